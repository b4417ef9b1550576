//! nbdkit plugin serving a zdisk store: a thin adapter from nbdkit callbacks to the engine.
//!
//! ```text
//! nbdkit --foreground -U /tmp/sock libnbdkit_zdisk_plugin.so store=/srv/disk.zdisk \
//!        [readonly=true] [metrics=127.0.0.1:9100] [direct=true|false] [cache=256M] [read_cache=0] \
//!        [low_space=0.10] [discard_freed=false] [codec_cores=N] [codec_fallback=MODE]
//!        [rundir=/run/zdisk]
//! ```
//!
//! Invariants:
//! - one [`Store`] per nbdkit process, opened once in `after_fork` (so engine threads are
//!   created after nbdkit forks into the background, when it does) and shared by every
//!   connection through an `Arc`; `unload` stops the background services, then closes the
//!   store (flush + checkpoint) once no connection holds it;
//! - the plugin keeps no storage logic: every request is one engine call, and the engine's
//!   error kind picks the errno (a write past the end is ENOSPC, as the NBD spec asks);
//! - flush is global (the engine has one log), so multi-conn is safe to advertise;
//! - zero is always cheap (a map update, no data written), so FAST_ZERO requests never fail
//!   with ENOTSUP; with MAY_TRIM a block-aligned range becomes a hole, otherwise (and for
//!   unaligned ranges, which a trim would not fully zero) written zeroes.

use zdisk_nbd::{metrics, service};

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use nbdkit::{ExtentHandle, ExtentType, Flags, FuaFlags, Server, ThreadModel};
use parking_lot::Mutex;
use zdisk_engine::{CodecFallback, Durability, ErrorKind, ExtentKind, OpenOptions, Secret, Store};

pub use metrics::{render_prometheus, Metrics, Op};
pub use service::{control_socket_path, failed_file_path, live_file_path, DEFAULT_RUN_DIR};

use service::{Service, Shared};

/// Plugin configuration, from `key=value` arguments on the nbdkit command line.
#[derive(Debug, Clone)]
struct Config {
    store: Option<PathBuf>,
    read_only: bool,
    metrics: Option<String>,
    direct: bool,
    cache_bytes: u64,
    write_behind_bytes: u64,
    read_cache_bytes: u64,
    map_cache_bytes: u64,
    low_space_fraction: f64,
    accept_data_loss: bool,
    idle_after: Option<std::time::Duration>,
    auto_dictionary_blocks: Option<u64>,
    discard_freed: bool,
    /// Cores the store's codec may keep busy before host writes fall back to LZ4 (None: the
    /// engine's default, or `ZDISK_CODEC_CORES`).
    codec_cores: Option<usize>,
    /// When host writes use LZ4 (or store blocks uncompressed for now) instead of the
    /// store's codec (the engine's default, or `ZDISK_CODEC_FALLBACK`).
    codec_fallback: CodecFallback,
    run_dir: PathBuf,
    /// An encrypted store's passphrase or key file, read when configured.
    key: Option<Arc<Secret>>,
}

impl Default for Config {
    fn default() -> Config {
        let defaults = OpenOptions::default();
        Config {
            store: None,
            read_only: false,
            metrics: None,
            direct: defaults.direct_io,
            cache_bytes: defaults.cache_bytes_max,
            write_behind_bytes: defaults.write_behind_bytes_max,
            read_cache_bytes: defaults.read_cache_bytes,
            map_cache_bytes: defaults.map_cache_bytes,
            low_space_fraction: defaults.low_space_fraction,
            accept_data_loss: false,
            idle_after: defaults.idle_after,
            auto_dictionary_blocks: defaults.auto_dictionary_blocks,
            discard_freed: defaults.discard_freed,
            codec_cores: defaults.codec_cores,
            codec_fallback: defaults.codec_fallback,
            run_dir: std::env::var_os("ZDISK_RUN_DIR").map(PathBuf::from).unwrap_or_else(|| DEFAULT_RUN_DIR.into()),
            key: None,
        }
    }
}

/// The serving state between `after_fork` and `unload`.
struct Serving {
    shared: Arc<Shared>,
    service: Option<Service>,
}

static CONFIG: Mutex<Option<Config>> = Mutex::new(None);
/// Bound in `get_ready` (so a busy port fails before nbdkit starts serving), served from
/// `after_fork`.
static METRICS_LISTENER: Mutex<Option<TcpListener>> = Mutex::new(None);
static SERVING: Mutex<Option<Serving>> = Mutex::new(None);

