//! Block codecs. Every fragment records the codec that made it, so one store may hold
//! several; an unknown codec tag is an error, never a guess.
//!
//! Contexts are reused: each thread keeps one zstd and one libdeflate compressor per level it
//! has used and one decompressor of each. Creating a zstd context per block cost more than
//! compressing a text block at level 1 (docs/space.md, "Codec choice"). Reuse does not change
//! the bytes: a context is reset for every block, so a fragment is the same as with a fresh
//! context (unit test `reused_contexts_make_the_same_bytes_as_fresh_ones`).
//!
//! A block is stored raw when the codec does not save `MIN_SAVING_BYTES`. Before the host
//! write path runs a slow codec (zstd, DEFLATE) it estimates whether the codec could save that
//! much at all (`looks_incompressible`: the collision entropy of 64 to 1,024 sampled bytes,
//! about 0.2 µs on plainly compressible blocks, 0.4 µs on most random ones); a block that
//! cannot is stored raw without running the codec (`skips_codec`), so incompressible data
//! (random, encrypted, already compressed) costs a sixth of zstd:1's CPU and a fiftieth of
//! DEFLATE:6's (docs/space.md, "Incompressible data").
//! The estimate errs towards compressing: it never skips a block
//! holding a run of zeros or any byte distribution an entropy coder shrinks by
//! `MIN_SAVING_BYTES`; what it cannot see is a random string repeated inside the block
//! (measured in docs/space.md, "Incompressible data").
//!
//! Adaptive fallback (`write_choice`): a host block is compressed with the store's codec
//! while one of the cores set aside for it is free, and with LZ4 when they are all busy
//! compressing (the write would otherwise queue behind the slow codec and the host would
//! see it). The load signal is the number of threads inside block compression at the moment
//! the block arrives, against `codec_cores` — half the cores the process may run on, the
//! other half being what the rest of the write path and the client need: cheap (one atomic
//! add and subtract a block), needs no clock or history, and it is high exactly when more
//! blocks want the codec than it may have cores. With `CodecFallback::AutoUncompressed` (not
//! the default, see there) the disk counts as well: when a host writer waits behind a
//! write-out, it binds and the store's codec is used however busy the cores are; when every
//! core is compressing and no write-out is in progress, the block is stored uncompressed for
//! now (an LZ4 block of literals, `lz4_literals`): the CPU binds, and the disk has bandwidth
//! to spare. Sampled per block, the share of blocks stored uncompressed follows the share of
//! time the disk idles.
//! GC recompresses LZ4 fragments with the store's codec when it moves them, under the same
//! rule, idle work when the CPU is free (`Store::recompress` does it on request). Every
//! fragment carries its codec tag, so reads never need to know which codec was chosen.
//!
//! Trained dictionaries (`Dictionary`, docs/format.md "Dictionaries"): a zstd dictionary
//! trained by zstd's own builder on a sample of the store's blocks. A fragment compressed
//! with one has tag `ZstdDict`; which dictionary is named by the zstd frame header's
//! Dictionary_ID field, which zstd writes anyway (1 byte for ids 1..=255), so the map entry
//! and the protection information stay as they are. Ids are the store's own, counted from 1
//! and never reused, so an id names one dictionary for the store's whole life; decoding
//! with a set that lacks it is an error, never a guess. Contexts holding a dictionary are
//! cached per thread by the dictionary's process-unique `serial` (ids repeat across the
//! stores one process opens), at most `DICTIONARY_CONTEXTS_MAX` of each kind.

use std::cell::RefCell;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::BLOCK_SIZE;

/// A codec as chosen at format time (with its level). The default is zstd level 1: it stores
/// 21-29% fewer bytes than LZ4 on every measured corpus, and with the adaptive LZ4 fallback
/// of the write path (module comment) it keeps the write-speed contract on a 2-core machine
/// (4K random write QD32 ≥ 2.0x raw, 128K sequential write ≥ 1.0x raw), which zstd:1 alone
/// did not (1.86x, 0.83x) — docs/space.md, "Codec choice".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Lz4,
    Zstd {
        level: i32,
    },
    /// Raw DEFLATE through libdeflate: the drive's GZIP-like engine.
    Deflate {
        level: i32,
    },
}

impl Default for Codec {
    fn default() -> Codec {
        Codec::DEFAULT
    }
}

/// When the write path may use LZ4 instead of the store's codec (see the module comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CodecFallback {
    /// The store's codec while a codec core is free; LZ4 when every one is busy.
    #[default]
    Auto,
    /// Which resource binds decides (`write_choice`): the store's codec also while a writer
    /// waits for the disk, LZ4 when the codec binds, and blocks stored uncompressed for now
    /// while every core is compressing and the disk idles. Not the default: on fio's 2:1
    /// data it measured 0.86–0.92x the build before on 128K writes with a fast disk, 0.90x
    /// with the disk throttled to 200 MB/s (docs/space.md, "Which resource binds").
    AutoUncompressed,
    /// LZ4 always on the write path: capacity comes from GC's recompression only (tests,
    /// and hosts that want the write path at its cheapest).
    Always,
    /// The store's codec always, however loaded the cores are.
    Never,
    /// Every host block stored uncompressed for now (`WriteChoice::Uncompressed`; LZ4 in an
    /// LZ4 store): capacity comes from recompression only (tests, and hosts whose CPU is
    /// entirely spoken for).
    Uncompressed,
}

impl CodecFallback {
    /// Every mode with the one name `FromStr` takes and `Display` prints (`zdisk serve`
    /// passes it on to the nbdkit plugin).
    const NAMES: [(CodecFallback, &'static str); 5] = [
        (CodecFallback::Auto, "auto"),
        (CodecFallback::AutoUncompressed, "auto-uncompressed"),
        (CodecFallback::Always, "always"),
        (CodecFallback::Never, "never"),
        (CodecFallback::Uncompressed, "uncompressed"),
    ];
}

impl FromStr for CodecFallback {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<CodecFallback, String> {
        match CodecFallback::NAMES.iter().find(|(_, name)| *name == s) {
            Some(&(mode, _)) => Ok(mode),
            None => {
                let names: Vec<&str> = CodecFallback::NAMES.iter().map(|(_, name)| *name).collect();
                Err(format!("unknown codec fallback {s:?} (expected one of: {})", names.join(", ")))
            }
        }
    }
}

impl std::fmt::Display for CodecFallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (_, name) = CodecFallback::NAMES.iter().find(|(mode, _)| mode == self).expect("every mode is named");
        f.write_str(name)
    }
}

/// How one host block is stored (the policy of the module comment, `write_choice`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteChoice {
    /// Compressed with this codec (the store's, or LZ4 as the fallback).
    Compress(Codec),
    /// Stored uncompressed for now, as an LZ4 block of literals only (`lz4_literals`): the
    /// cheapest tier, which recompression takes like any LZ4 fragment.
    Uncompressed,
}

/// What the write path knows of its two resources as a block arrives: the codec's cores and
/// the disk. Read from atomics, no lock, no clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteLoad {
    /// Other threads inside block compression, or host writers waiting for a write permit,
    /// whichever says more.
    pub busy_compressors: usize,
    /// Other threads inside block compression now (not counting waiting writers): with
    /// this block, every core compressing is what says the codec binds the whole process.
    pub compressing_now: usize,
    /// The cores the store's codec may keep busy (`OpenOptions::codec_cores`).
    pub codec_cores: usize,
    /// The cores the process may run on.
    pub available_cores: usize,
    /// Threads writing log bytes out to the disk or queued to (`Log::disk_writers`): 0 the
    /// disk idle (starved), 1 busy, 2 or more host writers waiting for it (it binds).
    pub disk_writers: usize,
    /// Free space is ample (`UNCOMPRESSED_TIER_FREE_SHARE`): storing a block uncompressed
    /// for now costs capacity GC would have to win back if space ran short.
    pub room_for_uncompressed: bool,
}

