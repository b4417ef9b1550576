//! A minimal NBD client for tests: fixed-newstyle handshake, NBD_OPT_GO, simple replies,
//! one request in flight — or many sent at once (`pipeline`). Enough to send requests
//! nbdkit's own clients never send (zero length, unaligned, past the end) and to check the
//! server's answer to each.

use std::collections::HashMap;

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
const IHAVEOPT: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const INFO_EXPORT: u16 = 0;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;

pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// One request of a `pipeline`.
#[derive(Clone, Copy)]
pub struct Pipelined<'a> {
    pub command: u16,
    pub flags: u16,
    pub offset: u64,
    pub length: u32,
    pub payload: &'a [u8],
}

pub struct NbdClient {
    stream: UnixStream,
    pub size: u64,
    pub transmission_flags: u16,
    next_handle: u64,
}

fn read_u16(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}
fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}
fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn protocol_error(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

impl NbdClient {
    pub fn connect(socket: &Path) -> io::Result<NbdClient> {
        let mut stream = UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        if read_u64(&mut stream)? != NBDMAGIC || read_u64(&mut stream)? != IHAVEOPT {
            return Err(protocol_error("not a newstyle NBD server".into()));
        }
        let server_flags = read_u16(&mut stream)?;
        if server_flags & FLAG_FIXED_NEWSTYLE == 0 {
            return Err(protocol_error("server is not fixed-newstyle".into()));
        }
        let client_flags = u32::from(server_flags & (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
        stream.write_all(&client_flags.to_be_bytes())?;

        // NBD_OPT_GO with the default export name and no info requests.
        let mut option = Vec::new();
        option.extend_from_slice(&IHAVEOPT.to_be_bytes());
        option.extend_from_slice(&OPT_GO.to_be_bytes());
        option.extend_from_slice(&6u32.to_be_bytes()); // name length (4) + info count (2)
        option.extend_from_slice(&0u32.to_be_bytes());
        option.extend_from_slice(&0u16.to_be_bytes());
        stream.write_all(&option)?;

        let mut size = None;
        let mut transmission_flags = 0;
        loop {
            if read_u64(&mut stream)? != OPT_REPLY_MAGIC {
                return Err(protocol_error("bad option reply magic".into()));
            }
            let _option = read_u32(&mut stream)?;
            let reply = read_u32(&mut stream)?;
            let length = read_u32(&mut stream)? as usize;
            let mut data = vec![0u8; length];
            stream.read_exact(&mut data)?;
            if reply & 0x8000_0000 != 0 {
                return Err(protocol_error(format!(
                    "NBD_OPT_GO refused ({reply:#x}): {}",
                    String::from_utf8_lossy(&data)
                )));
            }
            match reply {
                REP_INFO if length >= 12 && u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT => {
                    size = Some(u64::from_be_bytes(data[2..10].try_into().unwrap()));
                    transmission_flags = u16::from_be_bytes([data[10], data[11]]);
                }
                REP_ACK => break,
                _ => {}
            }
        }
        let size = size.ok_or_else(|| protocol_error("no NBD_INFO_EXPORT in the reply".into()))?;
        Ok(NbdClient { stream, size, transmission_flags, next_handle: 1 })
    }

    /// Sends one request and returns the server's error code (0 = success). For reads the
    /// data lands in `read_into` (which must be `length` bytes).
    pub fn request(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
        read_into: Option<&mut [u8]>,
    ) -> io::Result<u32> {
        let handle = self.next_handle;
        self.next_handle += 1;
        let mut header = Vec::with_capacity(28 + payload.len());
        header.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        header.extend_from_slice(&flags.to_be_bytes());
        header.extend_from_slice(&command.to_be_bytes());
        header.extend_from_slice(&handle.to_be_bytes());
        header.extend_from_slice(&offset.to_be_bytes());
        header.extend_from_slice(&length.to_be_bytes());
        header.extend_from_slice(payload);
        self.stream.write_all(&header)?;
        if command == CMD_DISC {
            return Ok(0);
        }
        if read_u32(&mut self.stream)? != SIMPLE_REPLY_MAGIC {
            return Err(protocol_error("bad reply magic".into()));
        }
        let error = read_u32(&mut self.stream)?;
        let reply_handle = read_u64(&mut self.stream)?;
        if reply_handle != handle {
            return Err(protocol_error(format!("reply for handle {reply_handle}, expected {handle}")));
        }
        if command == CMD_READ && error == 0 {
            match read_into {
                Some(buf) => self.stream.read_exact(buf)?,
                None => {
                    let mut sink = vec![0u8; length as usize];
                    self.stream.read_exact(&mut sink)?;
                }
            }
        }
        Ok(error)
    }

    /// Sends every request in one write, as a pipelining client does, then takes their
    /// replies in whatever order they come, and returns each request's error code in the
    /// order of `requests`. No reads (their replies carry data). A reply with a cookie that
    /// names no request, or one already answered, is an error.
    pub fn pipeline(&mut self, requests: &[Pipelined<'_>]) -> io::Result<Vec<u32>> {
        assert!(requests.iter().all(|r| r.command != CMD_READ && r.command != CMD_DISC), "no reads or goodbyes");
        let first = self.next_handle;
        let mut bytes = Vec::new();
        for request in requests {
            bytes.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
            bytes.extend_from_slice(&request.flags.to_be_bytes());
            bytes.extend_from_slice(&request.command.to_be_bytes());
            bytes.extend_from_slice(&self.next_handle.to_be_bytes());
            bytes.extend_from_slice(&request.offset.to_be_bytes());
            bytes.extend_from_slice(&request.length.to_be_bytes());
            bytes.extend_from_slice(request.payload);
            self.next_handle += 1;
        }
        self.stream.write_all(&bytes)?;
        let mut errors: HashMap<u64, u32> = HashMap::new();
        while errors.len() < requests.len() {
            if read_u32(&mut self.stream)? != SIMPLE_REPLY_MAGIC {
                return Err(protocol_error("bad reply magic".into()));
            }
            let error = read_u32(&mut self.stream)?;
            let handle = read_u64(&mut self.stream)?;
            if !(first..self.next_handle).contains(&handle) {
                return Err(protocol_error(format!("a reply for handle {handle}, which names no request")));
            }
            if errors.insert(handle, error).is_some() {
                return Err(protocol_error(format!("a second reply for handle {handle}")));
            }
        }
        Ok((first..self.next_handle).map(|handle| errors[&handle]).collect())
    }

    /// Sends bytes as they are (malformed requests, for the bad-input tests).
    pub fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Whether the server closed the connection within `timeout` (reads to the end of the
    /// stream, discarding anything it still sends; a reset counts as closed).
    pub fn closed_by_server_within(&mut self, timeout: Duration) -> bool {
        let _ = self.stream.set_read_timeout(Some(timeout));
        let mut sink = Vec::new();
        match self.stream.read_to_end(&mut sink) {
            Ok(_) => true,
            Err(e) => matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe),
        }
    }

    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<u32> {
        let length = buf.len() as u32;
        self.request(CMD_READ, 0, offset, length, &[], Some(buf))
    }

    pub fn write(&mut self, offset: u64, data: &[u8], flags: u16) -> io::Result<u32> {
        self.request(CMD_WRITE, flags, offset, data.len() as u32, data, None)
    }

    pub fn flush(&mut self) -> io::Result<u32> {
        self.request(CMD_FLUSH, 0, 0, 0, &[], None)
    }

    pub fn trim(&mut self, offset: u64, length: u32) -> io::Result<u32> {
        self.request(CMD_TRIM, 0, offset, length, &[], None)
    }

    pub fn write_zeroes(&mut self, offset: u64, length: u32, flags: u16) -> io::Result<u32> {
        self.request(CMD_WRITE_ZEROES, flags, offset, length, &[], None)
    }

    /// Reads and asserts success.
    pub fn read_ok(&mut self, offset: u64, length: usize) -> Vec<u8> {
        let mut buf = vec![0u8; length];
        let error = self.read(offset, &mut buf).expect("read I/O");
        assert_eq!(error, 0, "read of {length} bytes at {offset} failed with errno {error}");
        buf
    }

    pub fn write_ok(&mut self, offset: u64, data: &[u8]) {
        let error = self.write(offset, data, 0).expect("write I/O");
        assert_eq!(error, 0, "write of {} bytes at {offset} failed with errno {error}", data.len());
    }

    pub fn disconnect(mut self) {
        let _ = self.request(CMD_DISC, 0, 0, 0, &[], None);
    }
}
