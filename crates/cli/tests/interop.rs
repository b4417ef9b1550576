//! Interop: real NBD clients (nbdinfo, nbdcopy, qemu-img, fio, libnbd and a raw protocol client)
//! against both front ends of `zdisk serve`: each test runs as is against zdisk's own server
//! (the default) and again, in `through_nbdkit`, against nbdkit running the zdisk plugin.
//! The kernel's ext4 through `zdisk attach` (nbdfuse + loop) is in `attach.rs`; requests
//! no library client sends (invalid, malformed, many pipelined) in `requests.rs`.
//!
//! Run: `cargo test -p zdisk --test interop` (builds the plugin too; see tests/common).
//! Needs nbdkit, libnbd-bin, fio, qemu-utils, e2fsprogs, fuse3; missing tools skip locally
//! and fail under CI=true. Stores are small (64–256 MiB) to keep the suite short.

mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::crash_model::{pattern, Model, BLOCK};
use common::nbd::{self, NbdClient};
use common::{
    assert_success, fio, nbdinfo_json, require, require_libnbd_python, run_ok, sha256, tar_of, Scratch, Server,
    LIBNBD_PYTHON,
};
use serde_json::Value;

const BASIC_TOOLS: &[&str] = &["nbdkit"];

#[test]
fn nbdinfo_shows_size_allocation_and_capabilities() {
    if !require(&["nbdkit", "nbdinfo"]) {
        return;
    }
    let s = Scratch::new("nbdinfo");
    let store = s.format("s.zdisk", "64M", "256M", &[]);
    let server = Server::start(&s, &store, &[]);

    let export = nbdinfo_json(&server.uri);
    assert_eq!(export["export-size"], 256u64 << 20, "{export}");
    let contexts: Vec<&str> = export["contexts"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert!(contexts.contains(&"base:allocation"), "{export}");
    for flag in ["can_flush", "can_fua", "can_multi_conn", "can_trim", "can_zero", "can_fast_zero"] {
        assert_eq!(export[flag], true, "{flag}: {export}");
    }
    assert_eq!(export["is_rotational"], false, "{export}");
    assert_eq!(export["is_read_only"], false, "{export}");

    // Data, written zeroes, a trimmed hole and a zero request that may trim.
    let mut client = NbdClient::connect(&server.socket).unwrap();
    client.write_ok(0, &vec![0xab; 3 << 20]);
    assert_eq!(client.write_zeroes(1 << 20, 1 << 20, nbd::CMD_FLAG_NO_HOLE).unwrap(), 0);
    assert_eq!(client.write_zeroes(2 << 20, 1 << 20, 0).unwrap(), 0);
    assert_eq!(client.trim(0, 64 << 10).unwrap(), 0);
    assert_eq!(client.flush().unwrap(), 0);
    client.disconnect();

    let out = run_ok(Command::new("nbdinfo").arg("--map").arg("--json").arg(&server.uri));
    let map: Value = serde_json::from_str(&out).unwrap();
    let extents: Vec<(u64, u64, u64)> = map
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap(), e["type"].as_u64().unwrap()))
        .collect();
    // type: 0 data, 2 zero, 3 hole+zero.
    let expected = vec![
        (0, 64 << 10, 3),
        (64 << 10, (1 << 20) - (64 << 10), 0),
        (1 << 20, 1 << 20, 2),
        (2 << 20, (256 << 20) - (2 << 20), 3),
    ];
    assert_eq!(extents, expected, "{out}");
    server.stop();

    // Read-only serving: nothing writable is advertised.
    let server = Server::start(&s, &store, &["--readonly"]);
    let export = nbdinfo_json(&server.uri);
    assert_eq!(export["is_read_only"], true, "{export}");
    for flag in ["can_trim", "can_zero"] {
        assert_eq!(export[flag], false, "{flag}: {export}");
    }
    let mut client = NbdClient::connect(&server.socket).unwrap();
    assert_ne!(client.write(8192, &[1; 4096], 0).unwrap(), 0, "a read-only server accepted a write");
    assert_eq!(client.read_ok(1 << 20, 4096), vec![0u8; 4096]);
    assert_eq!(client.read_ok(512 << 10, 4096), vec![0xab; 4096]);
    client.disconnect();
    server.stop();
}

