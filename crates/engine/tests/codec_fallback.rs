//! The adaptive codec fallback and recompression: host blocks written with the LZ4 fallback
//! in a zstd store read back identical, GC and `Store::recompress` move them into zstd
//! (comp_ratio rises, `check`'s accounting stays exact), and a host overwrite racing a
//! recompression always wins.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use rand::Rng;
use zdisk_engine::{Codec, CodecFallback, Durability, FormatOptions, OpenOptions, Store};

const ZSTD: Codec = Codec::Zstd { level: 1 };

fn options(fallback: CodecFallback) -> OpenOptions {
    OpenOptions { codec_fallback: fallback, ..test_options() }
}

fn assert_clean(store: &Store) {
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "check: {:?}", report.problems);
}

/// A zstd:1 store whose whole logical range (1 MiB) was written with the fallback forced.
fn store_of_fallback_blocks(seed: u64) -> (Arc<zdisk_engine::sim::SimDisk>, Vec<u8>) {
    let disk = new_disk(48, 64 << 10, 1 << 20, ZSTD, seed);
    let store = Store::open_backing(disk.clone(), &options(CodecFallback::Always)).unwrap();
    let mut rng = rng(seed);
    let image = word_text(&mut rng, 1 << 20);
    for (i, chunk) in image.chunks(64 << 10).enumerate() {
        store.write((i as u64) << 16, chunk, Durability::Buffered).unwrap();
    }
    let stats = store.stats();
    assert_eq!(stats.codec.codec_fallback_blocks, 256, "{stats:?}");
    assert_eq!(stats.codec.blocks_written_lz4, 256, "{stats:?}");
    assert_eq!(stats.codec.blocks_written_zstd, 0, "{stats:?}");
    assert!(read_all(&store) == image, "fallback blocks read back different");
    store.close().unwrap();
    (disk, image)
}

#[test]
fn fallback_blocks_are_lz4_fragments_counted_and_read_back_identical() {
    // (`store_of_fallback_blocks` asserts the counts and the contents, before and after reopening.)
    let (disk, image) = store_of_fallback_blocks(5);
    let store = Store::open_backing(disk, &options(CodecFallback::Never)).unwrap();
    assert!(read_all(&store) == image, "differs after reopen");
    assert_clean(&store);
}

#[test]
fn a_lone_writer_in_auto_mode_uses_the_stores_codec() {
    let disk = new_disk(48, 64 << 10, 1 << 20, ZSTD, 7);
    let store = Store::open_backing(disk, &options(CodecFallback::Auto)).unwrap();
    let data = word_text(&mut rng(7), 256 << 10);
    store.write(0, &data, Durability::Buffered).unwrap();
    let stats = store.stats();
    // One thread compresses at a time: a core is always free for zstd.
    assert_eq!((stats.codec.blocks_written_zstd, stats.codec.codec_fallback_blocks), (64, 0), "{stats:?}");
}

#[test]
fn gc_recompresses_fallback_fragments_it_moves_and_keeps_the_accounting_exact() {
    let (disk, image) = store_of_fallback_blocks(11);
    let store = Store::open_backing(disk.clone(), &options(CodecFallback::Never)).unwrap();
    let before = store.stats();
    // Trim every other 64 KiB: every segment becomes half garbage, worth cleaning.
    let mut model = image.clone();
    for offset in (0..1u64 << 20).step_by(128 << 10) {
        store.trim(offset, 64 << 10, Durability::Buffered).unwrap();
        model[offset as usize..(offset + (64 << 10)) as usize].fill(0);
    }
    store.checkpoint().unwrap();
    store.checkpoint().unwrap();
    assert!(store.collect_garbage(100).unwrap() > 0, "GC cleaned nothing");
    let after = store.stats();
    assert!(after.codec.recompressed_fragments > 0, "{after:?}");
    assert!(after.codec.recompress_saved_bytes > 0, "{after:?}");
    assert!(after.comp_ratio > before.comp_ratio, "comp_ratio {} -> {}", before.comp_ratio, after.comp_ratio);
    assert!(read_all(&store) == model, "recompressed blocks read back different");
    assert_clean(&store);
    store.close().unwrap();
    let store = Store::open_backing(disk, &options(CodecFallback::Never)).unwrap();
    assert!(read_all(&store) == model, "differs after reopen");
    assert_clean(&store);
}

