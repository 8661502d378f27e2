//! Routing a fleet: which instance serves a request, from the index's exact per-tier overlap
//! and each instance's load.
//!
//! A gateway links a [`Router`] (or the service's `POST /route` calls it) and, per request,
//! calls [`Router::route`] with the index and a [`RouteRequest`]; it tells the router when the
//! request finished ([`Router::finished`]) and passes on load reports
//! ([`Router::report_load`]). Policies, one module each:
//!
//! | policy | module | uses |
//! |---|---|---|
//! | `round-robin` | [`round_robin`] | nothing |
//! | `least-load` | [`least_load`] | load |
//! | `sglang-cache-aware` | [`sglang`] | its own approximate tree of routed prompts, load |
//! | `dynamo-linear` | [`dynamo`] | index overlap per tier, prefill and decode load |
//! | `hicache` | [`hicache`] | index overlap per tier, tier and store rates, load, sessions |
//!
//! Rules (normative):
//! 1. `route` never fails: when the index is lost ([`OverlapSource::overlaps`] errs: down) or
//!    answers later than [`RouterConfig::deadline`] (slow), the decision is `least-load`'s,
//!    counted in [`RouterStats::fallback_down`] / [`RouterStats::fallback_slow`].
//! 2. Every decision is recorded as load ([`load`]): the prompt tokens to compute (the prompt
//!    minus the overlap credited on the chosen instance) until the request finishes.
//! 3. Hybrid models ([`hybrid`]): with [`ReuseRule::Hybrid`], an instance's overlap counts
//!    only up to where every component is resident ([`Components::cap`], from the components
//!    the overlap source tracks: [`OverlapSource::components`]); none tracked, no credit.
//! 4. With [`RouterConfig::credit_in_flight`], `hicache` also credits prefixes in flight
//!    ([`pending`]): the leading blocks of a prompt routed to an instance and not finished
//!    count as L1 overlap there (dense models only: a hybrid prefix is reusable only at ends
//!    the engine reports).

pub mod dynamo;
pub mod hicache;
pub mod hybrid;
pub mod least_load;
pub mod load;
pub mod pending;
pub mod round_robin;
pub mod sglang;
pub mod state;

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::chain::{BlockHash, ChainHasher};
use crate::table::{Answer, HolderId, Index, Tier};

pub use dynamo::{DynamoConfig, TierBlocks};
pub use hicache::{Busy, CostModel, Expected, Overlap};
pub use hybrid::{ComponentCounts, Components, HybridModel, ReuseRule};
pub use load::{InstanceLoad, LoadReport, LoadTracker};
pub use sglang::{SglangConfig, SglangRule};
pub use state::{RoutedState, RouterState, SessionState, SlotState};

/// A routing policy.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Instances in turn.
    RoundRobin,
    /// Fewest requests in flight.
    LeastLoad,
    /// SGLang's cache-aware router (approximate tree, its thresholds).
    SglangCacheAware,
    /// Dynamo's linear cost with its default weights.
    DynamoLinear,
    /// Expected TTFT from the exact per-tier overlap and the tiers' real costs.
    Hicache,
}

impl Policy {
    /// Every policy, anchors first.
    pub const ALL: [Policy; 5] = [
        Policy::RoundRobin,
        Policy::LeastLoad,
        Policy::SglangCacheAware,
        Policy::DynamoLinear,
        Policy::Hicache,
    ];

    /// The policy's name (`round-robin`, `least-load`, `sglang-cache-aware`,
    /// `dynamo-linear`, `hicache`).
    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::LeastLoad => "least-load",
            Policy::SglangCacheAware => "sglang-cache-aware",
            Policy::DynamoLinear => "dynamo-linear",
            Policy::Hicache => "hicache",
        }
    }

    /// Whether the policy queries the index.
    pub fn uses_index(self) -> bool {
        matches!(self, Policy::DynamoLinear | Policy::Hicache)
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).collect();
                format!("unknown router policy {s:?}; one of {}", names.join(", "))
            })
    }
}

/// The index is lost: the overlap source did not answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("index unavailable: {0}")]
pub struct IndexUnavailable(pub String);

/// Where the router reads overlaps: the in-process [`Index`], or a remote one (a client of
/// the service's `POST /query`), which may be down.
pub trait OverlapSource {
    /// The instances holding a prefix of `hashes`, as [`Index::query`] answers (a remote
    /// source fills `out` with [`Answer::clear`] and [`Answer::push`]).
    fn overlaps(&self, hashes: &[BlockHash], out: &mut Answer) -> Result<(), IndexUnavailable>;

