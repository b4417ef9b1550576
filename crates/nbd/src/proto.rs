//! The NBD transmission phase as pure functions over bytes: request parsing, the checks a
//! server makes before acting on a request, and reply encoders.
//!
//! Invariants:
//! - Every integer on the wire is big-endian; the encoders append complete messages (header and
//!   any fixed fields) to a caller's buffer and never write partial ones.
//! - [`parse_request`] fails only on what makes the byte stream unparseable (a bad magic); all
//!   other faults are NBD error numbers from [`validate`], answered on a connection that stays up.
//! - [`validate`] accepts no request that reaches past the export's size, and [`payload_bytes`]
//!   says how many bytes follow every header, valid or not, so the stream stays in step.
//!
//! Names follow the spec's (`doc/proto.md`) without its `NBD_` prefix so they can be grepped.

use thiserror::Error;

/// `NBDMAGIC`, the server's first 8 bytes.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the newstyle greeting's second magic, and the magic of every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every option reply in fixed newstyle negotiation.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

pub const REQUEST_HEADER_BYTES: usize = 28;
pub const SIMPLE_REPLY_HEADER_BYTES: usize = 16;
pub const STRUCTURED_REPLY_HEADER_BYTES: usize = 20;

/// The payload size every server should accept and no client may call a denial of service
/// (spec, "Size constraints"): the default advertised maximum, and the most write payload a
/// server consumes (and discards) for a request it rejects.
pub const DEFAULT_MAX_PAYLOAD_BYTES: u32 = 1 << 25;
/// The longest error message the spec allows in a reply.
pub const MAX_STRING_BYTES: usize = 4096;

// Transmission flags (16 bits, sent at the end of the handshake).
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_SEND_DF: u16 = 1 << 7;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const FLAG_SEND_CACHE: u16 = 1 << 10;
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;
/// The transmission flags this crate implements; the experimental RESIZE (bit 9) and
/// EXTENDED_HEADERS (bit 12) flags are not among them.
pub const KNOWN_TRANSMISSION_FLAGS: u16 = FLAG_HAS_FLAGS
    | FLAG_READ_ONLY
    | FLAG_SEND_FLUSH
    | FLAG_SEND_FUA
    | FLAG_ROTATIONAL
    | FLAG_SEND_TRIM
    | FLAG_SEND_WRITE_ZEROES
    | FLAG_SEND_DF
    | FLAG_CAN_MULTI_CONN
    | FLAG_SEND_CACHE
    | FLAG_SEND_FAST_ZERO;

// Command flags (16 bits of each request).
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Error values of replies. Spec values, not the host's errno.
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

// Structured reply chunk types and flags.
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;
pub const REPLY_FLAG_DONE: u16 = 1 << 0;

// `base:allocation` extent flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// A request's type. `Unknown` keeps the wire value so the server can log it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read,
    Write,
    Disconnect,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    Unknown(u16),
}

impl Command {
    pub fn from_wire(value: u16) -> Self {
        match value {
            0 => Command::Read,
            1 => Command::Write,
            2 => Command::Disconnect,
            3 => Command::Flush,
            4 => Command::Trim,
            5 => Command::Cache,
            6 => Command::WriteZeroes,
            7 => Command::BlockStatus,
            other => Command::Unknown(other),
        }
    }

    pub fn to_wire(self) -> u16 {
        match self {
            Command::Read => 0,
            Command::Write => 1,
            Command::Disconnect => 2,
            Command::Flush => 3,
            Command::Trim => 4,
            Command::Cache => 5,
            Command::WriteZeroes => 6,
            Command::BlockStatus => 7,
            Command::Unknown(value) => value,
        }
    }
}

/// One request header. `cookie` is opaque: every reply echoes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: Command,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

