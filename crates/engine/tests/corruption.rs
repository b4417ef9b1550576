//! Corruption and backing faults: bit flips in data, a record header, one checkpoint copy
//! and one superblock copy are detected and the store opens from what survives; ENOSPC and
//! EIO from the backing are reported, and a failed sync leaves the store read-only.

mod common;

use std::sync::Arc;

use common::*;
use zdisk_engine::sim::{Faults, SimDisk};
use zdisk_engine::{Codec, Durability, ErrorKind, Store};

const SLOT: usize = 16 << 10;

fn data(len: usize, tag: u8) -> Vec<u8> {
    (0..len).map(|i| if (i / 16) % 2 == 0 { tag } else { (i as u8).wrapping_mul(13) ^ tag }).collect()
}

fn fresh() -> Arc<SimDisk> {
    new_disk(32, 64 << 10, 1 << 20, Codec::Lz4, 3)
}

/// A fresh store holding one durable 8-block write at LBA 0 (one record at the start of the
/// data area), closed.
fn one_write_of_eight_blocks() -> Arc<SimDisk> {
    let disk = fresh();
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    store.write(0, &data(8 * 4096, 1), Durability::Fua).unwrap();
    store.close().unwrap();
    disk
}

fn reopen(disk: &SimDisk) -> (Arc<SimDisk>, Store) {
    let disk = Arc::new(SimDisk::from_image(disk.image(), 5));
    let store = Store::open_backing(disk.clone(), &test_options()).expect("reopen");
    (disk, store)
}

/// Where block `lba`'s fragment is in the image (the newest record holding one).
fn fragment_of(image: &[u8], lba: u64) -> std::ops::Range<u64> {
    zdisk_engine::sim::inspect::records(image)
        .into_iter()
        .rev()
        .find_map(|r| r.fragments.into_iter().find(|(l, _)| *l == lba).map(|(_, range)| range))
        .expect("a fragment of the block")
}

#[test]
fn a_flipped_data_bit_fails_that_read_only_and_is_counted() {
    let disk = one_write_of_eight_blocks();
    // Flip a bit inside block 0's compressed bytes (past its 12 bytes of protection info).
    let fragment = fragment_of(&disk.image(), 0);
    disk.flip_bit(fragment.start + 12 + 8, 3);
    let (_disk, store) = reopen(&disk);
    let mut block = vec![0u8; 4096];
    let err = store.read(0, &mut block).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Checksum, "{err}");
    assert_eq!(store.stats().checksum_errors, 1);
    store.read(4096, &mut block).unwrap();
    assert!(block == data(8 * 4096, 1)[4096..8192]);
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(report.problems.iter().any(|p| p.starts_with("block 0 ")), "{:?}", report.problems);
}

/// A record under a checkpoint whose description is lost in both copies (head and tail's
/// copy of it): the checkpointed map still finds its data; `check`
/// names the damage; GC cannot parse the record, so it never frees the segment.
#[test]
fn a_lost_record_under_a_checkpoint_is_reported_and_its_segment_kept() {
    let disk = fresh();
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    // Incompressible data fills segment 0 and more, so the checkpoint lands elsewhere.
    let mut rng = rng(9);
    let bytes = block_data(&mut rng, 40 * 4096, 100);
    store.write(0, &bytes, Durability::Fua).unwrap();
    store.close().unwrap();
    let first = zdisk_engine::sim::inspect::records(&disk.image()).remove(0);
    disk.flip_bit(first.head.start + 20, 0);
    disk.flip_bit(first.tail.end - 10, 0);
    let (_disk, store) = reopen(&disk);
    let image = read_all(&store);
    assert!(image[..40 * 4096] == bytes[..], "the checkpointed map still finds the data");
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(report.problems.iter().any(|p| p.contains("segment 0")), "{:?}", report.problems);
    assert!(report.damage.iter().any(|d| d.offset_bytes == first.head.start), "{:?}", report.damage);
    // GC cannot parse segment 0, so it must not free it: its data stays readable.
    store.trim(0, 4096, Durability::Buffered).unwrap();
    // Two checkpoints move the reuse horizon past segment 0, so background GC considers it.
    store.checkpoint().unwrap();
    store.checkpoint().unwrap();
    let cleaned = store.collect_garbage(8).unwrap();
    assert!(cleaned >= 1, "GC should have tried segment 0");
    store.checkpoint().unwrap();
    store.checkpoint().unwrap();
    let image = read_all(&store);
    assert!(image[4096..40 * 4096] == bytes[4096..]);
}

