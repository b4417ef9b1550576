//! The checkpoint image: the segment usage table, the map's root and the statistics
//! counters, as of one record sequence number (`docs/format.md`, "Checkpoint").
//!
//! Version 4 points at the map's pages; versions 1–3 carried every map entry (read when an
//! older store is upgraded, never written).

use super::{corrupt, Reader, Writer};
use crate::error::Result;

/// "ZDSKCKP4".
pub const CHECKPOINT_MAGIC: u64 = 0x3450_4B43_4B53_445A;
/// "ZDSKCKP5": a version 4 image followed by the dictionary table (written only while the
/// store keeps a dictionary, with superblock feature flag `FEATURE_DICTIONARIES`).
pub const CHECKPOINT_MAGIC_DICTIONARIES: u64 = 0x3550_4B43_4B53_445A;
/// "ZDSKCKP1": the image of format versions 1–3, with the whole map.
pub const CHECKPOINT_MAGIC_V1: u64 = 0x3150_4B43_4B53_445A;

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

/// Bytes one segment's usage takes: state u8, then six u64 (four before version 4).
const SEGMENT_USAGE_BYTES: u64 = 1 + 6 * 8;
const SEGMENT_USAGE_BYTES_V1: u64 = 1 + 4 * 8;
/// Bytes one map entry takes in a version 1 image: LBA delta u64, entry u64.
const MAP_ENTRY_BYTES: u64 = 16;
/// "EPCH": the marker of the nonce epoch table that ends a short-nonce store's image.
const EPOCH_TABLE_MARKER: u32 = 0x4843_5045;
/// Bytes one segment's nonce epoch takes in the epoch table.
const EPOCH_BYTES: u64 = 2;
/// Bytes one superseded-pages entry takes: segment u32, bytes u64.
const SUPERSEDED_BYTES: u64 = 12;
/// Magic, sequence number, generation, logical size, counter count and counters.
const FIXED_BYTES: u64 = 4 * 8 + 4 + 8 * COUNTER_COUNT as u64;
/// Map height u8, root u64, stored and zero block counts u64.
const MAP_ROOT_BYTES: u64 = 25;
/// Before each dictionary's bytes: id u32, level i32, since sequence number u64, length
/// u32, CRC32C of the bytes u32.
const DICTIONARY_HEAD_BYTES: u64 = 24;
/// A dictionary's stored bytes at their largest: sealed in an encrypted store.
const DICTIONARY_STORED_BYTES_MAX: usize =
    crate::codec::DICTIONARY_BYTES_MAX + crate::crypto::cipher::SEAL_OVERHEAD_BYTES;
/// The dictionary table's count u32, then its dictionaries at their largest.
const DICTIONARY_TABLE_BYTES_MAX: u64 =
    4 + crate::codec::DICTIONARIES_MAX as u64 * (DICTIONARY_HEAD_BYTES + DICTIONARY_STORED_BYTES_MAX as u64);

/// Bytes a dictionary table of these dictionaries takes in an image, at most (sealed, before
/// the image's compression; nothing for an empty table).
pub fn dictionary_table_bytes_max(dictionary_bytes: impl Iterator<Item = usize>) -> u64 {
    let entries: u64 = dictionary_bytes
        .map(|bytes| DICTIONARY_HEAD_BYTES + (bytes + crate::crypto::cipher::SEAL_OVERHEAD_BYTES) as u64)
        .sum();
    if entries == 0 {
        0
    } else {
        4 + entries
    }
}

/// A trained dictionary as the checkpoint carries it (`codec::Dictionary` in memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DictionaryEntry {
    pub id: u32,
    /// The zstd level fragments are recompressed at with it.
    pub level: i32,
    /// The log's sequence number from which every segment first used holds no fragment of
    /// an older dictionary (it became GC's then); 0: not known (not yet GC's).
    pub since_seq: u64,
    pub bytes: Vec<u8>,
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
    /// Sequence number of the first record of this use of the segment (0: unknown, before
    /// version 4). Replay restarts a segment only for a record at its start that is not
    /// this one.
    pub first_seq: u64,
    /// Bytes of map pages in this segment that a retained checkpoint references (not
    /// counted in `live_bytes`, which is data).
    pub page_bytes: u64,
    /// The nonce epoch of every sealed fragment of this use (a short-nonce store: the
    /// image's epoch table; 0 otherwise). Set with `first_seq`, from the use's records.
    pub nonce_epoch: u16,
}

