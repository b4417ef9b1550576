//! Fetching blocks: from the segment buffers while a fragment is not yet on disk, from the
//! read cache, or from the backing store in coalesced runs; every fragment is decoded and
//! its CRC checked before a byte of it is returned.
//!
//! Invariants: a checksum failure is an error for the request (and counted), never data;
//! only fragments that proved good enter the read cache; the caller holds the map read
//! lock the entries came from, so no segment they point into can be freed meanwhile.

use std::ops::Range;

use super::geometry::{new_buffer, round_up, AlignedBuf};
use super::state::Inner;
use crate::cache::FragmentCache;
use crate::codec::{decompress_block, CodecTag, DictionarySet, NO_DICTIONARIES};
use crate::crypto::cipher::{Domain, SegmentUse, StoreCipher};
use crate::error::{Error, ErrorKind, Result};
use crate::format::{FragmentEntry, FragmentFormat, Protection, PI_BYTES};
use crate::map::{Entry, PackedEntry, Stored};
use crate::stats::Counters;
use crate::types::{Lba, SegmentId};
use crate::BLOCK_SIZE;

/// Whether the read cache may answer and keep what is read (not for `check`, which
/// verifies the disk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadCache {
    Use,
    Bypass,
}

/// Backing reads of at most this many bytes carry several fragments.
const READ_RUN_BYTES_MAX: u64 = 1 << 20;

/// One backing read covering fragments whose sectors touch.
struct ReadRun {
    start_bytes: u64,
    end_bytes: u64,
    /// Indexes into the sorted list of fragments to read from disk.
    fragments: Range<usize>,
}

/// A fragment to read from disk for block `index` of the request.
struct DiskFragment {
    index: usize,
    stored: Stored,
}

/// A host read between `Store::plan_read` and `Store::finish_read`: the device reads it
/// still needs, into buffers it owns.
pub struct ReadPlan {
    offset: u64,
    /// Where the request starts in `blocks`.
    skip: usize,
    len: usize,
    first_lba: Lba,
    /// The request's whole blocks, those in memory decoded already.
    blocks: Vec<u8>,
    on_disk: Vec<DiskFragment>,
    runs: Vec<ReadRun>,
    buffers: Vec<AlignedBuf>,
    /// Each segment read, with its free count when the plan was made.
    frees: Vec<(SegmentId, u32)>,
}

impl ReadPlan {
    fn empty(offset: u64) -> ReadPlan {
        ReadPlan {
            offset,
            skip: 0,
            len: 0,
            first_lba: Lba(0),
            blocks: Vec::new(),
            on_disk: Vec::new(),
            runs: Vec::new(),
            buffers: Vec::new(),
            frees: Vec::new(),
        }
    }

    /// The device reads the plan needs: (backing offset, buffer to fill exactly), aligned to
    /// the backing's read alignment (O_DIRECT). Empty when memory answered it all.
    pub fn device_reads(&mut self) -> impl Iterator<Item = (u64, &mut [u8])> {
        self.runs.iter().zip(self.buffers.iter_mut()).map(|(run, buf)| (run.start_bytes, &mut buf[..]))
    }

    /// The request's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Fragments the plan decodes after its device reads (the work `finish_read` does).
    pub fn fragments_to_decode(&self) -> usize {
        self.on_disk.len()
    }

    /// How many device reads the plan needs.
    pub fn device_read_count(&self) -> usize {
        self.runs.len()
    }
}

/// A finished host read: the request's bytes.
pub struct ReadDone {
    bytes: Vec<u8>,
    skip: usize,
    len: usize,
}

impl ReadDone {
    pub fn data(&self) -> &[u8] {
        &self.bytes[self.skip..self.skip + self.len]
    }
}

impl Inner {
    /// Fills `out` (one block per entry) with the blocks' contents, verifying checksums.
    /// `first_lba` is the LBA of `entries[0]` (for error messages).
    pub(crate) fn fetch_blocks(
        &self,
        entries: &[Entry],
        out: &mut [u8],
        first_lba: Lba,
        cache: ReadCache,
    ) -> Result<()> {
        let read_cache = (cache == ReadCache::Use).then_some(&self.reads.cache);
        let on_disk = self.fetch_from_memory(entries, out, first_lba, read_cache)?;
        let runs = self.read_runs(&on_disk);
        // The runs go to the device together (io_uring where there is one): a request
        // whose blocks were scattered by random overwrites waits about one device latency,
        // not one per run. (Parallel `pread`s on helper threads were tried before: at QD32
        // their wake-ups cost more than the overlap won.)
        let mut buffers: Vec<AlignedBuf> =
            runs.iter().map(|run| new_buffer((run.end_bytes - run.start_bytes) as usize)).collect();
        {
            let mut reads: Vec<(u64, &mut [u8])> =
                runs.iter().zip(buffers.iter_mut()).map(|(run, raw)| (run.start_bytes, &mut raw[..])).collect();
            self.backing.read_many(&mut reads).map_err(|e| {
                let first = runs.first().map_or(0, |run| run.start_bytes);
                Error::io(format!("read of {} range(s) from {first}", runs.len()), e)
            })?;
        }
        self.decode_runs(&runs, &buffers, &on_disk, out, first_lba, read_cache)
    }

