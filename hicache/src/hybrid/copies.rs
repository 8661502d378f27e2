//! [`Copies`]: the device↔host copies in flight, oldest first, and the nodes waiting for
//! write-through. Each entry holds the tree's id of its committed transfer; the tree keeps
//! the node locked until [`HybridCache::poll`](super::HybridCache::poll) finishes it.

use hicache_core::{BackupId, NodeId, UnifiedLoadId};
use hicache_gpu::{Completion, LoadHandle};

use crate::agree::{Fifo, leading};
use crate::error::Result;

/// One copy launched on a stream, finished when its event has fired.
#[derive(Clone, Debug)]
pub(crate) enum Launched {
    /// A device → host copy, or a device-to-device state copy.
    Done(Completion),
    /// A host → device load, one event per layer.
    Load(LoadHandle),
}

impl Launched {
    /// Whether the copy has landed (never blocks).
    pub fn is_done(&self) -> Result<bool> {
        Ok(match self {
            Launched::Done(c) => c.is_done()?,
            Launched::Load(l) => l.is_done()?,
        })
    }

    /// Blocks until the copy has landed.
    pub fn wait(&self) -> Result<()> {
        match self {
            Launched::Done(c) => c.wait()?,
            Launched::Load(l) => l.wait()?,
        }
        Ok(())
    }
}

/// A committed write-through backup and its copies (one per component that had data).
#[derive(Debug)]
pub(crate) struct Backup {
    pub id: BackupId,
    /// Its L3 backup, run once the copy finished (with L3 attached).
    pub l3: Option<super::l3::L3Job>,
    pub copies: Vec<Launched>,
}

/// A committed load-back, the batch it belongs to and its copies.
#[derive(Debug)]
pub(crate) struct Load {
    pub id: UnifiedLoadId,
    pub batch: usize,
    pub copies: Vec<Launched>,
}

/// Copies in flight (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Copies {
    /// Backups, oldest first.
    pub backups: Fifo<Backup>,
    /// Load-backs, oldest first.
    pub loads: Fifo<Load>,
    /// Copy-on-write state copies (nothing to finish in the tree; kept until landed).
    pub cows: Vec<(usize, Launched)>,
    /// Inserted nodes to back up at the next poll.
    pub writes: Vec<(NodeId, Vec<u32>)>,
    /// The load batch being filled (closed by `start_loading`).
    pub batch: usize,
    /// Whether the open batch has any copy.
    pub batch_used: bool,
}

/// Whether every copy of a list has landed.
fn all_done(copies: &[Launched]) -> Result<bool> {
    Ok(leading(copies, Launched::is_done)? == copies.len())
}

impl Copies {
    /// Records a committed load-back in the open batch.
    pub fn add_load(&mut self, id: UnifiedLoadId, copies: Vec<Launched>) {
        self.batch_used = true;
        self.loads.push(Load {
            id,
            batch: self.batch,
            copies,
        });
    }

    /// Records a copy-on-write state copy in the open batch.
    pub fn add_cow(&mut self, copy: Launched) {
        self.batch_used = true;
        self.cows.push((self.batch, copy));
    }

    /// Queues `node` (the end of `tokens`, the inserted sequence) for write-through.
    pub fn queue_write(&mut self, node: NodeId, tokens: Vec<u32>) {
        if !self.writes.iter().any(|(n, _)| *n == node) {
            self.writes.push((node, tokens));
        }
    }

    /// Closes the open batch: its id, or `None` when it has no copy.
    pub fn close_batch(&mut self) -> Option<usize> {
        if !self.batch_used {
            return None;
        }
        let id = self.batch;
        self.batch += 1;
        self.batch_used = false;
        Some(id)
    }

    /// Blocks until every copy of batch `batch` has landed. Errors: a batch never handed out.
    pub fn wait_batch(&self, batch: usize) -> Result<()> {
        if batch >= self.batch {
            return Err(crate::error::HiCacheError::BadArgument(format!(
                "load batch {batch} was never started"
            )));
        }
        let loads = self.loads.iter().filter(|l| l.batch == batch);
        for c in loads.flat_map(|l| &l.copies) {
            c.wait()?;
        }
        for (_, c) in self.cows.iter().filter(|(b, _)| *b == batch) {
            c.wait()?;
        }
        Ok(())
    }

    /// Blocks until every backup and load-back copy has landed.
    pub fn wait_all(&self) -> Result<()> {
        let backups = self.backups.iter().flat_map(|b| &b.copies);
        for c in backups.chain(self.loads.iter().flat_map(|l| &l.copies)) {
            c.wait()?;
        }
        Ok(())
    }

    /// Leading backups whose copies have landed.
    pub fn backups_done(&self) -> Result<usize> {
        self.backups.leading(|b| all_done(&b.copies))
    }

    /// Leading load-backs whose copies have landed.
    pub fn loads_done(&self) -> Result<usize> {
        self.loads.leading(|l| all_done(&l.copies))
    }

    /// Forgets the copy-on-write copies that have landed.
    pub fn prune_cows(&mut self) -> Result<()> {
        let mut keep = Vec::new();
        for (b, c) in self.cows.drain(..) {
            if !c.is_done()? {
                keep.push((b, c));
            }
        }
        self.cows = keep;
        Ok(())
    }
}
