//! Map pages: 512 `u64` values each. A leaf holds the map entries of 512 consecutive blocks;
//! an interior page holds the packed pointers (map-entry encoding, `PackedEntry`) to 512
//! child pages. Level 0 is the leaves; the tree is as tall as the logical size needs, and
//! the checkpoint points at its root.
//!
//! On disk a page is a fragment like a block's (`docs/format.md`, "Map pages"): protection
//! information whose reference tag is the page id, then the page compressed with zstd. A
//! read checks the guard (CRC32C of the 4 KiB page) and that the page is the one the parent
//! meant, so a damaged or misdirected page is an error, never another page's entries.

use super::Stored;
use crate::codec::{decompress_block, CodecTag};
use crate::crypto::cipher::{Domain, SegmentUse, StoreCipher};
use crate::error::{Error, ErrorKind, Result};
use crate::format::{FragmentEntry, Protection, PI_BYTES};
use crate::types::Lba;
use crate::BLOCK_SIZE;

/// Values per page (leaf entries or child pointers).
pub const PAGE_SLOTS: usize = 512;
const SLOT_BITS: u32 = 9;
const _: () = assert!(PAGE_SLOTS * 8 == BLOCK_SIZE && 1 << SLOT_BITS == PAGE_SLOTS);
/// Levels a page id can name (level in the top 3 bits of its 48).
pub const LEVELS_MAX: u8 = 7;
const LEVEL_SHIFT: u32 = 45;
/// zstd level pages are compressed with (their entries are mostly high-entropy addresses:
/// higher levels buy little).
const PAGE_ZSTD_LEVEL: i32 = 1;

/// Which page: its level (0 = leaf) and its index within the level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId {
    pub level: u8,
    pub index: u64,
}

impl PageId {
    pub fn leaf_of(lba: Lba) -> (PageId, usize) {
        (PageId { level: 0, index: lba.0 >> SLOT_BITS }, (lba.0 as usize) & (PAGE_SLOTS - 1))
    }

    /// The leaves that hold `lbas`' entries, ascending, each once.
    pub fn leaves_of(lbas: impl Iterator<Item = Lba>) -> Vec<PageId> {
        let mut leaves: Vec<PageId> = lbas.map(|lba| PageId::leaf_of(lba).0).collect();
        leaves.sort_unstable();
        leaves.dedup();
        leaves
    }

    /// The parent page and the slot that points here.
    pub fn parent(self) -> (PageId, usize) {
        (PageId { level: self.level + 1, index: self.index >> SLOT_BITS }, (self.index as usize) & (PAGE_SLOTS - 1))
    }

    /// The id as the 48-bit reference tag of the page's fragment.
    pub fn tag(self) -> Lba {
        assert!(self.level <= LEVELS_MAX && self.index < 1 << LEVEL_SHIFT);
        Lba((self.level as u64) << LEVEL_SHIFT | self.index)
    }

    pub fn from_tag(tag: Lba) -> PageId {
        PageId { level: (tag.0 >> LEVEL_SHIFT) as u8, index: tag.0 & ((1 << LEVEL_SHIFT) - 1) }
    }

    /// The first block this page maps.
    pub fn first_lba(self) -> Lba {
        Lba(self.index << (SLOT_BITS * (self.level as u32 + 1)))
    }
}

/// Levels a map of `block_count` blocks needs (1: the root is a leaf).
pub fn height_for(block_count: u64) -> u8 {
    let mut pages = block_count.div_ceil(PAGE_SLOTS as u64).max(1);
    let mut height = 1;
    while pages > 1 {
        pages = pages.div_ceil(PAGE_SLOTS as u64);
        height += 1;
    }
    height
}

pub type PageBody = [u64; PAGE_SLOTS];

/// The fragment of a page: protection information, then the page compressed (and, in an
/// encrypted store, sealed: its guard then is the placement tag the log sets where the page
/// lands, as a block's; zero until then). With it, the nonce epoch a short-nonce page's
/// segment must record.
pub fn encode(
    id: PageId,
    body: &PageBody,
    cipher: Option<&StoreCipher>,
) -> Result<(FragmentEntry, Vec<u8>, Option<u16>)> {
    let raw: Vec<u8> = body.iter().flat_map(|v| v.to_le_bytes()).collect();
    let plain_guard = crc32c::crc32c(&raw);
    let compressed = zstd::bulk::compress(&raw, PAGE_ZSTD_LEVEL).expect("zstd compression of a memory buffer");
    let (codec, data) = if compressed.len() < raw.len() { (CodecTag::Zstd, compressed) } else { (CodecTag::Raw, raw) };
    let Some(cipher) = cipher else {
        let entry = FragmentEntry { stored_len: (PI_BYTES + data.len()) as u16, codec };
        let mut bytes = Vec::with_capacity(entry.stored_len as usize);
        bytes.extend_from_slice(&Protection { guard: plain_guard, lba: id.tag(), entry }.encode());
        bytes.extend_from_slice(&data);
        return Ok((entry, bytes, None));
    };
    let entry = FragmentEntry { stored_len: (PI_BYTES + cipher.fragment_overhead_bytes() + data.len()) as u16, codec };
    let mut bytes = Protection { guard: 0, lba: id.tag(), entry }.encode().to_vec();
    let epoch = cipher.seal(Domain::MapPage, id.tag().0, entry.packed(), &data, &mut bytes)?;
    Ok((entry, bytes, cipher.short_nonces().then_some(epoch)))
}

