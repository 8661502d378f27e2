//! `mru`: most recently used first (key `-last_access`).

use super::heap::{KeyFn, KeyedHeap};
use super::{NodeStats, StrategyKind};

/// Key of [`MruStrategy`].
#[derive(Debug)]
pub struct Mru;

impl KeyFn for Mru {
    const KIND: StrategyKind = StrategyKind::Mru;
    fn key(s: &NodeStats) -> (u64, u64) {
        (u64::MAX - s.last_access, 0)
    }
}

/// Most recently used first.
pub type MruStrategy = KeyedHeap<Mru>;

#[cfg(test)]
mod tests {
    use super::super::EvictionStrategy;
    use super::super::testing::{VecTable, drain};
    use super::*;

    #[test]
    fn newest_access_goes_first() {
        let mut t = VecTable::default();
        let mut s = MruStrategy::default();
        for a in [3u64, 1, 2] {
            let n = t.add(
                NodeStats {
                    last_access: a,
                    ..Default::default()
                },
                1,
            );
            s.insert(n, &t.stats[n as usize]);
        }
        assert_eq!(drain(&mut s, &mut t), vec![0, 2, 1]);
    }
}
