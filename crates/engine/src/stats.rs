//! Statistics, named after the drive's capacity-stat file (see DESIGN.md and docs/format.md).
//! Counters live in [`Counters`] (atomics, updated on the hot path without locks); a
//! [`Stats`] is a snapshot computed from them plus the space accounting.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// What a store is now, for an operator (`Stats::state`; docs/guarantees.md, "States").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreState {
    /// Serving reads and writes.
    #[default]
    Ok,
    /// Recovery lost records: read-only, blocks not provably newer than the loss read as
    /// EIO (`zdisk check` lists the damage).
    Degraded,
    /// Opened read-only.
    ReadOnly,
    /// A backing write or sync failed (the backing's file system full, an I/O error): the
    /// store takes no more writes until reopened; what was acknowledged and flushed before
    /// is on the backing.
    Failed,
}

impl StoreState {
    pub fn name(self) -> &'static str {
        match self {
            StoreState::Ok => "ok",
            StoreState::Degraded => "degraded",
            StoreState::ReadOnly => "read_only",
            StoreState::Failed => "failed",
        }
    }
}

/// The statistics that only grow while a store is open, beyond the persisted counters
/// (`format::COUNTER_ORDER`): with those, the counters (`is_counter_stat`).
const MORE_COUNTER_STATS: &[&str] = &[
    "read_cache_hits",
    "read_cache_misses",
    "map_cache_hits",
    "map_cache_misses",
    "map_damaged_pages",
    "map_write_bytes",
    "gc_cold_bytes_moved",
    "gc_colder_bytes_moved",
    "host_backing_reads",
    "host_backing_read_bytes",
    "host_reads_replanned",
    "flushes_written_through",
    "paced_writes",
    "paced_wait_ns",
    "blocks_written_raw",
    "blocks_written_lz4",
    "blocks_written_zstd",
    "blocks_written_deflate",
    "codec_fallback_blocks",
    "incompressible_skipped_blocks",
    "uncompressed_tier_blocks",
    "helper_compressed_blocks",
    "recompressed_fragments",
    "recompress_saved_bytes",
    "recompress_cpu_ns",
    "recompressed_fragments_dictionary",
    "dictionaries_trained_idle",
    "idle_segments_recompressed",
    "idle_room_steps",
];

/// Whether the statistic `name` only grows while a store is open: a counter (Prometheus
/// exports it as `zdisk_<name>_total`, typed `counter`); every other one is a gauge.
pub fn is_counter_stat(name: &str) -> bool {
    crate::format::COUNTER_ORDER.contains(&name) || MORE_COUNTER_STATS.contains(&name)
}

