//! The io_uring driver, the one every local layout uses: one ring owned by a dedicated
//! thread that submits the requests of every caller, keeps up to `queue_depth` of them in
//! flight (on registered buffers and fixed files where the caller has them), resubmits the
//! remainder of short transfers, and reports each request's outcome to the caller that sent
//! it.
//!
//! A caller hands over a whole batch at once ([`Ring::submit`]) and gets a [`Pending`] that
//! yields completions as they arrive, so it can verify early pages while later ones are still
//! in flight.
//!
//! # Invariants (what makes the raw pointers in requests sound)
//! 1. **Buffers outlive their requests.** A [`Req`] points into memory the caller borrows for
//!    the duration of its call. [`Pending`] is the only way to learn of completions, and its
//!    `Drop` blocks until every request of its batch has completed (been reaped from the
//!    completion queue), so a caller cannot return, unwind, or release a buffer while the
//!    kernel may still touch it. Should the driver thread die with requests outstanding, the
//!    process aborts rather than let a buffer go while the kernel may hold it.
//! 2. **iovec arrays outlive their requests.** A vectored request's iovecs live in the heap
//!    allocation of its `Req::iov`, owned by the driver's in-flight table until the request
//!    is reaped; moving the `Req` does not move that allocation.
//! 3. **Fixed buffers cover the request.** A request names fixed buffer `i` only if its whole
//!    range lies in registered chunk `i` ([`Registered::fixed_index`]). The registered region
//!    is the caller's long-lived pool (the `register_memory` contract); every page moved
//!    through it is checksum-verified, so even a pool unmapped against that contract cannot
//!    make a wrong page read as a hit.
//! 4. **Never short.** A request completes successfully only when all its bytes moved; a
//!    short transfer is resubmitted for the rest, and a zero-byte transfer is an error (or,
//!    for a read marked [`Req::eof_ok`], the end of its success, with the bytes it moved).
//!
//! The driver thread itself is in `thread`.

mod thread;

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, mpsc};
use std::thread::JoinHandle;

use io_uring::{opcode, squeue, types};

/// Largest span one registered buffer (and one request segment) covers.
pub const CHUNK: usize = 1 << 30;
/// Fixed-file slots the layouts may fill ([`Ring::register_file`]).
pub const MAX_FIXED_FILES: u32 = 256;
/// Largest number of iovecs in one vectored request.
pub const IOV_MAX: usize = 1024;
const WAKE: u64 = u64::MAX;

/// Direction of a transfer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Dir {
    /// File to memory.
    Read,
    /// Memory to file.
    Write,
}

/// A file as requests name it.
#[derive(Copy, Clone, Debug)]
pub struct FileRef {
    /// Its descriptor.
    pub fd: RawFd,
    /// Its slot in the ring's fixed-file table, when registered.
    pub fixed: Option<u32>,
}

/// One transfer: memory ranges (`iov`, in order) to or from consecutive file bytes.
#[derive(Debug)]
pub struct Req {
    /// Direction.
    pub dir: Dir,
    /// The file.
    pub file: FileRef,
    /// File offset of the first byte.
    pub offset: u64,
    /// The memory ranges.
    pub iov: Vec<libc::iovec>,
    /// Registered buffer the single range lies in (invariant 3).
    pub fixed_buf: Option<u16>,
    /// Write with `RWF_DSYNC` (durable on completion).
    pub dsync: bool,
    /// A read that may end at the end of the file: reported as `Ok(bytes read)` rather than
    /// an `UnexpectedEof` error (the caller checks the length, e.g. of a page file).
    pub eof_ok: bool,
    /// The caller's tag, reported with the outcome.
    pub tag: usize,
}

// SAFETY: a `Req` carries raw pointers into memory its sender borrows; the sender blocks
// until the request completes (invariant 1), so handing the pointers to the driver thread is
// no different from using them on the sender's thread.
unsafe impl Send for Req {}

impl Req {
    /// A transfer on an ordinary descriptor: no fixed file or buffer, no `RWF_DSYNC`, no read
    /// allowed to end at the end of the file (set those fields after, where wanted).
    pub fn new(dir: Dir, fd: RawFd, offset: u64, iov: Vec<libc::iovec>, tag: usize) -> Self {
        Self {
            dir,
            file: FileRef { fd, fixed: None },
            offset,
            iov,
            fixed_buf: None,
            dsync: false,
            eof_ok: false,
            tag,
        }
    }

