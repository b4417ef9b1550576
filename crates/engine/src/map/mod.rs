//! The logical-to-physical map: one packed entry per 4 KiB logical block, kept in 512-entry
//! pages on the backing store and cached in memory (`paged.rs`).
//!
//! Packing (see docs/format.md, "Map entry"):
//! - `0` — unmapped (never written or trimmed): reads as zeroes, a hole.
//! - `1` — written as zeroes: reads as zeroes, costs no space.
//! - `4` — lost: the metadata that said where the block is was damaged beyond repair;
//!   reads fail with EIO until the block is written again.
//! - stored — bits 0..2 = 2 (a version 2 fragment: 4-byte guard prefix) or 3 (version 3:
//!   12 bytes of protection information), bits 2..5 codec tag, bits 5..18 stored length
//!   (prefix included), bits 18..64 physical byte offset of the fragment.
//!
//! An interior map page's slot uses the same packing: a stored entry points at the child
//! page's fragment; UNMAPPED, ZERO and LOST stand for every block of the child's subtree.

mod merge;
pub(crate) mod page;
mod paged;
mod walk;

pub(crate) use merge::{uniform_constant, Prepared};
pub(crate) use paged::{span_blocks, Accounting, Delta, PageSource, PagedMap, DIRTY_PAGES_HARD};
pub(crate) use walk::{walk_subtree, Visit, WalkItem};

use crate::codec::CodecTag;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{FragmentEntry, FragmentFormat};

const KIND_STORED_V2: u64 = 2;
const KIND_STORED_V3: u64 = 3;
const LEN_BITS: u32 = 13;
const OFFSET_SHIFT: u32 = 18;
pub const OFFSET_MAX: u64 = (1 << (64 - OFFSET_SHIFT)) - 1;

/// A map entry as stored: one `u64` (in memory and in checkpoints).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackedEntry(pub u64);

impl PackedEntry {
    pub const UNMAPPED: PackedEntry = PackedEntry(0);
    pub const ZERO: PackedEntry = PackedEntry(1);
    pub const LOST: PackedEntry = PackedEntry(4);

    pub fn stored(s: Stored) -> PackedEntry {
        assert!(s.offset_bytes <= OFFSET_MAX);
        assert!((s.stored_len as u64) < (1 << LEN_BITS) && s.stored_len > 0);
        let kind = match s.format {
            FragmentFormat::V2 => KIND_STORED_V2,
            FragmentFormat::V3 => KIND_STORED_V3,
        };
        PackedEntry(kind | (s.codec as u64) << 2 | (s.stored_len as u64) << 5 | s.offset_bytes << OFFSET_SHIFT)
    }

    /// The entry of a fragment of `format` stored at `offset_bytes` (ZERO for an all-zero
    /// block, which the map never points at).
    pub fn of_fragment(offset_bytes: u64, fragment: FragmentEntry, format: FragmentFormat) -> PackedEntry {
        if fragment.is_zero_block(format) {
            PackedEntry::ZERO
        } else {
            PackedEntry::stored(Stored { offset_bytes, stored_len: fragment.stored_len, codec: fragment.codec, format })
        }
    }

    pub fn unpack(self) -> Result<Entry> {
        unpack(self.0)
    }
}

/// Where a stored block's fragment is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    pub offset_bytes: u64,
    pub stored_len: u16,
    pub codec: CodecTag,
    pub format: FragmentFormat,
}

impl Stored {
    /// The fragment entry (length and codec) a record lists for it.
    pub fn fragment_entry(&self) -> FragmentEntry {
        FragmentEntry { stored_len: self.stored_len, codec: self.codec }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    Unmapped,
    Zero,
    /// Its metadata was damaged: reads fail until it is written again.
    Lost,
    Stored(Stored),
}

pub fn unpack(raw: u64) -> Result<Entry> {
    match raw & 3 {
        0 if raw == PackedEntry::UNMAPPED.0 => Ok(Entry::Unmapped),
        0 if raw == PackedEntry::LOST.0 => Ok(Entry::Lost),
        1 if raw == PackedEntry::ZERO.0 => Ok(Entry::Zero),
        kind @ (KIND_STORED_V2 | KIND_STORED_V3) => {
            let stored_len = ((raw >> 5) & ((1 << LEN_BITS) - 1)) as u16;
            if stored_len == 0 {
                return Err(Error::new(ErrorKind::Corrupt, "map entry with zero length"));
            }
            Ok(Entry::Stored(Stored {
                offset_bytes: raw >> OFFSET_SHIFT,
                stored_len,
                codec: CodecTag::from_u8(((raw >> 2) & 7) as u8)?,
                format: if kind == KIND_STORED_V2 { FragmentFormat::V2 } else { FragmentFormat::V3 },
            }))
        }
        _ => Err(Error::new(ErrorKind::Corrupt, format!("bad map entry {raw:#x}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_entries_round_trip() {
        for format in [FragmentFormat::V2, FragmentFormat::V3] {
            let s = Stored { offset_bytes: OFFSET_MAX, stored_len: 4108, codec: CodecTag::Deflate, format };
            assert_eq!(PackedEntry::stored(s).unpack().unwrap(), Entry::Stored(s));
        }
        assert_eq!(PackedEntry::LOST.unpack().unwrap(), Entry::Lost);
        assert_eq!(PackedEntry::UNMAPPED.unpack().unwrap(), Entry::Unmapped);
        assert_eq!(PackedEntry::ZERO.unpack().unwrap(), Entry::Zero);
        assert!(unpack(3).is_err());
        assert!(unpack(5).is_err());
    }
}
