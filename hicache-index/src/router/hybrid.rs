//! Hybrid models (Mamba, sliding window): where a cached prefix is reusable.
//!
//! A hybrid model's prefix of `p` tokens is reusable only where every component is: the Full
//! attention pages up to `p`, *and* a Mamba state at exactly `p` (a state exists only at some
//! nodes: a match ends at the deepest one), or the sliding-window pages of the window before
//! `p` (outside the window they are tombstones). This is the rule of the hybrid tree
//! (`hicache_core::unified`) and of SGLang's `UnifiedRadixCache`.
//!
//! Engines publish KV events for Full-attention pages only (SGLang's `BlockStored` names no
//! component, and our hybrid facade follows it), so the index alone would credit a hybrid
//! instance with every Full page it holds: a false hit wherever the state or the window is
//! gone. The design here: the index side also records **reusable ends**, per instance and
//! tier: the chained hash of the block at which the instance can resume (a Mamba checkpoint,
//! or the end of a run whose window is resident). The router caps each instance's match, per
//! tier, at the deepest reusable end inside it, and with no end recorded credits nothing: a
//! hybrid fleet is never routed to a false hit, at worst routed by load.

use std::collections::{HashMap, HashSet};

use crate::chain::BlockHash;
use crate::table::Tier;

/// How a model's cached prefixes may be reused.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum ReuseRule {
    /// Dense attention: every cached page of a prefix is reusable.
    #[default]
    Dense,
    /// A hybrid model: a prefix is reusable only up to a recorded reusable end.
    Hybrid,
}

/// Reusable ends per (instance, tier): the blocks where a hybrid instance can resume.
///
/// Invariant: an end is recorded exactly between the `mark` and the `unmark` the instance's
/// engine reported for it (a state or window evicted is unmarked at once).
#[derive(Clone, Debug, Default)]
pub struct ReusableEnds {
    ends: HashMap<(usize, Tier), HashSet<BlockHash>>,
}

impl ReusableEnds {
    /// No end recorded.
    pub fn new() -> Self {
        Self::default()
    }

    /// `instance` can resume after block `end` from `tier`.
    pub fn mark(&mut self, instance: usize, tier: Tier, end: BlockHash) {
        self.ends.entry((instance, tier)).or_default().insert(end);
    }

    /// `instance` can no longer resume after `end` from `tier`.
    pub fn unmark(&mut self, instance: usize, tier: Tier, end: BlockHash) {
        if let Some(s) = self.ends.get_mut(&(instance, tier)) {
            s.remove(&end);
        }
    }

    /// Drops every end of `instance` (its engine cleared or restarted).
    pub fn clear(&mut self, instance: usize) {
        self.ends.retain(|(i, _), _| *i != instance);
    }

    /// The deepest block count `≤ blocks` at which `instance` can resume from `tier` or a
    /// faster one along `hashes`; 0 when none.
    pub fn cap(&self, instance: usize, tier: Tier, hashes: &[BlockHash], blocks: usize) -> usize {
        let tiers: &[Tier] = match tier {
            Tier::L1 => &[Tier::L1],
            Tier::L2 => &[Tier::L1, Tier::L2],
            Tier::L3 => &[Tier::L1, Tier::L2, Tier::L3],
        };
        let sets: Vec<&HashSet<BlockHash>> = tiers
            .iter()
            .filter_map(|t| self.ends.get(&(instance, *t)))
            .collect();
        (1..=blocks.min(hashes.len()))
            .rev()
            .find(|&n| sets.iter().any(|s| s.contains(&hashes[n - 1])))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_match_is_capped_at_the_deepest_end_of_a_tier_as_fast() {
        let h = [10, 11, 12, 13];
        let mut e = ReusableEnds::new();
        assert_eq!(e.cap(0, Tier::L3, &h, 4), 0);
        e.mark(0, Tier::L2, 11);
        e.mark(0, Tier::L1, 13);
        assert_eq!(e.cap(0, Tier::L1, &h, 4), 4);
        assert_eq!(e.cap(0, Tier::L1, &h, 3), 0);
        assert_eq!(e.cap(0, Tier::L2, &h, 3), 2);
        assert_eq!(e.cap(1, Tier::L2, &h, 3), 0);
        e.unmark(0, Tier::L2, 11);
        assert_eq!(e.cap(0, Tier::L3, &h, 3), 0);
        e.clear(0);
        assert_eq!(e.cap(0, Tier::L1, &h, 4), 0);
    }
}
