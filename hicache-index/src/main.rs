//! `hicache-index`: the fleet's KV index as a service. See the crate's README and the user
//! guide's "Fleet KV index" section.

use clap::Parser;
use hicache_index::driver::Hub;
use hicache_index::http::{HttpLimits, serve};
use hicache_index::router::Policy;
use hicache_index::routing::RoutingConfig;
use hicache_index::service::{Service, ServiceConfig};
use hicache_index::snapshot;
use hicache_index::transport::ZmtpTransport;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The fleet's KV index: subscribes to engines' KV events and answers which instance, tier and
/// L3 store holds each prefix.
#[derive(Parser, Debug)]
#[command(name = "hicache-index", version)]
struct Args {
    /// Address of the HTTP API, e.g. 127.0.0.1:8420.
    #[arg(long)]
    listen: String,
    /// Directory of the snapshot (loaded at start, written every --snapshot-secs and at exit).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Start from a peer's state (`GET /dump` of another hicache-index at HOST:PORT) when the
    /// data directory has no snapshot; the streams then catch up through replay.
    #[arg(long)]
    warm_from: Option<String>,
    /// Holder-blocks per model index at most (least recently stored evicted first).
    #[arg(long)]
    capacity: Option<u64>,
    /// Seconds an instance may stay disconnected before its entries are dropped.
    #[arg(long, default_value_t = 60)]
    dead_after_secs: u64,
    /// Milliseconds a replay may take before it counts as failed (the stream is fenced).
    #[arg(long, default_value_t = 2000)]
    replay_timeout_ms: u64,
    /// Seconds a shared L3 store's page is kept without being stored again (the bound on
    /// reporting a page a store lost without an event).
    #[arg(long, default_value_t = 600)]
    store_ttl_secs: u64,
    /// Seconds between snapshots (with --data-dir).
    #[arg(long, default_value_t = 30)]
    snapshot_secs: u64,
    /// HTTP connections open at once.
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// Largest HTTP request body in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_body: usize,
    /// Routing policy of `POST /route`: hicache, dynamo-linear, sglang-cache-aware,
    /// least-load or round-robin.
    #[arg(long, default_value = "hicache", value_parser = parse_policy)]
    router: Policy,
    /// Milliseconds a routing decision waits for the index before it falls back to least-load.
    #[arg(long, default_value_t = 5.0)]
    router_deadline_ms: f64,
    /// hicache policy: prefill time per computed token (µs; default: Llama-3-8B on an H100).
    #[arg(long)]
    prefill_us_per_token: Option<f64>,
    /// hicache policy: attention time per (query, key) pair (ns).
    #[arg(long)]
    attention_ns_per_pair: Option<f64>,
    /// hicache policy: decode step time, weights only (ms).
    #[arg(long)]
    decode_ms_per_step: Option<f64>,
    /// hicache policy: KV bytes per token of the model.
    #[arg(long)]
    kv_bytes_per_token: Option<f64>,
    /// hicache policy: L2 → L1 (host to device) rate in GB/s.
    #[arg(long)]
    h2d_gbps: Option<f64>,
    /// hicache policy: latency of an L3 read before its first byte (ms).
    #[arg(long)]
    l3_latency_ms: Option<f64>,
    /// hicache policy: mean answer length in tokens (the memory term, for instances
    /// registered with `kv_capacity_tokens`).
    #[arg(long)]
    answer_tokens: Option<f64>,
    /// Rate at which an instance reads its L3 (its shared store or its own), GB/s.
    #[arg(long, default_value_t = 10.0)]
    l3_read_gbps: f64,
}

fn parse_policy(s: &str) -> Result<Policy, String> {
    s.parse()
}

fn positive(name: &str, v: f64) -> Result<f64, String> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("--{name} must be a positive number, got {v}"))
    }
}

