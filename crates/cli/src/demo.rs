//! `zdisk demo`: format, serve, write real data through NBD, show the statistics, stop.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use zdisk_engine::{Codec, FormatOptions, Store};

use crate::commands;
use crate::runtime;
use crate::size::{human_bytes, LogicalSize, Size};

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Scratch directory for the store and temporary files (default: a new temporary
    /// directory, removed afterwards).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Keep the scratch directory (and the store in it) afterwards.
    #[arg(long)]
    pub keep: bool,
    /// The file tree to copy in (default: the Python standard library, else /usr/share/doc).
    #[arg(long, value_name = "DIR")]
    pub tree: Option<PathBuf>,
    /// Physical size of the demo store.
    #[arg(long, default_value = "1G", value_name = "SIZE")]
    pub physical_size: Size,
    /// Logical size of the demo store.
    #[arg(long, default_value = "4x", value_name = "SIZE|Nx")]
    pub logical_size: LogicalSize,
    /// Bytes the 2:1 compressible fio job writes.
    #[arg(long, default_value = "512M", value_name = "SIZE")]
    pub fio_size: Size,
    #[arg(long, default_value_t = Codec::DEFAULT, value_parser = |s: &str| s.parse::<Codec>())]
    pub codec: Codec,
}

/// Formats the demo store at `args`' sizes (`Nx` of the native capacity) and says so.
fn format_store(args: &DemoArgs, store: &Path) -> Result<zdisk_engine::StoreInfo> {
    step(&format!("formatting {} ({} physical)", store.display(), args.physical_size));
    let physical = args.physical_size.0;
    let over_provision_ppm = zdisk_engine::OVER_PROVISION_DEFAULT_PPM;
    let native =
        zdisk_engine::native_capacity_of_physical(physical, None, over_provision_ppm, zdisk_engine::Sealing::Plain);
    let options = FormatOptions {
        physical_size_bytes: physical,
        logical_size_bytes: args.logical_size.resolve(native),
        codec: args.codec,
        segment_size_bytes: None,
        force: true,
        over_provision_ppm,
        encryption: None,
        allocation: zdisk_engine::Allocation::Sparse,
    };
    let info = Store::format(store, &options).context("formatting the demo store")?;
    eprintln!(
        "    uuid {}, {} logical on {} physical, codec {}",
        info.uuid,
        human_bytes(info.logical_size_bytes),
        human_bytes(info.physical_size_bytes),
        info.codec
    );
    Ok(info)
}

fn step(text: &str) {
    eprintln!("\n==> {text}");
}

fn default_tree() -> Result<PathBuf> {
    let mut pythons: Vec<PathBuf> = std::fs::read_dir("/usr/lib")?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            name.starts_with("python3.") && p.join("json").is_dir()
        })
        .collect();
    pythons.sort();
    if let Some(python) = pythons.pop() {
        return Ok(python);
    }
    for candidate in ["/usr/share/doc", "/usr/share"] {
        if Path::new(candidate).is_dir() {
            return Ok(candidate.into());
        }
    }
    bail!("no file tree to copy found; pass --tree DIR")
}

/// `zdisk serve` as a child; SIGTERMed and reaped on drop.
struct ServeChild {
    child: Option<Child>,
    uri: String,
}

impl ServeChild {
    fn start(store: &Path, socket: &Path) -> Result<ServeChild> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .arg("serve")
            .arg(store)
            .arg("--unix")
            .arg(socket)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting zdisk serve")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        if line.trim().is_empty() {
            let status = child.wait()?;
            bail!("zdisk serve failed ({status})");
        }
        Ok(ServeChild { child: Some(child), uri: line.trim().to_string() })
    }

    fn stop(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else { return Ok(()) };
        runtime::send_signal(child.id(), libc::SIGTERM)?;
        let status = child.wait()?;
        if !status.success() {
            bail!("zdisk serve exited with {status}");
        }
        Ok(())
    }
}

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn rate(bytes: u64, elapsed: Duration) -> String {
    format!("{}/s", human_bytes((bytes as f64 / elapsed.as_secs_f64().max(1e-6)) as u64))
}

