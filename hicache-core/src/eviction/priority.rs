//! `priority`: lowest request priority first, ties by recency (key `(priority, last_access)`).

use super::heap::{KeyFn, KeyedHeap};
use super::{NodeStats, StrategyKind};

/// Key of [`PriorityStrategy`].
#[derive(Debug)]
pub struct Priority;

impl KeyFn for Priority {
    const KIND: StrategyKind = StrategyKind::Priority;
    fn key(s: &NodeStats) -> (u64, u64) {
        // Flip the sign bit so that signed order becomes unsigned order.
        ((s.priority as i64 as u64) ^ (1 << 63), s.last_access)
    }
}

/// Lowest priority first.
pub type PriorityStrategy = KeyedHeap<Priority>;

#[cfg(test)]
mod tests {
    use super::super::EvictionStrategy;
    use super::super::testing::{VecTable, drain};
    use super::*;

    #[test]
    fn lowest_priority_then_oldest_go_first() {
        let mut t = VecTable::default();
        let mut s = PriorityStrategy::default();
        for (p, a) in [(0i32, 1u64), (-5, 9), (3, 0), (0, 0)] {
            let n = t.add(
                NodeStats {
                    priority: p,
                    last_access: a,
                    ..Default::default()
                },
                1,
            );
            s.insert(n, &t.stats[n as usize]);
        }
        assert_eq!(drain(&mut s, &mut t), vec![1, 3, 0, 2]);
    }
}
