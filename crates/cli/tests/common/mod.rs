//! Shared setup for the interop tests: the `zdisk` binary and plugin, required tools, a
//! scratch directory per test, and a server guard that never outlives its test.
//!
//! The plugin `.so` is found next to the `zdisk` binary cargo built for this test run
//! (`target/<profile>/` or `target/<profile>/deps/`; the CLI crate lists the plugin as a
//! dev-dependency so `cargo test` builds it). Set `ZDISK_PLUGIN` to use another one.
//!
//! A missing tool (nbdkit, fio, qemu-img, nbdfuse, ...) skips a test locally, but fails it
//! when `CI=true`: CI must prove what the tests claim, not skip it.

#![allow(dead_code)]

pub mod crash_model;
pub mod nbd;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn zdisk_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_zdisk"))
}

pub fn plugin_if_built() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ZDISK_PLUGIN") {
        return Some(PathBuf::from(path));
    }
    let bin = zdisk_bin();
    let dir = bin.parent().expect("zdisk binary has a directory");
    // deps/ first: cargo test rebuilt it for this run; the uplifted copy may be older.
    [dir.join("deps/libnbdkit_zdisk_plugin.so"), dir.join("libnbdkit_zdisk_plugin.so")]
        .into_iter()
        .find(|candidate| candidate.is_file())
}

pub fn plugin() -> PathBuf {
    plugin_if_built().unwrap_or_else(|| {
        panic!(
            "libnbdkit_zdisk_plugin.so not found next to {} (build it: cargo build -p zdisk-nbdkit, \
         with the same profile and CARGO_TARGET_DIR as the tests)",
            zdisk_bin().display()
        )
    })
}

pub fn in_ci() -> bool {
    std::env::var("CI").map(|v| v == "true" || v == "1").unwrap_or(false)
}

fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// `true` when every tool is installed. Otherwise: panics in CI, prints SKIP and returns
/// `false` elsewhere.
pub fn require(tools: &[&str]) -> bool {
    let missing: Vec<&str> = tools.iter().copied().filter(|t| find_in_path(t).is_none()).collect();
    if missing.is_empty() {
        return true;
    }
    if in_ci() {
        panic!("required tools missing in CI: {missing:?} (.ci/run must install them)");
    }
    eprintln!("SKIP: missing tools {missing:?}");
    false
}

/// Whether loop devices and FUSE work here (a container may lack them).
pub fn require_block_devices() -> bool {
    let ok = Path::new("/dev/fuse").exists() && Path::new("/dev/loop-control").exists() && is_root();
    if ok {
        return true;
    }
    if in_ci() {
        panic!("CI needs root, /dev/fuse and /dev/loop-control for the filesystem test");
    }
    eprintln!("SKIP: needs root, /dev/fuse and /dev/loop-control");
    false
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A scratch directory with its own run directory (live files, attach state).
pub struct Scratch {
    pub dir: tempfile::TempDir,
}

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let dir = tempfile::Builder::new().prefix(&format!("zdisk-{name}.")).tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("run")).unwrap();
        Scratch { dir }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn run_dir(&self) -> PathBuf {
        self.path("run")
    }

    /// `zdisk ARGS` with this scratch's run directory and the test plugin.
    pub fn zdisk(&self) -> Command {
        let mut command = Command::new(zdisk_bin());
        command.env("ZDISK_RUN_DIR", self.run_dir());
        if let Some(plugin) = plugin_if_built() {
            command.env("ZDISK_PLUGIN", plugin);
        }
        command
    }

    pub fn zdisk_ok(&self, args: &[&str]) -> String {
        let output = self.zdisk().args(args).output().expect("running zdisk");
        assert_success(&output, &format!("zdisk {args:?}"));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Formats `name` in the scratch directory.
    pub fn format(&self, name: &str, physical: &str, logical: &str, extra: &[&str]) -> PathBuf {
        let store = self.path(name);
        let mut args = vec!["format", store.to_str().unwrap(), "--physical-size", physical, "--logical-size", logical];
        args.extend_from_slice(extra);
        self.zdisk_ok(&args);
        store
    }

    pub fn stat_json(&self, store: &Path) -> serde_json::Value {
        let out = self.zdisk_ok(&["stat", store.to_str().unwrap(), "--json"]);
        serde_json::from_str(&out).expect("stat --json is JSON")
    }
}

