//! The "real data" mode: bytes of real files found on this machine (/usr/share, /usr/lib),
//! streamed onto the target, and an estimate of how compressible they are.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde::Serialize;

pub const ROOTS: [&str; 2] = ["/usr/share", "/usr/lib"];

/// An ordered list of real files; streaming cycles through it as often as needed.
pub struct Corpus {
    files: Vec<PathBuf>,
    pub summary: CorpusSummary,
}

#[derive(Clone, Debug, Serialize)]
pub struct CorpusSummary {
    pub roots: Vec<String>,
    pub files: usize,
    pub distinct_bytes: u64,
    /// Uncompressed / compressed size over 4 KiB chunks with LZ4 (each chunk stored raw when it
    /// does not shrink), on the first `sampled_bytes` of the stream.
    pub lz4_4k_ratio: f64,
    pub sampled_bytes: u64,
    /// fio `buffer_compress_percentage` that gives the same ratio, used for the write workloads
    /// of the real mode (fio cannot write file contents at random offsets).
    pub write_compress_pct: u32,
}

/// Collects regular files under `root` in sorted order until `budget` bytes are found.
fn walk(root: &Path, budget: u64, out: &mut Vec<PathBuf>, found: &mut u64) {
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = fs::read_dir(&dir) else { continue };
        let mut entries: Vec<_> = rd.flatten().collect();
        entries.sort_by_key(|e| e.file_name());
        // Push directories reversed so they are visited in sorted order.
        let mut subdirs = Vec::new();
        for e in entries {
            // symlink_metadata: do not follow links (loops, duplicates, /proc-like surprises).
            let Ok(md) = e.path().symlink_metadata() else { continue };
            if md.is_dir() {
                subdirs.push(e.path());
            } else if md.is_file() && md.len() > 0 {
                out.push(e.path());
                *found += md.len();
                if *found >= budget {
                    return;
                }
            }
        }
        stack.extend(subdirs.into_iter().rev());
    }
}

impl Corpus {
    /// Finds up to `want_bytes` of distinct file content (mixing the roots file by file, so the
    /// stream interleaves text, binaries, and already-compressed files).
    pub fn find(want_bytes: u64) -> Result<Corpus> {
        let per_root = want_bytes / ROOTS.len() as u64 + 1;
        let mut lists = Vec::new();
        let mut total = 0;
        for root in ROOTS {
            let (mut list, mut found) = (Vec::new(), 0);
            walk(Path::new(root), per_root, &mut list, &mut found);
            total += found;
            lists.push(list);
        }
        let mut files = Vec::new();
        let longest = lists.iter().map(Vec::len).max().unwrap_or(0);
        for i in 0..longest {
            for list in &lists {
                if let Some(p) = list.get(i) {
                    files.push(p.clone());
                }
            }
        }
        if files.is_empty() || total < (1 << 20) {
            bail!("real-data mode found only {total} bytes of files under {ROOTS:?}; need at least 1 MiB");
        }
        let mut corpus = Corpus {
            files,
            summary: CorpusSummary {
                roots: ROOTS.iter().map(|s| s.to_string()).collect(),
                files: 0,
                distinct_bytes: total,
                lz4_4k_ratio: 1.0,
                sampled_bytes: 0,
                write_compress_pct: 0,
            },
        };
        corpus.summary.files = corpus.files.len();
        corpus.estimate_ratio(want_bytes.min(256 << 20))?;
        Ok(corpus)
    }

    fn estimate_ratio(&mut self, sample: u64) -> Result<()> {
        let mut sink = RatioSink::default();
        self.stream(sample, &mut sink)?;
        let ratio = if sink.stored > 0 { sink.raw as f64 / sink.stored as f64 } else { 1.0 };
        self.summary.lz4_4k_ratio = ratio;
        self.summary.sampled_bytes = sink.raw;
        // fio's buffer_compress_percentage=p makes about p% of each chunk compressible to
        // nothing: ratio ~ 1 / (1 - p/100).
        self.summary.write_compress_pct = ((1.0 - 1.0 / ratio.max(1.0)) * 100.0).round().clamp(0.0, 95.0) as u32;
        Ok(())
    }

    /// Writes exactly `total` bytes of file content to `out`, cycling through the corpus.
    pub fn stream(&self, total: u64, out: &mut dyn Write) -> Result<()> {
        let mut left = total;
        let mut buf = vec![0u8; 1 << 20];
        let mut progressed = true;
        while left > 0 {
            if !progressed {
                bail!("real-data corpus files are unreadable");
            }
            progressed = false;
            for path in &self.files {
                let Ok(mut f) = fs::File::open(path) else { continue };
                loop {
                    let want = buf.len().min(left as usize);
                    let n = match f.read(&mut buf[..want]) {
                        Ok(0) => break,
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(_) => break,
                    };
                    out.write_all(&buf[..n])?;
                    progressed = true;
                    left -= n as u64;
                    if left == 0 {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }
}

/// Counts what 4 KiB-chunk LZ4 would store for the bytes written into it.
#[derive(Default)]
struct RatioSink {
    pending: Vec<u8>,
    raw: u64,
    stored: u64,
}

impl RatioSink {
    fn chunk(&mut self, c: &[u8]) {
        let compressed = lz4_flex::block::compress(c).len();
        self.raw += c.len() as u64;
        self.stored += compressed.min(c.len()) as u64;
    }
}

impl Write for RatioSink {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.pending.extend_from_slice(data);
        let whole = self.pending.len() / 4096 * 4096;
        let pending = std::mem::take(&mut self.pending);
        for c in pending[..whole].chunks(4096) {
            self.chunk(c);
        }
        self.pending = pending[whole..].to_vec();
        Ok(data.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
