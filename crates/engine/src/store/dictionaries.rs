//! The store's trained zstd dictionaries: the table the checkpoint carries, training one
//! from the store's own blocks, installing it, and freeing the ones no fragment uses
//! (docs/format.md, "Dictionaries"; docs/space.md, "Trained dictionaries").
//!
//! Invariants:
//! - A dictionary is durable before any fragment names it: it is added to the table, then
//!   two checkpoints are written (each carries the table, and both superblock slots then
//!   point at one), and only then is it `newest` — the dictionary GC and `recompress`
//!   compress with. Whichever retained checkpoint recovery loads, and whatever log it
//!   replays after it, every `ZstdDict` fragment there names a dictionary that checkpoint
//!   carries. A crash before that leaves a table entry no fragment names (harmless; freed by
//!   the next recompression with a newer dictionary).
//! - A dictionary leaves the table only after a recompression into a newer one cleaned every
//!   segment that held a compressed fragment when it started, and no fragment naming an
//!   older dictionary was moved without being recompressed (a damaged one, which GC moves
//!   as it is) since it started; while `newest` exists, all GC (background included, even
//!   with every core busy) recompresses fragments of older dictionaries. The host's write
//!   path never uses a dictionary. The checkpoint written next no longer carries it; the
//!   older retained checkpoint still does, for the log between the two.
//! - A dictionary dropped from the table stays in `known` until close: a read that looked up
//!   the map before the recompression may still decode the old fragment.
//! - Ids count from 1 and are never reused within a run; a dictionary's id is in its own
//!   header and in every frame made with it.
//! - The state's lock is outside the lock order: it is held only to read or swap `Arc`s,
//!   never while another lock is taken.

use std::sync::Arc;

use std::collections::BTreeMap;

use super::capacity::SpaceClass;
use super::gc::{RecompressReport, RecompressTarget};
use super::geometry::{new_buffer, round_up};
use super::log::{Block, LiveFragment};
use super::state::Inner;
use crate::codec::CodecTag;
use crate::codec::{Dictionary, DictionarySet, DICTIONARIES_MAX, DICTIONARY_BYTES_DEFAULT};
use crate::error::{Error, ErrorKind, Result};
use crate::format::FragmentEntry;
use crate::map::{Entry, PackedEntry, Stored, WalkItem};
use crate::types::{Lba, SegmentId};
use crate::SECTOR_SIZE;

/// Blocks sampled for training at most: 4 MiB of blocks, picked across the store (zstd
/// suggests about 100 times the dictionary's size; 4 MiB trained a 112 KiB dictionary in
/// 0.3–0.5 s here and gave the ratios of docs/space.md, "Trained dictionaries").
pub const TRAINING_SAMPLE_BLOCKS_MAX: usize = 1024;

/// How `Store::recompress_with_new_dictionary` trains its dictionary.
#[derive(Debug, Clone, Copy)]
pub struct DictionaryOptions {
    /// The zstd level fragments are recompressed at with the dictionary.
    pub level: i32,
    /// The dictionary's size at most.
    pub size_bytes: usize,
    /// Blocks sampled across the map at most.
    pub sample_blocks_max: usize,
}

impl Default for DictionaryOptions {
    fn default() -> DictionaryOptions {
        DictionaryOptions {
            level: DICTIONARY_LEVEL_DEFAULT,
            size_bytes: DICTIONARY_BYTES_DEFAULT,
            sample_blocks_max: TRAINING_SAMPLE_BLOCKS_MAX,
        }
    }
}

/// The level `recompress --train` uses unless told, and so GC from then on: docs/space.md,
/// "Trained dictionaries". With a 112 KiB dictionary, zstd:3 took 2.34 on text lines and
/// 2.87 on the tablespace (zstd:1 alone 1.64, 2.14) at about 35 µs a block; zstd:6 gained
/// 5–8% on text, files and the VM image (lost 2% on the tablespace) for 2.7 times the CPU
/// — too much for GC, which recompresses at this level in the background on every move.
pub const DICTIONARY_LEVEL_DEFAULT: i32 = 3;

