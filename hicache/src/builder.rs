//! [`HiCacheBuilder`]: a staged builder that ends in a ready [`HiCache`].

use std::sync::Arc;

use hicache_core::{KvShape, Namespace, PageHasher, TreeConfig};
use hicache_gpu::{
    Device, DevicePool, HostRegistration, LayerDoneCounter, TransferConfig, TransferEngine,
};
use hicache_host::{HostPool, HostPoolConfig, PoolSize, Populate};
use hicache_storage::{Registry, Storage};

use crate::cache::HiCache;
use crate::config::HiCacheConfig;
use crate::copies::Copies;
use crate::error::{HiCacheError, Result};
use crate::metrics::Metrics;
use crate::rank::{RankGroup, SingleRank};
use crate::tree_pools::Tiers;

/// Builds a [`HiCache`]. Required: a [`KvShape`] and either a device page count or a device
/// pool. Everything else has a default: the sim device, a single rank, the built-in backend
/// registry.
///
/// ```
/// use hicache::{HiCache, HiCacheConfig, KvShape};
/// let cache = HiCache::builder(HiCacheConfig { page_size: 16, ..Default::default() })
///     .shape(KvShape::llama3_8b(16))
///     .device_pages(64)
///     .host_reserve_bytes(0)
///     .build()?;
/// assert_eq!(cache.page_size(), 16);
/// # Ok::<(), hicache::HiCacheError>(())
/// ```
pub struct HiCacheBuilder {
    cfg: HiCacheConfig,
    shape: Option<KvShape>,
    device: Option<Device>,
    device_pages: Option<usize>,
    device_pool: Option<Arc<DevicePool>>,
    rank: Arc<dyn RankGroup>,
    tp: (u32, u32),
    pp: (u32, u32),
    registry: Option<Arc<Registry>>,
    storage: Option<Arc<dyn Storage>>,
    transfer: TransferConfig,
    reserve: Option<u64>,
}

impl std::fmt::Debug for HiCacheBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HiCacheBuilder")
            .field("cfg", &self.cfg)
            .field("shape", &self.shape)
            .field("device_pages", &self.device_pages)
            .finish_non_exhaustive()
    }
}

impl HiCacheBuilder {
    pub(crate) fn new(cfg: HiCacheConfig) -> Self {
        Self {
            reserve: cfg.host_reserve_bytes,
            cfg,
            shape: None,
            device: None,
            device_pages: None,
            device_pool: None,
            rank: Arc::new(SingleRank),
            tp: (0, 1),
            pp: (0, 1),
            registry: None,
            storage: None,
            transfer: TransferConfig::default(),
        }
    }

    /// The KV shape of this rank (its page size must equal the config's).
    pub fn shape(mut self, shape: KvShape) -> Self {
        self.shape = Some(shape);
        self
    }

    /// The device (default: the sim device).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Allocates a device pool of `pages` pages on the device.
    pub fn device_pages(mut self, pages: usize) -> Self {
        self.device_pages = Some(pages);
        self
    }

    /// Uses an existing device pool (e.g. registered from the engine's buffers with
    /// [`DevicePool::from_engine`]). Its device and shape are used.
    pub fn device_pool(mut self, pool: Arc<DevicePool>) -> Self {
        self.device_pool = Some(pool);
        self
    }

    /// The tensor-parallel group; its rank and size enter the L3 namespace.
    pub fn rank_group(mut self, group: Arc<dyn RankGroup>) -> Self {
        self.tp = (group.rank() as u32, group.size() as u32);
        self.rank = group;
        self
    }

    /// The pipeline stage of this rank (enters the L3 namespace).
    pub fn pipeline(mut self, pp_rank: u32, pp_size: u32) -> Self {
        self.pp = (pp_rank, pp_size);
        self
    }

