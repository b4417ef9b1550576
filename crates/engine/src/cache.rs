//! The read cache: stored fragments (compressed, CRC prefix included) recently read from the
//! backing store, keyed by where they are on it.
//!
//! Holding fragments compressed makes the same memory cover `comp_ratio` times more logical
//! data than a block cache would. A hit is decoded and its CRC checked like a fragment read
//! from disk, so the cache can never return what the disk would not.
//!
//! It is direct-mapped (a fragment can live in one slot only, chosen by a hash of its offset)
//! and never waits: a slot another thread holds is a miss, and an insert into a busy slot is
//! skipped. On a 2-core machine serving 16+ request threads, a cache whose shard locks can be
//! held by a descheduled thread (quick_cache was tried) made random reads 15–25% *slower*;
//! under uniform random reads every policy hits at about capacity / working set anyway.
//!
//! A backing offset names a fragment only until its segment is freed and rewritten, so the
//! key carries the segment's *epoch*, bumped whenever the segment is freed. Every fragment
//! cached under an old epoch is unreachable from then on. The bump happens after the free
//! path's map write barrier (no reader still holds a map entry into the segment) and before
//! the segment can be reused, so a reader can never pair a new fragment's offset with an old
//! epoch.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::types::SegmentId;

/// The slot size allocated up front: a 2:1 block's fragment (about 2,090 bytes of LZ4 output
/// and CRC) fits. Larger fragments grow their slot, within the byte budget.
const TYPICAL_FRAGMENT_BYTES: u64 = 2176;

#[derive(Default)]
struct Slot {
    offset_bytes: u64,
    epoch: u32,
    /// Bytes of `bytes` in use; 0 for an empty slot.
    len: usize,
    bytes: Vec<u8>,
}

