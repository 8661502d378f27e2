//! The service's state: one [`Index`] per model, the registered streams with their state
//! machines, the shared stores with their page mirrors, and the counters.
//!
//! Invariants:
//! 1. **One index per model.** Every instance of a model registers the same page size; its
//!    holders (the instance, and the shared store it names) live in that model's index only.
//! 2. **Shared stores.** An `l3_store` is one store holder per model, attached to every
//!    instance registered on it, plus a *probe* (an instance holder that holds nothing and
//!    reads the store only) whose query answer is the store's own leading run: `/query`'s
//!    `l3_stores`. A store lives while an instance is registered on it.
//! 3. **Lost store pages are bounded.** A store may lose a page without an event (its TTL, its
//!    eviction, another fleet's `clear`). Every page of a shared store expires `store_ttl` after
//!    it was last reported stored ([`Service::sweep`], run every `store_ttl / 8` by the
//!    driver): a page the store lost silently is reported for at most `store_ttl` plus one
//!    sweep period. A page still present is forgotten as well after `store_ttl` unless an
//!    instance stores it again: the bound errs on the side of a miss, never a wrong hit.
//! 4. **Failures stay with their stream.** A bad payload, an event for an unknown parent, a
//!    malformed event is counted for its stream and changes nothing of the others.
//! 5. **Hybrid components.** Each model keeps the SWA pages and Mamba states its instances
//!    report ([`Components`], fed by the component events of every batch after its Full
//!    events, cleared with the instance's table entries on `AllBlocksCleared`, a fenced
//!    restart or its death, forgotten when it unregisters). Once an engine declared a
//!    component, the model's router applies [`ReuseRule::Hybrid`] and caps every instance's
//!    match where every component is.

use crate::chain::{BlockHash, ChainHasher};
use crate::decode::{GroupKinds, WireFormat, decode_batch_with};
use crate::ingest::{Applied, IngestCounts, InstanceFeed};
use crate::metrics::Metrics;
use crate::registry::{Registration, RegistrationError};
use crate::router::{ComponentCounts, Components, LoadReport, ReuseRule, WithComponents};
use crate::routing::{
    AUTO_REQUEST_BASE, Candidate, ModelRouter, RouteAnswer, RoutingConfig, fallback_reason,
};
use crate::stream::{
    Action, FenceReason, Input, StreamConfig, StreamCounters, StreamPosition, StreamState,
};
use crate::table::{HolderId, HolderKind, Index, Tier};
use bytes::Bytes;
use hashbrown::HashMap;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// The service's settings.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// Holder-blocks per model index at most (`None`: unbounded).
    pub capacity: Option<u64>,
    /// A replay not finished within this is failed (invariant 2 of [`crate::stream`]).
    pub replay_timeout: Duration,
    /// Disconnected this long, an instance's entries are dropped.
    pub dead_after: Duration,
    /// A shared store's page is forgotten this long after it was last stored (invariant 3).
    pub store_ttl: Duration,
    /// How `POST /route` chooses (see [`crate::routing`]).
    pub routing: RoutingConfig,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            capacity: None,
            replay_timeout: Duration::from_secs(2),
            dead_after: Duration::from_secs(60),
            store_ttl: Duration::from_secs(600),
            routing: RoutingConfig::default(),
        }
    }
}

/// Why a request to the service failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    /// A bad registration.
    #[error(transparent)]
    Registration(#[from] RegistrationError),
    /// A registration that contradicts the model's.
    #[error("model {model:?} has page size {have}, the registration says {got}")]
    PageSize {
        /// The model.
        model: String,
        /// Its page size.
        have: u32,
        /// The registration's.
        got: u32,
    },
    /// An unknown instance.
    #[error("no instance {0:?} is registered")]
    UnknownInstance(String),
    /// An unknown model.
    #[error("no instance of model {0:?} is registered")]
    UnknownModel(String),
    /// Every instance of the model was dropped as dead: none to route to.
    #[error("every instance of model {0:?} was dropped as dead: none to route to")]
    NoLiveInstance(String),
    /// A load report for an instance dropped as dead (not a routing candidate until it
    /// comes back).
    #[error("instance {0:?} was dropped as dead: it is not routed to until it comes back")]
    DeadInstance(String),
    /// A request the service cannot serve as asked.
    #[error("{0}")]
    BadRequest(String),
    /// The index refused an operation (a bug or a limit).
    #[error("index: {0}")]
    Index(String),
}

