//! The `zdisk` command line without a server: help, wrong use, format/stat/check/resize
//! offline. Wrong use must exit non-zero with a message that says what is wrong.

mod common;

use common::{fails, refused, Scratch};
use rand::SeedableRng;

#[test]
fn help_explains_every_command() {
    let s = Scratch::new("help");
    let top = s.zdisk_ok(&["--help"]);
    for command in ["format", "serve", "stat", "check", "resize", "attach", "detach", "demo", "bench", "tco"] {
        assert!(top.contains(command), "--help does not mention {command}:\n{top}");
        let help = s.zdisk_ok(&[command, "--help"]);
        assert!(help.contains("Usage: zdisk"), "{command} --help:\n{help}");
    }
    let format = s.zdisk_ok(&["format", "--help"]);
    assert!(format.contains("--logical-size") && format.contains("Nx") && format.contains("zstd"));
}

#[test]
fn format_refuses_an_unknown_codec() {
    let s = Scratch::new("codec");
    let store = s.path("s.zdisk");
    let (code, stderr) = fails(
        &s,
        &["format", store.to_str().unwrap(), "--physical-size", "64M", "--logical-size", "2x", "--codec", "brotli"],
    );
    assert_eq!(code, 2);
    assert!(stderr.contains("unknown codec"), "{stderr}");
    let (_, stderr) = fails(
        &s,
        &["format", store.to_str().unwrap(), "--physical-size", "64M", "--logical-size", "2x", "--codec", "zstd:99"],
    );
    assert!(stderr.contains("zstd level"), "{stderr}");
    assert!(!store.exists(), "a refused format must not create the store");
}

#[test]
fn format_refuses_bad_sizes() {
    let s = Scratch::new("sizes");
    let store = s.path("s.zdisk");
    let path = store.to_str().unwrap();
    refused(&s, &["format", path, "--physical-size", "64Q", "--logical-size", "2x"], 2, "bad size");
    refused(&s, &["format", path, "--physical-size", "64M", "--logical-size", "zx"], 2, "multiplier");
    refused(&s, &["format", path, "--logical-size", "2x"], 1, "--physical-size");
    // Sizes the engine refuses are wrong usage too: exit 2 (issue 47: they exited 1).
    // Not a multiple of 4 KiB: the engine refuses, the CLI says so.
    refused(&s, &["format", path, "--physical-size", "64M", "--logical-size", "4097"], 2, "multiple of 4096");
    // Above what a 48-bit LBA names (the message said "up to 64 TiB", the limit before the
    // paged map).
    let too_large = ["format", path, "--physical-size", "64M", "--logical-size", "2305843009213693952"];
    refused(&s, &too_large, 2, "up to 1 EiB");
    // The message names the size given (it said "physical size 0": the size rounded down to
    // whole sectors).
    refused(&s, &["format", path, "--physical-size", "1K"], 2, "physical size 1024 is too small");
    refused(&s, &["format", path, "--physical-size", "0"], 2, "physical size 0 is too small");
    // A segment size format refuses: said so (it overflowed computing what 1x resolves to).
    refused(&s, &["format", path, "--physical-size", "64M", "--segment-size", "3K"], 2, "segment size 3072");
    // A negative size is a size error (it was "unexpected argument '-5'"); a size no file can
    // have is named (it was "File too large (os error 27)").
    refused(&s, &["format", path, "--physical-size", "-5G"], 2, "a size is not negative");
    refused(&s, &["format", path, "--physical-size", "100P"], 2, "allows for one file");
    refused(&s, &["format", path, "--physical-size", "64M", "--key-file", path], 2, "need --encrypt");
    // A directory is named as one (it was "open: Is a directory (os error 21)").
    let dir = s.path("");
    refused(&s, &["format", dir.to_str().unwrap(), "--physical-size", "64M"], 2, "is a directory");
    // The engine created the file before it refused: it must not be left behind (a 64 MiB
    // leftover, or one that made the next format of the path refuse it as someone's data).
    assert!(!store.exists(), "a refused format left {} behind", store.display());
    s.format("s.zdisk", "32M", "2x", &[]);
}