    /// Decodes the blocks whose fragments are in memory (a segment buffer not yet written,
    /// or the read cache) into `out`; returns the others, sorted by address, to be read.
    fn fetch_from_memory(
        &self,
        entries: &[Entry],
        out: &mut [u8],
        first_lba: Lba,
        read_cache: Option<&FragmentCache>,
    ) -> Result<Vec<DiskFragment>> {
        let mut on_disk: Vec<DiskFragment> = Vec::new();
        let buffered = self.log.buffered.read();
        for (i, entry) in entries.iter().enumerate() {
            if *entry == Entry::Lost {
                Counters::add(&self.counters.checksum_errors, 1);
                let lba = first_lba.plus(i as u64);
                return Err(Error::new(ErrorKind::Checksum, format!("block {lba}: lost with damaged metadata")));
            }
            let Entry::Stored(s) = entry else { continue };
            let block = &mut out[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
            let lba = first_lba.plus(i as u64);
            let segment = self.geometry.segment_of(s.offset_bytes);
            if let Some(buffer) = buffered.iter().find(|b| b.segment == segment) {
                let at = (s.offset_bytes - self.geometry.segment_base(segment)) as usize;
                self.decode_fragment(*s, &buffer.data.read()[at..at + s.stored_len as usize], block, lba)?;
            } else if let Some(decoded) = read_cache.and_then(|c| {
                c.with_fragment(segment, s.offset_bytes, |fragment| self.decode_fragment(*s, fragment, block, lba))
            }) {
                decoded?;
            } else {
                on_disk.push(DiskFragment { index: i, stored: *s });
            }
        }
        on_disk.sort_by_key(|f| f.stored.offset_bytes);
        Ok(on_disk)
    }

    /// Decodes and checks the fragments `runs` read into `buffers`; caches the good ones.
    fn decode_runs(
        &self,
        runs: &[ReadRun],
        buffers: &[AlignedBuf],
        on_disk: &[DiskFragment],
        out: &mut [u8],
        first_lba: Lba,
        read_cache: Option<&FragmentCache>,
    ) -> Result<()> {
        Counters::add(&self.reads.backing_reads, runs.len() as u64);
        Counters::add(&self.reads.backing_read_bytes, buffers.iter().map(|b| b.len() as u64).sum());
        for (run, raw) in runs.iter().zip(buffers) {
            for f in &on_disk[run.fragments.clone()] {
                let at = (f.stored.offset_bytes - run.start_bytes) as usize;
                let fragment = &raw[at..at + f.stored.stored_len as usize];
                let block = &mut out[f.index * BLOCK_SIZE..(f.index + 1) * BLOCK_SIZE];
                self.decode_fragment(f.stored, fragment, block, first_lba.plus(f.index as u64))?;
                // Only fragments that proved good are cached.
                if let Some(c) = read_cache {
                    c.insert(self.geometry.segment_of(f.stored.offset_bytes), f.stored.offset_bytes, fragment);
                }
            }
        }
        Ok(())
    }

    /// The first half of a host read for a caller that reads the device itself (an event
    /// loop with the reads of many requests in flight: `ReadQueue`): checks the request,
    /// looks its blocks up and decodes those in memory. No lock is held when it returns, so
    /// a segment the plan reads may be freed and reused before the device read; the plan
    /// notes how often each was freed so far, and `finish_read` redoes a read whose
    /// segment was freed since (see `UseCell::frees`).
    pub(crate) fn plan_read(&self, offset: u64, len: usize) -> Result<ReadPlan> {
        let skip = (offset % BLOCK_SIZE as u64) as usize;
        let Some((first_lba, block_count)) = self.read_blocks_of(offset, len)? else {
            return Ok(ReadPlan::empty(offset));
        };
        let mut blocks = vec![0u8; block_count * BLOCK_SIZE];
        let map = self.map.read();
        let entries = self.read_entries(&map, first_lba, block_count)?;
        let on_disk = self.fetch_from_memory(&entries, &mut blocks, first_lba, Some(&self.reads.cache))?;
        // Under the map's read lock: a segment freed after this was freed after the lock
        // (`free_cleaned_locked` takes the write lock first), so its count has not moved yet.
        let mut frees: Vec<(SegmentId, u32)> = Vec::new();
        for f in &on_disk {
            let segment = self.geometry.segment_of(f.stored.offset_bytes);
            if frees.last().is_none_or(|&(last, _)| last != segment) {
                frees.push((segment, self.segment_frees(segment)));
            }
        }
        drop(map);
        let runs = self.read_runs(&on_disk);
        let buffers = runs.iter().map(|run| new_buffer((run.end_bytes - run.start_bytes) as usize)).collect();
        Ok(ReadPlan { offset, skip, len, first_lba, blocks, on_disk, runs, buffers, frees })
    }

    /// The second half: decodes and checks what the caller read into the plan's buffers
    /// (`ReadPlan::device_reads`) and returns the request's bytes. A plan whose segments
    /// were freed meanwhile is read again the synchronous way (rare: GC frees a segment
    /// only after every block in it moved, so the map no longer points there).
    pub(crate) fn finish_read(&self, mut plan: ReadPlan) -> Result<ReadDone> {
        if plan.frees.iter().any(|&(segment, frees)| self.segment_frees(segment) != frees) {
            Counters::add(&self.reads.replanned, 1);
            let mut data = vec![0u8; plan.len];
            self.read(plan.offset, &mut data)?;
            return Ok(ReadDone { bytes: data, skip: 0, len: plan.len });
        }
        self.decode_runs(
            &plan.runs,
            &plan.buffers,
            &plan.on_disk,
            &mut plan.blocks,
            plan.first_lba,
            Some(&self.reads.cache),
        )?;
        Counters::add(&self.counters.host_read_bytes, plan.len as u64);
        Ok(ReadDone { bytes: plan.blocks, skip: plan.skip, len: plan.len })
    }

    /// How many times `segment` was freed (`UseCell::frees`).
    fn segment_frees(&self, segment: SegmentId) -> u32 {
        self.log.segment_uses.get(segment.index()).map_or(0, |u| u.frees())
    }

    /// Coalesces fragments (sorted by address) whose sectors touch into runs of at most
    /// `READ_RUN_BYTES_MAX`, one backing read each. Data written sequentially is one run;
    /// data scattered by random overwrites is many. Reads use the device's own alignment,
    /// not the 4 KiB the log is written in.
    fn read_runs(&self, on_disk: &[DiskFragment]) -> Vec<ReadRun> {
        let sector = self.backing.read_alignment() as u64;
        let span =
            |s: &Stored| (s.offset_bytes / sector * sector, round_up(s.offset_bytes + s.stored_len as u64, sector));
        let mut runs = Vec::new();
        let mut run_start = 0;
        while run_start < on_disk.len() {
            let (start, mut end) = span(&on_disk[run_start].stored);
            let mut run_end = run_start + 1;
            while run_end < on_disk.len() {
                let (s_start, s_end) = span(&on_disk[run_end].stored);
                if s_start > end || s_end - start > READ_RUN_BYTES_MAX {
                    break;
                }
                end = end.max(s_end);
                run_end += 1;
            }
            runs.push(ReadRun { start_bytes: start, end_bytes: end, fragments: run_start..run_end });
            run_start = run_end;
        }
        runs
    }

    /// Decodes one fragment into `block` and checks it (see [`verify_fragment`]); a failure
    /// is a `Checksum` error, and counted.
    pub(crate) fn decode_fragment(&self, s: Stored, fragment: &[u8], block: &mut [u8], lba: Lba) -> Result<()> {
        let dictionaries = (s.codec == CodecTag::ZstdDict).then(|| self.dictionary_set());
        let dictionaries = dictionaries.as_deref().unwrap_or(&NO_DICTIONARIES);
        verify_fragment(s, fragment, lba, block, dictionaries, self.sealed_at(s.offset_bytes)).map_err(|why| {
            Counters::add(&self.counters.checksum_errors, 1);
            Error::new(ErrorKind::Checksum, format!("block {lba} (fragment at {}): {why}", s.offset_bytes))
        })
    }

    /// The dictionary a `ZstdDict` fragment's frame names (an encrypted store's opened
    /// first); `None` when the bytes do not say (damaged, or not this LBA's).
    /// `nonce_epoch`: its segment's (what a short nonce lacks).
    pub(crate) fn named_dictionary(&self, fragment: &[u8], lba: Lba, nonce_epoch: u16) -> Option<u32> {
        let pi = Protection::decode(fragment.get(..PI_BYTES)?).ok()?;
        let output = fragment.get(PI_BYTES..)?;
        match &self.log.cipher {
            Some(cipher) => {
                let plain = cipher.open(Domain::Block, lba.0, pi.entry.packed(), output, nonce_epoch).ok()?;
                crate::codec::frame_dictionary_id(&plain)
            }
            None => crate::codec::frame_dictionary_id(output),
        }
    }

    /// One block's current contents, and the map entry they came from.
    pub(crate) fn read_block(&self, lba: Lba) -> Result<(Vec<u8>, PackedEntry)> {
        let mut block = vec![0u8; BLOCK_SIZE];
        let map = self.map.read();
        if lba.0 >= map.block_count() {
            return Err(Error::new(ErrorKind::OutOfRange, "block past the end"));
        }
        let packed = map.get(lba, self)?;
        self.fetch_blocks(&[packed.unpack()?], &mut block, lba, ReadCache::Use)?;
        Ok((block, packed))
    }
}

/// An encrypted store's cipher, with the use of the segment a fragment lies in (what its
/// placement tag binds besides the address: `StoreCipher::placement`).
#[derive(Clone, Copy)]
pub(crate) struct Sealed<'a> {
    pub cipher: &'a StoreCipher,
    pub in_use: SegmentUse,
}

