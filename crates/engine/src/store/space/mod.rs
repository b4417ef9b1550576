//! Space: when host writers wait, and for what. One room answers it; in the order a host
//! write meets them (`request.rs`, `Inner::write`; a trim or write-zeroes from 2 on):
//!
//! 1. **Pacing** (`pacing.rs`, [`Space::pace_host_write`]): once the free space above the
//!    host reserve is in the pacing band (the background worker's cushion, where GC runs
//!    beside host writes) and GC's cost is measured, the write sleeps for its slot on one
//!    shared clock — at most 100 ms, holding no lock and no permit. Never a refusal.
//! 2. **A write permit** (`permits.rs`, [`Space::write_permits`]): at most one host write per
//!    core compresses and appends at a time; the others sleep, in order once one is
//!    overdue. Taken before any lock of the order; held through everything below, given
//!    back before a FUA write waits for the disk.
//! 3. **Block stripes** ([`Space::block_locks`], rank 1): a write that read-modify-writes a
//!    partial block holds its stripe while it reads, merges and appends it.
//! 4. **Map memory** (`admit.rs`, `wait_for_map_memory`): when the map's unwritten changes
//!    reached their memory limit (the background checkpoint fell behind, or there is no
//!    background thread), the writer writes the checkpoint itself before it adds more.
//! 5. **Reserves, foreground GC, ENOSPC** (`admit.rs`, `Inner::admit`): an append of a class
//!    ([`SpaceClass`]) must leave the [`Reserves`] of the classes below it unused in the log.
//!    A host request that does not fit runs foreground GC rounds (one writer at a time; the
//!    others wait for it) and tries again while they make progress; then a trim or zero may
//!    go below the metadata reserve (`SpaceClass::TrimWhileFull`), and anything else fails
//!    with ENOSPC, having changed nothing.
//!
//! GC and checkpoints never wait here: they append with `Inner::try_append` and fail at once
//! when short, so GC never waits on GC.
//!
//! Besides the waits, Space keeps what they are computed from: the logical size, the
//! over-provisioning the superblock records, the free bytes above the host reserve as of the
//! last change (what pacing reads without the log lock), and the reserves as of now.
//!
//! Invariants:
//! - The cached reserves equal the reserves computed afresh from the logical size and the
//!   dictionary table's bytes (`Reserves::compute`): they are recomputed whenever either
//!   changes (`set_logical_size`: resize; `set_dictionary_table_bytes`: a dictionary
//!   installed or freed) under the lock that holds them, and `Inner::reserves` asserts it in
//!   debug builds. (Nothing else they depend on changes while the store is open: the
//!   segment count and capacity are the geometry's; the over-provisioning does not enter
//!   them.)
//! - `host_slack_bytes` is only published while pacing is on; pacing reads nothing else.
//! - Reserves bind every append, of every class, even one that fits the open segment
//!   (docs/space.md, "Reserves").
//!
//! The arithmetic with no state — the checkpoint room, native capacity, image sizing — is
//! `capacity.rs`'s.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use super::capacity::{checkpoint_room_for, host_reserve_for};
use super::lock::{lock_unranked, Mutex, Rank};
use crate::error::{Error, ErrorKind};

pub(crate) mod admit;
pub(crate) mod pacing;
pub(crate) mod permits;

use pacing::Pacer;
use permits::WritePermits;

/// Stripes of the partial-block locks (by LBA).
pub(crate) const BLOCK_LOCK_STRIPES: usize = 1024;

