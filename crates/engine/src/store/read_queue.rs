//! Host reads with their device reads in flight together on one io_uring: the engine's
//! asynchronous read interface, for a front end's event loop (docs/architecture.md,
//! "Front ends").
//!
//! A read is submitted (`submit`: the map is looked up and what memory holds is decoded at
//! once, `Store::plan_read`), its device reads go to the ring, and it completes later
//! (`reap`: decoded and checked, `Store::finish_read`). No thread waits for the device: one
//! thread keeps as many reads in flight as it submits, and one `submit` syscall carries
//! all that were queued since the last (`kick`).
//!
//! Invariants:
//! - a plan's buffers belong to the kernel from the submission of its reads until each of
//!   their completions is reaped; the plan stays in `slots` (whose heap buffers do not
//!   move) until then, and dropping the queue waits for every read in flight;
//! - at most `depth` device reads are in flight, so the completion queue (twice that)
//!   never overflows; plans beyond it wait in `waiting`, in order;
//! - where io_uring is unavailable (or the backing has no descriptor) a read is done at
//!   once, synchronously, and completes at the next `reap`: same results, no overlap.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::Arc;

use super::read::{ReadDone, ReadPlan};
use super::Store;
use crate::error::{Error, Result};

/// A read back from the queue: finished (memory answered it, or it failed), or its device
/// reads done and its decoding left to the caller (`Store::finish_read`), who may run it on
/// another core — a 128 KiB read decodes 32 blocks.
pub enum Reaped {
    Finished(Result<ReadDone>),
    Decode(ReadPlan),
}

/// A read in flight: the plan whose buffers the device fills.
struct InFlight {
    tag: u64,
    plan: ReadPlan,
    /// Device reads not yet completed.
    outstanding: usize,
    /// The first failed device read.
    error: Option<io::Error>,
}

/// Reads submitted by one thread, completed as their device reads finish.
pub struct ReadQueue {
    store: Arc<Store>,
    ring: Option<io_uring::IoUring>,
    fd: RawFd,
    depth: usize,
    /// Device reads submitted to the ring or queued in its submission queue.
    reads_in_flight: usize,
    /// Pushed to the submission queue since the last `kick`.
    unsubmitted: usize,
    slots: Vec<Option<InFlight>>,
    free_slots: Vec<usize>,
    /// Plans waiting for room in the ring.
    waiting: VecDeque<(u64, ReadPlan)>,
    /// Reads that completed without the ring (memory answered, an error, no ring).
    ready: VecDeque<(u64, Result<ReadDone>)>,
    /// Plans whose device reads completed in the last `reap_undecoded` (reused).
    finished_slots: Vec<usize>,
}

/// A ring whose completions do not interrupt the thread while it runs (`COOP_TASKRUN`,
/// Linux 5.19; without it where refused): by default a device read completing while the
/// submitting loop runs sends its core an inter-processor interrupt so the loop posts the
/// completion at once, though the loop reaps only at its next `epoll_wait` anyway (which a
/// pending completion cuts short with EINTR). A sleeping thread is still woken. On this VM
/// (2026-11-29, 16 KiB random reads QD1 from 8 fio jobs through NBD) rescheduling
/// interrupts fell from 0.40 to 0.25–0.27 per request (`RES` in /proc/interrupts); IOPS
/// within noise (docs/nbd.md).
fn ring_of(depth: usize) -> io::Result<io_uring::IoUring> {
    let entries = depth as u32;
    io_uring::IoUring::builder()
        .setup_cqsize(2 * entries)
        .setup_coop_taskrun()
        .build(entries)
        .or_else(|_| io_uring::IoUring::builder().setup_cqsize(2 * entries).build(entries))
}

impl ReadQueue {
    /// A queue of `depth` device reads in flight at most (each request's reads count).
    pub fn new(store: Arc<Store>, depth: usize) -> ReadQueue {
        let depth = depth.clamp(1, 4096);
        let fd = store.inner.backing.raw_fd();
        let ring = fd.and_then(|_| match ring_of(depth) {
            Ok(ring) => Some(ring),
            Err(e) => {
                tracing::info!("io_uring is unavailable ({e}): reads complete one at a time");
                None
            }
        });
        ReadQueue {
            store,
            ring,
            fd: fd.unwrap_or(-1),
            depth,
            reads_in_flight: 0,
            unsubmitted: 0,
            slots: Vec::new(),
            free_slots: Vec::new(),
            waiting: VecDeque::new(),
            ready: VecDeque::new(),
            finished_slots: Vec::new(),
        }
    }

