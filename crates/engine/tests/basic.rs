//! Requests, formats and bad input on a real file.

use zdisk_engine::{Codec, Durability, ErrorKind, ExtentKind, FormatOptions, OpenOptions, Store};

fn format(dir: &tempfile::TempDir, physical: u64, logical: u64, codec: Codec) -> std::path::PathBuf {
    let path = dir.path().join("store.zdisk");
    Store::format(
        &path,
        &FormatOptions {
            physical_size_bytes: physical,
            logical_size_bytes: logical,
            codec,
            segment_size_bytes: None,
            force: false,
            over_provision_ppm: zdisk_engine::OVER_PROVISION_DEFAULT_PPM,
            encryption: None,
            allocation: zdisk_engine::Allocation::Sparse,
        },
    )
    .unwrap();
    path
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    // Half-compressible: text-like runs.
    (0..len)
        .map(|i| if (i / 64) % 2 == 0 { b'a' + ((i / 7) % 20) as u8 } else { (i as u8).wrapping_mul(seed) ^ seed })
        .collect()
}

#[test]
fn writes_read_back_across_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = format(&dir, 64 << 20, 256 << 20, Codec::Lz4);
    let data = pattern(1 << 20, 7);
    {
        let store = Store::open(&path, &OpenOptions::default()).unwrap();
        store.write(4096 * 10, &data, Durability::Buffered).unwrap();
        store.write(12345, b"hello unaligned world", Durability::Fua).unwrap();
        let mut back = vec![0; data.len()];
        store.read(4096 * 10, &mut back).unwrap();
        assert!(back == data);
        store.close().unwrap();
    }
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    let mut back = vec![0; data.len()];
    store.read(4096 * 10, &mut back).unwrap();
    assert!(back == data);
    let mut small = vec![0; 21];
    store.read(12345, &mut small).unwrap();
    assert_eq!(&small, b"hello unaligned world");
    let stats = store.stats();
    assert!(stats.comp_ratio > 1.3, "{stats:?}");
}

#[test]
fn unaligned_writes_merge_with_neighbours() {
    let dir = tempfile::tempdir().unwrap();
    let path = format(&dir, 32 << 20, 32 << 20, Codec::Zstd { level: 3 });
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    let mut model = vec![0u8; 64 << 10];
    for (i, (offset, len)) in
        [(100usize, 5000usize), (4000, 200), (8191, 2), (0, 1), (65535, 1), (30000, 20000)].into_iter().enumerate()
    {
        let data = pattern(len, i as u8 + 1);
        store.write(offset as u64, &data, Durability::Buffered).unwrap();
        model[offset..offset + len].copy_from_slice(&data);
    }
    store.write_zeroes(1000, 3000, Durability::Buffered).unwrap();
    model[1000..4000].fill(0);
    store.trim(0, 4096 * 3, Durability::Buffered).unwrap(); // whole blocks 0..3 become holes
    model[..4096 * 3].fill(0);
    let mut back = vec![0; model.len()];
    store.read(0, &mut back).unwrap();
    assert!(back == model);
}

#[test]
fn zero_length_and_out_of_range_requests() {
    let dir = tempfile::tempdir().unwrap();
    let path = format(&dir, 16 << 20, 16 << 20, Codec::Lz4);
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    store.write(0, &[], Durability::Buffered).unwrap();
    store.write(16 << 20, &[], Durability::Fua).unwrap();
    store.read(0, &mut []).unwrap();
    store.trim(0, 0, Durability::Buffered).unwrap();
    store.write_zeroes(0, 0, Durability::Fua).unwrap();
    assert_eq!(store.write((16 << 20) - 1, &[1, 2], Durability::Buffered).unwrap_err().kind(), ErrorKind::OutOfRange);
    assert_eq!(store.read(16 << 20, &mut [0]).unwrap_err().kind(), ErrorKind::OutOfRange);
    assert_eq!(store.trim(u64::MAX - 1, 10, Durability::Buffered).unwrap_err().kind(), ErrorKind::OutOfRange);
    assert_eq!(store.write_zeroes(0, (16 << 20) + 1, Durability::Buffered).unwrap_err().kind(), ErrorKind::OutOfRange);
    assert!(store.block_status(u64::MAX, 1).is_err());
}

#[test]
fn block_status_reports_holes_zeroes_and_data() {
    let dir = tempfile::tempdir().unwrap();
    let path = format(&dir, 16 << 20, 16 << 20, Codec::Lz4);
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    store.write(0, &pattern(8192, 3), Durability::Buffered).unwrap();
    store.write_zeroes(8192, 8192, Durability::Buffered).unwrap();
    store.write(16384, &vec![0u8; 4096], Durability::Buffered).unwrap();
    let extents = store.block_status(0, 32768).unwrap();
    let kinds: Vec<(u64, u64, ExtentKind)> = extents.iter().map(|e| (e.offset, e.length, e.kind)).collect();
    assert_eq!(
        kinds,
        vec![(0, 8192, ExtentKind::Data), (8192, 12288, ExtentKind::Zero), (20480, 12288, ExtentKind::Hole)]
    );
}

