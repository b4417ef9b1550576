//! The text that fills the modified schema's two text columns, and the offline measurement of
//! what LZ4, zstd and DEFLATE make of the database files' 4 KiB blocks.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde::Serialize;

/// Real English prose and notes from every Debian system: the license texts and the packages'
/// copyright files (the whitepaper used random lines of Project Gutenberg books, which cannot be
/// downloaded here). Lines of 30–200 characters, quotes and backslashes removed (they go into
/// SQL literals), de-duplicated, in a fixed order.
pub fn write_text_lines(out: &Path) -> Result<usize> {
    let mut files: Vec<PathBuf> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/usr/share/common-licenses") {
        files.extend(entries.flatten().map(|e| e.path()));
    }
    if let Ok(entries) = std::fs::read_dir("/usr/share/doc") {
        files.extend(entries.flatten().map(|e| e.path().join("copyright")));
    }
    files.sort();
    let mut lines: Vec<String> = Vec::new();
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else { continue };
        for l in text.lines() {
            let l: String = l.trim().chars().filter(|c| !matches!(c, '\'' | '\\' | '"') && !c.is_control()).collect();
            if (30..=200).contains(&l.len()) && l.is_ascii() {
                lines.push(l);
            }
        }
    }
    lines.sort();
    lines.dedup();
    if lines.len() < 1000 {
        bail!(
            "found only {} lines of text under /usr/share/common-licenses and /usr/share/doc/*/copyright; \
             the modified schema needs real text (install base-files/any documented packages)",
            lines.len()
        );
    }
    // A fixed shuffle, so neighbouring rows do not get alphabetically similar lines.
    let n = lines.len();
    let mut order: Vec<usize> = (0..n).collect();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let text: String = order.iter().map(|&i| format!("{}\n", lines[i])).collect();
    std::fs::write(out, text)?;
    Ok(n)
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct OfflineRatios {
    pub files: usize,
    pub bytes: u64,
    pub blocks: u64,
    pub zero_blocks: u64,
    /// Logical bytes of non-zero blocks / their compressed bytes (a block that does not shrink
    /// counts 4096), per codec — the ratio a per-4-KiB-block compressor reaches before its own
    /// metadata.
    pub lz4: f64,
    pub zstd1: f64,
    pub deflate6: f64,
}

/// Compresses every 4 KiB block of `files` on its own with LZ4, zstd level 1 and DEFLATE level 6.
pub fn offline_ratios(files: &[PathBuf]) -> Result<OfflineRatios> {
    let mut r = OfflineRatios { files: files.len(), ..Default::default() };
    let (mut lz4, mut zstd1, mut deflate6) = (0u64, 0u64, 0u64);
    let mut zc = zstd::bulk::Compressor::new(1)?;
    let mut dc = libdeflater::Compressor::new(libdeflater::CompressionLvl::new(6).expect("level 6"));
    let mut out = vec![0u8; 8192];
    for f in files {
        let mut file = std::fs::File::open(f)?;
        let mut block = vec![0u8; 4096];
        loop {
            let mut got = 0;
            while got < 4096 {
                let n = file.read(&mut block[got..])?;
                if n == 0 {
                    break;
                }
                got += n;
            }
            if got == 0 {
                break;
            }
            block[got..].fill(0);
            r.blocks += 1;
            r.bytes += got as u64;
            if block.iter().all(|&b| b == 0) {
                r.zero_blocks += 1;
                continue;
            }
            lz4 += (lz4_flex::block::compress(&block).len() as u64).min(4096);
            zstd1 += (zc.compress(&block)?.len() as u64).min(4096);
            let n = dc.deflate_compress(&block, &mut out).unwrap_or(4096);
            deflate6 += (n as u64).min(4096);
            if got < 4096 {
                break;
            }
        }
    }
    let logical = (r.blocks - r.zero_blocks) as f64 * 4096.0;
    let ratio = |c: u64| if c > 0 { logical / c as f64 } else { 0.0 };
    r.lz4 = ratio(lz4);
    r.zstd1 = ratio(zstd1);
    r.deflate6 = ratio(deflate6);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offline_ratios_tell_text_from_random_and_skip_zero_blocks() {
        let dir = std::env::temp_dir().join(format!("zdisk-apps-corpus-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = dir.join("text");
        let words = "the quick brown fox jumps over the lazy dog and keeps running through the field ";
        std::fs::write(&text, words.repeat(200)).unwrap();
        let random = dir.join("random");
        let mut x: u64 = 1;
        let bytes: Vec<u8> = (0..16384)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect();
        std::fs::write(&random, &bytes).unwrap();
        let zeros = dir.join("zeros");
        std::fs::write(&zeros, vec![0u8; 8192]).unwrap();
        let t = offline_ratios(std::slice::from_ref(&text)).unwrap();
        assert!(t.lz4 > 3.0 && t.zstd1 > 3.0 && t.deflate6 > 3.0, "{t:?}");
        let r = offline_ratios(std::slice::from_ref(&random)).unwrap();
        assert!((r.lz4 - 1.0).abs() < 1e-9 && (r.zstd1 - 1.0).abs() < 1e-9, "{r:?}");
        let z = offline_ratios(&[zeros, random]).unwrap();
        assert_eq!((z.blocks, z.zero_blocks), (6, 2));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
