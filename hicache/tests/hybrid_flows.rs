//! Whole flows of the hybrid facade on the sim device (or CUDA with
//! `HICACHE_TEST_DEVICE=cuda`): real bytes written into device pages per component, evicted
//! to host, loaded back and compared byte for byte (Full pages, SWA pages in the window, the
//! Mamba state), for [Full, SWA], [Full, Mamba] and [Full, SWA, Mamba].

mod common;
mod hybrid_common;

use hicache::{
    Component, HiCacheError, HybridAdmission, HybridCache, HybridConfig, HybridDemand, HybridSlots,
    KvEvent, MambaLoadBack, Medium,
};
use hybrid_common::{Engine, extended, prompt};

const PS: u32 = 4;

fn config(swa: Option<u32>, mamba: Option<u32>) -> HybridConfig {
    HybridConfig {
        page_size: PS,
        swa_window: swa,
        mamba_chunk: mamba,
        ..Default::default()
    }
}

/// A cache of `device` pages per KV component (and 8 state slots), 64 on host.
fn cache(cfg: HybridConfig, device: usize) -> HybridCache {
    hybrid_common::builder(cfg, device).build().unwrap()
}

/// Turn one, then an unrelated request that pushes it out of L1 into L2, then turn two
/// (turn one plus more tokens): its prefix is loaded back from host and checked byte for
/// byte per component by the engine.
fn evict_to_host_and_load_back(cfg: HybridConfig) -> hybrid_common::Run {
    let mut e = Engine::new(cache(cfg, 16));
    let a = prompt(1, 40);
    e.turn(&a);
    let b = prompt(2, 40);
    e.turn(&b);
    let t = e.cache.metrics();
    assert!(t.full.evicted_device >= 9, "turn one left L1: {t:?}");
    let run = e.run(&extended(&a, 3, 24));
    e.settle();
    assert!(run.admission.host_tokens > 0, "an L2 hit: {run:?}");
    assert_eq!(run.admission.device_tokens, 0, "{run:?}");
    assert_eq!(run.checked[0] * PS as usize, run.admission.cached_tokens());
    let t = e.cache.metrics();
    assert!(t.full.pages_h2d >= run.checked[0] as u64, "{t:?}");
    e.cache.shutdown().unwrap();
    run
}

#[test]
fn full_swa_pages_come_back_from_host_byte_equal() {
    let run = evict_to_host_and_load_back(config(Some(8), None));
    assert_eq!(run.admission.cached_tokens(), 40);
    // The window's SWA pages (8 tokens: 2 pages) are back and equal.
    assert!(run.checked[1] >= 2, "{run:?}");
}

#[test]
fn l1_hit_serves_the_prefix_and_counts_it() {
    let mut e = Engine::new(cache(config(Some(8), None), 64));
    let a = prompt(1, 40);
    e.run(&a);
    let run = e.run(&extended(&a, 3, 24));
    assert_eq!(run.admission.device_tokens, 40);
    assert_eq!(run.admission.host_tokens, 0);
    e.settle();
    let t = e.cache.metrics();
    assert_eq!(t.full.hit_tokens_l1, 40);
    assert!(t.full.pages_d2h >= 10 && t.swa.pages_d2h >= 2, "{t:?}");
    e.cache.shutdown().unwrap();
}

