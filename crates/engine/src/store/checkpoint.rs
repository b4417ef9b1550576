//! Checkpoints, and freeing segments under the reuse rule.
//!
//! A checkpoint is a snapshot of the segment table and the counters as of one record, the
//! map pages that changed since the last one (written into the log as map-pages records,
//! `pages.rs`), and the root of the map they form; the image is written as chunk records,
//! made durable, and then pointed at by the next superblock slot (generation g goes to slot
//! g mod 2).
//!
//! Invariants:
//! - The superblock slot is written only after every chunk and page it needs is durable.
//! - The snapshot is taken, and the map's changes frozen, under one hold of the log lock:
//!   the pages hold exactly the changes of the records up to the snapshot's sequence
//!   number, and replay applies the ones after it.
//! - The reuse horizon is the checkpoint sequence number of the older retained superblock:
//!   recovery from either replays only records after it.
//! - Map pages a checkpoint replaces stay counted until the next checkpoint is durable:
//!   the previous checkpoint, still retained, references them.
//! - Reuse rule: a cleaned segment becomes free only when (1) all its records are at or
//!   before the horizon, (2) the records that emptied it are durable, and (3) no reader
//!   still holds a map entry into it. Checked in this order by `free_cleaned_locked`,
//!   under the checkpoint lock, so two callers never free the same segment.

use std::sync::atomic::Ordering;

use super::capacity::SpaceClass;
use super::geometry::{round_up, Geometry};
use super::lock::MutexGuard;
use super::log::Attempt;
use super::log::Op;
use super::pages::PageCheckpoint;
use super::state::Inner;
use super::writeout::WriteOut;
use crate::backing::Backing;
use crate::crypto::cipher::StoreCipher;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{
    Checkpoint, MapRoot, SegmentState, Superblock, CHUNK_REFS_MAX, DATA_START_BYTES, FEATURE_AUTHENTICATED_LOG,
    FEATURE_DICTIONARIES, FEATURE_ENCRYPTED, FEATURE_LOG_JUMPS, FEATURE_PLACEMENT_USE, FEATURE_SHORT_NONCES,
    FORMAT_VERSION, SUPERBLOCK_SLOT_BYTES,
};
use crate::stats::Counters;
use crate::types::SegmentId;
use crate::{BLOCK_SIZE, SECTOR_SIZE};

/// A checkpoint's snapshot: what it records besides the map.
struct Snapshot {
    seq: u64,
    generation: u64,
    logical_size_bytes: u64,
    counters: [u64; crate::format::COUNTER_ORDER.len()],
    replay_offset_bytes: u64,
    replay_prev_crc: u32,
}

impl Inner {
    /// Takes a snapshot, writes the changed map pages and the image into the log, makes
    /// them durable, points the next superblock slot at them, and frees the segments the
    /// reuse rule now allows.
    pub(crate) fn checkpoint_now(&self) -> Result<()> {
        self.checkpoint_when(|| true)
    }