impl From<crate::IndexError> for ServiceError {
    fn from(e: crate::IndexError) -> Self {
        ServiceError::Index(e.to_string())
    }
}

/// One shared store of a model.
#[derive(Debug)]
pub(crate) struct Store {
    pub(crate) holder: HolderId,
    pub(crate) probe: HolderId,
    /// Pages held → when last stored (service clock, ms): invariant 3.
    pub(crate) pages: HashMap<BlockHash, u64>,
    /// Streams registered on it.
    pub(crate) members: Vec<String>,
}

/// One model's index.
#[derive(Debug)]
pub(crate) struct Model {
    pub(crate) page_size: u32,
    pub(crate) index: Index,
    pub(crate) stores: BTreeMap<String, Store>,
    /// Instance and probe holders → the stream id or store name they answer for.
    pub(crate) names: HashMap<HolderId, Named>,
    /// The hybrid components its instances hold (invariant 5).
    pub(crate) components: Components,
}

#[derive(Clone, Debug)]
pub(crate) enum Named {
    Stream(String),
    Probe(String),
}

/// One registered stream.
#[derive(Debug)]
pub(crate) struct Stream {
    pub(crate) reg: Registration,
    pub(crate) state: StreamState,
    pub(crate) feed: InstanceFeed,
    pub(crate) counts: IngestCounts,
    pub(crate) bad_payloads: u64,
    pub(crate) skipped_events: u64,
    /// The KV-cache group kinds its stores declared (vLLM's removals name the group only).
    pub(crate) groups: GroupKinds,
    /// What its component events did.
    pub(crate) component_counts: ComponentCounts,
}

/// The service: every model's index and every stream.
#[derive(Debug)]
pub struct Service {
    pub(crate) cfg: ServiceConfig,
    pub(crate) models: BTreeMap<String, Model>,
    pub(crate) streams: BTreeMap<String, Stream>,
    pub(crate) metrics: Metrics,
    scratch: crate::Answer,
    /// One router per model, built at its first decision or load report.
    pub(crate) routers: BTreeMap<String, ModelRouter>,
    pub(crate) next_auto_request: u64,
}

/// One instance's answer to `/query`, in tokens of whole pages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct InstanceAnswer {
    /// The longest prefix the instance can serve from any tier (= `l3`).
    pub longest_matched: u64,
    /// Leading tokens in L1.
    pub l1: u64,
    /// Leading tokens in L1 or L2.
    pub l2: u64,
    /// Leading tokens in L1, L2 or an L3 it reads.
    pub l3: u64,
}

/// `/query`'s answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct QueryAnswer {
    /// Instances matching at least one page, by stream id.
    pub instances: BTreeMap<String, InstanceAnswer>,
    /// Shared stores holding at least the first page: their leading tokens.
    pub l3_stores: BTreeMap<String, u64>,
}

/// One stream's state in `GET /instances`.
#[derive(Clone, Debug, Serialize)]
pub struct InstanceStatus {
    /// The stream's id.
    pub id: String,
    /// Its registration.
    pub registration: Registration,
    /// Whether its subscription is connected.
    pub connected: bool,
    /// Whether it was dropped as dead.
    pub dead: bool,
    /// Whether a replay is running.
    pub replaying: bool,
    /// The last sequence number applied.
    pub last_seq: Option<u64>,
    /// The stream's counters (gaps, replays, fenced restarts …).
    pub stream: StreamCounters,
    /// Events applied.
    pub events: u64,
    /// Blocks stored and removed.
    pub stored_blocks: u64,
    /// Blocks removed.
    pub removed_blocks: u64,
    /// `BlockStored` events dropped: unknown parent.
    pub unknown_parent: u64,
    /// Removals of blocks never reported.
    pub unknown_block: u64,
    /// Events dropped as malformed.
    pub malformed: u64,
    /// Payloads that did not decode.
    pub bad_payloads: u64,
    /// Events skipped (unknown types, other vLLM groups).
    pub skipped_events: u64,
    /// Blocks in its engine-hash map.
    pub mapped_blocks: u64,
}

impl Service {
    /// An empty service.
    pub fn new(cfg: ServiceConfig) -> Self {
        Self {
            cfg,
            models: BTreeMap::new(),
            streams: BTreeMap::new(),
            metrics: Metrics::new(),
            scratch: crate::Answer::new(),
            routers: BTreeMap::new(),
            next_auto_request: AUTO_REQUEST_BASE,
        }
    }

    /// The settings.
    pub fn config(&self) -> &ServiceConfig {
        &self.cfg
    }

