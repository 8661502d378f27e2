//! Whole flows of the two tiering modes beside the default, on the sim device (or CUDA with
//! `HICACHE_TEST_DEVICE=cuda`), with every served page's KV bytes checked by the engine:
//!
//! - `buffer_only` host memory: L2 only stages; every host copy is released once L3 (or L1)
//!   holds the pages, and L1 misses are served from L3 through L2.
//! - exclusive (cold-L2-first) L3 writes: nothing reaches L3 at L2 admission; the coldest L2
//!   pages are written when L2 runs short, and L2 drops only pages L3 acknowledged, so L2 and
//!   L3 share only that clean band, and no page is written twice.

mod common;

use std::sync::Arc;

use common::{Engine, Faulty, prompt, small_shape, test_config, test_device, with_storage};
use hicache::{
    HiCache, HiCacheConfig, HostMemoryMode, PrefetchPolicy, StorageWriteMode, TenantId, WritePolicy,
};
use hicache_storage::{MemoryBackend, PageKey};

/// A memory backend that counts how often each key was written (`Faulty::writes`), and
/// refuses every write when `fail_sets`.
fn recorder(fail_sets: bool) -> Arc<Faulty> {
    let mut f = Faulty::new(Arc::new(MemoryBackend::with_capacity(64 << 20)));
    f.fail_all_sets = fail_sets;
    Arc::new(f)
}

