//! # hicache-host
//!
//! L2 of hicache-rs: the pinned host KV pool.
//!
//! - [`memory`]: one anonymous, populated mapping ([`HostMemory`]), 2 MiB huge pages when the
//!   machine has them (hugetlb, else transparent huge pages), or populated on touch for pools
//!   a payload-free simulation never copies ([`Populate`]), exposed as a
//!   [`MemoryRegion`](hicache_core::MemoryRegion) that io_uring, RDMA and CUDA register once.
//! - [`layout`]: [`HostLayout`], the byte offset of every `(half, page, layer, token)` row for
//!   `layer_first`, `page_first` and `page_first_direct`, and the contiguous parts of a page.
//! - [`alloc`]: [`PageAllocator`], a free list with double-free detection, generic over the
//!   slot type so the device pool reuses it.
//! - [`pool`]: [`HostPool`], sized by pages, bytes or ratio with a RAM check, with page views
//!   (iovecs for zero-copy L3, flat `get_page` / `set_page` copies for generic backends).
//! - [`mamba`]: [`MambaPool`], Mamba / linear-attention states, one per slot, in SGLang's
//!   `MambaPoolHost` geometry (temporal + conv pieces, each with its own dtype).
//! - [`component`]: [`HostComponent`], the pools of a group as SGLang names them.
//! - [`group`]: [`HostPoolGroup`], a hybrid model's pools: KV, sliding-window KV and Mamba
//!   state, one RAM check over the group, per-component slots, iovecs, copies and regions.
//!
//! This crate knows nothing about CUDA: `hicache-gpu` page-locks the region with
//! `cuMemHostRegister` and unregisters it before the pool can be dropped.
#![warn(missing_docs)]

pub mod alloc;
pub mod component;
pub mod error;
pub mod group;
pub mod layout;
pub mod mamba;
pub mod memory;
pub mod pool;
mod reuse;

pub use alloc::{HostSlot, PageAllocator, Slot};
pub use component::HostComponent;
pub use error::{AllocError, HostError, Result};
pub use group::{HostPoolGroup, HostPoolGroupConfig};
pub use layout::{HostLayout, PagePart, Strides};
pub use mamba::{MambaPool, MambaPoolConfig, MambaShape, MambaSlot};
pub use memory::{Backing, HostMemory, HugePagePolicy, Populate, reuse_dropped_mappings};
pub use pool::{DEFAULT_RESERVE_BYTES, HostPool, HostPoolConfig, IoVec, PoolSize};

/// The README's example, run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
