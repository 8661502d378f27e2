//! The write stage: a batch is classified, its pages get slots, their bytes go through the
//! ring, and the batch joins a commit group (see [`commit`](crate::slab::commit)) that makes the
//! data and the index records durable for several concurrent batches at once before any of
//! their pages is acknowledged.

use std::io;
use std::sync::Arc;

use crate::io::FsyncPolicy;
use crate::io::ring::{Dir, Req};
use hicache_storage::backend::bump;
use hicache_storage::checksum::checksum_page;
use hicache_storage::{PageBuf, PageError, PageKey, PageOutcome, SetBatch};

use crate::slab::Slabs;
use crate::slab::commit::{CommitItem, PendingPut};
use crate::slab::format::{Record, slot_bytes};
use crate::slab::index::{Loc, ReserveError};
use crate::slab::plan::Plan;
use crate::slab::slabfile::{Disk, Slab};

impl Slabs {
    /// `batch_set` on the calling (blocking) thread.
    pub(crate) fn set_blocking(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Vec<PageOutcome> {
        let mut batch = {
            let mut ix = self.core.index.lock();
            SetBatch::classify(
                keys,
                src,
                |len| (slot_bytes(len) > self.core.capacity).then(|| self.max_page_bytes()),
                |k, meta| {
                    // An expired page (`ttl_s`) is rewritten (with a new write time).
                    let same = ix
                        .get(k)
                        .is_some_and(|e| e.meta == meta && !self.is_expired(e.written));
                    if same {
                        ix.touch(k);
                    }
                    same
                },
            )
        };
        let locs = self.reserve_slots(src, &mut batch);
        let slabs: Vec<Arc<Slab>> = self.slabs.read().clone();
        let (results, sums) = self.write_data(src, &slabs, &locs);
        // Pages whose data write failed give their slots back; the rest are committed.
        let mut item = CommitItem::default();
        {
            let mut ix = self.core.index.lock();
            for (i, r) in results.into_iter().enumerate() {
                let Some(loc) = locs[i] else { continue };
                match r {
                    Ok(()) => item.puts.push(PendingPut {
                        idx: i,
                        key: keys[i],
                        loc,
                        meta: src[i].meta(),
                        sum: sums[i],
                        slot_bytes: slabs[loc.class as usize].slot_bytes,
                    }),
                    Err(e) => {
                        ix.abort(loc);
                        tracing::warn!(key = %keys[i], error = %e, "uring backend: page write failed");
                        batch.outcomes.set(i, write_failed(&e));
                    }
                }
            }
        }
        item.slabs = item
            .puts
            .iter()
            .map(|p| p.loc.class)
            .collect::<std::collections::BTreeSet<u16>>()
            .into_iter()
            .map(|c| slabs[c as usize].clone())
            .collect();
        for (i, r) in self.commit_group(item) {
            batch.outcomes.set(
                i,
                match r {
                    Ok(()) => PageOutcome::Stored,
                    Err(e) => write_failed(&e),
                },
            );
        }
        batch.finish()
    }

    /// Gives each page to write a slot of its size class (creating slabs as needed, evicting
    /// as the capacity requires); pages that get none have their outcome set.
    fn reserve_slots(&self, src: &[PageBuf<'_>], batch: &mut SetBatch) -> Vec<Option<Loc>> {
        let mut locs: Vec<Option<Loc>> = vec![None; src.len()];
        let mut classes: Vec<(usize, u16)> = Vec::with_capacity(batch.todo.len());
        for &i in &batch.todo {
            match self.class_of(slot_bytes(src[i].len())) {
                Ok(c) => classes.push((i, c)),
                Err(e) => batch
                    .outcomes
                    .set(i, PageOutcome::Failed(PageError::Backend(e.to_string()))),
            }
        }
        let slabs: Vec<Arc<Slab>> = self.slabs.read().clone();
        let mut evicted = Vec::new();
        let mut ix = self.core.index.lock();
        for &(i, class) in &classes {
            match ix.reserve(class, &Disk(&slabs), &mut evicted) {
                Ok(loc) => locs[i] = Some(loc),
                Err(ReserveError::NoSpace) => {
                    batch
                        .outcomes
                        .set(i, PageOutcome::Failed(PageError::NoSpace));
                }
                Err(ReserveError::Io(e)) => {
                    batch
                        .outcomes
                        .set(i, PageOutcome::Failed(PageError::io("grow slab", &e)));
                }
            }
        }
        if !evicted.is_empty() {
            bump(&self.core.counters.evicted_pages, evicted.len() as u64);
            bump(
                &self.core.counters.evicted_bytes,
                evicted.iter().map(|(_, e)| e.meta.len as u64).sum(),
            );
            let mut dels = self.dels.lock();
            for (key, _) in evicted {
                dels.push(Record::Del {
                    seq: ix.next_seq(),
                    key,
                });
            }
        }
        locs
    }

    /// Writes the pages that have slots through the ring (with `RWF_DSYNC` under `always`),
    /// checksumming them while the writes run. Returns each page's write result and checksum.
    fn write_data(
        &self,
        src: &[PageBuf<'_>],
        slabs: &[Arc<Slab>],
        locs: &[Option<Loc>],
    ) -> (Vec<io::Result<()>>, Vec<u64>) {
        let n = src.len();
        let dsync = self.opts.fsync == FsyncPolicy::Always;
        let mut plans: Vec<(usize, Plan)> = Vec::new();
        for (i, loc) in locs.iter().enumerate() {
            let Some(loc) = loc else { continue };
            let slab = &slabs[loc.class as usize];
            let parts: Vec<(usize, usize)> = src[i]
                .parts()
                .iter()
                .map(|p| (p.as_ptr() as usize, p.len()))
                .collect();
            let offset = loc.slot as u64 * slab.slot_bytes;
            let mut plan = self.plan(Dir::Write, i, slab, offset, &parts, dsync);
            if let Some(b) = &mut plan.bounce {
                let mut off = 0;
                for p in src[i].parts() {
                    b[off..off + p.len()].copy_from_slice(p);
                    off += p.len();
                }
                b[off..].fill(0);
            }
            plans.push((i, plan));
        }
        let mut results: Vec<io::Result<()>> = (0..n).map(|_| Ok(())).collect();
        let mut sums = vec![0u64; n];
        let reqs: Vec<Req> = plans
            .iter_mut()
            .flat_map(|(_, p)| std::mem::take(&mut p.reqs))
            .collect();
        // The checksums are computed on this thread while the ring's thread runs the writes
        // (after them on the threads engine).
        let mut pending = self.engine.submit(reqs);
        for (i, _) in &plans {
            sums[*i] = checksum_page(&src[*i]);
        }
        if let Some((_, why)) = pending.not_submitted() {
            for (i, _) in &plans {
                results[*i] = Err(io::Error::other(why.clone()));
            }
        }
        while let Some((tag, r)) = pending.wait_next() {
            if let Err(e) = r
                && results[tag].is_ok()
            {
                results[tag] = Err(e);
            }
        }
        drop(pending);
        for (_, p) in plans {
            if let Some(b) = p.bounce {
                self.pool.put(b);
            }
        }
        (results, sums)
    }
}

/// The outcome of a page whose write (or commit) failed with `e`.
fn write_failed(e: &io::Error) -> PageOutcome {
    PageOutcome::Failed(PageError::Io {
        op: "write",
        detail: e.to_string(),
    })
}
