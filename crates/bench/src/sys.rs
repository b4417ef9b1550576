//! Processes, tools, interrupts and the kernel's counters (/proc, /sys) the runs are measured
//! with: the one copy `zdisk bench` and `zdisk db bench` (crates/apps) share, so both tell
//! "alive", "gone" and "CPU of a server" the same way.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;

static INTERRUPTED: OnceLock<Arc<AtomicBool>> = OnceLock::new();
static LOG: Mutex<Option<std::fs::File>> = Mutex::new(None);
static START: OnceLock<Instant> = OnceLock::new();

/// SIGINT/SIGTERM set a flag that every wait checks; a second signal ends the process at once.
/// Child processes run in their own process groups, so a terminal's Ctrl-C reaches only us and
/// the teardown (databases stopped, filesystems unmounted, devices detached) stays in order.
pub fn install_signal_handlers() -> Result<()> {
    let flag = INTERRUPTED.get_or_init(|| Arc::new(AtomicBool::new(false))).clone();
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(signal, 1, flag.clone())?;
        signal_hook::flag::register(signal, flag.clone())?;
    }
    START.get_or_init(Instant::now);
    Ok(())
}

pub fn interrupted() -> bool {
    INTERRUPTED.get().map(|f| f.load(Ordering::SeqCst)).unwrap_or(false)
}

pub fn check_interrupt() -> Result<()> {
    if interrupted() {
        bail!("interrupted (SIGINT/SIGTERM); tearing down");
    }
    Ok(())
}

/// Sleeps, waking early (with an error) when interrupted.
pub fn sleep(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    while Instant::now() < end {
        check_interrupt()?;
        std::thread::sleep((end - Instant::now()).min(Duration::from_millis(100)));
    }
    Ok(())
}

pub fn set_log_file(path: &Path) -> Result<()> {
    let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    *LOG.lock().unwrap() = Some(file);
    Ok(())
}

/// A progress line on stderr (and in the run's log file) with the time since start.
pub fn progress(msg: &str) {
    let t = START.get_or_init(Instant::now).elapsed().as_secs_f64();
    let line = format!("[{:>7.1}s] {msg}", t);
    eprintln!("{line}");
    if let Some(file) = LOG.lock().unwrap().as_mut() {
        let _ = writeln!(file, "{line}");
    }
}

/// A tool and the Debian package that provides it.
#[derive(Clone, Copy, Debug)]
pub struct Tool {
    pub name: &'static str,
    pub package: &'static str,
}

pub const fn tool(name: &'static str, package: &'static str) -> Tool {
    Tool { name, package }
}

/// `name` on PATH, else in the sbin directories (a root tool such as losetup when PATH lacks
/// them) and PostgreSQL's versioned bin directories.
pub fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    dirs.extend(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from));
    // PostgreSQL's server programs live in a versioned directory on Debian.
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<PathBuf> = entries.flatten().map(|e| e.path().join("bin")).collect();
        versions.sort();
        versions.reverse();
        dirs.extend(versions);
    }
    dirs.into_iter().map(|d| d.join(name)).find(|c| c.is_file())
}

/// Every missing tool, named with its package; an error listing them all.
pub fn require_tools(what: &str, tools: &[Tool]) -> Result<()> {
    let missing: Vec<&Tool> = tools.iter().filter(|t| find_tool(t.name).is_none()).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let mut packages: Vec<&str> = missing.iter().map(|t| t.package).collect();
    packages.sort();
    packages.dedup();
    let names: Vec<String> = missing.iter().map(|t| format!("{} ({})", t.name, t.package)).collect();
    bail!(
        "{what} needs tools that are not installed: {}. Install them with: apt-get install {}",
        names.join(", "),
        packages.join(" ")
    )
}

/// First line of `tool --version` (empty when the tool is missing or says nothing), for
/// reports.
pub fn tool_version(name: &str) -> String {
    let Some(path) = find_tool(name) else { return String::new() };
    Command::new(path)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").trim().to_string())
        .unwrap_or_default()
}

