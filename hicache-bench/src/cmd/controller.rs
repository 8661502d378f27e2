//! `hicache-bench controller`: the controller's own cost per scheduler tick, on the sim device
//! with tiny pages so that data movement is negligible, in two phases of one run:
//!
//! 1. **All-hit (the reference).** `--requests` requests are running; the device holds far
//!    more than the working set, so after warm-up every admission is a full L1 hit and a tick
//!    does no eviction, load-back, insert of new pages, backup or L3 lookup. This is the floor
//!    of a tick's cost.
//! 2. **Mixed.** The same number of running requests over `--clients` conversations picked at
//!    random (seeded), each turn extending its conversation's previous prompt; the working set
//!    is several times the device pool and the host pool (L2 = 2× L1), and L3 is the in-memory
//!    backend. Ticks now include misses with inserts, L1 and L2 evictions, load-backs,
//!    write-through launches, L3 lookups, L3 hits and backups.
//!
//! One tick = what a scheduler iteration does with the cache: one `poll`, one request finishes
//! (`cache_finished`), the request that arrived in the previous tick is admitted (`admit`,
//! `alloc_device`), one request arrives (`arrive`, with its L3 lookup), `start_loading`.
//! Each mixed tick is classified by what it did (from the controller's metrics and call
//! results, read outside the timed region) and reported per kind as p50/p99, each beside the
//! all-hit phase's p50/p99 from the same run. A tick counts in every kind it did.

use std::collections::VecDeque;
use std::io::Write;
use std::time::Instant;

use clap::Args;
use hicache::{HiCache, HiCacheConfig, KvKind, KvShape, PrefetchPolicy};
use hicache_core::DType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{BenchError, Result};
use crate::record::Record;

/// Arguments of `controller`.
#[derive(Debug, Args)]
pub struct ControllerArgs {
    /// Requests running at once.
    #[arg(long, default_value_t = 256)]
    pub requests: usize,
    /// Measured ticks per phase (after as many warm-up ticks; the mixed phase warms up until
    /// the host pool has filled about twice over).
    #[arg(long, default_value_t = 2000)]
    pub ticks: usize,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    pub page_size: u32,
    /// Tokens of the shared system prompt.
    #[arg(long, default_value_t = 1024)]
    pub system_tokens: usize,
    /// Tokens each turn adds.
    #[arg(long, default_value_t = 512)]
    pub turn_tokens: usize,
    /// Mixed phase: conversations requests are drawn from (the working set).
    #[arg(long, default_value_t = 2048)]
    pub clients: u64,
    /// Attach the in-memory L3 backend (prefetch lookups on arrivals, backups).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub l3: bool,
    /// Seed of the mixed phase's conversation picks.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// One JSON line per figure instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also time each cache call of the mixed ticks apart (poll, cache_finished, the
    /// admission, arrive, start_loading) and print their p50/p99: where a tick's time goes;
    /// and the engine thread's CPU time per mixed tick (the tick's time minus the time the
    /// thread waited for a core). Adds a clock read between the calls and two around each
    /// tick.
    #[arg(long)]
    pub per_call: bool,
    /// A tick's arrival is skipped while this many requests wait for admission (clients that
    /// send when the engine has room: the waiting queue, and the prefetches every poll
    /// tracks, stay bounded); before such a tick the bench waits, untimed, for the L3 work in
    /// flight, as an engine's forward pass would. 0: one arrival every tick, whatever waits —
    /// the method of the earlier tables, where every tick that admits nothing lengthens the
    /// queue for good (one arrival and at most one admission per tick).
    #[arg(long, default_value_t = 0)]
    pub max_waiting: usize,
}

/// Turns per conversation before it starts over.
const TURNS: u64 = 4;

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 128_000) as u32
        })
        .collect()
}

struct Running {
    id: u64,
    tokens: Vec<u32>,
    slots: Vec<hicache::DeviceSlot>,
}

/// What one tick did (a tick may do several).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    AllHit,
    Insert,
    EvictL1,
    EvictL2,
    LoadBack,
    WriteThrough,
    L3Lookup,
    L3Hit,
    Backup,
    Refused,
}

