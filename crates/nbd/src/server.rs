//! zdisk's own NBD server: a few event loops, not a thread per request.
//!
//! ```text
//! acceptor ──handshake thread per new connection──▶ loop k (round robin)
//! loop: epoll(connections, its ReadQueue's ring, its inbox)
//!   read request    → ReadQueue::submit; replied when the ring completes it, out of order
//!                     (decoded on the loop, or on a worker when it has > 4 fragments)
//!   write/trim/zero → the engine, on the loop — or on a worker when the client has others
//!                     in flight and the workers hold fewer jobs than there are cores;
//!                     a pass's small writes (≤ 16 KiB) split between the loop and the
//!                     workers, one batch per worker
//!   flush, FUA      → a worker, which replies itself (they wait for the device); the
//!                     flushes queued meanwhile are all answered by one engine flush
//! ```
//!
//! A read costs no thread hand-off: the loop that parsed it submits its device reads to
//! its own ring (`zdisk_engine::ReadQueue`, one `io_uring_enter` for every read parsed in a
//! pass) and answers it when they complete. A write is CPU work (compress, append in
//! memory; write admission bounds it to one per core, `WritePermits` in `store/space.rs`): alone it runs on
//! the loop, beside others it is shared with the workers so that one connection's writes
//! use every core — small ones a batch per worker and pass, since for a 4 KiB write a
//! worker's wake-up costs as much as the write. What waits for the device — a flush, a FUA
//! request — goes to a worker so the loop keeps serving reads.
//!
//! Invariants:
//! - a connection's requests are parsed in order; replies go out as they complete (NBD
//!   allows any order), each whole under the connection's write lock — the replies a loop
//!   or a worker produces in one pass or batch up to `REPLIES_PER_SEND` to a send, never
//!   held past the end of that pass or batch;
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

mod connection;
mod requests;
mod tls_connection;

use connection::{Connection, Inbox, Stream};
use requests::{nbd_errno, send_read_reply, serve_now, Job, Work, Workers};
use tls_connection::{tls_connection, Sessions};

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
/// A read with at most this many fragments to decode (16 KiB: a database page) is decoded on
/// the loop; a larger one on a worker, so one connection's large reads use every core. The
/// hand-off (a worker's wake-up, its reply) costs more than decoding 16 KiB: fio 16K random
/// reads at QD4 through NBD did 1.16x the IOPS at 0.7x the server CPU per read decoded on the
/// loop, and 1.43x at 0.5x with two busy loops beside (a database's CPU); docs/nbd.md.
const DECODE_ON_LOOP_FRAGMENTS_MAX: usize = 4;
/// Writes (and trims, zeroings) of at most this many bytes that one pass parsed are shared
/// with the workers a batch per worker: for a 4 KiB write the hand-off (a worker's wake-up
/// and sleep, a futex each) cost about what the write itself does.
const SHARED_WRITE_BYTES_MAX: usize = 16 << 10;
/// Replies of small requests a loop or a worker gathers into one send.
const REPLIES_PER_SEND: usize = 8;

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
    inbox.deliver(Arc::new(Connection::new(stream, limits, peer, false)));
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
    /// The requests of the pass being served (kept to reuse its memory).
    parsed: Vec<Parsed>,
}

/// A whole request in a connection's received bytes.
struct Parsed {
    request: Request,
    payload: std::ops::Range<usize>,
    /// A valid write, trim or zeroing of at most `SHARED_WRITE_BYTES_MAX`, without FUA.
    shareable: bool,
    share: Share,
}

