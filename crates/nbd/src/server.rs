//! zdisk's own NBD server: a few event loops, not a thread per request.
//!
//! ```text
//! acceptor ──handshake thread per new connection──▶ loop k (round robin)
//! loop: epoll(connections, its ReadQueue's ring, its inbox)
//!   read request    → ReadQueue::submit; replied when the ring completes it, out of order
//!                     (decoded on the loop, or on a worker when it has ≥ 4 fragments)
//!   write/trim/zero → the engine, on the loop — or on a worker when the client has others
//!                     in flight and the workers hold fewer jobs than there are cores
//!   flush, FUA      → a worker, which replies itself (they wait for the device)
//! ```
//!
//! A read costs no thread hand-off: the loop that parsed it submits its device reads to
//! its own ring (`zdisk_engine::ReadQueue`, one `io_uring_enter` for every read parsed in a
//! pass) and answers it when they complete. A write is CPU work (compress, append in
//! memory; write admission bounds it to one per core, `store/permits.rs`): alone it runs on
//! the loop, beside others it is shared with the workers so that one connection's writes
//! use every core. What waits for the device — a flush, a FUA request — goes to a worker so
//! the loop keeps serving reads.
//!
//! Invariants:
//! - a connection's requests are parsed in order; replies go out as they complete (NBD
//!   allows any order), each whole under the connection's write lock;
//! - malformed input (bad magic, an oversized write payload, a failed handshake) closes
//!   that connection with one log line and touches nothing else: no other connection, no
//!   store state;
//! - at most `READS_PER_CONNECTION_MAX` reads of a connection are in flight; past that the
//!   loop stops reading its socket until some complete (the client's TCP window then
//!   bounds what it sends), so memory per connection is bounded;
//! - every request is counted once in the metrics, with its latency;
//! - `Server::stop` closes the listener and every connection, waits for the reads in flight
//!   and the workers' requests, and returns; the store is the caller's to close.
//!
//! TLS (`Config::tls`): a connection that starts TLS (`NBD_OPT_STARTTLS`) never reaches a
//! loop — its bytes need the TLS session to be read, and an OpenSSL session is one thread's at
//! a time — and is served by threads of its own: its handshake's thread goes on as the only
//! user of the session (parse requests, send replies, over a non-blocking socket it polls) and
//! `TLS_WORKERS` workers serve its requests with the engine's blocking calls, at most
//! `TLS_REQUESTS_IN_FLIGHT_MAX` at once. The same checks, limits, metrics and drain refusal
//! apply (`proto::validate`, `serve_now`). Every accepted connection is tracked from accept
//! until it is handed to a loop or closed, so `Server::stop` shuts those still in their
//! handshake (or served over TLS) too and waits for their threads: none of them holds the
//! store once it returns.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::epoll;
use zdisk_engine::{ErrorKind, ExtentKind, ReadDone, ReadPlan, ReadQueue, Reaped, BLOCK_SIZE};

use crate::handshake::{Ended, Export, HandshakeError, Negotiation, TlsPolicy};
use crate::metrics::Op;
use crate::proto::{self, Command, Limits, Request, REQUEST_HEADER_BYTES};
use crate::service::Shared;
use crate::tls::TlsServer;

/// Reads of one connection in flight at once (fio at QD32 needs 32; libnbd clients send at
/// most their own queue depth).
const READS_PER_CONNECTION_MAX: usize = 256;
/// Device reads in flight on one loop's ring.
const RING_DEPTH: usize = 256;
/// How long a client may take over its handshake, and a reply may wait for the client to
/// read (a client that stops reading must not stall its loop's other connections for long).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
const SEND_TIMEOUT: Duration = Duration::from_secs(60);
/// How often loops and the acceptor look at the stop flag while nothing happens.
const POLL_STEP: Duration = Duration::from_millis(100);
/// Bytes asked of a socket per `recv`.
const RECV_BYTES: usize = 256 << 10;
/// Requests queued for the blocking workers before a loop waits for room.
const JOBS_MAX: usize = 1024;
/// epoll keys below this name a loop's own descriptors; connections count up from it.
const INBOX_KEY: u64 = 0;
const RING_KEY: u64 = 1;
const FIRST_CONNECTION_KEY: u64 = 2;
/// A read with this many fragments to decode (16 KiB of blocks) is decoded on a worker:
/// below it the hand-off costs more than the decoding.
const DECODE_ON_WORKER_FRAGMENTS: usize = 4;

/// Where the server listens.
pub enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

/// How the server runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// The export's name (clients may also ask for "", the default export).
    pub export_name: String,
    pub description: String,
    /// Event loops (default: one per core).
    pub loops: usize,
    /// Worker threads: requests that wait for the device (flush, FUA), and writes and
    /// decoding a loop shares with them.
    pub blocking_threads: usize,
    /// TLS offered or required, with the server's credentials (None: TLS off).
    pub tls: Option<Arc<TlsServer>>,
}

impl Config {
    pub fn new(export_name: String, description: String) -> Config {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Config { export_name, description, loops: cores, blocking_threads: (4 * cores).max(8), tls: None }
    }
}

/// A running server.
pub struct Server {
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
    loops: Vec<(JoinHandle<()>, Arc<Inbox>)>,
    workers: Arc<Workers>,
    worker_threads: Vec<JoinHandle<()>>,
    /// The connections not handed to a loop (handshakes, TLS connections).
    sessions: Option<Arc<Sessions>>,
}