/// A snapshot of the store's statistics. Every size is in bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Backing bytes still available for new data (free segments plus reclaimable garbage),
    /// less the reserve kept for GC and checkpoints.
    pub free_space: u64,
    /// Backing bytes holding live data and metadata (what GC cannot reclaim).
    pub physical_size: u64,
    /// Logical bytes written and not trimmed (zero blocks count).
    pub logical_size: u64,
    /// `logical_size / physical_size` (1.0 when nothing is stored).
    pub comp_ratio: f64,
    /// The logical capacity the client sees.
    pub provisioned_cap: u64,
    /// The logical bytes incompressible data can always fill and overwrite without ENOSPC
    /// (the data area less reserves, metadata at its worst and the over-provisioning).
    /// Capacity provisioned above it holds only as long as data compresses.
    #[serde(default)]
    pub native_capacity: u64,
    /// Share of the data area kept spare beyond native capacity, in percent.
    #[serde(default)]
    pub over_provision_percent: f64,
    /// 0 normal, 1 low (free space under the low watermark on a store provisioned above its
    /// native capacity), 2 full (writes get ENOSPC).
    pub space_flag: u8,
    pub host_write_bytes: u64,
    pub host_read_bytes: u64,
    /// Everything written to the backing store: data, GC copies, metadata, padding.
    pub backing_write_bytes: u64,
    /// `backing_write_bytes / host_write_bytes` (0 before any host write).
    pub write_amplification: f64,
    /// Bytes in used segments that no map entry references any more.
    pub garbage_bytes: u64,
    /// Bytes written only to fill a sector or the end of a segment.
    pub padding_bytes: u64,
    /// Record headers, checkpoints and superblocks written.
    pub metadata_bytes: u64,
    /// Stored (compressed) fragment bytes written for host writes, excluding GC copies.
    pub data_bytes: u64,
    pub checksum_errors: u64,
    pub gc_bytes_moved: u64,
    pub gc_segments_cleaned: u64,
    pub checkpoints: u64,
    pub read_ops: u64,
    pub write_ops: u64,
    pub trim_ops: u64,
    pub zero_ops: u64,
    /// `Store::flush` calls: a front end may answer several flush requests with one (the
    /// native server does, docs/nbd.md), so this can be below the clients' flush count.
    pub flush_ops: u64,
    pub fua_ops: u64,
    /// Size of the backing store.
    pub backing_size_bytes: u64,
    pub segment_size_bytes: u64,
    pub segments_total: u64,
    pub segments_free: u64,
    /// Blocks that hold stored (non-zero) data.
    pub stored_blocks: u64,
    /// Blocks written as zeroes (they cost no data).
    pub zero_blocks: u64,
    /// Fragment reads the read cache answered, since the store was opened.
    #[serde(default)]
    pub read_cache_hits: u64,
    /// Fragment reads that went to the backing store, since the store was opened.
    #[serde(default)]
    pub read_cache_misses: u64,
    /// Memory the read cache holds (compressed fragments plus bookkeeping).
    #[serde(default)]
    pub read_cache_bytes: u64,
    /// Records recovery found damaged (applied from a surviving copy, or lost).
    #[serde(default)]
    pub damaged_records: u64,
    /// Recovery lost records: the store is read-only and blocks not provably newer than
    /// the loss read as EIO (`zdisk check` lists the damage).
    #[serde(default)]
    pub damaged: bool,
    /// What the store is now (`ok`, `degraded`, `read_only`, `failed`) and why, when not ok.
    #[serde(default)]
    pub state: StoreState,
    #[serde(default)]
    pub state_reason: String,
    /// Memory the block map holds now (cached pages, page states, changes not yet
    /// checkpointed), and the budget it keeps to (`--map-cache`).
    #[serde(default)]
    pub map_cache_bytes: u64,
    #[serde(default)]
    pub map_cache_budget_bytes: u64,
    /// Map pages cached in memory.
    #[serde(default)]
    pub map_cached_pages: u64,
    /// Map pages with changes the next checkpoint writes.
    #[serde(default)]
    pub map_dirty_pages: u64,
    /// Changes to map slots not yet in a written page.
    #[serde(default)]
    pub map_pending_changes: u64,
    /// Map lookups answered from memory, and map page reads from the store, since open.
    #[serde(default)]
    pub map_cache_hits: u64,
    #[serde(default)]
    pub map_cache_misses: u64,
    /// `hits / (hits + misses)` (1.0 before any lookup).
    #[serde(default)]
    pub map_cache_hit_rate: f64,
    /// Map pages that failed their checksum since open (the blocks they map read as EIO).
    #[serde(default)]
    pub map_damaged_pages: u64,
    /// Backing bytes the map's pages take (retained checkpoints' pages).
    #[serde(default)]
    pub map_page_bytes: u64,
    /// Bytes of map pages written since open (part of `backing_write_bytes`).
    #[serde(default)]
    pub map_write_bytes: u64,
    /// Of `gc_bytes_moved`, the bytes GC moved into the GC streams' segments (cold and
    /// colder) since open (the rest shared the host stream's: the store was near full, or
    /// formatted before the cold stream; docs/space.md, "Hot and cold").
    #[serde(default)]
    pub gc_cold_bytes_moved: u64,
    /// Of `gc_cold_bytes_moved`, the bytes of data GC had moved before, into the colder
    /// stream's segments since open (docs/space.md, "A second cold stream").
    #[serde(default)]
    pub gc_colder_bytes_moved: u64,
    /// Backing reads host reads needed since open (after coalescing: fragments whose
    /// sectors touch are one read), and their bytes. Per `read_ops`, how scattered the
    /// data a client reads lies on the backing; per `host_read_bytes`, what compression
    /// saves the disk.
    #[serde(default)]
    pub host_backing_reads: u64,
    #[serde(default)]
    pub host_backing_read_bytes: u64,
    /// Host reads planned for an asynchronous front end whose segment was freed before
    /// the device read finished, read again synchronously (`Store::finish_read`).
    #[serde(default)]
    pub host_reads_replanned: u64,
    /// Flushes since open (of `flush_ops` and the engine's own) whose only unsynced data was
    /// their own range, written through (RWF_DSYNC) instead of written and synced: a device
    /// round trip saved each (docs/format.md, "Flush proof").
    #[serde(default)]
    pub flushes_written_through: u64,
    /// Host writes paced against GC since open (docs/space.md, "Pacing"), and their
    /// total wait.
    #[serde(default)]
    pub paced_writes: u64,
    #[serde(default)]
    pub paced_wait_ns: u64,
    /// Which codecs made the fragments written since open, and what recompression did.
    #[serde(flatten)]
    pub codec: CodecStats,
}

