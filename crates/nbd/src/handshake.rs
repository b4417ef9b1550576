//! The NBD handshake, server side: fixed newstyle negotiation over a blocking stream, offering
//! one export, ending in the transmission phase or in an error that closes the connection.
//!
//! Invariants:
//! - The server offers exactly one export, reachable by its name or by the default name "".
//! - Every option gets exactly one final reply (ACK or an error with a UTF-8 message), except
//!   `NBD_OPT_EXPORT_NAME`, which cannot carry an error and so closes the connection instead.
//! - A client cannot hold the handshake forever or make the server buffer much: at most
//!   [`MAX_OPTIONS`] options, each buffered only up to [`MAX_OPTION_BYTES`] (longer ones up to
//!   [`MAX_DISCARDED_OPTION_BYTES`] are read, discarded and refused; longer still closes).
//! - The transmission flags sent are the export's with `HAS_FLAGS` set, unknown bits cleared,
//!   `SEND_DF` only with structured replies and `SEND_FAST_ZERO` only with `SEND_WRITE_ZEROES`,
//!   as the spec requires; [`Negotiated::transmission_flags`] reports what was sent.
//! - TLS follows the server's [`TlsPolicy`], one mode for the connection's whole life (the spec's
//!   NOTLS, SELECTIVETLS with no TLS-only export, FORCEDTLS): with `Off`, `NBD_OPT_STARTTLS` is
//!   refused with `ERR_POLICY` and nothing else differs from a server without TLS; otherwise it
//!   is acknowledged once ([`Ended::StartTls`]: the caller starts TLS and negotiation goes on
//!   over it, with the options negotiated before forgotten, as the spec requires) and refused
//!   with `ERR_INVALID` after. With `Required`, no option but `STARTTLS` and `ABORT` is served
//!   before TLS: each gets `ERR_TLS_REQD`, and `NBD_OPT_EXPORT_NAME`, which cannot carry an
//!   error, closes. `ERR_TLS_REQD` is never sent once TLS is up, nor under another policy.

use std::io::{self, Read, Write};

use thiserror::Error;

use crate::proto::{
    clamp_str, Limits, FLAG_HAS_FLAGS, FLAG_SEND_DF, FLAG_SEND_FAST_ZERO, FLAG_SEND_WRITE_ZEROES, IHAVEOPT,
    KNOWN_TRANSMISSION_FLAGS, MAX_STRING_BYTES, NBDMAGIC, OPTION_REPLY_MAGIC,
};

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Option types.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

// Option reply types; errors have bit 31 set.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

// Information types of `NBD_OPT_INFO` / `NBD_OPT_GO`.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// The one metadata context this server has.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Its id once selected; the spec leaves ids to the server, and nonzero stands out in traces.
pub const BASE_ALLOCATION_CONTEXT_ID: u32 = 1;

/// Options a client may send before it must enter transmission.
pub const MAX_OPTIONS: usize = 128;
/// Longest option data buffered and parsed. A legal option is far shorter: names and queries
/// are strings of at most 4096 bytes.
pub const MAX_OPTION_BYTES: u32 = 64 << 10;
/// Longest option data read and discarded to answer `ERR_TOO_BIG`; a longer option closes the
/// connection, since draining it would let a client keep the server reading for gigabytes.
pub const MAX_DISCARDED_OPTION_BYTES: u32 = 1 << 20;

/// The export offered: its name, what `NBD_OPT_LIST` and `NBD_INFO_DESCRIPTION` show, and what
/// `NBD_INFO_EXPORT` and `NBD_INFO_BLOCK_SIZE` advertise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Export {
    pub name: String,
    pub description: String,
    pub size_bytes: u64,
    pub transmission_flags: u16,
    pub min_block_bytes: u32,
    pub preferred_block_bytes: u32,
    /// The maximum payload of a read or write.
    pub max_block_bytes: u32,
}

/// What the handshake agreed on, for the transmission phase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub structured_replies: bool,
    /// Set when the client selected `base:allocation` (which requires structured replies).
    pub block_status_context: Option<u32>,
    /// The client asked for no zero padding; it only changes the `NBD_OPT_EXPORT_NAME` reply.
    pub no_zeroes: bool,
    /// The name the client asked for: the export's name or "".
    pub export_name: String,
    /// The transmission flags sent to the client.
    pub transmission_flags: u16,
}

