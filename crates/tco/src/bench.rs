//! Reading measured figures out of a `zdisk bench` JSON report.
//!
//! The report format belongs to `zdisk bench`; this module reads only the keys documented in
//! docs/tco.md ("Feeding measured results"), in this order:
//! 1. top-level numbers `comp_ratio` (logical / stored bytes) and `perf_multiplier`
//!    (zdisk throughput / raw throughput); `null` counts as absent;
//! 2. for whichever is still missing, a top-level `summary` array of row objects, each with
//!    `workload` (a label), `comp_ratio`, and either `ratio` or both `zdisk_iops` and
//!    `raw_iops`. Rows are combined by geometric mean, the mean that treats a 2x gain and a
//!    2x loss symmetrically.
//!
//! Invariant: a figure that is found is finite and positive, or the read fails naming the key.

use anyhow::{bail, Context};
use serde::Serialize;
use serde_json::Value;

use crate::config::Config;

/// What a bench report measured. At least one of the two is present.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchFigures {
    /// Logical bytes / stored bytes.
    pub comp_ratio: Option<f64>,
    /// zdisk throughput / raw throughput (> 1: zdisk is faster).
    pub perf_ratio: Option<f64>,
    /// Where each figure came from, for the reader of the output.
    pub source: String,
}

/// Reads the measured figures; fails when the report holds neither.
pub fn read_bench_report(report: &Value) -> anyhow::Result<BenchFigures> {
    let Some(top) = report.as_object() else {
        bail!("bench report must be a JSON object, got {}", json_kind(report));
    };
    // `zdisk bench` writes `null` for a figure it could not measure: treat it as absent.
    let present = |key: &str| top.get(key).filter(|v| !v.is_null());
    let mut comp_ratio = present("comp_ratio").map(|v| positive_number(v, "comp_ratio")).transpose()?;
    let mut perf_ratio = present("perf_multiplier").map(|v| positive_number(v, "perf_multiplier")).transpose()?;
    let mut sources = Vec::new();
    if comp_ratio.is_some() {
        sources.push("comp_ratio".to_string());
    }
    if perf_ratio.is_some() {
        sources.push("perf_multiplier".to_string());
    }

    if comp_ratio.is_none() || perf_ratio.is_none() {
        if let Some(summary) = present("summary") {
            let rows = summary
                .as_array()
                .with_context(|| format!("bench report `summary` must be an array, got {}", json_kind(summary)))?;
            let mut comps = Vec::new();
            let mut perfs = Vec::new();
            for (index, row) in rows.iter().enumerate() {
                let Some(row) = row.as_object() else {
                    bail!("bench report `summary[{index}]` must be an object, got {}", json_kind(row));
                };
                let at = |key: &str| format!("summary[{index}].{key}");
                let field = |key: &str| row.get(key).filter(|v| !v.is_null());
                if let Some(v) = field("comp_ratio") {
                    comps.push(positive_number(v, &at("comp_ratio"))?);
                }
                if let Some(v) = field("ratio") {
                    perfs.push(positive_number(v, &at("ratio"))?);
                } else if let (Some(z), Some(r)) = (field("zdisk_iops"), field("raw_iops")) {
                    let zdisk = positive_number(z, &at("zdisk_iops"))?;
                    let raw = positive_number(r, &at("raw_iops"))?;
                    perfs.push(zdisk / raw);
                }
            }
            if comp_ratio.is_none() && !comps.is_empty() {
                comp_ratio = Some(geometric_mean(&comps));
                sources.push(format!("geometric mean of summary[].comp_ratio over {} rows", comps.len()));
            }
            if perf_ratio.is_none() && !perfs.is_empty() {
                perf_ratio = Some(geometric_mean(&perfs));
                sources.push(format!(
                    "geometric mean of summary[].ratio (or zdisk_iops/raw_iops) over {} rows",
                    perfs.len()
                ));
            }
        }
    }

    if comp_ratio.is_none() && perf_ratio.is_none() {
        let keys: Vec<&str> = top.keys().map(String::as_str).collect();
        // The bench report says why its headline figures are null; pass that on.
        let why = match top.get("headline_basis").and_then(Value::as_str) {
            Some(basis) => format!(" (the report says: {basis})"),
            None => String::new(),
        };
        bail!(
            "bench report holds no usable figure: expected a top-level number `comp_ratio` or \
             `perf_multiplier`, or a `summary` array of rows with `comp_ratio` and `ratio` (or \
             `zdisk_iops` and `raw_iops`); top-level keys present: {keys:?}{why}"
        );
    }
    Ok(BenchFigures { comp_ratio, perf_ratio, source: sources.join("; ") })
}

