//! `format`, `stat`, `check`, `resize`: thin calls into the engine plus presentation.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use std::sync::Arc;

use zdisk_engine::{Allocation, Codec, Encryption, ErrorKind, FormatOptions, OpenOptions, Sealing, Stats, Store};

use crate::keys::{KdfArgs, KeyArgs};

use crate::runtime;
use crate::size::{human_bytes, LogicalSize, OverProvision, Size};
use crate::Usage;

#[derive(Debug, Clone, clap::Args)]
pub struct FormatArgs {
    /// File (created at the physical size) or block device (its whole size is used).
    pub store: PathBuf,
    /// Bytes of backing store, e.g. 64G. Ignored for a block device (its size is used).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub physical_size: Option<Size>,
    /// Capacity the clients see: a size (e.g. 300G) or a multiple of the native capacity
    /// (e.g. 3x). Native capacity (1x) is what incompressible data can always fill and
    /// overwrite without ENOSPC; above it, the extra capacity holds only while data
    /// compresses that well.
    #[arg(long, value_name = "SIZE|Nx", default_value = "1x", allow_hyphen_values = true)]
    pub logical_size: LogicalSize,
    /// Share of the data area kept spare beyond native capacity, in percent (1-75). More
    /// spare area means less GC work and steadier latency when the store is full; less
    /// means more native capacity. See docs/space.md for the measured trade-off.
    #[arg(long, value_name = "PCT", default_value = "10")]
    pub over_provision: OverProvision,
    /// Default codec for new blocks: lz4, zstd[:LEVEL 1-19] or deflate[:LEVEL 1-12].
    #[arg(long, default_value_t = Codec::DEFAULT, value_parser = parse_codec)]
    pub codec: Codec,
    /// Segment size, the unit of log writing and garbage collection (a multiple of 64K, at
    /// most 256M); default: the engine's choice.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub segment_size: Option<Size>,
    /// Overwrite an existing zdisk store or other data on STORE.
    #[arg(long)]
    pub force: bool,
    /// Encrypt the store: every block is compressed, then sealed with AES-256-GCM-SIV
    /// (docs/format.md, "Encryption"). The key comes from --key-file, --passphrase-stdin, or
    /// a passphrase asked twice on the terminal.
    #[arg(long)]
    pub encrypt: bool,
    /// Write zeros over the whole data area now (one write of the physical size, with
    /// progress), instead of leaving a file's data area unallocated. On a backing file it
    /// keeps flushes fast from the first write: a flush that lands on blocks the file system
    /// has not allocated waits for it to allocate them (measured: 16 KiB write + flush at
    /// QD1, 1.6x faster; docs/format.md, "Backing allocation"). Use it under databases.
    #[arg(long, conflicts_with = "sparse")]
    pub preallocate: bool,
    /// Leave a file's data area unreserved: the file system allocates it as the log first
    /// writes it. By default `format` reserves the physical size (fallocate) so the file
    /// system cannot fill up under the store; a sparse store whose file system fills turns
    /// read-only (its writes then get ENOSPC; `zdisk stat` says `state failed`). Warns when
    /// the file system has less free space than the store.
    #[arg(long)]
    pub sparse: bool,
    #[command(flatten)]
    pub key: KeyArgs,
    #[command(flatten)]
    pub kdf: KdfArgs,
}

/// Progress of a long step on stderr: on a terminal a bar with an ETA; otherwise (logs, CI)
/// one line per 10%, with the ETA.
struct StepProgress {
    label: String,
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    last_decile: u64,
}

