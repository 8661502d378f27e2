//! Tensor parallelism: four ranks in one process, each with its own cache, pools and L3
//! latency, agreeing through the TCP rank group. Their trees must have the same shape after
//! every tick, and every rank must serve the same prefixes.

mod common;

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use common::{Engine, Faulty, prompt, small_shape, test_config};
use hicache::{
    HiCache, HiCacheConfig, HostMemoryMode, PrefetchPolicy, RankGroup, StorageWriteMode,
    TcpRankGroup,
};
use hicache_storage::{MemoryBackend, Storage};

/// Per rank: the tree shape after every poll, (L1, L2, L3, polls waited) per request, and the
/// pages written to L3.
type RankRun = (
    Vec<common::TreeShape>,
    Vec<(usize, usize, usize, usize)>,
    u64,
);

/// How the ranks tier L2 and L3, and the rank whose backend refuses every write (if any).
#[derive(Copy, Clone)]
struct Tiering {
    host: HostMemoryMode,
    write: StorageWriteMode,
    failing_rank: Option<usize>,
}

const DEFAULT_TIERING: Tiering = Tiering {
    host: HostMemoryMode::Cache,
    write: StorageWriteMode::Inclusive,
    failing_rank: None,
};

fn run_rank(
    rank: usize,
    size: usize,
    hub: std::net::SocketAddr,
    policy: PrefetchPolicy,
    tiering: Tiering,
) -> RankRun {
    let group: Arc<dyn RankGroup> =
        Arc::new(TcpRankGroup::connect(rank, size, hub, Duration::from_secs(30)).unwrap());
    let mut faulty = Faulty::new(Arc::new(MemoryBackend::with_capacity(64 << 20)));
    faulty.latency = Duration::from_millis(rank as u64 * 3);
    faulty.fail_all_sets = tiering.failing_rank == Some(rank);
    let storage: Arc<dyn Storage> = Arc::new(faulty);
    let cfg = HiCacheConfig {
        storage_backend: Some("memory".into()),
        storage_backend_extra_config: Some(
            r#"{"prefetch_threshold": 8, "prefetch_timeout_base": 0.02, "prefetch_timeout_per_ki_token": 0, "prefetch_timeout_max": 0.02}"#.into(),
        ),
        storage_prefetch_policy: policy,
        hicache_host_memory_mode: tiering.host,
        storage_write_mode: tiering.write,
        // Exclusive tiering writes L3 only under L2 pressure: an L2 as small as L1.
        hicache_ratio: if tiering.write == StorageWriteMode::Exclusive {
            1.0
        } else {
            2.0
        },
        ..test_config(4)
    };
    let cache = HiCache::builder(cfg)
        .shape(small_shape(4))
        .device_pages(20)
        .rank_group(group)
        .storage(storage)
        .build()
        .unwrap();
    let mut e = Engine::new(cache);
    e.shapes = Some(Vec::new());
    let mut served = Vec::new();
    let system = prompt(1, 12);
    for round in 0..3u64 {
        for client in 0..4u64 {
            let mut p = system.clone();
            p.extend(prompt(10 + client, 20));
            p.extend(prompt(100 + round, 4));
            let s = e.run(None, &p);
            let a = s.admission;
            served.push((
                a.device_pages,
                a.host_pages,
                a.storage_pages,
                s.polls_waiting,
            ));
        }
        if round == 1 {
            e.settle();
            e.cache.flush().unwrap();
        }
    }
    e.settle();
    let written = e.cache.metrics().snapshot().l2_to_l3.pages;
    e.cache.shutdown().unwrap();
    (e.shapes.take().unwrap(), served, written)
}

fn four_ranks(policy: PrefetchPolicy) {
    four_ranks_tiered(policy, DEFAULT_TIERING);
}

fn four_ranks_tiered(policy: PrefetchPolicy, tiering: Tiering) {
    let hub = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let handles: Vec<_> = (0..4)
        .map(|r| std::thread::spawn(move || run_rank(r, 4, hub, policy, tiering)))
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let (shapes0, served0, written0) = &results[0];
    // Every mode writes L3 here (exclusive: L2 overflows), unless the failing rank refuses.
    assert!(*written0 > 0 || tiering.failing_rank == Some(0));
    assert!(shapes0.len() > 20);
    // Only wait_complete guarantees hits; the other policies cut prefetches by time. Under
    // exclusive tiering this workload fits L2, so L3 (and, after the flush, the cache) stays
    // empty; with a failing rank nothing is complete.
    assert!(
        served0.iter().any(|s| s.2 > 0)
            || policy != PrefetchPolicy::WaitComplete
            || tiering.write == StorageWriteMode::Exclusive
            || tiering.failing_rank.is_some()
    );
    for (r, (shapes, served, _)) in results.iter().enumerate().skip(1) {
        assert_eq!(
            shapes.len(),
            shapes0.len(),
            "rank {r} polled a different number of times"
        );
        for (tick, (a, b)) in shapes0.iter().zip(shapes).enumerate() {
            assert_eq!(a, b, "rank {r} tree differs from rank 0 after tick {tick}");
        }
        assert_eq!(served, served0, "rank {r} served different prefixes");
    }
}

