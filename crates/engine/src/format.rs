//! On-disk structures, encoded and decoded field by field (little-endian). The byte maps are
//! in `docs/format.md`; keep the two in step. Every decoder checks lengths before it reads
//! and returns an error on any inconsistency: it must never panic on arbitrary bytes.

use std::borrow::Cow;

use crate::codec::CodecTag;
use crate::error::{Error, ErrorKind, Result};

/// 2: write-batch records (kind 6). Version 1 stores are read and upgraded when opened
/// for writing.
pub const FORMAT_VERSION: u32 = 2;
pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"ZDISKSB1";
pub const RECORD_MAGIC: u32 = 0x4345_525A; // "ZREC"
pub const CHECKPOINT_MAGIC: u64 = 0x3150_4B43_4B53_445A; // "ZDSKCKP1"

/// Each superblock slot is this big; slot 0 at offset 0, slot 1 right after it.
pub const SUPERBLOCK_SLOT_BYTES: usize = 16 << 10;
/// Segments start here (the superblock area is padded to 1 MiB for alignment).
pub const DATA_START_BYTES: u64 = 1 << 20;
const SUPERBLOCK_FIXED_BYTES: usize = 120;
const CHUNK_REF_BYTES: usize = 16;
pub const CHUNK_REFS_MAX: usize = (SUPERBLOCK_SLOT_BYTES - SUPERBLOCK_FIXED_BYTES - 4) / CHUNK_REF_BYTES;

/// Where one piece of a checkpoint lives: the payload of a `Checkpoint` record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRef {
    pub offset_bytes: u64,
    pub length_bytes: u32,
    pub crc: u32,
}

/// One superblock slot. The two slots hold the two newest checkpoints; the higher
/// `generation` with a valid CRC wins.
#[derive(Debug, Clone, PartialEq)]
pub struct Superblock {
    pub format_version: u32,
    pub uuid: [u8; 16],
    pub generation: u64,
    pub logical_size_bytes: u64,
    pub physical_size_bytes: u64,
    pub segment_size_bytes: u64,
    pub codec_tag: u8,
    pub codec_level: i32,
    pub feature_flags: u64,
    /// The last record sequence number the checkpoint covers (0: nothing written yet).
    pub checkpoint_seq: u64,
    /// Where the record with `checkpoint_seq + 1` is expected.
    pub replay_offset_bytes: u64,
    /// Header CRC of record `checkpoint_seq` (the chain anchor; 0 at format).
    pub replay_prev_crc: u32,
    pub checkpoint_chunks: Vec<ChunkRef>,
}

struct Writer<'a> {
    buf: &'a mut Vec<u8>,
}

impl Writer<'_> {
    fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    fn u48(&mut self, v: u64) {
        debug_assert!(v < 1 << 48);
        self.buf.extend_from_slice(&v.to_le_bytes()[..6]);
    }
    /// A fragment entry in two bytes: stored length (13 bits), codec tag (3 bits).
    fn fragment(&mut self, f: FragmentEntry) {
        debug_assert!(f.stored_len < 1 << 13 && (f.codec as u8) < 8);
        self.u16(f.stored_len | (f.codec as u16) << 13);
    }
}

