//! [`HybridCacheBuilder`]: validates a hybrid model's geometry and allocates each
//! component's device pool, host pool and copy engine.

use std::sync::Arc;

use hicache_core::{KvShape, LayoutKind, Namespace, PageHasher, UnifiedTree};
use hicache_gpu::{Device, DevicePool, TransferConfig};
use hicache_host::{
    HostPool, HostPoolConfig, HostPoolGroup, HostPoolGroupConfig, MambaPoolConfig, MambaShape,
    PoolSize, Populate,
};
use hicache_storage::Storage;

use super::cache::HybridCache;
use super::events::{Events, Tags};
use super::l3::L3Part;
use super::l3_keys::{HybridL3Layout, HybridL3Spec};
use super::pools::{KvPart, Pools};
use super::state::StatePart;
use super::types::HybridConfig;
use crate::error::{HiCacheError, Result};
use crate::rank::{RankGroup, SingleRank};

/// Builds a [`HybridCache`] (see [`HybridCache::builder`]).
pub struct HybridCacheBuilder {
    cfg: HybridConfig,
    full_shape: Option<KvShape>,
    swa_shape: Option<KvShape>,
    mamba_shape: Option<MambaShape>,
    device: Option<Device>,
    device_pages: (usize, usize),
    mamba_slots: usize,
    host_pages: (usize, usize),
    host_mamba_slots: usize,
    host_layout: LayoutKind,
    reserve: Option<u64>,
    namespace: Option<Namespace>,
    rank: Arc<dyn RankGroup>,
    storage: Option<Arc<dyn Storage>>,
    transfer: TransferConfig,
    kv_events: bool,
    component_events: bool,
    publisher: Option<crate::observe::KvEventsConfig>,
    metrics_addr: Option<String>,
}

impl std::fmt::Debug for HybridCacheBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridCacheBuilder")
            .field("cfg", &self.cfg)
            .field("device_pages", &self.device_pages)
            .field("host_pages", &self.host_pages)
            .finish_non_exhaustive()
    }
}

impl HybridCacheBuilder {
    /// A builder with `cfg`, the sim device and no pools sized yet.
    pub fn new(cfg: HybridConfig) -> Self {
        Self {
            cfg,
            full_shape: None,
            swa_shape: None,
            mamba_shape: None,
            device: None,
            device_pages: (0, 0),
            mamba_slots: 0,
            host_pages: (0, 0),
            host_mamba_slots: 0,
            host_layout: LayoutKind::PageFirst,
            reserve: None,
            namespace: None,
            rank: Arc::new(SingleRank),
            storage: None,
            transfer: TransferConfig::default(),
            kv_events: false,
            component_events: false,
            publisher: None,
            metrics_addr: None,
        }
    }

    /// The KV shape of the full-attention layers (required).
    pub fn full_shape(mut self, shape: KvShape) -> Self {
        self.full_shape = Some(shape);
        self
    }

    /// The KV shape of the sliding-window layers (required with `swa_window`).
    pub fn swa_shape(mut self, shape: KvShape) -> Self {
        self.swa_shape = Some(shape);
        self
    }

    /// The state shape of the Mamba layers (required with `mamba_chunk`).
    pub fn mamba_shape(mut self, shape: MambaShape) -> Self {
        self.mamba_shape = Some(shape);
        self
    }

    /// The device (default: the sim device).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Device pages of the Full and SWA pools.
    pub fn device_pages(mut self, full: usize, swa: usize) -> Self {
        self.device_pages = (full, swa);
        self
    }

    /// Device Mamba state slots.
    pub fn mamba_slots(mut self, n: usize) -> Self {
        self.mamba_slots = n;
        self
    }

    /// Host pages of the Full and SWA pools (0, the default: sized by the config's
    /// `hicache_size` or `hicache_ratio`).
    pub fn host_pages(mut self, full: usize, swa: usize) -> Self {
        self.host_pages = (full, swa);
        self
    }

    /// Host Mamba state slots (0, the default: sized by the config's `hicache_size` or
    /// `hicache_ratio`).
    pub fn host_mamba_slots(mut self, n: usize) -> Self {
        self.host_mamba_slots = n;
        self
    }

    /// The host (and L3) page layout (default `page_first`).
    pub fn host_layout(mut self, layout: LayoutKind) -> Self {
        self.host_layout = layout;
        self
    }

    /// Host RAM to leave free when mapping the host pools (default: the host crate's).
    pub fn host_reserve_bytes(mut self, bytes: u64) -> Self {
        self.reserve = Some(bytes);
        self
    }

    /// The KV namespace of this rank's L3 pages (default: model `hicache-hybrid`, the Full
    /// shape, one rank); the SWA and Mamba namespaces derive from it.
    pub fn namespace(mut self, namespace: Namespace) -> Self {
        self.namespace = Some(namespace);
        self
    }

