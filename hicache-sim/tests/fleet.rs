//! The fleet simulation: accounting per policy, and cache-aware routing beating round-robin.

use hicache_index::router::Policy;
use hicache_sim::fleet::{self, FleetSetup, L3Mode, Source};
use hicache_sim::plan::{MultiturnArgs, plan};

fn tiny(rounds: &str) -> hicache_sim::Plan {
    let args = [
        "--clients",
        "3",
        "--rounds",
        rounds,
        "--system-tokens",
        "64",
        "--user-tokens",
        "32",
        "--answer-tokens",
        "4",
        "--page-size",
        "16",
        "--device-pages",
        "64",
        "--request-rate",
        "inf",
        "--max-parallel",
        "3",
        "--quiet",
    ];
    plan(&MultiturnArgs::try_parse(&args).unwrap()).unwrap()
}

#[test]
fn every_policy_accounts_for_every_token_and_request() {
    let p = tiny("3");
    for l3 in [L3Mode::None, L3Mode::Shared] {
        let setup = FleetSetup::from_plan(&p, 2, l3, true).unwrap();
        let mut recomputed = Vec::new();
        for policy in Policy::ALL {
            let run = fleet::run(
                &setup,
                &p.conversations,
                Source::closed(&p).unwrap(),
                policy,
                &mut |_, _| {},
            )
            .unwrap();
            assert_eq!(run.requests.len(), 9, "{policy}");
            for r in &run.requests {
                assert_eq!(r.hit() + r.computed, r.prompt_tokens, "{policy} {}", r.id);
                assert!(r.first_token >= r.arrival && r.finished >= r.first_token);
            }
            let s = run.summary(2);
            assert_eq!(s.requests_per_instance.iter().sum::<usize>(), 9, "{policy}");
            assert_eq!(
                s.hit_tokens_l1 + s.hit_tokens_l2 + s.hit_tokens_l3 + s.recomputed_tokens,
                s.prompt_tokens
            );
            assert_eq!(s.fallbacks, 0);
            assert_eq!(run.ingest.malformed, 0);
            if policy.uses_index() {
                assert_eq!(s.index_lookups, 9);
            }
            recomputed.push((policy, s.recomputed_tokens));
        }
        let get = |p: Policy| recomputed.iter().find(|x| x.0 == p).unwrap().1;
        assert!(
            get(Policy::Hicache) < get(Policy::RoundRobin),
            "{l3:?}: {recomputed:?}"
        );
    }
}

#[test]
fn timed_sources_release_requests_at_their_times() {
    let p = tiny("1");
    let setup = FleetSetup::from_plan(&p, 2, L3Mode::None, true).unwrap();
    let run = fleet::run(
        &setup,
        &p.conversations,
        Source::timed(&[0.5, 0.0, 0.25]),
        Policy::LeastLoad,
        &mut |_, _| {},
    )
    .unwrap();
    let arrivals: Vec<f64> = run.requests.iter().map(|r| r.arrival).collect();
    assert_eq!(arrivals, [0.0, 0.25, 0.5]);
    assert_eq!(
        run.summary(2).requests_per_instance.iter().sum::<usize>(),
        3
    );
}
