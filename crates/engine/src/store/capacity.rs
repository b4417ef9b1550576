//! The arithmetic of space, with no state: the space classes and their reserves
//! (`SpaceClass`, `Reserves`: `space.rs` keeps the reserves as of now), the checkpoint room
//! and the host reserve they are made of, native capacity, and image sizing.
//!
//! Native capacity: the largest logical size that incompressible data can fill completely
//! and overwrite in any pattern, forever, without ENOSPC (docs/space.md, "Native capacity
//! and over-provisioning").
//!
//! It is what is left of the data area after the host reserve, the open segments, metadata
//! at its worst and the operator's over-provisioning (OP), counted in incompressible blocks
//! as densely as GC packs them. Why that suffices: GC can always run (the reserves,
//! `space.rs`), and with live data at most `1 - OP` of the data segments' block slots,
//! the emptiest segment holds at most that share live, so cleaning it gives back at least
//! OP of a segment for the relocations it costs — every GC step makes room.
//!
//! Native capacity is a function of the geometry and the OP alone (not of the logical
//! size), so `Nx` means the same bytes before and after a resize.

use super::geometry::{default_segment_size, segment_size_is_valid, FRAGMENT_END_WASTE_BYTES};
use crate::crypto::cipher::SEAL_OVERHEAD_BYTES;
use crate::format::{
    BATCH_ENTRY_BYTES, DATA_START_BYTES, PI_BYTES, RECORD_BLOCKS_MAX, RECORD_MAC_BYTES, RECORD_MIN_BYTES,
    RELOCATE_ENTRY_BYTES,
};
use crate::map::DIRTY_PAGES_HARD;
use crate::{BLOCK_SIZE, SECTOR_SIZE};

/// Parts per million: the unit of the over-provisioning setting.
pub const PPM: u32 = 1_000_000;
/// The default over-provisioning, 10%: at native capacity, full of incompressible data,
/// uniform random overwrites then run GC at ≤ 90% utilisation (docs/space.md has the
/// measured curve of OP against write amplification and latency).
pub const OVER_PROVISION_DEFAULT_PPM: u32 = 100_000;
/// Below 1%, GC at native capacity would copy ~99 bytes for each byte it frees.
pub const OVER_PROVISION_MIN_PPM: u32 = 10_000;
pub const OVER_PROVISION_MAX_PPM: u32 = 750_000;

/// Bytes one relocated incompressible block takes: the raw block with its protection
/// information, and its relocate entry (written twice). GC writes batch records since
/// 2026-11-27 (an 8-byte entry, once): the older cost stays here as a margin, so what
/// `zdisk format` promised a store does not change (docs/space.md).
/// An encrypted store's raw fragment is larger by the nonce and tag it carries.
const fn relocated_block_bytes(encrypted: bool) -> u64 {
    let seal = if encrypted { SEAL_OVERHEAD_BYTES } else { 0 };
    (BLOCK_SIZE + PI_BYTES + seal + 2 * RELOCATE_ENTRY_BYTES) as u64
}
/// A relocate record's header (with its extra 8 bytes; an encrypted store's with its MAC).
const fn relocate_header_bytes(encrypted: bool) -> u64 {
    let mac = if encrypted { RECORD_MAC_BYTES } else { 0 };
    (RECORD_MIN_BYTES + 8 + mac) as u64
}

/// How many incompressible blocks a segment holds when GC has packed it: its capacity (which
/// already leaves room for a fragment that does not fit at the end), less a relocate header
/// per 512 blocks and one more for a victim's relocation split across two segments.
///
/// This, not a host write's density, bounds what the store can hold: a host write of one
/// block costs a 132-byte record header of its own, but that header is dead at once and GC
/// reclaims it; what stays live is the fragment, and GC repacks fragments this densely.
fn blocks_per_packed_segment(segment_capacity_bytes: u64, encrypted: bool) -> u64 {
    let block_bytes = relocated_block_bytes(encrypted);
    let estimate = segment_capacity_bytes / block_bytes;
    let headers = estimate.div_ceil(RECORD_BLOCKS_MAX as u64) + 1;
    segment_capacity_bytes.saturating_sub(headers * relocate_header_bytes(encrypted)) / block_bytes
}

