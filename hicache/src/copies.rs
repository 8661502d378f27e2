//! [`Copies`]: the L1↔L2 pipelines: write-through batches (D2H), write-back staging and
//! load-back batches (H2D) with per-layer events.
//!
//! Invariants:
//! 1. All nodes due for write-through in one tick go out as **one** D2H launch (SGLang
//!    launches one per node).
//! 2. A node's device pages stay locked from `commit_backup` to `finish_backup`, which runs
//!    only after its batch's completion fired and every rank agreed on the count of finished
//!    batches (acks are finished in launch order).
//! 3. Loads queued by admissions of a tick are merged into one H2D launch by
//!    [`Copies::start_loading`], published to the `LayerDoneCounter`; their nodes stay locked
//!    until the agreed ack.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use hicache_core::{
    CoreError, DeviceSlot, FinishedBackup, HiRadixTree, HostSlot, LoadId, NodeId, StagedWriteBack,
    WriteId,
};
use hicache_gpu::{Completion, Event, LayerDoneCounter, LoadHandle, Stream, TransferEngine};

use crate::agree::Fifo;
use crate::error::Result;
use crate::metrics::Direction;
use crate::tree_pools::Tiers;

/// A launched D2H batch.
struct WriteBatch {
    done: Completion,
    ids: Vec<WriteId>,
    /// Pages the batch copies.
    pages: usize,
    started: Instant,
}

/// A load-back committed in the tree, waiting for [`Copies::start_loading`].
pub(crate) struct QueuedLoad {
    /// The tree's id of the load-back.
    pub load_id: LoadId,
    /// Pages to copy from.
    pub host: Vec<HostSlot>,
    /// Pages to copy to.
    pub device: Vec<DeviceSlot>,
}

/// A launched H2D batch.
struct LoadBatch {
    handle: LoadHandle,
    producer: usize,
    ids: Vec<LoadId>,
    pages: usize,
    started: Instant,
}

/// The device↔host copy pipelines of one cache: the transfer engine and its queues.
pub(crate) struct Copies {
    engine: TransferEngine,
    counter: Arc<LayerDoneCounter>,
    compute_stream: Option<Stream>,
    /// Without a host tier nothing is written: due nodes are dropped.
    enabled: bool,
    page_bytes: u64,
    /// Nodes due for write-through, launched as one D2H batch at the next poll.
    due: Vec<NodeId>,
    /// Exclusive tiering: due nodes that found no host room, retried at every poll while
    /// cold pages move to L3 (dropped once evicted or backed up; not awaited by a drain).
    waiting: Vec<NodeId>,
    /// Launched D2H batches, oldest first.
    writes: Fifo<WriteBatch>,
    /// Load-backs committed by admissions of this tick, launched by `start_loading`.
    queued_loads: Vec<QueuedLoad>,
    /// Launched H2D batches, oldest first.
    loads: Fifo<LoadBatch>,
    /// `launch_writes`' slot lists (device, host) of the batch it launches: empty between
    /// calls, kept so that a poll allocates no list for them.
    write_slots: (Vec<DeviceSlot>, Vec<HostSlot>),
}

impl Copies {
    /// Pipelines over `engine`, publishing loads to `counter`.
    pub fn new(
        engine: TransferEngine,
        counter: Arc<LayerDoneCounter>,
        enabled: bool,
        page_bytes: usize,
    ) -> Self {
        Self {
            engine,
            counter,
            compute_stream: None,
            enabled,
            page_bytes: page_bytes as u64,
            due: Vec::new(),
            waiting: Vec::new(),
            writes: Fifo::default(),
            queued_loads: Vec::new(),
            loads: Fifo::default(),
            write_slots: (Vec::new(), Vec::new()),
        }
    }

    /// The transfer engine.
    pub fn engine(&self) -> &TransferEngine {
        &self.engine
    }

    /// The counter loads are published to.
    pub fn counter(&self) -> &Arc<LayerDoneCounter> {
        &self.counter
    }

