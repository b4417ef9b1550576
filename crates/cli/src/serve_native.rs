//! `zdisk serve --frontend native` (the default): the store opened in this process and served
//! by zdisk's own NBD server (`zdisk_nbd::server`), beside the same live file, control socket
//! and metrics endpoint the nbdkit plugin runs (`zdisk_nbd::service`).
//!
//! Invariants:
//! - the URI is printed (stdout, one line) only once the store is open, the control socket
//!   answers and the listener accepts, so a script may connect as soon as it reads it;
//! - on SIGINT/SIGTERM/SIGHUP: writes are refused (ESHUTDOWN), the store is flushed and
//!   checkpointed, then every connection is closed and the store is closed — a client that
//!   keeps its connection cannot hold the stop, and loses nothing it was acknowledged;
//! - a store that failed while served makes the exit status non-zero, with the reason;
//! - with `--tls`, the credentials are loaded and checked before the store is opened: a
//!   missing or malformed file is an error naming it, not a server whose clients all fail.

use std::io::Write;
use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use zdisk_engine::{OpenOptions, Store, StoreState};
use zdisk_nbd::handshake::TlsPolicy;
use zdisk_nbd::metrics::Metrics;
use zdisk_nbd::server::{Config, Listener, Server};
use zdisk_nbd::service::{Service, Shared};
use zdisk_nbd::tls::TlsServer;

use crate::runtime::{self, ServeState};
use crate::serve::ServeArgs;

/// The engine's options as `zdisk serve`'s arguments ask (the plugin's `key=value`
/// parameters carry the same ones).
fn open_options(args: &ServeArgs) -> Result<OpenOptions> {
    let defaults = OpenOptions::default();
    Ok(OpenOptions {
        read_only: args.readonly,
        direct_io: !args.no_direct,
        cache_bytes_max: args.cache.map_or(defaults.cache_bytes_max, |s| s.0),
        write_behind_bytes_max: args.write_behind.map_or(defaults.write_behind_bytes_max, |s| s.0),
        read_cache_bytes: args.read_cache.map_or(defaults.read_cache_bytes, |s| s.0),
        map_cache_bytes: args.map_cache.map_or(defaults.map_cache_bytes, |s| s.0),
        low_space_fraction: args.low_space.unwrap_or(defaults.low_space_fraction),
        accept_data_loss: args.accept_data_loss,
        idle_after: match args.idle_after {
            Some(seconds) => (seconds > 0.0).then(|| Duration::from_secs_f64(seconds)),
            None => defaults.idle_after,
        },
        auto_dictionary_blocks: if args.no_auto_dictionary { None } else { defaults.auto_dictionary_blocks },
        discard_freed: args.discard_freed,
        codec_cores: args.codec_cores.map(|cores| cores as usize).or(defaults.codec_cores),
        codec_fallback: args.codec_fallback.unwrap_or(defaults.codec_fallback),
        key: args.key.secret_for(&args.store)?,
        ..defaults
    })
}

fn bind(args: &ServeArgs) -> Result<Listener> {
    if let Some(socket) = &args.unix {
        crate::serve::clear_stale_socket(socket)?;
        let listener = UnixListener::bind(socket).with_context(|| format!("listening on {}", socket.display()))?;
        return Ok(Listener::Unix(listener));
    }
    let tcp = args.tcp.as_deref().unwrap_or_default();
    let listener = TcpListener::bind(tcp).with_context(|| format!("--tcp {tcp}: cannot listen"))?;
    Ok(Listener::Tcp(listener))
}

