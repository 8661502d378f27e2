//! [`HiCache`]: the cache controller the engine drives, and its request-facing API.
//!
//! Ownership (who may touch what):
//! 1. The engine thread owns the `HiCache` and calls it with `&mut self`; the tree, the
//!    queues and every slot decision live on that thread.
//! 2. Device pages are owned either by the tree (cached prefixes), by a request (pages the
//!    engine allocated and has not handed to `cache_finished`), or are free. A page the tree
//!    owns is freed only by the tree's eviction or reset.
//! 3. Host pages are owned by the tree (backed-up nodes), by an in-flight prefetch (fetched
//!    into, not yet inserted), or are free. An L3 task touches only pages its operation owns
//!    (prefetch) or pages protected in the tree for its lifetime (backup).
//! 4. Device pages of a node being written are pinned (`lock_ref`) until the D2H ack; host
//!    pages of a node being backed up to L3 are protected (`host_ref`) until the L3 ack.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use hicache_core::{
    HiRadixTree, InsertOptions, KvEvent, KvShape, Namespace, NodeId, TenantId, WriteId,
};
use hicache_gpu::{DevicePool, DeviceSlot, LayerDoneCounter, Stream, TransferEngine};
use hicache_host::{HostPool, HostSlot};
use hicache_storage::Registry;

use crate::config::HiCacheConfig;
use crate::error::{HiCacheError, Result};
use crate::l3::L3;
use crate::metrics::{Metrics, Tier};
use crate::rank::RankGroup;
use crate::write::{LoadBatch, QueuedLoad, WriteBatch};

/// The engine's id of a request (unique among live requests).
pub type RequestId = u64;

/// What [`HiCache::arrive`] found for a new request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Arrival {
    /// Prompt pages cached on device.
    pub device_pages: usize,
    /// Prompt pages cached on host only (loadable at admission).
    pub host_pages: usize,
    /// Pages an L3 prefetch is looking up (0: no prefetch started).
    pub prefetch_pages: usize,
}

/// What [`HiCache::admit`] gives the engine: the cached prefix of the prompt on device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// One device slot per cached page, in order; these pages are locked for the request
    /// until [`HiCache::cache_finished`] or [`HiCache::abort`]. Pages loaded back from host
    /// are valid once [`HiCache::start_loading`]'s layer events fire.
    pub prefix_slots: Vec<DeviceSlot>,
    /// Pages that were already on device (L1 hits).
    pub device_pages: usize,
    /// Pages loaded back from host that were there before this request (L2 hits).
    pub host_pages: usize,
    /// Pages loaded back from host that this request's prefetch brought from L3 (L3 hits).
    pub storage_pages: usize,
}

impl Admission {
    /// Cached pages in total.
    pub fn cached_pages(&self) -> usize {
        self.prefix_slots.len()
    }
}

