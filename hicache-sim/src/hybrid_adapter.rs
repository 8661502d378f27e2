//! The `hicache` hybrid controller ([`HybridCache`]) as the cache under test of the simulated
//! engine: [`HybridAdapter`] implements [`CacheUnderTest`] for a hybrid model
//! ([`HybridModel`]: Full-attention KV plus sliding-window KV or a Mamba state per request),
//! and [`HybridFactory`] builds it from a [`CacheSetup`].
//!
//! The engine sees Full pages only; the adapter keeps the rest of each request. How the
//! engine's rules (see [`crate::cache`]) map onto the controller:
//! 1. `HybridCache::admit` matches the prompt but its last token, whole pages.
//! 2. All or nothing, with the host hit counted (SGLang's scheduler): one
//!    `HybridCache::try_admit` reserves the prefix per component (host hits loaded back, the
//!    matched Mamba state copied, or a host one loaded, into a slot of the request) and the
//!    rest together — a Full and an SWA page per page of prompt and answer, and Mamba slots
//!    (the working state, which is the admission's copy when the match has a state, plus
//!    SGLang's two ping-pong checkpoint slots). When they do not fit together it refuses: the request holds nothing
//!    (no lock, no load, no hit counted) and is matched again when the engine admits it on a
//!    later tick, so a host hit is not lost for lack of device room, and hits and loads
//!    count once.
//! 3. `cache_finished` hands the engine's Full slots back with the request's SWA slots and
//!    its Mamba slots (the first checkpoint slot first: the state inserted).
//! 4. Hits per tier are counted by the adapter when an admission is final (the controller's
//!    per-component counters are reported beside them).
//! 5. Copy time: as [`crate::adapter`], on the same machinery ([`CopyTimer`]): `advance`
//!    times each poll's write-through copies (every component's bytes) as one transfer on
//!    the D2H link, and the rank group ([`ClockRank::writes_only`]) lets the controller
//!    finish them only once the clock has reached their completion; L3 pages become visible
//!    to lookups once their backup window has completed on the L3 link ([`GatedStorage`]).
//!    Before the clock moves, `flush` waits in wall time for every launched copy.
//!    The pages a request's L3 prefetch read are reported by `prefetch_status`, and the
//!    engine charges them on its L3 link (Full and SWA pages at the plan's page bytes).
//!
//! [`GatedStorage`]: crate::copy_gate::GatedStorage

use std::collections::HashMap;
use std::sync::Arc;

use hicache::hybrid::HYBRID_EXCHANGE_BACKUPS;
use hicache::metrics::TransferTotals;
use hicache::{
    ComponentTotals, Device, HybridAdmission, HybridCache, HybridConfig, HybridExtent, HybridSlots,
    HybridTotals, StateSlot,
};
use hicache_storage::{BackendContext, Storage, StorageConfig};
use serde_json::Value;

use crate::cache::{
    Admission, CacheError, CacheResult, CacheStats, CacheUnderTest, ComponentMoves, DeviceSlot,
    HybridMoves, PrefetchStatus, RequestId,
};
use crate::copy_gate::{ClockRank, CopyTimer, Gated, advance_gated};
use crate::error::{Result, SimError};
use crate::links::Links;
use crate::model::HybridModel;
use crate::setup::{CacheFactory, CacheSetup, DeviceKind, HostSize, PayloadUsed};

/// Ping-pong checkpoint slots a request of a Mamba hybrid holds beside its working state
/// (SGLang's `extra_buffer` strategy with the overlap schedule on).
pub const TRACKING_SLOTS: usize = 2;

/// Builds [`HybridAdapter`]s for one hybrid model.
#[derive(Clone, Debug)]
pub struct HybridFactory {
    /// The model (its components' shapes).
    pub model: HybridModel,
    /// SWA device pages per Full device page (SGLang's `swa_full_tokens_ratio`); the host
    /// pools keep the same ratio. A request holds an SWA page per page of its prompt and
    /// answer, so below 1 the longest request may not fit.
    pub swa_ratio: f64,
    /// Device Mamba state slots.
    pub mamba_slots: usize,
    /// Host Mamba state slots (with L2).
    pub host_mamba_slots: usize,
}

