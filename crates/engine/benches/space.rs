//! `cargo bench -p zdisk-engine --bench space`: write amplification versus utilisation with
//! 2:1 compressible data and uniform random 4 KiB overwrites in steady state, the worst
//! write pause, and the time to reopen after a crash with 2 GiB of logical data written.
//!
//! Runs on a real file (O_DIRECT where allowed) in `ZDISK_BENCH_DIR` (default: the system
//! temp dir). `ZDISK_BENCH_QUICK=1` runs smaller sizes. Numbers, not assertions.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use zdisk_engine::{Codec, FormatOptions, OpenOptions, Store};

/// 4 KiB that compresses about 2:1, like fio's `buffer_compress_percentage=50` with
/// `buffer_compress_chunk=4096`: half random bytes, half zeroes.
fn two_to_one_block(rng: &mut StdRng, out: &mut [u8]) {
    let half = out.len() / 2;
    rng.fill(&mut out[..half]);
    out[half..].fill(0);
}

fn bench_dir() -> tempfile::TempDir {
    match std::env::var("ZDISK_BENCH_DIR") {
        Ok(dir) => tempfile::tempdir_in(dir).unwrap(),
        Err(_) => tempfile::tempdir().unwrap(),
    }
}

/// Segment size of the write-amplification runs: `ZDISK_BENCH_SEGMENT_KIB`, default 1 MiB.
fn segment_bytes() -> u64 {
    std::env::var("ZDISK_BENCH_SEGMENT_KIB")
        .map_or(1 << 20, |kib| kib.parse::<u64>().expect("ZDISK_BENCH_SEGMENT_KIB") << 10)
}

fn wa_point(physical_bytes: u64, utilisation: f64, quick: bool) {
    let dir = bench_dir();
    let path = dir.path().join("wa.zdisk");
    // Utilisation = live bytes (stored data and metadata: what GC cannot reclaim, the
    // engine's `physical_size`) over the data area. The store is formatted with room to
    // spare and filled sequentially until the live bytes reach the target; the filled range
    // is then the working set of the random overwrites.
    let data_area = physical_bytes - (1 << 20);
    let live_target = (data_area as f64 * utilisation) as u64;
    let logical_bytes = ((data_area as f64 * utilisation * 2.5) as u64) / 4096 * 4096;
    Store::format(
        &path,
        &FormatOptions {
            physical_size_bytes: physical_bytes,
            logical_size_bytes: logical_bytes,
            codec: Codec::Lz4,
            segment_size_bytes: Some(segment_bytes()),
            force: true,
        },
    )
    .unwrap();
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    let mut rng = StdRng::seed_from_u64(utilisation.to_bits());
    let mut block = vec![0u8; 4096];
    let mut buf = vec![0u8; 64 << 10];
    let mut filled_bytes = 0;
    while filled_bytes < logical_bytes && store.stats().physical_size < live_target {
        for chunk in buf.chunks_mut(4096) {
            two_to_one_block(&mut rng, chunk);
        }
        store.write(filled_bytes, &buf, false).unwrap();
        filled_bytes += buf.len() as u64;
    }
    let blocks = filled_bytes / 4096;
    // Warm up to steady state, then measure over a second span of the same length.
    let span = if quick { blocks } else { 2 * blocks };
    let mut measure = |count: u64| -> (f64, Duration, u64) {
        let before = store.stats();
        let mut worst = Duration::ZERO;
        let mut enospc = 0;
        for _ in 0..count {
            two_to_one_block(&mut rng, &mut block);
            let lba = rng.gen_range(0..blocks);
            let started = Instant::now();
            match store.write(lba * 4096, &block, false) {
                Ok(()) => {}
                Err(e) if e.kind() == zdisk_engine::ErrorKind::NoSpace => {
                    if enospc == 0 {
                        eprintln!("    first ENOSPC: {e}; {:?}", store.stats());
                    }
                    enospc += 1
                }
                Err(e) => panic!("{e}"),
            }
            worst = worst.max(started.elapsed());
        }
        let after = store.stats();
        let host = after.host_write_bytes - before.host_write_bytes;
        let backing = after.backing_write_bytes - before.backing_write_bytes;
        let per_host = |a: u64, b: u64| (a - b) as f64 / host.max(1) as f64;
        eprintln!(
            "    per host byte: data {:.3} gc {:.3} metadata {:.3} padding {:.3}; checkpoints {}; \
             mean live of cleaned segments {:.1}%; {} of {} segments free",
            per_host(after.data_bytes, before.data_bytes),
            per_host(after.gc_bytes_moved, before.gc_bytes_moved),
            per_host(after.metadata_bytes, before.metadata_bytes),
            per_host(after.padding_bytes, before.padding_bytes),
            after.checkpoints - before.checkpoints,
            100.0 * (after.gc_bytes_moved - before.gc_bytes_moved) as f64
                / ((after.gc_segments_cleaned - before.gc_segments_cleaned).max(1) * after.segment_size_bytes) as f64,
            after.segments_free,
            after.segments_total,
        );
        (backing as f64 / host.max(1) as f64, worst, enospc)
    };
    measure(span);
    let (wa, worst, enospc) = measure(span);
    let stats = store.stats();
    println!(
        "| {:>4.0}% | {:>8.1} | {:>6.3} | {:>9.1} | {:>6.2} | {:>10} | {} |",
        utilisation * 100.0,
        filled_bytes as f64 / (1 << 20) as f64,
        wa,
        worst.as_secs_f64() * 1000.0,
        stats.comp_ratio,
        stats.gc_segments_cleaned,
        enospc
    );
    store.close().unwrap();
}

