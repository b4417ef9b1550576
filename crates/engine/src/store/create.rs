//! Formatting a store, and reading what its superblock says without opening it.
//!
//! Invariants: format refuses, with nothing written, a geometry the engine cannot serve and
//! a target that holds a zdisk store or other data (unless forced); it writes both
//! superblock slots (generation 0, no checkpoint) only after discarding the data area, and
//! syncs before it returns.

use std::io::Read;
use std::path::Path;

use super::capacity::{native_capacity_for, OVER_PROVISION_MAX_PPM, OVER_PROVISION_MIN_PPM};
use super::geometry::{default_segment_size, segment_size_is_valid};
use super::options::{Allocation, FormatOptions, StoreInfo};
use crate::backing::{self, Access, Backing, BackingOptions, Lock};
use crate::codec::Codec;
use crate::crypto::cipher::StoreCipher;
use crate::crypto::keys::{KeyHeader, KEY_HEADER_OFFSETS};
use crate::error::{Error, ErrorKind, Result};
use crate::format::{
    Superblock, DATA_START_BYTES, FEATURE_AUTHENTICATED_LOG, FEATURE_ENCRYPTED, FEATURE_LOG_JUMPS,
    FEATURE_PLACEMENT_USE, FEATURE_SHORT_NONCES, LOGICAL_SIZE_MAX_BYTES, SUPERBLOCK_MAC_BYTES, SUPERBLOCK_SLOT_BYTES,
};
use crate::{BLOCK_SIZE, SECTOR_SIZE};

/// A store has at least this many segments (GC needs room to move).
const SEGMENTS_MIN: u64 = 8;

const FORMAT_OPEN: BackingOptions =
    BackingOptions { access: Access::ReadWrite, direct_io: false, lock: Lock::Exclusive };

pub(crate) fn store_tag(uuid: &[u8; 16]) -> u32 {
    crc32c::crc32c(uuid)
}

/// A fresh random session nonce for one open of the store (never 0), so records of one
/// run never chain with stale records of another.
pub(crate) fn session_nonce() -> u32 {
    let random = uuid::Uuid::new_v4();
    u32::from_le_bytes(random.as_bytes()[..4].try_into().expect("4 bytes")) | 1
}

pub(crate) fn info_from(sb: &Superblock) -> StoreInfo {
    let codec = Codec::from_parts(sb.codec_tag, sb.codec_level).map(|c| c.to_string()).unwrap_or_default();
    StoreInfo {
        uuid: uuid::Uuid::from_bytes(sb.uuid).to_string(),
        format_version: sb.format_version,
        logical_size_bytes: sb.logical_size_bytes,
        physical_size_bytes: sb.physical_size_bytes,
        segment_size_bytes: sb.segment_size_bytes,
        codec,
        over_provision_ppm: sb.over_provision_ppm,
        native_capacity_bytes: native_capacity_for(
            sb.segment_size_bytes,
            sb.segment_count(),
            sb.over_provision_ppm,
            sb.encrypted(),
            sb.feature_flags & FEATURE_LOG_JUMPS != 0,
        )
        .bytes,
        encrypted: sb.encrypted(),
    }
}

/// Checks a logical size a store may have.
pub(crate) fn validate_logical_size(logical_size_bytes: u64) -> Result<()> {
    if logical_size_bytes == 0
        || !logical_size_bytes.is_multiple_of(BLOCK_SIZE as u64)
        || logical_size_bytes > LOGICAL_SIZE_MAX_BYTES
    {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("logical size {logical_size_bytes} must be a non-zero multiple of 4096 up to 1 EiB (2^60 bytes)"),
        ));
    }
    Ok(())
}

/// Checks an over-provisioning setting.
pub(crate) fn validate_over_provision(ppm: u32) -> Result<()> {
    if !(OVER_PROVISION_MIN_PPM..=OVER_PROVISION_MAX_PPM).contains(&ppm) {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "over-provisioning {}% must be between {}% and {}%",
                ppm as f64 / 10_000.0,
                OVER_PROVISION_MIN_PPM / 10_000,
                OVER_PROVISION_MAX_PPM / 10_000
            ),
        ));
    }
    Ok(())
}

