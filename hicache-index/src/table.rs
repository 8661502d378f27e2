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

//!
//! Layout and cost (see [`blocks`], [`slot_map`] and [`ages`]): one hash table from block
//! hash to a compact sorted set of `(holder, tier)` words (inline when a block has one or two,
//! sorted chunks in an arena otherwise), 4 bytes per holder-block beyond the second plus 16
//! bytes and an 8-byte table bucket (at a load of 0.44–0.67) per block; one age log per
//! (holder, tier), 4 bytes per holder-block plus one 8-byte batch record per `store` call,
//! which gives the eviction order, `clear` in the holder's own size, and exact refreshes (a small per-log map names the live entry of a refreshed
//! holder-block until the log is compacted). A query walks the chain once, a run of blocks
//! with the same holder set at a time, narrowing the set of instances still matching, and
//! stops when it is empty.

mod ages;
mod blocks;
mod query;
mod slot_map;

use self::ages::{AgeLog, CallSeen};
use self::blocks::{BlockTable, Memo};
use crate::chain::BlockHash;
use crate::error::{IndexError, Result};
use std::collections::BTreeSet;

pub use self::query::Answer;

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
        1 << self.index()
    }

    /// The tier's index: 0 for L1, 1 for L2, 2 for L3.
    pub fn index(self) -> usize {
        match self {
            Tier::L1 => 0,
            Tier::L2 => 1,
            Tier::L3 => 2,
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

/// Holder ids are below this (an entry packs `id << 2 | tier` below bit 31).
const MAX_HOLDERS: usize = 1 << 29;

const KIND_INSTANCE: u8 = 1;
const KIND_STORE: u8 = 2;

#[derive(Debug)]
struct Holder {
    kind: HolderKind,
    /// Stores an instance reads (instances only), in attach order.
    stores: Vec<u32>,
    /// Instances reading a store (stores only), sorted.
    readers: Vec<u32>,
    /// Age log per tier.
    logs: [AgeLog; 3],
}

#[inline]
fn ht_of(h: u32, tier: usize) -> u32 {
    h << 2 | tier as u32
}

/// The fleet's KV index for one model.
#[derive(Debug)]
pub struct Index {
    capacity: Option<u64>,
    holders: Vec<Option<Holder>>,
    /// Per holder id: 0 removed, 1 instance, 2 store (the query's view of `holders`).
    kinds: Vec<u8>,
    blocks: BlockTable,
    /// (front batch clock, ht) of every non-empty age log: the eviction order of the logs.
    fronts: BTreeSet<(u64, u32)>,
    clock: u64,
    holder_blocks: u64,
    evicted: u64,
    /// Bumped whenever a store's readers change (attach, detach, a holder removed): part of
    /// the key of a query's cached first set (see [`Answer`]).
    readers_epoch: u64,
    /// Scratch of `store` and `remove`: the slots of a call's blocks, looked up first.
    found: Vec<Option<u32>>,
}

impl Default for Index {
    fn default() -> Self {
        Self::new(None)
    }
}

impl Index {
    /// An empty index holding at most `capacity` holder-blocks (`None`: unbounded).
    pub fn new(capacity: Option<u64>) -> Self {
        Self {
            capacity,
            holders: Vec::new(),
            kinds: Vec::new(),
            blocks: BlockTable::new(),
            fronts: BTreeSet::new(),
            clock: 0,
            holder_blocks: 0,
            evicted: 0,
            readers_epoch: 0,
            found: Vec::new(),
        }
    }

    /// Adds a holder.
    pub fn add_holder(&mut self, kind: HolderKind) -> Result<HolderId> {
        if self.holders.len() >= MAX_HOLDERS {
            return Err(IndexError::TooManyHolders(MAX_HOLDERS));
        }
        self.holders.push(Some(Holder {
            kind,
            stores: Vec::new(),
            readers: Vec::new(),
            logs: Default::default(),
        }));
        self.kinds.push(match kind {
            HolderKind::Instance => KIND_INSTANCE,
            HolderKind::Store => KIND_STORE,
        });
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
        let Some(gone) = self.holders[h.0 as usize].take() else {
            return Ok(());
        };
        self.kinds[h.0 as usize] = 0;
        self.readers_epoch += 1;
        for s in gone.stores {
            if let Some(Some(store)) = self.holders.get_mut(s as usize) {
                store.readers.retain(|r| *r != h.0);
            }
        }
        for r in gone.readers {
            if let Some(Some(reader)) = self.holders.get_mut(r as usize) {
                reader.stores.retain(|s| *s != h.0);
            }
        }
        Ok(())
    }

    /// Instance `instance` reads store `store` from now on.
    pub fn attach(&mut self, instance: HolderId, store: HolderId) -> Result<()> {
        self.expect_kind(instance, HolderKind::Instance)?;
        self.expect_kind(store, HolderKind::Store)?;
        self.readers_epoch += 1;
        let i = self.holder_mut(instance)?;
        if i.stores.contains(&store.0) {
            return Ok(());
        }
        i.stores.push(store.0);
        let s = self.holder_mut(store)?;
        if let Err(at) = s.readers.binary_search(&instance.0) {
            s.readers.insert(at, instance.0);
        }
        Ok(())
    }

    /// Instance `instance` no longer reads store `store`.
    pub fn detach(&mut self, instance: HolderId, store: HolderId) -> Result<()> {
        self.readers_epoch += 1;
        self.holder_mut(instance)?.stores.retain(|s| *s != store.0);
        if let Some(Some(s)) = self.holders.get_mut(store.0 as usize) {
            s.readers.retain(|r| *r != instance.0);
        }
        Ok(())
    }

    /// Re-registers the log of `ht` in the eviction order after its front batch changed.
    fn sync_front(fronts: &mut BTreeSet<(u64, u32)>, log: &mut AgeLog, ht: u32) {
        let now = log.front_clock();
        if now != log.key {
            if let Some(old) = log.key {
                fronts.remove(&(old, ht));
            }
            if let Some(new) = now {
                fronts.insert((new, ht));
            }
            log.key = now;
        }
    }

    /// Compacts `log` when its dead entries are due.
    fn maybe_compact(log: &mut AgeLog) {
        if log.wants_compaction() {
            log.compact();
        }
    }

    /// `h` holds `hashes` in `tier` (a chain, first block first). Returns how many of them
    /// were not held there before.
    pub fn store(&mut self, h: HolderId, tier: Tier, hashes: &[BlockHash]) -> Result<usize> {
        if self.holder(h)?.kind == HolderKind::Store && tier != Tier::L3 {
            return Err(IndexError::StoreTier(h.0, tier));
        }
        self.clock += 1;
        let ht = ht_of(h.0, tier.index());
        let Self {
            holders,
            blocks,
            fronts,
            clock,
            found,
            ..
        } = self;
        let log = &mut holders[h.0 as usize].as_mut().expect("checked above").logs[tier.index()];
        let before = log.len();
        let mut seen = CallSeen::default();
        let mut memo = Memo::default();
        let mut new = 0;
        // Hashes this call added to the index, as a 1,024-bit filter (no false negatives).
        let mut added = [0u64; 16];
        let added_bit = |b: BlockHash| {
            let i = (b.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 54) as usize;
            (i >> 6, 1u64 << (i & 63))
        };
        // The lookups first, batched (their cache misses overlap).
        found.clear();
        blocks.lookup_batch(hashes, |s| {
            found.push(s);
            true
        });
        // Deepest block first: the log's order is the eviction order.
        for (&b, &slot) in hashes.iter().zip(found.iter()).rev() {
            // A block new to the index may have been added deeper in this call (the same hash
            // twice in one chain): looked up again only where the filter says it may have.
            let slot = slot.or_else(|| {
                let (w, m) = added_bit(b);
                if added[w] & m != 0 {
                    blocks.lookup(b)
                } else {
                    None
                }
            });
            match slot {
                None => {
                    let (w, m) = added_bit(b);
                    added[w] |= m;
                    let slot = blocks.insert_new(b, ht);
                    log.push_new(slot, &mut seen);
                    new += 1;
                }
                Some(slot) if !blocks.contains(slot, ht) => {
                    blocks.insert(slot, ht, &mut memo);
                    log.push_new(slot, &mut seen);
                    new += 1;
                }
                // Held: moves to the back, unless stored deeper in this same call already.
                Some(slot) => log.refresh(slot, before, &seen),
            }
        }
        log.close_batch(before, *clock);
        Self::maybe_compact(log);
        Self::sync_front(fronts, log, ht);
        self.holder_blocks += new as u64;
        self.enforce_capacity();
        Ok(new)
    }

    fn enforce_capacity(&mut self) {
        let Some(cap) = self.capacity else { return };
        let Self {
            holders,
            blocks,
            fronts,
            holder_blocks,
            evicted,
            ..
        } = self;
        let mut memo = Memo::default();
        while *holder_blocks > cap {
            let Some(&(_, ht)) = fronts.first() else {
                break;
            };
            let log = &mut holders[(ht >> 2) as usize]
                .as_mut()
                .expect("a registered log belongs to a live holder")
                .logs[(ht & 3) as usize];
            if let Some((slot, true)) = log.pop_front() {
                blocks.remove(slot, ht, &mut memo);
                *holder_blocks -= 1;
                *evicted += 1;
            }
            Self::sync_front(fronts, log, ht);
        }
    }

    /// `h` no longer holds `hashes` in `tier`. Returns how many it held.
    pub fn remove(&mut self, h: HolderId, tier: Tier, hashes: &[BlockHash]) -> Result<usize> {
        self.holder(h)?;
        let ht = ht_of(h.0, tier.index());
        let Self {
            holders,
            blocks,
            fronts,
            found,
            ..
        } = self;
        let log = &mut holders[h.0 as usize].as_mut().expect("checked above").logs[tier.index()];
        let mut memo = Memo::default();
        let mut removed = 0;
        found.clear();
        blocks.lookup_batch(hashes, |s| {
            found.push(s);
            true
        });
        for &slot in found.iter() {
            // A block this call freed (a hash listed twice) stays free: a removal adds none.
            if let Some(slot) = slot
                && blocks.contains(slot, ht)
            {
                log.remove(slot);
                blocks.remove(slot, ht, &mut memo);
                removed += 1;
            }
        }
        Self::maybe_compact(log);
        Self::sync_front(fronts, log, ht);
        self.holder_blocks -= removed as u64;
        Ok(removed)
    }

    /// `h` holds nothing any more. Returns how many holder-blocks it held.
    pub fn clear(&mut self, h: HolderId) -> Result<usize> {
        self.holder(h)?;
        let Self {
            holders,
            blocks,
            fronts,
            ..
        } = self;
        let holder = holders[h.0 as usize].as_mut().expect("checked above");
        let mut removed = 0;
        for (t, log) in holder.logs.iter_mut().enumerate() {
            let ht = ht_of(h.0, t);
            let mut memo = Memo::default();
            for slot in log.live_slots() {
                blocks.remove(slot, ht, &mut memo);
            }
            removed += log.live;
            log.reset();
            Self::sync_front(fronts, log, ht);
        }
        self.holder_blocks -= removed;
        Ok(removed as usize)
    }

    /// The index's accounting.
    pub fn stats(&self) -> IndexStats {
        let mut bytes = self.blocks.bytes()
            + (self.holders.capacity() * size_of::<Option<Holder>>()) as u64
            // A B-tree of (u64, u32) keys: about 24 bytes a key with its nodes' slack.
            + self.fronts.len() as u64 * 24;
        for holder in self.holders.iter().flatten() {
            bytes += ((holder.stores.capacity() + holder.readers.capacity()) * 4) as u64;
            bytes += holder.logs.iter().map(AgeLog::bytes).sum::<u64>();
        }
        IndexStats {
            holders: self.holders.iter().flatten().count() as u64,
            blocks: self.blocks.len() as u64,
            holder_blocks: self.holder_blocks,
            evicted: self.evicted,
            bytes,
        }
    }
}
