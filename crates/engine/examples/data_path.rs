//! One store's data paths, for counting what they cross: `scripts/data-path.sh` runs this
//! under callgrind, collecting only inside one of `Store::write`, `Store::read` or
//! `Store::open`, and lists the engine's source files whose code ran.
//!
//! Formats a small store at PATH (default codec) and opens it; writes `count` 4 KiB blocks
//! at scattered LBAs (no FUA); flushes; drops the store like a power cut (`abandon`), so the
//! second open replays those writes; opens it again and reads every block back, checking
//! it; closes. The blocks are `half` (the default: half random, half zeroes, about 2:1),
//! `random` (incompressible) or `zero`.

use zdisk_engine::{Codec, Durability, FormatOptions, OpenOptions, Store};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = std::path::PathBuf::from(args.get(1).expect("usage: data_path PATH [count [half|random|zero]]"));
    let count: u64 = args.get(2).map_or(64, |c| c.parse().expect("count: a number"));
    let random_bytes = match args.get(3).map_or("half", String::as_str) {
        "half" => 2048,
        "random" => 4096,
        "zero" => 0,
        other => panic!("data: half, random or zero, not {other:?}"),
    };
    let options = FormatOptions {
        physical_size_bytes: 256 << 20,
        logical_size_bytes: 256 << 20,
        codec: Codec::default(),
        segment_size_bytes: None,
        force: true,
        over_provision_ppm: zdisk_engine::OVER_PROVISION_DEFAULT_PPM,
        encryption: None,
        allocation: zdisk_engine::Allocation::Sparse,
    };
    let block_of = |i: u64| {
        let mut block = vec![0u8; 4096];
        // `half`: random-ish, then zeroes: about 2:1, like fio's buffer_compress_percentage=50.
        let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for byte in block[..random_bytes].iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *byte = x as u8;
        }
        block
    };
    let lba_of = |i: u64| (i * 7919) % (64 << 10);
    Store::format(&path, &options).expect("format");
    let store = Store::open(&path, &OpenOptions::default()).expect("open");
    for i in 0..count {
        store.write(lba_of(i) * 4096, &block_of(i), Durability::Buffered).expect("write");
    }
    store.flush().expect("flush");
    store.abandon();
    let store = Store::open(&path, &OpenOptions::default()).expect("open again, replaying the writes");
    let mut read = vec![0u8; 4096];
    for i in 0..count {
        store.read(lba_of(i) * 4096, &mut read).expect("read");
        assert!(read == block_of(i), "block {i} reads back different");
    }
    store.close().expect("close");
}
