//! Stores written by earlier versions of zdisk open, read back, replay and check clean.
//!
//! `tests/fixtures/v2-*.img.zst` are durable images of small stores written by the format
//! version 2 code (commit ea550a0), one per codec, made by `make_version_2_fixtures` below
//! (run with `--ignored` on that commit; the function is kept to show what they hold). Each
//! covers every record kind version 2 writes — write, batch, trim, zero, relocate and
//! checkpoint-chunk records — with the newest checkpoint followed by a replay window that
//! holds one of each again, so opening one runs version-2 recovery end to end.
//! `v2.expected.zst` is the logical image each must read back.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::*;
use zdisk_engine::sim::SimDisk;
use zdisk_engine::{Codec, Durability, Store};

const CODECS: [(&str, Codec); 3] =
    [("lz4", Codec::Lz4), ("zstd", Codec::Zstd { level: 3 }), ("deflate", Codec::Deflate { level: 6 })];

const SEGMENTS: u64 = 40;
const SEGMENT_BYTES: u64 = 64 << 10;
const LOGICAL_BYTES: u64 = 4 << 20;

fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn load(name: &str) -> Vec<u8> {
    let compressed = std::fs::read(fixture_path(name)).unwrap_or_else(|e| panic!("fixture {name}: {e}"));
    zstd::decode_all(&compressed[..]).expect("fixture decompresses")
}

/// Text-like blocks (about 3:1, keeps the fixtures small but fills several segments),
/// different per version.
fn text_block(lba: u64, version: u8) -> Vec<u8> {
    let words = [
        "zdisk",
        "segment",
        "record",
        "batch",
        "replay",
        "checkpoint",
        "fragment",
        "map",
        "the",
        "of",
        "and",
        "block",
        "write",
        "trim",
        "zero",
        "flush",
        "crash",
        "horizon",
        "victim",
        "relocate",
        "codec",
        "store",
    ];
    let mut state = lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (version as u64) << 56 | 1;
    let mut block = Vec::with_capacity(4096);
    while block.len() < 4096 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        block.extend_from_slice(words[(state % words.len() as u64) as usize].as_bytes());
        if state.is_multiple_of(5) {
            block.extend_from_slice(format!(" {}", (state >> 20) % 100_000).as_bytes());
        }
        block.push(b' ');
    }
    block.truncate(4096);
    block
}

fn text(first_lba: u64, blocks: u64, version: u8) -> Vec<u8> {
    (first_lba..first_lba + blocks).flat_map(|lba| text_block(lba, version)).collect()
}

/// Overwrites every third of the first `blocks` blocks (garbage in the segments holding
/// them), lets two checkpoints move the reuse horizon past those segments, and has GC move
/// what is left live in them.
fn garbage_then_gc(store: &Store, expected: &mut [u8], blocks: u64, what: &str) {
    for lba in (0..blocks).step_by(3) {
        let data = text(lba, 1, 8);
        store.write(lba * 4096, &data, Durability::Buffered).unwrap();
        expected[lba as usize * 4096..(lba as usize + 1) * 4096].copy_from_slice(&data);
    }
    store.checkpoint().unwrap();
    store.checkpoint().unwrap();
    let moved_before = store.stats().gc_bytes_moved;
    assert!(store.collect_garbage(40).unwrap() > 0, "{what}: GC found no victim");
    assert!(store.stats().gc_bytes_moved > moved_before, "{what}: GC moved nothing");
}

