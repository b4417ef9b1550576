//! Ceph on zdisk, end to end with real parts: `scripts/ceph-demo.sh smoke` stands up one
//! ceph-mon, one ceph-mgr and three BlueStore OSDs, each on its own zdisk store attached as
//! a block device (`zdisk attach`: nbdfuse + loop here), a pool of size 2 and an RBD image;
//! fio's rbd engine writes 60%-compressible data with a crc32c in every block, verifies it
//! through Ceph and reads it back; the script requires HEALTH_OK and a zdisk comp_ratio
//! above 1.5, then tears everything down. This test checks the script's own verdict, the smoke
//! report (smoke.json, and the bench report `zdisk ceph report` writes from the smoke's run),
//! and that nothing is left behind — also when the script is interrupted (SIGINT)
//! while its cluster runs.
//!
//! Run: `cargo test -p zdisk --test ceph_smoke -- --nocapture` as root. Needs Debian's
//! ceph-mon, ceph-mgr, ceph-osd, ceph-common, fio, jq, libnbd-bin, fuse3, qemu-utils; a
//! missing tool skips locally and fails under CI=true (see tests/common). About a minute.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{plugin, require, require_block_devices, zdisk_bin, Scratch};
use serde_json::Value;

const TOOLS: [&str; 14] = [
    "ceph-mon",
    "ceph-mgr",
    "ceph-osd",
    "ceph",
    "rbd",
    "monmaptool",
    "ceph-authtool",
    "fio",
    "jq",
    "nbdfuse",
    "fusermount3",
    "qemu-nbd",
    "losetup",
    "bash",
];

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-demo.sh")
}

fn demo(scratch: &Scratch, mode: &str, out: &Path) -> Command {
    let dir = scratch.path("work");
    std::fs::create_dir_all(&dir).unwrap();
    let mut command = Command::new("bash");
    command
        .arg(script())
        .arg(mode)
        .arg("--zdisk")
        .arg(zdisk_bin())
        .arg("--dir")
        .arg(&dir)
        .arg("--out")
        .arg(out)
        .env("ZDISK_PLUGIN", plugin());
    command
}

