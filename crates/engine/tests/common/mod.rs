//! Shared pieces of the simulator-driven tests: a plain reference model of the device and
//! the contract check run after every recovery.
#![allow(dead_code)]

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use zdisk_engine::sim::SimDisk;
use zdisk_engine::{Codec, Durability, Encryption, FormatOptions, KdfParams, OpenOptions, Secret, Store};

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

    pub fn run(&self, store: &Store, durability: Durability) -> zdisk_engine::Result<()> {
        match self {
            Request::Write { offset, data } => store.write(*offset, data, durability),
            Request::Trim { offset, len } => store.trim(*offset, *len, durability),
            Request::Zero { offset, len } => store.write_zeroes(*offset, *len, durability),
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
                return Err(format!(
                    "block {block} changed although no request after the last flush touched it (reads {}, flushed {})",
                    describe(got),
                    describe(want)
                ));
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

impl Model {
    /// For each block, the values it may hold after a crash: its last flushed value, or
    /// what any prefix of the later requests left in it (as hashes).
    pub fn possible_block_values(&self) -> Vec<std::collections::HashSet<u64>> {
        let hash = |b: &[u8]| {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            b.hash(&mut h);
            h.finish()
        };
        let mut state = self.durable.clone();
        let mut possible: Vec<std::collections::HashSet<u64>> =
            state.chunks(BLOCK as usize).map(|b| std::iter::once(hash(b)).collect()).collect();
        for r in &self.pending {
            r.apply(&mut state);
            for (set, b) in possible.iter_mut().zip(state.chunks(BLOCK as usize)) {
                set.insert(hash(b));
            }
        }
        possible
    }
}

/// Flips one random bit in each of up to `records` random records of the replay window of
/// a crashed image, opens a copy read-only, and checks the contract: every block reads a
/// value at or after its last flushed one, or fails with EIO — never an older value.
/// Returns how many blocks failed.
pub fn check_damaged_copy(image: &[u8], model: &Model, records: usize, rng: &mut StdRng) -> Result<usize, String> {
    check_damaged_copy_with(image, model, records, rng, None)
}

/// [`check_damaged_copy`] of an encrypted store, opened with `key`.
pub fn check_damaged_copy_with(
    image: &[u8],
    model: &Model,
    records: usize,
    rng: &mut StdRng,
    key: Option<Arc<Secret>>,
) -> Result<usize, String> {
    use zdisk_engine::sim::inspect;
    let window = inspect::replay_window(image);
    if window.is_empty() {
        return Ok(0);
    }
    let mut damaged = image.to_vec();
    let mut flipped = Vec::new();
    for _ in 0..records {
        let r = &window[rng.gen_range(0..window.len())];
        if flipped.iter().any(|&(seq, _, _)| seq == r.seq) {
            continue; // one bit per record: more than one in a record needs proof of durability
        }
        let at = rng.gen_range(r.head.start..r.tail.end);
        let bit = rng.gen_range(0..8u8);
        damaged[at as usize] ^= 1 << bit;
        flipped.push((r.seq, at, bit));
    }
    let disk = Arc::new(SimDisk::from_image(damaged, 1));
    let store = match Store::open_backing(disk, &OpenOptions { read_only: true, key, ..test_options() }) {
        Ok(store) => store,
        // The newest checkpoint damaged with no older one to fall back to (a crash tore the
        // other superblock slot's write): a refusal to open, not wrong data. Anything else
        // is a failure.
        Err(e) if e.kind() == zdisk_engine::ErrorKind::Corrupt && valid_superblocks(image) == 1 => {
            return Ok(usize::MAX)
        }
        Err(e) => return Err(format!("open after flipping {flipped:?}: {e}")),
    };
    let possible = model.possible_block_values();
    let mut failed = 0;
    let mut block = vec![0u8; BLOCK as usize];
    for (lba, allowed) in possible.iter().enumerate() {
        match store.read(lba as u64 * BLOCK, &mut block) {
            Ok(()) => {
                use std::hash::{Hash, Hasher};
                let mut h = std::collections::hash_map::DefaultHasher::new();
                block[..].hash(&mut h);
                if !allowed.contains(&h.finish()) {
                    return Err(format!("after flipping {flipped:?}: block {lba} reads a value older than its last flushed one (or one never written)"));
                }
            }
            Err(e) if e.kind() == zdisk_engine::ErrorKind::Checksum => failed += 1,
            Err(e) => return Err(format!("after flipping {flipped:?}: block {lba}: {e}")),
        }
    }
    Ok(failed)
}

fn describe(block: &[u8]) -> String {
    if block.iter().all(|&b| b == 0) {
        "zeroes".into()
    } else {
        format!("{:02x?}..", &block[..8])
    }
}

/// How many superblock slots of an image decode.
fn valid_superblocks(image: &[u8]) -> usize {
    zdisk_engine::sim::inspect::valid_superblock_slots(image)
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
    new_disk_with(segments, segment_bytes, logical_bytes, codec, seed, None)
}

/// A passphrase for tests, with Argon2id at its cheapest (`KdfParams::TEST`).
pub fn test_encryption(passphrase: &str) -> Encryption {
    Encryption { secret: Arc::new(Secret::passphrase(passphrase.as_bytes().to_vec())), kdf: KdfParams::TEST }
}

/// [`new_disk`], encrypted when `encryption` is given.
pub fn new_disk_with(
    segments: u64,
    segment_bytes: u64,
    logical_bytes: u64,
    codec: Codec,
    seed: u64,
    encryption: Option<Encryption>,
) -> Arc<SimDisk> {
    let disk = Arc::new(SimDisk::new((1 << 20) + segments * segment_bytes, seed));
    Store::format_backing(
        disk.as_ref(),
        &FormatOptions {
            physical_size_bytes: 0,
            logical_size_bytes: logical_bytes,
            codec,
            segment_size_bytes: Some(segment_bytes),
            force: true,
            over_provision_ppm: zdisk_engine::OVER_PROVISION_DEFAULT_PPM,
            encryption,
            allocation: zdisk_engine::Allocation::Sparse,
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

/// Text-like blocks: words of a small vocabulary, now and then a number. zstd stores them in
/// clearly fewer bytes than LZ4, and a dictionary does best of all.
pub fn word_text(rng: &mut StdRng, len: usize) -> Vec<u8> {
    const WORDS: [&str; 12] = [
        "segment ",
        "zdisk ",
        "checkpoint ",
        "the ",
        "of ",
        "GC\n",
        "map ",
        "dictionary ",
        "42 ",
        "fragment ",
        "log ",
        "and ",
    ];
    let mut data = Vec::with_capacity(len + 16);
    while data.len() < len {
        data.extend_from_slice(WORDS[rng.gen_range(0..WORDS.len())].as_bytes());
        if rng.gen_bool(0.05) {
            data.extend_from_slice(format!("{} ", rng.gen::<u32>()).as_bytes());
        }
    }
    data.truncate(len);
    data
}

/// Lines of words from a vocabulary of a few hundred made-up words: few repeats inside one
/// 4 KiB block, many across blocks — LZ4 does little with it, zstd more, a dictionary most.
pub fn text_data(rng: &mut StdRng, len: usize) -> Vec<u8> {
    text_of_vocabulary(rng, len, 99)
}

/// `text_data` with words of another vocabulary (`vocabulary_seed`).
pub fn text_of_vocabulary(rng: &mut StdRng, len: usize, vocabulary_seed: u64) -> Vec<u8> {
    let mut vocabulary_rng = self::rng(vocabulary_seed);
    let vocabulary: Vec<String> = (0..400)
        .map(|_| {
            let letters = vocabulary_rng.gen_range(3..10);
            (0..letters).map(|_| vocabulary_rng.gen_range(b'a'..=b'z') as char).collect()
        })
        .collect();
    let mut out = Vec::with_capacity(len + 128);
    while out.len() < len {
        for _ in 0..rng.gen_range(4..12) {
            out.extend_from_slice(vocabulary[rng.gen_range(0..vocabulary.len())].as_bytes());
            out.push(b' ');
        }
        out.extend_from_slice(format!("{}\n", rng.gen_range(0..100_000)).as_bytes());
    }
    out.truncate(len);
    out
}
