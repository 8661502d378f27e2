//! Bad input and a cluster under pressure, on real standalone servers (and one cluster for
//! sharing between nodes): unreachable seeds, wrong credentials, a standalone server where a
//! cluster is configured, values over `proto-max-bulk-len`, OOM replies from a full server,
//! garbage under a page's key, and eviction by `allkeys-lru`. Each is a clear error or a
//! per-page outcome; nothing is acknowledged that is not stored, and no wrong byte is a hit.

use std::time::Duration;

use hicache_backend_redis::testing::{RedisCluster, RedisServer, cli, redis_available};
use hicache_backend_redis::{RedisOptions, RedisStorage};
use hicache_storage::pattern::{check_page, namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, PageBuf, PageBufMut, PageError, PageKey, PageOutcome, Storage};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn standalone(addr: String) -> RedisOptions {
    let mut o = RedisOptions::new([addr]);
    o.cluster = false;
    o.timeout = Duration::from_secs(3);
    o
}

async fn set(s: &RedisStorage, keys: &[PageKey], len: usize) -> Vec<PageOutcome> {
    let data: Vec<Vec<u8>> = keys.iter().map(|k| page_bytes(k, len)).collect();
    let bufs: Vec<PageBuf<'_>> = data
        .iter()
        .map(|d| PageBuf::contiguous(LayoutKind::PageFirst, d))
        .collect();
    s.batch_set(keys, &bufs).await.unwrap()
}

async fn get(s: &RedisStorage, keys: &[PageKey], len: usize) -> Vec<PageOutcome> {
    let mut data: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    let mut bufs: Vec<PageBufMut<'_>> = data
        .iter_mut()
        .map(|d| PageBufMut::contiguous(LayoutKind::PageFirst, d))
        .collect();
    let out = s.batch_get(keys, &mut bufs).await.unwrap();
    drop(bufs);
    for ((k, o), d) in keys.iter().zip(&out).zip(&data) {
        if o.is_hit() {
            assert!(check_page(k, d), "a hit must hold the page's bytes");
        }
    }
    out
}

fn keys(ns: u64, n: u64) -> Vec<PageKey> {
    (0..n).map(|i| page_key(namespace(ns), 3, i)).collect()
}

