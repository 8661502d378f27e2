//! `hicache-bench tree --components ...`: replays a trace through the [`UnifiedTree`] under
//! SGLang 0.5.23's scheduler protocol and writes the issue-26 per-request log.
//!
//! Protocol (normative; it reproduces `scripts/sglang-side-by-side/unified_replay.py`, which
//! drives SGLang's own `UnifiedRadixCache`). Page size P; Full capacity C pages, SWA capacity
//! S pages, M Mamba slots. Each trace line is one request of L tokens with
//! `max_new_tokens = 1`, run alone:
//!
//! 1. **Match** the first L − 1 tokens (page-aligned). With Mamba, a hit on a node with a
//!    state takes one slot for the copy-on-write (evicting one state, node locked, if none is
//!    free). `matched` = the valid prefix, `full_hit` = Full tokens walked, `branch` = the
//!    branching length of SWA or Mamba.
//! 2. **Admission** (SGLang's `PrefillAdder.add_one_req`): the scheduler's token budget
//!    ([`UnifiedTree::admission_fits`], the matched node locked, the host hit counted, with
//!    a host tier the load-back and the recompute fallback's second check: `hybrid_host`);
//!    a request it refuses is dropped (`refused`: it gives back its copy-on-write slot,
//!    nothing else happens). Then **lock** the matched node.
//! 3. **Mamba slots** (`alloc_req_slots`): the request needs 1 (unless it took the COW slot)
//!    + 2 ping-pong slots; if fewer are free, evict the difference in states.
//! 4. **KV** (`alloc_paged_token_slots_extend`): demand = (L − matched) + P tokens; evict
//!    each pool's shortfall (Full, and SWA); then the extend needs ⌈(L − matched)/P⌉ free
//!    pages in each pool, else the request is `skipped` (released without insert).
//! 5. **Insert** on release: SWA inserts up to its branching length when it goes past the
//!    match, else L; Mamba inserts up to the tracked checkpoint (`matched + k·grid` for the
//!    largest k, or the branching length when it lies on the chunk grid inside the extend;
//!    nothing when the extend is shorter than one grid), with a ping-pong slot as the state.
//!    The key is page-aligned; `inserted` is its length. Then unlock; every slot the request
//!    still holds is freed.
//!
//! Columns: `ev_full` / `ev_aux` sum every eviction of the request (Full tokens; SWA tokens
//! or Mamba states, cascades included); `tree_full` / `tree_aux` are the tree's sizes after it.
//! With `full,swa,mamba` the aux columns are SWA's and Mamba's follow (`MAMBA_COLUMNS`:
//! `branch_mamba`, `ev_mamba`, `tree_mamba`); SGLang's insert length is then Mamba's. The
//! last column, `refused`, is 1 when the admission budget refused the request.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use hicache_core::{
    Component, EvictRequest, Evicted, InsertParams, UnifiedConfig, UnifiedMatch, UnifiedTree,
};
use hicache_sim::trace::Request;

use crate::error::{BenchError, Result};

/// The issue-26 log header.
pub const HEADER: &str = "idx\tid\tprompt\tmatched\tfull_hit\tbranch\tinserted\tev_full\tev_aux\ttree_full\ttree_aux\tskipped";

/// The columns a replay with a host tier adds (see `hybrid_host`).
pub const HOST_COLUMNS: &str = "\thost_hit\tev_host_full\tev_host_aux";

/// The column a replay with a host tier adds after its others: the match's Full host hit,
/// which the admission budget counted (see `hybrid_host`).
pub const HOST_MATCH_COLUMN: &str = "\thost_match";

/// The column every log ends with: whether the admission budget refused the request.
pub const REFUSED_COLUMN: &str = "\trefused";

/// Ping-pong tracking slots of SGLang's `extra_buffer` strategy (overlap schedule on).
const TRACKING_SLOTS: usize = 2;

/// Capacities and component settings of one hybrid replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HybridSetup {
    /// The tree's configuration.
    pub tree: UnifiedConfig,
    /// Full pool, pages.
    pub full_pages: u64,
    /// SWA pool, pages.
    pub swa_pages: u64,
    /// Mamba state slots.
    pub mamba_slots: u32,
    /// The host tier (`None`: device only, the protocol above).
    pub host: Option<super::hybrid_host::HostSetup>,
}

