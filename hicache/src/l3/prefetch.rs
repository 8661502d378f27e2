//! Prefetches (L3 → L2): started at a request's arrival, advanced by the counts all ranks
//! agreed on at each poll, ended by policy.
//!
//! Invariants:
//! 1. **Anchor.** A prefetch fetches the pages after `last_host_node` (the deepest backed-up
//!    node of the match), chained from that node's last page hash, and inserts them under that
//!    same node. SGLang starts the tokens after the device *and* host match but chains from and
//!    inserts under `last_host_node`: when device-only nodes sit between the two
//!    the chain skips their tokens and every lookup misses. Here tokens, chain and anchor
//!    always agree; pages that are on device without a host copy are fetched too and adopted
//!    as their host copies by the tree.
//! 2. **Page ownership.** Host pages are allocated only after the hit is known (lazy), and
//!    only for the hit. The fetch task writes page `i` only while `i ≥ completed`;
//!    `completed` advances under the state lock and never after `terminated` is set. On
//!    termination the engine thread owns pages `[0, completed)` (inserts the agreed prefix,
//!    frees the rest); the task owns `[completed, n)` and hands them back when it exits.
//! 3. **Capacity.** In-flight prefetches hold at most `prefetch_capacity_ratio` of the host
//!    pool, counted in allocated hit pages (not candidate tokens, as SGLang does).
//! 4. **Prefix keys.** With `hicache_storage_pass_prefix_keys`, every batch of a prefetch is
//!    sent with the keys of the request's pages before it: the anchor's path from the root,
//!    then the prefetch's own earlier pages. Without it, with none.
//! 5. **Same on every rank.** Prefetches are created and ended by calls every rank makes
//!    identically, or by decisions taken from agreed values, so every rank tracks the same
//!    prefetches in the same (creation) order.
//! 6. **Failures are counted, never hidden.** A read that fails (the call, or a page's
//!    outcome `Failed`: an I/O error, not a miss) ends the fetch like a miss would, but its
//!    pages (the failed one and every later page of the hit) and the pages of a failed lookup
//!    batch are counted in `hicache_l3_failed_pages_total{op="read"}` and logged at warn
//!    (rate-limited) when the prefetch ends; a prefetch that brought nothing for it ends
//!    `failed`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hicache_core::{
    HiRadixTree, HostSlot, KnownHashes, MatchResult, NodeId, PageHash, PageKey, PrefetchConfig,
    PrefetchPolicy, TenantId,
};

use super::L3;
use super::jobs::{FetchShared, QueryJob};
use crate::agree::{Counts, Gathered};
use crate::error::{HiCacheError, Result};
use crate::metrics::{Direction, L3Op, PrefetchOutcome};
use crate::tree_pools::Tiers;

/// The engine's id of a request (unique among live requests): prefetches are tracked by
/// it.
pub type RequestId = u64;

/// Most prefetches tracked at once: the per-tick exchange carries
/// [`PrefetchCounts::LEN`] values for each after the tick's fixed values, in one round.
/// Arrivals beyond that start no prefetch.
pub(crate) const MAX_TRACKED_PREFETCHES: usize =
    crate::agree::max_tracked(crate::tick::FIXED_VALUES, PrefetchCounts::LEN);

/// Exclusive tiering: most polls a prefetch whose hit found no host room waits for cold
/// pages to reach L3 (and become droppable) before it gives up (`no_host_memory`).
const ROOM_WAIT_POLLS: u32 = 64;

/// How long [`L3::collect_leftovers`] waits, in all, for draining tasks to exit.
const LEFTOVER_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug)]
enum Phase {
    Querying,
    Fetching { host: Vec<HostSlot> },
}

/// A prefetch tracked by the engine thread.
#[derive(Debug)]
pub(crate) struct PrefetchOp {
    req: RequestId,
    tenant: TenantId,
    anchor: NodeId,
    /// Tokens after the anchor (whole pages), shared with the task (one copy per prefetch).
    tokens: Arc<[u32]>,
    /// Key page of the first token of `tokens` (the anchor's end).
    first_page: usize,
    /// The hash the task's chain starts from (the anchor's last page hash or the chain start).
    prior: Option<PageHash>,
    started: Instant,
    shared: Arc<FetchShared>,
    phase: Phase,
    /// Polls this prefetch waited for host room (exclusive tiering).
    room_waits: u32,
}