/// A file shorter than a sector that holds data is refused like any other (it made format
/// panic: the first-sector check read a whole sector, past the file's end) and left as it was.
#[test]
fn format_refuses_a_short_file_holding_data() {
    let s = Scratch::new("short");
    let short = s.path("notes.txt");
    std::fs::write(&short, b"hello").unwrap();
    let path = short.to_str().unwrap();
    let (code, stderr) = fails(&s, &["format", path, "--physical-size", "32M"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("holds data; use --force"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(std::fs::read(&short).unwrap(), b"hello");
    // Zeros are not data, and --force overwrites data.
    let zeros = s.path("zeros.img");
    std::fs::write(&zeros, [0u8; 1000]).unwrap();
    s.zdisk_ok(&["format", zeros.to_str().unwrap(), "--physical-size", "32M"]);
    s.zdisk_ok(&["format", path, "--physical-size", "32M", "--force"]);
    assert_eq!(s.stat_json(&short)["backing_size_bytes"].as_u64(), Some(32 << 20));
}

#[test]
fn commands_refuse_a_missing_store() {
    let s = Scratch::new("missing");
    let missing = s.path("nope.zdisk");
    for command in ["stat", "check"] {
        let (code, stderr) = fails(&s, &[command, missing.to_str().unwrap()]);
        assert_eq!(code, 1, "{command}");
        assert!(stderr.contains("nope.zdisk"), "{command}: {stderr}");
        // Said once (the engine's error printed its I/O error, and again as its source).
        assert_eq!(stderr.matches("No such file or directory").count(), 1, "{command}: {stderr}");
    }
    let (code, _) = fails(&s, &["serve", missing.to_str().unwrap(), "--unix", s.path("x.sock").to_str().unwrap()]);
    assert_eq!(code, 1);
    let (code, _) = fails(&s, &["resize", missing.to_str().unwrap(), "--logical-size", "1G"]);
    assert_eq!(code, 1);
}

#[test]
fn commands_refuse_a_foreign_file() {
    let s = Scratch::new("foreign");
    let foreign = s.path("foreign.img");
    std::fs::write(&foreign, vec![0x5a; 4 << 20]).unwrap();
    let path = foreign.to_str().unwrap();
    for args in [vec!["stat", path], vec!["check", path], vec!["resize", path, "--logical-size", "1G"]] {
        let (code, stderr) = fails(&s, &args);
        assert_eq!(code, 1, "{args:?}");
        assert!(stderr.contains("not a zdisk store"), "{args:?}: {stderr}");
    }
    let (code, stderr) = fails(&s, &["serve", path, "--unix", s.path("x.sock").to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(stderr.contains("not a zdisk store"), "{stderr}");
    // Formatting over other data needs --force; the data is untouched without it.
    let (code, _) = fails(&s, &["format", path, "--physical-size", "4M", "--logical-size", "2x"]);
    assert_eq!(code, 1);
    assert_eq!(std::fs::read(&foreign).unwrap(), vec![0x5a; 4 << 20]);
}

/// Key slots exist only in an encrypted store: changing them in a plain one is refused as
/// such before any passphrase is asked for (it said "the store is encrypted: give
/// --key-file FILE or --passphrase-stdin"), and a file that is no store is named.
#[test]
fn key_commands_refuse_a_plain_store_before_asking_for_a_key() {
    let s = Scratch::new("keys-plain");
    let store = s.format("plain.zdisk", "32M", "1x", &[]);
    let path = store.to_str().unwrap();
    for args in [
        vec!["key", "list", path],
        vec!["key", "add", path],
        vec!["key", "change", path],
        vec!["key", "remove", path, "--slot", "0"],
    ] {
        let (code, stderr) = fails(&s, &args);
        assert_eq!(code, 1, "{args:?}");
        assert!(stderr.contains("plain.zdisk is not encrypted"), "{args:?}: {stderr}");
    }
    let foreign = s.path("foreign.img");
    std::fs::write(&foreign, vec![0x5a; 1 << 20]).unwrap();
    let (_, stderr) = fails(&s, &["key", "add", foreign.to_str().unwrap()]);
    assert!(stderr.contains("foreign.img") && stderr.contains("not a zdisk store"), "{stderr}");
}

/// A zdisk store too small to format is refused before the bench starts (every step failed
/// on it, and the report listed 31 failures).
#[test]
fn bench_refuses_a_zdisk_store_too_small_to_format() {
    let s = Scratch::new("bench-size");
    let out = s.path("report");
    let (code, stderr) = fails(
        &s,
        &["bench", "--smoke", "--targets", "zdisk", "--zdisk-physical-size", "1K", "--out", out.to_str().unwrap()],
    );
    assert_eq!(code, 1);
    assert!(stderr.contains("--zdisk-physical-size must be at least 16 MiB"), "{stderr}");
    assert!(!out.exists(), "a refused bench wrote a report");
}

/// Scratch directories that cannot be created are named (it said only "No such file or
/// directory").
#[test]
fn scratch_directories_that_cannot_be_created_are_named() {
    let s = Scratch::new("dirs");
    for args in [
        vec!["db", "bench", "mysql", "--quick", "--dir", "/proc/zdisk-no-such-dir"],
        vec!["db", "powercut", "mysql", "--dir", "/proc/zdisk-no-such-dir"],
        vec!["demo", "--dir", "/proc/zdisk-no-such-dir"],
    ] {
        let (code, stderr) = fails(&s, &args);
        assert_eq!(code, 1, "{args:?}");
        assert!(stderr.contains("/proc/zdisk-no-such-dir"), "{args:?}: {stderr}");
    }
}

/// A codec `zdisk format` would refuse is refused with the arguments, before anything runs
/// (`--ratio-codecs none` ran the whole benchmark, then failed formatting its first ratio store).
#[test]
fn db_bench_refuses_unknown_codecs_up_front() {
    let s = Scratch::new("db-codecs");
    refused(&s, &["db", "bench", "mysql", "--quick", "--ratio-codecs", "lz4,none"], 2, "unknown codec \"none\"");
    refused(&s, &["db", "bench", "mysql", "--quick", "--zdisk-codec", "zstd:99"], 2, "--zdisk-codec");
}

#[test]
fn a_disk_bandwidth_cap_is_refused_where_it_cannot_apply() {
    let s = Scratch::new("disk-mbps");
    refused(&s, &["db", "bench", "mysql", "--disk-mbps", "0"], 2, "--disk-mbps");
    // loop-dw's I/O is issued by the kernel's loop workers, not by a server the cap could hold.
    let args = ["db", "bench", "mysql", "--quick", "--disk-mbps", "20", "--configs", "raw-dw,loop-dw"];
    refused(&s, &args, 1, "loop-dw has none");
}

#[test]
fn serve_needs_a_listen_address() {
    let s = Scratch::new("listen");
    let store = s.format("s.zdisk", "32M", "2x", &[]);
    let (code, stderr) = fails(&s, &["serve", store.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(stderr.contains("--unix") && stderr.contains("--tcp"), "{stderr}");
    // A thread count nbdkit cannot use is refused up front (100000 made nbdkit fail to
    // create its threads after it had started serving).
    let socket = s.path("x.sock");
    for threads in ["0", "100000"] {
        let (code, stderr) =
            fails(&s, &["serve", store.to_str().unwrap(), "--unix", socket.to_str().unwrap(), "-t", threads]);
        assert_eq!(code, 2, "-t {threads}");
        assert!(stderr.contains("1..=1024"), "-t {threads}: {stderr}");
    }
    // Event loops are the native front end's; nbdkit has threads.
    let (store, socket) = (store.to_str().unwrap(), socket.to_str().unwrap());
    refused(&s, &["serve", store, "--unix", socket, "--loops", "0"], 2, "1..=256");
    let nbdkit = ["serve", store, "--unix", socket, "--frontend", "nbdkit", "--loops", "2"];
    refused(&s, &nbdkit, 2, "--loops is an option of the native front end");
}

/// `--codec-cores` of `serve` and `attach` takes 1 up to the cores the process may run on:
/// anything else is wrong usage, refused before a server starts.
#[test]
fn codec_cores_outside_one_to_the_available_cores_are_refused() {
    let s = Scratch::new("codec-cores");
    let store = s.format("s.zdisk", "32M", "2x", &[]);
    let (store, socket) = (store.to_str().unwrap(), s.path("x.sock"));
    let too_many = (std::thread::available_parallelism().map_or(1, |n| n.get()) + 1).to_string();
    for cores in ["0", too_many.as_str(), "1000000"] {
        let serve = ["serve", store, "--unix", socket.to_str().unwrap(), "--codec-cores", cores];
        refused(&s, &serve, 2, "codec cores must be 1..=");
        refused(&s, &["attach", store, "--codec-cores", cores], 2, "codec cores must be 1..=");
    }
    refused(&s, &["serve", store, "--unix", socket.to_str().unwrap(), "--codec-cores", "two"], 2, "not a number");
    assert!(!socket.exists(), "a refused serve must not listen");
}

#[test]
fn format_refuses_an_existing_store_without_force() {
    let s = Scratch::new("reformat");
    let store = s.format("s.zdisk", "32M", "2x", &[]);
    let (code, _) = fails(&s, &["format", store.to_str().unwrap(), "--physical-size", "32M", "--logical-size", "2x"]);
    assert_eq!(code, 1);
    s.format("s.zdisk", "32M", "3x", &["--force", "--codec", "zstd:3"]);
    let stat = s.stat_json(&store);
    assert_eq!(stat["provisioned_cap"], 3 * stat["native_capacity"].as_u64().unwrap());
}

/// `--preallocate` leaves every block of the store file allocated (written zeros), and says
/// so on stderr as it goes; a plain format reserves the file's blocks (fallocate) without
/// writing them; `--sparse` leaves the file sparse. All three are equally empty stores.
#[test]
fn format_preallocate_allocates_the_whole_file() {
    use std::os::unix::fs::MetadataExt;
    let s = Scratch::new("prealloc");
    let sparse = s.format("sparse.zdisk", "64M", "1x", &["--sparse"]);
    let reserved = s.format("reserved.zdisk", "64M", "1x", &[]);
    let store = s.path("full.zdisk");
    let output = s
        .zdisk()
        .args(["format", store.to_str().unwrap(), "--physical-size", "64M", "--preallocate"])
        .output()
        .expect("running zdisk");
    common::assert_success(&output, "zdisk format --preallocate");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("writing zeros over") && stderr.contains("100%"), "{stderr}");
    let allocated = |path: &std::path::Path| std::fs::metadata(path).unwrap().blocks() * 512;
    assert!(allocated(&store) >= 63 << 20, "preallocated store holds {} bytes", allocated(&store));
    assert!(allocated(&reserved) >= 63 << 20, "a plain format reserved only {} bytes", allocated(&reserved));
    assert!(allocated(&sparse) < 8 << 20, "a --sparse format allocated {} bytes", allocated(&sparse));
    let (full, empty) = (s.stat_json(&store), s.stat_json(&sparse));
    assert_eq!(full["physical_size"], empty["physical_size"], "a preallocated store is as empty as a new one");
    assert_eq!(full["free_space"], empty["free_space"]);
    assert_eq!(s.stat_json(&reserved)["free_space"], empty["free_space"]);
    s.zdisk_ok(&["check", reserved.to_str().unwrap()]);
    s.zdisk_ok(&["check", store.to_str().unwrap()]);
}

#[test]
fn stat_json_has_the_capacity_stat_keys_and_engine_names() {
    let s = Scratch::new("statjson");
    let store = s.format("s.zdisk", "32M", "4x", &["--codec", "deflate:6"]);
    let stat = s.stat_json(&store);
    for key in ["free_space", "physical_size", "logical_size", "provisioned_cap", "space_flag", "native_capacity"] {
        assert!(stat[key].is_u64(), "{key} should be a byte count: {stat}");
    }
    assert!(stat["comp_ratio"].is_number());
    for key in ["host_write_bytes", "backing_write_bytes", "write_amplification", "checksum_errors", "padding_bytes"] {
        assert!(stat.get(key).is_some(), "{key} missing: {stat}");
    }
    assert_eq!(stat["provisioned_cap"], 4 * stat["native_capacity"].as_u64().unwrap());
    assert_eq!(stat["over_provision_percent"], 10.0);
    assert_eq!(stat["source"], "offline");
    let human = s.zdisk_ok(&["stat", store.to_str().unwrap()]);
    assert!(human.contains("offline"));
    assert!(
        human.contains("free_space  physical_size  logical_size  comp_ratio  provisioned_cap  space_flag"),
        "{human}"
    );
}

#[test]
fn check_reports_a_fresh_store_clean() {
    let s = Scratch::new("check");
    let store = s.format("s.zdisk", "32M", "2x", &[]);
    let out = s.zdisk_ok(&["check", store.to_str().unwrap(), "--json"]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["clean"], true, "{report}");
    assert_eq!(report["problems"].as_array().unwrap().len(), 0);
}

#[test]
fn resize_grows_offline() {
    let s = Scratch::new("resize");
    let store = s.format("s.zdisk", "32M", "2x", &[]);
    let native = s.stat_json(&store)["native_capacity"].as_u64().unwrap();
    s.zdisk_ok(&["resize", store.to_str().unwrap(), "--logical-size", "10x"]);
    assert_eq!(s.stat_json(&store)["provisioned_cap"], 10 * native);
    s.zdisk_ok(&["resize", store.to_str().unwrap(), "--logical-size", "100M"]);
    assert_eq!(s.stat_json(&store)["provisioned_cap"], 100 << 20);
}

/// Native capacity is 1x, the default; the over-provisioning moves it, at format and by
/// resize; a setting out of range, or one whose native capacity the stored data would not
/// fit, is refused with the store unchanged.
#[test]
fn native_capacity_follows_the_over_provisioning() {
    let s = Scratch::new("native");
    let store = s.path("s.zdisk");
    let path = store.to_str().unwrap();
    let out = s.zdisk_ok(&["format", path, "--physical-size", "64M", "--over-provision", "7"]);
    assert!(out.contains("native capacity") && out.contains("1.00x native"), "{out}");
    let stat = s.stat_json(&store);
    let native_7 = stat["native_capacity"].as_u64().unwrap();
    assert_eq!(stat["provisioned_cap"], native_7);
    assert_eq!(stat["over_provision_percent"], 7.0);
    // Native capacity: below the physical size by the OP and reserves, not by much more.
    assert!(native_7 < (64 << 20) * 93 / 100 && native_7 > (64 << 20) * 80 / 100, "{native_7}");

    let out = s.zdisk_ok(&["resize", path, "--over-provision", "28"]);
    assert!(out.contains("7% -> 28%"), "{out}");
    assert!(out.contains("ENOSPC"), "provisioned above the new native capacity must be said: {out}");
    let stat = s.stat_json(&store);
    let native_28 = stat["native_capacity"].as_u64().unwrap();
    let expected = native_7 as f64 * 72.0 / 93.0;
    assert!((native_28 as f64 - expected).abs() < expected * 0.01, "{native_28} vs {expected}");
    assert_eq!(stat["provisioned_cap"], native_7, "resizing the OP leaves the logical size");
    s.zdisk_ok(&["resize", path, "--logical-size", "1x"]);
    assert_eq!(s.stat_json(&store)["provisioned_cap"], native_28);

    for bad in ["0.5", "80", "lots"] {
        let (code, stderr) = fails(&s, &["resize", path, "--over-provision", bad]);
        assert_eq!(code, 2, "{bad}: {stderr}");
        assert!(stderr.contains("over-provision"), "{stderr}");
    }
    let (code, stderr) =
        fails(&s, &["format", s.path("t.zdisk").to_str().unwrap(), "--physical-size", "64M", "--over-provision", "90"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("between 1% and 75%"), "{stderr}");
    let (code, stderr) = fails(&s, &["resize", path]);
    assert_eq!(code, 2, "resize needs --logical-size or --over-provision: {stderr}");

    // Fill most of the native capacity (incompressible), then ask for an OP that would
    // leave less.
    let mut random = vec![0u8; 40 << 20];
    rand::Rng::fill(&mut rand::rngs::StdRng::seed_from_u64(1), &mut random[..]);
    let store_open = zdisk_engine::Store::open(&store, &zdisk_engine::OpenOptions::default()).unwrap();
    store_open.write(0, &random, zdisk_engine::Durability::Fua).unwrap();
    store_open.close().unwrap();
    let (code, stderr) = fails(&s, &["resize", path, "--over-provision", "60"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("native capacity it would leave"), "{stderr}");
    assert_eq!(s.stat_json(&store)["over_provision_percent"], 28.0, "a refused change changes nothing");
}

#[test]
fn detach_refuses_a_device_it_did_not_attach() {
    let s = Scratch::new("detach");
    let (code, stderr) = fails(&s, &["detach", "/dev/loop99"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("not attached by zdisk"), "{stderr}");
}

/// What the engine reports outside a request's result reaches the operator: with the
/// newest checkpoint damaged, `zdisk stat` still works (from the previous one) and says so
/// on stderr. Offsets from docs/format.md: 16 KiB superblock slots, the generation at 32,
/// the first checkpoint chunk's address at 120.
#[test]
fn engine_warnings_reach_stderr() {
    let s = Scratch::new("warnings");
    let store = s.format("w.zdisk", "32M", "1x", &[]);
    let path = store.to_str().unwrap();
    // Two more checkpoints, so a previous one is there to fall back to.
    s.zdisk_ok(&["resize", path, "--logical-size", "2x"]);
    s.zdisk_ok(&["resize", path, "--logical-size", "3x"]);
    let mut image = std::fs::read(&store).unwrap();
    let u64_at = |image: &[u8], at: usize| u64::from_le_bytes(image[at..at + 8].try_into().unwrap());
    let slot = if u64_at(&image, 32) > u64_at(&image, (16 << 10) + 32) { 0 } else { 16 << 10 };
    let chunk = u64_at(&image, slot + 120) as usize;
    image[chunk + 3] ^= 2;
    std::fs::write(&store, &image).unwrap();
    let output = s.zdisk().args(["stat", path]).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "stat of a store with a damaged newest checkpoint failed: {stderr}");
    assert!(stderr.contains("newest checkpoint unreadable"), "no warning on stderr: {stderr}");
}

/// A server that dies before serving makes `zdisk attach` fail with its log, promptly. (It
/// used to wait forever: the dead server stayed a zombie whose pid looked alive.) The nbdkit
/// front end without its plugin is such a server.
#[test]
fn attach_fails_promptly_when_the_server_dies_before_serving() {
    let s = Scratch::new("attach-dies");
    let store = s.format("s.zdisk", "32M", "1x", &[]);
    let mut child = s
        .zdisk()
        .env("ZDISK_PLUGIN", s.path("no-such-plugin.so"))
        .args(["attach", store.to_str().unwrap(), "--", "--frontend", "nbdkit"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running zdisk attach");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for zdisk attach") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("zdisk attach still waiting 60 s after its server died");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "attach succeeded without a server: {stderr}");
    assert!(stderr.contains("exited") && stderr.contains("before serving"), "{stderr}");
    assert!(stderr.contains("no-such-plugin.so"), "the server's own error is shown: {stderr}");
}

/// Options after `--` go to the server attach starts: a bad one fails attach with the
/// server's own error, before any device is made.
#[test]
fn attach_passes_the_options_after_the_double_dash_to_its_server() {
    let s = Scratch::new("attach-options");
    let store = s.format("s.zdisk", "32M", "1x", &[]);
    let (code, stderr) = fails(&s, &["attach", store.to_str().unwrap(), "--", "--write-behind", "lots"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("before serving") && stderr.contains("--write-behind"), "{stderr}");
}

/// `zdisk size` is the workspace's size parser for scripts (scripts/ceph-demo.sh): the bytes on
/// stdout, or wrong use (exit 2) naming the input.
#[test]
fn size_prints_bytes_as_every_command_reads_them() {
    let s = Scratch::new("size");
    for (text, bytes) in [("4096", "4096"), ("1G", "1073741824"), ("128M", "134217728"), ("1.5GiB", "1610612736")] {
        assert_eq!(s.zdisk_ok(&["size", text]), format!("{bytes}\n"), "{text}");
    }
    refused(&s, &["size", "12Q"], 2, "\"12Q\"");
    refused(&s, &["size", "-1G"], 2, "not negative");
}

/// `zdisk ceph report` names what is missing in a directory that is not a Ceph run's.
#[test]
fn ceph_report_names_a_missing_run() {
    let s = Scratch::new("ceph-report");
    let dir = s.path("no-run");
    std::fs::create_dir_all(&dir).unwrap();
    refused(&s, &["ceph", "report", dir.to_str().unwrap()], 1, "meta.json");
}
