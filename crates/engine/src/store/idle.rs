//! Idle work (docs/space.md, "Idle work"): what the worker does once the host has left the
//! store alone for `OpenOptions::idle_after` — the capacity the write path left behind.
//!
//! - **The first dictionary**: a zstd store that holds `options::AUTO_DICTIONARY_BLOCKS_MIN` stored
//!   blocks and has never had a dictionary trains one on a sample of its blocks and installs
//!   it (`dictionaries.rs`: durable in both retained checkpoints before anything uses it);
//!   then every segment holding a compressed fragment is queued, found by one walk of the
//!   map, to be recompressed into it. `OpenOptions::auto_dictionary_blocks` sets the
//!   threshold or turns it off. Only stores that zdisk versions without dictionaries refuse
//!   already (formatted with the log's second stream) get one unasked.
//! - **Retraining**: when blocks written since the newest dictionary compress clearly worse
//!   with it than the store's blocks did when it was measured (its *baseline*: the ratio
//!   it makes of a sample of the store's blocks other than those it was trained on), the
//!   data has changed: a new dictionary is trained on a fresh sample of the store and
//!   becomes the newest. The signal is what idle work's recompression of the segments the
//!   hints name — blocks written since, not the queue below, which is the very data the
//!   dictionary was trained on — made of blocks without a dictionary with the newest one,
//!   kept or not (`dictionary_trial_*`), over windows of `RETRAIN_WINDOW_BLOCKS`; the
//!   threshold is `RETRAIN_BELOW_BASELINE` of the baseline. Fragments of older dictionaries stay until GC
//!   moves them (it recompresses them into the newest) or `zdisk recompress --train` frees
//!   them; idle work stops retraining at `AUTO_DICTIONARIES_MAX` dictionaries.
//! - **Recompression**, one segment a step: the queue first, then the segment with the most
//!   fragments the target takes among those the segment table's hints name (fragments that
//!   joined the map since open: LZ4 ones, the write path's fallback, or with a dictionary
//!   every compressed one without it). A segment is cleaned as `zdisk recompress` cleans it
//!   (`gc.rs`: only smaller fragments replace old ones, a concurrent overwrite wins); after
//!   `IDLE_FREE_AFTER_SEGMENTS` cleaned, or when nothing is left, two checkpoints make them
//!   free again — when they are worth it (`idle_free_due`; else the worker's next regular
//!   checkpoint does). An open segment holding such fragments is sealed first (GC does not
//!   take open segments).
//!
//! Each step does at most one segment (tens of milliseconds) and looks again whether the
//! host is still away: a host request waits for at most one step. Idle work needs room to
//! move into beyond GC's cushion (two segments more) and never takes the host's reserve:
//! while free space is short of that and it has work, its steps clean garbage (one GC
//! victim a step) and free what they cleaned (`idle_make_room`); background GC alone stops
//! at its cushion, so on a store in steady use idle work would otherwise never run.

use std::time::Instant;

use super::dictionaries::DictionaryOptions;
use super::gc::RecompressTarget;
use super::spare_cpu::SpareCpu;
use super::state::Inner;
use crate::codec::{Codec, CodecTag};
use crate::error::Result;
use crate::stats::Counters;
use crate::types::SegmentId;

/// Blocks recompressed with the newest dictionary before their ratio is compared with its
/// baseline (8 MiB: enough that one odd file does not retrain the store).
const RETRAIN_WINDOW_BLOCKS: u64 = 2048;

/// Retrain when the window's ratio falls below this share of the baseline. Text of the
/// same kind measured 1.00–1.01 of its baseline in `tests/idle.rs`, text of another
/// vocabulary 0.68.
const RETRAIN_BELOW_BASELINE: f64 = 0.8;

/// Idle work retrains only while the store keeps fewer dictionaries than this (older ones
/// stay while fragments name them: `zdisk recompress --train` frees them).
const AUTO_DICTIONARIES_MAX: usize = 4;

/// Blocks the baseline is measured on.
const BASELINE_SAMPLE_BLOCKS: usize = 256;

/// Segments idle recompression cleans, at least, before two checkpoints free them: the
/// space they held comes back in steps (`idle_free_due` asks for more where checkpoints are
/// big).
const IDLE_FREE_AFTER_SEGMENTS: u32 = 16;

