//! The per-tick pump of [`HybridCache`]: one rank agreement a tick (the dense controller's
//! [`crate::agree`]: copies and L3 backups in [`Fifo`](crate::agree::Fifo)s, prefetches in a
//! [`Tracked`](crate::agree::Tracked) table, gathered and agreed as the dense ones), then
//! finishing copies and L3 work at the agreed counts, launching write-through per component,
//! and the load batches the engine waits on.
//!
//! The exchanged vector (reduced with `min`), the dense controller's layout where the two
//! share a meaning:
//!
//! | index | value |
//! |---|---|
//! | 0 | write-through backups finished (device → host), counted from the oldest |
//! | 1 | load-backs finished, counted from the oldest |
//! | 2 | L3 backups finished, counted from the oldest (0 without L3) |
//! | 3 | ended prefetches whose task exited, counted from the oldest (0 without L3) |
//! | 4 + 4·i … | prefetch `i` (creation order): the dense controller's `PrefetchCounts` (a read's pages count as fetched once every component's arrived) |
//!
//! Every rank commits the same copies and L3 work in the same order (the same calls, the same
//! tree; prefetches created and ended alike), so the shape is the same everywhere and
//! finishing the agreed numbers keeps every tree identical.

use hicache_core::{Component, HostBackup, NodeId, UnifiedLoadPlan};

use super::cache::{HybridCache, Units};
use super::copies::Backup;
use super::copies::Launched;
use super::pools::{COMPONENTS, Tier, plan_slots};
use crate::error::Result;

/// Index of "backups finished" in the exchanged vector.
pub const HYBRID_EXCHANGE_BACKUPS: usize = 0;
/// Index of "load-backs finished" in the exchanged vector.
pub const HYBRID_EXCHANGE_LOADS: usize = 1;
/// Index of "L3 backups finished".
pub(crate) const EXCHANGE_L3_BACKUPS: usize = 2;
/// Index of "ended prefetches whose task exited".
pub(crate) const EXCHANGE_DRAINED: usize = 3;
/// Values of the exchange before the prefetches'.
pub(crate) const FIXED_VALUES: usize = 4;

/// Most rounds of [`HybridCache::flush`]: a copy, then its L3 backup; a prefetch's lookup,
/// then its read and insert.
const SETTLE_ROUNDS: usize = 4;

impl HybridCache {
    /// One scheduler tick: finishes the copies every rank has seen land, then launches the
    /// write-through of the nodes inserted since the last poll.
    pub fn poll(&mut self) -> Result<()> {
        if self.is_closed() {
            return Err(crate::HiCacheError::Closed);
        }
        // L3 work queued since the last flush (arrivals after `start_loading`) is handed
        // over; this tick's lookups wait for `start_loading`.
        self.l3_begin_scheduling();
        self.tick(false)?;
        self.launch_writes()?;
        self.publish();
        Ok(())
    }

    /// Blocks until every copy launched so far has landed, and every L3 backup and
    /// prefetch has run its course, then finishes them all (every rank must call it at the
    /// same point, as `poll`).
    pub fn flush(&mut self) -> Result<()> {
        if self.is_closed() {
            return Err(crate::HiCacheError::Closed);
        }
        self.settle_all()
    }

    /// Waits for and finishes every copy, L3 backup and prefetch step, round by round
    /// (copy → its L3 backup; lookup → read → insert) while any is in flight. Whether
    /// another round runs depends on agreed state only, so every rank makes the same
    /// exchanges.
    pub(crate) fn settle_all(&mut self) -> Result<()> {
        for _ in 0..SETTLE_ROUNDS {
            self.tick(true)?;
            if self.copies_in_flight() == 0 && !self.l3_busy() {
                break;
            }
        }
        self.collect_drained()
    }

    /// Closes the batch of load-backs and copy-on-write copies launched by the admissions
    /// since the last call: its id for [`wait_loaded`](Self::wait_loaded), or `None` when
    /// nothing was launched.
    pub fn start_loading(&mut self) -> Result<Option<usize>> {
        if self.is_closed() {
            return Err(crate::HiCacheError::Closed);
        }
        // The tick's L3 work (this poll's backups, this tick's lookups) in one hand-off.
        self.l3_end_scheduling();
        Ok(self.copies.close_batch())
    }