impl StepProgress {
    fn new(label: String) -> StepProgress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(0);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {percent:>3}% ETA {eta}")
                    .expect("a valid progress template")
                    .progress_chars("=> "),
            );
            bar.set_message(label.clone());
            bar
        });
        StepProgress { label, bar, started: Instant::now(), last_decile: u64::MAX }
    }

    fn update(&mut self, done: u64, total: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total);
            bar.set_position(done);
            return;
        }
        let percent = done.saturating_mul(100).checked_div(total).unwrap_or(100);
        if percent / 10 != self.last_decile {
            self.last_decile = percent / 10;
            let eta_secs = self.started.elapsed().as_secs_f64() * (total - done) as f64 / done.max(1) as f64;
            eprintln!("{}: {percent}% ({done}/{total}), ETA {eta_secs:.0} s", self.label);
        }
    }

    fn finish(self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn parse_codec(text: &str) -> Result<Codec, String> {
    text.parse::<Codec>()
}

/// `--codec-cores N` of `serve` and `attach`: 1 up to the cores this process may run on
/// (the engine checks the same at open; a usage error here says so before anything starts).
pub fn parse_codec_cores(text: &str) -> Result<u32, String> {
    let cores: usize = text.trim().parse().map_err(|_| format!("{text:?} is not a number of cores"))?;
    zdisk_engine::check_codec_cores(cores, zdisk_engine::available_cores()).map(|cores| cores as u32)
}

fn is_block_device(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).map(|m| m.file_type().is_block_device()).unwrap_or(false)
}

fn block_device_size(path: &Path) -> Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    Ok(file.seek(SeekFrom::End(0))?)
}

pub fn format(args: &FormatArgs) -> Result<()> {
    let physical = if is_block_device(&args.store) {
        block_device_size(&args.store)?
    } else {
        match args.physical_size {
            Some(size) => size.0,
            None => bail!("--physical-size is required when STORE is a file"),
        }
    };
    let segment_size_bytes = args.segment_size.map(|s| s.0);
    let sealing = if args.encrypt { Sealing::Encrypted } else { Sealing::Plain };
    let native =
        zdisk_engine::native_capacity_of_physical(physical, segment_size_bytes, args.over_provision.0, sealing);
    if !args.encrypt && (args.key.key_file.is_some() || args.key.passphrase_stdin) {
        return Err(Usage("--key-file and --passphrase-stdin need --encrypt".into()).into());
    }
    let encryption = match args.encrypt {
        true => Some(Encryption {
            secret: Arc::new(args.key.read(&format!("New passphrase for {}: ", args.store.display()), true)?),
            kdf: args.kdf.params(),
        }),
        false => None,
    };
    let logical = args.logical_size.resolve(native);
    let options = FormatOptions {
        physical_size_bytes: physical,
        logical_size_bytes: logical,
        codec: args.codec,
        segment_size_bytes,
        force: args.force,
        over_provision_ppm: args.over_provision.0,
        encryption,
        allocation: match (args.preallocate, args.sparse) {
            (true, _) => Allocation::Zeroed,
            (false, true) => Allocation::Sparse,
            (false, false) => Allocation::Reserved,
        },
    };
    let mut progress =
        args.preallocate.then(|| StepProgress::new(format!("writing zeros over {}", args.store.display())));
    let info = Store::format_with_progress(&args.store, &options, &mut |done, total| {
        if let Some(progress) = progress.as_mut() {
            progress.update(done, total)
        }
    })
    .map_err(crate::usage_if_invalid)
    .with_context(|| format!("formatting {}", args.store.display()))?;
    if let Some(progress) = progress {
        progress.finish();
    }
    println!("formatted {}", args.store.display());
    println!("  uuid             {}", info.uuid);
    println!("  physical size    {} ({} bytes)", human_bytes(info.physical_size_bytes), info.physical_size_bytes);
    println!(
        "  native capacity  {} ({} bytes): incompressible data can always fill and overwrite it",
        human_bytes(info.native_capacity_bytes),
        info.native_capacity_bytes
    );
    println!(
        "  logical size     {} ({} bytes, {:.2}x native, {:.2}x physical)",
        human_bytes(info.logical_size_bytes),
        info.logical_size_bytes,
        info.logical_size_bytes as f64 / info.native_capacity_bytes.max(1) as f64,
        info.logical_size_bytes as f64 / info.physical_size_bytes.max(1) as f64
    );
    println!("  over-provision   {}% of the data area kept spare", info.over_provision_ppm as f64 / 10_000.0);
    println!("  segment size     {}", human_bytes(info.segment_size_bytes));
    println!("  codec            {}", info.codec);
    let times = info.logical_size_bytes as f64 / info.native_capacity_bytes.max(1) as f64;
    if times > 1.0 {
        println!(
            "  provisioned {times:.2}x native capacity: writes of data that compresses less than that may get ENOSPC"
        );
    }
    if times > FAR_ABOVE_NATIVE {
        eprintln!(
            "zdisk: warning: {times:.2}x native capacity is more than the data measured here compresses to (text \
             and database pages 1.3-2.5:1, docs/space.md); the store will run out of space long before clients \
             fill it unless the data compresses {times:.1}:1"
        );
    }
    if args.sparse {
        if let Some(warning) = sparse_room_warning(&args.store)? {
            eprintln!("zdisk: warning: {warning}");
        }
    }
    Ok(())
}

