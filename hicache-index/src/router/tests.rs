//! Router tests: fallback, session affinity, hybrid fleets, the policies through the router.

use super::*;
use crate::ingest::{EngineEvent, IngestCounts, InstanceFeed};
use crate::table::HolderKind;

const PS: usize = 4;

/// An index with `n` instances (no L3) and their feeds.
fn fleet(n: usize) -> (Index, Vec<InstanceFeed>, Vec<InstanceInfo>) {
    let mut idx = Index::new(None);
    let mut feeds = Vec::new();
    let mut infos = Vec::new();
    for _ in 0..n {
        let h = idx.add_holder(HolderKind::Instance).unwrap();
        feeds.push(InstanceFeed::new(h, h, PS as u32));
        infos.push(InstanceInfo {
            holder: h,
            l3: L3Access::None,
            kv_capacity_tokens: None,
            l3_prefetch_threshold_tokens: None,
        });
    }
    (idx, feeds, infos)
}

/// `feed` reports `tokens` (whole pages) stored in `medium`, engine hashes from `base`.
fn store(idx: &mut Index, feed: &mut InstanceFeed, tokens: &[u32], medium: &str, base: i64) {
    let pages = tokens.len() / PS;
    let ev = EngineEvent::BlockStored {
        block_hashes: (0..pages as i64).map(|i| base + i).collect(),
        parent_block_hash: None,
        token_ids: tokens[..pages * PS].to_vec(),
        block_size: PS as u32,
        lora_id: None,
        medium: Some(medium.into()),
    };
    let mut c = IngestCounts::default();
    feed.apply(idx, &ev, &mut c).unwrap();
    assert_eq!(c.stored_blocks, pages as u64);
}

/// The load of an instance far behind: 100,000 prompt tokens queued over 50 requests.
const BACKED_UP: LoadReport = LoadReport {
    queued_prefill_tokens: 100_000,
    requests: 50,
    running_tokens: 0,
    prefetching_requests: 0,
};

fn req(id: u64, tokens: &[u32], session: Option<u64>) -> RouteRequest<'_> {
    RouteRequest {
        request: id,
        tokens,
        session,
        lora: None,
    }
}

struct Down;
impl OverlapSource for Down {
    fn overlaps(&self, _: &[BlockHash], _: &mut Answer) -> Result<(), IndexUnavailable> {
        Err(IndexUnavailable("connection refused".into()))
    }
}

struct Slow<'a>(&'a Index);
impl OverlapSource for Slow<'_> {
    fn overlaps(&self, h: &[BlockHash], out: &mut Answer) -> Result<(), IndexUnavailable> {
        std::thread::sleep(Duration::from_millis(20));
        self.0.overlaps(h, out)
    }
}

#[test]
fn hicache_sends_a_prompt_where_its_prefix_is_in_l1() {
    let (mut idx, mut feeds, infos) = fleet(3);
    let prompt: Vec<u32> = (0..33).collect();
    store(&mut idx, &mut feeds[2], &prompt[..32], "GPU", 100);
    let mut r = Router::new(Policy::Hicache, infos, RouterConfig::new(PS));
    let d = r.route(&idx, &req(1, &prompt, None));
    assert_eq!(d.instance, 2);
    assert_eq!(
        d.overlap,
        Overlap {
            l1: 32,
            l2: 32,
            l3: 32
        }
    );
    assert!(!d.fallback);
    // Accounting: the credited overlap is not load; only the last token is.
    assert_eq!(r.load().load(2).queued_prefill_tokens, 1.0);
}

