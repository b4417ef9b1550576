//! The segment table: each segment's state and usage, the free set, the counts of what
//! the map references, and (in memory) hints of where idle recompression has work; and
//! beside it the other count the map's accounting keeps per fragment, the LZ4 bytes left
//! for recompression (`PendingRecompress`, the last section).
//!
//! A segment's life: Free → Open (appended to) → Sealed → Cleaned (emptied by GC, or all its
//! data died) → Free (under the reuse rule, `checkpoint.rs`). Every transition is a method
//! here that checks the state it starts from — in release builds too: a segment reused
//! while it holds live data is the classic log-structured corruption, and the checks cost
//! a comparison each. Replay may also restart a segment's use (`restart_in_replay`).
//!
//! Invariants: a segment is in the free set exactly when its state is Free; a Free
//! segment has no live bytes and no page bytes; `live_bytes` is at least the sum of the
//! stored lengths of the map entries pointing into the segment (equal once the map's owed
//! removals are settled — every checkpoint settles them); `page_bytes` is the bytes of the
//! map pages in it that a retained checkpoint references; a free segment's hint is zero.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::codec::{Codec, CodecTag};
use crate::format::{SegmentState, SegmentUsage};
use crate::map::{Delta, Entry, PackedEntry};
use crate::types::SegmentId;

/// Accounts for a map entry joining or leaving the map in a usage table and its block
/// counts (the live table, or a checkpoint's snapshot of it).
pub(crate) fn account_entry(
    usage: &mut [SegmentUsage],
    counts: &mut BlockCounts,
    entry: PackedEntry,
    delta: Delta,
    segment_of: impl Fn(u64) -> SegmentId,
) {
    match entry.unpack() {
        Ok(Entry::Stored(s)) => {
            let usage = &mut usage[segment_of(s.offset_bytes).index()];
            match delta {
                Delta::Add => {
                    usage.live_bytes += s.stored_len as u64;
                    counts.stored += 1;
                }
                Delta::Remove => {
                    debug_assert!(usage.live_bytes >= s.stored_len as u64, "live bytes underflow");
                    usage.live_bytes = usage.live_bytes.saturating_sub(s.stored_len as u64);
                    counts.stored = counts.stored.saturating_sub(1);
                }
            }
        }
        Ok(Entry::Zero) => counts.constant(PackedEntry::ZERO, 1, delta),
        Ok(Entry::Unmapped | Entry::Lost) | Err(_) => {}
    }
}

/// How many blocks the map holds as stored data and as written zeroes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct BlockCounts {
    pub stored: u64,
    pub zero: u64,
}

impl BlockCounts {
    /// `blocks` blocks of a constant join or leave (only ZERO is counted).
    pub fn constant(&mut self, value: PackedEntry, blocks: u64, delta: Delta) {
        if value == PackedEntry::ZERO {
            match delta {
                Delta::Add => self.zero += blocks,
                Delta::Remove => {
                    debug_assert!(self.zero >= blocks, "zero block count underflow");
                    self.zero = self.zero.saturating_sub(blocks);
                }
            }
        }
    }
}

pub(crate) struct SegmentTable {
    usage: Vec<SegmentUsage>,
    free: BTreeSet<SegmentId>,
    /// Segments holding the chunks of the retained checkpoints, newest first: GC must not
    /// touch them.
    pinned: Vec<Vec<SegmentId>>,
    /// Segments GC could not fully parse (damaged); never cleaned.
    unparseable: Vec<SegmentId>,
    /// Segments whose data GC moved but which wait for checkpoints: they still hold map
    /// pages a retained checkpoint references (they empty as checkpoints rewrite and
    /// release those pages), or their live count still holds removals the map owes (the
    /// next checkpoint settles them).
    awaiting_checkpoint: BTreeSet<SegmentId>,
    /// Per segment, the compressed fragments without a dictionary that joined the map
    /// there since open (replay included): where idle recompression looks (`idle.rs`).
    /// In memory only, and counted on joining alone — a hint, not a count of live ones.
    hints: Vec<RecompressHint>,
    /// Counts hint increments: idle work looks through the hints again only when it moved.
    hint_generation: u64,
    /// Per segment, whether a GC stream opened it in this run (`log.rs`, "Streams"): its data
    /// outlived a cleaning, and GC moves it on to the colder stream. In memory only: a
    /// segment written before the last restart counts as the host's (a hint, like `hints`).
    gc_output: Vec<bool>,
    /// Each segment's `first_seq` (its use: an encrypted store's placement tags bind it) and
    /// `nonce_epoch`, readable without the log lock by reads (`Inner::segment_use`). A
    /// reader that holds a map entry pointing into a segment sees its current use: the
    /// entry was set after the use's first record was appended, and a segment is freed
    /// under the map's write lock.
    uses: Arc<[UseCell]>,
    pub counts: BlockCounts,
}

