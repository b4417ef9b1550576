//! Pacing host writes against GC (docs/space.md, "Pacing").
//!
//! Without pacing, host writes run at full speed until the free space reaches the host
//! reserve, then every writer stalls behind a foreground GC round that cleans many victims
//! at once: at native capacity the worst writes took hundreds of milliseconds while the
//! median took well under one. With it, once the free space above the host reserve falls
//! into the pacing band (the background worker's cushion, where background GC runs), each
//! host write is admitted on one shared clock: its slot is as long as GC's measured cost of
//! giving back that many bytes, scaled by how deep into the band the store is — under 1x
//! above the band's middle, growing without bound towards the reserve. The write rate then
//! settles where GC keeps up, and the wait is spread evenly over all writes.
//!
//! The clock is shared, not per writer, so the pace does not depend on how many requests
//! are in flight (at queue depth 32 a per-write delay would be 32 times too weak).
//!
//! It is on unless `OpenOptions::pacing` is false (`ZDISK_PACING=off`). First measured on
//! 2026-11-23 it cut the tail but cost throughput, and stayed opt-in; measured again on
//! 2026-11-26 (GC's cold stream and reserve fixes came in between; which change turned it
//! is not known) it cut p99.9 write latency at native capacity from ~62 ms to 7–9 ms *and*
//! raised throughput by a third, with write amplification 3.75 → 3.18 (likely: background
//! GC works in the wider band while host writes wait their turn, rather than foreground
//! rounds cleaning under pressure), and became the default (docs/space.md, "Pacing").
//!
//! Invariants: pacing only delays a write — it never refuses one, holds no lock while it
//! waits, and waits at most `WAIT_MAX` per write (foreground GC in `admit` stays the
//! backstop); it does nothing until the background worker has measured GC, so a store
//! without background threads behaves exactly as before.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The longest one write waits for its slot. Past it the write goes, and the foreground GC
/// of `admit` takes over if space runs out.
const WAIT_MAX: Duration = Duration::from_millis(100);
/// The slot's scale at the bottom of the band (the scale is (1 − f) / f for f, the share of
/// the band still free, bounded here).
const SCALE_MAX: f64 = 64.0;
/// Weight of a new GC measurement in the running estimate (1/8: a few rounds' memory).
const GC_COST_NEW_WEIGHT: f64 = 0.125;
/// The widest pacing band (256 MiB of 4 MiB segments; docs/space.md, "Pacing's band").
pub(crate) const PACING_BAND_SEGMENTS_MAX: u64 = 64;

/// Free segments the background worker keeps above the host reserve; host writes are
/// paced once the free space falls below it (`Space::pace_host_write`). Without pacing, a
/// smaller cushion of its own.
pub(crate) fn cushion_segments(pacing: bool, segment_count: u64) -> u64 {
    match pacing {
        true => pacing_band_segments(segment_count),
        false => (segment_count / 256).max(2),
    }
}

/// The pacing band of a store of `segment_count` segments. It absorbs what host writes take
/// while GC gives space back (a step of up to the worker's `GC_ROUND_SEGMENTS` victims,
/// then the checkpoint that frees them), which does not grow with the store; every segment
/// in it is held free and raises the utilisation GC works at (docs/space.md, "Pacing's
/// band").
pub(crate) fn pacing_band_segments(segment_count: u64) -> u64 {
    (segment_count / 64).clamp(4, PACING_BAND_SEGMENTS_MAX)
}

pub(crate) struct Pacer {
    epoch: Instant,
    /// Nanoseconds after `epoch` from which the next paced write may go.
    next_slot_ns: AtomicU64,
    /// Background GC's wall-clock cost per byte of space it gave back, in picoseconds
    /// (a running average); 0 until GC has run.
    gc_ps_per_byte: AtomicU64,
    paced_writes: AtomicU64,
    paced_wait_ns: AtomicU64,
}

impl Pacer {
    pub fn new() -> Pacer {
        Pacer {
            epoch: Instant::now(),
            next_slot_ns: AtomicU64::new(0),
            gc_ps_per_byte: AtomicU64::new(0),
            paced_writes: AtomicU64::new(0),
            paced_wait_ns: AtomicU64::new(0),
        }
    }

    /// Records a background GC pass that took `elapsed` and gave back `gained_bytes`.
    pub fn note_gc(&self, elapsed: Duration, gained_bytes: u64) {
        if gained_bytes == 0 {
            return;
        }
        let sample = elapsed.as_nanos() as f64 * 1000.0 / gained_bytes as f64;
        let old = self.gc_ps_per_byte.load(Ordering::Relaxed) as f64;
        let new = if old == 0.0 { sample } else { old + GC_COST_NEW_WEIGHT * (sample - old) };
        self.gc_ps_per_byte.store(new.max(1.0) as u64, Ordering::Relaxed);
    }

