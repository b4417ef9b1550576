//! Trained dictionaries: `recompress_with_new_dictionary` trains one on the store's blocks,
//! makes it durable in both superblock slots' checkpoints (feature flag set: older code
//! refuses the store), recompresses into it (comp_ratio rises, every block reads back, before
//! and after reopening, `check` clean); a newer dictionary frees the older one; GC and plain
//! `recompress` use the newest; host overwrites racing a recompression win.

mod common;

use std::sync::Arc;

use common::*;
use rand::Rng;
use zdisk_engine::sim::SimDisk;
use zdisk_engine::{Codec, CodecFallback, DictionaryOptions, Durability, OpenOptions, Store};

const ZSTD: Codec = Codec::Zstd { level: 1 };
const LOGICAL_BYTES: u64 = 1 << 20;
/// Byte offset of a superblock slot's feature flags (docs/format.md) and the slot size.
const FEATURE_FLAGS_OFFSET: usize = 72;
const SLOT_BYTES: usize = 16 << 10;

fn options() -> OpenOptions {
    OpenOptions { codec_fallback: CodecFallback::Never, ..test_options() }
}

fn dictionary_options() -> DictionaryOptions {
    DictionaryOptions { level: 3, size_bytes: 16 << 10, sample_blocks_max: 256 }
}

fn assert_clean(store: &Store) {
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "check: {:?}", report.problems);
}

/// Both superblock slots' dictionaries flag (feature flag bit 0; the others say other things).
fn dictionary_flags(disk: &SimDisk) -> [u64; 2] {
    let image = disk.image();
    [0, 1].map(|slot| {
        let at = slot * SLOT_BYTES + FEATURE_FLAGS_OFFSET;
        u64::from_le_bytes(image[at..at + 8].try_into().unwrap()) & 1
    })
}

/// A zstd:1 store whose whole logical range holds text.
fn store_of_text(seed: u64) -> (Arc<SimDisk>, Store, Vec<u8>) {
    let disk = new_disk(64, 64 << 10, LOGICAL_BYTES, ZSTD, seed);
    let store = Store::open_backing(disk.clone(), &options()).unwrap();
    let image = text_data(&mut rng(seed), LOGICAL_BYTES as usize);
    for (i, chunk) in image.chunks(64 << 10).enumerate() {
        store.write((i as u64) << 16, chunk, Durability::Buffered).unwrap();
    }
    store.flush().unwrap();
    (disk, store, image)
}

#[test]
fn a_trained_dictionary_shrinks_text_further_and_every_block_reads_back() {
    let (disk, store, image) = store_of_text(1);
    assert_eq!(dictionary_flags(&disk), [0, 0], "a store without dictionaries does not say it keeps one");
    let mut calls = Vec::new();
    let report = store.recompress_with_new_dictionary(&dictionary_options(), &mut |d, t| calls.push((d, t))).unwrap();
    let trained = report.dictionary.clone().expect("a dictionary was trained");
    assert_eq!(trained.id, 1);
    assert!(trained.size_bytes > 0 && trained.size_bytes <= 16 << 10, "{trained:?}");
    assert_eq!(calls.last(), Some(&(report.segments, report.segments)), "progress ends at the total");
    assert!(report.after.codec.recompressed_fragments_dictionary > 200, "{:?}", report.after.codec);
    assert!(
        report.after.comp_ratio > 1.15 * report.before.comp_ratio,
        "comp_ratio {} -> {}",
        report.before.comp_ratio,
        report.after.comp_ratio
    );
    assert_eq!((report.after.codec.dictionary_count, report.after.codec.dictionary_newest_id), (1, 1));
    assert!(read_all(&store) == image, "blocks recompressed with the dictionary read back different");
    assert_clean(&store);
    // Both slots name checkpoints that carry it: zdisk without dictionaries refuses the store.
    assert_eq!(dictionary_flags(&disk), [1, 1]);
    // A plain recompress into the dictionary looks only at segments written before it was
    // GC's (the open one of the start): not at every segment again — nor after a reopen.
    let again = store.recompress(None, &mut |_, _| {}).unwrap();
    assert!(again.segments <= 1, "{again:?}");
    store.close().unwrap();
    let store = Store::open_backing(disk, &options()).unwrap();
    let again = store.recompress(None, &mut |_, _| {}).unwrap();
    assert!(again.segments <= 1, "after reopen: {again:?}");
    assert!(read_all(&store) == image, "differs after reopen");
    assert_eq!(store.stats().codec.dictionary_newest_id, 1);
    assert!(store.stats().comp_ratio > 1.15 * report.before.comp_ratio);
    assert_clean(&store);
}

