//! The store: the public [`Store`] API over the rooms below (see `docs/architecture.md`).
//!
//! | module | responsibility |
//! |---|---|
//! | `options` | what callers pass in and get back besides data |
//! | `create` | format, and reading a superblock without opening |
//! | `state` | `Inner`: the open store as a composition of the components below |
//! | `geometry` | the fixed facts of a store, segment buffers, the segment size rules |
//! | `health` | read-only, the first failure, what recovery found |
//! | `background` | the background threads' wake-ups, GC's locks |
//! | `codecs` | the dictionary table, codec counters and cores |
//! | `lock` | the lock order, written down and checked in debug and CI builds |
//! | `request` | read / write / trim / zero / block status |
//! | `read` | fetching and verifying blocks |
//! | `op` | the operations a record group carries |
//! | `space` | when host writers wait: pacing, permits, map memory, reserves, foreground GC |
//! | `capacity` | the arithmetic of space: checkpoint room, host reserve, native capacity |
//! | `log` | the log component: its state, lock and append (`LogGuard::append`) |
//! | `streams` | the log's streams and room |
//! | `apply` | the one rule for what a record does to the map |
//! | `segments` | the segment table and its state transitions |
//! | `writeout` | write-out, flush, the flush proof |
//! | `checkpoint` | checkpoints and the reuse rule |
//! | `pages` | map pages on the store: reading them, a checkpoint writing them |
//! | `gc` | victim choice, live collection, relocation |
//! | `pending` | the LZ4 fallback's live bytes, what recompression would take (statistics) |
//! | `dictionaries` | trained zstd dictionaries: training, installing, freeing |
//! | `worker` | the background threads |
//! | `recovery` | `recovery::open`: choose checkpoint, build, replay, settle, the open policy |
//! | `replay` | replaying the records after the checkpoint into the log's state |
//! | `scan` | reading records back from segment images |
//! | `check` | verifying the whole store |
//! | `statistics` | `Stats` |
//!
//! Invariants of the whole (asserted where cheap; `docs/guarantees.md` lists where each is
//! tested): map order is log order; a request is one record group, all-or-nothing across a
//! crash; records chain; no sector holding acknowledged data is written twice; a segment is
//! reused only under the reuse rule; a failed backing write or sync makes the store
//! read-only until reopened.

mod background;
pub(crate) mod capacity;
mod check;
mod checkpoint;
mod codecs;
mod create;
pub(crate) mod dictionaries;
mod encryption;
mod foreground_gc;
mod gc;
mod geometry;
mod health;
mod idle;
pub(crate) mod lock;
mod log;
pub(crate) mod options;
mod pages;
mod proof;
pub(crate) mod read;
pub(crate) mod read_queue;
mod recovery;
mod replay;
mod request;
mod scan;
mod segments;
mod space;
mod spare_cpu;
mod state;
mod statistics;
#[cfg(test)]
mod tests;
mod worker;
mod writeout;

pub use dictionaries::{DictionaryOptions, DictionaryReport, DICTIONARY_LEVEL_DEFAULT};
pub use encryption::KeyChange;
pub use gc::RecompressReport;
pub use options::{
    Allocation, CheckReport, DamageReport, Encryption, Extent, ExtentKind, FormatOptions, OpenOptions, Sealing,
    StoreInfo,
};
pub use read::{ReadDone, ReadPlan};
pub use read_queue::{ReadQueue, Reaped};
pub use request::Durability;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use lock::{Mutex, Rank};
use log::RangeKind;
use state::Inner;

use crate::backing::{self, Access, Backing, BackingOptions, Lock};
use crate::codec::Codec;
use crate::crypto::keys::SlotInfo;
use crate::crypto::Secret;
use crate::error::{Error, ErrorKind, Result};
use crate::stats::{Counters, Stats};
use crate::BLOCK_SIZE;

