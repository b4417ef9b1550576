//! `cargo bench -p zdisk-engine --bench codecs -- [CORPUS_FILE...]`: what each codec makes of
//! real data, 4 KiB block by 4 KiB block, and what it costs in CPU (issue 20; results and the
//! command in docs/space.md, "Codec choice").
//!
//! Corpora: the files given, or the ones `scripts/codec-corpora.sh` writes to
//! `ZDISK_CODECS_DIR` (default /var/tmp/zdisk-corpora), plus a synthetic control of random
//! (incompressible) blocks. At most `ZDISK_CODECS_MAX_MIB` (64) of a corpus is measured: a
//! seeded random sample of its blocks, in file order.
//!
//! Per codec it prints:
//! - **ratio**: logical bytes / stored bytes, where a fragment costs its 12 bytes of protection
//!   information plus what `Codec::compress_block` stores, and an all-zero block its 12 bytes
//!   alone (the store never compresses it). Record metadata (~8 bytes a block) is not counted.
//! - **CPU per block** to compress and to decompress: this thread's CPU time
//!   (/proc/thread-self/schedstat: time it ran, not time other jobs held the core) over every
//!   non-zero block, `ZDISK_CODECS_REPS` (3) passes taken round robin over the codecs so that
//!   a burst of load hits them all; min and median of the passes.
//!
//! Rows: the engine's path for LZ4, zstd -1/1/2/3 and DEFLATE 1/6 (reused per-thread
//! contexts); LZ4, zstd 1 and 3 and DEFLATE 6 behind the incompressibility estimate ("+
//! entropy test", `Codec::compress_block_with_test`: the store's write path runs it before
//! zstd and DEFLATE); and the code as it was before contexts were reused
//! ("fresh ctx": a new zstd or libdeflate context per block) for zstd 1, 3 and DEFLATE 6;
//! and zstd with a dictionary trained on the corpus as `zdisk recompress --train` trains one
//! on a store ("+ N KiB dictionary": zstd's builder on up to 1,024 of the measured non-zero
//! blocks picked evenly, `Dictionary::train`; training time printed per corpus; the blocks
//! compressed include the sample, as in a store). Every fragment is decoded and compared
//! with its block.
//!
//! Per corpus it also prints what the incompressibility estimate alone does
//! (`looks_incompressible`, which the store's write path runs before zstd and DEFLATE): its
//! CPU per block, the blocks it judges incompressible, and of those the **false raw** ones —
//! blocks zstd:1 would have stored at least `MIN_SAVING_BYTES` smaller — with the bytes they
//! cost.
//!
//! `ZDISK_CODECS_RATIO_ONLY=1`: one pass, no times (for a machine busy with other work).
//! `ZDISK_CODECS_ROWS="zstd:1,zstd:1 + entropy test"`: only the rows of these labels (and no
//! dictionary training unless one of them is a dictionary row).

use std::fmt::Write as _;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};
use std::sync::Arc;

use zdisk_engine::{decompress_block, looks_incompressible, Codec, CodecTag, Dictionary, DictionarySet};

const BLOCK: usize = 4096;
/// Protection information in front of every fragment (`format/fragment.rs`).
const PI_BYTES: u64 = 12;
const CORPUS_FILES: [&str; 4] = ["text-lines.bin", "real-files.bin", "db-tablespace.ibd", "vm-image.raw"];

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name}={v:?} does not parse")),
        Err(_) => default,
    }
}

