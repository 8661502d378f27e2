//! The per-tick agreement between ranks: [`TickCounts`] (gather → **one** fixed-shape
//! exchange → apply) and what a poll did ([`PollReport`]).
//!
//! The exchanged vector (reduced with `min` element-wise) is:
//!
//! | index | value |
//! |---|---|
//! | 0 | D2H batches finished, counted from the oldest |
//! | 1 | H2D batches finished, counted from the oldest |
//! | 2 | L3 backups finished, counted from the oldest |
//! | 3 | free host pages |
//! | 4 | index of the first finished L3 backup that did not store every page (`u64::MAX`: none) |
//! | 5 + 4·i … | prefetch `i` (creation order): [`PrefetchCounts`] |
//!
//! Every rank tracks the same prefetches in the same order (they are created and ended by
//! calls every rank makes identically, or by decisions taken from agreed values), so the
//! shape is the same everywhere; `TcpRankGroup` checks it. At most
//! [`MAX_TRACKED_PREFETCHES`] are tracked, so the vector always fits one exchange
//! ([`MAX_EXCHANGE_LEN`]). Decisions then use only agreed numbers, so all trees change
//! identically: a rank whose storage is slower simply holds the others back (wait_complete)
//! or makes all of them cut the prefetch at the same page (best_effort, timeout).

use hicache_core::KvEvent;

use crate::agree::{Counts, Gathered};
use crate::copies::Copies;
use crate::error::Result;
use crate::l3::{L3, MAX_TRACKED_PREFETCHES, PrefetchCounts};
use crate::rank::{MAX_EXCHANGE_LEN, RankGroup};
use crate::request_state::Requests;
use crate::tree_pools::Tiers;

/// Index of "D2H batches finished" in the exchanged vector (see the table above). A
/// [`RankGroup`] that lowers it holds write-through acknowledgements back.
pub const EXCHANGE_WRITES_FINISHED: usize = 0;
/// Index of "L3 backups finished" in the exchanged vector.
pub const EXCHANGE_BACKUPS_FINISHED: usize = 2;
/// Values of the exchange before the prefetches.
pub(crate) const FIXED_VALUES: usize = 5;

// The largest exchange fits one round.
const _: () =
    assert!(FIXED_VALUES + MAX_TRACKED_PREFETCHES * PrefetchCounts::LEN <= MAX_EXCHANGE_LEN);

/// What one [`crate::HiCache::poll`] did.
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

/// Background work launched and not yet finished by [`crate::HiCache::poll`], oldest first:
/// for a caller that models how long it takes (the bench's simulated clock charges copy time
/// on its links and holds acknowledgements back through its rank group until then).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InFlight {
    /// Each D2H (write-through) batch: pages, and whether its copy has completed.
    pub writes: Vec<(usize, bool)>,
    /// Each L2→L3 backup: pages, and whether its task has finished.
    pub backups: Vec<(usize, bool)>,
    /// Prefetches whose L3 lookup is still running.
    pub lookups: usize,
}

impl InFlight {
    /// What `copies` and `l3` have in flight.
    pub(crate) fn of(copies: &Copies, l3: Option<&L3>) -> Result<Self> {
        Ok(Self {
            writes: copies.write_pages_in_flight()?,
            backups: l3.map_or_else(Vec::new, L3::backup_pages_in_flight),
            lookups: l3.map_or(0, L3::lookups_running),
        })
    }
}

/// The counts of one tick: this rank's before the exchange, every rank's minimum after.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TickCounts {
    /// D2H batches finished, from the oldest.
    writes: usize,
    /// H2D batches finished, from the oldest.
    loads: usize,
    /// L3 backups finished, from the oldest.
    backups: usize,
    /// Free host pages.
    host_free: usize,
    /// The first finished L3 backup that did not store every page (see [`L3`]).
    backups_incomplete: usize,
    /// Each tracked prefetch's counts, in creation order.
    prefetches: Gathered<PrefetchCounts>,
}

