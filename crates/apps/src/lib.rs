//! `zdisk db`: real databases on zdisk — the Percona whitepaper's method (seeds/003) as a tool,
//! and the power-cut test that makes doublewrite-off (full_page_writes off) safe to advise.
//!
//! - `zdisk db tools [mysql|postgres]` — what is installed, what is missing (with packages);
//! - `zdisk db bench mysql|postgres` — MariaDB + sysbench (and PostgreSQL + pgbench) on zdisk
//!   attached as a block device vs the same disk raw through the same transport, raw with
//!   InnoDB compression, and raw on a plain loop device; Markdown, HTML and JSON report;
//! - `zdisk db powercut mysql|postgres` — SIGKILL of zdisk's server and the database together
//!   during a write-heavy load, recovery, and a check of every page.
//!
//! And `zdisk ceph report`: the report of the Ceph case study (`scripts/ceph-demo.sh`,
//! docs/ceph.md) from what the script recorded.
//!
//! See docs/apps.md.

mod bench;
pub mod ceph;
mod corpus;
mod db;
mod plan;
mod powercut;
mod report;
mod stack;
mod throttle;

use std::path::PathBuf;

use anyhow::Result;
use zdisk_bench::sys;
pub use zdisk_bench::Preset;

pub use ceph::CephArgs;
pub use db::Db;
pub use plan::{ConfigKey, Workload};

#[derive(Debug, clap::Args)]
pub struct DbArgs {
    #[command(subcommand)]
    pub command: DbCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum DbCommand {
    /// List the tools each database run needs, and the Debian package of each missing one.
    Tools(ToolsArgs),
    /// Benchmark a real database on zdisk against the raw disk (the whitepaper's method).
    #[command(after_help = "Presets: --smoke (CI, under a minute: tiny data, 2 targets, one point), \
--quick (minutes: ~250 MB of data vs a 32 MB buffer pool, every target, 4 and 16 threads, 15 s points), \
default (hours: ~2.5 GB vs 256 MB, threads 1,4,16,64, 60 s points, 2 rounds). \
Targets (--configs): zdisk-nodw, zdisk-dw, raw-dw, raw-nodw (UNSAFE, reference), raw-zlib (MySQL), loop-dw. \
For PostgreSQL 'dw' means full_page_writes. Needs root. See docs/apps.md.")]
    Bench(Box<BenchArgs>),
    /// Power-cut test: kill zdisk's server and the database together under load, recover, check
    /// every page.
    Powercut(PowercutArgs),
}

#[derive(Debug, clap::Args)]
pub struct ToolsArgs {
    /// Only this database's tools (default: both).
    #[arg(value_enum)]
    pub db: Option<Db>,
}

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// The database: mysql (MariaDB + sysbench) or postgres (PostgreSQL + pgbench + sysbench).
    #[arg(value_enum)]
    pub db: Db,

    /// Minutes on a 2-core box: a data set ~8x the buffer pool, every target, 4 and 16 threads.
    #[arg(long, conflicts_with = "smoke")]
    pub quick: bool,

    /// CI: a tiny data set, zdisk-nodw vs raw-dw, one short point. Checks the tool, not speed.
    #[arg(long)]
    pub smoke: bool,

    /// Directory for the stores, images and mounts (must allow O_DIRECT). Default $TMPDIR.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,

    /// Report directory. Default ./zdisk-db-<db>-<unix time>.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,

    /// Targets, comma-separated (see below). Default: all.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "LIST")]
    pub configs: Option<Vec<ConfigKey>>,

    /// Workloads, comma-separated: read-write, write-only, read-only, pgbench (PostgreSQL).
    #[arg(long, value_enum, value_delimiter = ',', value_name = "LIST")]
    pub workloads: Option<Vec<Workload>>,

    /// Client thread counts, comma-separated. Default 1,4,16,64 (quick 4,16; smoke 4).
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub threads: Option<Vec<u32>>,

    /// Measured seconds per point. Default 60 (quick 15, smoke 3).
    #[arg(long, value_name = "SECONDS")]
    pub time: Option<u32>,