/// How a store's data area divides, for a given over-provisioning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NativeCapacity {
    /// Logical bytes of incompressible data the store can always hold and overwrite.
    pub bytes: u64,
    /// Segments that may hold data (the rest: reserve, open segment, metadata).
    pub data_segments: u64,
    /// Incompressible blocks one segment holds, packed by GC.
    pub blocks_per_segment: u64,
}

/// The host reserve: room for GC to relocate a victim into a fresh segment and for the two
/// checkpoints that make it reusable (docs/space.md, "Reserves"). Native capacity leaves it
/// out of the data segments (`native_capacity_for`).
pub(crate) fn host_reserve_for(segment_capacity_bytes: u64, checkpoint_room_bytes: u64) -> u64 {
    2 * segment_capacity_bytes + 2 * checkpoint_room_bytes
}

/// Room one checkpoint takes in the log, conservatively: the map pages it may rewrite — at
/// most the pages writers may dirty before they wait for a checkpoint, with their
/// ancestors, or every page of the map if that is fewer — each raw in the worst case; the
/// image (the segment table, uncompressed); and what each segment boundary it crosses may
/// waste.
pub(crate) fn checkpoint_room_for(logical_size_bytes: u64, segment_count: u64, segment_capacity_bytes: u64) -> u64 {
    let pages = map_page_count(logical_size_bytes).min(2 * DIRTY_PAGES_HARD as u64 + 8);
    let page_bytes = pages * (BLOCK_SIZE + PI_BYTES + BATCH_ENTRY_BYTES) as u64;
    let estimate = page_bytes + image_bytes(segment_count);
    estimate + (estimate / segment_capacity_bytes + 1) * (RECORD_MIN_BYTES as u64 + FRAGMENT_END_WASTE_BYTES)
}

/// The native capacity of a plain store with this geometry and over-provisioning.
#[cfg(test)]
pub fn native_capacity(segment_size_bytes: u64, segment_count: u64, over_provision_ppm: u32) -> NativeCapacity {
    native_capacity_for(segment_size_bytes, segment_count, over_provision_ppm, false, true)
}

/// The native capacity of a store, plain or encrypted, with this geometry and
/// over-provisioning; `cold_stream`: GC's output has an open segment of its own (stores
/// formatted since 2026-11-25, superblock feature flag `FEATURE_LOG_JUMPS`), whose room host
/// writes cannot use.
pub fn native_capacity_for(
    segment_size_bytes: u64,
    segment_count: u64,
    over_provision_ppm: u32,
    encrypted: bool,
    cold_stream: bool,
) -> NativeCapacity {
    debug_assert!(over_provision_ppm < PPM);
    let capacity = super::geometry::segment_capacity_of(segment_size_bytes);
    let blocks_per_segment = blocks_per_packed_segment(capacity, encrypted);
    // Metadata at its worst, for a map as large as the data area at 1x: every map page raw,
    // twice (the current version and the one the older retained checkpoint still needs),
    // and two checkpoint images.
    let logical_bytes = segment_count * segment_size_bytes;
    let checkpoint = checkpoint_room_for(logical_bytes, segment_count, capacity);
    let map_pages = map_page_count(logical_bytes);
    let page_bytes = relocated_block_bytes(encrypted) - 2 * RELOCATE_ENTRY_BYTES as u64 + BATCH_ENTRY_BYTES as u64;
    let metadata_bytes = 2 * map_pages * page_bytes + 2 * image_bytes(segment_count);
    // The host reserve and (below) the open segments.
    let reserve_bytes = host_reserve_for(capacity, checkpoint);
    let open_segments = if cold_stream { 2 } else { 1 };
    let kept_segments = (reserve_bytes + metadata_bytes).div_ceil(capacity) + open_segments;
    let data_segments = segment_count.saturating_sub(kept_segments);
    let slots = data_segments * blocks_per_segment;
    let blocks = slots - (slots as u128 * over_provision_ppm as u128).div_ceil(PPM as u128) as u64;
    NativeCapacity { bytes: blocks * BLOCK_SIZE as u64, data_segments, blocks_per_segment }
}

