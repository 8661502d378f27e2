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
//! Layout and cost (see [`blocks`] and [`ages`]): one hash table from block hash to a compact
//! set of `(holder, tier)` entries (inline when a block has one, sorted chunks in an arena
//! otherwise), 8 bytes per holder-block plus 16 bytes and a table bucket per block; one age
//! log per (holder, tier), 4 bytes per holder-block plus one batch record per `store` call,
//! which gives the eviction order, `clear` in the holder's own size, and exact refreshes
//! through tombstones. A query walks the chain once, narrowing the set of instances still
//! matching, and stops when it is empty.

mod ages;
mod blocks;

use self::ages::{AgeLog, TOMBSTONE};
use self::blocks::{BlockTable, Entry};
use crate::chain::BlockHash;
use crate::error::{IndexError, Result};
use std::collections::BTreeSet;

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
}

impl Default for Index {
    fn default() -> Self {
        Self::new(None)
    }
}

/// One instance still matching a query, with its runs so far.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    holder: u32,
    /// Own tier bits in the current block (bit 3: through a store).
    mask: u8,
    l1: u32,
    l2: u32,
    in1: bool,
    in2: bool,
}

impl Candidate {
    fn new(holder: u32, mask: u8) -> Self {
        Self {
            holder,
            mask,
            l1: 0,
            l2: 0,
            in1: true,
            in2: true,
        }
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

    /// Compacts `log` when its tombstones are due.
    fn maybe_compact(blocks: &mut BlockTable, log: &mut AgeLog, ht: u32) {
        if log.wants_compaction() {
            log.compact(|slot, stamp| blocks.set_stamp(slot, ht, stamp));
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
            ..
        } = self;
        let log = &mut holders[h.0 as usize].as_mut().expect("checked above").logs[tier.index()];
        let before = log.entries.len();
        let mut new = 0;
        // Deepest block first: the log's order is the eviction order.
        for &b in hashes.iter().rev() {
            let Some(slot) = blocks.lookup(b) else {
                let stamp = log.next_stamp();
                let slot = blocks.insert_new(b, Entry { ht, stamp });
                log.push(slot);
                new += 1;
                continue;
            };
            match blocks.find(slot, ht) {
                None => {
                    let stamp = log.push(slot);
                    blocks.insert(slot, Entry { ht, stamp });
                    new += 1;
                }
                // Already stored deeper in this same call: the deepest position's age stands.
                Some(old) if log.index_of(old) >= before => {}
                Some(old) => {
                    log.kill(old);
                    let stamp = log.push(slot);
                    blocks.set_stamp(slot, ht, stamp);
                }
            }
        }
        log.close_batch(before, *clock);
        Self::maybe_compact(blocks, log, ht);
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
        while *holder_blocks > cap {
            let Some(&(_, ht)) = fronts.first() else {
                break;
            };
            let log = &mut holders[(ht >> 2) as usize]
                .as_mut()
                .expect("a registered log belongs to a live holder")
                .logs[(ht & 3) as usize];
            if let Some(slot) = log.pop_front()
                && slot != TOMBSTONE
            {
                blocks.remove(slot, ht);
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
            ..
        } = self;
        let log = &mut holders[h.0 as usize].as_mut().expect("checked above").logs[tier.index()];
        let mut removed = 0;
        for &b in hashes {
            if let Some(slot) = blocks.lookup(b)
                && let Some(stamp) = blocks.find(slot, ht)
            {
                log.kill(stamp);
                blocks.remove(slot, ht);
                removed += 1;
            }
        }
        Self::maybe_compact(blocks, log, ht);
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
            for &slot in &log.entries {
                if slot != TOMBSTONE {
                    blocks.remove(slot, ht);
                }
            }
            removed += log.live;
            log.reset();
            Self::sync_front(fronts, log, ht);
        }
        self.holder_blocks -= removed;
        Ok(removed as usize)
    }

    /// The tier bits of `holder` among a block's entries (sorted by `ht`).
    #[inline]
    fn own_mask(entries: &[Entry], holder: u32) -> u8 {
        let lo = holder << 2;
        let start = if entries.len() <= 8 {
            entries
                .iter()
                .position(|e| e.ht >= lo)
                .unwrap_or(entries.len())
        } else {
            entries.partition_point(|e| e.ht < lo)
        };
        let mut mask = 0;
        for e in &entries[start..] {
            if e.ht >> 2 != holder {
                break;
            }
            mask |= 1 << (e.ht & 3);
        }
        mask
    }

    /// Whether a block's entries hold store `s`'s L3.
    #[inline]
    fn has_store(entries: &[Entry], s: u32) -> bool {
        let ht = ht_of(s, 2);
        if entries.len() <= 8 {
            entries.iter().any(|e| e.ht == ht)
        } else {
            entries.binary_search_by_key(&ht, |e| e.ht).is_ok()
        }
    }

    /// The instances holding a prefix of `hashes`, in holder order, written to `out` (cleared
    /// first).
    pub fn query(&self, hashes: &[BlockHash], out: &mut Vec<QueryMatch>) {
        out.clear();
        let Some(slot) = hashes.first().and_then(|b| self.blocks.lookup(*b)) else {
            return;
        };
        // The first block: every instance holding it, itself or through a store it reads.
        let mut cands: Vec<Candidate> = Vec::new();
        // Per holder id: (depth + 1) << 4 | tier bits of the block at `depth` (bit 3: through
        // a store), for blocks with many holders; allocated on first use.
        let mut marks: Vec<u32> = Vec::new();
        let entries = self.blocks.entries(slot);
        if entries.len() > 32 {
            self.mark(entries, 0, &mut marks);
            cands.extend(
                marks
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| **m != 0)
                    .map(|(h, &m)| Candidate::new(h as u32, (m & 15) as u8)),
            );
        } else {
            self.holders_of(entries, |h, bits| cands.push(Candidate::new(h, bits)));
            cands.sort_unstable_by_key(|c| c.holder);
            cands.dedup_by(|later, kept| {
                let same = later.holder == kept.holder;
                if same {
                    kept.mask |= later.mask;
                }
                same
            });
        }
        let mut depth = 0u32;
        let mut held_by = entries;
        loop {
            // Blocks `depth..depth + run` have the same holders as block `depth` (so every
            // candidate holds each of them with the same bits): extend the runs at once.
            let mut run = 1;
            let mut next = None;
            while let Some(slot) = hashes
                .get((depth + run) as usize)
                .and_then(|b| self.blocks.lookup(*b))
            {
                let entries = self.blocks.entries(slot);
                let same = entries.len() == held_by.len()
                    && entries.iter().zip(held_by).all(|(a, b)| a.ht == b.ht);
                if !same {
                    next = Some(slot);
                    break;
                }
                run += 1;
            }
            for c in &mut cands {
                c.in1 &= c.mask & 1 != 0;
                c.in2 &= c.mask & 3 != 0;
                c.l1 += if c.in1 { run } else { 0 };
                c.l2 += if c.in2 { run } else { 0 };
            }
            depth += run;
            let Some(slot) = next else { break };
            let entries = self.blocks.entries(slot);
            // Few candidates against a block held widely: look each candidate up; otherwise
            // mark the block's holders once and read the candidates' marks.
            let by_lookup = cands.len() * 8 < entries.len() || entries.len() <= 2;
            if !by_lookup {
                self.mark(entries, depth, &mut marks);
            }
            let mut kept = 0;
            for i in 0..cands.len() {
                let mut c = cands[i];
                c.mask = if by_lookup {
                    self.lookup_mask(entries, c.holder)
                } else {
                    let m = marks[c.holder as usize];
                    if m >> 4 == depth + 1 {
                        (m & 15) as u8
                    } else {
                        0
                    }
                };
                if c.mask == 0 {
                    out.push(QueryMatch {
                        holder: HolderId(c.holder),
                        l1: c.l1,
                        l2: c.l2,
                        l3: depth,
                    });
                } else {
                    cands[kept] = c;
                    kept += 1;
                }
            }
            cands.truncate(kept);
            if cands.is_empty() {
                break;
            }
            held_by = entries;
        }
        out.extend(cands.iter().map(|c| QueryMatch {
            holder: HolderId(c.holder),
            l1: c.l1,
            l2: c.l2,
            l3: depth,
        }));
        // Runs finished at each depth are each in holder order: a stable sort merges them.
        out.sort_by_key(|m| m.holder);
    }

