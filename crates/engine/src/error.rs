//! One error type for the engine: a small matchable [`ErrorKind`] plus context.
//!
//! Front ends map kinds, not messages: the NBD plugin turns `OutOfRange` into EINVAL
//! (reads, trims) or ENOSPC (writes), `NoSpace` into ENOSPC, `Checksum` into EIO.

use std::fmt;

/// What went wrong, in the few classes a caller can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request reaches past the logical size.
    OutOfRange,
    /// The request is malformed (e.g. a size that is not a multiple of 4 KiB at format).
    InvalidArgument,
    /// Physical space is exhausted: a write that needs new space was refused, with no effect.
    NoSpace,
    /// A stored block failed its checksum (or could not be decoded); the read is refused.
    Checksum,
    /// The backing store failed an I/O.
    Io,
    /// The store is read-only: opened so, or an earlier sync failed and durability is unknown.
    ReadOnly,
    /// An earlier backing write failed because the backing's file system (or device) is
    /// full: the store is read-only until it is reopened with room (`zdisk format`
    /// reserves the physical size unless `--sparse`). Writes get ENOSPC, not EROFS.
    BackingFull,
    /// The file is not a zdisk store (no valid superblock).
    NotAStore,
    /// The file is shorter than its superblock says.
    Truncated,
    /// The store was written by a newer format version.
    NewerVersion,
    /// Another process has the store open.
    Locked,
    /// Format's target holds a zdisk store or other data, and `force` was not given.
    HoldsData,
    /// Metadata that should be valid is not (both checkpoint copies damaged, say).
    Corrupt,
    /// The store is encrypted and no key was given, or the key given opens no key slot.
    /// Nothing was written.
    WrongKey,
}

/// An engine error: a kind and a sentence of context (path, offset, operation).
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    context: String,
    source: Option<std::io::Error>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, context: impl Into<String>) -> Error {
        Error { kind, context: context.into(), source: None }
    }

    pub fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        let kind = if source.raw_os_error() == Some(libc::ENOSPC) { ErrorKind::NoSpace } else { ErrorKind::Io };
        Error { kind, context: context.into(), source: Some(source) }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The errno a front end should report for this error.
    pub fn errno(&self) -> i32 {
        match self.kind {
            ErrorKind::OutOfRange | ErrorKind::InvalidArgument => libc::EINVAL,
            ErrorKind::NoSpace | ErrorKind::BackingFull => libc::ENOSPC,
            ErrorKind::ReadOnly => libc::EROFS,
            ErrorKind::Locked => libc::EBUSY,
            ErrorKind::HoldsData => libc::EEXIST,
            ErrorKind::WrongKey => libc::EACCES,
            _ => libc::EIO,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            ErrorKind::OutOfRange => "out of range",
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::NoSpace => "no space left",
            ErrorKind::Checksum => "checksum mismatch",
            ErrorKind::Io => "I/O error",
            ErrorKind::ReadOnly => "store is read-only",
            ErrorKind::BackingFull => "the backing is full; store is read-only",
            ErrorKind::NotAStore => "not a zdisk store",
            ErrorKind::Truncated => "store is truncated",
            ErrorKind::NewerVersion => "store has a newer format version",
            ErrorKind::Locked => "store is in use",
            ErrorKind::HoldsData => "target holds data",
            ErrorKind::Corrupt => "store metadata is corrupt",
            ErrorKind::WrongKey => "wrong or missing key",
        };
        write!(f, "{what}: {}", self.context)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

/// No `source()`: `Display` already ends with the I/O error's text, and a chain printer
/// (anyhow's `{:#}`) would print it twice ("No such file or directory (os error 2): No such
/// file or directory (os error 2)").
impl std::error::Error for Error {}
