//! `zdisk serve`: the store over NBD, in the foreground — by zdisk's own server in this
//! process (`--frontend native`, the default: `zdisk_nbd::server`), or by nbdkit with the
//! zdisk plugin (`--frontend nbdkit`, for nbdkit's filters and TLS).
//!
//! Invariants (the nbdkit front end; the native one keeps the same promises in-process:
//! drain, then close every connection, then close the store):
//! - at most one writer serves a store: the store lock is probed up front for a clear
//!   message, and the plugin's own open (which takes the lock) is the real guard;
//! - nbdkit runs with `--exit-with-parent`, so it never outlives this process;
//! - on SIGINT/SIGTERM the store is drained first through the plugin's control socket
//!   (writes refused with ESHUTDOWN, flush, checkpoint), then nbdkit gets SIGTERM: it closes
//!   idle connections and unloads the plugin, which closes the store. A client that keeps its
//!   connection open (nbdfuse, the kernel) would hold nbdkit 1.32 forever, so after a grace
//!   period nbdkit is killed — losing nothing, because the drain made everything durable;
//! - the URI is printed (stdout, one line) only once nbdkit has bound its socket and opened
//!   the store, so a script may connect as soon as it reads the line.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use zdisk_engine::Store;
use zdisk_nbd::handshake::TlsPolicy;
use zdisk_nbd::tls::Credentials;

use crate::keys::KeyArgs;
use crate::runtime::{self, ServeState};
use crate::size::Size;
use std::os::fd::AsRawFd;

