//! Property-based state-machine tests of the controller on the sim device (or CUDA with
//! `HICACHE_TEST_DEVICE=cuda`).
//!
//! Random sequences of engine calls (arrive, poll, admit, compute, chunked and final inserts,
//! aborts at every stage, start_loading with layer waits, evict, flush, drain, detach/attach of
//! L3) run against tiny pools, so both tiers evict all the time, across write policies ×
//! prefetch policies × layouts, with an in-memory L3 behind the `Faulty` wrapper (read errors
//! and torn reads injected). A naive model of the engine's side (which requests are live, which
//! device slots each owns, what KV every page must hold) is checked after every step:
//!
//! 1. `tree().check_invariants()`;
//! 2. every page a live request holds, every device page of the tree (once no load is queued)
//!    and every host page of the tree (once its write finished) holds the KV pattern of its
//!    token prefix and tenant;
//! 3. no device or host slot has two owners, and every owned slot is allocated in its pool;
//!    device pool free + tree pages + requests' own pages == pool size;
//! 4. at quiescence (no live request, drained): no pins, and host pool free + tree host pages ==
//!    pool size (nothing leaked, nothing freed twice).
//!
//! `PROPTEST_CASES` raises the case count (default 64).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Faulty, TreeShape, page_pattern, prompt, small_shape, tree_shape};
use hicache::{
    HashMode, HiCache, HiCacheConfig, HiCacheError, IoBackendKind, KvEvent, KvKind, KvShape,
    LayoutKind, PrefetchPolicy, RankGroup, StrategyKind, TcpRankGroup, TenantId, WritePolicy,
};
use hicache_gpu::DeviceSlot;
use hicache_storage::{MemoryBackend, Storage};
use proptest::prelude::*;

// ----- the configuration space --------------------------------------------------------------

#[derive(Clone, Debug)]
struct Setup {
    page_size: u32,
    device_pages: usize,
    ratio: f64,
    write: WritePolicy,
    prefetch: PrefetchPolicy,
    layout: LayoutKind,
    l3: bool,
    /// L3 capacity in pages (small: L3 evicts too).
    l3_pages: usize,
    fail_every: usize,
    corrupt_every: usize,
    threshold_pages: u32,
    capacity_ratio: f64,
    batch_pages: usize,
    /// L3 calls take a little time, so prefetches and backups span several steps.
    slow: bool,
    /// Everything else: MLA instead of MHA, eviction order, io backend, hash mode, KV events.
    misc: Misc,
}

#[derive(Clone, Debug)]
struct Misc {
    mla: bool,
    eviction: StrategyKind,
    direct_io: bool,
    sglang_hashes: bool,
    events: bool,
}

fn misc() -> impl Strategy<Value = Misc> {
    (
        prop::bool::weighted(0.25),
        prop_oneof![
            4 => Just(StrategyKind::Lru),
            1 => Just(StrategyKind::Lfu),
            1 => Just(StrategyKind::Fifo),
            1 => Just(StrategyKind::Mru),
            1 => Just(StrategyKind::Filo),
            1 => Just(StrategyKind::Priority),
            1 => Just(StrategyKind::Slru),
            1 => Just(StrategyKind::S3Fifo),
            1 => Just(StrategyKind::Sieve),
        ],
        any::<bool>(),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.3),
    )
        .prop_map(|(mla, eviction, direct_io, sglang_hashes, events)| Misc {
            mla,
            eviction,
            direct_io,
            sglang_hashes,
            events,
        })
}

