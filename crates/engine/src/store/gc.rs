//! Garbage collection: pick a victim segment, collect its live fragments, relocate them.
//!
//! Invariants:
//! - A fragment is live only if the map still points at it; a copy replaces the map entry
//!   only if it still holds the old place, so a concurrent overwrite always wins: GC's
//!   copies go into batch records holding only the copies whose entry is still the old one,
//!   checked under the log lock as the record is appended (`log.rs`, `append_gc_copies`).
//!   Replay applies batch records unconditionally, in log order, which is the order those
//!   checks were made in. (Relocate records, which older stores hold, carried the old place
//!   and were compared and swapped when applied, twice over in their tail: 28 bytes a copy
//!   against a batch entry's 8.)
//! - GC's accounting does not depend on which map pages are cached (docs/space.md, "GC
//!   and the map cache"). Liveness is read through the map cache, a victim's leaves a
//!   batch at a time (one page read per leaf not cached); the owed removals of those
//!   leaves' changes are settled then. The copies' leaves are pinned from the check to the
//!   apply (`log.rs`), so a copy removes the entry it replaces at once. A host write racing
//!   GC may still owe the removal of a live fragment's old place: the leaves of what was
//!   live are settled again after the copies, and if one still owes (a write racing that
//!   too) the victim waits for the next checkpoint, which settles every owed removal.
//! - GC runs under the checkpoint lock: no checkpoint's frozen changes are in flight.
//! - A victim is marked cleaned only when nothing in it is live any more. If live bytes
//!   remain while the count is exact (nothing owed in those leaves, no walk owed), a
//!   damaged record header hid them: it is kept and never taken again, and `check` reports
//!   it. A victim holding current map pages has them rewritten at the next checkpoint and
//!   is freed once no retained checkpoint references them.
//! - A relocation must fit one fresh segment: GC may count on one beyond its reserve, and a
//!   victim that gives back less than it takes would eat the reserves trims and checkpoints
//!   need.
//! - Recompression (`codec.rs`, "Adaptive fallback"): a live fragment of another codec than
//!   the target (the store's, unless `recompress` names a stronger one) is decompressed,
//!   its guard and protection information checked, and recompressed; the new fragment is
//!   kept only if it is smaller. A fragment that fails its check is moved as it is (never
//!   laundered into a fragment with a fresh, valid guard). In `Auto`
//!   fallback mode GC does not recompress while every core is compressing (the host's
//!   writes come first; the fragments are recompressed the next time they move).
//! - Dictionaries (`dictionaries.rs`): once the store has a newest dictionary, GC
//!   recompresses every compressed fragment it moves with it (at the dictionary's level),
//!   except those already made with it; with every core busy, it still recompresses the
//!   fragments of older dictionaries (so they can be freed) and only those. A fragment of an
//!   older dictionary is replaced even when the new one is not smaller; one that fails its
//!   check is moved as it is and counted (`older_dictionary_fragments_kept`).

use super::capacity::SpaceClass;
use super::geometry::{new_buffer, round_up};
use super::log::Attempt;
use super::log::{gc_copy_bytes, group_bytes, Block, LiveFragment, Op};
use super::read::verify_fragment;
use super::scan::{parse_segment, RecordContext};
use super::state::Inner;
use std::sync::Arc;

use crate::codec::{recompresses, recompresses_into_dictionary, Codec, CodecFallback, CodecTag, Dictionary};
use crate::error::{Error, ErrorKind, Result};
use crate::format::{FragmentEntry, FragmentFormat, Protection, RecordBody, PI_BYTES, V2_PREFIX_BYTES};
use crate::map::page::PageId;
use crate::map::{Entry, PackedEntry, Stored, WalkItem};
use crate::stats::{thread_cpu_ns, Compressing, Counters};
use crate::types::{Lba, SegmentId};
use crate::{Stats, BLOCK_SIZE, SECTOR_SIZE};

/// Leaves a victim's liveness check pins at once.
const LEAVES_PER_BATCH: usize = 256;

/// Who runs GC: in the background only segments worth it are taken; in the foreground a
/// writer waits, so anything whose relocation fits a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GcMode {
    Background,
    /// A writer waits.
    Foreground,
    /// A writer waits, and the last foreground round gained nothing: the emptiest settled
    /// victims, which give back the most, soonest.
    Stalled,
}

