//! The operations a record group carries, as the request path and GC hand them to the
//! log: one enum for all of them, from which the appender builds the records
//! (`format::RecordBody` is their on-disk description, `apply::MapEffect` what they do to
//! the map).

use crate::crypto::cipher::Domain;
use crate::format::{FragmentEntry, BATCH_ENTRY_BYTES, FLAG_FIRST, FLAG_LAST, RECORD_MIN_BYTES, WRITE_ENTRY_BYTES};
use crate::map::page::PageId;
use crate::map::{Entry, PackedEntry};
use crate::types::Lba;

/// A request is split into records of at most this many blocks, so headers stay small.
pub(crate) const RECORD_BLOCKS_MAX: usize = 512;
/// Host writes of at most this many blocks go into batch records, which carry an LBA per
/// block; larger ones get write records of their own (a start LBA, and 2 bytes per block).
pub(crate) const BATCH_WRITE_BLOCKS_MAX: usize = 8;

/// A block ready to append: its fragment entry and bytes (protection information and
/// compressed data; the protection information alone for an all-zero block).
#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub entry: FragmentEntry,
    pub bytes: Vec<u8>,
    /// A short-nonce store's sealed fragment: the epoch of its nonce, which the segment it
    /// goes to must record (`LogGuard::hold_to_one_epoch`). None: nothing sealed, or the whole
    /// nonce stored.
    pub nonce_epoch: Option<u16>,
}

/// A live fragment GC found in a victim: where the map points now, and its bytes (a
/// version 3 fragment; a version 2 one is converted as it is read).
#[derive(Clone)]
pub(crate) struct LiveFragment {
    pub lba: Lba,
    pub old: PackedEntry,
    pub block: Block,
    /// An encrypted store's fragment whose guard is not the placement tag of where it was
    /// (damaged or tampered): it moves with that guard, so it still reads as EIO, rather
    /// than be given a good one at its new place.
    pub keeps_guard: bool,
}

impl LiveFragment {
    /// The stored length of the fragment being moved away from (what its segment loses).
    pub fn old_stored_len(&self) -> u64 {
        match self.old.unpack() {
            Ok(Entry::Stored(old)) => old.stored_len as u64,
            _ => 0,
        }
    }
}

/// Trim unmaps; zero maps to written zeroes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RangeKind {
    Trim,
    Zero,
}

impl RangeKind {
    /// The map entry every block of the range gets.
    pub fn entry(self) -> PackedEntry {
        match self {
            RangeKind::Trim => PackedEntry::UNMAPPED,
            RangeKind::Zero => PackedEntry::ZERO,
        }
    }
}

/// One operation of a record group.
#[derive(Clone)]
pub(crate) enum Op {
    /// Host blocks from `start_lba` on. `expected` lists the blocks read-modify-written for
    /// it and the map entry each had when read: the group is appended only if the map still
    /// holds those (else a concurrent request changed one, and this one is redone).
    Write { start_lba: Lba, blocks: Vec<Block>, expected: Vec<(Lba, PackedEntry)> },
    /// Trim or zero a whole-block range.
    Range { kind: RangeKind, start_lba: Lba, block_count: u64 },
    /// GC's copies of fragments as they were: batch records (each a group of its own)
    /// holding those whose map entry is still `old` when they are appended (`log.rs`,
    /// `append_gc_copies`).
    Relocate { fragments: Vec<LiveFragment> },
    /// GC's recompressed copies: batch records (each a group of its own) holding those
    /// whose map entry is still `old` when they are appended (`gc.rs`).
    Recompress { fragments: Vec<LiveFragment> },
    /// A checkpoint image, cut into chunk records (each a group of its own).
    Checkpoint { bytes: Vec<u8> },
    /// Map pages a checkpoint rewrote (records of their own; they change no map entry).
    MapPages { pages: Vec<(PageId, Block)> },
}

impl Op {
    /// The op's blocks, each with what its seal binds: its domain and reference tag (LBA or
    /// page). GC's copies whose guard does not hold where they were (`keeps_guard`) are left
    /// out: they move exactly as they are.
    pub fn sealed_blocks_mut(&mut self) -> Vec<(Domain, u64, &mut Block)> {
        match self {
            Op::Write { start_lba, blocks, .. } => {
                let start = start_lba.0;
                blocks.iter_mut().enumerate().map(|(i, b)| (Domain::Block, start + i as u64, b)).collect()
            }
            Op::Relocate { fragments } | Op::Recompress { fragments } => fragments
                .iter_mut()
                .filter(|f| !f.keeps_guard)
                .map(|f| (Domain::Block, f.lba.0, &mut f.block))
                .collect(),
            Op::MapPages { pages } => pages.iter_mut().map(|(id, b)| (Domain::MapPage, id.tag().0, b)).collect(),
            Op::Range { .. } | Op::Checkpoint { .. } => Vec::new(),
        }
    }

