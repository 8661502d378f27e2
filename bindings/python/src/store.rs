//! `Store`: one opened L3 backend, callable from Python threads concurrently.
//!
//! Invariants:
//! 1. Every I/O call runs with the GIL released (`Python::detach`) on this store's tokio
//!    runtime, so SGLang's three controller threads overlap their I/O.
//! 2. The backend lives behind a read-write lock: a call holds the read side for as long as it
//!    uses the backend (taken and released with the GIL released); `close` takes the write
//!    side, so it waits for the calls in flight, then drops the backend: when `close` returns
//!    the backend is closed (its directory lock released). Every later call is a
//!    `RuntimeError` saying the store is closed.
//! 3. Batches longer than the backend's `max_batch` are split, never refused.
//! 4. Prefix keys given with a call (SGLang's `extra_info.prefix_keys`) reach the backend
//!    with every batch it is split into, extended by the call's own keys before that batch.
//! 5. Memory: once `set_allowed_regions` (once) or `add_allowed_regions` (any number of
//!    times: one call per host pool, e.g. the pools of a hybrid model registered one after
//!    another) has registered the caller's pools, every piece of
//!    `batch_get_into`/`batch_set_from` must lie inside them ([`Pieces::new`], before any
//!    pointer is dereferenced). The registered memory only ever grows: no call removes a
//!    region, so a piece checked against it stays inside registered memory. The bytes calls (`get_bytes`,
//!    `batch_get_bytes`, `set_bytes`, `batch_set_bytes`) use memory this crate or Python owns
//!    and are not restricted. A read length is bounded by [`MAX_PAGE_BYTES`] and the
//!    backend's largest page before anything is allocated, and allocated fallibly: a length
//!    no page can have is a `ValueError`, memory that is not available a `MemoryError`; never
//!    an abort or a panic. A bytes read allocates only for the pages the backend has (asked
//!    first, [`Store::read_owned`]) and a call asks for at most [`MAX_CALL_BYTES`]
//!    (`keys × length`, refused before anything is asked or allocated).
//! 6. Regions are memory of this process: every registered region must lie wholly inside
//!    readable and writable mappings of this process when it is registered
//!    ([`crate::maps`]); a region that is not (one covering the whole address space, an
//!    unmapped address) is a `ValueError`. The fence then promises that no piece lies outside
//!    memory that was this process's when registered; it cannot see memory the caller
//!    unmaps later (the caller keeps registered buffers alive, as it promises).
//! 7. Threads and time: a store runs on [`IO_THREADS`] runtime threads, at most
//!    [`MAX_BLOCKING_THREADS`] blocking-pool threads, and [`JOB_WORKERS`] job workers (the
//!    jobs' bounded queue: [`crate::jobs`]). `close(grace_s)` waits at most `grace_s` for
//!    the jobs queued and the calls in flight, then fails the jobs still queued and cancels
//!    the backend calls still waiting (their futures are dropped: a network backend's
//!    requests stop at once; a backend call blocked in a system call ends with that call),
//!    so a stalled backend cannot hold `close` beyond that.

mod pool_io;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hicache_core::{LayoutKind, NamespaceId, PageHash, PageKey};
use hicache_storage::{
    BackendContext, BackendInfo, BatchContext, MemoryBackend, MemoryOptions, PageOutcome, Storage,
    StorageConfig,
};
use parking_lot::{MappedRwLockReadGuard, RwLock, RwLockReadGuard};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::backends;
use crate::error::{BindingError, Result};
use crate::host_pools::{HostPool, PieceRule};
use crate::identity;
use crate::jobs::{Completion, JOB_WORKERS, JobQueue, Jobs, Submit};
use crate::pages::Pieces;
use crate::regions::Regions;

/// The largest page the bytes calls read (1 GiB): far above any KV page (a DeepSeek-V3 MLA page
/// of 64 tokens is 4.5 MiB), far below what would exhaust a host by one wrong length.
pub const MAX_PAGE_BYTES: usize = 1 << 30;

/// The most one bytes read (`batch_get_bytes`, `get_bytes`) may ask for, `keys × length`
/// (1 GiB): a longer read is refused before anything is allocated (invariant 5); callers split
/// larger reads.
pub const MAX_CALL_BYTES: usize = 1 << 30;

/// Worker threads of a store's tokio runtime (invariant 7).
pub const IO_THREADS: usize = 2;

/// The most blocking-pool threads a store's runtime starts (invariant 7): backends that block
/// (`block_in_place`, file opens) share them; more waiting work queues.
pub const MAX_BLOCKING_THREADS: usize = 16;

/// How long `close` waits by default for the jobs and calls in flight before it cancels them
/// (invariant 7).
pub const DEFAULT_CLOSE_GRACE: Duration = Duration::from_secs(5);

