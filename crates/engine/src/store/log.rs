//! The log: one append attempt, and how a group of ops becomes records in the open segment.
//!
//! Invariants:
//! - Map order is log order: a group's records are appended and its map entries published
//!   under one hold of the log lock (`apply.rs` is the one rule for both).
//! - A group is FIRST..LAST; relocations and checkpoint chunks are groups of one record.
//! - Records chain: each carries the previous header's CRC and the session nonce.
//! - A batch record open at the end of the log is the last record: nothing else is appended
//!   until it is closed, and none of its bytes are written out before (so its head, filled
//!   in at close, never rewrites a written sector).
//! - Every record carries the durable sequence number as of its append: proof, for replay,
//!   that the records before it were not torn.
//! - Fragments never span segments; a record that does not fit seals the segment.
//! - Two streams, one chain: host writes and metadata go to the host stream's open segment,
//!   GC's output to the cold stream's, with a jump record between them (`streams.rs`).

use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::apply::{apply_record, Live};
use super::background::Wakeups;
use super::geometry::{AlignedBuf, Geometry, SegmentBuffer, FRAGMENT_END_WASTE_BYTES};
use super::health::Health;
use super::lock::{Mutex, MutexGuard, Rank, RwLock};
use super::op::{
    fragments_fitting, Block, GroupFlags, LiveFragment, Op, RangeKind, BATCH_WRITE_BLOCKS_MAX, RECORD_BLOCKS_MAX,
};
use super::proof::ProofState;
use super::segments::{SegmentTable, UseCell};
use super::space::{Reserves, SpaceClass};
use super::streams::{ParkedStream, Stream};
use crate::crypto::cipher::StoreCipher;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{
    BatchEntry, ChunkRef, EncodedRecord, FragmentFormat, Protection, RecordBody, RecordHeader, RecordVersion,
    BATCH_ENTRY_BYTES, BATCH_LBA_LIMIT, FLAG_FIRST, FLAG_LAST, HEAD_BYTES, PI_BYTES, RECORD_MAC_BYTES,
    RECORD_MIN_BYTES, TAIL_FIXED_BYTES, WRITE_ENTRY_BYTES,
};
use crate::map::page::PageId;
use crate::map::PageSource;
use crate::map::PagedMap;
use crate::stats::Counters;
use crate::stats::{CodecCounters, LogCounters};
use crate::types::{Lba, SegmentId};

/// Buffered log bytes past which the writer thread is woken.
pub(crate) const WRITE_OUT_THRESHOLD_BYTES: usize = 1 << 20;

/// The log: its state behind the log lock, and what appending needs besides — the store's
/// geometry, its cipher, the counters it keeps, the health it fails when a record cannot
/// be applied, the wake-ups of the threads that write it out. Nothing outside reaches into
/// an append: the store hands it the map to apply to and the reserves to keep
/// (`LogGuard::append`).
pub(crate) struct Log {
    /// Rank 5: the appender, the segment table, checkpoint epochs.
    state: Mutex<LogState>,
    /// Rank 4: serialises backing writes of log data, so a flush knows every earlier write
    /// is done; holds what the last flush proof said (`proof.rs`).
    pub io: Mutex<ProofState>,
    /// Rank 8: the segment buffers readers may find data in (the open segments and sealed
    /// ones not yet written out).
    pub buffered: RwLock<Vec<Arc<SegmentBuffer>>>,
    /// Only grows; every record up to it is on stable media.
    pub durable_seq: AtomicU64,
    pub geometry: Geometry,
    /// An encrypted store's keys (`crypto/`): fragments are sealed after compression and
    /// opened before decompression, placed where they land; records and checkpoints carry
    /// a MAC.
    pub cipher: Option<Arc<StoreCipher>>,
    /// Each segment's use, shared with the segment table (`SegmentTable::uses`): what an
    /// encrypted store's placement tags bind besides the address, read without the log lock.
    pub segment_uses: Arc<[UseCell]>,
    /// GC's output may go to the cold streams (`streams.rs`): the store was formatted with
    /// them (superblock feature flag `FEATURE_LOG_JUMPS`; its native capacity counts the
    /// second open segment).
    pub cold_stream: bool,
    pub counters: Arc<Counters>,
    pub codec_counters: Arc<CodecCounters>,
    /// Map pages' bytes, GC's moves into the cold streams, flushes written through.
    pub log_counters: LogCounters,
    /// Threads writing log bytes out to the disk or waiting to (`writeout.rs`): how busy the
    /// disk is, read by the write path's codec choice without a lock (`codec::WriteLoad`).
    /// The backlog would not say it: the write-behind bound keeps it at ~2 MiB however slow
    /// the disk is, by making writers write out themselves.
    pub disk_writers: std::sync::atomic::AtomicUsize,
    /// Free segments, as of the last release of the log lock: whether the write path may
    /// spend space on storing blocks uncompressed for now (`codec::WriteLoad`).
    pub free_segments: AtomicU64,
    pub(super) health: Arc<Health>,
    pub(super) wakeups: Arc<Wakeups>,
}

