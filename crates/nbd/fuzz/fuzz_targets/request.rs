#![no_main]
//! `cargo fuzz run request`: a request header plus limits from the fuzz input; `parse_request`,
//! `validate` and `payload_bytes` must not panic, and an accepted request must lie inside the
//! export.

use zdisk_nbd::proto::{parse_request, payload_bytes, validate, Limits, REQUEST_HEADER_BYTES};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // 28 header bytes, then size (8), transmission flags (2), min block log2 (1),
    // max payload (4), structured replies (1), context (1).
    let Some((header, limits)) = data.split_first_chunk::<REQUEST_HEADER_BYTES>() else { return };
    let Some(limits) = limits.first_chunk::<17>() else { return };
    let structured_replies = limits[15] & 1 != 0;
    let limits = Limits {
        size_bytes: u64::from_be_bytes(limits[0..8].try_into().unwrap()),
        transmission_flags: u16::from_be_bytes([limits[8], limits[9]]),
        min_block_bytes: 1 << (limits[10] % 17),
        max_payload_bytes: u32::from_be_bytes(limits[11..15].try_into().unwrap()),
        structured_replies,
        block_status_context: (structured_replies && limits[16] & 1 != 0).then_some(1),
    };
    let Ok(request) = parse_request(header) else { return };
    let _ = payload_bytes(&request, &limits);
    if validate(&request, &limits).is_ok() {
        let end = request.offset.checked_add(u64::from(request.length));
        assert!(end.is_some_and(|end| end <= limits.size_bytes), "{request:?} accepted past {limits:?}");
    }
});
