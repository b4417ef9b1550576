//! Encrypted stores (`docs/format.md`, "Encryption"; threat model in `docs/guarantees.md`):
//! round trips for every codec, wrong and missing keys (refused, nothing written), no
//! plaintext on the backing, and tampering — ciphertext, tag, a fragment moved to another
//! LBA, a map page, a checkpoint — reading as EIO or refusing the open, never as data.
//! (The crash model's `encrypted_stores_survive_crashes_and_never_reuse_a_nonce` covers
//! crashes and nonce uniqueness.)

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use common::*;
use rand::Rng;
use zdisk_engine::sim::inspect;
use zdisk_engine::sim::SimDisk;
use zdisk_engine::{Codec, DictionaryOptions, Durability, ErrorKind, OpenOptions, Secret, Store};

const LOGICAL: u64 = 4 << 20;
/// Bytes a sealed fragment adds: the stored nonce's low 32 bits (4) and the tag (16).
const SEAL_BYTES: usize = 20;
const PI_BYTES: usize = 12;

fn key(passphrase: &str) -> Option<Arc<Secret>> {
    Some(Arc::new(Secret::passphrase(passphrase.as_bytes().to_vec())))
}

fn encrypted_disk(codec: Codec) -> Arc<SimDisk> {
    new_disk_with(96, 64 << 10, LOGICAL, codec, 7, Some(test_encryption("correct horse")))
}

fn options(passphrase: &str) -> OpenOptions {
    OpenOptions { key: key(passphrase), ..test_options() }
}

/// Writes `data` from offset 0, flushes, checkpoints, closes.
fn write_and_close(disk: &Arc<SimDisk>, data: &[u8]) {
    let store = Store::open_backing(disk.clone(), &options("correct horse")).unwrap();
    store.write(0, data, Durability::Buffered).unwrap();
    store.flush().unwrap();
    store.checkpoint().unwrap();
    store.close().unwrap();
}

fn reopen(disk: &Arc<SimDisk>) -> Store {
    Store::open_backing(Arc::new(SimDisk::from_image(disk.image(), 1)), &options("correct horse")).unwrap()
}

/// An encrypted LZ4 store holding `len` bytes of `block_data(seed, len, percent)` from
/// offset 0, closed; and those bytes.
fn encrypted_store_holding(seed: u64, len: usize, percent: u32) -> (Arc<SimDisk>, Vec<u8>) {
    let data = block_data(&mut rng(seed), len, percent);
    let disk = encrypted_disk(Codec::Lz4);
    write_and_close(&disk, &data);
    (disk, data)
}

#[test]
fn every_codec_round_trips_encrypted_and_across_a_reopen() {
    let mut rng = rng(1);
    let data = [word_text(&mut rng, 1 << 20), block_data(&mut rng, 1 << 20, 40)].concat();
    // (Raw fragments too: a share of the blocks is incompressible.)
    for codec in [Codec::Lz4, Codec::Zstd { level: 3 }, Codec::Deflate { level: 6 }] {
        let disk = encrypted_disk(codec);
        write_and_close(&disk, &data);
        let store = reopen(&disk);
        assert_eq!(read_all(&store)[..data.len()], data[..], "{codec}");
        assert!(store.check(&mut |_, _| {}).unwrap().problems.is_empty(), "{codec}");
    }
    // A trained dictionary: sealed in the checkpoint, named by sealed fragments.
    let disk = encrypted_disk(Codec::Zstd { level: 1 });
    write_and_close(&disk, &data);
    let store = Store::open_backing(disk.clone(), &options("correct horse")).unwrap();
    store.recompress_with_new_dictionary(&DictionaryOptions::default(), &mut |_, _| {}).unwrap();
    assert!(store.stats().codec.dictionary_count > 0);
    store.close().unwrap();
    let store = reopen(&disk);
    assert_eq!(read_all(&store)[..data.len()], data[..], "dictionary");
    assert!(store.check(&mut |_, _| {}).unwrap().problems.is_empty());
}

