//! # hicache-gpu
//!
//! L1 of hicache-rs: the device KV pool and everything that moves pages between it and the
//! host pool (L2, `hicache-host`).
//!
//! - [`device`]: a [`Device`] (CUDA through cudarc with dynamic loading, or the [`sim`]
//!   device), its memory, [`Stream`]s and [`Event`]s.
//! - [`pool`]: the [`DevicePool`], allocated by us or registered from the engine's buffers,
//!   with a page allocator ([`DeviceSlot`]).
//! - [`registration`]: host memory page-locked with the device ([`HostRegistration`] for a
//!   host KV pool, [`StateRegistration`] for a host Mamba state pool).
//! - [`transfer`]: the [`TransferEngine`]: `backup` (D2H, all layers) and `load` (H2D, layer
//!   by layer with an event per layer), io backends `kernel` ([`kernels`], NVRTC, [`copy`]) and
//!   `direct` ([`plan`]).
//! - [`layer`]: [`LayerDoneCounter`], so attention for layer `i` waits for layer `i` only.
//! - [`state`]: the [`StatePool`] of Mamba states on the device ([`StateSlot`]), and
//!   [`state_transfer`]: the [`StateTransfer`] between it and the host `MambaPool` (`backup`,
//!   layer-by-layer `load`, device-to-device `copy_slot`).
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
pub mod marks;
pub mod plan;
pub mod pool;
pub mod registration;
pub mod sim;
pub mod state;
pub mod state_transfer;
pub mod transfer;

pub use device::{Device, DeviceBuffer, DeviceKind, Event, SimGate, Stream};
pub use error::{GpuError, Result};
pub use hicache_core::DeviceSlot;
pub use layer::LayerDoneCounter;
pub use marks::PageMarks;
pub use plan::{DeviceCopy, Direction, MemcpyOp};
pub use pool::{DevicePool, DeviceRegion, EngineLayer};
pub use registration::{HostRegistration, RegistrableMemory, Registration, StateRegistration};
pub use state::{StatePool, StateSlot};
pub use state_transfer::StateTransfer;
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
        check::<super::StateRegistration>();
        check::<super::StatePool>();
        check::<super::StateTransfer>();
        check::<super::Stream>();
        check::<super::Event>();
        check::<hicache_host::HostPool>();
    }
}
