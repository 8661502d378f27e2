//! The per-tick event pump, [`HiCache::poll`], and the agreement between ranks.
//!
//! One poll = gather local counts → **one** fixed-shape exchange → apply. The exchanged
//! vector (reduced with `min` element-wise) is:
//!
//! | index | value |
//! |---|---|
//! | 0 | D2H batches finished, counted from the oldest |
//! | 1 | H2D batches finished, counted from the oldest |
//! | 2 | L3 backups finished, counted from the oldest |
//! | 3 | free host pages |
//! | 4 + 4·i … | prefetch `i` (creation order): query done, hit pages, pages fetched, may terminate |
//!
//! Every rank tracks the same prefetches in the same order (they are created and ended by
//! calls every rank makes identically, or by decisions taken from agreed values), so the
//! shape is the same everywhere; `TcpRankGroup` checks it. At most
//! [`MAX_TRACKED_PREFETCHES`] are tracked, so the vector always fits one exchange
//! ([`crate::rank::MAX_EXCHANGE_LEN`]); arrivals beyond that start no prefetch. Decisions then use only agreed
//! numbers, so all trees change identically: a rank whose storage is slower simply holds
//! the others back (wait_complete) or makes all of them cut the prefetch at the same page
//! (best_effort, timeout).

use crate::cache::HiCache;
use crate::error::Result;

/// Index of "D2H batches finished" in the per-tick exchange's `min` vector (see the table
/// above). A [`crate::RankGroup`] that lowers it holds write-through acknowledgements back.
pub const EXCHANGE_WRITES_FINISHED: usize = 0;
/// Index of "L3 backups finished" in the per-tick exchange's `min` vector.
pub const EXCHANGE_BACKUPS_FINISHED: usize = 2;
/// Values of the per-tick exchange before the prefetches.
const FIXED_VALUES: usize = 4;
/// Values per tracked prefetch.
const VALUES_PER_PREFETCH: usize = 4;
/// Most prefetches tracked at once: the per-tick vector must fit one exchange.
pub(crate) const MAX_TRACKED_PREFETCHES: usize =
    (crate::rank::MAX_EXCHANGE_LEN - FIXED_VALUES) / VALUES_PER_PREFETCH;

/// What one [`HiCache::poll`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PollReport {
    /// D2H batches finished (their nodes are now backed up).
    pub writes_finished: usize,
    /// H2D batches finished (their nodes unpinned).
    pub loads_finished: usize,
    /// L3 backups finished.
    pub backups_finished: usize,
    /// Prefetches still tracked.
    pub prefetches_in_flight: usize,
    /// D2H batches launched by this poll.
    pub writes_launched: usize,
}

/// Background work launched and not yet finished by [`HiCache::poll`], oldest first: for a
/// caller that models how long it takes (the bench's simulated clock charges copy time on its
/// links and holds acknowledgements back through its rank group until then).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InFlight {
    /// Each D2H (write-through) batch: pages, and whether its copy has completed.
    pub writes: Vec<(usize, bool)>,
    /// Each L2→L3 backup: pages, and whether its task has finished.
    pub backups: Vec<(usize, bool)>,
    /// Prefetches whose L3 lookup is still running.
    pub lookups: usize,
}

impl HiCache {
    /// What is in flight now (see [`InFlight`]).
    pub fn in_flight(&self) -> Result<InFlight> {
        let mut out = InFlight::default();
        for w in &self.writes {
            out.writes.push((w.pages, w.done.is_done()?));
        }
        if let Some(l3) = &self.l3 {
            for b in &l3.backups {
                let done = b.shared.done.load(std::sync::atomic::Ordering::Acquire);
                out.backups.push((b.pages, done));
            }
            out.lookups = l3
                .prefetches
                .values()
                .filter(|op| op.shared.query.lock().is_none())
                .count();
        }
        Ok(out)
    }

    /// The per-tick pump; call it once per scheduler iteration, before scheduling: finishes
    /// the copies and L3 operations that completed on every rank, advances prefetches per
    /// policy, and launches the D2H batch of the nodes that became due since the last poll.
    pub fn poll(&mut self) -> Result<PollReport> {
        self.check_open()?;
        self.poll_inner()
    }

