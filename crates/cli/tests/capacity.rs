//! Native capacity through NBD with real clients (docs/space.md, "Native capacity and
//! over-provisioning"; docs/guarantees.md, contract item 6).

mod common;

use common::*;

/// Native capacity is a promise (docs/space.md, "Native capacity and over-provisioning"): a
/// store formatted at the default `1x` is filled completely with incompressible data through
/// NBD, then overwritten twice at random, in 4 KiB and in 128 KiB writes, 32 requests in
/// flight — not one ENOSPC, and every block reads back its last write
/// (`tests/scripts/fill_and_overwrite.py`). The same at 2x with data that compresses 2:1.
#[test]
fn a_store_at_native_capacity_is_filled_and_overwritten_through_nbd() {
    if !require(&["nbdkit"]) || !require_libnbd_python() {
        return;
    }
    let s = Scratch::new("native");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scripts/fill_and_overwrite.py");
    for (logical, data) in [("1x", "incompressible"), ("2x", "2to1")] {
        let store = s.format(&format!("{data}.zdisk"), "64M", logical, &[]);
        let server = Server::start(&s, &store, &[]);
        let seed: u64 = rand::random::<u32>() as u64;
        println!("{logical} {data}: seed {seed}");
        let output = std::process::Command::new(LIBNBD_PYTHON)
            .arg(&script)
            .args([&server.uri, &seed.to_string(), data])
            .output()
            .unwrap();
        println!("{}", String::from_utf8_lossy(&output.stdout));
        assert_success(&output, &format!("fill_and_overwrite.py at {logical} with {data} data (seed {seed})"));
        server.stop();
        let stat = s.stat_json(&store);
        let times = if logical == "2x" { 2 } else { 1 };
        assert_eq!(stat["provisioned_cap"], stat["native_capacity"].as_u64().unwrap() * times, "{stat}");
        // At native capacity a full store is not "low": it cannot run out.
        assert_eq!(
            stat["space_flag"],
            if times == 1 { 0 } else { stat["space_flag"].as_u64().unwrap().min(1) },
            "{stat}"
        );
        let out = s.zdisk_ok(&["check", store.to_str().unwrap()]);
        assert!(out.contains("clean"), "{out}");
    }
}