fn two_checkpoints() -> (Arc<SimDisk>, Vec<u8>) {
    let disk = fresh();
    let mut expected = vec![0u8; 1 << 20];
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    store.write(0, &data(16 * 4096, 1), Durability::Buffered).unwrap();
    expected[..16 * 4096].copy_from_slice(&data(16 * 4096, 1));
    store.checkpoint().unwrap();
    store.write(32 * 4096, &data(16 * 4096, 2), Durability::Buffered).unwrap();
    expected[32 * 4096..48 * 4096].copy_from_slice(&data(16 * 4096, 2));
    store.close().unwrap();
    (disk, expected)
}

/// The slot holding the newest checkpoint, and its first chunk's offset.
fn newest_slot(image: &[u8]) -> (usize, u64) {
    let generation = |slot: usize| u64::from_le_bytes(image[slot * SLOT + 32..slot * SLOT + 40].try_into().unwrap());
    let slot = if generation(0) > generation(1) { 0 } else { 1 };
    let chunk = u64::from_le_bytes(image[slot * SLOT + 120..slot * SLOT + 128].try_into().unwrap());
    (slot, chunk)
}

#[test]
fn a_damaged_newest_checkpoint_falls_back_to_the_previous_one() {
    let (disk, expected) = two_checkpoints();
    let (_, chunk) = newest_slot(&disk.image());
    disk.flip_bit(chunk + 3, 1);
    let (_disk, store) = reopen(&disk);
    assert!(read_all(&store) == expected);
}

#[test]
fn a_damaged_superblock_copy_falls_back_to_the_other() {
    for newest in [true, false] {
        let (disk, expected) = two_checkpoints();
        let (slot, _) = newest_slot(&disk.image());
        let damaged = if newest { slot } else { 1 - slot };
        disk.flip_bit((damaged * SLOT + 50) as u64, 2);
        let (_disk, store) = reopen(&disk);
        assert!(read_all(&store) == expected, "damaged the {} slot", if newest { "newest" } else { "older" });
    }
}

#[test]
fn both_superblocks_damaged_is_a_clear_error() {
    let (disk, _) = two_checkpoints();
    disk.flip_bit(50, 2);
    disk.flip_bit(SLOT as u64 + 50, 2);
    let disk = Arc::new(SimDisk::from_image(disk.image(), 1));
    let err = Store::open_backing(disk, &test_options()).err().unwrap();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
}

#[test]
fn enospc_from_the_backing_fails_the_flush_and_keeps_durable_data() {
    let disk = fresh();
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    store.write(0, &data(4096, 1), Durability::Fua).unwrap();
    disk.set_faults(Faults { enospc_from_write: Some(1), ..Faults::default() });
    store.write(4096, &data(4096, 2), Durability::Buffered).unwrap();
    let err = store.flush().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NoSpace, "{err}");
    // Failed, and says why; later writes and flushes get ENOSPC, not EROFS.
    let later = store.write(8192, &data(4096, 3), Durability::Buffered).unwrap_err();
    assert_eq!((later.kind(), later.errno()), (ErrorKind::BackingFull, libc::ENOSPC), "{later}");
    assert_eq!(store.flush().unwrap_err().kind(), ErrorKind::BackingFull);
    let stats = store.stats();
    assert_eq!(stats.state, zdisk_engine::StoreState::Failed, "{stats:?}");
    assert!(stats.state_reason.contains("No space left"), "{}", stats.state_reason);
    assert_eq!(stats.space_flag, 2, "a full backing is a full store");
    let mut block = vec![0u8; 4096];
    store.read(0, &mut block).unwrap();
    assert!(block == data(4096, 1));
    disk.power_off();
    drop(store);
    let disk = Arc::new(SimDisk::from_image(disk.crash_image(), 2));
    let store = Store::open_backing(disk, &test_options()).unwrap();
    store.read(0, &mut block).unwrap();
    assert!(block == data(4096, 1));
}

