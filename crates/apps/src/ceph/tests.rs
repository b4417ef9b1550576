//! `zdisk ceph report` on small runs.jsonl fixtures written here.

use super::*;
use serde_json::json;

/// A fio run as `run_workload` records it.
fn workload(name: &str, mb_per_s: f64, iops: f64, cpu_named: f64, cpu_host: f64) -> Value {
    json!({
        "workload": name, "fio_json": "/x.json", "runtime_s": 10.0,
        "write_bytes": 2_000_000_000u64, "read_bytes": 0, "mb_per_s": mb_per_s, "iops": iops,
        "p99_us": 900.0, "errors": 0, "wall_s": 20.0,
        "cpu_s": {"osd": cpu_named / 2.0, "monmgr": 0.5, "server": cpu_named / 4.0, "transport": 1.0,
                  "client": cpu_named / 4.0 - 1.5, "host": cpu_host, "named": cpu_named,
                  "other": cpu_host - cpu_named},
        "server_write_bytes": 1_000_000_000u64, "zdisk_backing_write_bytes": 0,
        "loadavg_before": "1.00 1.10 1.20", "loadavg_after": "2.00 2.10 2.20"
    })
}

/// A case in a round as `run_case` records it.
fn run(round: i64, case: &str, write_mb_s: f64, cpu_named: f64, host_disk_bytes: u64, zdisk: bool) -> String {
    let space = json!({
        "host_disk_bytes": host_disk_bytes,
        "pool": {"stored": 2_000_000_000u64, "bytes_used": 4_000_000_000u64, "compress_bytes_used": 0,
                 "compress_under_bytes": 0},
        "cluster_used_bytes": 4_000_000_000u64,
        "bluestore": [{"osd": 0, "bluestore_compressed": 100}, {"osd": 1, "bluestore_compressed": 300}],
        "bluestore_compressed_original": 1000, "bluestore_compressed_allocated": 500, "bluestore_allocated": 9,
        "zdisk": if zdisk { json!({"comp_ratio": 2.5, "physical_size": 1_600_000_000u64}) } else { Value::Null },
    });
    json!({
        "round": round, "position": 0, "case": case, "zdisk_format": "", "setup_s": 20, "devices": [],
        "workloads": [workload("128k-seqwrite", write_mb_s, 800.0, cpu_named, cpu_named * 1.5),
                      workload("128k-seqread", 2.0 * write_mb_s, 1600.0, 1.0, 2.0),
                      workload("4k-randwrite", 1.0, 500.0, 5.0, 6.0)],
        "space_after_write": space,
    })
    .to_string()
}

fn meta(cases: &[&str]) -> String {
    json!({
        "host": {"cpu": "Test CPU", "cores": 2, "kernel": "6.1", "mem_bytes": 1, "ceph": "16.2.15",
                 "fio": "fio-3.33", "zdisk": "zdisk 0.1", "nbdkit": "", "backing_fs": "ext4", "git": "abc1234"},
        "load0": "1.0 1.0 1.0", "load1": "2.0 2.0 2.0",
        "cfg": {"osds": 3, "osd_bytes": 4u64 << 30, "zdisk_native_fraction": 0.8, "zdisk_physical_bytes": 5u64 << 30,
                "zdisk_format": "", "cases": cases, "images": 2, "image_bytes": 1u64 << 30, "rounds": 2,
                "runtime_s": 20, "qd": 128, "buffer_compress_percentage": 60, "dir": "/var/tmp",
                "pool_size": 2, "pgs": 32, "osd_memory_target": 1073741824u64, "bdev_enable_discard": true},
        "cmd": "scripts/ceph-demo.sh bench", "wall": 1234
    })
    .to_string()
}

fn run_dir(meta: &str, runs: &[String]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("meta.json"), meta).unwrap();
    fs::write(dir.path().join("runs.jsonl"), runs.join("\n") + "\n").unwrap();
    dir
}

fn close(a: &Value, b: f64) -> bool {
    a.as_f64().is_some_and(|a| (a - b).abs() < 1e-9 * b.abs().max(1.0))
}

