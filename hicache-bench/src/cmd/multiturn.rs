//! `hicache-bench multiturn`: the main job. The workload planned by [`hicache_sim::plan`] (a
//! multi-turn chat workload like SGLang's `bench_multiturn.py`, a long-context variant or a
//! replayed trace) runs through the simulated engine ([`hicache_sim::engine`]) against the
//! cache under test in each configuration (L1 only, +L2, +L3) and against the same engine
//! without prefix caching; then a side-by-side table, `report.json` and plots
//! ([`crate::report`]).
//!
//! The command validates everything before it runs (bad input is exit code 2), builds one fresh
//! cache per configuration through a [`CacheFactory`], and fails with exit code 1 if the
//! report's consistency checks do not hold.

use std::io::{IsTerminal, Write};

use hicache_sim::engine::{EngineConfig, RunResult};
use hicache_sim::links::CopyTime;
use hicache_sim::nocache::NoCache;
use hicache_sim::plan::{Plan, counterfactual_for, plan, scratch_l3};
use hicache_sim::setup::{CacheFactory, Tiers};
use hicache_sim::{HybridFactory, HybridModel};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;

use crate::error::{BenchError, Result};
use crate::report::{self, Hits, HybridColumn, Percentiles, Report, Summary};

pub use hicache_sim::plan::{MultiturnArgs, TiersArg};

fn progress_bar(total: u64, hidden: bool) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{msg:>10} [{bar:40.cyan/blue}] {pos}/{len} requests, {elapsed}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Tiers of the hybrid models' columns.
pub const HYBRID_TIERS: Tiers = Tiers::L1_L2_L3;

/// Device Mamba state slots of the Mamba hybrid (its host pool holds twice as many).
pub const MAMBA_SLOTS: usize = 16;

/// The hybrid models run beside the dense one: Qwen3.5-9B on one rank (as the dense
/// Llama-3-8B), Gemma 3 12B on one of two tensor-parallel ranks (on one rank its 40
/// sliding-window layers alone hold 320 KiB per token).
pub fn hybrid_factories() -> Result<Vec<HybridFactory>> {
    let gemma = HybridModel::gemma3_12b()
        .with_tp(2)
        .map_err(BenchError::usage)?;
    Ok(vec![
        HybridFactory::new(HybridModel::qwen35_9b(), MAMBA_SLOTS),
        HybridFactory::new(gemma, 0),
    ])
}

/// One hybrid model on the plan's workload: its no-cache baseline and its run with
/// [`HYBRID_TIERS`] on a fresh cache (and scratch L3).
fn run_hybrid(plan: &Plan, factory: &HybridFactory, bar: &ProgressBar) -> Result<HybridColumn> {
    let hp = plan.for_hybrid(&factory.model);
    bar.set_message(factory.model.name.clone());
    let mut none = NoCache::new(
        hp.setup.kv_shape.page_size as usize,
        hp.setup.device_pages,
        hp.engine.page_bytes,
    );
    let baseline = run_through(&hp, &mut none, bar, &hp.engine)?;
    let mut setup = hp.setup.clone();
    setup.tiers = HYBRID_TIERS;
    let (scratch, setup) = scratch_l3(&setup)?;
    let result = {
        let mut cache = factory.build(&setup)?;
        run_through(&hp, cache.as_mut(), bar, &hp.engine)?
    };
    drop(scratch);
    Ok(HybridColumn {
        model: factory.model.clone(),
        compute: hp.compute.clone(),
        page_bytes: hp.engine.page_bytes,
        baseline: Summary::new("no cache", &baseline),
        run: Summary::new(HYBRID_TIERS.label(), &result),
    })
}

/// How many runs `plan` makes: the no-cache baseline, every configuration, and with
/// `counterfactual` a copies-free run of each configuration with copies.
fn run_count(plan: &Plan, counterfactual: bool) -> u64 {
    let free_runs = if counterfactual {
        plan.configurations
            .iter()
            .filter(|t| counterfactual_for(t))
            .count()
    } else {
        0
    };
    (1 + plan.configurations.len() + free_runs) as u64
}

