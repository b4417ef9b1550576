//! What `zdisk db bench` measures and reports: the configurations (stack and torn-page
//! guard), the workloads, the settings each preset scales from the whitepaper, and the
//! report's records. `bench` (the run) and `report` (the rendering) both read these; neither
//! imports the other's records back (bench → report → plan, bench → plan).

use anyhow::{bail, Result};
use serde::Serialize;
use zdisk_bench::sys::{CpuTimes, DiskStat};

use crate::corpus;
use crate::db::{Db, LoadResult};
use crate::{BenchArgs, Preset};

/// One measured configuration: a storage stack and the torn-page guard setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ConfigKey {
    /// zdisk (zdisk attach), doublewrite / full_page_writes OFF: what zdisk's atomic writes allow.
    ZdiskNodw,
    /// zdisk, doublewrite / full_page_writes ON.
    ZdiskDw,
    /// The same disk raw through the same transport (qemu-nbd + nbdfuse + loop), guard ON.
    RawDw,
    /// Raw, guard OFF: UNSAFE on a disk without atomic page writes; reference only.
    RawNodw,
    /// Raw with InnoDB table compression (ROW_FORMAT=COMPRESSED, zlib), doublewrite ON (MySQL).
    RawZlib,
    /// The raw file on a loop device directly (no NBD), guard ON: the transport's cost.
    LoopDw,
}

impl ConfigKey {
    pub fn key(self) -> &'static str {
        match self {
            ConfigKey::ZdiskNodw => "zdisk-nodw",
            ConfigKey::ZdiskDw => "zdisk-dw",
            ConfigKey::RawDw => "raw-dw",
            ConfigKey::RawNodw => "raw-nodw",
            ConfigKey::RawZlib => "raw-zlib",
            ConfigKey::LoopDw => "loop-dw",
        }
    }

    pub fn label(self, db: Db) -> String {
        let g = match db {
            Db::Mysql => "doublewrite",
            Db::Postgres => "full_page_writes",
        };
        match self {
            ConfigKey::ZdiskNodw => format!("zdisk, {g} off"),
            ConfigKey::ZdiskDw => format!("zdisk, {g} on"),
            ConfigKey::RawDw => format!("raw (NBD), {g} on"),
            ConfigKey::RawNodw => format!("raw (NBD), {g} off — UNSAFE"),
            ConfigKey::RawZlib => "raw (NBD), InnoDB zlib compression".into(),
            ConfigKey::LoopDw => format!("raw (loop, no NBD), {g} on"),
        }
    }

    pub(crate) fn stack(self) -> StackKind {
        match self {
            ConfigKey::ZdiskNodw | ConfigKey::ZdiskDw => StackKind::Zdisk,
            ConfigKey::RawDw | ConfigKey::RawNodw => StackKind::Raw,
            ConfigKey::RawZlib => StackKind::RawZlib,
            ConfigKey::LoopDw => StackKind::Loop,
        }
    }

    pub(crate) fn guard(self) -> bool {
        !matches!(self, ConfigKey::ZdiskNodw | ConfigKey::RawNodw)
    }

    pub fn all() -> Vec<ConfigKey> {
        vec![
            ConfigKey::ZdiskNodw,
            ConfigKey::ZdiskDw,
            ConfigKey::RawDw,
            ConfigKey::RawNodw,
            ConfigKey::RawZlib,
            ConfigKey::LoopDw,
        ]
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// sysbench oltp_read_write on the modified schema.
    ReadWrite,
    /// sysbench oltp_write_only on the modified schema.
    WriteOnly,
    /// sysbench oltp_read_only on the modified schema.
    ReadOnly,
    /// pgbench's TPC-B-like script (PostgreSQL only).
    Pgbench,
}

impl Workload {
    pub fn key(self) -> &'static str {
        match self {
            Workload::ReadWrite => "read_write",
            Workload::WriteOnly => "write_only",
            Workload::ReadOnly => "read_only",
            Workload::Pgbench => "pgbench",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum StackKind {
    Zdisk,
    Raw,
    RawZlib,
    Loop,
}

impl StackKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            StackKind::Zdisk => "zdisk",
            StackKind::Raw => "raw",
            StackKind::RawZlib => "raw-zlib",
            StackKind::Loop => "loop",
        }
    }
}

