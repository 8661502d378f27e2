//! Hybrid models (Mamba, sliding window): where a cached prefix is reusable.
//!
//! A hybrid model's prefix of `p` pages is reusable from a tier only where every component
//! is, counting that tier and the faster ones: the Full-attention pages up to `p` (the index's
//! table), *and*, when the model has Mamba, a Mamba state at exactly `p` (a state exists only
//! at some nodes: a match ends at the deepest one), *and*, when it has a sliding window of `w`
//! tokens, the SWA pages of the last `ceil(w / page)` pages before `p` (a run of SWA pages
//! reaching the first page counts, however short). This is the rule of the hybrid tree's
//! validators (`hicache_core::unified`, `Validators::all`) and of SGLang's
//! `UnifiedRadixCache`, read page by page: a node holds a component on all its pages or on
//! none, so a run of SWA pages is a run of SWA nodes and a state's page is a node's end.
//!
//! The residency of the two components comes from the engines' KV events
//! ([`ComponentEvent`], decoded from vLLM's `kv_cache_spec_kind` fields, which hicache-rs's
//! publisher writes with its `component_events` option): [`Components`] keeps, per holder and
//! tier, the blocks holding an SWA page and the blocks holding a Mamba state, and what the
//! model has (Mamba, the window) as the stores declared it. The router caps each instance's
//! match with [`Components::cap`]; with nothing declared it credits nothing: a hybrid fleet is
//! never routed to a false hit, at worst routed by load.
//!
//! Invariants:
//! 1. A block is in a (holder, tier, component) set exactly between the store and the removal
//!    the holder's engine reported for it (by its engine hash); an `AllBlocksCleared`, a fenced
//!    restart or the death of an instance empties its L1 and L2 sets (and its L3 ones when its
//!    L3 is its own), as [`InstanceFeed::clear`] does for the table.
//! 2. A store is resolved to the index's block hash through the instance's engine-hash map
//!    (the Full pages of the same blocks, stored before in the same stream); a block the map
//!    does not know is counted ([`ComponentCounts::unresolved`]) and not recorded: a miss,
//!    never a wrong hit.
//! 3. L3 components go to the instance's L3 holder (its shared store, or itself), like the
//!    table's L3 pages; a shared store's pages the service forgets by TTL leave its component
//!    sets too ([`Components::drop_blocks`]).

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

use crate::chain::BlockHash;
use crate::decode::{ComponentEvent, ComponentKind};
use crate::ingest::{InstanceFeed, tier_of_medium};
use crate::table::{HolderId, Tier};

/// How a model's cached prefixes may be reused.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum ReuseRule {
    /// Dense attention: every cached page of a prefix is reusable.
    #[default]
    Dense,
    /// A hybrid model: a prefix is reusable only where every component is
    /// ([`Components::cap`]).
    Hybrid,
}

/// The components a hybrid model has besides Full attention.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HybridModel {
    /// Mamba states (a prefix ends where a state is).
    pub mamba: bool,
    /// The sliding window in tokens.
    pub swa_window: Option<u32>,
}

impl HybridModel {
    /// Whether the model has a component besides Full attention.
    pub fn is_hybrid(&self) -> bool {
        self.mamba || self.swa_window.is_some()
    }
}

/// What applying component events did, counted.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ComponentCounts {
    /// Block residencies stored.
    pub stored: u64,
    /// Block residencies removed.
    pub removed: u64,
    /// Blocks the instance's engine-hash map did not know (stores), or never stored
    /// (removals): not recorded (invariant 2).
    pub unresolved: u64,
    /// Events dropped as malformed (a block size other than the model's, an unknown medium).
    pub malformed: u64,
}

/// One component's blocks in one (holder, tier): by engine hash, and counted by index hash.
#[derive(Clone, Debug, Default)]
struct Blocks {
    by_engine: HashMap<i64, BlockHash>,
    count: HashMap<BlockHash, u32>,
}

impl Blocks {
    fn insert(&mut self, engine: i64, block: BlockHash) -> bool {
        if self.by_engine.contains_key(&engine) {
            return false;
        }
        self.by_engine.insert(engine, block);
        *self.count.entry(block).or_insert(0) += 1;
        true
    }