pub fn run(args: &ServeArgs, stop: &AtomicBool) -> Result<()> {
    // TLS credentials first: a bad file is refused before the store is opened.
    let tls = match crate::serve::tls_setup(args)? {
        Some((policy, credentials)) => Some(Arc::new(TlsServer::new(policy, &credentials)?)),
        None => None,
    };
    let info =
        Store::info(&args.store).with_context(|| format!("{} is not a servable zdisk store", args.store.display()))?;
    if let Some(warning) = crate::commands::sparse_room_warning(&args.store)? {
        eprintln!("zdisk: warning: {warning}");
    }
    let metrics_listener = match &args.metrics {
        Some(addr) => Some(TcpListener::bind(addr).with_context(|| format!("--metrics {addr}: cannot listen"))?),
        None => None,
    };
    let options = open_options(args)?;
    let store = Store::open(&args.store, &options).map_err(|e| match e.kind() {
        zdisk_engine::ErrorKind::Locked => anyhow::anyhow!(
            "{} is already open in another process (being served?): refusing to serve it twice \
             (`zdisk stat {}` shows who)",
            args.store.display(),
            args.store.display()
        ),
        _ => anyhow::anyhow!("cannot open {}: {e}", args.store.display()),
    })?;
    let store_path = std::path::absolute(&args.store)?;
    let shared = Arc::new(Shared {
        store: Arc::new(store),
        metrics: Arc::new(Metrics::default()),
        store_path: store_path.clone(),
        read_only: args.readonly,
        metrics_addr: args.metrics.clone(),
        draining: AtomicBool::new(false),
        recompress: Default::default(),
    });
    let run_dir = runtime::run_dir();
    let service = Service::start(shared.clone(), &run_dir, metrics_listener)
        .with_context(|| format!("cannot start live stats in {}", run_dir.display()))?;
    let listener = bind(args)?;
    let description = format!("zdisk store {}", store_path.display());
    let mut config = Config { tls: tls.clone(), ..Config::new(String::new(), description) };
    if let Some(loops) = args.loops {
        config.loops = loops as usize;
    }
    let server = Server::start(listener, shared.clone(), config).context("starting the NBD server")?;
    let uri = crate::serve::uri(args)?;
    if let Some(pid_file) = &args.pid_file {
        std::fs::write(pid_file, format!("{}\n", std::process::id()))
            .with_context(|| format!("writing {}", pid_file.display()))?;
    }
    let state_file = announce(args, &info, &store_path, &uri, tls.as_ref())?;
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("zdisk: stopping: refusing new writes, flushing and checkpointing");
    shared.draining.store(true, Ordering::SeqCst);
    let drained = match shared.store.flush().and_then(|()| shared.store.checkpoint()) {
        // Served read-only, or opened so by the engine (a degraded store) or turned so by a
        // failure (reported below): nothing to make durable.
        Err(e) if e.kind() == zdisk_engine::ErrorKind::ReadOnly => Ok(()),
        drained => drained,
    };
    server.stop();
    service.stop();
    if let Some(socket) = &args.unix {
        let _ = std::fs::remove_file(socket);
    }
    let _ = std::fs::remove_file(&state_file);
    let stats = shared.store.stats();
    let failure = (stats.state == StoreState::Failed).then(|| stats.state_reason.clone());
    let Shared { store, .. } = Arc::try_unwrap(shared).map_err(|_| anyhow::anyhow!("the store is still in use"))?;
    let store = Arc::try_unwrap(store).map_err(|_| anyhow::anyhow!("the store is still in use"))?;
    let closed = store.close();
    if let Some(reason) = failure {
        bail!(
            "the store failed while served and took no writes after that ({reason}); what clients had flushed \
             before is on the backing: `zdisk check {}` says what the store holds",
            args.store.display()
        );
    }
    drained.context("draining the store at stop")?;
    closed.context("closing the store")?;
    eprintln!("zdisk: stopped cleanly");
    Ok(())
}

/// Records the server in the run directory (`<uuid>.serve.json`), says where it serves on
/// stderr and prints the URI on stdout, last (a script may connect once it reads it).
/// Returns the state file, removed at stop.
fn announce(
    args: &ServeArgs,
    info: &zdisk_engine::StoreInfo,
    store_path: &std::path::Path,
    uri: &str,
    tls: Option<&Arc<TlsServer>>,
) -> Result<std::path::PathBuf> {
    let state_file = runtime::serve_file(&info.uuid);
    runtime::write_json(
        &state_file,
        &ServeState {
            store: store_path.to_path_buf(),
            uuid: info.uuid.clone(),
            pid: std::process::id(),
            server_pid: std::process::id(),
            uri: uri.to_string(),
            unix_socket: args.unix.as_ref().map(std::path::absolute).transpose()?,
            read_only: args.readonly,
        },
    )?;
    eprintln!(
        "zdisk: serving {} ({}, {} logical) at {}; Ctrl-C or SIGTERM stops it cleanly",
        args.store.display(),
        info.uuid,
        crate::size::human_bytes(info.logical_size_bytes),
        uri
    );
    if let Some(metrics) = &args.metrics {
        eprintln!("zdisk: metrics at http://{metrics}/metrics and http://{metrics}/stats");
    }
    if let Some(tls) = tls {
        let mode = if tls.policy() == TlsPolicy::Required { "required" } else { "offered" };
        eprintln!("zdisk: TLS {mode}: {}", tls.description());
    }
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{uri}")?;
    stdout.flush()?;
    Ok(state_file)
}