/// Padding plus metadata as a share of the physical bytes used, after a sequential fill with
/// 2:1 data in 128 KiB writes (the reviewers' fill), flushed every 64 MiB.
fn fill_overhead(logical_bytes: u64) {
    let dir = bench_dir();
    let path = dir.path().join("fill.zdisk");
    Store::format(
        &path,
        &FormatOptions {
            physical_size_bytes: logical_bytes,
            logical_size_bytes: logical_bytes,
            codec: Codec::Lz4,
            segment_size_bytes: None,
            force: true,
        },
    )
    .unwrap();
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    let mut rng = StdRng::seed_from_u64(2);
    let mut buf = vec![0u8; 128 << 10];
    for offset in (0..logical_bytes).step_by(128 << 10) {
        for chunk in buf.chunks_mut(4096) {
            two_to_one_block(&mut rng, chunk);
        }
        store.write(offset, &buf, false).unwrap();
        if offset % (64 << 20) == 0 {
            store.flush().unwrap();
        }
    }
    store.close().unwrap();
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    let s = store.stats();
    println!(
        "fill: {} MiB of 2:1 data in 128 KiB writes: comp_ratio {:.3}, backing written {} bytes, metadata {} + padding {} = {:.2}% of it",
        logical_bytes >> 20,
        s.comp_ratio,
        s.backing_write_bytes,
        s.metadata_bytes,
        s.padding_bytes,
        100.0 * (s.metadata_bytes + s.padding_bytes) as f64 / s.backing_write_bytes as f64
    );
}

fn recovery_time(logical_written_bytes: u64) {
    let dir = bench_dir();
    let path = dir.path().join("recovery.zdisk");
    let physical = logical_written_bytes * 3 / 4 + (64 << 20);
    Store::format(
        &path,
        &FormatOptions {
            physical_size_bytes: physical,
            logical_size_bytes: logical_written_bytes * 2,
            codec: Codec::Lz4,
            segment_size_bytes: None,
            force: true,
        },
    )
    .unwrap();
    let options = OpenOptions::default();
    let store = Store::open(&path, &options).unwrap();
    let mut rng = StdRng::seed_from_u64(1);
    let mut buf = vec![0u8; 1 << 20];
    let started = Instant::now();
    for offset in (0..logical_written_bytes).step_by(1 << 20) {
        for chunk in buf.chunks_mut(4096) {
            two_to_one_block(&mut rng, chunk);
        }
        store.write(offset, &buf, false).unwrap();
        if offset % (64 << 20) == 0 {
            store.flush().unwrap();
        }
    }
    store.flush().unwrap();
    let write_secs = started.elapsed().as_secs_f64();
    let stats = store.stats();
    store.abandon();
    let started = Instant::now();
    let store = Store::open(&path, &options).unwrap();
    let reopen = started.elapsed();
    let mut check = vec![0u8; 4096];
    store.read(logical_written_bytes - 4096, &mut check).unwrap();
    println!(
        "recovery: {} MiB logical written in {:.1} s ({} checkpoints, interval {} MiB); reopen after a crash took {:.3} s",
        logical_written_bytes >> 20,
        write_secs,
        stats.checkpoints,
        options.checkpoint_interval_bytes >> 20,
        reopen.as_secs_f64()
    );
    store.close().unwrap();
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("space: benchmark");
        return;
    }
    let quick = std::env::var("ZDISK_BENCH_QUICK").is_ok();
    let physical = if quick { 128u64 << 20 } else { 512 << 20 };
    println!(
        "write amplification, 2:1 data, uniform random 4 KiB overwrites, physical {} MiB, {} KiB segments",
        physical >> 20,
        segment_bytes() >> 10
    );
    println!("| util | working set MiB | WA | worst write ms | ratio | segs cleaned | ENOSPC |");
    println!("|---|---|---|---|---|---|---|");
    let points: Vec<f64> = match std::env::var("ZDISK_BENCH_UTIL") {
        Ok(list) => list
            .split(',')
            .filter(|p| !p.is_empty())
            .map(|p| p.parse().expect("ZDISK_BENCH_UTIL: comma-separated fractions"))
            .collect(),
        Err(_) => vec![0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9],
    };
    for utilisation in points {
        wa_point(physical, utilisation, quick);
    }
    fill_overhead(if quick { 256 << 20 } else { 1 << 30 });
    if std::env::var("ZDISK_BENCH_NO_RECOVERY").is_err() {
        recovery_time(if quick { 512 << 20 } else { 2 << 30 });
    }
}