pub(crate) struct Space {
    /// Rank 1: stripes serialising read-modify-write of partial blocks.
    pub block_locks: Vec<Mutex<()>>,
    /// Host writes' CPU work, at most one per core at a time (`permits.rs`).
    pub write_permits: WritePermits,
    /// Host writes' pace against GC (no lock: atomics).
    pub pacer: Pacer,
    /// Whether pacing is on (`OpenOptions::pacing`): nothing reads `host_slack_bytes`
    /// otherwise.
    pacing: bool,
    /// Free segments the background worker keeps above the host reserve; with pacing on,
    /// the pacing band (`pacing::cushion_segments`).
    cushion_segments: u64,
    /// The pacing band in bytes of the log: `cushion_segments` segments' capacity.
    pacing_band_bytes: u64,
    /// Free bytes above the host reserve, as of the last change to the log's space (an
    /// append or a freeing; `publish_host_slack`): what pacing reads, so that a writer
    /// about to be paced does not take the log lock (docs/space.md, "Yielding locks").
    pub host_slack_bytes: AtomicU64,
    /// A host request was refused for lack of space (`space_flag` 2) and none has
    /// succeeded since.
    pub exhausted: AtomicBool,
    /// Changed only by `set_logical_size` (the reserves depend on it).
    pub logical_size_bytes: AtomicU64,
    /// The over-provisioning the superblock records (`capacity.rs`; changed by
    /// `Store::set_over_provision`).
    pub over_provision_ppm: AtomicU32,
    /// The reserves as of now, and what they were computed from. Outside the lock order
    /// (like the permits' mutex): held only to copy or recompute them, never while another
    /// lock is taken.
    reserves: std::sync::Mutex<CachedReserves>,
    segment_count: u64,
    segment_capacity_bytes: u64,
}

/// What a store's space starts from at open.
pub(crate) struct SpaceParts {
    pub write_concurrency: usize,
    /// `OpenOptions::write_permit_fair_after` (`permits.rs`).
    pub write_permit_fair_after: std::time::Duration,
    pub pacing: bool,
    pub logical_size_bytes: u64,
    pub over_provision_ppm: u32,
    /// Bytes the dictionary table takes in a checkpoint, at most
    /// (`DictionaryState::table_bytes_max`).
    pub dictionary_table_bytes: u64,
    pub segment_count: u64,
    pub segment_capacity_bytes: u64,
}

/// The reserves and the two inputs that change while the store is open.
struct CachedReserves {
    logical_size_bytes: u64,
    dictionary_table_bytes: u64,
    reserves: Reserves,
}

impl Space {
    pub fn new(parts: SpaceParts) -> Space {
        let cushion_segments = pacing::cushion_segments(parts.pacing, parts.segment_count);
        let reserves = Reserves::compute(
            parts.logical_size_bytes,
            parts.dictionary_table_bytes,
            parts.segment_count,
            parts.segment_capacity_bytes,
        );
        Space {
            block_locks: (0..BLOCK_LOCK_STRIPES).map(|_| Mutex::new(Rank::BlockStripe, ())).collect(),
            write_permits: WritePermits::new(parts.write_concurrency, parts.write_permit_fair_after),
            pacer: Pacer::new(),
            pacing: parts.pacing,
            cushion_segments,
            pacing_band_bytes: cushion_segments * parts.segment_capacity_bytes,
            host_slack_bytes: AtomicU64::new(u64::MAX),
            exhausted: AtomicBool::new(false),
            logical_size_bytes: AtomicU64::new(parts.logical_size_bytes),
            over_provision_ppm: AtomicU32::new(parts.over_provision_ppm),
            reserves: std::sync::Mutex::new(CachedReserves {
                logical_size_bytes: parts.logical_size_bytes,
                dictionary_table_bytes: parts.dictionary_table_bytes,
                reserves,
            }),
            segment_count: parts.segment_count,
            segment_capacity_bytes: parts.segment_capacity_bytes,
        }
    }

    /// Every class's reserve as of now (computed when the logical size or the dictionary
    /// table last changed). `Inner::reserves` is this, checked against a fresh computation
    /// in debug builds; an append (`Inner::try_append`) reads it here, unchecked.
    pub fn reserves(&self) -> Reserves {
        lock_unranked(&self.reserves).reserves
    }

    /// Changes the logical size (`Store::resize`, under the log lock) and the reserves with it.
    pub fn set_logical_size(&self, logical_size_bytes: u64) {
        let mut cached = lock_unranked(&self.reserves);
        self.logical_size_bytes.store(logical_size_bytes, Ordering::Release);
        cached.logical_size_bytes = logical_size_bytes;
        cached.reserves = self.compute_reserves(&cached);
    }

