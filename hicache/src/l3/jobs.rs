//! The background tasks of L3 (on the cache's runtime) and the state each shares with the
//! engine thread: a prefetch ([`run_prefetch`] over a [`Fetcher`]: lookup, then fetch into the
//! host pages the engine thread allocated; the dense model's is [`QueryJob`], the hybrid
//! model's reads every component of a page) and [`BackupJob`] (host pages to L3). Both
//! controllers run these two engines, each with its own fetcher and page source.
//!
//! Page ownership (see the invariants of [`crate::l3`]): a fetch writes page `i` only while
//! `i ≥ completed`; `completed` advances under the state lock and never after `terminated`
//! is set. A backup only reads pages the tree keeps host-protected until its agreed ack.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use hicache_core::{HostSlot, NamespaceId, PageHash, PageHasher, PageKey};
use hicache_host::{HostPool, IoVec};
use hicache_storage::{
    BatchContext, LayoutKind, PageBuf, PageBufMut, PageOutcome, Storage, StorageError,
};
use parking_lot::{Condvar, Mutex};
use tokio::sync::{Notify, Semaphore};
use tracing::Instrument;

use crate::error::Result;

/// What a lookup found.
#[derive(Debug, Default)]
pub(crate) struct QueryResult {
    /// The hashes of every page looked up (the leading pages present are published in
    /// [`Progress`]).
    pub hashes: Vec<PageHash>,
}

/// Progress of a prefetch's fetch, under one lock. `S`: the host pages it fetches into
/// (the dense model's slots; a hybrid model's plan and slots per component).
#[derive(Debug, Default)]
pub(crate) struct FetchState<S = Vec<HostSlot>> {
    /// Host pages to fetch into, set by the engine thread once the hit is known.
    pub slots: Option<S>,
    /// Pages fetched, from the first.
    pub completed: usize,
    /// The task stopped fetching (all done, a miss, an error, or terminated).
    pub done: bool,
    /// Set by the engine thread: stop, and never advance `completed` again.
    pub terminated: bool,
    /// The task met a storage error.
    pub failed: bool,
    /// Pages lost to storage errors: those of a lookup batch that failed, and the pages of
    /// the hit a fetch did not bring because a read failed (the failed page and every one
    /// after it). Read by the engine thread when the prefetch ends.
    pub failed_pages: usize,
    /// The first storage error met, for the log.
    pub error: Option<String>,
    /// Pages the task hands back when it exits (`slots[completed..]`, [`Fetcher::leftover`]).
    pub leftover: Option<S>,
    /// The task exited.
    pub exited: bool,
}

/// What the engine thread reads of a prefetch at every poll, published without a lock (one
/// atomic load per value instead of two lock round trips per tracked prefetch per poll).
///
/// Invariants:
/// 1. Each value is a copy of one the task keeps under a lock: `hit_pages` of `query`'s
///    result, `completed` and `exited` of [`FetchState`]'s, stored while the task holds that
///    lock right after changing the original, so a reader never sees a value the original
///    did not have, and the engine thread's decisions that need the exact values (ending a
///    prefetch, taking leftovers) still read them under the lock.
/// 2. Order: `hit_pages` is stored before `query_done`, `completed` before `exited`, all
///    with release and read with acquire, so a reader that sees `query_done` sees the hit,
///    and one that sees `exited` then reads the final `completed`.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    query_done: AtomicBool,
    hit_pages: AtomicUsize,
    completed: AtomicUsize,
    exited: AtomicBool,
}

impl Progress {
    /// The lookup's hit, once it finished.
    pub fn query(&self) -> Option<usize> {
        self.query_done
            .load(Ordering::Acquire)
            .then(|| self.hit_pages.load(Ordering::Acquire))
    }

    /// Pages fetched, from the first, and whether the task exited (reads `exited` first,
    /// invariant 2: once it is seen, the count is final).
    pub fn fetched(&self) -> (usize, bool) {
        let exited = self.exited.load(Ordering::Acquire);
        (self.completed.load(Ordering::Acquire), exited)
    }