impl Server {
    /// Starts serving `shared.store` on `listener`.
    pub fn start(listener: Listener, shared: Arc<Shared>, config: Config) -> io::Result<Server> {
        let stop = Arc::new(AtomicBool::new(false));
        let workers = Arc::new(Workers::default());
        let mut worker_threads = Vec::new();
        for i in 0..config.blocking_threads.max(1) {
            let (workers, shared) = (workers.clone(), shared.clone());
            worker_threads.push(
                std::thread::Builder::new().name(format!("zdisk-nbd-flush-{i}")).spawn(move || workers.run(&shared))?,
            );
        }
        let mut loops = Vec::new();
        for i in 0..config.loops.max(1) {
            let inbox = Arc::new(Inbox::new()?);
            let event_loop = EventLoop::new(shared.clone(), inbox.clone(), workers.clone(), stop.clone())?;
            let thread =
                std::thread::Builder::new().name(format!("zdisk-nbd-loop-{i}")).spawn(move || event_loop.run())?;
            loops.push((thread, inbox));
        }
        let inboxes: Vec<Arc<Inbox>> = loops.iter().map(|(_, inbox)| inbox.clone()).collect();
        // A client still in its handshake holds the store through its thread: tracked, so
        // that `stop` can close it rather than leave the store in use for its timeout.
        let sessions = Some(Arc::new(Sessions::default()));
        let acceptor = {
            let (stop, sessions) = (stop.clone(), sessions.clone());
            std::thread::Builder::new()
                .name("zdisk-nbd-accept".into())
                .spawn(move || accept_loop(listener, shared, config, inboxes, stop, sessions))?
        };
        Ok(Server { stop, acceptor: Some(acceptor), loops, workers, worker_threads, sessions })
    }

    /// Closes the listener and every connection, waits for what is in flight.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        if let Some(sessions) = &self.sessions {
            sessions.close();
        }
        for (thread, inbox) in self.loops.drain(..) {
            inbox.wake();
            let _ = thread.join();
        }
        self.workers.close();
        for thread in self.worker_threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A connection's socket.
enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(timeout),
            Stream::Tcp(s) => s.set_read_timeout(timeout),
        }
    }

    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(timeout),
            Stream::Tcp(s) => s.set_write_timeout(timeout),
        }
    }

    fn shutdown(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }

    fn write_vectored(&self, slices: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).write_vectored(slices),
            Stream::Tcp(s) => (&*s).write_vectored(slices),
        }
    }

    /// For a TLS connection's I/O thread, which polls.
    fn set_nonblocking(&self) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_nonblocking(true),
            Stream::Tcp(s) => s.set_nonblocking(true),
        }
    }

    /// Another handle on the same socket (to shut it down from another thread).
    fn try_clone(&self) -> io::Result<Stream> {
        match self {
            Stream::Unix(s) => s.try_clone().map(Stream::Unix),
            Stream::Tcp(s) => s.try_clone().map(Stream::Tcp),
        }
    }
}

/// A TLS session owns its socket and reads and writes through this.
impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsFd for Stream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Unix(s) => s.as_fd(),
            Stream::Tcp(s) => s.as_fd(),
        }
    }
}

/// `negotiate` reads and writes through this (a blocking stream during the handshake).
impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Tcp(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).write(buf),
            Stream::Tcp(s) => (&*s).write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What a loop and the workers share of a connection: its socket, its limits and the lock
/// that keeps each reply whole.
struct Connection {
    stream: Stream,
    limits: Limits,
    peer: String,
    send_lock: Mutex<()>,
    broken: AtomicBool,
    /// Requests handed to the workers and not yet answered: a connection that said
    /// goodbye is closed only once they are (the spec: outstanding requests are served).
    jobs_in_flight: AtomicUsize,
}

