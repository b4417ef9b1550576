//! Shared pieces of the simulator-driven tests: a plain reference model of the device and
//! the contract check run after every recovery.
#![allow(dead_code)]

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use zdisk_engine::sim::SimDisk;
use zdisk_engine::{Codec, FormatOptions, OpenOptions, Store};

pub const BLOCK: u64 = 4096;

/// A request as the client issued it.
#[derive(Debug, Clone)]
pub enum Request {
    Write { offset: u64, data: Vec<u8> },
    Trim { offset: u64, len: u64 },
    Zero { offset: u64, len: u64 },
}

impl Request {
    /// What the request does to a plain image of the device.
    pub fn apply(&self, image: &mut [u8]) {
        match self {
            Request::Write { offset, data } => {
                image[*offset as usize..*offset as usize + data.len()].copy_from_slice(data)
            }
            Request::Zero { offset, len } => image[*offset as usize..(*offset + *len) as usize].fill(0),
            Request::Trim { offset, len } => {
                // Only whole blocks are unmapped (read as zero); partial edges keep their data.
                let start = offset.div_ceil(BLOCK) * BLOCK;
                let end = (offset + len) / BLOCK * BLOCK;
                if end > start {
                    image[start as usize..end as usize].fill(0);
                }
            }
        }
    }

    pub fn range(&self) -> (u64, u64) {
        match self {
            Request::Write { offset, data } => (*offset, data.len() as u64),
            Request::Trim { offset, len } | Request::Zero { offset, len } => (*offset, *len),
        }
    }

    pub fn run(&self, store: &Store, fua: bool) -> zdisk_engine::Result<()> {
        match self {
            Request::Write { offset, data } => store.write(*offset, data, fua),
            Request::Trim { offset, len } => store.trim(*offset, *len, fua),
            Request::Zero { offset, len } => store.write_zeroes(*offset, *len, fua),
        }
    }
}

/// Block contents of three kinds: zero, about 2:1 compressible, incompressible.
pub fn block_data(rng: &mut StdRng, len: usize, incompressible_percent: u32) -> Vec<u8> {
    let mut data = vec![0u8; len];
    let mut at = 0;
    while at < len {
        let take = (BLOCK as usize - at % BLOCK as usize).min(len - at);
        let roll = rng.gen_range(0..100);
        let chunk = &mut data[at..at + take];
        if roll < 8 {
            // all zero
        } else if roll < 8 + incompressible_percent {
            rng.fill(chunk);
        } else {
            // Half random, half a repeated byte: compresses about 2:1.
            for (i, b) in chunk.iter_mut().enumerate() {
                *b = if (i / 32) % 2 == 0 { rng.gen() } else { 0x61 };
            }
        }
        at += take;
    }
    data
}

/// The reference model: the image as of the last completed flush, plus every request
/// acknowledged (or in flight at the crash) since, in order.
pub struct Model {
    pub durable: Vec<u8>,
    pub pending: Vec<Request>,
}

impl Model {
    pub fn new(logical_bytes: u64) -> Model {
        Model { durable: vec![0; logical_bytes as usize], pending: Vec::new() }
    }

    pub fn current(&self) -> Vec<u8> {
        let mut image = self.durable.clone();
        for r in &self.pending {
            r.apply(&mut image);
        }
        image
    }

    pub fn flushed(&mut self) {
        self.durable = self.current();
        self.pending.clear();
    }

    /// The contract after a crash: the device must equal the durable image with some
    /// prefix of the pending requests applied — each block holds its last flushed value or
    /// a later written one, no request is half-applied, no byte changes that nobody wrote.
    /// Returns how many pending requests survived, or a description of the violation.
    pub fn check_recovered(&mut self, recovered: &[u8]) -> Result<usize, String> {
        let touched: Vec<(usize, usize)> = self
            .pending
            .iter()
            .map(|r| {
                let (o, l) = r.range();
                ((o / BLOCK * BLOCK) as usize, ((o + l).div_ceil(BLOCK) * BLOCK) as usize)
            })
            .collect();
        let is_touched =
            |block: usize| touched.iter().any(|&(s, e)| block * BLOCK as usize >= s && block * (BLOCK as usize) < e);
        for (block, (got, want)) in
            recovered.chunks(BLOCK as usize).zip(self.durable.chunks(BLOCK as usize)).enumerate()
        {
            if !is_touched(block) && got != want {
                return Err(format!("block {block} changed although no request after the last flush touched it"));
            }
        }
        let matches = |image: &[u8]| touched.iter().all(|&(s, e)| recovered[s..e] == image[s..e]);
        let mut state = self.durable.clone();
        let mut survivors = None;
        if matches(&state) {
            survivors = Some(0);
        }
        for (k, r) in self.pending.iter().enumerate() {
            r.apply(&mut state);
            if matches(&state) {
                survivors = Some(k + 1);
            }
        }
        match survivors {
            Some(k) => {
                self.durable = recovered.to_vec();
                self.pending.clear();
                Ok(k)
            }
            None => {
                let first_bad = touched
                    .iter()
                    .flat_map(|&(s, e)| (s..e).step_by(BLOCK as usize))
                    .find(|&at| recovered[at..at + BLOCK as usize] != self.durable[at..at + BLOCK as usize]);
                Err(format!(
                    "recovered image is not the last flushed state plus a prefix of the {} later requests (first differing block from the flushed state at byte {:?}); requests: {:?}",
                    self.pending.len(),
                    first_bad,
                    self.pending.iter().map(|r| (std::mem::discriminant(r), r.range())).collect::<Vec<_>>()
                ))
            }
        }
    }
}

pub fn read_all(store: &Store) -> Vec<u8> {
    let mut image = vec![0u8; store.logical_size_bytes() as usize];
    for (i, chunk) in image.chunks_mut(1 << 20).enumerate() {
        store.read((i as u64) << 20, chunk).expect("read after recovery");
    }
    image
}

pub fn test_options() -> OpenOptions {
    // A small read cache, so every simulator test also exercises its invalidation.
    OpenOptions {
        background: false,
        checkpoint_interval_bytes: 192 << 10,
        read_cache_bytes: 1 << 20,
        ..OpenOptions::default()
    }
}

pub fn new_disk(segments: u64, segment_bytes: u64, logical_bytes: u64, codec: Codec, seed: u64) -> Arc<SimDisk> {
    let disk = Arc::new(SimDisk::new((1 << 20) + segments * segment_bytes, seed));
    Store::format_backing(
        disk.as_ref(),
        &FormatOptions {
            physical_size_bytes: 0,
            logical_size_bytes: logical_bytes,
            codec,
            segment_size_bytes: Some(segment_bytes),
            force: true,
        },
    )
    .expect("format");
    disk
}

/// The seeds a randomized test runs: `ZDISK_TEST_SEED=N` reruns exactly one.
pub fn seeds(count: u64) -> Vec<u64> {
    if let Ok(seed) = std::env::var("ZDISK_TEST_SEED") {
        return vec![seed.parse().expect("ZDISK_TEST_SEED must be a number")];
    }
    let base = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    (0..count).map(|i| base.wrapping_mul(6364136223846793005).wrapping_add(i)).collect()
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}
