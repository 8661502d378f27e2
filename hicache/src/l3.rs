//! L3: the attached storage backend, prefetches (L3 → L2) and backups (L2 → L3).
//!
//! Background work runs on a small tokio runtime owned by the cache; the engine thread never
//! blocks on storage. Every operation has a shared state the engine thread reads in `poll`;
//! every decision that changes the tree is taken on the engine thread from counts all ranks
//! agreed on (see [`crate::tick`]).
//!
//! Invariants:
//! 1. **Anchor.** A prefetch fetches the pages after `last_host_node` (the deepest backed-up
//!    node of the match), chained from that node's last page hash, and inserts them under that
//!    same node. SGLang starts the tokens after the device *and* host match but chains from and
//!    inserts under `last_host_node` (spec §13): when device-only nodes sit between the two
//!    the chain skips their tokens and every lookup misses. Here tokens, chain and anchor
//!    always agree; pages that are on device without a host copy are fetched too and adopted
//!    as their host copies by the tree.
//! 2. **Page ownership in a prefetch.** Host pages are allocated only after the hit is known
//!    (lazy), and only for the hit. The fetch task writes page `i` only while `i ≥ completed`;
//!    `completed` advances under the state lock and never after `terminated` is set. On
//!    termination the engine thread owns pages `[0, completed)` (inserts the agreed prefix,
//!    frees the rest); the task owns `[completed, n)` and hands them back when it exits.
//! 3. **Backups.** The host pages of a node being copied to L3 are host-protected until the
//!    agreed ack; the task only reads them.
//! 4. **Capacity.** In-flight prefetches hold at most `prefetch_capacity_ratio` of the host
//!    pool, counted in allocated hit pages (not candidate tokens, as SGLang does).
//! 5. **Rank-replicated KV.** MLA KV is the same on every TP rank (and so is its namespace):
//!    only rank 0 writes it to L3. Every other rank still tracks each backup (done at once),
//!    pins its nodes and finishes it at the agreed count, so that all ranks count the same
//!    backups and keep the same host pins (SGLang: "others still ack").

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use hicache_core::{
    FinishedBackup, KvEvent, KvKind, MatchResult, Medium, NamespaceId, NodeId, PageHash,
    PageHasher, PageKey, PrefetchConfig, PrefetchPolicy, TenantId,
};
use hicache_host::{HostPool, HostSlot};
use hicache_storage::{BackendContext, LayoutKind, PageBuf, PageBufMut, Storage, StorageConfig};
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::cache::{HiCache, RequestId};
use crate::error::{HiCacheError, Result};
use crate::metrics::{Direction, PrefetchOutcome};

/// What a lookup found.
#[derive(Debug, Default)]
pub(crate) struct QueryResult {
    pub hashes: Vec<PageHash>,
    pub hit_pages: usize,
}

#[derive(Debug, Default)]
pub(crate) struct FetchState {
    /// Host pages to fetch into, set by the engine thread once the hit is known.
    pub slots: Option<Vec<HostSlot>>,
    /// Pages fetched, from the first (invariant 2).
    pub completed: usize,
    /// The task stopped fetching (all done, a miss, an error, or terminated).
    pub done: bool,
    /// Set by the engine thread: stop, and never advance `completed` again.
    pub terminated: bool,
    /// The task met a storage error.
    pub failed: bool,
    /// Pages the task hands back when it exits (`slots[completed..]`).
    pub leftover: Option<Vec<HostSlot>>,
    /// The task exited.
    pub exited: bool,
}

/// State shared between a prefetch's task and the engine thread.
#[derive(Debug, Default)]
pub(crate) struct FetchShared {
    pub query: Mutex<Option<QueryResult>>,
    pub state: Mutex<FetchState>,
    pub notify: Notify,
}

#[derive(Debug)]
pub(crate) enum Phase {
    Querying,
    Fetching { host: Vec<HostSlot> },
}

/// A prefetch tracked by the engine thread.
#[derive(Debug)]
pub(crate) struct PrefetchOp {
    pub req: RequestId,
    pub tenant: TenantId,
    pub anchor: NodeId,
    /// Tokens after the anchor (whole pages).
    pub tokens: Vec<u32>,
    pub started: Instant,
    pub shared: Arc<FetchShared>,
    pub phase: Phase,
}

