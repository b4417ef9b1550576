//! `zdisk db bench`: the whitepaper's method (seeds/003) on this machine — the same database
//! and load on zdisk (doublewrite on and off) and on the same disk raw through the same
//! transport, raw with the database's own compression, and raw on a loop device directly.
//! What is measured and reported (configurations, presets, records) is in `crate::plan`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use zdisk_bench::sys::{self, progress, CpuTimes, DiskStat};

use crate::corpus;
use crate::db::{self, Db, Load, Server, ServerConfig};
use crate::plan::{settings, Capacity, CodecRatio, ConfigKey, CpuSplit, Point, Report, Settings, StackKind, Workload};
use crate::stack::{self, Ctx, Device, Mount};
use crate::throttle::DiskThrottle;
use crate::BenchArgs;

struct Stack {
    kind: StackKind,
    /// zdisk's (logical_size, physical_size) right after mkfs.
    base: Option<(u64, u64)>,
    // Field order is drop order: the filesystem goes before its device.
    mount: Mount,
    device: Device,
}

impl Stack {
    fn datadir(&self, db: Db) -> PathBuf {
        self.mount.dir.join(match db {
            Db::Mysql => "mysql",
            Db::Postgres => "pgdata",
        })
    }
}

fn statvfs_used(dir: &Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap_or_default();
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs writes into `s`; `c` is a valid NUL-terminated path.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return 0;
    }
    (s.f_blocks - s.f_bfree) * s.f_frsize
}

fn make_stack(ctx: &Ctx, s: &Settings, kind: StackKind, name: &str) -> Result<Stack> {
    let backing = ctx.work.join(format!("{name}.img"));
    let device = match kind {
        StackKind::Zdisk => {
            Device::zdisk_new(ctx, &ctx.work.join(format!("{name}.zdisk")), s.fs_size, s.fs_size, &s.zdisk_format_args)?
        }
        StackKind::Raw | StackKind::RawZlib => Device::raw_nbd(ctx, &backing, s.fs_size)?,
        StackKind::Loop => Device::raw_loop(ctx, &backing, s.fs_size)?,
    };
    stack::mkfs_ext4(&device.path)?;
    let mount = Mount::new(&device.path, &ctx.work.join(format!("mnt-{name}")), &s.mount_options)?;
    let base = zdisk_sizes(&device)?;
    Ok(Stack { kind, base, mount, device })
}

fn server_config(s: &Settings, guard: bool) -> ServerConfig {
    ServerConfig { buffer_pool: s.buffer_pool, log_file_size: s.log_file_size, torn_page_guard: guard }
}

fn start_server(ctx: &Ctx, db: Db, datadir: &Path, name: &str, cfg: &ServerConfig) -> Result<Server> {
    let log = ctx.work.join(format!("{name}.{}.log", db.name()));
    match db {
        Db::Mysql => db::mysql_start(datadir, &ctx.run_dir.join(format!("{name}.mysql.sock")), &log, cfg),
        Db::Postgres => db::pg_start(datadir, &ctx.run_dir.join(format!("pg-{name}")), &log, cfg),
    }
}

/// Loads the data set once into a seed directory on the host filesystem; every stack gets a
/// copy of it, so every target starts from the same pages.
fn load_seed(ctx: &Ctx, s: &Settings, lua: &Path, text: &Path, zlib: bool) -> Result<PathBuf> {
    let name = if zlib { "seed-zlib" } else { "seed-plain" };
    let dir = ctx.work.join(name).join("data");
    let load_cfg = ServerConfig { buffer_pool: 512 << 20, log_file_size: s.log_file_size, torn_page_guard: false };
    let t0 = Instant::now();
    match s.db {
        Db::Mysql => db::mysql_install(&dir)?,
        Db::Postgres => {
            std::fs::create_dir_all(dir.parent().unwrap())?;
            db::chown_postgres(dir.parent().unwrap())?;
            db::pg_initdb(&dir)?
        }
    }
    let server = start_server(ctx, s.db, &dir, name, &load_cfg)?;
    match s.db {
        Db::Mysql => {
            server.sql("", "CREATE DATABASE sbtest")?;
        }
        Db::Postgres => {
            server.sql("", "CREATE DATABASE sbtest")?;
        }
    }
    let uses_sysbench = s.workloads.iter().any(|w| *w != Workload::Pgbench);
    if uses_sysbench {
        progress(&format!(
            "loading {} tables x {} rows (modified schema{}) into {name}",
            s.tables,
            s.table_size,
            if zlib { ", ROW_FORMAT=COMPRESSED KEY_BLOCK_SIZE=8" } else { "" }
        ));
        let mut c = db::sysbench_command(&server, lua, text, s.tables, s.table_size)?;
        c.arg("--threads=2");
        if zlib {
            c.arg("--table_options=ROW_FORMAT=COMPRESSED KEY_BLOCK_SIZE=8");
        }
        c.arg("prepare");
        let load = Load::spawn(c, &ctx.work.join(format!("{name}.prepare.out")), "sysbench prepare")?;
        wait_plain(load, Duration::from_secs(6 * 3600))?;
    }
    if s.workloads.contains(&Workload::Pgbench) {
        progress(&format!("pgbench -i -s {} into {name}", s.pgbench_scale));
        let mut c = sys::cmd("pgbench")?;
        c.arg("-h")
            .arg(&server.socket)
            .args(["-U", "postgres", "-i", "-q", "-s"])
            .arg(s.pgbench_scale.to_string())
            .arg("sbtest");
        sys::run(&mut c).context("pgbench -i")?;
    }
    server.stop()?;
    progress(&format!("loaded {name} in {:.0} s", t0.elapsed().as_secs_f64()));
    Ok(dir)
}

