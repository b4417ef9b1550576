//! The store's locks, each with a rank, and the lock order written down once.
//!
//! A thread holding a lock may only take locks of a higher rank:
//!
//! | rank | lock (path from `Inner`, unless named) | guards |
//! |---|---|---|
//! | 0 | `Store::idle` | `Store::idle_work_once`'s idle-work state; held through one step of idle work |
//! | 1 | `space.block_locks` (stripes) | read-modify-write of partial blocks; several, in index order |
//! | 2 | `background.foreground_gc` | one foreground GC round at a time |
//! | 3 | `checkpoint` | checkpoints, freeing segments; the newest durable superblock |
//! | 4 | `background.gc_lock` | one GC victim at a time; freeing never races a victim |
//! | 5 | `log.io` | backing writes of log data, so a flush knows every earlier write is done |
//! | 6 | `log` (`Log::lock`) | the appender, the segment table, checkpoint epochs |
//! | 7 | the cipher's nonce source (`crypto/cipher.rs`) | the nonce lease; renewing it writes and syncs the key header |
//! | 8 | `map` | the block map (write: resize, and the freeing barrier) |
//! | 9 | the map's `tree` | map page states, cached pages, changes (never held across I/O) |
//! | 10 | `log.buffered` | the list of segment buffers readers may find data in |
//! | 11 | a segment buffer's `data` | its bytes |
//! | 12 | `background.wakeups.signal` | the worker threads' wake-up flags |
//!
//! The path of a host write shows why: it holds its block stripes while it may run a
//! foreground GC round, which checkpoints, which cleans a victim, which appends (log), which
//! publishes map entries, which may open a segment (buffered list) and copies bytes into its
//! buffer, which wakes the worker. A step of idle work (`Store::idle`) runs GC, checkpoints
//! and dictionary work, so it comes before all of them; it takes no block stripe and no
//! write permit. The nonce source is taken wherever a fragment is sealed: a host write's
//! blocks (under its stripes, if any), GC's recompressed copies (under `gc_lock`), a checkpoint's
//! map pages and dictionary table (under `checkpoint`), and a group resealed into the
//! current nonce epoch under `log` (`LogGuard::hold_to_one_epoch`) — hence above the log. It
//! sits below the map's locks on purpose: a lease renewal is a synced write of the key
//! header, and readers must never wait for one; nothing is taken while it is held.
//!
//! Debug builds check every acquisition against the locks the thread already holds and
//! panic naming both; so does CI, whose `--profile ci` (`Cargo.toml`; `scripts/test.sh`
//! runs `cargo test --workspace --profile ci`) keeps `debug-assertions` on. Release builds
//! check nothing. The read cache's slot locks are outside the order: they are only ever
//! try-locked. So is the dictionary table's lock: it is held only to read or swap `Arc`s,
//! never while another lock of the order is taken — except that a checkpoint seals the
//! table under it (the nonce source, which takes nothing further).

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
use std::sync::{Condvar, PoisonError};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Rank {
    Idle = 0,
    BlockStripe = 1,
    ForegroundGc = 2,
    Checkpoint = 3,
    Gc = 4,
    Io = 5,
    Log = 6,
    Nonce = 7,
    Map = 8,
    MapTree = 9,
    Buffered = 10,
    SegmentData = 11,
    Signal = 12,
}

const RANKS: usize = 13;

thread_local! {
    /// How many locks of each rank this thread holds (debug builds only).
    static HELD: RefCell<[u16; RANKS]> = const { RefCell::new([0; RANKS]) };
}

/// Whether this thread holds no lock of the order (always true in release builds, which
/// do not count).
pub(crate) fn holds_none() -> bool {
    HELD.with(|held| held.borrow().iter().all(|&n| n == 0))
}

/// Proof that the current thread registered a lock of `rank`; unregisters when dropped.
struct Held(Rank);

impl Held {
    fn acquire(rank: Rank) -> Held {
        if cfg!(debug_assertions) {
            HELD.with(|held| {
                let mut held = held.borrow_mut();
                if let Some(higher) = (rank as usize + 1..RANKS).find(|&r| held[r] > 0) {
                    panic!("lock order violated: taking {rank:?} while holding rank {higher} (see store/lock.rs)");
                }
                assert!(
                    held[rank as usize] == 0 || rank == Rank::BlockStripe,
                    "lock order violated: taking {rank:?} twice"
                );
                held[rank as usize] += 1;
            });
        }
        Held(rank)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if cfg!(debug_assertions) {
            HELD.with(|held| held.borrow_mut()[self.0 as usize] -= 1);
        }
    }
}