    /// Makes every D2H copy wait for the work queued so far on `stream`.
    pub fn set_compute_stream(&mut self, stream: Stream) {
        self.compute_stream = Some(stream);
    }

    /// Nodes that became due for write-through (launched at the next poll).
    pub fn queue_writes(&mut self, nodes: impl IntoIterator<Item = NodeId>) {
        self.due.extend(nodes);
    }

    /// A load-back the tree committed (launched by the next `start_loading`).
    pub fn queue_load(&mut self, load: QueuedLoad) {
        self.queued_loads.push(load);
    }

    /// Whether load-backs wait for `start_loading`.
    pub fn has_queued_loads(&self) -> bool {
        !self.queued_loads.is_empty()
    }

    /// Whether writes are due or in flight, or loads in flight.
    pub fn writing_or_loading(&self) -> bool {
        !self.due.is_empty() || !self.writes.is_empty() || !self.loads.is_empty()
    }

    /// Whether anything is due, queued or in flight.
    pub fn busy(&self) -> bool {
        self.writing_or_loading() || !self.queued_loads.is_empty()
    }

    /// D2H batches in flight.
    pub fn writes_in_flight(&self) -> usize {
        self.writes.len()
    }

    /// Loads queued or in flight.
    pub fn loads_pending(&self) -> usize {
        self.loads.len() + self.queued_loads.len()
    }

    fn after_compute(&self) -> Result<Option<Event>> {
        Ok(match &self.compute_stream {
            Some(s) => Some(s.record()?),
            None => None,
        })
    }

    /// Launches one D2H batch for every node due for write-through (invariant 1), after its
    /// ancestors that are not backed up (see [`with_unbacked_ancestors`]). Nodes evicted
    /// meanwhile, nodes for which no host memory can be found (after evicting host-only
    /// nodes) and nodes below those are skipped: they stay device-only, as in SGLang —
    /// except under exclusive tiering, where they wait for the room cold pages leaving for
    /// L3 make (the pages wanted are the tiers' shortfall). Returns the batches launched
    /// (0 or 1).
    #[tracing::instrument(skip_all, fields(nodes = self.due.len(), pages))]
    pub fn launch_writes(&mut self, tiers: &mut Tiers) -> Result<usize> {
        if !self.enabled {
            self.due.clear();
        }
        if self.due.is_empty() && self.waiting.is_empty() {
            return Ok(0);
        }
        let mut due = std::mem::take(&mut self.waiting);
        due.append(&mut self.due);
        // Transient host copies (buffer_only): ancestors were staged to L3 already, and a
        // node may be backed up below one that is not.
        let due = if tiers.tree.transient_host() {
            due
        } else {
            with_unbacked_ancestors(&tiers.tree, due)?
        };
        let (mut dev, mut host) = std::mem::take(&mut self.write_slots);
        let launched = self.plan_writes(due, tiers, &mut dev, &mut host);
        dev.clear();
        host.clear();
        self.write_slots = (dev, host);
        launched
    }

