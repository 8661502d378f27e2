//! [`L3Part`]: L3 for the hybrid facade, over the l3 layout's keys and I/O helpers.
//!
//! - **Backup.** When a node's write-through has finished (at an agreed poll), its host
//!   copies go to L3 per component (KV pages keyed by the page hashes; SWA pages by the
//!   node's last hashes; the Mamba state by the last page's hash), the node host-pinned
//!   (`lock_host`) while the write runs.
//! - **Prefetch.** On `arrive`, the part of the prompt cached in neither L1 nor L2 is looked
//!   up with the hit policy; the hit (the minimum every rank found) is read into host slots
//!   per component and inserted as host-only nodes under the host-valid prefix; `admit`
//!   then loads it back like any host hit.
//!
//! With tensor parallelism a prefetch exchanges twice with the other ranks inside `arrive`
//! (the hit pages, then whether every rank read them all), so every rank must call
//! `arrive` for the same requests in the same order, as it does every other call.
//!
//! The I/O runs on a current-thread runtime owned here, to completion inside the call that
//! starts it (`poll` or `arrive`): no page is read or written after the call returns, so
//! the host slots involved are never touched by L3 once the engine thread goes on.

use std::sync::Arc;

use hicache_core::{NodeId, PageHash, PageKey};
use hicache_host::{HostComponent, HostPoolGroup};
use hicache_storage::Storage;

use super::l3_io::{ComponentPages, HybridIo};
use super::l3_keys::{HitPolicy, HybridL3Layout};
use crate::error::{HiCacheError, Result};

/// One component's pages of an L3 write: keys and the host slots holding them.
#[derive(Clone, Debug, Default)]
pub(crate) struct PagesOut {
    /// The keys, one per slot.
    pub keys: Vec<PageKey>,
    /// The host slots.
    pub slots: Vec<u32>,
}

/// The L3 backup of one backed-up node (and the SWA window nodes of its backup).
#[derive(Clone, Debug, Default)]
pub(crate) struct L3Job {
    /// The nodes to host-pin while the write runs.
    pub nodes: Vec<NodeId>,
    /// KV, SWA, Mamba pages.
    pub parts: [PagesOut; 3],
}

/// What a prefetch's lookup decided.
#[derive(Clone, Debug)]
pub(crate) struct PrefetchPlan {
    /// Pages hit.
    pub hit: usize,
    /// Keys per component (KV, SWA, Mamba) to read for the hit.
    pub keys: [Vec<PageKey>; 3],
}

/// The attached storage and its layout.
pub(crate) struct L3Part {
    pub storage: Arc<dyn Storage>,
    pub layout: HybridL3Layout,
    rt: tokio::runtime::Runtime,
}

/// The components in [`L3Job::parts`] order.
pub(crate) const PARTS: [HostComponent; 3] =
    [HostComponent::Kv, HostComponent::Swa, HostComponent::Mamba];

