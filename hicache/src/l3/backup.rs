//! Backups (L2 → L3): started after a D2H ack, finished in launch order at the count every
//! rank agreed on.
//!
//! Invariants:
//! 1. The host pages of a node being copied to L3 are host-protected from
//!    [`L3::start_backup`] until the agreed ack in [`L3::finish_backups`]; the task only reads
//!    them.
//! 2. **Rank-replicated KV.** MLA KV is the same on every TP rank (and so is its namespace):
//!    only rank 0 writes it to L3. Every other rank still tracks each backup (done at once),
//!    pins its nodes and finishes it at the agreed count, so that all ranks count the same
//!    backups and keep the same host pins (SGLang: "others still ack").
//! 3. `BlockStored(L3)` events of a backup are emitted only once every page of it is
//!    acknowledged as stored.
//! 4. **Pipelining.** A backup's batches are sent in order with up to
//!    [`L3_WRITE_BATCHES_IN_FLIGHT`] in flight over every backup of the tier, so the next
//!    batch is written while the previous one's durability barrier runs (a backend with group
//!    commit merges those barriers). A backup is done, and finished at the agreed count, only
//!    once every batch is acknowledged; backups finish in launch order.
//! 5. **Prefix keys.** With `hicache_storage_pass_prefix_keys`, every batch is sent with the
//!    keys of the pages before it in the request: the path from the root to the first
//!    fragment's parent, then the backup's own earlier pages (those skipped as already in L3
//!    included). Without it, with none.
//! 6. **Tiering** ([`crate::l2_l3_sharing`]). A backup is *complete* when every rank stored every
//!    page of it (the agreed index of the first incomplete one, [`L3::first_incomplete_backup`]).
//!    Only complete backups record their pages as known in L3 (which lets exclusive tiering's
//!    host eviction drop them) and, under `buffer_only`, release their nodes' host copies.
//!    An incomplete backup's pages stay in L2.
//! 7. **Failures are counted, never hidden.** A finished backup moved (`l2_to_l3`) exactly
//!    the pages acknowledged as stored or present; every other page it was to send (a failed
//!    call, a page the backend refused, batches never sent after a failure) is counted in
//!    `hicache_l3_failed_pages_total{op="write"}` and logged at warn (rate-limited).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use hicache_core::{
    FinishedBackup, HostSlot, KvEvent, Medium, NamespaceId, NodeId, PageHash, PageKey,
};

use super::L3;
use super::jobs::{BackupShared, Chain};
use crate::error::Result;
use crate::metrics::{Direction, L3Op};
use crate::tree_pools::Tiers;

/// Most L3 write batches in flight at once, over every backup of a cache (invariant 4).
pub const L3_WRITE_BATCHES_IN_FLIGHT: usize = 4;

/// Polls without demotions after one that did not store every page (its pages stay in L2;
/// retrying at once would rewrite them on every poll while the backend refuses).
const DEMOTE_RETRY_POLLS: u32 = 64;

/// Why pages go to L3.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum BackupKind {
    /// At L2 admission (after a D2H ack): the default and `buffer_only`.
    Admission,
    /// Cold host-only leaves leaving L2 (exclusive): dropped from L2 once complete.
    Demotion,
}

/// What a backup is asked to write: one request's pages of `nodes` (root-first).
struct ToSend {
    kind: BackupKind,
    namespace: NamespaceId,
    nodes: Vec<NodeId>,
    /// Every page of the nodes.
    hashes: Vec<PageHash>,
    /// Their host slots.
    slots: Vec<HostSlot>,
    /// Skip the leading pages already known to be in L3.
    dedup: bool,
}

/// Pages a backup writes: the nodes it pins and, per page it sends, the key and host slot.
struct BackupPages {
    kind: BackupKind,
    nodes: Vec<NodeId>,
    /// Every page of the nodes (recorded as known in L3 when the backup is complete).
    hashes: Vec<PageHash>,
    /// The keys sent, after the request's earlier pages (prefix keys).
    chain: Chain,
    slots: Vec<HostSlot>,
}

/// A backup tracked by the engine thread.
#[derive(Debug)]
pub(crate) struct BackupOp {
    kind: BackupKind,
    nodes: Vec<NodeId>,
    hashes: Vec<PageHash>,
    /// Pages sent to L3 (pages already known to be there are not sent again).
    pages: usize,
    /// `BlockStored(L3)` events for the pages, made at launch (while the nodes hold exactly
    /// these pages) and emitted once every page is stored; empty when events are off.
    events: Vec<KvEvent>,
    started: Instant,
    shared: Arc<BackupShared>,
    /// Written by rank 0 for this rank (MLA, invariant 2): nothing was stored here.
    skipped: bool,
}

impl BackupOp {
    fn is_done(&self) -> bool {
        self.shared.done.is_set()
    }

