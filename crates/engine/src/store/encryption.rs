//! An encrypted store's keys as the store uses them: unlocking at open (before anything is
//! read past the superblock, or written), and the key-slot operations of `zdisk key`.
//!
//! Invariants:
//! - A wrong or missing key is refused before anything is written: the key header is only
//!   written (a nonce lease) once a slot has opened.
//! - Key-slot operations rewrite only the key header (both copies, one after the other),
//!   never data; they need the store closed (an exclusive lock), as a served store's nonce
//!   lease lives in its own copy of the header.

use std::path::Path;
use std::sync::Arc;

use super::options::OpenOptions;
use super::recovery::read_superblocks;
use crate::backing::{self, Access, Backing, BackingOptions, Lock};
use crate::crypto::cipher::{NonceSource, StoreCipher};
use crate::crypto::keys::{KdfParams, KeyHeader, SlotInfo};
use crate::crypto::Secret;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{Superblock, FEATURE_PLACEMENT_USE};

/// The cipher an open of store `sb` uses: `None` for a plain store. A writable open leases
/// its nonces here (a durable key-header write), after the key has proved right.
pub(crate) fn unlock(
    backing: &Arc<dyn Backing>,
    sb: &Superblock,
    options: &OpenOptions,
) -> Result<Option<Arc<StoreCipher>>> {
    if !sb.encrypted() {
        if options.key.is_some() {
            return Err(Error::new(ErrorKind::InvalidArgument, "the store is not encrypted, but a key was given"));
        }
        return Ok(None);
    }
    let Some(secret) = &options.key else {
        return Err(Error::new(
            ErrorKind::WrongKey,
            "the store is encrypted: give its passphrase or key file (--key-file FILE, or a passphrase on the terminal)",
        ));
    };
    let header = KeyHeader::read(backing.as_ref(), sb.uuid)?;
    let (key, slot) = header.unlock(secret)?;
    tracing::debug!("key slot {slot} opened");
    let nonces = if options.read_only {
        None
    } else {
        let source = NonceSource::lease(header, backing.clone(), options.nonce_lease)?;
        #[cfg(feature = "sim")]
        let source = source.observed(options.nonce_observer.clone());
        Some(source)
    };
    let cipher = StoreCipher::new(sb.uuid, &key, nonces);
    let cipher = match sb.feature_flags & FEATURE_PLACEMENT_USE {
        0 => cipher.with_address_only_placement(),
        _ => cipher,
    };
    Ok(Some(Arc::new(cipher)))
}

/// What `zdisk key` does to a closed store's key slots.
#[derive(Debug)]
pub enum KeyChange<'a> {
    /// Wrap the data key under another secret, in the first free slot.
    Add { new: &'a Secret, kdf: KdfParams },
    /// Empty a slot (never the last).
    Remove { slot: usize },
    /// Rewrap the slot `current` opens under `new`.
    Change { new: &'a Secret, kdf: KdfParams },
}

/// Applies `change` to the key slots of the store at `path`, which `current` must unlock;
/// returns the slots afterwards. Rewrites the key header only.
pub(crate) fn change_keys(path: &Path, current: &Secret, change: KeyChange<'_>) -> Result<Vec<SlotInfo>> {
    let backing =
        backing::open(path, &BackingOptions { access: Access::ReadWrite, direct_io: false, lock: Lock::Exclusive })?;
    let (sb, _) = read_superblocks(&backing)?;
    if !sb.encrypted() {
        return Err(Error::new(ErrorKind::InvalidArgument, "the store is not encrypted: it has no key slots"));
    }
    let mut header = KeyHeader::read(&backing, sb.uuid)?;
    let (key, opened) = header.unlock(current)?;
    match change {
        KeyChange::Add { new, kdf } => {
            header.add_slot(&key, new, kdf)?;
        }
        KeyChange::Remove { slot } => header.remove_slot(slot)?,
        KeyChange::Change { new, kdf } => header.change_slot(opened, &key, new, kdf)?,
    }
    header.write(&backing)?;
    Ok(header.slots())
}

/// The key slots of the store at `path` (no key needed; works while it is served).
pub(crate) fn key_slots(path: &Path) -> Result<Vec<SlotInfo>> {
    let backing =
        backing::open(path, &BackingOptions { access: Access::ReadOnly, direct_io: false, lock: Lock::None })?;
    let (sb, _) = read_superblocks(&backing)?;
    if !sb.encrypted() {
        return Ok(Vec::new());
    }
    Ok(KeyHeader::read(&backing, sb.uuid)?.slots())
}
