//! The engine's requests as the cache sees them: what arrival and admission found
//! ([`Arrival`], [`Admission`]) and the per-request state between the calls.
//!
//! Invariants:
//! 1. A request is live from `arrive` until `cache_finished` or `abort`; it holds at most one
//!    tracked prefetch and, once admitted, one lock on the tree (its `Admitted::lock`).
//! 2. An admission's hits are recorded in the metrics once, when the admission is final
//!    (the request finishes, completes a chunk or is aborted), so an undone admission
//!    (`unadmit`) is never counted.

use std::collections::HashMap;

use hicache_core::{DeviceSlot, NodeId, TenantId};
use hicache_gpu::{DevicePool, PageMarks};

use crate::error::{HiCacheError, Result};
use crate::l3::{LookedUp, PrefetchEnd, RequestId};
use crate::metrics::{Metrics, Tier};

/// What [`crate::HiCache::arrive`] found for a new request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Arrival {
    /// Prompt pages cached on device.
    pub device_pages: usize,
    /// Prompt pages cached on host only (loadable at admission).
    pub host_pages: usize,
    /// Pages an L3 prefetch is looking up (0: no prefetch started).
    pub prefetch_pages: usize,
}

/// What [`crate::HiCache::admit`] gives the engine: the cached prefix of the prompt on device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// One device slot per cached page, in order; these pages are locked for the request
    /// until [`crate::HiCache::cache_finished`] or [`crate::HiCache::abort`]. Pages loaded
    /// back from host are valid once [`crate::HiCache::start_loading`]'s layer events fire.
    pub prefix_slots: Vec<DeviceSlot>,
    /// Pages that were already on device (L1 hits).
    pub device_pages: usize,
    /// Pages loaded back from host that were there before this request (L2 hits).
    pub host_pages: usize,
    /// Pages loaded back from host that this request's prefetch brought from L3 (L3 hits).
    pub storage_pages: usize,
}

impl Admission {
    /// Cached pages in total.
    pub fn cached_pages(&self) -> usize {
        self.prefix_slots.len()
    }
}

/// Hit pages per tier and prompt tokens of an admission, recorded once it is final.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hits {
    pub l1: usize,
    pub l2: usize,
    pub l3: usize,
    pub prompt_tokens: usize,
}

/// Per-request state.
#[derive(Debug)]
pub(crate) struct Request {
    pub tenant: TenantId,
    /// Sequence number of the request's prefetch while one is tracked.
    pub prefetch: Option<u64>,
    /// Pages inserted into the tree by this request's finished prefetch.
    pub storage_pages: usize,
    /// Set once admitted: the locked node and the pages the request shares with the tree.
    pub admitted: Option<Admitted>,
    /// Pages loaded back for this request by admissions that were undone (`unadmit`): they
    /// are on device now but count as host or storage hits when it is admitted again.
    pub carried_loaded: usize,
    /// Prompt length at arrival (the denominator of the hit ratio).
    pub prompt_tokens: usize,
    /// Request priority (SGLang's `req.priority`): nodes this request inserts or walks keep the
    /// highest priority of their requests, which the `priority` eviction policy orders by.
    pub priority: i32,
    /// The page hashes its L3 lookup computed, reused when its pages are inserted.
    pub looked_up: Option<LookedUp>,
}

impl Request {
    /// A request of `tenant` that just arrived with a prompt of `prompt_tokens`.
    pub fn new(tenant: TenantId, prompt_tokens: usize) -> Self {
        Self {
            tenant,
            prefetch: None,
            storage_pages: 0,
            admitted: None,
            carried_loaded: 0,
            prompt_tokens,
            priority: 0,
            looked_up: None,
        }
    }
}

/// An admission in force.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Admitted {
    /// The node locked for the request.
    pub lock: NodeId,
    /// Leading pages the request shares with the tree.
    pub shared_pages: usize,
    /// Recorded in the metrics once the admission is final (invariant 2).
    pub hits: Option<Hits>,
    /// Pages loaded back by this admission.
    pub loaded: usize,
}

