//! What an encrypted store does with its data key (`docs/format.md`, "Encryption").
//!
//! - **Fragments** (data blocks, map pages) are sealed after compression with AES-256-GCM-SIV
//!   under a fragment key derived from the data key. A sealed fragment's bytes after its 12
//!   bytes of protection information are `nonce u64 | ciphertext | tag (16)`; the protection
//!   information stays in the clear (the LBA and length are visible in the log anyway) and
//!   its guard becomes the CRC32C of those sealed bytes, so replay and `check` verify a
//!   fragment's integrity without the key, and reveal nothing about the plaintext.
//! - The **associated data** binds a fragment to its store, its kind (block, map page,
//!   dictionary), its reference tag (LBA or page id) and its length and codec: a fragment
//!   copied to another LBA, page or store fails authentication and reads as EIO.
//! - **Nonces**: 96 bits, the top 32 zero and the low 64 a counter. The counter's values
//!   come from leases made durable in the key header before first use ([`NonceSource`]), so
//!   no value is handed out twice, across crashes too. A fragment stores the counter's low
//!   32 bits; the high bits are the **nonce epoch**, which the segment the fragment lies in
//!   records (every fragment of a segment's use has its epoch; `docs/format.md`, "Nonces").
//!   Stores formatted before 2026-11-27 (no `FEATURE_SHORT_NONCES`) store all 64 bits, as do
//!   dictionaries, which lie in checkpoints, not in segments.
//! - **Metadata**: checkpoints and superblocks carry an HMAC-SHA-256 (truncated to 96 bits)
//!   under a separate metadata key.

use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;

use aes::cipher::{BlockCipherEncrypt, KeyInit};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use zeroize::Zeroizing;

use super::aead::{Aead, NONCE_BYTES};
use super::keys::KeyHeader;
use super::{DataKey, KeyMemoryLock, KEY_BYTES};
use crate::backing::Backing;
use crate::error::{Error, ErrorKind, Result};
use crate::store::lock::{Mutex, MutexGuard, Rank};

/// The stored part of a whole nonce: the counter, u64 (dictionaries; every fragment of a
/// store formatted before 2026-11-27).
pub const NONCE_STORED_BYTES: usize = 8;
/// The stored part of a fragment's nonce in a store with short nonces: the counter's low 32
/// bits (the rest is the epoch its segment records).
pub const NONCE_SHORT_STORED_BYTES: usize = 4;
/// The AEAD's authentication tag.
pub use super::aead::TAG_BYTES;
/// What sealing adds at most (a whole stored nonce and the tag): what capacity and space
/// rules count, so they hold for both layouts.
pub const SEAL_OVERHEAD_BYTES: usize = NONCE_STORED_BYTES + TAG_BYTES;
/// Counter values per nonce epoch: the epoch is the counter's bits 32 and up.
pub const NONCES_PER_EPOCH: u64 = 1 << 32;
/// The high bits of a nonce counter that a short-nonce fragment does not store: recorded per
/// segment use (`SegmentUsage::nonce_epoch`) and in every record's head. 16 bits: 2^48
/// counter values per store.
pub type NonceEpoch = u16;
/// Bytes of a metadata MAC (HMAC-SHA-256 truncated, as RFC 2104 allows down to half).
pub const MAC_BYTES: usize = 12;
/// Nonces reserved per key-header write: 2^24 (a write per open, and one per 16.7 million
/// fragments sealed — every few minutes under a full write load). Small against an epoch
/// (2^32), so a crash wastes at most 1/256 of one, and 2^24 opens fit in a store's 2^48.
pub const NONCE_LEASE_DEFAULT: u64 = 1 << 24;

/// The use of the segment a fragment lies in: the sequence number of the use's first record
/// (what placement tags bind besides the address) and the nonce epoch of its fragments
/// (what a short nonce lacks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SegmentUse {
    pub seq: u64,
    pub nonce_epoch: NonceEpoch,
}

