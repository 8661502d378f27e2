//! `s3-fifo`: S3-FIFO (Yang et al., SOSP'23) over the tier's nodes.
//!
//! Nodes entering the tier join the small probationary queue S, or the main queue M when their
//! fingerprint is in the ghost queue G (recently evicted from S). Accesses raise a 2-bit
//! frequency. When S holds at least 10% of the tier's pages (or M has no candidate), the oldest
//! S candidate is examined: accessed since admission ⇒ moved to M; otherwise evicted and
//! remembered in G. Otherwise the oldest M candidate is examined: frequency > 0 ⇒ decremented
//! and reinserted at M's head; otherwise evicted.
//!
//! Adaptations to a radix tree: only evictable leaves are candidates (other nodes are skipped
//! as S3-FIFO skips objects that cannot be evicted); queue sizes are counted in pages of all
//! nodes in the tier; the ghost key is the node's fingerprint (its parent and first page), so a
//! node re-created at the same place after eviction is recognised; G holds at most as many
//! entries as the tier has nodes (and at least 64).

use std::collections::{BTreeSet, HashMap, VecDeque};

use super::{EvictionStrategy, Membership, NodeStats, StatsTable, StrategyKind};

/// [`NodeStats::bits`]: the node is in the main queue.
pub const MAIN: u8 = 1;
const FREQ_SHIFT: u8 = 1;
const FREQ_MASK: u8 = 0b110;
const FREQ_MAX: u8 = 3;
/// Share of the tier's pages the small queue aims for, in percent.
pub const SMALL_PERCENT: u64 = 10;
const MIN_GHOSTS: usize = 64;

fn freq(s: &NodeStats) -> u8 {
    (s.bits & FREQ_MASK) >> FREQ_SHIFT
}

fn set_freq(s: &mut NodeStats, f: u8) {
    s.bits = (s.bits & !FREQ_MASK) | (f.min(FREQ_MAX) << FREQ_SHIFT);
}

/// S3-FIFO candidate queues.
#[derive(Debug, Default)]
pub struct S3Fifo {
    small: BTreeSet<(u64, u32)>,
    main: BTreeSet<(u64, u32)>,
    member: Membership,
    small_pages: u64,
    main_pages: u64,
    resident_nodes: usize,
    next_seq: u64,
    ghost: VecDeque<u64>,
    ghost_count: HashMap<u64, u32>,
}

impl S3Fifo {
    fn queue(&mut self, stats: &NodeStats) -> &mut BTreeSet<(u64, u32)> {
        if stats.bits & MAIN != 0 {
            &mut self.main
        } else {
            &mut self.small
        }
    }

    fn remember(&mut self, fingerprint: u64) {
        self.ghost.push_back(fingerprint);
        *self.ghost_count.entry(fingerprint).or_insert(0) += 1;
        let cap = self.resident_nodes.max(MIN_GHOSTS);
        while self.ghost.len() > cap {
            let old = self.ghost.pop_front().expect("non-empty ghost queue");
            if let Some(c) = self.ghost_count.get_mut(&old) {
                *c -= 1;
                if *c == 0 {
                    self.ghost_count.remove(&old);
                }
            }
        }
    }

    fn next_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }
}

