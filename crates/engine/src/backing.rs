//! Backing I/O: the four operations the engine needs from a disk, behind a small trait so
//! tests can run the engine on a disk that crashes, tears and lies ([`crate::sim`]).
//!
//! Invariants the engine keeps at this boundary (asserted here): every write and discard
//! offset and length is a multiple of [`SECTOR_SIZE`], every read's a multiple of
//! [`Backing::read_alignment`], and no I/O reaches past `size_bytes()`.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;

use aligned_vec::{AVec, ConstAlign};

use crate::error::{Error, ErrorKind, Result};
use crate::SECTOR_SIZE;

pub trait Backing: Send + Sync {
    fn size_bytes(&self) -> u64;
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// The alignment reads need (a divisor of [`SECTOR_SIZE`]): the device's logical block
    /// size under O_DIRECT. A 2 KiB fragment then costs a 2.5 KiB read, not 4 or 8 KiB.
    fn read_alignment(&self) -> usize {
        SECTOR_SIZE
    }
    /// Reads several ranges, each under `read_at`'s rules. A backing that can have them in
    /// flight together does, so a request whose fragments lie scattered waits about one
    /// device latency instead of one per range.
    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        reads.iter_mut().try_for_each(|(offset, buf)| self.read_at(*offset, buf))
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Makes every completed write durable (fdatasync).
    fn sync(&self) -> io::Result<()>;
    /// Writes `data` and makes it durable before returning (the flush proof): a write and a
    /// sync, or where the backing can, one write-through write (RWF_DSYNC: a FUA write on a
    /// device that has FUA, instead of a flush of its whole cache).
    fn write_durable_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.write_at(offset, data)?;
        self.sync()
    }
    /// Tells the device the range holds nothing worth keeping (hole punch / BLKDISCARD).
    /// Contents read back afterwards are unspecified; the engine never reads them.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;
    /// Has a file's file system allocate the range without writing it (fallocate), so it
    /// cannot run out of room under it later; ENOSPC if it lacks the room. A no-op where
    /// the backing is allocated already (a block device, the simulator).
    fn reserve(&self, offset: u64, len: u64) -> io::Result<()> {
        let _ = (offset, len);
        Ok(())
    }
    /// The file descriptor a caller may read from itself under `read_at`'s rules (a
    /// `ReadQueue` submitting to its own io_uring); None where reads must go through
    /// `read_at` (the simulator).
    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

pub fn assert_aligned(offset: u64, len: usize, size_bytes: u64) {
    assert_aligned_to(offset, len, size_bytes, SECTOR_SIZE);
}

pub fn assert_aligned_to(offset: u64, len: usize, size_bytes: u64, alignment: usize) {
    // Checked in release builds too: a misaligned O_DIRECT I/O fails with EINVAL, and an
    // I/O past the end would read or write what is not ours. Two divisions per I/O.
    assert!(
        offset.is_multiple_of(alignment as u64) && len.is_multiple_of(alignment),
        "unaligned backing I/O: {len} bytes at {offset} (alignment {alignment})"
    );
    assert!(offset.checked_add(len as u64).is_some_and(|end| end <= size_bytes), "backing I/O past the end");
}

type AlignedBuf = AVec<u8, ConstAlign<4096>>;

/// A regular file or block device, opened with O_DIRECT where the file system allows it.
#[derive(Debug)]
pub struct FileBacking {
    file: File,
    size_bytes: u64,
    direct: bool,
    block_device: bool,
    read_alignment: usize,
}

/// The smallest read alignment tried; logical block sizes are at least this.
const MIN_READ_ALIGNMENT: usize = 512;

