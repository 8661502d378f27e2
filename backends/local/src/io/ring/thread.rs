//! The ring's own thread: it owns the `IoUring`, takes batches from callers, keeps up to
//! `queue_depth` requests in flight, continues short transfers, and sends each caller its
//! outcomes. The invariants are the [module's](super).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};

use io_uring::{IoUring, opcode, squeue, types};

use super::{Completion, Dir, Done, MAX_FIXED_FILES, Msg, Outcomes, Req, RingCounters, WAKE};

/// What [`setup`] made: the ring and whether the layouts' fixed-file slots exist.
pub(super) struct Setup {
    pub(super) ring: IoUring,
    pub(super) fixed_files: bool,
}

/// Builds the ring: room for `queue_depth` requests in flight, a fixed-file table of the
/// layouts' [`MAX_FIXED_FILES`] slots, and a worker pool as deep as the queue.
pub(super) fn setup(queue_depth: u32, fixed_files: bool) -> io::Result<Setup> {
    let entries = (queue_depth + 1).next_power_of_two().max(8);
    // At most `queue_depth` requests are in flight, each posting one completion.
    let cq = entries * 2;
    // Single issuer + deferred task work: completions are processed when this thread
    // waits for them, not by interrupting it. Older kernels refuse the flags: plain ring.
    let mut ring = match IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_cqsize(cq)
        .build(entries)
    {
        Ok(r) => r,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            IoUring::builder().setup_cqsize(cq).build(entries)?
        }
        Err(e) => return Err(e),
    };
    let table = match ring.submitter().register_files_sparse(MAX_FIXED_FILES) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(%e, "localio: no fixed-file table");
            false
        }
    };
    raise_workers(&mut ring, queue_depth);
    Ok(Setup {
        ring,
        fixed_files: fixed_files && table,
    })
}

/// Lets this (the driver's) thread's io_uring worker pool run `depth` workers: requests that
/// block (buffered writes with `RWF_DSYNC`) run on that pool, by default at most 4 per CPU. The pool exists once the
/// thread has submitted something, so a no-op goes first. Best effort: on failure the driver
/// is still correct, with fewer such requests in flight.
fn raise_workers(ring: &mut IoUring, depth: u32) {
    let nop = opcode::Nop::new().build().user_data(WAKE - 1);
    // SAFETY: a no-op request points at no memory; the new ring's queue is empty.
    if unsafe { ring.submission().push(&nop) }.is_err() {
        return;
    }
    if ring.submit_and_wait(1).is_err() {
        return;
    }
    ring.completion().for_each(drop);
    let mut workers = [depth.max(4), 0];
    if let Err(e) = ring.submitter().register_iowq_max_workers(&mut workers) {
        tracing::debug!(%e, "localio: io_uring worker limit unchanged");
    }
}

/// A transfer in flight (or queued), the bytes moved by earlier (short) completions of it,
/// and where its outcome goes.
struct Flight {
    req: Req,
    moved: usize,
    done: Done,
}

pub(super) struct Driver {
    pub(super) ring: IoUring,
    pub(super) rx: mpsc::Receiver<Msg>,
    pub(super) wake: File,
    pub(super) qd: usize,
    flights: Vec<Option<Flight>>,
    free: Vec<usize>,
    queue: VecDeque<Flight>,
    inflight: usize,
    wake_armed: bool,
    counters: Arc<RingCounters>,
}

impl Driver {
    pub(super) fn new(
        setup: Setup,
        rx: mpsc::Receiver<Msg>,
        wake: File,
        qd: usize,
        counters: Arc<RingCounters>,
    ) -> Self {
        Self {
            ring: setup.ring,
            rx,
            wake,
            qd,
            flights: Vec::new(),
            free: Vec::new(),
            queue: VecDeque::new(),
            inflight: 0,
            wake_armed: false,
            counters,
        }
    }