#[test]
fn unreachable_wrong_password_and_wrong_mode_are_clear_errors() {
    if !redis_available("unreachable_wrong_password_and_wrong_mode_are_clear_errors") {
        return;
    }
    let rt = rt();
    // Nothing listens on port 1 of loopback.
    let e = rt
        .block_on(RedisStorage::open(standalone("127.0.0.1:1".into())))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no seed node reachable") && e.contains("127.0.0.1:1"),
        "{e}"
    );

    let server = RedisServer::start(&["--requirepass", "s3cret"]);
    let mut o = standalone(server.addr());
    o.password = Some("wrong".into());
    let e = rt
        .block_on(RedisStorage::open(o.clone()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("authentication failed"), "{e}");
    o.password = None;
    let e = rt
        .block_on(RedisStorage::open(o.clone()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("authentication failed"), "{e}");
    o.password = Some("s3cret".into());
    let s = rt
        .block_on(RedisStorage::open(o.clone()))
        .expect("the right password opens");
    assert!(
        rt.block_on(set(&s, &keys(1, 2), 4096))
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );

    // A standalone server where a cluster is configured.
    o.cluster = true;
    let e = rt.block_on(RedisStorage::open(o)).unwrap_err().to_string();
    assert!(e.contains("cluster_enabled:0"), "{e}");
}

#[test]
fn oversized_values_oom_and_garbage_are_per_page_outcomes() {
    if !redis_available("oversized_values_oom_and_garbage_are_per_page_outcomes") {
        return;
    }
    let rt = rt();
    let server = RedisServer::start(&[
        "--proto-max-bulk-len",
        "1mb",
        "--maxmemory",
        "4mb",
        "--maxmemory-policy",
        "noeviction",
    ]);
    let s = rt
        .block_on(RedisStorage::open(standalone(server.addr())))
        .unwrap();
    // Over proto-max-bulk-len: TooLarge alone; the neighbour is stored.
    let ks = keys(2, 2);
    let data = [page_bytes(&ks[0], 2 << 20), page_bytes(&ks[1], 4096)];
    let bufs: Vec<PageBuf<'_>> = data
        .iter()
        .map(|d| PageBuf::contiguous(LayoutKind::PageFirst, d))
        .collect();
    let out = rt.block_on(s.batch_set(&ks, &bufs)).unwrap();
    assert!(
        matches!(out[0], PageOutcome::Failed(PageError::TooLarge { .. })),
        "{:?}",
        out[0]
    );
    assert_eq!(out[1], PageOutcome::Stored);

    // Fill the server past maxmemory (noeviction): OOM replies are NoSpace, and every page
    // acknowledged Stored reads back exact.
    let ks = keys(3, 64);
    let out = rt.block_on(set(&s, &ks, 256 << 10));
    assert!(
        out.iter()
            .any(|o| matches!(o, PageOutcome::Failed(PageError::NoSpace))),
        "{out:?}"
    );
    let stored: Vec<PageKey> = ks
        .iter()
        .zip(&out)
        .filter(|(_, o)| **o == PageOutcome::Stored)
        .map(|(k, _)| *k)
        .collect();
    assert!(!stored.is_empty());
    let back = rt.block_on(get(&s, &stored, 256 << 10));
    assert!(
        back.iter().all(PageOutcome::is_hit),
        "every acknowledged page is stored: {back:?}"
    );

    // Garbage and a wrong type under a page's key: Corrupt (counted), never a hit.
    let g = keys(4, 2);
    let name0 = String::from_utf8(s.redis_key(&g[0])).unwrap();
    let name1 = String::from_utf8(s.redis_key(&g[1])).unwrap();
    cli(server.port, &["set", &name0, "not a page"]);
    cli(server.port, &["hset", &name1, "f", "v"]);
    let out = rt.block_on(get(&s, &g, 4096));
    assert_eq!(out[0], PageOutcome::Corrupt);
    assert!(!out[1].is_hit(), "{:?}", out[1]);
    assert!(s.stats().get_corrupt >= 1);
}

#[test]
fn evicted_pages_are_misses_never_wrong() {
    if !redis_available("evicted_pages_are_misses_never_wrong") {
        return;
    }
    let rt = rt();
    let server = RedisServer::start(&["--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru"]);
    let s = rt
        .block_on(RedisStorage::open(standalone(server.addr())))
        .unwrap();
    let ks = keys(5, 96);
    for chunk in ks.chunks(16) {
        let out = rt.block_on(set(&s, chunk, 256 << 10));
        assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
    }
    let out = rt.block_on(get(&s, &ks, 256 << 10));
    let hits = out.iter().filter(|o| o.is_hit()).count();
    assert!(
        out.iter()
            .all(|o| matches!(o, PageOutcome::Hit | PageOutcome::Miss)),
        "{out:?}"
    );
    assert!(
        hits > 0 && hits < ks.len(),
        "24 MiB through 8 MiB: some pages evicted, some kept ({hits})"
    );
    assert!(rt.block_on(s.batch_exists(&ks)).unwrap() < ks.len());
}

#[test]
fn two_backends_on_different_nodes_share_pages() {
    if !redis_available("two_backends_on_different_nodes_share_pages") {
        return;
    }
    let rt = rt();
    let cluster = RedisCluster::start(3, 0, &[]);
    let seeds = cluster.seeds();
    let a = rt
        .block_on(RedisStorage::open(RedisOptions::new([seeds[0].clone()])))
        .unwrap();
    let b = rt
        .block_on(RedisStorage::open(RedisOptions::new([seeds[2].clone()])))
        .unwrap();
    let ks = keys(6, 128);
    assert!(
        rt.block_on(set(&a, &ks, 8192))
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    assert_eq!(rt.block_on(b.batch_exists(&ks)).unwrap(), 128);
    assert!(
        rt.block_on(get(&b, &ks, 8192))
            .iter()
            .all(PageOutcome::is_hit)
    );
    // Pages spread over every shard (no hash tag).
    assert_eq!(b.primaries().len(), 3);
    for srv in &cluster.servers {
        let n: u64 = cli(srv.port, &["dbsize"]).trim().parse().unwrap();
        assert!(n > 0, "every shard holds some of the 128 pages");
    }
}
