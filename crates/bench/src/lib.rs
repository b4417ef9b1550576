//! `zdisk bench`: the reviewers' SSD test methodology (purge, fill twice, precondition to SNIA
//! steady state, queue-depth sweep, performance consistency) run against zdisk and against the
//! same backing directory served raw, in one run, with a JSON + Markdown + HTML report.
//!
//! See docs/bench.md for the method and how to read the report.

mod charts;
mod corpus;
mod fio;
mod plan;
mod report;
mod results;
mod runner;
pub mod server;
pub mod size;
mod steady;
pub mod sys;
pub mod writer;

use std::path::PathBuf;

use anyhow::{bail, Result};
use serde::Serialize;

pub use plan::{DataMode, TargetKind, WorkloadKind};

/// `zdisk bench`: zdisk vs the same disk served raw, with the SSD reviewers' methodology.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Defaults: the full method (4 GiB targets, every workload, data mode and queue depth 1..256, \
60 s per point, preconditioning to SNIA steady state, 30-minute consistency runs) takes many hours; \
narrow it with --workloads/--data/--qd/--targets, or use --quick (under 5 minutes). \
The report directory holds report.json, summary.md and report.html; see docs/bench.md.")]
pub struct BenchArgs {
    /// Quick run (under 5 minutes on a 2-core machine): 1 GiB targets, 2:1 data, QD 1 and 32,
    /// 1-second points, short preconditioning and consistency runs.
    #[arg(long, conflicts_with = "smoke")]
    pub quick: bool,

    /// CI smoke run (well under a minute): tiny targets and sub-second runs. It checks that the
    /// tool works end to end; its numbers mean nothing.
    #[arg(long)]
    pub smoke: bool,

    /// Backing directory for every target's files (must allow O_DIRECT, i.e. not tmpfs).
    /// Default: a temporary directory under $TMPDIR, removed afterwards.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,

    /// Report directory (created; existing report files are overwritten).
    /// Default: ./zdisk-bench-<unix time>.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,

    /// Size of each target (binary units: 64M, 1G, 4G). Default 4G (quick 1G, smoke 64M).
    #[arg(long, value_parser = size::parse_nonzero_bytes, value_name = "SIZE")]
    pub size: Option<u64>,

    /// Targets, comma-separated. Default: all (quick: zdisk,raw,memory; smoke: zdisk,raw).
    #[arg(long, value_enum, value_delimiter = ',', value_name = "LIST")]
    pub targets: Option<Vec<TargetKind>>,

    /// Workloads, comma-separated. Default: all ten.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "LIST")]
    pub workloads: Option<Vec<WorkloadKind>>,

    /// Data modes, comma-separated. Default: all (quick and smoke: 2:1).
    #[arg(long, value_enum, value_delimiter = ',', value_name = "LIST")]
    pub data: Option<Vec<DataMode>>,

    /// Queue depths to sweep, comma-separated (1..=1024). Default 1,2,4,...,256
    /// (quick: 1,32; smoke: 1,4). Preconditioning runs at the largest.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub qd: Option<Vec<u32>>,

    /// Seconds per measured point (fractions allowed). Default 60 (quick 1, smoke 0.2).
    #[arg(long, value_name = "SECONDS")]
    pub runtime: Option<f64>,

    /// Seconds per preconditioning round (at least the IOPS log interval: 1 s, smoke 0.1 s).
    /// Default 60 (quick 1, smoke 0.1).
    #[arg(long, value_name = "SECONDS")]
    pub round: Option<f64>,

    /// Preconditioning round limit; past it the result says "steady state not reached".
    /// 0 skips preconditioning. Default 25 (quick 6, smoke 5).
    #[arg(long, value_name = "N")]
    pub max_rounds: Option<u32>,

    /// Seconds per performance-consistency run (0 skips the test). Default 1800 (quick 10, smoke 0.6).
    #[arg(long, value_name = "SECONDS")]
    pub consistency: Option<f64>,

    /// Sequential 128K fill passes after each purge. Default 2.
    #[arg(long, value_name = "N")]
    pub fill_passes: Option<u32>,

    /// Physical size of the zdisk store (default: --size, i.e. the same bytes as the raw file).
    #[arg(long, value_parser = size::parse_nonzero_bytes, value_name = "SIZE")]
    pub zdisk_physical_size: Option<u64>,

    /// The zdisk binary to format/serve/stat with (default: this executable).
    #[arg(long, hide = true, value_name = "PATH")]
    pub zdisk_bin: Option<PathBuf>,
}

/// Which preset a run's defaults come from: `--smoke` (CI: proves the tool works), `--quick`
/// (minutes: numbers for direction) or neither (the full method, hours). `zdisk bench` and
/// `zdisk db bench` both scale every default by it; recorded in report.json in lower case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    Full,
    Quick,
    Smoke,
}

