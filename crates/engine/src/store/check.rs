//! `check`: walks the whole map (every page, with its changes), then reads every used
//! segment — on all cores, each segment in one sequential read — and verifies every record
//! and every fragment in it (from the disk, never the read cache), noting which fragments
//! the map points at. Then: every map entry points at a fragment that verified (the bytes
//! the map references in each segment equal the bytes of verified live fragments found
//! there), the segment table's live bytes equal what the map references, and its page bytes
//! equal the pages of the current map plus those the newest checkpoint replaced. Damage
//! recovery found is reported too. Each problem comes with its byte offset and the LBAs it
//! affects where they are known.
//!
//! Memory is per segment, not per block; the map is read through its cache. Check expects
//! no host writes meanwhile (`zdisk check` opens the store read-only); it holds the
//! checkpoint lock, so GC and checkpoints wait for it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex as StdMutex;

use super::geometry::{new_buffer, round_up, AlignedBuf};
use super::options::{CheckReport, DamageReport};
use super::read::verify_fragment;
use super::scan::{parse_segment, FoundRecord, RecordContext};
use super::state::Inner;
use crate::error::Result;
use crate::format::{RecordKind, SegmentState, SegmentUsage};
use crate::map::page::PageId;
use crate::map::{span_blocks, Entry, PackedEntry, Stored, WalkItem};
use crate::types::{Lba, SegmentId};
use crate::{BLOCK_SIZE, SECTOR_SIZE};

impl CheckReport {
    fn problem(&mut self, offset_bytes: u64, what: String, lbas: Vec<(u64, u64)>) {
        self.problems.push(what.clone());
        self.damage.push(DamageReport { offset_bytes, what, lbas });
    }
}

/// What the map walk found, per segment.
struct MapTotals {
    /// Fragment bytes map entries point at.
    live: Vec<u64>,
    /// Bytes of the current map's pages.
    pages: Vec<u64>,
    /// Of `live`, the LZ4 fragments' bytes (`segments.rs`, `PendingRecompress`).
    lz4: Vec<u64>,
    stored: u64,
    zero: u64,
}

impl MapTotals {
    /// A map entry pointing at fragment `s` in `segment`.
    fn add_live(&mut self, segment: SegmentId, s: Stored) {
        self.live[segment.index()] += s.stored_len as u64;
        if s.codec == crate::codec::CodecTag::Lz4 {
            self.lz4[segment.index()] += s.stored_len as u64;
        }
    }
}

/// What the segment scan found, per segment: bytes of verified fragments the map points at.
struct ScanTotals {
    found_live: Vec<AtomicU64>,
    records: AtomicU64,
}

