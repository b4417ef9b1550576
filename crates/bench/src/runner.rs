//! The benchmark procedure: purge, fill, precondition, queue-depth sweep, consistency test —
//! for every data mode and workload, alternating between the targets. `setup` starts a run
//! (checks, targets, the report's skeleton) and `run` drives it; `phases` holds the
//! measuring phases (preconditioning, the points, the consistency test); this file the
//! plan, the fills and purges, and fio/stat plumbing.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;

use crate::corpus::Corpus;
use crate::fio::{self, DataArgs, FioJob, FioOutcome};
use crate::plan::{DataMode, TargetKind, WorkloadKind};
use crate::results::{
    fmt_int, ConsistencyRecord, FillRecord, Host, JobCost, JobResult, PreconditionRecord, Report, StatSample,
    TargetInfo,
};
use crate::server::{qemu_nbd_raw, require_tool, sparse_file, Server};
use crate::size::fmt_size;
use crate::steady::{self, WINDOW_ROUNDS};
use crate::sys::tree_sample;
use crate::{Config, Preset};

mod phases;
mod setup;

pub use setup::run;

/// Rough per-invocation cost of starting fio and connecting, for the time estimate.
const FIO_OVERHEAD_MS: u64 = 400;
const GIB: f64 = (1u64 << 30) as f64;

struct Target {
    kind: TargetKind,
    server: Option<Server>,
    /// zdisk store or raw image (unused for memory).
    file: PathBuf,
    socket: PathBuf,
    log: PathBuf,
    /// Bytes of the export the jobs use (smaller than the size with extra spare area).
    range_bytes: u64,
    /// Counts formats, so the timeline does not join unrelated stores.
    format_gen: u32,
}

struct Bench<'a> {
    cfg: &'a Config,
    fio: PathBuf,
    fio_dir: PathBuf,
    targets: Vec<Target>,
    report: Report,
    pb: ProgressBar,
    log: fs::File,
    t0: Instant,
    corpus: Option<Corpus>,
    stat_failures: u32,
    job_seq: u32,
    /// The native capacity of a zdisk store of the run's physical size: what incompressible
    /// data can always fill and overwrite, so what every target exposes in that mode.
    native_bytes: u64,
}

fn zdisk_stat(bin: &Path, store: &Path) -> Result<Value> {
    crate::sys::zdisk_stat(Command::new(bin), store)
}

/// Estimated sequential fill rate for the progress bar's time estimate.
fn fill_rate_bytes_per_ms(kind: TargetKind) -> f64 {
    match kind {
        TargetKind::Memory => 1_500_000.0,
        _ => 400_000.0,
    }
}