#[test]
fn a_failed_sync_makes_the_store_read_only_until_reopened() {
    let disk = fresh();
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    store.write(0, &data(4096, 1), Durability::Buffered).unwrap();
    disk.set_faults(Faults { fail_sync_at: Some(1), ..Faults::default() });
    assert_eq!(store.flush().unwrap_err().kind(), ErrorKind::Io);
    // A later flush must not claim durability the failed one lost.
    assert_eq!(store.flush().unwrap_err().kind(), ErrorKind::ReadOnly);
    assert_eq!(store.write(0, &data(4096, 2), Durability::Fua).unwrap_err().kind(), ErrorKind::ReadOnly);
    let stats = store.stats();
    assert_eq!(stats.state, zdisk_engine::StoreState::Failed, "{stats:?}");
    assert!(stats.state_reason.contains("sync"), "{}", stats.state_reason);
}

#[test]
fn a_failed_backing_read_is_an_io_error_and_the_store_keeps_serving() {
    let disk = fresh();
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    store.write(0, &data(4096, 1), Durability::Fua).unwrap();
    store.close().unwrap();
    let (disk, store) = reopen(&disk);
    disk.set_faults(Faults { fail_read_at: Some(1), ..Faults::default() });
    let mut block = vec![0u8; 4096];
    assert_eq!(store.read(0, &mut block).unwrap_err().kind(), ErrorKind::Io);
    store.read(0, &mut block).unwrap();
    assert!(block == data(4096, 1));
    assert_eq!(store.stats().checksum_errors, 0);
}

#[test]
fn a_reread_is_served_by_the_read_cache_but_check_still_reads_the_disk() {
    let disk = one_write_of_eight_blocks();
    let (disk, store) = reopen(&disk);
    let mut block = vec![0u8; 4096];
    store.read(0, &mut block).unwrap();
    let before = store.stats();
    assert_eq!((before.read_cache_hits, before.read_cache_misses), (0, 1));
    // Damage the fragment on disk after it was cached: reads keep returning the good copy
    // the cache verified, and `check`, which must see the disk, reports the damage.
    let fragment = fragment_of(&disk.image(), 0);
    disk.flip_bit(fragment.start + 12 + 8, 3);
    store.read(0, &mut block).unwrap();
    assert!(block == data(8 * 4096, 1)[..4096]);
    let after = store.stats();
    assert_eq!(after.read_cache_hits, 1, "{after:?}");
    assert!(after.read_cache_bytes > 0);
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(report.problems.iter().any(|p| p.starts_with("block 0 ")), "{:?}", report.problems);
}

/// A map page that fails its checksum makes the blocks it maps read as EIO (never another
/// page's entries, never zeroes), and only those: blocks under other pages read their data,
/// and writing a block again makes it readable.
#[test]
fn a_damaged_map_page_fails_the_reads_of_its_blocks_only() {
    // 4 MiB logical: two leaves (512 blocks each) under a root page.
    let disk = new_disk(64, 64 << 10, 4 << 20, Codec::Lz4, 7);
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    store.write(0, &data(4096, 1), Durability::Buffered).unwrap(); // leaf 0
    store.write(512 * 4096, &data(4096, 2), Durability::Buffered).unwrap(); // leaf 1
    store.checkpoint().unwrap();
    store.close().unwrap();
    // The newest version of leaf 0 (page id tag 0: level 0, index 0).
    let leaf0 = zdisk_engine::sim::inspect::records(&disk.image())
        .into_iter()
        .rev()
        .find_map(|r| r.pages.into_iter().find(|(tag, _)| *tag == 0).map(|(_, range)| range))
        .expect("leaf 0 was written as a map page");
    disk.flip_bit(leaf0.start + 12 + 4, 1);
    let (_disk, store) = reopen(&disk);
    let mut block = vec![0u8; 4096];
    let err = store.read(0, &mut block).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Checksum, "a block under the damaged page: {err}");
    store.read(512 * 4096, &mut block).expect("a block under the other leaf reads");
    assert!(block == data(4096, 2));
    assert_eq!(store.stats().map_damaged_pages, 1);
    store.write(0, &data(4096, 3), Durability::Fua).unwrap();
    store.read(0, &mut block).expect("written again, the block reads");
    assert!(block == data(4096, 3));
}
