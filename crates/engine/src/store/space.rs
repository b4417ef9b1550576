//! Space classes and the reserve arithmetic (`docs/space.md`, "Reserves"), and the
//! statistics that report space.
//!
//! Invariant (liveness): every append of a class leaves the reserve of the classes below it
//! unused, counted in bytes of the log (free segments' capacity and the open segment's
//! room), so GC — and the checkpoints that free what it cleaned — can always run, and trim
//! works on a full store.

use std::sync::atomic::Ordering;

use super::capacity::{image_bytes, map_page_count, native_capacity_for};
use super::log::Log;
use super::op::{group_bytes, metadata_only, Op};
use super::state::{Inner, FRAGMENT_END_WASTE_BYTES};
use super::streams::{Stream, JUMP_RESERVE_BYTES};
use crate::error::{Error, ErrorKind};
use crate::format::{
    SegmentState, BATCH_ENTRY_BYTES, PI_BYTES, RECORD_MAC_BYTES, RECORD_MIN_BYTES, SUPERBLOCK_SLOT_BYTES,
};
use crate::map::DIRTY_PAGES_HARD;
use crate::stats::{Counters, Stats};
use crate::BLOCK_SIZE;

/// Who is asking for space: host writes may not eat into the reserve kept for GC and
/// checkpoints; metadata-only requests (trim, zero) may use most of it; GC and checkpoints
/// all of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpaceClass {
    Host,
    /// A host write that replaces more stored bytes than it adds: it frees space once GC
    /// runs, so it may use one segment of the reserve that other host writes may not.
    HostShrinking,
    HostMetadata,
    /// A trim or zero on a full store, after GC could not make the metadata reserve.
    TrimWhileFull,
    /// GC relocations out of a segment the reuse horizon has not passed: may use the
    /// reserve but must leave room for the two checkpoints that make it reusable.
    Gc,
    /// GC relocations out of a segment behind the horizon: it is reusable after one flush,
    /// so this may go further, keeping room for one checkpoint.
    GcSettled,
    Internal,
}

impl SpaceClass {
    /// Classes whose appends never wait for foreground GC: they fail at once when short.
    pub fn is_internal(self) -> bool {
        matches!(self, SpaceClass::Internal | SpaceClass::Gc | SpaceClass::GcSettled | SpaceClass::TrimWhileFull)
    }
}

impl Inner {
    /// Room one checkpoint takes in the log (see [`checkpoint_room_for`]), and the trained
    /// dictionaries it carries: up to 8 of up to 256 KiB, which the static bound does not
    /// know (native capacity does not count them: they come out of the bound's slack and
    /// the over-provisioning, docs/space.md, "Reserves").
    pub(crate) fn checkpoint_room_bytes(&self, _log: &Log) -> u64 {
        let dictionaries = self.dictionaries.read().table_bytes_max();
        checkpoint_room_for(
            self.logical_size_bytes.load(Ordering::Relaxed),
            self.geometry.segment_count,
            self.geometry.segment_capacity(),
        ) + dictionaries
    }

    /// The reserve of a class in bytes: what an append of that class must leave unused in
    /// the log (free segments and the open segment's room) for the classes below it.
    ///
    /// Each class leaves the ones below it room to work, down to GC, which leaves room for
    /// the checkpoints that make its victims reusable. The reserve is in bytes, not whole
    /// segments, and binds every append, even one that fits the open segment: GC must be
    /// able to relocate a victim into the last free segment and still have room for those
    /// checkpoints, or a store at GC's floor, with nothing cleaned, could never move again
    /// (it did: ENOSPC forever at 50% utilisation). See docs/space.md, "Reserves".
    pub(crate) fn reserve_bytes(&self, log: &Log, class: SpaceClass) -> u64 {
        let capacity = self.geometry.segment_capacity();
        let checkpoint = self.checkpoint_room_bytes(log);
        match class {
            SpaceClass::Host => host_reserve_for(capacity, checkpoint),
            SpaceClass::HostShrinking | SpaceClass::HostMetadata => capacity + 2 * checkpoint,
            // Trim and zero records are a fixed header each, and every one that unmaps data
            // makes garbage: they may go below the metadata reserve when GC cannot give it
            // back (trim must work on a full store), but leave GC a victim's worth of room.
            SpaceClass::TrimWhileFull => capacity / 8 + 2 * checkpoint,
            SpaceClass::Gc => 2 * checkpoint,
            SpaceClass::GcSettled => checkpoint,
            SpaceClass::Internal => 0,
        }
    }

