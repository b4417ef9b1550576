//! Replay: the records after the checkpoint, in order, each group applied when complete —
//! and what to do when a record is damaged.
//!
//! A torn tail and damage in the middle of the log look alike at first: a record that does
//! not verify. They differ in time: a torn record was never durable (the crash caught it
//! being written), a damaged one was durable and decayed later. Every record carries the
//! durable sequence number as of its append, so a later record whose `durable_seq` reaches
//! the damaged one proves it was durable. Then:
//!
//! - a record found through a surviving copy (head or tail) or with a bad payload CRC is
//!   applied — its fragments carry their own guards, so a damaged block reads as EIO;
//! - a record none of whose copies survives is *lost*: replay goes on past it to the first
//!   later record whose own chain proves every record before it durable (its later records
//!   are newer) — or ends there if none does — and the store opens degraded: read-only, and
//!   every block not provably written after the loss reads as EIO, because it might be
//!   older than what the lost record wrote.
//!
//! The last records before a crash have no later record; the flush proof (`proof.rs`),
//! written after each flush's sync, says how far the last flush got. A damaged record it
//! covers is applied; a log that ends before what it proved is a loss.
//!
//! Without such proof the damage is a torn tail and the log ends there, as it always did.
//!
//! Invariants: replay follows one history (sequence numbers and the chain of head CRCs; a
//! record found past a loss is accepted only if its chain proves every record before it
//! durable, which a record a crashed run left past a never-durable gap cannot); a group is
//! applied only when its LAST record is found, except that a loss inside a durable-proven
//! group applies what survives of it.

use std::collections::HashMap;

use super::geometry::Geometry;
use super::health::{DamagedRecord, Degraded, RecoveryFindings};
use super::log::LogState;
use super::log::{apply_record, lbas_set};
use super::proof::Proven;
use super::read::Sealed;
use super::scan::{parse_record_at, probe, FoundRecord, Probe, RecordContext, SegmentCache};
use super::state::Inner;
use crate::codec::DictionarySet;
use crate::error::Result;
use crate::format::{Head, RecordBody, Superblock, FLAG_FIRST, FLAG_LAST, FORMAT_VERSION, HEAD_BYTES};
use crate::map::PagedMap;
use crate::types::{Lba, SegmentId};
use crate::SECTOR_SIZE;

/// How many records past a damaged one replay looks for a successor.
const LOOKAHEAD_RECORDS: u64 = 1024;
/// Leaves replay reads at once to settle owed removals.
const SETTLE_BATCH_LEAVES: usize = 256;
/// How many records after a damaged one replay follows to find proof it was durable.
const PROOF_RECORDS_MAX: usize = 1 << 20;

/// What replay found where it expected the next record.
enum Choice {
    Intact(FoundRecord),
    /// Damaged, but applied: why.
    Recovered(FoundRecord, &'static str),
    /// Only damaged records that may be torn writes: the end of the log.
    Torn,
    /// Nothing: the end of the log, or a record lost to damage (`look_past` tells).
    Missing,
}

/// What replay finds past a record it could not read at all.
enum PastLoss {
    /// The record that continues the log: every record before it is proven durable.
    Successor(FoundRecord),
    /// The lost record was durable, but no record found after it provably continues this
    /// log (those found may be a crashed run's records past a gap that was never durable).
    ProvenDurable,
    /// Nothing proves the lost record durable: a torn write, the end of the log.
    End,
}

/// What is wrong with a payload that fails its CRC.
enum PayloadState {
    /// It does not fail.
    Intact,
    /// Every fragment decodes to its guard: no data is damaged.
    FragmentsVerify,
    OneFlippedBit,
    Damaged,
}

/// Where replay expects the next record.
#[derive(Clone, Copy)]
struct Cursor {
    offset: u64,
    seq: u64,
    /// The chain value the next record must carry; None right after a loss (the record
    /// found past it was accepted on proof instead).
    prev_crc: Option<u32>,
    /// The segment the previous record was in (the log leaves it only through its link).
    segment: SegmentId,
}

impl Cursor {
    /// Where the record after `record` is expected: right after it, or — after a jump —
    /// where the jump says (in the segment it names, which the log then follows).
    fn after(record: &FoundRecord, geometry: &Geometry) -> Cursor {
        let next = Cursor {
            offset: record.end_bytes,
            seq: record.header.seq + 1,
            prev_crc: Some(record.crc),
            segment: geometry.segment_of(record.offset_bytes),
        };
        match record.header.body {
            RecordBody::Jump { next_record_bytes } if geometry.in_data_area(next_record_bytes) => {
                Cursor { offset: next_record_bytes, segment: geometry.segment_of(next_record_bytes), ..next }
            }
            _ => next,
        }
    }

