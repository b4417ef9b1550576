//! The store's statistics (`Stats`, what `zdisk stat` shows): read from the log, the map,
//! the space and codec state and the counters, at one moment each.

use std::sync::atomic::Ordering;

use super::capacity::native_capacity_for;
use super::capacity::SpaceClass;
use super::state::Inner;
use crate::format::{SegmentState, SUPERBLOCK_SLOT_BYTES};
use crate::stats::{Counters, Stats};
use crate::BLOCK_SIZE;

impl Inner {
    pub(crate) fn stats(&self) -> Stats {
        let c = &self.counters;
        let log = self.log.lock();
        let segment_size = self.geometry.segment_size_bytes;
        let SegmentTotals { live, page_bytes, garbage, reclaimable } = segment_totals(&log.segments, segment_size);
        let open_room = log.appender.open_segments().map(|o| segment_size - o.append_offset_bytes as u64).sum::<u64>();
        let reserve = self.reserves().of(SpaceClass::Host);
        let free_bytes = log.segments.free_count() as u64 * segment_size;
        let free_space = (free_bytes + reclaimable + open_room).saturating_sub(reserve);
        let physical_size = live + page_bytes + log.epochs.image_bytes * 2 + 2 * SUPERBLOCK_SLOT_BYTES as u64;
        let logical_size = (log.segments.counts.stored + log.segments.counts.zero) * BLOCK_SIZE as u64;
        let counts = log.segments.counts;
        let pending_recompress_bytes = log.pending.bytes();
        let segments_free = log.segments.free_count() as u64;
        drop(log);
        let map = self.map.read().stats();
        let findings = self.health.recovery.get();
        let damaged = self.degraded().is_some();
        let over_provision_ppm = self.space.over_provision_ppm.load(Ordering::Acquire);
        let native = native_capacity_for(
            self.geometry.segment_size_bytes,
            self.geometry.segment_count,
            over_provision_ppm,
            // (Not the cipher: a store read without its key has none.)
            self.geometry.encrypted,
            self.log.cold_stream,
        );
        let provisioned_cap = self.space.logical_size_bytes.load(Ordering::Acquire);
        let (state, state_reason) = self.health.state();
        let space_flag = self.space_flag(free_space, provisioned_cap > native.bytes, damaged);
        let host_write_bytes = Counters::get(&c.host_write_bytes);
        let backing_write_bytes = Counters::get(&c.backing_write_bytes);
        let (read_cache_hits, read_cache_misses, read_cache_bytes) = self.reads.cache.counters();
        Stats {
            free_space,
            physical_size,
            logical_size,
            comp_ratio: ratio_or(logical_size, physical_size, logical_size == 0, 1.0),
            provisioned_cap,
            native_capacity: native.bytes,
            over_provision_percent: over_provision_ppm as f64 / 10_000.0,
            space_flag,
            host_write_bytes,
            host_read_bytes: Counters::get(&c.host_read_bytes),
            backing_write_bytes,
            write_amplification: ratio_or(backing_write_bytes, host_write_bytes, host_write_bytes == 0, 0.0),
            garbage_bytes: garbage,
            padding_bytes: Counters::get(&c.padding_bytes),
            metadata_bytes: Counters::get(&c.metadata_bytes),
            data_bytes: Counters::get(&c.data_bytes),
            codec: self.codec_stats(pending_recompress_bytes),
            checksum_errors: Counters::get(&c.checksum_errors),
            gc_bytes_moved: Counters::get(&c.gc_bytes_moved),
            gc_segments_cleaned: Counters::get(&c.gc_segments_cleaned),
            checkpoints: Counters::get(&c.checkpoints),
            read_ops: Counters::get(&c.read_ops),
            write_ops: Counters::get(&c.write_ops),
            trim_ops: Counters::get(&c.trim_ops),
            zero_ops: Counters::get(&c.zero_ops),
            flush_ops: Counters::get(&c.flush_ops),
            fua_ops: Counters::get(&c.fua_ops),
            backing_size_bytes: self.geometry.physical_size_bytes,
            segment_size_bytes: segment_size,
            segments_total: self.geometry.segment_count,
            segments_free,
            stored_blocks: counts.stored,
            zero_blocks: counts.zero,
            read_cache_hits,
            read_cache_misses,
            read_cache_bytes,
            damaged_records: findings.map_or(0, |f| f.damaged.len() as u64),
            damaged,
            state,
            state_reason,
            map_cache_bytes: map.cache_bytes,
            map_cache_budget_bytes: map.cache_budget_bytes,
            map_cached_pages: map.cached_pages,
            map_dirty_pages: map.dirty_pages,
            map_pending_changes: map.pending_changes,
            map_cache_hits: map.hits,
            map_cache_misses: map.misses,
            map_cache_hit_rate: ratio_or(map.hits, map.hits + map.misses, map.hits + map.misses == 0, 1.0),
            map_damaged_pages: map.damaged_pages,
            map_page_bytes: page_bytes,
            map_write_bytes: Counters::get(&self.log.log_counters.map_write_bytes),
            gc_cold_bytes_moved: Counters::get(&self.log.log_counters.gc_cold_bytes_moved),
            gc_colder_bytes_moved: Counters::get(&self.log.log_counters.gc_colder_bytes_moved),
            host_backing_reads: Counters::get(&self.reads.backing_reads),
            host_backing_read_bytes: Counters::get(&self.reads.backing_read_bytes),
            host_reads_replanned: Counters::get(&self.reads.replanned),
            flushes_written_through: Counters::get(&self.log.log_counters.flushes_written_through),
            paced_writes: self.space.pacer.paced_writes(),
            paced_wait_ns: self.space.pacer.paced_wait_ns(),
        }
    }
}

