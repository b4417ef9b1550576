//! The write path's estimate of whether any codec could save `MIN_SAVING_BYTES` of a block
//! (`looks_incompressible`): the collision entropy of a sample of its bytes, with early exits
//! both ways (docs/space.md, "Incompressible data" and "Early exits"). Its unit tests are the
//! codec's (`codec::tests`), which hold the test blocks.

use crate::BLOCK_SIZE;

/// Bytes of the block the entropy estimate looks at: one in each 4-byte cell (1,024 samples).
pub(super) const SAMPLE_CELL_BYTES: usize = 4;
pub(super) const SAMPLES: usize = BLOCK_SIZE / SAMPLE_CELL_BYTES;
/// Samples between two looks at the running sum (the early exit). Checking after every
/// sample cost about 14% more on random blocks, which take all 1,024 (a micro-benchmark of
/// both, 2026-11-28).
pub(super) const SAMPLES_PER_CHECK: usize = 64;

/// Which byte each sample reads, in the order taken. The cells are visited in bit-reversed
/// order, so any prefix of the samples is spread over the whole block: a run of zeros
/// anywhere (fio's 2:1 data holds 2 KiB of them at each block's end) is met within the
/// first couple of hundred samples, not after the half of the block before it (about 1 µs
/// against 0.3 µs a block in the codecs bench). Within its cell each sample takes a fixed
/// pseudo-random byte (xorshift), so that every position modulo 2, 4, 8, ... is sampled
/// about equally often: a fixed stride (every 4th byte, as the first version did) sees one
/// byte of each 32-bit value only — 24-bit integers in 32-bit slots, floats (whose exponent
/// bytes it never saw) and 16-bit samples looked random, and would have been stored raw
/// where zstd:1 saves 6–14% (unit test
/// `structured_and_half_zero_blocks_are_never_judged_incompressible`).
pub(super) const SAMPLE_OFFSETS: [u16; SAMPLES] = sample_offsets();

const fn sample_offsets() -> [u16; SAMPLES] {
    const CELL_BITS: u32 = SAMPLES.trailing_zeros();
    let mut offsets = [0u16; SAMPLES];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut i = 0;
    while i < SAMPLES {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let cell = (i as u32).reverse_bits() >> (u32::BITS - CELL_BITS);
        offsets[i] = (cell as usize * SAMPLE_CELL_BYTES + (x >> 61) as usize % SAMPLE_CELL_BYTES) as u16;
        i += 1;
    }
    offsets
}

/// `looks_incompressible` is true when the sample's sum of squared byte counts is at most
/// this. n samples of bytes of collision entropy H bits have an expected sum of
/// n + n(n−1)·2^−H: uniformly random bytes 5,116 (standard deviation ≈ 90, so the bound is
/// 7.5 of them above), and the bound is the sum at H ≈ 7.78 bits a byte. Collision entropy
/// never exceeds Shannon entropy, so an entropy coder saves at most 2.8% of such a block
/// (113 bytes), well short of `MIN_SAVING_BYTES` (1/16): the estimate errs towards running
/// the codec. A spike is what moves the sum most: 4% zero bytes among random ones (49
/// bytes an entropy coder could save) already make about 99% of blocks count as compressible.
/// Measured in docs/space.md, "Incompressible data".
pub(super) const INCOMPRESSIBLE_MAX_COLLISIONS: u32 = 5_793;

/// `looks_incompressible`'s first look: after this many samples a block whose sum is at
/// most `FIRST_LOOK_MAX_COLLISIONS` is taken as incompressible without the rest.
pub(super) const FIRST_LOOK_SAMPLES: usize = 256;
/// 256 random bytes give 511 on average (standard deviation about 23), so about 90% of
/// random blocks stop here; the rest take the whole sample. A block an entropy coder could
/// save `MIN_SAVING_BYTES` of has a collision entropy of at most 7.5 bits a byte, an
/// expected sum of at least 617 — 3 of its standard deviations above the bound.
pub(super) const FIRST_LOOK_MAX_COLLISIONS: u32 = 540;

/// The sum above which a block is taken as compressible after `samples` samples: the
/// expected sum at a collision entropy of 6 bits a byte (`n + n(n−1)/64`, 4 times random
/// bytes' excess over `n`), or `INCOMPRESSIBLE_MAX_COLLISIONS` if lower (from 704 samples on).
/// Random bytes never reach it (at 64 samples 127 against 80 ± 4); text, half-zero blocks
/// and other plainly compressible data pass it at the first or second check.
pub(super) const fn compressible_above(samples: usize) -> u32 {
    let bound = samples + samples * (samples - 1) / 64;
    if bound < INCOMPRESSIBLE_MAX_COLLISIONS as usize {
        bound as u32
    } else {
        INCOMPRESSIBLE_MAX_COLLISIONS
    }
}

/// A cheap test for data no codec would compress by `MIN_SAVING_BYTES` (random or already
/// compressed bytes): the collision entropy of a sample of the block's bytes is high. Costs a
/// histogram of at most 1,024 bytes, no logarithms; the sum of squares is kept as the
/// histogram fills (each new occurrence of a byte adds 2·count + 1) and looked at every 64
/// samples: a block whose sum is well above random bytes' (`compressible_above`) is
/// compressible — text and half-zero blocks after 64 or 128 samples —, and one still at
/// random bytes' sum after 256 (`FIRST_LOOK_MAX_COLLISIONS`) is incompressible; the others
/// take the whole sample. Pure: the answer depends on the block alone.
pub fn looks_incompressible(block: &[u8]) -> bool {
    let block: &[u8; BLOCK_SIZE] = block.try_into().expect("a whole block");
    let mut counts = [0u32; 256];
    let mut collisions: u32 = 0;
    for (check, offsets) in SAMPLE_OFFSETS.chunks_exact(SAMPLES_PER_CHECK).enumerate() {
        for &offset in offsets {
            // (The mask is a no-op — every offset is inside the block — that spares a bounds check.)
            let count = &mut counts[block[offset as usize & (BLOCK_SIZE - 1)] as usize];
            collisions += 2 * *count + 1;
            *count += 1;
        }
        let samples = (check + 1) * SAMPLES_PER_CHECK;
        if collisions > compressible_above(samples) {
            return false;
        }
        if samples == FIRST_LOOK_SAMPLES && collisions <= FIRST_LOOK_MAX_COLLISIONS {
            return true;
        }
    }
    true
}
