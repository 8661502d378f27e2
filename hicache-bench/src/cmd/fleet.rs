//! `hicache-bench fleet`: cache-aware routing of a fleet, every policy on the same workload.
//!
//! N simulated engines ([`hicache_sim::fleet`]), each a real `hicache::HiCache`, publish
//! their KV events into a real `hicache_index::Index`; a `hicache_index::router::Router`
//! places each request at its arrival. Every policy runs the same workload on a fresh fleet
//! (fresh caches, fresh L3). Per policy: hit tokens per tier and hit ratio, recomputed prefill
//! tokens, TTFT p50 / p90 / p99 / mean, throughput, requests per instance and load CoV (of
//! the instances' busy time), index lookups and router decision time; then the router's
//! decision time at `--decision-instances` instances (64 by default) on an index holding
//! the workload's prefixes.
//!
//! Inputs: the multi-turn workload's flags (those of `multiturn`), our JSON Lines trace
//! (`--trace`), or a Mooncake FAST'25 trace (`--trace` of `hash_ids` lines, detected by its
//! first line; `--requests` and `--time-scale` for shorter runs).

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use hicache_index::decode::ComponentKind;
use hicache_index::router::{
    Components, CostModel, InstanceInfo, L3Access, OverlapSource, Policy, ReuseRule, RouteRequest,
    Router, RouterConfig, WithComponents,
};
use hicache_index::{ChainHasher, HolderId, HolderKind, Index, Tier};
use hicache_sim::fleet::{self, FleetSetup, L3Mode, Source, Summary, mooncake};
use hicache_sim::plan::{MultiturnArgs, Plan, plan};
use hicache_sim::trace::Conversation;
use hicache_sim::workload::ReadyPolicy;
use plotters::prelude::*;
use serde_json::json;

use crate::error::{BenchError, Result};

/// L1 tokens per instance when neither `--device-pages` nor `--device-gb` is given: 256 Ki
/// tokens (about half the KV an H100 holds for Llama-3-8B).
pub const DEFAULT_L1_TOKENS: usize = 1 << 18;

/// Arguments of `fleet`.
#[derive(Clone, Debug, Args)]
pub struct FleetArgs {
    /// Instances in the fleet.
    #[arg(long, default_value_t = 8, help_heading = "Fleet")]
    pub instances: usize,
    /// Routing policies to compare, comma-separated: round-robin, least-load,
    /// sglang-cache-aware, dynamo-linear, hicache [default: all].
    #[arg(long, value_delimiter = ',', help_heading = "Fleet")]
    pub router: Vec<String>,
    /// Where L3 lives: one store shared by every instance, one per instance, or none.
    #[arg(long, value_enum, default_value = "shared", help_heading = "Fleet")]
    pub l3: L3Mode,
    /// Use only the first N requests of a trace.
    #[arg(long, help_heading = "Fleet")]
    pub requests: Option<usize>,
    /// Multiply a Mooncake trace's timestamps by this (0.5 = twice as fast).
    #[arg(long, default_value_t = 1.0, help_heading = "Fleet")]
    pub time_scale: f64,
    /// Pages carry the model's full KV bytes (default: a reduced payload with every
    /// transfer timed as the full bytes; see `hicache_sim::fleet`).
    #[arg(long, help_heading = "Fleet")]
    pub full_payload: bool,
    /// Instances of the router decision-time measurement.
    #[arg(long, default_value_t = 64, help_heading = "Fleet")]
    pub decision_instances: usize,
    /// Weight of the delay a request imposes on those queued behind it in the `hicache`
    /// policy's score (0: each request's own expected TTFT only).
    #[arg(long, default_value_t = CostModel::default().queue_externality, help_heading = "Fleet")]
    pub queue_externality: f64,
    /// The `hicache` policy credits the prefixes of prompts routed and not finished as L1
    /// overlap on their instance.
    #[arg(long, help_heading = "Fleet")]
    pub credit_in_flight: bool,
    /// The workload, cache, engine and output flags of `multiturn`.
    #[command(flatten)]
    pub workload: MultiturnArgs,
}

/// The decision-time measurement of one policy.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DecisionTime {
    /// The policy.
    pub policy: String,
    /// Instances.
    pub instances: usize,
    /// Decisions timed.
    pub decisions: usize,
    /// p50 (µs).
    pub p50_us: f64,
    /// p99 (µs).
    pub p99_us: f64,
}