fn einval(message: impl Into<String>) -> nbdkit::Error {
    nbdkit::Error::new(libc::EINVAL, message.into())
}

fn config() -> Config {
    CONFIG.lock().clone().unwrap_or_default()
}

/// Maps an engine error to the errno nbdkit sends to the client.
fn nbd_error(op: Op, error: zdisk_engine::Error) -> nbdkit::Error {
    let errno = match (error.kind(), op) {
        // NBD: a write past the end of the export is ENOSPC; reads, trims, zeroes get EINVAL.
        (ErrorKind::OutOfRange, Op::Write) => libc::ENOSPC,
        _ => error.errno(),
    };
    nbdkit::Error::new(errno, format!("zdisk {}: {error}", op.name()))
}

/// One NBD connection. Holds the shared store; carries no per-connection state.
/// The engine's name for a request's FUA flag.
fn durability_of(flags: Flags) -> Durability {
    match flags.contains(Flags::FUA) {
        true => Durability::Fua,
        false => Durability::Buffered,
    }
}

struct Handle {
    shared: Arc<Shared>,
}

impl Handle {
    /// Refuses requests that change data once the server is draining for shutdown.
    fn check_not_draining(&self, op: Op) -> nbdkit::Result<()> {
        if self.shared.draining.load(Ordering::Relaxed) {
            self.shared.metrics.record(op, 0, std::time::Duration::ZERO, false);
            return Err(nbdkit::Error::new(libc::ESHUTDOWN, "zdisk: the server is shutting down"));
        }
        Ok(())
    }

    fn timed<T>(&self, op: Op, bytes: u64, f: impl FnOnce(&Store) -> zdisk_engine::Result<T>) -> nbdkit::Result<T> {
        let start = Instant::now();
        let result = f(&self.shared.store);
        self.shared.metrics.record(op, bytes, start.elapsed(), result.is_ok());
        result.map_err(|e| nbd_error(op, e))
    }
}

