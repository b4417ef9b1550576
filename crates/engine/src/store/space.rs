//! Space: when host writers wait, and for what. One room answers it; in the order a host
//! write meets them (`request.rs`, `Inner::write`; a trim or write-zeroes from 2 on). Waits
//! 1–3 are this file's, in its sections; 4 and 5 need the whole store and are the
//! "Admission" section of `request.rs`:
//!
//! 1. **Pacing** ("Pacing" below, [`Space::pace_host_write`]): once the free space above the
//!    host reserve is in the pacing band (the background worker's cushion, where GC runs
//!    beside host writes) and GC's cost is measured, the write sleeps for its slot on one
//!    shared clock — at most 100 ms, holding no lock and no permit. Never a refusal.
//! 2. **A write permit** ("Write permits" below, [`Space::write_permits`]): at most one host write per
//!    core compresses and appends at a time; the others sleep, in order once one is
//!    overdue. Taken before any lock of the order; held through everything below, given
//!    back before a FUA write waits for the disk.
//! 3. **Block stripes** ([`Space::block_locks`], rank 1): a write that read-modify-writes a
//!    partial block holds its stripe while it reads, merges and appends it.
//! 4. **Map memory** (`request.rs`, `wait_for_map_memory`): when the map's unwritten changes
//!    reached their memory limit (the background checkpoint fell behind, or there is no
//!    background thread), the writer writes the checkpoint itself before it adds more.
//! 5. **Reserves, foreground GC, ENOSPC** (`request.rs`, `Inner::admit`; its rounds in
//!    `foreground_gc.rs`): an append of a class ([`SpaceClass`]) must leave the
//!    [`Reserves`] of the classes below it unused in the log.
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
//! The arithmetic with no state — the classes and their reserves (`SpaceClass`,
//! `Reserves`), the checkpoint room, native capacity, image sizing — is `capacity.rs`'s.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::Thread;
use std::time::{Duration, Instant};

use super::capacity::Reserves;
use super::lock::{lock_unranked, Mutex, Rank};
use crate::error::{Error, ErrorKind};

/// Stripes of the partial-block locks (by LBA).
pub(crate) const BLOCK_LOCK_STRIPES: usize = 1024;

