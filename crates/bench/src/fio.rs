//! Building fio command lines for the nbd engine, running them, and reading their JSON and
//! per-interval IOPS logs.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use serde_json::Value;

/// How fio fills its write buffers.
#[derive(Clone, Debug, Serialize)]
pub struct DataArgs {
    /// fio `buffer_compress_percentage` (0 = incompressible random bytes).
    pub compress_pct: u32,
}

impl DataArgs {
    fn push(&self, args: &mut Vec<String>) {
        // refill_buffers: new random bytes for every I/O, so nothing dedups or caches by content.
        args.push("--refill_buffers".into());
        if self.compress_pct > 0 {
            args.push(format!("--buffer_compress_percentage={}", self.compress_pct));
            // Compressibility per 4 KiB block: zdisk compresses 4 KiB blocks independently.
            args.push("--buffer_compress_chunk=4096".into());
        }
    }
}

/// One fio job against one NBD export.
#[derive(Clone, Debug)]
pub struct FioJob {
    pub name: String,
    pub uri: String,
    pub rw: String,
    pub bs: Option<String>,
    pub bssplit: Option<String>,
    pub rwmixread_pct: Option<u32>,
    pub qd: u32,
    /// Range of the export the job touches, from offset 0.
    pub range_bytes: u64,
    /// Time-based run length; None = run over the range `loops` times (the fill).
    pub runtime_ms: Option<u64>,
    pub ramp_ms: u64,
    pub loops: u32,
    pub data: DataArgs,
    /// Per-interval IOPS log averaging window.
    pub log_ms: u64,
}

impl FioJob {
    pub fn args(&self, output: &Path, log_prefix: &Path) -> Vec<String> {
        let mut a: Vec<String> = vec![
            format!("--name={}", self.name),
            "--ioengine=nbd".into(),
            format!("--uri={}", self.uri),
            format!("--rw={}", self.rw),
            format!("--iodepth={}", self.qd),
            "--numjobs=1".into(),
            format!("--size={}", self.range_bytes),
            // Fresh random offsets every run, and no random map: time-based random runs revisit
            // blocks, as a real workload does.
            "--randrepeat=0".into(),
            "--norandommap".into(),
            "--random_generator=tausworthe64".into(),
            format!("--output={}", output.display()),
            "--output-format=json".into(),
            format!("--write_iops_log={}", log_prefix.display()),
            format!("--log_avg_msec={}", self.log_ms),
            "--per_job_logs=0".into(),
        ];
        if let Some(bs) = &self.bs {
            a.push(format!("--bs={bs}"));
        }
        if let Some(split) = &self.bssplit {
            a.push(format!("--bssplit={split}"));
        }
        if let Some(mix) = self.rwmixread_pct {
            a.push(format!("--rwmixread={mix}"));
        }
        match self.runtime_ms {
            Some(ms) => {
                a.push("--time_based".into());
                a.push(format!("--runtime={ms}ms"));
                if self.ramp_ms > 0 {
                    a.push(format!("--ramp_time={}ms", self.ramp_ms));
                }
            }
            None => a.push(format!("--loops={}", self.loops.max(1))),
        }
        self.data.push(&mut a);
        a
    }
}

/// One direction's numbers from fio's JSON.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct DirStats {
    pub iops: f64,
    pub bw_bytes_per_s: f64,
    pub io_bytes: u64,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub p999_us: Option<f64>,
    pub mean_lat_us: Option<f64>,
}

/// What one fio run measured.
#[derive(Clone, Debug, Default)]
pub struct FioOutcome {
    pub read: DirStats,
    pub write: DirStats,
    /// fio's own CPU (user+sys percent of one core), to see the client side too.
    pub client_cpu_pct: f64,
    pub runtime_s: f64,
    /// IOPS per `log_ms` interval (reads and writes summed), as logged by fio.
    pub iops_per_interval: Vec<f64>,
}

impl FioOutcome {
    pub fn iops(&self) -> f64 {
        self.read.iops + self.write.iops
    }
    pub fn bytes(&self) -> u64 {
        self.read.io_bytes + self.write.io_bytes
    }
}

fn dir_stats(v: &Value) -> DirStats {
    let f = |p: &str| v.pointer(p).and_then(Value::as_f64);
    let io_bytes = v.get("io_bytes").and_then(Value::as_u64).unwrap_or(0);
    let pct =
        |k: &str| v.pointer("/clat_ns/percentile").and_then(|p| p.get(k)).and_then(Value::as_f64).map(|ns| ns / 1000.0);
    DirStats {
        iops: f("/iops").unwrap_or(0.0),
        bw_bytes_per_s: f("/bw_bytes").unwrap_or(0.0),
        io_bytes,
        p50_us: pct("50.000000").filter(|_| io_bytes > 0),
        p99_us: pct("99.000000").filter(|_| io_bytes > 0),
        p999_us: pct("99.900000").filter(|_| io_bytes > 0),
        mean_lat_us: f("/lat_ns/mean").map(|ns| ns / 1000.0).filter(|_| io_bytes > 0),
    }
}

