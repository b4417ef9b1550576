//! `cargo bench -p zdisk-engine --bench space`: write amplification versus utilisation with
//! 2:1 compressible data and random 4 KiB overwrites in steady state (uniform, and the
//! skewed zipf:1.2 and 80/20 at 80%), the worst write pause; stores at native capacity full
//! of incompressible data with several over-provisioning settings (write amplification and
//! latency percentiles); and the time to reopen after a crash with 2 GiB of logical data
//! written.
//!
//! Runs on a real file (O_DIRECT where allowed) in `ZDISK_BENCH_DIR` (default: the system
//! temp dir). `ZDISK_BENCH_QUICK=1` runs smaller sizes; `ZDISK_BENCH_UTIL=0.5,0.8`,
//! `ZDISK_BENCH_PATTERNS=uniform,zipf:1.2,80/20` (empty: none) and `ZDISK_BENCH_OP=7,28`
//! choose the points. Numbers, not assertions.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use zdisk_engine::{Codec, Durability, FormatOptions, OpenOptions, Store};

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

/// Which blocks the steady-state overwrites hit.
#[derive(Clone, Copy)]
enum Pattern {
    Uniform,
    /// fio's `random_distribution=zipf:THETA`: rank r is hit in proportion to 1/r^theta,
    /// ranks scattered over the blocks.
    Zipf(f64),
    /// 80% of the writes to a fixed 20% of the blocks, scattered.
    HotCold,
}

impl Pattern {
    fn name(self) -> String {
        match self {
            Pattern::Uniform => "uniform".into(),
            Pattern::Zipf(theta) => format!("zipf:{theta}"),
            Pattern::HotCold => "80/20".into(),
        }
    }
}

/// Draws block numbers in `0..blocks` following a pattern.
struct Picker {
    pattern: Pattern,
    blocks: u64,
    /// Rank to block (a random permutation), for the skewed patterns.
    scatter: Vec<u64>,
    /// Zipf's cumulative weights by rank.
    cumulative: Vec<f64>,
}

impl Picker {
    fn new(pattern: Pattern, blocks: u64, rng: &mut StdRng) -> Picker {
        let mut scatter: Vec<u64> = (0..blocks).collect();
        rand::seq::SliceRandom::shuffle(&mut scatter[..], rng);
        let mut cumulative = Vec::new();
        if let Pattern::Zipf(theta) = pattern {
            let mut sum = 0.0;
            for rank in 1..=blocks {
                sum += 1.0 / (rank as f64).powf(theta);
                cumulative.push(sum);
            }
        }
        Picker { pattern, blocks, scatter, cumulative }
    }

    fn pick(&self, rng: &mut StdRng) -> u64 {
        match self.pattern {
            Pattern::Uniform => rng.gen_range(0..self.blocks),
            Pattern::Zipf(_) => {
                let x = rng.gen::<f64>() * self.cumulative.last().unwrap();
                let rank = self.cumulative.partition_point(|&c| c < x).min(self.blocks as usize - 1);
                self.scatter[rank]
            }
            Pattern::HotCold => {
                let hot = (self.blocks / 5).max(1);
                let rank = if rng.gen_bool(0.8) { rng.gen_range(0..hot) } else { rng.gen_range(hot..self.blocks) };
                self.scatter[rank as usize]
            }
        }
    }
}

/// What one span of overwrites cost.
struct Span {
    write_amplification: f64,
    worst: Duration,
    p999: Duration,
    median: Duration,
    enospc: u64,
}

/// `count` single-block overwrites, one at a time, drawn by `picker`, each filled by `fill`.
fn overwrite_span(
    store: &Store,
    rng: &mut StdRng,
    picker: &Picker,
    count: u64,
    fill: fn(&mut StdRng, &mut [u8]),
) -> Span {
    let before = store.stats();
    let mut block = vec![0u8; 4096];
    let mut latencies = Vec::with_capacity(count as usize);
    let mut enospc = 0;
    for _ in 0..count {
        fill(rng, &mut block);
        let lba = picker.pick(rng);
        let started = Instant::now();
        match store.write(lba * 4096, &block, Durability::Buffered) {
            Ok(()) => {}
            Err(e) if e.kind() == zdisk_engine::ErrorKind::NoSpace => {
                if enospc == 0 {
                    eprintln!("    first ENOSPC: {e}; {:?}", store.stats());
                }
                enospc += 1
            }
            Err(e) => panic!("{e}"),
        }
        latencies.push(started.elapsed());
    }
    let after = store.stats();
    let host = after.host_write_bytes - before.host_write_bytes;
    let backing = after.backing_write_bytes - before.backing_write_bytes;
    let per_host = |a: u64, b: u64| (a - b) as f64 / host.max(1) as f64;
    eprintln!(
        "    per host byte: data {:.3} gc {:.3} metadata {:.3} (map pages {:.3}) padding {:.3}; checkpoints {}; \
         mean live of cleaned segments {:.1}%; {} of {} segments free",
        per_host(after.data_bytes, before.data_bytes),
        per_host(after.gc_bytes_moved, before.gc_bytes_moved),
        per_host(after.metadata_bytes, before.metadata_bytes),
        per_host(after.map_write_bytes, before.map_write_bytes),
        per_host(after.padding_bytes, before.padding_bytes),
        after.checkpoints - before.checkpoints,
        100.0 * (after.gc_bytes_moved - before.gc_bytes_moved) as f64
            / ((after.gc_segments_cleaned - before.gc_segments_cleaned).max(1) * after.segment_size_bytes) as f64,
        after.segments_free,
        after.segments_total,
    );
    latencies.sort_unstable();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    Span {
        write_amplification: backing as f64 / host.max(1) as f64,
        worst: *latencies.last().unwrap(),
        p999: at(0.999),
        median: at(0.5),
        enospc,
    }
}

