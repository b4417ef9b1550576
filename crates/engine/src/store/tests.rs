//! White-box tests of states no sequence of requests reaches on purpose.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::capacity::SpaceClass;
use super::gc::GcMode;
use super::state::Inner;
use super::{Durability, FormatOptions, OpenOptions, Store};
use crate::codec::Codec;
use crate::error::ErrorKind;
use crate::sim::SimDisk;
use crate::types::Lba;
use crate::BLOCK_SIZE;

fn small_store(seed: u64) -> Store {
    small_store_on_disk(seed).1
}

fn small_store_on_disk(seed: u64) -> (Arc<SimDisk>, Store) {
    small_store_with(seed, OpenOptions { background: false, ..OpenOptions::default() })
}

/// `small_store_on_disk`, opened with `options`.
fn small_store_with(seed: u64, options: OpenOptions) -> (Arc<SimDisk>, Store) {
    let disk = sim_disk_formatted(1 << 20, 32, 4 << 20, Codec::Lz4, seed);
    let store = Store::open_backing(disk.clone(), &options);
    (disk, store.unwrap())
}

/// A simulated disk of `head_bytes` and `segments` segments of 64 KiB, formatted with
/// `codec` and `logical_bytes` of logical space.
fn sim_disk_formatted(head_bytes: u64, segments: u64, logical_bytes: u64, codec: Codec, seed: u64) -> Arc<SimDisk> {
    let segment_bytes = 64u64 << 10;
    let disk = Arc::new(SimDisk::new(head_bytes + segments * segment_bytes, seed));
    let format = FormatOptions {
        physical_size_bytes: 0,
        logical_size_bytes: logical_bytes,
        codec,
        segment_size_bytes: Some(segment_bytes),
        force: true,
        over_provision_ppm: crate::OVER_PROVISION_DEFAULT_PPM,
        encryption: None,
        allocation: crate::Allocation::Sparse,
    };
    Store::format_backing(disk.as_ref(), &format).unwrap();
    disk
}

fn incompressible(rng: &mut crate::sim::SimRng, len: usize) -> Vec<u8> {
    (0..len).map(|_| rng.next_u64() as u8).collect()
}

/// 512 KiB of incompressible blocks, then every other block of them overwritten: the first
/// segments are half garbage.
fn write_half_garbage(store: &Store, rng: &mut crate::sim::SimRng) {
    store.write(0, &incompressible(rng, 512 << 10), Durability::Buffered).unwrap();
    for lba in (0..128u64).step_by(2) {
        store.write(lba * 4096, &incompressible(rng, 4096), Durability::Buffered).unwrap();
    }
}

/// Cuts the power under a store: what its disk then holds.
fn power_cut(disk: &SimDisk, store: Store) -> Vec<u8> {
    disk.power_off();
    let image = disk.crash_image();
    drop(store);
    image
}

/// Opens (and recovers) a store image as `small_store` opens a store.
fn reopen(image: Vec<u8>, seed: u64) -> Store {
    let disk = Arc::new(SimDisk::from_image(image, seed));
    Store::open_backing(disk, &OpenOptions { background: false, ..OpenOptions::default() }).unwrap()
}

/// Takes free segments out of the free set (and out of GC's reach) until `keep` are
/// left: the state a busy store reaches, made directly.
fn take_free_segments(inner: &Inner, keep: usize) {
    inner.log.lock().segments.take_free_for_test(keep);
}

