//! A simulated backing store for tests: it keeps what a real disk would have durably and
//! what is only in its volatile cache, and on a simulated power loss keeps a random subset
//! of the un-synced writes, tearing some at sector granularity. It also injects faults on
//! demand: failed reads, writes, syncs, ENOSPC, and bit flips.
//!
//! Everything random comes from a seed, so a failing run replays exactly.

use std::io;

use parking_lot::Mutex;

use crate::backing::{assert_aligned, assert_aligned_to, Backing};
use crate::SECTOR_SIZE;

/// A tiny deterministic generator (SplitMix64): the simulator must not depend on a test
/// crate, and it needs nothing better than this.
#[derive(Debug, Clone)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> SimRng {
        SimRng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Which faults to inject; counts are in backing operations of that type.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Power is lost during the N-th write (1-based): that write is torn, and every later
    /// operation fails until the disk is "rebooted" with [`SimDisk::crash_image`].
    pub crash_at_write: Option<u64>,
    pub fail_read_at: Option<u64>,
    pub fail_write_at: Option<u64>,
    pub fail_sync_at: Option<u64>,
    /// Writes at or after the N-th fail with ENOSPC (a full host file system).
    pub enospc_from_write: Option<u64>,
}

#[derive(Debug)]
struct State {
    /// What reads see (the OS view, cache included).
    current: Vec<u8>,
    /// What survives power loss.
    durable: Vec<u8>,
    /// Un-synced writes in issue order.
    pending: Vec<(u64, Vec<u8>)>,
    faults: Faults,
    reads: u64,
    writes: u64,
    syncs: u64,
    crashed: bool,
    rng: SimRng,
}

#[derive(Debug)]
pub struct SimDisk {
    state: Mutex<State>,
    size_bytes: u64,
}

fn power_lost() -> io::Error {
    io::Error::other("simulated power loss")
}

impl SimDisk {
    pub fn new(size_bytes: u64, seed: u64) -> SimDisk {
        SimDisk::from_image(vec![0; size_bytes as usize], seed)
    }

    pub fn from_image(image: Vec<u8>, seed: u64) -> SimDisk {
        let size_bytes = image.len() as u64;
        SimDisk {
            state: Mutex::new(State {
                current: image.clone(),
                durable: image,
                pending: Vec::new(),
                faults: Faults::default(),
                reads: 0,
                writes: 0,
                syncs: 0,
                crashed: false,
                rng: SimRng::new(seed),
            }),
            size_bytes,
        }
    }

    pub fn set_faults(&self, faults: Faults) {
        let mut s = self.state.lock();
        s.reads = 0;
        s.writes = 0;
        s.syncs = 0;
        s.faults = faults;
    }

    pub fn writes(&self) -> u64 {
        self.state.lock().writes
    }

    /// Cuts the power now: every later operation fails, nothing more reaches the disk.
    pub fn power_off(&self) {
        self.state.lock().crashed = true;
    }

    pub fn crashed(&self) -> bool {
        self.state.lock().crashed
    }

    /// Flips one bit in both the durable image and the current view.
    pub fn flip_bit(&self, offset_bytes: u64, bit: u8) {
        let mut s = self.state.lock();
        s.durable[offset_bytes as usize] ^= 1 << bit;
        s.current[offset_bytes as usize] ^= 1 << bit;
    }

    /// The current view (what a clean shutdown would leave, once synced).
    pub fn image(&self) -> Vec<u8> {
        self.state.lock().current.clone()
    }

    /// What the disk holds after a power loss now: the durable image plus a random subset of
    /// the un-synced writes, each lost, kept whole, or torn at sector granularity.
    pub fn crash_image(&self) -> Vec<u8> {
        let mut s = self.state.lock();
        let mut image = s.durable.clone();
        let pending = std::mem::take(&mut s.pending);
        for (offset, data) in &pending {
            match s.rng.below(4) {
                0 | 1 => {}
                2 => image[*offset as usize..*offset as usize + data.len()].copy_from_slice(data),
                _ => {
                    for (i, sector) in data.chunks(SECTOR_SIZE).enumerate() {
                        if s.rng.below(2) == 0 {
                            let at = *offset as usize + i * SECTOR_SIZE;
                            image[at..at + sector.len()].copy_from_slice(sector);
                        }
                    }
                }
            }
        }
        s.pending = pending;
        image
    }
}