/// What a connection's requests are checked against: the export as advertised and what the
/// handshake negotiated (`handshake::Negotiated::limits` builds one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub size_bytes: u64,
    /// The transmission flags sent to the client: they say which commands and command flags
    /// it may use, and whether the export is read-only.
    pub transmission_flags: u16,
    /// Offsets and lengths of data commands must be multiples of this (a power of two; 1 means
    /// no constraint).
    pub min_block_bytes: u32,
    /// Longest read or write accepted (the advertised maximum payload).
    pub max_payload_bytes: u32,
    pub structured_replies: bool,
    /// The `base:allocation` context id, if the client selected it; block status needs it.
    pub block_status_context: Option<u32>,
}

impl Limits {
    pub fn read_only(&self) -> bool {
        self.transmission_flags & FLAG_READ_ONLY != 0
    }

    fn advertises(&self, flag: u16) -> bool {
        self.transmission_flags & flag != 0
    }
}

/// Faults that leave the byte stream unparseable or unsafe to follow: the connection must be
/// closed (no reply can be sent).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProtocolError {
    #[error("request magic {magic:#010x} is not NBD's {REQUEST_MAGIC:#010x}")]
    BadRequestMagic { magic: u32 },
    #[error(
        "write of {length_bytes} bytes is over the {cap_bytes}-byte payload cap: \
         its data cannot be consumed safely"
    )]
    WritePayloadTooLarge { length_bytes: u32, cap_bytes: u32 },
}

/// Parses a request header. Only a bad magic is an error here: any other fault is reported by
/// [`validate`] as an NBD error number.
pub fn parse_request(header: &[u8; REQUEST_HEADER_BYTES]) -> Result<Request, ProtocolError> {
    let magic = u32::from_be_bytes(fixed(&header[0..4]));
    if magic != REQUEST_MAGIC {
        return Err(ProtocolError::BadRequestMagic { magic });
    }
    Ok(Request {
        flags: u16::from_be_bytes(fixed(&header[4..6])),
        command: Command::from_wire(u16::from_be_bytes(fixed(&header[6..8]))),
        cookie: u64::from_be_bytes(fixed(&header[8..16])),
        offset: u64::from_be_bytes(fixed(&header[16..24])),
        length: u32::from_be_bytes(fixed(&header[24..28])),
    })
}

fn fixed<const N: usize>(bytes: &[u8]) -> [u8; N] {
    bytes.try_into().expect("caller slices exactly N bytes")
}

/// How many payload bytes follow this header on the wire, whether or not the request is valid:
/// the server must read (and, for a rejected request, discard) them before the next header.
///
/// Only writes carry a payload. A write's payload is consumed up to the larger of the
/// advertised maximum and [`DEFAULT_MAX_PAYLOAD_BYTES`] (the spec asks servers not to treat
/// payloads up to 32 MiB as an attack); a longer one is a [`ProtocolError`] and the connection
/// must be closed, since reading it would let a client make the server swallow up to 4 GiB.
pub fn payload_bytes(request: &Request, limits: &Limits) -> Result<usize, ProtocolError> {
    if request.command != Command::Write {
        return Ok(0);
    }
    let cap_bytes = limits.max_payload_bytes.max(DEFAULT_MAX_PAYLOAD_BYTES);
    if request.length > cap_bytes {
        return Err(ProtocolError::WritePayloadTooLarge { length_bytes: request.length, cap_bytes });
    }
    Ok(request.length as usize)
}

/// The whole request at the front of `received`: its header and the length of the payload
/// that follows it; None while part of either has yet to arrive. An error closes the
/// connection (see [`parse_request`], [`payload_bytes`]).
pub fn next_request(received: &[u8], limits: &Limits) -> Result<Option<(Request, usize)>, ProtocolError> {
    let Some(header) = received.first_chunk::<REQUEST_HEADER_BYTES>() else { return Ok(None) };
    let request = parse_request(header)?;
    let payload_bytes = payload_bytes(&request, limits)?;
    Ok((received.len() >= REQUEST_HEADER_BYTES + payload_bytes).then_some((request, payload_bytes)))
}