    /// Whether the task exited.
    pub fn exited(&self) -> bool {
        self.exited.load(Ordering::Acquire)
    }
}

/// State shared between a prefetch's task and the engine thread (`S`: see [`FetchState`]).
#[derive(Debug, Default)]
pub(crate) struct FetchShared<S = Vec<HostSlot>> {
    /// The lookup's result, once known.
    pub query: Mutex<Option<QueryResult>>,
    /// Set once the lookup's result is published (for an engine thread that waits for it).
    pub looked_up: Latch,
    /// The fetch's progress.
    pub state: Mutex<FetchState<S>>,
    /// Lock-free copies of the progress the engine thread polls.
    pub progress: Progress,
    /// Wakes the task when pages are given or the prefetch is terminated.
    pub notify: Notify,
    /// Signalled (with `state` locked) when the task sets `exited`.
    pub exited: Condvar,
}

impl<S> FetchShared<S> {
    /// Hands the task the host pages to fetch into (engine thread).
    pub fn give(&self, slots: S) {
        self.state.lock().slots = Some(slots);
        self.notify.notify_one();
    }

    /// Tells the task to stop: it never advances `completed` again (engine thread).
    pub fn terminate(&self) {
        self.state.lock().terminated = true;
        self.notify.notify_one();
    }

    /// Whether the task was told to stop.
    pub fn terminated(&self) -> bool {
        self.state.lock().terminated
    }

    /// Blocks until the task has exited.
    pub fn wait_exited(&self) {
        let mut st = self.state.lock();
        while !st.exited {
            self.exited.wait(&mut st);
        }
    }

    /// Publishes the lookup's result (task; progress invariants 1 and 2: the copy under the
    /// lock, the hit before the flag).
    fn publish_query(&self, hit: usize, result: QueryResult) {
        {
            let mut q = self.query.lock();
            *q = Some(result);
            self.progress.hit_pages.store(hit, Ordering::Release);
            self.progress.query_done.store(true, Ordering::Release);
        }
        self.looked_up.set();
    }

    /// Waits for host pages (`None`: terminated first).
    async fn slots_given(&self) -> Option<S>
    where
        S: Clone,
    {
        loop {
            {
                let st = self.state.lock();
                if st.terminated {
                    return None;
                }
                if let Some(s) = &st.slots {
                    return Some(s.clone());
                }
            }
            self.notify.notified().await;
        }
    }

    /// Advances `completed` by `pages` (the caller holds `st`, the state's lock, and has
    /// checked that the prefetch is not terminated). Progress invariant 1: the copy, under
    /// the lock.
    pub fn advance(&self, st: &mut FetchState<S>, pages: usize) {
        st.completed += pages;
        self.progress
            .completed
            .store(st.completed, Ordering::Release);
    }
}

/// One kind of prefetch's I/O, run by [`run_prefetch`]: the lookup, then the fetch into the
/// host pages the engine thread gave for the agreed hit (page ownership as in the module
/// docs: a fetch writes a page only while it is at or past `completed` and the prefetch is
/// not terminated).
pub(crate) trait Fetcher: Send + 'static {
    /// The host pages a fetch writes.
    type Slots: Clone + Send + 'static;

    /// Looks the pages up: the pages hit and the lookup's result.
    fn lookup(
        &mut self,
        shared: &FetchShared<Self::Slots>,
    ) -> impl Future<Output = (usize, QueryResult)> + Send;

    /// Fetches into `slots`, advancing `completed` as pages arrive ([`FetchShared::advance`]).
    fn fetch(
        &mut self,
        slots: &Self::Slots,
        shared: &FetchShared<Self::Slots>,
    ) -> impl Future<Output = ()> + Send;

    /// The pages of `slots` the task hands back on exit, `completed` of them fetched.
    fn leftover(slots: &Self::Slots, completed: usize) -> Option<Self::Slots>;
}

