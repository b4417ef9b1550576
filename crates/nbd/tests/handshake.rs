//! `negotiate` against a hand-written client over a Unix socket pair: the server runs in a
//! thread, the test plays the client byte by byte as `doc/proto.md` describes it.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::Duration;

use zdisk_nbd::handshake::*;
use zdisk_nbd::proto::*;

fn export() -> Export {
    Export {
        name: "disk".into(),
        description: "a zdisk store".into(),
        size_bytes: 1 << 30,
        transmission_flags: FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA | FLAG_SEND_TRIM | FLAG_SEND_DF,
        min_block_bytes: 1,
        preferred_block_bytes: 4096,
        max_block_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
    }
}

#[derive(Debug)]
struct Reply {
    option: u32,
    reply_type: u32,
    data: Vec<u8>,
}

struct Client {
    stream: UnixStream,
    server: Option<JoinHandle<Result<Negotiated, HandshakeError>>>,
}

impl Client {
    /// Connects, checks the greeting and sends `client_flags`.
    fn connect(client_flags: u32) -> Client {
        let (mut server_end, stream) = UnixStream::pair().unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let server = std::thread::spawn(move || negotiate(&mut server_end, &export()));
        let mut client = Client { stream, server: Some(server) };
        let greeting = client.read_bytes(18);
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        assert_eq!(&greeting[8..16], b"IHAVEOPT");
        assert_eq!(&greeting[16..], &[0, 3], "FIXED_NEWSTYLE | NO_ZEROES");
        client.stream.write_all(&client_flags.to_be_bytes()).unwrap();
        client
    }

    fn read_bytes(&mut self, count: usize) -> Vec<u8> {
        let mut bytes = vec![0; count];
        self.stream.read_exact(&mut bytes).unwrap();
        bytes
    }

    fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut bytes = IHAVEOPT.to_be_bytes().to_vec();
        bytes.extend_from_slice(&option.to_be_bytes());
        bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
        bytes.extend_from_slice(data);
        self.stream.write_all(&bytes).unwrap();
    }

    fn reply(&mut self) -> Reply {
        let header = self.read_bytes(20);
        assert_eq!(&header[..8], &OPTION_REPLY_MAGIC.to_be_bytes());
        let option = u32::from_be_bytes(header[8..12].try_into().unwrap());
        let reply_type = u32::from_be_bytes(header[12..16].try_into().unwrap());
        let length = u32::from_be_bytes(header[16..20].try_into().unwrap());
        Reply { option, reply_type, data: self.read_bytes(length as usize) }
    }

    /// Replies up to and including the final one (ACK or an error), all for `option`.
    fn replies(&mut self, option: u32) -> Vec<Reply> {
        let mut replies = Vec::new();
        loop {
            let reply = self.reply();
            assert_eq!(reply.option, option, "{reply:?}");
            let last = reply.reply_type == REP_ACK || reply.reply_type & (1 << 31) != 0;
            replies.push(reply);
            if last {
                return replies;
            }
        }
    }

    /// The one error reply to `option`, with its message.
    fn error(&mut self, option: u32) -> (u32, String) {
        let mut replies = self.replies(option);
        assert_eq!(replies.len(), 1, "{replies:?}");
        let reply = replies.remove(0);
        (reply.reply_type, String::from_utf8(reply.data).expect("UTF-8 message"))
    }

    fn ack(&mut self, option: u32) {
        let replies = self.replies(option);
        assert_eq!(replies.len(), 1, "{replies:?}");
        assert_eq!(replies[0].reply_type, REP_ACK);
        assert!(replies[0].data.is_empty());
    }

    fn outcome(&mut self) -> Result<Negotiated, HandshakeError> {
        self.server.take().unwrap().join().unwrap()
    }

    /// The server ended the handshake: it dropped its end and nothing more comes.
    fn assert_closed(&mut self) {
        let mut byte = [0u8; 1];
        assert_eq!(self.stream.read(&mut byte).unwrap(), 0, "the server sent more bytes");
    }
}

fn go_data(name: &str, info_requests: &[u16]) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&(info_requests.len() as u16).to_be_bytes());
    for request in info_requests {
        data.extend_from_slice(&request.to_be_bytes());
    }
    data
}

