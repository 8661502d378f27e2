//! The block table: block hash → the set of (holder, tier) residencies of that block.
//!
//! Layout (sized for tens of millions of holder-blocks):
//! - `slots`: one 16-byte record per live block (its hash and its set), addressed by a `u32`
//!   slot id that stays put while the block lives (the age logs name blocks by it); free slots
//!   are chained through their set and reused first.
//! - `map`: a [`SlotMap`] of slot ids under the top bits of the block hash mixed with a
//!   per-index random seed (engine hashes may be small integers), 8 bytes a bucket: one read
//!   finds the slot, a second (the record) confirms the hash.
//! - a set is a sorted list of `ht` words (holder id << 2 | tier index, 4 bytes each): a block
//!   held once or twice keeps them inline in its record; a block held more often refers to a
//!   chunk of the [`Arena`] (one of the size classes 2, 3, 4, 6, 8, 12, … words): a reference
//!   count, then the set.
//! - chunks are *shared*: the blocks of a chain that one call moves from the same set to the
//!   same set (a holder storing or dropping a run of blocks held alike) end up referring to one
//!   chunk, through the call's [`Memo`] of its last transition; a shared chunk is copied on
//!   write. So a run of blocks with the same holders stores them once, and a query compares
//!   two blocks' holders by their references.
//!
//! A set carries no age: the age logs keep the order (see [`super::ages`]).
//!
//! Invariants: every slot in `map` has a non-empty set; an inline set is `[a, NONE]` or
//! `[a, b]` with `a < b`; an arena set holds ≥ 3 words sorted without duplicates, in a chunk
//! whose count is the number of blocks referring to it; a chunk with one reference holds at
//! least a quarter of its capacity (shrunk when it falls below); a memo's chunks are live and
//! hold what the memo says (it forgets a chunk written in place or freed).

use super::slot_map::{self, SlotMap};

/// The second word of an inline set of one.
const NONE: u32 = u32::MAX;
/// First word of a free slot (its second word chains the next free slot).
const FREE: u32 = u32::MAX;
/// Flag in the first word of an arena set: bits 25..31 are its chunk's size class, bits 0..25
/// the set's length; the second word is the chunk's offset (its count word; the set follows).
const ARENA: u32 = 1 << 31;
const CLASS_SHIFT: u32 = 25;
/// Size classes (the largest holds over 2^25 words, more than a set can).
const CLASSES: usize = 49;
const LEN_MASK: u32 = (1 << CLASS_SHIFT) - 1;
/// No slot / no chunk.
const NIL: u32 = slot_map::NIL;
/// Lookups a batched lookup issues together: the first stage small (a chain whose first block
/// nobody holds costs little), the next ones wider.
const FIRST_STAGE: usize = 8;
const STAGE: usize = 32;

fn arena_set(off: usize, class: usize, len: usize) -> [u32; 2] {
    [
        ARENA | (class as u32) << CLASS_SHIFT | len as u32,
        off as u32,
    ]
}

fn is_arena(set: [u32; 2]) -> bool {
    set[0] & ARENA != 0
}

/// A call's last set transition: blocks whose set is `from` get `to` when `ht` is added
/// (`insert`) or dropped, sharing its chunk.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Memo {
    on: bool,
    insert: bool,
    ht: u32,
    from: [u32; 2],
    to: [u32; 2],
}

impl Memo {
    #[inline]
    fn get(&self, from: [u32; 2], ht: u32, insert: bool) -> Option<[u32; 2]> {
        (self.on && self.from == from && self.ht == ht && self.insert == insert).then_some(self.to)
    }

    fn remember(&mut self, from: [u32; 2], ht: u32, insert: bool, to: [u32; 2]) {
        *self = Self {
            on: true,
            insert,
            ht,
            from,
            to,
        };
    }

    /// The chunk at `off` changes or goes: a memo naming it no longer holds.
    #[inline]
    fn forget(&mut self, off: usize) {
        let names = |set: [u32; 2]| is_arena(set) && set[1] as usize == off;
        if self.on && (names(self.from) || names(self.to)) {
            self.on = false;
        }
    }
}

/// (offset, class, length) of an arena set.
fn arena_parts(set: [u32; 2]) -> (usize, usize, usize) {
    (
        set[1] as usize,
        ((set[0] & !ARENA) >> CLASS_SHIFT) as usize,
        (set[0] & LEN_MASK) as usize,
    )
}

