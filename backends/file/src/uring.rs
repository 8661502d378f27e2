//! The io_uring engine: a batch's page files are opened, written or read, synced and renamed
//! through one ring, with up to `queue_depth` pages in flight and a few system calls per batch
//! instead of several per page and a thread per request.
//!
//! Each page is one chain of linked requests on a fixed-file slot of its own:
//!
//! ```text
//! read:  openat(slot) -> readv(slot: header + page)                        then close(slot)
//! write: openat(slot, O_CREAT|O_EXCL) -> fallocate -> writev(header + page)
//!        -> fdatasync (fsync batch|always) -> renameat(temp -> final)
//!        -> fsync(directory) (fsync always)                                then close(slot)
//! ```
//!
//! # Invariants
//! 1. **Buffers outlive their requests.** Every path, iovec array, header buffer, staging
//!    buffer and caller page an in-flight request points to belongs to (or is borrowed by) the
//!    batch's jobs, which outlive the [`Flight`] that submits them; a `Flight` returns, errs or
//!    unwinds only after every request it submitted has completed (its `Drop` waits for them,
//!    and aborts the process if the ring cannot tell it, rather than free memory the kernel may
//!    still write).
//! 2. **One slot, one page.** A page's requests use only its own fixed-file slot; the slot
//!    returns to the free list after the page's close completed (or its open failed), so
//!    requests of different pages never share a file.
//! 3. **Visible only when complete.** A write's rename is linked after its preallocation, its
//!    data write and (unless `fsync: none`) its data sync: it runs only if all of them
//!    succeeded in full (a short write breaks the link), as in the blocking path.
//! 4. **Nothing guessed.** A short read or write, or a preallocation the file system does not
//!    support, is redone by the blocking per-page path ([`Outcome::Redo`]); every other
//!    request error is that page's outcome. A ring that failed is not reused.

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;

use hicache_core::PageKey;
use io_uring::{IoUring, opcode, squeue, types};
use parking_lot::Mutex;

use crate::pageio::{IoCtx, ReadIo, ReadResult, WriteIo};

/// Request kinds, the low bits of a request's `user_data` (the job index is the rest).
const OPEN: u8 = 0;
const FALLOCATE: u8 = 1;
const WRITE: u8 = 2;
const DATASYNC: u8 = 3;
const RENAME: u8 = 4;
const DIRSYNC: u8 = 5;
const READ: u8 = 6;
const CLOSE: u8 = 7;
const KINDS: usize = 8;
/// The most requests one page's chain takes (a write under `fsync: always`).
const MAX_CHAIN: usize = 6;

fn user_data(job: usize, kind: u8) -> u64 {
    ((job as u64) << 3) | u64::from(kind)
}

fn errno(res: i32) -> io::Error {
    io::Error::from_raw_os_error(-res)
}

/// What the ring did with one page.
#[derive(Debug)]
pub enum Outcome<T> {
    /// Finished; the result.
    Done(T),
    /// Not finished through the ring (short transfer, unsupported preallocation, or a ring
    /// failure): redo it with the blocking path.
    Redo,
}

/// A ring and the free fixed-file slots of its table.
struct Ring {
    ring: IoUring,
    free: Vec<u32>,
}

/// The io_uring engine of one backend: a pool of rings, one per concurrent batch.
pub struct Uring {
    depth: u32,
    /// Threads that verify a batch's reads.
    verifiers: usize,
    idle: Mutex<Vec<Ring>>,
}

impl std::fmt::Debug for Uring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Uring")
            .field("depth", &self.depth)
            .finish_non_exhaustive()
    }
}

/// Idle rings kept for later batches.
const KEEP_IDLE: usize = 8;