pub(crate) struct Space {
    /// Rank 1: stripes serialising read-modify-write of partial blocks.
    pub block_locks: Vec<Mutex<()>>,
    /// Host writes' CPU work, at most one per core at a time ("Write permits").
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
    /// `OpenOptions::write_permit_fair_after` ("Write permits").
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
        let cushion_segments = cushion_segments(parts.pacing, parts.segment_count);
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
    /// pacing band ("Pacing"). Takes no lock: the free space is the last one published
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

// ==============================================================================================
// Pacing: host writes against GC (docs/space.md, "Pacing")
//
// Pacing host writes against GC (docs/space.md, "Pacing").
//
// Without pacing, host writes run at full speed until the free space reaches the host
// reserve, then every writer stalls behind a foreground GC round that cleans many victims
// at once: at native capacity the worst writes took hundreds of milliseconds while the
// median took well under one. With it, once the free space above the host reserve falls
// into the pacing band (the background worker's cushion, where background GC runs), each
// host write is admitted on one shared clock: its slot is as long as GC's measured cost of
// giving back that many bytes, scaled by how deep into the band the store is — under 1x
// above the band's middle, growing without bound towards the reserve. The write rate then
// settles where GC keeps up, and the wait is spread evenly over all writes.
//
// The clock is shared, not per writer, so the pace does not depend on how many requests
// are in flight (at queue depth 32 a per-write delay would be 32 times too weak).
//
// It is on unless `OpenOptions::pacing` is false (`ZDISK_PACING=off`). First measured on
// 2026-11-23 it cut the tail but cost throughput, and stayed opt-in; measured again on
// 2026-11-26 (GC's cold stream and reserve fixes came in between; which change turned it
// is not known) it cut p99.9 write latency at native capacity from ~62 ms to 7–9 ms *and*
// raised throughput by a third, with write amplification 3.75 → 3.18 (likely: background
// GC works in the wider band while host writes wait their turn, rather than foreground
// rounds cleaning under pressure), and became the default (docs/space.md, "Pacing").
//
// Invariants: pacing only delays a write — it never refuses one, holds no lock while it
// waits, and waits at most `WAIT_MAX` per write (foreground GC in `admit` stays the
// backstop); it does nothing until the background worker has measured GC, so a store
// without background threads behaves exactly as before.
// ==============================================================================================

/// The longest one write waits for its slot. Past it the write goes, and the foreground GC
/// of `admit` takes over if space runs out.
const WAIT_MAX: Duration = Duration::from_millis(100);
/// The slot's scale at the bottom of the band (the scale is (1 − f) / f for f, the share of
/// the band still free, bounded here).
const SCALE_MAX: f64 = 64.0;
/// Weight of a new GC measurement in the running estimate (1/8: a few rounds' memory).
const GC_COST_NEW_WEIGHT: f64 = 0.125;
/// The widest pacing band (256 MiB of 4 MiB segments; docs/space.md, "Pacing's band").
pub(crate) const PACING_BAND_SEGMENTS_MAX: u64 = 64;

/// Free segments the background worker keeps above the host reserve; host writes are
/// paced once the free space falls below it (`Space::pace_host_write`). Without pacing, a
/// smaller cushion of its own.
pub(crate) fn cushion_segments(pacing: bool, segment_count: u64) -> u64 {
    match pacing {
        true => pacing_band_segments(segment_count),
        false => (segment_count / 256).max(2),
    }
}

/// The pacing band of a store of `segment_count` segments. It absorbs what host writes take
/// while GC gives space back (a step of up to the worker's `GC_ROUND_SEGMENTS` victims,
/// then the checkpoint that frees them), which does not grow with the store; every segment
/// in it is held free and raises the utilisation GC works at (docs/space.md, "Pacing's
/// band").
pub(crate) fn pacing_band_segments(segment_count: u64) -> u64 {
    (segment_count / 64).clamp(4, PACING_BAND_SEGMENTS_MAX)
}

pub(crate) struct Pacer {
    epoch: Instant,
    /// Nanoseconds after `epoch` from which the next paced write may go.
    next_slot_ns: AtomicU64,
    /// Background GC's wall-clock cost per byte of space it gave back, in picoseconds
    /// (a running average); 0 until GC has run.
    gc_ps_per_byte: AtomicU64,
    paced_writes: AtomicU64,
    paced_wait_ns: AtomicU64,
}

impl Pacer {
    pub fn new() -> Pacer {
        Pacer {
            epoch: Instant::now(),
            next_slot_ns: AtomicU64::new(0),
            gc_ps_per_byte: AtomicU64::new(0),
            paced_writes: AtomicU64::new(0),
            paced_wait_ns: AtomicU64::new(0),
        }
    }

    /// Records a background GC pass that took `elapsed` and gave back `gained_bytes`.
    pub fn note_gc(&self, elapsed: Duration, gained_bytes: u64) {
        if gained_bytes == 0 {
            return;
        }
        let sample = elapsed.as_nanos() as f64 * 1000.0 / gained_bytes as f64;
        let old = self.gc_ps_per_byte.load(Ordering::Relaxed) as f64;
        let new = if old == 0.0 { sample } else { old + GC_COST_NEW_WEIGHT * (sample - old) };
        self.gc_ps_per_byte.store(new.max(1.0) as u64, Ordering::Relaxed);
    }

    /// GC's measured cost per byte given back, in picoseconds (0: not measured yet).
    pub fn gc_ps_per_byte(&self) -> u64 {
        self.gc_ps_per_byte.load(Ordering::Relaxed)
    }

