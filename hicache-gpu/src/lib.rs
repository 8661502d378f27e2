//! # hicache-gpu
//!
//! L1 of hicache-rs: the device KV pool and everything that moves pages between it and the
//! host pool (L2, `hicache-host`).
//!
//! - [`device`]: a [`Device`] (CUDA through cudarc with dynamic loading, or the [`sim`]
//!   device), its memory, [`Stream`]s and [`Event`]s.
//! - [`pool`]: the [`DevicePool`], allocated by us or registered from the engine's buffers,
//!   with a page allocator ([`DeviceSlot`]).
//! - [`registration`]: the host pool page-locked with the device ([`HostRegistration`]).
//! - [`transfer`]: the [`TransferEngine`]: `backup` (D2H, all layers) and `load` (H2D, layer
//!   by layer with an event per layer), io backends `kernel` ([`kernels`], NVRTC, [`copy`]) and
//!   `direct` ([`plan`]).
//! - [`layer`]: [`LayerDoneCounter`], so attention for layer `i` waits for layer `i` only.
//!
//! Without a GPU everything runs on the sim device, where each kernel is replaced by its CPU
//! reference ([`copy::copy_reference`]) and DMA copies by memcpy.
#![warn(missing_docs)]

/// The README's example, run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
/// The CUDA backend's stand-in when the `cuda` feature is off (every type uninhabited).
#[cfg(not(feature = "cuda"))]
#[path = "cuda_off.rs"]
pub mod cuda;
pub mod device;
pub mod error;
#[cfg(feature = "cuda")]
pub mod kernels;
pub mod layer;
pub mod plan;
pub mod pool;
pub mod registration;
pub mod sim;
pub mod transfer;

pub use device::{Device, DeviceBuffer, DeviceKind, Event, SimGate, Stream};
pub use error::{GpuError, Result};
pub use hicache_core::DeviceSlot;
pub use layer::LayerDoneCounter;
pub use plan::{Direction, MemcpyOp};
pub use pool::{DevicePool, DeviceRegion, EngineLayer};
pub use registration::HostRegistration;
pub use transfer::{
    Completion, DEFAULT_CTAS, IoBackend, LoadHandle, TransferConfig, TransferEngine,
};

#[cfg(test)]
mod tests {
    /// The controller shares these across threads.
    #[test]
    fn public_types_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<super::Device>();
        check::<super::DevicePool>();
        check::<super::TransferEngine>();
        check::<super::LoadHandle>();
        check::<super::Completion>();
        check::<super::LayerDoneCounter>();
        check::<super::HostRegistration>();
        check::<super::Stream>();
        check::<super::Event>();
        check::<hicache_host::HostPool>();
    }
}
