//! An indexed binary min-heap of candidates keyed by a function of their [`NodeStats`].
//!
//! Positions are kept in a vector indexed by node id, so membership is O(1) and insert, remove
//! and re-key are O(log n). Ties between equal keys are broken by node id, which makes the
//! order a pure function of the keys (the same on every TP rank).

use std::marker::PhantomData;

use super::{EvictionStrategy, NodeStats, StatsTable, StrategyKind};

const ABSENT: u32 = u32::MAX;

/// A strategy whose order is a key computed from the node's stats (smaller evicted first).
pub trait KeyFn: std::fmt::Debug + Send + Sync + 'static {
    /// Which strategy this is.
    const KIND: StrategyKind;
    /// The key: compared as (major, minor), then by node id.
    fn key(stats: &NodeStats) -> (u64, u64);
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    major: u64,
    minor: u64,
    node: u32,
}

/// Indexed min-heap ordered by `K::key`.
#[derive(Debug)]
pub struct KeyedHeap<K: KeyFn> {
    heap: Vec<Entry>,
    pos: Vec<u32>,
    _key: PhantomData<K>,
}

impl<K: KeyFn> Clone for KeyedHeap<K> {
    fn clone(&self) -> Self {
        Self {
            heap: self.heap.clone(),
            pos: self.pos.clone(),
            _key: PhantomData,
        }
    }
}

impl<K: KeyFn> Default for KeyedHeap<K> {
    fn default() -> Self {
        Self {
            heap: Vec::new(),
            pos: Vec::new(),
            _key: PhantomData,
        }
    }
}

impl<K: KeyFn> KeyedHeap<K> {
    fn entry(node: u32, stats: &NodeStats) -> Entry {
        let (major, minor) = K::key(stats);
        Entry { major, minor, node }
    }

    fn position(&self, node: u32) -> Option<usize> {
        match self.pos.get(node as usize) {
            Some(&p) if p != ABSENT => Some(p as usize),
            _ => None,
        }
    }

    fn place(&mut self, i: usize) {
        let n = self.heap[i].node as usize;
        self.pos[n] = i as u32;
    }

    fn sift_up(&mut self, mut i: usize) {
        let e = self.heap[i];
        while i > 0 {
            let p = (i - 1) / 2;
            if self.heap[p] <= e {
                break;
            }
            self.heap[i] = self.heap[p];
            self.place(i);
            i = p;
        }
        self.heap[i] = e;
        self.place(i);
    }

    fn sift_down(&mut self, mut i: usize) {
        let len = self.heap.len();
        let e = self.heap[i];
        loop {
            let l = 2 * i + 1;
            if l >= len {
                break;
            }
            let r = l + 1;
            let c = if r < len && self.heap[r] < self.heap[l] {
                r
            } else {
                l
            };
            if self.heap[c] >= e {
                break;
            }
            self.heap[i] = self.heap[c];
            self.place(i);
            i = c;
        }
        self.heap[i] = e;
        self.place(i);
    }

    fn remove_at(&mut self, i: usize) -> Entry {
        let last = self.heap.len() - 1;
        self.heap.swap(i, last);
        let e = self.heap.pop().expect("non-empty heap");
        self.pos[e.node as usize] = ABSENT;
        if i < self.heap.len() {
            self.place(i);
            self.sift_down(i);
            self.sift_up(i);
        }
        e
    }

    /// The minimum without removing it.
    pub fn peek(&self) -> Option<u32> {
        self.heap.first().map(|e| e.node)
    }
}

