//! Background services of a serving plugin: the live-stats file, the control socket and
//! the metrics HTTP endpoint.
//!
//! Invariants:
//! - each service is one thread with a bounded loop step (≤ 100 ms), so [`Service::stop`]
//!   returns within about that long, before the store is closed at unload;
//! - the live file is replaced atomically (write to `.tmp`, then rename), so a reader sees a
//!   whole snapshot or the previous one, never a torn one; it and the control socket are
//!   removed at stop;
//! - a slow or hostile peer cannot stall a service: every socket has a short timeout and
//!   requests are bounded in size;
//! - the control socket only *grows* the logical size: connected clients keep the export size
//!   they negotiated, so shrinking under them is refused (the CLI says: stop the server).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use zdisk_engine::Store;

use crate::metrics::{render_prometheus, Metrics};

/// Where live files go unless `rundir=` or `$ZDISK_RUN_DIR` says otherwise.
pub const DEFAULT_RUN_DIR: &str = "/run/zdisk";

const STEP: Duration = Duration::from_millis(50);
const LIVE_PERIOD: Duration = Duration::from_secs(1);
const PEER_TIMEOUT: Duration = Duration::from_secs(2);
const REQUEST_BYTES_MAX: u64 = 8 << 10;

/// What the services need from the serving plugin.
pub struct Shared {
    pub store: Arc<Store>,
    pub metrics: Arc<Metrics>,
    pub store_path: PathBuf,
    pub read_only: bool,
    pub metrics_addr: Option<String>,
    /// Set by the `drain` control request when the server is being stopped: from then on
    /// writes, trims and zeroes fail with ESHUTDOWN, so the flush + checkpoint `drain` did
    /// stays complete even if nbdkit must be killed because a client keeps its connection.
    pub draining: std::sync::atomic::AtomicBool,
    /// The `recompress` control request's run: it goes on in a thread of its own (it takes
    /// as long as the store is big) while `recompress-status` reports on it.
    pub recompress: Arc<parking_lot::Mutex<RecompressRun>>,
}

/// The state of the served store's recompression, as `recompress-status` reports it.
#[derive(Debug, Default)]
pub struct RecompressRun {
    pub running: bool,
    pub done: u64,
    pub total: u64,
    /// Of the last finished run: the error, or the result (`segments`, `segments_cleaned`,
    /// `before`, `after`).
    pub error: Option<String>,
    pub report: Option<serde_json::Value>,
}

/// What a `recompress` control request asks for.
enum RecompressRequest {
    /// Into this codec; None: the store's (or its newest dictionary, if it keeps one).
    Codec(Option<zdisk_engine::Codec>),
    /// Train a new dictionary and recompress into it (`recompress-train [LEVEL]`).
    Train(zdisk_engine::DictionaryOptions),
}

/// The report of a finished run as `recompress-status` gives it.
fn report_json(report: &zdisk_engine::RecompressReport) -> serde_json::Value {
    serde_json::json!({
        "segments": report.segments,
        "segments_cleaned": report.segments_cleaned,
        "before": report.before,
        "after": report.after,
        "dictionary": report.dictionary.as_ref().map(|d| serde_json::json!({
            "id": d.id,
            "size_bytes": d.size_bytes,
            "sample_blocks": d.sample_blocks,
            "training_ms": d.training_ms,
            "freed_ids": d.freed_ids,
        })),
    })
}

/// Starts the recompression `request` asks for in a thread of its own; refused while one
/// runs.
fn start_recompress(shared: &Shared, request: RecompressRequest) -> String {
    if shared.read_only {
        return "error the store is served read-only".to_string();
    }
    {
        let mut run = shared.recompress.lock();
        if run.running {
            return "error a recompression is already running".to_string();
        }
        *run = RecompressRun { running: true, ..RecompressRun::default() };
    }
    let (store, run) = (Arc::clone(&shared.store), Arc::clone(&shared.recompress));
    let spawned = std::thread::Builder::new().name("zdisk-recompress".into()).spawn(move || {
        let mut progress = |done, total| {
            let mut run = run.lock();
            (run.done, run.total) = (done, total);
        };
        let result = match request {
            RecompressRequest::Codec(codec) => store.recompress(codec, &mut progress),
            RecompressRequest::Train(options) => store.recompress_with_new_dictionary(&options, &mut progress),
        };
        let mut run = run.lock();
        run.running = false;
        match result {
            Ok(report) => run.report = Some(report_json(&report)),
            Err(e) => run.error = Some(e.to_string()),
        }
    });
    match spawned {
        Ok(_) => "ok".to_string(),
        Err(e) => {
            shared.recompress.lock().running = false;
            format!("error cannot start the recompression thread: {e}")
        }
    }
}