/// What one `fleet` run produced.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FleetReport {
    /// The workload, one line.
    pub title: String,
    /// Whether pages carried the reduced payload.
    pub small_payload: bool,
    /// One summary per policy, in the order asked.
    pub policies: Vec<Summary>,
    /// Router decision time at `--decision-instances`.
    pub decision: Vec<DecisionTime>,
}

fn policies_of(args: &FleetArgs) -> Result<Vec<Policy>> {
    if args.router.is_empty() {
        return Ok(Policy::ALL.to_vec());
    }
    args.router
        .iter()
        .map(|s| s.trim().parse::<Policy>().map_err(BenchError::usage))
        .collect()
}

/// The plan and how its requests arrive: Mooncake traces on their timestamps, everything
/// else by the multi-turn workload's release rules.
fn workload_of(args: &FleetArgs) -> Result<(Plan, Option<Vec<f64>>, String)> {
    let mut w = args.workload.clone();
    if !(args.time_scale.is_finite() && args.time_scale > 0.0) {
        return Err(BenchError::usage(format!(
            "--time-scale must be > 0, got {}",
            args.time_scale
        )));
    }
    let mooncake_trace = match &w.trace {
        Some(p) if mooncake::is_mooncake(p)? => Some(p.clone()),
        _ => None,
    };
    let mut loaded: Option<(Vec<Conversation>, Vec<f64>)> = None;
    if let Some(path) = &mooncake_trace {
        let reqs = mooncake::read(path, args.requests)?;
        if reqs.is_empty() {
            return Err(BenchError::usage(format!(
                "{}: the trace has no requests",
                path.display()
            )));
        }
        loaded = Some(mooncake::workload(&reqs, w.vocab, w.seed, args.time_scale));
        w.trace = None;
    }
    let longest = loaded.as_ref().map_or(0, |(c, _)| {
        c.iter()
            .flat_map(|c| c.turns.iter().map(|t| t.answer_end))
            .max()
            .unwrap_or(0)
    });
    if w.device_pages.is_none() && w.device_gb.is_none() {
        let ps = w.page_size.max(1) as usize;
        w.device_pages = Some((DEFAULT_L1_TOKENS / ps).max(longest.div_ceil(ps)).max(1));
    }
    let mut p = plan(&w)?;
    let mut times = None;
    let mut title = p.title().replacen("multiturn", "fleet", 1);
    if let Some((convs, t)) = loaded {
        let need = longest.div_ceil(p.setup.kv_shape.page_size as usize);
        if need > p.setup.device_pages {
            return Err(BenchError::usage(format!(
                "the longest request needs {need} pages but L1 holds {}; raise --device-pages",
                p.setup.device_pages
            )));
        }
        p.workload.kind = "trace";
        p.workload.requests = convs.len();
        p.workload.prompt_tokens = convs.iter().map(|c| c.turns[0].prompt_end).sum();
        p.workload.longest_request_tokens = longest;
        p.conversations = convs;
        title = format!(
            "fleet: Mooncake trace {} ({} requests, {} prompt tokens, time scale {}); page {}, \
             L1 {} pages",
            mooncake_trace
                .as_deref()
                .map(Path::display)
                .map(|d| d.to_string())
                .unwrap_or_default(),
            p.workload.requests,
            p.workload.prompt_tokens,
            args.time_scale,
            p.setup.kv_shape.page_size,
            p.setup.device_pages
        );
        times = Some(t);
    } else if let Some(n) = args.requests
        && w.trace.is_some()
    {
        p.conversations.truncate(n);
        p.workload.requests = p.conversations.iter().map(|c| c.turns.len()).sum();
        p.workload.prompt_tokens = p
            .conversations
            .iter()
            .flat_map(|c| c.turns.iter().map(|t| t.prompt_end))
            .sum();
    }
    Ok((p, times, title))
}

/// Runs `fleet`: every policy, the table (or JSON lines) on `out`, the report and plots in
/// the report directory.
pub fn run(args: &FleetArgs, mut out: impl Write) -> Result<FleetReport> {
    let (report, dir) = measure(args, false, &mut out)?;
    if args.workload.json {
        print_json(&report, &mut out)?;
    } else {
        print_table(&report, &mut out)?;
    }
    write_report(&report, &dir, !args.workload.json, &mut out)?;
    Ok(report)
}