/// Liveness at GC's floor: two free segments left (below the host reserve: host writes are
/// refused), the open segment nearly full, nothing cleaned, half the data garbage. GC must still relocate a victim (into the last free
/// segment, keeping room for the checkpoints that free it), and then give back more
/// than it took. With reserves counted in whole free segments GC refused here, and the
/// store answered every write with ENOSPC forever (`zdisk bench --smoke` in CI).
#[test]
fn gc_can_always_move_at_its_floor() {
    let store = small_store(3);
    let inner = &store.inner;
    let mut rng = crate::sim::SimRng::new(3);
    write_half_garbage(&store, &mut rng);
    // Fill the open segment to its last few KiB with fresh blocks.
    let mut lba = 512;
    while inner.log.lock().room() > 12 << 10 {
        store.write(lba * 4096, &incompressible(&mut rng, 4096), Durability::Buffered).unwrap();
        lba += 1;
    }
    store.flush().unwrap();
    take_free_segments(inner, 2);
    let available_before = inner.log.lock().available_bytes();
    assert!(available_before < inner.reserves().of(SpaceClass::Host));
    assert!(inner.gc_once(GcMode::Foreground).unwrap().is_some(), "GC found no victim it could relocate at its floor");
    // Two checkpoints move the reuse horizon past the victim; then it is free again.
    inner.checkpoint_now().unwrap();
    inner.checkpoint_now().unwrap();
    inner.free_cleaned().unwrap();
    let available_after = inner.log.lock().available_bytes();
    assert!(
        available_after > available_before,
        "a GC step at the floor took more than it gave back: {available_before} -> {available_after}"
    );
}

/// A writer refused for space while cleaned segments wait only for a flush (the background
/// worker's step frees its victims at its end) frees them and goes on: its foreground round
/// cleans no victim. Before, the round cleaned a segment's worth of victims regardless
/// (~100 ms at 10% OP; docs/space.md, "The worst write").
#[test]
fn a_round_that_frees_enough_cleans_no_victim() {
    let store = small_store(11);
    let inner = &store.inner;
    let mut rng = crate::sim::SimRng::new(11);
    write_half_garbage(&store, &mut rng);
    // The reuse horizon past everything written; then one victim cleaned, not yet freed
    // (freeing it takes only a flush, as for the background worker's old victims).
    inner.checkpoint_now().unwrap();
    inner.checkpoint_now().unwrap();
    assert!(inner.gc_once(GcMode::Foreground).unwrap().is_some());
    assert_eq!(inner.log.lock().segments.cleaned_count(), 1);
    // Leave as many free segments as keep a 4 KiB write just short of the host reserve.
    let capacity = inner.geometry.segment_capacity();
    let keep = {
        let log = inner.log.lock();
        let need = inner.reserves().of(SpaceClass::Host) + 4096 + 2 * inner.log.fragment_end_waste_bytes();
        let room = log.room() as u64;
        assert!(need > room + capacity, "the open segment alone would take the write");
        ((need - room - 1) / capacity) as usize
    };
    assert!(inner.log.lock().segments.free_count() > keep, "the store has fewer free segments than the test needs");
    take_free_segments(inner, keep);
    let cleaned_before = crate::stats::Counters::get(&inner.counters.gc_segments_cleaned);
    store.write(600 * 4096, &incompressible(&mut rng, 4096), Durability::Buffered).unwrap();
    assert_eq!(inner.log.lock().segments.cleaned_count(), 0, "the cleaned segment was not freed");
    assert_eq!(
        crate::stats::Counters::get(&inner.counters.gc_segments_cleaned),
        cleaned_before,
        "the round cleaned victims although freeing what was cleaned made room"
    );
}

/// Every checkpoint carries the trained dictionaries: one raises the room a checkpoint takes
/// by its bytes (so the reserves keep room for the checkpoints that free GC's victims), and
/// on a store at its floor training is refused with ENOSPC and changes nothing.
#[test]
fn a_dictionary_counts_in_the_checkpoint_room_and_is_refused_at_the_floor() {
    let store = small_store(6);
    let inner = &store.inner;
    let mut rng = crate::sim::SimRng::new(6);
    const WORDS: [&str; 8] = ["block", "segment", "checkpoint", "fragment", "record", "reserve", "victim", "horizon"];
    let mut text = Vec::new();
    while text.len() < 256 << 10 {
        text.extend_from_slice(WORDS[(rng.next_u64() % 8) as usize].as_bytes());
        text.push(if rng.next_u64().is_multiple_of(9) { b'\n' } else { b' ' });
    }
    store.write(0, &text[..256 << 10], Durability::Buffered).unwrap();
    store.flush().unwrap();
    let room_before = inner.reserves().checkpoint_room_bytes();
    let options = super::DictionaryOptions { level: 3, size_bytes: 8 << 10, sample_blocks_max: 64 };
    let (dictionary, _) = inner.train_and_install(&options).unwrap();
    let room_after = inner.reserves().checkpoint_room_bytes();
    assert!(room_after >= room_before + dictionary.bytes.len() as u64, "checkpoint room {room_before} -> {room_after}");
    take_free_segments(inner, 2);
    let err = inner.train_and_install(&options).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NoSpace, "{err}");
    assert_eq!(inner.codecs.dictionaries.read().table.len(), 1, "a refused training changed the table");
}

