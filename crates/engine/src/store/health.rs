//! Whether the store may be written, and what recovery found: the first failure of a
//! backing write or sync, and the records recovery found damaged or lost.
//!
//! Invariants:
//! - Once `Health::failed` is set it stays set: nothing is written any more, because no
//!   later flush could vouch for what the failed one lost.
//! - `Health::recovery` is set once, at open; a store that lost records (`Degraded`) and
//!   did not accept the loss is read-only.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::error::{Error, ErrorKind, Result};
use crate::stats::StoreState;
use crate::types::{Lba, SegmentId};

/// Why a store failed: the first backing write or sync that did.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub reason: String,
    /// The backing's file system (or device) was full (ENOSPC).
    pub backing_full: bool,
}

/// Whether the store may still be written, and why not: shared by the store and its log
/// (which fails the store when it cannot apply a record it appended).
///
/// Invariant: once `failed` is set (a backing write or sync failed) it stays set: nothing
/// is written any more, because no later flush could vouch for what the failed one lost.
pub(crate) struct Health {
    pub read_only: bool,
    /// Recovery's losses are accepted (`OpenOptions::accept_data_loss`): not degraded.
    pub accept_data_loss: bool,
    pub failed: AtomicBool,
    /// Why the store failed (the first failure; set with `failed`).
    pub failure: OnceLock<Failure>,
    /// What recovery found damaged (set once, at open).
    pub recovery: OnceLock<RecoveryFindings>,
}

impl Health {
    pub fn new(read_only: bool, accept_data_loss: bool) -> Health {
        Health {
            read_only,
            accept_data_loss,
            failed: AtomicBool::new(false),
            failure: OnceLock::new(),
            recovery: OnceLock::new(),
        }
    }

    pub fn check_writable(&self) -> Result<()> {
        if self.read_only {
            return Err(Error::new(ErrorKind::ReadOnly, "the store was opened read-only"));
        }
        if let Some(degraded) = self.degraded() {
            return Err(Error::new(
                ErrorKind::ReadOnly,
                format!(
                    "the store is damaged: records from {} on were lost, so it is open read-only (see `zdisk check`)",
                    degraded.first_lost_seq
                ),
            ));
        }
        if self.failed.load(Ordering::Acquire) {
            let failure = self.failure.get();
            if failure.is_some_and(|f| f.backing_full) {
                return Err(Error::new(
                    ErrorKind::BackingFull,
                    "an earlier backing write found its file system full; the store is read-only until reopened \
                     with room",
                ));
            }
            return Err(Error::new(
                ErrorKind::ReadOnly,
                "an earlier backing write or sync failed; the store is read-only until reopened",
            ));
        }
        Ok(())
    }

    /// Set when recovery lost records and the caller did not accept the loss: the store is
    /// read-only and blocks not provably newer than the loss read as EIO.
    pub fn degraded(&self) -> Option<&Degraded> {
        if self.accept_data_loss {
            return None;
        }
        self.recovery.get().and_then(|r| r.degraded.as_ref())
    }

    /// Makes the store read-only after a backing write or sync failed; returns the error.
    pub fn fail(&self, e: Error) -> Error {
        let first = self.failure.set(Failure { reason: e.to_string(), backing_full: e.kind() == ErrorKind::NoSpace });
        self.failed.store(true, Ordering::Release);
        if first.is_ok() {
            tracing::error!("backing I/O failed, store is now read-only: {e}");
        }
        e
    }

    /// What the store is now, and why when not `Ok` (`Stats::state`).
    pub fn state(&self) -> (StoreState, String) {
        if let Some(failure) = self.failure.get() {
            return (StoreState::Failed, failure.reason.clone());
        }
        if let Some(degraded) = self.degraded() {
            let why = format!("recovery lost records from {} on (see `zdisk check`)", degraded.first_lost_seq);
            return (StoreState::Degraded, why);
        }
        if self.read_only {
            return (StoreState::ReadOnly, "opened read-only".to_string());
        }
        (StoreState::Ok, String::new())
    }
}

/// A record recovery found damaged.
#[derive(Debug, Clone)]
pub(crate) struct DamagedRecord {
    /// Where it starts (or where the damage starts, for a lost record).
    pub offset_bytes: u64,
    /// What was damaged and what recovery did.
    pub what: String,
    /// The LBA ranges (start, blocks) it wrote, where known.
    pub lbas: Vec<(Lba, u64)>,
    /// Complete, and no later record proves it durable: what a crash during its write
    /// leaves (a torn head or tail sector), not decay. Nothing was lost.
    pub torn_tail: bool,
    /// A checkpoint chunk or marker: nothing maps to it (a retained checkpoint that needs a
    /// damaged chunk is reported on its own).
    pub maps_nothing: bool,
}

/// A store that lost records: which blocks are provably newer than the loss.
#[derive(Debug, Clone, Default)]
pub(crate) struct Degraded {
    pub first_lost_seq: u64,
    /// Ranges (start → end, exclusive) of LBAs written, trimmed or zeroed after the loss.
    newer: BTreeMap<u64, u64>,
}

impl Degraded {
    pub(super) fn from(first_lost_seq: u64) -> Degraded {
        Degraded { first_lost_seq, newer: BTreeMap::new() }
    }

    pub(super) fn note(&mut self, start: Lba, blocks: u64) {
        let (mut start, mut end) = (start.0, start.0.saturating_add(blocks));
        // Merge with overlapping or adjacent ranges.
        if let Some((&s, &e)) = self.newer.range(..=start).next_back() {
            if e >= start {
                start = s;
                end = end.max(e);
            }
        }
        while let Some((&s, &e)) = self.newer.range(start..).next() {
            if s > end {
                break;
            }
            end = end.max(e);
            self.newer.remove(&s);
        }
        self.newer.insert(start, end);
    }

    /// Whether block `lba` was written after the loss (so no lost record can be newer).
    pub fn is_newer(&self, lba: Lba) -> bool {
        self.newer.range(..=lba.0).next_back().is_some_and(|(_, &end)| lba.0 < end)
    }
}

/// What recovery found, for `check` and the statistics.
#[derive(Debug, Clone, Default)]
pub(crate) struct RecoveryFindings {
    pub damaged: Vec<DamagedRecord>,
    pub degraded: Option<Degraded>,
    /// The segment the last replayed segment's link names: where the log goes on.
    pub continue_in: Option<SegmentId>,
    /// Whether replay had to read every segment's start (an older format, an unreadable
    /// link, or damage).
    pub indexed: bool,
}
