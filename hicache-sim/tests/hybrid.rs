//! The hybrid adapter (`HybridAdapter` over `hicache::HybridCache`) on a small multi-turn
//! workload, for a Mamba hybrid and a sliding-window hybrid of tiny shapes: runs repeat, the
//! engine's contract holds (its checks stop a run that breaks rules 1–3; rule 4 is checked
//! here), and the bytes moved per component add up to the pages the pools and the tree hold.

use hicache::Component;
use hicache_host::HostComponent;
use hicache_sim::engine::RunResult;
use hicache_sim::plan::{MultiturnArgs, Plan, plan};
use hicache_sim::{CacheUnderTest, HybridFactory, HybridModel, LinearAttention};

/// Qwen3.5's layer mix with tiny heads.
fn tiny_mamba() -> HybridModel {
    HybridModel {
        q_heads: 2,
        kv_heads: 1,
        head_dim: 8,
        params: 1e8,
        linear: Some(LinearAttention {
            key_heads: 1,
            value_heads: 2,
            key_head_dim: 8,
            value_head_dim: 8,
            ..HybridModel::qwen35_9b().linear.unwrap()
        }),
        ..HybridModel::qwen35_9b()
    }
}

/// Gemma 3's layer mix with tiny heads and a 64-token window.
fn tiny_swa() -> HybridModel {
    HybridModel {
        q_heads: 2,
        kv_heads: 1,
        head_dim: 8,
        params: 1e8,
        window: Some(64),
        ..HybridModel::gemma3_12b()
    }
}

/// The small workload with `extra` flags (pairs) replacing or adding to its own.
fn small_plan(tiers: &str, extra: &[&str]) -> Plan {
    let mut flags = vec![
        ("--clients", "4"),
        ("--rounds", "3"),
        ("--system-tokens", "128"),
        ("--user-tokens", "48"),
        ("--answer-tokens", "16"),
        ("--page-size", "16"),
        ("--device-pages", "48"),
        ("--tiers", tiers),
    ];
    for pair in extra.chunks(2) {
        flags.retain(|(k, _)| *k != pair[0]);
        flags.push((pair[0], pair[1]));
    }
    let argv: Vec<&str> = flags.iter().flat_map(|(k, v)| [*k, *v]).collect();
    plan(&MultiturnArgs::try_parse(&argv).unwrap()).unwrap()
}

fn run(model: &HybridModel, tiers: &str) -> (RunResult, HybridFactory, Plan) {
    run_with(model, tiers, &["--hicache-ratio", "3"])
}

fn run_with(model: &HybridModel, tiers: &str, extra: &[&str]) -> (RunResult, HybridFactory, Plan) {
    let base = small_plan(tiers, extra);
    let p = base.for_hybrid(model);
    let factory = HybridFactory::new(model.clone(), 16);
    let mut cache = factory.build_adapter(&p.setup).unwrap();
    let r = p.run_one(&mut cache, &mut |_| {}).unwrap();
    check_moves(&cache, model, &p);
    (r, factory, p)
}

/// Rule 4: the cache counted each admitted request's prefix once, by tier, as the engine did.
fn check_hits(r: &RunResult) {
    let m = &r.cache.metrics;
    let sum = |f: fn(&hicache_sim::RequestRecord) -> usize| -> u64 {
        r.requests.iter().map(|q| f(q) as u64).sum()
    };
    assert_eq!(m.hit_tokens_l1, sum(|q| q.hit_l1));
    assert_eq!(m.hit_tokens_l2, sum(|q| q.hit_l2));
    assert_eq!(m.hit_tokens_l3, sum(|q| q.hit_l3));
    assert_eq!(m.request_tokens, sum(|q| q.prompt_tokens));
    for q in &r.requests {
        assert_eq!(q.hit() + q.computed, q.prompt_tokens, "request {}", q.id);
        assert_eq!(q.hit() % 16, 0, "request {}: whole pages", q.id);
    }
}