impl Preset {
    /// The preset of a command's `--quick` and `--smoke` flags (clap lets only one be given).
    pub fn from_flags(quick: bool, smoke: bool) -> Preset {
        if smoke {
            Preset::Smoke
        } else if quick {
            Preset::Quick
        } else {
            Preset::Full
        }
    }

    /// This preset's one of three values.
    pub fn pick<T>(self, full: T, quick: T, smoke: T) -> T {
        match self {
            Preset::Full => full,
            Preset::Quick => quick,
            Preset::Smoke => smoke,
        }
    }
}

/// The order in which to run `n` targets on the `turn`-th pass (turn 0, 1, 2, …): each pass
/// starts one target later, so every target goes first equally often and slow drift of the
/// machine (other load, caches warming) does not always fall on the same one.
pub fn target_order(n: usize, turn: usize) -> Vec<usize> {
    (0..n).map(|k| (k + turn) % n).collect()
}

/// The zdisk binary a harness formats, serves and reads statistics with: `--zdisk-bin`, else
/// this executable (`zdisk` itself).
pub fn zdisk_bin(option: &Option<PathBuf>) -> Result<PathBuf> {
    match option {
        Some(path) => Ok(path.clone()),
        None => Ok(std::env::current_exe()?),
    }
}

/// The resolved settings of one run (all defaults applied), recorded in report.json.
#[derive(Clone, Debug, Serialize)]
pub struct Config {
    pub mode: Preset,
    pub size_bytes: u64,
    pub zdisk_physical_bytes: u64,
    pub targets: Vec<TargetKind>,
    pub workloads: Vec<WorkloadKind>,
    pub data: Vec<DataMode>,
    pub qds: Vec<u32>,
    pub runtime_ms: u64,
    pub ramp_ms: u64,
    pub round_ms: u64,
    pub max_rounds: u32,
    /// fio IOPS log averaging window.
    pub log_ms: u64,
    pub consistency_ms: u64,
    pub consistency_qd: u32,
    pub spare_pcts: Vec<u32>,
    pub fill_passes: u32,
    pub fill_qd: u32,
    /// Purge and fill before every workload (the full method) or once per data mode.
    pub purge_each_workload: bool,
    /// Precondition read-only workloads too (the full method) or only those that write.
    pub precondition_reads: bool,
    /// How often `zdisk stat` is sampled while a job runs on zdisk.
    pub stat_interval_ms: u64,
    /// Wait after each zdisk job for a statistics snapshot taken after it ended (the served
    /// store's snapshot is up to a second old), so per-job deltas are exact. Off in smoke runs.
    pub fresh_stats: bool,
    #[serde(skip)]
    pub dir: Option<PathBuf>,
    #[serde(skip)]
    pub out: PathBuf,
    #[serde(skip)]
    pub zdisk_bin: PathBuf,
}

fn dedup_keep_order<T: PartialEq + Copy>(v: &mut Vec<T>) {
    let mut seen: Vec<T> = Vec::new();
    v.retain(|x| {
        let new = !seen.contains(x);
        seen.push(*x);
        new
    });
}

fn secs_to_ms(what: &str, s: f64) -> Result<u64> {
    if !s.is_finite() || s < 0.0 {
        bail!("--{what} must be a non-negative number of seconds, got {s}");
    }
    Ok((s * 1000.0).round() as u64)
}

/// The raw targets' size and the zdisk store's physical size.
fn sizes(a: &BenchArgs, mode: Preset) -> Result<(u64, u64)> {
    let size_bytes = a.size.unwrap_or(match mode {
        Preset::Full => 4 << 30,
        Preset::Quick => 1 << 30,
        Preset::Smoke => 64 << 20,
    });
    // Align to 1 MiB so every block size, bssplit entry and 25% spare range divides evenly.
    let size_bytes = size_bytes / (1 << 20) * (1 << 20);
    if size_bytes < 16 << 20 {
        bail!("--size must be at least 16 MiB");
    }
    // Checked here, not by the run's formats: a store too small to format ran every step
    // into the same error and wrote a report of failures.
    let zdisk_physical_bytes = a.zdisk_physical_size.unwrap_or(size_bytes);
    if zdisk_physical_bytes < 16 << 20 {
        bail!("--zdisk-physical-size must be at least 16 MiB");
    }
    Ok((size_bytes, zdisk_physical_bytes))
}

