//! Address newtypes: a logical block number and a segment number are never mixed up with
//! each other or with byte offsets.

use std::fmt;

/// A logical block address: the index of a 4 KiB block of the device the client sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lba(pub u64);

impl Lba {
    /// The block holding byte `offset` of the device.
    pub fn of_byte(offset: u64) -> Lba {
        Lba(offset / crate::BLOCK_SIZE as u64)
    }

    /// Byte offset of the block's first byte on the device.
    pub fn byte_offset(self) -> u64 {
        self.0 * crate::BLOCK_SIZE as u64
    }

    pub fn plus(self, blocks: u64) -> Lba {
        Lba(self.0 + blocks)
    }
}

impl fmt::Display for Lba {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A segment of the data area, numbered from 0 at `DATA_START_BYTES`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SegmentId(pub u32);

impl SegmentId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for SegmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}
