//! Host requests: read, write, trim, write-zeroes and block status, from byte ranges to
//! the ops a record group carries.
//!
//! Invariants:
//! - Every range is validated against the logical size before anything happens.
//! - A request is one record group: all of it survives a crash, or none of it.
//! - Partial edge blocks are read-modify-written under a stripe lock held until the new
//!   version is published, so two read-modify-writes of one block never lose each other's
//!   bytes.

use std::sync::atomic::Ordering;

use super::lock::MutexGuard;
use super::op::{Block, Op, RangeKind};
use super::options::{Extent, ExtentKind};
use super::read::ReadCache;
use super::space::SpaceClass;
use super::state::{round_up, Inner};
use crate::codec::CodecTag;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{FragmentEntry, FRAGMENT_CRC_BYTES};
use crate::map::Entry;
use crate::stats::Counters;
use crate::types::Lba;
use crate::BLOCK_SIZE;

/// Stripes of the partial-block locks.
pub(crate) const BLOCK_LOCK_STRIPES: usize = 1024;

/// When a request must be durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Durability {
    /// At the next flush.
    Buffered,
    /// Before the request returns (FUA).
    Fua,
}

impl Inner {
    pub(crate) fn validate_range(&self, offset: u64, length: u64) -> Result<()> {
        let size = self.logical_size_bytes.load(Ordering::Acquire);
        match offset.checked_add(length) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Error::new(
                ErrorKind::OutOfRange,
                format!("request [{offset}, +{length}) is past the end of the device ({size} bytes)"),
            )),
        }
    }

    pub(crate) fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        Counters::add(&self.counters.read_ops, 1);
        self.validate_range(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        let first_lba = Lba::of_byte(offset);
        let last_lba = Lba::of_byte(offset + buf.len() as u64 - 1);
        let block_count = (last_lba.0 - first_lba.0 + 1) as usize;
        let map = self.map.read();
        if last_lba.0 >= map.block_count() {
            return Err(Error::new(ErrorKind::OutOfRange, "request past the end (resized)"));
        }
        let entries: Vec<Entry> =
            (first_lba.0..=last_lba.0).map(|lba| map.get(Lba(lba)).unpack()).collect::<Result<_>>()?;
        let mut blocks = vec![0u8; block_count * BLOCK_SIZE];
        self.fetch_blocks(&entries, &mut blocks, first_lba, ReadCache::Use)?;
        drop(map);
        let skip = (offset % BLOCK_SIZE as u64) as usize;
        buf.copy_from_slice(&blocks[skip..skip + buf.len()]);
        Counters::add(&self.counters.host_read_bytes, buf.len() as u64);
        Ok(())
    }

    /// Compresses one block: the CRC32C of the block, then the codec's output (or the block
    /// raw when compression does not pay). An all-zero block stores nothing.
    pub(crate) fn compress(&self, block: &[u8], scratch: &mut Vec<u8>) -> Block {
        if block.iter().all(|&b| b == 0) {
            return Block { entry: FragmentEntry::ZERO_BLOCK, bytes: Vec::new() };
        }
        let codec = self.geometry.codec.compress_block(block, scratch);
        let mut bytes = Vec::with_capacity(FRAGMENT_CRC_BYTES + scratch.len());
        bytes.extend_from_slice(&crc32c::crc32c(block).to_le_bytes());
        bytes.extend_from_slice(scratch);
        debug_assert!(codec != CodecTag::Raw || scratch.len() == BLOCK_SIZE);
        Block { entry: FragmentEntry { stored_len: bytes.len() as u16, codec }, bytes }
    }

    /// Locks the stripes of the given partial blocks, in stripe order.
    fn lock_edges(&self, edge_lbas: &[Lba]) -> Vec<MutexGuard<'_, ()>> {
        let mut stripes: Vec<usize> = edge_lbas.iter().map(|lba| lba.0 as usize % BLOCK_LOCK_STRIPES).collect();
        stripes.sort_unstable();
        stripes.dedup();
        stripes.iter().map(|&s| self.block_locks[s].lock()).collect()
    }

    pub(crate) fn write(&self, offset: u64, data: &[u8], durability: Durability) -> Result<()> {
        Counters::add(&self.counters.write_ops, 1);
        self.check_writable()?;
        self.validate_range(offset, data.len() as u64)?;
        if data.is_empty() {
            return self.make_durable(None, durability);
        }
        let first_lba = Lba::of_byte(offset);
        let last_lba = Lba::of_byte(offset + data.len() as u64 - 1);
        let head = (offset % BLOCK_SIZE as u64) as usize;
        let tail_end = ((offset + data.len() as u64) % BLOCK_SIZE as u64) as usize;
        let mut edge_lbas = Vec::new();
        if head != 0 || (first_lba == last_lba && tail_end != 0) {
            edge_lbas.push(first_lba);
        }
        if tail_end != 0 && last_lba != first_lba {
            edge_lbas.push(last_lba);
        }
        let guards = self.lock_edges(&edge_lbas);
        let mut scratch = Vec::with_capacity(BLOCK_SIZE * 2);
        let mut blocks = Vec::with_capacity((last_lba.0 - first_lba.0 + 1) as usize);
        let mut data_at = 0usize;
        for lba in (first_lba.0..=last_lba.0).map(Lba) {
            let in_block = if lba == first_lba { head } else { 0 };
            let take = (BLOCK_SIZE - in_block).min(data.len() - data_at);
            if take == BLOCK_SIZE {
                blocks.push(self.compress(&data[data_at..data_at + BLOCK_SIZE], &mut scratch));
            } else {
                let mut block = self.read_block(lba)?;
                block[in_block..in_block + take].copy_from_slice(&data[data_at..data_at + take]);
                blocks.push(self.compress(&block, &mut scratch));
            }
            data_at += take;
        }
        debug_assert_eq!(data_at, data.len());
        let class = self.write_class(first_lba, last_lba, &blocks);
        let appended =
            self.admit(&[Op::Write { start_lba: first_lba, blocks }], class).inspect_err(|e| self.note_no_space(e))?;
        Counters::add(&self.counters.host_write_bytes, data.len() as u64);
        drop(guards);
        if durability == Durability::Fua {
            Counters::add(&self.counters.fua_ops, 1);
        }
        self.make_durable(Some(appended.last_seq), durability)
    }

    /// A write that replaces more stored bytes than it adds frees space once GC runs: it
    /// may use part of the reserve other host writes may not.
    fn write_class(&self, first_lba: Lba, last_lba: Lba, blocks: &[Block]) -> SpaceClass {
        let map = self.map.read();
        let last = last_lba.0.min(map.block_count().saturating_sub(1));
        let replaced_bytes: u64 = (first_lba.0..=last)
            .map(|lba| match map.get(Lba(lba)).unpack() {
                Ok(Entry::Stored(s)) => s.stored_len as u64,
                _ => 0,
            })
            .sum();
        let added_bytes: u64 = blocks.iter().map(|b| b.bytes.len() as u64).sum();
        if added_bytes < replaced_bytes {
            SpaceClass::HostShrinking
        } else {
            SpaceClass::Host
        }
    }

    /// Trim (`RangeKind::Trim`) or write-zeroes (`RangeKind::Zero`) of a byte range.
    pub(crate) fn range_request(
        &self,
        kind: RangeKind,
        offset: u64,
        length: u64,
        durability: Durability,
    ) -> Result<()> {
        let counter = match kind {
            RangeKind::Trim => &self.counters.trim_ops,
            RangeKind::Zero => &self.counters.zero_ops,
        };
        Counters::add(counter, 1);
        self.check_writable()?;
        self.validate_range(offset, length)?;
        if length == 0 {
            return self.make_durable(None, durability);
        }
        let block = BLOCK_SIZE as u64;
        let full_start = round_up(offset, block);
        let full_end = (offset + length) / block * block;
        let mut ops = Vec::new();
        match kind {
            RangeKind::Zero => self.zero_ops(offset, length, &mut ops)?,
            // Trim is advisory for partial blocks: only whole blocks are unmapped.
            RangeKind::Trim if full_end > full_start => ops.push(Op::Range {
                kind: RangeKind::Trim,
                start_lba: Lba::of_byte(full_start),
                block_count: (full_end - full_start) / block,
            }),
            RangeKind::Trim => {}
        }
        let last_seq = if ops.is_empty() {
            None
        } else {
            Some(self.admit(&ops, SpaceClass::HostMetadata).inspect_err(|e| self.note_no_space(e))?.last_seq)
        };
        self.make_durable(last_seq, durability)
    }

    /// The ops of a write-zeroes: whole blocks become a zero range; partial edges are real
    /// writes of zero bytes, in the same group so the request stays atomic.
    fn zero_ops(&self, offset: u64, length: u64, ops: &mut Vec<Op>) -> Result<()> {
        let block = BLOCK_SIZE as u64;
        let full_start = round_up(offset, block);
        let full_end = (offset + length) / block * block;
        let mut scratch = Vec::new();
        let mut zeroed_edge = |lba: Lba, range: std::ops::Range<usize>, ops: &mut Vec<Op>| -> Result<()> {
            let mut bytes = self.read_block(lba)?;
            bytes[range].fill(0);
            ops.push(Op::Write { start_lba: lba, blocks: vec![self.compress(&bytes, &mut scratch)] });
            Ok(())
        };
        if full_start > full_end {
            // Inside one block.
            let at = (offset % block) as usize;
            return zeroed_edge(Lba::of_byte(offset), at..at + length as usize, ops);
        }
        if offset < full_start {
            zeroed_edge(Lba::of_byte(offset), (offset % block) as usize..BLOCK_SIZE, ops)?;
        }
        if full_end > full_start {
            let block_count = (full_end - full_start) / block;
            ops.push(Op::Range { kind: RangeKind::Zero, start_lba: Lba::of_byte(full_start), block_count });
        }
        if offset + length > full_end {
            zeroed_edge(Lba::of_byte(full_end), 0..((offset + length) % block) as usize, ops)?;
        }
        Ok(())
    }

    /// With FUA, makes the request durable before it returns: up to its last record, or
    /// everything when it appended none.
    fn make_durable(&self, last_seq: Option<u64>, durability: Durability) -> Result<()> {
        if durability == Durability::Buffered {
            return Ok(());
        }
        match last_seq {
            Some(seq) => self.flush_upto(seq),
            None => self.flush(),
        }
    }

    pub(crate) fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>> {
        self.validate_range(offset, length)?;
        let mut extents: Vec<Extent> = Vec::new();
        if length == 0 {
            return Ok(extents);
        }
        let block = BLOCK_SIZE as u64;
        let map = self.map.read();
        let first = offset / block;
        let last = ((offset + length - 1) / block).min(map.block_count().saturating_sub(1));
        for lba in first..=last {
            let kind = match map.get(Lba(lba)).unpack()? {
                Entry::Unmapped => ExtentKind::Hole,
                Entry::Zero => ExtentKind::Zero,
                Entry::Stored(_) => ExtentKind::Data,
            };
            let start = (lba * block).max(offset);
            let end = ((lba + 1) * block).min(offset + length);
            match extents.last_mut() {
                Some(e) if e.kind == kind && e.offset + e.length == start => e.length += end - start,
                _ => extents.push(Extent { offset: start, length: end - start, kind }),
            }
        }
        Ok(extents)
    }
}