/// What a recompression into a new dictionary did to the table.
#[derive(Debug, Clone, Default)]
pub struct DictionaryReport {
    /// The id of the dictionary trained.
    pub id: u32,
    pub size_bytes: u64,
    /// Blocks it was trained on, and the time training took.
    pub sample_blocks: u64,
    pub training_ms: u64,
    /// Older dictionaries dropped from the table because no fragment names them any more.
    pub freed_ids: Vec<u32>,
}

impl Inner {
    /// Every dictionary a fragment of this store may name (for decoding).
    pub(crate) fn dictionary_set(&self) -> Arc<DictionarySet> {
        Arc::clone(&self.codecs.dictionaries.read().known)
    }

    /// The dictionary GC recompresses into, if any.
    pub(crate) fn newest_dictionary(&self) -> Option<Arc<Dictionary>> {
        self.codecs.dictionaries.read().newest.clone()
    }

    /// Up to `blocks_max` blocks picked evenly across the stored blocks of the map (not
    /// zeroes, not holes), read and decoded as a host read would. One walk of the map; the
    /// memory it takes is the sample's (every `step`-th stored block from the `skip`-th,
    /// the step from the segment table's count of stored blocks: another `skip` picks other
    /// blocks, where there are enough).
    pub(crate) fn sample_blocks(&self, blocks_max: usize, skip: u64) -> Result<Vec<Vec<u8>>> {
        let stored_blocks = self.log.lock().segments.counts.stored;
        let step = stored_blocks.div_ceil(blocks_max.max(1) as u64).max(1);
        let mut picked: Vec<Lba> = Vec::new();
        let mut seen = 0u64;
        {
            let map = self.map.read();
            map.walk_current(0, map.block_count(), self, &mut |item| {
                if let WalkItem::Leaf(first, body) = item {
                    for (i, &value) in body.iter().enumerate() {
                        if matches!(PackedEntry(value).unpack(), Ok(Entry::Stored(_))) {
                            if seen % step == skip % step && picked.len() < blocks_max {
                                picked.push(Lba(first.first_lba().0 + i as u64));
                            }
                            seen += 1;
                        }
                    }
                }
                Ok(())
            })?;
        }
        let mut samples = Vec::with_capacity(picked.len());
        for lba in picked {
            // (Not a host read: not counted as one, so idle work does not see the host.)
            match self.read_block(lba) {
                Ok((block, _)) => samples.push(block),
                // A damaged block is no sample; reads of it fail as they should.
                Err(e) if matches!(e.kind(), ErrorKind::Checksum | ErrorKind::Corrupt) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(samples)
    }

    /// Every checkpoint carries the dictionary table, so a new dictionary raises the room a
    /// checkpoint takes, and every reserve with it, by its bytes (twice in each reserve:
    /// two checkpoints), and the two checkpoints that install it take the new room each.
    /// Refused (ENOSPC, nothing changed) when the log has not all that above the host
    /// reserve now: a store near its floor could otherwise not write the checkpoints that
    /// free GC's victims.
    fn check_room_for_dictionary(&self, dictionary_bytes_max: usize) -> Result<()> {
        let log = self.log.lock();
        let added_bytes = {
            let state = self.codecs.dictionaries.read();
            let lengths = state.table.iter().map(|d| d.bytes.len());
            crate::format::dictionary_table_bytes_max(lengths.chain([dictionary_bytes_max])) - state.table_bytes_max()
        };
        let needed_bytes = self.reserves().of(SpaceClass::Host)
            + 2 * added_bytes
            + 2 * (self.reserves().checkpoint_room_bytes() + added_bytes);
        let available_bytes = log.available_bytes();
        if available_bytes < needed_bytes {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!(
                    "no room for a new dictionary: with it the reserves and the two checkpoints that install it \
                     need {needed_bytes} bytes of the log, {available_bytes} are unused (free space first: trim, or \
                     let GC run)"
                ),
            ));
        }
        Ok(())
    }