#[test]
fn a_wrong_or_missing_key_is_refused_and_nothing_is_written() {
    let disk = encrypted_disk(Codec::Lz4);
    write_and_close(&disk, &vec![7u8; 1 << 20]);
    let before = disk.image();
    let writes = disk.writes();
    let wrong = Store::open_backing(disk.clone(), &options("Tr0ub4dor")).err().expect("a wrong key opens nothing");
    assert_eq!(wrong.kind(), ErrorKind::WrongKey, "{wrong}");
    let missing = Store::open_backing(disk.clone(), &test_options()).err().expect("no key opens nothing");
    assert_eq!(missing.kind(), ErrorKind::WrongKey, "{missing}");
    let file = OpenOptions { key: Some(Arc::new(Secret::key_file(vec![1; 32]))), ..test_options() };
    assert_eq!(Store::open_backing(disk.clone(), &file).err().unwrap().kind(), ErrorKind::WrongKey);
    assert_eq!(disk.writes(), writes, "a refused key wrote something");
    assert!(disk.image() == before);
    // A key for a plain store is a mistake, said so.
    let plain = new_disk(96, 64 << 10, LOGICAL, Codec::Lz4, 7);
    let err = Store::open_backing(plain, &options("correct horse")).err().unwrap();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    // The right key still opens it, read-only too.
    let store =
        Store::open_backing(disk.clone(), &OpenOptions { read_only: true, ..options("correct horse") }).unwrap();
    assert!(read_all(&store)[..1 << 20].iter().all(|&b| b == 7));
}

/// Every 16-byte window of `text`, and how many of them occur in `image`.
fn text_windows_found(text: &[u8], image: &[u8]) -> usize {
    let windows: HashSet<&[u8]> = text.windows(16).step_by(3).collect();
    image.windows(16).filter(|w| windows.contains(w)).count()
}

#[test]
fn the_backing_holds_no_plaintext() {
    let mut rng = rng(2);
    // Text zstd and LZ4 keep long literal runs of: a plain store shows them on disk.
    let text: Vec<u8> = (0..256).flat_map(|i| format!("row {i}: {}\n", rng_sentence(i)).into_bytes()).collect();
    let data: Vec<u8> = text.iter().copied().cycle().take(2 << 20).collect();
    let plain = new_disk(96, 64 << 10, LOGICAL, Codec::Lz4, 7);
    let store = Store::open_backing(plain.clone(), &test_options()).unwrap();
    store.write(0, &data, Durability::Buffered).unwrap();
    store.flush().unwrap();
    store.close().unwrap();
    assert!(text_windows_found(&text, &plain.image()) > 100, "the control: a plain store shows its text");
    for codec in [Codec::Lz4, Codec::Zstd { level: 1 }, Codec::Deflate { level: 6 }] {
        let disk = encrypted_disk(codec);
        write_and_close(&disk, &data);
        let store = Store::open_backing(disk.clone(), &options("correct horse")).unwrap();
        // A dictionary trained on the text is part of the checkpoint: sealed too.
        if codec == (Codec::Zstd { level: 1 }) {
            store.recompress_with_new_dictionary(&DictionaryOptions::default(), &mut |_, _| {}).unwrap();
        }
        store.close().unwrap();
        let _ = &mut rng;
        assert_eq!(text_windows_found(&text, &disk.image()), 0, "{codec}: plaintext on the backing");
    }
}

fn rng_sentence(i: u64) -> String {
    let words = ["checkpoint", "segment", "fragment", "ledger", "balance", "customer", "invoice", "shipped"];
    (0..8).map(|j| words[((i * 7 + j * 3) % 8) as usize]).collect::<Vec<_>>().join(" ")
}

/// The byte range of LBA `lba`'s newest fragment in an image, and its record's kind.
fn fragment_of(image: &[u8], lba: u64) -> std::ops::Range<u64> {
    inspect::records(image)
        .into_iter()
        .flat_map(|r| r.fragments)
        .rfind(|(l, _)| *l == lba)
        .map(|(_, range)| range)
        .expect("the block has a fragment")
}

/// An encrypted fragment's guard is its placement tag (docs/format.md): a keyed function of
/// its address and the first 8 bytes of its AEAD tag, which an attacker cannot recompute —
/// and need not: it does not cover the ciphertext, the stored nonce or the tag's last 8
/// bytes, so changes there keep it valid and only the AEAD can refuse them.
fn guard_of(image: &[u8], range: &std::ops::Range<u64>) -> [u8; 4] {
    image[range.start as usize..][..4].try_into().unwrap()
}

