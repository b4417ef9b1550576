//! Host requests: read, write, trim, write-zeroes and block status, from byte ranges to
//! the ops a record group carries; and their admission ("Admission" below): the one append
//! attempt every append takes (`Inner::try_append`, GC's and checkpoints' too), and a host
//! request's waits that need the whole store — the map's memory, the reserves, foreground
//! GC (whose rounds are `foreground_gc.rs`'s), ENOSPC (waits 4 and 5 of the list at the head
//! of `space.rs`).
//!
//! Invariants:
//! - Every range is validated against the logical size before anything happens.
//! - A request is one record group: all of it survives a crash, or none of it.
//! - Partial edge blocks (of writes and of write-zeroes) are read-modify-written under a
//!   stripe lock held until the new version is published, so two read-modify-writes of one
//!   block never lose each other's bytes; and the group is appended only if every such block
//!   still holds the map entry it was read with, so a whole-block write that lands in
//!   between is not lost either (the request is redone on top of it).

use std::sync::atomic::Ordering;

use super::capacity::{Reserves, SpaceClass};
use super::foreground_gc::{RoundOutcome, Short};
use super::geometry::round_up;
use super::lock::MutexGuard;
use super::log::{metadata_only, Appended, Attempt, Block, MapTarget, Op, RangeKind, WRITE_OUT_THRESHOLD_BYTES};
use super::options::{Extent, ExtentKind};
use super::read::ReadCache;
use super::space::WritePermit;
use super::state::Inner;
use super::writeout::WriteOut;
use crate::codec::{
    looks_incompressible, lz4_literals, skips_codec, store_raw, write_choice, Codec, CodecTag, WriteChoice, WriteLoad,
    UNCOMPRESSED_TIER_FREE_SHARE,
};
use crate::crypto::cipher::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{FragmentEntry, FragmentFormat, Protection, PI_BYTES};
use crate::map::{Entry, PackedEntry, PagedMap, WalkItem};
use crate::stats::{Compressing, Counters};
use crate::types::Lba;
use crate::BLOCK_SIZE;

use super::space::BLOCK_LOCK_STRIPES;

/// A request's blocks are shared with helper threads only in runs of at least this many
/// (32 KiB): a run costs a helper's wake-up and the writer's wait for it (tens of µs on a
/// busy VM), a run of 8 blocks ~50 µs of zstd:1 (docs/cpu.md, "Compression on every core").
const FAN_OUT_RUN_BLOCKS_MIN: usize = 8;

/// A partial-block request is redone at most this many times when concurrent writes keep
/// changing its blocks between its read and its append.
const CONFLICT_RETRIES_MAX: usize = 1000;

/// How `Inner::compress` stored a host block, for its counters.
#[derive(Clone, Copy)]
enum StoredAs {
    Configured,
    /// LZ4 instead of the store's codec.
    Fallback,
    /// The uncompressed tier.
    Uncompressed,
    /// Raw without running a codec: it looked incompressible, or it followed a block the
    /// LZ4 fallback could not shrink (`RunMemory`).
    Skipped,
}

/// After the LZ4 fallback stored a block of a request raw, the run's next blocks are stored
/// raw without LZ4 until this many have passed, and LZ4 is tried again on the next.
pub(crate) const LZ4_RETRY_BLOCKS: u32 = 4;

/// What the LZ4 fallback made of a request's previous blocks (`Inner::compress`). LZ4 gives
/// up on a block it cannot shrink only after 1.3 µs — about what the rest of the write path
/// spends on the block — and random, encrypted or compressed data comes in runs: on 128 KiB
/// writes of incompressible data the fallback's LZ4 was 15% of the server's CPU. So while
/// the codec binds (the fallback is chosen), a block that follows one LZ4 stored raw is
/// stored raw too, without LZ4, and LZ4 is tried again every `LZ4_RETRY_BLOCKS`th block.
/// The price, where a request's data turns compressible after incompressible blocks: at most
/// `LZ4_RETRY_BLOCKS - 1` compressible blocks stored raw, which recompression never takes
/// (`codec::recompresses`) — a bounded loss, only while the CPU binds. (Stored in the
/// uncompressed tier instead, the blocks would be recompressed at idle, but every block of
/// incompressible data would then be read and written again to save 18 bytes.)
#[derive(Debug, Default)]
pub(crate) struct RunMemory {
    /// Blocks since LZ4 last stored one of the run raw; None: it did not (or it shrank the last).
    since_lz4_gave_up: Option<u32>,
}