    fn stream_config(&self, reg: &Registration) -> StreamConfig {
        StreamConfig {
            replay: reg.replay_endpoint.is_some(),
            replay_timeout_ms: self.cfg.replay_timeout.as_millis() as u64,
            dead_after_ms: self.cfg.dead_after.as_millis() as u64,
        }
    }

    /// Registers a stream at `now_ms`; returns its id and whether it is new. Registering the
    /// same thing again changes nothing; a changed registration replaces the old one (its
    /// entries dropped).
    pub fn register(
        &mut self,
        reg: Registration,
        now_ms: u64,
    ) -> Result<(String, bool), ServiceError> {
        self.register_at(reg, StreamPosition::default(), now_ms)
    }

    pub(crate) fn register_at(
        &mut self,
        reg: Registration,
        pos: StreamPosition,
        now_ms: u64,
    ) -> Result<(String, bool), ServiceError> {
        reg.validate()?;
        let id = reg.id();
        if let Some(old) = self.streams.get(&id) {
            if old.reg == reg {
                return Ok((id, false));
            }
            self.remove_stream(&id)?;
        }
        if let Some(m) = self.models.get(&reg.model)
            && m.page_size != reg.page_size
        {
            return Err(ServiceError::PageSize {
                model: reg.model.clone(),
                have: m.page_size,
                got: reg.page_size,
            });
        }
        let capacity = self.cfg.capacity;
        let model = self
            .models
            .entry(reg.model.clone())
            .or_insert_with(|| Model {
                page_size: reg.page_size,
                index: Index::new(capacity),
                stores: BTreeMap::new(),
                names: HashMap::new(),
                components: Components::new(),
            });
        let instance = model.index.add_holder(HolderKind::Instance)?;
        model.names.insert(instance, Named::Stream(id.clone()));
        let l3 = match &reg.l3_store {
            None => instance,
            Some(name) => {
                if !model.stores.contains_key(name) {
                    let holder = model.index.add_holder(HolderKind::Store)?;
                    let probe = model.index.add_holder(HolderKind::Instance)?;
                    model.index.attach(probe, holder)?;
                    model.names.insert(probe, Named::Probe(name.clone()));
                    model.stores.insert(
                        name.clone(),
                        Store {
                            holder,
                            probe,
                            pages: HashMap::new(),
                            members: Vec::new(),
                        },
                    );
                }
                let store = model.stores.get_mut(name).expect("inserted above");
                store.members.push(id.clone());
                model.index.attach(instance, store.holder)?;
                store.holder
            }
        };
        model.components.attach(instance, l3);
        let cfg = self.stream_config(&reg);
        let feed = InstanceFeed::new(instance, l3, reg.page_size);
        tracing::info!(id, endpoint = reg.endpoint, model = reg.model, "registered");
        self.streams.insert(
            id.clone(),
            Stream {
                reg,
                state: StreamState::new(cfg, pos, now_ms),
                feed,
                counts: IngestCounts::default(),
                bad_payloads: 0,
                skipped_events: 0,
                groups: GroupKinds::new(),
                component_counts: ComponentCounts::default(),
            },
        );
        Ok((id, true))
    }

    fn remove_stream(&mut self, id: &str) -> Result<(), ServiceError> {
        let s = self
            .streams
            .remove(id)
            .ok_or_else(|| ServiceError::UnknownInstance(id.to_string()))?;
        let Some(model) = self.models.get_mut(&s.reg.model) else {
            return Ok(());
        };
        let instance = s.feed.instance();
        model.components.forget(instance);
        model.index.remove_holder(instance)?;
        model.names.remove(&instance);
        if let Some(name) = &s.reg.l3_store
            && let Some(store) = model.stores.get_mut(name)
        {
            store.members.retain(|m| m != id);
            if store.members.is_empty() {
                let (holder, probe) = (store.holder, store.probe);
                model.stores.remove(name);
                model.components.forget(holder);
                model.index.remove_holder(probe)?;
                model.index.remove_holder(holder)?;
                model.names.remove(&probe);
            }
        }
        if !self.streams.values().any(|o| o.reg.model == s.reg.model) {
            self.models.remove(&s.reg.model);
        }
        tracing::info!(id, "unregistered");
        Ok(())
    }