/// Write-outs in flight (one writing, the rest queued for the `io` lock) from which the disk
/// binds: a host writer waits behind the background writer's write-out.
pub const DISK_BINDS_WRITERS: usize = 2;

/// The share of the store's segments that must be free for the write path to store blocks
/// uncompressed: a quarter. The tier doubles what 2:1 data takes until it is recompressed;
/// with a quarter free it can never bring the store near GC's cushion (GC and pacing work
/// within the last few percent), and a store that is fuller gets the LZ4 fallback instead.
pub const UNCOMPRESSED_TIER_FREE_SHARE: f64 = 0.25;

/// How one host block is stored. With `CodecFallback::Auto` (the default): the store's codec
/// while a codec core is free, LZ4 when every one is busy. With `AutoUncompressed` the disk
/// counts too, and the cheaper tiers are taken only when the codec binds and the disk does
/// not:
/// - a codec core free: the store's codec;
/// - the disk binds (a write-out in progress and another queued behind it): the store's
///   codec too, since writing fewer bytes is what speeds the host up then (and the queue
///   drains only if the codec keeps up, which moves the choice back down);
/// - the codec binds: LZ4;
/// - every core of the process is busy and the disk is starved: stored uncompressed, to be
///   recompressed when the CPU is free. Not in an LZ4 store, which has no stronger codec
///   to recompress into (its fragments would stay uncompressed).
///
/// Pure, so the policy is tested without threads.
pub fn write_choice(configured: Codec, fallback: CodecFallback, load: WriteLoad) -> WriteChoice {
    let lz4_store = configured == Codec::Lz4;
    match fallback {
        CodecFallback::Never => WriteChoice::Compress(configured),
        CodecFallback::Always => WriteChoice::Compress(Codec::Lz4),
        CodecFallback::Uncompressed if lz4_store => WriteChoice::Compress(Codec::Lz4),
        CodecFallback::Uncompressed => WriteChoice::Uncompressed,
        CodecFallback::Auto if load.busy_compressors < load.codec_cores.max(1) => WriteChoice::Compress(configured),
        CodecFallback::Auto => WriteChoice::Compress(Codec::Lz4),
        CodecFallback::AutoUncompressed => {
            if load.busy_compressors < load.codec_cores.max(1) || load.disk_writers >= DISK_BINDS_WRITERS {
                WriteChoice::Compress(configured)
            } else if !lz4_store
                && load.room_for_uncompressed
                && load.compressing_now + 1 >= load.available_cores.max(2)
                && load.disk_writers == 0
            {
                WriteChoice::Uncompressed
            } else {
                WriteChoice::Compress(Codec::Lz4)
            }
        }
    }
}

/// A block as an LZ4 block of literals only: what LZ4's format calls a sequence with no
/// match — a token whose high nibble says 15+, the rest of the literal length in bytes of
/// 255 and a last one under 255, then the block. 4,114 bytes for 4 KiB (18 more than raw);
/// written at memory speed, decoded by any LZ4 decoder. This is the write path's
/// "uncompressed for now" tier: its fragments carry the LZ4 tag, so GC, idle recompression
/// and `pending_recompress_bytes` take them as they take the LZ4 fallback's, without a new
/// tag in the format. (lz4_flex has no store-only mode; its fastest compression still
/// searches for matches.) Appends to `out`, as `store_raw` does.
pub fn lz4_literals(block: &[u8], out: &mut Vec<u8>) -> CodecTag {
    out.reserve(block.len() + block.len() / 255 + 2);
    let len = block.len();
    if len < 15 {
        out.push((len as u8) << 4);
    } else {
        out.push(0xF0);
        let mut rest = len - 15;
        while rest >= 255 {
            out.push(255);
            rest -= 255;
        }
        out.push(rest as u8);
    }
    out.extend_from_slice(block);
    CodecTag::Lz4
}

/// How many cores the store's codec may keep busy before the write path falls back, unless
/// told (`OpenOptions::codec_cores`, `zdisk serve --codec-cores`), given the cores the
/// process may run on: half of them, at least one. Measured on a 2-core machine
/// (docs/space.md, "Adaptive fallback"): with the threshold at both cores zstd:1 was still
/// chosen for 97% of blocks under QD32 writes — the protocol, copies, checksums, the log and
/// the client kept the cores busy outside compression — and 128K sequential writes ran at
/// 0.69x raw.
pub fn default_codec_cores(available_cores: usize) -> usize {
    (available_cores / 2).max(1)
}

/// Checks a number of codec cores given by an operator against the cores the process may
/// run on: at least one (no core at all would be `CodecFallback::Always`, which says so), at
/// most all of them (more could never be busy at once: the threshold would be `Never`).
pub fn check_codec_cores(cores: usize, available_cores: usize) -> std::result::Result<usize, String> {
    if (1..=available_cores).contains(&cores) {
        Ok(cores)
    } else {
        Err(format!("codec cores must be 1..={available_cores} (the cores this process may run on), got {cores}"))
    }
}

/// The cores this process may run on (its affinity and cgroup quota; 1 if unknown).
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Whether GC, moving a fragment of codec `tag`, recompresses it with `target`: fragments
/// another codec made (the write path's LZ4 fallback, or a store formatted with another
/// codec's blocks recompressed into a stronger one), never raw ones (stored raw because no
/// codec saved enough; trying them again on every move would cost CPU for nothing). With
/// `same_tag_too` (an explicit stronger level) fragments of the target's own codec are
/// taken as well: the map does not record levels.
pub fn recompresses(tag: CodecTag, target: Codec, same_tag_too: bool) -> bool {
    tag != CodecTag::Raw && (tag != target.tag() || same_tag_too)
}

/// Whether GC, moving a fragment of codec `tag`, recompresses it with dictionary
/// `newest_id`: every compressed fragment but those already made with that dictionary
/// (`frame_dictionary_id` of a `ZstdDict` fragment; None when the frame does not say, which
/// is recompressed too). Raw fragments are left alone as in [`recompresses`].
pub fn recompresses_into_dictionary(tag: CodecTag, frame_dictionary_id: Option<u32>, newest_id: u32) -> bool {
    match tag {
        CodecTag::Raw => false,
        CodecTag::ZstdDict => frame_dictionary_id != Some(newest_id),
        CodecTag::Lz4 | CodecTag::Zstd | CodecTag::Deflate => true,
    }
}

/// The dictionary id a zstd frame's header names (None: none, or not a zstd frame).
pub fn frame_dictionary_id(frame: &[u8]) -> Option<u32> {
    zstd::zstd_safe::get_dict_id_from_frame(frame).map(|id| id.get())
}

/// The largest dictionary a store keeps (what the checkpoint decoder may allocate per
/// dictionary). zstd's default is 110 KiB; measured sizes in docs/space.md.
pub const DICTIONARY_BYTES_MAX: usize = 256 * 1024;
/// The dictionary size `recompress --train` asks zstd's builder for unless told otherwise:
/// zstd's own default, 112 KiB. At zstd:3 it stored 1–3% fewer bytes than 64 KiB on text,
/// tablespace, files and VM image, and 13–15% fewer than 16 KiB on text and tablespace
/// (docs/space.md, "Trained dictionaries"); the checkpoint carries it (0.02% of a 512 MiB
/// checkpoint interval).
pub const DICTIONARY_BYTES_DEFAULT: usize = 112 * 1024;
/// The most dictionaries a store's table holds at once: a new one is trained only after a
/// recompression with the previous one freed the older ones, so two are in use at most while
/// a recompression runs; the bound leaves room for runs cut short.
pub const DICTIONARIES_MAX: usize = 8;
/// Contexts per thread holding a dictionary, of each kind (compress, decompress).
const DICTIONARY_CONTEXTS_MAX: usize = 4;