fn shape(s: &Setup) -> KvShape {
    let mut shape = small_shape(s.page_size);
    if s.misc.mla {
        shape.kind = KvKind::Mla { kv_dim: 48 };
    }
    shape
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        prop_oneof![Just(2u32), Just(4u32)],
        10usize..24,
        prop_oneof![Just(1.0f64), Just(1.5), Just(2.0), Just(0.6)],
        prop_oneof![
            Just(WritePolicy::WriteThrough),
            Just(WritePolicy::WriteThroughSelective),
            Just(WritePolicy::WriteBack)
        ],
        prop_oneof![
            Just(PrefetchPolicy::BestEffort),
            Just(PrefetchPolicy::WaitComplete),
            Just(PrefetchPolicy::Timeout)
        ],
        prop_oneof![
            Just(LayoutKind::LayerFirst),
            Just(LayoutKind::PageFirst),
            Just(LayoutKind::PageFirstDirect)
        ],
        prop::bool::weighted(0.85),
        prop_oneof![Just(24usize), Just(1000)],
        (
            prop_oneof![Just(0usize), Just(0), Just(5), Just(13)],
            prop_oneof![Just(0usize), Just(0), Just(7)],
        ),
        1u32..3,
        (
            prop_oneof![Just(0.1f64), Just(0.5), Just(1.0)],
            prop::bool::weighted(0.25),
        ),
        (prop_oneof![Just(1usize), Just(2), Just(128)], misc()),
    )
        .prop_map(
            |(
                page_size,
                device_pages,
                ratio,
                write,
                prefetch,
                layout,
                l3,
                l3_pages,
                (fail_every, corrupt_every),
                threshold_pages,
                (capacity_ratio, slow),
                (batch_pages, misc),
            )| {
                // A host pool smaller than the device pool is refused with write_through.
                let ratio = if ratio < 1.0 && write == WritePolicy::WriteThrough {
                    1.0
                } else {
                    ratio
                };
                Setup {
                    page_size,
                    device_pages,
                    ratio,
                    write,
                    prefetch,
                    layout,
                    l3,
                    l3_pages,
                    fail_every,
                    corrupt_every,
                    threshold_pages,
                    capacity_ratio,
                    batch_pages,
                    slow,
                    misc,
                }
            },
        )
}

// ----- the operations -----------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    /// A request arrives: system prompt `sys`, the first `pages` pages of conversation `conv`,
    /// and `tail` more tokens of it (a partial page), for tenant `tenant`.
    Arrive {
        tenant: u8,
        sys: u8,
        conv: u8,
        pages: u8,
        tail: u8,
    },
    /// A request arrives with the prompt and output of one of the last four finished
    /// requests (a new turn of the same conversation, or a retry).
    Repeat(u8),
    Poll,
    /// Admits the i-th live request if its prefetch is ready.
    Admit(u8),
    /// The i-th request computes up to n more pages (allocating device pages).
    Compute(u8, u8),
    /// The i-th request's prefill chunk ends: `cache_unfinished` with what it computed.
    Unfinished(u8),
    /// The i-th request finishes (when it computed every page) after decoding n tokens.
    Finish(u8, u8),
    Abort(u8),
    /// `start_loading`, then the forward pass waits for every layer.
    StartLoading,
    Evict(u8),
    /// Flush (refused unless no request is live).
    Flush,
    Drain,
    Detach,
    Attach,
    /// Aborts every live request, drains and checks the quiescent state.
    Quiesce,
    /// Flush, then a recent prompt again (served from L3 if it got there).
    Reload(u8),
    /// Advances the i-th request up to eight times, until it finishes.
    Run(u8),
    /// The i-th request's next natural step: admit it (or poll while its prefetch runs),
    /// run the forward pass for its load-backs, compute up to three pages (or poll when the
    /// device is full), or finish it.
    Advance(u8),
}

fn op() -> impl Strategy<Value = Op> {
    let tenant = prop_oneof![4 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)];
    prop_oneof![
        6 => (tenant, 0u8..2, 0u8..3, 0u8..7, 0u8..4).prop_map(|(tenant, sys, conv, pages, tail)| {
            Op::Arrive { tenant, sys, conv, pages, tail }
        }),
        16 => any::<u8>().prop_map(Op::Advance),
        4 => any::<u8>().prop_map(Op::Repeat),
        4 => Just(Op::Poll),
        1 => any::<u8>().prop_map(Op::Admit),
        1 => (any::<u8>(), 1u8..6).prop_map(|(i, n)| Op::Compute(i, n)),
        2 => any::<u8>().prop_map(Op::Unfinished),
        1 => (any::<u8>(), 0u8..9).prop_map(|(i, n)| Op::Finish(i, n)),
        2 => any::<u8>().prop_map(Op::Abort),
        2 => Just(Op::StartLoading),
        1 => (1u8..8).prop_map(Op::Evict),
        2 => Just(Op::Flush),
        1 => Just(Op::Drain),
        1 => Just(Op::Detach),
        2 => Just(Op::Attach),
        2 => any::<u8>().prop_map(Op::Reload),
        6 => any::<u8>().prop_map(Op::Run),
        1 => Just(Op::Quiesce),
    ]
}

