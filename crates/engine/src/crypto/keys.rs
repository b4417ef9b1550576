//! The key header of an encrypted store: the data key wrapped in up to eight key slots, and
//! the nonce high-water mark (`docs/format.md`, "Encryption").
//!
//! Two copies of 4 KiB, at 32 KiB and 48 KiB (in the zero area before the segments). A
//! rewrite writes copy 0, syncs, writes copy 1, syncs, so a torn write leaves the other
//! whole; the valid copy with the higher generation wins, and the nonce high-water mark is
//! the highest any valid copy holds.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `ZDSKKEY1` |
//! | 8 | 4 | header version (1) |
//! | 12 | 4 | cipher (1: AES-256-GCM-SIV fragments, HMAC-SHA-256 metadata) |
//! | 16 | 16 | store UUID |
//! | 32 | 8 | generation (higher wins) |
//! | 40 | 8 | nonce high-water mark: every nonce below it may have been used |
//! | 48 | 8 × 128 | key slots |
//! | 1072 | … | zero |
//! | 4092 | 4 | CRC32C of bytes 0..4092 |
//!
//! A key slot (128 bytes): kind u8 (0 empty, 1 passphrase, 2 key file), 3 zero bytes,
//! Argon2id memory KiB u32, passes u32, lanes u32 (zero for a key file), salt (32), wrap
//! nonce (12), the data key sealed with AES-256-GCM-SIV under the key-encryption key (32 +
//! 16-byte tag), 16 zero bytes. The wrap's associated data is the UUID, the slot's index and
//! its first 16 bytes (kind and KDF parameters), so none of them can be changed unnoticed.
//! The key-encryption key is Argon2id(passphrase, salt) or HKDF-SHA-256(key file, salt).

use zeroize::Zeroizing;

use super::aead::{Aead, NONCE_BYTES, TAG_BYTES};
use super::{fill_random, DataKey, Secret, KEY_BYTES};
use crate::backing::Backing;
use crate::error::{Error, ErrorKind, Result};

pub const KEY_HEADER_OFFSETS: [u64; 2] = [32 << 10, 48 << 10];
pub const KEY_HEADER_BYTES: usize = 4096;
pub const KEY_SLOTS: usize = 8;
/// The cipher id the header records.
pub const CIPHER_AES_256_GCM_SIV: u32 = 1;

const MAGIC: [u8; 8] = *b"ZDSKKEY1";
const HEADER_VERSION: u32 = 1;
const SLOTS_OFFSET: usize = 48;
const SLOT_BYTES: usize = 128;
const CRC_OFFSET: usize = KEY_HEADER_BYTES - 4;
const SALT_BYTES: usize = 32;
const WRAP_NONCE_BYTES: usize = NONCE_BYTES;
/// Bytes of a slot its wrap authenticates: kind, zero, and the KDF parameters.
const SLOT_PARAMS_BYTES: usize = 16;
/// A key file must hold at least this many bytes.
pub const KEY_FILE_BYTES_MIN: usize = 32;

const _: () = assert!(SLOTS_OFFSET + KEY_SLOTS * SLOT_BYTES <= CRC_OFFSET);
const _: () = assert!(SLOT_PARAMS_BYTES + SALT_BYTES + WRAP_NONCE_BYTES + KEY_BYTES + TAG_BYTES <= SLOT_BYTES);

/// Argon2id's cost, stored per slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KdfParams {
    pub memory_kib: u32,
    pub iterations: u32,
    pub parallelism: u32,
}

impl KdfParams {
    /// 256 MiB, 3 passes, 2 lanes: about a second per unlock on a 2-core machine
    /// (`docs/format.md`), and 256 MiB for every guess an attacker makes.
    pub const DEFAULT: KdfParams = KdfParams { memory_kib: 256 * 1024, iterations: 3, parallelism: 2 };
    /// Cheapest there is: tests only.
    pub const TEST: KdfParams = KdfParams { memory_kib: 64, iterations: 1, parallelism: 1 };