impl Kind {
    const ALL: [Kind; 10] = [
        Kind::AllHit,
        Kind::Insert,
        Kind::EvictL1,
        Kind::EvictL2,
        Kind::LoadBack,
        Kind::WriteThrough,
        Kind::L3Lookup,
        Kind::L3Hit,
        Kind::Backup,
        Kind::Refused,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::AllHit => "all_hit",
            Kind::Insert => "insert",
            Kind::EvictL1 => "evict_l1",
            Kind::EvictL2 => "evict_l2",
            Kind::LoadBack => "load_back",
            Kind::WriteThrough => "write_through",
            Kind::L3Lookup => "l3_lookup",
            Kind::L3Hit => "l3_hit",
            Kind::Backup => "backup",
            Kind::Refused => "refused",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Kind::AllHit => "admission a full L1 hit, nothing else moved",
            Kind::Insert => "a finished request inserted new pages",
            Kind::EvictL1 => "device pages evicted",
            Kind::EvictL2 => "host pages evicted",
            Kind::LoadBack => "an L2 → L1 load launched",
            Kind::WriteThrough => "a D2H write-through batch launched",
            Kind::L3Lookup => "an arrival started an L3 lookup",
            Kind::L3Hit => "an admission used pages prefetched from L3",
            Kind::Backup => "L2 → L3 backups launched or finished",
            Kind::Refused => "an admission refused (device held), retried next tick",
        }
    }
}

/// The cache calls of a tick, in call order (`--per-call`).
const CALLS: [&str; 6] = [
    "poll",
    "cache_finished",
    "admit+alloc_device",
    "arrive",
    "start_loading",
    "tick_cpu_time",
];

/// Index in [`CALLS`] of the tick's CPU time.
const CPU: usize = 5;

/// The calling thread's CPU time, µs (`--per-call`).
fn thread_cpu_us() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 * 1e6 + ts.tv_nsec as f64 / 1e3
}

/// Per-tick samples of one phase.
#[derive(Default)]
struct Samples {
    all: Vec<f64>,
    by_kind: Vec<(Kind, Vec<f64>)>,
    /// `--per-call`: each call's time (µs) per tick that made it, by [`CALLS`] index.
    calls: [Vec<f64>; CALLS.len()],
    /// Prefetches tracked after each tick's poll (the poll's work grows with them).
    tracked: Vec<f64>,
}

impl Samples {
    fn push(&mut self, us: f64, kinds: &[Kind]) {
        self.all.push(us);
        for &k in kinds {
            match self.by_kind.iter_mut().find(|(x, _)| *x == k) {
                Some((_, v)) => v.push(us),
                None => self.by_kind.push((k, vec![us])),
            }
        }
    }

    fn kind(&self, k: Kind) -> Option<&[f64]> {
        self.by_kind
            .iter()
            .find(|(x, _)| *x == k)
            .map(|(_, v)| v.as_slice())
    }
}

/// p50, p99 and mean of a sample (sorted in place).
fn stats(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    (q(0.5), q(0.99), v.iter().sum::<f64>() / v.len() as f64)
}

fn fail(e: hicache::HiCacheError) -> BenchError {
    BenchError::check_failed(format!("cache call failed: {e}"))
}

/// One phase's cache and workload.
struct Phase<'a> {
    args: &'a ControllerArgs,
    cache: HiCache,
    system: Vec<u32>,
    mixed: bool,
    rng: ChaCha8Rng,
    /// Mixed: the next turn of each conversation.
    turns: Vec<u64>,
    /// Ticks before the measured ones.
    warmup: usize,
    /// Tests only: after each tick (outside the timed region) wait until every copy, backup
    /// and L3 lookup launched so far has completed, so which kinds of work the ticks do does
    /// not depend on how fast background threads run on a loaded machine. The bench never
    /// settles: its ticks see the background work as it really progresses.
    settle: bool,
    running: VecDeque<Running>,
    pending: VecDeque<(u64, Vec<u32>)>,
    next: u64,
    /// `--per-call`: the last tick's time per call (µs; `None`: not made), by [`CALLS`] index.
    call_us: [Option<f64>; CALLS.len()],
    /// Prefetches tracked after the last tick's poll.
    tracked: usize,
}