crate::agree::exchanged_counts! {
    /// One prefetch's values in the per-tick exchange (reduced with `min` over ranks).
    pub(crate) struct PrefetchCounts {
        /// The lookup finished.
        pub query_done: bool,
        /// Leading pages present in L3.
        pub hit_pages: u64,
        /// Pages fetched, from the first.
        pub completed_pages: u64,
        /// The policy allows ending the prefetch now.
        pub may_end: bool,
    }
}

/// Whether `policy` lets a prefetch started at `started` end now (SGLang's
/// `can_terminate_prefetch`): `best_effort` at any time, `wait_complete` once its read is
/// `done`, `timeout` then or once the budget for its `hit_tokens` has passed. Both
/// controllers decide with it.
pub(crate) fn may_end(
    policy: &PrefetchConfig,
    done: bool,
    started: Instant,
    hit_tokens: u64,
) -> bool {
    match policy.policy {
        PrefetchPolicy::BestEffort => true,
        PrefetchPolicy::WaitComplete => done,
        PrefetchPolicy::Timeout => done || started.elapsed() > policy.timeout(hit_tokens),
    }
}

/// This rank's view of one prefetch for the per-tick exchange, from its task's lock-free
/// progress (a few atomic loads: every tracked prefetch is viewed at every poll);
/// `fetching`: the engine thread has given it host pages. Both controllers exchange it.
pub(crate) fn prefetch_counts<S>(
    shared: &FetchShared<S>,
    fetching: bool,
    policy: &PrefetchConfig,
    started: Instant,
    page_size: usize,
) -> PrefetchCounts {
    let progress = &shared.progress;
    let query = progress.query();
    let hit = query.unwrap_or(0) as u64;
    let (completed, fetch_done) = if fetching {
        progress.fetched()
    } else {
        (0, false)
    };
    // As SGLang: the budget grows with the pages the query found (`len(hash)` after the
    // query; none while it runs), not with the candidate suffix, and counts from the op's
    // creation, query time included.
    let may_end = may_end(policy, fetch_done, started, hit * page_size as u64);
    PrefetchCounts {
        query_done: query.is_some(),
        hit_pages: hit,
        completed_pages: completed as u64,
        may_end,
    }
}

/// A prefetch that ended: its request and the pages it inserted into the tree.
#[derive(Debug)]
pub(crate) struct PrefetchEnd {
    /// The request that started it.
    pub req: RequestId,
    /// Pages it inserted (new host-only pages).
    pub storage_pages: usize,
    /// The page hashes its lookup computed (`None` if it ended before the lookup finished).
    pub looked_up: Option<LookedUp>,
}

/// The pages an L3 lookup hashed at a request's arrival, kept with the request so that
/// inserting the finished request does not hash them again ([`KnownHashes`]: the tree uses
/// them only where their prior and tokens match its own chain).
#[derive(Debug)]
pub(crate) struct LookedUp {
    first_page: usize,
    prior: Option<PageHash>,
    tokens: Arc<[u32]>,
    hashes: Vec<PageHash>,
}

impl LookedUp {
    /// The hashes as the tree takes them.
    pub fn known(&self) -> KnownHashes<'_> {
        KnownHashes {
            first_page: self.first_page,
            prior: self.prior,
            tokens: &self.tokens,
            hashes: &self.hashes,
        }
    }
}

/// Pages between the end of `anchor` and the end of `last` (its descendant on the match
/// path): the device-only nodes below the anchor.
fn pages_below(tree: &HiRadixTree, last: NodeId, anchor: NodeId) -> Result<usize> {
    let mut below = 0;
    let mut n = last;
    while n != anchor {
        let info = tree.node_info(n)?;
        below += info.pages;
        n = info
            .parent
            .ok_or_else(|| HiCacheError::BadArgument("match path broken".into()))?;
    }
    Ok(below)
}