/// Every setting of the run after presets (recorded in report.json).
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    pub db: Db,
    pub preset: Preset,
    pub configs: Vec<ConfigKey>,
    pub workloads: Vec<Workload>,
    pub threads: Vec<u32>,
    pub time_s: u32,
    pub warmup_s: u32,
    pub rounds: u32,
    pub tables: u32,
    pub table_size: u64,
    pub pgbench_scale: u32,
    pub buffer_pool: u64,
    pub log_file_size: u64,
    pub fs_size: u64,
    pub zdisk_format_args: Vec<String>,
    pub ratio_codecs: Vec<String>,
    pub rand_type: String,
    pub mount_options: String,
    /// The storage servers' disk bandwidth cap, MB/s each way (`--disk-mbps`).
    pub disk_mbps: Option<u32>,
    /// Options of the zdisk targets' servers (`--serve-options`).
    pub serve_options: Vec<String>,
}

pub fn settings(a: &BenchArgs) -> Result<Settings> {
    let p = a.preset();
    let mut configs = a.configs.clone().unwrap_or_else(|| match p {
        Preset::Smoke => vec![ConfigKey::ZdiskNodw, ConfigKey::RawDw],
        _ => ConfigKey::all(),
    });
    if a.db == Db::Postgres {
        if configs.contains(&ConfigKey::RawZlib) && a.configs.is_some() {
            bail!("raw-zlib is InnoDB's compression; PostgreSQL has no table compression for rows this small");
        }
        configs.retain(|c| *c != ConfigKey::RawZlib);
    }
    configs.sort();
    configs.dedup();
    let workloads = a.workloads.clone().unwrap_or_else(|| match (p, a.db) {
        (Preset::Smoke, Db::Mysql) => vec![Workload::ReadWrite],
        (Preset::Smoke, Db::Postgres) => vec![Workload::Pgbench],
        (_, Db::Mysql) => vec![Workload::ReadWrite, Workload::WriteOnly, Workload::ReadOnly],
        (_, Db::Postgres) => vec![Workload::ReadWrite, Workload::WriteOnly, Workload::ReadOnly, Workload::Pgbench],
    });
    if a.db == Db::Mysql && workloads.contains(&Workload::Pgbench) {
        bail!("the pgbench workload needs --db postgres");
    }
    let s = Settings {
        db: a.db,
        preset: p,
        configs,
        workloads,
        threads: a.threads.clone().unwrap_or_else(|| p.pick(vec![1, 4, 16, 64], vec![4, 16], vec![4])),
        time_s: a.time.unwrap_or(p.pick(60, 15, 3)),
        warmup_s: a.warmup.unwrap_or(p.pick(15, 5, 1)),
        rounds: a.rounds.unwrap_or(p.pick(2, 1, 1)),
        tables: a.tables.unwrap_or(p.pick(8, 4, 2)),
        table_size: a.table_size.unwrap_or(p.pick(500_000, 60_000, 2_000)),
        pgbench_scale: a.pgbench_scale.unwrap_or(p.pick(100, 10, 2)),
        buffer_pool: a.buffer_pool.unwrap_or(p.pick(256 << 20, 32 << 20, 16 << 20)),
        log_file_size: a.log_file_size.unwrap_or(p.pick(512 << 20, 128 << 20, 48 << 20)),
        fs_size: a.fs_size.unwrap_or(p.pick(12 << 30, 3 << 30, 1 << 30)),
        zdisk_format_args: a.zdisk_codec.iter().flat_map(|c| ["--codec".to_string(), c.clone()]).collect(),
        ratio_codecs: a.ratio_codecs.clone().unwrap_or_else(|| {
            p.pick(vec!["lz4", "zstd:1", "deflate:6"], vec!["lz4", "zstd:1", "deflate:6"], vec!["zstd:1"])
                .into_iter()
                .map(String::from)
                .collect()
        }),
        rand_type: a.rand_type.clone(),
        mount_options: a.mount_options.clone(),
        disk_mbps: a.disk_mbps,
        serve_options: crate::serve_options(&a.serve_options),
    };
    if s.threads.is_empty() || s.threads.contains(&0) || s.time_s == 0 || s.rounds == 0 {
        bail!("--threads must list counts >= 1, --time and --rounds must be >= 1");
    }
    if s.configs.is_empty() || s.workloads.is_empty() {
        bail!("nothing to run: --configs and --workloads must not be empty");
    }
    if s.disk_mbps.is_some() && s.configs.contains(&ConfigKey::LoopDw) {
        bail!("--disk-mbps caps the storage servers, and loop-dw has none: leave loop-dw out of --configs");
    }
    Ok(s)
}

