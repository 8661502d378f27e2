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
use hicache_storage::{
    MemoryRegion, PageBuf, PageBufMut, PageKey, PageOutcome, Storage, parse_byte_size, pattern,
};
use serde_json::Value;

use crate::cmd::storage_raw::{Raw, RawEngine, engine_name};
use crate::cmd::{redis_benchmark, tcp_loopback};
use crate::error::{BenchError, Result};
use crate::record::Record;
use hicache_cli::backend::{BackendArgs, LAYOUT, aligned_region, runtime, seed_key};

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

/// Bytes of destination the memcpy reference writes round: several times this machine class's
/// last-level cache (260 MiB), so its copies go to memory, as a store's pages do.
const MEMCPY_DST_BYTES: usize = 1 << 30;

/// memcpy of the same bytes (the memory backend's physical limit): every page copied from the
/// source batch into the next page of a destination of up to [`MEMCPY_DST_BYTES`], touched
/// before timing (already faulted in, as a store's memory is once it has served), so both
/// sides move each byte from memory to memory. A destination of one page (what this was
/// before) stays in the CPU cache and is no limit for a store holding gigabytes.
fn memcpy_secs(src: &[u8], page_bytes: usize, pages: usize) -> Result<f64> {
    let per_batch = src.len() / page_bytes;
    let slots = pages.min((MEMCPY_DST_BYTES / page_bytes).max(1));
    let mut dst = aligned_region(slots, page_bytes)?;
    dst.fill(1);
    let t = Instant::now();
    for i in 0..pages {
        dst[(i % slots) * page_bytes..][..page_bytes]
            .copy_from_slice(&src[(i % per_batch) * page_bytes..][..page_bytes]);
    }
    std::hint::black_box(&dst);
    Ok(t.elapsed().as_secs_f64())
}