impl L3 {
    /// Starts a prefetch for a request at arrival, if worthwhile (invariant 1). Returns the
    /// op's sequence number and the pages it looks up.
    pub fn start_prefetch(
        &mut self,
        req: RequestId,
        tenant: TenantId,
        key: &[u32],
        m: &MatchResult,
        tiers: &mut Tiers,
    ) -> Result<Option<(u64, usize)>> {
        let ps = tiers.page_size();
        let total = key.len() / ps;
        let matched_pages = m.device_pages() + m.host_hit_pages;
        if (total - matched_pages) * ps < self.threshold_tokens() {
            return Ok(None);
        }
        if self.prefetches.is_full() {
            // Every rank tracks the same prefetches, so every rank skips this one.
            tiers.metrics.prefetch(PrefetchOutcome::rate_limited);
            return Ok(None);
        }
        let anchor = m.last_host_node;
        let anchor_end = matched_pages - pages_below(&tiers.tree, m.last_node, anchor)?;
        let prior = match tiers.tree.last_page_hash(anchor)? {
            Some(h) => Some(h),
            None => tiers.tree.chain_start(tenant)?.and_then(|c| c.prior),
        };
        let Some(start) = tiers.tree.chain_start(tenant)? else {
            return Ok(None);
        };
        let hasher = tiers
            .tree
            .config()
            .hasher
            .clone()
            .expect("the controller always configures a hasher");
        // The request's pages before the first looked up: the path to the anchor.
        let prefix = if self.config.common.pass_prefix_keys {
            let hashes = tiers.tree.prefix_hashes(anchor)?;
            Some(
                hashes
                    .into_iter()
                    .map(|h| PageKey::new(start.namespace_id, h))
                    .collect(),
            )
        } else {
            None
        };
        tiers.tree.protect_host(anchor)?;
        let tokens: Arc<[u32]> = Arc::from(&key[anchor_end * ps..]);
        let pages = tokens.len() / ps;
        let shared = Arc::new(FetchShared::default());
        let job = QueryJob {
            storage: self.engine.storage.clone(),
            pool: tiers.host_pool.clone(),
            hasher,
            namespace: start.namespace_id,
            prior,
            prefix,
            tokens: Arc::clone(&tokens),
            hashes: Vec::with_capacity(pages),
            page_size: ps,
            batch: self.engine.batch,
            layout: self.layout,
            shared: shared.clone(),
        };
        // Handed to the runtime with the tick's flush, or at once outside the scheduling
        // part of a tick (the engine's submission rule).
        self.engine.lookup(job.run());
        let seq = self.prefetches.insert(PrefetchOp {
            req,
            tenant,
            anchor,
            tokens,
            first_page: anchor_end,
            prior,
            started: Instant::now(),
            shared,
            phase: Phase::Querying,
            room_waits: 0,
        });
        Ok(Some((seq, pages)))
    }

    /// This rank's view of every tracked prefetch for the per-tick exchange, in the agreed
    /// (creation) order, into `out` (its buffers reused).
    pub fn prefetch_counts(&self, page_size: usize, out: &mut Gathered<PrefetchCounts>) {
        self.prefetches
            .gather_into(out, |op| self.op_counts(op, page_size));
    }

    /// This rank's view of one prefetch ([`prefetch_counts`]).
    fn op_counts(&self, op: &PrefetchOp, page_size: usize) -> PrefetchCounts {
        let fetching = matches!(op.phase, Phase::Fetching { .. });
        prefetch_counts(&op.shared, fetching, &self.prefetch, op.started, page_size)
    }

    /// Applies the agreed view of one prefetch: allocates its host pages once the lookup is
    /// done, or ends it when the policy allows. Returns the end, if it ended.
    pub fn apply_prefetch(
        &mut self,
        seq: u64,
        agreed: PrefetchCounts,
        tiers: &mut Tiers,
    ) -> Result<Option<PrefetchEnd>> {
        if !agreed.query_done && !agreed.may_end {
            // Nothing to do in either phase (the lookup still runs somewhere and the policy
            // does not end the prefetch yet): the common case of a prefetch waiting for its
            // lookup, decided without finding the op (every tracked prefetch is applied at
            // every poll, and they pile up while the L3 threads lag).
            return Ok(None);
        }
        let op = self.prefetches.get(seq);
        let querying = matches!(op.phase, Phase::Querying);
        if querying {
            if agreed.query_done && agreed.may_end && op.room_waits > 0 {
                // Waited for host room until the policy's deadline.
                self.end_prefetch(seq, 0, PrefetchOutcome::no_host_memory, tiers)
                    .map(Some)
            } else if agreed.query_done {
                self.allocate(seq, agreed.hit_pages as usize, tiers)
            } else if agreed.may_end {
                self.end_prefetch(seq, 0, PrefetchOutcome::partial, tiers)
                    .map(Some)
            } else {
                Ok(None)
            }
        } else if agreed.may_end {
            let done = agreed.completed_pages as usize;
            self.end_prefetch(seq, done, PrefetchOutcome::completed, tiers)
                .map(Some)
        } else {
            Ok(None)
        }
    }