    /// The hybrid components' residency the source keeps beside the index, if any: with
    /// [`ReuseRule::Hybrid`] the router caps every instance's overlap with it, and credits
    /// nothing without it.
    fn components(&self) -> Option<&Components> {
        None
    }
}

/// An in-process index and the component residency of its hybrid model (what the service
/// passes its router).
#[derive(Copy, Clone, Debug)]
pub struct WithComponents<'a> {
    /// The index.
    pub index: &'a Index,
    /// The components.
    pub components: &'a Components,
}

impl OverlapSource for WithComponents<'_> {
    fn overlaps(&self, hashes: &[BlockHash], out: &mut Answer) -> Result<(), IndexUnavailable> {
        self.index.query(hashes, out);
        Ok(())
    }

    fn components(&self) -> Option<&Components> {
        Some(self.components)
    }
}

impl OverlapSource for Index {
    fn overlaps(&self, hashes: &[BlockHash], out: &mut Answer) -> Result<(), IndexUnavailable> {
        self.query(hashes, out);
        Ok(())
    }
}

/// How an instance reads L3.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum L3Access {
    /// No L3.
    None,
    /// Its own store (Dynamo's "disk" tier), read at this rate (bytes/s).
    Private(f64),
    /// A store shared with other instances (Dynamo's "shared pool"), read at this rate.
    Shared(f64),
}

impl L3Access {
    fn read_rate(self) -> f64 {
        match self {
            L3Access::None => 1.0,
            L3Access::Private(r) | L3Access::Shared(r) => r,
        }
    }
}

/// One instance the router may choose.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct InstanceInfo {
    /// Its holder in the index.
    pub holder: HolderId,
    /// How it reads L3.
    pub l3: L3Access,
    /// KV tokens its device memory holds (SGLang's `max_total_num_tokens`), when known: the
    /// `hicache` policy's memory term ([`CostModel`]).
    pub kv_capacity_tokens: Option<u64>,
    /// Its L3 prefetch threshold in tokens: an L3 run shorter than this past its L1 and L2
    /// overlap is never fetched by the engine, so it earns no credit. None: every L3 hit.
    pub l3_prefetch_threshold_tokens: Option<u64>,
}

/// The router's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// Tokens per page of the model (the index's page size).
    pub page_size: usize,
    /// Longest the router waits for the index before it falls back to `least-load` (a few
    /// ms; 5 ms by default).
    pub deadline: Duration,
    /// Whether prefixes are reusable page by page (dense) or only where every component is
    /// (hybrid).
    pub reuse: ReuseRule,
    /// The `hicache` policy's cost inputs.
    pub cost: CostModel,
    /// The `dynamo-linear` policy's weights.
    pub dynamo: DynamoConfig,
    /// The `sglang-cache-aware` policy's thresholds.
    pub sglang: SglangConfig,
    /// Sessions remembered for the tie-break (oldest forgotten first).
    pub max_sessions: usize,
    /// `hicache` credits prefixes in flight (rule 4; off by default: it helps an overloaded
    /// fleet and herds a lightly loaded one onto the first instance that saw a shared prefix).
    pub credit_in_flight: bool,
}

impl RouterConfig {
    /// Defaults for pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        Self {
            page_size: page_size.max(1),
            deadline: Duration::from_millis(5),
            reuse: ReuseRule::Dense,
            cost: CostModel::default(),
            dynamo: DynamoConfig::default(),
            sglang: SglangConfig::default(),
            max_sessions: 1 << 16,
            credit_in_flight: false,
        }
    }
}

/// One request to place.
#[derive(Copy, Clone, Debug)]
pub struct RouteRequest<'a> {
    /// The gateway's id of the request (what [`Router::finished`] names later).
    pub request: u64,
    /// The prompt's tokens.
    pub tokens: &'a [u32],
    /// The conversation the request continues, if the gateway knows it.
    pub session: Option<u64>,
    /// The LoRA adapter, if any (chains are per adapter).
    pub lora: Option<i64>,
}

