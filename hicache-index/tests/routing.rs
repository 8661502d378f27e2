//! Routing over HTTP: `POST /route`, `/finished` and `/load` of an in-process service on
//! loopback, its instances fed by hicache-rs's own KV-event publisher. Outcomes only, no
//! timing.

mod common;

use common::*;
use hicache::observe::wire::WireEvent;
use hicache::observe::{KvEventPublisher, KvEventsConfig};
use hicache_index::router::Policy;
use hicache_index::routing::RoutingConfig;
use hicache_index::service::{Service, ServiceConfig};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::time::Duration;

const PS: u32 = 4;
const LIMIT: Duration = Duration::from_secs(20);

fn publisher() -> KvEventPublisher {
    let cfg = KvEventsConfig::from_json(
        r#"{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv"}"#,
    )
    .unwrap();
    KvEventPublisher::start(&cfg)
        .unwrap()
        .expect("zmq publisher")
}

fn toks(n: u32, base: u32) -> Vec<u32> {
    (base..base + n).collect()
}

fn service(policy: Policy) -> Service {
    Service::new(ServiceConfig {
        routing: RoutingConfig {
            policy,
            // A loaded test machine must not turn a decision into a fallback.
            deadline: Duration::from_secs(60),
            ..RoutingConfig::default()
        },
        ..config()
    })
}

async fn register(addr: SocketAddr, name: &str, p: &KvEventPublisher) {
    let r = json!({
        "instance": name, "endpoint": p.endpoint(), "replay_endpoint": p.replay_endpoint(),
        "topic": "kv", "format": "sglang", "model": "m", "page_size": PS,
    });
    post_json(addr, "/register", &r).await;
}

async fn route(addr: SocketAddr, body: Value) -> Value {
    post_json(addr, "/route", &body).await
}

