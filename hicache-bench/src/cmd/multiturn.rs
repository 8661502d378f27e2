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
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;

use crate::error::{BenchError, Result};
use crate::report::{self, Report, Summary};

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

/// Runs the workload once through `cache`, advancing `bar`.
fn run_through(
    plan: &Plan,
    cache: &mut dyn hicache_sim::CacheUnderTest,
    bar: &ProgressBar,
    engine_cfg: &EngineConfig,
) -> Result<RunResult> {
    let start = bar.position();
    let mut progress = |done: usize| bar.set_position(start + done as u64);
    Ok(plan.run_with(cache, &mut progress, engine_cfg)?)
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

/// One configuration on a fresh cache from `factory` (and a fresh scratch L3); with
/// `counterfactual` first the same with copies free, whose hits and TTFT the summary carries.
fn run_configuration(
    plan: &Plan,
    tiers: Tiers,
    factory: &dyn CacheFactory,
    bar: &ProgressBar,
    counterfactual: bool,
) -> Result<Summary> {
    bar.set_message(tiers.label());
    let mut setup = plan.setup.clone();
    setup.tiers = tiers;
    let mut free_hits = None;
    if counterfactual && counterfactual_for(&tiers) {
        let free_cfg = EngineConfig {
            copy_time: CopyTime::Free,
            ..plan.engine.clone()
        };
        let (_scratch, setup) = scratch_l3(&setup)?;
        let mut cache = factory.build(&setup)?;
        let r = run_through(plan, cache.as_mut(), bar, &free_cfg)?;
        let s = Summary::new(tiers.label(), &r);
        free_hits = Some((s.hits, s.ttft));
    }
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

/// The report of the plan's runs: the setup and workload as recorded, the baseline and every
/// configuration.
fn report_of(plan: &Plan, baseline: Summary, runs: Vec<Summary>) -> Result<Report> {
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
    })
}

/// Prints the table and where the report went (or the JSON records with `json`), then any L3
/// error warning (on stderr with `json`, stdout being records only).
fn print_report(report: &Report, paths: &[std::path::PathBuf], json: bool, out: &mut dyn Write) -> Result<()> {
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
    let bar = progress_bar(
        plan.workload.requests as u64 * run_count(&plan, counterfactual),
        hidden,
    );
    let baseline = run_baseline(&plan, &bar)?;
    let runs = plan
        .configurations
        .iter()
        .map(|&tiers| run_configuration(&plan, tiers, factory, &bar, counterfactual))
        .collect::<Result<Vec<_>>>()?;
    bar.finish_and_clear();
    let report = report_of(&plan, baseline, runs)?;
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
