//! Run-time files shared by `serve`, `stat`, `resize`, `attach` and `detach`, and small
//! process helpers.
//!
//! Files under the run directory (`$ZDISK_RUN_DIR`, default `/run/zdisk`):
//! - `<uuid>.json`       live statistics, rewritten every second by the plugin;
//! - `<uuid>.ctl`        the plugin's control socket (`resize BYTES`, `stats`);
//! - `<uuid>.serve.json` written by `zdisk serve` once nbdkit is ready: its pid, the URI;
//! - `<uuid>.sock`, `<uuid>.log`  the socket and log of a server `zdisk attach` started;
//! - `attach/<device>.json` what `zdisk detach` must undo;
//! - `fuse-<uuid>/nbd`   the nbdfuse file behind a loop device.
//!
//! A file here is only a hint: the store's lock is the truth about whether it is served.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use zdisk_engine::Lock;

pub const DEFAULT_RUN_DIR: &str = "/run/zdisk";

/// Where live statistics, control sockets and attach state go: `$ZDISK_RUN_DIR`; else
/// `/run/zdisk` for root; else `$XDG_RUNTIME_DIR/zdisk` (a user cannot create `/run/zdisk`:
/// `serve` failed with "Permission denied" and no hint), else `/tmp/zdisk-UID`.
pub fn run_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ZDISK_RUN_DIR") {
        return dir.into();
    }
    let uid = rustix::process::geteuid();
    if uid.is_root() {
        return DEFAULT_RUN_DIR.into();
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("zdisk"),
        _ => std::env::temp_dir().join(format!("zdisk-{}", uid.as_raw())),
    }
}

pub fn live_file(uuid: &str) -> PathBuf {
    run_dir().join(format!("{uuid}.json"))
}

pub fn control_socket(uuid: &str) -> PathBuf {
    run_dir().join(format!("{uuid}.ctl"))
}

/// The reason a served store failed, written by the plugin at unload (its
/// `failed_file_path`): `zdisk serve` then exits non-zero.
pub fn failed_file(uuid: &str) -> PathBuf {
    run_dir().join(format!("{uuid}.failed"))
}

pub fn serve_file(uuid: &str) -> PathBuf {
    run_dir().join(format!("{uuid}.serve.json"))
}

/// What `zdisk serve` records once nbdkit serves the store.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServeState {
    pub store: PathBuf,
    pub uuid: String,
    /// The `zdisk serve` process.
    pub pid: u32,
    /// The process serving NBD: `zdisk serve` itself with the native front end, nbdkit with
    /// `--frontend nbdkit`.
    #[serde(alias = "nbdkit_pid")]
    pub server_pid: u32,
    pub uri: String,
    pub unix_socket: Option<PathBuf>,
    pub read_only: bool,
}

pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
}

/// Writes `value` as JSON atomically (tmp file + rename).
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = path.with_extension("tmp");
    let mut bytes = serde_json::to_vec_pretty(value)?;
    bytes.push(b'\n');
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))?;
    Ok(())
}

/// Whether a process runs, and waiting for one to end: the harness's one copy (a zombie counts
/// as gone: it holds no lock and no device any more).
pub use zdisk_bench::sys::{alive as process_alive, wait_gone};

pub fn send_signal(pid: u32, signal: i32) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: sending a signal to a process we started; no memory is involved.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Whether another process holds the store's lock so that one of `lock` cannot be taken
/// (the engine takes `flock`: exclusive for a writer, shared for a reader).
pub fn store_is_locked(path: &Path, lock: Lock) -> Result<bool> {
    zdisk_engine::is_locked(path, lock).with_context(|| format!("probing the lock of {}", path.display()))
}

/// Sends one request line to the plugin's control socket and returns its one-line reply.
pub fn control_request(socket: &Path, request: &str) -> Result<String> {
    let stream = UnixStream::connect(socket)
        .with_context(|| format!("connecting to the server's control socket {}", socket.display()))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    (&stream).write_all(format!("{request}\n").as_bytes())?;
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply)?;
    Ok(reply.trim_end().to_string())
}

/// Finds an executable: `$ENV_VAR` if set, else `name` in PATH.
pub fn tool(name: &str, env_var: &str) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(env_var) {
        return Ok(PathBuf::from(path));
    }
    if let Some(path) = zdisk_bench::sys::find_tool(name) {
        return Ok(path);
    }
    bail!("{name} not found in PATH (install it: see README.md; or set {env_var})")
}

/// Runs a command to completion; fails with its stderr when it fails.
pub fn run(command: &mut Command) -> Result<String> {
    let output = command.output().with_context(|| format!("running {command:?}"))?;
    if !output.status.success() {
        bail!("{command:?} failed ({}): {}", output.status, String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
