//! Requests no library client sends, through the tests' own raw protocol client
//! (`common/nbd.rs`), against both front ends of `zdisk serve` (again in `through_nbdkit`):
//! invalid requests get their NBD error and the connection goes on; malformed input closes
//! only its own connection; many requests sent in one write (a pipelining client) are each
//! answered once. Real clients are in `interop.rs`.
//!
//! Run: `cargo test -p zdisk --test requests`. Needs nbdkit (for the nbdkit front end).

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::crash_model::pattern;
use common::nbd::{self, NbdClient};
use common::{require, Scratch, Server};

const BASIC_TOOLS: &[&str] = &["nbdkit"];

#[test]
fn bad_requests_get_nbd_errors_and_the_server_keeps_serving() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("badinput");
    let store = s.format("s.zdisk", "64M", "64M", &[]);
    let server = Server::start(&s, &store, &[]);
    let mut c = NbdClient::connect(&server.socket).unwrap();
    let size = c.size;
    assert_eq!(size, 64 << 20);
    let base = pattern(7, 7, 0, 64 << 10);
    c.write_ok(0, &base);
    c.write_ok(size - 8192, &[0x11; 8192]);

    let einval = libc::EINVAL as u32;
    let enospc = libc::ENOSPC as u32;
    let mut buf = vec![0u8; 4096];
    // Out of range.
    assert_eq!(c.read(size, &mut buf).unwrap(), einval, "read at the end");
    assert_eq!(c.read(size - 2048, &mut buf).unwrap(), einval, "read across the end");
    assert_eq!(c.read(u64::MAX - 4095, &mut buf).unwrap(), einval, "read at 2^64-4096");
    assert_eq!(c.write(size - 2048, &[1; 4096], 0).unwrap(), enospc, "write across the end");
    assert_eq!(c.write(size, &[1; 512], 0).unwrap(), enospc, "write at the end");
    assert_eq!(c.trim(size - 4096, 8192).unwrap(), einval, "trim across the end");
    assert_ne!(c.write_zeroes(size, 4096, 0).unwrap(), 0, "zero past the end");
    // Zero-length requests: an error or a no-op, never a crash or a change. (nbdkit 1.32
    // refuses them itself as an empty range: EINVAL, or ENOSPC for a write.)
    for (what, error) in [
        ("read", c.request(nbd::CMD_READ, 0, 4096, 0, &[], None).unwrap()),
        ("write", c.request(nbd::CMD_WRITE, 0, 4096, 0, &[], None).unwrap()),
        ("trim", c.trim(4096, 0).unwrap()),
        ("zero", c.write_zeroes(4096, 0, 0).unwrap()),
    ] {
        eprintln!("zero-length {what}: errno {error}");
        assert!(error == 0 || error == einval || error == enospc, "zero-length {what}: errno {error}");
    }
    // An unknown command and an unknown flag.
    assert_ne!(c.request(99, 0, 0, 4096, &[], None).unwrap(), 0, "unknown command");
    // The connection is still usable, and nothing changed.
    assert!(c.read_ok(0, 64 << 10) == base, "bad requests changed data");
    assert_eq!(c.read_ok(size - 8192, 8192), vec![0x11; 8192]);

    // Unaligned requests are served exactly (read-modify-write in the engine).
    let mut model = base.clone();
    for (offset, length) in [(4093usize, 3usize), (1, 1), (5000, 9000), (65535, 1)] {
        let data = pattern(9, offset as u64, offset as u64, length);
        c.write_ok(offset as u64, &data);
        model[offset..offset + length].copy_from_slice(&data);
    }
    assert_eq!(c.write_zeroes(6000, 100, nbd::CMD_FLAG_NO_HOLE).unwrap(), 0);
    model[6000..6100].fill(0);
    assert_eq!(c.write_zeroes(20000, 3000, nbd::CMD_FLAG_FAST_ZERO).unwrap(), 0, "fast zero");
    model[20000..23000].fill(0);
    assert_eq!(c.write(30001, &[0x77; 777], nbd::CMD_FLAG_FUA).unwrap(), 0, "FUA write");
    model[30001..30778].fill(0x77);
    assert_same(&c.read_ok(0, 64 << 10), &model, "unaligned requests");
    let mut odd = vec![0u8; 3];
    assert_eq!(c.read(4093, &mut odd).unwrap(), 0);
    assert_eq!(odd, model[4093..4096]);
    // An unaligned trim may zero or keep its bytes, but never touches its neighbours.
    assert_eq!(c.trim(40000, 100).unwrap(), 0);
    let after = c.read_ok(0, 64 << 10);
    assert_eq!(after[..40000], model[..40000]);
    assert_eq!(after[40100..], model[40100..]);
    c.disconnect();

    // The server still serves new connections.
    let mut c = NbdClient::connect(&server.socket).unwrap();
    assert_eq!(c.read_ok(size - 8192, 8192), vec![0x11; 8192]);
    c.disconnect();
    server.stop();
}