/// A bounds-checked little-endian reader: running out of bytes is an error, not a panic.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { buf, pos: 0, what }
    }
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() - self.pos < n {
            return Err(Error::new(ErrorKind::Corrupt, format!("{} is truncated", self.what)));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.bytes(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.bytes(2)?.try_into().expect("2 bytes")))
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("4 bytes")))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("8 bytes")))
    }
    pub fn u48(&mut self) -> Result<u64> {
        let mut v = [0u8; 8];
        v[..6].copy_from_slice(self.bytes(6)?);
        Ok(u64::from_le_bytes(v))
    }
    fn fragment(&mut self) -> Result<FragmentEntry> {
        let packed = self.u16()?;
        Ok(FragmentEntry { stored_len: packed & 0x1fff, codec: CodecTag::from_u8((packed >> 13) as u8)? })
    }
    /// A record's entry list: `count` entries of `entry_bytes` each, which must be exactly
    /// what is left of the header.
    fn entries<T>(
        &mut self,
        count: u64,
        entry_bytes: usize,
        what: &'static str,
        mut read: impl FnMut(&mut Reader<'a>) -> Result<T>,
    ) -> Result<Vec<T>> {
        // (Checked: a header's count is whatever its bytes say.)
        if count.checked_mul(entry_bytes as u64) != Some(self.remaining() as u64) {
            return Err(corrupt(what));
        }
        (0..count).map(|_| read(self)).collect()
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
}

fn corrupt(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Corrupt, what)
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.checkpoint_chunks.len() <= CHUNK_REFS_MAX, "too many checkpoint chunks");
        let mut buf = Vec::with_capacity(SUPERBLOCK_SLOT_BYTES);
        buf.extend_from_slice(&SUPERBLOCK_MAGIC);
        let mut w = Writer { buf: &mut buf };
        w.u32(self.format_version);
        w.u32(SUPERBLOCK_SLOT_BYTES as u32);
        w.buf.extend_from_slice(&self.uuid);
        w.u64(self.generation);
        w.u64(self.logical_size_bytes);
        w.u64(self.physical_size_bytes);
        w.u64(self.segment_size_bytes);
        w.u8(self.codec_tag);
        w.u8(0);
        w.u16(0);
        w.u32(self.codec_level as u32);
        w.u64(self.feature_flags);
        w.u64(self.checkpoint_seq);
        w.u64(self.replay_offset_bytes);
        w.u32(self.replay_prev_crc);
        w.u32(self.checkpoint_chunks.len() as u32);
        w.u64(0); // reserved
        w.u64(0); // reserved
        debug_assert_eq!(w.buf.len(), SUPERBLOCK_FIXED_BYTES);
        for chunk in &self.checkpoint_chunks {
            w.u64(chunk.offset_bytes);
            w.u32(chunk.length_bytes);
            w.u32(chunk.crc);
        }
        buf.resize(SUPERBLOCK_SLOT_BYTES - 4, 0);
        let crc = crc32c::crc32c(&buf);
        buf.extend_from_slice(&crc.to_le_bytes());
        buf
    }

    /// Decodes one slot. A foreign magic is `NotAStore`; a newer version `NewerVersion`;
    /// anything else wrong is `Corrupt`.
    pub fn decode(slot: &[u8]) -> Result<Superblock> {
        if slot.len() < SUPERBLOCK_SLOT_BYTES || slot[..8] != SUPERBLOCK_MAGIC {
            return Err(Error::new(ErrorKind::NotAStore, "no zdisk superblock magic"));
        }
        let slot = &slot[..SUPERBLOCK_SLOT_BYTES];
        let stored_crc = u32::from_le_bytes(slot[SUPERBLOCK_SLOT_BYTES - 4..].try_into().expect("4 bytes"));
        if crc32c::crc32c(&slot[..SUPERBLOCK_SLOT_BYTES - 4]) != stored_crc {
            return Err(corrupt("superblock checksum mismatch"));
        }
        let mut r = Reader::new(&slot[8..], "superblock");
        let format_version = r.u32()?;
        if format_version > FORMAT_VERSION {
            return Err(Error::new(
                ErrorKind::NewerVersion,
                format!("format version {format_version}, this zdisk reads up to {FORMAT_VERSION}"),
            ));
        }
        if format_version == 0 {
            return Err(corrupt("format version 0"));
        }
        if r.u32()? as usize != SUPERBLOCK_SLOT_BYTES {
            return Err(corrupt("superblock size field"));
        }
        let uuid: [u8; 16] = r.bytes(16)?.try_into().expect("16 bytes");
        let generation = r.u64()?;
        let logical_size_bytes = r.u64()?;
        let physical_size_bytes = r.u64()?;
        let segment_size_bytes = r.u64()?;
        let codec_tag = r.u8()?;
        r.bytes(3)?;
        let codec_level = r.u32()? as i32;
        let feature_flags = r.u64()?;
        let checkpoint_seq = r.u64()?;
        let replay_offset_bytes = r.u64()?;
        let replay_prev_crc = r.u32()?;
        let chunk_count = r.u32()? as usize;
        r.bytes(16)?;
        if chunk_count > CHUNK_REFS_MAX {
            return Err(corrupt(format!("superblock lists {chunk_count} checkpoint chunks")));
        }
        let mut checkpoint_chunks = Vec::with_capacity(chunk_count);
        for _ in 0..chunk_count {
            checkpoint_chunks.push(ChunkRef { offset_bytes: r.u64()?, length_bytes: r.u32()?, crc: r.u32()? });
        }
        if feature_flags != 0 {
            return Err(Error::new(ErrorKind::NewerVersion, format!("unknown feature flags {feature_flags:#x}")));
        }
        CodecTag::from_u8(codec_tag)?;
        if segment_size_bytes == 0
            || segment_size_bytes % crate::SECTOR_SIZE as u64 != 0
            || logical_size_bytes % crate::BLOCK_SIZE as u64 != 0
            || physical_size_bytes < DATA_START_BYTES + segment_size_bytes
        {
            return Err(corrupt("superblock geometry is inconsistent"));
        }
        Ok(Superblock {
            format_version,
            uuid,
            generation,
            logical_size_bytes,
            physical_size_bytes,
            segment_size_bytes,
            codec_tag,
            codec_level,
            feature_flags,
            checkpoint_seq,
            replay_offset_bytes,
            replay_prev_crc,
            checkpoint_chunks,
        })
    }

    pub fn segment_count(&self) -> u64 {
        (self.physical_size_bytes - DATA_START_BYTES) / self.segment_size_bytes
    }
}

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