#[test]
fn four_ranks_keep_identical_trees_with_wait_complete() {
    four_ranks(PrefetchPolicy::WaitComplete);
}

/// buffer_only and exclusive tiering decide from agreed counts only: the trees stay equal
/// while backups complete, and while one rank's backend refuses every write (its pages then
/// stay in L2 on every rank).
#[test]
fn four_ranks_keep_identical_trees_with_buffer_only_and_exclusive_tiering() {
    for failing_rank in [None, Some(2)] {
        for (host, write) in [
            (HostMemoryMode::BufferOnly, StorageWriteMode::Inclusive),
            (HostMemoryMode::Cache, StorageWriteMode::Exclusive),
        ] {
            let tiering = Tiering {
                host,
                write,
                failing_rank,
            };
            four_ranks_tiered(PrefetchPolicy::WaitComplete, tiering);
        }
    }
}

#[test]
fn four_ranks_keep_identical_trees_with_timeout() {
    four_ranks(PrefetchPolicy::Timeout);
}

#[test]
fn four_ranks_keep_identical_trees_with_best_effort() {
    four_ranks(PrefetchPolicy::BestEffort);
}

/// MLA KV is the same on every rank, so only rank 0 writes it to L3 (the namespaces of all
/// ranks are equal: they share the pages). The other ranks must still count the same
/// backups, or the agreed count stays 0 and rank 0's backups never finish.
fn mla_rank(rank: usize, hub: std::net::SocketAddr, storage: Arc<dyn Storage>) -> usize {
    let group: Arc<dyn RankGroup> =
        Arc::new(TcpRankGroup::connect(rank, 2, hub, Duration::from_secs(5)).unwrap());
    let cfg = HiCacheConfig {
        storage_backend: Some("memory".into()),
        storage_backend_extra_config: Some(r#"{"prefetch_threshold": 8}"#.into()),
        storage_prefetch_policy: PrefetchPolicy::WaitComplete,
        ..test_config(4)
    };
    let shape = hicache::KvShape {
        kind: hicache::KvKind::Mla { kv_dim: 64 },
        ..small_shape(4)
    };
    let cache = HiCache::builder(cfg)
        .shape(shape)
        .device_pages(32)
        .rank_group(group)
        .storage(storage)
        .build()
        .unwrap();
    let mut e = Engine::new(cache);
    let p = prompt(7, 40);
    e.run(None, &p);
    e.settle();
    common::assert_no_pins(&e.cache);
    e.cache.flush().unwrap();
    let again = e.run(None, &p);
    e.settle();
    e.cache.shutdown().unwrap();
    again.admission.storage_pages
}

#[test]
fn mla_ranks_agree_on_backups_only_rank_0_writes() {
    let hub = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let storage: Arc<dyn Storage> = Arc::new(MemoryBackend::with_capacity(64 << 20));
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let s = storage.clone();
            std::thread::spawn(move || mla_rank(r, hub, s))
        })
        .collect();
    let served: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(served, vec![10, 10]);
}

/// More requests waiting for their prefetch than one exchange can carry (4 values each):
/// the prefetches past the limit are not started, instead of every rank's poll failing.
fn burst_rank(rank: usize, hub: std::net::SocketAddr) -> (usize, usize) {
    let group: Arc<dyn RankGroup> =
        Arc::new(TcpRankGroup::connect(rank, 2, hub, Duration::from_secs(10)).unwrap());
    let cfg = HiCacheConfig {
        storage_backend: Some("memory".into()),
        storage_backend_extra_config: Some(r#"{"prefetch_threshold": 8}"#.into()),
        storage_prefetch_policy: PrefetchPolicy::WaitComplete,
        ..test_config(4)
    };
    let mut cache = HiCache::builder(cfg)
        .shape(small_shape(4))
        .device_pages(16)
        .rank_group(group)
        .storage(Arc::new(MemoryBackend::with_capacity(1 << 20)))
        .build()
        .unwrap();
    let n = hicache::rank::MAX_EXCHANGE_LEN / 4 + 100;
    let mut started = 0;
    for req in 0..n as u64 {
        let a = cache.arrive(req, &prompt(req, 16)).unwrap();
        started += (a.prefetch_pages > 0) as usize;
    }
    let report = cache.poll().unwrap();
    let mut ready = 0;
    for req in 0..n as u64 {
        ready += cache.prefetch_ready(req).unwrap() as usize;
        cache.abort(req).unwrap();
    }
    cache.shutdown().unwrap();
    assert!(report.prefetches_in_flight <= started);
    (started, ready)
}

#[test]
fn a_burst_of_prefetches_beyond_one_exchange_is_capped() {
    let hub = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let handles: Vec<_> = (0..2)
        .map(|r| std::thread::spawn(move || burst_rank(r, hub)))
        .collect();
    let out: Vec<(usize, usize)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(out[0], out[1]);
    assert!(out[0].0 > 0 && out[0].0 < hicache::rank::MAX_EXCHANGE_LEN / 4);
}