/// Runs calls `0..n` in order, `inflight` at once, as the controller drives L3 (each batch its
/// own task on the L3 runtime, so a backend that blocks inside a call, as the local layouts
/// do, still has that many calls in flight): `inflight` lane threads each take the next call
/// and drive it to its end on the current runtime (`f(lane, call)`); results in call order.
/// Polling every call from one task instead (a `buffer_unordered` stream) ran the calls of a
/// blocking backend one at a time, whatever `inflight` said.
fn lanes<R, F, Fut>(inflight: usize, n: usize, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(usize, usize) -> Fut + Sync,
    Fut: std::future::Future<Output = R>,
{
    let handle = tokio::runtime::Handle::current();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<R>>> =
        (0..n).map(|_| std::sync::Mutex::new(None)).collect();
    let run = |lane: usize| loop {
        let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if c >= n {
            break;
        }
        let r = handle.block_on(f(lane, c));
        *results[c].lock().expect("no panic while held") = Some(r);
    };
    // The calling thread is inside the runtime (`block_on`): the lanes are threads of their
    // own, and this one only waits for them.
    tokio::task::block_in_place(|| {
        std::thread::scope(|s| {
            for lane in 0..inflight.clamp(1, n.max(1)) {
                let run = &run;
                s.spawn(move || run(lane));
            }
        })
    });
    results
        .into_iter()
        .map(|r| {
            r.into_inner()
                .expect("no panic while held")
                .expect("every call ran")
        })
        .collect()
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

/// The backend under measurement in one round, with the page counts of its page size.
struct BackendBench<'s> {
    args: &'s StorageArgs,
    reference: &'s RefKind,
    inflight: usize,
    storage: &'s dyn Storage,
    page_bytes: usize,
    pages: usize,
}

impl BackendBench<'_> {
    /// One round: write, read cold and probe every page of the round's seed, with the
    /// reference measured before or after each phase (alternating with the round, so neither
    /// side always meets the disk in the same state).
    async fn round(
        &self,
        src: &[u8],
        dst: &mut [u8],
        round: usize,
        reference: &mut Reference<'_>,
    ) -> Result<Round> {
        let reference_first = round.is_multiple_of(2);
        let seed = round as u64;
        // `dst` holds one batch per read in flight; the reference reads into the first.
        let slot_bytes = dst.len() / self.inflight;
        let mut write_ref = Vec::new();
        let mut read_ref = Vec::new();
        if reference_first {
            write_ref = reference(Phase::Write, &mut dst[..slot_bytes])?;
        }
        let keys: Vec<PageKey> = (0..self.pages as u64).map(|i| seed_key(seed, i)).collect();
        let write = self.write(&keys, src).await?;
        if !reference_first {
            write_ref = reference(Phase::Write, &mut dst[..slot_bytes])?;
        }
        let mut dropped = drop_caches();
        if reference_first {
            read_ref = reference(Phase::Read, &mut dst[..slot_bytes])?;
            dropped &= drop_caches();
        }
        let read = self.read(&keys, dst, slot_bytes).await?;
        if !reference_first {
            dropped &= drop_caches();
            read_ref = reference(Phase::Read, &mut dst[..slot_bytes])?;
        }
        Ok(Round {
            write_refs: write_ref,
            write,
            read_refs: read_ref,
            read,
            exists_us: self.exists(&keys).await?,
            dropped,
        })
    }

    /// Pages per backend batch.
    fn batch(&self) -> usize {
        self.args.batch.min(self.storage.info().max_batch)
    }

    /// Seconds to store every key (the source batch's pages, over and over), `inflight`
    /// batches at once, each call on its own lane (see [`lanes`]).
    async fn write(&self, keys: &[PageKey], src: &[u8]) -> Result<f64> {
        let (storage, page_bytes) = (self.storage, self.page_bytes);
        let chunks: Vec<&[PageKey]> = keys.chunks(self.batch()).collect();
        let chunks = &chunks;
        let t = Instant::now();
        let outs = lanes(self.inflight, chunks.len(), |_lane, c| async move {
            let chunk = chunks[c];
            let bufs: Vec<PageBuf<'_>> = src
                .chunks(page_bytes)
                .take(chunk.len())
                .map(|c| PageBuf::contiguous(LAYOUT, c))
                .collect();
            storage.batch_set(chunk, &bufs).await
        });
        let secs = t.elapsed().as_secs_f64();
        for out in outs {
            if let Some(o) = out?.iter().find(|o| **o != PageOutcome::Stored) {
                return Err(BenchError::check_failed(format!(
                    "bench write not stored: {o:?}"
                )));
            }
        }
        Ok(secs)
    }

    /// Seconds to read every key back, `inflight` batches at once (each on its own lane, see
    /// [`lanes`]), each lane into its own destination slot of `slot_bytes`. Every page must be
    /// a hit; misses are counted over the whole read.
    async fn read(&self, keys: &[PageKey], dst: &mut [u8], slot_bytes: usize) -> Result<f64> {
        let (storage, page_bytes) = (self.storage, self.page_bytes);
        let chunks: Vec<&[PageKey]> = keys.chunks(self.batch()).collect();
        let chunks = &chunks;
        // One destination slot per lane: a lane runs one batch at a time.
        let slots: Vec<std::sync::Mutex<&mut [u8]>> = dst
            .chunks_mut(slot_bytes)
            .take(self.inflight)
            .map(std::sync::Mutex::new)
            .collect();
        let slots = &slots;
        let t = Instant::now();
        let outs = lanes(self.inflight, chunks.len(), |lane, c| async move {
            let chunk = chunks[c];
            // The lane's own slot, taken for the call (no lock held across it) and put back.
            let slot: &mut [u8] =
                std::mem::take(&mut *slots[lane].lock().expect("no panic while held"));
            let mut bufs: Vec<PageBufMut<'_>> = slot
                .chunks_mut(page_bytes)
                .take(chunk.len())
                .map(|c| PageBufMut::contiguous(LAYOUT, c))
                .collect();
            let out = storage.batch_get(chunk, &mut bufs).await;
            drop(bufs);
            *slots[lane].lock().expect("no panic while held") = slot;
            out
        });
        let secs = t.elapsed().as_secs_f64();
        let mut misses = 0;
        for out in outs {
            for o in out? {
                match o {
                    PageOutcome::Hit => {}
                    PageOutcome::Miss => misses += 1,
                    o => {
                        return Err(BenchError::check_failed(format!(
                            "bench read not a hit: {o:?}"
                        )));
                    }
                }
            }
        }
        if misses > 0 {
            return Err(self.misses_error(misses));
        }
        Ok(secs)
    }

    /// The error of a read that missed pages the bench wrote and the backend acknowledged: on
    /// redis, the cluster evicted them (its `maxmemory` with an evicting policy holds less than
    /// the run writes).
    fn misses_error(&self, misses: usize) -> BenchError {
        let written = self.pages as f64 * self.page_bytes as f64 / (1u64 << 20) as f64;
        let RefKind::Redis(rb) = self.reference else {
            return BenchError::check_failed(format!(
                "bench read not a hit: {misses} of {} pages missed",
                self.pages
            ));
        };
        let info = rb
            .memory_report()
            .map(|m| format!(" (the cluster reports {m})"))
            .unwrap_or_default();
        BenchError::check_failed(format!(
            "the Redis cluster evicted pages the bench wrote: {misses} of {} pages ({written:.0} \
             MiB written this round) read back as misses{info}; its maxmemory with an evicting \
             policy holds less than the run writes: raise maxmemory or lower --total",
            self.pages
        ))
    }

    /// Microseconds of a warm `batch_exists` of a full controller batch (128 keys).
    async fn exists(&self, keys: &[PageKey]) -> Result<f64> {
        let probe = &keys[..keys.len().min(128)];
        let calls = 2000;
        let t = Instant::now();
        for _ in 0..calls {
            let n = self.storage.batch_exists(probe).await?;
            if n != probe.len() {
                return Err(BenchError::check_failed(format!(
                    "batch_exists found {n} of {}",
                    probe.len()
                )));
            }
        }
        Ok(t.elapsed().as_secs_f64() * 1e6 / calls as f64)
    }
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
        return Err(BenchError::usage(
            "--backend redis without \"nodes\" starts a local cluster and needs redis-server",
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
                .map_err(|e| BenchError::usage(format!("--extra-config: {e}")))?
        }
        (None, None) => return Err(BenchError::usage("--backend redis needs nodes")),
    };
    let node = match &doc["nodes"] {
        Value::String(s) => Some(s.clone()),
        Value::Array(a) => a.first().and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
    .ok_or_else(|| BenchError::usage("--extra-config: `nodes` must name a node"))?;
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
            if let Some(p) = d.parent() {
                // The stores' parent (see `stores_parent`), once empty.
                let _ = std::fs::remove_dir(p);
            }
        }
    }
}

