//! `check`: every record header in the used segments parses, every stored block decodes
//! and matches its CRC (read from the disk, never the read cache), and the segment table's
//! live bytes agree with what the map references.

use super::options::CheckReport;
use super::read::ReadCache;
use super::scan::parse_segment;
use super::state::{new_buffer, round_up, Inner};
use crate::error::Result;
use crate::format::{SegmentState, SegmentUsage};
use crate::map::Entry;
use crate::types::{Lba, SegmentId};
use crate::{BLOCK_SIZE, SECTOR_SIZE};

impl Inner {
    pub(crate) fn check(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<CheckReport> {
        if !self.read_only {
            self.flush()?;
        }
        let mut report = CheckReport::default();
        let (segments, buffered): (Vec<SegmentUsage>, Vec<SegmentId>) = {
            let log = self.log.lock();
            (log.segments.snapshot(), self.unwritten_segments())
        };
        let map = self.map.read();
        let total = segments.len() as u64 + map.block_count();
        for (id, s) in segments.iter().enumerate() {
            progress(id as u64, total);
            let id = SegmentId(id as u32);
            if matches!(s.state, SegmentState::Sealed | SegmentState::Open)
                && s.end_bytes > 0
                && !buffered.contains(&id)
            {
                self.check_records(id, s, &mut report);
            }
        }
        // Blocks: every stored block decodes and matches its checksum.
        let mut recomputed_live = vec![0u64; segments.len()];
        let mut block = vec![0u8; BLOCK_SIZE];
        for lba in (0..map.block_count()).map(Lba) {
            if lba.0 % 4096 == 0 {
                progress(segments.len() as u64 + lba.0, total);
            }
            match map.get(lba).unpack() {
                Ok(Entry::Stored(s)) => {
                    report.blocks_checked += 1;
                    recomputed_live[self.geometry.segment_of(s.offset_bytes).index()] += s.stored_len as u64;
                    if let Err(e) = self.fetch_blocks(&[Entry::Stored(s)], &mut block, lba, ReadCache::Bypass) {
                        report.problems.push(format!("block {lba} (byte offset {}): {e}", lba.byte_offset()));
                    }
                }
                Ok(_) => {}
                Err(e) => report.problems.push(format!("block {lba}: {e}")),
            }
        }
        for (id, s) in segments.iter().enumerate() {
            if recomputed_live[id] != s.live_bytes {
                report.problems.push(format!(
                    "segment {id}: usage table says {} live bytes, the map references {}",
                    s.live_bytes, recomputed_live[id]
                ));
            }
        }
        progress(total, total);
        Ok(report)
    }

    /// Records: a used segment parses cleanly up to its end.
    fn check_records(&self, id: SegmentId, usage: &SegmentUsage, report: &mut CheckReport) {
        let base = self.geometry.segment_base(id);
        let mut image = new_buffer(round_up(usage.end_bytes, SECTOR_SIZE as u64) as usize);
        if let Err(e) = self.backing.read_at(base, &mut image) {
            report.problems.push(format!("segment {id}: read failed: {e}"));
            return;
        }
        let records = parse_segment(&image, base, self.geometry.store_tag);
        report.records_checked += records.len() as u64;
        let parsed_end = records.last().map_or(0, |r| r.end_bytes - base);
        if round_up(parsed_end, SECTOR_SIZE as u64) < usage.end_bytes {
            report.problems.push(format!(
                "segment {id}: records end at byte {parsed_end} but the segment is used up to {}; a record header or payload is damaged",
                usage.end_bytes
            ));
        }
    }
}
