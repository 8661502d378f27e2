//! TEST DOUBLE: `ExactPrefix`, a naive model of a three-tier prefix cache used only by the
//! tests of the simulated engine (here) and of the bench's multiturn command (which includes this file by path). It is not the `hicache`
//! controller and is never used by the binary.
//!
//! Model: every whole page of every cached sequence is an entry keyed by the tokens up to the
//! end of that page. An entry may hold a device slot (L1), a host copy (L2, bounded) and a
//! storage copy (L3, unbounded). Finished requests are written through to L2 and L3 at once;
//! L1 and L2 evict least recently used entries, deepest first among equals, so every tier
//! stays prefix-closed. Transfers are instant (their reported time is notional: 10 GB/s).

#![allow(dead_code)]

use std::collections::HashMap;

use hicache_sim::{
    Admission, CacheError, CacheResult, CacheStats, CacheUnderTest, DeviceSlot, PrefetchStatus,
    RequestId,
};

/// Shape of the double.
#[derive(Clone, Debug)]
pub struct ExactPrefixConfig {
    /// Tokens per page.
    pub page_size: usize,
    /// L1 pages.
    pub device_pages: usize,
    /// L2 pages (0: no L2).
    pub host_pages: usize,
    /// Whether L3 exists (needs L2).
    pub storage: bool,
    /// Bytes per page (stats only).
    pub page_bytes: u64,
}

#[derive(Debug)]
struct Entry {
    slot: Option<DeviceSlot>,
    in_l2: bool,
    in_l3: bool,
    stamp: u64,
    depth: usize,
    locks: usize,
}

/// The test double.
#[derive(Debug)]
pub struct ExactPrefix {
    cfg: ExactPrefixConfig,
    entries: HashMap<Vec<u32>, Entry>,
    free: Vec<DeviceSlot>,
    l2_used: usize,
    clock: u64,
    prefetched: HashMap<RequestId, usize>,
    locked: HashMap<RequestId, Vec<Vec<u32>>>,
    pending_load: usize,
    producers: usize,
    stats: CacheStats,
    shut: bool,
}

impl ExactPrefix {
    /// An empty cache.
    pub fn new(cfg: ExactPrefixConfig) -> Self {
        assert!(!cfg.storage || cfg.host_pages > 0, "L3 needs L2");
        Self {
            free: (0..cfg.device_pages as u32).rev().map(DeviceSlot).collect(),
            stats: CacheStats {
                page_bytes: cfg.page_bytes,
                ..CacheStats::default()
            },
            cfg,
            entries: HashMap::new(),
            l2_used: 0,
            clock: 0,
            prefetched: HashMap::new(),
            locked: HashMap::new(),
            pending_load: 0,
            producers: 0,
            shut: false,
        }
    }

    fn key(&self, tokens: &[u32], page: usize) -> Vec<u32> {
        tokens[..(page + 1) * self.cfg.page_size].to_vec()
    }

    /// Pages a prefix may cover: never the last token.
    fn max_prefix_pages(&self, tokens: &[u32]) -> usize {
        tokens.len().saturating_sub(1) / self.cfg.page_size
    }

    fn touch(&mut self, keys: &[Vec<u32>]) {
        self.clock += 1;
        for k in keys {
            if let Some(e) = self.entries.get_mut(k) {
                e.stamp = self.clock;
            }
        }
    }

    fn victim(&self, pred: impl Fn(&Entry) -> bool) -> Option<Vec<u32>> {
        self.entries
            .iter()
            .filter(|(_, e)| pred(e))
            .min_by(|a, b| {
                (a.1.stamp, std::cmp::Reverse(a.1.depth), a.0).cmp(&(
                    b.1.stamp,
                    std::cmp::Reverse(b.1.depth),
                    b.0,
                ))
            })
            .map(|(k, _)| k.clone())
    }

    fn drop_if_empty(&mut self, k: &[u32]) {
        let e = &self.entries[k];
        if e.slot.is_none() && !e.in_l2 && !e.in_l3 {
            self.entries.remove(k);
        }
    }

    fn evict_l1(&mut self, pages: usize) {
        for _ in 0..pages {
            let Some(k) = self.victim(|e| e.slot.is_some() && e.locks == 0) else {
                return;
            };
            let slot = self.entries.get_mut(&k).unwrap().slot.take().unwrap();
            self.free.push(slot);
            self.stats.metrics.evicted_pages_l1 += 1;
            self.drop_if_empty(&k);
        }
    }