/// Bound on [`Phase::settle_in_flight`]'s 1 ms polls (a minute: far beyond any real copy).
const SETTLE_POLLS: usize = 60_000;

impl<'a> Phase<'a> {
    fn new(args: &'a ControllerArgs, mixed: bool) -> Result<Self> {
        let ps = args.page_size as usize;
        let shape = KvShape {
            kind: KvKind::Mha {
                heads: 1,
                head_dim: 8,
            },
            layers: 2,
            dtype: DType::F16,
            page_size: args.page_size,
        };
        let pages_per_req = (args.system_tokens + TURNS as usize * args.turn_tokens).div_ceil(ps);
        // All-hit: far more than the working set. Mixed: the running requests' pages with
        // half as much again for cached prefixes; the working set is many times that.
        let device_pages = if mixed {
            args.requests * pages_per_req * 3 / 2
        } else {
            // Every page of the 64 × 4 prompts, plus room for the running requests.
            let distinct =
                (args.system_tokens + 64 * TURNS as usize * args.turn_tokens).div_ceil(ps);
            args.requests * pages_per_req + distinct + 1024
        };
        let cfg = HiCacheConfig {
            page_size: args.page_size,
            storage_backend: args.l3.then(|| "memory".to_string()),
            storage_prefetch_policy: PrefetchPolicy::WaitComplete,
            hicache_ratio: 2.0,
            host_reserve_bytes: Some(0),
            ..Default::default()
        };
        let cache = HiCache::builder(cfg)
            .shape(shape)
            .device_pages(device_pages)
            .build()
            .map_err(|e| BenchError::usage(format!("cannot build the cache: {e}")))?;
        // Mixed: warm up until the host pool has filled (about twice over, at one turn's new
        // pages per tick), so the measured ticks see L2 evictions and L3 hits.
        let turn_pages = args.turn_tokens.div_ceil(ps).max(1);
        let warmup = if mixed {
            args.ticks.max(2 * 2 * device_pages / turn_pages)
        } else {
            args.ticks
        };
        Ok(Self {
            args,
            cache,
            warmup,
            settle: false,
            system: tokens(1, args.system_tokens),
            mixed,
            rng: ChaCha8Rng::seed_from_u64(args.seed),
            turns: vec![0; args.clients as usize],
            running: VecDeque::new(),
            pending: VecDeque::new(),
            next: 0,
            call_us: [None; CALLS.len()],
            tracked: 0,
        })
    }

    /// The next prompt: all-hit, client `id % 64` at turn `id / 64 % 4 + 1`; mixed, a random
    /// conversation's next turn (its previous prompt plus one more turn).
    fn prompt(&mut self, id: u64) -> Vec<u32> {
        let (client, turn) = if self.mixed {
            let c = self.rng.random_range(0..self.args.clients);
            let n = self.turns[c as usize];
            self.turns[c as usize] += 1;
            // After its last turn a conversation starts over as a new one (fresh tokens).
            (c + self.args.clients * (n / TURNS), n % TURNS + 1)
        } else {
            (id % 64, (id / 64) % TURNS + 1)
        };
        let mut t = self.system.clone();
        for k in 0..turn {
            t.extend(tokens(1000 + client * 16 + k, self.args.turn_tokens));
        }
        t
    }

    /// Admits `id`; `Err(t)` (the prompt handed back, not copied) when the device cannot
    /// hold it now (admission undone).
    fn admit(
        &mut self,
        id: u64,
        t: Vec<u32>,
    ) -> Result<std::result::Result<(Running, bool, bool), Vec<u32>>> {
        let ps = self.args.page_size as usize;
        let adm = self.cache.admit(id, &t).map_err(fail)?;
        let need = t.len().div_ceil(ps) - adm.prefix_slots.len();
        let Some(fresh) = self.cache.alloc_device(need).map_err(fail)? else {
            self.cache.unadmit(id).map_err(fail)?;
            return Ok(Err(t));
        };
        let all_hit = adm.device_pages == adm.prefix_slots.len() && need <= 1;
        let l3_hit = adm.storage_pages > 0;
        let mut slots = adm.prefix_slots;
        slots.extend(fresh);
        Ok(Ok((
            Running {
                id,
                tokens: t,
                slots,
            },
            all_hit,
            l3_hit,
        )))
    }