#[derive(Debug, Clone, clap::Args)]
#[command(group(clap::ArgGroup::new("listen").required(true).args(["unix", "tcp"])))]
#[command(group(clap::ArgGroup::new("tls_credentials").args(["tls_certificates", "tls_psk"])))]
pub struct ServeArgs {
    /// The zdisk store (file or block device) to serve.
    pub store: PathBuf,
    /// Listen on this Unix domain socket (URI nbd+unix:///?socket=SOCKET).
    #[arg(long, value_name = "SOCKET")]
    pub unix: Option<PathBuf>,
    /// Listen on this TCP address (URI nbd://HOST:PORT).
    #[arg(long, value_name = "HOST:PORT")]
    pub tcp: Option<String>,
    /// Serve read-only: writes, trims and zeroes are refused, the store is opened read-only.
    #[arg(long)]
    pub readonly: bool,
    /// Serve Prometheus text at http://HOST:PORT/metrics and JSON at /stats.
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics: Option<String>,
    /// nbdkit worker threads per connection (requests served in parallel; default 4 per core,
    /// at least 8; `zdisk attach` over nbdfuse asks for 1 on each of as many connections).
    /// A read holds its thread while it waits for the disk, so reads at depth want threads;
    /// writes only compress and append, and more threads than that only preempt each other
    /// (on 2 cores, 8 instead of 16: 4K random writes +10% and p99.9 -15% under GC, random
    /// reads at QD32 -4%; docs/nbd.md, "Threads").
    #[arg(long, short = 't', value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub threads: Option<u32>,
    /// Event loops of the native front end (default one per core): each serves the
    /// connections it was given (in turn, as they connect) and sleeps in epoll while none
    /// of them has a request (docs/nbd.md, "Event loops").
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=256))]
    pub loops: Option<u32>,
    /// Cores the store's codec (zstd, DEFLATE) may keep busy before host writes fall back to
    /// LZ4: 1 up to the cores this process may run on (default half of them, at least 1;
    /// environment ZDISK_CODEC_CORES). More keeps more blocks in the store's codec under load
    /// and costs write speed; fewer keeps writes fast and leaves the capacity to idle
    /// recompression (docs/space.md, "Adaptive fallback and recompression").
    #[arg(long, value_name = "N", value_parser = crate::commands::parse_codec_cores)]
    pub codec_cores: Option<u32>,
    /// When host writes use a cheaper form than the store's codec (idle work and GC
    /// recompress it into the store's codec later; `zdisk stat` shows what waits):
    /// `auto` (default) LZ4 while --codec-cores cores are busy compressing; `never` the
    /// store's codec always (the most capacity at once, the slowest writes); `always` LZ4
    /// always (the least CPU on the write path); `auto-uncompressed` as auto, but the store's codec while writers wait
    /// for the disk and blocks stored uncompressed for now while every core compresses and
    /// the disk idles; `uncompressed` every block stored uncompressed for now. Environment
    /// ZDISK_CODEC_FALLBACK (docs/cpu.md).
    #[arg(long, value_name = "MODE")]
    pub codec_fallback: Option<zdisk_engine::CodecFallback>,
    /// Do not use O_DIRECT on the backing store.
    #[arg(long)]
    pub no_direct: bool,
    /// Bound of the engine's buffer memory (e.g. 256M; default 256M).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub cache: Option<Size>,
    /// Write-behind bound (default 2M; 0: only --cache bounds it). Writes are acknowledged
    /// from memory and written out behind; past this many bytes not yet written, a write
    /// writes them out itself, so a flush never waits for more. Beside a streaming writer a
    /// committer's p99 flush was 440-570 ms unbounded, 27-42 ms at 2M, 19-25 ms at 1M; the
    /// stream pays some of its speed on incompressible data (docs/nbd.md, "Write-behind").
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub write_behind: Option<Size>,
    /// Memory for a read cache of compressed fragments (e.g. 512M; default 0: off). It holds
    /// comp_ratio times more data than a block cache of that size; it helps reads with
    /// locality, not uniform random reads over data much larger than it.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub read_cache: Option<Size>,
    /// Memory for the block map's cached pages and its changes not yet checkpointed (e.g.
    /// 1G; default 256M). The map costs 2 MiB per GiB of mapped logical space (8 bytes per
    /// 4 KiB block): the default keeps the map of 128 GiB cached; past that, a read or GC
    /// pass touching an uncached map page reads it (docs/scale.md).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub map_cache: Option<Size>,
    /// `space_flag` becomes 1 ("low") when free space falls below this fraction of the data
    /// area (0.0–1.0; default 0.10). It becomes 2 when a write is refused for lack of space.
    #[arg(long, value_name = "FRACTION", value_parser = parse_fraction)]
    pub low_space: Option<f64>,
    /// Serve for writing a store whose recovery lost records to damage (both copies of what
    /// they wrote were destroyed). Without it such a store is served read-only and every
    /// block not provably newer than the loss reads as EIO; with it, the blocks the lost
    /// records wrote read their older contents. Run `zdisk check` first: it names the loss.
    #[arg(long)]
    pub accept_data_loss: bool,
    /// Idle work starts after this many seconds without a request (default 2; 0: never):
    /// it recompresses what the write path stored with its LZ4 fallback, and trains the
    /// store's first dictionary (docs/space.md, "Idle work"), one segment at a time.
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
    pub idle_after: Option<f64>,
    /// Do not train a dictionary unasked (a store formatted since 2026-11-25 otherwise
    /// trains one while idle once it holds 16 MiB of blocks; `zdisk recompress --train`
    /// still does).
    #[arg(long)]
    pub no_auto_dictionary: bool,
    /// Discard each segment GC frees (punch a hole in a backing file, BLKDISCARD on a block
    /// device), so a thin backing gets the space back. Off by default, as ZFS's autotrim:
    /// the log soon reuses freed segments, and a flush that lands on blocks a backing file
    /// no longer has waits for the file system to allocate them again (16 KiB write + flush
    /// at QD1: 1.6x slower; docs/format.md, "Backing allocation").
    #[arg(long)]
    pub discard_freed: bool,
    /// Which NBD server serves the store: `native` (zdisk's own: event loops, reads in flight
    /// on io_uring, no thread per request; docs/frontends.md) or `nbdkit` (the zdisk plugin in
    /// nbdkit: its filters, TLS, `--threads`).
    #[arg(long, value_enum, default_value_t = Frontend::Native)]
    pub frontend: Frontend,
    /// Write the serving process's pid here once it is ready to serve (nbdkit's, with
    /// `--frontend nbdkit`).
    #[arg(long, value_name = "PATH")]
    pub pid_file: Option<PathBuf>,
    /// On SIGINT/SIGTERM, how long to let clients disconnect before nbdkit is killed (the
    /// store is flushed and checkpointed, and refuses writes, before the wait starts).
    #[arg(long, default_value_t = 10, value_name = "SECONDS")]
    pub stop_grace_seconds: u64,
    /// Pass -v to nbdkit (debug messages on stderr).
    #[arg(long, short = 'v')]
    pub verbose: bool,
    /// TLS, as nbdkit's --tls: `off` (the default), `on` (offered: a client may start TLS or
    /// stay in plain text) or `require` (a client must start TLS before anything else). Needs
    /// --tls-certificates or --tls-psk. The native server serves TLS connections with threads
    /// of their own, at some cost in read speed (docs/nbd.md, "TLS").
    #[arg(
        long,
        value_enum,
        value_name = "MODE",
        default_value_t = TlsMode::Off,
        requires_ifs = [("on", "tls_credentials"), ("require", "tls_credentials")]
    )]
    pub tls: TlsMode,
    /// Directory holding the server's X.509 certificate (server-cert.pem) and key
    /// (server-key.pem), and with --tls-verify-peer the CA (ca-cert.pem, and ca-crl.pem if
    /// any) that signs clients' certificates: nbdkit's layout.
    #[arg(long, value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,
    /// File of pre-shared keys, one `identity:hexkey` per line (as `psktool -u NAME -p FILE`
    /// writes it); clients authenticate with an identity and its key instead of certificates.
    #[arg(long, value_name = "FILE")]
    pub tls_psk: Option<PathBuf>,
    /// Require clients to present a certificate signed by the CA in --tls-certificates.
    #[arg(long, requires = "tls_certificates")]
    pub tls_verify_peer: bool,
    #[command(flatten)]
    pub key: KeyArgs,
}