impl HybridFactory {
    /// `model` with as many SWA pages as Full pages and `mamba_slots` device state slots,
    /// twice as many on host.
    pub fn new(model: HybridModel, mamba_slots: usize) -> Self {
        Self {
            model,
            swa_ratio: 1.0,
            mamba_slots,
            host_mamba_slots: 2 * mamba_slots,
        }
    }

    /// SWA pages for `full` Full pages.
    fn swa_pages(&self, full: usize) -> usize {
        (full as f64 * self.swa_ratio).ceil() as usize
    }

    fn config(&self, page_size: u32, host: bool, prefetch_threshold: usize) -> HybridConfig {
        HybridConfig {
            page_size,
            prefetch_threshold_tokens: prefetch_threshold,
            swa_window: self.model.window,
            // SGLang's `mamba_cache_chunk_size` default (FLA's chunk of 64 tokens).
            mamba_chunk: self.model.linear.as_ref().map(|_| 64),
            write_through: host,
            ..HybridConfig::default()
        }
    }

    /// Host Full pages of `setup` (its ratio or gigabytes, counted in Full + SWA pages).
    fn host_pages(&self, setup: &CacheSetup, ps: u32) -> usize {
        match setup.host_size {
            HostSize::Ratio(r) => (setup.device_pages as f64 * r) as usize,
            HostSize::Gigabytes(g) => {
                let full = self.model.full_kv_shape(ps).page_bytes() as f64;
                let swa = self.model.swa_kv_shape(ps).map_or(0, |s| s.page_bytes()) as f64;
                (g * 1e9 / (full + self.swa_ratio * swa)) as usize
            }
        }
    }

    /// The L3 backend of `setup` behind the timer's gate, and its prefetch threshold in
    /// tokens (the extra-config's `prefetch_threshold`, as the dense cache reads it).
    fn storage(&self, setup: &CacheSetup, timer: &CopyTimer) -> Result<(Arc<dyn Storage>, usize)> {
        let usage = |e: String| SimError::Usage(format!("L3 of the hybrid model: {e}"));
        let s = &setup.storage;
        let config = StorageConfig::from_value(
            Some(&s.backend),
            Value::Object(s.extra_config.clone()),
            "--extra-config",
        )?;
        let registry = hicache::backends::builtin_registry()
            .and_then(|base| match setup.l3_presence_only() {
                true => Ok(crate::presence::presence_registry(&base)?),
                false => Ok(base),
            })
            .map_err(|e| usage(e.to_string()))?;
        let ctx = BackendContext {
            layout: setup.mem_layout,
            ..BackendContext::default()
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| usage(e.to_string()))?;
        let inner = runtime
            .block_on(registry.open(&config, &ctx))
            .map_err(|e| usage(e.to_string()))?;
        Ok((
            timer.gate(inner),
            usize::try_from(config.common.prefetch_threshold).unwrap_or(usize::MAX),
        ))
    }
}

impl CacheFactory for HybridFactory {
    fn build(&self, setup: &CacheSetup) -> Result<Box<dyn CacheUnderTest>> {
        Ok(Box::new(self.build_adapter(setup)?))
    }
}