/// Per-request state.
#[derive(Debug)]
pub(crate) struct Request {
    pub tenant: TenantId,
    /// Sequence number of the request's prefetch while one is tracked.
    pub prefetch: Option<u64>,
    /// Pages inserted into the tree by this request's finished prefetch.
    pub storage_pages: usize,
    /// Set once admitted: the locked node and the pages the request shares with the tree.
    pub admitted: Option<Admitted>,
    /// Pages loaded back for this request by admissions that were undone (`unadmit`): they
    /// are on device now but count as host or storage hits when it is admitted again.
    pub carried_loaded: usize,
    /// Prompt length at arrival (the denominator of the hit ratio).
    pub prompt_tokens: usize,
    /// Request priority (SGLang's `req.priority`): nodes this request inserts or walks keep the
    /// highest priority of their requests, which the `priority` eviction policy orders by.
    pub priority: i32,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Admitted {
    pub lock: NodeId,
    pub shared_pages: usize,
    /// Hit pages per tier and prompt tokens (as given at arrival), recorded in the metrics once the admission is
    /// final (the request finishes, completes a chunk or is aborted), so an undone admission
    /// is never counted.
    pub hits: Option<(usize, usize, usize, usize)>,
    /// Pages loaded back by this admission.
    pub loaded: usize,
}

pub(crate) struct Parts {
    pub cfg: HiCacheConfig,
    pub shape: KvShape,
    pub namespace: Namespace,
    pub tree: HiRadixTree,
    pub device_pool: Arc<DevicePool>,
    pub host_pool: Arc<HostPool>,
    pub engine: TransferEngine,
    pub counter: Arc<LayerDoneCounter>,
    pub rank: Arc<dyn RankGroup>,
    pub metrics: Arc<Metrics>,
    pub registry: Arc<Registry>,
    pub endpoints: crate::observe::Endpoints,
}

/// The hierarchical KV cache of one rank: tree, pools, transfer engine, L3 and the pipelines
/// between them. See the crate documentation for the call sequence of one scheduler tick.
pub struct HiCache {
    pub(crate) cfg: HiCacheConfig,
    pub(crate) shape: KvShape,
    pub(crate) namespace: Namespace,
    pub(crate) tree: HiRadixTree,
    pub(crate) device_pool: Arc<DevicePool>,
    pub(crate) host_pool: Arc<HostPool>,
    pub(crate) engine: TransferEngine,
    pub(crate) counter: Arc<LayerDoneCounter>,
    pub(crate) rank: Arc<dyn RankGroup>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) registry: Arc<Registry>,
    pub(crate) requests: HashMap<RequestId, Request>,
    /// Nodes due for write-through, launched as one D2H batch at the next poll.
    pub(crate) due_writes: Vec<NodeId>,
    /// Launched D2H batches, oldest first.
    pub(crate) writes: VecDeque<WriteBatch>,
    /// Load-backs committed by admissions of this tick, launched by `start_loading`.
    pub(crate) queued_loads: Vec<QueuedLoad>,
    /// Launched H2D batches, oldest first.
    pub(crate) loads: VecDeque<LoadBatch>,
    /// Host pages every rank is known to have free (agreed at the last poll, minus what this
    /// rank allocated since, plus what it freed deterministically since).
    pub(crate) host_budget: usize,
    pub(crate) l3: Option<L3>,
    pub(crate) compute_stream: Option<Stream>,
    pub(crate) closed: bool,
    pub(crate) events: Vec<KvEvent>,
    /// KV-event publisher and metrics endpoint (stopped when the cache is dropped).
    pub(crate) endpoints: crate::observe::Endpoints,
}

impl std::fmt::Debug for HiCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HiCache")
            .field("page_size", &self.cfg.page_size)
            .field("device_pages", &self.device_pool.num_pages())
            .field("host_pages", &self.host_pool.num_pages())
            .field("requests", &self.requests.len())
            .field("l3", &self.l3.as_ref().map(|l| l.backend_name()))
            .finish_non_exhaustive()
    }
}

impl HiCache {
    /// Starts building a cache with `cfg`.
    pub fn builder(cfg: HiCacheConfig) -> crate::HiCacheBuilder {
        crate::HiCacheBuilder::new(cfg)
    }

    pub(crate) fn assemble(p: Parts) -> Self {
        let host_budget = p.host_pool.available();
        Self {
            cfg: p.cfg,
            shape: p.shape,
            namespace: p.namespace,
            tree: p.tree,
            device_pool: p.device_pool,
            host_pool: p.host_pool,
            engine: p.engine,
            counter: p.counter,
            rank: p.rank,
            metrics: p.metrics,
            registry: p.registry,
            requests: HashMap::new(),
            due_writes: Vec::new(),
            writes: VecDeque::new(),
            queued_loads: Vec::new(),
            loads: VecDeque::new(),
            host_budget,
            l3: None,
            compute_stream: None,
            closed: false,
            events: Vec::new(),
            endpoints: p.endpoints,
        }
    }

    // ----- accessors -------------------------------------------------------------------------

    /// The configuration.
    pub fn config(&self) -> &HiCacheConfig {
        &self.cfg
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.cfg.page_size as usize
    }

    /// The KV shape.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// The L3 namespace of this rank.
    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    /// The device pool (the engine reads and writes KV through it, or through its own
    /// registered buffers).
    pub fn device_pool(&self) -> &Arc<DevicePool> {
        &self.device_pool
    }

    /// The host pool.
    pub fn host_pool(&self) -> &Arc<HostPool> {
        &self.host_pool
    }