/// Formats `path` (created at the physical size if it does not exist). `progress(done,
/// total)` follows the zeros `FormatOptions::preallocate` writes.
pub(crate) fn format(path: &Path, options: &FormatOptions, progress: &mut dyn FnMut(u64, u64)) -> Result<StoreInfo> {
    let exists = path.exists();
    if !exists {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| Error::io(format!("create {}", path.display()), e))?;
        let formatted = file
            .set_len(options.physical_size_bytes)
            .map_err(|e| size_error(path, options.physical_size_bytes, e))
            .and_then(|()| format_existing(path, false, options, progress));
        // A refused format leaves nothing behind: the file is ours, and a leftover would
        // make the next attempt at that path look like formatting over someone's data.
        if formatted.is_err() {
            let _ = std::fs::remove_file(path);
        }
        return formatted;
    }
    format_existing(path, true, options, progress)
}

/// Setting a new file's size failed: a size larger than the file system allows for one file
/// is the caller's input (EFBIG), anything else an I/O error.
fn size_error(path: &Path, physical_size_bytes: u64, e: std::io::Error) -> Error {
    if e.raw_os_error() == Some(libc::EFBIG) {
        return Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "physical size {physical_size_bytes} bytes is more than the file system of {} allows for one file",
                path.display()
            ),
        );
    }
    Error::io(format!("size {}", path.display()), e)
}

/// Formats a file or block device that exists (`held_before`: it did before this format
/// began, so it may hold someone's data).
fn format_existing(
    path: &Path,
    held_before: bool,
    options: &FormatOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<StoreInfo> {
    let backing = backing::open(path, &FORMAT_OPEN)?;
    if held_before && !options.force {
        refuse_to_overwrite(path, &backing)?;
    }
    let is_file = std::fs::metadata(path).map(|m| m.is_file()).unwrap_or(false);
    let backing = if is_file && backing.size_bytes() != options.physical_size_bytes {
        drop(backing);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| Error::io(format!("open {}", path.display()), e))?;
        file.set_len(options.physical_size_bytes).map_err(|e| size_error(path, options.physical_size_bytes, e))?;
        backing::open(path, &FORMAT_OPEN)?
    } else {
        backing
    };
    format_backing(&backing, options, progress)
}

/// Refuses a target that holds a zdisk store or any data in its first sector.
fn refuse_to_overwrite(path: &Path, backing: &dyn Backing) -> Result<()> {
    if let Ok((sb, _)) = read_superblocks(backing) {
        return Err(Error::new(
            ErrorKind::HoldsData,
            format!(
                "{} already holds zdisk store {}; use --force to overwrite it",
                path.display(),
                info_from(&sb).uuid
            ),
        ));
    }
    // Through std::fs, not the backing: the backing reads whole sectors and refuses to read
    // past its end, and the file may be shorter than a sector.
    let mut head = Vec::with_capacity(SECTOR_SIZE);
    std::fs::File::open(path)
        .and_then(|file| file.take(SECTOR_SIZE as u64).read_to_end(&mut head))
        .map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    if head.iter().any(|&b| b != 0) {
        return Err(Error::new(
            ErrorKind::HoldsData,
            format!("{} holds data; use --force to overwrite it", path.display()),
        ));
    }
    Ok(())
}