pub fn path_of(name: &str) -> Result<PathBuf> {
    find_tool(name).ok_or_else(|| anyhow!("{name} not found in PATH"))
}

/// A command for `name` found in PATH (or the usual sbin and PostgreSQL directories).
pub fn cmd(name: &str) -> Result<Command> {
    Ok(Command::new(path_of(name)?))
}

/// Runs a command to completion in its own process group; stdout on success, an error with
/// stderr otherwise.
pub fn run(command: &mut Command) -> Result<String> {
    let what = describe(command);
    command.process_group(0).stdin(Stdio::null());
    let output = command.output().with_context(|| format!("running {what}"))?;
    if !output.status.success() {
        bail!(
            "{what} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim(),
            String::from_utf8_lossy(&output.stdout).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

pub fn describe(command: &Command) -> String {
    let mut s = command.get_program().to_string_lossy().into_owned();
    for a in command.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Spawns in a new process group (Ctrl-C on the terminal does not reach it).
pub fn spawn(command: &mut Command) -> Result<Child> {
    let what = describe(command);
    command.process_group(0).stdin(Stdio::null());
    command.spawn().with_context(|| format!("starting {what}"))
}

pub fn signal(pid: u32, sig: i32) -> bool {
    // SAFETY: kill(2) with a pid we started; no memory is touched.
    unsafe { libc::kill(pid as i32, sig) == 0 }
}

pub fn signal_group(pgid: u32, sig: i32) -> bool {
    // SAFETY: as above, to the process group we created with process_group(0).
    unsafe { libc::kill(-(pgid as i32), sig) == 0 }
}

/// Whether `pid` is a running process: kill(pid, 0) finds it (EPERM too: it exists, another
/// user's), and it is not a zombie — a zombie holds no files, locks or devices and does no
/// I/O; only its parent's `wait` is missing. Pid 0 and pids past `i32::MAX` are never
/// processes (kill would take them for process groups).
pub fn alive(pid: u32) -> bool {
    let Ok(raw) = libc::pid_t::try_from(pid) else { return false };
    if raw <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks for the process; no memory is involved.
    if unsafe { libc::kill(raw, 0) } != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EPERM) {
        return false;
    }
    // The state letter follows the command name's closing parenthesis. An unreadable stat
    // (/proc mounted with hidepid, or the process exiting this moment) leaves kill's answer
    // standing: a waiter asks again.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(stat.rsplit(')').next().map(|s| s.trim_start().chars().next()), Some(Some('Z'))),
        Err(_) => true,
    }
}

/// Waits until `pid` is no longer `alive` (exited, a zombie or reaped); false on timeout.
pub fn wait_gone(pid: u32, timeout: Duration) -> bool {
    let end = Instant::now() + timeout;
    while alive(pid) {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// `zdisk stat STORE --json` with `zdisk` (a command for the zdisk binary, its environment
/// set: a served store's live statistics are found through `ZDISK_RUN_DIR`). The JSON object
/// is read from the first `{`, past anything printed before it.
pub fn zdisk_stat(mut zdisk: Command, store: &Path) -> Result<serde_json::Value> {
    let what = zdisk.get_program().to_string_lossy().into_owned();
    // In its own process group, as every command here: a Ctrl-C reaches only the harness,
    // whose teardown runs in order.
    let out = zdisk
        .arg("stat")
        .arg(store)
        .arg("--json")
        .process_group(0)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {what} stat"))?;
    if !out.status.success() {
        bail!("zdisk stat failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text.find('{').ok_or_else(|| anyhow!("zdisk stat --json printed no JSON object"))?;
    serde_json::from_str(&text[start..]).context("parsing zdisk stat --json")
}

/// What `unmount_fuse` does with a mount or an nbdfuse that will not go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WhenStuck {
    /// A harness tearing down a stack it built (nbdfuse is its child): unmount lazily, then
    /// SIGKILL nbdfuse and reap it, so the teardown goes on.
    Force,
    /// A user's device (`zdisk detach`): leave the mount and nbdfuse be and say so; whoever
    /// still uses the device may have writes in flight.
    Report,
}

/// Unmounts the nbdfuse mount at `dir` with `fusermount` (`-u`, retried for 30 s while it is
/// busy), waits up to 60 s for nbdfuse (`nbdfuse_pid`) to exit — it flushes and closes its NBD
/// connection once unmounted — and removes the directory. Returns what went wrong, for the
/// caller to print: a teardown reports and goes on.
pub fn unmount_fuse(fusermount: &Path, dir: &Path, nbdfuse_pid: Option<u32>, when_stuck: WhenStuck) -> Vec<String> {
    let mut problems = Vec::new();
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        match run(Command::new(fusermount).arg("-u").arg(dir)) {
            Ok(_) => break,
            Err(e) if Instant::now() >= end => {
                if when_stuck == WhenStuck::Force {
                    problems.push(format!("{e:#}; lazy unmount"));
                    let _ = run(Command::new(fusermount).arg("-uz").arg(dir));
                } else {
                    problems.push(format!("{e:#}"));
                }
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    if let Some(pid) = nbdfuse_pid {
        if !wait_gone(pid, Duration::from_secs(60)) {
            problems.push(format!("nbdfuse pid {pid} did not exit after unmount"));
            if when_stuck == WhenStuck::Force {
                signal(pid, libc::SIGKILL);
            }
        }
        if when_stuck == WhenStuck::Force {
            // SAFETY: reaping our own child by pid (the harness spawned it); WNOHANG never
            // blocks, and a pid that is not our child only makes waitpid fail.
            unsafe {
                libc::waitpid(pid as i32, std::ptr::null_mut(), libc::WNOHANG);
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
    problems
}

pub fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

pub fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// utime + stime of one process (all its threads), in seconds.
pub fn process_cpu_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(parse_stat(pid, &stat)?.cpu_ticks as f64 / clock_ticks())
}

/// Our own reaped children's CPU (cutime + cstime): how sysbench/pgbench's CPU is measured.
pub fn children_cpu_s() -> f64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we pass.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// One entry of the process table, as the teardown needs it.
#[derive(Clone, Debug)]
pub struct Proc {
    pub pid: u32,
    pub ppid: u32,
    pub pgid: u32,
    /// Start time (clock ticks since boot): with the pid, identifies the process even if the
    /// pid is reused later.
    pub start: u64,
    /// State letter (R, S, D, Z, ...).
    pub state: char,
    pub comm: String,
    /// utime + stime of the process (all its threads), clock ticks.
    pub cpu_ticks: u64,
    /// cutime + cstime: the CPU of children it has reaped, clock ticks.
    pub reaped_children_ticks: u64,
}

fn parse_stat(pid: u32, stat: &str) -> Option<Proc> {
    let (head, rest) = stat.rsplit_once(')')?;
    let comm = head.split_once('(').map(|x| x.1).unwrap_or_default().to_string();
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the comm field: state(0) ppid(1) pgrp(2) ... utime(11) stime(12) cutime(13)
    // cstime(14) ... starttime(19).
    let num = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok());
    Some(Proc {
        pid,
        ppid: num(1)? as u32,
        pgid: num(2)? as u32,
        start: num(19)?,
        state: f.first()?.chars().next()?,
        comm,
        cpu_ticks: num(11)? + num(12)?,
        reaped_children_ticks: num(13)? + num(14)?,
    })
}

/// The process table (/proc/*/stat); processes that exit while it is read are left out.
pub fn processes() -> Vec<Proc> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            if let Some(proc_) =
                std::fs::read_to_string(format!("/proc/{p}/stat")).ok().and_then(|stat| parse_stat(p, &stat))
            {
                out.push(proc_);
            }
        }
    }
    out
}

/// `roots` and every descendant of them in `procs` (children, grandchildren, ...).
fn descendants(procs: &[Proc], roots: &[u32]) -> Vec<u32> {
    let mut tree = roots.to_vec();
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        for p in procs.iter().filter(|p| p.ppid == parent) {
            if !tree.contains(&p.pid) {
                tree.push(p.pid);
            }
        }
        i += 1;
    }
    tree
}

/// Every descendant of `pid` (children, grandchildren, ...), and `pid` itself.
pub fn process_tree(pid: u32) -> Vec<u32> {
    descendants(&processes(), &[pid])
}

/// The children of `pid` now.
pub fn children_of(pid: u32) -> Vec<u32> {
    processes().into_iter().filter(|p| p.ppid == pid).map(|p| p.pid).collect()
}

/// Every process (other than this one) whose working directory, root directory, executable or
/// one of whose open files is under `dir` (a canonical path). Mappings are not read:
/// /proc/PID/maps can block behind a process stuck in I/O on a dead device.
pub fn users_of(dir: &Path) -> Vec<u32> {
    let me = std::process::id();
    let under = |link: PathBuf| link.starts_with(dir);
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return out };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if pid == me {
            continue;
        }
        let base = e.path();
        let mut uses = ["cwd", "root", "exe"].iter().any(|l| std::fs::read_link(base.join(l)).is_ok_and(under));
        if !uses {
            if let Ok(fds) = std::fs::read_dir(base.join("fd")) {
                uses = fds.flatten().any(|fd| std::fs::read_link(fd.path()).is_ok_and(under));
            }
        }
        if uses {
            out.push(pid);
        }
    }
    out
}

/// SIGKILLs every process of `roots`, all their descendants and every process using anything
/// under one of `dirs`, and waits until all of them are dead (a zombie is dead: it holds no
/// files and does no I/O); fails after `timeout` naming the survivors. The descendants are
/// looked up again on every pass, from every process killed so far (identified by pid and
/// start time), so a child forked while its parent was being killed is killed too; one that
/// was reparented to init still uses `dirs` (PostgreSQL's and MariaDB's processes all work in
/// the data directory). Returns the processes killed.
pub fn kill_all(roots: &[u32], dirs: &[&Path], timeout: Duration) -> Result<Vec<Proc>> {
    let me = std::process::id();
    let dirs: Vec<PathBuf> =
        dirs.iter().map(|d| std::fs::canonicalize(d).unwrap_or_else(|_| d.to_path_buf())).collect();
    let end = Instant::now() + timeout;
    // pid -> every process killed so far.
    let mut seen: std::collections::HashMap<u32, Proc> = std::collections::HashMap::new();
    let mut first = true;
    loop {
        let procs = processes();
        let start_of = |pid: u32| procs.iter().find(|p| p.pid == pid).map(|p| p.start);
        let mut from: Vec<u32> = Vec::new();
        if first {
            from.extend(roots.iter().copied().filter(|&r| start_of(r).is_some()));
            first = false;
        }
        from.extend(seen.values().filter(|p| start_of(p.pid) == Some(p.start)).map(|p| p.pid));
        let mut targets = descendants(&procs, &from);
        for d in &dirs {
            targets.extend(users_of(d));
        }
        targets.sort_unstable();
        targets.dedup();
        let live: Vec<&Proc> = targets
            .iter()
            .filter(|&&pid| pid != me && pid > 1)
            .filter_map(|&pid| procs.iter().find(|p| p.pid == pid))
            .filter(|p| p.state != 'Z' && p.state != 'X')
            .collect();
        if live.is_empty() {
            return Ok(seen.into_values().collect());
        }
        if Instant::now() > end {
            let names: Vec<String> =
                live.iter().map(|p| format!("{} ({}, state {})", p.pid, p.comm, p.state)).collect();
            bail!(
                "processes still alive {} s after SIGKILL: {} (they use {} or descend from pid {:?})",
                timeout.as_secs(),
                names.join(", "),
                dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", "),
                roots
            );
        }
        for p in live {
            signal(p.pid, libc::SIGKILL);
            seen.insert(p.pid, p.clone());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `pid` has left the process table altogether (exited and reaped: not even a
/// zombie), so that nothing can mistake it for a live process — PostgreSQL refuses to start
/// while the pid in postmaster.pid answers kill(pid, 0).
pub fn wait_reaped(pid: u32, timeout: Duration) -> bool {
    let end = Instant::now() + timeout;
    while Path::new(&format!("/proc/{pid}")).exists() {
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// CPU of every kernel thread (children of kthreadd, pid 2): the loop device's workers, kworkers
/// doing block and FUSE work. Threads that come and go between two samples are missed or
/// counted whole; an approximation, but it leaves other users' processes out.
pub fn kernel_threads_cpu_s() -> f64 {
    let ticks: u64 = processes().iter().filter(|p| p.ppid == 2).map(|p| p.cpu_ticks).sum();
    ticks as f64 / clock_ticks()
}

/// CPU time and storage traffic of a process and all its descendants at one instant.
#[derive(Clone, Copy, Debug, Default)]
pub struct TreeSample {
    pub cpu_s: f64,
    /// Bytes the tree caused to be read from / sent to storage (/proc/PID/io `read_bytes`,
    /// `write_bytes`); None when the kernel does not expose them for one of its processes.
    pub os_read_bytes: Option<u64>,
    pub os_write_bytes: Option<u64>,
}

/// Sums utime+stime over `root` and its live descendants (threads are included by the
/// kernel), plus cutime+cstime for children they already reaped: `zdisk serve` runs nbdkit as
/// a child, and PostgreSQL forks a process per connection that may exit during a run, so the
/// root alone, or the live processes alone, would miss work done for the run.
pub fn tree_sample(root: u32) -> TreeSample {
    let procs = processes();
    let tree = descendants(&procs, &[root]);
    let ticks: u64 =
        procs.iter().filter(|p| tree.contains(&p.pid)).map(|p| p.cpu_ticks + p.reaped_children_ticks).sum();
    let io = |key: &str| -> Option<u64> { tree.iter().map(|&pid| io_counter(pid, key)).sum() };
    TreeSample {
        cpu_s: ticks as f64 / clock_ticks(),
        os_read_bytes: io("read_bytes:"),
        os_write_bytes: io("write_bytes:"),
    }
}

/// One counter of /proc/PID/io (`read_bytes:`, `write_bytes:`).
fn io_counter(pid: u32, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    text.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.trim().parse().ok())
}

/// The machine-wide CPU split from /proc/stat (jiffies summed over all CPUs).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct CpuTimes {
    pub user: f64,
    pub system: f64,
    pub iowait: f64,
    pub idle: f64,
    pub irq: f64,
    pub steal: f64,
}

impl CpuTimes {
    pub fn now() -> CpuTimes {
        let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let line = text.lines().next().unwrap_or_default();
        let v: Vec<f64> = line.split_whitespace().skip(1).map(|x| x.parse().unwrap_or(0.0)).collect();
        let g = |i: usize| v.get(i).copied().unwrap_or(0.0) / clock_ticks();
        CpuTimes { user: g(0) + g(1), system: g(2), idle: g(3), iowait: g(4), irq: g(5) + g(6), steal: g(7) }
    }

    pub fn minus(&self, o: &CpuTimes) -> CpuTimes {
        CpuTimes {
            user: self.user - o.user,
            system: self.system - o.system,
            iowait: self.iowait - o.iowait,
            idle: self.idle - o.idle,
            irq: self.irq - o.irq,
            steal: self.steal - o.steal,
        }
    }

    pub fn total(&self) -> f64 {
        self.user + self.system + self.iowait + self.idle + self.irq + self.steal
    }

    pub fn busy(&self) -> f64 {
        self.user + self.system + self.irq + self.steal
    }
}

/// A block device's counters from /sys/block/NAME/stat.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct DiskStat {
    pub read_ios: u64,
    pub read_bytes: u64,
    pub write_ios: u64,
    pub write_bytes: u64,
    pub io_ticks_ms: u64,
}

impl DiskStat {
    pub fn of(device: &Path) -> DiskStat {
        let name = std::fs::canonicalize(device)
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_default();
        let text = std::fs::read_to_string(format!("/sys/block/{name}/stat")).unwrap_or_default();
        let v: Vec<u64> = text.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
        let g = |i: usize| v.get(i).copied().unwrap_or(0);
        DiskStat { read_ios: g(0), read_bytes: g(2) * 512, write_ios: g(4), write_bytes: g(6) * 512, io_ticks_ms: g(9) }
    }

    pub fn minus(&self, o: &DiskStat) -> DiskStat {
        DiskStat {
            read_ios: self.read_ios.saturating_sub(o.read_ios),
            read_bytes: self.read_bytes.saturating_sub(o.read_bytes),
            write_ios: self.write_ios.saturating_sub(o.write_ios),
            write_bytes: self.write_bytes.saturating_sub(o.write_bytes),
            io_ticks_ms: self.io_ticks_ms.saturating_sub(o.io_ticks_ms),
        }
    }
}

/// The CPU's model name (/proc/cpuinfo), for reports.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':').map(|x| x.1.trim().to_string()))
        .unwrap_or_default()
}

/// The running kernel's release (`uname -r`), for reports.
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_string()
}

/// /proc/loadavg's 1, 5 and 15 minute averages: a busy machine makes every number noisier.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Bytes allocated to a file (st_blocks), which for a sparse file is what it really takes.
pub fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}

/// Sum of apparent sizes and of allocated bytes of every regular file under `dir`.
pub fn tree_sizes(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let mut apparent = 0;
    let mut allocated = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let Ok(m) = e.path().symlink_metadata() else { continue };
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() {
                apparent += m.len();
                allocated += m.blocks() * 512;
            }
        }
    }
    (apparent, allocated)
}