    fn remove_engine(&mut self, engine: i64) -> bool {
        let Some(block) = self.by_engine.remove(&engine) else {
            return false;
        };
        self.release(block);
        true
    }

    fn release(&mut self, block: BlockHash) {
        if let Some(n) = self.count.get_mut(&block) {
            *n -= 1;
            if *n == 0 {
                self.count.remove(&block);
            }
        }
    }

    fn contains(&self, block: &BlockHash) -> bool {
        self.count.contains_key(block)
    }

    fn len(&self) -> usize {
        self.by_engine.len()
    }
}

/// The SWA pages and Mamba states one holder holds in one tier.
#[derive(Clone, Debug, Default)]
struct Resident {
    swa: Blocks,
    mamba: Blocks,
}

impl Resident {
    fn of(&mut self, kind: ComponentKind) -> &mut Blocks {
        match kind {
            ComponentKind::SlidingWindow { .. } => &mut self.swa,
            ComponentKind::Mamba => &mut self.mamba,
        }
    }
}

/// Per (holder, tier) component residency of one model's fleet (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct Components {
    model: HybridModel,
    resident: HashMap<(HolderId, Tier), Resident>,
    /// Instance → the holder of its L3 pages.
    l3_of: HashMap<HolderId, HolderId>,
}

impl Components {
    /// Nothing recorded, nothing declared.
    pub fn new() -> Self {
        Self::default()
    }

    /// What the model has, as declared (by [`declare`](Self::declare) or the stores).
    pub fn model(&self) -> HybridModel {
        self.model
    }

    /// Whether the model is known to be hybrid (its router then applies
    /// [`ReuseRule::Hybrid`]).
    pub fn is_hybrid(&self) -> bool {
        self.model.is_hybrid()
    }

    /// Declares what the model has (a configuration, or a restored snapshot); stores declare
    /// it too (a Mamba store: Mamba; an SWA store: its window).
    pub fn declare(&mut self, model: HybridModel) {
        self.model.mamba |= model.mamba;
        if model.swa_window.is_some() {
            self.model.swa_window = model.swa_window;
        }
    }

    /// `instance`'s L3 pages are held by `l3` (a shared store, or itself).
    pub fn attach(&mut self, instance: HolderId, l3: HolderId) {
        self.l3_of.insert(instance, l3);
    }

    fn l3_holder(&self, instance: HolderId) -> HolderId {
        self.l3_of.get(&instance).copied().unwrap_or(instance)
    }

    /// Records that `holder` holds `kind` at `block` (engine hash `engine`) in `tier`.
    pub fn store(
        &mut self,
        holder: HolderId,
        tier: Tier,
        kind: ComponentKind,
        engine: i64,
        block: BlockHash,
    ) -> bool {
        self.declare_kind(kind);
        self.resident
            .entry((holder, tier))
            .or_default()
            .of(kind)
            .insert(engine, block)
    }

    /// Records that `holder` no longer holds `kind` at engine hash `engine` in `tier`; whether
    /// it was recorded.
    pub fn remove(
        &mut self,
        holder: HolderId,
        tier: Tier,
        kind: ComponentKind,
        engine: i64,
    ) -> bool {
        self.resident
            .get_mut(&(holder, tier))
            .is_some_and(|r| r.of(kind).remove_engine(engine))
    }

    fn declare_kind(&mut self, kind: ComponentKind) {
        match kind {
            ComponentKind::Mamba => self.model.mamba = true,
            ComponentKind::SlidingWindow { window } if window > 0 => {
                self.model.swa_window = Some(window);
            }
            ComponentKind::SlidingWindow { .. } => {}
        }
    }