impl Inner {
    /// The use of the segment holding byte `address`: its first record's sequence number
    /// and nonce epoch (`SegmentTable::uses`; no lock taken).
    pub(crate) fn segment_use(&self, address: u64) -> SegmentUse {
        let segment = self.geometry.segment_of(address);
        let (seq, nonce_epoch) = self.log.segment_uses.get(segment.index()).map_or((0, 0), |u| u.get());
        SegmentUse { seq, nonce_epoch }
    }

    /// The use of the segment of a record at `record_offset` with sequence number `seq` and
    /// nonce epoch `nonce_epoch` (its head's): a record at the segment's start begins its
    /// use (replay may meet it before the table knows the new use), any other is in the use
    /// the table knows; every record of a use carries the use's epoch.
    pub(crate) fn record_use(&self, record_offset: u64, seq: u64, nonce_epoch: u16) -> SegmentUse {
        let segment = self.geometry.segment_of(record_offset);
        if record_offset == self.geometry.segment_base(segment) {
            SegmentUse { seq, nonce_epoch }
        } else {
            SegmentUse { seq: self.segment_use(record_offset).seq, nonce_epoch }
        }
    }

    /// What verifying a fragment at `address` needs of an encrypted store (None: plain).
    pub(crate) fn sealed_at(&self, address: u64) -> Option<Sealed<'_>> {
        self.log.cipher.as_deref().map(|cipher| Sealed { cipher, in_use: self.segment_use(address) })
    }
}

