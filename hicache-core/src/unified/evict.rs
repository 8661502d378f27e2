//! Eviction: each component frees from its own order until its request is met (SGLang's
//! `_evict_components`, device tier, no allocator targets).
//!
//! - Full: the evictable leaves, oldest time first (a heap built at the start of the walk; a
//!   parent that becomes a leaf joins it).
//! - SWA, Mamba: their LRU from the tail, skipping locked nodes. A leaf goes whole; an
//!   internal node becomes a tombstone for the component, cascading to components of lower
//!   or equal internal priority (SWA takes Mamba with it; Mamba takes nothing).
//! - A device leaf whose Full is on host is *demoted* instead of deleted: every device
//!   component goes, the node stays *host-only* (device Full absent, host slots kept) and a
//!   later insert of its tokens rematerialises it with the request's device slots. A device
//!   leaf is one with device Full whose children have none (host-only children allowed).
//!
//! - Host: per component, see `host_evict` ([`UnifiedTree::evict_host_of`]).
//!
//! Invariant kept here: nothing with a positive lock count is evicted — the Full heap holds
//! only evictable leaves (unlocked in every component) and the LRU scans skip locked nodes.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::node::ROOT;
use super::{Component, UnifiedTree};

/// How much to free per component (SGLang's `EvictParams`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EvictRequest {
    /// Full tokens.
    pub full: u64,
    /// SWA tokens.
    pub swa: u64,
    /// Mamba states.
    pub mamba: u64,
}

/// What an eviction freed (each component counts what it freed, cascades included).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Evicted {
    /// Full tokens.
    pub full: u64,
    /// SWA tokens.
    pub swa: u64,
    /// Mamba states.
    pub mamba: u64,
    /// The Mamba state slots freed, for the caller's allocator.
    pub mamba_slots: Vec<u32>,
    /// The device Full page slots freed (trees made with
    /// [`UnifiedTree::with_device_slots`] only).
    pub full_pages: Vec<u32>,
    /// The device SWA page slots freed (trees made with
    /// [`UnifiedTree::with_device_slots`] only).
    pub swa_pages: Vec<u32>,
    /// Host Full page slots freed by [`UnifiedTree::evict_host`] (device eviction demotes a
    /// backed-up leaf and keeps its host slots).
    pub host_full_pages: Vec<u32>,
    /// Host SWA page slots freed by [`UnifiedTree::evict_host`].
    pub host_swa_pages: Vec<u32>,
    /// Host Mamba state slots freed by [`UnifiedTree::evict_host`].
    pub host_mamba_slots: Vec<u32>,
}

impl Evicted {
    fn get(&self, c: Component) -> u64 {
        match c {
            Component::Full => self.full,
            Component::Swa => self.swa,
            Component::Mamba => self.mamba,
        }
    }

    fn add(&mut self, c: Component, n: u64) {
        match c {
            Component::Full => self.full += n,
            Component::Swa => self.swa += n,
            Component::Mamba => self.mamba += n,
        }
    }
}

impl UnifiedTree {
    /// Frees at least what `req` asks of each component where the tree can (components in
    /// order; what a component already freed by cascade counts towards its request).
    pub fn evict(&mut self, req: EvictRequest) -> Evicted {
        let mut out = Evicted::default();
        let want = [req.full, req.swa, req.mamba];
        for c in [Component::Full, Component::Swa, Component::Mamba] {
            if !self.has[c as usize] || out.get(c) >= want[c as usize] {
                continue;
            }
            match c {
                Component::Full => self.evict_full(want[0], &mut out),
                _ => self.evict_aux(c, want[c as usize], &mut out),
            }
        }
        out
    }

    fn evict_full(&mut self, want: u64, out: &mut Evicted) {
        let mut heap: BinaryHeap<Reverse<(u64, u32, u32)>> = self
            .leaves
            .iter()
            .map(|&i| {
                let n = &self.arena.nodes[i as usize];
                Reverse((n.time, i, n.generation))
            })
            .collect();
        while out.full < want {
            let Some(Reverse((_, i, g))) = heap.pop() else {
                break;
            };
            if !self.in_leaves(i) || self.arena.nodes[i as usize].generation != g {
                continue;
            }
            let parent = self.evict_device_leaf(i, out);
            if self.in_leaves(parent) {
                let n = &self.arena.nodes[parent as usize];
                heap.push(Reverse((n.time, parent, n.generation)));
            }
        }
    }

