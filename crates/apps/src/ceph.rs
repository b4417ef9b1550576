//! `zdisk ceph report RUN_DIR`: the report of the Ceph case study (`scripts/ceph-demo.sh
//! bench`, docs/ceph.md). The script stands the clusters up and measures (it only glues
//! Ceph's, fio's and zdisk's commands together); this turns what it recorded — runs.jsonl, one
//! JSON object per case and round, and meta.json (host, configuration, command) — into
//! report.json (schema `zdisk-ceph/1`), summary.md and report.html, through the harness's
//! report writer (`zdisk_bench::writer`).
//!
//! Every ratio is taken between cases of the same round (side by side in time), then averaged
//! over the rounds (geometric mean). A value that cannot be computed (a missing workload, a
//! division by zero) is `null` in report.json and `—` in the pages; means leave such values
//! out. The fields and arithmetic are those of the jq scripts this replaced
//! (scripts/ceph-report.jq and ceph-summary.jq), so earlier reports compare with new ones.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use zdisk_bench::writer::write_report;

#[derive(Debug, clap::Args)]
pub struct CephArgs {
    #[command(subcommand)]
    pub command: CephCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum CephCommand {
    /// Write report.json, summary.md and report.html of a `scripts/ceph-demo.sh` run from the
    /// runs.jsonl and meta.json in its report directory.
    Report(ReportArgs),
}

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// The run's report directory (`--out` of the script): holds runs.jsonl and meta.json;
    /// the report is written next to them.
    #[arg(value_name = "RUN_DIR")]
    pub dir: PathBuf,
}

pub fn run(args: &CephArgs) -> Result<()> {
    match &args.command {
        CephCommand::Report(r) => write(&r.dir),
    }
}

/// The schema of report.json.
pub const SCHEMA: &str = "zdisk-ceph/1";

/// The zdisk cases and what they are compared with, in the report's order.
const ZDISK_CASES: [&str; 2] = ["zdisk", "zdisk-zstd1"];
const BASELINES: [&str; 3] = ["bluestore-zstd", "bluestore-lz4", "raw"];

// ---------------------------------------------------------------- what the script recorded

/// meta.json: the run as a whole.
#[derive(Debug, Deserialize)]
struct Meta {
    host: Value,
    load0: String,
    load1: String,
    cfg: Value,
    cmd: String,
    wall: serde_json::Number,
}

/// One line of runs.jsonl: one case in one round (`run_case` of the script).
#[derive(Debug, Deserialize)]
struct RunIn {
    round: i64,
    case: String,
    workloads: Vec<WorkloadIn>,
    space_after_write: Option<SpaceIn>,
}

/// One fio run and what was measured around it (`run_workload`).
#[derive(Debug, Deserialize)]
struct WorkloadIn {
    workload: String,
    write_bytes: Option<f64>,
    mb_per_s: Option<f64>,
    iops: Option<f64>,
    p99_us: Option<f64>,
    errors: Option<i64>,
    runtime_s: Option<f64>,
    wall_s: Option<f64>,
    cpu_s: Option<CpuGroups>,
    server_write_bytes: Option<f64>,
    zdisk_backing_write_bytes: Option<f64>,
    loadavg_before: Option<String>,
    loadavg_after: Option<String>,
}

/// CPU per process group: seconds in the runs, seconds per GB written in the report.
#[derive(Debug, Default, Clone, Copy, Serialize, Deserialize)]
struct CpuGroups {
    named: Option<f64>,
    host: Option<f64>,
    osd: Option<f64>,
    server: Option<f64>,
    transport: Option<f64>,
    client: Option<f64>,
    monmgr: Option<f64>,
    other: Option<f64>,
}

