//! The flush proof: one sector, written after a flush's sync and synced before the flush
//! is acknowledged, saying which records that sync made durable (`docs/format.md`, "Flush
//! proof").
//!
//! Why it exists: nothing written *with* a record can prove, after a crash, that its sync
//! completed, so a damaged last record looks like a torn write. The proof is written only
//! after the sync, so any copy of it that reads back is a true statement, and a flushed
//! record it covers that does not verify decayed — recovery fails its blocks instead of
//! serving what they held before.
//!
//! The entry is written twice in its sector, in different 512-byte pieces: a write torn
//! between them leaves one copy whole (the older, or the newer — both are true), and decay
//! must take both copies before recovery cannot tell what was proven.

use super::{u32_at, u64_at};

/// Where the sector lives: after the superblock slots (0, 16 KiB) and an encrypted store's
/// key headers (32, 48 KiB), in the area before the first segment.
pub const FLUSH_PROOF_OFFSET_BYTES: u64 = 64 << 10;
/// The sector written (one backing sector).
pub const FLUSH_PROOF_BYTES: usize = 4096;
/// "ZPRF".
pub const FLUSH_PROOF_MAGIC: u32 = 0x4652_505A;
/// The two copies' offsets in the sector: different 512-byte pieces.
const COPY_OFFSETS: [usize; 2] = [0, 2048];

const MAGIC_OFFSET: usize = 0;
const STORE_TAG_OFFSET: usize = MAGIC_OFFSET + 4;
const GENERATION_OFFSET: usize = STORE_TAG_OFFSET + 4;
const PROVEN_SEQ_OFFSET: usize = GENERATION_OFFSET + 8;
const SESSION_OFFSET: usize = PROVEN_SEQ_OFFSET + 8;
const CRC_OFFSET: usize = SESSION_OFFSET + 4;
/// One copy's bytes.
pub const FLUSH_PROOF_ENTRY_BYTES: usize = CRC_OFFSET + 4;
const _: () = assert!(FLUSH_PROOF_ENTRY_BYTES == 32);
const _: () = assert!(FLUSH_PROOF_ENTRY_BYTES <= 512);

/// What one flush proved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushProof {
    /// Counts up with every proof written to this store (the newest copy wins).
    pub generation: u64,
    /// Every record up to this sequence number was durable when the proof was written.
    pub proven_seq: u64,
    /// The session nonce of the run that wrote it: the records it proved past that run's
    /// start carry the same (a crashed earlier run's records at those sequence numbers do not).
    pub session: u32,
}

/// What the proof sector says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProofSector {
    /// All zero: never written (a store formatted before flush proofs, or a new one).
    Empty,
    Proof(FlushProof),
    /// Neither copy verifies and the sector is not empty: what was proven is unknown.
    Damaged,
}

impl FlushProof {
    /// The whole sector, both copies in place, the rest zero.
    pub fn encode_sector(&self, store_tag: u32) -> [u8; FLUSH_PROOF_BYTES] {
        let mut entry = [0u8; FLUSH_PROOF_ENTRY_BYTES];
        entry[MAGIC_OFFSET..][..4].copy_from_slice(&FLUSH_PROOF_MAGIC.to_le_bytes());
        entry[STORE_TAG_OFFSET..][..4].copy_from_slice(&store_tag.to_le_bytes());
        entry[GENERATION_OFFSET..][..8].copy_from_slice(&self.generation.to_le_bytes());
        entry[PROVEN_SEQ_OFFSET..][..8].copy_from_slice(&self.proven_seq.to_le_bytes());
        entry[SESSION_OFFSET..][..4].copy_from_slice(&self.session.to_le_bytes());
        let crc = crc32c::crc32c(&entry[..CRC_OFFSET]);
        entry[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        let mut sector = [0u8; FLUSH_PROOF_BYTES];
        for at in COPY_OFFSETS {
            sector[at..at + FLUSH_PROOF_ENTRY_BYTES].copy_from_slice(&entry);
        }
        sector
    }

    /// One copy at `at`, if it verifies and belongs to this store.
    fn decode_copy(sector: &[u8], at: usize, store_tag: u32) -> Option<FlushProof> {
        let entry = sector.get(at..at + FLUSH_PROOF_ENTRY_BYTES)?;
        let valid = u32_at(entry, MAGIC_OFFSET) == FLUSH_PROOF_MAGIC
            && u32_at(entry, STORE_TAG_OFFSET) == store_tag
            && u32_at(entry, CRC_OFFSET) == crc32c::crc32c(&entry[..CRC_OFFSET]);
        valid.then(|| FlushProof {
            generation: u64_at(entry, GENERATION_OFFSET),
            proven_seq: u64_at(entry, PROVEN_SEQ_OFFSET),
            session: u32_at(entry, SESSION_OFFSET),
        })
    }
}

impl ProofSector {
    /// Decodes the sector: the newest copy that verifies. (A copy of another store, or any
    /// other non-zero bytes, is damage: format zeroes the sector.)
    pub fn decode(sector: &[u8], store_tag: u32) -> ProofSector {
        let newest = COPY_OFFSETS
            .iter()
            .filter_map(|&at| FlushProof::decode_copy(sector, at, store_tag))
            .max_by_key(|p| p.generation);
        match newest {
            Some(proof) => ProofSector::Proof(proof),
            None if sector.iter().all(|&b| b == 0) => ProofSector::Empty,
            None => ProofSector::Damaged,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TAG: u32 = 0xfeed_beef;

    fn proof(generation: u64) -> FlushProof {
        FlushProof { generation, proven_seq: 1000 + generation, session: 7 }
    }

    #[test]
    fn a_sector_round_trips_and_zeros_are_empty() {
        let sector = proof(3).encode_sector(TAG);
        assert_eq!(ProofSector::decode(&sector, TAG), ProofSector::Proof(proof(3)));
        assert_eq!(ProofSector::decode(&[0u8; FLUSH_PROOF_BYTES], TAG), ProofSector::Empty);
        // Another store's proof is damage, not a proof (format zeroes the sector).
        assert_eq!(ProofSector::decode(&sector, TAG + 1), ProofSector::Damaged);
    }

    #[test]
    fn one_damaged_copy_leaves_the_other_and_both_leave_nothing() {
        let mut sector = proof(5).encode_sector(TAG);
        sector[PROVEN_SEQ_OFFSET] ^= 1;
        assert_eq!(ProofSector::decode(&sector, TAG), ProofSector::Proof(proof(5)));
        sector[COPY_OFFSETS[1] + GENERATION_OFFSET] ^= 4;
        assert_eq!(ProofSector::decode(&sector, TAG), ProofSector::Damaged);
    }

    #[test]
    fn a_write_torn_between_the_copies_reads_as_either_proof() {
        // The first 2 KiB new, the rest old: the newer copy wins; both are true.
        let old = proof(8).encode_sector(TAG);
        let new = proof(9).encode_sector(TAG);
        let mut torn = old;
        torn[..2048].copy_from_slice(&new[..2048]);
        assert_eq!(ProofSector::decode(&torn, TAG), ProofSector::Proof(proof(9)));
        let mut torn = new;
        torn[..2048].copy_from_slice(&old[..2048]);
        assert_eq!(ProofSector::decode(&torn, TAG), ProofSector::Proof(proof(9)));
    }
}