/// The codec GC recompresses fragments into, and whether fragments already tagged with it
/// are taken too (an explicit stronger level: the map does not record levels); or the
/// dictionary it recompresses into.
pub(crate) struct RecompressTarget {
    pub codec: Codec,
    pub same_tag_too: bool,
    /// Compress with this dictionary (at its level) instead of `codec`.
    pub dictionary: Option<Arc<Dictionary>>,
    /// Take only fragments of older dictionaries than `dictionary` (every core is busy).
    pub older_dictionaries_only: bool,
}

impl RecompressTarget {
    pub fn codec(codec: Codec, same_tag_too: bool) -> RecompressTarget {
        RecompressTarget { codec, same_tag_too, dictionary: None, older_dictionaries_only: false }
    }

    pub fn dictionary(dictionary: Arc<Dictionary>, older_dictionaries_only: bool) -> RecompressTarget {
        RecompressTarget {
            codec: Codec::Zstd { level: dictionary.level },
            same_tag_too: true,
            dictionary: Some(dictionary),
            older_dictionaries_only,
        }
    }

    /// Whether a fragment of codec `tag` may be one this target takes (what the map tells).
    fn may_take(&self, tag: CodecTag) -> bool {
        match &self.dictionary {
            Some(_) if self.older_dictionaries_only => tag == CodecTag::ZstdDict,
            Some(_) => tag != CodecTag::Raw,
            None => recompresses(tag, self.codec, self.same_tag_too),
        }
    }

    /// Whether this target takes the fragment of codec `tag` which, a dictionary fragment,
    /// names dictionary `named` in its frame (`Inner::named_dictionary`).
    fn takes(&self, tag: CodecTag, named: Option<u32>) -> bool {
        match &self.dictionary {
            Some(d) if self.older_dictionaries_only => tag == CodecTag::ZstdDict && named != Some(d.id),
            Some(d) => recompresses_into_dictionary(tag, named, d.id),
            None => recompresses(tag, self.codec, self.same_tag_too),
        }
    }
}

/// What [`Inner::recompress`] did.
#[derive(Debug, Clone, Default)]
pub struct RecompressReport {
    /// Segments that held fragments to recompress when it started.
    pub segments: u64,
    /// Of those, segments cleaned (their live fragments moved, recompressed where smaller).
    pub segments_cleaned: u64,
    /// Statistics before and after (after: once the cleaned segments are freed).
    pub before: Stats,
    pub after: Stats,
    /// The dictionary trained for this recompression (`recompress --train`), if one was.
    pub dictionary: Option<super::dictionaries::DictionaryReport>,
}

/// Why a victim is cleaned: for the space it gives back (GC), or for the fragments it holds
/// that recompress (`recompress`: a segment where none gets smaller is left alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CleanFor {
    Space,
    Recompression,
}

/// The victim GC chose, and whether the reuse horizon has passed it.
pub(super) struct Victim {
    pub segment: SegmentId,
    pub settled: bool,
}

impl Inner {
    /// Seals every stream's open segment, so GC may take everything written so far (an
    /// explicit recompression; the cost is their unused room).
    pub(crate) fn seal_open_segments(&self) -> Result<()> {
        let mut log = self.log.lock();
        self.health.check_writable()?;
        log.seal_open_segments()
    }

    /// Cleans one victim segment. Returns the bytes it gives back once freed (segment size
    /// less what was relocated), or None when no segment is worth cleaning.
    pub(crate) fn gc_once(&self, mode: GcMode) -> Result<Option<u64>> {
        let _checkpoint = self.checkpoint.lock();
        let _gc = self.background.gc_lock.lock();
        self.health.check_writable()?;
        let Some(victim) = self.pick_victim(mode) else { return Ok(None) };
        let target = self.gc_recompress_target();
        self.clean_victim(victim, target.as_ref(), CleanFor::Space)
    }

