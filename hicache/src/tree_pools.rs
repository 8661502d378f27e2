//! [`Tiers`]: the tree and the two pools whose pages it records, with the host budget every
//! rank agreed on. Every other part of the controller reaches L1 and L2 through it.
//!
//! Invariants:
//! 1. A device page is owned by the tree, by a request, or free; the tree's pages are freed
//!    only here (eviction), by [`Tiers::reset`] or by the tree's own write-back staging.
//! 2. `budget` is the number of host pages every rank is known to have free: agreed at the
//!    last poll, minus what this rank allocated since, plus what it freed deterministically
//!    since. Host allocations that change the tree go through it, so all ranks take the same
//!    decisions; pages freed by one rank only (prefetch leftovers) go to the pool alone.
//! 3. Under exclusive tiering, host eviction drops host-only leaves in eviction order only
//!    while their pages are known to be in L3 ([`Tiering`]): an L2 page leaves L2 only once
//!    L3 holds it, and never in place of a colder one that must stay.

use std::sync::Arc;

use hicache_core::{
    CoreError, DeviceSlot, HiRadixTree, HostAllocator, HostSlot, NodeId, StagedWriteBack,
};
use hicache_gpu::DevicePool;
use hicache_host::HostPool;

use crate::error::Result;
use crate::l2_l3_sharing::Tiering;
use crate::metrics::{DropReason, Metrics, Tier};

/// The tree, the device and host pools, the agreed host budget and the metrics they feed.
pub(crate) struct Tiers {
    /// Which pages of which prefixes live where.
    pub tree: HiRadixTree,
    /// L1.
    pub device_pool: Arc<DevicePool>,
    /// L2.
    pub host_pool: Arc<HostPool>,
    /// Host pages every rank is known to have free (invariant 2).
    pub budget: usize,
    /// Counters and gauges of this cache.
    pub metrics: Arc<Metrics>,
    /// How L2 and L3 share pages, and the pages known to be in L3.
    pub tiering: Tiering,
}

impl Tiers {
    /// The tiers of a new cache: the whole host pool is the budget.
    pub fn new(
        tree: HiRadixTree,
        device_pool: Arc<DevicePool>,
        host_pool: Arc<HostPool>,
        metrics: Arc<Metrics>,
        tiering: Tiering,
    ) -> Self {
        let budget = host_pool.available();
        Self {
            tree,
            device_pool,
            host_pool,
            budget,
            metrics,
            tiering,
        }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.tree.page_size() as usize
    }

    /// Evicts at least `pages` device pages if possible (whole nodes, so possibly more):
    /// backed-up nodes are demoted to host, others deleted, and under write-back staged to
    /// host (host pages from the budget). Frees the device pages it can free now; the staged
    /// nodes' pages are the caller's to copy and free. Returns the pages freed and the staged
    /// write-backs.
    pub fn evict_device(&mut self, pages: usize) -> Result<(usize, Vec<StagedWriteBack>)> {
        let mut host = BudgetHost {
            pool: &self.host_pool,
            budget: &mut self.budget,
        };
        let out = self.tree.evict(pages, &mut host);
        self.device_pool.free(&out.device_slots)?;
        self.metrics
            .evicted(Tier::l1, (out.demoted_pages + out.deleted_pages) as u64);
        if out.dropped_pages > 0 {
            self.metrics.dropped(
                DropReason::host_pressure,
                (out.dropped_pages * self.page_size()) as u64,
            );
            tracing::warn!(
                pages = out.dropped_pages,
                "write-back eviction found the host pool full: dropped cached pages"
            );
        }
        Ok((out.freed_pages, out.write_back))
    }

    /// Evicts at least `pages` host pages of nodes that are not on device (whole nodes;
    /// under exclusive tiering only while they are known to be in L3, invariant 3). Returns
    /// the pages freed.
    pub fn evict_host(&mut self, pages: usize) -> Result<usize> {
        let out = if self.tiering.exclusive {
            let known = &self.tiering.known;
            self.tree
                .evict_host_while(pages, &mut |h| known.contains_all(h))
        } else {
            self.tree.evict_host(pages)
        };
        self.host_pool.free(&out.host_slots)?;
        self.budget += out.host_slots.len();
        self.metrics.evicted(Tier::l2, out.freed_pages as u64);
        Ok(out.freed_pages)
    }

