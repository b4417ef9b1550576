//! Keys of encrypted stores on the command line: the options every command that opens a
//! store takes, the passphrase prompt, and `zdisk key list|add|remove|change`.
//!
//! A secret never appears on a command line or in a message: key files are read from their
//! path, passphrases from the terminal (asked twice when a new one is set) or from stdin, and
//! `serve` hands them to nbdkit through a pipe, not an argument.

use std::io::{BufRead, IsTerminal};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use zdisk_engine::{KdfParams, KeyChange, Secret, SlotKind, Store};

/// How to unlock an encrypted store (plain stores need none of it).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct KeyArgs {
    /// The store's key file (at least 32 bytes; make one with `head -c 32 /dev/urandom > FILE`).
    /// Without it an encrypted store asks for its passphrase on the terminal.
    #[arg(long, value_name = "FILE", conflicts_with = "passphrase_stdin")]
    pub key_file: Option<PathBuf>,
    /// Read the passphrase from the first line of stdin instead of the terminal.
    #[arg(long)]
    pub passphrase_stdin: bool,
}

impl KeyArgs {
    /// Whether a key option was given (an encrypted store's `stat` reads only the
    /// checkpoint's numbers without one, rather than asking).
    pub fn given(&self) -> bool {
        self.key_file.is_some() || self.passphrase_stdin
    }

    /// The secret that opens `store`: none for a plain store (given options are refused
    /// there by the engine, with a clear error), else from the options or the terminal.
    pub fn secret_for(&self, store: &Path) -> Result<Option<Arc<Secret>>> {
        let info = Store::info(store).with_context(|| format!("reading {}", store.display()))?;
        if !info.encrypted && !self.given() {
            return Ok(None);
        }
        let prompt = format!("Passphrase for {}: ", store.display());
        Ok(Some(Arc::new(self.read(&prompt, false)?)))
    }

    /// [`KeyArgs::secret_for`], but none when the store is being served (the caller then
    /// talks to the server, which holds the key).
    pub fn secret_unless_served(&self, store: &Path) -> Result<Option<Arc<Secret>>> {
        if crate::runtime::store_is_locked(store, zdisk_engine::Lock::Shared)? {
            return Ok(None);
        }
        self.secret_for(store)
    }

    /// The secret these options name, or a passphrase from the terminal (`confirm`: asked
    /// twice, for a new one).
    pub fn read(&self, prompt: &str, confirm: bool) -> Result<Secret> {
        if let Some(path) = &self.key_file {
            let bytes = std::fs::read(path).with_context(|| format!("reading key file {}", path.display()))?;
            return Ok(Secret::key_file(bytes));
        }
        if self.passphrase_stdin {
            return Ok(Secret::passphrase(read_stdin_line()?));
        }
        if !std::io::stdin().is_terminal() {
            bail!("the store is encrypted: give --key-file FILE or --passphrase-stdin (stdin is not a terminal)");
        }
        let first = rpassword::prompt_password(prompt).context("reading the passphrase")?;
        if confirm {
            let again = rpassword::prompt_password("Again: ").context("reading the passphrase")?;
            if again != first {
                bail!("the two passphrases differ");
            }
        }
        Ok(Secret::passphrase(first.into_bytes()))
    }
}

fn read_stdin_line() -> Result<Vec<u8>> {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).context("reading the passphrase from stdin")?;
    let line = line.strip_suffix('\n').unwrap_or(&line);
    let line = line.strip_suffix('\r').unwrap_or(line);
    if line.is_empty() {
        bail!("no passphrase on stdin");
    }
    Ok(line.as_bytes().to_vec())
}

/// Argon2id's cost for a new passphrase slot.
#[derive(Debug, Clone, clap::Args)]
pub struct KdfArgs {
    /// Argon2id memory per passphrase unlock, in MiB (memory-hard: what a guesser pays per try).
    #[arg(long, value_name = "MIB", default_value_t = KdfParams::DEFAULT.memory_kib / 1024)]
    pub kdf_memory: u32,
    /// Argon2id passes over that memory.
    #[arg(long, value_name = "N", default_value_t = KdfParams::DEFAULT.iterations)]
    pub kdf_iterations: u32,
    /// Argon2id lanes (threads).
    #[arg(long, value_name = "N", default_value_t = KdfParams::DEFAULT.parallelism)]
    pub kdf_parallelism: u32,
}