    fn fill(&mut self) -> Result<()> {
        while self.running.len() < self.args.requests {
            let id = self.next;
            self.next += 1;
            let t = self.prompt(id);
            self.cache.arrive(id, &t).map_err(fail)?;
            self.cache.poll().map_err(fail)?;
            while !self.cache.prefetch_ready(id).map_err(fail)? {
                self.cache.poll().map_err(fail)?;
            }
            match self.admit(id, t)? {
                Ok((r, _, _)) => self.running.push_back(r),
                Err(_) => {
                    return Err(BenchError::check_failed(
                        "the device pool cannot hold the running requests",
                    ));
                }
            }
            self.cache.start_loading().map_err(fail)?;
        }
        Ok(())
    }

    /// `--per-call`: records the time since `*at` as call `i`'s and restarts `*at`.
    fn lap(&mut self, i: usize, at: &mut Instant) {
        if self.args.per_call {
            let now = Instant::now();
            self.call_us[i] = Some((now - *at).as_secs_f64() * 1e6);
            *at = now;
        }
    }

    /// One tick; returns its time (µs, cache calls only) and what it did.
    fn tick(&mut self) -> Result<(f64, Vec<Kind>)> {
        let arrives = self.args.max_waiting == 0 || self.pending.len() < self.args.max_waiting;
        if !arrives {
            // A full waiting queue: an engine would spend this iteration in its forward pass
            // while the L3 reads go on; here the bench waits for them, outside the timed
            // region, so that the tick is not an idle spin.
            self.settle_in_flight()?;
        }
        let before = self.cache.metrics().snapshot();
        let id = self.next;
        if arrives {
            self.next += 1;
        }
        let prompt = if arrives { self.prompt(id) } else { Vec::new() };
        // The finished request's buffers are freed after the timed region (bench memory).
        let mut retired = None;
        self.call_us = [None; CALLS.len()];
        let cpu0 = if self.args.per_call {
            thread_cpu_us()
        } else {
            0.0
        };
        let t0 = Instant::now();
        let mut at = t0;
        let poll = self.cache.poll().map_err(fail)?;
        self.lap(0, &mut at);
        self.tracked = poll.prefetches_in_flight;
        let mut admitted = None;
        let mut refused = false;
        if let Some((pid, _)) = self.pending.front()
            && self.cache.prefetch_ready(*pid).map_err(fail)?
        {
            let (pid, t) = self.pending.pop_front().expect("checked");
            // One request finishes to make room (not again while an admission is retried).
            let mut inserted = 0;
            if self.running.len() >= self.args.requests {
                let done = self.running.pop_front().expect("running requests");
                // Two field reads: negligible inside the timed region.
                let cached = self.cache.tree_stats().device_pages;
                self.cache
                    .cache_finished(done.id, &done.tokens, &done.slots)
                    .map_err(fail)?;
                inserted = self.cache.tree_stats().device_pages.saturating_sub(cached);
                retired = Some(done);
                self.lap(1, &mut at);
            }
            // The prompt moves into the running request, or comes back when refused: the
            // bench copies no tokens inside the timed region.
            let admission = self.admit(pid, t)?;
            self.lap(2, &mut at);
            match admission {
                Ok((r, all_hit, l3_hit)) => {
                    admitted = Some((inserted, all_hit, l3_hit));
                    self.running.push_back(r);
                }
                Err(t) => {
                    refused = true;
                    self.pending.push_front((pid, t));
                }
            }
        }
        let mut prefetch_pages = 0;
        if arrives {
            prefetch_pages = self.cache.arrive(id, &prompt).map_err(fail)?.prefetch_pages;
            self.lap(3, &mut at);
            self.pending.push_back((id, prompt));
        }
        let loaded = self.cache.start_loading().map_err(fail)?;
        self.lap(4, &mut at);
        let us = t0.elapsed().as_secs_f64() * 1e6;
        if self.args.per_call {
            self.call_us[CPU] = Some(thread_cpu_us() - cpu0).filter(|v| v.is_finite());
        }
        drop(retired);
        let after = self.cache.metrics().snapshot();
        let mut kinds = Vec::new();
        let moved = after.evicted_pages_l1 > before.evicted_pages_l1
            || after.evicted_pages_l2 > before.evicted_pages_l2
            || loaded.is_some()
            || poll.writes_launched > 0
            || poll.writes_finished > 0
            || poll.backups_finished > 0
            || prefetch_pages > 0;
        if let Some((inserted, all_hit, l3_hit)) = admitted {
            if all_hit && inserted == 0 && !moved {
                kinds.push(Kind::AllHit);
            }
            if inserted > 0 {
                kinds.push(Kind::Insert);
            }
            if l3_hit {
                kinds.push(Kind::L3Hit);
            }
        }
        if refused {
            kinds.push(Kind::Refused);
        }
        if after.evicted_pages_l1 > before.evicted_pages_l1 {
            kinds.push(Kind::EvictL1);
        }
        if after.evicted_pages_l2 > before.evicted_pages_l2 {
            kinds.push(Kind::EvictL2);
        }
        if loaded.is_some() {
            kinds.push(Kind::LoadBack);
        }
        if poll.writes_launched > 0 {
            kinds.push(Kind::WriteThrough);
        }
        if prefetch_pages > 0 {
            kinds.push(Kind::L3Lookup);
        }
        if self.args.l3 && (poll.writes_finished > 0 || poll.backups_finished > 0) {
            kinds.push(Kind::Backup);
        }
        Ok((us, kinds))
    }

