//! Map pages on the store: reading page fragments for the map (from the segment buffers
//! while they are not on disk yet, else from the backing), and writing the pages a
//! checkpoint rewrites, level by level.
//!
//! Invariants: a page is read under the map's read lock (so the segment holding it is not
//! freed meanwhile); a checkpoint's page records are groups of their own and change no map
//! entry when replayed; the pages a checkpoint replaces are released only once the next
//! checkpoint is durable (the previous checkpoint, still retained, references them).

use std::collections::BTreeMap;

use super::capacity::SpaceClass;
use super::geometry::{new_buffer, round_up};
use super::log::Attempt;
use super::log::SnapshotAccount;
use super::log::{Block, Op};
use super::segments::BlockCounts;
use super::state::Inner;
use crate::error::{Error, ErrorKind, Result};
use crate::format::SegmentUsage;
use crate::map::page::{self, PageId};
use crate::map::{uniform_constant, walk_subtree, Delta, PackedEntry, PageSource, Prepared, Stored, Visit};
use crate::types::SegmentId;

/// Pages prepared and written together.
const PAGE_BATCH: usize = 256;

impl PageSource for Inner {
    fn cipher(&self) -> Option<&crate::crypto::cipher::StoreCipher> {
        self.log.cipher.as_deref()
    }

    fn segment_use(&self, address: u64) -> crate::crypto::cipher::SegmentUse {
        Inner::segment_use(self, address)
    }

    fn read_fragments(&self, at: &[Stored]) -> Result<Vec<Vec<u8>>> {
        let mut out: Vec<Vec<u8>> = vec![Vec::new(); at.len()];
        let mut on_disk = Vec::new();
        {
            let buffered = self.log.buffered.read();
            for (i, s) in at.iter().enumerate() {
                let segment = self.geometry.segment_of(s.offset_bytes);
                match buffered.iter().find(|b| b.segment == segment) {
                    Some(buffer) => {
                        let from = (s.offset_bytes - self.geometry.segment_base(segment)) as usize;
                        out[i] = buffer.data.read()[from..from + s.stored_len as usize].to_vec();
                    }
                    None => on_disk.push(i),
                }
            }
        }
        if on_disk.is_empty() {
            return Ok(out);
        }
        let align = self.backing.read_alignment() as u64;
        let spans: Vec<(u64, u64)> = on_disk
            .iter()
            .map(|&i| {
                let s = at[i];
                let start = s.offset_bytes / align * align;
                (start, round_up(s.offset_bytes + s.stored_len as u64, align))
            })
            .collect();
        let mut buffers: Vec<_> = spans.iter().map(|&(start, end)| new_buffer((end - start) as usize)).collect();
        {
            let mut reads: Vec<(u64, &mut [u8])> =
                spans.iter().zip(buffers.iter_mut()).map(|(&(start, _), b)| (start, &mut b[..])).collect();
            self.backing.read_many(&mut reads).map_err(|e| Error::io("read map pages", e))?;
        }
        for ((&i, &(start, _)), buffer) in on_disk.iter().zip(&spans).zip(&buffers) {
            let s = at[i];
            let from = (s.offset_bytes - start) as usize;
            out[i] = buffer[from..from + s.stored_len as usize].to_vec();
        }
        Ok(out)
    }
}

/// The checkpoint being written: its copy of the table, and the pages it replaced.
pub(crate) struct PageCheckpoint {
    pub usage: Vec<SegmentUsage>,
    pub counts: BlockCounts,
    /// Map page bytes per segment this checkpoint replaced.
    pub superseded: BTreeMap<SegmentId, u64>,
    pub page_bytes_written: u64,
    pub pages_written: u64,
}

/// What a replaced subtree's walk owes: entries and constants leaving the map (summed per
/// segment, so a walk of any size takes memory per segment, not per block), and its pages
/// superseded.
#[derive(Default)]
struct WalkDebt {
    live_bytes: BTreeMap<SegmentId, u64>,
    /// Of `live_bytes`, the LZ4 fragments' (`segments.rs`, `PendingRecompress`).
    lz4_bytes: BTreeMap<SegmentId, u64>,
    counts: BlockCounts,
    pages: BTreeMap<SegmentId, u64>,
}

impl WalkDebt {
    fn remove(&self, usage: &mut [SegmentUsage], counts: &mut BlockCounts) {
        for (&segment, &bytes) in &self.live_bytes {
            let u = &mut usage[segment.index()];
            debug_assert!(u.live_bytes >= bytes, "live bytes underflow in segment {segment}");
            u.live_bytes = u.live_bytes.saturating_sub(bytes);
        }
        counts.stored = counts.stored.saturating_sub(self.counts.stored);
        counts.zero = counts.zero.saturating_sub(self.counts.zero);
    }
}

