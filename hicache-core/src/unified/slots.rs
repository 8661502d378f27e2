//! Device page slots on the nodes (Full pages, SWA pages; the Mamba slot lives on the node
//! already): which slots an insert adopts, which it hands back, and the slots of a prefix.
//!
//! The tree stays metadata only: a slot is an opaque page index in the caller's pool of
//! that component. Contract of [`UnifiedTree::insert_with_slots`]: the caller hands one
//! slot per page of the key (the matched prefix's are the tree's own, from
//! [`UnifiedTree::prefix_pages`]); every handed slot (SWA: at or past the SWA floor) the tree
//! does not hold at that position after the insert is returned in
//! [`UnifiedInsert::release_full`] / [`UnifiedInsert::release_swa`]; a tree Full page
//! replaced by the request's (an unlocked SWA tombstone recovered on insert) is returned
//! there too. So the tree's slots before, plus the handed ones, equal the tree's slots
//! after plus the returned ones. Evictions return the slots
//! they free in [`Evicted`](super::Evicted).
//!
//! Invariant kept here (checked by `check_invariants`): in a slot-tracking tree every live
//! non-root node has one Full slot per page exactly when Full is on device (none on a
//! host-only node) and one SWA slot per page exactly when SWA is present; no slot of a
//! component appears twice in the tree. A tree without tracking holds no slots at all.

use super::{FULL, SWA};
use std::collections::HashSet;

use super::node::ROOT;
use super::{Component, InsertParams, UnifiedInsert, UnifiedTree};
use crate::error::{CoreError, Result};
use crate::tree::NodeId;

/// The request's device slots handed to [`UnifiedTree::insert_with_slots`], one per page of
/// the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InsertSlots<'a> {
    /// Full page slots (pages below `prev_prefix_len` are the tree's own, as matched).
    pub full: &'a [u32],
    /// SWA page slots (empty without SWA; entries below the SWA floor are not read; at an
    /// SWA tombstone of the matched prefix, a slot of the caller's that the tree may adopt
    /// by recovering the tombstone or else returns).
    pub swa: &'a [u32],
}

/// Splits the first `pages` entries off `v` (nothing when `v` is empty: an untracked node).
pub(crate) fn take_prefix(v: &mut Vec<u32>, pages: usize) -> Vec<u32> {
    if v.is_empty() {
        return Vec::new();
    }
    let rest = v.split_off(pages);
    std::mem::replace(v, rest)
}

impl UnifiedTree {
    /// An empty tree whose nodes carry device page slots: inserts go through
    /// [`insert_with_slots`](Self::insert_with_slots), evictions report the freed slots.
    pub fn with_device_slots(cfg: super::UnifiedConfig) -> Result<Self> {
        let mut t = Self::new(cfg)?;
        t.slots = true;
        Ok(t)
    }

    /// Whether nodes carry device page slots.
    pub fn tracks_slots(&self) -> bool {
        self.slots
    }

    /// [`insert`](Self::insert) with the request's device slots (see the module contract).
    pub fn insert_with_slots(
        &mut self,
        key: &[u32],
        p: &InsertParams,
        s: InsertSlots<'_>,
    ) -> Result<UnifiedInsert> {
        let pages = key.len() / self.ps();
        let swa_pages = if self.has[SWA] { pages } else { 0 };
        let bad = |value: String, reason| CoreError::InvalidPolicy {
            field: "slots",
            value,
            reason,
        };
        if !self.slots {
            return Err(bad("given".into(), "this tree does not track device slots"));
        }
        if s.full.len() != pages || s.swa.len() != swa_pages {
            return Err(bad(
                format!(
                    "{} full, {} swa for {pages} pages",
                    s.full.len(),
                    s.swa.len()
                ),
                "one Full slot per page, one SWA slot per page when SWA is configured",
            ));
        }
        self.insert_inner(key, p, Some(s))
    }

