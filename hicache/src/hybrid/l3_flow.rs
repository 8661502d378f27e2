//! The hybrid cache's L3 steps (see `l3` and `prefetch` for the rules): the L3 job of a
//! write-through backup, its background write once the copy finished, the prefetch started
//! by `arrive`, and what the tick's agreement (`tick`) ends or advances.
//!
//! The L3 values of the tick's exchange (reduced with `min`): L3 backups finished and ended
//! prefetches whose task exited (each counted from the oldest), then `PrefetchCounts::LEN`
//! values per tracked prefetch in creation order. Every rank tracks the same backups and
//! prefetches in the same order (created by calls every rank makes alike, ended at agreed
//! values), so the shape is the same everywhere; and host slots come back only at agreed
//! counts, so every rank's host pools hold the same free slots when the next allocation
//! evicts.

use std::sync::Arc;
use std::time::Instant;

use hicache_core::unified::HostInsert;
use hicache_core::{Component, PageHash, UnifiedBackupPlan, UnifiedMatch};
use hicache_host::HostComponent;

use super::cache::{HybridCache, Units};
use super::l3::{L3BackupOp, L3Job, PARTS, PagesOut};
use super::prefetch::{FetchShared, FetchTask, Phase, PrefetchOp, ReadMissing};
use super::tick::{EXCHANGE_DRAINED, EXCHANGE_L3_BACKUPS, FIXED_VALUES};
use crate::agree::{Counts, Fifo, Gathered, Tracked, max_tracked};
use crate::error::Result;
use crate::l3::{PrefetchCounts, WarnLimit, run_prefetch};

/// Most prefetches tracked at once (so the tick's exchange fits one round); arrivals beyond
/// that start none.
const MAX_TRACKED_PREFETCHES: usize = max_tracked(FIXED_VALUES, PrefetchCounts::LEN);

/// L3 work in flight.
#[derive(Debug)]
pub(crate) struct L3Ops {
    /// Background backups, oldest first.
    pub backups: Fifo<L3BackupOp>,
    /// Prefetches by sequence number (creation order).
    pub prefetches: Tracked<PrefetchOp>,
    /// Ended prefetches whose task may still write their slots: freed once it exited.
    draining: Fifo<(Arc<FetchShared>, Units)>,
    /// Warnings of backups that lost pages to storage errors (the dense tier's limit).
    write_warn: WarnLimit,
    /// Warnings of prefetches that lost pages to storage errors (the dense tier's).
    read_warn: WarnLimit,
    /// The per-tick exchange's buffers (prefetch counts), kept from tick to tick.
    pub scratch: Gathered<PrefetchCounts>,
}

impl Default for L3Ops {
    fn default() -> Self {
        Self {
            backups: Fifo::default(),
            prefetches: Tracked::new(MAX_TRACKED_PREFETCHES),
            draining: Fifo::default(),
            write_warn: WarnLimit::default(),
            read_warn: WarnLimit::default(),
            scratch: Gathered::default(),
        }
    }
}

impl HybridCache {
    /// The page hashes of `tokens` when L3 is attached (empty otherwise).
    pub(crate) fn l3_hashes(&self, tokens: &[u32]) -> Vec<PageHash> {
        self.l3
            .as_ref()
            .map_or_else(Vec::new, |l3| l3.hashes(tokens))
    }

    /// What the L3 backup of a committed write-through writes (`None` without L3): the
    /// node's KV pages, the SWA pages of the window nodes, the state, keyed from `hashes`
    /// (the page hashes of the inserted sequence).
    pub(crate) fn l3_job(
        &self,
        plan: &UnifiedBackupPlan,
        host: &Units,
        hashes: &[PageHash],
    ) -> Result<Option<L3Job>> {
        let Some(l3) = &self.l3 else {
            return Ok(None);
        };
        let ps = self.cfg.page_size as usize;
        let end = self.tree.depth_tokens(plan.node)? / ps;
        let mut job = L3Job {
            nodes: vec![plan.node],
            ..Default::default()
        };
        if !plan.full.is_empty() {
            let node = &hashes[end - plan.full.len()..end];
            job.parts[0] = PagesOut {
                keys: l3
                    .layout
                    .backup_keys(HostComponent::Kv, node, host.full.len())?,
                slots: host.full.clone(),
            };
        }
        let mut at = 0;
        for (swa_node, pages) in &plan.swa {
            let e = self.tree.depth_tokens(*swa_node)? / ps;
            let node = &hashes[e - pages.len()..e];
            let keys = l3
                .layout
                .backup_keys(HostComponent::Swa, node, pages.len())?;
            job.parts[1].keys.extend(keys);
            job.parts[1].slots.extend(&host.swa[at..at + pages.len()]);
            at += pages.len();
        }
        if let Some(&state) = host.mamba.first() {
            job.parts[2] = PagesOut {
                keys: l3
                    .layout
                    .backup_keys(HostComponent::Mamba, &hashes[..end], 1)?,
                slots: vec![state],
            };
        }
        Ok(Some(job))
    }