fn incompressible_block(rng: &mut StdRng, out: &mut [u8]) {
    rng.fill(out);
}

fn format_store(path: &std::path::Path, physical_bytes: u64, logical_bytes: u64, over_provision_ppm: u32) -> Store {
    Store::format(
        path,
        &FormatOptions {
            physical_size_bytes: physical_bytes,
            logical_size_bytes: logical_bytes,
            codec: Codec::Lz4,
            segment_size_bytes: Some(segment_bytes()),
            force: true,
            over_provision_ppm,
            encryption: None,
            allocation: zdisk_engine::Allocation::Sparse,
        },
    )
    .unwrap();
    Store::open(path, &OpenOptions::default()).unwrap()
}

/// Write amplification at a utilisation (2:1 data) under a write pattern.
fn wa_point(physical_bytes: u64, utilisation: f64, pattern: Pattern, quick: bool) {
    let dir = bench_dir();
    let path = dir.path().join("wa.zdisk");
    // Utilisation = live bytes (stored data and metadata: what GC cannot reclaim, the
    // engine's `physical_size`) over the data area. The store is formatted with room to
    // spare and filled sequentially until the live bytes reach the target; the filled range
    // is then the working set of the random overwrites.
    let data_area = physical_bytes - (1 << 20);
    let live_target = (data_area as f64 * utilisation) as u64;
    let logical_bytes = ((data_area as f64 * utilisation * 2.5) as u64) / 4096 * 4096;
    let store = format_store(&path, physical_bytes, logical_bytes, zdisk_engine::OVER_PROVISION_DEFAULT_PPM);
    let mut rng = StdRng::seed_from_u64(utilisation.to_bits());
    let mut buf = vec![0u8; 64 << 10];
    let mut filled_bytes = 0;
    while filled_bytes < logical_bytes && store.stats().physical_size < live_target {
        for chunk in buf.chunks_mut(4096) {
            two_to_one_block(&mut rng, chunk);
        }
        store.write(filled_bytes, &buf, Durability::Buffered).unwrap();
        filled_bytes += buf.len() as u64;
    }
    let blocks = filled_bytes / 4096;
    let picker = Picker::new(pattern, blocks, &mut rng);
    // Warm up to steady state, then measure over a second span of the same length.
    let span = if quick { blocks } else { 2 * blocks };
    overwrite_span(&store, &mut rng, &picker, span, two_to_one_block);
    let m = overwrite_span(&store, &mut rng, &picker, span, two_to_one_block);
    let stats = store.stats();
    println!(
        "| {:>4.0}% | {} | {:>8.1} | {:>6.3} | {:>9.1} | {:>6.2} | {:>10} | {} |",
        utilisation * 100.0,
        pattern.name(),
        filled_bytes as f64 / (1 << 20) as f64,
        m.write_amplification,
        m.worst.as_secs_f64() * 1000.0,
        stats.comp_ratio,
        stats.gc_segments_cleaned,
        m.enospc
    );
    // GC works against the space not held free. This store holds a few percent of its
    // segments free (reserves and the pacing band, whose sizes do not grow with the store);
    // a 4 TiB store of 4 MiB segments holds ~0.02% (docs/space.md, "At a drive's scale").
    // So this run's GC is what a drive does at a slightly higher utilisation.
    let held = stats.segments_free as f64 / stats.segments_total as f64;
    eprintln!(
        "    {} of {} segments free at the end ({:.1}%): this run's GC is a 4 TiB store's at {:.1}% utilisation",
        stats.segments_free,
        stats.segments_total,
        held * 100.0,
        utilisation / (1.0 - held) * (1.0 - DRIVE_HELD_FREE_SHARE) * 100.0
    );
    store.close().unwrap();
}

/// The share of a 4 TiB store (4 MiB segments) held free: 2S + 2C + the pacing band, ~0.95
/// GB (docs/space.md, "At a drive's scale").
const DRIVE_HELD_FREE_SHARE: f64 = 0.95e9 / (4u64 << 40) as f64;

