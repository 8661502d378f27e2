//! The contract between the simulated engine and the cache it drives.
//!
//! The engine calls these methods in the order of one SGLang scheduler tick (its
//! event loop: receive requests, check prefetches, build the prefill batch, run the forward,
//! process the results):
//!
//! 1. [`arrive`](CacheUnderTest::arrive) for each request as it joins the waiting queue
//!    (match, start the L3 prefetch of the uncached suffix);
//! 2. [`advance`](CacheUnderTest::advance) once per tick before scheduling, with the simulated
//!    time and the links background copies take ([`crate::links`]);
//! 3. for each waiting request in FCFS order: [`prefetch_status`](CacheUnderTest::prefetch_status)
//!    (a `Pending` request is skipped and stays queued), then
//!    [`admit`](CacheUnderTest::admit) (match again, load back host pages, allocate every device
//!    page the request needs, lock the prefix), which is all-or-nothing;
//! 4. [`start_loading`](CacheUnderTest::start_loading) once the batch is built, then during the
//!    forward [`wait_layer`](CacheUnderTest::wait_layer) before each layer's attention;
//! 5. [`cache_finished`](CacheUnderTest::cache_finished) when a request has produced its last
//!    token;
//! 6. [`shutdown`](CacheUnderTest::shutdown) at the end, then [`stats`](CacheUnderTest::stats).
//!
//! # Rules an implementation keeps (the engine and the report rely on them)
//!
//! 1. **Whole pages.** Prefixes are whole pages and never cover the last prompt token (an
//!    engine computes at least one token to get logits): `prefix_slots.len() · page_size <
//!    tokens.len()`.
//! 2. **All or nothing.** `admit` either returns `Some` with every page the request needs —
//!    `prefix_slots` (`l1_pages + l2_pages + l3_pages` of them, in prefix order) and
//!    `new_slots` (`ceil((tokens.len() + new_tokens) / page_size) − prefix pages`) — or returns
//!    `None` and changes nothing the engine can observe (the request retries on a later tick).
//! 3. **Ownership.** From `admit` until `cache_finished` the engine owns `new_slots`; the
//!    prefix stays locked. `cache_finished` hands every slot back (prefix then new, one per
//!    page of `tokens`, a partial last page included): the cache keeps the whole pages it
//!    inserts, frees duplicates and the partial page, and unlocks the prefix.
//! 4. **One count per admission.** `stats().hit_tokens_*` count each admitted request's prefix
//!    once, by the tier it came from; `request_tokens` counts each admitted prompt once.
//! 5. **Determinism.** The engine's clock is simulated; wall time passes only while the cache
//!    works. An implementation should make `advance` finish what is due by the simulated time
//!    (copies whose modelled transfer on [`Links`] has completed), waiting in wall time for the
//!    real work behind it, rather than depend on how fast the machine is, so runs repeat.
//!
//! The engine never sees tiers or slots beyond what these types carry, so any cache (the
//! `hicache` controller, a baseline without prefix caching, a test model) can be measured.

use hicache::metrics::MetricsSnapshot;
pub use hicache_core::DeviceSlot;
use serde::Serialize;
use thiserror::Error;

use crate::links::Links;

/// A request's id, unique within one run.
pub type RequestId = u64;

/// Why a cache call failed (the run stops with this message).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("{0}")]
pub struct CacheError(pub String);

impl From<String> for CacheError {
    fn from(s: String) -> Self {
        CacheError(s)
    }
}

impl From<&str> for CacheError {
    fn from(s: &str) -> Self {
        CacheError(s.to_string())
    }
}

/// Result of a cache call.
pub type CacheResult<T> = Result<T, CacheError>;

/// Where a request's L3 prefetch stands.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PrefetchStatus {
    /// Still running and the policy says wait: skip the request this tick.
    Pending,
    /// Finished (or there was nothing to fetch): the request may be scheduled. `l3_pages` is
    /// how many pages this request's prefetch brought from L3 into L2 (0 without L3).
    Ready {
        /// Pages fetched from L3 for this request.
        l3_pages: usize,
    },
}

/// What admission gave a request (rules 1–3 of the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// Prefix pages that were already on the device.
    pub l1_pages: usize,
    /// Prefix pages loaded back from L2 that were in L2 before this request arrived.
    pub l2_pages: usize,
    /// Prefix pages loaded back from L2 that this request's prefetch brought from L3.
    pub l3_pages: usize,
    /// Device slots of the prefix, in order (`l1_pages + l2_pages + l3_pages` of them).
    pub prefix_slots: Vec<DeviceSlot>,
    /// Device slots for the rest of the prompt and the new tokens.
    pub new_slots: Vec<DeviceSlot>,
    /// Bytes this admission copies from host to device, when the cache knows them exactly
    /// (a hybrid model loads Full pages, SWA pages and a Mamba state); `None`:
    /// [`load_pages`](Self::load_pages) pages of the engine's page size.
    pub load_bytes: Option<u64>,
}

impl Admission {
    /// Pages of the matched prefix (every tier).
    pub fn prefix_pages(&self) -> usize {
        self.l1_pages + self.l2_pages + self.l3_pages
    }

    /// Pages this admission copies from host to device before the forward (L2 and L3 hits).
    pub fn load_pages(&self) -> usize {
        self.l2_pages + self.l3_pages
    }
}

/// Totals of one transfer direction: the facade's, which the engine reads unchanged.
pub use hicache::metrics::TransferTotals as TransferStats;

