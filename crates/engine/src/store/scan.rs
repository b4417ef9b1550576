//! Reading records back from segment images: what replay, GC and check share.
//!
//! A version 3 record is found from its head, or — when the head is damaged — from the
//! copy of the head in its tail; its entries come from the tail, or — when the tail is
//! damaged — from walking its payload's fragments by their protection information. A
//! record found through a copy, or whose payload fails its CRC, is returned with its
//! damage noted: whether to apply it is the caller's decision (replay applies it only once
//! a later record proves it was durable; `recovery.rs`).
//!
//! Invariants: a record is returned only if its head, or its tail's copy of the head,
//! passed its CRC and carries the store's tag; within one segment image, `parse_segment`
//! returns records with increasing sequence numbers (a stale record from an earlier use of
//! the segment breaks that).

use super::geometry::round_up;
use super::state::Inner;
use crate::codec::{decompress_block, frame_dictionary_id, CodecTag, DictionarySet};

/// What parsing a record needs to know of its store: its tag (records of other stores are
/// not ours) and its dictionaries (a damaged record's fragments are verified by decoding).
pub(crate) struct RecordContext<'a> {
    pub store_tag: u32,
    pub dictionaries: &'a DictionarySet,
    /// An encrypted store's: its fragments verify by the CRC32C of their sealed bytes.
    pub cipher: Option<&'a StoreCipher>,
    /// The use of the segment of a record at an offset with a sequence number (what an
    /// encrypted store's placement tags bind: `Inner::record_use`).
    pub use_of: &'a dyn Fn(u64, u64, u16) -> SegmentUse,
}
use crate::crypto::cipher::{Domain, SegmentUse, StoreCipher};
use crate::format::v2;
use crate::format::{
    decode_tail, record_is_authentic, relocate_entries_from_damaged_tail, BatchEntry, FragmentFormat, Head, Protection,
    RecordBody, RecordHeader, RecordKind, DATA_START_BYTES, HEAD_BYTES, PI_BYTES, RECORD_MAGIC, RECORD_MIN_BYTES,
};
use crate::types::SegmentId;
use crate::{BLOCK_SIZE, SECTOR_SIZE};

/// What failed its checksum in a record that was still found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Damage {
    /// The head; the record was found through its tail's copy.
    pub head: bool,
    /// The tail; the entries came from the payload's protection information (or, for a
    /// relocation, were given up: losing one only leaves data where it was).
    pub tail: bool,
    /// The payload's CRC: some fragment is damaged (its own guard will say which).
    pub payload: bool,
}

impl Damage {
    pub fn any(self) -> bool {
        self.head || self.tail || self.payload
    }
}

/// A record found in the log.
pub(crate) struct FoundRecord {
    pub header: RecordHeader,
    /// The chain value: the next record's `prev_crc`.
    pub crc: u32,
    pub offset_bytes: u64,
    pub payload_offset_bytes: u64,
    pub end_bytes: u64,
    pub damage: Damage,
}

/// What a segment image holds at an offset.
pub(crate) enum Probe {
    /// A record starts here.
    Found,
    /// No record starts here, but a valid version 3 head does at `next_bytes` (an absolute
    /// address) further on in the image: the bytes between are damaged or stale.
    Damaged {
        next_bytes: u64,
    },
    Nothing,
}

/// Parses the record at `offset` in a segment image that starts at physical `base`, using
/// whatever copy of its description survives.
pub(crate) fn parse_record_at(
    image: &[u8],
    base: u64,
    offset: u64,
    context: &RecordContext<'_>,
) -> Option<FoundRecord> {
    let at = usize::try_from(offset.checked_sub(base)?).ok()?;
    let head = image.get(at..at + HEAD_BYTES.min(image.len().saturating_sub(at)))?;
    if head.len() >= 4 && head[..4] == v2::RECORD_MAGIC_V2.to_le_bytes() {
        // Encrypted stores are version 5: they never held a version 2 record.
        return context.cipher.is_none().then(|| parse_v2_at(image, base, at, context)).flatten();
    }
    match Head::decode(head) {
        Ok(head) if head.store_tag == context.store_tag => from_head(image, base, at, head, Damage::default(), context),
        Ok(_) => None,
        Err(_) => from_tail_copy(image, base, at, context),
    }
}