    /// GC's measured cost per byte given back, in picoseconds (0: not measured yet).
    pub fn gc_ps_per_byte(&self) -> u64 {
        self.gc_ps_per_byte.load(Ordering::Relaxed)
    }

    /// How long a host write of `bytes` waits for its slot when `slack_bytes` of the
    /// `band_bytes` pacing band are still free above the host reserve. Takes the slot.
    pub fn wait_for(&self, bytes: u64, slack_bytes: u64, band_bytes: u64) -> Duration {
        let now_ns = self.epoch.elapsed().as_nanos() as u64;
        let cost_ps = self.gc_ps_per_byte();
        if cost_ps == 0 || slack_bytes >= band_bytes || band_bytes == 0 {
            // Above the band nothing is owed: a later descent into it starts afresh.
            self.next_slot_ns.fetch_min(now_ns, Ordering::Relaxed);
            return Duration::ZERO;
        }
        let slot_ns = (bytes as f64 * cost_ps as f64 / 1000.0 * scale(slack_bytes, band_bytes)) as u64;
        let start_ns = match self
            .next_slot_ns
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |next| Some(next.max(now_ns) + slot_ns))
        {
            Ok(previous) | Err(previous) => previous.max(now_ns),
        };
        let wait = Duration::from_nanos(start_ns - now_ns).min(WAIT_MAX);
        if !wait.is_zero() {
            self.paced_writes.fetch_add(1, Ordering::Relaxed);
            self.paced_wait_ns.fetch_add(wait.as_nanos() as u64, Ordering::Relaxed);
        }
        wait
    }

    /// Writes that waited for a slot since open.
    pub fn paced_writes(&self) -> u64 {
        self.paced_writes.load(Ordering::Relaxed)
    }

    /// Their total wait, in nanoseconds.
    pub fn paced_wait_ns(&self) -> u64 {
        self.paced_wait_ns.load(Ordering::Relaxed)
    }
}

/// The slot's scale when the share `slack / band` of the pacing band is still free: 1 at
/// the middle (host writes at GC's pace), below 1 above it, growing towards the reserve.
fn scale(slack_bytes: u64, band_bytes: u64) -> f64 {
    let free_share = slack_bytes as f64 / band_bytes as f64;
    ((1.0 - free_share) / free_share).min(SCALE_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_waits_before_gc_is_measured_or_above_the_band() {
        let pacer = Pacer::new();
        assert_eq!(pacer.wait_for(4096, 0, 1 << 20), Duration::ZERO);
        pacer.note_gc(Duration::from_millis(10), 1 << 20);
        assert_eq!(pacer.wait_for(4096, 1 << 20, 1 << 20), Duration::ZERO);
        assert_eq!(pacer.wait_for(4096, 2 << 20, 1 << 20), Duration::ZERO);
    }

    #[test]
    fn slots_queue_on_one_clock_and_lengthen_towards_the_reserve() {
        let pacer = Pacer::new();
        // 1 ms per MiB given back: a 1 MiB write at the band's middle takes a 1 ms slot.
        pacer.note_gc(Duration::from_millis(1), 1 << 20);
        let first = pacer.wait_for(1 << 20, 512 << 10, 1 << 20);
        let second = pacer.wait_for(1 << 20, 512 << 10, 1 << 20);
        assert!(first < Duration::from_micros(200), "{first:?}");
        assert!(second > Duration::from_micros(700) && second < Duration::from_micros(1100), "{second:?}");
        // Deeper into the band, each slot is longer.
        let deep = Pacer::new();
        deep.note_gc(Duration::from_millis(1), 1 << 20);
        deep.wait_for(1 << 20, 128 << 10, 1 << 20);
        let after_deep = deep.wait_for(1 << 20, 128 << 10, 1 << 20);
        assert!(after_deep > Duration::from_micros(6000), "{after_deep:?}");
        // Waits are bounded.
        for _ in 0..200 {
            assert!(deep.wait_for(1 << 20, 1, 1 << 20) <= WAIT_MAX);
        }
    }

    #[test]
    fn the_scale_is_one_at_the_middle_of_the_band() {
        assert!((scale(50, 100) - 1.0).abs() < 1e-9);
        assert!(scale(90, 100) < 0.2);
        assert!(scale(10, 100) > 8.0);
        assert_eq!(scale(0, 100), SCALE_MAX);
    }
}