impl HybridFactory {
    /// A fresh adapter over a fresh cache configured by `setup` (its page size, Full device
    /// pages, host size, tiers, L3 backend and device) for this factory's model.
    pub fn build_adapter(&self, setup: &CacheSetup) -> Result<HybridAdapter> {
        let ps = setup.kv_shape.page_size;
        let device = match setup.device {
            DeviceKind::Sim => setup.sim_device(),
            DeviceKind::Cuda => {
                Device::cuda(0).map_err(|e| SimError::Usage(format!("--device cuda: {e}")))?
            }
        };
        let timer = CopyTimer::default();
        let full = setup.device_pages;
        let host = if setup.tiers.host {
            self.host_pages(setup, ps)
        } else {
            0
        };
        let storage = match setup.tiers.storage {
            true => Some(self.storage(setup, &timer)?),
            false => None,
        };
        let threshold = storage
            .as_ref()
            .map_or(HybridConfig::default().prefetch_threshold_tokens, |s| s.1);
        let mut b = HybridCache::builder(self.config(ps, setup.tiers.host, threshold))
            .full_shape(self.model.full_kv_shape(ps))
            .device(device)
            .device_pages(full, self.swa_pages(full))
            .host_pages(host, self.swa_pages(host))
            .rank_group(Arc::new(ClockRank::writes_only(
                timer.clock.clone(),
                HYBRID_EXCHANGE_BACKUPS,
            )));
        if let Some(s) = self.model.swa_kv_shape(ps) {
            b = b.swa_shape(s);
        }
        if let Some(m) = self.model.mamba_shape() {
            b = b
                .mamba_shape(m)
                .mamba_slots(self.mamba_slots)
                .host_mamba_slots(self.host_mamba_slots);
        }
        if let Some((storage, _)) = storage {
            b = b.storage(storage);
        }
        let cache = b.build().map_err(|e| {
            SimError::Usage(format!("cannot build the {} cache: {e}", self.model.name))
        })?;
        Ok(HybridAdapter::new(cache, &self.model, ps, full, timer)
            .with_payload(setup.payload_used()))
    }
}

/// What the adapter holds for a request the engine does not see.
#[derive(Debug, Default)]
struct Held {
    /// SWA slots, one per page (prefix then new).
    swa: Vec<Option<DeviceSlot>>,
    /// Mamba slots: the checkpoint slots first, then the working state.
    mamba: Vec<StateSlot>,
}

/// Tokens served per tier, counted once per final admission.
#[derive(Debug, Default, Clone, Copy)]
struct Hits {
    l1: u64,
    l2: u64,
    l3: u64,
    requests: u64,
}

/// The adapter (see the module documentation).
pub struct HybridAdapter {
    cache: HybridCache,
    timer: CopyTimer,
    page_size: usize,
    device_pages: usize,
    full_page_bytes: u64,
    has_swa: bool,
    /// Pages of the sliding window (a prefix's SWA pages the request's lock protects).
    window_pages: usize,
    has_mamba: bool,
    held: HashMap<RequestId, Held>,
    hits: Hits,
    d2h_timed: u64,
    refused_during_copies: u64,
    payload: PayloadUsed,
}

fn err(e: hicache::HiCacheError) -> CacheError {
    CacheError(e.to_string())
}

/// Bytes moved in one direction, summed over the components.
fn total(t: &HybridTotals, f: fn(&ComponentTotals) -> u64) -> u64 {
    f(&t.full) + f(&t.swa) + f(&t.mamba)
}

fn moves(c: &ComponentTotals) -> ComponentMoves {
    let t = |pages, bytes| TransferTotals {
        pages,
        bytes,
        ..TransferTotals::default()
    };
    ComponentMoves {
        d2h: t(c.pages_d2h, c.bytes_d2h),
        h2d: t(c.pages_h2d, c.bytes_h2d),
        l2_to_l3: t(c.pages_l2_to_l3, c.bytes_l2_to_l3),
        l3_to_l2: t(c.pages_l3_to_l2, c.bytes_l3_to_l2),
    }
}

impl HybridAdapter {
    /// Records what the cache does with page bytes (reported in [`CacheStats::payload`];
    /// default: bytes moved).
    pub fn with_payload(mut self, payload: PayloadUsed) -> Self {
        self.payload = payload;
        self
    }

    /// The adapter over `cache` (built for `model` with `page_size` and `device_pages` Full
    /// device pages), timing copies on `timer` (whose clock bounds the cache's rank group).
    pub fn new(
        cache: HybridCache,
        model: &HybridModel,
        page_size: u32,
        device_pages: usize,
        timer: CopyTimer,
    ) -> Self {
        Self {
            cache,
            timer,
            page_size: page_size as usize,
            device_pages,
            full_page_bytes: model.full_kv_shape(page_size).page_bytes() as u64,
            has_swa: model.swa_layers > 0,
            window_pages: model
                .window
                .map_or(0, |w| (w as usize).div_ceil(page_size as usize)),
            has_mamba: model.linear_layers > 0,
            held: HashMap::new(),
            hits: Hits::default(),
            d2h_timed: 0,
            payload: PayloadUsed::default(),
            refused_during_copies: 0,
        }
    }

