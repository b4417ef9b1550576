//! On-disk structures, encoded and decoded field by field (little-endian). The byte maps are
//! in `docs/format.md`, and the offsets here are named constants the document mirrors;
//! keep the two in step.
//!
//! Invariant: every decoder checks lengths before it reads and before it allocates, and
//! returns an error on any inconsistency — it never panics on arbitrary bytes (the fuzz
//! targets in `fuzz/` and the property tests below feed it garbage).

mod checkpoint;
mod fragment;
mod proof;
mod record;
mod superblock;
pub mod v2 {
    //! Version 2 records: read, never written.
    pub use super::record_v2::*;
}
mod record_v2;

pub use checkpoint::{
    dictionary_table_bytes_max, Checkpoint, DictionaryEntry, MapRoot, SegmentState, SegmentUsage, COUNTER_ORDER,
};
pub use fragment::{FragmentEntry, FragmentFormat, Protection, PI_BYTES, V2_PREFIX_BYTES};
pub use proof::{FlushProof, ProofSector, FLUSH_PROOF_BYTES, FLUSH_PROOF_OFFSET_BYTES};
pub use record::{
    decode_tail, record_is_authentic, relocate_entries_from_damaged_tail, BatchEntry, EncodedRecord, Head, RecordBody,
    RecordHeader, RecordKind, RecordVersion, BATCH_ENTRY_BYTES, BATCH_LBA_LIMIT, FLAG_FIRST, FLAG_LAST, HEAD_BYTES,
    RECORD_BLOCKS_MAX, RECORD_MAC_BYTES, RECORD_MAGIC, RECORD_MIN_BYTES, RELOCATE_ENTRY_BYTES, TAIL_FIXED_BYTES,
    WRITE_ENTRY_BYTES,
};
pub use superblock::{
    ChunkRef, Superblock, CHUNK_REFS_MAX, FEATURE_AUTHENTICATED_LOG, FEATURE_DICTIONARIES, FEATURE_ENCRYPTED,
    FEATURE_LOG_JUMPS, FEATURE_PLACEMENT_USE, FEATURE_SHORT_NONCES, SUPERBLOCK_MAC_BYTES, SUPERBLOCK_SLOT_BYTES,
};

use crate::error::{Error, ErrorKind, Result};

/// 4: the block map in pages on the store, checkpoints that point at them, segment links.
/// Versions 1–3 are read, and upgraded when opened for writing (`docs/format.md`,
/// "Version history").
pub const FORMAT_VERSION: u32 = 4;
/// 5: version 4, encrypted (`docs/format.md`, "Encryption"). A plain store stays version 4.
pub const FORMAT_VERSION_ENCRYPTED: u32 = 5;

/// Segments start here (the superblock area is padded to 1 MiB for alignment).
pub const DATA_START_BYTES: u64 = 1 << 20;

/// The largest logical size a store may have: 2^60 bytes (1 EiB; 2^48 blocks, what a
/// fragment's and an entry's 48-bit LBA can name).
pub const LOGICAL_SIZE_MAX_BYTES: u64 = 1 << 60;

/// Appends little-endian fields to a buffer.
pub(crate) struct Writer<'a> {
    pub buf: &'a mut Vec<u8>,
}

impl Writer<'_> {
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u48(&mut self, v: u64) {
        assert!(v < 1 << 48);
        self.buf.extend_from_slice(&v.to_le_bytes()[..6]);
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
    /// A list of `count` entries of `entry_bytes` each, which must be exactly what is left.
    pub fn entries<T>(
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

pub(crate) fn corrupt(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Corrupt, what)
}

/// Reads a little-endian `u32` at `at` (the caller has checked the length).
pub fn u32_at(buf: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"))
}

/// Reads a little-endian `u64` at `at` (the caller has checked the length).
pub(crate) fn u64_at(buf: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"))
}