    /// Within argon2's limits and ours (a tampered header must not make open take hours
    /// or exhaust memory).
    fn validate(self) -> Result<()> {
        let ok = (1..=16).contains(&self.parallelism)
            && (1..=64).contains(&self.iterations)
            && self.memory_kib >= 8 * self.parallelism
            && self.memory_kib <= 4 << 20;
        if !ok {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "Argon2id parameters out of range: {} KiB (8 per lane to 4 GiB), {} passes (1-64), {} lanes (1-16)",
                    self.memory_kib, self.iterations, self.parallelism
                ),
            ));
        }
        Ok(())
    }
}

/// What kind of secret a slot takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotKind {
    Passphrase = 1,
    KeyFile = 2,
}

/// An occupied slot, as `zdisk key list` shows it.
#[derive(Debug, Clone)]
pub struct SlotInfo {
    pub index: usize,
    pub kind: SlotKind,
    /// Argon2id's parameters (passphrase slots).
    pub kdf: Option<KdfParams>,
}

#[derive(Clone)]
struct Slot {
    kind: SlotKind,
    kdf: KdfParams,
    salt: [u8; SALT_BYTES],
    nonce: [u8; WRAP_NONCE_BYTES],
    wrapped: [u8; KEY_BYTES + TAG_BYTES],
}

/// The key header (module comment).
#[derive(Clone)]
pub struct KeyHeader {
    uuid: [u8; 16],
    generation: u64,
    nonce_high_water: u64,
    slots: [Option<Slot>; KEY_SLOTS],
}

impl std::fmt::Debug for KeyHeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyHeader")
            .field("generation", &self.generation)
            .field("nonce_high_water", &self.nonce_high_water)
            .field("slots", &self.slots().len())
            .finish()
    }
}

impl KeyHeader {
    /// A new header for store `uuid`: a fresh random data key in slot 0, wrapped by `secret`.
    pub fn create(uuid: [u8; 16], secret: &Secret, kdf: KdfParams) -> Result<(KeyHeader, DataKey)> {
        super::protect_process();
        let key = DataKey::random()?;
        let mut header = KeyHeader { uuid, generation: 0, nonce_high_water: 0, slots: Default::default() };
        header.add_slot(&key, secret, kdf)?;
        Ok((header, key))
    }

    /// Tries every occupied slot of the secret's kind; the data key and the slot it opened.
    pub fn unlock(&self, secret: &Secret) -> Result<(DataKey, usize)> {
        super::protect_process();
        for (index, slot) in self.slots.iter().enumerate() {
            let Some(slot) = slot else { continue };
            if slot.kind != kind_of(secret) {
                continue;
            }
            let kek = key_encryption_key(secret, slot.kdf, &slot.salt)?;
            let mut key = Zeroizing::new([0u8; KEY_BYTES]);
            key.copy_from_slice(&slot.wrapped[..KEY_BYTES]);
            let aad = self.slot_aad(index, slot);
            let cipher = Aead::new(&kek);
            if cipher.open(slot.nonce, &aad, key.as_mut_slice(), &slot.wrapped[KEY_BYTES..]).is_ok() {
                return Ok((DataKey::from_bytes(*key), index));
            }
        }
        let what = match secret {
            Secret::Passphrase(_) => "passphrase",
            Secret::KeyFile(_) => "key file",
        };
        Err(Error::new(ErrorKind::WrongKey, format!("no key slot opens with this {what}")))
    }

    /// Wraps `key` under `secret` in the first free slot; returns the slot.
    pub fn add_slot(&mut self, key: &DataKey, secret: &Secret, kdf: KdfParams) -> Result<usize> {
        let index = self.slots.iter().position(Option::is_none).ok_or_else(|| {
            Error::new(ErrorKind::InvalidArgument, format!("all {KEY_SLOTS} key slots are in use: remove one first"))
        })?;
        self.slots[index] = Some(self.wrap(index, key, secret, kdf)?);
        Ok(index)
    }

