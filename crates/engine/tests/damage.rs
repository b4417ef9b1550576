//! Never wrong data after damage: flushed writes, a crash, then bit flips in the records
//! recovery must replay (payload, head, a batch's tail, both copies of a description, a
//! checkpoint chunk, the first record of a segment, at every quarter of the replay window,
//! the last record). After recovery every block reads its latest flushed value or fails
//! with EIO — none reads an older value — and `check` names the damage.

mod common;

use std::sync::Arc;

use common::*;
use zdisk_engine::sim::inspect::{self, RecordLayout};
use zdisk_engine::sim::SimDisk;
use zdisk_engine::{Codec, Durability, ErrorKind, OpenOptions, Store};

const LOGICAL: u64 = 2 << 20;
const BLOCKS: usize = (LOGICAL / BLOCK) as usize;

/// A crashed store whose replay window holds every record kind, each request flushed.
/// Returns the crash image and the contents every block must have.
fn flushed_history(seed: u64) -> (Vec<u8>, Vec<u8>) {
    let disk = new_disk(256, 64 << 10, LOGICAL, Codec::Lz4, seed);
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    let mut model = Model::new(LOGICAL);
    let mut rng = rng(seed);
    fn run(r: Request, store: &Store, model: &mut Model) {
        r.run(store, Durability::Buffered).unwrap();
        model.pending.push(r);
    }
    // Before the checkpoint: data the window's records overwrite.
    run(Request::Write { offset: 0, data: block_data(&mut rng, LOGICAL as usize, 30) }, &store, &mut model);
    store.flush().unwrap();
    model.flushed();
    store.checkpoint().unwrap();
    for i in 0..48u64 {
        let request = match i % 6 {
            // 256 KiB writes: write records, some across a segment boundary.
            0 | 3 => Request::Write { offset: (i * 37 % 200) * BLOCK, data: block_data(&mut rng, 64 * 4096, 30) },
            // Small writes gathered into batch records (several per flush).
            1 => {
                for j in 0..3 {
                    let lba = (i * 13 + j * 101) % BLOCKS as u64;
                    let data = block_data(&mut rng, 4096, 30);
                    run(Request::Write { offset: lba * BLOCK, data }, &store, &mut model);
                }
                Request::Write { offset: (i * 7 % 500) * BLOCK + 100, data: block_data(&mut rng, 5000, 30) }
            }
            2 => Request::Trim { offset: (i * 11 % 480) * BLOCK, len: 8 * BLOCK },
            4 => Request::Zero { offset: (i * 19 % 480) * BLOCK + 300, len: 6 * BLOCK },
            _ => Request::Write { offset: (i * 23 % 500) * BLOCK, data: block_data(&mut rng, 2 * 4096, 30) },
        };
        run(request, &store, &mut model);
        store.flush().unwrap();
        model.flushed();
    }
    let image = disk.crash_image();
    store.abandon();
    (image, model.durable)
}

/// Opens a damaged image and checks the rule: each block is its latest flushed value or
/// an error, never anything else. Returns how many blocks failed, and the store.
fn reads_are_latest_or_errors(image: Vec<u8>, expected: &[u8], what: &str) -> (usize, Store) {
    let disk = Arc::new(SimDisk::from_image(image, 9));
    let store = Store::open_backing(disk, &test_options()).unwrap_or_else(|e| panic!("{what}: open: {e}"));
    let mut failed = 0;
    let mut block = vec![0u8; BLOCK as usize];
    for lba in 0..BLOCKS {
        match store.read(lba as u64 * BLOCK, &mut block) {
            Ok(()) => {
                let want = &expected[lba * BLOCK as usize..(lba + 1) * BLOCK as usize];
                assert!(block == want, "{what}: block {lba} reads data that is not its latest flushed value");
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Checksum, "{what}: block {lba}: {e}");
                failed += 1;
            }
        }
    }
    (failed, store)
}

fn check_names_damage(store: &Store, what: &str) -> Vec<String> {
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(!report.problems.is_empty(), "{what}: check found nothing");
    assert_eq!(report.problems.len(), report.damage.len());
    report.problems
}

fn window(image: &[u8]) -> Vec<RecordLayout> {
    let window = inspect::replay_window(image);
    assert!(window.len() > 40, "the replay window holds {} records", window.len());
    window
}

