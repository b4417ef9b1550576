//! Admission of host writes' CPU work (docs/space.md, "Write admission").
//!
//! A front end serves requests on more threads than there are cores, because reads wait for
//! the disk and need requests in flight to keep it busy (nbdkit's 16 threads: random reads
//! at QD32 do 43k IOPS, with 4 threads 28k). Writes never wait for the disk — they compress
//! and copy into a segment buffer — so more writers than cores only take turns on the CPU:
//! the scheduler preempts one while it holds the log or map lock, and the others queue
//! behind it for whole time slices. Measured at native capacity with 35% OP (little GC),
//! 16 writers had p99.9 write latency ~14 ms for a median of 0.25 ms; 2 or 4 nbdkit threads
//! had 3–5 ms at the same throughput.
//!
//! So at most one host write per core runs its CPU work (compress, append) at a time; the
//! others sleep here, and none is passed over once overdue (`FAIR_AFTER`, or longer when
//! its place in a queue of large writes explains the wait). A permit is taken before any lock of the lock order and after pacing
//! (`pacing.rs`: a paced write sleeps without one), and is held through `admit`: a
//! foreground GC round holds it too, as the writer that runs it would otherwise hold the
//! CPU. Nothing that a permit holder waits for needs another host write to progress
//! (foreground GC, the worker's checkpoint, a backing read), so permits cannot deadlock.
//!
//! Writers waiting here are also the write path's load signal: while any wait, a block is
//! compressed with LZ4 instead of the store's codec (`codec::write_codec`; the idle work
//! recompresses it later). Without that, permits hid the load the fallback looked for —
//! compressions no longer overlapped — and zstd:1 on 95% of blocks halved 128K sequential
//! writes of 2:1 data.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a waiter may be passed over by writers arriving after it. Handing a permit to a
/// sleeping waiter leaves it idle until the scheduler runs that thread (on a busy 2-core
/// machine ~0.4 ms on average), so permits go to whoever asks first while the wait is
/// short, and in order once it is not: strict order cost 22% of the throughput of 4K
/// writes, none cost the tail (docs/space.md, "Write admission"). The default of
/// `OpenOptions::write_permit_fair_after`.
pub(crate) const FAIR_AFTER: Duration = Duration::from_millis(1);

/// A waiter is overdue only past this many times the wait its place in the queue explains.
/// Measured with 128K writes (a permit held ~100 µs, so a queue of 14 is ~0.7 ms): with
/// `FAIR_AFTER` alone ~45% of permits were handed to sleeping waiters and an encrypted
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
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn no_more_holders_than_permits_and_every_waiter_gets_one() {
        let permits = Arc::new(WritePermits::new(2, FAIR_AFTER));
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
        let permits = Arc::new(WritePermits::new(2, FAIR_AFTER));
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
        let permits = Arc::new(WritePermits::new(1, FAIR_AFTER));
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
        let permits = Arc::new(WritePermits::new(1, FAIR_AFTER));
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
        std::thread::sleep(FAIR_AFTER * 3);
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
        let permits = Arc::new(WritePermits::new(2, FAIR_AFTER));
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
        let permits = WritePermits::new(1, FAIR_AFTER);
        let waited = Instant::now().checked_sub(FAIR_AFTER * 2).unwrap();
        let waiter =
            Arc::new(Waiter { thread: std::thread::current(), since: waited, granted: AtomicBool::new(false) });
        let mut state = PermitState { free: 0, waiting: VecDeque::from([waiter]), hold_ns: 0.0 };
        assert!(permits.front_overdue(&state), "short holds: overdue after FAIR_AFTER");
        state.hold_ns = (FAIR_AFTER * 10).as_nanos() as f64;
        assert!(!permits.front_overdue(&state), "one hold is ten FAIR_AFTERs: the queue explains the wait");
        state.waiting.clear();
        assert!(!permits.front_overdue(&state), "nobody waits");
    }

    #[test]
    fn zero_means_unlimited() {
        let permits = WritePermits::new(0, FAIR_AFTER);
        let all: Vec<_> = (0..100).map(|_| permits.acquire()).collect();
        assert!(all.iter().all(Option::is_none));
    }
}