/// `--tls`: nbdkit's modes and names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TlsMode {
    Off,
    On,
    Require,
}

/// The TLS `args` ask for: None when off. clap has refused TLS without credentials and both
/// kinds at once; credentials without TLS are refused here (nbdkit would turn TLS on by
/// itself, a surprise either way).
pub(crate) fn tls_setup(args: &ServeArgs) -> Result<Option<(TlsPolicy, Credentials)>> {
    // (clap's `requires` takes --tls-psk, of the same group, for --tls-certificates.)
    if args.tls_verify_peer && args.tls_certificates.is_none() {
        bail!(crate::Usage(
            "--tls-verify-peer needs --tls-certificates DIR (its ca-cert.pem verifies the clients' certificates)"
                .into()
        ));
    }
    let credentials = match (&args.tls_certificates, &args.tls_psk) {
        (Some(dir), None) => {
            if !dir.is_dir() {
                bail!(crate::Usage(format!("--tls-certificates {}: not a directory", dir.display())));
            }
            Some(Credentials::Certificates { dir: std::path::absolute(dir)?, verify_peer: args.tls_verify_peer })
        }
        (None, Some(file)) => {
            if !file.is_file() {
                bail!(crate::Usage(format!("--tls-psk {}: not a file", file.display())));
            }
            Some(Credentials::Psk { file: std::path::absolute(file)? })
        }
        (None, None) => None,
        (Some(_), Some(_)) => bail!(crate::Usage("--tls-certificates and --tls-psk exclude each other".into())),
    };
    let policy = match args.tls {
        TlsMode::Off => TlsPolicy::Off,
        TlsMode::On => TlsPolicy::Offered,
        TlsMode::Require => TlsPolicy::Required,
    };
    match (policy, credentials) {
        (TlsPolicy::Off, None) => Ok(None),
        (TlsPolicy::Off, Some(_)) => bail!(crate::Usage(
            "--tls-certificates and --tls-psk need --tls on or --tls require (TLS is off by default)".into()
        )),
        (_, None) => {
            bail!(crate::Usage("--tls on and --tls require need --tls-certificates DIR or --tls-psk FILE".into()))
        }
        (policy, Some(credentials)) => Ok(Some((policy, credentials))),
    }
}

