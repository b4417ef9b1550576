#![no_main]
//! `cargo fuzz run handshake`: the fuzz input is everything a client sends; `negotiate` must
//! return (Ok or Err) without panicking.

use std::io::{self, Cursor, Read, Write};

use zdisk_nbd::handshake::{negotiate, Export};
use zdisk_nbd::proto::{DEFAULT_MAX_PAYLOAD_BYTES, FLAG_HAS_FLAGS, FLAG_SEND_DF, FLAG_SEND_FLUSH};

/// Client bytes in; server bytes dropped. End of input is the client closing.
struct MemoryStream(Cursor<Vec<u8>>);

impl Read for MemoryStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for MemoryStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let export = Export {
        name: "disk".into(),
        description: "fuzzed".into(),
        size_bytes: 1 << 30,
        transmission_flags: FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_DF,
        min_block_bytes: 512,
        preferred_block_bytes: 4096,
        max_block_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
    };
    let _ = negotiate(&mut MemoryStream(Cursor::new(data.to_vec())), &export);
});