#[derive(Clone, Copy, Debug)]
struct Block {
    hash: u64,
    set: [u32; 2],
}

/// Chunks of `ht` words in size classes, one free list per class.
#[derive(Debug)]
struct Arena {
    words: Vec<u32>,
    /// Head of the free list of class `c` (chunks of `cap_of(c)` words); a free chunk's first
    /// word chains the next.
    free: [u32; CLASSES],
    /// Words in chunks handed out (for accounting).
    in_use: u64,
}

/// Chunk capacities grow by about 1.5: 2, 3, 4, 6, 8, 12, 16, 24, …
fn cap_of(class: usize) -> usize {
    if class.is_multiple_of(2) {
        2 << (class / 2)
    } else {
        3 << (class / 2)
    }
}

/// The smallest class whose chunks hold `len` words.
fn class_of(len: usize) -> usize {
    let len = len.max(2);
    let p = (usize::BITS - 1 - len.leading_zeros()) as usize; // 2^p <= len < 2^(p+1)
    if len == 1 << p {
        2 * (p - 1)
    } else if len <= 3 << (p - 1) {
        2 * (p - 1) + 1
    } else {
        2 * p
    }
}

/// Grows `v` to hold `extra` more items by an eighth of its size at least (not doubling),
/// keeping the slack of a large table small; amortised O(1) all the same.
pub(crate) fn reserve_gently<T>(v: &mut Vec<T>, extra: usize) {
    if v.len() + extra > v.capacity() {
        v.reserve_exact(extra.max(v.capacity() / 8).max(16));
    }
}

impl Arena {
    fn new() -> Self {
        Self {
            words: Vec::new(),
            free: [NIL; CLASSES],
            in_use: 0,
        }
    }

    fn alloc(&mut self, class: usize) -> usize {
        let cap = cap_of(class);
        self.in_use += cap as u64;
        let head = self.free[class];
        if head != NIL {
            self.free[class] = self.words[head as usize];
            return head as usize;
        }
        let off = self.words.len();
        assert!(off + cap < u32::MAX as usize, "arena beyond 2^32 words");
        reserve_gently(&mut self.words, cap);
        self.words.resize(off + cap, 0);
        off
    }

    fn release(&mut self, off: usize, class: usize) {
        self.in_use -= cap_of(class) as u64;
        self.words[off] = self.free[class];
        self.free[class] = off as u32;
    }
}

/// Ids of block tables (see [`BigSetKey`]).
static NEXT_TABLE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Block hash → holder set.
#[derive(Debug)]
pub(crate) struct BlockTable {
    slots: Vec<Block>,
    map: SlotMap,
    free_slot: u32,
    arena: Arena,
    seed: u64,
    /// This table's id, unique in the process (a cache of a set's holders names its table).
    id: u64,
    /// Per arena offset of a chunk that held a [`BIG_SET`] set: the stamp of its last change
    /// in place or release (see [`BlockTable::big_set_key`]).
    versions: hashbrown::HashMap<u32, u64>,
    /// The last stamp given.
    stamp: u64,
}

/// Sets at least this long are *big*: a change of one in place is stamped, so that a cache
/// of what a big set holds (a query's first block, held by most of the fleet) can tell it is
/// still exact. Big sets are few (the heads of the chains most instances hold), and a change
/// to one moves at least this many words anyway.
pub(crate) const BIG_SET: usize = 256;

/// Names a big set's content exactly: the table, the set's reference, and its chunk's stamp.
/// Two equal keys name sets with the same holders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BigSetKey {
    table: u64,
    set: [u32; 2],
    version: u64,
}

/// Mixes a block hash for the table (engine hashes may be sequential small integers).
#[inline]
fn mix(seed: u64, h: u64) -> u64 {
    let m = u128::from(h ^ seed) * 0x9E37_79B9_7F4A_7C15_u128;
    (m as u64) ^ ((m >> 64) as u64)
}

/// Position of `ht` in a sorted set.
#[inline]
fn position(set: &[u32], ht: u32) -> Result<usize, usize> {
    if set.len() <= 16 {
        for (i, &e) in set.iter().enumerate() {
            if e >= ht {
                return if e == ht { Ok(i) } else { Err(i) };
            }
        }
        Err(set.len())
    } else {
        set.binary_search(&ht)
    }
}