    /// Starts the background write of a finished backup's host copies, its nodes
    /// host-locked until its agreed end.
    pub(crate) fn l3_backup(&mut self, job: L3Job) -> Result<()> {
        let Some(l3) = &self.l3 else {
            return Ok(());
        };
        let host_lock = self.tree.lock_host(job.nodes[0])?;
        let op = l3.spawn_backup(job, host_lock)?;
        self.l3_ops.backups.push(op);
        Ok(())
    }

    /// Ends a background backup every rank has seen finish: unpins its nodes, counts it.
    fn end_backup(&mut self, op: L3BackupOp) -> Result<()> {
        self.tree.unlock_host(&op.host_lock)?;
        let (written, error) = op.counts();
        let lost: usize = written.failed.iter().sum();
        if lost > 0 {
            // Every lost page is also in the metric.
            self.l3_ops
                .write_warn
                .warn_loss("backups", lost as u64, error.as_deref());
        }
        for (k, slots) in op.part_slots.iter().enumerate() {
            if written.failed[k] == 0 {
                // Every page of the component is in L3: the router may count it there.
                self.events.copied_of(
                    super::component_of(PARTS[k]),
                    hicache_core::Medium::CpuPinned,
                    slots,
                    hicache_core::Medium::Storage,
                    slots,
                );
            }
        }
        for (k, part) in PARTS.iter().enumerate() {
            let (n, failed) = (written.stored[k], written.failed[k]);
            if n == 0 && failed == 0 {
                continue;
            }
            let bytes = self.pools.group.slot_bytes(*part)?;
            let t = self.totals.get_mut(super::component_of(*part));
            t.pages_l2_to_l3 += n as u64;
            t.bytes_l2_to_l3 += (n * bytes) as u64;
            t.l3_failed_write_pages += failed as u64;
        }
        Ok(())
    }

    /// L3 work in flight (background backups and prefetches).
    pub(crate) fn l3_busy(&self) -> bool {
        !self.l3_ops.backups.is_empty() || !self.l3_ops.prefetches.is_empty()
    }

    /// Hands the L3 tasks queued since the last flush to the runtime with one wake-up
    /// (`L3Engine`'s submission rule): before every wait for L3 work (a queued task never
    /// runs by itself).
    pub(crate) fn flush_l3(&self) {
        if let Some(l3) = &self.l3 {
            l3.engine.flush();
        }
    }

    /// The start of a tick's scheduling part (`poll`) on the L3 engine: a flush, then this
    /// tick's lookups wait for [`HybridCache::l3_end_scheduling`].
    pub(crate) fn l3_begin_scheduling(&self) {
        if let Some(l3) = &self.l3 {
            l3.engine.begin_scheduling();
        }
    }

    /// The end of a tick's scheduling part (`start_loading`): the tick's L3 work in one
    /// hand-off; lookups started after it are handed over at once.
    pub(crate) fn l3_end_scheduling(&self) {
        if let Some(l3) = &self.l3 {
            l3.engine.end_scheduling();
        }
    }

    /// Blocks until every background backup and every prefetch's current step finished.
    pub(crate) fn wait_l3(&self) {
        self.flush_l3();
        for b in &self.l3_ops.backups {
            b.wait();
        }
        for p in self.l3_ops.prefetches.values() {
            p.wait_step();
        }
    }

    /// This rank's L3 values for the tick's exchange: backups finished and drained
    /// prefetches into `fixed` (see `tick`), and each tracked prefetch's counts with its
    /// sequence number (none without L3), into `out` (its buffers reused).
    pub(crate) fn gather_l3(
        &self,
        fixed: &mut [u64; FIXED_VALUES],
        out: &mut Gathered<PrefetchCounts>,
    ) {
        let Some(l3) = &self.l3 else {
            out.clear();
            return;
        };
        let ops = &self.l3_ops;
        fixed[EXCHANGE_L3_BACKUPS] = ops.backups.leading_ok(L3BackupOp::is_done) as u64;
        fixed[EXCHANGE_DRAINED] = ops.draining.leading_ok(|(s, _)| s.progress.exited()) as u64;
        let ps = self.cfg.page_size as usize;
        ops.prefetches
            .gather_into(out, |p| p.counts(&l3.prefetch, ps));
    }

