//! What a caller passes to the store and gets back besides data: format and open options,
//! the superblock summary, extents, and the check report.
//!
//! The environment variables the engine heeds are read here and nowhere else, so one file
//! says what outside the options can change a store's behaviour. Most set an `OpenOptions`
//! default (a caller's explicit value wins); the rest of the engine gets them as options or
//! arguments:
//!
//! | variable | sets |
//! |---|---|
//! | `ZDISK_CODEC_FALLBACK` | `OpenOptions::codec_fallback` |
//! | `ZDISK_CODEC_CORES` | `OpenOptions::codec_cores` |
//! | `ZDISK_PACING` | `OpenOptions::pacing` (`off`) |
//! | `ZDISK_WRITE_PERMITS` | `OpenOptions::write_concurrency` |
//! | `ZDISK_WRITE_PERMIT_FAIR_US` | `OpenOptions::write_permit_fair_after` |
//! | `ZDISK_DISCARD_FREED` | `OpenOptions::discard_freed` (`on`) |
//! | `ZDISK_IDLE_AFTER_MS` | `OpenOptions::idle_after` |
//! | `ZDISK_IDLE_SPARE_CORES` | `OpenOptions::idle_spare_cores` |
//! | `ZDISK_LOCK_MEMORY` | whether the process locks all its memory once it holds keys (`off`; `lock_memory_from_env`, read by `crypto::protect_process`, which runs once per process whatever the store) |

use std::sync::Arc;
use std::time::Duration;

use crate::codec::{available_cores, check_codec_cores, Codec, CodecFallback};
#[cfg(feature = "sim")]
use crate::crypto::cipher::NonceObserver;
use crate::crypto::keys::KdfParams;
use crate::crypto::Secret;

/// Options for [`super::Store::format`].
#[derive(Debug, Clone)]
pub struct FormatOptions {
    /// Bytes the backing file is created with (ignored for block devices: their size is used).
    pub physical_size_bytes: u64,
    /// Logical capacity the client sees; a multiple of 4 KiB.
    pub logical_size_bytes: u64,
    pub codec: Codec,
    /// Segment size; a multiple of 64 KiB. `None` picks a default from the physical size.
    pub segment_size_bytes: Option<u64>,
    /// Overwrite something that already looks like a zdisk store (or any data).
    pub force: bool,
    /// Share of the data area kept spare beyond native capacity, in parts per million
    /// (`OVER_PROVISION_MIN_PPM..=OVER_PROVISION_MAX_PPM`).
    pub over_provision_ppm: u32,
    /// Encrypt the store (`docs/format.md`, "Encryption"): its first key slot wraps the data
    /// key under this secret.
    pub encryption: Option<Encryption>,
    /// How the data area is laid out on the backing (a backing file; a block device is
    /// allocated already).
    pub allocation: Allocation,
}

/// How `format` lays out the data area on a backing file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocation {
    /// Left unallocated: the file system allocates blocks as the log first writes them. A
    /// file system that fills up under the store turns it read-only
    /// (`ErrorKind::BackingFull`, state `failed`).
    Sparse,
    /// Reserved (fallocate) but not written: the file system holds the physical size for
    /// the store from format on, so it cannot fill up under it; format fails if it lacks
    /// the room. What `zdisk format` does unless told `--sparse` or `--preallocate`.
    Reserved,
    /// Zeros written over it: every segment lies on blocks the file system has allocated
    /// and written, so no flush waits for it to allocate or convert them (docs/format.md,
    /// "Backing allocation"). Costs one write of the physical size at format.
    Zeroed,
}

/// Whether a store's fragments are sealed (encrypted), where that is all a computation
/// needs to know of encryption: a sealed fragment carries a nonce and a tag, so fewer fit a
/// segment (`native_capacity_of_physical`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sealing {
    Plain,
    Encrypted,
}

/// How `format` encrypts a store.
#[derive(Debug, Clone)]
pub struct Encryption {
    pub secret: Arc<Secret>,
    /// Used when the secret is a passphrase.
    pub kdf: KdfParams,
}

