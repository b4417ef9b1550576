//! What the server does with a request that is not a read on the loop's ring: the workers
//! (flush, FUA, writes shared with the loops, decoding of large reads), the engine call and
//! its reply, and the NBD error for an engine error.

use super::*;
use zdisk_engine::Durability;
/// The NBD error for an engine error (NBD has a short list of them).
pub(super) fn nbd_errno(op: Op, error: &zdisk_engine::Error) -> u32 {
    match (error.kind(), op) {
        (ErrorKind::OutOfRange, Op::Write | Op::Zero) => proto::ENOSPC,
        (ErrorKind::OutOfRange, _) => proto::EINVAL,
        _ => match error.errno() {
            libc::EPERM | libc::EROFS => proto::EPERM,
            libc::ENOMEM => proto::ENOMEM,
            libc::EINVAL => proto::EINVAL,
            libc::ENOSPC => proto::ENOSPC,
            libc::EOVERFLOW => proto::EOVERFLOW,
            libc::ENOTSUP => proto::ENOTSUP,
            libc::ESHUTDOWN => proto::ESHUTDOWN,
            _ => proto::EIO,
        },
    }
}

/// Work for the workers: what waits for the device (flush, FUA), and CPU work a loop hands
/// on so that one connection's requests use every core.
pub(super) struct Job {
    pub(super) connection: Arc<Connection>,
    pub(super) work: Work,
    pub(super) started: Instant,
}

pub(super) enum Work {
    /// A request other than a read.
    Request { request: Request, payload: Vec<u8> },
    /// Small writes (trims, zeroings) of one pass, shared by a loop: served in order, their
    /// replies gathered `REPLIES_PER_SEND` to a send.
    Writes(Vec<(Request, Vec<u8>)>),
    /// A read whose device reads completed: decode it and reply.
    Decode { cookie: u64, offset: u64, plan: ReadPlan },
}

/// The jobs waiting for a worker, behind `Workers::queue`.
#[derive(Default)]
pub(super) struct Queue {
    jobs: VecDeque<Job>,
    /// Flush requests waiting, served together: one worker at a time claims all of them and
    /// answers them with one engine flush (`Workers::serve_flushes`).
    flushes: Vec<Job>,
    /// A worker is serving flushes, and takes those queued meanwhile before it lets go: a
    /// flush pushed then wakes nobody.
    flushes_claimed: bool,
    closed: bool,
    /// Workers waiting on `ready`: a push wakes one only if there is one (a futex call each).
    idle_workers: usize,
}

impl Queue {
    fn len(&self) -> usize {
        self.jobs.len() + self.flushes.len()
    }
}

/// What a worker took from the queue.
enum Taken {
    Job(Job),
    Flushes(Vec<Job>),
}

#[derive(Default)]
pub(super) struct Workers {
    pub(super) queue: Mutex<Queue>,
    pub(super) ready: Condvar,
    pub(super) room: Condvar,
    /// Jobs queued or running.
    pub(super) busy: AtomicUsize,
}

impl Workers {
    /// Queues a job, waiting while `JOBS_MAX` are queued (the loop then serves nothing
    /// until the device catches up, which is the backpressure wanted).
    pub(super) fn push(&self, job: Job) {
        job.connection.jobs_in_flight.fetch_add(1, Ordering::SeqCst);
        self.busy.fetch_add(1, Ordering::SeqCst);
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        while queue.len() >= JOBS_MAX && !queue.closed {
            queue = self.room.wait(queue).unwrap_or_else(|e| e.into_inner());
        }
        let flush = matches!(&job.work, Work::Request { request, .. } if request.command == Command::Flush);
        let wake = match flush {
            true => {
                queue.flushes.push(job);
                !queue.flushes_claimed && queue.idle_workers > 0
            }
            false => {
                queue.jobs.push_back(job);
                queue.idle_workers > 0
            }
        };
        // Woken after the lock is let go, so the worker does not wake only to wait for it.
        drop(queue);
        if wake {
            self.ready.notify_one();
        }
    }

    pub(super) fn close(&self) {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        self.ready.notify_all();
        self.room.notify_all();
    }