/// Where a request goes, and why.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Decision {
    /// Position of the instance in the router's list.
    pub instance: usize,
    /// Its holder in the index.
    pub holder: HolderId,
    /// The overlap the router credited there (tokens; zero for blind policies).
    pub overlap: Overlap,
    /// The policy's figure for the chosen instance (`dynamo-linear`: its cost; `hicache`: the
    /// expected TTFT in s, without the delay imposed on others; 0 for blind ones).
    pub score: f64,
    /// Whether the index was lost and `least-load` decided.
    pub fallback: bool,
}

/// What the router did, counted.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct RouterStats {
    /// Decisions made.
    pub decisions: u64,
    /// Index queries made.
    pub index_queries: u64,
    /// Total time of those queries (ns).
    pub index_query_ns: u64,
    /// Decisions that fell back because the index was down.
    pub fallback_down: u64,
    /// Decisions that fell back because the index answered past the deadline.
    pub fallback_slow: u64,
    /// Decisions the session tie-break kept on the session's instance.
    pub session_kept: u64,
}

/// A fleet router: one policy over a fixed list of instances.
#[derive(Debug)]
pub struct Router {
    policy: Policy,
    config: RouterConfig,
    instances: Vec<InstanceInfo>,
    load: LoadTracker,
    pending: pending::Pending,
    rr: round_robin::RoundRobin,
    sglang: sglang::SglangCacheAware,
    sessions: HashMap<u64, (usize, u64)>,
    session_clock: u64,
    stats: RouterStats,
    hashes: Vec<BlockHash>,
    matches: Answer,
    overlaps: Vec<Overlap>,
}

