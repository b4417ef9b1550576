//! Opening a store: choose the checkpoint, rebuild the map and segment table from it, replay
//! the records after it, and settle which segments are free — each its own step.
//!
//! Step 3, replay, has a room of its own (`replay.rs`). `open` runs the steps and then the
//! open policy (what a writable open writes before it serves); `inner_from_checkpoint`
//! builds the store's components from the checkpoint.
//!
//! Invariant: recovery reads only the checkpoint and the records after it, following each
//! segment's link to the next (and, only for an older format, a segment without a readable
//! link, or a damaged record, one sector per segment and the segments that could hold what
//! follows). Map pages are read when they are first needed, not at open.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::background::{Background, Wakeups};
use super::codecs::{Codecs, DictionaryState};
use super::create::read_superblocks;
use super::geometry::Geometry;
use super::health::Health;
use super::lock::{Mutex, Rank, RwLock};
use super::log::Stream;
use super::log::{Appender, CheckpointEpochs, Log, LogParts, LogState};
use super::options::{OpenOptions, StoreInfo};
use super::segments::{BlockCounts, SegmentTable};
use super::space::{Space, SpaceParts};
use super::state::Inner;
use super::{create, encryption, segments};
use crate::backing::Backing;
use crate::cache::{FragmentCache, Reads};
use crate::codec::{available_cores, Codec};
use crate::crypto::cipher::StoreCipher;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{Checkpoint, SegmentUsage, Superblock, FEATURE_LOG_JUMPS, FORMAT_VERSION};
use crate::map::page;
use crate::map::{Entry, PackedEntry, PagedMap};
use crate::stats::{CodecCounters, Counters, Stats};
use crate::BLOCK_SIZE;

use super::checkpoint::{chunk_segments, load_checkpoint};

/// The checkpoint recovery starts from, with the superblock that points at it.
pub(crate) struct Chosen {
    pub superblock: Superblock,
    pub checkpoint: Option<Checkpoint>,
    /// The other slot's superblock, when valid and older: the older retained checkpoint.
    pub older: Option<Superblock>,
}

/// Step 1: the newest superblock whose checkpoint loads; the older one if it does not.
pub(crate) fn choose_checkpoint(backing: &dyn Backing, cipher: Option<&StoreCipher>) -> Result<Chosen> {
    let (best, other) = read_superblocks(backing)?;
    let first = match load_checkpoint(backing, &best, cipher) {
        Ok(checkpoint) => {
            let older = other.filter(|o| o.generation < best.generation);
            return Ok(Chosen { superblock: best, checkpoint, older });
        }
        Err(e) => e,
    };
    let Some(other) = other else { return Err(first) };
    match load_checkpoint(backing, &other, cipher) {
        Ok(checkpoint) => {
            tracing::warn!("newest checkpoint unreadable ({first}); recovering from the previous one");
            Ok(Chosen { superblock: other, checkpoint, older: None })
        }
        Err(_) => Err(first),
    }
}

/// Step 2: the map a checkpoint points at (nothing is read: pages are read as they are
/// needed), and how many blocks are stored and zero. An older checkpoint's whole map is
/// taken as changes, which the first checkpoint writes as pages.
pub(crate) fn build_map(
    checkpoint: Option<&Checkpoint>,
    block_count: u64,
    cache_bytes: usize,
) -> Result<(PagedMap, BlockCounts)> {
    let height_needed = page::height_for(block_count);
    let Some(cp) = checkpoint else {
        return Ok((
            PagedMap::new(block_count, height_needed, PackedEntry::UNMAPPED.0, cache_bytes),
            BlockCounts::default(),
        ));
    };
    if let Some(root) = cp.map_root {
        let map = PagedMap::new(block_count, root.height.max(height_needed), root.root, cache_bytes);
        if root.height < height_needed {
            return Err(Error::new(ErrorKind::Corrupt, "checkpoint map is too short for its logical size"));
        }
        return Ok((map, BlockCounts { stored: cp.stored_blocks, zero: cp.zero_blocks }));
    }
    let map = PagedMap::new(block_count, height_needed, PackedEntry::UNMAPPED.0, cache_bytes);
    let mut counts = BlockCounts::default();
    for &(lba, raw) in &cp.legacy_map {
        if lba >= block_count {
            return Err(Error::new(ErrorKind::Corrupt, format!("checkpoint maps LBA {lba} past the end")));
        }
        match PackedEntry(raw).unpack()? {
            Entry::Stored(_) => counts.stored += 1,
            Entry::Zero => counts.zero += 1,
            Entry::Unmapped | Entry::Lost => {}
        }
    }
    map.import(&cp.legacy_map);
    Ok((map, counts))
}