/// A segment's use as reads see it without the log lock: its first record's sequence number
/// (0: none yet) and the nonce epoch of its sealed fragments.
pub(crate) struct UseCell {
    seq: AtomicU64,
    nonce_epoch: AtomicU16,
    /// How many times the segment was freed since open. Raised after the map's write lock
    /// (no reader holds an entry into it) and before it is discarded or reused: a read
    /// that looked its entries up under the map's read lock and finds the count unchanged
    /// after its device read read bytes nobody overwrote (`Inner::finish_read`).
    frees: AtomicU32,
}

impl UseCell {
    fn new(seq: u64, nonce_epoch: u16) -> UseCell {
        UseCell { seq: AtomicU64::new(seq), nonce_epoch: AtomicU16::new(nonce_epoch), frees: AtomicU32::new(0) }
    }

    /// The segment is being freed (see `frees`).
    pub fn note_freed(&self) {
        self.frees.fetch_add(1, Ordering::SeqCst);
    }

    pub fn frees(&self) -> u32 {
        self.frees.load(Ordering::SeqCst)
    }

    /// The epoch is stored first: a reader that sees the sequence number sees its epoch.
    fn set(&self, seq: u64, nonce_epoch: u16) {
        self.nonce_epoch.store(nonce_epoch, Ordering::Relaxed);
        self.seq.store(seq, Ordering::Release);
    }

    /// The use's first sequence number and nonce epoch.
    pub fn get(&self) -> (u64, u16) {
        let seq = self.seq.load(Ordering::Acquire);
        (seq, self.nonce_epoch.load(Ordering::Relaxed))
    }
}

/// Fragments that joined the map in a segment, by what recompression could make of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RecompressHint {
    /// LZ4 fragments: the write path's fallback in a store of a slower codec.
    pub lz4: u32,
    /// Compressed fragments without a dictionary, LZ4 included.
    pub plain: u32,
}

impl RecompressHint {
    /// The fragments recompression takes: into a dictionary every one without, else LZ4's.
    pub fn taken(self, into_dictionary: bool) -> u32 {
        if into_dictionary {
            self.plain
        } else {
            self.lz4
        }
    }
}

impl SegmentTable {
    /// The table as a checkpoint left it (every segment Free without one). Open segments
    /// are sealed: after a restart nothing is appended to them again. The free set is
    /// built by [`SegmentTable::settle_at_open`].
    pub fn recovered(mut usage: Vec<SegmentUsage>) -> SegmentTable {
        let usage_len = usage.len();
        let uses = usage.iter().map(|u| UseCell::new(u.first_seq, u.nonce_epoch)).collect();
        for s in usage.iter_mut() {
            if s.state == SegmentState::Open {
                s.state = SegmentState::Sealed;
            }
        }
        SegmentTable {
            usage,
            free: BTreeSet::new(),
            pinned: Vec::new(),
            unparseable: Vec::new(),
            awaiting_checkpoint: BTreeSet::new(),
            hints: vec![RecompressHint::default(); usage_len],
            hint_generation: 0,
            gc_output: vec![false; usage_len],
            uses,
            counts: BlockCounts::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.usage.len()
    }

    pub fn get(&self, id: SegmentId) -> &SegmentUsage {
        &self.usage[id.index()]
    }

    pub fn iter(&self) -> impl Iterator<Item = (SegmentId, &SegmentUsage)> + '_ {
        self.usage.iter().enumerate().map(|(i, s)| (SegmentId(i as u32), s))
    }

