//! A stored fragment: one compressed 4 KiB block, prefixed with its protection information
//! (`docs/format.md`, "Fragments").
//!
//! Version 3 fragments carry, like T10 protection information, a guard (the CRC32C of the
//! uncompressed block), a reference tag (the LBA the block was written for) and the
//! fragment's own length and codec, so that (1) a read can prove the bytes are the block it
//! asked for, not just some intact block, and (2) a record's payload can be walked without
//! its header — the second copy of what the header says. Version 2 fragments carry only the
//! guard; they are still read, and GC converts them when it moves them.

use super::{corrupt, Reader};
use crate::codec::CodecTag;
use crate::error::Result;
use crate::types::Lba;

/// Version 2: the CRC32C of the uncompressed block.
pub const V2_PREFIX_BYTES: usize = 4;
/// Version 3: guard u32, LBA u48, fragment u16 (stored length 13 bits, codec 3 bits).
pub const PI_BYTES: usize = 12;
/// Stored lengths fit 13 bits.
pub const STORED_LEN_MAX: usize = (1 << 13) - 1;

const _: () = assert!(PI_BYTES + crate::BLOCK_SIZE <= STORED_LEN_MAX, "a raw block with its PI fits the length field");

/// How a fragment's prefix is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragmentFormat {
    /// Version 2: a 4-byte guard.
    V2,
    /// Version 3: 12 bytes of protection information.
    V3,
}

impl FragmentFormat {
    pub fn prefix_bytes(self) -> usize {
        match self {
            FragmentFormat::V2 => V2_PREFIX_BYTES,
            FragmentFormat::V3 => PI_BYTES,
        }
    }
}

/// A fragment's length and codec, as record entries and protection information carry them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FragmentEntry {
    /// Fragment bytes on disk including the prefix; 0 for an all-zero block.
    pub stored_len: u16,
    pub codec: CodecTag,
}

impl FragmentEntry {
    /// The entry of an all-zero block in version 3: its protection information alone, so a
    /// payload walk sees every block of a record. The map never points at it.
    pub const ZERO_BLOCK: FragmentEntry = FragmentEntry { stored_len: PI_BYTES as u16, codec: CodecTag::Raw };

    /// Whether this is an all-zero block (stores no data; the map holds ZERO for it).
    pub fn is_zero_block(self, format: FragmentFormat) -> bool {
        match format {
            FragmentFormat::V2 => self.stored_len == 0,
            FragmentFormat::V3 => self.stored_len as usize == PI_BYTES,
        }
    }

    /// Packed in two bytes: stored length (13 bits), codec tag (3 bits).
    pub fn packed(self) -> u16 {
        assert!(self.stored_len as usize <= STORED_LEN_MAX && (self.codec as u8) < 8);
        self.stored_len | (self.codec as u16) << 13
    }

    pub fn unpack(packed: u16) -> Result<FragmentEntry> {
        Ok(FragmentEntry { stored_len: packed & 0x1fff, codec: CodecTag::from_u8((packed >> 13) as u8)? })
    }
}

/// A version 3 fragment's protection information.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protection {
    /// CRC32C of the uncompressed block.
    pub guard: u32,
    pub lba: Lba,
    pub entry: FragmentEntry,
}

impl Protection {
    pub fn encode(&self) -> [u8; PI_BYTES] {
        let mut out = [0u8; PI_BYTES];
        out[..4].copy_from_slice(&self.guard.to_le_bytes());
        out[4..10].copy_from_slice(&self.lba.0.to_le_bytes()[..6]);
        out[10..12].copy_from_slice(&self.entry.packed().to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Protection> {
        let mut r = Reader::new(bytes, "fragment protection information");
        let guard = r.u32()?;
        let lba = Lba(r.u48()?);
        let entry = FragmentEntry::unpack(r.u16()?)?;
        if (entry.stored_len as usize) < PI_BYTES {
            return Err(corrupt("fragment shorter than its protection information"));
        }
        Ok(Protection { guard, lba, entry })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protection_information_round_trips() {
        let pi = Protection {
            guard: 0xdead_beef,
            lba: Lba((1 << 48) - 1),
            entry: FragmentEntry { stored_len: (PI_BYTES + 4096) as u16, codec: CodecTag::Raw },
        };
        assert_eq!(Protection::decode(&pi.encode()).unwrap(), pi);
        let short = Protection { entry: FragmentEntry { stored_len: 3, codec: CodecTag::Lz4 }, ..pi };
        assert!(Protection::decode(&short.encode()).is_err());
    }
}