impl SegmentUsage {
    pub const FREE: SegmentUsage = SegmentUsage {
        state: SegmentState::Free,
        live_bytes: 0,
        end_bytes: 0,
        last_seq: 0,
        cleaned_seq: 0,
        first_seq: 0,
        page_bytes: 0,
        nonce_epoch: 0,
    };
}

/// Where the map is: its root page pointer (a packed map entry) and the tree's height.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapRoot {
    pub height: u8,
    pub root: u64,
}

/// The checkpoint image: everything recovery needs besides the records after it.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub seq: u64,
    pub generation: u64,
    pub logical_size_bytes: u64,
    pub counters: [u64; COUNTER_COUNT],
    pub segments: Vec<SegmentUsage>,
    /// The map's pages (version 4); None in an older image, which has `legacy_map`.
    pub map_root: Option<MapRoot>,
    /// Blocks the map holds as stored data and as written zeroes (version 4; an older
    /// image's map is counted when it is loaded).
    pub stored_blocks: u64,
    pub zero_blocks: u64,
    /// Map page bytes per segment that this checkpoint replaced: released once the next
    /// checkpoint is durable (the previous one still references them until then).
    pub superseded: Vec<(u32, u64)>,
    /// An older image's map: non-unmapped entries, ascending by LBA.
    pub legacy_map: Vec<(u64, u64)>,
    /// The store's dictionaries, ascending by id (magic `ZDSKCKP5` when not empty).
    pub dictionaries: Vec<DictionaryEntry>,
    /// The image ends with the epoch table (each segment's `nonce_epoch`): exactly in a
    /// short-nonce store (superblock feature `FEATURE_SHORT_NONCES`).
    pub nonce_epochs: bool,
}

impl Checkpoint {
    /// The largest decoded image a store of this geometry can have: what `decode` may
    /// allocate, checked before it does. (`block_count` bounds an older image's map.)
    pub fn decoded_bytes_max(segment_count: u64, block_count: u64) -> u64 {
        let v4 = FIXED_BYTES
            + MAP_ROOT_BYTES
            + 8
            + segment_count * (SEGMENT_USAGE_BYTES + SUPERSEDED_BYTES)
            + 8
            + DICTIONARY_TABLE_BYTES_MAX
            + 4
            + 8
            + segment_count * EPOCH_BYTES;
        let v1 = FIXED_BYTES + 8 + segment_count * SEGMENT_USAGE_BYTES_V1 + 8 + block_count * MAP_ENTRY_BYTES;
        v4.max(v1)
    }