    /// The controller under test.
    pub fn cache(&self) -> &HybridCache {
        &self.cache
    }

    /// What a request of `total_pages` pages holds on device in all: a Full (and SWA) page
    /// per page, and Mamba slots for its working state and checkpoints.
    fn extent(&self, total_pages: usize) -> HybridExtent {
        HybridExtent {
            pages: total_pages,
            mamba_slots: if self.has_mamba {
                1 + TRACKING_SLOTS
            } else {
                0
            },
        }
    }

    /// Counts a final admission's hits per tier (rule 4) and builds the engine's view.
    fn admitted(
        &mut self,
        req: RequestId,
        p: HybridAdmission,
        load_bytes: u64,
        rest: HybridSlots,
        prompt: usize,
    ) -> Admission {
        let ps = self.page_size;
        let l3 = p.storage_tokens.min(p.host_tokens);
        self.hits.l1 += p.device_tokens as u64;
        self.hits.l2 += (p.host_tokens - l3) as u64;
        self.hits.l3 += l3 as u64;
        self.hits.requests += prompt as u64;
        // The request's lock protects the prefix's SWA pages within the window only: those
        // below it may be evicted while the request runs, so it does not hold them.
        let mut swa = p.slots.swa;
        let below = swa.len().saturating_sub(self.window_pages);
        swa[..below].fill(None);
        swa.extend(rest.swa);
        // The checkpoint slots first (the first is the state inserted), then the working
        // state: the admission's copy, or the first slot allocated.
        let mut mamba = rest.mamba;
        mamba.extend(p.slots.mamba);
        self.held.insert(req, Held { swa, mamba });
        Admission {
            l1_pages: p.device_tokens / ps,
            l2_pages: (p.host_tokens - l3) / ps,
            l3_pages: l3 / ps,
            prefix_slots: p.slots.full,
            new_slots: rest.full,
            load_bytes: Some(load_bytes),
        }
    }
}

impl Gated for HybridAdapter {
    fn timer(&self) -> &CopyTimer {
        &self.timer
    }

    /// `flush`: blocks until every launched copy has landed, then finishes what the rank
    /// group agrees to.
    fn wait_quiet(&mut self) -> CacheResult<()> {
        self.cache.flush().map_err(err)
    }

    fn tick(&mut self) -> CacheResult<()> {
        self.cache.poll().map_err(err)
    }

    /// Times what the last poll launched: every write-through copy committed since the last
    /// call, all components, as one transfer on the D2H link.
    fn time_launches(&mut self, now: f64, links: &mut Links) -> CacheResult<()> {
        // Loads finished at the flush before this poll: what is in flight is write-through.
        let in_flight = self.cache.copies_in_flight();
        let known = self.timer.writes_in_flight();
        let d2h = total(&self.cache.metrics(), |c| c.bytes_d2h);
        let bytes = d2h - self.d2h_timed;
        self.d2h_timed = d2h;
        self.timer
            .time_write_group(now, links, in_flight.saturating_sub(known), bytes);
        Ok(())
    }
}

impl CacheUnderTest for HybridAdapter {
    fn page_size(&self) -> usize {
        self.page_size
    }

    fn device_pages(&self) -> usize {
        self.device_pages
    }

    fn arrive(&mut self, req: RequestId, tokens: &[u32]) -> CacheResult<()> {
        // The arrival's storage tokens are those a prefetch looks up; the pages that came
        // from L3 are counted at admission (`HybridAdmission::storage_tokens`).
        self.cache.arrive(req, tokens).map_err(err)?;
        Ok(())
    }