    /// Publishes the free bytes above the host reserve for pacing (`host_slack_bytes`);
    /// called wherever they change (appends, freeing). Nothing reads them without pacing.
    pub(crate) fn publish_host_slack(&self, log: &Log) {
        if !self.options.pacing {
            return;
        }
        self.host_slack_bytes.store(self.host_slack(log), Ordering::Relaxed);
    }

    /// Bytes the log can take beyond the host reserve: what pacing's band and the GC
    /// streams' spare-segment rules (`streams.rs`) measure.
    pub(crate) fn host_slack(&self, log: &Log) -> u64 {
        self.available_bytes(log).saturating_sub(self.reserve_bytes(log, SpaceClass::Host))
    }

    /// The host reserve in whole segments, for the background worker's targets.
    pub(crate) fn host_reserve_segments(&self, log: &Log) -> u64 {
        self.reserve_bytes(log, SpaceClass::Host).div_ceil(self.geometry.segment_capacity())
    }

    /// Bytes the log can still take for any record: free segments and the host stream's
    /// open segment's room. (The cold stream's room takes only GC's output: it counts for
    /// that alone, see `shortfall_bytes`; a new cold segment is taken with room to spare.)
    pub(crate) fn available_bytes(&self, log: &Log) -> u64 {
        log.segments.free_count() as u64 * self.geometry.segment_capacity() + self.stream_room(log, Stream::Host) as u64
    }

    /// Bytes of the data area that hold no records: free and cleaned segments and the open
    /// segments' room.
    pub(crate) fn unused_bytes(&self, log: &Log) -> u64 {
        let empty = (log.segments.free_count() + log.segments.cleaned_count()) as u64;
        let open_room: usize = Stream::ALL.iter().map(|&stream| self.stream_room(log, stream)).sum();
        empty * self.geometry.segment_size_bytes + open_room as u64
    }

    /// How many bytes the log lacks for a group of ops of a class going to `stream` (0: it
    /// may be appended now).
    pub(crate) fn shortfall_bytes(&self, log: &Log, ops: &[Op], class: SpaceClass, stream: Stream) -> u64 {
        let mut bytes = group_bytes(ops, self.geometry.segment_capacity(), self.record_extra_bytes());
        // Fragments do not span segments, so a record carrying them may leave up to a block
        // unused at the open segment's end (a free segment's capacity already allows for
        // that); a trim or zero record is a fixed header and fits whenever its bytes do.
        let end_waste = if metadata_only(ops) { 0 } else { self.fragment_end_waste_bytes() };
        let mut available = self.available_bytes(log).saturating_sub(end_waste);
        if stream.is_gc() {
            // Its own room, which may leave a block's end unused too, and the jump into it
            // from the host stream.
            available += (self.stream_room(log, stream) as u64).saturating_sub(end_waste);
            bytes += JUMP_RESERVE_BYTES as u64;
        }
        (bytes + self.reserve_bytes(log, class)).saturating_sub(available)
    }

    /// Remembers that a host request was refused for lack of space (`space_flag` 2) until
    /// one succeeds again.
    pub(crate) fn note_no_space(&self, e: &Error) {
        if e.kind() == ErrorKind::NoSpace {
            self.space_exhausted.store(true, Ordering::Relaxed);
        }
    }

