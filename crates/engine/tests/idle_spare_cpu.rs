//! Idle work takes only CPU other processes leave (`store/spare_cpu.rs`): with a busy loop
//! in another process on every core it waits; once they stop, it starts. A test binary of
//! its own: tests running beside it in one process would count as the store's own CPU.

mod common;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::*;
use zdisk_engine::{Codec, CodecFallback, Durability, OpenOptions, Store};

/// Busy loops in other processes, one per core, killed when dropped.
struct BusyCores(Vec<Child>);

impl BusyCores {
    fn start() -> BusyCores {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let spawn = || Command::new("sh").args(["-c", "while :; do :; done"]).spawn().expect("sh");
        BusyCores((0..cores).map(|_| spawn()).collect())
    }
}

impl Drop for BusyCores {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn idle_work_waits_while_other_processes_keep_every_core_busy() {
    const LOGICAL_BYTES: u64 = 1 << 20;
    let disk = new_disk(64, 64 << 10, LOGICAL_BYTES, Codec::Zstd { level: 1 }, 4);
    let options = OpenOptions {
        background: true,
        codec_fallback: CodecFallback::Always,
        idle_after: Some(Duration::from_millis(30)),
        idle_spare_cores: 1.0,
        auto_dictionary_blocks: Some(128),
        ..test_options()
    };
    let store = Store::open_backing(disk, &options).unwrap();
    // The loops start first, so every sample idle work takes sees them.
    let busy_cores = BusyCores::start();
    let text = text_of_vocabulary(&mut rng(4), LOGICAL_BYTES as usize, 99);
    for (i, chunk) in text.chunks(64 << 10).enumerate() {
        store.write((i as u64) << 16, chunk, Durability::Buffered).unwrap();
    }
    store.flush().unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let busy = store.stats();
    drop(busy_cores);
    assert_eq!(busy.codec.dictionaries_trained_idle, 0, "idle work took a busy machine's CPU: {:?}", busy.codec);
    assert_eq!(busy.codec.idle_segments_recompressed, 0, "{:?}", busy.codec);
    // The cores free again, it starts (the test's control: the host was away all along).
    let started = Instant::now();
    while store.stats().codec.dictionaries_trained_idle == 0 {
        assert!(started.elapsed() < Duration::from_secs(60), "idle work never started: {:?}", store.stats().codec);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(read_all(&store) == text, "blocks read back different after idle work");
}