/// Instance 0 holds the prompt's 400-token prefix in L1 but its device memory is nearly full
/// (capacity 640 tokens, 560 held by a running request): the request's 1 new token and 128
/// answer tokens do not fit, so it would wait about half an answer's decode (~0.4 s), and the
/// idle instance 1 wins despite recomputing 401 tokens (~13 ms). Without a known capacity the
/// cache wins (~3 ms behind half a decode step), as before.
#[test]
fn hicache_avoids_an_instance_whose_memory_cannot_hold_the_request() {
    let (mut idx, mut feeds, infos) = fleet(2);
    let prompt: Vec<u32> = (0..401).collect();
    store(&mut idx, &mut feeds[0], &prompt[..400], "GPU", 100);
    let busy = LoadReport {
        queued_prefill_tokens: 0,
        requests: 1,
        running_tokens: 560,
        ..LoadReport::default()
    };
    let sized: Vec<InstanceInfo> = infos
        .iter()
        .map(|i| InstanceInfo {
            kv_capacity_tokens: Some(640),
            l3_prefetch_threshold_tokens: None,
            ..*i
        })
        .collect();
    let mut r = Router::new(Policy::Hicache, sized, RouterConfig::new(PS));
    r.report_load(0, busy);
    assert_eq!(r.route(&idx, &req(1, &prompt, None)).instance, 1);
    let mut r = Router::new(Policy::Hicache, infos, RouterConfig::new(PS));
    r.report_load(0, busy);
    assert_eq!(r.route(&idx, &req(1, &prompt, None)).instance, 0);
}

#[test]
fn a_lost_index_falls_back_to_least_load_and_is_counted() {
    let (mut idx, mut feeds, infos) = fleet(2);
    let prompt: Vec<u32> = (0..17).collect();
    store(&mut idx, &mut feeds[0], &prompt[..16], "GPU", 1);
    for policy in [Policy::Hicache, Policy::DynamoLinear] {
        let mut r = Router::new(policy, infos.clone(), RouterConfig::new(PS));
        // Instance 0 holds the prefix but is busier: the fallback ignores the cache.
        r.report_load(
            0,
            LoadReport {
                queued_prefill_tokens: 0,
                requests: 3,
                running_tokens: 0,
                ..LoadReport::default()
            },
        );
        let d = r.route(&Down, &req(1, &prompt, None));
        assert!(d.fallback, "{policy}");
        assert_eq!(d.instance, 1);
        assert_eq!(d.overlap, Overlap::default());
        let mut cfg = RouterConfig::new(PS);
        cfg.deadline = Duration::from_millis(1);
        let mut r = Router::new(policy, infos.clone(), cfg);
        r.report_load(
            0,
            LoadReport {
                queued_prefill_tokens: 0,
                requests: 3,
                running_tokens: 0,
                ..LoadReport::default()
            },
        );
        let d = r.route(&Slow(&idx), &req(2, &prompt, None));
        assert!(d.fallback);
        assert_eq!(d.instance, 1);
        let s = r.stats();
        assert_eq!((s.fallback_slow, s.fallback_down, s.decisions), (1, 0, 1));
        // With the index back, the cache wins again.
        let d = r.route(&idx, &req(3, &prompt, None));
        assert!(!d.fallback);
        assert_eq!(d.instance, 0);
    }
    let mut r = Router::new(Policy::Hicache, infos, RouterConfig::new(PS));
    r.route(&Down, &req(1, &prompt, None));
    assert_eq!(r.stats().fallback_down, 1);
}

#[test]
fn sessions_stay_together_when_costs_tie() {
    let (idx, _, infos) = fleet(2);
    let mut r = Router::new(Policy::Hicache, infos, RouterConfig::new(PS));
    // Nothing cached anywhere. Session 7's first turn goes to instance 0 (tie: lowest
    // index), session 8's to instance 1 (instance 0 is busier).
    let a: Vec<u32> = (0..9).collect();
    assert_eq!(r.route(&idx, &req(1, &a, Some(7))).instance, 0);
    assert_eq!(r.route(&idx, &req(2, &a, Some(8))).instance, 1);
    // Equal load on both: without a session the tie goes to instance 0; session 8 stays on 1.
    let d = r.route(&idx, &req(3, &a, Some(8)));
    assert_eq!(d.instance, 1);
    assert_eq!(r.stats().session_kept, 1);
    r.finished(3);
    assert_eq!(r.route(&idx, &req(4, &a, None)).instance, 0);
    r.finished(4);
    // Beyond the tolerance the cheaper instance wins over the session.
    r.report_load(
        1,
        LoadReport {
            queued_prefill_tokens: 10_000,
            requests: 5,
            running_tokens: 0,
            ..LoadReport::default()
        },
    );
    assert_eq!(r.route(&idx, &req(5, &a, Some(8))).instance, 0);
    assert_eq!(r.stats().session_kept, 1);
}