impl BlockTable {
    pub(crate) fn new() -> Self {
        use std::hash::{BuildHasher, RandomState};
        Self {
            slots: Vec::new(),
            map: SlotMap::default(),
            free_slot: NIL,
            arena: Arena::new(),
            seed: RandomState::new().hash_one(0x6869_6361_6368_6549_u64) | 1,
            id: NEXT_TABLE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            versions: hashbrown::HashMap::new(),
            stamp: 0,
        }
    }

    /// Live blocks.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Bytes allocated by the table's structures.
    pub(crate) fn bytes(&self) -> u64 {
        (self.slots.capacity() * size_of::<Block>()
            + self.map.allocation_size()
            + self.versions.allocation_size()
            + self.arena.words.capacity() * size_of::<u32>()) as u64
    }

    /// The slot of `hash`, if held by anyone.
    #[inline]
    pub(crate) fn lookup(&self, hash: u64) -> Option<u32> {
        let slots = &self.slots;
        self.map.find(slot_map::tag(mix(self.seed, hash)), |s| {
            slots[s as usize].hash == hash
        })
    }

    /// Looks `hashes` up in order, calling `f` with each one's slot (`None`: nobody holds it)
    /// until it returns false; the same answers as [`Self::lookup`] one by one.
    ///
    /// In stages of up to [`STAGE`] hashes: first every hash's home bucket (independent reads,
    /// whose cache misses the processor overlaps; the next cache line too where the home is
    /// near its line's end, as a probe may go on there), then each one's candidate slot from the
    /// buckets now cached, then the candidates' records (independent again). One by one, each
    /// lookup's two misses would wait for each other and for the previous lookup's.
    pub(crate) fn lookup_batch(&self, hashes: &[u64], mut f: impl FnMut(Option<u32>) -> bool) {
        if hashes.len() <= 2 {
            // Nothing to overlap worth the stages' bookkeeping.
            for &h in hashes {
                if !f(self.lookup(h)) {
                    return;
                }
            }
            return;
        }
        let mut rest = hashes;
        let mut width = FIRST_STAGE;
        while !rest.is_empty() {
            let (stage, next) = rest.split_at(width.min(rest.len()));
            rest = next;
            width = STAGE;
            let n = stage.len();
            let mut homes = [(0usize, 0u64, 0u32); STAGE];
            for (home, &h) in homes[..n].iter_mut().zip(stage) {
                let tag = slot_map::tag(mix(self.seed, h));
                let (at, bucket) = self.map.home_bucket(tag);
                self.map.touch_next_line(at);
                *home = (at, bucket, tag);
            }
            let mut candidates = [NIL; STAGE];
            for (c, &(at, bucket, tag)) in candidates[..n].iter_mut().zip(&homes[..n]) {
                *c = self.map.find_from(tag, at, bucket, |_| true).unwrap_or(NIL);
            }
            for (&c, &h) in candidates[..n].iter().zip(stage) {
                let slot = match c {
                    NIL => None,
                    c if self.slots[c as usize].hash == h => Some(c),
                    // Another block's tag (one probe in 2^32): the full lookup goes on.
                    _ => self.lookup(h),
                };
                if !f(slot) {
                    return;
                }
            }
        }
    }

    /// Adds block `hash` (not held by anyone) with its first holder `ht`; returns its slot.
    pub(crate) fn insert_new(&mut self, hash: u64, ht: u32) -> u32 {
        let block = Block {
            hash,
            set: [ht, NONE],
        };
        let slot = if self.free_slot != NIL {
            let s = self.free_slot;
            self.free_slot = self.slots[s as usize].set[1];
            self.slots[s as usize] = block;
            s
        } else {
            assert!(self.slots.len() < NIL as usize, "more than 2^32 blocks");
            reserve_gently(&mut self.slots, 1);
            self.slots.push(block);
            self.slots.len() as u32 - 1
        };
        self.map.insert(slot_map::tag(mix(self.seed, hash)), slot);
        slot
    }

    /// The chunk at `off` changes in place or is released while (or after) holding `len`
    /// words: a big set's chunk gets a new stamp.
    #[inline]
    fn stamp(&mut self, off: usize, len: usize) {
        if len >= BIG_SET {
            self.stamp += 1;
            self.versions.insert(off as u32, self.stamp);
        }
    }