/// A name part of this run's own (process id and start time, hex): ext4 picks the block
/// group of a directory made under an `FS_TOPDIR_FL` one from a hash of its name, so every
/// run's stores need names of their own to land apart.
fn run_tag() -> &'static str {
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TAG.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        format!("{:x}-{nanos:x}", std::process::id())
    })
}

/// `FS_TOPDIR_FL` (`linux/fs.h`): the directory is the top of a hierarchy, so ext4's Orlov
/// allocator spreads its subdirectories over block groups as it does those of the root.
const FS_TOPDIR_FL: libc::c_long = 0x0002_0000;

/// The directory the stores of a run go in, `BASE/bench-stores`, created with the
/// `FS_TOPDIR_FL` attribute where the file system takes it (ext4; elsewhere it is a plain
/// directory). ext4 without a journal skips, in every inode allocation, each inode of the
/// block group deleted in the last minute (five more while its inode-table block is dirty),
/// one buffer-cache lookup each under the group lock. A store made beside the last run's
/// (the same block group) therefore paid for that run's cleanup on every page file it
/// created: measured 0.27-0.36 of the reference instead of 0.7-1.0 for 256 KiB page files
/// with runs 10 s apart, and still 0.6-0.75 a minute after. With the flag, and a name of the
/// run's own ([`run_tag`]), each store's directory, and so its page files, land in a block
/// group of their own.
fn stores_parent(base: &std::path::Path) -> PathBuf {
    use std::os::fd::AsRawFd;
    let p = base.join("bench-stores");
    if std::fs::create_dir_all(&p).is_ok()
        && let Ok(dir) = std::fs::File::open(&p)
    {
        let mut flags: libc::c_long = 0;
        // SAFETY: FS_IOC_GETFLAGS and FS_IOC_SETFLAGS read and write one `long` through the
        // pointer, which lives for the call, on a descriptor this function holds open.
        unsafe {
            if libc::ioctl(dir.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) == 0 {
                flags |= FS_TOPDIR_FL;
                libc::ioctl(dir.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags);
            }
        }
    }
    p
}

