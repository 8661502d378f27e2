//! [`HybridCache::try_admit`]: admission all or nothing, with the host hit counted (SGLang's
//! scheduler: `PrefillAdder.add_one_req` checks the request's whole token budget, its host
//! hit included, before `init_load_back`; a request that does not fit stays in the waiting
//! queue and is matched again on the next round; a load-back that then finds no room for a
//! state is not done and the host part is recomputed).
//!
//! Invariants (beside the ownership rules of `cache`):
//! 1. **Nothing or everything.** `try_admit` either refuses and changes nothing a request
//!    holds — the request stays arrived: no lock, no load-back, no slot, no hit counted; the
//!    next call matches again — or loads back the host hit, locks the prefix, copies the
//!    matched Mamba state (or loads the host one, invariant 5) into the request's slot and
//!    allocates the rest of the request, all in one call. What a
//!    refusal may change is the tree's cache only: the eviction it ran to make room (as a
//!    refused [`HybridCache::alloc`]).
//! 2. **One reservation.** The load-back's slots, the request's state slots and the rest are
//!    allocated by one [`alloc_units`](HybridCache::alloc_units) (each component's shortfall
//!    evicted first) while the device prefix is locked, before anything is committed; the
//!    load-back is committed only with every slot in hand.
//! 3. **Rank agreement.** The decision reads the tree and the device pools only, whose state
//!    every rank changes by the same calls in the same order (copies finish at agreed polls),
//!    so every rank refuses or admits alike; nothing here is local (no timing, no copy
//!    progress).
//! 4. **The plan holds.** The eviction that makes room may change the load-back (a page of
//!    its SWA window evicted on device, say); the plan is checked after the allocation and a
//!    changed one is given up and planned again from a fresh match, at most
//!    [`ATTEMPTS`] times.
//! 5. **A host state goes to the request.** A host hit's Mamba state is loaded straight into
//!    the request's working slot (one copy, host → that slot) and stays on host only in the
//!    tree ([`UnifiedTree::commit_load_back_detached`]); the request locks the loaded node
//!    with its Full path and SWA window, not its state. So loading a hit back needs no more
//!    of any component than recomputing it (the same Full pages, or only the window's SWA
//!    pages; the request's own states), where SGLang loads the state into the tree and
//!    copies it again (one state more: with a Mamba state pool held by running requests and
//!    by nodes in write-through, the hit was recomputed). Only an admission asking no Mamba
//!    slot loads the state into the tree; when that load-back and the rest do not fit
//!    together, the rest past the device prefix alone is tried: it fits only when states
//!    were short, and then the host part is recomputed (SGLang's `init_load_back` fallback,
//!    whose budget check counts tokens, not states). Whenever pages are short the request
//!    waits with its hit. With [`MambaLoadBack::Tree`] in the config (SGLang's mode) every
//!    host state is loaded into the tree and copied into the request's slot: one state more,
//!    so when only states are short the host part is recomputed as without a Mamba slot.
//! 6. **SGLang's budget first.** Before anything is allocated, the scheduler's token budget
//!    ([`UnifiedTree::admission_fits`], the one `hicache-bench tree --host-capacity-pages`
//!    replays against SGLang) must admit the request with its host hit counted: the part
//!    past the device prefix, the tokens it may decode (`extent` past the prompt) and one
//!    spare page strictly below the free and evictable Full tokens, and with SWA its window
//!    estimate below the SWA room. A refusal there evicts nothing. When the load-back does
//!    not fit (states short), the budget is checked again without the hit before the
//!    fallback recomputes it.
//!
//! [`UnifiedTree::commit_load_back_detached`]: hicache_core::UnifiedTree::commit_load_back_detached
//! [`UnifiedTree::admission_fits`]: hicache_core::UnifiedTree::admission_fits

use hicache_core::{
    AdmissionAsk, Component, CoreError, DeviceFree, DeviceSlot, LockReceipt, NodeId,
    UnifiedLoadPlan, UnifiedMatch,
};