async fn route_id(addr: SocketAddr, request: u64) -> String {
    let a = route(
        addr,
        json!({"model": "m", "token_ids": toks(8, 1000), "request": request}),
    )
    .await;
    a["instance"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hicache_routes_a_request_to_the_instance_holding_its_prefix() {
    let idx = start(service(Policy::Hicache)).await;
    let addr = idx.addr;
    let (pa, pb) = (publisher(), publisher());
    register(addr, "a", &pa).await;
    register(addr, "b", &pb).await;
    // b holds the first 12 tokens of the prompt: 8 in L1, 4 more in L2.
    pb.publish(vec![
        WireEvent::BlockStored {
            block_hashes: vec![1, 2],
            parent_block_hash: None,
            token_ids: toks(8, 0),
            block_size: PS,
            lora_id: None,
            medium: "GPU",
        },
        WireEvent::BlockStored {
            block_hashes: vec![3],
            parent_block_hash: Some(2),
            token_ids: toks(4, 8),
            block_size: PS,
            lora_id: None,
            medium: "CPU_PINNED",
        },
    ]);
    wait_for(LIMIT, "b's events ingested", || async move {
        tiers(&query(addr, "m", &toks(20, 0)).await, "b") == (8, 12, 12)
    })
    .await;
    let a = route(
        addr,
        json!({"model": "m", "token_ids": toks(20, 0), "request": 7, "session": 3}),
    )
    .await;
    assert_eq!(a["instance"], json!("b"), "{a}");
    assert_eq!(a["request"], json!(7));
    assert_eq!(a["policy"], json!("hicache"));
    assert_eq!(a["fallback"], json!(false));
    assert_eq!(a["overlap"], json!({"l1": 8, "l2": 12, "l3": 12}));
    assert!(a["expected_ttft_ms"].as_f64().unwrap() > 0.0, "{a}");
    // A prompt nobody holds: no overlap credited.
    let cold = route(addr, json!({"model": "m", "token_ids": toks(20, 500)})).await;
    assert_eq!(
        cold["overlap"],
        json!({"l1": 0, "l2": 0, "l3": 0}),
        "{cold}"
    );
    assert!(cold["request"].as_u64().unwrap() >= 1 << 63, "{cold}");
    let (_, metrics) = http(addr, "GET", "/metrics", "").await;
    assert!(
        metrics.contains(
            r#"hicache_index_routed_requests_total{model="m",instance="b",policy="hicache"} 1"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("hicache_index_route_decision_seconds_count 2"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_cycles_over_the_registered_instances() {
    let idx = start(service(Policy::RoundRobin)).await;
    let addr = idx.addr;
    let ps: Vec<KvEventPublisher> = (0..3).map(|_| publisher()).collect();
    for (name, p) in ["c", "a", "b"].iter().zip(&ps) {
        register(addr, name, p).await;
    }
    let mut picks = Vec::new();
    for r in 0..6 {
        picks.push(route_id(addr, r).await);
    }
    assert_eq!(picks, ["a", "b", "c", "a", "b", "c"]);
    let a = route(addr, json!({"model": "m", "token_ids": [1, 2, 3]})).await;
    assert_eq!(a["policy"], json!("round-robin"));
    assert_eq!(a["overlap"], json!({"l1": 0, "l2": 0, "l3": 0}));
    assert!(a.get("expected_ttft_ms").is_none(), "{a}");
    // b leaves: the turns go on over a and c.
    post_json(addr, "/unregister", &json!({"instance": "b"})).await;
    let mut picks = Vec::new();
    for r in 10..14 {
        picks.push(route_id(addr, r).await);
    }
    picks.sort();
    assert_eq!(picks, ["a", "a", "c", "c"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_requests_and_load_reports_move_least_load_decisions() {
    let idx = start(service(Policy::LeastLoad)).await;
    let addr = idx.addr;
    let (pa, pb) = (publisher(), publisher());
    register(addr, "a", &pa).await;
    register(addr, "b", &pb).await;
    // Ties go to the lowest position (a).
    assert_eq!(route_id(addr, 1).await, "a");
    assert_eq!(route_id(addr, 2).await, "b");
    assert_eq!(route_id(addr, 3).await, "a");
    // a has 2 requests, b 1: b next, unless a's are released.
    let f = post_json(addr, "/finished", &json!({"request": 1})).await;
    assert_eq!(f, json!({"released": true, "instance": "a"}));
    post_json(addr, "/finished", &json!({"request": 3})).await;
    assert_eq!(route_id(addr, 4).await, "a");
    // An unknown (or already finished) request: 200, released false, counted.
    let f = post_json(addr, "/finished", &json!({"request": 3})).await;
    assert_eq!(f, json!({"released": false}));
    let (_, metrics) = http(addr, "GET", "/metrics", "").await;
    assert!(
        metrics.contains(r#"hicache_index_route_finished_total{known="false"} 1"#),
        "{metrics}"
    );
    // a reports a long queue: the estimate restarts from it, b wins.
    post_json(
        addr,
        "/load",
        &json!({"instance": "a", "queued_prefill_tokens": 5000, "requests": 9, "running_tokens": 100}),
    )
    .await;
    assert_eq!(route_id(addr, 5).await, "b");
    assert_eq!(route_id(addr, 6).await, "b");
    let (status, body) = http(
        addr,
        "POST",
        "/load",
        r#"{"instance": "zz", "queued_prefill_tokens": 0, "requests": 0, "running_tokens": 0}"#,
    )
    .await;
    assert_eq!(status, 404, "{body}");
    // A new instance joins: it is idle, so it is chosen, and the others keep their load.
    let pc = publisher();
    register(addr, "c", &pc).await;
    assert_eq!(route_id(addr, 8).await, "c");
    post_json(addr, "/finished", &json!({"request": 2})).await;
    post_json(addr, "/finished", &json!({"request": 5})).await;
    post_json(addr, "/finished", &json!({"request": 6})).await;
    // b is idle again (its three requests released), c holds one, a reported nine.
    assert_eq!(route_id(addr, 9).await, "b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_instances_is_404_and_malformed_bodies_are_400() {
    let idx = start(service(Policy::Hicache)).await;
    let addr = idx.addr;
    let (status, body) = http(
        addr,
        "POST",
        "/route",
        r#"{"model": "nope", "token_ids": [1, 2, 3]}"#,
    )
    .await;
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("nope"), "{body}");
    // Registered, then gone: 404 again.
    let p = publisher();
    register(addr, "a", &p).await;
    assert_eq!(route_id(addr, 1).await, "a");
    post_json(addr, "/unregister", &json!({"instance": "a"})).await;
    let (status, body) = http(
        addr,
        "POST",
        "/route",
        r#"{"model": "m", "token_ids": [1]}"#,
    )
    .await;
    assert_eq!(status, 404, "{body}");
    register(addr, "a", &p).await;
    for (path, body) in [
        ("/route", "{"),
        ("/route", r#"{"model": "m"}"#),
        ("/route", r#"{"model": "m", "token_ids": "x"}"#),
        ("/route", r#"{"model": "m", "token_ids": [-1]}"#),
        ("/route", r#"{"model": "m", "token_ids": []}"#),
        ("/route", r#"{"model": "m", "token_ids": [1], "extra": 1}"#),
        (
            "/route",
            r#"{"model": "m", "token_ids": [1], "request": "r1"}"#,
        ),
        ("/finished", "{}"),
        ("/finished", r#"{"request": -3}"#),
        ("/load", r#"{"instance": "a"}"#),
        (
            "/load",
            r#"{"instance": "a", "queued_prefill_tokens": 1.5, "requests": 0, "running_tokens": 0}"#,
        ),
    ] {
        let (status, answer) = http(addr, "POST", path, body).await;
        assert_eq!(status, 400, "{path} {body}: {answer}");
        assert!(answer.contains("error"), "{answer}");
    }
    let (status, _) = http(addr, "GET", "/route", "").await;
    assert_eq!(status, 405);
    // An oversized body: 413, as for the other endpoints.
    let big = format!(
        r#"{{"model": "m", "token_ids": [{}]}}"#,
        vec!["1"; 40_000].join(",")
    );
    let (status, _) = http(addr, "POST", "/route", &big).await;
    assert_eq!(status, 413);
}