    /// Allocates `pages` host pages within the agreed budget, evicting host-only nodes if
    /// needed; `None` if not possible.
    pub fn alloc_host(&mut self, pages: usize) -> Result<Option<Vec<HostSlot>>> {
        if pages == 0 {
            return Ok(Some(Vec::new()));
        }
        if self.budget < pages {
            let need = pages - self.budget;
            self.evict_host(need)?;
        }
        if self.budget < pages {
            return Ok(None);
        }
        match self.host_pool.alloc(pages) {
            Some(v) => {
                self.budget -= pages;
                Ok(Some(v))
            }
            None => Ok(None),
        }
    }

    /// Frees host pages this rank's engine thread decided to free (deterministic on every
    /// rank), returning them to the budget.
    pub fn free_host(&mut self, slots: &[HostSlot]) -> Result<()> {
        self.host_pool.free(slots)?;
        self.budget += slots.len();
        Ok(())
    }

    /// Drops the host copy of `node` (see [`HiRadixTree::drop_host_copy`]) and frees its
    /// pages. Returns the pages freed: 0 when the tree keeps the copy or the node is gone.
    pub fn drop_host_copy(&mut self, node: NodeId) -> Result<usize> {
        let slots = match self.tree.drop_host_copy(node) {
            Ok(Some(slots)) => slots,
            Ok(None) | Err(CoreError::StaleNode(_)) => return Ok(0),
            Err(e) => return Err(e.into()),
        };
        self.free_host(&slots)?;
        Ok(slots.len())
    }

    /// `buffer_only`, after a load-back that ended at `node`: releases the host copies of
    /// `node` and its ancestors that are on device and whose pages are known to be in L3
    /// (walking up while nodes have a host copy). Returns the pages freed.
    pub fn release_loaded(&mut self, node: NodeId) -> Result<usize> {
        let mut freed = 0;
        let mut at = Some(node);
        while let Some(n) = at {
            let info = match self.tree.node_info(n) {
                Ok(i) => i,
                Err(CoreError::StaleNode(_)) => break,
                Err(e) => return Err(e.into()),
            };
            if info.is_root || !info.backed_up || !info.on_device {
                break;
            }
            if self.tiering.known.contains_all(self.tree.page_hashes(n)?) {
                freed += self.drop_host_copy(n)?;
            }
            at = info.parent;
        }
        Ok(freed)
    }

    /// Frees device pages (the request's or the tree's, as the caller decided).
    pub fn free_device(&self, slots: &[DeviceSlot]) -> Result<()> {
        self.device_pool.free(slots)?;
        Ok(())
    }

    /// Drops every cached page in L1 and L2 (the tree is emptied; L3 is kept).
    pub fn reset(&mut self) -> Result<()> {
        let (dev, host) = self.tree.reset();
        self.device_pool.free(&dev)?;
        self.free_host(&host)
    }

    /// Publishes the residency gauges.
    pub fn refresh_gauges(&self) {
        self.metrics
            .set_resident(Tier::l1, self.tree.device_pages() as u64);
        self.metrics
            .set_resident(Tier::l2, self.tree.host_pages() as u64);
    }
}

/// Host allocation for the tree's write-back eviction, within the agreed host budget.
struct BudgetHost<'a> {
    pool: &'a HostPool,
    budget: &'a mut usize,
}

impl HostAllocator for BudgetHost<'_> {
    fn alloc(&mut self, pages: usize) -> Option<Vec<HostSlot>> {
        if *self.budget < pages {
            return None;
        }
        let v = self.pool.alloc(pages)?;
        *self.budget -= pages;
        Some(v)
    }

    fn free(&mut self, slots: &[HostSlot]) {
        match self.pool.free(slots) {
            Ok(()) => *self.budget += slots.len(),
            Err(e) => tracing::error!(error = %e, "the tree freed host pages twice"),
        }
    }
}