/// Codec choices since the store was opened (not persisted: the checkpoint's counter list
/// is part of the format). Zero blocks are not compressed and not counted.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CodecStats {
    /// Host blocks stored raw (no codec saved `MIN_SAVING_BYTES`), and by each codec.
    #[serde(default)]
    pub blocks_written_raw: u64,
    #[serde(default)]
    pub blocks_written_lz4: u64,
    #[serde(default)]
    pub blocks_written_zstd: u64,
    #[serde(default)]
    pub blocks_written_deflate: u64,
    /// Host blocks compressed with LZ4 instead of the store's slower codec because every
    /// core was already compressing (the adaptive fallback; counted whatever LZ4 then made
    /// of them, raw included).
    #[serde(default)]
    pub codec_fallback_blocks: u64,
    /// Of `blocks_written_raw`, the host blocks stored raw without running the store's codec
    /// because they looked incompressible (`codec::skips_codec`), or — under the LZ4
    /// fallback — followed a block of their request LZ4 could not shrink (docs/space.md,
    /// "Incompressible data").
    #[serde(default)]
    pub incompressible_skipped_blocks: u64,
    /// Host blocks stored uncompressed for now (an LZ4 block of literals, counted in
    /// `blocks_written_lz4` and `codec_fallback_blocks` too) because every core was busy
    /// and the disk idled (`codec::write_choice`, `CodecFallback::AutoUncompressed` or
    /// `Uncompressed` only); recompression takes them.
    #[serde(default)]
    pub uncompressed_tier_blocks: u64,
    /// Host blocks compressed by a helper thread beside their writer: runs of a large
    /// request shared out while `--codec-cores` had cores to spare (`Inner::compress_blocks`).
    #[serde(default)]
    pub helper_compressed_blocks: u64,
    /// Stored bytes of the live LZ4 fragments written since open in a store of a slower
    /// codec: what the fallback left for idle work, GC or `zdisk recompress` to recompress
    /// (`PendingRecompress` in `store/segments.rs`; fragments from before the open are not
    /// counted). Between checkpoints an upper bound (overwrites may still owe their
    /// removal), exact after each.
    #[serde(default)]
    pub pending_recompress_bytes: u64,
    /// The bytes recompressing them is expected to free: at the share recompression saved
    /// on the LZ4 fragments it tried since open, once it tried 1 MiB, else at 21% (the least
    /// zstd:1 saved against LZ4 on the measured corpora). An estimate.
    #[serde(default)]
    pub pending_recompress_saving_bytes: u64,
    /// Fragments GC (or `recompress`) moved recompressed with the store's codec.
    #[serde(default)]
    pub recompressed_fragments: u64,
    /// Stored bytes those recompressions saved (old fragments' length less new ones').
    #[serde(default)]
    pub recompress_saved_bytes: u64,
    /// Thread CPU time spent decompressing, checking and recompressing them.
    #[serde(default)]
    pub recompress_cpu_ns: u64,
    /// Of `recompressed_fragments`, those recompressed with a trained dictionary.
    #[serde(default)]
    pub recompressed_fragments_dictionary: u64,
    /// Dictionaries the store keeps (the checkpoint's table), their bytes, and the id of
    /// the one GC compresses with (0: none).
    #[serde(default)]
    pub dictionary_count: u64,
    #[serde(default)]
    pub dictionary_bytes: u64,
    #[serde(default)]
    pub dictionary_newest_id: u64,
    /// Dictionaries the store trained on its own while idle, and segments idle work
    /// recompressed (`store/idle.rs`), since open.
    #[serde(default)]
    pub dictionaries_trained_idle: u64,
    #[serde(default)]
    pub idle_segments_recompressed: u64,
    /// Steps idle work spent making room for itself on a store whose free space sat at
    /// GC's cushion: a victim cleaned, or the checkpoints that freed what it cleaned.
    #[serde(default)]
    pub idle_room_steps: u64,
}