    /// Empties `slot`; never the last occupied one.
    pub fn remove_slot(&mut self, slot: usize) -> Result<()> {
        if slot >= KEY_SLOTS || self.slots[slot].is_none() {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("key slot {slot} is empty")));
        }
        if self.slots.iter().flatten().count() == 1 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "refusing to remove the last key slot: the data would be unreadable",
            ));
        }
        self.slots[slot] = None;
        Ok(())
    }

    /// Rewraps `slot` under `secret` (the same data key).
    pub fn change_slot(&mut self, slot: usize, key: &DataKey, secret: &Secret, kdf: KdfParams) -> Result<()> {
        if slot >= KEY_SLOTS || self.slots[slot].is_none() {
            return Err(Error::new(ErrorKind::InvalidArgument, format!("key slot {slot} is empty")));
        }
        self.slots[slot] = Some(self.wrap(slot, key, secret, kdf)?);
        Ok(())
    }

    pub fn slots(&self) -> Vec<SlotInfo> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(index, s)| {
                s.as_ref().map(|s| SlotInfo {
                    index,
                    kind: s.kind,
                    kdf: (s.kind == SlotKind::Passphrase).then_some(s.kdf),
                })
            })
            .collect()
    }

    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    pub fn nonce_high_water(&self) -> u64 {
        self.nonce_high_water
    }

    /// Reserves `count` nonces: returns the first; the caller must `write` before using any.
    pub fn lease(&mut self, count: u64) -> Result<u64> {
        let first = self.nonce_high_water;
        self.nonce_high_water = first.checked_add(count).ok_or_else(|| {
            Error::new(ErrorKind::NoSpace, "the store's nonces are used up: copy its data to a new store")
        })?;
        Ok(first)
    }

    /// Reserves `count` nonces inside one epoch of `per_epoch` values: from the high-water
    /// mark, or — the rest of its epoch is shorter — from the next epoch's start, the values
    /// skipped never used. Refuses a lease reaching past epoch `last_epoch`.
    pub fn lease_within_epoch(&mut self, count: u64, per_epoch: u64, last_epoch: u64) -> Result<u64> {
        assert!(count <= per_epoch);
        let mark = self.nonce_high_water;
        let first = if mark % per_epoch + count > per_epoch { mark.next_multiple_of(per_epoch) } else { mark };
        if (first + count - 1) / per_epoch > last_epoch {
            return Err(Error::new(ErrorKind::NoSpace, "the store's nonces are used up: copy its data to a new store"));
        }
        self.nonce_high_water = first + count;
        Ok(first)
    }

    /// Moves the high-water mark to `mark` (tests that start a store near an epoch's end).
    #[cfg(any(test, feature = "sim"))]
    pub fn set_nonce_high_water(&mut self, mark: u64) {
        self.nonce_high_water = mark;
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut buf = vec![0u8; KEY_HEADER_BYTES];
        buf[..8].copy_from_slice(&MAGIC);
        buf[8..12].copy_from_slice(&HEADER_VERSION.to_le_bytes());
        buf[12..16].copy_from_slice(&CIPHER_AES_256_GCM_SIV.to_le_bytes());
        buf[16..32].copy_from_slice(&self.uuid);
        buf[32..40].copy_from_slice(&self.generation.to_le_bytes());
        buf[40..48].copy_from_slice(&self.nonce_high_water.to_le_bytes());
        for (index, slot) in self.slots.iter().enumerate() {
            if let Some(slot) = slot {
                let at = SLOTS_OFFSET + index * SLOT_BYTES;
                buf[at..at + SLOT_BYTES].copy_from_slice(&encode_slot(slot));
            }
        }
        let crc = crc32c::crc32c(&buf[..CRC_OFFSET]);
        buf[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    /// Decodes one copy; any inconsistency is `Corrupt`, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<KeyHeader> {
        let corrupt = |what: &str| Error::new(ErrorKind::Corrupt, format!("key header: {what}"));
        if bytes.len() < KEY_HEADER_BYTES || bytes[..8] != MAGIC {
            return Err(corrupt("no magic"));
        }
        if crc32c::crc32c(&bytes[..CRC_OFFSET]) != u32_at(bytes, CRC_OFFSET) {
            return Err(corrupt("checksum mismatch"));
        }
        if u32_at(bytes, 8) != HEADER_VERSION || u32_at(bytes, 12) != CIPHER_AES_256_GCM_SIV {
            return Err(Error::new(ErrorKind::NewerVersion, "key header of an unknown version or cipher"));
        }
        let mut slots: [Option<Slot>; KEY_SLOTS] = Default::default();
        for (index, slot) in slots.iter_mut().enumerate() {
            let at = SLOTS_OFFSET + index * SLOT_BYTES;
            *slot = decode_slot(&bytes[at..at + SLOT_BYTES]).map_err(|e| corrupt(&format!("slot {index}: {e}")))?;
        }
        if slots.iter().all(Option::is_none) {
            return Err(corrupt("no key slot"));
        }
        Ok(KeyHeader {
            uuid: bytes[16..32].try_into().expect("16 bytes"),
            generation: u64_at(bytes, 32),
            nonce_high_water: u64_at(bytes, 40),
            slots,
        })
    }

    /// Reads both copies: the valid one with the higher generation, with the highest nonce
    /// high-water mark of either.
    pub fn read(backing: &dyn Backing, uuid: [u8; 16]) -> Result<KeyHeader> {
        let mut copies = Vec::new();
        let mut magic_seen = false;
        for offset in KEY_HEADER_OFFSETS {
            let mut buf = vec![0u8; KEY_HEADER_BYTES];
            backing.read_at(offset, &mut buf).map_err(|e| Error::io("read key header", e))?;
            magic_seen |= buf[..8] == MAGIC;
            if let Ok(header) = KeyHeader::decode(&buf) {
                copies.push(header);
            }
        }
        let high_water = copies.iter().map(|h| h.nonce_high_water).max().unwrap_or(0);
        let Some(mut newest) = copies.into_iter().max_by_key(|h| h.generation) else {
            return Err(match magic_seen {
                true => Error::new(ErrorKind::Corrupt, "both key header copies are damaged"),
                false => Error::new(ErrorKind::Corrupt, "the encrypted store has no key header"),
            });
        };
        if newest.uuid != uuid {
            return Err(Error::new(ErrorKind::Corrupt, "the key header belongs to another store"));
        }
        newest.nonce_high_water = high_water;
        Ok(newest)
    }

    /// Writes generation + 1: copy 0, sync, copy 1, sync.
    pub fn write(&mut self, backing: &dyn Backing) -> Result<()> {
        self.generation += 1;
        let bytes = self.encode();
        for offset in KEY_HEADER_OFFSETS {
            backing.write_at(offset, &bytes).map_err(|e| Error::io("write key header", e))?;
            backing.sync().map_err(|e| Error::io("sync key header", e))?;
        }
        Ok(())
    }

    fn wrap(&self, index: usize, key: &DataKey, secret: &Secret, kdf: KdfParams) -> Result<Slot> {
        let kind = kind_of(secret);
        let kdf =
            if kind == SlotKind::Passphrase { kdf } else { KdfParams { memory_kib: 0, iterations: 0, parallelism: 0 } };
        let mut slot = Slot { kind, kdf, salt: [0; SALT_BYTES], nonce: [0; WRAP_NONCE_BYTES], wrapped: [0; 48] };
        fill_random(&mut slot.salt)?;
        fill_random(&mut slot.nonce)?;
        let kek = key_encryption_key(secret, kdf, &slot.salt)?;
        let mut wrapped = Zeroizing::new(*key.bytes());
        let aad = self.slot_aad(index, &slot);
        let tag = Aead::new(&kek).seal(slot.nonce, &aad, wrapped.as_mut_slice());
        slot.wrapped[..KEY_BYTES].copy_from_slice(wrapped.as_ref());
        slot.wrapped[KEY_BYTES..].copy_from_slice(&tag);
        Ok(slot)
    }

    fn slot_aad(&self, index: usize, slot: &Slot) -> Vec<u8> {
        let mut aad = b"zdisk key slot".to_vec();
        aad.extend_from_slice(&self.uuid);
        aad.push(index as u8);
        aad.extend_from_slice(&encode_slot(slot)[..SLOT_PARAMS_BYTES]);
        aad
    }
}