/// Runs the workload once through `cache`, advancing `bar` by the requests it finishes.
fn run_through(
    plan: &Plan,
    cache: &mut dyn hicache_sim::CacheUnderTest,
    bar: &ProgressBar,
    engine_cfg: &EngineConfig,
) -> Result<RunResult> {
    let mut reported = 0;
    let mut progress = |done: usize| {
        bar.inc(done.saturating_sub(reported) as u64);
        reported = reported.max(done);
    };
    Ok(plan.run_with(cache, &mut progress, engine_cfg)?)
}

/// Hits and TTFT of a configuration with copies free.
type FreeCopy = (Hits, Percentiles);

/// The copies-free counterfactual of `tiers` on a fresh cache (and scratch L3).
fn run_free(
    plan: &Plan,
    tiers: Tiers,
    factory: &dyn CacheFactory,
    bar: &ProgressBar,
) -> Result<FreeCopy> {
    let mut setup = plan.setup.clone();
    setup.tiers = tiers;
    let free_cfg = EngineConfig {
        copy_time: CopyTime::Free,
        ..plan.engine.clone()
    };
    let (_scratch, setup) = scratch_l3(&setup)?;
    let mut cache = factory.build(&setup)?;
    let r = run_through(plan, cache.as_mut(), bar, &free_cfg)?;
    let s = Summary::new(tiers.label(), &r);
    Ok((s.hits, s.ttft))
}

/// The copies-free counterfactuals of every configuration that has one (with `counterfactual`),
/// in the order of the configurations. With copies free the simulation never waits on this
/// machine (every copy counts as complete at once) and these runs report no bytes per second,
/// so their hits and TTFT are the same whatever runs beside them: they run on threads side by
/// side, before the measured runs, which then run alone. Not when the cache publishes metrics
/// or KV events (two caches would bind the same endpoint).
fn run_counterfactuals(
    plan: &Plan,
    factory: &dyn CacheFactory,
    bar: &ProgressBar,
    counterfactual: bool,
) -> Result<Vec<Option<FreeCopy>>> {
    let wanted: Vec<bool> = plan
        .configurations
        .iter()
        .map(|t| counterfactual && counterfactual_for(t))
        .collect();
    let observe = &plan.setup.observe;
    if observe.metrics_addr.is_some() || observe.kv_events.is_some() {
        return plan
            .configurations
            .iter()
            .zip(&wanted)
            .map(|(&t, &w)| w.then(|| run_free(plan, t, factory, bar)).transpose())
            .collect();
    }
    bar.set_message("copies free");
    std::thread::scope(|scope| {
        let runs: Vec<_> = plan
            .configurations
            .iter()
            .zip(&wanted)
            .map(|(&t, &w)| w.then(|| scope.spawn(move || run_free(plan, t, factory, bar))))
            .collect();
        runs.into_iter()
            .map(|h| {
                h.map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(BenchError::check_failed("a copies-free run panicked"))
                    })
                })
                .transpose()
            })
            .collect()
    })
}

/// The baseline: the same engine without prefix caching.
fn run_baseline(plan: &Plan, bar: &ProgressBar) -> Result<Summary> {
    bar.set_message("no cache");
    let mut none = NoCache::new(
        plan.setup.kv_shape.page_size as usize,
        plan.setup.device_pages,
        plan.engine.page_bytes,
    );
    let result = run_through(plan, &mut none, bar, &plan.engine)?;
    Ok(Summary::new("no cache", &result))
}

/// One configuration on a fresh cache from `factory` (and a fresh scratch L3), alone; the
/// summary carries the hits and TTFT of its copies-free counterfactual, if it has one.
fn run_configuration(
    plan: &Plan,
    tiers: Tiers,
    factory: &dyn CacheFactory,
    bar: &ProgressBar,
    free_hits: Option<FreeCopy>,
) -> Result<Summary> {
    bar.set_message(tiers.label());
    let mut setup = plan.setup.clone();
    setup.tiers = tiers;
    let (scratch, setup) = scratch_l3(&setup)?;
    let result = {
        let mut cache = factory.build(&setup)?;
        run_through(plan, cache.as_mut(), bar, &plan.engine)?
    };
    drop(scratch);
    let mut summary = Summary::new(tiers.label(), &result);
    summary.free_copy_hits = free_hits.map(|f| f.0);
    summary.free_copy_ttft = free_hits.map(|f| f.1);
    Ok(summary)
}