/// An open zdisk store. All request methods take `&self` and may be called from many
/// threads at once.
pub struct Store {
    inner: Arc<Inner>,
    /// The GC/checkpoint worker and the log writer (empty without `background`).
    workers: Vec<JoinHandle<()>>,
    closed: bool,
    /// Idle work's state for `idle_work_once` (the worker thread keeps its own). Ranked
    /// (`Rank::Idle`, below every lock a step of idle work takes).
    idle: Mutex<idle::IdleWork>,
}

impl Store {
    /// Formats `path` (created at the physical size if it does not exist).
    pub fn format(path: &Path, options: &FormatOptions) -> Result<StoreInfo> {
        create::format(path, options, &mut |_, _| {})
    }

    /// `format`, calling `progress(done, total)` as it writes the zeros of
    /// `Allocation::Zeroed` (bytes; nothing else takes long).
    pub fn format_with_progress(
        path: &Path,
        options: &FormatOptions,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<StoreInfo> {
        create::format(path, options, progress)
    }

    /// Formats an already opened backing store (its whole size).
    pub fn format_backing(backing: &dyn Backing, options: &FormatOptions) -> Result<StoreInfo> {
        create::format_backing(backing, options, &mut |_, _| {})
    }

    /// Reads the superblock without locking or recovering (works while the store is served).
    pub fn info(path: &Path) -> Result<StoreInfo> {
        create::info(path)
    }

    /// Changes the key slots of the encrypted store at `path` (closed: locked exclusively),
    /// which `current` must unlock. Only the key header is rewritten; returns the slots.
    pub fn change_keys(path: &Path, current: &Secret, change: KeyChange<'_>) -> Result<Vec<SlotInfo>> {
        encryption::change_keys(path, current, change)
    }

    /// The slot of the encrypted store at `path` that `secret` opens (`WrongKey` if none).
    pub fn slot_opened_by(path: &Path, secret: &Secret) -> Result<usize> {
        encryption::slot_opened_by(path, secret)
    }

    /// The key slots of the store at `path` (empty for a plain store); needs no key.
    pub fn key_slots(path: &Path) -> Result<Vec<SlotInfo>> {
        encryption::key_slots(path)
    }

    /// Opens and recovers the store at `path` (locked against other processes).
    pub fn open(path: &Path, options: &OpenOptions) -> Result<Store> {
        let (access, lock) =
            if options.read_only { (Access::ReadOnly, Lock::Shared) } else { (Access::ReadWrite, Lock::Exclusive) };
        let backing = backing::open(path, &BackingOptions { access, direct_io: options.direct_io, lock })?;
        Store::open_backing(Arc::new(backing), options)
    }

    /// The statistics of the closed store at `path` as its newest loadable checkpoint left
    /// them, without opening it: no key needed (an encrypted store's checkpoint is taken on
    /// its CRCs, its MAC unchecked), no record replayed, no map page read, nothing written.
    /// What `zdisk stat` shows for an encrypted store when no key is given.
    pub fn checkpoint_stats(path: &Path) -> Result<(StoreInfo, Stats)> {
        let options = OpenOptions { read_only: true, background: false, ..OpenOptions::default() };
        let backing =
            backing::open(path, &BackingOptions { access: Access::ReadOnly, direct_io: false, lock: Lock::Shared })?;
        Store::checkpoint_stats_of(Arc::new(backing), &options)
    }

    /// [`Store::checkpoint_stats`] on any backing (the simulator in tests).
    pub fn checkpoint_stats_of(backing: Arc<dyn Backing>, options: &OpenOptions) -> Result<(StoreInfo, Stats)> {
        recovery::checkpoint_stats(backing, options)
    }

    /// Opens and recovers a store on any backing (the simulator in tests).
    pub fn open_backing(backing: Arc<dyn Backing>, options: &OpenOptions) -> Result<Store> {
        let inner = Arc::new(recovery::open(backing, options)?);
        let writable = !options.read_only && inner.degraded().is_none();
        let workers = if options.background && writable { spawn_workers(&inner)? } else { Vec::new() };
        Ok(Store { inner, workers, closed: false, idle: Mutex::new(Rank::Idle, Default::default()) })
    }

    /// Changes the logical size: grow any time; shrink only if nothing is mapped past the
    /// new end. Persisted by a checkpoint before it returns.
    pub fn resize(&self, logical_size_bytes: u64) -> Result<()> {
        self.inner.health.check_writable()?;
        create::validate_logical_size(logical_size_bytes)?;
        {
            let _log = self.inner.log.lock();
            let new_blocks = logical_size_bytes / BLOCK_SIZE as u64;
            let old_blocks = self.inner.map.read().block_count();
            if new_blocks < old_blocks && self.inner.map.read().any_mapped_in(new_blocks, old_blocks, &*self.inner)? {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "cannot shrink to {logical_size_bytes} bytes: blocks beyond the new end hold data (trim them first)"
                    ),
                ));
            }
            self.inner.map.write().resize(new_blocks);
            self.inner.space.set_logical_size(logical_size_bytes);
        }
        self.inner.checkpoint_now()
    }

    /// Sets the over-provisioning (and with it the native capacity). Refused when the data
    /// stored now would not fit the new native capacity: the spare area it promises would
    /// not exist. The new setting is durable when this returns (a checkpoint writes it).
    pub fn set_over_provision(&self, over_provision_ppm: u32) -> Result<()> {
        self.inner.health.check_writable()?;
        create::validate_over_provision(over_provision_ppm)?;
        let geometry = &self.inner.geometry;
        let native = capacity::native_capacity_for(
            geometry.segment_size_bytes,
            geometry.segment_count,
            over_provision_ppm,
            geometry.encrypted,
            self.inner.log.cold_stream,
        );
        let stored = self.inner.stats().physical_size;
        if stored > native.bytes {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "cannot set over-provisioning to {}%: the store holds {stored} bytes, more than the {} bytes of native capacity it would leave (trim data first)",
                    over_provision_ppm as f64 / 10_000.0,
                    native.bytes
                ),
            ));
        }
        self.inner.checkpoint.lock().over_provision_ppm = over_provision_ppm;
        self.inner.space.over_provision_ppm.store(over_provision_ppm, Ordering::Release);
        self.inner.checkpoint_now()
    }

    pub fn info_of(&self) -> StoreInfo {
        let mut info = create::info_from(&self.inner.checkpoint.lock());
        info.logical_size_bytes = self.logical_size_bytes();
        info
    }

    pub fn logical_size_bytes(&self) -> u64 {
        self.inner.space.logical_size_bytes.load(Ordering::Acquire)
    }

    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.inner.read(offset, buf)
    }

    /// The first half of a read whose device reads the caller issues (`ReadQueue`): see
    /// [`ReadPlan`]. Then [`Store::finish_read`].
    pub fn plan_read(&self, offset: u64, len: usize) -> Result<ReadPlan> {
        self.inner.plan_read(offset, len)
    }

    /// Whether host writes may wait now, for GC's pacing or GC itself (free space is in
    /// the band where GC runs beside them): a front end serving writes on an event loop
    /// should then run them on threads of their own (no lock taken; a hint).
    pub fn host_writes_may_wait(&self) -> bool {
        self.inner.space.host_writes_may_wait()
    }

    /// Reads a plan's device reads here, synchronously (where no ring is available).
    pub fn read_planned(&self, plan: &mut ReadPlan) -> Result<()> {
        let mut reads: Vec<(u64, &mut [u8])> = plan.device_reads().collect();
        self.inner.backing.read_many(&mut reads).map_err(|e| Error::io("read of a planned range", e))
    }

    /// The second half of a planned read, once every one of `plan.device_reads()` filled
    /// its buffer: decodes and checks it.
    pub fn finish_read(&self, plan: ReadPlan) -> Result<ReadDone> {
        self.inner.finish_read(plan)
    }

    pub fn write(&self, offset: u64, data: &[u8], durability: Durability) -> Result<()> {
        self.inner.write(offset, data, durability)
    }

    pub fn trim(&self, offset: u64, length: u64, durability: Durability) -> Result<()> {
        self.inner.range_request(RangeKind::Trim, offset, length, durability)
    }

    pub fn write_zeroes(&self, offset: u64, length: u64, durability: Durability) -> Result<()> {
        self.inner.range_request(RangeKind::Zero, offset, length, durability)
    }

    pub fn flush(&self) -> Result<()> {
        Counters::add(&self.inner.counters.flush_ops, 1);
        self.inner.flush()
    }

    /// Allocation status of `[offset, offset+length)`, merged into runs.
    pub fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>> {
        self.inner.block_status(offset, length)
    }

    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// Verifies every record header and block checksum and the space accounting.
    /// `progress(done, total)` is called now and then.
    pub fn check(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<CheckReport> {
        self.inner.check(progress)
    }

    /// Runs garbage collection until no segment is worth cleaning or `segments_max` are
    /// cleaned; returns how many were cleaned. (The background thread does this on its own.)
    pub fn collect_garbage(&self, segments_max: usize) -> Result<usize> {
        self.inner.health.check_writable()?;
        let mut cleaned = 0;
        while cleaned < segments_max && self.inner.gc_once(gc::GcMode::Background)?.is_some() {
            cleaned += 1;
        }
        self.inner.free_cleaned()?;
        Ok(cleaned)
    }

    /// Moves every live fragment another codec made (the write path's LZ4 fallback) into
    /// the store's codec, or into `codec` when given (a stronger level of the same codec
    /// takes that codec's fragments too), to completion: GC's cleaning with recompression
    /// over every segment holding one, then two checkpoints and the freeing they allow.
    /// `progress(done, total)` counts segments.
    /// Without `codec`, a store that keeps a trained dictionary recompresses into its newest
    /// one instead (every compressed fragment not made with it).
    pub fn recompress(&self, codec: Option<Codec>, progress: &mut dyn FnMut(u64, u64)) -> Result<RecompressReport> {
        let configured = self.inner.geometry.codec;
        let target = match (codec, self.inner.newest_dictionary()) {
            (None, Some(dictionary)) => gc::RecompressTarget::dictionary(dictionary, false),
            (codec, _) => {
                gc::RecompressTarget::codec(codec.unwrap_or(configured), codec.is_some_and(|c| c != configured))
            }
        };
        let into_dictionary = target.dictionary.is_some();
        let mut report = self.inner.recompress(target, progress)?;
        if into_dictionary && !self.inner.free_unnamed_dictionaries()?.is_empty() {
            report.after = self.inner.stats();
        }
        Ok(report)
    }

    /// Trains a zstd dictionary on a sample of the store's own blocks, makes it durable, and
    /// recompresses every compressed fragment into it at `options.level` (`recompress` with
    /// a new dictionary); older dictionaries no fragment names any more are freed. The
    /// store is refused by zdisk versions without dictionaries from then on
    /// (docs/format.md, "Dictionaries"). `progress(done, total)` counts segments.
    pub fn recompress_with_new_dictionary(
        &self,
        options: &DictionaryOptions,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<RecompressReport> {
        self.inner.recompress_with_new_dictionary(options, progress)
    }

    /// One round of the background work (write-out, GC when space is short, a checkpoint
    /// when due), run on the calling thread. For tests that run without the background
    /// thread, so every backing I/O happens at a point they choose.
    #[doc(hidden)]
    pub fn maintain(&self) -> Result<()> {
        self.inner.health.check_writable()?;
        self.inner.background_step().map(|_| ())
    }

    /// Writes the log's whole sectors out without a flush (what the writer thread does
    /// between flushes): for tests that need unflushed records on the disk.
    #[doc(hidden)]
    pub fn write_out_unflushed(&self) -> Result<()> {
        self.inner.write_out(writeout::WriteOut::WholeSectors)
    }

    /// One step of idle work (`idle.rs`) now, however recently the host was here: for tests
    /// without the background threads (the crash model). Returns whether it did any.
    #[doc(hidden)]
    pub fn idle_work_once(&self) -> Result<bool> {
        self.inner.health.check_writable()?;
        self.inner.idle_work(&mut self.idle.lock())
    }

    /// Writes a checkpoint now (and frees segments it makes reusable).
    pub fn checkpoint(&self) -> Result<()> {
        self.inner.health.check_writable()?;
        self.inner.checkpoint_now()
    }

    /// Drops the store like a power cut would: no flush, no checkpoint; what was not yet
    /// durable is gone. For crash benchmarks and tests on real files.
    #[doc(hidden)]
    pub fn abandon(mut self) {
        self.closed = true;
        self.inner.health.failed.store(true, Ordering::Release);
        self.stop_workers();
    }

    /// Flushes and writes a checkpoint, so the next open replays nothing.
    pub fn close(mut self) -> Result<()> {
        self.shutdown()
    }

    fn stop_workers(&mut self) {
        {
            let mut signal = self.inner.background.wakeups.signal.lock();
            signal.stop = true;
            self.inner.background.wakeups.signal_cv.notify_all();
        }
        self.inner.background.wakeups.writer_cv.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }

    fn shutdown(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        self.stop_workers();
        if self.inner.health.read_only
            || self.inner.health.failed.load(Ordering::Acquire)
            || self.inner.degraded().is_some()
        {
            return Ok(());
        }
        self.inner.flush()?;
        self.inner.checkpoint_now()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::error!("closing the store: {e}");
        }
    }
}

