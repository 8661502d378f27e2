//! The hybrid-model facade: [`HybridCache`] drives SGLang 0.5.23's `UnifiedRadixCache`
//! semantics ([`hicache_core::UnifiedTree`]) over one device pool, one host pool and one copy
//! engine per component — Full-attention KV, sliding-window (SWA) KV, Mamba state.
//!
//! One scheduler tick, as the dense `HiCache`:
//!
//! ```text
//! on arrival       cache.arrive(req, &prompt)          match (nothing copied)
//! every iteration:
//!   1. cache.poll()                                      finish copies; write-through
//!   2. per waiting request: cache.prefetch_ready(req)?, then
//!        cache.try_admit(req, &prompt, HybridExtent)
//!                                     → prefix slots per component (host hits loaded
//!                                       back; the matched Mamba state copied, or the host
//!                                       one loaded, into the request's slot)
//!                                       and slots for the rest, all or nothing (evicts per
//!                                       component; `None`: it waits, holding nothing)
//!      (or cache.admit, then cache.alloc(HybridDemand): a load-back without room falls
//!       back to the device prefix)
//!   3. cache.start_loading()          → Some(batch): cache.wait_loaded(batch) before use
//!   4. forward pass
//!   5. cache.cache_finished(req, &tokens, slots)   insert (SGLang's lengths)
//! on abort         cache.abort(req) (+ cache.release(slots) for what it allocated)
//! at the end       cache.shutdown()
//! ```
//!
//! A request matches its tokens but the last (at least one token is computed, as SGLang's
//! scheduler does). Ownership of each component's slots is stated in `cache`; the copies in
//! flight in `copies`; the rank agreement in `tick`.

mod admit;
mod builder;
mod cache;
mod copies;
mod events;
mod l3;
mod l3_flow;
mod l3_io;
mod l3_keys;
mod metrics;
mod pools;
mod prefetch;
mod state;
mod tick;
mod types;

/// The tree's component of a host pool group's component.
pub(crate) fn component_of(c: hicache_host::HostComponent) -> hicache_core::Component {
    match c {
        hicache_host::HostComponent::Kv => hicache_core::Component::Full,
        hicache_host::HostComponent::Swa => hicache_core::Component::Swa,
        hicache_host::HostComponent::Mamba => hicache_core::Component::Mamba,
    }
}

pub use builder::HybridCacheBuilder;
pub use cache::HybridCache;
pub use state::StateSlot;
pub use tick::{HYBRID_EXCHANGE_BACKUPS, HYBRID_EXCHANGE_LOADS};
pub use types::{
    ComponentTotals, HybridAdmission, HybridArrival, HybridConfig, HybridDemand, HybridExtent,
    HybridSlots, HybridTotals, MambaLoadBack,
};