/// CPU time this thread has run, in ns. Yielding first makes the kernel bring the running
/// thread's sum up to date (otherwise it may lag by up to a scheduler tick).
fn thread_cpu_ns() -> u64 {
    std::thread::yield_now();
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").expect("schedstat");
    stat.split_whitespace().next().and_then(|ns| ns.parse().ok()).expect("schedstat's first field")
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// How a row compresses and decompresses a block.
#[derive(Clone, Copy)]
enum Path {
    /// `Codec::compress_block`, as the store does.
    Engine,
    /// `Codec::compress_block_with_test`: incompressible-looking blocks skip the codec.
    WithTest,
    /// A fresh zstd or libdeflate context per block: the code before contexts were reused.
    FreshContext,
    /// zstd at the codec's level with a dictionary of this size trained on the corpus.
    Dictionary { size_bytes: usize },
}

struct Row {
    codec: Codec,
    path: Path,
    /// For `Path::Dictionary`: the dictionary (at the row's level), and the set decoding
    /// needs.
    dictionary: Option<(Arc<Dictionary>, DictionarySet)>,
}

impl Row {
    fn label(&self) -> String {
        match self.path {
            Path::Engine => format!("{}", self.codec),
            Path::WithTest => format!("{} + entropy test", self.codec),
            Path::FreshContext => format!("{} fresh ctx", self.codec),
            Path::Dictionary { size_bytes } => format!("{} + {} KiB dictionary", self.codec, size_bytes >> 10),
        }
    }

    fn compress(&self, block: &[u8], out: &mut Vec<u8>) -> CodecTag {
        match (self.path, self.codec) {
            (Path::Engine, codec) => codec.compress_block(block, out),
            (Path::WithTest, codec) => codec.compress_block_with_test(block, out),
            (Path::FreshContext, Codec::Zstd { level }) => {
                out.resize(8192, 0);
                let len = zstd::bulk::compress_to_buffer(block, &mut out[..], level).ok();
                fresh_decide(len, Codec::Zstd { level }, block, out)
            }
            (Path::FreshContext, Codec::Deflate { level }) => {
                let mut compressor = libdeflater::Compressor::new(libdeflater::CompressionLvl::new(level).unwrap());
                out.resize(8192, 0);
                let len = compressor.deflate_compress(block, out).ok();
                fresh_decide(len, Codec::Deflate { level }, block, out)
            }
            (Path::FreshContext, Codec::Lz4) => Codec::Lz4.compress_block(block, out),
            (Path::Dictionary { .. }, _) => self.dictionary.as_ref().expect("trained").0.compress_block(block, out),
        }
    }

    fn decompress(&self, tag: CodecTag, input: &[u8], block: &mut [u8]) {
        let len = match (self.path, tag) {
            (Path::FreshContext, CodecTag::Zstd) => zstd::bulk::decompress_to_buffer(input, block).ok(),
            (Path::FreshContext, CodecTag::Deflate) => {
                libdeflater::Decompressor::new().deflate_decompress(input, block).ok()
            }
            (Path::Dictionary { .. }, _) => {
                let set = &self.dictionary.as_ref().expect("trained").1;
                decompress_block(tag, input, block, set).ok().map(|()| BLOCK)
            }
            _ => decompress_block(tag, input, block, &zdisk_engine::NO_DICTIONARIES).ok().map(|()| BLOCK),
        };
        assert_eq!(len, Some(BLOCK), "{}: a fragment did not decode", self.label());
    }
}

/// codec.rs's rule before this change, for the fresh-context rows.
fn fresh_decide(len: Option<usize>, codec: Codec, block: &[u8], out: &mut Vec<u8>) -> CodecTag {
    match len {
        Some(len) if len + zdisk_engine::MIN_SAVING_BYTES <= BLOCK => {
            out.truncate(len);
            codec.tag()
        }
        _ => {
            out.clear();
            out.extend_from_slice(block);
            CodecTag::Raw
        }
    }
}

fn rows() -> Vec<Row> {
    let mut rows = Vec::new();
    let codecs = [
        Codec::Lz4,
        Codec::Zstd { level: -1 },
        Codec::Zstd { level: 1 },
        Codec::Zstd { level: 2 },
        Codec::Zstd { level: 3 },
        Codec::Deflate { level: 1 },
        Codec::Deflate { level: 6 },
    ];
    for codec in codecs {
        rows.push(Row { codec, path: Path::Engine, dictionary: None });
    }
    rows.push(Row { codec: Codec::Lz4, path: Path::WithTest, dictionary: None });
    for codec in [Codec::Zstd { level: 1 }, Codec::Zstd { level: 3 }, Codec::Deflate { level: 6 }] {
        rows.push(Row { codec, path: Path::WithTest, dictionary: None });
        rows.push(Row { codec, path: Path::FreshContext, dictionary: None });
    }
    rows
}

/// `ZDISK_CODECS_ROWS`: the labels of the rows to run (None: all).
fn selected_rows() -> Option<Vec<String>> {
    let labels = std::env::var("ZDISK_CODECS_ROWS").ok()?;
    Some(labels.split(',').map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect())
}

/// What the incompressibility estimate alone makes of a corpus (module comment): a line of
/// the report. `reps` timed passes (none: counts only).
fn estimate_line(corpus: &Corpus, reps: usize) -> String {
    let blocks: Vec<&[u8]> = corpus.data.chunks_exact(BLOCK).collect();
    let mut judged = 0u64;
    let (mut false_raw, mut false_raw_bytes) = (0u64, 0u64);
    let mut out = Vec::with_capacity(8192);
    let zstd1 = Codec::Zstd { level: 1 };
    for block in &blocks {
        if looks_incompressible(block) {
            judged += 1;
            if zstd1.compress_block(block, &mut out) != CodecTag::Raw {
                false_raw += 1;
                false_raw_bytes += (BLOCK - out.len()) as u64;
            }
        }
    }
    let mut ns = Vec::new();
    for _ in 0..reps {
        let start_ns = thread_cpu_ns();
        let mut sink = 0u64;
        for block in &blocks {
            sink += std::hint::black_box(looks_incompressible(std::hint::black_box(block))) as u64;
        }
        ns.push((thread_cpu_ns() - start_ns) as f64 / blocks.len().max(1) as f64);
        assert_eq!(sink, judged);
    }
    let (min, median) = min_median(&ns);
    let time = if reps == 0 { String::new() } else { format!("{min:.0} ({median:.0}) ns/block min (median); ") };
    format!(
        "entropy test alone: {time}{judged} of {} non-zero blocks judged incompressible ({:.2}%); false raw \
         (zstd:1 would have saved ≥ {} bytes): {false_raw} blocks, {false_raw_bytes} bytes ({:.3}% of zstd:1's saving)",
        blocks.len(),
        100.0 * judged as f64 / blocks.len().max(1) as f64,
        zdisk_engine::MIN_SAVING_BYTES,
        100.0 * false_raw_bytes as f64 / zstd_saving_bytes(&blocks).max(1) as f64,
    )
}

/// The bytes zstd:1 saves on `blocks` (raw ones save none).
fn zstd_saving_bytes(blocks: &[&[u8]]) -> u64 {
    let mut out = Vec::with_capacity(8192);
    let mut saving = 0;
    for block in blocks {
        Codec::Zstd { level: 1 }.compress_block(block, &mut out);
        saving += (BLOCK - out.len()) as u64;
    }
    saving
}

/// The dictionary rows of one corpus (sizes and levels: docs/space.md, "Trained
/// dictionaries"), each trained on the corpus; the training times, for the report.
fn dictionary_rows(corpus: &Corpus) -> (Vec<Row>, String) {
    let blocks: Vec<&[u8]> = corpus.data.chunks_exact(BLOCK).collect();
    let step = blocks.len().div_ceil(1024).max(1);
    let samples: Vec<Vec<u8>> = blocks.iter().step_by(step).map(|b| b.to_vec()).collect();
    let (mut rows, mut times) = (Vec::new(), String::new());
    for size_bytes in [16 << 10, 64 << 10, 112 << 10] {
        let started = std::time::Instant::now();
        let trained = match Dictionary::train(&samples, 1, 3, size_bytes) {
            Ok(trained) => trained,
            Err(e) => {
                let _ = write!(times, "{} KiB: {e}; ", size_bytes >> 10);
                continue;
            }
        };
        let _ = write!(
            times,
            "{} KiB ({} bytes) on {} blocks in {} ms; ",
            size_bytes >> 10,
            trained.bytes.len(),
            samples.len(),
            started.elapsed().as_millis()
        );
        let levels: &[i32] = match size_bytes >> 10 {
            64 => &[1, 3, 6, 9, 19],
            112 => &[3, 6],
            _ => &[3],
        };
        for &level in levels {
            let dictionary = Arc::new(Dictionary::new(1, level, trained.bytes.clone()).expect("just trained"));
            let set = DictionarySet::new(vec![Arc::clone(&dictionary)]);
            rows.push(Row {
                codec: Codec::Zstd { level },
                path: Path::Dictionary { size_bytes },
                dictionary: Some((dictionary, set)),
            });
        }
    }
    (rows, times)
}

struct Corpus {
    name: String,
    /// Measured blocks, zero blocks included (they count in the ratio at 12 bytes each).
    measured_blocks: u64,
    zero_blocks: u64,
    /// The non-zero measured blocks, back to back.
    data: Vec<u8>,
}

/// At most `max_blocks` blocks of `path` (a seeded random sample, read in file order).
fn load(path: &std::path::Path, max_blocks: usize, seed: u64) -> Corpus {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let total_blocks = (file.metadata().expect("metadata").len() as usize) / BLOCK;
    let mut picked: Vec<usize> = (0..total_blocks).collect();
    if max_blocks > 0 && total_blocks > max_blocks {
        picked.shuffle(&mut StdRng::seed_from_u64(seed));
        picked.truncate(max_blocks);
        picked.sort_unstable();
    }
    let (mut data, mut zero_blocks) = (Vec::with_capacity(picked.len() * BLOCK), 0);
    let mut block = vec![0u8; BLOCK];
    for &i in &picked {
        file.read_exact_at(&mut block, (i * BLOCK) as u64).expect("read");
        if block.iter().all(|&b| b == 0) {
            zero_blocks += 1;
        } else {
            data.extend_from_slice(&block);
        }
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Corpus { name, measured_blocks: picked.len() as u64, zero_blocks, data }
}

fn random_corpus(blocks: usize, seed: u64) -> Corpus {
    let mut data = vec![0u8; blocks * BLOCK];
    StdRng::seed_from_u64(seed).fill_bytes(&mut data);
    Corpus { name: format!("random (synthetic, seed {seed})"), measured_blocks: blocks as u64, zero_blocks: 0, data }
}

/// One row's results on one corpus.
#[derive(Default)]
struct Measured {
    stored_bytes: u64,
    raw_blocks: u64,
    compress_ns: Vec<f64>,
    decompress_ns: Vec<f64>,
}

/// One pass of `row` over the corpus: compresses every block, then decodes and checks every
/// fragment. Returns (stored bytes, raw blocks, compress ns, decompress ns) for the pass.
fn pass(row: &Row, corpus: &Corpus) -> (u64, u64, u64, u64) {
    let blocks = corpus.data.len() / BLOCK;
    let mut arena = Vec::with_capacity(corpus.data.len() + blocks * 64);
    let mut fragments: Vec<(usize, usize, CodecTag)> = Vec::with_capacity(blocks);
    let mut out = Vec::with_capacity(8192);
    let start_ns = thread_cpu_ns();
    for block in corpus.data.chunks_exact(BLOCK) {
        let tag = row.compress(block, &mut out);
        fragments.push((arena.len(), out.len(), tag));
        arena.extend_from_slice(&out);
    }
    let compress_ns = thread_cpu_ns() - start_ns;
    let mut block = vec![0u8; BLOCK];
    let start_ns = thread_cpu_ns();
    for &(offset, len, tag) in &fragments {
        row.decompress(tag, &arena[offset..offset + len], &mut block);
    }
    let decompress_ns = thread_cpu_ns() - start_ns;
    for (i, &(offset, len, tag)) in fragments.iter().enumerate() {
        row.decompress(tag, &arena[offset..offset + len], &mut block);
        assert!(block[..] == corpus.data[i * BLOCK..(i + 1) * BLOCK], "{}: block {i} differs", row.label());
    }
    let raw_blocks = fragments.iter().filter(|f| f.2 == CodecTag::Raw).count() as u64;
    let stored_bytes = arena.len() as u64 + PI_BYTES * corpus.measured_blocks;
    (stored_bytes, raw_blocks, compress_ns, decompress_ns)
}

fn min_median(v: &[f64]) -> (f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    (s.first().copied().unwrap_or(f64::NAN), s.get(s.len() / 2).copied().unwrap_or(f64::NAN))
}

fn report(corpus: &Corpus, rows: &[Row], results: &[Measured], timed: bool, md: &mut String) {
    let nonzero = (corpus.data.len() / BLOCK) as u64;
    let _ = writeln!(
        md,
        "\n### {}\n\n{} blocks measured, {} all-zero ({:.1}%). Load after: {}.\n",
        corpus.name,
        corpus.measured_blocks,
        corpus.zero_blocks,
        100.0 * corpus.zero_blocks as f64 / corpus.measured_blocks.max(1) as f64,
        loadavg()
    );
    let _ = writeln!(md, "| codec | ratio | raw blocks | compress ns/block min (median) | MB/s per core | decompress ns/block min (median) | decompress MB/s per core | CPU s per GiB written |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|");
    for (row, m) in rows.iter().zip(results) {
        let ratio = (corpus.measured_blocks * BLOCK as u64) as f64 / m.stored_bytes as f64;
        let raw_share = 100.0 * m.raw_blocks as f64 / nonzero.max(1) as f64;
        let (c_min, c_med) = min_median(&m.compress_ns);
        let (d_min, d_med) = min_median(&m.decompress_ns);
        if !timed {
            let _ = writeln!(md, "| {} | {ratio:.3} | {raw_share:.1}% | | | | | |", row.label());
            continue;
        }
        // Per GiB of logical data written: non-zero blocks only cost compression.
        let blocks_per_gib = nonzero as f64 / corpus.measured_blocks as f64 * (1u64 << 30) as f64 / BLOCK as f64;
        let _ = writeln!(
            md,
            "| {} | {ratio:.3} | {raw_share:.1}% | {c_min:.0} ({c_med:.0}) | {:.0} | {d_min:.0} ({d_med:.0}) | {:.0} | {:.2} |",
            row.label(),
            BLOCK as f64 / c_min * 1e3,
            BLOCK as f64 / d_min * 1e3,
            c_min * blocks_per_gib / 1e9,
        );
    }
}

fn main() {
    let timed = std::env::var("ZDISK_CODECS_RATIO_ONLY").is_err();
    let reps = if timed { env_or("ZDISK_CODECS_REPS", 3usize) } else { 1 };
    let seed = env_or("ZDISK_CODECS_SEED", 20u64);
    let max_blocks = env_or("ZDISK_CODECS_MAX_MIB", 64usize) * 256;
    let dir = PathBuf::from(env_or("ZDISK_CODECS_DIR", "/var/tmp/zdisk-corpora".to_string()));
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let paths: Vec<PathBuf> = if args.is_empty() {
        CORPUS_FILES.iter().map(|f| dir.join(f)).filter(|p| p.exists()).collect()
    } else {
        args.iter().map(PathBuf::from).collect()
    };
    let mut corpora: Vec<Corpus> = paths.iter().map(|p| load(p, max_blocks, seed)).collect();
    corpora.push(random_corpus(4096, seed));
    let mut md = format!(
        "# codecs: {reps} pass(es), at most {} MiB per corpus, seed {seed}{}; load {}\n",
        max_blocks / 256,
        if timed { "" } else { ", ratios only" },
        loadavg()
    );
    let selected = selected_rows();
    let wants_dictionaries = selected.as_ref().is_none_or(|labels| labels.iter().any(|l| l.contains("dictionary")));
    for corpus in &corpora {
        let (dictionary_rows, training) =
            if wants_dictionaries { dictionary_rows(corpus) } else { (Vec::new(), "not trained".to_string()) };
        md.push_str(&format!("\n{}: dictionaries {training}\n", corpus.name));
        md.push_str(&format!("\n{}: {}\n", corpus.name, estimate_line(corpus, if timed { reps } else { 0 })));
        let rows: Vec<Row> = rows()
            .into_iter()
            .chain(dictionary_rows)
            .filter(|row| selected.as_ref().is_none_or(|labels| labels.contains(&row.label())))
            .collect();
        let mut results: Vec<Measured> = rows.iter().map(|_| Measured::default()).collect();
        for _ in 0..reps {
            for (row, m) in rows.iter().zip(results.iter_mut()) {
                let (stored_bytes, raw_blocks, c_ns, d_ns) = pass(row, corpus);
                let blocks = (corpus.data.len() / BLOCK).max(1) as f64;
                *m = Measured {
                    stored_bytes,
                    raw_blocks,
                    compress_ns: [&m.compress_ns[..], &[c_ns as f64 / blocks]].concat(),
                    decompress_ns: [&m.decompress_ns[..], &[d_ns as f64 / blocks]].concat(),
                };
            }
        }
        report(corpus, &rows, &results, timed, &mut md);
        eprintln!("{} done", corpus.name);
    }
    print!("{md}");
}