#[test]
fn recompress_moves_every_fallback_fragment_and_raises_comp_ratio() {
    let (disk, image) = store_of_fallback_blocks(12);
    let store = Store::open_backing(disk.clone(), &options(CodecFallback::Never)).unwrap();
    let mut calls = Vec::new();
    let report = store.recompress(None, &mut |done, total| calls.push((done, total))).unwrap();
    assert!(report.segments > 0 && report.segments_cleaned == report.segments, "{report:?}");
    assert_eq!(calls.last(), Some(&(report.segments, report.segments)), "progress ends at the total");
    assert_eq!(report.after.codec.recompressed_fragments, 256, "{:?}", report.after);
    // LZ4 stores these text blocks in about 1.7x the bytes zstd does.
    assert!(
        report.after.comp_ratio > 1.3 * report.before.comp_ratio,
        "comp_ratio {} -> {}",
        report.before.comp_ratio,
        report.after.comp_ratio
    );
    assert!(read_all(&store) == image, "recompressed blocks read back different");
    assert_clean(&store);
    // Nothing is left to do: a second run finds no segment.
    let again = store.recompress(None, &mut |_, _| {}).unwrap();
    assert_eq!(again.segments, 0, "{again:?}");
    store.close().unwrap();
    let store = Store::open_backing(disk, &options(CodecFallback::Never)).unwrap();
    assert!(read_all(&store) == image, "differs after reopen");
    assert!(store.stats().comp_ratio > 1.3 * report.before.comp_ratio);
    assert_clean(&store);
}

#[test]
fn recompress_into_a_stronger_level_takes_the_stores_own_codec_too() {
    let disk = new_disk(48, 64 << 10, 1 << 20, Codec::Lz4, 13);
    let store = Store::open_backing(disk, &options(CodecFallback::Never)).unwrap();
    let image = word_text(&mut rng(13), 1 << 20);
    store.write(0, &image, Durability::Buffered).unwrap();
    // An LZ4 store has nothing in another codec...
    assert_eq!(store.recompress(None, &mut |_, _| {}).unwrap().segments, 0);
    // ...but can be moved into zstd on request.
    let report = store.recompress(Some(Codec::Zstd { level: 3 }), &mut |_, _| {}).unwrap();
    assert_eq!(report.after.codec.recompressed_fragments, 256, "{:?}", report.after);
    assert!(report.after.comp_ratio > report.before.comp_ratio);
    assert!(read_all(&store) == image);
    assert_clean(&store);
}

/// Writers overwrite their regions (LZ4 fallback always) while the background GC and a
/// thread running `recompress` move and recompress the same blocks: every thread reads back
/// its own last writes, before and after reopening, and the accounting is exact.
#[test]
fn host_overwrites_racing_recompression_always_win() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let logical = 8u64 << 20;
    Store::format(
        &path,
        &FormatOptions {
            physical_size_bytes: 16 << 20,
            logical_size_bytes: logical,
            codec: ZSTD,
            segment_size_bytes: Some(256 << 10),
            force: false,
            over_provision_ppm: zdisk_engine::OVER_PROVISION_DEFAULT_PPM,
            encryption: None,
            allocation: zdisk_engine::Allocation::Sparse,
        },
    )
    .unwrap();
    let open_options = OpenOptions {
        checkpoint_interval_bytes: 2 << 20,
        read_cache_bytes: 4 << 20,
        codec_fallback: CodecFallback::Always,
        ..OpenOptions::default()
    };
    let store = Arc::new(Store::open(&path, &open_options).unwrap());
    let done = Arc::new(AtomicBool::new(false));
    let recompressor = {
        let (store, done) = (Arc::clone(&store), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut runs = 0;
            while !done.load(Ordering::Relaxed) {
                store.recompress(None, &mut |_, _| {}).unwrap();
                runs += 1;
            }
            runs
        })
    };
    let region = logical / 4;
    let writers: Vec<_> = (0..4u64)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let mut rng = rng(t + 300);
                let mut model = vec![0u8; region as usize];
                for i in 0..2500 {
                    let offset = rng.gen_range(0..region / 4096 - 4) * 4096;
                    let len = rng.gen_range(1..=4) * 4096;
                    let data = word_text(&mut rng, len as usize);
                    store
                        .write(
                            t * region + offset,
                            &data,
                            if i % 200 == 0 { Durability::Fua } else { Durability::Buffered },
                        )
                        .unwrap();
                    model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                    if i % 10 == 0 {
                        let at = rng.gen_range(0..region - 16384);
                        let mut back = vec![0u8; 16384];
                        store.read(t * region + at, &mut back).unwrap();
                        assert!(back[..] == model[at as usize..at as usize + 16384], "thread {t} read a stale range");
                    }
                }
                model
            })
        })
        .collect();
    let models: Vec<Vec<u8>> = writers.into_iter().map(|t| t.join().unwrap()).collect();
    done.store(true, Ordering::Relaxed);
    let runs = recompressor.join().unwrap();
    let stats = store.stats();
    assert!(runs > 0 && stats.codec.recompressed_fragments > 0, "nothing recompressed in {runs} runs: {stats:?}");
    assert!(read_all(&store) == models.concat(), "a write was lost to a recompression");
    assert_clean(&store);
    Arc::try_unwrap(store).ok().unwrap().close().unwrap();
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    assert!(read_all(&store) == models.concat(), "differs after reopen");
    assert_clean(&store);
}

fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    rng(seed).fill(&mut data[..]);
    data
}