    /// Whether the next record is expected at a segment's start (a jump named a segment
    /// about to be opened): then that segment, not a link, is where the log goes on.
    fn at_segment_start(&self, geometry: &Geometry) -> bool {
        self.offset == geometry.segment_base(self.segment)
    }
}

/// How replay finds where the log goes on after a segment: the link record at each
/// segment's start; and only where that does not tell (an older format, a segment whose
/// link is unreadable or names none, a loss), the index of every segment's start.
struct Starts {
    index: Option<Index>,
    links: HashMap<SegmentId, Option<SegmentId>>,
    checkpoint_seq: u64,
}

/// Segment starts: which segment starts with which sequence number after the checkpoint,
/// and which start with a head-shaped thing that does not verify (candidates when a
/// record at a segment's start was damaged).
struct Index {
    starts: HashMap<u64, Vec<SegmentId>>,
    damaged_starts: Vec<SegmentId>,
}

impl Inner {
    /// The segment `segment`'s link names (read from its first record if replay did not
    /// pass it); None if it names none or cannot be read.
    fn link_of(&self, cache: &mut SegmentCache, starts: &mut Starts, segment: SegmentId) -> Option<SegmentId> {
        if let Some(&link) = starts.links.get(&segment) {
            return link;
        }
        let base = self.geometry.segment_base(segment);
        let link = cache.record_near(self, base, |r| matches!(r.header.body, RecordBody::Link { .. })).and_then(|r| {
            match r.header.body {
                RecordBody::Link { next_segment } => next_segment.map(SegmentId),
                _ => None,
            }
        });
        let link = link.filter(|s| (s.0 as u64) < self.geometry.segment_count);
        starts.links.insert(segment, link);
        link
    }

    /// Builds the index of every segment's start, once (the slow way on).
    fn ensure_index(&self, starts: &mut Starts) {
        if starts.index.is_none() {
            tracing::info!("replay: reading every segment's start to find where the log goes on");
            starts.index = Some(self.index_segment_starts(self.geometry.segment_count as usize, starts.checkpoint_seq));
        }
    }

    /// The segment starts after the checkpoint (see [`Index`]). Any segment but the one
    /// open at the checkpoint may have been reused after it; several may start with the
    /// same sequence number (stale ones left by a run that crashed, and the one that
    /// continues the chain): keep them all, as candidates that `next_record` verifies.
    fn index_segment_starts(&self, segment_count: usize, checkpoint_seq: u64) -> Index {
        let mut index = Index { starts: HashMap::new(), damaged_starts: Vec::new() };
        let mut head = vec![0u8; SECTOR_SIZE];
        for id in (0..segment_count as u32).map(SegmentId) {
            if self.backing.read_at(self.geometry.segment_base(id), &mut head).is_err() {
                continue;
            }
            let tag = self.geometry.store_tag;
            let v3 = Head::decode(&head).ok().filter(|h| h.store_tag == tag).map(|h| h.seq);
            // (Version 2 candidates are unverified: a batch's CRC lies past its payload.)
            let v2 = crate::format::v2::peek_identity(&head).filter(|&(_, t)| t == tag).map(|(seq, _)| seq);
            match v3.or(v2) {
                Some(seq) if seq > checkpoint_seq => index.starts.entry(seq).or_default().push(id),
                Some(_) => {}
                // Something that is not a verified head of ours, but not a discarded
                // (zeroed) segment either: a damaged head, perhaps.
                _ if head[..HEAD_BYTES].iter().any(|&b| b != 0) => index.damaged_starts.push(id),
                _ => {}
            }
        }
        index
    }

