//! The index fed by SGLang's and vLLM's own publishers (their `ZmqEventPublisher` and event
//! classes from PyPI, run by `tests/python/engine_publisher.py` over pyzmq): batches published
//! before the index subscribed arrive through the engine's replay endpoint, live ones follow,
//! every tier lands where its medium says; vLLM's events of a hybrid model's KV cache groups
//! (`group_idx`, `kv_cache_spec_kind`) make the router credit only where every group holds
//! the prefix.
//!
//! Skipped unless `HICACHE_SGLANG_PYTHON` / `HICACHE_VLLM_PYTHON` name a Python with the
//! engine installed (`--no-deps`) plus msgspec, pyzmq, pydantic; `HICACHE_REQUIRE_SGLANG=1` /
//! `HICACHE_REQUIRE_VLLM=1` (CI) turn a skip into a failure. See `.ci/run`.

mod common;

use common::*;
use hicache_index::service::Service;
use serde_json::json;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(20);
const PS: u32 = 4;

fn python(var: &str, require: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            assert!(
                std::env::var(require).as_deref() != Ok("1"),
                "{require}=1 but {var} is not set"
            );
            eprintln!(
                "skipped: set {var} to a python with the engine (--no-deps), msgspec, pyzmq, pydantic"
            );
            None
        }
    }
}

struct Engine {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    endpoint: String,
    replay: String,
}

impl Engine {
    fn start(python: &str, engine: &str) -> Engine {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/python/engine_publisher.py"
        );
        let mut child = Command::new(python)
            .arg(script)
            .arg(engine)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python starts");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        Engine {
            child,
            stdin,
            stdout,
            endpoint: v["endpoint"].as_str().unwrap().into(),
            replay: v["replay_endpoint"].as_str().unwrap().into(),
        }
    }

    fn send(&mut self, cmd: serde_json::Value) {
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ok", "the publisher answered {line:?}");
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"quit": true}));
        let _ = self.child.wait();
    }
}

fn toks(n: u32, base: u32) -> Vec<u32> {
    (base..base + n).collect()
}

