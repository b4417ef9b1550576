//! TLS on `zdisk serve` (`--tls`, `--tls-certificates`, `--tls-psk`, `--tls-verify-peer`)
//! with real clients — nbdcopy and nbdinfo, libnbd over GnuTLS, as `nbds+unix://` and
//! `nbds://` URIs — against both front ends: each test runs as is against zdisk's own server
//! and again, in `through_nbdkit`, against nbdkit running the plugin (same options).
//!
//! Certificates are made at test time with the `openssl` CLI: a CA, a server certificate for
//! localhost and 127.0.0.1 signed by it, a client certificate, and a second CA that signed
//! nothing here. PSK files are written by hand in psktool's `identity:hexkey` format.
//!
//! Run: `cargo test -p zdisk --test tls`. Needs nbdkit, libnbd-bin, python3-libnbd, openssl;
//! missing tools skip locally and fail under CI=true. Stores are small (32 MiB) to keep it
//! short.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{require, run_ok, sha256, wait_timeout, Scratch, Server};

const TOOLS: &[&str] = &["nbdkit", "nbdcopy", "nbdinfo", "openssl", "sha256sum"];

/// Runs `openssl ARGS` in `dir`.
fn openssl(dir: &Path, args: &[&str]) {
    run_ok(Command::new("openssl").current_dir(dir).args(args));
}

/// A CA in `dir` (ca-cert.pem, ca-key.pem).
fn make_ca(dir: &Path, name: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let subject = format!("/CN={name}");
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca-key.pem",
            "-out",
            "ca-cert.pem",
            "-days",
            "2",
            "-subj",
            &subject,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

/// `prefix`-cert.pem and `prefix`-key.pem in `dir`, for `subject`, signed by the CA in `ca`
/// with `extensions` (an openssl extension file's lines).
fn make_certificate(dir: &Path, ca: &Path, prefix: &str, subject: &str, extensions: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let (key, csr, cert, ext) =
        (format!("{prefix}-key.pem"), format!("{prefix}.csr"), format!("{prefix}-cert.pem"), format!("{prefix}.ext"));
    std::fs::write(dir.join(&ext), extensions).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            subject,
        ],
    );
    let (ca_cert, ca_key) = (ca.join("ca-cert.pem"), ca.join("ca-key.pem"));
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            ca_cert.to_str().unwrap(),
            "-CAkey",
            ca_key.to_str().unwrap(),
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
}

/// Certificate directories, in nbdkit's and libnbd's layouts.
struct Certificates {
    /// The server's: ca-cert.pem, server-cert.pem, server-key.pem.
    server: PathBuf,
    /// A client's with a certificate: ca-cert.pem, client-cert.pem, client-key.pem.
    client: PathBuf,
    /// A client's without one: ca-cert.pem only.
    anonymous: PathBuf,
    /// A client that trusts another CA: its ca-cert.pem only.
    other_ca: PathBuf,
}

fn certificates(s: &Scratch) -> Certificates {
    let ca = s.path("ca");
    make_ca(&ca, "zdisk test CA");
    let server = s.path("server-pki");
    make_certificate(
        &server,
        &ca,
        "server",
        "/CN=localhost",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n",
    );
    let client = s.path("client-pki");
    make_certificate(
        &client,
        &ca,
        "client",
        "/CN=zdisk test client",
        "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n",
    );
    let anonymous = s.path("anonymous-pki");
    std::fs::create_dir_all(&anonymous).unwrap();
    for dir in [&server, &client, &anonymous] {
        std::fs::copy(ca.join("ca-cert.pem"), dir.join("ca-cert.pem")).unwrap();
    }
    let other_ca = s.path("other-ca");
    make_ca(&other_ca, "another CA");
    std::fs::remove_file(other_ca.join("ca-key.pem")).unwrap();
    Certificates { server, client, anonymous, other_ca }
}