    /// A key naming what the block in `slot` holds, for a big set (`None` otherwise): equal
    /// keys mean equal sets, for as long as this table lives. A chunk's content changes only
    /// in place (stamped) or after its release (stamped, and a new block refers to it after);
    /// a copy on write leaves it as it was.
    #[inline]
    pub(crate) fn big_set_key(&self, slot: u32) -> Option<BigSetKey> {
        let set = self.slots[slot as usize].set;
        if !is_arena(set) || ((set[0] & LEN_MASK) as usize) < BIG_SET {
            return None;
        }
        Some(BigSetKey {
            table: self.id,
            set,
            version: self.versions.get(&set[1]).copied().unwrap_or(0),
        })
    }

    /// The holders (`ht` words) of the block in `slot`, sorted.
    #[inline]
    pub(crate) fn entries(&self, slot: u32) -> &[u32] {
        let set = &self.slots[slot as usize].set;
        if set[0] & ARENA == 0 {
            &set[..1 + usize::from(set[1] != NONE)]
        } else {
            let (off, _, len) = arena_parts(*set);
            &self.arena.words[off + 1..off + 1 + len]
        }
    }

    /// Whether the blocks in slots `a` and `b` refer to the same set: an inline set equal to
    /// the other, or one shared chunk (so they have the same holders; blocks with the same
    /// holders in two chunks are not the same set).
    #[inline]
    pub(crate) fn same_set(&self, a: u32, b: u32) -> bool {
        self.slots[a as usize].set == self.slots[b as usize].set
    }

    /// One more block refers to `set`.
    #[inline]
    fn retain(&mut self, set: [u32; 2]) {
        if is_arena(set) {
            self.arena.words[set[1] as usize] += 1;
        }
    }

    /// One block fewer refers to `set`: its chunk is freed with the last.
    #[inline]
    fn release(&mut self, set: [u32; 2], memo: &mut Memo) {
        if is_arena(set) {
            let (off, class, len) = arena_parts(set);
            self.arena.words[off] -= 1;
            if self.arena.words[off] == 0 {
                self.stamp(off, len);
                self.arena.release(off, class);
                memo.forget(off);
            }
        }
    }

    /// A new chunk with count 1 holding `set`; returns its set reference.
    fn new_chunk(&mut self, set: impl ExactSizeIterator<Item = u32>) -> [u32; 2] {
        let len = set.len();
        let class = class_of(len + 1);
        let off = self.arena.alloc(class);
        self.arena.words[off] = 1;
        for (w, e) in self.arena.words[off + 1..off + 1 + len].iter_mut().zip(set) {
            *w = e;
        }
        arena_set(off, class, len)
    }

    /// Whether `ht` holds the block in `slot` (false for a free slot).
    #[inline]
    pub(crate) fn contains(&self, slot: u32, ht: u32) -> bool {
        self.slots[slot as usize].set[0] != FREE && position(self.entries(slot), ht).is_ok()
    }

    /// Adds `ht` to the set of `slot` (which lacks it).
    pub(crate) fn insert(&mut self, slot: u32, ht: u32, memo: &mut Memo) {
        let set = self.slots[slot as usize].set;
        if let Some(to) = memo.get(set, ht, true) {
            self.retain(to);
            self.release(set, memo);
            self.slots[slot as usize].set = to;
            return;
        }
        if !is_arena(set) {
            if set[1] == NONE {
                self.slots[slot as usize].set = if set[0] < ht {
                    [set[0], ht]
                } else {
                    [ht, set[0]]
                };
                return;
            }
            let mut three = [set[0], set[1], ht];
            three.sort_unstable();
            let to = self.new_chunk(three.into_iter());
            memo.remember(set, ht, true, to);
            self.slots[slot as usize].set = to;
            return;
        }
        let (mut off, mut class, len) = arena_parts(set);
        assert!(len < LEN_MASK as usize, "a block held more than 2^25 times");
        let words = &self.arena.words[off + 1..off + 1 + len];
        let at = position(words, ht).unwrap_or_else(|i| i);
        if self.arena.words[off] > 1 {
            // Shared: copy on write (the shared chunk keeps its other references).
            self.arena.words[off] -= 1;
            let class = class_of(len + 2);
            let new = self.arena.alloc(class);
            let w = &mut self.arena.words;
            w[new] = 1;
            w.copy_within(off + 1..off + 1 + at, new + 1);
            w[new + 1 + at] = ht;
            w.copy_within(off + 1 + at..off + 1 + len, new + 2 + at);
            let to = arena_set(new, class, len + 1);
            memo.remember(set, ht, true, to);
            self.slots[slot as usize].set = to;
            return;
        }
        memo.forget(off);
        self.stamp(off, len + 1);
        if len + 1 == cap_of(class) {
            let new = self.arena.alloc(class + 1);
            self.arena.words.copy_within(off..off + 1 + len, new);
            self.arena.release(off, class);
            (off, class) = (new, class + 1);
        }
        let words = &mut self.arena.words[off + 1..off + 2 + len];
        words.copy_within(at..len, at + 1);
        words[at] = ht;
        self.slots[slot as usize].set = arena_set(off, class, len + 1);
    }