/// Stored blocks a store holds before it trains its first dictionary on its own (unless
/// told): 16 MiB, four times the most `sample_blocks` reads, so the sample is spread over
/// the data rather than being all of it.
pub const AUTO_DICTIONARY_BLOCKS_MIN: u64 = 4096;

/// How long the host must have been away before idle work starts, unless told.
pub const IDLE_AFTER_DEFAULT: std::time::Duration = std::time::Duration::from_secs(2);

/// The map cache's default: the map of 128 GiB of logical space stays cached (2 MiB of
/// pages per GiB), and a checkpoint's worth of changes fits beside it.
pub const DEFAULT_MAP_CACHE_BYTES: u64 = 256 << 20;

/// The write-behind bound's default: beside a 128 KiB streaming writer, a committer's p99
/// flush fell from 440-570 ms (unbounded) to 27-42 ms, for about 2% of 4 KiB random write
/// IOPS (docs/nbd.md, "Write-behind").
pub const WRITE_BEHIND_DEFAULT_BYTES: u64 = 2 << 20;

/// Options for [`super::Store::open`].
#[derive(Debug, Clone)]
pub struct OpenOptions {
    pub read_only: bool,
    /// O_DIRECT where the backing allows it.
    pub direct_io: bool,
    /// Upper bound for the engine's buffers (segments awaiting write-out).
    pub cache_bytes_max: u64,
    /// Write-behind bound: a host write that leaves more than this many bytes appended but
    /// not yet written to the backing writes them out itself, so a flush never has more to
    /// write first (0: only `cache_bytes_max` bounds the backlog). A committer beside a
    /// streaming writer then waits for this much, not for the whole cache (docs/nbd.md,
    /// "Write-behind"; default `WRITE_BEHIND_DEFAULT_BYTES`).
    pub write_behind_bytes_max: u64,
    /// Memory for the read cache of compressed fragments (0: none, the default). It pays
    /// where reads have locality; under uniform random reads it hits at about its size over
    /// the stored data and measured no faster (docs/nbd.md).
    pub read_cache_bytes: u64,
    /// `space_flag` becomes 1 when free space falls below this fraction of the data area.
    pub low_space_fraction: f64,
    /// A checkpoint is written after this many bytes of log; bounds recovery time.
    pub checkpoint_interval_bytes: u64,
    /// Memory for the block map's cached pages and its changes not yet checkpointed
    /// (`docs/scale.md`). Pages beyond it are read from the store as needed.
    pub map_cache_bytes: u64,
    /// Run the background threads (write-out, GC, checkpoints). Tests turn them off to make
    /// every backing I/O happen on the calling thread, deterministically.
    pub background: bool,
    /// Open a store whose recovery lost records (none of the copies of their description
    /// survived) for writing anyway, accepting that the blocks they wrote may read their
    /// older contents. Without it such a store opens read-only and reads every block not
    /// provably newer than the loss as EIO.
    pub accept_data_loss: bool,
    /// When host writes may be compressed with LZ4 instead of the store's codec, or stored
    /// uncompressed for now (`codec.rs`, "Adaptive fallback"). Defaults to `ZDISK_CODEC_FALLBACK`, else `Auto`.
    pub codec_fallback: CodecFallback,
    /// How many cores the store's codec may keep busy before host writes fall back to LZ4
    /// (`CodecFallback::Auto`; GC's recompression waits on the same signal): 1 up to the
    /// cores the process may run on, else open refuses it. None: half the cores, at least
    /// one (`codec::default_codec_cores`). Defaults to `ZDISK_CODEC_CORES` (measurements),
    /// else None; `zdisk serve --codec-cores N` sets it.
    pub codec_cores: Option<usize>,
    /// Pace host writes against GC as free space runs low (`space.rs`, `Pacer`). On unless
    /// `ZDISK_PACING=off`: at native capacity it cut p99.9 write latency about sevenfold and
    /// raised throughput by a third (docs/space.md, "Pacing").
    pub pacing: bool,
    /// Host writes (and trims, write-zeroes) that compress and append at once; the others
    /// sleep until a permit is free or they are overdue (`space.rs`, `WritePermits`). 0: no limit.
    /// Defaults to `ZDISK_WRITE_PERMITS`, else the number of cores: more writers than cores
    /// only preempt each other while holding the store's locks (docs/space.md, "Write
    /// admission").
    pub write_concurrency: usize,
    /// How long a host write waiting for a permit may be passed over by writers arriving
    /// after it (`space.rs`, `WritePermits`): longer trades the tail for throughput. Defaults to
    /// `ZDISK_WRITE_PERMIT_FAIR_US` (microseconds), else 1 ms (docs/space.md, "Write
    /// admission").
    pub write_permit_fair_after: Duration,
    /// Discard each segment as it is freed (a hole punched in a backing file, BLKDISCARD
    /// on a block device), giving its space back to a thin backing. Off by default, as
    /// ZFS's `autotrim`: the log reuses freed segments, and in a backing file each reuse
    /// of a punched segment makes the next flushes wait for the file system to allocate
    /// blocks again (docs/format.md, "Backing allocation"). Defaults to
    /// `ZDISK_DISCARD_FREED=on`, else off.
    pub discard_freed: bool,
    /// Idle work (`store/idle.rs`) starts once the host has sent no request for this long:
    /// recompression of what the write path stored with its fallback codec, and the first
    /// dictionary. None: never. Defaults to `ZDISK_IDLE_AFTER_MS`, else 2 s.
    pub idle_after: Option<std::time::Duration>,
    /// Idle work also waits until other processes leave at least this many cores unused
    /// (`store/spare_cpu.rs`; 0: never waits). Defaults to `ZDISK_IDLE_SPARE_CORES`, else 1.
    pub idle_spare_cores: f64,
    /// Train the store's first zstd dictionary on its own, when idle, once it holds this
    /// many stored blocks (default 4096: 16 MiB; None: never). A store with a dictionary is
    /// refused by zdisk versions before dictionaries (docs/format.md, "Dictionaries").
    pub auto_dictionary_blocks: Option<u64>,
    /// The passphrase or key file of an encrypted store (required to open one; refused for
    /// a plain store).
    pub key: Option<Arc<Secret>>,
    /// Nonces leased per key-header write (`crypto::cipher`); tests make it small.
    #[doc(hidden)]
    pub nonce_lease: u64,
    /// Sees every nonce an encrypted store hands out (the tests that prove none repeats).
    #[doc(hidden)]
    #[cfg(feature = "sim")]
    pub nonce_observer: Option<NonceObserver>,
    /// At each writable open, move the nonce high-water mark to this many values before
    /// the end of its epoch (the tests that cross nonce epochs within a run).
    #[doc(hidden)]
    #[cfg(feature = "sim")]
    pub nonce_epoch_end_margin: Option<u64>,
}