/// Formats an already opened backing store (its whole size).
pub(crate) fn format_backing(
    backing: &dyn Backing,
    options: &FormatOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<StoreInfo> {
    let physical_size_bytes = backing.size_bytes() / SECTOR_SIZE as u64 * SECTOR_SIZE as u64;
    let segment_size_bytes = options.segment_size_bytes.unwrap_or_else(|| default_segment_size(physical_size_bytes));
    if !segment_size_is_valid(segment_size_bytes) {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("segment size {segment_size_bytes} must be a multiple of 64 KiB between 64 KiB and 256 MiB"),
        ));
    }
    let segment_count = physical_size_bytes.saturating_sub(DATA_START_BYTES) / segment_size_bytes;
    if segment_count < SEGMENTS_MIN {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "physical size {} is too small: it must hold 1 MiB of superblocks and at least {SEGMENTS_MIN} segments of {segment_size_bytes} bytes",
                backing.size_bytes()
            ),
        ));
    }
    if physical_size_bytes > crate::map::OFFSET_MAX {
        return Err(Error::new(ErrorKind::InvalidArgument, "physical size above 64 TiB"));
    }
    validate_logical_size(options.logical_size_bytes)?;
    validate_over_provision(options.over_provision_ppm)?;
    let encrypted = options.encryption.is_some();
    if native_capacity_for(segment_size_bytes, segment_count, options.over_provision_ppm, encrypted, true).bytes == 0 {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "physical size {physical_size_bytes} is too small: with {segment_size_bytes}-byte segments its reserves and metadata leave no native capacity"
            ),
        ));
    }
    let uuid = *uuid::Uuid::new_v4().as_bytes();
    // The key slot is made (a passphrase's Argon2id runs) before anything is written, so a
    // refused secret leaves the target as it was.
    let keys = match &options.encryption {
        Some(encryption) => Some(KeyHeader::create(uuid, &encryption.secret, encryption.kdf)?),
        None => None,
    };
    let mut sb = Superblock {
        format_version: Superblock::version_for(keys.is_some()),
        uuid,
        generation: 0,
        logical_size_bytes: options.logical_size_bytes,
        physical_size_bytes,
        segment_size_bytes,
        codec_tag: options.codec.tag() as u8,
        codec_level: options.codec.level(),
        feature_flags: FEATURE_LOG_JUMPS
            | if keys.is_some() {
                FEATURE_ENCRYPTED | FEATURE_AUTHENTICATED_LOG | FEATURE_PLACEMENT_USE | FEATURE_SHORT_NONCES
            } else {
                0
            },
        checkpoint_seq: 0,
        replay_offset_bytes: DATA_START_BYTES,
        replay_prev_crc: 0,
        over_provision_ppm: options.over_provision_ppm,
        mac: [0; SUPERBLOCK_MAC_BYTES],
        checkpoint_chunks: Vec::new(),
    };
    if let Some((_, key)) = &keys {
        sb.mac = StoreCipher::new(uuid, key, None).mac(&[&sb.mac_input()]);
    }
    // Purge: old log records must not be mistaken for ours (they would not chain anyway).
    // Zeros leave the data area allocated; a discard gives its space back to a thin backing.
    let data_area_bytes = segment_count * segment_size_bytes;
    lay_out_data_area(backing, options.allocation, data_area_bytes, progress)?;
    let mut slots = sb.encode();
    slots.extend_from_slice(&sb.encode());
    slots.resize(DATA_START_BYTES as usize, 0);
    if let Some((header, _)) = &keys {
        let copy = header.encode();
        for offset in KEY_HEADER_OFFSETS {
            slots[offset as usize..offset as usize + copy.len()].copy_from_slice(&copy);
        }
    }
    backing.write_at(0, &slots).map_err(|e| Error::io("write superblocks", e))?;
    backing.sync().map_err(|e| Error::io("sync superblocks", e))?;
    Ok(info_from(&sb))
}

/// Lays out the data area as `allocation` says: zeros written, or discarded (so no old
/// record is taken for the store's) and, when reserved, allocated without being written.
fn lay_out_data_area(
    backing: &dyn Backing,
    allocation: Allocation,
    data_area_bytes: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    match allocation {
        Allocation::Zeroed => write_zeros(backing, DATA_START_BYTES, data_area_bytes, progress)?,
        Allocation::Sparse | Allocation::Reserved => {
            backing.discard(DATA_START_BYTES, data_area_bytes).map_err(|e| Error::io("discard data area", e))?
        }
    }
    if allocation == Allocation::Reserved {
        backing.reserve(DATA_START_BYTES, data_area_bytes).map_err(|e| {
            Error::io(
                format!(
                    "reserving the data area ({data_area_bytes} bytes) on the backing's file system (format \
                     with --sparse to leave it unreserved)"
                ),
                e,
            )
        })?;
    }
    Ok(())
}