/// Idle work frees what it cleaned with two checkpoints of its own only once that is at
/// least this many times those checkpoints' bytes: a checkpoint carries the segment table
/// (61 bytes a segment: 15 MiB per TiB physical with 4 MiB segments), so on a big store the
/// normal checkpoint cadence frees small amounts instead.
const IDLE_FREE_PER_CHECKPOINT_BYTES: u64 = 8;

/// What the worker remembers between idle steps.
#[derive(Debug)]
pub(crate) struct IdleWork {
    /// The host's request count when last looked at, and since when it has not changed.
    host_ops: u64,
    quiet_since: Instant,
    /// Segments to recompress into a dictionary just installed, taken first.
    queue: Vec<SegmentId>,
    /// Segments cleaned that wait for the checkpoints that free them.
    cleaned_unfreed: u32,
    /// Training failed once (too few distinct blocks, say): not tried again in this run.
    training_failed: bool,
    /// The newest dictionary's baseline once measured: its id and the ratio.
    baseline: Option<Baseline>,
    /// Blocks without a dictionary that idle work's recompression of hinted segments tried
    /// with the newest dictionary since the last look, and the bytes it made of them.
    window_blocks: u64,
    window_bytes: u64,
    /// When the hints last named nothing to do: their generation and the newest
    /// dictionary's id then. Looking through every segment's hint again waits for a change
    /// (a store of a million segments would otherwise scan them ten times a second).
    nothing_hinted: Option<(u64, u32)>,
    /// The last scan of the hints found a hinted segment only checkpoints keep from GC
    /// (pinned by a retained checkpoint's pages, or waiting to be settled).
    hinted_held: bool,
    /// The hint generation at which idle work last took checkpoints to release such a
    /// segment: once per generation, so a segment that stays held never makes idle work
    /// checkpoint in a loop.
    released_at_generation: Option<u64>,
    /// Whether other processes leave a core for idle work.
    spare_cpu: SpareCpu,
}

#[derive(Debug, Clone, Copy)]
struct Baseline {
    dictionary_id: u32,
    ratio: f64,
}

impl Default for IdleWork {
    fn default() -> IdleWork {
        IdleWork {
            host_ops: 0,
            quiet_since: Instant::now(),
            queue: Vec::new(),
            cleaned_unfreed: 0,
            training_failed: false,
            baseline: None,
            window_blocks: 0,
            window_bytes: 0,
            nothing_hinted: None,
            hinted_held: false,
            released_at_generation: None,
            spare_cpu: SpareCpu::default(),
        }
    }
}

impl Inner {
    /// One step of idle work, if the host has been away long enough; returns whether it did
    /// any (the worker then goes again at once).
    pub(crate) fn idle_step(&self, watch: &mut IdleWork) -> Result<bool> {
        let Some(idle_after) = self.options.idle_after else { return Ok(false) };
        let host_ops = self.host_request_count();
        if host_ops != watch.host_ops {
            watch.host_ops = host_ops;
            watch.quiet_since = Instant::now();
            return Ok(false);
        }
        if watch.quiet_since.elapsed() < idle_after {
            return Ok(false);
        }
        if !watch.spare_cpu.core_is_spare(self.options.idle_spare_cores) {
            return Ok(false);
        }
        self.idle_work(watch)
    }