impl EvictionStrategy for S3Fifo {
    fn kind(&self) -> StrategyKind {
        StrategyKind::S3Fifo
    }
    fn len(&self) -> usize {
        self.small.len() + self.main.len()
    }
    fn contains(&self, node: u32) -> bool {
        self.member.get(node)
    }
    fn insert(&mut self, node: u32, stats: &NodeStats) {
        if !self.member.get(node) {
            self.queue(stats).insert((stats.seq, node));
            self.member.set(node, true);
        }
    }
    fn remove(&mut self, node: u32, stats: &NodeStats) {
        if self.member.get(node) {
            self.queue(stats).remove(&(stats.seq, node));
            self.member.set(node, false);
        }
    }
    fn update(&mut self, _node: u32, _stats: &NodeStats) {}
    fn pop(&mut self, table: &mut dyn StatsTable) -> Option<u32> {
        loop {
            let total = self.small_pages + self.main_pages;
            let use_small = !self.small.is_empty()
                && (self.main.is_empty() || self.small_pages * 100 >= total * SMALL_PERCENT);
            if use_small {
                let (seq, node) = *self.small.first()?;
                self.small.remove(&(seq, node));
                let pages = u64::from(table.pages(node));
                if freq(table.stats(node)) > 0 {
                    let seq = self.next_seq();
                    let st = table.stats_mut(node);
                    st.bits |= MAIN;
                    set_freq(st, 0);
                    st.seq = seq;
                    self.main.insert((seq, node));
                    self.small_pages = self.small_pages.saturating_sub(pages);
                    self.main_pages += pages;
                    continue;
                }
                self.member.set(node, false);
                let fp = table.fingerprint(node);
                self.remember(fp);
                return Some(node);
            }
            let (seq, node) = *self.main.first()?;
            self.main.remove(&(seq, node));
            let f = freq(table.stats(node));
            if f > 0 {
                let seq = self.next_seq();
                let st = table.stats_mut(node);
                set_freq(st, f - 1);
                st.seq = seq;
                self.main.insert((seq, node));
                continue;
            }
            self.member.set(node, false);
            return Some(node);
        }
    }
    fn touch(&self, stats: &mut NodeStats) {
        let f = freq(stats);
        set_freq(stats, f + 1);
    }
    fn admitted(&mut self, stats: &mut NodeStats, pages: u32, fingerprint: u64) {
        self.resident_nodes += 1;
        let seq = self.next_seq();
        stats.seq = seq;
        stats.bits = 0;
        if self.ghost_count.contains_key(&fingerprint) {
            stats.bits = MAIN;
            self.main_pages += u64::from(pages);
        } else {
            self.small_pages += u64::from(pages);
        }
    }
    fn departed(&mut self, stats: &NodeStats, pages: u32) {
        self.resident_nodes = self.resident_nodes.saturating_sub(1);
        let p = u64::from(pages);
        if stats.bits & MAIN != 0 {
            self.main_pages = self.main_pages.saturating_sub(p);
        } else {
            self.small_pages = self.small_pages.saturating_sub(p);
        }
    }
    fn clear(&mut self) {
        *self = Self::default();
    }
    fn memory_bytes(&self) -> usize {
        (self.small.len() + self.main.len()) * 24
            + self.member.len()
            + self.ghost.capacity() * 8
            + self.ghost_count.capacity() * 16
    }
    fn candidates(&self) -> Vec<u32> {
        self.small
            .iter()
            .chain(self.main.iter())
            .map(|&(_, n)| n)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::VecTable;
    use super::*;

    fn admit(s: &mut S3Fifo, t: &mut VecTable, fp: u64) -> u32 {
        let id = t.add(NodeStats::default(), 1);
        t.fingerprints[id as usize] = fp;
        s.admitted(&mut t.stats[id as usize], 1, fp);
        s.insert(id, &t.stats[id as usize]);
        id
    }

    #[test]
    fn one_hit_wonders_leave_first_and_accessed_nodes_move_to_main() {
        let mut s = S3Fifo::default();
        let mut t = VecTable::default();
        let a = admit(&mut s, &mut t, 100);
        let b = admit(&mut s, &mut t, 101);
        let c = admit(&mut s, &mut t, 102);
        s.touch(&mut t.stats[a as usize]);
        // a was accessed: promoted to main; b is the first one-hit wonder.
        assert_eq!(s.pop(&mut t), Some(b));
        assert_ne!(t.stats[a as usize].bits & MAIN, 0);
        assert_eq!(s.pop(&mut t), Some(c));
        assert_eq!(s.pop(&mut t), Some(a));
        assert!(s.is_empty());
    }

    #[test]
    fn ghost_hits_are_admitted_to_main() {
        let mut s = S3Fifo::default();
        let mut t = VecTable::default();
        let a = admit(&mut s, &mut t, 7);
        assert_eq!(s.pop(&mut t), Some(a));
        s.departed(&t.stats[a as usize], 1);
        let again = admit(&mut s, &mut t, 7);
        assert_ne!(t.stats[again as usize].bits & MAIN, 0);
        let fresh = admit(&mut s, &mut t, 8);
        assert_eq!(t.stats[fresh as usize].bits & MAIN, 0);
    }

    #[test]
    fn main_reinserts_until_frequency_is_spent() {
        let mut s = S3Fifo::default();
        let mut t = VecTable::default();
        // Fill main through the ghost path, with frequencies.
        let ids: Vec<u32> = (0..3).map(|i| admit(&mut s, &mut t, 1000 + i)).collect();
        for &i in &ids {
            assert_eq!(s.pop(&mut t), Some(i));
            s.departed(&t.stats[i as usize], 1);
        }
        let x = admit(&mut s, &mut t, 1000);
        let y = admit(&mut s, &mut t, 1001);
        s.touch(&mut t.stats[x as usize]);
        s.touch(&mut t.stats[x as usize]);
        // Both in main; x has frequency 2, so y goes first.
        assert_eq!(s.pop(&mut t), Some(y));
        assert_eq!(s.pop(&mut t), Some(x));
    }
}