impl Negotiated {
    /// The limits the transmission phase checks this connection's requests against.
    pub fn limits(&self, export: &Export) -> Limits {
        Limits {
            size_bytes: export.size_bytes,
            transmission_flags: self.transmission_flags,
            min_block_bytes: export.min_block_bytes,
            max_payload_bytes: export.max_block_bytes,
            structured_replies: self.structured_replies,
            block_status_context: self.block_status_context,
        }
    }
}

/// Why a handshake ended without reaching transmission; in every case the connection is closed.
#[derive(Debug, Error)]
pub enum HandshakeError {
    #[error("NBD handshake I/O failed: {0}")]
    Io(#[from] io::Error),
    #[error("the NBD client aborted the handshake (NBD_OPT_ABORT)")]
    Aborted,
    #[error("the NBD client closed the connection during the handshake")]
    ClientClosed,
    #[error("NBD handshake protocol violation: {0}")]
    Protocol(String),
}

/// Runs the server side of fixed newstyle negotiation on `stream` until the client enters
/// transmission (`NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`), aborts, closes, or breaks the protocol.
/// Reads nothing past the option that enters transmission. TLS is off (see [`Negotiation`]).
pub fn negotiate<S: Read + Write>(stream: &mut S, export: &Export) -> Result<Negotiated, HandshakeError> {
    let mut negotiation = Negotiation::start(stream, export, TlsPolicy::Off)?;
    match negotiation.options(stream)? {
        Ended::Transmission(negotiated) => Ok(negotiated),
        Ended::StartTls => unreachable!("with TLS off, NBD_OPT_STARTTLS is refused"),
    }
}

/// Whether the server offers TLS, and whether it insists (nbdkit's `--tls=off|on|require`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsPolicy {
    /// NOTLS: `NBD_OPT_STARTTLS` is refused with `ERR_POLICY`.
    Off,
    /// SELECTIVETLS, no export TLS-only: a client may start TLS or stay in plain text.
    Offered,
    /// FORCEDTLS: nothing is served before TLS.
    Required,
}

/// Where a stretch of option haggling stopped.
#[derive(Debug)]
pub enum Ended {
    /// The client entered transmission, on the stream the options came over.
    Transmission(Negotiated),
    /// `NBD_OPT_STARTTLS` was acknowledged: the caller must start TLS as the server on the same
    /// connection and call [`Negotiation::options`] again over the TLS stream (or close).
    StartTls,
}

/// A handshake in progress, for a server that may start TLS in the middle of it: the
/// stream changes under it (plain, then TLS), the option count and state carry over.
pub struct Negotiation<'a> {
    session: Session<'a>,
    /// Options the client may still send before it must enter transmission.
    options_left: usize,
}

impl<'a> Negotiation<'a> {
    /// Sends the greeting and checks the client's flags.
    pub fn start<S: Read + Write>(
        stream: &mut S,
        export: &'a Export,
        tls_policy: TlsPolicy,
    ) -> Result<Negotiation<'a>, HandshakeError> {
        let mut greeting = Vec::with_capacity(18);
        greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
        greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
        greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        stream.write_all(&greeting)?;
        stream.flush()?;