    /// Trains a dictionary on a sample of the store's blocks and installs it (module
    /// comment: durable in both retained checkpoints before it is `newest`).
    pub(crate) fn train_and_install(&self, options: &DictionaryOptions) -> Result<(Arc<Dictionary>, DictionaryReport)> {
        self.health.check_writable()?;
        self.check_room_for_dictionary(options.size_bytes.min(crate::codec::DICTIONARY_BYTES_MAX))?;
        let samples = self.sample_blocks(options.sample_blocks_max, 0)?;
        // zstd's builder wants enough material; a nearly empty store has nothing to learn.
        if samples.len() < 8 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("{} stored blocks: too few to train a dictionary on", samples.len()),
            ));
        }
        if self.codecs.dictionaries.read().table.len() >= DICTIONARIES_MAX {
            // Runs cut short left their dictionaries behind: free those nothing names.
            self.free_unnamed_dictionaries()?;
        }
        let id = {
            let state = self.codecs.dictionaries.read();
            if state.table.len() >= DICTIONARIES_MAX {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("the store keeps {} dictionaries already", state.table.len()),
                ));
            }
            state.next_id
        };
        let started = std::time::Instant::now();
        let dictionary = Arc::new(Dictionary::train(&samples, id, options.level, options.size_bytes)?);
        let training_ms = started.elapsed().as_millis() as u64;
        {
            let mut state = self.codecs.dictionaries.write();
            state.next_id = id + 1;
            state.table.push(Arc::clone(&dictionary));
            // Every checkpoint carries the table: the reserves grow with it.
            self.space.set_dictionary_table_bytes(state.table_bytes_max());
            let mut known: Vec<_> = state.known.iter().cloned().collect();
            known.push(Arc::clone(&dictionary));
            state.known = Arc::new(DictionarySet::new(known));
        }
        // Both superblock slots must point at checkpoints carrying it (module comment).
        self.checkpoint_now()?;
        self.checkpoint_now()?;
        {
            // Its since number is not known until the GC rounds below have finished: 0 (a
            // checkpoint in between must not give it the previous dictionary's).
            let mut state = self.codecs.dictionaries.write();
            state.newest = Some(Arc::clone(&dictionary));
            state.newest_since_seq = 0;
        }
        // A GC round that chose its target before this has finished once the checkpoint
        // lock is free (GC holds it throughout): from here on, every GC uses `newest`.
        drop(self.checkpoint.lock());
        let since_seq = self.log.lock().appender.next_seq;
        self.codecs.dictionaries.write().newest_since_seq = since_seq;
        let report = DictionaryReport {
            id,
            size_bytes: dictionary.bytes.len() as u64,
            sample_blocks: samples.len() as u64,
            training_ms,
            freed_ids: Vec::new(),
        };
        Ok((dictionary, report))
    }

    /// Trains a dictionary, installs it, recompresses every compressed fragment into it
    /// (GC's cleaning of every segment holding one, `Inner::recompress`), then frees the
    /// older dictionaries if no fragment names them any more. `progress` counts segments.
    pub(crate) fn recompress_with_new_dictionary(
        &self,
        options: &DictionaryOptions,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<RecompressReport> {
        self.health.check_writable()?;
        let before = self.stats();
        let (dictionary, mut trained) = self.train_and_install(options)?;
        let mut report = self.recompress(RecompressTarget::dictionary(Arc::clone(&dictionary), false), progress)?;
        trained.freed_ids = self.free_unnamed_dictionaries()?;
        report.before = before;
        report.after = self.stats();
        report.dictionary = Some(trained);
        Ok(report)
    }

    /// Drops every dictionary but the newest from the table once no fragment the map
    /// points at names another, and checkpoints; returns the ids dropped. Only segments
    /// first used before `newest_since_seq` may hold such a fragment (usually only the segment that was open when the
    /// recompression started, which it could not clean): their dictionary fragments are read,
    /// and those naming an older dictionary are recompressed into `newest` in place of GC
    /// (a batch record whose entries go in only where the map still points at the old
    /// fragment). Held under the checkpoint and GC locks: no other fragment moves and no
    /// segment is freed while it looks. Any fragment it cannot rewrite keeps the table.
    pub(crate) fn free_unnamed_dictionaries(&self) -> Result<Vec<u32>> {
        let freed = self.drop_unnamed_dictionaries()?;
        if !freed.is_empty() {
            self.checkpoint_now()?;
        }
        Ok(freed)
    }

    /// `free_unnamed_dictionaries` but the checkpoint.
    fn drop_unnamed_dictionaries(&self) -> Result<Vec<u32>> {
        let (newest, start_seq) = {
            let state = self.codecs.dictionaries.read();
            match &state.newest {
                // (0: not known yet — every segment may hold an older one's fragments.)
                Some(newest) if state.table.iter().any(|d| d.id != newest.id) => {
                    (Arc::clone(newest), Some(state.newest_since_seq).filter(|&s| s != 0).unwrap_or(u64::MAX))
                }
                _ => return Ok(Vec::new()),
            }
        };
        let newest = &newest;
        let _checkpoint = self.checkpoint.lock();
        let _gc = self.background.gc_lock.lock();
        // Every fragment the map points at is on disk from here on: the host's writes
        // (which make no dictionary fragment) are the only appends while the locks are held.
        self.flush()?;
        let mut suspects: BTreeMap<SegmentId, Vec<(Lba, Stored)>> = BTreeMap::new();
        {
            let map = self.map.read();
            map.walk_current(0, map.block_count(), self, &mut |item| {
                if let WalkItem::Leaf(id, body) = item {
                    for (slot, &value) in body.iter().enumerate() {
                        if let Ok(Entry::Stored(s)) = PackedEntry(value).unpack() {
                            if s.codec == CodecTag::ZstdDict {
                                let lba = Lba(id.first_lba().0 + slot as u64);
                                suspects.entry(self.geometry.segment_of(s.offset_bytes)).or_default().push((lba, s));
                            }
                        }
                    }
                }
                Ok(())
            })?;
        }
        {
            let log = self.log.lock();
            suspects.retain(|&segment, _| {
                let first_seq = log.segments.get(segment).first_seq;
                first_seq == 0 || first_seq < start_seq
            });
        }
        let mut older = Vec::new();
        for (segment, fragments) in &suspects {
            let base = self.geometry.segment_base(*segment);
            let end = fragments.iter().map(|(_, s)| s.offset_bytes + s.stored_len as u64).max().unwrap_or(base);
            let mut image = new_buffer(round_up(end - base, SECTOR_SIZE as u64) as usize);
            self.backing
                .read_at(base, &mut image)
                .map_err(|e| Error::io(format!("read of segment {segment} for its dictionaries"), e))?;
            for &(lba, s) in fragments {
                let at = (s.offset_bytes - base) as usize;
                let bytes = &image[at..at + s.stored_len as usize];
                let named = self.named_dictionary(bytes, lba, self.segment_use(s.offset_bytes).nonce_epoch);
                if named != Some(newest.id) {
                    let entry = FragmentEntry { stored_len: s.stored_len, codec: s.codec };
                    let block =
                        Block { entry, bytes: bytes.to_vec(), nonce_epoch: self.nonce_epoch_at(s.offset_bytes) };
                    let keeps_guard = !self.placed_at(bytes, s.offset_bytes);
                    older.push(LiveFragment { lba, old: PackedEntry::stored(s), block, keeps_guard });
                }
            }
        }
        if !older.is_empty() {
            let count = older.len();
            let target = RecompressTarget::dictionary(Arc::clone(newest), false);
            let (verbatim, recompressed) = self.recompress_live(older, Some(&target));
            if !verbatim.is_empty() {
                tracing::warn!("dictionaries kept: {} fragments naming older ones do not recompress", verbatim.len());
                return Ok(Vec::new());
            }
            match self.relocate(Vec::new(), recompressed, SpaceClass::Gc) {
                Ok(()) => tracing::info!("{count} fragments of older dictionaries recompressed before freeing them"),
                Err(e) if e.kind() == ErrorKind::NoSpace => return Ok(Vec::new()),
                Err(e) => return Err(e),
            }
        }
        let mut state = self.codecs.dictionaries.write();
        let freed: Vec<u32> = state.table.iter().map(|d| d.id).filter(|&id| id != newest.id).collect();
        state.table.retain(|d| d.id == newest.id);
        self.space.set_dictionary_table_bytes(state.table_bytes_max());
        Ok(freed)
    }
}
