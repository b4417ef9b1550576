//! Version 2 (and 1) records: read, never written. Stores made before version 3 hold them
//! in their segments; replay of an old store's last window and GC of its old segments
//! decode them here into the shared record types (`record.rs`), with version `V2`.
//!
//! A version 2 record is a header (56 fixed bytes, entries, CRC) and a payload; a batch
//! keeps its entries and CRC after the payload (`docs/format.md`, "Version 2 records").

use std::borrow::Cow;

use super::fragment::{FragmentEntry, FragmentFormat};
use super::record::{BatchEntry, RecordBody, RecordHeader, RecordKind, RecordVersion, RelocateEntry};
use super::{corrupt, u32_at, u64_at, Reader};
use crate::codec::CodecTag;
use crate::error::Result;
use crate::types::Lba;

/// "ZREC": the magic of a version 1 or 2 record header.
pub const RECORD_MAGIC_V2: u32 = 0x4345_525A;

const MAGIC_OFFSET: usize = 0;
const KIND_OFFSET: usize = MAGIC_OFFSET + 4;
const FLAGS_OFFSET: usize = KIND_OFFSET + 1;
const RESERVED_OFFSET: usize = FLAGS_OFFSET + 1;
const SEQ_OFFSET: usize = RESERVED_OFFSET + 2;
const PREV_CRC_OFFSET: usize = SEQ_OFFSET + 8;
const SESSION_OFFSET: usize = PREV_CRC_OFFSET + 4;
const STORE_TAG_OFFSET: usize = SESSION_OFFSET + 4;
const HEADER_LEN_OFFSET: usize = STORE_TAG_OFFSET + 4;
const PAYLOAD_LEN_OFFSET: usize = HEADER_LEN_OFFSET + 4;
const PAYLOAD_CRC_OFFSET: usize = PAYLOAD_LEN_OFFSET + 4;
const START_LBA_OFFSET: usize = PAYLOAD_CRC_OFFSET + 4;
const COUNT_OFFSET: usize = START_LBA_OFFSET + 8;
const FIXED_BYTES: usize = COUNT_OFFSET + 8;
const CRC_BYTES: usize = 4;
/// The smallest version 2 header: the fixed part and the CRC.
pub const HEADER_MIN_BYTES_V2: usize = FIXED_BYTES + CRC_BYTES;
const HEADER_MAX_BYTES: usize = HEADER_MIN_BYTES_V2 + (1 << 24);

const _: () = assert!(FIXED_BYTES == 56, "docs/format.md: the version 2 fixed header is 56 bytes");
const _: () = assert!(SESSION_OFFSET == 20 && PAYLOAD_LEN_OFFSET == 32);

const WRITE_ENTRY_BYTES: usize = 3;
const RELOCATE_ENTRY_BYTES: usize = 14;
const RELOCATE_V1_ENTRY_BYTES: usize = 19;
const BATCH_ENTRY_BYTES: usize = 8;

/// The header length claimed by the bytes at the start of `buf`, if it looks like a
/// version 2 record at all.
pub fn peek_len(buf: &[u8]) -> Option<usize> {
    if buf.len() < FIXED_BYTES || u32_at(buf, MAGIC_OFFSET) != RECORD_MAGIC_V2 {
        return None;
    }
    let len = u32_at(buf, HEADER_LEN_OFFSET) as usize;
    (HEADER_MIN_BYTES_V2..=HEADER_MAX_BYTES).contains(&len).then_some(len)
}

/// Sequence number and store tag of what looks like a version 2 header, unverified.
pub fn peek_identity(buf: &[u8]) -> Option<(u64, u32)> {
    peek_len(buf)?;
    RecordKind::from_u8(buf[KIND_OFFSET]).ok()?;
    Some((u64_at(buf, SEQ_OFFSET), u32_at(buf, STORE_TAG_OFFSET)))
}

