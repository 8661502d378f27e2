//! The multi-turn planner: the main job's parameters ([`MultiturnArgs`], a `clap` argument
//! group an embedding binary flattens into its command line) validated into a [`Plan`] — the
//! conversations (a multi-turn chat workload like SGLang's `bench_multiturn.py`, a long-context
//! variant or a replayed trace), the simulated model and its costs, the scheduler settings, the
//! cache configuration and the tier sets to compare. [`Plan::run_with`] runs one configuration
//! through the engine.
//!
//! Bad input is [`SimError::Usage`] (exit code 2), found before anything runs.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, ValueEnum};
use hicache_core::{LayoutKind, PrefetchPolicy, StrategyKind, WritePolicy};
use hicache_gpu::IoBackend;
use hicache_storage::StorageConfig;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::cache::CacheUnderTest;
use crate::engine::{self, EngineConfig, RunResult};
use crate::error::{Result, SimError};
use crate::links::CopyTime;
use crate::model::{ComputeModel, HybridModel, ModelShape};
use crate::setup::{
    CacheSetup, DeviceKind, HostSize, ObserveSetup, Payload, StorageSetup, TieringMode, Tiers,
};
use crate::trace::{self, Conversation, LongContext, MultiTurn};
use crate::workload::{Arrivals, Distribution, ReadyPolicy, Workload};

/// Which tiers a single run uses.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum TiersArg {
    /// L1 only.
    #[value(name = "l1")]
    L1,
    /// L1 and L2.
    #[value(name = "l1+l2")]
    L1L2,
    /// L1, L2 and L3.
    #[value(name = "l1+l2+l3")]
    L1L2L3,
    /// L1 and L3, host memory only staging (`hicache_host_memory_mode = buffer_only`).
    #[value(name = "l1+l3-buffer-only")]
    L1L3BufferOnly,
    /// L1, L2 and L3, L3 written from the coldest L2 pages (`storage_write_mode = exclusive`).
    #[value(name = "l1+l2+l3-exclusive")]
    L1L2L3Exclusive,
}

impl TiersArg {
    fn tiers(self) -> Tiers {
        match self {
            TiersArg::L1 => Tiers::L1,
            TiersArg::L1L2 => Tiers::L1_L2,
            TiersArg::L1L2L3 => Tiers::L1_L2_L3,
            TiersArg::L1L3BufferOnly => Tiers::L1_L3_BUFFER_ONLY,
            TiersArg::L1L2L3Exclusive => Tiers::L1_L2_L3_EXCLUSIVE,
        }
    }
}

/// Whether `--compare` also runs `tiers` with copies free (the configurations with copies,
/// in the default L3 mode: the other modes are compared by their hits and bytes moved).
pub fn counterfactual_for(tiers: &Tiers) -> bool {
    tiers.host && tiers.mode == TieringMode::Inclusive
}

fn parse_layout(s: &str) -> std::result::Result<LayoutKind, String> {
    LayoutKind::ALL
        .into_iter()
        .find(|l| l.as_str() == s)
        .ok_or_else(|| format!("expected layer_first, page_first or page_first_direct, got {s:?}"))
}