/// Records of the window at its quarters, of kinds `kinds`.
fn at_quarters(window: &[RecordLayout], kinds: &[u8]) -> Vec<RecordLayout> {
    let of_kind: Vec<&RecordLayout> = window.iter().filter(|r| kinds.contains(&r.kind)).collect();
    assert!(of_kind.len() >= 4, "too few records of kinds {kinds:?}");
    [1, 2, 3].iter().map(|q| of_kind[of_kind.len() * q / 4].clone()).collect()
}

fn flip(image: &mut [u8], at: u64, bit: u8) {
    image[at as usize] ^= 1 << bit;
}

#[test]
fn a_flipped_payload_bit_fails_only_that_block() {
    let (image, expected) = flushed_history(1);
    for record in at_quarters(&window(&image), &[1, 6]) {
        let mut damaged = image.clone();
        let (lba, fragment) = &record.fragments[record.fragments.len() / 2];
        flip(&mut damaged, fragment.start + 20, 3);
        let what = format!("payload of record {} (block {lba})", record.seq);
        let (failed, store) = reads_are_latest_or_errors(damaged, &expected, &what);
        assert!(failed <= 1, "{what}: {failed} blocks fail");
        let problems = check_names_damage(&store, &what);
        assert!(problems.iter().any(|p| p.contains(&format!("block {lba}"))) || failed == 0, "{what}: {problems:?}");
    }
}

#[test]
fn a_flipped_head_bit_loses_nothing() {
    let (image, expected) = flushed_history(2);
    for record in at_quarters(&window(&image), &[1, 2, 3, 6]) {
        let mut damaged = image.clone();
        flip(&mut damaged, record.head.start + 9, 0);
        let what = format!("head of record {} (kind {})", record.seq, record.kind);
        let (failed, store) = reads_are_latest_or_errors(damaged, &expected, &what);
        assert_eq!(failed, 0, "{what}: the tail's copy describes the record");
        let problems = check_names_damage(&store, &what);
        assert!(problems.iter().any(|p| p.contains("head")), "{what}: {problems:?}");
    }
}

#[test]
fn a_flipped_bit_in_a_batch_tail_loses_nothing() {
    let (image, expected) = flushed_history(3);
    for record in at_quarters(&window(&image), &[6]) {
        let mut damaged = image.clone();
        flip(&mut damaged, record.tail.start + 2, 5);
        let what = format!("tail of batch record {}", record.seq);
        let (failed, store) = reads_are_latest_or_errors(damaged, &expected, &what);
        assert_eq!(failed, 0, "{what}: the fragments' protection information describes the record");
        let problems = check_names_damage(&store, &what);
        assert!(problems.iter().any(|p| p.contains("tail")), "{what}: {problems:?}");
    }
}

/// Data records of the window some of whose blocks no later record writes again: losing
/// one would leave those blocks at their older value if nothing stopped it. (Not the last
/// flushed request's: later records are what prove a record durable; the last one is
/// covered by the flush proof test below.)
fn not_overwritten_later(window: &[RecordLayout]) -> Vec<RecordLayout> {
    let data: Vec<&RecordLayout> = window.iter().filter(|r| r.kind == 1 || r.kind == 6).collect();
    let data = &data[..data.len() - 2];
    let found: Vec<RecordLayout> = data
        .iter()
        .enumerate()
        .filter(|(i, r)| {
            r.fragments
                .iter()
                .any(|(lba, _)| !data[i + 1..].iter().any(|later| later.fragments.iter().any(|(l, _)| l == lba)))
        })
        .map(|(_, r)| (*r).clone())
        .collect();
    assert!(found.len() >= 3, "too few records whose blocks stay");
    [0, found.len() / 2, found.len() - 1].iter().map(|&i| found[i].clone()).collect()
}

#[test]
fn losing_both_copies_of_a_description_opens_the_store_degraded() {
    let (image, expected) = flushed_history(4);
    for record in not_overwritten_later(&window(&image)) {
        let mut damaged = image.clone();
        flip(&mut damaged, record.head.start + 9, 0);
        flip(&mut damaged, record.tail.end - 10, 1);
        // The payload walk could rebuild it: damage a fragment's protection information too.
        flip(&mut damaged, record.fragments[0].1.start + 5, 2);
        let what = format!("record {} lost", record.seq);
        let (failed, store) = reads_are_latest_or_errors(damaged, &expected, &what);
        assert!(failed > 0, "{what}: blocks not provably newer than the loss must fail");
        let err = store.write(0, &[1u8; 4096], Durability::Buffered).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ReadOnly, "{what}: {err}");
        assert!(store.stats().space_flag == 2 || store.stats().damaged, "{what}: stat says the store is damaged");
        let problems = check_names_damage(&store, &what);
        assert!(problems.iter().any(|p| p.contains("lost")), "{what}: {problems:?}");
    }
}