    fn threshold_tokens(&self) -> usize {
        self.prefetch.threshold_tokens(self.page_size as u32) as usize
    }

    /// Allocates host pages for the agreed hit (invariants 2 and 3) and hands them to the
    /// task, or ends the prefetch when that is not worth it.
    fn allocate(&mut self, seq: u64, hit: usize, tiers: &mut Tiers) -> Result<Option<PrefetchEnd>> {
        let ps = self.page_size;
        let threshold = self.threshold_tokens();
        let room = self.capacity_pages.saturating_sub(self.occupied_pages);
        let end = |l3: &mut Self, outcome, tiers: &mut Tiers| {
            l3.end_prefetch(seq, 0, outcome, tiers).map(Some)
        };
        if hit * ps < threshold {
            return end(self, PrefetchOutcome::below_threshold, tiers);
        }
        let want = hit.min(room);
        if want * ps < threshold {
            return end(self, PrefetchOutcome::rate_limited, tiers);
        }
        let host = match tiers.alloc_host(want)? {
            Some(h) => h,
            None => {
                // Shrink to what every rank has, if still worth it.
                let can = tiers.budget.min(want);
                match (can * ps >= threshold).then(|| tiers.alloc_host(can)) {
                    Some(Ok(Some(h))) => h,
                    Some(Err(e)) => return Err(e),
                    _ => return self.wait_for_room(seq, want, tiers),
                }
            }
        };
        self.occupied_pages += host.len();
        let op = self.prefetches.get_mut(seq);
        op.shared.give(host.clone());
        op.phase = Phase::Fetching { host };
        Ok(None)
    }

    /// A prefetch without host room: under exclusive tiering it waits (bounded) while cold
    /// pages go to L3 to make room for it (the tiers' shortfall); otherwise, or when it
    /// waited long enough, it ends as `no_host_memory`.
    fn wait_for_room(
        &mut self,
        seq: u64,
        want: usize,
        tiers: &mut Tiers,
    ) -> Result<Option<PrefetchEnd>> {
        let op = self.prefetches.get_mut(seq);
        if tiers.tiering.exclusive && op.room_waits < ROOM_WAIT_POLLS {
            op.room_waits += 1;
            tiers.tiering.shortfall += want;
            return Ok(None);
        }
        self.end_prefetch(seq, 0, PrefetchOutcome::no_host_memory, tiers)
            .map(Some)
    }

    /// Ends a prefetch: terminates its task, inserts the first `agreed` pages (the count every
    /// rank has) as host-only nodes under the anchor, frees what is not needed, releases the
    /// anchor. `outcome` is refined from the numbers.
    pub fn end_prefetch(
        &mut self,
        seq: u64,
        agreed: usize,
        outcome: PrefetchOutcome,
        tiers: &mut Tiers,
    ) -> Result<PrefetchEnd> {
        let op = self.prefetches.remove(seq);
        let (snap, failed, failed_pages, error) = {
            let mut st = op.shared.state.lock();
            st.terminated = true;
            (st.completed, st.failed, st.failed_pages, st.error.take())
        };
        if failed_pages > 0 {
            // Invariant 6: pages lost to storage errors are counted and logged.
            let lost = failed_pages as u64;
            tiers.metrics.l3_failed(L3Op::read, lost);
            self.read_warn
                .warn_loss("prefetches", lost, error.as_deref());
        }
        op.shared.notify.notify_one();
        self.draining.push(op.shared.clone());
        let mut new_pages = 0;
        let mut outcome = outcome;
        if let Phase::Fetching { host } = &op.phase {
            self.occupied_pages -= host.len();
            let agreed = agreed.min(snap);
            if agreed > 0 {
                new_pages = self.insert_fetched(&op, &host[..agreed], tiers)?;
            }
            // Pages fetched by this rank beyond the agreed count: free now (not counted in the
            // budget: other ranks may not have them). The task hands back the rest.
            tiers.host_pool.free(&host[agreed..snap])?;
            if outcome == PrefetchOutcome::completed && agreed < host.len() {
                outcome = PrefetchOutcome::partial;
            }
        }
        if failed && new_pages == 0 && outcome == PrefetchOutcome::partial {
            outcome = PrefetchOutcome::failed;
        }
        tiers.tree.release_host(op.anchor)?;
        tiers.metrics.prefetch(outcome);
        // The task no longer reads the lookup's result (it was published before the hit).
        let looked_up = op.shared.query.lock().take().map(|q| LookedUp {
            first_page: op.first_page,
            prior: op.prior,
            tokens: op.tokens,
            hashes: q.hashes,
        });
        Ok(PrefetchEnd {
            req: op.req,
            storage_pages: new_pages,
            looked_up,
        })
    }

