//! Foreground GC: what a host request that does not fit does before it is refused with
//! ENOSPC (`request.rs`, `Inner::admit`, calls one round at a time). A round frees what is
//! cleaned; then, while the request still does not fit, cleans a few segments and frees
//! them; when they wait for the reuse horizon, checkpoints (at most twice) to move it past
//! them. docs/space.md, "Reserves and running out of space".
//!
//! Invariants: one writer runs a round at a time (the others wait for it and retry the
//! append); a round that gives back nothing, by its own failure, ends the request's
//! attempt — a checkpoint costs space too — while room that the background worker gave back
//! meanwhile only sends the writer to retry; a refused request has had no effect.

use std::sync::atomic::Ordering;

use super::capacity::{Reserves, SpaceClass};
use super::gc::GcMode;
use super::log::LogGuard;
use super::request::EXHAUSTED;
use super::state::Inner;
use super::writeout::WriteOut;
use crate::error::{Error, ErrorKind, Result};
use crate::stats::Counters;

/// Victims one foreground GC round may clean (bounds the pause of the write that waits).
const FOREGROUND_GC_VICTIMS_MAX: usize = 16;
/// The same for a round that must also pay for its checkpoints (see `clean_for`): at native
/// capacity a victim may give back only the over-provisioning's share of a segment.
const PAYING_GC_VICTIMS_MAX: usize = 256;

/// What `clean_for` did: segments cleaned and freed, and whether a victim's relocation was
/// refused for lack of space (GC's reserve, or no free segment to open).
struct Cleaning {
    cleaned: usize,
    freed: usize,
    /// The last refusal's message, if any.
    relocation_short: Option<String>,
}

/// What a round's checkpoints did: how many were written, the segments they freed, and
/// why the last one failed for lack of space, if it did.
struct Checkpointing {
    checkpoints: u64,
    freed: usize,
    failed: Option<Error>,
}

/// What a host request lacked when it was refused.
#[derive(Clone, Copy)]
pub(super) struct Short {
    pub shortfall_bytes: u64,
    /// Available when it was refused: a round that finds the space given back meanwhile
    /// (by the background worker, while the writer waited for the round) only retries.
    pub available_bytes: u64,
}

/// What a foreground GC round tells the waiting writer.
pub(super) enum RoundOutcome {
    /// Try the append again.
    Retry,
    /// The room the request lacked came back before the round cleaned anything (the
    /// background worker freed it): try the append again. Not counted against
    /// `FOREGROUND_GC_ROUNDS_MAX`: each one needs the space to have grown again since the
    /// refusal, so it is progress, and cheap.
    RoomBack,
    /// The message says what the round found, for the operator (and for a test that fails).
    GiveUp(String),
}