    /// How long a host write of `bytes` waits for its slot when `slack_bytes` of the
    /// `band_bytes` pacing band are still free above the host reserve. Takes the slot.
    pub fn wait_for(&self, bytes: u64, slack_bytes: u64, band_bytes: u64) -> Duration {
        let now_ns = self.epoch.elapsed().as_nanos() as u64;
        let cost_ps = self.gc_ps_per_byte();
        if cost_ps == 0 || slack_bytes >= band_bytes || band_bytes == 0 {
            // Above the band nothing is owed: a later descent into it starts afresh.
            self.next_slot_ns.fetch_min(now_ns, Ordering::Relaxed);
            return Duration::ZERO;
        }
        let slot_ns = (bytes as f64 * cost_ps as f64 / 1000.0 * scale(slack_bytes, band_bytes)) as u64;
        let start_ns = match self
            .next_slot_ns
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |next| Some(next.max(now_ns) + slot_ns))
        {
            Ok(previous) | Err(previous) => previous.max(now_ns),
        };
        let wait = Duration::from_nanos(start_ns - now_ns).min(WAIT_MAX);
        if !wait.is_zero() {
            self.paced_writes.fetch_add(1, Ordering::Relaxed);
            self.paced_wait_ns.fetch_add(wait.as_nanos() as u64, Ordering::Relaxed);
        }
        wait
    }

    /// Writes that waited for a slot since open.
    pub fn paced_writes(&self) -> u64 {
        self.paced_writes.load(Ordering::Relaxed)
    }

    /// Their total wait, in nanoseconds.
    pub fn paced_wait_ns(&self) -> u64 {
        self.paced_wait_ns.load(Ordering::Relaxed)
    }
}

/// The slot's scale when the share `slack / band` of the pacing band is still free: 1 at
/// the middle (host writes at GC's pace), below 1 above it, growing towards the reserve.
fn scale(slack_bytes: u64, band_bytes: u64) -> f64 {
    let free_share = slack_bytes as f64 / band_bytes as f64;
    ((1.0 - free_share) / free_share).min(SCALE_MAX)
}

// ==============================================================================================
// Write permits: admission of host writes' CPU work (docs/space.md, "Write admission")
//
// Admission of host writes' CPU work (docs/space.md, "Write admission").
//
// A front end serves requests on more threads than there are cores, because reads wait for
// the disk and need requests in flight to keep it busy (nbdkit's 16 threads: random reads
// at QD32 do 43k IOPS, with 4 threads 28k). Writes never wait for the disk — they compress
// and copy into a segment buffer — so more writers than cores only take turns on the CPU:
// the scheduler preempts one while it holds the log or map lock, and the others queue
// behind it for whole time slices. Measured at native capacity with 35% OP (little GC),
// 16 writers had p99.9 write latency ~14 ms for a median of 0.25 ms; 2 or 4 nbdkit threads
// had 3–5 ms at the same throughput.
//
// So at most one host write per core runs its CPU work (compress, append) at a time; the
// others sleep here, and none is passed over once overdue (`WRITE_PERMIT_FAIR_AFTER`, or longer when
// its place in a queue of large writes explains the wait). A permit is taken before any lock of the lock order and after pacing
// ("Pacing": a paced write sleeps without one), and is held through `admit`: a
// foreground GC round holds it too, as the writer that runs it would otherwise hold the
// CPU. Nothing that a permit holder waits for needs another host write to progress
// (foreground GC, the worker's checkpoint, a backing read), so permits cannot deadlock.
//
// Writers waiting here are also the write path's load signal: while any wait, a block is
// compressed with LZ4 instead of the store's codec (`codec::write_codec`; the idle work
// recompresses it later). Without that, permits hid the load the fallback looked for —
// compressions no longer overlapped — and zstd:1 on 95% of blocks halved 128K sequential
// writes of 2:1 data.
// ==============================================================================================

/// A waiter is overdue only past this many times the wait its place in the queue explains.
/// Measured with 128K writes (a permit held ~100 µs, so a queue of 14 is ~0.7 ms): with
/// `WRITE_PERMIT_FAIR_AFTER` alone ~45% of permits were handed to sleeping waiters and an encrypted
/// store ran 0.74 of a plain one; with this, 0.83 (plain unchanged), and 4K writes kept
/// their tail (docs/space.md, "Write admission").
const QUEUE_WAIT_SLACK: f64 = 4.0;

