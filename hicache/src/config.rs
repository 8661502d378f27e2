//! [`HiCacheConfig`]: the cache's settings, named and defaulted like SGLang's server flags
//! (`--hicache-*` and friends) so users recognise them, as serde data with validation that
//! names the field.
//!
//! | field | default | meaning |
//! |---|---|---|
//! | `enable_hierarchical_cache` | true | false: L1 only, a plain radix cache (no host tier, no L3) |
//! | `page_size` | 64 | tokens per page (SGLang resolves its default to 1; 64 is what L3 wants) |
//! | `hicache_ratio` | 2.0 | host pages = device pages × ratio (ignored when `hicache_size` > 0) |
//! | `hicache_size` | 0 | host pool size in GB (1e9 bytes) per rank; overrides the ratio |
//! | `write_policy` | `write_through` | `write_through`, `write_through_selective`, `write_back` |
//! | `io_backend` | `kernel` | `kernel` (gather/scatter kernels) or `direct` (DMA copies) |
//! | `mem_layout` | `page_first` | `layer_first`, `page_first`, `page_first_direct` (`page_first` with `direct` runs as `page_first_direct`, as in SGLang) |
//! | `storage_backend` | none | L3 backend name (`file`, `memory`, `plugin`, …); none = no L3 |
//! | `storage_prefetch_policy` | `timeout` | `best_effort`, `wait_complete`, `timeout` |
//! | `storage_backend_extra_config` | none | JSON object as a string, or `@path` to a JSON file |
//! | `hicache_host_memory_mode` | `cache` | `cache` (L2 holds pages) or `buffer_only` (L2 only stages L1↔L3 traffic; needs L3; not with `write_back`) |
//! | `storage_write_mode` | `inclusive` | `inclusive` (L3 written at L2 admission) or `exclusive` (L3 written from the coldest L2 pages before L2 drops them; needs L3; not with `write_back` or `buffer_only`) |
//! | `eviction_policy` | `lru` | `lru`, `lfu`, `fifo`, `mru`, `filo`, `priority`, `slru`, `s3fifo`, `sieve` |
//! | `hash_mode` | `namespaced` | `namespaced` (seeded per model/tenant) or `sglang` (bit-exact keys) |
//! | `model_name` | `default` | model fingerprint that enters the L3 namespace |
//! | `load_back_threshold` | 10 | host hits shorter than this many tokens are recomputed |
//! | `storage_batch_pages` | 128 | pages per L3 batch (backup, lookup, fetch) |
//! | `prefetch_capacity_ratio` | 0.5 | share of the host pool in-flight prefetches may hold |
//! | `enable_kv_events` | false | collect BlockStored/BlockRemoved events for routers |
//! | `kv_events_config` | none | SGLang's `--kv-events-config` JSON: publish events on ZMQ in SGLang's format (implies `enable_kv_events`) |
//! | `metrics_addr` | none | `IP:PORT` of a Prometheus endpoint serving `GET /metrics` |
//! | `host_reserve_bytes` | 10 GiB (capped) | host RAM to leave free when sizing the pool |
//!
//! The prefetch thresholds and timeouts (`prefetch_threshold`, `prefetch_timeout_base`,
//! `prefetch_timeout_per_ki_token`, `prefetch_timeout_max`) are read from the extra-config, as
//! in SGLang.

use std::path::PathBuf;

use hicache_core::{HashMode, LayoutKind, PrefetchPolicy, StrategyKind, WritePolicy};
use hicache_gpu::IoBackend;
use hicache_storage::StorageConfig;
use serde::{Deserialize, Serialize};

use crate::error::{HiCacheError, Result};
use crate::kv_events_config::KvEventsConfig;

/// How pages move between L1 and L2 (serde form of [`IoBackend`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IoBackendKind {
    /// Gather/scatter kernels.
    #[default]
    Kernel,
    /// DMA copies.
    Direct,
}

impl From<IoBackendKind> for IoBackend {
    fn from(k: IoBackendKind) -> Self {
        match k {
            IoBackendKind::Kernel => IoBackend::Kernel,
            IoBackendKind::Direct => IoBackend::Direct,
        }
    }
}