/// A prefetch's task: looks up, publishes the hit, waits for host pages (or a revocation),
/// fetches, then exits handing back the pages it did not fill. Spawn it on the L3 runtime.
pub(crate) async fn run_prefetch<F: Fetcher>(mut f: F, shared: Arc<FetchShared<F::Slots>>) {
    let (hit, result) = f.lookup(&shared).await;
    shared.publish_query(hit, result);
    // A lookup that found nothing is never given pages (the agreed hit is every rank's
    // minimum, so at most this one, in both controllers): the task exits at once instead of
    // waiting for the end of its prefetch to wake it (a wake-up of the runtime from the
    // engine thread for every missed lookup).
    let slots = if hit == 0 {
        None
    } else {
        shared.slots_given().await
    };
    if let Some(slots) = &slots {
        f.fetch(slots, &shared).await;
    }
    let mut st = shared.state.lock();
    st.done = true;
    st.exited = true;
    // Progress invariant 1 (`completed` was published when it last changed).
    shared.progress.exited.store(true, Ordering::Release);
    let from = st.completed;
    st.leftover = st.slots.as_ref().and_then(|s| F::leftover(s, from));
    shared.exited.notify_all();
}

/// A flag set once by a background task and waited for by the engine thread without
/// polling. Invariant: once set it stays set; everything the setter wrote before `set` is
/// visible to whoever sees it set (the lock orders them).
#[derive(Debug, Default)]
pub(crate) struct Latch {
    set: Mutex<bool>,
    changed: Condvar,
}

impl Latch {
    /// Sets the flag and wakes every waiter.
    pub fn set(&self) {
        *self.set.lock() = true;
        self.changed.notify_all();
    }

    /// Whether the flag is set.
    pub fn is_set(&self) -> bool {
        *self.set.lock()
    }

    /// Blocks until the flag is set.
    pub fn wait(&self) {
        let mut set = self.set.lock();
        while !*set {
            self.changed.wait(&mut set);
        }
    }
}

/// State shared between a backup's task and the engine thread.
#[derive(Debug, Default)]
pub(crate) struct BackupShared {
    /// The task finished (every batch acknowledged or failed).
    pub done: Latch,
    /// Pages stored (or already present) in L3.
    pub stored_pages: AtomicU64,
    /// Some batch failed (nothing more is sent).
    pub failed: AtomicBool,
    /// The first storage error met (a failed call or a page that was not stored), for the
    /// log; the pages lost are the backup's pages minus `stored_pages`.
    pub error: Mutex<Option<String>>,
}

impl BackupShared {
    /// Keeps `e` as the error to report unless one is already kept.
    fn note_error(&self, e: impl std::fmt::Display) {
        self.error.lock().get_or_insert_with(|| e.to_string());
    }
}

impl<S> FetchState<S> {
    /// Counts `pages` lost to a storage error `e` (the first error is kept for the log).
    pub fn note_failure(&mut self, pages: usize, e: impl std::fmt::Display) {
        self.failed_pages += pages;
        self.error.get_or_insert_with(|| e.to_string());
    }
}

/// Host pages a backup reads: a dense model's host pool, or one component's pool of a hybrid
/// model's pool group. The one backup engine ([`BackupJob`]) serves both.
pub(crate) trait PageSource: Send + Sync + 'static {
    /// The iovecs of `slot`'s page, checked to lie inside the source's mapping (which lives
    /// as long as the source).
    fn page_iovecs(&self, slot: HostSlot) -> Result<Vec<IoVec>>;
}

impl PageSource for HostPool {
    fn page_iovecs(&self, slot: HostSlot) -> Result<Vec<IoVec>> {
        Ok(HostPool::page_iovecs(self, slot)?)
    }
}

/// Slices of a host page for reading.
///
/// # Safety
/// Nothing may write the page while the slices live (backup page ownership).
unsafe fn read_parts(pool: &dyn PageSource, slot: HostSlot) -> Result<Vec<&[u8]>> {
    let iovs = pool.page_iovecs(slot)?;
    // SAFETY: the iovecs lie inside the source's mapping, which outlives the borrow of
    // `pool`; nobody writes the page meanwhile (forwarded contract).
    Ok(unsafe { iovec_parts(&iovs) })
}

