//! # hicache-core
//!
//! The pure logic of hicache-rs: no I/O, no `unsafe`, no async runtime, no CUDA.
//!
//! - [`key`]: page identities ([`PageHash`], [`NamespaceId`], [`PageKey`]).
//! - [`hash`]: the chained page hasher ([`PageHasher`]) in SGLang-compatible and namespaced
//!   modes.
//! - [`layout`]: KV shapes ([`KvShape`]) and host layouts ([`LayoutKind`]).
//! - [`region`]: the [`MemoryRegion`] descriptor of the pinned host pool.
//!
//! Everything else in the workspace builds on these descriptors, so that `hicache-storage` and
//! `hicache-host` need not know each other.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod error;
pub mod hash;
pub mod key;
pub mod layout;
pub mod region;

pub use error::{CoreError, Result};
pub use hash::{ChainStart, FORMAT_VERSION, HashMode, Namespace, PageHasher};
pub use key::{NamespaceId, PageHash, PageKey, tokens_from_i64, tokens_from_u64};
pub use layout::{DType, KvKind, KvShape, LayoutKind};
pub use region::MemoryRegion;