    /// Recomputes the reserves for a dictionary table that now takes `dictionary_table_bytes`
    /// in a checkpoint, at most (called under the table's write lock by whatever changed it).
    pub fn set_dictionary_table_bytes(&self, dictionary_table_bytes: u64) {
        let mut cached = lock_unranked(&self.reserves);
        cached.dictionary_table_bytes = dictionary_table_bytes;
        cached.reserves = self.compute_reserves(&cached);
    }

    /// Panics unless the cached reserves are what the logical size and the dictionary
    /// table's `dictionary_table_bytes` give now (a missed `set_…`). The caller holds the
    /// table's read lock, so that no change to it is half done.
    pub fn assert_reserves_fresh(&self, dictionary_table_bytes: u64) {
        let cached = lock_unranked(&self.reserves);
        assert_eq!(cached.dictionary_table_bytes, dictionary_table_bytes, "reserves: stale dictionary table");
        assert_eq!(
            cached.logical_size_bytes,
            self.logical_size_bytes.load(Ordering::Acquire),
            "reserves: stale logical size"
        );
        assert_eq!(cached.reserves, self.compute_reserves(&cached), "reserves: stale");
    }

    fn compute_reserves(&self, cached: &CachedReserves) -> Reserves {
        Reserves::compute(
            cached.logical_size_bytes,
            cached.dictionary_table_bytes,
            self.segment_count,
            self.segment_capacity_bytes,
        )
    }

    /// Free segments the background worker keeps above the host reserve (the pacing band
    /// when pacing is on).
    pub fn cushion_segments(&self) -> u64 {
        self.cushion_segments
    }

    /// Waits for a host write's slot when the free space above the host reserve is in the
    /// pacing band (`pacing.rs`). Takes no lock: the free space is the last one published
    /// (`publish_host_slack`). Every writer passes here before it has a write permit, so a
    /// lock taken here was taken by all of them at once, and one preempted while holding it
    /// stalled the rest (docs/space.md, "Yielding locks").
    pub fn pace_host_write(&self, bytes: u64) {
        if !self.pacing || self.pacer.gc_ps_per_byte() == 0 {
            return;
        }
        let slack_bytes = self.host_slack_bytes.load(Ordering::Relaxed);
        let wait = self.pacer.wait_for(bytes, slack_bytes, self.pacing_band_bytes);
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }

    /// Whether host writes may wait now (free space in the pacing band, where GC cleans
    /// beside them): a front end then runs them where a waiting one holds up nothing else.
    pub fn host_writes_may_wait(&self) -> bool {
        if !self.pacing || self.pacer.gc_ps_per_byte() == 0 {
            return false;
        }
        self.host_slack_bytes.load(Ordering::Relaxed) < self.pacing_band_bytes
    }

    /// Publishes the free bytes above the host reserve for pacing (`host_slack_bytes`);
    /// called wherever they change (appends, freeing) with `LogGuard::host_slack`'s answer.
    pub fn publish_host_slack(&self, host_slack_bytes: u64) {
        if self.pacing {
            self.host_slack_bytes.store(host_slack_bytes, Ordering::Relaxed);
        }
    }

    /// Remembers that a host request was refused for lack of space (`space_flag` 2) until
    /// one succeeds again.
    pub fn note_no_space(&self, e: &Error) {
        if e.kind() == ErrorKind::NoSpace {
            self.exhausted.store(true, Ordering::Relaxed);
        }
    }
}

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

/// The reserves of every class, in bytes (docs/space.md, "Reserves"): what an append of a
/// class must leave unused in the log. Invariant (liveness): every append of a class leaves
/// the reserve of the classes below it unused, counted in bytes of the log (free segments'
/// capacity and the open segment's room), so GC — and the checkpoints that free what it
/// cleaned — can always run, and trim works on a full store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reserves {
    segment_capacity_bytes: u64,
    checkpoint_room_bytes: u64,
    /// `host_reserve_for`'s answer, kept so that asking needs no arithmetic of `capacity.rs`.
    host_bytes: u64,
}