impl Inner {
    /// Rewrites every page the map froze for this checkpoint, leaves first, up to the root.
    pub(crate) fn write_map_pages(&self, cp: &mut PageCheckpoint) -> Result<()> {
        let height = self.map.read().lock().height;
        for level in 0..height {
            let ids = self.map.read().rewrites_at(level);
            for batch in ids.chunks(PAGE_BATCH) {
                self.map.read().pin_loaded(batch, self)?;
                if let Err(e) = self.rewrite_pinned(batch, cp) {
                    self.map.read().unpin(batch);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Builds, writes and installs a batch of pinned pages (installing unpins them).
    fn rewrite_pinned(&self, ids: &[PageId], cp: &mut PageCheckpoint) -> Result<()> {
        let prepared = self.map.read().prepared(ids);
        let mut bodies = Vec::with_capacity(prepared.len());
        let mut pages = Vec::new();
        let mut debts = Vec::with_capacity(prepared.len());
        for p in &prepared {
            debts.push(self.walk_debt(p)?);
            let body = p.merged();
            if uniform_constant(&body).is_none() {
                let (entry, bytes, nonce_epoch) = page::encode(p.id, &body, self.log.cipher.as_deref())?;
                pages.push((p.id, Block { entry, bytes, nonce_epoch }));
            }
            bodies.push(body);
        }
        let entries: Vec<_> = pages.iter().map(|(_, b)| b.entry).collect();
        let offsets = if pages.is_empty() {
            Vec::new()
        } else {
            match self.try_append(&[Op::MapPages { pages }], SpaceClass::Internal)? {
                Attempt::Appended(appended) => appended.page_offsets,
                Attempt::Short { .. } => {
                    return Err(Error::new(ErrorKind::NoSpace, "no room for the map pages of a checkpoint"))
                }
                Attempt::Conflict => unreachable!("map pages carry no expectations"),
            }
        };
        let mut log = self.log.lock();
        let map = self.map.read();
        let mut written = entries.iter().zip(&offsets);
        for ((p, body), debt) in prepared.iter().zip(bodies).zip(debts) {
            let new_pointer = match uniform_constant(&body) {
                Some(constant) => constant,
                None => {
                    let (&entry, &offset) = written.next().expect("a written page per non-constant body");
                    let segment = self.geometry.segment_of(offset);
                    let bytes = entry.stored_len as u64;
                    log.segments.add_pages(segment, bytes);
                    let live_usage = *log.segments.get(segment);
                    note_snapshot_pages(cp, &live_usage, segment, bytes);
                    cp.page_bytes_written += bytes;
                    cp.pages_written += 1;
                    PackedEntry::of_fragment(offset, entry, crate::format::FragmentFormat::V3).0
                }
            };
            log.segments.remove_debt(&debt.live_bytes, debt.counts);
            let log = &mut *log;
            log.pending.account_walked(&debt.lz4_bytes, |segment| log.segments.get(segment).first_seq);
            debt.remove(&mut cp.usage, &mut cp.counts);
            for (&segment, &bytes) in &debt.pages {
                *cp.superseded.entry(segment).or_default() += bytes;
            }
            let mut live = log.live(&self.geometry);
            let mut snapshot =
                SnapshotAccount { usage: &mut cp.usage, counts: &mut cp.counts, geometry: &self.geometry };
            let old = map.install_rewrite(p, new_pointer, body, &mut live, &mut snapshot);
            if let Ok(crate::map::Entry::Stored(s)) = PackedEntry(old).unpack() {
                *cp.superseded.entry(self.geometry.segment_of(s.offset_bytes)).or_default() += s.stored_len as u64;
            }
        }
        drop(map);
        drop(log);
        self.map.read().trim_cache();
        Ok(())
    }

    /// What the replaced subtrees of an interior page's frozen walks owe.
    fn walk_debt(&self, p: &Prepared) -> Result<WalkDebt> {
        let mut debt = WalkDebt::default();
        for &(slot, pointer) in &p.walks {
            let child = PageId { level: p.id.level - 1, index: p.id.index * page::PAGE_SLOTS as u64 + slot as u64 };
            let geometry = &self.geometry;
            walk_subtree(child, pointer, self, &mut |visit| match visit {
                Visit::Page(s) => {
                    *debt.pages.entry(geometry.segment_of(s.offset_bytes)).or_default() += s.stored_len as u64
                }
                Visit::Leaf(body) => {
                    for &v in body.iter() {
                        match PackedEntry(v).unpack() {
                            Ok(crate::map::Entry::Stored(s)) => {
                                let segment = geometry.segment_of(s.offset_bytes);
                                *debt.live_bytes.entry(segment).or_default() += s.stored_len as u64;
                                if s.codec == crate::codec::CodecTag::Lz4 {
                                    *debt.lz4_bytes.entry(segment).or_default() += s.stored_len as u64;
                                }
                                debt.counts.stored += 1;
                            }
                            Ok(crate::map::Entry::Zero) => debt.counts.zero += 1,
                            _ => {}
                        }
                    }
                }
                Visit::Constant(value, blocks) => debt.counts.constant(value, blocks, Delta::Add),
                // Its entries are unknown: their segments keep counting them (never freed
                // early), and `check` reports the difference.
                Visit::Damaged(id) => tracing::error!("map page {id:?} of a replaced subtree is damaged"),
            })?;
        }
        Ok(debt)
    }
}

/// The snapshot's view of a segment that received pages: a use that began after the
/// snapshot (its first record differs) starts from the live table's identity, with no data
/// — replay adds that — so replay does not take it for a reuse.
fn note_snapshot_pages(cp: &mut PageCheckpoint, live: &SegmentUsage, segment: SegmentId, bytes: u64) {
    let snap = &mut cp.usage[segment.index()];
    if snap.first_seq != live.first_seq || snap.state == crate::format::SegmentState::Free {
        *snap = SegmentUsage {
            state: crate::format::SegmentState::Sealed,
            first_seq: live.first_seq,
            nonce_epoch: live.nonce_epoch,
            last_seq: live.last_seq,
            end_bytes: live.end_bytes,
            ..SegmentUsage::FREE
        };
    }
    snap.page_bytes += bytes;
}
