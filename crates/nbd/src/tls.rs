//! TLS for zdisk's own NBD server: the server's credentials, loaded once at start, and the
//! TLS handshake on a connection that acknowledged `NBD_OPT_STARTTLS`. The names and files
//! are nbdkit's (`--tls-certificates DIR`, `--tls-psk FILE`, `--tls-verify-peer`), so one set of
//! files serves both front ends.
//!
//! OpenSSL (the system's, through the `openssl` crate) rather than rustls: NBD clients
//! (libnbd, qemu) authenticate with X.509 certificates or with pre-shared keys, and rustls
//! has no TLS-PSK.
//!
//! Invariants:
//! - exactly one kind of credential: X.509 (`DIR/server-cert.pem`, `DIR/server-key.pem`) or
//!   PSK identities; every file is read and checked when the server starts, and a missing,
//!   unreadable or malformed one is an error naming the file and what is wrong in it — never
//!   a server that fails its first client;
//! - TLS 1.2 at least (the NBD spec's floor), forward-secret key exchange only: ECDHE with
//!   certificates; with PSK, (EC)DHE-PSK under TLS 1.2 and `psk_dhe_ke` under TLS 1.3;
//! - with `verify_peer`, a client without a certificate signed by `DIR/ca-cert.pem` (and not
//!   revoked by `DIR/ca-crl.pem`, when that file exists) fails the TLS handshake;
//! - PSK keys live in memory only in zeroize-on-drop buffers and are never logged; an unknown
//!   identity fails the handshake exactly as a wrong key does.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use openssl::ssl::{
    SslAcceptor, SslAcceptorBuilder, SslFiletype, SslMethod, SslOptions, SslSessionCacheMode, SslStream, SslVerifyMode,
    SslVersion,
};
use openssl::x509::store::X509Lookup;
use openssl::x509::verify::X509VerifyFlags;
use thiserror::Error;
use zeroize::Zeroizing;

use crate::handshake::TlsPolicy;

/// Longest key a PSK file may hold: OpenSSL's `PSK_MAX_PSK_LEN`.
const PSK_KEY_BYTES_MAX: usize = 512;
/// The PSK ciphers offered under TLS 1.2: forward-secret ones only (plain `PSK-*` suites
/// would let a leaked key decrypt recorded sessions).
const PSK_CIPHERS_TLS12: &str = "ECDHE-PSK-CHACHA20-POLY1305:DHE-PSK-AES256-GCM-SHA384:\
                                 DHE-PSK-AES128-GCM-SHA256:DHE-PSK-CHACHA20-POLY1305";
/// Longest PSK file read (one line per identity: far beyond any real list).
const PSK_FILE_BYTES_MAX: u64 = 1 << 20;

/// How clients authenticate, as `zdisk serve` was told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credentials {
    /// `DIR/server-cert.pem` (the chain, server first) and `DIR/server-key.pem`; with
    /// `verify_peer`, clients must present a certificate signed by `DIR/ca-cert.pem`.
    Certificates { dir: PathBuf, verify_peer: bool },
    /// A file of `identity:hexkey` lines (nbdkit's and psktool's format).
    Psk { file: PathBuf },
}

/// Why the TLS credentials cannot be loaded; each names the file.
#[derive(Debug, Error)]
pub enum TlsError {
    #[error("{}: cannot read: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: {why}", path.display())]
    Invalid { path: PathBuf, why: String },
    #[error("setting up TLS: {0}")]
    OpenSsl(#[from] openssl::error::ErrorStack),
}

/// A server's TLS: its policy and its credentials, ready to accept connections.
pub struct TlsServer {
    policy: TlsPolicy,
    acceptor: SslAcceptor,
    /// What the credentials are, for logs ("certificates in DIR", "PSK identities from FILE").
    description: String,
}

impl std::fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsServer").field("policy", &self.policy).field("credentials", &self.description).finish()
    }
}

