//! Concurrent requests with the background writer, GC and checkpoint threads running: no
//! read-modify-write loses another's bytes, and every thread reads back what it wrote.

mod common;

use std::sync::Arc;

use common::*;
use rand::Rng;
use zdisk_engine::{Codec, Durability, FormatOptions, OpenOptions, Store};

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
            over_provision_ppm: zdisk_engine::OVER_PROVISION_DEFAULT_PPM,
            encryption: None,
            allocation: zdisk_engine::Allocation::Sparse,
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
                    store.write(3 * 4096 + t as u64 * 512, &fill, Durability::Buffered).unwrap();
                    store
                        .write(
                            6 * 4096 + 2048 + t as u64 * 512,
                            &fill,
                            if round % 50 == 0 { Durability::Fua } else { Durability::Buffered },
                        )
                        .unwrap();
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
                    store
                        .write(
                            t * region + offset,
                            &data,
                            if i % 100 == 0 { Durability::Fua } else { Durability::Buffered },
                        )
                        .unwrap();
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
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Write,
    Zero,
    Trim,
}

/// A request of `kind` over `[offset, offset + len)`, with its own recognisable bytes.
fn request(kind: Kind, offset: u64, len: u64, tag: u8) -> Request {
    match kind {
        Kind::Write => Request::Write { offset, data: vec![tag; len as usize] },
        Kind::Zero => Request::Zero { offset, len },
        Kind::Trim => Request::Trim { offset, len },
    }
}

/// Two requests sent at once that touch part of a block (disjoint or overlapping, within one
/// block or across two adjacent ones), for every pairing of write, write-zeroes and trim:
/// each byte must end up as one whole request left it, in some order — never with one
/// request's update to a block lost because the other read the block before it and wrote
/// it back after. Seeded; prints the seed.
#[test]
fn concurrent_partial_block_requests_of_every_kind_never_lose_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(open_file_store(&dir, 32 << 20, 16 << 20));
    let kinds = [Kind::Write, Kind::Zero, Kind::Trim];
    for seed in seeds(1) {
        println!("seed {seed}");
        let mut rng = rng(seed);
        let mut rounds = 0;
        for a in kinds {
            for b in kinds {
                for (blocks, overlap) in [(1u64, false), (1, true), (2, false), (2, true)] {
                    for round in 0..150u64 {
                        let base_lba = 16 + (round % 64) * 4;
                        let base = base_lba * BLOCK;
                        let span = blocks * BLOCK;
                        let initial: Vec<u8> = (0..span).map(|i| (i as u8).wrapping_mul(7) | 1).collect();
                        store.write(base, &initial, Durability::Buffered).unwrap();
                        // A cut inside the span; with overlap the two ranges share some bytes.
                        let cut = rng.gen_range(1..span);
                        let (ra, rb) = if overlap {
                            let shared = rng.gen_range(1..=cut.min(span - cut).min(512));
                            ((0, cut + shared), (cut - shared.min(cut - 1), span - (cut - shared.min(cut - 1))))
                        } else {
                            ((0, cut), (cut, span - cut))
                        };
                        let req_a = request(a, base + ra.0, ra.1, 0xA5);
                        let req_b = request(b, base + rb.0, rb.1, 0x5A);
                        let barrier = Arc::new(std::sync::Barrier::new(2));
                        let run = |r: Request| {
                            let (store, barrier) = (Arc::clone(&store), Arc::clone(&barrier));
                            std::thread::spawn(move || {
                                barrier.wait();
                                r.run(&store, Durability::Buffered).unwrap();
                            })
                        };
                        let (ta, tb) = (run(req_a.clone()), run(req_b.clone()));
                        ta.join().unwrap();
                        tb.join().unwrap();
                        let mut got = vec![0u8; span as usize];
                        store.read(base, &mut got).unwrap();
                        let order = |first: &Request, second: &Request| {
                            let mut image = vec![0u8; (base + span) as usize];
                            image[base as usize..].copy_from_slice(&initial);
                            first.apply(&mut image);
                            second.apply(&mut image);
                            image[base as usize..].to_vec()
                        };
                        assert!(
                            got == order(&req_a, &req_b) || got == order(&req_b, &req_a),
                            "seed {seed}: {a:?} {ra:?} and {b:?} {rb:?} over {blocks} block(s): an update was lost"
                        );
                        rounds += 1;
                    }
                }
            }
        }
        println!("{rounds} rounds");
    }
}
