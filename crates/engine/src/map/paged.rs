//! The paged block map: a radix tree of 512-slot pages on the backing store, cached in
//! memory under a byte budget, with changes kept beside the pages until a checkpoint writes
//! them (`docs/format.md`, "Map pages"; `docs/scale.md` for the costs).
//!
//! Each page in memory has a state: the version it starts from (`pointer`: a page fragment
//! on disk, or a constant — UNMAPPED, ZERO, LOST — that every slot of the subtree reads
//! as), that version's body when cached, and the changes made since: `pending` (newer than
//! the checkpoint being written, if any) and `frozen` (the checkpoint being written takes
//! them). A slot reads as its pending change, else its frozen change, else the base. Writes
//! never read a page: a change is recorded blind.
//!
//! Accounting (the segment table's live bytes, the stored/zero block counts) follows the
//! rule "a change owes the removal of the value beneath it": the value it replaced in the
//! same layer is removed at once; the value beneath it (frozen change or base) is removed
//! at once when known without I/O (`settled`), else when the checkpoint merges the change
//! into a new page version, or when GC settles the page. So counts are never too low — a
//! segment is never freed while the map points into it — and exact after every checkpoint.
//!
//! Invariants:
//! - A state's `pointer`, when known, equals its parent's effective slot value (or the
//!   root), except that a checkpoint installs a new page version and sets the parent's
//!   frozen slot under one hold of the tree lock.
//! - A whole subtree is replaced by a constant (a large trim or write-zeroes) only if no
//!   page in it has a state that is not clean; its old contents are owed as a walk of the
//!   old subtree, done when the parent's change is merged.
//! - Memory: page bodies are evicted (CLOCK) to keep the total under the budget; changes
//!   are bounded by checkpoints (`wants_checkpoint`, `must_checkpoint`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::page::{self, PageBody, PageId, PAGE_SLOTS};
use super::{Entry, PackedEntry, Stored};
use crate::error::Result;
use crate::store::lock::{Mutex, MutexGuard, Rank};
use crate::types::Lba;

/// Memory one cached page body costs (the body and its allocation).
const BODY_BYTES: usize = std::mem::size_of::<PageBody>() + 64;
/// Memory one page state costs besides its body and changes (map node included).
const STATE_BYTES: usize = 160;
/// Memory one change costs.
const CHANGE_BYTES: usize = std::mem::size_of::<Change>();

/// Where page fragments are read from (the store: its segment buffers, else the backing).
pub(crate) trait PageSource {
    /// The stored bytes of each page fragment, in order. An I/O error is an error; bytes
    /// that do not decode are the caller's to judge.
    fn read_fragments(&self, at: &[Stored]) -> Result<Vec<Vec<u8>>>;

    /// An encrypted store's cipher: its pages are sealed.
    fn cipher(&self) -> Option<&crate::crypto::cipher::StoreCipher> {
        None
    }

    /// The use of the segment holding byte `address` (what an encrypted store's placement
    /// tags bind besides the address; `Inner::segment_use`).
    fn segment_use(&self, _address: u64) -> crate::crypto::cipher::SegmentUse {
        crate::crypto::cipher::SegmentUse::default()
    }
}

/// Whether an entry joins or leaves the map, for [`Accounting`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delta {
    Add,
    Remove,
}

/// What the map tells the segment table as entries come and go.
pub(crate) trait Accounting {
    fn entry(&mut self, entry: PackedEntry, delta: Delta);
    /// `blocks` blocks of a constant (a replaced subtree) join or leave.
    fn constant(&mut self, value: PackedEntry, blocks: u64, delta: Delta);
}

/// A change to one slot, not yet in a written page version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Change {
    pub value: u64,
    pub slot: u16,
    /// The value beneath it was removed from the accounting already.
    pub settled: bool,
}

/// A page version's body in memory.
#[derive(Debug, Clone)]
pub(crate) enum Base {
    Absent,
    Loaded(Arc<PageBody>),
    /// The page failed its checksum: every slot reads as LOST.
    Damaged,
}