impl TlsServer {
    /// Loads `credentials` for a server that offers or requires TLS (`policy` is not `Off`).
    pub fn new(policy: TlsPolicy, credentials: &Credentials) -> Result<TlsServer, TlsError> {
        assert_ne!(policy, TlsPolicy::Off, "a TLS server offers TLS");
        let mut builder = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())?;
        builder.set_min_proto_version(Some(SslVersion::TLS1_2))?;
        // No resumption: a session is one NBD connection, and a resumed session would skip the
        // client certificate check.
        builder.set_session_cache_mode(SslSessionCacheMode::OFF);
        // No renegotiation (a client could make the server redo handshakes mid-stream). A
        // peer that closes without close_notify reads as a close: NBD's framing already
        // tells a whole request from a cut one, so a truncation attack gains nothing.
        builder.set_options(SslOptions::NO_TICKET | SslOptions::NO_RENEGOTIATION | SslOptions::IGNORE_UNEXPECTED_EOF);
        let description = match credentials {
            Credentials::Certificates { dir, verify_peer } => {
                load_certificates(&mut builder, dir, *verify_peer)?;
                match verify_peer {
                    true => format!("certificates in {} (client certificates verified)", dir.display()),
                    false => format!("certificates in {}", dir.display()),
                }
            }
            Credentials::Psk { file } => {
                let keys = read_psk_file(file)?;
                let count = keys.len();
                builder.set_cipher_list(PSK_CIPHERS_TLS12)?;
                builder.set_psk_server_callback(move |_ssl, identity, key_out| {
                    // An unknown identity and a wrong key fail alike: the handshake's Finished
                    // check fails (0 bytes is "no key").
                    let key = identity
                        .and_then(|identity| std::str::from_utf8(identity).ok())
                        .and_then(|identity| keys.get(identity));
                    match key {
                        Some(key) if key.len() <= key_out.len() => {
                            key_out[..key.len()].copy_from_slice(key);
                            Ok(key.len())
                        }
                        _ => Ok(0),
                    }
                });
                format!("{count} PSK identities from {}", file.display())
            }
        };
        Ok(TlsServer { policy, acceptor: builder.build(), description })
    }

    pub fn policy(&self) -> TlsPolicy {
        self.policy
    }

    /// What clients authenticate with, for the log.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Runs the server side of the TLS handshake on `stream` (whose timeouts bound it); the
    /// error says why it failed, for the log.
    pub fn accept<S: Read + Write>(&self, stream: S) -> Result<SslStream<S>, String> {
        self.acceptor.accept(stream).map_err(|e| match e {
            openssl::ssl::HandshakeError::SetupFailure(e) => e.to_string(),
            openssl::ssl::HandshakeError::Failure(mid) | openssl::ssl::HandshakeError::WouldBlock(mid) => {
                // OpenSSL's reasons ("binder does not verify": a wrong PSK key or an unknown
                // identity), without its source file and line.
                let reasons: Vec<&str> = mid
                    .error()
                    .ssl_error()
                    .map(|stack| stack.errors().iter().filter_map(|e| e.reason()).collect())
                    .unwrap_or_default();
                let why = match reasons.is_empty() {
                    true => mid.error().to_string(),
                    false => reasons.join("; "),
                };
                match mid.ssl().verify_result() {
                    openssl::x509::X509VerifyResult::OK => why,
                    verify => format!("{why} (client certificate: {})", verify.error_string()),
                }
            }
        })
    }
}

/// A path OpenSSL can take: the crate passes paths as C strings from UTF-8 (and panics on
/// other paths), so they are checked here first.
fn openssl_path(path: &Path) -> Result<&str, TlsError> {
    match path.to_str() {
        Some(text) if !text.contains('\0') => Ok(text),
        _ => Err(TlsError::Invalid { path: path.to_owned(), why: "OpenSSL needs a UTF-8 path".into() }),
    }
}

/// `path` must be a readable file: checked before OpenSSL reads it, for a message that says so.
fn readable(path: &Path) -> Result<&str, TlsError> {
    std::fs::File::open(path).map_err(|source| TlsError::Read { path: path.to_owned(), source })?;
    openssl_path(path)
}

