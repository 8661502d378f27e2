//! `hicache-bench tree`: replays a request trace through the HiRadixTree.
//!
//! Replay rule (normative; it reproduces SGLang's `RadixCache` request by request): page size
//! P, capacity C pages or unlimited; key = tokens truncated to whole pages (n pages). Per
//! request: (1) n = 0 ⇒ a miss, nothing else; (2) m = match(key) (splits on a partial match);
//! (3) lock the matched node and its ancestors; (4) need = n − m; if need > 0 and free < need,
//! evict(need − free) (whole leaves, oldest stamp first, so more may go); (5) if still free <
//! need, a skipped insert; otherwise allocate need pages and insert(key) — also when need = 0,
//! which re-stamps the path; (6) unlock. Free pages = C − pages held by the tree. The tree's
//! logical clock ticks once per match and once per insert.
//!
//! With `--components full[,swa|,mamba]` the replay runs through the unified tree
//! ([`hicache_core::UnifiedTree`]) under SGLang's scheduler protocol instead, and `--log`
//! writes the issue-26 format: see the [`hybrid`] module.
//!
//! Timing: requests/s is measured on replays without per-phase timers (the trace is parsed
//! before the clock starts), repeated for at least `--min-time-ms` and reported as the median
//! (and the best). Each timed replay starts from the same tree flushed with `reset()` outside
//! the clock, as a long-running cache is flushed, so that it measures the tree rather than the
//! kernel faulting fresh pages into a new heap. Per-phase times come from one separate replay
//! with timers, under the same conditions. The
//! reference is the rate of a loop that only compares each request's key with a copy of it
//! (the memory traffic any matcher must pay), measured in the same run.

use std::fmt;
use std::hint::black_box;
use std::io::Write;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, Instant};

use clap::Args;
use hicache_core::{
    DeviceSlot, HiRadixTree, InsertOptions, NoHost, NodeId, PageHasher, StrategyKind, TenantId,
    TreeConfig, UnifiedConfig,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{BenchError, Result};
use crate::record::Record;
use hicache_sim::trace::{self, MultiTurn, Request};

pub mod hybrid;
pub mod hybrid_host;

/// A capacity on the command line: `unlimited`, a number of pages, or a percentage of the
/// unique pages of the trace (`25%`).
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Capacity {
    /// No limit.
    Unlimited,
    /// A number of pages.
    Pages(usize),
    /// A share of the trace's unique pages.
    Percent(f64),
}

impl FromStr for Capacity {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        if s == "unlimited" {
            return Ok(Capacity::Unlimited);
        }
        if let Some(p) = s.strip_suffix('%') {
            let v: f64 = p
                .parse()
                .map_err(|_| format!("bad percentage {s:?}: expected e.g. 25%"))?;
            if !(v > 0.0 && v.is_finite()) {
                return Err(format!("bad percentage {s:?}: must be > 0"));
            }
            return Ok(Capacity::Percent(v));
        }
        s.parse::<usize>()
            .map(Capacity::Pages)
            .map_err(|_| format!("bad capacity {s:?}: expected unlimited, N pages or P%"))
    }
}

impl fmt::Display for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Capacity::Unlimited => f.write_str("unlimited"),
            Capacity::Pages(n) => write!(f, "{n}"),
            Capacity::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// Arguments of `tree`.
#[derive(Debug, Args)]
pub struct TreeArgs {
    /// Trace file (JSON Lines, optionally gzip). Without it a multi-turn trace is generated.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    pub page_size: u32,
    /// Capacities to replay at, comma-separated: `unlimited`, pages, or `P%` of the unique
    /// pages of the trace.
    #[arg(
        long = "capacity-pages",
        value_delimiter = ',',
        default_value = "unlimited,25%"
    )]
    pub capacity: Vec<Capacity>,
    /// Eviction strategy (lru, lfu, fifo, mru, filo, priority, slru, s3-fifo, sieve).
    #[arg(long, default_value = "lru")]
    pub policy: String,
    /// Write one line per request (tab-separated, with a header) to this file. Needs exactly
    /// one capacity.
    #[arg(long)]
    pub log: Option<PathBuf>,
    /// Print one JSON object per measured case instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Seed of the generated trace.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Generated trace: conversations.
    #[arg(long, default_value_t = 32)]
    pub clients: usize,
    /// Generated trace: rounds per conversation.
    #[arg(long, default_value_t = 8)]
    pub rounds: usize,
    /// Generated trace: tokens of the shared system prompt.
    #[arg(long, default_value_t = 1024)]
    pub system_tokens: usize,
    /// Generated trace: tokens per user turn.
    #[arg(long, default_value_t = 512)]
    pub user_tokens: usize,
    /// Generated trace: tokens per answer.
    #[arg(long, default_value_t = 256)]
    pub answer_tokens: usize,
    /// Write the trace used (generated or read) to this file as JSON Lines.
    #[arg(long)]
    pub write_trace: Option<PathBuf>,
    /// Repeat the timed replay for at least this long.
    #[arg(long, default_value_t = 1000)]
    pub min_time_ms: u64,
    /// Also measure single `match_prefix` latency in a tree of this many cached pages
    /// (0: skip; the main job uses 1048576).
    #[arg(long, default_value_t = 0)]
    pub big_tree_pages: usize,
    /// Key length of the big-tree lookups, in tokens.
    #[arg(long, default_value_t = 16384)]
    pub big_key_tokens: usize,
    /// Compute a SHA-256 page hash for every inserted page (as with L3 or KV events on).
    #[arg(long)]
    pub hashing: bool,
    /// Replay through the unified tree with these components (`full`, `full,swa`,
    /// `full,mamba`, `full,swa,mamba`) under SGLang's scheduler protocol (see
    /// `tree/hybrid.rs`); needs one `--capacity-pages` value (pages or `unlimited`).
    #[arg(long)]
    pub components: Option<String>,
    /// SWA window in tokens (with `--components full,swa` or `full,swa,mamba`).
    #[arg(long)]
    pub swa_window: Option<u32>,
    /// SWA pool in pages (default: `--capacity-pages`).
    #[arg(long)]
    pub swa_capacity_pages: Option<u64>,
    /// Mamba chunk in tokens (the model's `mamba_chunk_size`; the cache chunk is
    /// `max(chunk, page size)`).
    #[arg(long, default_value_t = 64)]
    pub mamba_chunk: u32,
    /// Mamba state slots (default: `--capacity-pages`).
    #[arg(long)]
    pub mamba_slots: Option<u32>,
    /// With `--components`: a host tier of this many Full pages (write-through backups,
    /// load-backs of host hits; see `tree/hybrid_host.rs`). The log gains the columns
    /// `host_hit`, `ev_host_full` and `ev_host_aux`.
    #[arg(long)]
    pub host_capacity_pages: Option<u64>,
    /// Host SWA pages (default: `--host-capacity-pages`).
    #[arg(long)]
    pub swa_host_capacity_pages: Option<u64>,
    /// Host Mamba states (default: `--host-capacity-pages`).
    #[arg(long)]
    pub host_mamba_slots: Option<u64>,
}