impl RunMemory {
    /// Whether this block skips LZ4 (counted as one more since it gave up).
    fn skips_lz4(&mut self) -> bool {
        match self.since_lz4_gave_up {
            Some(blocks) if blocks + 1 < LZ4_RETRY_BLOCKS => {
                self.since_lz4_gave_up = Some(blocks + 1);
                true
            }
            _ => false,
        }
    }

    /// What LZ4 made of a block: raw (an all-zero block is not LZ4's doing and says nothing).
    fn lz4_stored(&mut self, entry: FragmentEntry) {
        let gave_up = entry.codec == CodecTag::Raw && !entry.is_zero_block(FragmentFormat::V3);
        self.since_lz4_gave_up = gave_up.then_some(0);
    }
}

/// When a write, trim or write-zeroes must be durable: the NBD FUA flag, named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// At the next flush (or FUA request) that follows it: the request returns once its
    /// data is in the store's buffers and its map entries are published.
    Buffered,
    /// Before the request returns (Force Unit Access): it is written and synced, with the
    /// flush proof, as a flush would.
    Fua,
}

impl Inner {
    pub(crate) fn validate_range(&self, offset: u64, length: u64) -> Result<()> {
        let size = self.space.logical_size_bytes.load(Ordering::Acquire);
        match offset.checked_add(length) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Error::new(
                ErrorKind::OutOfRange,
                format!("request [{offset}, +{length}) is past the end of the device ({size} bytes)"),
            )),
        }
    }

    pub(crate) fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let Some((first_lba, block_count)) = self.read_blocks_of(offset, buf.len())? else { return Ok(()) };
        let map = self.map.read();
        let entries = self.read_entries(&map, first_lba, block_count)?;
        let mut blocks = vec![0u8; block_count * BLOCK_SIZE];
        self.fetch_blocks(&entries, &mut blocks, first_lba, ReadCache::Use)?;
        drop(map);
        let skip = (offset % BLOCK_SIZE as u64) as usize;
        buf.copy_from_slice(&blocks[skip..skip + buf.len()]);
        Counters::add(&self.counters.host_read_bytes, buf.len() as u64);
        Ok(())
    }

    /// A host read's checks (range, damage); its first block and block count (None: empty).
    pub(crate) fn read_blocks_of(&self, offset: u64, len: usize) -> Result<Option<(Lba, usize)>> {
        Counters::add(&self.counters.read_ops, 1);
        self.validate_range(offset, len as u64)?;
        if len == 0 {
            return Ok(None);
        }
        let first_lba = Lba::of_byte(offset);
        let last_lba = Lba::of_byte(offset + len as u64 - 1);
        if let Some(degraded) = self.degraded() {
            if let Some(lba) = (first_lba.0..=last_lba.0).map(Lba).find(|&lba| !degraded.is_newer(lba)) {
                Counters::add(&self.counters.checksum_errors, 1);
                return Err(Error::new(
                    ErrorKind::Checksum,
                    format!(
                        "block {lba} may be older than what records lost to damage (from {} on) wrote; `zdisk check` lists the damage",
                        degraded.first_lost_seq
                    ),
                ));
            }
        }
        Ok(Some((first_lba, (last_lba.0 - first_lba.0 + 1) as usize)))
    }

    /// The map entries of a host read, under the caller's map read lock.
    pub(crate) fn read_entries(&self, map: &PagedMap, first_lba: Lba, block_count: usize) -> Result<Vec<Entry>> {
        if first_lba.0 + block_count as u64 > map.block_count() {
            return Err(Error::new(ErrorKind::OutOfRange, "request past the end (resized)"));
        }
        map.get_range(first_lba, block_count as u64, self)?.into_iter().map(|e| e.unpack()).collect()
    }

    /// Compresses host block `lba` as the write path's load calls for
    /// (`codec::write_choice`): with the store's codec; with LZ4 when every codec core is
    /// already compressing or busy with other writers' CPU work (`space.rs`, `WritePermits`) — with
    /// `auto-uncompressed`, unless the disk binds; and there, stored uncompressed for now
    /// when every core is compressing and the disk idles. Counts the choice. A block that looks
    /// incompressible does not go through the store's (slow) codec, nor into the
    /// uncompressed tier (recompression would try it for nothing): it is stored raw
    /// (`codec::skips_codec`). LZ4, when the fallback picks it, runs on every block (see
    /// there) but those of a run it just failed to shrink (`run`, `RunMemory`).
    pub(crate) fn compress(&self, block: &[u8], lba: Lba, scratch: &mut Vec<u8>, run: &mut RunMemory) -> Result<Block> {
        let counters = &self.codecs.counters;
        let (compressing, compressing_before) = Compressing::enter(&counters.compressing);
        let load = WriteLoad {
            // Other compressions, or — with write admission — the other writers holding or
            // waiting for a permit, whichever says more (a permit holder compressing counts once).
            busy_compressors: compressing_before.max(self.space.write_permits.load_besides_holder()),
            compressing_now: compressing_before,
            codec_cores: self.codecs.cores,
            available_cores: self.codecs.available_cores,
            disk_writers: self.log.disk_writers.load(Ordering::Relaxed),
            room_for_uncompressed: self.log.free_segments.load(Ordering::Relaxed) as f64
                >= self.geometry.segment_count as f64 * UNCOMPRESSED_TIER_FREE_SHARE,
        };
        let configured = self.geometry.codec;
        let choice = write_choice(configured, self.options.codec_fallback, load);
        let (block, stored_as) = match choice {
            WriteChoice::Uncompressed if looks_incompressible(block) => {
                (self.compress_fragment(block, lba, scratch, store_raw)?, StoredAs::Skipped)
            }
            WriteChoice::Uncompressed => {
                (self.compress_fragment(block, lba, scratch, lz4_literals)?, StoredAs::Uncompressed)
            }
            WriteChoice::Compress(codec) if skips_codec(codec, block) => {
                (self.compress_fragment(block, lba, scratch, store_raw)?, StoredAs::Skipped)
            }
            WriteChoice::Compress(Codec::Lz4) if configured != Codec::Lz4 && run.skips_lz4() => {
                (self.compress_fragment(block, lba, scratch, store_raw)?, StoredAs::Skipped)
            }
            WriteChoice::Compress(codec) if codec != configured => {
                let block = self.compress_with(codec, block, lba, scratch)?;
                run.lz4_stored(block.entry);
                (block, StoredAs::Fallback)
            }
            WriteChoice::Compress(codec) => (self.compress_with(codec, block, lba, scratch)?, StoredAs::Configured),
        };
        drop(compressing);
        if !block.entry.is_zero_block(FragmentFormat::V3) {
            Counters::add(&counters.blocks_written[block.entry.codec as usize], 1);
            match stored_as {
                StoredAs::Skipped => Counters::add(&counters.incompressible_skipped_blocks, 1),
                StoredAs::Fallback => Counters::add(&counters.fallback_blocks, 1),
                StoredAs::Uncompressed => {
                    Counters::add(&counters.fallback_blocks, 1);
                    Counters::add(&counters.uncompressed_tier_blocks, 1);
                }
                StoredAs::Configured => {}
            }
        }
        Ok(block)
    }

    /// Compresses a request's blocks (`sources[i]` is block `first_lba + i`), in order. A
    /// large request whose writer is alone (no other holds or waits for a write permit)
    /// shares them out: while the codec has cores to
    /// spare (`--codec-cores` beyond those compressing now) and write permits are free, up to
    /// one helper thread per spare core compresses a run of at least `FAN_OUT_RUN_BLOCKS_MIN`
    /// blocks, holding a permit of its own (so no more threads do CPU work than write
    /// admission allows) and counted as compressing (so the codec choice sees it). Nothing
    /// else changes: the blocks come back in order and are appended as one group, after all
    /// of them are compressed, so request order and the crash contract are the same.
    pub(crate) fn compress_blocks(
        &self,
        first_lba: Lba,
        sources: &[&[u8]],
        scratch: &mut Vec<u8>,
    ) -> Result<Vec<Block>> {
        let compress_run = |first: usize, run: &[&[u8]], scratch: &mut Vec<u8>| -> Result<Vec<Block>> {
            let lba_of = |i: usize| Lba(first_lba.0 + (first + i) as u64);
            let mut memory = RunMemory::default();
            run.iter().enumerate().map(|(i, block)| self.compress(block, lba_of(i), scratch, &mut memory)).collect()
        };
        let Some((pool, helpers)) = self.compression_helpers(sources.len()) else {
            return compress_run(0, sources, scratch);
        };
        let run_blocks = sources.len().div_ceil(helpers.len() + 1);
        let mut runs: Vec<Option<Result<Vec<Block>>>> = (0..helpers.len()).map(|_| None).collect();
        let mut first = Ok(Vec::new());
        pool.in_place_scope(|scope| {
            let compress_run = &compress_run;
            for ((permit, (run, blocks)), out) in
                helpers.into_iter().zip(sources.chunks(run_blocks).enumerate().skip(1)).zip(runs.iter_mut())
            {
                scope.spawn(move |_| {
                    let _permit = permit;
                    *out = Some(compress_run(run * run_blocks, blocks, &mut Vec::with_capacity(BLOCK_SIZE * 2)));
                    Counters::add(&self.codecs.counters.helper_compressed_blocks, blocks.len() as u64);
                });
            }
            first = compress_run(0, &sources[..run_blocks], scratch);
        });
        let mut blocks = first?;
        for run in runs {
            blocks.extend(run.expect("the scope ran every helper")?);
        }
        debug_assert_eq!(blocks.len(), sources.len());
        Ok(blocks)
    }

    /// The helper pool and one write permit per helper a request of `block_count` blocks
    /// may have now; None: its writer compresses alone.
    fn compression_helpers(&self, block_count: usize) -> Option<(&rayon::ThreadPool, Vec<WritePermit<'_>>)> {
        let pool = self.codecs.helpers.as_ref()?;
        // Only a lone writer: beside others (holding or waiting for a permit, or one that
        // waited within the last few milliseconds) the cores are taken already, and a helper
        // only delays them (128K writes at QD32 ran at 0.82x without this check).
        if self.space.write_permits.load_besides_holder() > 0 {
            return None;
        }
        let spare_cores =
            self.codecs.cores.saturating_sub(1 + self.codecs.counters.compressing.load(Ordering::Relaxed));
        let most_helpers = spare_cores.min((block_count / FAN_OUT_RUN_BLOCKS_MIN).saturating_sub(1));
        let permits: Vec<_> = (0..most_helpers).map_while(|_| self.space.write_permits.try_acquire()).collect();
        (!permits.is_empty()).then_some((pool, permits))
    }

    /// Compresses block `lba` with `codec`: its protection information (guard, LBA, length
    /// and codec), then the codec's output (or the block raw when compression does not
    /// pay). An all-zero block stores its protection information alone.
    pub(crate) fn compress_with(&self, codec: Codec, block: &[u8], lba: Lba, scratch: &mut Vec<u8>) -> Result<Block> {
        self.compress_fragment(block, lba, scratch, |block, out| codec.compress_append(block, out))
    }

    /// `compress_with` for any compression (`compress` appends to `out` and returns the tag
    /// it used): a store codec, or a trained dictionary. Unencrypted, the codec appends to
    /// the fragment itself, after room for its protection information (known once the
    /// length is); encrypted, to `scratch`, which the cipher seals into the fragment.
    pub(crate) fn compress_fragment(
        &self,
        block: &[u8],
        lba: Lba,
        scratch: &mut Vec<u8>,
        compress: impl FnOnce(&[u8], &mut Vec<u8>) -> CodecTag,
    ) -> Result<Block> {
        if block.iter().all(|&b| b == 0) {
            let entry = FragmentEntry::ZERO_BLOCK;
            let bytes = Protection { guard: crc32c::crc32c(block), lba, entry }.encode().to_vec();
            return Ok(Block { entry, bytes, nonce_epoch: None });
        }
        let Some(cipher) = &self.log.cipher else {
            // (Room for a block stored as LZ4 literals, the largest a codec appends.)
            let mut bytes = Vec::with_capacity(PI_BYTES + BLOCK_SIZE + 32);
            bytes.resize(PI_BYTES, 0);
            let codec = compress(block, &mut bytes);
            let entry = FragmentEntry { stored_len: bytes.len() as u16, codec };
            bytes[..PI_BYTES].copy_from_slice(&Protection { guard: crc32c::crc32c(block), lba, entry }.encode());
            return Ok(Block { entry, bytes, nonce_epoch: None });
        };
        scratch.clear();
        let codec = compress(block, scratch);
        // Encrypted: the codec's output sealed (bound to the LBA). The guard is the placement
        // tag, which the log sets where the fragment lands (`Inner::place_fragment`); zero
        // until then (a plaintext CRC would leak a hash of the data).
        let stored_len = PI_BYTES + cipher.fragment_overhead_bytes() + scratch.len();
        let entry = FragmentEntry { stored_len: stored_len as u16, codec };
        let mut bytes = Vec::with_capacity(stored_len);
        bytes.extend_from_slice(&Protection { guard: 0, lba, entry }.encode());
        let epoch = cipher.seal(Domain::Block, lba.0, entry.packed(), scratch, &mut bytes)?;
        assert_eq!(bytes.len(), stored_len);
        Ok(Block { entry, bytes, nonce_epoch: cipher.short_nonces().then_some(epoch) })
    }

    /// Locks the stripes of the given partial blocks, in stripe order.
    fn lock_edges(&self, edge_lbas: &[Lba]) -> Vec<MutexGuard<'_, ()>> {
        let mut stripes: Vec<usize> = edge_lbas.iter().map(|lba| lba.0 as usize % BLOCK_LOCK_STRIPES).collect();
        stripes.sort_unstable();
        stripes.dedup();
        stripes.iter().map(|&s| self.space.block_locks[s].lock()).collect()
    }

    pub(crate) fn write(&self, offset: u64, data: &[u8], durability: Durability) -> Result<()> {
        Counters::add(&self.counters.write_ops, 1);
        self.health.check_writable()?;
        self.validate_range(offset, data.len() as u64)?;
        if data.is_empty() {
            return self.make_durable(None, durability);
        }
        self.space.pace_host_write(data.len() as u64);
        let permit = self.space.write_permits.acquire();
        let first_lba = Lba::of_byte(offset);
        let last_lba = Lba::of_byte(offset + data.len() as u64 - 1);
        let head = (offset % BLOCK_SIZE as u64) as usize;
        let tail_end = ((offset + data.len() as u64) % BLOCK_SIZE as u64) as usize;
        let mut edge_lbas = Vec::new();
        if head != 0 || (first_lba == last_lba && tail_end != 0) {
            edge_lbas.push(first_lba);
        }
        if tail_end != 0 && last_lba != first_lba {
            edge_lbas.push(last_lba);
        }
        let mut scratch = Vec::with_capacity(BLOCK_SIZE * 2);
        let appended = self.redo_on_conflict(|| {
            let guards = self.lock_edges(&edge_lbas);
            // The partial edge blocks, read and merged first; then every block in order.
            let mut merged = Vec::with_capacity(edge_lbas.len());
            let mut expected = Vec::new();
            for &lba in &edge_lbas {
                let (mut block, entry) = self.read_block(lba)?;
                let in_block = if lba == first_lba { head } else { 0 };
                let data_at = ((lba.0 - first_lba.0) as usize * BLOCK_SIZE + in_block).saturating_sub(head);
                let take = (BLOCK_SIZE - in_block).min(data.len() - data_at);
                block[in_block..in_block + take].copy_from_slice(&data[data_at..data_at + take]);
                merged.push((lba, block));
                expected.push((lba, entry));
            }
            let mut sources: Vec<&[u8]> = Vec::with_capacity((last_lba.0 - first_lba.0 + 1) as usize);
            let mut data_at = 0usize;
            for lba in (first_lba.0..=last_lba.0).map(Lba) {
                let in_block = if lba == first_lba { head } else { 0 };
                let take = (BLOCK_SIZE - in_block).min(data.len() - data_at);
                let edge = merged.iter().find(|(edge, _)| *edge == lba);
                debug_assert_eq!(edge.is_some(), take < BLOCK_SIZE, "the partial blocks are the edges");
                match edge {
                    Some((_, block)) => sources.push(block),
                    None => sources.push(&data[data_at..data_at + BLOCK_SIZE]),
                }
                data_at += take;
            }
            assert_eq!(data_at, data.len());
            let blocks = self.compress_blocks(first_lba, &sources, &mut scratch)?;
            let class = self.write_class(first_lba, last_lba, &blocks);
            let op = Op::Write { start_lba: first_lba, blocks, expected };
            let admitted = self.admit(&[op], class).inspect_err(|e| self.space.note_no_space(e));
            drop(guards);
            admitted
        })?;
        // A FUA write's wait for the disk holds no permit.
        drop(permit);
        Counters::add(&self.counters.host_write_bytes, data.len() as u64);
        if durability == Durability::Fua {
            Counters::add(&self.counters.fua_ops, 1);
        }
        self.make_durable(Some(appended.last_seq), durability)
    }

    /// Runs `attempt` (which builds a request's ops and admits them) until it is appended:
    /// a conflict means a block it read-modify-wrote changed in between, so it is redone
    /// on top of the new contents.
    fn redo_on_conflict(&self, mut attempt: impl FnMut() -> Result<Admitted>) -> Result<Appended> {
        for _ in 0..CONFLICT_RETRIES_MAX {
            if let Admitted::Appended(appended) = attempt()? {
                return Ok(appended);
            }
        }
        Err(Error::new(ErrorKind::Io, "a partial-block request kept conflicting with concurrent writes"))
    }

    /// A write that replaces more stored bytes than it adds frees space once GC runs: it
    /// may use part of the reserve other host writes may not. (Judged from the cached map
    /// only: a write never waits for a map page.)
    fn write_class(&self, first_lba: Lba, last_lba: Lba, blocks: &[Block]) -> SpaceClass {
        let map = self.map.read();
        let last = last_lba.0.min(map.block_count().saturating_sub(1));
        let replaced_bytes: u64 = (first_lba.0..=last)
            .map(|lba| match map.peek(Lba(lba)).map(|e| e.unpack()) {
                Some(Ok(Entry::Stored(s))) => s.stored_len as u64,
                _ => 0,
            })
            .sum();
        let added_bytes: u64 = blocks.iter().map(|b| b.bytes.len() as u64).sum();
        if added_bytes < replaced_bytes {
            SpaceClass::HostShrinking
        } else {
            SpaceClass::Host
        }
    }

    /// Trim (`RangeKind::Trim`) or write-zeroes (`RangeKind::Zero`) of a byte range.
    pub(crate) fn range_request(
        &self,
        kind: RangeKind,
        offset: u64,
        length: u64,
        durability: Durability,
    ) -> Result<()> {
        let counter = match kind {
            RangeKind::Trim => &self.counters.trim_ops,
            RangeKind::Zero => &self.counters.zero_ops,
        };
        Counters::add(counter, 1);
        self.health.check_writable()?;
        self.validate_range(offset, length)?;
        if length == 0 {
            return self.make_durable(None, durability);
        }
        let block = BLOCK_SIZE as u64;
        let full_start = round_up(offset, block);
        let full_end = (offset + length) / block * block;
        let permit = self.space.write_permits.acquire();
        let last_seq = match kind {
            RangeKind::Zero => Some(self.redo_on_conflict(|| self.zero_range(offset, length))?.last_seq),
            // Trim is advisory for partial blocks: only whole blocks are unmapped.
            RangeKind::Trim if full_end > full_start => {
                let (start_lba, block_count) = (Lba::of_byte(full_start), (full_end - full_start) / block);
                let trim = || self.admit_metadata(&[Op::Range { kind: RangeKind::Trim, start_lba, block_count }]);
                Some(self.redo_on_conflict(trim)?.last_seq)
            }
            RangeKind::Trim => None,
        };
        drop(permit);
        self.make_durable(last_seq, durability)
    }

    fn admit_metadata(&self, ops: &[Op]) -> Result<Admitted> {
        self.admit(ops, SpaceClass::HostMetadata).inspect_err(|e| self.space.note_no_space(e))
    }

    /// One attempt at a write-zeroes: whole blocks become a zero range; partial edges are
    /// real writes of zero bytes (read-modify-written under their stripe locks, with the
    /// entries read as expectations), in the same group so the request stays atomic.
    fn zero_range(&self, offset: u64, length: u64) -> Result<Admitted> {
        let block = BLOCK_SIZE as u64;
        let full_start = round_up(offset, block);
        let full_end = (offset + length) / block * block;
        let mut edges: Vec<(Lba, std::ops::Range<usize>)> = Vec::new();
        if full_start > full_end {
            // Inside one block.
            let at = (offset % block) as usize;
            edges.push((Lba::of_byte(offset), at..at + length as usize));
        } else {
            if offset < full_start {
                edges.push((Lba::of_byte(offset), (offset % block) as usize..BLOCK_SIZE));
            }
            if offset + length > full_end {
                edges.push((Lba::of_byte(full_end), 0..((offset + length) % block) as usize));
            }
        }
        let edge_lbas: Vec<Lba> = edges.iter().map(|(lba, _)| *lba).collect();
        let guards = self.lock_edges(&edge_lbas);
        let mut ops = Vec::new();
        let mut scratch = Vec::new();
        for (lba, range) in edges {
            let (mut bytes, entry) = self.read_block(lba)?;
            bytes[range].fill(0);
            let blocks = vec![self.compress(&bytes, lba, &mut scratch, &mut RunMemory::default())?];
            ops.push(Op::Write { start_lba: lba, blocks, expected: vec![(lba, entry)] });
        }
        if full_end > full_start {
            let block_count = (full_end - full_start) / block;
            ops.push(Op::Range { kind: RangeKind::Zero, start_lba: Lba::of_byte(full_start), block_count });
        }
        // (The whole-block part goes in the middle of the group: order within a group
        // does not matter, every record of it is applied or none.)
        let admitted = self.admit_metadata(&ops);
        drop(guards);
        admitted
    }

    /// With FUA, makes the request durable before it returns: up to its last record, or
    /// everything when it appended none.
    fn make_durable(&self, last_seq: Option<u64>, durability: Durability) -> Result<()> {
        if durability == Durability::Buffered {
            return Ok(());
        }
        match last_seq {
            Some(seq) => self.flush_upto(seq),
            None => self.flush(),
        }
    }

    /// Allocation status of a byte range, merged into runs. Subtrees of the map that are
    /// one constant are one run, without reading their pages.
    pub(crate) fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>> {
        self.validate_range(offset, length)?;
        let mut extents: Vec<Extent> = Vec::new();
        if length == 0 {
            return Ok(extents);
        }
        let block = BLOCK_SIZE as u64;
        let end_bytes = offset + length;
        let mut push = |first_lba: u64, end_lba: u64, entry: PackedEntry| {
            let kind = match entry.unpack() {
                Ok(Entry::Unmapped) => ExtentKind::Hole,
                Ok(Entry::Zero) => ExtentKind::Zero,
                _ => ExtentKind::Data,
            };
            let start = (first_lba * block).max(offset);
            let end = (end_lba * block).min(end_bytes);
            match extents.last_mut() {
                Some(e) if e.kind == kind && e.offset + e.length == start => e.length += end - start,
                _ => extents.push(Extent { offset: start, length: end - start, kind }),
            }
        };
        let map = self.map.read();
        let first = offset / block;
        let end = end_bytes.div_ceil(block).min(map.block_count());
        let mut runs: Vec<(u64, u64, PackedEntry)> = Vec::new();
        map.walk_current(first, end, self, &mut |item| {
            match item {
                WalkItem::Leaf(id, body) => {
                    let start = id.first_lba().0;
                    for (slot, &value) in body.iter().enumerate() {
                        let lba = start + slot as u64;
                        if lba >= first && lba < end {
                            runs.push((lba, lba + 1, PackedEntry(value)));
                        }
                    }
                }
                WalkItem::Constant(from, to, value) => runs.push((from, to, value)),
                WalkItem::Page(_) => {}
            }
            Ok(())
        })?;
        drop(map);
        for (from, to, value) in runs {
            push(from, to, value);
        }
        Ok(extents)
    }
}

