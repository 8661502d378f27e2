//! The block table: block hash → the set of (holder, tier) residencies of that block.
//!
//! Layout (sized for tens of millions of holder-blocks):
//! - `slots`: one 16-byte record per live block (its hash and its set), addressed by a `u32`
//!   slot id that stays put while the block lives (the age logs name blocks by it); free slots
//!   are chained through their set field and reused first.
//! - `map`: a hashbrown table of slot ids (4 bytes and a control byte per bucket), hashed by
//!   the block hash mixed with a per-index random seed (engine hashes may be small integers).
//! - a block held once keeps its one [`Entry`] inline in its record; a block held more often
//!   keeps its entries in the [`Arena`], sorted by `ht`, in a chunk of a power-of-two capacity.
//!
//! Invariants: every slot in `map` has a non-empty set; an arena set holds ≥ 2 entries, at
//! least a quarter of its chunk (shrunk when it falls below), sorted by `ht` without duplicates.

use hashbrown::HashTable;

/// One residency: `ht` = holder id << 2 | tier index, `stamp` = the position of its entry in
/// the (holder, tier)'s age log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) ht: u32,
    pub(crate) stamp: u32,
}

/// `ht` of a free slot (its `stamp` chains the next free slot).
const FREE: u32 = u32::MAX;
/// Flag in `ht` of an arena set: bits 25..31 of `ht` are its chunk's size class, bits 0..25
/// its length; `stamp` is the chunk's offset.
const ARENA: u32 = 1 << 31;
const CLASS_SHIFT: u32 = 25;
/// Size classes (the largest holds over 2^25 entries, more than a set can).
const CLASSES: usize = 49;
const LEN_MASK: u32 = (1 << CLASS_SHIFT) - 1;

fn arena_set(off: usize, class: usize, len: usize) -> Entry {
    Entry {
        ht: ARENA | (class as u32) << CLASS_SHIFT | len as u32,
        stamp: off as u32,
    }
}

/// (offset, class, length) of an arena set.
fn arena_parts(set: Entry) -> (usize, usize, usize) {
    (
        set.stamp as usize,
        ((set.ht & !ARENA) >> CLASS_SHIFT) as usize,
        (set.ht & LEN_MASK) as usize,
    )
}
/// No slot / no chunk.
const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Block {
    hash: u64,
    set: Entry,
}