/// The NBD server behind `zdisk serve`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Frontend {
    Native,
    Nbdkit,
}

/// The plugin: `$ZDISK_PLUGIN`, or `libnbdkit_zdisk_plugin.so` next to the `zdisk` binary
/// (or in `../lib/zdisk/` from it, for installed layouts).
pub fn plugin_path() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("ZDISK_PLUGIN") {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("ZDISK_PLUGIN={} does not exist", path.display());
        }
        return Ok(path);
    }
    let exe = std::env::current_exe().context("locating the zdisk executable")?;
    let dir = exe.parent().context("the zdisk executable has no directory")?;
    let candidates = [
        dir.join("libnbdkit_zdisk_plugin.so"),
        dir.join("../lib/zdisk/libnbdkit_zdisk_plugin.so"),
        // `cargo test` puts test binaries in target/<profile>/deps.
        dir.join("../libnbdkit_zdisk_plugin.so"),
    ];
    for candidate in &candidates {
        if candidate.is_file() {
            return Ok(candidate.clone());
        }
    }
    bail!(
        "the nbdkit plugin libnbdkit_zdisk_plugin.so is not next to {} \
         (build it: cargo build --release -p zdisk-nbdkit; or set ZDISK_PLUGIN)",
        exe.display()
    )
}

/// The URI to print: `nbds` when TLS is required (a client must then also be told the
/// certificates or PSK file, e.g. `&tls-certificates=DIR`; docs/nbd.md, "TLS").
pub(crate) fn uri(args: &ServeArgs) -> Result<String> {
    let scheme = if args.tls == TlsMode::Require { "nbds" } else { "nbd" };
    if let Some(socket) = &args.unix {
        let absolute = std::path::absolute(socket)?;
        return Ok(format!("{scheme}+unix:///?socket={}", absolute.display()));
    }
    let tcp = args.tcp.as_deref().unwrap_or_default();
    Ok(format!("{scheme}://{tcp}/"))
}

fn split_host_port(addr: &str) -> Result<(String, String)> {
    let (host, port) = addr.rsplit_once(':').with_context(|| format!("--tcp {addr}: expected HOST:PORT"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    port.parse::<u16>().with_context(|| format!("--tcp {addr}: bad port"))?;
    Ok((host.to_string(), port.to_string()))
}

fn parse_seconds(text: &str) -> std::result::Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if (0.0..=86_400.0).contains(&s) => Ok(s),
        _ => Err(format!("{text:?} is not a number of seconds between 0 and 86400")),
    }
}

fn parse_fraction(text: &str) -> std::result::Result<f64, String> {
    match text.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("{text:?} is not a fraction between 0 and 1")),
    }
}