/// Decodes a version 2 header; returns it and its CRC (the chain value).
pub fn decode(buf: &[u8]) -> Result<(RecordHeader, u32)> {
    let header_len = peek_len(buf).ok_or_else(|| corrupt("no record header"))?;
    if buf.len() < header_len {
        return Err(corrupt("record header is truncated"));
    }
    let crc_at = header_len - CRC_BYTES;
    let crc = crc32c::crc32c(&buf[..crc_at]);
    if crc != u32_at(buf, crc_at) {
        return Err(corrupt("record header checksum mismatch"));
    }
    let mut r = Reader::new(&buf[..crc_at], "record header");
    r.u32()?;
    let kind = RecordKind::from_u8(r.u8()?)?;
    let flags = r.u8()?;
    r.u16()?;
    let seq = r.u64()?;
    let prev_crc = r.u32()?;
    let session = r.u32()?;
    let store_tag = r.u32()?;
    r.u32()?;
    let payload_len = r.u32()?;
    let payload_crc = r.u32()?;
    let lba = Lba(r.u64()?);
    let count = r.u32()? as u64 | (r.u32()? as u64) << 32;
    let body = decode_body(kind, lba, count, &mut r)?;
    let carries_fragments =
        matches!(kind, RecordKind::Write | RecordKind::Batch | RecordKind::Relocate | RecordKind::RelocateV1);
    if carries_fragments && body.fragment_bytes() != payload_len as u64 {
        return Err(corrupt("record payload length disagrees with its entries"));
    }
    let header = RecordHeader {
        version: RecordVersion::V2,
        flags,
        seq,
        durable_seq: 0,
        prev_crc,
        session,
        store_tag,
        payload_len,
        payload_crc,
        nonce_epoch: 0,
        body,
    };
    Ok((header, crc))
}

/// The entries of a record of `kind`, which must be exactly what `r` has left.
fn decode_body(kind: RecordKind, lba: Lba, count: u64, r: &mut Reader<'_>) -> Result<RecordBody> {
    let v2_relocation = |lba, old_offset_bytes, fragment| RelocateEntry {
        lba,
        old_offset_bytes,
        old_format: FragmentFormat::V2,
        fragment,
    };
    Ok(match kind {
        RecordKind::Write => {
            let fragments = r.entries(count, WRITE_ENTRY_BYTES, "write record entry count", |r| {
                let stored_len = r.u16()?;
                let codec = CodecTag::from_u8(r.u8()?)?;
                Ok(FragmentEntry { stored_len, codec })
            })?;
            RecordBody::Write { start_lba: lba, fragments }
        }
        RecordKind::Relocate => {
            let entries = r.entries(count, RELOCATE_ENTRY_BYTES, "relocate record entry count", |r| {
                let (lba, old) = (Lba(r.u48()?), r.u48()?);
                Ok(v2_relocation(lba, old, FragmentEntry::unpack(r.u16()?)?))
            })?;
            RecordBody::Relocate { entries }
        }
        RecordKind::RelocateV1 => {
            let entries = r.entries(count, RELOCATE_V1_ENTRY_BYTES, "relocate record entry count", |r| {
                let lba = Lba(r.u64()?);
                let old = r.u64()?;
                let stored_len = r.u16()?;
                let codec = CodecTag::from_u8(r.u8()?)?;
                let crate::map::Entry::Stored(old) = crate::map::unpack(old)? else {
                    return Err(corrupt("relocate entry of a block that was not stored"));
                };
                Ok(v2_relocation(lba, old.offset_bytes, FragmentEntry { stored_len, codec }))
            })?;
            RecordBody::Relocate { entries }
        }
        RecordKind::Batch => {
            let entries = r.entries(count, BATCH_ENTRY_BYTES, "batch record entry count", |r| {
                Ok(BatchEntry { lba: Lba(r.u48()?), fragment: FragmentEntry::unpack(r.u16()?)? })
            })?;
            RecordBody::Batch { entries }
        }
        RecordKind::Trim | RecordKind::Zero | RecordKind::Checkpoint => {
            if r.remaining() != 0 {
                return Err(corrupt("record has entries it should not"));
            }
            match kind {
                RecordKind::Trim => RecordBody::Trim { start_lba: lba, block_count: count },
                RecordKind::Zero => RecordBody::Zero { start_lba: lba, block_count: count },
                _ => RecordBody::Checkpoint,
            }
        }
        RecordKind::Marker | RecordKind::MapPages | RecordKind::Link | RecordKind::Jump => {
            return Err(corrupt("a version 3 record kind in a version 2 header"))
        }
    })
}

