//! The state an open store shares between request threads and its background threads.
//!
//! Invariants:
//! - Every lock here has a rank; `lock.rs` writes down the order and checks it in debug
//!   builds.
//! - Once `failed` is set (a backing write or sync failed) it stays set: nothing is written
//!   any more, because no later flush could vouch for what the failed one lost.
//! - `durable_seq` only grows, and every record up to it is on stable media.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use aligned_vec::{AVec, ConstAlign};
use std::sync::Condvar;

use super::lock::{Mutex, RwLock};
use super::log::Log;
use super::options::OpenOptions;
use super::recovery::{Degraded, RecoveryFindings};
use crate::backing::Backing;
use crate::cache::FragmentCache;
use crate::codec::Codec;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{Superblock, DATA_START_BYTES};
use crate::map::PagedMap;
use crate::stats::{CodecCounters, Counters, StoreState};
use crate::types::SegmentId;
use crate::BLOCK_SIZE;

pub(crate) type AlignedBuf = AVec<u8, ConstAlign<4096>>;

pub(crate) fn new_buffer(size: usize) -> AlignedBuf {
    let mut buf = AVec::with_capacity(4096, size);
    buf.resize(size, 0);
    buf
}

pub(crate) fn round_up(value: u64, to: u64) -> u64 {
    value.div_ceil(to) * to
}

/// A record carrying fragments may leave this much of a segment's end unused: fragments
/// do not span segments, so one that does not fit starts the next segment. (The largest
/// fragment — a raw block and its protection information — a record's head and tail, and
/// an entry. An encrypted store's are larger by the seal and the record MAC:
/// `Inner::fragment_end_waste_bytes`; a segment's capacity, which leaves twice this, covers
/// that too.)
pub(crate) const FRAGMENT_END_WASTE_BYTES: u64 =
    (BLOCK_SIZE + crate::format::PI_BYTES + crate::format::RECORD_MIN_BYTES + crate::format::RELOCATE_ENTRY_BYTES)
        as u64;

/// Bytes a full segment of this size can hold for records, conservatively.
pub(crate) fn segment_capacity_of(segment_size_bytes: u64) -> u64 {
    segment_size_bytes - 2 * FRAGMENT_END_WASTE_BYTES
}

/// Why a store failed: the first backing write or sync that did.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub reason: String,
    /// The backing's file system (or device) was full (ENOSPC).
    pub backing_full: bool,
}

/// The fixed facts of an open store.
pub(crate) struct Geometry {
    pub store_tag: u32,
    pub segment_size_bytes: u64,
    pub segment_count: u64,
    pub physical_size_bytes: u64,
    pub codec: Codec,
    /// The superblock says the store is encrypted (its fragments carry a seal, which its
    /// native capacity counts) — known also when it is read without its key, where there
    /// is no cipher.
    pub encrypted: bool,
}

impl Geometry {
    pub fn segment_base(&self, segment: SegmentId) -> u64 {
        DATA_START_BYTES + segment.0 as u64 * self.segment_size_bytes
    }

    pub fn segment_of(&self, offset_bytes: u64) -> SegmentId {
        debug_assert!(offset_bytes >= DATA_START_BYTES);
        SegmentId(((offset_bytes - DATA_START_BYTES) / self.segment_size_bytes) as u32)
    }

    /// Whether a byte address lies in a segment (a jump record's target must).
    pub fn in_data_area(&self, offset_bytes: u64) -> bool {
        offset_bytes >= DATA_START_BYTES && offset_bytes < self.segment_base(SegmentId(self.segment_count as u32))
    }

    /// Bytes a full segment can hold for records, conservatively.
    pub fn segment_capacity(&self) -> u64 {
        segment_capacity_of(self.segment_size_bytes)
    }

    /// Bytes of all segments together.
    pub fn data_area_bytes(&self) -> u64 {
        self.segment_count * self.segment_size_bytes
    }
}

