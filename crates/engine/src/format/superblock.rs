//! The superblock: two 16 KiB slots at the start of the backing store, each describing one
//! checkpoint. The valid slot with the higher generation wins (`docs/format.md`,
//! "Superblock slot"; the offsets below are that table's).

use super::{corrupt, Reader, Writer, DATA_START_BYTES, FORMAT_VERSION, FORMAT_VERSION_ENCRYPTED};
use crate::codec::CodecTag;
use crate::error::{Error, ErrorKind, Result};

pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"ZDISKSB1";
/// Each superblock slot is this big; slot 0 at offset 0, slot 1 right after it.
pub const SUPERBLOCK_SLOT_BYTES: usize = 16 << 10;

const MAGIC_OFFSET: usize = 0;
const VERSION_OFFSET: usize = MAGIC_OFFSET + 8;
const SLOT_SIZE_OFFSET: usize = VERSION_OFFSET + 4;
const UUID_OFFSET: usize = SLOT_SIZE_OFFSET + 4;
const GENERATION_OFFSET: usize = UUID_OFFSET + 16;
const LOGICAL_SIZE_OFFSET: usize = GENERATION_OFFSET + 8;
const PHYSICAL_SIZE_OFFSET: usize = LOGICAL_SIZE_OFFSET + 8;
const SEGMENT_SIZE_OFFSET: usize = PHYSICAL_SIZE_OFFSET + 8;
const CODEC_TAG_OFFSET: usize = SEGMENT_SIZE_OFFSET + 8;
const CODEC_LEVEL_OFFSET: usize = CODEC_TAG_OFFSET + 4; // tag u8, then 3 zero bytes
const FEATURE_FLAGS_OFFSET: usize = CODEC_LEVEL_OFFSET + 4;
const CHECKPOINT_SEQ_OFFSET: usize = FEATURE_FLAGS_OFFSET + 8;
const REPLAY_OFFSET_OFFSET: usize = CHECKPOINT_SEQ_OFFSET + 8;
const REPLAY_PREV_CRC_OFFSET: usize = REPLAY_OFFSET_OFFSET + 8;
const CHUNK_COUNT_OFFSET: usize = REPLAY_PREV_CRC_OFFSET + 4;
const OVER_PROVISION_OFFSET: usize = CHUNK_COUNT_OFFSET + 4;
const MAC_OFFSET: usize = OVER_PROVISION_OFFSET + 4;
/// An encrypted store's superblock MAC (`crypto::cipher::MAC_BYTES`); zero otherwise.
pub const SUPERBLOCK_MAC_BYTES: usize = 12;
const CHUNK_REFS_OFFSET: usize = MAC_OFFSET + SUPERBLOCK_MAC_BYTES;
const CHUNK_REF_BYTES: usize = 16;
const CRC_OFFSET: usize = SUPERBLOCK_SLOT_BYTES - 4;
/// Checkpoint chunks one slot can list.
pub const CHUNK_REFS_MAX: usize = (CRC_OFFSET - CHUNK_REFS_OFFSET) / CHUNK_REF_BYTES;

const _: () = assert!(CHUNK_REFS_OFFSET == 120, "docs/format.md: chunk references start at 120");
const _: () = assert!(CHUNK_REFS_MAX == 1016);

/// Where one piece of a checkpoint lives: the payload of a `Checkpoint` record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRef {
    pub offset_bytes: u64,
    pub length_bytes: u32,
    pub crc: u32,
}