/// Waits for a load process that prints no summary (sysbench prepare).
fn wait_plain(mut load: Load, timeout: Duration) -> Result<()> {
    let end = Instant::now() + timeout;
    while load.running() {
        sys::check_interrupt()?;
        if Instant::now() > end {
            bail!("loading did not finish within {} s", timeout.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // finish() reports a failed exit status; its parse error (no summary) is expected here.
    match load.finish(Duration::from_secs(1)) {
        Err(e) if format!("{e:#}").contains("failed (") => Err(e),
        _ => Ok(()),
    }
}

/// zdisk's (logical_size, physical_size) once the live statistics are fresh (synced first).
fn zdisk_sizes(dev: &Device) -> Result<Option<(u64, u64)>> {
    if dev.transport != stack::Transport::Zdisk {
        return Ok(None);
    }
    sys::run(&mut sys::cmd("sync")?)?;
    // The server rewrites its live statistics every second.
    sys::sleep(Duration::from_millis(2500))?;
    Ok(dev.zdisk_stat().map(|z| (z["logical_size"].as_u64().unwrap_or(0), z["physical_size"].as_u64().unwrap_or(0))))
}

fn delta_ratio(base: Option<(u64, u64)>, now: Option<(u64, u64)>) -> Option<f64> {
    let ((l0, p0), (l1, p1)) = (base?, now?);
    (p1 > p0).then(|| l1.saturating_sub(l0) as f64 / (p1 - p0) as f64)
}

fn capacity(stack: &Stack, db: Db, phase: &str) -> Capacity {
    let (files, allocated) = sys::tree_sizes(&stack.datadir(db));
    let now = zdisk_sizes(&stack.device).ok().flatten();
    let zdisk = stack.device.zdisk_stat();
    let backing_used = match &zdisk {
        Some(z) => z["physical_size"].as_u64().unwrap_or(0),
        None => sys::allocated_bytes(&stack.device.backing),
    };
    Capacity {
        stack: stack.kind.name().into(),
        phase: phase.into(),
        db_files_bytes: files,
        db_files_allocated_bytes: allocated,
        fs_used_bytes: statvfs_used(&stack.mount.dir),
        backing_used_bytes: backing_used,
        zdisk,
        zdisk_data_comp_ratio: delta_ratio(stack.base, now),
    }
}

fn host_info() -> serde_json::Value {
    serde_json::json!({
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": sys::cpu_model(),
        "kernel": sys::kernel_release(),
        "mem_total": std::fs::read_to_string("/proc/meminfo").unwrap_or_default().lines().next().unwrap_or("").to_string(),
        "loadavg_start": sys::loadavg(),
        "mariadbd": sys::tool_version("mariadbd"),
        "postgres": sys::tool_version("postgres"),
        "sysbench": sys::tool_version("sysbench"),
        "nbdkit": sys::tool_version("nbdkit"),
        "qemu_nbd": sys::tool_version("qemu-nbd"),
    })
}

struct Measure {
    cpu: CpuTimes,
    db: f64,
    server: f64,
    fuse: f64,
    client: f64,
    kernel: f64,
    disk: DiskStat,
    io: (u64, u64),
    t: Instant,
    load: String,
}

fn measure(server: &Server, dev: &Device) -> Measure {
    let storage = dev.server_pid().map(sys::tree_sample).unwrap_or_default();
    Measure {
        cpu: CpuTimes::now(),
        db: sys::tree_sample(server.pid).cpu_s,
        server: storage.cpu_s,
        fuse: dev.nbdfuse_pid().and_then(sys::process_cpu_s).unwrap_or(0.0),
        client: sys::children_cpu_s(),
        kernel: sys::kernel_threads_cpu_s(),
        disk: DiskStat::of(&dev.path),
        io: (storage.os_read_bytes.unwrap_or(0), storage.os_write_bytes.unwrap_or(0)),
        t: Instant::now(),
        load: sys::loadavg(),
    }
}

#[allow(clippy::too_many_arguments)]
fn workload_command(
    ctx: &Ctx,
    s: &Settings,
    server: &Server,
    w: Workload,
    threads: u32,
    secs: u32,
    lua: &Path,
    text: &Path,
    tag: &str,
) -> Result<(std::process::Command, PathBuf)> {
    let out = ctx.work.join("out").join(format!("{tag}.out"));
    if w == Workload::Pgbench {
        let mut c = sys::cmd("pgbench")?;
        let jobs = threads.min(2);
        c.arg("-h")
            .arg(&server.socket)
            .args(["-U", "postgres", "-n", "-P", "1", "-M", "prepared"])
            .arg(format!("-c{threads}"))
            .arg(format!("-j{jobs}"))
            .arg(format!("-T{secs}"))
            .arg("--log")
            .arg(format!("--log-prefix={}", ctx.work.join("out").join(format!("{tag}.pgbench")).display()))
            .arg("sbtest");
        return Ok((c, out));
    }
    let mut c = db::sysbench_command(server, lua, text, s.tables, s.table_size)?;
    c.arg(format!("--workload={}", w.key()))
        .arg(format!("--threads={threads}"))
        .arg(format!("--time={secs}"))
        .arg(format!("--rand-type={}", s.rand_type))
        .args(["--report-interval=1", "--percentile=95", "run"]);
    Ok((c, out))
}

#[allow(clippy::too_many_arguments)]
fn run_point(
    ctx: &Ctx,
    s: &Settings,
    server: &Server,
    dev: &Device,
    key: ConfigKey,
    w: Workload,
    threads: u32,
    round: u32,
    lua: &Path,
    text: &Path,
) -> Result<Point> {
    let tag = format!("r{round}-{}-{}-t{threads}", key.key(), w.key());
    if s.warmup_s > 0 {
        let (c, out) = workload_command(ctx, s, server, w, threads, s.warmup_s, lua, text, &format!("{tag}-warmup"))?;
        let kind = if w == Workload::Pgbench { "pgbench" } else { "sysbench" };
        Load::spawn(c, &out, kind)?.finish(Duration::from_secs(u64::from(s.warmup_s) + 300))?;
    }
    let (c, out) = workload_command(ctx, s, server, w, threads, s.time_s, lua, text, &tag)?;
    let kind = if w == Workload::Pgbench { "pgbench" } else { "sysbench" };
    let before = measure(server, dev);
    let mut load = Load::spawn(c, &out, kind)?.finish(Duration::from_secs(u64::from(s.time_s) + 600))?;
    let after = measure(server, dev);
    if w == Workload::Pgbench {
        load.p95_ms = db::pgbench_p95_ms(&ctx.work.join("out").join(format!("{tag}.pgbench"))).unwrap_or(0.0);
    }
    let wall = after.t.duration_since(before.t).as_secs_f64();
    let machine = after.cpu.minus(&before.cpu);
    let txn = (load.transactions.max(1)) as f64;
    let mut cpu = CpuSplit {
        db_s: after.db - before.db,
        server_s: after.server - before.server,
        nbdfuse_s: after.fuse - before.fuse,
        client_s: after.client - before.client,
        busy_s: machine.busy(),
        wall_s: wall,
        busy_pct: 100.0 * machine.busy() / machine.total().max(1e-9),
        iowait_pct: 100.0 * machine.iowait / machine.total().max(1e-9),
        idle_pct: 100.0 * machine.idle / machine.total().max(1e-9),
        machine,
        ..Default::default()
    };
    cpu.kernel_s = (after.kernel - before.kernel).max(0.0) + machine.irq;
    cpu.other_s = (cpu.busy_s - cpu.db_s - cpu.server_s - cpu.nbdfuse_s - cpu.client_s - cpu.kernel_s).max(0.0);
    let ms = |x: f64| 1000.0 * x / txn;
    cpu.db_ms_per_txn = ms(cpu.db_s);
    cpu.server_ms_per_txn = ms(cpu.server_s);
    cpu.transport_ms_per_txn = ms(cpu.nbdfuse_s + cpu.kernel_s);
    cpu.client_ms_per_txn = ms(cpu.client_s);
    cpu.total_ms_per_txn = ms(cpu.db_s + cpu.server_s + cpu.nbdfuse_s + cpu.kernel_s + cpu.client_s);
    let disk = after.disk.minus(&before.disk);
    let util = 100.0 * disk.io_ticks_ms as f64 / (wall * 1000.0).max(1.0);
    let bound = if cpu.busy_pct >= 90.0 {
        "cpu"
    } else if cpu.iowait_pct >= 15.0 || util >= 90.0 {
        "io"
    } else {
        "mixed"
    };
    let kib = |b: u64| b as f64 / 1024.0 / txn;
    Ok(Point {
        round,
        config: key,
        workload: w,
        threads,
        device_write_kib_per_txn: kib(disk.write_bytes),
        device_read_kib_per_txn: kib(disk.read_bytes),
        server_write_kib_per_txn: kib(after.io.1.saturating_sub(before.io.1)),
        server_read_bytes: after.io.0.saturating_sub(before.io.0),
        server_write_bytes: after.io.1.saturating_sub(before.io.1),
        load,
        cpu,
        device: disk,
        device_util_pct: util,
        bound: bound.into(),
        loadavg_before: before.load,
        loadavg_after: after.load,
        error: None,
    })
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let s = settings(a)?;
    sys::require_tools(&format!("zdisk db bench {}", s.db.name()), &s.db.tools())?;
    if unsafe { libc::geteuid() } != 0 {
        bail!("zdisk db bench needs root (mkfs, mount, losetup)");
    }
    let started = Instant::now();
    let base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let work = base.join(format!("zdisk-db-{}-{}", s.db.name(), sys::unix_time()));
    let out_dir =
        a.out.clone().unwrap_or_else(|| PathBuf::from(format!("zdisk-db-{}-{}", s.db.name(), sys::unix_time())));
    for dir in [work.join("out"), work.join("run"), out_dir.clone()] {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    sys::set_log_file(&out_dir.join("bench.log"))?;
    let zdisk_bin = zdisk_bench::zdisk_bin(&a.zdisk_bin)?;
    let ctx =
        Ctx { work: work.clone(), zdisk_bin, run_dir: sys::short_run_dir()?, serve_options: s.serve_options.clone() };
    progress(&format!(
        "zdisk db bench {} ({:?}): work dir {}, report {}",
        s.db.name(),
        s.preset,
        work.display(),
        out_dir.display()
    ));
    let estimate = s.configs.len() as u64
        * s.workloads.len() as u64
        * s.threads.len() as u64
        * u64::from(s.rounds)
        * u64::from(s.time_s + s.warmup_s + 4);
    progress(&format!("measured points take about {} min, plus loading and copying", estimate.div_ceil(60)));
    let mut report = Report {
        schema: "zdisk-db-bench/1",
        command: std::env::args().collect::<Vec<_>>().join(" "),
        settings: s.clone(),
        host: host_info(),
        loaded_rows: u64::from(s.tables) * s.table_size,
        text_lines: 0,
        points: Vec::new(),
        capacity: Vec::new(),
        codec_ratios: Vec::new(),
        offline: None,
        loop_dio: Vec::new(),
        notes: Vec::new(),
        errors: Vec::new(),
        wall_s: 0.0,
    };
    let result = run_inner(&ctx, &s, &mut report);
    if let Err(e) = &result {
        report.errors.push(format!("{e:#}"));
    }
    report.wall_s = started.elapsed().as_secs_f64();
    report.host["loadavg_end"] = serde_json::Value::String(sys::loadavg());
    crate::report::write(&out_dir, &report)?;
    progress(&format!("report: {}/summary.md, report.html, report.json", out_dir.display()));
    if !a.keep {
        let _ = std::fs::remove_dir_all(&work);
    }
    let _ = std::fs::remove_dir_all(&ctx.run_dir);
    result
}

fn run_inner(ctx: &Ctx, s: &Settings, report: &mut Report) -> Result<()> {
    // Made first, so a machine that cannot cap fails before minutes of loading.
    let throttle = s.disk_mbps.map(|mbps| DiskThrottle::new(&ctx.work, mbps)).transpose()?;
    let text = ctx.work.join("text.txt");
    report.text_lines = corpus::write_text_lines(&text)?;
    let lua = ctx.work.join("zdisk_oltp.lua");
    std::fs::write(&lua, db::LUA)?;
    progress(&format!("text corpus: {} lines", report.text_lines));

    let need_zlib = s.configs.contains(&ConfigKey::RawZlib);
    let need_plain = s.configs.iter().any(|c| *c != ConfigKey::RawZlib);
    let seed_plain = if need_plain { Some(load_seed(ctx, s, &lua, &text, false)?) } else { None };
    let seed_zlib = if need_zlib { Some(load_seed(ctx, s, &lua, &text, true)?) } else { None };

    // One stack per storage kind, all attached for the whole run; one database at a time.
    let mut stacks = make_stacks(ctx, s, report, seed_plain.as_ref(), seed_zlib.as_ref())?;
    if let Some(t) = &throttle {
        cap_servers(t, &stacks)?;
    }

    let mut turn = 0usize;
    for round in 1..=s.rounds {
        for &w in &s.workloads {
            // Rotate the starting configuration each workload and round, so slow drift of the
            // machine does not always fall on the same target.
            let order: Vec<ConfigKey> =
                zdisk_bench::target_order(s.configs.len(), turn).into_iter().map(|i| s.configs[i]).collect();
            turn += 1;
            for &key in &order {
                sys::check_interrupt()?;
                let st = stacks.iter().find(|st| st.kind == key.stack()).context("stack")?;
                let cfg = server_config(s, key.guard());
                let server = start_server(ctx, s.db, &st.datadir(s.db), key.key(), &cfg)?;
                for &threads in &s.threads {
                    progress(&format!(
                        "round {round}/{}: {} on {} ({}), {threads} threads, load {}",
                        s.rounds,
                        w.key(),
                        key.key(),
                        key.label(s.db),
                        sys::loadavg()
                    ));
                    match run_point(ctx, s, &server, &st.device, key, w, threads, round, &lua, &text) {
                        Ok(p) => {
                            progress(&format!(
                                "  {:.1} tps, p95 {:.1} ms, CPU {:.2} ms/txn (db {:.2}, server {:.2}, transport {:.2}), busy {:.0}% iowait {:.0}% -> {}",
                                p.load.tps,
                                p.load.p95_ms,
                                p.cpu.total_ms_per_txn,
                                p.cpu.db_ms_per_txn,
                                p.cpu.server_ms_per_txn,
                                p.cpu.transport_ms_per_txn,
                                p.cpu.busy_pct,
                                p.cpu.iowait_pct,
                                p.bound
                            ));
                            report.points.push(p);
                        }
                        Err(e) => {
                            sys::check_interrupt()?;
                            progress(&format!("  failed: {e:#}"));
                            report.errors.push(format!("{} {} {threads}: {e:#}", key.key(), w.key()));
                        }
                    }
                }
                server.stop()?;
            }
        }
    }

    if let Some(t) = throttle {
        let (read, written) = t.io_bytes();
        report.notes.push(format!(
            "--disk-mbps: the storage servers' reads and writes to disk {} were capped at {} MB/s each way \
             (cgroup blkio) during the points; under the cap they read {:.0} MiB and wrote {:.0} MiB",
            t.device,
            t.bytes_per_s / 1_000_000,
            read as f64 / 1048576.0,
            written as f64 / 1048576.0
        ));
    }
    for st in &stacks {
        report.capacity.push(capacity(st, s.db, "end"));
    }
    // Offline codecs over the raw stack's final database files, 4 KiB at a time.
    if let Some(st) = stacks.iter().find(|st| st.kind == StackKind::Raw || st.kind == StackKind::Zdisk) {
        measure_codec_ratios(ctx, s, st, report)?;
    }
    for st in stacks.drain(..).rev() {
        let Stack { mount, device, .. } = st;
        mount.unmount()?;
        device.detach()?;
    }
    Ok(())
}

/// Puts every stack's storage server under the cap (after the data set is copied in:
/// loading is not what is measured).
fn cap_servers(throttle: &DiskThrottle, stacks: &[Stack]) -> Result<()> {
    for st in stacks {
        let pids = st.device.server_pids();
        if pids.is_empty() {
            bail!("stack {} has no storage server to cap", st.kind.name());
        }
        for pid in pids {
            throttle.add(pid)?;
        }
    }
    progress(&format!(
        "storage servers capped at {} MB/s each way on disk {}",
        throttle.bytes_per_s / 1_000_000,
        throttle.device
    ));
    Ok(())
}

/// One stack per storage kind the configurations need, each holding a copy of its loaded
/// seed database; notes each one's direct I/O and its capacity as loaded.
fn make_stacks(
    ctx: &Ctx,
    s: &Settings,
    report: &mut Report,
    seed_plain: Option<&PathBuf>,
    seed_zlib: Option<&PathBuf>,
) -> Result<Vec<Stack>> {
    let mut stacks: Vec<Stack> = Vec::new();
    for key in &s.configs {
        let kind = key.stack();
        if stacks.iter().any(|st| st.kind == kind) {
            continue;
        }
        progress(&format!("stack {}: device, ext4, copy of the loaded data", kind.name()));
        let st = make_stack(ctx, s, kind, kind.name())?;
        let seed = if kind == StackKind::RawZlib { seed_zlib } else { seed_plain };
        let datadir = st.datadir(s.db);
        stack::copy_tree(seed.context("seed")?, &datadir)?;
        if s.db == Db::Postgres {
            db::chown_postgres(&st.mount.dir)?;
        }
        report.loop_dio.push((kind.name().into(), st.device.dio));
        if !st.device.dio {
            report.notes.push(format!("stack {}: the loop device does NOT use direct I/O", kind.name()));
        }
        report.capacity.push(capacity(&st, s.db, "loaded"));
        stacks.push(st);
    }
    Ok(stacks)
}

/// The offline codecs' ratios over `st`'s final database files (4 KiB at a time), and
/// zdisk's `comp_ratio` with each of `--ratio-codecs` holding a copy of them.
fn measure_codec_ratios(ctx: &Ctx, s: &Settings, st: &Stack, report: &mut Report) -> Result<()> {
    let files = sys::files_with_suffix(&st.datadir(s.db), &[".ibd", "ibdata1", ""]);
    let files: Vec<PathBuf> = files.into_iter().filter(|p| is_table_file(s.db, p)).collect();
    progress(&format!("offline LZ4/zstd/DEFLATE over {} database files ({} stack)", files.len(), st.kind.name()));
    report.offline = Some(corpus::offline_ratios(&files)?);
    // zdisk formatted with each codec, holding the same final database files.
    for codec in &s.ratio_codecs {
        sys::check_interrupt()?;
        progress(&format!("comp_ratio with --codec {codec}: copy of the final database files"));
        let name = format!("ratio-{}", codec.replace(':', "-"));
        let store = ctx.work.join(format!("{name}.zdisk"));
        let dev = Device::zdisk_new(ctx, &store, s.fs_size, s.fs_size, &["--codec".to_string(), codec.clone()])?;
        stack::mkfs_ext4(&dev.path)?;
        let m = Mount::new(&dev.path, &ctx.work.join(format!("mnt-{name}")), &s.mount_options)?;
        let base = zdisk_sizes(&dev)?;
        stack::copy_tree(&st.datadir(s.db), &m.dir.join("data"))?;
        let (files_bytes, _) = sys::tree_sizes(&m.dir.join("data"));
        let now = zdisk_sizes(&dev)?;
        let z = dev.zdisk_stat().unwrap_or_default();
        report.codec_ratios.push(CodecRatio {
            codec: codec.clone(),
            data_comp_ratio: delta_ratio(base, now).unwrap_or(0.0),
            comp_ratio: z["comp_ratio"].as_f64().unwrap_or(0.0),
            physical_size: z["physical_size"].as_u64().unwrap_or(0),
            logical_size: z["logical_size"].as_u64().unwrap_or(0),
            db_files_bytes: files_bytes,
        });
        m.unmount()?;
        dev.detach()?;
        let _ = std::fs::remove_file(&store);
    }
    Ok(())
}

/// The files that hold table data: InnoDB tablespaces and system tablespace; PostgreSQL's
/// relation files under base/.
fn is_table_file(db: Db, p: &Path) -> bool {
    let s = p.to_string_lossy();
    match db {
        Db::Mysql => s.ends_with(".ibd") || s.ends_with("ibdata1"),
        Db::Postgres => {
            s.contains("/base/")
                && p.file_name()
                    .map(|n| n.to_string_lossy().chars().all(|c| c.is_ascii_digit() || c == '.'))
                    .unwrap_or(false)
        }
    }
}
