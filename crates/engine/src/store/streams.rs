//! The log's streams: host writes (and the log's own metadata) fill one open segment,
//! GC's relocations two more — data moved for the first time, and data GC had moved before
//! — and a jump record leads the log from one to another (docs/format.md, "Records";
//! docs/space.md, "Hot and cold", "A second cold stream").
//!
//! Invariants:
//! - One chain: the log leaves a stream only through a jump record naming the byte address
//!   of the next record (the other stream's append offset, or the start of the segment it
//!   opens next), so replay follows one history record by record, however many streams.
//! - A GC stream's segment always keeps room for its last jump (`JUMP_RESERVE_BYTES`):
//!   leaving it never takes a new segment.
//! - Only the host stream holds a segment back from the free set (the one its link names);
//!   a full GC segment ends in a jump to the next one, whose link names none.
//! - A GC stream's room is no host write's: `available_bytes` leaves it out, so a new GC
//!   segment is taken only with segments to spare (`stream_for`), and the colder stream's,
//!   which the native capacity does not count, is sealed when they run short
//!   (`retire_colder_when_short`): near full at most two segments are open, as counted.

use std::sync::Arc;

use super::geometry::{new_buffer, SegmentBuffer};
use super::lock::{Rank, RwLock};
use super::log::{Appender, LogGuard, OpenSegment, SealedSegment};
use super::op::{group_bytes, metadata_only, Op};
use super::space::{Reserves, SpaceClass};
use crate::error::{Error, ErrorKind, Result};
use crate::format::{RecordBody, FLAG_FIRST, FLAG_LAST, RECORD_MAC_BYTES, RECORD_MIN_BYTES};
use crate::map::Entry;
use crate::types::SegmentId;
use crate::SECTOR_SIZE;

/// Which open segment a record goes to (see the module's invariants). GC relocates data
/// that outlived the segment it was written to: likely cold. Kept apart from new host
/// writes, it fills segments that stay full, while host segments die whole — the
/// separation that lets skewed workloads pay less GC than uniform ones (docs/space.md,
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