#[derive(Debug)]
pub(crate) struct PageState {
    /// The version the changes apply to: a page pointer or a constant; None until looked up.
    pub pointer: Option<u64>,
    pub base: Base,
    pub pending: Vec<Change>,
    pub frozen: Vec<Change>,
    /// Interior pages: old subtrees replaced by a constant, owed as a walk (slot, pointer).
    pub pending_walks: Vec<(u16, u64)>,
    pub frozen_walks: Vec<(u16, u64)>,
    /// GC found this page's current version in a victim: rewrite it at the next checkpoint.
    pub force: bool,
    /// The checkpoint being written rewrites this page.
    pub rewrite: bool,
    pub pins: u32,
    referenced: bool,
}

impl PageState {
    fn new(pointer: Option<u64>) -> PageState {
        PageState {
            pointer,
            base: Base::Absent,
            pending: Vec::new(),
            frozen: Vec::new(),
            pending_walks: Vec::new(),
            frozen_walks: Vec::new(),
            force: false,
            rewrite: false,
            pins: 0,
            referenced: true,
        }
    }

    /// The value of `slot` in the version the changes apply to, if known without I/O.
    pub fn base_value(&self, slot: usize) -> Option<u64> {
        let pointer = self.pointer?;
        if is_constant(pointer) {
            return Some(pointer);
        }
        match &self.base {
            Base::Loaded(body) => Some(body[slot]),
            Base::Damaged => Some(PackedEntry::LOST.0),
            Base::Absent => None,
        }
    }

    /// The slot's current value, if known without I/O.
    pub fn value(&self, slot: usize) -> Option<u64> {
        find(&self.pending, slot)
            .or_else(|| find(&self.frozen, slot))
            .map(|c| c.value)
            .or_else(|| self.base_value(slot))
    }

    fn is_dirty(&self) -> bool {
        !self.pending.is_empty() || !self.pending_walks.is_empty() || self.force
    }

    /// Nothing in it but a cached copy of a version on disk (or a constant): droppable.
    fn is_clean(&self) -> bool {
        self.pending.is_empty()
            && self.frozen.is_empty()
            && self.pending_walks.is_empty()
            && self.frozen_walks.is_empty()
            && !self.force
            && !self.rewrite
            && self.pins == 0
            && self.pointer.is_some()
    }

    fn memory_bytes(&self) -> usize {
        let body = if matches!(self.base, Base::Loaded(_)) { BODY_BYTES } else { 0 };
        let changes = self.pending.len() + self.frozen.len() + self.pending_walks.len() + self.frozen_walks.len();
        STATE_BYTES + body + changes * CHANGE_BYTES
    }
}

pub(crate) fn find(changes: &[Change], slot: usize) -> Option<&Change> {
    changes.binary_search_by_key(&(slot as u16), |c| c.slot).ok().map(|i| &changes[i])
}

/// Whether a slot value is a constant for its whole subtree (not a page pointer).
pub(crate) fn is_constant(value: u64) -> bool {
    !matches!(PackedEntry(value).unpack(), Ok(Entry::Stored(_)))
}

/// Blocks a page at `level` maps.
pub(crate) fn span_blocks(level: u8) -> u64 {
    1u64 << (9 * (level as u32 + 1))
}

/// Everything the tree lock guards.
pub(crate) struct Tree {
    /// Pointer of the top page (level `height - 1`, index 0).
    pub root: u64,
    pub height: u8,
    pub states: BTreeMap<PageId, PageState>,
    /// Pages with pending changes, walks or a forced rewrite.
    pub dirty: BTreeSet<PageId>,
    pub memory_bytes: usize,
    pub change_count: usize,
    hand: Option<PageId>,
}

/// What a lookup found.
pub(crate) enum Lookup {
    Value(u64),
    /// The page's version at this pointer must be read.
    NeedBase(PageId, u64),
    /// The page's pointer must be looked up in its parent.
    NeedPointer(PageId),
}

impl Tree {
    pub fn top(&self) -> PageId {
        PageId { level: self.height - 1, index: 0 }
    }