/// Arguments of `multiturn`.
#[derive(Clone, Debug, Args)]
pub struct MultiturnArgs {
    // --- Workload -------------------------------------------------------------------------
    /// Conversations (clients).
    #[arg(long, default_value_t = 16, help_heading = "Workload")]
    pub clients: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 5, help_heading = "Workload")]
    pub rounds: usize,
    /// Tokens of the system prompt every conversation starts with.
    #[arg(long, default_value_t = 1024, help_heading = "Workload")]
    pub system_tokens: usize,
    /// Tokens of each user turn (bench_multiturn's --request-length).
    #[arg(long, default_value_t = 256, help_heading = "Workload")]
    pub user_tokens: usize,
    /// Tokens of each answer (bench_multiturn's --output-length).
    #[arg(long, default_value_t = 128, help_heading = "Workload")]
    pub answer_tokens: usize,
    /// Send attempts per second (`inf`: as fast as requests are ready).
    #[arg(long, default_value_t = 16.0, help_heading = "Workload")]
    pub request_rate: f64,
    /// Inter-arrival distribution.
    #[arg(long, value_enum, default_value = "poisson", help_heading = "Workload")]
    pub distribution: Distribution,
    /// Most requests in flight (the blog's canonical bench_multiturn run uses 4).
    #[arg(long, default_value_t = 4, help_heading = "Workload")]
    pub max_parallel: usize,
    /// Release round r+1 only after every request of round r finished.
    #[arg(long, help_heading = "Workload")]
    pub round_barrier: bool,
    /// Which ready request is sent first.
    #[arg(long, value_enum, default_value = "fifo", help_heading = "Workload")]
    pub ready_queue_policy: ReadyPolicy,
    /// Seed of tokens, arrivals and answers.
    #[arg(long, default_value_t = 1, help_heading = "Workload")]
    pub seed: u64,
    /// Token ids are drawn from [0, vocab).
    #[arg(long, default_value_t = 128_000, help_heading = "Workload")]
    pub vocab: u32,
    /// Long-context variant: a few long shared documents, many one-turn questions.
    #[arg(long, conflicts_with = "trace", help_heading = "Workload")]
    pub long_context: bool,
    /// Long context: documents.
    #[arg(long, default_value_t = 2, help_heading = "Workload")]
    pub documents: usize,
    /// Long context: tokens per document (the default fits the default L1 of 128 pages).
    #[arg(long, default_value_t = 6144, help_heading = "Workload")]
    pub document_tokens: usize,
    /// Long context: questions per document.
    #[arg(long, default_value_t = 16, help_heading = "Workload")]
    pub questions: usize,
    /// Long context: tokens per question.
    #[arg(long, default_value_t = 128, help_heading = "Workload")]
    pub question_tokens: usize,
    /// Replay this trace (the `tree --trace` JSON Lines format, optionally gzip) instead:
    /// one-turn requests in file order, each answered by --answer-tokens tokens.
    #[arg(long, help_heading = "Workload")]
    pub trace: Option<PathBuf>,

    // --- Cache ----------------------------------------------------------------------------
    /// L1 device.
    #[arg(long, value_enum, default_value = "sim", help_heading = "Cache")]
    pub device: DeviceKind,
    /// Tokens per page (page_size).
    #[arg(long, default_value_t = 64, help_heading = "Cache")]
    pub page_size: u32,
    /// L1 size in pages [default: 128].
    #[arg(long, conflicts_with = "device_gb", help_heading = "Cache")]
    pub device_pages: Option<usize>,
    /// L1 size in GB (1e9 bytes), rounded down to pages.
    #[arg(long, help_heading = "Cache")]
    pub device_gb: Option<f64>,
    /// L2 size as a multiple of L1 (hicache_ratio).
    #[arg(long, default_value_t = 2.0, help_heading = "Cache")]
    pub hicache_ratio: f64,
    /// L2 size in GB per rank (hicache_size); overrides --hicache-ratio.
    #[arg(long, help_heading = "Cache")]
    pub hicache_size: Option<f64>,
    /// write_through | write_through_selective | write_back (write_policy).
    #[arg(long, default_value = "write_through", help_heading = "Cache")]
    pub write_policy: WritePolicy,
    /// best_effort | wait_complete | timeout (storage_prefetch_policy). The simulation models
    /// prefetch time itself; wait_complete makes runs repeatable.
    #[arg(long, default_value = "wait_complete", help_heading = "Cache")]
    pub prefetch_policy: PrefetchPolicy,
    /// kernel | direct (io_backend).
    #[arg(long, default_value = "kernel", help_heading = "Cache")]
    pub io_backend: IoBackend,
    /// layer_first | page_first | page_first_direct (mem_layout).
    #[arg(long, default_value = "page_first", value_parser = parse_layout, help_heading = "Cache")]
    pub mem_layout: LayoutKind,
    /// Eviction strategy of the tree: lru, lfu, fifo, mru, filo, priority, slru, s3-fifo, sieve.
    #[arg(long, default_value = "lru", help_heading = "Cache")]
    pub eviction_policy: StrategyKind,
    /// L3 backend (storage_backend); `file` without a `dir` uses a fresh temporary directory.
    #[arg(long, default_value = "file", help_heading = "Cache")]
    pub storage_backend: String,
    /// L3 extra-config: a JSON object or @path to one (storage_backend_extra_config).
    #[arg(long, alias = "storage-backend-extra-config", help_heading = "Cache")]
    pub extra_config: Option<String>,
    /// Tiers of a single run.
    #[arg(long, value_enum, default_value = "l1+l2+l3", help_heading = "Cache")]
    pub tiers: TiersArg,
    /// Run L1 only, L1+L2, L1+L2+L3 and the two other L3 modes (buffer_only, exclusive) on
    /// the same workload and show them side by side (with the hybrid models' columns unless
    /// --no-hybrid).
    #[arg(long, help_heading = "Cache")]
    pub compare: bool,
    /// With --compare, skip the hybrid models (Qwen3.5-9B, Gemma 3 12B) run beside the dense
    /// model.
    #[arg(long, help_heading = "Cache")]
    pub no_hybrid: bool,
    /// With --compare, run only the hybrid models' tables (and the dense no-cache baseline,
    /// which the report keeps as its first column): the dense configurations are skipped.
    #[arg(
        long,
        help_heading = "Cache",
        requires = "compare",
        conflicts_with = "no_hybrid"
    )]
    pub only_hybrid: bool,
    /// Every run moves real bytes, also those whose figures do not depend on them (L1 only,
    /// the copies-free reruns of --compare, the hybrid models), which otherwise run without
    /// payload on the sim device (pages counted, never populated or copied). Slower; for
    /// checking that both give the same figures.
    #[arg(long, help_heading = "Cache")]
    pub all_bytes: bool,

    // --- Model --------------------------------------------------------------------------------
    /// Layers of the simulated model [default: 32, Llama-3-8B].
    #[arg(long, help_heading = "Model")]
    pub model_layers: Option<u32>,
    /// Query heads (attention FLOPs) [default: 32].
    #[arg(long, help_heading = "Model")]
    pub model_q_heads: Option<u32>,
    /// KV heads per rank (KV bytes) [default: 8].
    #[arg(long, help_heading = "Model")]
    pub model_kv_heads: Option<u32>,
    /// Elements per head [default: 128].
    #[arg(long, help_heading = "Model")]
    pub model_head_dim: Option<u32>,
    /// Parameters per rank in billions (weights FLOPs and bytes) [default: 8.03].
    #[arg(long, help_heading = "Model")]
    pub model_params_b: Option<f64>,

    // --- Engine and compute model -----------------------------------------------------------
    /// Most prompt tokens computed per prefill step (chunked prefill).
    #[arg(long, default_value_t = 16_384, help_heading = "Engine")]
    pub max_prefill_tokens: usize,
    /// Prefill time per token, excluding attention [default: 32.5 (Llama-3-8B on H100)].
    #[arg(long, help_heading = "Engine")]
    pub prefill_us_per_token: Option<f64>,
    /// Attention time per (query, key) pair; 0 drops the quadratic term [default: 1.06].
    #[arg(long, help_heading = "Engine")]
    pub attention_ns_per_pair: Option<f64>,
    /// Decode step time, weights only [default: 5.99].
    #[arg(long, help_heading = "Engine")]
    pub decode_ms_per_step: Option<f64>,
    /// Decode step time per context token of the batch [default: 48.9].
    #[arg(long, help_heading = "Engine")]
    pub decode_ns_per_context_token: Option<f64>,
    /// Fixed time per forward step.
    #[arg(long, default_value_t = 0.0, help_heading = "Engine")]
    pub step_overhead_ms: f64,
    /// L2→L1 bandwidth of the simulated device.
    #[arg(long, default_value_t = 50.0, help_heading = "Engine")]
    pub h2d_gbps: f64,
    /// L1→L2 bandwidth of the simulated device (write-through copies).
    #[arg(long, default_value_t = 50.0, help_heading = "Engine")]
    pub d2h_gbps: f64,
    /// L3↔L2 bandwidth of the simulated L3 (prefetch reads and backup writes share it).
    #[arg(long, default_value_t = 12.0, help_heading = "Engine")]
    pub l3_gbps: f64,
    /// charged: write-through copies and L3 backups take simulated time on their links and
    /// count only once complete; free: they cost nothing (the old upper-bound model).
    #[arg(long, value_enum, default_value = "charged", help_heading = "Engine")]
    pub copy_time: CopyTime,
    /// Latency of an L3 prefetch before its first byte.
    #[arg(long, default_value_t = 0.5, help_heading = "Engine")]
    pub l3_latency_ms: f64,

    // --- Output ------------------------------------------------------------------------------
    /// Directory for report.json and the plots [default: a new directory under the system
    /// temporary directory].
    #[arg(long, help_heading = "Output")]
    pub report_dir: Option<PathBuf>,
    /// One JSON object per figure instead of the table (no progress bar).
    #[arg(long, help_heading = "Output")]
    pub json: bool,
    /// No progress bar.
    #[arg(long, help_heading = "Output")]
    pub quiet: bool,
    /// Serve the cache's Prometheus metrics at http://ADDR/metrics while it runs (`IP:PORT`).
    #[arg(long, value_name = "ADDR", help_heading = "Output")]
    pub metrics_addr: Option<String>,
    /// Publish KV events on ZMQ while it runs: SGLang's `--kv-events-config` JSON, e.g.
    /// '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "topic": "kv"}'.
    #[arg(long, value_name = "JSON", help_heading = "Output")]
    pub kv_events: Option<String>,
    /// After the last run, keep its cache (its KV-event publisher and replay endpoint) open
    /// for up to SECONDS, so that an index registered after the run replays the run's whole
    /// stream; the wait ends as soon as a replay has sent a subscriber every batch. Needs
    /// --kv-events with a "replay_endpoint".
    #[arg(long, value_name = "SECONDS", help_heading = "Output")]
    pub kv_events_hold: Option<f64>,
}