fn kind_of(secret: &Secret) -> SlotKind {
    match secret {
        Secret::Passphrase(_) => SlotKind::Passphrase,
        Secret::KeyFile(_) => SlotKind::KeyFile,
    }
}

/// The key-encryption key of a slot: Argon2id of a passphrase, HKDF-SHA-256 of a key file.
fn key_encryption_key(secret: &Secret, kdf: KdfParams, salt: &[u8]) -> Result<Zeroizing<[u8; KEY_BYTES]>> {
    let mut kek = Zeroizing::new([0u8; KEY_BYTES]);
    match secret {
        Secret::Passphrase(passphrase) => {
            if passphrase.is_empty() {
                return Err(Error::new(ErrorKind::InvalidArgument, "an empty passphrase"));
            }
            kdf.validate()?;
            let params = argon2::Params::new(kdf.memory_kib, kdf.iterations, kdf.parallelism, Some(KEY_BYTES))
                .map_err(|e| Error::new(ErrorKind::InvalidArgument, format!("Argon2id parameters: {e}")))?;
            argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params)
                .hash_password_into(passphrase, salt, kek.as_mut())
                .map_err(|e| Error::new(ErrorKind::InvalidArgument, format!("Argon2id: {e}")))?;
        }
        Secret::KeyFile(bytes) => {
            if bytes.len() < KEY_FILE_BYTES_MIN {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    "a key file must hold at least 32 bytes; make one with `head -c 32 /dev/urandom > FILE`",
                ));
            }
            hkdf::Hkdf::<sha2::Sha256>::new(Some(salt), bytes)
                .expand(b"zdisk key file v1", kek.as_mut())
                .expect("32 bytes is a valid length");
        }
    }
    Ok(kek)
}

