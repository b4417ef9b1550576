//! One host write path, for counting what it crosses: `scripts/write-path.sh` runs this
//! under callgrind, collecting only inside `Store::write`, and lists the engine's source
//! files whose code ran. Formats a small store at PATH (default codec), writes `count`
//! 4 KiB blocks at scattered LBAs (no FUA), closes it. The blocks are `half` (the default:
//! half random, half zeroes, about 2:1), `random` (incompressible) or `zero`.

use zdisk_engine::{Codec, Durability, FormatOptions, OpenOptions, Store};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = std::path::PathBuf::from(args.get(1).expect("usage: write_path PATH [count]"));
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
    Store::format(&path, &options).expect("format");
    let store = Store::open(&path, &OpenOptions::default()).expect("open");
    let mut block = vec![0u8; 4096];
    for i in 0..count {
        // `half`: random-ish, then zeroes: about 2:1, like fio's buffer_compress_percentage=50.
        let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for byte in block[..random_bytes].iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *byte = x as u8;
        }
        let lba = (i * 7919) % (64 << 10);
        store.write(lba * 4096, &block, Durability::Buffered).expect("write");
    }
    store.flush().expect("flush");
}
