//! Admission of host requests: append when there is room, otherwise make room with
//! foreground GC, in bounded rounds, and refuse with ENOSPC only when GC cannot give back
//! what the request lacks — the waits of Space that need the whole store (`impl Inner`):
//! the map's memory and the reserves (`mod.rs` lists every wait in order).
//!
//! Only host requests come through here. GC and checkpoints call the single append attempt
//! (`Inner::try_append`) and fail at once when short, so GC never waits on GC.
//!
//! Invariants: rounds continue while they make progress, at most `FOREGROUND_GC_ROUNDS_MAX`; one writer runs a
//! round at a time (the others wait for it and retry); a refused request has no effect.

use std::sync::atomic::Ordering;

use super::{Reserves, SpaceClass};
use crate::error::{Error, ErrorKind, Result};
use crate::stats::Counters;
use crate::store::gc::GcMode;
use crate::store::log::{Appended, Attempt, LogGuard, MapTarget, WRITE_OUT_THRESHOLD_BYTES};
use crate::store::op::{metadata_only, Op};
use crate::store::state::Inner;
use crate::store::writeout::WriteOut;

/// A backstop only: a write that finds no space runs GC rounds for as long as they make
/// progress (ENOSPC after two that do not). At native capacity with little
/// over-provisioning a victim gives back as little as OP of a segment, so one large write
/// may need hundreds of victims (1% OP, 64 KiB segments, a 128 KiB write: ~230), and a
/// fixed small round count refused writes the store had room for.
const FOREGROUND_GC_ROUNDS_MAX: usize = 4096;
/// Victims one foreground GC round may clean (bounds the pause of the write that waits).
const FOREGROUND_GC_VICTIMS_MAX: usize = 16;
/// The same for a round that must also pay for its checkpoints (see `clean_for`): at native
/// capacity a victim may give back only the over-provisioning's share of a segment.
const PAYING_GC_VICTIMS_MAX: usize = 256;
const EXHAUSTED: &str = "physical space is exhausted";

/// How a host request's group went.
pub(crate) enum Admitted {
    Appended(Appended),
    /// A block the group read-modify-writes changed since it was read: nothing was
    /// appended; the request must be redone.
    Conflict,
}

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
struct Short {
    shortfall_bytes: u64,
    /// Available when it was refused: a round that finds the space given back meanwhile
    /// (by the background worker, while the writer waited for the round) only retries.
    available_bytes: u64,
}

/// What a foreground GC round tells the waiting writer.
enum RoundOutcome {
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
    /// One append attempt: appends the group and publishes its map entries if the log has
    /// room for it beyond its class's reserve, else says how much it lacks; then starts the
    /// write-out its backlog calls for. GC and checkpoints call this directly; host
    /// requests go through `admit`, which makes room.
    pub(crate) fn try_append(&self, ops: &[Op], class: SpaceClass) -> Result<Attempt> {
        let mut log = self.log.lock();
        self.health.check_writable()?;
        if !expectations_hold(MapTarget { map: &self.map.read(), pages: self }, ops)? {
            return Ok(Attempt::Conflict);
        }
        let reserves = self.space.reserves();
        let appended = match log.append(ops, class, &reserves, &self.map, self)? {
            Attempt::Appended(appended) => appended,
            other => return Ok(other),
        };
        self.space.publish_host_slack(log.host_slack(&reserves));
        if matches!(class, SpaceClass::Host | SpaceClass::HostShrinking) {
            self.space.exhausted.store(false, Ordering::Relaxed);
        }
        let unwritten = log.appender.unwritten_bytes();
        let sealed = log.appender.sealed_unwritten.len();
        let backlog_bytes = (unwritten + log.appender.sealed_unwritten_bytes()) as u64;
        drop(log);
        let sealed_max = (self.options.cache_bytes_max / self.geometry.segment_size_bytes).max(2) as usize;
        let behind_max = self.options.write_behind_bytes_max;
        if sealed >= sealed_max || !self.options.background && sealed > 0 {
            self.write_out(WriteOut::WholeSectors)?;
        } else if behind_max > 0 && backlog_bytes > behind_max {
            self.write_out_behind(behind_max)?;
        } else if sealed > 0 || unwritten >= WRITE_OUT_THRESHOLD_BYTES {
            self.background.wakeups.kick_writer();
        }
        Ok(Attempt::Appended(appended))
    }

