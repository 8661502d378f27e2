//! `slru`: segmented LRU. Nodes hit fewer than twice (probationary) go before nodes hit at
//! least twice (protected), each segment in LRU order (key `(hit_count >= 2, last_access)`).

use super::heap::{KeyFn, KeyedHeap};
use super::{NodeStats, StrategyKind};

/// Hits from which a node is in the protected segment (SGLang: 2).
pub const PROTECTED_HITS: u32 = 2;

/// Key of [`SlruStrategy`].
#[derive(Debug)]
pub struct Slru;

impl KeyFn for Slru {
    const KIND: StrategyKind = StrategyKind::Slru;
    fn key(s: &NodeStats) -> (u64, u64) {
        (u64::from(s.hit_count >= PROTECTED_HITS), s.last_access)
    }
}

/// Probationary nodes first, then protected ones, each by recency.
pub type SlruStrategy = KeyedHeap<Slru>;

#[cfg(test)]
mod tests {
    use super::super::EvictionStrategy;
    use super::super::testing::{VecTable, drain};
    use super::*;

    #[test]
    fn probationary_segment_goes_first() {
        let mut t = VecTable::default();
        let mut s = SlruStrategy::default();
        for (h, a) in [(5u32, 1u64), (1, 9), (2, 0), (0, 4)] {
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
        assert_eq!(drain(&mut s, &mut t), vec![3, 1, 2, 0]);
    }
}