    /// Blocks until every copy of the batch `producer` (from
    /// [`start_loading`](Self::start_loading)) has landed on the device.
    pub fn wait_loaded(&mut self, producer: usize) -> Result<()> {
        self.copies.wait_batch(producer)
    }

    /// One agreement (see the module docs), then the agreed copies, L3 backups and
    /// prefetch steps finish or advance (`all`: waits for every copy and L3 step first, as
    /// `flush` and shutdown do).
    pub(crate) fn tick(&mut self, all: bool) -> Result<()> {
        if all {
            self.copies.wait_all()?;
            self.wait_l3();
        }
        let mut fixed = [0; FIXED_VALUES];
        fixed[HYBRID_EXCHANGE_BACKUPS] = self.copies.backups_done()? as u64;
        fixed[HYBRID_EXCHANGE_LOADS] = self.copies.loads_done()? as u64;
        let mut prefetches = std::mem::take(&mut self.l3_ops.scratch);
        self.gather_l3(&mut fixed, &mut prefetches);
        prefetches.agree(&*self.rank, &mut fixed)?;
        self.finish_copies(&fixed)?;
        let ended = (fixed[EXCHANGE_L3_BACKUPS], fixed[EXCHANGE_DRAINED]);
        let r = self.apply_l3(ended, &prefetches);
        self.l3_ops.scratch = prefetches;
        r
    }

    /// Finishes the copies every rank has seen land (the agreed `fixed`), starting the L3
    /// backup of each finished write-through.
    fn finish_copies(&mut self, fixed: &[u64; FIXED_VALUES]) -> Result<()> {
        for _ in 0..fixed[HYBRID_EXCHANGE_BACKUPS] {
            let b = self.copies.backups.pop().expect("counted above");
            self.tree.finish_backup(b.id)?;
            if let Some(job) = b.l3 {
                self.l3_backup(job)?;
            }
        }
        for _ in 0..fixed[HYBRID_EXCHANGE_LOADS] {
            let l = self.copies.loads.pop().expect("counted above");
            self.tree.finish_load_back(l.id)?;
        }
        self.copies.prune_cows()
    }

