//! [`Pools`]: the device and host pools of each component and the copy engines between
//! them. Slot indices are the tree's `u32`s; this module turns them into each pool's slot
//! type.
//!
//! Ownership (invariant): a device page or state slot is owned by the tree (a cached
//! prefix), by a request (allocated, not yet handed back), or free; a host slot is owned by
//! the tree (a backed-up node, from the commit of its backup) or free. Only the facade frees
//! slots, and only those an eviction, an insert or a request hands back.

use std::sync::Arc;

use hicache_core::{Component, DeviceSlot, Evicted, HostSlot};
use hicache_gpu::{DevicePool, HostRegistration, TransferConfig, TransferEngine};
use hicache_host::{HostPool, HostPoolGroup};

use super::copies::Launched;
use crate::error::{HiCacheError, Result};

/// A KV component (Full or SWA): its device pool, its host pool and the engine between them.
pub(crate) struct KvPart {
    /// L1 pages.
    pub dev: Arc<DevicePool>,
    /// L2 pages.
    pub host: Arc<HostPool>,
    /// Copies between them.
    pub engine: TransferEngine,
}

impl KvPart {
    /// Registers `host` with the device of `dev` and builds the engine.
    pub fn new(
        dev: Arc<DevicePool>,
        host: Arc<HostPool>,
        transfer: TransferConfig,
    ) -> Result<Self> {
        let reg = HostRegistration::new(dev.device(), host.clone())?;
        let engine = TransferEngine::new(dev.clone(), reg, transfer)?;
        Ok(Self { dev, host, engine })
    }

    /// `n` free device pages, or `None`.
    pub fn alloc_dev(&self, n: usize) -> Option<Vec<u32>> {
        Some(self.dev.alloc(n)?.into_iter().map(|s| s.0).collect())
    }

    /// Frees device pages.
    pub fn free_dev(&self, slots: &[u32]) -> Result<()> {
        Ok(self.dev.free(&dev_slots(slots))?)
    }

    /// `n` free host pages, or `None`.
    pub fn alloc_host(&self, n: usize) -> Option<Vec<u32>> {
        Some(self.host.alloc(n)?.into_iter().map(|s| s.0).collect())
    }

    /// Frees host pages.
    pub fn free_host(&self, slots: &[u32]) -> Result<()> {
        Ok(self.host.free(&host_slots(slots))?)
    }

    /// Launches the device → host copy of `dev[i]` into `host[i]`.
    pub fn backup(&self, dev: &[u32], host: &[u32]) -> Result<Launched> {
        let c = self
            .engine
            .backup(&dev_slots(dev), &host_slots(host), &[])?;
        Ok(Launched::Done(c))
    }

    /// Launches the host → device copy of `host[i]` into `dev[i]`.
    pub fn load(&self, host: &[u32], dev: &[u32]) -> Result<Launched> {
        let l = self.engine.load(&host_slots(host), &dev_slots(dev), &[])?;
        Ok(Launched::Load(l))
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> usize {
        self.dev.page_bytes()
    }
}

fn dev_slots(s: &[u32]) -> Vec<DeviceSlot> {
    s.iter().map(|&x| DeviceSlot(x)).collect()
}

fn host_slots(s: &[u32]) -> Vec<HostSlot> {
    s.iter().map(|&x| HostSlot(x)).collect()
}

/// Every component's pools.
pub(crate) struct Pools {
    /// The host pools (the KV parts hold shared handles of the group's pools).
    pub group: Arc<HostPoolGroup>,
    /// Full-attention KV.
    pub full: KvPart,
    /// Sliding-window KV, when configured.
    pub swa: Option<KvPart>,
    /// Mamba state, when configured.
    pub mamba: Option<super::state::StatePart>,
}

impl Pools {
    /// The KV part of `c` (Full or a configured SWA).
    pub fn kv(&self, c: Component) -> Result<&KvPart> {
        match c {
            Component::Full => Ok(&self.full),
            Component::Swa => self.swa.as_ref().ok_or_else(|| missing(c)),
            Component::Mamba => Err(missing(c)),
        }
    }

    /// The Mamba part.
    pub fn state(&self) -> Result<&super::state::StatePart> {
        self.mamba.as_ref().ok_or_else(|| missing(Component::Mamba))
    }

    /// Free device units of `c` (pages, or state slots).
    pub fn dev_available(&self, c: Component) -> usize {
        match c {
            Component::Mamba => self.mamba.as_ref().map_or(0, |m| m.dev_available()),
            _ => self.kv(c).map_or(0, |p| p.dev.available()),
        }
    }

    /// Free host units of `c`.
    pub fn host_available(&self, c: Component) -> usize {
        match c {
            Component::Mamba => self.mamba.as_ref().map_or(0, |m| m.host_available()),
            _ => self.kv(c).map_or(0, |p| p.host.available()),
        }
    }

    /// Whether every one of `slots` is an allocated device slot of `c`, none named twice.
    pub fn owned_once(&self, c: Component, slots: &[u32]) -> bool {
        let mut sorted = slots.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return false;
        }
        slots.iter().all(|&s| match c {
            Component::Mamba => self
                .mamba
                .as_ref()
                .is_some_and(|m| m.dev.is_allocated(hicache_gpu::StateSlot(s))),
            _ => self.kv(c).is_ok_and(|p| p.dev.is_allocated(DeviceSlot(s))),
        })
    }

    /// Frees the device slots an eviction reports.
    pub fn free_evicted(&self, e: &Evicted) -> Result<()> {
        self.full.free_dev(&e.full_pages)?;
        if let Some(swa) = &self.swa {
            swa.free_dev(&e.swa_pages)?;
        }
        if let Some(m) = &self.mamba {
            m.free_dev(&e.mamba_slots)?;
        }
        Ok(())
    }

    /// Frees the host slots a host eviction reports.
    pub fn free_host_evicted(&self, e: &Evicted) -> Result<()> {
        self.full.free_host(&e.host_full_pages)?;
        if let Some(swa) = &self.swa {
            swa.free_host(&e.host_swa_pages)?;
        }
        if let Some(m) = &self.mamba {
            m.free_host(&e.host_mamba_slots)?;
        }
        Ok(())
    }

    /// Blocks until every engine's streams are idle.
    pub fn synchronize(&self) -> Result<()> {
        self.full.engine.synchronize()?;
        if let Some(swa) = &self.swa {
            swa.engine.synchronize()?;
        }
        if let Some(m) = &self.mamba {
            m.synchronize()?;
        }
        Ok(())
    }
}

fn missing(c: Component) -> HiCacheError {
    HiCacheError::BadArgument(format!("the {c:?} component is not configured"))
}