/// Which half of the reference a round asks for.
#[derive(Copy, Clone, Debug)]
enum Phase {
    Write,
    Read,
}

/// The physical limit a backend is measured against.
enum RefKind {
    /// Raw O_DIRECT I/O of the same bytes in the same directory (file-system backends).
    RawODirect,
    /// `redis-benchmark` against the same cluster.
    Redis(redis_benchmark::RedisBench),
    /// Raw TCP loopback of the same bytes (rdma).
    TcpLoopback,
    /// memcpy of the same bytes (memory).
    Memcpy,
}

impl RefKind {
    /// The `reference_kind` recorded with every figure.
    fn name(&self) -> &'static str {
        match self {
            RefKind::RawODirect => "raw-odirect",
            RefKind::Redis(_) => "redis-benchmark",
            RefKind::TcpLoopback => "tcp-loopback",
            RefKind::Memcpy => "memcpy",
        }
    }

    /// The seconds of one phase of a reference that is not raw I/O.
    fn secs(&self, phase: Phase, src: &[u8], page_bytes: usize, pages: usize) -> Result<f64> {
        match self {
            RefKind::Redis(rb) => {
                let op = match phase {
                    Phase::Write => redis_benchmark::Op::Set,
                    Phase::Read => redis_benchmark::Op::Get,
                };
                rb.secs(op, page_bytes, pages)
            }
            RefKind::TcpLoopback => tcp_loopback::secs(src, page_bytes, pages),
            RefKind::Memcpy | RefKind::RawODirect => memcpy_secs(src, page_bytes, pages),
        }
    }
}

/// What every page size of a run shares: the byte total, where stores go, the reference and
/// the nodes of a cluster started for the run.
struct Target {
    total: u64,
    base: Option<PathBuf>,
    reference: RefKind,
    cluster_nodes: Option<Value>,
}

/// The page sizes to measure, after checking the numeric flags.
fn sizes_of(args: &StorageArgs) -> Result<(u64, Vec<usize>)> {
    let total = parse_byte_size(&args.total)
        .ok_or_else(|| BenchError::usage(format!("--total {:?} is not a byte size", args.total)))?;
    if total == 0 {
        return Err(BenchError::usage(
            "--total must be at least one page (got 0 bytes)",
        ));
    }
    if args.batch == 0 || args.rounds == 0 || args.raw_depth == 0 || args.inflight == 0 {
        return Err(BenchError::usage(
            "--batch, --rounds, --raw-depth and --inflight must be at least 1",
        ));
    }
    let sizes = match args.page_bytes {
        Some(0) => return Err(BenchError::usage("--page-bytes must be at least 1")),
        Some(n) => vec![n],
        None => vec![8 << 20, 256 << 10],
    };
    Ok((total, sizes))
}