    /// One step of idle work, the host being away: training, retraining, or one segment.
    pub(crate) fn idle_work(&self, watch: &mut IdleWork) -> Result<bool> {
        if !self.idle_has_room() {
            return match self.idle_has_work(watch) {
                true => self.idle_make_room(),
                false => Ok(false),
            };
        }
        let first = self.wants_first_dictionary();
        if (first || self.wants_retraining(watch)?) && !watch.training_failed {
            let (dictionary, report) = match self.train_and_install(&self.idle_dictionary_options()) {
                Ok(trained) => trained,
                Err(e) => {
                    watch.training_failed = true;
                    tracing::warn!("no dictionary trained while idle: {e}");
                    return Ok(false);
                }
            };
            Counters::add(&self.codecs.counters.dictionaries_trained_idle, 1);
            tracing::info!(
                "trained dictionary {} ({} bytes) on {} blocks in {} ms while idle",
                report.id,
                report.size_bytes,
                report.sample_blocks,
                report.training_ms
            );
            if first {
                // Everything stored so far (a retrained one takes new writes, by the hints;
                // what the older one made stays until GC moves it).
                watch.queue = self.segments_holding(&RecompressTarget::dictionary(dictionary, false))?;
                watch.queue.reverse(); // taken from the back: lowest segment first
            }
            return Ok(true);
        }
        let Some(target) = self.idle_target() else { return Ok(false) };
        match self.next_idle_segment(watch, &target) {
            Some((segment, from_queue)) => {
                let trials_before = self.dictionary_trials();
                let cleaned = self.recompress_segment(segment, &target)?;
                if !from_queue && target.dictionary.is_some() {
                    // Blocks written since the dictionary: the retraining signal.
                    let trials = self.dictionary_trials();
                    watch.window_blocks += trials.0 - trials_before.0;
                    watch.window_bytes += trials.1 - trials_before.1;
                }
                self.log.lock().segments.clear_hint(segment);
                if cleaned {
                    Counters::add(&self.codecs.counters.idle_segments_recompressed, 1);
                    watch.cleaned_unfreed += 1;
                    if self.idle_free_due(watch.cleaned_unfreed, IDLE_FREE_AFTER_SEGMENTS) {
                        self.make_cleaned_free()?;
                        watch.cleaned_unfreed = 0;
                    }
                }
                Ok(true)
            }
            None if self.idle_free_due(watch.cleaned_unfreed, 1) => {
                self.make_cleaned_free()?;
                watch.cleaned_unfreed = 0;
                // Segments those checkpoints unpinned may be GC's to take now.
                watch.nothing_hinted = None;
                Ok(true)
            }
            None if self.open_segment_hinted(&target) => {
                // The last writes before the host left are in an open segment, which GC
                // does not take: seal it (its unused room comes back when it is cleaned).
                self.seal_open_segments()?;
                self.flush()?;
                watch.nothing_hinted = None;
                Ok(true)
            }
            None if watch.hinted_held && watch.released_at_generation != Some(self.hint_generation()) => {
                // What is left sits in a segment a retained checkpoint pins (often the one
                // the sealing above closed: it holds the last checkpoint's map pages). The
                // host is away, so no checkpoint would come to release it: take the two
                // that do, once for this state of the hints.
                watch.released_at_generation = Some(self.hint_generation());
                self.make_cleaned_free()?;
                watch.nothing_hinted = None;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Whether idle work has something to do once it has room: the first dictionary, the
    /// queue, or a segment (sealed, or open) holding fragments its target takes. (Retraining
    /// is judged on what recompression tries: it follows from that work.)
    fn idle_has_work(&self, watch: &mut IdleWork) -> bool {
        if self.wants_first_dictionary() || !watch.queue.is_empty() {
            return true;
        }
        let Some(target) = self.idle_target() else { return false };
        self.best_hinted_segment(watch, &target).is_some() || self.open_segment_hinted(&target)
    }

    /// Free space is short of what idle work needs while it has work: cleans garbage first,
    /// one victim a step (as background GC would, the host's reserve untouched), and once
    /// the segments cleaned would give idle work its room, two checkpoints free them.
    /// Background GC stops at its cushion, two segments short of idle work's room: without
    /// this, a store in steady use with garbage never recompressed what it stored cheaply
    /// (issue 48: 0 of 7,530 LZ4 blocks in 20 s after overwriting three times over).
    /// Returns whether it did anything (nothing: no victim worth cleaning).
    fn idle_make_room(&self) -> Result<bool> {
        let (free, cleaned, needed) = {
            let log = self.log.lock();
            let needed = self.reserves().host_segments() + self.space.cushion_segments() + 2;
            (log.segments.free_count() as u64, log.segments.cleaned_count() as u64, needed)
        };
        if cleaned > 0 && free + cleaned >= needed {
            self.make_cleaned_free()?;
            Counters::add(&self.codecs.counters.idle_room_steps, 1);
            return Ok(true);
        }
        let cleaned_one = self.gc_once(super::gc::GcMode::Background)?.is_some();
        if cleaned_one {
            Counters::add(&self.codecs.counters.idle_room_steps, 1);
        }
        Ok(cleaned_one)
    }

    fn hint_generation(&self) -> u64 {
        self.log.lock().segments.hint_generation()
    }

    /// Whether an open segment holds fragments `target` would take.
    fn open_segment_hinted(&self, target: &RecompressTarget) -> bool {
        let into_dictionary = target.dictionary.is_some();
        let log = self.log.lock();
        let hinted =
            log.appender.open_segments().any(|open| log.segments.hint(open.buffer.segment).taken(into_dictionary) > 0);
        hinted
    }

    /// Whether `cleaned` segments (at least `at_least`) are worth two checkpoints of idle
    /// work's own (`IDLE_FREE_PER_CHECKPOINT_BYTES`); if not, the worker's checkpoint cadence
    /// frees them.
    fn idle_free_due(&self, cleaned: u32, at_least: u32) -> bool {
        let checkpoint_bytes = self.log.lock().epochs.checkpoint_bytes;
        cleaned >= at_least.max(1)
            && cleaned as u64 * self.geometry.segment_size_bytes
                >= IDLE_FREE_PER_CHECKPOINT_BYTES * 2 * checkpoint_bytes
    }

    /// Host requests since open that touch data (reads, writes, trims, zeroes).
    fn host_request_count(&self) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.counters;
        c.read_ops.load(Relaxed) + c.write_ops.load(Relaxed) + c.trim_ops.load(Relaxed) + c.zero_ops.load(Relaxed)
    }

    /// Whether free space leaves idle work room to move into beyond what GC keeps.
    fn idle_has_room(&self) -> bool {
        let log = self.log.lock();
        let needed = self.reserves().host_segments() + self.space.cushion_segments() + 2;
        log.segments.free_count() as u64 >= needed
    }

    /// A zstd store that never had a dictionary and holds enough blocks to train one on.
    fn wants_first_dictionary(&self) -> bool {
        let Some(blocks_min) = self.options.auto_dictionary_blocks else { return false };
        // A store older zdisk versions can still open stays so: only stores formatted since
        // the log got its second stream (2026-11-25, which those versions refuse anyway)
        // get a dictionary unasked. Older ones get one from `recompress --train`.
        if !self.log.cold_stream || !matches!(self.geometry.codec, Codec::Zstd { .. }) {
            return false;
        }
        let never_had_one = {
            let state = self.codecs.dictionaries.read();
            state.table.is_empty() && state.next_id == 1
        };
        never_had_one && self.log.lock().segments.counts.stored >= blocks_min
    }

    /// Whether the data has changed under the newest dictionary (module comment). Measures
    /// the baseline first if it is not known (once per dictionary and run).
    fn wants_retraining(&self, watch: &mut IdleWork) -> Result<bool> {
        let Some(newest) = self.newest_dictionary() else { return Ok(false) };
        if self.options.auto_dictionary_blocks.is_none() || !self.log.cold_stream {
            return Ok(false);
        }
        if self.codecs.dictionaries.read().table.len() >= AUTO_DICTIONARIES_MAX {
            // Freeing older ones rewrites every fragment still naming them in one pass: an
            // operator's `zdisk recompress --train`, not idle work's.
            return Ok(false);
        }
        let baseline = match watch.baseline {
            Some(b) if b.dictionary_id == newest.id => b,
            _ => {
                // A new newest dictionary: what was tried with the one before says nothing.
                (watch.window_blocks, watch.window_bytes) = (0, 0);
                let Some(ratio) = self.dictionary_baseline(&newest)? else { return Ok(false) };
                tracing::debug!("dictionary {} baseline ratio {ratio:.3}", newest.id);
                watch.baseline = Some(Baseline { dictionary_id: newest.id, ratio });
                return Ok(false);
            }
        };
        if watch.window_blocks < RETRAIN_WINDOW_BLOCKS || watch.window_bytes == 0 {
            return Ok(false);
        }
        let window_ratio = (watch.window_blocks * crate::BLOCK_SIZE as u64) as f64 / watch.window_bytes as f64;
        // A new window from here either way.
        (watch.window_blocks, watch.window_bytes) = (0, 0);
        if window_ratio >= RETRAIN_BELOW_BASELINE * baseline.ratio {
            return Ok(false);
        }
        tracing::info!(
            "dictionary {}: new blocks compress {window_ratio:.2}:1 with it, its baseline {:.2}:1; retraining",
            newest.id,
            baseline.ratio
        );
        Ok(true)
    }

    /// The trial counters: blocks without a dictionary recompression tried with the newest
    /// one, and the bytes it made of them.
    fn dictionary_trials(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.codecs.counters;
        (c.dictionary_trial_blocks.load(Relaxed), c.dictionary_trial_bytes.load(Relaxed))
    }

    /// The ratio `dictionary` makes of a sample of the store's blocks other than those a
    /// training picks (fragment bytes as stored: protection information, and an encrypted
    /// store's seal, included). None when the store holds too few.
    fn dictionary_baseline(&self, dictionary: &crate::codec::Dictionary) -> Result<Option<f64>> {
        let stored_blocks = self.log.lock().segments.counts.stored;
        let training_step = stored_blocks.div_ceil(super::dictionaries::TRAINING_SAMPLE_BLOCKS_MAX as u64).max(1);
        let samples = self.sample_blocks(BASELINE_SAMPLE_BLOCKS, training_step / 2)?;
        if samples.len() < BASELINE_SAMPLE_BLOCKS / 4 {
            return Ok(None);
        }
        let overhead = crate::format::PI_BYTES
            + self.log.cipher.as_deref().map_or(0, crate::crypto::cipher::StoreCipher::fragment_overhead_bytes);
        let mut out = Vec::new();
        let mut stored_bytes = 0;
        for block in &samples {
            dictionary.compress_block(block, &mut out); // (raw when it does not pay)
            stored_bytes += out.len() + overhead;
        }
        Ok(Some((samples.len() * crate::BLOCK_SIZE) as f64 / stored_bytes as f64))
    }

    /// The defaults `recompress --train` uses, but a dictionary no bigger than a 32nd of
    /// the sample (zstd's builder fails or overfits on fewer samples; only a store smaller
    /// than 4 MiB of blocks, where the threshold was lowered, gets a smaller one).
    fn idle_dictionary_options(&self) -> DictionaryOptions {
        let defaults = DictionaryOptions::default();
        let stored_blocks = self.log.lock().segments.counts.stored;
        let sample_bytes = stored_blocks.min(defaults.sample_blocks_max as u64) as usize * crate::BLOCK_SIZE;
        DictionaryOptions { size_bytes: defaults.size_bytes.min(sample_bytes / 32), ..defaults }
    }

    /// What idle recompression makes fragments into: the newest dictionary, else the
    /// store's codec when the write path's fallback (LZ4) is another.
    fn idle_target(&self) -> Option<RecompressTarget> {
        match self.newest_dictionary() {
            Some(dictionary) => Some(RecompressTarget::dictionary(dictionary, false)),
            None if self.geometry.codec.tag() != CodecTag::Lz4 => {
                Some(RecompressTarget::codec(self.geometry.codec, false))
            }
            None => None,
        }
    }

    /// The next segment to recompress: the queue's, else the hinted one with the most
    /// fragments `target` takes. Only segments GC could take now.
    /// Whether it came from the queue is returned with it.
    fn next_idle_segment(&self, watch: &mut IdleWork, target: &RecompressTarget) -> Option<(SegmentId, bool)> {
        let unwritten = self.unwritten_segments();
        let log = self.log.lock();
        while let Some(segment) = watch.queue.pop() {
            if log.segments.is_victim_candidate(segment, &unwritten) {
                return Some((segment, true));
            }
        }
        drop(log);
        self.best_hinted_segment(watch, target).map(|id| (id, false))
    }

    /// The hinted segment GC could take now with the most fragments `target` takes (None is
    /// remembered until a hint moves: `IdleWork::nothing_hinted`).
    fn best_hinted_segment(&self, watch: &mut IdleWork, target: &RecompressTarget) -> Option<SegmentId> {
        let unwritten = self.unwritten_segments();
        let log = self.log.lock();
        let into_dictionary = target.dictionary.as_ref().map_or(0, |d| d.id);
        let now = (log.segments.hint_generation(), into_dictionary);
        if watch.nothing_hinted == Some(now) {
            return None;
        }
        let best = log
            .segments
            .iter()
            .filter(|&(id, _)| log.segments.is_victim_candidate(id, &unwritten))
            .map(|(id, _)| (log.segments.hint(id).taken(into_dictionary != 0), id))
            .filter(|&(count, _)| count > 0)
            .max();
        // (Segments not GC's to take yet — open, unwritten, pinned — are looked at again
        // when a hint next moves: the host's next write does that, or the checkpoints idle
        // work takes to release the pinned ones, `hinted_held`.)
        watch.nothing_hinted = best.is_none().then_some(now);
        watch.hinted_held = best.is_none()
            && log.segments.iter().any(|(id, _)| {
                log.segments.hint(id).taken(into_dictionary != 0) > 0
                    && log.segments.held_by_checkpoints(id, &unwritten)
            });
        best.map(|(_, id)| id)
    }
}