/// The store's on-disk format version, said in words (docs/format.md, "Superblock slot").
fn format_version_note(info: &zdisk_engine::StoreInfo) -> String {
    let encrypted = if info.encrypted { "encrypted (AES-256-GCM-SIV)" } else { "not encrypted" };
    let version = info.format_version;
    match version {
        4 | 5 => format!("v{version}, the current on-disk format; {encrypted}"),
        _ => format!(
            "v{version}, written by an older zdisk: this one reads it and brings it to v4 (v5 encrypted) at its \
             first writable open, after which older versions refuse it; {encrypted}"
        ),
    }
}

/// A provisioned multiple of the native capacity above this gets a warning at format: the
/// seeds' drives are formatted to 3-4x, and no data set measured here compressed more than
/// 2.5:1 (docs/space.md, "Codec choice").
const FAR_ABOVE_NATIVE: f64 = 4.0;

/// When `store` is a file whose file system has less free space than the store can still
/// grow by (its size less what is allocated): what an operator should be told. None for a
/// block device, or when the room is there.
pub fn sparse_room_warning(store: &Path) -> Result<Option<String>> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::metadata(store).with_context(|| format!("reading {}", store.display()))?;
    if !metadata.is_file() {
        return Ok(None);
    }
    let growth = metadata.len().saturating_sub(metadata.blocks() * 512);
    let fs = rustix::fs::statvfs(store).with_context(|| format!("reading the file system of {}", store.display()))?;
    let free = fs.f_bavail * fs.f_frsize;
    Ok((free < growth).then(|| {
        format!(
            "{} is sparse and can still grow by {}, but its file system has {} free: when the file system fills, \
             the store turns read-only (writes get ENOSPC). Format without --sparse to reserve the room.",
            store.display(),
            human_bytes(growth),
            human_bytes(free)
        )
    }))
}

#[derive(Debug, Clone, clap::Args)]
pub struct StatArgs {
    pub store: PathBuf,
    #[command(flatten)]
    pub key: KeyArgs,
    /// One JSON object: the six capacity-stat keys (bytes; comp_ratio a number) and every
    /// engine statistic under its engine name, plus `source` ("live", "offline", or
    /// "checkpoint": an encrypted store read without its key).
    #[arg(long)]
    pub json: bool,
}

/// Where the numbers came from.
pub enum Source {
    Offline,
    /// An encrypted store, not served, read without its key: its newest checkpoint's numbers
    /// (the log since is not replayed; the checkpoint's MAC is not checked).
    Checkpoint,
    Live {
        pid: u64,
        age: Duration,
    },
}

impl Source {
    fn name(&self) -> &'static str {
        match self {
            Source::Offline => "offline",
            Source::Checkpoint => "checkpoint",
            Source::Live { .. } => "live",
        }
    }
}

