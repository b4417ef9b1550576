//! Request metrics measured in the plugin, and their Prometheus/JSON rendering.
//!
//! Invariants:
//! - every request the plugin serves is counted exactly once, in its op's [`OpMetrics`],
//!   with its latency in exactly one histogram bucket (the last bucket catches everything
//!   slower than the largest bound);
//! - counters only grow (relaxed atomics: a scrape may see a request counted but its bucket
//!   not yet, never the reverse of a completed request disappearing);
//! - rendering never takes a lock the request path takes.
//!
//! Nothing here references nbdkit symbols, so it stays testable and reusable.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use zdisk_engine::{Stats, StoreInfo};

/// The request kinds a front end serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Trim,
    Zero,
    Flush,
    Extents,
}

impl Op {
    pub const ALL: [Op; 6] = [Op::Read, Op::Write, Op::Trim, Op::Zero, Op::Flush, Op::Extents];

    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Trim => "trim",
            Op::Zero => "zero",
            Op::Flush => "flush",
            Op::Extents => "extents",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Histogram upper bounds in microseconds: 1 µs, 2 µs, 4 µs ... 2^23 µs (~8.4 s).
pub const BUCKET_COUNT: usize = 24;

fn bucket_bound_micros(bucket: usize) -> u64 {
    1u64 << bucket
}

fn bucket_of(micros: u64) -> usize {
    // Smallest k with micros <= 2^k; everything slower lands in the last bucket, and
    // is still counted in the +Inf bucket (count) when rendered.
    if micros <= 1 {
        return 0;
    }
    let k = 64 - (micros - 1).leading_zeros() as usize;
    k.min(BUCKET_COUNT - 1)
}

#[derive(Default)]
pub struct OpMetrics {
    pub count: AtomicU64,
    pub errors: AtomicU64,
    pub bytes: AtomicU64,
    pub micros_sum: AtomicU64,
    /// Non-cumulative: `buckets[k]` counts requests with latency in (2^(k-1), 2^k] µs,
    /// except the last bucket, which also holds everything slower.
    buckets: [AtomicU64; BUCKET_COUNT],
    /// Requests slower than the largest bound (subset of the last bucket, for +Inf).
    overflow: AtomicU64,
}

#[derive(Default)]
pub struct Metrics {
    ops: [OpMetrics; Op::ALL.len()],
}

impl Metrics {
    pub fn record(&self, op: Op, bytes: u64, elapsed: Duration, ok: bool) {
        let m = &self.ops[op.index()];
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        m.count.fetch_add(1, Ordering::Relaxed);
        if !ok {
            m.errors.fetch_add(1, Ordering::Relaxed);
        }
        m.bytes.fetch_add(bytes, Ordering::Relaxed);
        m.micros_sum.fetch_add(micros, Ordering::Relaxed);
        if micros > bucket_bound_micros(BUCKET_COUNT - 1) {
            m.overflow.fetch_add(1, Ordering::Relaxed);
        } else {
            m.buckets[bucket_of(micros)].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn op(&self, op: Op) -> &OpMetrics {
        &self.ops[op.index()]
    }

    /// Per-op counters as JSON: `{"read": {"count":..,"errors":..,"bytes":..,"micros_sum":..}}`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut object = serde_json::Map::new();
        for op in Op::ALL {
            let m = self.op(op);
            object.insert(
                op.name().to_string(),
                serde_json::json!({
                    "count": m.count.load(Ordering::Relaxed),
                    "errors": m.errors.load(Ordering::Relaxed),
                    "bytes": m.bytes.load(Ordering::Relaxed),
                    "micros_sum": m.micros_sum.load(Ordering::Relaxed),
                }),
            );
        }
        serde_json::Value::Object(object)
    }
}

fn escape_label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

type CounterField = fn(&OpMetrics) -> &AtomicU64;

/// Renders the Prometheus text exposition format (version 0.0.4).
pub fn render_prometheus(info: &StoreInfo, stats: &Stats, metrics: &Metrics) -> String {
    let mut out = String::with_capacity(16 << 10);
    let uuid = escape_label(&info.uuid);
    let _ = writeln!(out, "# HELP zdisk_info The served store (value is always 1).");
    let _ = writeln!(out, "# TYPE zdisk_info gauge");
    let _ = writeln!(
        out,
        "zdisk_info{{uuid=\"{uuid}\",codec=\"{}\",format_version=\"{}\"}} 1",
        escape_label(&info.codec),
        info.format_version
    );

    let _ = writeln!(out, "# HELP zdisk_state The store's state (value 1; ok, degraded, read_only or failed).");
    let _ = writeln!(out, "# TYPE zdisk_state gauge");
    let _ = writeln!(
        out,
        "zdisk_state{{uuid=\"{uuid}\",state=\"{}\",reason=\"{}\"}} 1",
        stats.state.name(),
        escape_label(&stats.state_reason)
    );

    // Every engine statistic, under its engine name (docs/nbd.md lists them): counters
    // (`is_counter_stat`: they only grow) as `zdisk_<name>_total`, the rest as gauges. Sizes
    // are bytes; comp_ratio and write_amplification are ratios; space_flag is 0/1/2.
    if let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(stats) {
        for (name, value) in fields {
            let Some(number) = value.as_f64() else { continue };
            let (metric, kind) = match zdisk_engine::is_counter_stat(&name) {
                true => (format!("zdisk_{name}_total"), "counter"),
                false => (format!("zdisk_{name}"), "gauge"),
            };
            let _ = writeln!(out, "# HELP {metric} zdisk engine statistic {name}.");
            let _ = writeln!(out, "# TYPE {metric} {kind}");
            if value.is_f64() {
                let _ = writeln!(out, "{metric}{{uuid=\"{uuid}\"}} {number}");
            } else {
                let _ = writeln!(out, "{metric}{{uuid=\"{uuid}\"}} {value}");
            }
        }
    }

    let counters: [(&str, &str, CounterField); 3] = [
        ("zdisk_requests_total", "NBD requests served by the plugin.", |m| &m.count),
        ("zdisk_request_errors_total", "NBD requests that returned an error.", |m| &m.errors),
        ("zdisk_request_bytes_total", "Bytes covered by NBD requests.", |m| &m.bytes),
    ];
    for (name, help, field) in counters {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} counter");
        for op in Op::ALL {
            let value = field(metrics.op(op)).load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}{{uuid=\"{uuid}\",op=\"{}\"}} {value}", op.name());
        }
    }

    let name = "zdisk_request_duration_seconds";
    let _ = writeln!(out, "# HELP {name} Latency of NBD requests inside the plugin.");
    let _ = writeln!(out, "# TYPE {name} histogram");
    for op in Op::ALL {
        let m = metrics.op(op);
        let mut cumulative = 0u64;
        for bucket in 0..BUCKET_COUNT {
            cumulative += m.buckets[bucket].load(Ordering::Relaxed);
            let le = bucket_bound_micros(bucket) as f64 / 1e6;
            let _ = writeln!(out, "{name}_bucket{{uuid=\"{uuid}\",op=\"{}\",le=\"{le}\"}} {cumulative}", op.name());
        }
        let count = cumulative + m.overflow.load(Ordering::Relaxed);
        let sum = m.micros_sum.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_bucket{{uuid=\"{uuid}\",op=\"{}\",le=\"+Inf\"}} {count}", op.name());
        let _ = writeln!(out, "{name}_sum{{uuid=\"{uuid}\",op=\"{}\"}} {sum}", op.name());
        let _ = writeln!(out, "{name}_count{{uuid=\"{uuid}\",op=\"{}\"}} {count}", op.name());
    }
    out
}