    /// `launch_writes`' body: commits the backup of each `due` node that finds host room,
    /// gathering the batch's slots in `dev` and `host`, and launches the batch.
    fn plan_writes(
        &mut self,
        due: Vec<NodeId>,
        tiers: &mut Tiers,
        dev: &mut Vec<DeviceSlot>,
        host: &mut Vec<HostSlot>,
    ) -> Result<usize> {
        let mut ids = Vec::new();
        for node in due {
            let plan = match tiers.tree.begin_backup(node) {
                Ok(Some(p)) => p,
                Ok(None) | Err(CoreError::StaleNode(_)) => continue,
                Err(e) => return Err(e.into()),
            };
            if tiers.tiering.buffer_only
                && tiers
                    .tiering
                    .known
                    .contains_all(tiers.tree.page_hashes(node)?)
            {
                // buffer_only: L3 has these pages already (the node lost its staging copy
                // and was hit again); staging them again would only be released.
                continue;
            }
            let Some(h) = tiers.alloc_host(plan.pages())? else {
                if tiers.tiering.exclusive {
                    tiers.tiering.shortfall += plan.pages();
                    if !self.waiting.contains(&node) {
                        self.waiting.push(node);
                    }
                    continue;
                }
                tracing::debug!(
                    pages = plan.pages(),
                    "host pool full: node stays device-only"
                );
                continue;
            };
            let id = tiers.tree.commit_backup(node, &h)?;
            dev.extend_from_slice(&plan.device_slots);
            host.extend(h);
            ids.push(id);
        }
        if ids.is_empty() {
            return Ok(0);
        }
        tracing::Span::current().record("pages", dev.len());
        let after = self.after_compute()?;
        let after = after.as_ref();
        let done = self.engine.backup(dev, host, after.as_slice())?;
        self.writes.push(WriteBatch {
            done,
            ids,
            pages: dev.len(),
            started: Instant::now(),
        });
        Ok(1)
    }

    /// Write-back eviction's staged nodes: copies them to host now (blocking, as SGLang's
    /// `writing_check(write_back=True)`), then frees their device pages and finishes the
    /// writes. Returns the finished backups (for L3).
    #[tracing::instrument(skip_all, fields(nodes = staged.len(), pages))]
    pub fn write_back_staged(
        &mut self,
        staged: Vec<StagedWriteBack>,
        tiers: &mut Tiers,
    ) -> Result<Vec<FinishedBackup>> {
        let mut dev = Vec::new();
        let mut host = Vec::new();
        for s in &staged {
            dev.extend_from_slice(&s.device_slots);
            host.extend_from_slice(&s.host_slots);
        }
        tracing::Span::current().record("pages", dev.len());
        let started = Instant::now();
        let after = self.after_compute()?;
        let after: Vec<&Event> = after.iter().collect();
        self.engine.backup(&dev, &host, &after)?.wait()?;
        tiers.free_device(&dev)?;
        let ids: Vec<WriteId> = staged.iter().map(|s| s.write_id).collect();
        self.writes_done(&ids, started, tiers)
    }

    /// Launches the H2D copies of every load-back queued since the last call as one batch,
    /// layer by layer with an event per layer, and publishes it to the layer counter.
    /// Returns the producer id, or `None` when nothing is to be loaded.
    #[tracing::instrument(skip_all, fields(pages))]
    pub fn start_loading(&mut self) -> Result<Option<usize>> {
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
        tracing::Span::current().record("pages", host.len());
        // The counter's ring reuses slots: make sure the load that last used the next slot
        // finished (a deeper overlap than the ring allows would otherwise be an error). That
        // is the load published `DEFAULT_DEPTH` launches ago; `loads` holds every launched
        // load not yet finished, in launch order (finished ones are done).
        let depth = LayerDoneCounter::DEFAULT_DEPTH;
        if let Some(i) = self.loads.len().checked_sub(depth) {
            self.loads[i].handle.wait()?;
        }
        let handle = self.engine.load(&host, &dev, &[])?;
        let producer = self.counter.publish(handle.clone())?;
        self.loads.push(LoadBatch {
            handle,
            producer,
            ids,
            pages: host.len(),
            started: Instant::now(),
        });
        Ok(Some(producer))
    }

    /// Finishes the oldest `n` write batches (the agreed count). Returns the finished
    /// backups (for L3).
    pub fn finish_writes(&mut self, n: usize, tiers: &mut Tiers) -> Result<Vec<FinishedBackup>> {
        let mut out = Vec::new();
        for _ in 0..n {
            let Some(batch) = self.writes.pop() else {
                break;
            };
            batch.done.wait()?;
            out.extend(self.writes_done(&batch.ids, batch.started, tiers)?);
        }
        Ok(out)
    }