    /// Calls `f(instance, bits)` for every instance holding a block with these entries: its
    /// own tier bits, or bit 3 for each store it reads that holds the block.
    #[inline]
    fn holders_of(&self, entries: &[Entry], mut f: impl FnMut(u32, u8)) {
        for e in entries {
            let h = e.ht >> 2;
            match self.kinds[h as usize] {
                KIND_INSTANCE => f(h, 1 << (e.ht & 3)),
                KIND_STORE => {
                    if let Some(Some(store)) = self.holders.get(h as usize) {
                        store.readers.iter().for_each(|&r| f(r, 8));
                    }
                }
                _ => {}
            }
        }
    }

    /// Marks the holders of the block at `depth` (see `query`).
    fn mark(&self, entries: &[Entry], depth: u32, marks: &mut Vec<u32>) {
        if marks.is_empty() {
            marks.resize(self.holders.len(), 0);
        }
        let tag = (depth + 1) << 4;
        self.holders_of(entries, |h, bits| {
            let m = &mut marks[h as usize];
            *m = if *m >> 4 == depth + 1 { *m } else { tag } | u32::from(bits);
        });
    }

    /// An instance's bits in a block's entries: its own tiers, else bit 3 when a store it
    /// reads holds the block.
    #[inline]
    fn lookup_mask(&self, entries: &[Entry], h: u32) -> u8 {
        let own = Self::own_mask(entries, h);
        if own != 0 {
            return own;
        }
        match self.holders.get(h as usize) {
            Some(Some(holder)) if holder.stores.iter().any(|&s| Self::has_store(entries, s)) => 8,
            _ => 0,
        }
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