/// How long a wait for a permit keeps counting as load (`load_besides_holder`): longer than
/// the gaps between waits under a sustained load (a 128K write holds a permit ~100 µs), and
/// a lone writer never waits, so it keeps the store's codec.
const FULL_MEMORY: Duration = Duration::from_millis(10);

/// Permits for host writes' CPU work: taken at once while one is free and no waiter is
/// overdue; an overdue waiter (`front_overdue`) gets the next one handed to it.
pub(crate) struct WritePermits {
    /// Outside the lock order: held only to take or hand over a permit, and no other lock
    /// is taken while it is held — a leaf, so `try_acquire` may take it under a writer's
    /// stripe locks. (A standard library mutex: `store/lock.rs` says why.)
    state: std::sync::Mutex<PermitState>,
    /// 0: unlimited (no queue).
    count: usize,
    fair_after: Duration,
    /// `state.waiting.len()`, kept beside it (changed under the lock) for the write path's
    /// load signal (`Inner::compress`), which reads it without the lock.
    waiting: AtomicUsize,
    /// Permits held now (`count - state.free`), kept beside it likewise.
    held: AtomicUsize,
    /// When a writer last had to wait (nanoseconds since `epoch`; 0: never).
    last_full_ns: AtomicU64,
    epoch: Instant,
}

struct PermitState {
    free: usize,
    waiting: VecDeque<Arc<Waiter>>,
    /// How long a permit is held, a running mean (nanoseconds).
    hold_ns: f64,
}

struct Waiter {
    thread: Thread,
    since: Instant,
    /// Set (before the unpark) when a releasing thread handed its permit to this waiter.
    granted: AtomicBool,
}

/// A held permit; dropping it returns it, or hands it to an overdue waiter.
pub(crate) struct WritePermit<'a> {
    permits: &'a WritePermits,
    since: Instant,
}