use super::cache::{HybridCache, Req, Units};
use super::types::{HybridAdmission, HybridDemand, HybridExtent, HybridSlots};
use super::{MambaLoadBack, StateSlot};
use crate::error::{HiCacheError, Result};

/// Matches one `try_admit` makes at most before it refuses: the eviction of the first one
/// frees the room, so a second plan needs no eviction and holds.
const ATTEMPTS: usize = 3;

/// The device room an admission reserved before committing anything.
struct Reserved {
    /// The match the room was reserved for.
    m: UnifiedMatch,
    /// Its load-back (none without a host hit).
    plan: Option<UnifiedLoadPlan>,
    /// Tokens of the prefix once loaded back (what the rest was reserved after).
    prefix: usize,
    /// The device prefix's lock while the admission is committed.
    guard: LockReceipt,
    /// The load-back's slots first (per component), then the request's.
    units: Units,
    /// Whether the load-back's state goes into the request's first Mamba slot (invariant 5)
    /// instead of into the tree.
    detached: bool,
}

enum Reserve {
    /// No device room for the request with its hit.
    Refused,
    /// The eviction changed the load-back: match again.
    Stale,
    Ready(Box<Reserved>),
}

impl HybridCache {
    /// Admits an arrived request only when everything it needs fits on device: its host hit
    /// loaded back (per component) and the rest, `extent` in all. Either returns the
    /// admission (as [`admit`](Self::admit)'s) with the slots of the rest (as
    /// [`alloc`](Self::alloc)'s: a Full page, and with SWA an SWA page, per page past the
    /// prefix, and the Mamba slots but the admission's one), or `None` and the request
    /// stays arrived, holding nothing, to be matched again by a later call (SGLang's
    /// scheduler; see the module docs for the invariants). Unlike `admit` followed by a
    /// refused `alloc`, a host hit is never dropped for lack of device room: the request
    /// waits until the hit and the rest fit together. A host hit's Mamba state is loaded
    /// straight into the admission's state slot (the first of `extent.mamba_slots`), so the
    /// hit takes no state more than recomputing it; with no Mamba slot asked it is loaded
    /// into the tree, and when states are short for that the hit is recomputed instead, if
    /// the rest past the device prefix fits (SGLang's fallback).
    pub fn try_admit(
        &mut self,
        req: u64,
        tokens: &[u32],
        extent: HybridExtent,
    ) -> Result<Option<(HybridAdmission, HybridSlots)>> {
        let storage = self.arrived_storage(req, tokens)?;
        if extent.pages.saturating_mul(self.ps()) < tokens.len() {
            return Err(HiCacheError::BadArgument(format!(
                "request {req}: {} pages for a {}-token prompt",
                extent.pages,
                tokens.len()
            )));
        }
        if extent.mamba_slots > 0 && !self.tree.has(Component::Mamba) {
            return Err(HiCacheError::BadArgument(
                "Mamba slots asked without that component".into(),
            ));
        }
        for _ in 0..ATTEMPTS {
            match self.reserve(tokens, extent)? {
                Reserve::Refused => return Ok(None),
                Reserve::Stale => continue,
                Reserve::Ready(r) => {
                    return self.commit_admission(req, tokens, storage, *r).map(Some);
                }
            }
        }
        Ok(None)
    }

    /// Tokens an arrived request's L3 prefetch brought to host (0 without one, or while it
    /// runs): what a load-back at its admission reads from L3's copy (the engine charges the
    /// read on its L3 link).
    pub fn prefetched_tokens(&self, req: u64) -> Result<usize> {
        match self.requests.get(&req) {
            Some(Req::Arrived { storage, .. }) => Ok(*storage),
            Some(Req::Admitted(_)) => Err(HiCacheError::request(req, "already admitted")),
            None => Err(HiCacheError::request(req, "unknown request")),
        }
    }

