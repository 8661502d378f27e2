//! A fleet of simulated engines behind a router, for the routing bench.
//!
//! N instances, each a real `hicache::HiCache` (L1 + L2, and L3 as asked: one store shared by
//! all — the file backend's shared mode on one directory —, one each, or none) driven by the
//! scheduler of [`crate::engine`] ([`instance`]); every KV event the caches collect is
//! converted ([`events`]) and applied to a real [`hicache_index::Index`] through one
//! [`InstanceFeed`] per instance; a [`Router`] queries that index for every request, at the
//! request's arrival, and the request goes to the instance it chose.
//!
//! # The loop (normative)
//!
//! One simulated clock. Each instance has the time it next has something to do (`ready`:
//! its clock after a forward step, the completion of a prefetch or copy it waits for, or none
//! when idle). Repeatedly: if the workload's next arrival is at or before every `ready`, it is
//! routed and delivered (the instance's clock moves to the arrival if it was behind);
//! otherwise the instance with the earliest `ready` runs one iteration of its loop. After
//! every arrival and step, the instance's new KV events go to the index and its load is
//! reported to the router; finished requests go back to the workload (which releases the
//! next turn of a conversation) and to [`Router::finished`]. The run ends when every request
//! finished.
//!
//! # Small page payloads
//!
//! With [`FleetSetup::small_payload`], the caches hold pages of a reduced KV row (1 head of
//! 1 element per layer, so a fleet fits in this machine's memory) while every transfer is
//! timed as the model's real bytes: all link rates are scaled by the same ratio as the bytes,
//! so a page takes exactly the simulated time its real size would. Hits, tokens and times do
//! not depend on the bytes; byte counts do (they are the scaled ones), and the output says so.
//!
//! # The file L3's settings
//!
//! The caches' file L3 runs with `fsync: none` and `io_threads: 1` unless the extra-config
//! says otherwise: simulated time is charged on the modelled links, never from the wall time
//! of a sync or of parallel I/O, so these change no figure (hits and TTFT are the same), and a
//! fleet of N caches would otherwise sync the file system and spawn threads N times over.

pub mod events;
pub mod floor;
pub mod instance;
pub mod mooncake;

use std::time::Instant;

use hicache_index::router::{
    CostModel, InstanceInfo, L3Access, LoadReport, Policy, RouteRequest, Router, RouterConfig,
    RouterStats,
};
use hicache_index::{HolderKind, Index, IngestCounts, InstanceFeed};
use serde::Serialize;
use serde_json::Value;

use crate::adapter::HiCacheUnderTest;
use crate::engine::{EngineConfig, RequestRecord};
use crate::error::{Result, SimError};
use crate::model::{ComputeModel, ModelShape};
use crate::plan::Plan;
use crate::setup::CacheSetup;
use crate::trace::Conversation;
use crate::workload::{Sent, Workload};
use instance::Instance;

/// Where the fleet's L3 lives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum L3Mode {
    /// One store every instance reads and writes (the file backend's shared mode).
    Shared,
    /// One store per instance.
    PerInstance,
    /// No L3.
    None,
}

/// How requests are released: the multi-turn workload's closed loop, or a trace's
/// timestamps (open loop).
pub enum Source {
    /// Closed-loop clients ([`Workload`]'s rules).
    Closed(Box<Workload>),
    /// Requests at fixed times: `(time, conversation)` sorted by time, one turn each.
    Timed {
        /// Arrivals.
        sends: Vec<(f64, usize)>,
        /// Next to send.
        next: usize,
        /// Completed so far.
        completed: usize,
    },
}

impl Source {
    /// A closed-loop source over `plan`'s conversations and release rules.
    pub fn closed(plan: &Plan) -> Result<Self> {
        Ok(Source::Closed(Box::new(
            Workload::new(plan.conversations.clone(), plan.workload.arrivals.clone())
                .map_err(SimError::Usage)?,
        )))
    }

    /// An open-loop source: conversation `i` (one turn) arrives at `times[i]`.
    pub fn timed(times: &[f64]) -> Self {
        let mut sends: Vec<(f64, usize)> = times.iter().copied().zip(0..).collect();
        sends.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        Source::Timed {
            sends,
            next: 0,
            completed: 0,
        }
    }

    fn total(&self) -> usize {
        match self {
            Source::Closed(w) => w.total(),
            Source::Timed { sends, .. } => sends.len(),
        }
    }

    fn is_done(&self) -> bool {
        match self {
            Source::Closed(w) => w.is_done(),
            Source::Timed {
                sends, completed, ..
            } => *completed == sends.len(),
        }
    }

