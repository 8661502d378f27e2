//! The `hicache` controller as the cache under test of the simulated engine: implements
//! [`CacheUnderTest`] for [`HiCache`] and [`CacheFactory`] for building it from a
//! [`CacheSetup`].
//!
//! How the engine's rules (see [`crate::cache`]) map onto the controller:
//! 1. The prefix is matched on `tokens[..len - 1]` (page-aligned), so it never covers the last
//!    prompt token.
//! 2. Admission is all or nothing: `admit` then `alloc_device` for the rest; when the rest does
//!    not fit, `unadmit` undoes the admission (the request stays, its hits are not counted).
//! 3. `cache_finished` takes every slot back.
//! 4. Hits are recorded by the controller once an admission is final.
//! 5. Copy time ([`crate::links`]): `advance` times every write-through batch on the
//!    D2H link and every window of L3 backups on the L3 link when they launch, and lets the
//!    controller finish them (and lookups see the backed-up pages) only once the clock has
//!    reached their completion ([`crate::copy_gate`]). Before it moves the clock it waits in
//!    wall time until every launched copy, backup and lookup has really finished, so a run
//!    does not depend on how fast this machine copies. With copy time `free` it drains
//!    everything instead, while the clock stands still (the upper-bound model).

use std::sync::Arc;
use std::time::{Duration, Instant};

use hicache::{
    Device, HiCache, HiCacheConfig, HostMemoryMode, IoBackendKind, LayerDoneCounter,
    StorageWriteMode,
};
use hicache_gpu::IoBackend;

use crate::cache::{
    Admission, CacheError, CacheResult, CacheStats, CacheUnderTest, DeviceSlot, KvEventsState,
    PrefetchStatus, RequestId,
};
use crate::copy_gate::{CopyTimer, Gated, advance_gated};
use crate::error::{Result, SimError};
use crate::links::Links;
use crate::setup::{CacheFactory, CacheSetup, DeviceKind, HostSize, PayloadUsed, TieringMode};

/// Longest wall time `advance` waits for launched work to finish before it gives up.
const QUIET_LIMIT: Duration = Duration::from_secs(300);

/// Builds `HiCache` instances for the main job.
#[derive(Debug, Default, Clone, Copy)]
pub struct HiCacheFactory;

/// The adapter.
pub struct HiCacheUnderTest {
    cache: HiCache,
    counter: Arc<LayerDoneCounter>,
    consumer: Option<usize>,
    timer: CopyTimer,
    page_bytes: u64,
    refused_during_copies: u64,
    payload: PayloadUsed,
}

fn err(e: hicache::HiCacheError) -> CacheError {
    CacheError(e.to_string())
}

/// The `HiCacheConfig` for a setup.
pub fn config_for(setup: &CacheSetup) -> Result<HiCacheConfig> {
    let (ratio, size) = match setup.host_size {
        HostSize::Ratio(r) => (r, 0.0),
        HostSize::Gigabytes(g) => (2.0, g),
    };
    let storage = setup.tiers.storage.then(|| setup.storage.clone());
    let extra = match &storage {
        Some(s) if !s.extra_config.is_empty() => Some(
            serde_json::to_string(&s.extra_config)
                .map_err(|e| SimError::Usage(format!("extra-config: {e}")))?,
        ),
        _ => None,
    };
    Ok(HiCacheConfig {
        enable_hierarchical_cache: setup.tiers.host,
        page_size: setup.kv_shape.page_size,
        hicache_ratio: ratio,
        hicache_size: size,
        write_policy: setup.write_policy,
        io_backend: match setup.io_backend {
            IoBackend::Kernel => IoBackendKind::Kernel,
            IoBackend::Direct => IoBackendKind::Direct,
        },
        mem_layout: setup.mem_layout,
        storage_backend: storage.map(|s| s.backend),
        storage_prefetch_policy: setup.prefetch_policy,
        storage_backend_extra_config: extra,
        eviction_policy: setup.eviction_policy,
        metrics_addr: setup.observe.metrics_addr.clone(),
        kv_events_config: setup.observe.kv_events.clone(),
        hicache_host_memory_mode: match setup.tiers.mode {
            TieringMode::BufferOnly if setup.tiers.storage => HostMemoryMode::BufferOnly,
            _ => HostMemoryMode::Cache,
        },
        storage_write_mode: match setup.tiers.mode {
            TieringMode::Exclusive if setup.tiers.storage => StorageWriteMode::Exclusive,
            _ => StorageWriteMode::Inclusive,
        },
        ..Default::default()
    })
}