#[test]
fn foreign_truncated_newer_and_locked_stores_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let foreign = dir.path().join("foreign");
    std::fs::write(&foreign, pattern(4 << 20, 9)).unwrap();
    let before = std::fs::read(&foreign).unwrap();
    assert_eq!(Store::open(&foreign, &OpenOptions::default()).err().unwrap().kind(), ErrorKind::NotAStore);
    assert_eq!(std::fs::read(&foreign).unwrap(), before, "nothing may be written to a foreign file");
    let err = Store::format(
        &foreign,
        &FormatOptions {
            physical_size_bytes: 4 << 20,
            logical_size_bytes: 4 << 20,
            codec: Codec::Lz4,
            segment_size_bytes: None,
            force: false,
            over_provision_ppm: zdisk_engine::OVER_PROVISION_DEFAULT_PPM,
            encryption: None,
            allocation: zdisk_engine::Allocation::Sparse,
        },
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::HoldsData, "{err}");

    let path = format(&dir, 16 << 20, 16 << 20, Codec::Lz4);
    {
        let store = Store::open(&path, &OpenOptions::default()).unwrap();
        let second = Store::open(&path, &OpenOptions::default()).err().unwrap();
        assert_eq!(second.kind(), ErrorKind::Locked);
        let reader = Store::open(&path, &OpenOptions { read_only: true, ..OpenOptions::default() }).err().unwrap();
        assert_eq!(reader.kind(), ErrorKind::Locked);
        store.close().unwrap();
    }
    // Newer version: bump the version in both slots and fix their CRCs.
    let newer = dir.path().join("newer");
    std::fs::copy(&path, &newer).unwrap();
    let mut bytes = std::fs::read(&newer).unwrap();
    for slot in 0..2 {
        let at = slot * 16384;
        bytes[at + 8..at + 12].copy_from_slice(&99u32.to_le_bytes());
        let crc = crc32c::crc32c(&bytes[at..at + 16380]);
        bytes[at + 16380..at + 16384].copy_from_slice(&crc.to_le_bytes());
    }
    std::fs::write(&newer, &bytes).unwrap();
    assert_eq!(Store::open(&newer, &OpenOptions::default()).err().unwrap().kind(), ErrorKind::NewerVersion);
    assert_eq!(std::fs::read(&newer).unwrap(), bytes);
    // Truncated.
    let truncated = dir.path().join("truncated");
    std::fs::copy(&path, &truncated).unwrap();
    std::fs::OpenOptions::new().write(true).open(&truncated).unwrap().set_len(8 << 20).unwrap();
    assert_eq!(Store::open(&truncated, &OpenOptions::default()).err().unwrap().kind(), ErrorKind::Truncated);
}

#[test]
fn every_codec_round_trips_text_binary_zero_and_random_data() {
    let text = std::fs::read("/usr/share/common-licenses/GPL-3").unwrap_or_else(|_| pattern(64 << 10, 1));
    let binary = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    let mut random = vec![0u8; 64 << 10];
    let mut x = 0x1234_5678_9abc_def0u64;
    for b in random.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let zero = vec![0u8; 64 << 10];
    for codec in [
        Codec::Lz4,
        Codec::Zstd { level: 1 },
        Codec::Zstd { level: 19 },
        Codec::Deflate { level: 1 },
        Codec::Deflate { level: 12 },
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = format(&dir, 32 << 20, 32 << 20, codec);
        let store = Store::open(&path, &OpenOptions::default()).unwrap();
        let mut offset = 0u64;
        let mut written = Vec::new();
        for data in [&text[..text.len().min(1 << 20)], &binary[..binary.len().min(1 << 20)], &zero[..], &random[..]] {
            store.write(offset, data, Durability::Buffered).unwrap();
            written.push((offset, data.to_vec()));
            offset += (data.len() as u64).div_ceil(4096) * 4096;
        }
        store.close().unwrap();
        let store = Store::open(&path, &OpenOptions::default()).unwrap();
        for (offset, data) in written {
            let mut back = vec![0; data.len()];
            store.read(offset, &mut back).unwrap();
            assert!(back == data, "codec {codec}");
        }
        assert!(store.check(&mut |_, _| {}).unwrap().problems.is_empty());
    }
}

#[test]
fn codec_names_parse_and_bad_ones_are_refused() {
    assert_eq!("lz4".parse::<Codec>().unwrap(), Codec::Lz4);
    assert_eq!("zstd:7".parse::<Codec>().unwrap(), Codec::Zstd { level: 7 });
    assert_eq!("deflate".parse::<Codec>().unwrap(), Codec::Deflate { level: 6 });
    for bad in ["gzip", "zstd:0", "zstd:x", "deflate:13", "lz4:1", ""] {
        assert!(bad.parse::<Codec>().is_err(), "{bad}");
    }
}