#[test]
fn a_store_with_lost_records_opens_for_writing_when_the_loss_is_accepted() {
    let (image, _) = flushed_history(5);
    let record = at_quarters(&window(&image), &[1])[0].clone();
    let mut damaged = image;
    flip(&mut damaged, record.head.start + 9, 0);
    flip(&mut damaged, record.tail.end - 10, 1);
    flip(&mut damaged, record.fragments[0].1.start + 5, 2);
    let disk = Arc::new(SimDisk::from_image(damaged, 1));
    let store = Store::open_backing(disk, &OpenOptions { accept_data_loss: true, ..test_options() }).unwrap();
    store.write(0, &[7u8; 4096], Durability::Fua).unwrap();
    let mut block = vec![0u8; 4096];
    store.read(0, &mut block).unwrap();
    assert!(block.iter().all(|&b| b == 7));
}

#[test]
fn damage_to_the_first_record_of_a_segment_loses_nothing() {
    let (image, expected) = flushed_history(6);
    let sb = inspect::superblock(&image);
    // Every segment starts with its link record (version 4); the first data record follows it.
    let records = window(&image);
    let segment_starts: Vec<RecordLayout> = records
        .windows(2)
        .filter(|pair| {
            let (link, first) = (&pair[0], &pair[1]);
            (link.head.start - (1 << 20)) % sb.segment_size_bytes == 0
                && link.kind == 10
                && first.head.start == link.tail.end
                && !first.fragments.is_empty()
        })
        .map(|pair| pair[1].clone())
        .collect();
    assert!(!segment_starts.is_empty(), "no data record starts a segment in the window");
    for record in segment_starts.iter().take(3) {
        for part in ["head", "payload"] {
            let mut damaged = image.clone();
            let at = if part == "head" { record.head.start + 9 } else { record.fragments[0].1.start + 30 };
            flip(&mut damaged, at, 4);
            let what = format!("{part} of record {} at a segment start", record.seq);
            let (failed, store) = reads_are_latest_or_errors(damaged, &expected, &what);
            assert!(failed <= 1, "{what}: {failed} blocks fail");
            check_names_damage(&store, &what);
        }
    }
}

#[test]
fn the_last_record_with_one_flipped_bit_is_applied_and_with_more_fails_its_block() {
    let (image, expected) = flushed_history(7);
    let last = window(&image).into_iter().rev().find(|r| !r.fragments.is_empty()).unwrap();
    // Nothing follows it in the log: only the flush proof (written after the sync that made
    // it durable) tells its decay from a torn write.
    assert!(window(&image).iter().all(|r| r.seq <= last.seq || r.fragments.is_empty()));
    assert!(inspect::proven_seq(&image).is_some_and(|s| s >= last.seq));
    // One bit: corrected by trial (its payload CRC confirms it), so the record was whole.
    let mut damaged = image.clone();
    flip(&mut damaged, last.fragments[0].1.start + 40, 6);
    let (failed, store) = reads_are_latest_or_errors(damaged, &expected, "one bit in the last record");
    assert!(failed <= 1);
    check_names_damage(&store, "one bit in the last record");
    drop(store);
    // Three bits: no trial corrects them, but the flush proof says the record was durable,
    // so it is applied and the damaged block fails its reads (before flush proofs it was
    // taken for a torn write, and the block read its previous contents).
    let mut damaged = image.clone();
    for bit in 0..3 {
        flip(&mut damaged, last.fragments[0].1.start + 40 + bit, bit as u8);
    }
    let (failed, store) = reads_are_latest_or_errors(damaged.clone(), &expected, "three bits in the last record");
    assert_eq!(failed, 1);
    check_names_damage(&store, "three bits in the last record");
    drop(store);
    // Both copies of its description lost too: the proof still says it was durable, so
    // the store opens degraded rather than taking it for a torn tail.
    flip(&mut damaged, last.head.start + 9, 0);
    flip(&mut damaged, last.tail.end - 10, 1);
    let (failed, store) = reads_are_latest_or_errors(damaged.clone(), &expected, "the last record lost");
    assert!(failed > 0);
    assert!(store.stats().damaged);
    drop(store);
    // The proof itself damaged (both copies): what it said is unknown, so the damaged last
    // record may have been acknowledged — degraded, not its blocks' previous contents.
    let mut damaged = image.clone();
    for bit in 0..3 {
        flip(&mut damaged, last.fragments[0].1.start + 40 + bit, bit as u8);
    }
    flip(&mut damaged, inspect::FLUSH_PROOF.start as u64 + 9, 0);
    flip(&mut damaged, inspect::FLUSH_PROOF.start as u64 + 2048 + 17, 3);
    let (failed, store) =
        reads_are_latest_or_errors(damaged.clone(), &expected, "the proof and the last record damaged");
    assert!(failed > 0);
    assert!(store.stats().damaged);
    drop(store);
    // Accepting the loss opens it for writing and writes a new proof: the next open is whole.
    let disk = Arc::new(SimDisk::from_image(damaged, 5));
    let accepting = OpenOptions { accept_data_loss: true, ..test_options() };
    Store::open_backing(disk.clone(), &accepting).unwrap().close().unwrap();
    assert!(inspect::proven_seq(&disk.image()).is_some());
    let store = Store::open_backing(disk, &test_options()).unwrap();
    assert!(!store.stats().damaged);
    store.write(0, &[3u8; 4096], Durability::Fua).unwrap();
}