#[test]
fn bad_input_is_an_error_that_says_what() {
    let mut c = cache(config(Some(8), None), 16);
    let p = prompt(1, 12);
    assert!(matches!(
        c.admit(7, &p),
        Err(HiCacheError::Request { request: 7, .. })
    ));
    c.arrive(7, &p).unwrap();
    assert!(matches!(c.arrive(7, &p), Err(HiCacheError::Request { .. })));
    let adm = c.admit(7, &p).unwrap();
    assert_eq!(adm.cached_tokens(), 0);
    // Wrong slot counts: 3 pages of tokens, 1 slot each.
    let one = c
        .alloc(HybridDemand {
            full_pages: 1,
            swa_pages: 1,
            mamba_slots: 0,
        })
        .unwrap()
        .unwrap();
    let err = c.cache_finished(7, &p, one.clone()).unwrap_err();
    assert!(
        err.to_string()
            .contains("1 Full and 1 SWA slots for 12 tokens"),
        "{err}"
    );
    // A slot named twice, and one that was never allocated.
    let two = c
        .alloc(HybridDemand {
            full_pages: 2,
            swa_pages: 3,
            mamba_slots: 0,
        })
        .unwrap()
        .unwrap();
    let mut twice = HybridSlots {
        full: vec![one.full[0], one.full[0], two.full[0]],
        swa: two.swa.clone(),
        mamba: Vec::new(),
    };
    let err = c.cache_finished(7, &p, twice.clone()).unwrap_err();
    assert!(err.to_string().contains("named twice"), "{err}");
    let pool = c.device_pool(Component::Full).unwrap().clone();
    let free = (0..16)
        .map(hicache::DeviceSlot)
        .find(|&s| !pool.is_allocated(s))
        .unwrap();
    twice.full = vec![one.full[0], two.full[0], free];
    let err = c.cache_finished(7, &p, twice).unwrap_err();
    assert!(err.to_string().contains("not allocated"), "{err}");
    c.release(two).unwrap();
    // Mamba slots without Mamba.
    let err = c
        .alloc(HybridDemand {
            mamba_slots: 1,
            ..Default::default()
        })
        .unwrap_err();
    assert!(err.to_string().contains("Mamba"), "{err}");
    // Oversize demands are a refusal, not a panic.
    let none = c
        .alloc(HybridDemand {
            full_pages: 1000,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(none, None);
    c.release(one).unwrap();
    c.abort(7).unwrap();
    assert!(c.abort(7).is_err());
    assert!(c.cache_finished(8, &p, HybridSlots::default()).is_err());
    assert_eq!(c.device_pool(Component::Full).unwrap().available(), 16);
    c.shutdown().unwrap();
    assert!(matches!(c.poll(), Err(HiCacheError::Closed)));
}

#[test]
fn full_mamba_state_comes_back_from_host_byte_equal() {
    // Chunk 8: turn one (40 tokens) inserts its checkpoint at 40.
    let run = evict_to_host_and_load_back(config(None, Some(8)));
    assert_eq!(run.admission.cached_tokens(), 40);
    assert_eq!(
        run.checked[2], 1,
        "the Mamba state, copied into the request's slot"
    );
}

#[test]
fn full_swa_mamba_all_come_back_from_host_byte_equal() {
    let run = evict_to_host_and_load_back(config(Some(8), Some(8)));
    assert!(run.admission.cached_tokens() >= 32, "{run:?}");
    assert!(run.checked[1] >= 2, "{run:?}");
    assert_eq!(run.checked[2], 1, "{run:?}");
}

#[test]
fn mamba_hit_is_copied_on_write_into_the_requests_own_slot() {
    let mut e = Engine::new(cache(config(None, Some(8)), 64));
    let a = prompt(1, 40);
    e.run(&a);
    let run = e.run(&extended(&a, 3, 24));
    assert_eq!(run.admission.device_tokens, 40);
    assert_eq!(run.checked[2], 1);
    e.settle();
    // The tree's states plus none leaked: every slot is the tree's or free.
    let pool = e.cache.state_pool().unwrap();
    let tree_states = e.cache.tree().size(Component::Mamba) as usize;
    assert_eq!(pool.available() + tree_states, pool.num_slots());
    e.cache.shutdown().unwrap();
}

/// The Full page hashes of `events` with `medium`, stored or removed.
fn hashes(events: &[KvEvent], medium: Medium, stored: bool) -> Vec<hicache_core::PageHash> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                medium: m,
                ..
            } if stored && *m == medium => Some(block_hashes.clone()),
            KvEvent::BlockRemoved {
                block_hashes,
                medium: m,
                ..
            } if !stored && *m == medium => Some(block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

#[test]
fn kv_events_follow_full_pages_across_tiers_and_metrics_render_per_component() {
    let cache = hybrid_common::builder(config(Some(8), None), 16)
        .kv_events(true)
        .build()
        .unwrap();
    let mut e = Engine::new(cache);
    let a = prompt(1, 40);
    e.turn(&a);
    let ev = e.cache.drain_events();
    let on_gpu = hashes(&ev, Medium::Gpu, true);
    assert_eq!(on_gpu.len(), 10, "{ev:?}");
    let mut on_host = hashes(&ev, Medium::CpuPinned, true);
    on_host.sort();
    let mut sorted = on_gpu.clone();
    sorted.sort();
    assert_eq!(on_host, sorted, "the same pages backed up");
    // Another request pushes turn one out of L1: its pages leave the GPU, stay on host.
    e.turn(&prompt(2, 40));
    let ev = e.cache.drain_events();
    let mut removed = hashes(&ev, Medium::Gpu, false);
    removed.sort();
    assert_eq!(removed, sorted, "{ev:?}");
    assert!(hashes(&ev, Medium::CpuPinned, false).is_empty());
    let text = e.cache.render_metrics();
    let swa_d2h = r#"hicache_hybrid_moved_pages_total{component="swa",direction="d2h"}"#;
    assert!(text.lines().any(|l| l.starts_with(swa_d2h)), "{text}");
    e.cache.shutdown().unwrap();
}

#[test]
fn full_host_pools_evict_host_only_nodes_for_new_backups() {
    // 12 host pages: turn one's 10 backed-up pages must make room for the next request's.
    let cache = hybrid_common::builder(config(Some(8), Some(8)), 16)
        .host_pages(12, 12)
        .build()
        .unwrap();
    let mut e = Engine::new(cache);
    let a = prompt(1, 40);
    e.turn(&a);
    e.turn(&prompt(2, 40));
    let t = e.cache.metrics();
    assert!(t.full.evicted_host >= 8, "{t:?}");
    assert!(t.full.pages_d2h >= 20, "both requests backed up: {t:?}");
    // Turn one left L1 (for the second request) and then L2 (for its backup).
    let run = e.run(&a);
    assert_eq!(run.admission.cached_tokens(), 0, "{run:?}");
    e.settle();
    e.cache.shutdown().unwrap();
}

#[test]
fn abort_releases_the_prefix_lock_and_the_copy_on_write_state() {
    let mut e = Engine::new(cache(config(Some(8), Some(8)), 32));
    let a = prompt(1, 40);
    e.turn(&a);
    let a2 = extended(&a, 3, 24);
    e.cache.arrive(99, &a2).unwrap();
    let adm = e.cache.admit(99, &a2).unwrap();
    assert_eq!(adm.device_tokens, 40);
    assert_eq!(adm.slots.mamba.len(), 1, "a state of the request's own");
    let mine = e
        .cache
        .alloc(HybridDemand {
            full_pages: 6,
            swa_pages: 6,
            mamba_slots: 1,
        })
        .unwrap()
        .unwrap();
    e.cache.abort(99).unwrap();
    e.cache.release(mine).unwrap();
    assert_eq!(
        e.cache.tree().protected_size(Component::Full),
        0,
        "unlocked"
    );
    e.settle();
    e.cache.shutdown().unwrap();
}

#[test]
fn host_pools_are_sized_from_the_device_pools_by_ratio_or_size() {
    let mut cfg = config(Some(8), Some(8));
    cfg.hicache_ratio = 2.0;
    let sized = |cfg: HybridConfig| {
        hybrid_common::builder(cfg, 16)
            .host_pages(0, 0)
            .host_mamba_slots(0)
            .build()
            .unwrap()
    };
    let mut cache = sized(cfg.clone());
    let g = cache.host_pools();
    // SGLang: ⌊16 pages · 4 tokens · 2⌋ = 128 tokens, 32 pages, plus one; ⌊8 states · 2⌋ + 1.
    assert_eq!(g.kv().num_pages(), 33);
    assert_eq!(g.swa().unwrap().num_pages(), 33);
    assert_eq!(g.mamba().unwrap().num_slots(), 17);
    cache.shutdown().unwrap();
    // 1 MB split by device bytes: as many pages for each KV pool as its device share buys,
    // half as many states as pages (8 device states against 16 device pages).
    cfg.hicache_size = 1e-3;
    let mut cache = sized(cfg.clone());
    let g = cache.host_pools();
    let (kv, swa, states) = (
        g.kv().num_pages(),
        g.swa().unwrap().num_pages(),
        g.mamba().unwrap().num_slots(),
    );
    assert_eq!(kv, swa);
    assert!(((kv - 1) / 2).abs_diff(states - 1) <= 1, "{kv} {states}");
    let bytes = (kv * g.slot_bytes(hicache_host::HostComponent::Kv).unwrap()
        + swa * g.slot_bytes(hicache_host::HostComponent::Swa).unwrap()
        + states * g.slot_bytes(hicache_host::HostComponent::Mamba).unwrap())
        as f64;
    assert!((0.99e6..=1.02e6).contains(&bytes), "{bytes}");
    cache.shutdown().unwrap();
    cfg.hicache_size = -1.0;
    assert!(matches!(
        hybrid_common::builder(cfg, 16).build(),
        Err(HiCacheError::Config { .. })
    ));
}

/// The page hashes of the events of component `kind` (`None`: Full; else vLLM's
/// `kv_cache_spec_kind`) with `medium`, stored or removed.
fn component_hashes(
    events: &[hicache::ComponentKvEvent],
    kind: Option<&str>,
    medium: Medium,
    stored: bool,
) -> Vec<hicache_core::PageHash> {
    let of_kind: Vec<KvEvent> = events
        .iter()
        .filter(|e| e.component.map(|c| c.spec_kind()) == kind)
        .map(|e| e.event.clone())
        .collect();
    let mut h = hashes(&of_kind, medium, stored);
    h.sort();
    h
}

/// With component events on, the SWA pages and the Mamba state follow the tree through
/// insert, backup, device eviction and load-back, under the hashes of the Full pages they sit
/// on; the Full events are the same as with the option off.
#[test]
fn component_events_follow_swa_pages_and_mamba_states_and_leave_full_events_alone() {
    for (swa, mamba) in [(Some(8), None), (None, Some(8)), (Some(8), Some(8))] {
        let phases = |on: bool| {
            let cache = hybrid_common::builder(config(swa, mamba), 16)
                .kv_events(true)
                .component_events(on)
                .build()
                .unwrap();
            let mut e = Engine::new(cache);
            let a = prompt(1, 40);
            let mut out = Vec::new();
            e.turn(&a);
            out.push(e.cache.drain_component_events());
            // Another request pushes turn one out of L1; turn two loads it back.
            e.turn(&prompt(2, 40));
            out.push(e.cache.drain_component_events());
            e.turn(&extended(&a, 3, 24));
            out.push(e.cache.drain_component_events());
            e.cache.shutdown().unwrap();
            out
        };
        let (on, off) = (phases(true), phases(false));
        for (p, (on, off)) in on.iter().zip(&off).enumerate() {
            let full_on: Vec<_> = on.iter().filter(|e| e.component.is_none()).collect();
            let full_off: Vec<_> = off.iter().collect();
            assert_eq!(full_on, full_off, "phase {p}: Full events differ");
            assert!(off.iter().all(|e| e.component.is_none()));
        }
        let full_gpu = component_hashes(&on[0], None, Medium::Gpu, true);
        assert_eq!(full_gpu.len(), 10);
        for kind in ["sliding_window", "mamba"] {
            let has = if kind == "mamba" {
                mamba.is_some()
            } else {
                swa.is_some()
            };
            let stored = component_hashes(&on[0], Some(kind), Medium::Gpu, true);
            let on_host = component_hashes(&on[0], Some(kind), Medium::CpuPinned, true);
            if !has {
                assert!(stored.is_empty() && on_host.is_empty(), "{kind}");
                continue;
            }
            assert!(!stored.is_empty(), "{swa:?} {mamba:?}: {kind} stored");
            assert!(
                stored.iter().all(|h| full_gpu.contains(h)),
                "{kind}: same chain"
            );
            assert_eq!(
                on_host, stored,
                "{kind}: the backup copies what the device holds"
            );
            if kind == "mamba" {
                assert_eq!(stored.len(), 1, "one state, at the node's last page");
            }
            // Turn one leaves L1 whole: every component page it stored is removed there.
            let removed = component_hashes(&on[1], Some(kind), Medium::Gpu, false);
            assert_eq!(removed, stored, "{kind}: evicted from device");
            assert!(component_hashes(&on[1], Some(kind), Medium::CpuPinned, false).is_empty());
            // The load-back brings the component back to device from host.
            let back = component_hashes(&on[2], Some(kind), Medium::Gpu, true);
            assert!(
                stored.iter().any(|h| back.contains(h)),
                "{kind}: loaded back: {back:?}"
            );
        }
    }
}

/// The prefix's SWA pages outside the locked window are the tree's, not the request's: with
/// an SWA pool smaller than the Full pool, another request's allocation evicts (tombstones)
/// them while the request runs and takes their slots. The request's finish, handed the
/// admission's slots as they were, must neither fail on them nor free or adopt them: the
/// tree keeps its own view, nothing leaks, and the sequence is served again byte-equal.
#[test]
fn swa_prefix_pages_outside_the_window_taken_while_a_request_runs() {
    let cfg = config(Some(8), None);
    let mut e = Engine::new(
        hybrid_common::builder(cfg, 32)
            .device_pages(32, 16)
            .build()
            .unwrap(),
    );
    // Two nodes: `a` (10 pages) and its extension (4 pages), all on device with SWA.
    let a = prompt(1, 40);
    e.turn(&a);
    let a2 = extended(&a, 3, 16);
    e.turn(&a2);
    assert_eq!(e.cache.device_pool(Component::Swa).unwrap().available(), 2);

    // R1 extends `a2`: its prefix is 14 pages, the SWA window (2 pages) lies in the extension
    // node, so `a`'s SWA pages are not locked.
    let t1 = extended(&a2, 4, 8);
    let r1 = e.arrive(&t1);
    e.cache.poll().unwrap();
    let adm1 = e.cache.admit(r1, &t1).unwrap();
    assert_eq!(adm1.device_tokens, 56);
    assert_eq!(adm1.slots.swa.iter().flatten().count(), 14);
    let own1 = e
        .cache
        .alloc(HybridDemand {
            full_pages: 2,
            swa_pages: 2,
            mamba_slots: 0,
        })
        .unwrap()
        .expect("two free pages");

    // R2, unrelated, needs 6 SWA pages with none free: `a`'s SWA pages are evicted for it.
    let b = prompt(2, 24);
    let r2 = e.arrive(&b);
    e.cache.poll().unwrap();
    let adm2 = e.cache.admit(r2, &b).unwrap();
    assert_eq!(adm2.cached_tokens(), 0);
    let own2 = e
        .cache
        .alloc(HybridDemand {
            full_pages: 6,
            swa_pages: 6,
            mamba_slots: 0,
        })
        .unwrap()
        .expect("room after evicting the unlocked SWA pages");
    let taken: Vec<_> = own2.swa.iter().flatten().copied().collect();
    assert!(
        adm1.slots.swa.iter().flatten().any(|s| taken.contains(s)),
        "R2 got slots of R1's prefix outside its window"
    );

    // Both compute their pages.
    e.write_new(&t1, 14, &own1);
    e.write_new(&b, 0, &own2);

    // R1 finishes first, with its admission's slots as they were handed out.
    let mut slots1 = adm1.slots.clone();
    slots1.extend(own1);
    e.cache.cache_finished(r1, &t1, slots1).unwrap();
    let mut slots2 = adm2.slots.clone();
    slots2.extend(own2);
    e.cache.cache_finished(r2, &b, slots2).unwrap();
    e.cache.poll().unwrap();
    e.settle();

    // Served again: the whole of R1's sequence from the tree (its Full pages; SWA in the
    // window), bytes checked against what was written.
    let again = e.run(&extended(&t1, 5, 4));
    assert_eq!(again.admission.cached_tokens(), t1.len());
    e.settle();
    e.cache.shutdown().unwrap();
}

/// A request whose host hit finds no device room (another request runs and holds it) is
/// refused whole by `try_admit` — it holds nothing and counts nothing, and stays arrived —
/// instead of admitted with its hit dropped; once the running request ends it is matched
/// again and admitted with the hit, loaded back byte for byte and counted once.
fn refused_load_back_waits_and_keeps_its_hit(cfg: HybridConfig) {
    let mut e = Engine::new(cache(cfg, 16));
    let a = prompt(1, 40);
    e.turn(&a);
    e.turn(&prompt(2, 40));
    let before = e.cache.metrics();
    assert!(
        before.full.evicted_device >= 9,
        "turn one left L1: {before:?}"
    );
    // A request runs and holds 12 of the 16 device pages.
    let c = prompt(3, 48);
    let running = e.arrive(&c);
    e.cache.poll().unwrap();
    let (c_adm, c_new) = e
        .try_admit(running, &c)
        .expect("room for the running request");
    // Turn two of `a` (14 pages, its first 10 on host) does not fit beside it (SGLang's
    // budget asks one spare page more: 15 of the 16 once the running request ended).
    let a2 = extended(&a, 4, 16);
    let (device, reusable) = e.cache.reusable_tokens(&a2).unwrap();
    assert_eq!(device, 0);
    assert!(reusable >= 32, "an L2 hit: {reusable}");
    let req = e.arrive(&a2);
    e.cache.poll().unwrap();
    assert!(
        e.try_admit(req, &a2).is_none(),
        "no room for the hit and the rest"
    );
    let refused = e.cache.metrics();
    assert_eq!(refused.full.hit_tokens_l2, before.full.hit_tokens_l2);
    assert_eq!(refused.full.hit_tokens_l1, before.full.hit_tokens_l1);
    assert_eq!(
        refused.full.pages_h2d, before.full.pages_h2d,
        "nothing loaded"
    );
    assert!(
        e.cache.prefetch_ready(req).unwrap(),
        "still arrived, not admitted"
    );
    assert_eq!(
        e.cache.reusable_tokens(&a2).unwrap(),
        (0, reusable),
        "the hit stays"
    );
    e.cache.tree().check_invariants().unwrap();
    // The running request ends; once its write-through landed its pages can be evicted.
    e.complete(running, &c, c_adm, c_new);
    e.settle();
    let (adm, new) = e
        .try_admit(req, &a2)
        .expect("room once the running request ended");
    assert_eq!(adm.device_tokens, 0, "{adm:?}");
    assert_eq!(
        adm.host_tokens, reusable,
        "the whole hit, loaded back: {adm:?}"
    );
    let run = e.complete(req, &a2, adm, new);
    assert_eq!(
        run.checked[0] * PS as usize,
        reusable,
        "prefix bytes checked"
    );
    e.settle();
    let after = e.cache.metrics();
    assert_eq!(
        after.full.hit_tokens_l2 - before.full.hit_tokens_l2,
        reusable as u64,
        "the hit counted once"
    );
    e.cache.shutdown().unwrap();
}

#[test]
fn refused_load_back_waits_and_keeps_its_hit_full_swa() {
    refused_load_back_waits_and_keeps_its_hit(config(Some(8), None));
}

#[test]
fn refused_load_back_waits_and_keeps_its_hit_full_mamba() {
    refused_load_back_waits_and_keeps_its_hit(config(None, Some(8)));
}

#[test]
fn refused_load_back_waits_and_keeps_its_hit_full_swa_mamba() {
    refused_load_back_waits_and_keeps_its_hit(config(Some(8), Some(8)));
}

/// `try_admit`'s bad input: an extent shorter than the prompt, Mamba slots without Mamba, a
/// request that did not arrive or is admitted already.
#[test]
fn try_admit_refuses_bad_input_with_an_error() {
    let mut e = Engine::new(cache(config(Some(8), None), 16));
    let a = prompt(1, 40);
    let req = e.arrive(&a);
    let extent = |pages, mamba_slots| hicache::HybridExtent { pages, mamba_slots };
    let bad = |r: hicache::Result<Option<(hicache::HybridAdmission, HybridSlots)>>| {
        matches!(
            r,
            Err(HiCacheError::BadArgument(_) | HiCacheError::Request { .. })
        )
    };
    assert!(bad(e.cache.try_admit(req, &a, extent(9, 0))));
    assert!(bad(e.cache.try_admit(req, &a, extent(10, 1))));
    assert!(bad(e.cache.try_admit(99, &a, extent(10, 0))));
    assert!(bad(e.cache.try_admit(req, &[], extent(10, 0))));
    let (adm, new) = e.cache.try_admit(req, &a, extent(10, 0)).unwrap().unwrap();
    assert!(
        bad(e.cache.try_admit(req, &a, extent(10, 0))),
        "admitted already"
    );
    e.complete(req, &a, adm, new);
    e.settle();
    e.cache.shutdown().unwrap();
}

/// A running request: its id, tokens, admission and slots of the rest.
type Running = (u64, Vec<u32>, HybridAdmission, HybridSlots);

/// A cache of `config(None, Some(8))` whose 8 device states are all but one held by seven
/// running requests, with turn one of `a` on host; the running requests, `a` and the turn
/// two to admit with its host hit (its reusable tokens).
fn states_short() -> (Engine, Vec<Running>, Vec<u32>, usize) {
    states_short_with(config(None, Some(8)))
}

/// [`states_short`] with the configuration `cfg` (Mamba, no SWA).
fn states_short_with(cfg: HybridConfig) -> (Engine, Vec<Running>, Vec<u32>, usize) {
    let mut e = Engine::new(cache(cfg, 32));
    let a = prompt(1, 40);
    e.turn(&a);
    e.turn(&prompt(2, 100));
    let mut running = Vec::new();
    for k in 0..7 {
        let p = prompt(10 + k, 4);
        let req = e.arrive(&p);
        let (adm, new) = e.try_admit(req, &p).expect("room for a small request");
        running.push((req, p, adm, new));
    }
    let a2 = extended(&a, 4, 24);
    let (device, reusable) = e.cache.reusable_tokens(&a2).unwrap();
    assert_eq!(device, 0);
    assert!(reusable >= 32, "an L2 hit: {reusable}");
    (e, running, a2, reusable)
}

/// A host hit's Mamba state is loaded straight into the request's own state slot (one copy,
/// no state of the tree's beside it), so a hit takes no more states than recomputing it:
/// with one state slot left, `try_admit` admits the request with its whole hit, the state's
/// bytes in its slot, and the tree keeps that state on host only.
#[test]
fn try_admit_loads_a_host_state_into_the_request_slot() {
    let (mut e, running, a2, reusable) = states_short();
    let before = e.cache.metrics();
    let req = e.arrive(&a2);
    let (adm, new) = e
        .try_admit(req, &a2)
        .expect("room for the hit in one state");
    assert_eq!(adm.host_tokens, reusable, "the whole hit: {adm:?}");
    assert_eq!(adm.slots.mamba.len(), 1, "the request's state: {adm:?}");
    assert_eq!(
        e.cache.state_pool().unwrap().available(),
        0,
        "one state taken"
    );
    let moved = e.cache.metrics().mamba.pages_h2d - before.mamba.pages_h2d;
    assert_eq!(moved, 1, "one state loaded");
    let (device, host) = e.cache.reusable_tokens(&a2).unwrap();
    assert!(
        device < reusable,
        "the tree's state stays on host: {device}"
    );
    assert_eq!(host, reusable);
    let run = e.complete(req, &a2, adm, new);
    assert_eq!(run.checked[2], 1, "the loaded state's bytes checked");
    for (req, p, adm, new) in running {
        e.complete(req, &p, adm, new);
    }
    e.settle();
    let after = e.cache.metrics();
    assert_eq!(
        after.full.hit_tokens_l2 - before.full.hit_tokens_l2,
        reusable as u64
    );
    e.cache.shutdown().unwrap();
}

/// An admission that asks no state slot loads a host state into the tree, which takes one
/// more state than recomputing it: when only states are short, `try_admit` admits the
/// request past its device prefix and the host part is recomputed (SGLang's fallback),
/// instead of making it wait for a state slot.
#[test]
fn try_admit_without_a_state_slot_recomputes_when_states_are_short() {
    let (mut e, running, a2, _) = states_short();
    // The eighth state goes to one more running request: none is left for the tree.
    let p = prompt(20, 4);
    let last = e.arrive(&p);
    let (l_adm, l_new) = e.try_admit(last, &p).expect("the last state slot");
    let before = e.cache.metrics();
    let req = e.arrive(&a2);
    let extent = hicache::HybridExtent {
        pages: a2.len().div_ceil(PS as usize),
        mamba_slots: 0,
    };
    let (adm, new) = e
        .cache
        .try_admit(req, &a2, extent)
        .unwrap()
        .expect("room past the device prefix");
    assert_eq!(
        adm.cached_tokens(),
        0,
        "the host part is recomputed: {adm:?}"
    );
    assert_eq!(e.cache.metrics().full.pages_h2d, before.full.pages_h2d);
    e.complete(req, &a2, adm, new);
    e.complete(last, &p, l_adm, l_new);
    for (req, p, adm, new) in running {
        e.complete(req, &p, adm, new);
    }
    e.settle();
    e.cache.shutdown().unwrap();
}

/// SGLang's mode ([`MambaLoadBack::Tree`]): a host hit's state is loaded into the tree and
/// copied into the request's slot. With room for both, the whole hit is admitted, the
/// tree's state is back on device (the next match reuses the whole hit from device) and the
/// request's state holds its bytes.
#[test]
fn try_admit_in_sglangs_mode_loads_a_host_state_into_the_tree() {
    let mut cfg = config(None, Some(8));
    cfg.mamba_load_back = MambaLoadBack::Tree;
    let mut e = Engine::new(cache(cfg, 32));
    let a = prompt(1, 40);
    e.turn(&a);
    e.turn(&prompt(2, 100));
    let a2 = extended(&a, 4, 24);
    let (device, reusable) = e.cache.reusable_tokens(&a2).unwrap();
    assert_eq!(device, 0);
    assert!(reusable >= 32, "an L2 hit: {reusable}");
    let before = e.cache.metrics();
    let req = e.arrive(&a2);
    let (adm, new) = e.try_admit(req, &a2).expect("room for the hit");
    assert_eq!(adm.host_tokens, reusable, "the whole hit: {adm:?}");
    assert_eq!(
        e.cache.reusable_tokens(&a2).unwrap(),
        (reusable, reusable),
        "the tree's state is on device again"
    );
    let moved = e.cache.metrics().mamba.pages_h2d - before.mamba.pages_h2d;
    assert_eq!(moved, 1, "one state loaded");
    let run = e.complete(req, &a2, adm, new);
    assert_eq!(run.checked[2], 1, "the copied state's bytes checked");
    e.settle();
    e.cache.shutdown().unwrap();
}

/// SGLang's mode with one state slot left: the load-back needs two (the tree's and the
/// request's), so the host part is recomputed past the device prefix once the budget
/// admits it without the hit, as SGLang's `init_load_back` fallback does; the default mode
/// loads the same hit ([`try_admit_loads_a_host_state_into_the_request_slot`]).
#[test]
fn try_admit_in_sglangs_mode_recomputes_when_states_are_short() {
    let mut cfg = config(None, Some(8));
    cfg.mamba_load_back = MambaLoadBack::Tree;
    let (mut e, running, a2, _) = states_short_with(cfg);
    let before = e.cache.metrics();
    let req = e.arrive(&a2);
    let (adm, new) = e.try_admit(req, &a2).expect("room past the device prefix");
    assert_eq!(
        adm.cached_tokens(),
        0,
        "the host part is recomputed: {adm:?}"
    );
    assert_eq!(e.cache.metrics().full.pages_h2d, before.full.pages_h2d);
    assert_eq!(e.cache.metrics().mamba.pages_h2d, before.mamba.pages_h2d);
    e.complete(req, &a2, adm, new);
    for (req, p, adm, new) in running {
        e.complete(req, &p, adm, new);
    }
    e.settle();
    e.cache.shutdown().unwrap();
}