/// A record as `sim::inspect` shows it to tests.
#[cfg(any(test, feature = "sim"))]
pub(crate) struct ScannedRecord {
    pub seq: u64,
    pub kind: u8,
    pub offset_bytes: u64,
    pub payload_offset_bytes: u64,
    pub payload_len: u32,
    pub end_bytes: u64,
    pub fragments: Vec<(u64, std::ops::Range<u64>)>,
    /// Map pages (map-pages records): page id tag and bytes.
    pub pages: Vec<(u64, std::ops::Range<u64>)>,
}

/// The records of one segment image (for `sim::inspect`).
#[cfg(any(test, feature = "sim"))]
pub(crate) fn scan_image(image: &[u8], base: u64, store_tag: u32) -> Vec<ScannedRecord> {
    let context = scan::RecordContext {
        store_tag,
        dictionaries: &crate::codec::NO_DICTIONARIES,
        cipher: None,
        use_of: &|_, _, _| crate::crypto::cipher::SegmentUse::default(),
    };
    let (records, _) = scan::parse_segment(image, base, &context);
    records
        .into_iter()
        .map(|r| {
            let mut at = r.payload_offset_bytes;
            let mut ranges: Vec<(u64, std::ops::Range<u64>)> = r
                .header
                .body
                .payload_fragments()
                .into_iter()
                .map(|(tag, f)| {
                    let range = at..at + f.stored_len as u64;
                    at = range.end;
                    (tag.0, range)
                })
                .collect();
            let is_pages = matches!(r.header.body, crate::format::RecordBody::MapPages { .. });
            let pages = if is_pages { std::mem::take(&mut ranges) } else { Vec::new() };
            let fragments = ranges;
            ScannedRecord {
                seq: r.header.seq,
                kind: r.header.kind() as u8,
                offset_bytes: r.offset_bytes,
                payload_offset_bytes: r.payload_offset_bytes,
                payload_len: r.header.payload_len,
                end_bytes: r.end_bytes,
                fragments,
                pages,
            }
        })
        .collect()
}

/// Starts the background worker (GC, checkpoints) and the log writer.
fn spawn_workers(inner: &Arc<Inner>) -> Result<Vec<JoinHandle<()>>> {
    let worker_inner = Arc::clone(inner);
    let worker = std::thread::Builder::new()
        .name("zdisk-worker".into())
        .spawn(move || worker_inner.worker_loop())
        .map_err(|e| Error::io("spawn worker", e))?;
    let writer_inner = Arc::clone(inner);
    let writer = std::thread::Builder::new()
        .name("zdisk-writer".into())
        .spawn(move || writer_inner.writer_loop())
        .map_err(|e| Error::io("spawn writer", e))?;
    Ok(vec![worker, writer])
}