/// Chunks of entries in size classes, one free list per class.
#[derive(Debug)]
struct Arena {
    words: Vec<Entry>,
    /// Head of the free list of class `c` (chunks of `cap_of(c)` entries); a free chunk's
    /// first entry's `stamp` chains the next.
    free: [u32; CLASSES],
    /// Entries in chunks handed out (for accounting).
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

/// The smallest class whose chunks hold `len` entries.
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

/// Grows `v` to hold `extra` more items by a quarter of its size at least (not doubling),
/// keeping the slack of a large table small; amortised O(1) all the same.
pub(crate) fn reserve_gently<T>(v: &mut Vec<T>, extra: usize) {
    if v.len() + extra > v.capacity() {
        v.reserve_exact(extra.max(v.capacity() / 4).max(16));
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

    fn alloc(&mut self, class: usize) -> u32 {
        let cap = cap_of(class);
        self.in_use += cap as u64;
        let head = self.free[class];
        if head != NIL {
            self.free[class] = self.words[head as usize].stamp;
            return head;
        }
        let off = self.words.len();
        assert!(off + cap < u32::MAX as usize, "arena beyond 2^32 entries");
        reserve_gently(&mut self.words, cap);
        self.words.resize(off + cap, Entry { ht: 0, stamp: 0 });
        off as u32
    }

    fn release(&mut self, off: u32, class: usize) {
        self.in_use -= cap_of(class) as u64;
        self.words[off as usize].stamp = self.free[class];
        self.free[class] = off;
    }
}

/// Block hash → holder set.
#[derive(Debug)]
pub(crate) struct BlockTable {
    slots: Vec<Block>,
    map: HashTable<u32>,
    free_slot: u32,
    arena: Arena,
    seed: u64,
}

/// Mixes a block hash for the table (engine hashes may be sequential small integers).
#[inline]
fn mix(seed: u64, h: u64) -> u64 {
    let m = u128::from(h ^ seed) * 0x9E37_79B9_7F4A_7C15_u128;
    (m as u64) ^ ((m >> 64) as u64)
}

impl BlockTable {
    pub(crate) fn new() -> Self {
        use std::hash::{BuildHasher, RandomState};
        Self {
            slots: Vec::new(),
            map: HashTable::new(),
            free_slot: NIL,
            arena: Arena::new(),
            seed: RandomState::new().hash_one(0x6869_6361_6368_6549_u64) | 1,
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
            + self.arena.words.capacity() * size_of::<Entry>()) as u64
    }

    /// The slot of `hash`, if held by anyone.
    #[inline]
    pub(crate) fn lookup(&self, hash: u64) -> Option<u32> {
        let slots = &self.slots;
        self.map
            .find(mix(self.seed, hash), |&s| slots[s as usize].hash == hash)
            .copied()
    }

    /// Adds block `hash` (not held by anyone) with its first entry; returns its slot.
    pub(crate) fn insert_new(&mut self, hash: u64, first: Entry) -> u32 {
        let block = Block { hash, set: first };
        let slot = if self.free_slot != NIL {
            let s = self.free_slot;
            self.free_slot = self.slots[s as usize].set.stamp;
            self.slots[s as usize] = block;
            s
        } else {
            assert!(self.slots.len() < NIL as usize, "more than 2^32 blocks");
            reserve_gently(&mut self.slots, 1);
            self.slots.push(block);
            self.slots.len() as u32 - 1
        };
        let (seed, slots) = (self.seed, &self.slots);
        self.map.insert_unique(mix(seed, hash), slot, |&s| {
            mix(seed, slots[s as usize].hash)
        });
        slot
    }

    /// The entries of the block in `slot`, sorted by `ht`.
    #[inline]
    pub(crate) fn entries(&self, slot: u32) -> &[Entry] {
        let set = &self.slots[slot as usize].set;
        if set.ht & ARENA == 0 {
            std::slice::from_ref(set)
        } else {
            let (off, _, len) = arena_parts(*set);
            &self.arena.words[off..off + len]
        }
    }

    fn entries_mut(&mut self, slot: u32) -> &mut [Entry] {
        let set = &mut self.slots[slot as usize].set;
        if set.ht & ARENA == 0 {
            std::slice::from_mut(set)
        } else {
            let (off, _, len) = arena_parts(*set);
            &mut self.arena.words[off..off + len]
        }
    }

    /// Position of `ht` in a sorted entry slice.
    #[inline]
    fn position(entries: &[Entry], ht: u32) -> Result<usize, usize> {
        if entries.len() <= 8 {
            for (i, e) in entries.iter().enumerate() {
                if e.ht >= ht {
                    return if e.ht == ht { Ok(i) } else { Err(i) };
                }
            }
            Err(entries.len())
        } else {
            entries.binary_search_by_key(&ht, |e| e.ht)
        }
    }

    /// The stamp of `ht`'s entry in `slot`, if any.
    #[inline]
    pub(crate) fn find(&self, slot: u32, ht: u32) -> Option<u32> {
        let entries = self.entries(slot);
        Self::position(entries, ht).ok().map(|i| entries[i].stamp)
    }

    /// Overwrites the stamp of `ht`'s entry in `slot` (which exists).
    pub(crate) fn set_stamp(&mut self, slot: u32, ht: u32, stamp: u32) {
        let entries = self.entries_mut(slot);
        if let Ok(i) = Self::position(entries, ht) {
            entries[i].stamp = stamp;
        }
    }

    /// Adds `e` to the set of `slot` (which has no entry for `e.ht`).
    pub(crate) fn insert(&mut self, slot: u32, e: Entry) {
        let set = self.slots[slot as usize].set;
        if set.ht & ARENA == 0 {
            let off = self.arena.alloc(0);
            let (a, b) = if set.ht < e.ht { (set, e) } else { (e, set) };
            self.arena.words[off as usize] = a;
            self.arena.words[off as usize + 1] = b;
            self.slots[slot as usize].set = arena_set(off as usize, 0, 2);
            return;
        }
        let (mut off, mut class, len) = arena_parts(set);
        assert!(len < LEN_MASK as usize, "a block held more than 2^25 times");
        if len == cap_of(class) {
            let new = self.arena.alloc(class + 1) as usize;
            self.arena.words.copy_within(off..off + len, new);
            self.arena.release(off as u32, class);
            (off, class) = (new, class + 1);
        }
        let words = &mut self.arena.words[off..off + len + 1];
        let at = Self::position(&words[..len], e.ht).unwrap_or_else(|i| i);
        words.copy_within(at..len, at + 1);
        words[at] = e;
        self.slots[slot as usize].set = arena_set(off, class, len + 1);
    }

    /// Removes `ht`'s entry from `slot` (which has it); frees the block when its set empties.
    /// Returns whether the block was freed.
    pub(crate) fn remove(&mut self, slot: u32, ht: u32) -> bool {
        let set = self.slots[slot as usize].set;
        if set.ht & ARENA == 0 {
            debug_assert_eq!(set.ht, ht);
            self.free_block(slot);
            return true;
        }
        let (off, class, len) = arena_parts(set);
        let words = &mut self.arena.words[off..off + len];
        let Ok(at) = Self::position(words, ht) else {
            return false;
        };
        words.copy_within(at + 1..len, at);
        let len = len - 1;
        if len == 1 {
            let only = self.arena.words[off];
            self.arena.release(off as u32, class);
            self.slots[slot as usize].set = only;
        } else if class > 0 && len <= cap_of(class) / 4 {
            let smaller = class_of(len);
            let new = self.arena.alloc(smaller) as usize;
            self.arena.words.copy_within(off..off + len, new);
            self.arena.release(off as u32, class);
            self.slots[slot as usize].set = arena_set(new, smaller, len);
        } else {
            self.slots[slot as usize].set = arena_set(off, class, len);
        }
        false
    }

    fn free_block(&mut self, slot: u32) {
        let hash = self.slots[slot as usize].hash;
        if let Ok(entry) = self.map.find_entry(mix(self.seed, hash), |&s| s == slot) {
            entry.remove();
        }
        self.slots[slot as usize].set = Entry {
            ht: FREE,
            stamp: self.free_slot,
        };
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
        let s = t.insert_new(7, Entry { ht: 40, stamp: 0 });
        for ht in (0..40).rev() {
            t.insert(
                s,
                Entry {
                    ht,
                    stamp: ht + 100,
                },
            );
        }
        let hts: Vec<u32> = t.entries(s).iter().map(|e| e.ht).collect();
        assert_eq!(hts, (0..=40).collect::<Vec<_>>());
        assert_eq!(t.find(s, 5), Some(105));
        t.set_stamp(s, 5, 9);
        assert_eq!(t.find(s, 5), Some(9));
        for ht in 0..40 {
            assert!(!t.remove(s, ht));
            assert_eq!(t.entries(s).len(), 40 - ht as usize);
        }
        assert_eq!(t.entries(s), &[Entry { ht: 40, stamp: 0 }]);
        assert_eq!(t.lookup(7), Some(s));
        assert!(t.remove(s, 40));
        assert_eq!(t.lookup(7), None);
        assert_eq!(t.len(), 0);
        assert_eq!(t.arena.in_use, 0);
        // The freed slot is reused.
        assert_eq!(t.insert_new(8, Entry { ht: 1, stamp: 1 }), s);
    }
}