    /// The backend registry used to open `storage_backend` (default: the built-ins compiled
    /// in by this crate's features).
    pub fn registry(mut self, registry: Arc<Registry>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// Uses this L3 backend instance instead of opening `storage_backend` (the extra-config's
    /// common fields still apply).
    pub fn storage(mut self, storage: Arc<dyn Storage>) -> Self {
        self.storage = Some(storage);
        self
    }

    /// Transfer engine tuning (CTAs, threads, staging); the io backend comes from the config.
    pub fn transfer(mut self, transfer: TransferConfig) -> Self {
        self.transfer = transfer;
        self
    }

    /// Host RAM to leave free when sizing the host pool (overrides the config).
    pub fn host_reserve_bytes(mut self, bytes: u64) -> Self {
        self.reserve = Some(bytes);
        self
    }

    /// Validates everything, allocates the pools and, with L3 configured, opens the backend.
    pub fn build(mut self) -> Result<HiCache> {
        if let Some(change) = self.cfg.resolve_layout_io() {
            tracing::warn!("{change}");
        }
        let cfg = self.cfg.clone();
        cfg.validate()?;
        if let Some((field, value)) = cfg.needs_l3()
            && self.storage.is_none()
            && cfg.storage_config()?.is_none()
        {
            return Err(HiCacheError::config(
                field,
                value,
                "needs an L3 backend: set storage_backend (or give the builder a storage \
                 instance)",
            ));
        }
        let shape = self.checked_shape()?;
        let device_pool = self.make_device_pool(shape)?;
        let device = device_pool.device().clone();
        let host_pool = Arc::new(HostPool::new(self.host_pool_config(shape, &device_pool))?);
        let registration = HostRegistration::new(&device, host_pool.clone())?;
        let transfer = TransferConfig {
            io: cfg.io_backend.into(),
            ..self.transfer
        };
        let engine = TransferEngine::new(device_pool.clone(), registration, transfer)?;
        let counter = Arc::new(LayerDoneCounter::new(
            shape.layers as usize,
            LayerDoneCounter::DEFAULT_DEPTH,
        )?);
        let namespace = self.namespace(shape);
        let mut tree = make_tree(&cfg, &namespace)?;
        let tiering = crate::l2_l3_sharing::Tiering::new(&cfg, host_pool.num_pages());
        tree.set_transient_host(tiering.buffer_only)?;
        let metrics = Arc::new(Metrics::new());
        metrics.set_geometry(
            cfg.page_size,
            device_pool.num_pages() as u64,
            host_pool.num_pages() as u64,
        );
        let render = {
            let m = metrics.clone();
            Arc::new(move || m.render())
        };
        let endpoints = crate::observe::Endpoints::start(&cfg, render)?;
        let registry = match self.registry {
            Some(r) => r,
            None => Arc::new(crate::backends::builtin_registry()?),
        };
        let copies = Copies::new(
            engine,
            counter,
            cfg.enable_hierarchical_cache,
            shape.page_bytes(),
        );
        let mut cache = HiCache::assemble(crate::cache::Parts {
            cfg,
            shape,
            namespace,
            tiers: Tiers::new(tree, device_pool, host_pool, metrics, tiering),
            copies,
            rank: self.rank,
            registry,
            endpoints,
        });
        let storage_cfg = cache.config().storage_config()?;
        match (storage_cfg, self.storage) {
            (Some(sc), Some(storage)) => cache.attach_storage_instance(sc, storage)?,
            (None, Some(storage)) => {
                let sc = hicache_storage::StorageConfig::new(storage.info().name);
                cache.attach_storage_instance(sc, storage)?
            }
            (Some(sc), None) => cache.attach_storage(sc)?,
            (None, None) => {}
        }
        Ok(cache)
    }
}

impl HiCacheBuilder {
    /// The KV shape (from the device pool when one is given), checked against the config.
    fn checked_shape(&self) -> Result<KvShape> {
        let shape = match (&self.device_pool, self.shape) {
            (Some(p), _) => p.shape(),
            (None, Some(s)) => s,
            (None, None) => {
                return Err(HiCacheError::config(
                    "shape",
                    "none",
                    "the builder needs a KvShape (or a device pool)",
                ));
            }
        };
        shape.validate()?;
        if shape.page_size != self.cfg.page_size {
            return Err(HiCacheError::config(
                "page_size",
                self.cfg.page_size,
                format!("differs from the KV shape's page size {}", shape.page_size),
            ));
        }
        if self.tp.1 as usize != self.rank.size() || self.tp.0 as usize >= self.rank.size() {
            return Err(HiCacheError::config(
                "rank_group",
                format!("{}/{}", self.tp.0, self.tp.1),
                "rank outside the group",
            ));
        }
        Ok(shape)
    }