/// Slices over a host slot's iovecs (of a pool or a pool group), for reading.
///
/// # Safety
/// The iovecs must lie inside a mapping that outlives `'a`, and nothing may write them while
/// the slices live.
pub(crate) unsafe fn iovec_parts<'a>(iovs: &[IoVec]) -> Vec<&'a [u8]> {
    iovs.iter()
        // SAFETY: forwarded contract.
        .map(|iov| unsafe { std::slice::from_raw_parts(iov.as_ptr().cast_const(), iov.len) })
        .collect()
}

/// Mutable slices over a host slot's iovecs (of a pool or a pool group), for writing.
///
/// # Safety
/// The iovecs must be disjoint and lie inside a mapping that outlives `'a`, and the caller
/// must be their only user while the slices live.
pub(crate) unsafe fn iovec_parts_mut<'a>(iovs: &[IoVec]) -> Vec<&'a mut [u8]> {
    iovs.iter()
        // SAFETY: forwarded contract.
        .map(|iov| unsafe { std::slice::from_raw_parts_mut(iov.as_ptr(), iov.len) })
        .collect()
}

/// The keys of one request's pages an operation moves, after the keys of the pages before
/// them (the prefix) when the tier passes prefix keys: batch `[at, end)` of the operation is
/// sent with the prefix keys `prefix ++ keys[..at]`, a slice of the one vector, so no batch
/// copies keys.
#[derive(Debug)]
pub(crate) struct Chain {
    /// Prefix keys, then the operation's keys.
    all: Vec<PageKey>,
    /// Length of the prefix in `all`.
    base: usize,
    /// Whether prefix keys are passed at all.
    pass: bool,
}

impl Chain {
    /// The chain of `keys` after `prefix` (`None`: prefix keys are not passed).
    pub fn new<I>(prefix: Option<&[PageKey]>, keys: I) -> Self
    where
        I: IntoIterator<Item = PageKey>,
        I::IntoIter: ExactSizeIterator,
    {
        let keys = keys.into_iter();
        let base = prefix.map_or(0, <[PageKey]>::len);
        // Sized once for the prefix and the keys.
        let mut all = Vec::with_capacity(base + keys.len());
        all.extend_from_slice(prefix.unwrap_or_default());
        all.extend(keys);
        Self {
            all,
            base,
            pass: prefix.is_some(),
        }
    }

    /// Number of the operation's keys.
    pub fn len(&self) -> usize {
        self.all.len() - self.base
    }

    /// The operation's keys `range`.
    pub fn keys(&self, range: std::ops::Range<usize>) -> &[PageKey] {
        &self.all[self.base + range.start..self.base + range.end]
    }

    /// The context of a batch starting at the operation's key `at`.
    pub fn context(&self, at: usize) -> BatchContext<'_> {
        if self.pass {
            BatchContext::with_prefix_keys(&self.all[..self.base + at])
        } else {
            BatchContext::NONE
        }
    }
}

/// The leading run of `chain`'s keys present in L3, asked `batch` keys a call. A failed call
/// ends the run: the pages found before its batch, and its error with its batch's keys.
pub(crate) async fn present_run(
    storage: &dyn Storage,
    chain: &Chain,
    batch: usize,
) -> (usize, Option<(usize, StorageError)>) {
    let mut hit = 0;
    for at in (0..chain.len()).step_by(batch.max(1)) {
        let keys = chain.keys(at..(at + batch).min(chain.len()));
        match storage.batch_exists_with(keys, chain.context(at)).await {
            Ok(n) if n >= keys.len() => hit += keys.len(),
            Ok(n) => return (hit + n, None),
            Err(e) => return (hit, Some((keys.len(), e))),
        }
    }
    (hit, None)
}

