//! `zdisk recompress`: blocks written with the LZ4 fallback forced into a zstd:1 store are
//! recompressed offline and while served; comp_ratio rises, `zdisk check` is clean, the data
//! reads back identical.

mod common;

use common::{Scratch, Server};
use rand::{Rng, SeedableRng};
use zdisk_engine::{CodecFallback, Durability, OpenOptions, Store};

/// Text-like bytes (words from a small vocabulary): zstd stores them in clearly fewer bytes
/// than LZ4.
fn text(len: usize, seed: u64) -> Vec<u8> {
    const WORDS: [&str; 10] =
        ["the ", "block ", "segment ", "zdisk ", "of ", "checkpoint\n", "map ", "compress ", "GC ", "replay "];
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(len + 16);
    while out.len() < len {
        out.extend_from_slice(WORDS[rng.gen_range(0..WORDS.len())].as_bytes());
    }
    out.truncate(len);
    out
}

/// A zstd:1 store holding 16 MiB of text written with the LZ4 fallback forced.
fn store_of_fallback_blocks(s: &Scratch) -> (std::path::PathBuf, Vec<u8>) {
    let store_path = s.format("s.zdisk", "64M", "2x", &["--codec", "zstd:1", "--segment-size", "1M"]);
    let data = text(16 << 20, 20);
    let options = OpenOptions { codec_fallback: CodecFallback::Always, ..OpenOptions::default() };
    let store = Store::open(&store_path, &options).unwrap();
    for (i, chunk) in data.chunks(1 << 20).enumerate() {
        store.write((i as u64) << 20, chunk, Durability::Buffered).unwrap();
    }
    let stats = store.stats();
    assert_eq!(stats.codec.codec_fallback_blocks, 4096, "the fallback was not forced: {stats:?}");
    store.close().unwrap();
    (store_path, data)
}

fn assert_clean_and_identical(s: &Scratch, store_path: &std::path::Path, data: &[u8]) {
    let check: serde_json::Value =
        serde_json::from_str(&s.zdisk_ok(&["check", store_path.to_str().unwrap(), "--json"])).unwrap();
    assert_eq!(check["clean"], true, "{check}");
    let store = Store::open(store_path, &OpenOptions { read_only: true, ..OpenOptions::default() }).unwrap();
    let mut back = vec![0u8; data.len()];
    store.read(0, &mut back).unwrap();
    assert!(back == data, "recompressed data reads back different");
}

#[test]
fn recompress_moves_fallback_blocks_into_zstd_and_raises_comp_ratio() {
    let s = Scratch::new("recompress");
    let (store_path, data) = store_of_fallback_blocks(&s);
    let before = s.stat_json(&store_path);
    let out = s.zdisk_ok(&["recompress", store_path.to_str().unwrap(), "--json"]);
    let report: serde_json::Value = serde_json::from_str(&out).expect("recompress --json is JSON");
    assert!(report["segments"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["segments_cleaned"], report["segments"], "{report}");
    assert_eq!(report["after"]["recompressed_fragments"], 4096, "{report}");
    let after = s.stat_json(&store_path);
    let (ratio_before, ratio_after) = (before["comp_ratio"].as_f64().unwrap(), after["comp_ratio"].as_f64().unwrap());
    // LZ4 stores these text blocks in about 1.7x the bytes zstd:1 does.
    assert!(ratio_after > 1.3 * ratio_before, "comp_ratio {ratio_before} -> {ratio_after}");
    assert_clean_and_identical(&s, &store_path, &data);
    // The human form says before and after; a second run has nothing left to do.
    let out = s.zdisk_ok(&["recompress", store_path.to_str().unwrap()]);
    assert!(out.contains("0 of 0 segments") && out.contains("comp_ratio"), "{out}");
}

#[test]
fn recompress_refuses_an_unknown_codec() {
    let s = Scratch::new("recompress-codec");
    let store = s.format("s.zdisk", "32M", "2x", &[]);
    let output = s.zdisk().args(["recompress", store.to_str().unwrap(), "--codec", "brotli"]).output().unwrap();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("unknown codec"), "{output:?}");
}

#[test]
fn recompress_runs_through_the_servers_control_socket_while_served() {
    if !common::require(&["nbdkit"]) {
        return;
    }
    let s = Scratch::new("recompress-served");
    let (store_path, data) = store_of_fallback_blocks(&s);
    // (No idle work: it would recompress the same blocks, or train a dictionary, first.)
    let server = Server::start(&s, &store_path, &["--idle-after", "0"]);
    // The plugin opens the store, and its control socket, after nbdkit is ready: a moment
    // after `zdisk serve` prints the URI. (For the same reason no `zdisk stat` first: the
    // report carries the server's own before and after.)
    let uuid = Store::info(&store_path).unwrap().uuid;
    let control = s.run_dir().join(format!("{uuid}.ctl"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !control.exists() {
        assert!(std::time::Instant::now() < deadline, "no control socket at {}", control.display());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = s.zdisk_ok(&["recompress", store_path.to_str().unwrap(), "--json"]);
    let report: serde_json::Value = serde_json::from_str(&out).expect("recompress --json is JSON");
    assert_eq!(report["after"]["recompressed_fragments"], 4096, "{report}");
    let ratio_before = report["before"]["comp_ratio"].as_f64().unwrap();
    let ratio_after = report["after"]["comp_ratio"].as_f64().unwrap();
    assert!(ratio_after > 1.3 * ratio_before, "comp_ratio {ratio_before} -> {ratio_after}");
    server.stop();
    assert_clean_and_identical(&s, &store_path, &data);
}
