//! The one rule for what a record does to the map, used by the appender as it writes a
//! record and by replay as it reads one back — so "replay rebuilds the runtime map" holds
//! by construction, not by two copies agreeing.
//!
//! - write and batch records map each LBA to its fragment (an all-zero block to ZERO);
//! - trim and zero records map their range to UNMAPPED or ZERO;
//! - relocate records (GC's copies in stores written before 2026-11-27; GC now writes batch
//!   records, checked when appended) move an LBA to the copy only if the map still holds
//!   the old place (a later overwrite wins);
//! - checkpoint chunks do nothing.
//!
//! Every change is accounted in the segment table (live bytes, block counts). LBAs past the
//! map's end are skipped: the request path checks ranges before it appends, and replay may
//! meet records written before a shrink.

use super::geometry::Geometry;
use super::op::RangeKind;
use super::pending::PendingRecompress;
use super::segments::{account_entry, BlockCounts, SegmentTable};
use crate::error::Result;
use crate::format::{FragmentFormat, RecordBody, SegmentUsage};
use crate::map::{Accounting, Delta, PackedEntry, PageSource, PagedMap};
use crate::types::Lba;

/// The LBAs whose map entry a record sets (not relocations: a relocate entry may have lost
/// its compare-and-swap. GC's batch records do count: they hold only copies that won it, so
/// each is its block's latest contents as of the record). Replay after a lost record uses
/// them to know which blocks are provably newer.
pub(crate) fn lbas_set(body: &RecordBody) -> Vec<(Lba, u64)> {
    match body {
        RecordBody::Write { .. } | RecordBody::Batch { .. } => {
            body.fragments().iter().map(|(lba, _)| (*lba, 1)).collect()
        }
        RecordBody::Trim { start_lba, block_count } | RecordBody::Zero { start_lba, block_count } => {
            vec![(*start_lba, *block_count)]
        }
        _ => Vec::new(),
    }
}

/// The live segment table (and the pending recompression it feeds) as the map's accounting.
pub(crate) struct Live<'a> {
    pub segments: &'a mut SegmentTable,
    pub pending: &'a mut PendingRecompress,
    pub geometry: &'a Geometry,
}

impl Accounting for Live<'_> {
    fn entry(&mut self, entry: PackedEntry, delta: Delta) {
        let geometry = self.geometry;
        let segments = &*self.segments;
        self.pending.account(entry, delta, |o| segments.get(geometry.segment_of(o)).first_seq);
        self.segments.account(entry, delta, |o| geometry.segment_of(o));
    }

    fn constant(&mut self, value: PackedEntry, blocks: u64, delta: Delta) {
        self.segments.counts.constant(value, blocks, delta);
    }
}

/// A checkpoint's own copy of the table, which its frozen changes are settled into.
pub(crate) struct SnapshotAccount<'a> {
    pub usage: &'a mut [SegmentUsage],
    pub counts: &'a mut BlockCounts,
    pub geometry: &'a Geometry,
}

impl Accounting for SnapshotAccount<'_> {
    fn entry(&mut self, entry: PackedEntry, delta: Delta) {
        let geometry = self.geometry;
        account_entry(self.usage, self.counts, entry, delta, |o| geometry.segment_of(o));
    }

    fn constant(&mut self, value: PackedEntry, blocks: u64, delta: Delta) {
        self.counts.constant(value, blocks, delta);
    }
}

/// What applying a record changed beyond the map.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Applied {
    /// Fragment bytes relocate entries moved (those whose compare-and-swap succeeded).
    pub relocated_bytes: u64,
}

/// Applies `body`, whose payload (fragments of `format`) starts at byte address
/// `payload_offset_bytes`, to the map. Fails only if a map page cannot be read.
pub(crate) fn apply_record(
    map: &PagedMap,
    live: &mut Live<'_>,
    src: &dyn PageSource,
    body: &RecordBody,
    format: FragmentFormat,
    payload_offset_bytes: u64,
) -> Result<Applied> {
    let mut applied = Applied::default();
    let block_count = map.block_count();
    match body {
        RecordBody::Write { .. } | RecordBody::Batch { .. } => {
            let mut at = payload_offset_bytes;
            for (lba, fragment) in body.fragments() {
                let new = PackedEntry::of_fragment(at, fragment, format);
                at += fragment.stored_len as u64;
                if lba.0 < block_count {
                    map.set(lba, new, live);
                }
            }
        }
        RecordBody::Trim { start_lba, block_count: count } | RecordBody::Zero { start_lba, block_count: count } => {
            let kind = if matches!(body, RecordBody::Zero { .. }) { RangeKind::Zero } else { RangeKind::Trim };
            if start_lba.0 < block_count {
                let count = (*count).min(block_count - start_lba.0);
                map.set_range(*start_lba, count, kind.entry(), live, src)?;
            }
        }
        RecordBody::Relocate { entries } => {
            let mut at = payload_offset_bytes;
            for e in entries {
                let new = PackedEntry::of_fragment(at, e.fragment, format);
                at += e.fragment.stored_len as u64;
                let old_fragment = e.old_fragment(format);
                if e.lba.0 >= block_count
                    || e.old_offset_bytes > crate::map::OFFSET_MAX
                    || e.fragment.is_zero_block(format)
                    || old_fragment.is_zero_block(e.old_format)
                {
                    continue;
                }
                let old = PackedEntry::of_fragment(e.old_offset_bytes, old_fragment, e.old_format);
                if map.compare_swap(e.lba, old, new, live, src)? {
                    applied.relocated_bytes += e.fragment.stored_len as u64;
                }
            }
        }
        RecordBody::Checkpoint
        | RecordBody::Marker
        | RecordBody::MapPages { .. }
        | RecordBody::Link { .. }
        | RecordBody::Jump { .. } => {}
    }
    Ok(applied)
}