        let mut client_flags = [0u8; 4];
        read_message(stream, &mut client_flags)?;
        let client_flags = u32::from_be_bytes(client_flags);
        // The spec says to drop clients with unknown flags; one without fixed newstyle could not
        // parse our option replies (and could not start TLS: the spec's NOTLS mode is forced).
        if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
            return Err(HandshakeError::Protocol(format!("client flags {client_flags:#010x} set unknown bits")));
        }
        if client_flags & FLAG_C_FIXED_NEWSTYLE == 0 {
            return Err(HandshakeError::Protocol("client does not speak fixed newstyle negotiation".into()));
        }
        let session = Session {
            export,
            structured_replies: false,
            block_status_context: None,
            no_zeroes: client_flags & FLAG_C_NO_ZEROES != 0,
            tls_policy,
            tls_started: false,
        };
        Ok(Negotiation { session, options_left: MAX_OPTIONS })
    }

    /// Answers options on `stream` until the client enters transmission or TLS is to start.
    /// After [`Ended::StartTls`] the next call must be over the TLS stream.
    pub fn options<S: Read + Write>(&mut self, stream: &mut S) -> Result<Ended, HandshakeError> {
        let session = &mut self.session;
        while self.options_left > 0 {
            self.options_left -= 1;
            let mut header = [0u8; 16];
            read_message(stream, &mut header)?;
            let magic = u64::from_be_bytes(header[0..8].try_into().expect("8 bytes"));
            let option = u32::from_be_bytes(header[8..12].try_into().expect("4 bytes"));
            let data_bytes = u32::from_be_bytes(header[12..16].try_into().expect("4 bytes"));
            if magic != IHAVEOPT {
                return Err(HandshakeError::Protocol(format!("option magic {magic:#018x} is not IHAVEOPT")));
            }
            let mut replies = Vec::new();
            let outcome = if data_bytes > MAX_OPTION_BYTES {
                // NBD_OPT_EXPORT_NAME has no error reply, so it cannot be refused and continued.
                let limit_bytes = if option == OPT_EXPORT_NAME { MAX_OPTION_BYTES } else { MAX_DISCARDED_OPTION_BYTES };
                if data_bytes > limit_bytes {
                    return Err(HandshakeError::Protocol(format!(
                        "option {option} carries {data_bytes} bytes of data, over the {limit_bytes}-byte limit"
                    )));
                }
                let discarded = io::copy(&mut Read::take(&mut *stream, u64::from(data_bytes)), &mut io::sink())?;
                if discarded < u64::from(data_bytes) {
                    return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
                }
                if option == OPT_ABORT {
                    // Abort's data is to be ignored, however long.
                    session.handle(option, &[], &mut replies)?
                } else if session.needs_tls_first(option) {
                    session.refuse_before_tls(option, &mut replies)?
                } else {
                    let message = format!(
                        "option data of {data_bytes} bytes is over this server's {MAX_OPTION_BYTES}-byte limit"
                    );
                    error_reply(&mut replies, option, REP_ERR_TOO_BIG, &message);
                    Outcome::Continue
                }
            } else {
                let mut data = vec![0u8; data_bytes as usize];
                stream.read_exact(&mut data)?;
                session.handle(option, &data, &mut replies)?
            };
            let sent = stream.write_all(&replies).and_then(|()| stream.flush());
            match (outcome, sent) {
                // The spec lets a client close right after NBD_OPT_ABORT, without reading the ACK.
                (Outcome::Aborted, _) => return Err(HandshakeError::Aborted),
                (_, Err(error)) => return Err(error.into()),
                (Outcome::Continue, Ok(())) => {}
                (Outcome::Transmission(negotiated), Ok(())) => return Ok(Ended::Transmission(negotiated)),
                (Outcome::StartTls, Ok(())) => return Ok(Ended::StartTls),
            }
        }
        Err(HandshakeError::Protocol(format!("client sent {MAX_OPTIONS} options without entering transmission")))
    }
}

/// What an option leads to once its replies are sent.
enum Outcome {
    Continue,
    Transmission(Negotiated),
    Aborted,
    StartTls,
}

/// The negotiation state an option may change.
struct Session<'a> {
    export: &'a Export,
    structured_replies: bool,
    block_status_context: Option<u32>,
    no_zeroes: bool,
    tls_policy: TlsPolicy,
    /// STARTTLS was acknowledged: everything since went over TLS.
    tls_started: bool,
}