    /// The records that could be the one expected at the cursor: at its offset, at the next
    /// sector boundary (after a flush's padding) — if that is still in the segment the
    /// previous record was in — at the start of the segment its link names, and, once the
    /// index is built, at segment starts indexed with the sequence number or with a damaged
    /// head (found through its tail's copy). Several may chain: a stale record a crashed run
    /// left where this run's would have gone, and this run's own in the next segment.
    fn candidates(&self, cache: &mut SegmentCache, starts: &mut Starts, cursor: Cursor) -> Vec<FoundRecord> {
        let expected =
            |r: &FoundRecord| r.header.seq == cursor.seq && cursor.prev_crc.is_none_or(|crc| r.header.prev_crc == crc);
        let mut offsets = Vec::new();
        let in_segment = cursor.offset < self.geometry.segment_base(cursor.segment) + self.geometry.segment_size_bytes;
        if in_segment || starts.index.is_some() {
            offsets.push(cursor.offset);
        }
        // The fast way: an intact record right where the cursor is.
        if let Some(r) = offsets.first().and_then(|&o| cache.record_near(self, o, expected)) {
            if !r.damage.any() {
                return vec![r];
            }
        }
        match self.link_of(cache, starts, cursor.segment) {
            Some(next) => offsets.push(self.geometry.segment_base(next)),
            None => self.ensure_index(starts),
        }
        if let Some(index) = &starts.index {
            let indexed = index.starts.get(&cursor.seq).into_iter().flatten().chain(&index.damaged_starts);
            offsets.extend(indexed.map(|&id| self.geometry.segment_base(id)));
        }
        let mut found: Vec<FoundRecord> = Vec::new();
        for offset in offsets {
            if let Some(r) = cache.record_near(self, offset, expected) {
                if !found.iter().any(|f| f.offset_bytes == r.offset_bytes) {
                    found.push(r);
                }
            }
        }
        found
    }

    /// The record expected at the cursor, an intact one first (for following a chain).
    fn next_record(&self, cache: &mut SegmentCache, starts: &mut Starts, cursor: Cursor) -> Option<FoundRecord> {
        let mut found = self.candidates(cache, starts, cursor);
        let intact = found.iter().position(|r| !r.damage.any());
        intact.or((!found.is_empty()).then_some(0)).map(|i| found.swap_remove(i))
    }

    /// What replay takes at the cursor: an intact record; else a damaged one that is
    /// complete (one copy of its description and its whole payload survive), proven durable
    /// by a later record or by the flush proof, or off by one flipped bit per fragment; else, if there was a
    /// damaged candidate, the log ends in a torn write; else nothing is there.
    fn choose_record(
        &self,
        cache: &mut SegmentCache,
        starts: &mut Starts,
        cursor: Cursor,
        flush_proof: &Proven,
    ) -> Choice {
        let found = self.candidates(cache, starts, cursor);
        if found.is_empty() {
            return Choice::Missing;
        }
        let (intact, damaged): (Vec<FoundRecord>, Vec<FoundRecord>) = found.into_iter().partition(|r| !r.damage.any());
        if let Some(record) = intact.into_iter().next() {
            return Choice::Intact(record);
        }
        for record in damaged {
            // A record that maps no data (a checkpoint chunk, a relocation whose entries were
            // given up) changes nothing when applied: taking it loses nothing either way.
            let maps_data = !record.header.body.fragments().is_empty();
            let payload = match (record.damage.payload, maps_data) {
                (true, true) => self.payload_state(cache, &record),
                _ => PayloadState::Intact,
            };
            let why = match payload {
                PayloadState::Intact | PayloadState::FragmentsVerify => COMPLETE,
                _ if self.proof_from(cache, starts, &record, record.header.seq) => {
                    "a later record proves it was durable"
                }
                _ if flush_proof.covers(record.header.seq, record.header.session) => {
                    "the flush proof says it was durable"
                }
                PayloadState::OneFlippedBit => "one flipped bit: it was written whole",
                PayloadState::Damaged => continue,
            };
            return Choice::Recovered(record, why);
        }
        Choice::Torn
    }

