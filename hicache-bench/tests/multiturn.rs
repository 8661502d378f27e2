//! The `multiturn` command end to end with tiny parameters, against the `ExactPrefix` TEST
//! DOUBLE (tests/common): report consistency, the report directory, JSON output,
//! determinism, and bad input (exit code 2, no panic).

#[path = "../../hicache-sim/tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::sync::Mutex;

use common::{ExactPrefix, ExactPrefixConfig};
use hicache_bench::BenchError;
use hicache_bench::cmd::multiturn::{self, MultiturnArgs};
use hicache_sim::CacheUnderTest;
use hicache_sim::Result;
use hicache_sim::setup::{CacheSetup, HostSize};

fn build(setup: &CacheSetup) -> Result<Box<dyn CacheUnderTest>> {
    let host_pages = match (setup.tiers.host, setup.host_size) {
        (false, _) => 0,
        (true, HostSize::Ratio(r)) => (setup.device_pages as f64 * r) as usize,
        (true, HostSize::Gigabytes(g)) => (g * 1e9 / setup.kv_shape.page_bytes() as f64) as usize,
    };
    if setup.tiers.storage {
        let dir = setup.storage.extra_config["dir"].as_str().unwrap();
        assert!(Path::new(dir).is_dir(), "the command made the L3 directory");
        assert_eq!(setup.scratch_dir.as_deref(), Some(Path::new(dir)));
    }
    Ok(Box::new(ExactPrefix::new(ExactPrefixConfig {
        page_size: setup.kv_shape.page_size as usize,
        device_pages: setup.device_pages,
        host_pages,
        storage: setup.tiers.storage,
        page_bytes: setup.kv_shape.page_bytes() as u64,
    })))
}

/// Tiny: 6 clients × 4 rounds of ≤ 704 tokens, page 16, L1 of 60 pages, L2 2× L1, 2 requests in
/// flight; `extra`
/// flags replace the base ones they name.
fn tiny(extra: &[&str], dir: &Path) -> MultiturnArgs {
    let d = dir.display().to_string();
    let base = [
        ("--clients", "6"),
        ("--rounds", "4"),
        ("--system-tokens", "128"),
        ("--user-tokens", "96"),
        ("--answer-tokens", "48"),
        ("--page-size", "16"),
        ("--device-pages", "60"),
        ("--max-parallel", "2"),
        ("--report-dir", &d),
    ];
    let mut args = vec!["--quiet"];
    for (k, v) in base {
        if !extra.contains(&k) {
            args.extend([k, v]);
        }
    }
    args.extend_from_slice(extra);
    MultiturnArgs::try_parse(&args).unwrap()
}

#[test]
fn only_hybrid_runs_the_hybrid_ladders_and_the_dense_baseline_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut out = Vec::new();
    let args = tiny(&["--compare", "--only-hybrid"], dir.path());
    let report = multiturn::run(&args, &mut out, &build).unwrap();
    assert!(report.check().is_empty(), "{:?}", report.check());
    assert!(report.runs.is_empty());
    assert_eq!(report.baseline.label, "no cache");
    assert_eq!(report.hybrid.len(), 2);
    for h in &report.hybrid {
        let labels: Vec<&str> = h.runs.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, ["L1", "L1+L2", "L1+L2+L3"]);
        for s in &h.runs {
            assert_eq!(s.requests, 24);
            assert_eq!(s.hits.total() + s.computed_tokens, s.prompt_tokens);
        }
    }
    // The flag goes with --compare only, and not with --no-hybrid.
    assert!(MultiturnArgs::try_parse(&["multiturn", "--only-hybrid"]).is_err());
    assert!(
        MultiturnArgs::try_parse(&["multiturn", "--compare", "--only-hybrid", "--no-hybrid"])
            .is_err()
    );
}