fn meta_context_data(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend_from_slice(&(query.len() as u32).to_be_bytes());
        data.extend_from_slice(query.as_bytes());
    }
    data
}

/// Checks a successful INFO or GO reply: INFO_EXPORT with the expected flags, then ACK; returns
/// the info payloads by type.
fn info_replies(replies: &[Reply], expected_flags: u16) -> Vec<(u16, Vec<u8>)> {
    let (last, infos) = replies.split_last().unwrap();
    assert_eq!(last.reply_type, REP_ACK);
    let infos: Vec<(u16, Vec<u8>)> = infos
        .iter()
        .map(|reply| {
            assert_eq!(reply.reply_type, REP_INFO);
            (u16::from_be_bytes([reply.data[0], reply.data[1]]), reply.data[2..].to_vec())
        })
        .collect();
    let mut expected_export = (1u64 << 30).to_be_bytes().to_vec();
    expected_export.extend_from_slice(&expected_flags.to_be_bytes());
    assert!(infos.contains(&(INFO_EXPORT, expected_export)), "{infos:?}");
    infos
}

const FLAGS_WITHOUT_DF: u16 = FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA | FLAG_SEND_TRIM;

#[test]
fn export_name_with_zero_padding() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    client.send_option(OPT_EXPORT_NAME, b"disk");
    let reply = client.read_bytes(8 + 2 + 124);
    assert_eq!(&reply[..8], &(1u64 << 30).to_be_bytes());
    assert_eq!(&reply[8..10], &FLAGS_WITHOUT_DF.to_be_bytes());
    assert!(reply[10..].iter().all(|&byte| byte == 0));
    client.assert_closed();
    let negotiated = client.outcome().unwrap();
    assert_eq!(
        negotiated,
        Negotiated {
            structured_replies: false,
            block_status_context: None,
            no_zeroes: false,
            export_name: "disk".into(),
            transmission_flags: FLAGS_WITHOUT_DF,
        }
    );
}

#[test]
fn export_name_without_zeroes_and_by_the_default_name() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    client.send_option(OPT_EXPORT_NAME, b"");
    let reply = client.read_bytes(10);
    assert_eq!(&reply[..8], &(1u64 << 30).to_be_bytes());
    client.assert_closed();
    let negotiated = client.outcome().unwrap();
    assert!(negotiated.no_zeroes);
    assert_eq!(negotiated.export_name, "");
}

#[test]
fn go_with_structured_replies_and_base_allocation() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    client.send_option(OPT_STRUCTURED_REPLY, b"");
    client.ack(OPT_STRUCTURED_REPLY);

    client.send_option(OPT_LIST_META_CONTEXT, &meta_context_data("disk", &["base:"]));
    let listed = client.replies(OPT_LIST_META_CONTEXT);
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[0].reply_type, REP_META_CONTEXT);
    assert_eq!(listed[0].data, b"\0\0\0\0base:allocation");
    assert_eq!(listed[1].reply_type, REP_ACK);

    client.send_option(OPT_SET_META_CONTEXT, &meta_context_data("disk", &["qemu:dirty-bitmap:x", "base:allocation"]));
    let selected = client.replies(OPT_SET_META_CONTEXT);
    assert_eq!(selected.len(), 2);
    assert_eq!(selected[0].reply_type, REP_META_CONTEXT);
    assert_eq!(selected[0].data, b"\0\0\0\x01base:allocation");

    client.send_option(OPT_GO, &go_data("disk", &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]));
    let infos = info_replies(&client.replies(OPT_GO), FLAGS_WITHOUT_DF | FLAG_SEND_DF);
    assert!(infos.contains(&(INFO_NAME, b"disk".to_vec())));
    assert!(infos.contains(&(INFO_DESCRIPTION, b"a zdisk store".to_vec())));
    assert!(infos.contains(&(INFO_BLOCK_SIZE, [[0, 0, 0, 1], [0, 0, 0x10, 0], [0x02, 0, 0, 0]].concat())));
    client.assert_closed();

    let negotiated = client.outcome().unwrap();
    assert!(negotiated.structured_replies);
    assert_eq!(negotiated.block_status_context, Some(BASE_ALLOCATION_CONTEXT_ID));
    let limits = negotiated.limits(&export());
    assert_eq!(limits.size_bytes, 1 << 30);
    assert_eq!(limits.transmission_flags, FLAGS_WITHOUT_DF | FLAG_SEND_DF);
    assert_eq!(limits.block_status_context, Some(1));
}

