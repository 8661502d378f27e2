//! The main job through the real `hicache` controller on the sim device (tiny parameters):
//! the report is consistent (hits + recomputed = prompt tokens, bytes = pages × page bytes,
//! the cache's counts equal the engine's) and every tier adds hits.

mod common;

use common::tiny;
use hicache_bench::cmd::multiturn;
use hicache_sim::adapter::HiCacheFactory;

#[test]
fn main_job_through_hicache_is_consistent_and_every_tier_helps() {
    let dir = tempfile::tempdir().unwrap();
    let mut out = Vec::new();
    let report =
        multiturn::run(&tiny(&["--compare"], dir.path()), &mut out, &HiCacheFactory).unwrap();
    assert!(report.check().is_empty(), "{:?}", report.check());
    for s in report.all() {
        assert_eq!(s.requests, 24);
        assert_eq!(s.hits.total() + s.computed_tokens, s.prompt_tokens);
        for (_, t) in s.transfers() {
            assert_eq!(t.bytes, t.pages * s.cache.page_bytes);
        }
    }
    let [l1, l2, l3] = [&report.runs[0], &report.runs[1], &report.runs[2]];
    assert!(
        l1.hits.total() < l2.hits.total() && l2.hits.total() < l3.hits.total(),
        "{:?}",
        [l1.hits, l2.hits, l3.hits]
    );
    assert!(report.baseline.ttft.p50 > l1.ttft.p50);
    // The other two L3 modes: buffer_only serves L1 misses from L3; exclusive writes L3 only
    // from what L2 cannot keep, so less than at every L2 admission.
    let [buffer, exclusive] = [&report.runs[3], &report.runs[4]];
    assert_eq!(buffer.label, "L1+L3 buffer_only");
    assert_eq!(exclusive.label, "L1+L2+L3 exclusive");
    assert!(buffer.hits.l3 > 0, "{:?}", buffer.hits);
    let to_l3 = |s: &hicache_bench::report::Summary| s.transfers()[2].1.bytes;
    assert!(to_l3(l3) > 0);
    assert!(
        to_l3(exclusive) < to_l3(l3),
        "{} {}",
        to_l3(exclusive),
        to_l3(l3)
    );
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("L1+L2+L3"), "{text}");
    assert!(text.contains("L1+L3 buffer_only"), "{text}");
    assert!(dir.path().join("report.json").is_file());
}