impl Uring {
    /// An engine with `depth` pages in flight per batch, verifying reads on up to
    /// `verifiers` threads. Fails if the kernel (or a seccomp policy) refuses io_uring or a
    /// request kind this engine needs.
    pub fn new(depth: usize, verifiers: usize) -> io::Result<Self> {
        let u = Self {
            depth: depth.clamp(1, 1024) as u32,
            verifiers: verifiers.max(1),
            idle: Mutex::new(Vec::new()),
        };
        let ring = u.new_ring()?;
        let mut probe = io_uring::Probe::new();
        ring.ring.submitter().register_probe(&mut probe)?;
        for (name, code) in [
            ("openat", opcode::OpenAt::CODE),
            ("fallocate", opcode::Fallocate::CODE),
            ("writev", opcode::Writev::CODE),
            ("readv", opcode::Readv::CODE),
            ("fsync", opcode::Fsync::CODE),
            ("renameat", opcode::RenameAt::CODE),
            ("close", opcode::Close::CODE),
        ] {
            if !probe.is_supported(code) {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("io_uring lacks {name}"),
                ));
            }
        }
        u.give(ring);
        Ok(u)
    }

    fn new_ring(&self) -> io::Result<Ring> {
        // Room for every request of `depth` pages at once (chains and closes), queued and
        // completed, so neither queue ever has to wait for space.
        let sq = (self.depth as usize * (MAX_CHAIN + 1)).next_power_of_two() as u32;
        let ring = IoUring::builder().setup_cqsize(sq * 2).build(sq)?;
        ring.submitter().register_files_sparse(self.depth)?;
        Ok(Ring {
            ring,
            free: (0..self.depth).rev().collect(),
        })
    }

    fn take(&self) -> io::Result<Ring> {
        match self.idle.lock().pop() {
            Some(r) => Ok(r),
            None => self.new_ring(),
        }
    }

    fn give(&self, ring: Ring) {
        let mut idle = self.idle.lock();
        if idle.len() < KEEP_IDLE {
            idle.push(ring);
        }
    }

    /// Lets the calling thread's io_uring worker pool run one worker per page in flight.
    ///
    /// A page's chain starts with an open (and a write's has a preallocation, syncs and a
    /// rename): requests that block, so the kernel runs each chain on a worker of the
    /// *submitting thread's* pool, by default at most 4 per CPU (8 on a 2-core machine, which
    /// caps a batch at 8 pages in flight whatever `queue_depth` says). The limit is a property
    /// of that thread's pool, which exists only once the thread has submitted something, so
    /// it is raised per thread: a no-op first, then the limit, once per thread.
    fn raise_workers(&self, ring: &mut Ring) -> io::Result<()> {
        thread_local! {
            /// The worker limit this thread's io_uring pool has been given.
            static LIMIT: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
        }
        if LIMIT.get() >= self.depth {
            return Ok(());
        }
        LIMIT.set(self.depth);
        let nop = opcode::Nop::new().build().user_data(u64::MAX);
        // SAFETY: a no-op request points at no memory. The ring is idle (every flight ends
        // with nothing queued or in flight), so its queue has room.
        unsafe { ring.ring.submission().push(&nop) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        loop {
            match ring.ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        // Only the no-op can be waiting here; reap it so the next flight starts clean.
        let reaped = ring.ring.completion().count();
        debug_assert_eq!(reaped, 1);
        let mut workers = [self.depth, 0];
        ring.ring
            .submitter()
            .register_iowq_max_workers(&mut workers)?;
        Ok(())
    }

    /// Runs the jobs of `ops` through a ring. On a ring failure the jobs not finished are
    /// reported by `ops` as to be redone.
    fn run(&self, ops: &mut dyn Chains) {
        let mut ring = match self.take() {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%e, "file backend: no io_uring ring; using blocking I/O");
                return;
            }
        };
        if let Err(e) = self.raise_workers(&mut ring) {
            // Still correct, with fewer pages in flight. The no-op may still be queued or in
            // flight (it points at no memory): use a fresh ring.
            tracing::debug!(%e, "file backend: io_uring worker limit unchanged");
            ring = match self.new_ring() {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(%e, "file backend: no io_uring ring; using blocking I/O");
                    return;
                }
            };
        }
        let clean = {
            let mut flight = Flight {
                ring: &mut ring,
                inflight: 0,
            };
            match flight.run(ops) {
                Ok(clean) => clean,
                Err(e) => {
                    tracing::warn!(%e, "file backend: io_uring batch failed; redoing its pages");
                    false
                }
            }
        };
        if clean {
            self.give(ring);
        }
    }

    /// Reads `jobs` (each a page file into its destination); results in job order.
    ///
    /// The pages are verified (checksums) after the flight on up to `verifiers` threads: the
    /// ring's completions arrive on one thread, and checksumming a batch there would make
    /// one core's share of the CPU the limit (measured: 256 KiB cold reads at about 0.6 of
    /// the threads engine on this 2-core machine under load).
    pub fn read(&self, jobs: &mut [ReadJob<'_, '_, '_>]) -> Vec<Outcome<ReadResult>> {
        let mut ops = ReadOps { jobs };
        self.run(&mut ops);
        crate::par::par_map(
            self.verifiers,
            ops.jobs.iter_mut().collect(),
            ReadJob::outcome,
        )
    }

    /// Writes and commits `jobs` (each a page to a temp file renamed to its final name);
    /// results in job order.
    pub fn write(&self, jobs: &mut [WriteJob<'_>]) -> Vec<Outcome<Result<(), WriteError>>> {
        let mut ops = WriteOps { jobs };
        self.run(&mut ops);
        ops.jobs.iter_mut().map(WriteJob::outcome).collect()
    }
}

/// The per-page request chains of a batch, as [`Flight`] drives them.
trait Chains {
    /// Number of pages.
    fn len(&self) -> usize;
    /// Appends page `job`'s linked chain on fixed slot `slot` to `out` (user data set).
    fn chain(&mut self, job: usize, slot: u32, out: &mut Vec<squeue::Entry>);
    /// Records the completion of request `kind` of page `job`.
    fn complete(&mut self, job: usize, kind: u8, res: i32);
}

/// Where a page stands in a [`Flight`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Stage {
    Waiting,
    /// Its chain is in flight: `left` completions to come; `opened` once its open succeeded.
    Chain {
        slot: u32,
        left: usize,
        opened: bool,
    },
    Closing {
        slot: u32,
    },
    Done,
}