#[test]
fn the_report_takes_same_round_ratios_and_the_per_gb_arithmetic() {
    // Two rounds of zdisk, BlueStore zstd and raw. Round 0: zdisk writes 300 MB/s with
    // 10 s of named CPU, zstd 200 MB/s with 20 s; round 1: 400 vs 200, 10 vs 40.
    let runs = [
        run(0, "zdisk", 300.0, 10.0, 1_000_000_000, true),
        run(0, "bluestore-zstd", 200.0, 20.0, 1_500_000_000, false),
        run(0, "raw", 250.0, 8.0, 4_000_000_000, false),
        run(1, "raw", 250.0, 8.0, 4_000_000_000, false),
        run(1, "zdisk", 400.0, 10.0, 1_000_000_000, true),
        run(1, "bluestore-zstd", 200.0, 40.0, 1_500_000_000, false),
    ];
    let dir = run_dir(&meta(&["zdisk", "bluestore-zstd", "raw"]), &runs);
    write(dir.path()).unwrap();
    let r: Value = serde_json::from_str(&fs::read_to_string(dir.path().join("report.json")).unwrap()).unwrap();
    assert_eq!(r["schema"], "zdisk-ceph/1");
    assert_eq!(r["command"], "scripts/ceph-demo.sh bench");
    assert_eq!(r["wall_s"], 1234);
    assert_eq!(r["loadavg_start"], "1.0 1.0 1.0");
    assert_eq!(r["config"]["qd"], 128);
    assert_eq!(r["host"]["cores"], 2);
    assert_eq!(r["runs"].as_array().unwrap().len(), 6);
    assert_eq!(r["runs"][3]["case"], "raw");

    // per run: 2 GB written, so CPU s/GB = CPU s / 2; busy = 100 x CPU / 20 s / 2 cores
    let z0 = &r["per_round"][0];
    assert_eq!(z0["case"], "zdisk");
    assert!(close(&z0["cpu_s_per_gb"]["named"], 5.0), "{z0}");
    assert!(close(&z0["cpu_s_per_gb"]["host"], 7.5), "{z0}");
    assert!(close(&z0["cpu_s_per_gb"]["osd"], 2.5), "{z0}");
    assert!(close(&z0["cpu_busy_pct"]["named"], 25.0), "{z0}");
    assert!(close(&z0["cpu_busy_pct"]["host"], 37.5), "{z0}");
    // 5 s named over 500 IOPS x 10 s = 5 kIO
    assert!(close(&z0["randwrite_cpu_s_per_kio"], 1.0), "{z0}");
    assert!(close(&z0["backing_bytes_per_client_byte"], 0.5), "{z0}");
    assert!(z0["zdisk_backing_bytes_per_client_byte"].is_null(), "no zdisk backing bytes: null");
    // space saved against the same round's raw: 1 - 1 GB / 4 GB
    assert!(close(&z0["space_saving"], 0.75), "{z0}");
    assert!(close(&z0["zdisk_comp_ratio"], 2.5), "{z0}");
    assert!(close(&z0["bluestore_comp_ratio"], 2.0), "{z0}");
    assert!(close(&z0["bluestore_compressor_ratio"], 2.5), "1000 original / (100 + 300): {z0}");
    assert_eq!(z0["fio_errors"], 0);
    assert_eq!(z0["loadavg"], json!(["1.00 1.10 1.20", "2.00 2.10 2.20"]));
    assert!(close(&r["per_round"][2]["space_saving"], 0.0), "raw against itself");

    // per case: means over rounds, in the configuration's order
    let cases = r["cases"].as_array().unwrap();
    assert_eq!(
        cases.iter().map(|c| c["case"].as_str().unwrap()).collect::<Vec<_>>(),
        ["zdisk", "bluestore-zstd", "raw"]
    );
    assert_eq!(cases[0]["rounds"], 2);
    assert!(close(&cases[0]["write_mb_s"], 350.0));
    assert!(close(&cases[1]["cpu_s_per_gb"]["named"], 15.0));
    assert!(close(&cases[1]["space_saving"], 0.625));
    assert!(cases[2]["zdisk_comp_ratio"].is_null(), "raw has no zdisk ratio");
    assert_eq!(cases[0]["fio_errors"], 0);

    // ratios: zdisk vs zstd per round 1.5 and 2 → geometric mean √3; CPU 0.5 and 0.25
    let ratios = r["ratios"].as_array().unwrap();
    assert_eq!(ratios.len(), 2, "zdisk against bluestore-zstd and raw");
    let zstd = &ratios[0];
    assert_eq!((zstd["zdisk"].as_str(), zstd["versus"].as_str()), (Some("zdisk"), Some("bluestore-zstd")));
    assert!(close(&zstd["write_bw"]["per_round"][0], 1.5));
    assert!(close(&zstd["write_bw"]["per_round"][1], 2.0));
    assert!(close(&zstd["write_bw"]["mean"], 3f64.sqrt()));
    assert!(close(&zstd["cpu_per_gb_named"]["mean"], 0.125f64.sqrt()));
    assert!(close(&zstd["read_bw"]["mean"], 3f64.sqrt()));
    // space saving 0.75 / 0.625 = 1.2 in both rounds
    assert!(close(&zstd["space_saving"]["mean"], 1.2));
    // against raw the saving is 0.75 / 0: no ratio, so no mean
    assert!(ratios[1]["space_saving"]["per_round"][0].is_null());
    assert!(ratios[1]["space_saving"]["mean"].is_null());

    // goals, against BlueStore zstd
    let goal = &r["goals"][0];
    assert_eq!(goal["zdisk"], "zdisk");
    assert_eq!(goal["write_bw"]["met"], true);
    assert!(close(&goal["write_bw"]["fraction_of_goal"], 3f64.sqrt() / 1.2));
    assert_eq!(goal["cpu_per_gb"]["met"], true);
    assert!(close(&goal["cpu_per_gb"]["saving"], 1.0 - 0.125f64.sqrt()));
    assert_eq!(goal["space_saving"]["met"], true);
    assert_eq!(r["goals"].as_array().unwrap().len(), 1, "zdisk-zstd1 did not run");

    let md = fs::read_to_string(dir.path().join("summary.md")).unwrap();
    assert!(md.starts_with("# zdisk under Ceph: the SNIA case study side by side\n"), "{md}");
    assert!(md.contains("| zdisk (Ceph compression off) | 350.0 | 700.0 | 500 | 5.00 |"), "{md}");
    assert!(md.contains("| zdisk (Ceph compression off) | raw + BlueStore zstd force | 1.73x |"), "{md}");
    assert!(md.contains("1.73x: **met** (144% of the goal)"), "{md}");
    assert!(md.contains("2.50 (zdisk)") && md.contains("2.00 allocated (2.50 compressor)"), "{md}");
    assert!(md.contains("Wall time 1234 s") && md.contains("Command: `scripts/ceph-demo.sh bench`"), "{md}");
    let html = fs::read_to_string(dir.path().join("report.html")).unwrap();
    assert!(html.contains("<title>zdisk under Ceph</title>") && html.contains("<table>"), "{html}");
    assert!(html.contains("1.73x: met (144% of the goal)") && !html.contains("**"), "{html}");
    assert!(html.contains("<code>buffer_compress_percentage=60</code>"), "{html}");
}

fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    k.sort_unstable();
    k
}

fn sorted<'a>(names: &[&'a str]) -> Vec<&'a str> {
    let mut v = names.to_vec();
    v.sort_unstable();
    v
}

/// report.json keeps the field names scripts/ceph-report.jq wrote (docs/ceph.md, the smoke
/// test and earlier runs' reports use them).
#[test]
fn the_report_keeps_the_field_names_of_schema_1() {
    let runs = [run(0, "zdisk", 300.0, 10.0, 1, true), run(0, "bluestore-zstd", 200.0, 20.0, 2, false)];
    let dir = run_dir(&meta(&["zdisk", "bluestore-zstd"]), &runs);
    write(dir.path()).unwrap();
    let r: Value = serde_json::from_str(&fs::read_to_string(dir.path().join("report.json")).unwrap()).unwrap();
    let top = ["schema", "command", "wall_s", "config", "host", "loadavg_start", "loadavg_end", "cases"];
    assert_eq!(keys(&r), sorted(&[&top[..], &["ratios", "goals", "per_round", "runs"]].concat()));
    let cpu = ["named", "host", "osd", "server", "transport", "client", "monmgr", "other"];
    assert_eq!(keys(&r["cases"][0]), sorted(&CASE_MEAN_KEYS));
    assert_eq!(keys(&r["cases"][0]["cpu_s_per_gb"]), sorted(&cpu));
    assert_eq!(keys(&r["cases"][0]["cpu_busy_pct"]), ["host", "named"]);
    let per_run = [
        "round",
        "case",
        "write_mb_s",
        "read_mb_s",
        "randwrite_iops",
        "write_p99_us",
        "randwrite_p99_us",
        "fio_errors",
        "cpu_s_per_gb",
        "cpu_busy_pct",
        "randwrite_cpu_s_per_kio",
        "backing_bytes_per_client_byte",
        "zdisk_backing_bytes_per_client_byte",
        "host_disk_bytes",
        "stored_bytes",
        "zdisk_comp_ratio",
        "zdisk_physical_size",
        "bluestore_comp_ratio",
        "bluestore_compressor_ratio",
        "pool_compress_under_bytes",
        "pool_compress_bytes_used",
        "loadavg",
        "space_saving",
    ];
    assert_eq!(keys(&r["per_round"][0]), sorted(&per_run));
    assert_eq!(keys(&r["per_round"][0]["cpu_s_per_gb"]), sorted(&cpu));
    let ratio = ["zdisk", "versus", "write_bw", "read_bw", "randwrite_iops", "cpu_per_gb_named"];
    assert_eq!(keys(&r["ratios"][0]), sorted(&[&ratio[..], &["cpu_per_gb_host", "space_saving"]].concat()));
    assert_eq!(keys(&r["ratios"][0]["write_bw"]), ["mean", "per_round"]);
    let g = &r["goals"][0];
    assert_eq!(keys(g), sorted(&["zdisk", "write_bw", "cpu_per_gb", "space_saving"]));
    assert_eq!(keys(&g["write_bw"]), sorted(&["goal", "value", "met", "fraction_of_goal"]));
    assert_eq!(keys(&g["cpu_per_gb"]), sorted(&["goal", "value", "value_host_total", "met", "saving"]));
    assert_eq!(keys(&g["space_saving"]), sorted(&["goal", "value", "met"]));
}

