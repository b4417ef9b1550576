//! `zdisk recompress --train`: text copied into a served store through NBD (nbdcopy) is
//! recompressed with a dictionary trained on the store's own blocks, through the server's
//! control socket; comp_ratio rises well past what zstd alone reached, `zdisk stat` shows
//! the dictionary, `zdisk check` is clean, the data reads back identical through NBD, and a
//! later plain `zdisk recompress` finds nothing left to do. Idle work does the same unasked.

mod common;

use std::process::Command;

use common::{run_ok, sha256, Scratch, Server};
use rand::{Rng, SeedableRng};
use zdisk_engine::{Durability, Store};

/// Lines of words from a vocabulary of a few hundred made-up words: few repeats inside one
/// 4 KiB block, many across blocks (what a dictionary is for; shuffled changelog lines are
/// like this).
fn text_lines(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let vocabulary: Vec<String> =
        (0..500).map(|_| (0..rng.gen_range(3..10)).map(|_| rng.gen_range(b'a'..=b'z') as char).collect()).collect();
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

fn wait_for_control_socket(s: &Scratch, store: &std::path::Path) {
    let uuid = Store::info(store).unwrap().uuid;
    let control = s.run_dir().join(format!("{uuid}.ctl"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !control.exists() {
        assert!(std::time::Instant::now() < deadline, "no control socket at {}", control.display());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn recompress_train_through_nbd_trains_a_dictionary_and_raises_comp_ratio() {
    if !common::require(&["nbdkit", "nbdcopy", "sha256sum"]) {
        return;
    }
    let s = Scratch::new("recompress-train");
    let store = s.format("s.zdisk", "64M", "32M", &["--codec", "zstd:1", "--segment-size", "1M"]);
    let input = s.path("text.bin");
    std::fs::write(&input, text_lines(16 << 20, 7)).unwrap();
    // (No idle work: it would train the first dictionary itself.)
    let server = Server::start(&s, &store, &["--idle-after", "0"]);
    run_ok(Command::new("nbdcopy").arg("--flush").arg(&input).arg(&server.uri));
    wait_for_control_socket(&s, &store);
    let out = s.zdisk_ok(&["recompress", store.to_str().unwrap(), "--train", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&out).expect("recompress --json is JSON");
    assert_eq!(report["dictionary"]["id"], 1, "{report}");
    assert!(report["dictionary"]["size_bytes"].as_u64().unwrap() > 0, "{report}");
    assert!(report["after"]["recompressed_fragments_dictionary"].as_u64().unwrap() > 3000, "{report}");
    let ratio_before = report["before"]["comp_ratio"].as_f64().unwrap();
    let ratio_after = report["after"]["comp_ratio"].as_f64().unwrap();
    assert!(ratio_after > 1.15 * ratio_before, "comp_ratio {ratio_before} -> {ratio_after}");
    // Read back through NBD while still served, after the recompression.
    let readback = s.path("readback.img");
    run_ok(Command::new("nbdcopy").arg(&server.uri).arg(&readback));
    std::fs::OpenOptions::new().write(true).open(&readback).unwrap().set_len(16 << 20).unwrap();
    assert_eq!(sha256(&readback), sha256(&input), "bytes read back after recompression differ");
    server.stop();

    let stat = s.stat_json(&store);
    assert_eq!(stat["dictionary_count"], 1, "{stat}");
    assert!(stat["comp_ratio"].as_f64().unwrap() > 1.15 * ratio_before, "{stat}");
    let check: serde_json::Value =
        serde_json::from_str(&s.zdisk_ok(&["check", store.to_str().unwrap(), "--json"])).unwrap();
    assert_eq!(check["clean"], true, "{check}");
    // Offline, without --train, into the newest dictionary: nothing left to do.
    let out = s.zdisk_ok(&["recompress", store.to_str().unwrap()]);
    assert!(out.contains("comp_ratio"), "{out}");
    // And served again, the same bytes.
    let server = Server::start(&s, &store, &[]);
    std::fs::remove_file(&readback).unwrap();
    run_ok(Command::new("nbdcopy").arg(&server.uri).arg(&readback));
    std::fs::OpenOptions::new().write(true).open(&readback).unwrap().set_len(16 << 20).unwrap();
    assert_eq!(sha256(&readback), sha256(&input), "bytes read back after a restart differ");
    server.stop();
}

#[test]
fn recompress_train_offline_reports_the_dictionary() {
    let s = Scratch::new("recompress-train-offline");
    let store_path = s.format("s.zdisk", "32M", "16M", &["--segment-size", "1M"]);
    let data = text_lines(4 << 20, 8);
    let store = Store::open(&store_path, &zdisk_engine::OpenOptions::default()).unwrap();
    store.write(0, &data, Durability::Buffered).unwrap();
    store.close().unwrap();
    let out = s.zdisk_ok(&["recompress", store_path.to_str().unwrap(), "--train", "--level", "3"]);
    assert!(out.contains("dictionary     id 1") && out.contains("comp_ratio"), "{out}");
    let check: serde_json::Value =
        serde_json::from_str(&s.zdisk_ok(&["check", store_path.to_str().unwrap(), "--json"])).unwrap();
    assert_eq!(check["clean"], true, "{check}");
}

#[test]
fn recompress_refuses_a_level_without_train_and_train_with_a_codec() {
    let s = Scratch::new("recompress-train-args");
    let store = s.format("s.zdisk", "32M", "2x", &[]);
    for args in [vec!["--level", "3"], vec!["--train", "--codec", "zstd:3"]] {
        let output = s.zdisk().arg("recompress").arg(&store).args(&args).output().unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}: {output:?}");
    }
}

/// Idle work through NBD, with the store's defaults but a short idle time: text copied in
/// with nbdcopy, then left alone — the server trains the first dictionary itself and
/// recompresses the text into it; `zdisk stat` (live, then offline) shows it, the bytes read
/// back identical through NBD, `zdisk check` is clean.
#[test]
fn idle_work_through_nbd_trains_a_dictionary_and_raises_comp_ratio() {
    if !common::require(&["nbdkit", "nbdcopy", "sha256sum"]) {
        return;
    }
    let s = Scratch::new("idle-work");
    let store = s.format("s.zdisk", "64M", "32M", &["--segment-size", "1M"]);
    let input = s.path("text.bin");
    // 16 MiB: the 4,096 stored blocks a store holds before it trains on its own.
    std::fs::write(&input, text_lines(16 << 20, 9)).unwrap();
    let server = Server::start(&s, &store, &["--idle-after", "3"]);
    wait_for_control_socket(&s, &store);
    run_ok(Command::new("nbdcopy").arg("--flush").arg(&input).arg(&server.uri));
    // The live statistics are a snapshot the server takes every second: the copy's own
    // (before idle work, 3 s after it) first, then idle work's.
    let wait_for_stat = |what: &str, done: &dyn Fn(&serde_json::Value) -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let stat = s.stat_json(&store);
            if done(&stat) {
                return stat;
            }
            assert!(std::time::Instant::now() < deadline, "{what} did not happen: {stat}");
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    };
    let copied = wait_for_stat("the copy", &|stat| stat["host_write_bytes"] == 16 << 20);
    assert_eq!(copied["dictionaries_trained_idle"], 0, "idle work before the host left: {copied}");
    let ratio_copied = copied["comp_ratio"].as_f64().unwrap();
    let idle = wait_for_stat("idle work", &|stat| {
        stat["dictionaries_trained_idle"] == 1
            && stat["recompressed_fragments_dictionary"].as_u64().unwrap() >= 3500
            && stat["comp_ratio"].as_f64().unwrap() > 1.15 * ratio_copied
    });
    assert!(idle["idle_segments_recompressed"].as_u64().unwrap() > 0, "{idle}");
    let readback = s.path("readback.img");
    run_ok(Command::new("nbdcopy").arg(&server.uri).arg(&readback));
    std::fs::OpenOptions::new().write(true).open(&readback).unwrap().set_len(16 << 20).unwrap();
    assert_eq!(sha256(&readback), sha256(&input), "bytes read back after idle work differ");
    server.stop();
    let stat = s.stat_json(&store);
    assert_eq!(stat["dictionary_count"], 1, "{stat}");
    assert!(stat["comp_ratio"].as_f64().unwrap() > 1.15 * ratio_copied, "copied {ratio_copied}, offline {stat}");
    let check: serde_json::Value =
        serde_json::from_str(&s.zdisk_ok(&["check", store.to_str().unwrap(), "--json"])).unwrap();
    assert_eq!(check["clean"], true, "{check}");
}
