//! [`L3Part`]: L3 for the hybrid facade, over the l3 layout's keys and I/O helpers, on the
//! dense controller's [`L3Engine`] (its runtime, its backup job, its write permits).
//!
//! - **Backup.** When a node's write-through has finished (at an agreed poll), its host
//!   copies go to L3 per component (KV pages keyed by the page hashes; SWA pages by the
//!   node's last hashes; the Mamba state by the last page's hash) as one [`BackupJob`] per
//!   component in the background; the node stays host-locked (`lock_host`) until the poll
//!   at which every rank has seen the whole backup finish ([`L3BackupOp`]).
//! - **Prefetch.** On `arrive`, the part of the prompt cached in neither L1 nor L2 is looked
//!   up in the background with the hit policy (`prefetch`); the hit every rank found is read
//!   into host slots per component and inserted as host-only nodes under the host-valid
//!   prefix; `admit` then loads it back like any host hit.
//!
//! Invariant (slot ownership): a host slot read by a prefetch belongs to the prefetch's task
//! from the moment the engine thread hands it over until the task has recorded the read's
//! result (or, for a prefetch ended before that, exited: `crate::l3::run_prefetch`); a slot written by a backup is host-locked in
//! the tree until the backup's agreed end. The engine thread never frees or reuses a slot
//! before then.

use std::sync::Arc;

use hicache_core::{HostLockReceipt, HostSlot, NodeId, PageHash, PageKey, PrefetchConfig};
use hicache_host::{HostComponent, HostPoolGroup, IoVec};
use hicache_storage::Storage;

use super::l3_keys::{HitPolicy, HybridL3Layout};
use crate::error::{HiCacheError, Result};
use crate::l3::{BackupShared, Chain, L3Engine, PageSource};

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
    /// The backed-up node, host-locked while the write runs (SGLang's
    /// `write_backup_storage`: its host lock covers the SWA window nodes too). Empty only
    /// in a job under construction.
    pub nodes: Vec<NodeId>,
    /// KV, SWA, Mamba pages.
    pub parts: [PagesOut; 3],
}

/// What a prefetch's lookup decided.
#[derive(Clone, Debug, Default)]
pub(crate) struct PrefetchPlan {
    /// Pages hit.
    pub hit: usize,
    /// Keys per component (KV, SWA, Mamba) to read for the hit.
    pub keys: [Vec<PageKey>; 3],
}

/// The components in [`L3Job::parts`] order.
pub(crate) const PARTS: [HostComponent; 3] =
    [HostComponent::Kv, HostComponent::Swa, HostComponent::Mamba];

/// The iovecs of `component`'s host `slot` in `group`, checked to be exactly one page of
/// `page_bytes` (the component's L3 layout): what backups and prefetch reads move.
pub(crate) fn component_iovecs(
    group: &HostPoolGroup,
    component: HostComponent,
    page_bytes: usize,
    slot: u32,
) -> Result<Vec<IoVec>> {
    let iovs = group.iovecs(component, slot)?;
    let len: usize = iovs.iter().map(|v| v.len).sum();
    if len != page_bytes {
        return Err(HiCacheError::BadArgument(format!(
            "{component} slot {slot} holds {len} bytes, its pages {page_bytes}"
        )));
    }
    Ok(iovs)
}

/// One component of a pool group as the page source of a backup job ([`component_iovecs`]).
pub(crate) struct ComponentSource {
    /// The pool group.
    pub group: Arc<HostPoolGroup>,
    /// The component whose slots are read.
    pub component: HostComponent,
    /// Bytes of one of its pages in L3.
    pub page_bytes: usize,
}

impl PageSource for ComponentSource {
    fn page_iovecs(&self, slot: HostSlot) -> Result<Vec<IoVec>> {
        component_iovecs(&self.group, self.component, self.page_bytes, slot.0)
    }
}

/// An L3 backup in flight: one background job per component with pages.
#[derive(Debug)]
pub(crate) struct L3BackupOp {
    /// The node's host lock, held until the backup's agreed end.
    pub host_lock: HostLockReceipt,
    /// The host slots written per component (KV, SWA, Mamba as [`PARTS`]), for the L3
    /// stored events.
    pub part_slots: [Vec<u32>; 3],
    /// Per component with pages: its index in [`PARTS`], its pages, the job's state.
    parts: Vec<(usize, usize, Arc<BackupShared>)>,
}