    /// The tensor-parallel group (default: a single rank).
    pub fn rank_group(mut self, rank: Arc<dyn RankGroup>) -> Self {
        self.rank = rank;
        self
    }

    /// An L3 backend.
    pub fn storage(mut self, storage: Arc<dyn Storage>) -> Self {
        self.storage = Some(storage);
        self
    }

    /// Publishes the KV events on ZMQ in SGLang's wire format, as the dense
    /// `kv_events_config` (every poll hands its events to the publisher; L3 stores under the
    /// backend's medium).
    /// With `component_events` in `cfg`, the SWA pages and Mamba states are published too
    /// (see [`component_events`](Self::component_events)).
    pub fn kv_events_publisher(mut self, cfg: crate::observe::KvEventsConfig) -> Self {
        self.kv_events = true;
        self.component_events |= cfg.component_events;
        self.publisher = Some(cfg);
        self
    }

    /// Serves the counters ([`HybridCache::render_metrics`]) for Prometheus at `addr`
    /// (`IP:PORT`; port 0 picks one, see [`HybridCache::metrics_endpoint`]), as the dense
    /// `metrics_addr`.
    pub fn metrics_addr(mut self, addr: impl Into<String>) -> Self {
        self.metrics_addr = Some(addr.into());
        self
    }

    /// Collects KV events for [`HybridCache::drain_events`] (default off: nothing is kept).
    pub fn kv_events(mut self, on: bool) -> Self {
        self.kv_events = on;
        self
    }

    /// With KV events on, also emits events for the SWA pages and the Mamba states (each
    /// tagged with its [`EventComponent`](hicache_core::EventComponent); read them with
    /// [`HybridCache::drain_component_events`]), so a fleet index can tell where a prefix is
    /// reusable by every component. Default off; Full events are the same either way.
    pub fn component_events(mut self, on: bool) -> Self {
        self.component_events = on;
        self
    }

    /// Copy engine tuning.
    pub fn transfer(mut self, transfer: TransferConfig) -> Self {
        self.transfer = transfer;
        self
    }

    /// Checks that the configured components and the shapes agree.
    fn validate(&self) -> Result<KvShape> {
        let cfg = &self.cfg;
        let full = self.full_shape.ok_or_else(|| {
            HiCacheError::config("full_shape", "none", "the Full KV shape is required")
        })?;
        for (field, shape) in [("full_shape", Some(full)), ("swa_shape", self.swa_shape)] {
            if let Some(s) = shape
                && s.page_size != cfg.page_size
            {
                return Err(HiCacheError::config(
                    field,
                    s.page_size,
                    format!("its page size must be the config's {}", cfg.page_size),
                ));
            }
        }
        if cfg.swa_window.is_some() != self.swa_shape.is_some() {
            return Err(HiCacheError::config(
                "swa_shape",
                format!("{:?}", self.swa_shape.map(|s| s.layers)),
                "give an SWA shape exactly when swa_window is set",
            ));
        }
        if cfg.mamba_chunk.is_some() != self.mamba_shape.is_some() {
            return Err(HiCacheError::config(
                "mamba_shape",
                format!("{:?}", self.mamba_shape.as_ref().map(|s| s.layers)),
                "give a Mamba shape exactly when mamba_chunk is set",
            ));
        }
        if !cfg.hicache_size.is_finite() || cfg.hicache_size < 0.0 {
            return Err(HiCacheError::config(
                "hicache_size",
                cfg.hicache_size,
                "must be a finite number of GB >= 0",
            ));
        }
        if cfg.hicache_size == 0.0 && !(cfg.hicache_ratio.is_finite() && cfg.hicache_ratio > 0.0) {
            return Err(HiCacheError::config(
                "hicache_ratio",
                cfg.hicache_ratio,
                "must be a finite number > 0",
            ));
        }
        let (full_pages, swa_pages) = self.device_pages;
        if full_pages == 0 || (cfg.swa_window.is_some() && swa_pages == 0) {
            return Err(HiCacheError::config(
                "device_pages",
                format!("{full_pages}, {swa_pages}"),
                "every configured KV component needs device pages",
            ));
        }
        if cfg.mamba_chunk.is_some() && self.mamba_slots == 0 {
            return Err(HiCacheError::config(
                "mamba_slots",
                0,
                "Mamba needs device state slots",
            ));
        }
        Ok(full)
    }