    /// The L3 part of a tick, from the agreed values: the `backups` oldest background
    /// backups end, the `drained` oldest ended prefetches' slots are freed, and each tracked
    /// prefetch advances or ends (see the module docs).
    pub(crate) fn apply_l3(
        &mut self,
        (backups, drained): (u64, u64),
        prefetches: &Gathered<PrefetchCounts>,
    ) -> Result<()> {
        for _ in 0..backups {
            let op = self.l3_ops.backups.pop().expect("counted above");
            self.end_backup(op)?;
        }
        for _ in 0..drained {
            let (_, host) = self.l3_ops.draining.pop().expect("counted above");
            self.free_host_units(&host)?;
        }
        for (seq, agreed) in prefetches.iter() {
            self.advance_prefetch(seq, agreed)?;
        }
        Ok(())
    }

    /// The prefetch of an arriving request: starts the background lookup of the part of
    /// `key` past the host-valid prefix of `m`; the tokens looked up (0: none started).
    pub(crate) fn prefetch(
        &mut self,
        req: u64,
        key: &[u32],
        m: &UnifiedMatch,
    ) -> Result<(usize, Option<u64>)> {
        let Some(l3) = &self.l3 else {
            return Ok((0, None));
        };
        let ps = self.cfg.page_size as usize;
        let aligned = key.len() / ps * ps;
        let start = m.device_prefix_len + m.host_hit_len;
        let parent_on_host =
            m.host_node == self.tree.root() || self.tree.backed_up(m.host_node, Component::Full)?;
        // Only a span the tree knows nothing of (every rank's tree is the same, so every rank
        // decides alike).
        let threshold = self.cfg.prefetch_threshold_tokens.max(ps);
        let eligible = parent_on_host
            && m.full_hit_len <= start
            && aligned > start
            && aligned - start >= threshold
            && !self.l3_ops.prefetches.is_full();
        if !eligible {
            return Ok((0, None));
        }
        let hashes = l3.hashes(&key[..aligned]).split_off(start / ps);
        let shared = Arc::new(FetchShared::default());
        let missing = Arc::new(ReadMissing::default());
        let task = FetchTask {
            storage: l3.engine.storage.clone(),
            layout: l3.layout.clone(),
            group: l3.group.clone(),
            hashes: hashes.clone(),
            at_root: start == 0,
            sidecars: [
                self.tree.has(Component::Swa),
                self.tree.has(Component::Mamba),
            ],
            missing: missing.clone(),
        };
        // Handed over with the tick's flush, or at once outside the scheduling part of a
        // tick (the engine's submission rule).
        l3.engine.lookup(run_prefetch(task, shared.clone()));
        let host_lock = self.tree.lock_host(m.host_node)?;
        let seq = self.l3_ops.prefetches.insert(PrefetchOp {
            req,
            anchor: m.host_node,
            host_lock,
            key: key[..aligned].to_vec(),
            start,
            hashes,
            started: Instant::now(),
            shared,
            missing,
            phase: Phase::Lookup,
        });
        Ok((aligned - start, Some(seq)))
    }

    /// Applies the agreed view of one prefetch (steps 2–4 of `prefetch`).
    fn advance_prefetch(&mut self, seq: u64, agreed: PrefetchCounts) -> Result<()> {
        let read = match &self.l3_ops.prefetches.get(seq).phase {
            Phase::Reading { plan, .. } => Some(plan.hit),
            Phase::Lookup => None,
        };
        match read {
            None if agreed.query_done => self.start_read(seq, agreed.hit_pages as usize),
            // Every rank read the whole hit.
            Some(hit) if agreed.completed_pages as usize >= hit => self.end_prefetch(seq, true),
            _ if agreed.may_end => self.end_prefetch(seq, false),
            _ => Ok(()),
        }
    }

    /// Allocates host slots for the agreed hit and hands them to the task, or ends the
    /// prefetch (no hit worth it, no host room).
    fn start_read(&mut self, seq: u64, hit: usize) -> Result<()> {
        let ps = self.cfg.page_size as usize;
        if hit == 0 || hit * ps < self.cfg.prefetch_threshold_tokens.max(ps) {
            return self.end_prefetch(seq, false);
        }
        let op = &self.l3_ops.prefetches.get(seq);
        let l3 = self.l3.as_ref().expect("prefetches exist only with L3");
        let plan = l3.plan_for(&op.hashes, hit, op.start == 0)?;
        let [kv, swa, mamba] = [0, 1, 2].map(|k| plan.keys[k].len());
        let Some(host) = self.alloc_host(kv, swa, mamba)? else {
            return self.end_prefetch(seq, false);
        };
        let op = self.l3_ops.prefetches.get_mut(seq);
        op.shared.give((
            plan.clone(),
            [host.full.clone(), host.swa.clone(), host.mamba.clone()],
        ));
        op.phase = Phase::Reading { plan, host };
        Ok(())
    }