    fn bytes(&self) -> usize {
        self.iov.iter().map(|v| v.iov_len).sum()
    }

    /// Drops the first `n` bytes (a short transfer moved them).
    fn advance(&mut self, mut n: usize) {
        self.offset += n as u64;
        let mut skip = 0;
        for v in &mut self.iov {
            if n == 0 {
                break;
            }
            let k = n.min(v.iov_len);
            v.iov_base = v.iov_base.cast::<u8>().wrapping_add(k).cast();
            v.iov_len -= k;
            n -= k;
            if v.iov_len == 0 {
                skip += 1;
            }
        }
        self.iov.drain(..skip);
    }

    fn sqe(&self, user_data: u64) -> squeue::Entry {
        let flags = if self.dsync { libc::RWF_DSYNC } else { 0 };
        let first = self.iov[0];
        let (ptr, len) = (first.iov_base.cast::<u8>(), first.iov_len as u32);
        macro_rules! build {
            ($fd:expr) => {
                match (self.dir, self.fixed_buf, self.iov.len()) {
                    (Dir::Write, Some(b), _) => opcode::WriteFixed::new($fd, ptr, len, b)
                        .offset(self.offset)
                        .rw_flags(flags)
                        .build(),
                    (Dir::Read, Some(b), _) => opcode::ReadFixed::new($fd, ptr, len, b)
                        .offset(self.offset)
                        .build(),
                    (Dir::Write, None, 1) => opcode::Write::new($fd, ptr, len)
                        .offset(self.offset)
                        .rw_flags(flags)
                        .build(),
                    (Dir::Read, None, 1) => {
                        opcode::Read::new($fd, ptr, len).offset(self.offset).build()
                    }
                    (Dir::Write, None, n) => opcode::Writev::new($fd, self.iov.as_ptr(), n as u32)
                        .offset(self.offset)
                        .rw_flags(flags)
                        .build(),
                    (Dir::Read, None, n) => opcode::Readv::new($fd, self.iov.as_ptr(), n as u32)
                        .offset(self.offset)
                        .build(),
                }
            };
        }
        let e = match self.file.fixed {
            Some(i) => build!(types::Fixed(i)),
            None => build!(types::Fd(self.file.fd)),
        };
        e.user_data(user_data)
    }
}

/// The registered region: `len` bytes from `base`, as fixed buffers of [`CHUNK`] bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Registered {
    /// Start address.
    pub base: usize,
    /// Length.
    pub len: usize,
}

impl Registered {
    /// The fixed buffer holding all of `[addr, addr + len)`, if one does.
    pub fn fixed_index(&self, addr: usize, len: usize) -> Option<u16> {
        let off = addr.checked_sub(self.base)?;
        if len == 0 || off.checked_add(len)? > self.len {
            return None;
        }
        let i = off / CHUNK;
        ((off + len - 1) / CHUNK == i).then_some(i as u16)
    }
}

/// Splits `[addr, addr + len)` at multiples of [`CHUNK`] counted from `anchor`.
pub fn segments(addr: usize, len: usize, anchor: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut a = addr;
    let end = addr + len;
    std::iter::from_fn(move || {
        if a >= end {
            return None;
        }
        let next_cut = anchor + ((a - anchor) / CHUNK + 1) * CHUNK;
        let b = end.min(next_cut);
        let s = (a, b - a);
        a = b;
        Some(s)
    })
}

/// Counters of the requests the ring ran.
#[derive(Debug, Default)]
pub struct RingCounters {
    /// Requests on registered buffers (`READ_FIXED` / `WRITE_FIXED`).
    pub fixed: AtomicU64,
    /// Vectored requests (`READV` / `WRITEV`).
    pub vectored: AtomicU64,
    /// Single-range requests on unregistered memory (`READ` / `WRITE`).
    pub plain: AtomicU64,
    /// Short transfers whose remainder was resubmitted.
    pub short: AtomicU64,
    /// `submit` system calls.
    pub submits: AtomicU64,
}