// ----- the engine's side --------------------------------------------------------------------

#[derive(Debug)]
enum Stage {
    Arrived,
    Admitted {
        /// One device slot per computed page (the prefix served, then the request's own).
        slots: Vec<DeviceSlot>,
        /// Leading slots owned by the tree (the rest are the request's).
        shared: usize,
        /// A forward pass has run since the admission (load-backs are complete).
        started: bool,
    },
}

#[derive(Debug)]
struct Req {
    tenant: TenantId,
    tokens: Vec<u32>,
    stage: Stage,
}

struct Model {
    setup: Setup,
    cache: HiCache,
    storage: Arc<dyn Storage>,
    tenants: Vec<TenantId>,
    sys: Vec<Vec<u32>>,
    conv: Vec<Vec<u32>>,
    reqs: BTreeMap<u64, Req>,
    /// Token sequences of finished requests, newest last.
    history: Vec<(TenantId, Vec<u32>)>,
    next_id: u64,
    /// Admissions since the last `start_loading` queued load-backs.
    loads_queued: bool,
    log: Vec<String>,
    /// What the sequence exercised (printed with `HICACHE_MODEL_STATS=1`).
    stats: BTreeMap<&'static str, usize>,
}

fn salt(t: TenantId) -> u64 {
    0x5151 + t.0 as u64
}

fn extra_config(s: &Setup) -> String {
    let ps = s.page_size;
    format!(
        r#"{{"prefetch_threshold": {}, "prefetch_timeout_base": 0.002, "prefetch_timeout_per_ki_token": 0, "prefetch_timeout_max": 0.004}}"#,
        s.threshold_pages * ps
    )
}

fn config(s: &Setup) -> HiCacheConfig {
    HiCacheConfig {
        page_size: s.page_size,
        hicache_ratio: s.ratio,
        write_policy: s.write,
        storage_prefetch_policy: s.prefetch,
        mem_layout: s.layout,
        storage_backend: s.l3.then(|| "memory".to_string()),
        storage_backend_extra_config: s.l3.then(|| extra_config(s)),
        load_back_threshold: 1,
        storage_batch_pages: s.batch_pages,
        prefetch_capacity_ratio: s.capacity_ratio,
        eviction_policy: s.misc.eviction,
        io_backend: if s.misc.direct_io {
            IoBackendKind::Direct
        } else {
            IoBackendKind::Kernel
        },
        hash_mode: if s.misc.sglang_hashes {
            HashMode::Sglang
        } else {
            HashMode::Namespaced
        },
        enable_kv_events: s.misc.events,
        host_reserve_bytes: Some(0),
        ..Default::default()
    }
}

/// The L3 of one rank: the memory backend behind `Faulty`. Ranks differ in latency and in
/// which reads fail, so their prefetches progress differently and must still agree.
fn storage(s: &Setup, rank: usize) -> Arc<dyn Storage> {
    let page_bytes = shape(s).page_bytes();
    // Room for the pages plus the memory backend's per-entry overhead.
    let mem: Arc<dyn Storage> = Arc::new(MemoryBackend::with_capacity(
        (s.l3_pages * (page_bytes + 256)) as u64,
    ));
    let mut f = Faulty::new(mem);
    f.fail_every = s.fail_every + rank * (s.fail_every > 0) as usize;
    f.corrupt_every = s.corrupt_every;
    if s.slow || rank > 0 {
        f.latency = Duration::from_micros(300 * (1 + rank as u64));
    }
    Arc::new(f)
}

impl Model {
    fn new(setup: Setup, group: Option<Arc<dyn RankGroup>>) -> Self {
        let rank = group.as_ref().map_or(0, |g| g.rank());
        let storage = storage(&setup, rank);
        let mut builder = HiCache::builder(config(&setup))
            .device(common::test_device())
            .shape(shape(&setup))
            .device_pages(setup.device_pages);
        if let Some(g) = group {
            builder = builder.rank_group(g);
        }
        if setup.l3 {
            builder = builder.storage(storage.clone());
        }
        let mut cache = builder.build().unwrap();
        let tenants = vec![
            TenantId::DEFAULT,
            cache.tenant(Some("lora-a"), None).unwrap(),
            cache.tenant(None, Some("salt-b")).unwrap(),
        ];
        let ps = setup.page_size as usize;
        Self {
            sys: (0..3).map(|i| prompt(1 + i, 3 * ps)).collect(),
            conv: (0..4).map(|i| prompt(100 + i, 7 * ps)).collect(),
            setup,
            cache,
            storage,
            tenants,
            reqs: BTreeMap::new(),
            history: Vec::new(),
            next_id: 1,
            loads_queued: false,
            log: Vec::new(),
            stats: BTreeMap::new(),
        }
    }

