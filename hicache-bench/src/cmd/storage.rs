//! `hicache-bench storage`: write and read throughput of a storage backend next to the physical
//! limit measured in the same run on the same directory.
//!
//! For a file-system backend the reference is raw sequential O_DIRECT I/O of the same bytes in
//! the same directory ([`storage_raw`](crate::cmd::storage_raw)): one preallocated file,
//! page-sized requests at consecutive offsets, one `fdatasync` at the end of the write. Two
//! such references are measured in every round: `--raw-depth` (default 32) requests in flight
//! on as many threads (`--raw-engine`), and one io_uring with `--batch` requests in flight (the
//! queue depth the backend itself may use). The headline `reference` and `ratio` are against
//! the **stronger** of the two for each phase (the higher GB/s), named in `reference_engine`
//! and `reference_depth`; every candidate's figure is kept under `references`.
//! Headline figures are durable and cold: backend
//! writes include its fsync policy's cost (the default unless `--extra-config` says
//! otherwise), and reads run after `sync; echo 3 > /proc/sys/vm/drop_caches` (when permitted;
//! both sides also read with O_DIRECT from page-aligned buffers, so they are cold either way).
//! For the memory backend the reference is a memcpy of the same bytes; for the rdma backend
//! (a server named by `--extra-config`, or `{"spawn_server": true}`) it is raw TCP loopback
//! of the same bytes between two threads ([`tcp_loopback`]), not RDMA.
//!
//! Each figure is the best of `--rounds` rounds; a round measures the reference and the backend
//! back to back, so both see the same disk state.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use futures_util::StreamExt;
use hicache_storage::{
    MemoryRegion, PageBuf, PageBufMut, PageKey, PageOutcome, Storage, parse_byte_size, pattern,
};
use serde_json::Value;

use crate::cmd::storage_common::{BackendArgs, LAYOUT, aligned_region, runtime, seed_key};
use crate::cmd::storage_raw::{Raw, RawEngine, engine_name};
use crate::cmd::{redis_benchmark, tcp_loopback};
use crate::error::{BenchError, Result};
use crate::record::Record;

/// Arguments of `storage`.
#[derive(Debug, Args)]
pub struct StorageArgs {
    /// Backend selection (`--backend file --dir DIR`, or `--backend memory`).
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Bytes per page; default: both 8 MiB (Llama-3-8B, 64 tokens) and 256 KiB.
    #[arg(long)]
    pub page_bytes: Option<usize>,
    /// Pages per batch.
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// Bytes written and read per page size and round (e.g. `2GiB`).
    #[arg(long, default_value = "2GiB")]
    pub total: String,
    /// Rounds; each figure is the best round.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Requests in flight for the headline raw O_DIRECT reference (`--raw-threads` is an older
    /// name).
    #[arg(long, alias = "raw-threads", default_value_t = 32)]
    pub raw_depth: usize,
    /// How the headline raw reference issues its requests.
    #[arg(long, value_enum, default_value_t = RawEngine::Threads)]
    pub raw_engine: RawEngine,
    /// One JSON object per case instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Announce the bench's page buffers to the backend with `register_memory`, as an engine
    /// does with its host pool (uring registers them as io_uring fixed buffers).
    #[arg(long)]
    pub register_memory: bool,
    /// Batches in flight at once against the backend (writes and reads), as the controller
    /// drives it: the next L3 batch is in flight while the previous one's durability barrier
    /// runs. Recorded as `inflight` in the JSON. The raw reference is unchanged.
    #[arg(long, default_value_t = DEFAULT_INFLIGHT)]
    pub inflight: usize,
}

/// Batches the controller keeps in flight against L3 (the next ones while the previous one's
/// durability barrier runs): the `storage` bench's default `--inflight`.
pub const DEFAULT_INFLIGHT: usize = hicache::L3_WRITE_BATCHES_IN_FLIGHT;

fn size_label(n: usize) -> String {
    if n.is_multiple_of(1 << 20) {
        format!("{}MiB", n >> 20)
    } else if n.is_multiple_of(1 << 10) {
        format!("{}KiB", n >> 10)
    } else {
        format!("{n}B")
    }
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / 1e9 / secs.max(1e-9)
}

