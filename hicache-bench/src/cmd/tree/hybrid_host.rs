//! The host tier of `hicache-bench tree --components ... --host-capacity-pages N`: the
//! replay of `hybrid` with host pools and SGLang's write-through, each copy completed before
//! the next step (as the device-only protocol completes each request before the next).
//!
//! Rules added to the device-only protocol (`hybrid`'s module documentation):
//!
//! - **Load-back** after the match (SGLang's `init_load_back`): a host hit past the device
//!   prefix is loaded back whole (Full path, SWA window, Mamba state), the host node locked
//!   while the device evicts the shortfall of each pool; without room it is not loaded. The
//!   match is then taken again, and `host_hit` is what the reused prefix grew by (SGLang's
//!   `host_loaded_length`: the Full loaded and the Full already resident behind it).
//! - **Write-through** after the insert: the inserted node and its ancestors not on host,
//!   ancestors first, are backed up (Full pages, SWA window, Mamba state); a host pool short
//!   of room evicts from its own order (`UnifiedTree::evict_host_of`: Full host leaves, the
//!   SWA or Mamba host LRU) as SGLang's backup allocation does (`host_room`); when that
//!   cannot make room the backup stops there.
//! - A device leaf whose Full is on host is demoted by device eviction (it stays host-only).
//!
//! The tree tracks slots (fresh ids from one counter per tier: the replay counts pool room
//! from the tree's sizes, as the device-only protocol does). Host pools: Full and SWA pages,
//! Mamba states. Extra log columns: `host_hit`, `ev_host_full` (host Full tokens evicted),
//! `ev_host_aux` (host SWA tokens or Mamba states evicted).

use hicache_core::{
    AdmissionAsk, Component, DeviceFree, DeviceLoad, EvictRequest, Evicted, HostBackup,
    InsertParams, InsertSlots, NodeId, UnifiedInsert, UnifiedMatch,
};

use super::hybrid::HybridReplay;
use crate::error::Result;

/// Host pool sizes of a replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostSetup {
    /// Host Full pages.
    pub full_pages: u64,
    /// Host SWA pages.
    pub swa_pages: u64,
    /// Host Mamba states.
    pub mamba_slots: u64,
}

/// The host tier's running state: slots in use per component and the id counters.
#[derive(Debug)]
pub(super) struct HostTier {
    cap: [u64; 3],
    used: [u64; 3],
    next_host: u32,
    next_device: u32,
}

impl HostTier {
    pub(super) fn new(s: HostSetup) -> Self {
        Self {
            cap: [s.full_pages, s.swa_pages, s.mamba_slots],
            used: [0; 3],
            next_host: 0,
            next_device: 0,
        }
    }

    fn short(&self, need: [u64; 3]) -> [u64; 3] {
        std::array::from_fn(|c| need[c].saturating_sub(self.cap[c] - self.used[c]))
    }

    fn fresh(next: &mut u32, n: usize) -> Vec<u32> {
        let v = (*next..*next + n as u32).collect();
        *next += n as u32;
        v
    }
}

/// Tokens each request may decode (`max_new_tokens = 1`, nothing decoded yet).
const MAX_NEW: usize = 1;

impl HybridReplay {
    /// The scheduler's admission of a matched request of `prompt` tokens (module
    /// documentation): the budget with the host hit counted, the load-back, and the budget
    /// again without the hit when a Full hit was not loaded. The match to use, the tokens
    /// the reused prefix grew by, and whether the budget refused the request.
    pub(super) fn admit(
        &mut self,
        key: &[u32],
        m: UnifiedMatch,
        prompt: usize,
        ev: &mut [u64; 3],
    ) -> Result<(UnifiedMatch, usize, bool)> {
        let ask = AdmissionAsk::new(&m, prompt, MAX_NEW);
        if !self.budget_fits(&m, ask)? {
            return Ok((m, 0, true));
        }
        let promised = m.host_hit_len;
        let (m, grown) = self.load_back(key, m, ev)?;
        if promised > 0 && grown == 0 && !self.budget_fits(&m, ask.without_host())? {
            return Ok((m, 0, true));
        }
        Ok((m, grown, false))
    }

