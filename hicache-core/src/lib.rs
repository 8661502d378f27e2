//! # hicache-core
//!
//! The pure logic of hicache-rs: no I/O, no `unsafe`, no async runtime, no CUDA.
//!
//! - [`key`]: page identities ([`PageHash`], [`NamespaceId`], [`PageKey`]).
//! - [`pool_key`]: the namespaces of SGLang's sidecar host pools (v2 interface).
//! - [`hash`]: the chained page hasher ([`PageHasher`]) in SGLang-compatible and namespaced
//!   modes.
//! - [`layout`]: KV shapes ([`KvShape`]) and host layouts ([`LayoutKind`]).
//! - [`region`]: the [`MemoryRegion`] descriptor of the pinned host pool.
//! - [`slot`]: page slots of the device and host pools ([`DeviceSlot`], [`HostSlot`]).
//! - [`tree`]: the [`HiRadixTree`], which pages live in device and host memory.
//! - [`unified`]: the [`UnifiedTree`], whose nodes carry Full, sliding-window and Mamba
//!   components with SGLang's `UnifiedRadixCache` semantics.
//! - [`eviction`]: eviction strategies behind [`EvictionStrategy`].
//! - [`policy`]: write and prefetch policies; [`event`]: KV events.
//!
//! Everything else in the workspace builds on these descriptors, so that `hicache-storage` and
//! `hicache-host` need not know each other.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod error;
pub mod event;
pub mod eviction;
pub mod hash;
pub mod key;
pub mod layout;
pub mod policy;
pub mod pool_key;
pub mod region;
pub mod slot;
pub mod tree;
pub mod unified;

pub use error::{CoreError, Result};
pub use event::{ComponentKvEvent, EventComponent, KvEvent, Medium};
pub use eviction::{EvictionStrategy, NodeStats, StrategyKind};
pub use hash::{ChainStart, FORMAT_VERSION, HashMode, Namespace, PageHasher};
pub use key::{NamespaceId, PageHash, PageKey, tokens_from_i64, tokens_from_u64};
pub use layout::{DType, KvKind, KvShape, LayoutKind};
pub use policy::{PrefetchConfig, PrefetchPolicy, WritePolicy};
pub use pool_key::{
    PoolDeployment, PoolFingerprint, PoolPieces, pool_namespace_id, torch_dtype_name,
};
pub use region::MemoryRegion;
pub use slot::{DeviceSlot, HostSlot};
pub use tree::{
    BackupFragment, BackupPlan, EvictHostOutcome, EvictOutcome, FinishedBackup, HiRadixTree,
    HostAllocator, HostInsertResult, InsertOptions, InsertResult, KnownHashes, LoadBackPlan,
    LoadId, MatchResult, NoHost, NodeId, NodeInfo, StagedWriteBack, TenantId, TreeConfig,
    TreeStats, WriteId, page_aligned,
};
pub use unified::{
    AdmissionAsk, BackupId, Component, DeviceFree, DeviceLoad, EvictRequest, Evicted, HostBackup,
    HostLockReceipt, InsertParams, InsertSlots, LockReceipt, UnifiedBackupPlan, UnifiedConfig,
    UnifiedInsert, UnifiedLoadId, UnifiedLoadPlan, UnifiedMatch, UnifiedTree,
};