/// One batch on one ring. See the module's invariant 1.
struct Flight<'r> {
    ring: &'r mut Ring,
    /// Requests pushed and not yet completed.
    inflight: usize,
}

impl Flight<'_> {
    /// Drives every page of `ops` to the end. Returns whether the ring is fit for reuse
    /// (every slot closed).
    fn run(&mut self, ops: &mut dyn Chains) -> io::Result<bool> {
        let n = ops.len();
        let mut stage = vec![Stage::Waiting; n];
        let mut next = 0;
        let mut done = 0;
        let mut clean = true;
        let mut entries = Vec::with_capacity(MAX_CHAIN);
        let mut cqes: Vec<(u64, i32)> = Vec::new();
        while done < n {
            while next < n {
                let Some(slot) = self.ring.free.pop() else {
                    break;
                };
                entries.clear();
                ops.chain(next, slot, &mut entries);
                self.push(&entries)?;
                stage[next] = Stage::Chain {
                    slot,
                    left: entries.len(),
                    opened: false,
                };
                next += 1;
            }
            self.submit_and_wait(1)?;
            cqes.clear();
            cqes.extend(
                self.ring
                    .ring
                    .completion()
                    .map(|c| (c.user_data(), c.result())),
            );
            self.inflight -= cqes.len();
            for &(ud, res) in &cqes {
                let job = (ud >> 3) as usize;
                let kind = (ud & 7) as u8;
                let Some(&st) = stage.get(job) else {
                    return Err(io::Error::other(format!(
                        "io_uring: completion of unknown request {ud:#x}"
                    )));
                };
                match (st, kind) {
                    (Stage::Closing { slot }, CLOSE) => {
                        if res < 0 {
                            // The slot may still hold the file: never hand it out again.
                            tracing::warn!(err = %errno(res), "file backend: io_uring close failed");
                            clean = false;
                        } else {
                            self.ring.free.push(slot);
                        }
                        stage[job] = Stage::Done;
                        done += 1;
                    }
                    (Stage::Chain { slot, left, opened }, _) => {
                        ops.complete(job, kind, res);
                        let opened = opened || (kind == OPEN && res >= 0);
                        if left > 1 {
                            stage[job] = Stage::Chain {
                                slot,
                                left: left - 1,
                                opened,
                            };
                        } else if opened {
                            let close = opcode::Close::new(types::Fixed(slot))
                                .build()
                                .user_data(user_data(job, CLOSE));
                            self.push(std::slice::from_ref(&close))?;
                            stage[job] = Stage::Closing { slot };
                        } else {
                            self.ring.free.push(slot);
                            stage[job] = Stage::Done;
                            done += 1;
                        }
                    }
                    (s, k) => {
                        return Err(io::Error::other(format!(
                            "io_uring: unexpected completion of request {k} of page {job} in stage {s:?}"
                        )));
                    }
                }
            }
        }
        Ok(clean)
    }

    /// Queues `entries` (one page's chain, or one close) as a unit, submitting what is queued
    /// first if the submission queue lacks room.
    fn push(&mut self, entries: &[squeue::Entry]) -> io::Result<()> {
        for attempt in 0..2 {
            // SAFETY: the entries point into jobs that outlive this flight, which waits for
            // their completion before it ends (invariant 1); their slots are theirs alone.
            let pushed = unsafe { self.ring.ring.submission().push_multiple(entries) };
            if pushed.is_ok() {
                self.inflight += entries.len();
                return Ok(());
            }
            if attempt == 0 {
                self.submit_and_wait(0)?;
            }
        }
        // Not reached with the queue sized for every request of `depth` pages at once.
        Err(io::Error::other("io_uring submission queue full"))
    }

    /// Submits what is queued and waits for `want` completions, riding out interruptions
    /// and transient refusals.
    fn submit_and_wait(&mut self, want: usize) -> io::Result<()> {
        loop {
            match self.ring.ring.submit_and_wait(want) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e)
                    if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN))
                        && !self.ring.ring.completion().is_empty() =>
                {
                    // Completions are waiting to be read; the caller reads them next.
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        // Invariant 1: never let the jobs' memory go while the kernel may still use it.
        while self.inflight > 0 {
            match self.ring.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN)) => {}
                Err(e) => {
                    eprintln!(
                        "hicache-backend-file: io_uring failed with requests in flight ({e}); \
                         aborting rather than freeing their buffers"
                    );
                    std::process::abort();
                }
            }
            let reaped = self.ring.ring.completion().count();
            self.inflight = self.inflight.saturating_sub(reaped);
        }
    }
}

