//! Exhaustive small-scope crash test: every sequence of up to three operations over a few
//! blocks, with power cut at every backing write boundary (and after the last one), each
//! recovered image checked against the contract.

mod common;

use std::sync::Arc;

use common::*;
use zdisk_engine::sim::{Faults, SimDisk};
use zdisk_engine::{Codec, Durability, Store};

#[derive(Debug, Clone, Copy)]
enum Op {
    /// 20 incompressible blocks: more than a 64 KiB segment holds, so a multi-record group.
    BigWrite,
    WriteUnalignedAcross01,
    FuaWriteBlock2,
    TrimBlocks01,
    ZeroUnaligned,
    Flush,
    Checkpoint,
    CollectGarbage,
}

const OPS: [Op; 8] = [
    Op::BigWrite,
    Op::WriteUnalignedAcross01,
    Op::FuaWriteBlock2,
    Op::TrimBlocks01,
    Op::ZeroUnaligned,
    Op::Flush,
    Op::Checkpoint,
    Op::CollectGarbage,
];

const LOGICAL: u64 = 24 * BLOCK;

fn data(len: usize, tag: u8) -> Vec<u8> {
    (0..len).map(|i| if i % 3 == 0 { tag } else { (i as u8).wrapping_mul(31) ^ tag }).collect()
}

/// Runs `sequence` on a store over `disk`; returns the requests issued (the last one possibly
/// in flight at the crash) and the model after the last completed flush.
fn run_sequence(disk: &Arc<SimDisk>, sequence: &[Op], model: &mut Model) {
    // Open writes too (its flush proof): the power may go there, before any request.
    let store = match Store::open_backing(disk.clone(), &test_options()) {
        Ok(store) => store,
        Err(e) => {
            assert!(disk.crashed(), "open failed without a crash: {e}");
            disk.power_off();
            return;
        }
    };
    for (i, op) in sequence.iter().enumerate() {
        let tag = 0x40 + i as u8;
        let (request, durability) = match op {
            Op::BigWrite => {
                let mut rng = rng(tag as u64);
                (
                    Some(Request::Write { offset: 4 * BLOCK, data: block_data(&mut rng, 20 * 4096, 100) }),
                    Durability::Buffered,
                )
            }
            Op::WriteUnalignedAcross01 => {
                (Some(Request::Write { offset: 2048, data: data(4096, tag) }), Durability::Buffered)
            }
            Op::FuaWriteBlock2 => (Some(Request::Write { offset: 2 * BLOCK, data: data(4096, tag) }), Durability::Fua),
            Op::TrimBlocks01 => (Some(Request::Trim { offset: 0, len: 2 * BLOCK }), Durability::Buffered),
            Op::ZeroUnaligned => (Some(Request::Zero { offset: 3000, len: 6000 }), Durability::Buffered),
            _ => (None, Durability::Buffered),
        };
        let result = match (&request, op) {
            (Some(r), _) => r.run(&store, durability),
            (None, Op::Flush) => store.flush(),
            (None, Op::Checkpoint) => store.checkpoint(),
            (None, _) => store.collect_garbage(4).map(|_| ()),
        };
        if let Some(r) = request {
            model.pending.push(r);
        }
        match result {
            Ok(()) => {
                if durability == Durability::Fua || matches!(op, Op::Flush) {
                    model.flushed();
                }
            }
            Err(e) => {
                assert!(disk.crashed(), "unexpected error without a crash in {sequence:?}: {e}");
                break;
            }
        }
    }
    disk.power_off();
}

#[test]
fn every_short_sequence_survives_a_crash_at_every_write() {
    // A base image with all four blocks durable, so trims and overwrites have something to lose.
    let base = new_disk(12, 64 << 10, LOGICAL, Codec::Lz4, 1);
    let mut base_model = Model::new(LOGICAL);
    {
        let store = Store::open_backing(base.clone(), &test_options()).unwrap();
        let request = Request::Write { offset: 0, data: data(LOGICAL as usize, 0x11) };
        request.run(&store, Durability::Buffered).unwrap();
        base_model.pending.push(request);
        store.close().unwrap();
        base_model.flushed();
    }
    let base_image = base.image();

    let mut sequences: Vec<Vec<Op>> = OPS.iter().map(|&op| vec![op]).collect();
    for len in 2..=3 {
        let shorter: Vec<Vec<Op>> = sequences.iter().filter(|s| s.len() == len - 1).cloned().collect();
        for s in shorter {
            for &op in &OPS {
                let mut longer = s.clone();
                longer.push(op);
                sequences.push(longer);
            }
        }
    }
    let mut runs = 0;
    for sequence in &sequences {
        // Count the writes of an uninterrupted run, then cut the power at each of them.
        let probe = Arc::new(SimDisk::from_image(base_image.clone(), 0));
        probe.set_faults(Faults::default());
        let mut probe_model = Model { durable: base_model.durable.clone(), pending: Vec::new() };
        run_sequence(&probe, sequence, &mut probe_model);
        let writes = probe.writes();
        for crash_at in 1..=writes + 1 {
            for tear_seed in 0..2u64 {
                let disk = Arc::new(SimDisk::from_image(base_image.clone(), crash_at * 2 + tear_seed));
                disk.set_faults(Faults { crash_at_write: Some(crash_at), ..Faults::default() });
                let mut model = Model { durable: base_model.durable.clone(), pending: Vec::new() };
                run_sequence(&disk, sequence, &mut model);
                let recovered_disk = Arc::new(SimDisk::from_image(disk.crash_image(), 7));
                let store = Store::open_backing(recovered_disk.clone(), &test_options()).unwrap_or_else(|e| {
                    panic!("{sequence:?} crash at write {crash_at} (tear {tear_seed}): reopen: {e}")
                });
                let image = read_all(&store);
                if let Err(e) = model.check_recovered(&image) {
                    panic!("{sequence:?} crash at write {crash_at} (tear {tear_seed}): {e}");
                }
                // The recovered store must itself be sound and writable.
                store.write(0, &data(100, 0x77), Durability::Fua).unwrap();
                let report = store.check(&mut |_, _| {}).unwrap();
                assert!(report.problems.is_empty(), "{sequence:?} crash at {crash_at}: {:?}", report.problems);
                runs += 1;
            }
        }
    }
    eprintln!("{} sequences, {runs} crash runs checked", sequences.len());
    assert!(runs > sequences.len() * 2);
}