#[test]
fn a_hybrid_fleet_is_never_routed_to_a_false_hit() {
    // Both instances report the same Full-attention pages (as the hybrid facade's events
    // do); only instance 0 holds a Mamba state, after block 2. Instance 1 lost its state.
    let (mut idx, mut feeds, infos) = fleet(2);
    let prompt: Vec<u32> = (100..117).collect();
    store(&mut idx, &mut feeds[0], &prompt[..16], "GPU", 1);
    store(&mut idx, &mut feeds[1], &prompt[..16], "GPU", 50);
    let mut cfg = RouterConfig::new(PS);
    cfg.reuse = ReuseRule::Hybrid;
    let mut r = Router::new(Policy::Hicache, infos.clone(), cfg.clone());
    let mut comps = Components::new();
    let mut counts = ComponentCounts::default();
    // Instance 0's engine reports a Mamba state at its block 2 (engine hash 2), as its
    // component events do; the block resolves through the Full pages it stored.
    comps.apply(
        &feeds[0],
        &crate::decode::ComponentEvent::Stored {
            kind: crate::decode::ComponentKind::Mamba,
            block_hashes: vec![2],
            block_size: PS as u32,
            medium: Some("GPU".into()),
        },
        &mut counts,
    );
    assert_eq!((counts.stored, counts.unresolved), (1, 0));
    let with = WithComponents {
        index: &idx,
        components: &comps,
    };
    let d = r.route(&with, &req(1, &prompt, None));
    assert_eq!(d.instance, 0);
    assert_eq!(
        d.overlap,
        Overlap {
            l1: 8,
            l2: 8,
            l3: 8
        }
    );
    // Instance 0's state leaves its device: no credit at all, whatever the Full pages say
    // (and none either from a source that tracks no component).
    comps.apply(
        &feeds[0],
        &crate::decode::ComponentEvent::Removed {
            kind: crate::decode::ComponentKind::Mamba,
            block_hashes: vec![2],
            medium: Some("GPU".into()),
        },
        &mut counts,
    );
    for policy in [Policy::Hicache, Policy::DynamoLinear] {
        let mut r = Router::new(policy, infos.clone(), cfg.clone());
        let with = WithComponents {
            index: &idx,
            components: &comps,
        };
        let d = r.route(&with, &req(2, &prompt, None));
        assert_eq!(d.overlap, Overlap::default(), "{policy}");
        let d = r.route(&idx, &req(3, &prompt, None));
        assert_eq!(d.overlap, Overlap::default(), "{policy}");
    }
    // The dense rule would have credited all four pages: the false hit the rule prevents.
    let mut dense = Router::new(Policy::Hicache, infos, RouterConfig::new(PS));
    assert_eq!(dense.route(&idx, &req(3, &prompt, None)).overlap.l1, 16);
}

#[test]
fn dynamo_through_the_router_credits_tiers_by_its_weights() {
    // Instance 0: 2 pages on device; instance 1: 4 pages in host memory (credit 3 > 2).
    let (mut idx, mut feeds, infos) = fleet(2);
    let prompt: Vec<u32> = (0..21).collect();
    store(&mut idx, &mut feeds[0], &prompt[..8], "GPU", 1);
    store(&mut idx, &mut feeds[1], &prompt[..16], "CPU_PINNED", 10);
    let mut r = Router::new(Policy::DynamoLinear, infos, RouterConfig::new(PS));
    let d = r.route(&idx, &req(1, &prompt, None));
    assert_eq!(d.instance, 1);
    // 21/4 = 5.25 blocks − 0.75·4 = 2.25.
    assert!((d.score - 2.25).abs() < 1e-9);
}