/// A pipelining client's requests arrive many to a `recv`; the native server parses them
/// together and shares the small writes between its loop and a worker, a batch each, with
/// their replies gathered (`server.rs` `share_small_writes`). Rounds of 98 requests sent at
/// once — 4 KiB writes, unaligned 1 KiB writes, 16 KiB writes, trims, zeroings, 20 KiB
/// writes (too large to share), a FUA write, a flush and a write past the end — each get one
/// reply with their own result, and every byte reads back as its request left it.
#[test]
fn pipelined_small_requests_are_each_answered_once_and_land_where_addressed() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("pipeline");
    let store = s.format("s.zdisk", "64M", "64M", &[]);
    let server = Server::start(&s, &store, &[]);
    let mut c = NbdClient::connect(&server.socket).unwrap();
    let slot = 64usize << 10;
    let slots = 96;
    let mut model = vec![0u8; slot * slots];
    let enospc = libc::ENOSPC as u32;
    for round in 0..6u64 {
        // Every request in its own slot: requests in flight together have no order.
        let mut payloads: Vec<Vec<u8>> = Vec::new();
        let mut shapes = Vec::new();
        for i in 0..slots {
            let at = i * slot + (round as usize % 3) * 4096;
            let (command, flags, offset, length) = match (i + round as usize) % 10 {
                0..=4 => (nbd::CMD_WRITE, 0, at, 4096),
                5 => (nbd::CMD_WRITE, 0, at + 1000, 1024),
                6 => (nbd::CMD_WRITE, 0, at, 16 << 10),
                7 => (nbd::CMD_TRIM, 0, at, 8192),
                8 => (nbd::CMD_WRITE_ZEROES, nbd::CMD_FLAG_NO_HOLE, at + 512, 3000),
                _ => (nbd::CMD_WRITE, 0, at, 20 << 10),
            };
            let flags = if i == 41 { nbd::CMD_FLAG_FUA } else { flags };
            let payload = match command {
                nbd::CMD_WRITE => pattern(round, i as u64, offset as u64, length),
                _ => Vec::new(),
            };
            match command {
                nbd::CMD_WRITE => model[offset..offset + length].copy_from_slice(&payload),
                _ => model[offset..offset + length].fill(0),
            }
            shapes.push((command, flags, offset as u64, length as u32));
            payloads.push(payload);
        }
        shapes.insert(50, (nbd::CMD_FLUSH, 0, 0, 0));
        payloads.insert(50, Vec::new());
        shapes.push((nbd::CMD_WRITE, 0, c.size, 4096));
        payloads.push(vec![1; 4096]);
        let requests: Vec<nbd::Pipelined<'_>> = shapes
            .iter()
            .zip(&payloads)
            .map(|(&(command, flags, offset, length), payload)| nbd::Pipelined {
                command,
                flags,
                offset,
                length,
                payload,
            })
            .collect();
        let errors = c.pipeline(&requests).unwrap();
        let (past_end, served) = errors.split_last().unwrap();
        assert_eq!(*past_end, enospc, "round {round}: the write past the end");
        for (i, error) in served.iter().enumerate() {
            assert_eq!(*error, 0, "round {round}: request {i} ({:?}) failed", shapes[i]);
        }
        assert_same(&c.read_ok(0, model.len()), &model, &format!("round {round}: pipelined requests"));
    }
    c.disconnect();
    server.stop();
    let out = s.zdisk_ok(&["check", store.to_str().unwrap()]);
    assert!(out.contains("clean"), "{out}");
}

/// Flushes in flight together share engine flushes (the native front end's group commit,
/// `crates/nbd/src/server/requests.rs`): 4 rounds of 16 writes and then 32 flushes sent in
/// one write each get exactly one reply per request, the writes read back, and the engine
/// flushed (`flush_ops`) at most half as often as it was asked — one flush per request, the
/// server before, counts 128. Native front end only: nbdkit calls the engine once per flush.
#[test]
fn flushes_in_flight_together_share_engine_flushes() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("flushes");
    let store = s.format("s.zdisk", "64M", "64M", &[]);
    let server = Server::start(&s, &store, &[]);
    let mut c = NbdClient::connect(&server.socket).unwrap();
    let (rounds, writes, flushes) = (4usize, 16usize, 32usize);
    let mut model = vec![0u8; rounds * writes * 4096];
    for round in 0..rounds {
        let payloads: Vec<Vec<u8>> = (0..writes)
            .map(|i| {
                let offset = (round * writes + i) * 4096;
                let payload = pattern(round as u64, i as u64, offset as u64, 4096);
                model[offset..offset + 4096].copy_from_slice(&payload);
                payload
            })
            .collect();
        let mut requests: Vec<nbd::Pipelined<'_>> = payloads
            .iter()
            .enumerate()
            .map(|(i, payload)| nbd::Pipelined {
                command: nbd::CMD_WRITE,
                flags: 0,
                offset: ((round * writes + i) * 4096) as u64,
                length: 4096,
                payload,
            })
            .collect();
        let flush = nbd::Pipelined { command: nbd::CMD_FLUSH, flags: 0, offset: 0, length: 0, payload: &[] };
        requests.extend((0..flushes).map(|_| flush));
        let errors = c.pipeline(&requests).unwrap();
        assert!(errors.iter().all(|&e| e == 0), "round {round}: errors {errors:?}");
    }
    assert_same(&c.read_ok(0, model.len()), &model, "the writes before the flushes");
    c.disconnect();
    server.stop();
    let stat = s.stat_json(&store);
    let engine_flushes = stat["flush_ops"].as_u64().expect("flush_ops in zdisk stat");
    let asked = (rounds * flushes) as u64;
    eprintln!("{asked} flush requests, {engine_flushes} engine flushes");
    assert!(
        engine_flushes >= 1 && engine_flushes * 2 <= asked,
        "{asked} flush requests, {engine_flushes} engine flushes"
    );
    let out = s.zdisk_ok(&["check", store.to_str().unwrap()]);
    assert!(out.contains("clean"), "{out}");
}

