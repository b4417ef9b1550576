//! Log records, version 3 (`docs/format.md`, "Records"; the offsets below are that table's).
//!
//! A record is a 64-byte head, its payload, and a tail: the record's entries, a byte-for-byte
//! copy of the head, and a CRC over both. Each of head and tail is enough to know what the
//! record did and where it ends, and the payload's fragments carry their own protection
//! information (`fragment.rs`), a third description of a data record. One damaged copy
//! never loses what a record wrote.
//!
//! The head's CRC is the record's chain value: the next record carries it as `prev_crc`.
//!
//! Invariants of a decoded record: its head (or the tail's copy of it) passed its CRC; the
//! tail's entry count agrees with the head; the fragment lengths the entries give add up to
//! the payload length.

use super::fragment::{FragmentEntry, FragmentFormat};
use super::{corrupt, u32_at, u64_at, Reader, Writer};
use crate::error::Result;
use crate::types::Lba;

/// "ZRC3": the magic of a version 3 record head.
pub const RECORD_MAGIC: u32 = 0x3343_525A;

const MAGIC_OFFSET: usize = 0;
const KIND_OFFSET: usize = MAGIC_OFFSET + 4;
const FLAGS_OFFSET: usize = KIND_OFFSET + 1;
const EPOCH_OFFSET: usize = FLAGS_OFFSET + 1;
const SEQ_OFFSET: usize = EPOCH_OFFSET + 2;
const DURABLE_SEQ_OFFSET: usize = SEQ_OFFSET + 8;
const START_LBA_OFFSET: usize = DURABLE_SEQ_OFFSET + 8;
const COUNT_OFFSET: usize = START_LBA_OFFSET + 8;
const PREV_CRC_OFFSET: usize = COUNT_OFFSET + 8;
const SESSION_OFFSET: usize = PREV_CRC_OFFSET + 4;
const STORE_TAG_OFFSET: usize = SESSION_OFFSET + 4;
const PAYLOAD_LEN_OFFSET: usize = STORE_TAG_OFFSET + 4;
const PAYLOAD_CRC_OFFSET: usize = PAYLOAD_LEN_OFFSET + 4;
const HEAD_CRC_OFFSET: usize = PAYLOAD_CRC_OFFSET + 4;
/// The head: fixed fields and their CRC.
pub const HEAD_BYTES: usize = HEAD_CRC_OFFSET + 4;
/// The tail after its entries: the head's copy and the tail CRC.
pub const TAIL_FIXED_BYTES: usize = HEAD_BYTES + 4;
/// A record without payload or entries (trim, zero, marker).
pub const RECORD_MIN_BYTES: usize = HEAD_BYTES + TAIL_FIXED_BYTES;

const _: () = assert!(HEAD_BYTES == 64, "docs/format.md: the head is 64 bytes");

/// The most blocks the log puts in one write record, so headers stay small (a writer's
/// limit, not the format's: a reader takes any count whose entries fit the record).
pub const RECORD_BLOCKS_MAX: usize = 512;

/// Per block of a write record: fragment u16.
pub const WRITE_ENTRY_BYTES: usize = 2;
/// A batch entry: LBA u48, fragment u16.
pub const BATCH_ENTRY_BYTES: usize = 8;
/// A relocate entry: LBA u48, old byte address u48 (bit 47: the old copy was a version 2
/// fragment), fragment u16. A relocation's tail holds its entries twice, each copy with its
/// own CRC: the old addresses are nowhere else, and replay must not lose a relocation (it
/// may be what let its victim segment be reused).
pub const RELOCATE_ENTRY_BYTES: usize = 14;
/// Set in a relocate entry's old address: the copy converted a version 2 fragment.
const OLD_WAS_V2_BIT: u64 = 1 << 47;
/// LBAs an entry can hold (2^48 blocks: 1 EiB).
pub const BATCH_LBA_LIMIT: u64 = 1 << 48;

pub const FLAG_FIRST: u8 = 1;
pub const FLAG_LAST: u8 = 2;
/// The tail carries a MAC over the head and the entries (every record of an encrypted
/// store, and only those): `entries | MAC | head copy | CRC`.
pub const FLAG_MAC: u8 = 4;
/// An encrypted store's record MAC: HMAC-SHA-256 under the metadata key, truncated.
pub const RECORD_MAC_BYTES: usize = 12;
/// Computes a record's MAC over its parts (the store: `StoreCipher::mac`).
pub type RecordMacFn<'a> = &'a dyn Fn(&[&[u8]]) -> [u8; RECORD_MAC_BYTES];
/// Checks a MAC against parts (the store: `StoreCipher::verify_mac`).
pub type RecordVerifyFn<'a> = &'a dyn Fn(&[&[u8]], &[u8]) -> bool;

