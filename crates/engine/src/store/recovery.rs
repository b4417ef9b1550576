//! Opening a store: choose the checkpoint, rebuild the map and segment table from it, replay
//! the records after it, and settle which segments are free — each its own step.
//!
//! Step 3, replay, has a room of its own (`replay.rs`).
//!
//! Invariant: recovery reads only the checkpoint and the records after it, following each
//! segment's link to the next (and, only for an older format, a segment without a readable
//! link, or a damaged record, one sector per segment and the segments that could hold what
//! follows). Map pages are read when they are first needed, not at open.

use std::collections::BTreeMap;

use super::log::Log;
use super::segments::BlockCounts;
use super::state::Inner;
use crate::backing::Backing;
use crate::crypto::cipher::StoreCipher;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{Checkpoint, Superblock, SUPERBLOCK_SLOT_BYTES};
use crate::map::page;
use crate::map::{Entry, PackedEntry, PagedMap};
use crate::types::{Lba, SegmentId};
use crate::BLOCK_SIZE;

use super::checkpoint::{chunk_segments, load_checkpoint};

/// A record recovery found damaged.
#[derive(Debug, Clone)]
pub(crate) struct DamagedRecord {
    /// Where it starts (or where the damage starts, for a lost record).
    pub offset_bytes: u64,
    /// What was damaged and what recovery did.
    pub what: String,
    /// The LBA ranges (start, blocks) it wrote, where known.
    pub lbas: Vec<(Lba, u64)>,
    /// Complete, and no later record proves it durable: what a crash during its write
    /// leaves (a torn head or tail sector), not decay. Nothing was lost.
    pub torn_tail: bool,
    /// A checkpoint chunk or marker: nothing maps to it (a retained checkpoint that needs a
    /// damaged chunk is reported on its own).
    pub maps_nothing: bool,
}

/// A store that lost records: which blocks are provably newer than the loss.
#[derive(Debug, Clone, Default)]
pub(crate) struct Degraded {
    pub first_lost_seq: u64,
    /// Ranges (start → end, exclusive) of LBAs written, trimmed or zeroed after the loss.
    newer: BTreeMap<u64, u64>,
}

impl Degraded {
    pub(super) fn from(first_lost_seq: u64) -> Degraded {
        Degraded { first_lost_seq, newer: BTreeMap::new() }
    }

    pub(super) fn note(&mut self, start: Lba, blocks: u64) {
        let (mut start, mut end) = (start.0, start.0.saturating_add(blocks));
        // Merge with overlapping or adjacent ranges.
        if let Some((&s, &e)) = self.newer.range(..=start).next_back() {
            if e >= start {
                start = s;
                end = end.max(e);
            }
        }
        while let Some((&s, &e)) = self.newer.range(start..).next() {
            if s > end {
                break;
            }
            end = end.max(e);
            self.newer.remove(&s);
        }
        self.newer.insert(start, end);
    }

    /// Whether block `lba` was written after the loss (so no lost record can be newer).
    pub fn is_newer(&self, lba: Lba) -> bool {
        self.newer.range(..=lba.0).next_back().is_some_and(|(_, &end)| lba.0 < end)
    }
}

/// What recovery found, for `check` and the statistics.
#[derive(Debug, Clone, Default)]
pub(crate) struct RecoveryFindings {
    pub damaged: Vec<DamagedRecord>,
    pub degraded: Option<Degraded>,
    /// The segment the last replayed segment's link names: where the log goes on.
    pub continue_in: Option<SegmentId>,
    /// Whether replay had to read every segment's start (an older format, an unreadable
    /// link, or damage).
    pub indexed: bool,
}

/// The checkpoint recovery starts from, with the superblock that points at it.
pub(crate) struct Chosen {
    pub superblock: Superblock,
    pub checkpoint: Option<Checkpoint>,
    /// The other slot's superblock, when valid and older: the older retained checkpoint.
    pub older: Option<Superblock>,
}

pub(crate) fn read_superblocks(backing: &dyn Backing) -> Result<(Superblock, Option<Superblock>)> {
    if backing.size_bytes() < 2 * SUPERBLOCK_SLOT_BYTES as u64 {
        return Err(Error::new(ErrorKind::NotAStore, "too small to hold a zdisk superblock"));
    }
    let mut slots = vec![0u8; 2 * SUPERBLOCK_SLOT_BYTES];
    backing.read_at(0, &mut slots).map_err(|e| Error::io("read superblocks", e))?;
    pick_superblock(&slots, backing.size_bytes())
}