/// Per-request outcome (the `--log` line).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestOutcome {
    /// Tokens of the page-aligned key.
    pub key_tokens: usize,
    /// Tokens matched on device.
    pub hit_tokens: usize,
    /// Tokens evicted while serving this request.
    pub evicted_tokens: usize,
    /// Whether the insert was skipped for lack of room.
    pub skipped: bool,
}

/// Totals of one replay.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Totals {
    /// Requests replayed.
    pub requests: usize,
    /// Σ key tokens.
    pub key_tokens: usize,
    /// Σ hit tokens.
    pub hit_tokens: usize,
    /// Skipped inserts.
    pub skipped: usize,
    /// Σ evicted tokens.
    pub evicted_tokens: usize,
    /// Time in match + lock.
    pub match_time: Duration,
    /// Time in allocation + insert + unlock.
    pub insert_time: Duration,
    /// Time in eviction.
    pub evict_time: Duration,
}

impl Totals {
    /// `hit_tokens / key_tokens`.
    pub fn hit_ratio(&self) -> f64 {
        if self.key_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.key_tokens as f64
        }
    }
}

/// Replays `trace` under the replay rule on a fresh tree. With `TIMED`, phases are timed;
/// with `log`, every request's outcome is recorded. Returns the totals and the final tree.
pub fn replay<const TIMED: bool>(
    trace: &[Request],
    page_size: u32,
    capacity: Option<usize>,
    kind: StrategyKind,
    log: Option<&mut Vec<RequestOutcome>>,
) -> Result<(Totals, HiRadixTree)> {
    let cfg = TreeConfig {
        eviction: kind,
        ..TreeConfig::new(page_size)
    };
    replay_with::<TIMED>(trace, cfg, capacity, log)
}

/// [`replay`] on a fresh tree of the given configuration.
pub fn replay_with<const TIMED: bool>(
    trace: &[Request],
    cfg: TreeConfig,
    capacity: Option<usize>,
    log: Option<&mut Vec<RequestOutcome>>,
) -> Result<(Totals, HiRadixTree)> {
    let mut tree = HiRadixTree::new(cfg)?;
    let totals = replay_into::<TIMED>(&mut tree, trace, capacity, log)?;
    Ok((totals, tree))
}