impl Inner {
    /// `space_flag`: 2 full (or damaged), 1 low, 0 normal. Only a `thin` store (provisioned
    /// above native capacity) warns of low space: one at or below native capacity cannot run
    /// out, however full; its low free space is the over-provisioning at work.
    fn space_flag(&self, free_space: u64, thin: bool, damaged: bool) -> u8 {
        // A full backing is the store full, whatever its own free space says.
        let backing_full = self.health.failure.get().is_some_and(|f| f.backing_full);
        if self.space.exhausted.load(Ordering::Relaxed) || free_space == 0 || damaged || backing_full {
            2
        } else if thin && (free_space as f64) < self.options.low_space_fraction * self.geometry.data_area_bytes() as f64
        {
            1
        } else {
            0
        }
    }

    /// Codec choices since open, and the dictionary table as it is now.
    /// The codec statistics, with `pending_recompress_bytes` read from the log's count.
    fn codec_stats(&self, pending_recompress_bytes: u64) -> crate::stats::CodecStats {
        let mut codec = self.codecs.counters.snapshot();
        codec.pending_recompress_bytes = pending_recompress_bytes;
        codec.pending_recompress_saving_bytes = super::segments::recompress_saving_bytes(
            pending_recompress_bytes,
            Counters::get(&self.codecs.counters.lz4_recompress_tried_bytes),
            Counters::get(&self.codecs.counters.lz4_recompress_kept_bytes),
        );
        let dictionaries = self.codecs.dictionaries.read();
        codec.dictionary_count = dictionaries.table.len() as u64;
        codec.dictionary_bytes = dictionaries.table.iter().map(|d| d.bytes.len() as u64).sum();
        codec.dictionary_newest_id = dictionaries.newest.as_ref().map_or(0, |d| d.id as u64);
        codec
    }
}

/// What the segment table holds, summed for the statistics.
struct SegmentTotals {
    live: u64,
    page_bytes: u64,
    /// Dead bytes in sealed and open segments.
    garbage: u64,
    /// What cleaning would give back: cleaned segments, and sealed ones less what they hold.
    reclaimable: u64,
}

fn segment_totals(segments: &super::segments::SegmentTable, segment_size: u64) -> SegmentTotals {
    let mut t = SegmentTotals { live: 0, page_bytes: 0, garbage: 0, reclaimable: 0 };
    for (id, s) in segments.iter() {
        t.live += s.live_bytes;
        t.page_bytes += s.page_bytes;
        let held = s.live_bytes + s.page_bytes;
        match s.state {
            SegmentState::Sealed => {
                t.garbage += s.end_bytes.saturating_sub(held);
                if !segments.is_pinned(id) {
                    t.reclaimable += segment_size.saturating_sub(held);
                }
            }
            SegmentState::Open => t.garbage += s.end_bytes.saturating_sub(held),
            SegmentState::Cleaned => t.reclaimable += segment_size,
            SegmentState::Free => {}
        }
    }
    t
}

/// `numerator / denominator`, or `if_empty` when there is nothing to divide yet.
fn ratio_or(numerator: u64, denominator: u64, empty: bool, if_empty: f64) -> f64 {
    if empty {
        if_empty
    } else {
        numerator as f64 / denominator as f64
    }
}