    fn count(&mut self, what: &'static str, n: usize) {
        *self.stats.entry(what).or_default() += n;
    }

    fn ps(&self) -> usize {
        self.setup.page_size as usize
    }

    fn nth(&self, i: u8) -> Option<u64> {
        if self.reqs.is_empty() {
            return None;
        }
        self.reqs.keys().nth(i as usize % self.reqs.len()).copied()
    }

    fn pattern(&self, tenant: TenantId, tokens: &[u32], page: usize) -> Vec<u8> {
        let pb = self.cache.shape().page_bytes();
        page_pattern(tokens, page, self.ps(), pb, salt(tenant))
    }

    fn step(&mut self, op: &Op) {
        self.log.push(format!("{op:?}"));
        match *op {
            Op::Arrive {
                tenant,
                sys,
                conv,
                pages,
                tail,
            } => {
                let ps = self.ps();
                let mut tokens = self.sys[sys as usize].clone();
                let c = &self.conv[conv as usize];
                let n = (pages as usize * ps + tail as usize % ps).min(c.len());
                tokens.extend_from_slice(&c[..n]);
                let tenant = self.tenants[tenant as usize];
                self.arrive(tenant, tokens);
            }
            Op::Repeat(i) => {
                if self.history.is_empty() {
                    return;
                }
                let k = self.history.len().min(4);
                let (tenant, tokens) =
                    self.history[self.history.len() - 1 - i as usize % k].clone();
                self.arrive(tenant, tokens);
            }
            Op::Poll => {
                self.cache.poll().unwrap();
                let events = self.cache.drain_events();
                assert!(
                    self.setup.misc.events
                        || events
                            .iter()
                            .all(|e| matches!(e, KvEvent::AllBlocksCleared))
                );
            }
            Op::Admit(i) => {
                let Some(id) = self.nth(i) else { return };
                if !matches!(self.reqs[&id].stage, Stage::Arrived) {
                    return;
                }
                if !self.cache.prefetch_ready(id).unwrap() {
                    assert!(self.cache.admit(id, &self.reqs[&id].tokens).is_err());
                    return;
                }
                let tokens = self.reqs[&id].tokens.clone();
                let adm = self.cache.admit(id, &tokens).unwrap();
                assert_eq!(
                    adm.cached_pages(),
                    adm.device_pages + adm.host_pages + adm.storage_pages
                );
                assert!(adm.cached_pages() <= tokens.len() / self.ps());
                self.count("admitted", 1);
                self.count("l1_pages", adm.device_pages);
                self.count("l2_pages", adm.host_pages);
                self.count("l3_pages", adm.storage_pages);
                self.loads_queued |= adm.host_pages + adm.storage_pages > 0;
                // An L1 hit may be on pages another admission of this tick is loading: any
                // queued load makes the request wait for the forward pass.
                let started = !self.loads_queued;
                self.reqs.get_mut(&id).unwrap().stage = Stage::Admitted {
                    shared: adm.prefix_slots.len(),
                    slots: adm.prefix_slots,
                    started,
                };
            }
            Op::Compute(i, n) => {
                let Some(id) = self.nth(i) else { return };
                let ps = self.ps();
                let r = &self.reqs[&id];
                let total = r.tokens.len().div_ceil(ps);
                let Stage::Admitted {
                    slots,
                    started: true,
                    ..
                } = &r.stage
                else {
                    return;
                };
                let k = (n as usize).min(total - slots.len());
                if k == 0 {
                    return;
                }
                let Some(fresh) = self.cache.alloc_device(k).unwrap() else {
                    return;
                };
                assert_eq!(fresh.len(), k);
                let first = slots.len();
                let (tenant, tokens) = (r.tenant, r.tokens.clone());
                self.count("computed_pages", k);
                for (j, &s) in fresh.iter().enumerate() {
                    let data = self.pattern(tenant, &tokens, first + j);
                    self.cache.device_pool().write_page(s, &data).unwrap();
                }
                if let Stage::Admitted { slots, .. } = &mut self.reqs.get_mut(&id).unwrap().stage {
                    slots.extend(fresh);
                }
            }
            Op::Unfinished(i) => {
                let Some(id) = self.nth(i) else { return };
                let ps = self.ps();
                let r = &self.reqs[&id];
                let Stage::Admitted {
                    slots,
                    started: true,
                    ..
                } = &r.stage
                else {
                    return;
                };
                let done = (slots.len() * ps).min(r.tokens.len());
                let tokens = r.tokens[..done].to_vec();
                let slots = slots.clone();
                let now = self.cache.cache_unfinished(id, &tokens, &slots).unwrap();
                self.count("unfinished", 1);
                assert_eq!(now.len(), slots.len());
                // The request's own slots past the cached pages are unchanged.
                assert_eq!(now[done / ps..], slots[done / ps..]);
                // The tree's slots it now holds may be pages a queued load-back fills: the
                // next chunk's forward pass waits for the loads, as after an admission.
                let queued = self.loads_queued;
                if let Stage::Admitted {
                    slots,
                    shared,
                    started,
                } = &mut self.reqs.get_mut(&id).unwrap().stage
                {
                    *slots = now;
                    *shared = done / ps;
                    *started = !queued;
                }
            }
            Op::Finish(i, out) => {
                let Some(id) = self.nth(i) else { return };
                let ps = self.ps();
                let r = &self.reqs[&id];
                let Stage::Admitted {
                    slots,
                    started: true,
                    ..
                } = &r.stage
                else {
                    return;
                };
                if slots.len() != r.tokens.len().div_ceil(ps) {
                    return;
                }
                // Decode: `out` output tokens follow the prompt; their KV goes into the
                // prompt's partial last page (rewritten: the pattern covers the whole page)
                // and new pages.
                let (tenant, mut tokens, mut slots) = (r.tenant, r.tokens.clone(), slots.clone());
                let prompt_len = tokens.len();
                tokens.extend(prompt(id ^ 0xdec0de, out as usize));
                let need = tokens.len().div_ceil(ps) - slots.len();
                let Some(fresh) = self.cache.alloc_device(need).unwrap() else {
                    return;
                };
                slots.extend(fresh);
                for (page, &slot) in slots.iter().enumerate().skip(prompt_len / ps) {
                    let data = self.pattern(tenant, &tokens, page);
                    self.cache.device_pool().write_page(slot, &data).unwrap();
                }
                self.cache.cache_finished(id, &tokens, &slots).unwrap();
                self.reqs.remove(&id);
                self.history.push((tenant, tokens));
                self.count("finished", 1);
                self.count("output_tokens", out as usize);
            }
            Op::Abort(i) => {
                let Some(id) = self.nth(i) else { return };
                self.abort(id);
            }
            Op::StartLoading => self.start_loading(),
            Op::Evict(n) => {
                let freed = self.cache.evict(n as usize).unwrap();
                self.count("evicted", freed);
            }
            Op::Flush => {
                // Refused while requests are live; then ends them and flushes.
                if !self.reqs.is_empty() {
                    assert!(matches!(self.cache.flush(), Err(HiCacheError::NotIdle(_))));
                    self.quiesce();
                }
                self.cache.flush().unwrap();
                assert_eq!(self.cache.tree().device_pages(), 0);
                assert_eq!(self.cache.tree().host_pages(), 0);
                self.loads_queued = false;
                self.count("flushes", 1);
            }
            Op::Drain => self.cache.drain().unwrap(),
            Op::Detach => {
                self.cache.detach_storage().unwrap();
                // Live requests' prefetches were revoked.
                for id in self.reqs.keys() {
                    assert!(self.cache.prefetch_ready(*id).unwrap());
                }
            }
            Op::Attach => {
                if !self.setup.l3 {
                    return;
                }
                let sc = self.cache.config().storage_config().unwrap().unwrap();
                if self.cache.storage_backend().is_some() {
                    // Attaching the same backend again only updates the policy fields.
                    self.cache.attach_storage(sc).unwrap();
                    return;
                }
                match self
                    .cache
                    .attach_storage_instance(sc.clone(), self.storage.clone())
                {
                    Ok(()) => {}
                    Err(HiCacheError::NotIdle(_)) => {
                        self.quiesce();
                        self.cache
                            .attach_storage_instance(sc, self.storage.clone())
                            .unwrap();
                    }
                    Err(e) => panic!("attach: {e}"),
                }
            }
            Op::Quiesce => self.quiesce(),
            Op::Run(i) => {
                let Some(id) = self.nth(i) else { return };
                for _ in 0..8 {
                    let Some(k) = self.reqs.keys().position(|&r| r == id) else {
                        break;
                    };
                    self.step(&Op::Advance(k as u8));
                }
            }
            Op::Reload(i) => {
                self.step(&Op::Flush);
                self.step(&Op::Repeat(i));
            }
            Op::Advance(i) => {
                let Some(id) = self.nth(i) else { return };
                let ps = self.ps();
                let r = &self.reqs[&id];
                let next = match &r.stage {
                    Stage::Arrived if self.cache.prefetch_ready(id).unwrap() => Op::Admit(i),
                    Stage::Arrived => Op::Poll,
                    Stage::Admitted { started: false, .. } => Op::StartLoading,
                    Stage::Admitted { slots, .. } if slots.len() < r.tokens.len().div_ceil(ps) => {
                        Op::Compute(i, 16)
                    }
                    Stage::Admitted { .. } => Op::Finish(i, (id % 7) as u8),
                };
                let before = self.cache.device_pages_free();
                self.step(&next);
                if matches!(next, Op::Compute(..)) && before == self.cache.device_pages_free() {
                    // No device room: the scheduler polls and tries again next tick.
                    self.step(&Op::Poll);
                }
            }
        }
    }