    /// Serialized (version 4) and zstd-compressed.
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.legacy_map.is_empty(), "older images are read, never written");
        let map_root = self.map_root.expect("a version 4 image has a map root");
        let raw_bytes = FIXED_BYTES
            + MAP_ROOT_BYTES
            + 8
            + self.segments.len() as u64 * SEGMENT_USAGE_BYTES
            + 8
            + self.superseded.len() as u64 * SUPERSEDED_BYTES
            + self.dictionary_table_bytes()
            + if self.nonce_epochs { 4 + 8 + self.segments.len() as u64 * EPOCH_BYTES } else { 0 };
        let mut raw = Vec::with_capacity(raw_bytes as usize);
        let mut w = Writer { buf: &mut raw };
        w.u64(if self.dictionaries.is_empty() { CHECKPOINT_MAGIC } else { CHECKPOINT_MAGIC_DICTIONARIES });
        w.u64(self.seq);
        w.u64(self.generation);
        w.u64(self.logical_size_bytes);
        w.u32(self.counters.len() as u32);
        for c in self.counters {
            w.u64(c);
        }
        w.u8(map_root.height);
        w.u64(map_root.root);
        w.u64(self.stored_blocks);
        w.u64(self.zero_blocks);
        w.u64(self.segments.len() as u64);
        for s in &self.segments {
            w.u8(s.state as u8);
            w.u64(s.live_bytes);
            w.u64(s.end_bytes);
            w.u64(s.last_seq);
            w.u64(s.cleaned_seq);
            w.u64(s.first_seq);
            w.u64(s.page_bytes);
        }
        w.u64(self.superseded.len() as u64);
        for &(segment, bytes) in &self.superseded {
            w.u32(segment);
            w.u64(bytes);
        }
        if !self.dictionaries.is_empty() {
            w.u32(self.dictionaries.len() as u32);
            for d in &self.dictionaries {
                w.u32(d.id);
                w.u32(d.level as u32);
                w.u64(d.since_seq);
                w.u32(d.bytes.len() as u32);
                w.u32(crc32c::crc32c(&d.bytes));
                w.buf.extend_from_slice(&d.bytes);
            }
        }
        if self.nonce_epochs {
            w.u32(EPOCH_TABLE_MARKER);
            w.u64(self.segments.len() as u64);
            for s in &self.segments {
                w.u16(s.nonce_epoch);
            }
        }
        assert_eq!(raw.len() as u64, raw_bytes);
        zstd::bulk::compress(&raw, 1).expect("zstd compression of a memory buffer cannot fail")
    }

    /// The dictionary table's bytes in the image (none without a dictionary).
    fn dictionary_table_bytes(&self) -> u64 {
        if self.dictionaries.is_empty() {
            return 0;
        }
        4 + self.dictionaries.iter().map(|d| DICTIONARY_HEAD_BYTES + d.bytes.len() as u64).sum::<u64>()
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
        let (legacy, has_dictionaries) = match r.u64()? {
            CHECKPOINT_MAGIC => (false, false),
            CHECKPOINT_MAGIC_DICTIONARIES => (false, true),
            CHECKPOINT_MAGIC_V1 => (true, false),
            _ => return Err(corrupt("checkpoint magic")),
        };
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
        let (map_root, stored_blocks, zero_blocks) = if legacy {
            (None, 0, 0)
        } else {
            let height = r.u8()?;
            if height == 0 || height > crate::map::page::LEVELS_MAX {
                return Err(corrupt(format!("checkpoint map height {height}")));
            }
            (Some(MapRoot { height, root: r.u64()? }), r.u64()?, r.u64()?)
        };
        let segment_count = r.u64()?;
        let usage_bytes = if legacy { SEGMENT_USAGE_BYTES_V1 } else { SEGMENT_USAGE_BYTES };
        if segment_count > r.remaining() as u64 / usage_bytes {
            return Err(corrupt("checkpoint segment count"));
        }
        let mut segments = (0..segment_count).map(|_| decode_usage(&mut r, legacy)).collect::<Result<Vec<_>>>()?;
        let (superseded, legacy_map) = if legacy {
            (Vec::new(), decode_legacy_map(&mut r)?)
        } else {
            (decode_superseded(&mut r, segment_count)?, Vec::new())
        };
        let dictionaries = if has_dictionaries { decode_dictionaries(&mut r)? } else { Vec::new() };
        let nonce_epochs = !legacy && r.remaining() != 0;
        if nonce_epochs {
            if r.u32()? != EPOCH_TABLE_MARKER || r.u64()? != segment_count {
                return Err(corrupt("checkpoint epoch table"));
            }
            for s in segments.iter_mut() {
                s.nonce_epoch = r.u16()?;
            }
        }
        if r.remaining() != 0 {
            return Err(corrupt("checkpoint has trailing bytes"));
        }
        Ok(Checkpoint {
            seq,
            generation,
            logical_size_bytes,
            counters,
            segments,
            map_root,
            stored_blocks,
            zero_blocks,
            superseded,
            legacy_map,
            dictionaries,
            nonce_epochs,
        })
    }
}