    pub(super) fn run(mut self) {
        loop {
            if self.inflight == 0 && self.queue.is_empty() {
                match self.rx.recv() {
                    Ok(m) => self.handle(m),
                    Err(_) => return,
                }
            }
            while let Ok(m) = self.rx.try_recv() {
                self.handle(m);
            }
            if !self.wake_armed {
                let e = opcode::PollAdd::new(types::Fd(self.wake.as_raw_fd()), libc::POLLIN as _)
                    .build()
                    .user_data(WAKE);
                if self.push(std::slice::from_ref(&e)) {
                    self.wake_armed = true;
                }
            }
            self.start_queued();
            // While requests wait for room, refill in groups of an eighth of the depth (fewer
            // wake-ups); otherwise report each completion as it comes.
            let want = if self.queue.is_empty() {
                usize::from(self.inflight > 0)
            } else {
                self.inflight.min((self.qd / 8).max(1))
            };
            self.counters.submits.fetch_add(1, Ordering::Relaxed);
            match self.ring.submit_and_wait(want) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
                    ) => {}
                Err(e) => {
                    // The ring itself failed: fail what is queued; what is in flight still
                    // completes (we keep reaping).
                    tracing::error!(error = %e, "localio: io_uring_enter failed");
                    for f in self.queue.drain(..) {
                        let err = io::Error::new(e.kind(), e.to_string());
                        let _ = f.done.send(vec![Completion {
                            tag: f.req.tag,
                            result: Err(err),
                        }]);
                    }
                }
            }
            self.reap();
        }
    }

    /// Puts queued requests in the ring while fewer than `qd` are in flight.
    fn start_queued(&mut self) {
        while self.inflight < self.qd {
            let Some(f) = self.queue.pop_front() else {
                break;
            };
            let id = match self.free.pop() {
                Some(id) => id,
                None => {
                    self.flights.push(None);
                    self.flights.len() - 1
                }
            };
            let e = f.req.sqe(id as u64);
            if !self.push(std::slice::from_ref(&e)) {
                self.free.push(id);
                self.queue.push_front(f);
                break;
            }
            self.flights[id] = Some(f);
            self.inflight += 1;
        }
    }

    /// Pushes `entries` as a unit, submitting first if the queue lacks room. Returns false if it still does.
    fn push(&mut self, entries: &[squeue::Entry]) -> bool {
        for _ in 0..2 {
            // SAFETY: every pointer an entry carries is kept valid until its completion is
            // reaped: caller buffers by invariant 1, iovec arrays by
            // invariant 2 (the request stays in `flights` until reaped), the eventfd
            // by `self.wake`.
            if unsafe { self.ring.submission().push_multiple(entries) }.is_ok() {
                return true;
            }
            let _ = self.ring.submit();
        }
        false
    }

    fn reap(&mut self) {
        let done: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        let mut out: Vec<(Done, Outcomes)> = Vec::new();
        for (ud, res) in done {
            if ud == WAKE {
                let mut b = [0u8; 8];
                let _ = (&self.wake).read(&mut b);
                self.wake_armed = false;
                continue;
            }
            if ud == WAKE - 1 {
                continue;
            }
            let id = ud as usize;
            let Some(f) = self.flights.get_mut(id).and_then(Option::take) else {
                continue;
            };
            self.free.push(id);
            self.inflight -= 1;
            let result = self.transfer_done(f.req, f.moved, res, &f.done);
            if let Some(r) = result {
                match out.iter_mut().find(|(d, _)| Arc::ptr_eq(d, &f.done)) {
                    Some((_, v)) => v.push(r),
                    None => out.push((f.done, vec![r])),
                }
            }
        }
        for (d, v) in out {
            let _ = d.send(v);
        }
    }

    /// A transfer's completion with `res`: its outcome, or `None` when the rest of a short
    /// transfer was queued again (it stays in flight under a new id).
    fn transfer_done(
        &mut self,
        mut req: Req,
        moved: usize,
        res: i32,
        done: &Done,
    ) -> Option<Completion> {
        let tag = req.tag;
        let outcome = |result| Some(Completion { tag, result });
        if res < 0 {
            let errno = -res;
            if errno == libc::EINTR || errno == libc::EAGAIN {
                self.requeue(req, moved, done);
                return None;
            }
            return outcome(Err(io::Error::from_raw_os_error(errno)));
        }
        let n = res as usize;
        let want = req.bytes();
        if n >= want {
            outcome(Ok(moved + n))
        } else if n == 0 && req.eof_ok && req.dir == Dir::Read {
            outcome(Ok(moved))
        } else if n == 0 {
            let e = match req.dir {
                Dir::Read => io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("read ended {want} bytes short (end of file)"),
                ),
                Dir::Write => io::Error::new(
                    io::ErrorKind::WriteZero,
                    format!("write stopped {want} bytes short"),
                ),
            };
            outcome(Err(e))
        } else {
            self.counters.short.fetch_add(1, Ordering::Relaxed);
            req.advance(n);
            self.requeue(req, moved + n, done);
            None
        }
    }

    fn requeue(&mut self, req: Req, moved: usize, done: &Done) {
        self.queue.push_front(Flight {
            req,
            moved,
            done: done.clone(),
        });
    }

    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Batch(reqs, done) => {
                self.queue.extend(reqs.into_iter().map(|req| Flight {
                    req,
                    moved: 0,
                    done: done.clone(),
                }));
            }
            Msg::RegisterBuffers(iovs, reply) => {
                // SAFETY: the iovecs describe the caller's registered region, which stays
                // mapped for the ring's life (the `register_memory` contract, invariant 3);
                // the kernel pins its pages.
                let r = unsafe { self.ring.submitter().register_buffers(&iovs) };
                let _ = reply.send(r);
            }
            Msg::RegisterFile(slot, fd, reply) => {
                let r = self
                    .ring
                    .submitter()
                    .register_files_update(slot, &[fd])
                    .map(drop);
                let _ = reply.send(r);
            }
        }
    }
}
