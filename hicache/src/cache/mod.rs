//! [`HiCache`]: the cache controller the engine drives. It owns the parts and wires them
//! together; each part owns its state:
//!
//! - [`Tiers`]: the tree, the device and host pools, the agreed host budget, the metrics;
//! - [`Copies`]: the device↔host copy pipelines (write-through, write-back, load-back);
//! - [`L3`]: the attached storage backend with its prefetches and backups;
//! - [`Requests`]: the live requests;
//! - the tick ([`crate::tick`]): the per-poll agreement between ranks.
//!
//! The engine-facing calls are split by concern: requests ([`request_calls`]), the per-tick pump
//! and lifecycle ([`lifecycle`]) and attaching storage ([`storage`]).
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

mod lifecycle;
mod request_calls;
mod storage;

use std::sync::Arc;

use hicache_core::{KvEvent, KvShape, Namespace};
use hicache_gpu::{DevicePool, LayerDoneCounter, Stream};
use hicache_storage::Registry;

use crate::config::HiCacheConfig;
use crate::copies::Copies;
use crate::error::{HiCacheError, Result};
use crate::l3::L3;
use crate::metrics::Metrics;
use crate::rank::RankGroup;
use crate::request_state::Requests;
use crate::tree_pools::Tiers;

/// What the builder hands over.
pub(crate) struct Parts {
    pub cfg: HiCacheConfig,
    pub shape: KvShape,
    pub namespace: Namespace,
    pub tiers: Tiers,
    pub copies: Copies,
    pub rank: Arc<dyn RankGroup>,
    pub registry: Arc<Registry>,
    pub endpoints: crate::observe::Endpoints,
}

/// The hierarchical KV cache of one rank: tree, pools, transfer engine, L3 and the pipelines
/// between them. See the crate documentation for the call sequence of one scheduler tick.
pub struct HiCache {
    cfg: HiCacheConfig,
    shape: KvShape,
    namespace: Namespace,
    rank: Arc<dyn RankGroup>,
    registry: Arc<Registry>,
    tiers: Tiers,
    copies: Copies,
    l3: Option<L3>,
    requests: Requests,
    /// Events besides the tree's (L3 stores, cache cleared), published at the next poll.
    events: Vec<KvEvent>,
    /// KV-event publisher and metrics endpoint (stopped when the cache is dropped).
    endpoints: crate::observe::Endpoints,
    closed: bool,
    /// The per-tick exchange's buffers (prefetch counts), kept from poll to poll so that a
    /// poll allocates nothing for them.
    tick_scratch: crate::agree::Gathered<crate::l3::PrefetchCounts>,
    /// Marks for the repeat check of the slots a finished request hands back, kept from call
    /// to call (all clear between calls).
    slot_marks: hicache_gpu::PageMarks,
}

impl std::fmt::Debug for HiCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HiCache")
            .field("page_size", &self.cfg.page_size)
            .field("device_pages", &self.tiers.device_pool.num_pages())
            .field("host_pages", &self.tiers.host_pool.num_pages())
            .field("requests", &self.requests.len())
            .field("l3", &self.l3.as_ref().map(L3::backend_name))
            .finish_non_exhaustive()
    }
}

impl HiCache {
    /// Starts building a cache with `cfg`.
    pub fn builder(cfg: HiCacheConfig) -> crate::HiCacheBuilder {
        crate::HiCacheBuilder::new(cfg)
    }

    pub(crate) fn assemble(p: Parts) -> Self {
        Self {
            cfg: p.cfg,
            shape: p.shape,
            namespace: p.namespace,
            rank: p.rank,
            registry: p.registry,
            tiers: p.tiers,
            copies: p.copies,
            l3: None,
            requests: Requests::default(),
            events: Vec::new(),
            endpoints: p.endpoints,
            closed: false,
            tick_scratch: Default::default(),
            slot_marks: Default::default(),
        }
    }

    // ----- engine-facing accessors ------------------------------------------------------------

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

    /// The device pool: the KV buffers the engine's attention reads and writes (when the
    /// cache allocated them; an engine that registered its own buffers uses those).
    pub fn device_pool(&self) -> &Arc<DevicePool> {
        &self.tiers.device_pool
    }

    /// The counter the engine's attention layers wait on (`set_consumer` with the id
    /// [`HiCache::start_loading`] returned, then `wait_until(layer)` or `stream_wait`).
    pub fn layer_done_counter(&self) -> &Arc<LayerDoneCounter> {
        self.copies.counter()
    }