/// The dictionary table: at least one dictionary, at most `DICTIONARIES_MAX`, ids
/// ascending, each of at most `DICTIONARY_STORED_BYTES_MAX` bytes matching its CRC32C (an
/// encrypted store's are sealed; `store/dictionaries.rs` opens them).
fn decode_dictionaries(r: &mut Reader<'_>) -> Result<Vec<DictionaryEntry>> {
    let count = r.u32()? as usize;
    if count == 0 || count > crate::codec::DICTIONARIES_MAX {
        return Err(corrupt(format!("checkpoint lists {count} dictionaries")));
    }
    let mut out: Vec<DictionaryEntry> = Vec::with_capacity(count);
    for _ in 0..count {
        let id = r.u32()?;
        let level = r.u32()? as i32;
        let since_seq = r.u64()?;
        let length = r.u32()? as usize;
        let crc = r.u32()?;
        if length > DICTIONARY_STORED_BYTES_MAX || length > r.remaining() {
            return Err(corrupt(format!("dictionary {id} of {length} bytes")));
        }
        let bytes = r.bytes(length)?.to_vec();
        if crc32c::crc32c(&bytes) != crc {
            return Err(corrupt(format!("dictionary {id} fails its CRC")));
        }
        if id == 0 || out.last().is_some_and(|last| last.id >= id) {
            return Err(corrupt("checkpoint dictionary ids not ascending from 1"));
        }
        out.push(DictionaryEntry { id, level, since_seq, bytes });
    }
    Ok(out)
}

fn decode_superseded(r: &mut Reader<'_>, segment_count: u64) -> Result<Vec<(u32, u64)>> {
    let count = r.u64()?;
    if count > r.remaining() as u64 / SUPERSEDED_BYTES {
        return Err(corrupt("checkpoint superseded count"));
    }
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let segment = r.u32()?;
        if segment as u64 >= segment_count {
            return Err(corrupt("checkpoint superseded pages in a segment past the end"));
        }
        out.push((segment, r.u64()?));
    }
    Ok(out)
}

fn decode_legacy_map(r: &mut Reader<'_>) -> Result<Vec<(u64, u64)>> {
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
    Ok(map)
}

