#![no_main]
//! `cargo fuzz run superblock`: the superblock decoder must reject arbitrary bytes without panicking.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = zdisk_engine::fuzzing::decode_superblock(data);
});