    fn arrive(&mut self, tenant: TenantId, tokens: Vec<u32>) {
        if self.reqs.len() >= 3 {
            // The scheduler's waiting queue is full: advance the oldest instead.
            return self.step(&Op::Advance(0));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.cache.arrive_for(id, tenant, &tokens).unwrap();
        self.reqs.insert(
            id,
            Req {
                tenant,
                tokens,
                stage: Stage::Arrived,
            },
        );
    }

    fn abort(&mut self, id: u64) {
        let r = self.reqs.remove(&id).unwrap();
        self.cache.abort(id).unwrap();
        if let Stage::Admitted { slots, shared, .. } = r.stage {
            self.cache.free_device(&slots[shared..]).unwrap();
        }
    }

    fn start_loading(&mut self) {
        if let Some(producer) = self.cache.start_loading().unwrap() {
            let counter = self.cache.layer_done_counter().clone();
            counter.set_consumer(producer).unwrap();
            for layer in 0..self.cache.shape().layers as usize {
                counter.wait_until(layer).unwrap();
            }
        }
        self.loads_queued = false;
        for r in self.reqs.values_mut() {
            if let Stage::Admitted { started, .. } = &mut r.stage {
                *started = true;
            }
        }
    }

    /// Ends every request, drains, and checks that nothing is pinned or leaked.
    fn quiesce(&mut self) {
        let ids: Vec<u64> = self.reqs.keys().copied().collect();
        for id in ids {
            self.abort(id);
        }
        self.start_loading();
        self.cache.drain().unwrap();
        self.check();
        let tree = self.cache.tree();
        assert_eq!(tree.protected_pages(), 0, "device pins left at quiescence");
        let stats = tree.stats();
        assert_eq!(stats.pending_writes, 0);
        assert_eq!(stats.pending_loads, 0);
        self.for_each_node(|_, _, _, info| {
            assert_eq!(info.lock_ref, 0, "{:?} still locked", info.id);
            assert_eq!(info.host_ref, 0, "{:?} still host-protected", info.id);
        });
        // Prefetch tasks that were cut hand their pages back when they exit. With several
        // ranks, every rank polls until all of them got their pages back (polls are
        // collectives: the ranks agree through the group when to stop).
        let host = self.cache.host_pool().clone();
        let t0 = Instant::now();
        loop {
            let in_tree = self.cache.tree().host_pages();
            assert!(
                host.available() + in_tree <= host.num_pages(),
                "host pages freed twice: {} free + {} in the tree > {}",
                host.available(),
                in_tree,
                host.num_pages()
            );
            let mut done = [(host.available() + in_tree == host.num_pages()) as u64];
            self.cache
                .rank_group()
                .exchange(&mut done, &mut [])
                .unwrap();
            if done[0] == 1 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "host pages leaked: {} free + {} in the tree < {}",
                host.available(),
                in_tree,
                host.num_pages()
            );
            std::thread::sleep(Duration::from_millis(1));
            self.cache.poll().unwrap();
        }
        let dev = self.cache.device_pool();
        assert_eq!(
            dev.available() + self.cache.tree().device_pages(),
            dev.num_pages(),
            "device pages leaked or freed twice at quiescence"
        );
    }