    /// The short-nonce epochs of the op's sealed blocks.
    pub fn nonce_epochs(&self) -> impl Iterator<Item = u16> + '_ {
        let blocks: Box<dyn Iterator<Item = &Block>> = match self {
            Op::Write { blocks, .. } => Box::new(blocks.iter()),
            Op::Relocate { fragments } | Op::Recompress { fragments } => {
                Box::new(fragments.iter().filter(|f| !f.keeps_guard).map(|f| &f.block))
            }
            Op::MapPages { pages } => Box::new(pages.iter().map(|(_, b)| b)),
            Op::Range { .. } | Op::Checkpoint { .. } => Box::new(std::iter::empty()),
        };
        blocks.filter_map(|b| b.nonce_epoch)
    }

    /// The LBAs the op touches (for the range check against a resize); none for GC and
    /// checkpoints.
    pub fn lba_range(&self) -> Option<(Lba, u64)> {
        match self {
            Op::Write { start_lba, blocks, .. } => Some((*start_lba, blocks.len() as u64)),
            Op::Range { start_lba, block_count, .. } => Some((*start_lba, *block_count)),
            Op::Relocate { .. } | Op::Recompress { .. } | Op::Checkpoint { .. } | Op::MapPages { .. } => None,
        }
    }

    /// Log bytes the op takes, conservatively: payload, entries and a header per record
    /// (with `record_extra_bytes` more each: an encrypted store's MAC).
    pub fn log_bytes(&self, segment_capacity_bytes: u64, record_extra_bytes: u64) -> u64 {
        let header = RECORD_MIN_BYTES as u64 + record_extra_bytes;
        match self {
            Op::Write { blocks, .. } => {
                let payload: u64 = blocks.iter().map(|b| b.bytes.len() as u64).sum();
                let entry_bytes =
                    if blocks.len() <= BATCH_WRITE_BLOCKS_MAX { BATCH_ENTRY_BYTES } else { WRITE_ENTRY_BYTES };
                payload
                    + blocks.len() as u64 * entry_bytes as u64
                    + (blocks.len() / RECORD_BLOCKS_MAX + 1) as u64 * header
            }
            Op::Relocate { fragments } | Op::Recompress { fragments } => gc_copy_bytes(fragments, record_extra_bytes),
            Op::Range { .. } => header,
            Op::Checkpoint { bytes } => bytes.len() as u64 + (bytes.len() as u64 / segment_capacity_bytes + 1) * header,
            Op::MapPages { pages } => {
                let payload: u64 = pages.iter().map(|(_, b)| b.bytes.len() as u64).sum();
                payload
                    + pages.len() as u64 * BATCH_ENTRY_BYTES as u64
                    + (pages.len() / RECORD_BLOCKS_MAX + 1 + (payload / segment_capacity_bytes + 1) as usize) as u64
                        * header
            }
        }
    }
}

/// Log bytes the batch records holding GC's copies `fragments` take: the fragments, an
/// entry each, and a header per record.
pub(crate) fn gc_copy_bytes(fragments: &[LiveFragment], record_extra_bytes: u64) -> u64 {
    if fragments.is_empty() {
        return 0;
    }
    let payload: u64 = fragments.iter().map(|f| f.block.bytes.len() as u64).sum();
    payload
        + fragments.len() as u64 * BATCH_ENTRY_BYTES as u64
        + (fragments.len() / RECORD_BLOCKS_MAX + 1) as u64 * (RECORD_MIN_BYTES as u64 + record_extra_bytes)
}

/// Whether a group is only trim and zero records: fixed-size headers, no fragments.
pub(crate) fn metadata_only(ops: &[Op]) -> bool {
    ops.iter().all(|op| matches!(op, Op::Range { .. }))
}

/// Log bytes a group of ops takes, conservatively (`record_extra_bytes`: see `log_bytes`).
pub(crate) fn group_bytes(ops: &[Op], segment_capacity_bytes: u64, record_extra_bytes: u64) -> u64 {
    ops.iter().map(|op| op.log_bytes(segment_capacity_bytes, record_extra_bytes)).sum()
}

/// Hands out FIRST and LAST for the records of one group.
pub(super) struct GroupFlags {
    pub first: bool,
}

impl GroupFlags {
    pub fn next(&mut self, last: bool) -> u8 {
        let flags = if self.first { FLAG_FIRST } else { 0 } | if last { FLAG_LAST } else { 0 };
        self.first = false;
        flags
    }

    /// A record that is a group of its own; the next record starts a new group.
    pub fn alone(&mut self) -> u8 {
        self.first = true;
        FLAG_FIRST | FLAG_LAST
    }
}

/// How many fragments (given their sizes) fit in `room` bytes as one record whose header
/// has `entry_bytes` per fragment.
pub(super) fn fragments_fitting(room: usize, entry_bytes: usize, sizes: impl Iterator<Item = usize>) -> usize {
    let mut bytes = RECORD_MIN_BYTES;
    let mut take = 0;
    for size in sizes {
        if bytes + entry_bytes + size > room {
            break;
        }
        bytes += entry_bytes + size;
        take += 1;
    }
    take
}