/// Trim must work on a full store even when GC cannot give back the metadata reserve:
/// it may then go below it (`SpaceClass::TrimWhileFull`), while a host write is refused.
/// Only white-box: the state (the log at GC's floor, nothing collectable) is made by
/// taking free segments out of the free set, which no sequence of requests does on
/// purpose.
#[test]
fn a_trim_on_a_full_store_may_go_below_the_metadata_reserve() {
    let store = small_store(1);
    let inner = &store.inner;
    // Incompressible, never overwritten: nothing for GC to give back.
    let data = incompressible(&mut crate::sim::SimRng::new(7), 256 << 10);
    store.write(0, &data, Durability::Buffered).unwrap();
    store.flush().unwrap();
    {
        let log = inner.log.lock();
        let metadata = inner.reserves().of(SpaceClass::HostMetadata);
        let capacity = inner.geometry.segment_capacity();
        let keep = (metadata.saturating_sub(log.room() as u64) / capacity) as usize;
        drop(log);
        take_free_segments(inner, keep);
        let log = inner.log.lock();
        assert!(log.available_bytes() < metadata);
        let floor = inner.reserves().of(SpaceClass::TrimWhileFull);
        assert!(log.available_bytes() > floor + 4096, "the test state is below the trim floor too");
    }
    let err = store.write(512 << 10, &data[..4096], Durability::Buffered).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NoSpace, "{err}");
    store.trim(0, 64 << 10, Durability::Buffered).expect("a trim on a full store");
    store.write_zeroes(64 << 10, 8192, Durability::Buffered).expect("a write-zeroes on a full store");
    let mut back = vec![0xffu8; 128 << 10];
    store.read(0, &mut back).unwrap();
    assert!(back[..(64 << 10) + 8192].iter().all(|&b| b == 0), "trimmed and zeroed blocks read as zeros");
    assert_eq!(back[(64 << 10) + 8192..], data[(64 << 10) + 8192..128 << 10]);
}

/// Host writes that cross the write-behind bound together queue on the `io` lock. The first
/// writes the backlog out; one that gets the lock after it finds the backlog back under the
/// bound and must leave the open batch alone, not write out the few sectors appended
/// meanwhile (a convoy of write-outs, each closing the batch, at every crossing).
#[test]
fn a_write_out_queued_behind_one_that_cleared_the_backlog_does_nothing() {
    let (disk, store) = small_store_on_disk(5);
    let inner = &store.inner;
    let mut rng = crate::sim::SimRng::new(5);
    let bound_bytes = 16 << 10;
    store.write(0, &incompressible(&mut rng, 32 << 10), Durability::Buffered).unwrap();
    let before = disk.writes();
    inner.write_out_behind(bound_bytes).unwrap();
    assert!(disk.writes() > before, "32 KiB behind a 16 KiB bound: written out");
    // Appended while the first write-out ran: under the bound.
    let appended = incompressible(&mut rng, 8 << 10);
    store.write(64 << 10, &appended, Durability::Buffered).unwrap();
    let backlog_bytes = inner.log.lock().appender.backlog_bytes() as u64;
    assert!(backlog_bytes > 4096 && backlog_bytes <= bound_bytes, "backlog {backlog_bytes}");
    let before = disk.writes();
    inner.write_out_behind(bound_bytes).unwrap();
    assert_eq!(disk.writes(), before, "the queued write-out found the backlog under the bound");
    inner.write_out_behind(4096).unwrap();
    assert!(disk.writes() > before, "{backlog_bytes} bytes behind a 4 KiB bound: written out");
    let mut back = vec![0u8; 8 << 10];
    store.read(64 << 10, &mut back).unwrap();
    assert!(back == appended, "read back differs");
}

