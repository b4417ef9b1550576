//! Properties over arbitrary client input, what CI runs in place of the cargo-fuzz targets in
//! `fuzz/`: `negotiate` always returns (never panics, never loops) and only ever writes
//! well-formed replies; `parse_request` and `validate` never panic, and `validate` never
//! accepts a request reaching past the export.

use std::io::{self, Cursor, Read, Write};

use proptest::prelude::*;
use proptest::sample::Index;
use zdisk_nbd::handshake::*;
use zdisk_nbd::proto::*;

/// Client bytes in, server bytes out; end of input is the client closing.
struct MemoryStream {
    input: Cursor<Vec<u8>>,
    output: Vec<u8>,
}

impl Read for MemoryStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for MemoryStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.output.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn export() -> Export {
    Export {
        name: "disk".into(),
        description: "a zdisk store".into(),
        size_bytes: 1 << 30,
        transmission_flags: FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_WRITE_ZEROES | FLAG_SEND_DF,
        min_block_bytes: 512,
        preferred_block_bytes: 4096,
        max_block_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
    }
}

/// Runs the server on `client` and checks everything it wrote.
fn negotiate_checked(client: Vec<u8>) -> Result<Negotiated, HandshakeError> {
    let mut stream = MemoryStream { input: Cursor::new(client), output: Vec::new() };
    let result = negotiate(&mut stream, &export());
    assert_replies_well_formed(&stream.output, &result);
    result
}

/// The greeting, then option replies with valid magic and UTF-8 error messages, then, only if
/// the client entered transmission by `NBD_OPT_EXPORT_NAME`, its 10- or 134-byte reply.
fn assert_replies_well_formed(output: &[u8], result: &Result<Negotiated, HandshakeError>) {
    assert_eq!(&output[..16], b"NBDMAGICIHAVEOPT");
    let mut rest = &output[18..];
    while rest.starts_with(&OPTION_REPLY_MAGIC.to_be_bytes()) {
        assert!(rest.len() >= 20, "truncated reply header");
        let reply_type = u32::from_be_bytes(rest[12..16].try_into().unwrap());
        let length = u32::from_be_bytes(rest[16..20].try_into().unwrap()) as usize;
        let data = &rest[20..20 + length];
        if reply_type & (1 << 31) != 0 {
            assert!(std::str::from_utf8(data).is_ok() && length <= MAX_STRING_BYTES, "error message");
        }
        rest = &rest[20 + length..];
    }
    if !rest.is_empty() {
        assert!(result.is_ok(), "bytes after the replies without entering transmission");
        assert!(rest.len() == 10 || rest.len() == 134, "NBD_OPT_EXPORT_NAME reply of {} bytes", rest.len());
    }
}

fn option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut bytes = IHAVEOPT.to_be_bytes().to_vec();
    bytes.extend_from_slice(&option.to_be_bytes());
    bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
    bytes.extend_from_slice(data);
    bytes
}

fn string(text: &str) -> Vec<u8> {
    [&(text.len() as u32).to_be_bytes()[..], text.as_bytes()].concat()
}

