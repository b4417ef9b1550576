//! Flushes: from several threads at once, with a power cut at a random moment; and the
//! write-behind bound that caps what a flush has to write first.
//!
//! Flushes that queue behind one another share a sync and a flush proof (group commit,
//! `store/writeout.rs`, `store/proof.rs`). Whatever the interleaving, a flush that returned
//! must survive: after the cut, each block reads the write its thread's last returned flush
//! covered, or a later write of that thread to it — never an earlier one.
//!
//! Rerun one failing seed with `ZDISK_TEST_SEED=<seed> cargo test -p zdisk-engine --test flush`.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rand::Rng;
use zdisk_engine::sim::SimDisk;
use zdisk_engine::{Codec, Durability, OpenOptions, Store, BLOCK_SIZE};

const THREADS: u64 = 4;
/// Blocks each thread owns (its writes cycle through them).
const BLOCKS_PER_THREAD: u64 = 16;

/// Block contents naming the thread and its write number.
fn block(thread: u64, n: u64) -> Vec<u8> {
    let mut tag = [0u8; 16];
    tag[..8].copy_from_slice(&thread.to_le_bytes());
    tag[8..].copy_from_slice(&n.to_le_bytes());
    tag.iter().copied().cycle().take(BLOCK_SIZE).collect()
}

/// The (thread, write number) a block holds, if it holds one of `block`'s patterns.
fn tag_of(data: &[u8]) -> Option<(u64, u64)> {
    let thread = u64::from_le_bytes(data[..8].try_into().unwrap());
    let n = u64::from_le_bytes(data[8..16].try_into().unwrap());
    (data == block(thread, n).as_slice()).then_some((thread, n))
}

/// Writes `block(thread, n)` for n = 1, 2, ... to the thread's blocks in turn, each followed
/// by a flush; `flushed` holds the last n a returned flush covered. Stops at the first
/// error (the power cut).
fn writer(store: &Store, thread: u64, flushed: &AtomicU64) {
    for n in 1.. {
        let lba = thread * BLOCKS_PER_THREAD + n % BLOCKS_PER_THREAD;
        if store.write(lba * BLOCK_SIZE as u64, &block(thread, n), Durability::Buffered).is_err()
            || store.flush().is_err()
        {
            return;
        }
        flushed.store(n, Ordering::Release);
    }
}

/// Whether block `slot` of `thread` holds, after the cut, its last write a returned flush
/// covered (`flushed` is the thread's last such write number) or a later write of its
/// thread to it; all zero where no flush covered a write to it.
fn check_block(thread: u64, slot: u64, data: &[u8], flushed: u64) -> Result<(), String> {
    let must_have = (1..=flushed).rev().find(|n| n % BLOCKS_PER_THREAD == slot).unwrap_or(0);
    let held = match tag_of(data) {
        Some((t, n)) if t == thread && n % BLOCKS_PER_THREAD == slot => n,
        _ if data.iter().all(|&b| b == 0) => 0,
        _ => return Err(format!("thread {thread} block {slot}: neither zero nor one of its writes")),
    };
    if held < must_have {
        return Err(format!(
            "thread {thread} block {slot}: holds write {held}, but the flush after write {must_have} returned (stale)"
        ));
    }
    Ok(())
}

#[test]
fn concurrent_flushes_keep_every_acknowledged_write_across_a_power_cut() {
    for seed in seeds(6) {
        eprintln!("seed {seed}");
        let mut rng = rng(seed);
        let logical_bytes = THREADS * BLOCKS_PER_THREAD * BLOCK_SIZE as u64;
        let disk = new_disk(32, 256 << 10, logical_bytes.max(1 << 20), Codec::Lz4, seed);
        let store = Store::open_backing(disk.clone(), &test_options()).expect("open");
        let flushed: Vec<AtomicU64> = (0..THREADS).map(|_| AtomicU64::new(0)).collect();
        // The cut comes after a random number of returned flushes (so a slow machine still
        // tests something), at whatever point the threads have reached by then.
        let cut_after_flushes: u64 = rng.gen_range(1..2_000);
        let started = Instant::now();
        std::thread::scope(|scope| {
            for (thread, flushed) in flushed.iter().enumerate() {
                let store = &store;
                scope.spawn(move || writer(store, thread as u64, flushed));
            }
            let returned = || flushed.iter().map(|f| f.load(Ordering::Acquire)).sum::<u64>();
            while returned() < cut_after_flushes && started.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_micros(50));
            }
            disk.power_off();
        });
        let cut_after = started.elapsed();
        let total: u64 = flushed.iter().map(|f| f.load(Ordering::Acquire)).sum();
        drop(store);
        let disk = Arc::new(SimDisk::from_image(disk.crash_image(), rng.gen()));
        let store = Store::open_backing(disk, &test_options()).unwrap_or_else(|e| panic!("seed {seed}: reopen: {e}"));
        let image = read_all(&store);
        for thread in 0..THREADS {
            for slot in 0..BLOCKS_PER_THREAD {
                let at = ((thread * BLOCKS_PER_THREAD + slot) * BLOCK_SIZE as u64) as usize;
                let flushed = flushed[thread as usize].load(Ordering::Acquire);
                if let Err(e) = check_block(thread, slot, &image[at..at + BLOCK_SIZE], flushed) {
                    panic!("seed {seed}: {e}");
                }
            }
        }
        assert!(
            total > 0,
            "seed {seed}: no flush returned before the cut after {cut_after:?}: the test tested nothing"
        );
        eprintln!("seed {seed}: {total} flushes returned before the cut after {cut_after:?}, all kept");
    }
}