/// The reference of `--backend` and its store directory (file-system backends need `--dir`).
fn target_of(args: &StorageArgs, total: u64, cluster_nodes: Option<Value>) -> Result<Target> {
    let backend = args.backend.backend.as_str();
    let reference = match backend {
        "redis" => RefKind::Redis(redis_reference(args, cluster_nodes.as_ref(), args.batch)?),
        "rdma" => RefKind::TcpLoopback,
        "memory" => RefKind::Memcpy,
        _ => RefKind::RawODirect,
    };
    let base: Option<PathBuf> = args.backend.dir.clone();
    if matches!(reference, RefKind::RawODirect) && base.is_none() {
        return Err(BenchError::usage(format!(
            "--backend {backend} needs --dir (a directory on the disk to measure, not /dev/shm)"
        )));
    }
    if let Some(b) = &base {
        std::fs::create_dir_all(b).map_err(BenchError::io(b))?;
    }
    Ok(Target {
        total,
        base,
        reference,
        cluster_nodes,
    })
}

/// Runs `storage`, writing the table or JSON lines to `out`.
pub fn run(args: &StorageArgs, mut out: impl Write) -> Result<Vec<Record>> {
    let (total, sizes) = sizes_of(args)?;
    // `--backend redis` without `nodes`: a 3-primary cluster on loopback for the run.
    #[cfg(feature = "redis")]
    let _cluster = spawn_redis_cluster(args)?;
    #[cfg(feature = "redis")]
    let cluster_nodes: Option<Value> = _cluster.as_ref().map(|c| Value::from(c.seeds()));
    #[cfg(not(feature = "redis"))]
    let cluster_nodes: Option<Value> = None;
    let target = target_of(args, total, cluster_nodes)?;
    let rt = runtime()?;
    let mut records = Vec::new();
    // Stores written, removed once everything is measured or on an error (see `SizeRun::round`).
    let mut stores = Stores(Vec::new());
    for &page_bytes in &sizes {
        let mut size = SizeRun::new(args, &target, page_bytes)?;
        let rounds = (0..args.rounds)
            .map(|round| size.round(&rt, round, &mut stores))
            .collect::<Result<Vec<_>>>()?;
        records.extend(size.records(&rounds));
    }
    print_records(&records, args.json, &mut out)?;
    Ok(records)
}

/// One page size of a run: its page counts and the page buffers (source batch and read slots
/// in one mapping, one region to register).
struct SizeRun<'a> {
    args: &'a StorageArgs,
    target: &'a Target,
    page_bytes: usize,
    pages: usize,
    /// Bytes written (and read) per round.
    bytes: u64,
    batch_pages: usize,
    inflight: usize,
    pool: memmap2::MmapMut,
    zero_copy: bool,
    /// Names of the reference candidates ("threads@32", "io_uring@128"), with engine and depth.
    candidates: Vec<(String, &'static str, usize)>,
}

impl<'a> SizeRun<'a> {
    fn new(args: &'a StorageArgs, target: &'a Target, page_bytes: usize) -> Result<Self> {
        let pages = ((target.total / page_bytes as u64) as usize).max(args.batch);
        let bytes = pages
            .checked_mul(page_bytes)
            .and_then(|b| b.checked_mul(2))
            .ok_or_else(|| {
                BenchError::usage(format!(
                    "--page-bytes {page_bytes} is too large: {pages} pages of it (at least \
                     --batch {}) overflow a {}-bit byte count",
                    args.batch,
                    usize::BITS
                ))
            })? as u64
            / 2;
        let batch_pages = args.batch.min(pages);
        // No more read slots than batches (8 MiB pages: 2 batches of 128 in 2 GiB).
        let inflight = args.inflight.max(1).min(pages.div_ceil(batch_pages));
        let mut pool = aligned_region((1 + inflight) * batch_pages, page_bytes)?;
        let (src, dst) = pool.split_at_mut(batch_pages * page_bytes);
        // Touch every destination page now, as an engine's host pool is (allocated and pinned
        // before it serves): otherwise the first read into each slot pays the page faults of
        // fresh anonymous memory inside the timed read (8 MiB pages, 2 batches in flight:
        // 0.93 GB/s instead of 2.8, where the reference reads into the slot it touched).
        dst.fill(0);
        for (i, c) in src.chunks_mut(page_bytes).enumerate() {
            pattern::fill_page(&seed_key(u64::MAX, i as u64), c);
        }
        Ok(SizeRun {
            args,
            target,
            page_bytes,
            pages,
            bytes,
            batch_pages,
            inflight,
            pool,
            zero_copy: false,
            candidates: Vec::new(),
        })
    }