#[test]
fn nbdcopy_round_trips_a_real_file_tree() {
    if !require(&["nbdkit", "nbdcopy", "tar", "sha256sum"]) {
        return;
    }
    let s = Scratch::new("nbdcopy");
    let tree = common::real_tree().parent().unwrap().to_path_buf(); // the whole stdlib
    let archive = s.path("tree.tar");
    let bytes = tar_of(&tree, &archive);
    eprintln!("tree {} -> {bytes} bytes", tree.display());
    let store = s.format("s.zdisk", "256M", "512M", &[]);
    let server = Server::start(&s, &store, &[]);
    run_ok(Command::new("nbdcopy").arg("--flush").arg(&archive).arg(&server.uri));
    let readback = s.path("readback.img");
    run_ok(Command::new("nbdcopy").arg(&server.uri).arg(&readback));
    assert_eq!(std::fs::metadata(&readback).unwrap().len(), 512 << 20);
    std::fs::OpenOptions::new().write(true).open(&readback).unwrap().set_len(bytes).unwrap();
    assert_eq!(sha256(&readback), sha256(&archive), "bytes read back differ");
    server.stop();

    // After a clean restart too.
    let server = Server::start(&s, &store, &[]);
    std::fs::remove_file(&readback).unwrap();
    run_ok(Command::new("nbdcopy").arg(&server.uri).arg(&readback));
    std::fs::OpenOptions::new().write(true).open(&readback).unwrap().set_len(bytes).unwrap();
    assert_eq!(sha256(&readback), sha256(&archive), "bytes read back after restart differ");
    server.stop();
    let stat = s.stat_json(&store);
    assert!(stat["comp_ratio"].as_f64().unwrap() > 1.5, "a stdlib tarball should compress: {stat}");
}

#[test]
fn qemu_img_converts_into_the_disk_and_compares_equal() {
    if !require(&["nbdkit", "qemu-img", "tar"]) {
        return;
    }
    let s = Scratch::new("qemu");
    let archive = s.path("tree.tar");
    tar_of(&common::real_tree(), &archive);
    let source = s.path("source.qcow2");
    run_ok(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "qcow2"]).arg(&archive).arg(&source));
    let store = s.format("s.zdisk", "64M", "2x", &[]);
    let server = Server::start(&s, &store, &[]);
    run_ok(Command::new("qemu-img").args(["convert", "-n", "-f", "qcow2", "-O", "raw"]).arg(&source).arg(&server.uri));
    let out =
        run_ok(Command::new("qemu-img").args(["compare", "-f", "qcow2", "-F", "raw"]).arg(&source).arg(&server.uri));
    assert!(out.contains("Images are identical"), "{out}");
    server.stop();
}

/// (name, buffer_compress_percentage, comp_ratio range the data allows)
const DATA_KINDS: [(&str, u32, f64, f64); 3] =
    [("incompressible", 0, 0.85, 1.10), ("2to1", 50, 1.6, 2.3), ("4to1", 75, 3.0, 4.6)];

#[test]
fn fio_verifies_at_qd1_and_qd32_and_stat_shows_the_ratio() {
    if !require(&["nbdkit", "fio"]) {
        return;
    }
    let s = Scratch::new("fio");
    for (name, percent, low, high) in DATA_KINDS {
        let store = s.format(&format!("{name}.zdisk"), "256M", "1x", &[]);
        let server = Server::start(&s, &store, &[]);
        let common_args = |rw: &str, qd: u32, offset: u64, size: u64| -> Vec<String> {
            vec![
                format!("--name={name}-qd{qd}"),
                format!("--rw={rw}"),
                "--bs=4k".into(),
                format!("--iodepth={qd}"),
                format!("--offset={offset}"),
                format!("--size={size}"),
                format!("--buffer_compress_percentage={percent}"),
                "--buffer_compress_chunk=4096".into(),
                "--refill_buffers".into(),
                "--verify=crc32c".into(),
                "--verify_fatal=1".into(),
                "--randrepeat=0".into(),
            ]
        };
        for (rw, qd, offset, size) in [("write", 1, 0u64, 16u64 << 20), ("randwrite", 32, 16 << 20, 48 << 20)] {
            let report = fio(&server.uri, &common_args(rw, qd, offset, size));
            let job = &report["jobs"][0];
            assert_eq!(job["error"], 0, "{name} {rw} QD{qd}: {job}");
            assert_eq!(job["write"]["io_bytes"].as_u64().unwrap(), size, "{name} {rw} QD{qd}");
            // fio's verify phase read everything back.
            assert_eq!(job["read"]["io_bytes"].as_u64().unwrap(), size, "{name} {rw} QD{qd} verify");
        }
        server.stop();
        let stat = s.stat_json(&store);
        let ratio = stat["comp_ratio"].as_f64().unwrap();
        eprintln!("{name}: comp_ratio {ratio:.3}, write_amplification {}", stat["write_amplification"]);
        assert_eq!(stat["logical_size"], 64u64 << 20, "{name}: {stat}");
        assert!((low..=high).contains(&ratio), "{name}: comp_ratio {ratio} outside {low}..{high}: {stat}");
        let out = s.zdisk_ok(&["check", store.to_str().unwrap()]);
        assert!(out.contains("clean"), "{out}");
    }
}

