//! Routing as a service: one [`Router`] per model, over that model's registered instances, for
//! the HTTP API's `POST /route`, `POST /finished` and `POST /load`.
//!
//! Invariants:
//! 1. **The candidates are the registrations.** A model's router chooses among the streams
//!    registered for it and not dropped as dead, by stream id (`NAME`, or `NAME/dpR` for a dp
//!    rank), in id order. Before each decision and load report the list is compared with the
//!    registry; when it changed the router is rebuilt ([`Router::with_instances`]) and what it
//!    knew of the instances that stayed (load, outstanding requests, sessions) carries over.
//! 2. **Request ids are the gateway's.** A route without one gets the next id of the service's
//!    own range, from [`AUTO_REQUEST_BASE`] up, returned in the answer for `/finished`.

use crate::router::{
    CostModel, Decision, InstanceInfo, L3Access, Policy, Router, RouterConfig, RouterStats,
};
use crate::table::HolderId;
use serde::Serialize;
use std::time::Duration;

/// First id given to a routed request that came without one.
pub const AUTO_REQUEST_BASE: u64 = 1 << 63;

/// How the service routes (`hicache-index --router …`).
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingConfig {
    /// The policy of every model's router.
    pub policy: Policy,
    /// Longest a decision waits for the index before it falls back to `least-load`.
    pub deadline: Duration,
    /// The `hicache` policy's cost inputs.
    pub cost: CostModel,
    /// Rate at which an instance reads L3 (bytes/s): its shared store's, or its own.
    pub l3_read_bytes_per_s: f64,
}

impl Default for RoutingConfig {
    /// `hicache`, the library's defaults ([`RouterConfig::new`], [`CostModel::default`]), L3
    /// read at 10 GB/s.
    fn default() -> Self {
        let lib = RouterConfig::new(1);
        Self {
            policy: Policy::Hicache,
            deadline: lib.deadline,
            cost: lib.cost,
            l3_read_bytes_per_s: 10e9,
        }
    }
}

/// One candidate: a stream of the model.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Candidate {
    pub(crate) id: String,
    pub(crate) holder: HolderId,
    pub(crate) shared_l3: bool,
}

/// A model's router and the stream id of each of its positions.
#[derive(Debug)]
pub(crate) struct ModelRouter {
    pub(crate) router: Router,
    pub(crate) candidates: Vec<Candidate>,
}

impl ModelRouter {
    fn infos(cfg: &RoutingConfig, candidates: &[Candidate]) -> Vec<InstanceInfo> {
        candidates
            .iter()
            .map(|c| InstanceInfo {
                holder: c.holder,
                l3: if c.shared_l3 {
                    L3Access::Shared(cfg.l3_read_bytes_per_s)
                } else {
                    L3Access::Private(cfg.l3_read_bytes_per_s)
                },
            })
            .collect()
    }

    /// A router over `candidates` (at least one) for pages of `page_size` tokens.
    pub(crate) fn new(cfg: &RoutingConfig, page_size: u32, candidates: Vec<Candidate>) -> Self {
        let mut rc = RouterConfig::new(page_size as usize);
        rc.deadline = cfg.deadline;
        rc.cost = cfg.cost;
        Self {
            router: Router::new(cfg.policy, Self::infos(cfg, &candidates), rc),
            candidates,
        }
    }

    /// Brings the candidates up to `now` (invariant 1).
    pub(crate) fn update(&mut self, cfg: &RoutingConfig, now: Vec<Candidate>) {
        if now == self.candidates {
            return;
        }
        let old = &self.candidates;
        let map: Vec<Option<usize>> = old
            .iter()
            .map(|c| now.iter().position(|n| n == c))
            .collect();
        self.router = self
            .router
            .with_instances(Self::infos(cfg, &now), |i| map[i]);
        self.candidates = now;
    }

    /// The position of stream `id`.
    pub(crate) fn position(&self, id: &str) -> Option<usize> {
        self.candidates.iter().position(|c| c.id == id)
    }
}

/// Tokens of the prompt the chosen instance holds, per tier (cumulative through the faster).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OverlapTokens {
    /// Leading tokens in L1.
    pub l1: u64,
    /// Leading tokens in L1 or L2.
    pub l2: u64,
    /// Leading tokens in L1, L2 or the L3 the instance reads.
    pub l3: u64,
}

/// `POST /route`'s answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RouteAnswer {
    /// The chosen instance's stream id.
    pub instance: String,
    /// The request's id (the gateway's, or the one the service gave it): name it in
    /// `POST /finished`.
    pub request: u64,
    /// The configured policy.
    pub policy: &'static str,
    /// Whether the index was lost or slow and `least-load` decided instead.
    pub fallback: bool,
    /// The overlap the router credited on the chosen instance (zero for blind policies and
    /// fallbacks).
    pub overlap: OverlapTokens,
    /// The `hicache` policy's expected time to first token there (absent for other policies
    /// and fallbacks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected_ttft_ms: Option<f64>,
}

impl RouteAnswer {
    pub(crate) fn new(policy: Policy, request: u64, instance: String, d: &Decision) -> Self {
        Self {
            instance,
            request,
            policy: policy.name(),
            fallback: d.fallback,
            overlap: OverlapTokens {
                l1: d.overlap.l1 as u64,
                l2: d.overlap.l2 as u64,
                l3: d.overlap.l3 as u64,
            },
            expected_ttft_ms: (policy == Policy::Hicache && !d.fallback).then_some(d.score * 1e3),
        }
    }
}

/// Why a decision fell back, from the router's counters before and after it.
pub(crate) fn fallback_reason(before: RouterStats, after: RouterStats) -> Option<&'static str> {
    if after.fallback_down > before.fallback_down {
        Some("down")
    } else if after.fallback_slow > before.fallback_slow {
        Some("slow")
    } else {
        None
    }
}
