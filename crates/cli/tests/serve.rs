//! `zdisk serve`'s life cycle against real nbdkit: clean stops on SIGINT (to the server, and
//! to its whole process group as a terminal sends it), what it passes to nbdkit, the plugin's
//! parameters when nbdkit loads it directly, and `zdisk demo` end to end.
//!
//! Run: `cargo test -p zdisk --test serve` (builds the plugin too; see tests/common). Needs
//! nbdkit, libnbd-bin, fio and tar; missing tools skip locally and fail under CI=true.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use common::crash_model::pattern;
use common::nbd::NbdClient;
use common::{nbdinfo_json, require, Scratch, Server};

const BASIC_TOOLS: &[&str] = &["nbdkit"];

#[test]
fn serve_stops_cleanly_on_sigint_and_checkpoints() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("sigint");
    let store = s.format("s.zdisk", "64M", "2x", &[]);
    let server = Server::start(&s, &store, &[]);
    let mut c = NbdClient::connect(&server.socket).unwrap();
    c.write_ok(0, &pattern(5, 5, 0, 1 << 20));
    // No flush: the clean shutdown must make it durable.
    c.disconnect();
    let started = Instant::now();
    server.stop_with(libc::SIGINT);
    assert!(started.elapsed() < Duration::from_secs(30));
    let server = Server::start(&s, &store, &[]);
    let mut c = NbdClient::connect(&server.socket).unwrap();
    assert!(c.read_ok(0, 1 << 20) == pattern(5, 5, 0, 1 << 20));
    c.disconnect();
    server.stop();
}

/// A terminal's Ctrl-C signals the whole process group: nbdkit gets SIGINT as well and, with
/// no client connected, closes the store itself and exits before `zdisk serve`'s drain
/// reaches it. The stop is clean, says so, and does not claim a failure (it printed "drain
/// failed" on such a Ctrl-C); an acknowledged write the client never flushed survives. (With
/// a client still connected nbdkit waits for it: the drain then works, and after the grace
/// period nbdkit is killed without loss, as `serve --help` says.)
#[test]
fn serve_stops_cleanly_when_ctrl_c_reaches_its_whole_process_group() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("ctrl-c");
    let store = s.format("s.zdisk", "64M", "2x", &[]);
    let server = Server::start_as_job(&s, &store, &[]);
    assert!(server.uri.starts_with("nbd+unix://"), "zdisk serve printed {:?}", server.uri);
    let mut c = NbdClient::connect(&server.socket).unwrap();
    c.write_ok(0, &pattern(7, 7, 0, 1 << 20));
    c.disconnect();
    let (status, stderr) = server.stop_group_with(libc::SIGINT);
    assert!(status.success(), "zdisk serve exited {status}:\n{stderr}");
    assert!(stderr.contains("stopped cleanly"), "{stderr}");
    assert!(!stderr.contains("failed"), "a clean stop reported a failure:\n{stderr}");
    let server = Server::start(&s, &store, &[]);
    let mut c = NbdClient::connect(&server.socket).unwrap();
    assert!(c.read_ok(0, 1 << 20) == pattern(7, 7, 0, 1 << 20), "the unflushed write was lost");
    c.disconnect();
    server.stop();
}