    /// The host pool sizes of Full, SWA and Mamba: the builder's page counts where given,
    /// else SGLang's sizing from the device pools — `hicache_size` split over the components
    /// by device bytes, or `hicache_ratio` times each device pool.
    fn host_sizes(&self, full: KvShape) -> [PoolSize; 3] {
        let cfg = &self.cfg;
        let dev = [self.device_pages.0, self.device_pages.1, self.mamba_slots];
        let dev_bytes = [
            dev[0] * full.page_bytes(),
            self.swa_shape.map_or(0, |s| dev[1] * s.page_bytes()),
            self.mamba_shape
                .as_ref()
                .map_or(0, |m| dev[2] * m.slot_bytes()),
        ];
        let total: usize = dev_bytes.iter().sum();
        let given = [self.host_pages.0, self.host_pages.1, self.host_mamba_slots];
        std::array::from_fn(|c| {
            if given[c] > 0 {
                PoolSize::Pages(given[c])
            } else if cfg.hicache_size > 0.0 && total > 0 {
                let share = cfg.hicache_size * 1e9 * dev_bytes[c] as f64 / total as f64;
                PoolSize::Bytes((share as u64).max(1))
            } else {
                PoolSize::Ratio {
                    ratio: cfg.hicache_ratio,
                    device_pages: dev[c],
                }
            }
        })
    }

    /// The host pool group: Full KV, SWA KV, Mamba states, sized by [`Self::host_sizes`];
    /// populated on touch for a device without payload (nothing copies to or from them).
    fn host_group(&self, full: KvShape, device: &Device) -> Result<HostPoolGroup> {
        let [full_size, swa_size, mamba_size] = self.host_sizes(full);
        let kv = |shape, size| HostPoolConfig::new(shape, self.host_layout, size);
        let mut cfg = HostPoolGroupConfig::new(kv(full, full_size));
        if let Some(swa) = self.swa_shape {
            cfg = cfg.swa(kv(swa, swa_size));
        }
        if let Some(m) = &self.mamba_shape {
            // SGLang refuses `layer_first` for states; both page-first layouts lay a slot out
            // the same way.
            let layout = match self.host_layout {
                LayoutKind::LayerFirst => LayoutKind::PageFirst,
                other => other,
            };
            let mut mc = MambaPoolConfig::new(m.clone(), mamba_size);
            mc.layout = layout;
            cfg = cfg.mamba(mc);
        }
        if let Some(r) = self.reserve {
            cfg = cfg.reserve_bytes(r);
        }
        if !device.moves_payload() {
            cfg = cfg.populate(Populate::OnTouch);
        }
        Ok(HostPoolGroup::new(cfg)?)
    }

    /// Validates everything and allocates the pools.
    pub fn build(self) -> Result<HybridCache> {
        let full = self.validate()?;
        let device = self.device.clone().unwrap_or_else(Device::sim);
        let group = Arc::new(self.host_group(full, &device)?);
        let kv_part = |shape, pages, host: &Arc<HostPool>| {
            let dev = Arc::new(DevicePool::new(&device, shape, pages)?);
            KvPart::new(dev, host.clone(), self.transfer)
        };
        let full_part = kv_part(full, self.device_pages.0, group.kv_shared())?;
        let swa_part = match (self.swa_shape, group.swa_shared()) {
            (Some(s), Some(host)) => Some(kv_part(s, self.device_pages.1, host)?),
            _ => None,
        };
        let mamba_part = match (&self.mamba_shape, group.mamba_shared()) {
            (Some(m), Some(host)) => {
                Some(StatePart::new(&device, m, self.mamba_slots, host.clone())?)
            }
            _ => None,
        };
        let ns = self.namespace.clone().unwrap_or_else(|| {
            Namespace::single_rank(
                "hicache-hybrid",
                full.dtype,
                self.host_layout,
                full.kind,
                full.layers,
                full.page_size,
            )
        });
        let l3 = match &self.storage {
            Some(storage) => {
                let spec = HybridL3Spec {
                    namespace: &ns,
                    hash_mode: self.cfg.hash_mode,
                    tenant: None,
                    swa_window: self.cfg.swa_window,
                };
                let layout = HybridL3Layout::new(spec, &group)?;
                let prefetch = self.cfg.prefetch();
                Some(L3Part::new(
                    storage.clone(),
                    layout,
                    group.clone(),
                    prefetch,
                )?)
            }
            None => None,
        };
        let hasher = PageHasher::new(self.cfg.hash_mode, &ns)?;
        let prior = hasher.chain_start(None, None).prior;
        let tags = if self.component_events {
            Tags::of_model(self.cfg.swa_window, self.cfg.mamba_chunk.is_some())
        } else {
            Tags::default()
        };
        let events = Events::new(hasher, prior, self.kv_events, tags);
        let tree = UnifiedTree::with_device_slots(self.cfg.tree())?;
        let pools = Pools {
            group,
            full: full_part,
            swa: swa_part,
            mamba: mamba_part,
        };
        let published = Arc::new(parking_lot::Mutex::new(Default::default()));
        let render: crate::observe::RenderFn = {
            let p = Arc::clone(&published);
            Arc::new(move || super::metrics::render(&p.lock()))
        };
        let endpoints = crate::observe::Endpoints::start_with(
            self.publisher,
            self.metrics_addr.as_deref(),
            render,
        )?;
        let mut cache = HybridCache::assemble(self.cfg, tree, pools, self.rank, l3, events);
        cache.observe = super::cache::Observe {
            endpoints,
            published,
        };
        Ok(cache)
    }
}
