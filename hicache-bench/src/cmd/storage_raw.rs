//! The physical-limit reference of `hicache-bench storage` for file-system backends: raw
//! sequential O_DIRECT I/O of the same bytes in the same directory.
//!
//! One file, page-sized requests at consecutive offsets, `depth` requests in flight: through
//! io_uring (one thread, no per-request system call: the cheapest way to keep the disk's queue
//! full) or through `depth` threads doing `pwrite`/`pread`. The write goes into a file sized up
//! front (so no request extends it) and ends with one `fdatasync`; the read reads that file
//! back. Sources are the pages the backend writes; read destinations are the pages the backend
//! reads into, so both sides touch the same memory.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use io_uring::{IoUring, opcode, types};

use crate::error::{BenchError, Result};

/// How the reference issues its requests.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RawEngine {
    /// One io_uring, `depth` requests in flight (falls back to threads where io_uring is
    /// unavailable).
    Uring,
    /// `depth` threads with blocking `pwrite`/`pread`.
    Threads,
}

/// The raw reference of one page size: where, how and how deep.
#[derive(Debug)]
pub struct Raw<'a> {
    /// The file it writes and reads.
    pub path: &'a Path,
    /// Page size: the size of every request.
    pub page_bytes: usize,
    /// Requests (pages) per pass.
    pub pages: usize,
    /// Requests in flight.
    pub depth: usize,
    /// Engine asked for.
    pub engine: RawEngine,
}

/// What engine a pass actually used.
pub fn engine_name(e: RawEngine) -> &'static str {
    match e {
        RawEngine::Uring => "io_uring",
        RawEngine::Threads => "threads",
    }
}

impl Raw<'_> {
    /// The engine that will run: `Uring` only if a ring can be set up here.
    pub fn effective_engine(&self) -> RawEngine {
        match self.engine {
            RawEngine::Uring if IoUring::new(8).is_ok() => RawEngine::Uring,
            _ => RawEngine::Threads,
        }
    }

    /// Writes `pages` page-sized chunks of `src` (cycling through its pages) sequentially
    /// into a fresh file, then `fdatasync`; returns the seconds taken.
    pub fn write(&self, src: &[u8]) -> Result<f64> {
        let path = self.path;
        let _ = std::fs::remove_file(path);
        let f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(BenchError::io(path))?;
        preallocate(&f, (self.pages * self.page_bytes) as u64).map_err(BenchError::io(path))?;
        let per_batch = src.len() / self.page_bytes;
        let chunk = |i: usize| src[(i % per_batch) * self.page_bytes..].as_ptr().cast_mut();
        let t = Instant::now();
        match self.effective_engine() {
            RawEngine::Uring => self.uring(&f, true, self.depth, |i, _| chunk(i)),
            RawEngine::Threads => parallel(self.depth, self.pages, |_, i| {
                let c = &src[(i % per_batch) * self.page_bytes..][..self.page_bytes];
                f.write_all_at(c, (i * self.page_bytes) as u64)
            }),
        }
        .and_then(|()| f.sync_data())
        .map_err(BenchError::io(path))?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// Reads the file [`write`](Self::write) made into page-sized slots of `dst`; returns the
    /// seconds taken. At most as many requests are in flight as `dst` has pages.
    pub fn read(&self, dst: &mut [u8]) -> Result<f64> {
        let path = self.path;
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .map_err(BenchError::io(path))?;
        let slots = dst.len() / self.page_bytes;
        let depth = self.depth.min(slots).max(1);
        let t = Instant::now();
        match self.effective_engine() {
            RawEngine::Uring => {
                let base = dst.as_mut_ptr();
                let pb = self.page_bytes;
                self.uring(&f, false, depth, |_, slot| base.wrapping_add(slot * pb))
            }
            RawEngine::Threads => {
                let bufs: Vec<Mutex<&mut [u8]>> = dst
                    .chunks_mut(self.page_bytes)
                    .take(depth)
                    .map(Mutex::new)
                    .collect();
                parallel(depth, self.pages, |t, i| {
                    let mut b = bufs[t].lock().unwrap_or_else(|e| e.into_inner());
                    f.read_exact_at(&mut b[..], (i * self.page_bytes) as u64)
                })
            }
        }
        .map_err(BenchError::io(path))?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// Runs every request through one ring, `depth` in flight; request `i` covers bytes
    /// `[i·page, (i+1)·page)` of `f` and the memory at `buf(i, slot)`, where `slot < depth` is
    /// the in-flight slot it occupies. Short transfers are continued; the first error stops
    /// new requests and is returned once every request in flight has completed.
    fn uring(
        &self,
        f: &File,
        write: bool,
        depth: usize,
        buf: impl Fn(usize, usize) -> *mut u8,
    ) -> io::Result<()> {
        let depth = depth.clamp(1, 4096);
        let mut ring = IoUring::new(depth.next_power_of_two() as u32)?;
        let fd = types::Fd(f.as_raw_fd());
        let pb = self.page_bytes;
        // Per slot: (offset, memory, bytes left) of the request it carries.
        let mut slot_req: Vec<(u64, *mut u8, usize)> = vec![(0, std::ptr::null_mut(), 0); depth];
        let mut free: Vec<usize> = (0..depth).rev().collect();
        let mut next = 0;
        let mut inflight = 0usize;
        let mut err: Option<io::Error> = None;
        loop {
            while err.is_none() && next < self.pages {
                let Some(slot) = free.pop() else { break };
                slot_req[slot] = ((next * pb) as u64, buf(next, slot), pb);
                next += 1;
                push(&mut ring, fd, write, slot, slot_req[slot])?;
                inflight += 1;
            }
            if inflight == 0 {
                break;
            }
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // The requests in flight point into the caller's memory: never return
                    // while the kernel may still use it.
                    eprintln!("raw reference: io_uring failed with requests in flight: {e}");
                    std::process::abort();
                }
            }
            let done: Vec<(usize, i32)> = ring
                .completion()
                .map(|c| (c.user_data() as usize, c.result()))
                .collect();
            for (slot, res) in done {
                inflight -= 1;
                let (off, mem, left) = slot_req[slot];
                if res < 0 {
                    err.get_or_insert(io::Error::from_raw_os_error(-res));
                    free.push(slot);
                } else if res == 0 {
                    err.get_or_insert(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "raw reference: a request moved no bytes",
                    ));
                    free.push(slot);
                } else if (res as usize) < left {
                    let n = res as usize;
                    slot_req[slot] = (off + n as u64, mem.wrapping_add(n), left - n);
                    push(&mut ring, fd, write, slot, slot_req[slot])?;
                    inflight += 1;
                } else {
                    free.push(slot);
                }
            }
        }
        err.map_or(Ok(()), Err)
    }
}