#[test]
fn compare_runs_every_configuration_and_the_report_is_consistent() {
    let dir = tempfile::tempdir().unwrap();
    let mut out = Vec::new();
    let report = multiturn::run(&tiny(&["--compare"], dir.path()), &mut out, &build).unwrap();
    assert!(report.check().is_empty(), "{:?}", report.check());
    let labels: Vec<&str> = report.all().map(|s| s.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "no cache",
            "L1",
            "L1+L2",
            "L1+L2+L3",
            "L1+L3 buffer_only",
            "L1+L2+L3 exclusive"
        ]
    );
    for s in report.all() {
        assert_eq!(s.requests, 24);
        assert_eq!(s.hits.total() + s.computed_tokens, s.prompt_tokens);
        for (_, t) in s.transfers() {
            assert_eq!(t.bytes, t.pages * s.cache.page_bytes);
        }
    }
    let [l1, l2, l3] = [&report.runs[0], &report.runs[1], &report.runs[2]];
    let h = [l1.hits, l2.hits, l3.hits];
    assert!(
        l1.hits.total() < l2.hits.total() && l2.hits.total() < l3.hits.total(),
        "{h:?}"
    );
    assert!(report.baseline.ttft.p50 > l1.ttft.p50);
    assert!(l1.ttft.p50 > l3.ttft.p50);
    assert_eq!(l3.rounds.len(), 4);
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.contains("L1+L2+L3") && text.contains("TTFT p99"),
        "{text}"
    );
    assert!(text.contains("report.json"), "{text}");
    for f in [
        "report.json",
        "hit_ratio_per_round.svg",
        "ttft_cdf.svg",
        "bandwidth.svg",
    ] {
        assert!(dir.path().join(f).is_file(), "{f}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap())
            .unwrap();
    assert_eq!(json["runs"].as_array().unwrap().len(), 5);
    assert_eq!(json["workload"]["requests"], 24);
    assert_eq!(json["setup"]["write_policy"], "write_through");
}

#[test]
fn json_mode_prints_records_only() {
    let dir = tempfile::tempdir().unwrap();
    let mut out = Vec::new();
    multiturn::run(
        &tiny(&["--json", "--tiers", "l1+l2"], dir.path()),
        &mut out,
        &build,
    )
    .unwrap();
    let text = String::from_utf8(out).unwrap();
    let cases: Vec<String> = text
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["bench"], "multiturn");
            v["case"].as_str().unwrap().to_string()
        })
        .collect();
    assert!(cases.contains(&"l1+l2/ttft_p50".to_string()), "{cases:?}");
    assert!(cases.contains(&"no_cache/ttft_p50".to_string()));
    assert!(!cases.iter().any(|c| c.starts_with("l1+l2+l3")));
}

#[test]
fn runs_repeat_with_a_seed_and_change_without() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let r = multiturn::run(&tiny(extra, dir.path()), &mut Vec::new(), &build).unwrap();
        (r.runs[0].ttft_sorted.clone(), r.runs[0].hits)
    };
    assert_eq!(run(&[]), run(&[]));
    assert_ne!(run(&[]).0, run(&["--seed", "2"]).0);
}

#[test]
fn long_context_and_trace_workloads_run() {
    let dir = tempfile::tempdir().unwrap();
    let args = tiny(
        &[
            "--long-context",
            "--documents",
            "2",
            "--document-tokens",
            "400",
            "--questions",
            "3",
            "--question-tokens",
            "20",
        ],
        dir.path(),
    );
    let r = multiturn::run(&args, &mut Vec::new(), &build).unwrap();
    assert_eq!(r.runs[0].requests, 6);
    assert!(r.runs[0].hits.total() > 0, "questions share documents");
    let trace = dir.path().join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"id\": \"a\", \"tokens\": [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18]}\n\
         {\"id\": \"b\", \"tokens\": [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19]}\n",
    )
    .unwrap();
    let t = trace.display().to_string();
    let r = multiturn::run(&tiny(&["--trace", &t], dir.path()), &mut Vec::new(), &build).unwrap();
    assert_eq!(r.runs[0].requests, 2);
    assert_eq!(r.runs[0].prompt_tokens, 37);
}

