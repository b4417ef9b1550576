//! Reading records back from segment images: what replay, GC and check share.
//!
//! Invariant: a record is returned only after its header CRC, store tag and payload CRC
//! all verified; within one segment image, records follow each other with increasing
//! sequence numbers (a stale record from an earlier use of the segment breaks that).

use super::state::{round_up, Inner};
use crate::format::{locate_record, RecordHeader, RECORD_HEADER_MIN_BYTES};
use crate::types::SegmentId;
use crate::SECTOR_SIZE;

/// A verified record found in the log.
pub(crate) struct FoundRecord {
    pub header: RecordHeader,
    pub crc: u32,
    pub offset_bytes: u64,
    pub payload_offset_bytes: u64,
    pub end_bytes: u64,
}

/// Parses and fully verifies (header and payload CRC) the record at `offset` in a segment
/// image that starts at physical `base`.
pub(crate) fn parse_record_at(image: &[u8], base: u64, offset: u64, store_tag: u32) -> Option<FoundRecord> {
    let at = (offset.checked_sub(base)?) as usize;
    if at + RECORD_HEADER_MIN_BYTES > image.len() {
        return None;
    }
    let located = locate_record(image, at)?;
    let (header, crc) = RecordHeader::decode(&located.header).ok()?;
    if header.store_tag != store_tag {
        return None;
    }
    // `locate_record` read the payload length before the CRC vouched for it.
    let payload = image.get(located.payload_at..located.payload_at + header.payload_len as usize)?;
    if located.payload_at + payload.len() > located.end || crc32c::crc32c(payload) != header.payload_crc {
        return None;
    }
    Some(FoundRecord {
        header,
        crc,
        offset_bytes: offset,
        payload_offset_bytes: base + located.payload_at as u64,
        end_bytes: base + located.end as u64,
    })
}

/// The record at `offset` that `accept` takes, or else the one at the next sector boundary
/// (where a flush's padding ends).
fn parse_record_near(
    image: &[u8],
    base: u64,
    offset: u64,
    store_tag: u32,
    accept: impl Fn(&FoundRecord) -> bool,
) -> Option<FoundRecord> {
    let at = |offset| parse_record_at(image, base, offset, store_tag).filter(&accept);
    at(offset).or_else(|| {
        let aligned = round_up(offset, SECTOR_SIZE as u64);
        (aligned != offset).then(|| at(aligned)).flatten()
    })
}

/// Every valid record of a segment image in order, following padding to sector boundaries.
pub(crate) fn parse_segment(image: &[u8], base: u64, store_tag: u32) -> Vec<FoundRecord> {
    let mut records: Vec<FoundRecord> = Vec::new();
    let mut offset = base;
    while let Some(r) = parse_record_near(image, base, offset, store_tag, |_| true) {
        // Records of one incarnation have increasing sequence numbers; a stale record from
        // before the segment was reused would break that.
        if records.last().is_some_and(|p| r.header.seq != p.header.seq + 1) {
            break;
        }
        offset = r.end_bytes;
        records.push(r);
    }
    records
}

/// Whole-segment images read during replay, one at a time.
#[derive(Default)]
pub(crate) struct SegmentCache {
    segment: Option<SegmentId>,
    image: Vec<u8>,
}

impl SegmentCache {
    pub fn get(&mut self, inner: &Inner, segment: SegmentId) -> Option<&[u8]> {
        if self.segment != Some(segment) {
            let mut image = vec![0u8; inner.geometry.segment_size_bytes as usize];
            inner.backing.read_at(inner.geometry.segment_base(segment), &mut image).ok()?;
            self.image = image;
            self.segment = Some(segment);
        }
        Some(&self.image)
    }

    /// The record at `offset` or the next sector boundary after it that `accept` takes,
    /// read through the cache.
    pub fn record_near(
        &mut self,
        inner: &Inner,
        offset: u64,
        accept: impl Fn(&FoundRecord) -> bool,
    ) -> Option<FoundRecord> {
        if offset < crate::format::DATA_START_BYTES {
            return None;
        }
        let segment = inner.geometry.segment_of(offset);
        if segment.0 as u64 >= inner.geometry.segment_count {
            return None;
        }
        let base = inner.geometry.segment_base(segment);
        let image = self.get(inner, segment)?;
        parse_record_near(image, base, offset, inner.geometry.store_tag, accept)
    }
}