    /// Ends a prefetch: inserts what it read when `insert` (every rank read it all),
    /// otherwise frees its slots (once its task can no longer write them); unpins the anchor
    /// and tells the request what came from L3.
    fn end_prefetch(&mut self, seq: u64, insert: bool) -> Result<()> {
        let op = self.l3_ops.prefetches.remove(seq);
        op.shared.terminate();
        let (lost, error) = {
            let mut st = op.shared.state.lock();
            (st.failed_pages, st.error.take())
        };
        if lost > 0 {
            // Counted in the totals from `missing`; logged as the dense prefetch's.
            self.l3_ops
                .read_warn
                .warn_loss("prefetches", lost as u64, error.as_deref());
        }
        let mut tokens = 0;
        if let Phase::Reading { plan, host } = &op.phase {
            if let Some(missing) = *op.missing.lock() {
                for (k, part) in PARTS.iter().enumerate() {
                    self.totals
                        .get_mut(super::component_of(*part))
                        .l3_failed_read_pages += missing[k] as u64;
                }
            }
            tokens = if insert {
                self.insert_prefetched(&op, plan, host)?
            } else {
                0
            };
        }
        if let (0, Phase::Reading { host, .. }) = (tokens, op.phase) {
            self.l3_ops.draining.push((op.shared.clone(), host));
        }
        self.tree.unlock_host(&op.host_lock)?;
        self.prefetch_ended(op.req, seq, tokens);
        Ok(())
    }

    /// Inserts a whole read as host-only nodes under the anchor, unless the tree has since
    /// cached part of the span (then nothing: 0). The tokens inserted.
    fn insert_prefetched(
        &mut self,
        op: &PrefetchOp,
        plan: &super::l3::PrefetchPlan,
        h: &Units,
    ) -> Result<usize> {
        let ps = self.cfg.page_size as usize;
        let end = op.start + plan.hit * ps;
        let m = self.tree.match_prefix(&op.key[..end])?;
        let unchanged = m.host_node == op.anchor
            && m.device_prefix_len + m.host_hit_len == op.start
            && m.full_hit_len <= op.start;
        if !unchanged {
            return Ok(0);
        }
        let insert = HostInsert {
            full: &h.full,
            swa: &h.swa,
            mamba: h.mamba.first().copied(),
        };
        self.tree
            .insert_host_only(op.anchor, &op.key[op.start..end], insert)?;
        // Page identities for the events (empty when events are off).
        let mut infos = self.events.pages(&op.key[..end]);
        let infos = infos.split_off((op.start / ps).min(infos.len()));
        // SWA slots hold the span's last pages, the state its end.
        let swa_infos = infos[infos.len().saturating_sub(h.swa.len())..].to_vec();
        let last = infos.last().cloned();
        self.events
            .stored(hicache_core::Medium::CpuPinned, &h.full, infos);
        self.events.stored_of(
            Component::Swa,
            hicache_core::Medium::CpuPinned,
            &h.swa,
            swa_infos,
        );
        if let (Some(state), Some(last)) = (h.mamba.first(), last) {
            self.events.stored_of(
                Component::Mamba,
                hicache_core::Medium::CpuPinned,
                &[*state],
                vec![last],
            );
        }
        let moved = [h.full.len(), h.swa.len(), h.mamba.len()];
        for (k, n) in moved.into_iter().enumerate().filter(|&(_, n)| n > 0) {
            let bytes = self.pools.group.slot_bytes(PARTS[k])?;
            let t = self.totals.get_mut(super::component_of(PARTS[k]));
            t.pages_l3_to_l2 += n as u64;
            t.bytes_l3_to_l2 += (n * bytes) as u64;
        }
        Ok(end - op.start)
    }

    /// Waits for every ended prefetch's task to exit and frees its slots (every rank calls
    /// it at the same point: `flush`, shutdown).
    pub(crate) fn collect_drained(&mut self) -> Result<()> {
        self.flush_l3();
        for (shared, host) in std::mem::take(&mut self.l3_ops.draining) {
            shared.wait_exited();
            self.free_host_units(&host)?;
        }
        Ok(())
    }

    /// Closes L3: every prefetch ended (nothing inserted), every task awaited, every backup
    /// finished, the runtime stopped.
    pub(crate) fn close_l3(&mut self) -> Result<()> {
        self.flush_l3();
        let seqs = self.l3_ops.prefetches.seqs();
        for seq in seqs {
            self.end_prefetch(seq, false)?;
        }
        while let Some(op) = self.l3_ops.backups.pop() {
            op.wait();
            self.end_backup(op)?;
        }
        self.collect_drained()?;
        if let Some(l3) = self.l3.take() {
            l3.close();
        }
        Ok(())
    }
}