    /// Unregisters every stream of `instance` (all its dp ranks); returns their ids.
    pub fn unregister(&mut self, instance: &str) -> Result<Vec<String>, ServiceError> {
        let ids: Vec<String> = self
            .streams
            .iter()
            .filter(|(_, s)| s.reg.instance == instance)
            .map(|(id, _)| id.clone())
            .collect();
        if ids.is_empty() {
            return Err(ServiceError::UnknownInstance(instance.to_string()));
        }
        for id in &ids {
            self.remove_stream(id)?;
        }
        Ok(ids)
    }

    /// The registration of a stream.
    pub fn registration(&self, id: &str) -> Option<&Registration> {
        self.streams.get(id).map(|s| &s.reg)
    }

    /// Every stream id.
    pub fn stream_ids(&self) -> Vec<String> {
        self.streams.keys().cloned().collect()
    }

    /// Feeds one input to stream `id` at `now_ms` and carries out what it asks of the index;
    /// returns the replays the driver must run: (request id, start sequence).
    pub fn step(&mut self, id: &str, input: Input, now_ms: u64) -> Vec<(u64, u64)> {
        let Some(stream) = self.streams.get_mut(id) else {
            return Vec::new();
        };
        let mut actions = Vec::new();
        let before = stream.state.counters();
        stream.state.handle(input, now_ms, &mut actions);
        let after = stream.state.counters();
        self.metrics.gaps.inc_by(after.gaps - before.gaps);
        self.metrics
            .replayed_batches
            .inc_by(after.replayed_batches - before.replayed_batches);
        self.metrics
            .duplicates
            .inc_by(after.duplicates - before.duplicates);
        let mut replays = Vec::new();
        for a in actions {
            match a {
                Action::Apply { seq, payload } => self.apply_batch(id, seq, &payload, now_ms),
                Action::Replay { id: rid, start } => {
                    self.metrics.replays.inc();
                    replays.push((rid, start));
                }
                Action::Fence(reason) => {
                    match reason {
                        FenceReason::Restart => self.metrics.fenced_restarts.inc(),
                        FenceReason::LostGap => self.metrics.lost_gaps.inc(),
                    };
                    tracing::warn!(
                        id,
                        ?reason,
                        "stream fenced: the instance's entries are cleared"
                    );
                    self.clear_instance(id);
                }
                Action::DropDead => {
                    self.metrics.dead_drops.inc();
                    tracing::warn!(
                        id,
                        "instance disconnected too long: its entries are dropped"
                    );
                    self.clear_instance(id);
                }
            }
        }
        replays
    }

    fn clear_instance(&mut self, id: &str) {
        let Some(stream) = self.streams.get_mut(id) else {
            return;
        };
        let Some(model) = self.models.get_mut(&stream.reg.model) else {
            return;
        };
        if let Err(e) = stream.feed.clear(&mut model.index) {
            tracing::error!(id, "clearing the instance failed: {e}");
        }
        model.components.clear(stream.feed.instance());
    }

