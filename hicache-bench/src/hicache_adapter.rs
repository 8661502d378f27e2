//! The `hicache` controller as the cache under test of the simulated engine: implements
//! [`CacheUnderTest`] for [`HiCache`] and [`CacheFactory`] for building it from a
//! [`CacheSetup`].
//!
//! How the engine's rules (see [`crate::sim::cache`]) map onto the controller:
//! 1. The prefix is matched on `tokens[..len - 1]` (page-aligned), so it never covers the last
//!    prompt token.
//! 2. Admission is all or nothing: `admit` then `alloc_device` for the rest; when the rest does
//!    not fit, `unadmit` undoes the admission (the request stays, its hits are not counted).
//! 3. `cache_finished` takes every slot back.
//! 4. Hits are recorded by the controller once an admission is final.
//! 5. `poll` first waits for the copies and L3 backups already launched (the engine models
//!    transfer time itself), so a run does not depend on how fast this machine copies.

use std::sync::Arc;

use hicache::{Device, HiCache, HiCacheConfig, IoBackendKind, LayerDoneCounter};
use hicache_gpu::IoBackend;

use crate::error::{BenchError, Result};
use crate::setup::{CacheFactory, CacheSetup, DeviceKind, HostSize};
use crate::sim::cache::{
    Admission, CacheError, CacheResult, CacheStats, CacheUnderTest, DeviceSlot, PrefetchStatus,
    RequestId, TransferStats,
};

/// Builds `HiCache` instances for the main job.
#[derive(Debug, Default, Clone, Copy)]
pub struct HiCacheFactory;

/// The adapter.
pub struct HiCacheUnderTest {
    cache: HiCache,
    counter: Arc<LayerDoneCounter>,
    consumer: Option<usize>,
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
                .map_err(|e| BenchError::Usage(format!("extra-config: {e}")))?,
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
        ..Default::default()
    })
}

impl CacheFactory for HiCacheFactory {
    fn build(&self, setup: &CacheSetup) -> Result<Box<dyn CacheUnderTest>> {
        let cfg = config_for(setup)?;
        let device = match setup.device {
            DeviceKind::Sim => Device::sim(),
            DeviceKind::Cuda => {
                Device::cuda(0).map_err(|e| BenchError::Usage(format!("--device cuda: {e}")))?
            }
        };
        let cache = HiCache::builder(cfg)
            .shape(setup.kv_shape)
            .device(device)
            .device_pages(setup.device_pages)
            .build()
            .map_err(|e| BenchError::Usage(format!("cannot build the cache: {e}")))?;
        if let Some(addr) = cache.metrics_endpoint() {
            eprintln!("metrics: http://{addr}/metrics");
        }
        if let Some(ep) = cache.kv_events_endpoint() {
            let replay = cache.kv_events_replay_endpoint().unwrap_or("none");
            eprintln!("kv events: {ep} (replay: {replay})");
        }
        let counter = cache.layer_done_counter().clone();
        Ok(Box::new(HiCacheUnderTest {
            cache,
            counter,
            consumer: None,
        }))
    }
}

fn transfer(t: hicache::metrics::TransferTotals) -> TransferStats {
    TransferStats {
        pages: t.pages,
        bytes: t.bytes,
        seconds: t.seconds,
        batches: t.batches,
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
        self.cache.drain().map_err(err)
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
            })),
            None => {
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
        self.cache.shutdown().map_err(err)
    }

    fn stats(&self) -> CacheStats {
        let m = self.cache.metrics().snapshot();
        CacheStats {
            page_bytes: self.cache.shape().page_bytes() as u64,
            d2h: transfer(m.d2h),
            h2d: transfer(m.h2d),
            l2_to_l3: transfer(m.l2_to_l3),
            l3_to_l2: transfer(m.l3_to_l2),
            hit_tokens_l1: m.hit_tokens_l1,
            hit_tokens_l2: m.hit_tokens_l2,
            hit_tokens_l3: m.hit_tokens_l3,
            request_tokens: m.request_tokens,
            prefetch_completed: m.prefetch_completed,
            prefetch_partial: m.prefetch_partial,
            prefetch_below_threshold: m.prefetch_below_threshold,
            prefetch_rate_limited: m.prefetch_rate_limited,
            prefetch_no_host_memory: m.prefetch_no_host_memory,
            prefetch_failed: m.prefetch_failed,
            dropped_tokens: m.dropped_tokens,
            evicted_pages_l1: m.evicted_pages_l1,
            evicted_pages_l2: m.evicted_pages_l2,
        }
    }
}
