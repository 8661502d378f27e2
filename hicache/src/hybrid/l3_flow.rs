//! The hybrid cache's L3 steps (see `l3` for the rules): the L3 job of a write-through
//! backup, the L3 backup once it finished, and the prefetch of `arrive`. Every decision that
//! changes the tree uses numbers every rank agreed on.

use hicache_core::unified::HostInsert;
use hicache_core::{PageHash, UnifiedBackupPlan, UnifiedMatch};
use hicache_host::HostComponent;

use super::cache::{HybridCache, Units};
use super::l3::{L3Job, L3Part, PARTS, PagesOut};
use crate::error::Result;

impl HybridCache {
    /// Runs `f` with the L3 part taken out of the cache (so `f` may use the cache mutably).
    fn with_l3<T>(&mut self, f: impl FnOnce(&mut Self, &L3Part) -> Result<T>) -> Result<Option<T>> {
        let Some(l3) = self.l3.take() else {
            return Ok(None);
        };
        let r = f(self, &l3);
        self.l3 = Some(l3);
        r.map(Some)
    }

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
            if *swa_node != plan.node {
                job.nodes.push(*swa_node);
            }
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

    /// Writes a finished backup's host copies to L3, its nodes host-pinned meanwhile.
    pub(crate) fn l3_backup(&mut self, job: &L3Job) -> Result<()> {
        self.with_l3(|c, l3| {
            for &n in &job.nodes {
                c.tree.lock_host(n)?;
            }
            let written = l3.write(&c.pools.group, job);
            for &n in &job.nodes {
                c.tree.unlock_host(n)?;
            }
            for (k, part) in PARTS.iter().enumerate() {
                let (n, failed) = (written.stored[k], written.failed[k]);
                if n == 0 && failed == 0 {
                    // Nothing of this component (perhaps not configured: no slot size).
                    continue;
                }
                let bytes = c.pools.group.slot_bytes(*part)?;
                let t = c.totals.get_mut(super::component_of(*part));
                t.pages_l2_to_l3 += n as u64;
                t.bytes_l2_to_l3 += (n * bytes) as u64;
                t.l3_failed_write_pages += failed as u64;
            }
            Ok(())
        })
        .map(|_| ())
    }

    /// The minimum of `value` over every rank.
    fn agree_min(&self, value: u64) -> Result<u64> {
        let mut min = [value];
        let mut max = [value];
        self.rank.exchange(&mut min, &mut max)?;
        Ok(min[0])
    }

    /// The prefetch of an arriving request: fetches from L3 the part of `key` past the
    /// host-valid prefix of `m` and inserts it as host-only nodes; the tokens fetched.
    pub(crate) fn prefetch(&mut self, key: &[u32], m: &UnifiedMatch) -> Result<usize> {
        let ps = self.cfg.page_size as usize;
        let aligned = key.len() / ps * ps;
        let start = m.device_prefix_len + m.host_hit_len;
        let parent_on_host = m.host_node == self.tree.root()
            || self
                .tree
                .backed_up(m.host_node, hicache_core::Component::Full)?;
        // Only a span the tree knows nothing of (every rank's tree is the same, so every rank
        // decides alike and takes part in the same exchanges).
        let eligible = self.l3.is_some()
            && parent_on_host
            && m.full_hit_len <= start
            && aligned > start
            && aligned - start >= self.cfg.prefetch_threshold_tokens.max(1);
        if !eligible {
            return Ok(0);
        }
        let fetched = self.with_l3(|c, l3| c.prefetch_span(l3, &key[..aligned], start, m))?;
        Ok(fetched.unwrap_or(0))
    }

    fn prefetch_span(
        &mut self,
        l3: &L3Part,
        key: &[u32],
        start: usize,
        m: &UnifiedMatch,
    ) -> Result<usize> {
        let ps = self.cfg.page_size as usize;
        let hashes = l3.hashes(key);
        let span = &hashes[start / ps..];
        let at_root = start == 0;
        let comps = [
            true,
            self.tree.has(hicache_core::Component::Swa),
            self.tree.has(hicache_core::Component::Mamba),
        ];
        let local = l3
            .plan(&self.pools.group, span, at_root, comps)?
            .map_or(0, |p| p.hit);
        let hit = self.agree_min(local as u64)? as usize;
        if hit == 0 {
            return Ok(0);
        }
        let plan = l3.plan_for(span, hit, &l3.policies(span.len(), at_root))?;
        let pin = m.host_node != self.tree.root();
        if pin {
            self.tree.lock_host(m.host_node)?;
        }
        // Page identities for the events (empty when events are off).
        let mut infos = self.events.pages(&key[..start + hit * ps]);
        let infos = infos.split_off((start / ps).min(infos.len()));
        let r = self.fetch_and_insert(l3, &plan, &key[start..start + hit * ps], m, infos);
        if pin {
            self.tree.unlock_host(m.host_node)?;
        }
        r
    }

    fn fetch_and_insert(
        &mut self,
        l3: &L3Part,
        plan: &super::l3::PrefetchPlan,
        span: &[u32],
        m: &UnifiedMatch,
        infos: Vec<super::events::PageInfo>,
    ) -> Result<usize> {
        let [kv, swa, mamba] = [0, 1, 2].map(|k| plan.keys[k].len());
        let host = self.alloc_host(kv, swa, mamba)?;
        let read = match &host {
            Some(h) => {
                let missing = l3.read(&self.pools.group, plan, &[&h.full, &h.swa, &h.mamba]);
                for (k, part) in PARTS.iter().enumerate() {
                    self.totals
                        .get_mut(super::component_of(*part))
                        .l3_failed_read_pages += missing[k] as u64;
                }
                missing == [0; 3]
            }
            None => false,
        };
        let ok = self.agree_min(u64::from(read))? == 1;
        let Some(h) = host else {
            return Ok(0);
        };
        if !ok {
            self.free_host_units(&h)?;
            return Ok(0);
        }
        let insert = HostInsert {
            full: &h.full,
            swa: &h.swa,
            mamba: h.mamba.first().copied(),
        };
        self.tree.insert_host_only(m.host_node, span, insert)?;
        self.events
            .stored(hicache_core::Medium::CpuPinned, &h.full, infos);
        for (k, n) in [kv, swa, mamba]
            .into_iter()
            .enumerate()
            .filter(|&(_, n)| n > 0)
        {
            let bytes = self.pools.group.slot_bytes(PARTS[k])?;
            let t = self.totals.get_mut(super::component_of(PARTS[k]));
            t.pages_l3_to_l2 += n as u64;
            t.bytes_l3_to_l2 += (n * bytes) as u64;
        }
        Ok(span.len())
    }
}