    /// Past a record that could not be read at all: the first later record (by sequence
    /// number) whose own chain proves every record before it durable. Candidates come from
    /// the damaged segment itself, scanned forward, from the segment its link names, and —
    /// once the index is built — from segments whose first head is damaged (the lost record
    /// may have started one) and from segment starts.
    ///
    /// Proof that only the lost record was durable is not enough for a successor: a run
    /// that crashed leaves records past a gap that was never durable (recovery ended the
    /// log before the gap, and later runs wrote on from there), and those records still
    /// prove the lost one durable. Taking one would apply writes recovery had already
    /// dropped, over blocks later flushes made durable again. Its chain proves nothing past
    /// the gap, so it is refused; the lost record still counts as durable (any record's
    /// durable sequence number is a true statement about the syncs of the history up to it).
    fn look_past(&self, cache: &mut SegmentCache, starts: &mut Starts, cursor: Cursor) -> PastLoss {
        let lost_seq = cursor.seq;
        let wanted = lost_seq + 1..=lost_seq + LOOKAHEAD_RECORDS;
        let mut candidates: Vec<(u64, u64)> = Vec::new(); // (seq, offset)
        let mut scan_from = vec![cursor.offset];
        if let Some(next) = self.link_of(cache, starts, cursor.segment) {
            scan_from.push(self.geometry.segment_base(next));
        }
        if let Some(index) = &starts.index {
            scan_from.extend(index.damaged_starts.iter().map(|&id| self.geometry.segment_base(id)));
            for seq in wanted.clone() {
                for &id in index.starts.get(&seq).into_iter().flatten() {
                    candidates.push((seq, self.geometry.segment_base(id)));
                }
            }
        }
        for from in scan_from {
            if let Some((image, base)) = cache.image_at(self, from) {
                self.successors_in(image, base, from, &wanted, &mut candidates);
            }
        }
        candidates.sort_unstable();
        candidates.dedup();
        let mut lost_was_durable = false;
        for (seq, offset) in candidates {
            let Some(record) = cache.record_near(self, offset, |r| r.header.seq == seq) else { continue };
            debug_assert!(seq > lost_seq);
            // Proof may come from this record or one chained after it.
            let proven = self.durable_claim(cache, starts, &record, seq - 1);
            if proven >= seq - 1 {
                return PastLoss::Successor(record);
            }
            lost_was_durable |= proven >= lost_seq;
        }
        if lost_was_durable {
            PastLoss::ProvenDurable
        } else {
            PastLoss::End
        }
    }

    /// The records with sequence numbers in `wanted` that start after `from` in a segment
    /// image, found by skipping from one valid head to the next over damage.
    fn successors_in(
        &self,
        image: &[u8],
        base: u64,
        from: u64,
        wanted: &std::ops::RangeInclusive<u64>,
        candidates: &mut Vec<(u64, u64)>,
    ) {
        let dictionaries = self.dictionary_set();
        let tag = &RecordContext {
            store_tag: self.geometry.store_tag,
            dictionaries: &dictionaries,
            cipher: self.log.cipher.as_deref(),
            use_of: &|offset, seq, epoch| self.record_use(offset, seq, epoch),
        };
        let mut offset = from;
        loop {
            let next_bytes = match probe(image, base, offset, tag) {
                Probe::Damaged { next_bytes } => next_bytes,
                Probe::Found => match parse_record_at(image, base, offset, tag) {
                    Some(r) if r.end_bytes > offset => r.end_bytes,
                    _ => return,
                },
                Probe::Nothing => return,
            };
            let at = (next_bytes - base) as usize;
            if let Some(Ok(head)) = image.get(at..at + HEAD_BYTES).map(Head::decode) {
                if wanted.contains(&head.seq) && parse_record_at(image, base, next_bytes, tag).is_some() {
                    candidates.push((head.seq, next_bytes));
                }
            }
            if next_bytes <= offset {
                return;
            }
            offset = next_bytes;
        }
    }