/// Replays `trace` on `tree`, which must hold no pages (fresh, or flushed with `reset`).
pub fn replay_into<const TIMED: bool>(
    tree: &mut HiRadixTree,
    trace: &[Request],
    capacity: Option<usize>,
    mut log: Option<&mut Vec<RequestOutcome>>,
) -> Result<Totals> {
    if tree.device_pages() != 0 || tree.host_pages() != 0 {
        return Err(BenchError::check_failed("replay needs an empty tree"));
    }
    let ps = tree.page_size() as usize;
    let t = TenantId::DEFAULT;
    let mut totals = Totals::default();
    let mut free_slots: Vec<DeviceSlot> = match capacity {
        Some(c) => (0..c as u32).rev().map(DeviceSlot).collect(),
        None => Vec::new(),
    };
    let mut next_slot = 0u32;
    let now = || if TIMED { Some(Instant::now()) } else { None };
    let since = |a: Option<Instant>, b: Option<Instant>| match (a, b) {
        (Some(a), Some(b)) => b - a,
        _ => Duration::ZERO,
    };
    for req in trace {
        totals.requests += 1;
        let n = req.tokens.len() / ps;
        let mut outcome = RequestOutcome {
            key_tokens: n * ps,
            ..Default::default()
        };
        if n > 0 {
            let key = &req.tokens[..n * ps];
            let t0 = now();
            let m = tree.match_prefix(t, key)?;
            let locked: NodeId = m.last_device_node;
            tree.lock(locked)?;
            let t1 = now();
            let have = m.device_slots.len();
            let need = n - have;
            outcome.hit_tokens = have * ps;
            if let Some(cap) = capacity {
                let free = cap - tree.device_pages();
                if need > 0 && free < need {
                    let out = tree.evict(need - free, &mut NoHost);
                    outcome.evicted_tokens = out.freed_pages * ps;
                    free_slots.extend_from_slice(&out.device_slots);
                }
            }
            let t2 = now();
            let room = capacity.is_none_or(|cap| cap - tree.device_pages() >= need);
            if room {
                let mut slots = m.device_slots;
                if capacity.is_some() {
                    let at = free_slots.len() - need;
                    slots.extend(free_slots.drain(at..));
                } else {
                    slots.extend((next_slot..next_slot + need as u32).map(DeviceSlot));
                    next_slot += need as u32;
                }
                let r = tree.insert(t, key, &slots, InsertOptions::default())?;
                if r.prefix_pages != have {
                    return Err(BenchError::check_failed(format!(
                        "request {}: insert found {} cached pages, match found {have}",
                        req.id, r.prefix_pages
                    )));
                }
            } else {
                outcome.skipped = true;
            }
            tree.unlock(locked)?;
            let t3 = now();
            totals.match_time += since(t0, t1);
            totals.evict_time += since(t1, t2);
            totals.insert_time += since(t2, t3);
        }
        totals.key_tokens += outcome.key_tokens;
        totals.hit_tokens += outcome.hit_tokens;
        totals.evicted_tokens += outcome.evicted_tokens;
        totals.skipped += usize::from(outcome.skipped);
        if let Some(l) = log.as_deref_mut() {
            l.push(outcome);
        }
    }
    Ok(totals)
}

/// The reference loop: compares each request's page-aligned key with a copy of it.
fn scan_rate(trace: &[Request], copy: &[Request], ps: usize, min_time: Duration) -> f64 {
    let mut rates = Vec::new();
    let start = Instant::now();
    while rates.len() < 3 || (start.elapsed() < min_time && rates.len() < 100_000) {
        let t0 = Instant::now();
        let mut equal = 0usize;
        for (a, b) in trace.iter().zip(copy) {
            let n = a.tokens.len() / ps * ps;
            equal += usize::from(black_box(&a.tokens[..n]) == black_box(&b.tokens[..n]));
        }
        black_box(equal);
        rates.push(trace.len() as f64 / t0.elapsed().as_secs_f64());
    }
    median(&mut rates)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One measured capacity.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// The capacity in pages (`None`: unlimited).
    pub capacity: Option<usize>,
    /// Median requests/s of the untimed replays.
    pub req_per_s: f64,
    /// Best requests/s of the untimed replays (least disturbed by other processes).
    pub best_req_per_s: f64,
    /// Replays measured.
    pub reps: usize,
    /// Totals of the timed replay.
    pub totals: Totals,
    /// Pages in the tree at the end.
    pub cached_pages: usize,
    /// Tree metadata and token bytes at the end.
    pub memory: (usize, usize),
}

/// Measures one capacity.
pub fn measure(
    trace: &[Request],
    cfg: &TreeConfig,
    capacity: Option<usize>,
    min_time: Duration,
) -> Result<CaseResult> {
    // Warm-up on a fresh tree, then the per-phase figures on the flushed tree (the same
    // conditions as the timed replays below).
    let (_, mut tree) = replay_with::<false>(trace, cfg.clone(), capacity, None)?;
    tree.reset();
    let totals = replay_into::<true>(&mut tree, trace, capacity, None)?;
    let cached_pages = tree.device_pages();
    let memory = tree.memory_bytes();
    let mut rates = Vec::new();
    let start = Instant::now();
    while rates.len() < 3 || (start.elapsed() < min_time && rates.len() < 100_000) {
        // Flushed as a long-running cache is (outside the clock), so that the replay measures
        // the tree, not the kernel handing fresh pages to a new heap.
        tree.reset();
        let t0 = Instant::now();
        let again = replay_into::<false>(&mut tree, trace, capacity, None)?;
        let dt = t0.elapsed();
        if (again.hit_tokens, again.skipped, again.evicted_tokens)
            != (totals.hit_tokens, totals.skipped, totals.evicted_tokens)
        {
            return Err(BenchError::check_failed(
                "two replays of the same trace disagree",
            ));
        }
        rates.push(trace.len() as f64 / dt.as_secs_f64());
    }
    let reps = rates.len();
    let best = rates.iter().copied().fold(0.0, f64::max);
    Ok(CaseResult {
        capacity,
        best_req_per_s: best,
        req_per_s: median(&mut rates),
        reps,
        totals,
        cached_pages,
        memory,
    })
}

/// Result of the big-tree lookup case.
#[derive(Clone, Debug)]
pub struct BigTreeResult {
    /// Pages cached.
    pub pages: usize,
    /// Nodes.
    pub nodes: usize,
    /// Keys inserted.
    pub keys: usize,
    /// Lookups measured.
    pub lookups: usize,
    /// Median, p99 and mean latency of one `match_prefix`, in µs.
    pub match_us: (f64, f64, f64),
    /// Median latency of comparing the key with a copy, in µs (reference).
    pub memcmp_us: f64,
    /// Mean nodes on a lookup path.
    pub mean_depth: f64,
    /// Tree metadata and token bytes.
    pub memory: (usize, usize),
}