/// A client that uses every option the server supports, ending with GO.
fn valid_transcript() -> Vec<u8> {
    let meta = |queries: &[&str]| {
        let mut data = string("disk");
        data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        queries.iter().for_each(|query| data.extend(string(query)));
        data
    };
    let info = [string(""), vec![0, 2, 0, 1, 0, 3]].concat();
    [
        (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes().to_vec(),
        option(OPT_LIST, b""),
        option(OPT_STRUCTURED_REPLY, b""),
        option(OPT_LIST_META_CONTEXT, &meta(&["base:"])),
        option(OPT_SET_META_CONTEXT, &meta(&["base:allocation"])),
        option(OPT_INFO, &info),
        option(OPT_GO, &info),
    ]
    .concat()
}

#[test]
fn the_valid_transcript_reaches_transmission() {
    let negotiated = negotiate_checked(valid_transcript()).unwrap();
    assert_eq!(negotiated.block_status_context, Some(BASE_ALLOCATION_CONTEXT_ID));
}

fn any_limits() -> impl Strategy<Value = Limits> {
    let size_bytes = prop_oneof![any::<u64>(), 0..(1u64 << 34)];
    let min_block_bytes = prop_oneof![2 => Just(1u32), 1 => Just(512), 1 => (0..17u32).prop_map(|log2| 1 << log2)];
    let max_payload_bytes = prop_oneof![1 => any::<u32>(), 2 => Just(DEFAULT_MAX_PAYLOAD_BYTES)];
    let negotiated = (any::<bool>(), any::<Option<u32>>());
    (size_bytes, any::<u16>(), min_block_bytes, max_payload_bytes, negotiated).prop_map(
        |(size_bytes, transmission_flags, min_block_bytes, max_payload_bytes, (structured_replies, context))| Limits {
            size_bytes,
            transmission_flags,
            min_block_bytes,
            max_payload_bytes,
            structured_replies,
            block_status_context: context.filter(|_| structured_replies),
        },
    )
}

fn any_request() -> impl Strategy<Value = Request> {
    // Besides arbitrary values, plausible ones (known flags, sector-aligned ranges) so that
    // accepted requests, the ones the property is about, are common.
    let flags = prop_oneof![1 => any::<u16>(), 1 => 0..32u16, 2 => Just(0)];
    let offset =
        prop_oneof![1 => any::<u64>(), 1 => 0..(1u64 << 34), 2 => (0..(1u64 << 25)).prop_map(|sector| sector * 512)];
    let length =
        prop_oneof![1 => any::<u32>(), 1 => 0..(1u32 << 16), 2 => (1..2048u32).prop_map(|sectors| sectors * 512)];
    (flags, 0..10u16, any::<u64>(), offset, length).prop_map(|(flags, command, cookie, offset, length)| Request {
        flags,
        command: Command::from_wire(command),
        cookie,
        offset,
        length,
    })
}

proptest! {
    // Thousands of cases take well under a second.
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn negotiate_survives_arbitrary_bytes(client in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = negotiate_checked(client);
    }

    #[test]
    fn negotiate_survives_arbitrary_options(
        client_flags in 0..4u32,
        options in prop::collection::vec((0..16u32, prop::collection::vec(any::<u8>(), 0..48)), 0..12),
    ) {
        let mut client = client_flags.to_be_bytes().to_vec();
        for (number, data) in &options {
            client.extend(option(*number, data));
        }
        let _ = negotiate_checked(client);
    }

    #[test]
    fn negotiate_survives_mutated_transcripts(
        overwrites in prop::collection::vec((any::<Index>(), any::<u8>()), 0..6),
        insertion in prop::option::of((any::<Index>(), prop::collection::vec(any::<u8>(), 1..8))),
        truncation in prop::option::of(any::<Index>()),
    ) {
        let mut client = valid_transcript();
        for (at, byte) in overwrites {
            let at = at.index(client.len());
            client[at] = byte;
        }
        if let Some((at, bytes)) = insertion {
            let at = at.index(client.len());
            client.splice(at..at, bytes);
        }
        if let Some(at) = truncation {
            client.truncate(at.index(client.len()));
        }
        let _ = negotiate_checked(client);
    }

    #[test]
    fn parse_request_reads_every_header(header in any::<[u8; REQUEST_HEADER_BYTES]>()) {
        let magic = u32::from_be_bytes(header[..4].try_into().unwrap());
        match parse_request(&header) {
            Ok(request) => {
                prop_assert_eq!(magic, REQUEST_MAGIC);
                prop_assert_eq!(request.command.to_wire(), u16::from_be_bytes([header[6], header[7]]));
                prop_assert_eq!(request.length, u32::from_be_bytes(header[24..].try_into().unwrap()));
            }
            Err(ProtocolError::BadRequestMagic { magic: reported }) => {
                prop_assert_ne!(magic, REQUEST_MAGIC);
                prop_assert_eq!(reported, magic);
            }
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }

    #[test]
    fn validate_accepts_only_requests_inside_the_export(request in any_request(), limits in any_limits()) {
        let verdict = validate(&request, &limits);
        let payload = payload_bytes(&request, &limits);
        if let Ok(payload) = payload {
            prop_assert!(payload <= limits.max_payload_bytes.max(DEFAULT_MAX_PAYLOAD_BYTES) as usize);
        }
        if verdict.is_ok() {
            let end = request.offset.checked_add(u64::from(request.length));
            prop_assert!(end.is_some_and(|end| end <= limits.size_bytes), "{request:?} {limits:?}");
            let writes = matches!(request.command, Command::Write | Command::Trim | Command::WriteZeroes);
            prop_assert!(!(writes && limits.read_only()));
            prop_assert!(!matches!(request.command, Command::Unknown(_)));
            if matches!(request.command, Command::Read | Command::Write) {
                prop_assert!(request.length <= limits.max_payload_bytes);
                prop_assert_eq!(payload, Ok(if request.command == Command::Write { request.length as usize } else { 0 }));
            }
        }
    }
}
