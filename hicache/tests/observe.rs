//! The observability endpoints of a running cache, used as an operator's tools use them: a ZMQ
//! subscriber and a replay client decode the KV events (SGLang's wire format) and find the
//! tree's pages in them, for L1, L2 and L3; a Prometheus scrape over HTTP parses the metrics.
#![cfg(feature = "file")]

mod common;
mod hybrid_common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::{Engine, prompt, small_shape};
use hicache::observe::wire::wire_hash;
use hicache::{HiCache, HiCacheConfig, PrefetchPolicy};
use hicache_core::{PageHasher, TenantId};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const PS: usize = 64;

fn cache(dir: &std::path::Path, topic: &str) -> HiCache {
    let cfg = HiCacheConfig {
        page_size: PS as u32,
        hicache_ratio: 1.2,
        storage_backend: Some("file".into()),
        storage_backend_extra_config: Some(format!(
            r#"{{"dir": "{}", "prefetch_threshold": 256}}"#,
            dir.display()
        )),
        storage_prefetch_policy: PrefetchPolicy::WaitComplete,
        host_reserve_bytes: Some(0),
        kv_events_config: Some(format!(
            r#"{{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0",
                "replay_endpoint": "tcp://127.0.0.1:0", "topic": "{topic}"}}"#
        )),
        metrics_addr: Some("127.0.0.1:0".into()),
        ..Default::default()
    };
    HiCache::builder(cfg.clone())
        .shape(small_shape(cfg.page_size))
        .device_pages(40)
        .build()
        .unwrap()
}

/// One decoded batch: its sequence number and events as (type, medium, hashes).
type Batch = (u64, Vec<(String, Option<String>, Vec<i64>)>);

fn decode(topic: &[u8], frames: &[bytes::Bytes], want_topic: &str) -> Batch {
    assert_eq!(frames.len(), 3, "topic, seq, payload");
    assert_eq!(topic, want_topic.as_bytes());
    let seq = u64::from_be_bytes(frames[1][..].try_into().unwrap());
    let v = rmpv::decode::read_value(&mut &frames[2][..]).unwrap();
    let top = v.as_array().expect("KVEventBatch is an array");
    assert!(
        top[0].as_f64().unwrap() > 1.6e9,
        "ts is seconds since the epoch"
    );
    let mut events = Vec::new();
    for e in top[1].as_array().unwrap() {
        let m: BTreeMap<&str, &rmpv::Value> = e
            .as_map()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.as_str().unwrap(), v))
            .collect();
        let hashes = m
            .get("block_hashes")
            .map(|h| {
                h.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_i64().unwrap())
                    .collect()
            })
            .unwrap_or_default();
        events.push((
            m["type"].as_str().unwrap().to_string(),
            m.get("medium").map(|x| x.as_str().unwrap().to_string()),
            hashes,
        ));
    }
    (seq, events)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Every buffered batch from `start` on, through the replay socket.
fn replay(endpoint: &str, start: u64, topic: &str) -> Vec<Batch> {
    rt().block_on(async {
        let mut dealer = DealerSocket::new();
        dealer.connect(endpoint).await.unwrap();
        let req = ZmqMessage::try_from(vec![
            bytes::Bytes::new(),
            bytes::Bytes::copy_from_slice(&start.to_be_bytes()),
        ])
        .unwrap();
        dealer.send(req).await.unwrap();
        let mut out = Vec::new();
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
                .await
                .expect("replay answers within 10 s")
                .unwrap();
            let frames = msg.into_vec();
            // [b"", topic, seq, payload]
            assert_eq!(frames.len(), 4, "{frames:?}");
            assert!(frames[0].is_empty());
            if frames[2][..] == (-1i64).to_be_bytes() {
                break;
            }
            out.push(decode(&frames[1], &frames[1..], topic));
        }
        out
    })
}