impl KdfArgs {
    pub fn params(&self) -> KdfParams {
        KdfParams {
            memory_kib: self.kdf_memory.saturating_mul(1024),
            iterations: self.kdf_iterations,
            parallelism: self.kdf_parallelism,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct KeyCmdArgs {
    #[command(subcommand)]
    pub action: KeyAction,
}

#[derive(Debug, clap::Subcommand)]
pub enum KeyAction {
    /// List the key slots (no key needed).
    List { store: PathBuf },
    /// Add a key slot: the data key wrapped under a new passphrase or key file.
    Add(KeyChangeArgs),
    /// Empty a key slot (never the last one). Removing the slot the given key opens —
    /// after which that key no longer opens the store — asks first (or needs --yes).
    Remove {
        store: PathBuf,
        /// The slot to empty (`zdisk key list` shows them).
        #[arg(long)]
        slot: usize,
        /// Remove the slot the given key opens without asking.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        key: KeyArgs,
    },
    /// Change the passphrase or key file of the slot the current one opens.
    Change(KeyChangeArgs),
}

#[derive(Debug, clap::Args)]
pub struct KeyChangeArgs {
    pub store: PathBuf,
    /// How to unlock the store now.
    #[command(flatten)]
    pub key: KeyArgs,
    /// The new key file (else a new passphrase, on the terminal or, with
    /// --new-passphrase-stdin, stdin's next line).
    #[arg(long, value_name = "FILE", conflicts_with = "new_passphrase_stdin")]
    pub new_key_file: Option<PathBuf>,
    /// Read the new passphrase from stdin (after the current one, when that comes from stdin too).
    #[arg(long)]
    pub new_passphrase_stdin: bool,
    #[command(flatten)]
    pub kdf: KdfArgs,
}

impl KeyChangeArgs {
    fn new_secret(&self) -> Result<Secret> {
        KeyArgs { key_file: self.new_key_file.clone(), passphrase_stdin: self.new_passphrase_stdin }
            .read("New passphrase: ", true)
    }
}

/// Asks on the terminal before the slot the given key opens is removed; refuses without
/// one (`--yes` says it on the command line).
fn confirm_removing_own_slot(store: &Path, slot: usize) -> Result<()> {
    use std::io::Write;
    let warning = format!(
        "slot {slot} is the one this key opens: once it is removed, this key no longer opens {} (the other \
         slots' keys still do)",
        store.display()
    );
    if !std::io::stdin().is_terminal() {
        return Err(crate::Usage(format!("{warning}; give --yes to remove it")).into());
    }
    eprint!("{warning}. Remove it? [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    if !matches!(answer.trim(), "y" | "Y" | "yes") {
        bail!("slot {slot} kept");
    }
    Ok(())
}

pub fn run(args: &KeyCmdArgs) -> Result<()> {
    let (store, slots) = match &args.action {
        KeyAction::List { store } => (store, key_slots(store)?),
        KeyAction::Add(change) | KeyAction::Change(change) => {
            ready_for_key_change(&change.store)?;
            let current = change.key.read(&format!("Passphrase for {}: ", change.store.display()), false)?;
            let new = change.new_secret()?;
            let kdf = change.kdf.params();
            let what = match &args.action {
                KeyAction::Add(_) => KeyChange::Add { new: &new, kdf },
                _ => KeyChange::Change { new: &new, kdf },
            };
            (&change.store, changed(&change.store, &current, what)?)
        }
        KeyAction::Remove { store, slot, yes, key } => {
            ready_for_key_change(store)?;
            let current = key.read(&format!("Passphrase for {}: ", store.display()), false)?;
            let own =
                Store::slot_opened_by(store, &current).map_err(|e| anyhow::anyhow!("{}: {e}", store.display()))?;
            // (The last slot the engine refuses to remove anyway, and says so.)
            if own == *slot && !yes && key_slots(store)?.len() > 1 {
                confirm_removing_own_slot(store, *slot)?;
            }
            (store, changed(store, &current, KeyChange::Remove { slot: *slot })?)
        }
    };
    if slots.is_empty() {
        bail!("{} is not encrypted: it has no key slots", store.display());
    }
    for slot in slots {
        match (slot.kind, slot.kdf) {
            (SlotKind::Passphrase, Some(kdf)) => println!(
                "slot {}: passphrase (Argon2id, {} MiB, {} passes, {} lanes)",
                slot.index,
                kdf.memory_kib / 1024,
                kdf.iterations,
                kdf.parallelism
            ),
            (SlotKind::Passphrase, None) => println!("slot {}: passphrase", slot.index),
            (SlotKind::KeyFile, _) => println!("slot {}: key file", slot.index),
        }
    }
    Ok(())
}

/// Key slots change only in an encrypted store (a plain one was answered "the store is
/// encrypted: give --key-file …"), and only while it is closed: a server holds its own copy
/// of the key header (its nonce lease rewrites it). Said before any passphrase is asked for.
fn ready_for_key_change(store: &Path) -> Result<()> {
    if key_slots(store)?.is_empty() {
        bail!("{} is not encrypted: it has no key slots", store.display());
    }
    if crate::runtime::store_is_locked(store, zdisk_engine::Lock::Shared)? {
        bail!(
            "{} is being served (or open in another process): stop the server (or `zdisk detach`) before changing its key slots",
            store.display()
        );
    }
    Ok(())
}

fn key_slots(store: &Path) -> Result<Vec<zdisk_engine::SlotInfo>> {
    Store::key_slots(store).with_context(|| format!("reading {}", store.display()))
}

fn changed(store: &Path, current: &Secret, change: KeyChange<'_>) -> Result<Vec<zdisk_engine::SlotInfo>> {
    Store::change_keys(store, current, change).with_context(|| format!("changing the key slots of {}", store.display()))
}
