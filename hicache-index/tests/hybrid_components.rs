//! A hybrid fleet is never routed to a false hit, nor denied a true one: a real
//! `hicache::HybridCache` (sim device, Mamba or sliding-window model, with or without its host
//! tier) runs random requests — inserts, device and host evictions, load-backs — with
//! component events on; every poll's events go through the wire (our publisher's encoding)
//! into an in-process service, and for random prompts the router's credited L1 and L2 overlap
//! of that instance must equal what the cache's own tree would reuse (its validators:
//! device-valid prefix, device-or-host-valid prefix). With an L3 store shared by the
//! instance, the router's L3 credit must equal what a cache with empty L1 and L2 over that
//! store brings back through its prefetch. Outcomes only, no timing.

use bytes::Bytes;
use hicache::PrefetchPolicy;
use hicache::observe::wire::{L3Medium, WireEvent, encode_batch};
use hicache::{
    DType, Device, HybridCache, HybridConfig, HybridDemand, KvKind, KvShape, MambaShape,
};
use hicache_index::decode::WireFormat;
use hicache_index::registry::Registration;
use hicache_index::router::Policy;
use hicache_index::routing::RoutingConfig;
use hicache_index::service::{Service, ServiceConfig};
use hicache_storage::{MemoryBackend, Storage};
use proptest::prelude::*;
use std::sync::Arc;
use std::time::Duration;

const PS: u32 = 4;
/// The L3 prefetch threshold of the L3 tests' caches (two pages), registered with the index.
const THRESHOLD: u64 = 2 * PS as u64;

fn kv_shape(layers: u32) -> KvShape {
    KvShape {
        kind: KvKind::Mha {
            heads: 1,
            head_dim: 8,
        },
        layers,
        dtype: DType::Bf16,
        page_size: PS,
    }
}

/// A cache of 16 device Full pages, 12 SWA pages (so SWA is tombstoned before Full is
/// evicted) and 4 states (host: 24 pages, 8 states, used only with `host`), component events
/// on.
fn cache(swa: Option<u32>, mamba: Option<u32>, host: bool) -> HybridCache {
    let cfg = HybridConfig {
        page_size: PS,
        swa_window: swa,
        mamba_chunk: mamba,
        write_through: host,
        ..Default::default()
    };
    build(cfg, None)
}

/// The geometry of [`cache`] for `cfg`'s components, over `storage` when given.
fn build(cfg: HybridConfig, storage: Option<Arc<dyn Storage>>) -> HybridCache {
    let (swa, mamba) = (cfg.swa_window.is_some(), cfg.mamba_chunk.is_some());
    let mut b = HybridCache::builder(cfg)
        .device(Device::sim())
        .full_shape(kv_shape(2))
        .device_pages(16, if swa { 12 } else { 0 })
        .host_pages(24, 24)
        .host_reserve_bytes(0)
        .kv_events(true)
        .component_events(true);
    if let Some(storage) = storage {
        b = b.storage(storage);
    }
    if swa {
        b = b.swa_shape(kv_shape(1));
    }
    if mamba {
        b = b
            .mamba_shape(MambaShape {
                layers: 1,
                temporal_elems: 8,
                temporal_dtype: DType::F32,
                conv_elems: vec![8],
                conv_dtype: DType::Bf16,
            })
            .mamba_slots(4)
            .host_mamba_slots(8);
    }
    b.build().unwrap()
}

fn service() -> Service {
    service_on(None, None)
}

/// The service with instance `i0` registered, its L3 pages in `l3_store` (a shared store's
/// name) or its own, with its L3 prefetch threshold.
fn service_on(l3_store: Option<&str>, l3_threshold: Option<u64>) -> Service {
    let mut svc = Service::new(ServiceConfig {
        routing: RoutingConfig {
            policy: Policy::Hicache,
            // A loaded test machine must not turn a decision into a fallback.
            deadline: Duration::from_secs(60),
            ..RoutingConfig::default()
        },
        ..ServiceConfig::default()
    });
    svc.register(
        Registration {
            instance: "i0".into(),
            endpoint: "tcp://127.0.0.1:1".into(),
            replay_endpoint: None,
            topic: None,
            format: WireFormat::Sglang,
            model: "m".into(),
            page_size: PS,
            dp_rank: None,
            l3_store: l3_store.map(str::to_string),
            kv_capacity_tokens: None,
            l3_prefetch_threshold_tokens: l3_threshold,
        },
        0,
    )
    .unwrap();
    svc
}

/// A prompt of conversation `conv`, branch `branch` (branches share their first
/// `shared` pages), `len` tokens.
fn tokens(conv: u32, branch: u32, shared: usize, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            let b = if (i as usize) < shared * PS as usize {
                0
            } else {
                branch + 1
            };
            conv * 1_000_000 + b * 10_000 + i
        })
        .collect()
}