    /// Writes a checkpoint if `due` still holds once the checkpoint lock is held (writers
    /// that waited for one just written need not write another).
    pub(crate) fn checkpoint_when(&self, due: impl Fn() -> bool) -> Result<()> {
        let mut durable_sb = self.checkpoint.lock();
        self.health.check_writable()?;
        if !due() {
            return Ok(());
        }
        let (snapshot, mut pages) = self.snapshot();
        if let Err(e) = self.write_map_pages(&mut pages) {
            self.map.read().unfreeze();
            let mut log = self.log.lock();
            for (&segment, &bytes) in &pages.superseded {
                *log.epochs.superseded_carry.entry(segment).or_default() += bytes;
            }
            return Err(e);
        }
        let map_root = {
            let map = self.map.read();
            let tree = map.lock();
            MapRoot { height: tree.height, root: tree.root }
        };
        let image = Checkpoint {
            seq: snapshot.seq,
            generation: snapshot.generation,
            logical_size_bytes: snapshot.logical_size_bytes,
            counters: snapshot.counters,
            segments: pages.usage,
            map_root: Some(map_root),
            stored_blocks: pages.counts.stored,
            zero_blocks: pages.counts.zero,
            superseded: pages.superseded.iter().map(|(&s, &b)| (s.0, b)).collect(),
            legacy_map: Vec::new(),
            dictionaries: self.codecs.dictionaries.read().entries(self.log.cipher.as_deref())?,
            nonce_epochs: self.log.cipher.as_deref().is_some_and(StoreCipher::short_nonces),
        };
        let encoded = image.encode();
        let appended = match self.try_append(&[Op::Checkpoint { bytes: encoded.clone() }], SpaceClass::Internal)? {
            Attempt::Appended(appended) => appended,
            Attempt::Short { .. } => return Err(Error::new(ErrorKind::NoSpace, "no room for a checkpoint")),
            Attempt::Conflict => unreachable!("checkpoints carry no expectations"),
        };
        if appended.chunks.len() > CHUNK_REFS_MAX {
            return Err(Error::new(ErrorKind::NoSpace, "checkpoint too large for the superblock"));
        }
        self.write_out(WriteOut::Flush)?;
        let mut sb = Superblock {
            format_version: Superblock::version_for(self.log.cipher.is_some()),
            generation: snapshot.generation,
            logical_size_bytes: snapshot.logical_size_bytes,
            checkpoint_seq: snapshot.seq,
            replay_offset_bytes: snapshot.replay_offset_bytes,
            replay_prev_crc: snapshot.replay_prev_crc,
            checkpoint_chunks: appended.chunks,
            // Older code refuses a store that keeps a dictionary (docs/format.md, "Dictionaries").
            feature_flags: (durable_sb.feature_flags
                & (FEATURE_ENCRYPTED
                    | FEATURE_AUTHENTICATED_LOG
                    | FEATURE_LOG_JUMPS
                    | FEATURE_PLACEMENT_USE
                    | FEATURE_SHORT_NONCES))
                | if image.dictionaries.is_empty() { 0 } else { FEATURE_DICTIONARIES },
            ..durable_sb.clone()
        };
        if let Some(cipher) = &self.log.cipher {
            sb.mac = cipher.mac(&[&sb.mac_input(), &encoded]);
        }
        let slot = (sb.generation % 2) * SUPERBLOCK_SLOT_BYTES as u64;
        let bytes = sb.encode();
        self.backing.write_at(slot, &bytes).map_err(|e| self.fail(Error::io("write superblock", e)))?;
        self.backing.sync().map_err(|e| self.fail(Error::io("sync superblock", e)))?;
        Counters::add(&self.counters.backing_write_bytes, bytes.len() as u64);
        Counters::add(&self.counters.metadata_bytes, (bytes.len() + encoded.len()) as u64);
        Counters::add(&self.counters.checkpoints, 1);
        {
            let mut log = self.log.lock();
            log.epochs.checkpoint_bytes = encoded.len() as u64 + pages.page_bytes_written;
            log.epochs.image_bytes = encoded.len() as u64;
            // The previous checkpoint is now the older retained one: the pages it replaced
            // are referenced by no retained checkpoint any more.
            for (segment, bytes) in std::mem::take(&mut log.epochs.release_after_next) {
                log.segments.release_pages(SegmentId(segment), bytes);
            }
            log.epochs.release_after_next = image.superseded;
            log.segments.pin_newest(chunk_segments(&self.geometry, &sb));
            log.segments.recheck_awaiting();
            assert!(durable_sb.checkpoint_seq <= sb.checkpoint_seq, "checkpoints out of order");
            log.epochs.reuse_horizon_seq = durable_sb.checkpoint_seq;
        }
        *durable_sb = sb;
        self.free_cleaned_locked(&durable_sb)?;
        Ok(())
    }

    /// The snapshot a checkpoint records, taken with the map's changes frozen, under one
    /// hold of the log lock. It covers whole records only: the open batch is closed first.
    /// The table copy already leaves out the pages the previous checkpoint replaced: they
    /// are released the moment this one is durable.
    fn snapshot(&self) -> (Snapshot, PageCheckpoint) {
        let mut log = self.log.lock();
        log.close_batch();
        log.epochs.snapshot_generation += 1;
        let map = self.map.read();
        map.freeze();
        let replay_offset_bytes = match &log.appender.open {
            // (A full segment's end is the next one's start: replay would take the offset
            // for that segment's, and follow the wrong link.)
            Some(open) if (open.append_offset_bytes as u64) < self.geometry.segment_size_bytes => {
                self.geometry.segment_base(open.buffer.segment) + open.append_offset_bytes as u64
            }
            // The next record opens the segment the last link named, or the lowest free.
            _ => log
                .appender
                .next_segment
                .or_else(|| log.segments.lowest_free())
                .map_or(DATA_START_BYTES, |s| self.geometry.segment_base(s)),
        };
        let mut usage = log.segments.snapshot();
        for &(segment, bytes) in &log.epochs.release_after_next {
            let u = &mut usage[segment as usize];
            u.page_bytes = u.page_bytes.saturating_sub(bytes);
        }
        let snapshot = Snapshot {
            seq: log.appender.next_seq - 1,
            generation: log.epochs.snapshot_generation,
            logical_size_bytes: map.block_count() * BLOCK_SIZE as u64,
            counters: self.counters.to_array(),
            replay_offset_bytes,
            replay_prev_crc: log.appender.prev_crc,
        };
        let pages = PageCheckpoint {
            usage,
            counts: log.segments.counts,
            superseded: std::mem::take(&mut log.epochs.superseded_carry),
            page_bytes_written: 0,
            pages_written: 0,
        };
        log.epochs.bytes_since_checkpoint = 0;
        (snapshot, pages)
    }

