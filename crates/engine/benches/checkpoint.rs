//! `cargo bench -p zdisk-engine --bench checkpoint`: what a checkpoint costs (time, map-page
//! bytes, image bytes) against how much data is mapped, and what opening costs.
//!
//! For each size in `ZDISK_BENCH_MAPPED_GIB` (default `1,64`) it formats a sparse file with a
//! 16 TiB logical size, fills the first N GiB sequentially, takes a checkpoint, then dirties
//! leaf pages by writing one block in each (every leaf, or 16,000 of them: below the dirty-page
//! count at which the engine checkpoints by itself) and times the checkpoint that writes them;
//! then a checkpoint with nothing dirty, then close and reopen.
//!
//! Blocks hold `ZDISK_BENCH_RANDOM_BYTES` random bytes (default 2048: 2:1 data) and zeroes;
//! fewer random bytes make big sizes cheap on disk, and change the map only in how well its
//! pages compress (fragment offsets step by the compressed size). Runs in `ZDISK_BENCH_DIR`
//! (default: the system temp dir). Numbers, not assertions.

use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use zdisk_engine::{Codec, Durability, FormatOptions, OpenOptions, Store};

const GIB: u64 = 1 << 30;
const LEAF_SPAN_BYTES: u64 = 512 * 4096;
/// Stays below the map's soft limit of dirty pages (16,384), at which the background worker
/// checkpoints on its own and the measured checkpoint would write only the rest.
const DIRTY_LEAVES_MAX: u64 = 16_000;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn fill_block(rng: &mut StdRng, random_bytes: usize, out: &mut [u8]) {
    rng.fill(&mut out[..random_bytes]);
    out[random_bytes..].fill(0);
}

fn point(dir: &std::path::Path, mapped_bytes: u64, random_bytes: usize) {
    let path = dir.join("checkpoint.zdisk");
    let per_block_bytes = random_bytes as u64 + 256;
    let physical_bytes = ((mapped_bytes / 4096 * per_block_bytes) * 3 / 2 + GIB).next_multiple_of(GIB);
    Store::format(
        &path,
        &FormatOptions {
            physical_size_bytes: physical_bytes,
            logical_size_bytes: 16 << 40,
            codec: Codec::Lz4,
            segment_size_bytes: None,
            force: true,
            over_provision_ppm: zdisk_engine::OVER_PROVISION_DEFAULT_PPM,
            encryption: None,
            allocation: zdisk_engine::Allocation::Sparse,
        },
    )
    .unwrap();
    let options = OpenOptions::default();
    let store = Store::open(&path, &options).unwrap();
    let mut rng = StdRng::seed_from_u64(mapped_bytes);
    let mut buf = vec![0u8; 1 << 20];
    let started = Instant::now();
    for offset in (0..mapped_bytes).step_by(buf.len()) {
        for block in buf.chunks_mut(4096) {
            fill_block(&mut rng, random_bytes, block);
        }
        store.write(offset, &buf, Durability::Buffered).unwrap();
        if offset % (8 * GIB) == 0 && offset > 0 {
            eprintln!("  filled {} GiB in {:.0} s", offset / GIB, started.elapsed().as_secs_f64());
        }
    }
    store.flush().unwrap();
    let fill_secs = started.elapsed().as_secs_f64();
    store.checkpoint().unwrap();

    let leaves = mapped_bytes.div_ceil(LEAF_SPAN_BYTES);
    let dirty = leaves.min(DIRTY_LEAVES_MAX);
    let mut block = vec![0u8; 4096];
    for i in 0..dirty {
        let leaf = i * leaves / dirty;
        fill_block(&mut rng, random_bytes, &mut block);
        let lba = leaf * 512 + rng.gen_range(0..512u64.min(mapped_bytes / 4096 - leaf * 512));
        store.write(lba * 4096, &block, Durability::Buffered).unwrap();
    }
    store.flush().unwrap();
    let before = store.stats();
    let started = Instant::now();
    store.checkpoint().unwrap();
    let dirty_secs = started.elapsed().as_secs_f64();
    let after = store.stats();
    let page_bytes = after.map_write_bytes - before.map_write_bytes;
    let metadata_bytes = after.metadata_bytes - before.metadata_bytes;
    let written_bytes = after.backing_write_bytes - before.backing_write_bytes;

    let started = Instant::now();
    store.checkpoint().unwrap();
    let idle_secs = started.elapsed().as_secs_f64();
    let idle_bytes = store.stats().backing_write_bytes - after.backing_write_bytes;
    let map_bytes = store.stats().map_page_bytes;
    store.close().unwrap();
    let started = Instant::now();
    let reopened = Store::open(&path, &options).unwrap();
    let open_secs = started.elapsed().as_secs_f64();
    let map_rss = reopened.stats().map_cache_bytes;
    reopened.close().unwrap();
    println!(
        "| {} GiB | {leaves} | {fill_secs:.0} s | {dirty} | {:.3} s | {:.1} µs | {} KiB | {:.0} B | {} KiB | {} KiB | {:.3} s, {} KiB | {:.3} s, map cache {} KiB | {} KiB |",
        mapped_bytes / GIB,
        dirty_secs,
        dirty_secs * 1e6 / dirty as f64,
        page_bytes >> 10,
        page_bytes as f64 / dirty as f64,
        metadata_bytes >> 10,
        written_bytes >> 10,
        idle_secs,
        idle_bytes >> 10,
        open_secs,
        map_rss >> 10,
        map_bytes >> 10,
    );
    std::fs::remove_file(&path).unwrap();
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let dir = match std::env::var("ZDISK_BENCH_DIR") {
        Ok(dir) => tempfile::tempdir_in(dir).unwrap(),
        Err(_) => tempfile::tempdir().unwrap(),
    };
    let random_bytes: usize = env_or("ZDISK_BENCH_RANDOM_BYTES", "2048").parse().expect("ZDISK_BENCH_RANDOM_BYTES");
    assert!(random_bytes <= 4096, "ZDISK_BENCH_RANDOM_BYTES is at most 4096");
    println!("blocks of {random_bytes} random bytes and zeroes; 16 TiB logical; default options\n");
    println!(
        "| mapped | leaves | fill | leaves dirtied | checkpoint | per leaf | map pages written | per leaf | metadata written | backing written | checkpoint, nothing dirty | reopen | map on disk |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for gib in env_or("ZDISK_BENCH_MAPPED_GIB", "1,64").split(',') {
        let gib: u64 = gib.trim().parse().expect("ZDISK_BENCH_MAPPED_GIB: GiB,GiB,...");
        point(dir.path(), gib * GIB, random_bytes);
    }
}