fn routing(args: &Args) -> Result<RoutingConfig, String> {
    let mut r = RoutingConfig {
        policy: args.router,
        ..RoutingConfig::default()
    };
    if !(args.router_deadline_ms.is_finite() && args.router_deadline_ms >= 0.0) {
        return Err(format!(
            "--router-deadline-ms must be a non-negative number, got {}",
            args.router_deadline_ms
        ));
    }
    r.deadline = Duration::from_secs_f64(args.router_deadline_ms / 1e3);
    r.l3_read_bytes_per_s = positive("l3-read-gbps", args.l3_read_gbps)? * 1e9;
    let c = &mut r.cost;
    if let Some(v) = args.prefill_us_per_token {
        c.prefill_s_per_token = positive("prefill-us-per-token", v)? * 1e-6;
    }
    if let Some(v) = args.attention_ns_per_pair {
        c.attention_s_per_pair = positive("attention-ns-per-pair", v)? * 1e-9;
    }
    if let Some(v) = args.decode_ms_per_step {
        c.decode_s_per_step = positive("decode-ms-per-step", v)? * 1e-3;
    }
    if let Some(v) = args.kv_bytes_per_token {
        c.kv_bytes_per_token = positive("kv-bytes-per-token", v)?;
    }
    if let Some(v) = args.h2d_gbps {
        c.h2d_bytes_per_s = positive("h2d-gbps", v)? * 1e9;
    }
    if let Some(v) = args.l3_latency_ms {
        c.l3_latency_s = positive("l3-latency-ms", v)? * 1e-3;
    }
    if let Some(v) = args.answer_tokens {
        c.answer_tokens = positive("answer-tokens", v)?;
    }
    Ok(r)
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("hicache-index: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    let cfg = ServiceConfig {
        capacity: args.capacity,
        replay_timeout: Duration::from_millis(args.replay_timeout_ms.max(1)),
        dead_after: Duration::from_secs(args.dead_after_secs),
        store_ttl: Duration::from_secs(args.store_ttl_secs.max(1)),
        routing: routing(&args)?,
    };
    let mut svc = Service::new(cfg);
    if let Some(dir) = &args.data_dir {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let t = Instant::now();
        match snapshot::load(&mut svc, dir, 0).map_err(|e| e.to_string())? {
            Some(n) => tracing::info!(
                entries = n,
                streams = svc.stream_ids().len(),
                ms = t.elapsed().as_millis() as u64,
                "snapshot loaded; streams catch up through replay"
            ),
            None => tracing::info!(dir = %dir.display(), "no snapshot yet"),
        }
    }
    if let Some(peer) = &args.warm_from
        && svc.stream_ids().is_empty()
    {
        let t = Instant::now();
        let bytes = fetch_dump(peer).await?;
        let n = snapshot::restore(&mut svc, std::path::Path::new(peer), &bytes, 0)
            .map_err(|e| format!("warm start from {peer}: {e}"))?;
        tracing::info!(
            peer,
            entries = n,
            ms = t.elapsed().as_millis() as u64,
            "warm start from a peer's dump"
        );
    }
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let hub = Hub::new(svc, ZmtpTransport::default());
    hub.start_all();
    tracing::info!(listen = %args.listen, "serving");
    let limits = HttpLimits {
        max_connections: args.max_connections.max(1),
        max_body: args.max_body,
        ..HttpLimits::default()
    };
    let server = tokio::spawn(serve(listener, hub.clone(), limits));
    if let Some(dir) = args.data_dir.clone() {
        let hub = hub.clone();
        let period = Duration::from_secs(args.snapshot_secs.max(1));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                save(&hub, &dir).await;
            }
        });
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("cannot watch SIGTERM: {e}"))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    server.abort();
    if let Some(dir) = &args.data_dir {
        save(&hub, dir).await;
    }
    Ok(())
}

async fn save(hub: &std::sync::Arc<Hub<ZmtpTransport>>, dir: &std::path::Path) {
    let t = Instant::now();
    let bytes = snapshot::encode(&hub.service().lock());
    let dir = dir.to_path_buf();
    let len = bytes.len();
    match tokio::task::spawn_blocking(move || snapshot::write(&dir, &bytes)).await {
        Ok(Ok(())) => tracing::info!(
            bytes = len,
            ms = t.elapsed().as_millis() as u64,
            "snapshot written"
        ),
        Ok(Err(e)) => tracing::error!("snapshot not written: {e}"),
        Err(e) => tracing::error!("snapshot task failed: {e}"),
    }
}

/// `GET /dump` of a peer (plain HTTP/1.1, the body read to the end of the connection).
async fn fetch_dump(peer: &str) -> Result<Vec<u8>, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let err = |e: std::io::Error| format!("warm start from {peer}: {e}");
    let mut s = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::net::TcpStream::connect(peer),
    )
    .await
    .map_err(|_| format!("warm start from {peer}: connect timed out"))?
    .map_err(err)?;
    s.write_all(
        format!("GET /dump HTTP/1.1\r\nhost: {peer}\r\nconnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .map_err(err)?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(300), s.read_to_end(&mut out))
        .await
        .map_err(|_| format!("warm start from {peer}: the dump took over 300 s"))?
        .map_err(err)?;
    let end = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("warm start from {peer}: not an HTTP answer"))?;
    let head = String::from_utf8_lossy(&out[..end]).to_string();
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!(
            "warm start from {peer}: {}",
            head.lines().next().unwrap_or("")
        ));
    }
    Ok(out.split_off(end + 4))
}