    /// A page's pointer, if known without I/O: its state's, else its parent's slot value,
    /// else a constant an ancestor holds for the whole subtree.
    pub fn cheap_pointer(&self, id: PageId) -> Option<u64> {
        if let Some(pointer) = self.states.get(&id).and_then(|s| s.pointer) {
            return Some(pointer);
        }
        if id == self.top() {
            return Some(self.root);
        }
        let (parent, slot) = id.parent();
        match self.states.get(&parent) {
            Some(state) => state.value(slot),
            None => self.cheap_pointer(parent).filter(|&p| is_constant(p)),
        }
    }

    /// The value of `slot` of page `id`, or what must be read to know it.
    pub fn lookup(&mut self, id: PageId, slot: usize) -> Lookup {
        if let Some(state) = self.states.get_mut(&id) {
            state.referenced = true;
            if let Some(v) = state.value(slot) {
                return Lookup::Value(v);
            }
            return match state.pointer {
                Some(pointer) => Lookup::NeedBase(id, pointer),
                None => Lookup::NeedPointer(id),
            };
        }
        match self.cheap_pointer(id) {
            Some(pointer) if is_constant(pointer) => Lookup::Value(pointer),
            Some(pointer) => Lookup::NeedBase(id, pointer),
            None => Lookup::NeedPointer(id),
        }
    }

    /// The state of page `id`, created (with the pointer known so far) if absent.
    pub fn state_mut(&mut self, id: PageId) -> &mut PageState {
        if !self.states.contains_key(&id) {
            let pointer = self.cheap_pointer(id);
            self.memory_bytes += STATE_BYTES;
            self.states.insert(id, PageState::new(pointer));
        }
        self.states.get_mut(&id).expect("just inserted")
    }

    /// Runs `f` on a state and keeps the memory, change and dirty counts in step.
    pub fn with_state<R>(&mut self, id: PageId, f: impl FnOnce(&mut PageState) -> R) -> R {
        let state = self.state_mut(id);
        let (bytes, changes) = (state.memory_bytes(), change_len(state));
        let out = f(state);
        let (bytes_after, changes_after, dirty) = (state.memory_bytes(), change_len(state), state.is_dirty());
        self.memory_bytes = self.memory_bytes + bytes_after - bytes;
        self.change_count = self.change_count + changes_after - changes;
        if dirty {
            self.dirty.insert(id);
        } else {
            self.dirty.remove(&id);
        }
        out
    }

    /// Records `value` for a leaf slot (no I/O).
    pub fn set(&mut self, lba: Lba, value: u64, acct: &mut dyn Accounting) {
        let (id, slot) = PageId::leaf_of(lba);
        self.with_state(id, |state| set_slot(state, slot, value, acct));
        acct.entry(PackedEntry(value), Delta::Add);
    }

    /// Installs a page version read from disk, if the state still starts from it.
    pub fn install(&mut self, id: PageId, pointer: u64, base: Base) {
        let exists = self.states.contains_key(&id);
        if !exists && self.cheap_pointer(id) != Some(pointer) {
            return; // the page moved on meanwhile
        }
        self.with_state(id, |state| {
            if state.pointer.is_none() {
                state.pointer = Some(pointer);
            }
            if state.pointer == Some(pointer) && matches!(state.base, Base::Absent) {
                state.base = base;
            }
        });
    }

    /// Whether any page of the subtree of `id` (itself included) has a state.
    pub fn any_state_within(&self, id: PageId) -> bool {
        (0..=id.level).any(|level| {
            let shift = 9 * (id.level - level) as u32;
            let first = PageId { level, index: id.index << shift };
            let end = PageId { level, index: (id.index + 1) << shift };
            self.states.range(first..end).next().is_some()
        })
    }