    pub(super) fn run(&self, shared: &Shared) {
        loop {
            let taken = {
                let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    let was_full = queue.len() >= JOBS_MAX;
                    let taken = if !queue.flushes_claimed && !queue.flushes.is_empty() {
                        queue.flushes_claimed = true;
                        Some(Taken::Flushes(std::mem::take(&mut queue.flushes)))
                    } else {
                        queue.jobs.pop_front().map(Taken::Job)
                    };
                    if let Some(taken) = taken {
                        // Loops wait for room only on a full queue, so the first take from
                        // it wakes them all (each looks again; one that finds it full again
                        // waits for the next); other takes skip the futex call.
                        if was_full {
                            drop(queue);
                            self.room.notify_all();
                        }
                        break taken;
                    }
                    if queue.closed {
                        return;
                    }
                    queue.idle_workers += 1;
                    queue = self.ready.wait(queue).unwrap_or_else(|e| e.into_inner());
                    queue.idle_workers -= 1;
                }
            };
            let job = match taken {
                Taken::Job(job) => job,
                Taken::Flushes(flushes) => {
                    self.serve_flushes(shared, flushes);
                    continue;
                }
            };
            match job.work {
                Work::Request { request, payload } => {
                    let mut reply = Vec::with_capacity(64);
                    serve_now(shared, &job.connection, &request, &payload, job.started, &mut reply);
                    job.connection.send(&reply, &[]);
                }
                Work::Writes(writes) => {
                    let mut reply = Vec::with_capacity(64 * REPLIES_PER_SEND);
                    for (i, (request, payload)) in writes.iter().enumerate() {
                        serve_now(shared, &job.connection, request, payload, job.started, &mut reply);
                        if (i + 1) % REPLIES_PER_SEND == 0 || i + 1 == writes.len() {
                            job.connection.send(&reply, &[]);
                            reply.clear();
                        }
                    }
                }
                Work::Decode { cookie, offset, plan } => {
                    let result = shared.store.finish_read(plan);
                    send_read_reply(shared, &job.connection, cookie, offset, job.started, result);
                }
            }
            self.done(&job.connection);
        }
    }

    fn done(&self, connection: &Connection) {
        connection.jobs_in_flight.fetch_sub(1, Ordering::SeqCst);
        self.busy.fetch_sub(1, Ordering::SeqCst);
    }

    /// Group commit at the server: the flushes queued are answered by one engine flush, and
    /// those queued while it syncs by the next, until none wait. One worker serves flushes at
    /// a time, so N clients flushing at once cost one wake-up and one sync per round instead
    /// of N workers woken to queue on the engine's write-out lock (`Store::flush` also joins
    /// flushes, but each waiter there is a thread woken twice). One engine flush answers a
    /// flush request it started after: it makes durable every write acknowledged before it
    /// read the log's end, which is every write acknowledged before the request arrived.
    fn serve_flushes(&self, shared: &Shared, mut flushes: Vec<Job>) {
        loop {
            let result = shared.store.flush();
            for job in &flushes {
                let Work::Request { request, .. } = &job.work else { unreachable!("only flushes are claimed") };
                let mut reply = Vec::with_capacity(64);
                shared.metrics.record(Op::Flush, 0, job.started.elapsed(), result.is_ok());
                answer(&job.connection, request, Op::Flush, &result, &mut reply);
                job.connection.send(&reply, &[]);
                self.done(&job.connection);
            }
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            if queue.flushes.is_empty() {
                queue.flushes_claimed = false;
                return;
            }
            flushes = std::mem::take(&mut queue.flushes);
        }
    }
}

/// Sends a finished read's reply (data, or the error).
pub(super) fn send_read_reply(
    shared: &Shared,
    connection: &Connection,
    cookie: u64,
    offset: u64,
    started: Instant,
    result: zdisk_engine::Result<ReadDone>,
) {
    let limits = &connection.limits;
    let mut header = Vec::with_capacity(32);
    match result {
        Ok(done) => {
            let data = done.data();
            shared.metrics.record(Op::Read, data.len() as u64, started.elapsed(), true);
            if limits.structured_replies {
                proto::structured_read_header(&mut header, cookie, offset, data.len() as u32, true);
            } else {
                proto::simple_reply(&mut header, cookie, 0);
            }
            connection.send(&header, data);
        }
        Err(e) => {
            shared.metrics.record(Op::Read, 0, started.elapsed(), false);
            let message = format!("zdisk read: {e}");
            proto::error_reply(&mut header, limits, cookie, nbd_errno(Op::Read, &e), &message);
            connection.send(&header, &[]);
        }
    }
}