/// Decodes one fragment into `block` and checks its guard (the CRC32C of the block) and,
/// for a version 3 fragment, that its protection information names this LBA, this length
/// and this codec — so a misdirected map entry or write is caught too.
pub(crate) fn verify_fragment(
    s: Stored,
    fragment: &[u8],
    lba: Lba,
    block: &mut [u8],
    dictionaries: &DictionarySet,
    sealed: Option<Sealed<'_>>,
) -> std::result::Result<(), String> {
    let prefix = s.format.prefix_bytes();
    if fragment.len() < prefix || fragment.len() != s.stored_len as usize {
        return Err("fragment too short".into());
    }
    let guard = match s.format {
        FragmentFormat::V2 => crate::format::u32_at(fragment, 0),
        FragmentFormat::V3 => {
            let pi = Protection::decode(&fragment[..PI_BYTES]).map_err(|_| "bad protection information".to_string())?;
            if pi.lba != lba {
                return Err(format!("the fragment is block {}'s", pi.lba));
            }
            if pi.entry != (FragmentEntry { stored_len: s.stored_len, codec: s.codec }) {
                return Err("the fragment's length or codec disagrees with the map".into());
            }
            pi.guard
        }
    };
    let entry = FragmentEntry { stored_len: s.stored_len, codec: s.codec };
    if s.format == FragmentFormat::V3 && entry.is_zero_block(s.format) {
        block.fill(0); // an all-zero block's fragment is its protection information alone
    } else if let Some(Sealed { cipher, in_use }) = sealed {
        // Sealed: the guard is the placement tag of this address (so an authentic fragment
        // written anywhere else — an older version of this block too — is refused), and the
        // AEAD's tag proves the bytes, and that they are this LBA's, this long, of this codec.
        if cipher.placement(s.offset_bytes, in_use.seq, &fragment[prefix..]) != guard {
            return Err("fails authentication: not the fragment written at this address".into());
        }
        let plain = cipher
            .open(Domain::Block, lba.0, entry.packed(), &fragment[prefix..], in_use.nonce_epoch)
            .map_err(|_| "fails authentication".to_string())?;
        decompress_block(s.codec, &plain, block, dictionaries).map_err(|_| "does not decompress".to_string())?;
        return Ok(());
    } else if decompress_block(s.codec, &fragment[prefix..], block, dictionaries).is_err() {
        return Err("does not decompress".into());
    }
    if crc32c::crc32c(block) != guard {
        return Err("CRC32C mismatch".into());
    }
    Ok(())
}