/// nbdkit's command line for `args`.
fn nbdkit_command(args: &ServeArgs, plugin: &Path, pid_file: &Path) -> Result<Command> {
    let nbdkit = runtime::tool("nbdkit", "ZDISK_NBDKIT")?;
    let mut command = Command::new(nbdkit);
    command.arg("--foreground").arg("--exit-with-parent");
    command.arg("-P").arg(pid_file);
    command.arg("-t").arg(args.threads.unwrap_or_else(zdisk_apps::parallel_requests).max(1).to_string());
    if let Some(socket) = &args.unix {
        command.arg("-U").arg(std::path::absolute(socket)?);
    } else if let Some(tcp) = &args.tcp {
        let (host, port) = split_host_port(tcp)?;
        command.arg("-i").arg(host).arg("-p").arg(port);
    }
    if args.readonly {
        command.arg("-r");
    }
    if args.verbose {
        command.arg("-v");
    }
    // nbdkit's own default turns TLS on when it finds certificates in its default directory;
    // zdisk's is off, on both front ends.
    match tls_setup(args)? {
        None => {
            command.arg("--tls=off");
        }
        Some((policy, credentials)) => {
            command.arg(if policy == TlsPolicy::Required { "--tls=require" } else { "--tls=on" });
            match credentials {
                Credentials::Certificates { dir, verify_peer } => {
                    command.arg(format!("--tls-certificates={}", dir.display()));
                    if verify_peer {
                        command.arg("--tls-verify-peer");
                    }
                }
                Credentials::Psk { file } => {
                    command.arg(format!("--tls-psk={}", file.display()));
                }
            }
        }
    }
    command.arg(plugin);
    command.arg(format!("store={}", std::path::absolute(&args.store)?.display()));
    if args.readonly {
        command.arg("readonly=true");
    }
    if let Some(metrics) = &args.metrics {
        command.arg(format!("metrics={metrics}"));
    }
    if args.no_direct {
        command.arg("direct=false");
    }
    if let Some(read_cache) = args.read_cache {
        command.arg(format!("read_cache={}", read_cache.0));
    }
    if let Some(cache) = args.cache {
        command.arg(format!("cache={}", cache.0));
    }
    if let Some(write_behind) = args.write_behind {
        command.arg(format!("write_behind={}", write_behind.0));
    }
    if let Some(map_cache) = args.map_cache {
        command.arg(format!("map_cache={}", map_cache.0));
    }
    if args.accept_data_loss {
        command.arg("accept_data_loss=true");
    }
    if let Some(fraction) = args.low_space {
        command.arg(format!("low_space={fraction}"));
    }
    if let Some(seconds) = args.idle_after {
        command.arg(format!("idle_after={}", (seconds * 1000.0).round() as u64));
    }
    if args.no_auto_dictionary {
        command.arg("auto_dictionary=false");
    }
    if args.discard_freed {
        command.arg("discard_freed=true");
    }
    if let Some(cores) = args.codec_cores {
        command.arg(format!("codec_cores={cores}"));
    }
    if let Some(mode) = args.codec_fallback {
        command.arg(format!("codec_fallback={mode}"));
    }
    command.arg(format!("rundir={}", runtime::run_dir().display()));
    command.stdin(Stdio::null());
    Ok(command)
}

/// Removes a Unix socket left behind by a server that died, refusing a live one.
pub(crate) fn clear_stale_socket(socket: &Path) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(metadata) = std::fs::symlink_metadata(socket) else { return Ok(()) };
    if !metadata.file_type().is_socket() {
        bail!("{} exists and is not a socket", socket.display());
    }
    if std::os::unix::net::UnixStream::connect(socket).is_ok() {
        bail!("{} is in use by another server", socket.display());
    }
    std::fs::remove_file(socket).with_context(|| format!("removing stale socket {}", socket.display()))
}

/// A running nbdkit, SIGTERMed and reaped on drop.
pub struct Nbdkit {
    child: Option<Child>,
    pub uri: String,
}

impl Nbdkit {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// SIGTERM, then wait: nbdkit closes idle connections, unloads the plugin, which closes
    /// the store (flush + checkpoint). nbdkit 1.32 cannot interrupt a connection whose client
    /// keeps it open (an nbdfuse mount, a kernel client), so after `grace` it is killed; the
    /// caller drains the store first so that this loses nothing. Returns the exit status and
    /// whether the kill was needed.
    pub fn terminate(&mut self, grace: Duration) -> Result<(ExitStatus, bool)> {
        let mut child = self.child.take().context("nbdkit already stopped")?;
        if let Some(status) = child.try_wait()? {
            return Ok((status, false));
        }
        let _ = runtime::send_signal(child.id(), libc::SIGTERM);
        let deadline = std::time::Instant::now() + grace;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok((status, false));
            }
            if std::time::Instant::now() >= deadline {
                let _ = child.kill();
                return Ok((child.wait()?, true));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => Ok(child.try_wait()?),
            None => bail!("nbdkit already stopped"),
        }
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.terminate(Duration::from_secs(30));
        }
    }
}