    /// Every class's reserve as of now (they grow with the logical size and the
    /// dictionary table): `Space`'s, checked in debug builds against a fresh computation.
    /// Everything but an append asks here (the worker's step, GC, checkpoints, idle work,
    /// statistics); `try_append` reads `Space::reserves` unchecked, so that a host write
    /// takes neither the dictionary table's lock nor its arithmetic.
    pub(crate) fn reserves(&self) -> Reserves {
        if cfg!(debug_assertions) {
            // Under the table's read lock: a change to it updates the reserves before it
            // lets go of the write lock.
            let dictionaries = self.codecs.dictionaries.read();
            self.space.assert_reserves_fresh(dictionaries.table_bytes_max());
        }
        self.space.reserves()
    }

    /// Appends a host request's group, making room with foreground GC when it lacks it.
    /// A trim or zero that GC could not make room for may still go below the metadata
    /// reserve (`SpaceClass::TrimWhileFull`).
    pub(crate) fn admit(&self, ops: &[Op], mut class: SpaceClass) -> Result<Admitted> {
        debug_assert!(!class.is_internal(), "only host requests wait for space");
        self.wait_for_map_memory()?;
        let mut rounds = 0;
        let mut stalled_rounds = 0;
        loop {
            let short = match self.try_append(ops, class)? {
                Attempt::Appended(appended) => return Ok(Admitted::Appended(appended)),
                Attempt::Conflict => return Ok(Admitted::Conflict),
                Attempt::Short { shortfall_bytes, available_bytes } => Short { shortfall_bytes, available_bytes },
            };
            if class.is_internal() {
                return Err(Error::new(ErrorKind::NoSpace, EXHAUSTED));
            }
            let outcome = if rounds >= FOREGROUND_GC_ROUNDS_MAX {
                RoundOutcome::GiveUp(format!("{EXHAUSTED} ({FOREGROUND_GC_ROUNDS_MAX} rounds of GC did not make room)"))
            } else {
                let outcome = self.foreground_gc_round(short, &mut stalled_rounds)?;
                rounds += usize::from(!matches!(outcome, RoundOutcome::RoomBack));
                outcome
            };
            if let RoundOutcome::GiveUp(message) = outcome {
                if class == SpaceClass::HostMetadata && metadata_only(ops) {
                    class = SpaceClass::TrimWhileFull;
                    continue;
                }
                return Err(Error::new(ErrorKind::NoSpace, message));
            }
        }
    }

    /// When the map's changes reached their memory limit (the background checkpoint fell
    /// behind, or there is no background thread), a writer writes the checkpoint itself
    /// before it adds more.
    fn wait_for_map_memory(&self) -> Result<()> {
        if !self.map.read().must_checkpoint() {
            return Ok(());
        }
        self.checkpoint_when(|| self.map.read().must_checkpoint())
    }

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
    fn foreground_gc_round(&self, short: Short, stalled_rounds: &mut u32) -> Result<RoundOutcome> {
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

/// Whether every block the group read-modify-writes still holds the map entry it was read
/// with. (Checked under the log lock, so no other group can publish in between; the pages
/// are usually cached: the request just read these blocks.)
fn expectations_hold(target: MapTarget<'_>, ops: &[Op]) -> Result<bool> {
    for op in ops {
        if let Op::Write { expected, .. } = op {
            for &(lba, entry) in expected {
                if lba.0 >= target.map.block_count() || target.map.get(lba, target.pages)? != entry {
                    return Ok(false);
                }
            }
        }
    }
    Ok(true)
}