/// A PSK file of `identity:hexkey` lines, as psktool writes it.
fn psk_file(s: &Scratch, name: &str, entries: &[(&str, &str)]) -> PathBuf {
    let path = s.path(name);
    let text: String = entries.iter().map(|(identity, key)| format!("{identity}:{key}\n")).collect();
    std::fs::write(&path, text).unwrap();
    path
}

const ALICE_KEY: &str = "c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00";
const WRONG_KEY: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// `nbds+unix://[user@]/?socket=SOCKET&QUERY`.
fn tls_unix_uri(server: &Server, user: Option<&str>, query: &str) -> String {
    let user = user.map(|u| format!("{u}@")).unwrap_or_default();
    format!("nbds+unix://{user}/?socket={}&{query}", server.socket.display())
}

fn plain_unix_uri(server: &Server) -> String {
    format!("nbd+unix:///?socket={}", server.socket.display())
}

/// Whether `nbdinfo URI` succeeds (the server answered the handshake, over TLS or not).
fn nbdinfo_works(uri: &str) -> bool {
    let output = Command::new("nbdinfo").arg(uri).output().expect("running nbdinfo");
    output.status.success()
}

/// Copies `source` into the export at `uri` and back, and compares.
fn round_trip(s: &Scratch, uri: &str, source: &Path, what: &str) {
    run_ok(Command::new("nbdcopy").arg("--flush").arg(source).arg(uri));
    let back = s.path(&format!("{what}.back"));
    let _ = std::fs::remove_file(&back);
    run_ok(Command::new("nbdcopy").arg(uri).arg(&back));
    let length = std::fs::metadata(source).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&back).unwrap().set_len(length).unwrap();
    assert_eq!(sha256(&back), sha256(source), "{what}: the bytes read back differ");
}

/// 8 MiB of compressible, non-repeating text.
fn sample(s: &Scratch) -> PathBuf {
    let path = s.path("sample.bin");
    let text: String = (0..200_000u32).map(|i| format!("line {i:08} of the zdisk TLS sample {}\n", i * 7919)).collect();
    std::fs::write(&path, &text.as_bytes()[..8 << 20]).unwrap();
    path
}

/// `zdisk serve` on 127.0.0.1 (the shared `Server` listens on a Unix socket); SIGTERMed on drop.
struct TcpServer {
    child: Child,
    port: u16,
}

impl TcpServer {
    fn start(s: &Scratch, store: &Path, extra: &[&str]) -> TcpServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut child = s
            .zdisk()
            .env("ZDISK_PLUGIN", common::plugin())
            .arg("serve")
            .arg(store)
            .arg("--tcp")
            .arg(format!("127.0.0.1:{port}"))
            .args(["--frontend", common::frontend()])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting zdisk serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).expect("reading the URI");
        assert!(!line.trim().is_empty(), "zdisk serve --tcp failed to start; its stderr is above");
        TcpServer { child, port }
    }

    fn stop(mut self) {
        common::signal(self.child.id(), libc::SIGTERM);
        let status = wait_timeout(&mut self.child, Duration::from_secs(60));
        assert!(status.success(), "zdisk serve did not stop cleanly: {status}");
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        common::signal(self.child.id(), libc::SIGTERM);
        let _ = wait_timeout(&mut self.child, Duration::from_secs(60));
    }
}

