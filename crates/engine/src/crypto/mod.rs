//! Encryption at rest (`docs/format.md`, "Encryption"; threat model in
//! `docs/guarantees.md`): compress first, then encrypt and authenticate.
//!
//! - `keys.rs`: the key header — a random 256-bit data key per store, wrapped in up to eight
//!   key slots by a key-encryption key taken from a passphrase (Argon2id) or a key file; the
//!   nonce lease.
//! - `cipher.rs`: what the store does with the data key — every fragment (data block, map
//!   page) sealed with AES-256-GCM-SIV after compression; checkpoints and superblocks
//!   authenticated with HMAC-SHA-256.
//!
//! Invariants:
//! - Key material lives only in [`DataKey`] and [`Secret`], which zeroize on drop and never
//!   print their bytes (`Debug` shows a placeholder).
//! - No nonce is used twice under one data key: every seal takes the next value of a 64-bit
//!   counter whose range was made durable in the key header before its first use
//!   (`keys::KeyHeader::lease`), so a crashed run's values are never handed out again.

pub mod cipher;
pub mod keys;

use zeroize::{Zeroize, Zeroizing};

/// Bytes of the data key and of every derived key.
pub const KEY_BYTES: usize = 32;

/// A store's data key: random at format, never changed (a key slot change rewraps it).
#[derive(Clone)]
pub struct DataKey(Zeroizing<[u8; KEY_BYTES]>);

impl DataKey {
    pub fn from_bytes(bytes: [u8; KEY_BYTES]) -> DataKey {
        DataKey(Zeroizing::new(bytes))
    }

    /// A fresh key from the operating system's random source.
    pub fn random() -> crate::Result<DataKey> {
        let mut bytes = Zeroizing::new([0u8; KEY_BYTES]);
        fill_random(bytes.as_mut())?;
        Ok(DataKey(bytes))
    }

    pub fn bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }
}

impl std::fmt::Debug for DataKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DataKey(..)")
    }
}

/// What unlocks a key slot: a passphrase (stretched with Argon2id) or the contents of a key
/// file (at least 32 bytes, used through HKDF-SHA-256; a key file should be random, e.g.
/// `head -c 32 /dev/urandom`).
pub enum Secret {
    Passphrase(Zeroizing<Vec<u8>>),
    KeyFile(Zeroizing<Vec<u8>>),
}

impl Secret {
    pub fn passphrase(bytes: Vec<u8>) -> Secret {
        Secret::Passphrase(Zeroizing::new(bytes))
    }

    pub fn key_file(bytes: Vec<u8>) -> Secret {
        Secret::KeyFile(Zeroizing::new(bytes))
    }
}

impl Secret {
    /// The secret's bytes (to hand them to a server through a pipe; never print them).
    pub fn expose_bytes(&self) -> &[u8] {
        match self {
            Secret::Passphrase(bytes) | Secret::KeyFile(bytes) => bytes,
        }
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Secret::Passphrase(_) => f.write_str("Secret::Passphrase(..)"),
            Secret::KeyFile(_) => f.write_str("Secret::KeyFile(..)"),
        }
    }
}

/// Fills `out` from the operating system's random source.
pub(crate) fn fill_random(out: &mut [u8]) -> crate::Result<()> {
    getrandom::getrandom(out).map_err(|e| {
        out.zeroize();
        crate::Error::new(crate::ErrorKind::Io, format!("reading the random source: {e}"))
    })
}
