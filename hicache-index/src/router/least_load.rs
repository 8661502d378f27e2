//! `least-load`: the instance with the fewest requests in flight (then the fewest prompt tokens
//! still to compute, then the lowest index), blind to the cache. Also the policy every other
//! one falls back to when the index is lost.

use super::load::LoadTracker;

/// The least-loaded instance ([`LoadTracker::least_loaded`]).
pub fn pick(load: &LoadTracker) -> usize {
    load.least_loaded()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_instance_with_fewest_requests_wins_then_fewest_tokens() {
        let mut t = LoadTracker::new(3);
        t.routed(1, 0, 10, 10);
        t.routed(2, 1, 500, 500);
        t.routed(3, 2, 20, 20);
        // All have one request: fewest queued tokens wins.
        assert_eq!(pick(&t), 0);
        t.routed(4, 0, 10, 10);
        assert_eq!(pick(&t), 2);
    }
}