/// Finds the finest alignment O_DIRECT reads accept on this file (the device's logical
/// block size, or the file system's), by trying a 512-byte read; falls back to
/// [`SECTOR_SIZE`].
fn probe_read_alignment(file: &File, size_bytes: u64) -> usize {
    if size_bytes < 2 * MIN_READ_ALIGNMENT as u64 {
        return SECTOR_SIZE;
    }
    let mut probe: AlignedBuf = AVec::new(4096);
    probe.resize(MIN_READ_ALIGNMENT, 0);
    match file.read_exact_at(&mut probe[..], MIN_READ_ALIGNMENT as u64) {
        Ok(()) => MIN_READ_ALIGNMENT,
        Err(_) => SECTOR_SIZE,
    }
}

thread_local! {
    static BOUNCE: std::cell::RefCell<AlignedBuf> = std::cell::RefCell::new(AVec::new(4096));
    /// Each thread that reads scattered ranges gets its own ring, so submitting never
    /// waits for another thread (nbdkit serves each request on one worker thread).
    static RING: std::cell::RefCell<RingState> = const { std::cell::RefCell::new(RingState::Untried) };
}

/// Ranges one ring submission carries; a 128 KiB request needs at most 32.
const RING_ENTRIES: u32 = 64;

enum RingState {
    Untried,
    /// io_uring is not available here (old kernel, seccomp, disabled by sysctl): `pread`.
    Unavailable,
    Ready(Box<io_uring::IoUring>),
}

/// The ring failed before taking any read: nothing was read and nothing is in flight.
struct Broken(io::Error);
type RingResult = Result<io::Result<()>, Broken>;

/// Reads `reads` from `file` with every range of a chunk in flight at once: one submission
/// (so one doorbell to the device for the batch) and one wait. `Err(Broken)` means nothing
/// was read and nothing is in flight, and the ring must not be used again.
fn read_on_ring(ring: &mut io_uring::IoUring, file: &File, reads: &mut [(u64, &mut [u8])]) -> RingResult {
    use io_uring::{opcode, types};
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let mut first_error = None;
    for chunk in reads.chunks_mut(RING_ENTRIES as usize) {
        {
            let mut queue = ring.submission();
            assert!(queue.is_empty(), "a ring is left empty between calls");
            for (index, (offset, buf)) in chunk.iter_mut().enumerate() {
                let entry = opcode::Read::new(types::Fd(fd), buf.as_mut_ptr(), buf.len() as u32)
                    .offset(*offset)
                    .build()
                    .user_data(index as u64);
                // SAFETY: the kernel writes into `buf` and reads `fd` until the entry's
                // completion is reaped. `reads` borrows every buffer mutably for this whole
                // call, `fd` belongs to the `FileBacking` borrowed by the caller, and this
                // function returns only once every entry it pushed has completed (below) or
                // was never submitted (the ring is then abandoned, never entered again).
                unsafe { queue.push(&entry) }.expect("the ring has room for a whole chunk");
            }
        }
        let mut reaped = 0;
        let mut short = Vec::new();
        while reaped < chunk.len() {
            if let Err(e) = ring.submit_and_wait(chunk.len() - reaped) {
                let retry = matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY));
                if !retry {
                    if reaped == 0 && ring.submission().len() == chunk.len() {
                        return Err(Broken(e));
                    }
                    // Some reads are in flight into the caller's buffers: returning now would
                    // let the device write into memory that is no longer theirs.
                    panic!("io_uring wait failed with reads in flight: {e}");
                }
            }
            for completion in ring.completion() {
                reaped += 1;
                let index = completion.user_data() as usize;
                match usize::try_from(completion.result()) {
                    Ok(n) if n == chunk[index].1.len() => {}
                    // Short reads happen only at the end of a file; `read_exact_at` retries
                    // and reports what is wrong.
                    Ok(_) => short.push(index),
                    Err(_) => {
                        first_error.get_or_insert_with(|| io::Error::from_raw_os_error(-completion.result()));
                    }
                }
            }
        }
        for index in short {
            let (offset, buf) = &mut chunk[index];
            if let Err(e) = file.read_exact_at(buf, *offset) {
                first_error.get_or_insert(e);
            }
        }
    }
    Ok(first_error.map_or(Ok(()), Err))
}

