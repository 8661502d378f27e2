//! Eviction strategies: which evictable leaf goes first.
//!
//! The tree keeps two candidate sets, one per tier, each owned by an [`EvictionStrategy`]:
//!
//! - **device candidates**: device-resident nodes with `lock_ref == 0` and no device-resident
//!   child (SGLang's `evictable_leaves`);
//! - **host candidates**: host-only (evicted) nodes with no children and `host_ref == 0`
//!   (`evictable_host_leaves`, minus the protected nodes SGLang skips at pop time).
//!
//! The tree updates both sets incrementally on every change (lock, insert, split, evict,
//! delete, access); a strategy never scans the tree. Strategies ordered by a key (SGLang's seven:
//! lru, lfu, fifo, mru, filo, priority, slru) share the indexed binary heap of [`heap`], so a
//! change costs O(log n) and an eviction step O(log n), where SGLang rebuilds a heap over all
//! leaves on every call. [`sieve`] and [`s3fifo`] keep ordered queues with a hand and
//! second chances instead.
//!
//! Per-node inputs live in [`NodeStats`], stored in the node. A strategy may keep private state
//! in [`NodeStats::seq`] and [`NodeStats::bits`]. The two tiers hold disjoint node sets (a node
//! is in the device tier while it has device pages and in the host tier while it is host-only),
//! so each tier's strategy instance owns those fields while the node is in its tier.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};

pub mod fifo;
pub mod filo;
pub mod heap;
pub mod lfu;
pub mod lru;
pub mod mru;
pub mod priority;
pub mod s3fifo;
pub mod sieve;
pub mod slru;

/// The per-node inputs of eviction decisions.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Logical time of the last match or insert that walked past the node.
    pub last_access: u64,
    /// Logical time the node was created (split nodes count as new, as in SGLang).
    pub creation: u64,
    /// Strategy-private sequence number (queue position of SIEVE and S3-FIFO).
    pub seq: u64,
    /// Insert-path hits (drives write-through-selective, lfu and slru).
    pub hit_count: u32,
    /// Request priority (max over the requests that shared the node).
    pub priority: i32,
    /// Strategy-private flags (SIEVE visited bit, S3-FIFO queue and frequency).
    pub bits: u8,
}

/// Which tier a strategy instance serves.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Device (L1) residency; candidates are device leaves.
    Device,
    /// Host-only residency; candidates are host-only leaves.
    Host,
}

/// How a strategy reads and updates the stats of nodes while it picks a victim.
pub trait StatsTable {
    /// The stats of a node.
    fn stats(&self, node: u32) -> &NodeStats;
    /// The stats of a node, for update.
    fn stats_mut(&mut self, node: u32) -> &mut NodeStats;
    /// Number of pages of a node.
    fn pages(&self, node: u32) -> u32;
    /// A stable 64-bit fingerprint of the node's position and first page (S3-FIFO's ghost key).
    fn fingerprint(&self, node: u32) -> u64;
}

/// A candidate set with an eviction order. Node ids are arena indices.
///
/// The tree calls `insert`/`remove` when a node starts/stops being a candidate, `update` after
/// changing the stats of a candidate, `touch` on every access (before re-keying), and
/// `admitted`/`departed` when a node enters/leaves the strategy's tier, whether or not it is a
/// candidate. `pop` removes and returns the next victim.
pub trait EvictionStrategy: fmt::Debug + Send + Sync {
    /// Which strategy this is.
    fn kind(&self) -> StrategyKind;
    /// Number of candidates.
    fn len(&self) -> usize;
    /// Whether there are no candidates.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether `node` is a candidate.
    fn contains(&self, node: u32) -> bool;
    /// Makes `node` a candidate.
    fn insert(&mut self, node: u32, stats: &NodeStats);
    /// Removes `node` from the candidates.
    fn remove(&mut self, node: u32, stats: &NodeStats);
    /// Re-orders `node` after its stats changed.
    fn update(&mut self, node: u32, stats: &NodeStats);
    /// Removes and returns the next victim.
    fn pop(&mut self, table: &mut dyn StatsTable) -> Option<u32>;
    /// Records an access in strategy-private stats.
    fn touch(&self, _stats: &mut NodeStats) {}
    /// A node entered the tier.
    fn admitted(&mut self, _stats: &mut NodeStats, _pages: u32, _fingerprint: u64) {}
    /// A node left the tier.
    fn departed(&mut self, _stats: &NodeStats, _pages: u32) {}
    /// Drops every candidate and all strategy state.
    fn clear(&mut self);
    /// The candidates, in no particular order (for invariant checks).
    fn candidates(&self) -> Vec<u32>;
    /// Approximate heap memory held, in bytes.
    fn memory_bytes(&self) -> usize;
}

/// The strategies by name.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum StrategyKind {
    /// Least recently used (SGLang's default).
    #[default]
    #[serde(rename = "lru")]
    Lru,
    /// Least frequently used, ties by recency.
    #[serde(rename = "lfu")]
    Lfu,
    /// Oldest created first.
    #[serde(rename = "fifo")]
    Fifo,
    /// Most recently used first.
    #[serde(rename = "mru")]
    Mru,
    /// Newest created first.
    #[serde(rename = "filo")]
    Filo,
    /// Lowest request priority first, ties by recency.
    #[serde(rename = "priority")]
    Priority,
    /// Segmented LRU: nodes hit fewer than twice go before the others.
    #[serde(rename = "slru")]
    Slru,
    /// S3-FIFO: small probationary FIFO, main FIFO with reinsertion, ghost admission.
    #[serde(rename = "s3-fifo", alias = "s3fifo")]
    S3Fifo,
    /// SIEVE: one FIFO with a hand and visited bits.
    #[serde(rename = "sieve")]
    Sieve,
}