    /// Matches and reserves the device room of the load-back and of the rest together
    /// (invariant 2), the device prefix locked; failing that, the room of the rest past the
    /// device prefix alone when that fits (invariant 5).
    fn reserve(&mut self, tokens: &[u32], extent: HybridExtent) -> Result<Reserve> {
        let ps = self.ps();
        let has_swa = self.tree.has(Component::Swa);
        let m = self.tree.match_prefix(Self::match_key(tokens))?;
        let plan = match m.host_node == m.node {
            true => None,
            false => self.tree.plan_load_back(m.host_node)?,
        };
        // What the request needs past a prefix of `prefix` tokens, plus the load-back's
        // `load` (Full pages, SWA pages, states).
        let demand = |prefix: usize, load: (usize, usize, usize)| {
            let rest = extent.pages.saturating_sub(prefix / ps);
            HybridDemand {
                full_pages: load.0 + rest,
                swa_pages: if has_swa { load.1 + rest } else { 0 },
                mamba_slots: load.2 + extent.mamba_slots,
            }
        };
        let guard = self.tree.lock(m.node, false)?;
        // SGLang's budget, the host hit counted (invariant 6): a refusal evicts nothing.
        // `try_admit` checked `extent.pages · ps ≥ tokens.len()` with the same saturating product.
        let max_new = extent.pages.saturating_mul(ps) - tokens.len();
        let ask = AdmissionAsk::new(&m, tokens.len(), max_new);
        if !self.budget_fits(ask) {
            self.tree.unlock(&guard)?;
            return Ok(Reserve::Refused);
        }
        if let Some(p) = &plan {
            // The prefix once loaded: the path to the load-back's node (some of whose nodes
            // may hold their Full pages on device already, and lack only another component).
            let prefix = self.tree.depth_tokens(m.host_node)?;
            // A state on host goes straight into the request's working slot (invariant 5),
            // one of its own: no slot beside it for the tree's copy; in SGLang's mode it
            // goes into the tree and is copied into the request's slot.
            let into_tree =
                extent.mamba_slots == 0 || self.config().mamba_load_back == MambaLoadBack::Tree;
            let tree_state = p.mamba.is_some() && into_tree;
            let detached = p.mamba.is_some() && !tree_state;
            let load = (p.full_pages(), p.swa_pages(), usize::from(tree_state));
            match self.alloc_units(demand(prefix, load)) {
                Ok(Some(units)) => {
                    if self.tree.plan_load_back(m.host_node)?.as_ref() != Some(p) {
                        self.free_units(&units)?;
                        self.tree.unlock(&guard)?;
                        return Ok(Reserve::Stale);
                    }
                    return Ok(Reserve::Ready(Box::new(Reserved {
                        m,
                        plan,
                        prefix,
                        guard,
                        units,
                        detached,
                    })));
                }
                Ok(None) => {}
                Err(e) => {
                    self.tree.unlock(&guard)?;
                    return Err(e);
                }
            }
        }
        // No host hit, or no room for it: the rest past the device prefix (which needs as
        // many Full and SWA pages as with the load-back or more, fewer states only), once
        // the budget admits recomputing a Full hit (SGLang's second check).
        if plan.is_some() && m.host_hit_len > 0 && !self.budget_fits(ask.without_host()) {
            self.tree.unlock(&guard)?;
            return Ok(Reserve::Refused);
        }
        let prefix = m.device_prefix_len;
        match self.alloc_units(demand(prefix, (0, 0, 0))) {
            Ok(Some(units)) => Ok(Reserve::Ready(Box::new(Reserved {
                m,
                plan: None,
                prefix,
                guard,
                units,
                detached: false,
            }))),
            other => {
                self.tree.unlock(&guard)?;
                other.map(|_| Reserve::Refused)
            }
        }
    }