pub const FLAG_FIRST: u8 = 1;
pub const FLAG_LAST: u8 = 2;

/// Fixed part of a record header; entries follow, then the header CRC.
pub const RECORD_FIXED_BYTES: usize = 56;
pub const WRITE_ENTRY_BYTES: usize = 3;
/// A relocate entry: LBA (48 bits), old byte address (48 bits), fragment (16 bits).
pub const RELOCATE_ENTRY_BYTES: usize = 14;
const RELOCATE_V1_ENTRY_BYTES: usize = 19;
/// A batch entry: LBA (48 bits), then stored length (13 bits) and codec tag (3 bits).
pub const BATCH_ENTRY_BYTES: usize = 8;
/// LBAs a batch entry can hold (2^48 blocks: 1 EiB).
pub const BATCH_LBA_LIMIT: u64 = 1 << 48;
/// Each stored fragment starts with the CRC32C of its uncompressed block.
pub const FRAGMENT_CRC_BYTES: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FragmentEntry {
    /// Fragment bytes on disk including the CRC prefix; 0 for an all-zero block.
    pub stored_len: u16,
    pub codec: CodecTag,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelocateEntry {
    pub lba: u64,
    /// Where the fragment was: the map entry to replace is this address with the same
    /// stored length and codec.
    pub old_offset_bytes: u64,
    pub fragment: FragmentEntry,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchEntry {
    pub lba: u64,
    pub fragment: FragmentEntry,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordBody {
    Write { start_lba: u64, fragments: Vec<FragmentEntry> },
    Trim { start_lba: u64, block_count: u64 },
    Zero { start_lba: u64, block_count: u64 },
    Relocate { entries: Vec<RelocateEntry> },
    Checkpoint,
    Batch { entries: Vec<BatchEntry> },
}

impl RecordBody {
    /// The fragments a record's payload holds, in payload order, with the LBA each is for
    /// (empty for records without payload fragments).
    pub fn fragments(&self) -> Vec<(u64, FragmentEntry)> {
        match self {
            RecordBody::Write { start_lba, fragments } => {
                fragments.iter().enumerate().map(|(i, f)| (start_lba + i as u64, *f)).collect()
            }
            RecordBody::Relocate { entries } => entries.iter().map(|e| (e.lba, e.fragment)).collect(),
            RecordBody::Batch { entries } => entries.iter().map(|e| (e.lba, e.fragment)).collect(),
            RecordBody::Trim { .. } | RecordBody::Zero { .. } | RecordBody::Checkpoint => Vec::new(),
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
        match self.body {
            RecordBody::Write { .. } => RecordKind::Write,
            RecordBody::Trim { .. } => RecordKind::Trim,
            RecordBody::Zero { .. } => RecordKind::Zero,
            RecordBody::Relocate { .. } => RecordKind::Relocate,
            RecordBody::Checkpoint => RecordKind::Checkpoint,
            RecordBody::Batch { .. } => RecordKind::Batch,
        }
    }

    pub fn encoded_len(&self) -> usize {
        RECORD_FIXED_BYTES
            + match &self.body {
                RecordBody::Write { fragments, .. } => fragments.len() * WRITE_ENTRY_BYTES,
                RecordBody::Relocate { entries } => entries.len() * RELOCATE_ENTRY_BYTES,
                RecordBody::Batch { entries } => entries.len() * BATCH_ENTRY_BYTES,
                _ => 0,
            }
            + 4
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
        let (lba, count, entries) = match &self.body {
            RecordBody::Write { start_lba, fragments } => (*start_lba, fragments.len() as u64, fragments.len()),
            RecordBody::Trim { start_lba, block_count } | RecordBody::Zero { start_lba, block_count } => {
                (*start_lba, *block_count, 0)
            }
            RecordBody::Relocate { entries } => (0, entries.len() as u64, entries.len()),
            RecordBody::Batch { entries } => (0, entries.len() as u64, entries.len()),
            RecordBody::Checkpoint => (0, 0, 0),
        };
        let _ = entries;
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
                    w.u48(e.lba);
                    w.u48(e.old_offset_bytes);
                    w.fragment(e.fragment);
                }
            }
            RecordBody::Batch { entries } => {
                for e in entries {
                    w.u48(e.lba);
                    w.fragment(e.fragment);
                }
            }
            _ => {}
        }
        let crc = crc32c::crc32c(&w.buf[start..]);
        w.u32(crc);
        debug_assert_eq!(out.len() - start, header_len);
        crc
    }

    /// The header length claimed by the bytes at the start of `buf`, if it looks like a
    /// record at all (so the caller knows how much to read before `decode`).
    pub fn peek_len(buf: &[u8]) -> Option<usize> {
        if buf.len() < RECORD_FIXED_BYTES {
            return None;
        }
        let magic = u32::from_le_bytes(buf[0..4].try_into().ok()?);
        if magic != RECORD_MAGIC {
            return None;
        }
        let len = u32::from_le_bytes(buf[28..32].try_into().ok()?) as usize;
        (RECORD_FIXED_BYTES + 4..=RECORD_FIXED_BYTES + 4 + (1 << 24)).contains(&len).then_some(len)
    }

    /// Sequence number and store tag of what looks like a record header at the start of
    /// `buf`, without checking its CRC (a batch's CRC lies past its payload). Only for
    /// finding candidates; a record is trusted only after `locate_record` and `decode`.
    pub fn peek_identity(buf: &[u8]) -> Option<(u64, u32)> {
        RecordHeader::peek_len(buf)?;
        RecordKind::from_u8(buf[4]).ok()?;
        let seq = u64::from_le_bytes(buf[8..16].try_into().ok()?);
        let store_tag = u32::from_le_bytes(buf[24..28].try_into().ok()?);
        Some((seq, store_tag))
    }

    /// Decodes a header; returns it and its CRC. `buf` must hold at least the header.
    pub fn decode(buf: &[u8]) -> Result<(RecordHeader, u32)> {
        let header_len = RecordHeader::peek_len(buf).ok_or_else(|| corrupt("no record header"))?;
        if buf.len() < header_len {
            return Err(corrupt("record header is truncated"));
        }
        let stored_crc = u32::from_le_bytes(buf[header_len - 4..header_len].try_into().expect("4 bytes"));
        let crc = crc32c::crc32c(&buf[..header_len - 4]);
        if crc != stored_crc {
            return Err(corrupt("record header checksum mismatch"));
        }
        let mut r = Reader::new(&buf[..header_len - 4], "record header");
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
        let lba = r.u64()?;
        let count = r.u32()? as u64 | (r.u32()? as u64) << 32;
        let entry_bytes = r.remaining();
        let body = match kind {
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
                    let lba = r.u48()?;
                    let old_offset_bytes = r.u48()?;
                    let fragment = r.fragment()?;
                    Ok(RelocateEntry { lba, old_offset_bytes, fragment })
                })?;
                RecordBody::Relocate { entries }
            }
            RecordKind::RelocateV1 => {
                let entries = r.entries(count, RELOCATE_V1_ENTRY_BYTES, "relocate record entry count", |r| {
                    let lba = r.u64()?;
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
                    let lba = r.u48()?;
                    let fragment = r.fragment()?;
                    Ok(BatchEntry { lba, fragment })
                })?;
                RecordBody::Batch { entries }
            }
            RecordKind::Trim => RecordBody::Trim { start_lba: lba, block_count: count },
            RecordKind::Zero => RecordBody::Zero { start_lba: lba, block_count: count },
            RecordKind::Checkpoint => RecordBody::Checkpoint,
        };
        if !matches!(kind, RecordKind::Write | RecordKind::Relocate | RecordKind::RelocateV1 | RecordKind::Batch)
            && entry_bytes != 0
        {
            return Err(corrupt("record has entries it should not"));
        }
        let fragment_sum: u64 = match &body {
            RecordBody::Write { fragments, .. } => fragments.iter().map(|f| f.stored_len as u64).sum(),
            RecordBody::Relocate { entries } => entries.iter().map(|e| e.fragment.stored_len as u64).sum(),
            RecordBody::Batch { entries } => entries.iter().map(|e| e.fragment.stored_len as u64).sum(),
            _ => payload_len as u64,
        };
        if fragment_sum != payload_len as u64 {
            return Err(corrupt("record payload length disagrees with its entries"));
        }
        let header = RecordHeader { flags, seq, prev_crc, session, store_tag, payload_len, payload_crc, body };
        Ok((header, crc))
    }
}