    /// Removes `ht` from the set of `slot`; frees the block when its set empties. Returns
    /// whether the block was freed (false too when `ht` did not hold it, or the slot is free).
    pub(crate) fn remove(&mut self, slot: u32, ht: u32, memo: &mut Memo) -> bool {
        let set = self.slots[slot as usize].set;
        if set[0] == FREE {
            return false;
        }
        if !is_arena(set) {
            if set[1] == NONE {
                if set[0] != ht {
                    return false;
                }
                self.free_block(slot);
                return true;
            }
            let kept = if set[0] == ht {
                set[1]
            } else if set[1] == ht {
                set[0]
            } else {
                return false;
            };
            self.slots[slot as usize].set = [kept, NONE];
            return false;
        }
        if let Some(to) = memo.get(set, ht, false) {
            self.retain(to);
            self.release(set, memo);
            self.slots[slot as usize].set = to;
            return false;
        }
        let (off, class, len) = arena_parts(set);
        let words = &self.arena.words[off + 1..off + 1 + len];
        let Ok(at) = position(words, ht) else {
            return false;
        };
        let to = if len == 3 {
            let mut pair = [0; 2];
            for (p, e) in pair.iter_mut().zip(words.iter().filter(|&&e| e != ht)) {
                *p = *e;
            }
            pair
        } else if self.arena.words[off] > 1 {
            let class = class_of(len);
            let new = self.arena.alloc(class);
            let w = &mut self.arena.words;
            w[new] = 1;
            w.copy_within(off + 1..off + 1 + at, new + 1);
            w.copy_within(off + 2 + at..off + 1 + len, new + 1 + at);
            arena_set(new, class, len - 1)
        } else {
            // Ours alone: in place (or into a smaller chunk).
            memo.forget(off);
            self.stamp(off, len);
            let words = &mut self.arena.words[off + 1..off + 1 + len];
            words.copy_within(at + 1..len, at);
            let len = len - 1;
            if len < cap_of(class) / 4 {
                let smaller = class_of(len + 1);
                let new = self.arena.alloc(smaller);
                self.arena.words.copy_within(off..off + 1 + len, new);
                self.arena.release(off, class);
                self.slots[slot as usize].set = arena_set(new, smaller, len);
            } else {
                self.slots[slot as usize].set = arena_set(off, class, len);
            }
            return false;
        };
        // The chunk survives its release when shared: then the next block moving alike
        // shares `to`.
        let shared = self.arena.words[off] > 1;
        self.release(set, memo);
        if shared {
            memo.remember(set, ht, false, to);
        }
        self.slots[slot as usize].set = to;
        false
    }