fn read_block(store: &Store, lba: u64) -> zdisk_engine::Result<Vec<u8>> {
    let mut block = vec![0u8; 4096];
    store.read(lba * 4096, &mut block).map(|()| block)
}

#[test]
fn tampered_ciphertext_and_tags_read_as_eio() {
    let (disk, data) = encrypted_store_holding(3, 64 * 4096, 30);
    let image = disk.image();
    let stored = (0..64u64).filter(|&lba| data[lba as usize * 4096..][..4096].iter().any(|&b| b != 0));
    for lba in stored.step_by(20) {
        let range = fragment_of(&image, lba);
        assert!(range.end - range.start > (PI_BYTES + SEAL_BYTES) as u64, "a sealed fragment");
        // The ciphertext's first byte, the tag's last byte, the stored nonce.
        for at in [range.start as usize + PI_BYTES + 8, range.end as usize - 1, range.start as usize + PI_BYTES] {
            let mut tampered = image.clone();
            tampered[at] ^= 0x40;
            assert_eq!(guard_of(&tampered, &range), guard_of(&image, &range), "the guard still holds");
            let store =
                Store::open_backing(Arc::new(SimDisk::from_image(tampered, 1)), &options("correct horse")).unwrap();
            let err = read_block(&store, lba).expect_err("tampered bytes must not read");
            assert_eq!(err.kind(), ErrorKind::Checksum, "{err}");
            let other = (lba + 1) % 64;
            assert_eq!(read_block(&store, other).unwrap(), data[other as usize * 4096..][..4096]);
        }
    }
}

/// Short nonces (`docs/format.md`, "Nonces"): a fragment stores its nonce's low 32 bits, 20
/// bytes of seal in all, and its segment's use records the epoch. A run whose nonces cross
/// into the next epoch seals its open segments and goes on in new ones; GC seals older
/// fragments again as it moves them; every block reads back — after the crossing, after GC,
/// after a reopen (which crosses once more) — and `check` finds the store clean.
#[test]
fn nonces_crossing_into_a_new_epoch_keep_every_block() {
    let disk = encrypted_disk(Codec::Lz4);
    let options = OpenOptions { nonce_lease: 16, nonce_epoch_end_margin: Some(100), ..options("correct horse") };
    let mut rng = rng(12);
    // Incompressible: a raw fragment is its protection information, the block and the seal.
    let mut expected = block_data(&mut rng, 256 * 4096, 100);
    let store = Store::open_backing(disk.clone(), &options).unwrap();
    store.write(0, &expected, Durability::Buffered).unwrap();
    store.flush().unwrap();
    let stored = (0..256u64).find(|&lba| expected[lba as usize * 4096..][..4096].iter().any(|&b| b != 0)).unwrap();
    let range = fragment_of(&disk.image(), stored);
    assert_eq!(range.end - range.start, (PI_BYTES + 4096 + SEAL_BYTES) as u64);
    store.close().unwrap();
    for _ in 0..2 {
        // Each open crosses into the next epoch again: every block from the run before is
        // of an older one.
        let store = Store::open_backing(disk.clone(), &options).unwrap();
        assert!(read_all(&store)[..expected.len()] == expected[..], "differs after a reopen");
        for _ in 0..48 {
            let lba = rng.gen_range(0..256u64);
            let block = block_data(&mut rng, 4096, 100);
            store.write(lba * 4096, &block, Durability::Buffered).unwrap();
            expected[lba as usize * 4096..][..4096].copy_from_slice(&block);
        }
        store.flush().unwrap();
        store.collect_garbage(usize::MAX).unwrap();
        assert!(read_all(&store)[..expected.len()] == expected[..], "a block reads back different");
        assert!(store.check(&mut |_, _| {}).unwrap().problems.is_empty());
        store.close().unwrap();
    }
    let store = Store::open_backing(disk.clone(), &options).unwrap();
    for lba in 0..128u64 {
        let block = block_data(&mut rng, 4096, 100);
        store.write(lba * 4096, &block, Durability::Buffered).unwrap();
        expected[lba as usize * 4096..][..4096].copy_from_slice(&block);
    }
    store.flush().unwrap();
    store.collect_garbage(usize::MAX).unwrap();
    store.checkpoint().unwrap();
    assert!(read_all(&store)[..expected.len()] == expected[..], "differs after GC of older epochs");
    assert!(store.check(&mut |_, _| {}).unwrap().problems.is_empty());
    drop(store); // a crash: replay meets the last segments' epochs in their records
    let store = reopen(&disk);
    assert!(read_all(&store)[..expected.len()] == expected[..], "differs after a crash");
    assert!(store.check(&mut |_, _| {}).unwrap().problems.is_empty());
}