/// Drops the page cache (root only). Returns whether it was dropped.
fn drop_caches() -> bool {
    let _ = std::process::Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").is_ok()
}

/// memcpy of the same bytes (the memory backend's physical limit).
fn memcpy_secs(src: &[u8], page_bytes: usize, pages: usize) -> Result<f64> {
    let mut dst = aligned_region(1, page_bytes)?;
    let per_batch = src.len() / page_bytes;
    dst.fill(1);
    let t = Instant::now();
    for i in 0..pages {
        dst.copy_from_slice(&src[(i % per_batch) * page_bytes..][..page_bytes]);
    }
    std::hint::black_box(&dst);
    Ok(t.elapsed().as_secs_f64())
}

/// Measures one phase of every reference candidate into the given read destinations: the
/// seconds of each, in the order of the candidates.
type Reference<'a> = dyn FnMut(Phase, &mut [u8]) -> Result<Vec<f64>> + 'a;

struct Round {
    /// Seconds of each reference candidate's write.
    write_refs: Vec<f64>,
    write: f64,
    /// Seconds of each reference candidate's read.
    read_refs: Vec<f64>,
    read: f64,
    exists_us: f64,
    dropped: bool,
}

#[allow(clippy::too_many_arguments)]
async fn backend_round(
    args: &StorageArgs,
    inflight: usize,
    storage: &dyn Storage,
    src: &[u8],
    dst: &mut [u8],
    (page_bytes, pages): (usize, usize),
    round: usize,
    reference: &mut Reference<'_>,
) -> Result<Round> {
    // Alternate which side goes first, so neither always meets the disk in the same state.
    let reference_first = round.is_multiple_of(2);
    let seed = round as u64;
    // `dst` holds one batch per read in flight; the reference reads into the first, as before.
    let slot_bytes = dst.len() / inflight;
    let mut write_ref = Vec::new();
    let mut read_ref = Vec::new();
    if reference_first {
        write_ref = reference(Phase::Write, &mut dst[..slot_bytes])?;
    }
    let batch = args.batch.min(storage.info().max_batch);
    let keys: Vec<PageKey> = (0..pages as u64).map(|i| seed_key(seed, i)).collect();
    let t = Instant::now();
    let mut writes = futures_util::stream::iter(keys.chunks(batch))
        .map(|chunk| async move {
            let bufs: Vec<PageBuf<'_>> = src
                .chunks(page_bytes)
                .take(chunk.len())
                .map(|c| PageBuf::contiguous(LAYOUT, c))
                .collect();
            storage.batch_set(chunk, &bufs).await
        })
        .buffer_unordered(inflight);
    while let Some(out) = writes.next().await {
        if let Some(o) = out?.iter().find(|o| **o != PageOutcome::Stored) {
            return Err(BenchError::CheckFailed(format!(
                "bench write not stored: {o:?}"
            )));
        }
    }
    drop(writes);
    let write = t.elapsed().as_secs_f64();
    if !reference_first {
        write_ref = reference(Phase::Write, &mut dst[..slot_bytes])?;
    }
    let mut dropped = drop_caches();
    if reference_first {
        read_ref = reference(Phase::Read, &mut dst[..slot_bytes])?;
        dropped &= drop_caches();
    }
    let t = Instant::now();
    {
        // Each read in flight takes a destination slot and gives it back: at most `inflight`
        // run at once, so one is always free.
        let slots = std::sync::Mutex::new(dst.chunks_mut(slot_bytes).collect::<Vec<_>>());
        let slots = &slots;
        let mut reads = futures_util::stream::iter(keys.chunks(batch))
            .map(|chunk| async move {
                let slot = slots
                    .lock()
                    .expect("no panic while held")
                    .pop()
                    .expect("a slot per read in flight");
                let mut bufs: Vec<PageBufMut<'_>> = slot
                    .chunks_mut(page_bytes)
                    .take(chunk.len())
                    .map(|c| PageBufMut::contiguous(LAYOUT, c))
                    .collect();
                let out = storage.batch_get(chunk, &mut bufs).await;
                drop(bufs);
                slots.lock().expect("no panic while held").push(slot);
                out
            })
            .buffer_unordered(inflight);
        while let Some(out) = reads.next().await {
            if let Some(o) = out?.iter().find(|o| **o != PageOutcome::Hit) {
                return Err(BenchError::CheckFailed(format!(
                    "bench read not a hit: {o:?}"
                )));
            }
        }
    }
    let read = t.elapsed().as_secs_f64();
    if !reference_first {
        dropped &= drop_caches();
        read_ref = reference(Phase::Read, &mut dst[..slot_bytes])?;
    }
    // Warm batch_exists of a full controller batch (128 keys).
    let probe = &keys[..keys.len().min(128)];
    let calls = 2000;
    let t = Instant::now();
    for _ in 0..calls {
        let n = storage.batch_exists(probe).await?;
        if n != probe.len() {
            return Err(BenchError::CheckFailed(format!(
                "batch_exists found {n} of {}",
                probe.len()
            )));
        }
    }
    let exists_us = t.elapsed().as_secs_f64() * 1e6 / calls as f64;
    Ok(Round {
        write_refs: write_ref,
        write,
        read_refs: read_ref,
        read,
        exists_us,
        dropped,
    })
}

