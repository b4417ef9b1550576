//! What checkpoints and GC do to the map: freeze the changes a checkpoint takes, prepare
//! the pages it rewrites (pointers known, versions read, pinned), build their new bodies,
//! install the written versions, and settle owed accounting for pages GC holds.
//!
//! A checkpoint rewrites level by level, leaves first: installing a page gives its parent a
//! frozen change (the new pointer), so the parent is rewritten at the next level, up to the
//! top, whose pointer becomes the root.

use std::sync::Arc;

use super::page::{PageBody, PageId, PAGE_SLOTS};
use super::paged::{find, is_constant, Accounting, Base, Change, Delta, Lookup, PageSource, PageState, PagedMap};
use super::PackedEntry;
use crate::error::Result;

/// A page a checkpoint rewrites, with what it starts from.
pub(crate) struct Prepared {
    pub id: PageId,
    /// The version the frozen changes apply to (a pointer or a constant).
    pub pointer: u64,
    pub base: Base,
    pub frozen: Vec<Change>,
    pub walks: Vec<(u16, u64)>,
}

impl Prepared {
    /// The base's value of a slot.
    pub fn base_value(&self, slot: usize) -> u64 {
        if is_constant(self.pointer) {
            return self.pointer;
        }
        match &self.base {
            Base::Loaded(body) => body[slot],
            Base::Damaged | Base::Absent => PackedEntry::LOST.0,
        }
    }

    /// The new version: the base with the frozen changes applied. Slots of a damaged base
    /// that no change covers become LOST: their old values are unknown.
    pub fn merged(&self) -> Box<PageBody> {
        let mut body = Box::new([0u64; PAGE_SLOTS]);
        for (slot, value) in body.iter_mut().enumerate() {
            *value = self.base_value(slot);
        }
        for c in &self.frozen {
            body[c.slot as usize] = c.value;
        }
        body
    }
}

/// If every slot holds the same constant, that constant: the page need not be written, its
/// parent holds the constant for the whole subtree.
pub(crate) fn uniform_constant(body: &PageBody) -> Option<u64> {
    let first = body[0];
    (is_constant(first) && body.iter().all(|&v| v == first)).then_some(first)
}

impl PagedMap {
    /// Moves every pending change and walk to frozen, and marks those pages (and forced
    /// ones) for rewriting. Called under the log lock, with the checkpoint's snapshot.
    /// Returns how many pages it froze.
    pub fn freeze(&self) -> usize {
        let mut tree = self.lock();
        let dirty: Vec<PageId> = std::mem::take(&mut tree.dirty).into_iter().collect();
        for &id in &dirty {
            tree.with_state(id, |s| {
                assert!(s.frozen.is_empty() && s.frozen_walks.is_empty(), "a checkpoint is already frozen");
                s.frozen = std::mem::take(&mut s.pending);
                s.frozen_walks = std::mem::take(&mut s.pending_walks);
                s.rewrite = true;
                s.force = false;
            });
        }
        dirty.len()
    }

    /// Undoes a freeze after a checkpoint failed: frozen changes go back under the pending
    /// ones (a pending change on the same slot is newer; it already removed the frozen
    /// value, so the merged change keeps the frozen one's debt).
    pub fn unfreeze(&self) {
        let mut tree = self.lock();
        let frozen: Vec<PageId> = tree.states.iter().filter(|(_, s)| s.rewrite).map(|(&k, _)| k).collect();
        for id in frozen {
            tree.with_state(id, |s| {
                let mut merged: Vec<Change> = Vec::with_capacity(s.frozen.len() + s.pending.len());
                for f in s.frozen.drain(..) {
                    match find(&s.pending, f.slot as usize) {
                        Some(p) => merged.push(Change { settled: f.settled, ..*p }),
                        None => merged.push(f),
                    }
                }
                for p in &s.pending {
                    if !merged.iter().any(|m| m.slot == p.slot) {
                        merged.push(*p);
                    }
                }
                merged.sort_by_key(|c| c.slot);
                s.pending = merged;
                let mut walks = std::mem::take(&mut s.frozen_walks);
                walks.append(&mut s.pending_walks);
                s.pending_walks = walks;
                s.force |= s.rewrite;
                s.rewrite = false;
            });
        }
    }

