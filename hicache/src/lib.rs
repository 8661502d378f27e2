//! # hicache
//!
//! A hierarchical KV cache for LLM inference engines: **L1** device memory, **L2** pinned
//! host memory, **L3** pluggable storage, with a radix tree (`hicache-core`'s
//! [`HiRadixTree`]) recording which token pages live in which tier. This crate is the facade an
//! engine depends on: it wires the tree, the pools and the transfer engine (`hicache-host`,
//! `hicache-gpu`) and L3 (`hicache-storage` and the backends) into SGLang HiCache's
//! behaviour, and re-exports what an engine needs.
//!
//! ## One scheduler tick
//!
//! ```text
//! on request arrival      cache.arrive(req, &prompt)        match; start the L3 prefetch
//! every iteration:
//!   1. cache.poll()                                          acks, prefetch progress, D2H launch
//!   2. for each waiting request (FCFS):
//!        cache.prefetch_ready(req)?  → false: skip it this tick
//!        cache.admit(req, &prompt)   → cached prefix slots (L2 load-backs queued)
//!        cache.alloc_device(pages)   → slots for the rest (evicts if needed)
//!   3. cache.start_loading()   → Some(producer): counter.set_consumer(producer)
//!   4. forward pass: attention layer i calls counter.wait_until(i) (or stream_wait)
//!   5. cache.cache_unfinished(req, &tokens, &slots) after a prefill chunk,
//!      cache.cache_finished(req, &tokens, &slots) when a request ends
//! on abort                 cache.abort(req)
//! at the end               cache.shutdown()                  drains writes and L3 backups
//! ```
//!
//! Every call runs on the engine thread (`&mut self`); copies run on the device's streams and
//! L3 I/O on a small runtime owned by the cache, and their completions are picked up by
//! `poll`. The L3 work started between `poll` and `start_loading` (`poll`'s backups, the
//! lookups of arrivals in between) is handed to that runtime in one go by `start_loading`: one
//! wake-up of its threads per tick; a lookup started outside that window is handed over at
//! once. With tensor parallelism every rank runs the same calls in the same order and
//! `poll` agrees on every count through one exchange per tick ([`rank`]), so every rank's tree
//! keeps the same shape.
//!
//! ```
//! use hicache::{HiCache, HiCacheConfig, KvShape};
//! let mut cache = HiCache::builder(HiCacheConfig { page_size: 4, ..Default::default() })
//!     .shape(KvShape::llama3_8b(4))
//!     .device_pages(32)
//!     .host_reserve_bytes(0)
//!     .build()?;
//! let prompt: Vec<u32> = (0..16).collect();
//! cache.arrive(1, &prompt)?;
//! cache.poll()?;
//! let adm = cache.admit(1, &prompt)?;                    // nothing cached yet
//! assert_eq!(adm.cached_pages(), 0);
//! let slots = cache.alloc_device(4)?.expect("room");     // the engine computes the KV here
//! cache.start_loading()?;
//! cache.cache_finished(1, &prompt, &slots)?;
//! cache.poll()?;                                         // write-through to host launches
//!
//! cache.arrive(2, &prompt)?;
//! let adm = cache.admit(2, &prompt)?;
//! assert_eq!(adm.device_pages, 4);                       // an L1 hit
//! cache.abort(2)?;
//! cache.shutdown()?;
//! # Ok::<(), hicache::HiCacheError>(())
//! ```
//!
//! ## Hybrid models
//!
//! [`HybridCache`] is the controller of a hybrid model — Full-attention KV, sliding-window
//! (SWA) KV and Mamba state — over `hicache-core`'s `UnifiedTree` (SGLang 0.5.23's
//! `UnifiedRadixCache`), with one device pool, host pool and copy engine per component and
//! L3 in the layout our Python package shares with SGLang. Its tick is the same as above
//! (see [`hybrid`]).
//!
//! ## Features
//! - `file` (default): the file-system L3 backend.
//! - `plugin` (default): L3 backends loaded from a `.so` through the versioned C ABI.
//! - `cuda` (default): the CUDA device (cudarc with dynamic loading, so it builds anywhere and
//!   opening a GPU without libcuda is an error); the `sim` device is always built.
//! - `uring`: local NVMe through io_uring + O_DIRECT.
//! - `rdma`: remote memory pools (`hicache-rdma-server`) over TCP; `rdma-verbs` adds the
//!   one-sided RDMA data plane.
#![warn(missing_docs)]

mod agree;
pub mod backends;
mod builder;
mod cache;
pub mod config;
mod copies;
pub mod error;
pub mod hybrid;
mod kv_events_config;
mod l2_l3_sharing;
mod l3;
pub mod metrics;
pub mod observe;
pub mod rank;
mod request_state;
mod tick;
mod tree_pools;

pub use builder::HiCacheBuilder;
pub use cache::HiCache;
pub use config::{HiCacheConfig, HostMemoryMode, IoBackendKind, StorageWriteMode};
pub use error::{HiCacheError, Result};
pub use hybrid::{
    ComponentTotals, HybridAdmission, HybridArrival, HybridCache, HybridCacheBuilder, HybridConfig,
    HybridDemand, HybridExtent, HybridSlots, HybridTotals, MambaLoadBack, StateSlot,
};
pub use l3::L3_WRITE_BATCHES_IN_FLIGHT;
pub use l3::RequestId;
pub use rank::{RankError, RankGroup, SingleRank, TcpRankGroup};
pub use request_state::{Admission, Arrival};
pub use tick::{EXCHANGE_BACKUPS_FINISHED, EXCHANGE_WRITES_FINISHED, InFlight, PollReport};

pub use hicache_core::{
    Component, ComponentKvEvent, CoreError, DType, DeviceSlot, EventComponent, HashMode,
    HiRadixTree, HostSlot, KvEvent, KvKind, KvShape, LayoutKind, Medium, Namespace, PrefetchPolicy,
    StrategyKind, TenantId, WritePolicy,
};
pub use hicache_gpu::{Device, DevicePool, GpuError, LayerDoneCounter, StatePool, TransferConfig};
pub use hicache_host::{HostError, MambaShape};
pub use hicache_storage::{Registry, Storage, StorageConfig, StorageError};