#[test]
fn meta_context_selection_needs_structured_replies_and_known_queries() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    client.send_option(OPT_SET_META_CONTEXT, &meta_context_data("", &["base:allocation"]));
    let (reply_type, message) = client.error(OPT_SET_META_CONTEXT);
    assert_eq!(reply_type, REP_ERR_INVALID);
    assert!(message.contains("structured replies"), "{message}");

    client.send_option(OPT_STRUCTURED_REPLY, b"");
    client.ack(OPT_STRUCTURED_REPLY);
    client.send_option(OPT_STRUCTURED_REPLY, b"");
    assert_eq!(client.error(OPT_STRUCTURED_REPLY).0, REP_ERR_INVALID, "a second STRUCTURED_REPLY");

    // "base:" selects nothing in SET, unknown namespaces are ignored: only the ACK comes.
    client.send_option(OPT_SET_META_CONTEXT, &meta_context_data("", &["base:", "x-other:thing"]));
    client.ack(OPT_SET_META_CONTEXT);
    // A query whose length runs past the option is malformed.
    let mut malformed = meta_context_data("", &["base:allocation"]);
    malformed.pop();
    client.send_option(OPT_SET_META_CONTEXT, &malformed);
    assert_eq!(client.error(OPT_SET_META_CONTEXT).0, REP_ERR_INVALID);

    client.send_option(OPT_GO, &go_data("", &[]));
    client.replies(OPT_GO);
    let negotiated = client.outcome().unwrap();
    assert!(negotiated.structured_replies);
    assert_eq!(negotiated.block_status_context, None);
}

#[test]
fn list_names_the_export_then_acks() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    client.send_option(OPT_LIST, b"");
    let replies = client.replies(OPT_LIST);
    assert_eq!(replies.len(), 2);
    assert_eq!(replies[0].reply_type, REP_SERVER);
    assert_eq!(replies[0].data, b"\0\0\0\x04diska zdisk store");
    assert_eq!(replies[1].reply_type, REP_ACK);

    client.send_option(OPT_LIST, b"x");
    assert_eq!(client.error(OPT_LIST).0, REP_ERR_INVALID);
    client.send_option(OPT_ABORT, b"");
    client.ack(OPT_ABORT);
    assert!(matches!(client.outcome(), Err(HandshakeError::Aborted)));
}

#[test]
fn abort_is_acknowledged_and_ends_the_handshake() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    client.send_option(OPT_ABORT, b"");
    client.ack(OPT_ABORT);
    client.assert_closed();
    assert!(matches!(client.outcome(), Err(HandshakeError::Aborted)));
}

#[test]
fn abort_without_waiting_for_the_ack_is_still_aborted() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    client.send_option(OPT_ABORT, b"ignored data");
    let server = client.server.take().unwrap();
    drop(client);
    assert!(matches!(server.join().unwrap(), Err(HandshakeError::Aborted)));
}

#[test]
fn info_then_go() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    client.send_option(OPT_INFO, &go_data("disk", &[INFO_BLOCK_SIZE]));
    let info = info_replies(&client.replies(OPT_INFO), FLAGS_WITHOUT_DF);
    client.send_option(OPT_GO, &go_data("disk", &[INFO_BLOCK_SIZE]));
    let go = info_replies(&client.replies(OPT_GO), FLAGS_WITHOUT_DF);
    // The spec: a GO right after an INFO with the same parameters gets the same information.
    assert_eq!(info, go);
    client.assert_closed();
    assert_eq!(client.outcome().unwrap().export_name, "disk");
}