    /// Warm-up seconds before each point, discarded. Default 15 (quick 5, smoke 1).
    #[arg(long, value_name = "SECONDS")]
    pub warmup: Option<u32>,

    /// Rounds over every target; the target order rotates between workloads and rounds.
    /// Default 2 (quick and smoke 1).
    #[arg(long, value_name = "N")]
    pub rounds: Option<u32>,

    /// sysbench tables. Default 8 (quick 4, smoke 2).
    #[arg(long, value_name = "N")]
    pub tables: Option<u32>,

    /// Rows per sysbench table (~600 bytes each with the text columns). Default 500000
    /// (quick 60000, smoke 2000).
    #[arg(long, value_name = "ROWS")]
    pub table_size: Option<u64>,

    /// pgbench scale factor (PostgreSQL). Default 100 (quick 10, smoke 2).
    #[arg(long, value_name = "N")]
    pub pgbench_scale: Option<u32>,

    /// InnoDB buffer pool / PostgreSQL shared_buffers. Default 256M (quick 32M, smoke 16M).
    #[arg(long, value_parser = zdisk_bench::size::parse_nonzero_bytes, value_name = "SIZE")]
    pub buffer_pool: Option<u64>,

    /// InnoDB redo log size / PostgreSQL max_wal_size. Default 512M (quick 128M, smoke 48M).
    #[arg(long, value_parser = zdisk_bench::size::parse_nonzero_bytes, value_name = "SIZE")]
    pub log_file_size: Option<u64>,

    /// Size of each target's filesystem (zdisk logical = physical = raw image size).
    /// Default 12G (quick 3G, smoke 1G).
    #[arg(long, value_parser = zdisk_bench::size::parse_nonzero_bytes, value_name = "SIZE")]
    pub fs_size: Option<u64>,

    /// Codec of the benchmarked zdisk store (zdisk format --codec). Default: zdisk's default.
    #[arg(long, value_parser = codec_name, value_name = "CODEC")]
    pub zdisk_codec: Option<String>,

    /// Codecs whose comp_ratio is measured on the final database files (a fresh store each).
    /// Default lz4,zstd:1,deflate:6 (smoke zstd:1).
    #[arg(long, value_delimiter = ',', value_parser = codec_name, value_name = "LIST")]
    pub ratio_codecs: Option<Vec<String>>,

    /// sysbench --rand-type (uniform spreads reads over the whole data set).
    #[arg(long, default_value = "uniform", value_name = "TYPE")]
    pub rand_type: String,

    /// ext4 mount options.
    #[arg(long, default_value = "noatime", value_name = "OPTS")]
    pub mount_options: String,

    /// Cap the storage servers' reads and writes to the work directory's disk at this many
    /// MB/s each way (cgroup v1 blkio throttle), for a bandwidth-bound comparison like the
    /// whitepaper's drives: zdisk serve and qemu-nbd get the same cap, applied after the
    /// data set is copied in. Not with loop-dw (its I/O has no server process to cap).
    #[arg(long, value_name = "MBPS", value_parser = clap::value_parser!(u32).range(1..))]
    pub disk_mbps: Option<u32>,

    /// Options for the zdisk server of each zdisk target, as one string (e.g.
    /// "--write-behind 1M --cache 512M"; see `zdisk serve --help`): the store is attached
    /// with `zdisk attach --fuse STORE -- OPTIONS`. Default: the server's defaults.
    #[arg(long, value_name = "OPTIONS", allow_hyphen_values = true)]
    pub serve_options: Option<String>,

    /// Keep the work directory (stores, images, logs, sysbench output) afterwards.
    #[arg(long)]
    pub keep: bool,

    /// The zdisk binary (default: this executable).
    #[arg(long, hide = true, value_name = "PATH")]
    pub zdisk_bin: Option<PathBuf>,
}