/// A segment's bytes while they may not all be on disk yet.
pub(crate) struct SegmentBuffer {
    pub segment: SegmentId,
    pub data: RwLock<AlignedBuf>,
}

/// The background threads' wake-up flags.
pub(crate) struct WorkerSignal {
    pub stop: bool,
    /// GC / checkpoint work may be due.
    pub kick: bool,
    /// Buffered log bytes are waiting to be written.
    pub kick_writer: bool,
}

pub(crate) struct Inner {
    pub backing: Arc<dyn Backing>,
    pub geometry: Geometry,
    pub options: OpenOptions,
    pub read_only: bool,
    /// Rank 6 (its tree, rank 7). Readers hold the read lock while they use entries;
    /// freeing a segment takes the write lock once as a barrier.
    pub map: RwLock<PagedMap>,
    /// Rank 5.
    pub log: Mutex<Log>,
    /// Rank 4: serialises backing writes of log data, so a flush knows every earlier write
    /// is done; holds what the last flush proof said (`proof.rs`).
    pub io: Mutex<super::proof::ProofState>,
    /// Rank 2: serialises checkpoints and holds the superblock of the newest durable one.
    pub checkpoint: Mutex<Superblock>,
    /// Rank 8: the segment buffers readers may find data in (the open segment and sealed
    /// ones not yet written out).
    pub buffered: RwLock<Vec<Arc<SegmentBuffer>>>,
    pub read_cache: FragmentCache,
    pub counters: Counters,
    /// Codec choices and recompression since open, and the fallback's load signal.
    pub codec_counters: CodecCounters,
    /// Cores the store's codec may keep busy before host writes fall back to LZ4
    /// (`OpenOptions::codec_cores`, checked at open, else `codec::default_codec_cores`).
    pub codec_cores: usize,
    /// Bytes of map pages appended since open (the map's share of write amplification;
    /// not persisted, unlike `counters`).
    pub map_write_bytes: AtomicU64,
    /// Bytes GC moved into the GC streams since open (not persisted).
    pub gc_cold_bytes_moved: AtomicU64,
    /// Of those, bytes GC moved into the colder stream.
    pub gc_colder_bytes_moved: AtomicU64,
    /// Backing reads (coalesced runs) for host reads, and their bytes, since open.
    pub host_backing_reads: AtomicU64,
    pub host_backing_read_bytes: AtomicU64,
    /// Asynchronous reads redone because a segment they read was freed meanwhile.
    pub host_reads_replanned: AtomicU64,
    pub failed: AtomicBool,
    /// Why the store failed (the first failure; set with `failed`).
    pub failure: std::sync::OnceLock<Failure>,
    /// A host request was refused for lack of space (`space_flag` 2) and none has
    /// succeeded since.
    pub space_exhausted: AtomicBool,
    /// Free bytes above the host reserve, as of the last change to the log's space (an
    /// append or a freeing; `Inner::publish_host_slack`): what pacing reads, so that a
    /// writer about to be paced does not take the log lock (docs/space.md, "Yielding
    /// locks").
    pub host_slack_bytes: AtomicU64,
    /// GC's output may go to the cold stream (`log.rs`, `Stream`): the store was formatted
    /// with it (superblock feature flag `FEATURE_LOG_JUMPS`; its native capacity counts the
    /// second open segment).
    pub cold_stream: bool,
    pub logical_size_bytes: AtomicU64,
    /// The over-provisioning the superblock records (`capacity.rs`; changed by
    /// `Store::set_over_provision`).
    pub over_provision_ppm: AtomicU32,
    pub durable_seq: AtomicU64,
    /// Rank 0: stripes serialising read-modify-write of partial blocks.
    pub block_locks: Vec<Mutex<()>>,
    /// Rank 10.
    pub signal: Mutex<WorkerSignal>,
    pub signal_cv: Condvar,
    pub writer_cv: Condvar,
    /// Rank 3: one GC victim at a time, and never while segments are freed.
    pub gc_lock: Mutex<()>,
    /// Rank 1: one foreground GC round at a time; `foreground_rounds` counts finished rounds.
    pub foreground_gc: Mutex<()>,
    pub foreground_rounds: AtomicU64,
    /// Host writes' pace against GC (no lock: atomics).
    pub pacer: super::pacing::Pacer,
    /// Host writes' CPU work, at most one per core at a time (`permits.rs`).
    pub write_permits: super::permits::WritePermits,
    /// The trained dictionaries (`dictionaries.rs`). Outside the lock order: held only to
    /// read or swap `Arc`s, never while taking another lock.
    pub dictionaries: parking_lot::RwLock<super::dictionaries::DictionaryState>,
    /// What recovery found damaged (set once, at open).
    pub recovery: OnceLock<RecoveryFindings>,
    /// An encrypted store's keys (`crypto/`): fragments are sealed after compression and
    /// opened before decompression; checkpoints carry a MAC.
    pub cipher: Option<Arc<crate::crypto::cipher::StoreCipher>>,
    /// Each segment's use, shared with the segment table (`SegmentTable::uses`): what an
    /// encrypted store's placement tags bind besides the address, read without the log lock.
    pub segment_uses: Arc<[super::segments::UseCell]>,
}