impl LogState {
    /// Step 4: which segments are pinned by the retained checkpoints, the reuse horizon,
    /// and which segments are free. True when sealed segments were freed: the records that
    /// emptied them were replayed, so they are on disk, and a sync must put them on stable
    /// media before any of these segments is written again (`sync_settled`).
    pub(crate) fn settle_at_open(&mut self, geometry: &Geometry, chosen: &Chosen) -> bool {
        let sb = &chosen.superblock;
        let mut pinned = vec![chunk_segments(geometry, sb)];
        self.epochs.reuse_horizon_seq = sb.checkpoint_seq;
        if let Some(older) = &chosen.older {
            pinned.push(chunk_segments(geometry, older));
            self.epochs.reuse_horizon_seq = self.epochs.reuse_horizon_seq.min(older.checkpoint_seq);
        }
        self.segments.set_pinned(pinned);
        self.segments.settle_at_open(self.epochs.reuse_horizon_seq)
    }
}

/// The sync `LogState::settle_at_open` asks for when it freed sealed segments (none on a
/// read-only open, which writes nothing).
fn sync_settled(inner: &Inner, freed_sealed: bool) -> Result<()> {
    if freed_sealed && !inner.health.read_only {
        inner.backing.sync().map_err(|e| Error::io("sync after recovery", e))?;
    }
    Ok(())
}

/// The logical size recovery opens with: the checkpoint's, else the superblock's.
pub(crate) fn logical_size_bytes(chosen: &Chosen) -> u64 {
    chosen.checkpoint.as_ref().map_or(chosen.superblock.logical_size_bytes, |cp| cp.logical_size_bytes)
}

/// Blocks of `logical_size_bytes`.
pub(crate) fn block_count(logical_size_bytes: u64) -> u64 {
    logical_size_bytes / BLOCK_SIZE as u64
}