/// One page file to read through the ring.
pub struct ReadJob<'d, 'b, 'k> {
    path: CString,
    key: &'k PageKey,
    io: Option<ReadIo<'d, 'b>>,
    ctx: IoCtx<'k>,
    res: [Option<i32>; KINDS],
}

impl<'d, 'b, 'k> ReadJob<'d, 'b, 'k> {
    /// A read of the page file `path` of `key` into `io`'s destination.
    pub fn new(path: CString, key: &'k PageKey, io: ReadIo<'d, 'b>, ctx: IoCtx<'k>) -> Self {
        Self {
            path,
            key,
            io: Some(io),
            ctx,
            res: [None; KINDS],
        }
    }

    /// Verifies what the ring read (or asks for a redo). Called after the flight, when none
    /// of the job's buffers is in use by the kernel any more.
    fn outcome(&mut self) -> Outcome<ReadResult> {
        let Some(io) = self.io.take() else {
            return Outcome::Redo;
        };
        match (self.res[OPEN as usize], self.res[READ as usize]) {
            (Some(r), _) if r == -libc::ENOENT => Outcome::Done(ReadResult::Missing),
            (Some(r), _) if r < 0 => Outcome::Done(ReadResult::Io(errno(r))),
            (Some(_), Some(r)) if r < 0 => Outcome::Done(ReadResult::Io(errno(r))),
            (Some(_), Some(n)) if n as usize == io.total() => {
                Outcome::Done(io.finish(Ok(n as usize), self.key, self.ctx.bufs))
            }
            // A short read (perhaps a truncated file, perhaps not): the blocking path decides.
            _ => Outcome::Redo,
        }
    }
}

struct ReadOps<'j, 'd, 'b, 'k> {
    jobs: &'j mut [ReadJob<'d, 'b, 'k>],
}

impl Chains for ReadOps<'_, '_, '_, '_> {
    fn len(&self) -> usize {
        self.jobs.len()
    }