    /// The pages at `level` the checkpoint in progress rewrites, in order.
    pub fn rewrites_at(&self, level: u8) -> Vec<PageId> {
        let tree = self.lock();
        let first = PageId { level, index: 0 };
        let end = PageId { level: level + 1, index: 0 };
        tree.states.range(first..end).filter(|(_, s)| s.rewrite).map(|(&k, _)| k).collect()
    }

    /// Pins pages and reads what they need: their pointers and, for stored ones, their
    /// versions. Pinned pages keep their bodies until unpinned.
    pub fn pin_loaded(&self, ids: &[PageId], src: &dyn PageSource) -> Result<()> {
        {
            let mut tree = self.lock();
            for &id in ids {
                tree.with_state(id, |s| s.pins += 1);
            }
        }
        let result = self.load_pinned(ids, src);
        if result.is_err() {
            self.unpin(ids);
        }
        result
    }

    fn load_pinned(&self, ids: &[PageId], src: &dyn PageSource) -> Result<()> {
        loop {
            let (loads, pointer_needed) = {
                let tree = self.lock();
                let mut loads = Vec::new();
                let mut pointer_needed = Vec::new();
                for &id in ids {
                    let state = &tree.states[&id];
                    match state.pointer {
                        None => pointer_needed.push(id),
                        Some(p) if !is_constant(p) && matches!(state.base, Base::Absent) => loads.push((id, p)),
                        Some(_) => {}
                    }
                }
                (loads, pointer_needed)
            };
            if loads.is_empty() && pointer_needed.is_empty() {
                return Ok(());
            }
            for id in pointer_needed {
                self.resolve(Lookup::NeedPointer(id), src)?;
            }
            for chunk in loads.chunks(256) {
                self.load(chunk, src)?;
            }
        }
    }

    pub fn unpin(&self, ids: &[PageId]) {
        let mut tree = self.lock();
        for &id in ids {
            tree.with_state(id, |s| {
                assert!(s.pins > 0, "unpinning an unpinned page");
                s.pins = s.pins.saturating_sub(1);
            });
        }
        let budget = self.budget_bytes();
        tree.evict(budget);
    }

    /// What a pinned page being rewritten starts from.
    pub fn prepared(&self, ids: &[PageId]) -> Vec<Prepared> {
        let tree = self.lock();
        ids.iter()
            .map(|&id| {
                let s = &tree.states[&id];
                Prepared {
                    id,
                    pointer: s.pointer.expect("a prepared page's pointer is known"),
                    base: s.base.clone(),
                    frozen: s.frozen.clone(),
                    walks: s.frozen_walks.clone(),
                }
            })
            .collect()
    }

    /// Installs the version a checkpoint wrote for a prepared page (`new_pointer`, which
    /// may be a constant) and hands the parent its frozen change. The frozen changes'
    /// owed removals of base values are made in both `live` and `snapshot` (the checkpoint's
    /// own table). Returns the page's previous pointer. Called under the log lock.
    pub fn install_rewrite(
        &self,
        prepared: &Prepared,
        new_pointer: u64,
        body: Box<PageBody>,
        live: &mut dyn Accounting,
        snapshot: &mut dyn Accounting,
    ) -> u64 {
        let id = prepared.id;
        let mut tree = self.lock();
        let leaf = id.level == 0;
        tree.with_state(id, |s| {
            debug_assert_eq!(s.frozen, prepared.frozen, "frozen changes moved under a checkpoint");
            if leaf {
                for c in s.frozen.iter().filter(|c| !c.settled) {
                    let old = PackedEntry(prepared.base_value(c.slot as usize));
                    live.entry(old, Delta::Remove);
                    snapshot.entry(old, Delta::Remove);
                }
            }
            s.frozen.clear();
            s.frozen_walks.clear();
            s.rewrite = false;
            s.pins = s.pins.saturating_sub(1);
            s.pointer = Some(new_pointer);
            s.base = if is_constant(new_pointer) { Base::Absent } else { Base::Loaded(Arc::from(body)) };
            if leaf {
                settle_state(s, live);
            }
        });
        if id == tree.top() {
            tree.root = new_pointer;
        } else {
            let (parent, slot) = id.parent();
            tree.with_state(parent, |p| {
                let change = Change { value: new_pointer, slot: slot as u16, settled: true };
                match p.frozen.binary_search_by_key(&change.slot, |c| c.slot) {
                    Ok(i) => p.frozen[i] = change,
                    Err(i) => p.frozen.insert(i, change),
                }
                p.rewrite = true;
            });
        }
        prepared.pointer
    }

