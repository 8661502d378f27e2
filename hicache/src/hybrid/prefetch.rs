//! A hybrid model's L3 prefetch in the background: [`FetchTask`] (lookup under the hit
//! policy, then the read of the agreed hit into host slots the engine thread allocated) and
//! [`PrefetchOp`], the engine thread's record of it.
//!
//! Steps, each taken on the engine thread at a poll from values every rank agreed on (the
//! exchange of `l3_flow`), so every rank's tree changes alike:
//! 1. `arrive` spawns the task (lookup) and host-locks the anchor (the deepest host-valid
//!    node of the match); the request is not `prefetch_ready` until the prefetch ends.
//! 2. Once every rank's lookup finished, the minimum hit is planned; below the threshold it
//!    ends; otherwise host slots are allocated for it and handed to the task, which reads.
//! 3. Once every rank read every component's pages of the hit (the agreed pages fetched, the
//!    dense prefetch's count, reach the hit), they are inserted as host-only nodes (when the
//!    tree still has nothing below the anchor for them).
//! 4. The policy may end it earlier (`best_effort`: at any poll; `timeout`: once
//!    `prefetch_timeout_*` for the hit has passed; `wait_complete`: never): nothing is
//!    inserted (a hybrid page set is whole or useless), and slots handed to the task are
//!    freed only once the task has exited (slot ownership, see `l3`).

use std::sync::Arc;
use std::time::Instant;

use hicache_core::{NodeId, PageHash, PrefetchConfig};
use hicache_storage::Storage;
use parking_lot::Mutex;

use super::cache::Units;
use super::l3::{PARTS, PrefetchPlan};
use super::l3_io::{ComponentPages, HybridIo};
use super::l3_keys::HybridL3Layout;
use crate::l3::{Fetcher, PrefetchCounts, QueryResult, prefetch_counts};
use hicache_host::{HostComponent, HostPoolGroup};

/// What the engine thread hands the task after the lookup: the plan and the slots (per
/// component, paired with the plan's keys) to read into.
pub(crate) type ReadOrder = (PrefetchPlan, [Vec<u32>; 3]);

/// State shared by a prefetch's task and the engine thread: the dense prefetch's
/// ([`crate::l3::FetchShared`]), its slots a [`ReadOrder`].
pub(crate) type FetchShared = crate::l3::FetchShared<ReadOrder>;

/// Per component, the pages of a read that did not arrive: set when the read finished (the
/// task touches no slot after it).
pub(crate) type ReadMissing = Mutex<Option<[usize; 3]>>;

/// A prefetch's background I/O, run by the one prefetch task (`crate::l3::run_prefetch`).
pub(crate) struct FetchTask {
    /// The L3 backend.
    pub storage: Arc<dyn Storage>,
    /// Where each component's pages live.
    pub layout: Arc<HybridL3Layout>,
    /// The host slots the read fills.
    pub group: Arc<HostPoolGroup>,
    /// Page hashes of the span looked up.
    pub hashes: Vec<PageHash>,
    /// Whether the span starts at the root.
    pub at_root: bool,
    /// Which of SWA and Mamba the model has (the hit must restore each).
    pub sidecars: [bool; 2],
    /// Where the read's result goes.
    pub missing: Arc<ReadMissing>,
}

impl Fetcher for FetchTask {
    type Slots = ReadOrder;

    async fn lookup(&mut self, shared: &FetchShared) -> (usize, QueryResult) {
        (self.hit(shared).await, QueryResult::default())
    }

    async fn fetch(&mut self, (plan, slots): &ReadOrder, shared: &FetchShared) {
        let missing = self.read(plan, slots, shared).await;
        *self.missing.lock() = Some(missing);
        let mut st = shared.state.lock();
        if missing == [0; 3] && !st.terminated {
            // Every component's pages arrived: the whole hit counts as fetched.
            shared.advance(&mut st, plan.hit);
        }
    }

    fn leftover(_: &ReadOrder, _: usize) -> Option<ReadOrder> {
        // The engine thread frees a read's slots itself, at an agreed count.
        None
    }
}

