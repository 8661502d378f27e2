//! `sieve`: SIEVE (Zhang et al., NSDI'24) over the tier's nodes.
//!
//! Nodes enter a FIFO queue when they enter the tier ([`NodeStats::seq`] is their position,
//! newest last) and an access sets their *visited* bit. A hand moves from the oldest towards the
//! newest candidate: a visited candidate has its bit cleared and is passed over (it stays where
//! it is), the first unvisited one is evicted, and the hand wraps around at the newest. Only
//! evictable leaves are candidates; the hand skips every other node, which is what SIEVE does
//! with an object that cannot be evicted. The hand position is kept between calls.

use std::collections::BTreeSet;
use std::ops::Bound;

use super::{EvictionStrategy, Membership, NodeStats, StatsTable, StrategyKind};

/// The visited bit in [`NodeStats::bits`].
pub const VISITED: u8 = 1;

/// SIEVE candidate queue.
#[derive(Debug, Default)]
pub struct Sieve {
    queue: BTreeSet<(u64, u32)>,
    member: Membership,
    next_seq: u64,
    /// The next position the hand examines (inclusive lower bound).
    hand: Option<(u64, u32)>,
}

impl Sieve {
    fn at_or_after_hand(&self) -> Option<(u64, u32)> {
        let from = self.hand.map_or(Bound::Unbounded, Bound::Included);
        self.queue
            .range((from, Bound::Unbounded))
            .next()
            .or_else(|| self.queue.first())
            .copied()
    }
}

impl EvictionStrategy for Sieve {
    fn kind(&self) -> StrategyKind {
        StrategyKind::Sieve
    }
    fn len(&self) -> usize {
        self.queue.len()
    }
    fn contains(&self, node: u32) -> bool {
        self.member.get(node)
    }
    fn insert(&mut self, node: u32, stats: &NodeStats) {
        if !self.member.get(node) {
            self.queue.insert((stats.seq, node));
            self.member.set(node, true);
        }
    }
    fn remove(&mut self, node: u32, stats: &NodeStats) {
        if self.member.get(node) {
            self.queue.remove(&(stats.seq, node));
            self.member.set(node, false);
        }
    }
    fn update(&mut self, _node: u32, _stats: &NodeStats) {}
    fn pop(&mut self, table: &mut dyn StatsTable) -> Option<u32> {
        // Two laps clear every visited bit, so this terminates.
        for _ in 0..=2 * self.queue.len() {
            let (seq, node) = self.at_or_after_hand()?;
            self.hand = Some((seq, node + 1));
            let st = table.stats_mut(node);
            if st.bits & VISITED != 0 {
                st.bits &= !VISITED;
                continue;
            }
            self.queue.remove(&(seq, node));
            self.member.set(node, false);
            return Some(node);
        }
        None
    }
    fn touch(&self, stats: &mut NodeStats) {
        stats.bits |= VISITED;
    }
    fn admitted(&mut self, stats: &mut NodeStats, _pages: u32, _fingerprint: u64) {
        self.next_seq += 1;
        stats.seq = self.next_seq;
        stats.bits &= !VISITED;
    }
    fn clear(&mut self) {
        *self = Self::default();
    }
    fn memory_bytes(&self) -> usize {
        self.queue.len() * 24 + self.member.len()
    }
    fn candidates(&self) -> Vec<u32> {
        self.queue.iter().map(|&(_, n)| n).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::VecTable;
    use super::*;

    fn setup(n: usize) -> (Sieve, VecTable) {
        let mut s = Sieve::default();
        let mut t = VecTable::default();
        for _ in 0..n {
            let id = t.add(NodeStats::default(), 1);
            s.admitted(&mut t.stats[id as usize], 1, 0);
            s.insert(id, &t.stats[id as usize]);
        }
        (s, t)
    }

    #[test]
    fn unvisited_oldest_goes_first_and_visited_get_a_second_chance() {
        let (mut s, mut t) = setup(4);
        s.touch(&mut t.stats[0]);
        s.touch(&mut t.stats[2]);
        // Hand passes 0 (clears it), evicts 1.
        assert_eq!(s.pop(&mut t), Some(1));
        // Hand at 2: visited, cleared; evicts 3.
        assert_eq!(s.pop(&mut t), Some(3));
        // Wraps: 0 (cleared before) goes now, then 2.
        assert_eq!(s.pop(&mut t), Some(0));
        assert_eq!(s.pop(&mut t), Some(2));
        assert_eq!(s.pop(&mut t), None);
    }

    #[test]
    fn hand_persists_and_new_nodes_go_to_the_head() {
        let (mut s, mut t) = setup(3);
        s.touch(&mut t.stats[0]);
        assert_eq!(s.pop(&mut t), Some(1));
        // A new node joins at the head; the hand continues at 2 first.
        let id = t.add(NodeStats::default(), 1);
        s.admitted(&mut t.stats[id as usize], 1, 0);
        s.insert(id, &t.stats[id as usize]);
        assert_eq!(s.pop(&mut t), Some(2));
        assert_eq!(s.pop(&mut t), Some(3));
        assert_eq!(s.pop(&mut t), Some(0));
    }

    #[test]
    fn all_visited_still_evicts() {
        let (mut s, mut t) = setup(3);
        for i in 0..3 {
            s.touch(&mut t.stats[i]);
        }
        assert_eq!(s.pop(&mut t), Some(0));
        assert_eq!(s.len(), 2);
    }
}