/// Fills the measured figures into the existing column named `column`:
/// `compression_ratio = comp_ratio`, `performance_multiplier = 1 / perf_ratio` (a column that
/// is k times slower needs k times the hardware for the same throughput). A figure the report
/// lacks leaves the field as it was.
pub fn apply_bench_report(config: &mut Config, report: &Value, column: &str) -> anyhow::Result<BenchFigures> {
    let figures = read_bench_report(report)?;
    let Some(index) = config.column_index(column) else {
        let names: Vec<&str> = config.columns.iter().map(|c| c.name.as_str()).collect();
        bail!("no column named {column:?} to fill from the bench report (columns: {names:?})");
    };
    // Edit a copy so a failure leaves the caller's config as it was.
    let mut updated = config.clone();
    let workload = &mut updated.columns[index].workload;
    if let Some(comp_ratio) = figures.comp_ratio {
        workload.compression_ratio = comp_ratio;
    }
    if let Some(perf_ratio) = figures.perf_ratio {
        workload.performance_multiplier = 1.0 / perf_ratio;
    }
    updated.validate().context("the config after applying the bench report")?;
    *config = updated;
    Ok(figures)
}

fn positive_number(value: &Value, key: &str) -> anyhow::Result<f64> {
    match value.as_f64() {
        Some(number) if number.is_finite() && number > 0.0 => Ok(number),
        Some(number) => bail!("bench report `{key}` must be > 0, got {number}"),
        None => bail!("bench report `{key}` must be a number, got {}", json_kind(value)),
    }
}

fn geometric_mean(values: &[f64]) -> f64 {
    assert!(!values.is_empty() && values.iter().all(|v| *v > 0.0));
    (values.iter().map(|v| v.ln()).sum::<f64>() / values.len() as f64).exp()
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn top_level_keys_win_over_summary() {
        let report = json!({"comp_ratio": 2.5, "perf_multiplier": 0.8,
                            "summary": [{"workload": "w", "comp_ratio": 9.0, "ratio": 9.0}]});
        let figures = read_bench_report(&report).unwrap();
        assert_eq!(figures.comp_ratio, Some(2.5));
        assert_eq!(figures.perf_ratio, Some(0.8));
    }

    #[test]
    fn summary_fills_only_what_the_top_level_lacks() {
        let report = json!({"comp_ratio": 2.5,
                            "summary": [{"workload": "a", "comp_ratio": 9.0, "ratio": 0.5},
                                        {"workload": "b", "zdisk_iops": 200.0, "raw_iops": 100.0}]});
        let figures = read_bench_report(&report).unwrap();
        assert_eq!(figures.comp_ratio, Some(2.5));
        // sqrt(0.5 x 2) = 1
        assert!((figures.perf_ratio.unwrap() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn wrong_type_names_the_key() {
        let err = read_bench_report(&json!({"comp_ratio": "2"})).unwrap_err();
        assert!(err.to_string().contains("`comp_ratio` must be a number"), "{err}");
        let err = read_bench_report(&json!({"summary": [{"raw_iops": 0, "zdisk_iops": 1}]})).unwrap_err();
        assert!(err.to_string().contains("summary[0].raw_iops"), "{err}");
    }
}