/// Feature flag: the checkpoint image carries a dictionary table (magic `ZDSKCKP5`) and
/// fragments may be `ZstdDict`. Set exactly while the store keeps a dictionary; code from
/// before dictionaries refuses a store with it as "newer version", and opens the store again
/// once no dictionary is kept (docs/format.md, "Dictionaries").
pub const FEATURE_DICTIONARIES: u64 = 1;
/// Feature flag: the store is encrypted (a key header at 32 KiB, sealed fragments, a MAC in
/// every superblock). Set exactly when the format version is 5 (docs/format.md,
/// "Encryption"); both say it, so neither older code nor a flipped flag reads it as plain.
pub const FEATURE_ENCRYPTED: u64 = 2;
/// Feature flag: an encrypted store's records carry MACs and its fragments' guards are
/// placement tags (docs/format.md, "Encryption"). Set with `FEATURE_ENCRYPTED` by every
/// format since 2026-11-25; an encrypted store without it was made by the code before, whose
/// log this code cannot read (no record would authenticate), and is refused by name.
pub const FEATURE_AUTHENTICATED_LOG: u64 = 4;
/// Feature flag: the log may hold jump records (kind 11: host writes and GC's relocations
/// in two open segments, docs/format.md, "Records"). Set by every format since 2026-11-25
/// and kept by every checkpoint; code from before refuses such a store as "newer version"
/// instead of ending its replay at the first jump. A store formatted before keeps one open
/// segment (its native capacity was computed for one).
pub const FEATURE_LOG_JUMPS: u64 = 8;
/// Feature flag: an encrypted store's placement tags bind the use of the segment a fragment
/// lies in (its first record's sequence number) as well as its address (docs/format.md,
/// "Sealed fragments"). Set with `FEATURE_ENCRYPTED` by every format since 2026-11-26 and
/// kept by every checkpoint; encrypted stores formatted before keep tags of the address
/// alone, and code from before refuses a store with it as "newer version".
pub const FEATURE_PLACEMENT_USE: u64 = 16;
/// Feature flag: an encrypted store's fragments store their nonce's low 32 bits only; the
/// high bits, the nonce epoch, are recorded per segment use — in every record's head and in
/// the checkpoint's epoch table (docs/format.md, "Nonces"). Set with `FEATURE_ENCRYPTED` by
/// every format since 2026-11-27 and kept by every checkpoint; encrypted stores formatted
/// before keep whole nonces, and code from before refuses a store with it as "newer
/// version".
pub const FEATURE_SHORT_NONCES: u64 = 32;
/// The feature flags this code understands; any other is refused as "newer version".
pub const FEATURES_KNOWN: u64 = FEATURE_DICTIONARIES
    | FEATURE_ENCRYPTED
    | FEATURE_AUTHENTICATED_LOG
    | FEATURE_LOG_JUMPS
    | FEATURE_PLACEMENT_USE
    | FEATURE_SHORT_NONCES;

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
    /// Share of the data area kept spare beyond native capacity, in parts per million
    /// (`store/capacity.rs`). Advisory: it sets what `1x` means and what `stat` reports; 0
    /// in stores formatted before it existed. Older code ignores it (it was reserved).
    pub over_provision_ppm: u32,
    /// An encrypted store's MAC of this slot (with these bytes zero) and its checkpoint's
    /// stored bytes (`store/checkpoint.rs`); zero in a plain store.
    pub mac: [u8; SUPERBLOCK_MAC_BYTES],
    pub checkpoint_chunks: Vec<ChunkRef>,
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.checkpoint_chunks.len() <= CHUNK_REFS_MAX, "too many checkpoint chunks");
        let mut buf = Vec::with_capacity(SUPERBLOCK_SLOT_BYTES);
        let mut w = Writer { buf: &mut buf };
        w.buf.extend_from_slice(&SUPERBLOCK_MAGIC);
        w.u32(self.format_version);
        w.u32(SUPERBLOCK_SLOT_BYTES as u32);
        w.buf.extend_from_slice(&self.uuid);
        w.u64(self.generation);
        w.u64(self.logical_size_bytes);
        w.u64(self.physical_size_bytes);
        w.u64(self.segment_size_bytes);
        assert_eq!(w.buf.len(), CODEC_TAG_OFFSET);
        w.u8(self.codec_tag);
        w.u8(0);
        w.u16(0);
        w.u32(self.codec_level as u32);
        w.u64(self.feature_flags);
        w.u64(self.checkpoint_seq);
        w.u64(self.replay_offset_bytes);
        w.u32(self.replay_prev_crc);
        w.u32(self.checkpoint_chunks.len() as u32);
        assert_eq!(w.buf.len(), OVER_PROVISION_OFFSET);
        w.u32(self.over_provision_ppm);
        assert_eq!(w.buf.len(), MAC_OFFSET);
        w.buf.extend_from_slice(&self.mac);
        assert_eq!(w.buf.len(), CHUNK_REFS_OFFSET);
        for chunk in &self.checkpoint_chunks {
            w.u64(chunk.offset_bytes);
            w.u32(chunk.length_bytes);
            w.u32(chunk.crc);
        }
        buf.resize(CRC_OFFSET, 0);
        let crc = crc32c::crc32c(&buf);
        buf.extend_from_slice(&crc.to_le_bytes());
        buf
    }

    /// Decodes one slot. A foreign magic is `NotAStore`; a newer version `NewerVersion`;
    /// anything else wrong is `Corrupt`.
    pub fn decode(slot: &[u8]) -> Result<Superblock> {
        if slot.len() < SUPERBLOCK_SLOT_BYTES || slot[MAGIC_OFFSET..VERSION_OFFSET] != SUPERBLOCK_MAGIC {
            return Err(Error::new(ErrorKind::NotAStore, "no zdisk superblock magic"));
        }
        let slot = &slot[..SUPERBLOCK_SLOT_BYTES];
        if crc32c::crc32c(&slot[..CRC_OFFSET]) != super::u32_at(slot, CRC_OFFSET) {
            return Err(corrupt("superblock checksum mismatch"));
        }
        let mut r = Reader::new(&slot[VERSION_OFFSET..], "superblock");
        let format_version = r.u32()?;
        if format_version > FORMAT_VERSION_ENCRYPTED {
            return Err(Error::new(
                ErrorKind::NewerVersion,
                format!("format version {format_version}, this zdisk reads up to {FORMAT_VERSION_ENCRYPTED}"),
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
        let over_provision_ppm = r.u32()?;
        let mac: [u8; SUPERBLOCK_MAC_BYTES] = r.bytes(SUPERBLOCK_MAC_BYTES)?.try_into().expect("12 bytes");
        if over_provision_ppm >= 1_000_000 {
            return Err(corrupt(format!("over-provisioning of {over_provision_ppm} ppm")));
        }
        if chunk_count > CHUNK_REFS_MAX {
            return Err(corrupt(format!("superblock lists {chunk_count} checkpoint chunks")));
        }
        let checkpoint_chunks = (0..chunk_count)
            .map(|_| Ok(ChunkRef { offset_bytes: r.u64()?, length_bytes: r.u32()?, crc: r.u32()? }))
            .collect::<Result<Vec<_>>>()?;
        if feature_flags & !FEATURES_KNOWN != 0 {
            return Err(Error::new(ErrorKind::NewerVersion, format!("unknown feature flags {feature_flags:#x}")));
        }
        if (feature_flags & FEATURE_ENCRYPTED != 0) != (format_version == FORMAT_VERSION_ENCRYPTED) {
            return Err(corrupt("the superblock's version and encryption flag disagree"));
        }
        if (feature_flags & FEATURE_ENCRYPTED != 0) != (feature_flags & FEATURE_AUTHENTICATED_LOG != 0) {
            return Err(corrupt(if feature_flags & FEATURE_ENCRYPTED != 0 {
                "an encrypted store made by zdisk before 2026-11-25 (its records carry no MACs): \
                 this version cannot read it; recreate the store"
            } else {
                "the authenticated-log flag on a plain store"
            }));
        }
        if feature_flags & FEATURE_PLACEMENT_USE != 0 && feature_flags & FEATURE_ENCRYPTED == 0 {
            return Err(corrupt("the placement-use flag on a plain store"));
        }
        if feature_flags & FEATURE_SHORT_NONCES != 0 && feature_flags & FEATURE_ENCRYPTED == 0 {
            return Err(corrupt("the short-nonce flag on a plain store"));
        }
        CodecTag::from_u8(codec_tag)?;
        if segment_size_bytes == 0
            || !segment_size_bytes.is_multiple_of(crate::SECTOR_SIZE as u64)
            || !logical_size_bytes.is_multiple_of(crate::BLOCK_SIZE as u64)
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
            over_provision_ppm,
            mac,
            checkpoint_chunks,
        })
    }

    /// Whether the store is encrypted (format version 5).
    pub fn encrypted(&self) -> bool {
        self.feature_flags & FEATURE_ENCRYPTED != 0
    }

    /// The format version a store is written with: 5 when encrypted, else 4.
    pub fn version_for(encrypted: bool) -> u32 {
        if encrypted {
            FORMAT_VERSION_ENCRYPTED
        } else {
            FORMAT_VERSION
        }
    }

    /// The bytes a superblock MAC covers: this slot with its MAC (and CRC) zero.
    pub fn mac_input(&self) -> Vec<u8> {
        let mut bytes = Superblock { mac: [0; SUPERBLOCK_MAC_BYTES], ..self.clone() }.encode();
        bytes.truncate(CRC_OFFSET);
        bytes
    }

    pub fn segment_count(&self) -> u64 {
        (self.physical_size_bytes - DATA_START_BYTES) / self.segment_size_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    pub fn sample_superblock() -> Superblock {
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
            over_provision_ppm: 70_000,
            mac: [7; SUPERBLOCK_MAC_BYTES],
            checkpoint_chunks: vec![ChunkRef { offset_bytes: 2 << 20, length_bytes: 100, crc: 5 }],
        }
    }

    #[test]
    fn superblock_round_trips() {
        let sb = sample_superblock();
        let bytes = sb.encode();
        assert_eq!(bytes.len(), SUPERBLOCK_SLOT_BYTES);
        assert_eq!(Superblock::decode(&bytes).unwrap(), sb);
        // The offsets docs/format.md gives.
        assert_eq!(bytes[GENERATION_OFFSET], 3);
        assert_eq!(super::super::u64_at(&bytes, CHECKPOINT_SEQ_OFFSET), 42);
        assert_eq!(super::super::u32_at(&bytes, CHUNK_COUNT_OFFSET), 1);
        assert_eq!(super::super::u32_at(&bytes, 104), 70_000);
    }

    #[test]
    fn the_dictionary_feature_flag_is_read_and_any_other_is_a_newer_version() {
        let with_dictionaries = Superblock { feature_flags: FEATURE_DICTIONARIES, ..sample_superblock() };
        let bytes = with_dictionaries.encode();
        assert_eq!(FEATURE_FLAGS_OFFSET, 72, "docs/format.md");
        assert_eq!(super::super::u64_at(&bytes, FEATURE_FLAGS_OFFSET), 1);
        assert_eq!(Superblock::decode(&bytes).unwrap(), with_dictionaries);
        let unknown = Superblock { feature_flags: FEATURE_DICTIONARIES | 64, ..sample_superblock() };
        assert_eq!(Superblock::decode(&unknown.encode()).unwrap_err().kind(), ErrorKind::NewerVersion);
        // Placement tags that bind the segment's use: an encrypted store's flag only.
        let placement_plain = Superblock { feature_flags: FEATURE_PLACEMENT_USE, ..sample_superblock() };
        assert_eq!(Superblock::decode(&placement_plain.encode()).unwrap_err().kind(), ErrorKind::Corrupt);
        let short_plain = Superblock { feature_flags: FEATURE_SHORT_NONCES, ..sample_superblock() };
        assert_eq!(Superblock::decode(&short_plain.encode()).unwrap_err().kind(), ErrorKind::Corrupt);
        // Encryption: flag and version 5 together, never one without the other.
        let encrypted_flags = FEATURE_ENCRYPTED | FEATURE_AUTHENTICATED_LOG;
        let plain_version = Superblock { feature_flags: encrypted_flags, ..sample_superblock() };
        assert_eq!(Superblock::decode(&plain_version.encode()).unwrap_err().kind(), ErrorKind::Corrupt);
        let encrypted = Superblock {
            feature_flags: encrypted_flags,
            format_version: FORMAT_VERSION_ENCRYPTED,
            ..sample_superblock()
        };
        assert!(Superblock::decode(&encrypted.encode()).unwrap().encrypted());
        // Encrypted without the authenticated log: made by the code before; refused by name.
        let earlier = Superblock { feature_flags: FEATURE_ENCRYPTED, ..encrypted.clone() };
        let err = Superblock::decode(&earlier.encode()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt);
        assert!(err.to_string().contains("recreate the store"), "{err}");
        let stray = Superblock { feature_flags: FEATURE_AUTHENTICATED_LOG, ..sample_superblock() };
        assert_eq!(Superblock::decode(&stray.encode()).unwrap_err().kind(), ErrorKind::Corrupt);
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
    }
}