    /// [`UnifiedTree::admission_fits`] with the match's device node locked, as the
    /// scheduler checks.
    fn budget_fits(&mut self, m: &UnifiedMatch, ask: AdmissionAsk) -> Result<bool> {
        let lock = self.tree.lock(m.node, false)?;
        let free = DeviceFree {
            full: self.available(Component::Full),
            swa: self.available(Component::Swa),
        };
        let fits = self.tree.admission_fits(ask, free);
        self.tree.unlock(&lock)?;
        Ok(fits)
    }

    /// Inserts `key` with the request's slots when the tree tracks them (the host tier).
    pub(super) fn insert(
        &mut self,
        key: &[u32],
        p: &InsertParams,
        m: &UnifiedMatch,
    ) -> Result<UnifiedInsert> {
        let Some(host) = self.host.as_mut() else {
            return Ok(self.tree.insert(key, p)?);
        };
        let pages = key.len() / self.setup.tree.page_size as usize;
        let mut slots = [Vec::new(), Vec::new()];
        for (k, c) in [Component::Full, Component::Swa].into_iter().enumerate() {
            if !self.tree.has(c) {
                continue;
            }
            let prefix = self.tree.prefix_pages(m.node, c)?;
            slots[k] = (0..pages)
                .map(|i| match prefix.get(i).copied().flatten() {
                    Some(x) => x,
                    None => HostTier::fresh(&mut host.next_device, 1)[0],
                })
                .collect();
        }
        let s = InsertSlots {
            full: &slots[0],
            swa: &slots[1],
        };
        Ok(self.tree.insert_with_slots(key, p, s)?)
    }

    /// Loads `m`'s host hit back (module documentation); the match to use and the Full
    /// tokens loaded.
    pub(super) fn load_back(
        &mut self,
        key: &[u32],
        m: UnifiedMatch,
        ev: &mut [u64; 3],
    ) -> Result<(UnifiedMatch, usize)> {
        if self.host.is_none() || m.host_hit_len == 0 {
            return Ok((m, 0));
        }
        let Some(plan) = self.tree.plan_load_back(m.host_node)? else {
            return Ok((m, 0));
        };
        let ps = self.ps() as u64;
        let need = [plan.full_pages() as u64 * ps, plan.swa_pages() as u64 * ps];
        let lock = self.tree.lock(m.host_node, false)?;
        let short = |t: &Self| {
            let a = [t.available(Component::Full), t.available(Component::Swa)];
            [need[0].saturating_sub(a[0]), need[1].saturating_sub(a[1])]
        };
        let s = short(self);
        if s != [0, 0] {
            let req = EvictRequest {
                full: s[0],
                swa: s[1],
                mamba: 0,
            };
            self.evict(req, ev);
        }
        let state = match plan.mamba {
            Some(_) => self.take_mamba(1, ev),
            None => Some(Vec::new()),
        };
        self.tree.unlock(&lock)?;
        let fresh = self.tree.plan_load_back(m.host_node)?.as_ref() == Some(&plan);
        let (Some(state), [0, 0], true) = (state.clone(), short(self), fresh) else {
            self.free_mamba.give(&state.unwrap_or_default());
            return Ok((m, 0));
        };
        let host = self.host.as_mut().expect("host tier");
        let full = HostTier::fresh(&mut host.next_device, plan.full_pages());
        let swa = HostTier::fresh(&mut host.next_device, plan.swa_pages());
        let dev = DeviceLoad {
            full: &full,
            swa: &swa,
            mamba: state.first().copied(),
        };
        let id = self.tree.commit_load_back(&plan, dev)?;
        self.tree.finish_load_back(id)?;
        let before = m.device_prefix_len;
        let m = self.tree.match_prefix(key)?;
        // SGLang's `host_loaded_length`: what the request's reused prefix grew by (Full
        // loaded, and Full already resident behind host-only SWA or Mamba).
        let grown = m.device_prefix_len.saturating_sub(before);
        Ok((m, grown))
    }

