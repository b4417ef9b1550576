//! `zdisk attach` / `zdisk detach`: a block device backed by a running server.
//!
//! Two ways, chosen in this order:
//! 1. the kernel NBD client (`/dev/nbdN` and `nbd-client` exist): `nbd-client -unix`;
//! 2. otherwise `nbdfuse` exposes the export as a file and `losetup` makes a loop device of
//!    it (direct I/O when FUSE allows it, so the page cache is not doubled). nbdfuse opens
//!    several connections (multi-conn), and the server attach starts for it runs one nbdkit
//!    thread per connection: requests run in parallel across connections, and no request
//!    pays nbdkit's hand-off of a connection's socket between its threads (docs/nbd.md,
//!    "Threads").
//!
//! If the store is not being served, attach starts `zdisk serve` in the background on a Unix
//! socket in the run directory (with the options given after `--`) and records that, so
//! detach stops exactly what attach started.
//!
//! Invariants: every step attach takes is recorded in `attach/<device>.json` before the next
//! one, and a failing attach undoes what it did so far; detach undoes in reverse order and
//! only stops a server that attach itself started.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use zdisk_engine::Store;

use crate::runtime::{self, ServeState};

#[derive(Debug, Clone, clap::Args)]
pub struct AttachArgs {
    /// The zdisk store (file or block device) to attach.
    pub store: PathBuf,
    /// Use nbdfuse + loop even where the kernel NBD client is available.
    #[arg(long)]
    pub fuse: bool,
    /// NBD connections nbdfuse opens to the server (nbdfuse + loop only; default 4 per core,
    /// at least 8, at most 64). A server attach starts then runs one thread per connection
    /// unless the options after `--` set `--threads`.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=256))]
    pub connections: Option<u32>,
    /// Cores the store's codec may keep busy before host writes fall back to LZ4, for the
    /// server attach starts (`zdisk serve --codec-cores`; 1 up to the cores this process may
    /// run on, default half of them).
    #[arg(long, value_name = "N", value_parser = crate::commands::parse_codec_cores)]
    pub codec_cores: Option<u32>,
    /// An encrypted store's key, for the server attach starts.
    #[command(flatten)]
    pub key: crate::keys::KeyArgs,
    /// Options for the `zdisk serve` attach starts, after `--` (e.g. `-- --cache 512M
    /// --write-behind 1M`; see `zdisk serve --help`). Refused when the store is already
    /// being served: a running server's options do not change.
    #[arg(last = true, value_name = "SERVE_OPTIONS")]
    pub serve_options: Vec<String>,
}