    fn chain(&mut self, job: usize, slot: u32, out: &mut Vec<squeue::Entry>) {
        let j = &self.jobs[job];
        let io =
            j.io.as_ref()
                .expect("a read job holds its buffers until it ends");
        let direct = if io.direct { libc::O_DIRECT } else { 0 };
        let iov = io.iovecs();
        out.push(
            opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), j.path.as_ptr())
                .flags(libc::O_RDONLY | direct)
                .file_index(Some(slot_of(slot)))
                .build()
                .flags(squeue::Flags::IO_LINK)
                .user_data(user_data(job, OPEN)),
        );
        out.push(
            opcode::Readv::new(types::Fixed(slot), iov.as_ptr(), iov.len() as u32)
                .offset(0)
                .build()
                .user_data(user_data(job, READ)),
        );
    }

    fn complete(&mut self, job: usize, kind: u8, res: i32) {
        self.jobs[job].res[kind as usize] = Some(res);
    }
}

fn slot_of(slot: u32) -> types::DestinationSlot {
    types::DestinationSlot::try_from_slot_target(slot).expect("slot below the table size")
}

/// Why a page write through the ring failed, and at which step.
#[derive(Debug)]
pub struct WriteError {
    /// `"write"` (create, preallocate, write, data sync), `"rename"` or `"sync directory"`.
    pub op: &'static str,
    /// The error.
    pub err: io::Error,
}

/// One page to write through the ring: its file bytes, its temp and final names.
pub struct WriteJob<'a> {
    tmp: CString,
    fin: CString,
    io: Option<WriteIo<'a>>,
    datasync: bool,
    dir: Option<RawFd>,
    res: [Option<i32>; KINDS],
}

impl<'a> WriteJob<'a> {
    /// A write of `io` to the fresh temp file `tmp`, synced if `datasync`, renamed to `fin`,
    /// and, given `dir` (an open directory fd that outlives the write), the directory synced.
    pub fn new(
        io: WriteIo<'a>,
        tmp: CString,
        fin: CString,
        datasync: bool,
        dir: Option<RawFd>,
    ) -> Self {
        Self {
            tmp,
            fin,
            io: Some(io),
            datasync,
            dir,
            res: [None; KINDS],
        }
    }

    /// The page's bytes, handed back (to return its staging buffer).
    pub fn take_io(&mut self) -> Option<WriteIo<'a>> {
        self.io.take()
    }

    fn outcome(&mut self) -> Outcome<Result<(), WriteError>> {
        let total = self.io.as_ref().map_or(0, WriteIo::total);
        let steps: &[(u8, &'static str)] = &[
            (OPEN, "write"),
            (FALLOCATE, "write"),
            (WRITE, "write"),
            (DATASYNC, "write"),
            (RENAME, "rename"),
            (DIRSYNC, "sync directory"),
        ];
        for &(kind, op) in steps {
            let Some(r) = self.res[kind as usize] else {
                if (kind == DATASYNC && !self.datasync) || (kind == DIRSYNC && self.dir.is_none()) {
                    continue;
                }
                // Never completed: the ring failed under it.
                return Outcome::Redo;
            };
            if kind == FALLOCATE && matches!(-r, libc::EOPNOTSUPP | libc::ENOSYS) {
                return Outcome::Redo;
            }
            if kind == WRITE && r >= 0 && (r as usize) < total {
                return Outcome::Redo;
            }
            if r < 0 {
                return Outcome::Done(Err(WriteError { op, err: errno(r) }));
            }
        }
        Outcome::Done(Ok(()))
    }
}

struct WriteOps<'j, 'a> {
    jobs: &'j mut [WriteJob<'a>],
}

impl Chains for WriteOps<'_, '_> {
    fn len(&self) -> usize {
        self.jobs.len()
    }

