//! `insert`: the walk over existing nodes (with SWA tombstone recovery on overlaps and
//! host-only nodes put back on device with the request's KV), the new leaf, and each
//! component's commit.

use super::node::ROOT;
use super::{Component, InsertSlots, UnifiedTree};
use super::{FULL, MAMBA, MAMBA_LRU, SWA};
use crate::error::{CoreError, Result};
use crate::tree::NodeId;

/// What an insert needs besides the key (SGLang's `InsertParams`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InsertParams {
    /// Tokens of the key the request already shares with the tree (its
    /// `cache_protected_len`): overlaps below it are not duplicates.
    pub prev_prefix_len: usize,
    /// The request's SWA eviction floor in tokens (page-aligned): positions below it have no
    /// SWA KV, so SWA is neither recovered nor created there.
    pub swa_evicted_len: usize,
    /// The Mamba state slot handed to the tree (required when Mamba is configured).
    pub mamba_slot: Option<u32>,
}

/// What an insert did (SGLang's `InsertResult`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnifiedInsert {
    /// Tokens of the key that were already in the tree.
    pub prefix_len: usize,
    /// The node the key ends on.
    pub node: NodeId,
    /// The target already had a Mamba state: the handed slot was not taken.
    pub mamba_exist: bool,
    /// Tokens of the request's KV the tree did not take (duplicates of cached tokens): the
    /// caller frees them.
    pub duplicate_tokens: usize,
    /// Device Full slots the caller frees: the request's pages the tree did not adopt and
    /// tree pages replaced by the request's ([`UnifiedTree::insert_with_slots`] only).
    pub release_full: Vec<u32>,
    /// Device SWA slots of the request the tree did not adopt
    /// ([`UnifiedTree::insert_with_slots`] only).
    pub release_swa: Vec<u32>,
}

impl UnifiedTree {
    /// Inserts `key` (a whole number of pages). Existing nodes are touched and reused; SWA
    /// tombstones inside the request's window take the request's KV; the remainder becomes a
    /// new leaf with Full, SWA from the window floor on (capped at one window by a split) and
    /// the handed Mamba state. A tree made with
    /// [`with_device_slots`](Self::with_device_slots) takes
    /// [`insert_with_slots`](Self::insert_with_slots) instead.
    pub fn insert(&mut self, key: &[u32], p: &InsertParams) -> Result<UnifiedInsert> {
        if self.slots {
            return Err(CoreError::InvalidPolicy {
                field: "slots",
                value: "none".into(),
                reason: "this tree tracks device slots: use insert_with_slots",
            });
        }
        self.insert_inner(key, p, None)
    }

    /// The insert, with the request's slots when the tree tracks them.
    pub(crate) fn insert_inner(
        &mut self,
        key: &[u32],
        p: &InsertParams,
        slots: Option<InsertSlots<'_>>,
    ) -> Result<UnifiedInsert> {
        if !key.len().is_multiple_of(self.ps()) {
            return Err(CoreError::Unaligned {
                what: "key",
                len: key.len(),
                page_size: self.cfg.page_size,
            });
        }
        if self.has[MAMBA] && p.mamba_slot.is_none() && !key.is_empty() {
            return Err(CoreError::InvalidPolicy {
                field: "mamba_slot",
                value: "none".into(),
                reason: "the Mamba component needs a state slot on insert",
            });
        }
        let time = self.tick();
        self.stamp(ROOT, time);
        if key.is_empty() {
            return Ok(UnifiedInsert {
                prefix_len: 0,
                node: self.root(),
                mamba_exist: true,
                duplicate_tokens: 0,
                release_full: Vec::new(),
                release_swa: Vec::new(),
            });
        }
        let (mut node, mut total, mut dup) = (ROOT, 0usize, 0usize);
        let mut replaced = Vec::new();
        while total < key.len() {
            let Some(child) = self.child(node, &key[total..]) else {
                break;
            };
            let time = self.tick();
            self.stamp(child, time);
            let plen = self.match_len(child, &key[total..]);
            let next = if plen < self.arena.nodes[child as usize].key.len() {
                self.split(child, plen)
            } else {
                child
            };
            let consumed_from = if !self.arena.nodes[next as usize].comp[FULL].present {
                // A host-only node takes the request's KV back on device (SGLang's
                // `_unevict_node_on_insert` and `recover_after_unevict`).
                self.unevict(next);
                if self.has[SWA] {
                    self.swa_recover_after_unevict(next, total, plen, p);
                }
                0
            } else if self.has[SWA] {
                self.swa_recover_overlap(next, plen, total, p)
            } else {
                plen
            };
            if let Some(s) = slots
                && consumed_from < plen
            {
                self.adopt_recovered_full(next, total + consumed_from, s, &mut replaced);
            }
            let dup_start = p.prev_prefix_len.saturating_sub(total);
            dup += consumed_from.saturating_sub(dup_start);
            node = next;
            total += plen;
        }
        let new_leaf = total < key.len();
        let target = if new_leaf {
            self.add_leaf(node, key[total..].to_vec())
        } else {
            node
        };
        if self.has[SWA] && new_leaf {
            self.swa_commit_leaf(target, total, p);
        }
        let mamba_exist = match (self.has[MAMBA], p.mamba_slot) {
            (true, Some(slot)) => self.mamba_commit(target, new_leaf, slot),
            _ => false,
        };
        if let Some(w) = self.cfg.swa_window
            && target != ROOT
        {
            self.refresh_window(target, w as usize + self.ps());
        }
        let mut out = UnifiedInsert {
            prefix_len: total,
            node: self.id(target),
            mamba_exist,
            duplicate_tokens: dup,
            release_full: replaced,
            release_swa: Vec::new(),
        };
        if let Some(s) = slots {
            self.settle_slots(target, p, s, &mut out);
        }
        Ok(out)
    }

    /// Puts the host-only node `i` back on device (its Full slots come from the insert or
    /// the load-back that calls this).
    pub(crate) fn unevict(&mut self, i: u32) {
        self.arena.nodes[i as usize].comp[FULL].present = true;
        self.credit(i, Component::Full);
        self.update_leaf(i);
        let parent = self.arena.nodes[i as usize].parent;
        if parent != ROOT {
            self.update_leaf(parent);
        }
    }

    /// A new leaf under `parent` with Full present (SGLang's `_add_new_node`).
    fn add_leaf(&mut self, parent: u32, key: Vec<u32>) -> u32 {
        let time = self.tick();
        let i = self.arena.alloc(parent, key, time);
        self.arena.nodes[parent as usize].children.push(i);
        self.arena.nodes[i as usize].comp[FULL].present = true;
        self.evictable[Component::Full as usize] += self.comp_len(i, Component::Full);
        self.update_leaf(i);
        self.update_leaf(parent);
        i
    }

    /// Mamba's commit: a new leaf takes the slot; an existing node without state takes it
    /// (and is stamped); one with state keeps its own (`mamba_exist`), refreshed and stamped.
    fn mamba_commit(&mut self, target: u32, new_leaf: bool, slot: u32) -> bool {
        let has_state = self.arena.nodes[target as usize].comp[MAMBA].present;
        if new_leaf || !has_state {
            self.arena.nodes[target as usize].mamba_slot = slot;
            self.set_present(target, Component::Mamba);
            if !new_leaf {
                let time = self.tick();
                self.stamp(target, time);
            }
            return false;
        }
        self.lrus[MAMBA_LRU].touch(target);
        let time = self.tick();
        self.stamp(target, time);
        true
    }
}
