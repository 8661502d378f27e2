//! Scheduler inputs reach the tree: request priority (with `eviction_policy = priority` the
//! lowest-priority pages go first even when they are the most recent; LRU would evict the
//! oldest) and the admission's `mem_quota` (a load-back longer than it is not done).

mod common;

use common::{Engine, prompt, small_shape};
use hicache::{HiCache, HiCacheConfig, StrategyKind};

const PS: usize = 16;

fn engine(policy: StrategyKind) -> Engine {
    let cfg = HiCacheConfig {
        page_size: PS as u32,
        enable_hierarchical_cache: false,
        eviction_policy: policy,
        host_reserve_bytes: Some(0),
        ..Default::default()
    };
    let cache = HiCache::builder(cfg.clone())
        .shape(small_shape(cfg.page_size))
        .device_pages(8)
        .build()
        .unwrap();
    Engine::new(cache)
}

/// Caches an old high-priority prompt and a newer low-priority one, then a third that needs
/// room; returns how many pages of each of the first two are still on the device.
fn survivors(policy: StrategyKind) -> (usize, usize) {
    let mut e = engine(policy);
    let (old_high, new_low, third) = (prompt(1, 3 * PS), prompt(2, 3 * PS), prompt(3, 4 * PS));
    e.priority = 10;
    e.run(None, &old_high);
    e.priority = 0;
    e.run(None, &new_low);
    e.run(None, &third);
    e.settle();
    let on_device = |e: &mut Engine, tokens: &[u32], req| {
        let a = e.cache.arrive(req, tokens).unwrap();
        e.cache.abort(req).unwrap();
        a.device_pages
    };
    let high = on_device(&mut e, &old_high, 100);
    let low = on_device(&mut e, &new_low, 101);
    (high, low)
}

#[test]
fn priority_policy_keeps_the_high_priority_pages() {
    assert_eq!(survivors(StrategyKind::Priority), (3, 0));
}

#[test]
fn lru_evicts_the_oldest_whatever_the_priority() {
    assert_eq!(survivors(StrategyKind::Lru), (0, 3));
}

#[test]
fn priority_of_an_unknown_request_is_an_error() {
    let mut e = engine(StrategyKind::Priority);
    let err = e.cache.set_priority(42, 1).unwrap_err();
    assert!(err.to_string().contains("42"), "{err}");
}

/// The load-back of a host-resident prefix respects the scheduler's `mem_quota`.
#[test]
fn admission_quota_bounds_the_load_back() {
    let cfg = HiCacheConfig {
        page_size: PS as u32,
        host_reserve_bytes: Some(0),
        ..Default::default()
    };
    let cache = HiCache::builder(cfg.clone())
        .shape(small_shape(cfg.page_size))
        .device_pages(16)
        .build()
        .unwrap();
    let mut e = Engine::new(cache);
    let p = prompt(9, 6 * PS);
    e.run(None, &p);
    e.settle();
    assert_eq!(
        e.cache.evict(16).unwrap(),
        6,
        "L1 emptied, L2 keeps the prompt"
    );
    let admit = |e: &mut Engine, req, quota| {
        e.cache.arrive(req, &p).unwrap();
        e.cache.poll().unwrap();
        let a = e.cache.admit_with_quota(req, &p, quota).unwrap();
        let loaded = a.host_pages;
        if let Some(producer) = e.cache.start_loading().unwrap() {
            let counter = e.cache.layer_done_counter().clone();
            counter.set_consumer(producer).unwrap();
            for layer in 0..e.cache.shape().layers as usize {
                counter.wait_until(layer).unwrap();
            }
        }
        e.cache.abort(req).unwrap();
        e.settle();
        loaded
    };
    assert_eq!(
        admit(&mut e, 50, Some(5)),
        0,
        "6 pages do not fit a quota of 5"
    );
    assert_eq!(admit(&mut e, 51, Some(6)), 6);
}
