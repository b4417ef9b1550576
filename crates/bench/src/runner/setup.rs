//! Starting a run: the tools and the work directory checked, the targets and the report's
//! skeleton made, the progress bar; `run` drives the whole benchmark from there.

use super::*;

/// Checks up front that every tool the chosen targets and data modes need is installed.
fn check_tools(cfg: &Config) -> Result<PathBuf> {
    let fio = require_tool("fio", "every measurement (fio with its nbd engine)", "fio")?;
    let help = Command::new(&fio).arg("--enghelp=nbd").output().context("running fio --enghelp=nbd")?;
    if !help.status.success() || !String::from_utf8_lossy(&help.stdout).contains("uri") {
        bail!("{} has no nbd ioengine (fio --enghelp=nbd fails); install a fio built with libnbd (Debian/Ubuntu fio >= 3.16 is)", fio.display());
    }
    let t = &cfg.targets;
    if t.iter().any(|k| matches!(k, TargetKind::Zdisk | TargetKind::NbdkitFile | TargetKind::Memory)) {
        require_tool("nbdkit", "the zdisk, nbdkit-file and memory targets", "nbdkit")?;
    }
    if t.contains(&TargetKind::Raw) {
        require_tool("qemu-nbd", "the raw target (qemu-nbd --cache=none --aio=native)", "qemu-utils")?;
    }
    if cfg.data.contains(&DataMode::Real) {
        require_tool("nbdcopy", "the real-data fill (nbdcopy streams real files onto each target)", "libnbd-bin")?;
    }
    if t.contains(&TargetKind::Zdisk) && !cfg.zdisk_bin.is_file() {
        bail!("zdisk binary {} not found (set --zdisk-bin)", cfg.zdisk_bin.display());
    }
    Ok(fio)
}

/// O_DIRECT is what makes the raw baseline honest; tmpfs and some FUSE filesystems refuse it.
fn check_o_direct(dir: &Path) -> Result<()> {
    use rustix::fs::{open, Mode as FsMode, OFlags};
    let probe = dir.join(".o_direct_probe");
    let res = open(&probe, OFlags::CREATE | OFlags::WRONLY | OFlags::DIRECT, FsMode::from_raw_mode(0o600));
    let _ = fs::remove_file(&probe);
    res.map(drop).map_err(|e| {
        anyhow!("backing directory {} does not support O_DIRECT ({e}); tmpfs cannot host the raw baseline. Pass --dir on a real disk", dir.display())
    })
}

fn check_space(dir: &Path, need: u64) -> Result<()> {
    let st = rustix::fs::statvfs(dir).context("statvfs on the backing directory")?;
    let avail = st.f_bavail * st.f_frsize;
    if avail < need {
        bail!(
            "backing directory {} has {} free but the targets need {}; use a smaller --size or another --dir",
            dir.display(),
            fmt_size(avail),
            fmt_size(need)
        );
    }
    Ok(())
}

fn command_line() -> String {
    let args: Vec<String> = std::env::args().collect();
    let mut v = args.clone();
    if let Some(first) = v.first_mut() {
        *first = Path::new(&args[0]).file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    }
    v.join(" ")
}