/// GC's copies are batch records checked under the log lock as they are appended: a block
/// overwritten between GC reading its victim and appending the copies keeps the overwrite,
/// at once and after replay (which applies the batch without a compare-and-swap).
#[test]
fn gc_copies_lose_to_a_concurrent_overwrite() {
    let (disk, store) = small_store_on_disk(9);
    let inner = &store.inner;
    let mut rng = crate::sim::SimRng::new(9);
    write_half_garbage(&store, &mut rng);
    store.flush().unwrap();
    let live = inner.collect_live(segment_of_block(inner, 1)).unwrap();
    assert!(live.len() > 4, "the victim holds {} live fragments", live.len());
    let mut expected: Vec<(u64, Vec<u8>)> = Vec::new();
    for fragment in &live {
        let mut block = vec![0u8; 4096];
        store.read(fragment.lba.0 * 4096, &mut block).unwrap();
        expected.push((fragment.lba.0, block));
    }
    let overwritten = live[live.len() / 2].lba.0;
    let newer = incompressible(&mut rng, 4096);
    store.write(overwritten * 4096, &newer, Durability::Buffered).unwrap();
    expected.iter_mut().find(|(lba, _)| *lba == overwritten).unwrap().1 = newer;
    inner.relocate(live, Vec::new(), SpaceClass::Gc).unwrap();
    let check = |store: &Store, when: &str| {
        for (lba, block) in &expected {
            let mut back = vec![0u8; 4096];
            store.read(lba * 4096, &mut back).unwrap();
            assert!(back == *block, "block {lba} {when} (overwritten: {overwritten})");
        }
    };
    check(&store, "after the copies");
    store.flush().unwrap();
    // Power cut: no checkpoint after the copies, so the reopened store replays them.
    let store = reopen(power_cut(&disk, store), 9);
    check(&store, "after replay");
}

/// The segment block `lba` is stored in.
fn segment_of_block(inner: &Inner, lba: u64) -> crate::types::SegmentId {
    match inner.map.read().get(crate::types::Lba(lba), inner).unwrap().unpack().unwrap() {
        crate::map::Entry::Stored(stored) => inner.geometry.segment_of(stored.offset_bytes),
        other => panic!("block {lba} is not stored: {other:?}"),
    }
}