impl Session<'_> {
    /// FORCEDTLS: every option but these two waits for TLS.
    fn needs_tls_first(&self, option: u32) -> bool {
        self.tls_policy == TlsPolicy::Required && !self.tls_started && !matches!(option, OPT_STARTTLS | OPT_ABORT)
    }

    /// Refuses an option sent before TLS under FORCEDTLS.
    fn refuse_before_tls(&self, option: u32, out: &mut Vec<u8>) -> Result<Outcome, HandshakeError> {
        if option == OPT_EXPORT_NAME {
            // The reply to this option cannot carry an error: the spec says to close.
            return Err(HandshakeError::Protocol(
                "NBD_OPT_EXPORT_NAME before TLS, and this server requires TLS (use NBD_OPT_STARTTLS first)".into(),
            ));
        }
        error_reply(out, option, REP_ERR_TLS_REQD, "this server requires TLS: send NBD_OPT_STARTTLS first");
        Ok(Outcome::Continue)
    }

    /// `NBD_OPT_STARTTLS` under a policy that offers TLS.
    fn start_tls(&mut self, option: u32, data: &[u8], out: &mut Vec<u8>) -> Result<Outcome, HandshakeError> {
        if self.tls_started {
            return invalid(out, option, "TLS is already started on this connection");
        }
        if !data.is_empty() {
            return invalid(out, option, "NBD_OPT_STARTTLS carries no data");
        }
        option_reply(out, option, REP_ACK, &[]);
        self.tls_started = true;
        // The spec: what was negotiated in plain text does not survive the upgrade.
        self.structured_replies = false;
        self.block_status_context = None;
        Ok(Outcome::StartTls)
    }

    /// Answers one option by appending its replies to `out`.
    fn handle(&mut self, option: u32, data: &[u8], out: &mut Vec<u8>) -> Result<Outcome, HandshakeError> {
        if self.needs_tls_first(option) {
            return self.refuse_before_tls(option, out);
        }
        match option {
            OPT_EXPORT_NAME => {
                let name = std::str::from_utf8(data)
                    .map_err(|_| HandshakeError::Protocol("NBD_OPT_EXPORT_NAME name is not UTF-8".into()))?;
                if !self.is_export(name) {
                    // The reply to this option cannot carry an error: the spec says to close.
                    return Err(HandshakeError::Protocol(format!(
                        "NBD_OPT_EXPORT_NAME asked for unknown export {:?}",
                        clamp_str(name, 256)
                    )));
                }
                let transmission_flags = self.transmission_flags();
                out.extend_from_slice(&self.export.size_bytes.to_be_bytes());
                out.extend_from_slice(&transmission_flags.to_be_bytes());
                if !self.no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                Ok(Outcome::Transmission(self.negotiated(name, transmission_flags)))
            }
            OPT_ABORT => {
                // Data is ignored, as the spec asks.
                option_reply(out, option, REP_ACK, &[]);
                Ok(Outcome::Aborted)
            }
            OPT_LIST if !data.is_empty() => invalid(out, option, "NBD_OPT_LIST carries no data"),
            OPT_LIST => {
                let name = self.export.name.as_bytes();
                let description = clamp_str(&self.export.description, MAX_STRING_BYTES).as_bytes();
                option_reply(out, option, REP_SERVER, &[&(name.len() as u32).to_be_bytes(), name, description]);
                option_reply(out, option, REP_ACK, &[]);
                Ok(Outcome::Continue)
            }
            OPT_STARTTLS if self.tls_policy != TlsPolicy::Off => self.start_tls(option, data, out),
            OPT_STARTTLS => {
                let message = "TLS is not offered by this server; use --frontend nbdkit for TLS";
                error_reply(out, option, REP_ERR_POLICY, message);
                Ok(Outcome::Continue)
            }
            OPT_INFO | OPT_GO => self.info_or_go(option, data, out),
            OPT_STRUCTURED_REPLY if !data.is_empty() => {
                invalid(out, option, "NBD_OPT_STRUCTURED_REPLY carries no data")
            }
            OPT_STRUCTURED_REPLY if self.structured_replies => {
                invalid(out, option, "structured replies are already negotiated")
            }
            OPT_STRUCTURED_REPLY => {
                self.structured_replies = true;
                option_reply(out, option, REP_ACK, &[]);
                Ok(Outcome::Continue)
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => self.meta_context(option, data, out),
            _ => {
                tracing::debug!(option, "refusing unsupported NBD option");
                error_reply(out, option, REP_ERR_UNSUP, &format!("option {option} is not supported by this server"));
                Ok(Outcome::Continue)
            }
        }
    }

    /// `NBD_OPT_INFO` and `NBD_OPT_GO`: name, then a count and list of 16-bit info requests.
    fn info_or_go(&mut self, option: u32, data: &[u8], out: &mut Vec<u8>) -> Result<Outcome, HandshakeError> {
        let mut fields = Fields(data);
        let Some(name) = fields.string() else { return invalid(out, option, "malformed export name") };
        let Some(request_count) = fields.u16() else { return invalid(out, option, "missing information count") };
        let Some(requests) = fields.bytes(2 * usize::from(request_count)).filter(|_| fields.0.is_empty()) else {
            return invalid(out, option, "information request count does not match the option length");
        };
        let Ok(name) = std::str::from_utf8(name) else { return invalid(out, option, "export name is not UTF-8") };
        if !self.is_export(name) {
            self.refuse_unknown_export(out, option, name);
            return Ok(Outcome::Continue);
        }

        let export = self.export;
        let transmission_flags = self.transmission_flags();
        let info = |out: &mut Vec<u8>, fields: &[&[u8]]| option_reply(out, option, REP_INFO, fields);
        info(out, &[&INFO_EXPORT.to_be_bytes(), &export.size_bytes.to_be_bytes(), &transmission_flags.to_be_bytes()]);
        // Block sizes go unasked: the spec lets a server send them, and clients that ignore them
        // still get EINVAL, not corruption, for misaligned requests.
        info(
            out,
            &[
                &INFO_BLOCK_SIZE.to_be_bytes(),
                &export.min_block_bytes.to_be_bytes(),
                &export.preferred_block_bytes.to_be_bytes(),
                &export.max_block_bytes.to_be_bytes(),
            ],
        );
        let requested: Vec<u16> = requests.chunks_exact(2).map(|pair| u16::from_be_bytes([pair[0], pair[1]])).collect();
        if requested.contains(&INFO_NAME) {
            info(out, &[&INFO_NAME.to_be_bytes(), export.name.as_bytes()]);
        }
        if requested.contains(&INFO_DESCRIPTION) {
            let description = clamp_str(&export.description, MAX_STRING_BYTES);
            info(out, &[&INFO_DESCRIPTION.to_be_bytes(), description.as_bytes()]);
        }
        option_reply(out, option, REP_ACK, &[]);
        if option == OPT_GO {
            return Ok(Outcome::Transmission(self.negotiated(name, transmission_flags)));
        }
        Ok(Outcome::Continue)
    }

    /// `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT`: name, then a 32-bit count of
    /// queries, each a 32-bit length and a string. Only `base:allocation` exists.
    fn meta_context(&mut self, option: u32, data: &[u8], out: &mut Vec<u8>) -> Result<Outcome, HandshakeError> {
        let set = option == OPT_SET_META_CONTEXT;
        if set {
            // The spec: a SET replaces the selection even when it fails.
            self.block_status_context = None;
            if !self.structured_replies {
                return invalid(out, option, "negotiate structured replies before selecting metadata contexts");
            }
        }
        let mut fields = Fields(data);
        let Some(name) = fields.string() else { return invalid(out, option, "malformed export name") };
        let Some(query_count) = fields.u32() else { return invalid(out, option, "missing query count") };
        let mut queries = Vec::new();
        for _ in 0..query_count {
            let Some(query) = fields.string() else { return invalid(out, option, "malformed metadata query") };
            queries.push(query);
        }
        if !fields.0.is_empty() {
            return invalid(out, option, "metadata queries do not fill the option length");
        }
        if !std::str::from_utf8(name).is_ok_and(|name| self.is_export(name)) {
            self.refuse_unknown_export(out, option, &String::from_utf8_lossy(name));
            return Ok(Outcome::Continue);
        }
        let selects = if set {
            // "base:" alone selects nothing in SET; unknown queries are ignored, not errors.
            queries.iter().any(|query| *query == BASE_ALLOCATION.as_bytes())
        } else {
            queries.is_empty() || queries.iter().any(|query| matches!(*query, b"base:" | b"base:allocation"))
        };
        if selects {
            // A LIST reply's context id is reserved and should be zero.
            let context_id = if set { BASE_ALLOCATION_CONTEXT_ID } else { 0 };
            option_reply(out, option, REP_META_CONTEXT, &[&context_id.to_be_bytes(), BASE_ALLOCATION.as_bytes()]);
            if set {
                self.block_status_context = Some(BASE_ALLOCATION_CONTEXT_ID);
            }
        }
        option_reply(out, option, REP_ACK, &[]);
        Ok(Outcome::Continue)
    }

    fn refuse_unknown_export(&self, out: &mut Vec<u8>, option: u32, name: &str) {
        let message =
            format!("no export {:?}; this server offers {:?} (also as \"\")", clamp_str(name, 256), self.export.name);
        error_reply(out, option, REP_ERR_UNKNOWN, &message);
    }

    fn is_export(&self, name: &str) -> bool {
        name.is_empty() || name == self.export.name
    }

    /// The transmission flags to send given what is negotiated so far (see the module invariants).
    fn transmission_flags(&self) -> u16 {
        let mut flags = (self.export.transmission_flags & KNOWN_TRANSMISSION_FLAGS) | FLAG_HAS_FLAGS;
        if !self.structured_replies {
            flags &= !FLAG_SEND_DF;
        }
        if flags & FLAG_SEND_WRITE_ZEROES == 0 {
            flags &= !FLAG_SEND_FAST_ZERO;
        }
        flags
    }

    fn negotiated(&self, export_name: &str, transmission_flags: u16) -> Negotiated {
        Negotiated {
            structured_replies: self.structured_replies,
            block_status_context: self.block_status_context,
            no_zeroes: self.no_zeroes,
            export_name: export_name.to_owned(),
            transmission_flags,
        }
    }
}