fn decode_usage(r: &mut Reader<'_>, legacy: bool) -> Result<SegmentUsage> {
    let state = match r.u8()? {
        0 => SegmentState::Free,
        1 => SegmentState::Open,
        2 => SegmentState::Sealed,
        3 => SegmentState::Cleaned,
        s => return Err(corrupt(format!("segment state {s}"))),
    };
    let mut usage = SegmentUsage {
        state,
        live_bytes: r.u64()?,
        end_bytes: r.u64()?,
        last_seq: r.u64()?,
        cleaned_seq: r.u64()?,
        ..SegmentUsage::FREE
    };
    if !legacy {
        usage.first_seq = r.u64()?;
        usage.page_bytes = r.u64()?;
    }
    Ok(usage)
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
                first_seq: 3,
                page_bytes: 4,
                nonce_epoch: 0,
            }],
            map_root: Some(MapRoot { height: 2, root: 0x1234_5003 }),
            stored_blocks: 8,
            zero_blocks: 9,
            superseded: vec![(0, 77)],
            legacy_map: Vec::new(),
            dictionaries: Vec::new(),
            nonce_epochs: false,
        }
    }

    #[test]
    fn a_short_nonce_stores_epoch_table_round_trips_and_is_checked() {
        let mut cp = Checkpoint { nonce_epochs: true, ..sample() };
        cp.segments[0].nonce_epoch = 0xbeef;
        cp.dictionaries = vec![DictionaryEntry { id: 1, level: 3, since_seq: 0, bytes: vec![7; 10] }];
        let max = Checkpoint::decoded_bytes_max(1, 100);
        assert_eq!(Checkpoint::decode(&cp.encode(), max).unwrap(), cp);
        let raw = zstd::bulk::decompress(&cp.encode(), 1 << 20).unwrap();
        // The table's count must be the segment count, after its marker.
        let mut bad = raw.clone();
        let at = bad.len() - 2 - 8;
        bad[at] = 2;
        assert!(Checkpoint::decode(&zstd::bulk::compress(&bad, 1).unwrap(), max).is_err());
        let mut bad = raw;
        let at = bad.len() - 2 - 8 - 4;
        bad[at] ^= 1;
        assert!(Checkpoint::decode(&zstd::bulk::compress(&bad, 1).unwrap(), max).is_err());
    }

    #[test]
    fn a_checkpoint_with_dictionaries_round_trips_under_its_own_magic() {
        let dictionaries = vec![
            DictionaryEntry { id: 1, level: 3, since_seq: 0, bytes: vec![7; 1000] },
            DictionaryEntry { id: 4, level: -1, since_seq: 77, bytes: vec![9; 10] },
        ];
        let cp = Checkpoint { dictionaries, ..sample() };
        let encoded = cp.encode();
        assert_eq!(Checkpoint::decode(&encoded, Checkpoint::decoded_bytes_max(1, 100)).unwrap(), cp);
        let raw = zstd::bulk::decompress(&encoded, 1 << 20).unwrap();
        assert_eq!(u64::from_le_bytes(raw[..8].try_into().unwrap()), CHECKPOINT_MAGIC_DICTIONARIES);
        // Without dictionaries, the image is a version 4 one, byte for byte.
        let raw = zstd::bulk::decompress(&sample().encode(), 1 << 20).unwrap();
        assert_eq!(u64::from_le_bytes(raw[..8].try_into().unwrap()), CHECKPOINT_MAGIC);
    }

    #[test]
    fn a_damaged_dictionary_fails_the_checkpoint() {
        let cp = Checkpoint {
            dictionaries: vec![DictionaryEntry { id: 1, level: 3, since_seq: 5, bytes: vec![7; 100] }],
            ..sample()
        };
        let mut raw = zstd::bulk::decompress(&cp.encode(), 1 << 20).unwrap();
        let last = raw.len() - 1;
        raw[last] ^= 1;
        let damaged = zstd::bulk::compress(&raw, 1).unwrap();
        let err = Checkpoint::decode(&damaged, Checkpoint::decoded_bytes_max(1, 100)).unwrap_err();
        assert!(err.to_string().contains("CRC"), "{err}");
    }

    #[test]
    fn checkpoint_round_trips() {
        let cp = sample();
        assert_eq!(Checkpoint::decode(&cp.encode(), Checkpoint::decoded_bytes_max(1, 100)).unwrap(), cp);
    }

    #[test]
    fn a_checkpoint_larger_than_the_geometry_allows_is_refused_before_it_is_held() {
        // (More than the dictionary table's room: that is allowed for whatever the geometry.)
        let cp = Checkpoint { segments: vec![SegmentUsage::FREE; 60_000], ..sample() };
        // The geometry says 1 segment: sixty thousand cannot be ours.
        let err = Checkpoint::decode(&cp.encode(), Checkpoint::decoded_bytes_max(1, 0)).unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");
    }

    #[test]
    fn an_older_image_decodes_with_its_map() {
        // A version 1 image as versions 1-3 wrote it: one segment, two map entries.
        let mut raw = Vec::new();
        let mut w = Writer { buf: &mut raw };
        w.u64(CHECKPOINT_MAGIC_V1);
        for v in [9, 2, 4096 * 10] {
            w.u64(v);
        }
        w.u32(COUNTER_COUNT as u32);
        for _ in 0..COUNTER_COUNT {
            w.u64(1);
        }
        w.u64(1);
        w.u8(2);
        for v in [5, 6, 7, 0] {
            w.u64(v);
        }
        w.u64(2);
        for v in [3, 0x55, 4, 0x66] {
            w.u64(v);
        }
        let compressed = zstd::bulk::compress(&raw, 1).unwrap();
        let cp = Checkpoint::decode(&compressed, Checkpoint::decoded_bytes_max(1, 10)).unwrap();
        assert_eq!(cp.map_root, None);
        assert_eq!(cp.legacy_map, vec![(3, 0x55), (7, 0x66)]);
        assert_eq!(cp.segments[0].live_bytes, 5);
        assert_eq!(cp.segments[0].first_seq, 0);
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