/// The plugin loaded by nbdkit directly (no `zdisk serve`) refuses wrong parameters with a
/// message naming them, before it serves.
#[test]
fn the_plugin_refuses_bad_parameters_by_name() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("plugin-params");
    let store = s.format("s.zdisk", "32M", "1x", &[]);
    let foreign = s.path("foreign.img");
    std::fs::write(&foreign, vec![0x5a; 1 << 20]).unwrap();
    let store_param = format!("store={}", store.display());
    let foreign_param = format!("store={}", foreign.display());
    let cases: [(Vec<&str>, &str); 7] = [
        (vec![], "store=PATH is required"),
        (vec!["store="], "store= is empty"),
        (vec![&store_param, "bogus=1"], "unknown parameter \"bogus\""),
        (vec![&store_param, "low_space=7"], "low_space=7: must be in [0, 1)"),
        (vec![&store_param, "idle_after=-5"], "idle_after=-5"),
        (vec![&store_param, "cache=abc"], "could not parse size"),
        (vec![&foreign_param], "not a zdisk store"),
    ];
    for (params, expected) in cases {
        let output = Command::new("nbdkit")
            .args(["-f", "-U"])
            .arg(s.path("p.sock"))
            .arg(common::plugin())
            .args(&params)
            .args(["--run", "true"])
            .output()
            .expect("running nbdkit");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "nbdkit with {params:?} should fail:\n{stderr}");
        assert!(stderr.contains(expected), "nbdkit with {params:?}: expected {expected:?} in:\n{stderr}");
    }
}

#[test]
fn demo_runs_end_to_end() {
    if !require(&["nbdkit", "nbdcopy", "fio", "tar"]) {
        return;
    }
    let s = Scratch::new("demo");
    let tree = common::real_tree();
    let output = s
        .zdisk()
        .env("ZDISK_PLUGIN", common::plugin())
        .args(["demo", "--physical-size", "128M", "--logical-size", "2x", "--fio-size", "32M", "--tree"])
        .arg(&tree)
        .arg("--dir")
        .arg(s.path("demo"))
        .output()
        .unwrap();
    common::assert_success(&output, "zdisk demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("demo done"), "{stderr}");
    assert!(stdout.contains("source  live") && stdout.contains("source  offline"), "{stdout}");

    // Wrong use: a --fio-size the store cannot hold is cut to what fits (it ran into ENOSPC),
    // and a --tree that is not a directory is refused before anything starts.
    let small_tree = s.path("small-tree");
    std::fs::create_dir_all(&small_tree).unwrap();
    std::fs::write(small_tree.join("notes.txt"), "a small tree\n".repeat(1000)).unwrap();
    let output = s
        .zdisk()
        .env("ZDISK_PLUGIN", common::plugin())
        .args(["demo", "--physical-size", "64M", "--logical-size", "4x", "--fio-size", "10G", "--tree"])
        .arg(&small_tree)
        .output()
        .unwrap();
    common::assert_success(&output, "zdisk demo with a --fio-size larger than the store");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("does not fit the store") && stderr.contains("demo done"), "{stderr}");
    let output = s.zdisk().args(["demo", "--tree"]).arg(s.path("no-such-tree")).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("not a directory"), "{stderr}");
    assert!(!stderr.contains("==> formatting"), "the demo started before checking --tree:\n{stderr}");
}

/// `zdisk serve` gives nbdkit 4 threads per core (8 to 64) unless `--threads` says
/// otherwise, and passes `--discard-freed` to the plugin, which accepts it.
#[test]
fn serve_passes_threads_and_discard_freed_to_nbdkit() {
    if !require(&["nbdkit", "nbdinfo"]) {
        return;
    }
    let s = Scratch::new("threads");
    let store = s.format("s.zdisk", "64M", "1x", &[]);
    let argv = |server: &Server| -> Vec<String> {
        let raw = std::fs::read(format!("/proc/{}/cmdline", server.server_pid())).unwrap();
        raw.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect()
    };
    let threads_of = |argv: &[String]| argv.iter().position(|a| a == "-t").map(|i| argv[i + 1].clone());
    let cores = std::thread::available_parallelism().unwrap().get() as u32;
    let server = Server::start(&s, &store, &["--frontend", "nbdkit"]);
    let default = argv(&server);
    assert_eq!(threads_of(&default), Some((4 * cores).clamp(8, 64).to_string()), "{default:?}");
    assert!(!default.iter().any(|a| a.starts_with("discard_freed")), "{default:?}");
    server.stop();
    let server = Server::start(&s, &store, &["--frontend", "nbdkit", "--threads", "3", "--discard-freed"]);
    let asked = argv(&server);
    assert_eq!(threads_of(&asked), Some("3".to_string()), "{asked:?}");
    assert!(asked.iter().any(|a| a == "discard_freed=true"), "{asked:?}");
    // The plugin took the key (an unknown one would have stopped nbdkit before serving).
    assert!(nbdinfo_json(&server.uri)["export-size"].as_u64().is_some_and(|size| size > 0));
    server.stop();
}