    /// The usage table as a checkpoint records it.
    pub fn snapshot(&self) -> Vec<SegmentUsage> {
        self.usage.clone()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Free → Open: the lowest free segment, with a fresh usage record.
    pub fn open_next(&mut self) -> Option<SegmentId> {
        let id = self.free.pop_first()?;
        let usage = &mut self.usage[id.index()];
        assert_eq!(usage.state, SegmentState::Free, "segment {id} in the free set is {:?}", usage.state);
        assert_eq!(usage.live_bytes, 0, "free segment {id} has live bytes");
        *usage = SegmentUsage { state: SegmentState::Open, ..SegmentUsage::FREE };
        self.hints[id.index()] = RecompressHint::default();
        self.gc_output[id.index()] = false;
        self.uses[id.index()].set(0, 0);
        Some(id)
    }

    /// Free → Open for a chosen segment (the one a link named); the lowest free one if it
    /// is not free after all.
    pub fn open(&mut self, id: SegmentId) -> Option<SegmentId> {
        if !self.free.contains(&id) {
            debug_assert!(false, "segment {id} a link named is not free");
            return self.open_next();
        }
        self.free.remove(&id);
        let usage = &mut self.usage[id.index()];
        assert_eq!(usage.state, SegmentState::Free, "segment {id} in the free set is {:?}", usage.state);
        assert_eq!(usage.live_bytes, 0, "free segment {id} has live bytes");
        *usage = SegmentUsage { state: SegmentState::Open, ..SegmentUsage::FREE };
        self.hints[id.index()] = RecompressHint::default();
        self.gc_output[id.index()] = false;
        self.uses[id.index()].set(0, 0);
        Some(id)
    }

    /// The lowest free segment, which stays free.
    pub fn lowest_free(&self) -> Option<SegmentId> {
        self.free.first().copied()
    }

    /// The lowest free segment other than `reserved` (the one the other stream's link
    /// named), which stays free.
    pub fn lowest_free_except(&self, reserved: Option<SegmentId>) -> Option<SegmentId> {
        self.free.iter().copied().find(|&id| Some(id) != reserved)
    }

    /// Marks an open segment as a GC stream's (see `gc_output`).
    pub fn note_gc_output(&mut self, id: SegmentId) {
        assert_eq!(self.usage[id.index()].state, SegmentState::Open, "GC output goes to an open segment");
        self.gc_output[id.index()] = true;
    }

    /// Whether a GC stream opened segment `id` in this run.
    pub fn holds_gc_output(&self, id: SegmentId) -> bool {
        self.gc_output[id.index()]
    }

    /// Whether segment `id` is free.
    pub fn is_free(&self, id: SegmentId) -> bool {
        self.free.contains(&id)
    }

    /// Open → Sealed, with the bytes appended to it.
    pub fn seal(&mut self, id: SegmentId, end_bytes: u64) {
        let usage = &mut self.usage[id.index()];
        assert_eq!(usage.state, SegmentState::Open, "sealing segment {id}");
        usage.state = SegmentState::Sealed;
        usage.end_bytes = end_bytes;
    }

    /// Records an append to segment `id` (its end, and the newest record in it if any, with
    /// the nonce epoch its head carries: the first record's begins the use).
    pub fn note_append(&mut self, id: SegmentId, end_bytes: u64, last_seq: Option<(u64, u16)>) {
        let usage = &mut self.usage[id.index()];
        usage.end_bytes = end_bytes;
        if let Some((seq, nonce_epoch)) = last_seq {
            usage.last_seq = seq;
            if usage.first_seq == 0 {
                usage.first_seq = seq;
                usage.nonce_epoch = nonce_epoch;
                self.uses[id.index()].set(seq, nonce_epoch);
            }
            assert_eq!(usage.nonce_epoch, nonce_epoch, "segment {id}: one nonce epoch per use");
        }
    }

    /// Map pages a checkpoint wrote into segment `id` joined the retained tree.
    pub fn add_pages(&mut self, id: SegmentId, bytes: u64) {
        self.usage[id.index()].page_bytes += bytes;
    }

    /// Map pages in segment `id` no retained checkpoint references any more.
    pub fn release_pages(&mut self, id: SegmentId, bytes: u64) {
        let usage = &mut self.usage[id.index()];
        debug_assert!(usage.page_bytes >= bytes, "page bytes underflow in segment {id}");
        usage.page_bytes = usage.page_bytes.saturating_sub(bytes);
    }

    /// A replaced map subtree's entries left the map: live bytes per segment and counts.
    pub fn remove_debt(&mut self, live_bytes: &std::collections::BTreeMap<SegmentId, u64>, counts: BlockCounts) {
        for (&segment, &bytes) in live_bytes {
            let u = &mut self.usage[segment.index()];
            debug_assert!(u.live_bytes >= bytes, "live bytes underflow in segment {segment}");
            u.live_bytes = u.live_bytes.saturating_sub(bytes);
        }
        self.counts.stored = self.counts.stored.saturating_sub(counts.stored);
        self.counts.zero = self.counts.zero.saturating_sub(counts.zero);
    }

    /// GC moved segment `id`'s data; it waits for checkpoints to rewrite its map pages or
    /// to settle the removals its live count still holds.
    pub fn await_checkpoint(&mut self, id: SegmentId) {
        self.awaiting_checkpoint.insert(id);
    }

    /// A checkpoint is durable: every removal owed when a segment began to wait is settled.
    /// A waiting segment with no map pages left that still counts live bytes is given back
    /// to GC: its count is exact now, and taking it again either empties it or, if its
    /// live data really cannot be found, marks it unparseable (`gc.rs`). Emptied ones are
    /// freed by `free_cleaned`. Returns how many were given back.
    pub fn recheck_awaiting(&mut self) -> usize {
        let usage = &self.usage;
        let before = self.awaiting_checkpoint.len();
        self.awaiting_checkpoint.retain(|id| {
            let u = &usage[id.index()];
            u.state != SegmentState::Sealed || u.page_bytes != 0 || u.live_bytes == 0
        });
        before - self.awaiting_checkpoint.len()
    }

    /// Sealed → Cleaned: nothing in it is live any more; `cleaned_seq` is the newest record
    /// appended when it was emptied (it must be durable before the segment is reused).
    pub fn mark_cleaned(&mut self, id: SegmentId, cleaned_seq: u64) {
        let usage = &mut self.usage[id.index()];
        assert_eq!(usage.state, SegmentState::Sealed, "cleaning segment {id}");
        assert_eq!(usage.live_bytes, 0, "cleaning segment {id} with live data");
        assert_eq!(usage.page_bytes, 0, "cleaning segment {id} with live map pages");
        usage.state = SegmentState::Cleaned;
        usage.cleaned_seq = cleaned_seq;
        self.awaiting_checkpoint.remove(&id);
    }

    /// Cleaned → Free. The caller has checked the reuse rule.
    pub fn release(&mut self, id: SegmentId) {
        let usage = &mut self.usage[id.index()];
        assert_eq!(usage.state, SegmentState::Cleaned, "freeing segment {id}");
        assert_eq!(usage.live_bytes, 0, "freeing segment {id} with live data");
        assert_eq!(usage.page_bytes, 0, "freeing segment {id} with live map pages");
        *usage = SegmentUsage::FREE;
        self.hints[id.index()] = RecompressHint::default();
        self.gc_output[id.index()] = false;
        self.uses[id.index()].set(0, 0);
        self.free.insert(id);
    }

    /// A record found at a segment's start during replay, other than the first record of
    /// the use the table knows, begins a new use of it: whatever it held before died
    /// earlier in the log.
    pub fn restart_in_replay(&mut self, id: SegmentId) {
        let usage = &mut self.usage[id.index()];
        self.free.remove(&id);
        *usage = SegmentUsage { state: SegmentState::Sealed, ..SegmentUsage::FREE };
        self.hints[id.index()] = RecompressHint::default();
        self.gc_output[id.index()] = false;
        self.uses[id.index()].set(0, 0);
    }

    /// At open, after replay: segments that hold nothing live and lie behind the reuse
    /// horizon are free — also sealed ones whose data died after the checkpoint (the run
    /// that crashed may have freed and discarded them already). Returns whether such a
    /// sealed one was freed: the caller must then sync before writing any free segment,
    /// so the records that emptied it are on stable media first.
    pub fn settle_at_open(&mut self, horizon_seq: u64) -> bool {
        let pinned: Vec<SegmentId> = self.pinned.iter().flatten().copied().collect();
        let mut freed_sealed = false;
        for (i, s) in self.usage.iter_mut().enumerate() {
            let id = SegmentId(i as u32);
            let empty = matches!(s.state, SegmentState::Cleaned | SegmentState::Sealed)
                && s.live_bytes == 0
                && s.page_bytes == 0;
            if empty && s.last_seq <= horizon_seq && !pinned.contains(&id) {
                freed_sealed |= s.state == SegmentState::Sealed;
                s.state = SegmentState::Free;
            }
            if s.state == SegmentState::Free {
                *s = SegmentUsage::FREE;
                self.hints[i] = RecompressHint::default();
                self.gc_output[i] = false;
                self.uses[i].set(0, 0);
                self.free.insert(id);
            }
        }
        freed_sealed
    }

    /// The segments holding the retained checkpoints' chunks, newest first.
    pub fn set_pinned(&mut self, pinned: Vec<Vec<SegmentId>>) {
        self.pinned = pinned;
    }

    /// A new checkpoint is durable: its chunks are pinned, the oldest retained one's not.
    pub fn pin_newest(&mut self, segments: Vec<SegmentId>) {
        self.pinned.insert(0, segments);
        self.pinned.truncate(2);
    }

    pub fn is_pinned(&self, id: SegmentId) -> bool {
        self.pinned.iter().any(|p| p.contains(&id))
    }

    /// Damaged: GC could not find all its live data. It is never cleaned.
    pub fn mark_unparseable(&mut self, id: SegmentId) {
        self.unparseable.push(id);
    }

    /// Whether segment `id` may be cleaned or freed: sealed, on disk (`unwritten` lists
    /// the segments still buffered), not holding a retained checkpoint's chunks, and fully
    /// parseable.
    pub fn collectable(&self, id: SegmentId, unwritten: &[SegmentId]) -> bool {
        self.sealed_on_disk_and_parseable(id, unwritten) && !self.is_pinned(id)
    }

    fn sealed_on_disk_and_parseable(&self, id: SegmentId, unwritten: &[SegmentId]) -> bool {
        self.usage[id.index()].state == SegmentState::Sealed
            && !unwritten.contains(&id)
            && !self.unparseable.contains(&id)
    }

    /// Whether only checkpoints keep GC from segment `id`: sealed, on disk and parseable,
    /// but pinned by a retained checkpoint or waiting for the checkpoints that settle it.
    pub fn held_by_checkpoints(&self, id: SegmentId, unwritten: &[SegmentId]) -> bool {
        self.sealed_on_disk_and_parseable(id, unwritten)
            && (self.is_pinned(id) || self.awaiting_checkpoint.contains(&id))
    }

    /// Whether GC should take segment `id` as a victim: collectable, and not already
    /// waiting for checkpoints.
    pub fn is_victim_candidate(&self, id: SegmentId, unwritten: &[SegmentId]) -> bool {
        self.collectable(id, unwritten) && !self.awaiting_checkpoint.contains(&id)
    }

    /// Why sealed segments are or are not GC's to take, counted (for an ENOSPC message):
    /// candidates, and those left out as unwritten, pinned by a retained checkpoint,
    /// unparseable, or waiting for checkpoints (map pages, owed removals).
    pub fn victim_census(&self, unwritten: &[SegmentId]) -> String {
        let (mut candidates, mut in_memory, mut pinned, mut damaged, mut awaiting) = (0, 0, 0, 0, 0);
        for (i, s) in self.usage.iter().enumerate() {
            let id = SegmentId(i as u32);
            if s.state != SegmentState::Sealed {
                continue;
            }
            if unwritten.contains(&id) {
                in_memory += 1;
            } else if self.is_pinned(id) {
                pinned += 1;
            } else if self.unparseable.contains(&id) {
                damaged += 1;
            } else if self.awaiting_checkpoint.contains(&id) {
                awaiting += 1;
            } else {
                candidates += 1;
            }
        }
        format!(
            "sealed segments: {candidates} GC may take, {in_memory} not written out, {pinned} pinned, \
             {damaged} unparseable, {awaiting} waiting for checkpoints"
        )
    }

    /// Whether any segment is cleaned and waiting for the reuse rule.
    pub fn has_cleaned(&self) -> bool {
        self.usage.iter().any(|s| s.state == SegmentState::Cleaned)
    }

    /// Whether any victim waits for checkpoints (its map pages, or owed removals): the next
    /// ones rewrite the pages elsewhere and settle the removals, and then it is freed as a
    /// cleaned segment.
    pub fn has_awaiting_checkpoint(&self) -> bool {
        !self.awaiting_checkpoint.is_empty()
    }

    /// Whether segment `id` waits for checkpoints (`await_checkpoint`).
    #[cfg(test)]
    pub fn is_awaiting_checkpoint(&self, id: SegmentId) -> bool {
        self.awaiting_checkpoint.contains(&id)
    }

    /// Whether GC found segment `id` damaged (`mark_unparseable`).
    #[cfg(test)]
    pub fn is_unparseable(&self, id: SegmentId) -> bool {
        self.unparseable.contains(&id)
    }

    pub fn cleaned_count(&self) -> usize {
        self.usage.iter().filter(|s| s.state == SegmentState::Cleaned).count()
    }

    /// Accounts for a map entry joining or leaving the map: the live bytes of the segment
    /// it points into, and the block counts.
    pub fn account(&mut self, entry: PackedEntry, delta: Delta, segment_of: impl Fn(u64) -> SegmentId) {
        if delta == Delta::Add {
            self.note_hint(entry, &segment_of);
        }
        account_entry(&mut self.usage, &mut self.counts, entry, delta, segment_of);
    }

    /// A fragment joined the map: counted in its segment's hint if recompression could
    /// make something of it.
    fn note_hint(&mut self, entry: PackedEntry, segment_of: impl Fn(u64) -> SegmentId) {
        let Ok(Entry::Stored(s)) = entry.unpack() else { return };
        let hint = &mut self.hints[segment_of(s.offset_bytes).index()];
        match s.codec {
            CodecTag::Lz4 => {
                hint.lz4 = hint.lz4.saturating_add(1);
                hint.plain = hint.plain.saturating_add(1);
            }
            CodecTag::Zstd | CodecTag::Deflate => hint.plain = hint.plain.saturating_add(1),
            CodecTag::Raw | CodecTag::ZstdDict => return,
        }
        self.hint_generation += 1;
    }

    pub fn hint(&self, id: SegmentId) -> RecompressHint {
        self.hints[id.index()]
    }

    /// Every segment's use, for reads that do not take the log lock.
    pub fn uses(&self) -> Arc<[UseCell]> {
        Arc::clone(&self.uses)
    }

    pub fn hint_generation(&self) -> u64 {
        self.hint_generation
    }

    /// Idle recompression looked at segment `id`: nothing more to find there until new
    /// fragments join it.
    pub fn clear_hint(&mut self, id: SegmentId) {
        self.hints[id.index()] = RecompressHint::default();
    }

    /// Takes free segments out of the free set (and out of GC's reach) until `keep` are
    /// left: the state a busy store reaches, made directly for white-box tests.
    #[cfg(test)]
    pub fn take_free_for_test(&mut self, keep: usize) {
        while self.free.len() > keep {
            let id = self.free.pop_last().expect("a free segment");
            self.usage[id.index()].state = SegmentState::Open;
        }
    }
}

// ==============================================================================================
// What the LZ4 fallback left for recompression (pending_recompress_bytes)
//
// What the write path's LZ4 fallback left for recompression, for `zdisk stat`
// (`pending_recompress_bytes`, `pending_recompress_saving_bytes`; docs/space.md, "Adaptive
// fallback and recompression"): the stored bytes of the live LZ4 fragments of a store whose
// codec is slower, kept up to date as map entries join and leave the map (the map's
// accounting, `log.rs`, `apply_record`), so a statistic reads one number and never walks
// the map.
//
// Which fragments count: LZ4 ones in segments whose use began after the checkpoint the store
// was opened from — every fragment written or moved since open, replay included. Fragments
// from before the open are not counted: no checkpoint records bytes per codec (it would take
// a format change), and finding them is a walk of the map (`zdisk recompress` makes it).
//
// Invariants:
// - A fragment counts or not by its segment's use (`SegmentUsage::first_seq`), which does
//   not change while the fragment is live: its removal takes off exactly what its joining
//   added. A use's first record is noted before the record is applied (`note_append`), at
//   run time and in replay.
// - `bytes` is the stored length of the map's counted entries plus the removals the map
//   still owes (an overwritten block whose map page is not cached gives up its old entry
//   when the page is next read, at the latest at the next checkpoint): like
//   `SegmentUsage::live_bytes`, an upper bound between checkpoints, exact after each.
// - It never goes below zero; a removal of more than was added is a bug (asserted in debug
//   builds, clamped in release ones: a statistic is not worth failing a write for).
// ==============================================================================================

/// The share of an LZ4 fragment's bytes recompression is expected to save until it has
/// measured its own (`RECOMPRESS_MEASURED_MIN_BYTES`): zstd:1 stored 21–29% fewer bytes than
/// LZ4 on every corpus measured (docs/space.md, "Why zstd level 1"); the least of those.
pub(crate) const RECOMPRESS_SAVING_DEFAULT: f64 = 0.21;

/// LZ4 bytes recompression must have tried since open before its own ratio replaces the
/// default: 1 MiB, a few hundred blocks, so that one odd segment does not set it.
pub(crate) const RECOMPRESS_MEASURED_MIN_BYTES: u64 = 1 << 20;

/// The live LZ4 fragments written since open (see the head of this section).
#[derive(Debug)]
pub(crate) struct PendingRecompress {
    /// Whether LZ4 fragments are pending at all: not in an LZ4 store, which has nothing
    /// better to recompress them into.
    counts_lz4: bool,
    /// Fragments count in segments whose use began after this sequence number (the
    /// checkpoint the store was opened from).
    counted_after_seq: u64,
    bytes: u64,
}

impl PendingRecompress {
    pub fn new(store_codec: Codec, counted_after_seq: u64) -> PendingRecompress {
        PendingRecompress { counts_lz4: store_codec.tag() != CodecTag::Lz4, counted_after_seq, bytes: 0 }
    }

