//! SWA's insert rules: a tombstone overlapped inside the request's window takes the
//! request's KV; a new leaf gets SWA from the window floor on, capped at one window.
//!
//! Invariant kept here: SWA is made present only through `set_present`, which puts the node
//! in the SWA LRU and credits the ledger by the node's SWA lock.

use super::super::node::ROOT;
use super::super::{Component, InsertParams, UnifiedTree};
use crate::unified::SWA;

impl UnifiedTree {
    /// SGLang's `update_component_on_insert_overlap` for SWA: node `i` covers
    /// `[total, total + plen)` of the key. Returns where the tree started consuming the
    /// request's KV (`plen` when it took none).
    pub(crate) fn swa_recover_overlap(
        &mut self,
        i: u32,
        plen: usize,
        total: usize,
        p: &InsertParams,
    ) -> usize {
        if p.prev_prefix_len >= total + plen {
            return plen;
        }
        // Locked Full keeps its own KV and takes only the request's SWA; unlocked Full swaps
        // to the request's KV. Either way SWA becomes present here.
        self.swa_recover_after_unevict(i, total, plen, p)
            .map_or(plen, |live_start| live_start - total)
    }

    /// SGLang's `recover_after_unevict` for SWA (also the recovery of an overlapped
    /// tombstone): node `i`, covering `[total, total + plen)`, takes the request's SWA from
    /// the window floor on. Returns where it starts, `None` when it took none.
    pub(crate) fn swa_recover_after_unevict(
        &mut self,
        i: u32,
        total: usize,
        plen: usize,
        p: &InsertParams,
    ) -> Option<usize> {
        let live_start = self.swa_clip(i, total, total + plen, p.swa_evicted_len)?;
        self.set_present(i, Component::Swa);
        Some(live_start)
    }

    /// SGLang's `_clip_to_window`: for a tombstone `i` covering `[start, end)`, the first
    /// position at or past the window floor, splitting off the part below it. `None` when
    /// SWA is present or the whole span is below the floor.
    fn swa_clip(&mut self, i: u32, start: usize, end: usize, floor: usize) -> Option<usize> {
        if self.arena.nodes[i as usize].comp[SWA].present {
            return None;
        }
        let live_start = start.max(floor);
        if live_start >= end {
            return None;
        }
        if live_start > start {
            self.split(i, live_start - start);
        }
        Some(live_start)
    }

    /// SGLang's `commit_insert_component_data` for SWA on a new leaf `leaf` starting at
    /// `start`: SWA from the window floor on; a leaf longer than one window (rounded up to
    /// pages) is split so the tail holds exactly that; the older part is published first.
    pub(crate) fn swa_commit_leaf(&mut self, leaf: u32, start: usize, p: &InsertParams) {
        let end = start + self.arena.nodes[leaf as usize].key.len();
        if self.swa_clip(leaf, start, end, p.swa_evicted_len).is_none() {
            return;
        }
        let parent = self.swa_cap_leaf(leaf);
        if let Some(parent) = parent {
            self.set_present(parent, Component::Swa);
        }
        self.set_present(leaf, Component::Swa);
    }

    /// SGLang's `_maybe_split_leaf_for_swa_lock`: the split-off older part, if any.
    fn swa_cap_leaf(&mut self, leaf: u32) -> Option<u32> {
        let w = self.cfg.swa_window? as usize;
        if leaf == ROOT || self.arena.nodes[leaf as usize].comp[SWA].lock > 0 {
            return None;
        }
        let ps = self.ps();
        let tail = w.div_ceil(ps) * ps;
        let len = self.arena.nodes[leaf as usize].key.len();
        if len <= tail {
            return None;
        }
        Some(self.split(leaf, len - tail))
    }
}