/// A live snapshot older than this is not trusted (the plugin rewrites it every second).
const LIVE_STALE_AFTER: Duration = Duration::from_secs(10);

fn live_stats(uuid: &str) -> Result<(Stats, Source)> {
    // A snapshot the server takes now: the file it rewrites every second lagged a write the
    // client had just finished by up to that second. The file is the fallback (a server
    // that does not answer).
    let asked = runtime::control_request(&runtime::control_socket(uuid), "stats")
        .ok()
        .and_then(|reply| serde_json::from_str::<Value>(&reply).ok());
    let path = runtime::live_file(uuid);
    let value = match asked {
        Some(value) => value,
        None => runtime::read_json(&path).with_context(|| {
            format!("the store is being served but its live statistics ({}) cannot be read", path.display())
        })?,
    };
    let stats: Stats = serde_json::from_value(value.get("stats").cloned().unwrap_or(Value::Null))
        .with_context(|| format!("parsing the live statistics of store {uuid}"))?;
    let pid = value.get("pid").and_then(Value::as_u64).unwrap_or(0);
    let updated = value.get("updated_unix_ms").and_then(Value::as_u64).unwrap_or(0);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    let age = Duration::from_millis(now.saturating_sub(updated));
    Ok((stats, Source::Live { pid, age }))
}

fn fresh_live_stats(uuid: &str) -> Option<(Stats, Source)> {
    match live_stats(uuid) {
        Ok((stats, Source::Live { pid, age }))
            if age < LIVE_STALE_AFTER && runtime::process_alive(u32::try_from(pid).unwrap_or(0)) =>
        {
            Some((stats, Source::Live { pid, age }))
        }
        _ => None,
    }
}

/// Statistics stat read by opening the store itself: read-only is how it opened it, not what
/// the store is.
fn offline(mut stats: Stats) -> Stats {
    if stats.state == zdisk_engine::StoreState::ReadOnly {
        (stats.state, stats.state_reason) = (zdisk_engine::StoreState::Ok, String::new());
    }
    stats
}

/// Statistics of a store, served or not.
pub fn collect_stats(store: &Path, key: &KeyArgs) -> Result<(zdisk_engine::StoreInfo, Stats, Source)> {
    let info = Store::info(store).with_context(|| format!("reading {}", store.display()))?;
    if info.encrypted && runtime::store_is_locked(store, zdisk_engine::Lock::Shared)? {
        // Served: the server's numbers, which need no key.
        let (stats, source) = live_stats(&info.uuid)?;
        return Ok((info, stats, source));
    }
    if info.encrypted && !key.given() {
        let (info, stats) = Store::checkpoint_stats(store).with_context(|| format!("reading {}", store.display()))?;
        return Ok((info, offline(stats), Source::Checkpoint));
    }
    let options = OpenOptions { read_only: true, key: key.secret_for(store)?, ..OpenOptions::default() };
    match Store::open(store, &options) {
        Ok(opened) => {
            let stats = offline(opened.stats());
            drop(opened);
            // Served read-only (a shared lock lets us in too): the server's numbers are newer.
            if let Some((live, source)) = fresh_live_stats(&info.uuid) {
                return Ok((info, live, source));
            }
            Ok((info, stats, Source::Offline))
        }
        Err(e) if e.kind() == ErrorKind::Locked => {
            let (stats, source) = live_stats(&info.uuid)?;
            Ok((info, stats, source))
        }
        Err(e) => Err(e).with_context(|| format!("opening {}", store.display())),
    }
}

/// The `--json` object: every `Stats` field under its engine name, plus context keys.
pub fn stats_json(info: &zdisk_engine::StoreInfo, stats: &Stats, source: &Source) -> Result<Value> {
    let Value::Object(fields) = serde_json::to_value(stats)? else { bail!("statistics are not an object") };
    let mut object = Map::new();
    object.insert("source".into(), Value::from(source.name()));
    object.insert("uuid".into(), Value::from(info.uuid.clone()));
    object.extend(fields);
    Ok(Value::Object(object))
}