/// What the store shares with its log when it opens.
pub(crate) struct LogParts {
    pub geometry: Geometry,
    pub cipher: Option<Arc<StoreCipher>>,
    pub cold_stream: bool,
    pub counters: Arc<Counters>,
    pub codec_counters: Arc<CodecCounters>,
    pub health: Arc<Health>,
    pub wakeups: Arc<Wakeups>,
}

/// The log lock held: the log's state, and the methods that append to it.
pub(crate) struct LogGuard<'a> {
    pub(super) log: &'a Log,
    pub(super) state: MutexGuard<'a, LogState>,
}

/// The map a group's records are applied to, and where its pages are read from.
#[derive(Clone, Copy)]
pub(crate) struct MapTarget<'a> {
    pub map: &'a PagedMap,
    pub pages: &'a dyn PageSource,
}

/// Everything the log lock guards.
pub(crate) struct LogState {
    pub appender: Appender,
    pub segments: SegmentTable,
    pub epochs: CheckpointEpochs,
    /// The live LZ4 fragments written since open, for the statistics (`pending.rs`).
    pub pending: super::pending::PendingRecompress,
}

impl LogState {
    /// The segment table (and the pending recompression it feeds) as the map's accounting.
    pub fn live<'a>(&'a mut self, geometry: &'a Geometry) -> Live<'a> {
        Live { segments: &mut self.segments, pending: &mut self.pending, geometry }
    }
}

/// Written segments' buffers kept for reuse.
pub(crate) const BUFFER_POOL_MAX: usize = 4;

/// Where the next record goes and what it chains to.
pub(crate) struct Appender {
    pub next_seq: u64,
    pub prev_crc: u32,
    pub session: u32,
    /// The nonce epoch of the segment uses begun now, which every record's head carries: a
    /// short-nonce store's sealed fragments must have it (`LogGuard::hold_to_one_epoch`).
    pub nonce_epoch: u16,
    pub open: Option<OpenSegment>,
    /// The batch record growing in the open segment, if any.
    pub batch: Option<OpenBatch>,
    pub sealed_unwritten: VecDeque<SealedSegment>,
    /// Buffers of written segments for the next ones to open, zeroed (padding between
    /// records must read as zeros), at most `BUFFER_POOL_MAX`.
    pub buffer_pool: Vec<AlignedBuf>,
    /// The segment the log continues in after the open one: named by the open segment's
    /// link record, kept out of nobody's way (only the appender takes free segments).
    pub next_segment: Option<SegmentId>,
    /// The stream `open` belongs to.
    pub stream: Stream,
    /// The other streams' open segments, while records go to this one.
    pub parked: Vec<ParkedStream>,
}

/// Checkpoint bookkeeping the appender and the space rules need.
pub(crate) struct CheckpointEpochs {
    /// Generation of the newest checkpoint snapshot taken (durable or not).
    pub snapshot_generation: u64,
    /// The reuse horizon: the checkpoint sequence number of the older retained superblock.
    /// Recovery (even falling back to that superblock) replays only records after it, so a
    /// segment whose records all lie at or before it is never read by replay again.
    pub reuse_horizon_seq: u64,
    pub bytes_since_checkpoint: u64,
    /// Size of the newest checkpoint (its image and map pages), for the interval.
    pub checkpoint_bytes: u64,
    /// Size of the newest checkpoint's image (both retained ones take about this much).
    pub image_bytes: u64,
    /// Map page bytes per segment the newest durable checkpoint replaced: released once the
    /// next one is durable.
    pub release_after_next: Vec<(u32, u64)>,
    /// Pages replaced by checkpoints that failed before they were durable (carried into the
    /// next one's list).
    pub superseded_carry: std::collections::BTreeMap<SegmentId, u64>,
}

pub(crate) struct OpenSegment {
    pub buffer: Arc<SegmentBuffer>,
    pub append_offset_bytes: usize,
    /// Bytes handed to the backing (always a sector multiple).
    pub written_offset_bytes: usize,
}