/// A store at native capacity (`1x`) with an over-provisioning, filled completely with
/// incompressible data in 128 KiB writes, then overwritten in uniform random 4 KiB writes:
/// twice the store's size to reach steady state, then once more, measured.
fn native_point(physical_bytes: u64, over_provision_ppm: u32) {
    let dir = bench_dir();
    let path = dir.path().join("native.zdisk");
    let native = zdisk_engine::native_capacity_of_physical(
        physical_bytes,
        Some(segment_bytes()),
        over_provision_ppm,
        zdisk_engine::Sealing::Plain,
    );
    let store = format_store(&path, physical_bytes, native, over_provision_ppm);
    let mut rng = StdRng::seed_from_u64(over_provision_ppm as u64);
    let mut buf = vec![0u8; 128 << 10];
    for offset in (0..native).step_by(buf.len()) {
        let len = buf.len().min((native - offset) as usize);
        rng.fill(&mut buf[..len]);
        store.write(offset, &buf[..len], Durability::Buffered).unwrap();
    }
    let blocks = native / 4096;
    let picker = Picker::new(Pattern::Uniform, blocks, &mut rng);
    overwrite_span(&store, &mut rng, &picker, 2 * blocks, incompressible_block);
    let m = overwrite_span(&store, &mut rng, &picker, blocks, incompressible_block);
    println!(
        "| {:>4.1}% | {:>8.1} | {:>5.1}% | {:>6.3} | {:>7.3} | {:>7.2} | {:>9.1} | {} |",
        over_provision_ppm as f64 / 10_000.0,
        native as f64 / (1 << 20) as f64,
        100.0 * native as f64 / physical_bytes as f64,
        m.write_amplification,
        m.median.as_secs_f64() * 1000.0,
        m.p999.as_secs_f64() * 1000.0,
        m.worst.as_secs_f64() * 1000.0,
        m.enospc
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
            over_provision_ppm: zdisk_engine::OVER_PROVISION_DEFAULT_PPM,
            encryption: None,
            allocation: zdisk_engine::Allocation::Sparse,
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
        store.write(offset, &buf, Durability::Buffered).unwrap();
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
            over_provision_ppm: zdisk_engine::OVER_PROVISION_DEFAULT_PPM,
            encryption: None,
            allocation: zdisk_engine::Allocation::Sparse,
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
        store.write(offset, &buf, Durability::Buffered).unwrap();
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

impl std::str::FromStr for Pattern {
    type Err = String;
    fn from_str(text: &str) -> Result<Pattern, String> {
        match text {
            "uniform" => Ok(Pattern::Uniform),
            "80/20" => Ok(Pattern::HotCold),
            zipf => zipf.strip_prefix("zipf:").and_then(|t| t.parse().ok()).map(Pattern::Zipf).ok_or(text.to_string()),
        }
    }
}

/// A comma-separated list from the environment (empty: none), or None when unset.
fn env_list<T: std::str::FromStr>(name: &str, expected: &str) -> Option<Vec<T>> {
    let list = std::env::var(name).ok()?;
    let parse = |item: &str| item.parse().unwrap_or_else(|_| panic!("{name}: {item:?} is not one of: {expected}"));
    Some(list.split(',').filter(|item| !item.is_empty()).map(parse).collect())
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
    println!("| util | pattern | working set MiB | WA | worst write ms | ratio | segs cleaned | ENOSPC |");
    println!("|---|---|---|---|---|---|---|---|");
    let points: Vec<f64> = env_list("ZDISK_BENCH_UTIL", "comma-separated fractions")
        .unwrap_or_else(|| vec![0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9]);
    let patterns: Vec<Pattern> =
        env_list("ZDISK_BENCH_PATTERNS", "uniform, 80/20, zipf:THETA").unwrap_or_else(|| vec![Pattern::Uniform]);
    for utilisation in &points {
        for &pattern in &patterns {
            wa_point(physical, *utilisation, pattern, quick);
        }
    }
    // Skewed writes, the common case for databases, at 80%.
    if std::env::var("ZDISK_BENCH_PATTERNS").is_err() {
        for pattern in [Pattern::Zipf(1.2), Pattern::HotCold] {
            wa_point(physical, 0.8, pattern, quick);
        }
    }
    println!();
    println!(
        "native capacity (1x), incompressible data: sequential fill to 100%, then uniform random 4 KiB overwrites (2x the size to steady state, 1x measured)"
    );
    println!("| OP | native MiB | of physical | WA | median ms | p99.9 ms | worst ms | ENOSPC |");
    println!("|---|---|---|---|---|---|---|---|");
    let ops: Vec<u32> = env_list::<f64>("ZDISK_BENCH_OP", "percentages")
        .map(|percents| {
            percents.into_iter().map(|p| zdisk_engine::over_provision_ppm_from_percent(p).unwrap()).collect()
        })
        .unwrap_or_else(|| vec![70_000, 100_000, 150_000, 280_000]);
    for op in ops {
        native_point(physical, op);
    }
    fill_overhead(if quick { 256 << 20 } else { 1 << 30 });
    if std::env::var("ZDISK_BENCH_NO_RECOVERY").is_err() {
        recovery_time(if quick { 512 << 20 } else { 2 << 30 });
    }
}