    fn poll(&mut self) -> CacheResult<()> {
        // Copy time free: every copy counts as complete, every stored page as visible.
        self.timer.open_all();
        self.cache.flush().map_err(err)?;
        self.tick()?;
        self.cache.flush().map_err(err)
    }

    fn advance(&mut self, now: f64, links: &mut Links) -> CacheResult<()> {
        if !links.charged() {
            return self.poll();
        }
        advance_gated(self, now, links)
    }

    fn next_completion(&self) -> Option<f64> {
        self.timer.next_completion()
    }

    fn prefetch_status(&mut self, req: RequestId) -> CacheResult<PrefetchStatus> {
        if !self.cache.prefetch_ready(req).map_err(err)? {
            return Ok(PrefetchStatus::Pending);
        }
        // The pages the prefetch read: the engine charges them on its L3 link (Full and SWA
        // pages at the plan's page bytes; the state is not charged).
        let tokens = self.cache.prefetched_tokens(req).map_err(err)?;
        Ok(PrefetchStatus::Ready {
            l3_pages: tokens / self.page_size,
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
        let total_pages = (tokens.len() + new_tokens).div_ceil(self.page_size);
        let extent = self.extent(total_pages);
        let before = total(&self.cache.metrics(), |c| c.bytes_h2d);
        match self.cache.try_admit(req, tokens, extent).map_err(err)? {
            Some((adm, rest)) => {
                let load_bytes = total(&self.cache.metrics(), |c| c.bytes_h2d) - before;
                Ok(Some(self.admitted(
                    req,
                    adm,
                    load_bytes,
                    rest,
                    tokens.len(),
                )))
            }
            None => {
                if self.timer.writes_in_flight() > 0 {
                    self.refused_during_copies += 1;
                }
                Ok(None)
            }
        }
    }

    fn start_loading(&mut self) -> CacheResult<Option<usize>> {
        self.cache.start_loading().map_err(err)
    }

    fn wait_layer(&mut self, idx: usize, layer: usize) -> CacheResult<()> {
        // The controller's load batches land whole: the first layer's wait waits for all.
        if layer == 0 {
            self.cache.wait_loaded(idx).map_err(err)?;
        }
        Ok(())
    }

    fn cache_finished(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        slots: &[DeviceSlot],
    ) -> CacheResult<()> {
        let held = self
            .held
            .remove(&req)
            .ok_or_else(|| CacheError(format!("request {req}: finished but never admitted")))?;
        let pages = tokens.len().div_ceil(self.page_size);
        let mut swa = held.swa;
        swa.truncate(if self.has_swa { pages } else { 0 });
        let all = HybridSlots {
            full: slots.to_vec(),
            swa,
            mamba: held.mamba,
        };
        self.cache.cache_finished(req, tokens, all).map_err(err)
    }

    fn shutdown(&mut self) -> CacheResult<()> {
        // Whatever is still in flight completes after the last request: nothing waits for it.
        self.timer.close_run();
        self.cache.shutdown().map_err(err)
    }

    fn stats(&self) -> CacheStats {
        let t = self.cache.metrics();
        let full = moves(&t.full);
        let mut stats = CacheStats {
            page_bytes: self.full_page_bytes,
            l3_pages_in_flight: self.timer.l3_pages_in_flight(),
            refused_during_copies: self.refused_during_copies,
            components: Some(HybridMoves {
                full,
                swa: moves(&t.swa),
                mamba: moves(&t.mamba),
            }),
            payload: self.payload,
            ..CacheStats::default()
        };
        let m = &mut stats.metrics;
        m.hit_tokens_l1 = self.hits.l1;
        m.hit_tokens_l2 = self.hits.l2;
        m.hit_tokens_l3 = self.hits.l3;
        m.request_tokens = self.hits.requests;
        m.d2h = full.d2h;
        m.h2d = full.h2d;
        m.l2_to_l3 = full.l2_to_l3;
        m.l3_to_l2 = full.l3_to_l2;
        m.evicted_pages_l1 = t.full.evicted_device;
        m.evicted_pages_l2 = t.full.evicted_host;
        stats
    }
}