/// Builds a tree of about `pages` pages from keys of `key_tokens` tokens, each sharing a
/// random-length prefix with a random earlier key (a random trie, as conversations branch),
/// then times `match_prefix` of random full keys, each in cold order: the keys are sampled while
/// the tree is built (a reservoir, so no walk of the tree warms the looked-up nodes before they
/// are timed) and the mean depth is measured after the timed lookups.
pub fn big_tree(pages: usize, ps: u32, key_tokens: usize, seed: u64) -> Result<BigTreeResult> {
    let key_pages = (key_tokens / ps as usize).max(1);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut built = BigTree::build(pages, ps, key_pages, &mut rng)?;
    let lookups = Lookups::draw(&built, &mut rng);
    let mut lat = lookups.time_matches(&mut built.tree, key_pages)?;
    let memcmp_us = lookups.time_reference(&mut rng)?;
    // Depth after the timed lookups, so that these walks warm nothing that was measured.
    let mut depth = 0usize;
    let mut walked = Vec::new();
    for &n in &lookups.nodes {
        walked.clear();
        depth += path_into(&built.tree, n, &mut walked)?;
    }
    let n = lookups.queries.len();
    let mean = lat.iter().sum::<f64>() / lat.len() as f64;
    lat.sort_by(f64::total_cmp);
    let p99 = lat[(lat.len() * 99 / 100).min(lat.len() - 1)];
    Ok(BigTreeResult {
        pages: built.tree.device_pages(),
        nodes: built.tree.stats().nodes,
        keys: built.leaves,
        lookups: n,
        match_us: (lat[lat.len() / 2], p99, mean),
        memcmp_us,
        mean_depth: depth as f64 / n as f64,
        memory: built.tree.memory_bytes(),
    })
}

/// Lookups drawn from a big tree: at most this many.
const MAX_LOOKUPS: usize = 1000;

/// The big tree and a uniform sample of up to [`MAX_LOOKUPS`] inserted keys (reservoir
/// sampling), kept as the caller of a lookup would hold them: copies that never came from
/// walking the tree.
struct BigTree {
    tree: HiRadixTree,
    leaves: usize,
    sample: Vec<(NodeId, Vec<u32>)>,
}

impl BigTree {
    /// Inserts keys of `key_pages` pages, each sharing a random-length prefix with a random
    /// earlier key, until the tree holds `pages` pages.
    fn build(pages: usize, ps: u32, key_pages: usize, rng: &mut ChaCha8Rng) -> Result<Self> {
        let psz = ps as usize;
        let mut tree = HiRadixTree::new(TreeConfig::new(ps))?;
        let t = TenantId::DEFAULT;
        let mut leaves: Vec<NodeId> = Vec::new();
        let mut sample: Vec<(NodeId, Vec<u32>)> = Vec::with_capacity(MAX_LOOKUPS);
        let mut next_slot = 0u32;
        let mut key = Vec::with_capacity(key_pages * psz);
        while tree.device_pages() < pages {
            key.clear();
            if !leaves.is_empty() {
                let parent = leaves[rng.random_range(0..leaves.len())];
                let shared = rng.random_range(0..key_pages);
                path_into(&tree, parent, &mut key)?;
                key.truncate(shared * psz);
            }
            while key.len() < key_pages * psz {
                key.push(rng.random_range(0..128_000));
            }
            let slots: Vec<DeviceSlot> = (next_slot..next_slot + key_pages as u32)
                .map(DeviceSlot)
                .collect();
            next_slot += key_pages as u32;
            let r = tree.insert(t, &key, &slots, InsertOptions::default())?;
            leaves.push(r.last_node);
            if sample.len() < MAX_LOOKUPS {
                sample.push((r.last_node, key.clone()));
            } else {
                let j = rng.random_range(0..leaves.len());
                if j < MAX_LOOKUPS {
                    sample[j] = (r.last_node, key.clone());
                }
            }
        }
        Ok(BigTree {
            tree,
            leaves: leaves.len(),
            sample,
        })
    }
}

/// The keys to look up (with an equal copy of each and the node it ends at), in random order.
struct Lookups {
    queries: Vec<Vec<u32>>,
    copies: Vec<Vec<u32>>,
    nodes: Vec<NodeId>,
}

impl Lookups {
    /// Small trees: draw with replacement (up to 4 lookups per key); big ones: every sampled
    /// key once, in random order.
    fn draw(built: &BigTree, rng: &mut ChaCha8Rng) -> Self {
        let sample = &built.sample;
        let lookups = MAX_LOOKUPS.min(built.leaves * 4);
        let mut l = Lookups {
            queries: Vec::with_capacity(lookups),
            copies: Vec::with_capacity(lookups),
            nodes: Vec::with_capacity(lookups),
        };
        for i in 0..lookups {
            let pick = if sample.len() < lookups {
                rng.random_range(0..sample.len())
            } else {
                i
            };
            l.nodes.push(sample[pick].0);
            l.copies.push(sample[pick].1.clone());
            l.queries.push(sample[pick].1.clone());
        }
        for i in (1..lookups).rev() {
            let j = rng.random_range(0..=i);
            l.queries.swap(i, j);
            l.copies.swap(i, j);
            l.nodes.swap(i, j);
        }
        l
    }

    /// The latency of each `match_prefix`, in µs; every full key must match whole.
    fn time_matches(&self, tree: &mut HiRadixTree, key_pages: usize) -> Result<Vec<f64>> {
        let mut lat = Vec::with_capacity(self.queries.len());
        for q in &self.queries {
            let t0 = Instant::now();
            let m = tree.match_prefix(TenantId::DEFAULT, black_box(q))?;
            let dt = t0.elapsed();
            if m.device_slots.len() != key_pages {
                return Err(BenchError::check_failed(format!(
                    "big tree: a full key matched {} of {key_pages} pages",
                    m.device_slots.len()
                )));
            }
            black_box(m);
            lat.push(dt.as_secs_f64() * 1e6);
        }
        Ok(lat)
    }

