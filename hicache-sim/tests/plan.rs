//! The engine through its public API on the real `hicache` controller: a plan from the main
//! job's parameters, one run per tier set through [`HiCacheFactory`] (sim device, a scratch
//! file L3), no more hit tokens than prompt tokens, every tier adding hits, and the
//! same hits on a second run (the simulation does not depend on how fast this machine copies).

use hicache_sim::adapter::HiCacheFactory;
use hicache_sim::plan::{MultiturnArgs, Plan, plan, scratch_l3};
use hicache_sim::setup::{CacheFactory, Tiers};
use hicache_sim::{NoCache, RunResult};

fn tiny() -> Plan {
    let args = MultiturnArgs::try_parse(&[
        "--clients",
        "4",
        "--rounds",
        "3",
        "--system-tokens",
        "128",
        "--user-tokens",
        "64",
        "--answer-tokens",
        "32",
        "--page-size",
        "16",
        "--device-pages",
        "40",
        "--max-parallel",
        "2",
        "--compare",
    ])
    .unwrap();
    plan(&args).unwrap()
}

fn run(plan: &Plan, tiers: Tiers) -> RunResult {
    let mut setup = plan.setup.clone();
    setup.tiers = tiers;
    let (_scratch, setup) = scratch_l3(&setup).unwrap();
    let mut cache = HiCacheFactory.build(&setup).unwrap();
    plan.run_one(cache.as_mut(), &mut |_| {}).unwrap()
}

fn hits(r: &RunResult) -> [u64; 3] {
    [
        r.cache.metrics.hit_tokens_l1,
        r.cache.metrics.hit_tokens_l2,
        r.cache.metrics.hit_tokens_l3,
    ]
}

#[test]
fn every_tier_adds_hits_and_runs_repeat_exactly() {
    let plan = tiny();
    assert_eq!(plan.workload.requests, 12);
    assert_eq!(
        plan.configurations.len(),
        5,
        "--compare runs every tier set"
    );
    let mut none = NoCache::new(16, plan.setup.device_pages, plan.engine.page_bytes);
    let baseline = plan.run_one(&mut none, &mut |_| {}).unwrap();
    assert_eq!(baseline.requests.len(), 12);
    let prompt_tokens: u64 = baseline
        .requests
        .iter()
        .map(|r| r.prompt_tokens as u64)
        .sum();
    let runs: Vec<RunResult> = [Tiers::L1, Tiers::L1_L2, Tiers::L1_L2_L3]
        .into_iter()
        .map(|t| run(&plan, t))
        .collect();
    let totals: Vec<u64> = runs.iter().map(|r| hits(r).iter().sum()).collect();
    for r in &runs {
        assert_eq!(r.requests.len(), 12);
        let hit: u64 = hits(r).iter().sum();
        assert!(hit <= prompt_tokens, "{hit} hit tokens of {prompt_tokens}");
    }
    assert!(totals[0] > 0, "L1 alone hits the shared system prompt");
    assert!(
        totals[0] <= totals[1] && totals[1] <= totals[2],
        "{totals:?}"
    );
    assert_eq!(
        hits(&runs[0])[1..],
        [0, 0],
        "no L2 or L3 hits without those tiers"
    );
    let again = run(&plan, Tiers::L1_L2_L3);
    assert_eq!(
        hits(&again),
        hits(&runs[2]),
        "the same run gives the same hits"
    );
}
