//! `filo`: newest created first (key `-creation`).

use super::heap::{KeyFn, KeyedHeap};
use super::{NodeStats, StrategyKind};

/// Key of [`FiloStrategy`].
#[derive(Debug)]
pub struct Filo;

impl KeyFn for Filo {
    const KIND: StrategyKind = StrategyKind::Filo;
    fn key(s: &NodeStats) -> (u64, u64) {
        (u64::MAX - s.creation, 0)
    }
}

/// Newest created first.
pub type FiloStrategy = KeyedHeap<Filo>;

#[cfg(test)]
mod tests {
    use super::super::EvictionStrategy;
    use super::super::testing::{VecTable, drain};
    use super::*;

    #[test]
    fn newest_creation_goes_first() {
        let mut t = VecTable::default();
        let mut s = FiloStrategy::default();
        for c in [5u64, 1, 3] {
            let n = t.add(
                NodeStats {
                    creation: c,
                    ..Default::default()
                },
                1,
            );
            s.insert(n, &t.stats[n as usize]);
        }
        assert_eq!(drain(&mut s, &mut t), vec![0, 2, 1]);
    }
}