    /// Decodes and applies one batch of stream `id`.
    pub(crate) fn apply_batch(&mut self, id: &str, seq: u64, payload: &[u8], now_ms: u64) {
        let Some(stream) = self.streams.get_mut(id) else {
            return;
        };
        let format: WireFormat = stream.reg.format;
        let batch = match decode_batch_with(format, payload, &mut stream.groups) {
            Ok(b) => b,
            Err(e) => {
                stream.bad_payloads += 1;
                self.metrics.bad_payloads.inc();
                tracing::warn!(id, seq, "bad KV event payload dropped: {e}");
                return;
            }
        };
        stream.skipped_events += u64::from(batch.skipped);
        let Some(model) = self.models.get_mut(&stream.reg.model) else {
            return;
        };
        let store = stream
            .reg
            .l3_store
            .as_ref()
            .and_then(|s| model.stores.get_mut(s));
        let mut store_pages = store;
        let mut counts = IngestCounts::default();
        for ev in &batch.events {
            let mut observe = |a: Applied<'_>| {
                if a.tier != Tier::L3 {
                    return;
                }
                if let Some(st) = store_pages.as_deref_mut()
                    && st.holder == a.holder
                {
                    for h in a.hashes {
                        if a.stored {
                            st.pages.insert(*h, now_ms);
                        } else {
                            st.pages.remove(h);
                        }
                    }
                }
            };
            if let Err(e) =
                stream
                    .feed
                    .apply_observed(&mut model.index, ev, &mut counts, &mut observe)
            {
                tracing::error!(id, seq, "index refused an event: {e}");
            }
        }
        stream.counts.add(&counts);
        self.metrics.add_ingest(&counts);
        // Invariant 5: after the batch's Full events, so that every block a component store
        // names resolves through the instance's engine-hash map.
        let before = stream.component_counts;
        for ev in &batch.components {
            model
                .components
                .apply(&stream.feed, ev, &mut stream.component_counts);
        }
        let after = stream.component_counts;
        self.metrics.add_components(&ComponentCounts {
            stored: after.stored - before.stored,
            removed: after.removed - before.removed,
            unresolved: after.unresolved - before.unresolved,
            malformed: after.malformed - before.malformed,
        });
        let dropped = (after.unresolved - before.unresolved) + (after.malformed - before.malformed);
        stream.skipped_events += dropped;
    }

    /// Forgets shared-store pages not stored again within the TTL (invariant 3); returns how
    /// many.
    pub fn sweep(&mut self, now_ms: u64) -> u64 {
        let ttl = self.cfg.store_ttl.as_millis() as u64;
        let mut dropped = 0;
        for model in self.models.values_mut() {
            for store in model.stores.values_mut() {
                let old: Vec<BlockHash> = store
                    .pages
                    .iter()
                    .filter(|(_, t)| now_ms.saturating_sub(**t) >= ttl)
                    .map(|(h, _)| *h)
                    .collect();
                if old.is_empty() {
                    continue;
                }
                for h in &old {
                    store.pages.remove(h);
                }
                if let Err(e) = model.index.remove(store.holder, Tier::L3, &old) {
                    tracing::error!("store sweep failed: {e}");
                }
                model.components.drop_blocks(store.holder, Tier::L3, &old);
                dropped += old.len() as u64;
            }
        }
        self.metrics.store_expired.inc_by(dropped);
        dropped
    }

    /// Answers a query: which instance holds how much of `token_ids`' prefix, per tier.
    pub fn query(
        &mut self,
        model_name: &str,
        token_ids: &[u32],
    ) -> Result<QueryAnswer, ServiceError> {
        let model = self
            .models
            .get(model_name)
            .ok_or_else(|| ServiceError::UnknownModel(model_name.to_string()))?;
        let hashes = ChainHasher::new(model.page_size as usize).hashes(token_ids);
        model.index.query(&hashes, &mut self.scratch);
        let ps = u64::from(model.page_size);
        let mut answer = QueryAnswer::default();
        for m in self.scratch.iter() {
            match model.names.get(&m.holder) {
                Some(Named::Stream(id)) => {
                    answer.instances.insert(
                        id.clone(),
                        InstanceAnswer {
                            longest_matched: u64::from(m.l3) * ps,
                            l1: u64::from(m.l1) * ps,
                            l2: u64::from(m.l2) * ps,
                            l3: u64::from(m.l3) * ps,
                        },
                    );
                }
                Some(Named::Probe(store)) => {
                    answer.l3_stores.insert(store.clone(), u64::from(m.l3) * ps);
                }
                None => {}
            }
        }
        self.metrics.queries.inc();
        Ok(answer)
    }

    /// The live streams of `model_name`, in id order (invariant 1 of [`crate::routing`]).
    pub(crate) fn candidates(&self, model_name: &str) -> Vec<Candidate> {
        self.streams
            .iter()
            .filter(|(_, s)| s.reg.model == model_name && !s.state.dead())
            .map(|(id, s)| Candidate {
                id: id.clone(),
                holder: s.feed.instance(),
                shared_l3: s.reg.l3_store.is_some(),
                kv_capacity_tokens: s.reg.kv_capacity_tokens,
                l3_prefetch_threshold_tokens: s.reg.l3_prefetch_threshold_tokens,
            })
            .collect()
    }

    /// The router of `model_name`, brought up to the registry.
    fn router_of(&mut self, model_name: &str) -> Result<&mut ModelRouter, ServiceError> {
        let Some(model) = self.models.get(model_name) else {
            self.routers.remove(model_name);
            return Err(ServiceError::UnknownModel(model_name.to_string()));
        };
        let page_size = model.page_size;
        let now = self.candidates(model_name);
        if now.is_empty() {
            return Err(ServiceError::NoLiveInstance(model_name.to_string()));
        }
        let cfg = &self.cfg.routing;
        let r = self
            .routers
            .entry(model_name.to_string())
            .or_insert_with(|| ModelRouter::new(cfg, page_size, now.clone()));
        r.update(cfg, now);
        Ok(r)
    }

    /// Chooses the instance of `model_name` for a request of `token_ids` (`POST /route`); the
    /// request counts as load on it until [`Service::finished`] names it.
    pub fn route(
        &mut self,
        model_name: &str,
        token_ids: &[u32],
        request: Option<u64>,
        session: Option<u64>,
    ) -> Result<RouteAnswer, ServiceError> {
        if token_ids.is_empty() {
            return Err(ServiceError::BadRequest("token_ids is empty".into()));
        }
        // Drop the routers of models no longer registered.
        let models = &self.models;
        self.routers.retain(|m, _| models.contains_key(m));
        let request = request.unwrap_or_else(|| {
            let id = self.next_auto_request;
            self.next_auto_request = self
                .next_auto_request
                .wrapping_add(1)
                .max(AUTO_REQUEST_BASE);
            id
        });
        let policy = self.cfg.routing.policy;
        let t0 = std::time::Instant::now();
        self.router_of(model_name)?;
        let r = self.routers.get_mut(model_name).expect("built above");
        let model = self.models.get(model_name).expect("checked above");
        let before = r.router.stats();
        // Invariant 5: a model whose engines declared a component is routed as a hybrid.
        r.router.set_reuse(if model.components.is_hybrid() {
            ReuseRule::Hybrid
        } else {
            ReuseRule::Dense
        });
        let source = WithComponents {
            index: &model.index,
            components: &model.components,
        };
        let d = r.router.route(
            &source,
            &crate::router::RouteRequest {
                request,
                tokens: token_ids,
                session,
                lora: None,
            },
        );
        let took = t0.elapsed();
        let id = r.candidates[d.instance].id.clone();
        let reason = fallback_reason(before, r.router.stats());
        self.metrics
            .record_route(model_name, &id, policy.name(), reason, took);
        Ok(RouteAnswer::new(policy, request, id, &d))
    }

    /// `request` finished (`POST /finished`): its load is released. Returns the stream id of
    /// the instance it had gone to; `None`: no router knows it (counted).
    pub fn finished(&mut self, request: u64) -> Option<String> {
        let found = self.routers.values_mut().find_map(|r| {
            r.router
                .finished(request)
                .map(|i| r.candidates[i].id.clone())
        });
        self.metrics.record_finished(found.is_some());
        found
    }

    /// Stream `id` reported its load (`POST /load`): the router's estimate of it restarts
    /// from the report.
    pub fn report_load(&mut self, id: &str, report: LoadReport) -> Result<(), ServiceError> {
        let model = self
            .streams
            .get(id)
            .ok_or_else(|| ServiceError::UnknownInstance(id.to_string()))?
            .reg
            .model
            .clone();
        let r = self.router_of(&model)?;
        let Some(i) = r.position(id) else {
            return Err(ServiceError::DeadInstance(id.to_string()));
        };
        r.router.report_load(i, report);
        self.metrics.load_reports.inc();
        Ok(())
    }

    /// Every stream's state.
    pub fn instances(&self) -> Vec<InstanceStatus> {
        self.streams
            .iter()
            .map(|(id, s)| InstanceStatus {
                id: id.clone(),
                registration: s.reg.clone(),
                connected: s.state.connected(),
                dead: s.state.dead(),
                replaying: s.state.replaying(),
                last_seq: s.state.last_seq(),
                stream: s.state.counters(),
                events: s.counts.events,
                stored_blocks: s.counts.stored_blocks,
                removed_blocks: s.counts.removed_blocks,
                unknown_parent: s.counts.unknown_parent,
                unknown_block: s.counts.unknown_block,
                malformed: s.counts.malformed,
                bad_payloads: s.bad_payloads,
                skipped_events: s.skipped_events,
                mapped_blocks: s.feed.mapped_blocks() as u64,
            })
            .collect()
    }

    /// The Prometheus text exposition of the service's metrics.
    pub fn render_metrics(&self) -> String {
        self.metrics.render(self)
    }

    /// Feeds a live batch (as the driver does; for tests and tools that bring their own
    /// transport).
    pub fn live(&mut self, id: &str, seq: u64, payload: Bytes, now_ms: u64) -> Vec<(u64, u64)> {
        self.step(id, Input::Live { seq, payload }, now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    fn reg(name: &str, store: Option<&str>) -> Registration {
        Registration {
            instance: name.into(),
            endpoint: "tcp://127.0.0.1:1".into(),
            replay_endpoint: None,
            topic: None,
            format: WireFormat::Sglang,
            model: "m".into(),
            page_size: 2,
            dp_rank: None,
            l3_store: store.map(str::to_string),
            kv_capacity_tokens: None,
            l3_prefetch_threshold_tokens: None,
        }
    }

    fn stored(hashes: &[i64], parent: Option<i64>, tokens: &[u32], medium: &str) -> Value {
        Value::Map(vec![
            ("type".into(), "BlockStored".into()),
            (
                "block_hashes".into(),
                Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
            ),
            (
                "parent_block_hash".into(),
                parent.map_or(Value::Nil, Value::from),
            ),
            (
                "token_ids".into(),
                Value::Array(tokens.iter().map(|t| Value::from(*t)).collect()),
            ),
            ("block_size".into(), Value::from(2)),
            ("medium".into(), medium.into()),
        ])
    }

    fn batch(events: Vec<Value>) -> Bytes {
        let mut out = Vec::new();
        rmpv::encode::write_value(
            &mut out,
            &Value::Array(vec![Value::F64(1.0), Value::Array(events), Value::Nil]),
        )
        .unwrap();
        Bytes::from(out)
    }

    #[test]
    fn a_shared_store_counts_for_every_instance_on_it_and_expires_after_its_ttl() {
        let mut svc = Service::new(ServiceConfig {
            store_ttl: Duration::from_millis(1000),
            ..ServiceConfig::default()
        });
        svc.register(reg("a", Some("redis-1")), 0).unwrap();
        svc.register(reg("b", Some("redis-1")), 0).unwrap();
        svc.register(reg("c", None), 0).unwrap();
        svc.step("a", Input::Connected, 0);
        svc.live(
            "a",
            0,
            batch(vec![stored(&[1, 2], None, &[1, 2, 3, 4], "EXTERNAL")]),
            0,
        );
        svc.live("a", 1, batch(vec![stored(&[1], None, &[1, 2], "GPU")]), 0);
        let q = svc.query("m", &[1, 2, 3, 4, 5]).unwrap();
        assert_eq!(
            q.instances["a"],
            InstanceAnswer {
                longest_matched: 4,
                l1: 2,
                l2: 2,
                l3: 4
            }
        );
        assert_eq!(
            q.instances["b"],
            InstanceAnswer {
                longest_matched: 4,
                l1: 0,
                l2: 0,
                l3: 4
            }
        );
        assert!(!q.instances.contains_key("c"));
        assert_eq!(q.l3_stores["redis-1"], 4);
        // Not stored again within the TTL: forgotten (the bound of a silent loss).
        assert_eq!(svc.sweep(999), 0);
        svc.live(
            "a",
            2,
            batch(vec![stored(&[1], None, &[1, 2], "EXTERNAL")]),
            500,
        );
        assert_eq!(svc.sweep(1000), 1);
        let q = svc.query("m", &[1, 2, 3, 4]).unwrap();
        assert_eq!(q.instances["b"].l3, 2);
        assert_eq!(q.l3_stores["redis-1"], 2);
        assert_eq!(svc.sweep(1500), 1);
        let q = svc.query("m", &[1, 2, 3, 4]).unwrap();
        assert!(!q.instances.contains_key("b"));
        assert!(q.l3_stores.is_empty());
    }

    /// Invariant 5: a hybrid instance's components come from its events and leave with its
    /// table entries — `AllBlocksCleared`, a fenced restart, a dead drop — and the router
    /// credits it only where its state is.
    #[test]
    fn hybrid_components_follow_the_instance_and_leave_with_its_entries() {
        let mut svc = Service::new(ServiceConfig {
            dead_after: Duration::from_millis(1000),
            routing: RoutingConfig {
                deadline: Duration::from_secs(60),
                ..RoutingConfig::default()
            },
            ..ServiceConfig::default()
        });
        svc.register(reg("a", None), 0).unwrap();
        svc.step("a", Input::Connected, 0);
        let state = |ty: &str| {
            let mut m = vec![
                ("type".into(), ty.into()),
                ("block_hashes".into(), Value::Array(vec![Value::from(2)])),
                ("medium".into(), "GPU".into()),
                ("group_idx".into(), Value::from(1)),
                ("kv_cache_spec_kind".into(), "mamba".into()),
            ];
            if ty == "BlockStored" {
                m.push(("parent_block_hash".into(), Value::from(1)));
                m.push(("token_ids".into(), Value::Array(vec![3.into(), 4.into()])));
                m.push(("block_size".into(), Value::from(2)));
            }
            Value::Map(m)
        };
        let full_and_state = || {
            batch(vec![
                stored(&[1, 2], None, &[1, 2, 3, 4], "GPU"),
                state("BlockStored"),
            ])
        };
        let recorded = |svc: &Service| {
            let holder = svc.streams["a"].feed.instance();
            svc.models["m"].components.recorded(holder, Tier::L1)
        };
        let prompt = [1, 2, 3, 4, 5, 6];
        let credit = |svc: &mut Service| svc.route("m", &prompt, None, None).unwrap().overlap.l1;
        // Full pages alone: a dense model, credited page by page.
        svc.live(
            "a",
            0,
            batch(vec![stored(&[1, 2], None, &[1, 2, 3, 4], "GPU")]),
            0,
        );
        assert_eq!(credit(&mut svc), 4);
        svc.live("a", 1, batch(vec![state("BlockStored")]), 0);
        assert_eq!((recorded(&svc), credit(&mut svc)), ((0, 1), 4));
        let text = svc.metrics.render(&svc);
        for line in [
            "hicache_index_component_blocks{model=\"m\",component=\"mamba\",tier=\"l1\"} 1",
            "hicache_index_component_blocks{model=\"m\",component=\"swa\",tier=\"l1\"} 0",
            "hicache_index_component_ops_total{op=\"stored\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        // The state leaves: the Full pages stay, no credit (the model is hybrid now).
        svc.live("a", 2, batch(vec![state("BlockRemoved")]), 0);
        assert_eq!((recorded(&svc), credit(&mut svc)), ((0, 0), 0));
        svc.live("a", 3, full_and_state(), 0);
        assert_eq!(credit(&mut svc), 4);
        svc.live(
            "a",
            4,
            batch(vec![Value::Map(vec![(
                "type".into(),
                "AllBlocksCleared".into(),
            )])]),
            0,
        );
        assert_eq!((recorded(&svc), credit(&mut svc)), ((0, 0), 0));
        // A gap the instance cannot replay fences it: its entries go, components included.
        svc.live("a", 5, full_and_state(), 0);
        assert_eq!(recorded(&svc), (0, 1));
        svc.live("a", 7, batch(vec![stored(&[9], None, &[9, 9], "GPU")]), 0);
        assert_eq!((recorded(&svc), credit(&mut svc)), ((0, 0), 0));
        // Dropped as dead: cleared as well.
        svc.live("a", 8, full_and_state(), 0);
        assert_eq!((recorded(&svc), credit(&mut svc)), ((0, 1), 4));
        // A restart from a snapshot keeps the model hybrid, not its states: no credit until
        // the engine reports them again (a miss, never a false hit).
        let bytes = crate::snapshot::encode(&svc);
        let mut b = Service::new(svc.config().clone());
        crate::snapshot::restore(&mut b, std::path::Path::new("mem"), &bytes, 0).unwrap();
        assert!(b.models["m"].components.is_hybrid());
        assert_eq!((recorded(&b), credit(&mut b)), ((0, 0), 0));
        svc.step("a", Input::Disconnected, 10);
        svc.step("a", Input::Tick, 2000);
        assert_eq!(recorded(&svc), (0, 0));
    }

    #[test]
    fn bad_payloads_are_counted_for_their_stream_only() {
        let mut svc = Service::new(ServiceConfig::default());
        svc.register(reg("a", None), 0).unwrap();
        svc.register(reg("b", None), 0).unwrap();
        svc.step("a", Input::Connected, 0);
        svc.step("b", Input::Connected, 0);
        svc.live("a", 0, Bytes::from_static(b"\xc1garbage"), 0);
        svc.live("b", 0, batch(vec![stored(&[1], None, &[1, 2], "GPU")]), 0);
        let st = svc.instances();
        assert_eq!((st[0].bad_payloads, st[1].bad_payloads), (1, 0));
        let q = svc.query("m", &[1, 2]).unwrap();
        assert_eq!(q.instances.keys().collect::<Vec<_>>(), ["b"]);
        assert!(
            svc.render_metrics()
                .contains("hicache_index_bad_payloads_total 1")
        );
    }

    #[test]
    fn registrations_are_idempotent_per_id_and_models_agree_on_page_size() {
        let mut svc = Service::new(ServiceConfig::default());
        assert!(svc.register(reg("a", None), 0).unwrap().1);
        assert!(!svc.register(reg("a", None), 0).unwrap().1);
        let mut other = reg("b", None);
        other.page_size = 4;
        assert!(matches!(
            svc.register(other, 0),
            Err(ServiceError::PageSize { .. })
        ));
        assert_eq!(svc.unregister("a").unwrap(), ["a"]);
        assert!(svc.unregister("a").is_err());
        assert!(svc.query("m", &[1, 2]).is_err());
    }
}