/// Locates the record that starts at `at` in a segment image: its header bytes gathered
/// into one run for [`RecordHeader::decode`] (a batch keeps its entries and header CRC after
/// the payload), the payload's start and the record's end, as offsets into `image`. None
/// when the bytes there cannot be a record or it would run past the image. Nothing is
/// verified yet.
pub fn locate_record(image: &[u8], at: usize) -> Option<(Cow<'_, [u8]>, usize, usize)> {
    let head = image.get(at..)?;
    let header_len = RecordHeader::peek_len(head)?;
    let payload_len = u32::from_le_bytes(head[32..36].try_into().ok()?) as usize;
    if head[4] == RecordKind::Batch as u8 {
        let payload_at = at + RECORD_FIXED_BYTES;
        let trailer_at = payload_at.checked_add(payload_len)?;
        let end = trailer_at.checked_add(header_len - RECORD_FIXED_BYTES)?;
        if end > image.len() {
            return None;
        }
        let mut header = Vec::with_capacity(header_len);
        header.extend_from_slice(&image[at..payload_at]);
        header.extend_from_slice(&image[trailer_at..end]);
        Some((Cow::Owned(header), payload_at, end))
    } else {
        let payload_at = at + header_len;
        let end = payload_at.checked_add(payload_len)?;
        if end > image.len() {
            return None;
        }
        Some((Cow::Borrowed(&image[at..payload_at]), payload_at, end))
    }
}