    fn chain(&mut self, job: usize, slot: u32, out: &mut Vec<squeue::Entry>) {
        let j = &self.jobs[job];
        let io =
            j.io.as_ref()
                .expect("a write job holds its page until it ends");
        let direct = if io.direct { libc::O_DIRECT } else { 0 };
        let iov = io.iovecs();
        let file = types::Fixed(slot);
        let link = squeue::Flags::IO_LINK;
        out.push(
            opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), j.tmp.as_ptr())
                .flags(libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | direct)
                .mode(0o666)
                .file_index(Some(slot_of(slot)))
                .build()
                .flags(link)
                .user_data(user_data(job, OPEN)),
        );
        out.push(
            opcode::Fallocate::new(file, io.file_len)
                .build()
                .flags(link)
                .user_data(user_data(job, FALLOCATE)),
        );
        out.push(
            opcode::Writev::new(file, iov.as_ptr(), iov.len() as u32)
                .offset(0)
                .build()
                .flags(link)
                .user_data(user_data(job, WRITE)),
        );
        if j.datasync {
            out.push(
                opcode::Fsync::new(file)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build()
                    .flags(link)
                    .user_data(user_data(job, DATASYNC)),
            );
        }
        let rename = opcode::RenameAt::new(
            types::Fd(libc::AT_FDCWD),
            j.tmp.as_ptr(),
            types::Fd(libc::AT_FDCWD),
            j.fin.as_ptr(),
        )
        .build()
        .user_data(user_data(job, RENAME));
        match j.dir {
            Some(dir) => {
                out.push(rename.flags(link));
                out.push(
                    opcode::Fsync::new(types::Fd(dir))
                        .build()
                        .user_data(user_data(job, DIRSYNC)),
                );
            }
            None => out.push(rename),
        }
    }

    fn complete(&mut self, job: usize, kind: u8, res: i32) {
        self.jobs[job].res[kind as usize] = Some(res);
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use hicache_core::{LayoutKind, NamespaceId, PageHash};
    use hicache_storage::{PageBuf, PageBufMut};
    use memmap2::MmapMut;

    use super::*;
    use crate::sys::{self, BufPool};

    fn key(i: u8) -> PageKey {
        PageKey::new(NamespaceId([7; 16]), PageHash([i; 32]))
    }

    /// Page-aligned memory holding `pages` pages of `len` bytes, page `i` filled from `i`.
    fn pages(n: usize, len: usize) -> MmapMut {
        let mut m = MmapMut::map_anon(n * len).unwrap();
        for (i, c) in m.chunks_mut(len).enumerate() {
            for (j, b) in c.iter_mut().enumerate() {
                *b = (i * 131 + j * 7 % 253) as u8;
            }
        }
        m
    }

    fn cpath(p: &Path) -> CString {
        sys::cpath(p).unwrap()
    }

    /// Writes page `i` of `src` (split into `len`-byte pages) as `dir/<i>.page` through `u`.
    fn write_all(
        u: &Uring,
        ctx: IoCtx<'_>,
        dir: &Path,
        src: &[PageBuf<'_>],
    ) -> Vec<Outcome<Result<(), WriteError>>> {
        let keys: Vec<PageKey> = (0..src.len()).map(|i| key(i as u8)).collect();
        let mut jobs: Vec<WriteJob<'_>> = src
            .iter()
            .enumerate()
            .map(|(i, p)| {
                WriteJob::new(
                    WriteIo::new(ctx, &keys[i], p).unwrap(),
                    cpath(&dir.join(format!("{i}.tmp"))),
                    cpath(&dir.join(format!("{i}.page"))),
                    true,
                    None,
                )
            })
            .collect();
        let out = u.write(&mut jobs);
        for j in &mut jobs {
            j.take_io().unwrap().release(ctx.bufs);
        }
        out
    }

    /// Writes `src`, cut into `len`-byte pages, with [`write_all`] and asserts every page was
    /// written.
    fn write_pages_ok(u: &Uring, ctx: IoCtx<'_>, dir: &Path, src: &[u8], len: usize) {
        let p: Vec<PageBuf<'_>> = src
            .chunks(len)
            .map(|c| PageBuf::contiguous(LayoutKind::PageFirst, c))
            .collect();
        for o in write_all(u, ctx, dir, &p) {
            assert!(matches!(o, Outcome::Done(Ok(()))), "{o:?}");
        }
    }

    fn read_all(
        u: &Uring,
        ctx: IoCtx<'_>,
        dir: &Path,
        dst: &mut [PageBufMut<'_>],
    ) -> Vec<Outcome<ReadResult>> {
        let keys: Vec<PageKey> = (0..dst.len()).map(|i| key(i as u8)).collect();
        let mut jobs: Vec<ReadJob<'_, '_, '_>> = dst
            .iter_mut()
            .enumerate()
            .map(|(i, d)| {
                ReadJob::new(
                    cpath(&dir.join(format!("{i}.page"))),
                    &keys[i],
                    ReadIo::new(ctx, d).unwrap(),
                    ctx,
                )
            })
            .collect();
        u.read(&mut jobs)
    }

    fn idle_slots(u: &Uring) -> Vec<usize> {
        u.idle.lock().iter().map(|r| r.free.len()).collect()
    }

    #[test]
    fn the_worker_limit_is_raised_once_per_thread_and_leaves_the_ring_clean() {
        let u = Uring::new(16, 2).unwrap();
        std::thread::spawn(move || {
            let mut ring = u.take().unwrap();
            u.raise_workers(&mut ring).unwrap();
            assert!(ring.ring.completion().is_empty());
            // Once per thread: the second call submits nothing.
            u.raise_workers(&mut ring).unwrap();
            assert!(ring.ring.submission().is_empty());
            u.give(ring);
            let dir = tempfile::tempdir().unwrap();
            let bufs = BufPool::new(2);
            let ctx = IoCtx {
                direct: false,
                bufs: &bufs,
            };
            write_pages_ok(&u, ctx, dir.path(), &pages(3, 4096), 4096);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn many_pages_through_few_slots_with_o_direct() {
        let dir = tempfile::tempdir().unwrap();
        let bufs = BufPool::new(4);
        let ctx = IoCtx {
            direct: true,
            bufs: &bufs,
        };
        let u = Uring::new(4, 2).unwrap();
        let len = 12_288;
        let src = pages(40, len);
        write_pages_ok(&u, ctx, dir.path(), &src, len);
        assert!(!dir.path().join("0.tmp").exists(), "temp files are renamed");
        // Three more destinations than pages: their files do not exist.
        let mut back = pages(43, len);
        back.fill(0);
        let mut dst: Vec<PageBufMut<'_>> = back
            .chunks_mut(len)
            .map(|c| PageBufMut::contiguous(LayoutKind::PageFirst, c))
            .collect();
        let out = read_all(&u, ctx, dir.path(), &mut dst);
        for (i, o) in out.iter().enumerate() {
            if i < 40 {
                assert!(matches!(o, Outcome::Done(ReadResult::Hit)), "{i}: {o:?}");
            } else {
                assert!(
                    matches!(o, Outcome::Done(ReadResult::Missing)),
                    "{i}: {o:?}"
                );
            }
        }
        drop(dst);
        assert_eq!(&back[..40 * len], &src[..]);
        assert_eq!(
            idle_slots(&u),
            vec![4],
            "every slot closed and the ring reused"
        );
    }

    #[test]
    fn failed_requests_are_reported_and_free_their_slots() {
        let dir = tempfile::tempdir().unwrap();
        let bufs = BufPool::new(4);
        let ctx = IoCtx {
            direct: false,
            bufs: &bufs,
        };
        let u = Uring::new(2, 2).unwrap();
        let len = 5000;
        let src = pages(3, len);
        let p: Vec<PageBuf<'_>> = src
            .chunks(len)
            .map(|c| PageBuf::contiguous(LayoutKind::LayerFirst, c))
            .collect();
        // Page 0: its temp name is taken (the exclusive create fails). Page 1: the final
        // directory does not exist (the rename fails). Page 2: fine.
        std::fs::write(dir.path().join("0.tmp"), b"someone else's").unwrap();
        let keys = [key(0), key(1), key(2)];
        let names = [
            (dir.path().join("0.tmp"), dir.path().join("0.page")),
            (dir.path().join("1.tmp"), dir.path().join("nowhere/1.page")),
            (dir.path().join("2.tmp"), dir.path().join("2.page")),
        ];
        let mut jobs: Vec<WriteJob<'_>> = (0..3)
            .map(|i| {
                WriteJob::new(
                    WriteIo::new(ctx, &keys[i], &p[i]).unwrap(),
                    cpath(&names[i].0),
                    cpath(&names[i].1),
                    false,
                    None,
                )
            })
            .collect();
        let out = u.write(&mut jobs);
        match &out[0] {
            Outcome::Done(Err(e)) => {
                assert_eq!(e.op, "write");
                assert_eq!(e.err.kind(), io::ErrorKind::AlreadyExists);
            }
            o => panic!("{o:?}"),
        }
        match &out[1] {
            Outcome::Done(Err(e)) => assert_eq!(e.op, "rename"),
            o => panic!("{o:?}"),
        }
        assert!(matches!(out[2], Outcome::Done(Ok(()))), "{:?}", out[2]);
        assert!(
            dir.path().join("1.tmp").exists(),
            "an unrenamed temp stays for the caller"
        );
        assert_eq!(idle_slots(&u), vec![2]);
        // The ring still works.
        let mut back = vec![0u8; len];
        let mut dst = [PageBufMut::contiguous(LayoutKind::LayerFirst, &mut back)];
        let mut r = [ReadJob::new(
            cpath(&dir.path().join("2.page")),
            &keys[2],
            ReadIo::new(ctx, &mut dst[0]).unwrap(),
            ctx,
        )];
        assert!(matches!(
            u.read(&mut r).pop(),
            Some(Outcome::Done(ReadResult::Hit))
        ));
        drop(r);
        drop(dst);
        assert_eq!(&back[..], &src[2 * len..]);
    }

    #[test]
    fn short_reads_are_handed_back_and_damage_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let bufs = BufPool::new(4);
        let ctx = IoCtx {
            direct: false,
            bufs: &bufs,
        };
        let u = Uring::new(8, 2).unwrap();
        let len = 4096;
        let src = pages(4, len);
        write_pages_ok(&u, ctx, dir.path(), &src, len);
        // 0: truncated; 1: empty; 2: a data byte flipped; 3: intact.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("0.page"))
            .unwrap();
        f.set_len(5000).unwrap();
        std::fs::write(dir.path().join("1.page"), b"").unwrap();
        let mut bytes = std::fs::read(dir.path().join("2.page")).unwrap();
        bytes[crate::format::HEADER_LEN + 9] ^= 1;
        std::fs::write(dir.path().join("2.page"), &bytes).unwrap();
        let mut back = pages(4, len);
        let mut dst: Vec<PageBufMut<'_>> = back
            .chunks_mut(len)
            .map(|c| PageBufMut::contiguous(LayoutKind::PageFirst, c))
            .collect();
        let out = read_all(&u, ctx, dir.path(), &mut dst);
        assert!(matches!(out[0], Outcome::Redo), "{:?}", out[0]);
        assert!(matches!(out[1], Outcome::Redo), "{:?}", out[1]);
        assert!(
            matches!(&out[2], Outcome::Done(ReadResult::Corrupt(w)) if w.contains("checksum")),
            "{:?}",
            out[2]
        );
        assert!(
            matches!(out[3], Outcome::Done(ReadResult::Hit)),
            "{:?}",
            out[3]
        );
        assert_eq!(idle_slots(&u), vec![8]);
    }

    #[test]
    fn pages_of_many_parts_and_unaligned_pages_are_staged() {
        let dir = tempfile::tempdir().unwrap();
        let bufs = BufPool::new(4);
        let u = Uring::new(4, 2).unwrap();
        // More parts than one vectored call takes (buffered), and an unaligned page under
        // O_DIRECT (written through a staging copy, read buffered).
        let data: Vec<u8> = (0..1100 * 8 + 4).map(|i| (i % 241) as u8).collect();
        for (direct, parts) in [(false, 8usize), (true, 1100 * 8 + 4)] {
            let ctx = IoCtx {
                direct,
                bufs: &bufs,
            };
            let src = [PageBuf::from_parts(
                LayoutKind::LayerFirst,
                data[1..].chunks(parts),
            )];
            for o in write_all(&u, ctx, dir.path(), &src) {
                assert!(matches!(o, Outcome::Done(Ok(()))), "{o:?}");
            }
            let mut back = vec![0u8; data.len() - 1];
            let mut dst = [PageBufMut::from_parts(
                LayoutKind::LayerFirst,
                back.chunks_mut(parts),
            )];
            let out = read_all(&u, ctx, dir.path(), &mut dst);
            assert!(
                matches!(out[0], Outcome::Done(ReadResult::Hit)),
                "{:?}",
                out[0]
            );
            drop(dst);
            assert_eq!(&back[..], &data[1..]);
            std::fs::remove_file(dir.path().join("0.page")).unwrap();
        }
    }
}