/// Serves a request that is not a read, appending its reply to `reply`.
pub(super) fn serve_now(
    shared: &Shared,
    connection: &Connection,
    request: &Request,
    payload: &[u8],
    started: Instant,
    reply: &mut Vec<u8>,
) {
    let store = &shared.store;
    let durability = match request.flags & proto::CMD_FLAG_FUA != 0 {
        true => Durability::Fua,
        false => Durability::Buffered,
    };
    let changes = matches!(request.command, Command::Write | Command::Trim | Command::WriteZeroes);
    if changes && shared.draining.load(Ordering::Relaxed) {
        // Refused once the server drains for shutdown, so the flush and checkpoint the
        // drain did stay complete.
        let op = match request.command {
            Command::Write => Op::Write,
            Command::Trim => Op::Trim,
            _ => Op::Zero,
        };
        shared.metrics.record(op, 0, Duration::ZERO, false);
        let message = "zdisk: the server is shutting down";
        return proto::error_reply(reply, &connection.limits, request.cookie, proto::ESHUTDOWN, message);
    }
    let (offset, length) = (request.offset, u64::from(request.length));
    let (op, result) = match request.command {
        Command::Flush => (Op::Flush, store.flush()),
        Command::Write => (Op::Write, store.write(offset, payload, durability)),
        Command::Trim => (Op::Trim, store.trim(offset, length, durability)),
        Command::WriteZeroes => {
            // Without NO_HOLE the server may leave a hole — where a hole reads as zeroes:
            // the engine trims whole blocks only, so an unaligned range is written as
            // zeroes. One engine call either way keeps the request atomic. FAST_ZERO needs
            // no check: zeroing is a map update in zdisk, never a data write.
            let block = BLOCK_SIZE as u64;
            let aligned = offset.is_multiple_of(block) && length.is_multiple_of(block);
            let may_trim = request.flags & proto::CMD_FLAG_NO_HOLE == 0;
            let result = match may_trim && aligned {
                true => store.trim(offset, length, durability),
                false => store.write_zeroes(offset, length, durability),
            };
            (Op::Zero, result)
        }
        Command::BlockStatus => {
            let result = store.block_status(offset, length);
            shared.metrics.record(Op::Extents, length, started.elapsed(), result.is_ok());
            match result {
                Ok(extents) => block_status_reply(reply, connection, request, &extents),
                Err(e) => proto::error_reply(
                    reply,
                    &connection.limits,
                    request.cookie,
                    nbd_errno(Op::Extents, &e),
                    &e.to_string(),
                ),
            }
            return;
        }
        Command::Cache => return proto::simple_reply(reply, request.cookie, 0),
        Command::Read | Command::Disconnect | Command::Unknown(_) => unreachable!("not served here"),
    };
    let bytes = if op == Op::Write { payload.len() as u64 } else { length };
    shared.metrics.record(op, bytes, started.elapsed(), result.is_ok());
    answer(connection, request, op, &result, reply);
}

/// Appends a served request's reply: success, or the NBD error for the engine's error, with
/// its message.
fn answer(connection: &Connection, request: &Request, op: Op, result: &zdisk_engine::Result<()>, reply: &mut Vec<u8>) {
    match result {
        Ok(()) => proto::simple_reply(reply, request.cookie, 0),
        Err(e) => {
            let message = format!("zdisk {}: {e}", op.name());
            proto::error_reply(reply, &connection.limits, request.cookie, nbd_errno(op, e), &message);
        }
    }
}

pub(super) fn block_status_reply(
    reply: &mut Vec<u8>,
    connection: &Connection,
    request: &Request,
    extents: &[zdisk_engine::Extent],
) {
    let end = request.offset + u64::from(request.length);
    let mut out: Vec<(u32, u32)> = Vec::new();
    for extent in extents {
        let start = extent.offset.max(request.offset);
        let stop = (extent.offset + extent.length).min(end);
        if stop <= start {
            continue;
        }
        let flags = match extent.kind {
            ExtentKind::Data => 0,
            ExtentKind::Zero => proto::STATE_ZERO,
            ExtentKind::Hole => proto::STATE_HOLE | proto::STATE_ZERO,
        };
        out.push(((stop - start) as u32, flags));
        if request.flags & proto::CMD_FLAG_REQ_ONE != 0 {
            break;
        }
    }
    let context = connection.limits.block_status_context.expect("validated: a context was negotiated");
    proto::structured_block_status(reply, request.cookie, context, &out, true);
}