/// Native capacity from what a format is given (`None`: the default segment size), with the
/// data area laid out as `format` lays it out: what `--logical-size 1x` resolves to. 0 for a
/// segment size `format` refuses (it says why).
pub fn native_capacity_of_physical(
    physical_size_bytes: u64,
    segment_size_bytes: Option<u64>,
    over_provision_ppm: u32,
    sealing: super::options::Sealing,
) -> u64 {
    let encrypted = sealing == super::options::Sealing::Encrypted;
    let physical_size_bytes = physical_size_bytes / SECTOR_SIZE as u64 * SECTOR_SIZE as u64;
    let segment_size_bytes = segment_size_bytes.unwrap_or_else(|| default_segment_size(physical_size_bytes));
    if !segment_size_is_valid(segment_size_bytes) {
        return 0;
    }
    let segment_count = physical_size_bytes.saturating_sub(DATA_START_BYTES) / segment_size_bytes;
    native_capacity_for(segment_size_bytes, segment_count, over_provision_ppm, encrypted, true).bytes
}

/// Pages of a map covering `logical_bytes` (leaves and every level above them).
pub(crate) fn map_page_count(logical_bytes: u64) -> u64 {
    let mut level_pages = logical_bytes.div_ceil(BLOCK_SIZE as u64 * 512).max(1);
    let mut pages = level_pages;
    while level_pages > 1 {
        level_pages = level_pages.div_ceil(512);
        pages += level_pages;
    }
    pages
}

/// Bytes of a checkpoint image, at most (the segment table uncompressed and its header).
pub(crate) fn image_bytes(segment_count: u64) -> u64 {
    4096 + segment_count * 61
}

/// Parses and checks an over-provisioning percentage (`7`, `12.5`).
pub fn over_provision_ppm_from_percent(percent: f64) -> Result<u32, String> {
    let ppm = (percent * 10_000.0).round();
    if !percent.is_finite() || ppm < OVER_PROVISION_MIN_PPM as f64 || ppm > OVER_PROVISION_MAX_PPM as f64 {
        return Err(format!(
            "over-provisioning {percent}% must be between {}% and {}%",
            OVER_PROVISION_MIN_PPM / 10_000,
            OVER_PROVISION_MAX_PPM / 10_000
        ));
    }
    Ok(ppm as u32)
}

/// Who is asking for space: host writes may not eat into the reserve kept for GC and
/// checkpoints; metadata-only requests (trim, zero) may use most of it; GC and checkpoints
/// all of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpaceClass {
    Host,
    /// A host write that replaces more stored bytes than it adds: it frees space once GC
    /// runs, so it may use one segment of the reserve that other host writes may not.
    HostShrinking,
    HostMetadata,
    /// A trim or zero on a full store, after GC could not make the metadata reserve.
    TrimWhileFull,
    /// GC relocations out of a segment the reuse horizon has not passed: may use the
    /// reserve but must leave room for the two checkpoints that make it reusable.
    Gc,
    /// GC relocations out of a segment behind the horizon: it is reusable after one flush,
    /// so this may go further, keeping room for one checkpoint.
    GcSettled,
    Internal,
}

impl SpaceClass {
    /// Classes whose appends never wait for foreground GC: they fail at once when short.
    pub fn is_internal(self) -> bool {
        matches!(self, SpaceClass::Internal | SpaceClass::Gc | SpaceClass::GcSettled | SpaceClass::TrimWhileFull)
    }
}

/// The reserves of every class, in bytes (docs/space.md, "Reserves"): what an append of a
/// class must leave unused in the log. Invariant (liveness): every append of a class leaves
/// the reserve of the classes below it unused, counted in bytes of the log (free segments'
/// capacity and the open segment's room), so GC — and the checkpoints that free what it
/// cleaned — can always run, and trim works on a full store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reserves {
    segment_capacity_bytes: u64,
    checkpoint_room_bytes: u64,
    /// `host_reserve_for`'s answer, kept so that asking needs no arithmetic.
    host_bytes: u64,
}