impl CpuGroups {
    /// Each group's value from `f`, which is given the group's field.
    fn map(f: impl Fn(fn(&CpuGroups) -> Option<f64>) -> Option<f64>) -> CpuGroups {
        CpuGroups {
            named: f(|c| c.named),
            host: f(|c| c.host),
            osd: f(|c| c.osd),
            server: f(|c| c.server),
            transport: f(|c| c.transport),
            client: f(|c| c.client),
            monmgr: f(|c| c.monmgr),
            other: f(|c| c.other),
        }
    }
}

/// `space_snapshot` after the write phase.
#[derive(Debug, Deserialize)]
struct SpaceIn {
    host_disk_bytes: Option<f64>,
    pool: Option<PoolIn>,
    #[serde(default)]
    bluestore: Vec<BluestoreIn>,
    bluestore_compressed_original: Option<f64>,
    bluestore_compressed_allocated: Option<f64>,
    zdisk: Option<ZdiskIn>,
}

#[derive(Debug, Deserialize)]
struct PoolIn {
    stored: Option<f64>,
    compress_bytes_used: Option<f64>,
    compress_under_bytes: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct BluestoreIn {
    bluestore_compressed: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct ZdiskIn {
    comp_ratio: Option<f64>,
    physical_size: Option<f64>,
}

/// The part of meta.json's `cfg` the report reads (all of it is copied into report.json).
#[derive(Debug, Deserialize)]
struct Config {
    cases: Vec<String>,
}

// ---------------------------------------------------------------- report.json

/// report.json.
#[derive(Debug, Serialize)]
pub struct Report {
    schema: &'static str,
    command: String,
    wall_s: serde_json::Number,
    config: Value,
    host: Value,
    loadavg_start: String,
    loadavg_end: String,
    /// Per case, the mean over its rounds, in the configuration's case order.
    cases: Vec<CaseMeans>,
    /// Each zdisk case against each baseline: same-round ratios, geometric mean.
    ratios: Vec<Ratio>,
    /// Issue 19's goals against BlueStore zstd force.
    goals: Vec<Goal>,
    /// The numbers compared, per run.
    per_round: Vec<Metrics>,
    /// runs.jsonl as it was.
    runs: Vec<Value>,
}

/// What the report compares, for one run.
#[derive(Debug, Clone, Serialize)]
struct Metrics {
    round: i64,
    case: String,
    write_mb_s: Option<f64>,
    read_mb_s: Option<f64>,
    randwrite_iops: Option<f64>,
    write_p99_us: Option<f64>,
    randwrite_p99_us: Option<f64>,
    fio_errors: i64,
    /// CPU seconds per GB the client wrote (the 128K write phase).
    cpu_s_per_gb: CpuGroups,
    /// Share of the host's cores busy during the write phase.
    cpu_busy_pct: Busy,
    randwrite_cpu_s_per_kio: Option<f64>,
    /// Bytes the device servers sent to the backing disk per byte the client wrote.
    backing_bytes_per_client_byte: Option<f64>,
    zdisk_backing_bytes_per_client_byte: Option<f64>,
    host_disk_bytes: Option<f64>,
    stored_bytes: Option<f64>,
    zdisk_comp_ratio: Option<f64>,
    zdisk_physical_size: Option<f64>,
    /// What BlueStore allocated for compressed blobs (4 KiB units) against the original bytes.
    bluestore_comp_ratio: Option<f64>,
    /// What BlueStore's compressor produced against the original bytes.
    bluestore_compressor_ratio: Option<f64>,
    pool_compress_under_bytes: Option<f64>,
    pool_compress_bytes_used: Option<f64>,
    /// Before the write phase, after the random-write phase.
    loadavg: [Option<String>; 2],
    /// 1 - host disk bytes / the same round's raw case's host disk bytes.
    space_saving: Option<f64>,
}

#[derive(Debug, Clone, Copy, Serialize)]
struct Busy {
    named: Option<f64>,
    host: Option<f64>,
}

/// The fields of each case in report.json's `cases` (schema `zdisk-ceph/1`): what the unit
/// tests and the Ceph smoke check the report against.
pub const CASE_MEAN_KEYS: [&str; 19] = [
    "case",
    "rounds",
    "write_mb_s",
    "read_mb_s",
    "randwrite_iops",
    "write_p99_us",
    "randwrite_p99_us",
    "cpu_s_per_gb",
    "cpu_busy_pct",
    "randwrite_cpu_s_per_kio",
    "backing_bytes_per_client_byte",
    "zdisk_backing_bytes_per_client_byte",
    "host_disk_bytes",
    "space_saving",
    "zdisk_comp_ratio",
    "zdisk_physical_size",
    "bluestore_comp_ratio",
    "bluestore_compressor_ratio",
    "fio_errors",
];

#[derive(Debug, Serialize)]
struct CaseMeans {
    case: String,
    rounds: usize,
    write_mb_s: Option<f64>,
    read_mb_s: Option<f64>,
    randwrite_iops: Option<f64>,
    write_p99_us: Option<f64>,
    randwrite_p99_us: Option<f64>,
    cpu_s_per_gb: CpuGroups,
    cpu_busy_pct: Busy,
    randwrite_cpu_s_per_kio: Option<f64>,
    backing_bytes_per_client_byte: Option<f64>,
    zdisk_backing_bytes_per_client_byte: Option<f64>,
    host_disk_bytes: Option<f64>,
    space_saving: Option<f64>,
    zdisk_comp_ratio: Option<f64>,
    zdisk_physical_size: Option<f64>,
    bluestore_comp_ratio: Option<f64>,
    bluestore_compressor_ratio: Option<f64>,
    fio_errors: Option<i64>,
}

/// Same-round ratios and their geometric mean.
#[derive(Debug, Serialize)]
struct Rel {
    mean: Option<f64>,
    per_round: Vec<Option<f64>>,
}

#[derive(Debug, Serialize)]
struct Ratio {
    zdisk: String,
    versus: String,
    write_bw: Rel,
    read_bw: Rel,
    randwrite_iops: Rel,
    cpu_per_gb_named: Rel,
    cpu_per_gb_host: Rel,
    space_saving: Rel,
}

#[derive(Debug, Serialize)]
struct Goal {
    zdisk: String,
    write_bw: BandwidthGoal,
    cpu_per_gb: CpuGoal,
    space_saving: SpaceGoal,
}

#[derive(Debug, Serialize)]
struct BandwidthGoal {
    goal: &'static str,
    value: Option<f64>,
    met: bool,
    fraction_of_goal: Option<f64>,
}

#[derive(Debug, Serialize)]
struct CpuGoal {
    goal: &'static str,
    value: Option<f64>,
    value_host_total: Option<f64>,
    met: bool,
    saving: Option<f64>,
}

#[derive(Debug, Serialize)]
struct SpaceGoal {
    goal: &'static str,
    value: Option<f64>,
    met: bool,
}

// ---------------------------------------------------------------- arithmetic

/// a / b, or nothing when either is missing or b is zero.
fn safe_div(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b != 0.0 => Some(a / b).filter(|q| q.is_finite()),
        _ => None,
    }
}

/// The mean of the values present, or nothing when none is.
fn mean(values: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let v: Vec<f64> = values.into_iter().flatten().collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// The geometric mean, or nothing when there are no values or one is missing or not positive.
fn gmean(values: &[Option<f64>]) -> Option<f64> {
    if values.is_empty() || values.iter().any(|v| !matches!(v, Some(x) if *x > 0.0)) {
        return None;
    }
    Some((values.iter().flatten().map(|v| v.ln()).sum::<f64>() / values.len() as f64).exp())
}

fn workload<'a>(run: &'a RunIn, name: &str) -> Option<&'a WorkloadIn> {
    run.workloads.iter().find(|w| w.workload == name)
}