/// Checks a request before the server acts on it; `Err` is the NBD error to reply with (the
/// connection stays up, and a write's payload must still be consumed, see [`payload_bytes`]).
///
/// Follows the spec's SHOULDs: unknown commands, unknown or inapplicable command flags,
/// commands or flags the server did not advertise, and zero-length or misaligned ranges get
/// `EINVAL`; writes, trims and zero writes on a read-only export get `EPERM`; a range past the
/// end gets `ENOSPC` for writes and zero writes and `EINVAL` otherwise. `Cache` is accepted
/// whether or not advertised (clients send it regardless); `Disconnect` gets no reply, so its
/// result only says whether the client obeyed the spec (zero offset and length).
pub fn validate(request: &Request, limits: &Limits) -> Result<(), u32> {
    // FUA is valid on every command once advertised (clients set it on reads too).
    let fua = if limits.advertises(FLAG_SEND_FUA) { CMD_FLAG_FUA } else { 0 };
    let (allowed_flags, advertised) = match request.command {
        Command::Unknown(_) => return Err(EINVAL),
        Command::Read => {
            let df = if limits.structured_replies && limits.advertises(FLAG_SEND_DF) { CMD_FLAG_DF } else { 0 };
            (fua | df, true)
        }
        Command::Write => (fua, true),
        Command::Disconnect => (0, true),
        Command::Flush => (fua, limits.advertises(FLAG_SEND_FLUSH)),
        Command::Trim => (fua, limits.advertises(FLAG_SEND_TRIM)),
        Command::Cache => (fua, true),
        Command::WriteZeroes => {
            let fast_zero = if limits.advertises(FLAG_SEND_FAST_ZERO) { CMD_FLAG_FAST_ZERO } else { 0 };
            (fua | CMD_FLAG_NO_HOLE | fast_zero, limits.advertises(FLAG_SEND_WRITE_ZEROES))
        }
        Command::BlockStatus => (fua | CMD_FLAG_REQ_ONE, limits.block_status_context.is_some()),
    };
    if !advertised || request.flags & !allowed_flags != 0 {
        return Err(EINVAL);
    }
    let writes = matches!(request.command, Command::Write | Command::Trim | Command::WriteZeroes);
    if writes && limits.read_only() {
        return Err(EPERM);
    }
    if matches!(request.command, Command::Disconnect | Command::Flush) {
        // The spec reserves offset and length of these and requires zeroes.
        return if request.offset == 0 && request.length == 0 { Ok(()) } else { Err(EINVAL) };
    }
    // Every remaining command names a range; the spec leaves zero lengths unspecified and a
    // zero-length range has no meaningful answer, so refuse them.
    if request.length == 0 {
        return Err(EINVAL);
    }
    if matches!(request.command, Command::Read | Command::Write) && request.length > limits.max_payload_bytes {
        return Err(EINVAL);
    }
    // Block status lengths are hints, so only data commands must be aligned.
    let min_block_bytes = u64::from(limits.min_block_bytes.max(1));
    if request.command != Command::BlockStatus
        && !(request.offset.is_multiple_of(min_block_bytes)
            && u64::from(request.length).is_multiple_of(min_block_bytes))
    {
        return Err(EINVAL);
    }
    let in_range = request.offset.checked_add(u64::from(request.length)).is_some_and(|end| end <= limits.size_bytes);
    if !in_range {
        let writes_data = matches!(request.command, Command::Write | Command::WriteZeroes);
        return Err(if writes_data { ENOSPC } else { EINVAL });
    }
    Ok(())
}

/// Appends a simple reply header. For a successful read, the `length` bytes of data follow it.
pub fn simple_reply(out: &mut Vec<u8>, cookie: u64, error: u32) {
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
}

fn chunk_header(out: &mut Vec<u8>, cookie: u64, reply_type: u16, done: bool, payload_bytes: u32) {
    out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&(if done { REPLY_FLAG_DONE } else { 0 }).to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&payload_bytes.to_be_bytes());
}