#[test]
fn resize_grows_and_refuses_a_shrink_that_would_drop_data() {
    let dir = tempfile::tempdir().unwrap();
    let path = format(&dir, 16 << 20, 160 << 20, Codec::Lz4);
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    store.write((160 << 20) - 4096, &pattern(4096, 5), Durability::Buffered).unwrap();
    assert_eq!(store.resize(80 << 20).unwrap_err().kind(), ErrorKind::InvalidArgument);
    store.resize(320 << 20).unwrap();
    store.write((320 << 20) - 4096, &pattern(4096, 6), Durability::Buffered).unwrap();
    store.close().unwrap();
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    assert_eq!(store.logical_size_bytes(), 320 << 20);
    store.trim((160 << 20) - 4096, (160 << 20) + 4096, Durability::Buffered).unwrap();
    store.resize(80 << 20).unwrap();
    assert_eq!(store.logical_size_bytes(), 80 << 20);
}

/// Sets the format version of both superblock slots (fixing their CRCs); returns it as read.
fn set_format_version(path: &std::path::Path, version: u32) {
    let mut bytes = std::fs::read(path).unwrap();
    for slot in 0..2 {
        let at = slot * 16384;
        bytes[at + 8..at + 12].copy_from_slice(&version.to_le_bytes());
        let crc = crc32c::crc32c(&bytes[at..at + 16380]);
        bytes[at + 16380..at + 16384].copy_from_slice(&crc.to_le_bytes());
    }
    std::fs::write(path, &bytes).unwrap();
}

fn slot_versions(path: &std::path::Path) -> [u32; 2] {
    let bytes = std::fs::read(path).unwrap();
    [0, 1].map(|slot| u32::from_le_bytes(bytes[slot * 16384 + 8..slot * 16384 + 12].try_into().unwrap()))
}

#[test]
fn a_version_1_store_is_read_and_upgraded_when_opened_for_writing() {
    let dir = tempfile::tempdir().unwrap();
    let path = format(&dir, 16 << 20, 32 << 20, Codec::Lz4);
    // Version 1 stores hold write records only: write whole 64 KiB requests (no batches).
    {
        let store = Store::open(&path, &OpenOptions::default()).unwrap();
        store.write(0, &pattern(64 << 10, 3), Durability::Fua).unwrap();
        store.close().unwrap();
    }
    set_format_version(&path, 1);
    {
        let reader = Store::open(&path, &OpenOptions { read_only: true, ..OpenOptions::default() }).unwrap();
        let mut back = vec![0u8; 64 << 10];
        reader.read(0, &mut back).unwrap();
        assert_eq!(back, pattern(64 << 10, 3));
    }
    assert_eq!(slot_versions(&path), [1, 1], "a read-only open changes nothing");
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    assert_eq!(slot_versions(&path), [4, 4], "both slots are upgraded before anything is written");
    store.write(1 << 20, &pattern(4096, 5), Durability::Buffered).unwrap();
    store.close().unwrap();
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    let mut back = vec![0u8; 64 << 10];
    store.read(0, &mut back).unwrap();
    assert_eq!(back, pattern(64 << 10, 3));
    let mut small = vec![0u8; 4096];
    store.read(1 << 20, &mut small).unwrap();
    assert_eq!(small, pattern(4096, 5));
}

/// `host_backing_reads` counts backing reads after coalescing: blocks written together are
/// read in one, blocks written apart in one each, and zero or unwritten blocks in none.
#[test]
fn host_backing_reads_count_coalesced_reads() {
    let dir = tempfile::tempdir().unwrap();
    let path = format(&dir, 64 << 20, 64 << 20, Codec::Lz4);
    {
        let store = Store::open(&path, &OpenOptions::default()).unwrap();
        store.write(0, &pattern(16 << 10, 3), Durability::Buffered).unwrap();
        // Two blocks far apart in the log: a megabyte written between them.
        store.write(1 << 20, &pattern(4096, 5), Durability::Buffered).unwrap();
        store.write(4 << 20, &pattern(1 << 20, 6), Durability::Buffered).unwrap();
        store.write((1 << 20) + 4096, &pattern(4096, 9), Durability::Buffered).unwrap();
        store.close().unwrap();
    }
    // Reopened, nothing is in a segment buffer: every read goes to the backing.
    let store = Store::open(&path, &OpenOptions::default()).unwrap();
    let reads = |store: &Store| {
        let stats = store.stats();
        (stats.host_backing_reads, stats.host_backing_read_bytes)
    };
    let mut page = vec![0u8; 16 << 10];
    store.read(0, &mut page).unwrap();
    assert_eq!(page, pattern(16 << 10, 3));
    let (one, bytes) = reads(&store);
    assert_eq!(one, 1, "four blocks written together are one read");
    assert!(bytes > 0 && bytes < 16 << 10, "{bytes} bytes for four compressible blocks");
    let mut two = vec![0u8; 8192];
    store.read(1 << 20, &mut two).unwrap();
    assert_eq!(reads(&store).0, 3, "two blocks written apart are two reads");
    store.read(32 << 20, &mut two).unwrap();
    assert_eq!(reads(&store).0, 3, "unwritten blocks need no read");
}