impl Inner {
    /// One round of foreground GC for a writer refused for lacking `short.shortfall_bytes`:
    /// free what is cleaned; then, while the request still does not fit, clean a few
    /// segments and free them; when they wait for the reuse horizon, checkpoint (at most
    /// twice) to move it past them. One writer runs a round at a time; the others wait for
    /// it and then retry.
    ///
    /// A round that gives back nothing ends the attempt: a checkpoint costs space too, and
    /// spending it for no gain only digs deeper. But only when it is the round's own
    /// failure: the background worker may have freed what the writer needed meanwhile, and
    /// then the writer retries.
    pub(super) fn foreground_gc_round(&self, short: Short, stalled_rounds: &mut u32) -> Result<RoundOutcome> {
        let Short { shortfall_bytes, available_bytes: available_when_refused } = short;
        let round_generation = self.background.foreground_rounds.load(Ordering::Acquire);
        let _round = self.background.foreground_gc.lock();
        if self.background.foreground_rounds.load(Ordering::Acquire) != round_generation {
            return Ok(RoundOutcome::Retry); // another writer just ran a round: retry the append first
        }
        // The background worker's step borrows free segments for its victims' relocations
        // and frees the victims at its end: a paced store meets the host reserve mostly in
        // such a step, and the room comes back within milliseconds. So the round stops as
        // soon as the request fits, whoever gave the room back; cleaning a segment's worth
        // regardless (~10 victims, ~100 ms at 10% OP) stalled every writer (docs/space.md,
        // "The worst write").
        let fits = || self.log.lock().available_bytes() >= available_when_refused + shortfall_bytes;
        let freed_first = self.free_cleaned()?;
        if fits() {
            if freed_first > 0 {
                self.background.foreground_rounds.fetch_add(1, Ordering::AcqRel);
            }
            return Ok(RoundOutcome::RoomBack);
        }
        let (available_before, unused_before) = {
            let log = self.log.lock();
            log.trace_round(shortfall_bytes, &self.reserves(), self.space.host_slack_bytes.load(Ordering::Relaxed));
            (log.available_bytes(), log.unused_bytes())
        };
        let host_written_before = Counters::get(&self.counters.host_write_bytes);
        let worker_before = self.gc_and_checkpoint_count();
        // After a round that gained nothing, clean enough to pay for the checkpoints too.
        let Cleaning { cleaned, mut freed, relocation_short } =
            self.clean_for(shortfall_bytes, *stalled_rounds > 0, &fits)?;
        freed += freed_first;
        let Checkpointing { checkpoints, freed: freed_by_checkpoints, failed: checkpoint_failed } =
            self.checkpoint_for_cleaned(available_before + shortfall_bytes)?;
        freed += freed_by_checkpoints;
        self.background.foreground_rounds.fetch_add(1, Ordering::AcqRel);
        // Progress is judged by the space not holding records (free and cleaned segments,
        // the open segment's room), not by this round's own work: the background worker may
        // have freed the segments this round cleaned, and relocating a victim may take a
        // new segment while giving back only part of one.
        let (available_after, unused_after) = {
            let log = self.log.lock();
            (log.available_bytes(), log.unused_bytes())
        };
        if available_after >= available_before + shortfall_bytes || unused_after > unused_before {
            return Ok(RoundOutcome::Retry);
        }
        // Other writers' writes went in meanwhile: the space the round made went to them, not
        // nowhere. Counting that as a stall refused writes at native capacity with 8 writers
        // (about one run in ten of `space::a_store_at_native_capacity_…`).
        if Counters::get(&self.counters.host_write_bytes) > host_written_before {
            return Ok(RoundOutcome::Retry);
        }
        // The background worker cleaned or checkpointed meanwhile: its relocations may have
        // taken the room this round's needed, before its checkpoints freed what it cleaned
        // (they did: a thin store at 80% utilisation, 486 victims; the round's relocation of
        // 20 KB found 326 KB available against a reserve of 367, and 457 after it). The
        // round's failure then says nothing about the store; retry (`FOREGROUND_GC_ROUNDS_MAX`
        // still bounds it).
        if self.gc_and_checkpoint_count() > worker_before + cleaned as u64 + checkpoints {
            return Ok(RoundOutcome::Retry);
        }
        let why = |what: &str| {
            let unwritten = self.unwritten_segments();
            let log = self.log.lock();
            let checkpoint = checkpoint_failed.as_ref().map_or(String::new(), |e| format!("; checkpoint: {e}"))
                + &relocation_short
                    .as_ref()
                    .map_or(String::new(), |e| format!("; a victim's relocation was refused: {e}"));
            RoundOutcome::GiveUp(format!(
                "{EXHAUSTED} ({what}: the round cleaned {cleaned} and freed {freed} segments; {} free, {} cleaned \
                 waiting for the reuse horizon, {} bytes available for {shortfall_bytes} short (before the round: \
                 {available_before}; unused {unused_before} -> {unused_after}); {}{checkpoint})",
                log.segments.free_count(),
                log.segments.cleaned_count(),
                log.available_bytes(),
                log.segments.victim_census(&unwritten),
            ))
        };
        if cleaned == 0 && freed == 0 {
            return Ok(why("GC found nothing to clean"));
        }
        *stalled_rounds += 1;
        Ok(if *stalled_rounds >= 2 { why("GC cannot give back space") } else { RoundOutcome::Retry })
    }

    /// Checkpoints (at most two) while the available space is below `enough_bytes` and
    /// cleaned segments wait for the reuse horizon: each checkpoint moves it to the previous
    /// one, so two free everything cleaned before the first. Victims that wait for their map
    /// pages too: the checkpoint rewrites the pages elsewhere. (At native capacity with 1%
    /// OP, two of those held a megabyte while no victim's relocation fitted what was left:
    /// ENOSPC, "GC found nothing to clean", although a checkpoint would have freed both.)
    fn checkpoint_for_cleaned(&self, enough_bytes: u64) -> Result<Checkpointing> {
        let mut done = Checkpointing { checkpoints: 0, freed: 0, failed: None };
        for _ in 0..2 {
            let (short, waiting) = {
                let log = self.log.lock();
                let waiting = log.segments.has_cleaned() || log.segments.has_awaiting_checkpoint();
                (log.available_bytes() < enough_bytes, waiting)
            };
            if !short || !waiting {
                break;
            }
            match self.checkpoint_now() {
                Ok(()) => done.checkpoints += 1,
                Err(e) if e.kind() == ErrorKind::NoSpace => {
                    done.failed = Some(e);
                    break;
                }
                Err(e) => return Err(e),
            }
            done.freed += self.free_cleaned()?;
        }
        Ok(done)
    }