/// Decodes and checks a page's fragment, at the place `s` its pointer gives: it must be page
/// `id`, with the length and codec the pointer gives, and decode to its guard (encrypted:
/// carry the placement tag of that address, and open under the store's key).
/// `in_use`: the use of the segment the page lies in (what an encrypted store's placement
/// tags bind besides the address, and its nonce epoch).
pub fn decode(
    id: PageId,
    s: Stored,
    bytes: &[u8],
    cipher: Option<&StoreCipher>,
    in_use: SegmentUse,
) -> Result<Box<PageBody>> {
    let entry = s.fragment_entry();
    let bad = |why: &str| Error::new(ErrorKind::Checksum, format!("map page {id:?}: {why}"));
    if bytes.len() != entry.stored_len as usize || bytes.len() < PI_BYTES {
        return Err(bad("wrong length"));
    }
    let pi = Protection::decode(&bytes[..PI_BYTES]).map_err(|_| bad("bad protection information"))?;
    if pi.lba != id.tag() || pi.entry != entry {
        return Err(bad(&format!("the fragment is page {:?}'s", PageId::from_tag(pi.lba))));
    }
    let mut raw = vec![0u8; BLOCK_SIZE];
    let output = match cipher {
        Some(cipher) => {
            if cipher.placement(s.offset_bytes, in_use.seq, &bytes[PI_BYTES..]) != pi.guard {
                return Err(bad("fails authentication: not the page written at this address"));
            }
            cipher
                .open(Domain::MapPage, id.tag().0, entry.packed(), &bytes[PI_BYTES..], in_use.nonce_epoch)
                .map_err(|_| bad("fails authentication"))?
        }
        None => bytes[PI_BYTES..].to_vec(),
    };
    decompress_block(entry.codec, &output, &mut raw, &crate::codec::NO_DICTIONARIES)
        .map_err(|_| bad("does not decompress"))?;
    if cipher.is_none() && crc32c::crc32c(&raw) != pi.guard {
        return Err(bad("CRC32C mismatch"));
    }
    let mut body = Box::new([0u64; PAGE_SLOTS]);
    for (value, chunk) in body.iter_mut().zip(raw.chunks_exact(8)) {
        *value = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_round_trip_and_refuse_to_be_another_page() {
        let id = PageId { level: 1, index: 77 };
        let mut body = [0u64; PAGE_SLOTS];
        for (i, v) in body.iter_mut().enumerate() {
            *v = if i % 3 == 0 { 0 } else { (i as u64) << 20 | 3 };
        }
        let key = crate::crypto::DataKey::from_bytes([9; 32]);
        let source = crate::crypto::cipher::NonceSource::for_tests();
        let cipher = StoreCipher::new([1; 16], &key, Some(source));
        for cipher in [None, Some(&cipher)] {
            let (entry, mut bytes, epoch) = encode(id, &body, cipher).unwrap();
            assert_eq!(epoch, cipher.map(|_| 0), "a short nonce's epoch (the test source's first)");
            let in_use = |seq, nonce_epoch| SegmentUse { seq, nonce_epoch };
            let at = |offset_bytes| Stored {
                offset_bytes,
                stored_len: entry.stored_len,
                codec: entry.codec,
                format: crate::format::FragmentFormat::V3,
            };
            if let Some(cipher) = cipher {
                // Placed at 1 MiB (what the log does as it appends): elsewhere it does not read.
                // So are its use's: the same address in another use of the segment is not it.
                let guard = cipher.placement(1 << 20, 5, &bytes[PI_BYTES..]);
                bytes[..4].copy_from_slice(&guard.to_le_bytes());
                assert!(decode(id, at(2 << 20), &bytes, Some(cipher), in_use(5, 0)).is_err());
                assert!(decode(id, at(1 << 20), &bytes, Some(cipher), in_use(6, 0)).is_err());
                // The nonce's high bits are its segment's epoch: another epoch does not open.
                assert!(decode(id, at(1 << 20), &bytes, Some(cipher), in_use(5, 1)).is_err());
            }
            assert_eq!(*decode(id, at(1 << 20), &bytes, cipher, in_use(5, 0)).unwrap(), body);
            assert!(decode(PageId { level: 1, index: 78 }, at(1 << 20), &bytes, cipher, in_use(5, 0)).is_err());
            let mut damaged = bytes.clone();
            damaged[PI_BYTES + 5] ^= 1;
            assert!(decode(id, at(1 << 20), &damaged, cipher, in_use(5, 0)).is_err());
        }
    }

    #[test]
    fn heights_and_ids() {
        assert_eq!(height_for(1), 1);
        assert_eq!(height_for(512), 1);
        assert_eq!(height_for(513), 2);
        assert_eq!(height_for(512 * 512), 2);
        assert_eq!(height_for(512 * 512 + 1), 3);
        assert_eq!(height_for(1 << 48), 6);
        let (leaf, slot) = PageId::leaf_of(Lba(512 * 3 + 7));
        assert_eq!((leaf, slot), (PageId { level: 0, index: 3 }, 7));
        assert_eq!(leaf.parent(), (PageId { level: 1, index: 0 }, 3));
        assert_eq!(PageId::from_tag(PageId { level: 5, index: 123 }.tag()), PageId { level: 5, index: 123 });
        assert_eq!(PageId { level: 1, index: 2 }.first_lba(), Lba(2 * 512 * 512));
    }
}