/// State shared between a backup's task and the engine thread.
#[derive(Debug, Default)]
pub(crate) struct BackupShared {
    pub done: AtomicBool,
    pub stored_pages: AtomicU64,
    pub failed: AtomicBool,
}

/// A backup tracked by the engine thread.
#[derive(Debug)]
pub(crate) struct BackupOp {
    pub nodes: Vec<NodeId>,
    pub pages: usize,
    /// `BlockStored(L3)` events for the pages, made at launch (while the nodes hold exactly
    /// these pages) and emitted once every page is stored; empty when events are off.
    pub events: Vec<KvEvent>,
    pub started: Instant,
    pub shared: Arc<BackupShared>,
    /// Written by rank 0 for this rank (MLA, invariant 5): nothing was stored here.
    pub skipped: bool,
}

/// The attached L3 tier.
pub(crate) struct L3 {
    pub runtime: tokio::runtime::Runtime,
    pub storage: Arc<dyn Storage>,
    pub config: StorageConfig,
    pub prefetch: PrefetchConfig,
    pub batch: usize,
    pub prefetches: BTreeMap<u64, PrefetchOp>,
    pub backups: VecDeque<BackupOp>,
    /// Finished or revoked prefetches whose task may still hand pages back.
    pub draining: Vec<Arc<FetchShared>>,
    pub occupied_pages: usize,
    pub capacity_pages: usize,
    /// MLA KV is the same on every TP rank: only rank 0 writes it to L3.
    pub backup_skip: bool,
    pub next_seq: u64,
}

impl L3 {
    pub fn backend_name(&self) -> String {
        self.storage.info().name
    }
}

/// Slices of a host page for reading.
///
/// # Safety
/// Nothing may write the page while the slices live (invariant 3 / pool rule 1).
unsafe fn read_parts(pool: &HostPool, slot: HostSlot) -> Result<Vec<&[u8]>> {
    // SAFETY: forwarded contract.
    Ok(unsafe { pool.page_parts_shared(slot) }?)
}

/// Slices of a host page for writing.
///
/// # Safety
/// The caller must be the only user of the page while the slices live (invariant 2).
// Mutable slices from a shared pool: exclusivity comes from page ownership (invariant 2),
// not from the borrow of the pool, as for every page-granular allocator.
#[allow(clippy::mut_from_ref)]
unsafe fn write_parts(pool: &HostPool, slot: HostSlot) -> Result<Vec<&mut [u8]>> {
    let iovs = pool.page_iovecs(slot)?;
    Ok(iovs
        .into_iter()
        // SAFETY: each part is a disjoint run inside the pool's mapping, which outlives the
        // borrow of `pool`; the caller is the page's only user.
        .map(|iov| unsafe { std::slice::from_raw_parts_mut(iov.as_ptr(), iov.len) })
        .collect())
}

struct QueryJob {
    storage: Arc<dyn Storage>,
    pool: Arc<HostPool>,
    hasher: PageHasher,
    namespace: NamespaceId,
    prior: Option<PageHash>,
    tokens: Vec<u32>,
    batch: usize,
    layout: LayoutKind,
    shared: Arc<FetchShared>,
}

impl QueryJob {
    async fn run(self) {
        let hashes = self.hasher.hash_pages(self.prior, &self.tokens);
        let keys: Vec<PageKey> = hashes
            .iter()
            .map(|h| PageKey::new(self.namespace, *h))
            .collect();
        let mut hit = 0;
        for chunk in keys.chunks(self.batch) {
            match self.storage.batch_exists(chunk).await {
                Ok(n) => {
                    hit += n.min(chunk.len());
                    if n < chunk.len() {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "L3 lookup failed; using the hits found so far");
                    break;
                }
            }
        }
        *self.shared.query.lock() = Some(QueryResult {
            hashes,
            hit_pages: hit,
        });
        // Wait for host pages (or a revocation).
        let slots = loop {
            {
                let st = self.shared.state.lock();
                if st.terminated {
                    break None;
                }
                if let Some(s) = &st.slots {
                    break Some(s.clone());
                }
            }
            self.shared.notify.notified().await;
        };
        if let Some(slots) = slots {
            self.fetch(&keys, &slots).await;
        }
        let mut st = self.shared.state.lock();
        st.done = true;
        st.exited = true;
        let from = st.completed;
        st.leftover = st.slots.as_ref().map(|s| s[from..].to_vec());
    }