    /// Inserts the agreed fetched pages as host-only nodes under the anchor; frees the
    /// duplicates. Returns the new pages.
    fn insert_fetched(
        &self,
        op: &PrefetchOp,
        host: &[HostSlot],
        tiers: &mut Tiers,
    ) -> Result<usize> {
        let agreed = host.len();
        let hashes = op
            .shared
            .query
            .lock()
            .as_ref()
            .map(|q| q.hashes[..agreed].to_vec())
            .unwrap_or_default();
        let res = tiers.tree.insert_host_only(
            op.tenant,
            op.anchor,
            &op.tokens[..agreed * self.page_size],
            host,
            Some(&hashes),
        )?;
        tiers.free_host(&res.duplicate_slots)?;
        // Agreed pages read from L3: known to be there (crate::l2_l3_sharing invariant 1; kept
        // only by the modes that read the record, invariant 3).
        tiers.tiering.known.insert_all(&hashes);
        tiers.metrics.transfer(
            Direction::l3_to_l2,
            agreed as u64,
            (agreed * self.page_bytes) as u64,
            op.started.elapsed().as_secs_f64(),
        );
        Ok(res.new_pages)
    }

    /// Frees pages that finished prefetch tasks handed back. With `wait`, waits (up to
    /// [`LEFTOVER_WAIT`] in all) for every draining task to exit first; pages of a task still
    /// stuck in a backend call after that are left allocated (never reused while it may
    /// write them) and reported.
    pub fn collect_leftovers(&mut self, wait: bool, tiers: &Tiers) -> Result<()> {
        if wait {
            // A queued task never exits by itself.
            self.engine.flush();
        }
        // Read the clock only when waiting: a poll (`!wait`) never needs the deadline.
        let deadline = wait.then(|| Instant::now() + LEFTOVER_WAIT);
        let mut back = Vec::new();
        self.draining.retain(|s| {
            if !wait && !s.progress.exited() {
                // Still running (the lock-free copy of `exited`; no lock per poll and task).
                return true;
            }
            let mut st = s.state.lock();
            loop {
                if st.exited {
                    if let Some(l) = st.leftover.take() {
                        back.extend(l);
                    }
                    return false;
                }
                let Some(deadline) = deadline else {
                    return true;
                };
                // Woken when the task sets `exited` (under this lock, so no wake-up is lost).
                if s.exited.wait_until(&mut st, deadline).timed_out() && !st.exited {
                    tracing::warn!(
                        pages = st.slots.as_ref().map_or(0, |v| v.len() - st.completed),
                        "a prefetch task is stuck in its backend; its host pages stay allocated"
                    );
                    return false;
                }
            }
        });
        if !back.is_empty() {
            tiers.host_pool.free(&back)?;
        }
        Ok(())
    }

    /// Prefetches tracked, in the agreed (creation) order.
    pub fn prefetch_seqs(&self) -> Vec<u64> {
        self.prefetches.seqs()
    }

    /// Number of prefetches tracked.
    pub fn prefetches_tracked(&self) -> usize {
        self.prefetches.len()
    }

    /// Prefetches whose L3 lookup is still running.
    pub fn lookups_running(&self) -> usize {
        self.prefetches
            .values()
            .filter(|op| op.shared.progress.query().is_none())
            .count()
    }

    /// Whether any prefetch is tracked.
    pub fn has_prefetches(&self) -> bool {
        !self.prefetches.is_empty()
    }
}
