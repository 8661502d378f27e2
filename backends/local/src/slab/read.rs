//! The read stage: a batch's pages are looked up and pinned (so their slots are not reused
//! while read), read through the ring, and each verified against its checksum as soon as
//! its last request completes; a damaged page is zeroed, dropped and counted.

use std::io;
use std::sync::Arc;

use crate::io::ring::{Dir, Req};
use hicache_storage::backend::bump;
use hicache_storage::checksum::{checksum, checksum_page_mut};
use hicache_storage::{Outcomes, PageBufMut, PageError, PageKey, PageOutcome};

use crate::slab::Slabs;
use crate::slab::format::Record;
use crate::slab::index::Entry;
use crate::slab::plan::Plan;
use crate::slab::slabfile::Slab;

/// The pages of a read batch in flight.
struct Reads {
    found: Vec<Option<Entry>>,
    plans: Vec<Option<Plan>>,
    /// Requests of each page still to complete.
    left: Vec<usize>,
    errors: Vec<Option<io::Error>>,
    /// Damaged pages to drop: key and version.
    corrupt: Vec<(PageKey, u64)>,
}

impl Slabs {
    /// `batch_get` on the calling (blocking) thread: pins the pages' slots, plans and runs
    /// the reads, verifies each page.
    pub(crate) fn read_slots(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
        out: &mut Outcomes,
    ) {
        let n = keys.len();
        let found = self.lookup(keys, dst, out);
        let slabs: Vec<Arc<Slab>> = self.slabs.read().clone();
        let mut r = Reads {
            found,
            plans: (0..n).map(|_| None).collect(),
            left: vec![0; n],
            errors: (0..n).map(|_| None).collect(),
            corrupt: Vec::new(),
        };
        let mut reqs = Vec::new();
        for (i, d) in dst.iter_mut().enumerate() {
            let Some(e) = r.found[i] else { continue };
            let slab = &slabs[e.loc.class as usize];
            let parts: Vec<(usize, usize)> = d
                .parts_mut()
                .iter_mut()
                .map(|p| (p.as_mut_ptr() as usize, p.len()))
                .collect();
            let offset = e.loc.slot as u64 * slab.slot_bytes;
            let mut plan = self.plan(Dir::Read, i, slab, offset, &parts, false);
            r.left[i] = plan.reqs.len();
            reqs.append(&mut plan.reqs);
            r.plans[i] = Some(plan);
        }
        self.read_and_verify(keys, dst, reqs, &mut r, out);
        for p in r.plans.iter_mut().flatten() {
            if let Some(b) = p.bounce.take() {
                self.pool.put(b);
            }
        }
        self.release(&r);
    }

    /// Finds and pins each key's entry; misses and metadata mismatches get their outcome.
    fn lookup(
        &self,
        keys: &[PageKey],
        dst: &[PageBufMut<'_>],
        out: &mut Outcomes,
    ) -> Vec<Option<Entry>> {
        let mut found = vec![None; keys.len()];
        let mut expired = false;
        let mut ix = self.core.index.lock();
        for (i, (k, d)) in keys.iter().zip(dst.iter()).enumerate() {
            match ix.get(k).copied() {
                None => out.set(i, PageOutcome::Miss),
                Some(e) if self.is_expired(e.written) => {
                    // Expired (`ttl_s`): a miss; the reclaim thread deletes it.
                    expired = true;
                    out.set(i, PageOutcome::Miss);
                }
                Some(e) if e.meta != d.meta() => {
                    bump(&self.core.counters.meta_mismatches, 1);
                    out.set(i, PageOutcome::Miss);
                }
                Some(e) => {
                    ix.touch(k);
                    ix.pin(e.loc);
                    found[i] = Some(e);
                }
            }
        }
        drop(ix);
        if expired {
            self.wake_reclaimer();
        }
        found
    }

    /// Runs the read requests, verifying each page when its last request completes.
    fn read_and_verify(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
        reqs: Vec<Req>,
        r: &mut Reads,
        out: &mut Outcomes,
    ) {
        let mut pending = self.engine.submit(reqs);
        if let Some((_, why)) = pending.not_submitted() {
            for i in 0..keys.len() {
                if r.found[i].is_some() {
                    r.left[i] = 0;
                    out.set(
                        i,
                        PageOutcome::Failed(PageError::Io {
                            op: "read",
                            detail: why.clone(),
                        }),
                    );
                }
            }
        }
        while let Some((i, res)) = pending.wait_next() {
            if let Err(e) = res
                && r.errors[i].is_none()
            {
                r.errors[i] = Some(e);
            }
            r.left[i] -= 1;
            if r.left[i] == 0 {
                let o = self.verify(&keys[i], &mut dst[i], r, i);
                out.set(i, o);
            }
        }
    }

    /// The outcome of page `i` once all its requests completed.
    fn verify(
        &self,
        key: &PageKey,
        d: &mut PageBufMut<'_>,
        r: &mut Reads,
        i: usize,
    ) -> PageOutcome {
        let e = r.found[i].expect("requests only for found pages");
        match r.errors[i].take() {
            Some(err) if err.kind() == io::ErrorKind::UnexpectedEof => {
                tracing::warn!(key = %key, error = %err, "uring backend: slot cut short");
                d.zero();
                r.corrupt.push((*key, e.seq));
                PageOutcome::Corrupt
            }
            Some(err) => {
                tracing::warn!(key = %key, error = %err, "uring backend: read failed");
                PageOutcome::Failed(PageError::io("read", &err))
            }
            None => {
                let ok = match r.plans[i].as_ref().and_then(|p| p.bounce.as_ref()) {
                    Some(b) => {
                        let ok = checksum(&b[..e.meta.len]) == e.sum;
                        if ok {
                            d.copy_from(&b[..e.meta.len]);
                        }
                        ok
                    }
                    None => checksum_page_mut(d) == e.sum,
                };
                if ok {
                    PageOutcome::Hit
                } else {
                    tracing::warn!(key = %key, "uring backend: checksum mismatch, page dropped");
                    d.zero();
                    r.corrupt.push((*key, e.seq));
                    PageOutcome::Corrupt
                }
            }
        }
    }

    /// Unpins the batch's pages and drops the damaged ones (their `del` records ride on the
    /// next append).
    fn release(&self, r: &Reads) {
        let mut ix = self.core.index.lock();
        for e in r.found.iter().flatten() {
            ix.unpin(e.loc);
        }
        if !r.corrupt.is_empty() {
            let mut dels = self.dels.lock();
            for &(k, seq) in &r.corrupt {
                if ix.remove_version(&k, seq).is_some() {
                    dels.push(Record::Del {
                        seq: ix.next_seq(),
                        key: k,
                    });
                }
            }
        }
    }
}