#[derive(Parser)]
struct Standalone {
    #[command(flatten)]
    args: MultiturnArgs,
}

impl MultiturnArgs {
    /// Every default.
    pub fn defaults() -> Self {
        Standalone::parse_from(["multiturn"]).args
    }

    /// What `hicache-bench` runs with no subcommand: every default, with `--compare`.
    pub fn main_job() -> Self {
        Self {
            compare: true,
            ..Self::defaults()
        }
    }

    /// Parses `multiturn` arguments (without the program or subcommand name); clap errors
    /// (unknown flags, bad values) are returned, not printed.
    pub fn try_parse(args: &[&str]) -> std::result::Result<Self, clap::Error> {
        Standalone::try_parse_from(std::iter::once("multiturn").chain(args.iter().copied()))
            .map(|s| s.args)
    }
}

/// The workload's parameters, as recorded in the report.
#[derive(Clone, Debug, Serialize)]
pub struct WorkloadInfo {
    /// `multi_turn`, `long_context` or `trace`.
    pub kind: &'static str,
    /// Requests in total.
    pub requests: usize,
    /// Prompt tokens in total.
    pub prompt_tokens: usize,
    /// Longest prompt plus answer.
    pub longest_request_tokens: usize,
    /// The generator's or trace's parameters.
    pub params: Value,
    /// Release rules.
    pub arrivals: Arrivals,
}