/// A version 3 record whose head (or its copy) is known.
fn from_head(
    image: &[u8],
    base: u64,
    at: usize,
    head: Head,
    mut damage: Damage,
    context: &RecordContext<'_>,
) -> Option<FoundRecord> {
    let end = at.checked_add(head.record_len()?)?;
    if end > image.len() {
        return None;
    }
    let payload_at = at + HEAD_BYTES;
    let payload = &image[payload_at..payload_at + head.payload_len as usize];
    let tail_at = payload_at + payload.len();
    let tail = &image[tail_at..end];
    let body = match decode_tail(tail) {
        Ok((copy, body)) if copy == head => body,
        _ => {
            damage.tail = true;
            body_without_tail(&head, payload, base + payload_at as u64, tail, context)?
        }
    };
    if let Some(cipher) = context.cipher {
        // Forged, stripped of its MAC, or damaged past what the MAC can vouch for: in an
        // encrypted store such a record is not there (replay treats it as damage).
        let head_bytes =
            if damage.head { &tail[tail.len() - 4 - HEAD_BYTES..tail.len() - 4] } else { &image[at..payload_at] };
        if !record_is_authentic(head_bytes, tail, &body, damage.tail, &|parts, mac| cipher.verify_mac(parts, mac)) {
            return None;
        }
    }
    damage.payload = crc32c::crc32c(payload) != head.payload_crc;
    Some(FoundRecord {
        header: head.header(body),
        crc: head.crc,
        offset_bytes: base + at as u64,
        payload_offset_bytes: base + payload_at as u64,
        end_bytes: base + end as u64,
        damage,
    })
}

/// A record's body when its tail fails its CRC: from the head for records without entries,
/// from the payload's protection information for data and map-pages records, from the
/// surviving copy of a relocation's entries. None when nothing says what it did (the record
/// is lost).
fn body_without_tail(
    head: &Head,
    payload: &[u8],
    payload_address: u64,
    tail: &[u8],
    context: &RecordContext<'_>,
) -> Option<RecordBody> {
    match head.kind {
        // A map page's protection information names its page where a block's names its
        // LBA, so map-pages records are walked like batches.
        RecordKind::Write | RecordKind::Batch | RecordKind::MapPages => {
            let domain = if head.kind == RecordKind::MapPages { Domain::MapPage } else { Domain::Block };
            let in_use = (context.use_of)(payload_address - HEAD_BYTES as u64, head.seq, head.nonce_epoch);
            let sealed = context.cipher.map(|cipher| (cipher, domain, in_use));
            let walked = walk_fragments(payload, payload_address, context.dictionaries, sealed)?;
            if walked.len() as u64 != head.count {
                return None;
            }
            Some(match head.kind {
                RecordKind::Write => {
                    let consecutive = walked.iter().enumerate().all(|(i, e)| e.lba == head.start_lba.plus(i as u64));
                    if !consecutive {
                        return None;
                    }
                    RecordBody::Write {
                        start_lba: head.start_lba,
                        fragments: walked.iter().map(|e| e.fragment).collect(),
                    }
                }
                RecordKind::MapPages => RecordBody::MapPages { entries: walked },
                _ => RecordBody::Batch { entries: walked },
            })
        }
        RecordKind::Relocate => {
            let entries = relocate_entries_from_damaged_tail(head, tail)?;
            let body = RecordBody::Relocate { entries };
            (body.fragment_bytes() == head.payload_len as u64).then_some(body)
        }
        _ => head.body(&[]).ok(),
    }
}