/// Instances of the main job's fleet table.
pub const MAIN_JOB_INSTANCES: usize = 4;

/// The main job's compact fleet table: its workload's conversations (`args`, the main job's
/// flags, its L1 per instance) on [`MAIN_JOB_INSTANCES`] instances sharing one L3, every policy
/// run (same run, same workload, side by side on threads); printed: `round-robin`, the best
/// anchor by mean TTFT and `hicache`, with hits per tier (JSON lines of the three with
/// `--json`), `fleet.json` and the TTFT plot in the report directory.
///
/// Two workload flags differ from the single-engine tables, each for a stated reason:
/// - `max_parallel` is the job's times [`MAIN_JOB_INSTANCES`]: each instance sees the
///   concurrency one engine sees above (four engines at the job's four in flight would idle);
/// - ready requests go out in random order ([`ReadyPolicy::Random`]): with FIFO, 16 clients
///   and 4 instances, round-robin's turn lines up with the clients' fixed order, so it sends
///   every conversation to the same instance by accident and every policy prints one row.
pub fn main_job_table(args: &MultiturnArgs, mut out: impl Write) -> Result<FleetReport> {
    let wall = std::time::Instant::now();
    // The main job's L1 per instance (the fleet's own default is sized for traces).
    let l1 = plan(args)?.setup.device_pages;
    let fa = FleetArgs {
        instances: MAIN_JOB_INSTANCES,
        router: Vec::new(),
        l3: L3Mode::Shared,
        requests: None,
        time_scale: 1.0,
        full_payload: false,
        decision_instances: 0,
        queue_externality: CostModel::default().queue_externality,
        credit_in_flight: false,
        workload: MultiturnArgs {
            quiet: true,
            device_pages: Some(l1),
            device_gb: None,
            // The job's own endpoints belong to its single-engine tables: the fleet's engines
            // feed their index in process, and a second cache binding the job's metrics or
            // ZMQ address would fail with "address already in use".
            metrics_addr: None,
            kv_events: None,
            kv_events_hold: None,
            max_parallel: args.max_parallel.saturating_mul(MAIN_JOB_INSTANCES),
            ready_queue_policy: ReadyPolicy::Random,
            ..args.clone()
        },
    };
    let (mut report, dir) = measure(&fa, true, &mut std::io::sink())?;
    let anchors = ["least-load", "sglang-cache-aware", "dynamo-linear"];
    let best = report
        .policies
        .iter()
        .filter(|s| anchors.contains(&s.policy.as_str()))
        .min_by(|a, b| a.ttft_mean_ms.total_cmp(&b.ttft_mean_ms))
        .map(|s| s.policy.clone());
    let shown = |p: &str| p == "round-robin" || p == "hicache" || best.as_deref() == Some(p);
    let all = report.policies.clone();
    report.policies.retain(|s| shown(&s.policy));
    if args.json {
        print_json(&report, &mut out)?;
    } else {
        let w =
            |out: &mut dyn Write, s: String| writeln!(out, "{s}").map_err(BenchError::io("stdout"));
        w(
            &mut out,
            format!(
                "fleet: {MAIN_JOB_INSTANCES} instances, shared L3, the conversations above with \
                 {} in flight ({} per instance) sent in random ready order (best anchor of {}: \
                 {}; {:.2} s wall)",
                fa.workload.max_parallel,
                args.max_parallel,
                anchors.join(", "),
                best.as_deref().unwrap_or("none"),
                wall.elapsed().as_secs_f64()
            ),
        )?;
        w(
            &mut out,
            format!(
                "{:<19} {:>9} {:>9} {:>9} {:>10} {:>6} {:>9} {:>9} {:>9} {:>9} {:>6}",
                "policy",
                "hit L1",
                "hit L2",
                "hit L3",
                "recomputed",
                "hit%",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "mean ms",
                "CoV"
            ),
        )?;
        for s in &report.policies {
            w(
                &mut out,
                format!(
                    "{:<19} {:>9} {:>9} {:>9} {:>10} {:>6.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>6.3}",
                    s.policy,
                    s.hit_tokens_l1,
                    s.hit_tokens_l2,
                    s.hit_tokens_l3,
                    s.recomputed_tokens,
                    100.0 * s.hit_ratio,
                    s.ttft_p50_ms,
                    s.ttft_p90_ms,
                    s.ttft_p99_ms,
                    s.ttft_mean_ms,
                    s.load_cov
                ),
            )?;
        }
    }
    report.policies = all;
    write_report(&report, &dir, false, &mut out)?;
    Ok(report)
}

