//! Group commit of the uring layout: the durability barrier of a batch (one `fdatasync` per
//! slab it wrote, then its `put` records appended to the index log and synced) is merged
//! with those of the batches in flight beside it through
//! [`GroupCommit`](crate::io::GroupCommit): the group's leader syncs every slab any of
//! them wrote once, appends every record in one write with one log sync, and only then are
//! the pages of all of them made visible and acknowledged.
//!
//! # Invariants
//! 1. **Data before index, index before visibility** (the crate's invariant 1), for every
//!    page of the group: a page whose slab sync failed gets no record; a page whose records
//!    were not appended (and synced, unless `fsync: none`) is not committed and its slot is
//!    given back.
//! 2. **Sequence numbers in log order.** Records are numbered under the index lock while the
//!    leader holds the log, so a later record of a key always has the higher number.

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::io::FsyncPolicy;
use hicache_storage::{PageKey, PageMeta};

use crate::slab::format::{self, Put, Record};
use crate::slab::index::{Entry, Loc};
use crate::slab::slabfile::Slab;
use crate::slab::{COMPACT_SLACK, Slabs};

/// A page whose data is written, waiting for its commit.
#[derive(Clone, Debug)]
pub(crate) struct PendingPut {
    /// Its index in its batch.
    pub(crate) idx: usize,
    pub(crate) key: PageKey,
    pub(crate) loc: Loc,
    pub(crate) meta: PageMeta,
    pub(crate) sum: u64,
    pub(crate) slot_bytes: u64,
}

/// One batch's share of a commit group.
#[derive(Default)]
pub(crate) struct CommitItem {
    /// The slabs it wrote (synced under `fsync: batch`).
    pub(crate) slabs: Vec<Arc<Slab>>,
    /// Its pages.
    pub(crate) puts: Vec<PendingPut>,
}

/// Per page of an item (its batch index): committed, or why not.
pub(crate) type CommitResult = Vec<(usize, io::Result<()>)>;

/// The group commit of one backend.
pub(crate) type GroupCommit = crate::io::GroupCommit<CommitItem, CommitResult>;

fn copy_err(e: &io::Error) -> io::Error {
    io::Error::new(e.kind(), e.to_string())
}

impl Slabs {
    /// Commits `item` in a group (see the module docs); returns each page's result.
    pub(crate) fn commit_group(&self, item: CommitItem) -> CommitResult {
        if item.puts.is_empty() && self.dels.lock().is_empty() {
            return Vec::new();
        }
        self.commit.run(item, |items| self.commit_items(items))
    }

    /// The leader's work: one sync per slab of the group, one append and sync of every
    /// record, then visibility.
    #[tracing::instrument(name = "uring.commit", skip_all, fields(batches = items.len(), pages))]
    fn commit_items(&self, items: Vec<CommitItem>) -> Vec<CommitResult> {
        tracing::Span::current().record("pages", items.iter().map(|i| i.puts.len()).sum::<usize>());
        // Data durability (batch): each slab any batch of the group wrote, once.
        let mut failed: BTreeMap<u64, io::Error> = BTreeMap::new();
        if self.opts.fsync == FsyncPolicy::Batch {
            let mut slabs: BTreeMap<u64, &Arc<Slab>> = BTreeMap::new();
            for s in items.iter().flat_map(|i| &i.slabs) {
                slabs.insert(s.slot_bytes, s);
            }
            for (b, s) in slabs {
                if let Err(e) = crate::io::sys::sync_data(&s.file) {
                    failed.insert(b, e);
                }
            }
        }
        let mut log = self.log.lock();
        let mut ix = self.core.index.lock();
        let mut recs: Vec<[u8; format::RECORD_LEN]> =
            self.dels.lock().drain(..).map(|r| r.encode()).collect();
        let mut entries: Vec<(usize, usize, Entry)> = Vec::new();
        let written = self.now_secs();
        let mut out: Vec<CommitResult> = items.iter().map(|_| Vec::new()).collect();
        for (n, item) in items.iter().enumerate() {
            for p in &item.puts {
                if let Some(e) = failed.get(&p.slot_bytes) {
                    ix.abort(p.loc);
                    out[n].push((p.idx, Err(copy_err(e))));
                    continue;
                }
                let e = Entry {
                    loc: p.loc,
                    meta: p.meta,
                    sum: p.sum,
                    seq: ix.next_seq(),
                    written,
                };
                recs.push(
                    Record::Put(Put {
                        seq: e.seq,
                        key: p.key,
                        meta: e.meta,
                        slot_bytes: p.slot_bytes,
                        slot: p.loc.slot as u64,
                        sum: e.sum,
                        written: e.written,
                    })
                    .encode(),
                );
                entries.push((n, entries.len(), e));
            }
        }
        let sync = self.opts.fsync.durable() && !entries.is_empty();
        let appended = log.append(&recs, sync);
        let mut k = 0;
        for (n, item) in items.iter().enumerate() {
            for p in &item.puts {
                if failed.contains_key(&p.slot_bytes) {
                    continue;
                }
                let (_, _, e) = entries[k];
                k += 1;
                match &appended {
                    Ok(()) => {
                        ix.commit(p.key, e);
                        out[n].push((p.idx, Ok(())));
                    }
                    Err(err) => {
                        ix.abort(p.loc);
                        out[n].push((
                            p.idx,
                            Err(io::Error::new(err.kind(), format!("index log: {err}"))),
                        ));
                    }
                }
            }
        }
        if let Err(e) = &appended {
            tracing::warn!(error = %e, "uring backend: index log append failed");
        }
        if log.records() > 2 * ix.len() as u64 + COMPACT_SLACK {
            match log.compact(&Self::live_puts(&ix)) {
                Ok(()) => {
                    self.compactions.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => tracing::warn!(error = %e, "uring backend: log compaction failed"),
            }
        }
        out
    }
}