/// Writes the fixtures with the code of the commit it runs on. Only meaningful on a commit
/// that writes format version 2; kept to document what the fixtures hold.
#[test]
#[ignore]
fn make_version_2_fixtures() {
    for (name, codec) in CODECS {
        let disk = new_disk(SEGMENTS, SEGMENT_BYTES, LOGICAL_BYTES, codec, 1);
        let mut model = vec![0u8; LOGICAL_BYTES as usize];
        let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
        fn apply(offset: u64, data: &[u8], store: &Store, model: &mut [u8]) {
            store.write(offset, data, Durability::Buffered).unwrap();
            model[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        }
        // Write records (more than 8 blocks), one group crossing a segment boundary.
        apply(0, &text(0, 300, 1), &store, &mut model);
        // Batch records (small writes), with a few incompressible (raw) blocks.
        for lba in (300..400).step_by(3) {
            apply(lba * 4096, &text(lba, 2, 1), &store, &mut model);
        }
        let mut rng = rng(7);
        for lba in [401u64, 402, 700] {
            apply(lba * 4096, &block_data(&mut rng, 4096, 100), &store, &mut model);
        }
        // Garbage, then GC: relocate records.
        for lba in (0..300).step_by(2) {
            apply(lba * 4096, &text(lba, 1, 2), &store, &mut model);
        }
        // (Victims must lie behind the reuse horizon: two checkpoints move it.)
        store.checkpoint().unwrap();
        store.checkpoint().unwrap();
        assert!(store.collect_garbage(3).unwrap() > 0);
        // Trim and write-zeroes (aligned: trim/zero records; unaligned: write records).
        store.trim(10 * 4096, 20 * 4096, Durability::Buffered).unwrap();
        model[10 * 4096..30 * 4096].fill(0);
        store.write_zeroes(40 * 4096 + 100, 10 * 4096, Durability::Buffered).unwrap();
        model[40 * 4096 + 100..50 * 4096 + 100].fill(0);
        store.checkpoint().unwrap();
        store.checkpoint().unwrap();
        // The replay window: one of each record kind again after the newest checkpoint.
        apply(500 * 4096, &text(500, 40, 3), &store, &mut model);
        for lba in (600..640).step_by(5) {
            apply(lba * 4096 + 17, &text(lba, 1, 3)[..4000], &store, &mut model);
        }
        for lba in (300..400).step_by(2) {
            apply(lba * 4096, &text(lba, 1, 4), &store, &mut model);
        }
        let checkpoints = store.stats().checkpoints;
        assert!(store.collect_garbage(2).unwrap() > 0);
        assert_eq!(store.stats().checkpoints, checkpoints, "the replay window must not be checkpointed");
        store.trim(100 * 4096, 8 * 4096, Durability::Buffered).unwrap();
        model[100 * 4096..108 * 4096].fill(0);
        store.write_zeroes(200 * 4096, 16 * 4096, Durability::Buffered).unwrap();
        model[200 * 4096..216 * 4096].fill(0);
        store.flush().unwrap();
        // A crash: the image is what is durable now, nothing more.
        let image = disk.crash_image();
        store.abandon();
        assert!(
            read_all(&Store::open_backing(Arc::new(SimDisk::from_image(image.clone(), 2)), &test_options()).unwrap())
                == model
        );
        let dir = fixture_path("");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("v2-{name}.img.zst")), zstd::encode_all(&image[..], 19).unwrap()).unwrap();
        // (The same requests on every codec: one expected image.)
        std::fs::write(dir.join("v2.expected.zst"), zstd::encode_all(&model[..], 19).unwrap()).unwrap();
    }
}

/// A version 2 store opens (replaying its window), reads back exactly, checks clean, takes
/// new writes, and survives a crash and a clean reopen after them.
#[test]
fn version_2_stores_open_read_replay_and_check_clean() {
    for (name, codec) in CODECS {
        let image = load(&format!("v2-{name}.img.zst"));
        let mut expected = load("v2.expected.zst");
        // Read-only first: nothing is written to a store opened read-only.
        let disk = Arc::new(SimDisk::from_image(image.clone(), 3));
        let read_only =
            Store::open_backing(disk.clone(), &zdisk_engine::OpenOptions { read_only: true, ..test_options() })
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(read_all(&read_only) == expected, "{name}: read-only contents differ");
        let report = read_only.check(&mut |_, _| {}).unwrap();
        assert!(report.problems.is_empty(), "{name}: {:?}", report.problems);
        drop(read_only);
        assert!(disk.image() == image, "{name}: a read-only open wrote to the store");

        let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
        assert!(read_all(&store) == expected, "{name}: contents differ");
        assert_eq!(store.info_of().codec, codec.to_string());
        // New writes on top, flushed, then a crash and a reopen.
        let data = text(800, 24, 9);
        store.write(800 * 4096, &data, Durability::Buffered).unwrap();
        expected[800 * 4096..824 * 4096].copy_from_slice(&data);
        store.trim(0, 4 * 4096, Durability::Buffered).unwrap();
        expected[..4 * 4096].fill(0);
        store.flush().unwrap();
        let crashed = disk.crash_image();
        store.abandon();
        let disk = Arc::new(SimDisk::from_image(crashed, 4));
        let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
        assert!(read_all(&store) == expected, "{name}: contents differ after a crash");
        let report = store.check(&mut |_, _| {}).unwrap();
        assert!(report.problems.is_empty(), "{name}: {:?}", report.problems);
        store.close().unwrap();
        let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
        assert!(read_all(&store) == expected, "{name}: contents differ after a clean reopen");
        // GC moves version 2 fragments into version 3 records, converting each as it goes:
        // make garbage in the old segments, let the horizon pass them, and collect.
        garbage_then_gc(&store, &mut expected, 300, name);
        // Its native capacity counts one open segment: GC's output stays in the host stream.
        assert_eq!(store.stats().gc_cold_bytes_moved, 0, "{name}: an old store's GC used the cold stream");
        assert!(read_all(&store) == expected, "{name}: contents differ after GC converted fragments");
        let report = store.check(&mut |_, _| {}).unwrap();
        assert!(report.problems.is_empty(), "{name}: {:?}", report.problems);
        store.close().unwrap();
        let store = Store::open_backing(disk, &test_options()).unwrap();
        assert!(read_all(&store) == expected, "{name}: contents differ after GC and a reopen");
    }
}