/// One request to completion: arrive, admit (load-back), allocate (evicting), insert, poll,
/// and wait for its copies. A request the device cannot hold even after the copies end is
/// aborted.
fn run(c: &mut HybridCache, req: u64, t: &[u32]) {
    c.arrive(req, t).unwrap();
    c.poll().unwrap();
    if !c.prefetch_ready(req).unwrap() {
        // With L3, an L3 lookup of the prompt's uncached part runs first.
        c.flush().unwrap();
    }
    assert!(c.prefetch_ready(req).unwrap());
    let adm = c.admit(req, t).unwrap();
    if let Some(b) = c.start_loading().unwrap() {
        c.wait_loaded(b).unwrap();
    }
    let pages = t.len().div_ceil(PS as usize);
    let have = adm.slots.full.len();
    let swa = c.config().swa_window.is_some();
    let mamba = c.config().mamba_chunk.is_some();
    let demand = HybridDemand {
        full_pages: pages - have,
        swa_pages: if swa { pages - have } else { 0 },
        mamba_slots: usize::from(mamba && adm.slots.mamba.is_empty()),
    };
    let new = match c.alloc(demand).unwrap() {
        Some(n) => n,
        None => {
            c.flush().unwrap();
            match c.alloc(demand).unwrap() {
                Some(n) => n,
                None => {
                    c.abort(req).unwrap();
                    return;
                }
            }
        }
    };
    let mut slots = adm.slots.clone();
    // As an engine does, keep only the SWA pages of the prefix's last window (the ones the
    // admission locked): the allocation above may have tombstoned the others.
    if let Some(w) = c.config().swa_window {
        let cut = have.saturating_sub((w as usize).div_ceil(PS as usize));
        for s in &mut slots.swa[..cut] {
            *s = None;
        }
    }
    slots.extend(new);
    c.cache_finished(req, t, slots).unwrap();
    c.poll().unwrap();
    c.flush().unwrap();
}

/// Hands the cache's events since the last call to the service as one wire batch.
fn publish(c: &mut HybridCache, svc: &mut Service, seq: &mut u64) {
    let events: Vec<WireEvent> = c
        .drain_component_events()
        .iter()
        .map(|e| WireEvent::from_component_event(e, L3Medium::External))
        .collect();
    if events.is_empty() {
        return;
    }
    let payload = encode_batch(1.0, &events, None).unwrap();
    svc.live("i0", *seq, Bytes::from(payload), 0);
    *seq += 1;
}

type Prompt = (u32, u32, usize, usize);

fn prompt() -> impl Strategy<Value = Prompt> {
    (0..3u32, 0..2u32, 1..6usize, 2..44usize)
}

/// Runs `requests` on one cache and checks every query after each; the differences found.
fn check(swa: Option<u32>, mamba: Option<u32>, host: bool, requests: &[(Prompt, Vec<Prompt>)]) {
    let mut c = cache(swa, mamba, host);
    let mut svc = service();
    let mut seq = 0;
    let mut id = 1u64;
    for ((conv, branch, shared, len), queries) in requests {
        run(&mut c, id, &tokens(*conv, *branch, *shared, *len));
        id += 1;
        publish(&mut c, &mut svc, &mut seq);
        for &(conv, branch, shared, len) in queries {
            let q = tokens(conv, branch, shared, len);
            let (dev, either) = c.reusable_tokens(&q).unwrap();
            // The probe's match splits nodes and refreshes LRUs only: no event.
            publish(&mut c, &mut svc, &mut seq);
            let a = svc.route("m", &q, Some(id), None).unwrap();
            svc.finished(id);
            id += 1;
            assert!(!a.fallback);
            assert_eq!(
                (a.overlap.l1 as usize, a.overlap.l2 as usize),
                (dev, if host { either } else { dev }),
                "{swa:?} {mamba:?} host {host}: prompt {q:?}"
            );
        }
    }
    c.shutdown().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn the_router_credits_a_mamba_instance_exactly_what_its_tree_reuses(
        host in any::<bool>(),
        requests in prop::collection::vec((prompt(), prop::collection::vec(prompt(), 1..4)), 1..14),
    ) {
        check(None, Some(8), host, &requests);
    }

    #[test]
    fn the_router_credits_a_sliding_window_instance_exactly_what_its_tree_reuses(
        host in any::<bool>(),
        requests in prop::collection::vec((prompt(), prop::collection::vec(prompt(), 1..4)), 1..14),
    ) {
        check(Some(6), None, host, &requests);
    }

    #[test]
    fn the_router_credits_an_swa_and_mamba_instance_exactly_what_its_tree_reuses(
        host in any::<bool>(),
        requests in prop::collection::vec((prompt(), prop::collection::vec(prompt(), 1..4)), 1..14),
    ) {
        check(Some(8), Some(8), host, &requests);
    }
}