/// What the cache did during one run: the facade's [`MetricsSnapshot`] (the cache under test
/// reports in its names; a cache that is not `hicache` fills what applies) plus what only the
/// simulation knows.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct CacheStats {
    /// Bytes of one page (all layers, K and V).
    pub page_bytes: u64,
    /// The cache's counters: hits per tier, bytes moved per direction, prefetch outcomes,
    /// evictions, L3 failures.
    #[serde(flatten)]
    pub metrics: MetricsSnapshot,
    /// L3 pages lookups found stored but not yet visible: their backup had not completed in
    /// simulated time (L3 hits lost to copies in flight).
    pub l3_pages_in_flight: u64,
    /// Admissions refused while device pages were held by write-through copies in flight.
    pub refused_during_copies: u64,
    /// A hybrid model's moves per component (`metrics` then counts the Full component's
    /// pages, and `page_bytes` is a Full page); `None` for a dense model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub components: Option<HybridMoves>,
    /// What the run did with page bytes (none when `counted_only`: pages counted at
    /// `page_bytes`, never populated or copied).
    pub payload: crate::setup::PayloadUsed,
}

/// Pages (states for Mamba) and bytes one component of a hybrid model moved, per direction.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct ComponentMoves {
    /// Device → host (write-through).
    pub d2h: TransferStats,
    /// Host → device (load-back).
    pub h2d: TransferStats,
    /// Host → L3 (backup).
    pub l2_to_l3: TransferStats,
    /// L3 → host (prefetch).
    pub l3_to_l2: TransferStats,
}

impl ComponentMoves {
    /// The four directions with their report names.
    pub fn directions(&self) -> [(&'static str, TransferStats); 4] {
        [
            ("d2h", self.d2h),
            ("h2d", self.h2d),
            ("l2_to_l3", self.l2_to_l3),
            ("l3_to_l2", self.l3_to_l2),
        ]
    }
}

/// A hybrid model's moves per component.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct HybridMoves {
    /// Full-attention KV pages.
    pub full: ComponentMoves,
    /// Sliding-window KV pages.
    pub swa: ComponentMoves,
    /// Mamba states.
    pub mamba: ComponentMoves,
}

impl HybridMoves {
    /// The components with their report names.
    pub fn components(&self) -> [(&'static str, &ComponentMoves); 3] {
        [
            ("full", &self.full),
            ("swa", &self.swa),
            ("mamba", &self.mamba),
        ]
    }
}

/// A cache the simulated engine can drive. See the [module documentation](self) for the call
/// order and the rules.
pub trait CacheUnderTest {
    /// Tokens per page.
    fn page_size(&self) -> usize;

    /// Pages of device (L1) memory in total.
    fn device_pages(&self) -> usize;

    /// Request arrival: match and start the L3 prefetch of the uncached suffix.
    fn arrive(&mut self, req: RequestId, tokens: &[u32]) -> CacheResult<()>;

    /// Drain acknowledgements, finish writes, loads and prefetch steps.
    fn poll(&mut self) -> CacheResult<()>;

    /// Once per tick before scheduling, at simulated time `now`: what [`poll`](Self::poll)
    /// does, except that a cache with background copies times them on `links` and finishes
    /// only those completed by `now` (when `links` charges copy time). The default polls.
    fn advance(&mut self, now: f64, links: &mut Links) -> CacheResult<()> {
        let _ = (now, links);
        self.poll()
    }

    /// The earliest simulated time at which a copy the cache holds back completes (the engine
    /// moves its clock there when nothing else can happen); `None` when nothing is held.
    fn next_completion(&self) -> Option<f64> {
        None
    }

    /// Whether the request may be scheduled now (its prefetch finished per policy). The engine
    /// calls it (with `poll` in between) until it returns `Ready`, and not again afterwards.
    fn prefetch_status(&mut self, req: RequestId) -> CacheResult<PrefetchStatus>;

    /// Admission: match again, load back host pages (allocating device pages, evicting), lock
    /// the prefix, and allocate device pages for the rest of `tokens` plus `new_tokens` more.
    /// `None` when device memory cannot hold it now (retry later); rule 2.
    fn admit(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        new_tokens: usize,
    ) -> CacheResult<Option<Admission>>;

    /// Launches the host-to-device loads of this tick's admissions; `Some(producer index)` if
    /// there are any.
    fn start_loading(&mut self) -> CacheResult<Option<usize>>;

    /// Waits until layer `layer` of producer `idx` is loaded (the attention layer's wait).
    fn wait_layer(&mut self, idx: usize, layer: usize) -> CacheResult<()>;

    /// The request finished: insert `tokens` (prompt and output), taking back every slot
    /// (rule 3).
    fn cache_finished(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        slots: &[DeviceSlot],
    ) -> CacheResult<()>;

    /// Graceful end: drain pending writes and backups.
    fn shutdown(&mut self) -> CacheResult<()>;

    /// Totals of the run so far.
    fn stats(&self) -> CacheStats;

    /// The cache's KV-event publisher and where it stands, when one runs (`--kv-events`);
    /// `None` by default.
    fn kv_events(&self) -> Option<KvEventsState> {
        None
    }
}

/// A cache's KV-event publisher, as `--kv-events-hold` watches it after the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventsState {
    /// The bound PUB endpoint (`tcp://IP:PORT`).
    pub endpoint: String,
    /// The bound replay endpoint, when configured.
    pub replay_endpoint: Option<String>,
    /// Batches queued, published and replayed.
    pub progress: hicache::observe::PublisherProgress,
}