/// What a record's MAC covers after the store UUID (which the cipher prepends): a domain
/// string, the head's 64 bytes, the tail's entries area.
pub fn record_mac_parts<'a>(head: &'a [u8], entries: &'a [u8]) -> [&'a [u8]; 3] {
    [b"zdisk record v1", head, entries]
}

/// What a record says. Kinds 1–7 are version 2's (`record_v2.rs`); 8 on are version 3's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RecordKind {
    Write = 1,
    Trim = 2,
    Zero = 3,
    /// Version 1 GC copies; read from version 1 stores, never written.
    RelocateV1 = 4,
    Checkpoint = 5,
    Batch = 6,
    Relocate = 7,
    /// Carries only its head: everything up to `durable_seq` was durable when it was
    /// written, which proves the records before it were not torn (written when the store
    /// goes idle after a flush).
    Marker = 8,
    /// Map pages a checkpoint wrote: entries like a batch's, with a page id where a batch
    /// has an LBA (`map::page`).
    MapPages = 9,
    /// The first record of every segment: which segment the log continues in after this
    /// one (the start LBA field; all ones if none was free). Recovery follows it instead of
    /// reading every segment's start.
    Link = 10,
    /// The log goes on elsewhere: the next record is at the byte address in the start LBA
    /// field (in another open segment: host writes and GC's relocations fill different
    /// segments, so data of different ages dies in different segments).
    Jump = 11,
}

/// A link record's "no segment was free when this one opened".
pub const LINK_NONE: u64 = u64::MAX;

impl RecordKind {
    pub fn from_u8(v: u8) -> Result<RecordKind> {
        Ok(match v {
            1 => RecordKind::Write,
            2 => RecordKind::Trim,
            3 => RecordKind::Zero,
            4 => RecordKind::RelocateV1,
            5 => RecordKind::Checkpoint,
            6 => RecordKind::Batch,
            7 => RecordKind::Relocate,
            8 => RecordKind::Marker,
            9 => RecordKind::MapPages,
            10 => RecordKind::Link,
            11 => RecordKind::Jump,
            _ => return Err(corrupt(format!("unknown record kind {v}"))),
        })
    }

    /// Entry bytes per entry in a version 3 tail.
    fn entry_bytes(self) -> usize {
        match self {
            RecordKind::Write => WRITE_ENTRY_BYTES,
            RecordKind::Batch | RecordKind::MapPages => BATCH_ENTRY_BYTES,
            RecordKind::Relocate => RELOCATE_ENTRY_BYTES,
            _ => 0,
        }
    }