/// Blocks the relocate-record fixture writes (a small image; GC still moves several victims).
const RELOCATE_FIXTURE_BLOCKS: u64 = 200;

/// Writes `v4-relocate-records.img.zst` and its expected image with the code of the commit
/// it runs on. Only meaningful on a commit whose GC writes relocate records (8b9216d and
/// before; the fixture was made on 8b9216d): since then GC writes batch records, and the
/// assertion on the replay window fails. Kept to document what the fixture holds.
#[test]
#[ignore]
fn make_relocate_record_fixture() {
    let disk = new_disk(SEGMENTS, SEGMENT_BYTES, LOGICAL_BYTES, Codec::Lz4, 1);
    let mut model = vec![0u8; LOGICAL_BYTES as usize];
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    let apply = |offset: u64, data: &[u8], model: &mut [u8]| {
        store.write(offset, data, Durability::Buffered).unwrap();
        model[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    };
    apply(0, &text(0, RELOCATE_FIXTURE_BLOCKS, 1), &mut model);
    for lba in (0..RELOCATE_FIXTURE_BLOCKS).step_by(2) {
        apply(lba * 4096, &text(lba, 1, 2), &mut model);
    }
    store.checkpoint().unwrap();
    store.checkpoint().unwrap();
    // The replay window: more garbage, then GC's copies (relocate records) after the newest
    // checkpoint, and overwrites of some of the copied blocks after them.
    for lba in (1..RELOCATE_FIXTURE_BLOCKS).step_by(4) {
        apply(lba * 4096, &text(lba, 1, 3), &mut model);
    }
    let checkpoints = store.stats().checkpoints;
    assert!(store.collect_garbage(3).unwrap() > 0);
    assert_eq!(store.stats().checkpoints, checkpoints, "the replay window must not be checkpointed");
    for lba in (3..RELOCATE_FIXTURE_BLOCKS).step_by(8) {
        apply(lba * 4096, &text(lba, 1, 4), &mut model);
    }
    store.flush().unwrap();
    let image = disk.crash_image();
    store.abandon();
    let relocates = zdisk_engine::sim::inspect::replay_window(&image).iter().filter(|r| r.kind == 7).count();
    assert!(relocates > 0, "no relocate record in the replay window: this commit's GC writes batch records");
    assert!(
        read_all(&Store::open_backing(Arc::new(SimDisk::from_image(image.clone(), 2)), &test_options()).unwrap())
            == model
    );
    let dir = fixture_path("");
    std::fs::write(dir.join("v4-relocate-records.img.zst"), zstd::encode_all(&image[..], 19).unwrap()).unwrap();
    std::fs::write(dir.join("v4-relocate-records.expected.zst"), zstd::encode_all(&model[..], 19).unwrap()).unwrap();
}

/// GC wrote relocate records until 2026-11-27 (entries twice, compared and swapped in
/// replay); it writes batch records now. A store whose replay window holds relocate records
/// (`make_relocate_record_fixture`, on 8b9216d) replays them, reads back exactly, checks
/// clean, and takes GC's new batch copies on top, across a crash and a reopen. (A replay
/// that misplaced their fragments fails here; one that skipped them would not — their
/// victims cannot be reused within one replay window — and the version 2 test catches that.)
#[test]
fn relocate_records_of_earlier_builds_replay_and_check_clean() {
    let image = load("v4-relocate-records.img.zst");
    let mut expected = load("v4-relocate-records.expected.zst");
    let window = zdisk_engine::sim::inspect::replay_window(&image);
    assert!(window.iter().any(|r| r.kind == 7), "the fixture's replay window holds no relocate record");
    let disk = Arc::new(SimDisk::from_image(image, 5));
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    assert!(read_all(&store) == expected, "contents differ after replaying relocate records");
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    garbage_then_gc(&store, &mut expected, RELOCATE_FIXTURE_BLOCKS, "relocate fixture");
    store.flush().unwrap();
    let crashed = disk.crash_image();
    store.abandon();
    let store = Store::open_backing(Arc::new(SimDisk::from_image(crashed, 6)), &test_options()).unwrap();
    assert!(read_all(&store) == expected, "contents differ after GC and a crash");
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}
