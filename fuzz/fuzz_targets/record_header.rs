#![no_main]
//! `cargo fuzz run record_header`: the record_header decoder must reject arbitrary bytes without panicking.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = zdisk_engine::fuzzing::decode_record_header(data);
});