#[test]
fn a_fragment_moved_to_another_lba_fails_authentication() {
    // Incompressible blocks: every fragment has the same length, so one fits another's place.
    let (disk, data) = encrypted_store_holding(4, 16 * 4096, 100);
    let image = disk.image();
    let (from, to) = (fragment_of(&image, 3), fragment_of(&image, 9));
    assert_eq!(from.end - from.start, to.end - to.start);
    let mut moved = image.clone();
    let bytes = image[from.start as usize..from.end as usize].to_vec();
    moved[to.start as usize..to.end as usize].copy_from_slice(&bytes);
    // Claim LBA 9 in the protection information too, as a forger would.
    moved[to.start as usize + 4..to.start as usize + 10].copy_from_slice(&9u64.to_le_bytes()[..6]);
    // (Its guard, the placement tag of block 3's address, fails here too; the tag check is
    // the second line of defence.)
    let store = Store::open_backing(Arc::new(SimDisk::from_image(moved, 1)), &options("correct horse")).unwrap();
    let err = read_block(&store, 9).expect_err("block 3's bytes must not read as block 9");
    assert_eq!(err.kind(), ErrorKind::Checksum, "{err}");
    assert_eq!(read_block(&store, 3).unwrap(), data[3 * 4096..4 * 4096]);
}

#[test]
fn a_tampered_map_page_or_checkpoint_is_never_taken_for_data() {
    let (disk, data) = encrypted_store_holding(5, 1 << 20, 30);
    let image = disk.image();
    // A map page: flip a ciphertext byte and fix its guard.
    let page = inspect::records(&image).into_iter().flat_map(|r| r.pages).last().expect("a map page").1;
    let mut tampered = image.clone();
    tampered[page.start as usize + PI_BYTES + 9] ^= 1;
    match Store::open_backing(Arc::new(SimDisk::from_image(tampered, 1)), &options("correct horse")) {
        Ok(store) => {
            for lba in 0..256u64 {
                match read_block(&store, lba) {
                    Ok(block) => assert_eq!(block, data[lba as usize * 4096..][..4096], "block {lba}"),
                    Err(e) => assert_eq!(e.kind(), ErrorKind::Checksum, "{e}"),
                }
            }
        }
        Err(e) => assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}"),
    }
    // The newest checkpoint's superblock: change a field and fix the slot's CRC. The MAC
    // refuses it; recovery falls back to the older checkpoint, whose contents are older but
    // complete (the log since it is replayed), or refuses to open.
    let sb = inspect::superblock(&image);
    let slot = (sb.generation % 2) as usize * 16384;
    let mut tampered = image.clone();
    tampered[slot + 48] ^= 0x10; // the physical size's low byte
    let crc = crc32c::crc32c(&tampered[slot..slot + 16380]);
    tampered[slot + 16380..slot + 16384].copy_from_slice(&crc.to_le_bytes());
    if let Ok(store) = Store::open_backing(Arc::new(SimDisk::from_image(tampered, 1)), &options("correct horse")) {
        assert_eq!(read_all(&store)[..data.len()], data[..]);
    }
}

/// Rewrites a trim record's start LBA (in its head and in its tail's copy), with every CRC
/// fixed: a forgery by an attacker who knows the format but not the key.
fn forge_trim(image: &mut [u8], record: &inspect::RecordLayout, lba: u64) {
    let head = record.head.start as usize;
    let tail_end = record.tail.end as usize;
    let copy = tail_end - 4 - 64;
    for at in [head, copy] {
        image[at + 24..at + 32].copy_from_slice(&lba.to_le_bytes());
        let crc = crc32c::crc32c(&image[at..at + 60]);
        image[at + 60..at + 64].copy_from_slice(&crc.to_le_bytes());
    }
    let tail = record.tail.start as usize;
    let crc = crc32c::crc32c(&image[tail..tail_end - 4]);
    image[tail_end - 4..tail_end].copy_from_slice(&crc.to_le_bytes());
}