    /// Pages stored so far.
    fn stored(&self) -> usize {
        self.shared.stored_pages.load(Ordering::Relaxed) as usize
    }
}

impl L3 {
    /// Starts copying a finished write's pages to L3 (after the D2H ack). Nothing under
    /// exclusive tiering (L3 is written from cold pages instead); under `buffer_only` pages
    /// already known to be in L3 are not sent again.
    pub fn start_backup(&mut self, fin: FinishedBackup, tiers: &mut Tiers) -> Result<()> {
        if fin.fragments.is_empty() || !tiers.tiering.writes_at_admission() {
            return Ok(());
        }
        let Some(start) = tiers.tree.chain_start(fin.tenant)? else {
            return Ok(());
        };
        let (nodes, all_slots, hashes) = fin.into_parts();
        if hashes.len() != all_slots.len() {
            // Pages without hashes cannot be named in L3.
            return Ok(());
        }
        let to_send = ToSend {
            kind: BackupKind::Admission,
            namespace: start.namespace_id,
            nodes,
            hashes,
            slots: all_slots,
            dedup: tiers.tiering.dedups_admission(),
        };
        let pages = self.backup_pages(to_send, tiers)?;
        self.launch_backup(pages, tiers)
    }

    /// The pages to send of `t.nodes` (one request's pages, root-first): pages already known
    /// to be in L3 at the front are skipped when `t.dedup` (they become prefix keys, so
    /// invariant 5 stays true), the rest are sent in order.
    fn backup_pages(&self, t: ToSend, tiers: &Tiers) -> Result<BackupPages> {
        let ToSend {
            kind,
            namespace,
            nodes,
            hashes,
            slots,
            dedup,
        } = t;
        let key = |h: &PageHash| PageKey::new(namespace, *h);
        let skip = if dedup {
            hashes
                .iter()
                .take_while(|h| tiers.tiering.known.contains(h))
                .count()
        } else {
            0
        };
        // The request's pages before the first sent: the path to the first node's parent,
        // then the skipped pages (invariant 5).
        let prefix: Option<Vec<PageKey>> =
            if self.config.common.pass_prefix_keys && !self.backup_skip {
                let mut v: Vec<PageKey> = match tiers.tree.node_info(nodes[0])?.parent {
                    Some(p) => tiers.tree.prefix_hashes(p)?.iter().map(key).collect(),
                    None => Vec::new(),
                };
                v.extend(hashes[..skip].iter().map(key));
                Some(v)
            } else {
                None
            };
        let chain = Chain::new(prefix.as_deref(), hashes[skip..].iter().map(key));
        Ok(BackupPages {
            kind,
            nodes,
            hashes,
            chain,
            slots: {
                // The pages sent, in place (no copy of the rest).
                let mut slots = slots;
                slots.drain(..skip);
                slots
            },
        })
    }

    /// Exclusive tiering: when the agreed free host pages, plus pages of demotions in flight,
    /// plus the coldest host-only leaves already known to be in L3 (host eviction takes those
    /// at once when room is needed, so they stay in L2 until then), fall below the headroom
    /// plus the shortfall, starts a backup of each of the coldest leaves L3 lacks (its pages
    /// already known there are not sent); once it is complete they are known in L3 and host
    /// eviction may drop them (invariant 6). Deterministic: the tree, the budget and the
    /// shortfall are agreed.
    pub fn demote_cold(&mut self, tiers: &mut Tiers) -> Result<()> {
        if self.demote_pause > 0 {
            self.demote_pause -= 1;
            return Ok(());
        }
        let headroom = tiers.tiering.headroom() + std::mem::take(&mut tiers.tiering.shortfall);
        let have = tiers.budget + self.demoting_pages;
        if !tiers.tiering.exclusive || have >= headroom {
            return Ok(());
        }
        for node in tiers.tree.coldest_host_leaves(headroom - have) {
            let hashes = tiers.tree.page_hashes(node)?.to_vec();
            let slots = tiers.tree.host_slots(node)?;
            let tenant = tiers.tree.node_info(node)?.tenant;
            let Some(start) = tiers.tree.chain_start(tenant)? else {
                continue;
            };
            if tiers.tiering.known.contains_all(&hashes) || slots.len() != hashes.len() {
                continue;
            }
            self.demoting_pages += hashes.len();
            let to_send = ToSend {
                kind: BackupKind::Demotion,
                namespace: start.namespace_id,
                nodes: vec![node],
                hashes,
                slots,
                dedup: true,
            };
            let pages = self.backup_pages(to_send, tiers)?;
            self.launch_backup(pages, tiers)?;
        }
        Ok(())
    }

