//! The logical-to-physical map: one packed `u64` per 4 KiB logical block, updated with
//! atomic stores so reads need no lock on the map itself.
//!
//! Packing (see docs/format.md, "Map entry"):
//! - `0` — unmapped (never written or trimmed): reads as zeroes, a hole.
//! - `1` — written as zeroes: reads as zeroes, costs no space.
//! - stored — bits 0..2 = 2, bits 2..5 codec tag, bits 5..18 stored length (including the
//!   4-byte CRC prefix), bits 18..64 physical byte offset of the fragment.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::codec::CodecTag;
use crate::error::Result;

pub const UNMAPPED: u64 = 0;
pub const ZERO: u64 = 1;
const KIND_STORED: u64 = 2;
const LEN_BITS: u32 = 13;
const OFFSET_SHIFT: u32 = 18;
pub const OFFSET_MAX: u64 = (1 << (64 - OFFSET_SHIFT)) - 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    pub offset_bytes: u64,
    pub stored_len: u16,
    pub codec: CodecTag,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    Unmapped,
    Zero,
    Stored(Stored),
}

pub fn pack_stored(s: Stored) -> u64 {
    debug_assert!(s.offset_bytes <= OFFSET_MAX);
    debug_assert!((s.stored_len as u64) < (1 << LEN_BITS) && s.stored_len > 0);
    KIND_STORED | (s.codec as u64) << 2 | (s.stored_len as u64) << 5 | s.offset_bytes << OFFSET_SHIFT
}

pub fn unpack(raw: u64) -> Result<Entry> {
    match raw & 3 {
        0 if raw == UNMAPPED => Ok(Entry::Unmapped),
        1 if raw == ZERO => Ok(Entry::Zero),
        2 => {
            let stored_len = ((raw >> 5) & ((1 << LEN_BITS) - 1)) as u16;
            if stored_len == 0 {
                return Err(crate::Error::new(crate::ErrorKind::Corrupt, "map entry with zero length"));
            }
            Ok(Entry::Stored(Stored {
                offset_bytes: raw >> OFFSET_SHIFT,
                stored_len,
                codec: CodecTag::from_u8(((raw >> 2) & 7) as u8)?,
            }))
        }
        _ => Err(crate::Error::new(crate::ErrorKind::Corrupt, format!("bad map entry {raw:#x}"))),
    }
}

/// The map itself. Growing it (resize) needs `&mut`, which the store gets under its map lock.
#[derive(Debug, Default)]
pub struct Map {
    entries: Vec<AtomicU64>,
}

impl Map {
    pub fn new(block_count: u64) -> Map {
        Map { entries: (0..block_count).map(|_| AtomicU64::new(UNMAPPED)).collect() }
    }

    pub fn block_count(&self) -> u64 {
        self.entries.len() as u64
    }

    pub fn get(&self, lba: u64) -> u64 {
        self.entries[lba as usize].load(Ordering::Acquire)
    }

    /// Publishes a new entry and returns the one it replaced.
    pub fn swap(&self, lba: u64, raw: u64) -> u64 {
        self.entries[lba as usize].swap(raw, Ordering::AcqRel)
    }

    /// Replaces `old` with `new` only if the entry still holds `old` (GC relocation).
    pub fn compare_swap(&self, lba: u64, old: u64, new: u64) -> bool {
        self.entries[lba as usize].compare_exchange(old, new, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    pub fn resize(&mut self, block_count: u64) {
        self.entries.resize_with(block_count as usize, || AtomicU64::new(UNMAPPED));
    }

    /// Every entry that is not unmapped, ascending.
    pub fn mapped(&self) -> Vec<(u64, u64)> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(lba, e)| {
                let raw = e.load(Ordering::Acquire);
                (raw != UNMAPPED).then_some((lba as u64, raw))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_entries_round_trip() {
        let s = Stored { offset_bytes: OFFSET_MAX, stored_len: 4100, codec: CodecTag::Deflate };
        assert_eq!(unpack(pack_stored(s)).unwrap(), Entry::Stored(s));
        assert_eq!(unpack(UNMAPPED).unwrap(), Entry::Unmapped);
        assert_eq!(unpack(ZERO).unwrap(), Entry::Zero);
        assert!(unpack(3).is_err());
        assert!(unpack(5).is_err());
    }
}