/// A pool "as large as needed" (`--capacity-pages unlimited`): pages whose token count
/// cannot overflow at any page size.
pub const UNLIMITED_PAGES: u64 = u64::MAX >> 20;

/// Free Mamba state slots: ids never handed out (only counted, so an unlimited pool costs
/// nothing) and ids handed back.
#[derive(Debug)]
pub(super) struct StatePool {
    fresh: u32,
    next: u32,
    back: Vec<u32>,
}

impl StatePool {
    fn new(slots: u32) -> Self {
        Self {
            fresh: slots,
            next: 0,
            back: Vec::new(),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.fresh as usize + self.back.len()
    }

    pub(super) fn pop(&mut self) -> Option<u32> {
        if let Some(x) = self.back.pop() {
            return Some(x);
        }
        (self.fresh > 0).then(|| {
            self.fresh -= 1;
            self.next += 1;
            self.next - 1
        })
    }

    pub(super) fn give(&mut self, ids: &[u32]) {
        self.back.extend_from_slice(ids);
    }
}

/// One log line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HybridOutcome {
    /// Prompt tokens.
    pub prompt: usize,
    /// Reused prefix.
    pub matched: usize,
    /// Full tokens walked.
    pub full_hit: usize,
    /// Branching length.
    pub branch: Option<usize>,
    /// Inserted key length.
    pub inserted: usize,
    /// Full tokens evicted.
    pub ev_full: u64,
    /// SWA tokens or Mamba states evicted.
    pub ev_aux: u64,
    /// Full tokens in the tree after.
    pub tree_full: u64,
    /// SWA tokens or Mamba states in the tree after.
    pub tree_aux: u64,
    /// Whether the KV allocation failed.
    pub skipped: bool,
    /// Tokens loaded back from host before the match was reused (host tier only).
    pub host_hit: usize,
    /// Host Full tokens, host SWA tokens or Mamba states (SWA's with both), and host Mamba
    /// states with both auxiliary components, evicted (host tier only).
    pub ev_host: [u64; 3],
    /// With both SWA and Mamba: Mamba's branching length.
    pub branch_mamba: Option<usize>,
    /// With both SWA and Mamba: Mamba states evicted.
    pub ev_mamba: u64,
    /// With both SWA and Mamba: Mamba states in the tree after.
    pub tree_mamba: u64,
    /// The match's Full host hit, before any load-back (host tier only).
    pub host_match: usize,
    /// Whether the scheduler's admission budget refused the request.
    pub refused: bool,
}

/// A replay in progress: the tree and the free Mamba slots.
pub struct HybridReplay {
    pub(super) setup: HybridSetup,
    pub(super) tree: UnifiedTree,
    pub(super) free_mamba: StatePool,
    pub(super) aux: Option<Component>,
    /// The host tier's state (with `setup.host`).
    pub(super) host: Option<super::hybrid_host::HostTier>,
}

impl HybridReplay {
    /// A replay over an empty tree.
    pub fn new(setup: HybridSetup) -> Result<Self> {
        let tree = match setup.host {
            Some(_) => UnifiedTree::with_device_slots(setup.tree.clone())?,
            None => UnifiedTree::new(setup.tree.clone())?,
        };
        let aux = if tree.has(Component::Swa) {
            Some(Component::Swa)
        } else if tree.has(Component::Mamba) {
            Some(Component::Mamba)
        } else {
            None
        };
        let free_mamba = StatePool::new(setup.mamba_slots);
        let host = setup.host.map(super::hybrid_host::HostTier::new);
        Ok(Self {
            setup,
            tree,
            free_mamba,
            aux,
            host,
        })
    }

    /// The tree (for checks).
    pub fn tree(&self) -> &UnifiedTree {
        &self.tree
    }

    pub(super) fn ps(&self) -> usize {
        self.setup.tree.page_size as usize
    }

    /// Evicts for `req`; adds Full tokens, SWA tokens and Mamba states evicted to `ev`.
    pub(super) fn evict(&mut self, req: EvictRequest, ev: &mut [u64; 3]) {
        let e: Evicted = self.tree.evict(req);
        ev[0] += e.full;
        ev[1] += e.swa;
        ev[2] += e.mamba;
        self.free_mamba.give(&e.mamba_slots);
    }

