//! The log: what a group of ops is, where it goes, how it becomes records in an open
//! segment, and what each record does to the map — one file, in the order an append runs:
//!
//! 1. `Log` and `LogGuard::append` (this section): one append attempt under the log lock;
//!    records, batch records, placing fragments.
//! 2. **Streams** (`stream_for`, `switch_stream`, `room`): which open segment a group goes
//!    to, the jump records between the streams, the log's room and a group's shortfall.
//! 3. **Ops** (`Op`, `group_bytes`): what the request path and GC hand the log, and what a
//!    group costs in the log.
//! 4. **Applying a record** (`apply_record`): the one rule for what a record does to the
//!    map, used by the appender and by replay.
//!
//! Each section states its own invariants at its head; these hold across them:
//! - Map order is log order: a group's records are appended and its map entries published
//!   under one hold of the log lock (`apply_record` is the one rule for both).
//! - A group is FIRST..LAST; relocations and checkpoint chunks are groups of one record.
//! - Records chain: each carries the previous header's CRC and the session nonce.
//! - A batch record open at the end of the log is the last record: nothing else is appended
//!   until it is closed, and none of its bytes are written out before (so its head, filled
//!   in at close, never rewrites a written sector).
//! - Every record carries the durable sequence number as of its append: proof, for replay,
//!   that the records before it were not torn.
//! - Fragments never span segments; a record that does not fit seals the segment.
//! - Streams, one chain: host writes and metadata go to the host stream's open segment,
//!   GC's output to the cold streams', with a jump record between them ("Streams").

use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::background::Wakeups;
use super::capacity::{Reserves, SpaceClass};
use super::geometry::{new_buffer, AlignedBuf, Geometry, SegmentBuffer, FRAGMENT_END_WASTE_BYTES};
use super::health::Health;
use super::lock::{Mutex, MutexGuard, Rank, RwLock};
use super::proof::ProofState;
use super::segments::{account_entry, BlockCounts, PendingRecompress, SegmentTable, UseCell};
use crate::crypto::cipher::{Domain, StoreCipher};
use crate::error::{Error, ErrorKind, Result};
use crate::format::{
    BatchEntry, ChunkRef, EncodedRecord, FragmentEntry, FragmentFormat, Protection, RecordBody, RecordHeader,
    RecordVersion, SegmentUsage, BATCH_ENTRY_BYTES, BATCH_LBA_LIMIT, FLAG_FIRST, FLAG_LAST, HEAD_BYTES, PI_BYTES,
    RECORD_BLOCKS_MAX, RECORD_MAC_BYTES, RECORD_MIN_BYTES, TAIL_FIXED_BYTES, WRITE_ENTRY_BYTES,
};
use crate::map::page::PageId;
use crate::map::{Accounting, Delta, Entry, PackedEntry, PageSource, PagedMap};
use crate::stats::{CodecCounters, Counters, LogCounters};
use crate::types::{Lba, SegmentId};
use crate::SECTOR_SIZE;

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
    /// GC's output may go to the cold streams ("Streams" below): the store was formatted with
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
    /// The live LZ4 fragments written since open, for the statistics (`PendingRecompress`,
    /// `segments.rs`).
    pub pending: super::segments::PendingRecompress,
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

// ==============================================================================================
// Streams: where a group goes, and the log's room
//
// The log's streams: host writes (and the log's own metadata) fill one open segment,
// GC's relocations two more — data moved for the first time, and data GC had moved before
// — and a jump record leads the log from one to another (docs/format.md, "Records";
// docs/space.md, "Hot and cold", "A second cold stream").
//
// Invariants:
// - One chain: the log leaves a stream only through a jump record naming the byte address
//   of the next record (the other stream's append offset, or the start of the segment it
//   opens next), so replay follows one history record by record, however many streams.
// - A GC stream's segment always keeps room for its last jump (`JUMP_RESERVE_BYTES`):
//   leaving it never takes a new segment.
// - Only the host stream holds a segment back from the free set (the one its link names);
//   a full GC segment ends in a jump to the next one, whose link names none.
// - A GC stream's room is no host write's: `available_bytes` leaves it out, so a new GC
//   segment is taken only with segments to spare (`stream_for`), and the colder stream's,
//   which the native capacity does not count, is sealed when they run short
//   (`retire_colder_when_short`): near full at most two segments are open, as counted.
// ==============================================================================================