    /// Backs up `node` and its ancestors not on host (module documentation); counts the
    /// host evictions in `ev_host`.
    pub(super) fn backup(&mut self, node: NodeId, ev_host: &mut [u64; 3]) -> Result<()> {
        if self.host.is_none() || node == self.tree.root() {
            return Ok(());
        }
        let mut chain = self.tree.unbacked_chain(node)?;
        if chain.last() != Some(&node) {
            chain.push(node);
        }
        for n in chain {
            let Some(plan) = self.tree.plan_backup(n)? else {
                continue;
            };
            let need = [
                plan.full.len() as u64,
                plan.swa_pages() as u64,
                u64::from(plan.mamba.is_some()),
            ];
            if !self.host_room(need, ev_host) {
                break;
            }
            let host = self.host.as_mut().expect("host tier");
            let full = HostTier::fresh(&mut host.next_host, plan.full.len());
            let swa = HostTier::fresh(&mut host.next_host, plan.swa_pages());
            let mamba = plan
                .mamba
                .map(|_| HostTier::fresh(&mut host.next_host, 1)[0]);
            for (u, n) in host.used.iter_mut().zip(need) {
                *u += n;
            }
            let h = HostBackup {
                full: &full,
                swa: &swa,
                mamba,
            };
            let id = self.tree.commit_backup(&plan, h)?;
            self.tree.finish_backup(id)?;
        }
        Ok(())
    }

    /// Makes room for `need` (host Full pages, SWA pages, Mamba states) as SGLang's
    /// backup allocates (`_execute_kv_backup`, `HostPoolGroup.resolve_host_transfers`):
    /// Full evicts its shortfall from the host leaves and fails if it frees less; then
    /// each auxiliary pool in pool-name order (`mamba`, `swa`) that cannot take its share
    /// evicts its whole share from its own host order and fails if it still cannot.
    /// Evictions done before a failure stay done. Whether the node's copies fit.
    fn host_room(&mut self, need: [u64; 3], ev_host: &mut [u64; 3]) -> bool {
        let ps = self.ps() as u64;
        let full_short = self.host.as_ref().expect("host tier").short(need)[0];
        if full_short > 0 {
            let e = self.tree.evict_host_of(Component::Full, full_short * ps);
            let freed = e.host_full_pages.len() as u64;
            self.count_host_eviction(&e, ev_host);
            if freed < full_short {
                return false;
            }
        }
        for (c, k, unit) in [(Component::Mamba, 2, 1), (Component::Swa, 1, ps)] {
            if self.host.as_ref().expect("host tier").short(need)[k] == 0 {
                continue;
            }
            let e = self.tree.evict_host_of(c, need[k] * unit);
            self.count_host_eviction(&e, ev_host);
            if self.host.as_ref().expect("host tier").short(need)[k] > 0 {
                return false;
            }
        }
        true
    }

    fn count_host_eviction(&mut self, e: &Evicted, ev_host: &mut [u64; 3]) {
        let ps = self.ps() as u64;
        let freed = [
            e.host_full_pages.len() as u64,
            e.host_swa_pages.len() as u64,
            e.host_mamba_slots.len() as u64,
        ];
        let host = self.host.as_mut().expect("host tier");
        for (u, f) in host.used.iter_mut().zip(freed) {
            *u -= f;
        }
        ev_host[0] += freed[0] * ps;
        ev_host[1] += freed[1] * ps;
        ev_host[2] += freed[2];
    }

    /// Full tokens on host (host tier only; 0 without).
    pub fn host_full_tokens(&self) -> u64 {
        self.host
            .as_ref()
            .map_or(0, |h| h.used[0] * self.setup.tree.page_size as u64)
    }
}