/// What host (L2) memory is for (SGLang's `--hicache-host-memory-mode`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostMemoryMode {
    /// L2 is a cache tier: host copies stay until host eviction.
    #[default]
    Cache,
    /// L2 only stages L1↔L3 traffic: a page's host copy is released once it is in L3 (after
    /// a backup) or on device (after a load-back); L3 holds the capacity. Needs L3.
    BufferOnly,
}

impl HostMemoryMode {
    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            HostMemoryMode::Cache => "cache",
            HostMemoryMode::BufferOnly => "buffer_only",
        }
    }
}

/// When L3 is written (not an SGLang flag: SGLang writes L3 at L2 admission; its exclusive
/// mode is an open proposal without a flag name).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageWriteMode {
    /// Every page admitted to L2 is written to L3 (L3 holds a superset of L2).
    #[default]
    Inclusive,
    /// Cold-L2-first: L3 is written from the coldest host-only pages when L2 runs short of
    /// room, ahead of their eviction, and L2 drops a page only once its L3 copy is
    /// acknowledged, so L2 and L3 share only that clean band. Pages known to be in L3 are not
    /// written again. Needs L3.
    Exclusive,
}

impl StorageWriteMode {
    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            StorageWriteMode::Inclusive => "inclusive",
            StorageWriteMode::Exclusive => "exclusive",
        }
    }
}

/// The cache's settings. See the module documentation for every field and its default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HiCacheConfig {
    /// Whether the host tier (and L3) is used; false gives a plain device radix cache.
    pub enable_hierarchical_cache: bool,
    /// Tokens per page.
    pub page_size: u32,
    /// Host pages per device page.
    pub hicache_ratio: f64,
    /// Host pool size in GB (1e9 bytes) per rank; 0 uses the ratio.
    pub hicache_size: f64,
    /// When device pages are backed up to host.
    pub write_policy: WritePolicy,
    /// L1↔L2 transfer method.
    pub io_backend: IoBackendKind,
    /// Host (and L3) page layout.
    pub mem_layout: LayoutKind,
    /// L3 backend name; `None` disables L3.
    pub storage_backend: Option<String>,
    /// When an L3 prefetch may stop.
    pub storage_prefetch_policy: PrefetchPolicy,
    /// Extra-config: a JSON object as a string, or `@path` of a JSON file.
    pub storage_backend_extra_config: Option<String>,
    /// What host memory is for: a cache tier, or staging only (`buffer_only`).
    pub hicache_host_memory_mode: HostMemoryMode,
    /// When L3 is written: at L2 admission, or from cold L2 pages (`exclusive`).
    pub storage_write_mode: StorageWriteMode,
    /// Eviction order for both tiers.
    pub eviction_policy: StrategyKind,
    /// How page hashes are chained.
    pub hash_mode: HashMode,
    /// Model fingerprint (part of the L3 namespace).
    pub model_name: String,
    /// Host hits shorter than this many tokens are recomputed instead of loaded.
    pub load_back_threshold: u32,
    /// Pages per L3 batch.
    pub storage_batch_pages: usize,
    /// Share of the host pool that in-flight prefetches may hold (0 < r ≤ 1).
    pub prefetch_capacity_ratio: f64,
    /// Collect KV events.
    pub enable_kv_events: bool,
    /// SGLang's `--kv-events-config` JSON (see [`KvEventsConfig`]): with `"publisher": "zmq"`
    /// every poll publishes its events; implies `enable_kv_events`.
    pub kv_events_config: Option<String>,
    /// `IP:PORT` of the Prometheus scrape endpoint (`GET /metrics`); none serves nothing.
    pub metrics_addr: Option<String>,
    /// Host RAM to leave free when sizing the host pool (`None`: the host crate's default).
    pub host_reserve_bytes: Option<u64>,
}