    fn next_send_time(&self) -> Option<f64> {
        match self {
            Source::Closed(w) => w.next_send_time(),
            Source::Timed { sends, next, .. } => sends.get(*next).map(|s| s.0),
        }
    }

    fn pop_due(&mut self, now: f64) -> Option<Sent> {
        match self {
            Source::Closed(w) => w.pop_due(now),
            Source::Timed { sends, next, .. } => {
                let &(time, conversation) = sends.get(*next).filter(|s| s.0 <= now)?;
                let id = *next as u64;
                *next += 1;
                Some(Sent {
                    id,
                    conversation,
                    round: 0,
                    time,
                })
            }
        }
    }

    fn complete(&mut self, sent: &Sent, now: f64) {
        match self {
            Source::Closed(w) => w.complete(sent, now),
            Source::Timed { completed, .. } => *completed += 1,
        }
    }
}

/// Everything a fleet run needs besides the workload.
#[derive(Clone, Debug)]
pub struct FleetSetup {
    /// Instances.
    pub instances: usize,
    /// Where L3 lives.
    pub l3: L3Mode,
    /// Each instance's cache (L3 directory filled in per run).
    pub setup: CacheSetup,
    /// Costs (links scaled with the payload).
    pub compute: ComputeModel,
    /// Scheduler settings (page bytes: the payload's).
    pub engine: EngineConfig,
    /// The `hicache` policy's inputs (the model's real figures).
    pub cost: CostModel,
    /// Whether pages carry the reduced payload (see the module docs).
    pub small_payload: bool,
    /// The model's real bytes per page.
    pub real_page_bytes: u64,
    /// Whether requests carry their conversation as the router's session.
    pub sessions: bool,
    /// Whether `hicache` credits prefixes in flight ([`RouterConfig::credit_in_flight`]).
    pub credit_in_flight: bool,
}

impl FleetSetup {
    /// The fleet of `plan`'s engines and caches: `instances` of them, L3 as `l3`.
    pub fn from_plan(
        plan: &Plan,
        instances: usize,
        l3: L3Mode,
        small_payload: bool,
    ) -> Result<Self> {
        if instances == 0 {
            return Err(SimError::Usage("--instances must be at least 1".into()));
        }
        let mut setup = plan.setup.clone();
        // Every instance has L1 and L2 (whatever configuration the plan starts with), L3 as asked.
        setup.tiers.host = true;
        setup.tiers.storage = l3 != L3Mode::None;
        let mut compute = plan.compute.clone();
        let mut engine = plan.engine.clone();
        let real_page_bytes = engine.page_bytes;
        if small_payload {
            let payload = ModelShape {
                kv_heads: 1,
                head_dim: 1,
                ..plan.model.clone()
            };
            setup.kv_shape = payload.kv_shape(setup.kv_shape.page_size);
            engine.page_bytes = setup.kv_shape.page_bytes() as u64;
            let r = engine.page_bytes as f64 / real_page_bytes as f64;
            compute.h2d_bytes_per_s *= r;
            compute.d2h_bytes_per_s *= r;
            compute.l3_bytes_per_s *= r;
        }
        let cost = CostModel {
            prefill_s_per_token: plan.compute.prefill_s_per_token,
            attention_s_per_pair: plan.compute.attention_s_per_pair,
            decode_s_per_step: plan.compute.decode_s_per_step,
            decode_s_per_context_token: plan.compute.decode_s_per_context_token,
            kv_bytes_per_token: plan.model.token_bytes() as f64,
            h2d_bytes_per_s: plan.compute.h2d_bytes_per_s,
            l3_latency_s: plan.compute.l3_latency_s,
            answer_tokens: mean_answer_tokens(&plan.conversations)
                .unwrap_or(CostModel::default().answer_tokens),
            ..CostModel::default()
        };
        Ok(Self {
            instances,
            l3,
            setup,
            compute,
            engine,
            cost,
            small_payload,
            real_page_bytes,
            sessions: true,
            credit_in_flight: false,
        })
    }

    fn l3_access(&self) -> L3Access {
        let rate = self.cost_l3_rate();
        match self.l3 {
            L3Mode::Shared => L3Access::Shared(rate),
            L3Mode::PerInstance => L3Access::Private(rate),
            L3Mode::None => L3Access::None,
        }
    }

    /// The real L3 read rate (bytes/s), unscaled.
    fn cost_l3_rate(&self) -> f64 {
        let scale = if self.small_payload {
            self.engine.page_bytes as f64 / self.real_page_bytes as f64
        } else {
            1.0
        };
        self.compute.l3_bytes_per_s / scale
    }

