//! zdisk's NBD front ends' shared parts and its own NBD server.
//!
//! - `proto`, `handshake`: the wire protocol as pure synchronous code over bytes and
//!   blocking streams;
//! - `server`: zdisk's own server, a few event loops over the engine's asynchronous reads
//!   (`zdisk_engine::ReadQueue`), the default front end of `zdisk serve`;
//! - `tls`: the server's TLS credentials (X.509 or PSK, nbdkit's files) over OpenSSL;
//! - `service`, `metrics`: what every front end runs beside the store (live stats file,
//!   control socket, metrics endpoint), used by the server here and the nbdkit plugin.
//!
//! Spec: the NBD protocol, `doc/proto.md` of github.com/NetworkBlockDevice/nbd. Every integer
//! on the wire is big-endian.

pub mod handshake;
pub mod metrics;
pub mod proto;
pub mod server;
pub mod service;
pub mod tls;