    /// What is wrong with the payload of `record`, which fails its CRC: nothing that holds
    /// data (every fragment still decodes to its guard — the flip was in bits a codec
    /// ignores); exactly one flipped bit in each damaged fragment (it was written whole and
    /// decayed since, for a torn write leaves whole sectors of old bytes, which no single
    /// flipped bit turns back: each correction must make its fragment decode to its guard,
    /// and all of them together must restore the payload's CRC, 32 more bits of evidence);
    /// or more.
    fn payload_state(&self, cache: &mut SegmentCache, record: &FoundRecord) -> PayloadState {
        let Some((image, base)) = cache.image_at(self, record.payload_offset_bytes) else {
            return PayloadState::Damaged;
        };
        let start = (record.payload_offset_bytes - base) as usize;
        let Some(payload) = image.get(start..start + record.header.payload_len as usize) else {
            return PayloadState::Damaged;
        };
        let format = record.header.version.fragment_format();
        // Per damaged fragment, every single-bit flip that makes it verify. (More than one
        // may: LZ4 can reach the same block through different match offsets. The payload's
        // CRC tells which is what was written.)
        let mut damaged: Vec<(std::ops::Range<usize>, Vec<usize>)> = Vec::new();
        let dictionaries = self.dictionary_set();
        // (The record's segment use: what an encrypted store's placement tags bind.)
        let in_use = self.record_use(record.offset_bytes, record.header.seq, record.header.nonce_epoch);
        let sealed = self.log.cipher.as_deref().map(|cipher| Sealed { cipher, in_use });
        let mut at = 0;
        for (lba, fragment) in record.header.body.fragments() {
            let range = at..at + fragment.stored_len as usize;
            at = range.end;
            if range.is_empty() {
                continue; // a version 2 all-zero block stores nothing
            }
            // (Its address: an encrypted store's guard is the placement tag of it.)
            let offset_bytes = record.payload_offset_bytes + range.start as u64;
            let stored =
                crate::map::Stored { offset_bytes, stored_len: fragment.stored_len, codec: fragment.codec, format };
            if fragment_verifies(stored, lba, &payload[range.clone()], &dictionaries, sealed) {
                continue;
            }
            let flips = one_bit_corrections(stored, lba, &payload[range.clone()], &dictionaries, sealed);
            if flips.is_empty() || damaged.len() >= 4 {
                return PayloadState::Damaged;
            }
            damaged.push((range, flips));
        }
        if damaged.is_empty() {
            return PayloadState::FragmentsVerify;
        }
        let mut corrected = payload.to_vec();
        if restores_crc(&mut corrected, &damaged, record.header.payload_crc) {
            PayloadState::OneFlippedBit
        } else {
            PayloadState::Damaged
        }
    }

    /// Whether a record chained after `from` carries `durable_seq >= target` (proof that
    /// everything up to `target` was durable, so what does not verify there is damage, not
    /// a torn tail).
    fn proof_from(&self, cache: &mut SegmentCache, starts: &mut Starts, from: &FoundRecord, target: u64) -> bool {
        self.chained_claim(cache, starts, from, target) >= target
    }

    /// The highest durable sequence number `record` or a record chained after it claims,
    /// looking no further once one reaches `target`.
    fn durable_claim(&self, cache: &mut SegmentCache, starts: &mut Starts, record: &FoundRecord, target: u64) -> u64 {
        match record.header.durable_seq {
            own if own >= target => own,
            own => own.max(self.chained_claim(cache, starts, record, target)),
        }
    }

