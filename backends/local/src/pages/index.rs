//! The in-memory index of committed pages and the capacity accounting.
//!
//! Invariants (kept under the backend's index lock):
//! 1. `map` holds exactly the pages this process knows to be committed; the evictor tracks
//!    exactly the keys of `map`.
//! 2. `used` is the sum of `file_bytes` over `map`; `data` the sum of page lengths.
//! 3. `reserved` is the file bytes of writes in flight. A write reserves before it starts and
//!    releases when it ends; [`Index::reserve`] evicts until `used + reserved ≤ capacity`, so
//!    committed plus in-flight bytes never exceed the capacity.

use std::collections::HashMap;

use crate::common::PageCount;
use hicache_core::PageKey;
use hicache_storage::{EvictionPolicy, Evictor, PageMeta};

use crate::pages::format::file_bytes;

/// What the index knows of one committed page.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Layout and length.
    pub meta: PageMeta,
    /// When it was written, Unix nanoseconds (its header's write time).
    pub written: u64,
}

/// See the [module documentation](self).
pub struct Index {
    map: HashMap<PageKey, Entry>,
    evictor: Box<dyn Evictor<PageKey>>,
    used: u64,
    data: u64,
    reserved: u64,
    capacity: u64,
}

impl Index {
    /// An empty index.
    pub fn new(capacity: u64, policy: EvictionPolicy) -> Self {
        Self {
            map: HashMap::new(),
            evictor: policy.build(),
            used: 0,
            data: 0,
            reserved: 0,
            capacity,
        }
    }

    /// The entry of `key`.
    pub fn get(&self, key: &PageKey) -> Option<Entry> {
        self.map.get(key).copied()
    }

    /// Whether `key` is committed.
    pub fn contains(&self, key: &PageKey) -> bool {
        self.map.contains_key(key)
    }

    /// Records a use of `key`.
    pub fn touch(&mut self, key: &PageKey) {
        self.evictor.touch(key);
    }

    /// Records a committed page (most recent) written at `written` (Unix nanoseconds);
    /// returns the entry it replaced.
    pub fn insert(&mut self, key: PageKey, meta: PageMeta, written: u64) -> Option<Entry> {
        let old = self.remove(&key);
        self.map.insert(key, Entry { meta, written });
        self.used += file_bytes(meta.len);
        self.data += meta.len as u64;
        self.evictor.insert(key);
        old
    }

    /// Forgets a page; returns its entry.
    pub fn remove(&mut self, key: &PageKey) -> Option<Entry> {
        let e = self.map.remove(key)?;
        self.used -= file_bytes(e.meta.len);
        self.data -= e.meta.len as u64;
        self.evictor.remove(key);
        Some(e)
    }

    /// Reserves `need` file bytes for writes about to start, evicting pages (removed from the
    /// index and appended to `victims`, whose files the caller deletes) until they fit.
    /// Returns false, reserving nothing, if they cannot fit even with nothing left to evict.
    pub fn reserve(&mut self, need: u64, victims: &mut Vec<(PageKey, Entry)>) -> bool {
        while self.used + self.reserved + need > self.capacity {
            let Some(k) = self.evictor.pop_victim() else {
                return false;
            };
            // The evictor just dropped `k`; remove the rest of its state.
            if let Some(e) = self.map.remove(&k) {
                self.used -= file_bytes(e.meta.len);
                self.data -= e.meta.len as u64;
                victims.push((k, e));
            }
        }
        self.reserved += need;
        true
    }

    /// Background eviction: removes pages in the evictor's order, at most `max` of them,
    /// while committed bytes exceed `target`; appends them to `victims` (whose files the
    /// caller deletes). Returns whether committed bytes are now at most `target`.
    pub fn evict_down_to(
        &mut self,
        target: u64,
        max: usize,
        victims: &mut Vec<(PageKey, Entry)>,
    ) -> bool {
        let mut n = 0;
        while self.used > target {
            if n == max {
                return false;
            }
            let Some(k) = self.evictor.pop_victim() else {
                return true;
            };
            if let Some(e) = self.map.remove(&k) {
                self.used -= file_bytes(e.meta.len);
                self.data -= e.meta.len as u64;
                victims.push((k, e));
                n += 1;
            }
        }
        true
    }