/// Runs every policy of `args` on a fresh fleet each (with `parallel`, each on its own
/// thread: the fleets share nothing, and simulated figures do not depend on wall time); the
/// heading (unless `--json`) on `out`. Returns the report and the report directory.
fn measure(
    args: &FleetArgs,
    parallel: bool,
    out: &mut impl Write,
) -> Result<(FleetReport, PathBuf)> {
    let policies = policies_of(args)?;
    let (plan, times, title) = workload_of(args)?;
    let mut setup = FleetSetup::from_plan(&plan, args.instances, args.l3, !args.full_payload)?;
    if !(args.queue_externality.is_finite() && args.queue_externality >= 0.0) {
        return Err(BenchError::usage(format!(
            "--queue-externality must be a finite number ≥ 0, got {}",
            args.queue_externality
        )));
    }
    setup.cost.queue_externality = args.queue_externality;
    setup.credit_in_flight = args.credit_in_flight;
    let json = args.workload.json;
    let quiet = json || args.workload.quiet;
    if !json {
        writeln!(
            out,
            "{title}; {} instances, L3 {:?}",
            args.instances, args.l3
        )
        .map_err(BenchError::io("stdout"))?;
        if setup.small_payload {
            writeln!(
                out,
                "small page payloads: {} B per page instead of {} B, every link rate scaled \
                 alike (transfer times are the full bytes')",
                setup.engine.page_bytes, setup.real_page_bytes
            )
            .map_err(BenchError::io("stdout"))?;
        }
    }
    let run = |policy| run_policy(args, &plan, times.as_deref(), &setup, policy, quiet);
    let summaries = if parallel {
        std::thread::scope(|scope| {
            let runs: Vec<_> = policies
                .iter()
                .map(|&p| scope.spawn(move || run(p)))
                .collect();
            runs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(BenchError::check_failed("a fleet run panicked")))
                })
                .collect::<Result<Vec<_>>>()
        })?
    } else {
        policies
            .iter()
            .map(|&p| run(p))
            .collect::<Result<Vec<_>>>()?
    };
    let decision = decision_times(&plan.conversations, &plan, args.decision_instances, &setup)?;
    let report = FleetReport {
        title,
        small_payload: setup.small_payload,
        policies: summaries,
        decision,
    };
    Ok((report, plan.report_dir))
}

/// One policy on a fresh fleet: its summary, accounting checked.
fn run_policy(
    args: &FleetArgs,
    plan: &Plan,
    times: Option<&[f64]>,
    setup: &FleetSetup,
    policy: Policy,
    quiet: bool,
) -> Result<Summary> {
    let source = match times {
        Some(t) => Source::timed(t),
        None => Source::closed(plan)?,
    };
    let mut fleet_setup = setup.clone();
    fleet_setup.sessions = times.is_none();
    let mut last = std::time::Instant::now();
    let run = fleet::run(
        &fleet_setup,
        &plan.conversations,
        source,
        policy,
        &mut |done, total| {
            if !quiet && (done == total || last.elapsed().as_secs() >= 5) {
                eprintln!("{policy}: {done}/{total} requests");
                last = std::time::Instant::now();
            }
        },
    )?;
    check_accounting(&run, args.instances)?;
    Ok(run.summary(args.instances))
}

/// `hit + computed = prompt` per request; every request served exactly once.
fn check_accounting(run: &fleet::FleetRun, instances: usize) -> Result<()> {
    for r in &run.requests {
        if r.hit() + r.computed != r.prompt_tokens {
            return Err(BenchError::check_failed(format!(
                "{}: request {} has {} hit + {} computed tokens for a {}-token prompt",
                run.policy,
                r.id,
                r.hit(),
                r.computed,
                r.prompt_tokens
            )));
        }
    }
    if run.instance_of.iter().any(|&i| i >= instances)
        || run.instance_of.len() != run.requests.len()
    {
        return Err(BenchError::check_failed(format!(
            "{}: requests and placements disagree",
            run.policy
        )));
    }
    Ok(())
}