    /// Walks every node of every tenant: (tenant, tokens of the prefix up to and including the
    /// node, pages before the node, info).
    fn for_each_node(&self, mut f: impl FnMut(TenantId, &[u32], usize, &hicache_core::NodeInfo)) {
        let tree = self.cache.tree();
        let ps = self.ps();
        for &t in &self.tenants {
            let root = tree.tenant_root(t).unwrap();
            let mut stack = vec![(root, Vec::<u32>::new())];
            while let Some((n, prefix)) = stack.pop() {
                for k in tree.children(n).unwrap() {
                    let mut toks = prefix.clone();
                    toks.extend_from_slice(tree.tokens(k).unwrap());
                    let info = tree.node_info(k).unwrap();
                    f(t, &toks, toks.len() / ps - info.pages, &info);
                    stack.push((k, toks));
                }
            }
        }
    }

    /// Host bytes of a page in the host layout's flat order, from the device's flat order.
    fn host_flat(&self, dev: &[u8]) -> Vec<u8> {
        // The cache's layout, not the asked one: `page_first` with `direct` io runs as
        // `page_first_direct` (`HiCacheConfig::resolve_layout_io`).
        if self.cache.config().mem_layout != LayoutKind::PageFirst {
            return dev.to_vec();
        }
        // [h][l][t][row] -> [h][t][l][row]
        let shape = self.cache.shape();
        let (layers, ps) = (shape.layers as usize, self.ps());
        let halves = if self.setup.misc.mla { 1 } else { 2 };
        let row = dev.len() / (halves * layers * ps);
        let mut out = vec![0u8; dev.len()];
        for h in 0..halves {
            for l in 0..layers {
                for t in 0..ps {
                    let src = ((h * layers + l) * ps + t) * row;
                    let dst = ((h * ps + t) * layers + l) * row;
                    out[dst..dst + row].copy_from_slice(&dev[src..src + row]);
                }
            }
        }
        out
    }