/// Reads the pages `chain.keys(at..at + pages.len())` from L3 into host pages (each given by
/// its iovecs, stored with `layout`): the backend's outcome per page, or its error for the
/// whole call.
///
/// # Safety
/// The iovecs must be disjoint and lie inside mappings that outlive the future, and the
/// caller must be their only user until the future completes or is dropped.
pub(crate) async unsafe fn get_batch(
    storage: &dyn Storage,
    layout: LayoutKind,
    chain: &Chain,
    at: usize,
    pages: &[Vec<IoVec>],
) -> std::result::Result<Vec<PageOutcome>, StorageError> {
    let mut bufs: Vec<PageBufMut<'_>> = pages
        .iter()
        // SAFETY: forwarded contract.
        .map(|iovs| PageBufMut::from_parts(layout, unsafe { iovec_parts_mut(iovs) }))
        .collect();
    let keys = chain.keys(at..at + pages.len());
    storage
        .batch_get_with(keys, &mut bufs, chain.context(at))
        .instrument(tracing::debug_span!("l3_batch_get", pages = pages.len()))
        .await
}

/// A dense model's prefetch: looks its pages up, then fetches the leading hit into the host
/// pages given ([`run_prefetch`] over [`DenseFetch`]).
pub(crate) struct QueryJob {
    pub storage: Arc<dyn Storage>,
    pub pool: Arc<HostPool>,
    pub hasher: PageHasher,
    pub namespace: NamespaceId,
    pub prior: Option<PageHash>,
    /// The keys of the pages before the first looked up (root first), passed to the backend
    /// as each batch's prefix keys; `None` when prefix keys are not passed.
    pub prefix: Option<Vec<PageKey>>,
    /// The tokens looked up (whole pages), shared with the engine thread's op.
    pub tokens: Arc<[u32]>,
    /// Where the page hashes go: allocated (empty, with room for every page) by the engine
    /// thread, which frees it too when the request finishes (a block freed by a thread other
    /// than its allocator's waits for the other arena's lock, which a busy L3 thread holds).
    pub hashes: Vec<PageHash>,
    pub page_size: usize,
    pub batch: usize,
    pub layout: LayoutKind,
    pub shared: Arc<FetchShared>,
}

impl QueryJob {
    /// Runs the job to its end (spawn it on the L3 runtime).
    pub async fn run(self) {
        let span = tracing::debug_span!("l3_prefetch", pages = self.tokens.len() / self.page_size);
        let shared = self.shared.clone();
        let job = DenseFetch {
            job: self,
            chain: None,
        };
        run_prefetch(job, shared).instrument(span).await;
    }

    /// The leading run of `keys` present in L3, batch by batch ([`present_run`]); a failed
    /// call counts its batch's pages as failed and keeps the hits found so far.
    #[tracing::instrument(skip_all, fields(pages = chain.len(), hit))]
    async fn query(&self, chain: &Chain) -> usize {
        let (hit, failed) = present_run(&*self.storage, chain, self.batch).await;
        if let Some((pages, e)) = failed {
            // Counted and logged (rate-limited) by the engine thread at the end.
            tracing::debug!(error = %e, "L3 lookup failed; using the hits found so far");
            let mut st = self.shared.state.lock();
            st.note_failure(pages, format!("lookup: {e}"));
        }
        tracing::Span::current().record("hit", hit);
        hit
    }