/// Which open segment a record goes to (see the invariants at the head of this section).
/// GC relocates data that outlived the segment it was written to: likely cold. Kept apart
/// from new host writes, it fills segments that stay full, while host segments die whole —
/// the separation that lets skewed workloads pay less GC than uniform ones (docs/space.md,
/// "Hot and cold"). Data GC moves a second time (its victim held GC's output) outlived
/// a cleaning as well: colder still, kept apart again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    Host,
    /// GC's copies of data written by the host.
    Cold,
    /// GC's copies of data GC had moved before.
    Colder,
}

impl Stream {
    pub const ALL: [Stream; 3] = [Stream::Host, Stream::Cold, Stream::Colder];

    /// Whether GC's output goes here (a segment that keeps room for its jump, names no
    /// segment ahead, and whose room host writes cannot use).
    pub fn is_gc(self) -> bool {
        self != Stream::Host
    }
}

/// Room a GC stream's segment keeps for the jump record to another stream, so leaving it
/// never takes a new segment: a record's fixed bytes and, encrypted, its MAC — and a sector
/// less one, which a flush's padding may take from it.
pub(crate) const JUMP_RESERVE_BYTES: usize = RECORD_MIN_BYTES + RECORD_MAC_BYTES + SECTOR_SIZE - 1;

/// Free segments (beyond the group and the host reserve) a new cold segment needs: it
/// strands its room for host writes until GC fills it.
const COLD_SEGMENT_SPARE_SEGMENTS: u64 = 2;
/// The same for a new colder segment: one more, since the native capacity counts only two
/// open segments — below `COLD_SEGMENT_SPARE_SEGMENTS` the colder one is sealed, so the
/// two thresholds never make a segment open and seal over and over.
const COLDER_SEGMENT_SPARE_SEGMENTS: u64 = 3;

/// An open segment of a stream records are not going to now.
pub(crate) struct ParkedStream {
    pub stream: Stream,
    pub open: OpenSegment,
    /// What its link named (as `Appender::next_segment`).
    pub next_segment: Option<SegmentId>,
}

impl Appender {
    /// Every stream's open segment.
    pub fn open_segments(&self) -> impl Iterator<Item = &OpenSegment> {
        self.open.iter().chain(self.parked.iter().map(|p| &p.open))
    }

    /// Every stream's open segment, mutably.
    pub fn open_segments_mut(&mut self) -> impl Iterator<Item = &mut OpenSegment> {
        self.open.iter_mut().chain(self.parked.iter_mut().map(|p| &mut p.open))
    }

    /// The parked open segment of `stream`, if it has one.
    fn parked_of(&self, stream: Stream) -> Option<&ParkedStream> {
        self.parked.iter().find(|p| p.stream == stream)
    }

    /// Takes the parked open segment of `stream` out of the appender.
    fn take_parked(&mut self, stream: Stream) -> Option<ParkedStream> {
        let at = self.parked.iter().position(|p| p.stream == stream)?;
        Some(self.parked.swap_remove(at))
    }

    /// The segment the host stream's link named (held back from the free set), whether
    /// records go to the host stream now or not.
    fn host_next_segment(&self) -> Option<SegmentId> {
        if self.stream == Stream::Host {
            self.next_segment
        } else {
            self.parked_of(Stream::Host).and_then(|p| p.next_segment)
        }
    }

    /// Bytes appended to the open segments but not written out yet.
    pub fn unwritten_bytes(&self) -> usize {
        self.open_segments().map(|o| o.append_offset_bytes - o.written_offset_bytes).sum()
    }

    /// Bytes of sealed segments not written out yet.
    pub fn sealed_unwritten_bytes(&self) -> usize {
        self.sealed_unwritten.iter().map(|s| s.end_offset_bytes.saturating_sub(s.written_offset_bytes)).sum()
    }

    /// Bytes appended but not written out yet, open and sealed segments together: what a
    /// flush would have to write first (the write-behind bound's measure).
    pub fn backlog_bytes(&self) -> usize {
        self.unwritten_bytes() + self.sealed_unwritten_bytes()
    }
}