    async fn fetch(&self, keys: &[PageKey], slots: &[HostSlot]) {
        let mut at = 0;
        while at < slots.len() {
            if self.shared.state.lock().terminated {
                return;
            }
            let end = (at + self.batch).min(slots.len());
            let outcome = {
                let mut bufs = Vec::with_capacity(end - at);
                for &slot in &slots[at..end] {
                    // SAFETY: pages [at, end) are ≥ completed and this task owns them until it
                    // advances `completed` past them (invariant 2).
                    match unsafe { write_parts(&self.pool, slot) } {
                        Ok(parts) => bufs.push(PageBufMut::from_parts(self.layout, parts)),
                        Err(e) => {
                            tracing::error!(error = %e, "bad host page in a prefetch");
                            self.shared.state.lock().failed = true;
                            return;
                        }
                    }
                }
                self.storage.batch_get(&keys[at..end], &mut bufs).await
            };
            let lead = match outcome {
                Ok(outcomes) => outcomes.iter().take_while(|o| o.is_hit()).count(),
                Err(e) => {
                    tracing::warn!(error = %e, "L3 fetch failed; keeping the pages fetched so far");
                    self.shared.state.lock().failed = true;
                    return;
                }
            };
            let mut st = self.shared.state.lock();
            if st.terminated {
                return;
            }
            st.completed += lead;
            if lead < end - at {
                return;
            }
            at = end;
        }
    }
}

struct BackupJob {
    storage: Arc<dyn Storage>,
    pool: Arc<HostPool>,
    keys: Vec<PageKey>,
    slots: Vec<HostSlot>,
    batch: usize,
    layout: LayoutKind,
    shared: Arc<BackupShared>,
}

impl BackupJob {
    async fn run(self) {
        let mut at = 0;
        while at < self.keys.len() {
            let end = (at + self.batch).min(self.keys.len());
            let keys = &self.keys[at..end];
            let present = match self.storage.batch_exists(keys).await {
                Ok(n) => n.min(keys.len()),
                Err(_) => 0,
            };
            let mut stored = present;
            if present < keys.len() {
                let mut bufs = Vec::with_capacity(keys.len() - present);
                for &slot in &self.slots[at + present..end] {
                    // SAFETY: the node holding this page is host-protected until this task's
                    // ack is processed; nobody writes it meanwhile (invariant 3).
                    match unsafe { read_parts(&self.pool, slot) } {
                        Ok(parts) => bufs.push(PageBuf::from_parts(self.layout, parts)),
                        Err(e) => {
                            tracing::error!(error = %e, "bad host page in a backup");
                            self.shared.failed.store(true, Ordering::Relaxed);
                            break;
                        }
                    }
                }
                match self.storage.batch_set(&keys[present..], &bufs).await {
                    Ok(outcomes) => {
                        let ok = outcomes.iter().filter(|o| o.is_ok()).count();
                        stored += ok;
                        if ok < outcomes.len() {
                            let first_bad = outcomes.iter().find(|o| !o.is_ok());
                            tracing::warn!(outcome = ?first_bad, "some pages were not stored in L3");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "L3 backup failed");
                        self.shared.failed.store(true, Ordering::Relaxed);
                        break;
                    }
                }
            }
            self.shared
                .stored_pages
                .fetch_add(stored as u64, Ordering::Relaxed);
            at = end;
        }
        self.shared.done.store(true, Ordering::Release);
    }
}

fn new_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("hicache-l3")
        .enable_all()
        .build()
        .map_err(HiCacheError::Runtime)
}

impl HiCache {
    /// The name of the attached L3 backend, if any.
    pub fn storage_backend(&self) -> Option<String> {
        self.l3.as_ref().map(|l| l.backend_name())
    }