/// A batch record still growing at the end of the open segment. Its head is reserved at
/// `record_offset_bytes` and written when it closes, together with the tail that follows
/// the fragments. Its sequence number is taken when it opens.
pub(crate) struct OpenBatch {
    record_offset_bytes: usize,
    seq: u64,
    prev_crc: u32,
    entries: Vec<BatchEntry>,
    payload_len: usize,
    payload_crc: u32,
}

impl OpenBatch {
    /// Bytes still to be appended when it closes: its entries and the tail's fixed part.
    pub(super) fn trailer_bytes(&self) -> usize {
        self.entries.len() * BATCH_ENTRY_BYTES + TAIL_FIXED_BYTES
    }
}

pub(crate) struct SealedSegment {
    pub buffer: Arc<SegmentBuffer>,
    pub end_offset_bytes: usize,
    pub written_offset_bytes: usize,
}

/// A group that went into the log.
pub(crate) struct Appended {
    /// Sequence number of the group's last record.
    pub last_seq: u64,
    /// Where the chunks of a checkpoint op went.
    pub chunks: Vec<ChunkRef>,
    /// Where the fragments of a map-pages op went (byte addresses, in order).
    pub page_offsets: Vec<u64>,
}

/// The outcome of one append attempt.
pub(crate) enum Attempt {
    Appended(Appended),
    /// The log lacks this many bytes for the group (its class's reserve included), with
    /// `available_bytes` available when it was refused.
    Short {
        shortfall_bytes: u64,
        available_bytes: u64,
    },
    /// A block the group read-modify-writes changed since it was read: redo the request.
    Conflict,
}

impl Log {
    pub fn new(state: LogState, parts: LogParts) -> Log {
        let segment_uses = state.segments.uses();
        Log {
            state: Mutex::new(Rank::Log, state),
            io: Mutex::new(Rank::Io, ProofState::default()),
            buffered: RwLock::new(Rank::Buffered, Vec::new()),
            durable_seq: AtomicU64::new(0),
            log_counters: LogCounters::default(),
            disk_writers: std::sync::atomic::AtomicUsize::new(0),
            free_segments: AtomicU64::new(0),
            geometry: parts.geometry,
            segment_uses,
            cipher: parts.cipher,
            cold_stream: parts.cold_stream,
            counters: parts.counters,
            codec_counters: parts.codec_counters,
            health: parts.health,
            wakeups: parts.wakeups,
        }
    }

    /// Bytes a record of this store carries beyond a plain one: an encrypted store's MAC.
    pub fn record_extra_bytes(&self) -> u64 {
        if self.cipher.is_some() {
            RECORD_MAC_BYTES as u64
        } else {
            0
        }
    }

    /// `FRAGMENT_END_WASTE_BYTES` for this store: an encrypted one's largest fragment is
    /// larger by its seal, and its record by its MAC.
    pub fn fragment_end_waste_bytes(&self) -> u64 {
        match self.cipher {
            Some(ref c) => FRAGMENT_END_WASTE_BYTES + (c.fragment_overhead_bytes() + RECORD_MAC_BYTES) as u64,
            None => FRAGMENT_END_WASTE_BYTES,
        }
    }

    /// Sets, in an encrypted store, the guard of a sealed fragment just put at byte `address`
    /// of a segment in use `use_seq` to the placement tag of that address and use
    /// (`StoreCipher::placement`): read anywhere else, or there in another use, it fails. A
    /// plain store's fragment, and an all-zero block's, keep theirs.
    fn place_fragment(&self, fragment: &mut [u8], address: u64, use_seq: u64) {
        let Some(cipher) = self.cipher.as_deref() else { return };
        let Ok(pi) = Protection::decode(&fragment[..PI_BYTES]) else { return };
        if pi.entry.is_zero_block(FragmentFormat::V3) {
            return;
        }
        let guard = cipher.placement(address, use_seq, &fragment[PI_BYTES..]);
        fragment[..PI_BYTES].copy_from_slice(&Protection { guard, ..pi }.encode());
    }

    /// A record's head and tail: with a MAC in an encrypted store (`docs/format.md`).
    fn encode_record(&self, header: &RecordHeader) -> EncodedRecord {
        match self.cipher.as_deref() {
            Some(cipher) => header.encode_authenticated(&|parts| cipher.mac(parts)),
            None => header.encode(),
        }
    }

    /// Takes the log lock (rank 5).
    pub fn lock(&self) -> LogGuard<'_> {
        LogGuard { log: self, state: self.state.lock() }
    }
}