/// Who serves a parsed request.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Share {
    /// As `dispatch` decides.
    Dispatch,
    /// The loop: its share of the pass's small writes.
    Loop,
    /// A worker, which serves and answers it.
    Worker,
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
            parsed: Vec::new(),
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

    /// Serves the whole requests in a connection's received bytes, in order. They are parsed
    /// first, so that the pass's small writes can be shared with the workers in one hand-off
    /// each (`share_small_writes`) rather than one per write.
    fn parse(&mut self, key: u64) {
        let Some(served) = self.connections.get_mut(&key) else { return };
        let received = std::mem::take(&mut served.received);
        let connection = served.connection.clone();
        // Parsing stops where the reads in flight would pass their limit (the rest waits in
        // `received` until some complete) and after a goodbye.
        let reads_room = READS_PER_CONNECTION_MAX.saturating_sub(served.reads_in_flight);
        let mut parsed = std::mem::take(&mut self.parsed);
        parsed.clear();
        let (mut at, mut reads) = (0, 0);
        let mut malformed = None;
        while reads < reads_room {
            match proto::next_request(&received[at..], &connection.limits) {
                Ok(Some((request, payload_bytes))) => {
                    let payload = at + REQUEST_HEADER_BYTES..at + REQUEST_HEADER_BYTES + payload_bytes;
                    at = payload.end;
                    reads += usize::from(request.command == Command::Read);
                    let goodbye = request.command == Command::Disconnect;
                    let shareable = is_shareable(&request, &connection.limits);
                    parsed.push(Parsed { request, payload, shareable, share: Share::Dispatch });
                    if goodbye {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    malformed = Some(e);
                    break;
                }
            }
        }
        let started = Instant::now();
        self.share_small_writes(&connection, &received, &mut parsed, started);
        let mut reply = Vec::new();
        let mut replies = 0;
        for (i, next) in parsed.iter().enumerate() {
            if next.share == Share::Worker {
                continue;
            }
            // The client has other requests in flight or already sent: a write handed to a
            // worker runs beside them on another core. Alone (QD1), it runs here and
            // saves the hand-off; so does the loop's share of a pass's small writes.
            let served = self.connections.get(&key).expect("still served");
            let alone = i + 1 == parsed.len()
                && at == received.len()
                && served.reads_in_flight == 0
                && connection.jobs_in_flight.load(Ordering::SeqCst) == 0;
            let here = alone || next.share == Share::Loop;
            let before = reply.len();
            self.dispatch(key, &connection, next.request, &received[next.payload.clone()], here, &mut reply);
            replies += usize::from(reply.len() > before);
            if replies == REPLIES_PER_SEND {
                connection.send(&reply, &[]);
                reply.clear();
                replies = 0;
            }
        }
        if !reply.is_empty() {
            connection.send(&reply, &[]);
        }
        if let Some(e) = malformed {
            connection.break_with(&format!("closed: {e}"));
        }
        let mut received = received;
        received.drain(..at);
        self.parsed = parsed;
        let served = self.connections.get_mut(&key).expect("still served");
        served.received = received;
        let pause = served.disconnecting || served.reads_in_flight >= READS_PER_CONNECTION_MAX;
        if connection.broken.load(Ordering::Relaxed) {
            served.disconnecting = true;
        }
        self.set_paused(key, pause || served_broken(&connection));
    }

    /// Hands a share of a pass's small writes to the workers, one job per worker, so that one
    /// connection's writes use every core for one wake-up per pass instead of one per write
    /// (`SHARED_WRITE_BYTES_MAX`). The loop keeps the first share and serves it itself.
    fn share_small_writes(
        &self,
        connection: &Arc<Connection>,
        received: &[u8],
        parsed: &mut [Parsed],
        started: Instant,
    ) {
        let count = parsed.iter().filter(|p| p.shareable).count();
        let busy = self.workers.busy.load(Ordering::SeqCst);
        // While GC paces writes, each goes to a worker of its own (`dispatch`).
        if count < 2 || busy >= self.cores || self.shared.store.host_writes_may_wait() {
            return;
        }
        let workers = (self.cores - 1).min(self.cores - busy).min(count - 1).max(1);
        let share = count.div_ceil(workers + 1);
        let mut batch = Vec::with_capacity(share);
        let mut seen = 0;
        for next in parsed.iter_mut().filter(|p| p.shareable) {
            seen += 1;
            if seen <= share {
                next.share = Share::Loop;
                continue;
            }
            next.share = Share::Worker;
            batch.push((next.request, received[next.payload.clone()].to_vec()));
            if batch.len() == share {
                let writes = std::mem::replace(&mut batch, Vec::with_capacity(share));
                self.workers.push(Job { connection: connection.clone(), work: Work::Writes(writes), started });
            }
        }
        if !batch.is_empty() {
            self.workers.push(Job { connection: connection.clone(), work: Work::Writes(batch), started });
        }
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
    /// or a write not to be served `here`, to a worker; the rest here. `reply` gets what is to
    /// be sent now.
    fn dispatch(
        &mut self,
        key: u64,
        connection: &Arc<Connection>,
        request: Request,
        payload: &[u8],
        here: bool,
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
            // (`WritePermits` in `store/space.rs`): with only as many writers as cores no permit was ever
            // waited for, 50–65% of blocks got zstd:1 and 128K sequential writes ran at
            // 197–325 MB/s with 286 µs of CPU each; with one more, 424–581 MB/s, 186 µs, 1–20%
            // zstd:1 (nbdkit's 8 threads: 334–498 MB/s). While GC
            // paces writes they wait rather than compute: every one goes to a worker, so
            // one that sleeps for its slot holds up neither the loop's reads nor the other
            // writes (nbdkit has a thread per request in flight for the same reason).
            Command::Write | Command::Trim | Command::WriteZeroes
                if fua
                    || (!here
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
            Reaped::Decode(plan) if plan.fragments_to_decode() > DECODE_ON_LOOP_FRAGMENTS_MAX => {
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

/// Whether a pass may share `request` with the workers (`share_small_writes`): a valid write,
/// trim or zeroing small enough that a hand-off of its own would cost about what it does.
fn is_shareable(request: &Request, limits: &Limits) -> bool {
    matches!(request.command, Command::Write | Command::Trim | Command::WriteZeroes)
        && request.flags & proto::CMD_FLAG_FUA == 0
        && request.length as usize <= SHARED_WRITE_BYTES_MAX
        && proto::validate(request, limits).is_ok()
}

fn served_broken(connection: &Connection) -> bool {
    connection.broken.load(Ordering::Relaxed)
}