/// The log's statistics since open (not persisted, unlike [`Counters`]).
#[derive(Debug, Default)]
pub struct LogCounters {
    /// Bytes of map pages appended (the map's share of write amplification).
    pub map_write_bytes: AtomicU64,
    /// Bytes GC moved into the GC streams, and of those into the colder stream.
    pub gc_cold_bytes_moved: AtomicU64,
    pub gc_colder_bytes_moved: AtomicU64,
    /// Flushes that wrote their one range through instead of syncing (`store/writeout.rs`).
    pub flushes_written_through: AtomicU64,
}

/// The live counters behind [`CodecStats`], and the load signal of the adaptive fallback.
#[derive(Debug, Default)]
pub struct CodecCounters {
    /// Threads inside block compression now (the fallback's load signal, `codec.rs`).
    pub compressing: std::sync::atomic::AtomicUsize,
    pub blocks_written: [AtomicU64; 4],
    pub fallback_blocks: AtomicU64,
    pub incompressible_skipped_blocks: AtomicU64,
    pub uncompressed_tier_blocks: AtomicU64,
    pub helper_compressed_blocks: AtomicU64,
    /// LZ4 fragments' bytes recompression tried since open, and what they became (a fragment
    /// not made smaller counts whole): the measured share `pending_recompress_saving_bytes`
    /// is estimated at.
    pub lz4_recompress_tried_bytes: AtomicU64,
    pub lz4_recompress_kept_bytes: AtomicU64,
    pub recompressed_fragments: AtomicU64,
    pub recompress_saved_bytes: AtomicU64,
    pub recompress_cpu_ns: AtomicU64,
    pub recompressed_fragments_dictionary: AtomicU64,
    /// Fragments naming an older dictionary than the newest that GC moved without
    /// recompressing them (damaged ones): while it does not move, a recompression may free
    /// the older dictionaries (`store/dictionaries.rs`).
    pub older_dictionary_fragments_kept: AtomicU64,
    pub dictionaries_trained_idle: AtomicU64,
    pub idle_segments_recompressed: AtomicU64,
    pub idle_room_steps: AtomicU64,
    /// Blocks without a dictionary that recompression compressed with the newest one (kept
    /// or not), and the fragment bytes it made of them: idle work's retraining signal.
    pub dictionary_trial_blocks: AtomicU64,
    pub dictionary_trial_bytes: AtomicU64,
}

/// Counts the calling thread as inside block compression (the fallback's load signal) until
/// dropped — also when the compression panics, so the signal never stays high.
pub struct Compressing<'a>(&'a std::sync::atomic::AtomicUsize);

impl Compressing<'_> {
    /// Enters; returns the guard and how many threads were compressing before this one.
    pub fn enter(counter: &std::sync::atomic::AtomicUsize) -> (Compressing<'_>, usize) {
        (Compressing(counter), counter.fetch_add(1, Ordering::Relaxed))
    }
}

impl Drop for Compressing<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl CodecCounters {
    pub fn snapshot(&self) -> CodecStats {
        let get = Counters::get;
        CodecStats {
            blocks_written_raw: get(&self.blocks_written[0]),
            blocks_written_lz4: get(&self.blocks_written[1]),
            blocks_written_zstd: get(&self.blocks_written[2]),
            blocks_written_deflate: get(&self.blocks_written[3]),
            codec_fallback_blocks: get(&self.fallback_blocks),
            incompressible_skipped_blocks: get(&self.incompressible_skipped_blocks),
            uncompressed_tier_blocks: get(&self.uncompressed_tier_blocks),
            helper_compressed_blocks: get(&self.helper_compressed_blocks),
            // (Filled in by the store, which holds the log's count.)
            pending_recompress_bytes: 0,
            pending_recompress_saving_bytes: 0,
            recompressed_fragments: get(&self.recompressed_fragments),
            recompress_saved_bytes: get(&self.recompress_saved_bytes),
            recompress_cpu_ns: get(&self.recompress_cpu_ns),
            recompressed_fragments_dictionary: get(&self.recompressed_fragments_dictionary),
            // (The table's figures are filled in by the store, which holds the table.)
            dictionary_count: 0,
            dictionary_bytes: 0,
            dictionary_newest_id: 0,
            dictionaries_trained_idle: get(&self.dictionaries_trained_idle),
            idle_segments_recompressed: get(&self.idle_segments_recompressed),
            idle_room_steps: get(&self.idle_room_steps),
        }
    }
}