fn notes(cfg: &Config, native_bytes: u64) -> Vec<String> {
    let mut n = vec![
        if cfg.targets.contains(&TargetKind::NbdkitFile) {
            "nbdkit 1.32's `file cache=none` is not O_DIRECT: it writes through the page cache and drops pages afterwards, so reads of recently written data can still hit RAM. The honest raw baseline is qemu-nbd --cache=none --aio=native (O_DIRECT); the nbdkit-file row is shown for reference only.".to_string()
        } else {
            "The raw baseline is qemu-nbd --cache=none --aio=native (O_DIRECT). The second raw row, nbdkit file cache=none (not O_DIRECT in nbdkit 1.32, so the page cache helps it), is not in this run; add it with --targets zdisk,raw,nbdkit-file,memory.".to_string()
        },
        "Order: for each workload the targets are run one after another, each preconditioned and swept seamlessly; the starting target rotates from workload to workload so slow drift (other load, the host's own caches) hits every target.".into(),
        "CPU s/GiB: utime+stime of the server process and all its descendants (zdisk serve runs nbdkit as a child) from /proc, before and after each job, divided by GiB read+written by fio. fio itself runs on the same cores.".into(),
        "Write amplification: for zdisk from `zdisk stat` (backing_write_bytes / host_write_bytes), cumulative since format and per job; for every target also the OS view (write_bytes in /proc/PID/io of the server tree per byte written), in report.json as os_write_amplification.".into(),
        "p99 is fio's completion-latency 99th percentile; for mixed workloads the worse of the read and write p99.".into(),
        format!(
            "Steady state: SNIA PTS rule over a {WINDOW_ROUNDS}-round window (max−min ≤ 20% of the mean and least-squares rise ≤ 10% of the mean) on round-mean IOPS; rounds of {:.1} s, limit {} rounds, at QD{}.",
            cfg.round_ms as f64 / 1000.0,
            cfg.max_rounds,
            cfg.qds.last().unwrap_or(&1)
        ),
    ];
    if !cfg.purge_each_workload {
        n.push("Shortened method (quick/smoke): one purge + fill per target and data mode instead of one per workload, and read-only workloads are not preconditioned (the fill already wrote every block).".into());
    }
    if cfg.mode != Preset::Full {
        n.push(format!(
            "{:?} mode: points of {:.1} s and a {:.0} s consistency test are far shorter than the reviewers' (5 minutes per point, 30 minutes of consistency); use the numbers for direction, not for publication.",
            cfg.mode,
            cfg.runtime_ms as f64 / 1000.0,
            cfg.consistency_ms as f64 / 1000.0
        ));
    }
    if cfg.data.contains(&DataMode::Incompressible) {
        n.push(format!(
            "Incompressible data: every target exposes zdisk's native capacity, {} ({:.1}% of the {} physical; zdisk: a store formatted at that logical size — 1x, what `zdisk format` prints as native capacity; raw targets: fio's range). Native capacity is what incompressible data can always fill and overwrite: the rest of the physical size is zdisk's over-provisioning, record headers, checkpoints and GC reserve, hidden as a drive hides its spare area; giving the raw targets the same range keeps the comparison like for like.",
            fmt_size(native_bytes),
            native_bytes as f64 * 100.0 / cfg.zdisk_physical_bytes as f64,
            fmt_size(cfg.zdisk_physical_bytes)
        ));
    }
    if cfg.data.contains(&DataMode::Real) {
        n.push("Real data: each fill streams real files from /usr/share and /usr/lib (cycled to the target size) onto the target with nbdcopy, so reads return real bytes and zdisk's ratio is that of real files. fio cannot write file contents at random offsets, so write workloads in this mode write fio data at the compressibility measured on the corpus (4 KiB LZ4); that substitution is stated wherever the mode appears.".into());
    }
    n
}

pub fn run(cfg: &Config) -> Result<()> {
    let fio = check_tools(cfg)?;
    let base = match &cfg.dir {
        Some(d) => {
            fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            d.clone()
        }
        None => std::env::temp_dir(),
    };
    // Everything goes in a fresh subdirectory that is removed at the end, even on errors.
    let work = tempfile::Builder::new()
        .prefix("zdisk-bench.")
        .tempdir_in(&base)
        .with_context(|| format!("creating a work directory in {}", base.display()))?;
    // Unix socket paths are limited to 108 bytes; keep them short whatever --dir is.
    let sock_dir = tempfile::Builder::new().prefix("zb.").tempdir()?;
    check_o_direct(work.path())?;
    let disk_targets =
        cfg.targets.iter().filter(|t| matches!(t, TargetKind::Raw | TargetKind::NbdkitFile)).count() as u64;
    let zdisk_bytes = if cfg.targets.contains(&TargetKind::Zdisk) { cfg.zdisk_physical_bytes } else { 0 };
    check_space(work.path(), disk_targets * cfg.size_bytes + zdisk_bytes)?;
    let native_bytes =
        if cfg.data.contains(&DataMode::Incompressible) { native_capacity(cfg, work.path())? } else { cfg.size_bytes };

    fs::create_dir_all(&cfg.out).with_context(|| format!("creating report directory {}", cfg.out.display()))?;
    let fio_dir = cfg.out.join("fio");
    fs::create_dir_all(&fio_dir)?;
    let log = fs::File::create(cfg.out.join("bench.log"))?;

    // SIGINT/SIGTERM end the run between steps, with the report written and every server
    // stopped; a second one ends the process at once (the harness's rule, `sys`).
    crate::sys::install_signal_handlers()?;

    let mut bench = Bench {
        cfg,
        fio,
        fio_dir,
        targets: new_targets(cfg, work.path(), sock_dir.path()),
        report: new_report(cfg, work.path(), native_bytes),
        pb: ProgressBar::hidden(),
        log,
        t0: Instant::now(),
        corpus: None,
        stat_failures: 0,
        job_seq: 0,
        native_bytes,
    };
    let estimate_ms = bench.estimate_ms();
    bench.pb = progress_bar(estimate_ms);
    bench.say(&format!(
        "zdisk bench ({:?}): {} targets, workloads {}, data {}, QD {:?}; estimated {} (work dir {}, report {})",
        cfg.mode,
        fmt_size(cfg.size_bytes),
        cfg.workloads.iter().map(|w| w.key()).collect::<Vec<_>>().join(","),
        cfg.data.iter().map(|d| d.key()).collect::<Vec<_>>().join(","),
        cfg.qds,
        fmt_duration(estimate_ms),
        work.path().display(),
        cfg.out.display()
    ));

    let outcome = bench.run_all();
    let written = bench.finish(&outcome);
    written?;
    eprintln!("report: {}/report.html, summary.md, report.json ({:.0} s)", cfg.out.display(), bench.report.wall_s);
    if let (Some(c), Some(p)) = (bench.report.comp_ratio, bench.report.perf_multiplier) {
        eprintln!("2:1 data: comp_ratio {c:.2}, perf_multiplier (zdisk/raw IOPS geomean) {p:.2}x");
    }
    outcome?;
    bench.verdict()
}