fn recompress_status(shared: &Shared) -> String {
    let run = shared.recompress.lock();
    serde_json::json!({
        "running": run.running,
        "done": run.done,
        "total": run.total,
        "error": run.error,
        "report": run.report,
    })
    .to_string()
}

pub struct Service {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    remove_on_stop: Vec<PathBuf>,
}

pub fn live_file_path(run_dir: &Path, uuid: &str) -> PathBuf {
    run_dir.join(format!("{uuid}.json"))
}

pub fn control_socket_path(run_dir: &Path, uuid: &str) -> PathBuf {
    run_dir.join(format!("{uuid}.ctl"))
}

/// Written at unload when the store failed while served, holding the reason: `zdisk serve`
/// reads it (and removes it) once nbdkit has exited, and exits non-zero.
pub fn failed_file_path(run_dir: &Path, uuid: &str) -> PathBuf {
    run_dir.join(format!("{uuid}.failed"))
}

fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// One JSON snapshot: what `zdisk stat` prints when the store is being served.
pub fn snapshot(shared: &Shared, control: &Path) -> serde_json::Value {
    let info = shared.store.info_of();
    let stats = shared.store.stats();
    serde_json::json!({
        "uuid": info.uuid,
        "pid": std::process::id(),
        "updated_unix_ms": now_unix_ms(),
        "store": shared.store_path,
        // (Served read-only, or the store turned read-only: failed, degraded.)
        "read_only": shared.read_only || stats.state != zdisk_engine::StoreState::Ok,
        "control_socket": control,
        "metrics": shared.metrics_addr,
        "info": info,
        "stats": stats,
        "requests": shared.metrics.to_json(),
    })
}

fn write_live_file(path: &Path, value: &serde_json::Value) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let mut bytes = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, path)
}

impl Service {
    /// Starts the live-stats/control thread and, when `metrics` is given, the HTTP thread.
    pub fn start(shared: Arc<Shared>, run_dir: &Path, metrics: Option<TcpListener>) -> std::io::Result<Service> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut service = Service { stop: stop.clone(), threads: Vec::new(), remove_on_stop: Vec::new() };

        // Created with the process umask; an existing directory's mode is left alone (it may
        // be a shared one such as /tmp).
        std::fs::create_dir_all(run_dir)?;
        let uuid = shared.store.info_of().uuid;
        let live = live_file_path(run_dir, &uuid);
        let control = control_socket_path(run_dir, &uuid);
        // A stale socket from a server that was killed: the store lock (held by us now)
        // proves nobody else serves this store, so it is safe to replace.
        let _ = std::fs::remove_file(&control);
        let control_listener = UnixListener::bind(&control)?;
        std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o600))?;
        control_listener.set_nonblocking(true)?;
        service.remove_on_stop.push(control.clone());
        service.remove_on_stop.push(live.clone());
        write_live_file(&live, &snapshot(&shared, &control))?;

        let thread_shared = shared.clone();
        let thread_stop = stop.clone();
        service.threads.push(
            std::thread::Builder::new()
                .name("zdisk-live".into())
                .spawn(move || live_loop(&thread_shared, &thread_stop, &live, &control, &control_listener))?,
        );

        if let Some(listener) = metrics {
            listener.set_nonblocking(true)?;
            let thread_stop = stop.clone();
            service.threads.push(
                std::thread::Builder::new()
                    .name("zdisk-metrics".into())
                    .spawn(move || metrics_loop(&shared, &thread_stop, &listener))?,
            );
        }
        Ok(service)
    }

    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        for thread in self.threads {
            let _ = thread.join();
        }
        for path in self.remove_on_stop {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn live_loop(shared: &Shared, stop: &AtomicBool, live: &Path, control: &Path, listener: &UnixListener) {
    let mut next_write = Instant::now() + LIVE_PERIOD;
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = serve_control(shared, control, stream) {
                    tracing::debug!("zdisk: control request failed: {e}");
                }
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => tracing::debug!("zdisk: control accept failed: {e}"),
        }
        if Instant::now() >= next_write {
            if let Err(e) = write_live_file(live, &snapshot(shared, control)) {
                tracing::debug!("zdisk: cannot write {}: {e}", live.display());
            }
            next_write = Instant::now() + LIVE_PERIOD;
        }
        std::thread::sleep(STEP);
    }
}