/// A write torn by a crash is still a torn write: the proof covers only what a flush made
/// durable, so an unflushed last record that does not verify ends the log and its blocks
/// read what the last flush left, and the store opens writable with nothing to report.
#[test]
fn an_unflushed_torn_record_past_the_proof_is_a_torn_write() {
    let (image, expected) = flushed_history(12);
    let disk = Arc::new(SimDisk::from_image(image, 4));
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    let mut rng = rng(12);
    store.write(5 * BLOCK, &block_data(&mut rng, 4 * BLOCK as usize, 30), Durability::Buffered).unwrap();
    // (A later write, so the first record lies in whole sectors.)
    store.write(40 * BLOCK, &block_data(&mut rng, 16 * BLOCK as usize, 30), Durability::Buffered).unwrap();
    // Written out (whole sectors), never flushed: the disk holds it, as a crash may leave it.
    store.write_out_unflushed().unwrap();
    let mut image = disk.image();
    store.abandon();
    let proven = inspect::proven_seq(&image).unwrap();
    let torn = window(&image).into_iter().find(|r| r.fragments.first().is_some_and(|f| f.0 == 5)).unwrap();
    assert!(torn.seq > proven, "the unflushed record {} is past the proof ({proven})", torn.seq);
    for bit in 0..3 {
        flip(&mut image, torn.fragments[0].1.start + 40 + bit, bit as u8);
    }
    let (failed, store) = reads_are_latest_or_errors(image, &expected, "an unflushed torn record");
    assert_eq!(failed, 0);
    assert!(!store.stats().damaged);
    store.write(0, &[1u8; 4096], Durability::Fua).unwrap();
}

#[test]
fn a_damaged_checkpoint_chunk_falls_back_and_loses_nothing() {
    let (image, expected) = flushed_history(8);
    let chunk = inspect::superblock(&image).checkpoint_chunks[0];
    let mut damaged = image;
    flip(&mut damaged, chunk.offset_bytes + 10, 2);
    let (failed, _store) = reads_are_latest_or_errors(damaged, &expected, "checkpoint chunk");
    assert_eq!(failed, 0);
}

#[test]
fn a_flipped_bit_in_a_map_pages_tail_loses_nothing() {
    let (image, expected) = flushed_history(9);
    let pages: Vec<RecordLayout> = window(&image).into_iter().filter(|r| r.kind == 9).collect();
    assert!(!pages.is_empty(), "no map-pages record in the replay window");
    for record in pages.iter().take(3) {
        let mut damaged = image.clone();
        flip(&mut damaged, record.tail.start + 2, 5);
        let what = format!("tail of map-pages record {}", record.seq);
        let (failed, store) = reads_are_latest_or_errors(damaged, &expected, &what);
        assert_eq!(failed, 0, "{what}: the pages' protection information describes the record");
        // It maps no block, so check notes it rather than calling it a problem.
        let notes = store.check(&mut |_, _| {}).unwrap().notes;
        assert!(notes.iter().any(|n| n.contains("maps no block") && n.contains("tail")), "{what}: {notes:?}");
    }
}