impl L3BackupOp {
    /// Whether every component's job has finished (never blocks).
    pub fn is_done(&self) -> bool {
        self.parts.iter().all(|(_, _, s)| s.done.is_set())
    }

    /// Blocks until every component's job has finished.
    pub fn wait(&self) {
        for (_, _, s) in &self.parts {
            s.done.wait();
        }
    }

    /// What the finished backup did, per component (Full, SWA, Mamba), and the first error
    /// met (for the log).
    pub fn counts(&self) -> (WriteCounts, Option<String>) {
        let mut out = WriteCounts::default();
        let mut error = None;
        for (k, pages, s) in &self.parts {
            let stored =
                (s.stored_pages.load(std::sync::atomic::Ordering::Relaxed) as usize).min(*pages);
            if error.is_none() {
                error = s.error.lock().clone();
            }
            out.stored[*k] += stored;
            out.failed[*k] += pages - stored;
        }
        (out, error)
    }
}

/// The attached storage's engine and layout.
pub(crate) struct L3Part {
    /// The backend, the tasks' runtime and the write permits (the dense controller's).
    pub engine: L3Engine,
    /// Where each component's pages live.
    pub layout: Arc<HybridL3Layout>,
    /// The host slots pages move from and to.
    pub group: Arc<HostPoolGroup>,
    /// When a prefetch may end, its threshold and timeouts.
    pub prefetch: PrefetchConfig,
}

impl L3Part {
    /// L3 over `storage` with `layout`, reading and writing `group`'s slots.
    pub fn new(
        storage: Arc<dyn Storage>,
        layout: HybridL3Layout,
        group: Arc<HostPoolGroup>,
        prefetch: PrefetchConfig,
    ) -> Result<Self> {
        Ok(Self {
            engine: L3Engine::new(storage, crate::l3::new_runtime()?, None),
            layout: Arc::new(layout),
            group,
            prefetch,
        })
    }

    /// Page hashes of the whole pages of `tokens`, from the root.
    pub fn hashes(&self, tokens: &[u32]) -> Vec<PageHash> {
        self.layout.chain(None, tokens)
    }

    /// Queues a job's writes for the next flush (then they run in the background), one
    /// backup job per component with pages. The caller releases `host_lock` (the job's
    /// node) once the op is done and agreed.
    pub fn spawn_backup(&self, job: L3Job, host_lock: HostLockReceipt) -> Result<L3BackupOp> {
        let part_slots = [
            job.parts[0].slots.clone(),
            job.parts[1].slots.clone(),
            job.parts[2].slots.clone(),
        ];
        let mut parts = Vec::new();
        for (k, part) in job.parts.into_iter().enumerate() {
            if part.keys.is_empty() {
                continue;
            }
            let space = *self.layout.space(PARTS[k])?;
            let source = ComponentSource {
                group: self.group.clone(),
                component: PARTS[k],
                page_bytes: space.page_bytes,
            };
            let slots = part.slots.into_iter().map(HostSlot).collect();
            let chain = Chain::new(None, part.keys);
            let n = chain.len();
            let shared = (self.engine).backup(Arc::new(source), chain, slots, space.layout);
            parts.push((k, n, shared));
        }
        Ok(L3BackupOp {
            host_lock,
            part_slots,
            parts,
        })
    }

    /// The keys to read for a hit of `hit` pages of the span `hashes`.
    pub fn plan_for(&self, hashes: &[PageHash], hit: usize, at_root: bool) -> Result<PrefetchPlan> {
        let policies = self.layout.prefetch_policies(hashes.len(), at_root);
        let mut keys: [Vec<PageKey>; 3] = Default::default();
        keys[0] = self
            .layout
            .read_keys(HostComponent::Kv, HitPolicy::AllPages, hashes, hit)?;
        for &(c, policy) in &policies {
            let k = PARTS.iter().position(|&x| x == c).unwrap_or(0);
            keys[k] = self.layout.read_keys(c, policy, hashes, hit)?;
        }
        Ok(PrefetchPlan { hit, keys })
    }

    /// Stops the runtime (every task is awaited by the caller first).
    pub fn close(self) {
        self.engine.close();
    }
}

/// What a backup wrote, per component (Full, SWA, Mamba).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct WriteCounts {
    /// Pages stored or already present.
    pub stored: [usize; 3],
    /// Pages not stored.
    pub failed: [usize; 3],
}
