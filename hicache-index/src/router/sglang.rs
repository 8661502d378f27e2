//! `sglang-cache-aware`: SGLang's cache-aware router (sgl-router / SMG), on token pages.
//!
//! Its documented rules, in our words (reference: SGLang router docs, `cache_aware` policy):
//! the router keeps, per worker, an *approximate* tree of the prompts it routed there (it sees
//! no KV event: a prefix counts as cached on a worker once a request carrying it went there,
//! until the tree evicts it). For each request, with `load` = requests in flight per worker:
//!
//! 1. if `max_load − min_load > balance_abs_threshold` (32) **and**
//!    `max_load > balance_rel_threshold · min_load` (1.5), the load is unbalanced: the
//!    least-loaded worker;
//! 2. else, if the best match ratio (matched prefix / prompt length) exceeds
//!    `cache_threshold` (0.5): the worker with that best match;
//! 3. else the least-loaded worker.
//!
//! The request's prefix is then added to the chosen worker's tree. SGLang matches characters
//! of the text; here the unit is a page of tokens (the index's chain), so a match is a leading
//! run of whole pages. The tree is bounded (`max_tree_blocks` per worker, least recently
//! routed first out), as SGLang's is by `max_tree_size`.

use std::collections::{HashMap, VecDeque};

use super::load::LoadTracker;
use crate::chain::BlockHash;

/// The cache-aware policy's parameters (SGLang's defaults).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct SglangConfig {
    /// Match ratio above which the best-matching worker wins (0.5).
    pub cache_threshold: f64,
    /// Absolute load gap beyond which the load counts as unbalanced (32 requests).
    pub balance_abs_threshold: f64,
    /// Relative load gap beyond which the load counts as unbalanced (1.5×).
    pub balance_rel_threshold: f64,
    /// Blocks each worker's approximate tree keeps.
    pub max_tree_blocks: usize,
}

impl Default for SglangConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.5,
            balance_abs_threshold: 32.0,
            balance_rel_threshold: 1.5,
            max_tree_blocks: 1 << 20,
        }
    }
}

/// One worker's approximate tree: the blocks routed there, aged.
#[derive(Clone, Debug, Default)]
struct Approx {
    stamp: HashMap<BlockHash, u64>,
    order: VecDeque<(BlockHash, u64)>,
}

impl Approx {
    fn matched(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.stamp.contains_key(*h))
            .count()
    }

    fn insert(&mut self, hashes: &[BlockHash], clock: &mut u64, cap: usize) {
        for &h in hashes {
            *clock += 1;
            self.stamp.insert(h, *clock);
            self.order.push_back((h, *clock));
        }
        while self.stamp.len() > cap {
            let Some((h, s)) = self.order.pop_front() else {
                break;
            };
            if self.stamp.get(&h) == Some(&s) {
                self.stamp.remove(&h);
            }
        }
        // Stale entries (blocks touched again later) are dropped when the queue outgrows the
        // live set, so the queue stays within twice the tree.
        if self.order.len() > 2 * self.stamp.len().max(16) {
            let stamp = &self.stamp;
            self.order.retain(|(h, s)| stamp.get(h) == Some(s));
        }
    }
}

/// SGLang's cache-aware router state.
#[derive(Clone, Debug)]
pub struct SglangCacheAware {
    config: SglangConfig,
    trees: Vec<Approx>,
    clock: u64,
}

/// Why the cache-aware policy chose its worker (for tests and counters).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SglangRule {
    /// Rule 1: unbalanced load, shortest queue.
    Balance,
    /// Rule 2: best match above the threshold.
    Cache,
    /// Rule 3: no match good enough, least loaded.
    LeastLoad,
}

impl SglangCacheAware {
    /// State for `instances` workers.
    pub fn new(instances: usize, config: SglangConfig) -> Self {
        Self {
            config,
            trees: vec![Approx::default(); instances],
            clock: 0,
        }
    }

    /// Chooses a worker for a prompt of `prompt_tokens` tokens whose whole pages hash to
    /// `hashes` (pages of `page_size` tokens), and records the prompt in its tree.
    pub fn pick(
        &mut self,
        hashes: &[BlockHash],
        prompt_tokens: usize,
        page_size: usize,
        load: &LoadTracker,
    ) -> (usize, SglangRule, usize) {
        let n = self.trees.len();
        let loads: Vec<f64> = (0..n).map(|i| load.load(i).requests).collect();
        let max = loads.iter().copied().fold(0.0, f64::max);
        let min = loads.iter().copied().fold(f64::INFINITY, f64::min);
        let c = &self.config;
        let (pick, rule) =
            if max - min > c.balance_abs_threshold && max > c.balance_rel_threshold * min {
                (load.least_loaded(), SglangRule::Balance)
            } else {
                let matched: Vec<usize> = self.trees.iter().map(|t| t.matched(hashes)).collect();
                let best = (0..n)
                    .max_by(|&a, &b| {
                        matched[a]
                            .cmp(&matched[b])
                            .then(loads[b].total_cmp(&loads[a]))
                            .then(b.cmp(&a))
                    })
                    .unwrap_or(0);
                let ratio = (matched[best] * page_size) as f64 / prompt_tokens.max(1) as f64;
                if ratio > c.cache_threshold {
                    (best, SglangRule::Cache)
                } else {
                    (load.least_loaded(), SglangRule::LeastLoad)
                }
            };
        let matched = self.trees[pick].matched(hashes);
        self.trees[pick].insert(hashes, &mut self.clock, c.max_tree_blocks);
        (pick, rule, matched)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worked example of the documented rules: worker 0 was sent a 4-page prompt; a
    /// 5-page request sharing 3 of its pages matches 3/5 = 0.6 > 0.5 there; one sharing 2
    /// pages (0.4) goes to the least-loaded worker; with 40 requests on worker 0 and 2 on
    /// worker 1 (gap 38 > 32, 40 > 1.5 × 2) the balance rule wins over a full match.
    #[test]
    fn worked_example_of_the_documented_rules() {
        let mut s = SglangCacheAware::new(2, SglangConfig::default());
        let mut load = LoadTracker::new(2);
        let (w, rule, _) = s.pick(&[1, 2, 3, 4], 4, 1, &load);
        assert_eq!((w, rule), (0, SglangRule::LeastLoad));
        load.routed(100, 0, 4, 4);
        let (w, rule, m) = s.pick(&[1, 2, 3, 9, 9], 5, 1, &load);
        assert_eq!((w, rule, m), (0, SglangRule::Cache, 3));
        let (w, rule, _) = s.pick(&[1, 2, 7, 7, 7], 5, 1, &load);
        assert_eq!((w, rule), (1, SglangRule::LeastLoad));
        for r in 0..40 {
            load.routed(1000 + r, 0, 1, 1);
        }
        load.routed(2000, 1, 1, 1);
        let (w, rule, _) = s.pick(&[1, 2, 3, 4], 4, 1, &load);
        assert_eq!((w, rule), (1, SglangRule::Balance));
    }

    #[test]
    fn the_approximate_tree_is_bounded() {
        let mut a = Approx::default();
        let mut clock = 0;
        a.insert(&[1, 2, 3], &mut clock, 2);
        assert_eq!(a.stamp.len(), 2);
        assert_eq!(a.matched(&[1, 2, 3]), 0);
        assert_eq!(a.matched(&[2, 3]), 2);
    }
}