/// The control socket answers as soon as `zdisk serve` prints its URI: a request sent at that
/// moment, and a `zdisk resize`, work (issue 48: for up to ~10 ms it was not bound yet, since
/// nbdkit writes its pid file before the plugin opens the store). Five starts in a row.
#[test]
fn the_control_socket_answers_when_serve_prints_its_uri() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("control-ready");
    let store = s.format("s.zdisk", "256M", "1x", &[]);
    let uuid = s.stat_json(&store)["uuid"].as_str().unwrap().to_string();
    let control = s.run_dir().join(format!("{uuid}.ctl"));
    for times in 2..7 {
        // A crash before each start: the open replays ~48 MiB of log, which takes long
        // enough that a server announcing itself early is caught.
        let server = Server::start(&s, &store, &[]);
        let mut c = NbdClient::connect(&server.socket).unwrap();
        for i in 0..12u64 {
            c.write_ok(i << 22, &pattern(times, i, 0, 4 << 20));
        }
        c.flush().unwrap();
        c.disconnect();
        server.crash();
        let server = Server::start(&s, &store, &[]);
        // At once, from this process (a new process would give the server its start-up time).
        let stream = std::os::unix::net::UnixStream::connect(&control)
            .unwrap_or_else(|e| panic!("start {times}: the control socket {} refused: {e}", control.display()));
        (&stream).write_all(b"stats\n").unwrap();
        let mut reply = String::new();
        BufReader::new(&stream).read_line(&mut reply).unwrap();
        assert!(reply.starts_with('{'), "start {times}: the control socket answered {reply:?}");
        let resized =
            s.zdisk().arg("resize").arg(&store).arg("--logical-size").arg(format!("{times}x")).output().unwrap();
        let said = format!("{}{}", String::from_utf8_lossy(&resized.stdout), String::from_utf8_lossy(&resized.stderr));
        assert!(resized.status.success() && said.contains("while served"), "resize after start {times}: {said}");
        server.stop();
    }
}