/// Every regular file under `dir` whose name ends with one of `suffixes`, sorted.
pub fn files_with_suffix(dir: &Path, suffixes: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if suffixes.iter().any(|s| p.to_string_lossy().ends_with(s)) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

pub fn unix_time() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub fn unix_time_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A short run directory for sockets (a Unix socket path may not exceed 107 bytes, and the
/// work directory can be deep): /tmp/zdb-<pid>-<n>.
pub fn short_run_dir() -> Result<PathBuf> {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    let dir = PathBuf::from(format!("/tmp/zdb-{}-{}", std::process::id(), nanos % 1_000_000));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zombie_is_gone_and_a_running_process_is_alive() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        assert!(alive(pid));
        assert!(!wait_gone(pid, Duration::from_millis(100)), "a sleeping process is not gone");
        signal(pid, libc::SIGKILL);
        assert!(wait_gone(pid, Duration::from_secs(10)));
        // Not reaped yet: kill(pid, 0) still finds it, and yet it is gone.
        assert!(Path::new(&format!("/proc/{pid}")).exists(), "a zombie until reaped");
        child.wait().unwrap();
        assert!(!alive(pid));
        assert!(!alive(0), "pid 0 is a process group to kill(2), not a process");
        assert!(!alive(u32::MAX));
    }

    #[test]
    fn stat_fields_are_read_past_a_command_name_with_parentheses() {
        let stat = "42 (a) (b c) S 7 42 42 0 -1 4194560 1 2 3 4 150 25 30 5 20 0 1 0 123456 0 0";
        let p = parse_stat(42, stat).unwrap();
        assert_eq!((p.pid, p.ppid, p.pgid, p.state), (42, 7, 42, 'S'));
        assert_eq!(p.comm, "a) (b c");
        assert_eq!((p.cpu_ticks, p.reaped_children_ticks, p.start), (175, 35, 123456));
        assert!(parse_stat(1, "1 (x) S 0").is_none(), "a short line is no process");
    }

    #[test]
    fn a_process_tree_counts_the_cpu_of_children_it_reaped() {
        let me = std::process::id();
        let reaped = || processes().into_iter().find(|p| p.pid == me).unwrap().reaped_children_ticks;
        let before = reaped();
        let status =
            Command::new("sh").arg("-c").arg("i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done").status().unwrap();
        assert!(status.success());
        let gained_s = (reaped() - before) as f64 / clock_ticks();
        assert!(gained_s >= 0.05, "a busy child's CPU shows in its parent's reaped time: {gained_s} s");
        assert!(tree_sample(me).cpu_s >= gained_s);
    }
}
