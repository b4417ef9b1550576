//! Concurrent requests with the background writer, GC and checkpoint threads running: no
//! read-modify-write loses another's bytes, and every thread reads back what it wrote.

mod common;

use std::sync::Arc;

use common::*;
use rand::Rng;
use zdisk_engine::{Codec, FormatOptions, OpenOptions, Store};

fn open_file_store(dir: &tempfile::TempDir, physical: u64, logical: u64) -> Store {
    let path = dir.path().join("store");
    Store::format(
        &path,
        &FormatOptions {
            physical_size_bytes: physical,
            logical_size_bytes: logical,
            codec: Codec::Lz4,
            segment_size_bytes: Some(256 << 10),
            force: false,
        },
    )
    .unwrap();
    // The read cache is on so segment reuse under concurrent readers exercises its epochs.
    let options =
        OpenOptions { checkpoint_interval_bytes: 4 << 20, read_cache_bytes: 8 << 20, ..OpenOptions::default() };
    Store::open(&path, &options).unwrap()
}

#[test]
fn concurrent_sub_block_writes_to_one_block_never_lose_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(open_file_store(&dir, 32 << 20, 16 << 20));
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                for round in 0..200u32 {
                    // Each thread owns 512 bytes of block 3 and of the block pair 6–7 (spanning
                    // the boundary), and rewrites them with its round number.
                    let fill = [t.wrapping_mul(31) ^ round as u8; 512];
                    store.write(3 * 4096 + t as u64 * 512, &fill, false).unwrap();
                    store.write(6 * 4096 + 2048 + t as u64 * 512, &fill, round % 50 == 0).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut block = vec![0u8; 4096];
    store.read(3 * 4096, &mut block).unwrap();
    let mut span = vec![0u8; 4096];
    store.read(6 * 4096 + 2048, &mut span).unwrap();
    for t in 0..8u8 {
        let want = t.wrapping_mul(31) ^ 199;
        assert!(
            block[t as usize * 512..(t as usize + 1) * 512].iter().all(|&b| b == want),
            "thread {t} lost bytes in block 3"
        );
        assert!(
            span[t as usize * 512..(t as usize + 1) * 512].iter().all(|&b| b == want),
            "thread {t} lost bytes in blocks 6-7"
        );
    }
}

#[test]
fn threads_read_back_their_own_writes_while_gc_and_checkpoints_run() {
    let dir = tempfile::tempdir().unwrap();
    // Small physical space: overwrites force GC and checkpoints while the threads run.
    let logical = 12u64 << 20;
    let store = Arc::new(open_file_store(&dir, 24 << 20, logical));
    let region = logical / 4;
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let mut rng = rng(t + 100);
                let mut model = vec![0u8; region as usize];
                for i in 0..3000 {
                    let offset = rng.gen_range(0..region - 20000);
                    let len = rng.gen_range(1..20000);
                    let data = block_data(&mut rng, len as usize, 60);
                    store.write(t * region + offset, &data, i % 100 == 0).unwrap();
                    if i % 250 == 0 {
                        // Checkpoints from several threads at once, racing the background ones.
                        store.checkpoint().unwrap();
                    }
                    model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                    if i % 10 == 0 {
                        let at = rng.gen_range(0..region - 8192);
                        let mut back = vec![0u8; 8192];
                        store.read(t * region + at, &mut back).unwrap();
                        assert!(back[..] == model[at as usize..at as usize + 8192], "thread {t} read a stale range");
                    }
                }
                model
            })
        })
        .collect();
    let models: Vec<Vec<u8>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let stats = store.stats();
    assert!(stats.gc_segments_cleaned > 0, "the test should have made GC run: {stats:?}");
    let image = read_all(&store);
    for (t, model) in models.iter().enumerate() {
        assert!(image[t * region as usize..(t + 1) * region as usize] == model[..], "thread {t}'s region differs");
    }
    let store = Arc::try_unwrap(store).ok().unwrap();
    store.close().unwrap();
    let store = Store::open(&dir.path().join("store"), &OpenOptions::default()).unwrap();
    assert!(read_all(&store) == models.concat(), "differs after reopen");
    assert!(store.check(&mut |_, _| {}).unwrap().problems.is_empty());
}