/// How a backing store is opened: the one description every opener passes to [`open`].
#[derive(Debug, Clone, Copy)]
pub struct BackingOptions {
    pub access: Access,
    /// Ask for O_DIRECT; falls back to buffered I/O where the file system refuses it (tmpfs).
    pub direct_io: bool,
    pub lock: Lock,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    ReadOnly,
    ReadWrite,
}

/// The advisory lock (`flock`) taken on the backing store while it is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lock {
    /// None: reading the superblock of a store another process serves.
    None,
    /// Shared: read-only openers.
    Shared,
    /// Exclusive: the one writer.
    Exclusive,
}

/// Opens a file or block device for the engine: the one place a disk is opened. Fails with
/// `Locked` if the lock asked for is held by another process.
pub fn open(path: &Path, options: &BackingOptions) -> Result<FileBacking> {
    if path.is_dir() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("{} is a directory: a store is a file or a block device", path.display()),
        ));
    }
    let writable = options.access == Access::ReadWrite;
    let open_file = |direct: bool| {
        let mut file_options = OpenOptions::new();
        file_options.read(true).write(writable);
        if direct {
            file_options.custom_flags(libc::O_DIRECT);
        }
        file_options.open(path)
    };
    let (file, direct) = match open_file(options.direct_io) {
        Ok(file) => (file, options.direct_io),
        Err(e) if options.direct_io && e.raw_os_error() == Some(libc::EINVAL) => {
            (open_file(false).map_err(|e| Error::io(format!("open {}", path.display()), e))?, false)
        }
        Err(e) => return Err(Error::io(format!("open {}", path.display()), e)),
    };
    let locked = match options.lock {
        Lock::None => Ok(()),
        Lock::Shared => file.try_lock_shared(),
        Lock::Exclusive => file.try_lock(),
    };
    if let Err(e) = locked {
        return Err(match e {
            std::fs::TryLockError::WouldBlock => Error::new(
                ErrorKind::Locked,
                format!("{} is open in another process (is it being served?)", path.display()),
            ),
            std::fs::TryLockError::Error(e) => Error::io(format!("lock {}", path.display()), e),
        });
    }
    let metadata = file.metadata().map_err(|e| Error::io(format!("stat {}", path.display()), e))?;
    let block_device = metadata.file_type().is_block_device();
    let size_bytes = if block_device {
        use std::io::{Seek, SeekFrom};
        (&file).seek(SeekFrom::End(0)).map_err(|e| Error::io(format!("size of {}", path.display()), e))?
    } else {
        metadata.len()
    };
    let read_alignment = if direct { probe_read_alignment(&file, size_bytes) } else { MIN_READ_ALIGNMENT };
    Ok(FileBacking { file, size_bytes, direct, block_device, read_alignment })
}

/// Whether another process holds the store's lock in a way that excludes `lock` (for
/// example: it is being served). The probe's own lock is dropped before this returns.
pub fn is_locked(path: &Path, lock: Lock) -> Result<bool> {
    match open(path, &BackingOptions { access: Access::ReadOnly, direct_io: false, lock }) {
        Ok(_) => Ok(false),
        Err(e) if e.kind() == ErrorKind::Locked => Ok(true),
        Err(e) => Err(e),
    }
}

impl FileBacking {
    fn needs_bounce(&self, ptr: *const u8) -> bool {
        self.direct && !(ptr as usize).is_multiple_of(SECTOR_SIZE)
    }
}