/// Page size 4, a two-page prefetch threshold, wait_complete (so L3 hits are deterministic).
fn l3_config(ratio: f64) -> HiCacheConfig {
    HiCacheConfig {
        storage_prefetch_policy: PrefetchPolicy::WaitComplete,
        write_policy: WritePolicy::WriteThrough,
        storage_backend: Some("memory".into()),
        storage_backend_extra_config: Some(r#"{"prefetch_threshold": 8}"#.into()),
        hicache_ratio: ratio,
        ..test_config(4)
    }
}

/// The L3 keys of every page the tree holds a host copy of.
fn host_keys(cache: &HiCache) -> Vec<PageKey> {
    let tree = cache.tree();
    let ns = tree
        .chain_start(TenantId::DEFAULT)
        .unwrap()
        .unwrap()
        .namespace_id;
    let mut out = Vec::new();
    let mut stack = tree
        .children(tree.tenant_root(TenantId::DEFAULT).unwrap())
        .unwrap();
    while let Some(n) = stack.pop() {
        if tree.node_info(n).unwrap().backed_up {
            out.extend(
                tree.page_hashes(n)
                    .unwrap()
                    .iter()
                    .map(|h| PageKey::new(ns, *h)),
            );
        }
        stack.extend(tree.children(n).unwrap());
    }
    out
}

/// A shared 8-token system prompt, then 24 tokens of conversation `i`, then `tail` tokens.
fn chat(i: u64, tail: u64) -> Vec<u32> {
    let mut p = prompt(900, 8);
    p.extend(prompt(1000 + i, 24));
    p.extend(prompt(2000 + i * 10 + tail, 4));
    p
}

#[test]
fn buffer_only_stages_in_l2_and_serves_l1_misses_from_l3_with_exact_kv() {
    let cfg = HiCacheConfig {
        hicache_host_memory_mode: HostMemoryMode::BufferOnly,
        // A staging buffer smaller than the device pool (refused with write_through in
        // cache mode).
        hicache_ratio: 0.75,
        ..l3_config(0.75)
    };
    let rec = recorder(false);
    let mut e = Engine::new(with_storage(cfg.clone(), 24, rec.clone()));
    let host_total = e.cache.host_pool().num_pages();
    // Eight conversations of 9 pages through 24 device pages: most leave L1.
    for i in 0..8 {
        e.run(None, &chat(i, 0));
        e.settle();
        // Every page went through L2 to L3 and left L2 (the option ignored keeps them).
        assert_eq!(e.cache.tree().host_pages(), 0, "after conversation {i}");
        assert_eq!(e.cache.host_pool().available(), host_total);
    }
    let snap = e.cache.metrics().snapshot();
    assert!(snap.l2_to_l3.pages >= 8 * 7, "{snap:?}");
    assert!(
        rec.writes().values().all(|&n| n == 1),
        "a page written twice"
    );
    // The first conversations left L1 (deleted: L2 kept no copy); they come back from L3
    // through L2, the engine checks every page's bytes, and L2 is empty again afterwards.
    for i in 0..3 {
        let again = e.run(None, &chat(i, 0));
        assert!(
            again.admission.storage_pages > 0,
            "conversation {i}: {:?}",
            again.admission
        );
        assert_eq!(again.admission.cached_pages(), 9, "{:?}", again.admission);
        e.settle();
        assert_eq!(e.cache.tree().host_pages(), 0, "after reloading {i}");
    }
    let snap = e.cache.metrics().snapshot();
    assert!(snap.hit_tokens_l3 > 0 && snap.h2d.pages > 0, "{snap:?}");
    // Pages already in L3 are not staged again when a request hits them once more.
    let d2h = snap.d2h.pages;
    e.run(None, &chat(7, 0));
    e.settle();
    assert_eq!(e.cache.metrics().snapshot().d2h.pages, d2h);
    // Pages read from L3 and recomputed pages already there are not written again.
    assert!(
        rec.writes().values().all(|&n| n == 1),
        "a page written twice"
    );
    e.cache.shutdown().unwrap();
}

#[test]
fn buffer_only_and_exclusive_need_l3_and_keep_it() {
    for cfg in [
        HiCacheConfig {
            hicache_host_memory_mode: HostMemoryMode::BufferOnly,
            ..test_config(4)
        },
        HiCacheConfig {
            storage_write_mode: StorageWriteMode::Exclusive,
            ..test_config(4)
        },
    ] {
        let e = HiCache::builder(cfg.clone())
            .device(test_device())
            .shape(small_shape(4))
            .device_pages(16)
            .build()
            .unwrap_err()
            .to_string();
        let field = if cfg.hicache_host_memory_mode == HostMemoryMode::BufferOnly {
            "hicache_host_memory_mode"
        } else {
            "storage_write_mode"
        };
        assert!(e.contains(field) && e.contains("L3"), "{e}");
        let mut cache = with_storage(HiCacheConfig { ..cfg }, 16, recorder(false));
        let e = cache.detach_storage().unwrap_err().to_string();
        assert!(e.contains(field), "{e}");
        cache.shutdown().unwrap();
    }
}

#[test]
fn exclusive_writes_l3_only_from_cold_l2_pages_and_tiers_hold_different_pages() {
    let cfg = HiCacheConfig {
        storage_write_mode: StorageWriteMode::Exclusive,
        ..l3_config(2.0)
    };
    let rec = recorder(false);
    // 24 device pages, 48 host pages (headroom: 6).
    let mut e = Engine::new(with_storage(cfg.clone(), 24, rec.clone()));
    // Three conversations (about 25 pages): L2 has room, so nothing reaches L3 (at L2
    // admission the default would have written all of them).
    for i in 0..3 {
        e.run(None, &chat(i, 0));
    }
    e.settle();
    assert!(e.cache.tree().host_pages() > 0);
    assert_eq!(e.cache.metrics().snapshot().l2_to_l3.pages, 0);
    assert!(rec.writes().is_empty());
    // Ten more: L2 runs short, the coldest pages go to L3 ahead of their eviction. The
    // tiers share only that clean band (the option ignored, L3 holds a copy of all of L2).
    for i in 3..13 {
        e.run(None, &chat(i, 0));
        e.settle();
        let written = rec.writes();
        let host = host_keys(&e.cache);
        let both = host.iter().filter(|k| written.contains_key(k)).count();
        assert!(
            both * 4 <= host.len(),
            "{both} of {} L2 pages also in L3",
            host.len()
        );
    }
    let snap = e.cache.metrics().snapshot();
    assert!(snap.l2_to_l3.pages > 0, "{snap:?}");
    assert!(snap.evicted_pages_l2 > 0, "{snap:?}");
    // The first conversations are now only in L3: served from there with exact KV.
    let mut from_l3 = 0;
    for i in 0..3 {
        let again = e.run(None, &chat(i, 1));
        from_l3 += again.admission.storage_pages;
        e.settle();
    }
    assert!(from_l3 > 0);
    // More pressure: pages read back from L3 are known there and leave L2 unwritten.
    for i in 13..20 {
        e.run(None, &chat(i, 0));
        e.settle();
    }
    assert!(
        rec.writes().values().all(|&n| n == 1),
        "a page written twice"
    );
    e.cache.shutdown().unwrap();
}

#[test]
fn exclusive_keeps_l2_pages_whose_l3_write_failed() {
    let cfg = HiCacheConfig {
        storage_write_mode: StorageWriteMode::Exclusive,
        ..l3_config(2.0)
    };
    let mut e = Engine::new(with_storage(cfg.clone(), 24, recorder(true)));
    for i in 0..13 {
        e.run(None, &chat(i, 0));
        e.settle();
    }
    // Every demotion failed: no L2 page was dropped, so L2 stays full of the first pages.
    let snap = e.cache.metrics().snapshot();
    assert_eq!(snap.evicted_pages_l2, 0, "{snap:?}");
    assert_eq!(snap.l2_to_l3.pages, 0, "{snap:?}");
    let host = e.cache.tree().host_pages();
    assert!(host + 6 >= e.cache.host_pool().num_pages(), "{host}");
    // The oldest conversation still serves from L2, bytes checked.
    let again = e.run(None, &chat(0, 1));
    assert!(again.admission.cached_pages() >= 8, "{:?}", again.admission);
    e.cache.shutdown().unwrap();
}