    pub(crate) fn stats(&self) -> Stats {
        let c = &self.counters;
        let log = self.log.lock();
        let segment_size = self.geometry.segment_size_bytes;
        let SegmentTotals { live, page_bytes, garbage, reclaimable } = segment_totals(&log.segments, segment_size);
        let open_room = log.appender.open_segments().map(|o| segment_size - o.append_offset_bytes as u64).sum::<u64>();
        let reserve = self.reserve_bytes(&log, SpaceClass::Host);
        let free_bytes = log.segments.free_count() as u64 * segment_size;
        let free_space = (free_bytes + reclaimable + open_room).saturating_sub(reserve);
        let physical_size = live + page_bytes + log.epochs.image_bytes * 2 + 2 * SUPERBLOCK_SLOT_BYTES as u64;
        let logical_size = (log.segments.counts.stored + log.segments.counts.zero) * BLOCK_SIZE as u64;
        let counts = log.segments.counts;
        let pending_recompress_bytes = log.pending.bytes();
        let segments_free = log.segments.free_count() as u64;
        drop(log);
        let map = self.map.read().stats();
        let findings = self.recovery.get();
        let damaged = self.degraded().is_some();
        let over_provision_ppm = self.over_provision_ppm.load(Ordering::Acquire);
        let native = native_capacity_for(
            self.geometry.segment_size_bytes,
            self.geometry.segment_count,
            over_provision_ppm,
            // (Not the cipher: a store read without its key has none.)
            self.geometry.encrypted,
            self.cold_stream,
        );
        let provisioned_cap = self.logical_size_bytes.load(Ordering::Acquire);
        let (state, state_reason) = self.state();
        let space_flag = self.space_flag(free_space, provisioned_cap > native.bytes, damaged);
        let host_write_bytes = Counters::get(&c.host_write_bytes);
        let backing_write_bytes = Counters::get(&c.backing_write_bytes);
        let (read_cache_hits, read_cache_misses, read_cache_bytes) = self.read_cache.counters();
        Stats {
            free_space,
            physical_size,
            logical_size,
            comp_ratio: ratio_or(logical_size, physical_size, logical_size == 0, 1.0),
            provisioned_cap,
            native_capacity: native.bytes,
            over_provision_percent: over_provision_ppm as f64 / 10_000.0,
            space_flag,
            host_write_bytes,
            host_read_bytes: Counters::get(&c.host_read_bytes),
            backing_write_bytes,
            write_amplification: ratio_or(backing_write_bytes, host_write_bytes, host_write_bytes == 0, 0.0),
            garbage_bytes: garbage,
            padding_bytes: Counters::get(&c.padding_bytes),
            metadata_bytes: Counters::get(&c.metadata_bytes),
            data_bytes: Counters::get(&c.data_bytes),
            codec: self.codec_stats(pending_recompress_bytes),
            checksum_errors: Counters::get(&c.checksum_errors),
            gc_bytes_moved: Counters::get(&c.gc_bytes_moved),
            gc_segments_cleaned: Counters::get(&c.gc_segments_cleaned),
            checkpoints: Counters::get(&c.checkpoints),
            read_ops: Counters::get(&c.read_ops),
            write_ops: Counters::get(&c.write_ops),
            trim_ops: Counters::get(&c.trim_ops),
            zero_ops: Counters::get(&c.zero_ops),
            flush_ops: Counters::get(&c.flush_ops),
            fua_ops: Counters::get(&c.fua_ops),
            backing_size_bytes: self.geometry.physical_size_bytes,
            segment_size_bytes: segment_size,
            segments_total: self.geometry.segment_count,
            segments_free,
            stored_blocks: counts.stored,
            zero_blocks: counts.zero,
            read_cache_hits,
            read_cache_misses,
            read_cache_bytes,
            damaged_records: findings.map_or(0, |f| f.damaged.len() as u64),
            damaged,
            state,
            state_reason,
            map_cache_bytes: map.cache_bytes,
            map_cache_budget_bytes: map.cache_budget_bytes,
            map_cached_pages: map.cached_pages,
            map_dirty_pages: map.dirty_pages,
            map_pending_changes: map.pending_changes,
            map_cache_hits: map.hits,
            map_cache_misses: map.misses,
            map_cache_hit_rate: ratio_or(map.hits, map.hits + map.misses, map.hits + map.misses == 0, 1.0),
            map_damaged_pages: map.damaged_pages,
            map_page_bytes: page_bytes,
            map_write_bytes: Counters::get(&self.map_write_bytes),
            gc_cold_bytes_moved: Counters::get(&self.gc_cold_bytes_moved),
            gc_colder_bytes_moved: Counters::get(&self.gc_colder_bytes_moved),
            host_backing_reads: Counters::get(&self.host_backing_reads),
            host_backing_read_bytes: Counters::get(&self.host_backing_read_bytes),
            host_reads_replanned: Counters::get(&self.host_reads_replanned),
            paced_writes: self.pacer.paced_writes(),
            paced_wait_ns: self.pacer.paced_wait_ns(),
        }
    }
}

impl Inner {
    /// Bytes a record of this store carries beyond a plain one: an encrypted store's MAC.
    pub(crate) fn record_extra_bytes(&self) -> u64 {
        if self.cipher.is_some() {
            RECORD_MAC_BYTES as u64
        } else {
            0
        }
    }

    /// `FRAGMENT_END_WASTE_BYTES` for this store: an encrypted one's largest fragment is
    /// larger by its seal, and its record by its MAC.
    pub(crate) fn fragment_end_waste_bytes(&self) -> u64 {
        match self.cipher {
            Some(ref c) => FRAGMENT_END_WASTE_BYTES + (c.fragment_overhead_bytes() + RECORD_MAC_BYTES) as u64,
            None => FRAGMENT_END_WASTE_BYTES,
        }
    }