/// A version 2 record found in a segment image by [`locate_record`]: its header bytes
/// gathered into one run (a batch keeps its entries and header CRC after the payload), and
/// where its payload starts and the record ends, as offsets into the image.
pub struct LocatedRecord<'a> {
    pub header: Cow<'a, [u8]>,
    pub payload_at: usize,
    pub end: usize,
}

/// Locates the version 2 record that starts at `at` in a segment image. None when the
/// bytes there cannot be one or it would run past the image. Nothing is verified yet.
pub fn locate_record(image: &[u8], at: usize) -> Option<LocatedRecord<'_>> {
    let head = image.get(at..)?;
    let header_len = peek_len(head)?;
    let payload_len = u32_at(head, PAYLOAD_LEN_OFFSET) as usize;
    if head[KIND_OFFSET] == RecordKind::Batch as u8 {
        let payload_at = at + FIXED_BYTES;
        let trailer_at = payload_at.checked_add(payload_len)?;
        let end = trailer_at.checked_add(header_len - FIXED_BYTES)?;
        if end > image.len() {
            return None;
        }
        let mut header = Vec::with_capacity(header_len);
        header.extend_from_slice(&image[at..payload_at]);
        header.extend_from_slice(&image[trailer_at..end]);
        Some(LocatedRecord { header: Cow::Owned(header), payload_at, end })
    } else {
        let payload_at = at + header_len;
        let end = payload_at.checked_add(payload_len)?;
        if end > image.len() {
            return None;
        }
        Some(LocatedRecord { header: Cow::Borrowed(&image[at..payload_at]), payload_at, end })
    }
}

/// Encodes a version 2 header (tests only: version 2 is never written any more).
#[cfg(test)]
pub fn encode(header: &RecordHeader, out: &mut Vec<u8>) -> u32 {
    let start = out.len();
    let entries = match &header.body {
        RecordBody::Write { fragments, .. } => fragments.len() * WRITE_ENTRY_BYTES,
        RecordBody::Relocate { entries } => entries.len() * RELOCATE_ENTRY_BYTES,
        RecordBody::Batch { entries } => entries.len() * BATCH_ENTRY_BYTES,
        _ => 0,
    };
    let header_len = HEADER_MIN_BYTES_V2 + entries;
    let mut w = super::Writer { buf: out };
    w.u32(RECORD_MAGIC_V2);
    w.u8(header.kind() as u8);
    w.u8(header.flags);
    w.u16(0);
    w.u64(header.seq);
    w.u32(header.prev_crc);
    w.u32(header.session);
    w.u32(header.store_tag);
    w.u32(header.encoded_len_v2() as u32);
    w.u32(header.payload_len);
    w.u32(header.payload_crc);
    let (lba, count) = match &header.body {
        RecordBody::Write { start_lba, fragments } => (start_lba.0, fragments.len() as u64),
        RecordBody::Trim { start_lba, block_count } | RecordBody::Zero { start_lba, block_count } => {
            (start_lba.0, *block_count)
        }
        RecordBody::Relocate { entries } => (0, entries.len() as u64),
        RecordBody::Batch { entries } => (0, entries.len() as u64),
        RecordBody::Checkpoint
        | RecordBody::Marker
        | RecordBody::MapPages { .. }
        | RecordBody::Link { .. }
        | RecordBody::Jump { .. } => {
            unreachable!("version 3 record kinds are never encoded in version 2")
        }
    };
    w.u64(lba);
    w.u32(count as u32);
    w.u32((count >> 32) as u32);
    match &header.body {
        RecordBody::Write { fragments, .. } => fragments.iter().for_each(|f| {
            w.u16(f.stored_len);
            w.u8(f.codec as u8);
        }),
        RecordBody::Relocate { entries } => entries.iter().for_each(|e| {
            w.u48(e.lba.0);
            w.u48(e.old_offset_bytes);
            w.u16(e.fragment.packed());
        }),
        RecordBody::Batch { entries } => entries.iter().for_each(|e| {
            w.u48(e.lba.0);
            w.u16(e.fragment.packed());
        }),
        _ => {}
    }
    let crc = crc32c::crc32c(&w.buf[start..]);
    w.u32(crc);
    debug_assert_eq!(out.len() - start, header_len);
    crc
}

