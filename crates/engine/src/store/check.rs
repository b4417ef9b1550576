//! `check`: reads the whole log, past any damage, and verifies every record and every
//! fragment in it (read from the disk, never the read cache); then every map entry points
//! at a fragment that verified, with its length and codec, for its own LBA; then the segment table's live bytes agree
//! with what the map references. Damage recovery found is reported too. Each problem comes
//! with its byte offset and the LBAs it affects where they are known.

use std::collections::HashSet;

use super::options::{CheckReport, DamageReport};
use super::read::ReadCache;
use super::scan::{parse_segment, FoundRecord};
use super::state::{new_buffer, round_up, Inner};
use crate::error::Result;
use crate::format::{RecordKind, SegmentState, SegmentUsage};
use crate::map::{Entry, Map, PackedEntry, Stored};
use crate::types::{Lba, SegmentId};
use crate::{BLOCK_SIZE, SECTOR_SIZE};

impl CheckReport {
    fn problem(&mut self, offset_bytes: u64, what: String, lbas: Vec<(u64, u64)>) {
        self.problems.push(what.clone());
        self.damage.push(DamageReport { offset_bytes, what, lbas });
    }
}

impl Inner {
    pub(crate) fn check(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<CheckReport> {
        if self.check_writable().is_ok() {
            self.flush()?;
        }
        let mut report = CheckReport::default();
        for damaged in self.recovery.get().map_or(&[][..], |r| &r.damaged[..]) {
            if damaged.torn_tail || damaged.maps_nothing {
                report.notes.push(format!(
                    "the last record before a crash was written in part, nothing lost: {}",
                    damaged.what
                ));
                continue;
            }
            let lbas = damaged.lbas.iter().map(|(lba, n)| (lba.0, *n)).collect();
            report.problem(damaged.offset_bytes, format!("found at recovery: {}", damaged.what), lbas);
        }
        self.check_checkpoints(&mut report);
        // The accounting is compared under the log lock, under which every map change
        // happens: background GC may be moving fragments while check runs.
        let (segments, buffered, mapped_live) = {
            let log = self.log.lock();
            (log.segments.snapshot(), self.unwritten_segments(), self.live_bytes_by_segment(&self.map.read()))
        };
        let map = self.map.read();
        let total = segments.len() as u64 + map.block_count();
        let mut verified: HashSet<(u64, u64)> = HashSet::new();
        for (id, s) in segments.iter().enumerate() {
            progress(id as u64, total);
            let id = SegmentId(id as u32);
            if matches!(s.state, SegmentState::Sealed | SegmentState::Open)
                && s.end_bytes > 0
                && !buffered.contains(&id)
            {
                self.check_segment(id, s, &map, &mut verified, &mut report);
            }
        }
        self.check_map(&map, &verified, segments.len(), &mut report, progress);
        for (id, s) in segments.iter().enumerate() {
            if mapped_live[id] != s.live_bytes {
                report.problem(
                    self.geometry.segment_base(SegmentId(id as u32)),
                    format!(
                        "segment {id}: usage table says {} live bytes, the map references {}",
                        s.live_bytes, mapped_live[id]
                    ),
                    Vec::new(),
                );
            }
        }
        progress(total, total);
        Ok(report)
    }

    /// The retained checkpoints (both superblock slots) load.
    fn check_checkpoints(&self, report: &mut CheckReport) {
        let Ok((best, other)) = super::recovery::read_superblocks(self.backing.as_ref()) else {
            report.problem(0, "a superblock slot does not decode".into(), Vec::new());
            return;
        };
        for sb in std::iter::once(best).chain(other) {
            if let Err(e) = super::checkpoint::load_checkpoint(self.backing.as_ref(), &sb) {
                let at = sb.checkpoint_chunks.first().map_or(0, |c| c.offset_bytes);
                report.problem(at, format!("checkpoint {} does not load: {e}", sb.generation), Vec::new());
            }
        }
    }

    /// Every record of a used segment, past damage, and every fragment in them.
    fn check_segment(
        &self,
        id: SegmentId,
        usage: &SegmentUsage,
        map: &Map,
        verified: &mut HashSet<(u64, u64)>,
        report: &mut CheckReport,
    ) {
        let base = self.geometry.segment_base(id);
        let mut image = new_buffer(round_up(usage.end_bytes, SECTOR_SIZE as u64) as usize);
        if let Err(e) = self.backing.read_at(base, &mut image) {
            report.problem(base, format!("segment {id}: read failed: {e}"), Vec::new());
            return;
        }
        let (records, damaged) = parse_segment(&image, base, self.geometry.store_tag);
        report.records_checked += records.len() as u64;
        let damaged_ranges = damaged.len();
        for (start, end) in damaged {
            report.problem(
                start,
                format!(
                    "segment {id}: bytes {start}..{end} hold no readable record (damaged; what they wrote is unknown)"
                ),
                Vec::new(),
            );
        }
        let parsed_end = records.last().map_or(0, |r| r.end_bytes - base);
        if round_up(parsed_end, SECTOR_SIZE as u64) < usage.end_bytes {
            report.problem(
                base + parsed_end,
                format!(
                    "segment {id}: records end at byte {parsed_end} but the segment is used up to {}; the rest is damaged",
                    usage.end_bytes
                ),
                Vec::new(),
            );
        }
        let last_offset = records.last().map(|r| r.offset_bytes);
        for record in &records {
            // The segment's last record, complete, with nothing after it: a write a crash
            // tore (the next records went to a fresh segment). Nothing is lost.
            // (A damaged checkpoint chunk maps nothing: if a retained superblock needs it,
            // `check_checkpoints` reports that.)
            let maps_nothing = matches!(record.header.kind(), RecordKind::Checkpoint | RecordKind::Marker);
            let torn_tail = maps_nothing || Some(record.offset_bytes) == last_offset && damaged_ranges == 0;
            if record.damage.any() && torn_tail {
                report.notes.push(format!(
                    "segment {id}: record {} at byte {}, the last written there, is damaged as a crash leaves a torn write (its blocks are checked one by one)",
                    record.header.seq, record.offset_bytes
                ));
            } else if record.damage.any() {
                let lbas = record.header.body.fragments().iter().map(|(lba, _)| (lba.0, 1)).collect();
                let d = record.damage;
                report.problem(
                    record.offset_bytes,
                    format!(
                        "record {} at byte {}: damaged{}{}{} (its surviving copy still describes it)",
                        record.header.seq,
                        record.offset_bytes,
                        if d.head { ", head" } else { "" },
                        if d.tail { ", tail" } else { "" },
                        if d.payload { ", payload" } else { "" },
                    ),
                    lbas,
                );
            }
            self.check_fragments(record, &image, base, map, verified, report);
        }
    }

    /// Decodes every fragment of a record and checks its guard and protection information.
    fn check_fragments(
        &self,
        record: &FoundRecord,
        image: &[u8],
        base: u64,
        map: &Map,
        verified: &mut HashSet<(u64, u64)>,
        report: &mut CheckReport,
    ) {
        let format = record.header.version.fragment_format();
        let mut block = vec![0u8; BLOCK_SIZE];
        let mut at = record.payload_offset_bytes;
        for (lba, fragment) in record.header.body.fragments() {
            let len = fragment.stored_len as u64;
            if !fragment.is_zero_block(format) {
                let stored =
                    Stored { offset_bytes: at, stored_len: fragment.stored_len, codec: fragment.codec, format };
                let bytes = &image[(at - base) as usize..(at - base + len) as usize];
                match self.decode_fragment(stored, bytes, &mut block, lba) {
                    Ok(()) => {
                        verified.insert((PackedEntry::stored(stored).0, lba.0));
                    }
                    Err(e) => {
                        let live = lba.0 < map.block_count() && map.get(lba) == PackedEntry::stored(stored);
                        let state = if live { "live: reads of it fail" } else { "no longer mapped" };
                        report.problem(
                            at,
                            format!("block {lba}, fragment at byte {at} ({state}): {e}"),
                            vec![(lba.0, 1)],
                        );
                    }
                }
            }
            at += len;
        }
    }

    /// The fragment bytes the map references in each segment.
    fn live_bytes_by_segment(&self, map: &Map) -> Vec<u64> {
        let mut live = vec![0u64; self.geometry.segment_count as usize];
        for (_, entry) in map.mapped() {
            if let Ok(Entry::Stored(s)) = entry.unpack() {
                live[self.geometry.segment_of(s.offset_bytes).index()] += s.stored_len as u64;
            }
        }
        live
    }

    /// Every map entry: a stored one must point at a fragment that verified (or verify now,
    /// if it is still only in memory).
    fn check_map(
        &self,
        map: &Map,
        verified: &HashSet<(u64, u64)>,
        segment_count: usize,
        report: &mut CheckReport,
        progress: &mut dyn FnMut(u64, u64),
    ) {
        let total = segment_count as u64 + map.block_count();
        let mut block = vec![0u8; BLOCK_SIZE];
        for lba in (0..map.block_count()).map(Lba) {
            if lba.0 % 4096 == 0 {
                progress(segment_count as u64 + lba.0, total);
            }
            match map.get(lba).unpack() {
                Ok(Entry::Stored(s)) => {
                    report.blocks_checked += 1;
                    if verified.contains(&(PackedEntry::stored(s).0, lba.0)) {
                        continue;
                    }
                    if let Err(e) = self.fetch_blocks(&[Entry::Stored(s)], &mut block, lba, ReadCache::Bypass) {
                        report.problem(
                            s.offset_bytes,
                            format!("block {lba} (byte offset {}): {e}", lba.byte_offset()),
                            vec![(lba.0, 1)],
                        );
                    }
                }
                Ok(Entry::Lost) => {
                    report.problem(0, format!("block {lba}: lost with damaged metadata"), vec![(lba.0, 1)])
                }
                Ok(_) => {}
                Err(e) => report.problem(0, format!("block {lba}: {e}"), vec![(lba.0, 1)]),
            }
        }
    }
}
