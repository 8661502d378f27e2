//! `fifo`: oldest created first (key `creation`).

use super::heap::{KeyFn, KeyedHeap};
use super::{NodeStats, StrategyKind};

/// Key of [`FifoStrategy`].
#[derive(Debug)]
pub struct Fifo;

impl KeyFn for Fifo {
    const KIND: StrategyKind = StrategyKind::Fifo;
    fn key(s: &NodeStats) -> (u64, u64) {
        (s.creation, 0)
    }
}

/// Oldest created first.
pub type FifoStrategy = KeyedHeap<Fifo>;

#[cfg(test)]
mod tests {
    use super::super::EvictionStrategy;
    use super::super::testing::{VecTable, drain};
    use super::*;

    #[test]
    fn oldest_creation_goes_first_regardless_of_access() {
        let mut t = VecTable::default();
        let mut s = FifoStrategy::default();
        for (c, a) in [(5u64, 1u64), (1, 9), (3, 2)] {
            let n = t.add(
                NodeStats {
                    creation: c,
                    last_access: a,
                    ..Default::default()
                },
                1,
            );
            s.insert(n, &t.stats[n as usize]);
        }
        assert_eq!(drain(&mut s, &mut t), vec![1, 2, 0]);
    }
}