// ==============================================================================================
// Admission: room for an append, foreground GC, ENOSPC (the waits that need the whole store)
//
// Admission of host requests: append when there is room, otherwise make room with
// foreground GC, in bounded rounds (`foreground_gc.rs` runs one), and refuse with ENOSPC
// only when GC cannot give back what the request lacks — the waits of Space that need the
// whole store (`impl Inner`): the map's memory and the reserves (`space.rs` lists every
// wait in order).
//
// Only host requests come through here. GC and checkpoints call the single append attempt
// (`Inner::try_append`) and fail at once when short, so GC never waits on GC.
//
// Invariants: rounds continue while they make progress, at most `FOREGROUND_GC_ROUNDS_MAX`;
// a refused request has no effect.
// ==============================================================================================

/// A backstop only: a write that finds no space runs GC rounds for as long as they make
/// progress (ENOSPC after two that do not). At native capacity with little
/// over-provisioning a victim gives back as little as OP of a segment, so one large write
/// may need hundreds of victims (1% OP, 64 KiB segments, a 128 KiB write: ~230), and a
/// fixed small round count refused writes the store had room for.
const FOREGROUND_GC_ROUNDS_MAX: usize = 4096;
pub(super) const EXHAUSTED: &str = "physical space is exhausted";

/// How a host request's group went.
pub(crate) enum Admitted {
    Appended(Appended),
    /// A block the group read-modify-writes changed since it was read: nothing was
    /// appended; the request must be redone.
    Conflict,
}