#[test]
fn policies_parse_by_name() {
    for p in Policy::ALL {
        assert_eq!(p.name().parse::<Policy>().unwrap(), p);
    }
    assert!("random".parse::<Policy>().unwrap_err().contains("hicache"));
}

#[test]
fn a_router_over_a_changed_fleet_keeps_what_it_knew_of_the_instances_that_stay() {
    let (mut idx, _feeds, infos) = fleet(3);
    let mut r = Router::new(Policy::LeastLoad, infos.clone(), RouterConfig::new(PS));
    let prompt: Vec<u32> = (0..16).collect();
    assert_eq!(r.route(&idx, &req(1, &prompt, Some(9))).instance, 0);
    assert_eq!(r.route(&idx, &req(2, &prompt, None)).instance, 1);
    assert_eq!(r.route(&idx, &req(3, &prompt, None)).instance, 2);
    // Instance 0 leaves; 1 and 2 become 0 and 1; a newcomer is 2.
    let newcomer = InstanceInfo {
        holder: idx.add_holder(HolderKind::Instance).unwrap(),
        l3: L3Access::None,
        kv_capacity_tokens: None,
        l3_prefetch_threshold_tokens: None,
    };
    let mut r = r.with_instances(vec![infos[1], infos[2], newcomer], |i| {
        [None, Some(0), Some(1)][i]
    });
    assert_eq!(r.load().outstanding(), 2);
    assert_eq!(r.load().load(0).requests, 1.0);
    assert_eq!(r.load().load(2).requests, 0.0);
    assert_eq!(r.stats().decisions, 3);
    // The newcomer is idle: least-load sends the next request there.
    assert_eq!(r.route(&idx, &req(4, &prompt, None)).instance, 2);
    // Request 1 went to the instance that left: unknown now.
    assert_eq!(r.finished(1), None);
    assert_eq!(r.finished(3), Some(1));
}

/// A router restored from another's state decides every later request as that one does
/// (load, outstanding requests, sessions, turn); remapped, what belonged to an instance that
/// left is dropped and the rest moves with its instance.
#[test]
fn a_restored_router_decides_as_the_one_that_saved_its_state() {
    let (idx, _feeds, infos) = fleet(3);
    for policy in [Policy::RoundRobin, Policy::LeastLoad, Policy::Hicache] {
        let mut a = Router::new(policy, infos.clone(), RouterConfig::new(PS));
        let prompts: Vec<Vec<u32>> = (0..12u32)
            .map(|k| (0..(8 + 4 * k)).map(|t| t + 100 * k).collect())
            .collect();
        for (k, p) in prompts.iter().enumerate() {
            a.route(&idx, &req(k as u64, p, Some(k as u64 % 4)));
        }
        a.finished(3);
        a.report_load(
            1,
            LoadReport {
                queued_prefill_tokens: 40,
                requests: 2,
                running_tokens: 100,
                ..LoadReport::default()
            },
        );
        let state = a.state();
        let mut b = Router::new(policy, infos.clone(), RouterConfig::new(PS));
        b.restore_state(&state, Some);
        assert_eq!(b.state(), state, "{policy}");
        for (k, p) in prompts.iter().enumerate() {
            let id = 100 + k as u64;
            let s = Some(k as u64 % 5);
            assert_eq!(
                a.route(&idx, &req(id, p, s)).instance,
                b.route(&idx, &req(id, p, s)).instance,
                "{policy}: request {id}"
            );
            assert_eq!(a.finished(k as u64), b.finished(k as u64), "{policy}");
        }
    }
    // Instance 0 leaves; 1 and 2 become 0 and 1.
    let mut a = Router::new(Policy::LeastLoad, infos.clone(), RouterConfig::new(PS));
    let p: Vec<u32> = (0..16).collect();
    for k in 0..3u64 {
        assert_eq!(a.route(&idx, &req(k, &p, Some(k))).instance, k as usize);
    }
    let mut b = Router::new(
        Policy::LeastLoad,
        infos[1..].to_vec(),
        RouterConfig::new(PS),
    );
    b.restore_state(&a.state(), |i| i.checked_sub(1));
    assert_eq!(b.load().outstanding(), 2);
    assert_eq!(b.finished(0), None);
    assert_eq!(b.finished(2), Some(1));
    let st = b.state();
    assert_eq!(
        st.sessions
            .iter()
            .map(|s| (s.session, s.instance))
            .collect::<Vec<_>>(),
        [(1, 0), (2, 1)]
    );
}

