//! [`Registration`]: host memory (a [`HostPool`] or a [`MambaPool`]) page-locked with the
//! device.
//!
//! On CUDA the memory's region is registered with `cuMemHostRegister(PORTABLE | DEVICEMAP)`,
//! so DMA copies run at full speed and the transfer kernels read and write it directly.
//! On sim there is nothing to register; the "device address" of the memory is its host address.
//! Anything that is one [`MemoryRegion`] and records whether it is registered
//! ([`RegistrableMemory`]) can be registered; [`HostRegistration`] (a host KV pool) and
//! [`StateRegistration`] (a host Mamba state pool) are the two the transfer engines use.
//!
//! Drop order (invariant): the registration holds an `Arc` of the memory, so the memory (and
//! its mapping) cannot be unmapped before the registration is dropped; the registration
//! unregisters in its own `Drop`, and every transfer engine holds an `Arc` of the
//! registration and synchronises its streams in its `Drop`. So: engines → registration
//! (unregister) → pool (munmap).

use std::sync::Arc;

use hicache_core::MemoryRegion;
use hicache_host::{HostPool, MambaPool};

use crate::device::{Backend, Device};
use crate::error::Result;

/// Host memory that can be page-locked with a device: one mapping that stays mapped while
/// the value lives, and a flag recording whether it is registered with CUDA.
pub trait RegistrableMemory: Send + Sync + 'static {
    /// The whole mapping.
    fn region(&self) -> MemoryRegion;
    /// Records whether the region is page-locked with CUDA.
    fn set_cuda_registered(&self, registered: bool);
}

impl RegistrableMemory for HostPool {
    fn region(&self) -> MemoryRegion {
        HostPool::region(self)
    }
    fn set_cuda_registered(&self, registered: bool) {
        HostPool::set_cuda_registered(self, registered)
    }
}

impl RegistrableMemory for MambaPool {
    fn region(&self) -> MemoryRegion {
        MambaPool::region(self)
    }
    fn set_cuda_registered(&self, registered: bool) {
        MambaPool::set_cuda_registered(self, registered)
    }
}

/// Host memory registered with a device (see the module docs).
pub struct Registration<M: RegistrableMemory> {
    device: Device,
    pool: Arc<M>,
    device_addr: u64,
}

/// A host KV pool registered with a device.
pub type HostRegistration = Registration<HostPool>;

/// A host Mamba state pool registered with a device.
pub type StateRegistration = Registration<MambaPool>;

impl<M: RegistrableMemory> std::fmt::Debug for Registration<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("device", &self.device)
            .field("region", &self.pool.region())
            .finish()
    }
}

impl<M: RegistrableMemory> Registration<M> {
    /// Registers `pool` with `device`. Errors if the driver refuses (e.g. the region is
    /// already registered).
    pub fn new(device: &Device, pool: Arc<M>) -> Result<Arc<Self>> {
        let region = pool.region();
        let device_addr = match device.backend() {
            Backend::Cuda(c) => {
                // SAFETY: the region is the pool's mapping, alive while `pool` (held below)
                // lives; unregistered in Drop before the Arc is released.
                let a = unsafe { c.register_host(region.addr, region.len)? };
                pool.set_cuda_registered(true);
                a
            }
            Backend::Sim { .. } => region.addr as u64,
        };
        Ok(Arc::new(Self {
            device: device.clone(),
            pool,
            device_addr,
        }))
    }

    /// The registered memory.
    pub fn pool(&self) -> &Arc<M> {
        &self.pool
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Address of the memory's first byte as the device sees it.
    pub fn device_addr(&self) -> u64 {
        self.device_addr
    }
}

impl<M: RegistrableMemory> Drop for Registration<M> {
    fn drop(&mut self) {
        if let Backend::Cuda(c) = self.device.backend() {
            self.pool.set_cuda_registered(false);
            // SAFETY: registered in `new`; every engine using it has synchronised (module docs).
            if let Err(e) = unsafe { c.unregister_host(self.pool.region().addr) } {
                tracing::error!(error = %e, "cuMemHostUnregister of host memory failed");
            }
        }
    }
}