/// Reads one whole message; end of stream before its first byte is the client leaving
/// ([`HandshakeError::ClientClosed`]), after it a truncated message (an I/O error).
fn read_message<S: Read>(stream: &mut S, buf: &mut [u8]) -> Result<(), HandshakeError> {
    let mut filled = 0;
    while filled < buf.len() {
        match stream.read(&mut buf[filled..]) {
            Ok(0) if filled == 0 => return Err(HandshakeError::ClientClosed),
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
            Ok(read) => filled += read,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error.into()),
        }
    }
    Ok(())
}

/// Appends one option reply whose data is the concatenation of `fields`.
fn option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, fields: &[&[u8]]) {
    let data_bytes: usize = fields.iter().map(|field| field.len()).sum();
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&(data_bytes as u32).to_be_bytes());
    for field in fields {
        out.extend_from_slice(field);
    }
}

fn error_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, message: &str) {
    option_reply(out, option, reply_type, &[clamp_str(message, MAX_STRING_BYTES).as_bytes()]);
}

fn invalid(out: &mut Vec<u8>, option: u32, message: &str) -> Result<Outcome, HandshakeError> {
    error_reply(out, option, REP_ERR_INVALID, message);
    Ok(Outcome::Continue)
}

/// Big-endian fields taken from the front of an option's data; `None` when too short.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn bytes(&mut self, count: usize) -> Option<&'a [u8]> {
        let (taken, rest) = self.0.split_at_checked(count)?;
        self.0 = rest;
        Some(taken)
    }

    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes(self.bytes(2)?.try_into().ok()?))
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.bytes(4)?.try_into().ok()?))
    }

    /// A 32-bit length, then that many bytes.
    fn string(&mut self) -> Option<&'a [u8]> {
        let length = self.u32()?;
        self.bytes(usize::try_from(length).ok()?)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;
    use crate::proto::{FLAG_READ_ONLY, FLAG_SEND_FLUSH};

    /// Client bytes in, server bytes out.
    struct Transcript {
        input: Cursor<Vec<u8>>,
        output: Vec<u8>,
    }

    impl Read for Transcript {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }

    impl Write for Transcript {
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
            description: "a zdisk".into(),
            size_bytes: 0x1_0000_0000,
            transmission_flags: FLAG_HAS_FLAGS | FLAG_READ_ONLY | FLAG_SEND_FLUSH | FLAG_SEND_DF | (1 << 9),
            min_block_bytes: 512,
            preferred_block_bytes: 4096,
            max_block_bytes: 1 << 25,
        }
    }

    fn run(client: Vec<u8>) -> (Result<Negotiated, HandshakeError>, Vec<u8>) {
        let mut transcript = Transcript { input: Cursor::new(client), output: Vec::new() };
        let result = negotiate(&mut transcript, &export());
        (result, transcript.output)
    }

    fn option(option: u32, data: &[u8]) -> Vec<u8> {
        let mut bytes = IHAVEOPT.to_be_bytes().to_vec();
        bytes.extend_from_slice(&option.to_be_bytes());
        bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
        bytes.extend_from_slice(data);
        bytes
    }

    #[rustfmt::skip]
    const GREETING: [u8; 18] = [
        b'N', b'B', b'D', b'M', b'A', b'G', b'I', b'C',
        b'I', b'H', b'A', b'V', b'E', b'O', b'P', b'T',
        0x00, 0x03, // FIXED_NEWSTYLE | NO_ZEROES
    ];

    #[test]
    fn export_name_gets_size_flags_and_zero_padding() {
        let mut client = vec![0, 0, 0, 1];
        client.extend(option(OPT_EXPORT_NAME, b"disk"));
        let (result, output) = run(client);
        let negotiated = result.unwrap();
        let mut expected = GREETING.to_vec();
        // Size 4 GiB, flags HAS_FLAGS | READ_ONLY | SEND_FLUSH: DF needs structured replies
        // and bit 9 is unknown to this crate, so both are cleared.
        expected.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x00, 0x07]);
        expected.extend_from_slice(&[0; 124]);
        assert_eq!(output, expected);
        assert_eq!(negotiated.transmission_flags, 0x0007);
        assert_eq!(negotiated.export_name, "disk");
        assert!(!negotiated.no_zeroes && !negotiated.structured_replies);
    }

    #[test]
    fn go_replies_with_info_export_block_size_and_ack() {
        let mut client = vec![0, 0, 0, 3];
        client.extend(option(OPT_STRUCTURED_REPLY, b""));
        // Default name "", no information requests.
        client.extend(option(OPT_GO, &[0, 0, 0, 0, 0, 0]));
        let (result, output) = run(client);
        assert!(result.unwrap().structured_replies);
        #[rustfmt::skip]
        let expected: &[u8] = &[
            // ACK to STRUCTURED_REPLY
            0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0, 0, 0,
            // INFO_EXPORT: size 4 GiB, flags HAS_FLAGS | READ_ONLY | SEND_FLUSH | SEND_DF
            0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, 0, 0, 0, 7, 0, 0, 0, 3, 0, 0, 0, 12,
            0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0x00, 0x87,
            // INFO_BLOCK_SIZE: 512, 4096, 32 MiB
            0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, 0, 0, 0, 7, 0, 0, 0, 3, 0, 0, 0, 14,
            0, 3, 0, 0, 0x02, 0x00, 0, 0, 0x10, 0x00, 0x02, 0, 0, 0,
            // ACK to GO
            0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, 0, 0, 0, 7, 0, 0, 0, 1, 0, 0, 0, 0,
        ];
        assert_eq!(&output[GREETING.len()..], expected);
    }

    #[test]
    fn error_replies_carry_a_message() {
        let mut client = vec![0, 0, 0, 1];
        client.extend(option(OPT_STARTTLS, b""));
        let (result, output) = run(client);
        assert!(matches!(result, Err(HandshakeError::ClientClosed)));
        let reply = &output[GREETING.len()..];
        assert_eq!(&reply[8..16], &[0, 0, 0, 5, 0x80, 0, 0, 2]);
        let message = std::str::from_utf8(&reply[20..]).unwrap();
        assert_eq!(&reply[16..20], &(message.len() as u32).to_be_bytes());
        assert!(message.contains("--frontend nbdkit"), "{message}");
    }

    #[test]
    fn eof_inside_a_message_is_an_io_error_not_a_close() {
        let (result, _) = run(vec![0, 0]);
        assert!(matches!(result, Err(HandshakeError::Io(error)) if error.kind() == io::ErrorKind::UnexpectedEof));
        let (result, _) = run(vec![]);
        assert!(matches!(result, Err(HandshakeError::ClientClosed)));
    }

    #[test]
    fn fields_parse_big_endian_and_stop_at_the_end() {
        let mut fields = Fields(&[0, 0, 0, 2, b'h', b'i', 0, 7, 0xff]);
        assert_eq!(fields.string(), Some(&b"hi"[..]));
        assert_eq!(fields.u16(), Some(7));
        assert_eq!(fields.u16(), None);
        let mut fields = Fields(&[0xff, 0xff, 0xff, 0xff, 0]);
        assert_eq!(fields.string(), None);
    }

    /// TLS policies against a hand-written client over a Unix socket pair. The TLS session
    /// itself is `server.rs`'s (tested with real clients in the CLI's tests/tls.rs); here the
    /// server goes on over the same plain socket where it would go on over TLS.
    mod tls {
        use std::os::unix::net::UnixStream;
        use std::thread::JoinHandle;

        use super::*;

        /// How the server's side ended: how many times it was told to start TLS, and then.
        type Served = (usize, Result<Negotiated, HandshakeError>);

        struct Client {
            stream: UnixStream,
            server: JoinHandle<Served>,
        }

        impl Client {
            fn connect(policy: TlsPolicy) -> Client {
                let (mut server_end, mut stream) = UnixStream::pair().unwrap();
                stream.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
                let server = std::thread::spawn(move || {
                    let export = export();
                    let mut starts = 0;
                    let mut negotiation = match Negotiation::start(&mut server_end, &export, policy) {
                        Ok(negotiation) => negotiation,
                        Err(e) => return (starts, Err(e)),
                    };
                    loop {
                        match negotiation.options(&mut server_end) {
                            Ok(Ended::StartTls) => starts += 1,
                            Ok(Ended::Transmission(negotiated)) => return (starts, Ok(negotiated)),
                            Err(e) => return (starts, Err(e)),
                        }
                    }
                });
                let mut greeting = [0u8; 18];
                stream.read_exact(&mut greeting).unwrap();
                assert_eq!(greeting, GREETING);
                stream.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
                Client { stream, server }
            }

            fn send(&mut self, code: u32, data: &[u8]) {
                self.stream.write_all(&option(code, data)).unwrap();
            }

            /// The next reply: (option, type, data).
            fn reply(&mut self) -> (u32, u32, Vec<u8>) {
                let mut header = [0u8; 20];
                self.stream.read_exact(&mut header).unwrap();
                assert_eq!(header[..8], OPTION_REPLY_MAGIC.to_be_bytes());
                let field = |at: usize| u32::from_be_bytes(header[at..at + 4].try_into().unwrap());
                let mut data = vec![0u8; field(16) as usize];
                self.stream.read_exact(&mut data).unwrap();
                (field(8), field(12), data)
            }

            /// Sends `code` and expects exactly one reply of `reply_type` to it.
            fn expect(&mut self, code: u32, data: &[u8], reply_type: u32) {
                self.send(code, data);
                let (option, got, _) = self.reply();
                assert_eq!((option, got), (code, reply_type), "option {code}");
            }

            fn go(mut self) -> Served {
                self.send(OPT_GO, &[0, 0, 0, 0, 0, 0]);
                loop {
                    let (option, reply_type, _) = self.reply();
                    assert_eq!(option, OPT_GO);
                    if reply_type == REP_ACK {
                        break;
                    }
                    assert_eq!(reply_type, REP_INFO);
                }
                self.server.join().unwrap()
            }
        }

        #[test]
        fn required_tls_refuses_all_but_starttls_and_abort_until_tls_then_serves() {
            let mut client = Client::connect(TlsPolicy::Required);
            for (code, data) in [
                (OPT_LIST, &[][..]),
                (OPT_STRUCTURED_REPLY, &[]),
                (OPT_INFO, &[0, 0, 0, 0, 0, 0]),
                (OPT_GO, &[0, 0, 0, 0, 0, 0]),
                (99, b"unknown"),
            ] {
                client.expect(code, data, REP_ERR_TLS_REQD);
            }
            // Over the option size limit too: TLS is what is missing.
            client.send(OPT_LIST, &vec![0; MAX_OPTION_BYTES as usize + 1]);
            assert_eq!(client.reply().1, REP_ERR_TLS_REQD);
            client.expect(OPT_STARTTLS, b"x", REP_ERR_INVALID);
            client.expect(OPT_STARTTLS, &[], REP_ACK);
            // From here the server speaks "TLS": no more TLS_REQD, and no second STARTTLS.
            client.expect(OPT_STARTTLS, &[], REP_ERR_INVALID);
            client.expect(OPT_STRUCTURED_REPLY, &[], REP_ACK);
            let (starts, negotiated) = client.go();
            assert_eq!(starts, 1);
            assert!(negotiated.unwrap().structured_replies);
        }

        #[test]
        fn required_tls_closes_on_export_name_before_tls() {
            let mut client = Client::connect(TlsPolicy::Required);
            client.send(OPT_EXPORT_NAME, b"");
            let (starts, outcome) = client.server.join().unwrap();
            assert_eq!(starts, 0);
            assert!(matches!(outcome, Err(HandshakeError::Protocol(ref why)) if why.contains("requires TLS")));
            let mut byte = [0u8; 1];
            assert_eq!(client.stream.read(&mut byte).unwrap(), 0, "the server replied to EXPORT_NAME");
        }

        #[test]
        fn required_tls_still_lets_the_client_abort() {
            let mut client = Client::connect(TlsPolicy::Required);
            client.expect(OPT_ABORT, &[], REP_ACK);
            assert!(matches!(client.server.join().unwrap(), (0, Err(HandshakeError::Aborted))));
        }

        #[test]
        fn offered_tls_serves_plain_clients() {
            let mut client = Client::connect(TlsPolicy::Offered);
            client.expect(OPT_STRUCTURED_REPLY, &[], REP_ACK);
            let (starts, negotiated) = client.go();
            assert_eq!(starts, 0);
            assert!(negotiated.unwrap().structured_replies);
        }

        #[test]
        fn starttls_forgets_what_was_negotiated_in_plain_text() {
            let mut client = Client::connect(TlsPolicy::Offered);
            client.expect(OPT_STRUCTURED_REPLY, &[], REP_ACK);
            let mut context = 4u32.to_be_bytes().to_vec();
            context.extend_from_slice(b"disk");
            context.extend_from_slice(&1u32.to_be_bytes());
            context.extend_from_slice(&(BASE_ALLOCATION.len() as u32).to_be_bytes());
            context.extend_from_slice(BASE_ALLOCATION.as_bytes());
            client.send(OPT_SET_META_CONTEXT, &context);
            assert_eq!(client.reply().1, REP_META_CONTEXT);
            assert_eq!(client.reply().1, REP_ACK);
            client.expect(OPT_STARTTLS, &[], REP_ACK);
            let (starts, negotiated) = client.go();
            assert_eq!(starts, 1);
            let negotiated = negotiated.unwrap();
            assert!(!negotiated.structured_replies && negotiated.block_status_context.is_none(), "{negotiated:?}");
            assert!(negotiated.no_zeroes, "client flags are not options: they stay");
        }
    }
}