    /// The counter the engine's attention layers wait on (`set_consumer` with the id
    /// [`HiCache::start_loading`] returned, then `wait_until(layer)` or `stream_wait`).
    pub fn layer_done_counter(&self) -> &Arc<LayerDoneCounter> {
        &self.counter
    }

    /// The transfer engine (for benches and engines that run their own copies on its
    /// streams).
    pub fn transfer_engine(&self) -> &TransferEngine {
        &self.engine
    }

    /// The tree (read-only: for inspection, tests and reports).
    pub fn tree(&self) -> &HiRadixTree {
        &self.tree
    }

    /// Metrics of this cache.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Prometheus text of every metric.
    pub fn render_metrics(&self) -> String {
        self.refresh_gauges();
        self.metrics.render()
    }

    /// KV events collected since the last call (with `enable_kv_events`). With a publisher
    /// (`kv_events_config`), every poll hands its events to the publisher, so this returns only
    /// the events since the last poll.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        let mut out = std::mem::take(&mut self.events);
        out.extend(self.tree.drain_events());
        out
    }

    /// Publishes the events collected since the last call (end of every poll, when a publisher
    /// runs), L3 events under the attached backend's medium.
    pub(crate) fn publish_events(&mut self) {
        if !self.endpoints.publishes() {
            return;
        }
        let events = self.drain_events();
        if events.is_empty() {
            return;
        }
        let l3 = self
            .l3
            .as_ref()
            .map_or(crate::observe::wire::L3Medium::External, |l| {
                crate::observe::wire::L3Medium::of_backend(&l.backend_name())
            });
        self.endpoints.publish(&events, l3);
    }

    /// The bound KV-event PUB endpoint (`tcp://IP:PORT`), when a publisher runs.
    pub fn kv_events_endpoint(&self) -> Option<&str> {
        self.endpoints.kv_events().map(|p| p.endpoint())
    }

    /// The bound KV-event replay endpoint, when configured.
    pub fn kv_events_replay_endpoint(&self) -> Option<&str> {
        self.endpoints.kv_events().and_then(|p| p.replay_endpoint())
    }

    /// The bound metrics endpoint address, when `metrics_addr` is set.
    pub fn metrics_endpoint(&self) -> Option<std::net::SocketAddr> {
        self.endpoints.metrics().map(|m| m.addr())
    }

    /// The rank group.
    pub fn rank_group(&self) -> &Arc<dyn RankGroup> {
        &self.rank
    }

    /// Free device pages.
    pub fn device_pages_free(&self) -> usize {
        self.device_pool.available()
    }

    /// Live requests (arrived and not finished or aborted).
    pub fn live_requests(&self) -> usize {
        self.requests.len()
    }

    /// Makes every D2H backup wait for the work queued so far on the engine's compute stream
    /// (the forward pass that wrote the pages). Without it the engine must make sure pages
    /// are written before `cache_finished`.
    pub fn set_compute_stream(&mut self, stream: Stream) {
        self.compute_stream = Some(stream);
    }

    pub(crate) fn check_open(&self) -> Result<()> {
        if self.closed {
            Err(HiCacheError::Closed)
        } else {
            Ok(())
        }
    }

    pub(crate) fn refresh_gauges(&self) {
        self.metrics
            .set_resident(Tier::l1, self.tree.device_pages() as u64);
        self.metrics
            .set_resident(Tier::l2, self.tree.host_pages() as u64);
    }

    fn aligned<'t>(&self, tokens: &'t [u32]) -> &'t [u32] {
        hicache_core::page_aligned(tokens, self.cfg.page_size)
    }

    // ----- tenants and requests ---------------------------------------------------------------

    /// The tenant for an extra key (e.g. a LoRA id) and a cache salt; tenants never share
    /// cached pages, in any tier.
    pub fn tenant(
        &mut self,
        extra_key: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<TenantId> {
        Ok(self.tree.tenant(extra_key, cache_salt)?)
    }

    /// A request arrived (default tenant). See [`HiCache::arrive_for`].
    pub fn arrive(&mut self, req: RequestId, tokens: &[u32]) -> Result<Arrival> {
        let tenant = self.tree.tenant(None, None)?;
        self.arrive_for(req, tenant, tokens)
    }

    /// Sets a request's priority (default 0; higher is kept longer): the pages it inserts carry
    /// it, and with `eviction_policy = priority` the lowest-priority pages are evicted first
    /// (ties by recency), as SGLang's `--radix-eviction-policy priority` with `req.priority`.
    pub fn set_priority(&mut self, req: RequestId, priority: i32) -> Result<()> {
        let r = self
            .requests
            .get_mut(&req)
            .ok_or_else(|| HiCacheError::request(req, "unknown request"))?;
        r.priority = priority;
        Ok(())
    }

    /// A request of `tenant` arrived: matches its prompt and, with L3, starts prefetching
    /// the part cached in neither L1 nor L2 (if it is at least `prefetch_threshold` tokens).
    /// Tokens past the last whole page are ignored. An empty prompt is an error.
    pub fn arrive_for(
        &mut self,
        req: RequestId,
        tenant: TenantId,
        tokens: &[u32],
    ) -> Result<Arrival> {
        self.check_open()?;
        if self.requests.contains_key(&req) {
            return Err(HiCacheError::request(req, "already arrived"));
        }
        if tokens.is_empty() {
            return Err(HiCacheError::request(req, "empty prompt"));
        }
        let key = self.aligned(tokens);
        let m = self.tree.match_prefix(tenant, key)?;
        let mut arrival = Arrival {
            device_pages: m.device_pages(),
            host_pages: m.host_hit_pages,
            prefetch_pages: 0,
        };
        let mut request = Request {
            tenant,
            prefetch: None,
            storage_pages: 0,
            admitted: None,
            carried_loaded: 0,
            prompt_tokens: tokens.len(),
            priority: 0,
        };
        if self.l3.is_some() {
            let matched = m.device_pages() + m.host_hit_pages;
            if let Some((seq, pages)) = self.start_prefetch(req, tenant, key, &m, matched)? {
                request.prefetch = Some(seq);
                arrival.prefetch_pages = pages;
            }
        }
        self.requests.insert(req, request);
        Ok(arrival)
    }

    /// Whether the request may be admitted now: true unless its L3 prefetch is still
    /// running under the prefetch policy. Decided (identically on every rank) by
    /// [`HiCache::poll`]; calling this performs no collective.
    pub fn prefetch_ready(&self, req: RequestId) -> Result<bool> {
        let r = self
            .requests
            .get(&req)
            .ok_or_else(|| HiCacheError::request(req, "unknown request"))?;
        Ok(r.prefetch.is_none())
    }

    /// Admits a request: matches its prompt again (now including pages its prefetch
    /// brought), loads the host-resident part of the match back to device (allocating device
    /// pages, evicting if needed; launched by [`HiCache::start_loading`]) and locks the
    /// cached prefix for the request. A load-back that finds no device room falls back to the
    /// device-resident prefix (the rest is recomputed).
    pub fn admit(&mut self, req: RequestId, tokens: &[u32]) -> Result<Admission> {
        self.admit_with_quota(req, tokens, None)
    }

    /// [`HiCache::admit`] with SGLang's `mem_quota`: the device pages the scheduler can spend
    /// on this request. A load-back longer than the quota (less the pages the admission newly
    /// locks) is not done and the host-resident part is recomputed; `None` is unlimited.
    pub fn admit_with_quota(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        mem_quota_pages: Option<usize>,
    ) -> Result<Admission> {
        self.check_open()?;
        let (tenant, storage_pages, carried, prompt_tokens) = {
            let r = self
                .requests
                .get(&req)
                .ok_or_else(|| HiCacheError::request(req, "unknown request"))?;
            if r.admitted.is_some() {
                return Err(HiCacheError::request(req, "already admitted"));
            }
            if r.prefetch.is_some() {
                return Err(HiCacheError::request(
                    req,
                    "its L3 prefetch is still running (check prefetch_ready)",
                ));
            }
            (r.tenant, r.storage_pages, r.carried_loaded, r.prompt_tokens)
        };
        let key = self.aligned(tokens);
        let m = self.tree.match_prefix(tenant, key)?;
        // Pages an undone admission loaded are at the end of the device prefix now.
        let carried = carried.min(m.device_pages());
        let mut prefix: Vec<DeviceSlot> = m.device_slots.clone();
        let mut lock = m.last_device_node;
        let mut loaded = 0;
        if m.host_hit_pages > 0
            && let Some(plan) = self.tree.plan_load_back(m.last_node, mem_quota_pages)?
        {
            let pages = plan.pages();
            match self.alloc_device_pages(pages)? {
                Some(slots) => {
                    let host = plan.host_slots().to_vec();
                    let node = plan.node();
                    let load_id = self.tree.commit_load_back(plan, &slots)?;
                    prefix.extend_from_slice(&slots);
                    self.queued_loads.push(QueuedLoad {
                        load_id,
                        host,
                        device: slots,
                    });
                    lock = node;
                    loaded = pages;
                }
                None => {
                    tracing::debug!(req, pages, "no device room for a load-back; recomputing");
                    self.tree.abort_load_back(plan)?;
                }
            }
        }
        self.tree.lock(lock)?;
        let from_host = loaded + carried;
        let storage = storage_pages.min(from_host);
        let admission = Admission {
            device_pages: m.device_pages() - carried,
            host_pages: from_host - storage,
            storage_pages: storage,
            prefix_slots: prefix,
        };
        let r = self.requests.get_mut(&req).expect("checked above");
        r.admitted = Some(Admitted {
            lock,
            shared_pages: admission.prefix_slots.len(),
            hits: Some((
                admission.device_pages,
                admission.host_pages,
                admission.storage_pages,
                prompt_tokens,
            )),
            loaded,
        });
        Ok(admission)
    }

    /// Undoes an admission the engine could not complete (e.g. no device room for the rest of
    /// the request): unlocks the prefix; the request stays live and may be admitted again.
    /// Pages loaded back for it stay cached (their copy is launched by the next
    /// `start_loading`).
    pub fn unadmit(&mut self, req: RequestId) -> Result<()> {
        self.check_open()?;
        let a = self.admitted(req)?;
        self.tree.unlock(a.lock)?;
        let r = self.requests.get_mut(&req).expect("admitted");
        r.admitted = None;
        r.carried_loaded += a.loaded;
        Ok(())
    }

    /// Allocates `pages` device pages for new tokens, evicting cached pages if needed.
    /// `None` when even eviction cannot free enough (pinned pages).
    pub fn alloc_device(&mut self, pages: usize) -> Result<Option<Vec<DeviceSlot>>> {
        self.check_open()?;
        self.alloc_device_pages(pages)
    }

    pub(crate) fn alloc_device_pages(&mut self, pages: usize) -> Result<Option<Vec<DeviceSlot>>> {
        if pages == 0 {
            return Ok(Some(Vec::new()));
        }
        let free = self.device_pool.available();
        if free < pages {
            self.evict_device(pages - free)?;
        }
        Ok(self.device_pool.alloc(pages))
    }

    /// Returns device pages the engine allocated and does not hand to the tree (e.g. those of
    /// an aborted request). Freeing a page the tree owns is an error of the pool (double
    /// free) only if it was freed already; the engine must not free tree pages.
    pub fn free_device(&mut self, slots: &[DeviceSlot]) -> Result<()> {
        self.device_pool.free(slots)?;
        Ok(())
    }

    /// A request finished: inserts its tokens (prompt and output) with its device slots, one
    /// per page including a final partial page, frees the slots the tree already had (and
    /// the partial page's), unlocks the request's prefix and removes the request. Nodes due
    /// for write-through are backed up at the next poll, in one batch.
    pub fn cache_finished(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        slots: &[DeviceSlot],
    ) -> Result<()> {
        self.check_open()?;
        let admitted = self.admitted(req)?;
        let tenant = self.requests[&req].tenant;
        self.check_slots(req, tokens, slots, admitted.shared_pages)?;
        let key = self.aligned(tokens);
        let n = key.len() / self.page_size();
        let priority = self.requests[&req].priority;
        let res = self.tree.insert(
            tenant,
            key,
            &slots[..n],
            InsertOptions {
                priority,
                ..Default::default()
            },
        )?;
        self.tree.unlock(admitted.lock)?;
        self.record_hits(admitted);
        let lo = admitted.shared_pages.min(res.prefix_pages);
        let mut free: Vec<DeviceSlot> = slots[lo..res.prefix_pages].to_vec();
        free.extend_from_slice(&slots[n..]);
        self.device_pool.free(&free)?;
        self.due_writes.extend(res.write_through);
        self.requests.remove(&req);
        Ok(())
    }

    /// A chunk of a request's prefill is done (chunked prefill): inserts what exists so far
    /// (hit counts are not bumped), frees duplicate slots and moves the request's lock to the
    /// new last node. Returns the request's slot list from now on: the tree's slots for the
    /// cached pages, then the request's own slots for the rest (including a partial page).
    pub fn cache_unfinished(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        slots: &[DeviceSlot],
    ) -> Result<Vec<DeviceSlot>> {
        self.check_open()?;
        let admitted = self.admitted(req)?;
        let tenant = self.requests[&req].tenant;
        self.check_slots(req, tokens, slots, admitted.shared_pages)?;
        let key = self.aligned(tokens);
        let n = key.len() / self.page_size();
        let res = self.tree.insert(
            tenant,
            key,
            &slots[..n],
            InsertOptions {
                chunked: true,
                priority: self.requests[&req].priority,
            },
        )?;
        let lo = admitted.shared_pages.min(res.prefix_pages);
        self.device_pool.free(&slots[lo..res.prefix_pages])?;
        let m = self.tree.match_prefix(tenant, key)?;
        debug_assert_eq!(m.device_pages(), n, "inserted pages are on device");
        self.tree.lock(m.last_node)?;
        self.tree.unlock(admitted.lock)?;
        let mut out = m.device_slots;
        out.extend_from_slice(&slots[n..]);
        self.record_hits(admitted);
        let r = self.requests.get_mut(&req).expect("admitted above");
        r.admitted = Some(Admitted {
            lock: m.last_node,
            shared_pages: n,
            hits: None,
            loaded: 0,
        });
        self.due_writes.extend(res.write_through);
        Ok(out)
    }

    /// Drops a request at any stage: revokes its prefetch (pages already fetched are
    /// released), unlocks its prefix. The engine frees its own device slots
    /// ([`HiCache::free_device`]); the prefix slots of the admission belong to the tree.
    pub fn abort(&mut self, req: RequestId) -> Result<()> {
        self.check_open()?;
        let r = self
            .requests
            .remove(&req)
            .ok_or_else(|| HiCacheError::request(req, "unknown request"))?;
        if let Some(seq) = r.prefetch {
            self.abort_prefetch(seq)?;
        }
        if let Some(a) = r.admitted {
            self.tree.unlock(a.lock)?;
            self.record_hits(a);
        }
        Ok(())
    }

    /// Records an admission's hits in the metrics, once.
    fn record_hits(&self, a: Admitted) {
        if let Some((l1, l2, l3, tokens)) = a.hits {
            let ps = self.cfg.page_size as u64;
            self.metrics.request(tokens as u64);
            self.metrics.hit(Tier::l1, l1 as u64 * ps);
            self.metrics.hit(Tier::l2, l2 as u64 * ps);
            self.metrics.hit(Tier::l3, l3 as u64 * ps);
        }
    }

    /// Pages this request's L3 prefetch inserted into the tree (0 while it runs or without
    /// one).
    pub fn prefetched_pages(&self, req: RequestId) -> Result<usize> {
        Ok(self
            .requests
            .get(&req)
            .ok_or_else(|| HiCacheError::request(req, "unknown request"))?
            .storage_pages)
    }

    fn admitted(&self, req: RequestId) -> Result<Admitted> {
        self.requests
            .get(&req)
            .ok_or_else(|| HiCacheError::request(req, "unknown request (finished twice?)"))?
            .admitted
            .ok_or_else(|| HiCacheError::request(req, "not admitted"))
    }

    fn check_slots(
        &self,
        req: RequestId,
        tokens: &[u32],
        slots: &[DeviceSlot],
        shared: usize,
    ) -> Result<()> {
        let ps = self.page_size();
        let want = tokens.len().div_ceil(ps);
        if slots.len() != want {
            return Err(HiCacheError::request(
                req,
                format!(
                    "{} slots for {} tokens: expected one per page ({want})",
                    slots.len(),
                    tokens.len()
                ),
            ));
        }
        if shared > tokens.len() / ps {
            return Err(HiCacheError::request(
                req,
                format!(
                    "{} tokens do not cover the {shared} cached pages it was admitted with",
                    tokens.len()
                ),
            ));
        }
        // The tree takes these slots: a slot that is not an allocated device page, or given
        // twice, would end up freed twice (and its page reused while cached).
        let mut seen = std::collections::HashSet::with_capacity(slots.len());
        for (page, &slot) in slots.iter().enumerate() {
            if !self.device_pool.is_allocated(slot) {
                return Err(HiCacheError::request(
                    req,
                    format!(
                        "slot {slot} of page {page} is not an allocated device page (pool of {})",
                        self.device_pool.num_pages()
                    ),
                ));
            }
            if !seen.insert(slot) {
                return Err(HiCacheError::request(
                    req,
                    format!("slot {slot} is given twice (again for page {page})"),
                ));
            }
        }
        Ok(())
    }

    // ----- eviction ------------------------------------------------------------------------

    /// Evicts at least `pages` device pages if possible (whole nodes, so possibly more):
    /// backed-up nodes are demoted to host, others deleted, and under write-back staged to
    /// host first. Returns the pages freed.
    pub fn evict(&mut self, pages: usize) -> Result<usize> {
        self.check_open()?;
        self.evict_device(pages)
    }

    pub(crate) fn evict_device(&mut self, pages: usize) -> Result<usize> {
        let mut host = crate::write::BudgetHost {
            pool: &self.host_pool,
            budget: &mut self.host_budget,
            failed: false,
        };
        let out = self.tree.evict(pages, &mut host);
        self.device_pool.free(&out.device_slots)?;
        self.metrics
            .evicted(Tier::l1, (out.demoted_pages + out.deleted_pages) as u64);
        if out.dropped_pages > 0 {
            self.metrics.dropped(
                crate::metrics::DropReason::host_pressure,
                (out.dropped_pages * self.page_size()) as u64,
            );
            tracing::warn!(
                pages = out.dropped_pages,
                "write-back eviction found the host pool full: dropped cached pages"
            );
        }
        if !out.write_back.is_empty() {
            self.write_back_staged(out.write_back)?;
        }
        Ok(out.freed_pages)
    }

    /// Evicts at least `pages` host pages of nodes that are not on device (whole nodes).
    /// Returns the pages freed.
    pub(crate) fn evict_host(&mut self, pages: usize) -> Result<usize> {
        let out = self.tree.evict_host(pages);
        self.host_pool.free(&out.host_slots)?;
        self.host_budget += out.host_slots.len();
        self.metrics.evicted(Tier::l2, out.freed_pages as u64);
        Ok(out.freed_pages)
    }

    /// Allocates `pages` host pages within the agreed budget, evicting host-only nodes if
    /// needed; `None` if not possible.
    pub(crate) fn alloc_host(&mut self, pages: usize) -> Result<Option<Vec<HostSlot>>> {
        if pages == 0 {
            return Ok(Some(Vec::new()));
        }
        if self.host_budget < pages {
            let need = pages - self.host_budget;
            self.evict_host(need)?;
        }
        if self.host_budget < pages {
            return Ok(None);
        }
        match self.host_pool.alloc(pages) {
            Some(v) => {
                self.host_budget -= pages;
                Ok(Some(v))
            }
            None => Ok(None),
        }
    }

    /// Frees host pages this rank's engine thread decided to free (deterministic on every
    /// rank), returning them to the budget.
    pub(crate) fn free_host(&mut self, slots: &[HostSlot]) -> Result<()> {
        self.host_pool.free(slots)?;
        self.host_budget += slots.len();
        Ok(())
    }

    pub(crate) fn write_ids_done(&mut self, ids: &[WriteId], started: Instant) -> Result<()> {
        let mut pages = 0u64;
        for &id in ids {
            let fin = self.tree.finish_backup(id)?;
            let slots = fin.host_slots();
            pages += slots.len() as u64;
            if self.l3.is_some() {
                self.start_backup(fin)?;
            }
        }
        let bytes = pages * self.shape.page_bytes() as u64;
        self.metrics.transfer(
            crate::metrics::Direction::d2h,
            pages,
            bytes,
            started.elapsed().as_secs_f64(),
        );
        Ok(())
    }
}