const CAPACITY_STAT: [&str; 6] =
    ["free_space", "physical_size", "logical_size", "comp_ratio", "provisioned_cap", "space_flag"];

pub fn print_stats(store: &Path, info: &zdisk_engine::StoreInfo, stats: &Stats, source: &Source) -> Result<()> {
    let json = stats_json(info, stats, source)?;
    println!("store   {} (uuid {}, codec {})", store.display(), info.uuid, info.codec);
    println!("format  {}", format_version_note(info));
    match source {
        Source::Offline => println!("source  offline (not being served; numbers from the last checkpoint)"),
        Source::Checkpoint => println!(
            "source  checkpoint (encrypted, not served, no key given: capacity numbers as of the last checkpoint, \
             without the log since; give --key-file or --passphrase-stdin for current ones)"
        ),
        Source::Live { pid, age } => {
            println!("source  live (served by pid {pid}; snapshot {:.1} s old)", age.as_secs_f64())
        }
    }
    match stats.state {
        zdisk_engine::StoreState::Ok => println!("state   ok"),
        state => println!("state   {}: {}", state.name(), stats.state_reason),
    }
    println!();
    println!("capacity-stat (bytes):");
    let values: Vec<String> = CAPACITY_STAT
        .iter()
        .map(|key| match key {
            &"comp_ratio" => format!("{:.2}", stats.comp_ratio),
            key => json[*key].to_string(),
        })
        .collect();
    let widths: Vec<usize> = CAPACITY_STAT.iter().zip(&values).map(|(k, v)| k.len().max(v.len())).collect();
    let header: Vec<String> = CAPACITY_STAT.iter().zip(&widths).map(|(k, w)| format!("{k:<w$}")).collect();
    let row: Vec<String> = values.iter().zip(&widths).map(|(v, w)| format!("{v:<w$}")).collect();
    println!("  {}", header.join("  ").trim_end());
    println!("  {}", row.join("  ").trim_end());
    println!();
    let flag = match stats.space_flag {
        _ if stats.damaged => "damaged: read-only, see `zdisk check`",
        _ if stats.state == zdisk_engine::StoreState::Failed => {
            "full or failed: the store takes no more writes (state)"
        }
        0 => "normal",
        1 => "low",
        _ => "full: writes needing space get ENOSPC",
    };
    println!("  provisioned_cap  {:>12}  capacity the clients see", human_bytes(stats.provisioned_cap));
    println!(
        "  native_capacity  {:>12}  what incompressible data can always fill (provisioned = {:.2}x; {}% over-provisioned)",
        human_bytes(stats.native_capacity),
        stats.provisioned_cap as f64 / stats.native_capacity.max(1) as f64,
        stats.over_provision_percent
    );
    println!("  logical_size     {:>12}  written by clients and not trimmed", human_bytes(stats.logical_size));
    println!(
        "  physical_size    {:>12}  backing bytes holding live data and metadata",
        human_bytes(stats.physical_size)
    );
    println!("  free_space       {:>12}  backing bytes available for new data", human_bytes(stats.free_space));
    println!("  comp_ratio       {:>12.2}  logical_size / physical_size", stats.comp_ratio);
    println!("  space_flag       {:>12}  {flag}", stats.space_flag);
    if stats.damaged_records > 0 {
        println!();
        println!(
            "DAMAGE: recovery found {} damaged record(s){}; `zdisk check {}` lists them",
            stats.damaged_records,
            if stats.damaged { " and lost records: the store is read-only, older blocks read as EIO" } else { "" },
            store.display()
        );
    }
    println!();
    println!(
        "write amplification {:.3} (backing {} written / host {} written)",
        stats.write_amplification,
        human_bytes(stats.backing_write_bytes),
        human_bytes(stats.host_write_bytes)
    );
    println!();
    println!("engine statistics:");
    if let Value::Object(fields) = &json {
        for (key, value) in fields {
            if CAPACITY_STAT.contains(&key.as_str()) || key == "source" || key == "uuid" {
                continue;
            }
            println!("  {key:<22} {value}");
        }
    }
    Ok(())
}