    /// Makes the owed removals of pinned pages' pending changes (their bases are cached),
    /// so GC's victim is accounted exactly. Called under the log lock.
    pub fn settle(&self, ids: &[PageId], live: &mut dyn Accounting) {
        let mut tree = self.lock();
        for &id in ids.iter().filter(|id| id.level == 0) {
            tree.with_state(id, |s| settle_state(s, live));
        }
    }

    /// Leaves with changes whose owed removals are not settled yet.
    pub fn unsettled_leaves(&self) -> Vec<PageId> {
        let tree = self.lock();
        let end = PageId { level: 1, index: 0 };
        tree.states.range(..end).filter(|(_, s)| s.pending.iter().any(|c| !c.settled)).map(|(&k, _)| k).collect()
    }

    /// Of `leaves` (ascending), those with changes whose owed removals are not settled.
    pub fn unsettled_among(&self, leaves: &[PageId]) -> Vec<PageId> {
        let tree = self.lock();
        leaves
            .iter()
            .copied()
            .filter(|id| tree.states.get(id).is_some_and(|s| s.pending.iter().any(|c| !c.settled)))
            .collect()
    }

    /// Subtrees replaced by a constant whose old contents are still owed: (root page of
    /// the old subtree, its pointer).
    pub fn owed_walks(&self) -> Vec<(PageId, u64)> {
        let tree = self.lock();
        tree.states
            .iter()
            .flat_map(|(&id, s)| {
                s.pending_walks.iter().chain(&s.frozen_walks).map(move |&(slot, pointer)| {
                    (PageId { level: id.level - 1, index: id.index * PAGE_SLOTS as u64 + slot as u64 }, pointer)
                })
            })
            .collect()
    }

    /// Whether any replaced subtree's old contents are still owed.
    pub fn has_owed_walks(&self) -> bool {
        self.lock().states.values().any(|s| !s.pending_walks.is_empty() || !s.frozen_walks.is_empty())
    }

    /// Marks a page for rewriting at the next checkpoint (GC found its current version in
    /// a victim).
    pub fn force(&self, id: PageId) {
        self.lock().with_state(id, |s| s.force = true);
    }

    /// Loads entries of an older format's checkpoint (ascending LBAs) as changes to an
    /// empty tree, already accounted: the next checkpoint writes them as pages.
    pub fn import(&self, entries: &[(u64, u64)]) {
        let mut tree = self.lock();
        for &(lba, value) in entries {
            let (id, slot) = PageId::leaf_of(crate::types::Lba(lba));
            tree.with_state(id, |s| {
                debug_assert!(s.pending.last().is_none_or(|c| (c.slot as usize) < slot));
                s.pending.push(Change { value, slot: slot as u16, settled: true });
            });
        }
    }
}

/// Removes the value beneath each unsettled pending change, where it is known.
fn settle_state(state: &mut PageState, live: &mut dyn Accounting) {
    for i in 0..state.pending.len() {
        if state.pending[i].settled {
            continue;
        }
        let slot = state.pending[i].slot as usize;
        let beneath = find(&state.frozen, slot).map(|c| c.value).or_else(|| state.base_value(slot));
        if let Some(old) = beneath {
            live.entry(PackedEntry(old), Delta::Remove);
            state.pending[i].settled = true;
        }
    }
}