#[test]
fn four_connections_write_disjoint_ranges_at_once() {
    four_connections_write_disjoint_ranges("multiconn", &[]);
}

/// The native front end's `--loops 1`: one event loop takes all four connections.
#[test]
fn one_event_loop_serves_four_connections_writing_at_once() {
    four_connections_write_disjoint_ranges("one-loop", &["--loops", "1"]);
}

fn four_connections_write_disjoint_ranges(name: &str, serve_args: &[&str]) {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new(name);
    let store = s.format("s.zdisk", "128M", "2x", &[]);
    let server = Server::start(&s, &store, serve_args);
    if let Some(at) = serve_args.iter().position(|&a| a == "--loops") {
        // A thread takes its name once it first runs, which may be after the server is up:
        // counted again for a few seconds until the count is what was asked.
        let pid = server.server_pid();
        let count_loops = || {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .unwrap()
                .flatten()
                .filter(|task| {
                    std::fs::read_to_string(task.path().join("comm")).is_ok_and(|c| c.starts_with("zdisk-nbd-loop"))
                })
                .count()
                .to_string()
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut loops = count_loops();
        while loops != serve_args[at + 1] && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            loops = count_loops();
        }
        assert_eq!(loops, serve_args[at + 1], "event loop threads");
    }
    let region = 16u64 << 20;
    let seed = 0x5eed_0004;
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let socket = server.socket.clone();
            std::thread::spawn(move || {
                use rand::{Rng, SeedableRng};
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed + t);
                let mut client = NbdClient::connect(&socket).unwrap();
                let base = t * region;
                let mut model = vec![0u8; region as usize];
                for i in 0..400u64 {
                    let length = rng.gen_range(1..=128 << 10) as usize;
                    let offset = rng.gen_range(0..region - length as u64);
                    let data = pattern(seed, t * 1_000_000 + i, offset, length);
                    client.write_ok(base + offset, &data);
                    model[offset as usize..offset as usize + length].copy_from_slice(&data);
                    if i % 100 == 99 {
                        assert_eq!(client.flush().unwrap(), 0);
                    }
                }
                client.disconnect();
                model
            })
        })
        .collect();
    let models: Vec<Vec<u8>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let mut client = NbdClient::connect(&server.socket).unwrap();
    for (t, model) in models.iter().enumerate() {
        let got = client.read_ok(t as u64 * region, region as usize);
        assert!(got == *model, "connection {t}'s range differs (seed {seed:#x})");
    }
    client.disconnect();
    server.stop();
    // And after a clean restart.
    let server = Server::start(&s, &store, serve_args);
    let mut client = NbdClient::connect(&server.socket).unwrap();
    for (t, model) in models.iter().enumerate() {
        assert!(client.read_ok(t as u64 * region, region as usize) == *model, "range {t} differs after restart");
    }
    client.disconnect();
    server.stop();
}