    /// Bytes of a version 3 tail's entries area for `count` entries (a relocation's two
    /// copies each carry a CRC).
    fn entries_area_bytes(self, count: usize) -> Option<usize> {
        let one = count.checked_mul(self.entry_bytes())?;
        Some(if self == RecordKind::Relocate { 2 * (one + 4) } else { one })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordVersion {
    V2,
    V3,
}

impl RecordVersion {
    /// The format of the fragments in such a record's payload.
    pub fn fragment_format(self) -> FragmentFormat {
        match self {
            RecordVersion::V2 => FragmentFormat::V2,
            RecordVersion::V3 => FragmentFormat::V3,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelocateEntry {
    pub lba: Lba,
    /// Where the fragment was: the map entry to replace is this address with the old
    /// fragment's length and codec (the same, or 8 bytes shorter for a converted version 2
    /// fragment).
    pub old_offset_bytes: u64,
    pub old_format: FragmentFormat,
    pub fragment: FragmentEntry,
}

impl RelocateEntry {
    /// The fragment entry the old copy had, for a copy of format `new_format` (the
    /// record's). A version 2 fragment converted to version 3 grew by 8 bytes of PI.
    pub fn old_fragment(&self, new_format: FragmentFormat) -> FragmentEntry {
        match (self.old_format, new_format) {
            (old, new) if old == new => self.fragment,
            _ => FragmentEntry {
                stored_len: self.fragment.stored_len
                    - (super::fragment::PI_BYTES - super::fragment::V2_PREFIX_BYTES) as u16,
                ..self.fragment
            },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchEntry {
    pub lba: Lba,
    pub fragment: FragmentEntry,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordBody {
    Write {
        start_lba: Lba,
        fragments: Vec<FragmentEntry>,
    },
    Trim {
        start_lba: Lba,
        block_count: u64,
    },
    Zero {
        start_lba: Lba,
        block_count: u64,
    },
    Relocate {
        entries: Vec<RelocateEntry>,
    },
    Checkpoint,
    Batch {
        entries: Vec<BatchEntry>,
    },
    Marker,
    /// Map page fragments; each entry's `lba` is the page's id as a tag (`PageId::tag`).
    MapPages {
        entries: Vec<BatchEntry>,
    },
    Link {
        next_segment: Option<u32>,
    },
    Jump {
        next_record_bytes: u64,
    },
}

impl RecordBody {
    /// The data fragments a record's payload holds, in payload order, with the LBA each is
    /// for (none for records without them; map pages are not data, see
    /// [`RecordBody::payload_fragments`]).
    pub fn fragments(&self) -> Vec<(Lba, FragmentEntry)> {
        match self {
            RecordBody::MapPages { .. } => Vec::new(),
            _ => self.payload_fragments(),
        }
    }

    /// Every fragment in the payload, data or map page, with its LBA or page tag.
    pub fn payload_fragments(&self) -> Vec<(Lba, FragmentEntry)> {
        match self {
            RecordBody::Write { start_lba, fragments } => {
                fragments.iter().enumerate().map(|(i, f)| (start_lba.plus(i as u64), *f)).collect()
            }
            RecordBody::Relocate { entries } => entries.iter().map(|e| (e.lba, e.fragment)).collect(),
            RecordBody::Batch { entries } | RecordBody::MapPages { entries } => {
                entries.iter().map(|e| (e.lba, e.fragment)).collect()
            }
            RecordBody::Trim { .. }
            | RecordBody::Zero { .. }
            | RecordBody::Checkpoint
            | RecordBody::Marker
            | RecordBody::Link { .. }
            | RecordBody::Jump { .. } => Vec::new(),
        }
    }

    /// Records that change no map entry when applied (the log's own bookkeeping).
    pub fn maps_nothing(&self) -> bool {
        matches!(
            self,
            RecordBody::Checkpoint
                | RecordBody::Marker
                | RecordBody::MapPages { .. }
                | RecordBody::Link { .. }
                | RecordBody::Jump { .. }
        )
    }

    pub fn kind(&self) -> RecordKind {
        match self {
            RecordBody::Write { .. } => RecordKind::Write,
            RecordBody::Trim { .. } => RecordKind::Trim,
            RecordBody::Zero { .. } => RecordKind::Zero,
            RecordBody::Relocate { .. } => RecordKind::Relocate,
            RecordBody::Checkpoint => RecordKind::Checkpoint,
            RecordBody::Batch { .. } => RecordKind::Batch,
            RecordBody::Marker => RecordKind::Marker,
            RecordBody::MapPages { .. } => RecordKind::MapPages,
            RecordBody::Link { .. } => RecordKind::Link,
            RecordBody::Jump { .. } => RecordKind::Jump,
        }
    }

    /// The head's start LBA and count fields.
    fn lba_and_count(&self) -> (Lba, u64) {
        match self {
            RecordBody::Write { start_lba, fragments } => (*start_lba, fragments.len() as u64),
            RecordBody::Trim { start_lba, block_count } | RecordBody::Zero { start_lba, block_count } => {
                (*start_lba, *block_count)
            }
            RecordBody::Relocate { entries } => (Lba(0), entries.len() as u64),
            RecordBody::Batch { entries } | RecordBody::MapPages { entries } => (Lba(0), entries.len() as u64),
            RecordBody::Checkpoint | RecordBody::Marker => (Lba(0), 0),
            RecordBody::Link { next_segment } => (Lba(next_segment.map_or(LINK_NONE, u64::from)), 0),
            RecordBody::Jump { next_record_bytes } => (Lba(*next_record_bytes), 0),
        }
    }

    /// Sum of the payload fragments' stored lengths (the payload length of a record that
    /// carries fragments).
    pub fn fragment_bytes(&self) -> u64 {
        self.payload_fragments().iter().map(|(_, f)| f.stored_len as u64).sum()
    }

    fn encode_entries(&self, w: &mut Writer<'_>) {
        match self {
            RecordBody::Write { fragments, .. } => fragments.iter().for_each(|f| w.u16(f.packed())),
            RecordBody::Batch { entries } | RecordBody::MapPages { entries } => entries.iter().for_each(|e| {
                w.u48(e.lba.0);
                w.u16(e.fragment.packed());
            }),
            RecordBody::Relocate { entries } => {
                let mut one = Vec::with_capacity(entries.len() * RELOCATE_ENTRY_BYTES + 4);
                let mut copy = Writer { buf: &mut one };
                for e in entries {
                    assert!(e.old_offset_bytes < OLD_WAS_V2_BIT);
                    let flag = if e.old_format == FragmentFormat::V2 { OLD_WAS_V2_BIT } else { 0 };
                    copy.u48(e.lba.0);
                    copy.u48(e.old_offset_bytes | flag);
                    copy.u16(e.fragment.packed());
                }
                let crc = crc32c::crc32c(&one);
                one.extend_from_slice(&crc.to_le_bytes());
                w.buf.extend_from_slice(&one);
                w.buf.extend_from_slice(&one);
            }
            RecordBody::Trim { .. }
            | RecordBody::Zero { .. }
            | RecordBody::Checkpoint
            | RecordBody::Marker
            | RecordBody::Link { .. }
            | RecordBody::Jump { .. } => {}
        }
    }
}

/// A record's header: what its head (version 3) or header (version 2) says, with the body
/// its entries make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordHeader {
    pub version: RecordVersion,
    pub flags: u8,
    pub seq: u64,
    /// Everything up to this sequence number was durable when the record was appended
    /// (version 3; 0 in version 2 records).
    pub durable_seq: u64,
    pub prev_crc: u32,
    /// Random per open of the store: a stale record left by an earlier run never chains.
    pub session: u32,
    pub store_tag: u32,
    pub payload_len: u32,
    pub payload_crc: u32,
    /// The nonce epoch of its segment's use (a short-nonce store; 0 otherwise and in
    /// version 2): the high bits of its sealed fragments' nonces.
    pub nonce_epoch: u16,
    pub body: RecordBody,
}

/// A version 3 head as decoded, before its entries are known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub kind: RecordKind,
    pub flags: u8,
    pub seq: u64,
    pub durable_seq: u64,
    pub start_lba: Lba,
    pub count: u64,
    pub prev_crc: u32,
    pub session: u32,
    pub store_tag: u32,
    pub payload_len: u32,
    pub payload_crc: u32,
    pub nonce_epoch: u16,
    /// The head's CRC: the record's chain value.
    pub crc: u32,
}

impl Head {
    /// Decodes a head (or a tail's copy of one) and checks its CRC.
    pub fn decode(bytes: &[u8]) -> Result<Head> {
        if bytes.len() < HEAD_BYTES || u32_at(bytes, MAGIC_OFFSET) != RECORD_MAGIC {
            return Err(corrupt("no record head"));
        }
        let crc = u32_at(bytes, HEAD_CRC_OFFSET);
        if crc32c::crc32c(&bytes[..HEAD_CRC_OFFSET]) != crc {
            return Err(corrupt("record head checksum mismatch"));
        }
        let kind = RecordKind::from_u8(bytes[KIND_OFFSET])?;
        if kind.entry_bytes() == 0
            && !matches!(kind, RecordKind::Trim | RecordKind::Zero)
            && u64_at(bytes, COUNT_OFFSET) != 0
        {
            return Err(corrupt("record head counts entries its kind has not"));
        }
        Ok(Head {
            kind,
            flags: bytes[FLAGS_OFFSET],
            seq: u64_at(bytes, SEQ_OFFSET),
            durable_seq: u64_at(bytes, DURABLE_SEQ_OFFSET),
            start_lba: Lba(u64_at(bytes, START_LBA_OFFSET)),
            count: u64_at(bytes, COUNT_OFFSET),
            prev_crc: u32_at(bytes, PREV_CRC_OFFSET),
            session: u32_at(bytes, SESSION_OFFSET),
            store_tag: u32_at(bytes, STORE_TAG_OFFSET),
            payload_len: u32_at(bytes, PAYLOAD_LEN_OFFSET),
            payload_crc: u32_at(bytes, PAYLOAD_CRC_OFFSET),
            nonce_epoch: u16::from_le_bytes([bytes[EPOCH_OFFSET], bytes[EPOCH_OFFSET + 1]]),
            crc,
        })
    }

    /// Bytes of the tail this head announces; None if the count cannot be a record's.
    pub fn tail_len(&self) -> Option<usize> {
        let entries = self.kind.entries_area_bytes(usize::try_from(self.count).ok()?)?;
        (entries <= 1 << 24).then_some(entries + self.mac_bytes() + TAIL_FIXED_BYTES)
    }

    /// Bytes of MAC in the tail: `RECORD_MAC_BYTES` if the head says it has one.
    pub fn mac_bytes(&self) -> usize {
        if self.flags & FLAG_MAC != 0 {
            RECORD_MAC_BYTES
        } else {
            0
        }
    }

    /// Bytes of the whole record this head announces.
    pub fn record_len(&self) -> Option<usize> {
        HEAD_BYTES.checked_add(self.payload_len as usize)?.checked_add(self.tail_len()?)
    }

    /// The record's body from the entries of its tail (`entry_bytes` exactly).
    pub fn body(&self, entry_bytes: &[u8]) -> Result<RecordBody> {
        let mut r = Reader::new(entry_bytes, "record tail entries");
        let count = self.count;
        let body = match self.kind {
            RecordKind::Write => RecordBody::Write {
                start_lba: self.start_lba,
                fragments: r
                    .entries(count, WRITE_ENTRY_BYTES, "write record entries", |r| FragmentEntry::unpack(r.u16()?))?,
            },
            RecordKind::Batch => RecordBody::Batch { entries: batch_entries(&mut r, count)? },
            RecordKind::MapPages => RecordBody::MapPages { entries: batch_entries(&mut r, count)? },
            RecordKind::Link => RecordBody::Link {
                next_segment: match self.start_lba.0 {
                    LINK_NONE => None,
                    s => Some(u32::try_from(s).map_err(|_| corrupt("link to a segment past any store's end"))?),
                },
            },
            RecordKind::Jump => RecordBody::Jump { next_record_bytes: self.start_lba.0 },
            RecordKind::Relocate => RecordBody::Relocate { entries: first_relocate_copy(entry_bytes, count)? },
            RecordKind::Trim => RecordBody::Trim { start_lba: self.start_lba, block_count: count },
            RecordKind::Zero => RecordBody::Zero { start_lba: self.start_lba, block_count: count },
            RecordKind::Checkpoint => RecordBody::Checkpoint,
            RecordKind::Marker => RecordBody::Marker,
            RecordKind::RelocateV1 => return Err(corrupt("a version 1 record kind in a version 3 record")),
        };
        if self.kind != RecordKind::Relocate && r.remaining() != 0 {
            return Err(corrupt("record tail has bytes its entries do not use"));
        }
        let fragment_bytes = body.fragment_bytes();
        if !body.payload_fragments().is_empty() && fragment_bytes != self.payload_len as u64 {
            return Err(corrupt("record payload length disagrees with its entries"));
        }
        Ok(body)
    }

    /// The header of the record this head and `body` make.
    pub fn header(&self, body: RecordBody) -> RecordHeader {
        RecordHeader {
            version: RecordVersion::V3,
            flags: self.flags,
            seq: self.seq,
            durable_seq: self.durable_seq,
            prev_crc: self.prev_crc,
            session: self.session,
            store_tag: self.store_tag,
            payload_len: self.payload_len,
            payload_crc: self.payload_crc,
            nonce_epoch: self.nonce_epoch,
            body,
        }
    }
}

/// A version 3 record's head and tail, encoded.
pub struct EncodedRecord {
    pub head: [u8; HEAD_BYTES],
    pub tail: Vec<u8>,
    /// The chain value: the head's CRC.
    pub crc: u32,
}

impl RecordHeader {
    pub fn kind(&self) -> RecordKind {
        self.body.kind()
    }

    pub fn tail_len(&self) -> usize {
        let (_, count) = self.body.lba_and_count();
        let mac = if self.flags & FLAG_MAC != 0 { RECORD_MAC_BYTES } else { 0 };
        self.kind().entries_area_bytes(count as usize).expect("a record's entries fit") + mac + TAIL_FIXED_BYTES
    }

    /// Encodes head and tail in version 3 (a plain store's record: no MAC).
    pub fn encode(&self) -> EncodedRecord {
        self.encode_with(None)
    }

    /// Encodes head and tail with `mac` (an encrypted store's `StoreCipher::mac`) over
    /// `record_mac_parts`, setting `FLAG_MAC`.
    pub fn encode_authenticated(&self, mac: RecordMacFn<'_>) -> EncodedRecord {
        RecordHeader { flags: self.flags | FLAG_MAC, ..self.clone() }.encode_with(Some(mac))
    }

    fn encode_with(&self, mac: Option<RecordMacFn<'_>>) -> EncodedRecord {
        assert_eq!(self.version, RecordVersion::V3);
        assert_eq!(mac.is_some(), self.flags & FLAG_MAC != 0);
        let (start_lba, count) = self.body.lba_and_count();
        let mut head = Vec::with_capacity(HEAD_BYTES);
        let mut w = Writer { buf: &mut head };
        w.u32(RECORD_MAGIC);
        w.u8(self.kind() as u8);
        w.u8(self.flags);
        w.u16(self.nonce_epoch);
        w.u64(self.seq);
        w.u64(self.durable_seq);
        w.u64(start_lba.0);
        w.u64(count);
        w.u32(self.prev_crc);
        w.u32(self.session);
        w.u32(self.store_tag);
        w.u32(self.payload_len);
        w.u32(self.payload_crc);
        assert_eq!(head.len(), HEAD_CRC_OFFSET);
        let crc = crc32c::crc32c(&head);
        head.extend_from_slice(&crc.to_le_bytes());
        let mut tail = Vec::with_capacity(self.tail_len());
        self.body.encode_entries(&mut Writer { buf: &mut tail });
        if let Some(mac) = mac {
            let tag = mac(&record_mac_parts(&head, &tail));
            tail.extend_from_slice(&tag);
        }
        tail.extend_from_slice(&head);
        let tail_crc = crc32c::crc32c(&tail);
        tail.extend_from_slice(&tail_crc.to_le_bytes());
        assert_eq!(tail.len(), self.tail_len());
        EncodedRecord { head: head.try_into().expect("64 bytes"), tail, crc }
    }
}

/// Batch-shaped entries: LBA (or page tag) u48, fragment u16.
fn batch_entries(r: &mut Reader<'_>, count: u64) -> Result<Vec<BatchEntry>> {
    r.entries(count, BATCH_ENTRY_BYTES, "batch record entries", |r| {
        Ok(BatchEntry { lba: Lba(r.u48()?), fragment: FragmentEntry::unpack(r.u16()?)? })
    })
}

/// The entries of one checksummed copy of a relocation's entries.
fn relocate_copy(bytes: &[u8], count: u64) -> Result<Vec<RelocateEntry>> {
    let len = usize::try_from(count)
        .ok()
        .and_then(|n| n.checked_mul(RELOCATE_ENTRY_BYTES))
        .ok_or_else(|| corrupt("relocate count"))?;
    if bytes.len() < len + 4 || crc32c::crc32c(&bytes[..len]) != u32_at(bytes, len) {
        return Err(corrupt("relocate entries copy fails its CRC"));
    }
    Reader::new(&bytes[..len], "relocate record entries").entries(
        count,
        RELOCATE_ENTRY_BYTES,
        "relocate record entries",
        |r| {
            let lba = Lba(r.u48()?);
            let old = r.u48()?;
            let fragment = FragmentEntry::unpack(r.u16()?)?;
            let old_format = if old & OLD_WAS_V2_BIT != 0 { FragmentFormat::V2 } else { FragmentFormat::V3 };
            Ok(RelocateEntry { lba, old_offset_bytes: old & !OLD_WAS_V2_BIT, old_format, fragment })
        },
    )
}

/// The first copy of a relocation's entries (the area holds two, `count` entries each).
fn first_relocate_copy(area: &[u8], count: u64) -> Result<Vec<RelocateEntry>> {
    let expected = RecordKind::Relocate.entries_area_bytes(count as usize).ok_or_else(|| corrupt("relocate count"))?;
    if area.len() != expected {
        return Err(corrupt("relocate tail length"));
    }
    relocate_copy(area, count)
}

/// A relocation's entries from a tail that fails its CRC: either copy that passes its own.
pub fn relocate_entries_from_damaged_tail(head: &Head, tail: &[u8]) -> Option<Vec<RelocateEntry>> {
    let half = RecordKind::Relocate.entries_area_bytes(usize::try_from(head.count).ok()?)? / 2;
    let area = tail.get(..2 * half)?;
    relocate_copy(&area[..half], head.count).or_else(|_| relocate_copy(&area[half..], head.count)).ok()
}

/// A tail found at `tail` (its whole bytes): its head copy, and the body its entries make.
pub fn decode_tail(tail: &[u8]) -> Result<(Head, RecordBody)> {
    if tail.len() < TAIL_FIXED_BYTES {
        return Err(corrupt("record tail is truncated"));
    }
    let crc_at = tail.len() - 4;
    if crc32c::crc32c(&tail[..crc_at]) != u32_at(tail, crc_at) {
        return Err(corrupt("record tail checksum mismatch"));
    }
    let copy_at = crc_at - HEAD_BYTES;
    let head = Head::decode(&tail[copy_at..crc_at])?;
    if head.tail_len() != Some(tail.len()) {
        return Err(corrupt("record tail length disagrees with its head"));
    }
    let body = head.body(&tail[..copy_at - head.mac_bytes()])?;
    Ok((head, body))
}

/// Whether a record of an encrypted store is authentic: its head (`head_bytes`, the head
/// or the tail's copy of it) says it has a MAC, and the MAC in `tail` matches the head and
/// `body`'s entries — re-encoded, so a body rebuilt from the payload (tail damaged)
/// verifies as well as one read from the tail. `verify` is `StoreCipher::verify_mac`.
/// A tail that failed its CRC (`tail_damaged`) may have its flipped bit in the MAC itself:
/// each of the MAC's 96 single-bit corrections is tried too, so one flipped bit loses no
/// more in an encrypted store than in a plain one (a forger gains nothing: each try is a
/// full MAC check).
pub fn record_is_authentic(
    head_bytes: &[u8],
    tail: &[u8],
    body: &RecordBody,
    tail_damaged: bool,
    verify: RecordVerifyFn<'_>,
) -> bool {
    let Ok(head) = Head::decode(head_bytes) else { return false };
    if head.flags & FLAG_MAC == 0 || head.tail_len() != Some(tail.len()) {
        return false;
    }
    let mut entries = Vec::new();
    body.encode_entries(&mut Writer { buf: &mut entries });
    let Some(mac) = tail.get(entries.len()..entries.len() + RECORD_MAC_BYTES) else { return false };
    let parts = record_mac_parts(&head_bytes[..HEAD_BYTES], &entries);
    if verify(&parts, mac) {
        return true;
    }
    let mut corrected = mac.to_vec();
    tail_damaged
        && (0..RECORD_MAC_BYTES * 8).any(|bit| {
            corrected[bit / 8] ^= 1 << (bit % 8);
            let ok = verify(&parts, &corrected);
            corrected[bit / 8] ^= 1 << (bit % 8);
            ok
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::CodecTag;
    use proptest::prelude::*;

    fn sample(body: RecordBody) -> RecordHeader {
        let payload_len = body.fragment_bytes() as u32;
        RecordHeader {
            version: RecordVersion::V3,
            flags: FLAG_FIRST | FLAG_LAST,
            seq: 9,
            durable_seq: 7,
            prev_crc: 3,
            session: 4,
            store_tag: 5,
            payload_len,
            payload_crc: 6,
            nonce_epoch: 0x0102,
            body,
        }
    }

    fn bodies() -> Vec<RecordBody> {
        let f = |stored_len, codec| FragmentEntry { stored_len, codec };
        vec![
            RecordBody::Write { start_lba: Lba(5), fragments: vec![f(4108, CodecTag::Raw), f(0, CodecTag::Raw)] },
            RecordBody::Batch {
                entries: vec![
                    BatchEntry { lba: Lba((1 << 48) - 1), fragment: f(4108, CodecTag::Raw) },
                    BatchEntry { lba: Lba(7), fragment: f(30, CodecTag::Deflate) },
                ],
            },
            RecordBody::Relocate {
                entries: vec![
                    RelocateEntry {
                        lba: Lba(12),
                        old_offset_bytes: crate::map::OFFSET_MAX,
                        old_format: FragmentFormat::V2,
                        fragment: f(2000, CodecTag::Zstd),
                    },
                    RelocateEntry {
                        lba: Lba(13),
                        old_offset_bytes: 1 << 20,
                        old_format: FragmentFormat::V3,
                        fragment: f(20, CodecTag::Lz4),
                    },
                ],
            },
            RecordBody::Trim { start_lba: Lba(3), block_count: 1 << 40 },
            RecordBody::Zero { start_lba: Lba(0), block_count: 1 },
            RecordBody::Checkpoint,
            RecordBody::Marker,
            RecordBody::MapPages {
                entries: vec![BatchEntry { lba: Lba(1 << 45 | 3), fragment: f(900, CodecTag::Zstd) }],
            },
            RecordBody::Link { next_segment: Some(77) },
            RecordBody::Link { next_segment: None },
            RecordBody::Jump { next_record_bytes: (1 << 20) + 4096 * 3 },
        ]
    }

    #[test]
    fn heads_and_tails_round_trip_and_agree() {
        for body in bodies() {
            let header = sample(body);
            let encoded = header.encode();
            let head = Head::decode(&encoded.head).unwrap();
            assert_eq!(head.crc, encoded.crc);
            assert_eq!(head.tail_len(), Some(encoded.tail.len()));
            let (copy, body) = decode_tail(&encoded.tail).unwrap();
            assert_eq!(copy, head, "the tail holds the head's copy");
            assert_eq!(head.header(body), header);
        }
    }

    /// A stand-in MAC for the format's tests (the store uses HMAC-SHA-256: `crypto`). Not a
    /// CRC: a head whose CRC is fixed up leaves a CRC over head and CRC unchanged.
    fn test_mac(parts: &[&[u8]]) -> [u8; RECORD_MAC_BYTES] {
        use std::hash::{DefaultHasher, Hasher};
        let mut hasher = DefaultHasher::new();
        parts.iter().for_each(|part| hasher.write(part));
        let hash = hasher.finish().to_le_bytes();
        let mut mac = [0u8; RECORD_MAC_BYTES];
        mac[..8].copy_from_slice(&hash);
        mac
    }

    #[test]
    fn an_authenticated_record_carries_a_mac_that_vouches_for_head_and_entries() {
        let verify = |parts: &[&[u8]], mac: &[u8]| test_mac(parts) == mac;
        for body in bodies() {
            let header = sample(body.clone());
            let encoded = header.encode_authenticated(&test_mac);
            let head = Head::decode(&encoded.head).unwrap();
            assert_eq!(head.flags, FLAG_FIRST | FLAG_LAST | FLAG_MAC);
            assert_eq!(head.tail_len(), Some(encoded.tail.len()));
            assert_eq!(encoded.tail.len(), header.encode().tail.len() + RECORD_MAC_BYTES);
            let (copy, decoded) = decode_tail(&encoded.tail).unwrap();
            assert_eq!((copy, &decoded), (head, &body));
            assert!(record_is_authentic(&encoded.head, &encoded.tail, &body, false, &verify));
            // One flipped bit of the MAC: corrected when the tail is known damaged.
            let mut flipped = encoded.tail.clone();
            flipped[encoded.tail.len() - 4 - HEAD_BYTES - 3] ^= 0x20;
            assert!(!record_is_authentic(&encoded.head, &flipped, &body, false, &verify));
            assert!(record_is_authentic(&encoded.head, &flipped, &body, true, &verify));
            // Without the MAC (a plain record put in its place), or with another body.
            let plain = header.encode();
            assert!(!record_is_authentic(&plain.head, &plain.tail, &body, true, &verify));
            // A changed entry (an LBA), the tail's CRC fixed.
            if matches!(body.kind(), RecordKind::Batch | RecordKind::MapPages) {
                let mut tail = encoded.tail.clone();
                tail[1] ^= 1;
                let crc_at = tail.len() - 4;
                let crc = crc32c::crc32c(&tail[..crc_at]);
                tail[crc_at..].copy_from_slice(&crc.to_le_bytes());
                let (_, changed) = decode_tail(&tail).unwrap();
                assert_ne!(changed, body);
                assert!(!record_is_authentic(&encoded.head, &tail, &changed, true, &verify));
            }
            // A changed head (its CRC fixed): the MAC no longer matches.
            let mut forged = encoded.head;
            forged[SEQ_OFFSET] ^= 1;
            let crc = crc32c::crc32c(&forged[..HEAD_CRC_OFFSET]);
            forged[HEAD_CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
            assert!(Head::decode(&forged).is_ok());
            assert!(!record_is_authentic(&forged, &encoded.tail, &body, true, &verify));
        }
    }

    #[test]
    fn a_relocated_version_2_fragment_was_eight_bytes_shorter() {
        let RecordBody::Relocate { entries } = &bodies()[2] else { unreachable!() };
        assert_eq!(entries[0].old_fragment(FragmentFormat::V3).stored_len, 1992);
        assert_eq!(entries[1].old_fragment(FragmentFormat::V3), entries[1].fragment);
    }

    #[test]
    fn a_relocation_keeps_its_entries_when_one_copy_is_damaged() {
        let header = sample(bodies()[2].clone());
        let encoded = header.encode();
        let head = Head::decode(&encoded.head).unwrap();
        for at in [3, 14 * 2 + 4 + 3] {
            let mut tail = encoded.tail.clone();
            tail[at] ^= 0x10;
            assert!(decode_tail(&tail).is_err());
            let entries = relocate_entries_from_damaged_tail(&head, &tail).expect("the other copy");
            assert_eq!(RecordBody::Relocate { entries }, header.body);
        }
        let mut both = encoded.tail.clone();
        both[3] ^= 1;
        both[14 * 2 + 4 + 3] ^= 1;
        assert!(relocate_entries_from_damaged_tail(&head, &both).is_none());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400), fix_magic: bool) {
            let mut bytes = bytes;
            if fix_magic && bytes.len() >= 4 {
                bytes[..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
            }
            let _ = Head::decode(&bytes);
            let _ = decode_tail(&bytes);
        }

        #[test]
        fn any_flipped_bit_of_a_head_or_tail_is_caught(which in 0usize..10, index in 0usize..400, bit in 0u8..8) {
            let encoded = sample(bodies()[which].clone()).encode();
            let mut head = encoded.head;
            let i = index % head.len();
            head[i] ^= 1 << bit;
            prop_assert!(Head::decode(&head).is_err());
            let mut tail = encoded.tail.clone();
            let i = index % tail.len();
            tail[i] ^= 1 << bit;
            prop_assert!(decode_tail(&tail).is_err());
        }
    }
}
