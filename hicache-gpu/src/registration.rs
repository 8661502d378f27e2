//! [`HostRegistration`]: the host pool page-locked with the device.
//!
//! On CUDA the pool's region is registered with `cuMemHostRegister(PORTABLE | DEVICEMAP)`,
//! so DMA copies run at full speed and the transfer kernels read and write it directly.
//! On sim there is nothing to register; the "device address" of the pool is its host address.
//!
//! Drop order (invariant): the registration holds an `Arc` of the pool, so the pool (and its
//! mapping) cannot be unmapped before the registration is dropped; the registration
//! unregisters in its own `Drop`, and every transfer engine holds an `Arc` of the
//! registration and synchronises its streams in its `Drop`. So: engines → registration
//! (unregister) → pool (munmap).

use std::sync::Arc;

use hicache_host::HostPool;

use crate::device::{Backend, Device};
use crate::error::Result;

/// A host pool registered with a device (see the module docs).
pub struct HostRegistration {
    device: Device,
    pool: Arc<HostPool>,
    device_addr: u64,
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration")
            .field("device", &self.device)
            .field("region", &self.pool.region())
            .finish()
    }
}

impl HostRegistration {
    /// Registers `pool` with `device`. Errors if the driver refuses (e.g. the region is
    /// already registered).
    pub fn new(device: &Device, pool: Arc<HostPool>) -> Result<Arc<Self>> {
        let region = pool.region();
        let device_addr = match device.backend() {
            Backend::Cuda(c) => {
                // SAFETY: the region is the pool's mapping, alive while `pool` (held below)
                // lives; unregistered in Drop before the Arc is released.
                let a = unsafe { c.register_host(region.addr, region.len)? };
                pool.set_cuda_registered(true);
                a
            }
            Backend::Sim => region.addr as u64,
        };
        Ok(Arc::new(Self {
            device: device.clone(),
            pool,
            device_addr,
        }))
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<HostPool> {
        &self.pool
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Address of the pool's first byte as the device sees it.
    pub fn device_addr(&self) -> u64 {
        self.device_addr
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if let Backend::Cuda(c) = self.device.backend() {
            self.pool.set_cuda_registered(false);
            // SAFETY: registered in `new`; every engine using it has synchronised (module docs).
            if let Err(e) = unsafe { c.unregister_host(self.pool.region().addr) } {
                tracing::error!(error = %e, "cuMemHostUnregister of the host pool failed");
            }
        }
    }
}