/// The live requests.
#[derive(Debug, Default)]
pub(crate) struct Requests {
    map: HashMap<RequestId, Request>,
}

impl Requests {
    /// Live requests.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no request is live.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether `req` is live.
    pub fn contains(&self, req: RequestId) -> bool {
        self.map.contains_key(&req)
    }

    /// Adds a request that arrived.
    pub fn insert(&mut self, req: RequestId, r: Request) {
        self.map.insert(req, r);
    }

    /// Removes a request (finished or aborted).
    pub fn remove(&mut self, req: RequestId) -> Result<Request> {
        self.map
            .remove(&req)
            .ok_or_else(|| HiCacheError::request(req, "unknown request"))
    }

    /// A live request.
    pub fn get(&self, req: RequestId) -> Result<&Request> {
        self.map
            .get(&req)
            .ok_or_else(|| HiCacheError::request(req, "unknown request"))
    }

    /// A live request, mutably.
    pub fn get_mut(&mut self, req: RequestId) -> Result<&mut Request> {
        self.map
            .get_mut(&req)
            .ok_or_else(|| HiCacheError::request(req, "unknown request"))
    }

    /// The admission in force of a live request.
    pub fn admitted(&self, req: RequestId) -> Result<Admitted> {
        self.map
            .get(&req)
            .ok_or_else(|| HiCacheError::request(req, "unknown request (finished twice?)"))?
            .admitted
            .ok_or_else(|| HiCacheError::request(req, "not admitted"))
    }

    /// Records that a request's prefetch ended (the request may be gone: aborted).
    pub fn prefetch_ended(&mut self, end: PrefetchEnd) {
        if let Some(r) = self.map.get_mut(&end.req) {
            r.prefetch = None;
            r.storage_pages = end.storage_pages;
            r.looked_up = end.looked_up;
        }
    }
}

/// Records an admission's hits in the metrics, once (invariant 2).
pub(crate) fn record_hits(metrics: &Metrics, page_size: usize, a: Admitted) {
    if let Some(h) = a.hits {
        let ps = page_size as u64;
        metrics.request(h.prompt_tokens as u64);
        metrics.hit(Tier::l1, h.l1 as u64 * ps);
        metrics.hit(Tier::l2, h.l2 as u64 * ps);
        metrics.hit(Tier::l3, h.l3 as u64 * ps);
    }
}

/// Checks the slots the engine hands back for `tokens`: one per page (including a partial
/// last page), covering the `shared` pages it was admitted with, each an allocated device
/// page given once (`marks`: the cache's reused marks for the repeat check).
pub(crate) fn check_slots(
    pool: &DevicePool,
    page_size: usize,
    req: RequestId,
    tokens: &[u32],
    slots: &[DeviceSlot],
    shared: usize,
    marks: &mut PageMarks,
) -> Result<()> {
    let want = tokens.len().div_ceil(page_size);
    if slots.len() != want {
        return Err(HiCacheError::request(
            req,
            format!(
                "{} slots for {} tokens: expected one per page ({want})",
                slots.len(),
                tokens.len()
            ),
        ));
    }
    if shared > tokens.len() / page_size {
        return Err(HiCacheError::request(
            req,
            format!(
                "{} tokens do not cover the {shared} cached pages it was admitted with",
                tokens.len()
            ),
        ));
    }
    // The tree takes these slots: a slot that is not an allocated device page, or given
    // twice, would end up freed twice (and its page reused while cached). The first page
    // (in order) that is either is reported. One pool lock and one pass over the marks.
    let unallocated = pool.first_unallocated(slots);
    let again = marks.first_repeat(slots, |s| s.0, pool.num_pages());
    match (unallocated, again) {
        (Some(page), again) if again.is_none_or(|a| page < a) => Err(HiCacheError::request(
            req,
            format!(
                "slot {} of page {page} is not an allocated device page (pool of {})",
                slots[page].0,
                pool.num_pages()
            ),
        )),
        (_, Some(page)) => Err(HiCacheError::request(
            req,
            format!(
                "slot {} is given twice (again for page {page})",
                slots[page].0
            ),
        )),
        _ => Ok(()),
    }
}
