//! The simulated engine driven against the `ExactPrefix` test double and the no-cache
//! baseline: token accounting, TTFT ordering across tiers, the prefill budget, device memory
//! and contract checks.

mod common;

use std::time::Duration;

use common::{ExactPrefix, ExactPrefixConfig};
use hicache_sim::engine::{self, EngineConfig, RunResult, StepKind};
use hicache_sim::trace::{Conversation, LongContext, MultiTurn};
use hicache_sim::workload::{Arrivals, Workload};
use hicache_sim::{
    Admission, CacheResult, CacheStats, CacheUnderTest, ComputeModel, DeviceSlot, ModelShape,
    NoCache, PrefetchStatus, RequestId,
};

const PS: usize = 16;
const PAGE_BYTES: u64 = 16 * 131_072;

fn conversations() -> Vec<Conversation> {
    MultiTurn {
        clients: 8,
        rounds: 4,
        system_tokens: 256,
        user_tokens: 96,
        answer_tokens: 24,
        vocab: 1000,
        seed: 3,
    }
    .conversations()
}

fn config(budget: usize) -> EngineConfig {
    EngineConfig {
        max_prefill_tokens: budget,
        copy_time: Default::default(),
        layers: 32,
        page_bytes: PAGE_BYTES,
        wall_wait_limit: Duration::from_secs(5),
    }
}

fn compute() -> ComputeModel {
    ComputeModel::h100(&ModelShape::llama3_8b())
}

fn arrivals() -> Arrivals {
    Arrivals {
        rate: 8.0,
        ..Arrivals::default()
    }
}

fn run_with(cache: &mut dyn CacheUnderTest, convs: Vec<Conversation>, budget: usize) -> RunResult {
    let mut w = Workload::new(convs, arrivals()).unwrap();
    let mut calls = 0;
    let r = engine::run(
        &mut w,
        cache,
        &compute(),
        &config(budget),
        &mut |done, total| {
            calls += 1;
            assert!(done <= total);
        },
    )
    .unwrap();
    assert_eq!(
        calls,
        r.requests.len(),
        "progress after every finished request"
    );
    r
}

fn double(device_pages: usize, host_pages: usize, storage: bool) -> ExactPrefix {
    ExactPrefix::new(ExactPrefixConfig {
        page_size: PS,
        device_pages,
        host_pages,
        storage,
        page_bytes: PAGE_BYTES,
    })
}