/// What a sealed thing is; part of its associated data, so one kind never passes for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Domain {
    Block = 1,
    MapPage = 2,
    Dictionary = 3,
}

/// The keys derived from a store's data key, and the nonce source.
pub struct StoreCipher {
    uuid: [u8; 16],
    /// Boxed, so the locked pages stay where the keys are however the cipher moves.
    keys: Box<DerivedKeys>,
    /// After `keys`: dropped after them (zeroized, then unlocked).
    _locked: KeyMemoryLock,
    nonces: NonceSource,
    /// Placement tags bind the segment's use as well as the address (superblock feature
    /// `FEATURE_PLACEMENT_USE`); false in stores formatted before 2026-11-26.
    placement_binds_use: bool,
    /// Fragments store the nonce's low 32 bits only (superblock feature
    /// `FEATURE_SHORT_NONCES`); false in stores formatted before 2026-11-27.
    short_nonces: bool,
}

/// The fragment key (as the AEAD's key schedule, in AWS-LC's allocation, which it cleanses
/// when freed), the placement key (an AES-256 key schedule, zeroized on drop by the `aes`
/// crate's `zeroize` feature) and the metadata key.
struct DerivedKeys {
    fragments: Aead,
    placement: aes::Aes256,
    metadata_key: Zeroizing<[u8; KEY_BYTES]>,
}

impl std::fmt::Debug for StoreCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreCipher(..)")
    }
}

impl StoreCipher {
    /// The cipher of store `uuid`. `nonces` is `None` for a read-only open: it seals nothing.
    pub fn new(uuid: [u8; 16], key: &DataKey, nonces: Option<NonceSource>) -> StoreCipher {
        let fragment_key = derive(key, &uuid, b"zdisk fragments v1");
        let keys = Box::new(DerivedKeys {
            fragments: Aead::new(&fragment_key),
            placement: aes::Aes256::new_from_slice(derive(key, &uuid, b"zdisk placement v1").as_slice())
                .expect("a 32-byte key"),
            metadata_key: derive(key, &uuid, b"zdisk metadata v1"),
        });
        let locked = KeyMemoryLock::new(keys.as_ref());
        StoreCipher {
            uuid,
            keys,
            _locked: locked,
            nonces: nonces.unwrap_or_else(NonceSource::none),
            placement_binds_use: true,
            short_nonces: true,
        }
    }

    /// The cipher of a store formatted before short nonces: every fragment stores its whole
    /// nonce.
    pub fn with_whole_nonces(mut self) -> StoreCipher {
        self.short_nonces = false;
        self
    }

    /// Whether fragments store only the nonce's low 32 bits (their segment has the epoch).
    pub fn short_nonces(&self) -> bool {
        self.short_nonces
    }

    /// Bytes sealing adds to a fragment (block or map page) of this store.
    pub fn fragment_overhead_bytes(&self) -> usize {
        self.nonce_bytes(Domain::Block) + TAG_BYTES
    }

    /// The epoch of the nonces the source hands out now (what a segment begun now records).
    pub fn current_epoch(&self) -> NonceEpoch {
        self.nonces.epoch.load(Ordering::Acquire)
    }

    /// Stored nonce bytes of a sealed thing of `domain`: a dictionary lies in a checkpoint,
    /// where no segment records an epoch, so it keeps its whole nonce.
    fn nonce_bytes(&self, domain: Domain) -> usize {
        if self.short_nonces && domain != Domain::Dictionary {
            NONCE_SHORT_STORED_BYTES
        } else {
            NONCE_STORED_BYTES
        }
    }

    /// The cipher of a store formatted before placement tags bound the segment's use: its
    /// tags are of the address alone (`placement`).
    pub fn with_address_only_placement(mut self) -> StoreCipher {
        self.placement_binds_use = false;
        self
    }