    /// Applies one event of the instance fed by `feed` (invariants 1–3).
    pub fn apply(
        &mut self,
        feed: &InstanceFeed,
        ev: &ComponentEvent,
        counts: &mut ComponentCounts,
    ) {
        let (kind, hashes, medium, size) = match ev {
            ComponentEvent::Cleared => {
                self.clear(feed.instance());
                return;
            }
            ComponentEvent::Stored {
                kind,
                block_hashes,
                block_size,
                medium,
            } => (*kind, block_hashes, medium, Some(*block_size)),
            ComponentEvent::Removed {
                kind,
                block_hashes,
                medium,
            } => (*kind, block_hashes, medium, None),
        };
        let Some(tier) = tier_of_medium(medium.as_deref()) else {
            counts.malformed += 1;
            return;
        };
        let holder = if tier == Tier::L3 {
            feed.l3_holder()
        } else {
            feed.instance()
        };
        self.attach(feed.instance(), feed.l3_holder());
        match size {
            Some(size) if size != feed.page_size() => counts.malformed += 1,
            Some(_) => {
                for &e in hashes {
                    match feed.resolve(e) {
                        Some(block) => {
                            self.store(holder, tier, kind, e, block);
                            counts.stored += 1;
                        }
                        None => counts.unresolved += 1,
                    }
                }
            }
            None => {
                for &e in hashes {
                    if self.remove(holder, tier, kind, e) {
                        counts.removed += 1;
                    } else {
                        counts.unresolved += 1;
                    }
                }
            }
        }
    }

    /// Empties `instance`'s L1 and L2 sets, and its L3 ones when its L3 is its own
    /// (invariant 1); a shared store keeps what it holds.
    pub fn clear(&mut self, instance: HolderId) {
        let own_l3 = self.l3_holder(instance) == instance;
        self.resident
            .retain(|(h, t), _| *h != instance || (*t == Tier::L3 && !own_l3));
    }

    /// [`clear`](Self::clear), and forgets where `instance`'s L3 is (it left the fleet).
    pub fn forget(&mut self, instance: HolderId) {
        self.clear(instance);
        self.l3_of.remove(&instance);
    }

    /// Drops `blocks` from every component set of (`holder`, `tier`) (a shared store's pages
    /// forgotten by TTL, invariant 3).
    pub fn drop_blocks(&mut self, holder: HolderId, tier: Tier, blocks: &[BlockHash]) {
        let Some(r) = self.resident.get_mut(&(holder, tier)) else {
            return;
        };
        let gone: hashbrown::HashSet<BlockHash> = blocks.iter().copied().collect();
        for set in [&mut r.swa, &mut r.mamba] {
            set.by_engine.retain(|_, b| !gone.contains(b));
            set.count.retain(|b, _| !gone.contains(b));
        }
    }

    /// Component blocks recorded in `tier` over every holder: (SWA pages, Mamba states).
    pub fn held(&self, tier: Tier) -> (usize, usize) {
        self.resident
            .iter()
            .filter(|((_, t), _)| *t == tier)
            .fold((0, 0), |(s, m), (_, r)| {
                (s + r.swa.len(), m + r.mamba.len())
            })
    }

    /// Component blocks recorded for (`holder`, `tier`): (SWA pages, Mamba states).
    pub fn recorded(&self, holder: HolderId, tier: Tier) -> (usize, usize) {
        self.resident
            .get(&(holder, tier))
            .map_or((0, 0), |r| (r.swa.len(), r.mamba.len()))
    }