    fn evict_aux(&mut self, c: Component, want: u64, out: &mut Evicted) {
        let l = c.lru();
        let ci = c as usize;
        let mut cursor = self.lru_tail_unlocked(c, None);
        loop {
            if cursor.is_some_and(|x| !self.lrus[l].contains(x)) {
                cursor = self.lru_tail_unlocked(c, None);
            }
            let Some(x) = cursor else { break };
            if out.get(c) >= want {
                break;
            }
            cursor = self.lru_tail_unlocked(c, Some(x));
            if self.in_leaves(x) {
                self.evict_device_leaf(x, out);
                continue;
            }
            debug_assert_eq!(self.arena.nodes[x as usize].comp[ci].lock, 0);
            self.drop_comp(x, c, out);
            // Cascade on an internal node: every component of lower internal priority
            // (with equal priority only the trigger itself).
            for lower in [Component::Swa, Component::Mamba] {
                if lower != c
                    && self.has[lower as usize]
                    && lower.internal_priority() < c.internal_priority()
                    && self.arena.nodes[x as usize].comp[lower as usize].present
                {
                    self.drop_comp(x, lower, out);
                }
            }
            self.update_leaf(x);
        }
    }

    /// The unlocked node before `from` (or the tail) in `c`'s LRU.
    fn lru_tail_unlocked(&self, c: Component, from: Option<u32>) -> Option<u32> {
        let nodes = &self.arena.nodes;
        self.lrus[c.lru()].prev_unlocked(from, |x| nodes[x as usize].comp[c as usize].lock == 0)
    }

    /// Makes `c` a tombstone on `i`: off its LRU, out of the ledger, counted in `out`.
    fn drop_comp(&mut self, i: u32, c: Component, out: &mut Evicted) {
        let n = self.comp_len(i, c);
        let d = &mut self.arena.nodes[i as usize].comp[c as usize];
        if !d.present {
            return;
        }
        d.present = false;
        if d.lock > 0 {
            self.protected[c as usize] -= n;
        } else {
            self.evictable[c as usize] -= n;
        }
        if c != Component::Full {
            self.lrus[c.lru()].remove(i);
        }
        let node = &mut self.arena.nodes[i as usize];
        match c {
            Component::Full => out.full_pages.append(&mut node.full_pages),
            Component::Swa => out.swa_pages.append(&mut node.swa_pages),
            Component::Mamba => out.mamba_slots.push(node.mamba_slot),
        }
        out.add(c, n);
        if self.host_seen {
            // A host copy left behind joins its host LRU (SGLang's `evict_component`).
            self.sync_host_lru(i, c);
        }
    }

    /// Evicts the device leaf `i` with every component on it: a node whose Full is backed
    /// up is *demoted* (SGLang's `_demote`: its device data is freed, the node stays
    /// host-only with its host slots), any other is deleted. Returns its parent.
    fn evict_device_leaf(&mut self, i: u32, out: &mut Evicted) -> u32 {
        if self.arena.nodes[i as usize].host_full.is_empty() {
            return self.delete_leaf(i, out);
        }
        for c in [Component::Full, Component::Swa, Component::Mamba] {
            if self.has[c as usize] {
                self.drop_comp(i, c, out);
            }
        }
        self.update_leaf(i);
        let parent = self.arena.nodes[i as usize].parent;
        if parent != ROOT {
            self.update_leaf(parent);
        }
        parent
    }

    /// Deletes the evictable leaf `i` (device or host) with every component on it; returns
    /// its parent.
    pub(crate) fn delete_leaf(&mut self, i: u32, out: &mut Evicted) -> u32 {
        for c in [Component::Full, Component::Swa, Component::Mamba] {
            if self.has[c as usize] {
                self.drop_comp(i, c, out);
            }
        }
        self.remove_from_leaves(i);
        if self.host_seen {
            self.forget_host(i);
        }
        let n = &mut self.arena.nodes[i as usize];
        out.host_full_pages.append(&mut n.host_full);
        out.host_swa_pages.append(&mut n.host_swa);
        out.host_mamba_slots.extend(n.host_mamba.take());
        let parent = self.arena.nodes[i as usize].parent;
        let siblings = &mut self.arena.nodes[parent as usize].children;
        if let Some(p) = siblings.iter().position(|&x| x == i) {
            siblings.swap_remove(p);
        }
        self.arena.release(i);
        if parent != ROOT {
            self.update_leaf(parent);
        }
        parent
    }
}