    /// Each instance's cache setup, L3 under `dir`.
    fn instance_setups(&self, dir: &std::path::Path) -> Vec<CacheSetup> {
        (0..self.instances)
            .map(|i| {
                let mut s = self.setup.clone();
                if self.l3 != L3Mode::None && s.storage.backend == "file" {
                    let (d, shared) = match self.l3 {
                        L3Mode::Shared => (dir.join("shared"), true),
                        _ => (dir.join(format!("instance-{i}")), false),
                    };
                    s.storage
                        .extra_config
                        .entry("dir")
                        .or_insert_with(|| Value::String(d.display().to_string()));
                    if shared {
                        s.storage
                            .extra_config
                            .insert("shared".into(), Value::Bool(true));
                    }
                    // Simulated time does not depend on durability or I/O parallelism (see the
                    // module docs): unless asked otherwise, no syncs and no I/O threads.
                    for (k, v) in [
                        ("fsync", Value::from("none")),
                        ("io_threads", Value::from(1)),
                    ] {
                        s.storage.extra_config.entry(k).or_insert(v);
                    }
                    s.scratch_dir = Some(d);
                }
                s
            })
            .collect()
    }
}

/// One policy's run.
#[derive(Clone, Debug, Serialize)]
pub struct FleetRun {
    /// The policy.
    pub policy: String,
    /// Every request, by id.
    pub requests: Vec<RequestRecord>,
    /// The instance each request went to, by id.
    pub instance_of: Vec<usize>,
    /// Busy time of each instance (s).
    pub busy_s: Vec<f64>,
    /// Router decision times, in decision order (ns).
    pub decision_ns: Vec<u64>,
    /// Each request's no-queue floor (s), by id ([`floor`]).
    pub floor_ttft_s: Vec<f64>,
    /// What the router counted.
    #[serde(skip)]
    pub router: RouterStats,
    /// What the index's feeds counted.
    #[serde(skip)]
    pub ingest: IngestCounts,
    /// Holder-blocks in the index at the end.
    pub index_holder_blocks: u64,
    /// Simulated time from the first arrival to the last finish (s).
    pub sim_seconds: f64,
    /// Wall time of the run (s).
    pub wall_seconds: f64,
}

/// The L3 prefetch threshold an instance of `setup` applies, in tokens: its storage
/// config's `prefetch_threshold`, at least a page, as the dense cache reads it
/// (`PrefetchConfig::threshold_tokens`).
fn prefetch_threshold_tokens(setup: &CacheSetup) -> Result<u64> {
    let s = &setup.storage;
    let config = hicache_storage::StorageConfig::from_value(
        Some(&s.backend),
        Value::Object(s.extra_config.clone()),
        "--extra-config",
    )?;
    Ok(config
        .common
        .prefetch_threshold
        .max(u64::from(setup.kv_shape.page_size)))
}

/// The workload's mean answer length in tokens (what an operator would measure and give
/// the `hicache` policy's memory term); `None` without turns.
fn mean_answer_tokens(convs: &[Conversation]) -> Option<f64> {
    let (sum, n) = convs
        .iter()
        .flat_map(|c| c.turns.iter())
        .fold((0usize, 0usize), |(s, n), t| {
            (s + (t.answer_end - t.prompt_end), n + 1)
        });
    (n > 0).then(|| sum as f64 / n as f64)
}