/// Compares the first `length` bytes of two files.
fn same_prefix(a: &Path, b: &Path, length: u64) -> Result<bool> {
    let mut fa = std::fs::File::open(a)?.take(length);
    let mut fb = std::fs::File::open(b)?.take(length);
    let mut ba = vec![0u8; 1 << 20];
    let mut bb = vec![0u8; 1 << 20];
    loop {
        let na = read_full(&mut fa, &mut ba)?;
        let nb = read_full(&mut fb, &mut bb)?;
        if na != nb || ba[..na] != bb[..nb] {
            return Ok(false);
        }
        if na == 0 {
            return Ok(true);
        }
    }
}

fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        let n = reader.read(&mut buf[filled..])?;
        if n == 0 {
            break;
        }
        filled += n;
    }
    Ok(filled)
}

/// Where the demo works: `--dir` (created if missing), else a temporary directory (returned
/// too: it is removed when dropped, unless `--keep`).
fn scratch_dir(args: &DemoArgs) -> Result<(Option<tempfile::TempDir>, std::path::PathBuf)> {
    Ok(match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating --dir {}", dir.display()))?;
            (None, dir.clone())
        }
        None => {
            let temp = tempfile::Builder::new().prefix("zdisk-demo.").tempdir()?;
            let path = temp.path().to_path_buf();
            (Some(temp), path)
        }
    })
}

/// Packs `tree` into the tar file `archive`; returns its size.
fn pack_tree(tar: &Path, tree: &Path, archive: &Path) -> Result<u64> {
    let parent = tree.parent().unwrap_or(Path::new("/"));
    let name = tree.file_name().context("the tree has no name")?;
    let status =
        Command::new(tar).arg("-cf").arg(archive).arg("-C").arg(parent).arg(name).stderr(Stdio::null()).status()?;
    // tar exits 1 when files changed while read; the archive is still usable.
    if !matches!(status.code(), Some(0) | Some(1)) {
        bail!("tar failed: {status}");
    }
    Ok(std::fs::metadata(archive)?.len())
}

/// fio writes `size` bytes of 2:1 data at `offset` through NBD (128 KiB, QD16) and verifies
/// them; returns the write phase's bytes per second.
fn fio_write_verified(fio: &Path, scratch: &Path, uri: &str, offset: u64, size: u64) -> Result<u64> {
    let output = runtime::run(
        Command::new(fio)
            .current_dir(scratch)
            .arg("--verify_state_save=0")
            .arg("--name=demo-2to1")
            .arg("--ioengine=nbd")
            .arg(format!("--uri={uri}"))
            .arg("--rw=write")
            .arg("--bs=128k")
            .arg("--iodepth=16")
            .arg(format!("--offset={offset}"))
            .arg(format!("--size={size}"))
            .arg("--buffer_compress_percentage=50")
            .arg("--buffer_compress_chunk=4096")
            .arg("--refill_buffers")
            .arg("--verify=crc32c")
            .arg("--verify_fatal=1")
            .arg("--output-format=json"),
    )?;
    // fio's nbd engine prints "fio: connected to NBD server" before the JSON.
    let json = output.find('{').map(|start| &output[start..]).unwrap_or(&output);
    let report: serde_json::Value = serde_json::from_str(json).context("parsing fio's JSON output")?;
    Ok(report["jobs"][0]["write"]["bw_bytes"].as_u64().unwrap_or(0))
}

/// The fio step's bytes: what was asked, cut to the logical room past `fio_offset` and the
/// physical room at 2:1 less a tenth for metadata and GC (a small --physical-size under the
/// default 512M ran into ENOSPC).
fn fio_size_that_fits(asked_bytes: u64, store: &Path, logical_bytes: u64, fio_offset: u64) -> Result<u64> {
    let (_, now, _) = commands::collect_stats(store, &Default::default())?;
    let fits_bytes = logical_bytes.saturating_sub(fio_offset).min(now.free_space * 2 * 9 / 10);
    let fio_size = asked_bytes.min(fits_bytes) / (1 << 20) * (1 << 20);
    if fio_size == 0 {
        bail!("no room for the fio step in the demo store after the tree; pass a larger --physical-size");
    }
    if fio_size < asked_bytes {
        eprintln!(
            "    (--fio-size {} does not fit the store: {} instead)",
            human_bytes(asked_bytes),
            human_bytes(fio_size)
        );
    }
    Ok(fio_size)
}