    /// The stored bytes of the counted LZ4 fragments the map holds (an upper bound until the
    /// next checkpoint settles the removals the map owes).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Map entry `entry` joins or leaves the map; `first_seq_of` gives the first record of
    /// the current use of the segment a byte address lies in.
    pub fn account(&mut self, entry: PackedEntry, delta: Delta, first_seq_of: impl Fn(u64) -> u64) {
        if !self.counts_lz4 {
            return;
        }
        let Ok(Entry::Stored(s)) = entry.unpack() else { return };
        if s.codec == CodecTag::Lz4 && first_seq_of(s.offset_bytes) > self.counted_after_seq {
            self.change(s.stored_len as u64, delta);
        }
    }

    /// The entries of replaced map subtrees left the map (a checkpoint walked them): their LZ4
    /// bytes per segment, and each segment's first record.
    pub fn account_walked(&mut self, lz4_bytes: &BTreeMap<SegmentId, u64>, first_seq_of: impl Fn(SegmentId) -> u64) {
        if !self.counts_lz4 {
            return;
        }
        for (&segment, &bytes) in lz4_bytes {
            if first_seq_of(segment) > self.counted_after_seq {
                self.change(bytes, Delta::Remove);
            }
        }
    }

    /// What `bytes` must be given the LZ4 bytes the map references in each segment (`check`
    /// walks the map for them) and each segment's first record.
    pub fn expected(&self, lz4_bytes: &[u64], first_seq_of: impl Fn(usize) -> u64) -> u64 {
        if !self.counts_lz4 {
            return 0;
        }
        let counted = |&(i, _): &(usize, &u64)| first_seq_of(i) > self.counted_after_seq;
        lz4_bytes.iter().enumerate().filter(counted).map(|(_, &bytes)| bytes).sum()
    }