    /// Seals `plaintext` as a fragment of `domain` with reference tag `tag` whose
    /// protection information will carry `entry_packed` (length and codec): appends
    /// `nonce | ciphertext | tag` to `out` (the nonce's stored bytes: 4 or 8). Returns the
    /// nonce's epoch, which a short-nonce fragment's segment must record.
    pub fn seal(
        &self,
        domain: Domain,
        tag: u64,
        entry_packed: u16,
        plaintext: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<NonceEpoch> {
        let counter = self.nonces.next()?;
        out.extend_from_slice(&counter.to_le_bytes()[..self.nonce_bytes(domain)]);
        let start = out.len();
        out.extend_from_slice(plaintext);
        let aad = self.associated_data(domain, tag, entry_packed);
        let sealed_tag = self.keys.fragments.seal(nonce(counter), &aad, &mut out[start..]);
        out.extend_from_slice(&sealed_tag);
        Ok(epoch_of(counter))
    }

    /// Opens `sealed` (`nonce | ciphertext | tag`), checking it against what the reader
    /// expects it to be; returns the plaintext. `epoch` is what the fragment's segment (or
    /// record) records: a short nonce's high bits (ignored where the whole nonce is stored).
    /// Any mismatch is a `Checksum` error.
    pub fn open(
        &self,
        domain: Domain,
        tag: u64,
        entry_packed: u16,
        sealed: &[u8],
        epoch: NonceEpoch,
    ) -> Result<Vec<u8>> {
        let bad = || Error::new(ErrorKind::Checksum, "fragment fails authentication");
        let nonce_bytes = self.nonce_bytes(domain);
        if sealed.len() < nonce_bytes + TAG_BYTES {
            return Err(bad());
        }
        let (stored, rest) = sealed.split_at(nonce_bytes);
        let (ciphertext, auth) = rest.split_at(rest.len() - TAG_BYTES);
        let mut counter = [0u8; 8];
        counter[..nonce_bytes].copy_from_slice(stored);
        let mut counter = u64::from_le_bytes(counter);
        if nonce_bytes == NONCE_SHORT_STORED_BYTES {
            counter |= (epoch as u64) << 32;
        }
        let mut plaintext = ciphertext.to_vec();
        let aad = self.associated_data(domain, tag, entry_packed);
        self.keys.fragments.open(nonce(counter), &aad, &mut plaintext, auth).map_err(|_| bad())?;
        Ok(plaintext)
    }

    /// Seals again, under a fresh nonce, a fragment (`nonce | ciphertext | tag`, of
    /// `domain`, `tag` and `entry_packed`) sealed under epoch `epoch`, for a segment of
    /// another epoch: the same length. Returns the new bytes and their epoch, or `None` if
    /// the fragment does not open (damaged: it is moved as it is and still reads as EIO).
    pub fn reseal(
        &self,
        domain: Domain,
        tag: u64,
        entry_packed: u16,
        sealed: &[u8],
        epoch: NonceEpoch,
    ) -> Result<Option<(Vec<u8>, NonceEpoch)>> {
        let Ok(plaintext) = self.open(domain, tag, entry_packed, sealed, epoch) else { return Ok(None) };
        let mut out = Vec::with_capacity(sealed.len());
        let epoch = self.seal(domain, tag, entry_packed, &plaintext, &mut out)?;
        assert_eq!(out.len(), sealed.len());
        Ok(Some((out, epoch)))
    }

    /// The placement tag of a sealed fragment (`nonce | ciphertext | tag`) written at byte
    /// `address` of a segment whose current use began with record `use_seq`: the first 32
    /// bits of AES-256, under the placement key, of the address and the first 8 bytes of the
    /// fragment's AEAD tag — encrypted once more after `use_seq` is added in (a CBC-MAC of
    /// two blocks, a PRF for messages of this one length). It is the fragment's guard in an
    /// encrypted store (`docs/format.md`, "Sealed fragments"): the log sets it where the
    /// fragment lands, so an authentic fragment — an older version of the block included —
    /// put anywhere else, or at the same address in an earlier use of the segment, fails it.
    /// A store formatted before 2026-11-26 binds the address alone (one block). Two AES
    /// blocks: cheap enough for the log lock.
    pub fn placement(&self, address: u64, use_seq: u64, sealed: &[u8]) -> u32 {
        let mut block = aes::Block::default();
        block[..8].copy_from_slice(&address.to_le_bytes());
        if let Some(tag) = sealed.len().checked_sub(TAG_BYTES).and_then(|at| sealed.get(at..at + 8)) {
            block[8..].copy_from_slice(tag);
        }
        self.keys.placement.encrypt_block(&mut block);
        if self.placement_binds_use {
            for (b, u) in block[..8].iter_mut().zip(use_seq.to_le_bytes()) {
                *b ^= u;
            }
            self.keys.placement.encrypt_block(&mut block);
        }
        u32::from_le_bytes(block[..4].try_into().expect("4 bytes"))
    }

    /// The MAC of `parts`, concatenated, under the metadata key.
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; MAC_BYTES] {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(self.keys.metadata_key.as_slice()).expect("any key length");
        mac.update(&self.uuid);
        for part in parts {
            mac.update(part);
        }
        let full = mac.finalize().into_bytes();
        full[..MAC_BYTES].try_into().expect("12 bytes")
    }