    /// The reference: the median µs of comparing each key with its (equal) copy, in another
    /// random order, so that it streams both from memory as coldly as the lookups do.
    fn time_reference(&self, rng: &mut ChaCha8Rng) -> Result<f64> {
        let mut ref_lat = Vec::with_capacity(self.queries.len());
        let mut order: Vec<usize> = (0..self.queries.len()).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        for &i in &order {
            let t0 = Instant::now();
            let eq = black_box(&self.queries[i][..]) == black_box(&self.copies[i][..]);
            let dt = t0.elapsed();
            if !eq {
                return Err(BenchError::check_failed(
                    "big tree: a key differs from its copy",
                ));
            }
            ref_lat.push(dt.as_secs_f64() * 1e6);
        }
        Ok(median(&mut ref_lat))
    }
}

/// Appends the tokens from the root to the end of `node`; returns the number of nodes.
fn path_into(tree: &HiRadixTree, node: NodeId, out: &mut Vec<u32>) -> Result<usize> {
    let mut chain = Vec::new();
    let mut n = node;
    loop {
        let info = tree.node_info(n)?;
        if info.is_root {
            break;
        }
        chain.push(n);
        n = info.parent.expect("a non-root node has a parent");
    }
    for &c in chain.iter().rev() {
        out.extend_from_slice(tree.tokens(c)?);
    }
    Ok(chain.len())
}

fn load_trace(args: &TreeArgs) -> Result<Vec<Request>> {
    match &args.trace {
        Some(p) => Ok(trace::read_file(p)?),
        None => Ok(MultiTurn {
            clients: args.clients,
            rounds: args.rounds,
            system_tokens: args.system_tokens,
            user_tokens: args.user_tokens,
            answer_tokens: args.answer_tokens,
            seed: args.seed,
            ..MultiTurn::default()
        }
        .generate()),
    }
}

/// Checks the flags `tree` takes together; the eviction policy.
fn validate(args: &TreeArgs) -> Result<StrategyKind> {
    let kind: StrategyKind = args.policy.parse()?;
    if args.page_size == 0 || args.page_size > 65536 {
        return Err(BenchError::usage(format!(
            "--page-size {} must be between 1 and 65536",
            args.page_size
        )));
    }
    if args.capacity.is_empty() {
        return Err(BenchError::usage("--capacity-pages needs a value"));
    }
    if args.log.is_some() && args.capacity.len() != 1 {
        return Err(BenchError::usage(
            "--log needs exactly one --capacity-pages value",
        ));
    }
    Ok(kind)
}

/// Where the trace came from, for the header.
fn source_of(args: &TreeArgs) -> String {
    match &args.trace {
        Some(p) => p.display().to_string(),
        None => format!(
            "generated {}x{} (system {}, user {}, answer {}, seed {})",
            args.clients,
            args.rounds,
            args.system_tokens,
            args.user_tokens,
            args.answer_tokens,
            args.seed
        ),
    }
}

/// The trace of the run (read or generated), written to `--write-trace` when asked.
fn trace_of(args: &TreeArgs) -> Result<Vec<Request>> {
    let trace = load_trace(args)?;
    if let Some(p) = &args.write_trace {
        let mut f = std::io::BufWriter::new(std::fs::File::create(p).map_err(BenchError::io(p))?);
        trace::write(&mut f, &trace)
            .and_then(|()| f.flush())
            .map_err(BenchError::io(p))?;
    }
    Ok(trace)
}

/// The table's header: the trace, the reference, the column names.
fn header(
    args: &TreeArgs,
    kind: StrategyKind,
    requests: usize,
    unique: usize,
    reference: f64,
) -> String {
    let ps = args.page_size;
    let hashing = if args.hashing {
        ", page hashing on"
    } else {
        ""
    };
    let columns = format!(
        "{:>10} {:>12} {:>12} {:>7} {:>9} {:>9} {:>9} {:>11} {:>6} {:>8} {:>10} {:>9}",
        "capacity",
        "req/s",
        "best req/s",
        "ratio",
        "match us",
        "insert us",
        "evict us",
        "hit tokens",
        "hit %",
        "skipped",
        "evicted",
        "meta B/pg"
    );
    format!(
        "tree replay: {requests} requests, {}; page {ps}, policy {kind}, {unique} unique pages{hashing}\n\
         reference (compare each key with a copy): {reference:.0} req/s\n{columns}",
        source_of(args)
    )
}

/// One capacity's replay figures.
struct CapacityCase<'a> {
    args: &'a TreeArgs,
    kind: StrategyKind,
    pages: Option<usize>,
    unique: usize,
    reference: f64,
    r: CaseResult,
}

