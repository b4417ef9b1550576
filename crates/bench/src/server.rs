//! NBD servers the benchmark starts, as guards that always stop their process and remove the
//! socket, plus process-tree CPU and I/O accounting from /proc.

use std::collections::HashMap;
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

/// Last `n` lines of a log file, for error messages.
pub fn tail(path: &Path, n: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// CPU time and storage writes of a process and all its descendants at one instant.
#[derive(Clone, Copy, Debug, Default)]
pub struct TreeSample {
    pub cpu_s: f64,
    /// Bytes the tree caused to be sent to storage (/proc/PID/io `write_bytes`); None when the
    /// kernel does not expose it.
    pub os_write_bytes: Option<u64>,
}

struct ProcInfo {
    ppid: u32,
    own_ticks: u64,
    reaped_children_ticks: u64,
}

fn read_stat(pid: u32) -> Option<ProcInfo> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses; fields after the last ')'
    // are plain numbers: state ppid ... utime(14) stime(15) cutime(16) cstime(17).
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok());
    Some(ProcInfo { ppid: num(1)? as u32, own_ticks: num(11)? + num(12)?, reaped_children_ticks: num(13)? + num(14)? })
}

fn read_write_bytes(pid: u32) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    text.lines().find_map(|l| l.strip_prefix("write_bytes:")).and_then(|v| v.trim().parse().ok())
}

/// Sums utime+stime over `root` and its live descendants (threads are included by the kernel),
/// plus cutime+cstime for children they already reaped. `zdisk serve` runs nbdkit as a child,
/// so looking at the root alone would miss the plugin's work.
pub fn tree_sample(root: u32) -> TreeSample {
    let mut procs: HashMap<u32, ProcInfo> = HashMap::new();
    if let Ok(dir) = fs::read_dir("/proc") {
        for entry in dir.flatten() {
            if let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) {
                if let Some(info) = read_stat(pid) {
                    procs.insert(pid, info);
                }
            }
        }
    }
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(procs.iter().filter(|(_, p)| p.ppid == parent).map(|(&pid, _)| pid));
        i += 1;
    }
    let ticks: u64 = tree.iter().filter_map(|pid| procs.get(pid)).map(|p| p.own_ticks + p.reaped_children_ticks).sum();
    let writes: Option<u64> = tree.iter().map(|&pid| read_write_bytes(pid)).sum();
    TreeSample { cpu_s: ticks as f64 / rustix::param::clock_ticks_per_second() as f64, os_write_bytes: writes }
}

/// Finds `tool` on PATH or fails with a message that names it and what needs it.
pub fn require_tool(tool: &str, needed_for: &str, package_hint: &str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join(tool);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!("`{tool}` not found on PATH; it is needed for {needed_for}. Install it (e.g. `apt-get install {package_hint}`) or drop that part with --targets/--data")
}

/// First line of `tool --version`, for the report.
pub fn tool_version(tool: &str) -> String {
    Command::new(tool)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").trim().to_string())
        .unwrap_or_default()
}