    pub(super) fn available(&self, c: Component) -> u64 {
        let cap = match c {
            Component::Swa => self.setup.swa_pages,
            _ => self.setup.full_pages,
        } * self.ps() as u64;
        cap.saturating_sub(self.tree.size(c))
    }

    /// Takes `n` Mamba slots, evicting states first when fewer are free; `None` when the
    /// tree cannot free enough.
    pub(super) fn take_mamba(&mut self, n: usize, ev: &mut [u64; 3]) -> Option<Vec<u32>> {
        if self.free_mamba.len() < n {
            let short = (n - self.free_mamba.len()) as u64;
            self.evict(
                EvictRequest {
                    mamba: short,
                    ..Default::default()
                },
                ev,
            );
        }
        (self.free_mamba.len() >= n).then(|| (0..n).filter_map(|_| self.free_mamba.pop()).collect())
    }

    /// The Mamba slot of a match's copy-on-write (step 1): one slot when the match has a
    /// state, evicting one state (the matched node locked) when none is free.
    fn copy_on_write(&mut self, m: &UnifiedMatch, ev: &mut [u64; 3]) -> Result<Vec<u32>> {
        let mut held = Vec::new();
        if self.tree.has(Component::Mamba) && m.mamba_slot.is_some() {
            if self.free_mamba.len() == 0 {
                let r = self.tree.lock(m.node, false)?;
                self.evict(
                    EvictRequest {
                        mamba: 1,
                        ..Default::default()
                    },
                    ev,
                );
                self.tree.unlock(&r)?;
            }
            held.extend(self.free_mamba.pop());
        }
        Ok(held)
    }

    /// Runs one request (see the module documentation).
    pub fn run_one(&mut self, tokens: &[u32]) -> Result<HybridOutcome> {
        let ps = self.ps();
        let l = tokens.len();
        let mamba = self.tree.has(Component::Mamba);
        let (mut ev, mut ev_host) = ([0u64; 3], [0u64; 3]);
        let m = self.tree.match_prefix(&tokens[..l.saturating_sub(1)])?;
        let host_match = m.host_hit_len;
        let (m, host_hit, refused) = self.admit(&tokens[..l.saturating_sub(1)], m, l, &mut ev)?;
        let mut held = self.copy_on_write(&m, &mut ev)?;
        let matched = m.device_prefix_len;
        let mut out = HybridOutcome {
            prompt: l,
            matched,
            full_hit: m.full_hit_len,
            branch: if mamba && !self.tree.has(Component::Swa) {
                m.mamba_branching
            } else {
                m.swa_branching
            },
            ..Default::default()
        };
        let receipt = self.tree.lock(m.node, false)?;
        let mut ok = !refused;
        if ok && mamba {
            let need = usize::from(held.is_empty()) + TRACKING_SLOTS;
            match self.take_mamba(need, &mut ev) {
                Some(s) => held.extend(s),
                None => ok = false,
            }
        }
        let extend = l - matched;
        if ok {
            ok = self.alloc_kv(extend, &mut ev);
        }
        if ok {
            let len = self
                .setup
                .tree
                .insert_len(l, matched, m.swa_branching, m.mamba_branching);
            let key = &tokens[..len / ps * ps];
            if !key.is_empty() {
                // The tracked state sits in the ping-pong slot last written (index 1 of the
                // two when the request allocated three, the last one held).
                let state = held.last().copied();
                let p = InsertParams {
                    prev_prefix_len: matched,
                    swa_evicted_len: 0,
                    mamba_slot: state.filter(|_| mamba),
                };
                let r = self.insert(key, &p, &m)?;
                out.inserted = key.len();
                if mamba && !r.mamba_exist {
                    held.pop();
                }
                self.backup(r.node, &mut ev_host)?;
            }
        }
        out.skipped = !ok && !refused;
        out.refused = refused;
        out.host_match = host_match;
        self.tree.unlock(&receipt)?;
        self.free_mamba.give(&held);
        // Per component ([Full, SWA, Mamba]) to the log's columns: aux is SWA's when the
        // tree has SWA, else Mamba's; the Mamba columns are filled with both.
        let both = self.tree.has(Component::Swa) && mamba;
        let aux = |v: [u64; 3]| {
            if self.tree.has(Component::Swa) {
                v[1]
            } else {
                v[2]
            }
        };
        out.ev_full = ev[0];
        out.ev_aux = aux(ev);
        if both {
            out.branch_mamba = m.mamba_branching;
            out.ev_mamba = ev[2];
            out.tree_mamba = self.tree.size(Component::Mamba);
        }
        let ev_host = [ev_host[0], aux(ev_host), if both { ev_host[2] } else { 0 }];
        out.host_hit = host_hit;
        out.ev_host = ev_host;
        out.tree_full = self.tree.size(Component::Full);
        out.tree_aux = self.aux.map_or(0, |c| self.tree.size(c));
        Ok(out)
    }

