//! Eviction order for capacity-bounded backends.
//!
//! A backend keeps its own index of stored pages and asks an [`Evictor`] which page to drop
//! next. The trait is deliberately the small surface that `hicache-core`'s eviction strategies
//! also offer (insert / touch / remove / pop victim), so backends can switch to core's indexed
//! strategies without changing their own code; until then the two policies L3 needs live here.
//!
//! Invariant: an evictor tracks exactly the keys inserted and not yet removed or popped; the
//! owning backend keeps it in step with its index under the same lock.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// Which page an evictor gives up first.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum EvictionPolicy {
    /// Least recently used (written or read) first. The default.
    #[default]
    Lru,
    /// First written first, whatever was read since.
    Fifo,
}

impl EvictionPolicy {
    /// Configuration spellings, in the order of [`EvictionPolicy::parse`].
    pub const NAMES: [&'static str; 2] = ["lru", "fifo"];

    /// Parses a configuration spelling (see [`NAMES`](Self::NAMES)).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "lru" => Some(Self::Lru),
            "fifo" => Some(Self::Fifo),
            _ => None,
        }
    }

    /// A new, empty evictor of this policy.
    pub fn build<K: Clone + Eq + Hash + Send + 'static>(self) -> Box<dyn Evictor<K>> {
        Box::new(Ordered::new(self == Self::Lru))
    }
}

/// Chooses eviction victims among tracked keys.
pub trait Evictor<K>: Send {
    /// Starts tracking `key` as the most recent entry (or refreshes it if tracked).
    fn insert(&mut self, key: K);
    /// Records a use of `key` (a hit); ignored if not tracked.
    fn touch(&mut self, key: &K);
    /// Stops tracking `key`; ignored if not tracked.
    fn remove(&mut self, key: &K);
    /// Removes and returns the key to evict next, if any.
    fn pop_victim(&mut self) -> Option<K>;
    /// Number of tracked keys.
    fn len(&self) -> usize;
    /// Whether no key is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// LRU or FIFO over a logical clock: `order` maps tick → key, `ticks` key → its tick.
/// O(log n) per operation.
struct Ordered<K> {
    touch_moves: bool,
    clock: u64,
    ticks: HashMap<K, u64>,
    order: BTreeMap<u64, K>,
}

impl<K: Clone + Eq + Hash> Ordered<K> {
    fn new(touch_moves: bool) -> Self {
        Self {
            touch_moves,
            clock: 0,
            ticks: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    fn stamp(&mut self, key: K) {
        self.clock += 1;
        if let Some(old) = self.ticks.insert(key.clone(), self.clock) {
            self.order.remove(&old);
        }
        self.order.insert(self.clock, key);
    }
}

impl<K: Clone + Eq + Hash + Send> Evictor<K> for Ordered<K> {
    fn insert(&mut self, key: K) {
        self.stamp(key);
    }

    fn touch(&mut self, key: &K) {
        if self.touch_moves && self.ticks.contains_key(key) {
            self.stamp(key.clone());
        }
    }

    fn remove(&mut self, key: &K) {
        if let Some(t) = self.ticks.remove(key) {
            self.order.remove(&t);
        }
    }

    fn pop_victim(&mut self) -> Option<K> {
        let (_, key) = self.order.pop_first()?;
        self.ticks.remove(&key);
        Some(key)
    }

    fn len(&self) -> usize {
        self.ticks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lru_and_fifo_orders() {
        let mut lru = EvictionPolicy::Lru.build::<u32>();
        let mut fifo = EvictionPolicy::Fifo.build::<u32>();
        for e in [&mut lru, &mut fifo] {
            e.insert(1);
            e.insert(2);
            e.insert(3);
            e.touch(&1);
            e.touch(&9);
        }
        assert_eq!(lru.pop_victim(), Some(2));
        assert_eq!(fifo.pop_victim(), Some(1));
        lru.remove(&3);
        assert_eq!(lru.pop_victim(), Some(1));
        assert_eq!(lru.pop_victim(), None);
        assert!(lru.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8),
        Touch(u8),
        Remove(u8),
        Pop,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..16).prop_map(Op::Insert),
            (0u8..16).prop_map(Op::Touch),
            (0u8..16).prop_map(Op::Remove),
            Just(Op::Pop),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        /// Against a naive model: a vector ordered from least to most recent.
        #[test]
        fn matches_naive_model(ops in proptest::collection::vec(op(), 0..200), lru in any::<bool>()) {
            let policy = if lru { EvictionPolicy::Lru } else { EvictionPolicy::Fifo };
            let mut e = policy.build::<u8>();
            let mut model: Vec<u8> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(k) => {
                        model.retain(|x| *x != k);
                        model.push(k);
                        e.insert(k);
                    }
                    Op::Touch(k) => {
                        if lru && model.contains(&k) {
                            model.retain(|x| *x != k);
                            model.push(k);
                        }
                        e.touch(&k);
                    }
                    Op::Remove(k) => {
                        model.retain(|x| *x != k);
                        e.remove(&k);
                    }
                    Op::Pop => {
                        let want = if model.is_empty() { None } else { Some(model.remove(0)) };
                        prop_assert_eq!(e.pop_victim(), want);
                    }
                }
                prop_assert_eq!(e.len(), model.len());
            }
        }
    }
}