/// Opens and recovers the store on `backing`: unlock it, choose the checkpoint, build the
/// store's state from it, replay what follows, settle the free segments — then the open
/// policy: what a writable open writes before it serves (a flush proof; checkpoints past a
/// broken link, a torn record, a lost slot, an older format; making the newest dictionary
/// GC's). The caller starts the threads.
pub(crate) fn open(backing: Arc<dyn Backing>, options: &OpenOptions) -> Result<Inner> {
    // Wrong options are refused before a key derivation or a replay spends time on them.
    options.resolved_codec_cores()?;
    let (newest, _) = read_superblocks(backing.as_ref())?;
    let cipher = encryption::unlock(&backing, &newest, options)?;
    let chosen = choose_checkpoint(backing.as_ref(), cipher.as_deref())?;
    let sb = chosen.superblock.clone();
    let inner = inner_from_checkpoint(backing, options, cipher, &chosen)?;
    let flush_proof = inner.read_flush_proof();
    let broken_link;
    let unlinked;
    let torn_applied;
    {
        let mut log = inner.log.lock();
        let findings = log.replay(&inner, &sb, &flush_proof)?;
        let continue_in = findings.continue_in;
        torn_applied = findings.damaged.iter().any(|d| d.torn_tail);
        inner.health.recovery.set(findings).expect("recovery runs once");
        let freed_sealed = log.settle_at_open(&inner.geometry, &chosen);
        sync_settled(&inner, freed_sealed)?;
        // The next run goes on where the last segment's link points, so a later
        // recovery from an older checkpoint follows the log across this restart.
        log.appender.next_segment = continue_in.filter(|&s| log.segments.is_free(s));
        inner.log.durable_seq.store(log.appender.next_seq - 1, Ordering::Release);
        broken_link = continue_in.is_some() && log.appender.next_segment.is_none();
        unlinked = continue_in.is_none() && log.appender.next_seq > sb.checkpoint_seq + 1;
    }
    let writable = !options.read_only && inner.degraded().is_none();
    if writable {
        inner.prove_at_open(&flush_proof)?;
    }
    if writable && unlinked {
        // The log ended in a segment that names none to go on in (a cold segment, or
        // none was free when it opened): a later recovery from the retained checkpoints
        // would have to read every segment's start to find this run's records. A
        // checkpoint now spares it that; on a full store, it may wait.
        match inner.checkpoint_now() {
            Err(e) if e.kind() == ErrorKind::NoSpace => tracing::warn!("checkpoint at open: {e}"),
            other => other?,
        }
    }
    if writable && broken_link {
        // The segment the last link names is not free: the log goes on elsewhere, where
        // replay from the retained checkpoints would not look. Checkpoint past the break.
        tracing::warn!("the segment the log's last link names is in use; checkpointing past it");
        inner.checkpoint_now()?;
    }
    if writable && torn_applied {
        // Replay applied a record a crash tore (complete from its other copy). This run's
        // records will claim it durable, so a later replay would take its damage for
        // decay of a synced record. Two checkpoints take it out of both slots' replay.
        for _ in 0..2 {
            match inner.checkpoint_now() {
                Err(e) if e.kind() == ErrorKind::NoSpace => {
                    tracing::warn!("checkpoint past a torn record at open: {e}");
                    break;
                }
                other => other?,
            }
        }
    }
    if writable && sb.generation > 0 && chosen.older.is_none() {
        // One retained checkpoint only (a crash tore the other slot's write, or the
        // newest was damaged): write one now, so damage to either has a fallback again.
        inner.checkpoint_now()?;
    }
    if writable && sb.format_version < FORMAT_VERSION {
        // Older versions do not know this version's records. Both slots say the new
        // version before one is written, so an older zdisk refuses the store instead of
        // ending its replay at the first record it cannot read (which it would take for
        // the end of the log).
        inner.checkpoint_now()?;
        inner.checkpoint_now()?;
    }
    if writable && !inner.codecs.dictionaries.read().table.is_empty() {
        // The newest dictionary becomes GC's once both retained checkpoints carry it:
        // the one loaded does; the older one may not (a crash between the two
        // checkpoints that installed it). One more checkpoint makes both carry it.
        if chosen.older.is_some() {
            inner.checkpoint_now()?;
        }
        let next_seq = inner.log.lock().appender.next_seq;
        let mut state = inner.codecs.dictionaries.write();
        state.newest = state.table.last().cloned();
        // Known from the run that made it GC's, else from now (nothing ran since open).
        let loaded = state.newest.as_ref().map_or(0, |d| state.loaded_since_seq.get(&d.id).copied().unwrap_or(0));
        state.newest_since_seq = if loaded != 0 { loaded } else { next_seq };
    }
    Ok(inner)
}

/// The statistics of the closed store on `backing` as its newest loadable checkpoint left
/// them: nothing replayed, no key, nothing written (`Store::checkpoint_stats`).
pub(crate) fn checkpoint_stats(backing: Arc<dyn Backing>, options: &OpenOptions) -> Result<(StoreInfo, Stats)> {
    let chosen = choose_checkpoint(backing.as_ref(), None)?;
    let info = create::info_from(&chosen.superblock);
    let inner = inner_from_checkpoint(backing, options, None, &chosen)?;
    // As an open would free them (read-only: nothing is written).
    let freed_sealed = inner.log.lock().settle_at_open(&inner.geometry, &chosen);
    sync_settled(&inner, freed_sealed)?;
    Ok((info, inner.stats()))
}

