//! The request-facing calls of [`HiCache`]: arrival, admission, allocation, insertion of
//! computed pages, abort, and eviction on demand.

use hicache_core::{DeviceSlot, InsertOptions, MatchResult, NodeId, TenantId};

use super::HiCache;
use crate::copies::QueuedLoad;
use crate::error::{HiCacheError, Result};
use crate::l3::{LookedUp, RequestId};
use crate::request_state::{Admission, Admitted, Arrival, Hits, Request, check_slots, record_hits};

impl HiCache {
    /// The tenant for an extra key (e.g. a LoRA id) and a cache salt; tenants never share
    /// cached pages, in any tier.
    pub fn tenant(
        &mut self,
        extra_key: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<TenantId> {
        Ok(self.tiers.tree.tenant(extra_key, cache_salt)?)
    }

    /// A request arrived (default tenant). See [`HiCache::arrive_for`].
    pub fn arrive(&mut self, req: RequestId, tokens: &[u32]) -> Result<Arrival> {
        let tenant = self.tiers.tree.tenant(None, None)?;
        self.arrive_for(req, tenant, tokens)
    }

    /// Sets a request's priority (default 0; higher is kept longer): the pages it inserts carry
    /// it, and with `eviction_policy = priority` the lowest-priority pages are evicted first
    /// (ties by recency), as SGLang's `--radix-eviction-policy priority` with `req.priority`.
    pub fn set_priority(&mut self, req: RequestId, priority: i32) -> Result<()> {
        self.requests.get_mut(req)?.priority = priority;
        Ok(())
    }

    /// A request of `tenant` arrived: matches its prompt and, with L3, starts prefetching
    /// the part cached in neither L1 nor L2 (if it is at least `prefetch_threshold` tokens).
    /// Tokens past the last whole page are ignored. An empty prompt is an error.
    pub fn arrive_for(
        &mut self,
        req: RequestId,
        tenant: TenantId,
        tokens: &[u32],
    ) -> Result<Arrival> {
        self.check_open()?;
        if self.requests.contains(req) {
            return Err(HiCacheError::request(req, "already arrived"));
        }
        if tokens.is_empty() {
            return Err(HiCacheError::request(req, "empty prompt"));
        }
        let key = self.aligned(tokens);
        let m = self.tiers.tree.match_prefix(tenant, key)?;
        let mut arrival = Arrival {
            device_pages: m.device_pages(),
            host_pages: m.host_hit_pages,
            prefetch_pages: 0,
        };
        let mut request = Request::new(tenant, tokens.len());
        if let Some(l3) = &mut self.l3
            && let Some((seq, pages)) = l3.start_prefetch(req, tenant, key, &m, &mut self.tiers)?
        {
            request.prefetch = Some(seq);
            arrival.prefetch_pages = pages;
        }
        self.requests.insert(req, request);
        Ok(arrival)
    }

    /// Whether the request may be admitted now: true unless its L3 prefetch is still
    /// running under the prefetch policy. Decided (identically on every rank) by
    /// [`HiCache::poll`]; calling this performs no collective.
    pub fn prefetch_ready(&self, req: RequestId) -> Result<bool> {
        Ok(self.requests.get(req)?.prefetch.is_none())
    }

    /// Admits a request: matches its prompt again (now including pages its prefetch
    /// brought), loads the host-resident part of the match back to device (allocating device
    /// pages, evicting if needed; launched by [`HiCache::start_loading`]) and locks the
    /// cached prefix for the request. A load-back that finds no device room falls back to the
    /// device-resident prefix (the rest is recomputed).
    pub fn admit(&mut self, req: RequestId, tokens: &[u32]) -> Result<Admission> {
        self.admit_with_quota(req, tokens, None)
    }

    /// [`HiCache::admit`] with SGLang's `mem_quota`: the device pages the scheduler can spend
    /// on this request. A load-back longer than the quota (less the pages the admission newly
    /// locks) is not done and the host-resident part is recomputed; `None` is unlimited.
    pub fn admit_with_quota(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        mem_quota_pages: Option<usize>,
    ) -> Result<Admission> {
        self.check_open()?;
        let r = self.requests.get(req)?;
        if r.admitted.is_some() {
            return Err(HiCacheError::request(req, "already admitted"));
        }
        if r.prefetch.is_some() {
            return Err(HiCacheError::request(
                req,
                "its L3 prefetch is still running (check prefetch_ready)",
            ));
        }
        let (tenant, storage_pages, carried, prompt_tokens) =
            (r.tenant, r.storage_pages, r.carried_loaded, r.prompt_tokens);
        let key = self.aligned(tokens);
        let mut m = self.tiers.tree.match_prefix(tenant, key)?;
        let device_pages = m.device_pages();
        // Pages an undone admission loaded are at the end of the device prefix now.
        let carried = carried.min(device_pages);
        // The match's slots become the admission's (moved, not copied), with room for one
        // slot per page of the whole prompt (a partial last page included): the engine
        // appends the slots it allocates for the rest without growing the vector.
        let mut prefix = std::mem::take(&mut m.device_slots);
        prefix.reserve_exact(tokens.len().div_ceil(self.page_size()) - device_pages);
        let mut lock = m.last_device_node;
        let mut loaded = 0;
        if let Some((node, slots)) = self.load_back(req, &m, mem_quota_pages)? {
            loaded = slots.len();
            prefix.extend(slots);
            lock = node;
        }
        self.tiers.tree.lock(lock)?;
        let from_host = loaded + carried;
        let storage = storage_pages.min(from_host);
        let admission = Admission {
            device_pages: device_pages - carried,
            host_pages: from_host - storage,
            storage_pages: storage,
            prefix_slots: prefix,
        };
        self.requests.get_mut(req)?.admitted = Some(Admitted {
            lock,
            shared_pages: admission.prefix_slots.len(),
            hits: Some(Hits {
                l1: admission.device_pages,
                l2: admission.host_pages,
                l3: admission.storage_pages,
                prompt_tokens,
            }),
            loaded,
        });
        Ok(admission)
    }

    /// Plans and commits the load-back of the host-resident part of a match (queued for
    /// `start_loading`): the node it ends at and the device pages it fills, or `None` when
    /// nothing is loaded (no host hit, under the threshold or quota, or no device room).
    fn load_back(
        &mut self,
        req: RequestId,
        m: &MatchResult,
        mem_quota_pages: Option<usize>,
    ) -> Result<Option<(NodeId, Vec<DeviceSlot>)>> {
        if m.host_hit_pages == 0 {
            return Ok(None);
        }
        let Some(plan) = self
            .tiers
            .tree
            .plan_load_back(m.last_node, mem_quota_pages)?
        else {
            return Ok(None);
        };
        let pages = plan.pages();
        let Some(slots) = self.alloc_device_pages(pages)? else {
            tracing::debug!(req, pages, "no device room for a load-back; recomputing");
            self.tiers.tree.abort_load_back(plan)?;
            return Ok(None);
        };
        let host = plan.host_slots().to_vec();
        let node = plan.node();
        let load_id = self.tiers.tree.commit_load_back(plan, &slots)?;
        self.copies.queue_load(QueuedLoad {
            load_id,
            host,
            device: slots.clone(),
        });
        Ok(Some((node, slots)))
    }

    /// Undoes an admission the engine could not complete (e.g. no device room for the rest of
    /// the request): unlocks the prefix; the request stays live and may be admitted again.
    /// Pages loaded back for it stay cached (their copy is launched by the next
    /// `start_loading`).
    pub fn unadmit(&mut self, req: RequestId) -> Result<()> {
        self.check_open()?;
        let a = self.requests.admitted(req)?;
        self.tiers.tree.unlock(a.lock)?;
        let r = self.requests.get_mut(req)?;
        r.admitted = None;
        r.carried_loaded += a.loaded;
        Ok(())
    }

    /// Allocates `pages` device pages for new tokens, evicting cached pages if needed.
    /// `None` when even eviction cannot free enough (pinned pages).
    pub fn alloc_device(&mut self, pages: usize) -> Result<Option<Vec<DeviceSlot>>> {
        self.check_open()?;
        self.alloc_device_pages(pages)
    }

    /// Returns device pages the engine allocated and does not hand to the tree (e.g. those of
    /// an aborted request). Freeing a page the tree owns is an error of the pool (double
    /// free) only if it was freed already; the engine must not free tree pages.
    pub fn free_device(&mut self, slots: &[DeviceSlot]) -> Result<()> {
        self.tiers.free_device(slots)
    }

    /// A request finished: inserts its tokens (prompt and output) with its device slots, one
    /// per page including a final partial page, frees the slots the tree already had (and
    /// the partial page's), unlocks the request's prefix and removes the request. Nodes due
    /// for write-through are backed up at the next poll, in one batch.
    pub fn cache_finished(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        slots: &[DeviceSlot],
    ) -> Result<()> {
        let RequestInsert {
            admitted,
            pages: n,
            shared_from: lo,
            res,
            ..
        } = self.insert_request(req, tokens, slots, false)?;
        self.tiers.tree.unlock(admitted.lock)?;
        record_hits(&self.tiers.metrics, self.page_size(), admitted);
        // The duplicates and the partial page's slot (at most one) are freed in one call; a
        // vector joins them only when there are both.
        let (dup, partial) = (&slots[lo..res.prefix_pages], &slots[n..]);
        if dup.is_empty() || partial.is_empty() {
            self.tiers
                .free_device(if dup.is_empty() { partial } else { dup })?;
        } else {
            let mut free = Vec::with_capacity(dup.len() + partial.len());
            free.extend_from_slice(dup);
            free.extend_from_slice(partial);
            self.tiers.free_device(&free)?;
        }
        self.copies.queue_writes(res.write_through);
        self.requests.remove(req)?;
        Ok(())
    }

    /// A chunk of a request's prefill is done (chunked prefill): inserts what exists so far
    /// (hit counts are not bumped), frees duplicate slots and moves the request's lock to the
    /// new last node. Returns the request's slot list from now on: the tree's slots for the
    /// cached pages, then the request's own slots for the rest (including a partial page).
    pub fn cache_unfinished(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        slots: &[DeviceSlot],
    ) -> Result<Vec<DeviceSlot>> {
        let RequestInsert {
            admitted,
            tenant,
            key,
            pages: n,
            shared_from: lo,
            res,
        } = self.insert_request(req, tokens, slots, true)?;
        let ps = self.page_size();
        self.tiers.free_device(&slots[lo..res.prefix_pages])?;
        let m = self.tiers.tree.match_prefix(tenant, key)?;
        debug_assert_eq!(m.device_pages(), n, "inserted pages are on device");
        self.tiers.tree.lock(m.last_node)?;
        self.tiers.tree.unlock(admitted.lock)?;
        let mut out = m.device_slots;
        out.extend_from_slice(&slots[n..]);
        record_hits(&self.tiers.metrics, ps, admitted);
        self.requests.get_mut(req)?.admitted = Some(Admitted {
            lock: m.last_node,
            shared_pages: n,
            hits: None,
            loaded: 0,
        });
        self.copies.queue_writes(res.write_through);
        Ok(out)
    }

    /// The first half of [`HiCache::cache_finished`] and [`HiCache::cache_unfinished`]:
    /// checks the request's slots against its admission and inserts its page-aligned tokens
    /// under the request's tenant and priority (`chunked` for a prefill chunk).
    fn insert_request<'t>(
        &mut self,
        req: RequestId,
        tokens: &'t [u32],
        slots: &[DeviceSlot],
        chunked: bool,
    ) -> Result<RequestInsert<'t>> {
        self.check_open()?;
        let admitted = self.requests.admitted(req)?;
        let ps = self.page_size();
        check_slots(
            &self.tiers.device_pool,
            ps,
            req,
            tokens,
            slots,
            admitted.shared_pages,
            &mut self.slot_marks,
        )?;
        let r = self.requests.get(req)?;
        let (tenant, priority) = (r.tenant, r.priority);
        let key = self.aligned(tokens);
        let pages = key.len() / ps;
        let options = InsertOptions { chunked, priority };
        // The pages its L3 lookup hashed are not hashed again (the tree checks they match).
        let known = r.looked_up.as_ref().map(LookedUp::known);
        let res =
            self.tiers
                .tree
                .insert_with_hashes(tenant, key, &slots[..pages], options, known)?;
        Ok(RequestInsert {
            admitted,
            tenant,
            key,
            pages,
            shared_from: admitted.shared_pages.min(res.prefix_pages),
            res,
        })
    }

    /// Drops a request at any stage: revokes its prefetch (pages already fetched are
    /// released), unlocks its prefix. The engine frees its own device slots
    /// ([`HiCache::free_device`]); the prefix slots of the admission belong to the tree.
    pub fn abort(&mut self, req: RequestId) -> Result<()> {
        self.check_open()?;
        let r = self.requests.remove(req)?;
        if let Some(seq) = r.prefetch
            && let Some(l3) = &mut self.l3
        {
            let end = l3.end_prefetch(
                seq,
                0,
                crate::metrics::PrefetchOutcome::aborted,
                &mut self.tiers,
            )?;
            self.requests.prefetch_ended(end);
        }
        if let Some(a) = r.admitted {
            self.tiers.tree.unlock(a.lock)?;
            record_hits(&self.tiers.metrics, self.page_size(), a);
        }
        Ok(())
    }

    /// Pages this request's L3 prefetch inserted into the tree (0 while it runs or without
    /// one).
    pub fn prefetched_pages(&self, req: RequestId) -> Result<usize> {
        Ok(self.requests.get(req)?.storage_pages)
    }

    /// Evicts at least `pages` device pages if possible (whole nodes, so possibly more):
    /// backed-up nodes are demoted to host, others deleted, and under write-back staged to
    /// host first. Returns the pages freed.
    pub fn evict(&mut self, pages: usize) -> Result<usize> {
        self.check_open()?;
        self.evict_device(pages)
    }
}

/// What [`HiCache::insert_request`] did.
struct RequestInsert<'t> {
    /// The request's admission before the insert.
    admitted: Admitted,
    /// The request's tenant.
    tenant: TenantId,
    /// The page-aligned tokens inserted.
    key: &'t [u32],
    /// Whole pages inserted (`key.len() / page_size`).
    pages: usize,
    /// First of the request's slots the tree already had and the admission did not share
    /// (`shared_pages.min(prefix_pages)`): slots `shared_from..res.prefix_pages` are
    /// duplicates the request frees.
    shared_from: usize,
    /// The tree's answer.
    res: hicache_core::InsertResult,
}