impl Default for OpenOptions {
    fn default() -> OpenOptions {
        OpenOptions {
            read_only: false,
            direct_io: true,
            cache_bytes_max: 256 << 20,
            write_behind_bytes_max: WRITE_BEHIND_DEFAULT_BYTES,
            read_cache_bytes: 0,
            low_space_fraction: 0.10,
            checkpoint_interval_bytes: 512 << 20,
            map_cache_bytes: DEFAULT_MAP_CACHE_BYTES,
            background: true,
            accept_data_loss: false,
            codec_fallback: codec_fallback_from_env(),
            codec_cores: codec_cores_from_env(),
            pacing: !std::env::var("ZDISK_PACING").is_ok_and(|v| v == "off"),
            write_concurrency: write_concurrency_from_env(),
            write_permit_fair_after: write_permit_fair_after_from_env(),
            discard_freed: std::env::var("ZDISK_DISCARD_FREED").is_ok_and(|v| v == "on"),
            idle_after: idle_after_from_env(),
            idle_spare_cores: idle_spare_cores_from_env(),
            auto_dictionary_blocks: Some(AUTO_DICTIONARY_BLOCKS_MIN),
            key: None,
            nonce_lease: crate::crypto::cipher::NONCE_LEASE_DEFAULT,
            #[cfg(feature = "sim")]
            nonce_observer: None,
            #[cfg(feature = "sim")]
            nonce_epoch_end_margin: None,
        }
    }
}

