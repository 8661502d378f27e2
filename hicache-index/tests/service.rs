//! The index service against hicache-rs's own KV-event publisher (the facade's, in process,
//! over loopback): missed batches replayed, a restarted publisher fenced, a dead instance
//! dropped, a shared store counted for every instance on it, a snapshot restart and a second
//! replica answering exactly as an index that never stopped, garbage on the HTTP port.
//!
//! Recovery times are printed (`--nocapture`), never asserted: timing lives in benches.

mod common;

use common::*;
use hicache::observe::wire::WireEvent;
use hicache::observe::{KvEventPublisher, KvEventsConfig};
use hicache_index::service::{Service, ServiceConfig};
use hicache_index::snapshot;
use hicache_index::transport::{ReplayItem, SubEvent, Transport, ZmtpTransport};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

const PS: u32 = 4;
const LIMIT: Duration = Duration::from_secs(20);

fn publisher(endpoint: &str, replay: &str) -> KvEventPublisher {
    let cfg = KvEventsConfig::from_json(&format!(
        r#"{{"publisher": "zmq", "endpoint": "{endpoint}", "replay_endpoint": "{replay}", "topic": "kv"}}"#
    ))
    .unwrap();
    KvEventPublisher::start(&cfg)
        .unwrap()
        .expect("zmq publisher")
}

fn stored(hashes: &[i64], parent: Option<i64>, tokens: &[u32], medium: &'static str) -> WireEvent {
    WireEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: PS,
        lora_id: None,
        medium,
    }
}

fn toks(n: u32, base: u32) -> Vec<u32> {
    (base..base + n).collect()
}