#[test]
fn x509_required_serves_tls_clients_and_refuses_plain_ones() {
    if !require(TOOLS) {
        return;
    }
    let s = Scratch::new("tls-x509");
    let pki = certificates(&s);
    let store = s.format("s.zdisk", "32M", "64M", &[]);
    let source = sample(&s);
    let server_dir = pki.server.to_str().unwrap();

    let server = Server::start(&s, &store, &["--tls", "require", "--tls-certificates", server_dir]);
    let uri = tls_unix_uri(&server, None, &format!("tls-certificates={}", pki.anonymous.display()));
    round_trip(&s, &uri, &source, "unix");
    assert!(!nbdinfo_works(&plain_unix_uri(&server)), "a plain client was served under --tls require");
    server.stop();

    // Over TCP the client also checks the server's certificate: its CA, and 127.0.0.1 in it.
    let server = TcpServer::start(&s, &store, &["--tls=require", &format!("--tls-certificates={server_dir}")]);
    let uri = format!("nbds://127.0.0.1:{}/?tls-certificates={}", server.port, pki.anonymous.display());
    let back = s.path("tcp.back");
    run_ok(Command::new("nbdcopy").arg(&uri).arg(&back));
    std::fs::OpenOptions::new().write(true).open(&back).unwrap().set_len(8 << 20).unwrap();
    assert_eq!(sha256(&back), sha256(&source), "TCP: the bytes read back differ");
    let other = format!("nbds://127.0.0.1:{}/?tls-certificates={}", server.port, pki.other_ca.display());
    assert!(!nbdinfo_works(&other), "a client trusting another CA accepted the server");
    assert!(!nbdinfo_works(&format!("nbd://127.0.0.1:{}/", server.port)), "a plain TCP client was served");
    server.stop();
}

#[test]
fn x509_verify_peer_admits_only_clients_with_a_certificate_from_the_ca() {
    if !require(TOOLS) {
        return;
    }
    let s = Scratch::new("tls-verify");
    let pki = certificates(&s);
    let store = s.format("s.zdisk", "32M", "64M", &[]);
    let server_dir = pki.server.to_str().unwrap();
    let server =
        Server::start(&s, &store, &["--tls", "require", "--tls-certificates", server_dir, "--tls-verify-peer"]);
    let with_certificate = tls_unix_uri(&server, None, &format!("tls-certificates={}", pki.client.display()));
    round_trip(&s, &with_certificate, &sample(&s), "verified");
    let without = tls_unix_uri(&server, None, &format!("tls-certificates={}", pki.anonymous.display()));
    assert!(!nbdinfo_works(&without), "a client without a certificate was served under --tls-verify-peer");
    server.stop();
}

#[test]
fn psk_required_admits_a_listed_identity_with_its_key_only() {
    if !require(TOOLS) {
        return;
    }
    let s = Scratch::new("tls-psk");
    let keys = psk_file(&s, "keys.psk", &[("alice", ALICE_KEY), ("bob", WRONG_KEY)]);
    let wrong = psk_file(&s, "wrong.psk", &[("alice", WRONG_KEY)]);
    let store = s.format("s.zdisk", "32M", "64M", &[]);
    let server = Server::start(&s, &store, &["--tls", "require", "--tls-psk", keys.to_str().unwrap()]);
    let uri = tls_unix_uri(&server, Some("alice"), &format!("tls-psk-file={}", keys.display()));
    round_trip(&s, &uri, &sample(&s), "psk");
    let wrong_key = tls_unix_uri(&server, Some("alice"), &format!("tls-psk-file={}", wrong.display()));
    assert!(!nbdinfo_works(&wrong_key), "alice was served with a wrong key");
    assert!(!nbdinfo_works(&plain_unix_uri(&server)), "a plain client was served under --tls require");
    server.stop();
}

#[test]
fn tls_on_serves_plain_and_tls_clients_alike() {
    if !require(TOOLS) {
        return;
    }
    let s = Scratch::new("tls-on");
    let keys = psk_file(&s, "keys.psk", &[("alice", ALICE_KEY)]);
    let store = s.format("s.zdisk", "32M", "64M", &[]);
    let source = sample(&s);
    let server = Server::start(&s, &store, &["--tls", "on", "--tls-psk", keys.to_str().unwrap()]);
    // Written in plain text, read back over TLS (and the other way), through one server.
    round_trip(&s, &plain_unix_uri(&server), &source, "plain");
    let tls = tls_unix_uri(&server, Some("alice"), &format!("tls-psk-file={}", keys.display()));
    let back = s.path("tls.back");
    run_ok(Command::new("nbdcopy").arg(&tls).arg(&back));
    std::fs::OpenOptions::new().write(true).open(&back).unwrap().set_len(8 << 20).unwrap();
    assert_eq!(sha256(&back), sha256(&source), "read over TLS what was written in plain text");
    round_trip(&s, &tls, &source, "tls");
    server.stop();
}