/// One target per kind asked for, its files in `work` and its socket in `sock_dir`.
fn new_targets(cfg: &Config, work: &Path, sock_dir: &Path) -> Vec<Target> {
    cfg.targets
        .iter()
        .map(|&kind| Target {
            kind,
            server: None,
            file: work.join(match kind {
                TargetKind::Zdisk => "zdisk.store",
                TargetKind::Raw => "raw.img",
                TargetKind::NbdkitFile => "nbdkit-file.img",
                TargetKind::Memory => "memory",
            }),
            socket: sock_dir.join(format!("{}.sock", kind.key())),
            log: cfg.out.join(format!("server-{}.log", kind.key())),
            range_bytes: cfg.size_bytes,
            format_gen: 0,
        })
        .collect()
}

/// The report before any measurement: the configuration, host and targets.
/// The native capacity of a zdisk store of `cfg.zdisk_physical_bytes` with the default
/// over-provisioning (a probe store formatted in `work`, read back with `zdisk stat`, removed).
fn native_capacity(cfg: &Config, work: &Path) -> Result<u64> {
    let probe = work.join("native-capacity-probe.zdisk");
    crate::sys::run(
        Command::new(&cfg.zdisk_bin)
            .arg("format")
            .arg(&probe)
            .arg("--physical-size")
            .arg(format!("{}K", cfg.zdisk_physical_bytes / 1024))
            .arg("--force"),
    )
    .context("formatting the capacity probe")?;
    let stat = super::zdisk_stat(&cfg.zdisk_bin, &probe);
    let _ = fs::remove_file(&probe);
    let native = stat?["native_capacity"].as_u64().context("zdisk stat --json has no native_capacity")?;
    Ok(native.min(cfg.size_bytes))
}

fn new_report(cfg: &Config, work: &Path, native_bytes: u64) -> Report {
    Report {
        schema: "zdisk-bench/1",
        command: command_line(),
        started_unix_s: crate::sys::unix_time(),
        wall_s: 0.0,
        comp_ratio: None,
        perf_multiplier: None,
        headline_basis: String::new(),
        by_data: Vec::new(),
        host: Host::probe(work),
        config: cfg.clone(),
        targets: cfg
            .targets
            .iter()
            .map(|&k| TargetInfo {
                key: k,
                title: k.title(),
                description: k.description(),
                o_direct: matches!(k, TargetKind::Raw | TargetKind::Zdisk),
            })
            .collect(),
        corpus: None,
        fills: Vec::new(),
        preconditioning: Vec::new(),
        results: Vec::new(),
        consistency: Vec::new(),
        zdisk_timeline: Vec::new(),
        notes: notes(cfg, native_bytes),
        errors: Vec::new(),
    }
}

fn progress_bar(estimate_ms: u64) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(estimate_ms), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% ~{eta} left · {msg}")
            .expect("static progress template")
            .progress_chars("=> "),
    );
    pb.enable_steady_tick(Duration::from_millis(250));
    pb
}

fn fmt_duration(ms: u64) -> String {
    let s = ms / 1000;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}