impl Config {
    pub fn resolve(a: &BenchArgs) -> Result<Config> {
        let mode = Preset::from_flags(a.quick, a.smoke);
        let pick = |full: f64, quick: f64, smoke: f64| mode.pick(full, quick, smoke);
        let (size_bytes, zdisk_physical_bytes) = sizes(a, mode)?;
        let targets = a.targets.clone().unwrap_or_else(|| match mode {
            Preset::Full => TargetKind::ALL.to_vec(),
            Preset::Quick => vec![TargetKind::Zdisk, TargetKind::Raw, TargetKind::Memory],
            Preset::Smoke => vec![TargetKind::Zdisk, TargetKind::Raw],
        });
        let workloads = a.workloads.clone().unwrap_or_else(|| WorkloadKind::ALL.to_vec());
        let data = a.data.clone().unwrap_or_else(|| match mode {
            Preset::Full => DataMode::ALL.to_vec(),
            _ => vec![DataMode::Ratio2],
        });
        let mut qds = a.qd.clone().unwrap_or_else(|| match mode {
            Preset::Full => vec![1, 2, 4, 8, 16, 32, 64, 128, 256],
            Preset::Quick => vec![1, 32],
            Preset::Smoke => vec![1, 4],
        });
        qds.sort_unstable();
        qds.dedup();
        if qds.is_empty() || qds.iter().any(|&q| q == 0 || q > 1024) {
            bail!("--qd values must be between 1 and 1024");
        }
        let (mut targets, mut workloads, mut data) = (targets, workloads, data);
        dedup_keep_order(&mut targets);
        dedup_keep_order(&mut workloads);
        dedup_keep_order(&mut data);
        if targets.is_empty() || workloads.is_empty() || data.is_empty() {
            bail!("--targets, --workloads and --data must each name at least one entry");
        }
        // The smoke run's rounds are tiny, so its IOPS log interval is too; real runs log every second.
        let log_ms = if mode == Preset::Smoke { 100 } else { 1000 };
        let runtime_ms = secs_to_ms("runtime", a.runtime.unwrap_or(pick(60.0, 1.0, 0.2)))?;
        if runtime_ms < 100 {
            bail!("--runtime must be at least 0.1 s");
        }
        let round_ms = secs_to_ms("round", a.round.unwrap_or(pick(60.0, 1.0, 0.1)))?;
        if round_ms < log_ms {
            bail!("--round must be at least the {} ms IOPS logging interval", log_ms);
        }
        let consistency_ms = secs_to_ms("consistency", a.consistency.unwrap_or(pick(1800.0, 10.0, 0.6)))?;
        let out = a.out.clone().unwrap_or_else(|| PathBuf::from(format!("zdisk-bench-{}", sys::unix_time())));
        let zdisk_bin = zdisk_bin(&a.zdisk_bin)?;
        Ok(Config {
            mode,
            size_bytes,
            zdisk_physical_bytes,
            targets,
            workloads,
            data,
            qds,
            runtime_ms,
            ramp_ms: match mode {
                Preset::Full => 5000,
                _ => 0,
            },
            round_ms,
            max_rounds: a.max_rounds.unwrap_or(pick(25.0, 6.0, 5.0) as u32),
            log_ms,
            consistency_ms,
            consistency_qd: 32,
            spare_pcts: vec![0, 25],
            fill_passes: a.fill_passes.unwrap_or(2),
            fill_qd: 32,
            purge_each_workload: mode == Preset::Full,
            precondition_reads: mode == Preset::Full,
            stat_interval_ms: pick(5000.0, 1000.0, 500.0) as u64,
            fresh_stats: mode != Preset::Smoke,
            dir: a.dir.clone(),
            out,
            zdisk_bin,
        })
    }
}

/// Runs the benchmark and writes the report directory.
pub fn run(args: &BenchArgs) -> Result<()> {
    let cfg = Config::resolve(args)?;
    runner::run(&cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoke_wins_over_quick_and_each_preset_picks_its_own_value() {
        assert_eq!(Preset::from_flags(false, false), Preset::Full);
        assert_eq!(Preset::from_flags(true, false), Preset::Quick);
        assert_eq!(Preset::from_flags(true, true), Preset::Smoke);
        let picks: Vec<u32> = [Preset::Full, Preset::Quick, Preset::Smoke].iter().map(|p| p.pick(1, 2, 3)).collect();
        assert_eq!(picks, [1, 2, 3]);
        assert_eq!(serde_json::to_string(&Preset::Quick).unwrap(), "\"quick\"", "report.json's spelling");
    }

    #[test]
    fn every_target_goes_first_in_turn() {
        for n in 1..=6 {
            let firsts: Vec<usize> = (0..n).map(|turn| target_order(n, turn)[0]).collect();
            assert_eq!(firsts, (0..n).collect::<Vec<_>>(), "{n} targets");
            for turn in 0..2 * n {
                let mut order = target_order(n, turn);
                order.sort_unstable();
                assert_eq!(order, (0..n).collect::<Vec<_>>(), "each pass runs every target once");
            }
        }
        assert!(target_order(0, 3).is_empty());
    }
}
