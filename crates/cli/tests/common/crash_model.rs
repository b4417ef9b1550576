//! The model of `interop.rs`'s crash test: for one writer, the version every block had at
//! its last flush and those written since, and each request since, so that after a crash a
//! block must show its flushed version or a later one written since, and a request must
//! show in all its blocks or in none (unless a later request overwrote them).

use std::ops::Range;

pub const BLOCK: usize = 4096;

/// Deterministic bytes for (seed, tag, offset): half random, half zero, so they compress.
pub fn pattern(seed: u64, tag: u64, offset: u64, length: usize) -> Vec<u8> {
    let mut out = vec![0u8; length];
    for (i, byte) in out.iter_mut().enumerate() {
        let position = offset + i as u64;
        if (position / 512) % 2 == 1 {
            continue;
        }
        let mut x = seed ^ tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (position / 8).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x ^= x >> 31;
        x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 29;
        *byte = (x >> ((position % 8) * 8)) as u8;
    }
    out
}

/// Per-block expectations of the crash test for one writer.
pub struct Model {
    pub seed: u64,
    /// Version every block had when its writer's last flush completed (0 = never written).
    durable: Vec<u64>,
    /// Versions written (acknowledged or in flight) since that flush, in order.
    since_flush: Vec<Vec<u64>>,
    /// Blocks of each version written since the last flush (for the atomicity check).
    requests: Vec<(u64, Range<usize>)>,
}

impl Model {
    pub fn new(seed: u64, blocks: usize) -> Model {
        Model { seed, durable: vec![0; blocks], since_flush: vec![Vec::new(); blocks], requests: Vec::new() }
    }

    pub fn blocks(&self) -> usize {
        self.durable.len()
    }

    /// Records a write of `version` over `blocks` (before it is sent: it may land whether or
    /// not it is acknowledged) and returns its bytes.
    pub fn write(&mut self, version: u64, blocks: Range<usize>) -> Vec<u8> {
        let mut data = Vec::with_capacity(blocks.len() * BLOCK);
        for block in blocks.clone() {
            data.extend_from_slice(&block_content(self.seed, version, block));
            self.since_flush[block].push(version);
        }
        self.requests.push((version, blocks));
        data
    }

    /// A FUA write was acknowledged: durable by itself, so earlier versions of its blocks
    /// are not needed any more and it is their floor.
    pub fn written_with_fua(&mut self, version: u64, blocks: Range<usize>) {
        for block in blocks {
            self.durable[block] = version;
            self.since_flush[block].clear();
        }
    }

    /// A flush was acknowledged: every block's last version is durable.
    pub fn flushed(&mut self) {
        for (durable, since) in self.durable.iter_mut().zip(&mut self.since_flush) {
            if let Some(&last) = since.last() {
                *durable = last;
                since.clear();
            }
        }
        self.requests.clear();
    }

    /// Checks the writer's whole range read back after a crash, and takes it as the new
    /// flushed state.
    pub fn check_recovered(&mut self, bytes: &[u8], what: &str) {
        let seed = self.seed;
        let mut seen = vec![0u64; self.blocks()];
        for (block, data) in bytes.chunks(BLOCK).enumerate() {
            let version = version_of(seed, data, block)
                .unwrap_or_else(|| panic!("seed {seed} {what}: block {block} holds bytes nobody wrote"));
            let allowed = version == self.durable[block] || self.since_flush[block].contains(&version);
            assert!(
                allowed,
                "seed {seed} {what}: block {block} has version {version:#x}, expected the flushed {:#x} or one of {:x?}",
                self.durable[block],
                self.since_flush[block]
            );
            seen[block] = version;
        }
        // All-or-nothing: a request seen in one block is seen (or overwritten by a later
        // request) in every block it covered.
        for (version, range) in &self.requests {
            if range.clone().any(|b| seen[b] == *version) {
                for b in range.clone() {
                    assert!(
                        seen[b] >= *version,
                        "seed {seed} {what}: request {version:#x} is torn: block {b} shows {:#x}",
                        seen[b]
                    );
                }
            }
        }
        self.durable = seen;
        self.since_flush.iter_mut().for_each(Vec::clear);
        self.requests.clear();
    }
}

fn block_content(seed: u64, version: u64, block: usize) -> Vec<u8> {
    if version == 0 {
        return vec![0u8; BLOCK];
    }
    let mut data = pattern(seed, version, (block * BLOCK) as u64, BLOCK);
    data[..8].copy_from_slice(&version.to_le_bytes());
    data[8..16].copy_from_slice(&(block as u64).to_le_bytes());
    data
}

fn version_of(seed: u64, data: &[u8], block: usize) -> Option<u64> {
    if data.iter().all(|&b| b == 0) {
        return Some(0);
    }
    let version = u64::from_le_bytes(data[..8].try_into().unwrap());
    (block_content(seed, version, block) == data).then_some(version)
}