impl Reserves {
    /// The reserves for a store of this logical size and geometry whose dictionary table
    /// takes `dictionary_table_bytes` in a checkpoint: the checkpoint room (see
    /// [`checkpoint_room_for`]) and the trained dictionaries a checkpoint carries — up to 8
    /// of up to 256 KiB, which the static bound does not know (native capacity does not
    /// count them: they come out of the bound's slack and the over-provisioning,
    /// docs/space.md, "Reserves").
    pub fn compute(
        logical_size_bytes: u64,
        dictionary_table_bytes: u64,
        segment_count: u64,
        segment_capacity_bytes: u64,
    ) -> Reserves {
        let checkpoint_room_bytes =
            checkpoint_room_for(logical_size_bytes, segment_count, segment_capacity_bytes) + dictionary_table_bytes;
        Reserves {
            segment_capacity_bytes,
            checkpoint_room_bytes,
            host_bytes: host_reserve_for(segment_capacity_bytes, checkpoint_room_bytes),
        }
    }

    /// The reserve of a class in bytes: what an append of that class must leave unused in
    /// the log (free segments and the open segment's room) for the classes below it.
    ///
    /// Each class leaves the ones below it room to work, down to GC, which leaves room for
    /// the checkpoints that make its victims reusable. The reserve is in bytes, not whole
    /// segments, and binds every append, even one that fits the open segment: GC must be
    /// able to relocate a victim into the last free segment and still have room for those
    /// checkpoints, or a store at GC's floor, with nothing cleaned, could never move again
    /// (it did: ENOSPC forever at 50% utilisation). See docs/space.md, "Reserves".
    pub fn of(&self, class: SpaceClass) -> u64 {
        let capacity = self.segment_capacity_bytes;
        let checkpoint = self.checkpoint_room_bytes;
        match class {
            SpaceClass::Host => self.host_bytes,
            SpaceClass::HostShrinking | SpaceClass::HostMetadata => capacity + 2 * checkpoint,
            // Trim and zero records are a fixed header each, and every one that unmaps data
            // makes garbage: they may go below the metadata reserve when GC cannot give it
            // back (trim must work on a full store), but leave GC a victim's worth of room.
            SpaceClass::TrimWhileFull => capacity / 8 + 2 * checkpoint,
            SpaceClass::Gc => 2 * checkpoint,
            SpaceClass::GcSettled => checkpoint,
            SpaceClass::Internal => 0,
        }
    }

    /// Room one checkpoint takes in the log.
    pub fn checkpoint_room_bytes(&self) -> u64 {
        self.checkpoint_room_bytes
    }

    /// The host reserve in whole segments, for the background worker's targets.
    pub fn host_segments(&self) -> u64 {
        self.host_bytes.div_ceil(self.segment_capacity_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_capacity_leaves_the_over_provisioning_spare() {
        // 4 GiB of 4 MiB segments.
        let segments = ((4u64 << 30) - DATA_START_BYTES) / (4 << 20);
        let none = native_capacity(4 << 20, segments, 0);
        let ten = native_capacity(4 << 20, segments, 100_000);
        assert_eq!(none.data_segments, ten.data_segments);
        let ratio = ten.bytes as f64 / none.bytes as f64;
        assert!((0.899..=0.901).contains(&ratio), "{ratio}");
        // Without OP, reserves, metadata and relocation records take 1.5-3%.
        let share = none.bytes as f64 / (4u64 << 30) as f64;
        assert!((0.97..0.985).contains(&share), "{share}");
        assert!(ten.bytes.is_multiple_of(BLOCK_SIZE as u64));
    }

    #[test]
    fn small_segments_hold_fewer_blocks_at_their_worst() {
        let big = native_capacity(4 << 20, 64, 0);
        let small = native_capacity(64 << 10, 64 * 64, 0);
        assert!(small.blocks_per_segment * 64 < big.blocks_per_segment);
        assert!(small.bytes < big.bytes);
    }

    #[test]
    fn a_store_too_small_for_its_reserves_has_no_native_capacity() {
        assert_eq!(native_capacity(64 << 10, 3, 0).bytes, 0);
    }

    #[test]
    fn over_provisioning_percentages_are_checked() {
        assert_eq!(over_provision_ppm_from_percent(7.0), Ok(70_000));
        assert_eq!(over_provision_ppm_from_percent(12.5), Ok(125_000));
        assert!(over_provision_ppm_from_percent(0.5).is_err());
        assert!(over_provision_ppm_from_percent(80.0).is_err());
        assert!(over_provision_ppm_from_percent(f64::NAN).is_err());
    }
}
