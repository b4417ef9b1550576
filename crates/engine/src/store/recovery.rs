//! Opening a store: choose the checkpoint, rebuild the map and segment table from it, replay
//! the records after it, and settle which segments are free — each its own step.
//!
//! Invariants:
//! - Replay follows exactly one history: the next record must carry the expected sequence
//!   number and chain to the previous header's CRC; the first miss ends the log.
//! - A record group is applied only when its LAST record is found; a FIRST record discards
//!   an unfinished group (left by a crash). Records are applied with the same rule the
//!   appender used (`apply.rs`).
//! - Recovery reads only the records after the checkpoint plus one sector per segment.

use std::collections::HashMap;

use super::apply::apply_record;
use super::log::Log;
use super::scan::{FoundRecord, SegmentCache};
use super::state::Inner;
use crate::backing::Backing;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{Checkpoint, RecordHeader, Superblock, FLAG_FIRST, FLAG_LAST, SUPERBLOCK_SLOT_BYTES};
use crate::map::{Entry, Map, PackedEntry};
use crate::types::{Lba, SegmentId};
use crate::{BLOCK_SIZE, SECTOR_SIZE};

use super::checkpoint::{chunk_segments, load_checkpoint};

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
pub(crate) fn choose_checkpoint(backing: &dyn Backing) -> Result<Chosen> {
    let (best, other) = read_superblocks(backing)?;
    let first = match load_checkpoint(backing, &best) {
        Ok(checkpoint) => {
            let older = other.filter(|o| o.generation < best.generation);
            return Ok(Chosen { superblock: best, checkpoint, older });
        }
        Err(e) => e,
    };
    let Some(other) = other else { return Err(first) };
    match load_checkpoint(backing, &other) {
        Ok(checkpoint) => {
            tracing::warn!("newest checkpoint unreadable ({first}); recovering from the previous one");
            Ok(Chosen { superblock: other, checkpoint, older: None })
        }
        Err(_) => Err(first),
    }
}

/// Step 2: the map a checkpoint holds, and how many blocks are stored and zero.
pub(crate) fn rebuild_map(checkpoint: Option<&Checkpoint>, block_count: u64) -> Result<(Map, u64, u64)> {
    let map = Map::new(block_count);
    let (mut stored, mut zero) = (0, 0);
    for &(lba, raw) in checkpoint.map_or(&[][..], |cp| &cp.map[..]) {
        if lba >= block_count {
            return Err(Error::new(ErrorKind::Corrupt, format!("checkpoint maps LBA {lba} past the end")));
        }
        let entry = PackedEntry(raw);
        match entry.unpack()? {
            Entry::Stored(_) => stored += 1,
            Entry::Zero => zero += 1,
            Entry::Unmapped => {}
        }
        map.swap(Lba(lba), entry);
    }
    Ok((map, stored, zero))
}

impl Inner {
    /// Step 3: replays every complete record group after the checkpoint, in order.
    pub(crate) fn replay(&self, log: &mut Log, sb: &Superblock) -> Result<()> {
        let index = self.index_segment_starts(log.segments.len(), sb.checkpoint_seq);
        let mut cache = SegmentCache::default();
        let map = self.map.read();
        let mut offset = sb.replay_offset_bytes;
        let mut seq = sb.checkpoint_seq + 1;
        let mut prev_crc = sb.replay_prev_crc;
        let mut group: Vec<FoundRecord> = Vec::new();
        while let Some(record) = self.next_record(&mut cache, &index, offset, seq, prev_crc) {
            let segment = self.geometry.segment_of(record.offset_bytes);
            let base = self.geometry.segment_base(segment);
            // A record at a segment's start begins a new use of it. Whatever it held before
            // is dead by now: the records that emptied it precede this one.
            if record.offset_bytes == base {
                log.segments.restart_in_replay(segment);
            }
            let end = (record.end_bytes - base).max(log.segments.get(segment).end_bytes);
            log.segments.note_append(segment, end, Some(record.header.seq));
            seq += 1;
            prev_crc = record.crc;
            offset = record.end_bytes;
            if record.header.flags & FLAG_FIRST != 0 {
                group.clear();
            }
            let last = record.header.flags & FLAG_LAST != 0;
            group.push(record);
            if last {
                for record in group.drain(..) {
                    apply_record(
                        &map,
                        &mut log.segments,
                        &self.geometry,
                        &record.header.body,
                        record.payload_offset_bytes,
                    );
                }
            }
        }
        drop(map);
        log.appender.next_seq = seq;
        log.appender.prev_crc = prev_crc;
        Ok(())
    }

    /// Which segment starts with which sequence number after the checkpoint. Any segment
    /// but the one open at the checkpoint may have been reused after it: free and cleaned
    /// ones, and sealed ones whose data died after it (the reuse rule frees a segment once
    /// the horizon has passed its records and their overwrites are durable, without waiting
    /// for a checkpoint). Several segments may start with the same sequence number: stale
    /// ones left by a run that crashed, and the one that continues the chain. Keep them
    /// all, as candidates (a batch's CRC lies past its payload): `next_record` verifies
    /// whichever one replay follows.
    fn index_segment_starts(&self, segment_count: usize, checkpoint_seq: u64) -> HashMap<u64, Vec<SegmentId>> {
        let mut index: HashMap<u64, Vec<SegmentId>> = HashMap::new();
        let mut head = vec![0u8; SECTOR_SIZE];
        for id in (0..segment_count as u32).map(SegmentId) {
            if self.backing.read_at(self.geometry.segment_base(id), &mut head).is_err() {
                continue;
            }
            if let Some((seq, store_tag)) = RecordHeader::peek_identity(&head) {
                if seq > checkpoint_seq && store_tag == self.geometry.store_tag {
                    index.entry(seq).or_default().push(id);
                }
            }
        }
        index
    }

    /// The record expected next in the chain: at `offset`, at the next sector boundary
    /// (after a flush's padding), or at the start of a segment indexed with its sequence
    /// number.
    fn next_record(
        &self,
        cache: &mut SegmentCache,
        index: &HashMap<u64, Vec<SegmentId>>,
        offset: u64,
        seq: u64,
        prev_crc: u32,
    ) -> Option<FoundRecord> {
        let expected = |r: &FoundRecord| r.header.seq == seq && r.header.prev_crc == prev_crc;
        cache.record_near(self, offset, expected).or_else(|| {
            index
                .get(&seq)
                .into_iter()
                .flatten()
                .find_map(|&id| cache.record_near(self, self.geometry.segment_base(id), expected))
        })
    }

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