    fn backend_context(&self) -> BackendContext {
        BackendContext {
            page_bytes: self.shape.page_bytes(),
            layout: self.cfg.mem_layout,
            namespace: self
                .tree
                .tenant_root(hicache_core::TenantId(0))
                .ok()
                .and_then(|_| self.tree.chain_start(hicache_core::TenantId(0)).ok())
                .flatten()
                .map(|c| c.namespace_id),
            tp_rank: self.namespace.tp_rank,
            tp_size: self.namespace.tp_size,
            pp_rank: self.namespace.pp_rank,
            pp_size: self.namespace.pp_size,
            memory: Some(self.host_pool.region()),
        }
    }

    /// Attaches an L3 backend opened from `config` through the registry (idle only:
    /// no live requests, nothing in flight). Attaching the same backend again only updates
    /// the policy fields; a different one while attached is an error (detach first).
    pub fn attach_storage(&mut self, config: StorageConfig) -> Result<()> {
        self.check_open()?;
        if let Some(l3) = &mut self.l3 {
            if l3.config.backend == config.backend {
                l3.prefetch = prefetch_config(&self.cfg, &config);
                l3.config = config;
                return Ok(());
            }
            return Err(HiCacheError::NotIdle(format!(
                "backend {} is attached; detach it before attaching {}",
                l3.config.backend, config.backend
            )));
        }
        if !self.registry.contains(&config.backend)
            && let Some(feature) = crate::backends::feature_for(&config.backend)
        {
            return Err(HiCacheError::BackendNotCompiled {
                backend: config.backend.clone(),
                feature,
            });
        }
        let runtime = new_runtime()?;
        let ctx = self.backend_context();
        let storage = runtime.block_on(self.registry.open(&config, &ctx))?;
        self.attach_with_runtime(config, storage, runtime)
    }

    /// Attaches a backend instance (idle only), with `config`'s common fields.
    pub fn attach_storage_instance(
        &mut self,
        config: StorageConfig,
        storage: Arc<dyn Storage>,
    ) -> Result<()> {
        self.check_open()?;
        if let Some(l3) = &self.l3 {
            return Err(HiCacheError::NotIdle(format!(
                "backend {} is attached; detach it first",
                l3.config.backend
            )));
        }
        let runtime = new_runtime()?;
        self.attach_with_runtime(config, storage, runtime)
    }

    fn attach_with_runtime(
        &mut self,
        config: StorageConfig,
        storage: Arc<dyn Storage>,
        runtime: tokio::runtime::Runtime,
    ) -> Result<()> {
        self.require_idle("attach a storage backend")?;
        let info = storage.info();
        if info.max_page_bytes != 0 && info.max_page_bytes < self.shape.page_bytes() {
            return Err(HiCacheError::config(
                "storage_backend",
                &info.name,
                format!(
                    "pages of {} bytes exceed the backend's maximum of {}",
                    self.shape.page_bytes(),
                    info.max_page_bytes
                ),
            ));
        }
        storage.register_memory(self.host_pool.region())?;
        let batch = self.cfg.storage_batch_pages.min(info.max_batch.max(1));
        let capacity_pages =
            ((self.host_pool.num_pages() as f64) * self.cfg.prefetch_capacity_ratio) as usize;
        let backup_skip = matches!(self.shape.kind, KvKind::Mla { .. }) && self.rank.rank() != 0;
        tracing::info!(backend = %info.name, batch, capacity_pages, "L3 attached");
        self.metrics.set_storage(Some(storage.clone()));
        self.l3 = Some(L3 {
            runtime,
            storage,
            prefetch: prefetch_config(&self.cfg, &config),
            config,
            batch,
            prefetches: BTreeMap::new(),
            backups: VecDeque::new(),
            draining: Vec::new(),
            occupied_pages: 0,
            capacity_pages: capacity_pages.max(1),
            backup_skip,
            next_seq: 0,
        });
        Ok(())
    }