#[test]
fn events_of_every_tier_reach_subscribers_in_sglang_format() {
    let dir = tempfile::tempdir().unwrap();
    let topic = "kv";
    let mut e = Engine::new(cache(dir.path(), topic));
    let pub_ep = e.cache.kv_events_endpoint().unwrap().to_string();
    let replay_ep = e.cache.kv_events_replay_endpoint().unwrap().to_string();

    // A live subscriber: a PUB socket drops batches until the subscription has arrived, so
    // publish tick batches (bounded) until one is received.
    let rt = rt();
    let mut sub = SubSocket::new();
    rt.block_on(async {
        sub.connect(&pub_ep).await.unwrap();
        sub.subscribe(topic).await.unwrap();
    });
    let p = prompt(7, 768 + 30);
    let mut live = None;
    for round in 0..50 {
        e.run(None, &prompt(1000 + round, 2 * PS));
        e.poll();
        let received = rt
            .block_on(async { tokio::time::timeout(Duration::from_millis(200), sub.recv()).await });
        if let Ok(Ok(msg)) = received {
            let frames = msg.into_vec();
            live = Some(decode(&frames[0], &frames, topic));
            break;
        }
    }
    let (live_seq, live_events) = live.expect("a live batch within 50 rounds");
    assert!(!live_events.is_empty());

    // The workload: cache a prompt, back it up to L3, flush L1 and L2, serve it from L3.
    e.run(None, &p);
    e.settle();
    e.cache.flush().unwrap();
    let again = e.run(None, &p);
    assert_eq!(again.admission.storage_pages, 12);
    e.settle();

    assert_eq!(e.cache.kv_events_progress().unwrap().replayed_through, 0);
    let batches = replay(&replay_ep, 0, topic);
    let seqs: Vec<u64> = batches.iter().map(|b| b.0).collect();
    assert_eq!(
        seqs,
        (0..seqs.len() as u64).collect::<Vec<_>>(),
        "consecutive from 0"
    );
    // The publisher knows a replay reached its last batch (bounded wait: the replay task
    // records it just after queuing the end marker).
    let mut progress = e.cache.kv_events_progress().unwrap();
    for _ in 0..500 {
        if progress.replayed_through == seqs.len() as u64 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        progress = e.cache.kv_events_progress().unwrap();
    }
    assert_eq!(progress.replayed_through, seqs.len() as u64, "{progress:?}");
    assert!(progress.queued >= progress.published, "{progress:?}");
    assert!(progress.published >= seqs.len() as u64, "{progress:?}");
    assert!(seqs.contains(&live_seq));
    let live_again = batches.iter().find(|b| b.0 == live_seq).unwrap();
    assert_eq!(&live_again.1, &live_events, "replay sends the live payload");

    // The prompt's page hashes as the tree computes them, in the wire's int64 form.
    let start = e
        .cache
        .tree()
        .chain_start(TenantId::DEFAULT)
        .unwrap()
        .unwrap();
    let hasher = PageHasher::new(e.cache.config().hash_mode, e.cache.namespace()).unwrap();
    let pages = p.len() / PS;
    let want: Vec<i64> = hasher
        .hash_pages(start.prior, &p[..pages * PS])
        .iter()
        .map(wire_hash)
        .collect();
    let stored_in = |medium: &str| -> Vec<i64> {
        batches
            .iter()
            .flat_map(|b| &b.1)
            .filter(|ev| ev.0 == "BlockStored" && ev.1.as_deref() == Some(medium))
            .flat_map(|ev| ev.2.iter().copied())
            .collect()
    };
    for medium in ["GPU", "CPU_PINNED", "DISK"] {
        let got = stored_in(medium);
        for h in &want {
            assert!(got.contains(h), "{medium}: page hash {h} never stored");
        }
    }
    assert!(
        batches
            .iter()
            .flat_map(|b| &b.1)
            .any(|ev| ev.0 == "AllBlocksCleared"),
        "flushing L1 and L2 is announced"
    );
    e.cache.shutdown().unwrap();
}

/// `GET path` over a plain TCP connection; the status line and body.
fn http_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// Parses the text exposition into `name{labels}` → value (comments skipped).
fn parse(body: &str) -> BTreeMap<String, f64> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse::<f64>().unwrap())
        })
        .collect()
}

#[test]
fn metrics_are_scraped_over_http_with_backend_stats_and_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = Engine::new(cache(dir.path(), ""));
    let addr = e.cache.metrics_endpoint().unwrap();
    let p = prompt(3, 768 + 30);
    e.run(None, &p);
    e.settle();
    e.poll();
    let (status, body) = http_get(addr, "/metrics");
    assert!(status.contains("200"), "{status}");
    let m = parse(&body);
    let host_pages = e.cache.host_pool().num_pages() as f64;
    assert_eq!(m["hicache_capacity_pages{tier=\"l1\"}"], 40.0);
    assert_eq!(m["hicache_capacity_pages{tier=\"l2\"}"], host_pages);
    assert_eq!(
        m["hicache_resident_pages{tier=\"l2\"}"],
        e.cache.tree().host_pages() as f64
    );
    assert_eq!(
        m["sglang:hicache_host_total_tokens"],
        host_pages * PS as f64
    );
    assert_eq!(
        m["sglang:hicache_host_used_tokens"],
        (e.cache.tree().host_pages() * PS) as f64
    );
    let stored = m["hicache_storage_set_stored_total{backend=\"file\"}"];
    assert_eq!(stored, 12.0, "the backend's own count of stored pages");
    assert_eq!(m["hicache_storage_pages{backend=\"file\"}"], 12.0);
    assert_eq!(m["sglang:backuped_tokens_total"], 12.0 * PS as f64);
    assert!(m.contains_key("hicache_transfer_pages_total{direction=\"d2h\"}"));
    let (status, _) = http_get(addr, "/nope");
    assert!(status.contains("404"), "{status}");
    e.cache.shutdown().unwrap();
}

