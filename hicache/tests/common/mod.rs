//! A small engine simulator and storage wrappers for the controller's integration tests.
//!
//! The engine writes a deterministic KV pattern into every page it computes (a function of
//! the whole token prefix up to the end of the page), and checks every cached page it is
//! given against the same function, so any page served from the wrong place, the wrong
//! tenant or a torn copy fails the test.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hicache::{Admission, HiCache, HiCacheConfig, KvKind, KvShape, TenantId};
use hicache_core::{DType, PageHasher, PageKey};
use hicache_storage::async_trait;
use hicache_storage::{
    BackendInfo, MemoryRegion, PageBuf, PageBufMut, PageError, PageOutcome, Storage, StorageStats,
};

/// The device the controller tests run on: the sim device, or CUDA device 0 with
/// `HICACHE_TEST_DEVICE=cuda` (a GPU, or the emulated driver under `scripts/with-cuda-emu.sh`).
pub fn test_device() -> hicache::Device {
    match std::env::var("HICACHE_TEST_DEVICE").as_deref() {
        Ok("cuda") => hicache::Device::cuda(0)
            .unwrap_or_else(|e| panic!("HICACHE_TEST_DEVICE=cuda, but no CUDA device: {e}")),
        Ok("sim") | Ok("") | Err(_) => hicache::Device::sim(),
        Ok(other) => panic!("HICACHE_TEST_DEVICE={other}: expected sim or cuda"),
    }
}

/// A small MHA shape: pages of 2 KiB at page size 4.
pub fn small_shape(page_size: u32) -> KvShape {
    KvShape {
        kind: KvKind::Mha {
            heads: 2,
            head_dim: 16,
        },
        layers: 4,
        dtype: DType::Bf16,
        page_size,
    }
}

/// The KV bytes the engine computes for page `page` of `tokens` (one page's worth).
pub fn page_pattern(
    tokens: &[u32],
    page: usize,
    ps: usize,
    page_bytes: usize,
    salt: u64,
) -> Vec<u8> {
    let end = ((page + 1) * ps).min(tokens.len());
    let h = PageHasher::hash_page(None, &tokens[..end]);
    let mut x = u64::from_le_bytes(h.0[..8].try_into().unwrap()) ^ salt;
    let mut out = Vec::with_capacity(page_bytes);
    while out.len() < page_bytes {
        // splitmix64
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        out.extend_from_slice(&z.to_le_bytes());
    }
    out.truncate(page_bytes);
    out
}

/// A deterministic pseudo-random prompt.
pub fn prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 128_000) as u32
        })
        .collect()
}

/// What one simulated request saw.
#[derive(Debug, Clone, Default)]
pub struct Served {
    pub admission: Admission,
    pub polls_waiting: usize,
}

/// The engine: drives one `HiCache` like a scheduler would, checking KV contents.
pub struct Engine {
    pub cache: HiCache,
    pub next_req: u64,
    /// Salt of the KV pattern per tenant (tenants compute different KV for equal tokens).
    pub salt: u64,
    /// When set, the tree's shape after every poll is recorded here.
    pub shapes: Option<Vec<TreeShape>>,
    /// Priority given to the requests `run` makes (`HiCache::set_priority`).
    pub priority: i32,
}

/// See [`tree_shape`].
pub type TreeShape = Vec<(usize, Vec<u32>, bool, bool)>;

impl Engine {
    pub fn new(cache: HiCache) -> Self {
        Self {
            cache,
            next_req: 1,
            salt: 0,
            shapes: None,
            priority: 0,
        }
    }

    /// Polls, recording the tree's shape when asked to.
    pub fn poll(&mut self) {
        self.cache.poll().unwrap();
        if let Some(v) = &mut self.shapes {
            v.push(tree_shape(&self.cache));
        }
    }

    pub fn ps(&self) -> usize {
        self.cache.page_size()
    }

    fn page_bytes(&self) -> usize {
        self.cache.shape().page_bytes()
    }