    /// The highest `durable_seq` among the records chained after `from`, looking no
    /// further once one reaches `target` (0 if none is found).
    fn chained_claim(&self, cache: &mut SegmentCache, starts: &mut Starts, from: &FoundRecord, target: u64) -> u64 {
        let mut cursor = Cursor::after(from, &self.geometry);
        let mut claim = 0;
        for _ in 0..PROOF_RECORDS_MAX {
            let Some(next) = self.next_record(cache, starts, cursor) else { break };
            claim = claim.max(next.header.durable_seq);
            if claim >= target {
                break;
            }
            if let RecordBody::Link { next_segment } = next.header.body {
                starts.links.insert(self.geometry.segment_of(next.offset_bytes), next_segment.map(SegmentId));
            }
            cursor = Cursor::after(&next, &self.geometry);
        }
        claim
    }
}

impl LogState {
    /// Replays every complete record group after the checkpoint, in order. Fails only if
    /// a map page cannot be read.
    pub(crate) fn replay(&mut self, inner: &Inner, sb: &Superblock, flush_proof: &Proven) -> Result<RecoveryFindings> {
        let legacy = sb.format_version < FORMAT_VERSION;
        let mut starts = Starts { index: None, links: HashMap::new(), checkpoint_seq: sb.checkpoint_seq };
        if legacy {
            starts.index = Some(inner.index_segment_starts(self.segments.len(), sb.checkpoint_seq));
        }
        let mut cache = SegmentCache::default();
        let mut findings = RecoveryFindings::default();
        let map = inner.map.read();
        let mut cursor = Cursor {
            offset: sb.replay_offset_bytes,
            seq: sb.checkpoint_seq + 1,
            prev_crc: Some(sb.replay_prev_crc),
            segment: inner.geometry.segment_of(sb.replay_offset_bytes.max(crate::format::DATA_START_BYTES)),
        };
        let mut group: Vec<FoundRecord> = Vec::new();
        let mut recovered = RecoveredRecords::default();
        loop {
            let record = match inner.choose_record(&mut cache, &mut starts, cursor, flush_proof) {
                Choice::Intact(record) => record,
                Choice::Recovered(record, why) => {
                    findings.damaged.push(damage_report(&record, why));
                    recovered.note(findings.damaged.len() - 1, record.header.seq, why == COMPLETE);
                    record
                }
                // A torn write: the end of the log, unless the flush proof says the record
                // there was durable (and the damaged one is not its run's: a loss).
                Choice::Torn if flush_proof.lost_from(cursor.seq).is_none() => break,
                Choice::Torn | Choice::Missing => {
                    let past = inner.look_past(&mut cache, &mut starts, cursor);
                    let what = match &past {
                        // Nothing later proves a loss: the end of the log, unless the flush
                        // proof does.
                        PastLoss::End => match flush_proof.lost_from(cursor.seq) {
                            Some(what) => what,
                            None => break,
                        },
                        PastLoss::Successor(next) => format!(
                            "records {}..{} lost (no copy of their description survives); later records prove they were durable",
                            cursor.seq,
                            next.header.seq - 1
                        ),
                        PastLoss::ProvenDurable => format!(
                            "record {} lost (no copy of its description survives); a later record proves it was durable, and no record after it can be shown to continue this log",
                            cursor.seq
                        ),
                    };
                    note_loss(&mut findings, cursor, what);
                    // What survives of a group the loss cut is durable: apply it.
                    self.apply_group(inner, &map, &mut group, &mut findings)?;
                    match past {
                        PastLoss::Successor(next) => next,
                        _ => break,
                    }
                }
            };
            let damage_free = findings.damaged.is_empty() && map.damaged_page_count() == 0;
            self.note_replayed(inner, &map, &record, damage_free)?;
            recovered.followed_by(&record);
            let segment = inner.geometry.segment_of(record.offset_bytes);
            cursor = Cursor::after(&record, &inner.geometry);
            match record.header.body {
                // Links and jumps are no part of any group: a link may open a segment in a
                // group's middle.
                RecordBody::Link { next_segment } => {
                    starts.links.insert(segment, next_segment.map(SegmentId));
                    continue;
                }
                RecordBody::Jump { .. } => continue,
                _ => {}
            }
            if record.header.flags & FLAG_FIRST != 0 {
                group.clear();
            }
            let last = record.header.flags & FLAG_LAST != 0;
            group.push(record);
            if last {
                self.apply_group(inner, &map, &mut group, &mut findings)?;
            }
        }
        // The table must be exact before open frees segments (`settle_at_open`) and the
        // next run continues where the last link points.
        self.settle_owed_at_open(inner, &map)?;
        drop(map);
        recovered.mark_torn_writes(&mut findings);
        findings.continue_in = if cursor.at_segment_start(&inner.geometry) {
            // A jump named a segment whose link never became durable: the log goes on there
            // (it is free: nothing of this history was written to it).
            Some(cursor.segment)
        } else {
            inner.link_of(&mut cache, &mut starts, cursor.segment)
        };
        findings.indexed = starts.index.is_some();
        self.appender.next_seq = cursor.seq;
        self.appender.prev_crc = cursor.prev_crc.unwrap_or(0);
        Ok(findings)
    }

