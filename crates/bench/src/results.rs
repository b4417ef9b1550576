//! What a run records: the host, each target, every fio job's result and cost, fills,
//! preconditioning and consistency runs, and the report that holds them. Rendering lives
//! in `report` (text) and `charts` (SVG), which both read this model.

use std::fs;
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use crate::corpus::CorpusSummary;
use crate::plan::{DataMode, TargetKind, WorkloadKind};
use crate::steady::Window;
use crate::Config;

#[derive(Clone, Debug, Default, Serialize)]
pub struct Host {
    pub kernel: String,
    pub cpu_model: String,
    pub cpus: usize,
    pub mem_total_bytes: u64,
    pub backing_dir: String,
    pub backing_fs: String,
    pub fio: String,
    pub nbdkit: String,
    pub qemu_nbd: String,
    /// /proc/loadavg at the start and end: a busy machine makes every number noisier.
    pub loadavg_start: String,
    pub loadavg_end: String,
}

impl Host {
    pub fn probe(backing: &Path) -> Host {
        let meminfo = fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let backing_fs = fs::read_to_string("/proc/mounts")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.len() > 2 && backing.starts_with(f[1]))
                    .then(|| (f[1].len(), format!("{} on {} ({})", f[0], f[1], f[2])))
            })
            .max()
            .map(|(_, s)| s)
            .unwrap_or_default();
        Host {
            kernel: crate::sys::kernel_release(),
            cpu_model: crate::sys::cpu_model(),
            cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            mem_total_bytes: meminfo
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|s| s.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kb| kb * 1024)
                .unwrap_or(0),
            backing_dir: backing.display().to_string(),
            backing_fs,
            fio: crate::sys::tool_version("fio"),
            nbdkit: crate::sys::tool_version("nbdkit"),
            qemu_nbd: crate::sys::tool_version("qemu-nbd"),
            loadavg_start: crate::sys::loadavg(),
            loadavg_end: String::new(),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct TargetInfo {
    pub key: TargetKind,
    pub title: &'static str,
    pub description: &'static str,
    pub o_direct: bool,
}

/// One `zdisk stat --json` sample, for the ratio / write-amplification timeline.
#[derive(Clone, Debug, Serialize)]
pub struct StatSample {
    pub t_s: f64,
    pub data: DataMode,
    pub phase: String,
    /// Increments at every `zdisk format`, so charts do not join unrelated stores.
    pub format_gen: u32,
    pub comp_ratio: Option<f64>,
    pub write_amplification: Option<f64>,
    pub host_write_bytes: Option<f64>,
    pub backing_write_bytes: Option<f64>,
    pub free_space: Option<f64>,
    pub physical_size: Option<f64>,
    pub logical_size: Option<f64>,
    pub space_flag: Option<f64>,
}

impl StatSample {
    pub fn from_stat(t_s: f64, data: DataMode, phase: &str, format_gen: u32, v: &Value) -> Self {
        let f = |k: &str| v.get(k).and_then(Value::as_f64);
        StatSample {
            t_s,
            data,
            phase: phase.to_string(),
            format_gen,
            comp_ratio: f("comp_ratio"),
            write_amplification: f("write_amplification"),
            host_write_bytes: f("host_write_bytes"),
            backing_write_bytes: f("backing_write_bytes"),
            free_space: f("free_space"),
            physical_size: f("physical_size"),
            logical_size: f("logical_size"),
            space_flag: f("space_flag"),
        }
    }
}

/// Server-side cost and zdisk statistics measured around one fio job.
#[derive(Clone, Debug, Default, Serialize)]
pub struct JobCost {
    /// CPU seconds of the server process tree during the job.
    pub server_cpu_s: f64,
    pub gib_moved: f64,
    pub server_cpu_s_per_gib: Option<f64>,
    /// fio's own CPU use (percent of one core), the client side.
    pub client_cpu_pct: f64,
    /// Bytes the server tree sent to storage (/proc/PID/io write_bytes) per byte fio wrote:
    /// the OS's view of write amplification, comparable across all targets.
    pub os_write_amplification: Option<f64>,
    /// zdisk only: comp_ratio after the job.
    pub comp_ratio: Option<f64>,
    /// zdisk only: cumulative write amplification since format, after the job.
    pub write_amplification: Option<f64>,
    /// zdisk only: backing bytes / host bytes written during this job alone.
    pub job_write_amplification: Option<f64>,
    /// zdisk only: the full `zdisk stat --json` object after the job.
    pub zdisk_stat: Option<Value>,
}