/// Writes zeros over `[offset, offset + len)`, in chunks of 8 MiB (a multiple of the
/// sector, so O_DIRECT takes them), reporting progress after each. The caller syncs.
fn write_zeros(backing: &dyn Backing, offset: u64, len: u64, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
    const CHUNK_BYTES: u64 = 8 << 20;
    let zeros = aligned_vec::avec![[SECTOR_SIZE] | 0u8; CHUNK_BYTES as usize];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(CHUNK_BYTES);
        backing
            .write_at(offset + done, &zeros[..n as usize])
            .map_err(|e| Error::io(format!("write zeros at {}", offset + done), e))?;
        done += n;
        progress(done, len);
    }
    Ok(())
}

/// Reads the superblock without locking or recovering (works while the store is served).
pub(crate) fn info(path: &Path) -> Result<StoreInfo> {
    let backing =
        backing::open(path, &BackingOptions { access: Access::ReadOnly, direct_io: false, lock: Lock::None })?;
    let (sb, _) = read_superblocks(&backing)?;
    Ok(info_from(&sb))
}

/// Both superblock slots: the newest valid one, and the other if it is valid and of the same
/// store (what opening starts from, and what `info`, `check` and key changes read).
pub(crate) fn read_superblocks(backing: &dyn Backing) -> Result<(Superblock, Option<Superblock>)> {
    if backing.size_bytes() < 2 * SUPERBLOCK_SLOT_BYTES as u64 {
        return Err(Error::new(ErrorKind::NotAStore, "too small to hold a zdisk superblock"));
    }
    let mut slots = vec![0u8; 2 * SUPERBLOCK_SLOT_BYTES];
    backing.read_at(0, &mut slots).map_err(|e| Error::io("read superblocks", e))?;
    pick_superblock(&slots, backing.size_bytes())
}

/// Chooses the newest valid superblock slot; also returns the other one if valid and of the
/// same store.
fn pick_superblock(slots: &[u8], backing_size_bytes: u64) -> Result<(Superblock, Option<Superblock>)> {
    let decoded = [
        Superblock::decode(&slots[..SUPERBLOCK_SLOT_BYTES]),
        Superblock::decode(&slots[SUPERBLOCK_SLOT_BYTES..2 * SUPERBLOCK_SLOT_BYTES]),
    ];
    let (mut valid, errors): (Vec<_>, Vec<_>) = decoded.into_iter().partition(|r| r.is_ok());
    if valid.is_empty() {
        // Report the most telling error: a newer version beats corruption beats "foreign".
        let errors: Vec<Error> = errors.into_iter().filter_map(|r| r.err()).collect();
        for kind in [ErrorKind::NewerVersion, ErrorKind::Corrupt] {
            if let Some(e) = errors.iter().find(|e| e.kind() == kind) {
                return Err(Error::new(kind, e.to_string()));
            }
        }
        return Err(Error::new(ErrorKind::NotAStore, "no valid zdisk superblock"));
    }
    let mut valid: Vec<Superblock> = valid.drain(..).filter_map(|r| r.ok()).collect();
    valid.sort_by_key(|sb| std::cmp::Reverse(sb.generation));
    let best = valid.remove(0);
    let other = valid.pop().filter(|sb| sb.uuid == best.uuid);
    if best.physical_size_bytes > backing_size_bytes {
        return Err(Error::new(
            ErrorKind::Truncated,
            format!("the superblock says {} bytes, the backing has {}", best.physical_size_bytes, backing_size_bytes),
        ));
    }
    Ok((best, other))
}
