//! Whether the machine has a core to spare for idle work (docs/space.md, "Idle work").
//!
//! The drive zdisk imitates recompresses on cores of its own; zdisk shares the host's. Idle
//! work (training, recompression) takes a core for as long as it runs, so it waits while
//! other processes use the cores: a store whose host is away is not a machine that is idle
//! (a database on another device, or another target of `zdisk db bench`, would pay for it).
//! Lowering the worker's priority instead would not do: a recompression step holds the GC
//! and checkpoint locks, and a starved holder would stall the host's next write behind it.
//!
//! The measure, from Linux's `/proc/stat` (all CPUs) and `/proc/self/stat`, between two
//! looks at least `SAMPLE_INTERVAL` apart: the cores' time not used by other processes —
//! idle and I/O wait, plus this process's own (what idle work would take anyway) — in
//! cores. Steal counts as used. Where `/proc` cannot be read, every core is taken as spare
//! (the behaviour before this check). At most half the cores are asked for (a one-core
//! machine would otherwise need everything else to stop). Limit: `/proc/stat` counts the
//! whole machine's cores while `cores` is what this process may use (affinity, cgroup
//! quota), so in a container confined to a few cores of a big host the measure is the
//! host's idle share scaled to those cores.

use std::time::{Duration, Instant};

/// Idle work runs while other processes leave at least this many cores (the default of
/// `OpenOptions::idle_spare_cores`).
pub const SPARE_CORES_MIN: f64 = 1.0;

/// The shortest time between two looks (shorter ones would measure noise).
const SAMPLE_INTERVAL: Duration = Duration::from_millis(500);

/// CPU times as `/proc` counts them (clock ticks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct CpuTicks {
    /// Summed over every field of the `cpu` line: all cores' time.
    pub total: u64,
    /// Idle and I/O wait.
    pub idle: u64,
    /// This process's user and system time.
    pub own: u64,
}

/// Spare cores between two samples, of `cores` cores: the share of all cores' time left
/// idle or used by this process, in cores. None when no time passed.
pub(crate) fn spare_cores(before: CpuTicks, after: CpuTicks, cores: usize) -> Option<f64> {
    let total = after.total.checked_sub(before.total)?;
    if total == 0 {
        return None;
    }
    let idle = after.idle.saturating_sub(before.idle);
    let own = after.own.saturating_sub(before.own);
    Some(((idle + own).min(total) as f64 / total as f64) * cores as f64)
}

/// Parses the aggregate `cpu` line of `/proc/stat` (user nice system idle iowait irq
/// softirq steal ...) into (total, idle + iowait).
fn parse_proc_stat(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line.split_whitespace().skip(1).map(|f| f.parse().ok()).collect::<Option<_>>()?;
    // Guest time (fields 9 and 10) is already counted in user and nice.
    let total = fields.iter().take(8).sum();
    let idle = fields.get(3)? + fields.get(4).copied().unwrap_or(0);
    Some((total, idle))
}

/// Parses `/proc/self/stat` into utime + stime (fields 14 and 15, counted after the
/// command name, which may hold spaces and parentheses).
fn parse_self_stat(text: &str) -> Option<u64> {
    let after_name = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Field 3 (state) is the first after the name: utime is field 14, at index 11.
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

fn read_ticks() -> Option<CpuTicks> {
    let (total, idle) = parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?)?;
    let own = parse_self_stat(&std::fs::read_to_string("/proc/self/stat").ok()?)?;
    Some(CpuTicks { total, idle, own })
}

/// The idle worker's view of the machine: the last sample and what it concluded.
#[derive(Debug)]
pub(crate) struct SpareCpu {
    cores: usize,
    last: Option<(Instant, CpuTicks)>,
    spare: bool,
}

impl Default for SpareCpu {
    fn default() -> SpareCpu {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Nothing measured yet: not spare until two samples say so.
        SpareCpu { cores, last: None, spare: false }
    }
}

impl SpareCpu {
    /// Whether other processes leave `spare_cores_min` cores, from the time since the last
    /// sample taken at least `SAMPLE_INTERVAL` ago (until then, what that sample said; no
    /// after the first).
    pub(crate) fn core_is_spare(&mut self, spare_cores_min: f64) -> bool {
        if spare_cores_min <= 0.0 {
            return true;
        }
        // On one core, "one core spare" would be "nothing else runs at all".
        let needed = spare_cores_min.min(self.cores as f64 / 2.0);
        let now = Instant::now();
        if self.last.is_some_and(|(at, _)| now.duration_since(at) < SAMPLE_INTERVAL) {
            return self.spare;
        }
        let Some(ticks) = read_ticks() else { return true };
        if let Some((_, before)) = self.last {
            if let Some(spare) = spare_cores(before, ticks, self.cores) {
                if self.spare && spare < needed {
                    tracing::debug!("idle work waits: {spare:.2} cores spare of {}", self.cores);
                }
                self.spare = spare >= needed;
            }
        }
        self.last = Some((now, ticks));
        self.spare
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spare_cores_count_idle_and_own_time_and_not_others() {
        let before = CpuTicks { total: 1000, idle: 500, own: 100 };
        // 2 cores for 1 s at 100 ticks/s: 200 ticks. Others used 150 of them, zdisk 30.
        let after = CpuTicks { total: 1200, idle: 520, own: 130 };
        let spare = spare_cores(before, after, 2).unwrap();
        assert!((spare - 0.5).abs() < 1e-9, "{spare}");
        assert!(spare < SPARE_CORES_MIN);
        // Others idle: everything not idle is zdisk's own.
        let after = CpuTicks { total: 1200, idle: 600, own: 200 };
        assert!((spare_cores(before, after, 2).unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(spare_cores(before, before, 2), None);
    }

    #[test]
    fn proc_files_parse() {
        let stat = "cpu  100 5 50 800 20 3 2 7 0 0\ncpu0 50 2 25 400 10 1 1 3 0 0\nintr 1 2 3\n";
        assert_eq!(parse_proc_stat(stat), Some((987, 820)));
        let self_stat = "4242 (nbdkit (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 37 12 0 0 20 0 16 0";
        assert_eq!(parse_self_stat(self_stat), Some(49));
        assert_eq!(parse_proc_stat("intr 1\n"), None);
        assert_eq!(parse_self_stat("garbage"), None);
        // This machine's own files parse (Linux, where the tests run).
        assert!(read_ticks().is_some());
    }
}