/// The variable that sets `OpenOptions::codec_fallback` by default (tests and measurements).
pub const CODEC_FALLBACK_ENV: &str = "ZDISK_CODEC_FALLBACK";

/// `ZDISK_CODEC_FALLBACK` (`auto`, `auto-uncompressed`, `always`, `never`, `uncompressed`) if
/// set and valid, else `Auto`.
fn codec_fallback_from_env() -> CodecFallback {
    match std::env::var(CODEC_FALLBACK_ENV) {
        Ok(value) => value.parse().unwrap_or_else(|e| {
            tracing::warn!("{CODEC_FALLBACK_ENV}: {e}; using auto");
            CodecFallback::Auto
        }),
        Err(_) => CodecFallback::Auto,
    }
}

/// How long a waiter for a write permit (`space.rs`) may be passed over by writers arriving after it. Handing a permit to a
/// sleeping waiter leaves it idle until the scheduler runs that thread (on a busy 2-core
/// machine ~0.4 ms on average), so permits go to whoever asks first while the wait is
/// short, and in order once it is not: strict order cost 22% of the throughput of 4K
/// writes, none cost the tail (docs/space.md, "Write admission"). The default of
/// `OpenOptions::write_permit_fair_after`.
pub(crate) const WRITE_PERMIT_FAIR_AFTER: Duration = Duration::from_millis(1);

/// `ZDISK_WRITE_PERMIT_FAIR_US` (microseconds), else `WRITE_PERMIT_FAIR_AFTER`.
fn write_permit_fair_after_from_env() -> Duration {
    let default = WRITE_PERMIT_FAIR_AFTER;
    match std::env::var("ZDISK_WRITE_PERMIT_FAIR_US") {
        Ok(v) => v.parse().map(Duration::from_micros).unwrap_or_else(|_| {
            tracing::warn!("ZDISK_WRITE_PERMIT_FAIR_US={v:?} is not a number of microseconds; using the default");
            default
        }),
        Err(_) => default,
    }
}

/// Whether the process should lock all its memory once it holds key material
/// (`crypto::protect_process`): yes unless `ZDISK_LOCK_MEMORY=off`. A process-wide choice
/// made once, before any store's options exist (format and key changes have none), hence a
/// function and not an option.
pub(crate) fn lock_memory_from_env() -> bool {
    !std::env::var("ZDISK_LOCK_MEMORY").is_ok_and(|v| v == "off")
}

/// `ZDISK_IDLE_SPARE_CORES` (cores, fractions allowed; 0: idle work never waits for the
/// machine), else `SPARE_CORES_MIN`.
fn idle_spare_cores_from_env() -> f64 {
    let default = super::spare_cpu::SPARE_CORES_MIN;
    match std::env::var("ZDISK_IDLE_SPARE_CORES") {
        Ok(v) => v.parse::<f64>().ok().filter(|c| c.is_finite() && *c >= 0.0).unwrap_or_else(|| {
            tracing::warn!("ZDISK_IDLE_SPARE_CORES={v:?} is not a number of cores; using {default}");
            default
        }),
        Err(_) => default,
    }
}

impl OpenOptions {
    /// The cores the store's codec may keep busy: `codec_cores` checked against the cores the
    /// process may run on (an `InvalidArgument` error names the range), else the default.
    pub(crate) fn resolved_codec_cores(&self) -> crate::error::Result<usize> {
        let available = available_cores();
        match self.codec_cores {
            Some(cores) => check_codec_cores(cores, available)
                .map_err(|e| crate::error::Error::new(crate::error::ErrorKind::InvalidArgument, e)),
            None => Ok(crate::codec::default_codec_cores(available)),
        }
    }
}

