//! Connections that started TLS: tracked from accept (`Sessions`, which also holds every
//! connection still in its handshake, so `Server::stop` can close them), then served by
//! threads of their own — the OpenSSL session has one user, its I/O thread, and
//! `TLS_WORKERS` threads serve its requests with the engine's blocking calls.

use super::*;
/// How long `Server::stop` waits for TLS connections' threads once their sockets are shut
/// (one may be inside a flush).
pub(super) const SESSIONS_CLOSE_WAIT: Duration = Duration::from_secs(30);

/// With TLS configured: the connections not handed to a loop (in their handshake, or served
/// over TLS by their own thread), each with a handle on its socket, so `Server::stop` can shut
/// them and wait until their threads let go of the store.
#[derive(Default)]
pub(super) struct Sessions {
    pub(super) state: Mutex<SessionsState>,
    pub(super) left: Condvar,
}

#[derive(Default)]
pub(super) struct SessionsState {
    pub(super) sockets: HashMap<u64, Stream>,
    pub(super) next_id: u64,
    pub(super) closing: bool,
}

impl Sessions {
    /// Tracks a newly accepted connection until its guard drops; refused once stopping.
    pub(super) fn enter(self: &Arc<Self>, stream: &Stream) -> io::Result<SessionGuard> {
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
    pub(super) fn close(&self) {
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
pub(super) struct SessionGuard {
    pub(super) sessions: Arc<Sessions>,
    pub(super) id: u64,
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
pub(super) fn tls_connection(
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
        Ok(socket) => Connection::new(socket, negotiated.limits(export), peer, true),
        Err(e) => {
            tracing::warn!("NBD connection from {peer} closed: {e}");
            return;
        }
    };
    serve_tls(stream, &connection, shared);
}

/// Requests of one TLS connection served at once (its workers), and in flight at most (then
/// its TLS session is not read until some are answered: memory per connection stays bounded).
pub(super) const TLS_WORKERS: usize = 8;
pub(super) const TLS_REQUESTS_IN_FLIGHT_MAX: usize = 16;
/// Bytes asked of a TLS session per read (it yields at most one 16 KiB record per call).
pub(super) const TLS_RECV_BYTES: usize = 64 << 10;

/// A request of a TLS connection, for one of its workers.
pub(super) struct TlsJob {
    pub(super) request: Request,
    pub(super) payload: Vec<u8>,
    pub(super) started: Instant,
}

/// Replies a TLS connection's workers finished, for its I/O thread, which `wake` wakes.
pub(super) struct TlsDone {
    pub(super) replies: Mutex<Vec<Vec<u8>>>,
    pub(super) wake: OwnedFd,
}

/// Serves a TLS connection until the client disconnects, the connection fails, or the client
/// breaks the protocol (which closes it, as on a loop). An OpenSSL session may not be read
/// and written from two threads, so this thread is its only user — it reads requests and
/// sends replies, over a non-blocking socket — and `TLS_WORKERS` threads serve the requests
/// with the engine's blocking calls, so a client's requests overlap as on a loop (replies go
/// out as they complete, each whole).
pub(super) fn serve_tls(mut stream: openssl::ssl::SslStream<Stream>, connection: &Connection, shared: &Shared) {
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
pub(super) fn tls_worker(
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
pub(super) fn tls_io(
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
            disconnecting = match hand_on_requests(&mut received, connection, &jobs, &mut in_flight) {
                Ok(disconnecting) => disconnecting,
                Err(why) => return Some(why),
            };
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

        let write_blocked = match send_replies(stream, &mut output, &mut sent_bytes) {
            Ok(Sent { progressed, blocked }) => {
                if progressed {
                    blocked_since = None;
                }
                blocked
            }
            Err(why) => return Some(why),
        };
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

/// What one `send_replies` pass did.
struct Sent {
    /// Some bytes went out (the client is reading).
    progressed: bool,
    /// Replies are left that the session would not take now.
    blocked: bool,
}

/// Sends the finished replies in order, as far as the session takes them now, or says why
/// the connection must close. `sent_bytes` is how much of the front reply went out already.
fn send_replies(
    stream: &mut openssl::ssl::SslStream<Stream>,
    output: &mut VecDeque<Vec<u8>>,
    sent_bytes: &mut usize,
) -> Result<Sent, String> {
    use openssl::ssl::ErrorCode;
    let mut progressed = false;
    while let Some(front) = output.front() {
        match stream.ssl_write(&front[*sent_bytes..]) {
            Ok(n) => {
                progressed = true;
                *sent_bytes += n;
                if *sent_bytes == front.len() {
                    output.pop_front();
                    *sent_bytes = 0;
                }
            }
            Err(e) if matches!(e.code(), ErrorCode::WANT_WRITE | ErrorCode::WANT_READ) => {
                return Ok(Sent { progressed, blocked: true });
            }
            Err(e) => return Err(format!("sending a reply failed: {e}")),
        }
    }
    Ok(Sent { progressed, blocked: false })
}

/// Hands the whole requests in `received` to the workers, in order, while there is room (the
/// rest wait there for a later pass); returns whether the client said goodbye, or why the
/// connection must close.
fn hand_on_requests(
    received: &mut Vec<u8>,
    connection: &Connection,
    jobs: &std::sync::mpsc::SyncSender<TlsJob>,
    in_flight: &mut usize,
) -> Result<bool, String> {
    let mut at = 0;
    let mut disconnecting = false;
    while *in_flight < TLS_REQUESTS_IN_FLIGHT_MAX {
        let Some((request, payload_bytes)) =
            proto::next_request(&received[at..], &connection.limits).map_err(|e| format!("closed: {e}"))?
        else {
            break;
        };
        let payload = received[at + REQUEST_HEADER_BYTES..at + REQUEST_HEADER_BYTES + payload_bytes].to_vec();
        at += REQUEST_HEADER_BYTES + payload_bytes;
        if request.command == Command::Disconnect {
            disconnecting = true;
            break;
        }
        *in_flight += 1;
        // Never blocks: the channel holds as many as may be in flight.
        jobs.send(TlsJob { request, payload, started: Instant::now() })
            .map_err(|_| "its workers stopped".to_string())?;
    }
    received.drain(..at);
    Ok(disconnecting)
}

/// Serves one request of a TLS connection, appending its whole reply (a read's data too) to
/// `reply`: what a loop's `dispatch` does, with the engine's blocking read for reads (on a
/// TLS connection's worker).
pub(super) fn serve_tls_request(
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