fn registration(name: &str, p: &KvEventPublisher, store: Option<&str>) -> serde_json::Value {
    let mut r = json!({
        "instance": name, "endpoint": p.endpoint(), "replay_endpoint": p.replay_endpoint(),
        "topic": "kv", "format": "sglang", "model": "m", "page_size": PS,
    });
    if let Some(s) = store {
        r["l3_store"] = json!(s);
    }
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missed_batches_replayed_restart_fenced_dead_instance_dropped() {
    let idx = start(Service::new(ServiceConfig {
        dead_after: Duration::from_secs(1),
        ..config()
    }))
    .await;
    let p = publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0");
    let (endpoint, replay) = (
        p.endpoint().to_string(),
        p.replay_endpoint().unwrap().to_string(),
    );
    // Published before the index subscribed: only a replay can bring these.
    p.publish(vec![stored(&[1, 2], None, &toks(8, 0), "GPU")]);
    p.publish(vec![stored(&[3], Some(2), &toks(4, 8), "CPU_PINNED")]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    post_json(idx.addr, "/register", &registration("a", &p, None)).await;
    let addr = idx.addr;
    let t = wait_for(LIMIT, "the missed batches replayed", || async move {
        tiers(&query(addr, "m", &toks(16, 0)).await, "a") == (8, 12, 12)
    })
    .await;
    println!("replayed the batches missed before subscribing in {t:?}");

    // Live from now on; a removal applies.
    p.publish(vec![WireEvent::BlockRemoved {
        block_hashes: vec![2],
        medium: "GPU",
    }]);
    wait_for(LIMIT, "the live removal", || async move {
        tiers(&query(addr, "m", &toks(16, 0)).await, "a") == (4, 4, 4)
    })
    .await;

    // The publisher restarts on the same ports: its old entries are fenced.
    drop(p);
    let p2 = publisher(&endpoint, &replay);
    let restarted = Instant::now();
    let t = wait_for(LIMIT, "the restart fenced", || async move {
        instances(addr).await[0]["stream"]["fenced_restarts"].as_u64() == Some(1)
    })
    .await;
    println!("restarted publisher fenced {t:?} after it came back (no batch published yet)");
    assert_eq!(query(addr, "m", &toks(16, 0)).await["instances"], json!({}));
    p2.publish(vec![stored(&[9], None, &toks(4, 100), "GPU")]);
    wait_for(LIMIT, "the new publisher's batch", || async move {
        tiers(&query(addr, "m", &toks(4, 100)).await, "a") == (4, 4, 4)
    })
    .await;
    println!("restart to first new answer: {:?}", restarted.elapsed());
    let st = instances(addr).await;
    assert_eq!(st[0]["last_seq"], json!(0));
    assert!(st[0]["stream"]["replays"].as_u64().unwrap() >= 2, "{st}");

    // It dies: after the dead timeout (1 s) its entries are dropped.
    drop(p2);
    let died = Instant::now();
    wait_for(LIMIT, "the dead instance dropped", || async move {
        instances(addr).await[0]["dead"] == json!(true)
    })
    .await;
    println!(
        "dead instance dropped {:?} after its publisher stopped (timeout 1 s)",
        died.elapsed()
    );
    assert_eq!(
        query(addr, "m", &toks(4, 100)).await["instances"],
        json!({})
    );
    let (_, metrics) = http(addr, "GET", "/metrics", "").await;
    for name in [
        "hicache_index_fenced_restarts_total 1",
        "hicache_index_dead_instances_total 1",
    ] {
        assert!(metrics.contains(name), "{name} in {metrics}");
    }
}

/// The real transport, losing the live batches whose sequence numbers are in `lose` (as a PUB
/// socket drops batches for a slow subscriber).
struct Lossy {
    lose: Vec<u64>,
}

impl Transport for Lossy {
    async fn subscribe(&self, endpoint: String, topic: String, events: mpsc::Sender<SubEvent>) {
        let (tx, mut rx) = mpsc::channel(64);
        let inner = tokio::spawn(async move {
            ZmtpTransport::default()
                .subscribe(endpoint, topic, tx)
                .await
        });
        while let Some(ev) = rx.recv().await {
            if matches!(&ev, SubEvent::Batch { seq, .. } if self.lose.contains(seq)) {
                continue;
            }
            if events.send(ev).await.is_err() {
                break;
            }
        }
        inner.abort();
    }

    async fn replay(
        &self,
        endpoint: String,
        start: u64,
        items: mpsc::Sender<ReplayItem>,
    ) -> std::io::Result<()> {
        ZmtpTransport::default()
            .replay(endpoint, start, items)
            .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_live_batch_is_replayed() {
    let idx = start_with(Service::new(config()), Lossy { lose: vec![1, 2] }).await;
    let p = publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0");
    post_json(idx.addr, "/register", &registration("a", &p, None)).await;
    let addr = idx.addr;
    wait_for(LIMIT, "subscribed", || async move {
        instances(addr).await[0]["connected"] == json!(true)
            && instances(addr).await[0]["replaying"] == json!(false)
    })
    .await;
    p.publish(vec![stored(&[1], None, &toks(4, 0), "GPU")]);
    wait_for(LIMIT, "seq 0 live", || async move {
        instances(addr).await[0]["last_seq"] == json!(0)
    })
    .await;
    // 1 and 2 are lost on the way; 3 shows the gap, the replay brings 1 and 2.
    p.publish(vec![stored(&[2], Some(1), &toks(4, 4), "GPU")]);
    p.publish(vec![stored(&[3], Some(2), &toks(4, 8), "CPU_PINNED")]);
    let gap = Instant::now();
    p.publish(vec![stored(&[4], Some(3), &toks(4, 12), "EXTERNAL")]);
    let t = wait_for(LIMIT, "the lost batches replayed", || async move {
        tiers(&query(addr, "m", &toks(16, 0)).await, "a") == (8, 12, 16)
    })
    .await;
    println!(
        "two dropped batches replayed, answer complete {:?} after the batch showing the gap was published (query polled every 10 ms: {t:?})",
        gap.elapsed()
    );
    let st = instances(addr).await;
    assert_eq!(st[0]["stream"]["gaps"], json!(1), "{st}");
    // The replay may also bring 3 (published by the time it is served): then live 3 is a
    // duplicate, skipped.
    let replayed = st[0]["stream"]["replayed_batches"].as_u64().unwrap();
    let duplicates = st[0]["stream"]["duplicates"].as_u64().unwrap();
    assert!(replayed == 2 || (replayed == 3 && duplicates == 1), "{st}");
    assert_eq!(st[0]["last_seq"], json!(3), "{st}");
    assert_eq!(st[0]["stream"]["lost_gaps"], json!(0), "{st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_store_counts_for_every_instance_registered_on_it() {
    let idx = start(Service::new(config())).await;
    let pa = publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0");
    let pb = publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0");
    let pc = publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0");
    post_json(
        idx.addr,
        "/register",
        &registration("a", &pa, Some("redis-1")),
    )
    .await;
    post_json(
        idx.addr,
        "/register",
        &registration("b", &pb, Some("redis-1")),
    )
    .await;
    post_json(idx.addr, "/register", &registration("c", &pc, None)).await;
    pa.publish(vec![stored(&[1, 2, 3], None, &toks(12, 0), "EXTERNAL")]);
    pb.publish(vec![stored(&[7], None, &toks(4, 0), "GPU")]);
    let addr = idx.addr;
    wait_for(LIMIT, "the store's pages for a and b", || async move {
        let q = query(addr, "m", &toks(16, 0)).await;
        tiers(&q, "a") == (0, 0, 12) && tiers(&q, "b") == (4, 4, 12)
    })
    .await;
    let q = query(addr, "m", &toks(16, 0)).await;
    assert_eq!(q["l3_stores"], json!({"redis-1": 12}));
    assert_eq!(q["instances"]["b"]["longest_matched"], json!(12));
    assert!(q["instances"].get("c").is_none(), "{q}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_index_and_a_second_replica_answer_like_one_that_never_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let p = publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0");
    let reg = registration("a", &p, Some("nfs-1"));
    let steady = start(Service::new(config())).await;
    let first = start(Service::new(config())).await;
    post_json(steady.addr, "/register", &reg).await;
    post_json(first.addr, "/register", &reg).await;
    // Replicas converge: both subscribe; wait until both saw seq 0 before going on.
    let chains: Vec<Vec<u32>> = (0..20).map(|i| toks(16, i * 1000)).collect();
    let mut seq = 0u64;
    let mut publish = |evs: Vec<WireEvent>| {
        p.publish(evs);
        seq += 1;
        seq - 1
    };
    for (i, c) in chains.iter().enumerate() {
        let h = (i as i64) * 10;
        let medium = ["GPU", "CPU_PINNED", "EXTERNAL"][i % 3];
        publish(vec![stored(&[h, h + 1, h + 2, h + 3], None, c, medium)]);
    }
    let last = publish(vec![WireEvent::BlockRemoved {
        block_hashes: vec![1, 2, 3],
        medium: "GPU",
    }]);
    for r in [&steady, &first] {
        let addr = r.addr;
        wait_for(LIMIT, "the replica caught up", || async move {
            instances(addr).await[0]["last_seq"] == json!(last)
        })
        .await;
    }
    // Snapshot the first replica and stop it; the stream goes on meanwhile.
    let bytes = snapshot::encode(&first.hub.service().lock());
    snapshot::write(dir.path(), &bytes).unwrap();
    drop(first);
    let mut more = Vec::new();
    for i in (0..chains.len()).step_by(2) {
        let h = (i as i64) * 10;
        let medium = ["GPU", "CPU_PINNED", "EXTERNAL"][i % 3];
        more.push(WireEvent::BlockRemoved {
            block_hashes: vec![h + 3],
            medium,
        });
    }
    let last = publish(more);
    let last = last.max(publish(vec![stored(
        &[999],
        Some(11),
        &toks(4, 1000 + 8),
        "GPU",
    )]));
    // Restart: load, serve, catch up through replay.
    let t = Instant::now();
    let mut svc = Service::new(config());
    let loaded = snapshot::load(&mut svc, dir.path(), 0).unwrap().unwrap();
    let restarted = start(svc).await;
    println!(
        "snapshot of {loaded} entries loaded and serving in {:?}",
        t.elapsed()
    );
    for r in [&steady, &restarted] {
        let addr = r.addr;
        wait_for(LIMIT, "caught up", || async move {
            instances(addr).await[0]["last_seq"] == json!(last)
        })
        .await;
    }
    println!(
        "caught up through replay {:?} after the restart",
        t.elapsed()
    );
    let mut probes = chains.clone();
    probes.push([toks(12, 1000), toks(4, 1008)].concat());
    probes.push(toks(3, 0));
    for q in &probes {
        let a = query(steady.addr, "m", q).await;
        let b = query(restarted.addr, "m", q).await;
        assert_eq!(a, b, "query {:?}", &q[..4.min(q.len())]);
    }
    assert_eq!(
        instances(restarted.addr).await[0]["stream"]["fenced_restarts"],
        json!(0)
    );
    // A torn or foreign file is refused, never loaded.
    let path = dir.path().join(snapshot::FILE_NAME);
    let good = std::fs::read(&path).unwrap();
    std::fs::write(&path, &good[..good.len() - 9]).unwrap();
    let err = snapshot::load(&mut Service::new(config()), dir.path(), 0).unwrap_err();
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
    std::fs::write(&path, b"PK\x03\x04 some zip file").unwrap();
    let err = snapshot::load(&mut Service::new(config()), dir.path(), 0).unwrap_err();
    assert!(
        err.to_string().contains("not a hicache-index snapshot"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_http_port_gets_4xx_and_the_service_stays_up() {
    let idx = start(Service::new(config())).await;
    let addr = idx.addr;
    // Not HTTP at all.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    assert!(
        out.is_empty() || String::from_utf8_lossy(&out).contains(" 400 "),
        "{out:?}"
    );
    // Malformed JSON, wrong types, unknown fields, bad registrations.
    for (path, body, want) in [
        ("/register", "{not json", 400),
        ("/register", r#"{"instance": 1}"#, 400),
        (
            "/register",
            r#"{"instance": "a", "endpoint": "tcp://h:1", "format": "sglang", "model": "m", "page_size": 0}"#,
            400,
        ),
        ("/query", r#"{"model": "m", "token_ids": [-1]}"#, 400),
        ("/query", r#"{"model": "none", "token_ids": [1]}"#, 404),
        ("/unregister", r#"{"instance": "nobody"}"#, 404),
        ("/nowhere", "", 404),
        ("/route", "{}", 400),
        ("/route", r#"{"model": "none", "token_ids": [1]}"#, 404),
    ] {
        let (status, body) = http(addr, "POST", path, body).await;
        assert_eq!(status, want, "{path}: {body}");
        assert!(body.contains("error"), "{body}");
    }
    let (status, _) = http(addr, "DELETE", "/query", "").await;
    assert_eq!(status, 405);
    // An oversized body is refused unread.
    let big = format!(
        r#"{{"model": "m", "token_ids": [{}1]}}"#,
        "1,".repeat(40_000)
    );
    let (status, _) = http(addr, "POST", "/query", &big).await;
    assert_eq!(status, 413);
    // Headers that never end: the connection is closed (header timeout), the server lives on.
    let (status, body) = http(addr, "GET", "/health", "").await;
    assert_eq!(status, 200, "{body}");
}