fn bad(extra: &[&str]) -> BenchError {
    let dir = tempfile::tempdir().unwrap();
    let args = tiny(extra, dir.path());
    multiturn::run(&args, &mut Vec::new(), &build).unwrap_err()
}

#[test]
fn bad_input_is_exit_code_2_with_a_clear_message() {
    for (extra, needle) in [
        (&["--clients", "0"][..], "--clients must be at least 1"),
        (&["--rounds", "0"][..], "--rounds must be at least 1"),
        (
            &["--page-size", "4096"][..],
            "larger than the longest request",
        ),
        (&["--page-size", "0"][..], "--page-size must be between"),
        (&["--device-pages", "3"][..], "raise --device-pages"),
        (&["--request-rate", "0"][..], "--request-rate must be > 0"),
        (&["--max-parallel", "0"][..], "--max-parallel"),
        (&["--hicache-ratio=-1"][..], "--hicache-ratio"),
        (&["--h2d-gbps", "0"][..], "--h2d-gbps"),
        (&["--max-prefill-tokens", "0"][..], "--max-prefill-tokens"),
        (&["--extra-config", "{not json"][..], "not JSON"),
        (&["--extra-config", "[1]"][..], "JSON object"),
        (
            &["--extra-config", r#"{"prefetch_threshold": "x"}"#][..],
            "prefetch_threshold",
        ),
        (
            &["--extra-config", "@/nonexistent/extra.json"][..],
            "/nonexistent/extra.json",
        ),
        (
            &["--trace", "/nonexistent/trace.jsonl"][..],
            "/nonexistent/trace.jsonl",
        ),
        (&["--long-context", "--documents", "0"][..], "--documents"),
        (&["--system-tokens", "0", "--user-tokens", "0"][..], "empty"),
        (&["--model-layers", "0"][..], "--model-layers"),
        (&["--model-params-b", "0"][..], "--model-params-b"),
    ] {
        let e = bad(extra);
        assert_eq!(e.exit_code(), 2, "{extra:?}: {e}");
        assert!(e.to_string().contains(needle), "{extra:?}: {e}");
    }
}

#[test]
fn an_unwritable_report_directory_fails_before_running() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    let built = Mutex::new(0);
    let counting = |s: &CacheSetup| -> Result<Box<dyn CacheUnderTest>> {
        *built.lock().unwrap() += 1;
        build(s)
    };
    let args = tiny(&[], &file.join("report"));
    let e = multiturn::run(&args, &mut Vec::new(), &counting).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    assert!(e.to_string().contains("plain-file"), "{e}");
    assert_eq!(*built.lock().unwrap(), 0, "nothing ran");
}

#[test]
fn unknown_flags_and_bad_values_are_clap_errors_with_exit_code_2() {
    for args in [
        &["--no-such-flag"][..],
        &["--clients", "many"][..],
        &["--write-policy", "sometimes"][..],
        &["--mem-layout", "diagonal"][..],
        &["--io-backend", "dma"][..],
        &["--eviction-policy", "random"][..],
        &["--tiers", "l2"][..],
        &["--device-pages", "5", "--device-gb", "1"][..],
        &["--long-context", "--trace", "x"][..],
    ] {
        let e = MultiturnArgs::try_parse(args).unwrap_err();
        assert_eq!(e.exit_code(), 2, "{args:?}");
    }
    let d = MultiturnArgs::defaults();
    assert_eq!((d.clients, d.rounds, d.page_size), (16, 5, 64));
    assert!(!d.compare);
    assert!(MultiturnArgs::main_job().compare);
}

