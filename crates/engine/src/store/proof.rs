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

use std::sync::atomic::Ordering;

use super::state::{new_buffer, Inner};
use crate::error::{Error, Result};
use crate::format::{FlushProof, ProofSector, FLUSH_PROOF_BYTES, FLUSH_PROOF_OFFSET_BYTES};
use crate::stats::Counters;

/// What the last proof written said (held under the `io` lock).
#[derive(Debug, Default)]
pub(crate) struct ProofState {
    pub generation: u64,
    pub proven_seq: u64,
    /// This run's session nonce (set at open, before the first proof; never 0).
    pub session: u32,
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

impl Inner {
    /// Reads the proof sector (a failed read is damage: what it said is unknown).
    pub(crate) fn read_flush_proof(&self) -> Proven {
        let mut sector = new_buffer(FLUSH_PROOF_BYTES);
        match self.backing.read_at(FLUSH_PROOF_OFFSET_BYTES, &mut sector) {
            Ok(()) => Proven(ProofSector::decode(&sector, self.geometry.store_tag)),
            Err(e) => {
                tracing::error!("reading the flush proof: {e}");
                Proven(ProofSector::Damaged)
            }
        }
    }

    /// Writes and syncs a proof that every record up to `proven_seq` is durable. The caller
    /// holds the `io` lock and has synced those records.
    pub(crate) fn write_flush_proof(&self, state: &mut ProofState, proven_seq: u64) -> Result<()> {
        assert!(state.session != 0, "a proof before open set the session");
        debug_assert!(proven_seq < self.log.lock().appender.next_seq, "a proof of records not appended yet");
        let proof = FlushProof { generation: state.generation + 1, proven_seq, session: state.session };
        let mut aligned = new_buffer(FLUSH_PROOF_BYTES);
        aligned.copy_from_slice(&proof.encode_sector(self.geometry.store_tag));
        self.backing
            .write_durable_at(FLUSH_PROOF_OFFSET_BYTES, &aligned)
            .map_err(|e| self.fail(Error::io("write the flush proof", e)))?;
        Counters::add(&self.counters.backing_write_bytes, FLUSH_PROOF_BYTES as u64);
        state.generation = proof.generation;
        state.proven_seq = proven_seq;
        Ok(())
    }

    /// At a writable open, before anything is appended: makes what replay found durable and
    /// proves it, so the newest proof is this run's (an older run's would name sequence
    /// numbers this run writes again, in another session).
    pub(crate) fn prove_at_open(&self, found: &Proven) -> Result<()> {
        let mut state = self.io.lock();
        state.session = self.log.lock().appender.session;
        state.generation = match found.0 {
            ProofSector::Proof(p) => p.generation,
            ProofSector::Empty | ProofSector::Damaged => 0,
        };
        self.backing.sync().map_err(|e| self.fail(Error::io("sync at open", e)))?;
        let replayed = self.durable_seq.load(Ordering::Acquire);
        self.write_flush_proof(&mut state, replayed)
    }
}
