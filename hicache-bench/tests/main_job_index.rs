//! The main job as a real publisher of the fleet index: `multiturn --compare --kv-events …
//! --kv-events-hold …` (tiny workload) publishes every run's KV events on loopback; a
//! `hicache-index` service (the library's hub and HTTP API, in process) registers on the
//! endpoint once the job's last run is over and holds its publisher open, replays the whole
//! stream, and its `/query` answers for every prompt of the workload equal what the engine
//! really holds at the end: L1 and L2 from the cache's own radix tree, L3 from the L3
//! directory the cache wrote, opened again through the backend registry.
//!
//! Loopback only, every wait bounded, nothing timed.

use std::cell::Cell;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

mod common;

use hicache_bench::cmd::multiturn::{self, MultiturnArgs};
use hicache_core::{HiRadixTree, NodeId, PageHasher, PageKey, TenantId};
use hicache_index::driver::Hub;
use hicache_index::http::{HttpLimits, serve};
use hicache_index::service::{Service, ServiceConfig};
use hicache_index::transport::ZmtpTransport;
use hicache_sim::adapter::{HiCacheUnderTest, config_for};
use hicache_sim::cache::{
    Admission, CacheResult, CacheStats, CacheUnderTest, DeviceSlot, KvEventsState, PrefetchStatus,
    RequestId,
};
use hicache_sim::links::Links;
use hicache_sim::setup::{CacheFactory, CacheSetup};
use hicache_storage::BackendContext;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PAGE: usize = 16;
/// Every wait of the test ends within this.
const LIMIT: Duration = Duration::from_secs(120);

/// (l1, l2, l3) in tokens of whole pages, each cumulative through the faster tiers.
type Tiers = (u64, u64, u64);

/// What the engine holds at the end of the job's last run, per probe, and how many batches
/// its publisher was given (all of them: the run is over).
struct Final {
    truth: Vec<Tiers>,
    batches: u64,
}

/// The cache's own view of `tokens`: per leading page of its tree, whether it is on device
/// and whether on host (the walk `match_prefix` makes, read-only).
fn tree_pages(tree: &HiRadixTree, tokens: &[u32]) -> Vec<(bool, bool)> {
    let mut out = Vec::new();
    let mut node: NodeId = tree.tenant_root(TenantId::DEFAULT).unwrap();
    let mut at = 0;
    'walk: while at + PAGE <= tokens.len() {
        for child in tree.children(node).unwrap() {
            let key = tree.tokens(child).unwrap();
            if key[..PAGE] != tokens[at..at + PAGE] {
                continue;
            }
            let info = tree.node_info(child).unwrap();
            let common = key
                .chunks(PAGE)
                .zip(tokens[at..].chunks_exact(PAGE))
                .take_while(|(a, b)| a == b)
                .count();
            out.extend(std::iter::repeat_n(
                (info.on_device, info.backed_up),
                common,
            ));
            at += common * PAGE;
            if common * PAGE < key.len() {
                break 'walk;
            }
            node = child;
            continue 'walk;
        }
        break;
    }
    out
}

/// The truth for every probe: L1 and L2 runs from the tree, L3 from the tree's run plus the
/// pages after it that the L3 directory holds (its backend's own `batch_exists`).
fn truth_of(cache: &hicache::HiCache, setup: &CacheSetup, probes: &[Vec<u32>]) -> Vec<Tiers> {
    let tree = cache.tree();
    let start = tree.chain_start(TenantId::DEFAULT).unwrap().unwrap();
    let hasher = PageHasher::new(cache.config().hash_mode, cache.namespace()).unwrap();
    let storage_cfg = config_for(setup).unwrap().storage_config().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let storage = storage_cfg.map(|cfg| {
        let ctx = BackendContext {
            page_bytes: setup.kv_shape.page_bytes(),
            layout: setup.mem_layout,
            namespace: Some(start.namespace_id),
            ..BackendContext::default()
        };
        let registry = hicache::backends::builtin_registry().unwrap();
        rt.block_on(registry.open(&cfg, &ctx)).unwrap()
    });
    probes
        .iter()
        .map(|tokens| {
            let pages = tree_pages(tree, tokens);
            let l1 = pages.iter().take_while(|p| p.0).count();
            let l2 = pages.iter().take_while(|p| p.0 || p.1).count();
            assert_eq!(l2, pages.len(), "every tree page is on device or host");
            let whole = tokens.len() / PAGE * PAGE;
            let keys: Vec<PageKey> = hasher
                .hash_pages(start.prior, &tokens[..whole])
                .into_iter()
                .map(|hash| PageKey {
                    namespace: start.namespace_id,
                    hash,
                })
                .collect();
            let in_l3 = match &storage {
                Some(s) if l2 < keys.len() => rt.block_on(s.batch_exists(&keys[l2..])).unwrap(),
                _ => 0,
            };
            let tokens_of = |pages: usize| (pages * PAGE) as u64;
            (tokens_of(l1), tokens_of(l2), tokens_of(l2 + in_l3))
        })
        .collect()
}