/// Starts a 3-primary Redis Cluster on loopback when `--backend redis` names no `nodes`.
#[cfg(feature = "redis")]
fn spawn_redis_cluster(
    args: &StorageArgs,
) -> Result<Option<hicache_backend_redis::testing::RedisCluster>> {
    use hicache_backend_redis::testing::{RedisCluster, redis_available};
    let names_nodes = args
        .backend
        .extra_config
        .as_deref()
        .is_some_and(|c| c.contains("\"nodes\""));
    if args.backend.backend != "redis" || names_nodes {
        return Ok(None);
    }
    if !redis_available("storage --backend redis") {
        return Err(BenchError::Usage(
            "--backend redis without \"nodes\" starts a local cluster and needs redis-server"
                .into(),
        ));
    }
    Ok(Some(RedisCluster::start(3, 0, &[])))
}

/// `redis-benchmark` aimed at the first node of the cluster the backend uses (the spawned one,
/// or the extra-config's `nodes`), with `batch` connections (the backend's pages in flight).
fn redis_reference(
    args: &StorageArgs,
    spawned: Option<&Value>,
    batch: usize,
) -> Result<redis_benchmark::RedisBench> {
    let doc: Value = match (spawned, args.backend.extra_config.as_deref()) {
        (Some(nodes), _) => serde_json::json!({ "nodes": nodes }),
        (None, Some(c)) => {
            let text = match c.trim().strip_prefix('@') {
                Some(p) => std::fs::read_to_string(p).map_err(BenchError::io(p))?,
                None => c.to_string(),
            };
            serde_json::from_str(&text)
                .map_err(|e| BenchError::Usage(format!("--extra-config: {e}")))?
        }
        (None, None) => return Err(BenchError::Usage("--backend redis needs nodes".into())),
    };
    let node = match &doc["nodes"] {
        Value::String(s) => Some(s.clone()),
        Value::Array(a) => a.first().and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
    .ok_or_else(|| BenchError::Usage("--extra-config: `nodes` must name a node".into()))?;
    Ok(redis_benchmark::RedisBench {
        node,
        cluster: doc["cluster"].as_bool().unwrap_or(true),
        clients: batch.min(32),
    })
}

/// The stores a `storage` run wrote, removed when it ends (measured or failed).
struct Stores(Vec<PathBuf>);

impl Drop for Stores {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// Which half of the reference a round asks for.
#[derive(Copy, Clone, Debug)]
enum Phase {
    Write,
    Read,
}

/// Runs `storage`, writing the table or JSON lines to `out`.
pub fn run(args: &StorageArgs, mut out: impl Write) -> Result<Vec<Record>> {
    let total = parse_byte_size(&args.total)
        .ok_or_else(|| BenchError::Usage(format!("--total {:?} is not a byte size", args.total)))?;
    if total == 0 {
        return Err(BenchError::Usage(
            "--total must be at least one page (got 0 bytes)".into(),
        ));
    }
    let raw_depth = args.raw_depth;
    if args.batch == 0 || args.rounds == 0 || raw_depth == 0 || args.inflight == 0 {
        return Err(BenchError::Usage(
            "--batch, --rounds, --raw-depth and --inflight must be at least 1".into(),
        ));
    }
    let sizes = match args.page_bytes {
        Some(0) => return Err(BenchError::Usage("--page-bytes must be at least 1".into())),
        Some(n) => vec![n],
        None => vec![8 << 20, 256 << 10],
    };
    let file_like = !matches!(args.backend.backend.as_str(), "memory" | "rdma" | "redis");
    // Network backends are measured against raw TCP loopback of the same bytes.
    let rdma = matches!(args.backend.backend.as_str(), "rdma" | "redis");
    // `--backend redis` without `nodes`: a 3-primary cluster on loopback for the run.
    #[cfg(feature = "redis")]
    let _cluster = spawn_redis_cluster(args)?;
    #[cfg(feature = "redis")]
    let cluster_nodes: Option<Value> = _cluster.as_ref().map(|c| Value::from(c.seeds()));
    #[cfg(not(feature = "redis"))]
    let cluster_nodes: Option<Value> = None;
    // The redis backend's reference: redis-benchmark against the same cluster.
    let redis_ref = (args.backend.backend == "redis")
        .then(|| redis_reference(args, cluster_nodes.as_ref(), args.batch))
        .transpose()?;
    let base: Option<PathBuf> = args.backend.dir.clone();
    if file_like && base.is_none() {
        return Err(BenchError::Usage(format!(
            "--backend {} needs --dir (a directory on the disk to measure, not /dev/shm)",
            args.backend.backend
        )));
    }
    if let Some(b) = &base {
        std::fs::create_dir_all(b).map_err(BenchError::io(b))?;
    }
    let rt = runtime()?;
    let mut records = Vec::new();
    // Stores written, removed once everything is measured or on an error (see the round loop).
    let mut stores = Stores(Vec::new());
    for &page_bytes in &sizes {
        let pages = ((total / page_bytes as u64) as usize).max(args.batch);
        let bytes = pages
            .checked_mul(page_bytes)
            .and_then(|b| b.checked_mul(2))
            .ok_or_else(|| {
                BenchError::Usage(format!(
                    "--page-bytes {page_bytes} is too large: {pages} pages of it (at least \
                     --batch {}) overflow a {}-bit byte count",
                    args.batch,
                    usize::BITS
                ))
            })? as u64
            / 2;
        let batch_pages = args.batch.min(pages);
        // Source and destination pages in one mapping (one region to register).
        // No more read slots than batches (8 MiB pages: 2 batches of 128 in 2 GiB).
        let inflight = args.inflight.max(1).min(pages.div_ceil(batch_pages));
        let mut pool = aligned_region((1 + inflight) * batch_pages, page_bytes)?;
        let region = MemoryRegion {
            addr: pool.as_ptr() as usize,
            len: pool.len(),
            cuda_registered: false,
            huge_pages: false,
        };
        let (src, dst) = pool.split_at_mut(batch_pages * page_bytes);
        // Touch every destination page now, as an engine's host pool is (allocated and pinned
        // before it serves): otherwise the first read into each slot pays the page faults of
        // fresh anonymous memory inside the timed read (8 MiB pages, 2 batches in flight:
        // 0.93 GB/s instead of 2.8, where the reference reads into the slot it touched).
        dst.fill(0);
        for (i, c) in src.chunks_mut(page_bytes).enumerate() {
            pattern::fill_page(&seed_key(u64::MAX, i as u64), c);
        }
        let src: &[u8] = src;
        let mut rounds = Vec::new();
        let mut zero_copy = false;
        // Names of the reference candidates ("threads@32", "io_uring@128"), with their depth.
        let mut candidates: Vec<(String, &'static str, usize)> = Vec::new();
        for round in 0..args.rounds {
            // Each round writes a store of its own, and every store is removed only once the
            // whole run is measured: on ext4 without a journal a new inode skips every inode
            // deleted in the last minute whose table block is cached, one lookup each, under
            // the directory lock, so thousands of fresh deletions make each create of the next
            // minute scan them all (measured 0.2-0.4 GB/s instead of 1.2-1.5 for 256 KiB page
            // files; perf: `recently_deleted`). That would be the bench's own cleanup, not the
            // backend's write path (the raw reference creates no inodes). A run started within
            // a minute of another one's cleanup still meets it: leave a minute between runs.
            let store_dir = base
                .as_ref()
                .map(|b| b.join(format!("bench-store-{}-{round}", size_label(page_bytes))));
            if let Some(d) = &store_dir {
                let _ = std::fs::remove_dir_all(d);
                stores.0.push(d.clone());
                // Both sides start from a written-back disk.
                drop_caches();
            }
            let raw_path = base.as_ref().map(|b| b.join("bench-raw.bin"));
            let mut overrides: Vec<(&str, Value)> = Vec::new();
            if let Some(d) = &store_dir {
                overrides.push(("dir", Value::String(d.display().to_string())));
            }
            overrides.push(("capacity", Value::from(bytes * 2 + (64 << 20))));
            if let Some(n) = &cluster_nodes {
                overrides.push(("nodes", n.clone()));
            }
            let mut bargs = args.backend.clone();
            bargs.dir = None;
            // The raw candidates: the configured one, and io_uring at the backend's own depth
            // (one of them only where both would run the same engine at the same depth).
            let mut raws: Vec<Raw<'_>> = Vec::new();
            if let Some(path) = raw_path.as_deref() {
                for (engine, depth) in [
                    (args.raw_engine, raw_depth.min(batch_pages)),
                    (RawEngine::Uring, batch_pages),
                ] {
                    let r = Raw {
                        path,
                        page_bytes,
                        pages,
                        depth,
                        engine,
                    };
                    let e = r.effective_engine();
                    if !raws
                        .iter()
                        .any(|o| o.effective_engine() == e && o.depth == depth)
                    {
                        raws.push(r);
                    }
                }
            }
            candidates = if raws.is_empty() {
                let name = if redis_ref.is_some() {
                    "redis-benchmark"
                } else if rdma {
                    "tcp-loopback"
                } else {
                    "memcpy"
                };
                vec![(name.to_string(), name, 0)]
            } else {
                raws.iter()
                    .map(|r| {
                        let e = engine_name(r.effective_engine());
                        (format!("{e}@{}", r.depth), e, r.depth)
                    })
                    .collect()
            };
            let mut reference = |phase: Phase, dst: &mut [u8]| -> Result<Vec<f64>> {
                if raws.is_empty() {
                    let secs = if let Some(rb) = &redis_ref {
                        let op = match phase {
                            Phase::Write => redis_benchmark::Op::Set,
                            Phase::Read => redis_benchmark::Op::Get,
                        };
                        rb.secs(op, page_bytes, pages)?
                    } else if rdma {
                        tcp_loopback::secs(src, page_bytes, pages)?
                    } else {
                        memcpy_secs(src, page_bytes, pages)?
                    };
                    return Ok(vec![secs]);
                }
                raws.iter()
                    .map(|r| match phase {
                        Phase::Write => r.write(src),
                        Phase::Read => {
                            // Each candidate reads cold, like the backend.
                            drop_caches();
                            r.read(dst)
                        }
                    })
                    .collect()
            };
            let r = rt.block_on(async {
                let storage = bargs.open(&overrides, page_bytes).await?;
                if args.register_memory {
                    storage.register_memory(region)?;
                }
                zero_copy = storage.info().zero_copy;
                let r = backend_round(
                    args,
                    inflight,
                    &*storage,
                    src,
                    dst,
                    (page_bytes, pages),
                    round,
                    &mut reference,
                )
                .await;
                drop(storage);
                r
            })?;
            if let Some(p) = &raw_path {
                let _ = std::fs::remove_file(p);
            }
            rounds.push(r);
        }
        let best = |f: fn(&Round) -> f64| rounds.iter().map(f).fold(f64::INFINITY, f64::min);
        // The best seconds of candidate `i` over the rounds, for one phase.
        let best_ref = |f: fn(&Round) -> &Vec<f64>, i: usize| {
            rounds.iter().map(|r| f(r)[i]).fold(f64::INFINITY, f64::min)
        };
        // The headline reference of a phase: the stronger (higher GB/s) candidate, with every
        // candidate's figure beside it.
        let with_references = |r: Record, f: fn(&Round) -> &Vec<f64>| {
            let figures: Vec<f64> = (0..candidates.len())
                .map(|i| gbps(bytes, best_ref(f, i)))
                .collect();
            let strongest = (0..figures.len())
                .max_by(|&a, &b| figures[a].total_cmp(&figures[b]))
                .unwrap_or(0);
            let all: serde_json::Map<String, Value> = candidates
                .iter()
                .zip(&figures)
                .map(|((name, _, _), g)| (name.clone(), Value::from(*g)))
                .collect();
            let (name, engine, depth) = &candidates[strongest];
            let r = r
                .with_reference(figures[strongest])
                .with("reference_name", name.as_str())
                .with("references", Value::Object(all));
            if *depth > 0 {
                r.with("reference_engine", *engine)
                    .with("reference_depth", *depth as u64)
            } else {
                r
            }
        };
        let label = size_label(page_bytes);
        let b = &args.backend.backend;
        let reference = match (file_like, rdma) {
            (true, _) => "raw-odirect",
            _ if redis_ref.is_some() => "redis-benchmark",
            (false, true) => "tcp-loopback",
            (false, false) => "memcpy",
        };
        let cold = if rounds.iter().all(|r| r.dropped) {
            "drop_caches"
        } else {
            "o_direct-only"
        };
        let common = |r: Record| {
            r.with("pages", pages as u64)
                .with("page_bytes", page_bytes as u64)
                .with("bytes", bytes)
                .with("batch", args.batch as u64)
                .with("rounds", args.rounds as u64)
                .with("reference_kind", reference)
                .with("zero_copy", zero_copy)
                .with("registered", args.register_memory)
                .with("inflight", inflight as u64)
        };
        let common = |r: Record| match &args.backend.extra_config {
            Some(c) => common(r).with("extra_config", c.as_str()),
            None => common(r),
        };
        let mut write = with_references(
            common(Record::new(
                "storage",
                format!("{b}/write/{label}"),
                gbps(bytes, best(|r| r.write)),
                "GB/s",
            )),
            |r| &r.write_refs,
        );
        let mut read = with_references(
            common(Record::new(
                "storage",
                format!("{b}/read/{label}"),
                gbps(bytes, best(|r| r.read)),
                "GB/s",
            )),
            |r| &r.read_refs,
        );
        if file_like {
            write = write.with(
                "durable",
                "backend fsync policy; reference ends with fdatasync",
            );
            read = read.with("cold", cold);
        }
        records.push(write);
        records.push(read);
        records.push(
            Record::new(
                "storage",
                format!("{b}/exists128/{label}"),
                best(|r| r.exists_us),
                "us",
            )
            .with("target_us", 50.0)
            .with("warm", true),
        );
    }
    if args.json {
        for r in &records {
            writeln!(out, "{}", r.to_json_line()).map_err(BenchError::io("<stdout>"))?;
        }
    } else {
        writeln!(
            out,
            "{:<28} {:>10} {:>6} {:>10} {:>7}  reference name (every candidate, GB/s)",
            "case", "value", "unit", "reference", "ratio"
        )
        .map_err(BenchError::io("<stdout>"))?;
        for r in &records {
            let candidates = r
                .extra
                .get("references")
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| format!("{k} {:.3}", v.as_f64().unwrap_or(f64::NAN)))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default();
            let name = r
                .extra
                .get("reference_name")
                .and_then(Value::as_str)
                .unwrap_or("-");
            writeln!(
                out,
                "{:<28} {:>10.3} {:>6} {:>10} {:>7}  {name} ({candidates})",
                r.case,
                r.value,
                r.unit,
                r.reference.map_or("-".into(), |v| format!("{v:.3}")),
                r.ratio.map_or("-".into(), |v| format!("{v:.3}")),
            )
            .map_err(BenchError::io("<stdout>"))?;
        }
    }
    Ok(records)
}
