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
    /// The same residencies by age, for eviction (the oldest first).
    by_age: BTreeMap<(u64, u32), (u32, Tier, BlockHash)>,
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
            let age = (self.clock, u32::MAX - pos as u32);
            match self.held.insert((h.0, tier, b), age) {
                None => new += 1,
                Some(old) => {
                    self.by_age.remove(&old);
                }
            }
            self.by_age.insert(age, (h.0, tier, b));
        }
        if let Some(cap) = self.capacity {
            while self.held.len() as u64 > cap {
                let (_, oldest) = self
                    .by_age
                    .pop_first()
                    .expect("over capacity means not empty");
                self.held.remove(&oldest);
                self.evicted += 1;
            }
        }
        new
    }

    /// Removes blocks; returns how many were held.
    pub fn remove(&mut self, h: HolderId, tier: Tier, hashes: &[BlockHash]) -> usize {
        let mut removed = 0;
        for b in hashes {
            if let Some(age) = self.held.remove(&(h.0, tier, *b)) {
                self.by_age.remove(&age);
                removed += 1;
            }
        }
        removed
    }

    /// Drops everything `h` holds.
    pub fn clear(&mut self, h: HolderId) -> usize {
        let before = self.held.len();
        let by_age = &mut self.by_age;
        self.held.retain(|(id, _, _), age| {
            let keep = *id != h.0;
            if !keep {
                by_age.remove(age);
            }
            keep
        });
        before - self.held.len()
    }

    /// The tiers in which `h` holds `b`.
    fn tiers_of(&self, h: u32, b: BlockHash) -> [bool; 3] {
        [Tier::L1, Tier::L2, Tier::L3].map(|t| self.held.contains_key(&(h, t, b)))
    }

    /// The query, by the rules, holder by holder: one walk down the chain per instance, each
    /// tier's run ending at its first block missing.
    pub fn query(&self, hashes: &[BlockHash]) -> Vec<QueryMatch> {
        let mut out = Vec::new();
        for (&id, &kind) in &self.kinds {
            if kind != HolderKind::Instance {
                continue;
            }
            let no_stores = BTreeSet::new();
            let stores = self.stores_of.get(&id).unwrap_or(&no_stores);
            let mut m = QueryMatch {
                holder: HolderId(id),
                l1: 0,
                l2: 0,
                l3: 0,
            };
            let (mut run1, mut run2) = (true, true);
            for &b in hashes {
                let [in1, in2, in3] = self.tiers_of(id, b);
                let shared = || stores.iter().any(|s| self.tiers_of(*s, b).contains(&true));
                run1 &= in1;
                run2 &= in1 || in2;
                if !(in1 || in2 || in3 || shared()) {
                    break;
                }
                m.l1 += u32::from(run1);
                m.l2 += u32::from(run2);
                m.l3 += 1;
            }
            if m.l3 > 0 {
                out.push(m);
            }
        }
        out
    }

    /// Distinct blocks held by anyone.
    pub fn blocks(&self) -> u64 {
        let set: BTreeSet<BlockHash> = self.held.keys().map(|(_, _, b)| *b).collect();
        set.len() as u64
    }

    /// Holder-blocks held.
    pub fn holder_blocks(&self) -> u64 {
        self.held.len() as u64
    }
}
