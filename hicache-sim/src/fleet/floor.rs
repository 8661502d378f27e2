//! The no-queue floor of a fleet run: what each request's time to first token would be if it
//! ran alone on an idle instance that held, in L1, every page any earlier prompt of the run
//! carried. Only its own compute is left (`ComputeModel::prefill_compute` of the pages no
//! earlier prompt had), no queueing, no load from L2 or L3, no decode beside it. The simulated
//! engines reuse only pages of earlier prompts (a prompt's L3 prefetch starts at its arrival;
//! an instance admits in arrival order), with one exception: a request whose own L3 prefetch
//! is still running can be overtaken on its instance and then reuse the later prompt's pages,
//! having waited for its prefetch meanwhile. So a mean TTFT target below the floor is out of
//! reach for any placement, and the distance to it is what routing can still win.
//!
//! Invariants: a prompt is matched at page granularity and up to its last token, which the
//! engine always computes (at most `(n − 1) / page` pages); pages are identified by the chain
//! of their tokens and every earlier page (two prompts share a page only where they share the
//! whole prefix up to it, as the radix tree and the fleet index see it).

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};

use crate::model::ComputeModel;

/// Prompts seen so far and each request's floor, in arrival order.
#[derive(Debug)]
pub struct Floor {
    page: usize,
    seen: HashSet<u64>,
    ttft_s: Vec<f64>,
}

impl Floor {
    /// An empty floor for pages of `page_size` tokens (at least 1).
    pub fn new(page_size: usize) -> Self {
        Self {
            page: page_size.max(1),
            seen: HashSet::new(),
            ttft_s: Vec::new(),
        }
    }

    /// A request with `tokens` arrives: returns its floor (s) and remembers its pages.
    pub fn arrive(&mut self, tokens: &[u32], compute: &ComputeModel) -> f64 {
        let n = tokens.len();
        let reusable = n.saturating_sub(1) / self.page;
        let mut chain = 0u64;
        let mut cached_pages = 0;
        let mut matching = true;
        for (i, page) in tokens.chunks_exact(self.page).enumerate() {
            let mut h = DefaultHasher::new();
            (chain, page).hash(&mut h);
            chain = h.finish();
            if matching && i < reusable && self.seen.contains(&chain) {
                cached_pages += 1;
            } else {
                matching = false;
            }
            self.seen.insert(chain);
        }
        let cached = cached_pages * self.page;
        let t = compute.prefill_compute(cached, n - cached);
        self.ttft_s.push(t);
        t
    }

    /// Each request's floor (s), in arrival order.
    pub fn ttft_s(&self) -> &[f64] {
        &self.ttft_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelShape;

    /// A model costing `per_token` s per computed token and `per_pair` s per attention pair.
    fn model(per_token: f64, per_pair: f64) -> ComputeModel {
        ComputeModel {
            prefill_s_per_token: per_token,
            attention_s_per_pair: per_pair,
            window_attention_s_per_pair: 0.0,
            attention_window: 0,
            ..ComputeModel::h100(&ModelShape::llama3_8b())
        }
    }

    /// Pages of 4 tokens at 1 s per computed token. The first prompt computes all 10 tokens;
    /// a second sharing its first 8 tokens reuses both full pages (2 left); one equal to the
    /// first reuses only the pages before its last token (8 of 10: 2 left); one whose first
    /// page differs reuses nothing, even where later tokens agree; a prompt of exactly two
    /// pages reuses one (its last token is always computed).
    #[test]
    fn the_floor_computes_what_no_earlier_prompt_carried() {
        let m = model(1.0, 0.0);
        let mut f = Floor::new(4);
        let a: Vec<u32> = (0..10).collect();
        assert_eq!(f.arrive(&a, &m), 10.0);
        let mut b = a[..8].to_vec();
        b.extend([100, 101]);
        assert_eq!(f.arrive(&b, &m), 2.0);
        assert_eq!(f.arrive(&a, &m), 2.0);
        let mut c = a.clone();
        c[0] = 99;
        assert_eq!(f.arrive(&c, &m), 10.0);
        assert_eq!(f.arrive(&a[..8], &m), 4.0);
        assert_eq!(f.ttft_s(), &[10.0, 2.0, 2.0, 10.0, 4.0]);
    }

    /// With attention, a reused prefix still costs the new tokens' pairs with it.
    #[test]
    fn the_floor_charges_attention_over_the_cached_prefix() {
        let m = model(0.0, 1.0);
        let mut f = Floor::new(2);
        let a: Vec<u32> = (0..4).collect();
        // 4 new tokens: 4·5/2 = 10 pairs.
        assert_eq!(f.arrive(&a, &m), 10.0);
        // 2 cached, 2 new: 2·2 + 2·3/2 = 7 pairs.
        assert_eq!(f.arrive(&a, &m), 7.0);
    }
}