/// CPU seconds of each part during a measured run, and per transaction.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CpuSplit {
    pub db_s: f64,
    pub server_s: f64,
    pub nbdfuse_s: f64,
    pub client_s: f64,
    /// Kernel threads (loop workers, kworkers) plus interrupt and softirq time: the kernel's
    /// share of the transport.
    pub kernel_s: f64,
    /// Busy CPU not accounted above: other users of the machine (noise), short-lived threads.
    pub other_s: f64,
    pub busy_s: f64,
    pub wall_s: f64,
    pub machine: CpuTimes,
    pub busy_pct: f64,
    pub iowait_pct: f64,
    pub idle_pct: f64,
    /// Milliseconds of CPU per transaction: database, storage server, transport (nbdfuse +
    /// kernel threads + interrupts), load generator, and their sum (other users excluded).
    pub db_ms_per_txn: f64,
    pub server_ms_per_txn: f64,
    pub transport_ms_per_txn: f64,
    pub client_ms_per_txn: f64,
    pub total_ms_per_txn: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Point {
    pub round: u32,
    pub config: ConfigKey,
    pub workload: Workload,
    pub threads: u32,
    pub load: LoadResult,
    pub cpu: CpuSplit,
    /// The block device the filesystem is on (the loop device).
    pub device: DiskStat,
    pub device_util_pct: f64,
    /// Bytes the storage server (zdisk or qemu-nbd) read and wrote on its backing file.
    pub server_read_bytes: u64,
    pub server_write_bytes: u64,
    pub device_write_kib_per_txn: f64,
    pub device_read_kib_per_txn: f64,
    pub server_write_kib_per_txn: f64,
    /// "cpu", "io" or "mixed": see docs/apps.md.
    pub bound: String,
    pub loadavg_before: String,
    pub loadavg_after: String,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Capacity {
    pub stack: String,
    pub phase: String,
    /// Sum of the database files' sizes (what the database occupies logically).
    pub db_files_bytes: u64,
    pub db_files_allocated_bytes: u64,
    /// Used blocks of the ext4 filesystem.
    pub fs_used_bytes: u64,
    /// Bytes the backing file takes on the host disk: the raw image's allocated blocks, or
    /// zdisk's physical_size (the store file is preallocated; physical_size is what is used).
    pub backing_used_bytes: u64,
    pub zdisk: Option<serde_json::Value>,
    /// zdisk's ratio over what was written after mkfs (the database files, not ext4's zeroed
    /// inode tables and journal): Δlogical_size / Δphysical_size since the empty filesystem.
    pub zdisk_data_comp_ratio: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct CodecRatio {
    pub codec: String,
    /// Over the database files only (Δ since the empty filesystem).
    pub data_comp_ratio: f64,
    /// zdisk's own comp_ratio of the whole device (ext4's zeroed metadata included).
    pub comp_ratio: f64,
    pub physical_size: u64,
    pub logical_size: u64,
    pub db_files_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub schema: &'static str,
    pub command: String,
    pub settings: Settings,
    pub host: serde_json::Value,
    pub loaded_rows: u64,
    pub text_lines: usize,
    pub points: Vec<Point>,
    pub capacity: Vec<Capacity>,
    pub codec_ratios: Vec<CodecRatio>,
    pub offline: Option<corpus::OfflineRatios>,
    pub loop_dio: Vec<(String, bool)>,
    pub notes: Vec<String>,
    pub errors: Vec<String>,
    pub wall_s: f64,
}