/// Serials for `Dictionary::serial`, unique within the process.
static DICTIONARY_SERIAL: AtomicU64 = AtomicU64::new(1);

/// A trained zstd dictionary of a store (module comment).
pub struct Dictionary {
    /// The store's id for it: the Dictionary_ID of its header and of every frame made with it.
    pub id: u32,
    /// The zstd level GC and `recompress` compress with it at.
    pub level: i32,
    /// The dictionary as zstd's builder made it, its id set to `id`.
    pub bytes: Vec<u8>,
    /// Names its contexts in a thread's cache (unique within the process).
    serial: u64,
}

impl fmt::Debug for Dictionary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Dictionary {{ id: {}, level: {}, {} bytes }}", self.id, self.level, self.bytes.len())
    }
}

impl Dictionary {
    /// A dictionary from its stored bytes. Refuses bytes that are not a zstd dictionary
    /// naming `id` (a dictionary whose header disagrees with its table entry is damage).
    pub fn new(id: u32, level: i32, bytes: Vec<u8>) -> Result<Dictionary> {
        let named = zstd::zstd_safe::get_dict_id_from_dict(&bytes).map(|id| id.get());
        if id == 0 || named != Some(id) || bytes.len() > DICTIONARY_BYTES_MAX {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("dictionary {id}: {} bytes naming {named:?}", bytes.len()),
            ));
        }
        Ok(Dictionary { id, level, bytes, serial: DICTIONARY_SERIAL.fetch_add(1, Ordering::Relaxed) })
    }

    /// Trains a dictionary of at most `size_bytes` on `samples` (whole blocks) with zstd's
    /// builder, and gives it id `id`: zstd's builder picks a random id; a store's ids are
    /// its own small numbers (1 byte in every frame header rather than 4), so the header's
    /// Dictionary_ID field (bytes 4..8 after the magic, little-endian, which no other part
    /// of the dictionary depends on) is set to `id`.
    pub fn train(samples: &[Vec<u8>], id: u32, level: i32, size_bytes: usize) -> Result<Dictionary> {
        let mut bytes = zstd::dict::from_samples(samples, size_bytes.min(DICTIONARY_BYTES_MAX))
            .map_err(|e| Error::new(ErrorKind::InvalidArgument, format!("dictionary training failed: {e}")))?;
        if bytes.len() < 8 || zstd::zstd_safe::get_dict_id_from_dict(&bytes).is_none() {
            return Err(Error::new(ErrorKind::InvalidArgument, "zstd made a dictionary without a header"));
        }
        bytes[4..8].copy_from_slice(&id.to_le_bytes());
        Dictionary::new(id, level, bytes)
    }

    /// Compresses one block with this dictionary at its level into `out` (cleared first).
    /// Returns `ZstdDict`, or `Raw` when that does not save `MIN_SAVING_BYTES`.
    pub fn compress_block(&self, block: &[u8], out: &mut Vec<u8>) -> CodecTag {
        out.clear();
        self.compress_append(block, out)
    }

    /// `compress_block`, appending to `out`.
    pub(crate) fn compress_append(&self, block: &[u8], out: &mut Vec<u8>) -> CodecTag {
        assert_eq!(block.len(), BLOCK_SIZE);
        with_contexts(|c| match c.compress(Compression::Dictionary(self), block) {
            Some(compressed) if compressed.len() + MIN_SAVING_BYTES <= BLOCK_SIZE => {
                out.extend_from_slice(compressed);
                CodecTag::ZstdDict
            }
            _ => store_raw(block, out),
        })
    }
}

/// The dictionaries a store's fragments may name, by id: what decoding a `ZstdDict`
/// fragment needs.
#[derive(Debug, Default, Clone)]
pub struct DictionarySet {
    dictionaries: Vec<Arc<Dictionary>>,
}

/// A set with no dictionary (map pages, stores without dictionaries).
pub static NO_DICTIONARIES: DictionarySet = DictionarySet { dictionaries: Vec::new() };

impl DictionarySet {
    pub fn new(dictionaries: Vec<Arc<Dictionary>>) -> DictionarySet {
        DictionarySet { dictionaries }
    }

    pub fn get(&self, id: u32) -> Option<&Arc<Dictionary>> {
        self.dictionaries.iter().find(|d| d.id == id)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Dictionary>> {
        self.dictionaries.iter()
    }

    /// Whether dictionary `id` is one the store has dropped: ids rise and the newest is
    /// never dropped, so an id missing below one held was freed — which happens only once
    /// no fragment the map points at names it. A fragment naming it is dead bytes that
    /// cannot be decoded any more.
    pub fn dropped(&self, id: u32) -> bool {
        self.get(id).is_none() && self.iter().any(|d| d.id > id)
    }

    pub fn len(&self) -> usize {
        self.dictionaries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.dictionaries.is_empty()
    }
}

/// A block is stored raw unless compression saves at least this many bytes: reading a raw
/// block costs no decoding, and a few saved bytes are not worth that.
pub const MIN_SAVING_BYTES: usize = 256;

/// How a fragment is stored on disk; the tag is 3 bits in the map and a byte in records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CodecTag {
    Raw = 0,
    Lz4 = 1,
    Zstd = 2,
    Deflate = 3,
    /// A zstd frame made with one of the store's dictionaries (its header names which).
    ZstdDict = 4,
}

impl CodecTag {
    pub fn from_u8(tag: u8) -> Result<CodecTag> {
        match tag {
            0 => Ok(CodecTag::Raw),
            1 => Ok(CodecTag::Lz4),
            2 => Ok(CodecTag::Zstd),
            3 => Ok(CodecTag::Deflate),
            4 => Ok(CodecTag::ZstdDict),
            other => Err(Error::new(ErrorKind::Corrupt, format!("unknown codec tag {other}"))),
        }
    }
}