/// Concurrent partial-block requests through NBD, two in flight on one connection with
/// libnbd's asynchronous calls, every pairing of write, write-zeroes and trim: no update is
/// lost (`tests/scripts/partial_block_races.py`).
#[test]
fn concurrent_partial_block_requests_through_libnbd_never_lose_each_other() {
    if !require(BASIC_TOOLS) || !require_libnbd_python() {
        return;
    }
    let s = Scratch::new("races");
    let store = s.format("s.zdisk", "64M", "32M", &[]);
    let server = Server::start(&s, &store, &[]);
    let seed: u64 = rand::random::<u32>() as u64;
    println!("seed {seed}");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/partial_block_races.py");
    let output = std::process::Command::new(LIBNBD_PYTHON)
        .arg(&script)
        .args([&server.uri, &seed.to_string(), "2000"])
        .output()
        .unwrap();
    assert_success(&output, &format!("partial_block_races.py (seed {seed})"));
    server.stop();
}

/// The scenario of "never wrong data": a store written in 256 KiB writes, each flushed, its
/// server killed; one bit flipped at a quarter, a half and three quarters of the replay
/// window (records after the newest checkpoint, `docs/format.md`). `zdisk check` exits 3 and
/// names the damage; served again, every block reads its latest flushed value or fails
/// with EIO — none reads its previous contents.
#[test]
fn a_flipped_bit_in_the_replay_window_never_yields_older_data() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("flip");
    let store = s.format("s.zdisk", "64M", "32M", &[]);
    let server = Server::start(&s, &store, &[]);
    let seed = rand::random::<u32>() as u64;
    println!("seed {seed}");
    let mut client = NbdClient::connect(&server.socket).unwrap();
    let written = 24usize << 20;
    for (i, offset) in (0..written).step_by(256 << 10).enumerate() {
        client.write_ok(offset as u64, &pattern(seed, i as u64, offset as u64, 256 << 10));
        assert_eq!(client.flush().unwrap(), 0);
    }
    let expected: Vec<u8> = (0..written)
        .step_by(256 << 10)
        .enumerate()
        .flat_map(|(i, offset)| pattern(seed, i as u64, offset as u64, 256 << 10))
        .collect();
    server.crash();
    let crashed = std::fs::read(&store).unwrap();
    let window = zdisk_engine::sim::inspect::replay_window(&crashed);
    assert!(window.len() >= 8, "the replay window holds {} records", window.len());
    for quarter in 1..=3 {
        // A data record (links, markers and map pages map no block: check notes their damage).
        let record = window[window.len() * quarter / 4..].iter().find(|r| !r.fragments.is_empty()).unwrap();
        let mut damaged = crashed.clone();
        // Inside a fragment's compressed bytes: the most likely place for a flipped bit.
        let at = record.fragments.first().map_or(record.head.start + 9, |(_, f)| f.start + 40);
        damaged[at as usize] ^= 1 << (seed % 8);
        let copy = s.path(&format!("q{quarter}.zdisk"));
        std::fs::write(&copy, &damaged).unwrap();
        let output = s.zdisk().args(["check", "--json"]).arg(&copy).output().unwrap();
        assert_eq!(output.status.code(), Some(3), "check should find the flipped bit at byte {at}: {output:?}");
        let report: Value = serde_json::from_slice(&output.stdout).unwrap();
        let located = report["damage"].as_array().unwrap().iter().any(|d| {
            let offset = d["offset_bytes"].as_u64().unwrap();
            offset >= record.head.start && offset < record.tail.end
        });
        assert!(located, "check names the damaged record: {report}");
        let server = Server::start(&s, &copy, &[]);
        let mut client = NbdClient::connect(&server.socket).unwrap();
        let (mut good, mut errors) = (0, 0);
        for block in 0..written / 4096 {
            let offset = (block * 4096) as u64;
            let mut data = vec![0u8; 4096];
            match client.read(offset, &mut data).unwrap() {
                0 => {
                    let want = &expected[block * 4096..(block + 1) * 4096];
                    assert!(data == want, "block {block} is not its flushed value (quarter {quarter}, seed {seed})");
                    good += 1;
                }
                _ => errors += 1,
            }
        }
        println!("quarter {quarter}: {good} blocks correct, {errors} EIO");
        assert!(errors <= 1, "one flipped bit costs at most one block");
        client.disconnect();
        server.stop();
    }
}