/// One request's outcome as the driver thread reports it.
struct Completion {
    /// The caller's tag.
    tag: usize,
    /// Bytes moved; else the error.
    result: io::Result<usize>,
}

/// Outcomes of requests.
type Outcomes = Vec<Completion>;
/// Where a batch's outcomes go: one message per batch per reaping pass, so a caller wakes once
/// for all of its requests that completed together.
type Done = Arc<mpsc::Sender<Outcomes>>;

enum Msg {
    Batch(Vec<Req>, Done),
    RegisterBuffers(Vec<libc::iovec>, mpsc::SyncSender<io::Result<()>>),
    RegisterFile(u32, RawFd, mpsc::SyncSender<io::Result<()>>),
}

// SAFETY: the iovecs of `RegisterBuffers` describe the caller's long-lived region (the
// `register_memory` contract); the thread receiving them only passes them to the kernel.
// Requests are `Send` themselves.
unsafe impl Send for Msg {}

/// The ring and its thread.
pub struct Ring {
    tx: Option<mpsc::Sender<Msg>>,
    wake: File,
    thread: Option<JoinHandle<()>>,
    fixed_files: bool,
    registered: OnceLock<Registered>,
    counters: Arc<RingCounters>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("fixed_files", &self.fixed_files)
            .field("registered", &self.registered.get())
            .finish_non_exhaustive()
    }
}