fn push(
    ring: &mut IoUring,
    fd: types::Fd,
    write: bool,
    slot: usize,
    (off, mem, len): (u64, *mut u8, usize),
) -> io::Result<()> {
    let e = if write {
        opcode::Write::new(fd, mem.cast_const(), len as u32)
            .offset(off)
            .build()
    } else {
        opcode::Read::new(fd, mem, len as u32).offset(off).build()
    }
    .user_data(slot as u64);
    // SAFETY: `mem` points into the caller's page memory, which outlives the ring's use (the
    // loop returns only once nothing is in flight, and aborts if it cannot know); the slot's
    // memory is used by one request at a time. The ring has an entry per slot, so it never
    // holds more unsubmitted entries than it has room for.
    unsafe { ring.submission().push(&e) }
        .map_err(|_| io::Error::other("raw reference: submission queue full"))
}

/// Runs `f(thread, i)` for `i` in `0..n` on `threads` threads.
fn parallel(
    threads: usize,
    n: usize,
    f: impl Fn(usize, usize) -> io::Result<()> + Sync,
) -> io::Result<()> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads.min(n).max(1))
            .map(|t| {
                let next = &next;
                let f = &f;
                s.spawn(move || -> io::Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            return Ok(());
                        }
                        f(t, i)?;
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("raw I/O thread panicked"))
    })
}

/// Allocates the file's blocks up front (`fallocate`), as the backends preallocate their
/// pages and slabs, so the reference's writes neither extend the file nor allocate blocks:
/// the disk's best case. Falls back to `ftruncate` where the file system has no `fallocate`.
fn preallocate(f: &File, len: u64) -> io::Result<()> {
    // SAFETY: plain system call on an open descriptor; no memory is passed.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, len as libc::off_t) };
    if r == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
        return f.set_len(len);
    }
    Err(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use memmap2::MmapMut;

    #[test]
    fn both_engines_round_trip_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let page = 64 << 10;
        let mut src = MmapMut::map_anon(4 * page).unwrap();
        for (i, b) in src.iter_mut().enumerate() {
            *b = (i * 13 % 251) as u8;
        }
        for engine in [RawEngine::Uring, RawEngine::Threads] {
            let path = dir.path().join("raw.bin");
            let raw = Raw {
                path: &path,
                page_bytes: page,
                pages: 10,
                depth: 3,
                engine,
            };
            raw.write(&src).unwrap();
            let data = std::fs::read(&path).unwrap();
            assert_eq!(data.len(), 10 * page);
            for (i, c) in data.chunks(page).enumerate() {
                assert_eq!(c, &src[(i % 4) * page..][..page], "{engine:?} page {i}");
            }
            let mut dst = MmapMut::map_anon(4 * page).unwrap();
            raw.read(&mut dst).unwrap();
            // Every slot holds one of the pages, read back whole, or was never used (a thread
            // may find no page left to read); the fourth is beyond the depth.
            let mut used = 0;
            for c in dst.chunks(page).take(3) {
                if c.iter().any(|&b| b != 0) {
                    assert!(src.chunks(page).any(|s| s == c), "{engine:?}");
                    used += 1;
                }
            }
            assert!(used >= 1, "{engine:?}");
            assert!(dst[3 * page..].iter().all(|&b| b == 0), "{engine:?}");
            assert_eq!(engine_name(raw.effective_engine()), engine_name(engine));
        }
    }
}