/// The flush proof (`docs/guarantees.md`): a write flushed just before the server is
/// killed — before anything else reaches the log, or the idle marker — then decay of more
/// than one bit in its record. Before flush proofs, recovery took that for a torn write and
/// the blocks read what they held before the flushed write: stale data. Now each reads its
/// flushed value or fails with EIO, and `zdisk check` names the damage.
#[test]
fn decay_of_the_last_flushed_write_never_yields_its_previous_contents() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("lastflush");
    let store = s.format("s.zdisk", "64M", "32M", &[]);
    let server = Server::start(&s, &store, &[]);
    let seed = rand::random::<u32>() as u64;
    println!("seed {seed}");
    let length = 256usize << 10;
    let (old, new) = (pattern(seed, 1, 0, length), pattern(seed, 2, 0, length));
    let mut client = NbdClient::connect(&server.socket).unwrap();
    client.write_ok(0, &old);
    assert_eq!(client.flush().unwrap(), 0);
    client.write_ok(0, &new);
    assert_eq!(client.flush().unwrap(), 0);
    server.crash();
    let crashed = std::fs::read(&store).unwrap();
    let window = zdisk_engine::sim::inspect::replay_window(&crashed);
    let last = window.iter().rev().find(|r| !r.fragments.is_empty()).unwrap();
    assert!(
        last.fragments.iter().all(|(lba, _)| *lba < (length / 4096) as u64),
        "the last data record is the new write"
    );
    let mut damaged = crashed;
    // Three flipped bits in one fragment: no single-bit trial repairs them.
    let at = last.fragments[0].1.start + 40;
    for bit in 0..3u64 {
        damaged[(at + bit * 7) as usize] ^= 1 << ((seed + bit) % 8);
    }
    std::fs::write(&store, &damaged).unwrap();
    let output = s.zdisk().args(["check", "--json"]).arg(&store).output().unwrap();
    assert_eq!(output.status.code(), Some(3), "check should find the damage at byte {at}: {output:?}");
    let server = Server::start(&s, &store, &[]);
    let mut client = NbdClient::connect(&server.socket).unwrap();
    let mut errors = 0;
    for block in 0..length / 4096 {
        let mut data = vec![0u8; 4096];
        let range = block * 4096..(block + 1) * 4096;
        match client.read((block * 4096) as u64, &mut data).unwrap() {
            0 => {
                assert!(data[..] != old[range.clone()], "block {block} reads its previous contents (seed {seed})");
                assert!(data[..] == new[range], "block {block} reads neither value (seed {seed})");
            }
            _ => errors += 1,
        }
    }
    assert!(errors >= 1, "the damaged block must fail its read (seed {seed})");
    client.disconnect();
    server.stop();
    // The proof decayed too (both copies): what it said is unknown, so the store serves
    // degraded — every read fails, none returns the previous contents — until the loss is
    // accepted, which opens it for writing again.
    let proof = zdisk_engine::sim::inspect::FLUSH_PROOF;
    damaged[proof.start + 9] ^= 1;
    damaged[proof.start + 2048 + 21] ^= 4;
    let unknown = s.path("unknown.zdisk");
    std::fs::write(&unknown, &damaged).unwrap();
    let output = s.zdisk().args(["check"]).arg(&unknown).output().unwrap();
    assert_eq!(output.status.code(), Some(3), "check should report the possible loss: {output:?}");
    let server = Server::start(&s, &unknown, &[]);
    let mut client = NbdClient::connect(&server.socket).unwrap();
    for block in 0..length / 4096 {
        let mut data = vec![0u8; 4096];
        let status = client.read((block * 4096) as u64, &mut data).unwrap();
        assert_ne!(status, 0, "block {block} read while the proof is unknown (seed {seed})");
    }
    assert_ne!(client.write(0, &new[..4096], 0).unwrap(), 0, "a degraded store takes no writes");
    client.disconnect();
    server.stop();
    let server = Server::start(&s, &unknown, &["--accept-data-loss"]);
    let mut client = NbdClient::connect(&server.socket).unwrap();
    client.write_ok(0, &new[..4096]);
    assert_eq!(client.flush().unwrap(), 0);
    client.disconnect();
    server.stop();
}