/// Router decision time (index query and cost) at `n` instances: an index holding every
/// prompt of the workload, each on one instance in L1, the next one in L2 and the shared
/// store, then one decision per prompt (released at once so load stays bounded). Besides
/// `dynamo-linear` and `hicache`, `hicache (hybrid)` times the same decisions for a Mamba
/// model: the same blocks, a state at every fourth block and at each prompt's last (as a
/// hybrid engine checkpoints), and every credit capped where the states are
/// ([`Components::cap`]), the rule the service applies to a hybrid model.
fn decision_times(
    convs: &[Conversation],
    plan: &Plan,
    n: usize,
    setup: &FleetSetup,
) -> Result<Vec<DecisionTime>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let ps = plan.setup.kv_shape.page_size as usize;
    let hasher = ChainHasher::new(ps);
    let mut index = Index::new(None);
    let idx_err = |e: hicache_index::IndexError| BenchError::check_failed(format!("index: {e}"));
    let store = index.add_holder(HolderKind::Store).map_err(idx_err)?;
    let mut infos = Vec::with_capacity(n);
    for _ in 0..n {
        let h = index.add_holder(HolderKind::Instance).map_err(idx_err)?;
        index.attach(h, store).map_err(idx_err)?;
        infos.push(InstanceInfo {
            holder: h,
            l3: L3Access::Shared(1e10),
            kv_capacity_tokens: None,
            l3_prefetch_threshold_tokens: None,
        });
    }
    let prompts: Vec<&[u32]> = convs
        .iter()
        .flat_map(|c| (0..c.turns.len()).map(move |r| c.prompt(r)))
        .take(4096)
        .collect();
    for (k, p) in prompts.iter().enumerate() {
        let h = hasher.hashes(p);
        index
            .store(infos[k % n].holder, Tier::L1, &h)
            .map_err(idx_err)?;
        index
            .store(infos[(k + 1) % n].holder, Tier::L2, &h[..h.len() / 2])
            .map_err(idx_err)?;
        index.store(store, Tier::L3, &h).map_err(idx_err)?;
    }
    let components = mamba_states(&prompts, &hasher, &infos, store);
    let mut out = Vec::new();
    for (policy, hybrid) in [
        (Policy::DynamoLinear, false),
        (Policy::Hicache, false),
        (Policy::Hicache, true),
    ] {
        let mut cfg = RouterConfig::new(ps);
        cfg.cost = setup.cost;
        let mut router = Router::new(policy, infos.clone(), cfg);
        let with = WithComponents {
            index: &index,
            components: &components,
        };
        let source: &dyn OverlapSource = if hybrid {
            router.set_reuse(ReuseRule::Hybrid);
            &with
        } else {
            &index
        };
        // The first round warms caches and allocations; the others are timed, at least
        // 4096 decisions in all.
        let rounds = 1 + 4096usize.div_ceil(prompts.len().max(1));
        let mut ns = Vec::with_capacity(4096 + prompts.len());
        for round in 0..rounds {
            for (k, p) in prompts.iter().enumerate() {
                let id = (round * prompts.len() + k) as u64;
                let t0 = std::time::Instant::now();
                let d = router.route(
                    source,
                    &RouteRequest {
                        request: id,
                        tokens: p,
                        session: Some(k as u64),
                        lora: None,
                    },
                );
                let t = t0.elapsed().as_nanos() as f64 / 1e3;
                std::hint::black_box(d);
                router.finished(id);
                if round > 0 {
                    ns.push(t);
                }
            }
        }
        ns.sort_by(f64::total_cmp);
        out.push(DecisionTime {
            policy: if hybrid {
                format!("{} (hybrid)", policy.name())
            } else {
                policy.name().into()
            },
            instances: n,
            decisions: ns.len(),
            p50_us: fleet::quantile(&ns, 0.5),
            p99_us: fleet::quantile(&ns, 0.99),
        });
    }
    Ok(out)
}