/// One thread's codec contexts (see the module comment). A thread uses one level or two, so
/// a list searched in order is enough.
#[derive(Default)]
struct Contexts {
    zstd_compressors: Vec<(i32, zstd::bulk::Compressor<'static>)>,
    zstd_decompressor: Option<zstd::bulk::Decompressor<'static>>,
    deflate_compressors: Vec<(i32, libdeflater::Compressor)>,
    deflate_decompressor: Option<libdeflater::Decompressor>,
    /// By `Dictionary::serial`, the most recently added last.
    zstd_dictionary_compressors: Vec<(u64, zstd::bulk::Compressor<'static>)>,
    zstd_dictionary_decompressors: Vec<(u64, zstd::bulk::Decompressor<'static>)>,
    /// Where the compressors write (`OUT_BOUND_BYTES`, zeroed once): the caller copies out
    /// only what it keeps.
    out: Vec<u8>,
}

/// What `Contexts::compress` compresses with.
#[derive(Clone, Copy)]
enum Compression<'a> {
    Codec(Codec),
    Dictionary(&'a Dictionary),
}

/// The index of `serial`'s context in `cache`, made by `make` (and the oldest dropped when
/// the cache is full) if it is not there.
fn cached_context<T>(cache: &mut Vec<(u64, T)>, serial: u64, make: impl FnOnce() -> Option<T>) -> Option<usize> {
    if let Some(index) = cache.iter().position(|(s, _)| *s == serial) {
        return Some(index);
    }
    let context = make()?;
    if cache.len() >= DICTIONARY_CONTEXTS_MAX {
        cache.remove(0);
    }
    cache.push((serial, context));
    Some(cache.len() - 1)
}

thread_local! {
    static CONTEXTS: RefCell<Contexts> = RefCell::new(Contexts::default());
}

/// Runs `f` with this thread's contexts; with fresh ones while the thread is being torn down
/// (its thread-locals may already be gone) — slower, never wrong.
fn with_contexts<R>(f: impl FnOnce(&mut Contexts) -> R) -> R {
    let mut f = Some(f);
    let reused = CONTEXTS.try_with(|contexts| match contexts.try_borrow_mut() {
        Ok(mut contexts) => Some((f.take().expect("called once"))(&mut contexts)),
        Err(_) => None,
    });
    match reused {
        Ok(Some(result)) => result,
        _ => (f.take().expect("called once"))(&mut Contexts::default()),
    }
}

impl Contexts {
    /// Compresses `block` into this thread's output buffer: the compressed bytes, or None
    /// when the codec fails (no room: the block does not compress).
    fn compress(&mut self, compression: Compression, block: &[u8]) -> Option<&[u8]> {
        if self.out.len() < OUT_BOUND_BYTES {
            self.out.resize(OUT_BOUND_BYTES, 0);
        }
        let out = &mut self.out[..];
        let len = match compression {
            Compression::Codec(Codec::Lz4) => lz4_flex::block::compress_into(block, out).ok()?,
            Compression::Codec(Codec::Zstd { level }) => {
                let index = match self.zstd_compressors.iter().position(|(l, _)| *l == level) {
                    Some(index) => index,
                    None => {
                        self.zstd_compressors.push((level, zstd::bulk::Compressor::new(level).ok()?));
                        self.zstd_compressors.len() - 1
                    }
                };
                self.zstd_compressors[index].1.compress_to_buffer(block, out).ok()?
            }
            Compression::Codec(Codec::Deflate { level }) => {
                let index = match self.deflate_compressors.iter().position(|(l, _)| *l == level) {
                    Some(index) => index,
                    None => {
                        let lvl = libdeflater::CompressionLvl::new(level).unwrap_or_default();
                        self.deflate_compressors.push((level, libdeflater::Compressor::new(lvl)));
                        self.deflate_compressors.len() - 1
                    }
                };
                self.deflate_compressors[index].1.deflate_compress(block, out).ok()?
            }
            Compression::Dictionary(dictionary) => {
                let cache = &mut self.zstd_dictionary_compressors;
                let index = cached_context(cache, dictionary.serial, || {
                    zstd::bulk::Compressor::with_dictionary(dictionary.level, &dictionary.bytes).ok()
                })?;
                cache[index].1.compress_to_buffer(block, out).ok()?
            }
        };
        Some(&self.out[..len])
    }

    fn zstd_decompress(&mut self, input: &[u8], block: &mut [u8]) -> Option<usize> {
        if self.zstd_decompressor.is_none() {
            self.zstd_decompressor = Some(zstd::bulk::Decompressor::new().ok()?);
        }
        self.zstd_decompressor.as_mut()?.decompress_to_buffer(input, block).ok()
    }

    fn zstd_dictionary_decompress(&mut self, dictionary: &Dictionary, input: &[u8], block: &mut [u8]) -> Option<usize> {
        let cache = &mut self.zstd_dictionary_decompressors;
        let index = cached_context(cache, dictionary.serial, || {
            zstd::bulk::Decompressor::with_dictionary(&dictionary.bytes).ok()
        })?;
        cache[index].1.decompress_to_buffer(input, block).ok()
    }

    fn deflate_decompress(&mut self, input: &[u8], block: &mut [u8]) -> Option<usize> {
        let decompressor = self.deflate_decompressor.get_or_insert_with(libdeflater::Decompressor::new);
        decompressor.deflate_decompress(input, block).ok()
    }
}

/// Room for any codec's output of one block (each bound is below 4.2 KiB).
const OUT_BOUND_BYTES: usize = 2 * BLOCK_SIZE;

mod estimate;
pub use estimate::looks_incompressible;
#[cfg(test)]
use estimate::{
    compressible_above, FIRST_LOOK_MAX_COLLISIONS, FIRST_LOOK_SAMPLES, SAMPLES, SAMPLES_PER_CHECK, SAMPLE_CELL_BYTES,
    SAMPLE_OFFSETS,
};

/// Whether the host write path stores `block` raw without running `codec`, the codec it chose
/// for the block (module comment): when `codec` is slower than LZ4 and the block looks
/// incompressible. LZ4 (an LZ4 store's, or the fallback's) is not gated: the estimate gives up
/// on random bytes about twice as fast as LZ4 (0.4–0.7 µs against 1.3 µs a block), but LZ4
/// is the codec of a loaded write path, whose compressible blocks it takes in about 1 µs
/// (fio's 2:1 data), and gating it cost 128K writes of such data 5% more server CPU
/// (docs/space.md, "Incompressible data").
pub fn skips_codec(codec: Codec, block: &[u8]) -> bool {
    codec != Codec::Lz4 && looks_incompressible(block)
}

impl Codec {
    /// What `zdisk format` uses unless told otherwise (see the type's comment).
    pub const DEFAULT: Codec = Codec::Zstd { level: 1 };

    pub fn tag(self) -> CodecTag {
        match self {
            Codec::Lz4 => CodecTag::Lz4,
            Codec::Zstd { .. } => CodecTag::Zstd,
            Codec::Deflate { .. } => CodecTag::Deflate,
        }
    }

    pub fn level(self) -> i32 {
        match self {
            Codec::Lz4 => 0,
            Codec::Zstd { level } | Codec::Deflate { level } => level,
        }
    }

    pub fn from_parts(tag: u8, level: i32) -> Result<Codec> {
        match CodecTag::from_u8(tag)? {
            CodecTag::Lz4 => Ok(Codec::Lz4),
            CodecTag::Zstd => Ok(Codec::Zstd { level }),
            CodecTag::Deflate => Ok(Codec::Deflate { level }),
            CodecTag::Raw => Err(Error::new(ErrorKind::Corrupt, "raw is not a store codec")),
            CodecTag::ZstdDict => Err(Error::new(ErrorKind::Corrupt, "a dictionary is not a store codec")),
        }
    }

    /// `compress_block` behind `looks_incompressible`, whatever the codec (the bench measures
    /// LZ4 behind it too): a block the test judges incompressible is stored raw without
    /// running the codec. The store's write path gates its slow codecs only (`skips_codec`).
    pub fn compress_block_with_test(self, block: &[u8], out: &mut Vec<u8>) -> CodecTag {
        if looks_incompressible(block) {
            out.clear();
            return store_raw(block, out);
        }
        self.compress_block(block, out)
    }

    /// Compresses one block into `out` (cleared first). Returns the tag actually used: `Raw`
    /// when compression does not save at least `MIN_SAVING_BYTES`.
    pub fn compress_block(self, block: &[u8], out: &mut Vec<u8>) -> CodecTag {
        out.clear();
        self.compress_append(block, out)
    }

    /// `compress_block`, appending to `out`: the write path appends to the fragment it
    /// builds, after the protection information, so a block is copied once, into its
    /// fragment (the codec works in its thread's own output buffer, not zeroed again per block).
    pub(crate) fn compress_append(self, block: &[u8], out: &mut Vec<u8>) -> CodecTag {
        assert_eq!(block.len(), BLOCK_SIZE);
        with_contexts(|c| match c.compress(Compression::Codec(self), block) {
            Some(compressed) if compressed.len() + MIN_SAVING_BYTES <= BLOCK_SIZE => {
                out.extend_from_slice(compressed);
                self.tag()
            }
            _ => store_raw(block, out),
        })
    }
}

/// Stores `block` as it is: appends it to `out`.
pub fn store_raw(block: &[u8], out: &mut Vec<u8>) -> CodecTag {
    out.extend_from_slice(block);
    CodecTag::Raw
}

/// Decompresses a fragment into exactly one block; a `ZstdDict` fragment with the dictionary
/// of `dictionaries` its frame names. Any decoder error, a wrong output length, or a
/// dictionary the set does not hold is a `Checksum` error: the bytes on disk are not what we
/// wrote (or name a dictionary no retained checkpoint carries).
pub fn decompress_block(tag: CodecTag, input: &[u8], block: &mut [u8], dictionaries: &DictionarySet) -> Result<()> {
    assert_eq!(block.len(), BLOCK_SIZE);
    let decoded_len = match tag {
        CodecTag::Raw if input.len() == BLOCK_SIZE => {
            block.copy_from_slice(input);
            Some(BLOCK_SIZE)
        }
        CodecTag::Raw => None,
        CodecTag::Lz4 => lz4_flex::block::decompress_into(input, block).ok(),
        CodecTag::Zstd => with_contexts(|c| c.zstd_decompress(input, block)),
        CodecTag::Deflate => with_contexts(|c| c.deflate_decompress(input, block)),
        CodecTag::ZstdDict => match frame_dictionary_id(input).and_then(|id| dictionaries.get(id)) {
            Some(dictionary) => with_contexts(|c| c.zstd_dictionary_decompress(dictionary, input, block)),
            None => {
                let named = frame_dictionary_id(input);
                return Err(Error::new(
                    ErrorKind::Checksum,
                    format!("zstd fragment names dictionary {named:?}, which the store does not hold"),
                ));
            }
        },
    };
    if decoded_len == Some(BLOCK_SIZE) {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::Checksum, format!("{tag:?} fragment of {} bytes does not decode", input.len())))
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Codec::Lz4 => write!(f, "lz4"),
            Codec::Zstd { level } => write!(f, "zstd:{level}"),
            Codec::Deflate { level } => write!(f, "deflate:{level}"),
        }
    }
}