    /// Checks `expected` against the MAC of `parts` in constant time.
    pub fn verify_mac(&self, parts: &[&[u8]], expected: &[u8]) -> bool {
        let computed = self.mac(parts);
        expected.len() == MAC_BYTES && computed.iter().zip(expected).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }

    /// The nonces handed out so far in this run (statistics and tests).
    pub fn nonces_used(&self) -> u64 {
        self.nonces.used.load(Ordering::Relaxed)
    }

    fn associated_data(&self, domain: Domain, tag: u64, entry_packed: u16) -> [u8; 27] {
        let mut aad = [0u8; 27];
        aad[..16].copy_from_slice(&self.uuid);
        aad[16] = domain as u8;
        aad[17..25].copy_from_slice(&tag.to_le_bytes());
        aad[25..27].copy_from_slice(&entry_packed.to_le_bytes());
        aad
    }
}

/// The epoch of a nonce counter value (leases stay below 2^48: `NonceState::renew`).
pub fn epoch_of(counter: u64) -> NonceEpoch {
    assert!(counter >> 32 <= NonceEpoch::MAX as u64, "nonce {counter} past the last epoch");
    (counter >> 32) as NonceEpoch
}

fn nonce(counter: u64) -> [u8; NONCE_BYTES] {
    let mut bytes = [0u8; NONCE_BYTES];
    bytes[4..].copy_from_slice(&counter.to_le_bytes());
    bytes
}

/// HKDF-SHA-256 of the data key, salted with the store's UUID, for one purpose.
fn derive(key: &DataKey, uuid: &[u8; 16], info: &[u8]) -> Zeroizing<[u8; KEY_BYTES]> {
    let mut out = Zeroizing::new([0u8; KEY_BYTES]);
    hkdf::Hkdf::<Sha256>::new(Some(uuid), key.bytes()).expand(info, out.as_mut()).expect("32 bytes is a valid length");
    out
}

/// Sees every nonce value handed out (tests).
#[derive(Clone)]
pub struct NonceObserver(pub Arc<dyn Fn(u64) + Send + Sync>);

impl std::fmt::Debug for NonceObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NonceObserver")
    }
}