/// Parses fio's JSON output file.
pub fn parse_output(path: &Path) -> Result<FioOutcome> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    // Some engines print notices before the JSON; start at the first '{'.
    let start = text.find('{').ok_or_else(|| anyhow!("no JSON in {}", path.display()))?;
    let v: Value =
        serde_json::from_str(&text[start..]).with_context(|| format!("parsing fio JSON {}", path.display()))?;
    let job = v.pointer("/jobs/0").ok_or_else(|| anyhow!("fio JSON {} has no jobs", path.display()))?;
    let err = job.get("error").and_then(Value::as_i64).unwrap_or(0);
    if err != 0 {
        bail!("fio job reported error {err} ({})", std::io::Error::from_raw_os_error(err as i32));
    }
    let num = |k: &str| job.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    Ok(FioOutcome {
        read: dir_stats(job.get("read").unwrap_or(&Value::Null)),
        write: dir_stats(job.get("write").unwrap_or(&Value::Null)),
        client_cpu_pct: num("usr_cpu") + num("sys_cpu"),
        runtime_s: num("job_runtime") / 1000.0,
        iops_per_interval: Vec::new(),
    })
}

/// Parses a `--write_iops_log` file ("time_ms, value, direction, bs, offset[, prio]") into IOPS
/// per interval, summing reads and writes that fall into the same interval.
pub fn parse_iops_log(path: &Path, log_ms: u64) -> Vec<f64> {
    let Ok(text) = fs::read_to_string(path) else {
        return Vec::new();
    };
    let mut buckets: Vec<f64> = Vec::new();
    for line in text.lines() {
        let mut f = line.split(',').map(str::trim);
        let (Some(t), Some(v)) = (f.next(), f.next()) else {
            continue;
        };
        let (Ok(t_ms), Ok(value)) = (t.parse::<u64>(), v.parse::<f64>()) else {
            continue;
        };
        // fio stamps each averaged sample near a multiple of log_ms (1000, 2001, 3000, ...).
        let idx = ((t_ms + log_ms / 2) / log_ms).saturating_sub(1) as usize;
        if buckets.len() <= idx {
            buckets.resize(idx + 1, 0.0);
        }
        buckets[idx] += value;
    }
    buckets
}

/// Runs fio to completion, calling `poll` about every 20 ms (for Ctrl-C and live statistics).
/// Writes `<stem>.json`, `<stem>_iops.log` and `<stem>.stderr` under `dir`.
pub fn run(
    fio: &Path,
    job: &FioJob,
    dir: &Path,
    stem: &str,
    poll: &mut dyn FnMut() -> Result<()>,
) -> Result<FioOutcome> {
    let output = dir.join(format!("{stem}.json"));
    let log_prefix = dir.join(stem);
    let log_file = dir.join(format!("{stem}_iops.log"));
    let stderr_path = dir.join(format!("{stem}.stderr"));
    let _ = fs::remove_file(&output);
    let _ = fs::remove_file(&log_file);
    let args = job.args(&output, &log_prefix);
    let stderr = fs::File::create(&stderr_path)?;
    let mut child = Command::new(fio)
        .args(&args)
        .stdin(Stdio::null())
        // The nbd engine prints to stdout; the JSON goes to --output.
        .stdout(stderr.try_clone()?)
        .stderr(stderr)
        .spawn()
        .with_context(|| format!("starting {}", fio.display()))?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if let Err(e) = poll() {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let wall = started.elapsed();
    if !status.success() {
        bail!(
            "fio {} failed ({status}) after {:.1}s: {}\n  command: fio {}",
            job.name,
            wall.as_secs_f64(),
            crate::server::tail(&stderr_path, 8),
            args.join(" ")
        );
    }
    let mut out = parse_output(&output)?;
    out.iops_per_interval = parse_iops_log(&log_file, job.log_ms);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iops_log_sums_directions_per_interval() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x_iops.log");
        fs::write(&p, "1000, 100, 0, 4096, 0\n1000, 50, 1, 4096, 0\n2001, 120, 0, 4096, 0\n3000, 10, 1, 4096, 0\n")
            .unwrap();
        assert_eq!(parse_iops_log(&p, 1000), vec![150.0, 120.0, 10.0]);
    }
}