impl Inner {
    /// One append attempt: appends the group and publishes its map entries if the log has
    /// room for it beyond its class's reserve, else says how much it lacks; then starts the
    /// write-out its backlog calls for. GC and checkpoints call this directly; host
    /// requests go through `admit`, which makes room.
    pub(crate) fn try_append(&self, ops: &[Op], class: SpaceClass) -> Result<Attempt> {
        let mut log = self.log.lock();
        self.health.check_writable()?;
        if !expectations_hold(MapTarget { map: &self.map.read(), pages: self }, ops)? {
            return Ok(Attempt::Conflict);
        }
        let reserves = self.space.reserves();
        let appended = match log.append(ops, class, &reserves, &self.map, self)? {
            Attempt::Appended(appended) => appended,
            other => return Ok(other),
        };
        self.space.publish_host_slack(log.host_slack(&reserves));
        if matches!(class, SpaceClass::Host | SpaceClass::HostShrinking) {
            self.space.exhausted.store(false, Ordering::Relaxed);
        }
        let unwritten = log.appender.unwritten_bytes();
        let sealed = log.appender.sealed_unwritten.len();
        let backlog_bytes = (unwritten + log.appender.sealed_unwritten_bytes()) as u64;
        drop(log);
        let sealed_max = (self.options.cache_bytes_max / self.geometry.segment_size_bytes).max(2) as usize;
        let behind_max = self.options.write_behind_bytes_max;
        if sealed >= sealed_max || !self.options.background && sealed > 0 {
            self.write_out(WriteOut::WholeSectors)?;
        } else if behind_max > 0 && backlog_bytes > behind_max {
            self.write_out_behind(behind_max)?;
        } else if sealed > 0 || unwritten >= WRITE_OUT_THRESHOLD_BYTES {
            self.background.wakeups.kick_writer();
        }
        Ok(Attempt::Appended(appended))
    }

