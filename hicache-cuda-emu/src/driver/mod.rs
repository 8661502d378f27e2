//! The emulated CUDA driver: the `cu*` entry points the CUDA path (cudarc 0.19 with dynamic
//! loading) calls, exported from the cdylib, with the driver's documented ordering
//! ([`stream`]) and checks of what real hardware punishes ([`memory`]): access outside any
//! allocation, use after free, async copies from host memory that is neither registered nor
//! pinned, 2D copies with width > pitch or bad memory types, kernel images whose parameter
//! block differs from the CPU kernel's. Every entry point is counted ([`stats`]).
//!
//! One emulated device (ordinal 0): "Emulated H100 (hicache-cuda-emu)", compute capability
//! 9.0, 132 SMs, memory pools, unified addressing. Device pointers are host addresses.

pub mod api;
pub mod image;
pub mod memory;
pub mod stats;
pub mod stream;