/// One line in, one line out: `resize BYTES` → `ok BYTES` | `error MESSAGE`;
/// `stats` → the JSON snapshot on one line; `drain` → refuse further writes, flush and
/// checkpoint → `ok` | `error MESSAGE`; `recompress [CODEC]` → starts it, `ok` | `error
/// MESSAGE`; `recompress-train [LEVEL]` → starts training a dictionary and recompressing into
/// it, likewise; `recompress-status` → `{"running", "done", "total", "error", "report"}`.
fn serve_control(shared: &Shared, control: &Path, stream: UnixStream) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(PEER_TIMEOUT))?;
    stream.set_write_timeout(Some(PEER_TIMEOUT))?;
    let mut line = String::new();
    BufReader::new((&stream).take(REQUEST_BYTES_MAX)).read_line(&mut line)?;
    let mut words = line.split_whitespace();
    let reply = match (words.next(), words.next(), words.next()) {
        (Some("stats"), None, None) => snapshot(shared, control).to_string(),
        (Some("drain"), None, None) => {
            shared.draining.store(true, Ordering::SeqCst);
            if shared.read_only {
                "ok".to_string()
            } else {
                match shared.store.flush().and_then(|()| shared.store.checkpoint()) {
                    Ok(()) => "ok".to_string(),
                    Err(e) => format!("error {e}"),
                }
            }
        }
        (Some("resize"), Some(bytes), None) => match bytes.parse::<u64>() {
            Err(_) => format!("error bad size {bytes:?}"),
            Ok(_) if shared.read_only => "error the store is served read-only".to_string(),
            Ok(bytes) if bytes < shared.store.logical_size_bytes() => format!(
                "error cannot shrink while served (clients hold the current size {}); stop the server first",
                shared.store.logical_size_bytes()
            ),
            Ok(bytes) => match shared.store.resize(bytes) {
                Ok(()) => format!("ok {}", shared.store.logical_size_bytes()),
                Err(e) => format!("error {e}"),
            },
        },
        (Some("recompress"), codec, None) => match codec.map(str::parse::<zdisk_engine::Codec>).transpose() {
            Ok(codec) => start_recompress(shared, RecompressRequest::Codec(codec)),
            Err(e) => format!("error {e}"),
        },
        (Some("recompress-train"), level, None) => match level.map(str::parse::<i32>).transpose() {
            Ok(level) => {
                let defaults = zdisk_engine::DictionaryOptions::default();
                let options = zdisk_engine::DictionaryOptions { level: level.unwrap_or(defaults.level), ..defaults };
                start_recompress(shared, RecompressRequest::Train(options))
            }
            Err(_) => format!("error bad level {:?}", level.unwrap_or_default()),
        },
        (Some("recompress-status"), None, None) => recompress_status(shared),
        _ => format!(
            "error unknown request {:?} (expected `stats`, `drain`, `resize BYTES`, `recompress [CODEC]`, `recompress-train [LEVEL]` or `recompress-status`)",
            line.trim()
        ),
    };
    let mut writer = &stream;
    writer.write_all(reply.as_bytes())?;
    writer.write_all(b"\n")
}

fn metrics_loop(shared: &Shared, stop: &AtomicBool, listener: &TcpListener) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = serve_http(shared, stream) {
                    tracing::debug!("zdisk: metrics request failed: {e}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(STEP),
            Err(e) => {
                tracing::debug!("zdisk: metrics accept failed: {e}");
                std::thread::sleep(STEP);
            }
        }
    }
}

fn serve_http(shared: &Shared, stream: TcpStream) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(PEER_TIMEOUT))?;
    stream.set_write_timeout(Some(PEER_TIMEOUT))?;
    let mut reader = BufReader::new((&stream).take(REQUEST_BYTES_MAX));
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // Drain the headers (bounded by `take`), so the peer sees a clean close.
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header == "\r\n" || header == "\n" {
            break;
        }
    }
    let mut parts = request_line.split_whitespace();
    let method = parts.next().unwrap_or("");
    let target = parts.next().unwrap_or("");
    let path = target.split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET" | "HEAD", "/metrics") => {
            let info = shared.store.info_of();
            let stats = shared.store.stats();
            ("200 OK", "text/plain; version=0.0.4; charset=utf-8", render_prometheus(&info, &stats, &shared.metrics))
        }
        ("GET" | "HEAD", "/stats") => {
            let mut body = serde_json::to_string_pretty(&snapshot(shared, Path::new(""))).unwrap_or_default();
            body.push('\n');
            ("200 OK", "application/json", body)
        }
        ("GET" | "HEAD", "/") => {
            ("200 OK", "text/plain; charset=utf-8", "zdisk: see /metrics and /stats\n".to_string())
        }
        ("GET" | "HEAD", _) => ("404 Not Found", "text/plain; charset=utf-8", "not found\n".to_string()),
        _ => ("405 Method Not Allowed", "text/plain; charset=utf-8", "only GET\n".to_string()),
    };
    let mut writer = &stream;
    write!(
        writer,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    if method != "HEAD" {
        writer.write_all(body.as_bytes())?;
    }
    writer.flush()
}