/// GC's copies of host-written data go to the cold stream; copies out of a segment that
/// held GC's output go to the colder one (a third open segment); when free space beyond the
/// host reserve runs short, the colder segment is sealed (the native capacity counts two open
/// segments); and a power cut replays the log through all three streams' jumps.
#[test]
fn data_gc_moved_before_goes_to_the_colder_stream_which_is_sealed_when_space_runs_short() {
    use super::log::Stream;
    let (disk, store) = small_store_on_disk(13);
    let inner = &store.inner;
    let mut rng = crate::sim::SimRng::new(13);
    write_half_garbage(&store, &mut rng);
    let expected: Vec<u8> = {
        let mut image = vec![0u8; 512 << 10];
        store.read(0, &mut image).unwrap();
        image
    };
    let move_block_1 = |why: &str| {
        let segment = segment_of_block(inner, 1);
        inner.seal_open_segments().unwrap();
        store.flush().unwrap();
        let live = inner.collect_live(segment).unwrap();
        assert!(!live.is_empty(), "{why}: segment {segment} holds nothing live");
        inner.relocate(live, Vec::new(), SpaceClass::Gc).unwrap();
        let now = segment_of_block(inner, 1);
        assert_ne!(now, segment, "{why}: block 1 did not move");
        now
    };
    let first = move_block_1("first move");
    assert!(inner.log.lock().segments.holds_gc_output(first), "the first move did not go to a GC stream");
    let stats = store.stats();
    assert!(stats.gc_cold_bytes_moved > 0 && stats.gc_colder_bytes_moved == 0, "first move: {stats:?}");
    let second = move_block_1("second move");
    let stats = store.stats();
    assert!(stats.gc_colder_bytes_moved > 0, "data GC had moved before did not go to the colder stream: {stats:?}");
    assert!(inner.log.lock().segments.holds_gc_output(second));
    // A host write parks the colder stream; then free space runs short beyond the host
    // reserve, and the next append seals the colder segment.
    store.write(600 * 4096, &incompressible(&mut rng, 4096), Durability::Buffered).unwrap();
    assert!(inner.log.lock().stream_room(Stream::Colder) > 0, "the colder segment is not open");
    let keep = inner.reserves().host_segments() as usize;
    take_free_segments(inner, keep);
    let _ = store.write(601 * 4096, &incompressible(&mut rng, 4096), Durability::Buffered);
    assert_eq!(inner.log.lock().stream_room(Stream::Colder), 0, "the colder segment stayed open when short");
    let check = |store: &Store, when: &str| {
        let mut back = vec![0u8; 512 << 10];
        store.read(0, &mut back).unwrap();
        assert!(back == expected, "contents differ {when}");
    };
    check(&store, "after the moves");
    store.flush().unwrap();
    let store = reopen(power_cut(&disk, store), 13);
    check(&store, "after replay through the three streams' jumps");
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

/// A lost record's blocks that GC copied after it are provably newer than the loss: GC's
/// batch entries hold only copies that won their compare-and-swap when appended, so each
/// is its block's latest contents as of that record. After a degraded open those blocks
/// read their latest flushed value, not EIO, and no block reads an older value.
#[test]
fn blocks_gc_copied_after_a_lost_record_read_their_latest_value() {
    let (disk, store) = small_store_on_disk(17);
    let inner = &store.inner;
    let mut rng = crate::sim::SimRng::new(17);
    store.write(0, &incompressible(&mut rng, 256 << 10), Durability::Buffered).unwrap();
    store.flush().unwrap();
    inner.checkpoint_now().unwrap();
    // The record to be lost: 16 blocks over older data (a write record), flushed.
    store.write(0, &incompressible(&mut rng, 64 << 10), Durability::Buffered).unwrap();
    store.write(200 * 4096, &incompressible(&mut rng, 8 << 10), Durability::Buffered).unwrap();
    store.flush().unwrap();
    // GC copies its segment (the lost record's blocks with it); later host records prove
    // the copies durable.
    let segment = segment_of_block(inner, 0);
    inner.seal_open_segments().unwrap();
    store.flush().unwrap();
    inner.relocate(inner.collect_live(segment).unwrap(), Vec::new(), SpaceClass::Gc).unwrap();
    assert_ne!(segment_of_block(inner, 0), segment, "GC did not move block 0");
    store.write(300 * 4096, &incompressible(&mut rng, 8 << 10), Durability::Buffered).unwrap();
    store.flush().unwrap();
    let mut expected = vec![0u8; 4 << 20];
    store.read(0, &mut expected).unwrap();
    let mut image = power_cut(&disk, store);
    let window = crate::sim::inspect::replay_window(&image);
    let lost = window
        .iter()
        .find(|r| r.kind == 1 && r.fragments.first().map(|f| f.0) == Some(0))
        .expect("the write record of block 0 is in the replay window")
        .clone();
    // Both copies of its description, and a fragment's protection information (the payload
    // walk could rebuild it otherwise).
    for (at, bit) in [(lost.head.start + 9, 0), (lost.tail.end - 10, 1), (lost.fragments[0].1.start + 5, 2)] {
        image[at as usize] ^= 1 << bit;
    }
    let store = reopen(image, 17);
    assert!(store.stats().damaged, "the lost record was not noticed");
    let mut block = vec![0u8; 4096];
    for lba in 0..(4u64 << 20) / 4096 {
        let want = &expected[lba as usize * 4096..(lba as usize + 1) * 4096];
        match store.read(lba * 4096, &mut block) {
            Ok(()) => assert!(block == want, "block {lba} reads a value that is not its latest"),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Checksum, "block {lba}: {e}");
                assert!(lba >= 16, "block {lba}, copied by GC after the loss, reads as EIO: {e}");
            }
        }
    }
}