pub fn run(args: &DemoArgs) -> Result<()> {
    let nbdcopy = runtime::tool("nbdcopy", "ZDISK_NBDCOPY")?;
    let fio = runtime::tool("fio", "ZDISK_FIO")?;
    let tar = runtime::tool("tar", "ZDISK_TAR")?;
    let tree = match &args.tree {
        Some(tree) if !tree.is_dir() => bail!("--tree {}: not a directory", tree.display()),
        Some(tree) => tree.clone(),
        None => default_tree()?,
    };

    let (temp, scratch) = scratch_dir(args)?;
    let store = scratch.join("demo.zdisk");
    let socket = scratch.join("demo.sock");

    let info = format_store(args, &store)?;

    step("serving it over NBD (zdisk serve: its own server, event loops on io_uring)");
    let mut server = ServeChild::start(&store, &socket)?;
    eprintln!("    NBD URI: {}", server.uri);

    step(&format!("packing a real file tree: {}", tree.display()));
    let archive = scratch.join("tree.tar");
    let archive_bytes = pack_tree(&tar, &tree, &archive)?;
    if archive_bytes > info.logical_size_bytes / 2 {
        bail!("the tree ({}) is too big for the demo store; pass --tree", human_bytes(archive_bytes));
    }
    eprintln!("    {} in {}", human_bytes(archive_bytes), archive.display());

    step("nbdcopy: writing the archive's bytes into the disk at offset 0");
    let started = Instant::now();
    runtime::run(Command::new(&nbdcopy).arg("--flush").arg(&archive).arg(&server.uri))?;
    eprintln!(
        "    {} in {:.2} s ({})",
        human_bytes(archive_bytes),
        started.elapsed().as_secs_f64(),
        rate(archive_bytes, started.elapsed())
    );

    step("nbdcopy: reading the disk back and comparing");
    let readback = scratch.join("readback.img");
    let started = Instant::now();
    runtime::run(Command::new(&nbdcopy).arg(&server.uri).arg(&readback))?;
    let same = same_prefix(&archive, &readback, archive_bytes)?;
    let _ = std::fs::remove_file(&readback);
    if !same {
        bail!("the bytes read back differ from the archive");
    }
    eprintln!(
        "    whole disk read in {:.2} s; the archive's {} read back identical",
        started.elapsed().as_secs_f64(),
        human_bytes(archive_bytes)
    );

    let fio_offset = (archive_bytes + (64 << 20)) / (1 << 20) * (1 << 20);
    let fio_size = fio_size_that_fits(args.fio_size.0, &store, info.logical_size_bytes, fio_offset)?;
    step(&format!(
        "fio (nbd engine): {} of 2:1 compressible data, 128 KiB writes at QD16, verified with crc32c",
        human_bytes(fio_size)
    ));
    let started = Instant::now();
    let write_bytes_s = fio_write_verified(&fio, &scratch, &server.uri, fio_offset, fio_size)?;
    eprintln!(
        "    written and verified in {:.2} s (write phase {}/s)",
        started.elapsed().as_secs_f64(),
        human_bytes(write_bytes_s)
    );

    step("zdisk stat (live, from the running server)");
    let (info_now, stats, source) = commands::collect_stats(&store, &Default::default())?;
    commands::print_stats(&store, &info_now, &stats, &source)?;

    step("stopping the server (SIGTERM: flush + checkpoint)");
    server.stop()?;
    eprintln!("    stopped cleanly");

    step("zdisk check");
    let code = commands::check(&commands::CheckArgs { store: store.clone(), json: false, key: Default::default() })?;
    if code != 0 {
        bail!("zdisk check found problems");
    }

    step("zdisk stat (offline, from the store itself)");
    let (info_now, stats, source) = commands::collect_stats(&store, &Default::default())?;
    commands::print_stats(&store, &info_now, &stats, &source)?;

    if args.keep || args.dir.is_some() {
        eprintln!("\nthe demo store is kept at {}", store.display());
    }
    eprintln!("\ndemo done: {} of real files and {} of 2:1 data stored in {} of backing (comp_ratio {:.2}, write amplification {:.2})",
        human_bytes(archive_bytes), human_bytes(fio_size), human_bytes(stats.physical_size), stats.comp_ratio, stats.write_amplification);
    if let (true, Some(temp)) = (args.keep, temp) {
        let _ = temp.keep();
    }
    Ok(())
}