/// Chooses the newest valid superblock slot; also returns the other one if valid and of the
/// same store.
fn pick_superblock(slots: &[u8], backing_size_bytes: u64) -> Result<(Superblock, Option<Superblock>)> {
    let decoded = [
        Superblock::decode(&slots[..SUPERBLOCK_SLOT_BYTES]),
        Superblock::decode(&slots[SUPERBLOCK_SLOT_BYTES..2 * SUPERBLOCK_SLOT_BYTES]),
    ];
    let (mut valid, errors): (Vec<_>, Vec<_>) = decoded.into_iter().partition(|r| r.is_ok());
    if valid.is_empty() {
        // Report the most telling error: a newer version beats corruption beats "foreign".
        let errors: Vec<Error> = errors.into_iter().filter_map(|r| r.err()).collect();
        for kind in [ErrorKind::NewerVersion, ErrorKind::Corrupt] {
            if let Some(e) = errors.iter().find(|e| e.kind() == kind) {
                return Err(Error::new(kind, e.to_string()));
            }
        }
        return Err(Error::new(ErrorKind::NotAStore, "no valid zdisk superblock"));
    }
    let mut valid: Vec<Superblock> = valid.drain(..).filter_map(|r| r.ok()).collect();
    valid.sort_by_key(|sb| std::cmp::Reverse(sb.generation));
    let best = valid.remove(0);
    let other = valid.pop().filter(|sb| sb.uuid == best.uuid);
    if best.physical_size_bytes > backing_size_bytes {
        return Err(Error::new(
            ErrorKind::Truncated,
            format!("the superblock says {} bytes, the backing has {}", best.physical_size_bytes, backing_size_bytes),
        ));
    }
    Ok((best, other))
}

/// Step 1: the newest superblock whose checkpoint loads; the older one if it does not.
pub(crate) fn choose_checkpoint(backing: &dyn Backing, cipher: Option<&StoreCipher>) -> Result<Chosen> {
    let (best, other) = read_superblocks(backing)?;
    let first = match load_checkpoint(backing, &best, cipher) {
        Ok(checkpoint) => {
            let older = other.filter(|o| o.generation < best.generation);
            return Ok(Chosen { superblock: best, checkpoint, older });
        }
        Err(e) => e,
    };
    let Some(other) = other else { return Err(first) };
    match load_checkpoint(backing, &other, cipher) {
        Ok(checkpoint) => {
            tracing::warn!("newest checkpoint unreadable ({first}); recovering from the previous one");
            Ok(Chosen { superblock: other, checkpoint, older: None })
        }
        Err(_) => Err(first),
    }
}

/// Step 2: the map a checkpoint points at (nothing is read: pages are read as they are
/// needed), and how many blocks are stored and zero. An older checkpoint's whole map is
/// taken as changes, which the first checkpoint writes as pages.
pub(crate) fn build_map(
    checkpoint: Option<&Checkpoint>,
    block_count: u64,
    cache_bytes: usize,
) -> Result<(PagedMap, BlockCounts)> {
    let height_needed = page::height_for(block_count);
    let Some(cp) = checkpoint else {
        return Ok((
            PagedMap::new(block_count, height_needed, PackedEntry::UNMAPPED.0, cache_bytes),
            BlockCounts::default(),
        ));
    };
    if let Some(root) = cp.map_root {
        let map = PagedMap::new(block_count, root.height.max(height_needed), root.root, cache_bytes);
        if root.height < height_needed {
            return Err(Error::new(ErrorKind::Corrupt, "checkpoint map is too short for its logical size"));
        }
        return Ok((map, BlockCounts { stored: cp.stored_blocks, zero: cp.zero_blocks }));
    }
    let map = PagedMap::new(block_count, height_needed, PackedEntry::UNMAPPED.0, cache_bytes);
    let mut counts = BlockCounts::default();
    for &(lba, raw) in &cp.legacy_map {
        if lba >= block_count {
            return Err(Error::new(ErrorKind::Corrupt, format!("checkpoint maps LBA {lba} past the end")));
        }
        match PackedEntry(raw).unpack()? {
            Entry::Stored(_) => counts.stored += 1,
            Entry::Zero => counts.zero += 1,
            Entry::Unmapped | Entry::Lost => {}
        }
    }
    map.import(&cp.legacy_map);
    Ok((map, counts))
}

impl Inner {
    /// Step 4: which segments are pinned by the retained checkpoints, the reuse horizon,
    /// and which segments are free.
    pub(crate) fn settle_segments(&self, log: &mut Log, chosen: &Chosen) -> Result<()> {
        let sb = &chosen.superblock;
        let mut pinned = vec![chunk_segments(&self.geometry, sb)];
        log.epochs.reuse_horizon_seq = sb.checkpoint_seq;
        if let Some(older) = &chosen.older {
            pinned.push(chunk_segments(&self.geometry, older));
            log.epochs.reuse_horizon_seq = log.epochs.reuse_horizon_seq.min(older.checkpoint_seq);
        }
        log.segments.set_pinned(pinned);
        let freed_sealed = log.segments.settle_at_open(log.epochs.reuse_horizon_seq);
        // The records that emptied those sealed segments were replayed, so they are on
        // disk; the sync makes sure they are on stable media before any of these segments
        // is written again.
        if freed_sealed && !self.read_only {
            self.backing.sync().map_err(|e| Error::io("sync after recovery", e))?;
        }
        Ok(())
    }
}

/// The logical size recovery opens with: the checkpoint's, else the superblock's.
pub(crate) fn logical_size_bytes(chosen: &Chosen) -> u64 {
    chosen.checkpoint.as_ref().map_or(chosen.superblock.logical_size_bytes, |cp| cp.logical_size_bytes)
}

/// Blocks of `logical_size_bytes`.
pub(crate) fn block_count(logical_size_bytes: u64) -> u64 {
    logical_size_bytes / BLOCK_SIZE as u64
}