impl Ring {
    /// Sets up a ring of `queue_depth` requests in flight on a new thread. `fixed_files`:
    /// register a fixed-file table (files are then added with [`register_file`]).
    ///
    /// [`register_file`]: Self::register_file
    pub fn new(queue_depth: u32, fixed_files: bool) -> io::Result<Self> {
        let wake = crate::io::sys::eventfd()?;
        let wake_thread = wake.try_clone()?;
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let counters = Arc::new(RingCounters::default());
        let c = counters.clone();
        let thread = std::thread::Builder::new()
            .name("hicache-uring".into())
            .spawn(move || {
                let setup = match thread::setup(queue_depth, fixed_files) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(setup.fixed_files));
                thread::Driver::new(setup, rx, wake_thread, queue_depth as usize, c).run();
            })?;
        let files = ready_rx
            .recv()
            .map_err(|_| io::Error::other("ring thread ended during setup"))??;
        Ok(Self {
            tx: Some(tx),
            wake,
            thread: Some(thread),
            fixed_files: files,
            registered: OnceLock::new(),
            counters,
        })
    }

    /// Whether files can be registered.
    pub fn fixed_files(&self) -> bool {
        self.fixed_files
    }

    /// The registered region, once [`register_buffers`](Self::register_buffers) succeeded.
    pub fn registered(&self) -> Option<Registered> {
        self.registered.get().copied()
    }

    /// The request counters.
    pub fn counters(&self) -> &RingCounters {
        &self.counters
    }

    fn send(&self, m: Msg) -> io::Result<()> {
        self.tx
            .as_ref()
            .expect("sender lives until drop")
            .send(m)
            .map_err(|_| io::Error::other("the io_uring thread has ended"))?;
        let _ = (&self.wake).write(&1u64.to_ne_bytes());
        Ok(())
    }

    /// Puts `fd` in slot `slot` of the fixed-file table.
    pub fn register_file(&self, slot: u32, fd: RawFd) -> io::Result<()> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Msg::RegisterFile(slot, fd, tx))?;
        rx.recv()
            .map_err(|_| io::Error::other("the io_uring thread has ended"))?
    }

    /// Registers `[base, base + len)` as fixed buffers of up to [`CHUNK`] bytes. Once only.
    ///
    /// The range must stay mapped for the life of the ring (the `register_memory` contract).
    pub fn register_buffers(&self, base: usize, len: usize) -> io::Result<()> {
        if let Some(r) = self.registered.get() {
            return if *r == (Registered { base, len }) {
                Ok(())
            } else {
                Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("a region is registered already ({:#x}+{})", r.base, r.len),
                ))
            };
        }
        let iovs: Vec<libc::iovec> = segments(base, len, base)
            .map(|(a, l)| libc::iovec {
                iov_base: a as *mut libc::c_void,
                iov_len: l,
            })
            .collect();
        if iovs.len() > u16::MAX as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "region too large for fixed buffers",
            ));
        }
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Msg::RegisterBuffers(iovs, tx))?;
        rx.recv()
            .map_err(|_| io::Error::other("the io_uring thread has ended"))??;
        let _ = self.registered.set(Registered { base, len });
        Ok(())
    }

    /// Hands `reqs` to the ring; their outcomes come from the returned [`Pending`].
    #[tracing::instrument(name = "localio.submit", skip_all, fields(reqs = reqs.len()))]
    pub fn submit(&self, reqs: Vec<Req>) -> Pending {
        let left = reqs.len();
        // The journal (tests only): writes as issued; `RWF_DSYNC` ones durable when the last
        // request of their tag completed.
        let mut dsync: Vec<(usize, RawFd, u64, u64)> = Vec::new();
        let mut per_tag: std::collections::HashMap<usize, usize> = Default::default();
        for r in reqs.iter().filter(|r| r.dir == Dir::Write) {
            // SAFETY: a request's iovecs describe memory readable until it completes
            // (invariant 1), and it has not been submitted yet.
            unsafe { crate::io::journal::write_iov(r.file.fd, r.offset, &r.iov) };
            if r.dsync {
                dsync.push((r.tag, r.file.fd, r.offset, r.bytes() as u64));
            }
        }
        for r in &reqs {
            *per_tag.entry(r.tag).or_default() += 1;
        }
        if dsync.is_empty() {
            per_tag.clear();
        }
        for r in &reqs {
            let c = match (r.fixed_buf, r.iov.len()) {
                (Some(_), _) => &self.counters.fixed,
                (None, 1) => &self.counters.plain,
                _ => &self.counters.vectored,
            };
            c.fetch_add(1, Ordering::Relaxed);
        }
        let mut p = self.hand_over(left, |tx| Msg::Batch(reqs, tx));
        p.dsync = dsync;
        p.per_tag = per_tag;
        p
    }

    /// Hands `left` requests over in the message `msg` builds; the [`Pending`] of them.
    fn hand_over(&self, left: usize, msg: impl FnOnce(Done) -> Msg) -> Pending {
        let (tx, rx) = mpsc::channel();
        let failed = if left > 0 {
            // Nothing handed over (the driver is gone): every request failed.
            self.send(msg(Arc::new(tx)))
                .err()
                .map(|e| (left, e.to_string()))
        } else {
            None
        };
        Pending {
            rx,
            ready: VecDeque::new(),
            left: if failed.is_some() { 0 } else { left },
            failed,
            dsync: Vec::new(),
            per_tag: Default::default(),
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        drop(self.tx.take());
        let _ = (&self.wake).write(&1u64.to_ne_bytes());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The outcomes of one submitted batch. Dropping it waits for every request (invariant 1).
pub struct Pending {
    rx: mpsc::Receiver<Outcomes>,
    ready: VecDeque<Completion>,
    left: usize,
    failed: Option<(usize, String)>,
    /// `RWF_DSYNC` writes `(tag, fd, offset, len)`, for the journal.
    dsync: Vec<(usize, RawFd, u64, u64)>,
    /// Requests per tag not yet completed (only when `dsync` is not empty).
    per_tag: std::collections::HashMap<usize, usize>,
}

impl Pending {
    /// The next completed request's tag and outcome (the bytes it moved), in completion
    /// order; `None` when all have been reported. Blocks.
    pub fn wait_next(&mut self) -> Option<(usize, io::Result<usize>)> {
        self.wait_completion().map(|c| (c.tag, c.result))
    }

    /// The next completion.
    fn wait_completion(&mut self) -> Option<Completion> {
        if self.left == 0 {
            return None;
        }
        if let Some(r) = self.ready.pop_front() {
            self.left -= 1;
            self.journal(&r);
            return Some(r);
        }
        match self.rx.recv() {
            Ok(v) => {
                self.ready.extend(v);
                let r = self.ready.pop_front()?;
                self.left -= 1;
                self.journal(&r);
                Some(r)
            }
            Err(_) => {
                // The driver died holding our requests: the kernel may still write into the
                // caller's buffers, which we can no longer keep alive. Stop here.
                tracing::error!("localio: io_uring thread died with requests in flight");
                std::process::abort();
            }
        }
    }

    /// Records `RWF_DSYNC` durability in the journal once every request of a tag completed.
    fn journal(&mut self, r: &Completion) {
        if self.dsync.is_empty() {
            return;
        }
        let Some(n) = self.per_tag.get_mut(&r.tag) else {
            return;
        };
        *n -= 1;
        if *n == 0 && r.result.is_ok() {
            for &(_, fd, off, len) in self.dsync.iter().filter(|d| d.0 == r.tag) {
                crate::io::journal::sync(fd, Some((off, len)));
            }
        }
    }

    /// Requests never handed to the ring because its thread had ended (count and reason).
    pub fn not_submitted(&self) -> Option<&(usize, String)> {
        self.failed.as_ref()
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        while self.wait_next().is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    fn iov(a: usize, l: usize) -> libc::iovec {
        libc::iovec {
            iov_base: a as *mut libc::c_void,
            iov_len: l,
        }
    }

    #[test]
    fn advance_moves_offset_and_ranges() {
        let mut r = Req {
            dir: Dir::Write,
            file: FileRef { fd: 0, fixed: None },
            offset: 4096,
            iov: vec![iov(0x10000, 4096), iov(0x20000, 8192), iov(0x40000, 4096)],
            fixed_buf: None,
            dsync: false,
            eof_ok: false,
            tag: 0,
        };
        r.advance(4096 + 1024);
        assert_eq!(r.offset, 4096 + 5120);
        assert_eq!(r.iov.len(), 2);
        assert_eq!(r.iov[0].iov_base as usize, 0x20000 + 1024);
        assert_eq!(r.iov[0].iov_len, 8192 - 1024);
        assert_eq!(r.bytes(), 8192 - 1024 + 4096);
        r.advance(r.bytes());
        assert!(r.iov.is_empty());
    }

    #[test]
    fn segments_cut_at_chunk_boundaries() {
        let base = 0x1000_0000usize;
        let v: Vec<_> = segments(base + CHUNK - 4096, 3 * 4096, base).collect();
        assert_eq!(v, vec![(base + CHUNK - 4096, 4096), (base + CHUNK, 8192)]);
        let r = Registered {
            base,
            len: 2 * CHUNK,
        };
        assert_eq!(r.fixed_index(base, 4096), Some(0));
        assert_eq!(r.fixed_index(base + CHUNK, 4096), Some(1));
        assert_eq!(r.fixed_index(base + CHUNK - 4096, 8192), None);
        assert_eq!(r.fixed_index(base + 2 * CHUNK, 4096), None);
        assert_eq!(r.fixed_index(base - 4096, 4096), None);
    }

    #[test]
    fn a_ring_reads_and_writes_with_short_io_resubmitted() {
        // A file shorter than the read: the first transfer is short, the resubmitted rest
        // hits the end of the file and fails; a full-length read succeeds.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 6000]).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let ring = Ring::new(8, true).unwrap();
        if ring.fixed_files() {
            ring.register_file(3, f.as_raw_fd()).unwrap();
        }
        let file = FileRef {
            fd: f.as_raw_fd(),
            fixed: ring.fixed_files().then_some(3),
        };
        let mut a = vec![0u8; 8192];
        let mut b = vec![0u8; 6000];
        let reqs = vec![
            Req {
                dir: Dir::Read,
                file,
                offset: 0,
                iov: vec![iov(a.as_mut_ptr() as usize, 8192)],
                fixed_buf: None,
                dsync: false,
                eof_ok: false,
                tag: 0,
            },
            Req {
                dir: Dir::Read,
                file,
                offset: 0,
                iov: vec![
                    iov(b.as_mut_ptr() as usize, 1000),
                    iov(b.as_mut_ptr() as usize + 1000, 5000),
                ],
                fixed_buf: None,
                dsync: false,
                eof_ok: true,
                tag: 1,
            },
        ];
        let mut p = ring.submit(reqs);
        let mut out = [None, None];
        while let Some((t, r)) = p.wait_next() {
            out[t] = Some(r);
        }
        drop(p);
        let e = out[0].take().unwrap().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        assert!(out[1].take().unwrap().is_ok());
        assert!(b.iter().all(|x| *x == 7));
        assert!(ring.counters().short.load(Ordering::Relaxed) >= 1);
        drop(a);
    }
}