    pub(crate) fn require_idle(&self, what: &str) -> Result<()> {
        let busy = [
            (self.requests.len(), "live requests"),
            (self.writes.len(), "D2H batches in flight"),
            (
                self.loads.len() + self.queued_loads.len(),
                "loads in flight",
            ),
            (
                self.l3.as_ref().map_or(0, |l| l.backups.len()),
                "L3 backups in flight",
            ),
        ];
        for (n, name) in busy {
            if n > 0 {
                return Err(HiCacheError::NotIdle(format!("cannot {what}: {n} {name}")));
            }
        }
        Ok(())
    }

    /// Detaches the L3 backend: waits for backups in flight (nothing acknowledged is lost),
    /// revokes prefetches, releases every pin they held. Detaching without a backend does
    /// nothing. Requests may stay live; their prefetches are revoked.
    pub fn detach_storage(&mut self) -> Result<()> {
        self.check_open()?;
        if self.l3.is_none() {
            return Ok(());
        }
        let seqs: Vec<u64> = self
            .l3
            .as_ref()
            .map(|l| l.prefetches.keys().copied().collect())
            .unwrap_or_default();
        for seq in seqs {
            let req = self.l3.as_ref().expect("attached").prefetches[&seq].req;
            self.abort_prefetch(seq)?;
            if let Some(r) = self.requests.get_mut(&req) {
                r.prefetch = None;
            }
        }
        let n = self.l3.as_ref().map_or(0, |l| l.backups.len());
        self.wait_backups(n)?;
        self.finish_backups(n)?;
        self.collect_leftovers(true)?;
        let l3 = self.l3.take().expect("attached");
        self.metrics.set_storage(None);
        l3.runtime
            .shutdown_timeout(std::time::Duration::from_secs(10));
        tracing::info!("L3 detached");
        Ok(())
    }