    /// Frees the cleaned segments the reuse rule allows (see [`Inner::free_cleaned_locked`]).
    pub(crate) fn free_cleaned(&self) -> Result<usize> {
        let durable_sb = self.checkpoint.lock();
        self.free_cleaned_locked(&durable_sb)
    }

    /// Frees every cleaned segment that nothing recovery could replay points into, in the
    /// order of the reuse rule (module comment), and only then discards it on the backing
    /// and puts it in the free set — a segment discarded after reuse would lose the new
    /// data written into it. Sealed segments whose data all died (overwritten or trimmed)
    /// are freed the same way, without GC reading them.
    pub(crate) fn free_cleaned_locked(&self, _checkpoint_held: &MutexGuard<'_, Superblock>) -> Result<usize> {
        // GC must not be working on a segment while it is freed (it would mark it cleaned
        // after it was reused).
        let _gc = self.background.gc_lock.lock();
        let unwritten = self.unwritten_segments();
        let (freeable, emptied_seq) = {
            let mut log = self.log.lock();
            let horizon = log.epochs.reuse_horizon_seq;
            let now_seq = log.appender.next_seq - 1;
            let dead: Vec<SegmentId> = log
                .segments
                .iter()
                .filter(|&(id, s)| s.live_bytes == 0 && s.page_bytes == 0 && log.segments.collectable(id, &unwritten))
                .map(|(id, _)| id)
                .collect();
            for id in dead {
                log.segments.mark_cleaned(id, now_seq);
            }
            // (1) behind the horizon.
            let freeable: Vec<SegmentId> = log
                .segments
                .iter()
                .filter(|(_, s)| s.state == SegmentState::Cleaned && s.last_seq <= horizon)
                .map(|(id, _)| id)
                .collect();
            let emptied_seq = freeable.iter().map(|&id| log.segments.get(id).cleaned_seq).max().unwrap_or(0);
            (freeable, emptied_seq)
        };
        if freeable.is_empty() {
            return Ok(0);
        }
        // (2) what emptied them is durable; (3) no reader holds an old map entry.
        self.flush_upto(emptied_seq)?;
        drop(self.map.write());
        for &id in &freeable {
            self.log.segment_uses[id.index()].note_freed();
        }
        // Off by default: the log reuses the segment soon, and a file's punched blocks must
        // be allocated again under the flushes that follow (docs/format.md).
        if self.options.discard_freed {
            for &id in &freeable {
                let base = self.geometry.segment_base(id);
                if let Err(e) = self.backing.discard(base, self.geometry.segment_size_bytes) {
                    tracing::warn!("discard of segment {id} failed: {e}");
                }
            }
        }
        let mut log = self.log.lock();
        let horizon = log.epochs.reuse_horizon_seq;
        for &id in &freeable {
            // Cleaned segments are touched by nobody else (GC and allocation skip them).
            let usage = log.segments.get(id);
            assert!(usage.last_seq <= horizon, "freeing segment {id} before the reuse horizon passed it");
            assert!(
                usage.cleaned_seq <= self.log.durable_seq.load(Ordering::Acquire),
                "freeing segment {id} before what emptied it is durable"
            );
            log.segments.release(id);
            self.reads.cache.forget_segment(id);
        }
        self.space.publish_host_slack(log.host_slack(&self.reserves()));
        Ok(freeable.len())
    }

