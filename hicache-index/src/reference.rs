//! A naive model of the index's semantics (see [`table`](crate::table) for the rules), written
//! for clarity, not speed: the oracle the model tests hold [`Index`](crate::Index) to.

use crate::chain::BlockHash;
use crate::table::{HolderId, HolderKind, QueryMatch, Tier};
use std::collections::{BTreeMap, BTreeSet};

/// The naive index: for every (holder, tier, block), the age of its last store.
#[derive(Debug, Default, Clone)]
pub struct ReferenceIndex {
    capacity: Option<u64>,
    kinds: BTreeMap<u32, HolderKind>,
    stores_of: BTreeMap<u32, BTreeSet<u32>>,
    held: BTreeMap<(u32, Tier, BlockHash), (u64, u32)>,
    next_holder: u32,
    clock: u64,
    /// Holder-blocks evicted for capacity.
    pub evicted: u64,
}

impl ReferenceIndex {
    /// An empty model with the given capacity in holder-blocks.
    pub fn new(capacity: Option<u64>) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    /// Adds a holder; ids are given in order from 0, as [`Index`](crate::Index) gives them.
    pub fn add_holder(&mut self, kind: HolderKind) -> HolderId {
        let id = self.next_holder;
        self.next_holder += 1;
        self.kinds.insert(id, kind);
        HolderId(id)
    }

    /// Removes a holder, its blocks and its attachments.
    pub fn remove_holder(&mut self, h: HolderId) {
        self.clear(h);
        self.kinds.remove(&h.0);
        self.stores_of.remove(&h.0);
        for s in self.stores_of.values_mut() {
            s.remove(&h.0);
        }
    }

    /// Instance reads store.
    pub fn attach(&mut self, instance: HolderId, store: HolderId) {
        self.stores_of
            .entry(instance.0)
            .or_default()
            .insert(store.0);
    }

    /// Instance no longer reads store.
    pub fn detach(&mut self, instance: HolderId, store: HolderId) {
        if let Some(s) = self.stores_of.get_mut(&instance.0) {
            s.remove(&store.0);
        }
    }

    /// Stores a chain; returns how many were new.
    pub fn store(&mut self, h: HolderId, tier: Tier, hashes: &[BlockHash]) -> usize {
        self.clock += 1;
        let mut new = 0;
        for (pos, &b) in hashes.iter().enumerate() {
            if self
                .held
                .insert((h.0, tier, b), (self.clock, u32::MAX - pos as u32))
                .is_none()
            {
                new += 1;
            }
        }
        if let Some(cap) = self.capacity {
            while self.held.len() as u64 > cap {
                let oldest = *self
                    .held
                    .iter()
                    .min_by_key(|(_, age)| **age)
                    .map(|(k, _)| k)
                    .expect("over capacity means not empty");
                self.held.remove(&oldest);
                self.evicted += 1;
            }
        }
        new
    }

    /// Removes blocks; returns how many were held.
    pub fn remove(&mut self, h: HolderId, tier: Tier, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .filter(|b| self.held.remove(&(h.0, tier, **b)).is_some())
            .count()
    }

    /// Drops everything `h` holds.
    pub fn clear(&mut self, h: HolderId) -> usize {
        let before = self.held.len();
        self.held.retain(|(id, _, _), _| *id != h.0);
        before - self.held.len()
    }

    fn holds(&self, h: u32, tiers: &[Tier], b: BlockHash) -> bool {
        tiers.iter().any(|t| self.held.contains_key(&(h, *t, b)))
    }

    /// The query, by the rules, holder by holder.
    pub fn query(&self, hashes: &[BlockHash]) -> Vec<QueryMatch> {
        let mut out = Vec::new();
        for (&id, &kind) in &self.kinds {
            if kind != HolderKind::Instance {
                continue;
            }
            let lead = |pred: &dyn Fn(BlockHash) -> bool| {
                hashes.iter().take_while(|b| pred(**b)).count() as u32
            };
            let no_stores = BTreeSet::new();
            let stores = self.stores_of.get(&id).unwrap_or(&no_stores);
            let all = [Tier::L1, Tier::L2, Tier::L3];
            let m = QueryMatch {
                holder: HolderId(id),
                l1: lead(&|b| self.holds(id, &[Tier::L1], b)),
                l2: lead(&|b| self.holds(id, &[Tier::L1, Tier::L2], b)),
                l3: lead(&|b| {
                    self.holds(id, &all, b) || stores.iter().any(|s| self.holds(*s, &all, b))
                }),
            };
            if m.l3 > 0 {
                out.push(m);
            }
        }
        out
    }

    /// Holder-blocks held.
    pub fn holder_blocks(&self) -> u64 {
        self.held.len() as u64
    }
}
