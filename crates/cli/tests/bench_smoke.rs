//! Smoke test of `zdisk bench`: runs the built `zdisk` binary in its tiny `--smoke` mode
//! (zdisk and the qemu-nbd raw baseline, 64 MiB, sub-second points) and checks that the report
//! directory is complete: every workload at every queue depth has a non-zero result on every
//! target, every JSON file parses, the headline keys a TCO tool reads are there, and the
//! Markdown and HTML reports name every workload. It tests the tool, not zdisk's speed: no
//! number is compared against a threshold.
//!
//! Run: `cargo test -p zdisk --test bench_smoke` (needs fio with the nbd engine, nbdkit and
//! qemu-nbd; missing tools skip locally and fail under CI=true, see tests/common).

mod common;

use std::path::Path;
use std::time::Instant;

use common::{require, Scratch};
use serde_json::Value;

const WORKLOADS: [(&str, &str); 10] = [
    ("4k-randread", "4K random read"),
    ("4k-randwrite", "4K random write"),
    ("8k-randread", "8K random read"),
    ("8k-randwrite", "8K random write"),
    ("128k-seqread", "128K sequential read"),
    ("128k-seqwrite", "128K sequential write"),
    ("4k-70-30", "4K 70/30 random mix"),
    ("email", "Email server 8K 50/50"),
    ("oltp", "OLTP 8K 66/33"),
    ("web", "Web server 512B-512K reads"),
];

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    // fio's nbd engine may print a notice before the JSON object.
    let start = text.find('{').unwrap_or_else(|| panic!("{} holds no JSON object", path.display()));
    serde_json::from_str(&text[start..]).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// Runs `zdisk bench --smoke` on zdisk and raw with `extra` arguments, its work directory
/// in `scratch` and its report in `out`; returns report.json.
fn run_smoke_bench(scratch: &Scratch, out: &Path, extra: &[&str]) -> Value {
    let output = scratch
        .zdisk()
        .args(["bench", "--smoke", "--targets", "zdisk,raw"])
        .args(extra)
        .arg("--dir")
        .arg(scratch.path("backing"))
        .arg("--out")
        .arg(out)
        .output()
        .expect("running zdisk bench");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "zdisk bench --smoke {extra:?} failed ({}):\n{stderr}", output.status);
    read_json(&out.join("report.json"))
}

fn positive(v: &Value, what: &str) -> f64 {
    let x = v.as_f64().unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(x > 0.0 && x.is_finite(), "{what} must be > 0, got {x}");
    x
}