/// Malformed input closes its own connection and nothing else: garbage in place of the
/// handshake, a request with a bad magic, a write announcing a payload over the 32 MiB cap.
/// Another client's connection, opened before and kept throughout, sees every byte it wrote
/// and keeps writing; the store checks clean afterwards.
#[test]
fn malformed_input_closes_only_that_connection() {
    if !require(BASIC_TOOLS) {
        return;
    }
    let s = Scratch::new("malformed");
    let store = s.format("s.zdisk", "64M", "64M", &[]);
    let server = Server::start(&s, &store, &[]);
    let mut good = NbdClient::connect(&server.socket).unwrap();
    let first = pattern(3, 0, 0, 256 << 10);
    good.write_ok(0, &first);

    // Garbage where the client's flags and options belong.
    let mut raw = std::os::unix::net::UnixStream::connect(&server.socket).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut greeting = [0u8; 18];
    raw.read_exact(&mut greeting).unwrap();
    let _ = raw.write_all(&[0xff; 4096]);
    let mut rest = Vec::new();
    let closed = match raw.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    };
    assert!(closed, "a handshake of garbage left the connection open");

    // A request with a bad magic.
    let mut bad = NbdClient::connect(&server.socket).unwrap();
    bad.send_raw(&[0x5a; 28]).unwrap();
    assert!(bad.closed_by_server_within(Duration::from_secs(20)), "a bad request magic left the connection open");

    // A write announcing 64 MiB of payload (over the cap), followed by 64 KiB: the native
    // server closes the connection; nbdkit 1.32 waits to read the payload, which is fine too
    // as long as nothing is written.
    let mut big = NbdClient::connect(&server.socket).unwrap();
    let mut header = Vec::new();
    header.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    header.extend_from_slice(&0u16.to_be_bytes());
    header.extend_from_slice(&nbd::CMD_WRITE.to_be_bytes());
    header.extend_from_slice(&7u64.to_be_bytes());
    header.extend_from_slice(&0u64.to_be_bytes());
    header.extend_from_slice(&(64u32 << 20).to_be_bytes());
    big.send_raw(&header).unwrap();
    let _ = big.send_raw(&[0xee; 64 << 10]);
    let closed = big.closed_by_server_within(Duration::from_secs(if common::frontend() == "native" { 20 } else { 2 }));
    assert!(closed || common::frontend() == "nbdkit", "a write over the payload cap left the connection open");

    // The first client's connection was never disturbed, nor was the store.
    assert_same(&good.read_ok(0, 256 << 10), &first, "the good connection's data");
    let second = pattern(4, 64, 0, 128 << 10);
    good.write_ok(64 << 10, &second);
    assert_eq!(good.flush().unwrap(), 0);
    let mut expected = first.clone();
    expected[64 << 10..192 << 10].copy_from_slice(&second);
    assert_same(&good.read_ok(0, 256 << 10), &expected, "after more writes");
    good.disconnect();
    server.stop();
    let check = s.zdisk_ok(&["check", store.to_str().unwrap()]);
    assert!(check.contains("clean"), "{check}");
}

/// Asserts equal bytes, naming the differing ranges instead of dumping both buffers.
fn assert_same(got: &[u8], expected: &[u8], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    let mut ranges = Vec::new();
    let mut i = 0;
    while i < got.len() {
        if got[i] != expected[i] {
            let start = i;
            while i < got.len() && got[i] != expected[i] {
                i += 1;
            }
            ranges.push(start..i);
        }
        i += 1;
    }
    assert!(ranges.is_empty(), "{what}: bytes differ in {ranges:?}");
}

through_nbdkit!(
    bad_requests_get_nbd_errors_and_the_server_keeps_serving,
    pipelined_small_requests_are_each_answered_once_and_land_where_addressed,
    malformed_input_closes_only_that_connection,
);