    /// Puts `k` in L2, evicting the least recently used other entry if full. False when L2 is
    /// absent or holds only `protect`ed entries.
    fn put_l2(&mut self, k: &[u32], protect: &[Vec<u32>]) -> bool {
        if self.cfg.host_pages == 0 {
            return false;
        }
        if self.entries[k].in_l2 {
            return true;
        }
        if self.l2_used == self.cfg.host_pages {
            let Some(v) = self.victim(|e| e.in_l2 && e.locks == 0) else {
                return false;
            };
            if protect.contains(&v) {
                return false;
            }
            self.entries.get_mut(&v).unwrap().in_l2 = false;
            self.l2_used -= 1;
            self.stats.metrics.evicted_pages_l2 += 1;
            self.drop_if_empty(&v);
        }
        self.entries.get_mut(k).unwrap().in_l2 = true;
        self.l2_used += 1;
        true
    }

    fn count(&mut self, dir: fn(&mut CacheStats) -> &mut hicache_sim::TransferStats, n: usize) {
        if n > 0 {
            let b = self.cfg.page_bytes;
            let t = dir(&mut self.stats);
            t.pages += n as u64;
            t.bytes += n as u64 * b;
            // Notional time, as if every direction moved 10 GB/s.
            t.seconds += (n as u64 * b) as f64 / 1e10;
            t.batches += 1;
        }
    }

    /// Device pages not held by anything.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Locks held by running requests.
    pub fn lock_count(&self) -> usize {
        self.entries.values().map(|e| e.locks).sum()
    }
}

impl CacheUnderTest for ExactPrefix {
    fn page_size(&self) -> usize {
        self.cfg.page_size
    }

    fn device_pages(&self) -> usize {
        self.cfg.device_pages
    }

    fn arrive(&mut self, req: RequestId, tokens: &[u32]) -> CacheResult<()> {
        let max = self.max_prefix_pages(tokens);
        let mut k = 0;
        let mut prefix = Vec::new();
        while k < max {
            let key = self.key(tokens, k);
            match self.entries.get(&key) {
                Some(e) if e.slot.is_some() || e.in_l2 => prefix.push(key),
                _ => break,
            }
            k += 1;
        }
        self.touch(&prefix);
        let mut fetched = 0;
        if self.cfg.storage {
            while k < max {
                let key = self.key(tokens, k);
                if !self.entries.get(&key).is_some_and(|e| e.in_l3) {
                    break;
                }
                if !self.put_l2(&key, &prefix) {
                    break;
                }
                prefix.push(key);
                self.touch(&prefix);
                fetched += 1;
                k += 1;
            }
        }
        self.count(|s| &mut s.metrics.l3_to_l2, fetched);
        if fetched > 0 {
            self.stats.metrics.prefetch_completed += 1;
        }
        self.prefetched.insert(req, fetched);
        Ok(())
    }

    fn poll(&mut self) -> CacheResult<()> {
        if self.shut {
            return Err("poll after shutdown".into());
        }
        Ok(())
    }

    fn prefetch_status(&mut self, req: RequestId) -> CacheResult<PrefetchStatus> {
        let l3_pages = *self
            .prefetched
            .get(&req)
            .ok_or_else(|| CacheError(format!("prefetch_status of unknown request {req}")))?;
        Ok(PrefetchStatus::Ready { l3_pages })
    }