/// Issue 48: GC's accounting does not depend on which map pages are cached. With a map cache
/// of one page, a host write racing GC — after GC read its victim, before it appended the
/// copies — owes the removal of the victim's fragment in a leaf that is not cached. GC
/// settles such leaves after the copies (`finish_victim`): the victim's count is exact and it
/// is cleaned. Should the race come after that settling too (`judge_victim` alone, here), the
/// victim waits for a checkpoint, which settles every owed removal, and is then freed. Either
/// way it is never kept out of GC as damaged, and every block reads its latest write.
#[test]
fn a_victim_owed_a_racing_overwrite_is_cleaned_or_waits_for_a_checkpoint_never_kept() {
    use super::gc::{leaves_of, Victim};
    use crate::format::SegmentState;
    for settle_after_copies in [true, false] {
        let options = OpenOptions { background: false, map_cache_bytes: 5 << 10, ..OpenOptions::default() };
        let (_disk, store) = small_store_with(21, options);
        let inner = &store.inner;
        let mut rng = crate::sim::SimRng::new(21);
        let mut expected = std::collections::BTreeMap::new();
        // Sixteen blocks in each of the two leaves of the map, interleaved: every segment
        // holds both.
        for k in 0..16u64 {
            for leaf in 0..2u64 {
                let lba = leaf * 512 + k;
                let data = incompressible(&mut rng, 4096);
                store.write(lba * 4096, &data, Durability::Buffered).unwrap();
                expected.insert(lba, data);
            }
        }
        inner.seal_open_segments().unwrap();
        store.flush().unwrap();
        store.checkpoint().unwrap();
        let segment = segment_of_block(inner, 0);
        let live = inner.collect_live(segment).unwrap();
        let leaves = leaves_of(&live);
        assert!(leaves.len() >= 2, "the victim's blocks lie in {} leaves", leaves.len());
        // The race: overwrite a live block of the first leaf after reading a block of
        // another (whose load evicts the first leaf's page), so the overwrite owes the
        // removal of the victim's fragment.
        let racing = live.iter().find(|f| f.lba.0 < 512).expect("a live block in leaf 0").lba.0;
        store.read(512 * 4096, &mut [0u8; 4096]).unwrap();
        let newer = incompressible(&mut rng, 4096);
        store.write(racing * 4096, &newer, Durability::Buffered).unwrap();
        expected.insert(racing, newer);
        assert!(!inner.map.read().unsettled_among(&leaves).is_empty(), "the overwrite owes nothing: no race made");
        let relocated_bytes = super::log::gc_copy_bytes(&live, inner.log.record_extra_bytes());
        inner.relocate(live, Vec::new(), SpaceClass::Gc).unwrap();
        let victim = Victim { segment, settled: false };
        let why = if settle_after_copies { "settled after the copies" } else { "raced after the settling" };
        let given_back = if settle_after_copies {
            inner.finish_victim(&victim, &leaves, relocated_bytes).unwrap()
        } else {
            inner.judge_victim(&victim, &leaves, relocated_bytes).unwrap()
        };
        {
            let log = inner.log.lock();
            assert!(!log.segments.is_unparseable(segment), "{why}: the victim was kept as damaged");
            let state = log.segments.get(segment).state;
            if settle_after_copies {
                assert_eq!(state, SegmentState::Cleaned, "{why}");
                assert!(given_back.unwrap() > 0, "{why}: gave back nothing");
            } else {
                assert!(log.segments.is_awaiting_checkpoint(segment), "{why}: not waiting for a checkpoint");
                assert_eq!(given_back, Some(0), "{why}");
            }
        }
        // Two checkpoints move the reuse horizon past it: it is free.
        inner.make_cleaned_free().unwrap();
        assert_eq!(inner.log.lock().segments.get(segment).state, SegmentState::Free, "{why}: not freed");
        for (lba, data) in &expected {
            let mut back = vec![0u8; 4096];
            store.read(lba * 4096, &mut back).unwrap();
            assert!(back == *data, "{why}: block {lba} reads back wrong");
        }
        let report = store.check(&mut |_, _| {}).unwrap();
        assert!(report.problems.is_empty(), "{why}: {:?}", report.problems);
    }
}

