//! Group commit of the uring layout: the durability barrier of a batch (one `fdatasync` per
//! slab it wrote, its `put` records appended to the index log and synced) is merged with
//! those of the batches in flight beside it through
//! [`GroupCommit`](hicache_localio::GroupCommit): the group's leader syncs every slab any of
//! them wrote once, on a second thread while it appends every record in one write with one
//! log sync, and only when both ended are the pages of all of them made visible and
//! acknowledged. Run at once, the two syncs share the file system's journal commit and cache
//! flush (one after the other they paid one each: 256 KiB pages wrote at about half the
//! speed of the raw reference, see docs/benchmarks.md).
//!
//! # Invariants
//! 1. **Written before indexed, durable before visible** (the crate's invariant 1), for every
//!    page of the group: its record is appended only after its data writes completed; it is
//!    committed (visible, acknowledged) only if its slab sync and the log append and sync
//!    succeeded. A page whose slab sync failed is not committed, its slot is given back and a
//!    `del` for it rides on the next append (its record may already be in the log: until the
//!    `del` is, a restart reads the slot's checksum as a mismatch, never as that page); a page
//!    whose records were not appended is not committed and its slot is given back.
//! 2. **Sequence numbers in log order.** Records are numbered under the index lock while the
//!    leader holds the log, so a later record of a key always has the higher number.

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use hicache_localio::FsyncPolicy;
use hicache_storage::{PageKey, PageMeta};

use crate::format::{self, Put, Record};
use crate::index::{Entry, Loc};
use crate::slab::Slab;
use crate::{COMPACT_SLACK, UringBackend};

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
pub(crate) type GroupCommit = hicache_localio::GroupCommit<CommitItem, CommitResult>;

/// Syncs each distinct slab of `slabs` once; the slabs (by slot size) whose sync failed.
fn sync_each<'a>(slabs: impl Iterator<Item = &'a Arc<Slab>>) -> BTreeMap<u64, io::Error> {
    let mut distinct: BTreeMap<u64, &Arc<Slab>> = BTreeMap::new();
    for s in slabs {
        distinct.insert(s.slot_bytes, s);
    }
    let mut failed = BTreeMap::new();
    for (b, s) in distinct {
        if let Err(e) = hicache_localio::sys::sync_data(&s.file) {
            failed.insert(b, e);
        }
    }
    failed
}

fn copy_err(e: &io::Error) -> io::Error {
    io::Error::new(e.kind(), e.to_string())
}

impl UringBackend {
    /// Commits `item` in a group (see the module docs); returns each page's result.
    pub(crate) fn commit_group(&self, item: CommitItem) -> CommitResult {
        if item.puts.is_empty() && self.dels.lock().is_empty() {
            return Vec::new();
        }
        self.commit.run(item, |items| self.commit_items(items))
    }

    /// Every record of a group, in log order: the pending `del`s, then a `put` per page,
    /// numbered now (under the log lock the caller holds, so numbers follow log order); and
    /// each page's index entry.
    fn records_of(&self, items: &[CommitItem]) -> (Vec<[u8; format::RECORD_LEN]>, Vec<Entry>) {
        let mut ix = self.index.lock();
        let mut recs: Vec<[u8; format::RECORD_LEN]> =
            self.dels.lock().drain(..).map(|r| r.encode()).collect();
        let mut entries = Vec::new();
        for p in items.iter().flat_map(|i| &i.puts) {
            let e = Entry {
                loc: p.loc,
                meta: p.meta,
                sum: p.sum,
                seq: ix.next_seq(),
            };
            recs.push(
                Record::Put(Put {
                    seq: e.seq,
                    key: p.key,
                    meta: e.meta,
                    slot_bytes: p.slot_bytes,
                    slot: p.loc.slot as u64,
                    sum: e.sum,
                })
                .encode(),
            );
            entries.push(e);
        }
        (recs, entries)
    }

    /// The leader's work: the group's slab syncs (one per slab any of its batches wrote) and
    /// the append and sync of every record, at once; then visibility for the pages whose
    /// slab sync and records both succeeded.
    #[tracing::instrument(name = "uring.commit", skip_all, fields(batches = items.len(), pages))]
    fn commit_items(&self, items: Vec<CommitItem>) -> Vec<CommitResult> {
        tracing::Span::current().record("pages", items.iter().map(|i| i.puts.len()).sum::<usize>());
        let mut log = self.log.lock();
        let (recs, entries) = self.records_of(&items);
        let sync = self.opts.fsync.durable() && !entries.is_empty();
        // The slab syncs on a second thread while this one appends and syncs the log: the
        // two syncs then share the file system's journal commit and cache flush instead of
        // paying one each in a row.
        let (failed, appended) = std::thread::scope(|s| {
            let slabs = (self.opts.fsync == FsyncPolicy::Batch)
                .then(|| s.spawn(|| sync_each(items.iter().flat_map(|i| &i.slabs))));
            let appended = log.append(&recs, sync);
            let failed = match slabs {
                Some(h) => h.join().unwrap_or_else(|_| {
                    let mut all = BTreeMap::new();
                    for s in items.iter().flat_map(|i| &i.slabs) {
                        all.insert(s.slot_bytes, io::Error::other("slab sync panicked"));
                    }
                    all
                }),
                None => BTreeMap::new(),
            };
            (failed, appended)
        });
        let mut ix = self.index.lock();
        let mut out: Vec<CommitResult> = items.iter().map(|_| Vec::new()).collect();
        let mut undo = Vec::new();
        let mut k = 0;
        for (n, item) in items.iter().enumerate() {
            for p in &item.puts {
                let e = entries[k];
                k += 1;
                let r = match (&appended, failed.get(&p.slot_bytes)) {
                    (Err(err), _) => Err(io::Error::new(err.kind(), format!("index log: {err}"))),
                    (Ok(()), Some(err)) => {
                        // Its record is in the log but its data may not be durable: a `del`
                        // rides on the next append (until then a restart reads the slot's
                        // checksum as a mismatch, never as this page).
                        undo.push(Record::Del {
                            seq: ix.next_seq(),
                            key: p.key,
                        });
                        Err(copy_err(err))
                    }
                    (Ok(()), None) => Ok(()),
                };
                match r {
                    Ok(()) => {
                        ix.commit(p.key, e);
                        out[n].push((p.idx, Ok(())));
                    }
                    Err(err) => {
                        ix.abort(p.loc);
                        out[n].push((p.idx, Err(err)));
                    }
                }
            }
        }
        if !undo.is_empty() {
            self.dels.lock().extend(undo);
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