fn encode_slot(slot: &Slot) -> [u8; SLOT_BYTES] {
    let mut out = [0u8; SLOT_BYTES];
    out[0] = slot.kind as u8;
    out[4..8].copy_from_slice(&slot.kdf.memory_kib.to_le_bytes());
    out[8..12].copy_from_slice(&slot.kdf.iterations.to_le_bytes());
    out[12..16].copy_from_slice(&slot.kdf.parallelism.to_le_bytes());
    let mut at = SLOT_PARAMS_BYTES;
    for part in [&slot.salt[..], &slot.nonce[..], &slot.wrapped[..]] {
        out[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
    out
}

fn decode_slot(bytes: &[u8]) -> std::result::Result<Option<Slot>, String> {
    let kind = match bytes[0] {
        0 if bytes.iter().all(|&b| b == 0) => return Ok(None),
        1 => SlotKind::Passphrase,
        2 => SlotKind::KeyFile,
        other => return Err(format!("kind {other}")),
    };
    let kdf = KdfParams { memory_kib: u32_at(bytes, 4), iterations: u32_at(bytes, 8), parallelism: u32_at(bytes, 12) };
    if kind == SlotKind::Passphrase && kdf.validate().is_err() {
        return Err(format!("Argon2id parameters {kdf:?}"));
    }
    let at = SLOT_PARAMS_BYTES;
    Ok(Some(Slot {
        kind,
        kdf,
        salt: bytes[at..at + SALT_BYTES].try_into().expect("32 bytes"),
        nonce: bytes[at + SALT_BYTES..at + SALT_BYTES + WRAP_NONCE_BYTES].try_into().expect("12 bytes"),
        wrapped: bytes[at + SALT_BYTES + WRAP_NONCE_BYTES..at + SALT_BYTES + WRAP_NONCE_BYTES + 48]
            .try_into()
            .expect("48 bytes"),
    }))
}

fn u32_at(buf: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(buf: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass(text: &str) -> Secret {
        Secret::passphrase(text.as_bytes().to_vec())
    }

    #[test]
    fn slots_open_with_their_secret_only_and_the_last_is_kept() {
        let (mut header, key) = KeyHeader::create([3; 16], &pass("one"), KdfParams::TEST).unwrap();
        assert_eq!(header.unlock(&pass("one")).unwrap().0.bytes(), key.bytes());
        assert_eq!(header.unlock(&pass("two")).unwrap_err().kind(), ErrorKind::WrongKey);
        let file = Secret::key_file(vec![5; 32]);
        assert_eq!(header.add_slot(&key, &file, KdfParams::TEST).unwrap(), 1);
        assert_eq!(header.unlock(&file).unwrap().1, 1);
        assert_eq!(header.unlock(&file).unwrap().0.bytes(), key.bytes());
        let short = Secret::key_file(vec![5; 31]);
        assert_eq!(header.add_slot(&key, &short, KdfParams::TEST).unwrap_err().kind(), ErrorKind::InvalidArgument);
        header.remove_slot(0).unwrap();
        assert_eq!(header.unlock(&pass("one")).unwrap_err().kind(), ErrorKind::WrongKey);
        assert_eq!(header.remove_slot(1).unwrap_err().kind(), ErrorKind::InvalidArgument);
        header.change_slot(1, &key, &pass("three"), KdfParams::TEST).unwrap();
        assert_eq!(header.unlock(&pass("three")).unwrap().0.bytes(), key.bytes());
        assert!(header.unlock(&file).is_err());
        for _ in 1..KEY_SLOTS {
            header.add_slot(&key, &pass("more"), KdfParams::TEST).unwrap();
        }
        assert!(header.add_slot(&key, &pass("full"), KdfParams::TEST).is_err());
    }

    #[test]
    fn decoding_refuses_damage_and_tampering_is_a_wrong_key() {
        let (header, _) = KeyHeader::create([4; 16], &pass("pw"), KdfParams::TEST).unwrap();
        let bytes = header.encode();
        assert_eq!(KeyHeader::decode(&bytes).unwrap().encode(), bytes);
        for bit in 0..512 * 8 {
            let mut damaged = bytes.clone();
            damaged[bit / 8] ^= 1 << (bit % 8);
            assert!(KeyHeader::decode(&damaged).is_err(), "bit {bit}");
        }
        // A forger who fixes the CRC: the wrapped key's tag refuses.
        let mut forged = bytes.clone();
        forged[SLOTS_OFFSET + SLOT_PARAMS_BYTES + SALT_BYTES + WRAP_NONCE_BYTES + 3] ^= 1;
        let crc = crc32c::crc32c(&forged[..CRC_OFFSET]);
        forged[CRC_OFFSET..].copy_from_slice(&crc.to_le_bytes());
        let forged = KeyHeader::decode(&forged).unwrap();
        assert_eq!(forged.unlock(&pass("pw")).unwrap_err().kind(), ErrorKind::WrongKey);
        let mut seed = 1u64;
        for _ in 0..200 {
            let garbage: Vec<u8> = (0..KEY_HEADER_BYTES)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (seed >> 33) as u8
                })
                .collect();
            assert!(KeyHeader::decode(&garbage).is_err());
        }
    }

    #[test]
    fn leases_within_epochs_never_span_two_and_stop_at_the_last() {
        let (mut header, _) = KeyHeader::create([6; 16], &pass("pw"), KdfParams::TEST).unwrap();
        assert_eq!(header.lease_within_epoch(6, 16, 2).unwrap(), 0);
        assert_eq!(header.lease_within_epoch(6, 16, 2).unwrap(), 6);
        // 12..18 would span epochs 0 and 1: the lease starts at 16, 12..16 never used.
        assert_eq!(header.lease_within_epoch(6, 16, 2).unwrap(), 16);
        assert_eq!(header.nonce_high_water(), 22);
        assert_eq!(header.lease_within_epoch(10, 16, 2).unwrap(), 22);
        assert_eq!(header.lease_within_epoch(16, 16, 2).unwrap(), 32);
        let refused = header.lease_within_epoch(1, 16, 2).unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::NoSpace);
        assert_eq!(header.nonce_high_water(), 48, "a refused lease moves nothing");
    }

    #[test]
    fn leases_move_up_and_a_torn_copy_leaves_the_other() {
        let disk = crate::sim::SimDisk::new(1 << 20, 1);
        let (mut header, _) = KeyHeader::create([6; 16], &pass("pw"), KdfParams::TEST).unwrap();
        header.write(&disk).unwrap();
        assert_eq!(header.lease(10).unwrap(), 0);
        header.write(&disk).unwrap();
        assert_eq!(KeyHeader::read(&disk, [6; 16]).unwrap().nonce_high_water(), 10);
        assert_eq!(header.lease(5).unwrap(), 10);
        header.write(&disk).unwrap();
        disk.write_at(KEY_HEADER_OFFSETS[0], &[0xee; KEY_HEADER_BYTES]).unwrap();
        assert_eq!(KeyHeader::read(&disk, [6; 16]).unwrap().nonce_high_water(), 15);
        assert_eq!(KeyHeader::read(&disk, [7; 16]).unwrap_err().kind(), ErrorKind::Corrupt);
        disk.write_at(KEY_HEADER_OFFSETS[1], &[0xee; KEY_HEADER_BYTES]).unwrap();
        assert_eq!(KeyHeader::read(&disk, [6; 16]).unwrap_err().kind(), ErrorKind::Corrupt);
    }
}