    /// Polls until the request's prefetch is decided (liveness guard: 20 s).
    pub fn wait_prefetch(&mut self, req: u64) -> usize {
        let t0 = Instant::now();
        let mut polls = 0;
        while !self.cache.prefetch_ready(req).unwrap() {
            self.poll();
            polls += 1;
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "prefetch never finished"
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        polls
    }

    /// Runs one request to completion: arrival, prefetch, admission (with layer waits),
    /// compute of the uncached pages, cache_finished. Checks every cached page's bytes.
    pub fn run(&mut self, tenant: Option<TenantId>, tokens: &[u32]) -> Served {
        let req = self.next_req;
        self.next_req += 1;
        match tenant {
            Some(t) => self.cache.arrive_for(req, t, tokens).unwrap(),
            None => self.cache.arrive(req, tokens).unwrap(),
        };
        self.cache.set_priority(req, self.priority).unwrap();
        self.poll();
        let polls_waiting = self.wait_prefetch(req);
        let admission = self.cache.admit(req, tokens).unwrap();
        if let Some(producer) = self.cache.start_loading().unwrap() {
            let counter = self.cache.layer_done_counter().clone();
            counter.set_consumer(producer).unwrap();
            for layer in 0..self.cache.shape().layers as usize {
                counter.wait_until(layer).unwrap();
            }
        }
        self.check_pages(tokens, &admission.prefix_slots);
        let ps = self.ps();
        let total = tokens.len().div_ceil(ps);
        // Pages pinned by copies in flight free up at later polls: retry like a scheduler
        // would at its next iteration (liveness guard: 20 s).
        let t0 = Instant::now();
        let fresh = loop {
            if let Some(f) = self
                .cache
                .alloc_device(total - admission.prefix_slots.len())
                .unwrap()
            {
                break f;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "no device room, ever"
            );
            self.poll();
            std::thread::sleep(Duration::from_micros(200));
        };
        let pb = self.page_bytes();
        for (k, &slot) in fresh.iter().enumerate() {
            let page = admission.prefix_slots.len() + k;
            let data = page_pattern(tokens, page, ps, pb, self.salt);
            self.cache.device_pool().write_page(slot, &data).unwrap();
        }
        let mut slots = admission.prefix_slots.clone();
        slots.extend(fresh);
        self.cache.cache_finished(req, tokens, &slots).unwrap();
        self.poll();
        Served {
            admission,
            polls_waiting,
        }
    }

    /// Checks that device pages `slots` hold the KV of the first pages of `tokens`.
    pub fn check_pages(&self, tokens: &[u32], slots: &[hicache::DeviceSlot]) {
        let ps = self.ps();
        let pb = self.page_bytes();
        let mut buf = vec![0u8; pb];
        for (i, &slot) in slots.iter().enumerate() {
            self.cache.device_pool().read_page(slot, &mut buf).unwrap();
            let want = page_pattern(tokens, i, ps, pb, self.salt);
            assert!(buf == want, "page {i} ({slot}) holds wrong KV");
        }
    }

    /// Drains in-flight work and asserts every pin is released.
    pub fn settle(&mut self) {
        self.cache.drain().unwrap();
        assert_no_pins(&self.cache);
        self.cache.tree().check_invariants().unwrap();
    }
}

/// Asserts no node is locked or host-protected, in any tenant.
pub fn assert_no_pins(cache: &HiCache) {
    let tree = cache.tree();
    assert_eq!(tree.protected_pages(), 0, "device pins left");
    let mut t = 0u32;
    while let Ok(root) = tree.tenant_root(TenantId(t)) {
        let mut stack = tree.children(root).unwrap();
        while let Some(n) = stack.pop() {
            let info = tree.node_info(n).unwrap();
            assert_eq!(info.lock_ref, 0, "node {n} still locked");
            assert_eq!(info.host_ref, 0, "node {n} still host-protected");
            stack.extend(tree.children(n).unwrap());
        }
        t += 1;
    }
}

/// A fingerprint of the tree's shape: tokens and tiers of every node, slot indices excluded
/// (they may differ between ranks).
pub fn tree_shape(cache: &HiCache) -> TreeShape {
    let tree = cache.tree();
    let mut out = Vec::new();
    let mut t = 0u32;
    while let Ok(root) = tree.tenant_root(TenantId(t)) {
        let mut stack = vec![(root, 0usize)];
        while let Some((n, depth)) = stack.pop() {
            let mut kids = tree.children(n).unwrap();
            kids.sort_by_key(|k| tree.tokens(*k).unwrap().to_vec());
            for k in kids {
                let info = tree.node_info(k).unwrap();
                out.push((
                    depth,
                    tree.tokens(k).unwrap().to_vec(),
                    info.on_device,
                    info.backed_up,
                ));
                stack.push((k, depth + 1));
            }
        }
        t += 1;
    }
    out
}

/// A cache of `cfg` on the test device with `device_pages` device pages and `storage` as L3.
pub fn with_storage(
    cfg: HiCacheConfig,
    device_pages: usize,
    storage: Arc<dyn Storage>,
) -> hicache::HiCache {
    hicache::HiCache::builder(cfg.clone())
        .device(test_device())
        .shape(small_shape(cfg.page_size))
        .device_pages(device_pages)
        .storage(storage)
        .build()
        .unwrap()
}

/// A config for tests: small pages, write-through, no L3.
pub fn test_config(page_size: u32) -> HiCacheConfig {
    HiCacheConfig {
        page_size,
        host_reserve_bytes: Some(0),
        ..Default::default()
    }
}

/// Wraps a backend: adds latency to every call, and can fail or corrupt reads.
pub struct Faulty {
    pub inner: Arc<dyn Storage>,
    pub latency: Duration,
    /// Every n-th page read (1-based count over all reads) fails with an error (0: never).
    pub fail_every: usize,
    /// Every n-th page read returns Corrupt (0: never).
    pub corrupt_every: usize,
    /// Every batch_get call fails outright.
    pub fail_all_gets: bool,
    /// Every page of every batch_set fails.
    pub fail_all_sets: bool,
    /// While false, batch_get calls wait (a backend that hangs).
    pub gate: Arc<std::sync::atomic::AtomicBool>,
    reads: AtomicUsize,
    pub get_calls: AtomicU64,
    /// How many times each key was stored (`Stored` or `Present` outcomes of batch_set).
    stored: std::sync::Mutex<std::collections::HashMap<PageKey, usize>>,
}

impl Faulty {
    pub fn new(inner: Arc<dyn Storage>) -> Self {
        Self {
            inner,
            latency: Duration::ZERO,
            fail_every: 0,
            corrupt_every: 0,
            fail_all_gets: false,
            fail_all_sets: false,
            gate: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            reads: AtomicUsize::new(0),
            get_calls: AtomicU64::new(0),
            stored: Default::default(),
        }
    }