impl FetchTask {
    fn io(&self) -> HybridIo<'_> {
        HybridIo {
            storage: &*self.storage,
            layout: &self.layout,
            group: &self.group,
        }
    }

    /// This rank's hit: 0 when a configured component cannot be restored from the span, or
    /// when the lookup fails (a miss, never an error of the request; its pages counted as
    /// failed in `shared`, logged when the prefetch ends, as the dense prefetch's).
    async fn hit(&self, shared: &FetchShared) -> usize {
        let policies = self
            .layout
            .prefetch_policies(self.hashes.len(), self.at_root);
        let listed = |c| policies.iter().any(|(x, _)| *x == c);
        if (self.sidecars[0] && !listed(HostComponent::Swa))
            || (self.sidecars[1] && !listed(HostComponent::Mamba))
        {
            return 0;
        }
        match self.io().lookup(&self.hashes, &policies).await {
            Ok(v) => v.hit_pages,
            Err(e) => {
                tracing::debug!(error = %e, "hybrid L3 lookup failed: treated as a miss");
                let mut st = shared.state.lock();
                st.note_failure(self.hashes.len(), format!("lookup: {e}"));
                0
            }
        }
    }

    /// Reads the plan's pages into the slots: per component, the pages that did not arrive
    /// (a failed call fails all of its component's, counted as failed in `shared`).
    async fn read(
        &self,
        plan: &PrefetchPlan,
        slots: &[Vec<u32>; 3],
        shared: &FetchShared,
    ) -> [usize; 3] {
        let mut missing = [0; 3];
        for k in 0..3 {
            if plan.keys[k].is_empty() {
                continue;
            }
            if shared.terminated() {
                missing[k] = plan.keys[k].len();
                continue;
            }
            let pages = ComponentPages {
                component: PARTS[k],
                keys: &plan.keys[k],
                slots: &slots[k],
            };
            // SAFETY: the slots were allocated for this read (distinct, in no node) and the
            // engine thread neither frees nor reuses them before the task exited.
            let read = unsafe { self.io().read_pages(pages) };
            let arrived = match read.await {
                Ok(r) => r.ok(),
                Err(e) => {
                    tracing::debug!(error = %e, "hybrid L3 read failed: the prefetch is dropped");
                    let mut st = shared.state.lock();
                    st.failed = true;
                    st.note_failure(plan.keys[k].len(), format!("{} read: {e}", PARTS[k]));
                    0
                }
            };
            missing[k] = plan.keys[k].len() - arrived;
        }
        missing
    }
}

/// Where a prefetch stands on the engine thread.
#[derive(Debug)]
pub(crate) enum Phase {
    /// The lookup runs.
    Lookup,
    /// The task reads the agreed hit into these host slots.
    Reading { plan: PrefetchPlan, host: Units },
}

/// A prefetch tracked by the engine thread.
#[derive(Debug)]
pub(crate) struct PrefetchOp {
    /// The request that started it.
    pub req: u64,
    /// The host-valid node the span hangs under.
    pub anchor: NodeId,
    /// The anchor's host lock (SGLang's prefetch anchor lock), held until the prefetch ends.
    pub host_lock: hicache_core::HostLockReceipt,
    /// The request's key up to the span's end (whole pages).
    pub key: Vec<u32>,
    /// Tokens of `key` before the span.
    pub start: usize,
    /// Page hashes of the span.
    pub hashes: Vec<PageHash>,
    /// When `arrive` started it (the timeout counts from here).
    pub started: Instant,
    /// State shared with its task.
    pub shared: Arc<FetchShared>,
    /// The read's result, once it finished.
    pub missing: Arc<ReadMissing>,
    /// Where it stands.
    pub phase: Phase,
}

impl PrefetchOp {
    /// This rank's view for the exchange: the dense prefetch's counts under `policy`
    /// (pages fetched: the hit once every component's pages arrived, 0 before).
    pub fn counts(&self, policy: &PrefetchConfig, page_size: usize) -> PrefetchCounts {
        let reading = matches!(self.phase, Phase::Reading { .. });
        prefetch_counts(&self.shared, reading, policy, self.started, page_size)
    }

    /// Blocks until the task's current step (lookup, or read) has finished.
    pub fn wait_step(&self) {
        match self.phase {
            Phase::Lookup => self.shared.looked_up.wait(),
            Phase::Reading { .. } => self.shared.wait_exited(),
        }
    }
}