    /// Metrics of this cache.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.tiers.metrics
    }

    /// Prometheus text of every metric.
    pub fn render_metrics(&self) -> String {
        self.tiers.refresh_gauges();
        self.tiers.metrics.render()
    }

    /// KV events collected since the last call (with `enable_kv_events`). With a publisher
    /// (`kv_events_config`), every poll hands its events to the publisher, so this returns only
    /// the events since the last poll.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        let mut out = std::mem::take(&mut self.events);
        out.extend(self.tiers.tree.drain_events());
        out
    }

    /// Publishes the events collected since the last call (end of every poll, when a publisher
    /// runs), L3 events under the attached backend's medium.
    fn publish_events(&mut self) {
        if !self.endpoints.publishes() {
            return;
        }
        let events = self.drain_events();
        if events.is_empty() {
            return;
        }
        let backend = self.l3.as_ref().map(|l| l.backend_name());
        let l3 = crate::observe::wire::L3Medium::of_attached(backend.as_deref());
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

    /// Where the KV-event publisher stands (batches queued, published, replayed), when one
    /// runs.
    pub fn kv_events_progress(&self) -> Option<crate::observe::PublisherProgress> {
        self.endpoints.kv_events().map(|p| p.progress())
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
        self.tiers.device_pool.available()
    }

    /// Live requests (arrived and not finished or aborted).
    pub fn live_requests(&self) -> usize {
        self.requests.len()
    }

    /// The name of the attached L3 backend, if any.
    pub fn storage_backend(&self) -> Option<String> {
        self.l3.as_ref().map(L3::backend_name)
    }

    /// Makes every D2H backup wait for the work queued so far on the engine's compute stream
    /// (the forward pass that wrote the pages). Without it the engine must make sure pages
    /// are written before `cache_finished`.
    pub fn set_compute_stream(&mut self, stream: Stream) {
        self.copies.set_compute_stream(stream);
    }

    // ----- figures for benches and dashboards -----------------------------------------------

    /// The tree's counts (nodes, pages per tier, evictable and protected sizes), without the
    /// tree itself.
    pub fn tree_stats(&self) -> hicache_core::TreeStats {
        self.tiers.tree.stats()
    }

    /// One bulk copy of the first `bytes` of the pinned host pool to (or from) `scratch` on
    /// the transfer engine's stream for `dir`, waited for: the physical reference the
    /// controller's page copies (which take the same streams) are measured against.
    pub fn bulk_copy(
        &self,
        dir: hicache_gpu::Direction,
        scratch: &hicache_gpu::DeviceBuffer,
        bytes: usize,
    ) -> Result<()> {
        self.copies
            .engine()
            .bulk_copy(dir, scratch, bytes, &[])?
            .wait()?;
        Ok(())
    }

    // ----- inspection (feature `test-util`) ---------------------------------------------------

    /// The tree (read-only: for inspection, tests and reports).
    #[cfg(feature = "test-util")]
    pub fn tree(&self) -> &hicache_core::HiRadixTree {
        &self.tiers.tree
    }

    /// The host pool.
    #[cfg(feature = "test-util")]
    pub fn host_pool(&self) -> &Arc<hicache_host::HostPool> {
        &self.tiers.host_pool
    }

    /// The transfer engine (for benches that run their own copies on its streams).
    #[cfg(feature = "test-util")]
    pub fn transfer_engine(&self) -> &hicache_gpu::TransferEngine {
        self.copies.engine()
    }

    // ----- helpers ----------------------------------------------------------------------------

    fn check_open(&self) -> Result<()> {
        if self.closed {
            Err(HiCacheError::Closed)
        } else {
            Ok(())
        }
    }

    fn aligned<'t>(&self, tokens: &'t [u32]) -> &'t [u32] {
        hicache_core::page_aligned(tokens, self.cfg.page_size)
    }

    /// Starts the L3 backups of finished writes (dropped without L3).
    fn start_backups(&mut self, finished: Vec<hicache_core::FinishedBackup>) -> Result<()> {
        if let Some(l3) = &mut self.l3 {
            for fin in finished {
                l3.start_backup(fin, &mut self.tiers)?;
            }
        }
        Ok(())
    }

    /// Evicts at least `pages` device pages if possible; nodes staged by write-back eviction
    /// are copied to host (and on to L3) first. Returns the pages freed.
    fn evict_device(&mut self, pages: usize) -> Result<usize> {
        let (freed, staged) = self.tiers.evict_device(pages)?;
        if !staged.is_empty() {
            let finished = self.copies.write_back_staged(staged, &mut self.tiers)?;
            self.start_backups(finished)?;
        }
        Ok(freed)
    }

    /// Allocates `pages` device pages, evicting cached pages if needed.
    fn alloc_device_pages(
        &mut self,
        pages: usize,
    ) -> Result<Option<Vec<hicache_core::DeviceSlot>>> {
        if pages == 0 {
            return Ok(Some(Vec::new()));
        }
        let free = self.tiers.device_pool.available();
        if free < pages {
            self.evict_device(pages - free)?;
        }
        Ok(self.tiers.device_pool.alloc(pages))
    }
}