impl SimDisk {
    /// Counts a sync (or a write-through write's durability) and says whether it may go on:
    /// the power is on and no fault is aimed at it. A failed fsync may have written some,
    /// all or none of the cache, so the caller leaves everything pending then.
    fn sync_started(&self) -> io::Result<parking_lot::MutexGuard<'_, State>> {
        let mut s = self.state.lock();
        if s.crashed {
            return Err(power_lost());
        }
        s.syncs += 1;
        if s.faults.fail_sync_at == Some(s.syncs) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(s)
    }
}

impl Backing for SimDisk {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Like a disk with 512-byte logical blocks under O_DIRECT.
    fn read_alignment(&self) -> usize {
        512
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        assert_aligned_to(offset, buf.len(), self.size_bytes, self.read_alignment());
        let mut s = self.state.lock();
        if s.crashed {
            return Err(power_lost());
        }
        s.reads += 1;
        if s.faults.fail_read_at == Some(s.reads) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        buf.copy_from_slice(&s.current[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        assert_aligned(offset, data.len(), self.size_bytes);
        let mut s = self.state.lock();
        if s.crashed {
            return Err(power_lost());
        }
        s.writes += 1;
        let n = s.writes;
        if s.faults.fail_write_at == Some(n) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        if s.faults.enospc_from_write.is_some_and(|from| n >= from) {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        if s.faults.crash_at_write == Some(n) {
            // The write in flight at the moment of power loss: some of its sectors made it.
            s.crashed = true;
            let mut torn = Vec::new();
            for (i, sector) in data.chunks(SECTOR_SIZE).enumerate() {
                if s.rng.below(2) == 0 {
                    torn.push((offset + (i * SECTOR_SIZE) as u64, sector.to_vec()));
                }
            }
            s.pending.extend(torn);
            return Err(power_lost());
        }
        s.current[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        s.pending.push((offset, data.to_vec()));
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        let mut s = self.sync_started()?;
        let pending = std::mem::take(&mut s.pending);
        for (offset, data) in pending {
            s.durable[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
        }
        Ok(())
    }

    /// A write-through write (RWF_DSYNC, a FUA write): durable when it returns, and nothing
    /// else with it — earlier writes not yet synced stay as much at risk as before. The sectors
    /// it covers leave the pending writes: a disk keeps the newest data of a sector, and a
    /// crash never brings an older pending version back over it. A fault aimed at the Nth
    /// sync hits this write's durability as it hit the sync a write and a sync made (the
    /// write then stays pending).
    fn write_durable_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.write_at(offset, data)?;
        let mut s = self.sync_started()?;
        let (start, end) = (offset, offset + data.len() as u64);
        s.durable[start as usize..end as usize].copy_from_slice(data);
        let pending = std::mem::take(&mut s.pending);
        for (at, bytes) in pending {
            let at_end = at + bytes.len() as u64;
            if at_end <= start || at >= end {
                s.pending.push((at, bytes));
                continue;
            }
            // Keep the sectors outside the durable range, as runs.
            let mut run: Option<(u64, Vec<u8>)> = None;
            for (i, sector) in bytes.chunks(SECTOR_SIZE).enumerate() {
                let sector_at = at + (i * SECTOR_SIZE) as u64;
                let covered = sector_at < end && sector_at + sector.len() as u64 > start;
                if covered {
                    s.pending.extend(run.take());
                    continue;
                }
                match &mut run {
                    Some((_, kept)) => kept.extend_from_slice(sector),
                    None => run = Some((sector_at, sector.to_vec())),
                }
            }
            s.pending.extend(run);
        }
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        assert_aligned(offset, len as usize, self.size_bytes);
        let zeros = vec![0u8; len as usize];
        let mut s = self.state.lock();
        if s.crashed {
            return Err(power_lost());
        }
        s.current[offset as usize..(offset + len) as usize].copy_from_slice(&zeros);
        s.pending.push((offset, zeros));
        Ok(())
    }
}

/// Where things are in a store image, for tests that damage exactly one part of it.
pub mod inspect {
    use std::ops::Range;

    use crate::format::{Superblock, DATA_START_BYTES, HEAD_BYTES, SUPERBLOCK_SLOT_BYTES};
    use crate::store::scan_image;

    /// One record as found in an image (byte ranges are absolute offsets).
    #[derive(Debug, Clone)]
    pub struct RecordLayout {
        pub seq: u64,
        /// The record kind's tag (`docs/format.md`): 1 write, 2 trim, 3 zero, 5 checkpoint
        /// chunk, 6 batch, 7 relocate, 8 marker, 9 map pages, 10 link.
        pub kind: u8,
        pub head: Range<u64>,
        pub payload: Range<u64>,
        pub tail: Range<u64>,
        /// Each fragment's LBA and bytes.
        pub fragments: Vec<(u64, Range<u64>)>,
        /// Map pages (kind 9): each page's id tag (level in bits 45–47, index below) and bytes.
        pub pages: Vec<(u64, Range<u64>)>,
    }

    /// The superblock recovery would start from (the newest valid slot).
    pub fn superblock(image: &[u8]) -> Superblock {
        let slots =
            [0, 1].map(|i| Superblock::decode(&image[i * SUPERBLOCK_SLOT_BYTES..(i + 1) * SUPERBLOCK_SLOT_BYTES]));
        slots.into_iter().flatten().max_by_key(|sb| sb.generation).expect("a valid superblock")
    }

    /// The flush proof sector's bytes in an image (`format/proof.rs`).
    pub const FLUSH_PROOF: Range<usize> = crate::format::FLUSH_PROOF_OFFSET_BYTES as usize
        ..crate::format::FLUSH_PROOF_OFFSET_BYTES as usize + crate::format::FLUSH_PROOF_BYTES;

    /// The sequence number the newest flush proof in an image says was durable (None:
    /// no proof, or both copies damaged).
    pub fn proven_seq(image: &[u8]) -> Option<u64> {
        match crate::format::ProofSector::decode(&image[FLUSH_PROOF], crc32c::crc32c(&superblock(image).uuid)) {
            crate::format::ProofSector::Proof(p) => Some(p.proven_seq),
            _ => None,
        }
    }

    /// How many of the two superblock slots decode.
    pub fn valid_superblock_slots(image: &[u8]) -> usize {
        (0..2)
            .filter(|i| Superblock::decode(&image[i * SUPERBLOCK_SLOT_BYTES..(i + 1) * SUPERBLOCK_SLOT_BYTES]).is_ok())
            .count()
    }

    /// Every record in every segment of a version 3 store image, by sequence number.
    pub fn records(image: &[u8]) -> Vec<RecordLayout> {
        let sb = superblock(image);
        let store_tag = crc32c::crc32c(&sb.uuid);
        let mut out = Vec::new();
        for segment in 0..sb.segment_count() {
            let base = DATA_START_BYTES + segment * sb.segment_size_bytes;
            let image = &image[base as usize..(base + sb.segment_size_bytes) as usize];
            for r in scan_image(image, base, store_tag) {
                let payload_end = r.payload_offset_bytes + r.payload_len as u64;
                out.push(RecordLayout {
                    seq: r.seq,
                    kind: r.kind,
                    head: r.offset_bytes..r.offset_bytes + HEAD_BYTES as u64,
                    payload: r.payload_offset_bytes..payload_end,
                    tail: payload_end..r.end_bytes,
                    fragments: r.fragments,
                    pages: r.pages,
                });
            }
        }
        out.sort_by_key(|r| r.seq);
        out
    }

    /// The records recovery would replay: those after the newest checkpoint.
    pub fn replay_window(image: &[u8]) -> Vec<RecordLayout> {
        let checkpoint_seq = superblock(image).checkpoint_seq;
        records(image).into_iter().filter(|r| r.seq > checkpoint_seq).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sector(byte: u8) -> Vec<u8> {
        vec![byte; SECTOR_SIZE]
    }

    /// A write-through write survives every crash whole, an older pending version of its
    /// sectors never comes back over it, and the other unsynced writes stay at risk.
    #[test]
    fn a_write_through_write_is_durable_alone() {
        let s = SECTOR_SIZE as u64;
        let (mut lost_elsewhere, mut kept_beside) = (false, false);
        for seed in 0..64 {
            let disk = SimDisk::new(4 * s, seed);
            disk.write_at(0, &sector(1)).unwrap();
            // Two sectors pending, the second then written through with newer bytes.
            disk.write_at(s, &[sector(2), sector(3)].concat()).unwrap();
            disk.write_durable_at(2 * s, &sector(4)).unwrap();
            let image = disk.crash_image();
            assert_eq!(&image[2 * s as usize..3 * s as usize], &sector(4)[..], "seed {seed}: the durable write");
            let first = &image[..s as usize];
            assert!(first == sector(0) || first == sector(1), "seed {seed}: a sector nobody wrote");
            lost_elsewhere |= first == sector(0);
            kept_beside |= image[s as usize..2 * s as usize] == sector(2);
        }
        assert!(lost_elsewhere, "no crash lost an unsynced write beside a write-through one");
        assert!(kept_beside, "the unsynced part of a split write never survived");
    }
}