    /// Evicts for the extend plus one spare page in each pool; whether the extend's pages
    /// are then free.
    fn alloc_kv(&mut self, extend: usize, ev: &mut [u64; 3]) -> bool {
        let ps = self.ps() as u64;
        let demand = extend as u64 + ps;
        let full_short = demand.saturating_sub(self.available(Component::Full));
        let swa = self.tree.has(Component::Swa);
        let swa_short = if swa {
            demand.saturating_sub(self.available(Component::Swa))
        } else {
            0
        };
        if full_short > 0 || swa_short > 0 {
            self.evict(
                EvictRequest {
                    full: full_short,
                    swa: swa_short,
                    mamba: 0,
                },
                ev,
            );
        }
        let pages = (extend as u64).div_ceil(ps);
        self.available(Component::Full) / ps >= pages
            && (!swa || self.available(Component::Swa) / ps >= pages)
    }
}

/// Replays the whole trace; the outcomes and the final tree sizes.
pub fn replay(setup: &HybridSetup, trace: &[Request]) -> Result<(Vec<HybridOutcome>, [u64; 3])> {
    let mut r = HybridReplay::new(setup.clone())?;
    let mut out = Vec::with_capacity(trace.len());
    for req in trace {
        out.push(r.run_one(&req.tokens)?);
    }
    let fin = [
        r.tree.size(Component::Full),
        r.aux.map_or(0, |c| r.tree.size(c)),
        r.tree.size(Component::Mamba),
    ];
    Ok((out, fin))
}

/// Requests per second: the median over replays repeated for at least `min_time`.
pub fn rate(setup: &HybridSetup, trace: &[Request], min_time: Duration) -> Result<(f64, f64)> {
    let mut rates = Vec::new();
    let start = Instant::now();
    while rates.is_empty() || start.elapsed() < min_time {
        let mut r = HybridReplay::new(setup.clone())?;
        let t0 = Instant::now();
        for req in trace {
            std::hint::black_box(r.run_one(&req.tokens)?);
        }
        rates.push(trace.len() as f64 / t0.elapsed().as_secs_f64().max(1e-12));
    }
    rates.sort_by(f64::total_cmp);
    Ok((rates[rates.len() / 2], rates[rates.len() - 1]))
}

/// Which columns a log has beyond the issue-26 ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogColumns {
    /// The host tier's (`HOST_COLUMNS`, and `ev_host_mamba` with `mamba`).
    pub host: bool,
    /// Mamba's beside SWA's, for `[Full, SWA, Mamba]` (`MAMBA_COLUMNS`).
    pub mamba: bool,
}

/// The columns `[Full, SWA, Mamba]` adds after `skipped` (the aux columns are SWA's).
pub const MAMBA_COLUMNS: &str = "\tbranch_mamba\tev_mamba\ttree_mamba";

/// The host column `[Full, SWA, Mamba]` adds after the host tier's.
pub const HOST_MAMBA_COLUMN: &str = "\tev_host_mamba";

/// The header line of a log with `cols`.
fn header(cols: LogColumns) -> String {
    let mut s = String::from(HEADER);
    if cols.mamba {
        s.push_str(MAMBA_COLUMNS);
    }
    if cols.host {
        s.push_str(HOST_COLUMNS);
        if cols.mamba {
            s.push_str(HOST_MAMBA_COLUMN);
        }
        s.push_str(HOST_MATCH_COLUMN);
    }
    s.push_str(REFUSED_COLUMN);
    s.push('\n');
    s
}

