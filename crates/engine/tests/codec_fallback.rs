//! The adaptive codec fallback: host blocks written with the LZ4 fallback in a zstd store
//! are counted and read back identical; a lone writer gets the store's codec.

mod common;

use std::sync::Arc;

use common::*;
use rand::rngs::StdRng;
use rand::Rng;
use zdisk_engine::{Codec, CodecFallback, OpenOptions, Store};

const ZSTD: Codec = Codec::Zstd { level: 1 };

/// Text-like blocks (words from a small vocabulary), where zstd stores clearly fewer bytes
/// than LZ4 — what recompression is for.
fn text_data(rng: &mut StdRng, len: usize) -> Vec<u8> {
    const WORDS: [&str; 12] = [
        "the ",
        "block ",
        "segment ",
        "zdisk ",
        "of ",
        "checkpoint\n",
        "map ",
        "compress ",
        "GC ",
        "and ",
        "log ",
        "replay ",
    ];
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        out.extend_from_slice(WORDS[rng.gen_range(0..WORDS.len())].as_bytes());
    }
    out.truncate(len);
    out
}

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
    let image = text_data(&mut rng, 1 << 20);
    for (i, chunk) in image.chunks(64 << 10).enumerate() {
        store.write((i as u64) << 16, chunk, false).unwrap();
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
    let data = text_data(&mut rng(7), 256 << 10);
    store.write(0, &data, false).unwrap();
    let stats = store.stats();
    // One thread compresses at a time: a core is always free for zstd.
    assert_eq!((stats.codec.blocks_written_zstd, stats.codec.codec_fallback_blocks), (64, 0), "{stats:?}");
}
