//! Holds the `hicache` controller's background copies back until they have completed in
//! simulated time ([`crate::links`]), without changing the controller.
//!
//! Two gates, both shared with the adapter that drives them:
//!
//! - [`ClockRank`] is the cache's [`RankGroup`]: a group of one whose per-tick agreement is
//!   also bounded by the simulated clock. The controller finishes (acknowledges) only as many
//!   write-through batches and L3 backups as every rank agrees are done
//!   ([`hicache::EXCHANGE_WRITES_FINISHED`], [`hicache::EXCHANGE_BACKUPS_FINISHED`]); this
//!   rank agrees to those whose simulated completion is at or before the clock. Until then a
//!   written node's device pages stay locked and it is not backed up, and a backup's host
//!   pages stay pinned — as on a real node while the copy runs.
//! - [`GatedStorage`] wraps the L3 backend: a page stored by a backup stays invisible to
//!   lookups (`batch_exists`) until its backup has completed in simulated time; lookups that
//!   stopped at such a page are counted ([`L3Clock::pages_in_flight`]).
//!
//! Invariants (the adapter keeps them):
//! 1. The clock moves only while no copy, backup or lookup runs in wall time, so what a gate
//!    decides never depends on how fast this machine copies (runs repeat).
//! 2. Every write batch and backup in flight has an entry in [`Clock`], oldest first, with its
//!    simulated completion (`INFINITY` while it is not yet timed); entries leave in the order
//!    the controller finishes them.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use hicache::{EXCHANGE_BACKUPS_FINISHED, EXCHANGE_WRITES_FINISHED, RankError, RankGroup};
use hicache_storage::{
    BackendContext, BackendFactory, BackendInfo, BatchContext, CommonConfig, ConfigFields,
    MemoryRegion, PageBuf, PageBufMut, PageKey, PageOutcome, Registry, Storage, StorageStats,
    async_trait,
};

use crate::cache::CacheResult;
use crate::links::Links;

/// The simulated clock and the completion times of what is in flight.
#[derive(Debug, Default)]
pub struct Clock {
    /// Simulated time (s).
    pub now: f64,
    /// Every copy counts as complete (shutdown).
    pub open: bool,
    /// Completion of each write-through batch in flight, oldest first.
    pub writes: VecDeque<f64>,
    /// Completion of each L3 backup in flight, oldest first.
    pub backups: VecDeque<f64>,
}

impl Clock {
    fn due(&self, q: &VecDeque<f64>) -> u64 {
        if self.open {
            return u64::MAX;
        }
        q.iter().take_while(|&&t| t <= self.now).count() as u64
    }

    /// Whether a copy in flight has completed by `now` (the controller may finish it).
    pub fn any_due(&self) -> bool {
        self.due(&self.writes) > 0 || self.due(&self.backups) > 0
    }