/// `OpenOptions::codec_cores` (`zdisk serve --codec-cores`) is the threshold the write path
/// and GC read; 0 and more than the process's cores are refused at open, None is the default.
#[test]
fn the_codec_cores_option_reaches_the_store_and_bad_values_are_refused() {
    let available = crate::codec::available_cores();
    let options = |codec_cores| OpenOptions { background: false, codec_cores, ..OpenOptions::default() };
    let (disk, store) = small_store_with(61, options(Some(1)));
    assert_eq!(store.inner.codecs.cores, 1);
    store.close().unwrap();
    let store = Store::open_backing(disk.clone(), &options(Some(available))).unwrap();
    assert_eq!(store.inner.codecs.cores, available);
    store.close().unwrap();
    let store = Store::open_backing(disk.clone(), &options(None)).unwrap();
    assert_eq!(store.inner.codecs.cores, crate::codec::default_codec_cores(available));
    store.close().unwrap();
    for refused in [0, available + 1] {
        let err = Store::open_backing(disk.clone(), &options(Some(refused))).err().expect("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{refused}: {err}");
        assert!(err.to_string().contains(&format!("1..={available}")), "{err}");
    }
}

/// With two codec cores a large write's blocks are shared with a helper thread
/// (`Inner::compress_blocks`), and what it stores is what one thread stores: the same
/// fragments in the same order, and the write reads back intact after a reopen. With one
/// codec core there is no helper.
#[test]
fn a_large_write_is_compressed_beside_its_writer_with_the_same_fragments() {
    let available = crate::codec::available_cores();
    if available < 2 {
        eprintln!("skipped: a helper needs a second core, this process has {available}");
        return;
    }
    let disk = sim_disk_formatted(4 << 20, 64, 8 << 20, Codec::Zstd { level: 1 }, 77);
    let options =
        |codec_cores| OpenOptions { background: false, codec_cores: Some(codec_cores), ..OpenOptions::default() };
    // 64 blocks of text-like data, each different.
    let data: Vec<u8> = (0..64 * BLOCK_SIZE).map(|i| b"the quick brown fox jumps "[(i * 7 + i / 4096) % 26]).collect();
    let blocks: Vec<&[u8]> = data.chunks(BLOCK_SIZE).collect();

    let store = Store::open_backing(disk.clone(), &options(2)).unwrap();
    let helped = |store: &Store| store.inner.codecs.counters.helper_compressed_blocks.load(Ordering::Relaxed);
    let shared = store.inner.compress_blocks(Lba(0), &blocks, &mut Vec::new()).unwrap();
    assert!(helped(&store) >= 8, "a helper compressed a run: {}", helped(&store));
    let mut scratch = Vec::new();
    for (i, (block, source)) in shared.iter().zip(&blocks).enumerate() {
        let alone = store.inner.compress(source, Lba(i as u64), &mut scratch, &mut Default::default()).unwrap();
        assert_eq!((block.entry, &block.bytes), (alone.entry, &alone.bytes), "block {i}");
    }
    let before = helped(&store);
    store.write(BLOCK_SIZE as u64, &data, Durability::Fua).unwrap();
    assert!(helped(&store) > before, "the write shared its blocks");
    store.close().unwrap();

    let store = Store::open_backing(disk.clone(), &options(1)).unwrap();
    assert!(store.inner.codecs.helpers.is_none(), "one codec core: no helper threads");
    store.write(0, &data[..16 * BLOCK_SIZE], Durability::Fua).unwrap();
    assert_eq!(helped(&store), 0);
    let mut back = vec![0u8; data.len()];
    store.read(BLOCK_SIZE as u64 * 16, &mut back[..48 * BLOCK_SIZE]).unwrap();
    assert!(back[..48 * BLOCK_SIZE] == data[15 * BLOCK_SIZE..63 * BLOCK_SIZE], "the shared write reads back");
    let report = store.check(&mut |_, _| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    store.close().unwrap();
}

/// Under the LZ4 fallback, a request's blocks that follow one LZ4 could not shrink are stored
/// raw without LZ4, and LZ4 is tried again every `LZ4_RETRY_BLOCKS`th block: a run that turns
/// compressible loses at most `LZ4_RETRY_BLOCKS - 1` blocks to raw, and every block reads back.
#[test]
fn the_lz4_fallback_skips_a_run_it_just_failed_to_shrink_and_tries_again() {
    use rand::{RngCore, SeedableRng};
    let disk = sim_disk_formatted(4 << 20, 64, 8 << 20, Codec::Zstd { level: 1 }, 78);
    let options =
        OpenOptions { background: false, codec_fallback: crate::CodecFallback::Always, ..OpenOptions::default() };
    let store = Store::open_backing(disk, &options).unwrap();
    let counters = |store: &Store| {
        let c = &store.inner.codecs.counters;
        (c.fallback_blocks.load(Ordering::Relaxed), c.incompressible_skipped_blocks.load(Ordering::Relaxed))
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(78);
    let mut random = vec![0u8; 32 * BLOCK_SIZE];
    rng.fill_bytes(&mut random);
    let text: Vec<u8> = (0..32 * BLOCK_SIZE).map(|i| b"the quick brown fox jumps "[(i * 7 + i / 4096) % 26]).collect();

    // 32 random blocks: LZ4 on blocks 0, 4, 8, ..., 28, the others raw without it.
    store.write(0, &random, Durability::Fua).unwrap();
    let retry = super::request::LZ4_RETRY_BLOCKS as u64;
    assert_eq!(counters(&store), (32 / retry, 32 - 32 / retry));
    // 4 random blocks, then text: LZ4 on block 0 (raw), blocks 1-3 raw without it, block 4
    // shrinks and every later one goes through LZ4 again.
    let mixed = [&random[..4 * BLOCK_SIZE], &text[4 * BLOCK_SIZE..]].concat();
    let before = counters(&store);
    store.write(32 * BLOCK_SIZE as u64, &mixed, Durability::Fua).unwrap();
    let after = counters(&store);
    assert_eq!((after.0 - before.0, after.1 - before.1), (29, 3), "(LZ4 runs, raw without LZ4)");
    // Text alone never skips, nor text after an all-zero block (stored as no data, not by LZ4).
    store.write(64 * BLOCK_SIZE as u64, &text, Durability::Fua).unwrap();
    let zero_then_text = [&[0u8; BLOCK_SIZE][..], &text[BLOCK_SIZE..]].concat();
    store.write(96 * BLOCK_SIZE as u64, &zero_then_text, Durability::Fua).unwrap();
    assert_eq!(counters(&store).1, after.1);
    let mut back = vec![0u8; 32 * BLOCK_SIZE];
    for (at, data) in [(0u64, &random), (32, &mixed), (64, &text), (96, &zero_then_text)] {
        store.read(at * BLOCK_SIZE as u64, &mut back).unwrap();
        assert!(back == *data, "blocks {at}..{} read back", at + 32);
    }
    store.close().unwrap();
}