impl CapacityCase<'_> {
    fn per_req(&self, d: Duration) -> f64 {
        d.as_secs_f64() * 1e6 / self.r.totals.requests.max(1) as f64
    }

    fn cap_name(&self) -> String {
        self.pages
            .map_or("unlimited".to_string(), |p| p.to_string())
    }

    fn meta_per_page(&self) -> f64 {
        self.r.memory.0 as f64 / self.r.cached_pages.max(1) as f64
    }

    /// The JSON record.
    fn record(&self) -> Record {
        let (r, t) = (&self.r, &self.r.totals);
        Record::new(
            "tree",
            format!(
                "replay/page{}/{}/{}",
                self.args.page_size,
                self.kind,
                self.cap_name()
            ),
            r.req_per_s,
            "req/s",
        )
        .with_reference(self.reference)
        .with("reference_what", "compare each key with a copy (req/s)")
        .with(
            "capacity_pages",
            self.pages.map_or(serde_json::Value::Null, |p| p.into()),
        )
        .with("unique_pages", self.unique)
        .with("requests", t.requests)
        .with("key_tokens", t.key_tokens)
        .with("hit_tokens", t.hit_tokens)
        .with("hit_ratio", t.hit_ratio())
        .with("skipped", t.skipped)
        .with("evicted_tokens", t.evicted_tokens)
        .with("match_us_per_req", self.per_req(t.match_time))
        .with("insert_us_per_req", self.per_req(t.insert_time))
        .with("evict_us_per_req", self.per_req(t.evict_time))
        .with("match_s", t.match_time.as_secs_f64())
        .with("insert_s", t.insert_time.as_secs_f64())
        .with("evict_s", t.evict_time.as_secs_f64())
        .with("cached_pages", r.cached_pages)
        .with("metadata_bytes_per_page", self.meta_per_page())
        .with(
            "token_bytes_per_page",
            r.memory.1 as f64 / r.cached_pages.max(1) as f64,
        )
        .with("best_req_per_s", r.best_req_per_s)
        .with("replays", r.reps)
    }

    /// The table row.
    fn row(&self) -> String {
        let (r, t) = (&self.r, &self.r.totals);
        format!(
            "{:>10} {:>12.0} {:>12.0} {:>7.3} {:>9.3} {:>9.3} {:>9.3} {:>11} {:>6.1} {:>8} {:>10} {:>9.1}",
            self.cap_name(),
            r.req_per_s,
            r.best_req_per_s,
            r.req_per_s / self.reference,
            self.per_req(t.match_time),
            self.per_req(t.insert_time),
            self.per_req(t.evict_time),
            t.hit_tokens,
            100.0 * t.hit_ratio(),
            t.skipped,
            t.evicted_tokens,
            self.meta_per_page(),
        )
    }
}

/// The big-tree case's JSON record or line.
fn big_tree_output(args: &TreeArgs, b: &BigTreeResult) -> String {
    let meta = b.memory.0 as f64 / b.pages as f64;
    let toks = b.memory.1 as f64 / b.pages as f64;
    if args.json {
        return Record::new(
            "tree",
            format!("match/{}tok/{}pages", args.big_key_tokens, b.pages),
            b.match_us.0,
            "us",
        )
        .with_reference(b.memcmp_us)
        .with("reference_what", "compare the key with a copy (us)")
        .with("p99_us", b.match_us.1)
        .with("mean_us", b.match_us.2)
        .with("lookups", b.lookups)
        .with("keys", b.keys)
        .with("nodes", b.nodes)
        .with("mean_nodes_per_lookup", b.mean_depth)
        .with("metadata_bytes_per_page", meta)
        .with("token_bytes_per_page", toks)
        .to_json_line();
    }
    format!(
        "match_prefix of a {}-token key in a tree of {} pages ({} nodes, {} keys, {:.1} nodes per lookup): median {:.2} us, p99 {:.2} us, mean {:.2} us; reference (compare key with a copy) {:.2} us; metadata {:.1} B/page (+{:.0} B/page of token ids)",
        args.big_key_tokens,
        b.pages,
        b.nodes,
        b.keys,
        b.mean_depth,
        b.match_us.0,
        b.match_us.1,
        b.match_us.2,
        b.memcmp_us,
        meta,
        toks
    )
}

/// Runs `tree`, writing the table or JSON lines to `out`.
pub fn run(args: &TreeArgs, mut out: impl Write) -> Result<()> {
    if args.components.is_some() {
        return run_hybrid(args, out);
    }
    let kind = validate(args)?;
    let trace = trace_of(args)?;
    let ps = args.page_size;
    let min_time = Duration::from_millis(args.min_time_ms);
    let cfg = TreeConfig {
        eviction: kind,
        hasher: if args.hashing {
            Some(PageHasher::sglang(ps)?)
        } else {
            None
        },
        ..TreeConfig::new(ps)
    };
    // Unique pages of the trace: the tree size after an unlimited replay.
    let (_, full) = replay::<false>(&trace, ps, None, kind, None)?;
    let unique = full.device_pages();
    drop(full);
    let copy = trace.clone();
    let reference = scan_rate(&trace, &copy, ps as usize, min_time);
    let mut w = |s: String| writeln!(out, "{s}").map_err(BenchError::io("<stdout>"));
    if !args.json {
        w(header(args, kind, trace.len(), unique, reference))?;
    }
    for cap in &args.capacity {
        let pages = match *cap {
            Capacity::Unlimited => None,
            Capacity::Pages(n) => Some(n),
            Capacity::Percent(p) => Some(((unique as f64 * p / 100.0).round() as usize).max(1)),
        };
        let r = measure(&trace, &cfg, pages, min_time)?;
        if let Some(path) = &args.log {
            let mut log = Vec::new();
            replay_with::<false>(&trace, cfg.clone(), pages, Some(&mut log))?;
            write_log(path, &trace, &log)?;
        }
        let case = CapacityCase {
            args,
            kind,
            pages,
            unique,
            reference,
            r,
        };
        w(if args.json {
            case.record().to_json_line()
        } else {
            case.row()
        })?;
    }
    if args.big_tree_pages > 0 {
        let b = big_tree(args.big_tree_pages, ps, args.big_key_tokens, args.seed)?;
        w(big_tree_output(args, &b))?;
    }
    Ok(())
}