impl LogGuard<'_> {
    /// The stream a group goes to: GC's output to a GC stream when its open segment has
    /// room for it, or the store has room to spare for a new one — a GC segment's room is
    /// no host write's (`available_bytes` leaves it out), so a new one is taken only while
    /// free space is well above the host reserve, and near full GC's output shares the host
    /// stream as it always did. Copies out of a segment that held GC's output go to the
    /// colder stream, or the cold one where it has no room.
    pub(super) fn stream_for(&self, ops: &[Op], class: SpaceClass, reserves: &Reserves) -> Stream {
        let gc_output =
            !ops.is_empty() && ops.iter().all(|op| matches!(op, Op::Relocate { .. } | Op::Recompress { .. }));
        if !gc_output || !matches!(class, SpaceClass::Gc | SpaceClass::GcSettled) || !self.log.cold_stream {
            return Stream::Host;
        }
        let capacity = self.log.geometry.segment_capacity();
        let needed = group_bytes(ops, capacity, self.log.record_extra_bytes()) + self.log.fragment_end_waste_bytes();
        let fits = |stream: Stream, spare_segments: u64| {
            self.stream_room(stream) as u64 >= needed || self.host_slack(reserves) >= needed + spare_segments * capacity
        };
        if self.moved_before(ops) && fits(Stream::Colder, COLDER_SEGMENT_SPARE_SEGMENTS) {
            Stream::Colder
        } else if fits(Stream::Cold, COLD_SEGMENT_SPARE_SEGMENTS) {
            Stream::Cold
        } else {
            Stream::Host
        }
    }

    /// Whether GC's copies come out of a segment that held GC's output (a victim's copies
    /// all come from one segment): data that outlived a cleaning already.
    fn moved_before(&self, ops: &[Op]) -> bool {
        let first = ops.iter().find_map(|op| match op {
            Op::Relocate { fragments } | Op::Recompress { fragments } => fragments.first(),
            _ => None,
        });
        match first.map(|f| f.old.unpack()) {
            Some(Ok(Entry::Stored(old))) => {
                self.state.segments.holds_gc_output(self.log.geometry.segment_of(old.offset_bytes))
            }
            _ => false,
        }
    }

    /// Seals the colder stream's open segment when free space beyond the host reserve runs
    /// short: its room is stranded for everything but GC's second moves, and the native
    /// capacity counts two open segments, not three. Sealed, GC may take it like any other
    /// (its unused room counts as reclaimable). Only a parked one: the stream records go to
    /// now is left alone (the next append parks it, and the one after seals it).
    pub(super) fn retire_colder_when_short(&mut self, reserves: &Reserves) {
        if self.state.appender.parked_of(Stream::Colder).is_none() {
            return;
        }
        if self.host_slack(reserves) >= COLD_SEGMENT_SPARE_SEGMENTS * self.log.geometry.segment_capacity() {
            return;
        }
        let parked = self.state.appender.take_parked(Stream::Colder).expect("checked above");
        tracing::debug!("free space is short: sealing the colder stream's segment {}", parked.open.buffer.segment);
        self.seal(parked.open);
    }

    /// Makes `stream` the one records go to. Leaving the current one takes a jump record
    /// in it that names where the other stream's next record goes: its open segment's
    /// append offset, or — it has none, or no room for a record — the start of the segment
    /// it opens next (whose first record, as every segment's, is its link).
    pub(super) fn switch_stream(&mut self, stream: Stream) -> Result<()> {
        if self.state.appender.stream == stream {
            return Ok(());
        }
        self.close_batch();
        if self.state.appender.stream == Stream::Host {
            self.ensure_room(RECORD_MIN_BYTES)?;
        }
        // (A GC segment always has room for its jump: `room` keeps it.)
        let reserved = self.state.appender.host_next_segment();
        let resume = match self.state.appender.take_parked(stream) {
            Some(p) if self.open_room(&p.open, stream) >= RECORD_MIN_BYTES => Ok(p),
            Some(p) => {
                let next = p.next_segment.filter(|&id| self.state.segments.is_free(id));
                self.seal(p.open);
                Err(next.or_else(|| self.state.segments.lowest_free_except(reserved)))
            }
            None => Err(self.state.segments.lowest_free_except(reserved)),
        };
        let next_record_bytes = match &resume {
            Ok(p) => self.log.geometry.segment_base(p.open.buffer.segment) + p.open.append_offset_bytes as u64,
            Err(Some(id)) => self.log.geometry.segment_base(*id),
            Err(None) => return Err(Error::new(ErrorKind::NoSpace, "no free segment")),
        };
        self.put_record(FLAG_FIRST | FLAG_LAST, RecordBody::Jump { next_record_bytes }, &[], &[]);
        let appender = &mut self.state.appender;
        let open = appender.open.take().expect("the stream left has an open segment");
        appender.parked.push(ParkedStream {
            stream: appender.stream,
            open,
            next_segment: appender.next_segment.take(),
        });
        appender.stream = stream;
        match resume {
            Ok(p) => {
                appender.open = Some(p.open);
                appender.next_segment = p.next_segment;
            }
            Err(id) => {
                // `open_new_segment` opens the segment the jump named and writes its link.
                appender.next_segment = id;
                self.open_new_segment()?;
            }
        }
        Ok(())
    }

    /// Room left in the open segment (0 if none is open). An open batch's entries and CRC,
    /// still to be appended, are not room; nor is the MAC every record of an encrypted store
    /// carries (so a caller that counts `RECORD_MIN_BYTES` per record has it covered); nor,
    /// in a GC segment, the jump back to another stream.
    pub(crate) fn room(&self) -> usize {
        let appender = &self.state.appender;
        let trailer = appender.batch.as_ref().map_or(0, |b| b.trailer_bytes());
        appender.open.as_ref().map_or(0, |o| self.open_room(o, appender.stream).saturating_sub(trailer))
    }

    /// Room left in a stream's open segment, whether records go there now or not.
    pub(crate) fn stream_room(&self, stream: Stream) -> usize {
        let appender = &self.state.appender;
        if appender.stream == stream {
            self.room()
        } else {
            appender.parked_of(stream).map_or(0, |p| self.open_room(&p.open, stream))
        }
    }

    /// Bytes the log can take beyond the host reserve: what pacing's band and the GC
    /// streams' spare-segment rules measure.
    pub(crate) fn host_slack(&self, reserves: &Reserves) -> u64 {
        self.available_bytes().saturating_sub(reserves.of(SpaceClass::Host))
    }

    /// Bytes the log can still take for any record: free segments and the host stream's
    /// open segment's room. (The cold stream's room takes only GC's output: it counts for
    /// that alone, see `shortfall_bytes`; a new cold segment is taken with room to spare.)
    pub(crate) fn available_bytes(&self) -> u64 {
        self.state.segments.free_count() as u64 * self.log.geometry.segment_capacity()
            + self.stream_room(Stream::Host) as u64
    }

    /// Bytes of the data area that hold no records: free and cleaned segments and the open
    /// segments' room.
    pub(crate) fn unused_bytes(&self) -> u64 {
        let empty = (self.state.segments.free_count() + self.state.segments.cleaned_count()) as u64;
        let open_room: usize = Stream::ALL.iter().map(|&stream| self.stream_room(stream)).sum();
        empty * self.log.geometry.segment_size_bytes + open_room as u64
    }

    /// How many bytes the log lacks for a group of ops of a class going to `stream` (0: it
    /// may be appended now).
    pub(crate) fn shortfall_bytes(&self, ops: &[Op], class: SpaceClass, stream: Stream, reserves: &Reserves) -> u64 {
        let mut bytes = group_bytes(ops, self.log.geometry.segment_capacity(), self.log.record_extra_bytes());
        // Fragments do not span segments, so a record carrying them may leave up to a block
        // unused at the open segment's end (a free segment's capacity already allows for
        // that); a trim or zero record is a fixed header and fits whenever its bytes do.
        let end_waste = if metadata_only(ops) { 0 } else { self.log.fragment_end_waste_bytes() };
        let mut available = self.available_bytes().saturating_sub(end_waste);
        if stream.is_gc() {
            // Its own room, which may leave a block's end unused too, and the jump into it
            // from the host stream.
            available += (self.stream_room(stream) as u64).saturating_sub(end_waste);
            bytes += JUMP_RESERVE_BYTES as u64;
        }
        (bytes + reserves.of(class)).saturating_sub(available)
    }

    /// Room in an open segment of `stream` (no batch counted).
    fn open_room(&self, open: &OpenSegment, stream: Stream) -> usize {
        let mac = if self.log.cipher.is_some() { RECORD_MAC_BYTES } else { 0 };
        let jump = if stream.is_gc() { JUMP_RESERVE_BYTES } else { 0 };
        (self.log.geometry.segment_size_bytes as usize - open.append_offset_bytes).saturating_sub(mac + jump)
    }

    /// Seals every stream's open segment, so GC may take everything written so far (an
    /// explicit recompression; the cost is their unused room). The host stream goes on in
    /// the segment its link named.
    pub(crate) fn seal_open_segments(&mut self) -> Result<()> {
        self.close_batch();
        if self.state.appender.open.is_some() {
            self.switch_stream(Stream::Host)?;
        }
        for parked in std::mem::take(&mut self.state.appender.parked) {
            self.seal(parked.open);
        }
        if let Some(open) = self.state.appender.open.take() {
            self.seal(open);
        }
        Ok(())
    }

    /// Queues a segment no stream appends to any more for write-out.
    fn seal(&mut self, open: OpenSegment) {
        self.state.segments.seal(open.buffer.segment, open.append_offset_bytes as u64);
        self.state.appender.sealed_unwritten.push_back(SealedSegment {
            buffer: open.buffer,
            end_offset_bytes: open.append_offset_bytes,
            written_offset_bytes: open.written_offset_bytes,
        });
    }

    /// Seals the open segment (queueing it for write-out) and opens the next one of its
    /// stream. The host stream's is the one its link named, else the lowest free; its first
    /// record is its link. A GC stream names no segment ahead (only the host stream holds
    /// one back from the free set, so no stream can run out of segments for another's
    /// sake): a full GC segment ends in a jump to the next one, whose link names none.
    pub(super) fn open_new_segment(&mut self) -> Result<()> {
        self.close_batch();
        let cold = self.state.appender.stream.is_gc();
        let reserved = if cold { self.state.appender.host_next_segment() } else { None };
        let id = self
            .state
            .appender
            .next_segment
            .take()
            .or_else(|| self.state.segments.lowest_free_except(reserved))
            .ok_or_else(|| Error::new(ErrorKind::NoSpace, "no free segment"))?;
        if cold && self.state.appender.open.is_some() {
            // (The cold segment kept room for it.)
            let next_record_bytes = self.log.geometry.segment_base(id);
            self.put_record(FLAG_FIRST | FLAG_LAST, RecordBody::Jump { next_record_bytes }, &[], &[]);
        }
        if let Some(open) = self.state.appender.open.take() {
            self.seal(open);
        }
        let id = self.state.segments.open(id).ok_or_else(|| Error::new(ErrorKind::NoSpace, "no free segment"))?;
        if cold {
            self.state.segments.note_gc_output(id);
        }
        let size = self.log.geometry.segment_size_bytes as usize;
        let data = match self.state.appender.buffer_pool.pop() {
            Some(buf) => {
                debug_assert!(buf.iter().all(|&b| b == 0), "a pooled segment buffer is zeroed");
                buf
            }
            None => new_buffer(size),
        };
        let buffer = Arc::new(SegmentBuffer { segment: id, data: RwLock::new(Rank::SegmentData, data) });
        // Once per segment: let the worker see whether GC or a checkpoint is due.
        self.log.wakeups.kick_worker();
        self.log.buffered.write().push(Arc::clone(&buffer));
        self.state.appender.open = Some(OpenSegment { buffer, append_offset_bytes: 0, written_offset_bytes: 0 });
        // Name the segment that comes next, so recovery follows the log from segment to
        // segment instead of reading the start of every one.
        let next_segment = if cold { None } else { self.state.segments.lowest_free() };
        self.state.appender.next_segment = next_segment;
        self.put_record(FLAG_FIRST | FLAG_LAST, RecordBody::Link { next_segment: next_segment.map(|s| s.0) }, &[], &[]);
        Ok(())
    }
}

// ==============================================================================================
// Ops: what a record group carries, and its log cost
//
// The operations a record group carries, as the request path and GC hand them to the
// log: one enum for all of them, from which the appender builds the records
// (`format::RecordBody` is their on-disk description, `apply_record` below what they do
// to the map).
// ==============================================================================================

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

// ==============================================================================================
// Applying a record to the map: one rule for the appender and replay
//
// The one rule for what a record does to the map, used by the appender as it writes a
// record and by replay as it reads one back — so "replay rebuilds the runtime map" holds
// by construction, not by two copies agreeing.
//
// - write and batch records map each LBA to its fragment (an all-zero block to ZERO);
// - trim and zero records map their range to UNMAPPED or ZERO;
// - relocate records (GC's copies in stores written before 2026-11-27; GC now writes batch
//   records, checked when appended) move an LBA to the copy only if the map still holds
//   the old place (a later overwrite wins);
// - checkpoint chunks do nothing.
//
// Every change is accounted in the segment table (live bytes, block counts). LBAs past the
// map's end are skipped: the request path checks ranges before it appends, and replay may
// meet records written before a shrink.
// ==============================================================================================

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
