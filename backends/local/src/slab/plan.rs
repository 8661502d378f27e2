//! Transfer plans: the requests that move one page between the caller's memory and its slot
//! (fixed buffers when registered, vectored when aligned, a bounce buffer otherwise).

use std::sync::atomic::Ordering;

use crate::io::ring::{CHUNK, Dir, IOV_MAX, Req, segments};
use crate::io::{AlignedBuf, Ring};

use crate::slab::Slabs;
use crate::slab::format::{ALIGN, slot_bytes};
use crate::slab::slabfile::Slab;

fn aligned(addr: usize, len: usize) -> bool {
    addr.is_multiple_of(ALIGN) && len.is_multiple_of(ALIGN)
}

/// A page's transfer plan: the requests, and the bounce buffer when its memory is unaligned.
pub(crate) struct Plan {
    pub(crate) reqs: Vec<Req>,
    pub(crate) bounce: Option<AlignedBuf>,
}

impl Slabs {
    /// Builds the requests moving one page between `parts` (in order) and the slot at
    /// `offset` of `slab`. Aligned parts go directly (fixed buffers when registered);
    /// otherwise a bounce buffer of the slot's size is used (for writes, filled here).
    pub(crate) fn plan(
        &self,
        dir: Dir,
        tag: usize,
        slab: &Slab,
        offset: u64,
        parts: &[(usize, usize)],
        dsync: bool,
    ) -> Plan {
        let file = slab.file_ref();
        let req = |offset: u64, iov: Vec<libc::iovec>, fixed_buf: Option<u16>| Req {
            dir,
            file,
            offset,
            iov,
            fixed_buf,
            dsync,
            eof_ok: false,
            tag,
        };
        let iov = |a: usize, l: usize| libc::iovec {
            iov_base: a as *mut libc::c_void,
            iov_len: l,
        };
        let mut reqs = Vec::new();
        if parts.iter().all(|&(a, l)| aligned(a, l)) {
            let reg = self.engine.ring().and_then(Ring::registered);
            if let Some(r) = reg.filter(|r| {
                parts
                    .iter()
                    .all(|&(a, l)| a >= r.base && a + l <= r.base + r.len)
            }) {
                let mut off = offset;
                for &(a, l) in parts {
                    for (sa, sl) in segments(a, l, r.base) {
                        reqs.push(req(off, vec![iov(sa, sl)], r.fixed_index(sa, sl)));
                        off += sl as u64;
                    }
                }
            } else {
                let mut off = offset;
                let mut cur: Vec<libc::iovec> = Vec::new();
                let mut cur_len = 0usize;
                for &(a, l) in parts {
                    for (sa, sl) in segments(a, l, a) {
                        if cur.len() == IOV_MAX || cur_len + sl > CHUNK {
                            reqs.push(req(off, std::mem::take(&mut cur), None));
                            off += cur_len as u64;
                            cur_len = 0;
                        }
                        cur.push(iov(sa, sl));
                        cur_len += sl;
                    }
                }
                if !cur.is_empty() {
                    reqs.push(req(off, cur, None));
                }
            }
            return Plan { reqs, bounce: None };
        }
        self.bounced.fetch_add(1, Ordering::Relaxed);
        let len: usize = parts.iter().map(|p| p.1).sum();
        let mut b = self.pool.get(slot_bytes(len) as usize);
        let base = b.as_mut_ptr() as usize;
        let mut off = offset;
        for (sa, sl) in segments(base, b.len(), base) {
            reqs.push(req(off, vec![iov(sa, sl)], None));
            off += sl as u64;
        }
        Plan {
            reqs,
            bounce: Some(b),
        }
    }
}