/// The hybrid setup of `--components`.
fn hybrid_setup(args: &TreeArgs) -> Result<hybrid::HybridSetup> {
    let comps = args.components.as_deref().unwrap_or("full");
    let (swa, mamba) = match comps {
        "full" => (false, false),
        "full,swa" => (true, false),
        "full,mamba" => (false, true),
        "full,swa,mamba" => (true, true),
        other => {
            return Err(BenchError::usage(format!(
                "--components {other:?}: expected full, full,swa, full,mamba or full,swa,mamba"
            )));
        }
    };
    if swa != args.swa_window.is_some() {
        return Err(BenchError::usage(
            "--swa-window goes with --components full,swa or full,swa,mamba (and only with them)",
        ));
    }
    let full_pages = match args.capacity.as_slice() {
        [Capacity::Pages(n)] => *n as u64,
        [Capacity::Unlimited] => hybrid::UNLIMITED_PAGES,
        _ => {
            return Err(BenchError::usage(
                "--components needs exactly one --capacity-pages value: pages or unlimited",
            ));
        }
    };
    let host = args.host_capacity_pages.map(|n| hybrid_host::HostSetup {
        full_pages: n,
        swa_pages: args.swa_host_capacity_pages.unwrap_or(n),
        mamba_slots: args.host_mamba_slots.unwrap_or(n),
    });
    if host.is_none() && (args.swa_host_capacity_pages.or(args.host_mamba_slots)).is_some() {
        return Err(BenchError::usage(
            "--swa-host-capacity-pages and --host-mamba-slots go with --host-capacity-pages",
        ));
    }
    Ok(hybrid::HybridSetup {
        tree: UnifiedConfig {
            page_size: args.page_size,
            swa_window: args.swa_window,
            mamba_chunk: mamba.then_some(args.mamba_chunk),
        },
        full_pages,
        swa_pages: args.swa_capacity_pages.unwrap_or(full_pages),
        mamba_slots: args
            .mamba_slots
            .unwrap_or(full_pages.min(u64::from(u32::MAX)) as u32),
        host,
    })
}

/// `tree --components`: the unified-tree replay, its log and its rate.
fn run_hybrid(args: &TreeArgs, mut out: impl Write) -> Result<()> {
    let setup = hybrid_setup(args)?;
    let trace = trace_of(args)?;
    let (rows, fin) = hybrid::replay(&setup, &trace)?;
    if let Some(path) = &args.log {
        let cols = hybrid::LogColumns {
            host: setup.host.is_some(),
            mamba: setup.tree.swa_window.is_some() && setup.tree.mamba_chunk.is_some(),
        };
        hybrid::write_log(path, &trace, &rows, fin, cols)?;
    }
    let (median, best) = hybrid::rate(&setup, &trace, Duration::from_millis(args.min_time_ms))?;
    let comps = args.components.as_deref().unwrap_or("full");
    let mut pages = match setup.full_pages {
        hybrid::UNLIMITED_PAGES => "unlimited pages".to_string(),
        n => format!("{n} pages"),
    };
    if let Some(h) = setup.host {
        pages.push_str(&format!(", {} host pages", h.full_pages));
    }
    let line = if args.json {
        Record::new(
            "tree",
            format!(
                "unified/{comps}/page{}/{}",
                args.page_size,
                pages.replace(' ', "").replace(',', "+")
            ),
            median,
            "req/s",
        )
        .with("components", comps)
        .with("requests", trace.len())
        .with("best_req_per_s", best)
        .to_json_line()
    } else {
        format!(
            "unified tree replay [{comps}]: {} requests, page {}, {pages}: {median:.0} req/s (best {best:.0})",
            trace.len(),
            args.page_size,
        )
    };
    writeln!(out, "{line}").map_err(BenchError::io("<stdout>"))
}

