//! Failover on a real 3-primary + 3-replica cluster: a primary is SIGKILLed between batches
//! of a stream of writes; after its replica is promoted, every page the backend acknowledged
//! with `min_replicas_acked: 1` is served bit-exact, and with `0` every page is served
//! bit-exact or is a miss, never wrong bytes. Writes during the failover window may fail
//! (reported per page); the backend recovers without being reopened.

use std::time::Duration;

use hicache_backend_redis::testing::{RedisCluster, redis_available};
use hicache_backend_redis::{RedisOptions, RedisStorage};
use hicache_storage::pattern::{check_page, namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, PageBuf, PageBufMut, PageKey, PageOutcome, Storage};

const LEN: usize = 32 << 10;

async fn write_stream(
    s: &RedisStorage,
    ns: u64,
    batches: u64,
    kill_after: u64,
    kill: &mut dyn FnMut(),
) -> Vec<PageKey> {
    let mut acked = Vec::new();
    for b in 0..batches {
        if b == kill_after {
            kill();
        }
        let keys: Vec<PageKey> = (0..16)
            .map(|j| page_key(namespace(ns), 7, b * 16 + j))
            .collect();
        let data: Vec<Vec<u8>> = keys.iter().map(|k| page_bytes(k, LEN)).collect();
        let bufs: Vec<PageBuf<'_>> = data
            .iter()
            .map(|d| PageBuf::contiguous(LayoutKind::PageFirst, d))
            .collect();
        let out = s
            .batch_set(&keys, &bufs)
            .await
            .expect("batch_set returns per-page outcomes");
        for (k, o) in keys.iter().zip(out) {
            if o.is_ok() {
                acked.push(*k);
            }
        }
    }
    acked
}

async fn read_back(s: &RedisStorage, keys: &[PageKey]) -> (usize, usize) {
    let (mut hits, mut misses) = (0, 0);
    for chunk in keys.chunks(64) {
        let mut data: Vec<Vec<u8>> = chunk.iter().map(|_| vec![0u8; LEN]).collect();
        let mut bufs: Vec<PageBufMut<'_>> = data
            .iter_mut()
            .map(|d| PageBufMut::contiguous(LayoutKind::PageFirst, d))
            .collect();
        let out = s.batch_get(chunk, &mut bufs).await.expect("batch_get");
        drop(bufs);
        for ((k, o), d) in chunk.iter().zip(out).zip(&data) {
            match o {
                PageOutcome::Hit => {
                    assert!(check_page(k, d), "a hit with wrong bytes after failover");
                    hits += 1;
                }
                PageOutcome::Miss => misses += 1,
                other => {
                    panic!("after the cluster healed a read is a hit or a miss, got {other:?}")
                }
            }
        }
    }
    (hits, misses)
}

#[test]
fn acknowledged_pages_survive_a_primary_killed_during_writes() {
    if !redis_available("acknowledged_pages_survive_a_primary_killed_during_writes") {
        return;
    }
    let mut cluster = RedisCluster::start(3, 1, &[]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The strict backend's budget is short: once its shard's replica is promoted, that shard
    // has no replica left and each `WAIT 1` runs to its timeout (the pages then fail, as they
    // must: no replica confirmed them).
    let open = |acked: u32, prefix: &str, secs: u64| {
        let mut o = RedisOptions::new(cluster.seeds());
        o.min_replicas_acked = acked;
        o.key_prefix = prefix.into();
        o.timeout = Duration::from_secs(secs);
        rt.block_on(RedisStorage::open(o)).expect("open")
    };
    let strict = open(1, "fo1:", 4);
    let relaxed = open(0, "fo0:", 15);

    // min_replicas_acked = 1: kill a primary (one that has a replica) mid-stream.
    let victim = cluster.a_primary();
    let acked = rt.block_on(async {
        let mut kill = || cluster.kill(victim);
        write_stream(&strict, 1, 11, 8, &mut kill).await
    });
    cluster.wait_healthy(Duration::from_secs(60));
    assert!(
        acked.len() >= 8 * 16,
        "the batches before the kill are acknowledged ({})",
        acked.len()
    );
    let (hits, misses) = rt.block_on(read_back(&strict, &acked));
    assert_eq!(
        (hits, misses),
        (acked.len(), 0),
        "every acknowledged page is served after promotion"
    );
    // The backend recovered by itself: new writes and reads work.
    let after = rt.block_on(async { write_stream(&strict, 2, 2, u64::MAX, &mut || {}).await });
    assert!(!after.is_empty());

    // min_replicas_acked = 0: kill another primary; every page reads exact or as a miss.
    let victim = cluster.a_primary();
    let written = rt.block_on(async {
        let mut kill = || cluster.kill(victim);
        write_stream(&relaxed, 3, 12, 6, &mut kill).await
    });
    cluster.wait_healthy(Duration::from_secs(60));
    let (hits, _misses) = rt.block_on(read_back(&relaxed, &written));
    assert!(hits > 0);
    assert_eq!(relaxed.stats().get_corrupt, 0);
    assert_eq!(strict.stats().get_corrupt, 0);
}
