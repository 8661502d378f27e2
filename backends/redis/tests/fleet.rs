//! The fleet tier on a real Redis Cluster on loopback: what a batch costs in round trips per
//! node (counted by the backend and checked against the servers' own counters, `INFO stats`
//! `total_reads_processed` and `INFO commandstats`), and two caches (two `RedisStorage`
//! instances = two inference nodes, each seeded with a different cluster node) sharing pages:
//! one writes, the other's prefetch (`batch_exists` then `batch_get`) hits with identical bytes,
//! while namespaces stay separate.

use std::collections::HashMap;

use hicache_backend_redis::exec::PIPELINE_BYTES;
use hicache_backend_redis::testing::{RedisCluster, cli, redis_available};
use hicache_backend_redis::value::HEADER_LEN;
use hicache_backend_redis::{RedisOptions, RedisStorage};
use hicache_storage::pattern::{namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, PageBuf, PageBufMut, PageKey, PageOutcome, Storage};

const L: LayoutKind = LayoutKind::PageFirst;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn keys(ns: u64, seed: u64, n: u64) -> Vec<PageKey> {
    (0..n).map(|i| page_key(namespace(ns), seed, i)).collect()
}

async fn set(s: &RedisStorage, keys: &[PageKey], pages: &[Vec<u8>]) -> Vec<PageOutcome> {
    let bufs: Vec<PageBuf<'_>> = pages.iter().map(|d| PageBuf::contiguous(L, d)).collect();
    s.batch_set(keys, &bufs).await.unwrap()
}

async fn get(s: &RedisStorage, keys: &[PageKey], len: usize) -> (Vec<PageOutcome>, Vec<Vec<u8>>) {
    let mut data: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    let out = {
        let mut bufs: Vec<PageBufMut<'_>> = data
            .iter_mut()
            .map(|d| PageBufMut::contiguous(L, d))
            .collect();
        s.batch_get(keys, &mut bufs).await.unwrap()
    };
    (out, data)
}

/// One node's counters from `INFO all` (one command: it counts itself once).
#[derive(Clone, Debug, Default)]
struct NodeCounters {
    reads: u64,
    calls: HashMap<String, u64>,
}

fn counters(port: u16) -> NodeCounters {
    let info = cli(port, &["info", "all"]);
    let mut c = NodeCounters::default();
    for line in info.lines() {
        if let Some(v) = line.strip_prefix("total_reads_processed:") {
            c.reads = v.trim().parse().unwrap();
        } else if let Some(rest) = line.strip_prefix("cmdstat_") {
            let (name, fields) = rest.split_once(':').unwrap();
            let calls = fields
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))
                .unwrap()
                .parse()
                .unwrap();
            c.calls.insert(name.to_string(), calls);
        }
    }
    assert!(
        info.contains("total_reads_processed:"),
        "this redis-server reports no total_reads_processed"
    );
    c
}

/// Per node (by port): server read events and calls of each command.
type Deltas = HashMap<u16, (u64, HashMap<String, u64>)>;

/// [`Deltas`] since `before`, less the `INFO` that took the snapshot.
fn delta(before: &HashMap<u16, NodeCounters>, after: &HashMap<u16, NodeCounters>) -> Deltas {
    after
        .iter()
        .map(|(port, a)| {
            let b = &before[port];
            let calls = a
                .calls
                .iter()
                .filter(|(n, _)| n.as_str() != "info")
                .map(|(n, v)| (n.clone(), v - b.calls.get(n).copied().unwrap_or(0)))
                .filter(|(_, v)| *v > 0)
                .collect();
            (*port, (a.reads - b.reads - 1, calls))
        })
        .collect()
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit_once(':').unwrap().1.parse().unwrap()
}

fn total(d: &Deltas, cmd: &str) -> u64 {
    d.values()
        .map(|(_, c)| c.get(cmd).copied().unwrap_or(0))
        .sum()
}

