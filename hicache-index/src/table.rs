//! The index: which holder holds which block in which tier.
//!
//! Semantics (the [`reference`](crate::reference) model states the same in the plainest code,
//! and the model tests hold this implementation to it):
//!
//! 1. A holder is an *instance* (tiers L1, L2, and L3 for a private L3 store of its own) or a
//!    *store* (tier L3 only): an L3 store that several instances may attach to.
//! 2. `store` and `remove` are idempotent per (holder, tier, block): storing a block held
//!    already refreshes its age, removing an absent block does nothing. `clear` drops every
//!    block of a holder; removing a holder also detaches it.
//! 3. A query walks a chain of block hashes from its first block. For each instance holder,
//!    `l1` is the length of the leading run of blocks it holds in L1, `l2` the leading run held
//!    in L1 or L2, `l3` the leading run held in L1, L2, its own L3, or the L3 of any store it is
//!    attached to; so `l1 ≤ l2 ≤ l3`. Instances with `l3 == 0` are left out.
//! 4. With a capacity, the number of holder-blocks never exceeds it after an operation: the
//!    holder-blocks stored least recently are evicted first, and within one `store` call the
//!    deepest block first (a chain loses its tail before its head), counted in
//!    [`IndexStats::evicted`].

use crate::chain::BlockHash;
use crate::error::{IndexError, Result};
use hashbrown::HashMap;
use std::collections::{BTreeMap, HashSet};

/// A tier of the cache hierarchy.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// Device memory.
    L1,
    /// Pinned host memory.
    L2,
    /// Storage (an instance's own, or a shared store).
    L3,
}

impl Tier {
    /// The tier's bit in a tier mask.
    pub fn bit(self) -> u8 {
        match self {
            Tier::L1 => 1,
            Tier::L2 => 2,
            Tier::L3 => 4,
        }
    }
}

/// A holder's id, given by [`Index::add_holder`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HolderId(pub u32);

/// What a holder is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HolderKind {
    /// One dp rank of one engine instance.
    Instance,
    /// An L3 store instances attach to.
    Store,
}

/// One instance's answer to a query, in blocks, each tier cumulative through the faster ones.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct QueryMatch {
    /// The instance.
    pub holder: HolderId,
    /// Leading blocks in L1.
    pub l1: u32,
    /// Leading blocks in L1 or L2.
    pub l2: u32,
    /// Leading blocks in L1, L2 or an L3 the instance reads.
    pub l3: u32,
}

/// The index's own accounting.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Live holders.
    pub holders: u64,
    /// Distinct blocks held by anyone.
    pub blocks: u64,
    /// (holder, tier, block) residencies.
    pub holder_blocks: u64,
    /// Holder-blocks evicted for capacity since the start.
    pub evicted: u64,
    /// Bytes the index's structures hold (their allocated capacity).
    pub bytes: u64,
}

#[derive(Clone, Debug)]
struct Holder {
    kind: HolderKind,
    /// Stores an instance reads (instances only).
    stores: Vec<HolderId>,
    /// Blocks held (any tier).
    blocks: HashSet<BlockHash>,
}

/// Key of one holder-block in the age order: (store call, position in it reversed).
type Age = (u64, u32);

/// The fleet's KV index for one model.
#[derive(Debug, Default)]
pub struct Index {
    capacity: Option<u64>,
    holders: Vec<Option<Holder>>,
    /// block → (holder, tier mask) pairs.
    blocks: HashMap<BlockHash, Vec<(u32, u8)>>,
    /// Age of each holder-block, for capacity eviction.
    ages: BTreeMap<Age, (u32, Tier, BlockHash)>,
    age_of: HashMap<(u32, Tier, BlockHash), Age>,
    clock: u64,
    holder_blocks: u64,
    evicted: u64,
}

impl Index {
    /// An empty index holding at most `capacity` holder-blocks (`None`: unbounded).
    pub fn new(capacity: Option<u64>) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    /// Adds a holder.
    pub fn add_holder(&mut self, kind: HolderKind) -> Result<HolderId> {
        if self.holders.len() >= u32::MAX as usize {
            return Err(IndexError::TooManyHolders(u32::MAX as usize));
        }
        self.holders.push(Some(Holder {
            kind,
            stores: Vec::new(),
            blocks: HashSet::new(),
        }));
        Ok(HolderId(self.holders.len() as u32 - 1))
    }

    fn holder(&self, h: HolderId) -> Result<&Holder> {
        self.holders
            .get(h.0 as usize)
            .and_then(Option::as_ref)
            .ok_or(IndexError::UnknownHolder(h.0))
    }

    fn holder_mut(&mut self, h: HolderId) -> Result<&mut Holder> {
        self.holders
            .get_mut(h.0 as usize)
            .and_then(Option::as_mut)
            .ok_or(IndexError::UnknownHolder(h.0))
    }

    fn expect_kind(&self, h: HolderId, expected: HolderKind) -> Result<()> {
        let actual = self.holder(h)?.kind;
        if actual == expected {
            return Ok(());
        }
        let name = |k| match k {
            HolderKind::Instance => "instance",
            HolderKind::Store => "store",
        };
        Err(IndexError::WrongHolderKind {
            holder: h.0,
            actual: name(actual),
            expected: name(expected),
        })
    }

    /// Removes a holder and everything it holds; instances attached to a removed store are
    /// detached from it.
    pub fn remove_holder(&mut self, h: HolderId) -> Result<()> {
        self.clear(h)?;
        self.holders[h.0 as usize] = None;
        for other in self.holders.iter_mut().flatten() {
            other.stores.retain(|s| *s != h);
        }
        Ok(())
    }