    /// Every class's reserve as of now (they grow with the logical size and the
    /// dictionary table): `Space`'s, checked in debug builds against a fresh computation.
    /// Everything but an append asks here (the worker's step, GC, checkpoints, idle work,
    /// statistics); `try_append` reads `Space::reserves` unchecked, so that a host write
    /// takes neither the dictionary table's lock nor its arithmetic.
    pub(crate) fn reserves(&self) -> Reserves {
        if cfg!(debug_assertions) {
            // Under the table's read lock: a change to it updates the reserves before it
            // lets go of the write lock.
            let dictionaries = self.codecs.dictionaries.read();
            self.space.assert_reserves_fresh(dictionaries.table_bytes_max());
        }
        self.space.reserves()
    }

    /// Appends a host request's group, making room with foreground GC when it lacks it.
    /// A trim or zero that GC could not make room for may still go below the metadata
    /// reserve (`SpaceClass::TrimWhileFull`).
    pub(crate) fn admit(&self, ops: &[Op], mut class: SpaceClass) -> Result<Admitted> {
        debug_assert!(!class.is_internal(), "only host requests wait for space");
        self.wait_for_map_memory()?;
        let mut rounds = 0;
        let mut stalled_rounds = 0;
        loop {
            let short = match self.try_append(ops, class)? {
                Attempt::Appended(appended) => return Ok(Admitted::Appended(appended)),
                Attempt::Conflict => return Ok(Admitted::Conflict),
                Attempt::Short { shortfall_bytes, available_bytes } => Short { shortfall_bytes, available_bytes },
            };
            if class.is_internal() {
                return Err(Error::new(ErrorKind::NoSpace, EXHAUSTED));
            }
            let outcome = if rounds >= FOREGROUND_GC_ROUNDS_MAX {
                RoundOutcome::GiveUp(format!("{EXHAUSTED} ({FOREGROUND_GC_ROUNDS_MAX} rounds of GC did not make room)"))
            } else {
                let outcome = self.foreground_gc_round(short, &mut stalled_rounds)?;
                rounds += usize::from(!matches!(outcome, RoundOutcome::RoomBack));
                outcome
            };
            if let RoundOutcome::GiveUp(message) = outcome {
                if class == SpaceClass::HostMetadata && metadata_only(ops) {
                    class = SpaceClass::TrimWhileFull;
                    continue;
                }
                return Err(Error::new(ErrorKind::NoSpace, message));
            }
        }
    }

    /// When the map's changes reached their memory limit (the background checkpoint fell
    /// behind, or there is no background thread), a writer writes the checkpoint itself
    /// before it adds more.
    fn wait_for_map_memory(&self) -> Result<()> {
        if !self.map.read().must_checkpoint() {
            return Ok(());
        }
        self.checkpoint_when(|| self.map.read().must_checkpoint())
    }
}

/// Whether every block the group read-modify-writes still holds the map entry it was read
/// with. (Checked under the log lock, so no other group can publish in between; the pages
/// are usually cached: the request just read these blocks.)
fn expectations_hold(target: MapTarget<'_>, ops: &[Op]) -> Result<bool> {
    for op in ops {
        if let Op::Write { expected, .. } = op {
            for &(lba, entry) in expected {
                if lba.0 >= target.map.block_count() || target.map.get(lba, target.pages)? != entry {
                    return Ok(false);
                }
            }
        }
    }
    Ok(true)
}
