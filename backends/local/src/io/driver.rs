//! [`Driver`]: how a batch of transfers is issued, behind one trait: the io_uring [`Ring`]
//! or the [`Threads`] fallback (blocking `preadv`/`pwritev` on a few scoped threads), with
//! the same request type ([`Req`]) and the same outcomes, so a layout is written once.
//!
//! # Invariants
//! 1. **Same outcome either way.** A request succeeds only when all its bytes moved (short
//!    transfers are continued); a read marked `eof_ok` reports the bytes it read up to the
//!    end of the file, any other read stopped by the end of the file fails with
//!    `UnexpectedEof`; a write with `dsync` is durable when it succeeds.
//! 2. **Buffers outlive their requests.** [`Driver::run`] returns only after every request it
//!    was given has completed, so the memory the requests point into (borrowed by the caller
//!    for the call) is never used after the call.

use std::fs::File;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;

use crate::io::par::par_map;
use crate::io::ring::{Dir, Req, Ring};
use crate::io::sys;

/// A way to run a batch of transfers. See the [module docs](self).
pub trait Driver: Send + Sync + std::fmt::Debug {
    /// `"uring"` or `"threads"`.
    fn name(&self) -> &'static str;

    /// Runs `reqs`, calling `done(tag, outcome)` on the calling thread for each request as it
    /// completes (the outcome is the number of bytes moved). Returns when all have completed.
    fn run(&self, reqs: Vec<Req>, done: &mut dyn FnMut(usize, io::Result<usize>));
}

impl Driver for Ring {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn run(&self, reqs: Vec<Req>, done: &mut dyn FnMut(usize, io::Result<usize>)) {
        let tags: Vec<usize> = reqs.iter().map(|r| r.tag).collect();
        let mut pending = self.submit(reqs);
        if let Some((_, why)) = pending.not_submitted() {
            for t in tags {
                done(t, Err(io::Error::other(why.clone())));
            }
            return;
        }
        while let Some((tag, r)) = pending.wait_next() {
            done(tag, r);
        }
    }
}

/// The thread-pool fallback: each request is one blocking positioned vectored call (looped
/// over short transfers) on one of up to `threads` scoped threads.
#[derive(Debug)]
pub struct Threads {
    threads: usize,
}

impl Threads {
    /// A driver running up to `threads` requests at once.
    pub fn new(threads: usize) -> Self {
        Self {
            threads: threads.max(1),
        }
    }
}

/// A `Send` wrapper of a request for the scoped threads.
struct Job(Req);

// SAFETY: see `Req`'s `Send` impl; the threads are scoped, so they end before `run` returns
// (invariant 2).
unsafe impl Send for Job {}

fn run_one(r: &Req) -> io::Result<usize> {
    // SAFETY: the caller's descriptor stays open for the call (it outlives `run`); the
    // `ManuallyDrop` never closes it.
    let file = ManuallyDrop::new(unsafe { File::from_raw_fd(r.file.fd) });
    let want: usize = r.iov.iter().map(|v| v.iov_len).sum();
    match r.dir {
        Dir::Write => {
            // SAFETY: the iovecs describe memory the caller keeps readable until `run`
            // returns (invariant 2).
            unsafe {
                crate::io::journal::write_iov(r.file.fd, r.offset, &r.iov);
                sys::pwritev_raw(&file, &r.iov, r.offset)?;
            }
            if r.dsync {
                file.sync_data()?;
                crate::io::journal::sync(r.file.fd, Some((r.offset, want as u64)));
            }
            Ok(want)
        }
        Dir::Read => {
            // SAFETY: the iovecs describe memory the caller keeps writable, and untouched by
            // others, until `run` returns (invariant 2).
            let n = unsafe { sys::preadv_raw(&file, &r.iov, r.offset)? };
            if n < want && !r.eof_ok {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("read ended {} bytes short (end of file)", want - n),
                ));
            }
            Ok(n)
        }
    }
}

impl Driver for Threads {
    fn name(&self) -> &'static str {
        "threads"
    }

    #[tracing::instrument(name = "localio.threads", skip_all, fields(reqs = reqs.len()))]
    fn run(&self, reqs: Vec<Req>, done: &mut dyn FnMut(usize, io::Result<usize>)) {
        let jobs: Vec<Job> = reqs.into_iter().map(Job).collect();
        for (tag, r) in par_map(self.threads, jobs, |j| (j.0.tag, run_one(&j.0))) {
            done(tag, r);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;
    use crate::io::ring::FileRef;

    fn iov(p: *mut u8, l: usize) -> libc::iovec {
        libc::iovec {
            iov_base: p.cast(),
            iov_len: l,
        }
    }

    /// Both drivers: a write then reads, one of them past the end of the file, with and
    /// without `eof_ok`.
    #[test]
    fn both_drivers_give_the_same_outcomes() {
        let drivers: Vec<Box<dyn Driver>> = vec![
            Box::new(Ring::new(8, false).unwrap()),
            Box::new(Threads::new(3)),
        ];
        for d in drivers {
            let dir = tempfile::tempdir().unwrap();
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.path().join("f"))
                .unwrap();
            let file = FileRef {
                fd: f.as_raw_fd(),
                fixed: None,
            };
            let mut src = vec![9u8; 6000];
            let req = |dir, iov, eof_ok, tag| Req {
                dir,
                file,
                offset: 0,
                iov,
                fixed_buf: None,
                dsync: true,
                eof_ok,
                tag,
            };
            let mut out = Vec::new();
            d.run(
                vec![req(Dir::Write, vec![iov(src.as_mut_ptr(), 6000)], false, 0)],
                &mut |t, r| out.push((t, r.unwrap())),
            );
            assert_eq!(out, vec![(0, 6000)], "{}", d.name());
            let mut a = vec![0u8; 8192];
            let mut b = vec![0u8; 8192];
            let mut res: Vec<Option<io::Result<usize>>> = vec![None, None];
            d.run(
                vec![
                    req(Dir::Read, vec![iov(a.as_mut_ptr(), 8192)], true, 0),
                    req(Dir::Read, vec![iov(b.as_mut_ptr(), 8192)], false, 1),
                ],
                &mut |t, r| res[t] = Some(r),
            );
            assert_eq!(res[0].take().unwrap().unwrap(), 6000, "{}", d.name());
            let e = res[1].take().unwrap().unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{}", d.name());
            assert!(a[..6000].iter().all(|x| *x == 9));
        }
    }
}