/// The store's state as its checkpoint `chosen` left it, before replay: what
/// `Store::open_backing` recovers from, and all `Store::checkpoint_stats` reads.
fn inner_from_checkpoint(
    backing: Arc<dyn Backing>,
    options: &OpenOptions,
    cipher: Option<Arc<StoreCipher>>,
    chosen: &Chosen,
) -> Result<Inner> {
    let sb = chosen.superblock.clone();
    let geometry = Geometry {
        store_tag: create::store_tag(&sb.uuid),
        segment_size_bytes: sb.segment_size_bytes,
        segment_count: sb.segment_count(),
        physical_size_bytes: sb.physical_size_bytes,
        codec: Codec::from_parts(sb.codec_tag, sb.codec_level)?,
        encrypted: sb.encrypted(),
    };
    let codec_cores = options.resolved_codec_cores()?;
    let logical_size_bytes = logical_size_bytes(chosen);
    let (map, counts) =
        build_map(chosen.checkpoint.as_ref(), block_count(logical_size_bytes), options.map_cache_bytes as usize)?;
    let usage = match &chosen.checkpoint {
        Some(cp) if cp.segments.len() as u64 != geometry.segment_count => {
            return Err(Error::new(ErrorKind::Corrupt, "checkpoint segment table does not match the geometry"))
        }
        Some(cp) => cp.segments.clone(),
        None => vec![SegmentUsage::FREE; geometry.segment_count as usize],
    };
    let mut segments = SegmentTable::recovered(usage);
    segments.counts = counts;
    let counters =
        Arc::new(chosen.checkpoint.as_ref().map_or_else(Counters::default, |cp| Counters::from_array(&cp.counters)));
    let codec_counters = Arc::new(CodecCounters::default());
    let health = Arc::new(Health::new(options.read_only, options.accept_data_loss));
    let wakeups = Arc::new(Wakeups::new());
    let log_state = log_state_at(chosen, segments, cipher.as_deref(), geometry.codec);
    let log = Log::new(
        log_state,
        LogParts {
            geometry: geometry.clone(),
            cipher: cipher.clone(),
            cold_stream: sb.feature_flags & FEATURE_LOG_JUMPS != 0,
            counters: Arc::clone(&counters),
            codec_counters: Arc::clone(&codec_counters),
            health: Arc::clone(&health),
            wakeups: Arc::clone(&wakeups),
        },
    );
    let dictionaries = DictionaryState::recovered(
        chosen.checkpoint.as_ref().map_or(&[][..], |cp| &cp.dictionaries[..]),
        cipher.as_deref(),
    )?;
    let space = Space::new(SpaceParts {
        write_concurrency: options.write_concurrency,
        write_permit_fair_after: options.write_permit_fair_after,
        pacing: options.pacing,
        logical_size_bytes,
        over_provision_ppm: sb.over_provision_ppm,
        dictionary_table_bytes: dictionaries.table_bytes_max(),
        segment_count: geometry.segment_count,
        segment_capacity_bytes: geometry.segment_capacity(),
    });
    Ok(Inner {
        backing,
        reads: Reads::new(FragmentCache::new(options.read_cache_bytes, geometry.segment_count)),
        geometry,
        health,
        options: options.clone(),
        map: RwLock::new(Rank::Map, map),
        log,
        checkpoint: Mutex::new(Rank::Checkpoint, sb.clone()),
        space,
        background: Background::new(wakeups),
        codecs: Codecs {
            dictionaries: parking_lot::RwLock::new(dictionaries),
            counters: codec_counters,
            cores: codec_cores,
            available_cores: available_cores(),
            helpers: compression_helpers(codec_cores)?,
        },
        counters,
    })
}

/// The log's state as the checkpoint `chosen` left it, before replay: the appender at the
/// record after the checkpoint, the recovered segment table, the checkpoint's epochs.
fn log_state_at(chosen: &Chosen, segments: SegmentTable, cipher: Option<&StoreCipher>, codec: Codec) -> LogState {
    let sb = &chosen.superblock;
    LogState {
        appender: Appender {
            next_seq: sb.checkpoint_seq + 1,
            prev_crc: sb.replay_prev_crc,
            session: create::session_nonce(),
            nonce_epoch: cipher.filter(|c| c.short_nonces()).map_or(0, StoreCipher::current_epoch),
            open: None,
            batch: None,
            sealed_unwritten: VecDeque::new(),
            buffer_pool: Vec::new(),
            next_segment: None,
            stream: Stream::Host,
            parked: Vec::new(),
        },
        segments,
        epochs: CheckpointEpochs {
            snapshot_generation: sb.generation,
            reuse_horizon_seq: 0,
            bytes_since_checkpoint: 0,
            checkpoint_bytes: sb.checkpoint_chunks.iter().map(|c| c.length_bytes as u64).sum(),
            image_bytes: sb.checkpoint_chunks.iter().map(|c| c.length_bytes as u64).sum(),
            release_after_next: chosen.checkpoint.as_ref().map_or_else(Vec::new, |cp| cp.superseded.clone()),
            superseded_carry: Default::default(),
        },
        pending: segments::PendingRecompress::new(codec, sb.checkpoint_seq),
    }
}

/// The threads that share a large request's compression with its writer: one per codec core
/// beyond the writer's own (`Codecs::helpers`).
fn compression_helpers(codec_cores: usize) -> Result<Option<rayon::ThreadPool>> {
    if codec_cores < 2 {
        return Ok(None);
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(codec_cores - 1)
        .thread_name(|i| format!("zdisk-codec-{i}"))
        .build()
        .map(Some)
        .map_err(|e| Error::io("starting compression helpers", std::io::Error::other(e.to_string())))
}