/// Writes 16 blocks, checkpoints, trims block 5, flushes and loses power: the trim is in the
/// log after the checkpoint. Returns the data and the crashed image.
fn trim_after_checkpoint(disk: &Arc<SimDisk>, options: &OpenOptions) -> (Vec<u8>, Vec<u8>) {
    let data = block_data(&mut rng(6), 16 * 4096, 100);
    let store = Store::open_backing(disk.clone(), options).unwrap();
    store.write(0, &data, Durability::Buffered).unwrap();
    store.flush().unwrap();
    store.checkpoint().unwrap();
    store.trim(5 * 4096, 4096, Durability::Buffered).unwrap();
    store.flush().unwrap();
    disk.power_off();
    drop(store);
    (data, disk.crash_image())
}

#[test]
fn a_forged_record_in_the_log_is_refused() {
    let forged_store = |image: Vec<u8>, options: &OpenOptions| {
        let trim = inspect::replay_window(&image).into_iter().rfind(|r| r.kind == 2).expect("the trim record");
        let mut forged = image;
        forge_trim(&mut forged, &trim, 7);
        Store::open_backing(
            Arc::new(SimDisk::from_image(forged, 1)),
            &OpenOptions { accept_data_loss: true, ..options.clone() },
        )
    };
    // The control: a plain store takes the forgery (its CRCs are all an attacker must fix).
    let plain = new_disk(96, 64 << 10, LOGICAL, Codec::Lz4, 7);
    let (data, image) = trim_after_checkpoint(&plain, &test_options());
    let store = forged_store(image, &test_options()).unwrap();
    assert!(read_block(&store, 7).unwrap() == vec![0; 4096], "the control: the forged trim applies");
    // Encrypted: the record's MAC does not match its head, so replay does not take it.
    let disk = encrypted_disk(Codec::Lz4);
    let (data_e, image) = trim_after_checkpoint(&disk, &options("correct horse"));
    assert_eq!(data, data_e);
    let store = forged_store(image, &options("correct horse")).unwrap();
    for lba in 0..16u64 {
        match read_block(&store, lba) {
            Ok(block) if lba == 5 => assert!(block == data[5 * 4096..6 * 4096] || block == vec![0; 4096]),
            Ok(block) => assert!(block == data[lba as usize * 4096..][..4096], "block {lba} is not what was written"),
            Err(e) => assert_eq!(e.kind(), ErrorKind::Checksum, "block {lba}: {e}"),
        }
    }
}

#[test]
fn capacity_statistics_need_no_key() {
    let (disk, _) = encrypted_store_holding(7, 1 << 20, 50);
    let writes = disk.writes();
    let (info, keyless) = Store::checkpoint_stats_of(disk.clone(), &test_options()).unwrap();
    assert!(info.encrypted);
    assert_eq!(disk.writes(), writes, "reading the checkpoint's numbers wrote something");
    let keyed = reopen(&disk).stats();
    assert!(keyless.logical_size > 0);
    // Closed cleanly: the last checkpoint holds everything, so the numbers agree.
    assert_eq!(
        (keyless.logical_size, keyless.physical_size, keyless.free_space, keyless.provisioned_cap),
        (keyed.logical_size, keyed.physical_size, keyed.free_space, keyed.provisioned_cap)
    );
    assert_eq!(keyless.comp_ratio, keyed.comp_ratio);
}
/// Writes two versions of block 3 (incompressible: every version has the same length) and
/// closes; returns the first version's and the current fragment's byte ranges and the image.
fn two_versions(disk: &Arc<SimDisk>, options: &OpenOptions) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let mut rng = rng(8);
    let (old, new) = (block_data(&mut rng, 4096, 100), block_data(&mut rng, 4096, 100));
    let store = Store::open_backing(disk.clone(), options).unwrap();
    store.write(3 * 4096, &old, Durability::Buffered).unwrap();
    store.flush().unwrap();
    store.checkpoint().unwrap();
    store.write(3 * 4096, &new, Durability::Buffered).unwrap();
    store.close().unwrap();
    (old, new, disk.image())
}