    fn admit(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        new_tokens: usize,
    ) -> CacheResult<Option<Admission>> {
        let ps = self.cfg.page_size;
        let max = self.max_prefix_pages(tokens);
        let mut l1_keys = Vec::new();
        let mut host_keys = Vec::new();
        for k in 0..max {
            let key = self.key(tokens, k);
            match self.entries.get(&key) {
                Some(e) if e.slot.is_some() && host_keys.is_empty() => l1_keys.push(key),
                Some(e) if e.slot.is_none() && e.in_l2 => host_keys.push(key),
                _ => break,
            }
        }
        let total = (tokens.len() + new_tokens).div_ceil(ps);
        let prefix = l1_keys.len() + host_keys.len();
        let needed = total - prefix + host_keys.len();
        for k in &l1_keys {
            self.entries.get_mut(k).unwrap().locks += 1;
        }
        if self.free.len() < needed {
            self.evict_l1(needed - self.free.len());
        }
        if self.free.len() < needed {
            for k in &l1_keys {
                self.entries.get_mut(k).unwrap().locks -= 1;
            }
            return Ok(None);
        }
        let mut prefix_slots: Vec<DeviceSlot> = l1_keys
            .iter()
            .map(|k| self.entries[k].slot.unwrap())
            .collect();
        for k in &host_keys {
            let s = self.free.pop().unwrap();
            let e = self.entries.get_mut(k).unwrap();
            e.slot = Some(s);
            e.locks += 1;
            prefix_slots.push(s);
        }
        let new_slots = self.free.split_off(self.free.len() - (total - prefix));
        self.pending_load += host_keys.len();
        self.count(|s| &mut s.metrics.h2d, host_keys.len());
        let l3 = self
            .prefetched
            .remove(&req)
            .unwrap_or(0)
            .min(host_keys.len());
        let l2 = host_keys.len() - l3;
        self.stats.metrics.hit_tokens_l1 += (l1_keys.len() * ps) as u64;
        self.stats.metrics.hit_tokens_l2 += (l2 * ps) as u64;
        self.stats.metrics.hit_tokens_l3 += (l3 * ps) as u64;
        self.stats.metrics.request_tokens += tokens.len() as u64;
        let mut keys = l1_keys.clone();
        keys.extend(host_keys.iter().cloned());
        self.touch(&keys);
        self.locked.insert(req, keys);
        Ok(Some(Admission {
            l1_pages: l1_keys.len(),
            l2_pages: l2,
            l3_pages: l3,
            prefix_slots,
            new_slots,
            load_bytes: None,
        }))
    }

    fn start_loading(&mut self) -> CacheResult<Option<usize>> {
        if self.pending_load == 0 {
            return Ok(None);
        }
        self.pending_load = 0;
        self.producers += 1;
        Ok(Some(self.producers))
    }

    fn wait_layer(&mut self, idx: usize, _layer: usize) -> CacheResult<()> {
        if idx == 0 || idx > self.producers {
            return Err(CacheError(format!("wait_layer: unknown producer {idx}")));
        }
        Ok(())
    }

    fn cache_finished(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        slots: &[DeviceSlot],
    ) -> CacheResult<()> {
        let ps = self.cfg.page_size;
        if slots.len() != tokens.len().div_ceil(ps) {
            return Err(CacheError(format!(
                "request {req}: {} slots for {} tokens",
                slots.len(),
                tokens.len()
            )));
        }
        let locked = self
            .locked
            .remove(&req)
            .ok_or_else(|| CacheError(format!("cache_finished of unknown request {req}")))?;
        for k in &locked {
            self.entries.get_mut(k).unwrap().locks -= 1;
        }
        let full = tokens.len() / ps;
        let mut keys = Vec::with_capacity(full);
        for (page, &slot) in slots.iter().enumerate().take(full) {
            let key = self.key(tokens, page);
            let e = self.entries.entry(key.clone()).or_insert(Entry {
                slot: None,
                in_l2: false,
                in_l3: false,
                stamp: 0,
                depth: page,
                locks: 0,
            });
            match e.slot {
                Some(s) if s == slot => {}
                Some(_) => self.free.push(slot),
                None => e.slot = Some(slot),
            }
            keys.push(key);
        }
        // One stamp for the whole sequence: parents are never older than their children.
        self.touch(&keys);
        let (mut d2h, mut l3) = (0, 0);
        for key in &keys {
            if !self.entries[key].in_l2 && self.put_l2(key, &keys) {
                d2h += 1;
            }
            if self.cfg.storage && !self.entries[key].in_l3 {
                self.entries.get_mut(key).unwrap().in_l3 = true;
                l3 += 1;
            }
        }
        self.free.extend_from_slice(&slots[full..]);
        self.count(|s| &mut s.metrics.d2h, d2h);
        self.count(|s| &mut s.metrics.l2_to_l3, l3);
        Ok(())
    }

    fn shutdown(&mut self) -> CacheResult<()> {
        self.shut = true;
        Ok(())
    }

    fn stats(&self) -> CacheStats {
        self.stats
    }
}