/// Runs `op` and returns, per node, the backend's round trips and the servers' deltas.
fn measure<T>(
    ports: &[u16],
    s: &RedisStorage,
    op: impl FnOnce() -> T,
) -> (T, HashMap<u16, u64>, Deltas) {
    let snap =
        || -> HashMap<u16, NodeCounters> { ports.iter().map(|&p| (p, counters(p))).collect() };
    let trips_before = s.round_trips();
    let before = snap();
    let r = op();
    let after = snap();
    let trips = s
        .round_trips()
        .into_iter()
        .map(|(a, n)| (port_of(&a), n - trips_before.get(&a).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect();
    (r, trips, delta(&before, &after))
}

#[test]
fn a_batch_costs_one_round_trip_per_node() {
    if !redis_available("a_batch_costs_one_round_trip_per_node") {
        return;
    }
    let rt = rt();
    // No replicas: a replica's REPLCONF ACKs would be read events on its primary.
    let cluster = RedisCluster::start(3, 0, &[]);
    let ports: Vec<u16> = cluster.servers.iter().map(|s| s.port).collect();
    let s = rt
        .block_on(RedisStorage::open(RedisOptions::new(cluster.seeds())))
        .unwrap();
    let n = 128u64;
    let len = 16 << 10;
    let ks = keys(1, 1, n);
    let pages: Vec<Vec<u8>> = ks.iter().map(|k| page_bytes(k, len)).collect();
    // Warm up: a connection to every node (its setup is not a page round trip).
    assert_eq!(rt.block_on(s.batch_exists(&ks)).unwrap(), 0);
    let per_node = |trips: &HashMap<u16, u64>, want: u64, what: &str| {
        assert_eq!(
            trips.len(),
            3,
            "{what}: every shard holds some of the keys: {trips:?}"
        );
        for (port, t) in trips {
            assert_eq!(*t, want, "{what}: round trips to node :{port}: {trips:?}");
        }
    };

    // batch_set of new pages: SET NX per page, one pipeline per node.
    let (out, trips, d) = measure(&ports, &s, || rt.block_on(set(&s, &ks, &pages)));
    assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
    per_node(&trips, 1, "batch_set (new)");
    assert_eq!(total(&d, "set"), n, "one SET per page, none resent: {d:?}");

    // batch_exists of 128 present keys: one pipeline per node, and the servers read each
    // pipeline in at most two read events (the target: <= 2 network round trips per shard;
    // the count may include the close of the previous snapshot's redis-cli connection).
    let (run, trips, d) = measure(&ports, &s, || rt.block_on(s.batch_exists(&ks)).unwrap());
    assert_eq!(run, n as usize);
    per_node(&trips, 1, "batch_exists");
    println!("batch_exists(128): round trips per node {trips:?}; server deltas {d:?}");
    assert_eq!(total(&d, "exists"), n, "{d:?}");
    for (port, (reads, calls)) in &d {
        assert!(
            *reads <= 2,
            "batch_exists(128): node :{port} processed {reads} reads ({calls:?})"
        );
    }

    // batch_get: one GET per page, one pipeline per node; the requests are small, so each
    // node reads them in at most two read events too.
    let ((out, back), trips, d) = measure(&ports, &s, || rt.block_on(get(&s, &ks, len)));
    assert!(out.iter().all(PageOutcome::is_hit), "{out:?}");
    assert_eq!(back, pages);
    per_node(&trips, 1, "batch_get");
    println!("batch_get(128): round trips per node {trips:?}; server deltas {d:?}");
    assert_eq!(total(&d, "get"), n, "{d:?}");
    for (port, (reads, calls)) in &d {
        assert!(
            *reads <= 2,
            "batch_get(128): node :{port} processed {reads} reads ({calls:?})"
        );
    }

    // batch_set of pages already present: SET NX, then their headers (GETRANGE): two.
    let (out, trips, d) = measure(&ports, &s, || rt.block_on(set(&s, &ks, &pages)));
    assert!(out.iter().all(|o| *o == PageOutcome::Present), "{out:?}");
    per_node(&trips, 2, "batch_set (present)");
    assert_eq!((total(&d, "set"), total(&d, "getrange")), (n, n), "{d:?}");

    // A node's share above a quarter of max_inflight_bytes is cut into several pipelines,
    // each at most that size: 128 x 64 KiB pages with a 1 MiB bound (256 KiB pipelines).
    let mut o = RedisOptions::new(cluster.seeds());
    o.max_inflight_bytes = 1 << 20;
    let small = rt.block_on(RedisStorage::open(o)).unwrap();
    let big = keys(1, 2, n);
    let big_pages: Vec<Vec<u8>> = big.iter().map(|k| page_bytes(k, 64 << 10)).collect();
    rt.block_on(small.batch_exists(&big)).unwrap();
    let (out, trips, _) = measure(&ports, &small, || {
        rt.block_on(set(&small, &big, &big_pages))
    });
    assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
    let per_pipeline = (256 << 10) / ((64 << 10) + 128);
    let sent: u64 = trips.values().sum();
    assert!(
        sent >= n / per_pipeline as u64 && sent <= n / per_pipeline as u64 + 3,
        "{sent} pipelines for 128 pages of 64 KiB in 256 KiB pipelines: {trips:?}"
    );

    // With the default bound, a node's share of large pages is cut into pipelines of at most
    // PIPELINE_BYTES (1 MiB) each, on separate connections: 128 x 64 KiB pages (8 MiB, about
    // 2.7 MiB per node) go as about 15 pages per pipeline.
    let large = keys(1, 3, n);
    let large_pages: Vec<Vec<u8>> = large.iter().map(|k| page_bytes(k, 64 << 10)).collect();
    let (out, trips, d) = measure(&ports, &s, || rt.block_on(set(&s, &large, &large_pages)));
    assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
    assert_eq!(total(&d, "set"), n, "one SET per page, none resent: {d:?}");
    let per_pipeline = (PIPELINE_BYTES / ((64 << 10) + HEADER_LEN)) as u64;
    let sent: u64 = trips.values().sum();
    assert!(
        sent >= n / per_pipeline && sent <= n / per_pipeline + 3,
        "{sent} pipelines for 128 pages of 64 KiB in 1 MiB pipelines: {trips:?}"
    );
}

#[test]
fn two_caches_share_pages_and_namespaces_stay_separate() {
    if !redis_available("two_caches_share_pages_and_namespaces_stay_separate") {
        return;
    }
    let rt = rt();
    let cluster = RedisCluster::start(3, 1, &[]);
    let seeds = cluster.seeds();
    // Two inference nodes, each knowing a different cluster node, acknowledging on a replica.
    let node = |seed: &str| {
        let mut o = RedisOptions::new([seed.to_string()]);
        o.min_replicas_acked = 1;
        rt.block_on(RedisStorage::open(o)).unwrap()
    };
    let a = node(&seeds[0]);
    let b = node(&seeds[seeds.len() - 1]);
    let len = 32 << 10;
    // Node A serves a prompt: its 64 pages of namespace 7 go to L3.
    let prompt = keys(7, 11, 64);
    let pages: Vec<Vec<u8>> = prompt.iter().map(|k| page_bytes(k, len)).collect();
    assert!(
        rt.block_on(set(&a, &prompt, &pages))
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    // Node B gets the same prompt: its prefetch finds the whole run and loads it, bit-exact.
    assert_eq!(rt.block_on(b.batch_exists(&prompt)).unwrap(), 64);
    let (out, back) = rt.block_on(get(&b, &prompt, len));
    assert!(out.iter().all(PageOutcome::is_hit), "{out:?}");
    assert_eq!(back, pages, "node B's pages differ from what node A stored");
    // The same page hashes under another namespace (another model, tenant or LoRA): absent
    // for B, and once B stores its own, each namespace reads its own bytes.
    let other: Vec<PageKey> = prompt
        .iter()
        .map(|k| PageKey::new(namespace(8), k.hash))
        .collect();
    assert_eq!(rt.block_on(b.batch_exists(&other)).unwrap(), 0);
    let (out, _) = rt.block_on(get(&b, &other, len));
    assert!(out.iter().all(|o| *o == PageOutcome::Miss), "{out:?}");
    let other_pages: Vec<Vec<u8>> = other.iter().map(|k| page_bytes(k, len)).collect();
    assert_ne!(other_pages[0], pages[0]);
    assert!(
        rt.block_on(set(&b, &other, &other_pages))
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    let (out, back) = rt.block_on(get(&a, &prompt, len));
    assert!(out.iter().all(PageOutcome::is_hit));
    assert_eq!(back, pages, "namespace 7 after namespace 8 was stored");
    let (out, back) = rt.block_on(get(&a, &other, len));
    assert!(out.iter().all(PageOutcome::is_hit));
    assert_eq!(
        back, other_pages,
        "node A reads namespace 8 as node B stored it"
    );
    // Issue 18: node B clears namespace 7 across every shard, A's pages included; namespace 8
    // stays.
    assert!(b.info().clear);
    assert_eq!(rt.block_on(b.clear(namespace(7))).unwrap(), 64);
    assert_eq!(rt.block_on(a.batch_exists(&prompt[..1])).unwrap(), 0);
    assert_eq!(rt.block_on(a.batch_exists(&other)).unwrap(), 64);
    assert_eq!(b.stats().cleared_pages, 64);
    assert_eq!(rt.block_on(b.clear(namespace(7))).unwrap(), 0);
    // A key prefix with glob characters is matched literally: clearing under `x*` leaves the
    // pages of prefix `xy`.
    let prefixed = |prefix: &str| {
        let mut o = RedisOptions::new([seeds[0].clone()]);
        o.key_prefix = prefix.into();
        rt.block_on(RedisStorage::open(o)).unwrap()
    };
    let (star, xy) = (prefixed("x*"), prefixed("xy"));
    let few = keys(9, 1, 8);
    let few_pages: Vec<Vec<u8>> = few.iter().map(|k| page_bytes(k, 4096)).collect();
    for s in [&star, &xy] {
        assert!(
            rt.block_on(set(s, &few, &few_pages))
                .iter()
                .all(|o| *o == PageOutcome::Stored)
        );
    }
    assert_eq!(rt.block_on(star.clear(namespace(9))).unwrap(), 8);
    assert_eq!(rt.block_on(star.batch_exists(&few)).unwrap(), 0);
    assert_eq!(rt.block_on(xy.batch_exists(&few)).unwrap(), 8);
}

/// Reads follow `ASK` while a slot migrates and `MOVED` once it moved, on a real cluster,
/// for one `GET` per page and for ranged reads (`ASKING` in front of `MULTI`: the flag lasts
/// through the transaction); every page read back is exact.
#[test]
fn reads_follow_ask_and_moved_while_a_slot_migrates() {
    if !redis_available("reads_follow_ask_and_moved_while_a_slot_migrates") {
        return;
    }
    let rt = rt();
    let cluster = RedisCluster::start(3, 0, &[]);
    let ports: Vec<u16> = cluster.servers.iter().map(|s| s.port).collect();
    let open = |chunk: u64| {
        let mut o = RedisOptions::new(cluster.seeds());
        o.read_chunk_bytes = chunk;
        rt.block_on(RedisStorage::open(o)).unwrap()
    };
    let (ranged, plain) = (open(4096), open(0));
    let len = 64 << 10;
    let ks = keys(3, 1, 8);
    let pages: Vec<Vec<u8>> = ks.iter().map(|k| page_bytes(k, len)).collect();
    let out = rt.block_on(set(&ranged, &ks, &pages));
    assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");

    let name = String::from_utf8(ranged.redis_key(&ks[0])).unwrap();
    let slot = cli(ports[0], &["CLUSTER", "KEYSLOT", &name])
        .trim()
        .to_string();
    let src = *ports
        .iter()
        .find(|p| cli(**p, &["EXISTS", &name]).trim() == "1")
        .expect("a node holds the page");
    let dst = *ports.iter().find(|p| **p != src).unwrap();
    let id = |p: u16| cli(p, &["CLUSTER", "MYID"]).trim().to_string();
    let (src_id, dst_id) = (id(src), id(dst));
    cli(dst, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &src_id]);
    cli(src, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &dst_id]);
    let moved = cli(
        src,
        &["MIGRATE", "127.0.0.1", &dst.to_string(), &name, "0", "5000"],
    );
    assert_eq!(moved.trim(), "OK", "{moved}");
    let ask = cli(src, &["GET", &name]);
    assert!(ask.contains("ASK"), "the source answers ASK: {ask}");
    let check = |what: &str| {
        for s in [&ranged, &plain] {
            let (out, back) = rt.block_on(get(s, &ks, len));
            assert!(out.iter().all(PageOutcome::is_hit), "{what}: {out:?}");
            assert_eq!(back, pages, "{what}");
        }
    };
    check("ASK (slot migrating)");
    for p in &ports {
        cli(*p, &["CLUSTER", "SETSLOT", &slot, "NODE", &dst_id]);
    }
    check("MOVED (slot moved)");
    assert_eq!(ranged.stats().get_corrupt, 0);
}
