//! The service's Prometheus metrics (`GET /metrics`), every name prefixed `hicache_index_`.
//!
//! Counters move as events arrive; the per-model gauges (holders, holder-blocks, bytes,
//! instances) are read from the indexes when a scrape renders them.

use crate::ingest::IngestCounts;
use crate::router::ComponentCounts;
use crate::service::Service;
use crate::table::Tier;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::time::Duration;

type Labels = Vec<(String, String)>;

/// The service's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Events applied.
    pub events: Counter,
    /// Block residencies stored / removed (`op`).
    pub block_ops: Family<Labels, Counter>,
    /// Events dropped: unknown parent, unknown block, malformed (`reason`).
    pub dropped: Family<Labels, Counter>,
    /// Payloads that did not decode.
    pub bad_payloads: Counter,
    /// Sequence gaps seen.
    pub gaps: Counter,
    /// Replays asked for.
    pub replays: Counter,
    /// Batches applied from replays.
    pub replayed_batches: Counter,
    /// Duplicate batches skipped.
    pub duplicates: Counter,
    /// Publisher restarts fenced.
    pub fenced_restarts: Counter,
    /// Gaps that could not be replayed (fenced).
    pub lost_gaps: Counter,
    /// Instances dropped as dead.
    pub dead_drops: Counter,
    /// Shared-store pages forgotten after the store TTL.
    pub store_expired: Counter,
    /// Queries answered.
    pub queries: Counter,
    /// Requests routed (`model`, `instance`, `policy`).
    pub routed: Family<Labels, Counter>,
    /// Decisions that fell back to `least-load` (`reason`: `down`, `slow`).
    pub route_fallbacks: Family<Labels, Counter>,
    /// Time of a routing decision, index query included (s).
    pub route_seconds: Histogram,
    /// `POST /finished` calls (`known`: whether a router knew the request).
    pub finished: Family<Labels, Counter>,
    /// Load reports accepted.
    pub load_reports: Counter,
    /// Hybrid component residencies applied (`op`: stored, removed, unresolved, malformed).
    pub component_ops: Family<Labels, Counter>,
    holders: Family<Labels, Gauge>,
    holder_blocks: Family<Labels, Gauge>,
    component_blocks: Family<Labels, Gauge>,
    blocks: Family<Labels, Gauge>,
    bytes: Family<Labels, Gauge>,
    evicted: Family<Labels, Gauge>,
    instances: Family<Labels, Gauge>,
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("hicache_index");
        let m = Self {
            events: Counter::default(),
            block_ops: Family::default(),
            dropped: Family::default(),
            bad_payloads: Counter::default(),
            gaps: Counter::default(),
            replays: Counter::default(),
            replayed_batches: Counter::default(),
            duplicates: Counter::default(),
            fenced_restarts: Counter::default(),
            lost_gaps: Counter::default(),
            dead_drops: Counter::default(),
            store_expired: Counter::default(),
            queries: Counter::default(),
            routed: Family::default(),
            route_fallbacks: Family::default(),
            route_seconds: Histogram::new(exponential_buckets(1e-6, 2.0, 20)),
            finished: Family::default(),
            load_reports: Counter::default(),
            component_ops: Family::default(),
            holders: Family::default(),
            holder_blocks: Family::default(),
            component_blocks: Family::default(),
            blocks: Family::default(),
            bytes: Family::default(),
            evicted: Family::default(),
            instances: Family::default(),
            registry: Registry::default(),
        };
        registry.register("events", "KV events applied", m.events.clone());
        registry.register(
            "block_ops",
            "Block residencies stored or removed (op)",
            m.block_ops.clone(),
        );
        registry.register(
            "dropped_events",
            "Events or blocks dropped (reason: unknown_parent, unknown_block, malformed)",
            m.dropped.clone(),
        );
        registry.register(
            "bad_payloads",
            "Batches whose payload did not decode",
            m.bad_payloads.clone(),
        );
        registry.register("gaps", "Sequence gaps seen", m.gaps.clone());
        registry.register("replays", "Replays asked for", m.replays.clone());
        registry.register(
            "replayed_batches",
            "Batches applied from replays",
            m.replayed_batches.clone(),
        );
        registry.register(
            "duplicate_batches",
            "Duplicate batches skipped",
            m.duplicates.clone(),
        );
        registry.register(
            "fenced_restarts",
            "Publisher restarts fenced",
            m.fenced_restarts.clone(),
        );
        registry.register(
            "lost_gaps",
            "Gaps that could not be replayed (fenced)",
            m.lost_gaps.clone(),
        );
        registry.register(
            "dead_instances",
            "Instances dropped as dead",
            m.dead_drops.clone(),
        );
        registry.register(
            "store_expired_pages",
            "Shared-store pages forgotten after the store TTL",
            m.store_expired.clone(),
        );
        registry.register("queries", "Queries answered", m.queries.clone());
        registry.register(
            "routed_requests",
            "Requests routed (model, instance, policy)",
            m.routed.clone(),
        );
        registry.register(
            "route_fallbacks",
            "Routing decisions that fell back to least-load (reason: down, slow)",
            m.route_fallbacks.clone(),
        );
        registry.register(
            "route_decision_seconds",
            "Time of a routing decision, index query included",
            m.route_seconds.clone(),
        );
        registry.register(
            "route_finished",
            "POST /finished calls (known: whether a router knew the request)",
            m.finished.clone(),
        );
        registry.register(
            "load_reports",
            "Load reports accepted",
            m.load_reports.clone(),
        );
        registry.register(
            "holders",
            "Holders (instances, stores, store probes) per model",
            m.holders.clone(),
        );
        registry.register(
            "holder_blocks",
            "Holder-blocks per model",
            m.holder_blocks.clone(),
        );
        registry.register("blocks", "Distinct blocks per model", m.blocks.clone());
        registry.register(
            "component_blocks",
            "Hybrid models' SWA pages and Mamba states recorded, per model, component and tier",
            m.component_blocks.clone(),
        );
        registry.register(
            "component_ops",
            "Hybrid component residencies applied (op: stored, removed, unresolved, malformed)",
            m.component_ops.clone(),
        );
        registry.register(
            "bytes",
            "Bytes of the index's structures per model",
            m.bytes.clone(),
        );
        registry.register(
            "evicted_holder_blocks",
            "Holder-blocks evicted for capacity per model",
            m.evicted.clone(),
        );
        registry.register(
            "instances",
            "Registered streams per model and state",
            m.instances.clone(),
        );
        Self { registry, ..m }
    }

    /// Counts what applying a batch did.
    pub fn add_ingest(&self, c: &IngestCounts) {
        self.events.inc_by(c.events);
        let l = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        self.block_ops
            .get_or_create(&l("op", "store"))
            .inc_by(c.stored_blocks);
        self.block_ops
            .get_or_create(&l("op", "remove"))
            .inc_by(c.removed_blocks);
        self.dropped
            .get_or_create(&l("reason", "unknown_parent"))
            .inc_by(c.unknown_parent);
        self.dropped
            .get_or_create(&l("reason", "unknown_block"))
            .inc_by(c.unknown_block);
        self.dropped
            .get_or_create(&l("reason", "malformed"))
            .inc_by(c.malformed);
    }

    /// Counts what a batch's component events did (`delta`: the stream's counts after minus
    /// before).
    pub fn add_components(&self, delta: &ComponentCounts) {
        for (op, n) in [
            ("stored", delta.stored),
            ("removed", delta.removed),
            ("unresolved", delta.unresolved),
            ("malformed", delta.malformed),
        ] {
            self.component_ops
                .get_or_create(&vec![("op".to_string(), op.to_string())])
                .inc_by(n);
        }
    }

    /// Counts one routing decision.
    pub fn record_route(
        &self,
        model: &str,
        instance: &str,
        policy: &str,
        fallback: Option<&str>,
        took: Duration,
    ) {
        let labels = vec![
            ("model".to_string(), model.to_string()),
            ("instance".to_string(), instance.to_string()),
            ("policy".to_string(), policy.to_string()),
        ];
        self.routed.get_or_create(&labels).inc();
        if let Some(reason) = fallback {
            self.route_fallbacks
                .get_or_create(&vec![("reason".to_string(), reason.to_string())])
                .inc();
        }
        self.route_seconds.observe(took.as_secs_f64());
    }

    /// Counts one `POST /finished`.
    pub fn record_finished(&self, known: bool) {
        self.finished
            .get_or_create(&vec![("known".to_string(), known.to_string())])
            .inc();
    }

    /// The text exposition, with the gauges read from `svc` now.
    pub fn render(&self, svc: &Service) -> String {
        for fam in [
            &self.holders,
            &self.holder_blocks,
            &self.component_blocks,
            &self.blocks,
            &self.bytes,
            &self.evicted,
            &self.instances,
        ] {
            fam.clear();
        }
        for (name, model) in &svc.models {
            let l = vec![("model".to_string(), name.clone())];
            let st = model.index.stats();
            let map_bytes: u64 = svc
                .streams
                .values()
                .filter(|s| &s.reg.model == name)
                .map(|s| s.feed.map_bytes())
                .sum();
            let store_bytes: u64 = model
                .stores
                .values()
                .map(|s| (s.pages.capacity() * 17) as u64)
                .sum();
            self.holders.get_or_create(&l).set(st.holders as i64);
            self.holder_blocks
                .get_or_create(&l)
                .set(st.holder_blocks as i64);
            self.blocks.get_or_create(&l).set(st.blocks as i64);
            self.bytes
                .get_or_create(&l)
                .set((st.bytes + map_bytes + store_bytes) as i64);
            self.evicted.get_or_create(&l).set(st.evicted as i64);
            if model.components.is_hybrid() {
                for (tier, tier_name) in [(Tier::L1, "l1"), (Tier::L2, "l2"), (Tier::L3, "l3")] {
                    let (swa, mamba) = model.components.held(tier);
                    for (component, n) in [("swa", swa), ("mamba", mamba)] {
                        let labels = vec![
                            ("model".to_string(), name.clone()),
                            ("component".to_string(), component.to_string()),
                            ("tier".to_string(), tier_name.to_string()),
                        ];
                        self.component_blocks.get_or_create(&labels).set(n as i64);
                    }
                }
            }
        }
        for s in svc.streams.values() {
            let state = if s.state.dead() {
                "dead"
            } else if s.state.connected() {
                "connected"
            } else {
                "disconnected"
            };
            let l = vec![
                ("model".to_string(), s.reg.model.clone()),
                ("state".to_string(), state.to_string()),
            ];
            self.instances.get_or_create(&l).inc();
        }
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