    /// Commits a reserved admission: launches the load-back, matches again (the loaded
    /// pages are on device now), locks the prefix, copies the matched state (or has loaded
    /// the host one into the request's slot) and hands out the rest.
    fn commit_admission(
        &mut self,
        req: u64,
        tokens: &[u32],
        storage: usize,
        r: Reserved,
    ) -> Result<(HybridAdmission, HybridSlots)> {
        let Reserved {
            m,
            plan,
            prefix,
            guard,
            mut units,
            detached,
        } = r;
        if let Some(plan) = &plan {
            let states = usize::from(plan.mamba.is_some());
            let load = Units {
                full: units.full.drain(..plan.full_pages()).collect(),
                swa: units.swa.drain(..plan.swa_pages()).collect(),
                mamba: units.mamba.drain(..states).collect(),
            };
            self.start_load_back(plan, &load, detached)?;
            if detached {
                // The state's slot is the request's working state.
                units.mamba.splice(0..0, load.mamba);
            }
        }
        let after = match plan {
            Some(_) => self.tree.match_prefix(Self::match_key(tokens))?,
            None => m.clone(),
        };
        let after = match detached {
            true => Self::as_loaded(after, m.host_node, prefix),
            false => after,
        };
        if after.device_prefix_len < prefix {
            // The tree's contract: a committed load-back is on device, the match reaches it.
            self.free_units(&units)?;
            self.tree.unlock(&guard)?;
            return Err(HiCacheError::Core(CoreError::InvalidState {
                node: format!("{:?}", m.host_node),
                reason: format!(
                    "the match after a load-back to {prefix} tokens covers {} tokens",
                    after.device_prefix_len
                ),
            }));
        }
        self.free_surplus(&mut units, (after.device_prefix_len - prefix) / self.ps())?;
        let receipt = self.tree.lock(after.node, detached)?;
        self.tree.unlock(&guard)?;
        let cow = match after.mamba_slot {
            _ if detached => Some(units.mamba.remove(0)),
            Some(src) if !units.mamba.is_empty() => {
                let dst = units.mamba.remove(0);
                self.copy_state(src, dst)?;
                Some(dst)
            }
            _ => None,
        };
        let admission =
            self.record_admission(req, &after, m.device_prefix_len, storage, receipt, cow)?;
        let rest = HybridSlots {
            full: units.full.into_iter().map(DeviceSlot).collect(),
            swa: units.swa.into_iter().map(|s| Some(DeviceSlot(s))).collect(),
            mamba: units.mamba.into_iter().map(StateSlot).collect(),
        };
        Ok((admission, rest))
    }

    /// The match a request admitted on a detached load-back of `node` (`prefix` tokens deep)
    /// holds: what the match after a load-back with the state in the tree would say — the
    /// node, its depth on device, the branching lengths past it — with no state of the
    /// tree's to copy. `after` is the match once the pages are loaded (its device prefix
    /// ends above the node, whose state is on host only); the same walk, so its Full hit is
    /// the one to align.
    fn as_loaded(after: UnifiedMatch, node: NodeId, prefix: usize) -> UnifiedMatch {
        UnifiedMatch {
            device_prefix_len: prefix,
            node,
            swa_branching: after.swa_branching.filter(|&b| b > prefix),
            mamba_branching: after.mamba_branching.filter(|&b| b > prefix),
            mamba_slot: None,
            host_node: node,
            host_hit_len: 0,
            swa_host_hit_len: 0,
            mamba_host_hit: false,
            ..after
        }
    }

    /// [`UnifiedTree::admission_fits`] on the free device pages (the caller holds the
    /// match's lock).
    ///
    /// [`UnifiedTree::admission_fits`]: hicache_core::UnifiedTree::admission_fits
    fn budget_fits(&self, ask: AdmissionAsk) -> bool {
        let ps = self.ps() as u64;
        let free = DeviceFree {
            full: self.pools.dev_available(Component::Full) as u64 * ps,
            swa: self.pools.dev_available(Component::Swa) as u64 * ps,
        };
        self.tree.admission_fits(ask, free)
    }

    /// Frees the last `surplus` Full (and SWA) pages of the rest: a match that reaches
    /// further than the load-back's node needs fewer pages.
    fn free_surplus(&self, units: &mut Units, surplus: usize) -> Result<()> {
        let keep = units.full.len().saturating_sub(surplus);
        let mut spare = Units {
            full: units.full.split_off(keep),
            ..Units::default()
        };
        if !units.swa.is_empty() {
            spare.swa = units.swa.split_off(units.swa.len().saturating_sub(surplus));
        }
        self.free_units(&spare)
    }
}