/// Bytes per component are pages × the component's page (state) bytes, and what was copied
/// to host (from device or L3) minus what host eviction freed is what the host pools hold;
/// on device, the pools hold exactly what the tree reports.
fn check_moves(cache: &hicache_sim::HybridAdapter, model: &HybridModel, p: &Plan) {
    let ps = p.setup.kv_shape.page_size;
    let stats = cache.stats();
    let moves = stats
        .components
        .expect("a hybrid cache reports its components");
    let t = cache.cache().metrics();
    let host = cache.cache().host_pools();
    let tree = cache.cache().tree();
    let parts = [
        (
            Component::Full,
            HostComponent::Kv,
            &moves.full,
            &t.full,
            model.full_kv_shape(ps).page_bytes() as u64,
        ),
        (
            Component::Swa,
            HostComponent::Swa,
            &moves.swa,
            &t.swa,
            model.swa_kv_shape(ps).map_or(0, |s| s.page_bytes()) as u64,
        ),
        (
            Component::Mamba,
            HostComponent::Mamba,
            &moves.mamba,
            &t.mamba,
            model.state_bytes(),
        ),
    ];
    for (c, hc, m, totals, unit) in parts {
        for (dir, x) in m.directions() {
            assert_eq!(x.bytes, x.pages * unit, "{c:?} {dir}");
        }
        if !tree.has(c) {
            assert_eq!(
                m.d2h.pages + m.h2d.pages,
                0,
                "{c:?} moved without that component"
            );
            continue;
        }
        let used_host = host.capacity(hc).unwrap() - host.available(hc).unwrap();
        assert_eq!(
            m.d2h.pages + m.l3_to_l2.pages - totals.evicted_host,
            used_host as u64,
            "{c:?}: host pages copied from device or fetched from L3, minus evicted"
        );
        let on_device = match c {
            Component::Mamba => {
                let pool = cache.cache().state_pool().unwrap();
                (pool.num_slots() - pool.available()) as u64
            }
            _ => {
                let pool = cache.cache().device_pool(c).unwrap();
                ((pool.num_pages() - pool.available()) * ps as usize) as u64
            }
        };
        assert_eq!(on_device, tree.size(c), "{c:?}: device pool vs tree");
    }
    // The Full component is the dense view the report checks.
    assert_eq!(stats.metrics.d2h.pages, moves.full.d2h.pages);
    assert_eq!(
        stats.page_bytes,
        model.full_kv_shape(ps).page_bytes() as u64
    );
}

fn hits_of(r: &RunResult) -> Vec<(usize, usize, usize)> {
    r.requests
        .iter()
        .map(|q| (q.hit_l1, q.hit_l2, q.hit_l3))
        .collect()
}

#[test]
fn a_mamba_hybrid_repeats_and_keeps_the_contract() {
    let m = tiny_mamba();
    let (a, _, _) = run(&m, "l1+l2");
    let (b, _, _) = run(&m, "l1+l2");
    assert_eq!(hits_of(&a), hits_of(&b), "two runs, same hits");
    assert_eq!(
        a.requests.iter().map(|q| q.first_token).collect::<Vec<_>>(),
        b.requests.iter().map(|q| q.first_token).collect::<Vec<_>>()
    );
    check_hits(&a);
    let moves = a.cache.components.unwrap();
    assert!(
        a.cache.metrics.hit_tokens_l1 > 0,
        "later rounds reuse their history"
    );
    assert!(
        a.cache.metrics.hit_tokens_l2 > 0,
        "evicted history comes back from host"
    );
    assert!(moves.mamba.h2d.pages > 0, "with its state");
    assert!(moves.mamba.d2h.pages > 0, "states are written through");
    assert!(moves.full.d2h.pages > 0);
    assert_eq!(moves.swa.d2h.pages, 0);
    // Every component's write-through was timed on the simulated D2H link.
    let copied: u64 = moves.components().iter().map(|(_, c)| c.d2h.bytes).sum();
    assert_eq!(a.links.d2h.bytes, copied);
}

#[test]
fn a_sliding_window_hybrid_repeats_and_keeps_the_contract() {
    let m = tiny_swa();
    let (a, _, _) = run(&m, "l1+l2");
    let (b, _, _) = run(&m, "l1+l2");
    assert_eq!(hits_of(&a), hits_of(&b), "two runs, same hits");
    check_hits(&a);
    let moves = a.cache.components.unwrap();
    assert!(a.cache.metrics.hit_tokens_l1 > 0);
    assert!(
        a.cache.metrics.hit_tokens_l2 > 0,
        "evicted history comes back from host"
    );
    assert!(moves.swa.d2h.pages > 0, "SWA pages are written through");
    assert_eq!(moves.mamba.d2h.pages, 0);
}

#[test]
fn device_only_runs_move_nothing_to_host() {
    let m = tiny_mamba();
    let (a, _, _) = run(&m, "l1");
    check_hits(&a);
    let moves = a.cache.components.unwrap();
    assert_eq!(a.cache.metrics.hit_tokens_l2, 0);
    for (_, c) in moves.components() {
        assert_eq!(c.d2h.pages + c.h2d.pages, 0);
    }
}