pub struct FragmentCache {
    slots: Box<[Mutex<Slot>]>,
    /// One per segment; bumped when the segment is freed.
    epochs: Box<[AtomicU32]>,
    /// Slot buffer capacity allocated so far, never more than `capacity_bytes`.
    held_bytes: AtomicU64,
    capacity_bytes: u64,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl FragmentCache {
    /// A cache holding at most `capacity_bytes` of fragments for a store of `segment_count`
    /// segments (0: no cache).
    pub fn new(capacity_bytes: u64, segment_count: u64) -> FragmentCache {
        let slot_count = (capacity_bytes / TYPICAL_FRAGMENT_BYTES) as usize;
        // Allocated (and touched) up front: growing the heap while serving stalls the
        // O_DIRECT reads, which need the same address-space lock to pin their buffers.
        let slots: Box<[Mutex<Slot>]> = (0..slot_count)
            .map(|_| Mutex::new(Slot { bytes: vec![0; TYPICAL_FRAGMENT_BYTES as usize], ..Slot::default() }))
            .collect();
        FragmentCache {
            slots,
            epochs: (0..segment_count).map(|_| AtomicU32::new(0)).collect(),
            held_bytes: AtomicU64::new(slot_count as u64 * TYPICAL_FRAGMENT_BYTES),
            capacity_bytes,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    fn slot(&self, offset_bytes: u64) -> Option<&Mutex<Slot>> {
        if self.slots.is_empty() {
            return None;
        }
        // Fibonacci hashing: fragment offsets are near-sequential, slots should not be.
        let hash = offset_bytes.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 16;
        Some(&self.slots[(hash % self.slots.len() as u64) as usize])
    }

    fn epoch(&self, segment: SegmentId) -> u32 {
        self.epochs[segment.index()].load(Ordering::Acquire)
    }

    /// Runs `decode` on the fragment stored at `offset_bytes` in `segment` if it is cached
    /// (and its slot not busy). The caller holds the map read lock that made the offset current.
    pub fn with_fragment<R>(
        &self,
        segment: SegmentId,
        offset_bytes: u64,
        decode: impl FnOnce(&[u8]) -> R,
    ) -> Option<R> {
        let slot = self.slot(offset_bytes)?;
        let found = slot.try_lock().and_then(|slot| {
            (slot.len > 0 && slot.offset_bytes == offset_bytes && slot.epoch == self.epoch(segment))
                .then(|| decode(&slot.bytes[..slot.len]))
        });
        let counter = if found.is_some() { &self.hits } else { &self.misses };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    /// Remembers a fragment just read from the backing store (same lock rule as
    /// `with_fragment`). Skipped when the slot is busy or the budget is spent.
    pub fn insert(&self, segment: SegmentId, offset_bytes: u64, fragment: &[u8]) {
        let Some(slot) = self.slot(offset_bytes) else { return };
        let Some(mut slot) = slot.try_lock() else { return };
        let grow = fragment.len().saturating_sub(slot.bytes.len()) as u64;
        if grow > 0 {
            if self.held_bytes.fetch_add(grow, Ordering::Relaxed) + grow > self.capacity_bytes {
                self.held_bytes.fetch_sub(grow, Ordering::Relaxed);
                return;
            }
            slot.bytes.resize(fragment.len(), 0);
        }
        slot.bytes[..fragment.len()].copy_from_slice(fragment);
        slot.len = fragment.len();
        slot.offset_bytes = offset_bytes;
        slot.epoch = self.epoch(segment);
    }

    /// Forgets everything cached from `segment`: called when it is freed, after no reader can
    /// hold a map entry into it and before it can be written again.
    pub fn forget_segment(&self, segment: SegmentId) {
        self.epochs[segment.index()].fetch_add(1, Ordering::AcqRel);
    }

    /// (hits, misses, bytes held).
    pub fn counters(&self) -> (u64, u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
            self.held_bytes.load(Ordering::Relaxed),
        )
    }
}

/// The read side of an open store: the fragment cache, and what host reads cost the
/// device since open.
pub(crate) struct Reads {
    pub cache: FragmentCache,
    /// Backing reads (coalesced runs) for host reads, and their bytes.
    pub backing_reads: AtomicU64,
    pub backing_read_bytes: AtomicU64,
    /// Asynchronous reads redone because a segment they read was freed meanwhile.
    pub replanned: AtomicU64,
}

impl Reads {
    pub fn new(cache: FragmentCache) -> Reads {
        Reads {
            cache,
            backing_reads: AtomicU64::new(0),
            backing_read_bytes: AtomicU64::new(0),
            replanned: AtomicU64::new(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(cache: &FragmentCache, segment: SegmentId, offset_bytes: u64) -> Option<Vec<u8>> {
        cache.with_fragment(segment, offset_bytes, |f| f.to_vec())
    }

    #[test]
    fn a_freed_segment_no_longer_hits() {
        let cache = FragmentCache::new(1 << 20, 4);
        cache.insert(SegmentId(2), 8192, b"fragment");
        assert_eq!(get(&cache, SegmentId(2), 8192).as_deref(), Some(&b"fragment"[..]));
        assert!(get(&cache, SegmentId(2), 8193).is_none());
        cache.forget_segment(SegmentId(2));
        assert!(get(&cache, SegmentId(2), 8192).is_none(), "a fragment of a freed segment must not be returned");
        cache.insert(SegmentId(2), 8192, b"new one");
        assert_eq!(get(&cache, SegmentId(2), 8192).as_deref(), Some(&b"new one"[..]));
        let (hits, misses, held) = cache.counters();
        assert_eq!((hits, misses), (2, 2));
        assert!(held > 0);
    }

    #[test]
    fn the_cache_stays_within_its_bound_and_keeps_recent_fragments() {
        let capacity = 64 << 10;
        let cache = FragmentCache::new(capacity, 1);
        for i in 0..1000u64 {
            cache.insert(SegmentId(0), i * 2100, &[i as u8; 2100]);
        }
        let (_, _, held) = cache.counters();
        assert!(held <= capacity, "{held} bytes held, bound {capacity}");
        let kept = (900..1000u64)
            .filter(|i| get(&cache, SegmentId(0), i * 2100).is_some_and(|f| f == [*i as u8; 2100]))
            .count();
        assert!(kept >= 5, "only {kept} of the last 100 fragments are cached");
    }

    #[test]
    fn a_busy_slot_is_a_miss_not_a_wait() {
        let cache = FragmentCache::new(1 << 20, 1);
        cache.insert(SegmentId(0), 4096, b"x");
        let _held = cache.slot(4096).unwrap().lock();
        assert!(get(&cache, SegmentId(0), 4096).is_none());
        cache.insert(SegmentId(0), 4096, b"y");
    }

    #[test]
    fn a_zero_sized_cache_holds_nothing() {
        let cache = FragmentCache::new(0, 1);
        cache.insert(SegmentId(0), 0, b"x");
        assert!(get(&cache, SegmentId(0), 0).is_none());
        assert_eq!(cache.counters(), (0, 0, 0));
    }
}