    /// Drops the clean states inside the subtree of `id` (they are about to go stale);
    /// returns whether none that is not clean remains.
    pub fn clear_subtree(&mut self, id: PageId) -> bool {
        for level in 0..=id.level {
            let shift = 9 * (id.level - level) as u32;
            let first = PageId { level, index: id.index << shift };
            let end = PageId { level, index: (id.index + 1) << shift };
            let inside: Vec<PageId> = self.states.range(first..end).map(|(&k, _)| k).collect();
            for k in inside {
                if !self.states[&k].is_clean() {
                    return false;
                }
                self.drop_state(k);
            }
        }
        true
    }

    fn drop_state(&mut self, id: PageId) {
        if let Some(state) = self.states.remove(&id) {
            self.memory_bytes -= state.memory_bytes();
            self.change_count -= change_len(&state);
            self.dirty.remove(&id);
        }
    }

    /// Evicts cached bodies (and clean states) until memory is under `budget` or nothing
    /// more can go: CLOCK, a referenced page gets a second chance.
    pub fn evict(&mut self, budget: usize) -> u64 {
        let mut evicted = 0;
        let mut visited = 0;
        let limit = 2 * self.states.len();
        while self.memory_bytes > budget && visited < limit {
            let next = match self.hand {
                Some(hand) => self.states.range((std::ops::Bound::Excluded(hand), std::ops::Bound::Unbounded)).next(),
                None => self.states.iter().next(),
            }
            .map(|(&k, _)| k);
            let Some(id) = next.or_else(|| self.states.keys().next().copied()) else { break };
            self.hand = Some(id);
            visited += 1;
            let state = self.states.get_mut(&id).expect("a state");
            if state.referenced {
                state.referenced = false;
                continue;
            }
            if state.pins > 0 {
                continue;
            }
            if matches!(state.base, Base::Loaded(_)) {
                state.base = Base::Absent;
                self.memory_bytes -= BODY_BYTES;
                evicted += 1;
            }
            if self.states[&id].is_clean() && !matches!(self.states[&id].base, Base::Damaged) {
                self.drop_state(id);
            }
        }
        evicted
    }
}

fn change_len(state: &PageState) -> usize {
    state.pending.len() + state.frozen.len() + state.pending_walks.len() + state.frozen_walks.len()
}

/// Sets a slot's pending value: the pending value it replaces is removed now; the value
/// beneath is removed now if known (frozen change, or cached base), else owed.
pub(crate) fn set_slot(state: &mut PageState, slot: usize, value: u64, acct: &mut dyn Accounting) {
    match state.pending.binary_search_by_key(&(slot as u16), |c| c.slot) {
        Ok(i) => {
            acct.entry(PackedEntry(state.pending[i].value), Delta::Remove);
            state.pending[i].value = value;
        }
        Err(i) => {
            let beneath = find(&state.frozen, slot).map(|c| c.value).or_else(|| {
                // A cached base value is settled at once unless a frozen change owes it.
                state.base_value(slot)
            });
            if let Some(old) = beneath {
                acct.entry(PackedEntry(old), Delta::Remove);
            }
            state.pending.insert(i, Change { value, slot: slot as u16, settled: beneath.is_some() });
        }
    }
}

/// Map statistics, for `zdisk stat` and the metrics.
#[derive(Debug, Clone, Copy, Default)]
pub struct MapStats {
    pub cache_bytes: u64,
    pub cache_budget_bytes: u64,
    pub cached_pages: u64,
    pub dirty_pages: u64,
    pub pending_changes: u64,
    pub hits: u64,
    pub misses: u64,
    pub damaged_pages: u64,
}

/// The block map of an open store.
pub(crate) struct PagedMap {
    block_count: u64,
    pub(crate) tree: Mutex<Tree>,
    budget_bytes: usize,
    hits: AtomicU64,
    misses: AtomicU64,
    damaged_pages: AtomicU64,
}

/// Pages with changes past which a checkpoint is wanted, and past which writers wait for one.
pub(crate) const DIRTY_PAGES_SOFT: usize = 16384;
pub(crate) const DIRTY_PAGES_HARD: usize = 32768;
/// Change memory never limits below this, however small the cache.
const CHANGE_BYTES_FLOOR: usize = 4 << 20;