/// Everything the script starts lives under `dir`: no process may still name it on its
/// command line, no loop device may still point into it, no FUSE mount may remain, and the
/// work directory itself must be gone.
fn assert_nothing_left(dir: &Path) {
    let needle = dir.to_string_lossy().into_owned();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut left = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            if pid == std::process::id() {
                continue;
            }
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if cmdline.contains(&needle) {
                left.push(format!("process {pid}: {cmdline}"));
            }
        }
        let loops = Command::new("losetup").arg("-a").output().expect("losetup -a");
        for line in String::from_utf8_lossy(&loops.stdout).lines() {
            if line.contains(&needle) {
                left.push(format!("loop device: {line}"));
            }
        }
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        for line in mounts.lines() {
            if line.contains(&needle) {
                left.push(format!("mount: {line}"));
            }
        }
        let work_dirs: Vec<_> = std::fs::read_dir(dir)
            .map(|d| d.flatten().map(|e| e.path().display().to_string()).collect())
            .unwrap_or_default();
        for d in work_dirs {
            left.push(format!("work directory: {d}"));
        }
        if left.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            panic!("the script left things behind:\n{}", left.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn wait_with_deadline(child: &mut Child, limit: Duration, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() >= deadline {
            // SAFETY: SIGINT to our own child; the script tears down on it.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
            let status = child.wait().unwrap();
            panic!("{what} did not finish within {limit:?} (interrupted: {status})");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn ceph_cluster_on_zdisk_devices_serves_rbd_and_tears_down() {
    if !require(&TOOLS) || !require_block_devices() {
        return;
    }
    let scratch = Scratch::new("ceph-smoke");
    let work = scratch.path("work");

    // 1. Interrupted while the cluster serves: everything must still be torn down.
    let out = scratch.path("report-interrupted");
    let mut child = demo(&scratch, "smoke", &out).stdin(Stdio::null()).spawn().expect("starting the script");
    let log = out.join("run.log");
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        if std::fs::read_to_string(&log).map(|l| l.contains("every PG active+clean")).unwrap_or(false) {
            break;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the smoke exited ({status}) before its cluster was up; see {}", log.display());
        }
        assert!(Instant::now() < deadline, "the cluster did not come up within 240 s; see {}", log.display());
        std::thread::sleep(Duration::from_millis(200));
    }
    // SAFETY: SIGINT to our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let status = wait_with_deadline(&mut child, Duration::from_secs(180), "the interrupted smoke");
    assert_eq!(status.code(), Some(130), "an interrupted run exits 130");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("interrupted") && text.contains("teardown"), "run.log:\n{text}");
    assert_nothing_left(&work);

    // 2. The whole smoke.
    let out = scratch.path("report");
    let started = Instant::now();
    let mut child = demo(&scratch, "smoke", &out).stdin(Stdio::null()).spawn().expect("starting the script");
    let status = wait_with_deadline(&mut child, Duration::from_secs(600), "the smoke");
    let text = std::fs::read_to_string(out.join("run.log")).unwrap_or_default();
    assert!(status.success(), "scripts/ceph-demo.sh smoke failed ({status}); run.log:\n{text}");
    eprintln!("ceph smoke: {:.0} s", started.elapsed().as_secs_f64());
    assert_nothing_left(&work);

    let report: Value = serde_json::from_str(&std::fs::read_to_string(out.join("smoke.json")).unwrap()).unwrap();
    assert!(report["health"].as_str().unwrap().starts_with("HEALTH_OK"), "{report}");
    let written = report["workloads"][0]["write_bytes"].as_f64().unwrap();
    assert!(written >= 64.0 * 1024.0 * 1024.0, "fio wrote {written} bytes");
    assert_eq!(report["workloads"][0]["errors"], 0);
    assert!(report["workloads"][1]["read_bytes"].as_f64().unwrap() > 0.0);
    // Ceph stored the client's bytes twice (pool size 2) on zdisk, which compressed them.
    let stored = report["space"]["pool"]["stored"].as_f64().unwrap();
    assert!(stored >= written * 0.99, "pool stored {stored} of {written} written");
    let zdisk = &report["space"]["zdisk"];
    assert_eq!(zdisk["stores"].as_array().unwrap().len(), 3);
    let ratio = zdisk["comp_ratio"].as_f64().unwrap();
    assert!(ratio > 1.5, "comp_ratio {ratio}");
    let logical = zdisk["logical_size"].as_f64().unwrap();
    assert!(logical >= 2.0 * written, "zdisk holds {logical} logical bytes for 2 x {written}");

    // The smoke's run through the bench's report (`zdisk ceph report`, from the runs.jsonl and
    // meta.json the script wrote): report.json with a bench's fields, summary.md, report.html.
    let bench: Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(bench["schema"], "zdisk-ceph/1");
    for key in ["command", "wall_s", "config", "host", "loadavg_start", "loadavg_end", "ratios", "goals", "runs"] {
        assert!(bench.get(key).is_some(), "report.json has no {key}: {bench}");
    }
    let case = &bench["cases"][0];
    let keys: std::collections::BTreeSet<&str> = case.as_object().unwrap().keys().map(String::as_str).collect();
    let expected: std::collections::BTreeSet<&str> = zdisk_apps::ceph::CASE_MEAN_KEYS.into_iter().collect();
    assert_eq!(keys, expected, "{case}");
    assert_eq!((case["case"].as_str(), case["rounds"].as_u64()), (Some("zdisk"), Some(1)), "{case}");
    assert!(case["write_mb_s"].as_f64().unwrap() > 0.0 && case["read_mb_s"].as_f64().unwrap() > 0.0, "{case}");
    assert!(case["cpu_s_per_gb"]["named"].as_f64().unwrap() > 0.0, "{case}");
    // the zdisk servers were found and measured (their CPU and what they wrote to the disk)
    assert!(case["cpu_s_per_gb"]["server"].as_f64().unwrap() > 0.0, "{case}");
    assert!(case["backing_bytes_per_client_byte"].as_f64().unwrap() > 0.0, "{case}");
    assert!(case["host_disk_bytes"].as_f64().unwrap() > 0.0, "{case}");
    assert!((case["zdisk_comp_ratio"].as_f64().unwrap() - ratio).abs() < 1e-9, "{case}");
    assert_eq!(case["fio_errors"], 0, "{case}");
    assert_eq!(bench["per_round"].as_array().unwrap().len(), 1);
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(
        summary.starts_with("# zdisk under Ceph") && summary.contains("| zdisk (Ceph compression off) |"),
        "{summary}"
    );
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("<table>") && html.contains("zdisk (Ceph compression off)"), "{html}");
}