    /// Backs up every node queued by `cache_finished` (its unbacked ancestors first).
    fn launch_writes(&mut self) -> Result<()> {
        for (node, tokens) in std::mem::take(&mut self.copies.writes) {
            // A node evicted (deleted, or demoted) since its insert has nothing to copy.
            if !self.tree.present(node, Component::Full).unwrap_or(false) {
                continue;
            }
            let mut chain = self.tree.unbacked_chain(node)?;
            if chain.last() != Some(&node) {
                chain.push(node);
            }
            let hashes = self.l3_hashes(&tokens);
            for n in chain {
                if !self.backup_node(n, &hashes)? {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Launches the backup of `node` per component and commits it; `false` when the host
    /// pools cannot make room (the node stays device-only).
    /// `hashes` are the page hashes of the inserted sequence (for the L3 keys; empty without
    /// L3).
    fn backup_node(&mut self, node: NodeId, hashes: &[hicache_core::PageHash]) -> Result<bool> {
        let Some(plan) = self.tree.plan_backup(node)? else {
            return Ok(true);
        };
        let mamba = usize::from(plan.mamba.is_some());
        let Some(host) = self.alloc_host(plan.full.len(), plan.swa_pages(), mamba)? else {
            return Ok(false);
        };
        if self.tree.plan_backup(node)?.as_ref() != Some(&plan) {
            self.free_host_units(&host)?;
            return Ok(false);
        }
        let swa_dev = plan_slots(&plan.swa);
        let mut copies = Vec::new();
        if !plan.full.is_empty() {
            copies.push(self.pools.full.backup(&plan.full, &host.full)?);
        }
        if !swa_dev.is_empty() {
            copies.push(self.pools.kv(Component::Swa)?.backup(&swa_dev, &host.swa)?);
        }
        if let Some(dev) = plan.mamba {
            copies.push(self.pools.state()?.backup(dev, host.mamba[0])?);
        }
        let id = self.tree.commit_backup(
            &plan,
            HostBackup {
                full: &host.full,
                swa: &host.swa,
                mamba: host.mamba.first().copied(),
            },
        )?;
        self.count_moved(true, &host)?;
        let dev = [&plan.full[..], &swa_dev, plan.mamba.as_slice()];
        let (gpu, cpu) = (hicache_core::Medium::Gpu, hicache_core::Medium::CpuPinned);
        self.events.copied_all(gpu, dev, cpu, host.lists());
        let l3 = self.l3_job(&plan, &host, hashes)?;
        self.copies.backups.push(Backup { id, l3, copies });
        Ok(true)
    }

    /// Counts pages (states) and bytes of a copy per component: device → host (`d2h`) or
    /// host → device.
    pub(crate) fn count_moved(&mut self, d2h: bool, u: &Units) -> Result<()> {
        for (c, slots) in COMPONENTS.into_iter().zip(u.lists()) {
            let (n, bytes) = (slots.len() as u64, self.pools.unit_bytes(c) as u64);
            let t = self.totals.get_mut(c);
            let (pages, total) = match d2h {
                true => (&mut t.pages_d2h, &mut t.bytes_d2h),
                false => (&mut t.pages_h2d, &mut t.bytes_h2d),
            };
            *pages += n;
            *total += n * bytes;
        }
        Ok(())
    }

    /// Host slots of every component, evicting from each short pool's own host order (Full:
    /// host leaves; SWA, Mamba: their host LRU, as SGLang's per-pool `evict_host`) until
    /// every pool has room; all or nothing.
    pub(crate) fn alloc_host(
        &mut self,
        full: usize,
        swa: usize,
        mamba: usize,
    ) -> Result<Option<Units>> {
        let ps = self.cfg.page_size as u64;
        let need = [
            (Component::Full, full, ps),
            (Component::Swa, swa, ps),
            (Component::Mamba, mamba, 1),
        ];
        for (c, n, unit) in need {
            let short = n.saturating_sub(self.pools.host_available(c)) as u64;
            if short > 0 {
                let e = self.tree.evict_host_of(c, short * unit);
                self.forget_evicted(Tier::Host, &e)?;
            }
        }
        // An SWA or Mamba copy still on device is on no host LRU: whole host leaves (which
        // take every component with them) are the last resort.
        while need
            .iter()
            .any(|&(c, n, _)| self.pools.host_available(c) < n)
        {
            let e = self.tree.evict_host(ps);
            if e.host_full_pages.is_empty() {
                return Ok(None);
            }
            self.forget_evicted(Tier::Host, &e)?;
        }
        self.pools.alloc(Tier::Host, [full, swa, mamba]).map(Some)
    }

    /// Frees host slots of a step that did not happen.
    pub(crate) fn free_host_units(&self, u: &Units) -> Result<()> {
        self.pools.free(Tier::Host, u.lists())
    }

    /// Backups and load-backs committed and not yet finished by a poll.
    pub fn copies_in_flight(&self) -> usize {
        self.copies.backups.len() + self.copies.loads.len()
    }

    /// Launches the host → device copies of a load-back plan into `dev` (per component).
    pub(crate) fn launch_load(
        &mut self,
        plan: &UnifiedLoadPlan,
        dev: &Units,
    ) -> Result<Vec<Launched>> {
        let mut copies = Vec::new();
        if !dev.full.is_empty() {
            copies.push(self.pools.full.load(&plan_slots(&plan.full), &dev.full)?);
        }
        if !dev.swa.is_empty() {
            let swa = self.pools.kv(Component::Swa)?;
            copies.push(swa.load(&plan_slots(&plan.swa), &dev.swa)?);
        }
        if let (Some(host), Some(&d)) = (plan.mamba, dev.mamba.first()) {
            copies.push(self.pools.state()?.load(host, d)?);
        }
        self.count_moved(false, dev)?;
        Ok(copies)
    }
}