    fn change(&mut self, bytes: u64, delta: Delta) {
        match delta {
            Delta::Add => self.bytes += bytes,
            Delta::Remove => {
                debug_assert!(self.bytes >= bytes, "pending recompression bytes underflow");
                self.bytes = self.bytes.saturating_sub(bytes);
            }
        }
    }
}

/// The bytes recompressing `pending_bytes` of LZ4 fragments is expected to free: at the
/// share recompression saved on the LZ4 fragments it tried since open (`tried_bytes` in,
/// `kept_bytes` out — a fragment not made smaller counts as kept whole) once that is at least
/// `RECOMPRESS_MEASURED_MIN_BYTES`, else at `RECOMPRESS_SAVING_DEFAULT`. An estimate: the
/// fragments left may compress better or worse than those already done.
pub(crate) fn recompress_saving_bytes(pending_bytes: u64, tried_bytes: u64, kept_bytes: u64) -> u64 {
    let saving = if tried_bytes >= RECOMPRESS_MEASURED_MIN_BYTES {
        1.0 - kept_bytes.min(tried_bytes) as f64 / tried_bytes as f64
    } else {
        RECOMPRESS_SAVING_DEFAULT
    };
    (pending_bytes as f64 * saving).round() as u64
}

#[cfg(test)]
mod pending_tests {
    use super::*;
    use crate::format::{FragmentEntry, FragmentFormat};

