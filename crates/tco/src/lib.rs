//! `zdisk tco`: the SNIA storage TCO model, fed by measured results.
//!
//! Flow: a [`Config`] (built-in [`Config::published_default`] or `--config FILE`, validated on
//! the way in) -> optionally [`apply_bench_report`] (`--from-bench`) -> [`compute`] -> a
//! [`Report`] rendered as an aligned table or as one JSON object (`--json`).
//! The config format and the formulas are documented in docs/tco.md.

mod bench;
mod config;
mod model;
mod render;

use std::path::PathBuf;

use anyhow::Context;
use serde::Serialize;

pub use bench::{apply_bench_report, read_bench_report, BenchFigures};
pub use config::{Column, Config, Drive, RackProfile, Workload, PUBLISHED_DEFAULT_TOML};
pub use model::{compute, ColumnReport, Report};
pub use render::{render_table, usd};

/// Name of the column `--from-bench` fills when `--bench-column` is not given.
pub const DEFAULT_BENCH_COLUMN: &str = "zdisk";

/// `zdisk tco [--config FILE] [--from-bench REPORT.json] [--json]`
#[derive(Debug, Clone, clap::Args)]
pub struct TcoArgs {
    /// TOML model configuration (default: the whitepaper appendix's three columns;
    /// see --print-default-config).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// `zdisk bench` JSON report: its measured compression ratio and zdisk-vs-raw throughput
    /// fill the column named by --bench-column.
    #[arg(long, value_name = "REPORT.json")]
    pub from_bench: Option<PathBuf>,

    /// Column filled by --from-bench. If the config has no column of that name, one is added
    /// as a copy of the first column (the software-compression baseline, the hardware zdisk
    /// runs on) with performance multiplier 1 before the measured figures go in.
    #[arg(long, value_name = "NAME", default_value = DEFAULT_BENCH_COLUMN, requires = "from_bench")]
    pub bench_column: String,

    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,

    /// Print the built-in configuration as TOML (a starting point for --config) and exit.
    #[arg(long, conflicts_with_all = ["config", "from_bench", "json"])]
    pub print_default_config: bool,
}

/// The `--json` document.
#[derive(Debug, Serialize)]
struct JsonOutput<'a> {
    config: &'a Config,
    bench: Option<&'a BenchFigures>,
    report: &'a Report,
}

/// Runs `zdisk tco` and prints its output on stdout.
pub fn run(args: &TcoArgs) -> anyhow::Result<()> {
    print!("{}", output(args)?);
    Ok(())
}

/// What [`run`] prints, as a string (for tests and embedding).
pub fn output(args: &TcoArgs) -> anyhow::Result<String> {
    if args.print_default_config {
        return Ok(PUBLISHED_DEFAULT_TOML.to_string());
    }
    let mut config = match &args.config {
        Some(path) => Config::from_file(path)?,
        None => Config::published_default(),
    };
    let bench = match &args.from_bench {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read bench report {}", path.display()))?;
            let report: serde_json::Value =
                serde_json::from_str(&text).with_context(|| format!("bench report {} is not JSON", path.display()))?;
            add_column_like_first(&mut config, &args.bench_column);
            let figures = apply_bench_report(&mut config, &report, &args.bench_column)
                .with_context(|| format!("in bench report {}", path.display()))?;
            Some(figures)
        }
        None => None,
    };
    let report = compute(&config);
    if args.json {
        let document = JsonOutput { config: &config, bench: bench.as_ref(), report: &report };
        let mut text = serde_json::to_string_pretty(&document)?;
        text.push('\n');
        return Ok(text);
    }
    let mut text = render_table(&report);
    if let Some(figures) = &bench {
        text.push_str(&format!(
            "\nColumn {:?} filled from the bench report ({}).\n",
            args.bench_column, figures.source
        ));
    }
    Ok(text)
}

/// Adds a column named `name` as a copy of the first column, unless one exists. The copy's
/// performance multiplier is reset to 1: the first column's multiplier describes that column's
/// own measurement, not zdisk's.
pub fn add_column_like_first(config: &mut Config, name: &str) {
    if config.column_index(name).is_some() {
        return;
    }
    let mut column = config.columns.first().expect("a validated config has a column").clone();
    column.name = name.to_string();
    column.workload.performance_multiplier = 1.0;
    config.columns.push(column);
}