/// A crashed run can leave records past a gap that was never durable: recovery ends the log
/// before the gap, and whatever is flushed later is the truth. Those records still carry a
/// durable sequence number that proves the log's last record durable — so when that record
/// is then lost, they must not be taken for its successors (the crash model's seed
/// 4207321907676004483 read a trim such a record held, in a block flushed since).
#[test]
fn records_past_a_never_durable_gap_are_not_replayed_after_a_loss() {
    let disk = new_disk(256, 64 << 10, LOGICAL, Codec::Lz4, 10);
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    let mut rng = rng(10);
    let mut model = Model::new(LOGICAL);
    for request in [
        Request::Write { offset: 0, data: block_data(&mut rng, LOGICAL as usize, 30) },
        Request::Write { offset: 100 * BLOCK, data: block_data(&mut rng, 16 * 4096, 30) },
    ] {
        request.run(&store, Durability::Buffered).unwrap();
        model.pending.push(request);
        store.flush().unwrap();
    }
    model.flushed();
    // What a later run appends; erasing its first record below makes the rest a crashed
    // run's leftovers past a gap. That run never flushed past the gap, so its flush proof
    // is the one written now (put back below).
    let proof_before_gap = disk.crash_image()[inspect::FLUSH_PROOF].to_vec();
    for lba in [300, 400] {
        Request::Write { offset: lba * BLOCK, data: block_data(&mut rng, 16 * 4096, 30) }
            .run(&store, Durability::Buffered)
            .unwrap();
    }
    store.flush().unwrap();
    let mut image = disk.crash_image();
    store.abandon();
    let records = inspect::replay_window(&image);
    // The 16 blocks at LBA 100 may straddle a segment: the log's last record is the
    // last data record before the write at LBA 300 (the gap).
    let gap = records.iter().find(|r| r.fragments.first().is_some_and(|f| f.0 == 300)).unwrap().clone();
    let last = records.iter().rfind(|r| r.seq < gap.seq && !r.fragments.is_empty()).unwrap().clone();
    assert!(records.iter().any(|r| r.seq > gap.seq && r.fragments.iter().any(|f| f.0 == 400)));
    image[gap.head.start as usize..gap.tail.end as usize].fill(0);
    image[inspect::FLUSH_PROOF].copy_from_slice(&proof_before_gap);
    assert!(inspect::proven_seq(&image).is_some_and(|s| s < gap.seq));
    let expected = model.durable;
    let (failed, store) = reads_are_latest_or_errors(image.clone(), &expected, "a gap after the last record");
    assert_eq!(failed, 0, "the log ends at the gap");
    drop(store);
    // Now the log's last record is lost too.
    flip(&mut image, last.head.start + 9, 0);
    flip(&mut image, last.tail.end - 10, 1);
    flip(&mut image, last.fragments[0].1.start + 5, 2);
    let (failed, store) = reads_are_latest_or_errors(image, &expected, "the last record lost, a gap after it");
    assert!(failed > 0, "blocks not provably newer than the loss must fail");
    assert!(store.stats().damaged);
}

#[test]
fn a_torn_last_record_applied_at_open_is_not_taken_for_damage_by_a_later_recovery() {
    let (image, expected) = flushed_history(11);
    let last = window(&image).into_iter().rev().find(|r| !r.fragments.is_empty()).unwrap();
    // Its tail copy damaged, as a crash tearing the record's last sectors leaves it: complete
    // from its head, and nothing proves it durable, so it is a torn write, not a problem.
    let mut torn = image;
    flip(&mut torn, last.tail.start + 9, 0);
    let disk = Arc::new(SimDisk::from_image(torn, 3));
    let store = Store::open_backing(disk.clone(), &test_options()).unwrap();
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "a torn last record: {:?}", report.problems);
    assert!(report.notes.iter().any(|n| n.contains("torn by a crash")), "notes: {:?}", report.notes);
    // This run's records claim everything replayed durable, the torn record too; a later
    // recovery must still not replay it as a synced record that decayed.
    let mut expected = expected;
    let data = vec![0x5au8; BLOCK as usize];
    store.write(3 * BLOCK, &data, Durability::Buffered).unwrap();
    store.flush().unwrap();
    expected[3 * BLOCK as usize..4 * BLOCK as usize].copy_from_slice(&data);
    let image = disk.crash_image();
    store.abandon();
    let (failed, store) = reads_are_latest_or_errors(image, &expected, "a crash after a torn record was applied");
    assert_eq!(failed, 0);
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "after a second crash: {:?}", report.problems);
}