impl<K: KeyFn> EvictionStrategy for KeyedHeap<K> {
    fn kind(&self) -> StrategyKind {
        K::KIND
    }
    fn len(&self) -> usize {
        self.heap.len()
    }
    fn contains(&self, node: u32) -> bool {
        self.position(node).is_some()
    }
    fn insert(&mut self, node: u32, stats: &NodeStats) {
        if self.contains(node) {
            self.update(node, stats);
            return;
        }
        if node as usize >= self.pos.len() {
            self.pos.resize(node as usize + 1, ABSENT);
        }
        self.heap.push(Self::entry(node, stats));
        let i = self.heap.len() - 1;
        self.sift_up(i);
    }
    fn remove(&mut self, node: u32, _stats: &NodeStats) {
        if let Some(i) = self.position(node) {
            self.remove_at(i);
        }
    }
    fn update(&mut self, node: u32, stats: &NodeStats) {
        if let Some(i) = self.position(node) {
            let e = Self::entry(node, stats);
            let old = self.heap[i];
            self.heap[i] = e;
            if e < old {
                self.sift_up(i);
            } else {
                self.sift_down(i);
            }
        }
    }
    fn pop(&mut self, _table: &mut dyn StatsTable) -> Option<u32> {
        if self.heap.is_empty() {
            None
        } else {
            Some(self.remove_at(0).node)
        }
    }
    fn clear(&mut self) {
        self.heap.clear();
        self.pos.clear();
    }
    fn candidates(&self) -> Vec<u32> {
        self.heap.iter().map(|e| e.node).collect()
    }
    fn memory_bytes(&self) -> usize {
        self.heap.capacity() * std::mem::size_of::<Entry>() + self.pos.capacity() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::super::lru::LruStrategy;
    use super::super::testing::{VecTable, drain};
    use super::*;

    fn at(t: u64) -> NodeStats {
        NodeStats {
            last_access: t,
            ..Default::default()
        }
    }

    #[test]
    fn pops_in_key_order_with_updates_and_removals() {
        let mut t = VecTable::default();
        let mut h = LruStrategy::default();
        let times = [50u64, 10, 40, 30, 20, 60, 5, 45];
        for &x in &times {
            let n = t.add(at(x), 1);
            h.insert(n, &t.stats[n as usize]);
        }
        assert_eq!(h.len(), 8);
        // Node 6 (t=5) is re-stamped to 100: last now.
        t.stats[6] = at(100);
        h.update(6, &t.stats[6]);
        // Node 2 (t=40) leaves.
        h.remove(2, &t.stats[2]);
        assert!(!h.contains(2));
        h.remove(2, &t.stats[2]);
        let order = drain(&mut h, &mut t);
        assert_eq!(order, vec![1, 4, 3, 7, 0, 5, 6]);
        assert!(h.is_empty());
    }

    #[test]
    fn equal_keys_break_ties_by_node_id() {
        let mut t = VecTable::default();
        let mut h = LruStrategy::default();
        for _ in 0..5 {
            let n = t.add(at(7), 1);
            h.insert(n, &t.stats[n as usize]);
        }
        h.remove(0, &t.stats[0]);
        assert_eq!(drain(&mut h, &mut t), vec![1, 2, 3, 4]);
    }

    #[test]
    fn matches_a_sorted_reference_under_random_operations() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(7);
        let mut t = VecTable::default();
        for _ in 0..200 {
            t.add(at(0), 1);
        }
        let mut h = LruStrategy::default();
        let mut model: std::collections::BTreeSet<(u64, u32)> = Default::default();
        for _ in 0..5000 {
            let n: u32 = rng.random_range(0..200);
            match rng.random_range(0..4) {
                0 => {
                    model.retain(|&(_, m)| m != n);
                    t.stats[n as usize] = at(rng.random_range(0..1000));
                    model.insert((t.stats[n as usize].last_access, n));
                    h.insert(n, &t.stats[n as usize]);
                }
                1 => {
                    model.retain(|&(_, m)| m != n);
                    h.remove(n, &t.stats[n as usize]);
                }
                2 => {
                    if h.contains(n) {
                        model.retain(|&(_, m)| m != n);
                        t.stats[n as usize] = at(rng.random_range(0..1000));
                        model.insert((t.stats[n as usize].last_access, n));
                        h.update(n, &t.stats[n as usize]);
                    }
                }
                _ => {
                    let want = model.pop_first().map(|(_, m)| m);
                    assert_eq!(h.pop(&mut t), want);
                }
            }
            assert_eq!(h.len(), model.len());
        }
    }
}