impl Router {
    /// A router with `policy` over `instances` (at least one).
    pub fn new(policy: Policy, instances: Vec<InstanceInfo>, config: RouterConfig) -> Self {
        let n = instances.len();
        Self {
            load: LoadTracker::new(n),
            pending: pending::Pending::new(n),
            rr: round_robin::RoundRobin::default(),
            sglang: sglang::SglangCacheAware::new(n, config.sglang),
            sessions: HashMap::new(),
            session_clock: 0,
            stats: RouterStats::default(),
            hashes: Vec::new(),
            matches: Answer::new(),
            overlaps: vec![Overlap::default(); n],
            policy,
            config,
            instances,
        }
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The instances, in decision order.
    pub fn instances(&self) -> &[InstanceInfo] {
        &self.instances
    }

    /// What the router did.
    pub fn stats(&self) -> RouterStats {
        self.stats
    }

    /// The load the router sees on each instance.
    pub fn load(&self) -> &LoadTracker {
        &self.load
    }

    /// Sets the reuse rule (the service switches a model to [`ReuseRule::Hybrid`] once its
    /// engines declare a component).
    pub fn set_reuse(&mut self, reuse: ReuseRule) {
        self.config.reuse = reuse;
    }

    /// `request` finished: its load is released. Returns the position of the instance it had
    /// gone to; unknown requests are ignored (`None`).
    pub fn finished(&mut self, request: u64) -> Option<usize> {
        self.pending.finished(request);
        self.load.finished(request)
    }

    /// The same router over a new list of instances (a fleet that changed): `map` gives each
    /// current instance's position in `instances` (`None`: it left). What the router knows of
    /// the instances that stay — their load, outstanding requests, sessions — and its counters
    /// carry over; the turn of `round-robin` continues; `sglang-cache-aware`'s approximate
    /// tree restarts empty (hybrid components live with the overlap source, not here).
    pub fn with_instances(
        &self,
        instances: Vec<InstanceInfo>,
        map: impl Fn(usize) -> Option<usize>,
    ) -> Router {
        let mut r = Router::new(self.policy, instances, self.config.clone());
        let n = r.instances.len();
        let moved: Vec<Option<usize>> = (0..self.instances.len())
            .map(|i| map(i).filter(|&j| j < n))
            .collect();
        r.load = self.load.remap(n, |i| moved.get(i).copied().flatten());
        r.sessions = self
            .sessions
            .iter()
            .filter_map(|(&s, &(i, t))| moved.get(i).copied().flatten().map(|j| (s, (j, t))))
            .collect();
        r.session_clock = self.session_clock;
        r.stats = self.stats;
        r.rr = self.rr.clone();
        r
    }

    /// Instance `instance` (its position) reported its load.
    pub fn report_load(&mut self, instance: usize, report: LoadReport) {
        self.load.report(instance, report);
    }

    /// Chooses an instance for `req` (rules 1–3 of the module docs). Never fails.
    pub fn route(&mut self, index: &dyn OverlapSource, req: &RouteRequest<'_>) -> Decision {
        let n = self.instances.len();
        self.stats.decisions += 1;
        let ps = self.config.page_size;
        let prompt = req.tokens.len();
        // The engine computes at least the last prompt token: a match covers at most the
        // whole pages before it.
        let max_blocks = prompt.saturating_sub(1) / ps;
        let needs_hashes = self.policy.uses_index() || self.policy == Policy::SglangCacheAware;
        if needs_hashes {
            self.hashes.clear();
            ChainHasher::with_lora(ps, req.lora).extend(
                None,
                &req.tokens[..max_blocks * ps],
                &mut self.hashes,
            );
        }
        let mut fallback = false;
        if self.policy.uses_index() {
            let t0 = Instant::now();
            let answer = index.overlaps(&self.hashes, &mut self.matches);
            let took = t0.elapsed();
            self.stats.index_queries += 1;
            self.stats.index_query_ns += took.as_nanos() as u64;
            match answer {
                Err(_) => {
                    self.stats.fallback_down += 1;
                    fallback = true;
                }
                Ok(()) if took > self.config.deadline => {
                    self.stats.fallback_slow += 1;
                    fallback = true;
                }
                Ok(()) => self.fill_overlaps(index.components()),
            }
        }
        let in_flight = self.policy == Policy::Hicache
            && self.config.credit_in_flight
            && self.config.reuse == ReuseRule::Dense;
        if in_flight && !fallback {
            self.credit_pending();
        }
        let (instance, score) = if fallback {
            (self.load.least_loaded(), 0.0)
        } else {
            match self.policy {
                Policy::RoundRobin => (self.rr.pick(n), 0.0),
                Policy::LeastLoad => (least_load::pick(&self.load), 0.0),
                Policy::SglangCacheAware => {
                    let (i, _, _) = self.sglang.pick(&self.hashes, prompt, ps, &self.load);
                    (i, 0.0)
                }
                Policy::DynamoLinear => self.pick_dynamo(prompt),
                Policy::Hicache => self.pick_hicache(prompt, req.session),
            }
        };
        let overlap = if fallback || !self.policy.uses_index() {
            Overlap::default()
        } else {
            self.overlaps[instance]
        };
        let new_tokens = prompt - overlap.l3.min(prompt);
        self.load
            .routed(req.request, instance, prompt as u64, new_tokens as u64);
        if overlap.l3 > overlap.l2 {
            self.load.prefetching(instance);
        }
        if let Some(s) = req.session {
            self.remember_session(s, instance);
        }
        if in_flight {
            self.pending.routed(req.request, instance, &self.hashes);
        }
        Decision {
            instance,
            holder: self.instances[instance].holder,
            overlap,
            score,
            fallback,
        }
    }

    /// Per-instance overlaps in tokens from the last query, capped by the reuse rule: each
    /// instance reads its own answer (O(1) each, no map from holder to answer).
    fn fill_overlaps(&mut self, components: Option<&Components>) {
        let ps = self.config.page_size;
        for i in 0..self.instances.len() {
            let Some(m) = self.matches.get(self.instances[i].holder) else {
                self.overlaps[i] = Overlap::default();
                continue;
            };
            let (mut b1, mut b2, mut b3) = (m.l1 as usize, m.l2 as usize, m.l3 as usize);
            if self.instances[i].l3 == L3Access::None {
                b3 = b2;
            }
            if self.config.reuse == ReuseRule::Hybrid {
                let holder = self.instances[i].holder;
                let cap = |tier, blocks| {
                    components.map_or(0, |c| c.cap(holder, tier, &self.hashes, blocks, ps))
                };
                b1 = cap(Tier::L1, b1);
                b2 = cap(Tier::L2, b2).max(b1);
                b3 = if self.instances[i].l3 == L3Access::None {
                    b2
                } else {
                    cap(Tier::L3, b3).max(b2)
                };
            }
            // An L3 run shorter than the instance's prefetch threshold past its L1 and L2
            // overlap is never fetched (the engine's prefetch rule): no credit.
            let threshold = self.instances[i].l3_prefetch_threshold_tokens.unwrap_or(0);
            if (((b3 - b2) * ps) as u64) < threshold {
                b3 = b2;
            }
            self.overlaps[i] = Overlap {
                l1: b1 * ps,
                l2: b2 * ps,
                l3: b3 * ps,
            };
        }
    }

    /// Rule 4: the prompts routed to an instance and not finished will be in its L1 when a
    /// request queued behind them runs; their leading blocks count as L1 overlap there, but
    /// only where they reach past what the index shows on any instance or store. A prefix the
    /// index already shows somewhere (a shared system prompt once computed) earns no credit:
    /// crediting it would send every request that shares it to the instance it was first
    /// routed to.
    fn credit_pending(&mut self) {
        let ps = self.config.page_size;
        let known = self.overlaps.iter().map(|o| o.l3).max().unwrap_or(0);
        for i in 0..self.instances.len() {
            let p = self.pending.matched(i, &self.hashes) * ps;
            let o = &mut self.overlaps[i];
            if p > known && p > o.l1 {
                o.l1 = p;
                o.l2 = o.l2.max(p);
                o.l3 = o.l3.max(p);
            }
        }
    }

    fn busy(&self, i: usize) -> Busy {
        let l = self.load.load(i);
        Busy {
            queued_prefill_tokens: l.queued_prefill_tokens,
            requests: l.requests,
            running_tokens: l.running_tokens,
            kv_capacity_tokens: self.instances[i].kv_capacity_tokens.map(|c| c as f64),
            prefetching_requests: l.prefetching_requests,
        }
    }

    /// Lowest score wins; ties: fewest requests, then the lowest index.
    fn argmin(&self, scores: &[f64]) -> usize {
        (0..scores.len())
            .min_by(|&a, &b| {
                scores[a]
                    .total_cmp(&scores[b])
                    .then(
                        self.load
                            .load(a)
                            .requests
                            .total_cmp(&self.load.load(b).requests),
                    )
                    .then(a.cmp(&b))
            })
            .unwrap_or(0)
    }

    fn pick_dynamo(&self, prompt: usize) -> (usize, f64) {
        let ps = self.config.page_size as f64;
        let blocks = prompt as f64 / ps;
        let scores: Vec<f64> = (0..self.instances.len())
            .map(|i| {
                let o = self.overlaps[i];
                let beyond = (o.l3 - o.l2) as f64 / ps;
                let (disk, shared) = match self.instances[i].l3 {
                    L3Access::Shared(_) => (0.0, beyond),
                    _ => (beyond, 0.0),
                };
                let tiers = TierBlocks {
                    device: o.l1 as f64 / ps,
                    host: (o.l2 - o.l1) as f64 / ps,
                    disk,
                    shared,
                };
                let l = self.load.load(i);
                self.config.dynamo.cost(
                    blocks,
                    &tiers,
                    l.queued_prefill_tokens / ps,
                    l.running_tokens / ps,
                )
            })
            .collect();
        let i = self.argmin(&scores);
        (i, scores[i])
    }

    fn pick_hicache(&mut self, prompt: usize, session: Option<u64>) -> (usize, f64) {
        let cost = self.config.cost;
        let n = self.instances.len();
        let backlog: f64 = (0..n)
            .map(|i| self.load.load(i).queued_prefill_tokens)
            .sum();
        let behind = backlog / (n.max(1) as f64 * prompt.max(1) as f64);
        let expected: Vec<Expected> = (0..n)
            .map(|i| {
                cost.expect(
                    prompt,
                    &self.overlaps[i],
                    self.instances[i].l3.read_rate(),
                    &self.busy(i),
                )
            })
            .collect();
        let scores: Vec<f64> = expected.iter().map(|e| cost.score(e, behind)).collect();
        let best = self.argmin(&scores);
        if let Some(&(home, _)) = session.and_then(|s| self.sessions.get(&s))
            && home != best
            && home < scores.len()
            && scores[home] <= scores[best] * (1.0 + cost.tie_tolerance) + 1e-9
        {
            self.stats.session_kept += 1;
            return (home, expected[home].ttft);
        }
        (best, expected[best].ttft)
    }

    fn remember_session(&mut self, session: u64, instance: usize) {
        self.session_clock += 1;
        self.sessions
            .insert(session, (instance, self.session_clock));
        if self.sessions.len() > self.config.max_sessions.max(1) {
            // Forget the older half in one pass (amortised O(1) per decision).
            let mut ages: Vec<u64> = self.sessions.values().map(|v| v.1).collect();
            ages.sort_unstable();
            let cut = ages[ages.len() / 2];
            self.sessions.retain(|_, v| v.1 > cut);
        }
    }
}

#[cfg(test)]
mod tests;