impl PagedMap {
    pub fn new(block_count: u64, height: u8, root: u64, budget_bytes: usize) -> PagedMap {
        assert!(height >= page::height_for(block_count));
        let tree = Tree {
            root,
            height,
            states: BTreeMap::new(),
            dirty: BTreeSet::new(),
            memory_bytes: 0,
            change_count: 0,
            hand: None,
        };
        PagedMap {
            block_count,
            tree: Mutex::new(Rank::MapTree, tree),
            budget_bytes,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            damaged_pages: AtomicU64::new(0),
        }
    }

    pub fn block_count(&self) -> u64 {
        self.block_count
    }

    pub fn lock(&self) -> MutexGuard<'_, Tree> {
        self.tree.lock()
    }

    /// The entry of one block, reading map pages as needed.
    pub fn get(&self, lba: Lba, src: &dyn PageSource) -> Result<PackedEntry> {
        let (id, slot) = PageId::leaf_of(lba);
        self.slot_value(id, slot, src).map(PackedEntry)
    }

    /// The entries of `count` blocks from `first` (one lock hold per page in the common case).
    pub fn get_range(&self, first: Lba, count: u64, src: &dyn PageSource) -> Result<Vec<PackedEntry>> {
        let mut out = Vec::with_capacity(count as usize);
        let mut lba = first.0;
        let end = first.0 + count;
        let mut hits = 0;
        while lba < end {
            let need = {
                let mut tree = self.tree.lock();
                loop {
                    if lba == end {
                        break None;
                    }
                    let (id, slot) = PageId::leaf_of(Lba(lba));
                    match tree.lookup(id, slot) {
                        Lookup::Value(v) => {
                            out.push(PackedEntry(v));
                            hits += (slot == 0 || lba == first.0) as u64;
                            lba += 1;
                        }
                        other => break Some(other),
                    }
                }
            };
            match need {
                None => {}
                Some(need) => self.resolve(need, src)?,
            }
        }
        self.hits.fetch_add(hits, Ordering::Relaxed);
        Ok(out)
    }

    /// The entry of one block if known without I/O.
    pub fn peek(&self, lba: Lba) -> Option<PackedEntry> {
        let (id, slot) = PageId::leaf_of(lba);
        match self.tree.lock().lookup(id, slot) {
            Lookup::Value(v) => Some(PackedEntry(v)),
            _ => None,
        }
    }

    /// Slot `slot` of page `id`, reading pages as needed.
    pub fn slot_value(&self, id: PageId, slot: usize, src: &dyn PageSource) -> Result<u64> {
        loop {
            let need = self.tree.lock().lookup(id, slot);
            match need {
                Lookup::Value(v) => {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(v);
                }
                need => self.resolve(need, src)?,
            }
        }
    }

    /// Reads what a lookup needs: a page version, or a pointer from the parent.
    pub fn resolve(&self, need: Lookup, src: &dyn PageSource) -> Result<()> {
        match need {
            Lookup::Value(_) => Ok(()),
            Lookup::NeedBase(id, pointer) => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                self.load(&[(id, pointer)], src)
            }
            Lookup::NeedPointer(id) => {
                let pointer = self.pointer_of(id, src)?;
                let mut tree = self.tree.lock();
                if let Some(state) = tree.states.get_mut(&id) {
                    state.pointer.get_or_insert(pointer);
                }
                Ok(())
            }
        }
    }

    /// The pointer of page `id` (its parent's slot, or the root).
    pub fn pointer_of(&self, id: PageId, src: &dyn PageSource) -> Result<u64> {
        let top = self.tree.lock().top();
        if id == top {
            return Ok(self.tree.lock().root);
        }
        let (parent, slot) = id.parent();
        self.slot_value(parent, slot, src)
    }

    /// Reads page versions and installs them (a damaged one as all-LOST, reported).
    pub fn load(&self, pages: &[(PageId, u64)], src: &dyn PageSource) -> Result<()> {
        let stored: Vec<(PageId, u64, Stored)> = pages
            .iter()
            .filter_map(|&(id, p)| match PackedEntry(p).unpack() {
                Ok(Entry::Stored(s)) => Some((id, p, s)),
                _ => None,
            })
            .collect();
        if stored.is_empty() {
            return Ok(());
        }
        let fragments = src.read_fragments(&stored.iter().map(|&(_, _, s)| s).collect::<Vec<_>>())?;
        let bases: Vec<Base> = stored
            .iter()
            .zip(&fragments)
            .map(|(&(id, _, s), bytes)| {
                match page::decode(id, s, bytes, src.cipher(), src.segment_use(s.offset_bytes)) {
                    Ok(body) => Base::Loaded(Arc::from(body)),
                    Err(e) => {
                        self.damaged_pages.fetch_add(1, Ordering::Relaxed);
                        tracing::error!("{e}: the blocks it maps read as EIO until written again");
                        Base::Damaged
                    }
                }
            })
            .collect();
        let mut tree = self.tree.lock();
        for (&(id, pointer, _), base) in stored.iter().zip(bases) {
            tree.install(id, pointer, base);
        }
        // The pages just read are spared this eviction: in a cache smaller than the pages a
        // lookup or a checkpoint holds, evicting them would make the caller read them again
        // forever. They go at the next load or trim.
        let installed: Vec<PageId> =
            stored.iter().map(|&(id, _, _)| id).filter(|id| tree.states.contains_key(id)).collect();
        for &id in &installed {
            tree.with_state(id, |s| s.pins += 1);
        }
        tree.evict(self.budget_bytes);
        for &id in &installed {
            tree.with_state(id, |s| s.pins -= 1);
        }
        Ok(())
    }

    /// Records a block's new entry (no I/O).
    pub fn set(&self, lba: Lba, value: PackedEntry, acct: &mut dyn Accounting) {
        debug_assert!(lba.0 < self.block_count);
        self.tree.lock().set(lba, value.0, acct);
    }

    /// Replaces the entry only if it still holds `old` (GC relocation); reads the page if
    /// it must.
    pub fn compare_swap(
        &self,
        lba: Lba,
        old: PackedEntry,
        new: PackedEntry,
        acct: &mut dyn Accounting,
        src: &dyn PageSource,
    ) -> Result<bool> {
        let (id, slot) = PageId::leaf_of(lba);
        loop {
            let need = {
                let mut tree = self.tree.lock();
                match tree.lookup(id, slot) {
                    Lookup::Value(v) if v == old.0 => {
                        tree.set(lba, new.0, acct);
                        return Ok(true);
                    }
                    Lookup::Value(_) => return Ok(false),
                    need => need,
                }
            };
            self.resolve(need, src)?;
        }
    }

    /// Gives every block of `[first, first + count)` the constant `value` (trim: UNMAPPED,
    /// write-zeroes: ZERO). Whole subtrees without changes are replaced in their parent;
    /// the rest is set slot by slot.
    pub fn set_range(
        &self,
        first: Lba,
        count: u64,
        value: PackedEntry,
        acct: &mut dyn Accounting,
        src: &dyn PageSource,
    ) -> Result<()> {
        assert!(is_constant(value.0));
        let end = (first.0 + count).min(self.block_count);
        let mut from = first.0;
        while from < end {
            let need = {
                let mut tree = self.tree.lock();
                let top = tree.top();
                range_in(&mut tree, top, &mut from, end, value.0, acct)
            };
            if let Some(need) = need {
                self.resolve(need, src)?;
            }
        }
        Ok(())
    }

    /// Whether a memory limit asks for a checkpoint now (the worker's cue).
    pub fn wants_checkpoint(&self) -> bool {
        let tree = self.tree.lock();
        tree.dirty.len() >= DIRTY_PAGES_SOFT || tree.change_count * CHANGE_BYTES >= self.change_budget() / 2
    }

    /// Whether writers must wait for a checkpoint before adding changes.
    pub fn must_checkpoint(&self) -> bool {
        let tree = self.tree.lock();
        tree.dirty.len() >= DIRTY_PAGES_HARD || tree.change_count * CHANGE_BYTES >= self.change_budget()
    }

    fn change_budget(&self) -> usize {
        (self.budget_bytes / 2).max(CHANGE_BYTES_FLOOR)
    }

    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    /// Keeps memory under the budget (after changes were added).
    pub fn trim_cache(&self) {
        self.tree.lock().evict(self.budget_bytes);
    }

    /// Page versions found damaged since open.
    pub fn damaged_page_count(&self) -> u64 {
        self.damaged_pages.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> MapStats {
        let tree = self.tree.lock();
        let cached = tree.states.values().filter(|s| matches!(s.base, Base::Loaded(_))).count();
        MapStats {
            cache_bytes: tree.memory_bytes as u64,
            cache_budget_bytes: self.budget_bytes as u64,
            cached_pages: cached as u64,
            dirty_pages: tree.dirty.len() as u64,
            pending_changes: tree.change_count as u64,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            damaged_pages: self.damaged_pages.load(Ordering::Relaxed),
        }
    }

    /// Grows (or shrinks) the logical size; a taller tree gets a new top page whose first
    /// slot is the old top (the caller holds the map's write lock).
    pub fn resize(&mut self, block_count: u64) {
        let tree = self.tree.get_mut();
        while page::height_for(block_count) > tree.height {
            let old_top = tree.top();
            let old_root = tree.root;
            tree.height += 1;
            tree.root = PackedEntry::UNMAPPED.0;
            let new_top = tree.top();
            if let Some(state) = tree.states.get_mut(&old_top) {
                state.pointer.get_or_insert(old_root);
            }
            if old_root != PackedEntry::UNMAPPED.0 {
                // The new top is unwritten: its first slot, the old top, is a change the
                // next checkpoint writes. (Nothing to account: it is a pointer.)
                tree.with_state(new_top, |state| {
                    state.pointer = Some(PackedEntry::UNMAPPED.0);
                    state.frozen.clear();
                    state.pending = vec![Change { value: old_root, slot: 0, settled: true }];
                });
            }
        }
        self.block_count = block_count;
    }
}