    /// How many times each key was stored so far.
    pub fn writes(&self) -> std::collections::HashMap<PageKey, usize> {
        self.stored.lock().unwrap().clone()
    }
}

#[async_trait]
impl Storage for Faulty {
    fn info(&self) -> BackendInfo {
        let mut i = self.inner.info();
        i.name = format!("faulty({})", i.name);
        i
    }

    async fn batch_exists(&self, keys: &[PageKey]) -> hicache_storage::Result<usize> {
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
        self.inner.batch_exists(keys).await
    }

    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> hicache_storage::Result<Vec<PageOutcome>> {
        self.get_calls.fetch_add(1, Ordering::Relaxed);
        while !self.gate.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
        if self.fail_all_gets {
            return Err(hicache_storage::StorageError::backend(
                "faulty",
                "injected failure",
            ));
        }
        let mut out = self.inner.batch_get(keys, dst).await?;
        for (o, buf) in out.iter_mut().zip(dst.iter_mut()) {
            let n = self.reads.fetch_add(1, Ordering::Relaxed) + 1;
            if self.fail_every > 0 && n.is_multiple_of(self.fail_every) {
                // A torn read: garbage in the buffer, reported as a failure.
                buf.zero();
                *o = PageOutcome::Failed(PageError::Backend("injected read error".into()));
            } else if self.corrupt_every > 0 && n.is_multiple_of(self.corrupt_every) {
                buf.zero();
                *o = PageOutcome::Corrupt;
            }
        }
        Ok(out)
    }

    async fn batch_set(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
    ) -> hicache_storage::Result<Vec<PageOutcome>> {
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
        if self.fail_all_sets {
            return Ok(keys
                .iter()
                .map(|_| PageOutcome::Failed(PageError::Backend("injected write error".into())))
                .collect());
        }
        let out = self.inner.batch_set(keys, src).await?;
        let mut stored = self.stored.lock().unwrap();
        for (k, o) in keys.iter().zip(&out) {
            if o.is_ok() {
                *stored.entry(*k).or_default() += 1;
            }
        }
        Ok(out)
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
