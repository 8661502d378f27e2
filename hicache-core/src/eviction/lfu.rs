//! `lfu`: fewest insert-path hits first, ties by recency (key `(hit_count, last_access)`).

use super::heap::{KeyFn, KeyedHeap};
use super::{NodeStats, StrategyKind};

/// Key of [`LfuStrategy`].
#[derive(Debug)]
pub struct Lfu;

impl KeyFn for Lfu {
    const KIND: StrategyKind = StrategyKind::Lfu;
    fn key(s: &NodeStats) -> (u64, u64) {
        (u64::from(s.hit_count), s.last_access)
    }
}

/// Least frequently used first.
pub type LfuStrategy = KeyedHeap<Lfu>;

#[cfg(test)]
mod tests {
    use super::super::EvictionStrategy;
    use super::super::testing::{VecTable, drain};
    use super::*;

    #[test]
    fn fewest_hits_then_oldest_go_first() {
        let mut t = VecTable::default();
        let mut s = LfuStrategy::default();
        for (h, a) in [(2u32, 1u64), (1, 5), (1, 3), (0, 9)] {
            let n = t.add(
                NodeStats {
                    hit_count: h,
                    last_access: a,
                    ..Default::default()
                },
                1,
            );
            s.insert(n, &t.stats[n as usize]);
        }
        assert_eq!(drain(&mut s, &mut t), vec![3, 2, 1, 0]);
    }
}
