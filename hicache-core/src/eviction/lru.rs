//! `lru`: least recently used first (SGLang's default; key `last_access`).

use super::heap::{KeyFn, KeyedHeap};
use super::{NodeStats, StrategyKind};

/// Key of [`LruStrategy`].
#[derive(Debug)]
pub struct Lru;

impl KeyFn for Lru {
    const KIND: StrategyKind = StrategyKind::Lru;
    fn key(s: &NodeStats) -> (u64, u64) {
        (s.last_access, 0)
    }
}

/// Least recently used first.
pub type LruStrategy = KeyedHeap<Lru>;

#[cfg(test)]
mod tests {
    use super::super::EvictionStrategy;
    use super::super::testing::{VecTable, drain};
    use super::*;

    #[test]
    fn oldest_access_goes_first() {
        let mut t = VecTable::default();
        let mut s = LruStrategy::default();
        for a in [3u64, 1, 2] {
            let n = t.add(
                NodeStats {
                    last_access: a,
                    creation: 10 - a,
                    ..Default::default()
                },
                1,
            );
            s.insert(n, &t.stats[n as usize]);
        }
        assert_eq!(drain(&mut s, &mut t), vec![1, 2, 0]);
    }
}