#[test]
fn endpoints_that_cannot_bind_fail_the_build() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    for cfg in [
        HiCacheConfig {
            metrics_addr: Some(addr.to_string()),
            ..Default::default()
        },
        HiCacheConfig {
            kv_events_config: Some(format!(
                r#"{{"publisher": "zmq", "endpoint": "tcp://{addr}"}}"#
            )),
            ..Default::default()
        },
    ] {
        let err = HiCache::builder(cfg)
            .shape(small_shape(64))
            .device_pages(8)
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("cannot bind"), "{err}");
    }
    let t0 = Instant::now();
    let err = HiCacheConfig {
        kv_events_config: Some(r#"{"publisher": "nats"}"#.into()),
        ..Default::default()
    }
    .validate()
    .unwrap_err();
    assert!(err.to_string().contains("nats"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5));
}

/// The Python interpreter with SGLang installed (`HICACHE_SGLANG_PYTHON`), or `None` to skip;
/// CI sets `HICACHE_REQUIRE_SGLANG=1`, which turns a missing interpreter into a failure.
fn sglang_python() -> Option<String> {
    match std::env::var("HICACHE_SGLANG_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            assert!(
                std::env::var("HICACHE_REQUIRE_SGLANG").as_deref() != Ok("1"),
                "HICACHE_REQUIRE_SGLANG=1 but HICACHE_SGLANG_PYTHON is not set"
            );
            eprintln!(
                "skipped: set HICACHE_SGLANG_PYTHON to a python with sglang (--no-deps), pyzmq, \
                 msgspec and pydantic (see .ci/run) to decode with SGLang's own classes"
            );
            None
        }
    }
}

#[test]
fn sglangs_own_event_classes_decode_every_batch() {
    let Some(python) = sglang_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let topic = "hicache";
    let mut e = Engine::new(cache(dir.path(), topic));
    let p = prompt(11, 768 + 30);
    e.run(None, &p);
    e.settle();
    e.cache.flush().unwrap();
    e.run(None, &p);
    e.settle();
    let replay_ep = e.cache.kv_events_replay_endpoint().unwrap().to_string();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/sglang_kv_subscriber.py"
    );
    let out = std::process::Command::new(&python)
        .args([script, &replay_ep, topic])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let start = e
        .cache
        .tree()
        .chain_start(TenantId::DEFAULT)
        .unwrap()
        .unwrap();
    let hasher = PageHasher::new(e.cache.config().hash_mode, e.cache.namespace()).unwrap();
    let want: Vec<i64> = hasher
        .hash_pages(start.prior, &p[..(p.len() / PS) * PS])
        .iter()
        .map(wire_hash)
        .collect();
    for medium in ["GPU", "CPU_PINNED", "DISK"] {
        let got: Vec<i64> = lines
            .iter()
            .filter(|l| l["type"] == "BlockStored" && l["medium"] == medium)
            .flat_map(|l| l["block_hashes"].as_array().unwrap().clone())
            .map(|h| h.as_i64().unwrap())
            .collect();
        for h in &want {
            assert!(
                got.contains(h),
                "{medium}: {h} not decoded by SGLang's classes"
            );
        }
    }
    assert!(lines.iter().any(|l| l["type"] == "AllBlocksCleared"));
    e.cache.shutdown().unwrap();
}