#[test]
fn writes_flushed_before_a_crash_survive_it() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let seed: u64 = std::env::var("ZDISK_CRASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    eprintln!("crash test seed {seed} (rerun with ZDISK_CRASH_SEED={seed})");
    let s = Scratch::new("crash");
    let store = s.format("s.zdisk", "128M", "1x", &[]);
    let writers = 2usize;
    let blocks_per_writer = 4096usize; // 16 MiB each
    let models: Vec<Arc<Mutex<Model>>> =
        (0..writers).map(|_| Arc::new(Mutex::new(Model::new(seed, blocks_per_writer)))).collect();

    for round in 0..3u64 {
        let server = Server::start(&s, &store, &[]);
        let stop = Arc::new(AtomicBool::new(false));
        let handles: Vec<_> = (0..writers)
            .map(|w| {
                let (model, socket, stop) = (models[w].clone(), server.socket.clone(), stop.clone());
                std::thread::spawn(move || crash_test_writer(&socket, &model, round, w, &stop))
            })
            .collect();
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xc0ffee ^ round);
        std::thread::sleep(Duration::from_millis(rng.gen_range(800..2500)));
        server.crash();
        stop.store(true, Ordering::Relaxed);
        let writes: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        eprintln!("round {round}: {writes} writes acknowledged before the crash");
        assert!(writes > 0, "no writes happened before the crash");

        // Recover and check every block against the model.
        let server = Server::start(&s, &store, &[]);
        let mut client = NbdClient::connect(&server.socket).unwrap();
        for (w, model) in models.iter().enumerate() {
            let bytes = client.read_ok((w * blocks_per_writer * BLOCK) as u64, blocks_per_writer * BLOCK);
            model.lock().unwrap().check_recovered(&bytes, &format!("round {round}: writer {w}"));
        }
        client.disconnect();
        server.stop();
    }
    let out = s.zdisk_ok(&["check", store.to_str().unwrap()]);
    assert!(out.contains("clean"), "{out}");
}

/// One writer of the crash test: writes of 1–16 blocks at random in its own range, one in
/// 16 with FUA, a flush every 4–64 writes, each recorded in `model` before it is sent, until
/// stopped or the server is gone. Returns the writes acknowledged.
fn crash_test_writer(socket: &Path, model: &Mutex<Model>, round: u64, writer: usize, stop: &AtomicBool) -> u64 {
    use rand::{Rng, SeedableRng};
    let (seed, blocks) = {
        let m = model.lock().unwrap();
        (m.seed, m.blocks())
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (round << 8) ^ writer as u64);
    let Ok(mut client) = NbdClient::connect(socket) else { return 0 };
    let base = (writer * blocks) as u64;
    let mut writes = 0u64;
    let mut until_flush = rng.gen_range(4..64);
    while !stop.load(Ordering::Relaxed) {
        let count = rng.gen_range(1..=16usize);
        let first = rng.gen_range(0..blocks - count);
        // Versions: unique across writers and rounds, increasing per writer.
        let version = ((round + 1) << 40) | ((writer as u64) << 32) | (writes + 1);
        let data = model.lock().unwrap().write(version, first..first + count);
        let fua = rng.gen_ratio(1, 16);
        let flags = if fua { nbd::CMD_FLAG_FUA } else { 0 };
        match client.write((base + first as u64) * BLOCK as u64, &data, flags) {
            Ok(0) => writes += 1,
            _ => break, // the server is gone
        }
        if fua {
            model.lock().unwrap().written_with_fua(version, first..first + count);
        }
        until_flush -= 1;
        if until_flush == 0 {
            until_flush = rng.gen_range(4..64);
            match client.flush() {
                Ok(0) => model.lock().unwrap().flushed(),
                _ => break,
            }
        }
    }
    writes
}