    /// The earliest completion in flight.
    pub fn next_completion(&self) -> Option<f64> {
        let w = self.writes.front().copied().unwrap_or(f64::INFINITY);
        let b = self.backups.front().copied().unwrap_or(f64::INFINITY);
        Some(w.min(b)).filter(|t| t.is_finite())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another thread panicked while holding it; the data (times
    // and counters) is still consistent enough to report.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The cache's rank group: one rank, whose agreement on finished copies is bounded by the
/// simulated clock (see the module documentation).
#[derive(Debug, Clone)]
pub struct ClockRank {
    clock: Arc<Mutex<Clock>>,
    /// Index of "write-through copies finished" in the exchanged vector.
    writes_at: usize,
    /// Index of "L3 backups finished", if the clock bounds it.
    backups_at: Option<usize>,
}

impl ClockRank {
    /// The dense controller's rank bounded by `clock` (writes at
    /// [`EXCHANGE_WRITES_FINISHED`], backups at [`EXCHANGE_BACKUPS_FINISHED`]).
    pub fn new(clock: Arc<Mutex<Clock>>) -> Self {
        Self {
            clock,
            writes_at: EXCHANGE_WRITES_FINISHED,
            backups_at: Some(EXCHANGE_BACKUPS_FINISHED),
        }
    }

    /// A rank bounded by `clock` for a controller that exchanges its finished
    /// write-through (device → host) copies at index `writes_at` of its per-tick vector, and
    /// nothing else the clock bounds (the hybrid controller: its `HYBRID_EXCHANGE_BACKUPS`;
    /// its L3 values pass).
    pub fn writes_only(clock: Arc<Mutex<Clock>>, writes_at: usize) -> Self {
        Self {
            clock,
            writes_at,
            backups_at: None,
        }
    }
}

impl RankGroup for ClockRank {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn exchange(&self, min: &mut [u64], _max: &mut [u64]) -> Result<(), RankError> {
        let last = self.writes_at.max(self.backups_at.unwrap_or(0));
        if min.len() <= last {
            return Ok(());
        }
        let mut c = lock(&self.clock);
        let gates = [(Some(self.writes_at), true), (self.backups_at, false)];
        for (i, writes) in gates.into_iter().filter_map(|(i, w)| Some((i?, w))) {
            let q = if writes { &c.writes } else { &c.backups };
            let agreed = min[i].min(c.due(q));
            min[i] = agreed;
            let q = if writes {
                &mut c.writes
            } else {
                &mut c.backups
            };
            let n = (agreed as usize).min(q.len());
            q.drain(..n);
        }
        Ok(())
    }
}

/// The simulated-time state an adapter shares with its gates ([`ClockRank`] and
/// [`GatedStorage`]), and the steps every adapter takes on it: time what the controller
/// launched on the [`Links`], open everything when copies are free, close the L3 window.
#[derive(Debug, Clone, Default)]
pub struct CopyTimer {
    /// Completions of the copies in flight.
    pub clock: Arc<Mutex<Clock>>,
    /// Visibility of stored pages.
    pub l3: Arc<Mutex<L3Clock>>,
}

impl CopyTimer {
    /// Copy time free: every copy counts as complete and every stored page as visible.
    pub fn open_all(&self) {
        lock(&self.clock).open = true;
        let mut l3 = lock(&self.l3);
        l3.close_window(|_| 0.0);
        l3.set_now(f64::INFINITY);
    }

    /// The end of a run: whatever is still in flight completes after the last request.
    pub fn close_run(&self) {
        lock(&self.clock).open = true;
        lock(&self.l3).set_now(f64::INFINITY);
    }

    /// Moves the simulated clock of both gates to `now`.
    pub fn set_now(&self, now: f64) {
        lock(&self.clock).now = now;
        lock(&self.l3).set_now(now);
    }

    /// Write-through batches timed so far and not yet finished.
    pub fn writes_in_flight(&self) -> usize {
        lock(&self.clock).writes.len()
    }

    /// Times write-through batches launched at `now` beyond those already timed, one D2H
    /// transfer of its bytes each, in launch order; `in_flight` lists every batch in flight,
    /// oldest first, by its bytes.
    pub fn time_writes(&self, now: f64, links: &mut Links, in_flight: &[u64]) {
        let mut c = lock(&self.clock);
        let known = c.writes.len();
        for &bytes in in_flight.iter().skip(known) {
            let done = links.d2h.transfer(now, bytes);
            c.writes.push_back(done);
        }
    }

    /// Times `count` write-through copies launched at `now` whose bytes are known only
    /// together: one D2H transfer of `bytes`, at whose end they all complete.
    pub fn time_write_group(&self, now: f64, links: &mut Links, count: usize, bytes: u64) {
        if count == 0 {
            return;
        }
        let done = links.d2h.transfer(now, bytes);
        lock(&self.clock)
            .writes
            .extend(std::iter::repeat_n(done, count));
    }

    /// Records L3 backups in flight up to `in_flight` in total, untimed until the window
    /// they stored in closes ([`CopyTimer::close_window`]).
    pub fn add_backups(&self, in_flight: usize) {
        let mut c = lock(&self.clock);
        while c.backups.len() < in_flight {
            c.backups.push_back(f64::INFINITY);
        }
    }

    /// Times the open window of L3 backups (every page they stored, as one transfer on the
    /// L3 link issued now); pages stored become visible and the backups finishable when it
    /// ends.
    pub fn close_window(&self, now: f64, links: &mut Links) {
        let mut c = lock(&self.clock);
        let mut done = now;
        lock(&self.l3).close_window(|bytes| {
            done = links.l3.transfer(now, bytes);
            done
        });
        for t in c.backups.iter_mut().filter(|t| t.is_infinite()) {
            *t = done;
        }
    }

    /// Whether a copy in flight has completed by the clock (the controller may finish it).
    pub fn any_due(&self) -> bool {
        lock(&self.clock).any_due()
    }

    /// The earliest completion in flight.
    pub fn next_completion(&self) -> Option<f64> {
        lock(&self.clock).next_completion()
    }

    /// L3 pages lookups found stored but not yet visible.
    pub fn l3_pages_in_flight(&self) -> u64 {
        lock(&self.l3).pages_in_flight()
    }

    /// The rank group of the dense controller, bounded by this clock.
    pub fn dense_rank(&self) -> ClockRank {
        ClockRank::new(self.clock.clone())
    }

    /// `base`'s backends, each opened behind a [`GatedStorage`] on this clock.
    pub fn gated_registry(&self, base: &Registry) -> hicache_storage::Result<Registry> {
        gated_registry(base, &self.l3)
    }

    /// `inner` behind a [`GatedStorage`] on this clock.
    pub fn gate(&self, inner: Arc<dyn Storage>) -> Arc<dyn Storage> {
        Arc::new(GatedStorage {
            inner,
            clock: self.l3.clone(),
        })
    }
}

/// A controller under a [`CopyTimer`]: the steps [`advance_gated`] takes on it.
pub trait Gated {
    /// The timer its gates share.
    fn timer(&self) -> &CopyTimer;
    /// Waits in wall time until every launched copy, backup and lookup has finished
    /// (invariant 1).
    fn wait_quiet(&mut self) -> CacheResult<()>;
    /// One tick of the controller: finishes what the gates allow, launches new copies.
    fn tick(&mut self) -> CacheResult<()>;
    /// Times on `links` what the last tick launched, at `now`.
    fn time_launches(&mut self, now: f64, links: &mut Links) -> CacheResult<()>;
}

/// Moves `g`'s clock to `now` and lets it finish every copy completed by then: waits for
/// what runs (launched at the old time), then ticks, times the launches and closes the L3
/// window until no completion is due.
pub fn advance_gated(g: &mut impl Gated, now: f64, links: &mut Links) -> CacheResult<()> {
    g.wait_quiet()?;
    g.timer().set_now(now);
    loop {
        g.tick()?;
        g.time_launches(now, links)?;
        g.wait_quiet()?;
        g.timer().close_window(now, links);
        if !g.timer().any_due() {
            return Ok(());
        }
    }
}

/// What the storage gate knows: the simulated time, pages not yet visible, and the pages
/// stored since the last window was timed.
#[derive(Debug, Default)]
pub struct L3Clock {
    now: f64,
    /// Pages stored whose backup completes at the given simulated time (`INFINITY`: not yet
    /// timed).
    hidden: HashMap<PageKey, f64>,
    /// Pages stored since the last [`L3Clock::close_window`].
    window: Vec<PageKey>,
    window_bytes: u64,
    /// Pages lookups found stored but not yet visible.
    pages_in_flight: u64,
}

impl L3Clock {
    /// Sets the simulated time and forgets pages that became visible.
    pub fn set_now(&mut self, now: f64) {
        self.now = now;
        self.hidden.retain(|_, t| *t > now);
    }

    /// Times the pages stored since the last call: they become visible at `done`. Returns
    /// the bytes they took.
    pub fn close_window(&mut self, done: impl FnOnce(u64) -> f64) -> u64 {
        let bytes = std::mem::take(&mut self.window_bytes);
        let keys = std::mem::take(&mut self.window);
        if keys.is_empty() {
            return 0;
        }
        let at = done(bytes);
        for k in keys {
            if let Some(t) = self.hidden.get_mut(&k)
                && t.is_infinite()
            {
                *t = at;
            }
        }
        bytes
    }

    /// Pages lookups found stored but not yet visible (L3 hits lost to backups in flight).
    pub fn pages_in_flight(&self) -> u64 {
        self.pages_in_flight
    }
}

/// An L3 backend whose backed-up pages become visible at their simulated completion.
pub struct GatedStorage {
    inner: Arc<dyn Storage>,
    clock: Arc<Mutex<L3Clock>>,
}

#[async_trait]
impl Storage for GatedStorage {
    fn info(&self) -> BackendInfo {
        self.inner.info()
    }

    async fn batch_exists(&self, keys: &[PageKey]) -> hicache_storage::Result<usize> {
        self.batch_exists_with(keys, BatchContext::NONE).await
    }

    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> hicache_storage::Result<Vec<PageOutcome>> {
        self.batch_get_with(keys, dst, BatchContext::NONE).await
    }

    async fn batch_set(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
    ) -> hicache_storage::Result<Vec<PageOutcome>> {
        self.batch_set_with(keys, src, BatchContext::NONE).await
    }

    async fn batch_exists_with(
        &self,
        keys: &[PageKey],
        ctx: BatchContext<'_>,
    ) -> hicache_storage::Result<usize> {
        let n = self.inner.batch_exists_with(keys, ctx).await?;
        let mut c = lock(&self.clock);
        let now = c.now;
        let visible = keys[..n.min(keys.len())]
            .iter()
            .take_while(|k| c.hidden.get(k).is_none_or(|&t| t <= now))
            .count();
        c.pages_in_flight += (n - visible) as u64;
        Ok(visible)
    }

    async fn batch_get_with(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
        ctx: BatchContext<'_>,
    ) -> hicache_storage::Result<Vec<PageOutcome>> {
        self.inner.batch_get_with(keys, dst, ctx).await
    }

    async fn batch_set_with(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
        ctx: BatchContext<'_>,
    ) -> hicache_storage::Result<Vec<PageOutcome>> {
        let out = self.inner.batch_set_with(keys, src, ctx).await?;
        let mut c = lock(&self.clock);
        for ((k, o), buf) in keys.iter().zip(&out).zip(src) {
            if o.is_ok() {
                c.window.push(*k);
                c.window_bytes += buf.len() as u64;
                c.hidden.entry(*k).or_insert(f64::INFINITY);
            }
        }
        Ok(out)
    }

    fn register_memory(&self, region: MemoryRegion) -> hicache_storage::Result<()> {
        self.inner.register_memory(region)
    }

    async fn delete(&self, keys: &[PageKey]) -> hicache_storage::Result<usize> {
        let n = self.inner.delete(keys).await?;
        let mut c = lock(&self.clock);
        for k in keys {
            c.hidden.remove(k);
        }
        Ok(n)
    }

    async fn clear(&self, namespace: hicache_storage::NamespaceId) -> hicache_storage::Result<u64> {
        let n = self.inner.clear(namespace).await?;
        lock(&self.clock)
            .hidden
            .retain(|k, _| k.namespace != namespace);
        Ok(n)
    }

    fn stats(&self) -> StorageStats {
        self.inner.stats()
    }
}

struct GatedFactory {
    inner: Arc<dyn BackendFactory>,
    clock: Arc<Mutex<L3Clock>>,
}

#[async_trait]
impl BackendFactory for GatedFactory {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn open(
        &self,
        common: &CommonConfig,
        fields: ConfigFields,
        ctx: &BackendContext,
    ) -> hicache_storage::Result<Arc<dyn Storage>> {
        let inner = self.inner.open(common, fields, ctx).await?;
        Ok(Arc::new(GatedStorage {
            inner,
            clock: self.clock.clone(),
        }))
    }
}

/// `base`'s backends, each opened behind a [`GatedStorage`] sharing `clock`.
pub fn gated_registry(
    base: &Registry,
    clock: &Arc<Mutex<L3Clock>>,
) -> hicache_storage::Result<Registry> {
    let out = Registry::new();
    for name in base.names() {
        out.register_arc(Arc::new(GatedFactory {
            inner: base.factory(&name)?,
            clock: clock.clone(),
        }))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_agrees_only_to_copies_completed_by_the_clock() {
        let clock = Arc::new(Mutex::new(Clock {
            now: 1.0,
            writes: [0.5, 1.0, 2.0].into(),
            backups: [3.0].into(),
            ..Clock::default()
        }));
        let rank = ClockRank::new(clock.clone());
        // The controller saw all three writes and the backup done in wall time.
        let mut min = [3, 0, 1, 10];
        rank.exchange(&mut min, &mut []).unwrap();
        assert_eq!(min, [2, 0, 0, 10]);
        assert_eq!(lock(&clock).writes, VecDeque::from([2.0]));
        assert_eq!(lock(&clock).next_completion(), Some(2.0));
        // A copy not done in wall time is not finished, whatever the clock says.
        lock(&clock).now = 5.0;
        let mut min = [0, 0, 1, 10];
        rank.exchange(&mut min, &mut []).unwrap();
        assert_eq!(min, [0, 0, 1, 10]);
        assert_eq!(lock(&clock).writes.len(), 1);
        assert!(lock(&clock).backups.is_empty());
        // Open: everything the controller finished leaves.
        lock(&clock).open = true;
        let mut min = [1, 0, 0, 10];
        rank.exchange(&mut min, &mut []).unwrap();
        assert_eq!(min[0], 1);
        assert!(lock(&clock).writes.is_empty());
    }

    #[test]
    fn a_writes_only_rank_gates_only_its_index() {
        let clock = Arc::new(Mutex::new(Clock {
            now: 1.0,
            writes: [0.5, 2.0].into(),
            backups: [0.5].into(),
            ..Clock::default()
        }));
        let rank = ClockRank::writes_only(clock.clone(), 0);
        // An empty agreement passes and leaves the writes.
        rank.exchange(&mut [], &mut []).unwrap();
        assert_eq!(lock(&clock).writes.len(), 2);
        // The tick's vector: writes bounded by the clock, the other values (loads, L3)
        // unchanged, and no backup entry consumed.
        let mut min = [2, 3, 4, 5];
        rank.exchange(&mut min, &mut []).unwrap();
        assert_eq!(min, [1, 3, 4, 5]);
        assert_eq!(lock(&clock).writes, VecDeque::from([2.0]));
        assert_eq!(lock(&clock).backups.len(), 1);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn stored_pages_stay_invisible_until_their_window_completes() {
        use hicache_storage::{LayoutKind, MemoryBackend, MemoryOptions, PageHash};
        let inner: Arc<dyn Storage> = Arc::new(MemoryBackend::new(MemoryOptions::default()));
        let clock = Arc::new(Mutex::new(L3Clock::default()));
        let g = GatedStorage {
            inner,
            clock: clock.clone(),
        };
        let keys: Vec<PageKey> = (0..2u8)
            .map(|i| PageKey::new(Default::default(), PageHash([i; 32])))
            .collect();
        let data = [[1u8; 8], [2u8; 8]];
        let bufs: Vec<PageBuf<'_>> = data
            .iter()
            .map(|d| PageBuf::from_parts(LayoutKind::PageFirst, vec![&d[..]]))
            .collect();
        let out = g.batch_set(&keys, &bufs).await.unwrap();
        assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
        assert_eq!(g.batch_exists(&keys).await.unwrap(), 0);
        assert_eq!(lock(&clock).pages_in_flight(), 2);
        let bytes = lock(&clock).close_window(|b| {
            assert_eq!(b, 16);
            2.0
        });
        assert_eq!(bytes, 16);
        lock(&clock).set_now(1.9);
        assert_eq!(g.batch_exists(&keys).await.unwrap(), 0);
        lock(&clock).set_now(2.0);
        assert_eq!(g.batch_exists(&keys).await.unwrap(), 2);
        assert_eq!(lock(&clock).pages_in_flight(), 4);
    }
}