#[test]
fn an_older_version_put_back_where_the_map_points_fails_authentication() {
    let roll_back = |image: &mut Vec<u8>| {
        let versions: Vec<_> =
            inspect::records(image).into_iter().flat_map(|r| r.fragments).filter(|(lba, _)| *lba == 3).collect();
        let (old, current) = (versions[0].1.clone(), versions[versions.len() - 1].1.clone());
        assert_eq!(old.end - old.start, current.end - current.start, "same length: the forger's easy case");
        assert_ne!(old.start, current.start);
        let bytes = image[old.start as usize..old.end as usize].to_vec();
        image[current.start as usize..current.end as usize].copy_from_slice(&bytes);
    };
    // The control: in a plain store the old version's CRC is as good as the new one's.
    let plain = new_disk(96, 64 << 10, LOGICAL, Codec::Lz4, 7);
    let (old, _, mut image) = two_versions(&plain, &test_options());
    roll_back(&mut image);
    let store = Store::open_backing(Arc::new(SimDisk::from_image(image, 1)), &test_options()).unwrap();
    assert!(read_block(&store, 3).unwrap() == old, "the control: a plain store returns the rolled-back version");
    // Encrypted: the old version was sealed for its own address, not this one.
    let disk = encrypted_disk(Codec::Lz4);
    let (_, new, mut image) = two_versions(&disk, &options("correct horse"));
    let store =
        Store::open_backing(Arc::new(SimDisk::from_image(image.clone(), 1)), &options("correct horse")).unwrap();
    assert!(read_block(&store, 3).unwrap() == new);
    drop(store);
    roll_back(&mut image);
    let store = Store::open_backing(Arc::new(SimDisk::from_image(image, 1)), &options("correct horse")).unwrap();
    match read_block(&store, 3) {
        Ok(_) => panic!("an older version must not read"),
        Err(err) => assert_eq!(err.kind(), ErrorKind::Checksum, "{err}"),
    }
}

/// Block 3 written again and again (incompressible: every version the same length), each
/// write flushed, in a store of 16 small segments: GC cleans segments and the log reuses
/// them, and before long block 3's current version lies at exactly the address an older
/// version had in an earlier use of the same segment. Returns the image at that moment with
/// the older version's bytes put back there, and the older and current contents.
fn image_with_a_version_from_an_earlier_use(disk: &Arc<SimDisk>, options: &OpenOptions) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let store = Store::open_backing(disk.clone(), options).unwrap();
    let mut rng = rng(11);
    let mut earlier: std::collections::HashMap<u64, (Vec<u8>, Vec<u8>)> = Default::default();
    for _ in 0..5000 {
        let data = block_data(&mut rng, 4096, 100);
        store.write(3 * 4096, &data, Durability::Buffered).unwrap();
        store.flush().unwrap();
        let image = disk.image();
        let newest = inspect::records(&image).into_iter().flat_map(|r| r.fragments).rfind(|(lba, _)| *lba == 3);
        let (_, at) = newest.expect("block 3 is in the log");
        let bytes = image[at.start as usize..at.end as usize].to_vec();
        match earlier.get(&at.start) {
            Some((old_bytes, old_data)) if old_bytes.len() == bytes.len() && *old_data != data => {
                // Checkpointed, so the map that points there is read, not replayed (a
                // changed record replay would find damaged: the log's own check).
                store.checkpoint().unwrap();
                let mut rolled_back = disk.image();
                rolled_back[at.start as usize..at.end as usize].copy_from_slice(old_bytes);
                return (rolled_back, old_data.clone(), data);
            }
            _ => {
                earlier.insert(at.start, (bytes, data));
            }
        }
    }
    panic!("no segment was reused with block 3 at the same address");
}

