//! [`HybridCache`]: the controller of a hybrid model (Full KV + SWA KV + Mamba state) over
//! the [`UnifiedTree`], one scheduler tick at a time, as the dense `HiCache`.
//!
//! Ownership of slots, per component (invariants):
//! 1. A device Full / SWA page or Mamba state slot is owned by the tree (a cached prefix,
//!    freed only when an eviction or an insert reports it), by a request (from
//!    [`HybridCache::alloc`] or an admission's copy-on-write slot, until the request hands it
//!    to [`HybridCache::cache_finished`] or [`HybridCache::release`]), or free.
//! 2. An admitted request holds a lock on its matched node (Full path, SWA window, Mamba
//!    node), so its prefix slots stay put until `cache_finished` or `abort`.
//! 3. A host slot is owned by the tree from the commit of the backup that wrote it (or from
//!    the host-only insert of the L3 prefetch that read it; until then by that prefetch
//!    alone) until a host eviction reports it; a node being copied (either way) is locked in
//!    the tree until the poll that finishes its copy, at a count every rank agreed on, and a
//!    node whose host copy is written to L3 is host-locked meanwhile.
//! 4. The Mamba state of a match is never handed to a request: the request gets a copy in a
//!    slot of its own (copy-on-write from the device state, or, with
//!    [`HybridCache::try_admit`], loaded from the host state, which stays the tree's on host
//!    only), so the cached state never changes under it.

use std::collections::HashMap;
use std::sync::Arc;

use hicache_core::{
    Component, DeviceLoad, DeviceSlot, EvictRequest, Evicted, InsertParams, InsertSlots,
    LockReceipt, Medium, UnifiedMatch, UnifiedTree,
};

use super::StateSlot;
use super::copies::Copies;
use super::pools::{COMPONENTS, Pools, Tier, plan_slots};
use super::types::{
    HybridAdmission, HybridArrival, HybridConfig, HybridDemand, HybridSlots, HybridTotals,
};
use crate::error::{HiCacheError, Result};
use crate::rank::RankGroup;

/// Slots of every component, as the tree's `u32` indices.
#[derive(Debug, Default)]
pub(crate) struct Units {
    pub full: Vec<u32>,
    pub swa: Vec<u32>,
    pub mamba: Vec<u32>,
}

impl Units {
    /// The slots per component (Full, SWA, Mamba).
    pub fn lists(&self) -> [&[u32]; 3] {
        [&self.full, &self.swa, &self.mamba]
    }
}

/// A request between `arrive` and `cache_finished` / `abort`.
pub(super) enum Req {
    /// Arrived, not admitted: the tokens its L3 prefetch brought to host, and the prefetch
    /// while it runs.
    Arrived {
        storage: usize,
        prefetch: Option<u64>,
    },
    /// Admitted: holds a lock on its prefix.
    Admitted(Admitted),
}

pub(super) struct Admitted {
    pub(super) receipt: LockReceipt,
    /// Prefix tokens on device (after any load-back).
    pub(super) matched: usize,
    pub(super) swa_branching: Option<usize>,
    pub(super) mamba_branching: Option<usize>,
    /// The prefix's Full slots (the tree's).
    pub(super) prefix_full: Vec<u32>,
    /// The request's copy-on-write state slot.
    pub(super) cow: Option<u32>,
}

/// The cache's observability endpoints and the counters its metrics endpoint serves.
#[derive(Debug, Default)]
pub(crate) struct Observe {
    pub endpoints: crate::observe::Endpoints,
    /// The counters as of the last poll (what the metrics endpoint renders).
    pub published: Arc<parking_lot::Mutex<HybridTotals>>,
}

/// The hierarchical cache of a hybrid model on one rank (see the module docs for who owns
/// which slot, and the crate docs for the call sequence of a tick).
pub struct HybridCache {
    pub(crate) cfg: HybridConfig,
    pub(crate) tree: UnifiedTree,
    pub(crate) pools: Pools,
    pub(crate) copies: Copies,
    pub(crate) rank: Arc<dyn RankGroup>,
    pub(crate) totals: HybridTotals,
    pub(crate) events: super::events::Events,
    pub(crate) l3: Option<super::l3::L3Part>,
    pub(crate) l3_ops: super::l3_flow::L3Ops,
    pub(crate) observe: Observe,
    pub(super) requests: HashMap<u64, Req>,
    closed: bool,
}

