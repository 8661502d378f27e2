//! The block table's hash map: a block's mixed hash → its slot id, in one open-addressing
//! array of 8-byte buckets.
//!
//! A bucket holds the top 32 bits of the block's mixed hash (its *tag*) above the slot id; an
//! empty bucket holds [`EMPTY`] (slot [`NIL`], which no block has). The tag is the whole key
//! the map keeps: a bucket's home position is `tag × capacity / 2^32` (so the table grows by
//! any factor and rehashes without reading a block record), and a lookup reads a block record
//! only for a bucket whose tag matches (a false match costs one record read in 2^32 probes).
//! Collisions are resolved by linear probing, removals by backward shifting (no tombstones).
//!
//! Why not `hashbrown`: its lookup reads the control group, then the bucket, then the block
//! record, three dependent cache misses for a table far beyond the caches; here the bucket
//! and its tag come in one read, and a caller that knows many hashes up front (a query's
//! chain) reads all their buckets before any record ([`SlotMap::home_bucket`]).
//!
//! Invariants: `len` buckets are not empty; a non-empty bucket is reachable from its home by
//! a run of non-empty buckets (cyclically); the load stays at most [`MAX_LOAD_NUM`] /
//! [`MAX_LOAD_DEN`], and a growth multiplies the capacity by 3/2, so the load after one is
//! 0.44 (a table of millions of blocks keeps 12–18 bytes a block, hashbrown's doubling
//! 5.7–11.4 bytes at 5 bytes a bucket; a growth moves each bucket once, reading no record).

/// No slot.
pub(crate) const NIL: u32 = u32::MAX;
/// An empty bucket (slot [`NIL`]).
const EMPTY: u64 = u64::MAX;
/// Maximum load: grow before it passes 2/3 (linear probing's misses, which every new block
/// pays, grow as 1/(1 - load)²).
const MAX_LOAD_NUM: usize = 2;
const MAX_LOAD_DEN: usize = 3;
/// The smallest table.
const MIN_CAPACITY: usize = 16;

/// A bucket's slot.
#[inline]
pub(crate) fn slot_of(bucket: u64) -> u32 {
    bucket as u32
}

/// A bucket's tag.
#[inline]
pub(crate) fn tag_of(bucket: u64) -> u32 {
    (bucket >> 32) as u32
}

/// The tag of a mixed hash.
#[inline]
pub(crate) fn tag(mixed: u64) -> u32 {
    (mixed >> 32) as u32
}

/// Mixed hash (as tag) → slot id.
#[derive(Debug, Default)]
pub(crate) struct SlotMap {
    buckets: Vec<u64>,
    len: usize,
}

impl SlotMap {
    /// Entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes allocated.
    pub(crate) fn allocation_size(&self) -> usize {
        self.buckets.capacity() * size_of::<u64>()
    }

    #[inline]
    fn home(&self, tag: u32) -> usize {
        ((u64::from(tag) * self.buckets.len() as u64) >> 32) as usize
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.buckets.len() {
            0
        } else {
            i + 1
        }
    }

    /// The home position of `tag` and the bucket there (`EMPTY` in an empty table): the
    /// first read of a lookup, which a caller with many lookups to do issues for all of them
    /// before continuing any (the reads are independent, so their cache misses overlap).
    #[inline]
    pub(crate) fn home_bucket(&self, tag: u32) -> (usize, u64) {
        if self.buckets.is_empty() {
            return (0, EMPTY);
        }
        let at = self.home(tag);
        (at, self.buckets[at])
    }

    /// Reads the first bucket of the cache line after the one of bucket `at` when `at` is in
    /// the last quarter of its line (a probe from there often goes on into the next line), so
    /// that its miss overlaps the others of a batch; a hint, with no effect on any answer.
    #[inline]
    pub(crate) fn touch_next_line(&self, at: usize) {
        const LINE: usize = 64;
        let addr = self.buckets.as_ptr() as usize + at * size_of::<u64>();
        if addr % LINE >= LINE - 2 * size_of::<u64>() {
            let next = at + (LINE - addr % LINE) / size_of::<u64>();
            if let Some(&b) = self.buckets.get(next) {
                std::hint::black_box(b);
            }
        }
    }