impl CacheFactory for HiCacheFactory {
    fn build(&self, setup: &CacheSetup) -> Result<Box<dyn CacheUnderTest>> {
        Ok(Box::new(HiCacheUnderTest::build(setup, false)?))
    }
}

impl HiCacheUnderTest {
    /// The cache of `setup`; with `kv_events`, it collects KV events for
    /// [`drain_kv_events`](Self::drain_kv_events) (the fleet simulation feeds them to its
    /// index).
    pub fn build(setup: &CacheSetup, kv_events: bool) -> Result<Self> {
        let mut cfg = config_for(setup)?;
        cfg.enable_kv_events |= kv_events;
        let device = match setup.device {
            DeviceKind::Sim => setup.sim_device(),
            DeviceKind::Cuda => {
                Device::cuda(0).map_err(|e| SimError::Usage(format!("--device cuda: {e}")))?
            }
        };
        let timer = CopyTimer::default();
        let registry = hicache::backends::builtin_registry()
            .and_then(|base| match setup.l3_presence_only() {
                true => Ok(crate::presence::presence_registry(&base)?),
                false => Ok(base),
            })
            .and_then(|base| Ok(timer.gated_registry(&base)?))
            .map_err(|e| SimError::Usage(format!("cannot list the backends: {e}")))?;
        let cache = HiCache::builder(cfg)
            .shape(setup.kv_shape)
            .device(device)
            .device_pages(setup.device_pages)
            .rank_group(Arc::new(timer.dense_rank()))
            .registry(Arc::new(registry))
            .build()
            .map_err(|e| SimError::Usage(format!("cannot build the cache: {e}")))?;
        if let Some(addr) = cache.metrics_endpoint() {
            eprintln!("metrics: http://{addr}/metrics");
        }
        if let Some(ep) = cache.kv_events_endpoint() {
            let replay = cache.kv_events_replay_endpoint().unwrap_or("none");
            eprintln!("kv events: {ep} (replay: {replay})");
        }
        let counter = cache.layer_done_counter().clone();
        Ok(HiCacheUnderTest {
            payload: setup.payload_used(),
            page_bytes: cache.shape().page_bytes() as u64,
            cache,
            counter,
            consumer: None,
            timer,
            refused_during_copies: 0,
        })
    }

    /// The cache under test (its tree, its publisher), for checks beside a run.
    pub fn cache(&self) -> &HiCache {
        &self.cache
    }

    /// The KV events the cache collected since the last call (empty unless built with
    /// `kv_events`).
    pub fn drain_kv_events(&mut self) -> Vec<hicache_core::KvEvent> {
        self.cache.drain_events()
    }
}

impl Gated for HiCacheUnderTest {
    fn timer(&self) -> &CopyTimer {
        &self.timer
    }

    /// Waits in wall time until every launched write-through copy, L3 backup and L3 lookup
    /// has really finished (invariant 1 of [`crate::copy_gate`]).
    fn wait_quiet(&mut self) -> CacheResult<()> {
        let started = Instant::now();
        loop {
            let f = self.cache.in_flight().map_err(err)?;
            if f.lookups == 0 && f.writes.iter().chain(&f.backups).all(|&(_, done)| done) {
                return Ok(());
            }
            if started.elapsed() > QUIET_LIMIT {
                return Err(CacheError(format!(
                    "copies still running after {QUIET_LIMIT:?}: {f:?}"
                )));
            }
            std::thread::sleep(crate::poll::pause(started.elapsed()));
        }
    }

    fn tick(&mut self) -> CacheResult<()> {
        self.cache.poll().map(drop).map_err(err)
    }

    /// Times what the last poll launched: new write batches on the D2H link; new backups
    /// join the open window (timed by [`CopyTimer::close_window`]).
    fn time_launches(&mut self, now: f64, links: &mut Links) -> CacheResult<()> {
        let f = self.cache.in_flight().map_err(err)?;
        let writes: Vec<u64> = f
            .writes
            .iter()
            .map(|&(pages, _)| pages as u64 * self.page_bytes)
            .collect();
        self.timer.time_writes(now, links, &writes);
        self.timer.add_backups(f.backups.len());
        Ok(())
    }
}