impl std::fmt::Debug for HybridCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridCache")
            .field("config", &self.cfg)
            .field("requests", &self.requests.len())
            .finish_non_exhaustive()
    }
}

impl HybridCache {
    /// Starts building a cache with `cfg`.
    pub fn builder(cfg: HybridConfig) -> super::HybridCacheBuilder {
        super::HybridCacheBuilder::new(cfg)
    }

    pub(crate) fn assemble(
        cfg: HybridConfig,
        tree: UnifiedTree,
        pools: Pools,
        rank: Arc<dyn RankGroup>,
        l3: Option<super::l3::L3Part>,
        events: super::events::Events,
    ) -> Self {
        Self {
            cfg,
            tree,
            pools,
            copies: Copies::default(),
            rank,
            totals: HybridTotals::default(),
            events,
            l3,
            l3_ops: Default::default(),
            observe: Observe::default(),
            requests: HashMap::new(),
            closed: false,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &HybridConfig {
        &self.cfg
    }

    /// The tree (for inspection).
    pub fn tree(&self) -> &UnifiedTree {
        &self.tree
    }

    /// The device pool of Full or SWA KV (the engine's kernels read and write its pages).
    pub fn device_pool(&self, c: Component) -> Result<&Arc<hicache_gpu::DevicePool>> {
        Ok(&self.pools.kv(c)?.dev)
    }

    /// The device Mamba state pool (the engine's kernels address its slots).
    pub fn state_pool(&self) -> Result<&Arc<hicache_gpu::StatePool>> {
        Ok(&self.pools.state()?.dev)
    }

    /// The host pools of every component.
    pub fn host_pools(&self) -> &hicache_host::HostPoolGroup {
        &self.pools.group
    }

    /// Bytes of one Mamba state (0 without Mamba).
    pub fn state_bytes(&self) -> usize {
        self.pools.unit_bytes(Component::Mamba)
    }

    /// Reads a device Mamba state (synchronous; for checks and tests, an engine's kernels
    /// use the state pool's addresses).
    pub fn read_state(&self, slot: StateSlot) -> Result<Vec<u8>> {
        self.pools.state()?.read(slot.0)
    }

    /// Writes a device Mamba state (synchronous).
    pub fn write_state(&self, slot: StateSlot, src: &[u8]) -> Result<()> {
        self.pools.state()?.write(slot.0, src)
    }

    /// The counters so far.
    pub fn metrics(&self) -> HybridTotals {
        self.totals
    }

    /// The counters in the Prometheus text format (`hicache_hybrid_*_total` with a
    /// `component` label).
    pub fn render_metrics(&self) -> String {
        super::metrics::render(&self.totals)
    }

    /// The KV events since the last call. With a publisher
    /// ([`kv_events_publisher`](super::HybridCacheBuilder::kv_events_publisher)) every poll
    /// hands its events to it, so this returns only the events since the last poll.
    pub fn drain_events(&mut self) -> Vec<hicache_core::KvEvent> {
        self.events.drain()
    }

    /// Every KV event since the last call, Full-attention ones and, with component events
    /// on ([`component_events`](super::HybridCacheBuilder::component_events)), the SWA and
    /// Mamba ones, in the order they happened (a Full event has no component). With a
    /// publisher every poll hands them to it, as [`drain_events`](Self::drain_events).
    pub fn drain_component_events(&mut self) -> Vec<hicache_core::ComponentKvEvent> {
        self.events.drain_tagged()
    }

    /// Publishes what a poll changed: the counters for the metrics endpoint, the events to
    /// the KV-event publisher (L3 stores under the backend's medium).
    pub(crate) fn publish(&mut self) {
        *self.observe.published.lock() = self.totals;
        if !self.observe.endpoints.publishes() {
            return;
        }
        let backend = self.l3.as_ref().map(|l| l.engine.storage.info().name);
        let l3 = crate::observe::wire::L3Medium::of_attached(backend.as_deref());
        if self.events.tagged() {
            let events = self.events.drain_tagged();
            if !events.is_empty() {
                self.observe.endpoints.publish_tagged(&events, l3);
            }
            return;
        }
        let events = self.events.drain();
        if events.is_empty() {
            return;
        }
        self.observe.endpoints.publish(&events, l3);
    }

    /// The bound KV-event PUB endpoint (`tcp://IP:PORT`), when a publisher runs.
    pub fn kv_events_endpoint(&self) -> Option<&str> {
        self.observe.endpoints.kv_events().map(|p| p.endpoint())
    }

    /// The bound KV-event replay endpoint, when configured.
    pub fn kv_events_replay_endpoint(&self) -> Option<&str> {
        self.observe
            .endpoints
            .kv_events()
            .and_then(|p| p.replay_endpoint())
    }

    /// The bound metrics endpoint address, when one was asked for.
    pub fn metrics_endpoint(&self) -> Option<std::net::SocketAddr> {
        self.observe.endpoints.metrics().map(|m| m.addr())
    }

    pub(super) fn ps(&self) -> usize {
        self.cfg.page_size as usize
    }

    /// Whether [`shutdown`](Self::shutdown) was called.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    pub(super) fn check_open(&self) -> Result<()> {
        if self.closed {
            return Err(HiCacheError::Closed);
        }
        Ok(())
    }

    /// The key a request matches: its tokens but the last (at least one token is computed),
    /// whole pages.
    pub(super) fn match_key(tokens: &[u32]) -> &[u32] {
        &tokens[..tokens.len().saturating_sub(1)]
    }

    /// A request arrives: matches its prompt (nothing is copied yet).
    pub fn arrive(&mut self, req: u64, tokens: &[u32]) -> Result<HybridArrival> {
        self.check_open()?;
        if self.requests.contains_key(&req) {
            return Err(HiCacheError::request(req, "already arrived"));
        }
        if tokens.is_empty() {
            return Err(HiCacheError::request(req, "an empty prompt"));
        }
        let key = Self::match_key(tokens);
        let m = self.tree.match_prefix(key)?;
        let (looked_up, prefetch) = self.prefetch(req, key, &m)?;
        let storage = 0;
        self.requests
            .insert(req, Req::Arrived { storage, prefetch });
        Ok(HybridArrival {
            device_tokens: m.device_prefix_len,
            host_tokens: m.host_hit_len,
            storage_tokens: looked_up,
        })
    }

    /// What a request of `tokens` would reuse now, without arriving: the tokens valid on
    /// device, and those valid on device or host (every component's validator, as `arrive`
    /// and `admit` match: the match refreshes the LRUs as theirs does). What a fleet router
    /// should credit this cache in L1 and L2.
    pub fn reusable_tokens(&mut self, tokens: &[u32]) -> Result<(usize, usize)> {
        self.check_open()?;
        let m = self.tree.match_prefix(Self::match_key(tokens))?;
        let host = self.tree.depth_tokens(m.host_node)?;
        Ok((m.device_prefix_len, host.max(m.device_prefix_len)))
    }

    /// Whether the request's L3 prefetch (if any) has ended (at a poll, by its policy), so
    /// it can be admitted with what it brought.
    pub fn prefetch_ready(&mut self, req: u64) -> Result<bool> {
        self.check_open()?;
        match self.requests.get(&req) {
            Some(Req::Arrived { prefetch, .. }) => Ok(prefetch.is_none()),
            Some(Req::Admitted(_)) => Err(HiCacheError::request(req, "already admitted")),
            None => Err(HiCacheError::request(req, "unknown request")),
        }
    }

    /// Admits an arrived request: matches again, loads back what is on host per component,
    /// locks the prefix and copies its Mamba state into a fresh slot of the request. A
    /// load-back without device room is not done (the admission keeps the device prefix and
    /// the host part is recomputed): an engine that must not lose the hit for lack of room
    /// admits with [`try_admit`](Self::try_admit), which reserves the rest with it.
    pub fn admit(&mut self, req: u64, tokens: &[u32]) -> Result<HybridAdmission> {
        let storage = self.arrived_storage(req, tokens)?;
        let first = self.tree.match_prefix(Self::match_key(tokens))?;
        let host_tokens = self.load_back(&first)?;
        let m = if host_tokens > 0 {
            self.tree.match_prefix(Self::match_key(tokens))?
        } else {
            first.clone()
        };
        let receipt = self.tree.lock(m.node, false)?;
        let cow = match m.mamba_slot {
            Some(src) => self.copy_on_write(src)?,
            None => None,
        };
        self.record_admission(req, &m, first.device_prefix_len, storage, receipt, cow)
    }

    /// The L3 tokens of `req`'s prefetch, checking that it is an arrived request with a prompt
    /// (what `admit` and `try_admit` take).
    pub(super) fn arrived_storage(&self, req: u64, tokens: &[u32]) -> Result<usize> {
        self.check_open()?;
        let storage = match self.requests.get(&req) {
            Some(Req::Arrived { storage, .. }) => *storage,
            Some(Req::Admitted(_)) => return Err(HiCacheError::request(req, "already admitted")),
            None => return Err(HiCacheError::request(req, "unknown request (call arrive)")),
        };
        if tokens.is_empty() {
            return Err(HiCacheError::request(req, "an empty prompt"));
        }
        Ok(storage)
    }

    /// Records `req` admitted on the match `m` (its prefix on device and locked by
    /// `receipt`, `device` tokens of it on device before any load-back, `storage` tokens
    /// prefetched from L3) with its copy-on-write state slot `cow`; counts its hits and
    /// returns what the engine is handed.
    pub(super) fn record_admission(
        &mut self,
        req: u64,
        m: &UnifiedMatch,
        device: usize,
        storage: usize,
        receipt: LockReceipt,
        cow: Option<u32>,
    ) -> Result<HybridAdmission> {
        let prefix_full = self.prefix_slots(m.node, Component::Full)?;
        let slots = HybridSlots {
            full: prefix_full.iter().map(|&s| DeviceSlot(s)).collect(),
            swa: self.swa_prefix(m.node)?,
            mamba: cow.map(StateSlot).into_iter().collect(),
        };
        let host_tokens = m.device_prefix_len - device;
        let storage_tokens = storage.min(host_tokens);
        self.count_hits(device, host_tokens, storage_tokens);
        self.requests.insert(
            req,
            Req::Admitted(Admitted {
                receipt,
                matched: m.device_prefix_len,
                swa_branching: m.swa_branching,
                mamba_branching: m.mamba_branching,
                prefix_full,
                cow,
            }),
        );
        Ok(HybridAdmission {
            device_tokens: device,
            host_tokens,
            storage_tokens,
            slots,
        })
    }

    /// A request's prefetch ended, bringing `tokens` to host (the request may be gone).
    pub(crate) fn prefetch_ended(&mut self, req: u64, seq: u64, tokens: usize) {
        if let Some(Req::Arrived { storage, prefetch }) = self.requests.get_mut(&req)
            && *prefetch == Some(seq)
        {
            *storage = tokens;
            *prefetch = None;
        }
    }

    pub(super) fn count_hits(&mut self, device: usize, host: usize, storage: usize) {
        for c in self.tree.config().components() {
            let t = self.totals.get_mut(c);
            t.hit_tokens_l1 += device as u64;
            t.hit_tokens_l2 += (host - storage) as u64;
            t.hit_tokens_l3 += storage as u64;
        }
    }

    /// The Full slots of the path to `node` (all on device).
    pub(super) fn prefix_slots(
        &self,
        node: hicache_core::NodeId,
        c: Component,
    ) -> Result<Vec<u32>> {
        let pages = self.tree.prefix_pages(node, c)?;
        pages
            .into_iter()
            .map(|s| s.ok_or_else(|| HiCacheError::BadArgument("a prefix page off device".into())))
            .collect()
    }

    /// The SWA slots of the path to `node` (`None` at tombstones); empty without SWA.
    pub(super) fn swa_prefix(&self, node: hicache_core::NodeId) -> Result<Vec<Option<DeviceSlot>>> {
        if !self.tree.has(Component::Swa) {
            return Ok(Vec::new());
        }
        let pages = self.tree.prefix_pages(node, Component::Swa)?;
        Ok(pages.into_iter().map(|s| s.map(DeviceSlot)).collect())
    }

    /// Copies the matched state `src` into a new slot of the request (evicting one state
    /// when none is free; the caller has locked the matched node, so `src` stays).
    fn copy_on_write(&mut self, src: u32) -> Result<Option<u32>> {
        let Some(units) = self.alloc_units(HybridDemand {
            mamba_slots: 1,
            ..Default::default()
        })?
        else {
            return Ok(None);
        };
        let dst = units.mamba[0];
        self.copy_state(src, dst)?;
        Ok(Some(dst))
    }

    /// Launches the copy of the matched state `src` into the request's slot `dst` (in the
    /// open batch, after the batch's load-backs).
    pub(super) fn copy_state(&mut self, src: u32, dst: u32) -> Result<()> {
        let launched = self.pools.state()?.copy(src, dst)?;
        self.copies.add_cow(launched);
        Ok(())
    }

    /// Brings `m`'s host hit back to device per component (SGLang's `load_back`): the Full
    /// chain, the SWA window, the Mamba state. Returns the Full tokens loaded (0 when
    /// nothing was on host or the device has no room).
    fn load_back(&mut self, m: &UnifiedMatch) -> Result<usize> {
        if m.host_node == m.node {
            return Ok(0);
        }
        let Some(plan) = self.tree.plan_load_back(m.host_node)? else {
            return Ok(0);
        };
        // The device prefix stays locked while the pools make room.
        let guard = self.tree.lock(m.node, false)?;
        let units = self.alloc_units(HybridDemand {
            full_pages: plan.full_pages(),
            swa_pages: plan.swa_pages(),
            mamba_slots: usize::from(plan.mamba.is_some()),
        });
        let units = match units {
            Ok(Some(u)) if self.tree.plan_load_back(m.host_node)?.as_ref() == Some(&plan) => u,
            Ok(Some(u)) => {
                self.free_units(&u)?;
                self.tree.unlock(&guard)?;
                return Ok(0);
            }
            other => {
                self.tree.unlock(&guard)?;
                return other.map(|_| 0);
            }
        };
        self.start_load_back(&plan, &units, false)?;
        self.tree.unlock(&guard)?;
        Ok(plan.full_pages() * self.ps())
    }

    /// Launches the load-back `plan` into the device slots `units` (exactly the plan's, each
    /// component's) and commits it in the tree: from now on its pages are on device (matches
    /// reuse them) and its node is locked until the poll that finishes the copy. With
    /// `detached`, the plan's state goes to `units.mamba[0]`, a request's own slot, and stays
    /// on host only in the tree ([`UnifiedTree::commit_load_back_detached`]).
    pub(super) fn start_load_back(
        &mut self,
        plan: &hicache_core::UnifiedLoadPlan,
        units: &Units,
        detached: bool,
    ) -> Result<()> {
        let launched = self.launch_load(plan, units)?;
        let (full, swa) = (plan_slots(&plan.full), plan_slots(&plan.swa));
        // A detached state goes to the request, not to a cached block.
        let state = if detached { &[] } else { plan.mamba.as_slice() };
        let to = units.lists();
        (self.events).copied_all(Medium::CpuPinned, [&full, &swa, state], Medium::Gpu, to);
        let dev = DeviceLoad {
            full: &units.full,
            swa: &units.swa,
            mamba: units.mamba.first().copied().filter(|_| !detached),
        };
        let id = match detached {
            true => self.tree.commit_load_back_detached(plan, dev)?,
            false => self.tree.commit_load_back(plan, dev)?,
        };
        self.copies.add_load(id, launched);
        Ok(())
    }

    /// Allocates every component's demand, evicting each one's shortfall first; all or
    /// nothing.
    pub(crate) fn alloc_units(&mut self, d: HybridDemand) -> Result<Option<Units>> {
        let ps = self.ps() as u64;
        let short = |p: &Pools, c, want: usize| want.saturating_sub(p.dev_available(c)) as u64;
        let req = EvictRequest {
            full: short(&self.pools, Component::Full, d.full_pages) * ps,
            swa: short(&self.pools, Component::Swa, d.swa_pages) * ps,
            mamba: short(&self.pools, Component::Mamba, d.mamba_slots),
        };
        if req != EvictRequest::default() {
            let e = self.tree.evict(req);
            self.forget_evicted(Tier::Device, &e)?;
        }
        let fits = self.pools.dev_available(Component::Full) >= d.full_pages
            && self.pools.dev_available(Component::Swa) >= d.swa_pages
            && self.pools.dev_available(Component::Mamba) >= d.mamba_slots;
        if !fits {
            return Ok(None);
        }
        let want = [d.full_pages, d.swa_pages, d.mamba_slots];
        self.pools.alloc(Tier::Device, want).map(Some)
    }

    /// Frees slots a request or a failed step held.
    pub(crate) fn free_units(&self, u: &Units) -> Result<()> {
        self.pools.free(Tier::Device, u.lists())
    }

    /// Frees the slots of `tier` an eviction reports, with their events and counts.
    pub(crate) fn forget_evicted(&mut self, tier: Tier, e: &Evicted) -> Result<()> {
        let slots = super::pools::evicted(e, tier);
        self.pools.free(tier, slots)?;
        let medium = match tier {
            Tier::Device => Medium::Gpu,
            Tier::Host => Medium::CpuPinned,
        };
        for (c, s) in COMPONENTS.into_iter().zip(slots) {
            self.events.removed_of(c, medium, s);
            let t = self.totals.get_mut(c);
            match tier {
                Tier::Device => t.evicted_device += s.len() as u64,
                Tier::Host => t.evicted_host += s.len() as u64,
            }
        }
        Ok(())
    }

    /// Device slots for a request's new pages and states, evicting per component as needed;
    /// `None` when the tree cannot free enough (nothing is allocated then).
    pub fn alloc(&mut self, d: HybridDemand) -> Result<Option<HybridSlots>> {
        self.check_open()?;
        let bad = |what: &str| HiCacheError::BadArgument(format!("{what} without that component"));
        if d.swa_pages > 0 && !self.tree.has(Component::Swa) {
            return Err(bad("SWA pages asked"));
        }
        if d.mamba_slots > 0 && !self.tree.has(Component::Mamba) {
            return Err(bad("Mamba slots asked"));
        }
        let Some(u) = self.alloc_units(d)? else {
            return Ok(None);
        };
        Ok(Some(HybridSlots {
            full: u.full.into_iter().map(DeviceSlot).collect(),
            swa: u.swa.into_iter().map(|s| Some(DeviceSlot(s))).collect(),
            mamba: u.mamba.into_iter().map(StateSlot).collect(),
        }))
    }

    /// Frees slots a request holds and will not hand to `cache_finished` (never a prefix's).
    pub fn release(&mut self, slots: HybridSlots) -> Result<()> {
        self.check_open()?;
        self.free_units(&Units {
            full: slots.full.iter().map(|s| s.0).collect(),
            swa: slots.swa.iter().flatten().map(|s| s.0).collect(),
            mamba: slots.mamba.iter().map(|s| s.0).collect(),
        })
    }

    /// Drops a request: releases its prefix lock and its copy-on-write state slot. Slots it
    /// allocated stay the engine's (free them with [`release`](Self::release)).
    pub fn abort(&mut self, req: u64) -> Result<()> {
        self.check_open()?;
        match self.requests.remove(&req) {
            None => Err(HiCacheError::request(req, "unknown request")),
            Some(Req::Arrived { .. }) => Ok(()),
            Some(Req::Admitted(a)) => {
                self.tree.unlock(&a.receipt)?;
                if let Some(c) = a.cow {
                    self.pools.state()?.free_dev(&[c])?;
                }
                Ok(())
            }
        }
    }

    /// A request ended: inserts its sequence (SGLang's insert lengths) with its slots, frees
    /// the slots the tree did not take, releases its prefix lock and queues the inserted
    /// node for write-through. `slots` are all the request's slots (the admission's prefix
    /// followed by what it allocated; see [`HybridSlots`]).
    pub fn cache_finished(&mut self, req: u64, tokens: &[u32], slots: HybridSlots) -> Result<()> {
        self.check_open()?;
        let a = match self.requests.remove(&req) {
            Some(Req::Admitted(a)) => a,
            Some(arrived) => {
                self.requests.insert(req, arrived);
                return Err(HiCacheError::request(req, "not admitted"));
            }
            None => return Err(HiCacheError::request(req, "unknown request")),
        };
        if let Err(e) = self.check_finished(&a, tokens, &slots) {
            self.requests.insert(req, Req::Admitted(a));
            return Err(e);
        }
        let inserted = self.insert_finished(&a, tokens, slots);
        self.tree.unlock(&a.receipt)?;
        if let Some(node) = inserted?
            && self.cfg.write_through
        {
            let len = self.tree.depth_tokens(node)?;
            self.copies.queue_write(node, tokens[..len].to_vec());
        }
        Ok(())
    }

    /// The tokens [`cache_finished`](Self::cache_finished) will insert for an admitted
    /// request whose sequence is `len` tokens long (SGLang's insert length, whole pages):
    /// with Mamba, the checkpoint whose state the engine hands as the state to insert.
    pub fn insert_len(&self, req: u64, len: usize) -> Result<usize> {
        match self.requests.get(&req) {
            Some(Req::Admitted(a)) => Ok(self.insert_len_of(a, len)),
            Some(Req::Arrived { .. }) => Err(HiCacheError::request(req, "not admitted")),
            None => Err(HiCacheError::request(req, "unknown request")),
        }
    }

    fn insert_len_of(&self, a: &Admitted, len: usize) -> usize {
        let want =
            self.tree
                .config()
                .insert_len(len, a.matched, a.swa_branching, a.mamba_branching);
        want / self.ps() * self.ps()
    }

    /// Slot counts and ownership of a finished request's slots.
    fn check_finished(&self, a: &Admitted, tokens: &[u32], s: &HybridSlots) -> Result<()> {
        let pages = tokens.len().div_ceil(self.ps());
        let swa_pages = if self.tree.has(Component::Swa) {
            pages
        } else {
            0
        };
        let bad = |what: String| Err(HiCacheError::BadArgument(what));
        if s.full.len() != pages || s.swa.len() != swa_pages {
            return bad(format!(
                "{} Full and {} SWA slots for {} tokens: want {pages} and {swa_pages}",
                s.full.len(),
                s.swa.len(),
                tokens.len()
            ));
        }
        if tokens.len() < a.matched {
            return bad(format!(
                "{} tokens, shorter than the {}-token prefix",
                tokens.len(),
                a.matched
            ));
        }
        let prefix: Vec<u32> = s.full[..a.prefix_full.len()].iter().map(|x| x.0).collect();
        if prefix != a.prefix_full {
            return bad("the Full slots do not start with the admission's prefix".into());
        }
        if !s.mamba.is_empty() && !self.tree.has(Component::Mamba) {
            return bad("Mamba slots without that component".into());
        }
        // The prefix's SWA entries are the tree's (read from it at insert), only the
        // request's own SWA slots are checked: the tree may have evicted the prefix's pages
        // outside the locked window since the admission and handed their slots on.
        let own_swa = a.prefix_full.len().min(s.swa.len());
        let lists = [
            (
                Component::Full,
                s.full.iter().map(|x| x.0).collect::<Vec<_>>(),
            ),
            (
                Component::Swa,
                s.swa[own_swa..].iter().flatten().map(|x| x.0).collect(),
            ),
            (Component::Mamba, s.mamba.iter().map(|x| x.0).collect()),
        ];
        for (c, list) in lists {
            if !self.pools.owned_once(c, &list) {
                return bad(format!(
                    "{c:?} slots that are not allocated device slots, or named twice"
                ));
            }
        }
        Ok(())
    }

    /// Inserts a finished request and frees what the tree did not take; the node inserted.
    fn insert_finished(
        &mut self,
        a: &Admitted,
        tokens: &[u32],
        s: HybridSlots,
    ) -> Result<Option<hicache_core::NodeId>> {
        let ps = self.ps();
        let pages = self.insert_len_of(a, tokens.len()) / ps;
        let mamba = self.tree.has(Component::Mamba);
        let state = s.mamba.first().map(|x| x.0);
        let insert = pages > 0 && pages * ps > a.matched && (!mamba || state.is_some());
        let prefix_pages = a.prefix_full.len();
        let full: Vec<u32> = s.full.iter().map(|x| x.0).collect();
        // Invariant: the prefix's SWA entries are the tree's as of now (its pages outside the
        // locked window may have been evicted while the request ran: a stale slot would
        // lower the floor and could be adopted or freed twice), the rest the request's.
        // `u32::MAX`: no SWA KV there.
        let swa: Vec<u32> = if s.swa.is_empty() {
            Vec::new()
        } else {
            let live = self.swa_prefix(a.receipt.node)?;
            let own = prefix_pages.min(s.swa.len()).min(live.len());
            live[..own]
                .iter()
                .chain(&s.swa[own..])
                .map(|x| x.map_or(u32::MAX, |d| d.0))
                .collect()
        };
        // SWA floor: past the last page without SWA KV; entries below are not read.
        let floor = swa[..pages.min(swa.len())]
            .iter()
            .rposition(|&x| x == u32::MAX)
            .map_or(0, |i| i + 1);
        let mut free = Units::default();
        let mut node = None;
        if insert {
            let r = self.tree.insert_with_slots(
                &tokens[..pages * ps],
                &InsertParams {
                    prev_prefix_len: a.matched,
                    swa_evicted_len: floor * ps,
                    mamba_slot: state.filter(|_| mamba),
                },
                InsertSlots {
                    full: &full[..pages],
                    swa: if swa.is_empty() { &[] } else { &swa[..pages] },
                },
            )?;
            let adopted_state = state.filter(|_| mamba && !r.mamba_exist);
            self.record_stored(
                &tokens[..pages * ps],
                &full[..pages],
                &r.release_full,
                r.node,
                adopted_state,
            )?;
            free.full = r.release_full;
            free.swa = r.release_swa;
            node = Some(r.node);
            if r.mamba_exist {
                free.mamba.extend(state);
            }
            // The request's own SWA pages below the floor (never read by the insert).
            free.swa.extend(
                swa[prefix_pages.min(floor)..floor]
                    .iter()
                    .filter(|&&x| x != u32::MAX),
            );
        } else {
            // Nothing inserted: every page past the prefix is the request's.
            free.full.extend(&full[prefix_pages.min(pages)..pages]);
            let swa_own = &swa[prefix_pages.min(pages).min(swa.len())..pages.min(swa.len())];
            free.swa.extend(swa_own.iter().filter(|&&x| x != u32::MAX));
            free.mamba.extend(state);
        }
        // Pages past the key are the request's.
        let tail = pages.max(prefix_pages);
        free.full.extend(&full[tail.min(full.len())..]);
        free.swa.extend(
            swa[tail.min(swa.len())..]
                .iter()
                .filter(|&&x| x != u32::MAX),
        );
        free.mamba.extend(s.mamba.iter().skip(1).map(|x| x.0));
        if let Some(c) = a.cow
            && !s.mamba.iter().any(|x| x.0 == c)
        {
            free.mamba.push(c);
        }
        self.free_units(&free)?;
        Ok(node)
    }

    /// Emits the events of an insert that ended on `node`: the tree's pages it replaced are
    /// removed, the request's pages it adopted (`full` but `released`) are stored on the
    /// device; with component events, so are the SWA pages the path holds that had no
    /// identity yet (the ones the insert adopted) and the Mamba state it took.
    fn record_stored(
        &mut self,
        tokens: &[u32],
        full: &[u32],
        released: &[u32],
        node: hicache_core::NodeId,
        state: Option<u32>,
    ) -> Result<()> {
        self.events.removed(Medium::Gpu, released);
        let infos = self.events.pages(tokens);
        let (slots, full_infos): (Vec<u32>, Vec<_>) = full
            .iter()
            .zip(&infos)
            .filter(|(s, _)| !released.contains(s) && !self.events.on_device(Component::Full, **s))
            .map(|(s, i)| (*s, i.clone()))
            .unzip();
        self.events.stored(Medium::Gpu, &slots, full_infos);
        if self.events.follows(Component::Swa) {
            let path = self.tree.prefix_pages(node, Component::Swa)?;
            let (slots, swa_infos): (Vec<u32>, Vec<_>) = path
                .iter()
                .zip(&infos)
                .filter_map(|(s, i)| s.map(|s| (s, i)))
                .filter(|(s, _)| !self.events.on_device(Component::Swa, *s))
                .map(|(s, i)| (s, i.clone()))
                .unzip();
            self.events
                .stored_of(Component::Swa, Medium::Gpu, &slots, swa_infos);
        }
        if let (Some(slot), Some(last)) = (state, infos.last()) {
            self.events
                .stored_of(Component::Mamba, Medium::Gpu, &[slot], vec![last.clone()]);
        }
        Ok(())
    }

    /// Blocks until every copy the cache launched has landed, finishes them, and refuses
    /// further calls.
    pub fn shutdown(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.pools.synchronize()?;
        self.settle_all()?;
        self.close_l3()?;
        self.closed = true;
        Ok(())
    }
}