/// A segment's state in the usage table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum SegmentState {
    Free = 0,
    /// Being appended to (at most one).
    Open = 1,
    Sealed = 2,
    /// Emptied by GC; reusable under the reuse rule (see `docs/space.md`): once no retained
    /// checkpoint's replay window reaches into it and the records that emptied it (up to
    /// `cleaned_seq`) are durable.
    Cleaned = 3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentUsage {
    pub state: SegmentState,
    /// Fragment bytes in this segment that the map references.
    pub live_bytes: u64,
    /// Bytes appended (records and padding).
    pub end_bytes: u64,
    /// Sequence number of the newest record in the segment (its age for GC).
    pub last_seq: u64,
    /// For `Cleaned`: the sequence number of the newest record appended when it was
    /// emptied; the segment is not reused before that record is durable.
    pub cleaned_seq: u64,
}

/// The checkpoint image: everything recovery needs besides the records after it.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub seq: u64,
    pub generation: u64,
    pub logical_size_bytes: u64,
    pub counters: [u64; crate::stats::COUNTER_COUNT],
    pub segments: Vec<SegmentUsage>,
    /// Non-unmapped map entries, ascending by LBA.
    pub map: Vec<(u64, u64)>,
}

impl Checkpoint {
    /// Serialized and zstd-compressed.
    pub fn encode(&self) -> Vec<u8> {
        let mut raw = Vec::with_capacity(64 + self.segments.len() * 33 + self.map.len() * 16);
        let mut w = Writer { buf: &mut raw };
        w.u64(CHECKPOINT_MAGIC);
        w.u64(self.seq);
        w.u64(self.generation);
        w.u64(self.logical_size_bytes);
        w.u32(self.counters.len() as u32);
        for c in self.counters {
            w.u64(c);
        }
        w.u64(self.segments.len() as u64);
        for s in &self.segments {
            w.u8(s.state as u8);
            w.u64(s.live_bytes);
            w.u64(s.end_bytes);
            w.u64(s.last_seq);
            w.u64(s.cleaned_seq);
        }
        w.u64(self.map.len() as u64);
        // Delta-coded LBAs compress far better than absolute ones.
        let mut prev_lba = 0;
        for &(lba, entry) in &self.map {
            w.u64(lba - prev_lba);
            w.u64(entry);
            prev_lba = lba;
        }
        zstd::bulk::compress(&raw, 1).expect("zstd compression of a memory buffer cannot fail")
    }

