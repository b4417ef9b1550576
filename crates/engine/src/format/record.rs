//! Log records: a header (fixed part, entries, CRC) and a payload of fragments
//! (`docs/format.md`, "Records"; the offsets below are that table's).
//!
//! Invariants: a decoded header's CRC matched; its entry count agrees with its length; the
//! fragment lengths its entries give add up to its payload length.

use std::borrow::Cow;

use super::{corrupt, u32_at, u64_at, Reader, Writer};
use crate::codec::CodecTag;
use crate::error::Result;
use crate::types::Lba;

pub const RECORD_MAGIC: u32 = 0x4345_525A; // "ZREC"

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
/// Fixed part of a record header; entries follow, then the header CRC.
pub const RECORD_FIXED_BYTES: usize = COUNT_OFFSET + 8;
const RECORD_CRC_BYTES: usize = 4;
/// The smallest header: the fixed part and the CRC (trim, zero, checkpoint-chunk records).
pub const RECORD_HEADER_MIN_BYTES: usize = RECORD_FIXED_BYTES + RECORD_CRC_BYTES;
/// The largest header length a record may claim (`peek_len` refuses more).
const RECORD_HEADER_MAX_BYTES: usize = RECORD_HEADER_MIN_BYTES + (1 << 24);

const _: () = assert!(RECORD_FIXED_BYTES == 56, "docs/format.md: the fixed header is 56 bytes");

/// Per block of a write record: stored length u16, codec u8.
pub const WRITE_ENTRY_BYTES: usize = 3;
/// A relocate entry: LBA (48 bits), old byte address (48 bits), fragment (16 bits).
pub const RELOCATE_ENTRY_BYTES: usize = 14;
const RELOCATE_V1_ENTRY_BYTES: usize = 19;
/// A batch entry: LBA (48 bits), then stored length (13 bits) and codec tag (3 bits).
pub const BATCH_ENTRY_BYTES: usize = 8;
/// LBAs a batch entry can hold (2^48 blocks: 1 EiB).
pub const BATCH_LBA_LIMIT: u64 = 1 << 48;

pub const FLAG_FIRST: u8 = 1;
pub const FLAG_LAST: u8 = 2;

/// What a record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RecordKind {
    /// Blocks `start_lba..start_lba+count`, one entry each (stored length, codec).
    Write = 1,
    /// Unmap `start_lba..start_lba+count`.
    Trim = 2,
    /// Map `start_lba..start_lba+count` to zero.
    Zero = 3,
    /// Version 1 GC copies (19-byte entries: lba, old map entry, stored length, codec); read
    /// from version 1 stores, never written.
    RelocateV1 = 4,
    /// A piece of a checkpoint; replay skips it.
    Checkpoint = 5,
    /// Small host writes gathered while buffered: entries (lba, stored length, codec), one
    /// per block, in any LBA order. Its entries and header CRC follow the payload (see
    /// `docs/format.md`), so the record can grow in memory until it is closed.
    Batch = 6,
    /// GC copies: entries (lba, old address, fragment), applied only where the map still
    /// holds the old entry.
    Relocate = 7,
}

