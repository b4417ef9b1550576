//! What the background work (GC, checkpoints, write-out, idle work — `worker.rs`) and the
//! foreground GC rounds of waiting writers coordinate on.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar};

use super::lock::{Mutex, Rank};

pub(crate) struct Background {
    /// Shared with the log, which wakes the worker once per segment it opens.
    pub wakeups: Arc<Wakeups>,
    /// Rank 3: one GC victim at a time, and never while segments are freed.
    pub gc_lock: Mutex<()>,
    /// Rank 1: one foreground GC round at a time; `foreground_rounds` counts finished rounds.
    pub foreground_gc: Mutex<()>,
    pub foreground_rounds: AtomicU64,
}

impl Background {
    pub fn new(wakeups: Arc<Wakeups>) -> Background {
        Background {
            wakeups,
            gc_lock: Mutex::new(Rank::Gc, ()),
            foreground_gc: Mutex::new(Rank::ForegroundGc, ()),
            foreground_rounds: AtomicU64::new(0),
        }
    }
}

/// The background threads' wake-up flags.
pub(crate) struct WorkerSignal {
    pub stop: bool,
    /// GC / checkpoint work may be due.
    pub kick: bool,
    /// Buffered log bytes are waiting to be written.
    pub kick_writer: bool,
}

/// How the background threads are woken: shared by the store and its log (which wakes the
/// worker once per segment it opens).
pub(crate) struct Wakeups {
    /// Rank 10.
    pub signal: Mutex<WorkerSignal>,
    pub signal_cv: Condvar,
    pub writer_cv: Condvar,
}

impl Wakeups {
    pub fn new() -> Wakeups {
        Wakeups {
            signal: Mutex::new(Rank::Signal, WorkerSignal { stop: false, kick: false, kick_writer: false }),
            signal_cv: Condvar::new(),
            writer_cv: Condvar::new(),
        }
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
}