/// The real cache, watched: when the job's hold first asks for its publisher (the run is over
/// and the cache shut down), the truth is taken and sent.
struct Watched {
    inner: HiCacheUnderTest,
    setup: CacheSetup,
    probes: Arc<Vec<Vec<u32>>>,
    done: mpsc::Sender<Final>,
    sent: Cell<bool>,
}

impl CacheUnderTest for Watched {
    fn page_size(&self) -> usize {
        self.inner.page_size()
    }
    fn device_pages(&self) -> usize {
        self.inner.device_pages()
    }
    fn arrive(&mut self, req: RequestId, tokens: &[u32]) -> CacheResult<()> {
        self.inner.arrive(req, tokens)
    }
    fn poll(&mut self) -> CacheResult<()> {
        self.inner.poll()
    }
    fn advance(&mut self, now: f64, links: &mut Links) -> CacheResult<()> {
        self.inner.advance(now, links)
    }
    fn next_completion(&self) -> Option<f64> {
        self.inner.next_completion()
    }
    fn prefetch_status(&mut self, req: RequestId) -> CacheResult<PrefetchStatus> {
        self.inner.prefetch_status(req)
    }
    fn admit(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        new_tokens: usize,
    ) -> CacheResult<Option<Admission>> {
        self.inner.admit(req, tokens, new_tokens)
    }
    fn start_loading(&mut self) -> CacheResult<Option<usize>> {
        self.inner.start_loading()
    }
    fn wait_layer(&mut self, idx: usize, layer: usize) -> CacheResult<()> {
        self.inner.wait_layer(idx, layer)
    }
    fn cache_finished(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        slots: &[DeviceSlot],
    ) -> CacheResult<()> {
        self.inner.cache_finished(req, tokens, slots)
    }
    fn shutdown(&mut self) -> CacheResult<()> {
        self.inner.shutdown()
    }
    fn stats(&self) -> CacheStats {
        self.inner.stats()
    }
    fn kv_events(&self) -> Option<KvEventsState> {
        let state = self.inner.kv_events();
        if !self.sent.replace(true) {
            let truth = truth_of(self.inner.cache(), &self.setup, &self.probes);
            let batches = state.as_ref().map_or(0, |s| s.progress.queued);
            let _ = self.done.send(Final { truth, batches });
        }
        state
    }
}

/// Builds [`Watched`] caches (every run's; only the last run's is asked for its publisher).
struct Watching {
    probes: Arc<Vec<Vec<u32>>>,
    done: Mutex<mpsc::Sender<Final>>,
}

impl CacheFactory for Watching {
    fn build(&self, setup: &CacheSetup) -> hicache_sim::Result<Box<dyn CacheUnderTest>> {
        Ok(Box::new(Watched {
            inner: HiCacheUnderTest::build(setup, false)?,
            setup: setup.clone(),
            probes: self.probes.clone(),
            done: self.done.lock().unwrap().clone(),
            sent: Cell::new(false),
        }))
    }
}

/// A loopback port free now (the job binds it a moment later).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One HTTP/1.1 request to the index; the status and the JSON body.
async fn http(addr: SocketAddr, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("the index answers within 10 s")
        .unwrap();
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let json = text
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b).ok())
        .unwrap_or(Value::Null);
    (status, json)
}

/// The tiny workload with the dense table's every column (no hybrid models).
fn tiny(extra: &[&str], dir: &std::path::Path) -> MultiturnArgs {
    let mut all = vec!["--compare", "--no-hybrid"];
    all.extend_from_slice(extra);
    common::tiny(&all, dir)
}

