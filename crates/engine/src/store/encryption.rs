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

use super::create::read_superblocks;
use super::log::LogGuard;
use super::log::{Block, LiveFragment, Op};
use super::options::OpenOptions;
use super::state::Inner;
use crate::backing::{self, Access, Backing, BackingOptions, Lock};
use crate::crypto::cipher::{Domain, NonceSource, StoreCipher};
use crate::crypto::keys::{KdfParams, KeyHeader, SlotInfo};
use crate::crypto::Secret;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{Superblock, FEATURE_PLACEMENT_USE, FEATURE_SHORT_NONCES, PI_BYTES};

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
        let short = sb.feature_flags & FEATURE_SHORT_NONCES != 0;
        #[cfg(feature = "sim")]
        let header = near_epoch_end(header, options.nonce_epoch_end_margin);
        let source = NonceSource::lease(header, backing.clone(), options.nonce_lease, short)?;
        #[cfg(feature = "sim")]
        let source = source.observed(options.nonce_observer.clone());
        Some(source)
    };
    let cipher = StoreCipher::new(sb.uuid, &key, nonces);
    let cipher = match sb.feature_flags & FEATURE_PLACEMENT_USE {
        0 => cipher.with_address_only_placement(),
        _ => cipher,
    };
    let cipher = match sb.feature_flags & FEATURE_SHORT_NONCES {
        0 => cipher.with_whole_nonces(),
        _ => cipher,
    };
    Ok(Some(Arc::new(cipher)))
}

impl LogGuard<'_> {
    /// Holds a group bound for the log (under the log lock) to the rule of short nonces:
    /// every sealed fragment of a segment's use has the use's nonce epoch. When the nonce
    /// source (or a fragment) has moved to a newer epoch, the open segments are sealed and
    /// the appender takes it: the uses begun next record it. A fragment sealed under an
    /// older epoch — sealed before a lease crossed into the next, or a GC copy of data
    /// written before — is sealed again under a fresh nonce (the same length; a fragment
    /// that does not open is damaged and moves as it is, still EIO). Returns the group with
    /// such fragments resealed, or `None` when it holds to the rule as it is. Epochs only
    /// grow, so this settles within a lease or two.
    pub(crate) fn hold_to_one_epoch(&mut self, ops: &[Op]) -> Result<Option<Vec<Op>>> {
        let log = self.log;
        let Some(cipher) = log.cipher.as_deref().filter(|c| c.short_nonces()) else { return Ok(None) };
        let mut resealed: Option<Vec<Op>> = None;
        loop {
            let group = resealed.as_deref().unwrap_or(ops);
            let newest = group.iter().flat_map(Op::nonce_epochs).chain([cipher.current_epoch()]).max();
            if let Some(newest) = newest.filter(|&e| e > self.appender.nonce_epoch) {
                self.begin_nonce_epoch(newest)?;
            }
            let epoch = self.appender.nonce_epoch;
            if group.iter().flat_map(Op::nonce_epochs).all(|e| e == epoch) {
                return Ok(resealed);
            }
            let owned = resealed.get_or_insert_with(|| ops.to_vec());
            for op in owned.iter_mut() {
                for (domain, tag, block) in op.sealed_blocks_mut() {
                    if block.nonce_epoch.is_some_and(|e| e != epoch) && !reseal(cipher, domain, tag, block)? {
                        block.nonce_epoch = None; // damaged: moves as it is
                    }
                }
            }
        }
    }

    /// Seals both streams' open segments and makes `epoch` the appender's: the next
    /// segment opened begins a use of it.
    fn begin_nonce_epoch(&mut self, epoch: u16) -> Result<()> {
        tracing::info!("nonce epoch {} begins: the open segments are sealed", epoch);
        self.seal_open_segments()?;
        self.appender.nonce_epoch = epoch;
        Ok(())
    }
}

impl Inner {
    /// The nonce epoch of a sealed fragment read at byte `address` (a short-nonce store's:
    /// its segment's use's).
    pub(crate) fn nonce_epoch_at(&self, address: u64) -> Option<u16> {
        self.log.cipher.as_deref().filter(|c| c.short_nonces()).map(|_| self.segment_use(address).nonce_epoch)
    }

    /// GC's copies sealed under an older nonce epoch than the current one, sealed again
    /// here, before the log lock is taken (the log reseals any left: `hold_to_one_epoch`).
    pub(crate) fn reseal_older_epochs(&self, live: &mut [LiveFragment]) -> Result<()> {
        let Some(current) = self.log.cipher.as_deref().filter(|c| c.short_nonces()).map(|c| c.current_epoch()) else {
            return Ok(());
        };
        for f in live.iter_mut().filter(|f| !f.keeps_guard && f.block.nonce_epoch.is_some_and(|e| e < current)) {
            self.reseal(Domain::Block, f.lba.0, &mut f.block)?;
        }
        Ok(())
    }

    /// Seals `block` (of `domain`, reference tag `tag`) again under the current nonce
    /// epoch if it was sealed under another; false if it does not open (damaged).
    pub(crate) fn reseal(&self, domain: Domain, tag: u64, block: &mut Block) -> Result<bool> {
        match self.log.cipher.as_deref() {
            Some(cipher) => reseal(cipher, domain, tag, block),
            None => Ok(true),
        }
    }
}

/// Seals `block` (of `domain`, reference tag `tag`) again under `cipher`'s current nonce
/// epoch if it was sealed under another; false if it does not open (damaged).
fn reseal(cipher: &StoreCipher, domain: Domain, tag: u64, block: &mut Block) -> Result<bool> {
    let Some(epoch) = block.nonce_epoch else { return Ok(true) };
    let packed = block.entry.packed();
    match cipher.reseal(domain, tag, packed, &block.bytes[PI_BYTES..], epoch)? {
        Some((sealed, epoch)) => {
            block.bytes.truncate(PI_BYTES);
            block.bytes.extend_from_slice(&sealed);
            block.nonce_epoch = Some(epoch);
            Ok(true)
        }
        None => Ok(false),
    }
}

/// The key header with its nonce mark moved up to `margin` values before its epoch's end.
#[cfg(feature = "sim")]
fn near_epoch_end(mut header: KeyHeader, margin: Option<u64>) -> KeyHeader {
    use crate::crypto::cipher::NONCES_PER_EPOCH;
    if let Some(margin) = margin {
        let mark = header.nonce_high_water();
        let end = (mark / NONCES_PER_EPOCH + 1) * NONCES_PER_EPOCH;
        header.set_nonce_high_water(end.saturating_sub(margin).max(mark));
    }
    header
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

/// The slot of the store at `path` that `secret` opens (nothing is written; works while it is
/// served).
pub(crate) fn slot_opened_by(path: &Path, secret: &Secret) -> Result<usize> {
    let backing =
        backing::open(path, &BackingOptions { access: Access::ReadOnly, direct_io: false, lock: Lock::None })?;
    let (sb, _) = read_superblocks(&backing)?;
    if !sb.encrypted() {
        return Err(Error::new(ErrorKind::InvalidArgument, "the store is not encrypted: it has no key slots"));
    }
    Ok(KeyHeader::read(&backing, sb.uuid)?.unlock(secret)?.1)
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
