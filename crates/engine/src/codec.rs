//! Block codecs. Every fragment records the codec that made it, so one store may hold
//! several; an unknown codec tag is an error, never a guess.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, ErrorKind, Result};
use crate::BLOCK_SIZE;

/// A codec as chosen at format time (with its level).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Codec {
    #[default]
    Lz4,
    Zstd {
        level: i32,
    },
    /// Raw DEFLATE through libdeflate: the drive's GZIP-like engine.
    Deflate {
        level: i32,
    },
}

/// How a fragment is stored on disk; the tag is 3 bits in the map and a byte in records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CodecTag {
    Raw = 0,
    Lz4 = 1,
    Zstd = 2,
    Deflate = 3,
}

impl CodecTag {
    pub fn from_u8(tag: u8) -> Result<CodecTag> {
        match tag {
            0 => Ok(CodecTag::Raw),
            1 => Ok(CodecTag::Lz4),
            2 => Ok(CodecTag::Zstd),
            3 => Ok(CodecTag::Deflate),
            other => Err(Error::new(ErrorKind::Corrupt, format!("unknown codec tag {other}"))),
        }
    }
}

impl Codec {
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
        }
    }

    /// Compresses one block into `out` (cleared first). Returns the tag actually used:
    /// `Raw` when compression does not save at least `min_saving_bytes`.
    pub fn compress_block(self, block: &[u8], out: &mut Vec<u8>) -> CodecTag {
        debug_assert_eq!(block.len(), BLOCK_SIZE);
        out.clear();
        let min_saving_bytes = 256;
        let compressed_len = match self {
            Codec::Lz4 => {
                out.resize(lz4_flex::block::get_maximum_output_size(BLOCK_SIZE), 0);
                lz4_flex::block::compress_into(block, out).ok()
            }
            Codec::Zstd { level } => {
                out.resize(zstd::zstd_safe::compress_bound(BLOCK_SIZE), 0);
                zstd::bulk::compress_to_buffer(block, out, level).ok()
            }
            Codec::Deflate { level } => {
                let level =
                    libdeflater::CompressionLvl::new(level).unwrap_or_else(|_| libdeflater::CompressionLvl::default());
                let mut compressor = libdeflater::Compressor::new(level);
                out.resize(compressor.deflate_compress_bound(BLOCK_SIZE), 0);
                compressor.deflate_compress(block, out).ok()
            }
        };
        match compressed_len {
            Some(len) if len + min_saving_bytes <= BLOCK_SIZE => {
                out.truncate(len);
                self.tag()
            }
            _ => {
                out.clear();
                out.extend_from_slice(block);
                CodecTag::Raw
            }
        }
    }
}

/// Decompresses a fragment into exactly one block. Any decoder error or a wrong output
/// length is a `Checksum` error: the bytes on disk are not what we wrote.
pub fn decompress_block(tag: CodecTag, input: &[u8], block: &mut [u8]) -> Result<()> {
    debug_assert_eq!(block.len(), BLOCK_SIZE);
    let ok = match tag {
        CodecTag::Raw => {
            if input.len() == BLOCK_SIZE {
                block.copy_from_slice(input);
                true
            } else {
                false
            }
        }
        CodecTag::Lz4 => matches!(lz4_flex::block::decompress_into(input, block), Ok(BLOCK_SIZE)),
        CodecTag::Zstd => matches!(zstd::bulk::decompress_to_buffer(input, block), Ok(BLOCK_SIZE)),
        CodecTag::Deflate => {
            let mut decompressor = libdeflater::Decompressor::new();
            matches!(decompressor.deflate_decompress(input, block), Ok(BLOCK_SIZE))
        }
    };
    if ok {
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