impl StrategyKind {
    /// Every strategy.
    pub const ALL: [StrategyKind; 9] = [
        StrategyKind::Lru,
        StrategyKind::Lfu,
        StrategyKind::Fifo,
        StrategyKind::Mru,
        StrategyKind::Filo,
        StrategyKind::Priority,
        StrategyKind::Slru,
        StrategyKind::S3Fifo,
        StrategyKind::Sieve,
    ];

    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            StrategyKind::Lru => "lru",
            StrategyKind::Lfu => "lfu",
            StrategyKind::Fifo => "fifo",
            StrategyKind::Mru => "mru",
            StrategyKind::Filo => "filo",
            StrategyKind::Priority => "priority",
            StrategyKind::Slru => "slru",
            StrategyKind::S3Fifo => "s3-fifo",
            StrategyKind::Sieve => "sieve",
        }
    }

    /// A fresh, empty strategy instance for one tier.
    pub fn build(self) -> Box<dyn EvictionStrategy> {
        match self {
            StrategyKind::Lru => Box::new(lru::LruStrategy::default()),
            StrategyKind::Lfu => Box::new(lfu::LfuStrategy::default()),
            StrategyKind::Fifo => Box::new(fifo::FifoStrategy::default()),
            StrategyKind::Mru => Box::new(mru::MruStrategy::default()),
            StrategyKind::Filo => Box::new(filo::FiloStrategy::default()),
            StrategyKind::Priority => Box::new(priority::PriorityStrategy::default()),
            StrategyKind::Slru => Box::new(slru::SlruStrategy::default()),
            StrategyKind::S3Fifo => Box::new(s3fifo::S3Fifo::default()),
            StrategyKind::Sieve => Box::new(sieve::Sieve::default()),
        }
    }
}

impl fmt::Display for StrategyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for StrategyKind {
    type Err = CoreError;
    /// Case-insensitive, like SGLang's factory; `s3fifo` is accepted for `s3-fifo`.
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        if lower == "s3fifo" || lower == "s3_fifo" {
            return Ok(StrategyKind::S3Fifo);
        }
        StrategyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == lower)
            .ok_or_else(|| CoreError::InvalidPolicy {
                field: "eviction_policy",
                value: s.to_string(),
                reason: "expected lru, lfu, fifo, mru, filo, priority, slru, s3-fifo or sieve",
            })
    }
}

/// Growable membership bitmap indexed by node id (for the queue-based strategies).
#[derive(Clone, Debug, Default)]
pub(crate) struct Membership(Vec<bool>);

impl Membership {
    pub(crate) fn get(&self, node: u32) -> bool {
        self.0.get(node as usize).copied().unwrap_or(false)
    }
    pub(crate) fn set(&mut self, node: u32, v: bool) {
        let i = node as usize;
        if i >= self.0.len() {
            if !v {
                return;
            }
            self.0.resize(i + 1, false);
        }
        self.0[i] = v;
    }
    pub(crate) fn len(&self) -> usize {
        self.0.capacity()
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! A stats table over a plain vector, for strategy unit tests.
    use super::*;

    #[derive(Default)]
    pub struct VecTable {
        pub stats: Vec<NodeStats>,
        pub pages: Vec<u32>,
        pub fingerprints: Vec<u64>,
    }

    impl VecTable {
        pub fn add(&mut self, s: NodeStats, pages: u32) -> u32 {
            self.stats.push(s);
            self.pages.push(pages);
            self.fingerprints.push(self.fingerprints.len() as u64);
            (self.stats.len() - 1) as u32
        }
    }

    impl StatsTable for VecTable {
        fn stats(&self, node: u32) -> &NodeStats {
            &self.stats[node as usize]
        }
        fn stats_mut(&mut self, node: u32) -> &mut NodeStats {
            &mut self.stats[node as usize]
        }
        fn pages(&self, node: u32) -> u32 {
            self.pages[node as usize]
        }
        fn fingerprint(&self, node: u32) -> u64 {
            self.fingerprints[node as usize]
        }
    }

    /// Pops every candidate, returning the order.
    pub fn drain(s: &mut dyn EvictionStrategy, t: &mut VecTable) -> Vec<u32> {
        let mut out = vec![];
        while let Some(n) = s.pop(t) {
            out.push(n);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_case_insensitively() {
        for k in StrategyKind::ALL {
            assert_eq!(k.as_str().parse::<StrategyKind>().unwrap(), k);
            assert_eq!(
                k.as_str().to_uppercase().parse::<StrategyKind>().unwrap(),
                k
            );
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(serde_json::from_str::<StrategyKind>(&json).unwrap(), k);
            assert_eq!(k.build().kind(), k);
        }
        assert_eq!(
            "s3fifo".parse::<StrategyKind>().unwrap(),
            StrategyKind::S3Fifo
        );
        let e = "arc".parse::<StrategyKind>().unwrap_err();
        assert!(e.to_string().contains("eviction_policy"));
    }
}