    fn writes_done(
        &self,
        ids: &[WriteId],
        started: Instant,
        tiers: &mut Tiers,
    ) -> Result<Vec<FinishedBackup>> {
        let mut pages = 0u64;
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            let fin = tiers.tree.finish_backup(id)?;
            pages += fin.pages() as u64;
            out.push(fin);
        }
        tiers.metrics.transfer(
            Direction::d2h,
            pages,
            pages * self.page_bytes,
            started.elapsed().as_secs_f64(),
        );
        Ok(out)
    }

    /// Finishes the oldest `n` load batches (the agreed count): unlocks their nodes; under
    /// `buffer_only` releases the host copies of loaded pages known to be in L3.
    pub fn finish_loads(&mut self, n: usize, tiers: &mut Tiers) -> Result<()> {
        for _ in 0..n {
            let Some(batch) = self.loads.pop() else {
                break;
            };
            batch.handle.wait()?;
            for id in batch.ids {
                let node = tiers.tree.finish_load_back(id)?;
                if tiers.tiering.buffer_only {
                    // The pages are on device now: L2 only staged them.
                    tiers.release_loaded(node)?;
                }
            }
            tiers.metrics.transfer(
                Direction::h2d,
                batch.pages as u64,
                batch.pages as u64 * self.page_bytes,
                batch.started.elapsed().as_secs_f64(),
            );
            tracing::trace!(producer = batch.producer, "load batch finished");
        }
        Ok(())
    }

    /// Each launched D2H batch, oldest first: its pages and whether its copy completed.
    pub fn write_pages_in_flight(&self) -> Result<Vec<(usize, bool)>> {
        self.writes
            .iter()
            .map(|w| Ok((w.pages, w.done.is_done()?)))
            .collect()
    }

    /// Number of write batches, from the oldest, whose copies completed.
    pub fn ready_writes(&self) -> Result<usize> {
        self.writes.leading(|w| Ok(w.done.is_done()?))
    }

    /// Number of load batches, from the oldest, whose copies completed.
    pub fn ready_loads(&self) -> Result<usize> {
        self.loads.leading(|l| Ok(l.handle.is_done()?))
    }
}

/// The due nodes preceded (root-first, once each) by their ancestors that are on device
/// but not backed up. Backups are deferred to the next poll, so a due node may have been
/// split meanwhile (a match ending inside it): its upper part is a new node, not backed
/// up, with the same hit count, and the due node's own backup would be refused for its
/// parent (host residency stays prefix-closed). Backing up those ancestors first keeps
/// write-through complete.
fn with_unbacked_ancestors(tree: &HiRadixTree, due: Vec<NodeId>) -> Result<Vec<NodeId>> {
    let mut out = Vec::with_capacity(due.len());
    // Nodes already in `out`: a linear search while it is short (a tick's due nodes are a
    // few), a set past that; no allocation per poll in the common case.
    let mut seen: Option<HashSet<NodeId>> = None;
    let mut chain = Vec::new();
    for node in due {
        chain.clear();
        chain.push(node);
        let mut at = match tree.node_info(node) {
            Ok(info) => info.parent,
            Err(CoreError::StaleNode(_)) => None,
            Err(e) => return Err(e.into()),
        };
        while let Some(p) = at {
            let info = tree.node_info(p)?;
            if info.is_root || info.backed_up || !info.on_device {
                break;
            }
            chain.push(p);
            at = info.parent;
        }
        for &n in chain.iter().rev() {
            let new = match &mut seen {
                Some(set) => set.insert(n),
                None => !out.contains(&n),
            };
            if new {
                out.push(n);
                if seen.is_none() && out.len() > SEEN_LINEAR_MAX {
                    seen = Some(out.iter().copied().collect());
                }
            }
        }
    }
    Ok(out)
}

/// Most nodes [`with_unbacked_ancestors`] checks for repeats by a linear search.
const SEEN_LINEAR_MAX: usize = 32;