impl Inner {
    pub fn check_writable(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::new(ErrorKind::ReadOnly, "the store was opened read-only"));
        }
        if let Some(degraded) = self.degraded() {
            return Err(Error::new(
                ErrorKind::ReadOnly,
                format!(
                    "the store is damaged: records from {} on were lost, so it is open read-only (see `zdisk check`)",
                    degraded.first_lost_seq
                ),
            ));
        }
        if self.failed.load(Ordering::Acquire) {
            let failure = self.failure.get();
            if failure.is_some_and(|f| f.backing_full) {
                return Err(Error::new(
                    ErrorKind::BackingFull,
                    "an earlier backing write found its file system full; the store is read-only until reopened \
                     with room",
                ));
            }
            return Err(Error::new(
                ErrorKind::ReadOnly,
                "an earlier backing write or sync failed; the store is read-only until reopened",
            ));
        }
        Ok(())
    }

    /// Set when recovery lost records and the caller did not accept the loss: the store is
    /// read-only and blocks not provably newer than the loss read as EIO.
    pub fn degraded(&self) -> Option<&Degraded> {
        if self.options.accept_data_loss {
            return None;
        }
        self.recovery.get().and_then(|r| r.degraded.as_ref())
    }

    /// Makes the store read-only after a backing write or sync failed; returns the error.
    pub fn fail(&self, e: Error) -> Error {
        let first = self.failure.set(Failure { reason: e.to_string(), backing_full: e.kind() == ErrorKind::NoSpace });
        self.failed.store(true, Ordering::Release);
        if first.is_ok() {
            tracing::error!("backing I/O failed, store is now read-only: {e}");
        }
        e
    }

    /// What the store is now, and why when not `Ok` (`Stats::state`).
    pub fn state(&self) -> (StoreState, String) {
        if let Some(failure) = self.failure.get() {
            return (StoreState::Failed, failure.reason.clone());
        }
        if let Some(degraded) = self.degraded() {
            let why = format!("recovery lost records from {} on (see `zdisk check`)", degraded.first_lost_seq);
            return (StoreState::Degraded, why);
        }
        if self.read_only {
            return (StoreState::ReadOnly, "opened read-only".to_string());
        }
        (StoreState::Ok, String::new())
    }

    pub fn kick_worker(&self) {
        let mut signal = self.signal.lock();
        signal.kick = true;
        self.signal_cv.notify_one();
    }

    pub fn kick_writer(&self) {
        let mut signal = self.signal.lock();
        signal.kick_writer = true;
        self.writer_cv.notify_one();
    }

    /// Segments whose bytes may still be only in memory: GC and freeing leave them be.
    pub fn unwritten_segments(&self) -> Vec<SegmentId> {
        self.buffered.read().iter().map(|b| b.segment).collect()
    }
}