/// On one connection (argv[1]), rounds of 32 requests in flight at once on disjoint ranges of
/// 8 MiB: random writes, then reads of the same ranges, each checked against a model; then
/// a flush and the whole range read back. Seeded by argv[2].
const MANY_IN_FLIGHT: &str = "import nbd, random, sys
h = nbd.NBD()
h.set_uri_allow_local_file(True)
h.connect_uri(sys.argv[1])
rng = random.Random(int(sys.argv[2]))
SLOT, SLOTS = 256 << 10, 32
model = bytearray(SLOT * SLOTS)
def wait(cookies):
    while cookies:
        h.poll(-1)
        cookies = [c for c in cookies if not h.aio_command_completed(c)]
for r in range(24):
    ranges = []
    for slot in range(SLOTS):
        length = rng.randint(1, SLOT // 2)
        ranges.append((slot * SLOT + rng.randrange(0, SLOT - length), length))
    cookies = []
    for offset, length in ranges:
        data = rng.randbytes(length)
        model[offset:offset + length] = data
        cookies.append(h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(data)), offset))
    wait(cookies)
    reads = [(offset, length, nbd.Buffer(length)) for offset, length in ranges]
    wait([h.aio_pread(buf, offset) for offset, length, buf in reads])
    for offset, length, buf in reads:
        if buf.to_bytearray() != model[offset:offset + length]:
            sys.exit(f'round {r}: {length} bytes at {offset} read back wrong')
h.flush()
if h.pread(len(model), 0) != model:
    sys.exit('the whole range read back wrong')
print('ok')";

#[test]
fn many_requests_in_flight_on_one_tls_connection_each_get_their_own_reply() {
    if !require(TOOLS) || !common::require_libnbd_python() {
        return;
    }
    let s = Scratch::new("tls-depth");
    let keys = psk_file(&s, "keys.psk", &[("alice", ALICE_KEY)]);
    let store = s.format("s.zdisk", "64M", "64M", &[]);
    let server = Server::start(&s, &store, &["--tls", "require", "--tls-psk", keys.to_str().unwrap()]);
    let uri = tls_unix_uri(&server, Some("alice"), &format!("tls-psk-file={}", keys.display()));
    let seed = rand::random::<u32>().to_string();
    let output = Command::new(common::LIBNBD_PYTHON).args(["-c", MANY_IN_FLIGHT, &uri, &seed]).output().unwrap();
    common::assert_success(&output, &format!("32 requests in flight over TLS (seed {seed})"));
    server.stop();
}

/// Connects to the URI given as argv[1] with libnbd, says so, and keeps the connection.
const HOLD_CONNECTION: &str = "import nbd, sys, time
h = nbd.NBD()
h.set_uri_allow_local_file(True)
h.connect_uri(sys.argv[1])
print('connected', flush=True)
time.sleep(120)";

#[test]
fn a_tls_client_that_stays_connected_does_not_hold_the_stop() {
    if !require(TOOLS) || !common::require_libnbd_python() {
        return;
    }
    let s = Scratch::new("tls-stop");
    let keys = psk_file(&s, "keys.psk", &[("alice", ALICE_KEY)]);
    let store = s.format("s.zdisk", "32M", "64M", &[]);
    // nbdkit cannot close a connection its client keeps: zdisk kills it after the grace.
    let server = Server::start(
        &s,
        &store,
        &["--tls", "require", "--tls-psk", keys.to_str().unwrap(), "--stop-grace-seconds", "2"],
    );
    let uri = tls_unix_uri(&server, Some("alice"), &format!("tls-psk-file={}", keys.display()));
    let mut holder = Command::new(common::LIBNBD_PYTHON)
        .args(["-c", HOLD_CONNECTION, &uri])
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting python3 with libnbd");
    let mut line = String::new();
    BufReader::new(holder.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "connected", "the TLS client did not connect");
    let started = std::time::Instant::now();
    server.stop();
    let limit = if common::frontend() == "native" { 5 } else { 15 };
    assert!(started.elapsed() < Duration::from_secs(limit), "the stop took {:?}", started.elapsed());
    let _ = holder.kill();
    let _ = holder.wait();
}

