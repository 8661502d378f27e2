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
use std::time::{Duration, Instant};

use hicache_sim::engine::{EngineConfig, RunResult};
use hicache_sim::links::CopyTime;
use hicache_sim::nocache::NoCache;
use hicache_sim::plan::{Plan, counterfactual_for, plan, scratch_l3};
use hicache_sim::setup::{CacheFactory, Payload, PayloadUsed, Tiers};
use hicache_sim::{CacheUnderTest, HybridFactory, HybridModel};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;

use crate::error::{BenchError, Result};
use crate::report::{self, Hits, HybridColumn, Percentiles, Report, Span, Summary, TableSeconds};

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

/// The hybrid models' ladder of configurations: the dense table's inclusive ones.
pub const HYBRID_LADDER: [Tiers; 3] = [Tiers::L1, Tiers::L1_L2, Tiers::L1_L2_L3];

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

/// One hybrid model on the plan's workload: its no-cache baseline and its run of each
/// configuration of [`HYBRID_LADDER`] on a fresh cache (and scratch L3), with `payload` (the
/// table shows bytes moved as counted, no GB/s); with `counterfactual`, each configuration
/// that copies also runs with copies free.
fn run_hybrid(
    plan: &Plan,
    factory: &HybridFactory,
    bar: &ProgressBar,
    payload: Payload,
    counterfactual: bool,
    remover: &ScratchRemover,
) -> Result<HybridColumn> {
    let hp = plan.for_hybrid(&factory.model);
    bar.set_message(factory.model.name.clone());
    let mut none = NoCache::new(
        hp.setup.kv_shape.page_size as usize,
        hp.setup.device_pages,
        hp.engine.page_bytes,
    );
    let baseline = run_through(&hp, &mut none, bar, &hp.engine)?;
    let runs = HYBRID_LADDER
        .into_iter()
        .map(|tiers| {
            let run = run_configuration(&hp, tiers, factory, bar, None, payload, remover)?;
            let free = if counterfactual && counterfactual_for(&tiers) {
                Some(run_free(&hp, tiers, factory, bar, payload, remover)?)
            } else {
                None
            };
            Ok(with_free_copy(run, free))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(HybridColumn {
        model: factory.model.clone(),
        compute: hp.compute.clone(),
        page_bytes: hp.engine.page_bytes,
        baseline: Summary::new("no cache", &baseline),
        runs,
    })
}

/// Runs of one hybrid model: the baseline, the ladder, and with `counterfactual` the
/// copies-free reruns.
fn hybrid_run_count(counterfactual: bool) -> u64 {
    let free = if counterfactual {
        HYBRID_LADDER
            .iter()
            .filter(|t| counterfactual_for(t))
            .count()
    } else {
        0
    };
    (1 + HYBRID_LADDER.len() + free) as u64
}

/// `run` with the figures of its copies-free counterfactual, if it ran one.
fn with_free_copy(mut run: Summary, free: Option<FreeCopy>) -> Summary {
    run.free_copy_hits = free.map(|f| f.0);
    run.free_copy_ttft = free.map(|f| f.1);
    run.free_copy_payload = free.map(|f| f.2);
    run
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

/// Hits and TTFT of a configuration with copies free, and what its cache did with bytes.
type FreeCopy = (Hits, Percentiles, PayloadUsed);

/// The copies-free counterfactual of `tiers` on a fresh cache (and scratch L3), with
/// `payload`. With copies free the simulation never waits on this machine (every copy counts
/// as complete at once) and the run reports no bytes per second, so its hits and TTFT are the
/// same whatever runs beside it, and with or without bytes.
fn run_free(
    plan: &Plan,
    tiers: Tiers,
    factory: &dyn CacheFactory,
    bar: &ProgressBar,
    payload: Payload,
    remover: &ScratchRemover,
) -> Result<FreeCopy> {
    let mut setup = plan.setup.clone();
    setup.tiers = tiers;
    setup.payload = payload;
    let free_cfg = EngineConfig {
        copy_time: CopyTime::Free,
        ..plan.engine.clone()
    };
    let (scratch, setup) = scratch_l3(&setup)?;
    let r = {
        let mut cache = factory.build(&setup)?;
        run_through(plan, cache.as_mut(), bar, &free_cfg)?
    };
    remover.remove(scratch);
    let s = Summary::new(tiers.label(), &r);
    Ok((s.hits, s.ttft, s.cache.payload))
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

/// One configuration on a fresh cache from `factory` (and a fresh scratch L3), with
/// `payload`; with `hold` (`--kv-events-hold`, on the job's last run) the cache stays open
/// after the run until a subscriber has replayed its KV events or `hold` has passed.
fn run_configuration(
    plan: &Plan,
    tiers: Tiers,
    factory: &dyn CacheFactory,
    bar: &ProgressBar,
    hold: Option<Duration>,
    payload: Payload,
    remover: &ScratchRemover,
) -> Result<Summary> {
    bar.set_message(tiers.label());
    let mut setup = plan.setup.clone();
    setup.tiers = tiers;
    setup.payload = payload;
    let (scratch, setup) = scratch_l3(&setup)?;
    let result = {
        let mut cache = factory.build(&setup)?;
        let result = run_through(plan, cache.as_mut(), bar, &plan.engine)?;
        if let Some(limit) = hold {
            hold_kv_events(cache.as_ref(), limit);
        }
        result
    };
    remover.remove(scratch);
    Ok(Summary::new(tiers.label(), &result))
}

/// Removes the runs' scratch L3 directories off the job's critical path: a dense L3 column
/// leaves ~500 page files of 8 MiB, and deleting them took 2-3 s of the job's wall time per
/// column on the development machine (ext4 mounted with `discard`: each unlink discards its
/// blocks). Directories handed over are held until [`release`](Self::release) (called when
/// the measured run without an L3 starts: the L3 columns run first, see `measured_order`), then
/// removed on a thread of their own while that run copies only memory, so that no deletion
/// shares the disk with a run that measures it. Dropping the remover removes what is still
/// held and waits for every removal, so the job leaves no directory behind (an early return
/// too). Held directories take disk space: the default workload's three L3 columns ~12 GB.
#[derive(Default)]
struct ScratchRemover {
    state: std::sync::Mutex<Removals>,
}

/// What a [`ScratchRemover`] holds and runs.
#[derive(Default)]
struct Removals {
    held: Vec<tempfile::TempDir>,
    released: bool,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// Removes `dirs`, saying on stderr which could not be.
fn remove_dirs(dirs: Vec<tempfile::TempDir>) {
    for dir in dirs {
        let path = dir.path().to_path_buf();
        if let Err(e) = dir.close() {
            eprintln!("hicache-bench: cannot remove {}: {e}", path.display());
        }
    }
}

impl ScratchRemover {
    /// Hands `dir` (if any) over: held until [`release`](Self::release), removed in the
    /// background after it.
    fn remove(&self, dir: Option<tempfile::TempDir>) {
        let Some(dir) = dir else { return };
        match self.state.lock() {
            Ok(mut st) if !st.released => st.held.push(dir),
            Ok(mut st) => st.spawn(vec![dir]),
            Err(_) => drop(dir),
        }
    }

    /// Starts removing what is held (and, from now on, what is handed over) in the background.
    fn release(&self) {
        if let Ok(mut st) = self.state.lock() {
            st.released = true;
            let dirs = std::mem::take(&mut st.held);
            st.spawn(dirs);
        }
    }

    /// Removes what is still held and waits until every directory handed over is removed.
    fn finish(self) {
        drop(self);
    }
}

impl Removals {
    /// Removes `dirs` on a thread of its own (if none can start, the failed spawn drops them,
    /// and dropping a `TempDir` removes it, here).
    fn spawn(&mut self, dirs: Vec<tempfile::TempDir>) {
        if dirs.is_empty() {
            return;
        }
        if let Ok(t) = std::thread::Builder::new()
            .name("scratch-remover".into())
            .spawn(move || remove_dirs(dirs))
        {
            self.threads.push(t);
        }
    }
}

impl Drop for ScratchRemover {
    fn drop(&mut self) {
        let (held, threads) = match self.state.get_mut() {
            Ok(st) => (
                std::mem::take(&mut st.held),
                std::mem::take(&mut st.threads),
            ),
            Err(_) => return,
        };
        remove_dirs(held);
        for t in threads {
            let _ = t.join();
        }
    }
}

/// How often [`hold_kv_events`] looks at the publisher.
const HOLD_POLL: Duration = Duration::from_millis(20);

/// `--kv-events-hold`: keeps `cache` (shut down, its publisher and replay endpoint still
/// open) until a replay has sent a subscriber every batch the run published, or `limit` has
/// passed; says so on stderr. Returns at once for a cache without a publisher. Bounded: at
/// most `limit` plus one [`HOLD_POLL`].
fn hold_kv_events(cache: &dyn CacheUnderTest, limit: Duration) {
    let Some(state) = cache.kv_events() else {
        return;
    };
    eprintln!(
        "kv events: {} batches published at {} (replay: {}); open for up to {:.0} s, until a \
         subscriber has replayed them all",
        state.progress.published,
        state.endpoint,
        state.replay_endpoint.as_deref().unwrap_or("none"),
        limit.as_secs_f64(),
    );
    let start = Instant::now();
    loop {
        let Some(now) = cache.kv_events().map(|s| s.progress) else {
            return;
        };
        if now.replayed_everything() {
            eprintln!(
                "kv events: a subscriber replayed all {} batches after {:.1} s; closing",
                now.published,
                start.elapsed().as_secs_f64()
            );
            return;
        }
        if start.elapsed() >= limit {
            eprintln!(
                "kv events: no subscriber replayed all {} batches within {:.0} s (a replay \
                 reached {}); closing",
                now.published,
                limit.as_secs_f64(),
                now.replayed_through
            );
            return;
        }
        std::thread::sleep(HOLD_POLL.min(limit.saturating_sub(start.elapsed())));
    }
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
        timing: report::Timing::default(),
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

/// One run of the main job and the slot its result goes to.
enum Outcome {
    /// The dense model's no-cache baseline.
    Baseline(Summary),
    /// A configuration (its index in the plan).
    Configuration(usize, Summary),
    /// The copies-free counterfactual of a configuration (its index in the plan).
    Free(usize, FreeCopy),
    /// A hybrid model's columns (its index in the hybrid factories; boxed, being twice the
    /// size of the others).
    Hybrid(usize, Box<HybridColumn>),
}

/// A run not started yet: the table its columns go to (`dense`, `hybrid`) and the work.
struct Job<'a> {
    table: &'static str,
    work: Box<dyn FnOnce() -> Result<Outcome> + Send + 'a>,
}

impl<'a> Job<'a> {
    fn new(table: &'static str, work: impl FnOnce() -> Result<Outcome> + Send + 'a) -> Self {
        Self {
            table,
            work: Box::new(work),
        }
    }
}

/// A finished run: its table, result and when it ran (seconds since the job started).
type Done = (&'static str, Result<Outcome>, Span);

/// Runs `jobs` on `workers` threads, each taking the next job as it finishes one (so at most
/// `workers` caches exist at a time), and returns every result with when it ran. With one
/// worker the jobs run on this thread, in order.
fn run_jobs(workers: usize, jobs: Vec<Job<'_>>, clock: Instant) -> Vec<Done> {
    let timed = |job: Job<'_>| {
        let start = clock.elapsed().as_secs_f64();
        let result = (job.work)();
        (
            job.table,
            result,
            Span::new(start, clock.elapsed().as_secs_f64()),
        )
    };
    if workers <= 1 || jobs.len() <= 1 {
        return jobs.into_iter().map(timed).collect();
    }
    let queue = std::sync::Mutex::new(jobs.into_iter());
    let next = || queue.lock().ok().and_then(|mut q| q.next());
    std::thread::scope(|scope| {
        let threads: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    while let Some(job) = next() {
                        done.push(timed(job));
                    }
                    done
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|t| {
                t.join().unwrap_or_else(|_| {
                    let panicked = Err(BenchError::check_failed("a main-job run panicked"));
                    vec![("dense", panicked, Span::default())]
                })
            })
            .collect()
    })
}

/// Threads the runs whose figures do not depend on this machine's speed run on. One: side by
/// side on a 2-core machine the caches' pool set-up and tear-down (a 1 GiB device pool and a
/// 2 GiB host pool each) contend for memory bandwidth and page faults, and the job ran 14 %
/// longer (118.6 s vs 103.9 s at load 4.5, same session); with metrics or KV events two
/// caches would also bind the same endpoint. `HICACHE_MAIN_JOB_WORKERS` asks for more.
fn side_by_side_workers(plan: &Plan) -> usize {
    let observe = &plan.setup.observe;
    if observe.metrics_addr.is_some() || observe.kv_events.is_some() {
        return 1;
    }
    std::env::var("HICACHE_MAIN_JOB_WORKERS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n >= 1)
        .unwrap_or(1)
}

/// The runs that measure GB/s at a time: `HICACHE_MAIN_JOB_MEASURED_WORKERS` (default
/// [`MEASURED_WORKERS`]), one with metrics or KV events (two caches would bind the same
/// endpoint, and the KV events hold waits on the job's last run).
fn measured_workers(plan: &Plan) -> usize {
    let observe = &plan.setup.observe;
    if observe.metrics_addr.is_some() || observe.kv_events.is_some() {
        return 1;
    }
    std::env::var("HICACHE_MAIN_JOB_MEASURED_WORKERS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n >= 1)
        .unwrap_or(MEASURED_WORKERS)
}

/// Default of [`measured_workers`].
const MEASURED_WORKERS: usize = 1;

/// Lets each run's cache take the pool mappings (device and host, GiBs each) an earlier run
/// dropped instead of mapping fresh ones: populating fresh memory was measured at 0.13–0.4
/// GB/s on the 2-core VMs (the kernel zeroing it, and under memory pressure reclaiming and
/// compacting), 57 % of a loaded run's CPU. Budget: a quarter of the machine's memory (half
/// with `runs_at_a_time` above one), at most 16 GiB (a dense run's pools are 3 GiB); no
/// figure depends on it (the pools are populated before a run either way).
fn keep_pools_between_runs(runs_at_a_time: usize) {
    let share =
        hicache_host::memory::mem_total().unwrap_or(0) / if runs_at_a_time > 1 { 2 } else { 4 };
    let budget = share.min(16 << 30);
    hicache_host::reuse_dropped_mappings(usize::try_from(budget).unwrap_or(usize::MAX));
}

/// Whether a configuration's figures depend on how fast this machine runs: only the GB/s of
/// the copies it makes do (hits, TTFT and bytes moved come from the simulated clock, which
/// moves only while no copy runs). A configuration without L2 or L3 copies nothing.
fn measures_speed(tiers: &Tiers) -> bool {
    tiers.host || tiers.storage
}

/// The runs of a table: those whose figures do not depend on this machine's speed (run side
/// by side) and those that measure it (run alone).
#[derive(Default)]
struct TableJobs<'a> {
    side_by_side: Vec<Job<'a>>,
    alone: Vec<Job<'a>>,
}

/// The configuration whose run comes last (of those in `configurations`): the last that
/// measures speed (those run alone, after every other run), else the last of all (the
/// dense table's side-by-side runs end with the configurations, in order). The order is
/// this one when runs go one at a time, as they do with KV events (`side_by_side_workers`).
fn last_run(configurations: &[Tiers]) -> Option<usize> {
    configurations
        .iter()
        .rposition(measures_speed)
        .or(configurations.len().checked_sub(1))
}

/// What the runs whose figures do not depend on bytes carry: none (pages counted, never
/// populated or copied), unless `--all-bytes`.
fn payload_where_bytes_do_not_count(args: &MultiturnArgs) -> Payload {
    if args.all_bytes {
        Payload::Bytes
    } else {
        Payload::Counted
    }
}

/// The dense table's runs: the no-cache baseline, the copies-free counterfactuals (with
/// `counterfactual`) and the configurations that copy nothing side by side, with `spare`
/// (their figures do not depend on bytes); the configurations that copy alone, with bytes
/// (their GB/s do).
fn dense_jobs<'a>(
    plan: &'a Plan,
    factory: &'a dyn CacheFactory,
    bar: &'a ProgressBar,
    counterfactual: bool,
    spare: Payload,
    remover: &'a ScratchRemover,
) -> TableJobs<'a> {
    let mut jobs = TableJobs::default();
    let hold = plan.setup.observe.kv_events_hold;
    let last = last_run(&plan.configurations);
    for (i, &tiers) in plan.configurations.iter().enumerate() {
        if counterfactual && counterfactual_for(&tiers) {
            jobs.side_by_side.push(Job::new("dense", move || {
                Ok(Outcome::Free(
                    i,
                    run_free(plan, tiers, factory, bar, spare, remover)?,
                ))
            }));
        }
    }
    jobs.side_by_side.push(Job::new("dense", move || {
        Ok(Outcome::Baseline(run_baseline(plan, bar)?))
    }));
    for (i, &tiers) in plan.configurations.iter().enumerate() {
        let hold = hold.filter(|_| Some(i) == last);
        let payload = if measures_speed(&tiers) {
            Payload::Bytes
        } else {
            spare
        };
        // The measured run without an L3 starts the removal of the columns' directories
        // (held until then: `ScratchRemover`), unless a KV events hold keeps the plan's order.
        let release =
            measures_speed(&tiers) && !tiers.storage && plan.setup.observe.kv_events_hold.is_none();
        let job = Job::new("dense", move || {
            if release {
                remover.release();
            }
            let s = run_configuration(plan, tiers, factory, bar, hold, payload, remover)?;
            Ok(Outcome::Configuration(i, s))
        });
        if measures_speed(&tiers) {
            jobs.alone.push(job);
        } else {
            jobs.side_by_side.push(job);
        }
    }
    let mut alone: Vec<Option<(usize, Job<'a>)>> = std::mem::take(&mut jobs.alone)
        .into_iter()
        .zip(
            plan.configurations
                .iter()
                .enumerate()
                .filter(|(_, t)| measures_speed(t)),
        )
        .map(|(job, (i, _))| Some((i, job)))
        .collect();
    for i in measured_order(plan) {
        if let Some(slot) = alone
            .iter_mut()
            .find(|s| s.as_ref().is_some_and(|(j, _)| *j == i))
        {
            jobs.alone.extend(slot.take().map(|(_, job)| job));
        }
    }
    jobs
}

/// The configurations that measure GB/s (indices into the plan's), in the order they run:
/// those with an L3 disk first — each one's scratch directory is removed in the background
/// while the next run goes (`ScratchRemover`), the last one's while the run without L3
/// copies only memory, and with several at a time the longest runs start first. With a KV
/// events hold, the plan's order (`last_run`).
fn measured_order(plan: &Plan) -> Vec<usize> {
    let mut order: Vec<usize> = (0..plan.configurations.len())
        .filter(|&i| measures_speed(&plan.configurations[i]))
        .collect();
    if plan.setup.observe.kv_events_hold.is_none() {
        order.sort_by_key(|&i| !plan.configurations[i].storage);
    }
    order
}

/// The hybrid table's runs: each model's no-cache baseline and ladder (and with
/// `counterfactual` its copies-free reruns), side by side with other runs, with `payload`
/// (the table shows bytes moved as counted, not GB/s).
fn hybrid_jobs<'a>(
    plan: &'a Plan,
    factories: &'a [HybridFactory],
    bar: &'a ProgressBar,
    payload: Payload,
    counterfactual: bool,
    remover: &'a ScratchRemover,
) -> TableJobs<'a> {
    // The model with the largest pools (the last) first: the other runs' pools then fit in
    // the mappings its cache leaves (see `keep_pools_between_runs`).
    let side_by_side = factories
        .iter()
        .enumerate()
        .rev()
        .map(|(i, f)| {
            Job::new("hybrid", move || {
                Ok(Outcome::Hybrid(
                    i,
                    Box::new(run_hybrid(plan, f, bar, payload, counterfactual, remover)?),
                ))
            })
        })
        .collect();
    TableJobs {
        side_by_side,
        alone: Vec::new(),
    }
}

/// The results of the runs, in their slots.
#[derive(Default)]
struct Results {
    baseline: Option<Summary>,
    runs: Vec<Option<Summary>>,
    free: Vec<Option<FreeCopy>>,
    hybrid: Vec<Option<HybridColumn>>,
    spans: Vec<(&'static str, Span)>,
}

impl Results {
    fn new(configurations: usize, hybrids: usize) -> Self {
        Self {
            runs: vec![None; configurations],
            free: vec![None; configurations],
            hybrid: vec![None; hybrids],
            ..Self::default()
        }
    }

    /// Puts finished runs in their slots; the first error is returned.
    fn take(&mut self, done: Vec<Done>) -> Result<()> {
        for (table, result, span) in done {
            self.spans.push((table, span));
            match result? {
                Outcome::Baseline(s) => self.baseline = Some(s),
                Outcome::Configuration(i, s) => self.runs[i] = Some(s),
                Outcome::Free(i, f) => self.free[i] = Some(f),
                Outcome::Hybrid(i, h) => self.hybrid[i] = Some(*h),
            }
        }
        Ok(())
    }

    /// The wall time of `table`'s runs (the time at least one of them ran), if it had any.
    fn seconds(&self, table: &'static str) -> Option<TableSeconds> {
        let spans: Vec<Span> = self
            .spans
            .iter()
            .filter(|(t, _)| *t == table)
            .map(|(_, s)| *s)
            .collect();
        (!spans.is_empty()).then(|| TableSeconds::new(table, Span::union_seconds(spans)))
    }
}

/// Runs the main job: validates, runs the no-cache baseline and every configuration through
/// caches built by `factory`, writes the report directory, prints the table (or JSON records
/// with `--json`) to `out`, and returns the report. Exit code 1 when the report is
/// inconsistent.
///
/// Each table's runs come from one call (`dense_jobs`, `hybrid_jobs`) and run in two phases:
/// first, side by side on one thread per core, every run whose figures do not depend on this
/// machine's speed (the no-cache baselines, the configurations that copy nothing, the
/// copies-free counterfactuals, the hybrid models' columns); then the runs that measure GB/s,
/// one at a time (`HICACHE_MAIN_JOB_MEASURED_WORKERS` asks for more), those with an L3 disk
/// first. A table's wall time is the time at least one of its runs ran.
pub fn run(
    args: &MultiturnArgs,
    mut out: impl Write,
    factory: &dyn CacheFactory,
) -> Result<Report> {
    let clock = Instant::now();
    let mut plan = plan(args)?;
    if args.only_hybrid {
        // The dense table keeps its no-cache baseline (the report's first column) only.
        plan.configurations.clear();
    }
    report::prepare_dir(&plan.report_dir)?;
    let measured = measured_workers(&plan);
    keep_pools_between_runs(measured);
    let hidden = args.json || args.quiet || !std::io::stdout().is_terminal();
    // With --compare and copy time charged, every configuration with copies runs a second
    // time with copies free: the hits copy time cost, per tier.
    let counterfactual = args.compare && plan.engine.copy_time == CopyTime::Charged;
    let hybrids = if args.compare && !args.no_hybrid {
        hybrid_factories()?
    } else {
        Vec::new()
    };
    let runs_total =
        run_count(&plan, counterfactual) + hybrid_run_count(counterfactual) * hybrids.len() as u64;
    let bar = progress_bar(plan.workload.requests as u64 * runs_total, hidden);
    let mut results = Results::new(plan.configurations.len(), hybrids.len());

    // The longest runs (the hybrid models') first, so that the threads finish together.
    let spare = payload_where_bytes_do_not_count(args);
    let remover = ScratchRemover::default();
    let tables = [
        hybrid_jobs(&plan, &hybrids, &bar, spare, counterfactual, &remover),
        dense_jobs(&plan, factory, &bar, counterfactual, spare, &remover),
    ];
    let (mut side_by_side, mut alone) = (Vec::new(), Vec::new());
    for t in tables {
        side_by_side.extend(t.side_by_side);
        alone.extend(t.alone);
    }
    let workers = side_by_side_workers(&plan);
    results.take(run_jobs(workers, side_by_side, clock))?;
    results.take(run_jobs(measured, alone, clock))?;
    bar.finish_and_clear();
    remover.finish();

    let table_seconds = ["dense", "hybrid"]
        .into_iter()
        .filter_map(|t| results.seconds(t))
        .collect();
    let missing = || BenchError::check_failed("a main-job run left no result");
    let baseline = results.baseline.take().ok_or_else(missing)?;
    let runs = results
        .runs
        .into_iter()
        .zip(results.free)
        .map(|(run, free)| Ok(with_free_copy(run.ok_or_else(missing)?, free)))
        .collect::<Result<Vec<_>>>()?;
    let hybrid = results
        .hybrid
        .into_iter()
        .map(|h| h.ok_or_else(missing))
        .collect::<Result<Vec<_>>>()?;
    let mut report = report_of(&plan, baseline, runs, hybrid)?;
    report.timing = report::Timing {
        tables: table_seconds,
        total_seconds: clock.elapsed().as_secs_f64(),
        threads: workers,
        measured_threads: measured,
    };
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