/// A hybrid cache's builder ([Full, SWA, Mamba], page 4, 32 device pages) with a `file` L3 in
/// a fresh directory (returned: keep it while the cache runs) and a ZMQ KV-event publisher
/// with its replay endpoint on loopback, topic `hybrid`; `kv_extra` adds fields to the
/// publisher's config (`, "key": value`).
fn hybrid_with_file_l3_and_events(
    kv_extra: &str,
) -> (tempfile::TempDir, hicache::HybridCacheBuilder) {
    let dir = tempfile::tempdir().unwrap();
    let extra = format!(r#"{{"dir": "{}"}}"#, dir.path().display());
    let sc = hicache::StorageConfig::parse(Some("file"), Some(&extra)).unwrap();
    let registry = hicache::backends::builtin_registry().unwrap();
    let storage = rt()
        .block_on(registry.open(&sc, &hicache_storage::BackendContext::default()))
        .unwrap();
    let cfg = hicache::HybridConfig {
        page_size: 4,
        swa_window: Some(8),
        mamba_chunk: Some(8),
        prefetch_threshold_tokens: 8,
        ..Default::default()
    };
    let kv = hicache::observe::KvEventsConfig::from_json(&format!(
        r#"{{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0",
            "replay_endpoint": "tcp://127.0.0.1:0", "topic": "hybrid"{kv_extra}}}"#
    ))
    .unwrap();
    let builder = hybrid_common::builder(cfg, 32)
        .storage(storage)
        .kv_events_publisher(kv);
    (dir, builder)
}

/// A hybrid cache serves its counters on the metrics endpoint and publishes its KV events
/// (device, host and L3 stores) in SGLang's wire format, as the dense one.
#[test]
fn a_hybrid_cache_publishes_metrics_and_events() {
    let (_dir, builder) = hybrid_with_file_l3_and_events("");
    let cache = builder.metrics_addr("127.0.0.1:0").build().unwrap();
    let mut e = hybrid_common::Engine::new(cache);
    e.turn(&hybrid_common::prompt(1, 40));
    // The poll after the flush publishes what the flush finished (the L3 backups).
    e.cache.poll().unwrap();
    let (status, body) = http_get(e.cache.metrics_endpoint().unwrap(), "/metrics");
    assert!(status.contains("200"), "{status}");
    let m = parse(&body);
    let key = |c: &str| {
        format!(r#"hicache_hybrid_moved_pages_total{{component="{c}",direction="l2_to_l3"}}"#)
    };
    assert_eq!(m.get(&key("full")), Some(&10.0), "{body}");
    assert_eq!(m.get(&key("mamba")), Some(&1.0), "{body}");
    let replay_at = e.cache.kv_events_replay_endpoint().unwrap().to_string();
    let media: Vec<String> = replay(&replay_at, 0, "hybrid")
        .into_iter()
        .flat_map(|(_, evs)| evs)
        .filter(|ev| ev.0 == "BlockStored")
        .filter_map(|ev| ev.1)
        .collect();
    for want in ["GPU", "CPU_PINNED", "DISK"] {
        assert!(media.iter().any(|m| m == want), "{want} in {media:?}");
    }
    e.cache.shutdown().unwrap();
}

/// With `component_events`, a hybrid cache also publishes its SWA pages and Mamba states on
/// every tier (device, host, and the L3 medium once a backup is whole): SGLang's own classes
/// still decode every batch (its decoder ignores the extra fields), event for event.
#[test]
fn hybrid_component_events_still_decode_with_sglangs_classes() {
    let (_dir, builder) = hybrid_with_file_l3_and_events(r#", "component_events": true"#);
    let cache = builder.build().unwrap();
    let mut e = hybrid_common::Engine::new(cache);
    e.turn(&hybrid_common::prompt(1, 40));
    e.cache.poll().unwrap();
    let replay_at = e.cache.kv_events_replay_endpoint().unwrap().to_string();
    let events: Vec<_> = replay(&replay_at, 0, "hybrid")
        .into_iter()
        .flat_map(|(_, evs)| evs)
        .collect();
    // Full, SWA and Mamba each reach L3: three DISK stores at least (one with the option off).
    let disk = events
        .iter()
        .filter(|ev| ev.0 == "BlockStored" && ev.1.as_deref() == Some("DISK"))
        .count();
    assert!(disk >= 3, "{events:?}");
    let Some(python) = sglang_python() else {
        e.cache.shutdown().unwrap();
        return;
    };
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/sglang_kv_subscriber.py"
    );
    let out = std::process::Command::new(&python)
        .args([script, &replay_at, "hybrid"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let decoded = String::from_utf8(out.stdout).unwrap().lines().count();
    assert_eq!(
        decoded,
        events.len(),
        "every event decoded by SGLang's classes"
    );
    e.cache.shutdown().unwrap();
}
