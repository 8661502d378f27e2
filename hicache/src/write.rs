//! The L1↔L2 pipelines: write-through batches (D2H), write-back staging, load-back batches
//! (H2D) with per-layer events.
//!
//! Invariants:
//! 1. All nodes due for write-through in one tick go out as **one** D2H launch (SGLang
//!    launches one per node).
//! 2. A node's device pages stay locked from `commit_backup` to `finish_backup`, which runs
//!    only after its batch's completion fired and every rank agreed on the count of finished
//!    batches (acks are finished in launch order).
//! 3. Loads queued by admissions of a tick are merged into one H2D launch by
//!    `start_loading`, published to the `LayerDoneCounter`; their nodes stay locked until the
//!    agreed ack.

use std::time::Instant;

use hicache_core::{HostAllocator, LoadId, NodeId, StagedWriteBack, WriteId};
use hicache_gpu::{Completion, DeviceSlot, Event, LoadHandle};
use hicache_host::{HostPool, HostSlot};

use crate::cache::{HiCache, dev_slots, host_slots, raw_host};
use crate::error::Result;
use crate::metrics::Direction;

/// A launched D2H batch.
pub(crate) struct WriteBatch {
    pub done: Completion,
    pub ids: Vec<WriteId>,
    /// Pages copied by the batch.
    pub pages: usize,
    pub started: Instant,
}

/// A load-back committed in the tree, waiting for `start_loading`.
pub(crate) struct QueuedLoad {
    pub load_id: LoadId,
    pub host: Vec<HostSlot>,
    pub device: Vec<DeviceSlot>,
}

/// A launched H2D batch.
pub(crate) struct LoadBatch {
    pub handle: LoadHandle,
    pub producer: usize,
    pub ids: Vec<LoadId>,
    pub pages: usize,
    pub started: Instant,
}

/// Host allocation for the tree's write-back eviction, within the agreed host budget.
pub(crate) struct BudgetHost<'a> {
    pub pool: &'a HostPool,
    pub budget: &'a mut usize,
    pub failed: bool,
}

impl HostAllocator for BudgetHost<'_> {
    fn alloc(&mut self, pages: usize) -> Option<Vec<u32>> {
        if *self.budget < pages {
            self.failed = true;
            return None;
        }
        let v = self.pool.alloc(pages)?;
        *self.budget -= pages;
        Some(raw_host(&v))
    }

    fn free(&mut self, slots: &[u32]) {
        match self.pool.free(&host_slots(slots)) {
            Ok(()) => *self.budget += slots.len(),
            Err(e) => tracing::error!(error = %e, "the tree freed host pages twice"),
        }
    }
}

impl HiCache {
    fn after_compute(&self) -> Result<Option<Event>> {
        Ok(match &self.compute_stream {
            Some(s) => Some(s.record()?),
            None => None,
        })
    }

    /// Launches one D2H batch for every node due for write-through (invariant 1), after its
    /// ancestors that are not backed up (see [`Self::with_unbacked_ancestors`]). Nodes evicted
    /// meanwhile, nodes for which no host memory can be found (after evicting host-only
    /// nodes) and nodes below those are skipped: they stay device-only, as in SGLang.
    pub(crate) fn launch_writes(&mut self) -> Result<()> {
        if !self.cfg.enable_hierarchical_cache {
            self.due_writes.clear();
        }
        if self.due_writes.is_empty() {
            return Ok(());
        }
        let due = std::mem::take(&mut self.due_writes);
        let due = self.with_unbacked_ancestors(due)?;
        let mut dev = Vec::new();
        let mut host = Vec::new();
        let mut ids = Vec::new();
        for node in due {
            let plan = match self.tree.begin_backup(node) {
                Ok(Some(p)) => p,
                Ok(None) => continue,
                Err(hicache_core::CoreError::StaleNode(_)) => continue,
                Err(e) => return Err(e.into()),
            };
            let Some(h) = self.alloc_host(plan.pages())? else {
                tracing::debug!(
                    pages = plan.pages(),
                    "host pool full: node stays device-only"
                );
                continue;
            };
            let id = self.tree.commit_backup(node, &raw_host(&h))?;
            dev.extend(dev_slots(&plan.device_slots));
            host.extend(h);
            ids.push(id);
        }
        if ids.is_empty() {
            return Ok(());
        }
        let after = self.after_compute()?;
        let after: Vec<&Event> = after.iter().collect();
        let done = self.engine.backup(&dev, &host, &after)?;
        self.writes.push_back(WriteBatch {
            done,
            ids,
            pages: dev.len(),
            started: Instant::now(),
        });
        Ok(())
    }