/// One measured point: workload x target x data x queue depth.
#[derive(Clone, Debug, Serialize)]
pub struct JobResult {
    pub data: DataMode,
    pub workload: WorkloadKind,
    pub workload_title: &'static str,
    pub target: TargetKind,
    pub qd: u32,
    pub iops: f64,
    pub read_iops: f64,
    pub write_iops: f64,
    pub mb_per_s: f64,
    /// The worse of the read and write 99th percentile completion latency.
    pub p99_us: Option<f64>,
    pub read_p99_us: Option<f64>,
    pub write_p99_us: Option<f64>,
    pub read_p50_us: Option<f64>,
    pub write_p50_us: Option<f64>,
    pub mean_lat_us: Option<f64>,
    pub runtime_s: f64,
    pub cost: JobCost,
    pub iops_per_interval: Vec<f64>,
    pub interval_ms: u64,
    pub fio_json: String,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct FillRecord {
    pub data: DataMode,
    pub target: TargetKind,
    pub phase: String,
    pub range_bytes: u64,
    pub passes: u32,
    pub tool: String,
    pub secs: f64,
    pub mb_per_s: f64,
    pub cost: JobCost,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct PreconditionRecord {
    pub data: DataMode,
    pub workload: WorkloadKind,
    pub target: TargetKind,
    pub qd: u32,
    pub round_ms: u64,
    pub rounds_run: u32,
    /// Mean IOPS of each round (the tracked metric).
    pub round_iops: Vec<f64>,
    pub iops_per_interval: Vec<f64>,
    pub interval_ms: u64,
    pub steady_state_reached: bool,
    /// "steady state reached at round N" or "steady state not reached (limit N rounds)".
    pub verdict: String,
    pub window: Option<Window>,
    pub cost: JobCost,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ConsistencyRecord {
    pub data: DataMode,
    pub target: TargetKind,
    /// Extra spare area: 25 means only 75% of the space is exposed (zdisk: smaller logical
    /// size; raw: a smaller range of the file).
    pub spare_pct: u32,
    pub range_bytes: u64,
    pub qd: u32,
    pub iops_per_interval: Vec<f64>,
    pub interval_ms: u64,
    pub mean_iops: f64,
    pub min_iops: f64,
    pub max_iops: f64,
    /// Standard deviation / mean of the per-interval IOPS: lower is more consistent.
    pub cov: f64,
    pub cost: JobCost,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct DataSummary {
    pub data: DataMode,
    /// zdisk comp_ratio at the end of this data mode's main runs.
    pub comp_ratio: Option<f64>,
    /// Geometric mean over every (workload, QD) of zdisk IOPS / raw IOPS.
    pub perf_multiplier: Option<f64>,
    pub pairs: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub schema: &'static str,
    pub command: String,
    pub started_unix_s: u64,
    pub wall_s: f64,
    /// zdisk comp_ratio for the 2:1 data (a TCO tool reads this key).
    pub comp_ratio: Option<f64>,
    /// zdisk / raw (qemu-nbd, O_DIRECT) IOPS, geometric mean over all 2:1 points (a TCO tool
    /// reads this key).
    pub perf_multiplier: Option<f64>,
    pub headline_basis: String,
    pub by_data: Vec<DataSummary>,
    pub host: Host,
    pub config: Config,
    pub targets: Vec<TargetInfo>,
    pub corpus: Option<CorpusSummary>,
    pub fills: Vec<FillRecord>,
    pub preconditioning: Vec<PreconditionRecord>,
    pub results: Vec<JobResult>,
    pub consistency: Vec<ConsistencyRecord>,
    pub zdisk_timeline: Vec<StatSample>,
    pub notes: Vec<String>,
    pub errors: Vec<String>,
}

pub fn fmt_int(v: f64) -> String {
    let n = v.round() as i64;
    let digits = n.abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}