/// Appends an `OFFSET_DATA` chunk up to and including its offset; the caller sends the
/// `data_bytes` bytes of data next. `data_bytes` must be 1..=2^32-9 (the chunk's length field
/// counts the offset too); the server's maximum payload keeps it far below that.
pub fn structured_read_header(out: &mut Vec<u8>, cookie: u64, offset: u64, data_bytes: u32, done: bool) {
    debug_assert!(data_bytes > 0, "an OFFSET_DATA chunk describes at least one byte");
    let payload_bytes = data_bytes.checked_add(8).expect("OFFSET_DATA chunk of under 4 GiB");
    chunk_header(out, cookie, REPLY_TYPE_OFFSET_DATA, done, payload_bytes);
    out.extend_from_slice(&offset.to_be_bytes());
}

/// Appends an `OFFSET_HOLE` chunk: `hole_bytes` (nonzero) bytes at `offset` read as zeroes.
pub fn structured_hole(out: &mut Vec<u8>, cookie: u64, offset: u64, hole_bytes: u32, done: bool) {
    debug_assert!(hole_bytes > 0, "the spec requires a nonzero hole size");
    chunk_header(out, cookie, REPLY_TYPE_OFFSET_HOLE, done, 12);
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&hole_bytes.to_be_bytes());
}

/// Appends an `ERROR` chunk with a message for humans (cut to the spec's 4096 bytes).
pub fn structured_error(out: &mut Vec<u8>, cookie: u64, error: u32, message: &str, done: bool) {
    let message = clamp_str(message, MAX_STRING_BYTES);
    chunk_header(out, cookie, REPLY_TYPE_ERROR, done, 6 + message.len() as u32);
    error_fields(out, error, message);
}

/// Appends an `ERROR_OFFSET` chunk: the error happened at `offset`, inside the request's range,
/// so the client may trust data chunks before it.
pub fn structured_error_offset(out: &mut Vec<u8>, cookie: u64, error: u32, message: &str, offset: u64, done: bool) {
    let message = clamp_str(message, MAX_STRING_BYTES);
    chunk_header(out, cookie, REPLY_TYPE_ERROR_OFFSET, done, 14 + message.len() as u32);
    error_fields(out, error, message);
    out.extend_from_slice(&offset.to_be_bytes());
}

fn error_fields(out: &mut Vec<u8>, error: u32, message: &str) {
    debug_assert!(error != 0, "an error chunk's error must be nonzero");
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message.as_bytes());
}

/// Appends the `NONE` chunk that ends a structured reply (it always carries `DONE`).
pub fn structured_done(out: &mut Vec<u8>, cookie: u64) {
    chunk_header(out, cookie, REPLY_TYPE_NONE, true, 0);
}

