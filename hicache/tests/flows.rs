//! Whole request flows on the sim device (or CUDA with `HICACHE_TEST_DEVICE=cuda`): L1, L2 and
//! L3 hits with KV contents checked, every write policy × prefetch policy, slow and failing
//! backends, small host pools, bad input.

mod common;

use std::sync::Arc;

use common::{
    Engine, Faulty, assert_no_pins, prompt, small_shape, test_config, test_device, with_storage,
};
use hicache::{
    DeviceSlot, HiCache, HiCacheConfig, HiCacheError, IoBackendKind, LayoutKind, PrefetchPolicy,
    StorageConfig, WritePolicy,
};
use hicache_storage::{MemoryBackend, Storage};

fn cache(cfg: HiCacheConfig, device_pages: usize) -> HiCache {
    HiCache::builder(cfg.clone())
        .device(test_device())
        .shape(small_shape(cfg.page_size))
        .device_pages(device_pages)
        .build()
        .unwrap()
}

fn l3_config(policy: PrefetchPolicy, write: WritePolicy, ps: u32) -> HiCacheConfig {
    HiCacheConfig {
        storage_prefetch_policy: policy,
        write_policy: write,
        storage_backend: Some("memory".into()),
        // A threshold of two pages so small prompts still prefetch.
        storage_backend_extra_config: Some(format!(r#"{{"prefetch_threshold": {}}}"#, 2 * ps)),
        hicache_ratio: 2.0,
        ..test_config(ps)
    }
}

#[test]
fn l1_hit_serves_the_whole_prompt() {
    let mut e = Engine::new(cache(test_config(4), 64));
    let p = prompt(1, 40);
    let first = e.run(None, &p);
    assert_eq!(first.admission.cached_pages(), 0);
    let second = e.run(None, &p);
    assert_eq!(second.admission.device_pages, 10);
    assert_eq!(second.admission.host_pages, 0);
    // A longer prompt sharing the prefix hits the shared pages only.
    let mut longer = p.clone();
    longer.extend(prompt(2, 12));
    let third = e.run(None, &longer);
    assert_eq!(third.admission.device_pages, 10);
    e.settle();
}

#[test]
fn an_admission_has_room_for_the_slots_of_the_whole_prompt() {
    let mut e = Engine::new(cache(test_config(4), 64));
    let p = prompt(3, 40);
    e.run(None, &p);
    // 10 cached pages, then 3 pages and a partial one of new tokens: the engine appends its
    // 4 fresh slots to the prefix without the vector growing.
    let mut longer = p.clone();
    longer.extend(prompt(4, 14));
    e.cache.arrive(7, &longer).unwrap();
    let adm = e.cache.admit(7, &longer).unwrap();
    assert_eq!(adm.device_pages, 10);
    assert!(adm.prefix_slots.capacity() >= longer.len().div_ceil(4));
    let mut slots = adm.prefix_slots;
    let fresh = e.cache.alloc_device(4).unwrap().unwrap();
    let before = slots.as_ptr();
    slots.extend(fresh);
    assert_eq!(slots.as_ptr(), before, "the admission's vector grew");
    e.cache.cache_finished(7, &longer, &slots).unwrap();
    e.settle();
}

#[test]
fn l2_hit_after_l1_eviction_loads_back_with_layer_waits() {
    // 12 device pages: a second 8-page prompt forces the first out of L1 (to L2, as
    // write-through backed it up).
    let mut e = Engine::new(cache(test_config(4), 12));
    let a = prompt(10, 32);
    let b = prompt(11, 32);
    e.run(None, &a);
    e.settle();
    e.run(None, &b);
    e.settle();
    let again = e.run(None, &a);
    assert_eq!(again.admission.device_pages + again.admission.host_pages, 8);
    assert!(again.admission.host_pages > 0, "{:?}", again.admission);
    let snap = e.cache.metrics().snapshot();
    assert!(snap.h2d.pages >= again.admission.host_pages as u64);
    assert!(snap.d2h.pages >= 16);
    e.settle();
}

#[test]
fn page_first_with_direct_io_runs_as_page_first_direct() {
    // SGLang's pairing: `page_first` rows are strided per token, so the direct io backend
    // takes the layout whose (page, layer) runs are contiguous. KV stays exact through a
    // backup and a load-back on the resolved layout (the engine checks every page it reads).
    let cfg = HiCacheConfig {
        io_backend: IoBackendKind::Direct,
        mem_layout: LayoutKind::PageFirst,
        ..test_config(4)
    };
    let mut e = Engine::new(cache(cfg, 12));
    assert_eq!(e.cache.config().mem_layout, LayoutKind::PageFirstDirect);
    assert_eq!(e.cache.config().io_backend, IoBackendKind::Direct);
    let a = prompt(20, 32);
    e.run(None, &a);
    e.settle();
    e.run(None, &prompt(21, 32));
    e.settle();
    let again = e.run(None, &a);
    assert!(again.admission.host_pages > 0, "{:?}", again.admission);
    e.settle();
}

// SGLang's L3 acceptance flow (768 tokens, flush, >700 served from L3) runs on every compiled
// backend in tests/backends.rs.

#[test]
fn every_write_policy_with_every_prefetch_policy_keeps_kv_exact() {
    for write in [
        WritePolicy::WriteThrough,
        WritePolicy::WriteThroughSelective,
        WritePolicy::WriteBack,
    ] {
        for policy in [
            PrefetchPolicy::BestEffort,
            PrefetchPolicy::WaitComplete,
            PrefetchPolicy::Timeout,
        ] {
            let storage: Arc<dyn Storage> = Arc::new(MemoryBackend::with_capacity(64 << 20));
            let mut e = Engine::new(with_storage(l3_config(policy, write, 4), 24, storage));
            let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(100 + i, 28)).collect();
            // Shared system prompt + suffixes, several rounds, small device pool: every tier
            // gets used.
            for round in 0..3 {
                for p in &prompts {
                    let mut full = prompts[0][..8].to_vec();
                    full.extend_from_slice(p);
                    full.extend(prompt(round, 4));
                    e.run(None, &full);
                }
            }
            e.settle();
            e.cache.flush().unwrap();
            for p in &prompts {
                let mut full = prompts[0][..8].to_vec();
                full.extend_from_slice(p);
                e.run(None, &full);
            }
            e.settle();
            let snap = e.cache.metrics().snapshot();
            // Under write_through every page reached L3 before the flush; the other policies
            // only back up pages hit twice or evicted, so the leading pages may be missing.
            if write == WritePolicy::WriteThrough && policy == PrefetchPolicy::WaitComplete {
                assert!(snap.hit_tokens_l3 > 0, "{write:?}/{policy:?}: {snap:?}");
            }
            e.cache.shutdown().unwrap();
        }
    }
}

#[test]
fn slow_backend_with_timeout_policy_cuts_prefetches_and_stays_exact() {
    let mem: Arc<dyn Storage> = Arc::new(MemoryBackend::with_capacity(64 << 20));
    let faulty = Arc::new(Faulty::new(mem.clone()));
    let mut cfg = l3_config(PrefetchPolicy::Timeout, WritePolicy::WriteThrough, 4);
    cfg.storage_backend_extra_config = Some(
        r#"{"prefetch_threshold": 8, "prefetch_timeout_base": 0.05, "prefetch_timeout_per_ki_token": 0, "prefetch_timeout_max": 0.05}"#
            .into(),
    );
    let mut e = Engine::new(with_storage(cfg, 64, faulty.clone()));
    let p = prompt(7, 64);
    e.run(None, &p);
    e.settle();
    e.cache.flush().unwrap();
    // Reads now hang: only the timeout can end the prefetch, with nothing fetched.
    faulty
        .gate
        .store(false, std::sync::atomic::Ordering::Release);
    let again = e.run(None, &p);
    assert_eq!(again.admission.storage_pages, 0, "{:?}", again.admission);
    assert_eq!(again.admission.cached_pages(), 0);
    let snap = e.cache.metrics().snapshot();
    assert_eq!(snap.prefetch_completed, 0);
    assert_eq!(snap.prefetch_partial, 1);
    // The hung read returns later; its pages come back to the pool.
    faulty
        .gate
        .store(true, std::sync::atomic::Ordering::Release);
    e.settle();
    let third = e.run(None, &p);
    assert_eq!(third.admission.device_pages, 16);
    e.cache.shutdown().unwrap();
    assert_eq!(
        e.cache.host_pool().available(),
        e.cache.host_pool().num_pages() - e.cache.tree().host_pages()
    );
}

#[test]
fn failing_and_corrupting_backends_degrade_to_recompute() {
    for (fail_every, corrupt_every, fail_all) in [(5, 0, false), (0, 3, false), (0, 0, true)] {
        let mem: Arc<dyn Storage> = Arc::new(MemoryBackend::with_capacity(64 << 20));
        let mut faulty = Faulty::new(mem);
        faulty.fail_every = fail_every;
        faulty.corrupt_every = corrupt_every;
        faulty.fail_all_gets = fail_all;
        let cfg = l3_config(PrefetchPolicy::WaitComplete, WritePolicy::WriteThrough, 4);
        let mut e = Engine::new(with_storage(cfg, 64, Arc::new(faulty)));
        let p = prompt(9, 64);
        e.run(None, &p);
        e.settle();
        e.cache.flush().unwrap();
        // Engine::run checks every served page; anything past the first bad page is
        // recomputed.
        let again = e.run(None, &p);
        assert!(again.admission.storage_pages < 16, "{:?}", again.admission);
        // Failed reads are counted as L3 pages lost to errors, never as quiet misses; a
        // corrupt copy is a miss (the backend counts it).
        let snap = e.cache.metrics().snapshot();
        if fail_every > 0 || fail_all {
            assert!(snap.l3_read_failures > 0, "{snap:?}");
        } else {
            assert_eq!(snap.l3_read_failures, 0, "{snap:?}");
        }
        assert_eq!(snap.l3_write_failures, 0, "{snap:?}");
        e.run(None, &p);
        e.settle();
        e.cache.shutdown().unwrap();
    }
}

/// A backend that stores nothing: every page a backup sent is counted as lost, none as moved
/// to L3, and the next run of the prompt finds nothing in L3 (issue 28 item 7: writes that
/// failed must not read as data moved).
#[test]
fn failed_l3_writes_are_counted_not_moved() {
    let mem: Arc<dyn Storage> = Arc::new(MemoryBackend::with_capacity(64 << 20));
    let mut faulty = Faulty::new(mem);
    faulty.fail_all_sets = true;
    let cfg = l3_config(PrefetchPolicy::WaitComplete, WritePolicy::WriteThrough, 4);
    let mut e = Engine::new(with_storage(cfg, 64, Arc::new(faulty)));
    let p = prompt(11, 64);
    e.run(None, &p);
    e.settle();
    e.cache.flush().unwrap();
    let snap = e.cache.metrics().snapshot();
    assert_eq!(snap.l2_to_l3.pages, 0, "{snap:?}");
    assert_eq!(snap.l2_to_l3.bytes, 0, "{snap:?}");
    assert_eq!(snap.l3_write_failures, 16, "{snap:?}");
    let again = e.run(None, &p);
    assert_eq!(again.admission.storage_pages, 0, "{:?}", again.admission);
    let text = e.cache.metrics().render();
    assert!(
        text.contains("hicache_l3_failed_pages_total{op=\"write\"} 16"),
        "{text}"
    );
    e.cache.shutdown().unwrap();
}

#[test]
fn host_pool_smaller_than_device_pool() {
    let cfg = HiCacheConfig {
        hicache_ratio: 0.5,
        write_policy: WritePolicy::WriteThroughSelective,
        ..test_config(4)
    };
    let mut e = Engine::new(cache(cfg, 32));
    assert!(e.cache.host_pool().num_pages() < 32);
    for round in 0..4 {
        for i in 0..5 {
            let mut p = prompt(i, 24);
            p.extend(prompt(1000 + round, 4));
            e.run(None, &p);
        }
    }
    e.settle();
}

#[test]
fn write_back_stages_on_eviction_and_serves_from_host() {
    let cfg = HiCacheConfig {
        write_policy: WritePolicy::WriteBack,
        ..test_config(4)
    };
    let mut e = Engine::new(cache(cfg, 12));
    let a = prompt(20, 32);
    let b = prompt(21, 32);
    e.run(None, &a);
    assert_eq!(
        e.cache.tree().host_pages(),
        0,
        "write_back writes nothing on insert"
    );
    e.run(None, &b);
    assert!(
        e.cache.tree().host_pages() > 0,
        "eviction staged pages to host"
    );
    let again = e.run(None, &a);
    assert!(again.admission.host_pages > 0);
    e.settle();
}

#[test]
fn write_back_with_a_full_host_drops_and_counts() {
    let cfg = HiCacheConfig {
        write_policy: WritePolicy::WriteBack,
        hicache_ratio: 0.3,
        ..test_config(4)
    };
    let mut e = Engine::new(cache(cfg, 16));
    for i in 0..6 {
        e.run(None, &prompt(30 + i, 32));
    }
    let snap = e.cache.metrics().snapshot();
    assert!(snap.dropped_tokens > 0, "{snap:?}");
    e.settle();
}

#[test]
fn tenants_never_share_pages() {
    let storage: Arc<dyn Storage> = Arc::new(MemoryBackend::with_capacity(64 << 20));
    let cfg = l3_config(PrefetchPolicy::WaitComplete, WritePolicy::WriteThrough, 4);
    let mut e = Engine::new(with_storage(cfg, 64, storage));
    let a = e.cache.tenant(Some("lora-a"), None).unwrap();
    let b = e.cache.tenant(Some("lora-b"), None).unwrap();
    let p = prompt(3, 32);
    e.salt = 1;
    e.run(Some(a), &p);
    e.settle();
    e.salt = 2;
    let other = e.run(Some(b), &p);
    assert_eq!(other.admission.cached_pages(), 0);
    e.settle();
    e.cache.flush().unwrap();
    // L3 keeps tenants apart too.
    let again_b = e.run(Some(b), &p);
    assert_eq!(again_b.admission.storage_pages, 8);
    e.salt = 1;
    let again_a = e.run(Some(a), &p);
    assert_eq!(again_a.admission.storage_pages, 8);
    e.settle();
}

#[test]
fn chunked_prefill_moves_the_lock_and_frees_duplicates() {
    let mut e = Engine::new(cache(test_config(4), 64));
    let p = prompt(5, 40);
    e.run(None, &p);
    let before = e.cache.device_pages_free();
    e.cache.arrive(100, &p).unwrap();
    let adm = e.cache.admit(100, &p[..16]).unwrap();
    assert_eq!(adm.device_pages, 4);
    // The engine recomputed pages 4..8 itself (e.g. it did not use the hit).
    let own = e.cache.alloc_device(4).unwrap().unwrap();
    let mut slots = adm.prefix_slots.clone();
    slots.extend(&own);
    let now = e.cache.cache_unfinished(100, &p[..32], &slots).unwrap();
    // Pages 4..8 were already cached: the engine's copies were freed, the tree's returned.
    assert_eq!(now.len(), 8);
    assert_eq!(e.cache.device_pages_free(), before);
    e.check_pages(&p, &now);
    e.cache.abort(100).unwrap();
    e.settle();
}

#[test]
fn attach_detach_at_run_time() {
    let mut e = Engine::new(cache(test_config(4), 64));
    assert!(e.cache.storage_backend().is_none());
    e.cache.detach_storage().unwrap(); // idempotent without a backend
    let mut sc =
        StorageConfig::parse(Some("memory"), Some(r#"{"prefetch_threshold": 8}"#)).unwrap();
    e.cache.attach_storage(sc.clone()).unwrap();
    assert_eq!(e.cache.storage_backend().as_deref(), Some("memory"));
    // Same backend again: only the policy fields change.
    sc.common.prefetch_threshold = 12;
    e.cache.attach_storage(sc).unwrap();
    let other = StorageConfig::parse(Some("file"), Some(r#"{"dir": "/nonexistent"}"#)).unwrap();
    assert!(matches!(
        e.cache.attach_storage(other),
        Err(HiCacheError::NotIdle(_))
    ));
    let p = prompt(77, 32);
    e.run(None, &p);
    e.cache.arrive(500, &p).unwrap();
    assert!(matches!(
        e.cache.attach_storage_instance(
            StorageConfig::new("memory"),
            Arc::new(MemoryBackend::with_capacity(1 << 20))
        ),
        Err(HiCacheError::NotIdle(_))
    ));
    e.cache.abort(500).unwrap();
    e.cache.detach_storage().unwrap();
    e.cache.detach_storage().unwrap();
    assert!(e.cache.storage_backend().is_none());
    e.run(None, &p);
    e.settle();
}

#[test]
fn shutdown_drains_backups_so_nothing_acknowledged_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = HiCacheConfig {
        storage_backend: Some("file".into()),
        storage_backend_extra_config: Some(format!(r#"{{"dir": "{}"}}"#, dir.path().display())),
        ..test_config(4)
    };
    let p = prompt(55, 48);
    {
        let mut e = Engine::new(cache(cfg.clone(), 64));
        e.run(None, &p);
        // No settle: the write and its L3 backup may be in flight.
        e.cache.shutdown().unwrap();
        assert!(matches!(e.cache.poll(), Err(HiCacheError::Closed)));
        assert!(matches!(e.cache.shutdown(), Err(HiCacheError::Closed)));
    }
    // A new instance on the same directory finds every page (L1 and L2 start empty).
    let mut e = Engine::new(cache(
        HiCacheConfig {
            storage_prefetch_policy: PrefetchPolicy::WaitComplete,
            storage_backend_extra_config: Some(format!(
                r#"{{"dir": "{}", "prefetch_threshold": 8}}"#,
                dir.path().display()
            )),
            ..cfg
        },
        64,
    ));
    let again = e.run(None, &p);
    assert_eq!(again.admission.storage_pages, 12);
    e.cache.shutdown().unwrap();
}

#[test]
fn bad_calls_are_errors_and_leave_no_pins() {
    let mut e = Engine::new(cache(test_config(4), 32));
    let p = prompt(1, 16);
    assert!(matches!(
        e.cache.arrive(1, &[]),
        Err(HiCacheError::Request { .. })
    ));
    e.cache.arrive(1, &p).unwrap();
    assert!(matches!(
        e.cache.arrive(1, &p),
        Err(HiCacheError::Request { .. })
    ));
    assert!(matches!(
        e.cache.cache_finished(1, &p, &[]),
        Err(HiCacheError::Request { .. })
    ));
    let adm = e.cache.admit(1, &p).unwrap();
    assert!(e.cache.admit(1, &p).is_err());
    let slots = e.cache.alloc_device(4).unwrap().unwrap();
    // Wrong slot count.
    assert!(e.cache.cache_finished(1, &p, &slots[..3]).is_err());
    let mut all = adm.prefix_slots.clone();
    all.extend(&slots);
    e.cache.cache_finished(1, &p, &all).unwrap();
    // Finishing twice.
    assert!(matches!(
        e.cache.cache_finished(1, &p, &all),
        Err(HiCacheError::Request { .. })
    ));
    assert!(e.cache.abort(99).is_err());
    assert!(e.cache.prefetch_ready(99).is_err());
    // Unaligned prompts are truncated to whole pages; the tail is the engine's.
    let mut odd = prompt(2, 18);
    e.cache.arrive(2, &odd).unwrap();
    let adm = e.cache.admit(2, &odd).unwrap();
    assert_eq!(adm.cached_pages(), 0);
    let fresh = e.cache.alloc_device(5).unwrap().unwrap();
    e.cache.cache_finished(2, &odd, &fresh).unwrap();
    odd.truncate(16);
    let m = e.cache.arrive(3, &odd).unwrap();
    assert_eq!(m.device_pages, 4);
    e.cache.abort(3).unwrap();
    e.settle();
    assert_no_pins(&e.cache);
    e.cache.shutdown().unwrap();
    assert!(matches!(e.cache.arrive(4, &p), Err(HiCacheError::Closed)));
}

#[test]
fn contradictory_config_and_unknown_backends_are_clear_errors() {
    let build = |cfg: HiCacheConfig| {
        HiCache::builder(cfg.clone())
            .shape(small_shape(cfg.page_size))
            .device_pages(16)
            .build()
    };
    let e = build(HiCacheConfig {
        hicache_ratio: 0.5,
        ..test_config(4)
    })
    .unwrap_err();
    assert!(e.to_string().contains("hicache_ratio"), "{e}");
    let e = build(HiCacheConfig {
        storage_backend: Some("nosuch".into()),
        ..test_config(4)
    })
    .unwrap_err();
    assert!(e.to_string().contains("nosuch"), "{e}");
    let e = build(HiCacheConfig {
        storage_backend: Some("file".into()),
        storage_backend_extra_config: Some("{not json".into()),
        ..test_config(4)
    })
    .unwrap_err();
    assert!(e.to_string().contains("extra"), "{e}");
    let e = HiCache::builder(test_config(4))
        .shape(small_shape(8))
        .device_pages(16)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("page_size"), "{e}");
    let e = HiCache::builder(test_config(4))
        .device_pages(16)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("shape"), "{e}");
}

/// Five load-back batches launched without a poll in between, the second to fourth held on
/// the load stream: the fifth reuses the ring slot of the second and must wait for it, not
/// fail (and leak its nodes' pins). Holding the load stream needs the sim device's gate, so
/// this test runs on the sim device whatever `HICACHE_TEST_DEVICE` says.
#[test]
fn more_loads_in_flight_than_the_layer_ring_without_polls() {
    let cfg = test_config(4);
    let sim = HiCache::builder(cfg.clone())
        .device(hicache::Device::sim())
        .shape(small_shape(cfg.page_size))
        .device_pages(64)
        .build()
        .unwrap();
    let mut e = Engine::new(sim);
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(300 + i, 16)).collect();
    for p in &prompts {
        e.run(None, p);
    }
    e.settle();
    e.cache.evict(64).unwrap();
    assert_eq!(e.cache.tree().device_pages(), 0);
    let counter = e.cache.layer_done_counter().clone();
    let layers = e.cache.shape().layers as usize;
    let mut admitted: Vec<(u64, usize, hicache::Admission)> = Vec::new();
    let mut gate = None;
    for (i, p) in prompts.iter().enumerate() {
        let req = 1000 + i as u64;
        e.cache.arrive(req, p).unwrap();
        let adm = e.cache.admit(req, p).unwrap();
        assert_eq!(adm.host_pages, 4, "{adm:?}");
        let producer = if i == 4 {
            let g: hicache_gpu::SimGate = gate.take().unwrap();
            start_loading_behind_the_gate(&mut e.cache, &counter, admitted[1].1, layers, g)
        } else {
            e.cache.start_loading().unwrap().expect("a load")
        };
        if i == 0 {
            counter.set_consumer(producer).unwrap();
            for l in 0..layers {
                counter.wait_until(l).unwrap();
            }
            gate = Some(e.cache.transfer_engine().load_stream().sim_gate().unwrap());
        }
        admitted.push((req, producer, adm));
    }
    let (_, last, _) = admitted.last().unwrap();
    counter.set_consumer(*last).unwrap();
    for l in 0..layers {
        counter.wait_until(l).unwrap();
    }
    for ((req, _, adm), p) in admitted.iter().zip(&prompts) {
        e.check_pages(p, &adm.prefix_slots);
        e.cache.abort(*req).unwrap();
    }
    e.settle();
}

/// Calls `start_loading` on another thread while `gate` holds the load stream and checks
/// that it waits: while the gate is closed the load in ring slot `held` (the one the new
/// load reuses) has not arrived and `start_loading` has not returned; once the gate opens it
/// returns the new load, in that slot. Returns the new load's producer id.
fn start_loading_behind_the_gate(
    cache: &mut HiCache,
    counter: &hicache_gpu::LayerDoneCounter,
    held: usize,
    layers: usize,
    gate: hicache_gpu::SimGate,
) -> usize {
    std::thread::scope(|s| {
        let loading = s.spawn(|| cache.start_loading());
        counter.set_consumer(held).unwrap();
        // Nothing on the held stream can complete before the gate opens, however long the
        // other thread runs: each check below holds whatever the scheduling.
        for _ in 0..1000 {
            assert!(
                !counter.is_ready(layers - 1).unwrap(),
                "a load behind the closed gate arrived"
            );
            assert!(
                !loading.is_finished(),
                "start_loading returned while the load whose ring slot it reuses was held"
            );
            std::thread::yield_now();
        }
        gate.open();
        let producer = loading
            .join()
            .expect("start_loading panicked")
            .unwrap()
            .expect("a load");
        assert_eq!(
            producer, held,
            "the new load reuses the held load's ring slot"
        );
        producer
    })
}

#[test]
fn write_through_backs_up_a_node_split_before_the_next_poll() {
    // A node due for write-through is split (by a match of a shorter prompt) before the poll
    // that launches its backup: both halves must still be backed up.
    let mut e = Engine::new(cache(test_config(4), 64));
    let p = prompt(400, 32);
    e.cache.arrive(1, &p).unwrap();
    e.cache.admit(1, &p).unwrap();
    let slots = e.cache.alloc_device(8).unwrap().unwrap();
    for (i, &s) in slots.iter().enumerate() {
        let data = common::page_pattern(&p, i, 4, e.cache.shape().page_bytes(), 0);
        e.cache.device_pool().write_page(s, &data).unwrap();
    }
    e.cache.cache_finished(1, &p, &slots).unwrap();
    e.cache.arrive(2, &p[..16]).unwrap();
    e.cache.abort(2).unwrap();
    e.settle();
    assert_eq!(e.cache.tree().host_pages(), 8);
    // Evicted from device, the whole prompt is served from host.
    e.cache.evict(64).unwrap();
    let again = e.run(None, &p);
    assert_eq!(again.admission.host_pages, 8, "{:?}", again.admission);
    e.settle();
}

#[test]
fn slots_the_request_does_not_own_are_refused_before_the_tree_changes() {
    let mut e = Engine::new(cache(test_config(4), 16));
    let p = prompt(1, 18);
    e.cache.arrive(1, &p).unwrap();
    let adm = e.cache.admit(1, &p).unwrap();
    assert_eq!(adm.cached_pages(), 0);
    let own = e.cache.alloc_device(5).unwrap().unwrap();
    let never_allocated = (0..16u32)
        .map(DeviceSlot)
        .find(|s| !own.contains(s))
        .unwrap();
    // Out of range, never allocated, given twice (also for the partial page).
    for bad in [
        vec![DeviceSlot(9999), own[1], own[2], own[3], own[4]],
        vec![own[0], never_allocated, own[2], own[3], own[4]],
        vec![own[0], own[0], own[2], own[3], own[4]],
        vec![own[0], own[1], own[2], own[3], own[3]],
    ] {
        assert!(matches!(
            e.cache.cache_unfinished(1, &p, &bad),
            Err(HiCacheError::Request { .. })
        ));
        assert!(matches!(
            e.cache.cache_finished(1, &p, &bad),
            Err(HiCacheError::Request { .. })
        ));
        assert_eq!(e.cache.tree().device_pages(), 0);
    }
    assert_eq!(e.cache.device_pages_free(), 11);
    e.cache.cache_finished(1, &p, &own).unwrap();
    assert_eq!(e.cache.tree().device_pages(), 4);
    assert_eq!(e.cache.evict(16).unwrap(), 4);
    e.settle();
    assert_eq!(e.cache.device_pages_free(), 16);
}

#[test]
fn without_the_hierarchical_cache_it_is_a_plain_radix_cache() {
    let cfg = HiCacheConfig {
        enable_hierarchical_cache: false,
        ..test_config(4)
    };
    let mut e = Engine::new(cache(cfg, 12));
    let a = prompt(60, 32);
    let b = prompt(61, 32);
    e.run(None, &a);
    e.run(None, &b);
    assert_eq!(e.cache.tree().host_pages(), 0);
    // `a` was evicted from L1 and nothing else holds it: recomputed.
    let again = e.run(None, &a);
    assert_eq!(again.admission.host_pages, 0);
    assert!(again.admission.device_pages < 8);
    assert_eq!(e.cache.metrics().snapshot().d2h.pages, 0);
    e.settle();
}

#[test]
fn unadmit_releases_the_prefix_and_keeps_the_request() {
    let mut e = Engine::new(cache(test_config(4), 32));
    let p = prompt(62, 32);
    e.run(None, &p);
    e.settle(); // the write-through of `p` holds its pages until the D2H ack
    e.cache.arrive(9, &p).unwrap();
    let adm = e.cache.admit(9, &p).unwrap();
    assert_eq!(adm.device_pages, 8);
    assert!(e.cache.tree().protected_pages() > 0);
    e.cache.unadmit(9).unwrap();
    assert_eq!(e.cache.tree().protected_pages(), 0);
    assert!(e.cache.unadmit(9).is_err());
    let again = e.cache.admit(9, &p).unwrap();
    assert_eq!(again.prefix_slots, adm.prefix_slots);
    e.cache.abort(9).unwrap();
    // The undone admission is not counted: two admitted prompts of 32 tokens.
    let snap = e.cache.metrics().snapshot();
    assert_eq!(snap.request_tokens, 64);
    assert_eq!(snap.hit_tokens_l1, 32);
    e.settle();
}

/// Issue 18: `clear_storage` removes from L3 every page of this cache's namespaces (each
/// tenant's) and nothing else; afterwards the prompts miss L3. Without a backend, or with one
/// that cannot clear, it is an error naming why.
#[test]
fn clear_storage_removes_this_cache_s_pages_only() {
    use hicache_storage::pattern::{namespace, page_bytes, page_key};
    use hicache_storage::{LayoutKind, StorageExt};
    let memory = Arc::new(MemoryBackend::with_capacity(64 << 20));
    let foreign = page_key(namespace(77), 1, 1);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(memory.put(LayoutKind::PageFirst, foreign, &page_bytes(&foreign, 4096)))
        .unwrap();
    let storage: Arc<dyn Storage> = memory.clone();
    let cfg = l3_config(PrefetchPolicy::WaitComplete, WritePolicy::WriteThrough, 4);
    let mut e = Engine::new(with_storage(cfg.clone(), 64, storage));
    let a = e.cache.tenant(Some("lora-a"), None).unwrap();
    let p = prompt(3, 32);
    e.run(Some(a), &p);
    e.run(None, &p);
    e.settle();
    assert_eq!(e.cache.storage_namespaces().len(), 2);
    assert_eq!(
        memory.stats().pages,
        17,
        "8 pages per tenant and the foreign one"
    );
    assert_eq!(e.cache.clear_storage().unwrap(), 16);
    assert_eq!(memory.stats().pages, 1);
    let still = rt.block_on(memory.batch_exists(&[foreign])).unwrap();
    assert_eq!(still, 1, "another namespace's page survives");
    e.cache.flush().unwrap();
    assert_eq!(e.run(Some(a), &p).admission.storage_pages, 0);
    assert_eq!(e.run(None, &p).admission.storage_pages, 0);
    e.settle();
    // A backend without the capability: an error that names it, nothing removed.
    let faulty: Arc<dyn Storage> = Arc::new(Faulty::new(memory.clone()));
    let mut e = Engine::new(with_storage(cfg, 64, faulty));
    let err = e.cache.clear_storage().unwrap_err().to_string();
    assert!(
        err.contains("clear") && err.contains("not supported"),
        "{err}"
    );
    // No backend at all.
    let mut c = cache(test_config(4), 16);
    let err = c.clear_storage().unwrap_err().to_string();
    assert!(err.contains("no L3 storage backend"), "{err}");
}