/// A user other than root serves a store with its run-time files under
/// `$XDG_RUNTIME_DIR/zdisk` (issue 47: it failed with "cannot start live stats in
/// /run/zdisk: Permission denied"), and reads its live statistics from there.
#[test]
fn a_user_other_than_root_serves_with_its_own_runtime_dir() {
    if !require(&["nbdkit", "setpriv"]) {
        return;
    }
    if !common::is_root() {
        assert!(!common::in_ci(), "CI runs as root: it can test another user");
        eprintln!("SKIP: needs root to run as another user");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let s = Scratch::new("nonroot");
    std::fs::set_permissions(s.path(""), std::fs::Permissions::from_mode(0o777)).unwrap();
    let store = s.format("s.zdisk", "64M", "1x", &[]);
    let xdg = s.path("xdg");
    std::fs::create_dir(&xdg).unwrap();
    for path in [&store, &xdg] {
        std::os::unix::fs::chown(path, Some(65534), Some(65534)).unwrap();
    }
    let as_nobody = |args: &[&str]| {
        let mut command = Command::new("setpriv");
        command
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(common::zdisk_bin())
            .args(args)
            .env_remove("ZDISK_RUN_DIR")
            .env("XDG_RUNTIME_DIR", &xdg)
            .env("ZDISK_PLUGIN", common::plugin());
        command
    };
    let socket = s.path("s.sock");
    let mut server = as_nobody(&["serve", store.to_str().unwrap(), "--unix", socket.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut uri = String::new();
    BufReader::new(server.stdout.take().unwrap()).read_line(&mut uri).unwrap();
    assert!(uri.starts_with("nbd+unix://"), "serve as nobody printed {uri:?}");
    let files: Vec<String> =
        std::fs::read_dir(xdg.join("zdisk")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert!(files.iter().any(|f| f.ends_with(".ctl")), "no control socket in $XDG_RUNTIME_DIR/zdisk: {files:?}");
    let stat = as_nobody(&["stat", store.to_str().unwrap()]).output().unwrap();
    let said = String::from_utf8_lossy(&stat.stdout);
    assert!(stat.status.success() && said.contains("source  live"), "{said}{}", String::from_utf8_lossy(&stat.stderr));
    common::signal(server.id(), libc::SIGTERM);
    let status = common::wait_timeout(&mut server, Duration::from_secs(60));
    assert!(status.success(), "serve as nobody did not stop cleanly: {status}");
}

/// A client that connects and never finishes its handshake does not hold the stop: the
/// native server closes it with the rest, closes the store and exits 0 at once (before, its
/// handshake thread kept the store for its 30 s timeout and the stop failed with "the store
/// is still in use").
#[test]
fn a_client_stuck_in_its_handshake_does_not_hold_the_stop() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("stuck-handshake");
    let store = s.format("s.zdisk", "64M", "1x", &[]);
    let server = Server::start(&s, &store, &[]);
    let mut stuck = std::os::unix::net::UnixStream::connect(&server.socket).unwrap();
    let mut greeting = [0u8; 18];
    std::io::Read::read_exact(&mut stuck, &mut greeting).unwrap();
    let started = std::time::Instant::now();
    server.stop();
    assert!(started.elapsed() < Duration::from_secs(10), "the stop took {:?}", started.elapsed());
    drop(stuck);
    let check = s.zdisk_ok(&["check", store.to_str().unwrap()]);
    assert!(check.contains("clean"), "{check}");
}

/// `--codec-fallback MODE` reaches the store through either front end (the native server
/// sets the option, nbdkit gets `codec_fallback=MODE`): in a zstd:1 store, `always` writes
/// every host block LZ4, `never` none, `uncompressed` every one uncompressed for now — read
/// from the live counters of the serving process. A mode the engine does not know is wrong
/// usage, refused before anything serves.
#[test]
fn the_codec_fallback_mode_reaches_the_store_through_both_front_ends() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("codec-fallback");
    let store = s.format("s.zdisk", "64M", "2x", &["--codec", "zstd:1"]);
    const BLOCKS: u64 = 256;
    for frontend in ["native", "nbdkit"] {
        for (mode, fallback, uncompressed) in [("always", BLOCKS, 0), ("never", 0, 0), ("uncompressed", BLOCKS, BLOCKS)]
        {
            // No idle work: it would recompress what the mode wrote before the stat reads it.
            let args = ["--frontend", frontend, "--codec-fallback", mode, "--idle-after", "0"];
            let server = Server::start(&s, &store, &args);
            let mut c = NbdClient::connect(&server.socket).unwrap();
            c.write_ok(0, &pattern(9, 1, 0, (BLOCKS * 4096) as usize));
            assert_eq!(c.flush().unwrap(), 0, "flush");
            let stat = s.stat_json(&store);
            let what = format!("{frontend}, --codec-fallback {mode}: {stat}");
            assert_eq!(stat["codec_fallback_blocks"], fallback, "{what}");
            assert_eq!(stat["uncompressed_tier_blocks"], uncompressed, "{what}");
            assert!(c.read_ok(0, (BLOCKS * 4096) as usize) == pattern(9, 1, 0, (BLOCKS * 4096) as usize), "{what}");
            c.disconnect();
            server.stop();
        }
    }
    let socket = s.path("x.sock");
    let serve = ["serve", store.to_str().unwrap(), "--unix", socket.to_str().unwrap(), "--codec-fallback", "sometimes"];
    common::refused(&s, &serve, 2, "unknown codec fallback \"sometimes\"");
    assert!(!socket.exists(), "a refused serve must not listen");
}