#[test]
fn an_older_version_from_an_earlier_use_of_the_segment_at_the_same_address_fails_authentication() {
    // The control: a plain store returns the older version (its CRC is as good).
    let plain = new_disk(16, 64 << 10, 256 << 10, Codec::Lz4, 7);
    let (image, old, _) = image_with_a_version_from_an_earlier_use(&plain, &test_options());
    let store = Store::open_backing(Arc::new(SimDisk::from_image(image, 1)), &test_options()).unwrap();
    assert!(read_block(&store, 3).unwrap() == old, "the control: a plain store returns the rolled-back version");
    // Encrypted: the older version's placement tag is of that address in the segment's
    // earlier use (its first record's sequence number), not of this use.
    let disk = new_disk_with(16, 64 << 10, 256 << 10, Codec::Lz4, 7, Some(test_encryption("correct horse")));
    let (image, _, new) = image_with_a_version_from_an_earlier_use(&disk, &options("correct horse"));
    let store = Store::open_backing(Arc::new(SimDisk::from_image(disk.image(), 1)), &options("correct horse")).unwrap();
    assert!(read_block(&store, 3).unwrap() == new, "before the roll-back");
    drop(store);
    let store = Store::open_backing(Arc::new(SimDisk::from_image(image, 1)), &options("correct horse")).unwrap();
    match read_block(&store, 3) {
        Ok(_) => panic!("an older version from an earlier use of the segment must not read"),
        Err(err) => assert_eq!(err.kind(), ErrorKind::Checksum, "{err}"),
    }
}

/// Encrypted stores made by earlier code, each 512 KiB of `block_data(rng(5), _, 50)`,
/// checkpointed, then 128 KiB of `block_data(rng(6), _, 50)` over it from 64 KiB, flushed,
/// abandoned (the second write is replayed):
/// - `v5-encrypted-address-placement.img.zst`, by the code of 2026-11-25 (commit bf1d092):
///   placement tags of the address alone (no superblock feature flag 16), whole nonces;
/// - `v5-encrypted-whole-nonces.img.zst`, by the code of 2026-11-26 (commit 3b942cb):
///   placement tags binding the segment's use, whole nonces (no feature flag 32).
///
/// Each opens, replays, reads back, takes new writes — in its own layout still, as its
/// superblock says — and checks clean, before and after a reopen.
#[test]
fn encrypted_stores_of_earlier_layouts_still_work() {
    for fixture in ["v5-encrypted-address-placement.img.zst", "v5-encrypted-whole-nonces.img.zst"] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(fixture);
        let image = zstd::decode_all(&std::fs::read(path).unwrap()[..]).unwrap();
        let mut expected = block_data(&mut rng(5), 512 << 10, 50);
        let again = block_data(&mut rng(6), 128 << 10, 50);
        expected[64 << 10..(64 << 10) + again.len()].copy_from_slice(&again);
        let disk = Arc::new(SimDisk::from_image(image, 1));
        let store = Store::open_backing(disk.clone(), &options("correct horse")).unwrap();
        assert!(read_all(&store)[..expected.len()] == expected[..], "{fixture} reads back different");
        let fresh = block_data(&mut rng(7), 64 << 10, 50);
        store.write(256 << 10, &fresh, Durability::Buffered).unwrap();
        expected[256 << 10..(256 << 10) + fresh.len()].copy_from_slice(&fresh);
        store.flush().unwrap();
        store.collect_garbage(usize::MAX).unwrap();
        assert!(store.check(&mut |_, _| {}).unwrap().problems.is_empty(), "{fixture}");
        store.close().unwrap();
        let store = reopen(&disk);
        assert!(read_all(&store)[..expected.len()] == expected[..], "{fixture} differs after writes and a reopen");
        assert!(store.check(&mut |_, _| {}).unwrap().problems.is_empty(), "{fixture}");
    }
}

/// A lone large write shared out to a helper thread (`--codec-cores 2`) seals its blocks on
/// that thread: they read back across a reopen and `check` is clean.
#[test]
fn a_write_compressed_by_helper_threads_round_trips_encrypted() {
    if zdisk_engine::available_cores() < 2 {
        eprintln!("skipped: a helper needs a second core");
        return;
    }
    let data = word_text(&mut rng(3), 1 << 20);
    let disk = encrypted_disk(Codec::Zstd { level: 1 });
    let store =
        Store::open_backing(disk.clone(), &OpenOptions { codec_cores: Some(2), ..options("correct horse") }).unwrap();
    store.write(0, &data, Durability::Fua).unwrap();
    assert!(store.stats().codec.helper_compressed_blocks > 0, "no helper ran: {:?}", store.stats().codec);
    store.close().unwrap();
    let store = reopen(&disk);
    assert_eq!(read_all(&store)[..data.len()], data[..]);
    assert!(store.check(&mut |_, _| {}).unwrap().problems.is_empty());
}