impl WritePermits {
    /// `count` permits (0: unlimited); a waiter is overdue after `fair_after`
    /// (`OpenOptions::write_permit_fair_after`) at the least.
    pub fn new(count: usize, fair_after: Duration) -> WritePermits {
        WritePermits {
            state: std::sync::Mutex::new(PermitState { free: count, waiting: VecDeque::new(), hold_ns: 0.0 }),
            count,
            fair_after,
            waiting: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            last_full_ns: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    /// Takes a permit, sleeping while all are held (or while an overdue waiter is owed one).
    pub fn acquire(&self) -> Option<WritePermit<'_>> {
        debug_assert!(crate::store::lock::holds_none(), "a write permit is taken before any lock of the order");
        if self.count == 0 {
            return None;
        }
        let mut state = self.lock_state();
        if state.free > 0 && !self.front_overdue(&state) {
            state.free -= 1;
            self.held.fetch_add(1, Ordering::Relaxed);
            return Some(WritePermit { permits: self, since: Instant::now() });
        }
        let waiter =
            Arc::new(Waiter { thread: std::thread::current(), since: Instant::now(), granted: AtomicBool::new(false) });
        self.last_full_ns.store(self.nanos_since_epoch(waiter.since).max(1), Ordering::Relaxed);
        state.waiting.push_back(waiter.clone());
        self.waiting.fetch_add(1, Ordering::Relaxed);
        loop {
            drop(state);
            // Woken by a release: either handed a permit, or told one is free to take.
            // (`park` may also return spuriously: the checks below decide.)
            std::thread::park();
            state = self.lock_state();
            if waiter.granted.load(Ordering::Acquire) {
                return Some(WritePermit { permits: self, since: Instant::now() });
            }
            let first = state.waiting.front().is_some_and(|w| Arc::ptr_eq(w, &waiter));
            if first && state.free > 0 {
                state.free -= 1;
                self.held.fetch_add(1, Ordering::Relaxed);
                state.waiting.pop_front();
                self.waiting.fetch_sub(1, Ordering::Relaxed);
                // Two releases before this thread ran woke it twice and the next waiter
                // not at all: pass the word on.
                if state.free > 0 {
                    if let Some(next) = state.waiting.front() {
                        next.thread.unpark();
                    }
                }
                return Some(WritePermit { permits: self, since: Instant::now() });
            }
        }
    }

    /// Takes a free permit without waiting, for a writer's compression helper
    /// (`Inner::compress_blocks`): None while every permit is held, a writer waits for one
    /// (it comes first), or writers are not limited.
    pub fn try_acquire(&self) -> Option<WritePermit<'_>> {
        if self.count == 0 {
            return None;
        }
        let mut state = self.lock_state();
        if state.free == 0 || !state.waiting.is_empty() {
            return None;
        }
        state.free -= 1;
        self.held.fetch_add(1, Ordering::Relaxed);
        Some(WritePermit { permits: self, since: Instant::now() })
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, PermitState> {
        crate::store::lock::lock_unranked(&self.state)
    }

    /// How many writers wait for a permit now (0 while they are not limited).
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// The write path's load signal for a writer that holds a permit: the writers waiting
    /// for one, and the others holding one — each of those runs CPU work (compression or an
    /// append) on a core now; and all the permits if a writer had to wait within the last
    /// `FULL_MEMORY`. That memory is for loads whose bottleneck is outside the store: under
    /// 128K writes at QD32 the front end's receive path (one thread at a time reads a request
    /// and its data) often leaves a single writer inside, which then chose zstd:1 and took
    /// the CPU the front end needed (docs/space.md, "Adaptive fallback"). 0 while writers
    /// are not limited.
    pub fn load_besides_holder(&self) -> usize {
        let now = self.waiting() + self.held.load(Ordering::Relaxed).saturating_sub(1);
        let last_full_ns = self.last_full_ns.load(Ordering::Relaxed);
        if last_full_ns != 0
            && self.nanos_since_epoch(Instant::now()).saturating_sub(last_full_ns) < FULL_MEMORY.as_nanos() as u64
        {
            return now.max(self.count);
        }
        now
    }

    fn nanos_since_epoch(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// Whether the longest waiter has waited past `fair_after`, or past `QUEUE_WAIT_SLACK`
    /// times the wait its place in the queue explains (waiters per permit × the mean hold),
    /// whichever is longer: large writes hold a permit long, so their queue alone is a
    /// wait of milliseconds, and handing over there only idles the permit.
    fn front_overdue(&self, state: &PermitState) -> bool {
        let Some(front) = state.waiting.front() else { return false };
        let queued_ns = QUEUE_WAIT_SLACK * state.hold_ns * state.waiting.len() as f64 / self.count.max(1) as f64;
        front.since.elapsed() >= self.fair_after.max(Duration::from_nanos(queued_ns as u64))
    }

    fn release(&self, held: Duration) {
        let mut state = self.lock_state();
        state.hold_ns += (held.as_nanos() as f64 - state.hold_ns) / 16.0;
        if self.front_overdue(&state) {
            let waiter = state.waiting.pop_front().expect("an overdue waiter");
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            waiter.granted.store(true, Ordering::Release);
            waiter.thread.unpark();
            return;
        }
        state.free += 1;
        self.held.fetch_sub(1, Ordering::Relaxed);
        assert!(state.free <= self.count, "more permits returned than taken");
        // The first waiter may take it — unless a writer arriving meanwhile does first
        // (no hand-over: a sleeping thread would hold the permit idle until it runs).
        if let Some(waiter) = state.waiting.front() {
            waiter.thread.unpark();
        }
    }
}

impl Drop for WritePermit<'_> {
    fn drop(&mut self) {
        self.permits.release(self.since.elapsed());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::capacity::{host_reserve_for, SpaceClass};
    use crate::store::options::WRITE_PERMIT_FAIR_AFTER;

    fn space(logical_size_bytes: u64, dictionary_table_bytes: u64) -> Space {
        Space::new(SpaceParts {
            write_concurrency: 2,
            write_permit_fair_after: WRITE_PERMIT_FAIR_AFTER,
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

#[cfg(test)]
mod pacing_tests {
    use super::*;

    #[test]
    fn nothing_waits_before_gc_is_measured_or_above_the_band() {
        let pacer = Pacer::new();
        assert_eq!(pacer.wait_for(4096, 0, 1 << 20), Duration::ZERO);
        pacer.note_gc(Duration::from_millis(10), 1 << 20);
        assert_eq!(pacer.wait_for(4096, 1 << 20, 1 << 20), Duration::ZERO);
        assert_eq!(pacer.wait_for(4096, 2 << 20, 1 << 20), Duration::ZERO);
    }

    #[test]
    fn slots_queue_on_one_clock_and_lengthen_towards_the_reserve() {
        let pacer = Pacer::new();
        // 1 ms per MiB given back: a 1 MiB write at the band's middle takes a 1 ms slot.
        pacer.note_gc(Duration::from_millis(1), 1 << 20);
        let first = pacer.wait_for(1 << 20, 512 << 10, 1 << 20);
        let second = pacer.wait_for(1 << 20, 512 << 10, 1 << 20);
        assert!(first < Duration::from_micros(200), "{first:?}");
        assert!(second > Duration::from_micros(700) && second < Duration::from_micros(1100), "{second:?}");
        // Deeper into the band, each slot is longer.
        let deep = Pacer::new();
        deep.note_gc(Duration::from_millis(1), 1 << 20);
        deep.wait_for(1 << 20, 128 << 10, 1 << 20);
        let after_deep = deep.wait_for(1 << 20, 128 << 10, 1 << 20);
        assert!(after_deep > Duration::from_micros(6000), "{after_deep:?}");
        // Waits are bounded.
        for _ in 0..200 {
            assert!(deep.wait_for(1 << 20, 1, 1 << 20) <= WAIT_MAX);
        }
    }

    #[test]
    fn the_scale_is_one_at_the_middle_of_the_band() {
        assert!((scale(50, 100) - 1.0).abs() < 1e-9);
        assert!(scale(90, 100) < 0.2);
        assert!(scale(10, 100) > 8.0);
        assert_eq!(scale(0, 100), SCALE_MAX);
    }
}

#[cfg(test)]
mod permits_tests {
    use super::*;
    use crate::store::options::WRITE_PERMIT_FAIR_AFTER;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn no_more_holders_than_permits_and_every_waiter_gets_one() {
        let permits = Arc::new(WritePermits::new(2, WRITE_PERMIT_FAIR_AFTER));
        let holders = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (permits, holders, most) = (permits.clone(), holders.clone(), most.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let _permit = permits.acquire().expect("limited");
                        let now = holders.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::yield_now();
                        holders.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 2, "two permits, eight threads: two hold at once");
        let state = permits.lock_state();
        assert_eq!((state.free, state.waiting.len()), (2, 0), "every permit came back");
        assert_eq!(permits.held.load(Ordering::SeqCst), 0, "the held count came back to 0");
    }

    #[test]
    fn load_counts_other_holders_and_a_recent_wait() {
        let permits = Arc::new(WritePermits::new(2, WRITE_PERMIT_FAIR_AFTER));
        let first = permits.acquire().expect("limited");
        assert_eq!(permits.load_besides_holder(), 0, "a lone writer sees no load");
        let second = permits.acquire().expect("limited");
        assert_eq!(permits.load_besides_holder(), 1, "the other holder counts");
        let before_wait = Instant::now();
        let waiter = {
            let permits = permits.clone();
            std::thread::spawn(move || drop(permits.acquire()))
        };
        while permits.waiting() == 0 {
            std::thread::yield_now();
        }
        assert_eq!(permits.load_besides_holder(), 2, "a waiter counts");
        drop((first, second));
        waiter.join().unwrap();
        let _lone = permits.acquire().expect("limited");
        // Within FULL_MEMORY of the wait the load stays at all permits, then falls back.
        let load = permits.load_besides_holder();
        assert!(load == 2 || before_wait.elapsed() >= FULL_MEMORY, "load {load} right after a wait");
        std::thread::sleep(FULL_MEMORY + Duration::from_millis(5));
        assert_eq!(permits.load_besides_holder(), 0, "the wait is forgotten after {FULL_MEMORY:?}");
    }

    #[test]
    fn waiters_are_served_in_arrival_order() {
        let permits = Arc::new(WritePermits::new(1, WRITE_PERMIT_FAIR_AFTER));
        let held = permits.acquire();
        let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        for i in 0..4 {
            let (shared, order) = (permits.clone(), order.clone());
            threads.push(std::thread::spawn(move || {
                let _permit = shared.acquire();
                order.lock().push(i);
            }));
            // Wait until thread i is queued before starting the next.
            while permits.lock_state().waiting.len() < i + 1 {
                std::thread::yield_now();
            }
        }
        drop(held);
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(*order.lock(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn an_overdue_waiter_is_handed_the_next_permit() {
        let permits = Arc::new(WritePermits::new(1, WRITE_PERMIT_FAIR_AFTER));
        let held = permits.acquire();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let waiter = {
            let permits = permits.clone();
            std::thread::spawn(move || {
                let _permit = permits.acquire();
                release_rx.recv().unwrap();
            })
        };
        while permits.lock_state().waiting.is_empty() {
            std::thread::yield_now();
        }
        std::thread::sleep(WRITE_PERMIT_FAIR_AFTER * 3);
        assert_eq!(permits.waiting(), 1, "the load signal counts the waiter");
        drop(held);
        {
            let state = permits.lock_state();
            assert_eq!((state.free, state.waiting.len()), (0, 0), "handed over, not returned to the pool");
        }
        release_tx.send(()).unwrap();
        waiter.join().unwrap();
        assert_eq!((permits.lock_state().free, permits.waiting()), (1, 0));
    }

    #[test]
    fn permits_freed_together_reach_every_waiter() {
        let permits = Arc::new(WritePermits::new(2, WRITE_PERMIT_FAIR_AFTER));
        let (first, second) = (permits.acquire(), permits.acquire());
        let (got_tx, got_rx) = std::sync::mpsc::channel::<()>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let done_rx = Arc::new(parking_lot::Mutex::new(done_rx));
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let (shared, got_tx, done_rx) = (permits.clone(), got_tx.clone(), done_rx.clone());
                std::thread::spawn(move || {
                    let _permit = shared.acquire();
                    got_tx.send(()).unwrap();
                    done_rx.lock().recv().unwrap();
                })
            })
            .collect();
        while permits.lock_state().waiting.len() < 2 {
            std::thread::yield_now();
        }
        // Both freed before either waiter runs (and before either is overdue): each
        // release wakes the first waiter; the second must still get the other permit
        // without a third release.
        drop((first, second));
        for _ in 0..2 {
            got_rx
                .recv_timeout(std::time::Duration::from_secs(5))
                .expect("a waiter was left asleep with a permit free");
        }
        for _ in 0..2 {
            done_tx.send(()).unwrap();
        }
        for waiter in waiters {
            waiter.join().unwrap();
        }
    }

    #[test]
    fn a_long_queue_of_long_writes_is_not_overdue_after_fair_after() {
        let permits = WritePermits::new(1, WRITE_PERMIT_FAIR_AFTER);
        let waited = Instant::now().checked_sub(WRITE_PERMIT_FAIR_AFTER * 2).unwrap();
        let waiter =
            Arc::new(Waiter { thread: std::thread::current(), since: waited, granted: AtomicBool::new(false) });
        let mut state = PermitState { free: 0, waiting: VecDeque::from([waiter]), hold_ns: 0.0 };
        assert!(permits.front_overdue(&state), "short holds: overdue after WRITE_PERMIT_FAIR_AFTER");
        state.hold_ns = (WRITE_PERMIT_FAIR_AFTER * 10).as_nanos() as f64;
        assert!(
            !permits.front_overdue(&state),
            "one hold is ten WRITE_PERMIT_FAIR_AFTERs: the queue explains the wait"
        );
        state.waiting.clear();
        assert!(!permits.front_overdue(&state), "nobody waits");
    }

    #[test]
    fn zero_means_unlimited() {
        let permits = WritePermits::new(0, WRITE_PERMIT_FAIR_AFTER);
        let all: Vec<_> = (0..100).map(|_| permits.acquire()).collect();
        assert!(all.iter().all(Option::is_none));
    }
}