fn metrics(run: &RunIn, cores: Option<f64>) -> Metrics {
    let w = workload(run, "128k-seqwrite");
    let r = workload(run, "128k-seqread");
    let rw = workload(run, "4k-randwrite");
    let gb = w.and_then(|w| w.write_bytes).map(|b| b / 1e9);
    let w_cpu = w.and_then(|w| w.cpu_s).unwrap_or_default();
    let busy = |cpu: Option<f64>| {
        safe_div(cpu.map(|c| 100.0 * c), w.and_then(|w| w.wall_s).zip(cores).map(|(wall, cores)| wall * cores))
    };
    let space = run.space_after_write.as_ref();
    let pool = space.and_then(|s| s.pool.as_ref());
    let zdisk = space.and_then(|s| s.zdisk.as_ref());
    let compressed = space.and_then(|s| {
        (!s.bluestore.is_empty()).then(|| s.bluestore.iter().map(|b| b.bluestore_compressed.unwrap_or(0.0)).sum())
    });
    Metrics {
        round: run.round,
        case: run.case.clone(),
        write_mb_s: w.and_then(|w| w.mb_per_s),
        read_mb_s: r.and_then(|r| r.mb_per_s),
        randwrite_iops: rw.and_then(|rw| rw.iops),
        write_p99_us: w.and_then(|w| w.p99_us),
        randwrite_p99_us: rw.and_then(|rw| rw.p99_us),
        fio_errors: [w, r, rw].iter().flatten().map(|x| x.errors.unwrap_or(0)).sum(),
        cpu_s_per_gb: CpuGroups::map(|group| safe_div(group(&w_cpu), gb)),
        cpu_busy_pct: Busy { named: busy(w_cpu.named), host: busy(w_cpu.host) },
        randwrite_cpu_s_per_kio: rw.and_then(|rw| {
            let kio = rw.iops.zip(rw.runtime_s).map(|(iops, secs)| iops * secs / 1000.0);
            safe_div(rw.cpu_s.and_then(|c| c.named), kio)
        }),
        backing_bytes_per_client_byte: w.and_then(|w| safe_div(w.server_write_bytes, w.write_bytes)),
        zdisk_backing_bytes_per_client_byte: w
            .filter(|w| w.zdisk_backing_write_bytes.is_some_and(|b| b > 0.0))
            .and_then(|w| safe_div(w.zdisk_backing_write_bytes, w.write_bytes)),
        host_disk_bytes: space.and_then(|s| s.host_disk_bytes),
        stored_bytes: pool.and_then(|p| p.stored),
        zdisk_comp_ratio: zdisk.and_then(|z| z.comp_ratio),
        zdisk_physical_size: zdisk.and_then(|z| z.physical_size),
        bluestore_comp_ratio: space
            .and_then(|s| safe_div(s.bluestore_compressed_original, s.bluestore_compressed_allocated)),
        bluestore_compressor_ratio: space.and_then(|s| safe_div(s.bluestore_compressed_original, compressed)),
        pool_compress_under_bytes: pool.and_then(|p| p.compress_under_bytes),
        pool_compress_bytes_used: pool.and_then(|p| p.compress_bytes_used),
        loadavg: [w.and_then(|w| w.loadavg_before.clone()), rw.and_then(|rw| rw.loadavg_after.clone())],
        space_saving: None,
    }
}