impl BenchArgs {
    pub fn preset(&self) -> Preset {
        Preset::from_flags(self.quick, self.smoke)
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct PowercutArgs {
    /// The database: mysql (innochecksum + CHECK TABLE) or postgres (data checksums;
    /// pg_checksums + pg_amcheck).
    #[arg(value_enum)]
    pub db: Db,

    /// The database's own torn-page protection: doublewrite (mysql) or full_page_writes
    /// (postgres). Default: off for mysql (what the test proves safe: O_DIRECT pages arrive
    /// whole), on for postgres (PostgreSQL writes pages through the page cache, whose
    /// writeback may split them: off is not advised, docs/guarantees.md; `off` measures
    /// whether pages tore).
    #[arg(long, value_name = "on|off", value_parser = clap::builder::BoolishValueParser::new(), hide_possible_values = true)]
    pub torn_page_guard: Option<bool>,

    /// Power cuts to run. Default 20 (smoke 2).
    #[arg(long, value_name = "N")]
    pub cycles: Option<u32>,

    /// Seed of the cut moments (printed; rerun a failure with it). Default: from the clock.
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,

    /// Shortest and longest load before a cut, seconds, counted from the load's first
    /// reported interval. Default 3,20 (smoke 1,3).
    #[arg(long, value_delimiter = ',', value_name = "MIN,MAX")]
    pub cut_after: Option<Vec<f64>>,

    /// Load threads. Default 16.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub threads: u32,

    /// Tiny data, 2 cycles: CI.
    #[arg(long)]
    pub smoke: bool,

    /// Directory for the store and mount (default $TMPDIR).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,

    /// Where the JSON result goes (default ./zdisk-powercut-<db>-<unix time>.json).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,

    /// Codec of the store (zdisk format --codec). Default: zdisk's default.
    #[arg(long, value_name = "CODEC")]
    pub zdisk_codec: Option<String>,

    /// Options for the zdisk server of each zdisk target, as one string (e.g.
    /// "--write-behind 1M --cache 512M"; see `zdisk serve --help`): the store is attached
    /// with `zdisk attach --fuse STORE -- OPTIONS`. Default: the server's defaults.
    #[arg(long, value_name = "OPTIONS", allow_hyphen_values = true)]
    pub serve_options: Option<String>,

    /// Keep the work directory afterwards.
    #[arg(long)]
    pub keep: bool,

    /// The zdisk binary (default: this executable).
    #[arg(long, hide = true, value_name = "PATH")]
    pub zdisk_bin: Option<PathBuf>,
}

/// Requests a zdisk server takes at once: 4 per core, at least 8, at most 64. `zdisk serve`
/// runs this many nbdkit threads on a connection; `zdisk attach` over nbdfuse opens this many
/// connections with one thread each, and the raw targets here open as many, so both sides
/// of a comparison carry the same requests at once (docs/nbd.md, "Threads").
pub fn parallel_requests() -> u32 {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get()) as u32;
    (4 * cores).clamp(8, 64)
}

/// A codec name as `zdisk format --codec` takes it, checked when the arguments are parsed
/// (a bad one failed only after the whole benchmark, at its first ratio store).
fn codec_name(text: &str) -> Result<String, String> {
    text.parse::<zdisk_engine::Codec>().map(|_| text.to_string())
}

/// `--serve-options`' string as the arguments it holds.
pub fn serve_options(text: &Option<String>) -> Vec<String> {
    text.as_deref().unwrap_or_default().split_whitespace().map(String::from).collect()
}

pub fn run(args: &DbArgs) -> Result<()> {
    sys::install_signal_handlers()?;
    match &args.command {
        DbCommand::Tools(t) => tools(t),
        DbCommand::Bench(b) => bench::run(b),
        DbCommand::Powercut(p) => powercut::run(p),
    }
}

fn tools(args: &ToolsArgs) -> Result<()> {
    let dbs = match args.db {
        Some(d) => vec![d],
        None => vec![Db::Mysql, Db::Postgres],
    };
    let mut missing_any = false;
    for d in dbs {
        println!("{}:", d.name());
        for t in d.tools() {
            match sys::find_tool(t.name) {
                Some(p) => println!("  ok       {:<20} {}", t.name, p.display()),
                None => {
                    missing_any = true;
                    println!("  MISSING  {:<20} apt-get install {}", t.name, t.package)
                }
            }
        }
    }
    if missing_any {
        anyhow::bail!("some tools are missing (see above)");
    }
    Ok(())
}