#[test]
fn the_index_subscribed_to_the_main_job_answers_what_the_engine_holds() {
    let dir = tempfile::tempdir().unwrap();
    let (pub_port, replay_port) = (free_port(), free_port());
    let endpoint = format!("tcp://127.0.0.1:{pub_port}");
    let replay = format!("tcp://127.0.0.1:{replay_port}");
    let kv = json!({
        "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv",
    })
    .to_string();
    let args = tiny(&["--kv-events", &kv, "--kv-events-hold", "120"], dir.path());

    // Probes: every turn's prompt and prompt + answer, of every conversation.
    let plan = hicache_sim::plan::plan(&args).unwrap();
    let probes: Vec<Vec<u32>> = plan
        .conversations
        .iter()
        .flat_map(|c| {
            (0..c.turns.len()).flat_map(move |r| [c.prompt(r).to_vec(), c.with_answer(r).to_vec()])
        })
        .collect();
    let probes = Arc::new(probes);
    let (done_tx, done_rx) = mpsc::channel();
    let factory = Watching {
        probes: probes.clone(),
        done: Mutex::new(done_tx),
    };

    std::thread::scope(|scope| {
        let job = scope.spawn(|| multiturn::run(&args, Vec::new(), &factory));
        // The job's last run is over; its publisher stays open for us.
        let fin = done_rx
            .recv_timeout(LIMIT)
            .expect("the job's last run reaches its hold");
        assert!(fin.batches > 0, "the last run published KV events");

        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let svc = Service::new(ServiceConfig {
                replay_timeout: Duration::from_secs(60),
                dead_after: Duration::from_secs(3600),
                ..ServiceConfig::default()
            });
            let hub = Hub::new(svc, ZmtpTransport::default());
            hub.start_all();
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let server = tokio::spawn(serve(listener, hub.clone(), HttpLimits::default()));

            let reg = json!({
                "instance": "main-job", "endpoint": endpoint, "replay_endpoint": replay,
                "topic": "kv", "format": "sglang", "model": "llama", "page_size": PAGE,
            });
            let (status, body) = http(addr, "POST", "/register", &reg).await;
            assert_eq!(status, 200, "{body}");

            // Caught up: every batch of the last run applied (through the replay), no replay
            // running. Bounded.
            let last = fin.batches - 1;
            let t = Instant::now();
            let stream = loop {
                let (_, inst) = http(addr, "GET", "/instances", &Value::Null).await;
                let s = inst[0].clone();
                if s["last_seq"] == json!(last) && s["replaying"] == json!(false) {
                    break s;
                }
                assert!(t.elapsed() < LIMIT, "not caught up within {LIMIT:?}: {s}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            assert_eq!(stream["stream"]["lost_gaps"], json!(0), "{stream}");
            assert!(
                stream["stream"]["replayed_batches"].as_u64().unwrap() >= 1,
                "{stream}"
            );

            let mut held = 0;
            for (tokens, want) in probes.iter().zip(&fin.truth) {
                let q = json!({"model": "llama", "token_ids": tokens});
                let (status, answer) = http(addr, "POST", "/query", &q).await;
                assert_eq!(status, 200, "{answer}");
                let i = &answer["instances"]["main-job"];
                let got = (
                    i["l1"].as_u64().unwrap_or(0),
                    i["l2"].as_u64().unwrap_or(0),
                    i["l3"].as_u64().unwrap_or(0),
                );
                assert_eq!(
                    got,
                    *want,
                    "prompt of {} tokens: index {answer} vs the engine's (l1, l2, l3)",
                    tokens.len()
                );
                held += usize::from(want.2 > 0);
            }
            assert!(held > 0, "the engine holds some prompt's prefix at the end");
            let deeper = |f: fn(&Tiers) -> bool| fin.truth.iter().filter(|t| f(t)).count();
            let (l2_beyond_l1, l3_beyond_l2) = (deeper(|t| t.1 > t.0), deeper(|t| t.2 > t.1));
            println!(
                "{} probes, {held} held, {l2_beyond_l1} deeper in L2 than L1, {l3_beyond_l2} \
                 deeper in L3 than L2; stream {}",
                probes.len(),
                stream["stream"]
            );
            assert!(
                l2_beyond_l1 > 0 && l3_beyond_l2 > 0,
                "the last run leaves prefixes in every tier"
            );
            server.abort();
        });

        let report = job.join().unwrap().unwrap();
        assert!(report.check().is_empty(), "{:?}", report.check());
    });
}

#[test]
fn kv_events_hold_needs_a_replay_endpoint_and_a_sane_duration() {
    let dir = tempfile::tempdir().unwrap();
    let no_replay = r#"{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0"}"#;
    for (extra, named) in [
        (vec!["--kv-events-hold", "5"], "--kv-events"),
        (
            vec!["--kv-events", no_replay, "--kv-events-hold", "5"],
            "replay_endpoint",
        ),
        (
            vec!["--kv-events", no_replay, "--kv-events-hold=-1"],
            "--kv-events-hold",
        ),
        (
            vec!["--kv-events", no_replay, "--kv-events-hold=1e9"],
            "--kv-events-hold",
        ),
    ] {
        let e = hicache_sim::plan::plan(&tiny(&extra, dir.path())).unwrap_err();
        assert!(e.to_string().contains(named), "{extra:?}: {e}");
        let e = multiturn::run(&tiny(&extra, dir.path()), Vec::new(), &Fails).unwrap_err();
        assert_eq!(e.exit_code(), 2, "{extra:?}: {e}");
    }
}

/// A factory the validation errors above must stop before.
struct Fails;

impl CacheFactory for Fails {
    fn build(&self, _: &CacheSetup) -> hicache_sim::Result<Box<dyn CacheUnderTest>> {
        panic!("a bad --kv-events-hold is an error before any run");
    }
}