#[test]
fn tls_options_without_what_they_need_are_usage_errors() {
    if !require(&["nbdkit"]) {
        return;
    }
    let s = Scratch::new("tls-usage");
    let store = s.format("s.zdisk", "32M", "64M", &[]);
    let keys = psk_file(&s, "keys.psk", &[("alice", ALICE_KEY)]);
    let (store, keys, socket) = (store.to_str().unwrap(), keys.to_str().unwrap(), s.path("x.sock"));
    let socket = socket.to_str().unwrap();
    let frontend = common::frontend();
    let serve = |extra: &[&str]| -> Vec<String> {
        let args = ["serve", store, "--unix", socket, "--frontend", frontend].into_iter().chain(extra.iter().copied());
        args.map(str::to_owned).collect()
    };
    for (extra, says) in [
        (&["--tls", "require"][..], "--tls-certificates"),
        (&["--tls", "on"], "--tls-certificates"),
        (&["--tls-psk", keys], "need --tls on or --tls require"),
        (&["--tls", "require", "--tls-psk", keys, "--tls-certificates", "/tmp"], "cannot be used with"),
        (&["--tls", "require", "--tls-psk", keys, "--tls-verify-peer"], "--tls-certificates"),
        (&["--tls", "require", "--tls-psk", "/nonexistent/keys.psk"], "/nonexistent/keys.psk: not a file"),
        (&["--tls", "sometimes"], "invalid value 'sometimes'"),
    ] {
        let args = serve(extra);
        common::refused(&s, &args.iter().map(String::as_str).collect::<Vec<_>>(), 2, says);
    }
    // Files that exist but cannot serve: the native server names the file and what is wrong,
    // before it opens the store. (nbdkit reads a PSK file only when a client comes: it would
    // start, so it is not asked here.)
    if frontend != "native" {
        return;
    }
    let empty = s.path("empty-pki");
    std::fs::create_dir_all(&empty).unwrap();
    let bad_psk = psk_file(&s, "bad.psk", &[("alice", "not-hex")]);
    for (extra, says) in [
        (["--tls", "require", "--tls-certificates", empty.to_str().unwrap()], "server-cert.pem: cannot read"),
        (
            ["--tls", "require", "--tls-psk", bad_psk.to_str().unwrap()],
            "bad.psk: line 1: the key of \"alice\" is not hex",
        ),
    ] {
        let args = serve(&extra);
        common::refused(&s, &args.iter().map(String::as_str).collect::<Vec<_>>(), 1, says);
    }
}

/// The same tests against `zdisk serve --frontend nbdkit`.
mod through_nbdkit {
    macro_rules! through_nbdkit {
        ($($name:ident),* $(,)?) => {
            $(
                #[test]
                fn $name() {
                    crate::common::with_frontend("nbdkit", super::$name);
                }
            )*
        };
    }

    through_nbdkit!(
        x509_required_serves_tls_clients_and_refuses_plain_ones,
        x509_verify_peer_admits_only_clients_with_a_certificate_from_the_ca,
        psk_required_admits_a_listed_identity_with_its_key_only,
        tls_on_serves_plain_and_tls_clients_alike,
        many_requests_in_flight_on_one_tls_connection_each_get_their_own_reply,
        a_tls_client_that_stays_connected_does_not_hold_the_stop,
        tls_options_without_what_they_need_are_usage_errors,
    );
}
