//! zdisk's engine: a compressed, variable-length, log-structured block store.
//!
//! The engine knows nothing about NBD or the CLI. It turns a [`Backing`] (a file, a block
//! device, or the fault-injecting simulator used by tests) into a block store that
//! compresses every 4 KiB block, packs the fragments back to back in an append-only log,
//! and keeps the contract written in `docs/guarantees.md`:
//!
//! 1. after `flush` (or a FUA request) returns, every write acknowledged before it survives
//!    a crash;
//! 2. every write, trim and write-zeroes request is all-or-nothing across a crash;
//! 3. nothing the client did not write ever changes;
//! 4. corruption is detected by CRC32C and reported as an error, never returned as data.
//!
//! The on-disk format is specified in `docs/format.md`; `format` mirrors it. How the
//! modules divide the work is in `docs/architecture.md`.

mod backing;
mod cache;
mod codec;
pub mod crypto;
mod error;
mod format;
mod map;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
mod stats;
pub(crate) mod store;
mod types;

pub use backing::{is_locked, Backing, FileBacking, Lock};
pub use codec::{
    available_cores, check_codec_cores, decompress_block, looks_incompressible, Codec, CodecFallback, CodecTag,
    Dictionary, DictionarySet, MIN_SAVING_BYTES, NO_DICTIONARIES,
};
pub use crypto::cipher::NonceObserver;
pub use crypto::keys::{KdfParams, SlotInfo, SlotKind};
pub use crypto::Secret;
pub use error::{Error, ErrorKind, Result};
pub use stats::{is_counter_stat, CodecStats, Stats, StoreState};
pub use store::capacity::{
    native_capacity_of_physical, over_provision_ppm_from_percent, OVER_PROVISION_DEFAULT_PPM, OVER_PROVISION_MAX_PPM,
    OVER_PROVISION_MIN_PPM,
};
pub use store::{
    Allocation, CheckReport, DamageReport, DictionaryOptions, DictionaryReport, Durability, Encryption, Extent,
    ExtentKind, FormatOptions, KeyChange, OpenOptions, ReadDone, ReadPlan, ReadQueue, Reaped, RecompressReport,
    Sealing, Store, StoreInfo, DICTIONARY_LEVEL_DEFAULT,
};
pub use types::{Lba, SegmentId};

/// The logical block: the unit of compression and of the map.
pub const BLOCK_SIZE: usize = 4096;
/// The unit the log is written in: every backing write offset and length is a multiple of
/// it. (Reads may be finer: [`Backing::read_alignment`].)
pub const SECTOR_SIZE: usize = 4096;

/// Entry points for the fuzz targets in `fuzz/`: every on-disk decoder, fed arbitrary bytes,
/// must return an error rather than panic or hang.
#[doc(hidden)]
pub mod fuzzing {
    pub fn decode_superblock(bytes: &[u8]) -> bool {
        crate::format::Superblock::decode(bytes).is_ok()
    }
    pub fn decode_record_header(bytes: &[u8]) -> bool {
        let v3 = crate::format::Head::decode(bytes).is_ok() | crate::format::decode_tail(bytes).is_ok();
        v3 | crate::format::v2::decode(bytes).is_ok()
    }
    pub fn decode_checkpoint(bytes: &[u8]) -> bool {
        crate::format::Checkpoint::decode(bytes, 1 << 30).is_ok()
    }
}
