//! Smoke tests of `zdisk db` with real databases: MariaDB + sysbench and PostgreSQL + pgbench
//! on zdisk attached as a block device (nbdfuse + loop + ext4).
//!
//! - `zdisk db bench mysql --smoke`: zdisk (doublewrite off) and raw (doublewrite on), one short
//!   point; the report must be complete and every number positive. No speed is compared.
//! - `zdisk db powercut mysql|postgres --smoke`: 2 power cuts each (SIGKILL of zdisk's nbdkit and
//!   the database together under load; MariaDB with doublewrite off, PostgreSQL with
//!   full_page_writes on, as advised); every cycle must pass (innochecksum / pg_checksums on
//!   every page, CHECK TABLE / pg_amcheck, the load's invariants, zdisk check). The seed is
//!   printed; replay a failure with the printed command (or ZDISK_CRASH_SEED=<seed>).
//!
//! Needs root, /dev/fuse, loop devices, mariadb-server, sysbench, postgresql, nbdkit, libnbd-bin,
//! qemu-utils: missing tools skip locally and fail under CI=true (see tests/common).

mod common;

use std::time::{Duration, Instant};

use common::{require, require_block_devices, Scratch};
use serde_json::Value;

const MYSQL_TOOLS: &[&str] =
    &["mariadbd", "mariadb-install-db", "mariadb", "innochecksum", "sysbench", "nbdkit", "nbdfuse", "qemu-nbd"];
const PG_TOOLS: &[&str] = &["pgbench", "psql", "pg_isready", "nbdkit", "nbdfuse", "runuser"];

fn pg_server_installed() -> bool {
    let found = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().any(|e| e.path().join("bin/postgres").is_file()))
        .unwrap_or(false);
    if !found && common::in_ci() {
        panic!("PostgreSQL server (postgresql) missing in CI: .ci/run must install it");
    }
    found
}

fn seed() -> Option<String> {
    std::env::var("ZDISK_CRASH_SEED").ok()
}