    #[tracing::instrument(skip_all, fields(pages = slots.len()))]
    async fn fetch(&self, chain: &Chain, slots: &[HostSlot]) {
        let mut at = 0;
        while at < slots.len() {
            if self.shared.state.lock().terminated {
                return;
            }
            let end = (at + self.batch).min(slots.len());
            let iovs = slots[at..end].iter().map(|&s| self.pool.page_iovecs(s));
            let iovs = match iovs.collect::<std::result::Result<Vec<_>, _>>() {
                Ok(iovs) => iovs,
                Err(e) => {
                    tracing::error!(error = %e, "bad host page in a prefetch");
                    let mut st = self.shared.state.lock();
                    st.failed = true;
                    let lost = slots.len() - st.completed;
                    st.note_failure(lost, format!("host page: {e}"));
                    return;
                }
            };
            // SAFETY: pages [at, end) are ≥ completed and this task owns them until it
            // advances `completed` past them; the pool's mapping outlives the task.
            let outcome = unsafe { get_batch(&*self.storage, self.layout, chain, at, &iovs) }.await;
            let (lead, error) = match outcome {
                Ok(outcomes) => {
                    let lead = outcomes.iter().take_while(|o| o.is_hit()).count();
                    // A page that failed (not a miss: an I/O error, descriptors exhausted…)
                    // loses it and every hit page after it: a failure, never a quiet miss.
                    let error = match outcomes.get(lead) {
                        Some(PageOutcome::Failed(e)) => Some(format!("read: {e}")),
                        _ => None,
                    };
                    (lead, error)
                }
                Err(e) => (0, Some(format!("read: {e}"))),
            };
            let mut st = self.shared.state.lock();
            if st.terminated {
                return;
            }
            self.shared.advance(&mut st, lead);
            if let Some(e) = error {
                tracing::debug!(error = %e, "L3 fetch failed; keeping the pages fetched so far");
                st.failed = true;
                let lost = slots.len() - st.completed;
                st.note_failure(lost, e);
                return;
            }
            if lead < end - at {
                return;
            }
            at = end;
        }
    }
}

/// [`QueryJob`] as a [`Fetcher`]: the chain of its keys, hashed by the lookup.
struct DenseFetch {
    job: QueryJob,
    chain: Option<Chain>,
}

impl Fetcher for DenseFetch {
    type Slots = Vec<HostSlot>;

    async fn lookup(&mut self, _: &FetchShared) -> (usize, QueryResult) {
        let mut hashes = std::mem::take(&mut self.job.hashes);
        let job = &self.job;
        job.hasher
            .hash_pages_into(job.prior, &job.tokens, &mut hashes);
        let chain = Chain::new(
            job.prefix.as_deref(),
            hashes.iter().map(|h| PageKey::new(job.namespace, *h)),
        );
        let hit = job.query(&chain).await;
        self.chain = Some(chain);
        (hit, QueryResult { hashes })
    }

    async fn fetch(&mut self, slots: &Vec<HostSlot>, _: &FetchShared) {
        let chain = self.chain.as_ref().expect("fetched after the lookup");
        self.job.fetch(chain, slots).await;
    }

    fn leftover(slots: &Vec<HostSlot>, completed: usize) -> Option<Vec<HostSlot>> {
        Some(slots[completed..].to_vec())
    }
}

/// A backup's task: stores host pages in L3, batch by batch, skipping pages present. Batches
/// are submitted in order and pipelined: the next batch is sent while the previous one's
/// durability barrier runs, with at most [`crate::L3_WRITE_BATCHES_IN_FLIGHT`] batches in
/// flight over every backup of the tier (`in_flight`, a fair semaphore, so submission
/// order is kept across backups too). A page counts as stored only once its batch is
/// acknowledged (`batch_set` returned: durable per the backend's contract), and the backup
/// is done only when every batch is.
pub(crate) struct BackupJob {
    pub storage: Arc<dyn Storage>,
    pub pool: Arc<dyn PageSource>,
    /// The keys of the pages to store, after their prefix keys when those are passed.
    pub chain: Arc<Chain>,
    pub slots: Vec<HostSlot>,
    pub batch: usize,
    pub layout: LayoutKind,
    pub shared: Arc<BackupShared>,
    /// One permit per batch in flight, shared by every backup of the tier.
    pub in_flight: Arc<Semaphore>,
}

impl BackupJob {
    /// Runs the job to its end (spawn it on the L3 runtime).
    pub async fn run(self) {
        let span = tracing::debug_span!("l3_backup", pages = self.chain.len());
        let shared = self.shared.clone();
        self.run_inner().instrument(span).await;
        shared.done.set();
    }

