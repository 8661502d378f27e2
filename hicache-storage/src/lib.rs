//! # hicache-storage
//!
//! The L3 contract of hicache-rs: what a storage backend is, how it is configured and found,
//! and how it is tested.
//!
//! - [`Storage`]: the async trait every backend implements, with its rules in [`backend`]'s
//!   documentation: atomic visibility, verified reads, stored metadata, leading-run
//!   `batch_exists`, bounded batches, idempotent set, capacity with eviction, concurrency.
//! - [`BatchContext`]: the per-batch context (the request's prefix keys, extra info) of the
//!   `*_with` calls, which backends may use for placement (rule 9); [`ContextLog`] records it.
//! - [`PageBuf`] / [`PageBufMut`]: caller-owned page views (one or many parts), so pages move
//!   between the pinned host pool and storage without staging copies; [`PageOutcome`]: one
//!   outcome per page.
//! - [`StorageConfig`]: backend name plus the extra-config JSON, parsed strictly; common
//!   HiCache fields ([`CommonConfig`]) once, the backend's own fields ([`ConfigFields`]) by the
//!   backend.
//! - [`Registry`]: names to [`BackendFactory`]s; built-ins behind features, third parties with
//!   one `register` call.
//! - [`MemoryBackend`] (feature `memory`, default): the in-memory reference backend.
//! - [`conformance`]: the public suite every backend runs from its own tests
//!   (`conformance_tests!`; the cases need the feature `testing`, the [`conformance::Harness`]
//!   trait does not); `faults` (feature `testing`): the fault-injection suite
//!   every persistent backend runs (`fault_tests!`): bit flips, truncation, garbage files,
//!   foreign directories, a second opener, a full disk. Enable the feature in a backend's
//!   `[dev-dependencies]` only, so production builds compile neither.
//! - [`SetBatch`] / [`Outcomes`]: batch classification (empty / too large / present /
//!   repeated) and outcome gathering, once for every backend.
//! - [`StorageExt`]: owned-bytes helpers that batch automatically, for simple callers.
//!
//! Page keys are [`hicache_core::PageKey`] (namespace id + page hash, 48 bytes), re-exported
//! here; backends treat them as opaque and may use [`PageKey::to_hex`] as a name.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> hicache_storage::Result<()> {
//! use hicache_storage::{LayoutKind, MemoryBackend, PageOutcome, Storage, StorageExt, pattern};
//! let storage = MemoryBackend::with_capacity(64 << 20);
//! let key = pattern::page_key(pattern::namespace(1), 42, 0);
//! let page = pattern::page_bytes(&key, 4096);
//! assert_eq!(storage.put(LayoutKind::PageFirst, key, &page).await?, PageOutcome::Stored);
//! assert_eq!(storage.batch_exists(&[key]).await?, 1);
//! let back = storage.get(LayoutKind::PageFirst, 4096, key).await?.expect("a hit");
//! assert_eq!(&back[..], &page[..]);
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod backend;
pub mod batch;
pub mod checksum;
pub mod config;
pub mod conformance;
pub mod context;
pub mod error;
pub mod evict;
pub mod ext;
pub mod factory;
#[cfg(feature = "testing")]
pub mod faults;
pub mod lifecycle;
pub mod machine;
#[cfg(feature = "memory")]
pub mod memory;
pub mod page;
pub mod pattern;
pub mod registry;
pub mod strict_json;

pub use backend::{
    BackendInfo, STORAGE_BATCH_SIZE, StatsCounters, Storage, StorageStats, check_batch,
};
pub use batch::{Outcomes, SetBatch};
pub use config::{
    CommonConfig, ConfigFields, DYNAMIC_BACKEND, StorageConfig, parse_byte_size, read_config_file,
};
pub use context::{BatchContext, ContextLog, SeenContext};
pub use error::{Result, StorageError};
pub use evict::{EvictionPolicy, Evictor};
pub use ext::StorageExt;
pub use factory::{BackendContext, BackendFactory};
pub use hicache_core::{LayoutKind, MemoryRegion, NamespaceId, PageHash, PageKey};
pub use lifecycle::{Clock, Lifecycle, Watermarks};
#[cfg(feature = "memory")]
pub use memory::{MemoryBackend, MemoryFactory, MemoryOptions};
pub use page::{PageBuf, PageBufMut, PageError, PageMeta, PageOutcome, leading_ok};
pub use registry::Registry;

/// Re-exported so backend crates implement [`Storage`] with the same macro version.
pub use async_trait::async_trait;