impl Server for Handle {
    fn name() -> &'static str {
        "zdisk"
    }

    fn longname() -> Option<&'static str> {
        Some("zdisk compressing block store")
    }

    fn description() -> Option<&'static str> {
        Some("Serves a zdisk store: compressed, thin-provisioned, log-structured, crash-safe.")
    }

    fn version() -> Option<&'static str> {
        Some(env!("CARGO_PKG_VERSION"))
    }

    fn config_help() -> Option<&'static str> {
        Some(
            "store=PATH            (required) the zdisk store (file or block device)\n\
             readonly=true|false   open the store read-only (pair with nbdkit -r)\n\
             metrics=HOST:PORT     serve Prometheus text at /metrics and JSON at /stats\n\
             direct=true|false     O_DIRECT on the backing store (default true)\n\
             cache=SIZE            engine buffer memory bound (default 256M)\n\
             write_behind=SIZE     bytes appended but not yet written before a write writes them (default 2M; 0: none)\n\
             read_cache=SIZE       read cache of compressed fragments (default 0: off)\n\
             map_cache=SIZE        block map pages and changes in memory (default 256M)\n\
             accept_data_loss=BOOL serve for writing a store whose recovery lost records\n\
             low_space=FRACTION    space_flag=1 below this free fraction (default 0.10)\n\
             idle_after=MS         idle work after MS ms without requests (default 2000; 0: never)\n\
             auto_dictionary=BOOL  train the first dictionary while idle (default true)\n\
             discard_freed=BOOL    discard freed segments: thin backing, slower flushes (default false)\n\
             codec_cores=N         cores the store's codec may keep busy before writes fall back to LZ4\n\
                                   (1 up to the cores nbdkit may run on; default half of them)\n\
             codec_fallback=MODE   auto (default), never, always, auto-uncompressed or uncompressed:\n\
                                   when writes use LZ4 instead of the store's codec (zdisk serve --help)\n\
             rundir=DIR            live stats/control files (default /run/zdisk)\n\
             key-file=PATH         an encrypted store's key file\n\
             passphrase-file=PATH  an encrypted store's passphrase: the first line of PATH\n\
                                   (`zdisk serve` passes a pipe, /proc/self/fd/N)",
        )
    }

    fn magic_config_key() -> Option<&'static str> {
        Some("store")
    }

    fn thread_model() -> nbdkit::Result<ThreadModel> {
        Ok(ThreadModel::Parallel)
    }

    fn config(key: &str, value: &str) -> nbdkit::Result<()> {
        let mut guard = CONFIG.lock();
        let config = guard.get_or_insert_with(Config::default);
        match key {
            "store" if value.is_empty() => return Err(einval("store= is empty: give the store's path")),
            "store" => config.store = Some(PathBuf::from(value)),
            "readonly" => config.read_only = nbdkit::parse_bool(value)?,
            "metrics" => {
                if value.parse::<std::net::SocketAddr>().is_err() && !value.contains(':') {
                    return Err(einval(format!("metrics={value}: expected HOST:PORT")));
                }
                config.metrics = Some(value.to_string());
            }
            "direct" => config.direct = nbdkit::parse_bool(value)?,
            "cache" => {
                let bytes = nbdkit::parse_size(value)?;
                config.cache_bytes = u64::try_from(bytes).map_err(|_| einval(format!("cache={value}")))?;
            }
            "write_behind" => {
                let bytes = nbdkit::parse_size(value)?;
                config.write_behind_bytes =
                    u64::try_from(bytes).map_err(|_| einval(format!("write_behind={value}")))?;
            }
            "read_cache" => {
                let bytes = nbdkit::parse_size(value)?;
                config.read_cache_bytes = u64::try_from(bytes).map_err(|_| einval(format!("read_cache={value}")))?;
            }
            "map_cache" => {
                let bytes = nbdkit::parse_size(value)?;
                config.map_cache_bytes = u64::try_from(bytes).map_err(|_| einval(format!("map_cache={value}")))?;
            }
            "low_space" => {
                let fraction: f64 = value.parse().map_err(|_| einval(format!("low_space={value}: not a number")))?;
                if !(0.0..1.0).contains(&fraction) {
                    return Err(einval(format!("low_space={value}: must be in [0, 1)")));
                }
                config.low_space_fraction = fraction;
            }
            "accept_data_loss" => config.accept_data_loss = nbdkit::parse_bool(value)?,
            "discard_freed" => config.discard_freed = nbdkit::parse_bool(value)?,
            "idle_after" => {
                let ms: u64 = value.parse().map_err(|_| einval(format!("idle_after={value}: not milliseconds")))?;
                config.idle_after = (ms > 0).then(|| std::time::Duration::from_millis(ms));
            }
            "auto_dictionary" => {
                config.auto_dictionary_blocks = match nbdkit::parse_bool(value)? {
                    true => OpenOptions::default().auto_dictionary_blocks,
                    false => None,
                };
            }
            "codec_cores" => {
                let cores: usize = value.parse().map_err(|_| einval(format!("codec_cores={value}: not a number")))?;
                let checked = zdisk_engine::check_codec_cores(cores, zdisk_engine::available_cores());
                config.codec_cores = Some(checked.map_err(|e| einval(format!("codec_cores={value}: {e}")))?);
            }
            "codec_fallback" => {
                config.codec_fallback = value.parse().map_err(|e| einval(format!("codec_fallback={value}: {e}")))?;
            }
            "rundir" => config.run_dir = PathBuf::from(value),
            // Read now: a pipe's contents are there once, and before nbdkit forks.
            "key-file" => {
                let bytes = std::fs::read(value).map_err(|e| einval(format!("key-file={value}: {e}")))?;
                config.key = Some(Arc::new(Secret::key_file(bytes)));
            }
            "passphrase-file" => {
                let text = std::fs::read(value).map_err(|e| einval(format!("passphrase-file={value}: {e}")))?;
                let line = text.split(|&b| b == b'\n').next().unwrap_or_default();
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                config.key = Some(Arc::new(Secret::passphrase(line.to_vec())));
            }
            _ => return Err(einval(format!("unknown parameter {key:?} (see nbdkit zdisk --help)"))),
        }
        Ok(())
    }

    fn config_complete() -> nbdkit::Result<()> {
        let config = config();
        let Some(store) = &config.store else {
            return Err(einval("store=PATH is required"));
        };
        // Refuse early (before nbdkit binds its socket) what is not a zdisk store.
        Store::info(store).map_err(|e| nbdkit::Error::new(e.errno(), format!("{}: {e}", store.display())))?;
        Ok(())
    }

    fn get_ready() -> nbdkit::Result<()> {
        if let Some(addr) = config().metrics {
            let listener = TcpListener::bind(&addr).map_err(|e| {
                nbdkit::Error::new(e.raw_os_error().unwrap_or(libc::EIO), format!("metrics={addr}: {e}"))
            })?;
            *METRICS_LISTENER.lock() = Some(listener);
        }
        Ok(())
    }

    fn after_fork() -> nbdkit::Result<()> {
        // The engine reports what it cannot return to a request (a failed background
        // write-out, GC or discard; the store turning read-only) through `tracing`: to
        // nbdkit's stderr, at warnings and above unless ZDISK_LOG says otherwise.
        let filter = tracing_subscriber::EnvFilter::try_from_env("ZDISK_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ =
            tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false).try_init();
        let config = config();
        let path = config.store.clone().ok_or_else(|| einval("store=PATH is required"))?;
        let options = OpenOptions {
            read_only: config.read_only,
            direct_io: config.direct,
            cache_bytes_max: config.cache_bytes,
            write_behind_bytes_max: config.write_behind_bytes,
            read_cache_bytes: config.read_cache_bytes,
            map_cache_bytes: config.map_cache_bytes,
            low_space_fraction: config.low_space_fraction,
            accept_data_loss: config.accept_data_loss,
            idle_after: config.idle_after,
            auto_dictionary_blocks: config.auto_dictionary_blocks,
            discard_freed: config.discard_freed,
            codec_cores: config.codec_cores,
            codec_fallback: config.codec_fallback,
            key: config.key.clone(),
            ..OpenOptions::default()
        };
        let store = Store::open(&path, &options)
            .map_err(|e| nbdkit::Error::new(e.errno(), format!("cannot open {}: {e}", path.display())))?;
        let shared = Arc::new(Shared {
            store: Arc::new(store),
            metrics: Arc::new(Metrics::default()),
            store_path: path,
            read_only: config.read_only,
            metrics_addr: config.metrics.clone(),
            draining: AtomicBool::new(false),
            recompress: Default::default(),
        });
        let listener = METRICS_LISTENER.lock().take();
        let service = Service::start(shared.clone(), &config.run_dir, listener).map_err(|e| {
            nbdkit::Error::new(
                e.raw_os_error().unwrap_or(libc::EIO),
                format!("cannot start live stats in {}: {e}", config.run_dir.display()),
            )
        })?;
        *SERVING.lock() = Some(Serving { shared, service: Some(service) });
        Ok(())
    }

    fn unload() {
        let Some(mut serving) = SERVING.lock().take() else { return };
        if let Some(service) = serving.service.take() {
            service.stop();
        }
        let stats = serving.shared.store.stats();
        if stats.state == zdisk_engine::StoreState::Failed {
            // For `zdisk serve`, which exits non-zero (nbdkit's own status does not say).
            let path = failed_file_path(&config().run_dir, &serving.shared.store.info_of().uuid);
            if let Err(e) = std::fs::write(&path, &stats.state_reason) {
                eprintln!("zdisk: cannot record the store's failure in {}: {e}", path.display());
            }
        }
        let shared = match Arc::try_unwrap(serving.shared) {
            Ok(shared) => shared,
            Err(shared) => {
                // nbdkit unloads after every connection closed; if one still holds the
                // store, make what it acknowledged durable and leave it to that connection.
                match shared.store.flush() {
                    Ok(()) => eprintln!("zdisk: store still in use at unload; flushed, not closed"),
                    Err(e) => eprintln!("zdisk: store still in use at unload; flushing it failed: {e}"),
                }
                return;
            }
        };
        match Arc::try_unwrap(shared.store) {
            Ok(store) => {
                if let Err(e) = store.close() {
                    eprintln!("zdisk: closing {} failed: {e}", shared.store_path.display());
                }
            }
            Err(store) => {
                if let Err(e) = store.flush() {
                    eprintln!("zdisk: flushing {} at unload failed: {e}", shared.store_path.display());
                }
            }
        }
    }

    fn open(readonly: bool) -> nbdkit::Result<Box<dyn Server>> {
        let _ = readonly; // can_write answers for the whole store; nbdkit enforces -r.
        let guard = SERVING.lock();
        let serving = guard.as_ref().ok_or_else(|| nbdkit::Error::new(libc::EIO, "zdisk: store is not open"))?;
        Ok(Box::new(Handle { shared: serving.shared.clone() }))
    }

    fn get_size(&self) -> nbdkit::Result<i64> {
        i64::try_from(self.shared.store.logical_size_bytes()).map_err(|_| einval("logical size exceeds i64"))
    }

    fn can_write(&self) -> nbdkit::Result<bool> {
        Ok(!self.shared.read_only)
    }

    fn can_flush(&self) -> nbdkit::Result<bool> {
        Ok(!self.shared.read_only)
    }

    fn can_trim(&self) -> nbdkit::Result<bool> {
        Ok(!self.shared.read_only)
    }

    fn can_zero(&self) -> nbdkit::Result<bool> {
        Ok(!self.shared.read_only)
    }

    fn can_fast_zero(&self) -> nbdkit::Result<bool> {
        Ok(!self.shared.read_only)
    }

    fn can_fua(&self) -> nbdkit::Result<FuaFlags> {
        Ok(FuaFlags::Native)
    }

    fn can_multi_conn(&self) -> nbdkit::Result<bool> {
        Ok(true)
    }

    fn can_extents(&self) -> nbdkit::Result<bool> {
        Ok(true)
    }

    fn is_rotational(&self) -> nbdkit::Result<bool> {
        Ok(false)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> nbdkit::Result<()> {
        let bytes = buf.len() as u64;
        self.timed(Op::Read, bytes, |store| store.read(offset, buf))
    }

    fn write_at(&self, buf: &[u8], offset: u64, flags: Flags) -> nbdkit::Result<()> {
        self.check_not_draining(Op::Write)?;
        let durability = durability_of(flags);
        self.timed(Op::Write, buf.len() as u64, |store| store.write(offset, buf, durability))
    }

    fn trim(&self, count: u32, offset: u64, flags: Flags) -> nbdkit::Result<()> {
        self.check_not_draining(Op::Trim)?;
        let durability = durability_of(flags);
        self.timed(Op::Trim, u64::from(count), |store| store.trim(offset, u64::from(count), durability))
    }

    fn zero(&self, count: u32, offset: u64, flags: Flags) -> nbdkit::Result<()> {
        self.check_not_draining(Op::Zero)?;
        // FAST_ZERO needs no check: zeroing is a map update in zdisk, never a data write.
        // MAY_TRIM lets us leave a hole, but only where the hole reads as zeroes: the engine
        // trims whole blocks only (a trim is advisory), so an unaligned range is written as
        // zeroes instead. One engine call either way keeps the request atomic.
        let durability = durability_of(flags);
        let length = u64::from(count);
        let block = zdisk_engine::BLOCK_SIZE as u64;
        let aligned = offset.is_multiple_of(block) && length.is_multiple_of(block);
        if flags.contains(Flags::MAY_TRIM) && aligned {
            self.timed(Op::Zero, length, |store| store.trim(offset, length, durability))
        } else {
            self.timed(Op::Zero, length, |store| store.write_zeroes(offset, length, durability))
        }
    }

    fn flush(&self) -> nbdkit::Result<()> {
        self.timed(Op::Flush, 0, |store| store.flush())
    }

    fn extents(&self, count: u32, offset: u64, flags: Flags, handle: &mut ExtentHandle) -> nbdkit::Result<()> {
        let extents =
            self.timed(Op::Extents, u64::from(count), |store| store.block_status(offset, u64::from(count)))?;
        for extent in &extents {
            let kind = match extent.kind {
                ExtentKind::Data => ExtentType::Allocated,
                ExtentKind::Zero => ExtentType::Zero,
                ExtentKind::Hole => ExtentType::HoleZero,
            };
            handle.add(extent.offset, extent.length, kind)?;
            if flags.contains(Flags::REQ_ONE) {
                break;
            }
        }
        Ok(())
    }
}

nbdkit::plugin!(Handle {
    thread_model,
    config,
    config_complete,
    config_help,
    get_ready,
    after_fork,
    unload,
    write_at,
    flush,
    trim,
    zero,
    extents,
    can_write,
    can_flush,
    can_trim,
    can_zero,
    can_fast_zero,
    can_fua,
    can_multi_conn,
    can_extents,
    is_rotational
});