/// Runs `convs` released by `source` through a fleet routed by `policy`.
pub fn run(
    fleet: &FleetSetup,
    convs: &[Conversation],
    mut source: Source,
    policy: Policy,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<FleetRun> {
    let wall = Instant::now();
    let scratch = tempfile::Builder::new()
        .prefix("hicache-fleet-l3-")
        .tempdir()
        .map_err(SimError::io(std::env::temp_dir()))?;
    let mut index = Index::new(None);
    let store = match fleet.l3 {
        L3Mode::Shared => Some(index.add_holder(HolderKind::Store).map_err(idx_err)?),
        _ => None,
    };
    let ps = fleet.setup.kv_shape.page_size;
    let mut instances = Vec::with_capacity(fleet.instances);
    let mut feeds = Vec::with_capacity(fleet.instances);
    let mut infos = Vec::with_capacity(fleet.instances);
    for setup in fleet.instance_setups(scratch.path()) {
        let h = index.add_holder(HolderKind::Instance).map_err(idx_err)?;
        if let Some(s) = store {
            index.attach(h, s).map_err(idx_err)?;
        }
        feeds.push(InstanceFeed::new(h, store.unwrap_or(h), ps));
        infos.push(InstanceInfo {
            holder: h,
            l3: fleet.l3_access(),
            kv_capacity_tokens: Some(
                fleet.setup.device_pages as u64 * u64::from(fleet.setup.kv_shape.page_size),
            ),
            l3_prefetch_threshold_tokens: (fleet.l3 != L3Mode::None)
                .then(|| prefetch_threshold_tokens(&setup))
                .transpose()?,
        });
        let cache = HiCacheUnderTest::build(&setup, true)?;
        instances.push(Instance::new(cache, &fleet.compute, &fleet.engine)?);
    }
    let mut cfg = RouterConfig::new(ps as usize);
    cfg.cost = fleet.cost;
    cfg.credit_in_flight = fleet.credit_in_flight;
    let mut router = Router::new(policy, infos, cfg);
    let total = source.total();
    let mut records: Vec<RequestRecord> = Vec::with_capacity(total);
    let mut instance_of = Vec::with_capacity(total);
    let mut decision_ns = Vec::with_capacity(total);
    let mut ready: Vec<Option<f64>> = vec![None; fleet.instances];
    let mut ingest = IngestCounts::default();
    let mut finished = Vec::new();
    let mut done = 0;
    let mut floor = floor::Floor::new(ps as usize);
    while !source.is_done() {
        let next_step = (0..ready.len())
            .filter_map(|i| ready[i].map(|t| (t, i)))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let arrival = source.next_send_time();
        match (arrival, next_step) {
            (Some(ta), step) if step.is_none_or(|(t, _)| ta <= t) => {
                let Some(sent) = source.pop_due(ta) else {
                    return Err(SimError::Cache(format!(
                        "the workload announced a request at {ta:.3} s and sent none"
                    )));
                };
                if sent.id as usize != records.len() {
                    return Err(SimError::Cache(format!(
                        "request ids out of order: {} after {}",
                        sent.id,
                        records.len()
                    )));
                }
                let tokens = convs[sent.conversation].prompt(sent.round);
                floor.arrive(tokens, &fleet.compute);
                let t0 = Instant::now();
                let d = router.route(
                    &index,
                    &RouteRequest {
                        request: sent.id,
                        tokens,
                        session: fleet.sessions.then_some(sent.conversation as u64),
                        lora: None,
                    },
                );
                decision_ns.push(t0.elapsed().as_nanos() as u64);
                let i = d.instance;
                records.push(RequestRecord::default());
                instance_of.push(i);
                instances[i].arrive(sent, convs, &mut records[sent.id as usize])?;
                ready[i] = Some(instances[i].sched.now());
                feed_events(&mut instances[i], &mut feeds[i], &mut index, &mut ingest)?;
            }
            (_, Some((t, i))) => {
                ready[i] = instances[i].step(t, convs, &mut records, &mut finished)?;
                feed_events(&mut instances[i], &mut feeds[i], &mut index, &mut ingest)?;
                // Finished requests first: the report after the step no longer counts them,
                // and a `finished` after it would take them off the fresh report again.
                for (sent, at) in finished.drain(..) {
                    source.complete(&sent, at);
                    router.finished(sent.id);
                    done += 1;
                    progress(done, total);
                }
                let inst = &instances[i].sched;
                router.report_load(
                    i,
                    LoadReport {
                        queued_prefill_tokens: inst.queued_prefill_tokens(convs) as u64,
                        requests: inst.requests() as u64,
                        running_tokens: inst.running_tokens() as u64,
                        prefetching_requests: inst.prefetching_requests() as u64,
                    },
                );
            }
            (_, None) => {
                return Err(SimError::Cache(format!(
                    "the fleet stalled: {} of {total} requests finished, none running, none due",
                    done
                )));
            }
        }
    }
    for inst in &mut instances {
        inst.shutdown()?;
    }
    let first = records
        .iter()
        .map(|r| r.arrival)
        .fold(f64::INFINITY, f64::min);
    let last = records.iter().map(|r| r.finished).fold(0.0, f64::max);
    Ok(FleetRun {
        policy: policy.name().to_string(),
        requests: records,
        instance_of,
        busy_s: instances.iter().map(|i| i.sched.busy_s()).collect(),
        decision_ns,
        floor_ttft_s: floor.ttft_s().to_vec(),
        router: router.stats(),
        ingest,
        index_holder_blocks: index.stats().holder_blocks,
        sim_seconds: if first.is_finite() { last - first } else { 0.0 },
        wall_seconds: wall.elapsed().as_secs_f64(),
    })
}

fn idx_err(e: hicache_index::IndexError) -> SimError {
    SimError::Cache(format!("index: {e}"))
}

fn feed_events(
    inst: &mut Instance,
    feed: &mut InstanceFeed,
    index: &mut Index,
    counts: &mut IngestCounts,
) -> Result<()> {
    for e in inst.cache.drain_kv_events() {
        feed.apply(index, &events::engine_event(&e), counts)
            .map_err(idx_err)?;
    }
    Ok(())
}

/// One policy's figures (what `hicache-bench fleet` prints).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// The policy.
    pub policy: String,
    /// Instances.
    pub instances: usize,
    /// Requests.
    pub requests: usize,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens served from L1.
    pub hit_tokens_l1: u64,
    /// From L2.
    pub hit_tokens_l2: u64,
    /// From L3.
    pub hit_tokens_l3: u64,
    /// Prompt tokens computed.
    pub recomputed_tokens: u64,
    /// Hits / prompt tokens.
    pub hit_ratio: f64,
    /// TTFT percentiles and mean (ms).
    pub ttft_p50_ms: f64,
    /// p90.
    pub ttft_p90_ms: f64,
    /// p99.
    pub ttft_p99_ms: f64,
    /// Mean.
    pub ttft_mean_ms: f64,
    /// Mean of the requests' no-queue floors ([`floor`]): no router's mean TTFT is lower.
    pub ttft_floor_mean_ms: f64,
    /// Requests per simulated second (first arrival to last finish).
    pub throughput_req_s: f64,
    /// Coefficient of variation of the instances' busy time.
    pub load_cov: f64,
    /// Requests each instance served.
    pub requests_per_instance: Vec<usize>,
    /// Index queries the router made.
    pub index_lookups: u64,
    /// Their mean time (µs).
    pub index_lookup_mean_us: f64,
    /// Router decision time p50 / p99 (µs; index query and cost).
    pub decision_p50_us: f64,
    /// p99.
    pub decision_p99_us: f64,
    /// Decisions that fell back to least-load.
    pub fallbacks: u64,
    /// Simulated seconds.
    pub sim_seconds: f64,
    /// Wall seconds.
    pub wall_seconds: f64,
}