#[derive(Debug, Clone, clap::Args)]
pub struct DetachArgs {
    /// The device `zdisk attach` printed (e.g. /dev/loop3 or /dev/nbd0), or the attached store.
    pub device: PathBuf,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct AttachState {
    store: PathBuf,
    uuid: String,
    device: PathBuf,
    kind: String,
    /// `zdisk serve` started by attach (stopped by detach).
    started_serve_pid: Option<u32>,
    fuse_dir: Option<PathBuf>,
    nbdfuse_pid: Option<u32>,
}

fn attach_dir() -> PathBuf {
    runtime::run_dir().join("attach")
}

fn state_path(device: &Path) -> PathBuf {
    let name = device.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    attach_dir().join(format!("{name}.json"))
}

/// Waits for `zdisk serve` of `uuid` to be ready, as long as `server` runs. The child is
/// polled with `try_wait`, not by pid: a server that dies stays a zombie of ours until
/// reaped, and a zombie's pid still answers `kill(pid, 0)`.
fn wait_for_serve(uuid: &str, server: &mut Child, log: &Path) -> Result<ServeState> {
    let path = runtime::serve_file(uuid);
    loop {
        if let Ok(state) = runtime::read_json::<ServeState>(&path) {
            if state.pid == server.id() {
                return Ok(state);
            }
        }
        if let Some(status) = server.try_wait()? {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            bail!("zdisk serve exited ({status}) before serving:\n{}", log.trim());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts `zdisk serve STORE --unix RUN_DIR/<uuid>.sock` detached from our session.
/// An encrypted store's key reaches it as `--key-file`, or a passphrase on its stdin.
/// `threads_per_connection`: what `--threads` the server gets unless the options after `--`
/// set it.
fn start_background_server(
    store: &Path,
    uuid: &str,
    args: &AttachArgs,
    threads_per_connection: Option<u32>,
) -> Result<ServeState> {
    let key = &args.key;
    let secret = key.secret_for(store)?;
    let run_dir = runtime::run_dir();
    std::fs::create_dir_all(&run_dir)?;
    let socket = run_dir.join(format!("{uuid}.sock"));
    let log_path = run_dir.join(format!("{uuid}.log"));
    let log = std::fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let exe = std::env::current_exe()?;
    let mut command = Command::new(exe);
    command.arg("serve").arg(store).arg("--unix").arg(&socket);
    if let Some(threads) = threads_per_connection.filter(|_| !sets_threads(&args.serve_options)) {
        command.arg("--threads").arg(threads.to_string());
    }
    if let Some(cores) = args.codec_cores {
        command.arg("--codec-cores").arg(cores.to_string());
    }
    command
        .args(&args.serve_options)
        .stdin(if secret.is_some() && key.key_file.is_none() { Stdio::piped() } else { Stdio::null() })
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: setsid is async-signal-safe and touches no memory; it detaches the server from
    // our terminal's session so it outlives this command and its Ctrl-C.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    match (&key.key_file, &secret) {
        (Some(path), Some(_)) => {
            command.arg("--key-file").arg(std::path::absolute(path)?);
        }
        (None, Some(_)) => {
            command.arg("--passphrase-stdin");
        }
        _ => {}
    }
    let mut child = command.spawn().context("starting zdisk serve")?;
    if let (Some(stdin), Some(secret)) = (child.stdin.take(), &secret) {
        use std::io::Write;
        let mut stdin = stdin;
        stdin
            .write_all(secret.expose_bytes())
            .and_then(|()| stdin.write_all(b"\n"))
            .context("passing the passphrase")?;
    }
    let serve = wait_for_serve(uuid, &mut child, &log_path)?;
    // Serving: the server outlives us (init reaps it after we exit); from here it is tracked
    // by pid.
    std::mem::forget(child);
    Ok(serve)
}

/// Whether `args` ask anything of the server attach would start (a running one's options do
/// not change).
fn has_server_options(args: &AttachArgs) -> bool {
    !args.serve_options.is_empty() || args.codec_cores.is_some()
}

/// Whether `zdisk serve` options set its thread count (`--threads N`, `--threads=N`, `-t N`,
/// `-tN`).
fn sets_threads(options: &[String]) -> bool {
    options.iter().any(|option| option == "--threads" || option.starts_with("--threads=") || option.starts_with("-t"))
}

fn stop_background_server(pid: u32) {
    if runtime::send_signal(pid, libc::SIGTERM).is_ok() && !runtime::wait_gone(pid, Duration::from_secs(300)) {
        eprintln!("zdisk: server pid {pid} did not stop within 5 minutes");
    }
}

fn nbd_client_device() -> Option<PathBuf> {
    runtime::tool("nbd-client", "ZDISK_NBD_CLIENT").ok()?;
    (0..128).find_map(|n| {
        let device = PathBuf::from(format!("/dev/nbd{n}"));
        let busy = Path::new(&format!("/sys/block/nbd{n}/pid")).exists();
        (device.exists() && !busy).then_some(device)
    })
}

/// The attachment of the store `uuid` that is still in place, if any: its state file names
/// a device that is still bound to it (a state file left by a reboot names none).
fn attachment_of(uuid: &str) -> Option<AttachState> {
    let entries = std::fs::read_dir(attach_dir()).ok()?;
    entries
        .filter_map(|entry| runtime::read_json::<AttachState>(&entry.ok()?.path()).ok())
        .find(|state| state.uuid == uuid && still_bound(state))
}

fn still_bound(state: &AttachState) -> bool {
    let Some(name) = state.device.file_name().map(|n| n.to_string_lossy().into_owned()) else { return false };
    match (state.kind.as_str(), &state.fuse_dir) {
        ("nbd", _) => Path::new(&format!("/sys/block/{name}/pid")).exists(),
        (_, Some(fuse_dir)) => std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
            .is_ok_and(|backing| Path::new(backing.trim()) == fuse_dir.join("nbd")),
        _ => false,
    }
}

pub fn attach(args: &AttachArgs) -> Result<()> {
    let info = Store::info(&args.store).with_context(|| format!("reading {}", args.store.display()))?;
    let store = std::path::absolute(&args.store)?;
    // A second attach of the same store prints the first one's device: another would mount a
    // second nbdfuse over the first one's directory, and detaching either then hung.
    if let Some(attached) = attachment_of(&info.uuid) {
        if has_server_options(args) {
            bail!(
                "{} is already attached as {}; --codec-cores and the options after -- apply only to a server \
                 attach starts: detach it first",
                store.display(),
                attached.device.display()
            );
        }
        eprintln!("zdisk: {} is already attached", store.display());
        println!("{}", attached.device.display());
        return Ok(());
    }
    let mut state = AttachState { store: store.clone(), uuid: info.uuid.clone(), ..AttachState::default() };
    let kernel_device = if args.fuse { None } else { nbd_client_device() };
    // The kernel client opens one connection: its server keeps the default threads.
    let threads_per_connection = kernel_device.is_none().then_some(1);

    let serve = match runtime::read_json::<ServeState>(&runtime::serve_file(&info.uuid)) {
        Ok(serve)
            if runtime::process_alive(serve.pid)
                && runtime::store_is_locked(&store, zdisk_engine::Lock::Exclusive)? =>
        {
            if has_server_options(args) {
                bail!(
                    "{} is already being served (zdisk serve pid {}); --codec-cores and the options after -- \
                     apply only to a server attach starts: stop that server, or attach without them",
                    store.display(),
                    serve.pid
                );
            }
            serve
        }
        _ => {
            if runtime::store_is_locked(&store, zdisk_engine::Lock::Exclusive)? {
                bail!("{} is open in another process that is not a `zdisk serve`; cannot attach", store.display());
            }
            eprintln!("zdisk: {} is not being served; starting a server", store.display());
            let serve = start_background_server(&store, &info.uuid, args, threads_per_connection)?;
            state.started_serve_pid = Some(serve.pid);
            serve
        }
    };
    let result = attach_device(args, kernel_device, &serve, &mut state);
    match result {
        Ok(device) => {
            println!("{}", device.display());
            Ok(())
        }
        Err(e) => {
            if let Some(pid) = state.started_serve_pid {
                stop_background_server(pid);
            }
            Err(e)
        }
    }
}

fn attach_device(
    args: &AttachArgs,
    kernel_device: Option<PathBuf>,
    serve: &ServeState,
    state: &mut AttachState,
) -> Result<PathBuf> {
    let socket = serve.unix_socket.clone();
    if !args.fuse {
        if let (Some(device), Some(socket)) = (kernel_device, socket.as_ref()) {
            let nbd_client = runtime::tool("nbd-client", "ZDISK_NBD_CLIENT")?;
            runtime::run(Command::new(nbd_client).arg("-unix").arg(socket).arg(&device).arg("-b").arg("4096"))?;
            state.device = device.clone();
            state.kind = "nbd".into();
            runtime::write_json(&state_path(&device), state)?;
            return Ok(device);
        }
    }

    let nbdfuse = runtime::tool("nbdfuse", "ZDISK_NBDFUSE")?;
    let losetup = runtime::tool("losetup", "ZDISK_LOSETUP")?;
    let fuse_dir = runtime::run_dir().join(format!("fuse-{}", serve.uuid));
    std::fs::create_dir_all(&fuse_dir).with_context(|| format!("creating {}", fuse_dir.display()))?;
    let pid_file = runtime::run_dir().join(format!("fuse-{}.pid", serve.uuid));
    let _ = std::fs::remove_file(&pid_file);
    let mut command = Command::new(nbdfuse);
    let connections = args.connections.unwrap_or_else(zdisk_apps::parallel_requests);
    command.arg("-C").arg(connections.to_string());
    command.arg("-P").arg(&pid_file).arg(fuse_dir.join("nbd")).arg(&serve.uri);
    command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    // SAFETY: as in start_background_server: setsid only.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command.spawn().context("starting nbdfuse")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait()? {
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                use std::io::Read;
                let _ = pipe.read_to_string(&mut stderr);
            }
            bail!("nbdfuse exited ({status}): {}", stderr.trim());
        }
        if std::fs::read_to_string(&pid_file).map(|s| !s.trim().is_empty()).unwrap_or(false) {
            break;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            bail!("nbdfuse did not become ready within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(child.stderr.take());
    let nbdfuse_pid = child.id();
    std::mem::forget(child);
    let _ = std::fs::remove_file(&pid_file);
    state.fuse_dir = Some(fuse_dir.clone());
    state.nbdfuse_pid = Some(nbdfuse_pid);
    state.kind = "fuse-loop".into();

    let file = fuse_dir.join("nbd");
    let loop_device = runtime::run(Command::new(&losetup).arg("--direct-io=on").arg("-f").arg("--show").arg(&file))
        .or_else(|_| runtime::run(Command::new(&losetup).arg("-f").arg("--show").arg(&file)));
    let device = match loop_device {
        Ok(out) => PathBuf::from(out.trim()),
        Err(e) => {
            unmount_fuse(&fuse_dir, nbdfuse_pid);
            return Err(e.context("creating a loop device on the nbdfuse file"));
        }
    };
    state.device = device.clone();
    runtime::write_json(&state_path(&device), state)?;
    Ok(device)
}

/// Unmounts the nbdfuse mount behind an attachment; a busy mount is left as it is (someone
/// still uses the device) and said so.
fn unmount_fuse(dir: &Path, nbdfuse_pid: u32) {
    let fusermount = runtime::tool("fusermount3", "ZDISK_FUSERMOUNT").unwrap_or_else(|_| "fusermount3".into());
    for problem in
        zdisk_bench::sys::unmount_fuse(&fusermount, dir, Some(nbdfuse_pid), zdisk_bench::sys::WhenStuck::Report)
    {
        eprintln!("zdisk: {problem}");
    }
}

pub fn detach(args: &DetachArgs) -> Result<()> {
    let mut device = std::fs::canonicalize(&args.device).unwrap_or_else(|_| args.device.clone());
    // The store's path works too: its attachment's device.
    if !state_path(&device).exists() {
        if let Ok(info) = Store::info(&args.device) {
            match attachment_of(&info.uuid) {
                Some(attached) => device = attached.device,
                None => bail!("{} is not attached", args.device.display()),
            }
        }
    }
    let path = state_path(&device);
    let state: AttachState =
        runtime::read_json(&path).with_context(|| format!("{} was not attached by zdisk attach", device.display()))?;
    match state.kind.as_str() {
        "nbd" => {
            let nbd_client = runtime::tool("nbd-client", "ZDISK_NBD_CLIENT")?;
            runtime::run(Command::new(nbd_client).arg("-d").arg(&device))?;
        }
        _ => {
            let losetup = runtime::tool("losetup", "ZDISK_LOSETUP")?;
            runtime::run(Command::new(losetup).arg("-d").arg(&device))
                .with_context(|| format!("detaching {} (is it still mounted?)", device.display()))?;
            if let (Some(dir), Some(pid)) = (&state.fuse_dir, state.nbdfuse_pid) {
                unmount_fuse(dir, pid);
            }
        }
    }
    if let Some(pid) = state.started_serve_pid {
        stop_background_server(pid);
        // nbdkit leaves its socket file behind; the log stays for whoever wants to read it.
        let _ = std::fs::remove_file(runtime::run_dir().join(format!("{}.sock", state.uuid)));
    }
    let _ = std::fs::remove_file(&path);
    eprintln!("zdisk: detached {} ({})", device.display(), state.store.display());
    Ok(())
}