impl Connection {
    /// Sends one reply (header, then data if any) whole; a failure marks the connection
    /// broken (its loop closes it) and is logged once.
    fn send(&self, header: &[u8], data: &[u8]) {
        if self.broken.load(Ordering::Relaxed) {
            return;
        }
        let _held = self.send_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut slices = [IoSlice::new(header), IoSlice::new(data)];
        let mut slices: &mut [IoSlice<'_>] = &mut slices;
        while !slices.is_empty() && slices.iter().any(|s| !s.is_empty()) {
            match self.stream.write_vectored(slices) {
                Ok(0) => return self.break_with("the client closed the connection"),
                Ok(n) => IoSlice::advance_slices(&mut slices, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return self.break_with(&format!("sending a reply failed: {e}")),
            }
        }
    }

    fn break_with(&self, why: &str) {
        if !self.broken.swap(true, Ordering::Relaxed) {
            tracing::info!("NBD connection from {}: {why}", self.peer);
            self.stream.shutdown();
        }
    }
}

/// A loop's mailbox for connections past their handshake.
struct Inbox {
    connections: Mutex<Vec<Arc<Connection>>>,
    wake: OwnedFd,
}

impl Inbox {
    fn new() -> io::Result<Inbox> {
        let wake =
            rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK)?;
        Ok(Inbox { connections: Mutex::new(Vec::new()), wake })
    }

    fn wake(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    fn deliver(&self, connection: Arc<Connection>) {
        self.connections.lock().unwrap_or_else(|e| e.into_inner()).push(connection);
        self.wake();
    }

    fn take(&self) -> Vec<Arc<Connection>> {
        let mut counter = [0u8; 8];
        let _ = rustix::io::read(&self.wake, &mut counter);
        std::mem::take(&mut *self.connections.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Accepts connections until stopped; each handshake runs on a thread of its own (a slow or
/// hostile client holds only that thread, for at most `HANDSHAKE_TIMEOUT`).
fn accept_loop(
    listener: Listener,
    shared: Arc<Shared>,
    config: Config,
    inboxes: Vec<Arc<Inbox>>,
    stop: Arc<AtomicBool>,
    sessions: Option<Arc<Sessions>>,
) {
    let nonblocking = match &listener {
        Listener::Unix(l) => l.set_nonblocking(true),
        Listener::Tcp(l) => l.set_nonblocking(true),
    };
    if let Err(e) = nonblocking {
        tracing::error!("NBD listener: {e}");
        return;
    }
    let mut next_loop = 0usize;
    while !stop.load(Ordering::SeqCst) {
        let accepted = match &listener {
            Listener::Unix(l) => l.accept().map(|(s, _)| (Stream::Unix(s), "a Unix socket client".to_string())),
            Listener::Tcp(l) => l.accept().map(|(s, addr)| {
                let _ = s.set_nodelay(true);
                (Stream::Tcp(s), addr.to_string())
            }),
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let fd = match &listener {
                    Listener::Unix(l) => l.as_fd(),
                    Listener::Tcp(l) => l.as_fd(),
                };
                let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
                let timeout = rustix::event::Timespec { tv_sec: 0, tv_nsec: POLL_STEP.as_nanos() as i64 };
                let _ = rustix::event::poll(&mut fds, Some(&timeout));
                continue;
            }
            Err(e) => {
                tracing::warn!("NBD listener: accept failed: {e}");
                std::thread::sleep(POLL_STEP);
                continue;
            }
        };
        let session = match &sessions {
            Some(sessions) => match sessions.enter(&stream) {
                Ok(session) => Some(session),
                Err(e) => {
                    tracing::warn!("NBD connection from {peer} closed: {e}");
                    continue;
                }
            },
            None => None,
        };
        let inbox = inboxes[next_loop % inboxes.len()].clone();
        next_loop += 1;
        let (shared, config) = (shared.clone(), config.clone());
        let spawned = std::thread::Builder::new().name("zdisk-nbd-handshake".into()).spawn(move || {
            handshake(stream, peer, &shared, &config, &inbox);
            // Untracked only once this thread holds nothing of the store: `Server::stop`
            // waits for that, and its caller then takes the store back.
            drop(shared);
            drop(session);
        });
        if let Err(e) = spawned {
            tracing::warn!("NBD listener: cannot start a handshake thread: {e}");
        }
    }
}

/// Negotiates with a new client and hands the connection to its loop — or, once it starts
/// TLS, serves it on this thread (`serve_tls`).
fn handshake(stream: Stream, peer: String, shared: &Shared, config: &Config, inbox: &Inbox) {
    let export = export_of(shared, config);
    let tls_policy = config.tls.as_ref().map_or(TlsPolicy::Off, |tls| tls.policy());
    let ended = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(HandshakeError::Io).and_then(|()| {
        stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        let mut negotiation = Negotiation::start(&mut &stream, &export, tls_policy)?;
        Ok((negotiation.options(&mut &stream)?, negotiation))
    });
    let negotiated = match ended {
        Ok((Ended::Transmission(negotiated), _)) => negotiated,
        Ok((Ended::StartTls, negotiation)) => {
            let tls = config.tls.as_ref().expect("STARTTLS is acknowledged only with TLS configured");
            return tls_connection(stream, peer, shared, tls, negotiation, &export);
        }
        Err(HandshakeError::Aborted | HandshakeError::ClientClosed) => return,
        Err(e) => {
            tracing::warn!("NBD connection from {peer} closed: {e}");
            return;
        }
    };
    if let Err(e) = stream.set_read_timeout(None).and_then(|()| stream.set_write_timeout(Some(SEND_TIMEOUT))) {
        tracing::warn!("NBD connection from {peer} closed: {e}");
        return;
    }
    let limits = negotiated.limits(&export);
    inbox.deliver(Arc::new(Connection {
        stream,
        limits,
        peer,
        send_lock: Mutex::new(()),
        broken: AtomicBool::new(false),
        jobs_in_flight: AtomicUsize::new(0),
    }));
}

/// The export as a new connection sees it: the store's size now (a resize grows it for
/// connections made after; connected clients keep what they negotiated).
fn export_of(shared: &Shared, config: &Config) -> Export {
    let mut flags = proto::FLAG_HAS_FLAGS | proto::FLAG_SEND_DF | proto::FLAG_CAN_MULTI_CONN | proto::FLAG_SEND_CACHE;
    if shared.read_only {
        flags |= proto::FLAG_READ_ONLY;
    } else {
        flags |= proto::FLAG_SEND_FLUSH
            | proto::FLAG_SEND_FUA
            | proto::FLAG_SEND_TRIM
            | proto::FLAG_SEND_WRITE_ZEROES
            | proto::FLAG_SEND_FAST_ZERO;
    }
    Export {
        name: config.export_name.clone(),
        description: config.description.clone(),
        size_bytes: shared.store.logical_size_bytes(),
        transmission_flags: flags,
        // Any byte range works (the engine read-modify-writes partial blocks); whole blocks
        // are what it prefers.
        min_block_bytes: 1,
        preferred_block_bytes: BLOCK_SIZE as u32,
        max_block_bytes: proto::DEFAULT_MAX_PAYLOAD_BYTES,
    }
}

/// The NBD error for an engine error (NBD has a short list of them).
fn nbd_errno(op: Op, error: &zdisk_engine::Error) -> u32 {
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
struct Job {
    connection: Arc<Connection>,
    work: Work,
    started: Instant,
}

enum Work {
    /// A request other than a read.
    Request { request: Request, payload: Vec<u8> },
    /// A read whose device reads completed: decode it and reply.
    Decode { cookie: u64, offset: u64, plan: ReadPlan },
}

#[derive(Default)]
struct Workers {
    queue: Mutex<(VecDeque<Job>, bool)>,
    ready: Condvar,
    room: Condvar,
    /// Jobs queued or running.
    busy: AtomicUsize,
}

impl Workers {
    /// Queues a job, waiting while `JOBS_MAX` are queued (the loop then serves nothing
    /// until the device catches up, which is the backpressure wanted).
    fn push(&self, job: Job) {
        job.connection.jobs_in_flight.fetch_add(1, Ordering::SeqCst);
        self.busy.fetch_add(1, Ordering::SeqCst);
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        while queue.0.len() >= JOBS_MAX && !queue.1 {
            queue = self.room.wait(queue).unwrap_or_else(|e| e.into_inner());
        }
        queue.0.push_back(job);
        self.ready.notify_one();
    }

    fn close(&self) {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.ready.notify_all();
        self.room.notify_all();
    }

    fn run(&self, shared: &Shared) {
        loop {
            let job = {
                let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(job) = queue.0.pop_front() {
                        self.room.notify_one();
                        break job;
                    }
                    if queue.1 {
                        return;
                    }
                    queue = self.ready.wait(queue).unwrap_or_else(|e| e.into_inner());
                }
            };
            match job.work {
                Work::Request { request, payload } => {
                    let mut reply = Vec::with_capacity(64);
                    serve_now(shared, &job.connection, &request, &payload, job.started, &mut reply);
                    job.connection.send(&reply, &[]);
                }
                Work::Decode { cookie, offset, plan } => {
                    let result = shared.store.finish_read(plan);
                    send_read_reply(shared, &job.connection, cookie, offset, job.started, result);
                }
            }
            job.connection.jobs_in_flight.fetch_sub(1, Ordering::SeqCst);
            self.busy.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Sends a finished read's reply (data, or the error).
fn send_read_reply(
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
fn serve_now(
    shared: &Shared,
    connection: &Connection,
    request: &Request,
    payload: &[u8],
    started: Instant,
    reply: &mut Vec<u8>,
) {
    let store = &shared.store;
    let fua = request.flags & proto::CMD_FLAG_FUA != 0;
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
        Command::Write => (Op::Write, store.write(offset, payload, fua)),
        Command::Trim => (Op::Trim, store.trim(offset, length, fua)),
        Command::WriteZeroes => {
            // Without NO_HOLE the server may leave a hole — where a hole reads as zeroes:
            // the engine trims whole blocks only, so an unaligned range is written as
            // zeroes. One engine call either way keeps the request atomic. FAST_ZERO needs
            // no check: zeroing is a map update in zdisk, never a data write.
            let block = BLOCK_SIZE as u64;
            let aligned = offset.is_multiple_of(block) && length.is_multiple_of(block);
            let may_trim = request.flags & proto::CMD_FLAG_NO_HOLE == 0;
            let result = match may_trim && aligned {
                true => store.trim(offset, length, fua),
                false => store.write_zeroes(offset, length, fua),
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
    match result {
        Ok(()) => proto::simple_reply(reply, request.cookie, 0),
        Err(e) => {
            let message = format!("zdisk {}: {e}", op.name());
            proto::error_reply(reply, &connection.limits, request.cookie, nbd_errno(op, &e), &message);
        }
    }
}

fn block_status_reply(
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

/// A read in flight on a loop's ring.
struct PendingRead {
    connection_key: u64,
    cookie: u64,
    offset: u64,
    started: Instant,
}

/// A connection as its loop sees it.
struct Served {
    connection: Arc<Connection>,
    /// Received bytes not yet parsed (a partial header or payload).
    received: Vec<u8>,
    reads_in_flight: usize,
    /// Not polled for input: too many reads in flight, or the client said goodbye.
    paused: bool,
    disconnecting: bool,
}

struct EventLoop {
    shared: Arc<Shared>,
    inbox: Arc<Inbox>,
    workers: Arc<Workers>,
    /// Cores this process may run on: how many writes the workers may take beside the loop.
    cores: usize,
    stop: Arc<AtomicBool>,
    epoll: OwnedFd,
    queue: ReadQueue,
    connections: HashMap<u64, Served>,
    reads: HashMap<u64, PendingRead>,
    next_key: u64,
    next_tag: u64,
}

impl EventLoop {
    fn new(
        shared: Arc<Shared>,
        inbox: Arc<Inbox>,
        workers: Arc<Workers>,
        stop: Arc<AtomicBool>,
    ) -> io::Result<EventLoop> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        epoll::add(&epoll, &inbox.wake, epoll::EventData::new_u64(INBOX_KEY), epoll::EventFlags::IN)?;
        let queue = ReadQueue::new(shared.store.clone(), RING_DEPTH);
        if let Some(fd) = queue.poll_fd() {
            epoll::add(&epoll, fd, epoll::EventData::new_u64(RING_KEY), epoll::EventFlags::IN)?;
        }
        Ok(EventLoop {
            shared,
            inbox,
            workers,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            stop,
            epoll,
            queue,
            connections: HashMap::new(),
            reads: HashMap::new(),
            next_key: FIRST_CONNECTION_KEY,
            next_tag: 0,
        })
    }

    fn run(mut self) {
        let mut events: Vec<epoll::Event> = Vec::with_capacity(64);
        let mut done = Vec::new();
        let mut ready_keys = Vec::new();
        while !self.stop.load(Ordering::SeqCst) {
            if let Err(e) = self.queue.kick() {
                tracing::error!("NBD server: io_uring submission failed: {e}");
            }
            let timeout = if self.queue.has_ready() { Duration::ZERO } else { POLL_STEP };
            let timeout = rustix::event::Timespec { tv_sec: 0, tv_nsec: timeout.as_nanos() as i64 };
            events.clear();
            match epoll::wait(&self.epoll, rustix::buffer::spare_capacity(&mut events), Some(&timeout)) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::error!("NBD server: epoll failed: {e}");
                    break;
                }
            }
            ready_keys.clear();
            for event in &events {
                match event.data.u64() {
                    INBOX_KEY => self.adopt(),
                    RING_KEY => {}
                    key => ready_keys.push(key),
                }
            }
            for &key in &ready_keys {
                self.receive(key);
            }
            self.queue.reap_undecoded(&mut done);
            for (tag, reaped) in done.drain(..) {
                self.answer_read(tag, reaped);
            }
            self.close_finished();
        }
        self.close_all();
    }

    /// Registers the connections the acceptor delivered.
    fn adopt(&mut self) {
        for connection in self.inbox.take() {
            let key = self.next_key;
            self.next_key += 1;
            let registered = epoll::add(
                &self.epoll,
                connection.stream.as_fd(),
                epoll::EventData::new_u64(key),
                epoll::EventFlags::IN,
            );
            if let Err(e) = registered {
                tracing::warn!("NBD connection from {} closed: {e}", connection.peer);
                continue;
            }
            let served =
                Served { connection, received: Vec::new(), reads_in_flight: 0, paused: false, disconnecting: false };
            self.connections.insert(key, served);
        }
    }

    /// Reads what the socket has and serves every whole request in it.
    fn receive(&mut self, key: u64) {
        let Some(served) = self.connections.get_mut(&key) else { return };
        loop {
            served.received.reserve(RECV_BYTES);
            let received = rustix::net::recv(
                served.connection.stream.as_fd(),
                rustix::buffer::spare_capacity(&mut served.received),
                rustix::net::RecvFlags::DONTWAIT,
            );
            match received {
                Ok((0, _)) => {
                    served.disconnecting = true;
                    break;
                }
                Ok((n, _)) if n < RECV_BYTES => break,
                Ok(_) => {}
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    served.connection.break_with(&format!("receiving failed: {e}"));
                    served.disconnecting = true;
                    break;
                }
            }
            // A long write payload arrives over many calls; serve what is whole first.
            if served.received.len() >= 2 * RECV_BYTES {
                break;
            }
        }
        self.parse(key);
    }

    /// Serves the whole requests in a connection's received bytes, in order.
    fn parse(&mut self, key: u64) {
        let Some(served) = self.connections.get_mut(&key) else { return };
        let mut received = std::mem::take(&mut served.received);
        let connection = served.connection.clone();
        let mut at = 0;
        let mut reply = Vec::new();
        while received.len() - at >= REQUEST_HEADER_BYTES {
            let header: &[u8; REQUEST_HEADER_BYTES] =
                received[at..at + REQUEST_HEADER_BYTES].try_into().expect("sliced");
            let request = match proto::parse_request(header) {
                Ok(request) => request,
                Err(e) => {
                    connection.break_with(&format!("closed: {e}"));
                    break;
                }
            };
            let payload_bytes = match proto::payload_bytes(&request, &connection.limits) {
                Ok(bytes) => bytes,
                Err(e) => {
                    connection.break_with(&format!("closed: {e}"));
                    break;
                }
            };
            if received.len() - at < REQUEST_HEADER_BYTES + payload_bytes {
                break;
            }
            let payload = &received[at + REQUEST_HEADER_BYTES..at + REQUEST_HEADER_BYTES + payload_bytes];
            at += REQUEST_HEADER_BYTES + payload_bytes;
            reply.clear();
            // The client has other requests in flight or already sent: a write handed to a
            // worker runs beside them on another core. Alone (QD1), it runs here and
            // saves the hand-off.
            let served = self.connections.get(&key).expect("still served");
            let alone = at == received.len()
                && served.reads_in_flight == 0
                && connection.jobs_in_flight.load(Ordering::SeqCst) == 0;
            self.dispatch(key, &connection, request, payload, alone, &mut reply);
            if !reply.is_empty() {
                connection.send(&reply, &[]);
            }
            let served = self.connections.get_mut(&key).expect("still served");
            if served.disconnecting || served.reads_in_flight >= READS_PER_CONNECTION_MAX {
                break;
            }
        }
        received.drain(..at);
        let served = self.connections.get_mut(&key).expect("still served");
        served.received = received;
        let pause = served.disconnecting || served.reads_in_flight >= READS_PER_CONNECTION_MAX;
        if connection.broken.load(Ordering::Relaxed) {
            served.disconnecting = true;
        }
        self.set_paused(key, pause || served_broken(&connection));
    }

    fn set_paused(&mut self, key: u64, pause: bool) {
        let Some(served) = self.connections.get_mut(&key) else { return };
        if served.paused == pause {
            return;
        }
        served.paused = pause;
        let flags = if pause { epoll::EventFlags::empty() } else { epoll::EventFlags::IN };
        let _ = epoll::modify(&self.epoll, served.connection.stream.as_fd(), epoll::EventData::new_u64(key), flags);
    }

    /// Serves one request: a read goes to the ring; a request that waits for the device,
    /// or a write that is not `alone`, to a worker; the rest here. `reply` gets what is to
    /// be sent now.
    fn dispatch(
        &mut self,
        key: u64,
        connection: &Arc<Connection>,
        request: Request,
        payload: &[u8],
        alone: bool,
        reply: &mut Vec<u8>,
    ) {
        let limits = &connection.limits;
        if request.command == Command::Disconnect {
            self.connections.get_mut(&key).expect("served").disconnecting = true;
            return;
        }
        if let Err(errno) = proto::validate(&request, limits) {
            let message = format!("invalid request ({:?} at {} +{})", request.command, request.offset, request.length);
            return proto::error_reply(reply, limits, request.cookie, errno, &message);
        }
        let started = Instant::now();
        let fua = request.flags & proto::CMD_FLAG_FUA != 0;
        match request.command {
            Command::Read => {
                let tag = self.next_tag;
                self.next_tag += 1;
                self.reads.insert(
                    tag,
                    PendingRead { connection_key: key, cookie: request.cookie, offset: request.offset, started },
                );
                self.connections.get_mut(&key).expect("served").reads_in_flight += 1;
                self.queue.submit(tag, request.offset, request.length as usize);
            }
            Command::Flush => {
                let work = Work::Request { request, payload: Vec::new() };
                self.workers.push(Job { connection: connection.clone(), work, started })
            }
            // A write beside others goes to a worker while the workers hold fewer jobs than
            // there are cores, and runs here otherwise: each hand-off costs a wake-up, so
            // the loop keeps a share. One writer more than the cores is what lets a writer
            // wait for a write permit, the write path's load signal for its LZ4 fallback
            // (`store/permits.rs`): with only as many writers as cores no permit was ever
            // waited for, 50–65% of blocks got zstd:1 and 128K sequential writes ran at
            // 197–325 MB/s with 286 µs of CPU each; with one more, 424–581 MB/s, 186 µs, 1–20%
            // zstd:1 (nbdkit's 8 threads: 334–498 MB/s). While GC
            // paces writes they wait rather than compute: every one goes to a worker, so
            // one that sleeps for its slot holds up neither the loop's reads nor the other
            // writes (nbdkit has a thread per request in flight for the same reason).
            Command::Write | Command::Trim | Command::WriteZeroes
                if fua
                    || (!alone
                        && (self.workers.busy.load(Ordering::SeqCst) < self.cores
                            || self.shared.store.host_writes_may_wait())) =>
            {
                let work = Work::Request { request, payload: payload.to_vec() };
                self.workers.push(Job { connection: connection.clone(), work, started })
            }
            _ => serve_now(&self.shared, connection, &request, payload, started, reply),
        }
    }

    /// Answers a read back from the ring: a small one here, one with several fragments to
    /// decode on a worker (so a single connection's large reads use every core).
    fn answer_read(&mut self, tag: u64, reaped: Reaped) {
        let pending = self.reads.remove(&tag).expect("a completion names a pending read");
        let key = pending.connection_key;
        let Some(served) = self.connections.get_mut(&key) else { return };
        served.reads_in_flight -= 1;
        let connection = served.connection.clone();
        match reaped {
            Reaped::Decode(plan) if plan.fragments_to_decode() >= DECODE_ON_WORKER_FRAGMENTS => {
                let work = Work::Decode { cookie: pending.cookie, offset: pending.offset, plan };
                self.workers.push(Job { connection, work, started: pending.started });
            }
            Reaped::Decode(plan) => {
                let result = self.shared.store.finish_read(plan);
                send_read_reply(&self.shared, &connection, pending.cookie, pending.offset, pending.started, result);
            }
            Reaped::Finished(result) => {
                send_read_reply(&self.shared, &connection, pending.cookie, pending.offset, pending.started, result);
            }
        }
        let served = self.connections.get(&key).expect("served");
        if !served.disconnecting && served.reads_in_flight < READS_PER_CONNECTION_MAX && served.paused {
            // Requests may be waiting whole in the received bytes.
            self.set_paused(key, false);
            self.parse(key);
        }
    }

    /// Drops connections that said goodbye (or broke) once their reads and their workers'
    /// requests are answered (a loop pass at most `POLL_STEP` after the last).
    fn close_finished(&mut self) {
        let finished: Vec<u64> = self
            .connections
            .iter()
            .filter(|(_, s)| (s.disconnecting || served_broken(&s.connection)) && s.reads_in_flight == 0)
            .filter(|(_, s)| s.connection.jobs_in_flight.load(Ordering::SeqCst) == 0 || served_broken(&s.connection))
            .map(|(&key, _)| key)
            .collect();
        for key in finished {
            if let Some(served) = self.connections.remove(&key) {
                let _ = epoll::delete(&self.epoll, served.connection.stream.as_fd());
                served.connection.stream.shutdown();
            }
        }
    }

    /// At stop: closes every connection and waits for the reads in flight.
    fn close_all(&mut self) {
        for served in self.connections.values() {
            served.connection.stream.shutdown();
        }
        let mut done = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.reads.is_empty() && Instant::now() < deadline {
            let _ = self.queue.kick();
            self.queue.reap(&mut done);
            for (tag, _) in done.drain(..) {
                self.reads.remove(&tag);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.connections.clear();
    }
}

fn served_broken(connection: &Connection) -> bool {
    connection.broken.load(Ordering::Relaxed)
}

/// How long `Server::stop` waits for TLS connections' threads once their sockets are shut
/// (one may be inside a flush).
const SESSIONS_CLOSE_WAIT: Duration = Duration::from_secs(30);

/// With TLS configured: the connections not handed to a loop (in their handshake, or served
/// over TLS by their own thread), each with a handle on its socket, so `Server::stop` can shut
/// them and wait until their threads let go of the store.
#[derive(Default)]
struct Sessions {
    state: Mutex<SessionsState>,
    left: Condvar,
}

#[derive(Default)]
struct SessionsState {
    sockets: HashMap<u64, Stream>,
    next_id: u64,
    closing: bool,
}

impl Sessions {
    /// Tracks a newly accepted connection until its guard drops; refused once stopping.
    fn enter(self: &Arc<Self>, stream: &Stream) -> io::Result<SessionGuard> {
        let socket = stream.try_clone()?;
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.closing {
            return Err(io::Error::other("the server is stopping"));
        }
        let id = state.next_id;
        state.next_id += 1;
        state.sockets.insert(id, socket);
        Ok(SessionGuard { sessions: self.clone(), id })
    }

    /// Shuts every tracked socket (its thread's next read or write fails) and waits for the
    /// threads to finish, at most `SESSIONS_CLOSE_WAIT`.
    fn close(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.closing = true;
        for socket in state.sockets.values() {
            socket.shutdown();
        }
        let deadline = Instant::now() + SESSIONS_CLOSE_WAIT;
        while !state.sockets.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                tracing::warn!(
                    "NBD server: {} connections (handshakes or TLS) still busy {} s after they were closed",
                    state.sockets.len(),
                    SESSIONS_CLOSE_WAIT.as_secs()
                );
                return;
            }
            state = self.left.wait_timeout(state, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// A tracked connection; dropping it (its thread is done with it) untracks it.
struct SessionGuard {
    sessions: Arc<Sessions>,
    id: u64,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        let mut state = self.sessions.state.lock().unwrap_or_else(|e| e.into_inner());
        state.sockets.remove(&self.id);
        self.sessions.left.notify_all();
    }
}

/// A connection that was acknowledged `NBD_OPT_STARTTLS`: the TLS handshake and the rest of
/// the negotiation over TLS on this thread, then its requests (`serve_tls`).
fn tls_connection(
    stream: Stream,
    peer: String,
    shared: &Shared,
    tls: &TlsServer,
    mut negotiation: Negotiation<'_>,
    export: &Export,
) {
    // The handshake's timeouts still bound the TLS handshake and the options after it.
    let mut stream = match tls.accept(stream) {
        Ok(stream) => stream,
        Err(e) => {
            tracing::warn!("NBD connection from {peer} closed: TLS handshake failed: {e}");
            return;
        }
    };
    let negotiated = match negotiation.options(&mut stream) {
        Ok(Ended::Transmission(negotiated)) => negotiated,
        Ok(Ended::StartTls) => unreachable!("NBD_OPT_STARTTLS is refused once TLS is started"),
        Err(HandshakeError::Aborted | HandshakeError::ClientClosed) => {
            let _ = stream.shutdown();
            return;
        }
        Err(e) => {
            tracing::warn!("NBD connection from {peer} closed: {e}");
            return;
        }
    };
    // (From here the socket is non-blocking, polled by `serve_tls`: its timeouts no longer apply.)
    let connection = match stream.get_ref().try_clone() {
        // `serve_now` takes a `Connection` for its limits. Replies here go through the TLS
        // session, never through this handle on the raw socket: marked broken, its `send` is
        // a no-op (a plain-text byte on a TLS connection would break it).
        Ok(socket) => Connection {
            stream: socket,
            limits: negotiated.limits(export),
            peer,
            send_lock: Mutex::new(()),
            broken: AtomicBool::new(true),
            jobs_in_flight: AtomicUsize::new(0),
        },
        Err(e) => {
            tracing::warn!("NBD connection from {peer} closed: {e}");
            return;
        }
    };
    serve_tls(stream, &connection, shared);
}

/// Requests of one TLS connection served at once (its workers), and in flight at most (then
/// its TLS session is not read until some are answered: memory per connection stays bounded).
const TLS_WORKERS: usize = 8;
const TLS_REQUESTS_IN_FLIGHT_MAX: usize = 16;
/// Bytes asked of a TLS session per read (it yields at most one 16 KiB record per call).
const TLS_RECV_BYTES: usize = 64 << 10;

/// A request of a TLS connection, for one of its workers.
struct TlsJob {
    request: Request,
    payload: Vec<u8>,
    started: Instant,
}

/// Replies a TLS connection's workers finished, for its I/O thread, which `wake` wakes.
struct TlsDone {
    replies: Mutex<Vec<Vec<u8>>>,
    wake: OwnedFd,
}

/// Serves a TLS connection until the client disconnects, the connection fails, or the client
/// breaks the protocol (which closes it, as on a loop). An OpenSSL session may not be read
/// and written from two threads, so this thread is its only user — it reads requests and
/// sends replies, over a non-blocking socket — and `TLS_WORKERS` threads serve the requests
/// with the engine's blocking calls, so a client's requests overlap as on a loop (replies go
/// out as they complete, each whole).
fn serve_tls(mut stream: openssl::ssl::SslStream<Stream>, connection: &Connection, shared: &Shared) {
    let wake = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK);
    let (wake, ()) =
        match wake.map_err(io::Error::from).and_then(|wake| Ok((wake, stream.get_ref().set_nonblocking()?))) {
            Ok(ready) => ready,
            Err(e) => {
                tracing::warn!("NBD connection from {} (TLS) closed: {e}", connection.peer);
                return;
            }
        };
    let done = TlsDone { replies: Mutex::new(Vec::new()), wake };
    let (jobs, queue) = std::sync::mpsc::sync_channel::<TlsJob>(TLS_REQUESTS_IN_FLIGHT_MAX);
    let queue = Mutex::new(queue);
    let closed_because = std::thread::scope(|scope| {
        // Owned here: dropped when the I/O side returns, which ends the workers.
        let jobs = jobs;
        for i in 0..TLS_WORKERS {
            let spawned = std::thread::Builder::new()
                .name(format!("zdisk-nbd-tls-{i}"))
                .spawn_scoped(scope, || tls_worker(shared, connection, &queue, &done));
            if let Err(e) = spawned {
                return Some(format!("cannot start a worker thread: {e}"));
            }
        }
        tls_io(&mut stream, connection, jobs, &done)
    });
    if let Some(why) = closed_because {
        tracing::info!("NBD connection from {} (TLS): {why}", connection.peer);
    }
    // close_notify (best effort: the socket is non-blocking and may be gone), then the socket.
    let _ = stream.shutdown();
    stream.get_ref().shutdown();
}

/// A TLS connection's worker: serves its requests until the I/O side hangs up.
fn tls_worker(
    shared: &Shared,
    connection: &Connection,
    queue: &Mutex<std::sync::mpsc::Receiver<TlsJob>>,
    done: &TlsDone,
) {
    loop {
        let job = match queue.lock().unwrap_or_else(|e| e.into_inner()).recv() {
            Ok(job) => job,
            Err(_) => return,
        };
        let mut reply = Vec::new();
        serve_tls_request(shared, connection, &job.request, &job.payload, job.started, &mut reply);
        done.replies.lock().unwrap_or_else(|e| e.into_inner()).push(reply);
        let _ = rustix::io::write(&done.wake, &1u64.to_ne_bytes());
    }
}

/// The I/O side of a TLS connection, the only user of its session: reads and parses requests
/// in order and hands them to the workers (at most `TLS_REQUESTS_IN_FLIGHT_MAX` in flight),
/// sends the replies they finish, and waits (poll) for the socket or a finished reply. Returns
/// why the connection closed, None when the client said goodbye (all its requests answered).
fn tls_io(
    stream: &mut openssl::ssl::SslStream<Stream>,
    connection: &Connection,
    jobs: std::sync::mpsc::SyncSender<TlsJob>,
    done: &TlsDone,
) -> Option<String> {
    use openssl::ssl::ErrorCode;

    let mut chunk = vec![0u8; TLS_RECV_BYTES];
    // Received bytes not yet parsed: at most a partial request (header and payload).
    let mut received: Vec<u8> = Vec::new();
    // Whole replies to send, the first `sent_bytes` into the front one already sent.
    let mut output: VecDeque<Vec<u8>> = VecDeque::new();
    let mut sent_bytes = 0usize;
    let mut in_flight = 0usize;
    // The client said goodbye (NBD_CMD_DISC, TLS close or end of stream): read no more.
    let mut disconnecting = false;
    // The socket hung up or failed: only finished work is waited for.
    let mut socket_gone = false;
    let mut blocked_since: Option<Instant> = None;
    loop {
        for reply in done.replies.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            in_flight -= 1;
            output.push_back(reply);
        }

        let mut read_wants_writable = false;
        while !disconnecting {
            // Whole requests go to the workers, in order, while there is room (some may wait
            // in `received` from an earlier pass, when the room ran out).
            let mut at = 0;
            while in_flight < TLS_REQUESTS_IN_FLIGHT_MAX && received.len() - at >= REQUEST_HEADER_BYTES {
                let header: &[u8; REQUEST_HEADER_BYTES] =
                    received[at..at + REQUEST_HEADER_BYTES].try_into().expect("sliced");
                let request = match proto::parse_request(header) {
                    Ok(request) => request,
                    Err(e) => return Some(format!("closed: {e}")),
                };
                let payload_bytes = match proto::payload_bytes(&request, &connection.limits) {
                    Ok(bytes) => bytes,
                    Err(e) => return Some(format!("closed: {e}")),
                };
                let end = at + REQUEST_HEADER_BYTES + payload_bytes;
                if received.len() < end {
                    break;
                }
                let payload = received[at + REQUEST_HEADER_BYTES..end].to_vec();
                at = end;
                if request.command == Command::Disconnect {
                    disconnecting = true;
                    break;
                }
                in_flight += 1;
                let job = TlsJob { request, payload, started: Instant::now() };
                // Never blocks: the channel holds as many as may be in flight.
                if jobs.send(job).is_err() {
                    return Some("its workers stopped".into());
                }
            }
            received.drain(..at);
            if disconnecting || in_flight >= TLS_REQUESTS_IN_FLIGHT_MAX {
                break;
            }
            match stream.ssl_read(&mut chunk) {
                Ok(n) => received.extend_from_slice(&chunk[..n]),
                Err(e) if e.code() == ErrorCode::WANT_READ => break,
                // TLS 1.3 may answer a key update while reading.
                Err(e) if e.code() == ErrorCode::WANT_WRITE => {
                    read_wants_writable = true;
                    break;
                }
                // The client closed (TLS close_notify, or the end of the stream).
                Err(e) if e.code() == ErrorCode::ZERO_RETURN => disconnecting = true,
                Err(e) if e.code() == ErrorCode::SYSCALL && e.io_error().is_none() => disconnecting = true,
                Err(e) => return Some(format!("receiving failed: {e}")),
            }
        }

        let mut write_blocked = false;
        while let Some(front) = output.front() {
            match stream.ssl_write(&front[sent_bytes..]) {
                Ok(n) => {
                    sent_bytes += n;
                    blocked_since = None;
                    if sent_bytes == front.len() {
                        output.pop_front();
                        sent_bytes = 0;
                    }
                }
                Err(e) if matches!(e.code(), ErrorCode::WANT_WRITE | ErrorCode::WANT_READ) => {
                    write_blocked = true;
                    break;
                }
                Err(e) => return Some(format!("sending a reply failed: {e}")),
            }
        }
        if disconnecting && in_flight == 0 && output.is_empty() {
            return None;
        }
        if write_blocked {
            // A client that stops reading must not hold its workers' replies forever.
            let since = *blocked_since.get_or_insert_with(Instant::now);
            if since.elapsed() > SEND_TIMEOUT {
                return Some(format!("a reply waited {} s for the client to read", SEND_TIMEOUT.as_secs()));
            }
        }

        let mut socket_flags = rustix::event::PollFlags::empty();
        if !disconnecting && in_flight < TLS_REQUESTS_IN_FLIGHT_MAX {
            socket_flags |= rustix::event::PollFlags::IN;
        }
        if write_blocked || read_wants_writable {
            socket_flags |= rustix::event::PollFlags::OUT;
        }
        if socket_gone {
            socket_flags = rustix::event::PollFlags::empty();
        }
        let socket = stream.get_ref().as_fd();
        let mut fds = [
            rustix::event::PollFd::new(&done.wake, rustix::event::PollFlags::IN),
            rustix::event::PollFd::new(&socket, socket_flags),
        ];
        let timeout = rustix::event::Timespec { tv_sec: 0, tv_nsec: POLL_STEP.as_nanos() as i64 };
        match rustix::event::poll(if socket_gone { &mut fds[..1] } else { &mut fds }, Some(&timeout)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Some(format!("poll failed: {e}")),
        }
        let hung_up = rustix::event::PollFlags::HUP | rustix::event::PollFlags::ERR;
        if !socket_gone && fds[1].revents().intersects(hung_up) {
            // Nothing more can come; replies still owed may fail to send, which closes.
            socket_gone = true;
            disconnecting = true;
        }
        let mut counter = [0u8; 8];
        let _ = rustix::io::read(&done.wake, &mut counter);
    }
}

/// Serves one request of a TLS connection, appending its whole reply (a read's data too) to
/// `reply`: what a loop's `dispatch` does, with the engine's blocking read for reads (on a
/// TLS connection's worker).
fn serve_tls_request(
    shared: &Shared,
    connection: &Connection,
    request: &Request,
    payload: &[u8],
    started: Instant,
    reply: &mut Vec<u8>,
) {
    let limits = &connection.limits;
    if let Err(errno) = proto::validate(request, limits) {
        let message = format!("invalid request ({:?} at {} +{})", request.command, request.offset, request.length);
        return proto::error_reply(reply, limits, request.cookie, errno, &message);
    }
    if request.command != Command::Read {
        return serve_now(shared, connection, request, payload, started, reply);
    }
    // The data is read straight into the reply, after its header.
    let length = request.length as usize;
    if limits.structured_replies {
        proto::structured_read_header(reply, request.cookie, request.offset, request.length, true);
    } else {
        proto::simple_reply(reply, request.cookie, 0);
    }
    let at = reply.len();
    reply.resize(at + length, 0);
    match shared.store.read(request.offset, &mut reply[at..]) {
        Ok(()) => shared.metrics.record(Op::Read, length as u64, started.elapsed(), true),
        Err(e) => {
            shared.metrics.record(Op::Read, 0, started.elapsed(), false);
            reply.clear();
            let message = format!("zdisk read: {e}");
            proto::error_reply(reply, limits, request.cookie, nbd_errno(Op::Read, &e), &message);
        }
    }
}
