//! `hicache-bench controller`: the controller's own cost per scheduler tick, with many running
//! requests, on the sim device with tiny pages so that data movement is negligible.
//!
//! Steady state: `--requests` requests are running (admitted, prefix locked). Each tick does
//! what a scheduler iteration does with the cache: one `poll`, one request finishes
//! (`cache_finished`: insert, free duplicates, unlock, write-through queued), one request
//! arrives and is admitted (`arrive` with an L3 prefetch lookup, `admit`, `alloc_device`,
//! `start_loading`). Prompts share a system prompt and grow per client, so the tree has real
//! sharing and every tier is exercised. The figure is the median time of a tick's cache calls
//! (the sim device's copy worker runs on another thread; with pages of a few hundred bytes its
//! copies are negligible, but they are not excluded).

use std::collections::VecDeque;
use std::io::Write;
use std::time::Instant;

use clap::Args;
use hicache::{HiCache, HiCacheConfig, KvKind, KvShape, PrefetchPolicy};
use hicache_core::DType;

use crate::error::{BenchError, Result};
use crate::record::Record;

/// Arguments of `controller`.
#[derive(Debug, Args)]
pub struct ControllerArgs {
    /// Requests running at once.
    #[arg(long, default_value_t = 256)]
    pub requests: usize,
    /// Measured ticks (after as many warm-up ticks).
    #[arg(long, default_value_t = 2000)]
    pub ticks: usize,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    pub page_size: u32,
    /// Tokens of the shared system prompt.
    #[arg(long, default_value_t = 1024)]
    pub system_tokens: usize,
    /// Tokens each request adds.
    #[arg(long, default_value_t = 512)]
    pub turn_tokens: usize,
    /// Attach the in-memory L3 backend (prefetch lookups on every arrival, backups).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub l3: bool,
    /// One JSON line per figure instead of a table.
    #[arg(long)]
    pub json: bool,
}

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

/// Runs the bench, writing the table or JSON lines to `out`.
pub fn run(args: &ControllerArgs, mut out: impl Write) -> Result<()> {
    if args.requests == 0 || args.ticks == 0 {
        return Err(BenchError::Usage(
            "--requests and --ticks must be at least 1".into(),
        ));
    }
    let ps = args.page_size as usize;
    if ps == 0 || args.turn_tokens < ps {
        return Err(BenchError::Usage(format!(
            "--turn-tokens {} must be at least one page ({ps} tokens)",
            args.turn_tokens
        )));
    }
    let shape = KvShape {
        kind: KvKind::Mha {
            heads: 1,
            head_dim: 8,
        },
        layers: 2,
        dtype: DType::F16,
        page_size: args.page_size,
    };
    let pages_per_req = (args.system_tokens + 4 * args.turn_tokens).div_ceil(ps) + 1;
    let device_pages = args.requests * pages_per_req * 2 + 1024;
    let cfg = HiCacheConfig {
        page_size: args.page_size,
        storage_backend: args.l3.then(|| "memory".to_string()),
        storage_prefetch_policy: PrefetchPolicy::BestEffort,
        host_reserve_bytes: Some(0),
        ..Default::default()
    };
    let mut cache = HiCache::builder(cfg)
        .shape(shape)
        .device_pages(device_pages)
        .build()
        .map_err(|e| BenchError::Usage(format!("cannot build the cache: {e}")))?;
    let fail =
        |e: hicache::HiCacheError| BenchError::CheckFailed(format!("cache call failed: {e}"));
    let system = tokens(1, args.system_tokens);
    // Client `id % 64`, turn `id / 64 % 4 + 1`: prompts share the system prompt and grow with
    // the turn.
    let prompt_of = |id: u64| {
        let client = id % 64;
        let turn = (id / 64) % 4 + 1;
        let mut t = system.clone();
        for k in 0..turn {
            t.extend(tokens(1000 + client * 16 + k, args.turn_tokens));
        }
        t
    };
    let admit = |cache: &mut HiCache, id: u64, t: Vec<u32>| -> Result<Running> {
        let adm = cache.admit(id, &t).map_err(fail)?;
        let need = t.len().div_ceil(ps) - adm.prefix_slots.len();
        let fresh = cache
            .alloc_device(need)
            .map_err(fail)?
            .ok_or_else(|| BenchError::CheckFailed("device pool too small".into()))?;
        let mut slots = adm.prefix_slots;
        slots.extend(fresh);
        Ok(Running {
            id,
            tokens: t,
            slots,
        })
    };
    let mut running: VecDeque<Running> = VecDeque::new();
    let mut next = 0u64;
    for _ in 0..args.requests {
        let t = prompt_of(next);
        cache.arrive(next, &t).map_err(fail)?;
        cache.poll().map_err(fail)?;
        while !cache.prefetch_ready(next).map_err(fail)? {
            cache.poll().map_err(fail)?;
        }
        running.push_back(admit(&mut cache, next, t)?);
        cache.start_loading().map_err(fail)?;
        next += 1;
    }
    // One request arrived in the previous tick waits for admission.
    let mut pending: VecDeque<(u64, Vec<u32>)> = VecDeque::new();
    let mut samples = Vec::with_capacity(args.ticks);
    for tick in 0..2 * args.ticks {
        let t0 = Instant::now();
        cache.poll().map_err(fail)?;
        if let Some((id, _)) = pending.front()
            && cache.prefetch_ready(*id).map_err(fail)?
        {
            let (id, t) = pending.pop_front().expect("checked");
            let done = running.pop_front().expect("running requests");
            cache
                .cache_finished(done.id, &done.tokens, &done.slots)
                .map_err(fail)?;
            running.push_back(admit(&mut cache, id, t)?);
        }
        let t = prompt_of(next);
        cache.arrive(next, &t).map_err(fail)?;
        pending.push_back((next, t));
        next += 1;
        cache.start_loading().map_err(fail)?;
        let dt = t0.elapsed();
        if tick >= args.ticks {
            samples.push(dt.as_secs_f64() * 1e6);
        }
    }
    for (id, _) in pending {
        cache.abort(id).map_err(fail)?;
    }
    while let Some(r) = running.pop_front() {
        cache
            .cache_finished(r.id, &r.tokens, &r.slots)
            .map_err(fail)?;
    }
    cache.shutdown().map_err(fail)?;
    samples.sort_by(f64::total_cmp);
    let q = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize];
    let (p50, p99) = (q(0.5), q(0.99));
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    let tree = cache.tree().stats();
    let wr = BenchError::io("<stdout>");
    if args.json {
        let rec = Record::new(
            "controller",
            format!("tick/{}req", args.requests),
            p50,
            "us",
        )
        .with("p99_us", p99)
        .with("mean_us", mean)
        .with("requests", args.requests)
        .with("ticks", args.ticks)
        .with("l3", args.l3)
        .with("tree_nodes", tree.nodes);
        writeln!(out, "{}", rec.to_json_line()).map_err(wr)?;
    } else {
        writeln!(
            out,
            "controller cost per tick ({} running requests, page {}, L3 {}): median {:.1} us, p99 {:.1} us, mean {:.1} us over {} ticks; tree {} nodes",
            args.requests,
            args.page_size,
            if args.l3 { "memory" } else { "off" },
            p50,
            p99,
            mean,
            args.ticks,
            tree.nodes
        )
        .map_err(wr)?;
    }
    Ok(())
}