impl Reserves {
    /// The reserves for a store of this logical size and geometry whose dictionary table
    /// takes `dictionary_table_bytes` in a checkpoint: the checkpoint room (see
    /// [`checkpoint_room_for`]) and the trained dictionaries a checkpoint carries — up to 8
    /// of up to 256 KiB, which the static bound does not know (native capacity does not
    /// count them: they come out of the bound's slack and the over-provisioning,
    /// docs/space.md, "Reserves").
    fn compute(
        logical_size_bytes: u64,
        dictionary_table_bytes: u64,
        segment_count: u64,
        segment_capacity_bytes: u64,
    ) -> Reserves {
        let checkpoint_room_bytes =
            checkpoint_room_for(logical_size_bytes, segment_count, segment_capacity_bytes) + dictionary_table_bytes;
        Reserves {
            segment_capacity_bytes,
            checkpoint_room_bytes,
            host_bytes: host_reserve_for(segment_capacity_bytes, checkpoint_room_bytes),
        }
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
    pub fn of(&self, class: SpaceClass) -> u64 {
        let capacity = self.segment_capacity_bytes;
        let checkpoint = self.checkpoint_room_bytes;
        match class {
            SpaceClass::Host => self.host_bytes,
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

    /// Room one checkpoint takes in the log.
    pub fn checkpoint_room_bytes(&self) -> u64 {
        self.checkpoint_room_bytes
    }

    /// The host reserve in whole segments, for the background worker's targets.
    pub fn host_segments(&self) -> u64 {
        self.host_bytes.div_ceil(self.segment_capacity_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space(logical_size_bytes: u64, dictionary_table_bytes: u64) -> Space {
        Space::new(SpaceParts {
            write_concurrency: 2,
            write_permit_fair_after: permits::FAIR_AFTER,
            pacing: true,
            logical_size_bytes,
            over_provision_ppm: 100_000,
            dictionary_table_bytes,
            segment_count: 64,
            segment_capacity_bytes: 1 << 20,
        })
    }

    #[test]
    fn the_cached_reserves_follow_the_logical_size_and_the_dictionary_table() {
        let s = space(1 << 30, 0);
        s.assert_reserves_fresh(0);
        let before = s.reserves();
        s.set_logical_size(64 << 30);
        s.assert_reserves_fresh(0);
        let grown = s.reserves();
        assert!(grown.checkpoint_room_bytes() > before.checkpoint_room_bytes());
        s.set_dictionary_table_bytes(300 << 10);
        s.assert_reserves_fresh(300 << 10);
        assert_eq!(s.reserves().checkpoint_room_bytes(), grown.checkpoint_room_bytes() + (300 << 10));
        assert_eq!(s.reserves(), space(64 << 30, 300 << 10).reserves());
    }

    #[test]
    #[should_panic(expected = "stale")]
    fn a_missed_change_of_the_logical_size_is_caught() {
        let s = space(1 << 30, 0);
        s.logical_size_bytes.store(2 << 30, Ordering::Release);
        s.assert_reserves_fresh(0);
    }

    #[test]
    fn each_class_leaves_the_ones_below_it_room() {
        let r = space(1 << 30, 0).reserves();
        let order = [
            SpaceClass::Host,
            SpaceClass::HostMetadata,
            SpaceClass::TrimWhileFull,
            SpaceClass::Gc,
            SpaceClass::GcSettled,
            SpaceClass::Internal,
        ];
        for pair in order.windows(2) {
            assert!(r.of(pair[0]) > r.of(pair[1]), "{:?} vs {:?}", pair[0], pair[1]);
        }
        assert_eq!(r.of(SpaceClass::Host), host_reserve_for(1 << 20, r.checkpoint_room_bytes()));
        assert_eq!(r.host_segments(), r.of(SpaceClass::Host).div_ceil(1 << 20));
    }
}
