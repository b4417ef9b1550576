//! Encryption at rest (`docs/format.md`, "Encryption"; threat model in
//! `docs/guarantees.md`): compress first, then encrypt and authenticate.
//!
//! - `keys.rs`: the key header — a random 256-bit data key per store, wrapped in up to eight
//!   key slots by a key-encryption key taken from a passphrase (Argon2id) or a key file; the
//!   nonce lease.
//! - `cipher.rs`: what the store does with the data key — every fragment (data block, map
//!   page) sealed with AES-256-GCM-SIV after compression; checkpoints and superblocks
//!   authenticated with HMAC-SHA-256.
//!
//! Invariants:
//! - Key material lives only in [`DataKey`] and [`Secret`], which zeroize on drop and never
//!   print their bytes (`Debug` shows a placeholder), and in a `StoreCipher`'s derived keys,
//!   which sit in locked memory ([`KeyMemoryLock`]) and zeroize on drop.
//! - No nonce is used twice under one data key: every seal takes the next value of a 64-bit
//!   counter whose range was made durable in the key header before its first use
//!   (`keys::KeyHeader::lease`), so a crashed run's values are never handed out again.

mod aead;
pub mod cipher;
pub mod keys;

/// Once per process, before the first key material exists (a key header created or
/// unlocked, a derived key): marks the process not dumpable (`PR_SET_DUMPABLE` 0: no core
/// file, no ptrace or /proc/PID/mem by other users) and locks all its memory, present and
/// future, as it is touched (`mlockall(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT)`, as
/// cryptsetup does): key material the store cannot place itself — AES-GCM-SIV's key
/// schedule inside AWS-LC's allocation, Argon2id's working memory, transient copies on the
/// stack — then never reaches swap either. Only where no limit can make a later allocation
/// fail: with a finite `RLIMIT_MEMLOCK` and no `CAP_IPC_LOCK` a locked process's
/// allocations past the limit fail, so there it is skipped with a warning (the derived keys
/// are still locked one by one, `KeyMemoryLock`). `ZDISK_LOCK_MEMORY=off` skips it.
pub(crate) fn protect_process() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Err(e) = rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable) {
            tracing::warn!("could not exclude the process from core dumps: {e}");
        }
        match lock_all_memory() {
            Ok(()) => tracing::debug!("process memory locked (mlockall)"),
            Err(why) => tracing::warn!(
                "process memory not locked ({why}): AES-GCM-SIV's key schedule and transient key copies \
                 may reach swap; use encrypted swap, or run with CAP_IPC_LOCK or an unlimited RLIMIT_MEMLOCK"
            ),
        }
    });
}

fn lock_all_memory() -> std::result::Result<(), String> {
    use rustix::mm::{mlockall, MlockAllFlags};
    if !crate::store::options::lock_memory_from_env() {
        return Err("ZDISK_LOCK_MEMORY=off".into());
    }
    let unlimited = rustix::process::getrlimit(rustix::process::Resource::Memlock).current.is_none();
    let capable = rustix::thread::capabilities(None)
        .is_ok_and(|sets| sets.effective.contains(rustix::thread::CapabilitySet::IPC_LOCK));
    if !unlimited && !capable {
        return Err("RLIMIT_MEMLOCK is finite and the process lacks CAP_IPC_LOCK".into());
    }
    mlockall(MlockAllFlags::CURRENT | MlockAllFlags::FUTURE | MlockAllFlags::ONFAULT)
        .map_err(|e| format!("mlockall: {e}"))
}

/// Keeps a value holding key material out of swap and core dumps for as long as it lives:
/// `protect_process`, and its own pages locked in memory (`mlock`, in case the process
/// could not lock all of it; a refusal — `RLIMIT_MEMLOCK` — is logged, the store still
/// opens). Drop it after the value (declare it after the value in a struct) so the key is
/// zeroized before its pages unlock.
pub(crate) struct KeyMemoryLock {
    _locked: Option<region::LockGuard>,
}

impl KeyMemoryLock {
    pub(crate) fn new<T>(value: &T) -> KeyMemoryLock {
        protect_process();
        let locked = region::lock(value as *const T, std::mem::size_of::<T>())
            .map_err(|e| tracing::warn!("could not lock key memory (raise RLIMIT_MEMLOCK): {e}"))
            .ok();
        KeyMemoryLock { _locked: locked }
    }
}

use zeroize::{Zeroize, Zeroizing};

/// Bytes of the data key and of every derived key.
pub const KEY_BYTES: usize = 32;

/// A store's data key: random at format, never changed (a key slot change rewraps it).
#[derive(Clone)]
pub struct DataKey(Zeroizing<[u8; KEY_BYTES]>);

impl DataKey {
    pub fn from_bytes(bytes: [u8; KEY_BYTES]) -> DataKey {
        DataKey(Zeroizing::new(bytes))
    }

    /// A fresh key from the operating system's random source.
    pub fn random() -> crate::Result<DataKey> {
        let mut bytes = Zeroizing::new([0u8; KEY_BYTES]);
        fill_random(bytes.as_mut())?;
        Ok(DataKey(bytes))
    }

    pub fn bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }
}

impl std::fmt::Debug for DataKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DataKey(..)")
    }
}

/// What unlocks a key slot: a passphrase (stretched with Argon2id) or the contents of a key
/// file (at least 32 bytes, used through HKDF-SHA-256; a key file should be random, e.g.
/// `head -c 32 /dev/urandom`).
pub enum Secret {
    Passphrase(Zeroizing<Vec<u8>>),
    KeyFile(Zeroizing<Vec<u8>>),
}

impl Secret {
    pub fn passphrase(bytes: Vec<u8>) -> Secret {
        Secret::Passphrase(Zeroizing::new(bytes))
    }

    pub fn key_file(bytes: Vec<u8>) -> Secret {
        Secret::KeyFile(Zeroizing::new(bytes))
    }
}

impl Secret {
    /// The secret's bytes (to hand them to a server through a pipe; never print them).
    pub fn expose_bytes(&self) -> &[u8] {
        match self {
            Secret::Passphrase(bytes) | Secret::KeyFile(bytes) => bytes,
        }
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Secret::Passphrase(_) => f.write_str("Secret::Passphrase(..)"),
            Secret::KeyFile(_) => f.write_str("Secret::KeyFile(..)"),
        }
    }
}

/// Fills `out` from the operating system's random source.
pub(crate) fn fill_random(out: &mut [u8]) -> crate::Result<()> {
    getrandom::getrandom(out).map_err(|e| {
        out.zeroize();
        crate::Error::new(crate::ErrorKind::Io, format!("reading the random source: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Locked kB of this process, from /proc/self/status.
    fn locked_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmLck:")).expect("a VmLck line");
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[test]
    fn key_memory_is_locked_and_the_process_not_dumpable() {
        let keys = Box::new([0x42u8; 3 * 4096]);
        let lock = KeyMemoryLock::new(keys.as_ref());
        assert_eq!(
            rustix::process::dumpable_behavior().unwrap(),
            rustix::process::DumpableBehavior::NotDumpable,
            "a process holding keys must not dump core"
        );
        // Under the default RLIMIT_MEMLOCK (8 MiB) or as root, the pages lock.
        assert!(lock._locked.is_some(), "could not lock 12 KiB of key memory (RLIMIT_MEMLOCK?)");
        assert!(locked_kib() >= 12, "VmLck {} kB", locked_kib());
        drop(lock);
    }
}
