//! The checkpoint image: the segment usage table, the map and the statistics counters, as
//! of one record sequence number (`docs/format.md`, "Checkpoint").

use super::{corrupt, Reader, Writer};
use crate::error::Result;

pub const CHECKPOINT_MAGIC: u64 = 0x3150_4B43_4B53_445A; // "ZDSKCKP1"

/// The statistics counters a checkpoint carries, in their on-disk order (part of the format;
/// `stats::Counters` lists its fields in this order, checked by a unit test there).
pub const COUNTER_ORDER: [&str; 16] = [
    "host_write_bytes",
    "host_read_bytes",
    "backing_write_bytes",
    "padding_bytes",
    "metadata_bytes",
    "data_bytes",
    "checksum_errors",
    "gc_bytes_moved",
    "gc_segments_cleaned",
    "checkpoints",
    "read_ops",
    "write_ops",
    "trim_ops",
    "zero_ops",
    "flush_ops",
    "fua_ops",
];
const COUNTER_COUNT: usize = COUNTER_ORDER.len();

/// Bytes one segment's usage takes: state u8, then four u64.
const SEGMENT_USAGE_BYTES: u64 = 1 + 4 * 8;
/// Bytes one map entry takes: LBA delta u64, entry u64.
const MAP_ENTRY_BYTES: u64 = 16;
/// Magic, sequence number, generation, logical size, counter count and counters.
const FIXED_BYTES: u64 = 4 * 8 + 4 + 8 * COUNTER_COUNT as u64;

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

impl SegmentUsage {
    pub const FREE: SegmentUsage =
        SegmentUsage { state: SegmentState::Free, live_bytes: 0, end_bytes: 0, last_seq: 0, cleaned_seq: 0 };
}

/// The checkpoint image: everything recovery needs besides the records after it.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub seq: u64,
    pub generation: u64,
    pub logical_size_bytes: u64,
    pub counters: [u64; COUNTER_COUNT],
    pub segments: Vec<SegmentUsage>,
    /// Non-unmapped map entries, ascending by LBA.
    pub map: Vec<(u64, u64)>,
}

impl Checkpoint {
    /// The largest decoded image a store of this geometry can have: what `decode` may
    /// allocate, checked before it does.
    pub fn decoded_bytes_max(segment_count: u64, block_count: u64) -> u64 {
        FIXED_BYTES + 8 + segment_count * SEGMENT_USAGE_BYTES + 8 + block_count * MAP_ENTRY_BYTES
    }

    /// Serialized and zstd-compressed.
    pub fn encode(&self) -> Vec<u8> {
        let raw_bytes = Checkpoint::decoded_bytes_max(self.segments.len() as u64, self.map.len() as u64);
        let mut raw = Vec::with_capacity(raw_bytes as usize);
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
        debug_assert_eq!(raw.len() as u64, raw_bytes);
        zstd::bulk::compress(&raw, 1).expect("zstd compression of a memory buffer cannot fail")
    }

    /// Decodes a checkpoint whose decompressed image may be at most `decoded_bytes_max`
    /// (see [`Checkpoint::decoded_bytes_max`]): a larger one is refused before it is held.
    pub fn decode(compressed: &[u8], decoded_bytes_max: u64) -> Result<Checkpoint> {
        use std::io::Read;
        let decoder = zstd::stream::read::Decoder::new(compressed)
            .map_err(|e| corrupt(format!("checkpoint does not decompress: {e}")))?;
        let mut raw = Vec::new();
        decoder
            .take(decoded_bytes_max + 1)
            .read_to_end(&mut raw)
            .map_err(|e| corrupt(format!("checkpoint does not decompress: {e}")))?;
        if raw.len() as u64 > decoded_bytes_max {
            return Err(corrupt("checkpoint is larger than the store's geometry allows"));
        }
        let mut r = Reader::new(&raw, "checkpoint");
        if r.u64()? != CHECKPOINT_MAGIC {
            return Err(corrupt("checkpoint magic"));
        }
        let seq = r.u64()?;
        let generation = r.u64()?;
        let logical_size_bytes = r.u64()?;
        let counter_count = r.u32()? as usize;
        if counter_count != COUNTER_COUNT {
            return Err(corrupt(format!("checkpoint has {counter_count} counters")));
        }
        let mut counters = [0u64; COUNTER_COUNT];
        for c in counters.iter_mut() {
            *c = r.u64()?;
        }
        let segment_count = r.u64()?;
        if segment_count > r.remaining() as u64 / SEGMENT_USAGE_BYTES {
            return Err(corrupt("checkpoint segment count"));
        }
        let segments = (0..segment_count).map(|_| decode_usage(&mut r)).collect::<Result<Vec<_>>>()?;
        let map_len = r.u64()?;
        if map_len > r.remaining() as u64 / MAP_ENTRY_BYTES {
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

fn decode_usage(r: &mut Reader<'_>) -> Result<SegmentUsage> {
    let state = match r.u8()? {
        0 => SegmentState::Free,
        1 => SegmentState::Open,
        2 => SegmentState::Sealed,
        3 => SegmentState::Cleaned,
        s => return Err(corrupt(format!("segment state {s}"))),
    };
    Ok(SegmentUsage { state, live_bytes: r.u64()?, end_bytes: r.u64()?, last_seq: r.u64()?, cleaned_seq: r.u64()? })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Checkpoint {
        Checkpoint {
            seq: 1,
            generation: 2,
            logical_size_bytes: 4096 * 100,
            counters: [3; COUNTER_COUNT],
            segments: vec![SegmentUsage {
                state: SegmentState::Sealed,
                live_bytes: 5,
                end_bytes: 6,
                last_seq: 7,
                cleaned_seq: 0,
            }],
            map: vec![(0, 1), (5, 2), (99, 3)],
        }
    }

    #[test]
    fn checkpoint_round_trips() {
        let cp = sample();
        assert_eq!(Checkpoint::decode(&cp.encode(), Checkpoint::decoded_bytes_max(1, 100)).unwrap(), cp);
    }

    #[test]
    fn a_checkpoint_larger_than_the_geometry_allows_is_refused_before_it_is_held() {
        let cp = sample();
        // The geometry says 2 mapped blocks at most: three entries cannot be ours.
        let err = Checkpoint::decode(&cp.encode(), Checkpoint::decoded_bytes_max(1, 2)).unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn checkpoint_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Checkpoint::decode(&bytes, 1 << 20);
            // Also feed it valid zstd frames of garbage, which reach the field parser.
            let framed = zstd::bulk::compress(&bytes, 1).unwrap();
            let _ = Checkpoint::decode(&framed, 1 << 20);
        }
    }
}