impl Inner {
    pub(crate) fn check(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<CheckReport> {
        if self.health.check_writable().is_ok() {
            self.flush()?;
        }
        let _checkpoint = self.checkpoint.lock();
        let mut report = CheckReport::default();
        self.report_recovery(&mut report);
        self.check_checkpoints(&mut report);
        self.settle_owed()?;
        let segments = self.log.lock().segments.snapshot();
        let buffered = self.unwritten_segments();
        let block_count = self.map.read().block_count();
        let leaves = block_count.div_ceil(span_blocks(0));
        let total = leaves + segments.len() as u64;
        let mut map_totals = self.check_map(&mut report, &mut |done| progress(done, total))?;
        self.add_owed_walks(&mut map_totals)?;
        let scan = ScanTotals {
            found_live: (0..segments.len()).map(|_| AtomicU64::new(0)).collect(),
            records: AtomicU64::new(0),
        };
        let shared = StdMutex::new(CheckReport::default());
        let next = AtomicU64::new(0);
        let done = AtomicU64::new(0);
        // Twice the cores: while one thread of a pair waits for its segment's read, the other
        // decompresses and checksums, so the disk and the cores are both kept busy.
        let threads = (2 * std::thread::available_parallelism().map_or(2, |n| n.get())).clamp(4, 32);
        std::thread::scope(|scope| {
            // Each scanner holds a sender; the channel disconnects when the last one is done,
            // so the progress loop below ends without polling.
            let (scanning, scanned) = std::sync::mpsc::channel::<()>();
            for _ in 0..threads {
                let scanning = scanning.clone();
                let (next, done, segments, scan, shared, buffered) =
                    (&next, &done, &segments, &scan, &shared, &buffered);
                scope.spawn(move || {
                    // One buffer per thread for all its segments: a fresh 4 MiB buffer per
                    // segment costs a page fault and a zeroed page per 4 KiB read.
                    let mut image = new_buffer(0);
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                        let Some(usage) = segments.get(i) else { break };
                        let id = SegmentId(i as u32);
                        let used =
                            matches!(usage.state, SegmentState::Sealed | SegmentState::Open) && usage.end_bytes > 0;
                        if used && !buffered.contains(&id) {
                            let mut local = CheckReport::default();
                            self.check_segment(id, usage, scan, &mut image, &mut local);
                            let mut shared = shared.lock().expect("check report");
                            shared.problems.append(&mut local.problems);
                            shared.damage.append(&mut local.damage);
                            shared.notes.append(&mut local.notes);
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    drop(scanning);
                });
            }
            drop(scanning);
            // Progress comes from this thread (the callback need not be thread-safe).
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                scanned.recv_timeout(std::time::Duration::from_millis(100))
            {
                progress(leaves + done.load(Ordering::Relaxed), total);
            }
        });
        let mut scanned = shared.into_inner().expect("check report");
        report.problems.append(&mut scanned.problems);
        report.damage.append(&mut scanned.damage);
        report.notes.append(&mut scanned.notes);
        report.records_checked = scan.records.load(Ordering::Relaxed);
        report.blocks_checked = map_totals.stored;
        self.compare_accounting(&segments, &buffered, &map_totals, &scan, &mut report)?;
        progress(total, total);
        Ok(report)
    }

    /// Makes every owed removal of the map's leaf changes (reading their pages), so the
    /// table counts exactly what the map references.
    fn settle_owed(&self) -> Result<()> {
        let leaves = self.map.read().unsettled_leaves();
        for batch in leaves.chunks(256) {
            self.map.read().pin_loaded(batch, self)?;
            {
                let mut log = self.log.lock();
                let map = self.map.read();
                map.settle(batch, &mut log.live(&self.geometry));
            }
            self.map.read().unpin(batch);
        }
        Ok(())
    }

    /// Subtrees replaced by a constant whose old contents the next checkpoint removes: the
    /// table still counts their entries and pages.
    fn add_owed_walks(&self, totals: &mut MapTotals) -> Result<()> {
        let walks = self.map.read().owed_walks();
        for (id, pointer) in walks {
            crate::map::walk_subtree(id, pointer, self, &mut |visit| match visit {
                crate::map::Visit::Page(s) => {
                    totals.pages[self.geometry.segment_of(s.offset_bytes).index()] += s.stored_len as u64
                }
                crate::map::Visit::Leaf(body) => {
                    for &v in body.iter() {
                        match PackedEntry(v).unpack() {
                            Ok(Entry::Stored(s)) => {
                                totals.add_live(self.geometry.segment_of(s.offset_bytes), s);
                                totals.stored += 1;
                            }
                            Ok(Entry::Zero) => totals.zero += 1,
                            _ => {}
                        }
                    }
                }
                crate::map::Visit::Constant(value, blocks) if value == PackedEntry::ZERO => totals.zero += blocks,
                crate::map::Visit::Constant(..) | crate::map::Visit::Damaged(..) => {}
            })?;
        }
        Ok(())
    }

    /// What recovery found damaged.
    fn report_recovery(&self, report: &mut CheckReport) {
        for damaged in self.health.recovery.get().map_or(&[][..], |r| &r.damaged[..]) {
            if damaged.torn_tail || damaged.maps_nothing {
                let why = match damaged.torn_tail {
                    true => "a record written after the last flush was torn by a crash",
                    false => "a record that maps no block is damaged",
                };
                report.notes.push(format!("{why}, nothing lost: {}", damaged.what));
                continue;
            }
            let lbas = damaged.lbas.iter().map(|(lba, n)| (lba.0, *n)).collect();
            report.problem(damaged.offset_bytes, format!("found at recovery: {}", damaged.what), lbas);
        }
    }

    /// The retained checkpoints (both superblock slots) load.
    fn check_checkpoints(&self, report: &mut CheckReport) {
        let Ok((best, other)) = super::create::read_superblocks(self.backing.as_ref()) else {
            report.problem(0, "a superblock slot does not decode".into(), Vec::new());
            return;
        };
        for sb in std::iter::once(best).chain(other) {
            if let Err(e) = super::checkpoint::load_checkpoint(self.backing.as_ref(), &sb, self.log.cipher.as_deref()) {
                let at = sb.checkpoint_chunks.first().map_or(0, |c| c.offset_bytes);
                report.problem(at, format!("checkpoint {} does not load: {e}", sb.generation), Vec::new());
            }
        }
    }

    /// Walks the whole map: what it references per segment, its pages, and entries lost to
    /// damage.
    fn check_map(&self, report: &mut CheckReport, progress: &mut dyn FnMut(u64)) -> Result<MapTotals> {
        let n = self.geometry.segment_count as usize;
        let mut totals = MapTotals { live: vec![0; n], pages: vec![0; n], lz4: vec![0; n], stored: 0, zero: 0 };
        let map = self.map.read();
        let block_count = map.block_count();
        let mut lost: Vec<(u64, u64)> = Vec::new();
        let geometry = &self.geometry;
        let mut leaves_done = 0u64;
        let mut note = |lba: u64, blocks: u64, entry: PackedEntry, totals: &mut MapTotals| match entry.unpack() {
            Ok(Entry::Stored(s)) => {
                totals.add_live(geometry.segment_of(s.offset_bytes), s);
                totals.stored += blocks;
            }
            Ok(Entry::Zero) => totals.zero += blocks,
            Ok(Entry::Lost) | Err(_) => match lost.last_mut() {
                Some((start, n)) if *start + *n == lba => *n += blocks,
                _ => lost.push((lba, blocks)),
            },
            Ok(Entry::Unmapped) => {}
        };
        map.walk_current(0, block_count, self, &mut |item| {
            match item {
                WalkItem::Leaf(id, body) => {
                    let start = id.first_lba().0;
                    for (slot, &value) in body.iter().enumerate() {
                        if start + slot as u64 >= block_count {
                            break;
                        }
                        note(start + slot as u64, 1, PackedEntry(value), &mut totals);
                    }
                    leaves_done += 1;
                    if leaves_done.is_multiple_of(64) {
                        progress(id.index);
                    }
                }
                WalkItem::Constant(from, to, value) => note(from, to - from, value, &mut totals),
                WalkItem::Page(s) => totals.pages[geometry.segment_of(s.offset_bytes).index()] += s.stored_len as u64,
            }
            Ok(())
        })?;
        for (start, blocks) in lost {
            report.problem(
                0,
                format!("blocks {start}..{}: lost with damaged metadata (they read as EIO)", start + blocks),
                vec![(start, blocks)],
            );
        }
        Ok(totals)
    }

    /// Every record of a used segment, past damage, and every fragment in them; adds the
    /// verified fragments the map points at to the scan totals.
    fn check_segment(
        &self,
        id: SegmentId,
        usage: &SegmentUsage,
        scan: &ScanTotals,
        image: &mut AlignedBuf,
        report: &mut CheckReport,
    ) {
        let base = self.geometry.segment_base(id);
        image.resize(round_up(usage.end_bytes, SECTOR_SIZE as u64) as usize, 0);
        if let Err(e) = self.backing.read_at(base, &mut image[..]) {
            report.problem(base, format!("segment {id}: read failed: {e}"), Vec::new());
            return;
        }
        let image = &image[..];
        let dictionaries = self.dictionary_set();
        let context = RecordContext {
            store_tag: self.geometry.store_tag,
            dictionaries: &dictionaries,
            cipher: self.log.cipher.as_deref(),
            use_of: &|offset, seq, epoch| self.record_use(offset, seq, epoch),
        };
        let (records, damaged) = parse_segment(image, base, &context);
        scan.records.fetch_add(records.len() as u64, Ordering::Relaxed);
        let damaged_ranges = damaged.len();
        for (start, end) in damaged {
            report.problem(
                start,
                format!(
                    "segment {id}: bytes {start}..{end} hold no readable record (damaged; what they wrote is unknown)"
                ),
                Vec::new(),
            );
        }
        let parsed_end = records.last().map_or(0, |r| r.end_bytes - base);
        if round_up(parsed_end, SECTOR_SIZE as u64) < usage.end_bytes {
            report.problem(
                base + parsed_end,
                format!(
                    "segment {id}: records end at byte {parsed_end} but the segment is used up to {}; the rest is damaged",
                    usage.end_bytes
                ),
                Vec::new(),
            );
        }
        let last_offset = records.last().map(|r| r.offset_bytes);
        for record in &records {
            // The segment's last record, complete, with nothing after it: a write a crash
            // tore (the next records went to a fresh segment). Nothing is lost. (A damaged
            // record that maps nothing changes nothing; a retained checkpoint that needs a
            // damaged chunk is reported by `check_checkpoints`.)
            let maps_nothing = record.header.body.maps_nothing() || record.header.kind() == RecordKind::Checkpoint;
            let torn_tail = maps_nothing || Some(record.offset_bytes) == last_offset && damaged_ranges == 0;
            if record.damage.any() && torn_tail {
                report.notes.push(format!(
                    "segment {id}: record {} at byte {}, the last written there, is damaged as a crash leaves a torn write (its blocks are checked one by one)",
                    record.header.seq, record.offset_bytes
                ));
            } else if record.damage.any() {
                let lbas = record.header.body.fragments().iter().map(|(lba, _)| (lba.0, 1)).collect();
                let d = record.damage;
                report.problem(
                    record.offset_bytes,
                    format!(
                        "record {} at byte {}: damaged{}{}{} (its surviving copy still describes it)",
                        record.header.seq,
                        record.offset_bytes,
                        if d.head { ", head" } else { "" },
                        if d.tail { ", tail" } else { "" },
                        if d.payload { ", payload" } else { "" },
                    ),
                    lbas,
                );
            }
        }
        self.check_fragments(id, &records, image, base, scan, report);
    }

    /// Decodes every data fragment of a segment's records, checks its guard and protection
    /// information, and whether the map points at it (its leaves read a batch at a time).
    fn check_fragments(
        &self,
        id: SegmentId,
        records: &[FoundRecord],
        image: &[u8],
        base: u64,
        scan: &ScanTotals,
        report: &mut CheckReport,
    ) {
        let mut fragments: Vec<(Lba, Stored)> = Vec::new();
        let dictionaries = self.dictionary_set();
        for record in records {
            let format = record.header.version.fragment_format();
            let mut at = record.payload_offset_bytes;
            for (lba, fragment) in record.header.body.fragments() {
                if !fragment.is_zero_block(format) {
                    let stored =
                        Stored { offset_bytes: at, stored_len: fragment.stored_len, codec: fragment.codec, format };
                    fragments.push((lba, stored));
                }
                at += fragment.stored_len as u64;
            }
        }
        let mut leaves: Vec<PageId> = fragments.iter().map(|(lba, _)| PageId::leaf_of(*lba).0).collect();
        leaves.sort_unstable();
        leaves.dedup();
        let block_count = self.map.read().block_count();
        let mut block = vec![0u8; BLOCK_SIZE];
        for batch in leaves.chunks(256) {
            let map = self.map.read();
            let pinned = map.pin_loaded(batch, self);
            let (first, last) = (batch[0], batch[batch.len() - 1]);
            for (lba, stored) in fragments.iter().filter(|(lba, _)| (first..=last).contains(&PageId::leaf_of(*lba).0)) {
                let live = lba.0 < block_count
                    && pinned.is_ok()
                    && map.get(*lba, self).is_ok_and(|e| e == PackedEntry::stored(*stored));
                let from = (stored.offset_bytes - base) as usize;
                let bytes = &image[from..from + stored.stored_len as usize];
                match verify_fragment(
                    *stored,
                    bytes,
                    *lba,
                    &mut block,
                    &dictionaries,
                    self.sealed_at(stored.offset_bytes),
                ) {
                    Ok(()) if live => {
                        scan.found_live[id.index()].fetch_add(stored.stored_len as u64, Ordering::Relaxed);
                    }
                    Ok(()) => {}
                    // A dead fragment of a dictionary the store freed (`dictionaries.rs`):
                    // it no longer decodes, by design.
                    Err(_)
                        if !live
                            && freed_dictionary(
                                stored,
                                self.named_dictionary(bytes, *lba, self.segment_use(stored.offset_bytes).nonce_epoch),
                                &dictionaries,
                            ) => {}
                    Err(e) => {
                        let state = if live { "live: reads of it fail" } else { "no longer mapped" };
                        report.problem(
                            stored.offset_bytes,
                            format!("block {lba}, fragment at byte {} ({state}): {e}", stored.offset_bytes),
                            vec![(lba.0, 1)],
                        );
                    }
                }
            }
            if pinned.is_ok() {
                map.unpin(batch);
            }
        }
    }

    /// The table's live bytes equal what the map references, every map reference is a
    /// fragment that verified, and the table's page bytes are the current map's pages plus
    /// those the newest checkpoint replaced.
    fn compare_accounting(
        &self,
        segments: &[SegmentUsage],
        buffered: &[SegmentId],
        map: &MapTotals,
        scan: &ScanTotals,
        report: &mut CheckReport,
    ) -> Result<()> {
        let log = self.log.lock();
        let mut expected_pages = map.pages.clone();
        for &(segment, bytes) in &log.epochs.release_after_next {
            expected_pages[segment as usize] += bytes;
        }
        let counts = log.segments.counts;
        let pending = log.pending.bytes();
        let expected_pending = log.pending.expected(&map.lz4, |i| segments[i].first_seq);
        drop(log);
        if pending != expected_pending {
            report.problem(
                0,
                format!(
                    "pending recompression counts {pending} bytes of LZ4 fragments written since open, the map references {expected_pending}"
                ),
                Vec::new(),
            );
        }
        if counts.stored != map.stored || counts.zero != map.zero {
            report.problem(
                0,
                format!(
                    "the table counts {} stored and {} zero blocks, the map holds {} and {}",
                    counts.stored, counts.zero, map.stored, map.zero
                ),
                Vec::new(),
            );
        }
        for (i, s) in segments.iter().enumerate() {
            let at = self.geometry.segment_base(SegmentId(i as u32));
            if map.live[i] != s.live_bytes {
                report.problem(
                    at,
                    format!(
                        "segment {i}: usage table says {} live bytes, the map references {}",
                        s.live_bytes, map.live[i]
                    ),
                    Vec::new(),
                );
            }
            if expected_pages[i] != s.page_bytes {
                report.problem(
                    at,
                    format!(
                        "segment {i}: usage table says {} map page bytes, the map's pages take {}",
                        s.page_bytes, expected_pages[i]
                    ),
                    Vec::new(),
                );
            }
            let found = scan.found_live[i].load(Ordering::Relaxed);
            if !buffered.contains(&SegmentId(i as u32)) && found < map.live[i] {
                self.name_unverified(SegmentId(i as u32), map.live[i] - found, report)?;
            }
        }
        Ok(())
    }

    /// A segment whose map references are not all fragments that verified: find which
    /// blocks (a walk of the map for entries into that segment, each read and verified).
    fn name_unverified(&self, segment: SegmentId, missing_bytes: u64, report: &mut CheckReport) -> Result<()> {
        let map = self.map.read();
        let mut suspects: Vec<(u64, Stored)> = Vec::new();
        map.walk_current(0, map.block_count(), self, &mut |item| {
            if let WalkItem::Leaf(id, body) = item {
                for (slot, &value) in body.iter().enumerate() {
                    if let Ok(Entry::Stored(s)) = PackedEntry(value).unpack() {
                        if self.geometry.segment_of(s.offset_bytes) == segment {
                            suspects.push((id.first_lba().0 + slot as u64, s));
                        }
                    }
                }
            }
            Ok(())
        })?;
        drop(map);
        let mut named = 0;
        let mut block = vec![0u8; BLOCK_SIZE];
        for (lba, s) in suspects {
            if let Err(e) = self.fetch_blocks(&[Entry::Stored(s)], &mut block, Lba(lba), super::read::ReadCache::Bypass)
            {
                named += 1;
                report.problem(
                    s.offset_bytes,
                    format!("block {lba} (byte offset {}): {e}", lba * BLOCK_SIZE as u64),
                    vec![(lba, 1)],
                );
            }
        }
        if named == 0 {
            report.problem(
                self.geometry.segment_base(segment),
                format!("segment {segment}: {missing_bytes} bytes the map references are not fragments of its records"),
                Vec::new(),
            );
        }
        Ok(())
    }
}

/// Whether a dictionary fragment naming `named` names a dictionary the store no longer keeps.
fn freed_dictionary(stored: &Stored, named: Option<u32>, dictionaries: &crate::codec::DictionarySet) -> bool {
    stored.codec == crate::codec::CodecTag::ZstdDict && named.is_some_and(|id| dictionaries.dropped(id))
}