    /// Waits (bounded) until nothing launched so far is still running; results are left for
    /// the next tick's poll to collect.
    fn settle_in_flight(&self) -> Result<()> {
        for _ in 0..SETTLE_POLLS {
            let f = self.cache.in_flight().map_err(fail)?;
            let busy = f.writes.iter().any(|&(_, done)| !done)
                || f.backups.iter().any(|&(_, done)| !done)
                || f.lookups > 0;
            if !busy {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Err(BenchError::usage(format!(
            "background copies still running after {SETTLE_POLLS} polls"
        )))
    }

    fn run(mut self) -> Result<(Samples, usize)> {
        self.fill()?;
        let mut samples = Samples::default();
        for tick in 0..self.warmup + self.args.ticks {
            let (us, kinds) = self.tick()?;
            if tick >= self.warmup {
                samples.push(us, &kinds);
                samples.tracked.push(self.tracked as f64);
                for (v, us) in samples.calls.iter_mut().zip(self.call_us) {
                    v.extend(us);
                }
            }
            if self.settle {
                self.settle_in_flight()?;
            }
        }
        for (id, _) in std::mem::take(&mut self.pending) {
            self.cache.abort(id).map_err(fail)?;
        }
        while let Some(r) = self.running.pop_front() {
            self.cache
                .cache_finished(r.id, &r.tokens, &r.slots)
                .map_err(fail)?;
        }
        let nodes = self.cache.tree_stats().nodes;
        self.cache.shutdown().map_err(fail)?;
        Ok((samples, nodes))
    }
}

/// Runs the bench, writing the table or JSON lines to `out`.
pub fn run(args: &ControllerArgs, mut out: impl Write) -> Result<()> {
    if args.requests == 0 || args.ticks == 0 {
        return Err(BenchError::usage(
            "--requests and --ticks must be at least 1",
        ));
    }
    let ps = args.page_size as usize;
    if ps == 0 || args.turn_tokens < ps {
        return Err(BenchError::usage(format!(
            "--turn-tokens {} must be at least one page ({ps} tokens)",
            args.turn_tokens
        )));
    }
    if args.clients < args.requests as u64 {
        return Err(BenchError::usage(format!(
            "--clients {} must be at least --requests {} (the working set must exceed the \
             running requests)",
            args.clients, args.requests
        )));
    }
    let (mut reference, ref_nodes) = Phase::new(args, false)?.run()?;
    let (mut mixed, mixed_nodes) = Phase::new(args, true)?.run()?;
    let (ref_p50, ref_p99, ref_mean) = stats(&mut reference.all);
    let wr = BenchError::io("<stdout>");
    let l3 = if args.l3 { "memory" } else { "off" };
    let mut rows = Vec::new();
    let (tracked_p50, tracked_max) = if mixed.tracked.is_empty() {
        (0.0, 0.0)
    } else {
        let (p50, _, _) = stats(&mut mixed.tracked);
        (p50, mixed.tracked[mixed.tracked.len() - 1])
    };
    let (p50, p99, mean) = stats(&mut mixed.all);
    rows.push(("all", "every mixed tick", mixed.all.len(), p50, p99, mean));
    for k in Kind::ALL {
        let Some(v) = mixed.kind(k) else { continue };
        let mut v = v.to_vec();
        let (p50, p99, mean) = stats(&mut v);
        rows.push((k.name(), k.what(), v.len(), p50, p99, mean));
    }
    if args.json {
        let rec = Record::new(
            "controller",
            format!("tick/all_hit/{}req", args.requests),
            ref_p50,
            "us",
        )
        .with("p99_us", ref_p99)
        .with("mean_us", ref_mean)
        .with("ticks", args.ticks)
        .with("l3", args.l3)
        .with("tree_nodes", ref_nodes);
        writeln!(out, "{}", rec.to_json_line()).map_err(wr)?;
        for (name, _, n, p50, p99, mean) in &rows {
            let rec = Record::new(
                "controller",
                format!("tick/mixed/{name}/{}req", args.requests),
                *p50,
                "us",
            )
            .with_reference(ref_p50)
            .with("p99_us", *p99)
            .with("reference_p99_us", ref_p99)
            .with("mean_us", *mean)
            .with("ticks", *n)
            .with("l3", args.l3)
            .with("clients", args.clients)
            .with("tree_nodes", mixed_nodes)
            .with("prefetches_tracked_p50", tracked_p50)
            .with("prefetches_tracked_max", tracked_max);
            writeln!(out, "{}", rec.to_json_line()).map_err(BenchError::io("<stdout>"))?;
        }
    } else {
        writeln!(
            out,
            "controller cost per tick: {} running requests, page {}, L3 {l3}; {} measured ticks \
             per phase\nreference (all-hit phase, same run): p50 {ref_p50:.1} us, p99 \
             {ref_p99:.1} us, mean {ref_mean:.1} us; tree {ref_nodes} nodes\nmixed phase: {} \
             conversations, L1 1.5× the running requests' pages, L2 2× L1; tree {mixed_nodes} \
             nodes at the end; prefetches tracked after a poll: median {tracked_p50:.0}, max \
             {tracked_max:.0}",
            args.requests, args.page_size, args.ticks, args.clients
        )
        .map_err(wr)?;
        writeln!(
            out,
            "{:<14} {:>6} {:>9} {:>9} {:>9} {:>9}  what the tick did",
            "kind", "ticks", "p50 us", "×ref p50", "p99 us", "×ref p99"
        )
        .map_err(BenchError::io("<stdout>"))?;
        for (name, what, n, p50, p99, _) in &rows {
            writeln!(
                out,
                "{name:<14} {n:>6} {p50:>9.1} {:>9.2} {p99:>9.1} {:>9.2}  {what}",
                p50 / ref_p50,
                p99 / ref_p99
            )
            .map_err(BenchError::io("<stdout>"))?;
        }
    }
    if args.per_call {
        for (name, v) in CALLS.iter().zip(&mut mixed.calls) {
            if v.is_empty() {
                continue;
            }
            let n = v.len();
            let (p50, p99, mean) = stats(v);
            if args.json {
                let rec = Record::new(
                    "controller",
                    format!("tick/mixed/call/{name}/{}req", args.requests),
                    p50,
                    "us",
                )
                .with("p99_us", p99)
                .with("mean_us", mean)
                .with("ticks", n);
                writeln!(out, "{}", rec.to_json_line()).map_err(BenchError::io("<stdout>"))?;
            } else {
                writeln!(
                    out,
                    "mixed call {name:<18} {n:>6} ticks  p50 {p50:>7.1} us  p99 {p99:>8.1} us  \
                     mean {mean:>7.1} us"
                )
                .map_err(BenchError::io("<stdout>"))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mixed_phase_does_every_kind_of_work() {
        let args = ControllerArgs {
            requests: 8,
            ticks: 300,
            page_size: 16,
            system_tokens: 64,
            turn_tokens: 128,
            clients: 64,
            l3: true,
            seed: 1,
            json: true,
            per_call: false,
            max_waiting: 0,
        };
        let mut mixed = Phase::new(&args, true).unwrap();
        mixed.settle = true;
        let (mut samples, _) = mixed.run().unwrap();
        let missing: Vec<&str> = [
            Kind::Insert,
            Kind::EvictL1,
            Kind::EvictL2,
            Kind::LoadBack,
            Kind::WriteThrough,
            Kind::L3Lookup,
            Kind::L3Hit,
            Kind::Backup,
        ]
        .into_iter()
        .filter(|&k| samples.kind(k).is_none())
        .map(Kind::name)
        .collect();
        assert!(missing.is_empty(), "kinds never seen: {missing:?}");
        assert_eq!(samples.all.len(), 300);
        let (p50, p99, _) = stats(&mut samples.all);
        assert!(p50 > 0.0 && p99 >= p50);
        // The all-hit phase is (nearly: the last warm-up writes may still finish) all hits.
        let mut all_hit = Phase::new(&args, false).unwrap();
        all_hit.settle = true;
        let (r, _) = all_hit.run().unwrap();
        let hits = r.kind(Kind::AllHit).map_or(0, <[f64]>::len);
        assert!(hits >= 290, "{hits} all-hit ticks of 300");
        assert!(r.kind(Kind::L3Lookup).is_none() && r.kind(Kind::EvictL1).is_none());
    }

    /// `--max-waiting 2`: whatever the L3 threads' pace (no settling between ticks), no
    /// tick leaves more than two requests waiting, and arrivals go on as admissions make room.
    #[test]
    fn a_bounded_waiting_queue_stays_bounded() {
        let args = ControllerArgs {
            requests: 8,
            ticks: 200,
            page_size: 16,
            system_tokens: 64,
            turn_tokens: 128,
            clients: 64,
            l3: true,
            seed: 1,
            json: true,
            per_call: false,
            max_waiting: 2,
        };
        let mut mixed = Phase::new(&args, true).unwrap();
        mixed.fill().unwrap();
        let first = mixed.next;
        for _ in 0..200 {
            mixed.tick().unwrap();
            assert!(mixed.pending.len() <= 2, "{} waiting", mixed.pending.len());
        }
        assert!(mixed.next > first, "no arrival in 200 ticks");
    }

    #[test]
    fn prints_each_kind_beside_the_reference() {
        let args = ControllerArgs {
            requests: 4,
            ticks: 50,
            page_size: 16,
            system_tokens: 32,
            turn_tokens: 16,
            clients: 32,
            l3: true,
            seed: 1,
            json: true,
            per_call: true,
            max_waiting: 0,
        };
        let mut out = Vec::new();
        run(&args, &mut out).unwrap();
        let lines: Vec<serde_json::Value> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines[0]["case"], "tick/all_hit/4req");
        let all = lines
            .iter()
            .find(|l| l["case"] == "tick/mixed/all/4req")
            .unwrap();
        assert_eq!(all["reference"], lines[0]["value"]);
        assert!(all["ratio"].as_f64().unwrap() > 0.0);
        assert!(all["reference_p99_us"].as_f64().is_some());
        // `--per-call`: every call of a tick timed apart.
        for call in CALLS {
            let case = format!("tick/mixed/call/{call}/4req");
            assert!(
                lines.iter().any(|l| l["case"] == case.as_str()),
                "{case} missing"
            );
        }
    }
}