#[test]
fn a_second_dictionary_frees_the_first_once_no_fragment_names_it() {
    let (disk, store, mut image) = store_of_text(2);
    store.recompress_with_new_dictionary(&dictionary_options(), &mut |_, _| {}).unwrap();
    // New text over a quarter of the store, then a second dictionary.
    let fresh = text_data(&mut rng(22), (LOGICAL_BYTES / 4) as usize);
    store.write(0, &fresh, Durability::Buffered).unwrap();
    image[..fresh.len()].copy_from_slice(&fresh);
    let report = store.recompress_with_new_dictionary(&dictionary_options(), &mut |_, _| {}).unwrap();
    let trained = report.dictionary.unwrap();
    assert_eq!((trained.id, trained.freed_ids.clone()), (2, vec![1]), "{trained:?}");
    assert_eq!(report.after.codec.dictionary_count, 1);
    assert!(read_all(&store) == image);
    assert_clean(&store);
    store.close().unwrap();
    let store = Store::open_backing(disk.clone(), &options()).unwrap();
    assert!(read_all(&store) == image, "differs after reopen");
    assert_eq!((store.stats().codec.dictionary_count, store.stats().codec.dictionary_newest_id), (1, 2));
    assert_clean(&store);
    assert_eq!(dictionary_flags(&disk), [1, 1]);
}

#[test]
fn gc_and_plain_recompress_use_the_newest_dictionary() {
    let (disk, store, mut image) = store_of_text(3);
    store.recompress_with_new_dictionary(&dictionary_options(), &mut |_, _| {}).unwrap();
    let before = store.stats().codec.recompressed_fragments_dictionary;
    // Host writes are zstd:1 fragments (the write path never uses a dictionary)...
    let fresh = text_data(&mut rng(33), (LOGICAL_BYTES / 2) as usize);
    store.write(0, &fresh, Durability::Buffered).unwrap();
    image[..fresh.len()].copy_from_slice(&fresh);
    assert_eq!(store.stats().codec.blocks_written_zstd, 256 + 128, "{:?}", store.stats().codec);
    // ... which plain `recompress` moves into the dictionary.
    let report = store.recompress(None, &mut |_, _| {}).unwrap();
    assert!(report.after.codec.recompressed_fragments_dictionary >= before + 100, "{:?}", report.after.codec);
    // Trimming half makes segments worth cleaning; GC recompresses what it moves.
    let fresh = text_data(&mut rng(34), (LOGICAL_BYTES / 2) as usize);
    store.write(LOGICAL_BYTES / 2, &fresh, Durability::Buffered).unwrap();
    image[(LOGICAL_BYTES / 2) as usize..].copy_from_slice(&fresh);
    for offset in (0..LOGICAL_BYTES).step_by(128 << 10) {
        store.trim(offset, 64 << 10, Durability::Buffered).unwrap();
        image[offset as usize..(offset + (64 << 10)) as usize].fill(0);
    }
    store.checkpoint().unwrap();
    store.checkpoint().unwrap();
    let before_gc = store.stats().codec.recompressed_fragments_dictionary;
    assert!(store.collect_garbage(100).unwrap() > 0, "GC cleaned nothing");
    assert!(store.stats().codec.recompressed_fragments_dictionary > before_gc, "{:?}", store.stats().codec);
    assert!(read_all(&store) == image);
    assert_clean(&store);
    store.close().unwrap();
    let store = Store::open_backing(disk, &options()).unwrap();
    assert!(read_all(&store) == image, "differs after reopen");
}

#[test]
fn host_overwrites_racing_a_dictionary_recompression_win() {
    let (_disk, store, mut image) = store_of_text(4);
    let overwrites: Vec<(u64, Vec<u8>)> = {
        let mut rng = rng(44);
        (0..64)
            .map(|_| {
                let block = rng.gen_range(0..LOGICAL_BYTES / BLOCK);
                (block * BLOCK, text_data(&mut rng, BLOCK as usize))
            })
            .collect()
    };
    std::thread::scope(|scope| {
        let recompressing =
            scope.spawn(|| store.recompress_with_new_dictionary(&dictionary_options(), &mut |_, _| {}).unwrap());
        for (offset, data) in &overwrites {
            store.write(*offset, data, Durability::Buffered).unwrap();
        }
        recompressing.join().unwrap();
    });
    for (offset, data) in &overwrites {
        image[*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
    }
    assert!(read_all(&store) == image, "an overwrite racing the recompression was lost");
    assert_clean(&store);
}

#[test]
fn a_store_too_empty_to_train_on_is_told_so_and_left_as_it_was() {
    let disk = new_disk(64, 64 << 10, LOGICAL_BYTES, ZSTD, 5);
    let store = Store::open_backing(disk.clone(), &options()).unwrap();
    store.write(0, &text_data(&mut rng(5), 2 * BLOCK as usize), Durability::Buffered).unwrap();
    let err = store.recompress_with_new_dictionary(&dictionary_options(), &mut |_, _| {}).unwrap_err();
    assert_eq!(err.kind(), zdisk_engine::ErrorKind::InvalidArgument, "{err}");
    assert_eq!(store.stats().codec.dictionary_count, 0);
    store.close().unwrap();
    assert_eq!(dictionary_flags(&disk), [0, 0]);
}