/// The Mamba states of [`decision_times`]' hybrid case: where each prompt's blocks are held
/// (L1 on one instance, the first half in L2 on the next, all in the shared store), a state
/// at every fourth block and at the last.
fn mamba_states(
    prompts: &[&[u32]],
    hasher: &ChainHasher,
    infos: &[InstanceInfo],
    store: HolderId,
) -> Components {
    let n = infos.len();
    let mut components = Components::new();
    for info in infos {
        components.attach(info.holder, store);
    }
    for (k, p) in prompts.iter().enumerate() {
        let h = hasher.hashes(p);
        for (b, &block) in h.iter().enumerate() {
            if (b + 1) % 4 != 0 && b + 1 != h.len() {
                continue;
            }
            // The engine's hash of a block is opaque to the index; the block's own does.
            let engine = block as i64;
            let mut put = |holder, tier| {
                components.store(holder, tier, ComponentKind::Mamba, engine, block);
            };
            put(infos[k % n].holder, Tier::L1);
            if b < h.len() / 2 {
                put(infos[(k + 1) % n].holder, Tier::L2);
            }
            put(store, Tier::L3);
        }
    }
    components
}

fn print_json(report: &FleetReport, out: &mut impl Write) -> Result<()> {
    for s in &report.policies {
        let line = json!({
            "bench": "fleet",
            "policy": s.policy,
            "instances": s.instances,
            "requests": s.requests,
            "prompt_tokens": s.prompt_tokens,
            "hit_tokens_l1": s.hit_tokens_l1,
            "hit_tokens_l2": s.hit_tokens_l2,
            "hit_tokens_l3": s.hit_tokens_l3,
            "recomputed_tokens": s.recomputed_tokens,
            "ttft_p50_ms": s.ttft_p50_ms,
            "ttft_p90_ms": s.ttft_p90_ms,
            "ttft_p99_ms": s.ttft_p99_ms,
            "ttft_mean_ms": s.ttft_mean_ms,
            "ttft_floor_mean_ms": s.ttft_floor_mean_ms,
            "throughput_req_s": s.throughput_req_s,
            "load_cov": s.load_cov,
            "requests_per_instance": s.requests_per_instance,
        });
        writeln!(out, "{line}").map_err(BenchError::io("stdout"))?;
    }
    Ok(())
}

fn print_table(report: &FleetReport, out: &mut impl Write) -> Result<()> {
    let w = |out: &mut dyn Write, s: String| writeln!(out, "{s}").map_err(BenchError::io("stdout"));
    w(
        out,
        format!(
            "{:<19} {:>6} {:>11} {:>11} {:>11} {:>12} {:>6} {:>9} {:>9} {:>9} {:>9} {:>7} {:>6} {:>8} {:>8}",
            "policy",
            "reqs",
            "hit L1",
            "hit L2",
            "hit L3",
            "recomputed",
            "hit%",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "mean ms",
            "req/s",
            "CoV",
            "dec p99",
            "fallbk"
        ),
    )?;
    for s in &report.policies {
        w(
            out,
            format!(
                "{:<19} {:>6} {:>11} {:>11} {:>11} {:>12} {:>6.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>7.2} {:>6.3} {:>6.1}µs {:>8}",
                s.policy,
                s.requests,
                s.hit_tokens_l1,
                s.hit_tokens_l2,
                s.hit_tokens_l3,
                s.recomputed_tokens,
                100.0 * s.hit_ratio,
                s.ttft_p50_ms,
                s.ttft_p90_ms,
                s.ttft_p99_ms,
                s.ttft_mean_ms,
                s.throughput_req_s,
                s.load_cov,
                s.decision_p99_us,
                s.fallbacks
            ),
        )?;
    }
    for s in &report.policies {
        w(
            out,
            format!(
                "{:<19} requests per instance {:?}; index lookups {} (mean {:.2} µs)",
                s.policy, s.requests_per_instance, s.index_lookups, s.index_lookup_mean_us
            ),
        )?;
    }
    let floors = report.policies.iter().map(|s| s.ttft_floor_mean_ms);
    let (lo, hi) = floors.fold((f64::INFINITY, 0.0f64), |(lo, hi), f| {
        (lo.min(f), hi.max(f))
    });
    if lo.is_finite() {
        let range = if hi - lo > 0.05 {
            format!("{lo:.1}–{hi:.1} ms (arrival orders differ by policy)")
        } else {
            format!("{hi:.1} ms")
        };
        w(
            out,
            format!(
                "no-queue floor: mean TTFT {range} (each request alone on an idle instance \
                 holding in L1 every page an earlier prompt carried: its compute only)"
            ),
        )?;
    }
    if let Some(rr) = report.policies.iter().find(|s| s.policy == "round-robin")
        && let Some(ours) = report.policies.iter().find(|s| s.policy == "hicache")
    {
        let anchors = ["least-load", "sglang-cache-aware", "dynamo-linear"];
        let best = report
            .policies
            .iter()
            .filter(|s| anchors.contains(&s.policy.as_str()))
            .min_by(|a, b| a.ttft_mean_ms.total_cmp(&b.ttft_mean_ms));
        let red = |a: u64, b: u64| 100.0 * (1.0 - a as f64 / b.max(1) as f64);
        w(
            out,
            format!(
                "hicache vs round-robin: {:.1} % fewer recomputed tokens, mean TTFT {:.2}× lower",
                red(ours.recomputed_tokens, rr.recomputed_tokens),
                rr.ttft_mean_ms / ours.ttft_mean_ms.max(1e-9)
            ),
        )?;
        if let Some(b) = best {
            w(
                out,
                format!(
                    "hicache vs the best anchor ({}): {:.1} % fewer recomputed tokens, mean TTFT \
                     {:.1} % lower; load CoV {:.3}",
                    b.policy,
                    red(ours.recomputed_tokens, b.recomputed_tokens),
                    100.0 * (1.0 - ours.ttft_mean_ms / b.ttft_mean_ms.max(1e-9)),
                    ours.load_cov
                ),
            )?;
        }
    }
    for d in &report.decision {
        w(
            out,
            format!(
                "router decision at {} instances ({}): p50 {:.2} µs, p99 {:.2} µs over {} decisions",
                d.instances, d.policy, d.p50_us, d.p99_us, d.decisions
            ),
        )?;
    }
    Ok(())
}

