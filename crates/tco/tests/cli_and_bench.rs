//! The `zdisk tco` command line (through clap, as the `zdisk` binary wires it) and
//! `--from-bench` with sample `zdisk bench` reports.

use std::path::PathBuf;

use clap::Parser;
use serde_json::{json, Value};
use zdisk_tco::{apply_bench_report, compute, output, Config, TcoArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    tco: TcoArgs,
}

fn run_cli(args: &[&str]) -> anyhow::Result<String> {
    let cli = Cli::try_parse_from(std::iter::once("zdisk-tco").chain(args.iter().copied()))?;
    output(&cli.tco)
}

fn write_tmp(name: &str, text: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A sample report in the `summary` form: two workloads, zdisk 10% slower than raw on both,
/// 2.1:1 compression.
fn sample_summary_report() -> Value {
    json!({
        "device": "/dev/nvme0n1",
        "summary": [
            {"workload": "seq-write-128k", "raw_iops": 10000.0, "zdisk_iops": 9000.0, "comp_ratio": 2.1},
            {"workload": "rand-read-4k", "ratio": 0.9, "comp_ratio": 2.1},
            {"workload": "label-only"}
        ]
    })
}

#[test]
fn default_table_shows_the_published_headline_figures() {
    let text = run_cli(&[]).unwrap();
    for needle in ["Ceph baseline", "Ceph CS SSD 15.36TB", "$565.09", "$389.19", "$141.05", "$9.42", "$6.49", "$2.35"] {
        assert!(text.contains(needle), "table lacks {needle}:\n{text}");
    }
    let tco_line = text.lines().find(|l| l.starts_with("TCO (OpEx + CapEx) per TBe")).unwrap();
    assert!(tco_line.ends_with("$565.09             $389.19              $141.05"), "{tco_line}");
}

#[test]
fn json_output_is_one_object_with_the_report() {
    let value: Value = serde_json::from_str(&run_cli(&["--json"]).unwrap()).unwrap();
    let columns = value["report"]["columns"].as_array().unwrap();
    assert_eq!(columns.len(), 3);
    assert_eq!(columns[2]["name"], "Ceph CS SSD 15.36TB");
    let tco = columns[1]["tco_per_tbe_usd"].as_f64().unwrap();
    assert_eq!((tco * 100.0).round() / 100.0, 389.19);
    assert!(value["bench"].is_null());
    assert_eq!(value["config"]["column"][0]["workload"]["compression_ratio"], 2.2);
}

#[test]
fn printed_default_config_is_the_built_in_one() {
    let text = run_cli(&["--print-default-config"]).unwrap();
    assert_eq!(Config::from_toml_str(&text).unwrap(), Config::published_default());
    let path = write_tmp("tco-default.toml", &text);
    assert_eq!(run_cli(&["--config", path.to_str().unwrap()]).unwrap(), run_cli(&[]).unwrap());
    assert!(run_cli(&["--print-default-config", "--json"]).is_err());
}

#[test]
fn bad_config_file_error_reaches_the_cli() {
    let path = write_tmp("tco-cli-bad.toml", &PUBLISHED_DEFAULT.replacen("pue = 1.0\n", "pue = 1.0\nfoo = 1\n", 1));
    let err = run_cli(&["--config", path.to_str().unwrap()]).unwrap_err();
    assert!(format!("{err:#}").contains("unknown field `foo`"), "{err:#}");
}
const PUBLISHED_DEFAULT: &str = zdisk_tco::PUBLISHED_DEFAULT_TOML;

#[test]
fn from_bench_adds_a_zdisk_column_with_measured_figures() {
    let path = write_tmp("tco-bench-summary.json", &sample_summary_report().to_string());
    let value: Value =
        serde_json::from_str(&run_cli(&["--from-bench", path.to_str().unwrap(), "--json"]).unwrap()).unwrap();
    let columns = value["report"]["columns"].as_array().unwrap();
    assert_eq!(columns.len(), 4);
    let zdisk = &columns[3];
    assert_eq!(zdisk["name"], "zdisk");
    // A copy of the baseline hardware (software compression on the host CPU, 3.84 TB drives).
    assert_eq!(zdisk["rack"], "baseline");
    let get = |key: &str| zdisk[key].as_f64().unwrap();
    assert!((get("compression_ratio") - 2.1).abs() < 1e-12);
    // Geometric mean of 9000/10000 and 0.9 is 0.9: 1/0.9 times the hardware for equal speed.
    assert!((get("performance_multiplier") - 1.0 / 0.9).abs() < 1e-12);
    // Effective factor 0.9 x 2.1 / 1.5 x 0.9 = 1.134; the baseline hardware's TCO per raw TB
    // is $565.0906 (its published factor is exactly 1), so $565.0906 / 1.134 = $498.32.
    assert!((get("effective_tb_per_raw_tb") - 1.134).abs() < 1e-12);
    let baseline_tco = columns[0]["tco_per_tbe_usd"].as_f64().unwrap();
    assert!((get("tco_per_tbe_usd") - baseline_tco / 1.134).abs() < 1e-9);
    assert_eq!(zdisk_tco::usd(get("tco_per_tbe_usd")), "$498.32");
    assert!(value["bench"]["source"].as_str().unwrap().contains("summary"));

    let table = run_cli(&["--from-bench", path.to_str().unwrap()]).unwrap();
    assert!(table.contains("filled from the bench report"), "{table}");
    assert!(table.lines().next().unwrap().trim_end().ends_with("zdisk"));
}

#[test]
fn from_bench_fills_a_named_existing_column() {
    let path = write_tmp("tco-bench-top.json", r#"{"comp_ratio": 3.0, "perf_multiplier": 1.25}"#);
    let text =
        run_cli(&["--from-bench", path.to_str().unwrap(), "--bench-column", "Ceph CS SSD 3.84TB", "--json"]).unwrap();
    let value: Value = serde_json::from_str(&text).unwrap();
    let columns = value["report"]["columns"].as_array().unwrap();
    assert_eq!(columns.len(), 3);
    assert_eq!(columns[1]["compression_ratio"], 3.0);
    assert_eq!(columns[1]["performance_multiplier"], 0.8);
}

#[test]
fn apply_bench_report_top_level_keys() {
    let mut config = Config::published_default();
    let figures =
        apply_bench_report(&mut config, &json!({"comp_ratio": 1.8, "perf_multiplier": 0.5}), "Ceph CS SSD 15.36TB")
            .unwrap();
    assert_eq!(figures.comp_ratio, Some(1.8));
    assert_eq!(figures.perf_ratio, Some(0.5));
    let w = &config.columns[2].workload;
    assert_eq!((w.compression_ratio, w.performance_multiplier), (1.8, 2.0));
    // 0.9 x 1.8 / 1.5 / 2 = 0.54 effective TB per raw TB
    assert!((compute(&config).columns[2].effective_tb_per_raw_tb - 0.54).abs() < 1e-12);
}

/// The shape `zdisk bench` writes (crates/bench/src/report.rs): headline numbers at the top
/// level beside much else; `null` where a figure was not measured.
#[test]
fn reads_the_zdisk_bench_report_shape() {
    let report = json!({
        "schema": "zdisk-bench/1", "command": "zdisk bench ...", "wall_s": 1234.5,
        "comp_ratio": 2.04, "perf_multiplier": 0.87,
        "headline_basis": "2:1 data: ...",
        "by_data": [{"data": "ratio2", "comp_ratio": 2.04, "perf_multiplier": 0.87, "pairs": 6}],
        "results": [], "notes": [], "errors": []
    });
    let figures = zdisk_tco::read_bench_report(&report).unwrap();
    assert_eq!((figures.comp_ratio, figures.perf_ratio), (Some(2.04), Some(0.87)));

    // Only the ratio measured: the performance figure falls back to nothing and is left alone.
    let partial = json!({"comp_ratio": 1.5, "perf_multiplier": null});
    let mut config = Config::published_default();
    let figures = apply_bench_report(&mut config, &partial, "Ceph CS SSD 3.84TB").unwrap();
    assert_eq!(figures.perf_ratio, None);
    assert_eq!(config.columns[1].workload.compression_ratio, 1.5);
    assert_eq!(config.columns[1].workload.performance_multiplier, 1.0);
}

#[test]
fn apply_bench_report_with_only_a_ratio_keeps_the_multiplier() {
    let mut config = Config::published_default();
    apply_bench_report(&mut config, &json!({"summary": [{"workload": "w", "comp_ratio": 4.0}]}), "Ceph baseline")
        .unwrap();
    assert_eq!(config.columns[0].workload.compression_ratio, 4.0);
    assert_eq!(config.columns[0].workload.performance_multiplier, 1.32);
}

#[test]
fn unusable_bench_reports_are_clear_errors() {
    let mut config = Config::published_default();
    let cases = [
        (json!({"results": []}), "no usable figure"),
        (json!({"summary": [{"workload": "w"}]}), "no usable figure"),
        (json!([1, 2]), "must be a JSON object"),
        (json!({"comp_ratio": 0}), "`comp_ratio` must be > 0"),
        (json!({"summary": {"w": 1}}), "`summary` must be an array"),
        (json!({"summary": [{"workload": "w", "ratio": "fast"}]}), "`summary[0].ratio` must be a number"),
    ];
    let null_headline = json!({"schema": "zdisk-bench/1", "comp_ratio": null, "perf_multiplier": null,
        "headline_basis": "the 2:1 data mode was not run", "by_data": []});
    let cases = [cases.as_slice(), &[(null_headline, "the 2:1 data mode was not run")]].concat();
    for (report, needle) in cases {
        let err = apply_bench_report(&mut config, &report, "Ceph baseline").unwrap_err();
        assert!(format!("{err:#}").contains(needle), "{report}: {err:#}");
    }
    let err = apply_bench_report(&mut config, &json!({"comp_ratio": 2}), "nope").unwrap_err();
    assert!(err.to_string().contains("no column named \"nope\""), "{err}");
    assert_eq!(config, Config::published_default(), "failed applications change nothing");

    let path = write_tmp("tco-bench-bad.json", "{ not json");
    let err = run_cli(&["--from-bench", path.to_str().unwrap()]).unwrap_err();
    assert!(format!("{err:#}").contains("is not JSON"), "{err:#}");
}