    /// The descriptor that polls readable while completions wait in the ring (None without
    /// a ring: then every read is in `has_ready` at once).
    pub fn poll_fd(&self) -> Option<BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.ring.as_ref().map(|ring| ring.as_fd())
    }

    /// Whether `reap` has something without waiting for the device.
    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Requests submitted and not yet reaped.
    pub fn len(&self) -> usize {
        self.slots.len() - self.free_slots.len() + self.waiting.len() + self.ready.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts reading `len` bytes at `offset`; its result comes back from `reap` with `tag`.
    /// Reads of blocks in memory (or refused at once) are ready at the next `reap`.
    pub fn submit(&mut self, tag: u64, offset: u64, len: usize) {
        let mut plan = match self.store.plan_read(offset, len) {
            Ok(plan) => plan,
            Err(e) => return self.ready.push_back((tag, Err(e))),
        };
        if plan.device_read_count() == 0 {
            return self.ready.push_back((tag, self.store.finish_read(plan)));
        }
        if self.ring.is_none() {
            let result = self.store.read_planned(&mut plan).and_then(|()| self.store.finish_read(plan));
            return self.ready.push_back((tag, result));
        }
        if self.waiting.is_empty() && self.has_room_for(&plan) {
            self.start(tag, plan);
        } else {
            self.waiting.push_back((tag, plan));
        }
    }

    /// Submits what was queued since the last call, in one syscall.
    pub fn kick(&mut self) -> io::Result<()> {
        let Some(ring) = self.ring.as_mut() else { return Ok(()) };
        if self.unsubmitted == 0 {
            return Ok(());
        }
        loop {
            match ring.submit() {
                Ok(_) => {
                    self.unsubmitted = 0;
                    return Ok(());
                }
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Moves every completed read to `done` (tag, result), decoded here, without waiting;
    /// starts waiting plans as room frees up.
    pub fn reap(&mut self, done: &mut Vec<(u64, Result<ReadDone>)>) {
        let mut reaped = Vec::new();
        self.reap_undecoded(&mut reaped);
        for (tag, reaped) in reaped {
            done.push((
                tag,
                match reaped {
                    Reaped::Finished(result) => result,
                    Reaped::Decode(plan) => self.store.finish_read(plan),
                },
            ));
        }
    }

    /// As `reap`, but leaves the decoding of reads whose device reads completed to the
    /// caller (`Reaped::Decode`).
    pub fn reap_undecoded(&mut self, done: &mut Vec<(u64, Reaped)>) {
        done.extend(self.ready.drain(..).map(|(tag, result)| (tag, Reaped::Finished(result))));
        let Some(ring) = self.ring.as_mut() else { return };
        for completion in ring.completion() {
            self.reads_in_flight -= 1;
            let slot = (completion.user_data() >> 32) as usize;
            let run = (completion.user_data() & 0xffff_ffff) as usize;
            let in_flight = self.slots[slot].as_mut().expect("a completion names a read in flight");
            in_flight.outstanding -= 1;
            let expected = in_flight.plan.device_reads().nth(run).map_or(0, |(_, buf)| buf.len());
            match usize::try_from(completion.result()) {
                Ok(n) if n == expected => {}
                // O_DIRECT reads of whole sectors inside the store are short only at the end
                // of a file, which the store never reads past.
                Ok(n) => {
                    in_flight.error.get_or_insert_with(|| {
                        io::Error::new(io::ErrorKind::UnexpectedEof, format!("short read: {n} of {expected} bytes"))
                    });
                }
                Err(_) => {
                    in_flight.error.get_or_insert_with(|| io::Error::from_raw_os_error(-completion.result()));
                }
            }
            if in_flight.outstanding == 0 {
                self.finished_slots.push(slot);
            }
        }
        for slot in self.finished_slots.drain(..) {
            let in_flight = self.slots[slot].take().expect("finished once");
            self.free_slots.push(slot);
            let reaped = match in_flight.error {
                Some(e) => Reaped::Finished(Err(Error::io("read of a planned range", e))),
                None => Reaped::Decode(in_flight.plan),
            };
            done.push((in_flight.tag, reaped));
        }
        while let Some((_, plan)) = self.waiting.front() {
            if !self.has_room_for(plan) {
                break;
            }
            let (tag, plan) = self.waiting.pop_front().expect("a front");
            self.start(tag, plan);
        }
    }

    fn has_room_for(&self, plan: &ReadPlan) -> bool {
        // A plan larger than the whole depth goes alone.
        self.reads_in_flight == 0 || self.reads_in_flight + plan.device_read_count() <= self.depth
    }

    /// Pushes a plan's reads to the submission queue (submitted at the next `kick`).
    fn start(&mut self, tag: u64, mut plan: ReadPlan) {
        let ring = self.ring.as_mut().expect("start needs a ring");
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        let reads = plan.device_read_count();
        for (run, (offset, buf)) in plan.device_reads().enumerate() {
            let entry = io_uring::opcode::Read::new(io_uring::types::Fd(self.fd), buf.as_mut_ptr(), buf.len() as u32)
                .offset(offset)
                .build()
                .user_data(((slot as u64) << 32) | run as u64);
            loop {
                // SAFETY: the kernel writes into `buf` until this entry's completion is
                // reaped. `buf` is a heap buffer of `plan`, which moves into `slots[slot]`
                // below (the heap allocation does not move with it) and leaves it only in
                // `reap`, after the last of its completions; `Drop` waits for every read in
                // flight. `self.fd` is the backing's, which `self.store` keeps open.
                if unsafe { ring.submission().push(&entry) }.is_ok() {
                    break;
                }
                // The submission queue is full: hand it to the kernel to make room.
                if let Err(e) = ring.submit() {
                    if !matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) {
                        panic!("io_uring submission failed with reads queued: {e}");
                    }
                }
                self.unsubmitted = 0;
            }
            self.unsubmitted += 1;
        }
        self.reads_in_flight += reads;
        self.slots[slot] = Some(InFlight { tag, plan, outstanding: reads, error: None });
    }
}

impl Drop for ReadQueue {
    fn drop(&mut self) {
        let Some(ring) = self.ring.as_mut() else { return };
        while self.reads_in_flight > 0 {
            if let Err(e) = ring.submit_and_wait(1) {
                if !matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) {
                    // Buffers the device may still write into must outlive it.
                    tracing::error!("io_uring wait failed with reads in flight ({e}): leaking their buffers");
                    std::mem::forget(std::mem::take(&mut self.slots));
                    return;
                }
            }
            self.reads_in_flight -= ring.completion().count();
        }
    }
}
