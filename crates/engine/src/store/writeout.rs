//! Write-out: buffered log bytes go to the backing store, and a flush makes them durable.
//!
//! Invariants:
//! - No sector that may hold acknowledged data is written twice: write-out without a flush
//!   writes whole sectors only; a flush pads the open segments (both streams') to the next
//!   sector and appends continue after the padding.
//! - Backing writes of log data are serialised (the `io` lock), so a sync covers every
//!   write before it, and `durable_seq` advances only after the sync and the flush proof
//!   written after it (`proof.rs`).
//! - A sealed segment leaves the buffered list (readers go to disk) only after its bytes
//!   are written.
//! - A flush skips its sync only when nothing it must make durable could be left in a
//!   volatile cache: every log write before it was synced (`ProofState::log_synced`, kept
//!   under the `io` lock every log write holds) and it writes at most one range, written
//!   through (`Backing::write_durable_at`: RWF_DSYNC, a FUA write where the device has
//!   FUA). That is the commit case — a few writes, then a flush — and it saves the flush
//!   one device round trip: two (the tail and the proof, each written through) where it
//!   took three (the tail, a sync, the proof).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use aligned_vec::AVec;

use super::geometry::{new_buffer, round_up, AlignedBuf, SegmentBuffer};
use super::log::BUFFER_POOL_MAX;
use super::proof::{ProofState, Proven};
use super::state::Inner;
use crate::error::{Error, Result};
use crate::format::{FlushProof, ProofSector, FLUSH_PROOF_BYTES, FLUSH_PROOF_OFFSET_BYTES};
use crate::stats::{Compressing, Counters};
use crate::SECTOR_SIZE;

/// How far a write-out goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteOut {
    /// Whole sectors only, no sync: the open segment's partial last sector stays buffered.
    WholeSectors,
    /// Pad the open segment to a sector, write everything and sync.
    Flush,
}

/// What a queued write-out checks, once it holds the `io` lock, for whether the write-outs
/// before it already did its work.
#[derive(Debug, Clone, Copy)]
enum Done {
    Never,
    /// A flush that finished meanwhile made everything up to this sequence number durable
    /// (group commit: flushes that queued behind one share its sync and proof).
    Durable(u64),
    /// At most this many bytes are left unwritten (the write-behind bound).
    BacklogAtMost(u64),
}

/// One range of a segment buffer to write.
struct WriteJob {
    buffer: Arc<SegmentBuffer>,
    start_bytes: usize,
    end_bytes: usize,
    /// The segment is sealed: nobody appends to it, and it is done once written.
    sealed: bool,
}

impl Inner {
    /// Writes buffered log bytes to the backing; with `WriteOut::Flush` also syncs.
    pub(crate) fn write_out(&self, mode: WriteOut) -> Result<()> {
        self.write_out_unless(mode, Done::Never)
    }

    /// Whole sectors written out, unless — once this thread holds the `io` lock — write-outs
    /// that finished meanwhile left at most `backlog_bytes_max` unwritten. Host writes that
    /// crossed the write-behind bound together queue on the `io` lock; only the first has
    /// work to do, and the others must not close the open batch and write its few new
    /// sectors each in turn.
    pub(crate) fn write_out_behind(&self, backlog_bytes_max: u64) -> Result<()> {
        self.write_out_unless(WriteOut::WholeSectors, Done::BacklogAtMost(backlog_bytes_max))
    }

    /// `write_out`, or nothing if `done` holds once this thread has the `io` lock.
    fn write_out_unless(&self, mode: WriteOut, done: Done) -> Result<()> {
        // Counted from before the wait for the `io` lock: a writer queued behind a write-out
        // is the disk binding (the counting guard compression uses).
        let (_writing, _) = Compressing::enter(&self.log.disk_writers);
        let mut io = self.log.io.lock();
        self.health.check_writable()?;
        let already_done = match done {
            Done::Never => false,
            Done::Durable(seq) => self.log.durable_seq.load(Ordering::Acquire) >= seq,
            Done::BacklogAtMost(bytes) => self.log.lock().appender.backlog_bytes() as u64 <= bytes,
        };
        if already_done {
            return Ok(());
        }
        let (jobs, target_seq) = self.take_write_jobs(mode);
        let ranges = jobs.iter().filter(|job| job.end_bytes > job.start_bytes).count();
        // The commit case (module comment): the flush's own range is all there is to make
        // durable, so it is written through and the sync is left out.
        let write_through = mode == WriteOut::Flush && io.log_synced && ranges <= 1;
        let mut scratch: Option<AlignedBuf> = None;
        for job in &jobs {
            if job.end_bytes > job.start_bytes {
                let offset = self.geometry.segment_base(job.buffer.segment) + job.start_bytes as u64;
                let range = job.start_bytes..job.end_bytes;
                let write = |data: &[u8]| match write_through {
                    true => self.backing.write_durable_at(offset, data),
                    false => self.backing.write_at(offset, data),
                };
                // A plain write leaves the log unsynced from here on; a written-through one
                // keeps it synced, unless it fails (below).
                io.log_synced = write_through;
                let written = if job.sealed {
                    // Nobody appends to a sealed segment: write straight from its buffer.
                    write(&job.buffer.data.read()[range])
                } else {
                    // The open segment is appended to concurrently: copy the range out so the
                    // buffer lock is not held across the backing write.
                    let copy = scratch.get_or_insert_with(|| AVec::new(4096));
                    copy.clear();
                    copy.extend_from_slice(&job.buffer.data.read()[range]);
                    write(copy)
                };
                written.map_err(|e| {
                    io.log_synced = false;
                    self.fail(Error::io(format!("write log at {offset}"), e))
                })?;
                Counters::add(&self.counters.backing_write_bytes, (job.end_bytes - job.start_bytes) as u64);
            }
        }
        self.retire_written(jobs);
        if mode == WriteOut::Flush {
            if write_through {
                Counters::add(&self.log.log_counters.flushes_written_through, 1);
            } else {
                self.backing.sync().map_err(|e| self.fail(Error::io("sync", e)))?;
                io.log_synced = true;
            }
            // Only a write after the sync can show a later recovery that the sync completed
            // (`proof.rs`); the flush is acknowledged after it.
            if target_seq > io.proven_seq {
                self.write_flush_proof(&mut io, target_seq)?;
            }
            self.log.durable_seq.fetch_max(target_seq, Ordering::AcqRel);
        }
        Ok(())
    }

