//! Controller-side pipelining of L3 writes: the next backup batch is in flight while the
//! previous one's durability barrier runs, the number in flight is bounded, and pages count
//! as stored in L3 only once their own batch is acknowledged. Shown by counts on the sim
//! device: a backend that holds batches until the test lets them go.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Engine, prompt, small_shape, test_config};
use hicache::{
    HiCache, HiCacheConfig, KvEvent, L3_WRITE_BATCHES_IN_FLIGHT, Medium, PrefetchPolicy,
    WritePolicy,
};
use hicache_storage::async_trait;
use hicache_storage::{
    BackendInfo, MemoryBackend, MemoryRegion, PageBuf, PageBufMut, PageKey, PageOutcome, Storage,
    StorageStats,
};
use tokio::sync::watch;

/// Liveness bound of every wait in these tests (never reached when the code is right).
const BOUND: Duration = Duration::from_secs(20);

/// A backend whose `batch_set` calls wait until the test opens the gate (bounded), counting
/// calls and the most in flight at once.
struct Gated {
    inner: Arc<dyn Storage>,
    /// While `false`, `batch_set` waits (only the first call when `first_only`).
    open: watch::Sender<bool>,
    first_only: bool,
    calls: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

impl Gated {
    fn new(first_only: bool) -> Self {
        Self {
            inner: Arc::new(MemoryBackend::with_capacity(64 << 20)),
            open: watch::Sender::new(false),
            first_only,
            calls: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        }
    }
}

#[async_trait]
impl Storage for Gated {
    fn info(&self) -> BackendInfo {
        self.inner.info()
    }

    async fn batch_exists(&self, keys: &[PageKey]) -> hicache_storage::Result<usize> {
        self.inner.batch_exists(keys).await
    }

    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> hicache_storage::Result<Vec<PageOutcome>> {
        self.inner.batch_get(keys, dst).await
    }

    async fn batch_set(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
    ) -> hicache_storage::Result<Vec<PageOutcome>> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        if call == 0 || !self.first_only {
            let mut gate = self.open.subscribe();
            // Bounded: a test that never opens the gate fails on its counts, never hangs.
            let _ = tokio::time::timeout(BOUND, gate.wait_for(|open| *open)).await;
        }
        let out = self.inner.batch_set(keys, src).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        out
    }

    fn register_memory(&self, region: MemoryRegion) -> hicache_storage::Result<()> {
        self.inner.register_memory(region)
    }

    async fn delete(&self, keys: &[PageKey]) -> hicache_storage::Result<usize> {
        self.inner.delete(keys).await
    }

    fn stats(&self) -> StorageStats {
        self.inner.stats()
    }
}

/// Pages per L3 batch in these tests.
const BATCH: usize = 2;

fn cache(storage: Arc<Gated>) -> HiCache {
    let cfg = HiCacheConfig {
        storage_backend: Some("memory".into()),
        // Prefetch from two pages on, to completion, so a prompt is served exactly from L3.
        storage_backend_extra_config: Some(r#"{"prefetch_threshold": 8}"#.into()),
        storage_prefetch_policy: PrefetchPolicy::WaitComplete,
        write_policy: WritePolicy::WriteThrough,
        storage_batch_pages: BATCH,
        enable_kv_events: true,
        hicache_ratio: 2.0,
        ..test_config(4)
    };
    HiCache::builder(cfg.clone())
        .shape(small_shape(cfg.page_size))
        .device_pages(64)
        .storage(storage)
        .build()
        .unwrap()
}

/// Pages stored in L3 according to the events published so far.
fn l3_stored_pages(e: &mut Engine) -> usize {
    e.cache
        .drain_events()
        .iter()
        .map(|ev| match ev {
            KvEvent::BlockStored {
                medium: Medium::Storage,
                block_hashes,
                ..
            } => block_hashes.len(),
            _ => 0,
        })
        .sum()
}

/// Polls until `done` holds (bounded).
fn poll_until(e: &mut Engine, what: &str, mut done: impl FnMut(&mut Engine) -> bool) {
    let t0 = Instant::now();
    while !done(e) {
        assert!(t0.elapsed() < BOUND, "{what}: never happened");
        e.cache.poll().unwrap();
        std::thread::yield_now();
    }
}

#[test]
fn the_next_batch_is_in_flight_while_the_first_is_unacknowledged() {
    let gated = Arc::new(Gated::new(true));
    let mut e = Engine::new(cache(gated.clone()));
    // 8 pages: 4 batches of 2 when backed up.
    let p = prompt(1, 32);
    e.run(None, &p);
    // The first batch is held; the second must reach the backend meanwhile.
    poll_until(&mut e, "a second batch while the first is held", |_| {
        gated.calls.load(Ordering::SeqCst) >= 2
    });
    assert!(gated.max_in_flight.load(Ordering::SeqCst) >= 2);
    // Acknowledged = durable: while the first batch is unacknowledged the backup is not
    // finished and no page is reported stored in L3, whatever the later batches did.
    poll_until(&mut e, "every later batch acknowledged", |_| {
        gated.calls.load(Ordering::SeqCst) == 4 && gated.in_flight.load(Ordering::SeqCst) == 1
    });
    for _ in 0..3 {
        assert_eq!(e.cache.poll().unwrap().backups_finished, 0);
    }
    assert_eq!(l3_stored_pages(&mut e), 0);
    gated.open.send_replace(true);
    e.settle();
    assert_eq!(l3_stored_pages(&mut e), 8);
    // Every page is in L3: after dropping L1 and L2 the prompt is served from storage.
    e.cache.flush().unwrap();
    let again = e.run(None, &p);
    assert_eq!(again.admission.storage_pages, 8);
    e.settle();
    e.cache.shutdown().unwrap();
}

#[test]
fn batches_in_flight_are_bounded_over_all_backups() {
    let gated = Arc::new(Gated::new(false));
    let mut e = Engine::new(cache(gated.clone()));
    // Three prompts of 8 pages: 12 batches, every one held until the gate opens.
    for seed in 1..=3 {
        e.run(None, &prompt(seed, 32));
    }
    poll_until(&mut e, "a full window of batches", |_| {
        gated.calls.load(Ordering::SeqCst) >= L3_WRITE_BATCHES_IN_FLIGHT
    });
    gated.open.send_replace(true);
    e.settle();
    assert_eq!(gated.calls.load(Ordering::SeqCst), 12);
    assert_eq!(
        gated.max_in_flight.load(Ordering::SeqCst),
        L3_WRITE_BATCHES_IN_FLIGHT
    );
    assert_eq!(l3_stored_pages(&mut e), 24);
    e.cache.shutdown().unwrap();
}