    /// Every check that holds after every step.
    fn check(&self) {
        let tree = self.cache.tree();
        if let Err(e) = tree.check_invariants() {
            panic!("tree invariant: {e}");
        }
        let pb = self.cache.shape().page_bytes();
        let dev_pool = self.cache.device_pool();
        let host_pool = self.cache.host_pool();
        let mut buf = vec![0u8; pb];
        let mut dev_owned = BTreeSet::new();
        let mut host_owned = BTreeSet::new();
        // The tree's pages.
        self.for_each_node(|tenant, toks, before, info| {
            let dslots = tree.device_slots(info.id).unwrap();
            let hslots = tree.host_slots(info.id).unwrap();
            for (j, &s) in dslots.iter().enumerate() {
                assert!(dev_owned.insert(s), "device slot {s} owned twice");
                assert!(dev_pool.is_allocated(s), "tree device slot {s} is free");
                if !self.loads_queued {
                    dev_pool.read_page(s, &mut buf).unwrap();
                    let want = self.pattern(tenant, toks, before + j);
                    assert!(
                        buf == want,
                        "tree device page {} of {:?} (slot {s}) holds wrong KV",
                        before + j,
                        info.id
                    );
                }
            }
            for (j, &s) in hslots.iter().enumerate() {
                assert!(host_owned.insert(s), "host slot {s} owned twice");
                assert!(host_pool.is_allocated(s), "tree host slot {s} is free");
                if !info.write_pending {
                    host_pool.get_page(s, &mut buf).unwrap();
                    let want = self.host_flat(&self.pattern(tenant, toks, before + j));
                    assert!(
                        buf == want,
                        "tree host page {} of {:?} (slot {s}) holds wrong KV",
                        before + j,
                        info.id
                    );
                }
            }
        });
        // The requests' pages.
        let mut own = 0;
        for (id, r) in &self.reqs {
            let Stage::Admitted {
                slots,
                shared,
                started,
            } = &r.stage
            else {
                continue;
            };
            for (j, &s) in slots.iter().enumerate() {
                if j < *shared {
                    assert!(
                        dev_owned.contains(&s),
                        "request {id}: shared slot {s} not in the tree"
                    );
                } else {
                    assert!(
                        dev_owned.insert(s),
                        "request {id}: own slot {s} owned twice"
                    );
                    assert!(dev_pool.is_allocated(s));
                    own += 1;
                }
                if *started {
                    dev_pool.read_page(s, &mut buf).unwrap();
                    let want = self.pattern(r.tenant, &r.tokens, j);
                    assert!(
                        buf == want,
                        "request {id}: page {j} (slot {s}) holds wrong KV"
                    );
                }
            }
        }
        assert_eq!(
            dev_pool.available() + tree.device_pages() + own,
            dev_pool.num_pages(),
            "device pages leaked or freed twice"
        );
        assert!(host_pool.available() + tree.host_pages() <= host_pool.num_pages());
    }
}