    /// What background and foreground GC recompress into: the newest dictionary if there is
    /// one, else the store's codec; when the fallback is automatic and every core is
    /// compressing now, nothing — or only older dictionaries' fragments (module comment).
    fn gc_recompress_target(&self) -> Option<RecompressTarget> {
        let busy = self.codecs.counters.compressing.load(std::sync::atomic::Ordering::Relaxed);
        let saturated = matches!(self.options.codec_fallback, CodecFallback::Auto | CodecFallback::AutoUncompressed)
            && busy >= self.codecs.cores.max(1);
        match (self.newest_dictionary(), saturated) {
            (Some(dictionary), saturated) => Some(RecompressTarget::dictionary(dictionary, saturated)),
            (None, false) => Some(RecompressTarget::codec(self.geometry.codec, false)),
            (None, true) => None,
        }
    }

    /// Cleans `victim` (held under the checkpoint and GC locks): moves its live fragments,
    /// recompressing those `target` takes, and marks it cleaned when nothing in it is live.
    /// Returns the bytes it gives back once freed, or None when its relocation does not fit
    /// (or, cleaning for recompression, nothing in it recompresses smaller).
    fn clean_victim(&self, victim: Victim, target: Option<&RecompressTarget>, why: CleanFor) -> Result<Option<u64>> {
        let live = self.collect_live(victim.segment)?;
        let leaves = leaves_of(&live);
        let (verbatim, recompressed) = self.recompress_live(live, target);
        if why == CleanFor::Recompression && recompressed.is_empty() {
            // Nothing in it gets smaller (fragments the target's codec does not shrink stay
            // as they are, and keep their segment listed): moving it would cost writes for
            // nothing.
            return Ok(None);
        }
        // Relocating costs the live fragments plus an entry each. It must fit one fresh
        // segment (see the module comment).
        let extra = self.log.record_extra_bytes();
        let relocated_bytes = gc_copy_bytes(&verbatim, extra) + gc_copy_bytes(&recompressed, extra);
        if relocated_bytes > self.geometry.segment_capacity() {
            return Ok(None);
        }
        if !verbatim.is_empty() || !recompressed.is_empty() {
            let class = if victim.settled { SpaceClass::GcSettled } else { SpaceClass::Gc };
            self.relocate(verbatim, recompressed, class)?;
        }
        self.finish_victim(&victim, &leaves, relocated_bytes)
    }

    /// After a victim's live fragments were moved: settles what host writes racing GC owe
    /// in the leaves of those fragments, then judges the victim (`judge_victim`).
    pub(super) fn finish_victim(
        &self,
        victim: &Victim,
        leaves: &[PageId],
        relocated_bytes: u64,
    ) -> Result<Option<u64>> {
        // A host write that overwrote a live fragment while GC worked, into a leaf not
        // cached, owes the removal of the victim's fragment: settle those leaves now.
        let owed = self.map.read().unsettled_among(leaves);
        self.settle_leaves(&owed)?;
        self.judge_victim(victim, leaves, relocated_bytes)
    }

    /// Marks a victim whose live fragments were moved (those in `leaves`) cleaned, waiting
    /// for checkpoints, or — when its count is exact and still not zero — unparseable.
    /// Returns the bytes it gives back once freed.
    pub(super) fn judge_victim(&self, victim: &Victim, leaves: &[PageId], relocated_bytes: u64) -> Result<Option<u64>> {
        // A trim that replaced a whole subtree owes its old entries until the checkpoint
        // walks it: they may point into the victim.
        let walks_owed = self.map.read().has_owed_walks();
        let mut log = self.log.lock();
        // Under the log lock no host write applies, so what is owed now is all that is:
        // any removal owed of the victim's fragments sits in the leaves of what it held
        // live when GC read it (the others' leaves were settled then, `collect_live`).
        let removals_owed = walks_owed || !self.map.read().unsettled_among(leaves).is_empty();
        let usage = *log.segments.get(victim.segment);
        if (usage.live_bytes == 0 && usage.page_bytes != 0) || (usage.live_bytes != 0 && removals_owed) {
            // Its data is gone, or its count still holds removals the map owes (a walk, or
            // a write racing the settling above); its map pages go with the next
            // checkpoints, which also settle every owed removal. Once it holds nothing,
            // freeing finds it (`free_cleaned`); if its count stays above zero once exact,
            // GC may take it again (`SegmentTable::recheck_awaiting`).
            log.segments.await_checkpoint(victim.segment);
            return Ok(Some(0));
        }
        if usage.live_bytes != 0 {
            // Live data that parsing did not find, with the count exact: a damaged record
            // header (or a bug). Never free such a segment; leave it out of GC from now on;
            // `check` reports it.
            tracing::error!(
                "segment {} still has {} live bytes after GC; keeping it",
                victim.segment,
                usage.live_bytes
            );
            log.segments.mark_unparseable(victim.segment);
            return Ok(Some(0));
        }
        // Everything that emptied it was appended by now (a concurrent overwrite included).
        let cleaned_seq = log.appender.next_seq - 1;
        log.segments.mark_cleaned(victim.segment, cleaned_seq);
        Counters::add(&self.counters.gc_segments_cleaned, 1);
        Ok(Some(self.geometry.segment_size_bytes - relocated_bytes))
    }

