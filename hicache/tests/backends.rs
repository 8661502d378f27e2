//! SGLang's L3 acceptance flow on every L3 backend compiled into this build, named in the
//! configuration as an operator would: a 768-token prompt is cached, L1 and L2 are flushed, and
//! the same prompt again is served from L3 (more than 700 tokens), KV bytes checked.

mod common;

use common::{Engine, prompt, small_shape};
use hicache::{HiCache, HiCacheConfig, PrefetchPolicy};

/// Runs the flow with `backend` configured by `extra` (a JSON object's fields, without braces).
fn l3_round_trip(backend: &str, extra: &str) {
    let cfg = HiCacheConfig {
        page_size: 64,
        hicache_ratio: 1.2,
        storage_backend: Some(backend.into()),
        storage_backend_extra_config: Some(format!(r#"{{{extra}"prefetch_threshold": 256}}"#)),
        storage_prefetch_policy: PrefetchPolicy::WaitComplete,
        host_reserve_bytes: Some(0),
        ..Default::default()
    };
    let cache = HiCache::builder(cfg.clone())
        .shape(small_shape(cfg.page_size))
        .device_pages(40)
        .build()
        .unwrap_or_else(|e| panic!("{backend}: {e}"));
    let mut e = Engine::new(cache);
    let p = prompt(42, 768 + 30);
    e.run(None, &p);
    e.settle();
    e.cache.flush().unwrap();
    assert_eq!(e.cache.tree().device_pages(), 0);
    assert_eq!(e.cache.tree().host_pages(), 0);
    // `run` checks every admitted page's KV bytes against what was written.
    let again = e.run(None, &p);
    let served = again.admission.cached_pages() * 64;
    // On failure, say what L3 reported (a write refused for disk space shows here).
    assert!(
        served > 700,
        "{backend}: only {served} tokens served: {again:?}; metrics: {:?}",
        e.cache.metrics().snapshot()
    );
    assert_eq!(again.admission.storage_pages, 12, "{backend}");
    let snap = e.cache.metrics().snapshot();
    assert_eq!(snap.l3_to_l2.pages, 12, "{backend}");
    assert_eq!(snap.prefetch_completed, 1, "{backend}");
    e.settle();
    e.cache.shutdown().unwrap();
}

#[test]
fn memory_backend_serves_the_prompt_from_l3() {
    l3_round_trip("memory", "");
}

#[cfg(feature = "file")]
#[test]
fn file_backend_serves_the_prompt_from_l3() {
    let dir = tempfile::tempdir().unwrap();
    l3_round_trip("file", &format!(r#""dir": "{}", "#, dir.path().display()));
}

#[cfg(feature = "uring")]
#[test]
fn uring_backend_serves_the_prompt_from_l3() {
    // The host pool is registered as io_uring fixed buffers when L3 attaches.
    let dir = tempfile::tempdir().unwrap();
    l3_round_trip("uring", &format!(r#""dir": "{}", "#, dir.path().display()));
}

#[cfg(feature = "rdma")]
#[test]
fn rdma_backend_serves_the_prompt_from_l3() {
    // An in-process hicache-rdma-server on 127.0.0.1, data over TCP.
    l3_round_trip("rdma", r#""spawn_server": true, "capacity": "64MiB", "#);
}

#[cfg(feature = "redis")]
#[test]
fn redis_backend_serves_the_prompt_from_l3() {
    // A real 3-primary + 3-replica Redis Cluster on loopback; acknowledged by one replica.
    use hicache_backend_redis::testing::{RedisCluster, redis_available};
    if !redis_available("redis_backend_serves_the_prompt_from_l3") {
        return;
    }
    let cluster = RedisCluster::start(3, 1, &[]);
    let seeds: Vec<String> = cluster.seeds().iter().map(|s| format!("{s:?}")).collect();
    l3_round_trip(
        "redis",
        &format!(
            r#""nodes": [{}], "min_replicas_acked": 1, "#,
            seeds.join(", ")
        ),
    );
}