/// Runs `ops` on one rank (of `group`, if given); returns the tree's shape after every step.
fn run_rank(setup: Setup, ops: &[Op], group: Option<Arc<dyn RankGroup>>) -> Vec<TreeShape> {
    let mut m = Model::new(setup, group);
    let mut shapes = Vec::with_capacity(ops.len());
    for op in ops {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            m.step(op);
            m.check();
        }));
        if let Err(e) = r {
            eprintln!(
                "rank {}: setup: {:?}\nsteps:\n  {}",
                m.cache.rank_group().rank(),
                m.setup,
                m.log.join("\n  ")
            );
            std::panic::resume_unwind(e);
        }
        shapes.push(tree_shape(&m.cache));
    }
    m.quiesce();
    m.cache.shutdown().unwrap();
    if std::env::var_os("HICACHE_MODEL_STATS").is_some() {
        let snap = m.cache.metrics().snapshot();
        eprintln!(
            "{:?} {:?} l3={} {:?} d2h={} h2d={} l3_to_l2={} l2_to_l3={} prefetch c/p/bt/rl/nh/ab/f={}/{}/{}/{}/{}/{}/{}",
            m.setup.write,
            m.setup.prefetch,
            m.setup.l3,
            m.stats,
            snap.d2h.pages,
            snap.h2d.pages,
            snap.l3_to_l2.pages,
            snap.l2_to_l3.pages,
            snap.prefetch_completed,
            snap.prefetch_partial,
            snap.prefetch_below_threshold,
            snap.prefetch_rate_limited,
            snap.prefetch_no_host_memory,
            snap.prefetch_aborted,
            snap.prefetch_failed,
        );
    }
    shapes
}

fn run(setup: Setup, ops: Vec<Op>) {
    run_rank(setup, &ops, None);
}

/// Two ranks with their own pools and L3 (different latency and faults) run the same calls
/// through the TCP rank group: their trees must have the same shape after every step.
fn run_two_ranks(setup: Setup, ops: Vec<Op>) {
    let hub = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let ops = Arc::new(ops);
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let (setup, ops) = (setup.clone(), ops.clone());
            std::thread::spawn(move || {
                let group: Arc<dyn RankGroup> =
                    Arc::new(TcpRankGroup::connect(rank, 2, hub, Duration::from_secs(5)).unwrap());
                run_rank(setup, &ops, Some(group))
            })
        })
        .collect();
    let shapes: Vec<Vec<TreeShape>> = handles
        .into_iter()
        .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
        .collect();
    for (step, (a, b)) in shapes[0].iter().zip(&shapes[1]).enumerate() {
        assert_eq!(
            a, b,
            "rank 1's tree differs from rank 0's after step {step} ({:?})",
            ops[step]
        );
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 2000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn controller_keeps_kv_exact_and_leaks_nothing(
        setup in setup(),
        ops in prop::collection::vec(op(), 20..200),
    ) {
        run(setup, ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases().div_ceil(4),
        // A diverged case fails after the group's timeout: keep shrinking short.
        max_shrink_iters: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn two_ranks_keep_the_same_tree_after_every_step(
        setup in setup(),
        ops in prop::collection::vec(op(), 20..150),
    ) {
        run_two_ranks(setup, ops);
    }
}