    /// Component `c`'s slots on the pages from the root to `node` (`None` where `c` is a
    /// tombstone or the node is host-only). Full and SWA only; empty for a tree without slot tracking.
    pub fn prefix_pages(&self, node: NodeId, c: Component) -> Result<Vec<Option<u32>>> {
        let mut i = self.index(node)?;
        if c == Component::Mamba || !self.has[c as usize] {
            return Err(CoreError::InvalidPolicy {
                field: "component",
                value: format!("{c:?}"),
                reason: "page slots exist for configured Full and SWA only",
            });
        }
        let mut out = Vec::new();
        if !self.slots {
            return Ok(out);
        }
        while i != ROOT {
            let n = &self.arena.nodes[i as usize];
            let pages = n.key.len() / self.ps();
            match (c, n.comp[c as usize].present) {
                (_, false) => out.extend(std::iter::repeat_n(None, pages)),
                (Component::Full, _) => out.extend(n.full_pages.iter().rev().map(|&x| Some(x))),
                (_, true) => out.extend(n.swa_pages.iter().rev().map(|&x| Some(x))),
            }
            i = n.parent;
        }
        out.reverse();
        Ok(out)
    }

    /// After recovering an SWA tombstone on `i` (covering `[start, ..)`) whose Full is
    /// unlocked: the node takes the request's Full slots; its old ones go to `released`.
    pub(crate) fn adopt_recovered_full(
        &mut self,
        i: u32,
        start: usize,
        s: InsertSlots<'_>,
        released: &mut Vec<u32>,
    ) {
        let ps = self.ps();
        let n = &mut self.arena.nodes[i as usize];
        if n.comp[FULL].lock > 0 {
            return;
        }
        let first = start / ps;
        for (k, old) in n.full_pages.iter_mut().enumerate() {
            let new = s.full[first + k];
            if *old != new {
                released.push(*old);
                *old = new;
            }
        }
    }

    /// Walks the key's path (ending at `target`): fills the slots of nodes the insert
    /// created or whose SWA it recovered, then lists the request's slots not adopted.
    pub(crate) fn settle_slots(
        &mut self,
        target: u32,
        p: &InsertParams,
        s: InsertSlots<'_>,
        out: &mut UnifiedInsert,
    ) {
        let ps = self.ps();
        let mut path = Vec::new();
        let mut i = target;
        while i != ROOT {
            path.push(i);
            i = self.arena.nodes[i as usize].parent;
        }
        let mut pos = 0usize;
        for &i in path.iter().rev() {
            let n = &mut self.arena.nodes[i as usize];
            let (first, pages) = (pos / ps, n.key.len() / ps);
            if n.full_pages.is_empty() {
                n.full_pages = s.full[first..first + pages].to_vec();
            }
            if n.comp[SWA].present && n.swa_pages.is_empty() {
                n.swa_pages = s.swa[first..first + pages].to_vec();
            }
            for k in 0..pages {
                if n.full_pages[k] != s.full[first + k] {
                    out.release_full.push(s.full[first + k]);
                }
                let swa_kept = n.comp[SWA].present && n.swa_pages[k] == s.swa[first + k];
                if self.has[SWA] && (first + k) * ps >= p.swa_evicted_len && !swa_kept {
                    out.release_swa.push(s.swa[first + k]);
                }
            }
            pos += n.key.len();
        }
    }

    /// The slot invariants of the module documentation.
    pub(crate) fn check_slots(&self) -> std::result::Result<(), String> {
        let mut seen = [HashSet::new(), HashSet::new()];
        for (i, n) in self.arena.nodes.iter().enumerate() {
            if !n.live || i == ROOT as usize {
                continue;
            }
            let pages = n.key.len() / self.ps();
            let on = |c: usize| if n.comp[c].present { pages } else { 0 };
            let want = [on(0), on(1)];
            let have = [&n.full_pages, &n.swa_pages];
            for c in 0..2 {
                let want = if self.slots { want[c] } else { 0 };
                if have[c].len() != want {
                    return Err(format!(
                        "node {i}: {} slots of {c}, want {want}",
                        have[c].len()
                    ));
                }
                if let Some(x) = have[c].iter().find(|&&x| !seen[c].insert(x)) {
                    return Err(format!("node {i}: slot {x} of {c} held twice"));
                }
            }
        }
        Ok(())
    }
}