#[test]
fn l3_serves_what_host_memory_evicted_for_both_hybrids() {
    // More history than host memory holds: what host eviction dropped comes back from L3
    // (copy time charged: a page counts in L3 once its backup completed).
    let extra = [
        "--storage-backend",
        "memory",
        "--extra-config",
        r#"{"prefetch_threshold": 16}"#,
        "--hicache-ratio",
        "2",
        "--system-tokens",
        "256",
        "--clients",
        "10",
        "--device-pages",
        "64",
    ];
    for m in [tiny_swa(), tiny_mamba()] {
        let (a, _, _) = run_with(&m, "l1+l2+l3", &extra);
        let (b, _, _) = run_with(&m, "l1+l2+l3", &extra);
        assert_eq!(hits_of(&a), hits_of(&b), "{}: two runs, same hits", m.name);
        check_hits(&a);
        let moves = a.cache.components.unwrap();
        assert!(moves.full.l2_to_l3.pages > 0, "{}: backed up to L3", m.name);
        let aux = if m.swa_layers > 0 {
            &moves.swa
        } else {
            &moves.mamba
        };
        assert!(
            aux.l2_to_l3.pages > 0,
            "{}: its other component too",
            m.name
        );
        assert!(
            a.cache.metrics.hit_tokens_l3 > 0,
            "{}: L3 hits {:?}, {} pages stored but not yet visible",
            m.name,
            a.cache.metrics,
            a.cache.l3_pages_in_flight
        );
        assert!(moves.full.l3_to_l2.pages > 0);
        // The prefetches' reads take time on the L3 link (Full and SWA pages).
        let read: usize = a.requests.iter().map(|q| q.prefetched_pages).sum();
        assert!(read > 0, "{}: prefetched pages reported", m.name);
        assert!(
            a.links.l3_read_bytes > 0,
            "{}: charged on the L3 link",
            m.name
        );
    }
}

/// `len` tokens of conversation `seed`.
fn tokens(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 100_000 + i).collect()
}

/// One request through the adapter with copy time free: arrive, admit (which must fit),
/// finish with its answer, poll.
fn serve(cache: &mut dyn CacheUnderTest, req: u64, prompt: &[u32], answer: usize) {
    cache.arrive(req, prompt).unwrap();
    cache.poll().unwrap();
    let adm = cache.admit(req, prompt, answer).unwrap().expect("room");
    finish(cache, req, prompt, answer, adm);
}

fn finish(
    cache: &mut dyn CacheUnderTest,
    req: u64,
    prompt: &[u32],
    answer: usize,
    adm: hicache_sim::Admission,
) {
    let mut all = prompt.to_vec();
    all.extend(tokens(9_000 + req as u32, answer));
    let mut slots = adm.prefix_slots;
    slots.extend(adm.new_slots);
    cache.cache_finished(req, &all, &slots).unwrap();
    cache.poll().unwrap();
}

/// 20 device pages of 16 tokens. Turn one of conversation 1 (11 pages with its answer) is
/// pushed to host by conversation 2; a third request runs and holds 16 pages; turn two of
/// conversation 1 (its first pages on host, 15 pages in all) has no room beside it: the
/// cache refuses it whole (nothing counted, nothing loaded), and admits it with its L2 hit,
/// counted once, when it is admitted again after the third has ended.
fn refused_then_matched_again(cache: &mut dyn CacheUnderTest, name: &str) {
    let a = tokens(1, 160);
    serve(cache, 1, &a, 16);
    serve(cache, 2, &tokens(2, 160), 16);
    let before = cache.stats().metrics;
    let c = tokens(3, 240);
    cache.arrive(3, &c).unwrap();
    let running = cache.admit(3, &c, 16).unwrap().expect("room");
    let mut a2 = a.clone();
    a2.extend(tokens(9_001, 16));
    a2.extend(tokens(4, 48));
    cache.arrive(4, &a2).unwrap();
    cache.poll().unwrap();
    let refused = cache.admit(4, &a2, 16).unwrap();
    assert!(
        refused.is_none(),
        "{name}: no room for the hit and the rest"
    );
    let m = cache.stats().metrics;
    assert_eq!(
        m.hit_tokens_l2, before.hit_tokens_l2,
        "{name}: nothing counted"
    );
    assert_eq!(m.h2d.pages, before.h2d.pages, "{name}: nothing loaded");
    finish(cache, 3, &c, 16, running);
    let adm = cache
        .admit(4, &a2, 16)
        .unwrap()
        .expect("room once request 3 ended");
    assert_eq!(adm.l1_pages, 0, "{name}: {adm:?}");
    assert!(adm.l2_pages >= 8, "{name}: the L2 hit kept: {adm:?}");
    let hit = adm.l2_pages as u64 * 16;
    finish(cache, 4, &a2, 16, adm);
    let after = cache.stats().metrics;
    assert_eq!(
        after.hit_tokens_l2 - before.hit_tokens_l2,
        hit,
        "{name}: counted once"
    );
    cache.shutdown().unwrap();
}

#[test]
fn a_request_refused_for_its_load_back_waits_and_is_matched_again_with_its_hit() {
    let flags = ["--device-pages", "20", "--hicache-ratio", "3"];
    for m in [tiny_swa(), tiny_mamba()] {
        let p = small_plan("l1+l2", &flags).for_hybrid(&m);
        let factory = HybridFactory::new(m.clone(), 16);
        let mut adapter = factory.build_adapter(&p.setup).unwrap();
        refused_then_matched_again(&mut adapter, &m.name);
    }
    // The dense controller does the same: its adapter undoes an admission whose rest does
    // not fit (`unadmit`), and a refused load-back leaves no room for the rest.
    let p = small_plan("l1+l2", &flags);
    let mut dense = hicache_sim::adapter::HiCacheUnderTest::build(&p.setup, false).unwrap();
    refused_then_matched_again(&mut dense, "dense");
}