impl RecordKind {
    fn from_u8(v: u8) -> Result<RecordKind> {
        Ok(match v {
            1 => RecordKind::Write,
            2 => RecordKind::Trim,
            3 => RecordKind::Zero,
            4 => RecordKind::RelocateV1,
            5 => RecordKind::Checkpoint,
            6 => RecordKind::Batch,
            7 => RecordKind::Relocate,
            _ => return Err(corrupt(format!("unknown record kind {v}"))),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FragmentEntry {
    /// Fragment bytes on disk including the CRC prefix; 0 for an all-zero block.
    pub stored_len: u16,
    pub codec: CodecTag,
}

impl FragmentEntry {
    /// The entry of an all-zero block: no bytes stored.
    pub const ZERO_BLOCK: FragmentEntry = FragmentEntry { stored_len: 0, codec: CodecTag::Raw };
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelocateEntry {
    pub lba: Lba,
    /// Where the fragment was: the map entry to replace is this address with the same
    /// stored length and codec.
    pub old_offset_bytes: u64,
    pub fragment: FragmentEntry,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchEntry {
    pub lba: Lba,
    pub fragment: FragmentEntry,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordBody {
    Write { start_lba: Lba, fragments: Vec<FragmentEntry> },
    Trim { start_lba: Lba, block_count: u64 },
    Zero { start_lba: Lba, block_count: u64 },
    Relocate { entries: Vec<RelocateEntry> },
    Checkpoint,
    Batch { entries: Vec<BatchEntry> },
}

impl RecordBody {
    /// The fragments a record's payload holds, in payload order, with the LBA each is for
    /// (none for records without payload fragments).
    pub fn fragments(&self) -> Vec<(Lba, FragmentEntry)> {
        match self {
            RecordBody::Write { start_lba, fragments } => {
                fragments.iter().enumerate().map(|(i, f)| (start_lba.plus(i as u64), *f)).collect()
            }
            RecordBody::Relocate { entries } => entries.iter().map(|e| (e.lba, e.fragment)).collect(),
            RecordBody::Batch { entries } => entries.iter().map(|e| (e.lba, e.fragment)).collect(),
            RecordBody::Trim { .. } | RecordBody::Zero { .. } | RecordBody::Checkpoint => Vec::new(),
        }
    }

    fn kind(&self) -> RecordKind {
        match self {
            RecordBody::Write { .. } => RecordKind::Write,
            RecordBody::Trim { .. } => RecordKind::Trim,
            RecordBody::Zero { .. } => RecordKind::Zero,
            RecordBody::Relocate { .. } => RecordKind::Relocate,
            RecordBody::Checkpoint => RecordKind::Checkpoint,
            RecordBody::Batch { .. } => RecordKind::Batch,
        }
    }

    /// Entry bytes this body adds to the header.
    fn entry_bytes(&self) -> usize {
        match self {
            RecordBody::Write { fragments, .. } => fragments.len() * WRITE_ENTRY_BYTES,
            RecordBody::Relocate { entries } => entries.len() * RELOCATE_ENTRY_BYTES,
            RecordBody::Batch { entries } => entries.len() * BATCH_ENTRY_BYTES,
            RecordBody::Trim { .. } | RecordBody::Zero { .. } | RecordBody::Checkpoint => 0,
        }
    }

    /// The fixed header's start LBA and count fields.
    fn lba_and_count(&self) -> (u64, u64) {
        match self {
            RecordBody::Write { start_lba, fragments } => (start_lba.0, fragments.len() as u64),
            RecordBody::Trim { start_lba, block_count } | RecordBody::Zero { start_lba, block_count } => {
                (start_lba.0, *block_count)
            }
            RecordBody::Relocate { entries } => (0, entries.len() as u64),
            RecordBody::Batch { entries } => (0, entries.len() as u64),
            RecordBody::Checkpoint => (0, 0),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordHeader {
    pub flags: u8,
    pub seq: u64,
    pub prev_crc: u32,
    /// Random per open of the store: a stale record left by an earlier run never chains.
    pub session: u32,
    pub store_tag: u32,
    pub payload_len: u32,
    pub payload_crc: u32,
    pub body: RecordBody,
}

impl RecordHeader {
    pub fn kind(&self) -> RecordKind {
        self.body.kind()
    }

    pub fn encoded_len(&self) -> usize {
        RECORD_HEADER_MIN_BYTES + self.body.entry_bytes()
    }

    /// Encodes into `out` and returns the header CRC (the next record's `prev_crc`).
    pub fn encode(&self, out: &mut Vec<u8>) -> u32 {
        let start = out.len();
        let header_len = self.encoded_len();
        let mut w = Writer { buf: out };
        w.u32(RECORD_MAGIC);
        w.u8(self.kind() as u8);
        w.u8(self.flags);
        w.u16(0);
        w.u64(self.seq);
        w.u32(self.prev_crc);
        w.u32(self.session);
        w.u32(self.store_tag);
        w.u32(header_len as u32);
        w.u32(self.payload_len);
        w.u32(self.payload_crc);
        let (lba, count) = self.body.lba_and_count();
        w.u64(lba);
        w.u32(count as u32);
        w.u32((count >> 32) as u32);
        debug_assert_eq!(w.buf.len() - start, RECORD_FIXED_BYTES);
        match &self.body {
            RecordBody::Write { fragments, .. } => {
                for f in fragments {
                    w.u16(f.stored_len);
                    w.u8(f.codec as u8);
                }
            }
            RecordBody::Relocate { entries } => {
                for e in entries {
                    w.u48(e.lba.0);
                    w.u48(e.old_offset_bytes);
                    w.fragment(e.fragment);
                }
            }
            RecordBody::Batch { entries } => {
                for e in entries {
                    w.u48(e.lba.0);
                    w.fragment(e.fragment);
                }
            }
            RecordBody::Trim { .. } | RecordBody::Zero { .. } | RecordBody::Checkpoint => {}
        }
        let crc = crc32c::crc32c(&w.buf[start..]);
        w.u32(crc);
        debug_assert_eq!(out.len() - start, header_len);
        crc
    }

    /// The header length claimed by the bytes at the start of `buf`, if it looks like a
    /// record at all (so the caller knows how much to read before `decode`).
    pub fn peek_len(buf: &[u8]) -> Option<usize> {
        if buf.len() < RECORD_FIXED_BYTES || u32_at(buf, MAGIC_OFFSET) != RECORD_MAGIC {
            return None;
        }
        let len = u32_at(buf, HEADER_LEN_OFFSET) as usize;
        (RECORD_HEADER_MIN_BYTES..=RECORD_HEADER_MAX_BYTES).contains(&len).then_some(len)
    }

    /// Sequence number and store tag of what looks like a record header at the start of
    /// `buf`, without checking its CRC (a batch's CRC lies past its payload). Only for
    /// finding candidates; a record is trusted only after `locate_record` and `decode`.
    pub fn peek_identity(buf: &[u8]) -> Option<(u64, u32)> {
        RecordHeader::peek_len(buf)?;
        RecordKind::from_u8(buf[KIND_OFFSET]).ok()?;
        Some((u64_at(buf, SEQ_OFFSET), u32_at(buf, STORE_TAG_OFFSET)))
    }

    /// Decodes a header; returns it and its CRC. `buf` must hold at least the header.
    pub fn decode(buf: &[u8]) -> Result<(RecordHeader, u32)> {
        let header_len = RecordHeader::peek_len(buf).ok_or_else(|| corrupt("no record header"))?;
        if buf.len() < header_len {
            return Err(corrupt("record header is truncated"));
        }
        let crc_at = header_len - RECORD_CRC_BYTES;
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
        let fragment_sum: u64 = match &body {
            RecordBody::Write { .. } | RecordBody::Relocate { .. } | RecordBody::Batch { .. } => {
                body.fragments().iter().map(|(_, f)| f.stored_len as u64).sum()
            }
            RecordBody::Trim { .. } | RecordBody::Zero { .. } | RecordBody::Checkpoint => payload_len as u64,
        };
        if fragment_sum != payload_len as u64 {
            return Err(corrupt("record payload length disagrees with its entries"));
        }
        let header = RecordHeader { flags, seq, prev_crc, session, store_tag, payload_len, payload_crc, body };
        Ok((header, crc))
    }
}

/// The entries of a record of `kind`, which must be exactly what `r` has left.
fn decode_body(kind: RecordKind, lba: Lba, count: u64, r: &mut Reader<'_>) -> Result<RecordBody> {
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
                Ok(RelocateEntry { lba: Lba(r.u48()?), old_offset_bytes: r.u48()?, fragment: r.fragment()? })
            })?;
            RecordBody::Relocate { entries }
        }
        RecordKind::RelocateV1 => {
            let entries = r.entries(count, RELOCATE_V1_ENTRY_BYTES, "relocate record entry count", |r| {
                let lba = Lba(r.u64()?);
                let old = crate::map::unpack(r.u64()?)?;
                let stored_len = r.u16()?;
                let codec = CodecTag::from_u8(r.u8()?)?;
                let crate::map::Entry::Stored(old) = old else {
                    return Err(corrupt("relocate entry of a block that was not stored"));
                };
                Ok(RelocateEntry {
                    lba,
                    old_offset_bytes: old.offset_bytes,
                    fragment: FragmentEntry { stored_len, codec },
                })
            })?;
            RecordBody::Relocate { entries }
        }
        RecordKind::Batch => {
            let entries = r.entries(count, BATCH_ENTRY_BYTES, "batch record entry count", |r| {
                Ok(BatchEntry { lba: Lba(r.u48()?), fragment: r.fragment()? })
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
    })
}

/// A record found in a segment image by [`locate_record`]: its header bytes gathered into
/// one run for [`RecordHeader::decode`] (a batch keeps its entries and header CRC after the
/// payload), and where its payload starts and the record ends, as offsets into the image.
pub struct LocatedRecord<'a> {
    pub header: Cow<'a, [u8]>,
    pub payload_at: usize,
    pub end: usize,
}

/// Locates the record that starts at `at` in a segment image. None when the bytes there
/// cannot be a record or it would run past the image. Nothing is verified yet.
pub fn locate_record(image: &[u8], at: usize) -> Option<LocatedRecord<'_>> {
    let head = image.get(at..)?;
    let header_len = RecordHeader::peek_len(head)?;
    let payload_len = u32_at(head, PAYLOAD_LEN_OFFSET) as usize;
    if head[KIND_OFFSET] == RecordKind::Batch as u8 {
        let payload_at = at + RECORD_FIXED_BYTES;
        let trailer_at = payload_at.checked_add(payload_len)?;
        let end = trailer_at.checked_add(header_len - RECORD_FIXED_BYTES)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn record_header_round_trips() {
        let header = RecordHeader {
            flags: FLAG_FIRST | FLAG_LAST,
            seq: 9,
            prev_crc: 1,
            session: 2,
            store_tag: 3,
            payload_len: 10,
            payload_crc: 4,
            body: RecordBody::Write {
                start_lba: Lba(5),
                fragments: vec![
                    FragmentEntry { stored_len: 10, codec: CodecTag::Lz4 },
                    FragmentEntry { stored_len: 0, codec: CodecTag::Raw },
                ],
            },
        };
        let mut buf = Vec::new();
        let crc = header.encode(&mut buf);
        assert_eq!(buf.len(), header.encoded_len());
        assert_eq!(RecordHeader::decode(&buf).unwrap(), (header, crc));
    }

    #[test]
    fn batch_and_relocate_records_round_trip_and_batches_keep_their_entries_after_the_payload() {
        let fragment = |stored_len, codec| FragmentEntry { stored_len, codec };
        let batch = RecordHeader {
            flags: FLAG_FIRST | FLAG_LAST,
            seq: 9,
            prev_crc: 3,
            session: 4,
            store_tag: 5,
            payload_len: 4100 + 20,
            payload_crc: 0,
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
                    fragment: fragment(2000, CodecTag::Zstd),
                }],
            },
            payload_len: 2000,
            ..batch.clone()
        };
        for header in [batch, relocate] {
            let mut contiguous = Vec::new();
            let crc = header.encode(&mut contiguous);
            assert_eq!(RecordHeader::decode(&contiguous).unwrap(), (header.clone(), crc));
            // As laid out in a segment: a batch's entries and CRC follow its payload.
            let payload = vec![0xa5u8; header.payload_len as usize];
            let mut image = vec![0u8; 100];
            let split = if header.kind() == RecordKind::Batch { RECORD_FIXED_BYTES } else { contiguous.len() };
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
        });
        let mut buf = Vec::new();
        let mut w = Writer { buf: &mut buf };
        w.u32(RECORD_MAGIC);
        w.u8(RecordKind::RelocateV1 as u8);
        w.u8(FLAG_FIRST | FLAG_LAST);
        w.u16(0);
        w.u64(9); // seq
        w.u32(1); // prev crc
        w.u32(2); // session
        w.u32(3); // store tag
        w.u32((RECORD_FIXED_BYTES + RELOCATE_V1_ENTRY_BYTES + 4) as u32);
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
        let (header, _) = RecordHeader::decode(&buf).unwrap();
        assert_eq!(
            header.body,
            RecordBody::Relocate {
                entries: vec![RelocateEntry {
                    lba: Lba(77),
                    old_offset_bytes: 5 << 20,
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
            bytes[..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        }
        let _ = RecordHeader::decode(&bytes);
    }

    #[test]
    fn record_decoder_rejects_mutations(index in 0usize..57, bit in 0u8..8) {
        let header = RecordHeader {
            flags: FLAG_LAST, seq: 1, prev_crc: 0, session: 0, store_tag: 0, payload_len: 7, payload_crc: 0,
            body: RecordBody::Write { start_lba: Lba(1), fragments: vec![FragmentEntry { stored_len: 7, codec: CodecTag::Zstd }, FragmentEntry { stored_len: 0, codec: CodecTag::Raw }, FragmentEntry { stored_len: 0, codec: CodecTag::Raw }] },
        };
        let mut buf = Vec::new();
        header.encode(&mut buf);
        let index = index % buf.len();
        buf[index] ^= 1 << bit;
        prop_assert!(RecordHeader::decode(&buf).is_err());
    }

        }
}