/// The `q`-quantile (nearest rank) of sorted `v`; 0 when empty.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// The mean of `v`; 0 when empty.
fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Coefficient of variation (population); 0 for an empty or all-zero set.
pub fn cov(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    if mean == 0.0 {
        return 0.0;
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
    var.sqrt() / mean
}

impl FleetRun {
    /// The run's figures.
    pub fn summary(&self, instances: usize) -> Summary {
        let r = &self.requests;
        let sum = |f: fn(&RequestRecord) -> usize| r.iter().map(|x| f(x) as u64).sum::<u64>();
        let prompt = sum(|x| x.prompt_tokens);
        let (h1, h2, h3) = (sum(|x| x.hit_l1), sum(|x| x.hit_l2), sum(|x| x.hit_l3));
        let mut ttft: Vec<f64> = r.iter().map(|x| x.ttft() * 1e3).collect();
        ttft.sort_by(f64::total_cmp);
        let mut per = vec![0; instances];
        for &i in &self.instance_of {
            per[i] += 1;
        }
        let mut dec: Vec<f64> = self.decision_ns.iter().map(|&n| n as f64 / 1e3).collect();
        dec.sort_by(f64::total_cmp);
        Summary {
            policy: self.policy.clone(),
            instances,
            requests: r.len(),
            prompt_tokens: prompt,
            hit_tokens_l1: h1,
            hit_tokens_l2: h2,
            hit_tokens_l3: h3,
            recomputed_tokens: sum(|x| x.computed),
            hit_ratio: if prompt == 0 {
                0.0
            } else {
                (h1 + h2 + h3) as f64 / prompt as f64
            },
            ttft_p50_ms: quantile(&ttft, 0.5),
            ttft_p90_ms: quantile(&ttft, 0.9),
            ttft_p99_ms: quantile(&ttft, 0.99),
            ttft_mean_ms: mean(&ttft),
            ttft_floor_mean_ms: 1e3 * mean(&self.floor_ttft_s),
            throughput_req_s: if self.sim_seconds > 0.0 {
                r.len() as f64 / self.sim_seconds
            } else {
                0.0
            },
            load_cov: cov(&self.busy_s),
            requests_per_instance: per,
            index_lookups: self.router.index_queries,
            index_lookup_mean_us: if self.router.index_queries == 0 {
                0.0
            } else {
                self.router.index_query_ns as f64 / self.router.index_queries as f64 / 1e3
            },
            decision_p50_us: quantile(&dec, 0.5),
            decision_p99_us: quantile(&dec, 0.99),
            fallbacks: self.router.fallback_down + self.router.fallback_slow,
            sim_seconds: self.sim_seconds,
            wall_seconds: self.wall_seconds,
        }
    }
}