/// The report as JSON without what depends on this machine (wall times, and with them GB/s)
/// or says what carried bytes.
fn figures(report: &hicache_bench::report::Report) -> serde_json::Value {
    fn strip(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(m) => {
                for k in [
                    "wall_seconds",
                    "seconds",
                    "payload",
                    "free_copy_payload",
                    "timing",
                ] {
                    m.remove(k);
                }
                m.values_mut().for_each(strip);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let mut v = serde_json::to_value(report).unwrap();
    strip(&mut v);
    v
}

/// The runs whose figures do not depend on bytes (L1 only, the copies-free reruns, the hybrid
/// models) run without payload, say so, and give exactly the figures of the same job with
/// bytes everywhere (`--all-bytes`): hits, TTFT, bytes and pages moved, evictions.
#[test]
fn runs_without_payload_give_the_figures_of_runs_with_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut out = Vec::new();
        let args = tiny(&[&["--compare"], extra].concat(), dir.path());
        let report = multiturn::run(&args, &mut out, &HiCacheFactory).unwrap();
        (report, String::from_utf8(out).unwrap())
    };
    let (spare, text) = run(&[]);
    let (bytes, bytes_text) = run(&["--all-bytes"]);
    let [l1, l2, l3] = [&spare.runs[0], &spare.runs[1], &spare.runs[2]];
    assert!(l1.cache.payload.counted_only, "L1 prints no bytes");
    for s in &spare.runs[1..] {
        assert!(!s.cache.payload.counted_only, "{} prints GB/s", s.label);
    }
    assert!(l2.free_copy_payload.unwrap().counted_only);
    let l3_free = l3.free_copy_payload.unwrap();
    assert!(l3_free.counted_only && l3_free.l3_presence_only);
    for h in &spare.hybrid {
        assert_eq!(h.runs.len(), 3, "the hybrid ladder");
        let l3 = h.runs[2].cache.payload;
        assert!(l3.counted_only && l3.l3_presence_only, "{}", h.model.name);
        for s in &h.runs {
            assert!(s.cache.payload.counted_only, "{} {}", h.model.name, s.label);
        }
        for s in &h.runs[1..] {
            let free = s.free_copy_payload.unwrap_or_else(|| panic!("{}", s.label));
            assert!(free.counted_only, "{} {}", h.model.name, s.label);
        }
    }
    for r in bytes
        .all()
        .chain(bytes.hybrid.iter().flat_map(|h| h.runs.iter()))
    {
        assert!(!r.cache.payload.counted_only, "{}", r.label);
    }
    let line = text
        .lines()
        .find(|l| l.starts_with("without payload"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains("L1,") && line.contains("L1+L2+L3 copies free"),
        "{line}"
    );
    assert_eq!(text.matches("without payload").count(), 2, "{text}");
    assert!(!bytes_text.contains("without payload"), "{bytes_text}");
    assert_eq!(figures(&spare), figures(&bytes));
}

#[test]
fn main_job_through_hicache_with_the_memory_backend() {
    let dir = tempfile::tempdir().unwrap();
    let report = multiturn::run(
        &tiny(
            &[
                "--storage-backend",
                "memory",
                "--prefetch-policy",
                "timeout",
            ],
            dir.path(),
        ),
        &mut Vec::new(),
        &HiCacheFactory,
    )
    .unwrap();
    assert!(report.check().is_empty(), "{:?}", report.check());
}

#[test]
fn observe_flags_reach_the_cache_config_and_bad_ones_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let kv = r#"{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "topic": "kv"}"#;
    let args = tiny(
        &["--metrics-addr", "127.0.0.1:0", "--kv-events", kv],
        dir.path(),
    );
    let plan = hicache_sim::plan::plan(&args).unwrap();
    let cfg = hicache_sim::adapter::config_for(&plan.setup).unwrap();
    assert_eq!(cfg.metrics_addr.as_deref(), Some("127.0.0.1:0"));
    assert_eq!(cfg.kv_events_config.as_deref(), Some(kv));
    // A run with both endpoints serves them while it runs and completes.
    let mut out = Vec::new();
    let report = multiturn::run(&args, &mut out, &HiCacheFactory).unwrap();
    assert!(report.check().is_empty(), "{:?}", report.check());
    // An endpoint that cannot work fails before the first request, naming the setting.
    let bad = tiny(&["--kv-events", r#"{"publisher": "nats"}"#], dir.path());
    let e = multiturn::run(&bad, Vec::new(), &HiCacheFactory).unwrap_err();
    assert_eq!(e.exit_code(), 2, "{e}");
    assert!(e.to_string().contains("nats"), "{e}");
}

/// Copy time is charged: with a slow L3 link the hits differ from the same run with copies
/// free (backups pin host pages and hold the link longer), the links carry every copied byte,
/// a slow D2H link holds device pages so that admissions are refused until the clock reaches
/// the copies' completion, and runs with charged copies repeat exactly.
#[test]
fn copy_time_is_charged_on_the_simulated_links() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["--tiers", "l1+l2+l3", "--storage-backend", "memory"];
        args.extend_from_slice(extra);
        multiturn::run(&tiny(&args, dir.path()), &mut Vec::new(), &HiCacheFactory).unwrap()
    };
    let slow = ["--l3-gbps", "0.05"];
    let charged = run(&slow);
    let free = run(&[&slow[..], &["--copy-time", "free"]].concat());
    let (c, f) = (&charged.runs[0], &free.runs[0]);
    assert!(charged.check().is_empty(), "{:?}", charged.check());
    assert_ne!(c.hits, f.hits, "copy time changed nothing");
    assert!(
        c.hits.l3 < f.hits.l3,
        "charged {:?} free {:?}",
        c.hits,
        f.hits
    );
    // The links carried every page copied: D2H batches, L3 prefetches and backups.
    // (Writes launched by the shutdown's drain, after the last request, are not timed.)
    assert!(c.links.d2h.bytes > 0 && c.links.d2h.bytes <= c.cache.metrics.d2h.bytes);
    assert_eq!(c.links.l3_read_bytes, c.cache.metrics.l3_to_l2.bytes);
    // Backups count pages already in L3 as stored; the link carries only what was written.
    let written = c.links.l3.bytes - c.links.l3_read_bytes;
    assert!(written > 0 && written <= c.cache.metrics.l2_to_l3.bytes);
    assert_eq!(f.links.d2h.bytes, 0);
    assert_eq!(f.cache.refused_during_copies, 0);
    let again = run(&slow);
    assert_eq!(again.runs[0].ttft_sorted, c.ttft_sorted);
    assert_eq!(again.runs[0].hits, c.hits);
    let held = run(&["--d2h-gbps", "0.05"]);
    assert!(held.check().is_empty(), "{:?}", held.check());
    assert!(held.runs[0].cache.refused_during_copies > 0);
    assert!(held.runs[0].ttft.mean > c.ttft.mean);
}

/// The main job's compact fleet table: every policy ran on the same workload (accounting
/// holds), three rows are shown — round-robin, the best anchor by mean TTFT, `hicache` —
/// and the report directory holds `fleet.json` and the TTFT plot.
#[test]
fn main_job_fleet_table_shows_round_robin_the_best_anchor_and_hicache() {
    let dir = tempfile::tempdir().unwrap();
    let args = tiny(&[], dir.path());
    let mut out = Vec::new();
    let report = hicache_bench::cmd::fleet::main_job_table(&args, &mut out).unwrap();
    assert_eq!(report.policies.len(), 5);
    let requests: usize = 6 * 4;
    for s in &report.policies {
        assert_eq!(s.instances, hicache_bench::cmd::fleet::MAIN_JOB_INSTANCES);
        assert_eq!(s.requests, requests, "{}", s.policy);
        assert_eq!(s.requests_per_instance.iter().sum::<usize>(), requests);
        assert_eq!(
            s.hit_tokens_l1 + s.hit_tokens_l2 + s.hit_tokens_l3 + s.recomputed_tokens,
            s.prompt_tokens,
            "{}",
            s.policy
        );
        // The no-queue floor: every request's compute alone, at most its TTFT.
        assert!(
            s.ttft_floor_mean_ms > 0.0 && s.ttft_floor_mean_ms <= s.ttft_mean_ms,
            "{}: floor {} ms, mean {} ms",
            s.policy,
            s.ttft_floor_mean_ms,
            s.ttft_mean_ms
        );
    }
    let best = report
        .policies
        .iter()
        .filter(|s| !["round-robin", "hicache"].contains(&s.policy.as_str()))
        .min_by(|a, b| a.ttft_mean_ms.total_cmp(&b.ttft_mean_ms))
        .unwrap();
    let text = String::from_utf8(out).unwrap();
    let rows: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| report.policies.iter().any(|s| s.policy == *w))
        .collect();
    assert_eq!(
        rows,
        ["round-robin", best.policy.as_str(), "hicache"],
        "{text}"
    );
    assert!(dir.path().join("fleet.json").is_file());
    assert!(dir.path().join("fleet_ttft.svg").is_file());
}