#[test]
fn a_run_without_some_workloads_or_cases_gives_nulls_not_a_failure() {
    // what the smoke records: one round of zdisk, a write and a read, no random writes
    let line = json!({
        "round": 0, "case": "zdisk",
        "workloads": [workload("128k-seqwrite", 100.0, 800.0, 10.0, 12.0), workload("128k-seqread", 200.0, 1.0, 1.0, 1.0)],
        "space_after_write": {"host_disk_bytes": 5, "pool": {"stored": 7}, "bluestore": [],
                              "zdisk": {"comp_ratio": 2.0, "physical_size": 3}},
    })
    .to_string();
    let dir = run_dir(&meta(&["zdisk", "raw"]), &[line]);
    write(dir.path()).unwrap();
    let r: Value = serde_json::from_str(&fs::read_to_string(dir.path().join("report.json")).unwrap()).unwrap();
    let z = &r["cases"][0];
    assert!(close(&z["write_mb_s"], 100.0) && close(&z["zdisk_comp_ratio"], 2.0), "{z}");
    assert!(z["randwrite_iops"].is_null() && z["space_saving"].is_null(), "{z}");
    assert!(r["per_round"][0]["bluestore_compressor_ratio"].is_null());
    assert_eq!(r["cases"][1]["rounds"], 0);
    assert!(r["cases"][1]["fio_errors"].is_null());
    assert_eq!(r["ratios"][0]["write_bw"]["per_round"], json!([]), "raw never ran");
    assert!(r["goals"].as_array().unwrap().is_empty());
    let md = fs::read_to_string(dir.path().join("summary.md")).unwrap();
    assert!(md.contains("| zdisk (Ceph compression off) | 100.0 | 200.0 | — |"), "{md}");
}

#[test]
fn a_malformed_line_is_named_with_its_number() {
    let good = run(0, "zdisk", 300.0, 10.0, 1, true);
    let dir = run_dir(&meta(&["zdisk"]), &[good.clone(), "{\"round\": 1, \"case\": \"zdisk\", \"workl".into()]);
    let err = format!("{:#}", write(dir.path()).unwrap_err());
    assert!(err.contains("runs.jsonl line 2: not JSON"), "{err}");
    assert!(!dir.path().join("report.json").exists());

    let dir = run_dir(&meta(&["zdisk"]), &[good.clone(), String::new(), "{\"round\": \"one\"}".into()]);
    let err = format!("{:#}", write(dir.path()).unwrap_err());
    assert!(err.contains("runs.jsonl line 3: not a run"), "{err}");

    let dir = run_dir(&meta(&["zdisk"]), &[]);
    assert!(format!("{:#}", write(dir.path()).unwrap_err()).contains("holds no runs"));

    let dir = run_dir("{\"host\": {}}", &[good]);
    let err = format!("{:#}", write(dir.path()).unwrap_err());
    assert!(err.contains("meta.json: not the meta.json"), "{err}");
}

#[test]
fn geometric_means_need_every_value_positive() {
    assert_eq!(gmean(&[]), None);
    assert_eq!(gmean(&[Some(2.0), None]), None);
    assert_eq!(gmean(&[Some(2.0), Some(0.0)]), None);
    assert!((gmean(&[Some(2.0), Some(8.0)]).unwrap() - 4.0).abs() < 1e-12);
    assert_eq!(mean([None, Some(1.0), Some(3.0)]), Some(2.0));
    assert_eq!(mean([None]), None);
    assert_eq!(safe_div(Some(1.0), Some(0.0)), None);
    assert_eq!(pages::inline_html("a `<b>` **c**"), "a <code>&lt;b&gt;</code> <b>c</b>");
}