/// Everything a run needs, validated.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The conversations.
    pub conversations: Vec<Conversation>,
    /// Their description.
    pub workload: WorkloadInfo,
    /// The simulated model.
    pub model: ModelShape,
    /// Its costs.
    pub compute: ComputeModel,
    /// Scheduler settings.
    pub engine: EngineConfig,
    /// The cache configuration (tiers set per run).
    pub setup: CacheSetup,
    /// Tier sets to run, in order.
    pub configurations: Vec<Tiers>,
    /// Where the report goes.
    pub report_dir: PathBuf,
}

fn usage(msg: impl Into<String>) -> SimError {
    SimError::Usage(msg.into())
}

fn positive(name: &str, v: f64) -> Result<f64> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(usage(format!("{name} must be a number > 0, got {v}")))
    }
}

fn non_negative(name: &str, v: f64) -> Result<f64> {
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(usage(format!("{name} must be a number ≥ 0, got {v}")))
    }
}

fn read_extra_config(arg: Option<&str>) -> Result<Map<String, Value>> {
    let Some(s) = arg.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok(Map::new());
    };
    let (text, name) = match s.strip_prefix('@') {
        Some(p) => (
            hicache_storage::read_config_file(std::path::Path::new(p))
                .map_err(|e| usage(format!("--extra-config: {e}")))?,
            p.to_string(),
        ),
        None => (s.to_string(), "--extra-config".to_string()),
    };
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(usage(format!(
            "{name}: the extra-config must be a JSON object, got {other}"
        ))),
        Err(e) => Err(usage(format!("{name}: not JSON: {e}"))),
    }
}

/// The longest `--kv-events-hold` (a day): the hold is for an operator watching one run.
pub const MAX_KV_EVENTS_HOLD: Duration = Duration::from_secs(24 * 3600);