    /// `space_flag`: 2 full (or damaged), 1 low, 0 normal. Only a `thin` store (provisioned
    /// above native capacity) warns of low space: one at or below native capacity cannot run
    /// out, however full; its low free space is the over-provisioning at work.
    fn space_flag(&self, free_space: u64, thin: bool, damaged: bool) -> u8 {
        // A full backing is the store full, whatever its own free space says.
        let backing_full = self.failure.get().is_some_and(|f| f.backing_full);
        if self.space_exhausted.load(Ordering::Relaxed) || free_space == 0 || damaged || backing_full {
            2
        } else if thin && (free_space as f64) < self.options.low_space_fraction * self.geometry.data_area_bytes() as f64
        {
            1
        } else {
            0
        }
    }

    /// Codec choices since open, and the dictionary table as it is now.
    /// The codec statistics, with `pending_recompress_bytes` read from the log's count.
    fn codec_stats(&self, pending_recompress_bytes: u64) -> crate::stats::CodecStats {
        let mut codec = self.codec_counters.snapshot();
        codec.pending_recompress_bytes = pending_recompress_bytes;
        codec.pending_recompress_saving_bytes = super::pending::recompress_saving_bytes(
            pending_recompress_bytes,
            Counters::get(&self.codec_counters.lz4_recompress_tried_bytes),
            Counters::get(&self.codec_counters.lz4_recompress_kept_bytes),
        );
        let dictionaries = self.dictionaries.read();
        codec.dictionary_count = dictionaries.table.len() as u64;
        codec.dictionary_bytes = dictionaries.table.iter().map(|d| d.bytes.len() as u64).sum();
        codec.dictionary_newest_id = dictionaries.newest.as_ref().map_or(0, |d| d.id as u64);
        codec
    }
}

/// The host reserve: room for GC to relocate a victim into a fresh segment and for the two
/// checkpoints that make it reusable (docs/space.md, "Reserves"). Native capacity leaves it
/// out of the data segments (`capacity.rs`).
pub(crate) fn host_reserve_for(segment_capacity_bytes: u64, checkpoint_room_bytes: u64) -> u64 {
    2 * segment_capacity_bytes + 2 * checkpoint_room_bytes
}

/// Room one checkpoint takes in the log, conservatively: the map pages it may rewrite — at
/// most the pages writers may dirty before they wait for a checkpoint, with their
/// ancestors, or every page of the map if that is fewer — each raw in the worst case; the
/// image (the segment table, uncompressed); and what each segment boundary it crosses may
/// waste.
pub(crate) fn checkpoint_room_for(logical_size_bytes: u64, segment_count: u64, segment_capacity_bytes: u64) -> u64 {
    let pages = map_page_count(logical_size_bytes).min(2 * DIRTY_PAGES_HARD as u64 + 8);
    let page_bytes = pages * (BLOCK_SIZE + PI_BYTES + BATCH_ENTRY_BYTES) as u64;
    let estimate = page_bytes + image_bytes(segment_count);
    estimate + (estimate / segment_capacity_bytes + 1) * (RECORD_MIN_BYTES as u64 + FRAGMENT_END_WASTE_BYTES)
}

/// What the segment table holds, summed for the statistics.
struct SegmentTotals {
    live: u64,
    page_bytes: u64,
    /// Dead bytes in sealed and open segments.
    garbage: u64,
    /// What cleaning would give back: cleaned segments, and sealed ones less what they hold.
    reclaimable: u64,
}

fn segment_totals(segments: &super::segments::SegmentTable, segment_size: u64) -> SegmentTotals {
    let mut t = SegmentTotals { live: 0, page_bytes: 0, garbage: 0, reclaimable: 0 };
    for (id, s) in segments.iter() {
        t.live += s.live_bytes;
        t.page_bytes += s.page_bytes;
        let held = s.live_bytes + s.page_bytes;
        match s.state {
            SegmentState::Sealed => {
                t.garbage += s.end_bytes.saturating_sub(held);
                if !segments.is_pinned(id) {
                    t.reclaimable += segment_size.saturating_sub(held);
                }
            }
            SegmentState::Open => t.garbage += s.end_bytes.saturating_sub(held),
            SegmentState::Cleaned => t.reclaimable += segment_size,
            SegmentState::Free => {}
        }
    }
    t
}

/// `numerator / denominator`, or `if_empty` when there is nothing to divide yet.
fn ratio_or(numerator: u64, denominator: u64, empty: bool, if_empty: f64) -> f64 {
    if empty {
        if_empty
    } else {
        numerator as f64 / denominator as f64
    }
}