    pub(crate) fn wait_backups(&self, n: usize) -> Result<()> {
        if let Some(l3) = &self.l3 {
            for op in l3.backups.iter().take(n) {
                while !op.shared.done.load(Ordering::Acquire) {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
            }
        }
        Ok(())
    }

    // ----- backups -------------------------------------------------------------------------

    /// Starts copying a finished write's pages to L3 (after the D2H ack).
    pub(crate) fn start_backup(&mut self, fin: FinishedBackup) -> Result<()> {
        if fin.fragments.is_empty() {
            return Ok(());
        }
        let Some(start) = self.tree.chain_start(fin.tenant)? else {
            return Ok(());
        };
        let hashes = fin.hashes();
        let slots = fin.host_slots();
        let pages = slots.len();
        if hashes.len() != slots.len() {
            // Pages without hashes cannot be named in L3.
            return Ok(());
        }
        let keys: Vec<PageKey> = hashes
            .iter()
            .map(|h| PageKey::new(start.namespace_id, *h))
            .collect();
        let nodes: Vec<NodeId> = fin.fragments.iter().map(|f| f.node).collect();
        for &n in &nodes {
            self.tree.protect_host(n)?;
        }
        let mut events = Vec::new();
        for &n in &nodes {
            events.extend(self.tree.stored_event(n, Medium::Storage)?);
        }
        let l3 = self.l3.as_mut().expect("attached");
        let shared = Arc::new(BackupShared::default());
        if l3.backup_skip {
            // Rank 0 writes these pages for every rank (invariant 5): this rank's backup is
            // done at once, but it is tracked, pinned and finished like rank 0's so that every
            // rank counts the same backups and keeps the same pins.
            shared.done.store(true, Ordering::Release);
        } else {
            let job = BackupJob {
                storage: l3.storage.clone(),
                pool: self.host_pool.clone(),
                keys,
                slots,
                batch: l3.batch,
                layout: self.cfg.mem_layout,
                shared: shared.clone(),
            };
            l3.runtime.spawn(job.run());
        }
        l3.backups.push_back(BackupOp {
            nodes,
            pages,
            events,
            started: Instant::now(),
            shared,
            skipped: l3.backup_skip,
        });
        Ok(())
    }

    /// Number of backups, from the oldest, that finished.
    pub(crate) fn ready_backups(&self) -> usize {
        self.l3.as_ref().map_or(0, |l| {
            l.backups
                .iter()
                .take_while(|b| b.shared.done.load(Ordering::Acquire))
                .count()
        })
    }

    /// Finishes the oldest `n` backups (the agreed count): releases their host pins.
    pub(crate) fn finish_backups(&mut self, n: usize) -> Result<()> {
        for _ in 0..n {
            let Some(op) = self.l3.as_mut().and_then(|l| l.backups.pop_front()) else {
                break;
            };
            for node in &op.nodes {
                self.tree.release_host(*node)?;
            }
            if op.skipped {
                continue;
            }
            let stored = op.shared.stored_pages.load(Ordering::Relaxed);
            self.metrics.transfer(
                Direction::l2_to_l3,
                stored,
                stored * self.shape.page_bytes() as u64,
                op.started.elapsed().as_secs_f64(),
            );
            if stored as usize == op.pages {
                self.events.extend(op.events);
            }
            if op.shared.failed.load(Ordering::Relaxed) {
                tracing::warn!(
                    pages = op.pages,
                    stored,
                    "an L3 backup stored only part of its pages"
                );
            }
        }
        Ok(())
    }

    // ----- prefetches ------------------------------------------------------------------------

    /// Starts a prefetch for a request at arrival, if worthwhile (invariant 1). Returns the
    /// op's sequence number and the pages it looks up.
    pub(crate) fn start_prefetch(
        &mut self,
        req: RequestId,
        tenant: TenantId,
        key: &[u32],
        m: &MatchResult,
        matched_pages: usize,
    ) -> Result<Option<(u64, usize)>> {
        let ps = self.page_size();
        let total = key.len() / ps;
        let threshold = {
            let l3 = self.l3.as_ref().expect("attached");
            l3.prefetch.threshold_tokens(self.cfg.page_size) as usize
        };
        if (total - matched_pages) * ps < threshold {
            return Ok(None);
        }
        let tracked = self.l3.as_ref().expect("attached").prefetches.len();
        if tracked >= crate::tick::MAX_TRACKED_PREFETCHES {
            // Every rank tracks the same prefetches, so every rank skips this one.
            self.metrics.prefetch(PrefetchOutcome::rate_limited);
            return Ok(None);
        }
        let anchor = m.last_host_node;
        // Pages between the anchor's end and the end of the match (device-only nodes).
        let mut below = 0;
        let mut n = m.last_node;
        while n != anchor {
            let info = self.tree.node_info(n)?;
            below += info.pages;
            n = info
                .parent
                .ok_or_else(|| HiCacheError::BadArgument("match path broken".into()))?;
        }
        let anchor_end = matched_pages - below;
        let prior = match self.tree.last_page_hash(anchor)? {
            Some(h) => Some(h),
            None => self.tree.chain_start(tenant)?.and_then(|c| c.prior),
        };
        let Some(start) = self.tree.chain_start(tenant)? else {
            return Ok(None);
        };
        let hasher = self
            .tree
            .config()
            .hasher
            .clone()
            .expect("the controller always configures a hasher");
        self.tree.protect_host(anchor)?;
        let tokens = key[anchor_end * ps..].to_vec();
        let pages = tokens.len() / ps;
        let l3 = self.l3.as_mut().expect("attached");
        let shared = Arc::new(FetchShared::default());
        let job = QueryJob {
            storage: l3.storage.clone(),
            pool: self.host_pool.clone(),
            hasher,
            namespace: start.namespace_id,
            prior,
            tokens: tokens.clone(),
            batch: l3.batch,
            layout: self.cfg.mem_layout,
            shared: shared.clone(),
        };
        l3.runtime.spawn(job.run());
        let seq = l3.next_seq;
        l3.next_seq += 1;
        l3.prefetches.insert(
            seq,
            PrefetchOp {
                req,
                tenant,
                anchor,
                tokens,
                started: Instant::now(),
                shared,
                phase: Phase::Querying,
            },
        );
        Ok(Some((seq, pages)))
    }

    /// Local view of one prefetch for the per-tick exchange: `[query_done, hit_pages,
    /// completed_pages, can_terminate]`.
    pub(crate) fn prefetch_local(&self, op: &PrefetchOp) -> [u64; 4] {
        let l3 = self.l3.as_ref().expect("attached");
        let q = op.shared.query.lock();
        let query_done = q.is_some() as u64;
        let hit = q.as_ref().map_or(0, |q| q.hit_pages) as u64;
        drop(q);
        let st = op.shared.state.lock();
        let (completed, fetch_done) = match &op.phase {
            Phase::Querying => (0, false),
            Phase::Fetching { .. } => (st.completed, st.done),
        };
        // As SGLang: the budget grows with the pages the query found (`len(hash)` after the
        // query; none while it runs), not with the candidate suffix, and counts from the op's
        // creation, query time included.
        let can = match l3.prefetch.policy {
            PrefetchPolicy::BestEffort => true,
            PrefetchPolicy::WaitComplete => fetch_done,
            PrefetchPolicy::Timeout => {
                fetch_done
                    || op.started.elapsed() > l3.prefetch.timeout(hit * self.page_size() as u64)
            }
        };
        [query_done, hit, completed as u64, can as u64]
    }

    /// Applies the agreed view of one prefetch (see [`HiCache::prefetch_local`]).
    pub(crate) fn prefetch_apply(&mut self, seq: u64, agreed: [u64; 4]) -> Result<()> {
        let [query_done, hit, completed, can] = agreed;
        let querying = matches!(
            self.l3.as_ref().expect("attached").prefetches[&seq].phase,
            Phase::Querying
        );
        if querying {
            if query_done == 1 {
                self.prefetch_allocate(seq, hit as usize)
            } else if can == 1 {
                self.end_prefetch(seq, 0, PrefetchOutcome::partial)
            } else {
                Ok(())
            }
        } else if can == 1 {
            self.end_prefetch(seq, completed as usize, PrefetchOutcome::completed)
        } else {
            Ok(())
        }
    }

    fn prefetch_allocate(&mut self, seq: u64, hit: usize) -> Result<()> {
        let ps = self.page_size();
        let (threshold, room) = {
            let l3 = self.l3.as_ref().expect("attached");
            (
                l3.prefetch.threshold_tokens(self.cfg.page_size) as usize,
                l3.capacity_pages.saturating_sub(l3.occupied_pages),
            )
        };
        if hit * ps < threshold {
            return self.end_prefetch(seq, 0, PrefetchOutcome::below_threshold);
        }
        let want = hit.min(room);
        if want * ps < threshold {
            return self.end_prefetch(seq, 0, PrefetchOutcome::rate_limited);
        }
        let host = match self.alloc_host(want)? {
            Some(h) => h,
            None => {
                // Shrink to what every rank has, if still worth it.
                let can = self.host_budget.min(want);
                match (can * ps >= threshold).then(|| self.alloc_host(can)) {
                    Some(Ok(Some(h))) => h,
                    Some(Err(e)) => return Err(e),
                    _ => return self.end_prefetch(seq, 0, PrefetchOutcome::no_host_memory),
                }
            }
        };
        let l3 = self.l3.as_mut().expect("attached");
        l3.occupied_pages += host.len();
        let op = l3.prefetches.get_mut(&seq).expect("tracked");
        op.shared.state.lock().slots = Some(host.clone());
        op.shared.notify.notify_one();
        op.phase = Phase::Fetching { host };
        Ok(())
    }

    /// Ends a prefetch: terminates its task, inserts the first `agreed` pages (the count every
    /// rank has) as host-only nodes under the anchor, frees what is not needed, releases the
    /// anchor. `outcome` is refined from the numbers.
    pub(crate) fn end_prefetch(
        &mut self,
        seq: u64,
        agreed: usize,
        outcome: PrefetchOutcome,
    ) -> Result<()> {
        let l3 = self.l3.as_mut().expect("attached");
        let op = l3.prefetches.remove(&seq).expect("tracked");
        let (snap, failed) = {
            let mut st = op.shared.state.lock();
            st.terminated = true;
            (st.completed, st.failed)
        };
        op.shared.notify.notify_one();
        l3.draining.push(op.shared.clone());
        let ps = self.page_size();
        let mut new_pages = 0;
        let mut outcome = outcome;
        if let Phase::Fetching { host } = &op.phase {
            let l3 = self.l3.as_mut().expect("attached");
            l3.occupied_pages -= host.len();
            let agreed = agreed.min(snap);
            if agreed > 0 {
                let hashes = op
                    .shared
                    .query
                    .lock()
                    .as_ref()
                    .map(|q| q.hashes[..agreed].to_vec())
                    .unwrap_or_default();
                let res = self.tree.insert_host_only(
                    op.tenant,
                    op.anchor,
                    &op.tokens[..agreed * ps],
                    &host[..agreed],
                    Some(&hashes),
                )?;
                new_pages = res.new_pages;
                self.free_host(&res.duplicate_slots)?;
                let bytes = (agreed * self.shape.page_bytes()) as u64;
                self.metrics.transfer(
                    Direction::l3_to_l2,
                    agreed as u64,
                    bytes,
                    op.started.elapsed().as_secs_f64(),
                );
            }
            // Pages fetched by this rank beyond the agreed count: free now (not counted in the
            // budget: other ranks may not have them). The task hands back the rest.
            self.host_pool.free(&host[agreed..snap])?;
            if outcome == PrefetchOutcome::completed && agreed < host.len() {
                outcome = PrefetchOutcome::partial;
            }
        }
        if failed && new_pages == 0 && outcome == PrefetchOutcome::partial {
            outcome = PrefetchOutcome::failed;
        }
        self.tree.release_host(op.anchor)?;
        if let Some(r) = self.requests.get_mut(&op.req) {
            r.prefetch = None;
            r.storage_pages = new_pages;
        }
        self.metrics.prefetch(outcome);
        Ok(())
    }

    /// Revokes a prefetch of an aborted request.
    pub(crate) fn abort_prefetch(&mut self, seq: u64) -> Result<()> {
        self.end_prefetch(seq, 0, PrefetchOutcome::aborted)
    }

    /// Frees pages that finished prefetch tasks handed back. With `wait`, waits (up to 10 s
    /// in all) for every draining task to exit first; pages of a task still stuck in a
    /// backend call after that are left allocated (never reused while it may write them)
    /// and reported.
    pub(crate) fn collect_leftovers(&mut self, wait: bool) -> Result<()> {
        let Some(l3) = self.l3.as_mut() else {
            return Ok(());
        };
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        let mut back = Vec::new();
        l3.draining.retain(|s| {
            loop {
                let mut st = s.state.lock();
                if st.exited {
                    if let Some(l) = st.leftover.take() {
                        back.extend(l);
                    }
                    return false;
                }
                if !wait {
                    return true;
                }
                if Instant::now() >= deadline {
                    tracing::warn!(
                        pages = st.slots.as_ref().map_or(0, |v| v.len() - st.completed),
                        "a prefetch task is stuck in its backend; its host pages stay allocated"
                    );
                    return false;
                }
                drop(st);
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        });
        if !back.is_empty() {
            self.host_pool.free(&back)?;
        }
        Ok(())
    }

    /// Prefetches tracked, in the agreed (creation) order.
    pub(crate) fn prefetch_seqs(&self) -> Vec<u64> {
        self.l3
            .as_ref()
            .map(|l| l.prefetches.keys().copied().collect())
            .unwrap_or_default()
    }
}

fn prefetch_config(cfg: &crate::HiCacheConfig, sc: &StorageConfig) -> PrefetchConfig {
    PrefetchConfig {
        policy: cfg.storage_prefetch_policy,
        prefetch_threshold: sc.common.prefetch_threshold.min(u32::MAX as u64) as u32,
        prefetch_timeout_base: sc.common.prefetch_timeout_base,
        prefetch_timeout_per_ki_token: sc.common.prefetch_timeout_per_ki_token,
        prefetch_timeout_max: sc.common.prefetch_timeout_max,
    }
}

impl std::fmt::Debug for L3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L3")
            .field("backend", &self.backend_name())
            .field("prefetches", &self.prefetches.len())
            .field("backups", &self.backups.len())
            .finish_non_exhaustive()
    }
}