    fn apply_group(
        &mut self,
        inner: &Inner,
        map: &PagedMap,
        group: &mut Vec<FoundRecord>,
        findings: &mut RecoveryFindings,
    ) -> Result<()> {
        for record in group.drain(..) {
            let header = &record.header;
            let mut live = self.live(&inner.geometry);
            let format = header.version.fragment_format();
            apply_record(map, &mut live, inner, &header.body, format, record.payload_offset_bytes)?;
            if let Some(degraded) = findings.degraded.as_mut() {
                for (start, blocks) in lbas_set(&header.body) {
                    degraded.note(start, blocks);
                }
            }
        }
        map.trim_cache();
        Ok(())
    }

    /// Segment bookkeeping for a replayed record: a record at a segment's start begins a new
    /// use of it (whatever it held before died earlier in the log) — unless it is the first
    /// record of the use the table already knows (a checkpoint wrote pages into a segment
    /// opened after its snapshot).
    ///
    /// The run that reused the segment had settled the owed removals of the leaves pointing
    /// into it (GC does before it cleans a victim); replay records changes blind, so it
    /// settles every owed removal first, or they would later come off the new use's count.
    /// (A replaced subtree's walk cannot point into it: GC waits for the checkpoint that
    /// walks it, and replay starts from that checkpoint or a later one.)
    fn note_replayed(&mut self, inner: &Inner, map: &PagedMap, record: &FoundRecord, damage_free: bool) -> Result<()> {
        let segment = inner.geometry.segment_of(record.offset_bytes);
        let base = inner.geometry.segment_base(segment);
        if record.offset_bytes == base && self.segments.get(segment).first_seq != record.header.seq {
            if self.segments.get(segment).live_bytes != 0 {
                self.settle_owed_at_open(inner, map)?;
            }
            // Only damage (a map page that hides what it mapped, a record replay could not
            // read) leaves the table wrong here; without it, the old use held nothing.
            let usage = self.segments.get(segment);
            debug_assert!(
                (usage.live_bytes == 0 && usage.page_bytes == 0) || !damage_free,
                "replay reuses segment {segment} that holds live data or map pages: {usage:?}"
            );
            self.segments.restart_in_replay(segment);
        }
        let end = (record.end_bytes - base).max(self.segments.get(segment).end_bytes);
        self.segments.note_append(segment, end, Some((record.header.seq, record.header.nonce_epoch)));
        Ok(())
    }

    /// Settles the owed removals of every leaf with unsettled changes (reading them). Alone
    /// at open, replay holds the map and the table throughout (`check` takes them in turn).
    fn settle_owed_at_open(&mut self, inner: &Inner, map: &PagedMap) -> Result<()> {
        for leaves in map.unsettled_leaves().chunks(SETTLE_BATCH_LEAVES) {
            map.pin_loaded(leaves, inner)?;
            map.settle(leaves, &mut self.live(&inner.geometry));
            map.unpin(leaves);
        }
        Ok(())
    }
}

/// Why a damaged record is applied when one copy of its description and its payload survive.
const COMPLETE: &str = "complete";

/// A damaged record replay applied, with what decides whether it is a torn write.
struct Recovered {
    /// Its index in `RecoveryFindings::damaged`.
    index: usize,
    seq: u64,
    complete: bool,
    /// The highest durable sequence number a record after it claims.
    claim: u64,
}

#[derive(Default)]
struct RecoveredRecords(Vec<Recovered>);

impl RecoveredRecords {
    fn note(&mut self, index: usize, seq: u64, complete: bool) {
        self.0.push(Recovered { index, seq, complete, claim: 0 });
    }

    fn followed_by(&mut self, record: &FoundRecord) {
        for r in self.0.iter_mut().filter(|r| r.seq < record.header.seq) {
            r.claim = r.claim.max(record.header.durable_seq);
        }
    }