fn load_certificates(builder: &mut SslAcceptorBuilder, dir: &Path, verify_peer: bool) -> Result<(), TlsError> {
    if !dir.is_dir() {
        return Err(TlsError::Invalid { path: dir.to_owned(), why: "is not a directory of TLS certificates".into() });
    }
    let cert = dir.join("server-cert.pem");
    let key = dir.join("server-key.pem");
    builder
        .set_certificate_chain_file(readable(&cert)?)
        .map_err(|e| TlsError::Invalid { path: cert.clone(), why: format!("not a PEM certificate chain ({e})") })?;
    builder
        .set_private_key_file(readable(&key)?, SslFiletype::PEM)
        .map_err(|e| TlsError::Invalid { path: key.clone(), why: format!("not a PEM private key ({e})") })?;
    builder.check_private_key().map_err(|_| TlsError::Invalid {
        path: key.clone(),
        why: format!("does not match the certificate in {}", cert.display()),
    })?;
    if !verify_peer {
        return Ok(());
    }
    let ca = dir.join("ca-cert.pem");
    builder.set_ca_file(readable(&ca)?).map_err(|e| TlsError::Invalid {
        path: ca.clone(),
        why: format!("not a PEM CA certificate, needed to verify client certificates ({e})"),
    })?;
    let crl = dir.join("ca-crl.pem");
    if crl.exists() {
        let lookup = builder.cert_store_mut().add_lookup(X509Lookup::file())?;
        lookup.load_crl_file(readable(&crl)?, SslFiletype::PEM).map_err(|e| TlsError::Invalid {
            path: crl.clone(),
            why: format!("not a PEM certificate revocation list ({e})"),
        })?;
        builder.cert_store_mut().set_flags(X509VerifyFlags::CRL_CHECK)?;
    }
    builder.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    Ok(())
}

/// Reads a PSK file: `identity:hexkey` per line (blank lines are skipped), as psktool writes
/// it and nbdkit reads it.
pub fn read_psk_file(path: &Path) -> Result<HashMap<String, Zeroizing<Vec<u8>>>, TlsError> {
    let invalid = |why: String| TlsError::Invalid { path: path.to_owned(), why };
    let file = std::fs::File::open(path).map_err(|source| TlsError::Read { path: path.to_owned(), source })?;
    let mut text = Zeroizing::new(String::new());
    file.take(PSK_FILE_BYTES_MAX + 1)
        .read_to_string(&mut text)
        .map_err(|source| TlsError::Read { path: path.to_owned(), source })?;
    if text.len() as u64 > PSK_FILE_BYTES_MAX {
        return Err(invalid(format!("longer than {PSK_FILE_BYTES_MAX} bytes: not a PSK file")));
    }
    let mut keys = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        let line_number = index + 1;
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        // The first ':' splits, as GnuTLS's and libnbd's readers split (psktool refuses ':'
        // in an identity).
        let Some((identity, hex)) = line.split_once(':') else {
            return Err(invalid(format!("line {line_number}: expected IDENTITY:HEXKEY")));
        };
        if identity.is_empty() {
            return Err(invalid(format!("line {line_number}: empty identity")));
        }
        let key = decode_hex(hex).ok_or_else(|| {
            invalid(format!(
                "line {line_number}: the key of {identity:?} is not hex (an even number of digits 0-9, a-f)"
            ))
        })?;
        if key.is_empty() || key.len() > PSK_KEY_BYTES_MAX {
            return Err(invalid(format!(
                "line {line_number}: the key of {identity:?} is {} bytes; 1 to {PSK_KEY_BYTES_MAX} are allowed",
                key.len()
            )));
        }
        if keys.insert(identity.to_owned(), key).is_some() {
            return Err(invalid(format!("line {line_number}: identity {identity:?} appears twice")));
        }
    }
    if keys.is_empty() {
        return Err(invalid("holds no identities (expected IDENTITY:HEXKEY lines, as psktool writes)".into()));
    }
    Ok(keys)
}