/// An opened hicache-rs L3 backend.
#[pyclass(frozen, module = "hicache_rs._native")]
pub struct Store {
    backend: RwLock<Option<Arc<dyn Storage>>>,
    info: BackendInfo,
    runtime: tokio::runtime::Runtime,
    /// The same backend when it is the memory backend, for [`Store::contexts_seen`].
    memory: Option<Arc<MemoryBackend>>,
    /// The memory the zero-copy calls may touch, once registered; it only grows
    /// (invariant 5).
    regions: RwLock<Option<Regions>>,
    /// Whether `set_allowed_regions` (the once-only call) was made.
    regions_set_once: parking_lot::Mutex<bool>,
    /// The asynchronous jobs (`submit_job`) in flight and their completions.
    jobs: Arc<Jobs>,
    /// The bounded queue and fixed workers that run the jobs (invariant 7).
    queue: JobQueue,
    /// Set by `close` once its grace ran out: every backend call still waiting is cancelled.
    cancel: tokio::sync::watch::Sender<bool>,
    /// The host pools whose pieces this store makes itself (`add_pool`), by name; they are
    /// only ever added.
    pools: RwLock<HashMap<String, Arc<HostPool>>>,
}

/// Parses the keys of a batch under one namespace.
fn page_keys(namespace: &str, hashes: &[String]) -> Result<Vec<PageKey>> {
    let ns = NamespaceId::from_hex(namespace)
        .map_err(|_| BindingError::BadNamespace(namespace.chars().take(80).collect()))?;
    hashes
        .iter()
        .enumerate()
        .map(|(index, h)| {
            PageHash::from_hex(h)
                .map(|h| PageKey::new(ns, h))
                .map_err(|_| BindingError::BadKey {
                    index,
                    key: h.chars().take(80).collect(),
                })
        })
        .collect()
}

/// The keys of a job whose keys each have their own namespace (`namespaces[i]` for
/// `hashes[i]`).
fn keys_each(op: &'static str, namespaces: &[String], hashes: &[String]) -> Result<Vec<PageKey>> {
    if namespaces.len() != hashes.len() {
        return Err(BindingError::NamespaceCount {
            op,
            keys: hashes.len(),
            namespaces: namespaces.len(),
        });
    }
    let mut keys = Vec::with_capacity(hashes.len());
    for (index, (ns, h)) in namespaces.iter().zip(hashes).enumerate() {
        let key = page_keys(ns, std::slice::from_ref(h)).map_err(|e| match e {
            BindingError::BadKey { key, .. } => BindingError::BadKey { index, key },
            e => e,
        })?;
        keys.extend(key);
    }
    Ok(keys)
}

/// `len` zero bytes, or [`BindingError::OutOfMemory`] when they cannot be had (never an
/// abort: the allocation is fallible).
fn alloc_zeroed(op: &'static str, len: usize) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(len)
        .map_err(|_| BindingError::OutOfMemory { op, bytes: len })?;
    buf.resize(len, 0);
    Ok(buf)
}

/// The keys of one call after its prefix keys, and the call's extra info: batch `[at, ..)` of
/// the call goes with the prefix keys `prefix ++ keys[..at]` (invariant 4).
struct Call {
    chain: Vec<PageKey>,
    base: usize,
    pass: bool,
    extra_info: Option<String>,
}

impl Call {
    /// The call's keys `hashes` under `namespace`, after `prefix` (SGLang's prefix keys).
    fn new(
        namespace: &str,
        hashes: &[String],
        prefix: Option<Vec<String>>,
        extra_info: Option<String>,
    ) -> Result<Self> {
        let mut chain = match &prefix {
            Some(p) => page_keys(namespace, p).map_err(|e| match e {
                BindingError::BadKey { index, key } => BindingError::BadPrefixKey { index, key },
                e => e,
            })?,
            None => Vec::new(),
        };
        let base = chain.len();
        chain.extend(page_keys(namespace, hashes)?);
        Ok(Self {
            chain,
            base,
            pass: prefix.is_some(),
            extra_info,
        })
    }

    /// A call of `keys` (each under its own namespace) without prefix keys or extra info.
    fn from_keys(chain: Vec<PageKey>) -> Self {
        Self {
            chain,
            base: 0,
            pass: false,
            extra_info: None,
        }
    }

    fn keys(&self) -> &[PageKey] {
        &self.chain[self.base..]
    }

    /// The same call with only its first `n` keys (`n <= keys().len()`).
    fn truncated(&self, n: usize) -> Self {
        Self {
            chain: self.chain[..(self.base + n).min(self.chain.len())].to_vec(),
            base: self.base,
            pass: self.pass,
            extra_info: self.extra_info.clone(),
        }
    }

    /// The context of the batch starting at the call's key `at`.
    fn context(&self, at: usize) -> BatchContext<'_> {
        let mut c = if self.pass {
            BatchContext::with_prefix_keys(&self.chain[..self.base + at])
        } else {
            BatchContext::NONE
        };
        if let Some(e) = &self.extra_info {
            c = c.extra_info(e);
        }
        c
    }
}

