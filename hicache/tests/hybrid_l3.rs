//! L3 for the hybrid facade: pages written L1 → L2 → L3 by one cache come back
//! L3 → L2 → L1 in a new cache over the same L3 directory, byte-equal per component (Full
//! pages, SWA pages in the window, the Mamba state); the hit policy decides how far.

mod common;
mod hybrid_common;

use std::path::Path;
use std::sync::Arc;

use hicache::{HybridCache, HybridConfig, StorageConfig};
use hicache_storage::{BackendContext, Storage};
use hybrid_common::{Engine, extended, prompt};

const PS: u32 = 4;

fn file_storage(dir: &Path) -> Arc<dyn Storage> {
    let extra = format!(r#"{{"dir": "{}"}}"#, dir.display());
    let cfg = StorageConfig::parse(Some("file"), Some(&extra)).unwrap();
    let registry = hicache::backends::builtin_registry().unwrap();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(registry.open(&cfg, &BackendContext::default()))
        .unwrap()
}

fn cache(swa: bool, mamba: bool, storage: Arc<dyn Storage>) -> HybridCache {
    let cfg = HybridConfig {
        page_size: PS,
        swa_window: swa.then_some(8),
        mamba_chunk: mamba.then_some(8),
        prefetch_threshold_tokens: 8,
        ..Default::default()
    };
    hybrid_common::builder(cfg, 32)
        .storage(storage)
        .build()
        .unwrap()
}

fn l3_round_trip(swa: bool, mamba: bool) {
    let dir = tempfile::tempdir().unwrap();
    let a = prompt(1, 40);
    {
        let mut e = Engine::new(cache(swa, mamba, file_storage(dir.path())));
        e.turn(&a);
        let t = e.cache.metrics();
        assert_eq!(t.full.pages_l2_to_l3, 10, "{t:?}");
        // Every SWA page backed up to host goes to L3 too.
        assert_eq!(t.swa.pages_l2_to_l3, t.swa.pages_d2h, "{t:?}");
        assert_eq!(t.swa.pages_l2_to_l3 > 0, swa, "{t:?}");
        assert_eq!(t.mamba.pages_l2_to_l3, u64::from(mamba), "{t:?}");
        e.cache.shutdown().unwrap();
    }
    // A new cache (empty L1 and L2) over the same directory.
    let mut e = Engine::new(cache(swa, mamba, file_storage(dir.path())));
    let run = e.run(&extended(&a, 3, 24));
    assert_eq!(run.admission.device_tokens, 0);
    assert_eq!(run.admission.host_tokens, 40, "{run:?}");
    assert_eq!(run.admission.storage_tokens, 40, "{run:?}");
    assert_eq!(run.checked[0], 10, "every Full page checked");
    if swa {
        assert_eq!(run.checked[1], 2, "the window's SWA pages checked");
    }
    assert_eq!(run.checked[2], usize::from(mamba), "the state checked");
    let t = e.cache.metrics();
    assert_eq!(t.full.hit_tokens_l3, 40);
    assert_eq!(t.full.pages_l3_to_l2, 10);
    assert_eq!(t.mamba.pages_l3_to_l2, u64::from(mamba));
    e.settle();
    e.cache.shutdown().unwrap();
}

#[test]
fn full_swa_pages_come_back_from_l3_in_a_new_cache() {
    l3_round_trip(true, false);
}

#[test]
fn full_mamba_pages_come_back_from_l3_in_a_new_cache() {
    l3_round_trip(false, true);
}

#[test]
fn full_swa_mamba_pages_come_back_from_l3_in_a_new_cache() {
    l3_round_trip(true, true);
}

#[test]
fn a_prompt_shorter_than_the_threshold_is_not_prefetched() {
    let dir = tempfile::tempdir().unwrap();
    let a = prompt(1, 8);
    {
        let mut e = Engine::new(cache(true, true, file_storage(dir.path())));
        e.turn(&a);
        e.cache.shutdown().unwrap();
    }
    let mut e = Engine::new(cache(true, true, file_storage(dir.path())));
    let run = e.run(&a);
    assert_eq!(run.admission.cached_tokens(), 0, "{run:?}");
    e.cache.shutdown().unwrap();
}

/// A prefetch of a span below a cached prefix (not from the root), KV events off: the new
/// cache computed the first 16 tokens itself; the rest of the prompt comes from L3.
fn prefetch_below_a_cached_prefix(swa: bool, mamba: bool) {
    let dir = tempfile::tempdir().unwrap();
    let a = prompt(1, 40);
    {
        let mut e = Engine::new(cache(swa, mamba, file_storage(dir.path())));
        e.turn(&a);
        e.cache.shutdown().unwrap();
    }
    let mut e = Engine::new(cache(swa, mamba, file_storage(dir.path())));
    e.turn(&a[..17]);
    let run = e.run(&extended(&a, 3, 24));
    // Before the fix this path panicked (page identities taken from events that were off).
    assert_eq!(run.admission.device_tokens, 16, "{run:?}");
    assert_eq!(run.admission.host_tokens, 24, "{run:?}");
    assert_eq!(run.admission.storage_tokens, 24, "{run:?}");
    assert_eq!(run.checked[0], 10, "every Full page checked");
    e.settle();
    e.assert_no_leaks();
    e.cache.shutdown().unwrap();
}

#[test]
fn full_prefetch_below_a_cached_prefix() {
    prefetch_below_a_cached_prefix(false, false);
}

#[test]
fn full_swa_prefetch_below_a_cached_prefix() {
    prefetch_below_a_cached_prefix(true, false);
}

#[test]
fn full_swa_mamba_prefetch_below_a_cached_prefix() {
    prefetch_below_a_cached_prefix(true, true);
}

/// A backend whose every call fails.
struct Down;

#[hicache_storage::async_trait]
impl Storage for Down {
    fn info(&self) -> hicache_storage::BackendInfo {
        hicache_storage::BackendInfo::new("down", 2)
    }
    async fn batch_exists(&self, _: &[hicache_core::PageKey]) -> hicache_storage::Result<usize> {
        Err(hicache::StorageError::backend("down", "unreachable"))
    }
    async fn batch_get(
        &self,
        _: &[hicache_core::PageKey],
        _: &mut [hicache_storage::PageBufMut<'_>],
    ) -> hicache_storage::Result<Vec<hicache_storage::PageOutcome>> {
        Err(hicache::StorageError::backend("down", "unreachable"))
    }
    async fn batch_set(
        &self,
        _: &[hicache_core::PageKey],
        _: &[hicache_storage::PageBuf<'_>],
    ) -> hicache_storage::Result<Vec<hicache_storage::PageOutcome>> {
        Err(hicache::StorageError::backend("down", "unreachable"))
    }
    async fn delete(&self, _: &[hicache_core::PageKey]) -> hicache_storage::Result<usize> {
        Ok(0)
    }
    fn stats(&self) -> hicache_storage::StorageStats {
        hicache_storage::StorageStats::default()
    }
}

/// A backend that is down: backups fail and are counted per component (the pages stay in
/// L2, the tick goes on), lookups are misses; every request is still served.
#[test]
fn a_down_backend_is_counted_never_an_error() {
    let mut e = Engine::new(cache(true, true, Arc::new(Down)));
    let a = prompt(1, 40);
    e.turn(&a);
    let t = e.cache.metrics();
    assert_eq!(t.full.pages_l2_to_l3, 0, "{t:?}");
    assert_eq!(t.full.l3_failed_write_pages, t.full.pages_d2h, "{t:?}");
    assert!(t.full.l3_failed_write_pages > 0, "{t:?}");
    assert_eq!(t.swa.l3_failed_write_pages, t.swa.pages_d2h, "{t:?}");
    assert_eq!(t.mamba.l3_failed_write_pages, t.mamba.pages_d2h, "{t:?}");
    let text = e.cache.render_metrics();
    assert!(
        text.contains(r#"hicache_hybrid_l3_failed_pages_total{component="full",op="write"}"#),
        "{text}"
    );
    // An unrelated prompt: its lookup fails, it is computed.
    let run = e.run(&prompt(2, 40));
    assert_eq!(run.admission.cached_tokens(), 0, "{run:?}");
    e.settle();
    e.assert_no_leaks();
    e.cache.shutdown().unwrap();
}

/// A backend over another whose reads (or lookups) wait at a gate the test opens.
struct Gated {
    inner: Arc<dyn Storage>,
    /// Gate the reads (`batch_get`); otherwise the lookups (`batch_exists`).
    reads: bool,
    /// Closed by the test to let the reads through (`acquire` fails once closed).
    gate: tokio::sync::Semaphore,
    /// Set when a gated call has reached the gate.
    read_started: std::sync::Mutex<bool>,
    started: std::sync::Condvar,
}

impl Gated {
    fn new(inner: Arc<dyn Storage>, reads: bool) -> Arc<Self> {
        Arc::new(Self {
            inner,
            reads,
            gate: tokio::sync::Semaphore::new(0),
            read_started: std::sync::Mutex::new(false),
            started: std::sync::Condvar::new(),
        })
    }

    /// Whether a gated call reached the gate, waiting up to 10 ms for one (not an assertion on
    /// time: callers poll the cache in between, a bounded number of times).
    fn read_started(&self) -> bool {
        let g = self.read_started.lock().unwrap();
        let (g, _) = self
            .started
            .wait_timeout_while(g, std::time::Duration::from_millis(10), |s| !*s)
            .unwrap();
        *g
    }

    fn open(&self) {
        self.gate.close();
    }

    /// Signals the call's arrival at the gate, then waits there until it opens.
    async fn pass(&self) {
        *self.read_started.lock().unwrap() = true;
        self.started.notify_all();
        let _ = self.gate.acquire().await;
    }
}

#[hicache_storage::async_trait]
impl Storage for Gated {
    fn info(&self) -> hicache_storage::BackendInfo {
        self.inner.info()
    }
    async fn batch_exists(&self, keys: &[hicache_core::PageKey]) -> hicache_storage::Result<usize> {
        if !self.reads {
            self.pass().await;
        }
        self.inner.batch_exists(keys).await
    }
    async fn batch_get(
        &self,
        keys: &[hicache_core::PageKey],
        dst: &mut [hicache_storage::PageBufMut<'_>],
    ) -> hicache_storage::Result<Vec<hicache_storage::PageOutcome>> {
        if self.reads {
            self.pass().await;
        }
        self.inner.batch_get(keys, dst).await
    }
    async fn batch_set(
        &self,
        keys: &[hicache_core::PageKey],
        src: &[hicache_storage::PageBuf<'_>],
    ) -> hicache_storage::Result<Vec<hicache_storage::PageOutcome>> {
        self.inner.batch_set(keys, src).await
    }
    async fn delete(&self, keys: &[hicache_core::PageKey]) -> hicache_storage::Result<usize> {
        self.inner.delete(keys).await
    }
    fn stats(&self) -> hicache_storage::StorageStats {
        self.inner.stats()
    }
}

/// A cache whose prefetches follow `policy`, over a copy of what `a` wrote to L3 whose
/// reads (`reads`) or lookups are gated.
fn gated_cache(a: &[u32], policy: hicache::PrefetchPolicy, reads: bool) -> (Engine, Arc<Gated>) {
    let memory: Arc<dyn Storage> =
        Arc::new(hicache_storage::MemoryBackend::with_capacity(64 << 20));
    {
        let mut e = Engine::new(cache(true, true, memory.clone()));
        e.turn(a);
        e.cache.shutdown().unwrap();
    }
    let gated = Gated::new(memory, reads);
    let cfg = HybridConfig {
        page_size: PS,
        swa_window: Some(8),
        mamba_chunk: Some(8),
        prefetch_threshold_tokens: 8,
        prefetch_policy: policy,
        ..Default::default()
    };
    let c = hybrid_common::builder(cfg, 32)
        .storage(gated.clone())
        .build()
        .unwrap();
    (Engine::new(c), gated)
}

/// Polls `e` until a gated call has reached the gate (bounded).
fn poll_until_read_started(e: &mut Engine, gated: &Gated) {
    for _ in 0..1000 {
        e.cache.poll().unwrap();
        if gated.read_started() {
            return;
        }
    }
    panic!("the prefetch never started its read");
}

/// `arrive` returns while the backend's read is still in flight (blocked at a gate); the
/// request is not ready, polls go on, and once the read passes the pages come from L3 whole.
#[test]
fn arrive_returns_while_a_slow_read_is_in_flight() {
    let a = prompt(1, 40);
    let (mut e, gated) = gated_cache(&a, hicache::PrefetchPolicy::WaitComplete, true);
    let b = extended(&a, 3, 24);
    let req = e.arrive(&b);
    poll_until_read_started(&mut e, &gated);
    assert!(!e.cache.prefetch_ready(req).unwrap());
    e.cache.poll().unwrap();
    assert!(
        !e.cache.prefetch_ready(req).unwrap(),
        "the read is still blocked"
    );
    gated.open();
    e.cache.flush().unwrap();
    assert!(e.cache.prefetch_ready(req).unwrap());
    let run = e.finish(req, &b);
    assert_eq!(run.admission.storage_tokens, 40, "{run:?}");
    assert_eq!(run.checked[0], 10, "every Full page checked");
    assert_eq!(run.checked[2], 1, "the state checked");
    e.settle();
    e.cache.shutdown().unwrap();
}

/// `best_effort`: the request is ready at the next poll while its lookup is still blocked;
/// nothing comes from L3, no host slot was taken, and the task ends once let through.
#[test]
fn best_effort_does_not_wait_for_a_slow_lookup() {
    let a = prompt(1, 40);
    let (mut e, gated) = gated_cache(&a, hicache::PrefetchPolicy::BestEffort, false);
    let b = extended(&a, 3, 24);
    let kv_free = |e: &Engine| {
        e.cache
            .host_pools()
            .available(hicache_host::HostComponent::Kv)
            .unwrap()
    };
    let total = kv_free(&e);
    let req = e.arrive(&b);
    poll_until_read_started(&mut e, &gated);
    assert!(
        e.cache.prefetch_ready(req).unwrap(),
        "best_effort never waits"
    );
    assert_eq!(kv_free(&e), total, "no slot taken for a lookup");
    gated.open();
    e.cache.flush().unwrap();
    let run = e.finish(req, &b);
    assert_eq!(run.admission.cached_tokens(), 0, "{run:?}");
    e.settle();
    e.cache.shutdown().unwrap();
}