/// The same workload with component events off: the model is never declared hybrid, so the
/// router credits the Full pages — the false hits the events exist to prevent show up (for
/// a Mamba model whose states were evicted while its Full pages stayed).
#[test]
fn without_component_events_the_router_would_credit_false_hits() {
    let mut c = cache(None, Some(8), false);
    let mut svc = service();
    // Two turns of one conversation: each turn's state sits at its end only; a prompt
    // ending between the turns' ends has Full pages cached but no state there.
    run(&mut c, 1, &tokens(0, 0, 0, 21));
    run(&mut c, 2, &tokens(0, 0, 0, 45));
    let events: Vec<WireEvent> = c
        .drain_component_events()
        .iter()
        .filter(|e| e.component.is_none())
        .map(|e| WireEvent::from_component_event(e, L3Medium::External))
        .collect();
    let payload = encode_batch(1.0, &events, None).unwrap();
    svc.live("i0", 0, Bytes::from(payload), 0);
    let q = tokens(0, 0, 0, 33);
    let (dev, _) = c.reusable_tokens(&q).unwrap();
    let a = svc.route("m", &q, Some(100), None).unwrap();
    assert!(
        a.overlap.l1 as usize > dev,
        "Full pages alone credit {} tokens, the tree reuses {dev}",
        a.overlap.l1
    );
    c.shutdown().unwrap();
}

/// `cache` with an L3 store: every backup goes on to L3, and a prefetch of any hit of two
/// pages or more is waited for (`wait_complete`), so an admission brings back all that L3
/// restores. Without `write_through` the cache writes nothing (a reader of the store).
fn cache_l3(
    swa: Option<u32>,
    mamba: Option<u32>,
    storage: Arc<dyn Storage>,
    write_through: bool,
) -> HybridCache {
    let cfg = HybridConfig {
        page_size: PS,
        swa_window: swa,
        mamba_chunk: mamba,
        write_through,
        prefetch_threshold_tokens: THRESHOLD as usize,
        prefetch_policy: PrefetchPolicy::WaitComplete,
        ..Default::default()
    };
    build(cfg, Some(storage))
}

/// The tokens a cache with empty L1 and L2 over `storage` brings back for `t` from L3 (its
/// admission's host tokens, all of them prefetched); the request is then aborted.
fn restored_from_l3(
    swa: Option<u32>,
    mamba: Option<u32>,
    storage: Arc<dyn Storage>,
    t: &[u32],
) -> usize {
    let mut c = cache_l3(swa, mamba, storage, false);
    c.arrive(1, t).unwrap();
    // `wait_complete`: the prefetch ends once every read landed; `flush` runs it through.
    c.flush().unwrap();
    assert!(c.prefetch_ready(1).unwrap());
    let adm = c.admit(1, t).unwrap();
    assert_eq!(
        adm.device_tokens, 0,
        "a fresh cache holds nothing on device"
    );
    assert_eq!(adm.host_tokens, adm.storage_tokens, "{adm:?}");
    if let Some(b) = c.start_loading().unwrap() {
        c.wait_loaded(b).unwrap();
    }
    c.abort(1).unwrap();
    c.shutdown().unwrap();
    adm.storage_tokens
}

/// One instance writes `requests` through L1 and L2 to a store it shares, then restarts
/// (`AllBlocksCleared`: its L1 and L2 are gone, the store's pages and components stay); for
/// each query the router's L3 credit equals what a fresh cache restores from the store.
fn check_l3(swa: Option<u32>, mamba: Option<u32>, requests: &[Prompt], queries: &[Prompt]) {
    let storage: Arc<dyn Storage> = Arc::new(MemoryBackend::with_capacity(64 << 20));
    let mut c = cache_l3(swa, mamba, storage.clone(), true);
    let mut svc = service_on(Some("s"), Some(THRESHOLD));
    let mut seq = 0;
    for (id, &(conv, branch, shared, len)) in requests.iter().enumerate() {
        run(&mut c, id as u64 + 1, &tokens(conv, branch, shared, len));
        publish(&mut c, &mut svc, &mut seq);
    }
    c.flush().unwrap();
    publish(&mut c, &mut svc, &mut seq);
    c.shutdown().unwrap();
    let cleared = encode_batch(1.0, &[WireEvent::AllBlocksCleared], None).unwrap();
    svc.live("i0", seq, Bytes::from(cleared), 0);
    for (k, &(conv, branch, shared, len)) in queries.iter().enumerate() {
        let q = tokens(conv, branch, shared, len);
        let id = 1_000 + k as u64;
        let a = svc.route("m", &q, Some(id), None).unwrap();
        svc.finished(id);
        assert!(!a.fallback);
        assert_eq!(a.overlap.l2, 0, "L1 and L2 were cleared: {a:?}");
        let truth = restored_from_l3(swa, mamba, storage.clone(), &q);
        assert_eq!(
            a.overlap.l3 as usize, truth,
            "{swa:?} {mamba:?}: prompt of {len} tokens (conv {conv}, branch {branch}, shared {shared})"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn the_router_credits_a_hybrid_instance_s_shared_store_exactly_what_l3_restores(
        kind in 0..3u8,
        requests in prop::collection::vec(prompt(), 1..10),
        queries in prop::collection::vec(prompt(), 1..6),
    ) {
        let (swa, mamba) = match kind {
            0 => (None, Some(8)),
            1 => (Some(6), None),
            _ => (Some(8), Some(8)),
        };
        check_l3(swa, mamba, &requests, &queries);
    }
}
