//! The store: request path, log appender, recovery, checkpoints, GC.

use std::path::Path;
use std::sync::Arc;

use crate::backing::Backing;
use crate::codec::Codec;
use crate::error::Result;
use crate::stats::Stats;

/// Options for [`Store::format`].
#[derive(Debug, Clone)]
pub struct FormatOptions {
    /// Bytes the backing file is created with (ignored for block devices: their size is used).
    pub physical_size_bytes: u64,
    /// Logical capacity the client sees; a multiple of 4 KiB.
    pub logical_size_bytes: u64,
    pub codec: Codec,
    /// Segment size; a power of two multiple of 1 MiB. `None` picks a default.
    pub segment_size_bytes: Option<u64>,
    /// Overwrite something that already looks like a zdisk store (or any data).
    pub force: bool,
}

/// Options for [`Store::open`].
#[derive(Debug, Clone)]
pub struct OpenOptions {
    pub read_only: bool,
    /// O_DIRECT where the backing allows it.
    pub direct_io: bool,
    /// Upper bound for the engine's own buffers (open segments awaiting write-out).
    pub cache_bytes_max: u64,
    /// `space_flag` becomes 1 when free space falls below this fraction of the backing.
    pub low_space_fraction: f64,
}

impl Default for OpenOptions {
    fn default() -> OpenOptions {
        OpenOptions {
            read_only: false,
            direct_io: true,
            cache_bytes_max: 256 << 20,
            low_space_fraction: 0.10,
        }
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

/// The result of [`Store::check`].
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CheckReport {
    pub blocks_checked: u64,
    pub records_checked: u64,
    /// One line per problem found; empty when the store is clean.
    pub problems: Vec<String>,
}

pub struct Store {
    _backing: Arc<dyn Backing>,
}

impl Store {
    /// Formats `path` (created at the physical size if it does not exist).
    pub fn format(path: &Path, options: &FormatOptions) -> Result<StoreInfo> {
        let _ = (path, options);
        todo!()
    }

    /// Formats an already opened backing store.
    pub fn format_backing(backing: &dyn Backing, options: &FormatOptions) -> Result<StoreInfo> {
        let _ = (backing, options);
        todo!()
    }

    /// Reads the superblock without locking or recovering.
    pub fn info(path: &Path) -> Result<StoreInfo> {
        let _ = path;
        todo!()
    }

    /// Opens and recovers the store at `path` (locked against other processes).
    pub fn open(path: &Path, options: &OpenOptions) -> Result<Store> {
        let _ = (path, options);
        todo!()
    }

    pub fn open_backing(backing: Arc<dyn Backing>, options: &OpenOptions) -> Result<Store> {
        let _ = (backing, options);
        todo!()
    }

    /// Changes the logical size (grow any time; shrink only if nothing is mapped past the end).
    pub fn resize(&self, logical_size_bytes: u64) -> Result<()> {
        let _ = logical_size_bytes;
        todo!()
    }

    pub fn info_of(&self) -> StoreInfo {
        todo!()
    }

    pub fn logical_size_bytes(&self) -> u64 {
        todo!()
    }

    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let _ = (offset, buf);
        todo!()
    }

    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let _ = (offset, data, fua);
        todo!()
    }

    pub fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        let _ = (offset, length, fua);
        todo!()
    }

    pub fn write_zeroes(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        let _ = (offset, length, fua);
        todo!()
    }

    pub fn flush(&self) -> Result<()> {
        todo!()
    }

    /// Allocation status of `[offset, offset+length)`, merged into runs.
    pub fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>> {
        let _ = (offset, length);
        todo!()
    }

    pub fn stats(&self) -> Stats {
        todo!()
    }

    /// Verifies every record header and block checksum and the space accounting.
    /// `progress(done, total)` is called now and then.
    pub fn check(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<CheckReport> {
        let _ = progress;
        todo!()
    }

    /// Flushes and writes a checkpoint, so the next open replays nothing.
    pub fn close(self) -> Result<()> {
        todo!()
    }
}