    /// Continues a lookup of `tag` from `at` (whose bucket is `bucket`): the first slot at or
    /// after it with that tag for which `is` holds, or `None` at the first empty bucket.
    #[inline]
    pub(crate) fn find_from(
        &self,
        tag: u32,
        mut at: usize,
        mut bucket: u64,
        mut is: impl FnMut(u32) -> bool,
    ) -> Option<u32> {
        loop {
            let slot = slot_of(bucket);
            if slot == NIL {
                return None;
            }
            if tag_of(bucket) == tag && is(slot) {
                return Some(slot);
            }
            at = self.next(at);
            bucket = self.buckets[at];
        }
    }

    /// The slot under `tag` for which `is` holds.
    #[inline]
    pub(crate) fn find(&self, tag: u32, is: impl FnMut(u32) -> bool) -> Option<u32> {
        let (at, bucket) = self.home_bucket(tag);
        self.find_from(tag, at, bucket, is)
    }

    /// Adds `slot` under `tag` (the caller knows it is not in the map).
    pub(crate) fn insert(&mut self, tag: u32, slot: u32) {
        debug_assert_ne!(slot, NIL);
        if (self.len + 1) * MAX_LOAD_DEN > self.buckets.len() * MAX_LOAD_NUM {
            self.grow();
        }
        self.place(u64::from(tag) << 32 | u64::from(slot));
        self.len += 1;
    }

    fn place(&mut self, bucket: u64) {
        let mut at = self.home(tag_of(bucket));
        while self.buckets[at] != EMPTY {
            at = self.next(at);
        }
        self.buckets[at] = bucket;
    }

    fn grow(&mut self) {
        let cap = (self.buckets.len() + self.buckets.len() / 2).max(MIN_CAPACITY);
        let old = std::mem::replace(&mut self.buckets, vec![EMPTY; cap]);
        for b in old {
            if b != EMPTY {
                self.place(b);
            }
        }
    }

    /// Removes `slot` under `tag`; returns whether it was there.
    pub(crate) fn remove(&mut self, tag: u32, slot: u32) -> bool {
        if self.buckets.is_empty() {
            return false;
        }
        let want = u64::from(tag) << 32 | u64::from(slot);
        let mut at = self.home(tag);
        loop {
            let b = self.buckets[at];
            if b == want {
                break;
            }
            if b == EMPTY {
                return false;
            }
            at = self.next(at);
        }
        // Backward shift: move each later bucket of the run whose home is not in the
        // cyclic range (hole, j] into the hole, so no bucket is cut off from its home.
        let mut hole = at;
        let mut j = at;
        loop {
            j = self.next(j);
            let b = self.buckets[j];
            if b == EMPTY {
                break;
            }
            let h = self.home(tag_of(b));
            let stays = if hole <= j {
                hole < h && h <= j
            } else {
                hole < h || h <= j
            };
            if !stays {
                self.buckets[hole] = b;
                hole = j;
            }
        }
        self.buckets[hole] = EMPTY;
        self.len -= 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A tag function with many collisions (tags in a small range) and wrap-around homes.
    fn tag_for(key: u32) -> u32 {
        (key % 37).wrapping_mul(0x0700_0000) ^ (key % 5)
    }

    #[test]
    fn matches_a_std_map_through_inserts_and_removals() {
        let mut m = SlotMap::default();
        let mut model: HashMap<u32, u32> = HashMap::new();
        let mut x = 12345u64;
        for step in 0..200_000u32 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let key = (x >> 40) as u32 % 3000;
            let tag = tag_for(key);
            // Slot ids are the keys themselves here.
            if let std::collections::hash_map::Entry::Vacant(e) = model.entry(key) {
                if step % 3 != 0 {
                    e.insert(key);
                    m.insert(tag, key);
                }
            } else if step % 2 == 0 {
                model.remove(&key);
                assert!(m.remove(tag, key));
            }
            assert!(!m.remove(tag, 5000), "an absent slot is not removed");
            if step % 997 == 0 {
                for k in 0..3000 {
                    let found = m.find(tag_for(k), |s| s == k);
                    assert_eq!(found, model.get(&k).copied(), "key {k} at step {step}");
                }
            }
        }
        assert_eq!(m.len(), model.len());
        let load = m.len() as f64 / m.buckets.len() as f64;
        assert!(load <= 2.0 / 3.0, "load {load}");
    }

    #[test]
    fn an_empty_map_finds_nothing() {
        let mut m = SlotMap::default();
        assert_eq!(m.find(7, |_| true), None);
        assert!(!m.remove(7, 1));
        m.insert(7, 1);
        assert_eq!(m.find(7, |s| s == 1), Some(1));
        assert!(m.remove(7, 1));
        assert_eq!(m.find(7, |_| true), None);
        assert_eq!(m.len(), 0);
    }
}