#[test]
fn unknown_and_unsupported_options_are_refused_and_negotiation_continues() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    client.send_option(42, b"some data the server must skip");
    let (reply_type, message) = client.error(42);
    assert_eq!(reply_type, REP_ERR_UNSUP);
    assert!(message.contains("42"), "{message}");
    client.send_option(OPT_EXTENDED_HEADERS, b"");
    assert_eq!(client.error(OPT_EXTENDED_HEADERS).0, REP_ERR_UNSUP);

    client.send_option(OPT_STARTTLS, b"");
    let (reply_type, message) = client.error(OPT_STARTTLS);
    assert_eq!(reply_type, REP_ERR_POLICY);
    assert!(message.contains("--frontend nbdkit"), "{message}");

    client.send_option(OPT_GO, &go_data("", &[]));
    info_replies(&client.replies(OPT_GO), FLAGS_WITHOUT_DF);
    assert!(client.outcome().is_ok());
}

#[test]
fn bad_client_flags_close_the_connection() {
    for client_flags in [FLAG_C_FIXED_NEWSTYLE | 1 << 2, FLAG_C_NO_ZEROES, 0] {
        let mut client = Client::connect(client_flags);
        client.assert_closed();
        let error = client.outcome().unwrap_err();
        assert!(matches!(error, HandshakeError::Protocol(_)), "{client_flags:#x}: {error}");
    }
}

#[test]
fn unknown_export_name_is_an_error_reply_for_go_and_a_close_for_export_name() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    for option in [OPT_INFO, OPT_GO] {
        client.send_option(option, &go_data("other", &[]));
        let (reply_type, message) = client.error(option);
        assert_eq!(reply_type, REP_ERR_UNKNOWN);
        assert!(message.contains("\"other\"") && message.contains("\"disk\""), "{message}");
    }
    client.send_option(OPT_EXPORT_NAME, b"other");
    client.assert_closed();
    assert!(matches!(client.outcome(), Err(HandshakeError::Protocol(message)) if message.contains("other")));
}

#[test]
fn malformed_go_is_invalid() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    let mut data = go_data("disk", &[INFO_NAME]);
    data.push(0); // an odd trailing byte
    client.send_option(OPT_GO, &data);
    assert_eq!(client.error(OPT_GO).0, REP_ERR_INVALID);
    client.send_option(OPT_GO, &[0, 0, 0, 9, b'd']);
    assert_eq!(client.error(OPT_GO).0, REP_ERR_INVALID);
    client.send_option(OPT_GO, &go_data("disk", &[]));
    client.replies(OPT_GO);
    assert!(client.outcome().is_ok());
}

#[test]
fn oversized_options_are_refused_then_closed() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    client.send_option(OPT_GO, &vec![0u8; 100 << 10]);
    let (reply_type, message) = client.error(OPT_GO);
    assert_eq!(reply_type, REP_ERR_TOO_BIG);
    assert!(message.contains("102400"), "{message}");

    // Past the discard cap only the header is needed: the server closes without reading on.
    let mut header = IHAVEOPT.to_be_bytes().to_vec();
    header.extend_from_slice(&OPT_INFO.to_be_bytes());
    header.extend_from_slice(&(MAX_DISCARDED_OPTION_BYTES + 1).to_be_bytes());
    client.stream.write_all(&header).unwrap();
    client.assert_closed();
    assert!(matches!(client.outcome(), Err(HandshakeError::Protocol(_))));
}

#[test]
fn too_many_options_close_the_connection() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    for _ in 0..MAX_OPTIONS {
        client.send_option(OPT_LIST, b"");
        client.replies(OPT_LIST);
    }
    client.assert_closed();
    assert!(matches!(client.outcome(), Err(HandshakeError::Protocol(message)) if message.contains("128")));
}

#[test]
fn client_closing_between_options_is_client_closed() {
    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    client.send_option(OPT_STRUCTURED_REPLY, b"");
    client.ack(OPT_STRUCTURED_REPLY);
    client.stream.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(matches!(client.outcome(), Err(HandshakeError::ClientClosed)));

    let mut client = Client::connect(FLAG_C_FIXED_NEWSTYLE);
    client.stream.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
    client.stream.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(matches!(client.outcome(), Err(HandshakeError::Io(_))), "a half-sent option is not a clean close");
}