/// Rule 4 (switched on): a prompt routed to an instance and not finished (not in the index yet) draws the
/// next prompt sharing its prefix to that instance under `hicache`; finished, it no longer
/// does; a hybrid fleet never gets the credit.
#[test]
fn hicache_credits_prefixes_in_flight_on_dense_models_only() {
    let (idx, _feeds, infos) = fleet(3);
    let long: Vec<u32> = (0..64).collect();
    let mut next = long.clone();
    next.extend(64..80);
    let mut cfg = RouterConfig::new(PS);
    cfg.credit_in_flight = true;
    let mut r = Router::new(Policy::Hicache, infos.clone(), cfg.clone());
    // Instances 1 and 2 are backed up: both requests go to 0.
    r.report_load(1, BACKED_UP);
    r.report_load(2, BACKED_UP);
    let first = r.route(&idx, &req(1, &long, None)).instance;
    let d = r.route(&idx, &req(2, &next, None));
    assert_eq!(d.instance, first);
    // The first prompt's whole pages before its last token: 15 of 4 tokens.
    assert_eq!(d.overlap.l1, 60);
    r.finished(1);
    r.finished(2);
    let d = r.route(&idx, &req(3, &next, None));
    assert_eq!(d.overlap, Overlap::default());
    cfg.reuse = ReuseRule::Hybrid;
    let mut h = Router::new(Policy::Hicache, infos, cfg);
    h.route(&idx, &req(1, &long, None));
    assert_eq!(
        h.route(&idx, &req(2, &next, None)).overlap,
        Overlap::default()
    );
}

/// In-flight credit only reaches past what the index shows: instance 2 holds the shared
/// 32-token head in L1. A prompt in flight on instance 0 extends it; the next turn (sharing 60
/// tokens with it) is credited 60 tokens on 0, but a new conversation sharing only the head
/// earns no credit on 0 (the index shows the head on 2), so it is not sent to 0 for it.
#[test]
fn in_flight_credit_covers_only_what_the_index_shows_nowhere() {
    let (mut idx, mut feeds, infos) = fleet(3);
    let long: Vec<u32> = (0..64).collect();
    store(&mut idx, &mut feeds[2], &long[..32], "GPU", 500);
    let mut next = long.clone();
    next.extend(64..80);
    let mut other: Vec<u32> = long[..32].to_vec();
    other.extend(1000..1032);
    let mut cfg = RouterConfig::new(PS);
    cfg.credit_in_flight = true;
    let mut r = Router::new(Policy::Hicache, infos, cfg);
    r.report_load(1, BACKED_UP);
    r.report_load(2, BACKED_UP);
    assert_eq!(r.route(&idx, &req(1, &long, None)).instance, 0);
    let d = r.route(&idx, &req(2, &next, None));
    assert_eq!((d.instance, d.overlap.l1), (0, 60));
    let d = r.route(&idx, &req(3, &other, None));
    assert_eq!(d.instance, 0, "instances 1 and 2 are backed up");
    assert_eq!(d.overlap, Overlap::default());
}

