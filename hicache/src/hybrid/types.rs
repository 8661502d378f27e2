//! The plain data of the hybrid facade: its configuration, what a request is handed, what it
//! hands back, and the per-component totals.

use std::time::Duration;

use hicache_core::{Component, DeviceSlot, HashMode, PrefetchConfig, PrefetchPolicy};

use super::StateSlot;

/// Configuration of a [`HybridCache`](super::HybridCache).
#[derive(Clone, Debug, PartialEq)]
pub struct HybridConfig {
    /// Tokens per page, the same for every component (1..=65536).
    pub page_size: u32,
    /// Sliding-window size in tokens (SGLang's `swa_retain_window`); `None`: no SWA layers.
    pub swa_window: Option<u32>,
    /// Mamba checkpoint chunk in tokens (`mamba_cache_chunk_size`); `None`: no Mamba layers.
    pub mamba_chunk: Option<u32>,
    /// How L3 page keys are chained.
    pub hash_mode: HashMode,
    /// An L3 prefetch starts only when at least this many tokens are missing from L1 and L2.
    pub prefetch_threshold_tokens: usize,
    /// Back up every inserted node to host at the next `poll` (SGLang's write-through).
    pub write_through: bool,
    /// When an L3 prefetch may end (SGLang's `hicache_storage_prefetch_policy`): at any
    /// poll (`best_effort`), once read whole (`wait_complete`), or once read whole or
    /// timed out (`timeout`, the default, as the dense `HiCacheConfig`'s).
    pub prefetch_policy: PrefetchPolicy,
    /// `prefetch_timeout_base` (SGLang: 2 s).
    pub prefetch_timeout_base: Duration,
    /// `prefetch_timeout_per_ki_token`: more time per 1024 tokens of the hit (SGLang: 0.1 s).
    pub prefetch_timeout_per_ki_token: Duration,
    /// `prefetch_timeout_max` (SGLang: 30 s).
    pub prefetch_timeout_max: Duration,
    /// Host pool size over device pool size, per component (SGLang's `hicache_ratio`): a
    /// host pool holds `⌊device pages · page_size · ratio⌋` tokens in whole pages plus one
    /// page (Mamba: `⌊device slots · ratio⌋` states plus one). Ignored when `hicache_size`
    /// is set. Default 1.0: host pools the device's size (SGLang's default is 2.0).
    pub hicache_ratio: f64,
    /// Host memory for all host pools together, in GB (1e9 bytes; SGLang's `hicache_size`),
    /// split over the components in proportion to their device pools' bytes; 0 uses
    /// `hicache_ratio`.
    pub hicache_size: f64,
    /// Where [`HybridCache::try_admit`](super::HybridCache::try_admit) loads a host hit's
    /// Mamba state when the request asks state slots (default
    /// [`MambaLoadBack::Request`]).
    pub mamba_load_back: MambaLoadBack,
}

/// Where `try_admit` loads a host hit's Mamba state.
///
/// SGLang loads it into the tree (the node's state back on device) and copies it into the
/// request's slot: two copies on the admission's path and one state more than recomputing
/// the hit, so with the state pool held by running requests the hit is recomputed. Loading
/// it straight into the request's slot is one host → device copy and no state beside the
/// request's; the node's state stays on host only, so a later request with the same prefix
/// loads it again (each admission pays one copy either way). Only the tree's Mamba sizes and
/// the later matches of that node differ; `hicache-bench tree --host-capacity-pages` replays
/// SGLang's mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MambaLoadBack {
    /// Straight into the request's working slot (one copy; the tree's state stays on host).
    #[default]
    Request,
    /// Into the tree, then copied into the request's slot (SGLang's `init_load_back`).
    Tree,
}

impl Default for HybridConfig {
    fn default() -> Self {
        Self {
            page_size: 16,
            swa_window: None,
            mamba_chunk: None,
            hash_mode: HashMode::default(),
            prefetch_threshold_tokens: 256,
            write_through: true,
            prefetch_policy: PrefetchPolicy::Timeout,
            prefetch_timeout_base: Duration::from_secs(2),
            prefetch_timeout_per_ki_token: Duration::from_millis(100),
            prefetch_timeout_max: Duration::from_secs(30),
            hicache_ratio: 1.0,
            hicache_size: 0.0,
            mamba_load_back: MambaLoadBack::Request,
        }
    }
}

impl HybridConfig {
    /// The prefetch policy, threshold and timeouts as the dense controller's.
    pub(crate) fn prefetch(&self) -> PrefetchConfig {
        PrefetchConfig {
            policy: self.prefetch_policy,
            prefetch_threshold: self.prefetch_threshold_tokens.min(u32::MAX as usize) as u32,
            prefetch_timeout_base: self.prefetch_timeout_base.as_secs_f64(),
            prefetch_timeout_per_ki_token: self.prefetch_timeout_per_ki_token.as_secs_f64(),
            prefetch_timeout_max: self.prefetch_timeout_max.as_secs_f64(),
        }
    }

    /// The tree's configuration.
    pub(crate) fn tree(&self) -> hicache_core::UnifiedConfig {
        hicache_core::UnifiedConfig {
            page_size: self.page_size,
            swa_window: self.swa_window,
            mamba_chunk: self.mamba_chunk,
        }
    }
}