    /// The raw candidates: the configured one, and io_uring at the backend's own depth (one of
    /// them only where both would run the same engine at the same depth).
    fn raws<'p>(&self, path: &'p std::path::Path) -> Vec<Raw<'p>> {
        let mut raws: Vec<Raw<'p>> = Vec::new();
        for (engine, depth) in [
            (
                self.args.raw_engine,
                self.args.raw_depth.min(self.batch_pages),
            ),
            (RawEngine::Uring, self.batch_pages),
        ] {
            let r = Raw {
                path,
                page_bytes: self.page_bytes,
                pages: self.pages,
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
        raws
    }

    /// The backend's configuration for `round`: its own store directory, room for what it
    /// writes, the cluster's nodes.
    fn overrides(&self, store_dir: Option<&PathBuf>) -> Vec<(&'static str, Value)> {
        let mut overrides: Vec<(&str, Value)> = Vec::new();
        if let Some(d) = store_dir {
            overrides.push(("dir", Value::String(d.display().to_string())));
        }
        overrides.push(("capacity", Value::from(self.bytes * 2 + (64 << 20))));
        if let Some(n) = &self.target.cluster_nodes {
            overrides.push(("nodes", n.clone()));
        }
        overrides
    }

    /// One round: the reference candidates and the backend back to back on a fresh store.
    fn round(
        &mut self,
        rt: &tokio::runtime::Runtime,
        round: usize,
        stores: &mut Stores,
    ) -> Result<Round> {
        // Each round writes a store of its own, and every store is removed only once the
        // whole run is measured: on ext4 without a journal a new inode skips every inode
        // deleted in the last minute whose table block is cached, one lookup each, under
        // the directory lock, so thousands of fresh deletions make each create of the next
        // minute scan them all (measured 0.2-0.4 GB/s instead of 1.2-1.5 for 256 KiB page
        // files; perf: `recently_deleted`). That would be the bench's own cleanup, not the
        // backend's write path (the raw reference creates no inodes). Another run's cleanup
        // (up to six minutes old: five more while the inode-table block is dirty) is kept
        // away by `stores_parent` and `run_tag`: each store lands in a block group of its own.
        let base = self.target.base.as_ref();
        let store_dir = base.map(|b| {
            stores_parent(b).join(format!(
                "bench-store-{}-{round}-{}",
                size_label(self.page_bytes),
                run_tag()
            ))
        });
        if let Some(d) = &store_dir {
            let _ = std::fs::remove_dir_all(d);
            stores.0.push(d.clone());
            // Both sides start from a written-back disk.
            drop_caches();
        }
        let raw_path = base.map(|b| b.join("bench-raw.bin"));
        let overrides = self.overrides(store_dir.as_ref());
        let raws = raw_path
            .as_deref()
            .map(|p| self.raws(p))
            .unwrap_or_default();
        self.candidates = if raws.is_empty() {
            let name = self.target.reference.name();
            vec![(name.to_string(), name, 0)]
        } else {
            raws.iter()
                .map(|r| {
                    let e = engine_name(r.effective_engine());
                    (format!("{e}@{}", r.depth), e, r.depth)
                })
                .collect()
        };
        let r = self.backend_round(rt, round, &raws, &overrides);
        if let Some(p) = &raw_path {
            let _ = std::fs::remove_file(p);
        }
        r
    }

    /// Opens the backend and measures it next to the reference candidates `raws` (or the
    /// target's reference where there is no raw I/O).
    fn backend_round(
        &mut self,
        rt: &tokio::runtime::Runtime,
        round: usize,
        raws: &[Raw<'_>],
        overrides: &[(&str, Value)],
    ) -> Result<Round> {
        let (page_bytes, pages) = (self.page_bytes, self.pages);
        let region = MemoryRegion {
            addr: self.pool.as_ptr() as usize,
            len: self.pool.len(),
            cuda_registered: false,
            huge_pages: false,
        };
        let (src, dst) = self.pool.split_at_mut(self.batch_pages * page_bytes);
        let src: &[u8] = src;
        let target = self.target;
        let mut reference = |phase: Phase, dst: &mut [u8]| -> Result<Vec<f64>> {
            if raws.is_empty() {
                return Ok(vec![target.reference.secs(phase, src, page_bytes, pages)?]);
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
        let mut bargs = self.args.backend.clone();
        bargs.dir = None;
        let (args, inflight) = (self.args, self.inflight);
        let mut zero_copy = false;
        let r = rt.block_on(async {
            let storage = bargs.open(overrides, page_bytes).await?;
            if args.register_memory {
                storage.register_memory(region)?;
            }
            zero_copy = storage.info().zero_copy;
            let bench = BackendBench {
                args,
                reference: &target.reference,
                inflight,
                storage: &*storage,
                page_bytes,
                pages,
            };
            bench.round(src, dst, round, &mut reference).await
        });
        self.zero_copy = zero_copy;
        r
    }

    /// The write, read and exists records of this page size: the best round of each, against
    /// the stronger reference candidate.
    fn records(&self, rounds: &[Round]) -> Vec<Record> {
        let args = self.args;
        let best = |f: fn(&Round) -> f64| rounds.iter().map(f).fold(f64::INFINITY, f64::min);
        let label = size_label(self.page_bytes);
        let b = &args.backend.backend;
        let file_like = matches!(self.target.reference, RefKind::RawODirect);
        let common = |r: Record| {
            let r = r
                .with("pages", self.pages as u64)
                .with("page_bytes", self.page_bytes as u64)
                .with("bytes", self.bytes)
                .with("batch", args.batch as u64)
                .with("rounds", args.rounds as u64)
                .with("reference_kind", self.target.reference.name())
                .with("zero_copy", self.zero_copy)
                .with("registered", args.register_memory)
                .with("inflight", self.inflight as u64);
            match &args.backend.extra_config {
                Some(c) => r.with("extra_config", c.as_str()),
                None => r,
            }
        };
        let figure = |phase: &str, f: fn(&Round) -> f64| {
            let value = gbps(self.bytes, best(f));
            common(Record::new(
                "storage",
                format!("{b}/{phase}/{label}"),
                value,
                "GB/s",
            ))
        };
        let mut write =
            self.with_references(figure("write", |r| r.write), rounds, |r| &r.write_refs);
        let mut read = self.with_references(figure("read", |r| r.read), rounds, |r| &r.read_refs);
        if file_like {
            write = write.with(
                "durable",
                "backend fsync policy; reference ends with fdatasync",
            );
            let cold = if rounds.iter().all(|r| r.dropped) {
                "drop_caches"
            } else {
                "o_direct-only"
            };
            read = read.with("cold", cold);
        }
        let exists = Record::new(
            "storage",
            format!("{b}/exists128/{label}"),
            best(|r| r.exists_us),
            "us",
        )
        .with("target_us", 50.0)
        .with("warm", true);
        vec![write, read, exists]
    }

    /// `r` with the headline reference of a phase: the stronger (higher GB/s) candidate, with
    /// every candidate's figure beside it.
    fn with_references(&self, r: Record, rounds: &[Round], f: fn(&Round) -> &Vec<f64>) -> Record {
        let best_ref = |i: usize| rounds.iter().map(|r| f(r)[i]).fold(f64::INFINITY, f64::min);
        let figures: Vec<f64> = (0..self.candidates.len())
            .map(|i| gbps(self.bytes, best_ref(i)))
            .collect();
        let strongest = (0..figures.len())
            .max_by(|&a, &b| figures[a].total_cmp(&figures[b]))
            .unwrap_or(0);
        let all: serde_json::Map<String, Value> = self
            .candidates
            .iter()
            .zip(&figures)
            .map(|((name, _, _), g)| (name.clone(), Value::from(*g)))
            .collect();
        let (name, engine, depth) = &self.candidates[strongest];
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
    }
}

/// Prints the records as JSON lines or as a table with every reference candidate.
fn print_records(records: &[Record], json: bool, out: &mut dyn Write) -> Result<()> {
    let io = BenchError::io("<stdout>");
    let mut w = |s: String| writeln!(out, "{s}");
    if json {
        return records
            .iter()
            .try_for_each(|r| w(r.to_json_line()))
            .map_err(io);
    }
    let header = format!(
        "{:<28} {:>10} {:>6} {:>10} {:>7}  reference name (every candidate, GB/s)",
        "case", "value", "unit", "reference", "ratio"
    );
    std::iter::once(header)
        .chain(records.iter().map(table_row))
        .try_for_each(w)
        .map_err(io)
}

/// One record's row of the table.
fn table_row(r: &Record) -> String {
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
    format!(
        "{:<28} {:>10.3} {:>6} {:>10} {:>7}  {name} ({candidates})",
        r.case,
        r.value,
        r.unit,
        r.reference.map_or("-".into(), |v| format!("{v:.3}")),
        r.ratio.map_or("-".into(), |v| format!("{v:.3}")),
    )
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    /// Calls that block their thread (as the local layouts' `batch_set` does) still run
    /// `inflight` at once, and the results come back in call order. Polling them from one
    /// task (what `write` did before) ran them one at a time: most at once 1.
    #[test]
    fn lanes_keep_blocking_calls_in_flight() {
        let rt = runtime().unwrap();
        let (active, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let out = rt.block_on(async {
            lanes(4, 12, |lane, c| {
                let (active, most) = (&active, &most);
                async move {
                    let now = active.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    // Blocks the thread, as a blocking backend does inside its call.
                    std::thread::sleep(Duration::from_millis(40));
                    active.fetch_sub(1, Ordering::SeqCst);
                    (lane, c)
                }
            })
        });
        assert_eq!(most.load(Ordering::SeqCst), 4, "four calls in flight");
        assert_eq!(
            out.iter().map(|o| o.1).collect::<Vec<_>>(),
            (0..12).collect::<Vec<_>>()
        );
        assert!(out.iter().all(|o| o.0 < 4), "four lanes");
        // Fewer calls than lanes, and none at all.
        assert_eq!(
            rt.block_on(async { lanes(4, 1, |_, c| async move { c }) }),
            [0]
        );
        assert!(
            rt.block_on(async { lanes(4, 0, |_, c| async move { c }) })
                .is_empty()
        );
    }

    /// The stores' parent is made (with the top-of-hierarchy attribute where the file system
    /// takes it) and goes once its stores are removed.
    #[test]
    fn stores_parent_is_made_and_removed_with_its_stores() {
        let base = tempfile::tempdir().unwrap();
        let p = stores_parent(base.path());
        assert_eq!(p, base.path().join("bench-stores"));
        assert!(p.is_dir());
        let store = p.join("bench-store-256KiB-0");
        std::fs::create_dir_all(store.join("pages")).unwrap();
        std::fs::write(store.join("pages/x"), b"x").unwrap();
        drop(Stores(vec![store]));
        assert!(!p.exists(), "the parent went with its last store");
    }
}