#[cfg(test)]
impl RecordHeader {
    fn encoded_len_v2(&self) -> usize {
        let entries = match &self.body {
            RecordBody::Write { fragments, .. } => fragments.len() * WRITE_ENTRY_BYTES,
            RecordBody::Relocate { entries } => entries.len() * RELOCATE_ENTRY_BYTES,
            RecordBody::Batch { entries } => entries.len() * BATCH_ENTRY_BYTES,
            _ => 0,
        };
        HEADER_MIN_BYTES_V2 + entries
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::record::{FLAG_FIRST, FLAG_LAST};
    use crate::format::Writer;
    use proptest::prelude::*;

    #[test]
    fn record_header_round_trips() {
        let header = RecordHeader {
            version: RecordVersion::V2,
            durable_seq: 0,
            flags: FLAG_FIRST | FLAG_LAST,
            seq: 9,
            prev_crc: 1,
            session: 2,
            store_tag: 3,
            payload_len: 10,
            payload_crc: 4,
            nonce_epoch: 0,
            body: RecordBody::Write {
                start_lba: Lba(5),
                fragments: vec![
                    FragmentEntry { stored_len: 10, codec: CodecTag::Lz4 },
                    FragmentEntry { stored_len: 0, codec: CodecTag::Raw },
                ],
            },
        };
        let mut buf = Vec::new();
        let crc = encode(&header, &mut buf);
        assert_eq!(buf.len(), header.encoded_len_v2());
        assert_eq!(decode(&buf).unwrap(), (header, crc));
    }

    #[test]
    fn batch_and_relocate_records_round_trip_and_batches_keep_their_entries_after_the_payload() {
        let fragment = |stored_len, codec| FragmentEntry { stored_len, codec };
        let batch = RecordHeader {
            version: RecordVersion::V2,
            durable_seq: 0,
            flags: FLAG_FIRST | FLAG_LAST,
            seq: 9,
            prev_crc: 3,
            session: 4,
            store_tag: 5,
            payload_len: 4100 + 20,
            payload_crc: 0,
            nonce_epoch: 0,
            body: RecordBody::Batch {
                entries: vec![
                    BatchEntry { lba: Lba((1 << 48) - 1), fragment: fragment(4100, CodecTag::Raw) },
                    BatchEntry { lba: Lba(7), fragment: fragment(0, CodecTag::Raw) },
                    BatchEntry { lba: Lba(3), fragment: fragment(20, CodecTag::Deflate) },
                ],
            },
        };
        let relocate = RecordHeader {
            body: RecordBody::Relocate {
                entries: vec![RelocateEntry {
                    lba: Lba(12),
                    old_offset_bytes: crate::map::OFFSET_MAX,
                    old_format: FragmentFormat::V2,
                    fragment: fragment(2000, CodecTag::Zstd),
                }],
            },
            payload_len: 2000,
            ..batch.clone()
        };
        for header in [batch, relocate] {
            let mut contiguous = Vec::new();
            let crc = encode(&header, &mut contiguous);
            assert_eq!(decode(&contiguous).unwrap(), (header.clone(), crc));
            // As laid out in a segment: a batch's entries and CRC follow its payload.
            let payload = vec![0xa5u8; header.payload_len as usize];
            let mut image = vec![0u8; 100];
            let split = if header.kind() == RecordKind::Batch { FIXED_BYTES } else { contiguous.len() };
            image.extend_from_slice(&contiguous[..split]);
            image.extend_from_slice(&payload);
            image.extend_from_slice(&contiguous[split..]);
            let LocatedRecord { header: gathered, payload_at, end } = locate_record(&image, 100).unwrap();
            assert_eq!(&*gathered, &contiguous[..]);
            assert_eq!(&image[payload_at..payload_at + payload.len()], &payload[..]);
            assert_eq!(end, image.len());
            assert!(locate_record(&image[..image.len() - 1], 100).is_none(), "a cut record is not located");
        }
    }

    #[test]
    fn version_1_relocate_records_still_decode() {
        let old = crate::map::PackedEntry::stored(crate::map::Stored {
            offset_bytes: 5 << 20,
            stored_len: 2000,
            codec: CodecTag::Lz4,
            format: FragmentFormat::V2,
        });
        let mut buf = Vec::new();
        let mut w = Writer { buf: &mut buf };
        w.u32(RECORD_MAGIC_V2);
        w.u8(RecordKind::RelocateV1 as u8);
        w.u8(FLAG_FIRST | FLAG_LAST);
        w.u16(0);
        w.u64(9); // seq
        w.u32(1); // prev crc
        w.u32(2); // session
        w.u32(3); // store tag
        w.u32((FIXED_BYTES + RELOCATE_V1_ENTRY_BYTES + 4) as u32);
        w.u32(2000); // payload length
        w.u32(0); // payload crc
        w.u64(0);
        w.u64(1); // one entry
        w.u64(77); // lba
        w.u64(old.0);
        w.u16(2000);
        w.u8(CodecTag::Lz4 as u8);
        let crc = crc32c::crc32c(&buf);
        buf.extend_from_slice(&crc.to_le_bytes());
        let (header, _) = decode(&buf).unwrap();
        assert_eq!(
            header.body,
            RecordBody::Relocate {
                entries: vec![RelocateEntry {
                    lba: Lba(77),
                    old_offset_bytes: 5 << 20,
                    old_format: FragmentFormat::V2,
                    fragment: FragmentEntry { stored_len: 2000, codec: CodecTag::Lz4 }
                }]
            }
        );
    }

    proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]



    #[test]
    fn record_decoder_never_panics(mut bytes in proptest::collection::vec(any::<u8>(), 0..400), fix_magic: bool) {
        if fix_magic && bytes.len() >= 4 {
            bytes[..4].copy_from_slice(&RECORD_MAGIC_V2.to_le_bytes());
        }
        let _ = decode(&bytes);
    }

    #[test]
    fn record_decoder_rejects_mutations(index in 0usize..57, bit in 0u8..8) {
        let header = RecordHeader {
            version: RecordVersion::V2,
            durable_seq: 0,
            flags: FLAG_LAST, seq: 1, prev_crc: 0, session: 0, store_tag: 0, payload_len: 7, payload_crc: 0, nonce_epoch: 0,
            body: RecordBody::Write { start_lba: Lba(1), fragments: vec![FragmentEntry { stored_len: 7, codec: CodecTag::Zstd }, FragmentEntry { stored_len: 0, codec: CodecTag::Raw }, FragmentEntry { stored_len: 0, codec: CodecTag::Raw }] },
        };
        let mut buf = Vec::new();
        encode(&header, &mut buf);
        let index = index % buf.len();
        buf[index] ^= 1 << bit;
        prop_assert!(decode(&buf).is_err());
    }

        }
}
