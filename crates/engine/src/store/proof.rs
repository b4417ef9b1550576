//! Flush proofs: after a flush's sync, and before the flush is acknowledged, one sector
//! at a fixed place says which records that sync made durable (`format/proof.rs`,
//! `docs/format.md` "Flush proof").
//!
//! Recovery uses it where nothing in the log tells a torn write from decay: the records
//! the last flush before a crash made durable, not followed by any later record. A record
//! the proof covers that does not verify is applied (its damaged blocks fail their reads);
//! one it covers that is missing is a loss (the store opens degraded). Either way a block
//! reads its latest flushed value or an error, never the one before.
//!
//! Invariants:
//! - A proof is written only after the sync that made its records durable, and only under
//!   the `io` lock, so no log write is in flight beside it: any copy that reads back is true.
//! - A flush is acknowledged only after the proof covering it is synced (`write_out`).
//! - Every writable open writes one (after a sync) before it appends anything, so the
//!   newest proof is always the latest writable run's, about the history that run recovered.

use crate::format::ProofSector;

/// What the last proof written said (held under the `io` lock).
#[derive(Debug, Default)]
pub(crate) struct ProofState {
    pub generation: u64,
    pub proven_seq: u64,
    /// This run's session nonce (set at open, before the first proof; never 0).
    pub session: u32,
    /// Every log write so far is durable: none since the last sync (or write-through write)
    /// under this lock. False until the first (a store just opened has made no such sync),
    /// and from a write-out without a sync, or a failed write, on.
    pub log_synced: bool,
}

/// What recovery knows from the proof sector.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Proven(pub ProofSector);

impl Proven {
    /// Whether the proof covers a damaged candidate `seq` of the run `session`: that run
    /// synced it before it wrote the proof. (A crashed earlier run's record at the same
    /// sequence number carries another session, and is never taken for it.)
    pub fn covers(&self, seq: u64, session: u32) -> bool {
        matches!(self.0, ProofSector::Proof(p) if seq <= p.proven_seq && session == p.session)
    }

    /// Why the log cannot end before record `seq`, if it cannot: the proof says a record
    /// from `seq` on was durable (so what stands there decayed), or what the proof said is
    /// unknown (both copies damaged).
    pub fn lost_from(&self, seq: u64) -> Option<String> {
        match self.0 {
            ProofSector::Proof(p) if p.proven_seq >= seq => Some(format!(
                "records {seq}..{} lost: the flush proof says they were durable, and none of them can be read",
                p.proven_seq
            )),
            ProofSector::Damaged => Some(format!(
                "the flush proof is damaged, so records from {seq} on may have been durable and acknowledged"
            )),
            _ => None,
        }
    }
}