/// CPU time this thread has run, in nanoseconds (what recompression costs, without the
/// time it waited for a core).
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Monotonic counters kept live; persisted in each checkpoint so totals survive restarts.
#[derive(Debug, Default)]
pub struct Counters {
    pub host_write_bytes: AtomicU64,
    pub host_read_bytes: AtomicU64,
    pub backing_write_bytes: AtomicU64,
    pub padding_bytes: AtomicU64,
    pub metadata_bytes: AtomicU64,
    pub data_bytes: AtomicU64,
    pub checksum_errors: AtomicU64,
    pub gc_bytes_moved: AtomicU64,
    pub gc_segments_cleaned: AtomicU64,
    pub checkpoints: AtomicU64,
    pub read_ops: AtomicU64,
    pub write_ops: AtomicU64,
    pub trim_ops: AtomicU64,
    pub zero_ops: AtomicU64,
    pub flush_ops: AtomicU64,
    pub fua_ops: AtomicU64,
}

/// The persisted form of [`Counters`]: the values in the checkpoint's order
/// (`format::COUNTER_ORDER`, which `docs/format.md` lists).
pub const COUNTER_COUNT: usize = crate::format::COUNTER_ORDER.len();

impl Counters {
    /// Every counter with its name, in checkpoint order.
    fn all(&self) -> [(&'static str, &AtomicU64); COUNTER_COUNT] {
        [
            ("host_write_bytes", &self.host_write_bytes),
            ("host_read_bytes", &self.host_read_bytes),
            ("backing_write_bytes", &self.backing_write_bytes),
            ("padding_bytes", &self.padding_bytes),
            ("metadata_bytes", &self.metadata_bytes),
            ("data_bytes", &self.data_bytes),
            ("checksum_errors", &self.checksum_errors),
            ("gc_bytes_moved", &self.gc_bytes_moved),
            ("gc_segments_cleaned", &self.gc_segments_cleaned),
            ("checkpoints", &self.checkpoints),
            ("read_ops", &self.read_ops),
            ("write_ops", &self.write_ops),
            ("trim_ops", &self.trim_ops),
            ("zero_ops", &self.zero_ops),
            ("flush_ops", &self.flush_ops),
            ("fua_ops", &self.fua_ops),
        ]
    }

    pub fn to_array(&self) -> [u64; COUNTER_COUNT] {
        self.all().map(|(_, c)| c.load(Ordering::Relaxed))
    }

    pub fn from_array(values: &[u64; COUNTER_COUNT]) -> Counters {
        let counters = Counters::default();
        for ((_, counter), value) in counters.all().into_iter().zip(values) {
            counter.store(*value, Ordering::Relaxed);
        }
        counters
    }

    pub fn add(counter: &AtomicU64, value: u64) {
        counter.fetch_add(value, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checkpoint's counter order is part of the format: the list here must be it.
    #[test]
    fn counters_persist_in_the_documented_order() {
        let names = Counters::default().all().map(|(name, _)| name);
        assert_eq!(names, crate::format::COUNTER_ORDER);
    }

    /// Every counter named is a statistic (a misspelt name would export nothing).
    #[test]
    fn every_counter_is_a_statistic() {
        let serde_json::Value::Object(fields) = serde_json::to_value(Stats::default()).unwrap() else {
            panic!("statistics are an object")
        };
        for name in crate::format::COUNTER_ORDER.iter().chain(MORE_COUNTER_STATS) {
            assert!(is_counter_stat(name));
            assert!(fields.get(*name).is_some_and(|v| v.is_u64()), "{name} is not a numeric statistic");
        }
    }
}