    const SEGMENT_BYTES: u64 = 1 << 20;

    fn fragment(segment: u64, stored_len: u16, codec: CodecTag) -> PackedEntry {
        PackedEntry::of_fragment(
            segment * SEGMENT_BYTES + 4096,
            FragmentEntry { stored_len, codec },
            FragmentFormat::V3,
        )
    }

    /// Segment 0's use began before the open (checkpoint 10), segments 1 and 2 after it.
    fn first_seq_of(offset_bytes: u64) -> u64 {
        [5, 11, 40][(offset_bytes / SEGMENT_BYTES) as usize]
    }

    #[test]
    fn lz4_fragments_written_since_open_count_until_they_leave_the_map() {
        let mut pending = PendingRecompress::new(Codec::Zstd { level: 1 }, 10);
        pending.account(fragment(1, 2000, CodecTag::Lz4), Delta::Add, first_seq_of);
        pending.account(fragment(2, 1500, CodecTag::Lz4), Delta::Add, first_seq_of);
        // Other codecs, zero blocks and fragments from before the open do not count.
        pending.account(fragment(1, 1000, CodecTag::Zstd), Delta::Add, first_seq_of);
        pending.account(fragment(1, 4108, CodecTag::Raw), Delta::Add, first_seq_of);
        pending.account(PackedEntry::ZERO, Delta::Add, first_seq_of);
        pending.account(fragment(0, 3000, CodecTag::Lz4), Delta::Add, first_seq_of);
        assert_eq!(pending.bytes(), 3500);
        // An old fragment overwritten takes nothing off; a counted one its own bytes.
        pending.account(fragment(0, 3000, CodecTag::Lz4), Delta::Remove, first_seq_of);
        pending.account(fragment(1, 2000, CodecTag::Lz4), Delta::Remove, first_seq_of);
        assert_eq!(pending.bytes(), 1500);
        // A checkpoint's walk of a replaced subtree.
        let walked = BTreeMap::from([(SegmentId(0), 700u64), (SegmentId(2), 1500)]);
        pending.account_walked(&walked, |segment| first_seq_of(segment.0 as u64 * SEGMENT_BYTES));
        assert_eq!(pending.bytes(), 0);
    }