#[test]
fn a_cache_that_breaks_accounting_fails_the_check() {
    // The double's stats are right; a wrapper that inflates H2D bytes must be caught.
    struct Liar(Box<dyn CacheUnderTest>);
    impl CacheUnderTest for Liar {
        fn page_size(&self) -> usize {
            self.0.page_size()
        }
        fn device_pages(&self) -> usize {
            self.0.device_pages()
        }
        fn arrive(&mut self, r: u64, t: &[u32]) -> hicache_sim::CacheResult<()> {
            self.0.arrive(r, t)
        }
        fn poll(&mut self) -> hicache_sim::CacheResult<()> {
            self.0.poll()
        }
        fn prefetch_status(
            &mut self,
            r: u64,
        ) -> hicache_sim::CacheResult<hicache_sim::PrefetchStatus> {
            self.0.prefetch_status(r)
        }
        fn admit(
            &mut self,
            r: u64,
            t: &[u32],
            n: usize,
        ) -> hicache_sim::CacheResult<Option<hicache_sim::Admission>> {
            self.0.admit(r, t, n)
        }
        fn start_loading(&mut self) -> hicache_sim::CacheResult<Option<usize>> {
            self.0.start_loading()
        }
        fn wait_layer(&mut self, i: usize, l: usize) -> hicache_sim::CacheResult<()> {
            self.0.wait_layer(i, l)
        }
        fn cache_finished(
            &mut self,
            r: u64,
            t: &[u32],
            s: &[hicache_sim::DeviceSlot],
        ) -> hicache_sim::CacheResult<()> {
            self.0.cache_finished(r, t, s)
        }
        fn shutdown(&mut self) -> hicache_sim::CacheResult<()> {
            self.0.shutdown()
        }
        fn stats(&self) -> hicache_sim::CacheStats {
            let mut s = self.0.stats();
            s.metrics.h2d.bytes += 1;
            s
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let liar =
        |s: &CacheSetup| -> Result<Box<dyn CacheUnderTest>> { Ok(Box::new(Liar(build(s)?))) };
    let e = multiturn::run(
        &tiny(&["--tiers", "l1+l2"], dir.path()),
        &mut Vec::new(),
        &liar,
    )
    .unwrap_err();
    assert_eq!(e.exit_code(), 1);
    assert!(e.to_string().contains("h2d"), "{e}");
    assert!(
        dir.path().join("report.json").is_file(),
        "the report is still written"
    );
}

#[test]
fn the_defaults_plan_within_the_default_device() {
    for args in [&[][..], &["--long-context"][..], &["--compare"][..]] {
        let p = hicache_sim::plan::plan(&MultiturnArgs::try_parse(args).unwrap()).unwrap();
        assert_eq!(p.setup.device_pages, 128, "{args:?}");
        assert!(p.workload.longest_request_tokens <= 128 * 64, "{args:?}");
    }
    let p = hicache_sim::plan::plan(&MultiturnArgs::defaults()).unwrap();
    assert_eq!(p.workload.requests, 80);
    assert_eq!(p.engine.page_bytes, 8 << 20);
    assert!(p.title().contains("16 clients × 5 rounds"), "{}", p.title());
    let p =
        hicache_sim::plan::plan(&MultiturnArgs::try_parse(&["--device-gb", "2"]).unwrap()).unwrap();
    assert_eq!(p.setup.device_pages, 238, "2e9 / 8 MiB");
}

#[test]
fn model_overrides_change_page_bytes_and_costs() {
    let base = hicache_sim::plan::plan(&MultiturnArgs::defaults()).unwrap();
    let args = MultiturnArgs::try_parse(&[
        "--model-layers",
        "80",
        "--model-q-heads",
        "64",
        "--model-params-b",
        "70.6",
        "--device-pages",
        "200",
    ])
    .unwrap();
    let p = hicache_sim::plan::plan(&args).unwrap();
    assert_eq!(
        p.engine.page_bytes,
        20 << 20,
        "80 layers × 8 KV heads × 128 × 2 B × 2 × 64"
    );
    assert_eq!(p.engine.layers, 80);
    assert!(
        p.model.name.starts_with("custom model (80 layers"),
        "{}",
        p.model.name
    );
    let ratio = p.compute.prefill_s_per_token / base.compute.prefill_s_per_token;
    assert!((ratio - 70.6 / 8.03).abs() < 1e-9);
    assert!(p.compute.attention_s_per_pair > base.compute.attention_s_per_pair * 4.9);
}
