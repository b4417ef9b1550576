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
//! - **Nonces**: 96 bits, the top 32 zero and the low 64 a counter stored in the fragment.
//!   The counter's values come from leases made durable in the key header before first use
//!   ([`NonceSource`]), so no value is handed out twice, across crashes too.
//! - **Metadata**: checkpoints and superblocks carry an HMAC-SHA-256 (truncated to 96 bits)
//!   under a separate metadata key.

use std::sync::atomic::{AtomicU64, Ordering};
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

/// The stored part of a nonce: the counter, u64.
pub const NONCE_STORED_BYTES: usize = 8;
/// The AEAD's authentication tag.
pub use super::aead::TAG_BYTES;
/// What sealing adds to a fragment: stored nonce and tag.
pub const SEAL_OVERHEAD_BYTES: usize = NONCE_STORED_BYTES + TAG_BYTES;
/// Bytes of a metadata MAC (HMAC-SHA-256 truncated, as RFC 2104 allows down to half).
pub const MAC_BYTES: usize = 12;
/// Nonces reserved per key-header write: 2^32 (one write per open; a run that seals more
/// fragments than that — 8 TiB of 2 KiB fragments — writes the header again).
pub const NONCE_LEASE_DEFAULT: u64 = 1 << 32;

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
    /// `nonce | ciphertext | tag` to `out`.
    pub fn seal(&self, domain: Domain, tag: u64, entry_packed: u16, plaintext: &[u8], out: &mut Vec<u8>) -> Result<()> {
        let counter = self.nonces.next()?;
        out.extend_from_slice(&counter.to_le_bytes());
        let start = out.len();
        out.extend_from_slice(plaintext);
        let aad = self.associated_data(domain, tag, entry_packed);
        let sealed_tag = self.keys.fragments.seal(nonce(counter), &aad, &mut out[start..]);
        out.extend_from_slice(&sealed_tag);
        Ok(())
    }

    /// Opens `sealed` (`nonce | ciphertext | tag`), checking it against what the reader
    /// expects it to be; returns the plaintext. Any mismatch is a `Checksum` error.
    pub fn open(&self, domain: Domain, tag: u64, entry_packed: u16, sealed: &[u8]) -> Result<Vec<u8>> {
        let bad = || Error::new(ErrorKind::Checksum, "fragment fails authentication");
        if sealed.len() < SEAL_OVERHEAD_BYTES {
            return Err(bad());
        }
        let (counter, rest) = sealed.split_at(NONCE_STORED_BYTES);
        let (ciphertext, auth) = rest.split_at(rest.len() - TAG_BYTES);
        let counter = u64::from_le_bytes(counter.try_into().expect("8 bytes"));
        let mut plaintext = ciphertext.to_vec();
        let aad = self.associated_data(domain, tag, entry_packed);
        self.keys.fragments.open(nonce(counter), &aad, &mut plaintext, auth).map_err(|_| bad())?;
        Ok(plaintext)
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
/// once" evident. The standard library's: a contended `parking_lot` mutex yields the core
/// (`store/lock.rs`).
pub struct NonceSource {
    state: std::sync::Mutex<NonceState>,
    used: AtomicU64,
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
}

impl NonceSource {
    /// A source that seals nothing (read-only opens).
    fn none() -> NonceSource {
        NonceSource {
            state: std::sync::Mutex::new(NonceState { next: 0, limit: 0, lease: None }),
            used: AtomicU64::new(0),
            #[cfg(any(test, feature = "sim"))]
            observer: None,
        }
    }

    /// Leases `size` nonces from `header` (written and synced before this returns) and
    /// leases again whenever they run out.
    pub fn lease(header: KeyHeader, backing: Arc<dyn Backing>, size: u64) -> Result<NonceSource> {
        assert!(size > 0, "a lease of no nonces");
        let source = NonceSource::none();
        {
            let mut state = source.lock_state();
            state.lease = Some(Lease { header, backing, size });
            state.renew()?;
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

    fn lock_state(&self) -> std::sync::MutexGuard<'_, NonceState> {
        crate::store::lock::lock_unranked(&self.state)
    }

    fn next(&self) -> Result<u64> {
        let mut state = self.lock_state();
        if state.next == state.limit {
            state.renew()?;
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
        let first = lease.header.lease(lease.size)?;
        lease.header.write(lease.backing.as_ref())?;
        // Only now, with the new high-water mark durable, may a value of the lease be used.
        debug_assert!(first >= self.limit, "leases only move up");
        self.next = first;
        self.limit = first + lease.size;
        tracing::debug!("leased nonces {first}..{}", self.limit);
        Ok(())
    }
}