    pub fn decode(compressed: &[u8]) -> Result<Checkpoint> {
        let capacity_max = 1usize << 36;
        let mut raw = Vec::new();
        zstd::stream::copy_decode(compressed, &mut raw)
            .map_err(|e| corrupt(format!("checkpoint does not decompress: {e}")))?;
        if raw.len() > capacity_max {
            return Err(corrupt("checkpoint too large"));
        }
        let mut r = Reader::new(&raw, "checkpoint");
        if r.u64()? != CHECKPOINT_MAGIC {
            return Err(corrupt("checkpoint magic"));
        }
        let seq = r.u64()?;
        let generation = r.u64()?;
        let logical_size_bytes = r.u64()?;
        let counter_count = r.u32()? as usize;
        if counter_count != crate::stats::COUNTER_COUNT {
            return Err(corrupt(format!("checkpoint has {counter_count} counters")));
        }
        let mut counters = [0u64; crate::stats::COUNTER_COUNT];
        for c in counters.iter_mut() {
            *c = r.u64()?;
        }
        let segment_count = r.u64()?;
        if segment_count > r.remaining() as u64 / 33 {
            return Err(corrupt("checkpoint segment count"));
        }
        let mut segments = Vec::with_capacity(segment_count as usize);
        for _ in 0..segment_count {
            let state = match r.u8()? {
                0 => SegmentState::Free,
                1 => SegmentState::Open,
                2 => SegmentState::Sealed,
                3 => SegmentState::Cleaned,
                s => return Err(corrupt(format!("segment state {s}"))),
            };
            segments.push(SegmentUsage {
                state,
                live_bytes: r.u64()?,
                end_bytes: r.u64()?,
                last_seq: r.u64()?,
                cleaned_seq: r.u64()?,
            });
        }
        let map_len = r.u64()?;
        if map_len > r.remaining() as u64 / 16 {
            return Err(corrupt("checkpoint map length"));
        }
        let mut map = Vec::with_capacity(map_len as usize);
        let mut lba = 0u64;
        for i in 0..map_len {
            let delta = r.u64()?;
            if i > 0 && delta == 0 {
                return Err(corrupt("checkpoint map LBAs not ascending"));
            }
            lba = lba.checked_add(delta).ok_or_else(|| corrupt("checkpoint map LBA overflow"))?;
            map.push((lba, r.u64()?));
        }
        if r.remaining() != 0 {
            return Err(corrupt("checkpoint has trailing bytes"));
        }
        Ok(Checkpoint { seq, generation, logical_size_bytes, counters, segments, map })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample_superblock() -> Superblock {
        Superblock {
            format_version: FORMAT_VERSION,
            uuid: [7; 16],
            generation: 3,
            logical_size_bytes: 1 << 30,
            physical_size_bytes: 64 << 20,
            segment_size_bytes: 1 << 20,
            codec_tag: 1,
            codec_level: 0,
            feature_flags: 0,
            checkpoint_seq: 42,
            replay_offset_bytes: 5 << 20,
            replay_prev_crc: 99,
            checkpoint_chunks: vec![ChunkRef { offset_bytes: 2 << 20, length_bytes: 100, crc: 5 }],
        }
    }

    #[test]
    fn superblock_round_trips() {
        let sb = sample_superblock();
        assert_eq!(Superblock::decode(&sb.encode()).unwrap(), sb);
    }

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
                start_lba: 5,
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
    fn checkpoint_round_trips() {
        let cp = Checkpoint {
            seq: 1,
            generation: 2,
            logical_size_bytes: 4096 * 100,
            counters: [3; crate::stats::COUNTER_COUNT],
            segments: vec![SegmentUsage {
                state: SegmentState::Sealed,
                live_bytes: 5,
                end_bytes: 6,
                last_seq: 7,
                cleaned_seq: 0,
            }],
            map: vec![(0, 1), (5, 2), (99, 3)],
        };
        assert_eq!(Checkpoint::decode(&cp.encode()).unwrap(), cp);
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
                    BatchEntry { lba: (1 << 48) - 1, fragment: fragment(4100, CodecTag::Raw) },
                    BatchEntry { lba: 7, fragment: fragment(0, CodecTag::Raw) },
                    BatchEntry { lba: 3, fragment: fragment(20, CodecTag::Deflate) },
                ],
            },
        };
        let relocate = RecordHeader {
            body: RecordBody::Relocate {
                entries: vec![RelocateEntry {
                    lba: 12,
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
            let (gathered, payload_at, end) = locate_record(&image, 100).unwrap();
            assert_eq!(&*gathered, &contiguous[..]);
            assert_eq!(&image[payload_at..payload_at + payload.len()], &payload[..]);
            assert_eq!(end, image.len());
            assert!(locate_record(&image[..image.len() - 1], 100).is_none(), "a cut record is not located");
        }
    }

    #[test]
    fn version_1_relocate_records_still_decode() {
        let old = crate::map::pack_stored(crate::map::Stored {
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
        w.u64(old);
        w.u16(2000);
        w.u8(CodecTag::Lz4 as u8);
        let crc = crc32c::crc32c(&buf);
        buf.extend_from_slice(&crc.to_le_bytes());
        let (header, _) = RecordHeader::decode(&buf).unwrap();
        assert_eq!(
            header.body,
            RecordBody::Relocate {
                entries: vec![RelocateEntry {
                    lba: 77,
                    old_offset_bytes: 5 << 20,
                    fragment: FragmentEntry { stored_len: 2000, codec: CodecTag::Lz4 }
                }]
            }
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn superblock_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..SUPERBLOCK_SLOT_BYTES + 10)) {
            let _ = Superblock::decode(&bytes);
        }

        #[test]
        fn superblock_decoder_rejects_mutations(index in 0..SUPERBLOCK_SLOT_BYTES, bit in 0u8..8) {
            let mut bytes = sample_superblock().encode();
            bytes[index] ^= 1 << bit;
            prop_assert!(Superblock::decode(&bytes).is_err());
        }

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
                body: RecordBody::Write { start_lba: 1, fragments: vec![FragmentEntry { stored_len: 7, codec: CodecTag::Zstd }, FragmentEntry { stored_len: 0, codec: CodecTag::Raw }, FragmentEntry { stored_len: 0, codec: CodecTag::Raw }] },
            };
            let mut buf = Vec::new();
            header.encode(&mut buf);
            let index = index % buf.len();
            buf[index] ^= 1 << bit;
            prop_assert!(RecordHeader::decode(&buf).is_err());
        }

        #[test]
        fn checkpoint_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Checkpoint::decode(&bytes);
            // Also feed it valid zstd frames of garbage, which reach the field parser.
            let framed = zstd::bulk::compress(&bytes, 1).unwrap();
            let _ = Checkpoint::decode(&framed);
        }
    }
}