    async fn run_inner(self) {
        let mut batches = Vec::new();
        for (i, slots) in self.slots.chunks(self.batch).enumerate() {
            let at = i * self.batch;
            if self.shared.failed.load(Ordering::Relaxed) {
                // As without pipelining: nothing more is sent after a failed batch.
                break;
            }
            let Ok(permit) = self.in_flight.clone().acquire_owned().await else {
                self.shared.failed.store(true, Ordering::Relaxed);
                self.shared.note_error("the L3 runtime is shutting down");
                break;
            };
            let unit = BackupBatch {
                storage: self.storage.clone(),
                pool: self.pool.clone(),
                chain: self.chain.clone(),
                at,
                slots: slots.to_vec(),
                layout: self.layout,
                shared: self.shared.clone(),
            };
            // Its own task, so that it progresses while this one waits for the next permit.
            batches.push(tokio::spawn(
                async move {
                    unit.run().await;
                    drop(permit);
                }
                .in_current_span(),
            ));
        }
        for b in batches {
            if let Err(e) = b.await {
                tracing::error!(error = %e, "an L3 backup batch task died");
                self.shared.failed.store(true, Ordering::Relaxed);
                self.shared.note_error(format!("batch task: {e}"));
            }
        }
    }
}

/// One batch of a backup.
struct BackupBatch {
    storage: Arc<dyn Storage>,
    pool: Arc<dyn PageSource>,
    chain: Arc<Chain>,
    /// The batch's first page in the chain (its keys are `chain.keys(at..at + slots.len())`).
    at: usize,
    slots: Vec<HostSlot>,
    layout: LayoutKind,
    shared: Arc<BackupShared>,
}

impl BackupBatch {
    async fn run(self) {
        let at = self.at;
        let keys = self.chain.keys(at..at + self.slots.len());
        let present = match self
            .storage
            .batch_exists_with(keys, self.chain.context(at))
            .instrument(tracing::debug_span!("l3_batch_exists", pages = keys.len()))
            .await
        {
            Ok(n) => n.min(keys.len()),
            Err(_) => 0,
        };
        let mut stored = present;
        if present < keys.len() {
            let mut bufs = Vec::with_capacity(keys.len() - present);
            for &slot in &self.slots[present..] {
                // SAFETY: the node holding this page is host-protected until the backup's
                // ack is processed, which waits for this batch; nobody writes it meanwhile.
                match unsafe { read_parts(&*self.pool, slot) } {
                    Ok(parts) => bufs.push(PageBuf::from_parts(self.layout, parts)),
                    Err(e) => {
                        tracing::error!(error = %e, "bad host page in a backup");
                        self.shared.failed.store(true, Ordering::Relaxed);
                        self.shared.note_error(format!("host page: {e}"));
                        // Nothing is sent: the batch's keys and buffers would not pair.
                        (self.shared.stored_pages).fetch_add(present as u64, Ordering::Relaxed);
                        return;
                    }
                }
            }
            let set = self
                .storage
                .batch_set_with(&keys[present..], &bufs, self.chain.context(at + present))
                .instrument(tracing::debug_span!("l3_batch_set", pages = bufs.len()))
                .await;
            match set {
                Ok(outcomes) => {
                    let ok = outcomes.iter().filter(|o| o.is_ok()).count();
                    stored += ok;
                    if ok < outcomes.len() {
                        // Counted (backup pages − stored) and logged, rate-limited, by the
                        // engine thread when the backup finishes.
                        if let Some(bad) = outcomes.iter().find(|o| !o.is_ok()) {
                            let why = match bad {
                                PageOutcome::Failed(e) => e.to_string(),
                                other => format!("{other:?}"),
                            };
                            self.shared.note_error(format!("write: {why}"));
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "L3 backup failed");
                    self.shared.failed.store(true, Ordering::Relaxed);
                    self.shared.note_error(format!("write: {e}"));
                    return;
                }
            }
        }
        self.shared
            .stored_pages
            .fetch_add(stored as u64, Ordering::Relaxed);
    }
}