impl FromStr for Codec {
    type Err = String;

    /// `lz4`, `zstd`, `zstd:L` (1..=19), `deflate`, `deflate:L` (1..=12).
    fn from_str(s: &str) -> std::result::Result<Codec, String> {
        let (name, level) = match s.split_once(':') {
            Some((name, level)) => {
                let level: i32 = level.parse().map_err(|_| format!("bad codec level in {s:?}"))?;
                (name, Some(level))
            }
            None => (s, None),
        };
        match (name, level) {
            ("lz4", None) => Ok(Codec::Lz4),
            ("lz4", Some(_)) => Err("lz4 takes no level".to_string()),
            ("zstd", level) => level_in(level, 3, 1..=19, "zstd").map(|level| Codec::Zstd { level }),
            ("deflate", level) => level_in(level, 6, 1..=12, "deflate").map(|level| Codec::Deflate { level }),
            _ => Err(format!("unknown codec {s:?} (expected lz4, zstd[:L] or deflate[:L])")),
        }
    }
}

/// A codec level, or the default when none was given, checked against its range.
fn level_in(
    level: Option<i32>,
    default: i32,
    range: std::ops::RangeInclusive<i32>,
    name: &str,
) -> std::result::Result<i32, String> {
    let level = level.unwrap_or(default);
    if range.contains(&level) {
        Ok(level)
    } else {
        Err(format!("{name} level must be {}..={}, got {level}", range.start(), range.end()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CODECS: [Codec; 7] = [
        Codec::Lz4,
        Codec::Zstd { level: -1 },
        Codec::Zstd { level: 1 },
        Codec::Zstd { level: 3 },
        Codec::Zstd { level: 19 },
        Codec::Deflate { level: 1 },
        Codec::Deflate { level: 12 },
    ];

    /// Deterministic pseudo-random bytes (xorshift), no dependency.
    fn noise(seed: u64, len: usize) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Text-like: words drawn from a small vocabulary by the seed.
    fn text(seed: u64) -> Vec<u8> {
        let words = ["zdisk ", "block ", "segment ", "the ", "of ", "checkpoint\n", "map ", "42 ", "GC "];
        let picks = noise(seed, BLOCK_SIZE);
        let mut out = Vec::with_capacity(BLOCK_SIZE + 16);
        for p in picks {
            out.extend_from_slice(words[p as usize % words.len()].as_bytes());
            if out.len() >= BLOCK_SIZE {
                break;
            }
        }
        out.truncate(BLOCK_SIZE);
        out
    }

    /// Blocks of every kind: compressible, incompressible, half-and-half, constant, and
    /// random bytes repeated (incompressible per byte, compressible by matches).
    fn blocks(seed: u64) -> Vec<Vec<u8>> {
        let half = [noise(seed, BLOCK_SIZE / 2), vec![0; BLOCK_SIZE / 2]].concat();
        let repeated = noise(seed, 512).repeat(BLOCK_SIZE / 512);
        vec![text(seed), noise(seed, BLOCK_SIZE), half, vec![0xa5; BLOCK_SIZE], repeated]
    }

    fn round_trip(codec: Codec, block: &[u8]) -> CodecTag {
        let mut out = Vec::new();
        let tag = codec.compress_block(block, &mut out);
        assert!(tag == CodecTag::Raw || tag == codec.tag(), "{codec}: tag {tag:?}");
        assert!(tag == CodecTag::Raw || out.len() + MIN_SAVING_BYTES <= BLOCK_SIZE, "{codec}: {} bytes", out.len());
        let mut back = vec![0u8; BLOCK_SIZE];
        decompress_block(tag, &out, &mut back, &NO_DICTIONARIES).unwrap();
        assert!(back == block, "{codec}: {tag:?} fragment does not round-trip");
        tag
    }

    #[test]
    fn every_codec_round_trips_with_contexts_reused_across_levels() {
        for seed in 1..20 {
            for codec in CODECS {
                for block in blocks(seed) {
                    round_trip(codec, &block);
                }
            }
        }
    }

    #[test]
    fn reused_contexts_round_trip_on_many_threads_at_once() {
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                std::thread::spawn(move || {
                    for seed in 0..50 {
                        let codec = CODECS[((seed + t) % CODECS.len() as u64) as usize];
                        for block in blocks(seed * 4 + t) {
                            round_trip(codec, &block);
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
    }

    #[test]
    fn reused_contexts_make_the_same_bytes_as_fresh_ones() {
        for seed in 1..10 {
            for block in blocks(seed) {
                for level in [1, 3] {
                    let mut out = Vec::new();
                    let tag = Codec::Zstd { level }.compress_block(&block, &mut out);
                    let fresh = zstd::bulk::compress(&block, level).unwrap();
                    if tag == CodecTag::Zstd {
                        assert_eq!(out, fresh, "zstd:{level}");
                    }
                }
                let mut out = Vec::new();
                let tag = Codec::Deflate { level: 6 }.compress_block(&block, &mut out);
                let mut fresh = vec![0u8; 8192];
                let len = libdeflater::Compressor::new(libdeflater::CompressionLvl::new(6).unwrap())
                    .deflate_compress(&block, &mut fresh)
                    .unwrap();
                if tag == CodecTag::Deflate {
                    assert_eq!(out, fresh[..len], "deflate:6");
                }
            }
        }
    }

    /// The collision sum of a whole sample without the early exit: what the running sum must
    /// agree with.
    fn looks_incompressible_reference(block: &[u8]) -> bool {
        for samples in (SAMPLES_PER_CHECK..=SAMPLES).step_by(SAMPLES_PER_CHECK) {
            let mut counts = [0u32; 256];
            for &offset in &SAMPLE_OFFSETS[..samples] {
                counts[block[offset as usize] as usize] += 1;
            }
            let sum = counts.iter().map(|&c| c * c).sum::<u32>();
            if sum > compressible_above(samples) {
                return false;
            }
            if samples == FIRST_LOOK_SAMPLES && sum <= FIRST_LOOK_MAX_COLLISIONS {
                return true;
            }
        }
        true
    }

    /// fio's `buffer_compress_percentage` data (lib/rand.c, `__fill_random_buf_percentage`):
    /// each chunk of `chunk` bytes is `100 - percent`% random bytes, then zeros.
    fn fio_block(seed: u64, percent: usize, chunk: usize) -> Vec<u8> {
        let random_bytes = chunk * (100 - percent) / 100;
        let mut block = Vec::with_capacity(BLOCK_SIZE);
        for i in 0..(BLOCK_SIZE / chunk) as u64 {
            block.extend_from_slice(&noise((seed * 1000 + i) << 1, random_bytes));
            block.resize(block.len() + chunk - random_bytes, 0);
        }
        block
    }

    /// Blocks an entropy coder shrinks that a sampler can miss: fio's mixes of random bytes
    /// and zeros at every chunk size and share it offers, little-endian 24-bit integers in
    /// 32-bit slots, floats, 16-bit samples, base64 and hex text.
    fn structured_blocks(seed: u64) -> Vec<(String, Vec<u8>)> {
        let mut blocks = Vec::new();
        for chunk in [512, 1024, 4096] {
            for percent in [10, 25, 50, 75] {
                blocks.push((format!("fio {percent}% chunk {chunk}"), fio_block(seed, percent, chunk)));
            }
        }
        let bytes = noise(seed, BLOCK_SIZE);
        let words = |width: usize, f: &dyn Fn(&[u8]) -> Vec<u8>| -> Vec<u8> {
            bytes.chunks_exact(width).flat_map(f).take(BLOCK_SIZE).collect()
        };
        blocks.push(("u32 < 2^24".into(), words(4, &|w| vec![w[0], w[1], w[2], 0])));
        let floats = words(4, &|w| (1.0f32 + u16::from_le_bytes([w[0], w[1]]) as f32 / 977.0).to_le_bytes().to_vec());
        blocks.push(("f32 in 1..68".into(), floats));
        let pcm = words(2, &|w| ((i8::from_le_bytes([w[0]]) as i16 * 40) + (w[1] as i16 >> 5)).to_le_bytes().to_vec());
        blocks.push(("16-bit samples".into(), pcm));
        const B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        blocks.push(("base64".into(), bytes.iter().map(|&b| B64[b as usize % 64]).collect()));
        blocks.push(("hex".into(), bytes.iter().map(|&b| b"0123456789abcdef"[b as usize % 16]).collect()));
        blocks
    }

    #[test]
    fn the_running_sum_gives_the_same_answer_as_the_whole_histogram() {
        let mut judged = [0usize; 2];
        for seed in 1..200 {
            let kinds = blocks(seed).into_iter().chain(structured_blocks(seed).into_iter().map(|(_, b)| b));
            for block in kinds {
                let answer = looks_incompressible(&block);
                assert_eq!(answer, looks_incompressible_reference(&block));
                judged[answer as usize] += 1;
            }
        }
        assert!(judged[0] > 0 && judged[1] > 0, "{judged:?}");
    }

    #[test]
    fn samples_cover_the_whole_block_and_every_position_in_a_word() {
        let mut cells: Vec<usize> = SAMPLE_OFFSETS.iter().map(|&o| o as usize / SAMPLE_CELL_BYTES).collect();
        // Any prefix is spread over the block: the first 64 samples one in each 64 bytes.
        let mut first: Vec<usize> = SAMPLE_OFFSETS[..64].iter().map(|&o| o as usize / 64).collect();
        first.sort_unstable();
        assert_eq!(first, (0..64).collect::<Vec<_>>());
        cells.sort_unstable();
        assert_eq!(cells, (0..SAMPLES).collect::<Vec<_>>(), "one sample per cell");
        for period in [2usize, 4, 8, 16] {
            let mut hits = vec![0usize; period];
            for &offset in &SAMPLE_OFFSETS {
                hits[offset as usize % period] += 1;
            }
            let even = SAMPLES / period;
            assert!(hits.iter().all(|&h| h > even * 3 / 4 && h < even * 5 / 4), "mod {period}: {hits:?}");
        }
    }

    #[test]
    fn structured_and_half_zero_blocks_are_never_judged_incompressible() {
        for seed in 1..100 {
            for (name, block) in structured_blocks(seed) {
                // Every one of them is worth compressing, so the test must not skip it.
                let mut out = Vec::new();
                let tag = Codec::Zstd { level: 1 }.compress_block(&block, &mut out);
                assert_eq!(tag, CodecTag::Zstd, "{name}: zstd:1 stores it in {} bytes", out.len());
                assert!(!looks_incompressible(&block), "{name} (seed {seed}) judged incompressible");
            }
        }
    }

    #[test]
    fn the_incompressibility_test_only_skips_what_the_codec_would_store_raw() {
        let mut skipped = 0;
        for seed in 1..200 {
            for block in blocks(seed) {
                if !looks_incompressible(&block) {
                    continue;
                }
                skipped += 1;
                for codec in [Codec::Zstd { level: 1 }, Codec::Deflate { level: 6 }] {
                    let mut out = Vec::new();
                    assert_eq!(codec.compress_block_with_test(&block, &mut out), CodecTag::Raw);
                    assert_eq!(out, block, "a skipped block is stored as it is");
                    // Random bytes repeated fool a byte histogram: those the codec would
                    // compress are a known loss (measured in docs/space.md), all others not.
                    if block[..512] != block[512..1024] {
                        assert_eq!(codec.compress_block(&block, &mut out), CodecTag::Raw, "{codec}");
                    }
                }
            }
        }
        // 199 random blocks (and 199 random strings repeated): the bound is 7.5 standard
        // deviations above random bytes' sum, so every random block is recognised.
        assert!(skipped >= 199, "random blocks are recognised: {skipped}");
        assert!(!looks_incompressible(&text(1)) && !looks_incompressible(&[0; BLOCK_SIZE]));
    }

    #[test]
    fn the_write_path_skips_only_slow_codecs_and_only_on_incompressible_blocks() {
        let random = noise(3, BLOCK_SIZE);
        assert!(skips_codec(Codec::Zstd { level: 1 }, &random));
        assert!(skips_codec(Codec::Deflate { level: 6 }, &random));
        assert!(!skips_codec(Codec::Lz4, &random), "LZ4 is not gated");
        assert!(!skips_codec(Codec::Zstd { level: 1 }, &text(3)));
        assert!(!skips_codec(Codec::Zstd { level: 1 }, &fio_block(3, 50, 4096)));
    }

    #[test]
    fn the_estimate_stops_early_on_plain_cases() {
        // Which check the estimate stops at, from the reference's sums.
        let stops_at = |block: &[u8]| {
            (SAMPLES_PER_CHECK..=SAMPLES).step_by(SAMPLES_PER_CHECK).find(|&samples| {
                let mut counts = [0u32; 256];
                for &offset in &SAMPLE_OFFSETS[..samples] {
                    counts[block[offset as usize] as usize] += 1;
                }
                let sum = counts.iter().map(|&c| c * c).sum::<u32>();
                sum > compressible_above(samples) || (samples == FIRST_LOOK_SAMPLES && sum <= FIRST_LOOK_MAX_COLLISIONS)
            })
        };
        for seed in 1..50 {
            assert_eq!(stops_at(&text(seed)), Some(64), "text");
            assert!(stops_at(&fio_block(seed, 50, 4096)) <= Some(128), "fio's 2:1 data");
        }
        let first_look =
            (1..200).filter(|&seed| stops_at(&noise(seed, BLOCK_SIZE)) == Some(FIRST_LOOK_SAMPLES)).count();
        assert!(first_look >= 150, "most random blocks are judged at the first look: {first_look} of 199");
    }

    #[test]
    fn the_default_codec_is_zstd_1_with_the_adaptive_fallback() {
        assert_eq!(Codec::default(), Codec::Zstd { level: 1 });
        assert_eq!(Codec::DEFAULT.to_string(), "zstd:1");
        assert_eq!("zstd:1".parse::<Codec>().unwrap(), Codec::default());
        // The fallback has something faster to fall back to.
        assert_eq!(write_codec(Codec::DEFAULT, CodecFallback::Auto, 1, 1), Codec::Lz4);
    }

    /// The choice for `busy` other compressors and `codec_cores`, on a 2-core process whose
    /// disk neither binds nor starves (one write-out in progress, none queued).
    fn write_codec(configured: Codec, fallback: CodecFallback, busy: usize, codec_cores: usize) -> Codec {
        let load = WriteLoad { busy_compressors: busy, codec_cores, ..LOAD };
        match write_choice(configured, fallback, load) {
            WriteChoice::Compress(codec) => codec,
            WriteChoice::Uncompressed => panic!("uncompressed with the disk neither starved nor binding"),
        }
    }

    const LOAD: WriteLoad = WriteLoad {
        busy_compressors: 0,
        compressing_now: 0,
        codec_cores: 1,
        available_cores: 2,
        disk_writers: 1,
        room_for_uncompressed: true,
    };

    #[test]
    fn the_write_path_falls_back_to_lz4_only_when_every_core_is_compressing() {
        let zstd = Codec::Zstd { level: 1 };
        // Auto: the store's codec while a core is free, LZ4 from the moment none is.
        assert_eq!(write_codec(zstd, CodecFallback::Auto, 0, 2), zstd);
        assert_eq!(write_codec(zstd, CodecFallback::Auto, 1, 2), zstd);
        assert_eq!(write_codec(zstd, CodecFallback::Auto, 2, 2), Codec::Lz4);
        assert_eq!(write_codec(zstd, CodecFallback::Auto, 9, 2), Codec::Lz4);
        assert_eq!(write_codec(zstd, CodecFallback::Auto, 7, 8), zstd);
        // No core for the codec counts as one: a lone writer still gets zstd.
        assert_eq!(write_codec(zstd, CodecFallback::Auto, 0, 0), zstd);
        assert_eq!(write_codec(zstd, CodecFallback::Auto, 1, 0), Codec::Lz4);
        // The knobs ignore the load.
        assert_eq!(write_codec(zstd, CodecFallback::Never, 100, 2), zstd);
        assert_eq!(write_codec(zstd, CodecFallback::Always, 0, 2), Codec::Lz4);
        // An LZ4 store has nothing faster to fall back to.
        assert_eq!(write_codec(Codec::Lz4, CodecFallback::Auto, 100, 2), Codec::Lz4);
        let deflate = Codec::Deflate { level: 6 };
        assert_eq!(write_codec(deflate, CodecFallback::Auto, 2, 2), Codec::Lz4);
    }

    #[test]
    fn the_disk_binding_keeps_the_stores_codec_and_a_starved_disk_takes_blocks_uncompressed() {
        let zstd = Codec::Zstd { level: 1 };
        // `busy` others want the codec, `now` of them are compressing, `disk` write-outs.
        let choice = |busy, now, disk_writers| {
            let load = WriteLoad { busy_compressors: busy, compressing_now: now, disk_writers, ..LOAD };
            write_choice(zstd, CodecFallback::AutoUncompressed, load)
        };
        // A writer queued behind a write-out: the store's codec however busy the cores are.
        assert_eq!(choice(30, 1, 2), WriteChoice::Compress(zstd));
        assert_eq!(choice(30, 1, 9), WriteChoice::Compress(zstd));
        // Both cores compressing, the disk idle: uncompressed for now.
        assert_eq!(choice(2, 1, 0), WriteChoice::Uncompressed);
        assert_eq!(choice(30, 1, 0), WriteChoice::Uncompressed);
        // Writers waiting but the other core not compressing: LZ4 (the codec is not what
        // keeps them waiting).
        assert_eq!(choice(30, 0, 0), WriteChoice::Compress(Codec::Lz4));
        // Less than a quarter of the store free: LZ4, the cheap tier that keeps the saving.
        let full = WriteLoad {
            busy_compressors: 30,
            compressing_now: 1,
            disk_writers: 0,
            room_for_uncompressed: false,
            ..LOAD
        };
        assert_eq!(write_choice(zstd, CodecFallback::AutoUncompressed, full), WriteChoice::Compress(Codec::Lz4));
        // `Auto` (the default) looks at the codec's cores alone: never uncompressed, and LZ4
        // while the codec binds however busy the disk is.
        let starved = WriteLoad { busy_compressors: 30, compressing_now: 1, disk_writers: 0, ..LOAD };
        assert_eq!(write_choice(zstd, CodecFallback::Auto, starved), WriteChoice::Compress(Codec::Lz4));
        let disk_bound = WriteLoad { disk_writers: 2, ..starved };
        assert_eq!(write_choice(zstd, CodecFallback::Auto, disk_bound), WriteChoice::Compress(Codec::Lz4));
        // The disk busy but nobody waiting for it: LZ4.
        assert_eq!(choice(30, 1, 1), WriteChoice::Compress(Codec::Lz4));
        // A free codec core: the store's codec, starved disk or not.
        assert_eq!(choice(0, 0, 0), WriteChoice::Compress(zstd));
        // An LZ4 store never stores uncompressed: nothing would recompress it.
        let lz4_load = WriteLoad { busy_compressors: 30, compressing_now: 1, disk_writers: 0, ..LOAD };
        assert_eq!(
            write_choice(Codec::Lz4, CodecFallback::AutoUncompressed, lz4_load),
            WriteChoice::Compress(Codec::Lz4)
        );
        assert_eq!(write_choice(Codec::Lz4, CodecFallback::Uncompressed, LOAD), WriteChoice::Compress(Codec::Lz4));
        assert_eq!(write_choice(zstd, CodecFallback::Uncompressed, LOAD), WriteChoice::Uncompressed);
    }

    #[test]
    fn literal_only_lz4_blocks_decode_to_the_block_and_cost_18_bytes() {
        let mut out = Vec::new();
        for block in [text(5), noise(5, BLOCK_SIZE), vec![0; BLOCK_SIZE], fio_block(5, 50, 4096)] {
            out.clear();
            assert_eq!(lz4_literals(&block, &mut out), CodecTag::Lz4);
            assert_eq!(out.len(), BLOCK_SIZE + 18);
            let mut back = vec![0u8; BLOCK_SIZE];
            decompress_block(CodecTag::Lz4, &out, &mut back, &NO_DICTIONARIES).unwrap();
            assert!(back == block);
            assert!(lz4_flex::block::decompress(&out, BLOCK_SIZE).unwrap() == block);
        }
        // Short inputs and the length encoding's edges (14, 15, 15 + 255).
        for len in [0usize, 1, 14, 15, 16, 269, 270, 271, 1000] {
            let input: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            out.clear();
            lz4_literals(&input, &mut out);
            assert_eq!(lz4_flex::block::decompress(&out, len).unwrap(), input, "length {len}");
        }
    }

    #[test]
    fn gc_recompresses_other_codecs_fragments_but_not_raw_ones() {
        let zstd = Codec::Zstd { level: 1 };
        assert!(recompresses(CodecTag::Lz4, zstd, false));
        assert!(recompresses(CodecTag::Deflate, zstd, false));
        assert!(!recompresses(CodecTag::Zstd, zstd, false));
        assert!(!recompresses(CodecTag::Raw, zstd, false));
        assert!(!recompresses(CodecTag::Raw, zstd, true));
        assert!(recompresses(CodecTag::Zstd, Codec::Zstd { level: 3 }, true));
        assert!(!recompresses(CodecTag::Lz4, Codec::Lz4, false));
    }

    #[test]
    fn the_codec_may_keep_half_the_cores_busy_and_at_least_one() {
        assert_eq!(default_codec_cores(1), 1);
        assert_eq!(default_codec_cores(2), 1);
        assert_eq!(default_codec_cores(3), 1);
        assert_eq!(default_codec_cores(8), 4);
    }

    #[test]
    fn codec_cores_given_must_be_between_one_and_the_available_cores() {
        assert_eq!(check_codec_cores(1, 2), Ok(1));
        assert_eq!(check_codec_cores(2, 2), Ok(2));
        assert!(check_codec_cores(0, 2).unwrap_err().contains("1..=2"));
        assert!(check_codec_cores(3, 2).unwrap_err().contains("got 3"));
    }

    #[test]
    fn the_fallback_knob_parses_and_defaults_to_auto() {
        assert_eq!("always".parse::<CodecFallback>().unwrap(), CodecFallback::Always);
        assert_eq!("never".parse::<CodecFallback>().unwrap(), CodecFallback::Never);
        assert_eq!("auto".parse::<CodecFallback>().unwrap(), CodecFallback::Auto);
        assert_eq!("auto-uncompressed".parse::<CodecFallback>().unwrap(), CodecFallback::AutoUncompressed);
        assert_eq!("uncompressed".parse::<CodecFallback>().unwrap(), CodecFallback::Uncompressed);
        assert!("sometimes".parse::<CodecFallback>().is_err());
        assert_eq!(CodecFallback::default(), CodecFallback::Auto);
        // The name it prints is the one it parses (`zdisk serve` hands it to the plugin).
        for mode in [
            CodecFallback::Auto,
            CodecFallback::AutoUncompressed,
            CodecFallback::Always,
            CodecFallback::Never,
            CodecFallback::Uncompressed,
        ] {
            assert_eq!(mode.to_string().parse::<CodecFallback>(), Ok(mode));
        }
    }

    #[test]
    fn a_damaged_fragment_is_a_checksum_error_and_the_context_still_works() {
        for codec in [Codec::Zstd { level: 1 }, Codec::Deflate { level: 6 }, Codec::Lz4] {
            let block = text(7);
            let mut out = Vec::new();
            let tag = codec.compress_block(&block, &mut out);
            let mut back = vec![0u8; BLOCK_SIZE];
            let err = decompress_block(tag, &out[..out.len() / 2], &mut back, &NO_DICTIONARIES).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Checksum, "{codec}");
            decompress_block(tag, &out, &mut back, &NO_DICTIONARIES).unwrap();
            assert_eq!(back, block);
        }
    }

    /// Blocks of text lines sharing a vocabulary but not repeating within a block much: what
    /// a dictionary is for.
    fn text_samples(count: u64) -> Vec<Vec<u8>> {
        (0..count).map(|seed| text(seed * 7919 + 3)).collect()
    }

    #[test]
    fn a_trained_dictionary_names_its_store_id_in_every_frame_and_round_trips() {
        let dictionary = Arc::new(Dictionary::train(&text_samples(200), 7, 3, 16 * 1024).unwrap());
        assert_eq!(dictionary.id, 7);
        assert!(dictionary.bytes.len() <= 16 * 1024);
        let set = DictionarySet::new(vec![Arc::clone(&dictionary)]);
        let mut with_dictionary = 0;
        for seed in 1000..1040 {
            for block in blocks(seed) {
                let mut out = Vec::new();
                let tag = dictionary.compress_block(&block, &mut out);
                assert!(tag == CodecTag::ZstdDict || tag == CodecTag::Raw);
                if tag == CodecTag::ZstdDict {
                    with_dictionary += 1;
                    assert_eq!(frame_dictionary_id(&out), Some(7));
                }
                let mut back = vec![0u8; BLOCK_SIZE];
                decompress_block(tag, &out, &mut back, &set).unwrap();
                assert!(back == block);
            }
        }
        assert!(with_dictionary >= 40, "text blocks compress with the dictionary: {with_dictionary}");
    }

    #[test]
    fn a_dictionary_beats_plain_zstd_on_blocks_like_its_samples() {
        let dictionary = Dictionary::train(&text_samples(300), 1, 3, 16 * 1024).unwrap();
        let (mut plain_bytes, mut dictionary_bytes) = (0, 0);
        for block in (5000..5050).map(text) {
            let mut out = Vec::new();
            Codec::Zstd { level: 3 }.compress_block(&block, &mut out);
            plain_bytes += out.len();
            dictionary.compress_block(&block, &mut out);
            dictionary_bytes += out.len();
        }
        assert!(dictionary_bytes < plain_bytes, "{dictionary_bytes} vs {plain_bytes}");
    }

    #[test]
    fn a_fragment_naming_a_dictionary_the_set_lacks_is_a_checksum_error() {
        let dictionary = Dictionary::train(&text_samples(200), 2, 1, 16 * 1024).unwrap();
        let other = Arc::new(Dictionary::train(&text_samples(200), 3, 1, 16 * 1024).unwrap());
        let mut out = Vec::new();
        assert_eq!(dictionary.compress_block(&text(99), &mut out), CodecTag::ZstdDict);
        let mut back = vec![0u8; BLOCK_SIZE];
        for set in [&NO_DICTIONARIES, &DictionarySet::new(vec![other])] {
            let err = decompress_block(CodecTag::ZstdDict, &out, &mut back, set).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Checksum);
        }
    }

    #[test]
    fn dictionary_bytes_that_disagree_with_their_id_are_refused() {
        let dictionary = Dictionary::train(&text_samples(200), 4, 1, 16 * 1024).unwrap();
        assert_eq!(Dictionary::new(5, 1, dictionary.bytes.clone()).unwrap_err().kind(), ErrorKind::Corrupt);
        assert_eq!(Dictionary::new(4, 1, vec![1, 2, 3]).unwrap_err().kind(), ErrorKind::Corrupt);
        assert!(Dictionary::new(4, 1, dictionary.bytes.clone()).is_ok());
        assert_eq!(CodecTag::from_u8(4).unwrap(), CodecTag::ZstdDict);
        assert!(CodecTag::from_u8(5).is_err());
    }

    #[test]
    fn gc_recompresses_into_the_newest_dictionary_everything_but_raw_and_its_own() {
        assert!(recompresses_into_dictionary(CodecTag::Zstd, None, 2));
        assert!(recompresses_into_dictionary(CodecTag::Lz4, None, 2));
        assert!(recompresses_into_dictionary(CodecTag::ZstdDict, Some(1), 2));
        assert!(recompresses_into_dictionary(CodecTag::ZstdDict, None, 2));
        assert!(!recompresses_into_dictionary(CodecTag::ZstdDict, Some(2), 2));
        assert!(!recompresses_into_dictionary(CodecTag::Raw, None, 2));
    }
}