pub fn assert_success(output: &Output, what: &str) {
    assert!(
        output.status.success(),
        "{what} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Runs a tool and asserts it succeeded; returns stdout.
pub fn run_ok(command: &mut Command) -> String {
    let what = format!("{command:?}");
    let output = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_success(&output, &what);
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The first export `nbdinfo --json` describes at `uri`.
/// Runs `zdisk ARGS`, which must fail: its exit code and stderr.
pub fn fails(scratch: &Scratch, args: &[&str]) -> (i32, String) {
    let output = scratch.zdisk().args(args).output().expect("running zdisk");
    assert!(!output.status.success(), "zdisk {args:?} should fail but succeeded");
    (output.status.code().unwrap_or(-1), String::from_utf8_lossy(&output.stderr).into_owned())
}

/// `zdisk ARGS` fails with exit code `code` and a message containing `says`.
pub fn refused(scratch: &Scratch, args: &[&str], code: i32, says: &str) {
    let (got, stderr) = fails(scratch, args);
    assert_eq!(got, code, "zdisk {args:?}: {stderr}");
    assert!(stderr.contains(says), "zdisk {args:?}: expected {says:?} in:\n{stderr}");
}

pub fn nbdinfo_json(uri: &str) -> serde_json::Value {
    let out = run_ok(Command::new("nbdinfo").arg("--json").arg(uri));
    let info: serde_json::Value = serde_json::from_str(&out).expect("nbdinfo --json");
    info["exports"][0].clone()
}

/// The pid in `pid_file` (`-P` of nbdkit, nbdfuse), waiting for it to be written: a daemonising
/// nbdkit returns to its caller before its child has written the file, and a foreground tool
/// writes it only once it serves. Panics after `timeout` naming `what` and the file.
pub fn wait_for_pid_file(pid_file: &Path, what: &str, timeout: Duration) -> u32 {
    let start = Instant::now();
    loop {
        // The file is created empty, then the pid is written in one write ("PID\n" by nbdkit,
        // "PID" by nbdfuse): a number is the whole pid.
        if let Some(pid) = std::fs::read_to_string(pid_file).ok().and_then(|t| t.trim().parse::<u32>().ok()) {
            if pid > 0 {
                return pid;
            }
        }
        if start.elapsed() > timeout {
            let content = std::fs::read_to_string(pid_file).map(|t| format!("{t:?}")).unwrap_or_else(|e| e.to_string());
            panic!(
                "{what} did not write its pid file {} within {} s (content: {content})",
                pid_file.display(),
                timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn sha256(path: &Path) -> String {
    let out = run_ok(Command::new("sha256sum").arg(path));
    out.split_whitespace().next().unwrap().to_string()
}

thread_local! {
    /// The front end `Server::start` asks `zdisk serve` for in this test's thread (None: the
    /// default, native); `with_frontend` sets it, so one test body runs against both.
    static FRONTEND: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// The front end `Server::start` uses in this thread ("native" unless `with_frontend` says).
pub fn frontend() -> &'static str {
    FRONTEND.with(|f| f.get()).unwrap_or("native")
}

/// Runs the named tests of the file again against `zdisk serve --frontend nbdkit`, as the
/// tests of a module `through_nbdkit` (each test body starts its servers with `Server`).
#[macro_export]
macro_rules! through_nbdkit {
    ($($name:ident),* $(,)?) => {
        mod through_nbdkit {
            $(
                #[test]
                fn $name() {
                    $crate::common::with_frontend("nbdkit", super::$name);
                }
            )*
        }
    };
}

/// Runs `test` with every `Server` it starts served by `frontend` ("native" or "nbdkit").
pub fn with_frontend(frontend: &'static str, test: impl FnOnce()) {
    FRONTEND.with(|f| f.set(Some(frontend)));
    test();
    FRONTEND.with(|f| f.set(None));
}

/// `zdisk serve` on a Unix socket; stopped with SIGTERM (clean shutdown) on drop.
pub struct Server {
    child: Option<Child>,
    pub uri: String,
    pub socket: PathBuf,
    pid_file: PathBuf,
}

impl Server {
    pub fn start(scratch: &Scratch, store: &Path, extra: &[&str]) -> Server {
        Server::spawn(scratch, store, extra, false)
    }

    /// As a shell starts a foreground job: in a process group of its own, which
    /// `stop_group_with` signals as a terminal does. Its stderr is kept for that call (the
    /// server writes a few lines; a pipe holds far more).
    pub fn start_as_job(scratch: &Scratch, store: &Path, extra: &[&str]) -> Server {
        Server::spawn(scratch, store, extra, true)
    }

    fn spawn(scratch: &Scratch, store: &Path, extra: &[&str], as_job: bool) -> Server {
        let socket = scratch.path(&format!("{}.sock", store.file_name().unwrap().to_string_lossy()));
        let pid_file = scratch.path(&format!("{}.nbdkit.pid", store.file_name().unwrap().to_string_lossy()));
        let mut command = scratch.zdisk();
        command
            .env("ZDISK_PLUGIN", plugin())
            // Idle work waits for the host's absence only, not for the other tests' processes
            // to leave a core free (`store/spare_cpu.rs`).
            .env("ZDISK_IDLE_SPARE_CORES", "0")
            .arg("serve")
            .arg(store)
            .arg("--unix")
            .arg(&socket)
            .arg("--pid-file")
            .arg(&pid_file)
            .args(FRONTEND.with(|f| f.get()).map(|f| ["--frontend", f]).iter().flatten())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        if as_job {
            use std::os::unix::process::CommandExt;
            command.process_group(0).stderr(Stdio::piped());
        }
        let mut child = command.spawn().expect("starting zdisk serve");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).expect("reading the URI");
        if line.trim().is_empty() {
            let status = child.wait().unwrap();
            panic!("zdisk serve {} failed to start ({status}); its stderr is above", store.display());
        }
        Server { child: Some(child), uri: line.trim().to_string(), socket, pid_file }
    }

    /// The process serving NBD: `zdisk serve` itself (native front end) or its nbdkit.
    pub fn server_pid(&self) -> u32 {
        // `zdisk serve` prints the URI only once the file is written; waiting costs
        // nothing and keeps every pid-file read in one place.
        wait_for_pid_file(&self.pid_file, "the server (zdisk serve)", Duration::from_secs(30))
    }

    /// Clean stop (SIGTERM); asserts `zdisk serve` exited 0.
    pub fn stop(self) {
        self.stop_with(libc::SIGTERM);
    }

    /// Clean stop with `sig` (SIGINT or SIGTERM); asserts `zdisk serve` exited 0.
    pub fn stop_with(mut self, sig: i32) {
        let mut child = self.child.take().unwrap();
        signal(child.id(), sig);
        let status = wait_timeout(&mut child, Duration::from_secs(120));
        assert!(status.success(), "zdisk serve did not stop cleanly: {status}");
    }

    /// Signals the whole process group of a server started with `start_as_job` (nbdkit
    /// included), as a terminal's Ctrl-C does; returns how `zdisk serve` exited and its stderr.
    pub fn stop_group_with(mut self, sig: i32) -> (std::process::ExitStatus, String) {
        let mut child = self.child.take().unwrap();
        // SAFETY: signalling a process group this test started; no memory is involved.
        unsafe {
            libc::kill(-(child.id() as libc::pid_t), sig);
        }
        let status = wait_timeout(&mut child, Duration::from_secs(60));
        let mut stderr = String::new();
        if let Some(mut pipe) = child.stderr.take() {
            use std::io::Read;
            pipe.read_to_string(&mut stderr).unwrap();
        }
        (status, stderr)
    }

    /// SIGKILL the serving process (a crash: no flush, no checkpoint), then reap `zdisk serve`.
    pub fn crash(mut self) {
        let server = self.server_pid();
        signal(server, libc::SIGKILL);
        let mut child = self.child.take().unwrap();
        let status = wait_timeout(&mut child, Duration::from_secs(60));
        assert!(!status.success(), "zdisk serve should report the server's crash");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), libc::SIGTERM);
            let _ = wait_timeout(&mut child, Duration::from_secs(60));
        }
    }
}

pub fn signal(pid: u32, signal: i32) {
    // SAFETY: signalling a process this test started; no memory is involved.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

pub fn wait_timeout(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            return child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A small real file tree to copy: part of the Python standard library, else /usr/share/doc.
pub fn real_tree() -> PathBuf {
    let mut candidates: Vec<PathBuf> = std::fs::read_dir("/usr/lib")
        .map(|it| it.filter_map(|e| e.ok()).map(|e| e.path().join("email")).filter(|p| p.is_dir()).collect())
        .unwrap_or_default();
    candidates.sort();
    candidates.pop().unwrap_or_else(|| PathBuf::from("/usr/share/doc"))
}

/// A tar archive of `tree` in `dir`, at least `min_bytes` long (the tree repeated under
/// numbered names when it is small), so copies exercise many requests.
pub fn tar_of(tree: &Path, dest: &Path) -> u64 {
    let parent = tree.parent().unwrap();
    let name = tree.file_name().unwrap();
    let status = Command::new("tar").arg("-cf").arg(dest).arg("-C").arg(parent).arg(name).status().unwrap();
    assert!(matches!(status.code(), Some(0) | Some(1)), "tar failed: {status}");
    std::fs::metadata(dest).unwrap().len()
}

/// fio with the nbd engine against `uri`; returns fio's JSON output.
pub fn fio(uri: &str, args: &[String]) -> serde_json::Value {
    let mut command = Command::new("fio");
    // fio leaves verify-state files in its working directory unless told not to.
    command.current_dir(std::env::temp_dir()).arg("--verify_state_save=0");
    command.arg("--ioengine=nbd").arg(format!("--uri={uri}")).arg("--output-format=json").args(args);
    let out = run_ok(&mut command);
    // fio may print a line ("fio: connected to NBD server") before the JSON.
    let start = out.find('{').expect("fio printed JSON");
    serde_json::from_str(&out[start..]).expect("fio JSON")
}

/// Debian's python3 with libnbd's bindings (python3-libnbd): a python3 earlier in PATH
/// (pyenv) would not see them.
pub const LIBNBD_PYTHON: &str = "/usr/bin/python3";

/// Whether that python3 imports libnbd's bindings (a missing package fails the test in CI).
pub fn require_libnbd_python() -> bool {
    let import = std::process::Command::new(LIBNBD_PYTHON).args(["-c", "import nbd"]).status();
    import.is_ok_and(|s| s.success()) || require(&["python3-libnbd"])
}