    /// Segments GC cleaned and checkpoints written since open, by anyone.
    fn gc_and_checkpoint_count(&self) -> u64 {
        Counters::get(&self.counters.gc_segments_cleaned) + Counters::get(&self.counters.checkpoints)
    }

    /// Cleans victims until they give back what a writer lacks (no more: every segment GC
    /// keeps free beyond the reserve raises the utilisation it works at), or until the
    /// writer's request `fits` because the background worker freed room meanwhile, and
    /// frees them.
    /// With `pay_checkpoints`, also what the two checkpoints that free them will take: at
    /// native capacity with small segments and little over-provisioning, the victims of a
    /// round may give back less than those checkpoints cost (16 victims at 10% of a 64 KiB
    /// segment give ~91 KiB; two checkpoints may take ~190 KiB), and the writer got ENOSPC
    /// with a fifth of the store garbage. Only after a round that gained nothing: every
    /// segment cleaned beyond need raises the utilisation GC works at. Returns (segments
    /// cleaned, segments freed, and whether a relocation was refused for lack of space: GC's
    /// reserve, or no free segment to open).
    fn clean_for(&self, shortfall_bytes: u64, pay_checkpoints: bool, fits: &dyn Fn() -> bool) -> Result<Cleaning> {
        // As the last checkpoint cost, with a quarter to spare (the reserve's bound on a
        // checkpoint is far above a typical one on a large store).
        let checkpoints_bytes = if pay_checkpoints { 2 * self.log.lock().epochs.checkpoint_bytes * 5 / 4 } else { 0 };
        // GC reads victims from disk, so sealed segments still in memory are none: under a
        // burst of writes they may be all the garbage there is. Write them out first.
        if !self.log.lock().appender.sealed_unwritten.is_empty() {
            self.write_out(WriteOut::WholeSectors)?;
        }
        let want_bytes = shortfall_bytes.max(self.geometry.segment_size_bytes) + checkpoints_bytes;
        let victims_max = if pay_checkpoints { PAYING_GC_VICTIMS_MAX } else { FOREGROUND_GC_VICTIMS_MAX };
        let mut cleaned = 0;
        let mut gained_bytes = 0;
        let mut freed = 0;
        let mut relocation_short = None;
        while cleaned < victims_max && gained_bytes < want_bytes && (pay_checkpoints || !fits()) {
            let mode = if pay_checkpoints { GcMode::Stalled } else { GcMode::Foreground };
            match self.gc_once(mode) {
                Ok(Some(bytes)) => {
                    cleaned += 1;
                    gained_bytes += bytes;
                }
                Ok(None) => break,
                // Relocations ran into GC's reserve: free what is cleaned so far and go on.
                Err(e) if e.kind() == ErrorKind::NoSpace => {
                    relocation_short = Some(e.to_string());
                    match self.free_cleaned()? {
                        0 => break,
                        n => freed += n,
                    }
                }
                Err(e) => return Err(e),
            }
        }
        freed += self.free_cleaned()?;
        Ok(Cleaning { cleaned, freed, relocation_short })
    }
}

impl LogGuard<'_> {
    /// Why a foreground round was needed, next to the worker's steps
    /// (`ZDISK_LOG=zdisk_engine::gc=debug`).
    fn trace_round(&self, shortfall_bytes: u64, reserves: &Reserves, published_slack_bytes: u64) {
        tracing::debug!(
            target: "zdisk_engine::gc",
            shortfall_bytes,
            available_bytes = self.available_bytes(),
            host_reserve_bytes = reserves.of(SpaceClass::Host),
            published_slack_bytes,
            free = self.segments.free_count(),
            cleaned = self.segments.cleaned_count(),
            awaiting_checkpoint = self.segments.has_awaiting_checkpoint(),
            since_checkpoint_bytes = self.epochs.bytes_since_checkpoint,
            "foreground round"
        );
    }
}
