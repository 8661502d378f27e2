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

use super::cache::Units;
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

/// The components in the order of [`Units`]' lists and of [`Pools::alloc`] / [`Pools::free`].
pub(crate) const COMPONENTS: [Component; 3] = [Component::Full, Component::Swa, Component::Mamba];

/// Which pool of a component: the device's (L1) or the host's (L2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tier {
    /// Device pages and state slots.
    Device,
    /// Host pages and state slots.
    Host,
}

/// The slots of `tier` an eviction reports, per component (Full, SWA, Mamba).
pub(crate) fn evicted(e: &Evicted, tier: Tier) -> [&[u32]; 3] {
    match tier {
        Tier::Device => [&e.full_pages, &e.swa_pages, &e.mamba_slots],
        Tier::Host => [&e.host_full_pages, &e.host_swa_pages, &e.host_mamba_slots],
    }
}

/// The slots of a plan's per-node list (a load-back's or a backup's), its nodes in order.
pub(crate) fn plan_slots(list: &[(hicache_core::NodeId, Vec<u32>)]) -> Vec<u32> {
    list.iter().flat_map(|(_, p)| p.iter().copied()).collect()
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

    /// Bytes of one device unit of `c` (a page, or a state); 0 when `c` is not configured.
    pub fn unit_bytes(&self, c: Component) -> usize {
        match c {
            Component::Mamba => self.mamba.as_ref().map_or(0, |m| m.slot_bytes()),
            _ => self.kv(c).map_or(0, |p| p.page_bytes()),
        }
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

    /// `n` free slots of `c` in `tier`; none when `n` is 0 or the pool is short of room.
    fn alloc_of(&self, tier: Tier, c: Component, n: usize) -> Result<Vec<u32>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let got = match (c, tier) {
            (Component::Mamba, Tier::Device) => self.state()?.alloc_dev(n),
            (Component::Mamba, Tier::Host) => self.state()?.alloc_host(n),
            (_, Tier::Device) => self.kv(c)?.alloc_dev(n),
            (_, Tier::Host) => self.kv(c)?.alloc_host(n),
        };
        Ok(got.unwrap_or_default())
    }

    /// `want` slots of each component (Full, SWA, Mamba) in `tier`; a pool short of room
    /// gives none (the callers evict first and check the room).
    pub fn alloc(&self, tier: Tier, want: [usize; 3]) -> Result<Units> {
        let mut got: [Vec<u32>; 3] = Default::default();
        for ((slots, c), n) in got.iter_mut().zip(COMPONENTS).zip(want) {
            *slots = self.alloc_of(tier, c, n)?;
        }
        let [full, swa, mamba] = got;
        Ok(Units { full, swa, mamba })
    }

    /// Frees slots of each component (Full, SWA, Mamba) in `tier`; a component with none is
    /// not touched (so an unconfigured one is no error).
    pub fn free(&self, tier: Tier, slots: [&[u32]; 3]) -> Result<()> {
        for (c, s) in COMPONENTS.into_iter().zip(slots) {
            if s.is_empty() {
                continue;
            }
            match (c, tier) {
                (Component::Mamba, Tier::Device) => self.state()?.free_dev(s)?,
                (Component::Mamba, Tier::Host) => self.state()?.free_host(s)?,
                (_, Tier::Device) => self.kv(c)?.free_dev(s)?,
                (_, Tier::Host) => self.kv(c)?.free_host(s)?,
            }
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