/// Locks a standard library mutex kept outside the lock order (the write permits),
/// ignoring poisoning like the ranked locks below.
pub(crate) fn lock_unranked<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A mutex with a place in the lock order.
///
/// The standard library's locks, not `parking_lot`'s: a contended `parking_lot` lock calls
/// `sched_yield` up to seven times before it sleeps, and on a busy machine a yield hands
/// the core to another thread for a whole time slice — traced under 4K random writes at
/// QD32 on 2 cores, ~11,000 yields a second, 0.6 s of them a second, and the largest share of
/// the milliseconds the slowest writes spent not running (docs/space.md, "Yielding
/// locks"). The standard library's futex locks spin briefly and then sleep until woken.
/// A panic while a lock is held does not poison it for the other threads (as before).
pub(crate) struct Mutex<T> {
    rank: Rank,
    inner: std::sync::Mutex<T>,
}

pub(crate) struct MutexGuard<'a, T> {
    /// `None` only inside `wait_for`, which gives the guard to the condition variable.
    guard: Option<std::sync::MutexGuard<'a, T>>,
    _held: Held,
}

impl<T> Mutex<T> {
    pub fn new(rank: Rank, value: T) -> Mutex<T> {
        Mutex { rank, inner: std::sync::Mutex::new(value) }
    }

    pub fn lock(&self) -> MutexGuard<'_, T> {
        let held = Held::acquire(self.rank);
        MutexGuard { guard: Some(lock_unranked(&self.inner)), _held: held }
    }

    /// The value, through exclusive access (no lock is taken).
    pub fn get_mut(&mut self) -> &mut T {
        self.inner.get_mut().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T> MutexGuard<'_, T> {
    /// Waits on `condvar` for at most `timeout`, releasing the lock meanwhile.
    pub fn wait_for(&mut self, condvar: &Condvar, timeout: Duration) {
        let guard = self.guard.take().expect("a held guard");
        let (guard, _) = condvar.wait_timeout(guard, timeout).unwrap_or_else(PoisonError::into_inner);
        self.guard = Some(guard);
    }
}

impl<T> Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard.as_ref().expect("a held guard")
    }
}

impl<T> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_mut().expect("a held guard")
    }
}

/// A reader-writer lock with a place in the lock order.
/// (The standard library's, as `Mutex`.)
pub(crate) struct RwLock<T> {
    rank: Rank,
    inner: std::sync::RwLock<T>,
}

pub(crate) struct ReadGuard<'a, T> {
    guard: std::sync::RwLockReadGuard<'a, T>,
    _held: Held,
}

pub(crate) struct WriteGuard<'a, T> {
    guard: std::sync::RwLockWriteGuard<'a, T>,
    _held: Held,
}

impl<T> RwLock<T> {
    pub fn new(rank: Rank, value: T) -> RwLock<T> {
        RwLock { rank, inner: std::sync::RwLock::new(value) }
    }

    pub fn read(&self) -> ReadGuard<'_, T> {
        let held = Held::acquire(self.rank);
        ReadGuard { guard: self.inner.read().unwrap_or_else(PoisonError::into_inner), _held: held }
    }

    pub fn write(&self) -> WriteGuard<'_, T> {
        let held = Held::acquire(self.rank);
        WriteGuard { guard: self.inner.write().unwrap_or_else(PoisonError::into_inner), _held: held }
    }

    pub fn into_inner(self) -> T {
        self.inner.into_inner().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T> Deref for ReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> Deref for WriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locks_taken_in_rank_order_are_fine() {
        let log = Mutex::new(Rank::Log, 1);
        let map = RwLock::new(Rank::Map, 2);
        let _log = log.lock();
        let _map = map.read();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "lock order violated")]
    fn a_lock_taken_against_the_order_panics_in_debug_builds() {
        let log = Mutex::new(Rank::Log, 1);
        let map = RwLock::new(Rank::Map, 2);
        let _map = map.read();
        let _log = log.lock();
    }

    #[test]
    fn the_nonce_source_may_be_taken_under_the_log_and_idle_work_before_anything() {
        let idle = Mutex::new(Rank::Idle, ());
        let log = Mutex::new(Rank::Log, ());
        let nonce = Mutex::new(Rank::Nonce, ());
        let _idle = idle.lock();
        let _log = log.lock();
        let _nonce = nonce.lock();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "lock order violated")]
    fn the_nonce_source_under_the_map_panics_in_debug_builds() {
        let map = RwLock::new(Rank::Map, ());
        let nonce = Mutex::new(Rank::Nonce, ());
        let _map = map.read();
        let _nonce = nonce.lock();
    }

    #[test]
    fn releasing_a_lock_lets_a_lower_one_be_taken_again() {
        let checkpoint = Mutex::new(Rank::Checkpoint, ());
        let gc = Mutex::new(Rank::Gc, ());
        drop(gc.lock());
        let _checkpoint = checkpoint.lock();
        let _gc = gc.lock();
    }
}