/// Appends a `BLOCK_STATUS` chunk: consecutive extents from the request's offset, each
/// `(length_bytes, flags)` with a nonzero length. The spec asks for at most 2^20 extents.
pub fn structured_block_status(out: &mut Vec<u8>, cookie: u64, context_id: u32, extents: &[(u32, u32)], done: bool) {
    debug_assert!(!extents.is_empty(), "a block status chunk carries at least one extent");
    let payload_bytes = u32::try_from(4 + 8 * extents.len()).expect("block status chunk of under 4 GiB");
    chunk_header(out, cookie, REPLY_TYPE_BLOCK_STATUS, done, payload_bytes);
    out.extend_from_slice(&context_id.to_be_bytes());
    for &(length_bytes, flags) in extents {
        out.extend_from_slice(&length_bytes.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
    }
}

/// Appends the complete error reply for a request: a final `ERROR` chunk when structured
/// replies were negotiated (the spec forbids simple replies to reads then, and a message helps
/// the user), else a simple reply, which cannot carry the message.
pub fn error_reply(out: &mut Vec<u8>, limits: &Limits, cookie: u64, error: u32, message: &str) {
    if limits.structured_replies {
        structured_error(out, cookie, error, message, true);
    } else {
        simple_reply(out, cookie, error);
    }
}

/// The longest prefix of `text` of at most `max_bytes` bytes that ends on a character boundary.
pub(crate) fn clamp_str(text: &str, max_bytes: usize) -> &str {
    if text.len() <= max_bytes {
        return text;
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    const COOKIE: u64 = 0x0102_0304_0506_0708;

    fn limits() -> Limits {
        Limits {
            size_bytes: 1 << 20,
            transmission_flags: FLAG_HAS_FLAGS
                | FLAG_SEND_FLUSH
                | FLAG_SEND_FUA
                | FLAG_SEND_TRIM
                | FLAG_SEND_WRITE_ZEROES
                | FLAG_SEND_DF
                | FLAG_SEND_FAST_ZERO,
            min_block_bytes: 512,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            structured_replies: true,
            block_status_context: Some(1),
        }
    }

    fn request(command: Command, flags: u16, offset: u64, length: u32) -> Request {
        Request { flags, command, cookie: COOKIE, offset, length }
    }

    #[test]
    fn parses_a_request_header_field_by_field() {
        #[rustfmt::skip]
        let header = [
            0x25, 0x60, 0x95, 0x13, // magic
            0x00, 0x01,             // flags: FUA
            0x00, 0x01,             // type: write
            1, 2, 3, 4, 5, 6, 7, 8, // cookie
            0, 0, 0, 0, 0, 0, 0x10, 0x00, // offset 4096
            0, 0, 0x02, 0x00,       // length 512
        ];
        let parsed = parse_request(&header).unwrap();
        assert_eq!(parsed, request(Command::Write, CMD_FLAG_FUA, 4096, 512));
    }

    #[test]
    fn keeps_unknown_command_values_and_rejects_bad_magic() {
        let mut header = [0u8; REQUEST_HEADER_BYTES];
        header[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        header[6..8].copy_from_slice(&8u16.to_be_bytes());
        assert_eq!(parse_request(&header).unwrap().command, Command::Unknown(8));
        header[0] = 0x21;
        let error = parse_request(&header).unwrap_err();
        assert_eq!(error, ProtocolError::BadRequestMagic { magic: 0x2160_9513 });
        assert_eq!(error.to_string(), "request magic 0x21609513 is not NBD's 0x25609513");
    }

    #[test]
    fn command_wire_values_round_trip() {
        for value in 0..=20u16 {
            assert_eq!(Command::from_wire(value).to_wire(), value);
        }
    }

    #[test]
    fn validate_accepts_well_formed_requests() {
        let limits = limits();
        for accepted in [
            request(Command::Read, CMD_FLAG_FUA | CMD_FLAG_DF, 0, 4096),
            request(Command::Write, CMD_FLAG_FUA, (1 << 20) - 512, 512),
            request(Command::Flush, 0, 0, 0),
            request(Command::Trim, 0, 512, 1024),
            request(Command::Cache, 0, 0, 512),
            request(Command::WriteZeroes, CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO, 0, 1 << 20),
            request(Command::BlockStatus, CMD_FLAG_REQ_ONE, 100, 7),
            request(Command::Disconnect, 0, 0, 0),
        ] {
            assert_eq!(validate(&accepted, &limits), Ok(()), "{accepted:?}");
        }
    }

    #[test]
    fn validate_refuses_with_the_spec_errors() {
        let limits = limits();
        let read_only = Limits { transmission_flags: limits.transmission_flags | FLAG_READ_ONLY, ..limits };
        let plain = Limits { transmission_flags: FLAG_HAS_FLAGS, structured_replies: false, ..limits };
        let no_context = Limits { block_status_context: None, ..limits };
        let size = limits.size_bytes;
        for (refused, limits, error) in [
            (request(Command::Unknown(9), 0, 0, 512), limits, EINVAL),
            (request(Command::Read, 1 << 5, 0, 512), limits, EINVAL),
            (request(Command::Read, CMD_FLAG_NO_HOLE, 0, 512), limits, EINVAL),
            (request(Command::Write, CMD_FLAG_FAST_ZERO, 0, 512), limits, EINVAL),
            (request(Command::Read, CMD_FLAG_DF, 0, 512), plain, EINVAL),
            (request(Command::Write, CMD_FLAG_FUA, 0, 512), plain, EINVAL),
            (request(Command::Trim, 0, 0, 512), plain, EINVAL),
            (request(Command::Flush, 0, 0, 0), plain, EINVAL),
            (request(Command::WriteZeroes, 0, 0, 512), plain, EINVAL),
            (request(Command::Flush, 0, 512, 0), limits, EINVAL),
            (request(Command::Disconnect, 0, 0, 1), limits, EINVAL),
            (request(Command::BlockStatus, 0, 0, 512), no_context, EINVAL),
            (request(Command::BlockStatus, CMD_FLAG_DF, 0, 512), limits, EINVAL),
            (request(Command::Write, 0, 0, 512), read_only, EPERM),
            (request(Command::Trim, 0, 0, 512), read_only, EPERM),
            (request(Command::WriteZeroes, 0, 0, 512), read_only, EPERM),
            (request(Command::Read, 0, 0, 0), limits, EINVAL),
            (request(Command::Trim, 0, 0, 0), limits, EINVAL),
            (request(Command::Read, 0, 0, DEFAULT_MAX_PAYLOAD_BYTES + 512), limits, EINVAL),
            (request(Command::Read, 0, 1, 512), limits, EINVAL),
            (request(Command::Write, 0, 0, 513), limits, EINVAL),
            (request(Command::Read, 0, size, 512), limits, EINVAL),
            (request(Command::Trim, 0, size - 512, 1024), limits, EINVAL),
            (request(Command::BlockStatus, 0, size, 1), limits, EINVAL),
            (request(Command::Write, 0, size, 512), limits, ENOSPC),
            (request(Command::WriteZeroes, 0, u64::MAX - 511, 512), limits, ENOSPC),
        ] {
            assert_eq!(validate(&refused, &limits), Err(error), "{refused:?}");
        }
    }

    #[test]
    fn payload_is_the_write_length_up_to_the_cap() {
        let limits = limits();
        assert_eq!(payload_bytes(&request(Command::Read, 0, 0, 4096), &limits), Ok(0));
        // Invalid (misaligned, out of range) writes still carry their payload.
        assert_eq!(payload_bytes(&request(Command::Write, 0, u64::MAX, 1000), &limits), Ok(1000));
        let small = Limits { max_payload_bytes: 4096, ..limits };
        assert_eq!(payload_bytes(&request(Command::Write, 0, 0, 1 << 25), &small), Ok(1 << 25));
        let error = payload_bytes(&request(Command::Write, 0, 0, (1 << 25) + 1), &small).unwrap_err();
        assert_eq!(error, ProtocolError::WritePayloadTooLarge { length_bytes: (1 << 25) + 1, cap_bytes: 1 << 25 });
    }

    #[test]
    fn next_request_waits_for_the_whole_header_and_payload() {
        let limits = limits();
        let mut wire = vec![0u8; REQUEST_HEADER_BYTES];
        wire[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        wire[6..8].copy_from_slice(&Command::Write.to_wire().to_be_bytes());
        wire[24..28].copy_from_slice(&100u32.to_be_bytes());
        assert_eq!(next_request(&wire[..27], &limits), Ok(None), "a partial header");
        assert_eq!(next_request(&wire, &limits), Ok(None), "the payload has not arrived");
        wire.extend_from_slice(&[7; 100]);
        let (request, payload) = next_request(&wire, &limits).unwrap().unwrap();
        assert_eq!((request.command, payload), (Command::Write, 100));
        wire[0] = 0;
        assert!(next_request(&wire, &limits).is_err(), "a bad magic closes the connection");
    }

    #[test]
    fn simple_reply_bytes() {
        let mut out = Vec::new();
        simple_reply(&mut out, COOKIE, EIO);
        assert_eq!(out, [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 5, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(out.len(), SIMPLE_REPLY_HEADER_BYTES);
    }

    #[test]
    fn structured_read_header_bytes() {
        let mut out = Vec::new();
        structured_read_header(&mut out, COOKIE, 0x1000, 512, true);
        #[rustfmt::skip]
        let expected = [
            0x66, 0x8e, 0x33, 0xef, // magic
            0x00, 0x01,             // flags: DONE
            0x00, 0x01,             // type: OFFSET_DATA
            1, 2, 3, 4, 5, 6, 7, 8, // cookie
            0x00, 0x00, 0x02, 0x08, // length: 8 + 512
            0, 0, 0, 0, 0, 0, 0x10, 0x00, // offset
        ];
        assert_eq!(out, expected);
    }

    #[test]
    fn structured_hole_bytes() {
        let mut out = Vec::new();
        structured_hole(&mut out, COOKIE, 0x2000, 0x0300, false);
        #[rustfmt::skip]
        let expected = [
            0x66, 0x8e, 0x33, 0xef, 0x00, 0x00, 0x00, 0x02, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 12,
            0, 0, 0, 0, 0, 0, 0x20, 0x00, // offset
            0x00, 0x00, 0x03, 0x00,       // hole size
        ];
        assert_eq!(out, expected);
    }

    #[test]
    fn structured_error_bytes() {
        let mut out = Vec::new();
        structured_error(&mut out, COOKIE, EINVAL, "bad", true);
        #[rustfmt::skip]
        let expected = [
            0x66, 0x8e, 0x33, 0xef, 0x00, 0x01, 0x80, 0x01, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 9,
            0, 0, 0, 22, // error
            0, 3,        // message length
            b'b', b'a', b'd',
        ];
        assert_eq!(out, expected);

        out.clear();
        structured_error_offset(&mut out, COOKIE, EIO, "", 0x200, false);
        #[rustfmt::skip]
        let expected = [
            0x66, 0x8e, 0x33, 0xef, 0x00, 0x00, 0x80, 0x02, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 14,
            0, 0, 0, 5, 0, 0,
            0, 0, 0, 0, 0, 0, 0x02, 0x00,
        ];
        assert_eq!(out, expected);
    }

    #[test]
    fn structured_error_message_is_cut_to_the_spec_limit_on_a_char_boundary() {
        let mut out = Vec::new();
        let message = "é".repeat(3000); // 6000 bytes
        structured_error(&mut out, COOKIE, EIO, &message, true);
        assert_eq!(&out[16..20], &(6u32 + 4096).to_be_bytes());
        assert_eq!(&out[24..26], &4096u16.to_be_bytes());
        assert_eq!(out.len(), STRUCTURED_REPLY_HEADER_BYTES + 6 + 4096);
        assert_eq!(clamp_str("aé", 2), "a");
    }

    #[test]
    fn structured_done_bytes() {
        let mut out = Vec::new();
        structured_done(&mut out, COOKIE);
        assert_eq!(out, [0x66, 0x8e, 0x33, 0xef, 0, 1, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0]);
    }

    #[test]
    fn structured_block_status_bytes() {
        let mut out = Vec::new();
        structured_block_status(&mut out, COOKIE, 1, &[(0x1000, 0), (0x2000, STATE_HOLE | STATE_ZERO)], true);
        #[rustfmt::skip]
        let expected = [
            0x66, 0x8e, 0x33, 0xef, 0x00, 0x01, 0x00, 0x05, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 20,
            0, 0, 0, 1,                         // context id
            0, 0, 0x10, 0x00, 0, 0, 0, 0,       // 4 KiB allocated
            0, 0, 0x20, 0x00, 0, 0, 0, 3,       // 8 KiB hole, reads as zeroes
        ];
        assert_eq!(out, expected);
    }

    #[test]
    fn error_reply_follows_the_negotiated_reply_style() {
        let mut out = Vec::new();
        error_reply(&mut out, &Limits { structured_replies: false, ..limits() }, COOKIE, EPERM, "read-only");
        assert_eq!(out.len(), SIMPLE_REPLY_HEADER_BYTES);
        out.clear();
        error_reply(&mut out, &limits(), COOKIE, EPERM, "read-only");
        assert_eq!(&out[6..8], &REPLY_TYPE_ERROR.to_be_bytes());
        assert_eq!(&out[4..6], &REPLY_FLAG_DONE.to_be_bytes());
    }
}
