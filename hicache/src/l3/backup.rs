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
//!    fragment's parent, then the backup's own earlier pages. Without it, with none.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use hicache_core::{FinishedBackup, KvEvent, Medium, NodeId, PageKey};

use super::L3;
use super::jobs::{BackupJob, BackupShared, Chain};
use crate::error::Result;
use crate::metrics::Direction;
use crate::tiers::Tiers;

/// Most L3 write batches in flight at once, over every backup of a cache (invariant 4).
pub const L3_WRITE_BATCHES_IN_FLIGHT: usize = 4;

/// A backup tracked by the engine thread.
#[derive(Debug)]
pub(crate) struct BackupOp {
    nodes: Vec<NodeId>,
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
        self.shared.done.load(Ordering::Acquire)
    }
}

impl L3 {
    /// Starts copying a finished write's pages to L3 (after the D2H ack).
    pub fn start_backup(&mut self, fin: FinishedBackup, tiers: &mut Tiers) -> Result<()> {
        if fin.fragments.is_empty() {
            return Ok(());
        }
        let Some(start) = tiers.tree.chain_start(fin.tenant)? else {
            return Ok(());
        };
        let hashes = fin.hashes();
        let slots = fin.host_slots();
        if hashes.len() != slots.len() {
            // Pages without hashes cannot be named in L3.
            return Ok(());
        }
        let key = |h: &hicache_core::PageHash| PageKey::new(start.namespace_id, *h);
        // The request's pages before the first stored: the path to the first fragment's
        // parent (invariant 5).
        let prefix: Option<Vec<PageKey>> =
            if self.config.common.pass_prefix_keys && !self.backup_skip {
                match tiers.tree.node_info(fin.fragments[0].node)?.parent {
                    Some(p) => Some(tiers.tree.prefix_hashes(p)?.iter().map(key).collect()),
                    None => Some(Vec::new()),
                }
            } else {
                None
            };
        let chain = Chain::new(prefix.as_deref(), hashes.iter().map(key));
        let nodes: Vec<NodeId> = fin.fragments.iter().map(|f| f.node).collect();
        for &n in &nodes {
            tiers.tree.protect_host(n)?;
        }
        let mut events = Vec::new();
        for &n in &nodes {
            events.extend(tiers.tree.stored_event(n, Medium::Storage)?);
        }
        let pages = slots.len();
        let shared = Arc::new(BackupShared::default());
        if self.backup_skip {
            // Rank 0 writes these pages for every rank (invariant 2): this rank's backup is
            // done at once, but it is tracked, pinned and finished like rank 0's.
            shared.done.store(true, Ordering::Release);
        } else {
            let job = BackupJob {
                storage: self.storage.clone(),
                pool: tiers.host_pool.clone(),
                chain: Arc::new(chain),
                slots,
                batch: self.batch,
                layout: self.layout,
                shared: shared.clone(),
                in_flight: self.write_permits.clone(),
            };
            self.runtime.spawn(job.run());
        }
        self.backups.push_back(BackupOp {
            nodes,
            pages,
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
        self.backups.iter().take_while(|b| b.is_done()).count()
    }

    /// Waits until the oldest `n` backups finished (polling).
    pub fn wait_backups(&self, n: usize) {
        for op in self.backups.iter().take(n) {
            while !op.is_done() {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        }
    }

    /// Finishes the oldest `n` backups (the agreed count): releases their host pins and
    /// appends the events of those that stored every page (invariant 3) to `events`.
    pub fn finish_backups(
        &mut self,
        n: usize,
        tiers: &mut Tiers,
        events: &mut Vec<KvEvent>,
    ) -> Result<()> {
        for _ in 0..n {
            let Some(op) = self.backups.pop_front() else {
                break;
            };
            for node in &op.nodes {
                tiers.tree.release_host(*node)?;
            }
            if op.skipped {
                continue;
            }
            let stored = op.shared.stored_pages.load(Ordering::Relaxed);
            tiers.metrics.transfer(
                Direction::l2_to_l3,
                stored,
                stored * self.page_bytes as u64,
                op.started.elapsed().as_secs_f64(),
            );
            if stored as usize == op.pages {
                events.extend(op.events);
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
}