    /// Instance `instance` reads store `store` from now on.
    pub fn attach(&mut self, instance: HolderId, store: HolderId) -> Result<()> {
        self.expect_kind(instance, HolderKind::Instance)?;
        self.expect_kind(store, HolderKind::Store)?;
        let i = self.holder_mut(instance)?;
        if !i.stores.contains(&store) {
            i.stores.push(store);
        }
        Ok(())
    }

    /// Instance `instance` no longer reads store `store`.
    pub fn detach(&mut self, instance: HolderId, store: HolderId) -> Result<()> {
        self.holder_mut(instance)?.stores.retain(|s| *s != store);
        Ok(())
    }

    /// `h` holds `hashes` in `tier` (a chain, first block first). Returns how many of them
    /// were not held there before.
    pub fn store(&mut self, h: HolderId, tier: Tier, hashes: &[BlockHash]) -> Result<usize> {
        if self.holder(h)?.kind == HolderKind::Store && tier != Tier::L3 {
            return Err(IndexError::StoreTier(h.0, tier));
        }
        self.clock += 1;
        let mut new = 0;
        for (pos, &b) in hashes.iter().enumerate() {
            let entries = self.blocks.entry(b).or_default();
            match entries.iter_mut().find(|(id, _)| *id == h.0) {
                Some((_, mask)) if *mask & tier.bit() != 0 => {}
                Some((_, mask)) => {
                    *mask |= tier.bit();
                    new += 1;
                }
                None => {
                    entries.push((h.0, tier.bit()));
                    new += 1;
                }
            }
            let age = (self.clock, u32::MAX - pos as u32);
            if let Some(old) = self.age_of.insert((h.0, tier, b), age) {
                self.ages.remove(&old);
            } else {
                self.holder_blocks += 1;
            }
            self.ages.insert(age, (h.0, tier, b));
            self.holder_mut(h)?.blocks.insert(b);
        }
        self.enforce_capacity();
        Ok(new)
    }

    fn enforce_capacity(&mut self) {
        let Some(cap) = self.capacity else { return };
        while self.holder_blocks > cap {
            let Some((_, (h, tier, b))) = self.ages.pop_first() else {
                break;
            };
            self.drop_one(h, tier, b);
            self.evicted += 1;
        }
    }

    /// Drops one holder-block whose age entry is already gone.
    fn drop_one(&mut self, h: u32, tier: Tier, b: BlockHash) {
        self.age_of.remove(&(h, tier, b));
        self.holder_blocks -= 1;
        let mut gone_for_holder = false;
        if let Some(entries) = self.blocks.get_mut(&b) {
            if let Some(i) = entries.iter().position(|(id, _)| *id == h) {
                entries[i].1 &= !tier.bit();
                if entries[i].1 == 0 {
                    entries.swap_remove(i);
                    gone_for_holder = true;
                }
            }
            if entries.is_empty() {
                self.blocks.remove(&b);
            }
        }
        if gone_for_holder && let Some(Some(holder)) = self.holders.get_mut(h as usize) {
            holder.blocks.remove(&b);
        }
    }

    /// `h` no longer holds `hashes` in `tier`. Returns how many it held.
    pub fn remove(&mut self, h: HolderId, tier: Tier, hashes: &[BlockHash]) -> Result<usize> {
        self.holder(h)?;
        let mut removed = 0;
        for &b in hashes {
            if let Some(age) = self.age_of.get(&(h.0, tier, b)).copied() {
                self.ages.remove(&age);
                self.drop_one(h.0, tier, b);
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// `h` holds nothing any more. Returns how many holder-blocks it held.
    pub fn clear(&mut self, h: HolderId) -> Result<usize> {
        let blocks: Vec<BlockHash> = self.holder(h)?.blocks.iter().copied().collect();
        let mut removed = 0;
        for tier in [Tier::L1, Tier::L2, Tier::L3] {
            removed += self.remove(h, tier, &blocks)?;
        }
        Ok(removed)
    }

    /// The instances holding a prefix of `hashes`, in holder order, written to `out` (cleared
    /// first).
    pub fn query(&self, hashes: &[BlockHash], out: &mut Vec<QueryMatch>) {
        out.clear();
        for (id, holder) in self.holders.iter().enumerate() {
            let Some(holder) = holder else { continue };
            if holder.kind != HolderKind::Instance {
                continue;
            }
            let mut m = QueryMatch {
                holder: HolderId(id as u32),
                l1: 0,
                l2: 0,
                l3: 0,
            };
            let (mut in1, mut in2) = (true, true);
            for &b in hashes {
                let Some(entries) = self.blocks.get(&b) else {
                    break;
                };
                let own = entries
                    .iter()
                    .find(|(hid, _)| *hid == id as u32)
                    .map_or(0, |e| e.1);
                let shared = entries
                    .iter()
                    .any(|(hid, _)| holder.stores.iter().any(|s| s.0 == *hid));
                in1 &= own & 1 != 0;
                in2 &= own & 3 != 0;
                if in1 {
                    m.l1 += 1;
                }
                if in2 {
                    m.l2 += 1;
                }
                if own != 0 || shared {
                    m.l3 += 1;
                } else {
                    break;
                }
            }
            if m.l3 > 0 {
                out.push(m);
            }
        }
    }

    /// The index's accounting.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            holders: self.holders.iter().flatten().count() as u64,
            blocks: self.blocks.len() as u64,
            holder_blocks: self.holder_blocks,
            evicted: self.evicted,
            bytes: 0,
        }
    }
}