/// `--kv-events-hold`, checked: a number of seconds in `0..=MAX_KV_EVENTS_HOLD`, with a ZMQ
/// publisher that serves replays (a subscriber arriving after the run gets the run's batches
/// through replay only).
fn kv_events_hold_of(args: &MultiturnArgs) -> Result<Option<Duration>> {
    let Some(secs) = args.kv_events_hold else {
        return Ok(None);
    };
    let hold = Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| *d <= MAX_KV_EVENTS_HOLD)
        .ok_or_else(|| {
            usage(format!(
                "--kv-events-hold must be a number of seconds from 0 to {}, got {secs}",
                MAX_KV_EVENTS_HOLD.as_secs()
            ))
        })?;
    let Some(json) = &args.kv_events else {
        return Err(usage(
            "--kv-events-hold needs --kv-events (a publisher to keep open)",
        ));
    };
    let cfg = hicache::observe::KvEventsConfig::from_json(json)
        .map_err(|e| usage(format!("--kv-events: {e}")))?;
    if cfg.publisher != "zmq" || cfg.replay_endpoint.is_none() {
        return Err(usage(
            "--kv-events-hold needs a ZMQ publisher with a \"replay_endpoint\" in --kv-events \
             (a subscriber that arrives after the run gets its batches through replay only)",
        ));
    }
    Ok(Some(hold))
}

fn default_report_dir() -> PathBuf {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    std::env::temp_dir().join(format!(
        "hicache-bench-multiturn-{stamp}-{}",
        std::process::id()
    ))
}

fn workload_of(args: &MultiturnArgs) -> Result<(Vec<Conversation>, &'static str, Value)> {
    if let Some(path) = &args.trace {
        let requests = trace::read_file(path)?;
        if requests.is_empty() {
            return Err(usage(format!(
                "{}: the trace has no requests",
                path.display()
            )));
        }
        let params = serde_json::json!({
            "trace": path.display().to_string(),
            "answer_tokens": args.answer_tokens,
        });
        return Ok((
            trace::conversations_of(requests, args.answer_tokens, args.vocab, args.seed),
            "trace",
            params,
        ));
    }
    if args.long_context {
        for (name, v) in [
            ("--documents", args.documents),
            ("--questions", args.questions),
            ("--document-tokens", args.document_tokens),
        ] {
            if v == 0 {
                return Err(usage(format!("{name} must be at least 1")));
            }
        }
        let g = LongContext {
            documents: args.documents,
            document_tokens: args.document_tokens,
            questions: args.questions,
            question_tokens: args.question_tokens,
            answer_tokens: args.answer_tokens,
            vocab: args.vocab,
            seed: args.seed,
        };
        let params = serde_json::json!({
            "documents": g.documents, "document_tokens": g.document_tokens,
            "questions": g.questions, "question_tokens": g.question_tokens,
            "answer_tokens": g.answer_tokens, "vocab": g.vocab, "seed": g.seed,
        });
        return Ok((g.conversations(), "long_context", params));
    }
    for (name, v) in [("--clients", args.clients), ("--rounds", args.rounds)] {
        if v == 0 {
            return Err(usage(format!("{name} must be at least 1")));
        }
    }
    if args.system_tokens + args.user_tokens == 0 {
        return Err(usage(
            "--system-tokens and --user-tokens are both 0: the first prompt would be empty",
        ));
    }
    let g = MultiTurn {
        clients: args.clients,
        rounds: args.rounds,
        system_tokens: args.system_tokens,
        user_tokens: args.user_tokens,
        answer_tokens: args.answer_tokens,
        vocab: args.vocab,
        seed: args.seed,
    };
    let params = serde_json::json!({
        "clients": g.clients, "rounds": g.rounds, "system_tokens": g.system_tokens,
        "user_tokens": g.user_tokens, "answer_tokens": g.answer_tokens, "vocab": g.vocab,
        "seed": g.seed,
    });
    Ok((g.conversations(), "multi_turn", params))
}

/// Llama-3-8B with the `--model-*` overrides.
fn model_of(args: &MultiturnArgs) -> Result<ModelShape> {
    let mut m = ModelShape::llama3_8b();
    let overrides = [
        ("--model-layers", args.model_layers, &mut m.layers),
        ("--model-q-heads", args.model_q_heads, &mut m.q_heads),
        ("--model-kv-heads", args.model_kv_heads, &mut m.kv_heads),
        ("--model-head-dim", args.model_head_dim, &mut m.head_dim),
    ];
    let mut custom = args.model_params_b.is_some();
    for (name, v, field) in overrides {
        if let Some(v) = v {
            if v == 0 {
                return Err(usage(format!("{name} must be at least 1")));
            }
            *field = v;
            custom = true;
        }
    }
    if let Some(b) = args.model_params_b {
        m.params = positive("--model-params-b", b)? * 1e9;
    }
    if custom {
        m.name = format!(
            "custom model ({} layers, {} q / {} kv heads of {}, {:.2} B params)",
            m.layers,
            m.q_heads,
            m.kv_heads,
            m.head_dim,
            m.params / 1e9
        );
    }
    Ok(m)
}

