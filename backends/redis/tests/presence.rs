//! The presence cache of `batch_exists` (`presence_cache_keys`) on real servers: repeated asks
//! are answered from the cache, and every change another client makes (a deletion, a flush, a
//! new write) reaches it through the servers' invalidations, also after its subscriber
//! connections were killed. Waits are bounded loops on the outcome, never sleeps sized to the
//! machine. Without the ACL permissions it needs, the cache turns itself off and every answer
//! comes from the servers.

use std::time::{Duration, Instant};

use hicache_backend_redis::testing::{RedisCluster, RedisServer, cli, redis_available};
use hicache_backend_redis::{RedisOptions, RedisStorage};
use hicache_storage::pattern::{namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, PageBuf, PageKey, Storage};

const LEN: usize = 4096;
const WAIT: Duration = Duration::from_secs(20);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn keys(ns: u64, n: u64) -> Vec<PageKey> {
    (0..n).map(|j| page_key(namespace(ns), 3, j)).collect()
}

async fn store(s: &RedisStorage, keys: &[PageKey]) {
    let data: Vec<Vec<u8>> = keys.iter().map(|k| page_bytes(k, LEN)).collect();
    let bufs: Vec<PageBuf<'_>> = data
        .iter()
        .map(|d| PageBuf::contiguous(LayoutKind::PageFirst, d))
        .collect();
    for o in s.batch_set(keys, &bufs).await.unwrap() {
        assert!(o.is_ok(), "{o:?}");
    }
}

/// Asks `batch_exists` until it answers `want` (bounded by [`WAIT`]); panics otherwise.
fn exists_until(rt: &tokio::runtime::Runtime, s: &RedisStorage, keys: &[PageKey], want: usize) {
    let deadline = Instant::now() + WAIT;
    loop {
        let got = rt.block_on(s.batch_exists(keys)).unwrap();
        assert!(got <= keys.len());
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "batch_exists answered {got}, not {want}, for {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Asks until one whole answer came from the cache (its subscribers are up and it knows
/// every key), bounded by [`WAIT`].
fn cached_until(rt: &tokio::runtime::Runtime, s: &RedisStorage, keys: &[PageKey]) {
    let deadline = Instant::now() + WAIT;
    loop {
        let before = s.presence_hits();
        assert_eq!(rt.block_on(s.batch_exists(keys)).unwrap(), keys.len());
        if s.presence_hits() - before == keys.len() as u64 {
            return;
        }
        assert!(Instant::now() < deadline, "never answered from the cache");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn del(port: u16, key: &[u8]) {
    let key = String::from_utf8(key.to_vec()).unwrap();
    cli(port, &["-c", "DEL", &key]);
}

#[test]
fn the_cache_follows_every_change_made_by_other_clients() {
    if !redis_available("the_cache_follows_every_change_made_by_other_clients") {
        return;
    }
    let cluster = RedisCluster::start(3, 0, &[]);
    let ports: Vec<u16> = cluster.servers.iter().map(|s| s.port).collect();
    let rt = runtime();
    let mut o = RedisOptions::new(cluster.seeds());
    o.key_prefix = "pc:".into();
    o.presence_cache_keys = 1024;
    let s = rt.block_on(RedisStorage::open(o)).unwrap();
    let ks = keys(1, 24);
    rt.block_on(store(&s, &ks));
    cached_until(&rt, &s, &ks);

    // Another client deletes a page: the run ends there once its invalidation arrived.
    del(ports[0], &s.redis_key(&ks[9]));
    exists_until(&rt, &s, &ks, 9);
    // Written again (by us): the whole run again, from the cache once asked.
    rt.block_on(store(&s, &ks[9..10]));
    exists_until(&rt, &s, &ks, ks.len());
    cached_until(&rt, &s, &ks);

    // The subscribers are killed: the cache empties, reconnects, and still follows changes.
    for &p in &ports {
        cli(p, &["CLIENT", "KILL", "TYPE", "pubsub"]);
    }
    del(ports[0], &s.redis_key(&ks[2]));
    exists_until(&rt, &s, &ks, 2);
    rt.block_on(store(&s, &ks[2..3]));
    cached_until(&rt, &s, &ks);
    del(ports[0], &s.redis_key(&ks[17]));
    exists_until(&rt, &s, &ks, 17);

    // A flush of every node forgets everything.
    rt.block_on(store(&s, &ks[17..18]));
    cached_until(&rt, &s, &ks);
    for &p in &ports {
        cli(p, &["FLUSHALL"]);
    }
    exists_until(&rt, &s, &ks, 0);

    // Our own deletion is forgotten at once, before any invalidation.
    rt.block_on(store(&s, &ks));
    cached_until(&rt, &s, &ks);
    assert_eq!(rt.block_on(s.delete(&ks[5..6])).unwrap(), 1);
    assert_eq!(rt.block_on(s.batch_exists(&ks)).unwrap(), 5);
}

#[test]
fn without_the_permissions_it_needs_the_cache_turns_itself_off() {
    if !redis_available("without_the_permissions_it_needs_the_cache_turns_itself_off") {
        return;
    }
    let server = RedisServer::start(&[]);
    let acl = cli(
        server.port,
        &[
            "ACL",
            "SETUSER",
            "hc",
            "on",
            ">pw",
            "~*",
            "&*",
            "+@all",
            "-client|tracking",
        ],
    );
    assert_eq!(acl.trim(), "OK", "{acl}");
    let rt = runtime();
    let mut o = RedisOptions::new([server.addr()]);
    o.cluster = false;
    o.username = Some("hc".into());
    o.password = Some("pw".into());
    o.presence_cache_keys = 1024;
    let s = rt.block_on(RedisStorage::open(o)).unwrap();
    let ks = keys(2, 8);
    rt.block_on(store(&s, &ks));
    for _ in 0..50 {
        assert_eq!(rt.block_on(s.batch_exists(&ks)).unwrap(), ks.len());
    }
    assert_eq!(
        s.presence_hits(),
        0,
        "no answer may come from a cache nobody keeps true"
    );
    del(server.port, &s.redis_key(&ks[3]));
    assert_eq!(rt.block_on(s.batch_exists(&ks)).unwrap(), 3);
}

/// The runtime the subscriber tasks ran on is shut down: the cache forgets everything, keeps
/// answering right on another runtime, and starts caching again there.
#[test]
fn a_runtime_shut_down_under_the_cache_leaves_it_right() {
    if !redis_available("a_runtime_shut_down_under_the_cache_leaves_it_right") {
        return;
    }
    let server = RedisServer::start(&[]);
    let first = runtime();
    let mut o = RedisOptions::new([server.addr()]);
    o.cluster = false;
    o.presence_cache_keys = 1024;
    let s = first.block_on(RedisStorage::open(o)).unwrap();
    let ks = keys(3, 12);
    first.block_on(store(&s, &ks));
    cached_until(&first, &s, &ks);
    drop(first);

    let second = runtime();
    del(server.port, &s.redis_key(&ks[4]));
    exists_until(&second, &s, &ks, 4);
    second.block_on(store(&s, &ks[4..5]));
    cached_until(&second, &s, &ks);
    del(server.port, &s.redis_key(&ks[7]));
    exists_until(&second, &s, &ks, 7);
}