/// `ZDISK_CODEC_CORES` (1 up to the cores the process may run on), else None (the default,
/// half the cores). A value out of range is warned about and ignored: the variable is for
/// measurements, and a store should still open.
fn codec_cores_from_env() -> Option<usize> {
    let v = std::env::var(CODEC_CORES_ENV).ok()?;
    let checked =
        v.parse::<usize>().map_err(|e| e.to_string()).and_then(|cores| check_codec_cores(cores, available_cores()));
    match checked {
        Ok(cores) => Some(cores),
        Err(e) => {
            tracing::warn!("{CODEC_CORES_ENV}={v:?}: {e}; using the default");
            None
        }
    }
}

/// The variable that sets `OpenOptions::codec_cores` by default (measurements).
pub const CODEC_CORES_ENV: &str = "ZDISK_CODEC_CORES";

/// `ZDISK_WRITE_PERMITS` (a number of writers; 0: no limit), else the number of cores.
fn write_concurrency_from_env() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match std::env::var("ZDISK_WRITE_PERMITS") {
        Ok(v) => v.parse::<usize>().unwrap_or_else(|_| {
            tracing::warn!("ZDISK_WRITE_PERMITS={v:?} is not a number of writers; using the number of cores");
            cores
        }),
        Err(_) => cores,
    }
}

/// `ZDISK_IDLE_AFTER_MS` (milliseconds; 0 or "off": never), else the default.
fn idle_after_from_env() -> Option<std::time::Duration> {
    match std::env::var("ZDISK_IDLE_AFTER_MS") {
        Ok(v) if v == "off" || v == "0" => None,
        Ok(v) => match v.parse::<u64>() {
            Ok(ms) => Some(std::time::Duration::from_millis(ms)),
            Err(_) => {
                tracing::warn!("ZDISK_IDLE_AFTER_MS={v:?} is not a number of milliseconds; using the default");
                Some(IDLE_AFTER_DEFAULT)
            }
        },
        Err(_) => Some(IDLE_AFTER_DEFAULT),
    }
}

/// What the superblock says, readable without opening (and locking) the store.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StoreInfo {
    pub uuid: String,
    pub format_version: u32,
    pub logical_size_bytes: u64,
    pub physical_size_bytes: u64,
    pub segment_size_bytes: u64,
    pub codec: String,
    /// Spare share of the data area, in parts per million (0 in stores formatted before
    /// over-provisioning was recorded).
    pub over_provision_ppm: u32,
    /// The logical bytes incompressible data can always fill and overwrite
    /// (`store/capacity.rs`).
    pub native_capacity_bytes: u64,
    /// Format version 5: the data is encrypted (`docs/format.md`, "Encryption").
    pub encrypted: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ExtentKind {
    /// Stored data.
    Data,
    /// Written as zeroes: reads as zero, costs no space, but was written.
    Zero,
    /// Never written or trimmed: reads as zero.
    Hole,
}

/// A run of blocks with one kind, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Extent {
    pub offset: u64,
    pub length: u64,
    pub kind: ExtentKind,
}

/// The result of [`super::Store::check`].
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CheckReport {
    pub blocks_checked: u64,
    pub records_checked: u64,
    /// One line per problem found; empty when the store is clean.
    pub problems: Vec<String>,
    /// The problems again, with where they are and which blocks they touch.
    pub damage: Vec<DamageReport>,
    /// What costs nothing: a record no later record proves durable, torn by a crash, its
    /// content complete (one copy of its description and its payload survive); damage to a record
    /// that maps no block (a checkpoint chunk, a map-pages record's tail).
    pub notes: Vec<String>,
}

/// One problem `check` found, located.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DamageReport {
    /// Byte offset on the backing store where the damage is.
    pub offset_bytes: u64,
    /// What is damaged and what it means.
    pub what: String,
    /// The LBA ranges (first block, block count) affected, where known.
    pub lbas: Vec<(u64, u64)>,
}
