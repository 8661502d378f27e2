//! [`StatePart`]: the Mamba component's device state pool, the host state pool and the
//! copies between them (`hicache_gpu::StateTransfer`). Slot indices are the tree's `u32`s.
//!
//! Ownership (invariant, as for the KV parts): a device state slot is owned by the tree (a
//! cached node's state), by a request (its copy-on-write slot or an allocated one), or
//! free; a host state slot by the tree from its backup's commit until a host eviction
//! reports it, or free.

use std::sync::Arc;

use hicache_gpu::{Device, StatePool, StateTransfer};
use hicache_host::{MambaPool, MambaShape, MambaSlot};

pub use hicache_gpu::StateSlot;

use super::copies::Launched;
use crate::error::Result;

/// The Mamba component's pools and copy engine.
pub(crate) struct StatePart {
    /// Device states.
    pub dev: Arc<StatePool>,
    /// Host states (the group's Mamba pool).
    pub host: Arc<MambaPool>,
    xfer: StateTransfer,
}

impl StatePart {
    /// A device pool of `slots` states of `shape` and the engine to `host`.
    pub fn new(
        device: &Device,
        shape: &MambaShape,
        slots: usize,
        host: Arc<MambaPool>,
    ) -> Result<Self> {
        let dev = Arc::new(StatePool::new(device, shape, slots)?);
        let xfer = StateTransfer::new(dev.clone(), host.clone())?;
        Ok(Self { dev, host, xfer })
    }

    /// Free device state slots.
    pub fn dev_available(&self) -> usize {
        self.dev.available()
    }

    /// Free host state slots.
    pub fn host_available(&self) -> usize {
        self.host.available()
    }

    /// `n` device state slots, or `None`.
    pub fn alloc_dev(&self, n: usize) -> Option<Vec<u32>> {
        Some(self.dev.alloc(n)?.into_iter().map(|s| s.0).collect())
    }

    /// Frees device state slots.
    pub fn free_dev(&self, s: &[u32]) -> Result<()> {
        let slots: Vec<StateSlot> = s.iter().map(|&x| StateSlot(x)).collect();
        Ok(self.dev.free(&slots)?)
    }

    /// `n` host state slots, or `None`.
    pub fn alloc_host(&self, n: usize) -> Option<Vec<u32>> {
        Some(self.host.alloc(n)?.into_iter().map(|s| s.0).collect())
    }

    /// Frees host state slots.
    pub fn free_host(&self, s: &[u32]) -> Result<()> {
        let slots: Vec<MambaSlot> = s.iter().map(|&x| MambaSlot(x)).collect();
        Ok(self.host.free(&slots)?)
    }

    /// Launches the device → host copy of one state.
    pub fn backup(&self, dev: u32, host: u32) -> Result<Launched> {
        let c = self
            .xfer
            .backup(&[StateSlot(dev)], &[MambaSlot(host)], &[])?;
        Ok(Launched::Done(c))
    }

    /// Launches the host → device copy of one state.
    pub fn load(&self, host: u32, dev: u32) -> Result<Launched> {
        let l = self.xfer.load(&[MambaSlot(host)], &[StateSlot(dev)], &[])?;
        Ok(Launched::Load(l))
    }

    /// Launches the device copy-on-write of one state (on the load stream, after any load
    /// queued before it).
    pub fn copy(&self, src: u32, dst: u32) -> Result<Launched> {
        let c = self.xfer.copy_slot(StateSlot(src), StateSlot(dst), &[])?;
        Ok(Launched::Done(c))
    }

    /// Bytes of one state.
    pub fn slot_bytes(&self) -> usize {
        self.dev.slot_bytes()
    }

    /// Reads one device state (synchronous).
    pub fn read(&self, slot: u32) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.slot_bytes()];
        self.dev.read_slot(StateSlot(slot), &mut out)?;
        Ok(out)
    }

    /// Writes one device state (synchronous).
    pub fn write(&self, slot: u32, src: &[u8]) -> Result<()> {
        Ok(self.dev.write_slot(StateSlot(slot), src)?)
    }

    /// Waits for the engine's streams.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.xfer.synchronize()?)
    }
}