fn http_get(addr: &str, path: &str) -> (String, String) {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn stat_is_live_while_served_and_metrics_are_served() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("live");
    let store = s.format("s.zdisk", "64M", "2x", &[]);
    let addr = format!("127.0.0.1:{}", free_port());
    let server = Server::start(&s, &store, &["--metrics", &addr, "--read-cache", "16M"]);
    let mut c = NbdClient::connect(&server.socket).unwrap();
    c.write_ok(0, &pattern(3, 3, 0, 4 << 20));
    assert_eq!(c.flush().unwrap(), 0);
    // Read twice: the second pass finds what the first read from disk in the read cache.
    for _ in 0..2 {
        assert!(c.read_ok(0, 1 << 20) == pattern(3, 3, 0, 1 << 20));
    }
    c.disconnect();

    // At once, exact: stat asks the server for a snapshot taken now (it read a file the
    // server rewrites every second, and lagged what a client had just written).
    let stat = s.stat_json(&store);
    assert_eq!(stat["source"], "live", "{stat}");
    assert_eq!(stat["logical_size"], 4u64 << 20, "{stat}");
    assert_eq!(stat["host_write_bytes"], 4u64 << 20, "{stat}");
    assert!(stat["read_cache_hits"].as_u64().unwrap() > 0, "--read-cache did not reach the engine: {stat}");
    let ratio = stat["comp_ratio"].as_f64().unwrap();
    assert!((1.5..2.5).contains(&ratio), "{stat}");
    let human = s.zdisk_ok(&["stat", store.to_str().unwrap()]);
    // The serving process, whichever front end it is (it said "nbdkit" for the native one too).
    assert!(human.contains("source  live (served by pid "), "{human}");

    let (status, body) = http_get(&addr, "/metrics");
    assert!(status.contains("200"), "{status}");
    for needle in [
        "zdisk_comp_ratio{",
        "zdisk_free_space{",
        "zdisk_write_amplification{",
        "zdisk_space_flag{",
        "# TYPE zdisk_space_flag gauge",
        "zdisk_backing_write_bytes_total{",
        "# TYPE zdisk_backing_write_bytes_total counter",
        "zdisk_state{uuid=",
        "state=\"ok\"",
        "zdisk_requests_total{",
        "op=\"write\"",
        "zdisk_request_duration_seconds_bucket{",
        "le=\"+Inf\"",
    ] {
        assert!(body.contains(needle), "/metrics lacks {needle}:\n{body}");
    }
    let writes: f64 = body
        .lines()
        .find(|l| l.starts_with("zdisk_request_duration_seconds_count") && l.contains("op=\"write\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(writes >= 1.0, "write latency histogram is empty");
    let (status, body) = http_get(&addr, "/stats");
    assert!(status.contains("200"));
    let live: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(live["stats"]["logical_size"], 4u64 << 20);
    let (status, _) = http_get(&addr, "/nope");
    assert!(status.contains("404"));

    // A second server on the same store is refused, and check refuses a served store.
    let second = s
        .zdisk()
        .args(["serve", store.to_str().unwrap(), "--unix", s.path("second.sock").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("already open"), "{second:?}");
    let check = s.zdisk().args(["check", store.to_str().unwrap()]).output().unwrap();
    assert!(!check.status.success());

    // Grow while served: new connections see the new size; shrinking is refused.
    let native = s.stat_json(&store)["native_capacity"].as_u64().unwrap();
    s.zdisk_ok(&["resize", store.to_str().unwrap(), "--logical-size", "4x"]);
    assert_eq!(NbdClient::connect(&server.socket).unwrap().size, 4 * native);
    let shrink = s.zdisk().args(["resize", store.to_str().unwrap(), "--logical-size", "1x"]).output().unwrap();
    assert!(!shrink.status.success());
    assert!(String::from_utf8_lossy(&shrink.stderr).contains("shrink"), "{shrink:?}");

    server.stop();
    let stat = s.stat_json(&store);
    assert_eq!(stat["source"], "offline");
    assert_eq!(stat["provisioned_cap"], 4 * native);
    assert_eq!(stat["logical_size"], 4u64 << 20);
    let leftovers: Vec<_> =
        std::fs::read_dir(s.run_dir()).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
    assert!(leftovers.is_empty(), "live files left after a clean stop: {leftovers:?}");
}

// The same tests against `zdisk serve --frontend nbdkit`.
through_nbdkit!(
    nbdinfo_shows_size_allocation_and_capabilities,
    nbdcopy_round_trips_a_real_file_tree,
    qemu_img_converts_into_the_disk_and_compares_equal,
    fio_verifies_at_qd1_and_qd32_and_stat_shows_the_ratio,
    four_connections_write_disjoint_ranges_at_once,
    concurrent_partial_block_requests_through_libnbd_never_lose_each_other,
    a_flipped_bit_in_the_replay_window_never_yields_older_data,
    decay_of_the_last_flushed_write_never_yields_its_previous_contents,
    writes_flushed_before_a_crash_survive_it,
    stat_is_live_while_served_and_metrics_are_served,
);