    /// The device pool given, or a new one of `device_pages` on the device (sim by default).
    fn make_device_pool(&self, shape: KvShape) -> Result<Arc<DevicePool>> {
        if let Some(p) = &self.device_pool {
            return Ok(p.clone());
        }
        let pages = self.device_pages.ok_or_else(|| {
            HiCacheError::config(
                "device_pages",
                "none",
                "the builder needs device_pages or a device pool",
            )
        })?;
        if pages == 0 {
            return Err(HiCacheError::config(
                "device_pages",
                0,
                "must be at least 1",
            ));
        }
        let device = self.device.clone().unwrap_or_else(Device::sim);
        Ok(Arc::new(DevicePool::new(&device, shape, pages)?))
    }

    /// The host pool's configuration: `hicache_size` bytes, or `hicache_ratio` times the
    /// device pool; one page when the host tier is off. Populated on touch when the device
    /// moves no payload (nothing copies to or from it).
    fn host_pool_config(&self, shape: KvShape, device_pool: &DevicePool) -> HostPoolConfig {
        let cfg = &self.cfg;
        let size = if !cfg.enable_hierarchical_cache {
            // No host tier: the smallest pool (one page), never used.
            PoolSize::Pages(1)
        } else if cfg.hicache_size > 0.0 {
            PoolSize::Bytes((cfg.hicache_size * 1e9) as u64)
        } else {
            PoolSize::Ratio {
                ratio: cfg.hicache_ratio,
                device_pages: device_pool.num_pages(),
            }
        };
        let mut host_cfg = HostPoolConfig::new(shape, cfg.mem_layout, size);
        if !device_pool.device().moves_payload() {
            host_cfg = host_cfg.populate(Populate::OnTouch);
        }
        match self.reserve {
            Some(r) => host_cfg.reserve_bytes(r),
            None => host_cfg,
        }
    }

    /// This rank's L3 namespace.
    fn namespace(&self, shape: KvShape) -> Namespace {
        let mut namespace = Namespace::single_rank(
            self.cfg.model_name.clone(),
            shape.dtype,
            self.cfg.mem_layout,
            shape.kind,
            shape.layers,
            shape.page_size,
        );
        namespace.tp_rank = self.tp.0;
        namespace.tp_size = self.tp.1;
        namespace.pp_rank = self.pp.0;
        namespace.pp_size = self.pp.1;
        namespace
    }
}

/// The tree, hashing pages in `namespace`.
fn make_tree(cfg: &HiCacheConfig, namespace: &Namespace) -> Result<hicache_core::HiRadixTree> {
    let hasher = PageHasher::new(cfg.hash_mode, namespace)?;
    Ok(hicache_core::HiRadixTree::new(TreeConfig {
        page_size: cfg.page_size,
        // Without a host tier nothing is ever written: evictions delete, as in a plain
        // radix cache.
        write_policy: if cfg.enable_hierarchical_cache {
            cfg.write_policy
        } else {
            hicache_core::WritePolicy::WriteThroughSelective
        },
        eviction: cfg.eviction_policy,
        load_back_threshold_tokens: cfg.load_back_threshold,
        hasher: Some(hasher),
        events: cfg.enable_kv_events || cfg.kv_events_config.is_some(),
    })?)
}