fn write_report(report: &FleetReport, dir: &Path, say: bool, out: &mut impl Write) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(BenchError::io(dir))?;
    let path = dir.join("fleet.json");
    let text = serde_json::to_string_pretty(report)
        .map_err(|e| BenchError::check_failed(format!("report: {e}")))?;
    std::fs::write(&path, text).map_err(BenchError::io(&path))?;
    let svg = dir.join("fleet_ttft.svg");
    ttft_plot(&svg, report).map_err(BenchError::check_failed)?;
    if say {
        writeln!(out, "report: {} and {}", path.display(), svg.display())
            .map_err(BenchError::io("stdout"))?;
    }
    Ok(())
}

/// TTFT p50 / p90 / p99 / mean per policy, grouped bars (ms).
fn ttft_plot(path: &PathBuf, report: &FleetReport) -> Result<(), String> {
    let e = |x: String| format!("{}: TTFT plot: {x}", path.display());
    let val = |s: &Summary, k: usize| match k {
        0 => s.ttft_p50_ms,
        1 => s.ttft_p90_ms,
        2 => s.ttft_p99_ms,
        _ => s.ttft_mean_ms,
    };
    let max = report
        .policies
        .iter()
        .flat_map(|s| (0..4).map(move |k| val(s, k)))
        .fold(1e-3, f64::max)
        * 1.1;
    let n = report.policies.len().max(1);
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Fleet routing: time to first token per policy (simulated)",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..(4 * (n + 1)) as f64, 0f64..max)
        .map_err(|x| e(x.to_string()))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("TTFT (ms)")
        .x_desc("p50 | p90 | p99 | mean")
        .draw()
        .map_err(|x| e(x.to_string()))?;
    const C: [RGBColor; 5] = [
        RGBColor(110, 110, 110),
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(148, 103, 189),
        RGBColor(44, 160, 44),
    ];
    for (i, s) in report.policies.iter().enumerate() {
        let c = C[i % C.len()];
        let bars: Vec<Rectangle<(f64, f64)>> = (0..4)
            .map(|k| {
                let x = (k * (n + 1) + i) as f64;
                Rectangle::new([(x, 0.0), (x + 0.9, val(s, k))], c.filled())
            })
            .collect();
        chart
            .draw_series(bars)
            .map_err(|x| e(x.to_string()))?
            .label(s.policy.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|x| e(x.to_string()))?;
    root.present().map_err(|x| e(x.to_string()))
}