#[test]
fn bench_smoke_writes_a_complete_report() {
    if !require(&["fio", "nbdkit", "qemu-nbd"]) {
        return;
    }
    let scratch = Scratch::new("bench-smoke");
    let out = scratch.path("report");
    let started = Instant::now();
    let report = run_smoke_bench(&scratch, &out, &[]);
    eprintln!("zdisk bench --smoke took {:.1} s", started.elapsed().as_secs_f64());

    assert_eq!(report["schema"], "zdisk-bench/1");
    assert_eq!(report["errors"].as_array().map(Vec::len), Some(0), "errors: {}", report["errors"]);
    // The two keys the TCO tool reads.
    let ratio = positive(&report["comp_ratio"], "comp_ratio");
    assert!(ratio >= 1.0, "2:1 data cannot give comp_ratio {ratio} < 1");
    positive(&report["perf_multiplier"], "perf_multiplier");

    let config = &report["config"];
    let qds: Vec<u64> = config["qds"].as_array().expect("config.qds").iter().filter_map(Value::as_u64).collect();
    assert!(!qds.is_empty());
    let workloads: Vec<&str> =
        config["workloads"].as_array().expect("config.workloads").iter().filter_map(Value::as_str).collect();
    for (key, _) in WORKLOADS {
        assert!(workloads.contains(&key), "workload {key} missing from the smoke run's config");
    }

    let results = report["results"].as_array().expect("results array");
    for (key, _) in WORKLOADS {
        for target in ["zdisk", "raw"] {
            for &qd in &qds {
                let r = results
                    .iter()
                    .find(|r| r["workload"] == key && r["target"] == target && r["qd"] == qd)
                    .unwrap_or_else(|| panic!("no result for {key} on {target} at QD{qd}"));
                let what = format!("{key} on {target} at QD{qd}");
                assert!(r["error"].is_null(), "{what} failed: {}", r["error"]);
                positive(&r["iops"], &format!("{what}: iops"));
                positive(&r["mb_per_s"], &format!("{what}: mb_per_s"));
                positive(&r["p99_us"], &format!("{what}: p99_us"));
                positive(&r["cost"]["gib_moved"], &format!("{what}: gib_moved"));
                if target == "zdisk" {
                    positive(&r["cost"]["comp_ratio"], &format!("{what}: comp_ratio"));
                    assert!(r["cost"]["zdisk_stat"].is_object(), "{what}: zdisk stat missing");
                }
                let fio_json = r["fio_json"].as_str().expect("fio_json path");
                let fio = read_json(&out.join(fio_json));
                assert!(fio["jobs"][0].is_object(), "{fio_json} has no job");
            }
        }
    }

    let pre = report["preconditioning"].as_array().expect("preconditioning array");
    // The workloads that write are preconditioned (the smoke run skips read-only ones).
    for key in ["4k-randwrite", "8k-randwrite", "128k-seqwrite", "4k-70-30", "email", "oltp"] {
        for target in ["zdisk", "raw"] {
            let p = pre
                .iter()
                .find(|p| p["workload"] == key && p["target"] == target)
                .unwrap_or_else(|| panic!("no preconditioning record for {key} on {target}"));
            assert!(p["error"].is_null(), "preconditioning {key} on {target}: {}", p["error"]);
            assert!(p["verdict"].as_str().is_some_and(|v| v.starts_with("steady state")), "{}", p["verdict"]);
            assert!(!p["round_iops"].as_array().expect("round_iops").is_empty());
        }
    }

    let consistency = report["consistency"].as_array().expect("consistency array");
    for target in ["zdisk", "raw"] {
        for spare in [0, 25] {
            let c = consistency
                .iter()
                .find(|c| c["target"] == target && c["spare_pct"] == spare)
                .unwrap_or_else(|| panic!("no consistency run for {target} +{spare}%"));
            positive(&c["mean_iops"], &format!("consistency {target} +{spare}%"));
        }
    }
    assert!(!report["zdisk_timeline"].as_array().expect("zdisk_timeline").is_empty(), "no zdisk stat samples");

    let summary = std::fs::read_to_string(out.join("summary.md")).expect("summary.md");
    let html = std::fs::read_to_string(out.join("report.html")).expect("report.html");
    for (_, title) in WORKLOADS {
        assert!(summary.contains(title), "summary.md does not mention {title}");
        assert!(html.contains(title), "report.html does not mention {title}");
    }
    assert!(summary.contains("zdisk/raw"), "summary.md has no zdisk/raw column");
    assert!(html.matches("<svg").count() >= WORKLOADS.len(), "report.html has too few inline charts");
    assert!(!html.contains("<script") && !html.contains("src=\"http"), "report.html must be self-contained");
}

/// Incompressible data runs every target on zdisk's native capacity (docs/bench.md): the
/// fills before the workload cover exactly that range (rounded down to a MiB) on zdisk and on
/// the raw target, and zdisk's store is provisioned at it — what incompressible data can
/// always fill and overwrite, not a fixed share of the size.
#[test]
fn bench_runs_incompressible_data_on_the_native_capacity() {
    if !require(&["fio", "nbdkit", "qemu-nbd"]) {
        return;
    }
    let scratch = Scratch::new("bench-native");
    let out = scratch.path("report");
    let report = run_smoke_bench(&scratch, &out, &["--data", "incompressible", "--workloads", "4k-randwrite"]);
    let fills = report["fills"].as_array().expect("fills array");
    let zdisk_fill = fills.iter().find(|f| f["target"] == "zdisk" && f["phase"] == "before 4K random write");
    let zdisk_fill = zdisk_fill.expect("zdisk's fill before the workload");
    let stat = &zdisk_fill["cost"]["zdisk_stat"];
    let native = stat["native_capacity"].as_u64().expect("native_capacity");
    let range = zdisk_fill["range_bytes"].as_u64().expect("range_bytes");
    assert_eq!(range, native >> 20 << 20, "zdisk's range is not its native capacity");
    assert_eq!(stat["provisioned_cap"].as_u64(), Some(range), "zdisk's store is not provisioned at the range");
    let raw_fill = fills.iter().find(|f| f["target"] == "raw" && f["phase"] == "before 4K random write");
    assert_eq!(raw_fill.expect("raw's fill")["range_bytes"].as_u64(), Some(range), "raw exposes another range");
    let notes = report["notes"].as_array().expect("notes");
    assert!(notes.iter().any(|n| n.as_str().is_some_and(|n| n.contains("native capacity"))), "no note says so");
}