fn decode_hex(hex: &str) -> Option<Zeroizing<Vec<u8>>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut key = Zeroizing::new(Vec::with_capacity(hex.len() / 2));
    for pair in hex.as_bytes().chunks_exact(2) {
        key.push(digit(pair[0])? << 4 | digit(pair[1])?);
    }
    Some(key)
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use openssl::ssl::{SslConnector, SslVerifyMode};

    use super::*;

    fn psk_file(content: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.psk");
        std::fs::write(&path, content).unwrap();
        (dir, path)
    }

    const ALICE_HEX: &str = "8f2e4a1c9b7d3e5f60718293a4b5c6d7e8f9011223344556677889aabbccddee";

    #[test]
    fn psk_file_reads_identities_and_names_the_bad_line() {
        let (_dir, path) = psk_file(&format!("alice:{ALICE_HEX}\n\nbob:00ff\r\n"));
        let keys = read_psk_file(&path).unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys["bob"].as_slice(), &[0x00, 0xff]);
        assert_eq!(keys["alice"].len(), 32);

        for (content, says) in [
            ("alice\n", "line 1: expected IDENTITY:HEXKEY"),
            ("alice:abc\n", "is not hex"),
            ("alice:zz\n", "is not hex"),
            ("ok:00\n:00\n", "line 2: empty identity"),
            ("alice:00\nalice:01\n", "appears twice"),
            ("alice:\n", "is 0 bytes"),
            ("\n\n", "holds no identities"),
        ] {
            let (_dir, path) = psk_file(content);
            let error = read_psk_file(&path).unwrap_err().to_string();
            assert!(error.contains(says) && error.contains("keys.psk"), "{content:?}: {error}");
        }
        let error = read_psk_file(Path::new("/nonexistent/keys.psk")).unwrap_err().to_string();
        assert!(error.contains("/nonexistent/keys.psk: cannot read"), "{error}");
    }

    #[test]
    fn missing_certificates_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let credentials = Credentials::Certificates { dir: dir.path().to_owned(), verify_peer: false };
        let error = TlsServer::new(TlsPolicy::Required, &credentials).unwrap_err().to_string();
        assert!(error.contains("server-cert.pem: cannot read"), "{error}");
        std::fs::write(dir.path().join("server-cert.pem"), "not a certificate").unwrap();
        std::fs::write(dir.path().join("server-key.pem"), "not a key").unwrap();
        let error = TlsServer::new(TlsPolicy::Required, &credentials).unwrap_err().to_string();
        assert!(error.contains("server-cert.pem: not a PEM certificate chain"), "{error}");
        let credentials = Credentials::Certificates { dir: dir.path().join("nope"), verify_peer: false };
        let error = TlsServer::new(TlsPolicy::Required, &credentials).unwrap_err().to_string();
        assert!(error.contains("is not a directory"), "{error}");
    }

    /// A TLS client over a socket pair with `identity` and `key_hex`; whether the handshake
    /// and one echoed message got through, and the protocol version.
    fn psk_round_trip(server: &TlsServer, identity: &'static str, key_hex: &'static str) -> Option<String> {
        let (server_end, client_end) = UnixStream::pair().unwrap();
        let timeout = Some(std::time::Duration::from_secs(10));
        server_end.set_read_timeout(timeout).unwrap();
        client_end.set_read_timeout(timeout).unwrap();
        std::thread::scope(|scope| {
            let served = scope.spawn(move || {
                let mut tls = server.accept(server_end).ok()?;
                let mut message = [0u8; 5];
                tls.read_exact(&mut message).ok()?;
                tls.write_all(&message).ok()?;
                Some(())
            });
            let mut connector = SslConnector::builder(SslMethod::tls_client()).unwrap();
            connector.set_verify(SslVerifyMode::NONE);
            connector.set_cipher_list(PSK_CIPHERS_TLS12).unwrap();
            connector.set_psk_client_callback(move |_ssl, _hint, identity_out, key_out| {
                let key = decode_hex(key_hex).unwrap();
                identity_out[..identity.len()].copy_from_slice(identity.as_bytes());
                identity_out[identity.len()] = 0;
                key_out[..key.len()].copy_from_slice(&key);
                Ok(key.len())
            });
            let client = connector.build().configure().unwrap().verify_hostname(false).connect("zdisk", client_end);
            let echoed = client.ok().and_then(|mut tls| {
                tls.write_all(b"hello").ok()?;
                let mut echo = [0u8; 5];
                tls.read_exact(&mut echo).ok()?;
                (&echo == b"hello").then(|| tls.ssl().version_str().to_string())
            });
            let _ = served.join();
            echoed
        })
    }

    #[test]
    fn psk_clients_need_a_listed_identity_and_its_key() {
        let (_dir, path) = psk_file(&format!("alice:{ALICE_HEX}\n"));
        let server = TlsServer::new(TlsPolicy::Required, &Credentials::Psk { file: path }).unwrap();
        assert!(server.description().contains("1 PSK identities"), "{}", server.description());
        let version = psk_round_trip(&server, "alice", ALICE_HEX).expect("alice with her key gets through");
        assert!(version == "TLSv1.3" || version == "TLSv1.2", "{version}");
        let wrong = "0000000000000000000000000000000000000000000000000000000000000000";
        assert!(psk_round_trip(&server, "alice", wrong).is_none(), "a wrong key got through");
        assert!(psk_round_trip(&server, "mallory", ALICE_HEX).is_none(), "an unknown identity got through");
    }
}
