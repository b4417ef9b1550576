//! Walking the map: a subtree as it is on disk (a replaced subtree's old contents, owed to
//! the accounting), and the current map with its changes (check, shrinking).

use super::page::{self, PageBody, PageId, PAGE_SLOTS};
use super::paged::{is_constant, Base, Lookup, PageSource, PagedMap};
use super::{Entry, PackedEntry, Stored};
use crate::error::Result;

/// What a walk of an on-disk subtree meets.
pub(crate) enum Visit<'a> {
    /// A page of the subtree (its bytes are superseded once the subtree is replaced).
    Page(Stored),
    /// A leaf's entries.
    Leaf(&'a PageBody),
    /// An interior slot holding a constant for its whole subtree of `blocks` blocks.
    Constant(PackedEntry, u64),
    /// A page that does not verify: its contents are unknown.
    Damaged(PageId),
}

fn stored(pointer: u64) -> Option<Stored> {
    match PackedEntry(pointer).unpack() {
        Ok(Entry::Stored(s)) => Some(s),
        _ => None,
    }
}

/// Visits every page of the subtree at `pointer` (page `id`), depth first, reading each
/// interior page's children together: memory per level, not per page. Nothing is cached.
pub(crate) fn walk_subtree(
    id: PageId,
    pointer: u64,
    src: &dyn PageSource,
    visit: &mut dyn FnMut(Visit<'_>),
) -> Result<()> {
    let Some(s) = stored(pointer) else {
        if pointer != PackedEntry::UNMAPPED.0 {
            visit(Visit::Constant(PackedEntry(pointer), super::paged::span_blocks(id.level)));
        }
        return Ok(());
    };
    let bytes = src.read_fragments(&[s])?.pop().expect("one fragment");
    walk_read(id, s, &bytes, src, visit)
}

fn walk_read(
    id: PageId,
    s: Stored,
    bytes: &[u8],
    src: &dyn PageSource,
    visit: &mut dyn FnMut(Visit<'_>),
) -> Result<()> {
    visit(Visit::Page(s));
    let Ok(body) = page::decode(id, s, bytes, src.cipher(), src.segment_use(s.offset_bytes)) else {
        visit(Visit::Damaged(id));
        return Ok(());
    };
    if id.level == 0 {
        visit(Visit::Leaf(&body));
        return Ok(());
    }
    let mut children = Vec::new();
    for (slot, &value) in body.iter().enumerate() {
        let child = PageId { level: id.level - 1, index: id.index * PAGE_SLOTS as u64 + slot as u64 };
        match stored(value) {
            Some(child_stored) => children.push((child, child_stored)),
            None if value != PackedEntry::UNMAPPED.0 => {
                visit(Visit::Constant(PackedEntry(value), super::paged::span_blocks(child.level)))
            }
            None => {}
        }
    }
    let at: Vec<Stored> = children.iter().map(|&(_, s)| s).collect();
    let fragments = src.read_fragments(&at)?;
    for (&(child, child_stored), fragment) in children.iter().zip(&fragments) {
        walk_read(child, child_stored, fragment, src, visit)?;
    }
    Ok(())
}

/// What a walk of the current map meets.
pub(crate) enum WalkItem<'a> {
    /// A leaf's entries, every change applied (all of them, also those outside the range).
    Leaf(PageId, &'a PageBody),
    /// Blocks `[from, to)` all hold this constant.
    Constant(u64, u64, PackedEntry),
    /// A page of the map as it is on disk.
    Page(Stored),
}

/// A page of the current map: a constant for its whole subtree, or its entries with every
/// change applied.
pub(crate) enum Current {
    Constant(u64),
    Body(Box<PageBody>),
}

impl PagedMap {
    /// Page `id` as it reads now (reading its version if needed), and the pointer of the
    /// version its changes apply to.
    pub fn current_page(&self, id: PageId, src: &dyn PageSource) -> Result<(Current, Option<u64>)> {
        loop {
            let need = {
                let mut tree = self.lock();
                let pointer = match tree.states.get(&id).and_then(|s| s.pointer).or_else(|| tree.cheap_pointer(id)) {
                    Some(p) => p,
                    None => {
                        drop(tree);
                        self.resolve(Lookup::NeedPointer(id), src)?;
                        continue;
                    }
                };
                let state = tree.states.get(&id);
                let changes = state.is_some_and(|s| !s.pending.is_empty() || !s.frozen.is_empty());
                if is_constant(pointer) && !changes {
                    return Ok((Current::Constant(pointer), Some(pointer)));
                }
                let base: Option<Box<PageBody>> = if is_constant(pointer) {
                    Some(Box::new([pointer; PAGE_SLOTS]))
                } else {
                    match state.map(|s| &s.base) {
                        Some(Base::Loaded(body)) => Some(Box::new(**body)),
                        Some(Base::Damaged) => Some(Box::new([PackedEntry::LOST.0; PAGE_SLOTS])),
                        _ => None,
                    }
                };
                match base {
                    Some(mut body) => {
                        if let Some(s) = state {
                            for c in s.frozen.iter().chain(&s.pending) {
                                body[c.slot as usize] = c.value;
                            }
                        }
                        return Ok((Current::Body(body), Some(pointer)));
                    }
                    None => {
                        // Make sure a state exists for the version to land in.
                        tree.with_state(id, |s| {
                            s.pointer.get_or_insert(pointer);
                        });
                        Lookup::NeedBase(id, pointer)
                    }
                }
            };
            self.resolve(need, src)?;
        }
    }

    /// Visits the current map over `[first, end)` blocks in block order: every leaf page
    /// that is not a constant, every run of blocks a constant covers (constant subtrees are
    /// not descended into), and every page on disk it passes through.
    pub fn walk_current(
        &self,
        first_lba: u64,
        end_lba: u64,
        src: &dyn PageSource,
        visit: &mut dyn FnMut(WalkItem<'_>) -> Result<()>,
    ) -> Result<()> {
        let top = self.lock().top();
        self.walk_in(top, first_lba, end_lba, src, visit)
    }

    fn walk_in(
        &self,
        id: PageId,
        first_lba: u64,
        end_lba: u64,
        src: &dyn PageSource,
        visit: &mut dyn FnMut(WalkItem<'_>) -> Result<()>,
    ) -> Result<()> {
        let start = id.first_lba().0;
        let span = super::paged::span_blocks(id.level);
        let (lo, hi) = (first_lba.max(start), end_lba.min(start + span));
        if lo >= hi {
            return Ok(());
        }
        let (current, pointer) = self.current_page(id, src)?;
        if let Some(s) = pointer.and_then(stored) {
            visit(WalkItem::Page(s))?;
        }
        let body = match current {
            // A constant subtree may still hold pages with changes (made under it).
            Current::Constant(v) if !self.lock().any_state_within(id) => {
                return visit(WalkItem::Constant(lo, hi, PackedEntry(v)));
            }
            Current::Constant(v) => Box::new([v; PAGE_SLOTS]),
            Current::Body(body) => body,
        };
        if id.level == 0 {
            return visit(WalkItem::Leaf(id, &body));
        }
        let child_span = span / PAGE_SLOTS as u64;
        for (slot, &value) in body.iter().enumerate() {
            let child_first = start + slot as u64 * child_span;
            if child_first >= hi || child_first + child_span <= lo {
                continue;
            }
            let child = PageId { level: id.level - 1, index: id.index * PAGE_SLOTS as u64 + slot as u64 };
            if is_constant(value) && !self.lock().any_state_within(child) {
                visit(WalkItem::Constant(lo.max(child_first), hi.min(child_first + child_span), PackedEntry(value)))?;
            } else {
                self.walk_in(child, lo, hi, src, visit)?;
            }
        }
        Ok(())
    }

    /// Whether any block in `[first, end)` is mapped (not UNMAPPED).
    pub fn any_mapped_in(&self, first_lba: u64, end_lba: u64, src: &dyn PageSource) -> Result<bool> {
        let mut found = false;
        self.walk_current(first_lba, end_lba, src, &mut |item| {
            match item {
                WalkItem::Leaf(id, body) => {
                    let start = id.first_lba().0;
                    found |= body.iter().enumerate().any(|(slot, &v)| {
                        let lba = start + slot as u64;
                        lba >= first_lba && lba < end_lba && v != PackedEntry::UNMAPPED.0
                    });
                }
                WalkItem::Constant(_, _, value) => found |= value != PackedEntry::UNMAPPED,
                WalkItem::Page(_) => {}
            }
            Ok(())
        })?;
        Ok(found)
    }
}