    /// The due nodes preceded (root-first, once each) by their ancestors that are on device
    /// but not backed up. Backups are deferred to the next poll, so a due node may have been
    /// split meanwhile (a match ending inside it): its upper part is a new node, not backed
    /// up, with the same hit count, and the due node's own backup would be refused for its
    /// parent (host residency stays prefix-closed). Backing up those ancestors first keeps
    /// write-through complete.
    fn with_unbacked_ancestors(&self, due: Vec<NodeId>) -> Result<Vec<NodeId>> {
        let mut out = Vec::with_capacity(due.len());
        let mut seen = std::collections::HashSet::new();
        for node in due {
            let mut chain = vec![node];
            let mut at = match self.tree.node_info(node) {
                Ok(info) => info.parent,
                Err(hicache_core::CoreError::StaleNode(_)) => None,
                Err(e) => return Err(e.into()),
            };
            while let Some(p) = at {
                let info = self.tree.node_info(p)?;
                if info.is_root || info.backed_up || !info.on_device {
                    break;
                }
                chain.push(p);
                at = info.parent;
            }
            for n in chain.into_iter().rev() {
                if seen.insert(n) {
                    out.push(n);
                }
            }
        }
        Ok(out)
    }

    /// Write-back eviction staged nodes: copy them to host now (blocking, as SGLang's
    /// `writing_check(write_back=True)`), then free their device pages and finish the writes.
    pub(crate) fn write_back_staged(&mut self, staged: Vec<StagedWriteBack>) -> Result<()> {
        let mut dev = Vec::new();
        let mut host = Vec::new();
        for s in &staged {
            dev.extend(dev_slots(&s.device_slots));
            host.extend(host_slots(&s.host_slots));
        }
        let started = Instant::now();
        let after = self.after_compute()?;
        let after: Vec<&Event> = after.iter().collect();
        self.engine.backup(&dev, &host, &after)?.wait()?;
        self.device_pool.free(&dev)?;
        let ids: Vec<WriteId> = staged.iter().map(|s| s.write_id).collect();
        self.write_ids_done(&ids, started)
    }

    /// Launches the H2D copies of every load-back admitted since the last call as one batch,
    /// layer by layer with an event per layer, and publishes it to the layer counter.
    /// Returns the producer id the engine passes to `LayerDoneCounter::set_consumer`, or
    /// `None` when nothing is to be loaded.
    pub fn start_loading(&mut self) -> Result<Option<usize>> {
        self.check_open()?;
        if self.queued_loads.is_empty() {
            return Ok(None);
        }
        let queued = std::mem::take(&mut self.queued_loads);
        let mut host = Vec::new();
        let mut dev = Vec::new();
        let mut ids = Vec::new();
        for q in queued {
            host.extend(q.host);
            dev.extend(q.device);
            ids.push(q.load_id);
        }
        // The counter's ring reuses slots: make sure the load that last used the next slot
        // finished (a deeper overlap than the ring allows would otherwise be an error). That
        // is the load published `DEFAULT_DEPTH` launches ago; `loads` holds every launched
        // load not yet finished, in launch order (finished ones are done).
        let depth = hicache_gpu::LayerDoneCounter::DEFAULT_DEPTH;
        if let Some(i) = self.loads.len().checked_sub(depth) {
            self.loads[i].handle.wait()?;
        }
        let handle = self.engine.load(&host, &dev, &[])?;
        let producer = self.counter.publish(handle.clone())?;
        self.loads.push_back(LoadBatch {
            handle,
            producer,
            ids,
            pages: host.len(),
            started: Instant::now(),
        });
        Ok(Some(producer))
    }

    /// Finishes the oldest `n` write batches (the agreed count).
    pub(crate) fn finish_writes(&mut self, n: usize) -> Result<()> {
        for _ in 0..n {
            let Some(batch) = self.writes.pop_front() else {
                break;
            };
            batch.done.wait()?;
            self.write_ids_done(&batch.ids, batch.started)?;
        }
        Ok(())
    }

    /// Finishes the oldest `n` load batches (the agreed count): unlocks their nodes.
    pub(crate) fn finish_loads(&mut self, n: usize) -> Result<()> {
        for _ in 0..n {
            let Some(batch) = self.loads.pop_front() else {
                break;
            };
            batch.handle.wait()?;
            for id in batch.ids {
                self.tree.finish_load_back(id)?;
            }
            let bytes = (batch.pages * self.shape.page_bytes()) as u64;
            self.metrics.transfer(
                Direction::h2d,
                batch.pages as u64,
                bytes,
                batch.started.elapsed().as_secs_f64(),
            );
            tracing::trace!(producer = batch.producer, "load batch finished");
        }
        Ok(())
    }

    /// Number of write batches, from the oldest, whose copies completed.
    pub(crate) fn ready_writes(&self) -> Result<usize> {
        let mut n = 0;
        for w in &self.writes {
            if !w.done.is_done()? {
                break;
            }
            n += 1;
        }
        Ok(n)
    }

    /// Number of load batches, from the oldest, whose copies completed.
    pub(crate) fn ready_loads(&self) -> Result<usize> {
        let mut n = 0;
        for l in &self.loads {
            if !l.handle.is_done()? {
                break;
            }
            n += 1;
        }
        Ok(n)
    }
}
