//! The fixed facts of an open store — segment size and count, where segments lie — and
//! the segment buffers the log fills: what every other part of the store may use without
//! depending on any of them.

use aligned_vec::{AVec, ConstAlign};

use super::lock::RwLock;
use crate::codec::Codec;
use crate::format::DATA_START_BYTES;
use crate::types::SegmentId;
use crate::BLOCK_SIZE;

pub(crate) type AlignedBuf = AVec<u8, ConstAlign<4096>>;

pub(crate) fn new_buffer(size: usize) -> AlignedBuf {
    let mut buf = AVec::with_capacity(4096, size);
    buf.resize(size, 0);
    buf
}

pub(crate) fn round_up(value: u64, to: u64) -> u64 {
    value.div_ceil(to) * to
}

/// A record carrying fragments may leave this much of a segment's end unused: fragments
/// do not span segments, so one that does not fit starts the next segment. (The largest
/// fragment — a raw block and its protection information — a record's head and tail, and
/// an entry. An encrypted store's are larger by the seal and the record MAC:
/// `Inner::fragment_end_waste_bytes`; a segment's capacity, which leaves twice this, covers
/// that too.)
pub(crate) const FRAGMENT_END_WASTE_BYTES: u64 =
    (BLOCK_SIZE + crate::format::PI_BYTES + crate::format::RECORD_MIN_BYTES + crate::format::RELOCATE_ENTRY_BYTES)
        as u64;

/// Bytes a full segment of this size can hold for records, conservatively.
pub(crate) fn segment_capacity_of(segment_size_bytes: u64) -> u64 {
    segment_size_bytes - 2 * FRAGMENT_END_WASTE_BYTES
}

/// The fixed facts of an open store.
#[derive(Clone)]
pub(crate) struct Geometry {
    pub store_tag: u32,
    pub segment_size_bytes: u64,
    pub segment_count: u64,
    pub physical_size_bytes: u64,
    pub codec: Codec,
    /// The superblock says the store is encrypted (its fragments carry a seal, which its
    /// native capacity counts) — known also when it is read without its key, where there
    /// is no cipher.
    pub encrypted: bool,
}

impl Geometry {
    pub fn segment_base(&self, segment: SegmentId) -> u64 {
        DATA_START_BYTES + segment.0 as u64 * self.segment_size_bytes
    }

    pub fn segment_of(&self, offset_bytes: u64) -> SegmentId {
        debug_assert!(offset_bytes >= DATA_START_BYTES);
        SegmentId(((offset_bytes - DATA_START_BYTES) / self.segment_size_bytes) as u32)
    }

    /// Whether a byte address lies in a segment (a jump record's target must).
    pub fn in_data_area(&self, offset_bytes: u64) -> bool {
        offset_bytes >= DATA_START_BYTES && offset_bytes < self.segment_base(SegmentId(self.segment_count as u32))
    }

    /// Bytes a full segment can hold for records, conservatively.
    pub fn segment_capacity(&self) -> u64 {
        segment_capacity_of(self.segment_size_bytes)
    }

    /// Bytes of all segments together.
    pub fn data_area_bytes(&self) -> u64 {
        self.segment_count * self.segment_size_bytes
    }
}

/// A segment's bytes while they may not all be on disk yet.
pub(crate) struct SegmentBuffer {
    pub segment: SegmentId,
    pub data: RwLock<AlignedBuf>,
}

const SEGMENT_BYTES_MIN: u64 = 64 << 10;
const SEGMENT_BYTES_MAX: u64 = 256 << 20;
const SEGMENT_BYTES_DEFAULT: u64 = 4 << 20;
/// The default segment size shrinks on small stores until there are this many.
const SEGMENTS_PREFERRED: u64 = 64;

/// Whether a store can be formatted with segments of this size.
pub(crate) fn segment_size_is_valid(segment_size_bytes: u64) -> bool {
    (SEGMENT_BYTES_MIN..=SEGMENT_BYTES_MAX).contains(&segment_size_bytes)
        && segment_size_bytes.is_multiple_of(SEGMENT_BYTES_MIN)
}

/// Default segment size: 4 MiB, smaller on small stores so there are at least 64 segments.
pub(crate) fn default_segment_size(physical_size_bytes: u64) -> u64 {
    let mut size = SEGMENT_BYTES_DEFAULT;
    while size > SEGMENT_BYTES_MIN && physical_size_bytes.saturating_sub(DATA_START_BYTES) / size < SEGMENTS_PREFERRED {
        size /= 2;
    }
    size
}