    /// Pins the nodes, makes their `BlockStored(L3)` events and starts the job (or, for a
    /// rank that does not write, or nothing to send, a backup done at once).
    fn launch_backup(&mut self, p: BackupPages, tiers: &mut Tiers) -> Result<()> {
        for &n in &p.nodes {
            tiers.tree.protect_host(n)?;
        }
        let mut events = Vec::new();
        for &n in &p.nodes {
            events.extend(tiers.tree.stored_event(n, Medium::Storage)?);
        }
        let sent = p.chain.len();
        let shared = if self.backup_skip || sent == 0 {
            // Rank 0 writes these pages for every rank (invariant 2), or every page is known
            // to be in L3: done at once, but tracked, pinned and finished like the others.
            let shared = Arc::new(BackupShared::default());
            shared.done.set();
            shared
        } else {
            let pool = tiers.host_pool.clone();
            // Handed to the runtime at the tick's next flush (one wake-up per tick).
            self.engine.backup(pool, p.chain, p.slots, self.layout)
        };
        self.backups.push(BackupOp {
            kind: p.kind,
            nodes: p.nodes,
            hashes: p.hashes,
            pages: sent,
            events,
            started: Instant::now(),
            shared,
            skipped: self.backup_skip,
        });
        Ok(())
    }

    /// Backups in flight (started, not finished).
    pub fn backups_in_flight(&self) -> usize {
        self.backups.len()
    }

    /// Each backup in flight, oldest first: its pages and whether its task finished.
    pub fn backup_pages_in_flight(&self) -> Vec<(usize, bool)> {
        self.backups
            .iter()
            .map(|b| (b.pages, b.is_done()))
            .collect()
    }

    /// Number of backups, from the oldest, that finished.
    pub fn ready_backups(&self) -> usize {
        self.backups.leading_ok(BackupOp::is_done)
    }

    /// Waits (blocking, woken by each task's end) until the oldest `n` backups finished
    /// (queued ones are handed to the runtime first).
    pub fn wait_backups(&self, n: usize) {
        self.engine.flush();
        for op in self.backups.iter().take(n) {
            op.shared.done.wait();
        }
    }

    /// The index, from the oldest, of the first finished backup that did not store every
    /// page on this rank (`usize::MAX` when none): every rank's minimum tells which backups
    /// are complete everywhere (invariant 6).
    pub fn first_incomplete_backup(&self) -> usize {
        self.backups
            .iter()
            .take_while(|b| b.is_done())
            .position(|b| !b.skipped && b.stored() < b.pages)
            .unwrap_or(usize::MAX)
    }

    /// Finishes the oldest `n` backups (the agreed count; those before index
    /// `first_incomplete` are complete on every rank): releases their host pins, appends the
    /// events of those that stored every page (invariant 3) to `events`, and applies the
    /// tiering of complete ones (invariant 6).
    pub fn finish_backups(
        &mut self,
        n: usize,
        first_incomplete: usize,
        tiers: &mut Tiers,
        events: &mut Vec<KvEvent>,
    ) -> Result<()> {
        for k in 0..n {
            let Some(op) = self.backups.pop() else {
                break;
            };
            for node in &op.nodes {
                tiers.tree.release_host(*node)?;
            }
            if op.kind == BackupKind::Demotion {
                self.demoting_pages -= op.hashes.len();
            }
            let complete = k < first_incomplete;
            if complete {
                self.apply_tiering(&op, tiers)?;
            } else if op.kind == BackupKind::Demotion {
                self.demote_pause = DEMOTE_RETRY_POLLS;
            }
            if op.skipped || op.pages == 0 {
                continue;
            }
            // Only pages acknowledged as stored count as moved (invariant 7); the rest are
            // counted as lost to storage errors, never as moved.
            let stored = op.stored().min(op.pages);
            tiers.metrics.transfer(
                Direction::l2_to_l3,
                stored as u64,
                (stored * self.page_bytes) as u64,
                op.started.elapsed().as_secs_f64(),
            );
            if stored == op.pages {
                events.extend(op.events);
            } else {
                let lost = (op.pages - stored) as u64;
                tiers.metrics.l3_failed(L3Op::write, lost);
                let error = op.shared.error.lock().clone();
                self.write_warn.warn_loss("backups", lost, error.as_deref());
            }
        }
        Ok(())
    }

    /// A complete backup: its pages are known in L3; under `buffer_only` its nodes' host
    /// copies go (deepest first), and a demotion's leaves leave L2.
    fn apply_tiering(&self, op: &BackupOp, tiers: &mut Tiers) -> Result<()> {
        tiers.tiering.known.insert_all(&op.hashes);
        if op.kind == BackupKind::Admission && tiers.tiering.buffer_only {
            for &node in op.nodes.iter().rev() {
                tiers.drop_host_copy(node)?;
            }
        }
        Ok(())
    }
}