impl Default for HiCacheConfig {
    fn default() -> Self {
        Self {
            enable_hierarchical_cache: true,
            page_size: 64,
            hicache_ratio: 2.0,
            hicache_size: 0.0,
            write_policy: WritePolicy::WriteThrough,
            io_backend: IoBackendKind::Kernel,
            mem_layout: LayoutKind::PageFirst,
            storage_backend: None,
            storage_prefetch_policy: PrefetchPolicy::Timeout,
            storage_backend_extra_config: None,
            hicache_host_memory_mode: HostMemoryMode::Cache,
            storage_write_mode: StorageWriteMode::Inclusive,
            eviction_policy: StrategyKind::Lru,
            hash_mode: HashMode::Namespaced,
            model_name: "default".into(),
            load_back_threshold: 10,
            storage_batch_pages: hicache_storage::STORAGE_BATCH_SIZE,
            prefetch_capacity_ratio: 0.5,
            enable_kv_events: false,
            kv_events_config: None,
            metrics_addr: None,
            host_reserve_bytes: None,
        }
    }
}

impl HiCacheConfig {
    /// Parses a JSON object; unknown fields and wrong types are errors naming the field.
    pub fn from_json(text: &str) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text).map_err(|e| {
            HiCacheError::config("config", truncate(text), format!("not a valid config: {e}"))
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// SGLang's pairing of host layout and io backend: `page_first` with the `direct` io
    /// backend becomes `page_first_direct` (SGLang's server arguments do the same with a
    /// warning). `page_first` rows are strided per token on the host, so direct copies of
    /// them are one DMA per (page, layer, token): on an H200 (docs/benchmarks.md, CUDA)
    /// 0.03–0.13 of a bulk pinned copy, against 0.91–0.995 for `page_first_direct`, whose
    /// (page, layer) runs are contiguous. Returns the change made, for the caller to log; the
    /// L3 namespace takes the resolved layout. (SGLang also turns `page_first_direct` with
    /// `kernel` into `direct` because its kernels lack that layout; ours have it, so that
    /// pairing stays as asked.)
    pub fn resolve_layout_io(&mut self) -> Option<String> {
        if self.io_backend == IoBackendKind::Direct && self.mem_layout == LayoutKind::PageFirst {
            self.mem_layout = LayoutKind::PageFirstDirect;
            return Some(
                "mem_layout page_first does not suit io_backend direct (one copy per token); \
                 using page_first_direct"
                    .into(),
            );
        }
        None
    }

    /// Checks every field and the combinations that contradict each other.
    pub fn validate(&self) -> Result<()> {
        if self.page_size == 0 || self.page_size > 65536 {
            return Err(HiCacheError::config(
                "page_size",
                self.page_size,
                "must be between 1 and 65536 tokens",
            ));
        }
        if !self.hicache_size.is_finite() || self.hicache_size < 0.0 {
            return Err(HiCacheError::config(
                "hicache_size",
                self.hicache_size,
                "must be a finite number of GB >= 0",
            ));
        }
        if self.enable_hierarchical_cache && self.hicache_size == 0.0 {
            if !self.hicache_ratio.is_finite() || self.hicache_ratio <= 0.0 {
                return Err(HiCacheError::config(
                    "hicache_ratio",
                    self.hicache_ratio,
                    "must be a finite number > 0",
                ));
            }
            if self.hicache_ratio < 1.0
                && self.write_policy == WritePolicy::WriteThrough
                && self.hicache_host_memory_mode == HostMemoryMode::Cache
            {
                return Err(HiCacheError::config(
                    "hicache_ratio",
                    self.hicache_ratio,
                    "below 1 with write_policy = write_through: every device page is written \
                     to host at once, so a smaller host pool stops backing up new pages; use \
                     write_through_selective or write_back, or a ratio >= 1",
                ));
            }
        }
        if self.load_back_threshold == 0 {
            return Err(HiCacheError::config(
                "load_back_threshold",
                0,
                "must be at least 1 token",
            ));
        }
        if self.storage_batch_pages == 0 || self.storage_batch_pages > 4096 {
            return Err(HiCacheError::config(
                "storage_batch_pages",
                self.storage_batch_pages,
                "must be between 1 and 4096",
            ));
        }
        if !(self.prefetch_capacity_ratio > 0.0 && self.prefetch_capacity_ratio <= 1.0) {
            return Err(HiCacheError::config(
                "prefetch_capacity_ratio",
                self.prefetch_capacity_ratio,
                "must be in (0, 1]",
            ));
        }
        if self.model_name.is_empty() {
            return Err(HiCacheError::config(
                "model_name",
                "\"\"",
                "must not be empty (it keeps models apart in L3)",
            ));
        }
        if !self.enable_hierarchical_cache && self.storage_backend.is_some() {
            return Err(HiCacheError::config(
                "storage_backend",
                self.storage_backend.as_deref().unwrap_or_default(),
                "L3 needs the host tier: enable_hierarchical_cache is false",
            ));
        }
        if self.storage_backend.is_none() && self.storage_backend_extra_config.is_some() {
            // The extra-config may name the backend itself (`{"backend": "plugin", …}`).
            let cfg = self.storage_config()?;
            if cfg.is_none() {
                return Err(HiCacheError::config(
                    "storage_backend_extra_config",
                    "…",
                    "given without storage_backend",
                ));
            }
        } else {
            self.storage_config()?;
        }
        self.validate_tiering()?;
        self.kv_events()?;
        if let Some(addr) = &self.metrics_addr {
            addr.parse::<std::net::SocketAddr>().map_err(|e| {
                HiCacheError::config("metrics_addr", addr, format!("must be IP:PORT: {e}"))
            })?;
        }
        Ok(())
    }

    /// The host memory mode and the L3 write mode against the rest. Whether L3 is attached
    /// at all is checked when the cache is built (a backend instance may come from the
    /// builder).
    fn validate_tiering(&self) -> Result<()> {
        let buffer_only = self.hicache_host_memory_mode == HostMemoryMode::BufferOnly;
        let exclusive = self.storage_write_mode == StorageWriteMode::Exclusive;
        if (buffer_only || exclusive) && !self.enable_hierarchical_cache {
            let field = if buffer_only {
                "hicache_host_memory_mode"
            } else {
                "storage_write_mode"
            };
            return Err(HiCacheError::config(
                field,
                if buffer_only {
                    "buffer_only"
                } else {
                    "exclusive"
                },
                "needs the host tier and L3: enable_hierarchical_cache is false",
            ));
        }
        if buffer_only && self.write_policy == WritePolicy::WriteBack {
            return Err(HiCacheError::config(
                "hicache_host_memory_mode",
                "buffer_only",
                "does not work with write_policy = write_back (write-back keeps pages in host \
                 memory until device eviction; buffer_only holds none): use write_through or \
                 write_through_selective",
            ));
        }
        if exclusive && self.write_policy == WritePolicy::WriteBack {
            return Err(HiCacheError::config(
                "storage_write_mode",
                "exclusive",
                "does not work with write_policy = write_back (write-back eviction frees host \
                 room inside the tree, dropping pages L3 does not hold): use write_through or \
                 write_through_selective",
            ));
        }
        if buffer_only && exclusive {
            return Err(HiCacheError::config(
                "storage_write_mode",
                "exclusive",
                "contradicts hicache_host_memory_mode = buffer_only (host memory holds no \
                 pages for L3 to be exclusive of)",
            ));
        }
        Ok(())
    }

    /// The field naming the tiering mode that needs L3, if one is set.
    pub(crate) fn needs_l3(&self) -> Option<(&'static str, &'static str)> {
        if self.hicache_host_memory_mode == HostMemoryMode::BufferOnly {
            Some(("hicache_host_memory_mode", "buffer_only"))
        } else if self.storage_write_mode == StorageWriteMode::Exclusive {
            Some(("storage_write_mode", "exclusive"))
        } else {
            None
        }
    }

    /// The parsed `kv_events_config`, or `None` when not set.
    pub fn kv_events(&self) -> Result<Option<KvEventsConfig>> {
        self.kv_events_config
            .as_deref()
            .map(KvEventsConfig::from_json)
            .transpose()
    }

    /// The L3 configuration: backend name plus the parsed extra-config, or `None` without L3.
    /// The extra-config is strict: its errors name the field.
    pub fn storage_config(&self) -> Result<Option<StorageConfig>> {
        let extra = match &self.storage_backend_extra_config {
            None => None,
            Some(s) => Some(read_extra_config(s)?),
        };
        if self.storage_backend.is_none() && extra.is_none() {
            return Ok(None);
        }
        let cfg = StorageConfig::parse(self.storage_backend.as_deref(), extra.as_deref())?;
        Ok(Some(cfg))
    }
}

/// Reads the extra-config: a JSON object, or `@path` naming a JSON file.
fn read_extra_config(s: &str) -> Result<String> {
    match s.strip_prefix('@') {
        Some(path) => {
            let path = PathBuf::from(path);
            hicache_storage::read_config_file(&path).map_err(|e| {
                HiCacheError::config(
                    "storage_backend_extra_config",
                    path.display(),
                    format!("cannot read the file: {e}"),
                )
            })
        }
        None => Ok(s.to_string()),
    }
}

fn truncate(s: &str) -> String {
    if s.len() <= 120 {
        s.to_string()
    } else {
        let mut end = 120;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &s[..end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_sglangs_and_valid() {
        let c = HiCacheConfig::default();
        assert_eq!(c.hicache_ratio, 2.0);
        assert_eq!(c.write_policy, WritePolicy::WriteThrough);
        assert_eq!(c.storage_prefetch_policy, PrefetchPolicy::Timeout);
        assert_eq!(c.mem_layout, LayoutKind::PageFirst);
        c.validate().unwrap();
        assert!(c.storage_config().unwrap().is_none());
    }

    #[test]
    fn page_first_with_direct_io_resolves_to_page_first_direct() {
        let mut c = HiCacheConfig {
            io_backend: IoBackendKind::Direct,
            ..Default::default()
        };
        assert!(c.resolve_layout_io().is_some());
        assert_eq!(c.mem_layout, LayoutKind::PageFirstDirect);
        assert_eq!(c.io_backend, IoBackendKind::Direct);
        // Resolved once: nothing left to change.
        assert!(c.resolve_layout_io().is_none());
        // Every other pairing stays as asked.
        for io in [IoBackendKind::Kernel, IoBackendKind::Direct] {
            for layout in [
                LayoutKind::LayerFirst,
                LayoutKind::PageFirst,
                LayoutKind::PageFirstDirect,
            ] {
                if io == IoBackendKind::Direct && layout == LayoutKind::PageFirst {
                    continue;
                }
                let mut c = HiCacheConfig {
                    io_backend: io,
                    mem_layout: layout,
                    ..Default::default()
                };
                assert!(c.resolve_layout_io().is_none(), "{io:?} {layout:?}");
                assert_eq!((c.io_backend, c.mem_layout), (io, layout));
            }
        }
    }

    #[test]
    fn json_uses_sglang_names() {
        let c = HiCacheConfig::from_json(
            r#"{"page_size": 16, "hicache_ratio": 3, "write_policy": "write_back",
                "io_backend": "direct", "mem_layout": "layer_first",
                "storage_prefetch_policy": "wait_complete", "eviction_policy": "lfu"}"#,
        )
        .unwrap();
        assert_eq!(c.page_size, 16);
        assert_eq!(c.write_policy, WritePolicy::WriteBack);
        assert_eq!(c.io_backend, IoBackendKind::Direct);
        assert_eq!(c.eviction_policy, StrategyKind::Lfu);
    }

    fn err(json: &str) -> String {
        HiCacheConfig::from_json(json).unwrap_err().to_string()
    }

    #[test]
    fn bad_values_name_the_field() {
        assert!(err(r#"{"page_size": 0}"#).contains("page_size"));
        assert!(err(r#"{"hicache_ratio": 0.5}"#).contains("write_through"));
        assert!(err(r#"{"write_policy": "sometimes"}"#).contains("write_policy"));
        assert!(err(r#"{"storage_prefetch_policy": "eager"}"#).contains("storage_prefetch_policy"));
        assert!(err(r#"{"pagesize": 4}"#).contains("pagesize"));
        assert!(err(r#"{"page_size": "big"}"#).contains("page_size"));
        assert!(err(r#"{"storage_batch_pages": 0}"#).contains("storage_batch_pages"));
        assert!(err(r#"{"model_name": ""}"#).contains("model_name"));
        assert!(err("not json").contains("not a valid config"));
    }

    #[test]
    fn ratio_below_one_is_fine_with_selective_writes() {
        HiCacheConfig::from_json(
            r#"{"hicache_ratio": 0.5, "write_policy": "write_through_selective"}"#,
        )
        .unwrap();
        HiCacheConfig::from_json(r#"{"hicache_ratio": 0.5, "hicache_size": 1.0}"#).unwrap();
    }

    #[test]
    fn extra_config_is_parsed_strictly() {
        let mut c = HiCacheConfig {
            storage_backend: Some("memory".into()),
            storage_backend_extra_config: Some(r#"{"prefetch_threshold": 512}"#.into()),
            ..Default::default()
        };
        let s = c.storage_config().unwrap().unwrap();
        assert_eq!(s.backend, "memory");
        assert_eq!(s.common.prefetch_threshold, 512);
        c.storage_backend_extra_config = Some("{not json".into());
        assert!(c.validate().is_err());
        c.storage_backend_extra_config = Some(r#"{"prefetch_threshold": "many"}"#.into());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("prefetch_threshold"), "{e}");
        c.storage_backend_extra_config = Some("@/nonexistent/extra.json".into());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("/nonexistent/extra.json"), "{e}");
    }

    #[test]
    fn l3_needs_the_host_tier() {
        let e = HiCacheConfig::from_json(
            r#"{"enable_hierarchical_cache": false, "storage_backend": "memory"}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("enable_hierarchical_cache"), "{e}");
        HiCacheConfig::from_json(r#"{"enable_hierarchical_cache": false, "hicache_ratio": 0.1}"#)
            .unwrap();
    }

    #[test]
    fn tiering_modes_use_sglang_names_and_check_combinations() {
        let c = HiCacheConfig::from_json(
            r#"{"hicache_host_memory_mode": "buffer_only", "storage_backend": "memory",
                "hicache_ratio": 0.25}"#,
        )
        .unwrap();
        assert_eq!(c.hicache_host_memory_mode, HostMemoryMode::BufferOnly);
        let c = HiCacheConfig::from_json(
            r#"{"storage_write_mode": "exclusive", "storage_backend": "memory"}"#,
        )
        .unwrap();
        assert_eq!(c.storage_write_mode, StorageWriteMode::Exclusive);
        assert!(
            err(r#"{"hicache_host_memory_mode": "staging"}"#).contains("hicache_host_memory_mode")
        );
        assert!(err(r#"{"storage_write_mode": "sometimes"}"#).contains("storage_write_mode"));
        let e = err(r#"{"hicache_host_memory_mode": "buffer_only", "write_policy": "write_back"}"#);
        assert!(
            e.contains("hicache_host_memory_mode") && e.contains("write_back"),
            "{e}"
        );
        let e = err(
            r#"{"hicache_host_memory_mode": "buffer_only", "storage_write_mode": "exclusive"}"#,
        );
        assert!(e.contains("storage_write_mode"), "{e}");
        let e = err(r#"{"storage_write_mode": "exclusive", "write_policy": "write_back"}"#);
        assert!(
            e.contains("storage_write_mode") && e.contains("write_back"),
            "{e}"
        );
        let e = err(r#"{"enable_hierarchical_cache": false, "storage_write_mode": "exclusive"}"#);
        assert!(e.contains("storage_write_mode"), "{e}");
    }

    #[test]
    fn extra_config_from_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("extra.json");
        std::fs::write(&p, r#"{"prefetch_timeout_base": 1.5}"#).unwrap();
        let c = HiCacheConfig {
            storage_backend: Some("memory".into()),
            storage_backend_extra_config: Some(format!("@{}", p.display())),
            ..Default::default()
        };
        let s = c.storage_config().unwrap().unwrap();
        assert_eq!(s.common.prefetch_timeout_base, 1.5);
    }
}