/// Every run, by round: ratios between two cases are taken within a round.
struct Rounds<'a> {
    runs: &'a [Metrics],
    rounds: Vec<i64>,
}

impl<'a> Rounds<'a> {
    fn new(runs: &'a [Metrics]) -> Rounds<'a> {
        let mut rounds: Vec<i64> = runs.iter().map(|m| m.round).collect();
        rounds.sort_unstable();
        rounds.dedup();
        Rounds { runs, rounds }
    }

    fn find(&self, round: i64, case: &str) -> Option<&'a Metrics> {
        self.runs.iter().find(|m| m.round == round && m.case == case)
    }

    /// f(a) / f(b) of every round that ran both cases.
    fn rel(&self, a: &str, b: &str, f: impl Fn(&Metrics) -> Option<f64>) -> Vec<Option<f64>> {
        self.rounds.iter().filter_map(|&r| Some(safe_div(f(self.find(r, a)?), f(self.find(r, b)?)))).collect()
    }

    fn summary(&self, a: &str, b: &str, f: impl Fn(&Metrics) -> Option<f64>) -> Rel {
        let per_round = self.rel(a, b, f);
        Rel { mean: gmean(&per_round), per_round }
    }
}

fn case_means(case: &str, all: &[Metrics]) -> CaseMeans {
    let rs: Vec<&Metrics> = all.iter().filter(|m| m.case == case).collect();
    let m = |f: fn(&Metrics) -> Option<f64>| mean(rs.iter().map(|x| f(x)));
    CaseMeans {
        case: case.to_string(),
        rounds: rs.len(),
        write_mb_s: m(|x| x.write_mb_s),
        read_mb_s: m(|x| x.read_mb_s),
        randwrite_iops: m(|x| x.randwrite_iops),
        write_p99_us: m(|x| x.write_p99_us),
        randwrite_p99_us: m(|x| x.randwrite_p99_us),
        cpu_s_per_gb: CpuGroups::map(|group| mean(rs.iter().map(|x| group(&x.cpu_s_per_gb)))),
        cpu_busy_pct: Busy { named: m(|x| x.cpu_busy_pct.named), host: m(|x| x.cpu_busy_pct.host) },
        randwrite_cpu_s_per_kio: m(|x| x.randwrite_cpu_s_per_kio),
        backing_bytes_per_client_byte: m(|x| x.backing_bytes_per_client_byte),
        zdisk_backing_bytes_per_client_byte: m(|x| x.zdisk_backing_bytes_per_client_byte),
        host_disk_bytes: m(|x| x.host_disk_bytes),
        space_saving: m(|x| x.space_saving),
        zdisk_comp_ratio: m(|x| x.zdisk_comp_ratio),
        zdisk_physical_size: m(|x| x.zdisk_physical_size),
        bluestore_comp_ratio: m(|x| x.bluestore_comp_ratio),
        bluestore_compressor_ratio: m(|x| x.bluestore_compressor_ratio),
        fio_errors: (!rs.is_empty()).then(|| rs.iter().map(|x| x.fio_errors).sum()),
    }
}