/// The release rules of `--request-rate`, `--max-parallel` and the rest, validated.
fn arrivals_of(args: &MultiturnArgs) -> Result<Arrivals> {
    if args.request_rate.is_nan() || args.request_rate <= 0.0 {
        return Err(usage(format!(
            "--request-rate must be > 0 (or inf), got {}",
            args.request_rate
        )));
    }
    if args.max_parallel == 0 {
        return Err(usage("--max-parallel must be at least 1"));
    }
    Ok(Arrivals {
        distribution: args.distribution,
        rate: args.request_rate,
        max_parallel: args.max_parallel,
        round_barrier: args.round_barrier,
        ready_policy: args.ready_queue_policy,
        seed: args.seed,
    })
}

/// The workload's counts (requests, prompt tokens, longest request); an empty prompt is an
/// error.
fn describe(
    conversations: &[Conversation],
    kind: &'static str,
    params: Value,
    arrivals: Arrivals,
) -> Result<WorkloadInfo> {
    let mut info = WorkloadInfo {
        kind,
        requests: 0,
        prompt_tokens: 0,
        longest_request_tokens: 0,
        params,
        arrivals,
    };
    for c in conversations {
        for (round, t) in c.turns.iter().enumerate() {
            if t.prompt_end == 0 {
                return Err(usage(format!(
                    "request {} round {round}: empty prompt",
                    c.id
                )));
            }
            info.requests += 1;
            info.prompt_tokens += t.prompt_end;
            info.longest_request_tokens = info.longest_request_tokens.max(t.answer_end);
        }
    }
    Ok(info)
}

/// `--page-size`, which must fit the longest request.
fn page_size_of(args: &MultiturnArgs, longest: usize) -> Result<usize> {
    let ps = args.page_size as usize;
    if ps == 0 || ps > 65_536 {
        return Err(usage(format!(
            "--page-size must be between 1 and 65536, got {ps}"
        )));
    }
    if ps > longest {
        return Err(usage(format!(
            "--page-size {ps} is larger than the longest request ({longest} tokens of prompt and \
             answer): no page could ever be cached"
        )));
    }
    Ok(ps)
}

/// L1 pages from `--device-pages` or `--device-gb` (default 128), enough for the longest
/// request.
fn device_pages_of(
    args: &MultiturnArgs,
    page_bytes: u64,
    ps: usize,
    longest: usize,
) -> Result<usize> {
    let device_pages = match (args.device_pages, args.device_gb) {
        (Some(p), _) => p,
        (None, Some(gb)) => (positive("--device-gb", gb)? * 1e9 / page_bytes as f64) as usize,
        (None, None) => 128,
    };
    let need = longest.div_ceil(ps);
    if device_pages < need {
        return Err(usage(format!(
            "L1 holds {device_pages} pages of {ps} tokens but the longest request needs {need} \
             ({longest} tokens of prompt and answer); raise --device-pages or --device-gb"
        )));
    }
    Ok(device_pages)
}

/// The tier sets to run: every one with `--compare`, else `--tiers`.
fn configurations_of(args: &MultiturnArgs) -> Vec<Tiers> {
    if args.compare {
        vec![
            Tiers::L1,
            Tiers::L1_L2,
            Tiers::L1_L2_L3,
            Tiers::L1_L3_BUFFER_ONLY,
            Tiers::L1_L2_L3_EXCLUSIVE,
        ]
    } else {
        vec![args.tiers.tiers()]
    }
}

/// The L3 backend and its extra-config, parsed strictly now when a configuration uses L3 so
/// that a typo fails before any run.
fn storage_of(args: &MultiturnArgs, configurations: &[Tiers]) -> Result<StorageSetup> {
    let extra_config = read_extra_config(args.extra_config.as_deref())?;
    if args.storage_backend.trim().is_empty() {
        return Err(usage("--storage-backend must name a backend"));
    }
    if configurations.iter().any(|t| t.storage) {
        StorageConfig::from_value(
            Some(&args.storage_backend),
            Value::Object(extra_config.clone()),
            "--extra-config",
        )?;
    }
    Ok(StorageSetup {
        backend: args.storage_backend.clone(),
        extra_config,
    })
}