    /// Up to `max` keys whose entries satisfy `expired` (by write time).
    pub fn expired_keys(&self, max: usize, expired: impl Fn(u64) -> bool) -> Vec<PageKey> {
        self.map
            .iter()
            .filter(|(_, e)| expired(e.written))
            .map(|(k, _)| *k)
            .take(max)
            .collect()
    }

    /// Ends a reservation of `n` bytes (after the writes committed or failed).
    pub fn release(&mut self, n: u64) {
        self.reserved -= n;
    }

    /// Number of committed pages.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no page is committed.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// File bytes of committed pages.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Page bytes of committed pages.
    pub fn data_bytes(&self) -> u64 {
        self.data
    }

    /// The capacity in file bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Every key (for shared-mode reconciliation).
    pub fn keys(&self) -> impl Iterator<Item = &PageKey> {
        self.map.keys()
    }
}

impl PageCount for Index {
    fn pages(&self) -> u64 {
        self.map.len() as u64
    }

    fn bytes(&self) -> u64 {
        self.data
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_core::LayoutKind;
    use hicache_storage::pattern::{namespace, page_key};
    use proptest::prelude::*;

    fn meta(len: usize) -> PageMeta {
        PageMeta {
            layout: LayoutKind::PageFirst,
            len,
        }
    }

    #[test]
    fn reserve_evicts_oldest_first() {
        let k = |i| page_key(namespace(0), 0, i);
        let mut ix = Index::new(3 * file_bytes(4096), EvictionPolicy::Lru);
        for i in 0..3 {
            let mut v = Vec::new();
            assert!(ix.reserve(file_bytes(4096), &mut v));
            assert!(v.is_empty());
            ix.insert(k(i), meta(4096), 0);
            ix.release(file_bytes(4096));
        }
        ix.touch(&k(0));
        let mut v = Vec::new();
        assert!(ix.reserve(file_bytes(4096), &mut v));
        assert_eq!(v.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![k(1)]);
        assert!(!ix.reserve(10 * file_bytes(4096), &mut v), "never fits");
    }

    #[test]
    fn evict_down_to_in_chunks_and_expired_keys() {
        let k = |i| page_key(namespace(0), 0, i);
        let mut ix = Index::new(100 * file_bytes(4096), EvictionPolicy::Fifo);
        for i in 0..10 {
            ix.insert(k(i), meta(4096), i);
        }
        let mut v = Vec::new();
        assert!(
            !ix.evict_down_to(4 * file_bytes(4096), 3, &mut v),
            "3 at a time"
        );
        assert_eq!(
            v.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            vec![k(0), k(1), k(2)]
        );
        assert!(ix.evict_down_to(4 * file_bytes(4096), 3, &mut v));
        assert_eq!((ix.len(), v.len()), (4, 6));
        assert!(
            ix.evict_down_to(4 * file_bytes(4096), 3, &mut v),
            "already there"
        );
        let mut old = ix.expired_keys(10, |w| w < 8);
        old.sort_by_key(|k| k.to_hex());
        let mut want = vec![k(6), k(7)];
        want.sort_by_key(|k| k.to_hex());
        assert_eq!(old, want);
        assert_eq!(ix.expired_keys(1, |_| true).len(), 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        /// Accounting against a naive model of (key → len) after random inserts, removes and
        /// reservations.
        #[test]
        fn accounting_matches_model(ops in proptest::collection::vec((0u8..3, 0u64..12, 1usize..20_000), 0..150)) {
            let cap = 16 * file_bytes(8192);
            let mut ix = Index::new(cap, EvictionPolicy::Lru);
            let mut model: HashMap<PageKey, usize> = HashMap::new();
            for (op, i, len) in ops {
                let key = page_key(namespace(1), 1, i);
                match op {
                    0 => {
                        let mut v = Vec::new();
                        let need = file_bytes(len);
                        if ix.reserve(need, &mut v) {
                            for (k, _) in &v { model.remove(k); }
                            ix.insert(key, meta(len), 0);
                            ix.release(need);
                            model.insert(key, len);
                        }
                    }
                    1 => { ix.remove(&key); model.remove(&key); }
                    _ => ix.touch(&key),
                }
                prop_assert_eq!(ix.len(), model.len());
                prop_assert_eq!(ix.used(), model.values().map(|l| file_bytes(*l)).sum::<u64>());
                prop_assert_eq!(ix.data_bytes(), model.values().map(|l| *l as u64).sum::<u64>());
                prop_assert!(ix.used() <= cap);
            }
        }
    }
}