    /// Log bytes between checkpoints. Short enough that GC victims (the older segments)
    /// have usually passed the reuse horizon — at most 1/4 of the data area, so the last
    /// two intervals cover at most half of it, segments greedy GC would not take yet (under
    /// uniform overwrites at 80% utilisation they are still over 80% live) — and long
    /// enough that a checkpoint (its pages and table) stays a small part of what is
    /// written: at least 32 times its size. Never longer than the configured interval,
    /// which bounds recovery time.
    pub(crate) fn checkpoint_interval_bytes(&self) -> u64 {
        let checkpoint_bytes = self.log.lock().epochs.checkpoint_bytes;
        (self.geometry.data_area_bytes() / 4).max(32 * checkpoint_bytes).min(self.options.checkpoint_interval_bytes)
    }
}

/// The segments holding the chunks of the checkpoint a superblock points at.
pub(crate) fn chunk_segments(geometry: &Geometry, sb: &Superblock) -> Vec<SegmentId> {
    let mut segments: Vec<SegmentId> = sb
        .checkpoint_chunks
        .iter()
        .filter(|c| c.offset_bytes >= DATA_START_BYTES)
        .map(|c| geometry.segment_of(c.offset_bytes))
        .filter(|&s| (s.0 as u64) < geometry.segment_count)
        .collect();
    segments.dedup();
    segments
}

/// Reads and decodes the checkpoint a superblock points at (`None` for a fresh store).
///
/// An encrypted store's superblock and checkpoint must carry its MAC under `cipher`; without
/// a cipher (statistics read without the key) they are taken on their CRCs alone.
pub(crate) fn load_checkpoint(
    backing: &dyn Backing,
    sb: &Superblock,
    cipher: Option<&StoreCipher>,
) -> Result<Option<Checkpoint>> {
    let verify = |compressed: &[u8]| match cipher {
        Some(cipher) if !cipher.verify_mac(&[&sb.mac_input(), compressed], &sb.mac) => Err(Error::new(
            ErrorKind::Corrupt,
            format!("superblock generation {} fails authentication (tampered, or not this key's)", sb.generation),
        )),
        _ => Ok(()),
    };
    if sb.checkpoint_chunks.is_empty() {
        verify(&[])?;
        return Ok(None);
    }
    let mut compressed = Vec::new();
    for chunk in &sb.checkpoint_chunks {
        let start = chunk.offset_bytes / SECTOR_SIZE as u64 * SECTOR_SIZE as u64;
        let end = round_up(chunk.offset_bytes + chunk.length_bytes as u64, SECTOR_SIZE as u64);
        if start < DATA_START_BYTES || end > sb.physical_size_bytes {
            return Err(Error::new(ErrorKind::Corrupt, "checkpoint chunk outside the data area"));
        }
        let mut buf = vec![0u8; (end - start) as usize];
        backing.read_at(start, &mut buf).map_err(|e| Error::io("read checkpoint", e))?;
        let at = (chunk.offset_bytes - start) as usize;
        let bytes = &buf[at..at + chunk.length_bytes as usize];
        if crc32c::crc32c(bytes) != chunk.crc {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("checkpoint chunk at {} fails its checksum", chunk.offset_bytes),
            ));
        }
        compressed.extend_from_slice(bytes);
    }
    verify(&compressed)?;
    // The superblock carries the checkpoint's logical size: the map holds at most that many
    // blocks, which bounds what decoding may allocate.
    // An older format's image holds the whole map: at most one entry per block.
    let legacy_blocks = if sb.format_version < FORMAT_VERSION { sb.logical_size_bytes / BLOCK_SIZE as u64 } else { 0 };
    let decoded_max = Checkpoint::decoded_bytes_max(sb.segment_count(), legacy_blocks);
    let cp = Checkpoint::decode(&compressed, decoded_max)?;
    if cp.seq != sb.checkpoint_seq || cp.generation != sb.generation {
        return Err(Error::new(ErrorKind::Corrupt, "checkpoint does not match its superblock"));
    }
    if (sb.feature_flags & FEATURE_DICTIONARIES != 0) == cp.dictionaries.is_empty() {
        return Err(Error::new(ErrorKind::Corrupt, "the superblock and its checkpoint disagree on dictionaries"));
    }
    if (sb.feature_flags & FEATURE_SHORT_NONCES != 0) != cp.nonce_epochs {
        return Err(Error::new(ErrorKind::Corrupt, "the superblock and its checkpoint disagree on nonce epochs"));
    }
    Ok(Some(cp))
}