impl L3Part {
    /// L3 over `storage` with `layout`.
    pub fn new(storage: Arc<dyn Storage>, layout: HybridL3Layout) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(HiCacheError::Runtime)?;
        Ok(Self {
            storage,
            layout,
            rt,
        })
    }

    /// The I/O helpers over this storage and layout and `group`'s slots.
    fn io<'a>(&'a self, group: &'a HostPoolGroup) -> HybridIo<'a> {
        HybridIo {
            storage: &*self.storage,
            layout: &self.layout,
            group,
        }
    }

    /// Page hashes of the whole pages of `tokens`, from the root.
    pub fn hashes(&self, tokens: &[u32]) -> Vec<PageHash> {
        self.layout.chain(None, tokens)
    }

    /// Writes a job's pages: per component, the pages stored (or already present) and the
    /// pages that failed. A failed call fails its component's pages (logged, counted by the
    /// caller), never the tick: the pages stay in L2.
    pub fn write(&self, group: &HostPoolGroup, job: &L3Job) -> WriteCounts {
        let mut out = WriteCounts::default();
        for (k, part) in job.parts.iter().enumerate() {
            if part.keys.is_empty() {
                continue;
            }
            let pages = ComponentPages {
                component: PARTS[k],
                keys: &part.keys,
                slots: &part.slots,
            };
            // SAFETY: the slots are the tree's host copies of host-pinned nodes and this call
            // runs the write to completion before returning, so nothing writes them meanwhile.
            let write = unsafe { self.io(group).write_pages(pages) };
            match self.rt.block_on(write) {
                Ok(r) => out.stored[k] = r.ok(),
                Err(e) => tracing::warn!(
                    component = %PARTS[k],
                    pages = part.keys.len(),
                    error = %e,
                    "hybrid L3 backup failed: the pages stay in L2"
                ),
            }
            out.failed[k] = part.keys.len() - out.stored[k];
        }
        out
    }

    /// Looks up the span `hashes` (starting at the root when `at_root`); `None` without a
    /// hit every configured component can restore.
    pub fn plan(
        &self,
        group: &HostPoolGroup,
        hashes: &[PageHash],
        at_root: bool,
        components: [bool; 3],
    ) -> Result<Option<PrefetchPlan>> {
        let policies = self.layout.prefetch_policies(hashes.len(), at_root);
        let listed = |c| policies.iter().any(|(x, _)| *x == c);
        if (components[1] && !listed(HostComponent::Swa))
            || (components[2] && !listed(HostComponent::Mamba))
        {
            // A component the span cannot restore: the pages would not make a valid match.
            return Ok(None);
        }
        let verdict = match self.rt.block_on(self.io(group).lookup(hashes, &policies)) {
            Ok(v) => v,
            Err(e) => {
                // A lookup that fails is a miss (the pages are recomputed), never an error of
                // the request.
                tracing::warn!(error = %e, "hybrid L3 lookup failed: treated as a miss");
                return Ok(None);
            }
        };
        if verdict.hit_pages == 0 {
            return Ok(None);
        }
        Ok(Some(self.plan_for(hashes, verdict.hit_pages, &policies)?))
    }

    /// The keys to read for a hit of `hit` pages.
    pub fn plan_for(
        &self,
        hashes: &[PageHash],
        hit: usize,
        policies: &[(HostComponent, HitPolicy)],
    ) -> Result<PrefetchPlan> {
        let mut keys: [Vec<PageKey>; 3] = Default::default();
        keys[0] = self
            .layout
            .read_keys(HostComponent::Kv, HitPolicy::AllPages, hashes, hit)?;
        for &(c, policy) in policies {
            let k = PARTS.iter().position(|&x| x == c).unwrap_or(0);
            keys[k] = self.layout.read_keys(c, policy, hashes, hit)?;
        }
        Ok(PrefetchPlan { hit, keys })
    }

    /// The policies of a span (for [`plan_for`](Self::plan_for) after agreement).
    pub fn policies(&self, span: usize, at_root: bool) -> Vec<(HostComponent, HitPolicy)> {
        self.layout.prefetch_policies(span, at_root)
    }

    /// Reads a plan's pages into `slots` (per component, paired with the keys): per
    /// component the pages that did not arrive (a failed call fails all of its component's;
    /// logged). The prefetch is whole only when every count is 0.
    pub fn read(
        &self,
        group: &HostPoolGroup,
        plan: &PrefetchPlan,
        slots: &[&[u32]; 3],
    ) -> [usize; 3] {
        let mut missing = [0; 3];
        for k in 0..3 {
            if plan.keys[k].is_empty() {
                continue;
            }
            let pages = ComponentPages {
                component: PARTS[k],
                keys: &plan.keys[k],
                slots: slots[k],
            };
            // SAFETY: the slots were just allocated for this read (distinct, owned by it, in
            // no node yet) and the read runs to completion before returning.
            let read = unsafe { self.io(group).read_pages(pages) };
            let arrived = match self.rt.block_on(read) {
                Ok(r) => r.ok(),
                Err(e) => {
                    tracing::warn!(
                        component = %PARTS[k],
                        pages = plan.keys[k].len(),
                        error = %e,
                        "hybrid L3 read failed: the prefetch is dropped"
                    );
                    0
                }
            };
            missing[k] = plan.keys[k].len() - arrived;
        }
        missing
    }
}

/// What [`L3Part::write`] did, per component (Full, SWA, Mamba).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct WriteCounts {
    /// Pages stored or already present.
    pub stored: [usize; 3],
    /// Pages not stored.
    pub failed: [usize; 3],
}