/// Starts nbdkit and waits until it serves (or fails).
pub fn start(args: &ServeArgs) -> Result<Nbdkit> {
    if args.loops.is_some() {
        bail!(crate::Usage("--loops is an option of the native front end (nbdkit has --threads)".into()));
    }
    Store::info(&args.store).with_context(|| format!("{} is not a servable zdisk store", args.store.display()))?;
    if runtime::store_is_locked(
        &args.store,
        if args.readonly { zdisk_engine::Lock::Shared } else { zdisk_engine::Lock::Exclusive },
    )? {
        bail!(
            "{} is already open in another process (being served?): refusing to serve it twice \
             (`zdisk stat {}` shows who)",
            args.store.display(),
            args.store.display()
        );
    }
    if let Some(socket) = &args.unix {
        clear_stale_socket(socket)?;
    }
    let plugin = plugin_path()?;
    let scratch = tempfile::tempdir().context("creating a temporary directory")?;
    let pid_file = args.pid_file.clone().unwrap_or_else(|| scratch.path().join("nbdkit.pid"));
    let _ = std::fs::remove_file(&pid_file);
    let mut command = nbdkit_command(args, &plugin, &pid_file)?;
    // An encrypted store's key: a key file by its path; a passphrase through a pipe nbdkit
    // inherits (never on its command line). The pipe holds it until the plugin reads it.
    let _passphrase_pipe = match (&args.key.key_file, args.key.secret_for(&args.store)?) {
        (Some(path), Some(_)) => {
            command.arg(format!("key-file={}", std::path::absolute(path)?.display()));
            None
        }
        (None, Some(secret)) => {
            let (read, write) = rustix::pipe::pipe().context("creating a pipe for the passphrase")?;
            let mut write = std::fs::File::from(write);
            write.write_all(secret.expose_bytes()).context("passing the passphrase")?;
            drop(write);
            command.arg(format!("passphrase-file=/proc/self/fd/{}", read.as_raw_fd()));
            Some(read)
        }
        _ => None,
    };
    let uuid = Store::info(&args.store)?.uuid;
    // (A server killed before it could read it left this; it is about that run.)
    let _ = std::fs::remove_file(runtime::failed_file(&uuid));
    if let Some(warning) = crate::commands::sparse_room_warning(&args.store)? {
        eprintln!("zdisk: warning: {warning}");
    }
    let child = command.spawn().with_context(|| format!("starting {command:?}"))?;
    let mut nbdkit = Nbdkit { child: Some(child), uri: uri(args)? };
    // nbdkit writes the pid file once its socket is bound, and calls the plugin's
    // after_fork — which opens the store (replaying the log) and then binds the control
    // socket — after that. Serving starts when the control socket answers: a `zdisk resize`
    // or `stat` issued the moment the URI is printed must find it (issue 48 saw it refused
    // for ~10 ms).
    let control = runtime::control_socket(&uuid);
    let mut pid_written = false;
    loop {
        if let Some(status) = nbdkit.try_wait()? {
            nbdkit.child = None;
            bail!("nbdkit exited before serving ({status}); its messages are above");
        }
        pid_written = pid_written || std::fs::read_to_string(&pid_file).is_ok_and(|s| !s.trim().is_empty());
        if pid_written && runtime::control_request(&control, "stats").is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(nbdkit)
}

/// A flag SIGINT, SIGTERM and SIGHUP set: the request to stop cleanly.
fn stop_flag() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM, signal_hook::consts::SIGHUP] {
        signal_hook::flag::register(signal, stop.clone()).context("installing signal handlers")?;
    }
    Ok(stop)
}

