//! In-process throughput of the engine on a file: `cargo run --release -p zdisk-engine
//! --example throughput -- PATH [threads] [seconds]`. 4 KiB random writes then reads of
//! 2:1 data over a 1 GiB logical range; prints IOPS. (No NBD, no transport.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use zdisk_engine::{Codec, Durability, FormatOptions, OpenOptions, Store};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = std::path::PathBuf::from(args.get(1).expect("usage: throughput PATH [threads] [seconds]"));
    let threads: usize = args.get(2).map_or(2, |t| t.parse().unwrap());
    let seconds: u64 = args.get(3).map_or(5, |t| t.parse().unwrap());
    let logical = 1u64 << 30;
    Store::format(
        &path,
        &FormatOptions {
            physical_size_bytes: 2 << 30,
            logical_size_bytes: logical,
            codec: Codec::Lz4,
            segment_size_bytes: None,
            force: true,
            over_provision_ppm: zdisk_engine::OVER_PROVISION_DEFAULT_PPM,
            encryption: None,
            allocation: zdisk_engine::Allocation::Sparse,
        },
    )
    .unwrap();
    let store = Arc::new(Store::open(&path, &OpenOptions::default()).unwrap());
    for (name, write) in [("randwrite", true), ("randread", false)] {
        let ops = Arc::new(AtomicU64::new(0));
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let store = Arc::clone(&store);
                let ops = Arc::clone(&ops);
                std::thread::spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(t as u64);
                    let mut block = vec![0u8; 4096];
                    while Instant::now() < deadline {
                        let lba = rng.gen_range(0..logical / 4096);
                        if write {
                            rng.fill(&mut block[..2048]);
                            block[2048..].fill(0);
                            store.write(lba * 4096, &block, Durability::Buffered).unwrap();
                        } else {
                            store.read(lba * 4096, &mut block).unwrap();
                        }
                        ops.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let n = ops.load(Ordering::Relaxed);
        println!("{name}: {} IOPS ({threads} threads)", n / seconds);
    }
    println!("{:?}", store.stats());
}