impl Store {
    /// The open backend, held for as long as the returned guard lives (invariant 2): `close`
    /// waits for every guard to go. A guard is only ever taken and dropped without the GIL
    /// held, or without blocking on anything while held, so `close` cannot deadlock with a
    /// call that needs the GIL to finish.
    fn backend(&self, op: &'static str) -> Result<MappedRwLockReadGuard<'_, Arc<dyn Storage>>> {
        RwLockReadGuard::try_map(self.backend.read(), Option::as_ref)
            .map_err(|_| BindingError::Closed(op))
    }

    fn max_batch(&self) -> usize {
        self.info.max_batch.max(1)
    }

    /// Runs `fut` (a backend call of `op`) on the store's runtime until it ends or `close`
    /// cancels it (invariant 7): a cancelled call is [`BindingError::Cancelled`].
    fn run<T>(&self, op: &'static str, fut: impl Future<Output = Result<T>>) -> Result<T> {
        let mut cancelled = self.cancel.subscribe();
        self.runtime.block_on(async move {
            tokio::select! {
                r = fut => r,
                // `wait_for` also ends when the sender is gone, which cannot happen while
                // `self` lives; either way the call is over.
                _ = cancelled.wait_for(|c| *c) => Err(BindingError::Cancelled(op)),
            }
        })
    }

    fn exists(&self, call: &Call) -> Result<usize> {
        let backend = self.backend("batch_exists")?;
        self.run("batch_exists", async {
            let mut total = 0;
            for (i, chunk) in call.keys().chunks(self.max_batch()).enumerate() {
                let ctx = call.context(i * self.max_batch());
                let n = backend.batch_exists_with(chunk, ctx).await?;
                total += n;
                if n < chunk.len() {
                    break;
                }
            }
            Ok(total)
        })
    }

    /// Per-key presence (see `Store.batch_exists_each`): windows of `max_batch` keys, the
    /// keys of a window asked concurrently, one key per backend call.
    fn exists_each(&self, call: &Call) -> Result<Vec<bool>> {
        let backend = self.backend("batch_exists")?;
        let keys = call.keys();
        self.run("batch_exists", async {
            let mut present = Vec::with_capacity(keys.len());
            let step = self.max_batch();
            for (w, window) in keys.chunks(step).enumerate() {
                let asks = window.iter().enumerate().map(|(j, key)| {
                    let ctx = call.context(w * step + j);
                    let backend = &*backend;
                    async move {
                        backend
                            .batch_exists_with(std::slice::from_ref(key), ctx)
                            .await
                    }
                });
                for n in futures_util::future::join_all(asks).await {
                    present.push(n? == 1);
                }
            }
            Ok(present)
        })
    }

    fn get_into(&self, call: &Call, layout: LayoutKind, pieces: &Pieces) -> Result<Vec<bool>> {
        let keys = call.keys();
        let backend = self.backend("batch_get")?;
        // SAFETY: the pieces are either pool memory the Python caller keeps alive and leaves
        // alone for this call (the contract of `Store.batch_get_into`; inside the registered
        // regions when there are some) or a buffer of `read_owned` that outlives the call; the
        // views die before we return.
        let mut dst = unsafe { pieces.destinations("batch_get", layout)? };
        // A cancelled call drops the backend's future before `dst` dies: no write into the
        // pieces can follow the return.
        self.run("batch_get", async {
            let mut hits = Vec::with_capacity(keys.len());
            let step = self.max_batch();
            for (i, (k, d)) in keys.chunks(step).zip(dst.chunks_mut(step)).enumerate() {
                let outcomes = backend.batch_get_with(k, d, call.context(i * step)).await?;
                hits.extend(outcomes.iter().map(|o| matches!(o, PageOutcome::Hit)));
            }
            Ok(hits)
        })
    }

    /// The longest page the bytes calls read: [`MAX_PAGE_BYTES`], or less when the backend's
    /// pages are smaller (0 means no backend limit).
    fn max_read_len(&self) -> usize {
        match self.info.max_page_bytes {
            0 => MAX_PAGE_BYTES,
            m => m.min(MAX_PAGE_BYTES),
        }
    }

    /// Reads the pages of `call` that the backend has, `length` bytes each, into one new
    /// buffer holding only them (invariant 5: the length and the call's total are bounded
    /// before anything is asked or allocated, the presence of every page is asked first, and
    /// the buffer is allocated fallibly). Returns the buffer and, per key, the page's offset
    /// in it when it was read.
    fn read_owned(
        &self,
        op: &'static str,
        call: &Call,
        layout: LayoutKind,
        length: usize,
    ) -> Result<(Vec<u8>, Vec<Option<usize>>)> {
        let max = self.max_read_len();
        if length == 0 || length > max {
            return Err(BindingError::BadLength { op, length, max });
        }
        let n = call.keys().len();
        match n.checked_mul(length) {
            Some(total) if total <= MAX_CALL_BYTES => {}
            _ => {
                return Err(BindingError::CallTooLarge {
                    op,
                    keys: n,
                    length,
                    max: MAX_CALL_BYTES,
                });
            }
        }
        let present = self.exists_each(call)?;
        let wanted: Vec<PageKey> = call
            .keys()
            .iter()
            .zip(&present)
            .filter(|(_, p)| **p)
            .map(|(k, _)| *k)
            .collect();
        let mut at = vec![None; n];
        if wanted.is_empty() {
            return Ok((Vec::new(), at));
        }
        let m = wanted.len();
        // At most `n × length`, bounded above.
        let mut buf = alloc_zeroed(op, m * length)?;
        let base = buf.as_mut_ptr() as usize;
        let ptrs = (0..m).map(|i| base + i * length).collect();
        // Our own buffer: not subject to the registered regions.
        let pieces = Pieces::new(op, m, ptrs, vec![length; m], false, None)?;
        let hits = self.get_into(&Call::from_keys(wanted), layout, &pieces)?;
        let mut slot = 0;
        for (i, p) in present.iter().enumerate() {
            if *p {
                if hits[slot] {
                    at[i] = Some(slot * length);
                }
                slot += 1;
            }
        }
        Ok((buf, at))
    }

    /// Writes one page from each of `pages`, memory Python owns and keeps alive and unchanged
    /// for the call (`bytes` objects): not subject to the registered regions (invariant 5).
    fn set_owned(
        &self,
        py: Python<'_>,
        op: &'static str,
        call: &Call,
        layout: LayoutKind,
        pages: &[&[u8]],
    ) -> Result<Vec<bool>> {
        let ptrs = pages.iter().map(|p| p.as_ptr() as usize).collect();
        let sizes = pages.iter().map(|p| p.len()).collect();
        let pieces = Pieces::new(op, pages.len(), ptrs, sizes, false, None)?;
        py.detach(|| self.set_from(call, layout, &pieces))
    }

    fn set_from(&self, call: &Call, layout: LayoutKind, pieces: &Pieces) -> Result<Vec<bool>> {
        let keys = call.keys();
        let backend = self.backend("batch_set")?;
        // SAFETY: as in `get_into`: live, readable caller memory not written during the call.
        let src = unsafe { pieces.sources(layout) };
        self.run("batch_set", async {
            let mut ok = Vec::with_capacity(keys.len());
            let step = self.max_batch();
            for (i, (k, s)) in keys.chunks(step).zip(src.chunks(step)).enumerate() {
                let outcomes = backend.batch_set_with(k, s, call.context(i * step)).await?;
                ok.extend(
                    outcomes
                        .iter()
                        .map(|o| matches!(o, PageOutcome::Stored | PageOutcome::Present)),
                );
            }
            Ok(ok)
        })
    }
}

#[pymethods]
impl Store {
    /// Opens the backend an extra-config names, exactly as hicache-rs' own extra-config:
    /// `{"backend": "file", "dir": "/var/cache/kv", ...}`. Unknown fields are errors.
    /// `page_bytes`, `layout` and the ranks describe the deployment to the backend.
    #[new]
    #[pyo3(signature = (extra_config, page_bytes=0, layout="page_first", tp_rank=0, tp_size=1, pp_rank=0, pp_size=1))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        extra_config: &str,
        page_bytes: usize,
        layout: &str,
        tp_rank: u32,
        tp_size: u32,
        pp_rank: u32,
        pp_size: u32,
    ) -> PyResult<Self> {
        let layout = identity::layout(layout)?;
        let config = StorageConfig::parse(None, Some(extra_config)).map_err(BindingError::from)?;
        let registry = backends::registry()?;
        backends::check_compiled(&registry, &config.backend)?;
        let ctx = BackendContext {
            page_bytes,
            layout,
            tp_rank,
            tp_size,
            pp_rank,
            pp_size,
            ..BackendContext::default()
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(IO_THREADS)
            .max_blocking_threads(MAX_BLOCKING_THREADS)
            .thread_name("hicache-py-io")
            .enable_all()
            .build()
            .map_err(BindingError::Runtime)?;
        // The memory backend is opened here, as its registry factory would, so that the
        // contexts it records (`record_contexts`) can be read back (`contexts_seen`).
        let (backend, memory): (Arc<dyn Storage>, _) = if config.backend == "memory" {
            let options = MemoryOptions::from_config(&config.common, config.backend_fields)
                .map_err(BindingError::from)?;
            let m = Arc::new(MemoryBackend::new(options));
            (m.clone(), Some(m))
        } else {
            let b = py
                .detach(|| runtime.block_on(registry.open(&config, &ctx)))
                .map_err(BindingError::from)?;
            (b, None)
        };
        Ok(Self {
            info: backend.info(),
            backend: RwLock::new(Some(backend)),
            runtime,
            memory,
            regions: RwLock::new(None),
            regions_set_once: parking_lot::Mutex::new(false),
            jobs: Arc::new(Jobs::default()),
            queue: JobQueue::default(),
            cancel: tokio::sync::watch::Sender::new(false),
            pools: RwLock::new(HashMap::new()),
        })
    }

    /// Registers the memory the zero-copy calls may read and write: `(address, length)` pairs,
    /// e.g. the host pool's KV buffer(s). From then on a piece of `batch_get_into` or
    /// `batch_set_from` not wholly inside one of them is a `ValueError` and nothing is read
    /// or written. Once per store: a second call is a `ValueError` (pools registered later
    /// use `add_allowed_regions`). Every region must be readable and writable memory mapped
    /// by this process now (`/proc/self/maps`); anything else is a `ValueError`.
    fn set_allowed_regions(&self, regions: Vec<(usize, usize)>) -> PyResult<()> {
        let r = Regions::new(&regions)?;
        crate::maps::check_mapped(&regions)?;
        let mut once = self.regions_set_once.lock();
        let mut current = self.regions.write();
        if *once || current.is_some() {
            let had = current.as_ref().map(Regions::describe).unwrap_or_default();
            return Err(BindingError::RegionsAlreadySet(had).into());
        }
        *current = Some(r);
        *once = true;
        Ok(())
    }

    /// Adds `(address, length)` pairs to the memory the zero-copy calls may read and write
    /// (the buffers of a host pool registered after the first, e.g. a hybrid model's Mamba
    /// or indexer pool). Registers the first regions when none are yet. Regions are never
    /// removed: the caller keeps every registered buffer alive as long as the store. Every
    /// region must be memory of this process, as in `set_allowed_regions`.
    fn add_allowed_regions(&self, regions: Vec<(usize, usize)>) -> PyResult<()> {
        let added = Regions::new(&regions)?;
        crate::maps::check_mapped(&regions)?;
        let mut current = self.regions.write();
        let merged = match current.as_ref() {
            Some(r) => r.union(&added),
            None => added,
        };
        *current = Some(merged);
        Ok(())
    }

    /// The registered regions as sorted, merged `(address, length)` pairs, or `None` when
    /// none were registered (the zero-copy calls then trust their pointers).
    #[getter]
    fn allowed_regions(&self) -> Option<Vec<(usize, usize)>> {
        self.regions.read().as_ref().map(Regions::spans)
    }

    /// The batch contexts the backend received since the last call, oldest first: one dict per
    /// call (`op`, `keys`, `prefix_keys` (a list, or `None`), `extra_info`), page hashes as hex.
    /// Only for the memory backend opened with `"record_contexts": true` (tests, debugging).
    fn contexts_seen<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let m = match &self.memory {
            Some(m) if m.contexts().is_enabled() => m,
            _ => {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "contexts_seen needs the memory backend opened with \"record_contexts\": true",
                ));
            }
        };
        let hex = |ks: &[PageKey]| ks.iter().map(|k| k.hash.to_hex()).collect::<Vec<_>>();
        m.contexts()
            .take()
            .into_iter()
            .map(|c| {
                let d = PyDict::new(py);
                d.set_item("op", c.op)?;
                d.set_item("keys", hex(&c.keys))?;
                d.set_item("prefix_keys", c.prefix_keys.as_deref().map(hex))?;
                d.set_item("extra_info", c.extra_info)?;
                Ok(d)
            })
            .collect()
    }

    /// The backend's name and capabilities.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("name", &self.info.name)?;
        d.set_item("zero_copy", self.info.zero_copy)?;
        d.set_item("persistent", self.info.persistent)?;
        d.set_item("shared", self.info.shared)?;
        d.set_item("max_batch", self.info.max_batch)?;
        d.set_item("capacity_bytes", self.info.capacity_bytes)?;
        d.set_item("clear", self.info.clear)?;
        d.set_item("batch_context", self.info.batch_context)?;
        Ok(d)
    }

    /// Number of leading `hashes` (64-hex page hashes) present under `namespace` (32 hex).
    /// `prefix_keys`: the hashes of the request's pages before `hashes[0]` (SGLang's
    /// `extra_info.prefix_keys`), passed to the backend with every batch; `extra_info`: opaque
    /// text passed with them.
    #[pyo3(signature = (namespace, hashes, prefix_keys=None, extra_info=None))]
    fn batch_exists(
        &self,
        py: Python<'_>,
        namespace: &str,
        hashes: Vec<String>,
        prefix_keys: Option<Vec<String>>,
        extra_info: Option<String>,
    ) -> PyResult<usize> {
        let call = Call::new(namespace, &hashes, prefix_keys, extra_info)?;
        Ok(py.detach(|| self.exists(&call))?)
    }

    /// Whether each of `hashes` is present under `namespace`: one bool per key, in order (not
    /// only the leading run `batch_exists` answers). The keys are asked one per backend call,
    /// at most `max_batch` of them at a time, concurrently; each call carries the prefix keys
    /// before its key (`prefix_keys` then the earlier `hashes`), as `batch_exists` does.
    #[pyo3(signature = (namespace, hashes, prefix_keys=None, extra_info=None))]
    fn batch_exists_each(
        &self,
        py: Python<'_>,
        namespace: &str,
        hashes: Vec<String>,
        prefix_keys: Option<Vec<String>>,
        extra_info: Option<String>,
    ) -> PyResult<Vec<bool>> {
        let call = Call::new(namespace, &hashes, prefix_keys, extra_info)?;
        Ok(py.detach(|| self.exists_each(&call))?)
    }

    /// Reads pages straight into caller memory: page `i` is pieces `i*n .. (i+1)*n` of
    /// `ptrs`/`sizes` (`n = len(ptrs) / len(hashes)`). One bool per page: `True` means every
    /// byte of the page was written. The caller keeps that memory alive and untouched for the
    /// call. `kv_interleaved`: the pieces are K0, V0, K1, V1, … (MHA `layer_first`).
    #[pyo3(signature = (namespace, hashes, layout, ptrs, sizes, kv_interleaved=false, prefix_keys=None, extra_info=None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_get_into(
        &self,
        py: Python<'_>,
        namespace: &str,
        hashes: Vec<String>,
        layout: &str,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        kv_interleaved: bool,
        prefix_keys: Option<Vec<String>>,
        extra_info: Option<String>,
    ) -> PyResult<Vec<bool>> {
        let call = Call::new(namespace, &hashes, prefix_keys, extra_info)?;
        let layout = identity::layout(layout)?;
        let pieces = Pieces::new(
            "batch_get",
            hashes.len(),
            ptrs,
            sizes,
            kv_interleaved,
            self.regions.read().as_ref(),
        )?;
        Ok(py.detach(|| self.get_into(&call, layout, &pieces))?)
    }

    /// Writes pages straight from caller memory (same piece convention as `batch_get_into`).
    /// One bool per page: `True` means stored (or already present).
    #[pyo3(signature = (namespace, hashes, layout, ptrs, sizes, kv_interleaved=false, prefix_keys=None, extra_info=None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_set_from(
        &self,
        py: Python<'_>,
        namespace: &str,
        hashes: Vec<String>,
        layout: &str,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        kv_interleaved: bool,
        prefix_keys: Option<Vec<String>>,
        extra_info: Option<String>,
    ) -> PyResult<Vec<bool>> {
        let call = Call::new(namespace, &hashes, prefix_keys, extra_info)?;
        let layout = identity::layout(layout)?;
        let pieces = Pieces::new(
            "batch_set",
            hashes.len(),
            ptrs,
            sizes,
            kv_interleaved,
            self.regions.read().as_ref(),
        )?;
        Ok(py.detach(|| self.set_from(&call, layout, &pieces))?)
    }

    /// Registers host pool `name` for the one-call batch methods (`pool_io`, `pool_exists`):
    /// its pages are stored under `namespace` (32 hex) in `layout`; a page is `page_size`
    /// token slots of the pool's `tokens`; `pieces` are `(base, stride, size)` triples, page
    /// `p`'s piece being `size` bytes at `base + p × stride`, in SGLang's order (empty for a
    /// pool only asked for presence). A name registers once (`ValueError` after); a geometry
    /// that cannot hold a page or overflows the address space is a `ValueError`. Pieces are
    /// still checked against the allowed regions at every call.
    #[pyo3(signature = (name, namespace, layout, page_size, tokens, pieces, kv_interleaved=false))]
    #[allow(clippy::too_many_arguments)]
    fn add_pool(
        &self,
        name: String,
        namespace: String,
        layout: &str,
        page_size: usize,
        tokens: usize,
        pieces: Vec<(usize, usize, usize)>,
        kv_interleaved: bool,
    ) -> PyResult<()> {
        let layout = identity::layout(layout)?;
        let rules = pieces
            .into_iter()
            .map(|(base, stride, size)| PieceRule { base, stride, size })
            .collect();
        let pool = HostPool::new(
            name,
            namespace,
            layout,
            page_size,
            tokens,
            rules,
            kv_interleaved,
        )?;
        let mut pools = self.pools.write();
        if pools.contains_key(&pool.name) {
            return Err(BindingError::PoolRegistered(pool.name).into());
        }
        pools.insert(pool.name.clone(), Arc::new(pool));
        Ok(())
    }

    /// Reads (`write=False`) or writes the pages of every transfer in place, in one call
    /// with the GIL released once. `transfers`: SGLang's `PoolTransfer`s (`name`, `keys`,
    /// `host_indices`) or `(name, keys, host_indices)` tuples, each of a pool registered
    /// with `add_pool`. Returns `({pool: [bool per key]}, [(pool, error)])`: the second list
    /// names the transfers whose backend failed (answered all `False`). Returns `None`,
    /// before any I/O, for a call this path does not take (an unregistered pool, a pool named
    /// twice, host indices that are not whole pages of the pool, a count mismatch): the
    /// caller's own path decides then. Malformed keys and pieces outside the allowed regions
    /// are a `ValueError`, a closed store a `RuntimeError`.
    #[pyo3(signature = (write, transfers, prefix_keys=None, extra_info=None))]
    fn pool_io<'py>(
        &self,
        py: Python<'py>,
        write: bool,
        transfers: &Bound<'py, PyAny>,
        prefix_keys: Option<&Bound<'py, PyAny>>,
        extra_info: Option<String>,
    ) -> PyResult<Option<(Bound<'py, PyDict>, Vec<pool_io::Failure>)>> {
        drop(self.backend(if write { "batch_set" } else { "batch_get" })?);
        let prefix = pool_io::prefix_keys(prefix_keys)?;
        self.pool_io_call(py, write, transfers, prefix, extra_info)
    }

    /// SGLang's `batch_exists_v2` in one call: the leading run of `keys` in pool `kv`, then
    /// each transfer's hit policy (`all_pages`, `trailing_pages`, `block_groups`), each pool
    /// asked only when the walk reaches it. Returns `(kv_hit_pages, extra_pool_hit_pages,
    /// restorable_prefix_pages, [(pool, error)])`, a failing backend counting as absent
    /// pages; `None` for a call this path does not take (as `pool_io`).
    #[pyo3(signature = (kv, keys, transfers, prefix_keys=None, extra_info=None))]
    #[allow(clippy::type_complexity)]
    fn pool_exists<'py>(
        &self,
        py: Python<'py>,
        kv: &str,
        keys: &Bound<'py, PyAny>,
        transfers: &Bound<'py, PyAny>,
        prefix_keys: Option<&Bound<'py, PyAny>>,
        extra_info: Option<String>,
    ) -> PyResult<Option<(usize, Bound<'py, PyDict>, Vec<usize>, Vec<pool_io::Failure>)>> {
        drop(self.backend("batch_exists")?);
        let prefix = pool_io::prefix_keys(prefix_keys)?;
        self.pool_exists_call(py, kv, keys, transfers, prefix, extra_info)
    }

    /// Starts an asynchronous job and returns at once: a load (`load=True`: reads page `i`
    /// into `ptrs[i]`, `sizes[i]` bytes) or a store (writes page `i` from that memory), key
    /// `i` being `hashes[i]` under `namespaces[i]`. The job runs on the store's I/O threads
    /// without the GIL; its outcome is queued for `take_completed`. The caller keeps the
    /// memory alive and leaves it alone (a load's destination unread, a store's source
    /// unwritten) until the job's completion is taken. Bad input (counts, keys, a piece
    /// outside the registered regions) is a `ValueError` here and no job starts; a closed
    /// store is a `RuntimeError`; a backend failure is a failed completion. Jobs run on a
    /// fixed set of worker threads from a bounded queue: when the queue is full the job is
    /// refused at once with a `RuntimeError` saying so (no completion will come for it),
    /// never waited for.
    #[pyo3(signature = (job_id, load, namespaces, hashes, ptrs, sizes))]
    #[allow(clippy::too_many_arguments)]
    fn submit_job(
        slf: &Bound<'_, Self>,
        job_id: u64,
        load: bool,
        namespaces: Vec<String>,
        hashes: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<()> {
        let this = slf.get();
        let op = if load {
            "submit_job(load)"
        } else {
            "submit_job(store)"
        };
        drop(this.backend(op)?);
        let call = Call::from_keys(keys_each(op, &namespaces, &hashes)?);
        let pieces = Pieces::new(
            op,
            hashes.len(),
            ptrs,
            sizes,
            false,
            this.regions.read().as_ref(),
        )?;
        let store: Py<Store> = slf.clone().unbind();
        let ticket = this.jobs.start(job_id, hashes.len());
        let work = Box::new(move || {
            let s = store.get();
            let outcome = if load {
                s.get_into(&call, LayoutKind::PageFirst, &pieces)
            } else {
                s.set_from(&call, LayoutKind::PageFirst, &pieces)
            };
            // Without the GIL: pyo3 defers this reference's release to the next holder of
            // the GIL, so the store is never dropped on one of its own threads.
            drop(store);
            outcome.map_err(|e| e.to_string())
        });
        match this
            .queue
            .submit(ticket, work)
            .map_err(BindingError::Runtime)?
        {
            Submit::Queued => Ok(()),
            Submit::Full => Err(BindingError::JobQueueFull {
                op,
                capacity: crate::jobs::JOB_QUEUE_CAPACITY,
                workers: JOB_WORKERS,
            }
            .into()),
            Submit::Closed => Err(BindingError::Closed(op).into()),
        }
    }

    /// The asynchronous jobs finished since the last call, oldest first: `(job_id, ok,
    /// seconds, error)` with one bool per key in `ok` (page read in full, or stored) and
    /// `error` the message of a failure of the whole job (then every bool is `False`).
    fn take_completed(&self) -> Vec<(u64, Vec<bool>, f64, Option<String>)> {
        self.jobs
            .take()
            .into_iter()
            .map(|c: Completion| (c.job_id, c.ok, c.seconds, c.error))
            .collect()
    }

    /// Blocks (without the GIL) until no asynchronous job is in flight; woken by the last
    /// job to finish.
    fn wait_idle(&self, py: Python<'_>) {
        py.detach(|| self.jobs.wait_idle());
    }

    /// Asynchronous jobs started and not yet finished.
    #[getter]
    fn jobs_in_flight(&self) -> usize {
        self.jobs.in_flight()
    }

    /// Worker threads running this store's jobs: 0 before the first job, then a fixed
    /// number, however many jobs are submitted.
    #[getter]
    fn job_workers(&self) -> usize {
        self.queue.workers()
    }

    /// Reads one page of `length` bytes into new `bytes` (for tools), or `None` on a miss.
    /// A length of 0 or above the largest page (1 GiB, or the backend's limit) is a
    /// `ValueError`; memory that cannot be allocated a `MemoryError`. Memory is allocated
    /// only when the backend has the page.
    fn get_bytes<'py>(
        &self,
        py: Python<'py>,
        namespace: &str,
        hash: String,
        layout: &str,
        length: usize,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let call = Call::new(namespace, std::slice::from_ref(&hash), None, None)?;
        let layout = identity::layout(layout)?;
        let (buf, at) = py.detach(|| self.read_owned("get_bytes", &call, layout, length))?;
        Ok(at[0].map(|o| PyBytes::new(py, &buf[o..o + length])))
    }

    /// Reads pages of `length` bytes each into new `bytes`, `None` for a miss (the legacy
    /// tensor path, tools). Lengths are bounded as in `get_bytes`; a call of `len(hashes) ×
    /// length` above 1 GiB is a `ValueError` (split it); memory is allocated only for the
    /// pages the backend has.
    fn batch_get_bytes<'py>(
        &self,
        py: Python<'py>,
        namespace: &str,
        hashes: Vec<String>,
        layout: &str,
        length: usize,
    ) -> PyResult<Vec<Option<Bound<'py, PyBytes>>>> {
        let call = Call::new(namespace, &hashes, None, None)?;
        let layout = identity::layout(layout)?;
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        let (buf, at) = py.detach(|| self.read_owned("batch_get_bytes", &call, layout, length))?;
        Ok(at
            .into_iter()
            .map(|o| o.map(|o| PyBytes::new(py, &buf[o..o + length])))
            .collect())
    }

    /// Writes one page from `data` (for tools); `True` when stored or already present.
    fn set_bytes(
        &self,
        py: Python<'_>,
        namespace: &str,
        hash: String,
        layout: &str,
        data: &[u8],
    ) -> PyResult<bool> {
        let call = Call::new(namespace, std::slice::from_ref(&hash), None, None)?;
        let layout = identity::layout(layout)?;
        Ok(self.set_owned(py, "set_bytes", &call, layout, &[data])?[0])
    }

    /// Writes pages from `bytes` objects, one per hash (the legacy tensor path, tools); one
    /// bool per page: `True` when stored or already present.
    fn batch_set_bytes(
        &self,
        py: Python<'_>,
        namespace: &str,
        hashes: Vec<String>,
        layout: &str,
        pages: Vec<Bound<'_, PyBytes>>,
    ) -> PyResult<Vec<bool>> {
        let call = Call::new(namespace, &hashes, None, None)?;
        let layout = identity::layout(layout)?;
        if pages.len() != hashes.len() {
            return Err(BindingError::PieceCount {
                op: "batch_set_bytes",
                keys: hashes.len(),
                pieces: pages.len(),
                sizes: pages.len(),
            }
            .into());
        }
        // `pages` holds the `bytes` objects (immutable) alive until we return.
        let data: Vec<&[u8]> = pages.iter().map(|p| p.as_bytes()).collect();
        Ok(self.set_owned(py, "batch_set_bytes", &call, layout, &data)?)
    }

    /// Deletes pages; returns how many were present.
    fn delete(&self, py: Python<'_>, namespace: &str, hashes: Vec<String>) -> PyResult<usize> {
        let keys = page_keys(namespace, &hashes)?;
        let n = py.detach(|| {
            let backend = self.backend("delete")?;
            self.run("delete", async {
                let mut n = 0;
                for chunk in keys.chunks(self.max_batch()) {
                    n += backend.delete(chunk).await?;
                }
                Ok::<_, BindingError>(n)
            })
        })?;
        Ok(n)
    }

    /// Removes every page of `namespace` (32 hex) from the backend, whoever wrote it; returns
    /// how many were removed. A backend without the capability (`info()["clear"]` false)
    /// raises `RuntimeError` naming it.
    fn clear(&self, py: Python<'_>, namespace: &str) -> PyResult<u64> {
        let ns = NamespaceId::from_hex(namespace)
            .map_err(|_| BindingError::BadNamespace(namespace.chars().take(80).collect()))?;
        let n = py.detach(|| {
            let backend = self.backend("clear")?;
            self.run("clear", async {
                backend.clear(ns).await.map_err(BindingError::from)
            })
        })?;
        Ok(n)
    }

    /// The backend's counters (pages, bytes, hits, misses, corrupt pages, …) as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.backend("stats")?.stats();
        let value = serde_json::to_value(&stats)
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(format!("stats: {e}")))?;
        let d = PyDict::new(py);
        if let serde_json::Value::Object(map) = value {
            for (k, v) in map {
                d.set_item(k, v.as_u64())?;
            }
        }
        Ok(d)
    }

    /// Closes the backend; later calls raise `RuntimeError`. Waits up to `grace_s` seconds
    /// for the calls in flight and the asynchronous jobs (queued ones too) to end; after
    /// that, the jobs still queued fail without running and the backend calls still waiting
    /// are cancelled (a failed completion, a `RuntimeError`), so a stalled backend holds
    /// `close` for about `grace_s`, not for its own timeouts. When `close` returns no job or
    /// call uses the backend any more and the backend is really closed (its directory lock
    /// released: a new store may open the same directory at once). Idempotent.
    #[pyo3(signature = (grace_s=DEFAULT_CLOSE_GRACE.as_secs_f64()))]
    fn close(&self, py: Python<'_>, grace_s: f64) -> PyResult<()> {
        if !(grace_s.is_finite() && (0.0..=86_400.0).contains(&grace_s)) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "close: grace_s = {grace_s} is not a number of seconds from 0 to 86400"
            )));
        }
        let deadline = Instant::now() + Duration::from_secs_f64(grace_s);
        // Without the GIL: waiting for calls in flight, and dropping a backend (which may
        // flush files or close connections), must not stop other Python threads.
        py.detach(|| {
            self.queue.stop_accepting();
            let mut guard = None;
            if self.jobs.wait_idle_until(deadline) {
                guard = self.backend.try_write_until(deadline);
            }
            let mut guard = guard.unwrap_or_else(|| {
                // Grace is over: what waits is failed or cancelled (invariant 7).
                self.queue.fail_waiting();
                self.cancel.send_replace(true);
                self.jobs.wait_idle();
                self.backend.write()
            });
            let taken = guard.take();
            drop(guard);
            drop(taken);
            self.queue.join();
        });
        Ok(())
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.backend.read().is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allocation_that_cannot_be_had_is_an_error_not_an_abort() {
        assert_eq!(alloc_zeroed("t", 16).unwrap(), vec![0; 16]);
        for len in [usize::MAX, isize::MAX as usize, 1 << 62] {
            let e = alloc_zeroed("get_bytes", len).unwrap_err();
            assert!(matches!(e, BindingError::OutOfMemory { .. }), "{e}");
            assert!(!e.is_bad_input());
            assert!(e.to_string().contains("cannot allocate"), "{e}");
        }
    }
}
