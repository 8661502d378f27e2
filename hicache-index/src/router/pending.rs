//! Prefixes on their way into an instance's cache: the blocks of the prompts routed to it and
//! not finished. The index knows what is stored; a prompt routed a moment ago is not stored
//! yet, but it will be by the time a later request queued behind it on the same instance
//! runs (engines serve their queue first come, first served). Under load, when the next turn
//! of a conversation arrives before the previous one ran, only this record sees the prefix
//! they share.
//!
//! Invariant: an instance's set holds exactly the blocks of the requests recorded for it and
//! not yet finished, each counted once per such request (a block shared by two in-flight
//! prompts stays until both finished).

use std::collections::HashMap;

use crate::chain::BlockHash;

/// In-flight prompt blocks per instance.
#[derive(Clone, Debug, Default)]
pub struct Pending {
    per_instance: Vec<HashMap<BlockHash, u32>>,
    requests: HashMap<u64, (usize, Vec<BlockHash>)>,
}

impl Pending {
    /// Nothing in flight on `instances` instances.
    pub fn new(instances: usize) -> Self {
        Self {
            per_instance: vec![HashMap::new(); instances],
            requests: HashMap::new(),
        }
    }

    /// Leading blocks of `hashes` that a prompt in flight on `instance` carries.
    pub fn matched(&self, instance: usize, hashes: &[BlockHash]) -> usize {
        let Some(set) = self.per_instance.get(instance).filter(|s| !s.is_empty()) else {
            return 0;
        };
        hashes.iter().take_while(|h| set.contains_key(*h)).count()
    }

    /// `request` with the blocks `hashes` went to `instance` (a request recorded again
    /// replaces its earlier record).
    pub fn routed(&mut self, request: u64, instance: usize, hashes: &[BlockHash]) {
        self.finished(request);
        let Some(set) = self.per_instance.get_mut(instance) else {
            return;
        };
        for &h in hashes {
            *set.entry(h).or_insert(0) += 1;
        }
        self.requests.insert(request, (instance, hashes.to_vec()));
    }

    /// Every request in flight: id, instance, blocks (by request id).
    pub fn state(&self) -> Vec<(u64, usize, Vec<BlockHash>)> {
        let mut v: Vec<_> = self
            .requests
            .iter()
            .map(|(&r, (i, h))| (r, *i, h.clone()))
            .collect();
        v.sort_unstable_by_key(|e| e.0);
        v
    }

    /// `request` finished: its blocks leave its instance's set.
    pub fn finished(&mut self, request: u64) {
        let Some((i, hashes)) = self.requests.remove(&request) else {
            return;
        };
        let set = &mut self.per_instance[i];
        for h in hashes {
            if let Some(n) = set.get_mut(&h) {
                *n -= 1;
                if *n == 0 {
                    set.remove(&h);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_blocks_count_until_their_last_request_finishes() {
        let mut p = Pending::new(2);
        p.routed(1, 0, &[10, 11, 12]);
        p.routed(2, 0, &[10, 11, 20]);
        assert_eq!(p.matched(0, &[10, 11, 12, 13]), 3);
        assert_eq!(p.matched(1, &[10, 11, 12, 13]), 0);
        p.finished(1);
        assert_eq!(p.matched(0, &[10, 11, 12, 13]), 2);
        p.finished(2);
        p.finished(2);
        assert_eq!(p.matched(0, &[10]), 0);
        assert!(p.per_instance[0].is_empty());
    }
}
