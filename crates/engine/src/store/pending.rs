//! What the write path's LZ4 fallback left for recompression, for `zdisk stat`
//! (`pending_recompress_bytes`, `pending_recompress_saving_bytes`; docs/space.md, "Adaptive
//! fallback and recompression"): the stored bytes of the live LZ4 fragments of a store whose
//! codec is slower, kept up to date as map entries join and leave the map (the map's
//! accounting, `apply.rs`), so a statistic reads one number and never walks the map.
//!
//! Which fragments count: LZ4 ones in segments whose use began after the checkpoint the store
//! was opened from — every fragment written or moved since open, replay included. Fragments
//! from before the open are not counted: no checkpoint records bytes per codec (it would take
//! a format change), and finding them is a walk of the map (`zdisk recompress` makes it).
//!
//! Invariants:
//! - A fragment counts or not by its segment's use (`SegmentUsage::first_seq`), which does
//!   not change while the fragment is live: its removal takes off exactly what its joining
//!   added. A use's first record is noted before the record is applied (`note_append`), at
//!   run time and in replay.
//! - `bytes` is the stored length of the map's counted entries plus the removals the map
//!   still owes (an overwritten block whose map page is not cached gives up its old entry
//!   when the page is next read, at the latest at the next checkpoint): like
//!   `SegmentUsage::live_bytes`, an upper bound between checkpoints, exact after each.
//! - It never goes below zero; a removal of more than was added is a bug (asserted in debug
//!   builds, clamped in release ones: a statistic is not worth failing a write for).

use std::collections::BTreeMap;

use crate::codec::{Codec, CodecTag};
use crate::map::{Delta, Entry, PackedEntry};
use crate::types::SegmentId;

/// The share of an LZ4 fragment's bytes recompression is expected to save until it has
/// measured its own (`RECOMPRESS_MEASURED_MIN_BYTES`): zstd:1 stored 21–29% fewer bytes than
/// LZ4 on every corpus measured (docs/space.md, "Why zstd level 1"); the least of those.
pub(crate) const RECOMPRESS_SAVING_DEFAULT: f64 = 0.21;

/// LZ4 bytes recompression must have tried since open before its own ratio replaces the
/// default: 1 MiB, a few hundred blocks, so that one odd segment does not set it.
pub(crate) const RECOMPRESS_MEASURED_MIN_BYTES: u64 = 1 << 20;

/// The live LZ4 fragments written since open (module comment).
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
mod tests {
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