/// Where a run's nonces come from: a range leased from the key header, renewed (a durable
/// header write) when it runs out. One mutex: taken once per seal, rarely contended (a seal
/// costs microseconds, the lock tens of nanoseconds), and it makes "handed out at most
/// once" evident. It has a place in the store's lock order (`Rank::Nonce`, above the log's:
/// a group is resealed under the log lock; below the map's: no reader waits for a header
/// write), so every acquisition is checked where the order is.
pub struct NonceSource {
    state: Mutex<NonceState>,
    used: AtomicU64,
    /// The epoch of the current lease (`StoreCipher::current_epoch`).
    epoch: AtomicU16,
    /// Every value handed out, for the tests that prove none repeats.
    #[cfg(any(test, feature = "sim"))]
    observer: Option<NonceObserver>,
}

struct NonceState {
    next: u64,
    /// `next == limit`: the lease is spent.
    limit: u64,
    /// `None` for a read-only open.
    lease: Option<Lease>,
}

struct Lease {
    header: KeyHeader,
    backing: Arc<dyn Backing>,
    size: u64,
    /// A lease never spans two epochs (short nonces: each fragment's segment records one).
    within_epochs: bool,
}

impl NonceSource {
    /// A source that seals nothing (read-only opens).
    fn none() -> NonceSource {
        NonceSource {
            state: Mutex::new(Rank::Nonce, NonceState { next: 0, limit: 0, lease: None }),
            used: AtomicU64::new(0),
            epoch: AtomicU16::new(0),
            #[cfg(any(test, feature = "sim"))]
            observer: None,
        }
    }

    /// Leases `size` nonces from `header` (written and synced before this returns) and
    /// leases again whenever they run out. `within_epochs`: no lease spans two epochs, and
    /// none reaches past the last (a short-nonce store).
    pub fn lease(header: KeyHeader, backing: Arc<dyn Backing>, size: u64, within_epochs: bool) -> Result<NonceSource> {
        assert!(size > 0 && (!within_epochs || size <= NONCES_PER_EPOCH), "a lease of {size} nonces");
        let source = NonceSource::none();
        {
            let mut state = source.lock_state();
            state.lease = Some(Lease { header, backing, size, within_epochs });
            state.renew()?;
            source.epoch.store(epoch_of(state.next), Ordering::Release);
        }
        Ok(source)
    }

    /// A source with nonces and no key header behind it (unit tests of sealing).
    #[cfg(test)]
    pub fn for_tests() -> NonceSource {
        let source = NonceSource::none();
        source.lock_state().limit = u64::MAX;
        source
    }

    #[cfg(any(test, feature = "sim"))]
    pub fn observed(mut self, observer: Option<NonceObserver>) -> NonceSource {
        self.observer = observer;
        self
    }

    fn lock_state(&self) -> MutexGuard<'_, NonceState> {
        self.state.lock()
    }

    fn next(&self) -> Result<u64> {
        let mut state = self.lock_state();
        if state.next == state.limit {
            state.renew()?;
            self.epoch.store(epoch_of(state.next), Ordering::Release);
        }
        let value = state.next;
        state.next += 1;
        drop(state);
        self.used.fetch_add(1, Ordering::Relaxed);
        #[cfg(any(test, feature = "sim"))]
        if let Some(observer) = &self.observer {
            (observer.0)(value);
        }
        Ok(value)
    }
}

impl NonceState {
    fn renew(&mut self) -> Result<()> {
        let Some(lease) = self.lease.as_mut() else {
            return Err(Error::new(ErrorKind::ReadOnly, "the store is open read-only: nothing can be sealed"));
        };
        let first = if lease.within_epochs {
            lease.header.lease_within_epoch(lease.size, NONCES_PER_EPOCH, NonceEpoch::MAX as u64)?
        } else {
            lease.header.lease(lease.size)?
        };
        lease.header.write(lease.backing.as_ref())?;
        // Only now, with the new high-water mark durable, may a value of the lease be used.
        assert!(first >= self.limit, "leases only move up");
        self.next = first;
        self.limit = first + lease.size;
        tracing::debug!("leased nonces {first}..{}", self.limit);
        Ok(())
    }
}