fn p50(r: &RunResult) -> f64 {
    let mut t: Vec<f64> = r.requests.iter().map(|q| q.ttft()).collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn hits(r: &RunResult) -> usize {
    r.requests.iter().map(|q| q.hit()).sum()
}

#[test]
fn every_prompt_token_is_a_hit_or_computed() {
    let mut cache = double(48, 96, true);
    let r = run_with(&mut cache, conversations(), 2048);
    assert_eq!(r.requests.len(), 32);
    let mut tokens = 0;
    for q in &r.requests {
        assert_eq!(q.hit() + q.computed, q.prompt_tokens, "{q:?}");
        assert!(q.hit() < q.prompt_tokens, "at least one token computed");
        assert!(q.arrival <= q.admitted && q.admitted < q.first_token);
        assert!(q.first_token <= q.finished);
        assert!(q.prefetch_done <= q.admitted);
        tokens += q.prompt_tokens;
    }
    let s = r.cache;
    let sum = |f: fn(&hicache_sim::RequestRecord) -> usize| {
        r.requests.iter().map(f).sum::<usize>() as u64
    };
    assert_eq!(s.metrics.request_tokens, tokens as u64);
    assert_eq!(s.metrics.hit_tokens_l1, sum(|q| q.hit_l1));
    assert_eq!(s.metrics.hit_tokens_l2, sum(|q| q.hit_l2));
    assert_eq!(s.metrics.hit_tokens_l3, sum(|q| q.hit_l3));
    assert_eq!(
        s.metrics.h2d.pages * PS as u64,
        s.metrics.hit_tokens_l2 + s.metrics.hit_tokens_l3
    );
    assert!(
        s.metrics.hit_tokens_l1 > 0 && s.metrics.hit_tokens_l2 > 0 && s.metrics.hit_tokens_l3 > 0,
        "{s:?}"
    );
    // Loads in the steps are the admissions' host pages.
    let loaded: u64 = r.steps.iter().map(|s| s.load_bytes).sum();
    assert_eq!(loaded, s.metrics.h2d.bytes);
    // Everything handed back: no locks, all pages free or cached.
    assert_eq!(cache.lock_count(), 0);
    // Prefill steps computed exactly the computed tokens.
    let computed: usize = r
        .steps
        .iter()
        .filter(|s| s.kind == StepKind::Prefill)
        .map(|s| s.tokens)
        .sum();
    assert_eq!(
        computed as u64,
        tokens as u64 - s.metrics.hit_tokens_l1 - s.metrics.hit_tokens_l2 - s.metrics.hit_tokens_l3
    );
    // Decode steps produced every answer token but the first of each request.
    let decoded: usize = r
        .steps
        .iter()
        .filter(|s| s.kind == StepKind::Decode)
        .map(|s| s.tokens)
        .sum();
    let answers: usize = r.requests.iter().map(|q| q.answer_tokens - 1).sum();
    assert_eq!(decoded, answers);
}

#[test]
fn each_tier_adds_hits_and_cuts_ttft() {
    let mut none = NoCache::new(PS, 48, PAGE_BYTES);
    let base = run_with(&mut none, conversations(), 2048);
    let l1 = run_with(&mut double(48, 0, false), conversations(), 2048);
    let l2 = run_with(&mut double(48, 96, false), conversations(), 2048);
    let l3 = run_with(&mut double(48, 96, true), conversations(), 2048);
    assert_eq!(hits(&base), 0);
    assert!(hits(&l1) > 0);
    assert!(hits(&l2) > hits(&l1), "{} {}", hits(&l2), hits(&l1));
    assert!(hits(&l3) > hits(&l2), "{} {}", hits(&l3), hits(&l2));
    assert!(p50(&base) > p50(&l1), "{} {}", p50(&base), p50(&l1));
    assert!(p50(&l1) > p50(&l2), "{} {}", p50(&l1), p50(&l2));
    assert!(p50(&l2) >= p50(&l3), "{} {}", p50(&l2), p50(&l3));
    assert_eq!(l1.cache.metrics.h2d.pages, 0);
    assert_eq!(l2.cache.metrics.l3_to_l2.pages, 0);
    assert!(l3.cache.metrics.l3_to_l2.pages > 0);
}

#[test]
fn runs_repeat_exactly() {
    let a = run_with(&mut double(48, 96, true), conversations(), 2048);
    let b = run_with(&mut double(48, 96, true), conversations(), 2048);
    assert_eq!(a.requests, b.requests);
    assert_eq!(a.steps, b.steps);
    assert_eq!(a.cache, b.cache);
}

#[test]
fn prefill_steps_respect_the_budget_and_chunk_long_prompts() {
    let convs = LongContext {
        documents: 2,
        document_tokens: 1000,
        questions: 3,
        question_tokens: 20,
        answer_tokens: 4,
        vocab: 1000,
        seed: 1,
    }
    .conversations();
    let budget = 256;
    let mut cache = NoCache::new(PS, 400, PAGE_BYTES);
    let r = run_with(&mut cache, convs, budget);
    for s in r.steps.iter().filter(|s| s.kind == StepKind::Prefill) {
        assert!(s.tokens <= budget, "{s:?}");
        assert!(s.tokens > 0);
    }
    // 1020-token prompts need at least 4 prefill steps before their first token.
    for q in &r.requests {
        let steps = r
            .steps
            .iter()
            .filter(|s| {
                s.kind == StepKind::Prefill && s.start >= q.admitted && s.start < q.first_token
            })
            .count();
        assert!(steps >= 4, "{q:?}: {steps}");
    }
    assert_eq!(cache.free_pages(), 400, "every page returned");
}

#[test]
fn device_memory_bounds_concurrency() {
    // Each request needs up to ceil((256+4*120)/16) = 46 pages; 50 pages run one at a time.
    let convs = conversations();
    let mut tight = NoCache::new(PS, 50, PAGE_BYTES);
    let r = run_with(&mut tight, convs.clone(), 1 << 20);
    let mut roomy = NoCache::new(PS, 2000, PAGE_BYTES);
    let r2 = run_with(&mut roomy, convs, 1 << 20);
    let max_batch = |r: &RunResult| r.steps.iter().map(|s| s.requests).max().unwrap();
    assert!(max_batch(&r) < max_batch(&r2));
    assert!(r.sim_seconds > r2.sim_seconds);
    assert_eq!(tight.free_pages(), 50);
}

#[test]
fn a_request_larger_than_the_device_is_bad_input() {
    let mut w = Workload::new(conversations(), arrivals()).unwrap();
    let mut cache = NoCache::new(PS, 10, PAGE_BYTES);
    let e = engine::run(
        &mut w,
        &mut cache,
        &compute(),
        &config(2048),
        &mut |_, _| {},
    )
    .unwrap_err();
    assert_eq!(e.exit_code(), 2);
    assert!(e.to_string().contains("device holds 10 pages"), "{e}");
}

/// A cache that breaks rule 1 of the contract: its prefix covers the whole prompt.
struct Greedy(NoCache);

impl CacheUnderTest for Greedy {
    fn page_size(&self) -> usize {
        self.0.page_size()
    }
    fn device_pages(&self) -> usize {
        self.0.device_pages()
    }
    fn arrive(&mut self, req: RequestId, tokens: &[u32]) -> CacheResult<()> {
        self.0.arrive(req, tokens)
    }
    fn poll(&mut self) -> CacheResult<()> {
        self.0.poll()
    }
    fn prefetch_status(&mut self, req: RequestId) -> CacheResult<PrefetchStatus> {
        self.0.prefetch_status(req)
    }
    fn admit(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        new_tokens: usize,
    ) -> CacheResult<Option<Admission>> {
        let pages = tokens.len() / PS;
        Ok(self.0.admit(req, tokens, new_tokens)?.map(|mut a| {
            a.prefix_slots = a.new_slots.drain(..pages).collect();
            a.l1_pages = pages;
            a
        }))
    }
    fn start_loading(&mut self) -> CacheResult<Option<usize>> {
        self.0.start_loading()
    }
    fn wait_layer(&mut self, idx: usize, layer: usize) -> CacheResult<()> {
        self.0.wait_layer(idx, layer)
    }
    fn cache_finished(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        slots: &[DeviceSlot],
    ) -> CacheResult<()> {
        self.0.cache_finished(req, tokens, slots)
    }
    fn shutdown(&mut self) -> CacheResult<()> {
        self.0.shutdown()
    }
    fn stats(&self) -> CacheStats {
        self.0.stats()
    }
}

#[test]
fn contract_violations_stop_the_run_naming_the_request() {
    let convs = vec![Conversation::single(
        "x".into(),
        vec![7; 64],
        2,
        10,
        &mut rand::rng(),
    )];
    let mut w = Workload::new(convs, arrivals()).unwrap();
    let mut cache = Greedy(NoCache::new(PS, 100, PAGE_BYTES));
    let e = engine::run(
        &mut w,
        &mut cache,
        &compute(),
        &config(2048),
        &mut |_, _| {},
    )
    .unwrap_err();
    assert_eq!(e.exit_code(), 1);
    assert!(
        e.to_string().contains("request 0 (x)") && e.to_string().contains("whole"),
        "{e}"
    );
}

/// A cache whose prefetches stay pending for a few polls.
struct Slow {
    inner: NoCache,
    polls_left: usize,
}

impl CacheUnderTest for Slow {
    fn page_size(&self) -> usize {
        self.inner.page_size()
    }
    fn device_pages(&self) -> usize {
        self.inner.device_pages()
    }
    fn arrive(&mut self, req: RequestId, tokens: &[u32]) -> CacheResult<()> {
        self.polls_left = 3;
        self.inner.arrive(req, tokens)
    }
    fn poll(&mut self) -> CacheResult<()> {
        self.polls_left = self.polls_left.saturating_sub(1);
        Ok(())
    }
    fn prefetch_status(&mut self, _req: RequestId) -> CacheResult<PrefetchStatus> {
        Ok(if self.polls_left == 0 {
            PrefetchStatus::Ready { l3_pages: 2 }
        } else {
            PrefetchStatus::Pending
        })
    }
    fn admit(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        n: usize,
    ) -> CacheResult<Option<Admission>> {
        self.inner.admit(req, tokens, n)
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
}

#[test]
fn pending_prefetches_are_waited_for_and_their_time_modelled() {
    let convs = vec![Conversation::single(
        "x".into(),
        vec![7; 64],
        2,
        10,
        &mut rand::rng(),
    )];
    let mut w = Workload::new(convs, arrivals()).unwrap();
    let mut cache = Slow {
        inner: NoCache::new(PS, 100, PAGE_BYTES),
        polls_left: 0,
    };
    let c = compute();
    let r = engine::run(&mut w, &mut cache, &c, &config(2048), &mut |_, _| {}).unwrap();
    let q = &r.requests[0];
    assert_eq!(q.prefetched_pages, 2);
    let expected = c.l3_latency_s + 2.0 * PAGE_BYTES as f64 / c.l3_bytes_per_s;
    assert!((q.prefetch_done - q.arrival - expected).abs() < 1e-12);
    assert!(q.admitted >= q.prefetch_done);
    assert!(q.ttft() > expected);
}

/// A cache that refuses its first `refusals` admissions (memory held by copies in flight).
struct Busy {
    inner: NoCache,
    refusals: usize,
}

impl CacheUnderTest for Busy {
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
    fn prefetch_status(&mut self, req: RequestId) -> CacheResult<PrefetchStatus> {
        self.inner.prefetch_status(req)
    }
    fn admit(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        n: usize,
    ) -> CacheResult<Option<Admission>> {
        if self.refusals > 0 {
            self.refusals -= 1;
            return Ok(None);
        }
        self.inner.admit(req, tokens, n)
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
}

#[test]
fn transient_refusals_with_nothing_running_are_waited_out_without_simulated_time() {
    let plain = run_with(&mut NoCache::new(PS, 48, PAGE_BYTES), conversations(), 2048);
    let mut busy = Busy {
        inner: NoCache::new(PS, 48, PAGE_BYTES),
        refusals: 20,
    };
    let r = run_with(&mut busy, conversations(), 2048);
    assert_eq!(busy.refusals, 0);
    assert_eq!(
        r.requests, plain.requests,
        "the simulated clock did not move while waiting"
    );

    let mut stuck = Busy {
        inner: NoCache::new(PS, 48, PAGE_BYTES),
        refusals: usize::MAX,
    };
    let mut w = Workload::new(conversations(), arrivals()).unwrap();
    let cfg = EngineConfig {
        wall_wait_limit: Duration::from_millis(20),
        ..config(2048)
    };
    let e = engine::run(&mut w, &mut stuck, &compute(), &cfg, &mut |_, _| {}).unwrap_err();
    assert_eq!(e.exit_code(), 1);
    assert!(
        e.to_string().contains("refused admission") && e.to_string().contains("request 0"),
        "{e}"
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]

    /// Whatever the workload, memory and budget: every request finishes, every prompt token
    /// is a hit or computed, the cache's counts equal the engine's, prefill steps stay within
    /// the budget, every H2D page is an L2/L3 hit page, and nothing stays locked.
    #[test]
    fn accounting_holds_for_any_shape(
        clients in 1usize..5,
        rounds in 1usize..4,
        system in 0usize..80,
        user in 1usize..60,
        answer in 0usize..20,
        extra_pages in 0usize..40,
        host_pages in 0usize..60,
        storage: bool,
        budget in 16usize..300,
        seed: u64,
    ) {
        let convs = MultiTurn {
            clients, rounds, system_tokens: system, user_tokens: user, answer_tokens: answer,
            vocab: 50, seed,
        }
        .conversations();
        let longest = system + rounds * (user + answer);
        let device_pages = longest.div_ceil(PS) + extra_pages;
        let storage = storage && host_pages > 0;
        let mut cache = double(device_pages, host_pages, storage);
        let mut w = Workload::new(convs, Arrivals { seed, ..arrivals() }).unwrap();
        let r = engine::run(&mut w, &mut cache, &compute(), &config(budget), &mut |_, _| {}).unwrap();
        proptest::prop_assert_eq!(r.requests.len(), clients * rounds);
        let mut hits = [0u64; 3];
        for q in &r.requests {
            proptest::prop_assert_eq!(q.hit() + q.computed, q.prompt_tokens);
            proptest::prop_assert!(q.first_token <= q.finished && q.arrival <= q.admitted);
            hits[0] += q.hit_l1 as u64;
            hits[1] += q.hit_l2 as u64;
            hits[2] += q.hit_l3 as u64;
        }
        let s = r.cache;
        proptest::prop_assert_eq!([s.metrics.hit_tokens_l1, s.metrics.hit_tokens_l2, s.metrics.hit_tokens_l3], hits);
        proptest::prop_assert_eq!(s.metrics.h2d.pages * PS as u64, hits[1] + hits[2]);
        for step in &r.steps {
            if step.kind == StepKind::Prefill {
                proptest::prop_assert!(step.tokens <= budget);
            }
        }
        proptest::prop_assert_eq!(cache.lock_count(), 0);
        if host_pages == 0 {
            proptest::prop_assert_eq!(s.metrics.hit_tokens_l2 + s.metrics.hit_tokens_l3, 0);
        }
    }
}