/// Writes are acknowledged from memory and written out behind; past the write-behind bound
/// a write writes the backlog out itself, so a flush never has more than that to write first.
#[test]
fn a_write_past_the_write_behind_bound_writes_the_backlog_out() {
    // 96 KiB of incompressible data: under the test segment and checkpoint interval, over
    // a 32 KiB bound. Without a bound (and without background threads) nothing is written.
    let data = block_data(&mut rng(7), 96 << 10, 100);
    for (bound_bytes, written_out) in [(0, false), (32 << 10, true)] {
        let disk = new_disk(16, 1 << 20, 4 << 20, Codec::Lz4, 1);
        let options = OpenOptions { write_behind_bytes_max: bound_bytes, ..test_options() };
        let store = Store::open_backing(disk.clone(), &options).unwrap();
        let before = disk.writes();
        store.write(0, &data, Durability::Buffered).unwrap();
        assert_eq!(disk.writes() > before, written_out, "write-behind bound {bound_bytes}");
        let mut back = vec![0u8; data.len()];
        store.read(0, &mut back).unwrap();
        assert!(back == data, "write-behind bound {bound_bytes}: read back differs");
    }
}

/// A flush whose own range is all that is unsynced writes it through and skips its sync
/// (`store/writeout.rs`); one after a write-out left earlier log bytes unsynced syncs them.
/// Either way what the flushes covered survives a power cut right after the last one.
#[test]
fn a_commit_flush_writes_through_and_one_after_a_write_out_syncs() {
    for seed in seeds(8) {
        let mut rng = rng(seed);
        let disk = new_disk(16, 1 << 20, 4 << 20, Codec::Lz4, seed);
        let options = OpenOptions { write_behind_bytes_max: 32 << 10, ..test_options() };
        let store = Store::open_backing(disk.clone(), &options).unwrap();
        let through = |store: &Store| store.stats().flushes_written_through;
        let mut expected = vec![0u8; 4 << 20];
        let mut write = |store: &Store, offset: usize, len: usize, incompressible: u32| {
            let data = block_data(&mut rng, len, incompressible);
            store.write(offset as u64, &data, Durability::Buffered).unwrap();
            expected[offset..offset + len].copy_from_slice(&data);
        };
        // The first flush of a run syncs: nothing says the log before it was synced.
        write(&store, 0, 2 * BLOCK_SIZE, 50);
        store.flush().unwrap();
        assert_eq!(through(&store), 0, "seed {seed}: the first flush after open wrote through");
        // A commit: a few writes, a flush.
        write(&store, 8 * BLOCK_SIZE, 3 * BLOCK_SIZE, 50);
        store.flush().unwrap();
        assert_eq!(through(&store), 1, "seed {seed}: a commit's flush did not write through");
        // Past the write-behind bound the write writes the backlog out, unsynced: the next
        // flush must sync it.
        write(&store, 64 * BLOCK_SIZE, 24 * BLOCK_SIZE, 100);
        store.flush().unwrap();
        assert_eq!(through(&store), 1, "seed {seed}: a flush after a write-out skipped its sync");
        write(&store, 200 * BLOCK_SIZE, BLOCK_SIZE, 0);
        store.flush().unwrap();
        assert_eq!(through(&store), 2, "seed {seed}: the commit after a synced flush did not write through");
        // Power cut now: every write above was covered by a flush that returned.
        let image = disk.crash_image();
        drop(store);
        let recovered = Store::open_backing(Arc::new(SimDisk::from_image(image, seed)), &test_options()).unwrap();
        assert!(read_all(&recovered) == expected, "seed {seed}: a flushed write did not survive the power cut");
    }
}
