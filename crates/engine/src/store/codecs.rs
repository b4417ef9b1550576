//! The codec side of an open store: the table of trained dictionaries (what its
//! checkpoints carry, the one GC compresses with, every one a fragment may name —
//! `dictionaries.rs` trains, installs and frees them), the codec counters, and the cores
//! the store's codec may keep busy.

use std::sync::Arc;

use crate::codec::{Dictionary, DictionarySet};
use crate::crypto::cipher::{Domain, StoreCipher, SEAL_OVERHEAD_BYTES};
use crate::error::Result;
use crate::format::DictionaryEntry;
use crate::stats::CodecCounters;

pub(crate) struct Codecs {
    /// The trained dictionaries. Outside the lock order: held only to read or swap `Arc`s,
    /// never while taking another lock.
    pub dictionaries: parking_lot::RwLock<DictionaryState>,
    /// Codec choices and recompression since open, and the fallback's load signal (shared
    /// with the log, which counts recompressed fragments as it appends them).
    pub counters: Arc<CodecCounters>,
    /// Cores the store's codec may keep busy before host writes fall back to LZ4
    /// (`OpenOptions::codec_cores`, checked at open, else `codec::default_codec_cores`).
    pub cores: usize,
    /// The cores the process may run on (`codec::available_cores`, at open): when every one
    /// is busy and the disk is starved, host blocks are stored uncompressed for now.
    pub available_cores: usize,
    /// Threads that compress runs of a large request beside its writer (`cores - 1` of
    /// them; none with one codec core): persistent, so each keeps its codec contexts.
    pub helpers: Option<rayon::ThreadPool>,
}

#[derive(Debug, Default)]
pub(crate) struct DictionaryState {
    /// What the next checkpoint carries, ascending by id.
    pub table: Vec<Arc<Dictionary>>,
    /// The dictionary GC compresses with: the newest in the table, once both retained
    /// checkpoints carry it.
    pub newest: Option<Arc<Dictionary>>,
    /// Every dictionary a fragment may name: the table and those dropped from it since open.
    pub known: Arc<DictionarySet>,
    /// The id the next trained dictionary gets.
    pub next_id: u32,
    /// The log's next sequence number when `newest` became GC's (and every GC that began
    /// before had finished): a segment first used from then on holds no fragment of an
    /// older dictionary, but a damaged one GC moved as it is (which reads fail anyway).
    /// Carried by the checkpoint, so a later run need not look at the segments written
    /// since. 0: not known (yet) — then every segment may hold an older one's fragments.
    pub newest_since_seq: u64,
    /// The `since_seq` each dictionary of the table had when loaded (0: not known).
    pub loaded_since_seq: std::collections::BTreeMap<u32, u64>,
}

impl DictionaryState {
    /// The state a checkpoint's table gives at open. The newest dictionary is not usable
    /// until a checkpoint written by this run carries it too (`Store::open_backing`).
    /// The table a checkpoint carried (an encrypted store's dictionaries sealed: a trained
    /// dictionary is made of the store's own data).
    pub fn recovered(entries: &[DictionaryEntry], cipher: Option<&StoreCipher>) -> Result<DictionaryState> {
        let table = entries
            .iter()
            .map(|e| {
                let bytes = match cipher {
                    Some(c) => c.open(Domain::Dictionary, e.id as u64, 0, &e.bytes, 0)?,
                    None => e.bytes.clone(),
                };
                Dictionary::new(e.id, e.level, bytes).map(Arc::new)
            })
            .collect::<Result<Vec<_>>>()?;
        let next_id = table.last().map_or(1, |d| d.id + 1);
        let known = Arc::new(DictionarySet::new(table.clone()));
        let loaded_since_seq = entries.iter().map(|e| (e.id, e.since_seq)).collect();
        Ok(DictionaryState { table, newest: None, known, next_id, newest_since_seq: 0, loaded_since_seq })
    }

    /// Bytes the table takes in a checkpoint, at most.
    pub fn table_bytes_max(&self) -> u64 {
        crate::format::dictionary_table_bytes_max(self.table.iter().map(|d| d.bytes.len()))
    }

    /// The table as the checkpoint writes it (sealed in an encrypted store).
    pub fn entries(&self, cipher: Option<&StoreCipher>) -> Result<Vec<DictionaryEntry>> {
        self.table
            .iter()
            .map(|d| {
                let bytes = match cipher {
                    Some(c) => {
                        let mut sealed = Vec::with_capacity(d.bytes.len() + SEAL_OVERHEAD_BYTES);
                        c.seal(Domain::Dictionary, d.id as u64, 0, &d.bytes, &mut sealed)?;
                        sealed
                    }
                    None => d.bytes.clone(),
                };
                Ok(DictionaryEntry { id: d.id, level: d.level, since_seq: self.since_seq_of(d.id), bytes })
            })
            .collect()
    }

    /// The sequence number from which segments hold no fragment of a dictionary older than
    /// `id` (0: not known).
    pub fn since_seq_of(&self, id: u32) -> u64 {
        match &self.newest {
            Some(newest) if newest.id == id => self.newest_since_seq,
            _ => self.loaded_since_seq.get(&id).copied().unwrap_or(0),
        }
    }
}