async fn engine_feeds_the_index(python: String, engine: &str, media: [&'static str; 3]) {
    let idx = start(Service::new(config())).await;
    let mut e = tokio::task::spawn_blocking({
        let engine = engine.to_string();
        move || Engine::start(&python, &engine)
    })
    .await
    .unwrap();
    let stored = |hashes: &[i64], parent: Option<i64>, tokens: Vec<u32>, medium: &str| json!({"stored": hashes, "parent": parent, "tokens": tokens, "block_size": PS, "medium": medium});
    // Before the index subscribes: only the replay endpoint can bring it.
    e.send(stored(&[-11, 12], None, toks(8, 0), media[0]));
    let reg = json!({
        "instance": engine, "endpoint": e.endpoint, "replay_endpoint": e.replay, "topic": "kv",
        "format": engine, "model": "m", "page_size": PS,
    });
    post_json(idx.addr, "/register", &reg).await;
    let addr = idx.addr;
    let id = engine.to_string();
    let t = wait_for(LIMIT, "the replayed batch", || {
        let id = id.clone();
        async move { tiers(&query(addr, "m", &toks(16, 0)).await, &id) == (8, 8, 8) }
    })
    .await;
    println!("{engine}: the batch published before subscribing arrived through replay in {t:?}");
    e = tokio::task::spawn_blocking(move || {
        e.send(stored(&[13], Some(12), toks(4, 8), media[1]));
        e.send(stored(&[14], Some(13), toks(4, 12), media[2]));
        e.send(json!({"removed": [12], "medium": media[0]}));
        e
    })
    .await
    .unwrap();
    let id2 = id.clone();
    wait_for(LIMIT, "the live batches", || {
        let id = id2.clone();
        async move { tiers(&query(addr, "m", &toks(16, 0)).await, &id) == (4, 4, 4) }
    })
    .await;
    // The removed block breaks the chain in L1; put it in L2 and the whole chain shows.
    let e = tokio::task::spawn_blocking(move || {
        let mut e = e;
        e.send(stored(&[12], Some(-11), toks(4, 4), media[1]));
        e
    })
    .await
    .unwrap();
    wait_for(LIMIT, "every tier", || {
        let id = id.clone();
        async move { tiers(&query(addr, "m", &toks(16, 0)).await, &id) == (4, 12, 16) }
    })
    .await;
    let st = instances(addr).await;
    assert_eq!(st[0]["bad_payloads"], json!(0), "{st}");
    assert_eq!(st[0]["malformed"], json!(0), "{st}");
    assert_eq!(st[0]["last_seq"], json!(4), "{st}");
    tokio::task::spawn_blocking(move || drop(e)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglangs_own_publisher_feeds_the_index() {
    let Some(py) = python("HICACHE_SGLANG_PYTHON", "HICACHE_REQUIRE_SGLANG") else {
        return;
    };
    engine_feeds_the_index(py, "sglang", ["GPU", "CPU_PINNED", "EXTERNAL"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_own_publisher_feeds_the_index() {
    let Some(py) = python("HICACHE_VLLM_PYTHON", "HICACHE_REQUIRE_VLLM") else {
        return;
    };
    engine_feeds_the_index(py, "vllm", ["GPU", "CPU", "STORAGE"]).await;
}

/// `POST /route` of `tokens`: the instance and its credited L1 tokens.
async fn route_l1(addr: std::net::SocketAddr, model: &str, tokens: &[u32]) -> (String, u64) {
    let a = post_json(
        addr,
        "/route",
        &json!({"model": model, "token_ids": tokens}),
    )
    .await;
    (
        a["instance"].as_str().unwrap_or_default().to_string(),
        a["overlap"]["l1"].as_u64().unwrap_or(0),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_own_publisher_feeds_a_hybrid_models_groups() {
    let Some(py) = python("HICACHE_VLLM_PYTHON", "HICACHE_REQUIRE_VLLM") else {
        return;
    };
    let idx = start(Service::new(config())).await;
    let mut e = tokio::task::spawn_blocking(move || Engine::start(&py, "vllm"))
        .await
        .unwrap();
    let reg = json!({
        "instance": "v", "endpoint": e.endpoint, "replay_endpoint": e.replay, "topic": "kv",
        "format": "vllm", "model": "h", "page_size": PS,
    });
    post_json(idx.addr, "/register", &reg).await;
    let addr = idx.addr;
    // A Mamba model: four Full blocks (group 0), and the state of the second block only
    // (group 1), as vLLM publishes a hybrid's groups.
    e = tokio::task::spawn_blocking(move || {
        e.send(
            json!({"stored": [21, 22, 23, 24], "parent": null, "tokens": toks(16, 0),
            "block_size": PS, "medium": "GPU", "group_idx": 0, "kind": "full_attention"}),
        );
        e.send(json!({"stored": [22], "parent": 21, "tokens": toks(4, 4),
            "block_size": PS, "medium": "GPU", "group_idx": 1, "kind": "mamba"}));
        e
    })
    .await
    .unwrap();
    // Every Full block is in the index; the route of a 17-token prompt (an engine computes
    // at least its last token) credits only the 8 tokens the state restores (the hybrid
    // tree's rule), never the 16 Full tokens alone would claim.
    wait_for(LIMIT, "the Full blocks", || async move {
        tiers(&query(addr, "h", &toks(16, 0)).await, "v").0 == 16
    })
    .await;
    wait_for(LIMIT, "the Mamba state's credit", || async move {
        route_l1(addr, "h", &toks(17, 0)).await == ("v".to_string(), 8)
    })
    .await;
    // A state of the last block too: the whole prompt is reusable.
    e = tokio::task::spawn_blocking(move || {
        e.send(json!({"stored": [24], "parent": 23, "tokens": toks(4, 12),
            "block_size": PS, "medium": "GPU", "group_idx": 1, "kind": "mamba"}));
        e
    })
    .await
    .unwrap();
    wait_for(LIMIT, "the second state's credit", || async move {
        route_l1(addr, "h", &toks(17, 0)).await.1 == 16
    })
    .await;
    // Both states removed (group 1): no block of this prefix is reusable any more.
    e = tokio::task::spawn_blocking(move || {
        e.send(json!({"removed": [22, 24], "medium": "GPU", "group_idx": 1}));
        e
    })
    .await
    .unwrap();
    wait_for(LIMIT, "the credit gone with the states", || async move {
        route_l1(addr, "h", &toks(17, 0)).await.1 == 0
    })
    .await;
    let st = instances(addr).await;
    assert_eq!(st[0]["bad_payloads"], json!(0), "{st}");
    assert_eq!(st[0]["malformed"], json!(0), "{st}");
    tokio::task::spawn_blocking(move || drop(e)).await.unwrap();
}