/// Stored bytes of the fragment LZ4 makes of `block` (its protection information
/// included), or None when LZ4 stores it raw or it is all zeros (a map entry, no fragment).
fn lz4_fragment_bytes(block: &[u8]) -> Option<u64> {
    let mut out = Vec::new();
    let lz4 = Codec::Lz4.compress_block(block, &mut out) == zdisk_engine::CodecTag::Lz4;
    (lz4 && block.iter().any(|&b| b != 0)).then_some(12 + out.len() as u64)
}

#[test]
fn incompressible_blocks_skip_a_slow_codec_and_are_counted() {
    let random = random_bytes(21, 256 << 10);
    let text = word_text(&mut rng(22), 256 << 10);
    let disk = new_disk(48, 64 << 10, 1 << 20, ZSTD, 21);
    let store = Store::open_backing(disk, &options(CodecFallback::Auto)).unwrap();
    store.write(0, &random, Durability::Buffered).unwrap();
    store.write(256 << 10, &text, Durability::Buffered).unwrap();
    let codec = store.stats().codec;
    assert_eq!((codec.incompressible_skipped_blocks, codec.blocks_written_raw), (64, 64), "{codec:?}");
    assert_eq!((codec.blocks_written_zstd, codec.codec_fallback_blocks), (64, 0), "{codec:?}");
    let mut back = vec![0u8; 512 << 10];
    store.read(0, &mut back).unwrap();
    assert!(back[..256 << 10] == random[..] && back[256 << 10..] == text[..], "read back different");
    assert_clean(&store);
    // An LZ4 store runs LZ4 on every block (it gives up on random data about as fast).
    let disk = new_disk(48, 64 << 10, 1 << 20, Codec::Lz4, 23);
    let store = Store::open_backing(disk, &options(CodecFallback::Auto)).unwrap();
    store.write(0, &random, Durability::Buffered).unwrap();
    let codec = store.stats().codec;
    assert_eq!((codec.incompressible_skipped_blocks, codec.blocks_written_raw), (0, 64), "{codec:?}");
}

#[test]
fn pending_recompress_bytes_follow_the_fallbacks_live_fragments_until_recompressed() {
    // Room enough that no GC runs (it would recompress some) before `recompress`.
    let disk = new_disk(256, 64 << 10, 4 << 20, ZSTD, 31);
    let store = Store::open_backing(disk.clone(), &options(CodecFallback::Always)).unwrap();
    // 4 MiB: recompression then tries more than the 1 MiB it measures its share on.
    let mut image = word_text(&mut rng(31), 4 << 20);
    store.write(0, &image, Durability::Buffered).unwrap();
    let pending_of = |image: &[u8]| -> u64 { image.chunks(4096).filter_map(lz4_fragment_bytes).sum() };
    let stats = store.stats();
    assert!(pending_of(&image) > 0);
    assert_eq!(stats.codec.pending_recompress_bytes, pending_of(&image), "{stats:?}");
    // Until recompression has measured its own, the saving is estimated at 21%.
    let expected_saving = (stats.codec.pending_recompress_bytes as f64 * 0.21).round() as u64;
    assert_eq!(stats.codec.pending_recompress_saving_bytes, expected_saving);
    // Overwrites take the old fragments off and count the new ones; random blocks are raw,
    // trimmed and zeroed ones gone.
    image[..64 << 10].copy_from_slice(&word_text(&mut rng(32), 64 << 10));
    store.write(0, &image[..64 << 10], Durability::Buffered).unwrap();
    let random = random_bytes(33, 64 << 10);
    image[64 << 10..128 << 10].copy_from_slice(&random);
    store.write(64 << 10, &random, Durability::Buffered).unwrap();
    store.trim(128 << 10, 64 << 10, Durability::Buffered).unwrap();
    store.write_zeroes(192 << 10, 64 << 10, Durability::Buffered).unwrap();
    image[128 << 10..256 << 10].fill(0);
    store.checkpoint().unwrap();
    let codec = store.stats().codec;
    assert_eq!((codec.pending_recompress_bytes, codec.recompressed_fragments), (pending_of(&image), 0));
    assert_clean(&store);
    // Recompression takes them all (text: every one gets smaller), and then knows its ratio.
    let report = store.recompress(None, &mut |_, _| {}).unwrap();
    assert!(report.after.codec.recompressed_fragments > 0, "{:?}", report.after);
    assert_eq!(report.after.codec.pending_recompress_bytes, 0, "{:?}", report.after);
    assert!(read_all(&store) == image, "read back different");
    assert_clean(&store);
    // Written with the fallback again: the estimate is at the share measured (zstd:1 stores
    // these text blocks in about 1/1.7 of LZ4's bytes), no longer 21%.
    store.write(0, &image[..256 << 10], Durability::Buffered).unwrap();
    let codec = store.stats().codec;
    let share = codec.pending_recompress_saving_bytes as f64 / codec.pending_recompress_bytes as f64;
    assert!(share > 0.3 && share < 0.6, "{codec:?}");
    store.close().unwrap();
    // Since open: fragments from before it are not counted.
    let store = Store::open_backing(disk, &options(CodecFallback::Never)).unwrap();
    assert_eq!(store.stats().codec.pending_recompress_bytes, 0);
    assert_clean(&store);
}