pub fn run(args: &ServeArgs) -> Result<()> {
    let stop = stop_flag()?;
    if args.frontend == Frontend::Native {
        return crate::serve_native::run(args, &stop);
    }
    let info = Store::info(&args.store)?;
    let mut nbdkit = start(args)?;
    let state = ServeState {
        store: std::path::absolute(&args.store)?,
        uuid: info.uuid.clone(),
        pid: std::process::id(),
        server_pid: nbdkit.pid(),
        uri: nbdkit.uri.clone(),
        unix_socket: args.unix.as_ref().map(std::path::absolute).transpose()?,
        read_only: args.readonly,
    };
    let state_file = runtime::serve_file(&info.uuid);
    runtime::write_json(&state_file, &state)?;
    eprintln!(
        "zdisk: serving {} ({}, {} logical) at {}; Ctrl-C or SIGTERM stops it cleanly",
        args.store.display(),
        info.uuid,
        crate::size::human_bytes(info.logical_size_bytes),
        nbdkit.uri
    );
    if let Some(metrics) = &args.metrics {
        eprintln!("zdisk: metrics at http://{metrics}/metrics and http://{metrics}/stats");
    }
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{}", nbdkit.uri)?;
        stdout.flush()?;
    }
    let grace = Duration::from_secs(args.stop_grace_seconds);
    // The store's state as the server last told it (its live file, rewritten every second,
    // and the control socket at the stop): a store that failed while served makes the stop
    // fail too (its messages say why; `zdisk check` says what the store holds).
    let mut failure = None;
    let mut polls = 0u64;
    let status = loop {
        polls += 1;
        if failure.is_none() && polls.is_multiple_of(20) {
            failure = live_failure(&info.uuid);
        }
        if stop.load(Ordering::SeqCst) {
            eprintln!("zdisk: stopping: refusing new writes, flushing and checkpointing");
            let control = runtime::control_socket(&info.uuid);
            failure = failure.or_else(|| store_failure(&control));
            // A drain that fails matters only if nbdkit then has to be killed: a terminal's
            // Ctrl-C reaches nbdkit too (one process group), and nbdkit then closes the store
            // cleanly itself — and removes the control socket before the drain reaches it.
            let drained = match runtime::control_request(&control, "drain") {
                Ok(reply) if reply == "ok" => Ok(()),
                Ok(reply) => Err(reply),
                Err(e) => Err(format!("{e:#}")),
            };
            let (status, killed) = nbdkit.terminate(grace)?;
            if !killed {
                break status;
            }
            // The plugin did not unload: remove the files it would have removed.
            let _ = std::fs::remove_file(runtime::live_file(&info.uuid));
            let _ = std::fs::remove_file(&control);
            let _ = std::fs::remove_file(&state_file);
            if let Err(why) = drained {
                bail!(
                    "clients kept their connections open for {}s and the store could not be drained ({why}); \
                       nbdkit was killed: writes not flushed by the clients may be lost",
                    grace.as_secs()
                );
            }
            eprintln!(
                "zdisk: clients kept their connections open for {}s; the store was already flushed and \
                 checkpointed, so nbdkit was stopped with SIGKILL without loss",
                grace.as_secs()
            );
            return Ok(());
        }
        if let Some(status) = nbdkit.try_wait()? {
            nbdkit.child = None;
            break status;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = std::fs::remove_file(&state_file);
    let failure = failure_at_unload(&info.uuid).or(failure);
    if !status.success() {
        bail!("nbdkit exited with {status}; see its messages above");
    }
    if let Some(reason) = failure {
        bail!(
            "the store failed while served and took no writes after that ({reason}); what clients had flushed \
             before is on the backing: `zdisk check {}` says what the store holds",
            args.store.display()
        );
    }
    eprintln!("zdisk: stopped cleanly");
    Ok(())
}

/// Why the store failed, if the plugin recorded it at unload (the file is removed).
fn failure_at_unload(uuid: &str) -> Option<String> {
    let path = runtime::failed_file(uuid);
    let reason = std::fs::read_to_string(&path).ok()?;
    let _ = std::fs::remove_file(&path);
    Some(reason)
}

/// Why the served store failed, if its live file says it did.
fn live_failure(uuid: &str) -> Option<String> {
    failure_of(&runtime::read_json::<serde_json::Value>(&runtime::live_file(uuid)).ok()?)
}

/// Why the served store failed, if its server says it did (`Stats::state`).
fn store_failure(control: &std::path::Path) -> Option<String> {
    let reply = runtime::control_request(control, "stats").ok()?;
    failure_of(&serde_json::from_str(&reply).ok()?)
}

/// Why the store failed, from a live snapshot (the live file, or the control socket's
/// `stats`), if it did.
pub(crate) fn failure_of(live: &serde_json::Value) -> Option<String> {
    let stats = live.get("stats")?;
    (stats.get("state")?.as_str()? == zdisk_engine::StoreState::Failed.name())
        .then(|| stats.get("state_reason").and_then(|r| r.as_str()).unwrap_or("").to_string())
}