fn goal(z: &str, rounds: &Rounds) -> Goal {
    let versus = "bluestore-zstd";
    let bw = gmean(&rounds.rel(z, versus, |m| m.write_mb_s));
    let cpu = gmean(&rounds.rel(z, versus, |m| m.cpu_s_per_gb.named));
    let cpu_host = gmean(&rounds.rel(z, versus, |m| m.cpu_s_per_gb.host));
    let space = gmean(&rounds.rel(z, versus, |m| m.space_saving));
    Goal {
        zdisk: z.to_string(),
        write_bw: BandwidthGoal {
            goal: ">= 1.2x BlueStore zstd force",
            value: bw,
            met: bw.is_some_and(|v| v >= 1.2),
            fraction_of_goal: safe_div(bw, Some(1.2)),
        },
        cpu_per_gb: CpuGoal {
            goal: "<= 0.75x BlueStore zstd force (25% less)",
            value: cpu,
            value_host_total: cpu_host,
            met: cpu.is_some_and(|v| v <= 0.75),
            saving: cpu.map(|v| 1.0 - v),
        },
        space_saving: SpaceGoal {
            goal: ">= 0.85x BlueStore zstd's saving (within 15%)",
            value: space,
            met: space.is_some_and(|v| v >= 0.85),
        },
    }
}