/// Device slots of a request, per component.
///
/// As an admission's prefix ([`HybridAdmission::slots`]) the Full and SWA slots are the
/// tree's: the Full ones and the SWA window locked for the request until `cache_finished` or
/// `abort`. The prefix's SWA pages outside the window are not locked (SGLang's rule): the tree
/// may evict them (tombstone) for another allocation while the request runs, and their slots
/// may then serve other requests, so the engine must not read them (it reads only its
/// window). `cache_finished` takes the prefix's SWA entries from the tree, not from the slots
/// handed to it. Slots from
/// [`HybridCache::alloc`](super::HybridCache::alloc) are the request's until it hands them
/// to `cache_finished` (or frees them with `release`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HybridSlots {
    /// Full-attention pages, one per page (a partial last page included).
    pub full: Vec<DeviceSlot>,
    /// SWA pages, one per page; `None` where the request holds no SWA KV (pages outside the
    /// window of a matched prefix, or pages the engine freed below its window). Empty
    /// without SWA.
    pub swa: Vec<Option<DeviceSlot>>,
    /// Mamba state slots. An admission's is the request's own copy-on-write slot (empty
    /// without a matched state); in `cache_finished` the first is the state inserted at the
    /// insert length (SGLang's tracked checkpoint) and every one is taken over by the cache.
    pub mamba: Vec<StateSlot>,
}

impl HybridSlots {
    /// Appends `other`'s slots after this one's (a prefix followed by an extend).
    pub fn extend(&mut self, other: HybridSlots) {
        self.full.extend(other.full);
        self.swa.extend(other.swa);
        self.mamba.extend(other.mamba);
    }
}

/// What [`HybridCache::alloc`](super::HybridCache::alloc) asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HybridDemand {
    /// Full-attention device pages.
    pub full_pages: usize,
    /// SWA device pages (must be 0 without SWA).
    pub swa_pages: usize,
    /// Mamba state slots (must be 0 without Mamba).
    pub mamba_slots: usize,
}

/// Everything a request holds on device once admitted, for
/// [`HybridCache::try_admit`](super::HybridCache::try_admit): its prefix (matched, and
/// loaded back from host) and the rest it computes, together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HybridExtent {
    /// Full pages of the whole request, prompt and the tokens it may generate, a partial
    /// last page included; with SWA it holds as many SWA pages (one per page, as
    /// [`HybridCache::alloc`](super::HybridCache::alloc) gives them). At least the prompt's
    /// pages.
    pub pages: usize,
    /// Mamba state slots of the request in all (0 without Mamba), its working state
    /// included: when the match has a state, the first one is the copy of it
    /// (copy-on-write, [`HybridAdmission::slots`]), the others come with the rest.
    pub mamba_slots: usize,
}

/// What a request's arrival found (before any copy).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HybridArrival {
    /// Prefix tokens valid on device (every component).
    pub device_tokens: usize,
    /// Further tokens a load-back from host would restore.
    pub host_tokens: usize,
    /// Further tokens an L3 prefetch is fetching.
    pub storage_tokens: usize,
}

/// What [`HybridCache::admit`](super::HybridCache::admit) gives a request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HybridAdmission {
    /// Prefix tokens that were valid on device at admission.
    pub device_tokens: usize,
    /// Prefix tokens loaded back from host (L2) by this admission.
    pub host_tokens: usize,
    /// Of those, tokens that came from L3 through a prefetch.
    pub storage_tokens: usize,
    /// The prefix: Full slots, SWA slots (`None` outside the window), the request's own
    /// copy-on-write Mamba slot.
    pub slots: HybridSlots,
}

impl HybridAdmission {
    /// Tokens of the prompt the request reuses.
    pub fn cached_tokens(&self) -> usize {
        self.device_tokens + self.host_tokens
    }
}

/// Counters of one component.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ComponentTotals {
    /// Tokens of prompts served from device (L1) at admission.
    pub hit_tokens_l1: u64,
    /// Tokens of prompts loaded back from host (L2).
    pub hit_tokens_l2: u64,
    /// Tokens of prompts fetched from L3.
    pub hit_tokens_l3: u64,
    /// Pages (states for Mamba) copied device → host.
    pub pages_d2h: u64,
    /// Bytes copied device → host.
    pub bytes_d2h: u64,
    /// Pages (states) copied host → device.
    pub pages_h2d: u64,
    /// Bytes copied host → device.
    pub bytes_h2d: u64,
    /// Pages (states) written host → L3.
    pub pages_l2_to_l3: u64,
    /// Bytes written host → L3.
    pub bytes_l2_to_l3: u64,
    /// Pages (states) read L3 → host.
    pub pages_l3_to_l2: u64,
    /// Bytes read L3 → host.
    pub bytes_l3_to_l2: u64,
    /// Device pages (states) evicted.
    pub evicted_device: u64,
    /// Host pages (states) evicted.
    pub evicted_host: u64,
    /// Pages (states) a backup was to store in L3 that are not stored (a failed call, a
    /// page the backend refused).
    pub l3_failed_write_pages: u64,
    /// Pages (states) of an agreed prefetch hit that did not arrive (a failed lookup or
    /// read, a page gone or damaged since the lookup).
    pub l3_failed_read_pages: u64,
}

/// Counters of a [`HybridCache`](super::HybridCache), per component.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HybridTotals {
    /// Full-attention KV.
    pub full: ComponentTotals,
    /// Sliding-window KV.
    pub swa: ComponentTotals,
    /// Mamba state.
    pub mamba: ComponentTotals,
}

impl HybridTotals {
    /// The counters of `c`.
    pub fn get(&self, c: Component) -> &ComponentTotals {
        match c {
            Component::Full => &self.full,
            Component::Swa => &self.swa,
            Component::Mamba => &self.mamba,
        }
    }

    /// The counters of `c`, to update.
    pub(crate) fn get_mut(&mut self, c: Component) -> &mut ComponentTotals {
        match c {
            Component::Full => &mut self.full,
            Component::Swa => &mut self.swa,
            Component::Mamba => &mut self.mamba,
        }
    }
}