/// The parts a tick changes.
pub(crate) struct TickParts<'a> {
    pub tiers: &'a mut Tiers,
    pub copies: &'a mut Copies,
    pub l3: Option<&'a mut L3>,
    pub requests: &'a mut Requests,
    /// Events the cache publishes besides the tree's (L3 stores).
    pub events: &'a mut Vec<KvEvent>,
}

impl TickCounts {
    /// This rank's counts; the prefetches' into `scratch` (the buffers of an earlier tick's
    /// [`into_scratch`](Self::into_scratch), reused).
    pub fn gather(
        copies: &Copies,
        l3: Option<&L3>,
        tiers: &Tiers,
        mut scratch: Gathered<PrefetchCounts>,
    ) -> Result<Self> {
        let ps = tiers.page_size();
        match l3 {
            Some(l3) => l3.prefetch_counts(ps, &mut scratch),
            None => scratch.clear(),
        }
        Ok(Self {
            writes: copies.ready_writes()?,
            loads: copies.ready_loads()?,
            backups: l3.map_or(0, L3::ready_backups),
            host_free: tiers.host_pool.available(),
            backups_incomplete: l3.map_or(usize::MAX, L3::first_incomplete_backup),
            prefetches: scratch,
        })
    }

    /// The prefetches' buffers, for the next tick's [`gather`](Self::gather).
    pub fn into_scratch(self) -> Gathered<PrefetchCounts> {
        self.prefetches
    }

    /// Every rank's minimum, through one exchange ([`Gathered::agree`]).
    pub fn agree(mut self, rank: &dyn RankGroup) -> Result<Self> {
        // EXCHANGE_WRITES_FINISHED, 1, EXCHANGE_BACKUPS_FINISHED, 3, 4.
        let mut fixed: [u64; FIXED_VALUES] = [
            self.writes as u64,
            self.loads as u64,
            self.backups as u64,
            self.host_free as u64,
            u64::try_from(self.backups_incomplete).unwrap_or(u64::MAX),
        ];
        self.prefetches.agree(rank, &mut fixed)?;
        self.writes = fixed[0] as usize;
        self.loads = fixed[1] as usize;
        self.backups = fixed[2] as usize;
        self.host_free = fixed[3] as usize;
        self.backups_incomplete = usize::try_from(fixed[4]).unwrap_or(usize::MAX);
        Ok(self)
    }

    /// Applies the agreed counts: finishes the copies and backups every rank finished
    /// (starting the L3 backups of finished writes), advances or ends prefetches, then
    /// launches the D2H batch of the nodes that became due.
    pub fn apply(&self, p: TickParts<'_>) -> Result<PollReport> {
        let TickParts {
            tiers,
            copies,
            mut l3,
            requests,
            events,
        } = p;
        tiers.budget = self.host_free;
        let mut report = PollReport {
            writes_finished: self.writes,
            loads_finished: self.loads,
            backups_finished: self.backups,
            ..Default::default()
        };
        let finished = copies.finish_writes(self.writes, tiers)?;
        if let Some(l3) = l3.as_deref_mut() {
            for fin in finished {
                l3.start_backup(fin, tiers)?;
            }
        }
        copies.finish_loads(self.loads, tiers)?;
        if let Some(l3) = l3.as_deref_mut() {
            l3.finish_backups(self.backups, self.backups_incomplete, tiers, events)?;
            // Exclusive tiering: make host room from cold pages before new pages need it (and
            // before this tick's prefetched pages arrive: they are for requests about to run).
            l3.demote_cold(tiers)?;
            for (seq, agreed) in self.prefetches.iter() {
                if let Some(end) = l3.apply_prefetch(seq, agreed, tiers)? {
                    requests.prefetch_ended(end);
                }
            }
        }
        report.writes_launched = copies.launch_writes(tiers)?;
        report.prefetches_in_flight = l3.map_or(0, |l3| l3.prefetches_tracked());
        Ok(report)
    }
}