/// The fragments of a version 3 payload, from their protection information: each must
/// decode and match its guard, and together they must fill the payload exactly. (An
/// all-zero block's fragment is its protection information alone.)
/// In an encrypted store (`sealed`: its cipher, what the fragments are, and the use of their
/// segment), a fragment must carry the placement tag of its address (the payload starts at
/// `payload_address`) and use, and open under the key.
pub(crate) fn walk_fragments(
    payload: &[u8],
    payload_address: u64,
    dictionaries: &DictionarySet,
    sealed: Option<(&StoreCipher, Domain, SegmentUse)>,
) -> Option<Vec<BatchEntry>> {
    let mut entries = Vec::new();
    let mut at = 0;
    let mut block = vec![0u8; BLOCK_SIZE];
    while at < payload.len() {
        let pi = Protection::decode(payload.get(at..at + PI_BYTES)?).ok()?;
        let fragment = payload.get(at..at + pi.entry.stored_len as usize)?;
        if pi.entry.is_zero_block(FragmentFormat::V3) {
            block.fill(0);
        } else if let Some((cipher, domain, in_use)) = sealed {
            let body = &fragment[PI_BYTES..];
            if cipher.placement(payload_address + at as u64, in_use.seq, body) != pi.guard {
                return None;
            }
            cipher.open(domain, pi.lba.0, pi.entry.packed(), body, in_use.nonce_epoch).ok()?;
            entries.push(BatchEntry { lba: pi.lba, fragment: pi.entry });
            at += fragment.len();
            continue;
        } else if pi.entry.codec == CodecTag::ZstdDict
            && frame_dictionary_id(&fragment[PI_BYTES..]).is_some_and(|id| dictionaries.dropped(id))
        {
            // A dead fragment of a dictionary freed since (a torn record GC has not cleaned
            // away yet): its guard cannot be checked, but its protection information decoded
            // and it fits, so the walk goes on. The map names no such fragment; were one
            // applied, its reads would fail, never return other bytes.
            entries.push(BatchEntry { lba: pi.lba, fragment: pi.entry });
            at += fragment.len();
            continue;
        } else {
            decompress_block(pi.entry.codec, &fragment[PI_BYTES..], &mut block, dictionaries).ok()?;
        }
        if crc32c::crc32c(&block) != pi.guard {
            return None;
        }
        entries.push(BatchEntry { lba: pi.lba, fragment: pi.entry });
        at += fragment.len();
    }
    Some(entries)
}

/// A record whose head is damaged: look for its tail — the first valid head-shaped thing
/// after it is either the tail's copy of its head (if it describes a record starting at
/// `at`) or the next record's head (then this one is lost).
fn from_tail_copy(image: &[u8], base: u64, at: usize, context: &RecordContext<'_>) -> Option<FoundRecord> {
    let (q, copy) = next_valid_head(image, at + 1, context)?;
    let tail_len = copy.tail_len()?;
    let start = (q + HEAD_BYTES + 4).checked_sub(tail_len)?.checked_sub(copy.payload_len as usize + HEAD_BYTES)?;
    if start != at {
        return None;
    }
    from_head(image, base, at, copy, Damage { head: true, ..Damage::default() }, context)
}

/// The first offset at or after `from` holding a valid version 3 head (or a tail's copy of
/// one) of this store.
fn next_valid_head(image: &[u8], from: usize, context: &RecordContext<'_>) -> Option<(usize, Head)> {
    let magic = RECORD_MAGIC.to_le_bytes();
    let mut at = from;
    while at + HEAD_BYTES <= image.len() {
        let found = image[at..image.len() - HEAD_BYTES + 4].windows(4).position(|w| w == magic)?;
        at += found;
        if let Ok(head) = Head::decode(&image[at..at + HEAD_BYTES]) {
            if head.store_tag == context.store_tag {
                return Some((at, head));
            }
        }
        at += 1;
    }
    None
}