/// The log text: header, one line per request, the totals line; `cols` adds the Mamba
/// columns of `[Full, SWA, Mamba]` and the host tier's, with their totals, after the others.
/// `fin`: the final tree's Full tokens, aux size and Mamba states.
pub fn log_text(
    trace: &[Request],
    rows: &[HybridOutcome],
    fin: [u64; 3],
    cols: LogColumns,
) -> String {
    let mut s = header(cols);
    let mut tot = [0u64; 14];
    for (i, (req, o)) in trace.iter().zip(rows).enumerate() {
        let dash = |b: Option<usize>| b.map_or_else(|| "-".to_string(), |b| b.to_string());
        let branch = dash(o.branch);
        let _ = write!(
            s,
            "{i}\t{}\t{}\t{}\t{}\t{branch}\t{}\t{}\t{}\t{}\t{}\t{}",
            req.id,
            o.prompt,
            o.matched,
            o.full_hit,
            o.inserted,
            o.ev_full,
            o.ev_aux,
            o.tree_full,
            o.tree_aux,
            u8::from(o.skipped)
        );
        if cols.mamba {
            let b = dash(o.branch_mamba);
            let _ = write!(s, "\t{b}\t{}\t{}", o.ev_mamba, o.tree_mamba);
        }
        if cols.host {
            let _ = write!(s, "\t{}\t{}\t{}", o.host_hit, o.ev_host[0], o.ev_host[1]);
            if cols.mamba {
                let _ = write!(s, "\t{}", o.ev_host[2]);
            }
            let _ = write!(s, "\t{}", o.host_match);
        }
        let _ = write!(s, "\t{}", u8::from(o.refused));
        s.push('\n');
        let row = [
            o.prompt as u64,
            o.matched as u64,
            o.full_hit as u64,
            o.inserted as u64,
            o.ev_full,
            o.ev_aux,
            u64::from(o.skipped),
            o.host_hit as u64,
            o.ev_host[0],
            o.ev_host[1],
            o.ev_host[2],
            o.ev_mamba,
            u64::from(o.refused),
            o.host_match as u64,
        ];
        for (t, v) in tot.iter_mut().zip(row) {
            *t += v;
        }
    }
    let _ = write!(
        s,
        "# totals requests={} prompt={} matched={} full_hit={} inserted={} ev_full={} ev_aux={} skipped={} final_tree_full={} final_tree_aux={}",
        rows.len(),
        tot[0],
        tot[1],
        tot[2],
        tot[3],
        tot[4],
        tot[5],
        tot[6],
        fin[0],
        fin[1]
    );
    if cols.mamba {
        let _ = write!(s, " ev_mamba={} final_tree_mamba={}", tot[11], fin[2]);
    }
    if cols.host {
        let _ = write!(
            s,
            " host_hit={} ev_host_full={} ev_host_aux={}",
            tot[7], tot[8], tot[9]
        );
        if cols.mamba {
            let _ = write!(s, " ev_host_mamba={}", tot[10]);
        }
        let _ = write!(s, " host_match={}", tot[13]);
    }
    let _ = write!(s, " refused={}", tot[12]);
    s.push('\n');
    s
}