impl Drop for LogGuard<'_> {
    /// Every change to the free segments is made under the log lock: publishing them as
    /// the lock is released keeps the atomic current.
    fn drop(&mut self) {
        self.log.free_segments.store(self.state.segments.free_count() as u64, Ordering::Relaxed);
    }
}

impl Deref for LogGuard<'_> {
    type Target = LogState;
    fn deref(&self) -> &LogState {
        &self.state
    }
}

impl DerefMut for LogGuard<'_> {
    fn deref_mut(&mut self) -> &mut LogState {
        &mut self.state
    }
}

impl LogGuard<'_> {
    /// Appends the group and publishes its map entries (in `map`, whose pages `pages`
    /// reads) if the log has room for it beyond its class's reserve (`reserves`), else says
    /// how much it lacks. The caller checked
    /// that the store is writable and the group's expectations hold, under this lock.
    pub(crate) fn append(
        &mut self,
        ops: &[Op],
        class: SpaceClass,
        reserves: &Reserves,
        map: &RwLock<PagedMap>,
        pages: &dyn PageSource,
    ) -> Result<Attempt> {
        // (Before the map's lock: resealing takes the nonce source, which ranks below it.)
        let resealed = self.hold_to_one_epoch(ops)?;
        let ops = resealed.as_deref().unwrap_or(ops);
        self.retire_colder_when_short(reserves);
        let stream = self.stream_for(ops, class, reserves);
        let shortfall_bytes = self.shortfall_bytes(ops, class, stream, reserves);
        if shortfall_bytes > 0 {
            return Ok(Attempt::Short { shortfall_bytes, available_bytes: self.available_bytes() });
        }
        let map = map.read();
        Ok(Attempt::Appended(self.append_checked(ops, stream, MapTarget { map: &map, pages })?))
    }

    /// Appends a group whose space was checked, and publishes its map entries.
    fn append_checked(&mut self, ops: &[Op], stream: Stream, map: MapTarget<'_>) -> Result<Appended> {
        for (start_lba, count) in ops.iter().filter_map(Op::lba_range) {
            if start_lba.0 + count > map.map.block_count() {
                return Err(Error::new(ErrorKind::OutOfRange, "request past the end (resized)"));
            }
        }
        self.switch_stream(stream)?;
        let appended = |state: &LogState, chunks, page_offsets| Appended {
            last_seq: state.appender.next_seq - 1,
            chunks,
            page_offsets,
        };
        if let [Op::Write { start_lba, blocks, .. }] = ops {
            if blocks.len() <= BATCH_WRITE_BLOCKS_MAX {
                self.append_to_batch(map, *start_lba, blocks)?;
                return Ok(appended(&self.state, Vec::new(), Vec::new()));
            }
        }
        self.close_batch();
        let mut flags = GroupFlags { first: true };
        let mut chunks = Vec::new();
        let mut page_offsets = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let last_op = i + 1 == ops.len();
            match op {
                Op::Write { start_lba, blocks, .. } => {
                    for (j, piece) in blocks.chunks(RECORD_BLOCKS_MAX).enumerate() {
                        let last_piece = last_op && (j + 1) * RECORD_BLOCKS_MAX >= blocks.len();
                        let piece_lba = start_lba.plus((j * RECORD_BLOCKS_MAX) as u64);
                        self.append_write_records(map, piece_lba, piece, &mut flags, last_piece)?;
                    }
                }
                Op::Range { kind, start_lba, block_count } => {
                    self.ensure_room(RECORD_MIN_BYTES)?;
                    let body = match kind {
                        RangeKind::Trim => RecordBody::Trim { start_lba: *start_lba, block_count: *block_count },
                        RangeKind::Zero => RecordBody::Zero { start_lba: *start_lba, block_count: *block_count },
                    };
                    let (payload_at, body) = self.put_record(flags.next(last_op), body, &[], &[]);
                    self.apply(map, &body, payload_at)?;
                }
                Op::Relocate { fragments } => self.append_gc_copies(map, fragments, &mut flags, false)?,
                Op::Recompress { fragments } => self.append_gc_copies(map, fragments, &mut flags, true)?,
                Op::Checkpoint { bytes } => chunks.extend(self.append_checkpoint_records(bytes, &mut flags)?),
                Op::MapPages { pages } => page_offsets.extend(self.append_page_records(pages, &mut flags)?),
            }
        }
        Ok(appended(&self.state, chunks, page_offsets))
    }

    /// Applies an appended record to the map. A map page that cannot be read leaves the
    /// map behind the log: the store fails (read-only; reopening replays the record).
    fn apply(&mut self, map: MapTarget<'_>, body: &RecordBody, payload_at: u64) -> Result<u64> {
        let log = self.log;
        let mut live = self.state.live(&log.geometry);
        match apply_record(map.map, &mut live, map.pages, body, FragmentFormat::V3, payload_at) {
            Ok(applied) => Ok(applied.relocated_bytes),
            Err(e) => Err(log.health.fail(e)),
        }
    }

    /// Write records for up to `RECORD_BLOCKS_MAX` blocks: as many records as the segment
    /// ends make it.
    fn append_write_records(
        &mut self,
        map: MapTarget<'_>,
        start_lba: Lba,
        blocks: &[Block],
        flags: &mut GroupFlags,
        last_piece: bool,
    ) -> Result<()> {
        let mut done = 0;
        while done < blocks.len() {
            let sizes = blocks[done..].iter().map(|b| b.bytes.len());
            let take = fragments_fitting(self.room(), WRITE_ENTRY_BYTES, sizes);
            if take == 0 {
                self.open_new_segment()?;
                continue;
            }
            let part = &blocks[done..done + take];
            let body = RecordBody::Write {
                start_lba: start_lba.plus(done as u64),
                fragments: part.iter().map(|b| b.entry).collect(),
            };
            let payload: Vec<&[u8]> = part.iter().map(|b| b.bytes.as_slice()).collect();
            let record_flags = flags.next(last_piece && done + take == blocks.len());
            let (payload_at, body) = self.put_record(record_flags, body, &payload, &vec![true; payload.len()]);
            self.apply(map, &body, payload_at)?;
            let data_bytes: usize = part.iter().map(|b| b.bytes.len()).sum();
            Counters::add(&self.log.counters.data_bytes, data_bytes as u64);
            done += take;
        }
        Ok(())
    }

    /// Batch records for GC's copies (moved as they were, or `recompressed`), each a group
    /// of its own. A fragment goes in only if the map still points at its old place —
    /// checked here, under the log lock, so nothing changes the entry before the record is
    /// applied: a concurrent overwrite wins. Replay applies batch records unconditionally, in
    /// log order, which is the order these checks were made in; so a copy needs no old
    /// address for a compare-and-swap, and its entry is a batch's 8 bytes, once — where the
    /// relocate records written until 2026-11-27 held 14 bytes twice (docs/format.md).
    fn append_gc_copies(
        &mut self,
        map: MapTarget<'_>,
        fragments: &[LiveFragment],
        flags: &mut GroupFlags,
        recompressed: bool,
    ) -> Result<()> {
        // The copies' leaves stay loaded from the check to the apply, a record's worth of
        // copies at a time (at most 512 leaves pinned, 2 MiB; and no more records than
        // `gc_copy_bytes` counts): so each copy removes the entry it replaces at once,
        // instead of owing the removal of a victim's fragment — a map cache smaller than
        // the map evicts between the two (docs/space.md, "GC and the map cache").
        let mut fragments: Vec<&LiveFragment> = fragments.iter().filter(|f| f.lba.0 < map.map.block_count()).collect();
        fragments.sort_unstable_by_key(|f| f.lba);
        for group in fragments.chunks(RECORD_BLOCKS_MAX) {
            let leaves = PageId::leaves_of(group.iter().map(|f| f.lba));
            map.map.pin_loaded(&leaves, map.pages)?;
            let appended = self.append_current_gc_copies(map, group, flags, recompressed);
            map.map.unpin(&leaves);
            appended?;
        }
        Ok(())
    }

    /// [`LogGuard::append_gc_copies`] for copies whose leaves are pinned.
    fn append_current_gc_copies(
        &mut self,
        map: MapTarget<'_>,
        fragments: &[&LiveFragment],
        flags: &mut GroupFlags,
        recompressed: bool,
    ) -> Result<()> {
        let mut current = Vec::with_capacity(fragments.len());
        for &fragment in fragments {
            if map.map.get(fragment.lba, map.pages)? == fragment.old {
                current.push(fragment);
            }
        }
        let mut done = 0;
        while done < current.len() {
            let sizes = current[done..].iter().take(RECORD_BLOCKS_MAX).map(|f| f.block.bytes.len());
            let take = fragments_fitting(self.room(), BATCH_ENTRY_BYTES, sizes);
            if take == 0 {
                self.open_new_segment()?;
                continue;
            }
            let part = &current[done..done + take];
            let entries = part.iter().map(|f| BatchEntry { lba: f.lba, fragment: f.block.entry }).collect();
            let payload: Vec<&[u8]> = part.iter().map(|f| f.block.bytes.as_slice()).collect();
            // (A copy whose guard did not vouch for its old place keeps it: EIO still.)
            let placed: Vec<bool> = part.iter().map(|f| recompressed || !f.keeps_guard).collect();
            let (payload_at, body) = self.put_record(flags.alone(), RecordBody::Batch { entries }, &payload, &placed);
            self.apply(map, &body, payload_at)?;
            let new_bytes: u64 = part.iter().map(|f| f.block.bytes.len() as u64).sum();
            self.count_gc_moved(new_bytes);
            done += take;
            if !recompressed {
                continue;
            }
            let old_bytes: u64 = part.iter().map(|f| f.old_stored_len()).sum();
            Counters::add(&self.log.codec_counters.recompressed_fragments, take as u64);
            let with_dictionary =
                part.iter().filter(|f| f.block.entry.codec == crate::codec::CodecTag::ZstdDict).count();
            Counters::add(&self.log.codec_counters.recompressed_fragments_dictionary, with_dictionary as u64);
            Counters::add(&self.log.codec_counters.recompress_saved_bytes, old_bytes.saturating_sub(new_bytes));
        }
        Ok(())
    }

    /// Counts bytes GC moved (and, into a GC stream, `gc_cold_bytes_moved`; into the
    /// colder one, `gc_colder_bytes_moved` too).
    fn count_gc_moved(&self, bytes: u64) {
        Counters::add(&self.log.counters.gc_bytes_moved, bytes);
        if self.state.appender.stream.is_gc() {
            Counters::add(&self.log.log_counters.gc_cold_bytes_moved, bytes);
        }
        if self.state.appender.stream == Stream::Colder {
            Counters::add(&self.log.log_counters.gc_colder_bytes_moved, bytes);
        }
    }

    /// Checkpoint-chunk records holding `bytes`; returns where the chunks went.
    fn append_checkpoint_records(&mut self, bytes: &[u8], flags: &mut GroupFlags) -> Result<Vec<ChunkRef>> {
        let mut chunks = Vec::new();
        let mut done = 0;
        while done < bytes.len() {
            let room = self.room().saturating_sub(RECORD_MIN_BYTES);
            if room < 512.min(bytes.len() - done) {
                self.open_new_segment()?;
                continue;
            }
            let take = room.min(bytes.len() - done);
            let part = &bytes[done..done + take];
            let (payload_at, _) = self.put_record(flags.alone(), RecordBody::Checkpoint, &[part], &[]);
            chunks.push(ChunkRef { offset_bytes: payload_at, length_bytes: take as u32, crc: crc32c::crc32c(part) });
            done += take;
        }
        Ok(chunks)
    }

    /// Map-pages records for a checkpoint's pages (each a group of its own); returns where
    /// each page's fragment went.
    fn append_page_records(&mut self, pages: &[(PageId, Block)], flags: &mut GroupFlags) -> Result<Vec<u64>> {
        let mut offsets = Vec::with_capacity(pages.len());
        let mut done = 0;
        while done < pages.len() {
            let sizes = pages[done..].iter().take(RECORD_BLOCKS_MAX).map(|(_, b)| b.bytes.len());
            let take = fragments_fitting(self.room(), BATCH_ENTRY_BYTES, sizes);
            if take == 0 {
                self.open_new_segment()?;
                continue;
            }
            let part = &pages[done..done + take];
            let entries = part.iter().map(|(id, b)| BatchEntry { lba: id.tag(), fragment: b.entry }).collect();
            let payload: Vec<&[u8]> = part.iter().map(|(_, b)| b.bytes.as_slice()).collect();
            let placed = vec![true; payload.len()];
            let (mut at, _) = self.put_record(flags.alone(), RecordBody::MapPages { entries }, &payload, &placed);
            for (_, b) in part {
                offsets.push(at);
                at += b.bytes.len() as u64;
            }
            let page_bytes = part.iter().map(|(_, b)| b.bytes.len() as u64).sum();
            Counters::add(&self.log.counters.metadata_bytes, page_bytes);
            Counters::add(&self.log.log_counters.map_write_bytes, page_bytes);
            done += take;
        }
        Ok(offsets)
    }

    /// Appends host blocks to the open batch record, first closing it (and opening a new
    /// segment) when they do not fit. All of them go into one record: a request is atomic.
    fn append_to_batch(&mut self, map: MapTarget<'_>, start_lba: Lba, blocks: &[Block]) -> Result<()> {
        debug_assert!(blocks.len() <= BATCH_WRITE_BLOCKS_MAX);
        debug_assert!(start_lba.0 + (blocks.len() as u64) < BATCH_LBA_LIMIT);
        let payload_bytes: usize = blocks.iter().map(|b| b.bytes.len()).sum();
        let added = payload_bytes + blocks.len() * BATCH_ENTRY_BYTES;
        let fits = self
            .state
            .appender
            .batch
            .as_ref()
            .is_some_and(|b| b.entries.len() + blocks.len() <= RECORD_BLOCKS_MAX && self.room() >= added);
        if !fits {
            self.open_batch(added)?;
        }
        // (The open batch is a record of this segment's use: its first is known.)
        let use_seq = self
            .state
            .segments
            .get(self.state.appender.open.as_ref().expect("an open segment").buffer.segment)
            .first_seq;
        debug_assert_ne!(use_seq, 0, "a batch's segment has a first record");
        let state = &mut *self.state;
        let appender = &mut state.appender;
        let open = appender.open.as_mut().expect("an open segment");
        let batch = appender.batch.as_mut().expect("an open batch");
        let segment = open.buffer.segment;
        let payload_at = self.log.geometry.segment_base(segment) + open.append_offset_bytes as u64;
        let mut at = open.append_offset_bytes;
        let mut entries = Vec::with_capacity(blocks.len());
        {
            let mut data = open.buffer.data.write();
            for (i, block) in blocks.iter().enumerate() {
                let place = &mut data[at..at + block.bytes.len()];
                place.copy_from_slice(&block.bytes);
                self.log.place_fragment(place, self.log.geometry.segment_base(segment) + at as u64, use_seq);
                batch.payload_crc = crc32c::crc32c_append(batch.payload_crc, place);
                entries.push(BatchEntry { lba: start_lba.plus(i as u64), fragment: block.entry });
                at += block.bytes.len();
            }
        }
        batch.entries.extend_from_slice(&entries);
        batch.payload_len += payload_bytes;
        open.append_offset_bytes = at;
        state.segments.note_append(segment, at as u64, None);
        state.epochs.bytes_since_checkpoint += payload_bytes as u64;
        let body = RecordBody::Batch { entries };
        self.apply(map, &body, payload_at)?;
        Counters::add(&self.log.counters.data_bytes, payload_bytes as u64);
        Ok(())
    }

    /// Closes the open batch and opens a new one with room for `added` bytes of fragments
    /// and entries (in a new segment if this one lacks it). The batch takes its sequence
    /// number now.
    fn open_batch(&mut self, added: usize) -> Result<()> {
        self.close_batch();
        if self.state.appender.open.is_none() || self.room() < RECORD_MIN_BYTES + added {
            self.open_new_segment()?;
        }
        let state = &mut *self.state;
        let appender = &mut state.appender;
        let open = appender.open.as_mut().expect("an open segment");
        let record_offset_bytes = open.append_offset_bytes;
        open.append_offset_bytes += HEAD_BYTES;
        let segment = open.buffer.segment;
        appender.batch = Some(OpenBatch {
            record_offset_bytes,
            seq: appender.next_seq,
            prev_crc: appender.prev_crc,
            entries: Vec::new(),
            payload_len: 0,
            payload_crc: 0,
        });
        let end = open.append_offset_bytes as u64;
        state.segments.note_append(segment, end, Some((appender.next_seq, appender.nonce_epoch)));
        appender.next_seq += 1;
        Ok(())
    }

    /// Closes the open batch record, if any: appends its tail after its fragments and fills
    /// in its head. Until then nothing of it is written out, so the head is never
    /// rewritten on disk.
    pub(crate) fn close_batch(&mut self) {
        let state = &mut *self.state;
        let appender = &mut state.appender;
        let Some(batch) = appender.batch.take() else { return };
        let header = RecordHeader {
            version: RecordVersion::V3,
            flags: FLAG_FIRST | FLAG_LAST,
            seq: batch.seq,
            durable_seq: self.log.durable_seq.load(Ordering::Acquire),
            prev_crc: batch.prev_crc,
            session: appender.session,
            store_tag: self.log.geometry.store_tag,
            nonce_epoch: appender.nonce_epoch,
            payload_len: batch.payload_len as u32,
            payload_crc: batch.payload_crc,
            body: RecordBody::Batch { entries: batch.entries },
        };
        let encoded = self.log.encode_record(&header);
        let open = appender.open.as_mut().expect("a batch lives in the open segment");
        let record_at = batch.record_offset_bytes;
        assert_eq!(open.append_offset_bytes, record_at + HEAD_BYTES + batch.payload_len);
        assert!(open.written_offset_bytes <= record_at, "part of an open batch was written out");
        let tail_at = open.append_offset_bytes;
        debug_assert!(tail_at + encoded.tail.len() <= self.log.geometry.segment_size_bytes as usize);
        {
            let mut data = open.buffer.data.write();
            data[record_at..record_at + HEAD_BYTES].copy_from_slice(&encoded.head);
            data[tail_at..tail_at + encoded.tail.len()].copy_from_slice(&encoded.tail);
        }
        open.append_offset_bytes += encoded.tail.len();
        let (segment, end) = (open.buffer.segment, open.append_offset_bytes as u64);
        appender.prev_crc = encoded.crc;
        state.segments.note_append(segment, end, None);
        state.epochs.bytes_since_checkpoint += encoded.tail.len() as u64;
        Counters::add(&self.log.counters.metadata_bytes, (HEAD_BYTES + encoded.tail.len()) as u64);
    }

    /// Writes one record into the open segment (which has room for it). Returns the
    /// physical byte address of its payload, and its body back. The payload parts `placed`
    /// marks are fragments: in an encrypted store each gets the placement tag of where it
    /// lands (`place_fragment`) before the payload's CRC is taken.
    pub(super) fn put_record(
        &mut self,
        flags: u8,
        body: RecordBody,
        payload: &[&[u8]],
        placed: &[bool],
    ) -> (u64, RecordBody) {
        debug_assert!(placed.is_empty() || placed.len() == payload.len());
        // The segment's use: this record begins it if it is the segment's first.
        let segment = self.state.appender.open.as_ref().expect("an open segment").buffer.segment;
        let use_seq = match self.state.segments.get(segment).first_seq {
            0 => self.state.appender.next_seq,
            first => first,
        };
        let state = &mut *self.state;
        let appender = &mut state.appender;
        debug_assert!(appender.batch.is_none(), "a record appended while a batch is open");
        let payload_len: usize = payload.iter().map(|p| p.len()).sum();
        let open = appender.open.as_mut().expect("an open segment");
        let segment = open.buffer.segment;
        let record_at = open.append_offset_bytes;
        let base = self.log.geometry.segment_base(segment);
        let tail_at = record_at + HEAD_BYTES + payload_len;
        // The payload goes in first (its CRC is of the placed fragments); the buffer's lock
        // is not held while the head and tail are encoded (an encrypted store's MAC). Nothing
        // past the append offset is read or written out meanwhile.
        let payload_crc = {
            let mut data = open.buffer.data.write();
            let mut at = record_at + HEAD_BYTES;
            for (i, part) in payload.iter().enumerate() {
                let place = &mut data[at..at + part.len()];
                place.copy_from_slice(part);
                if placed.get(i) == Some(&true) {
                    self.log.place_fragment(place, base + at as u64, use_seq);
                }
                at += part.len();
            }
            crc32c::crc32c(&data[record_at + HEAD_BYTES..tail_at])
        };
        let header = RecordHeader {
            version: RecordVersion::V3,
            flags,
            seq: appender.next_seq,
            durable_seq: self.log.durable_seq.load(Ordering::Acquire),
            prev_crc: appender.prev_crc,
            session: appender.session,
            store_tag: self.log.geometry.store_tag,
            nonce_epoch: appender.nonce_epoch,
            payload_len: payload_len as u32,
            payload_crc,
            body,
        };
        let encoded = self.log.encode_record(&header);
        let total = HEAD_BYTES + payload_len + encoded.tail.len();
        assert!(record_at + total <= self.log.geometry.segment_size_bytes as usize, "record past the segment end");
        {
            let mut data = open.buffer.data.write();
            data[record_at..record_at + HEAD_BYTES].copy_from_slice(&encoded.head);
            data[tail_at..tail_at + encoded.tail.len()].copy_from_slice(&encoded.tail);
        }
        open.append_offset_bytes += total;
        state.segments.note_append(
            segment,
            (record_at + total) as u64,
            Some((appender.next_seq, appender.nonce_epoch)),
        );
        appender.prev_crc = encoded.crc;
        appender.next_seq += 1;
        state.epochs.bytes_since_checkpoint += total as u64;
        Counters::add(&self.log.counters.metadata_bytes, (HEAD_BYTES + encoded.tail.len()) as u64);
        (base + (record_at + HEAD_BYTES) as u64, header.body)
    }

    /// Makes sure the open segment has `bytes` of room, opening a new one if needed.
    pub(super) fn ensure_room(&mut self, bytes: usize) -> Result<()> {
        if self.state.appender.open.is_none() || self.room() < bytes {
            self.open_new_segment()?;
        }
        Ok(())
    }
}
