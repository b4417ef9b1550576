//! The background threads: the writer (log write-out) and the worker (GC and checkpoints).
//!
//! Write-out has its own thread so a long GC pass never holds up the log writes that host
//! requests wait on under backpressure. Both stop when signalled, and do nothing once the
//! store has failed (it is read-only until reopened).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::background::WorkerSignal;
use super::gc::GcMode;
use super::idle::IdleWork;
use super::log::WRITE_OUT_THRESHOLD_BYTES;
use super::state::Inner;
use super::writeout::WriteOut;
use crate::error::{ErrorKind, Result};
use crate::SECTOR_SIZE;

#[derive(Debug, Clone, Copy)]
enum Thread {
    Writer,
    Worker,
}

/// Segments background GC cleans in one round before it frees what it can.
const GC_ROUND_SEGMENTS: u64 = 4;

impl Inner {
    /// Waits until kicked (or the timeout passes) and clears the kick; false when the
    /// thread must stop.
    fn wait_for_work(&self, thread: Thread) -> bool {
        let mut signal = self.background.wakeups.signal.lock();
        let (condvar, timeout) = match thread {
            Thread::Writer => (&self.background.wakeups.writer_cv, Duration::from_millis(50)),
            Thread::Worker => (&self.background.wakeups.signal_cv, Duration::from_millis(100)),
        };
        let kicked = |s: &WorkerSignal| match thread {
            Thread::Writer => s.kick_writer,
            Thread::Worker => s.kick,
        };
        if !kicked(&signal) && !signal.stop {
            signal.wait_for(condvar, timeout);
        }
        match thread {
            Thread::Writer => signal.kick_writer = false,
            Thread::Worker => signal.kick = false,
        }
        !signal.stop
    }

    pub(crate) fn writer_loop(&self) {
        while self.wait_for_work(Thread::Writer) {
            if self.health.check_writable().is_err() {
                continue;
            }
            let pending = {
                let log = self.log.lock();
                !log.appender.sealed_unwritten.is_empty()
                    || log
                        .appender
                        .open_segments()
                        .any(|o| o.append_offset_bytes - o.written_offset_bytes >= SECTOR_SIZE)
            };
            if pending {
                if let Err(e) = self.write_out(WriteOut::WholeSectors) {
                    tracing::warn!("log write-out: {e}");
                }
            }
        }
    }

    pub(crate) fn worker_loop(&self) {
        let mut idle = IdleWork::default();
        while self.wait_for_work(Thread::Worker) {
            if self.health.check_writable().is_err() {
                continue;
            }
            match self.background_step().and_then(|busy| Ok(busy || self.idle_step(&mut idle)?)) {
                Ok(true) => self.background.wakeups.kick_worker(),
                Ok(false) => {}
                // GC's relocations ran into its reserve: on a store at native capacity that
                // is the usual state between checkpoints, not news (it flooded the log).
                Err(e) if e.kind() == ErrorKind::NoSpace => tracing::debug!("background work: {e}"),
                Err(e) => tracing::warn!("background work: {e}"),
            }
        }
    }

    /// One round of background work; returns whether it did any GC or checkpoint work (the
    /// worker then goes again at once instead of sleeping).
    pub(crate) fn background_step(&self) -> Result<bool> {
        let (unwritten, sealed) = {
            let log = self.log.lock();
            (log.appender.unwritten_bytes(), log.appender.sealed_unwritten.len())
        };
        if sealed > 0 || unwritten >= WRITE_OUT_THRESHOLD_BYTES {
            self.write_out(WriteOut::WholeSectors)?;
        }
        // GC keeps a small cushion of free segments above the host reserve so host writes
        // rarely wait for it. Every free segment held back raises the utilisation GC works
        // at (and so its write amplification), so the cushion stays small: freeing a cleaned
        // segment usually costs one flush, not a checkpoint.
        let (free, reserve) = {
            let log = self.log.lock();
            (log.segments.free_count() as u64, self.reserves().host_segments())
        };
        let target = reserve + self.space.cushion_segments();
        let mut busy = false;
        let started = std::time::Instant::now();
        let mut gained_bytes = 0;
        let mut cleaned = 0;
        if free < target {
            while free + cleaned < target && cleaned < GC_ROUND_SEGMENTS {
                let Some(gained) = self.gc_once(GcMode::Background)? else { break };
                gained_bytes += gained;
                cleaned += 1;
                busy = true;
            }
            self.free_cleaned()?;
        }
        // A checkpoint when one is due, or early when cleaned segments wait only for the
        // reuse horizon to pass them (it takes two) and space is short.
        let (free, waiting, since) = {
            let log = self.log.lock();
            (log.segments.free_count() as u64, log.segments.has_cleaned(), log.epochs.bytes_since_checkpoint)
        };
        let urgent = waiting && free < target;
        // The map's changes take memory until a checkpoint writes them.
        let memory = self.map.read().wants_checkpoint();
        let checkpoint = since >= self.checkpoint_interval_bytes() || urgent || memory;
        if checkpoint {
            self.checkpoint_now()?;
            busy = true;
        }
        // GC's cost includes the checkpoints that make what it cleaned reusable.
        let elapsed = started.elapsed();
        self.space.pacer.note_gc(elapsed, gained_bytes);
        if busy {
            // What pacing is measured on (`ZDISK_LOG=zdisk_engine::gc=debug`).
            tracing::debug!(
                target: "zdisk_engine::gc",
                free,
                target,
                gained_bytes,
                victims = cleaned,
                checkpoint,
                urgent,
                memory,
                elapsed_us = elapsed.as_micros() as u64,
                gc_ps_per_byte = self.space.pacer.gc_ps_per_byte(),
                paced_wait_ms = self.space.pacer.paced_wait_ns() / 1_000_000,
                foreground_rounds = self.background.foreground_rounds.load(Ordering::Relaxed),
                "background step"
            );
        }
        Ok(busy)
    }
}

#[cfg(test)]
mod tests {
    use super::super::space::{pacing_band_segments, PACING_BAND_SEGMENTS_MAX};
    use super::*;

    #[test]
    fn the_pacing_band_is_wider_than_a_gc_step_and_does_not_grow_with_the_store() {
        // A 1 GiB store of 4 MiB segments (255), the full space bench's 511 of 1 MiB.
        assert_eq!(pacing_band_segments(255), 4);
        assert_eq!(pacing_band_segments(511), 7);
        // 4 TiB and 64 TiB of 4 MiB segments: 256 MiB either way, not 3% of the store.
        assert_eq!(pacing_band_segments(1 << 20), PACING_BAND_SEGMENTS_MAX);
        assert_eq!(pacing_band_segments(1 << 24), PACING_BAND_SEGMENTS_MAX);
        for segment_count in [2, 255, 511, 4096, 1 << 20] {
            assert!(pacing_band_segments(segment_count) >= GC_ROUND_SEGMENTS);
        }
    }
}