    /// The deepest block count `p ≤ blocks` (and `≤ hashes.len()`) at which `instance` can
    /// reuse the prefix `hashes` from `tier` or a faster one (the module's rule, pages of
    /// `page_size` tokens); 0 when none, or when the model declared no component.
    ///
    /// Scans back from the deepest candidate, so a decision costs the distance to the deepest
    /// reusable block, not the prompt's length (a router calls this for every instance and
    /// tier of every decision). A block without its SWA page rules out every `p` whose window
    /// covers it, so the scan resumes below that block.
    pub fn cap(
        &self,
        instance: HolderId,
        tier: Tier,
        hashes: &[BlockHash],
        blocks: usize,
        page_size: usize,
    ) -> usize {
        let mut p = blocks.min(hashes.len());
        if !self.model.is_hybrid() || p == 0 {
            return 0;
        }
        let sets = self.sets(instance, tier);
        if sets.iter().all(Option::is_none) {
            return 0;
        }
        let has = |k: usize, swa: bool| {
            let h = &hashes[k];
            sets.iter()
                .flatten()
                .any(|r| if swa { &r.swa } else { &r.mamba }.contains(h))
        };
        let window = self
            .model
            .swa_window
            .map(|w| (w as usize).div_ceil(page_size.max(1)));
        'candidates: while p > 0 {
            if self.model.mamba && !has(p - 1, false) {
                p -= 1;
                continue;
            }
            if let Some(need) = window {
                // Blocks `p - min(need, p) .. p` must hold their SWA pages.
                let lo = p - need.min(p);
                for k in (lo..p).rev() {
                    if !has(k, true) {
                        p = k;
                        continue 'candidates;
                    }
                }
            }
            return p;
        }
        0
    }

    /// What `instance` holds in `tier` and the faster tiers (its L3 in its L3 holder's).
    fn sets(&self, instance: HolderId, tier: Tier) -> [Option<&Resident>; 3] {
        let l3 = self.l3_holder(instance);
        let set = |t: Tier| {
            let h = if t == Tier::L3 { l3 } else { instance };
            self.resident.get(&(h, t))
        };
        match tier {
            Tier::L1 => [set(Tier::L1), None, None],
            Tier::L2 => [set(Tier::L1), set(Tier::L2), None],
            Tier::L3 => [set(Tier::L1), set(Tier::L2), set(Tier::L3)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::{HolderKind, Index};

    #[test]
    fn a_match_ends_at_a_state_of_a_tier_as_fast() {
        let mut idx = Index::new(None);
        let a = idx.add_holder(HolderKind::Instance).unwrap();
        let b = idx.add_holder(HolderKind::Instance).unwrap();
        let h = [10, 11, 12, 13];
        let mut c = Components::new();
        assert_eq!(c.cap(a, Tier::L3, &h, 4, 4), 0);
        c.store(a, Tier::L2, ComponentKind::Mamba, 1, 11);
        c.store(a, Tier::L1, ComponentKind::Mamba, 3, 13);
        assert_eq!(c.cap(a, Tier::L1, &h, 4, 4), 4);
        assert_eq!(c.cap(a, Tier::L1, &h, 3, 4), 0);
        assert_eq!(c.cap(a, Tier::L2, &h, 3, 4), 2);
        assert_eq!(c.cap(b, Tier::L2, &h, 3, 4), 0);
        assert!(c.remove(a, Tier::L2, ComponentKind::Mamba, 1));
        assert_eq!(c.cap(a, Tier::L3, &h, 3, 4), 0);
        c.clear(a);
        assert_eq!(c.cap(a, Tier::L1, &h, 4, 4), 0);
    }

    #[test]
    fn a_shared_store_holds_components_for_every_instance_on_it() {
        let mut idx = Index::new(None);
        let a = idx.add_holder(HolderKind::Instance).unwrap();
        let b = idx.add_holder(HolderKind::Instance).unwrap();
        let s = idx.add_holder(HolderKind::Store).unwrap();
        let mut c = Components::new();
        c.attach(a, s);
        c.attach(b, s);
        c.store(s, Tier::L3, ComponentKind::Mamba, 7, 12);
        let h = [10, 11, 12];
        assert_eq!(c.cap(b, Tier::L3, &h, 3, 4), 3, "written by a, read by b");
        assert_eq!(c.cap(b, Tier::L2, &h, 3, 4), 0);
        // Clearing an instance keeps the store's; the store's TTL drops them.
        c.clear(a);
        assert_eq!(c.cap(b, Tier::L3, &h, 3, 4), 3);
        c.drop_blocks(s, Tier::L3, &[12]);
        assert_eq!(c.cap(b, Tier::L3, &h, 3, 4), 0);
        assert_eq!(c.recorded(s, Tier::L3), (0, 0));
    }

    #[test]
    fn a_window_needs_its_last_pages_or_a_run_from_the_root() {
        let mut idx = Index::new(None);
        let a = idx.add_holder(HolderKind::Instance).unwrap();
        let h = [10, 11, 12, 13, 14, 15];
        let mut c = Components::new();
        // Window 6 tokens over pages of 4: the last 2 pages before the end.
        let swa = ComponentKind::SlidingWindow { window: 6 };
        c.store(a, Tier::L1, swa, 0, 10);
        assert_eq!(c.cap(a, Tier::L1, &h, 6, 4), 1, "a run from the root");
        for (e, b) in [(2, 12), (3, 13)] {
            c.store(a, Tier::L1, swa, e, b);
        }
        assert_eq!(c.cap(a, Tier::L1, &h, 6, 4), 4);
        assert_eq!(c.cap(a, Tier::L1, &h, 3, 4), 1);
        c.store(a, Tier::L2, swa, 5, 15);
        c.store(a, Tier::L2, swa, 4, 14);
        assert_eq!(c.cap(a, Tier::L1, &h, 6, 4), 4);
        assert_eq!(
            c.cap(a, Tier::L2, &h, 6, 4),
            6,
            "host pages count through L2"
        );
        // With Mamba as well, a state is needed where the window holds.
        c.store(a, Tier::L1, ComponentKind::Mamba, 9, 13);
        assert_eq!(c.cap(a, Tier::L2, &h, 6, 4), 4);
    }

    /// The rule read forward, page by page, as the module docs state it: the reference the
    /// backward scan of [`Components::cap`] must equal.
    fn cap_forward(
        c: &Components,
        instance: HolderId,
        tier: Tier,
        hashes: &[BlockHash],
        blocks: usize,
        page_size: usize,
    ) -> usize {
        if !c.model.is_hybrid() {
            return 0;
        }
        let sets: Vec<&Resident> = c.sets(instance, tier).into_iter().flatten().collect();
        let window = c.model.swa_window.map(|w| (w as usize).div_ceil(page_size));
        let (mut run, mut best) = (0, 0);
        for (k, h) in hashes.iter().take(blocks).enumerate() {
            let p = k + 1;
            if let Some(need) = window {
                run = if sets.iter().any(|r| r.swa.contains(h)) {
                    run + 1
                } else {
                    0
                };
                if run < need.min(p) {
                    continue;
                }
            }
            if c.model.mamba && !sets.iter().any(|r| r.mamba.contains(h)) {
                continue;
            }
            best = p;
        }
        best
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
        /// The backward scan equals the rule read forward, for every holder, tier and length,
        /// with Mamba, a window, or both.
        #[test]
        fn the_backward_scan_equals_the_forward_rule(
            mamba in proptest::bool::ANY,
            window in proptest::option::of(1u32..24),
            residency in proptest::collection::vec((0usize..3, 0usize..3, 0u64..20, proptest::bool::ANY), 0..80),
            blocks in 0usize..24,
        ) {
            let mut idx = Index::new(None);
            let a = idx.add_holder(HolderKind::Instance).unwrap();
            let b = idx.add_holder(HolderKind::Instance).unwrap();
            let s = idx.add_holder(HolderKind::Store).unwrap();
            let holders = [a, b, s];
            let tiers = [Tier::L1, Tier::L2, Tier::L3];
            let mut c = Components::new();
            c.attach(a, s);
            c.declare(HybridModel { mamba, swa_window: window });
            for (i, (h, t, block, swa)) in residency.into_iter().enumerate() {
                let kind = if swa {
                    ComponentKind::SlidingWindow { window: window.unwrap_or(0) }
                } else {
                    ComponentKind::Mamba
                };
                c.store(holders[h], tiers[t], kind, i as i64, block);
            }
            let hashes: Vec<BlockHash> = (0..20).collect();
            for inst in [a, b] {
                for tier in tiers {
                    for n in 0..=blocks {
                        proptest::prop_assert_eq!(
                            c.cap(inst, tier, &hashes, n, 4),
                            cap_forward(&c, inst, tier, &hashes, n, 4),
                            "{:?} {:?} {} blocks", inst, tier, n
                        );
                    }
                }
            }
        }
    }
}