    #[test]
    fn an_lz4_store_has_nothing_pending() {
        let mut pending = PendingRecompress::new(Codec::Lz4, 10);
        pending.account(fragment(1, 2000, CodecTag::Lz4), Delta::Add, first_seq_of);
        assert_eq!(pending.bytes(), 0);
    }

    #[test]
    fn the_saving_is_the_default_share_until_recompression_measured_a_mebibyte() {
        assert_eq!(recompress_saving_bytes(1_000_000, 0, 0), 210_000);
        assert_eq!(recompress_saving_bytes(1_000_000, (1 << 20) - 1, 0), 210_000);
        // Measured: 40% saved.
        assert_eq!(recompress_saving_bytes(1_000_000, 10 << 20, 6 << 20), 400_000);
        // Nothing saved (fragments kept as they were): nothing expected.
        assert_eq!(recompress_saving_bytes(1_000_000, 2 << 20, 2 << 20), 0);
        assert_eq!(recompress_saving_bytes(0, 10 << 20, 6 << 20), 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed(live_bytes: u64, page_bytes: u64) -> SegmentUsage {
        SegmentUsage { state: SegmentState::Sealed, live_bytes, page_bytes, ..SegmentUsage::FREE }
    }

    /// After a checkpoint, a victim waiting for it goes back to GC only when its count, now
    /// exact, is still above zero with no map pages left: emptied ones wait to be freed,
    /// ones with pages wait for the pages' release.
    #[test]
    fn recheck_awaiting_gives_back_to_gc_only_victims_still_counted_live() {
        let mut table = SegmentTable::recovered(vec![sealed(0, 0), sealed(0, 512), sealed(4096, 0), sealed(4096, 512)]);
        for i in 0..4 {
            table.await_checkpoint(SegmentId(i));
        }
        assert!(!table.is_victim_candidate(SegmentId(2), &[]), "a waiting segment is no victim");
        assert_eq!(table.recheck_awaiting(), 1);
        let waiting: Vec<bool> = (0..4).map(|i| table.is_awaiting_checkpoint(SegmentId(i))).collect();
        assert_eq!(waiting, [true, true, false, true]);
        assert!(table.is_victim_candidate(SegmentId(2), &[]), "given back to GC");
    }
}