impl Backing for FileBacking {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        assert_aligned_to(offset, buf.len(), self.size_bytes, self.read_alignment);
        if !self.needs_bounce(buf.as_ptr()) {
            return self.file.read_exact_at(buf, offset);
        }
        BOUNCE.with(|bounce| {
            let mut bounce = bounce.borrow_mut();
            bounce.resize(buf.len(), 0);
            self.file.read_exact_at(&mut bounce[..], offset)?;
            buf.copy_from_slice(&bounce[..]);
            Ok(())
        })
    }

    fn read_alignment(&self) -> usize {
        self.read_alignment
    }

    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        Some(self.file.as_raw_fd())
    }

    fn read_many(&self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let one_by_one =
            |reads: &mut [(u64, &mut [u8])]| reads.iter_mut().try_for_each(|(offset, buf)| self.read_at(*offset, buf));
        if reads.len() < 2 || reads.iter().any(|(_, buf)| self.needs_bounce(buf.as_ptr())) {
            return one_by_one(reads);
        }
        for (offset, buf) in reads.iter() {
            assert_aligned_to(*offset, buf.len(), self.size_bytes, self.read_alignment);
        }
        let on_ring = RING.with(|state| {
            let mut state = state.borrow_mut();
            if let RingState::Untried = *state {
                *state = match io_uring::IoUring::new(RING_ENTRIES) {
                    Ok(ring) => RingState::Ready(Box::new(ring)),
                    Err(e) => {
                        tracing::info!("io_uring is unavailable ({e}): scattered reads go one at a time");
                        RingState::Unavailable
                    }
                };
            }
            let RingState::Ready(ring) = &mut *state else {
                return None;
            };
            let result = read_on_ring(ring, &self.file, reads);
            if let Err(Broken(e)) = &result {
                tracing::warn!("io_uring submission failed ({e}): scattered reads go one at a time");
                // Entries never submitted die with the ring: nothing enters it again.
                *state = RingState::Unavailable;
            }
            Some(result)
        });
        match on_ring {
            Some(Ok(result)) => result,
            None | Some(Err(Broken(_))) => one_by_one(reads),
        }
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        assert_aligned(offset, data.len(), self.size_bytes);
        if !self.needs_bounce(data.as_ptr()) {
            return self.file.write_all_at(data, offset);
        }
        BOUNCE.with(|bounce| {
            let mut bounce = bounce.borrow_mut();
            bounce.clear();
            bounce.extend_from_slice(data);
            self.file.write_all_at(&bounce[..], offset)
        })
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn write_durable_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        assert_aligned(offset, data.len(), self.size_bytes);
        if self.needs_bounce(data.as_ptr()) {
            self.write_at(offset, data)?;
            return self.sync();
        }
        let slices = [io::IoSlice::new(data)];
        match rustix::io::pwritev2(&self.file, &slices, offset, rustix::io::ReadWriteFlags::DSYNC) {
            Ok(n) if n == data.len() => Ok(()),
            // Short, or refused (a kernel or file system without RWF_DSYNC): the slow way.
            Ok(_) | Err(rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS) => {
                self.write_at(offset, data)?;
                self.sync()
            }
            Err(e) => Err(e.into()),
        }
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        assert_aligned(offset, len as usize, self.size_bytes);
        if self.block_device {
            const BLKDISCARD: libc::c_ulong = 0x1277;
            let range: [u64; 2] = [offset, len];
            use std::os::fd::AsRawFd;
            // SAFETY: BLKDISCARD reads exactly two u64 (start, length) from the pointer,
            // which points at a live local array for the duration of the call.
            let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), BLKDISCARD, range.as_ptr()) };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        } else {
            use rustix::fs::{fallocate, FallocateFlags};
            match fallocate(&self.file, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, len) {
                Ok(()) => Ok(()),
                // File systems without hole punching: discard is advisory, keep going.
                Err(e) if e == rustix::io::Errno::OPNOTSUPP => Ok(()),
                Err(e) => Err(e.into()),
            }
        }
    }

    fn reserve(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.block_device {
            return Ok(());
        }
        use rustix::fs::{fallocate, FallocateFlags};
        match fallocate(&self.file, FallocateFlags::KEEP_SIZE, offset, len) {
            Ok(()) => Ok(()),
            // A file system that cannot reserve: the store stays as sparse as it was.
            Err(e) if e == rustix::io::Errno::OPNOTSUPP => {
                tracing::warn!("the backing's file system cannot reserve space (fallocate); the store stays sparse");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a real file (O_DIRECT where the file system allows it) the probed read alignment
    /// is one a read really accepts, and a read at that alignment returns what was written.
    #[test]
    fn reads_work_at_the_probed_alignment() {
        // /var/tmp is usually on a disk (O_DIRECT works there); /tmp may be tmpfs.
        let dir = tempfile::tempdir_in("/var/tmp").unwrap_or_else(|_| tempfile::tempdir().unwrap());
        let path = dir.path().join("backing");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let backing =
            open(&path, &BackingOptions { access: Access::ReadWrite, direct_io: true, lock: Lock::Exclusive }).unwrap();
        let alignment = backing.read_alignment();
        assert!(alignment == MIN_READ_ALIGNMENT || alignment == SECTOR_SIZE, "alignment {alignment}");
        let mut block: AlignedBuf = AVec::new(4096);
        let pattern: Vec<u8> = (0..SECTOR_SIZE).map(|i| (i % 251) as u8).collect();
        block.extend_from_slice(&pattern);
        backing.write_at(8192, &block).unwrap();
        let mut back: AlignedBuf = AVec::new(4096);
        back.resize(alignment, 0);
        backing.read_at(8192 + (SECTOR_SIZE - alignment) as u64, &mut back).unwrap();
        assert_eq!(back[..], block[SECTOR_SIZE - alignment..]);
    }

    /// `read_many` returns what `read_at` does for every range: over more ranges than one
    /// ring submission carries, of mixed lengths, adjacent and overlapping, both on the
    /// ring and on a thread where io_uring is unavailable.
    #[test]
    fn read_many_matches_read_at_on_and_off_the_ring() {
        use rand::{Rng, SeedableRng};
        let dir = tempfile::tempdir_in("/var/tmp").unwrap_or_else(|_| tempfile::tempdir().unwrap());
        let path = dir.path().join("backing");
        let size = 4 << 20;
        let content: Vec<u8> = (0..size).map(|i: usize| (i * 7 + i / 4096) as u8).collect();
        std::fs::write(&path, &content).unwrap();
        let backing =
            open(&path, &BackingOptions { access: Access::ReadWrite, direct_io: true, lock: Lock::Exclusive }).unwrap();
        let alignment = backing.read_alignment();
        let seed: u64 = rand::random();
        println!("seed {seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let ranges: Vec<(u64, usize)> = (0..RING_ENTRIES as usize * 2 + 7)
            .map(|_| {
                let len = rng.gen_range(1..=16) * alignment;
                let offset = rng.gen_range(0..(size - len) / alignment) * alignment;
                (offset as u64, len)
            })
            .collect();
        for ring in [true, false] {
            let ranges = ranges.clone();
            let backing = &backing;
            let content = &content;
            std::thread::scope(|scope| {
                scope.spawn(move || {
                    if !ring {
                        RING.with(|state| *state.borrow_mut() = RingState::Unavailable);
                    }
                    let mut buffers: Vec<AlignedBuf> = ranges
                        .iter()
                        .map(|&(_, len)| {
                            let mut buf = AVec::new(4096);
                            buf.resize(len, 0xAA);
                            buf
                        })
                        .collect();
                    let mut reads: Vec<(u64, &mut [u8])> =
                        ranges.iter().zip(buffers.iter_mut()).map(|(r, b)| (r.0, &mut b[..])).collect();
                    backing.read_many(&mut reads).unwrap();
                    for ((offset, len), buf) in ranges.iter().zip(&buffers) {
                        let at = *offset as usize;
                        assert!(buf[..] == content[at..at + len], "ring {ring}: range at {offset}, {len} bytes");
                    }
                    if ring {
                        let used = RING.with(|state| matches!(*state.borrow(), RingState::Ready(_)));
                        println!("io_uring used: {used}");
                    }
                });
            });
        }
    }
}