/// One step of a range change inside page `page` from `*from` (advanced as blocks are
/// done); returns what must be read before it can go on.
fn range_in(
    tree: &mut Tree,
    page: PageId,
    from: &mut u64,
    end: u64,
    value: u64,
    acct: &mut dyn Accounting,
) -> Option<Lookup> {
    let page_first = page.first_lba().0;
    let page_end = page_first + span_blocks(page.level);
    let stop = end.min(page_end);
    if page.level == 0 {
        while *from < stop {
            tree.set(Lba(*from), value, acct);
            *from += 1;
        }
        return None;
    }
    let child_span = span_blocks(page.level - 1);
    while *from < stop {
        let slot = ((*from - page_first) / child_span) as usize;
        let child = PageId { level: page.level - 1, index: page.index * PAGE_SLOTS as u64 + slot as u64 };
        let child_first = page_first + slot as u64 * child_span;
        if *from == child_first && end >= child_first + child_span && tree.clear_subtree(child) {
            let current = match tree.lookup(page, slot) {
                Lookup::Value(v) => v,
                need => return Some(need),
            };
            if current != value {
                acct.constant(PackedEntry(value), child_span, Delta::Add);
                tree.with_state(page, |state| {
                    if is_constant(current) {
                        acct.constant(PackedEntry(current), child_span, Delta::Remove);
                    } else {
                        state.pending_walks.push((slot as u16, current));
                    }
                    match state.pending.binary_search_by_key(&(slot as u16), |c| c.slot) {
                        Ok(i) => state.pending[i].value = value,
                        Err(i) => state.pending.insert(i, Change { value, slot: slot as u16, settled: true }),
                    }
                });
            }
            *from = child_first + child_span;
            continue;
        }
        if let Some(need) = range_in(tree, child, from, end, value, acct) {
            return Some(need);
        }
    }
    None
}