    /// Loads `leaves` (a batch at a time) and settles the removals their changes owe.
    fn settle_leaves(&self, leaves: &[PageId]) -> Result<()> {
        for batch in leaves.chunks(LEAVES_PER_BATCH) {
            self.map.read().pin_loaded(batch, self)?;
            {
                let mut log = self.log.lock();
                let map = self.map.read();
                map.settle(batch, &mut log.live(&self.geometry));
            }
            self.map.read().unpin(batch);
        }
        Ok(())
    }

    /// Recompresses, to completion, every fragment `target` takes: each segment holding one
    /// is cleaned as GC would clean it, whatever its live share. When the log runs short of
    /// room for a relocation, two checkpoints move the reuse horizon past the segments
    /// cleaned so far and they are freed; then the segment is tried once more. (A segment
    /// that still cannot be taken — its relocation does not fit one segment — keeps its
    /// fragments; `segments_cleaned` says how many were.)
    /// `progress(done, total)` counts segments.
    pub(crate) fn recompress(
        &self,
        target: RecompressTarget,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<RecompressReport> {
        self.health.check_writable()?;
        // Open segments and sealed ones still only in memory are not GC's to take: seal the
        // open ones and write them out first.
        self.seal_open_segments()?;
        self.flush()?;
        let before = self.stats();
        let segments = self.segments_holding(&target)?;
        let total = segments.len() as u64;
        let mut report = RecompressReport { segments: total, ..RecompressReport::default() };
        let mut done = 0;
        progress(done, total);
        // A segment holding a retained checkpoint's chunks is not GC's to take until two
        // newer checkpoints retire it: such segments are tried again after those.
        let mut skipped = Vec::new();
        for pass in 0..2 {
            let todo = if pass == 0 { segments.clone() } else { std::mem::take(&mut skipped) };
            for segment in todo {
                let cleaned = match self.recompress_segment(segment, &target) {
                    Err(e) if e.kind() == ErrorKind::NoSpace => {
                        self.make_cleaned_free()?;
                        self.recompress_segment(segment, &target)?
                    }
                    other => other?,
                };
                if cleaned || pass == 1 {
                    report.segments_cleaned += cleaned as u64;
                    done += 1;
                    progress(done, total);
                } else {
                    skipped.push(segment);
                }
            }
            self.make_cleaned_free()?;
        }
        report.before = before;
        report.after = self.stats();
        Ok(report)
    }

    /// Two checkpoints (the reuse horizon is the older retained one) and the freeing they
    /// allow: every segment cleaned before becomes free.
    pub(crate) fn make_cleaned_free(&self) -> Result<()> {
        self.checkpoint_now()?;
        self.checkpoint_now()?;
        self.free_cleaned().map(|_| ())
    }

    /// Cleans `segment` recompressing into `target`; false when it is not a victim GC may
    /// take (open, unwritten, waiting for its pages), its relocation does not fit, or nothing
    /// in it gets smaller.
    pub(crate) fn recompress_segment(&self, segment: SegmentId, target: &RecompressTarget) -> Result<bool> {
        let _checkpoint = self.checkpoint.lock();
        let _gc = self.background.gc_lock.lock();
        self.health.check_writable()?;
        let victim = {
            let log = self.log.lock();
            let unwritten = self.unwritten_segments();
            if !log.segments.is_victim_candidate(segment, &unwritten) {
                return Ok(false);
            }
            let settled = log.segments.get(segment).last_seq <= log.epochs.reuse_horizon_seq;
            Victim { segment, settled }
        };
        Ok(self.clean_victim(victim, Some(target), CleanFor::Recompression)?.is_some())
    }

    /// The segments holding a fragment the map points at that `target` recompresses, in
    /// order (found by walking the current map: the segment table does not know codecs).
    /// Into a dictionary: a dictionary fragment in a segment first used since that
    /// dictionary became GC's is one of its own (`dictionaries.rs`), so not a reason.
    pub(crate) fn segments_holding(&self, target: &RecompressTarget) -> Result<Vec<SegmentId>> {
        let since_seq = target.dictionary.as_ref().map_or(0, |d| self.codecs.dictionaries.read().since_seq_of(d.id));
        let first_seqs: Vec<u64> = {
            let log = self.log.lock();
            (0..self.geometry.segment_count).map(|s| log.segments.get(SegmentId(s as u32)).first_seq).collect()
        };
        let mut found = std::collections::BTreeSet::new();
        let mut note = |value: PackedEntry| {
            if let Ok(Entry::Stored(s)) = value.unpack() {
                let segment = self.geometry.segment_of(s.offset_bytes);
                let own_dictionary = s.codec == CodecTag::ZstdDict
                    && since_seq != 0
                    && first_seqs.get(segment.index()).is_some_and(|&first| first >= since_seq);
                if target.may_take(s.codec) && !own_dictionary {
                    found.insert(segment);
                }
            }
        };
        let map = self.map.read();
        map.walk_current(0, map.block_count(), self, &mut |item| {
            match item {
                WalkItem::Leaf(_, body) => body.iter().for_each(|&value| note(PackedEntry(value))),
                WalkItem::Constant(_, _, value) => note(value),
                WalkItem::Page(_) => {}
            }
            Ok(())
        })?;
        Ok(found.into_iter().collect())
    }

    /// Chooses a victim. A store whose GC output has a stream of its own (`log.rs`, "Streams")
    /// takes the best cost-benefit victim, settled or not, in the background and the
    /// foreground alike — except when a writer waits and free segments are short (fewer
    /// than the host reserve and two), or after a foreground round that gained nothing
    /// (`GcMode::Stalled`): then the emptiest, settled ones first, which give back the most
    /// soonest (without that, a store at native capacity with 1% OP got ENOSPC about once
    /// in 20 runs of `space::a_store_at_native_capacity_…`). With one stream (stores
    /// formatted before), cost-benefit in the background, the emptiest in the foreground,
    /// settled segments first. Measured: docs/space.md, "Hot and cold".
    ///
    /// Why settled segments need not come first with two streams: a segment written after
    /// the reuse horizon is freed only after up to two more checkpoints, so taking one ties
    /// its space up for a while. But the horizon lags one or two checkpoint intervals (a
    /// quarter of the data area each), and under skewed writes the segments that lost most
    /// to overwrites are exactly the young ones: preferring settled ones took victims 75%
    /// live where 58% ones were waiting (zipf:1.2 at 80%: WA 2.2 against 1.2).
    fn pick_victim(&self, mode: GcMode) -> Option<Victim> {
        let log = self.log.lock();
        let now = log.appender.next_seq;
        let size = self.geometry.segment_size_bytes as f64;
        // Segments still (partly) in memory may not be on disk yet: leave them be.
        let unwritten = self.unwritten_segments();
        let foreground = mode != GcMode::Background;
        // In the background only segments worth it; when a writer waits, or space is
        // short, anything whose relocation fits one segment.
        let short = (log.segments.free_count() as u64) < self.reserves().host_segments() + 2;
        let separated = self.log.cold_stream;
        // (The bound leaves room for relocation entries; a victim whose relocation still
        // does not fit one segment is given up after it is read.)
        let capacity = self.geometry.segment_capacity() as f64;
        let live_max = if foreground || short { capacity - capacity / 64.0 } else { size * 0.90 };
        // A segment written after the reuse horizon can be cleaned but not freed before
        // up to two more checkpoints (see above).
        let horizon = log.epochs.reuse_horizon_seq;
        let settled_first = !separated || mode == GcMode::Stalled || (foreground && short);
        let greedy = foreground && settled_first;
        let mut best: Option<(bool, f64, SegmentId)> = None;
        for (id, s) in log.segments.iter() {
            if !log.segments.is_victim_candidate(id, &unwritten) || s.live_bytes as f64 > live_max {
                continue;
            }
            let settled = s.last_seq <= horizon;
            if !(settled || foreground || short || separated) {
                continue;
            }
            // Cost-benefit (Rosenblum & Ousterhout): free space gained times age, over the
            // cost of reading the segment and writing its live data. Greedy: the emptiest.
            let u = s.live_bytes as f64 / size;
            let age = (now - s.last_seq.min(now)) as f64 + 1.0;
            let score = if greedy { 1.0 - u } else { (1.0 - u) * age / (1.0 + u) };
            let rank = (settled && settled_first, score);
            if best.is_none_or(|(b_settled, b_score, _)| rank > (b_settled, b_score)) {
                best = Some((rank.0, score, id));
            }
        }
        best.map(|(_, _, segment)| {
            let settled = log.segments.get(segment).last_seq <= horizon;
            Victim { segment, settled }
        })
    }

    /// Reads a victim and returns the fragments in it the map still points at; marks the
    /// current map pages in it for rewriting.
    pub(super) fn collect_live(&self, segment: SegmentId) -> Result<Vec<LiveFragment>> {
        let base = self.geometry.segment_base(segment);
        let usage = *self.log.lock().segments.get(segment);
        // An empty victim needs no read: nothing in it is live.
        if usage.live_bytes == 0 && usage.page_bytes == 0 {
            return Ok(Vec::new());
        }
        let mut image = new_buffer(round_up(usage.end_bytes, SECTOR_SIZE as u64) as usize);
        self.backing.read_at(base, &mut image).map_err(|e| Error::io(format!("GC read of segment {segment}"), e))?;
        let dictionaries = self.dictionary_set();
        let context = RecordContext {
            store_tag: self.geometry.store_tag,
            dictionaries: &dictionaries,
            cipher: self.log.cipher.as_deref(),
            use_of: &|offset, seq, epoch| self.record_use(offset, seq, epoch),
        };
        let (records, _) = parse_segment(&image, base, &context);
        let mut fragments = Vec::new(); // (lba, here, format, byte range in the image)
        for record in &records {
            let format = record.header.version.fragment_format();
            let mut at = record.payload_offset_bytes;
            for (tag, fragment) in record.header.body.payload_fragments() {
                let here = PackedEntry::of_fragment(at, fragment, format);
                let range = (at - base) as usize..(at - base) as usize + fragment.stored_len as usize;
                at += fragment.stored_len as u64;
                if let RecordBody::MapPages { .. } = record.header.body {
                    self.force_if_current(PageId::from_tag(tag), here)?;
                } else if !fragment.is_zero_block(format) {
                    fragments.push((tag, here, format, fragment, range));
                }
            }
        }
        let mut live = Vec::new();
        let mut by_leaf: Vec<PageId> = fragments.iter().map(|f| PageId::leaf_of(f.0).0).collect();
        by_leaf.sort_unstable();
        by_leaf.dedup();
        for leaves in by_leaf.chunks(LEAVES_PER_BATCH) {
            self.map.read().pin_loaded(leaves, self)?;
            let (first, last) = (leaves[0], leaves[leaves.len() - 1]);
            let checked: Result<()> = {
                let map = self.map.read();
                fragments.iter().filter(|f| (first..=last).contains(&PageId::leaf_of(f.0).0)).try_for_each(
                    |(lba, here, format, fragment, range)| {
                        if lba.0 < map.block_count() && map.get(*lba, self)? == *here {
                            let bytes = &image[range.clone()];
                            let block = match format {
                                FragmentFormat::V3 => Block {
                                    entry: *fragment,
                                    bytes: bytes.to_vec(),
                                    nonce_epoch: self.nonce_epoch_at(base + range.start as u64),
                                },
                                FragmentFormat::V2 => convert_v2_fragment(bytes, *lba, *fragment),
                            };
                            let keeps_guard = !self.placed_at(&block.bytes, base + range.start as u64);
                            live.push(LiveFragment { lba: *lba, old: *here, block, keeps_guard });
                        }
                        Ok(())
                    },
                )
            };
            if checked.is_ok() {
                // The owed removals of these leaves' changes (some point into the victim).
                let mut log = self.log.lock();
                let map = self.map.read();
                map.settle(leaves, &mut log.live(&self.geometry));
            }
            self.map.read().unpin(leaves);
            checked?;
        }
        Ok(live)
    }

    /// Whether a fragment read at byte `address` carries that address's placement tag (an
    /// encrypted store's guard; a plain store's fragments always do: true). One that does
    /// not is moved with its guard as it is (`LiveFragment::keeps_guard`).
    pub(crate) fn placed_at(&self, fragment: &[u8], address: u64) -> bool {
        let Some(cipher) = self.log.cipher.as_deref() else { return true };
        match Protection::decode(&fragment[..PI_BYTES]) {
            Ok(pi) => {
                pi.entry.is_zero_block(FragmentFormat::V3)
                    || cipher.placement(address, self.segment_use(address).seq, &fragment[PI_BYTES..]) == pi.guard
            }
            Err(_) => false,
        }
    }

    /// Marks page `id` for rewriting if its current version is the fragment at `here`.
    fn force_if_current(&self, id: PageId, here: PackedEntry) -> Result<()> {
        let map = self.map.read();
        if id.level < map.lock().height && map.pointer_of(id, self)? == here.0 {
            map.force(id);
        }
        Ok(())
    }

    /// Splits `live` into fragments moved as they are and fragments recompressed with
    /// `target` (those it takes whose new fragment is smaller; module comment).
    pub(crate) fn recompress_live(
        &self,
        live: Vec<LiveFragment>,
        target: Option<&RecompressTarget>,
    ) -> (Vec<LiveFragment>, Vec<LiveFragment>) {
        let Some(target) = target else { return (live, Vec::new()) };
        let named = |f: &LiveFragment| {
            (f.block.entry.codec == CodecTag::ZstdDict)
                .then(|| self.named_dictionary(&f.block.bytes, f.lba, f.block.nonce_epoch.unwrap_or(0)))
                .flatten()
        };
        if !live.iter().any(|f| target.takes(f.block.entry.codec, named(f))) {
            return (live, Vec::new());
        }
        let counters = &self.codecs.counters;
        let compressing = Compressing::enter(&counters.compressing);
        let cpu_before = thread_cpu_ns();
        let (mut verbatim, mut recompressed) = (Vec::new(), Vec::new());
        let mut block = vec![0u8; BLOCK_SIZE];
        let mut scratch = Vec::with_capacity(2 * BLOCK_SIZE);
        let dictionaries = self.dictionary_set();
        for fragment in live {
            let entry = fragment.block.entry;
            if !target.takes(entry.codec, named(&fragment)) {
                verbatim.push(fragment);
                continue;
            }
            // (The bytes are a version 3 fragment: `collect_live` converted older ones. Its
            // old address: an encrypted store's guard is the placement tag of it.)
            let old_offset = match fragment.old.unpack() {
                Ok(Entry::Stored(old)) => old.offset_bytes,
                _ => 0,
            };
            let stored = Stored {
                offset_bytes: old_offset,
                stored_len: entry.stored_len,
                codec: entry.codec,
                format: FragmentFormat::V3,
            };
            // A fragment of an older dictionary than the target's goes, smaller or not.
            let older_dictionary = entry.codec == CodecTag::ZstdDict && target.dictionary.is_some();
            let sealed = self.sealed_at(old_offset);
            if let Err(why) =
                verify_fragment(stored, &fragment.block.bytes, fragment.lba, &mut block, &dictionaries, sealed)
            {
                tracing::warn!("GC: block {} fails its check ({why}); moved as it is, not recompressed", fragment.lba);
                if older_dictionary {
                    Counters::add(&counters.older_dictionary_fragments_kept, 1);
                }
                verbatim.push(fragment);
                continue;
            }
            let new = match &target.dictionary {
                Some(dictionary) => self.compress_fragment(&block, fragment.lba, &mut scratch, |block, out| {
                    dictionary.compress_append(block, out)
                }),
                None => self.compress_with(target.codec, &block, fragment.lba, &mut scratch),
            };
            let new = match new {
                Ok(new) => new,
                Err(e) => {
                    // (Sealing failed: the nonce lease could not be written. The store has
                    // failed already; the fragment moves as it is.)
                    tracing::warn!("GC: block {} not recompressed: {e}", fragment.lba);
                    verbatim.push(fragment);
                    continue;
                }
            };
            if target.dictionary.is_some() && entry.codec != CodecTag::ZstdDict {
                Counters::add(&counters.dictionary_trial_blocks, 1);
                Counters::add(&counters.dictionary_trial_bytes, new.bytes.len() as u64);
            }
            let smaller = new.bytes.len() < fragment.block.bytes.len();
            if entry.codec == CodecTag::Lz4 {
                // What recompression makes of the fallback's fragments: the share
                // `pending_recompress_saving_bytes` is estimated at.
                let tried = fragment.block.bytes.len() as u64;
                Counters::add(&counters.lz4_recompress_tried_bytes, tried);
                Counters::add(&counters.lz4_recompress_kept_bytes, tried.min(new.bytes.len() as u64));
            }
            if (smaller || older_dictionary) && !new.entry.is_zero_block(FragmentFormat::V3) {
                recompressed.push(LiveFragment { block: new, ..fragment });
            } else {
                verbatim.push(fragment);
            }
        }
        Counters::add(&counters.recompress_cpu_ns, thread_cpu_ns().saturating_sub(cpu_before));
        drop(compressing);
        (verbatim, recompressed)
    }

    /// Appends the relocation of `verbatim` and `recompressed` (GC's single append attempt:
    /// no foreground GC).
    pub(crate) fn relocate(
        &self,
        mut verbatim: Vec<LiveFragment>,
        recompressed: Vec<LiveFragment>,
        class: SpaceClass,
    ) -> Result<()> {
        // (Only now: recompression verifies a fragment as it lay at its old address.)
        self.reseal_older_epochs(&mut verbatim)?;
        let ops = [Op::Relocate { fragments: verbatim }, Op::Recompress { fragments: recompressed }];
        match self.try_append(&ops, class)? {
            Attempt::Appended(_) => Ok(()),
            Attempt::Short { shortfall_bytes, .. } => {
                // The terms, for the operator (and for a test that fails).
                let log = self.log.lock();
                let bytes = group_bytes(&ops, self.geometry.segment_capacity(), self.log.record_extra_bytes());
                Err(Error::new(
                    ErrorKind::NoSpace,
                    format!(
                        "physical space is exhausted (GC's relocation of {bytes} bytes lacks {shortfall_bytes} with \
                         its reserve of {}; {} available)",
                        self.reserves().of(class),
                        log.available_bytes()
                    ),
                ))
            }
            Attempt::Conflict => unreachable!("relocations carry no expectations"),
        }
    }
}

/// The map leaves that hold the entries of `fragments`, ascending, each once.
pub(crate) fn leaves_of(fragments: &[LiveFragment]) -> Vec<PageId> {
    PageId::leaves_of(fragments.iter().map(|f| f.lba))
}

/// A version 2 fragment (guard, compressed bytes) as a version 3 one: the same guard and
/// compressed bytes, with the LBA and length added to its protection information. No
/// decompression: the guard is the CRC of the uncompressed block in both formats.
fn convert_v2_fragment(bytes: &[u8], lba: Lba, fragment: FragmentEntry) -> Block {
    let compressed = &bytes[V2_PREFIX_BYTES..];
    let entry = FragmentEntry { stored_len: (PI_BYTES + compressed.len()) as u16, codec: fragment.codec };
    let guard = crate::format::u32_at(bytes, 0);
    let mut out = Vec::with_capacity(entry.stored_len as usize);
    out.extend_from_slice(&Protection { guard, lba, entry }.encode());
    out.extend_from_slice(compressed);
    Block { entry, bytes: out, nonce_epoch: None }
}
