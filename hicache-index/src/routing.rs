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
//! 3. **Restarts keep the routing.** The snapshot holds each model's [`RouterState`] with the
//!    stream id of every position ([`SavedRouting`]); restored, the state is mapped onto the
//!    restored streams by id (a stream no longer registered loses its part), the auto ids go
//!    on past the saved one, and the routers decide as before the restart.

use crate::router::{
    CostModel, Decision, InstanceInfo, L3Access, Policy, Router, RouterConfig, RouterState,
    RouterStats,
};
use crate::service::Service;
use crate::table::HolderId;
use serde::{Deserialize, Serialize};
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
    pub(crate) kv_capacity_tokens: Option<u64>,
    pub(crate) l3_prefetch_threshold_tokens: Option<u64>,
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
                kv_capacity_tokens: c.kv_capacity_tokens,
                l3_prefetch_threshold_tokens: c.l3_prefetch_threshold_tokens,
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

/// One model's router as a snapshot keeps it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedRouter {
    /// The model.
    pub model: String,
    /// The stream id of each of the router's positions.
    pub candidates: Vec<String>,
    /// The router's state, by position.
    pub state: RouterState,
}

/// The service's routing state in a snapshot (invariant 3).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedRouting {
    /// Every model's router.
    pub routers: Vec<SavedRouter>,
    /// The next id the service gives a request that came without one (0: none given yet).
    pub next_auto_request: u64,
}

impl Service {
    /// The routing state to keep across a restart.
    pub(crate) fn routing_state(&self) -> SavedRouting {
        SavedRouting {
            routers: self
                .routers
                .iter()
                .map(|(model, r)| SavedRouter {
                    model: model.clone(),
                    candidates: r.candidates.iter().map(|c| c.id.clone()).collect(),
                    state: r.router.state(),
                })
                .collect(),
            next_auto_request: self.next_auto_request,
        }
    }

    /// Takes over `saved` once the streams are restored (invariant 3): each saved router is
    /// rebuilt over its model's live streams and given the state of the streams that are
    /// still there; a model with no live stream gets none.
    pub(crate) fn restore_routing(&mut self, saved: SavedRouting) {
        self.next_auto_request = self
            .next_auto_request
            .max(saved.next_auto_request)
            .max(AUTO_REQUEST_BASE);
        for s in saved.routers {
            let Some(page_size) = self.models.get(&s.model).map(|m| m.page_size) else {
                continue;
            };
            let now = self.candidates(&s.model);
            if now.is_empty() {
                continue;
            }
            let mut r = ModelRouter::new(&self.cfg.routing, page_size, now);
            let map: Vec<Option<usize>> = s.candidates.iter().map(|id| r.position(id)).collect();
            r.router
                .restore_state(&s.state, |i| map.get(i).copied().flatten());
            self.routers.insert(s.model, r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::WireFormat;
    use crate::registry::Registration;
    use crate::service::ServiceConfig;
    use crate::snapshot;

    fn service(policy: Policy) -> Service {
        let mut svc = Service::new(ServiceConfig {
            routing: RoutingConfig {
                policy,
                // A loaded test machine must not turn a decision into a fallback.
                deadline: Duration::from_secs(60),
                ..RoutingConfig::default()
            },
            ..ServiceConfig::default()
        });
        for i in 0..3 {
            svc.register(
                Registration {
                    instance: format!("i{i}"),
                    endpoint: "tcp://127.0.0.1:1".into(),
                    replay_endpoint: None,
                    topic: None,
                    format: WireFormat::Sglang,
                    model: "m".into(),
                    page_size: 4,
                    dp_rank: None,
                    l3_store: None,
                    kv_capacity_tokens: None,
                    l3_prefetch_threshold_tokens: None,
                },
                0,
            )
            .unwrap();
        }
        svc
    }

    fn prompt(k: u32) -> Vec<u32> {
        (0..8 + 4 * (k % 5)).map(|t| t + 1000 * k).collect()
    }

    /// Invariant 3: a service restored from a snapshot routes the next requests as the one
    /// that wrote it (its load, outstanding requests, sessions and auto ids), where a fresh
    /// service would not.
    #[test]
    fn routing_state_survives_a_snapshot_restart() {
        for policy in [Policy::LeastLoad, Policy::Hicache, Policy::RoundRobin] {
            let mut a = service(policy);
            for k in 0..10u32 {
                let id = (k != 4).then_some(u64::from(k));
                a.route("m", &prompt(k), id, Some(u64::from(k % 3)))
                    .unwrap();
            }
            a.finished(2);
            let bytes = snapshot::encode(&a);
            let mut b = Service::new(a.config().clone());
            snapshot::restore(&mut b, std::path::Path::new("mem"), &bytes, 0).unwrap();
            let mut fresh = service(policy);
            let mut differs = false;
            for k in 10..30u32 {
                let (p, id, s) = (prompt(k), Some(u64::from(k)), Some(u64::from(k % 4)));
                let x = a.route("m", &p, id, s).unwrap();
                let y = b.route("m", &p, id, s).unwrap();
                assert_eq!(
                    (&x.instance, x.request),
                    (&y.instance, y.request),
                    "{policy}"
                );
                differs |= fresh.route("m", &p, id, s).unwrap().instance != x.instance;
                let done = u64::from(k - 10);
                assert_eq!(a.finished(done), b.finished(done), "{policy}: {done}");
            }
            assert!(
                differs,
                "{policy}: the test must tell a restored router from a fresh one"
            );
            let auto = a.route("m", &prompt(1), None, None).unwrap();
            let auto_b = b.route("m", &prompt(1), None, None).unwrap();
            assert_eq!(auto.request, auto_b.request);
            assert_eq!(auto.request, AUTO_REQUEST_BASE + 1);
        }
    }
}