/// The report of the plan's runs: the setup and workload as recorded, the baseline, every
/// configuration and the hybrid models' columns.
fn report_of(
    plan: &Plan,
    baseline: Summary,
    runs: Vec<Summary>,
    hybrid: Vec<HybridColumn>,
) -> Result<Report> {
    let usage = |what: &str, e: serde_json::Error| {
        BenchError::usage(format!("cannot record the {what}: {e}"))
    };
    let mut setup_json = serde_json::to_value(&plan.setup).map_err(|e| usage("setup", e))?;
    if let Value::Object(m) = &mut setup_json {
        m.remove("tiers");
        m.remove("scratch_dir");
    }
    Ok(Report {
        title: plan.title(),
        workload: serde_json::to_value(&plan.workload).map_err(|e| usage("workload", e))?,
        setup: setup_json,
        model: plan.model.clone(),
        compute: plan.compute.clone(),
        engine: plan.engine.clone(),
        page_size: plan.setup.kv_shape.page_size as usize,
        baseline,
        runs,
        hybrid,
    })
}

/// Prints the table and where the report went (or the JSON records with `json`), then any L3
/// error warning (on stderr with `json`, stdout being records only).
fn print_report(
    report: &Report,
    paths: &[std::path::PathBuf],
    json: bool,
    out: &mut dyn Write,
) -> Result<()> {
    let mut w = |s: &str| writeln!(out, "{s}").map_err(BenchError::io("<stdout>"));
    if json {
        for r in report.records() {
            w(&r.to_json_line())?;
        }
    } else {
        w(report.table().trim_end())?;
        let listed: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        w(&format!("report: {}", listed.join(", ")))?;
    }
    if let Some(warning) = report.l3_error_warning() {
        if json {
            eprintln!("hicache-bench: {warning}");
        } else {
            w(&warning)?;
        }
    }
    Ok(())
}

/// Runs the main job: validates, runs the no-cache baseline and every configuration through
/// caches built by `factory`, writes the report directory, prints the table (or JSON records
/// with `--json`) to `out`, and returns the report. Exit code 1 when the report is
/// inconsistent.
pub fn run(
    args: &MultiturnArgs,
    mut out: impl Write,
    factory: &dyn CacheFactory,
) -> Result<Report> {
    let plan = plan(args)?;
    report::prepare_dir(&plan.report_dir)?;
    let hidden = args.json || args.quiet || !std::io::stdout().is_terminal();
    // With --compare and copy time charged, every configuration with copies runs a second
    // time with copies free: the hits copy time cost, per tier.
    let counterfactual = args.compare && plan.engine.copy_time == CopyTime::Charged;
    let hybrids = if args.compare && !args.no_hybrid {
        hybrid_factories()?
    } else {
        Vec::new()
    };
    let runs_total = run_count(&plan, counterfactual) + 2 * hybrids.len() as u64;
    let bar = progress_bar(plan.workload.requests as u64 * runs_total, hidden);
    let baseline = run_baseline(&plan, &bar)?;
    let free = run_counterfactuals(&plan, factory, &bar, counterfactual)?;
    let runs = plan
        .configurations
        .iter()
        .zip(free)
        .map(|(&tiers, free)| run_configuration(&plan, tiers, factory, &bar, free))
        .collect::<Result<Vec<_>>>()?;
    let hybrid = hybrids
        .iter()
        .map(|f| run_hybrid(&plan, f, &bar))
        .collect::<Result<Vec<_>>>()?;
    bar.finish_and_clear();
    let report = report_of(&plan, baseline, runs, hybrid)?;
    let paths = report.write_to(&plan.report_dir)?;
    print_report(&report, &paths, args.json, &mut out)?;
    let bad = report.check();
    if !bad.is_empty() {
        return Err(BenchError::check_failed(format!(
            "the report is inconsistent:\n  {}",
            bad.join("\n  ")
        )));
    }
    Ok(report)
}