#[test]
fn db_bench_smoke_writes_a_complete_report() {
    if !require(MYSQL_TOOLS) || !require_block_devices() {
        return;
    }
    let s = Scratch::new("db-bench");
    let out = s.path("report");
    let started = Instant::now();
    // Where the kernel has the blkio throttle, the smoke runs under `--disk-mbps`, capped
    // well above what its tiny points need: the cap's path is exercised without slowing it.
    let capped = std::path::Path::new("/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device").exists();
    if !capped {
        eprintln!("no cgroup v1 blkio throttle here: the smoke runs without --disk-mbps");
    }
    let cap_args: &[&str] = if capped { &["--disk-mbps", "200"] } else { &[] };
    let output = s
        .zdisk()
        .args(["db", "bench", "mysql", "--smoke"])
        .args(cap_args)
        .arg("--dir")
        .arg(s.dir.path())
        .arg("--out")
        .arg(&out)
        .output()
        .expect("running zdisk db bench");
    common::assert_success(&output, "zdisk db bench mysql --smoke");
    eprintln!("db bench smoke: {:.1} s", started.elapsed().as_secs_f64());
    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["schema"], "zdisk-db-bench/1");
    assert!(report["errors"].as_array().unwrap().is_empty(), "{}", report["errors"]);
    let points = report["points"].as_array().unwrap();
    let configs: Vec<&str> = points.iter().map(|p| p["config"].as_str().unwrap()).collect();
    assert_eq!(configs, ["zdisk-nodw", "raw-dw"], "one point per target");
    for p in points {
        assert!(p["load"]["tps"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["load"]["transactions"].as_u64().unwrap() > 0, "{p}");
        assert!(p["load"]["p95_ms"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["cpu"]["db_ms_per_txn"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["cpu"]["server_ms_per_txn"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["device"]["write_bytes"].as_u64().unwrap() > 0, "{p}");
    }
    // The capacity story: zdisk's numbers and the raw image's allocation, loaded and at the end.
    let cap = report["capacity"].as_array().unwrap();
    assert_eq!(cap.len(), 4, "{cap:?}");
    for c in cap {
        assert!(c["db_files_bytes"].as_u64().unwrap() > 0 && c["backing_used_bytes"].as_u64().unwrap() > 0, "{c}");
        if c["stack"] == "zdisk" {
            assert!(c["zdisk"]["comp_ratio"].as_f64().unwrap() > 1.0, "{c}");
            assert!(c["zdisk_data_comp_ratio"].as_f64().unwrap() > 1.0, "{c}");
        }
    }
    assert!(report["codec_ratios"][0]["data_comp_ratio"].as_f64().unwrap() > 1.0);
    assert!(report["offline"]["zstd1"].as_f64().unwrap() > 1.0);
    if capped {
        assert_eq!(report["settings"]["disk_mbps"], 200);
        let notes = report["notes"].as_array().unwrap();
        let cap_note = notes.iter().filter_map(|n| n.as_str()).find(|n| n.contains("--disk-mbps"));
        let cap_note = cap_note.unwrap_or_else(|| panic!("no note of the disk cap in {}", report["notes"]));
        assert!(cap_note.contains("capped at 200 MB/s") && !cap_note.contains("wrote 0 MiB"), "{cap_note}");
    }
    assert!(report["loop_dio"].as_array().unwrap().iter().all(|x| x[1] == true), "{}", report["loop_dio"]);
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    for text in [&md, &html] {
        assert!(
            text.contains("read_write") && text.contains("zdisk, doublewrite off"),
            "report names the workload and target"
        );
    }
    assert!(html.matches("<svg").count() >= 3, "TPS, p95 and CPU charts");
    // Nothing left attached: no loop device backed by this scratch directory.
    let loops = std::process::Command::new("losetup").arg("-l").output().unwrap();
    assert!(!String::from_utf8_lossy(&loops.stdout).contains(&*s.dir.path().to_string_lossy()), "loop device left");
}

fn powercut(db: &str) {
    let s = Scratch::new(&format!("db-powercut-{db}"));
    let out = s.path("powercut.json");
    let mut c = s.zdisk();
    c.args(["db", "powercut", db, "--smoke"]).arg("--dir").arg(s.dir.path()).arg("--out").arg(&out);
    if let Some(seed) = seed() {
        c.args(["--seed", &seed]);
    }
    let started = Instant::now();
    let output = c.output().expect("running zdisk db powercut");
    eprintln!("{}", String::from_utf8_lossy(&output.stdout));
    common::assert_success(&output, &format!("zdisk db powercut {db} --smoke"));
    eprintln!("powercut {db} smoke: {:.1} s", started.elapsed().as_secs_f64());
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let cycles = r["cycles"].as_array().unwrap();
    assert_eq!(cycles.len(), 2);
    // MariaDB runs without doublewrite (the claim under test); PostgreSQL with
    // full_page_writes, the configuration docs/guarantees.md advises.
    assert_eq!(r["torn_page_guard"], db == "postgres", "{r}");
    for cy in cycles {
        assert_eq!(cy["passed"], true, "{cy}");
        assert_eq!(cy["bad_pages_before_recovery"], 0, "{cy}");
        assert_eq!(cy["bad_pages_after_recovery"], 0, "{cy}");
        // The cut happened under load, not before it started.
        assert!(cy["load_seconds_reported"].as_u64().unwrap() >= 1, "{cy}");
    }
    if db == "mysql" {
        assert!(r["checker_self_test"].as_str().unwrap().contains("torn page"), "the page check must be able to fail");
    }
}

#[test]
fn db_powercut_mysql_smoke_has_no_torn_pages() {
    if !require(MYSQL_TOOLS) || !require_block_devices() {
        return;
    }
    powercut("mysql");
}

#[test]
fn db_powercut_postgres_smoke_has_no_torn_pages() {
    if !require(PG_TOOLS) || !pg_server_installed() || !require_block_devices() {
        return;
    }
    powercut("postgres");
}

/// A daemonised nbdkit of this test, stopped (SIGTERM) when dropped, also when the test panics.
struct NbdkitDaemon(u32);

impl Drop for NbdkitDaemon {
    fn drop(&mut self) {
        common::signal(self.0, libc::SIGTERM);
    }
}

/// Whether a page written with O_DIRECT reaches the NBD server as one request through the
/// attach path used here (nbdfuse + loop). nbdkit's log filter records every request the
/// transport sends; each 4–256 KiB O_DIRECT write to the loop device must arrive as exactly one
/// write request of that offset and length — with the loop device in direct-I/O mode (as
/// `zdisk attach` sets it) and in buffered mode. (A request larger than the transport's limit is
/// split: 1 MiB arrives as two here; pages are never that large.)
#[test]
fn nbdfuse_loop_delivers_direct_page_writes_as_one_request() {
    if !require(&["nbdkit", "nbdfuse", "losetup", "fusermount3", "dd"]) || !require_block_devices() {
        return;
    }
    let s = Scratch::new("db-split");
    let sock = s.path("mem.sock");
    let log = s.path("requests.log");
    let pid_file = s.path("nbdkit.pid");
    common::run_ok(
        std::process::Command::new("nbdkit")
            .arg("-U")
            .arg(&sock)
            .arg("-P")
            .arg(&pid_file)
            .args(["--filter=log", "memory", "256M"])
            .arg(format!("logfile={}", log.display())),
    );
    // nbdkit daemonises: its pid file appears after run_ok has returned.
    let nbdkit = NbdkitDaemon(common::wait_for_pid_file(&pid_file, "nbdkit (memory)", Duration::from_secs(30)));
    let fuse = s.path("fuse");
    std::fs::create_dir_all(&fuse).unwrap();
    let fuse_pid = s.path("fuse.pid");
    // As many connections as `zdisk attach` opens: a request goes whole to one of them.
    let mut nbdfuse = std::process::Command::new("nbdfuse")
        .arg("-C")
        .arg(zdisk_apps::parallel_requests().to_string())
        .arg("-P")
        .arg(&fuse_pid)
        .arg(fuse.join("nbd"))
        .arg(format!("nbd+unix:///?socket={}", sock.display()))
        .spawn()
        .unwrap();
    common::wait_for_pid_file(&fuse_pid, "nbdfuse (did not mount)", Duration::from_secs(30));
    let mut failures = Vec::new();
    for dio in ["on", "off"] {
        let dev = common::run_ok(
            std::process::Command::new("losetup")
                .arg(format!("--direct-io={dio}"))
                .args(["-f", "--show"])
                .arg(fuse.join("nbd")),
        );
        let dev = dev.trim().to_string();
        for (k, kib) in [4u64, 8, 16, 32, 64, 256].into_iter().enumerate() {
            std::fs::write(&log, b"").unwrap();
            let seek = 3 + 7 * k as u64; // in units of the write size: aligned, distinct offsets
            common::run_ok(
                std::process::Command::new("dd")
                    .arg("if=/dev/urandom")
                    .arg(format!("of={dev}"))
                    .arg(format!("bs={kib}K"))
                    .args(["count=1", "oflag=direct", "iflag=fullblock", "status=none"])
                    .arg(format!("seek={seek}")),
            );
            let want = (seek * kib * 1024, kib * 1024);
            // The log filter appends after the request completes: poll until the write shows.
            let parse = |text: &str| -> Vec<(u64, u64)> {
                text.lines()
                    .filter(|l| l.contains(" Write ") && l.contains("offset=") && l.contains("count="))
                    .filter_map(|l| {
                        let hex = |key: &str| {
                            let v = l.split(key).nth(1)?.split_whitespace().next()?;
                            u64::from_str_radix(v.trim_start_matches("0x"), 16).ok()
                        };
                        Some((hex("offset=")?, hex("count=")?))
                    })
                    .collect()
            };
            let t0 = Instant::now();
            let mut writes = Vec::new();
            while t0.elapsed().as_secs() < 10 {
                writes = parse(&String::from_utf8_lossy(&std::fs::read(&log).unwrap()));
                if writes.iter().map(|w| w.1).sum::<u64>() >= want.1 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            if writes != vec![want] {
                failures.push(format!(
                    "loop direct-io={dio}, {kib} KiB O_DIRECT write: NBD writes {writes:?}, wanted [{want:?}]"
                ));
            }
        }
        common::run_ok(std::process::Command::new("losetup").arg("-d").arg(&dev));
    }
    common::run_ok(std::process::Command::new("fusermount3").arg("-u").arg(&fuse));
    let _ = nbdfuse.wait();
    drop(nbdkit);
    assert!(failures.is_empty(), "pages split by the transport:\n{}", failures.join("\n"));
}