/// An L3 run shorter than an instance's prefetch threshold past its L1 and L2 overlap is
/// never fetched by its engine: the router credits none of it; at the threshold, all of it.
#[test]
fn an_l3_run_below_the_prefetch_threshold_earns_no_credit() {
    let (mut idx, mut feeds, mut infos) = fleet(1);
    infos[0].l3 = L3Access::Private(1e10);
    infos[0].l3_prefetch_threshold_tokens = Some(3 * PS as u64);
    let tokens: Vec<u32> = (0..6 * PS as u32).collect();
    // L1 holds the first page, L3 the first three.
    store(&mut idx, &mut feeds[0], &tokens[..PS], "GPU", 0);
    store(&mut idx, &mut feeds[0], &tokens[..3 * PS], "DISK", 0);
    let overlap = |infos: &[InstanceInfo], idx: &Index| {
        let mut r = Router::new(Policy::Hicache, infos.to_vec(), RouterConfig::new(PS));
        r.route(idx, &req(1, &tokens, None)).overlap
    };
    // Two pages of L3 past L1: below three pages, so only L1 counts.
    let o = overlap(&infos, &idx);
    assert_eq!((o.l1, o.l2, o.l3), (PS, PS, PS));
    // A fourth page in L3: three past L1, at the threshold.
    store(&mut idx, &mut feeds[0], &tokens[..4 * PS], "DISK", 0);
    let o = overlap(&infos, &idx);
    assert_eq!((o.l1, o.l2, o.l3), (PS, PS, 4 * PS));
    // Without a threshold every L3 page counts.
    infos[0].l3_prefetch_threshold_tokens = None;
    store(&mut idx, &mut feeds[0], &tokens[..5 * PS], "DISK", 0);
    assert_eq!(overlap(&infos, &idx).l3, 5 * PS);
}

/// Requests it overtakes, through the router: two instances reading one store that holds a
/// prompt's prefix. The prompt goes to instance 0 (a tie, lowest index) with its prefix
/// credited from L3, so its prefetch runs there. Instance 1 then reports the same load
/// without a prefetch. A fresh prompt would delay the waiting request on instance 0 by its
/// whole prefill: it goes to instance 1. Once instance 0 reports that nothing waits for a
/// prefetch, the next fresh prompt ties again and goes to instance 0.
#[test]
fn hicache_does_not_send_a_prompt_to_overtake_a_request_awaiting_its_prefetch() {
    let mut idx = Index::new(None);
    let s = idx.add_holder(HolderKind::Store).unwrap();
    let mut feeds = Vec::new();
    let mut infos = Vec::new();
    for _ in 0..2 {
        let h = idx.add_holder(HolderKind::Instance).unwrap();
        idx.attach(h, s).unwrap();
        feeds.push(InstanceFeed::new(h, s, PS as u32));
        infos.push(InstanceInfo {
            holder: h,
            l3: L3Access::Shared(1e9),
            kv_capacity_tokens: None,
            l3_prefetch_threshold_tokens: None,
        });
    }
    let cached: Vec<u32> = (0..401).collect();
    store(&mut idx, &mut feeds[0], &cached[..400], "EXTERNAL", 100);
    let mut r = Router::new(Policy::Hicache, infos, RouterConfig::new(PS));
    let d = r.route(&idx, &req(1, &cached, None));
    assert_eq!(d.instance, 0);
    assert!(d.overlap.l3 == 400 && d.overlap.l2 == 0);
    assert_eq!(r.load().load(0).prefetching_requests, 1.0);
    let same = LoadReport {
        queued_prefill_tokens: 1,
        requests: 1,
        running_tokens: 401,
        ..LoadReport::default()
    };
    r.report_load(1, same);
    let fresh: Vec<u32> = (1000..1401).collect();
    assert_eq!(r.route(&idx, &req(2, &fresh, None)).instance, 1);
    r.finished(2);
    r.report_load(1, same);
    r.report_load(0, same);
    let other: Vec<u32> = (2000..2401).collect();
    assert_eq!(r.route(&idx, &req(3, &other, None)).instance, 0);
}