    fn free_block(&mut self, slot: u32) {
        let hash = self.slots[slot as usize].hash;
        self.map.remove(slot_map::tag(mix(self.seed, hash)), slot);
        self.slots[slot as usize].set = [FREE, self.free_slot];
        self.free_slot = slot;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_are_the_smallest_that_fit() {
        for len in 1..5000 {
            let c = class_of(len);
            assert!(cap_of(c) >= len.max(2), "{len}");
            assert!(c == 0 || cap_of(c - 1) < len, "{len}");
        }
        assert!(cap_of(CLASSES - 1) > LEN_MASK as usize);
    }

    #[test]
    fn sets_grow_shrink_and_stay_sorted() {
        let mut t = BlockTable::new();
        let mut memo = Memo::default();
        let s = t.insert_new(7, 40);
        for ht in (0..40).rev() {
            t.insert(s, ht, &mut memo);
        }
        assert_eq!(t.entries(s), (0..=40).collect::<Vec<_>>());
        assert!(t.contains(s, 5));
        assert!(!t.contains(s, 41));
        for ht in 0..40 {
            assert!(!t.remove(s, ht, &mut memo));
            assert_eq!(t.entries(s).len(), 40 - ht as usize);
            assert!(!t.contains(s, ht));
        }
        assert_eq!(t.entries(s), &[40]);
        assert!(
            !t.remove(s, 3, &mut memo),
            "an absent holder leaves the set alone"
        );
        assert_eq!(t.lookup(7), Some(s));
        assert!(t.remove(s, 40, &mut memo));
        assert_eq!(t.lookup(7), None);
        assert_eq!(t.len(), 0);
        assert_eq!(t.arena.in_use, 0);
        // The freed slot is reused.
        assert_eq!(t.insert_new(8, 1), s);
    }

    #[test]
    fn batched_lookups_answer_as_single_ones() {
        let mut t = BlockTable::new();
        let mut memo = Memo::default();
        // Held: multiples of 3 below 300, every seventh freed again; asked: multiples of 3
        // from 3 (some off by one) to 447, in stages.
        let slots: Vec<u32> = (0..100).map(|b| t.insert_new(b * 3, 1)).collect();
        for &s in slots.iter().step_by(7) {
            t.remove(s, 1, &mut memo);
        }
        let asked: Vec<u64> = (1..150).map(|x| x * 3 + u64::from(x % 11 == 0)).collect();
        let mut all = Vec::new();
        t.lookup_batch(&asked, |s| {
            all.push(s);
            true
        });
        let single: Vec<Option<u32>> = asked.iter().map(|&h| t.lookup(h)).collect();
        assert_eq!(all, single);
        assert!(all.iter().filter(|s| s.is_some()).count() > 50);
        // Stopping early: only the prefix is visited.
        let mut seen = 0;
        t.lookup_batch(&asked, |s| {
            seen += 1;
            s.is_some()
        });
        let prefix = single.iter().position(Option::is_none).unwrap();
        assert_eq!(prefix, 6, "3 to 18 held, 21 freed");
        assert_eq!(seen, prefix + 1);
    }

    #[test]
    fn two_holders_stay_inline_in_either_order() {
        let mut t = BlockTable::new();
        let mut memo = Memo::default();
        let s = t.insert_new(1, 9);
        t.insert(s, 4, &mut memo);
        assert_eq!(t.entries(s), &[4, 9]);
        assert_eq!(t.arena.in_use, 0);
        t.insert(s, 6, &mut memo);
        assert_eq!(t.entries(s), &[4, 6, 9]);
        assert!(!t.remove(s, 9, &mut memo));
        assert_eq!(t.entries(s), &[4, 6]);
        assert_eq!(t.arena.in_use, 0);
        assert!(!t.remove(s, 4, &mut memo));
        assert_eq!(t.entries(s), &[6]);
    }

    #[test]
    fn a_run_moved_alike_shares_one_chunk_copied_on_write() {
        let mut t = BlockTable::new();
        let slots: Vec<u32> = (0..10).map(|b| t.insert_new(b, 1)).collect();
        for ht in [2, 3, 4] {
            let mut memo = Memo::default();
            for &s in &slots {
                t.insert(s, ht, &mut memo);
            }
        }
        // Ten blocks, one chunk of {1, 2, 3, 4}.
        assert_eq!(t.arena.in_use, cap_of(class_of(5)) as u64);
        assert!(t.same_set(slots[0], slots[9]));
        // One block diverges: copied, the others keep the shared chunk.
        let mut memo = Memo::default();
        t.insert(slots[3], 9, &mut memo);
        assert_eq!(t.entries(slots[3]), &[1, 2, 3, 4, 9]);
        assert_eq!(t.entries(slots[4]), &[1, 2, 3, 4]);
        assert!(!t.same_set(slots[3], slots[4]));
        // Dropping holders from the shared run, block by block.
        let mut memo = Memo::default();
        for &s in &slots {
            t.remove(s, 2, &mut memo);
        }
        assert_eq!(t.entries(slots[3]), &[1, 3, 4, 9]);
        assert_eq!(t.entries(slots[0]), &[1, 3, 4]);
        assert_eq!(t.entries(slots[9]), &[1, 3, 4]);
        for ht in [1, 3, 4, 9] {
            let mut memo = Memo::default();
            for &s in &slots {
                t.remove(s, ht, &mut memo);
            }
        }
        assert_eq!(t.len(), 0);
        assert_eq!(t.arena.in_use, 0);
    }
}
