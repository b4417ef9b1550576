//! The state an open store shares between request threads and its background threads.
//!
//! Invariants:
//! - Every lock here has a rank; `lock.rs` writes down the order and checks it in debug
//!   builds.
//! - Once `Health::failed` is set it stays set (see `Health`).

use std::sync::Arc;

use super::background::Background;
use super::codecs::Codecs;
use super::geometry::Geometry;
use super::health::{Degraded, Health};
use super::lock::{Mutex, RwLock};
use super::log::Log;
use super::options::OpenOptions;
use super::space::Space;
use crate::backing::Backing;
use crate::cache::Reads;
use crate::error::Error;
use crate::format::Superblock;
use crate::map::PagedMap;
use crate::stats::Counters;
use crate::types::SegmentId;

/// The open store: a composition of the components below, each owning its state and the
/// locks that guard it (the lock order is `lock.rs`).
pub(crate) struct Inner {
    pub backing: Arc<dyn Backing>,
    pub geometry: Geometry,
    pub options: OpenOptions,
    /// Whether the store may be written; what recovery found (shared with the log).
    pub health: Arc<Health>,
    /// Rank 6 (its tree, rank 7). Readers hold the read lock while they use entries;
    /// freeing a segment takes the write lock once as a barrier.
    pub map: RwLock<PagedMap>,
    /// The log (`log.rs`): its state (rank 5), its write-out (rank 4), its segment buffers
    /// (rank 8), the durable sequence number, the cipher.
    pub log: Log,
    /// Rank 2: serialises checkpoints and holds the superblock of the newest durable one.
    pub checkpoint: Mutex<Superblock>,
    /// When host writers wait: pacing, permits, block stripes (rank 1), the reserves as of
    /// now (`space.rs`).
    pub space: Space,
    /// GC's locks (ranks 1 and 3) and the background threads' wake-ups (`background.rs`).
    pub background: Background,
    /// The read cache and what host reads cost the device (`cache.rs`).
    pub reads: Reads,
    /// Dictionaries, codec counters, codec cores (`codecs.rs`).
    pub codecs: Codecs,
    /// The persisted counters (shared with the log).
    pub counters: Arc<Counters>,
}

impl Inner {
    pub fn degraded(&self) -> Option<&Degraded> {
        self.health.degraded()
    }

    pub fn fail(&self, e: Error) -> Error {
        self.health.fail(e)
    }

    /// Segments whose bytes may still be only in memory: GC and freeing leave them be.
    pub fn unwritten_segments(&self) -> Vec<SegmentId> {
        self.log.buffered.read().iter().map(|b| b.segment).collect()
    }
}
