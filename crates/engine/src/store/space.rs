//! Space: when host writers wait, and for what — their block stripes (a partial block's
//! read-modify-write), a write permit (`permits.rs`), GC's pace as free space runs low
//! (`pacing.rs`), room in the log beyond their class's reserve (`capacity.rs` has the
//! arithmetic; `admit.rs` runs the foreground GC rounds that make room) — and the logical
//! size and over-provisioning those reserves are computed from.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use super::capacity::{checkpoint_room_for, Reserves};
use super::lock::{Mutex, Rank};
use super::pacing::Pacer;
use super::permits::WritePermits;
use crate::error::{Error, ErrorKind};

/// Stripes of the partial-block locks (by LBA).
pub(crate) const BLOCK_LOCK_STRIPES: usize = 1024;

pub(crate) struct Space {
    /// Rank 0: stripes serialising read-modify-write of partial blocks.
    pub block_locks: Vec<Mutex<()>>,
    /// Host writes' CPU work, at most one per core at a time (`permits.rs`).
    pub write_permits: WritePermits,
    /// Host writes' pace against GC (no lock: atomics).
    pub pacer: Pacer,
    /// Whether pacing is on (`OpenOptions::pacing`): nothing reads `host_slack_bytes`
    /// otherwise.
    pacing: bool,
    /// Free bytes above the host reserve, as of the last change to the log's space (an
    /// append or a freeing; `publish_host_slack`): what pacing reads, so that a writer
    /// about to be paced does not take the log lock (docs/space.md, "Yielding locks").
    pub host_slack_bytes: AtomicU64,
    /// A host request was refused for lack of space (`space_flag` 2) and none has
    /// succeeded since.
    pub exhausted: AtomicBool,
    pub logical_size_bytes: AtomicU64,
    /// The over-provisioning the superblock records (`capacity.rs`; changed by
    /// `Store::set_over_provision`).
    pub over_provision_ppm: AtomicU32,
    segment_count: u64,
    segment_capacity_bytes: u64,
}

/// What a store's space starts from at open.
pub(crate) struct SpaceParts {
    pub write_concurrency: usize,
    /// `OpenOptions::write_permit_fair_after` (`permits.rs`).
    pub write_permit_fair_after: std::time::Duration,
    pub pacing: bool,
    pub logical_size_bytes: u64,
    pub over_provision_ppm: u32,
    pub segment_count: u64,
    pub segment_capacity_bytes: u64,
}

impl Space {
    pub fn new(parts: SpaceParts) -> Space {
        Space {
            block_locks: (0..BLOCK_LOCK_STRIPES).map(|_| Mutex::new(Rank::BlockStripe, ())).collect(),
            write_permits: WritePermits::new(parts.write_concurrency, parts.write_permit_fair_after),
            pacer: Pacer::new(),
            pacing: parts.pacing,
            host_slack_bytes: AtomicU64::new(u64::MAX),
            exhausted: AtomicBool::new(false),
            logical_size_bytes: AtomicU64::new(parts.logical_size_bytes),
            over_provision_ppm: AtomicU32::new(parts.over_provision_ppm),
            segment_count: parts.segment_count,
            segment_capacity_bytes: parts.segment_capacity_bytes,
        }
    }

    /// Every class's reserve as of now: the checkpoint room (see [`checkpoint_room_for`])
    /// and the trained dictionaries a checkpoint carries, `dictionary_table_bytes` — up to
    /// 8 of up to 256 KiB, which the static bound does not know (native capacity does not
    /// count them: they come out of the bound's slack and the over-provisioning,
    /// docs/space.md, "Reserves").
    pub fn reserves(&self, dictionary_table_bytes: u64) -> Reserves {
        let checkpoint_room_bytes = checkpoint_room_for(
            self.logical_size_bytes.load(Ordering::Relaxed),
            self.segment_count,
            self.segment_capacity_bytes,
        ) + dictionary_table_bytes;
        Reserves::new(self.segment_capacity_bytes, checkpoint_room_bytes)
    }

    /// Publishes the free bytes above the host reserve for pacing (`host_slack_bytes`);
    /// called wherever they change (appends, freeing) with `LogGuard::host_slack`'s answer.
    pub fn publish_host_slack(&self, host_slack_bytes: u64) {
        if self.pacing {
            self.host_slack_bytes.store(host_slack_bytes, Ordering::Relaxed);
        }
    }

    /// Remembers that a host request was refused for lack of space (`space_flag` 2) until
    /// one succeeds again.
    pub fn note_no_space(&self, e: &Error) {
        if e.kind() == ErrorKind::NoSpace {
            self.exhausted.store(true, Ordering::Relaxed);
        }
    }
}