    pub(crate) fn poll_inner(&mut self) -> Result<PollReport> {
        self.collect_leftovers(false)?;
        let seqs = self.prefetch_seqs();
        let mut min = Vec::with_capacity(4 + 4 * seqs.len());
        min.push(self.ready_writes()? as u64); // EXCHANGE_WRITES_FINISHED
        min.push(self.ready_loads()? as u64);
        min.push(self.ready_backups() as u64); // EXCHANGE_BACKUPS_FINISHED
        min.push(self.host_pool.available() as u64);
        if let Some(l3) = &self.l3 {
            for seq in &seqs {
                min.extend_from_slice(&self.prefetch_local(&l3.prefetches[seq]));
            }
        }
        self.rank.exchange(&mut min, &mut [])?;
        self.host_budget = min[3] as usize;
        let mut report = PollReport {
            writes_finished: min[0] as usize,
            loads_finished: min[1] as usize,
            backups_finished: min[2] as usize,
            ..Default::default()
        };
        self.finish_writes(report.writes_finished)?;
        self.finish_loads(report.loads_finished)?;
        self.finish_backups(report.backups_finished)?;
        for (i, seq) in seqs.iter().enumerate() {
            let v = &min[4 + 4 * i..8 + 4 * i];
            self.prefetch_apply(*seq, [v[0], v[1], v[2], v[3]])?;
        }
        let before = self.writes.len();
        self.launch_writes()?;
        report.writes_launched = self.writes.len() - before;
        report.prefetches_in_flight = self.prefetch_seqs().len();
        self.refresh_gauges();
        self.publish_events();
        Ok(report)
    }

    /// Whether anything is in flight (copies, L3 operations, due writes).
    pub fn busy(&self) -> bool {
        !self.due_writes.is_empty()
            || !self.writes.is_empty()
            || !self.loads.is_empty()
            || !self.queued_loads.is_empty()
            || self
                .l3
                .as_ref()
                .is_some_and(|l| !l.backups.is_empty() || !l.prefetches.is_empty())
    }

    /// Polls until nothing is in flight except prefetches of live requests: every due write
    /// is launched and finished, every L3 backup finished. Every rank must call it together.
    pub fn drain(&mut self) -> Result<()> {
        self.check_open()?;
        loop {
            self.poll_inner()?;
            let pending = !self.due_writes.is_empty()
                || !self.writes.is_empty()
                || !self.loads.is_empty()
                || self.l3.as_ref().is_some_and(|l| !l.backups.is_empty());
            if !pending {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }

    /// Drops every cached page in L1 and L2 (SGLang's `flush_cache`; L3 is kept). Idle only:
    /// no live requests; in-flight copies are drained first.
    pub fn flush(&mut self) -> Result<()> {
        self.check_open()?;
        if !self.requests.is_empty() {
            return Err(crate::HiCacheError::NotIdle(format!(
                "cannot flush: {} live requests",
                self.requests.len()
            )));
        }
        if !self.queued_loads.is_empty() {
            self.start_loading()?;
        }
        self.drain()?;
        let (dev, host) = self.tree.reset();
        self.device_pool.free(&crate::cache::dev_slots(&dev))?;
        self.free_host(&crate::cache::host_slots(&host))?;
        // Pages handed back by prefetch tasks go to the pool only: a task stuck in its
        // backend keeps its pages on one rank, and the budget stays what every rank has.
        self.collect_leftovers(true)?;
        self.events.push(hicache_core::KvEvent::AllBlocksCleared);
        Ok(())
    }

    /// Graceful shutdown: launches and finishes every due write, waits for every L3 backup
    /// (nothing acknowledged is lost), revokes prefetches, detaches L3. Afterwards every call
    /// returns [`crate::HiCacheError::Closed`]. Calling it twice is an error.
    pub fn shutdown(&mut self) -> Result<()> {
        self.check_open()?;
        if !self.queued_loads.is_empty() {
            self.start_loading()?;
        }
        self.drain()?;
        self.detach_storage()?;
        self.closed = true;
        Ok(())
    }
}