/// Reads RUN_DIR/runs.jsonl and RUN_DIR/meta.json into the report.
pub fn read(dir: &Path) -> Result<Report> {
    let meta_path = dir.join("meta.json");
    let meta: Meta = serde_json::from_str(
        &fs::read_to_string(&meta_path).with_context(|| format!("reading {}", meta_path.display()))?,
    )
    .with_context(|| format!("{}: not the meta.json of a scripts/ceph-demo.sh run", meta_path.display()))?;
    let config: Config = serde_json::from_value(meta.cfg.clone())
        .with_context(|| format!("{}: cfg has no list of cases", meta_path.display()))?;
    let runs_path = dir.join("runs.jsonl");
    let text = fs::read_to_string(&runs_path).with_context(|| format!("reading {}", runs_path.display()))?;
    let mut raw = Vec::new();
    let mut runs = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = || format!("{} line {}", runs_path.display(), i + 1);
        let value: Value = serde_json::from_str(line).with_context(|| format!("{}: not JSON", at()))?;
        let run: RunIn = serde_json::from_value(value.clone())
            .with_context(|| format!("{}: not a run of scripts/ceph-demo.sh (round, case, workloads)", at()))?;
        raw.push(value);
        runs.push(run);
    }
    if runs.is_empty() {
        bail!("{} holds no runs", runs_path.display());
    }
    Ok(build(meta, config, &runs, raw))
}

fn build(meta: Meta, config: Config, runs: &[RunIn], raw: Vec<Value>) -> Report {
    let cores = meta.host.get("cores").and_then(Value::as_f64);
    let mut per_round: Vec<Metrics> = runs.iter().map(|r| metrics(r, cores)).collect();
    // the same round's raw (uncompressed) footprint is the reference for space saved
    let savings: Vec<Option<f64>> = per_round
        .iter()
        .map(|m| {
            let raw = per_round.iter().find(|x| x.round == m.round && x.case == "raw")?;
            safe_div(m.host_disk_bytes, raw.host_disk_bytes).map(|q| 1.0 - q)
        })
        .collect();
    for (m, s) in per_round.iter_mut().zip(savings) {
        m.space_saving = s;
    }
    let rounds = Rounds::new(&per_round);
    let has = |c: &str| config.cases.iter().any(|x| x == c);
    let mut ratios = Vec::new();
    for z in ZDISK_CASES.into_iter().filter(|z| has(z)) {
        for b in BASELINES.into_iter().filter(|b| has(b)) {
            ratios.push(Ratio {
                zdisk: z.to_string(),
                versus: b.to_string(),
                write_bw: rounds.summary(z, b, |m| m.write_mb_s),
                read_bw: rounds.summary(z, b, |m| m.read_mb_s),
                randwrite_iops: rounds.summary(z, b, |m| m.randwrite_iops),
                cpu_per_gb_named: rounds.summary(z, b, |m| m.cpu_s_per_gb.named),
                cpu_per_gb_host: rounds.summary(z, b, |m| m.cpu_s_per_gb.host),
                space_saving: rounds.summary(z, b, |m| m.space_saving),
            });
        }
    }
    let goals = if has("bluestore-zstd") {
        ZDISK_CASES.into_iter().filter(|z| has(z)).map(|z| goal(z, &rounds)).collect()
    } else {
        Vec::new()
    };
    let cases = config.cases.iter().map(|c| case_means(c, &per_round)).collect();
    Report {
        schema: SCHEMA,
        command: meta.cmd,
        wall_s: meta.wall,
        config: meta.cfg,
        host: meta.host,
        loadavg_start: meta.load0,
        loadavg_end: meta.load1,
        cases,
        ratios,
        goals,
        per_round,
        runs: raw,
    }
}

/// `zdisk ceph report RUN_DIR`: report.json, summary.md and report.html in RUN_DIR.
pub fn write(dir: &Path) -> Result<()> {
    let report = read(dir)?;
    write_report(dir, &report, || Ok(pages::render(&report)))
}

mod pages;

#[cfg(test)]
mod tests;