    /// What to write: every sealed segment's unwritten rest, and the open segments' whole
    /// sectors (all of it, padded, for a flush: both streams'). Closes the open batch first.
    fn take_write_jobs(&self, mode: WriteOut) -> (Vec<WriteJob>, u64) {
        let sector = SECTOR_SIZE;
        let mut jobs = Vec::new();
        let mut log = self.log.lock();
        log.close_batch();
        let target_seq = log.appender.next_seq - 1;
        while let Some(sealed) = log.appender.sealed_unwritten.pop_front() {
            let end = round_up(sealed.end_offset_bytes as u64, sector as u64) as usize;
            Counters::add(&self.counters.padding_bytes, (end - sealed.end_offset_bytes) as u64);
            let start = sealed.written_offset_bytes.min(end);
            jobs.push(WriteJob { buffer: sealed.buffer, start_bytes: start, end_bytes: end, sealed: true });
        }
        let log = &mut *log;
        let appender = &mut log.appender;
        for open in appender.open_segments_mut() {
            let end = match mode {
                WriteOut::Flush => {
                    let padded = round_up(open.append_offset_bytes as u64, sector as u64) as usize;
                    let padded = padded.min(self.geometry.segment_size_bytes as usize);
                    Counters::add(&self.counters.padding_bytes, (padded - open.append_offset_bytes) as u64);
                    open.append_offset_bytes = padded;
                    padded
                }
                WriteOut::WholeSectors => open.append_offset_bytes / sector * sector,
            };
            if end > open.written_offset_bytes {
                let buffer = Arc::clone(&open.buffer);
                jobs.push(WriteJob { buffer, start_bytes: open.written_offset_bytes, end_bytes: end, sealed: false });
                open.written_offset_bytes = end;
            }
            let (segment, end_bytes) = (open.buffer.segment, open.append_offset_bytes as u64);
            log.segments.note_append(segment, end_bytes, None);
        }
        (jobs, target_seq)
    }

    /// Sealed segments are on disk now: readers may go there, and the buffers are reused.
    fn retire_written(&self, jobs: Vec<WriteJob>) {
        let done: Vec<_> = jobs.iter().filter(|j| j.sealed).map(|j| j.buffer.segment).collect();
        if done.is_empty() {
            return;
        }
        self.log.buffered.write().retain(|b| !done.contains(&b.segment));
        // Zeroed here, before the log's lock (a segment's worth of memset held every
        // appender up when it was done at the next segment's opening).
        let mut zeroed: Vec<_> = (jobs.into_iter().filter(|j| j.sealed))
            .filter_map(|job| Arc::try_unwrap(job.buffer).ok())
            .take(BUFFER_POOL_MAX)
            .map(|buffer| {
                let mut data = buffer.data.into_inner();
                data.fill(0);
                data
            })
            .collect();
        let mut log = self.log.lock();
        let room = BUFFER_POOL_MAX.saturating_sub(log.appender.buffer_pool.len());
        zeroed.truncate(room);
        log.appender.buffer_pool.append(&mut zeroed);
    }

    /// Makes every record appended so far durable. (A request is acknowledged after its
    /// append, so this covers every write acknowledged before the call; an open batch
    /// already holds its sequence number, and any flush that covers it closes it first.)
    pub(crate) fn flush(&self) -> Result<()> {
        self.health.check_writable()?;
        let appended = self.log.lock().appender.next_seq - 1;
        self.flush_upto(appended)
    }

    /// Makes everything up to `seq` durable, joining a flush that already covered it.
    pub(crate) fn flush_upto(&self, seq: u64) -> Result<()> {
        if self.log.durable_seq.load(Ordering::Acquire) >= seq {
            return Ok(());
        }
        self.write_out_unless(WriteOut::Flush, Done::Durable(seq))
    }
}

/// Flush proofs (`proof.rs`): reading the sector at open, writing it after a flush's sync.
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
        let mut state = self.log.io.lock();
        state.session = self.log.lock().appender.session;
        state.generation = match found.0 {
            ProofSector::Proof(p) => p.generation,
            ProofSector::Empty | ProofSector::Damaged => 0,
        };
        self.backing.sync().map_err(|e| self.fail(Error::io("sync at open", e)))?;
        let replayed = self.log.durable_seq.load(Ordering::Acquire);
        self.write_flush_proof(&mut state, replayed)
    }
}