impl CacheUnderTest for HiCacheUnderTest {
    fn page_size(&self) -> usize {
        self.cache.page_size()
    }

    fn device_pages(&self) -> usize {
        self.cache.device_pool().num_pages()
    }

    fn arrive(&mut self, req: RequestId, tokens: &[u32]) -> CacheResult<()> {
        self.cache.arrive(req, tokens).map(drop).map_err(err)
    }

    fn poll(&mut self) -> CacheResult<()> {
        // Copy time free: every copy counts as complete, every stored page as visible.
        self.timer.open_all();
        self.cache.drain().map_err(err)
    }

    fn advance(&mut self, now: f64, links: &mut Links) -> CacheResult<()> {
        if !links.charged() {
            return self.poll();
        }
        // Lookups started at the old time finish at the old time (invariant 1).
        advance_gated(self, now, links)
    }

    fn next_completion(&self) -> Option<f64> {
        self.timer.next_completion()
    }

    fn prefetch_status(&mut self, req: RequestId) -> CacheResult<PrefetchStatus> {
        if !self.cache.prefetch_ready(req).map_err(err)? {
            return Ok(PrefetchStatus::Pending);
        }
        Ok(PrefetchStatus::Ready {
            l3_pages: self.cache.prefetched_pages(req).map_err(err)?,
        })
    }

    fn admit(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        new_tokens: usize,
    ) -> CacheResult<Option<Admission>> {
        if tokens.is_empty() {
            return Err(CacheError(format!("request {req}: empty prompt")));
        }
        let ps = self.cache.page_size();
        let adm = self
            .cache
            .admit(req, &tokens[..tokens.len() - 1])
            .map_err(err)?;
        let total = (tokens.len() + new_tokens).div_ceil(ps);
        let need = total - adm.prefix_slots.len();
        match self.cache.alloc_device(need).map_err(err)? {
            Some(new_slots) => Ok(Some(Admission {
                l1_pages: adm.device_pages,
                l2_pages: adm.host_pages,
                l3_pages: adm.storage_pages,
                prefix_slots: adm.prefix_slots,
                new_slots,
                load_bytes: None,
            })),
            None => {
                if self.timer.writes_in_flight() > 0 {
                    self.refused_during_copies += 1;
                }
                self.cache.unadmit(req).map_err(err)?;
                Ok(None)
            }
        }
    }

    fn start_loading(&mut self) -> CacheResult<Option<usize>> {
        self.cache.start_loading().map_err(err)
    }

    fn wait_layer(&mut self, idx: usize, layer: usize) -> CacheResult<()> {
        if self.consumer != Some(idx) {
            self.counter
                .set_consumer(idx)
                .map_err(|e| CacheError(e.to_string()))?;
            self.consumer = Some(idx);
        }
        self.counter
            .wait_until(layer)
            .map_err(|e| CacheError(e.to_string()))
    }

    fn cache_finished(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        slots: &[DeviceSlot],
    ) -> CacheResult<()> {
        self.cache.cache_finished(req, tokens, slots).map_err(err)
    }

    fn shutdown(&mut self) -> CacheResult<()> {
        // Whatever is still in flight completes after the last request: nothing waits for it.
        self.timer.close_run();
        self.cache.shutdown().map_err(err)
    }

    fn kv_events(&self) -> Option<KvEventsState> {
        Some(KvEventsState {
            endpoint: self.cache.kv_events_endpoint()?.to_string(),
            replay_endpoint: self.cache.kv_events_replay_endpoint().map(str::to_string),
            progress: self.cache.kv_events_progress()?,
        })
    }

    fn stats(&self) -> CacheStats {
        CacheStats {
            page_bytes: self.cache.shape().page_bytes() as u64,
            metrics: self.cache.metrics().snapshot(),
            l3_pages_in_flight: self.timer.l3_pages_in_flight(),
            refused_during_copies: self.refused_during_copies,
            components: None,
            payload: self.payload,
        }
    }
}