fn write_log(path: &PathBuf, trace: &[Request], log: &[RequestOutcome]) -> Result<()> {
    let f = std::fs::File::create(path).map_err(BenchError::io(path))?;
    let mut w = std::io::BufWriter::new(f);
    let mut body = || -> std::io::Result<()> {
        writeln!(w, "id\tkey_tokens\thit_tokens\tevicted_tokens\tskipped")?;
        for (r, o) in trace.iter().zip(log) {
            writeln!(
                w,
                "{}\t{}\t{}\t{}\t{}",
                r.id,
                o.key_tokens,
                o.hit_tokens,
                o.evicted_tokens,
                u8::from(o.skipped)
            )?;
        }
        w.flush()
    };
    body().map_err(BenchError::io(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Vec<Request> {
        MultiTurn {
            clients: 4,
            rounds: 3,
            system_tokens: 8,
            user_tokens: 4,
            answer_tokens: 4,
            ..MultiTurn::default()
        }
        .generate()
    }

    #[test]
    fn unlimited_replay_hits_the_shared_history() {
        let trace = small();
        let mut log = Vec::new();
        let (tot, tree) =
            replay::<true>(&trace, 4, None, StrategyKind::Lru, Some(&mut log)).unwrap();
        // Round 0: client 0 misses, the others hit the 2-page system prompt.
        assert_eq!(log[0].hit_tokens, 0);
        assert_eq!(log[1].hit_tokens, 8);
        // Round 1: the whole previous request is cached (system + user = 12 tokens).
        assert_eq!(log[4].hit_tokens, 12);
        assert_eq!(tot.skipped, 0);
        assert_eq!(tot.evicted_tokens, 0);
        assert_eq!(tot.requests, 12);
        // Unique pages: system 2 + per client 3 user pages + 2 answer pages.
        assert_eq!(tree.device_pages(), 2 + 4 * (3 + 2));
        tree.check_invariants().unwrap();
    }

    #[test]
    fn capacity_replay_evicts_and_skips_by_the_rule() {
        let trace = small();
        let mut log = Vec::new();
        let (tot, tree) =
            replay::<false>(&trace, 4, Some(5), StrategyKind::Lru, Some(&mut log)).unwrap();
        tree.check_invariants().unwrap();
        assert!(tree.device_pages() <= 5);
        assert!(tot.evicted_tokens > 0);
        // A request of more than 5 pages can never be inserted.
        for (r, o) in trace.iter().zip(&log) {
            if r.tokens.len() / 4 > 5 {
                assert!(o.skipped, "{}", r.id);
            }
        }
        assert_eq!(tot.skipped, log.iter().filter(|o| o.skipped).count());
        // The same replay twice gives the same outcome.
        let mut log2 = Vec::new();
        replay::<false>(&trace, 4, Some(5), StrategyKind::Lru, Some(&mut log2)).unwrap();
        assert_eq!(log, log2);
    }

    #[test]
    fn capacities_parse() {
        assert_eq!(
            "unlimited".parse::<Capacity>().unwrap(),
            Capacity::Unlimited
        );
        assert_eq!("740".parse::<Capacity>().unwrap(), Capacity::Pages(740));
        assert_eq!("25%".parse::<Capacity>().unwrap(), Capacity::Percent(25.0));
        assert!("x%".parse::<Capacity>().is_err());
        assert!("-3".parse::<Capacity>().is_err());
        assert!("0%".parse::<Capacity>().is_err());
    }

    #[test]
    fn run_prints_json_records_and_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log.tsv");
        let args = TreeArgs {
            trace: None,
            page_size: 4,
            capacity: vec![Capacity::Percent(50.0)],
            policy: "lru".into(),
            log: Some(log.clone()),
            json: true,
            seed: 1,
            clients: 4,
            rounds: 3,
            system_tokens: 8,
            user_tokens: 4,
            answer_tokens: 4,
            write_trace: Some(dir.path().join("t.jsonl")),
            min_time_ms: 1,
            big_tree_pages: 64,
            big_key_tokens: 32,
            hashing: true,
            components: None,
            swa_window: None,
            swa_capacity_pages: None,
            mamba_chunk: 64,
            mamba_slots: None,
            host_capacity_pages: None,
            swa_host_capacity_pages: None,
            host_mamba_slots: None,
        };
        let mut out = Vec::new();
        run(&args, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["unit"], "req/s");
        assert_eq!(lines[0]["requests"], 12);
        assert!(lines[0]["ratio"].as_f64().unwrap() > 0.0);
        assert_eq!(lines[1]["unit"], "us");
        let log = std::fs::read_to_string(&log).unwrap();
        assert!(log.starts_with("id\tkey_tokens\thit_tokens\tevicted_tokens\tskipped\n"));
        assert_eq!(log.lines().count(), 13);
        // The written trace reads back and replays the same.
        let back = trace::read_file(&dir.path().join("t.jsonl")).unwrap();
        assert_eq!(back, small());
        // Bad input: unknown policy, --log with two capacities.
        let bad = TreeArgs {
            policy: "arc".into(),
            ..args
        };
        assert_eq!(run(&bad, Vec::new()).unwrap_err().exit_code(), 2);
        let two = TreeArgs {
            policy: "lru".into(),
            capacity: vec![Capacity::Unlimited, Capacity::Pages(3)],
            ..bad
        };
        assert_eq!(run(&two, Vec::new()).unwrap_err().exit_code(), 2);
        // The same flags through the unified tree: a log in the issue-26 format.
        let hybrid = TreeArgs {
            components: Some("full,swa".into()),
            swa_window: Some(8),
            capacity: vec![Capacity::Pages(64)],
            json: false,
            ..two
        };
        let mut out2 = Vec::new();
        run(&hybrid, &mut out2).unwrap();
        assert!(String::from_utf8(out2).unwrap().contains("req/s"));
        let text = std::fs::read_to_string(dir.path().join("log.tsv")).unwrap();
        assert!(text.starts_with(hybrid::HEADER));
        assert!(text.contains("# totals requests=12 "));
        let no_window = TreeArgs {
            swa_window: None,
            ..hybrid
        };
        assert!(
            run(&no_window, Vec::new()).is_err(),
            "full,swa needs a window"
        );
        // With --json, one record in the benches' convention.
        let json = TreeArgs {
            swa_window: Some(8),
            json: true,
            log: None,
            ..no_window
        };
        let mut out3 = Vec::new();
        run(&json, &mut out3).unwrap();
        let rec: serde_json::Value = serde_json::from_slice(&out3).unwrap();
        assert_eq!(rec["bench"], "tree");
        assert_eq!(rec["unit"], "req/s");
        assert_eq!(rec["components"], "full,swa");
        assert_eq!(rec["requests"], 12);
        assert!(rec["value"].as_f64().unwrap() > 0.0);
    }
}
