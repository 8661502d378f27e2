//! Test support: an index service on loopback with its HTTP API, and a raw HTTP client.
#![allow(dead_code)]

use hicache_index::driver::Hub;
use hicache_index::http::{HttpLimits, serve};
use hicache_index::service::{Service, ServiceConfig};
use hicache_index::transport::{Transport, ZmtpTransport};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A running index: its hub and the address of its HTTP API.
pub struct Running<T: Transport = ZmtpTransport> {
    pub hub: Arc<Hub<T>>,
    pub addr: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl<T: Transport> Drop for Running<T> {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Starts an index over `svc` (restored or empty) on 127.0.0.1:0.
pub async fn start(svc: Service) -> Running {
    start_with(svc, ZmtpTransport::default()).await
}

/// [`start`] over another transport.
pub async fn start_with<T: Transport>(svc: Service, transport: T) -> Running<T> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hub = Hub::new(svc, transport);
    hub.start_all();
    let limits = HttpLimits {
        max_connections: 8,
        max_body: 64 << 10,
        ..HttpLimits::default()
    };
    let server = tokio::spawn(serve(listener, hub.clone(), limits));
    Running { hub, addr, server }
}

pub fn config() -> ServiceConfig {
    ServiceConfig {
        dead_after: Duration::from_secs(3600),
        ..ServiceConfig::default()
    }
}

/// One HTTP/1.1 request; returns the status and the body.
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("the server answers within 10 s")
        .unwrap();
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    (status, body)
}

pub async fn post_json(addr: SocketAddr, path: &str, v: &Value) -> Value {
    let (status, body) = http(addr, "POST", path, &v.to_string()).await;
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

pub async fn query(addr: SocketAddr, model: &str, tokens: &[u32]) -> Value {
    post_json(
        addr,
        "/query",
        &serde_json::json!({"model": model, "token_ids": tokens}),
    )
    .await
}

pub async fn instances(addr: SocketAddr) -> Value {
    let (status, body) = http(addr, "GET", "/instances", "").await;
    assert_eq!(status, 200);
    serde_json::from_str(&body).unwrap()
}

/// Polls `cond` every 10 ms for at most `limit`; returns how long it took, or panics with
/// `what`.
pub async fn wait_for<F, Fut>(limit: Duration, what: &str, mut cond: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t = Instant::now();
    while t.elapsed() < limit {
        if cond().await {
            return t.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("not within {limit:?}: {what}");
}

/// The `l1`, `l2`, `l3` of `id` in a query answer (zeros when absent).
pub fn tiers(answer: &Value, id: &str) -> (u64, u64, u64) {
    let i = &answer["instances"][id];
    (
        i["l1"].as_u64().unwrap_or(0),
        i["l2"].as_u64().unwrap_or(0),
        i["l3"].as_u64().unwrap_or(0),
    )
}