pub fn stat(args: &StatArgs) -> Result<()> {
    let (info, stats, source) = collect_stats(&args.store, &args.key)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&stats_json(&info, &stats, &source)?)?);
        return Ok(());
    }
    print_stats(&args.store, &info, &stats, &source)
}

#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    pub store: PathBuf,
    #[command(flatten)]
    pub key: KeyArgs,
    /// Print the report as JSON (`clean`, `blocks_checked`, `records_checked`, `problems`,
    /// `damage`: each problem with its byte offset on the backing store and the LBA ranges
    /// it affects, `notes`: what a crash leaves that costs nothing).
    #[arg(long)]
    pub json: bool,
}

/// Exit status of `zdisk check` when it finds damage (other failures exit 1).
pub const CHECK_DAMAGED_EXIT: i32 = 3;

pub fn check(args: &CheckArgs) -> Result<i32> {
    Store::info(&args.store).with_context(|| format!("reading {}", args.store.display()))?;
    let options = OpenOptions { read_only: true, key: args.key.secret_for(&args.store)?, ..OpenOptions::default() };
    let store = match Store::open(&args.store, &options) {
        Ok(store) => store,
        Err(e) if e.kind() == ErrorKind::Locked => {
            bail!("{} is being served: stop the server (or `zdisk detach`) before checking it", args.store.display())
        }
        Err(e) => return Err(e).with_context(|| format!("opening {}", args.store.display())),
    };
    let started = Instant::now();
    let mut progress = StepProgress::new(format!("checking {}", args.store.display()));
    let report = store.check(&mut |done, total| progress.update(done, total));
    progress.finish();
    let report = report.with_context(|| format!("checking {}", args.store.display()))?;
    drop(store);
    let clean = report.problems.is_empty();
    if args.json {
        let value = serde_json::json!({
            "store": args.store,
            "clean": clean,
            "blocks_checked": report.blocks_checked,
            "records_checked": report.records_checked,
            "problems": report.problems,
            "damage": report.damage,
            "notes": report.notes,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!(
            "{}: {} blocks and {} records checked in {:.1} s",
            args.store.display(),
            report.blocks_checked,
            report.records_checked,
            started.elapsed().as_secs_f64()
        );
        for note in &report.notes {
            println!("  note: {note}");
        }
        if clean {
            println!("clean");
        } else {
            println!("{} problem(s):", report.problems.len());
            for d in &report.damage {
                let lbas: Vec<String> = merged(&d.lbas).iter().map(|(lba, n)| format!("{lba}+{n}")).collect();
                let lbas = if lbas.is_empty() { String::new() } else { format!(" [blocks {}]", lbas.join(", ")) };
                println!("  at byte {}: {}{lbas}", d.offset_bytes, d.what);
            }
        }
    }
    Ok(if clean { 0 } else { CHECK_DAMAGED_EXIT })
}

/// Block ranges (first, count) sorted, with adjacent and overlapping ones joined: a damaged
/// record's blocks print as one range, not one per block.
fn merged(ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
    for (first, count) in sorted {
        match out.last_mut() {
            Some((last_first, last_count)) if first <= *last_first + *last_count => {
                *last_count = (*last_count).max(first + count - *last_first);
            }
            _ => out.push((first, count)),
        }
    }
    out
}

#[derive(Debug, Clone, clap::Args)]
pub struct ResizeArgs {
    pub store: PathBuf,
    /// New capacity: a size (e.g. 500G) or a multiple of the native capacity (e.g. 4x; with
    /// --over-provision, of the native capacity that leaves).
    #[arg(long, value_name = "SIZE|Nx", required_unless_present = "over_provision", allow_hyphen_values = true)]
    pub logical_size: Option<LogicalSize>,
    /// New over-provisioning in percent (1-75), which moves the native capacity. Offline
    /// only; refused when the data stored now would not fit the native capacity it leaves.
    #[arg(long, value_name = "PCT")]
    pub over_provision: Option<OverProvision>,
    #[command(flatten)]
    pub key: KeyArgs,
}

pub fn resize(args: &ResizeArgs) -> Result<()> {
    let info = Store::info(&args.store).with_context(|| format!("reading {}", args.store.display()))?;
    let over_provision_ppm = args.over_provision.map_or(info.over_provision_ppm, |op| op.0);
    let native = zdisk_engine::native_capacity_of_physical(
        info.physical_size_bytes,
        Some(info.segment_size_bytes),
        over_provision_ppm,
        if info.encrypted { Sealing::Encrypted } else { Sealing::Plain },
    );
    let logical = args.logical_size.map(|size| size.resolve(native));
    let options = OpenOptions { key: args.key.secret_unless_served(&args.store)?, ..OpenOptions::default() };
    match Store::open(&args.store, &options) {
        Ok(store) => {
            let context = || format!("resizing {}", args.store.display());
            if let Some(op) = args.over_provision {
                store.set_over_provision(op.0).with_context(context)?;
                println!(
                    "{}: over-provisioning {}% -> {op}; native capacity {} -> {} ({native} bytes)",
                    args.store.display(),
                    info.over_provision_ppm as f64 / 10_000.0,
                    human_bytes(info.native_capacity_bytes),
                    human_bytes(native)
                );
            }
            if let Some(logical) = logical {
                let before = store.logical_size_bytes();
                store.resize(logical).with_context(context)?;
                let after = store.logical_size_bytes();
                println!(
                    "{}: logical size {} -> {} ({after} bytes)",
                    args.store.display(),
                    human_bytes(before),
                    human_bytes(after)
                );
            }
            let after = store.logical_size_bytes();
            store.close().with_context(|| format!("closing {}", args.store.display()))?;
            if after > native {
                println!(
                    "  provisioned {:.2}x native capacity: writes of data that compresses less than that may get ENOSPC",
                    after as f64 / native.max(1) as f64
                );
            }
            Ok(())
        }
        Err(e) if e.kind() == ErrorKind::Locked && args.over_provision.is_some() => {
            bail!("{} is being served: over-provisioning can only be changed offline", args.store.display())
        }
        Err(e) if e.kind() == ErrorKind::Locked => {
            let logical = logical.expect("clap requires --logical-size without --over-provision");
            // Served: grow through the plugin's control socket. Shrinking is refused there,
            // because connected clients keep the size they negotiated.
            let socket = runtime::control_socket(&info.uuid);
            let reply = runtime::control_request(&socket, &format!("resize {logical}"))?;
            match reply.strip_prefix("ok ") {
                Some(size) => {
                    let after: u64 = size.trim().parse().context("bad reply from the server")?;
                    println!(
                        "{}: logical size {} -> {} ({after} bytes) while served; \
                         clients see the new size when they reconnect",
                        args.store.display(),
                        human_bytes(info.logical_size_bytes),
                        human_bytes(after)
                    );
                    Ok(())
                }
                None => bail!("the server refused: {}", reply.strip_prefix("error ").unwrap_or(&reply)),
            }
        }
        Err(e) => Err(e).with_context(|| format!("opening {}", args.store.display())),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn adjacent_and_overlapping_ranges_merge() {
        let ranges = [(10, 1), (0, 2), (11, 1), (2, 3), (20, 5), (22, 1), (30, 1)];
        assert_eq!(super::merged(&ranges), vec![(0, 5), (10, 2), (20, 5), (30, 1)]);
        assert!(super::merged(&[]).is_empty());
    }
}