/// The H100 costs of `model` with the `--*-per-*`, link and latency overrides.
fn compute_of(args: &MultiturnArgs, model: &ModelShape) -> Result<ComputeModel> {
    let mut compute = ComputeModel::h100(model);
    if let Some(v) = args.prefill_us_per_token {
        compute.prefill_s_per_token = non_negative("--prefill-us-per-token", v)? * 1e-6;
    }
    if let Some(v) = args.attention_ns_per_pair {
        compute.attention_s_per_pair = non_negative("--attention-ns-per-pair", v)? * 1e-9;
    }
    if let Some(v) = args.decode_ms_per_step {
        compute.decode_s_per_step = non_negative("--decode-ms-per-step", v)? * 1e-3;
    }
    if let Some(v) = args.decode_ns_per_context_token {
        compute.decode_s_per_context_token =
            non_negative("--decode-ns-per-context-token", v)? * 1e-9;
    }
    compute.step_overhead_s = non_negative("--step-overhead-ms", args.step_overhead_ms)? * 1e-3;
    compute.h2d_bytes_per_s = positive("--h2d-gbps", args.h2d_gbps)? * 1e9;
    compute.d2h_bytes_per_s = positive("--d2h-gbps", args.d2h_gbps)? * 1e9;
    compute.l3_bytes_per_s = positive("--l3-gbps", args.l3_gbps)? * 1e9;
    compute.l3_latency_s = non_negative("--l3-latency-ms", args.l3_latency_ms)? * 1e-3;
    Ok(compute)
}

/// Validates the arguments into a [`Plan`] (bad input: [`SimError::Usage`], exit code 2).
pub fn plan(args: &MultiturnArgs) -> Result<Plan> {
    if args.vocab == 0 {
        return Err(usage("--vocab must be at least 1"));
    }
    let arrivals = arrivals_of(args)?;
    let (conversations, kind, params) = workload_of(args)?;
    let workload = describe(&conversations, kind, params, arrivals)?;
    let longest = workload.longest_request_tokens;
    let ps = page_size_of(args, longest)?;
    let model = model_of(args)?;
    let kv_shape = model.kv_shape(args.page_size);
    kv_shape.validate()?;
    let page_bytes = kv_shape.page_bytes() as u64;
    let device_pages = device_pages_of(args, page_bytes, ps, longest)?;
    let host_size = match args.hicache_size {
        Some(gb) => HostSize::Gigabytes(positive("--hicache-size", gb)?),
        None => HostSize::Ratio(positive("--hicache-ratio", args.hicache_ratio)?),
    };
    let configurations = configurations_of(args);
    let storage = storage_of(args, &configurations)?;
    let compute = compute_of(args, &model)?;
    if args.max_prefill_tokens == 0 {
        return Err(usage("--max-prefill-tokens must be at least 1"));
    }
    Ok(Plan {
        workload,
        conversations,
        engine: EngineConfig {
            max_prefill_tokens: args.max_prefill_tokens,
            copy_time: args.copy_time,
            layers: model.layers,
            page_bytes,
            wall_wait_limit: Duration::from_secs(120),
        },
        model,
        compute,
        setup: CacheSetup {
            device: args.device,
            kv_shape,
            device_pages,
            host_size,
            write_policy: args.write_policy,
            prefetch_policy: args.prefetch_policy,
            io_backend: args.io_backend,
            mem_layout: args.mem_layout,
            eviction_policy: args.eviction_policy,
            storage,
            tiers: configurations[0],
            scratch_dir: None,
            observe: ObserveSetup {
                metrics_addr: args.metrics_addr.clone(),
                kv_events: args.kv_events.clone(),
                kv_events_hold: kv_events_hold_of(args)?,
            },
            payload: Payload::Bytes,
        },
        configurations,
        report_dir: args.report_dir.clone().unwrap_or_else(default_report_dir),
    })
}