/// Probes `offset`: the record there, or where the next valid head after damage is.
pub(crate) fn probe(image: &[u8], base: u64, offset: u64, context: &RecordContext<'_>) -> Probe {
    if parse_record_at(image, base, offset, context).is_some() {
        return Probe::Found;
    }
    let Some(at) = offset.checked_sub(base).map(|a| a as usize) else { return Probe::Nothing };
    match next_valid_head(image, at + 1, context) {
        Some((q, _)) => Probe::Damaged { next_bytes: base + q as u64 },
        None => Probe::Nothing,
    }
}

fn parse_v2_at(image: &[u8], base: u64, at: usize, context: &RecordContext<'_>) -> Option<FoundRecord> {
    if at + v2::HEADER_MIN_BYTES_V2 > image.len() {
        return None;
    }
    let located = v2::locate_record(image, at)?;
    let (header, crc) = v2::decode(&located.header).ok()?;
    if header.store_tag != context.store_tag {
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
        offset_bytes: base + at as u64,
        payload_offset_bytes: base + located.payload_at as u64,
        end_bytes: base + located.end as u64,
        damage: Damage::default(),
    })
}

/// The record at `offset` that `accept` takes, or else the one at the next sector boundary
/// (where a flush's padding ends).
fn parse_record_near(
    image: &[u8],
    base: u64,
    offset: u64,
    context: &RecordContext<'_>,
    accept: impl Fn(&FoundRecord) -> bool,
) -> Option<FoundRecord> {
    let at = |offset| parse_record_at(image, base, offset, context).filter(&accept);
    let here = at(offset);
    if here.as_ref().is_some_and(|r| !r.damage.any()) {
        return here;
    }
    // After a flush's padding the next record starts at the sector boundary. An intact one
    // there wins over a damaged one "found" at the offset: a record without payload right
    // after the padding has its head where a record at the offset would have its tail's
    // copy, and the copy decodes.
    let aligned = round_up(offset, SECTOR_SIZE as u64);
    match (aligned != offset).then(|| at(aligned)).flatten() {
        Some(r) if !r.damage.any() || here.is_none() => Some(r),
        _ => here,
    }
}