    /// Complete damage in a record no later record proves durable is what a crash tearing
    /// its write leaves: the last record of the log, or — records of different segments
    /// reach the disk in any order before a flush — the last of its segment, with the log
    /// going on in another (a crash-model run once flagged one as damage).
    fn mark_torn_writes(&self, findings: &mut RecoveryFindings) {
        for r in &self.0 {
            findings.damaged[r.index].torn_tail = r.complete && r.claim < r.seq;
        }
    }
}

/// Records a loss at the cursor: the store opens degraded from its sequence number on.
fn note_loss(findings: &mut RecoveryFindings, cursor: Cursor, what: String) {
    let lost =
        DamagedRecord { torn_tail: false, maps_nothing: false, offset_bytes: cursor.offset, what, lbas: Vec::new() };
    tracing::error!("replay: {} at byte {}", lost.what, lost.offset_bytes);
    findings.damaged.push(lost);
    findings.degraded.get_or_insert_with(|| Degraded::from(cursor.seq));
}

/// What a damaged-but-recovered record's report says; `why` says why it was applied.
fn damage_report(record: &FoundRecord, why: &str) -> DamagedRecord {
    let d = record.damage;
    let mut parts = Vec::new();
    if d.head {
        parts.push("head damaged (recovered from the tail's copy)");
    }
    if d.tail {
        parts.push("tail damaged (entries recovered from the fragments' protection information)");
    }
    if d.payload {
        parts.push("payload damaged (its damaged blocks read as EIO)");
    }
    let what = format!("record {}: {}; applied ({why})", record.header.seq, parts.join("; "));
    tracing::warn!("replay: {what}, at byte {}", record.offset_bytes);
    let maps_nothing = record.header.body.maps_nothing();
    DamagedRecord {
        offset_bytes: record.offset_bytes,
        what,
        lbas: lbas_set(&record.header.body),
        torn_tail: false,
        maps_nothing,
    }
}

/// Whether a fragment decodes to its guard (and, in version 3, names this LBA and entry).
fn fragment_verifies(
    stored: crate::map::Stored,
    lba: Lba,
    bytes: &[u8],
    dictionaries: &DictionarySet,
    sealed: Option<Sealed<'_>>,
) -> bool {
    crate::store::read::verify_fragment(stored, bytes, lba, &mut [0u8; crate::BLOCK_SIZE], dictionaries, sealed).is_ok()
}

/// Every single-bit flip (as a bit index) that makes a damaged fragment verify.
fn one_bit_corrections(
    stored: crate::map::Stored,
    lba: Lba,
    fragment: &[u8],
    dictionaries: &DictionarySet,
    sealed: Option<Sealed<'_>>,
) -> Vec<usize> {
    let mut bytes = fragment.to_vec();
    let mut found = Vec::new();
    for i in 0..bytes.len() * 8 {
        bytes[i / 8] ^= 1 << (i % 8);
        if fragment_verifies(stored, lba, &bytes, dictionaries, sealed) {
            found.push(i);
        }
        bytes[i / 8] ^= 1 << (i % 8);
    }
    found
}

/// Whether one choice of flip per damaged fragment gives the payload its CRC back.
fn restores_crc(payload: &mut [u8], damaged: &[(std::ops::Range<usize>, Vec<usize>)], crc: u32) -> bool {
    let Some(((range, flips), rest)) = damaged.split_first() else {
        return crc32c::crc32c(payload) == crc;
    };
    for &bit in flips {
        let byte = range.start + bit / 8;
        payload[byte] ^= 1 << (bit % 8);
        let restored = restores_crc(payload, rest, crc);
        payload[byte] ^= 1 << (bit % 8);
        if restored {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn damaged() -> DamagedRecord {
        DamagedRecord { what: String::new(), lbas: Vec::new(), torn_tail: false, maps_nothing: false, offset_bytes: 0 }
    }

    #[test]
    fn a_torn_write_is_complete_damage_no_later_record_proves_durable() {
        let mut findings = RecoveryFindings { damaged: vec![damaged(), damaged(), damaged()], ..Default::default() };
        let recovered = RecoveredRecords(vec![
            // Complete, nothing after it claims it: torn.
            Recovered { index: 0, seq: 7, complete: true, claim: 6 },
            // Complete, but a later record claims it durable: decay.
            Recovered { index: 1, seq: 8, complete: true, claim: 8 },
            // Applied for one flipped bit, not complete: never a torn write.
            Recovered { index: 2, seq: 9, complete: false, claim: 0 },
        ]);
        recovered.mark_torn_writes(&mut findings);
        let torn: Vec<bool> = findings.damaged.iter().map(|d| d.torn_tail).collect();
        assert_eq!(torn, [true, false, false]);
    }
}