impl Plan {
    /// One line describing the workload and the cache.
    pub fn title(&self) -> String {
        let w = &self.workload;
        let p = &w.params;
        let shape = match w.kind {
            "multi_turn" => format!(
                "{} clients × {} rounds (system {}, user {}, answer {} tokens)",
                p["clients"], p["rounds"], p["system_tokens"], p["user_tokens"], p["answer_tokens"]
            ),
            "long_context" => format!(
                "long context: {} documents of {} tokens × {} questions",
                p["documents"], p["document_tokens"], p["questions"]
            ),
            _ => format!("trace {}", p["trace"]),
        };
        let s = &self.setup;
        let page_mib = self.engine.page_bytes as f64 / (1 << 20) as f64;
        let host = match s.host_size {
            HostSize::Ratio(r) => format!("L2 {r}× L1"),
            HostSize::Gigabytes(g) => format!("L2 {g} GB"),
        };
        format!(
            "multiturn: {shape}, {} requests, {:?} {} req/s; {} page {} ({page_mib:.1} MiB); L1 {} \
             pages ({:.2} GB), {host}, L3 {}; {:?} device",
            w.requests,
            w.arrivals.distribution,
            w.arrivals.rate,
            self.model.name,
            s.kv_shape.page_size,
            s.device_pages,
            s.device_pages as f64 * self.engine.page_bytes as f64 / 1e9,
            s.storage.backend,
            s.device,
        ) + &emulated_note(s.device)
    }

    /// This plan for the hybrid model `model` on the same node, workload, cache settings and
    /// tiers: its costs ([`HybridModel::compute_h100`] with this plan's link figures), its
    /// layers, and a page of its Full and SWA KV as the engine's page (what a page hit
    /// loads and a prefetch reads).
    pub fn for_hybrid(&self, model: &HybridModel) -> Plan {
        let ps = self.setup.kv_shape.page_size;
        let full = model.full_kv_shape(ps);
        let swa = model.swa_kv_shape(ps).map_or(0, |s| s.page_bytes());
        let mut p = self.clone();
        p.compute = model.compute_h100().with_node_of(&self.compute);
        p.engine.layers = model.layers;
        p.engine.page_bytes = (full.page_bytes() + swa) as u64;
        p.setup.kv_shape = full;
        p
    }

    /// Runs the workload once through `cache` with the plan's scheduler settings;
    /// `progress` gets the number of requests finished so far.
    pub fn run_one(
        &self,
        cache: &mut dyn CacheUnderTest,
        progress: &mut dyn FnMut(usize),
    ) -> Result<RunResult> {
        self.run_with(cache, progress, &self.engine)
    }

    /// Runs the workload once through `cache` with the scheduler settings `engine_cfg` (the
    /// copies-free counterfactual runs the plan with [`CopyTime::Free`]).
    pub fn run_with(
        &self,
        cache: &mut dyn CacheUnderTest,
        progress: &mut dyn FnMut(usize),
        engine_cfg: &EngineConfig,
    ) -> Result<RunResult> {
        let mut workload =
            Workload::new(self.conversations.clone(), self.workload.arrivals.clone())
                .map_err(usage)?;
        engine::run(
            &mut workload,
            cache,
            &self.compute,
            engine_cfg,
            &mut |done, _| progress(done),
        )
    }
}

/// `setup` with a fresh, empty L3 directory for the file backend unless the user named one
/// (removed when the returned guard drops).
pub fn scratch_l3(setup: &CacheSetup) -> Result<(Option<tempfile::TempDir>, CacheSetup)> {
    let mut setup = setup.clone();
    if !(setup.tiers.storage
        && setup.storage.backend == "file"
        && !setup.storage.extra_config.contains_key("dir"))
    {
        return Ok((None, setup));
    }
    let dir = tempfile::Builder::new()
        .prefix("hicache-bench-l3-")
        .tempdir()
        .map_err(SimError::io(std::env::temp_dir()))?;
    setup.storage.extra_config.insert(
        "dir".into(),
        Value::String(dir.path().display().to_string()),
    );
    setup.scratch_dir = Some(dir.path().to_path_buf());
    Ok((Some(dir), setup))
}

/// A note for the header when the CUDA device is the emulated driver (`hicache-cuda-emu`):
/// its bytes per second are CPU copies, never GPU speed.
fn emulated_note(device: DeviceKind) -> String {
    let emulated = device == DeviceKind::Cuda
        && hicache_gpu::Device::cuda(0).is_ok_and(|d| crate::setup::is_emulated(&d));
    if emulated {
        " (EMULATED CUDA driver hicache-cuda-emu: GB/s are CPU copies, not GPU speed)".into()
    } else {
        String::new()
    }
}