/// Every record of a segment image in order, following padding to sector boundaries and
/// skipping damage to the next valid head (so GC and check see what lies beyond it).
/// Returns the records and the byte ranges (absolute) where nothing could be parsed.
pub(crate) fn parse_segment(
    image: &[u8],
    base: u64,
    context: &RecordContext<'_>,
) -> (Vec<FoundRecord>, Vec<(u64, u64)>) {
    let mut records: Vec<FoundRecord> = Vec::new();
    let mut damaged = Vec::new();
    let mut offset = base;
    loop {
        if let Some(r) = parse_record_near(image, base, offset, context, |_| true) {
            // Records of one incarnation have increasing sequence numbers; a stale record
            // from before the segment was reused would break that.
            if records.last().is_some_and(|p| r.header.seq <= p.header.seq) {
                break;
            }
            offset = r.end_bytes;
            records.push(r);
            continue;
        }
        // Damage, or the end: go on only if a later head continues the sequence.
        let Some(at) = offset.checked_sub(base).map(|a| a as usize) else { break };
        let Some((q, head)) = next_valid_head(image, at + 1, context) else { break };
        if records.last().is_some_and(|p| head.seq <= p.header.seq) {
            break;
        }
        let next = base + q as u64;
        if next - offset >= RECORD_MIN_BYTES as u64 {
            damaged.push((offset, next));
        }
        offset = next;
    }
    (records, damaged)
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

    /// The image of the segment holding `offset` and its base, if `offset` is in the
    /// data area.
    pub fn image_at(&mut self, inner: &Inner, offset: u64) -> Option<(&[u8], u64)> {
        if offset < DATA_START_BYTES {
            return None;
        }
        let segment = inner.geometry.segment_of(offset);
        if segment.0 as u64 >= inner.geometry.segment_count {
            return None;
        }
        let base = inner.geometry.segment_base(segment);
        Some((self.get(inner, segment)?, base))
    }

    /// The record at `offset` or the next sector boundary after it that `accept` takes,
    /// read through the cache.
    pub fn record_near(
        &mut self,
        inner: &Inner,
        offset: u64,
        accept: impl Fn(&FoundRecord) -> bool,
    ) -> Option<FoundRecord> {
        let dictionaries = inner.dictionary_set();
        let context = RecordContext {
            store_tag: inner.geometry.store_tag,
            dictionaries: &dictionaries,
            cipher: inner.log.cipher.as_deref(),
            use_of: &|offset, seq, epoch| inner.record_use(offset, seq, epoch),
        };
        let (image, base) = self.image_at(inner, offset)?;
        parse_record_near(image, base, offset, &context, accept)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::codec::{Codec, Dictionary};
    use crate::format::FragmentEntry;
    use crate::types::Lba;

    /// A block of text lines from a small vocabulary (what a dictionary learns), by seed.
    fn text_block(seed: u64) -> Vec<u8> {
        let words = ["segment ", "record ", "the ", "fragment\n", "map ", "of ", "dictionary ", "zdisk "];
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let mut out = Vec::with_capacity(BLOCK_SIZE + 16);
        while out.len() < BLOCK_SIZE {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            out.extend_from_slice(words[(state >> 33) as usize % words.len()].as_bytes());
        }
        out.truncate(BLOCK_SIZE);
        out
    }

    fn dictionary(id: u32) -> Arc<Dictionary> {
        let samples: Vec<Vec<u8>> = (0..200).map(|s| text_block(s * 7919 + u64::from(id))).collect();
        Arc::new(Dictionary::train(&samples, id, 1, 16 << 10).unwrap())
    }

    /// A payload of two fragments: block 10 in plain zstd, block 11 in dictionary `named`.
    fn payload(named: &Dictionary) -> Vec<u8> {
        let mut payload = Vec::new();
        for (lba, tag_wanted) in [(10u64, CodecTag::Zstd), (11, CodecTag::ZstdDict)] {
            let block = text_block(lba);
            let mut out = Vec::new();
            let tag = match tag_wanted {
                CodecTag::ZstdDict => named.compress_block(&block, &mut out),
                _ => Codec::Zstd { level: 1 }.compress_block(&block, &mut out),
            };
            assert_eq!(tag, tag_wanted);
            let entry = FragmentEntry { stored_len: (PI_BYTES + out.len()) as u16, codec: tag };
            payload.extend_from_slice(&Protection { guard: crc32c::crc32c(&block), lba: Lba(lba), entry }.encode());
            payload.extend_from_slice(&out);
        }
        payload
    }

    #[test]
    fn a_fragment_of_a_dropped_dictionary_does_not_stop_the_walk_but_one_of_an_unknown_one_does() {
        let (first, second, third) = (dictionary(1), dictionary(2), dictionary(3));
        let walk = |named: &Dictionary, held: Vec<Arc<Dictionary>>| {
            walk_fragments(&payload(named), 0, &DictionarySet::new(held), None).map(|e| e.len())
        };
        assert_eq!(walk(&first, vec![first.clone(), second.clone()]), Some(2), "both held");
        // Dictionary 1 was freed once dictionary 2 was GC's: a torn record's dead fragments
        // still name it, and the segment's later records must still be found.
        assert_eq!(walk(&first, vec![second.clone()]), Some(2), "a dropped dictionary's fragment");
        // An id above every one held was never the store's: damage, not a freed dictionary.
        assert_eq!(walk(&third, vec![second.clone()]), None, "a dictionary newer than any held");
        assert_eq!(walk(&first, Vec::new()), None, "a store holding no dictionary");
    }
}
