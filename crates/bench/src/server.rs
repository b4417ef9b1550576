//! NBD servers a harness starts — `zdisk bench`'s targets, and `zdisk db bench`'s raw
//! qemu-nbd under nbdfuse — as guards that always stop their process and remove the socket.
//! Their CPU and I/O accounting is `sys::tree_sample`.

use std::fs;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rustix::process::{kill_process, Pid, Signal};

/// How long a server gets to come up (zdisk may replay a log) and to go down (it flushes).
const START_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// A running NBD server on a unix socket. Dropping it stops the server (SIGTERM, then SIGKILL
/// after a grace period) and removes the socket, so no error path leaks a process.
pub struct Server {
    child: Option<Child>,
    socket: PathBuf,
    label: String,
    log_path: PathBuf,
}

impl Server {
    /// Starts `cmd` with stdout/stderr appended to `log_path` and waits until `socket` accepts
    /// connections.
    pub fn spawn(label: &str, mut cmd: Command, socket: &Path, log_path: &Path) -> Result<Server> {
        // A stale socket from a killed earlier run would make the readiness check lie.
        let _ = fs::remove_file(socket);
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)
            .with_context(|| format!("opening server log {}", log_path.display()))?;
        cmd.stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        let program = cmd.get_program().to_string_lossy().into_owned();
        let child = cmd.spawn().with_context(|| format!("starting {label} ({program})"))?;
        let mut server = Server {
            child: Some(child),
            socket: socket.to_path_buf(),
            label: label.to_string(),
            log_path: log_path.to_path_buf(),
        };
        let start = Instant::now();
        loop {
            if let Some(status) = server.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                server.child = None;
                bail!(
                    "{label} exited during start-up ({status}); last lines of {}:\n{}",
                    log_path.display(),
                    tail(log_path, 15)
                );
            }
            if socket.exists() && UnixStream::connect(socket).is_ok() {
                return Ok(server);
            }
            if start.elapsed() > START_TIMEOUT {
                bail!(
                    "{label} did not open {} within {:?}; last lines of {}:\n{}",
                    socket.display(),
                    START_TIMEOUT,
                    log_path.display(),
                    tail(log_path, 15)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }

    /// Whether the process is still running (a crashed server must not be measured as slow).
    pub fn alive(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    pub fn describe_exit(&self) -> String {
        format!(
            "{} is not running; last lines of {}:\n{}",
            self.label,
            self.log_path.display(),
            tail(&self.log_path, 15)
        )
    }

    /// Stops the server: SIGTERM (zdisk serve flushes and checkpoints on it), SIGKILL if it
    /// does not exit within the grace period.
    pub fn stop(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            let _ = fs::remove_file(&self.socket);
            return Ok(());
        };
        let result = (|| {
            if child.try_wait()?.is_some() {
                return Ok(());
            }
            if let Some(pid) = Pid::from_raw(child.id() as i32) {
                let _ = kill_process(pid, Signal::TERM);
            }
            let start = Instant::now();
            while start.elapsed() < STOP_TIMEOUT {
                if child.try_wait()?.is_some() {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
            bail!("{} ignored SIGTERM for {:?}; killed", self.label, STOP_TIMEOUT)
        })();
        let _ = fs::remove_file(&self.socket);
        result
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// The honest raw baseline both harnesses compare zdisk with: a raw image behind qemu-nbd
/// with O_DIRECT (`--cache=none --aio=native`), up between connections (`--persistent`),
/// letting `shared` clients in at once.
pub fn qemu_nbd_raw(image: &Path, socket: &Path, shared: u32) -> Command {
    let mut c = Command::new(crate::sys::find_tool("qemu-nbd").unwrap_or_else(|| "qemu-nbd".into()));
    c.args(["-f", "raw", "--cache=none", "--aio=native", "--persistent"])
        .arg(format!("--shared={shared}"))
        .arg(format!("--socket={}", socket.display()))
        .arg(image);
    c
}

/// A new sparse file of `size` bytes in place of `path`: a raw disk's "secure erase"; what
/// is written later allocates it.
pub fn sparse_file(path: &Path, size: u64) -> Result<()> {
    let _ = fs::remove_file(path);
    let f = fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.set_len(size).with_context(|| format!("sizing {}", path.display()))?;
    Ok(())
}

/// Last `n` lines of a log file, for error messages.
pub fn tail(path: &Path, n: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Finds `tool` on PATH or fails with a message that names it and what needs it.
pub fn require_tool(tool: &str, needed_for: &str, package_hint: &str) -> Result<PathBuf> {
    if let Some(path) = crate::sys::find_tool(tool) {
        return Ok(path);
    }
    bail!("`{tool}` not found on PATH; it is needed for {needed_for}. Install it (e.g. `apt-get install {package_hint}`) or drop that part with --targets/--data")
}
