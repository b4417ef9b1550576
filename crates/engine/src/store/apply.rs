//! The one rule for what a record does to the map, used by the appender as it writes a
//! record and by replay as it reads one back — so "replay rebuilds the runtime map" holds
//! by construction, not by two copies agreeing.
//!
//! - write and batch records map each LBA to its fragment (an all-zero block to ZERO);
//! - trim and zero records map their range to UNMAPPED or ZERO;
//! - relocate records move an LBA to the copy only if the map still holds the old place
//!   (a later overwrite wins);
//! - checkpoint chunks do nothing.
//!
//! Every change is accounted in the segment table (live bytes, block counts). LBAs past the
//! map's end are skipped: the request path checks ranges before it appends, and replay may
//! meet records written before a shrink.

use super::op::RangeKind;
use super::segments::{Change, SegmentTable};
use super::state::Geometry;
use crate::format::{FragmentFormat, RecordBody};
use crate::map::{Map, PackedEntry};
use crate::types::Lba;

/// The LBAs whose map entry a record sets (not relocations: a copy does not make a block
/// newer). Replay after a lost record uses them to know which blocks are provably newer.
pub(crate) fn lbas_set(body: &RecordBody) -> Vec<(Lba, u64)> {
    match body {
        RecordBody::Write { .. } | RecordBody::Batch { .. } => {
            body.fragments().iter().map(|(lba, _)| (*lba, 1)).collect()
        }
        RecordBody::Trim { start_lba, block_count } | RecordBody::Zero { start_lba, block_count } => {
            vec![(*start_lba, *block_count)]
        }
        RecordBody::Relocate { .. } | RecordBody::Checkpoint | RecordBody::Marker => Vec::new(),
    }
}

/// What applying a record changed beyond the map.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Applied {
    /// Fragment bytes relocate entries moved (those whose compare-and-swap succeeded).
    pub relocated_bytes: u64,
}

/// Applies `body`, whose payload (fragments of `format`) starts at byte address
/// `payload_offset_bytes`, to the map.
pub(crate) fn apply_record(
    map: &Map,
    segments: &mut SegmentTable,
    geometry: &Geometry,
    body: &RecordBody,
    format: FragmentFormat,
    payload_offset_bytes: u64,
) -> Applied {
    let mut applied = Applied::default();
    let block_count = map.block_count();
    let publish = |lba: Lba, new: PackedEntry, segments: &mut SegmentTable| {
        let old = map.swap(lba, new);
        segments.account(old, Change::Remove, |o| geometry.segment_of(o));
        segments.account(new, Change::Add, |o| geometry.segment_of(o));
    };
    match body {
        RecordBody::Write { .. } | RecordBody::Batch { .. } => {
            let mut at = payload_offset_bytes;
            for (lba, fragment) in body.fragments() {
                let new = PackedEntry::of_fragment(at, fragment, format);
                at += fragment.stored_len as u64;
                if lba.0 < block_count {
                    publish(lba, new, segments);
                }
            }
        }
        RecordBody::Trim { start_lba, block_count: count } | RecordBody::Zero { start_lba, block_count: count } => {
            let kind = if matches!(body, RecordBody::Zero { .. }) { RangeKind::Zero } else { RangeKind::Trim };
            let end = start_lba.0.saturating_add(*count).min(block_count);
            for lba in start_lba.0..end {
                publish(Lba(lba), kind.entry(), segments);
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
                if map.compare_swap(e.lba, old, new) {
                    segments.account(old, Change::Remove, |o| geometry.segment_of(o));
                    segments.account(new, Change::Add, |o| geometry.segment_of(o));
                    applied.relocated_bytes += e.fragment.stored_len as u64;
                }
            }
        }
        RecordBody::Checkpoint | RecordBody::Marker => {}
    }
    applied
}