impl Bench<'_> {
    fn say(&mut self, msg: &str) {
        let _ = writeln!(self.log, "[{:8.1}s] {msg}", self.t0.elapsed().as_secs_f64());
        if self.pb.is_hidden() {
            eprintln!("{msg}");
        } else {
            self.pb.println(msg);
        }
    }

    fn check_stop(&self) -> Result<()> {
        if crate::sys::interrupted() {
            bail!("interrupted");
        }
        Ok(())
    }

    /// RAM has no wear or garbage-collection state to bring to steady state (and the fill has
    /// already allocated every page), so the memory ceiling is never preconditioned.
    fn uses_precondition(&self, kind: TargetKind, w: WorkloadKind) -> bool {
        self.cfg.max_rounds > 0 && kind != TargetKind::Memory && (w.writes() || self.cfg.precondition_reads)
    }

    fn fill_est_ms(&self, kind: TargetKind, range: u64) -> u64 {
        FIO_OVERHEAD_MS + (range as f64 * self.cfg.fill_passes as f64 / fill_rate_bytes_per_ms(kind)) as u64
    }

    fn precondition_est_ms(&self) -> u64 {
        let c = self.cfg;
        let first = WINDOW_ROUNDS as u64 * c.round_ms + c.log_ms / 2 + FIO_OVERHEAD_MS;
        let more =
            c.max_rounds.saturating_sub(WINDOW_ROUNDS as u32) as u64 * (c.round_ms + c.log_ms / 2 + FIO_OVERHEAD_MS);
        if (c.max_rounds as usize) < WINDOW_ROUNDS {
            c.max_rounds as u64 * c.round_ms + FIO_OVERHEAD_MS
        } else {
            first + more
        }
    }

    fn measure_est_ms(&self) -> u64 {
        self.cfg.runtime_ms + self.cfg.ramp_ms + FIO_OVERHEAD_MS
    }

    fn consistency_targets(&self) -> Vec<usize> {
        (0..self.targets.len()).filter(|&i| self.targets[i].kind.has_disk()).collect()
    }

    /// The range every target exposes for `data`, minus `spare_pct` extra spare area:
    /// incompressible data on zdisk's native capacity (`native_bytes`), other data on the
    /// whole size.
    fn spare_range(&self, data: DataMode, spare_pct: u32) -> u64 {
        let full = if data == DataMode::Incompressible { self.native_bytes } else { self.cfg.size_bytes };
        full * (100 - spare_pct as u64) / 100 / (1 << 20) * (1 << 20)
    }

    /// Upper-bound estimate of the whole run (preconditioning may stop early).
    fn estimate_ms(&self) -> u64 {
        let c = self.cfg;
        let mut total = 0;
        for &data in &c.data {
            let fills: u64 = self.targets.iter().map(|t| self.fill_est_ms(t.kind, self.spare_range(data, 0))).sum();
            total += if c.purge_each_workload { fills * c.workloads.len() as u64 } else { fills };
            for &w in &c.workloads {
                for t in &self.targets {
                    total += if self.uses_precondition(t.kind, w) { self.precondition_est_ms() } else { 0 }
                        + c.qds.len() as u64 * self.measure_est_ms();
                }
            }
            if c.consistency_ms > 0 {
                for &spare in &c.spare_pcts {
                    for &i in &self.consistency_targets() {
                        total += self.fill_est_ms(self.targets[i].kind, self.spare_range(data, spare))
                            + c.consistency_ms
                            + FIO_OVERHEAD_MS;
                    }
                }
            }
        }
        total
    }

    /// After the run, stopped early or not: stops the servers (so zdisk has flushed its final
    /// state), completes the report and writes it.
    fn finish(&mut self, outcome: &Result<()>) -> Result<()> {
        for t in &mut self.targets {
            if let Some(mut s) = t.server.take() {
                if let Err(e) = s.stop() {
                    self.report.errors.push(format!("stopping {}: {e:#}", t.kind.key()));
                }
            }
        }
        self.pb.finish_and_clear();
        self.report.wall_s = self.t0.elapsed().as_secs_f64();
        self.report.host.loadavg_end = crate::sys::loadavg();
        if let Err(e) = outcome {
            self.report.errors.push(format!("benchmark stopped early: {e:#}"));
        }
        self.report.summarize();
        self.report.write_all(&self.cfg.out)
    }

    /// A run that measured but lacks zdisk's statistics, or had a failed step, is an error:
    /// the report is written and marks them.
    fn verdict(&self) -> Result<()> {
        let zdisk_points = self.report.results.iter().filter(|r| r.target == TargetKind::Zdisk && r.error.is_none());
        if zdisk_points.clone().count() > 0 && zdisk_points.clone().all(|r| r.cost.comp_ratio.is_none()) {
            bail!("`zdisk stat --json` gave no statistics for any zdisk point; the report lacks comp_ratio and write amplification");
        }
        if !self.report.errors.is_empty() {
            bail!(
                "{} step(s) failed (first: {}); the report in {} marks them",
                self.report.errors.len(),
                self.report.errors[0].lines().next().unwrap_or(""),
                self.cfg.out.display()
            );
        }
        Ok(())
    }

    fn run_all(&mut self) -> Result<()> {
        let cfg = self.cfg;
        let n = self.targets.len();
        for (di, &data) in cfg.data.iter().enumerate() {
            if data == DataMode::Real && self.corpus.is_none() {
                self.pb.set_message("finding real files for the real-data mode");
                let corpus = Corpus::find(cfg.size_bytes.min(2 << 30))?;
                self.say(&format!(
                    "real data: {} files, {} distinct bytes from {:?}; LZ4 4K ratio {:.2} -> writes use buffer_compress_percentage={}",
                    corpus.summary.files,
                    fmt_size(corpus.summary.distinct_bytes),
                    corpus.summary.roots,
                    corpus.summary.lz4_4k_ratio,
                    corpus.summary.write_compress_pct
                ));
                self.report.corpus = Some(corpus.summary.clone());
                self.corpus = Some(corpus);
            }
            for (wi, &w) in cfg.workloads.iter().enumerate() {
                // Rotate which target goes first so drift is spread over all of them.
                let order = crate::target_order(n, wi + di);
                if cfg.purge_each_workload || wi == 0 {
                    for &ti in &order {
                        self.check_stop()?;
                        let range = self.spare_range(data, 0);
                        self.purge_and_fill(ti, data, range, &format!("before {}", w.title()));
                    }
                }
                for &ti in &order {
                    self.check_stop()?;
                    if self.uses_precondition(self.targets[ti].kind, w) {
                        self.precondition(ti, data, w)?;
                    }
                    for &qd in &cfg.qds {
                        self.check_stop()?;
                        self.measure(ti, data, w, qd)?;
                    }
                }
            }
            if cfg.consistency_ms > 0 {
                let ct = self.consistency_targets();
                for (si, &spare) in cfg.spare_pcts.iter().enumerate() {
                    for k in 0..ct.len() {
                        let ti = ct[(k + si) % ct.len()];
                        self.check_stop()?;
                        let range = self.spare_range(data, spare);
                        self.purge_and_fill(ti, data, range, &format!("consistency +{spare}% spare"));
                        self.consistency_run(ti, data, spare)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Fresh format / fresh file / fresh server, then the sequential fill. Failures are recorded
    /// (the target's later jobs then fail visibly) rather than ending the run.
    fn purge_and_fill(&mut self, ti: usize, data: DataMode, range: u64, phase: &str) {
        let kind = self.targets[ti].kind;
        self.pb.set_message(format!("{}: purge + fill {} ({})", kind.key(), fmt_size(range), data.key()));
        let est = self.fill_est_ms(kind, range);
        if let Err(e) = self.purge(ti, range) {
            let msg = format!("purge of {} ({}, {phase}): {e:#}", kind.key(), data.key());
            self.say(&format!("ERROR {msg}"));
            self.report.errors.push(msg);
            self.pb.inc(est);
            return;
        }
        self.fill(ti, data, phase);
        self.pb.inc(est);
    }

    fn purge(&mut self, ti: usize, range: u64) -> Result<()> {
        let cfg = self.cfg;
        let t = &mut self.targets[ti];
        if let Some(mut s) = t.server.take() {
            s.stop()?;
        }
        t.range_bytes = range;
        t.format_gen += 1;
        let label = t.kind.title();
        let cmd = match t.kind {
            TargetKind::Zdisk => {
                crate::sys::run(
                    Command::new(&cfg.zdisk_bin)
                        .arg("format")
                        .arg(&t.file)
                        .arg("--physical-size")
                        .arg(format!("{}K", cfg.zdisk_physical_bytes / 1024))
                        .arg("--logical-size")
                        .arg(format!("{}K", range / 1024))
                        .arg("--force"),
                )?;
                let mut c = Command::new(&cfg.zdisk_bin);
                c.arg("serve").arg(&t.file).arg("--unix").arg(&t.socket);
                // No idle work unless asked: the targets' servers stay up side by side, and
                // zdisk recompressing while the raw target is measured would take its cores
                // (docs/space.md, "Idle work"; `ZDISK_IDLE_AFTER_MS` set turns it on).
                if std::env::var_os("ZDISK_IDLE_AFTER_MS").is_none() {
                    c.env("ZDISK_IDLE_AFTER_MS", "0");
                }
                c
            }
            TargetKind::Raw | TargetKind::NbdkitFile => {
                // A new sparse file is the raw disk's "secure erase"; the fills allocate it.
                sparse_file(&t.file, cfg.size_bytes)?;
                if t.kind == TargetKind::Raw {
                    qemu_nbd_raw(&t.file, &t.socket, 8)
                } else {
                    let mut c = Command::new("nbdkit");
                    c.args(["--foreground", "--exit-with-parent", "--unix"])
                        .arg(&t.socket)
                        .arg("file")
                        .arg(format!("file={}", t.file.display()))
                        .arg("cache=none");
                    c
                }
            }
            TargetKind::Memory => {
                let mut c = Command::new("nbdkit");
                c.args(["--foreground", "--exit-with-parent", "--unix"])
                    .arg(&t.socket)
                    .arg("memory")
                    .arg(format!("size={}", cfg.size_bytes));
                c
            }
        };
        t.server = Some(Server::spawn(label, cmd, &t.socket, &t.log)?);
        Ok(())
    }

    fn data_args(&self, data: DataMode) -> DataArgs {
        DataArgs {
            compress_pct: data
                .compress_pct()
                .or_else(|| self.corpus.as_ref().map(|c| c.summary.write_compress_pct))
                .unwrap_or(0),
        }
    }

    fn job(&self, ti: usize, name: String, rw: &str, bs: &str, qd: u32, data: DataMode) -> FioJob {
        let t = &self.targets[ti];
        FioJob {
            name,
            uri: t.server.as_ref().map(|s| s.uri()).unwrap_or_default(),
            rw: rw.to_string(),
            bs: Some(bs.to_string()),
            bssplit: None,
            rwmixread_pct: None,
            qd,
            range_bytes: t.range_bytes,
            runtime_ms: None,
            ramp_ms: 0,
            loops: 1,
            data: self.data_args(data),
            log_ms: self.cfg.log_ms,
        }
    }

    fn workload_job(
        &self,
        ti: usize,
        w: WorkloadKind,
        qd: u32,
        data: DataMode,
        runtime_ms: u64,
        ramp_ms: u64,
    ) -> FioJob {
        let mut j = self.job(ti, w.key().to_string(), w.fio_rw(), "4k", qd, data);
        j.bs = w.fio_bs().map(str::to_string);
        j.bssplit = w.fio_bssplit().map(str::to_string);
        j.rwmixread_pct = w.rwmixread_pct();
        j.runtime_ms = Some(runtime_ms);
        j.ramp_ms = ramp_ms;
        j
    }

    fn next_stem(&mut self, data: DataMode, what: &str, kind: TargetKind) -> String {
        self.job_seq += 1;
        format!("{:04}-{}-{}-{}", self.job_seq, data.slug(), what, kind.key())
    }

    /// `zdisk stat --json` of target `ti` (None for other targets). A failure is retried for
    /// about a second (just after start-up the server may not have published its statistics
    /// yet); a lasting one is a warning in the report, and a run where no zdisk point got
    /// statistics is an error (see `run`).
    fn stat_now(&mut self, ti: usize) -> Option<Value> {
        let t = &self.targets[ti];
        if t.kind != TargetKind::Zdisk {
            return None;
        }
        let mut last_err = None;
        for attempt in 0..6 {
            if attempt > 0 {
                std::thread::sleep(Duration::from_millis(200));
            }
            match zdisk_stat(&self.cfg.zdisk_bin, &t.file) {
                Ok(v) => return Some(v),
                Err(e) => last_err = Some(e),
            }
        }
        self.stat_failures += 1;
        if let Some(e) = last_err {
            let msg = format!("zdisk stat failed (failure {}): {e:#}", self.stat_failures);
            self.say(&format!("WARNING {msg}"));
            if self.stat_failures <= 3 {
                self.report.notes.push(format!("WARNING: {msg}"));
            }
        }
        None
    }

    /// `zdisk stat` of a served store reads a snapshot the plugin rewrites every second; for
    /// per-job deltas wait (briefly) for one taken after `since_unix_ms`.
    fn stat_fresh(&mut self, ti: usize, since_unix_ms: u64) -> Option<Value> {
        let started = Instant::now();
        loop {
            let v = self.stat_now(ti);
            let updated = v.as_ref().and_then(|v| v.get("updated_unix_ms")).and_then(Value::as_u64);
            let fresh = updated.is_none_or(|u| u >= since_unix_ms);
            if !self.cfg.fresh_stats || fresh || started.elapsed() > Duration::from_millis(2500) {
                return v;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn push_sample(&mut self, ti: usize, data: DataMode, phase: &str, v: &Option<Value>) {
        if let Some(v) = v {
            let s = StatSample::from_stat(self.t0.elapsed().as_secs_f64(), data, phase, self.targets[ti].format_gen, v);
            self.report.zdisk_timeline.push(s);
        }
    }

    /// Runs `work` against target `ti` and measures the server's CPU, writes and zdisk stats
    /// around it. `work` gets the poll callback to call while it waits.
    fn measured<T>(
        &mut self,
        ti: usize,
        data: DataMode,
        phase: &str,
        work: impl FnOnce(&Path, &mut dyn FnMut() -> Result<()>) -> Result<T>,
    ) -> Result<(T, JobCost, f64)> {
        let t = &mut self.targets[ti];
        let server = t
            .server
            .as_mut()
            .ok_or_else(|| anyhow!("{} is not running (its purge failed; see above)", t.kind.key()))?;
        if !server.alive() {
            bail!(server.describe_exit());
        }
        let pid = server.pid().unwrap_or(0);
        let is_zdisk = t.kind == TargetKind::Zdisk;
        let store = t.file.clone();
        let gen = t.format_gen;
        let stat_before = self.stat_now(ti);
        self.push_sample(ti, data, phase, &stat_before);
        let before = tree_sample(pid);
        let started = Instant::now();

        let bin = self.cfg.zdisk_bin.clone();
        let interval = Duration::from_millis(self.cfg.stat_interval_ms);
        let t0 = self.t0;
        let mut last = Instant::now();
        let mut samples = Vec::new();
        let mut poll = || -> Result<()> {
            if crate::sys::interrupted() {
                bail!("interrupted");
            }
            if is_zdisk && last.elapsed() >= interval {
                last = Instant::now();
                if let Ok(v) = zdisk_stat(&bin, &store) {
                    samples.push(StatSample::from_stat(t0.elapsed().as_secs_f64(), data, phase, gen, &v));
                }
            }
            Ok(())
        };
        let result = work(&self.fio, &mut poll);
        self.report.zdisk_timeline.extend(samples);
        let value = result?;
        let wall_s = started.elapsed().as_secs_f64();
        let after = tree_sample(pid);
        let stat_after = self.stat_fresh(ti, crate::sys::unix_time_ms());
        self.push_sample(ti, data, phase, &stat_after);
        let f = |v: &Option<Value>, k: &str| v.as_ref().and_then(|v| v.get(k)).and_then(Value::as_f64);
        let job_wa = match (
            f(&stat_before, "host_write_bytes"),
            f(&stat_after, "host_write_bytes"),
            f(&stat_before, "backing_write_bytes"),
            f(&stat_after, "backing_write_bytes"),
        ) {
            (Some(h0), Some(h1), Some(b0), Some(b1)) if h1 > h0 => Some((b1 - b0) / (h1 - h0)),
            _ => None,
        };
        let cost = JobCost {
            server_cpu_s: after.cpu_s - before.cpu_s,
            gib_moved: 0.0,
            server_cpu_s_per_gib: None,
            client_cpu_pct: 0.0,
            os_write_amplification: match (before.os_write_bytes, after.os_write_bytes) {
                (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64),
                _ => None,
            },
            comp_ratio: f(&stat_after, "comp_ratio"),
            write_amplification: f(&stat_after, "write_amplification"),
            job_write_amplification: job_wa,
            zdisk_stat: stat_after,
        };
        Ok((value, cost, wall_s))
    }

    /// Runs one fio job with full accounting.
    fn fio_job(
        &mut self,
        ti: usize,
        data: DataMode,
        phase: &str,
        job: FioJob,
        stem: &str,
    ) -> Result<(FioOutcome, JobCost)> {
        let fio_dir = self.fio_dir.clone();
        let (out, mut cost, _) =
            self.measured(ti, data, phase, |fio_bin, poll| fio::run(fio_bin, &job, &fio_dir, stem, poll))?;
        finish_cost(&mut cost, out.bytes(), out.write.io_bytes);
        cost.client_cpu_pct = out.client_cpu_pct;
        Ok((out, cost))
    }

    fn fill(&mut self, ti: usize, data: DataMode, phase: &str) {
        let kind = self.targets[ti].kind;
        let range = self.targets[ti].range_bytes;
        let passes = self.cfg.fill_passes.max(1);
        let stem = self.next_stem(data, "fill", kind);
        let phase_label = format!("fill ({phase})");
        let res: Result<(f64, JobCost, String)> = if data == DataMode::Real {
            self.real_fill(ti, data, &phase_label, range, passes)
        } else {
            let mut job = self.job(ti, "fill".into(), "write", "128k", self.cfg.fill_qd, data);
            job.loops = passes;
            self.fio_job(ti, data, &phase_label, job, &stem).map(|(o, c)| {
                (o.write.bw_bytes_per_s / 1e6, c, format!("fio 128K sequential write QD{}", self.cfg.fill_qd))
            })
        };
        let (mb_per_s, cost, tool, error) = match res {
            Ok((mb, c, tool)) => (mb, c, tool, None),
            Err(e) => {
                let msg = format!("fill of {} ({}, {phase}): {e:#}", kind.key(), data.key());
                self.say(&format!("ERROR {msg}"));
                self.report.errors.push(msg.clone());
                (0.0, JobCost::default(), String::new(), Some(msg))
            }
        };
        if error.is_none() {
            self.say(&format!(
                "[{}] fill {} {} x{passes}: {mb_per_s:.0} MB/s{}",
                data.key(),
                kind.key(),
                fmt_size(range),
                cost.comp_ratio.map(|r| format!(", comp_ratio {r:.2}")).unwrap_or_default()
            ));
        }
        self.report.fills.push(FillRecord {
            data,
            target: kind,
            phase: phase.to_string(),
            range_bytes: range,
            passes,
            tool,
            secs: if mb_per_s > 0.0 { range as f64 * passes as f64 / 1e6 / mb_per_s } else { 0.0 },
            mb_per_s,
            cost,
            error,
        });
    }

    /// Streams the real-file corpus onto the target with nbdcopy, `passes` times.
    fn real_fill(
        &mut self,
        ti: usize,
        data: DataMode,
        phase: &str,
        range: u64,
        passes: u32,
    ) -> Result<(f64, JobCost, String)> {
        let corpus = self.corpus.take().ok_or_else(|| anyhow!("real-data corpus missing"))?;
        let uri = self.targets[ti].server.as_ref().map(|s| s.uri()).unwrap_or_default();
        let res = self.measured(ti, data, phase, |_fio, poll| {
            for _ in 0..passes {
                let mut child = Command::new("nbdcopy")
                    .arg("--")
                    .arg("-")
                    .arg(&uri)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .context("starting nbdcopy")?;
                let mut stdin = child.stdin.take().ok_or_else(|| anyhow!("nbdcopy stdin"))?;
                let mut sink = PollingWriter { inner: &mut stdin, poll, since: Instant::now() };
                let streamed = corpus.stream(range, &mut sink);
                drop(stdin);
                let out = child.wait_with_output()?;
                streamed?;
                if !out.status.success() {
                    bail!("nbdcopy failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
                }
            }
            Ok(())
        });
        self.corpus = Some(corpus);
        let ((), mut cost, wall_s) = res?;
        let bytes = range * passes as u64;
        finish_cost(&mut cost, bytes, bytes);
        Ok((bytes as f64 / 1e6 / wall_s.max(1e-9), cost, "nbdcopy of real files, sequential".into()))
    }
}

/// Turns the raw counters in `cost` into per-GiB and per-byte figures. On entry
/// `os_write_amplification` holds the raw OS write bytes of the job.
fn finish_cost(cost: &mut JobCost, bytes_moved: u64, bytes_written: u64) {
    cost.gib_moved = bytes_moved as f64 / GIB;
    cost.server_cpu_s_per_gib = (bytes_moved > 0).then(|| cost.server_cpu_s / cost.gib_moved);
    cost.os_write_amplification =
        cost.os_write_amplification.and_then(|os_bytes| (bytes_written > 0).then(|| os_bytes / bytes_written as f64));
}

/// A writer that calls the poll callback now and then, so a long real-data fill still answers
/// Ctrl-C and samples zdisk statistics.
struct PollingWriter<'a, 'b> {
    inner: &'a mut dyn Write,
    poll: &'b mut dyn FnMut() -> Result<()>,
    since: Instant,
}

impl Write for PollingWriter<'_, '_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.since.elapsed() > Duration::from_millis(100) {
            self.since = Instant::now();
            (self.poll)().map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        self.inner.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