/// Writes [`log_text`] to `path`.
pub fn write_log(
    path: &Path,
    trace: &[Request],
    rows: &[HybridOutcome],
    fin: [u64; 3],
    cols: LogColumns,
) -> Result<()> {
    std::fs::write(path, log_text(trace, rows, fin, cols)).map_err(BenchError::io(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: &str, tokens: Vec<u32>) -> Request {
        Request {
            id: id.into(),
            tokens,
        }
    }

    /// Two turns of one conversation and an unrelated request, 16-token pages.
    fn trace() -> Vec<Request> {
        let turn1: Vec<u32> = (0..100).collect();
        let turn2: Vec<u32> = (0..200).collect();
        let other: Vec<u32> = (1000..1130).collect();
        vec![req("a", turn1), req("b", turn2), req("c", other)]
    }

    fn setup(swa: Option<u32>, mamba: Option<u32>, pages: u64, aux: u64) -> HybridSetup {
        HybridSetup {
            tree: UnifiedConfig {
                page_size: 16,
                swa_window: swa,
                mamba_chunk: mamba,
            },
            full_pages: pages,
            swa_pages: aux,
            mamba_slots: aux as u32,
            host: None,
        }
    }

    #[test]
    fn swa_replay_reuses_the_prefix_and_logs_totals() {
        let t = trace();
        let (rows, fin) = replay(&setup(Some(32), None, 1000, 1000), &t).unwrap();
        assert_eq!((rows[0].matched, rows[0].inserted), (0, 96));
        assert_eq!(
            (rows[1].matched, rows[1].full_hit, rows[1].inserted),
            (96, 96, 192)
        );
        assert_eq!(rows[2].matched, 0);
        assert_eq!(fin, [192 + 128, 192 + 128, 0]);
        let log = log_text(&t, &rows, fin, LogColumns::default());
        assert!(log.starts_with(HEADER));
        assert!(log.ends_with(
            "# totals requests=3 prompt=430 matched=96 full_hit=96 inserted=416 ev_full=0 ev_aux=0 skipped=0 final_tree_full=320 final_tree_aux=320 refused=0\n"
        ));
    }

    #[test]
    fn a_small_swa_pool_tombstones_the_older_window() {
        // SWA pool of 11 pages: the second turn's extend needs 7 + 1 pages while the first
        // turn holds 6 (a 64-token node and its 32-token window leaf, locked by the match):
        // the older node becomes a tombstone, Full stays.
        let (rows, _) = replay(&setup(Some(32), None, 1000, 11), &trace()).unwrap();
        assert_eq!((rows[1].ev_full, rows[1].ev_aux), (0, 64), "{:?}", rows[1]);
        assert!(!rows[1].skipped && !rows[1].refused);
        // With 10 pages SGLang's budget refuses it before any eviction: its SWA estimate
        // (80 past the window + 32 + a spare page = 128 tokens) is not below the 128 free
        // or evictable (the match's window locked).
        let (rows, _) = replay(&setup(Some(32), None, 1000, 10), &trace()).unwrap();
        assert!(rows[1].refused && !rows[1].skipped, "{:?}", rows[1]);
        assert_eq!(
            (rows[1].ev_full, rows[1].ev_aux, rows[1].inserted),
            (0, 0, 0)
        );
    }

    #[test]
    fn mamba_replay_tracks_chunk_checkpoints_and_refuses_without_room() {
        let t = trace();
        let (rows, fin) = replay(&setup(None, Some(64), 1000, 16), &t).unwrap();
        assert_eq!(rows[0].inserted, 64, "the checkpoint at 64 of 100 tokens");
        assert_eq!(rows[1].matched, 64);
        assert_eq!(rows[1].inserted, 192);
        assert_eq!(fin[1], 3, "one state per inserted checkpoint");
        // 4 pages cannot hold a 100-token extend, a decoded token and a spare page: SGLang's
        // budget refuses every request, nothing held.
        let (rows, fin) = replay(&setup(None, Some(64), 4, 16), &t).unwrap();
        assert!(rows.iter().all(|r| r.refused && !r.skipped));
        assert_eq!(fin, [0, 0, 0]);
    }

    #[test]
    fn swa_and_mamba_together_log_both_components() {
        let t = trace();
        let (rows, fin) = replay(&setup(Some(32), Some(64), 1000, 16), &t).unwrap();
        // Mamba decides the insert (a checkpoint at 64 of 100), SWA fills the aux columns.
        assert_eq!(rows[0].inserted, 64);
        assert_eq!(rows[0].tree_aux, 64);
        assert_eq!(rows[0].tree_mamba, 1);
        assert_eq!(fin[2], rows[2].tree_mamba);
        let cols = LogColumns {
            host: false,
            mamba: true,
        };
        let log = log_text(&t, &rows, fin, cols);
        assert!(
            log.starts_with(&format!("{HEADER}{MAMBA_COLUMNS}{REFUSED_COLUMN}\n")),
            "{log}"
        );
        let last = log.lines().last().unwrap();
        assert!(
            last.contains(&format!(" final_tree_mamba={}", fin[2])),
            "{last}"
        );
        let first = log.lines().nth(1).unwrap();
        assert_eq!(first.split('\t').count(), 16, "{first}");
    }

    fn host(setup: HybridSetup, full: u64, swa: u64, mamba: u64) -> HybridSetup {
        HybridSetup {
            host: Some(super::super::hybrid_host::HostSetup {
                full_pages: full,
                swa_pages: swa,
                mamba_slots: mamba,
            }),
            ..setup
        }
    }

    /// Turn one, an unrelated request that pushes it out of a small device pool, turn two.
    fn pushed_out() -> Vec<Request> {
        vec![
            req("a", (0..100).collect()),
            req("x", (1000..1200).collect()),
            req("b", (0..200).collect()),
        ]
    }

    #[test]
    fn a_host_tier_turns_device_evictions_into_host_hits() {
        for (swa, mamba) in [(Some(32), None), (None, Some(64))] {
            let t = pushed_out();
            let small = setup(swa, mamba, 16, 16);
            let (rows, _) = replay(&small, &t).unwrap();
            assert_eq!(
                rows[2].matched, 0,
                "without host, turn one is gone: {rows:?}"
            );
            let (rows, _) = replay(&host(small, 100, 100, 100), &t).unwrap();
            assert!(rows[2].host_hit > 0, "{rows:?}");
            assert_eq!(rows[2].matched, rows[2].host_hit, "{rows:?}");
            assert_eq!(
                rows.iter()
                    .map(|r| r.ev_host[0] + r.ev_host[1])
                    .sum::<u64>(),
                0
            );
            let cols = LogColumns {
                host: true,
                mamba: false,
            };
            let log = log_text(&t, &rows, [0, 0, 0], cols);
            assert!(log.starts_with(&format!(
                "{HEADER}{HOST_COLUMNS}{HOST_MATCH_COLUMN}{REFUSED_COLUMN}\n"
            )));
            assert!(log.contains(" host_hit="), "{log}");
        }
    }

    #[test]
    fn small_host_pools_evict_per_component() {
        let t = pushed_out();
        // Full host pool of 8 pages: turn one's backup makes room for the next one's.
        let (rows, _) = replay(&host(setup(Some(32), None, 16, 16), 8, 100, 100), &t).unwrap();
        assert!(rows.iter().any(|r| r.ev_host[0] > 0), "{rows:?}");
        // SWA host pool of 4 pages: SWA host copies go, from the SWA host LRU or whole.
        let (rows, _) = replay(&host(setup(Some(32), None, 16, 16), 100, 4, 100), &t).unwrap();
        assert!(rows.iter().any(|r| r.ev_host[1] > 0), "{rows:?}");
        // One host state: Mamba host copies go.
        let (rows, _) = replay(&host(setup(None, Some(64), 16, 16), 100, 100, 1), &t).unwrap();
        assert!(rows.iter().any(|r| r.ev_host[1] > 0), "{rows:?}");
    }

    #[test]
    fn host_replays_keep_the_tree_consistent_under_pressure() {
        // 8 conversations of 6 turns, interleaved: every pool small enough to evict.
        let trace: Vec<Request> = (0..48u32)
            .map(|i| {
                let (conv, turn) = (i % 8, i / 8);
                let len = 40 + 37 * turn as usize;
                req(
                    &format!("{i}"),
                    (0..len as u32).map(|t| conv * 10_000 + t).collect(),
                )
            })
            .collect();
        let configs = [
            setup(Some(24), None, 40, 20),
            setup(None, Some(32), 40, 6),
            setup(Some(24), Some(32), 40, 20),
        ];
        for base in configs {
            for (f, a, m) in [(12, 12, 2), (30, 6, 8), (64, 64, 64)] {
                let mut r = HybridReplay::new(host(base.clone(), f, a, m)).unwrap();
                let (mut hits, mut ev_host) = (0, [0; 2]);
                for q in &trace {
                    let o = r.run_one(&q.tokens).unwrap();
                    hits += o.host_hit;
                    ev_host = [ev_host[0] + o.ev_host[0], ev_host[1] + o.ev_host[1]];
                    r.tree().check_invariants().unwrap();
                }
                let case = format!("{base:?} {f} {a} {m}: {hits} {ev_host:?}");
                if f == 64 {
                    assert!(hits > 0, "{case}");
                } else {
                    assert!(ev_host[0] + ev_host[1] > 0, "{case}");
                }
            }
        }
    }
}
