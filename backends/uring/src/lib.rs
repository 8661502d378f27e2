//! # hicache-backend-uring
//!
//! An L3 backend of hicache-rs for local NVMe: pages live in preallocated slab files opened
//! with `O_DIRECT`, and move between the caller's memory and the disk through one io_uring,
//! a whole batch per submission. The host pool announced by
//! [`register_memory`](hicache_storage::Storage::register_memory) is registered once as
//! io_uring fixed buffers, so its pages go to and from disk with `READ_FIXED` / `WRITE_FIXED`
//! and no per-request page pinning; other 4096-aligned memory goes with `READV` / `WRITEV`,
//! and unaligned memory through an aligned bounce buffer. Slab files are registered as fixed
//! files.
//!
//! ```no_run
//! # async fn f() -> hicache_storage::Result<()> {
//! use hicache_backend_uring::{UringBackend, UringOptions};
//! use hicache_storage::{LayoutKind, Storage, StorageExt, pattern};
//! let mut options = UringOptions::new("/nvme/hicache");
//! options.capacity_bytes = Some(500 << 30);
//! let storage = UringBackend::open(options)?;
//! let key = pattern::page_key(pattern::namespace(1), 7, 0);
//! storage.put(LayoutKind::PageFirst, key, &pattern::page_bytes(&key, 1 << 20)).await?;
//! # Ok(()) }
//! ```
//!
//! The on-disk format (slabs and the index log) is described in [`format`].
//!
//! # Invariants
//! 1. **Data before index.** A page's bytes are written to a slot no committed page uses
//!    ([`index`] invariant 1), made durable per the fsync policy, and only then is its `put`
//!    record appended to the index log (synced unless `fsync` is `none`) and the page made
//!    visible. So after any crash the log names only pages whose data was complete; a torn log
//!    tail is cut off at open ([`log`] invariant 1).
//! 2. **Verified reads.** Every read is checked against the XXH3-64 its `put` record holds. A
//!    mismatch, or a slot cut short by a truncated slab, is `Corrupt`: the destination is
//!    zeroed, the page dropped, the event counted. Bad bytes are never a hit.
//! 3. **Acknowledged means committed.** `Stored` is returned only after invariant 1's steps.
//! 4. **Never short.** Short transfers are resubmitted for the rest; a page is a success only
//!    when every byte moved ([`ring`] invariant 4).
//! 5. **Buffers outlive I/O.** Calls block (through `block_in_place` on a multi-threaded tokio
//!    runtime, so the runtime's other tasks move to other workers) until every request they
//!    submitted has completed, including on error paths ([`ring`] invariant 1).
//! 6. **One owner.** The directory is locked (`flock`) by one process; a second opener gets an
//!    error naming the directory.
//! 7. **Bounded.** Slab blocks in use stay within the capacity ([`index`] invariant 2).
#![warn(missing_docs)]

mod buf;
pub mod format;
pub mod index;
pub mod log;
pub mod options;
pub mod ring;
mod sys;

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use async_trait::async_trait;
use hicache_storage::backend::bump;
use hicache_storage::checksum::{checksum, checksum_page, checksum_page_mut};
use hicache_storage::{
    BackendContext, BackendFactory, BackendInfo, CommonConfig, ConfigFields, MemoryRegion, PageBuf,
    PageBufMut, PageError, PageKey, PageOutcome, Registry, Result, StatsCounters, Storage,
    StorageError, StorageStats, check_batch,
};
use parking_lot::{Mutex, RwLock};
use tokio::runtime::{Handle, RuntimeFlavor};

use crate::buf::{AlignedBuf, BufPool};
use crate::format::{ALIGN, LOCK_FILE, Put, Record, slab_file_name, slot_bytes};
use crate::index::{Entry, Index, Loc, ReserveError, SlabDisk};
use crate::log::IndexLog;
pub use crate::options::{FsyncPolicy, UringOptions};
use crate::ring::{CHUNK, Dir, FileRef, IOV_MAX, Pending, Req, Ring, segments};

const NAME: &str = "uring";
/// Log records beyond twice the live pages that trigger a compaction.
const COMPACT_SLACK: u64 = 1 << 16;

fn backend_err(reason: impl Into<String>) -> StorageError {
    StorageError::Backend {
        backend: NAME.into(),
        reason: reason.into(),
    }
}

/// What [`UringBackend::open`] found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// Committed pages restored from the index log.
    pub pages: u64,
    /// Torn index-log records cut off the tail.
    pub discarded_records: u64,
    /// Damaged index-log records skipped inside the log (later valid records kept).
    pub skipped_records: u64,
    /// Where the damaged index-log bytes were copied before recovery cut them, if any.
    pub preserved: Option<PathBuf>,
    /// `put` records ignored because their slab or slot does not exist.
    pub discarded_pages: u64,
    /// Pages evicted at open because the capacity is below what the slabs held.
    pub evicted: u64,
    /// Whether the log was compacted at open.
    pub compacted: bool,
}

/// Counters of the I/O paths taken (beyond [`StorageStats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Requests on registered buffers (`READ_FIXED` / `WRITE_FIXED`).
    pub fixed_requests: u64,
    /// Vectored requests on unregistered aligned memory.
    pub vectored_requests: u64,
    /// Single-range requests on unregistered memory (bounce buffers, single-part pages).
    pub plain_requests: u64,
    /// Pages staged through a bounce buffer (memory not 4096-aligned).
    pub bounced_pages: u64,
    /// Short transfers resubmitted.
    pub short_transfers: u64,
    /// Bytes registered as fixed buffers (0 if none).
    pub registered_bytes: u64,
    /// Index-log compactions since open.
    pub compactions: u64,
}

struct Slab {
    slot_bytes: u64,
    file: File,
    fixed: Option<u32>,
}

impl Slab {
    fn file_ref(&self) -> FileRef {
        FileRef {
            fd: self.file.as_raw_fd(),
            fixed: self.fixed,
        }
    }
}

/// Free space a slab never grows into: the index log's appends and compactions need room on
/// a file system the slabs have filled (at least this, or 1/256 of the file system).
const MIN_FS_HEADROOM: u64 = 4 << 20;

/// The disk operations of the index, on the slabs.
struct Disk<'a>(&'a [Arc<Slab>]);

impl SlabDisk for Disk<'_> {
    /// Grows by the whole step when the file system has room, else by the most slots it has
    /// room for (halving the step); a failed `fallocate` is undone by cutting the file back,
    /// so a partial allocation never leaves the file system full.
    fn grow(&self, class: u16, from: u32, to: u32) -> io::Result<u32> {
        let s = &self.0[class as usize];
        let start = from as u64 * s.slot_bytes;
        // Leave room for the index log (its appends and a compaction's copy) and others.
        let (avail, total) = sys::fs_space(&s.file)?;
        let headroom = (total / 256).max(MIN_FS_HEADROOM);
        let room = avail.saturating_sub(headroom) / s.slot_bytes;
        if room == 0 {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let mut to = to.min(from.saturating_add(u32::try_from(room).unwrap_or(u32::MAX)));
        loop {
            let len = (to - from) as u64 * s.slot_bytes;
            match sys::allocate(&s.file, start, len) {
                Ok(()) => return Ok(to),
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                    if s.file.metadata()?.len() > start {
                        s.file.set_len(start)?;
                    }
                    if to - from == 1 {
                        return Err(e);
                    }
                    to = from + (to - from) / 2;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn punch(&self, class: u16, slot: u32) {
        let s = &self.0[class as usize];
        sys::punch_hole(&s.file, slot as u64 * s.slot_bytes, s.slot_bytes);
    }
}

/// The uring backend. See the [crate documentation](crate).
pub struct UringBackend {
    // Dropped first: the ring thread ends before the slab files close.
    ring: Ring,
    opts: UringOptions,
    capacity: u64,
    slabs: RwLock<Vec<Arc<Slab>>>,
    new_slab: Mutex<()>,
    index: Mutex<Index>,
    log: Mutex<IndexLog>,
    dels: Mutex<Vec<Record>>,
    counters: StatsCounters,
    bounced: std::sync::atomic::AtomicU64,
    compactions: std::sync::atomic::AtomicU64,
    pool: BufPool,
    report: OpenReport,
    _lock: File,
}

impl std::fmt::Debug for UringBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringBackend")
            .field("dir", &self.opts.dir)
            .field("capacity", &self.capacity)
            .field("ring", &self.ring)
            .finish_non_exhaustive()
    }
}

/// The error for a system without a usable io_uring, naming the `file` backend.
fn unavailable(e: &io::Error) -> StorageError {
    let sysctl = fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .map(|s| format!(" (kernel.io_uring_disabled = {})", s.trim()))
        .unwrap_or_default();
    StorageError::Unavailable {
        backend: NAME.into(),
        reason: format!(
            "io_uring is unavailable on this system: io_uring_setup failed: {e}{sysctl}; \
             use the `file` backend instead (--storage-backend file), which needs no io_uring"
        ),
    }
}

/// Takes the directory lock, or says who holds it.
/// Refuses a capacity that cannot hold one page of `page_bytes` (one slot of its size class),
/// which would otherwise evict every stored page at open and store nothing.
fn check_capacity(capacity: u64, page_bytes: usize) -> Result<()> {
    let need = slot_bytes(page_bytes.max(1));
    if capacity < need {
        return Err(StorageError::config(
            "extra-config",
            "capacity",
            capacity.to_string(),
            format!("cannot hold one page of {page_bytes} bytes (a {need}-byte slot)"),
        ));
    }
    Ok(())
}

/// Whether `dir` may be used: it holds this backend's index log, or nothing but names this
/// backend writes (the lock file with a pid in it, the O_DIRECT probe, slab files and copies
/// of damaged log bytes: a directory whose log was lost is still this backend's). A
/// foreign index log or any other content is refused with an error naming the directory,
/// before anything in it is written.
fn claim_directory(dir: &Path) -> Result<()> {
    if IndexLog::check_owner(dir).map_err(|e| backend_err(e.to_string()))? {
        return Ok(());
    }
    let ours_before_log = |name: &str| match name {
        LOCK_FILE => fs::read_to_string(dir.join(LOCK_FILE))
            .is_ok_and(|s| s.trim().bytes().all(|b| b.is_ascii_digit())),
        format::INDEX_FILE | format::INDEX_TMP_FILE | "direct-probe.tmp" => true,
        n => n.starts_with(format::DAMAGED_PREFIX) || format::parse_slab_file_name(n).is_some(),
    };
    let foreign: Vec<String> = fs::read_dir(dir)
        .map_err(StorageError::io("list", dir))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !ours_before_log(n))
        .collect();
    if foreign.is_empty() {
        return Ok(());
    }
    Err(backend_err(format!(
        "{} is not empty and has no hicache-uring index log: refusing to use a directory the \
         uring backend did not create ({} entries, e.g. {}); give an empty or new directory",
        dir.display(),
        foreign.len(),
        foreign
            .iter()
            .take(5)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

fn lock_dir(dir: &Path) -> Result<File> {
    let path = dir.join(LOCK_FILE);
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(StorageError::io("open", &path))?;
    match f.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = f.read_to_string(&mut holder);
            let holder = holder.trim();
            return Err(backend_err(format!(
                "{} is in use by another process{}: a uring directory has one owner; give each \
                 process its own directory (or use the `file` backend with \"shared\": true to \
                 share one)",
                dir.display(),
                if holder.is_empty() {
                    String::new()
                } else {
                    format!(" (pid {holder})")
                }
            )));
        }
        Err(fs::TryLockError::Error(e)) => return Err(StorageError::io("lock", &path)(e)),
    }
    let pid = std::process::id().to_string();
    f.set_len(0)
        .and_then(|()| f.rewind())
        .and_then(|()| f.write_all(pid.as_bytes()))
        .map_err(StorageError::io("write", &path))?;
    Ok(f)
}

fn open_slab(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

/// Runs blocking work from async code: through `block_in_place` on a multi-threaded runtime
/// (the runtime's other tasks move to other workers), directly otherwise.
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

fn aligned(addr: usize, len: usize) -> bool {
    addr.is_multiple_of(ALIGN) && len.is_multiple_of(ALIGN)
}

/// A page's transfer plan: the requests, and the bounce buffer when its memory is unaligned.
struct Plan {
    reqs: Vec<Req>,
    bounce: Option<AlignedBuf>,
}

impl UringBackend {
    /// Opens (creating if needed) the storage directory of `opts`, recovering what a previous
    /// run committed. Blocking: it replays the index log.
    pub fn open(opts: UringOptions) -> Result<Self> {
        let dir = opts.dir.clone();
        fs::create_dir_all(&dir).map_err(StorageError::io("create directory", &dir))?;
        if let Some(c) = opts.capacity_bytes {
            check_capacity(c, opts.page_bytes.unwrap_or(1) as usize)?;
        }
        // Ownership before anything is written, the lock file included.
        claim_directory(&dir)?;
        let lock = lock_dir(&dir)?;
        let ring = Ring::new(opts.queue_depth, opts.fixed_files).map_err(|e| unavailable(&e))?;
        let (mut log, replay) =
            IndexLog::open(&dir).map_err(|e| backend_err(format!("index log: {e}")))?;
        // Slabs: every slab file present, plus those the log names (recreated empty if lost,
        // their pages then ignored).
        let mut sizes: Vec<u64> = Vec::new();
        for e in fs::read_dir(&dir)
            .map_err(StorageError::io("list", &dir))?
            .flatten()
        {
            if let Some(s) = e
                .file_name()
                .to_str()
                .and_then(format::parse_slab_file_name)
            {
                sizes.push(s);
            }
        }
        if let Some(p) = opts.page_bytes {
            sizes.push(slot_bytes(p as usize));
        }
        sizes.sort_unstable();
        sizes.dedup();
        let mut slabs = Vec::new();
        let mut file_slots = Vec::new();
        for &s in &sizes {
            let (slab, len) = Self::make_slab(&ring, &dir, s, slabs.len())?;
            file_slots.push(u32::try_from(len.div_ceil(s)).unwrap_or(u32::MAX));
            slabs.push(Arc::new(slab));
        }
        if slabs.is_empty() {
            Self::probe_direct(&dir)?;
        }
        let used: u64 = sizes
            .iter()
            .zip(&file_slots)
            .map(|(s, n)| s * *n as u64)
            .sum();
        let capacity = match opts.capacity_bytes {
            Some(c) => c,
            None => {
                let free = sys::free_bytes(&dir).map_err(StorageError::io("statvfs", &dir))?;
                (free + used) / 10 * 9
            }
        };
        let mut index = Index::new(capacity, opts.grow_bytes, opts.eviction, replay.max_seq);
        for (s, n) in sizes.iter().zip(&file_slots) {
            index.add_class(*s, *n);
        }
        let mut discarded_pages = 0u64;
        for p in &replay.puts {
            let restored = sizes
                .iter()
                .position(|s| *s == p.slot_bytes)
                .zip(u32::try_from(p.slot).ok())
                .is_some_and(|(class, slot)| {
                    index.restore(
                        p.key,
                        Entry {
                            loc: Loc {
                                class: class as u16,
                                slot,
                            },
                            meta: p.meta,
                            sum: p.sum,
                            seq: p.seq,
                        },
                    )
                });
            if !restored {
                discarded_pages += 1;
            }
        }
        index.finish_restore();
        let victims = index.fit(&Disk(&slabs));
        let mut report = OpenReport {
            pages: index.len() as u64,
            discarded_records: replay.discarded,
            skipped_records: replay.skipped,
            preserved: replay.preserved.clone(),
            discarded_pages,
            evicted: victims.len() as u64,
            compacted: false,
        };
        let counters = StatsCounters::default();
        bump(
            &counters.discarded_on_open,
            replay.discarded + replay.skipped + discarded_pages,
        );
        bump(&counters.evicted_pages, victims.len() as u64);
        bump(
            &counters.evicted_bytes,
            victims.iter().map(|(_, e)| e.meta.len as u64).sum(),
        );
        let live = index.len() as u64;
        if !victims.is_empty() || discarded_pages > 0 || log.records() > 2 * live + 1024 {
            let puts = Self::live_puts(&index);
            log.compact(&puts)
                .map_err(|e| backend_err(format!("index log compaction: {e}")))?;
            report.compacted = true;
        }
        tracing::info!(dir = %dir.display(), ?report, capacity, "uring backend opened");
        Ok(Self {
            ring,
            capacity,
            slabs: RwLock::new(slabs),
            new_slab: Mutex::new(()),
            index: Mutex::new(index),
            log: Mutex::new(log),
            dels: Mutex::new(Vec::new()),
            counters,
            bounced: 0.into(),
            compactions: 0.into(),
            pool: BufPool::new(64 << 20),
            report,
            opts,
            _lock: lock,
        })
    }

    fn probe_direct(dir: &Path) -> Result<()> {
        let p = dir.join("direct-probe.tmp");
        let r = open_slab(&p);
        let _ = fs::remove_file(&p);
        r.map(drop).map_err(|e| {
            backend_err(format!(
                "{}: the file system refuses O_DIRECT ({e}); the uring backend needs a local \
                 disk file system (ext4, xfs); use the `file` backend elsewhere",
                dir.display()
            ))
        })
    }

    /// Opens (creating) the slab of `slot_bytes` as class `class`, registering it with the
    /// ring; returns it and its length.
    fn make_slab(ring: &Ring, dir: &Path, slot_bytes: u64, class: usize) -> Result<(Slab, u64)> {
        let path = dir.join(slab_file_name(slot_bytes));
        let file = open_slab(&path).map_err(|e| {
            if e.raw_os_error() == Some(libc::EINVAL) {
                backend_err(format!(
                    "{}: the file system refuses O_DIRECT; use the `file` backend here",
                    path.display()
                ))
            } else {
                StorageError::io("open slab", &path)(e)
            }
        })?;
        let len = file
            .metadata()
            .map_err(StorageError::io("stat", &path))?
            .len();
        let fixed = (ring.fixed_files() && (class as u32) < ring::MAX_FIXED_FILES)
            .then_some(class as u32)
            .filter(|&slot| ring.register_file(slot, file.as_raw_fd()).is_ok());
        Ok((
            Slab {
                slot_bytes,
                file,
                fixed,
            },
            len,
        ))
    }

    /// The class of `slot_bytes`, creating its slab if needed.
    fn class_of(&self, slot_bytes: u64) -> Result<u16> {
        let find = |v: &[Arc<Slab>]| v.iter().position(|s| s.slot_bytes == slot_bytes);
        if let Some(c) = find(&self.slabs.read()) {
            return Ok(c as u16);
        }
        let _g = self.new_slab.lock();
        if let Some(c) = find(&self.slabs.read()) {
            return Ok(c as u16);
        }
        let n = self.slabs.read().len();
        if n >= u16::MAX as usize {
            return Err(backend_err("too many page size classes"));
        }
        let (slab, len) = Self::make_slab(&self.ring, &self.opts.dir, slot_bytes, n)?;
        let mut ix = self.index.lock();
        let id = ix.add_class(
            slot_bytes,
            u32::try_from(len.div_ceil(slot_bytes)).unwrap_or(u32::MAX),
        );
        self.slabs.write().push(Arc::new(slab));
        debug_assert_eq!(id as usize, n);
        Ok(id)
    }

    fn live_puts(ix: &Index) -> Vec<Put> {
        ix.entries_by_seq()
            .into_iter()
            .map(|(key, e)| Put {
                seq: e.seq,
                key,
                meta: e.meta,
                slot_bytes: ix.slot_bytes(e.loc.class),
                slot: e.loc.slot as u64,
                sum: e.sum,
            })
            .collect()
    }

    /// The options it was opened with.
    pub fn options(&self) -> &UringOptions {
        &self.opts
    }

    /// What opening found.
    pub fn open_report(&self) -> &OpenReport {
        &self.report
    }

    /// Counters of the I/O paths taken.
    pub fn io_stats(&self) -> IoStats {
        let c = self.ring.counters();
        IoStats {
            fixed_requests: c.fixed.load(Ordering::Relaxed),
            vectored_requests: c.vectored.load(Ordering::Relaxed),
            plain_requests: c.plain.load(Ordering::Relaxed),
            bounced_pages: self.bounced.load(Ordering::Relaxed),
            short_transfers: c.short.load(Ordering::Relaxed),
            registered_bytes: self.ring.registered().map_or(0, |r| r.len as u64),
            compactions: self.compactions.load(Ordering::Relaxed),
        }
    }

    /// Where `key`'s bytes lie: slab path, byte offset and page length (for tools and tests
    /// that inspect or damage the medium).
    pub fn page_location(&self, key: &PageKey) -> Option<(PathBuf, u64, usize)> {
        let e = *self.index.lock().get(key)?;
        let b = self.slabs.read()[e.loc.class as usize].slot_bytes;
        Some((
            self.opts.dir.join(slab_file_name(b)),
            e.loc.slot as u64 * b,
            e.meta.len,
        ))
    }

    /// Builds the requests moving one page between `parts` (in order) and the slot at
    /// `offset` of `slab`. Aligned parts go directly (fixed buffers when registered);
    /// otherwise a bounce buffer of the slot's size is used (for writes, filled here).
    fn plan(
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
            tag,
        };
        let iov = |a: usize, l: usize| libc::iovec {
            iov_base: a as *mut libc::c_void,
            iov_len: l,
        };
        let mut reqs = Vec::new();
        if parts.iter().all(|&(a, l)| aligned(a, l)) {
            let reg = self.ring.registered();
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

    fn set_blocking(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Vec<PageOutcome> {
        let n = keys.len();
        let mut out: Vec<Option<PageOutcome>> = vec![None; n];
        let mut jobs: Vec<usize> = Vec::new();
        let mut dups: Vec<(usize, usize)> = Vec::new();
        {
            let mut ix = self.index.lock();
            let mut first: HashMap<PageKey, usize> = HashMap::new();
            for (i, (k, p)) in keys.iter().zip(src).enumerate() {
                if p.is_empty() {
                    out[i] = Some(PageOutcome::Failed(PageError::EmptyPage));
                } else if slot_bytes(p.len()) > self.capacity {
                    out[i] = Some(PageOutcome::Failed(PageError::TooLarge {
                        len: p.len(),
                        max: self.max_page_bytes(),
                    }));
                } else if ix.get(k).is_some_and(|e| e.meta == p.meta()) {
                    ix.touch(k);
                    out[i] = Some(PageOutcome::Present);
                } else if let Some(&f) = first.get(k) {
                    dups.push((i, f));
                } else {
                    first.insert(*k, i);
                    jobs.push(i);
                }
            }
        }
        // Classes (creating slabs as needed), then slots.
        let mut locs: Vec<Option<Loc>> = vec![None; n];
        let mut classes: Vec<(usize, u16)> = Vec::with_capacity(jobs.len());
        for &i in &jobs {
            match self.class_of(slot_bytes(src[i].len())) {
                Ok(c) => classes.push((i, c)),
                Err(e) => {
                    out[i] = Some(PageOutcome::Failed(PageError::Backend(e.to_string())));
                }
            }
        }
        let slabs: Vec<Arc<Slab>> = self.slabs.read().clone();
        {
            let mut evicted = Vec::new();
            let mut ix = self.index.lock();
            for &(i, class) in &classes {
                match ix.reserve(class, &Disk(&slabs), &mut evicted) {
                    Ok(loc) => locs[i] = Some(loc),
                    Err(ReserveError::NoSpace) => {
                        out[i] = Some(PageOutcome::Failed(PageError::NoSpace));
                    }
                    Err(ReserveError::Io(e)) => {
                        out[i] = Some(PageOutcome::Failed(PageError::io("grow slab", &e)));
                    }
                }
            }
            if !evicted.is_empty() {
                bump(&self.counters.evicted_pages, evicted.len() as u64);
                bump(
                    &self.counters.evicted_bytes,
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
        }
        // Plans (bounce buffers filled), submission, checksums while the writes run.
        let dsync = self.opts.fsync == FsyncPolicy::Always;
        let mut plans: Vec<(usize, Plan)> = Vec::new();
        for i in 0..n {
            let Some(loc) = locs[i] else { continue };
            let slab = &slabs[loc.class as usize];
            let parts: Vec<(usize, usize)> = src[i]
                .parts()
                .iter()
                .map(|p| (p.as_ptr() as usize, p.len()))
                .collect();
            let mut plan = self.plan(
                Dir::Write,
                i,
                slab,
                loc.slot as u64 * slab.slot_bytes,
                &parts,
                dsync,
            );
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
        {
            let reqs: Vec<Req> = plans
                .iter_mut()
                .flat_map(|(_, p)| std::mem::take(&mut p.reqs))
                .collect();
            let mut pending: Pending = self.ring.submit(reqs);
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
        }
        for (_, p) in plans {
            if let Some(b) = p.bounce {
                self.pool.put(b);
            }
        }
        // Data durability (batch): one fdatasync per slab touched.
        if self.opts.fsync == FsyncPolicy::Batch {
            let mut touched: Vec<u16> = (0..n)
                .filter(|&i| locs[i].is_some() && results[i].is_ok())
                .map(|i| locs[i].expect("filtered").class)
                .collect();
            touched.sort_unstable();
            touched.dedup();
            for c in touched {
                if let Err(e) = slabs[c as usize].file.sync_data() {
                    for i in 0..n {
                        if locs[i].is_some_and(|l| l.class == c) && results[i].is_ok() {
                            results[i] = Err(io::Error::new(e.kind(), e.to_string()));
                        }
                    }
                }
            }
        }
        // Commit: index records first (synced per policy), then visibility.
        let committed: Vec<usize> = (0..n)
            .filter(|&i| locs[i].is_some() && results[i].is_ok())
            .collect();
        {
            let mut log = self.log.lock();
            let mut ix = self.index.lock();
            let mut recs: Vec<[u8; format::RECORD_LEN]> =
                self.dels.lock().drain(..).map(|r| r.encode()).collect();
            let mut entries = Vec::with_capacity(committed.len());
            for &i in &committed {
                let loc = locs[i].expect("committed pages have slots");
                let e = Entry {
                    loc,
                    meta: src[i].meta(),
                    sum: sums[i],
                    seq: ix.next_seq(),
                };
                recs.push(
                    Record::Put(Put {
                        seq: e.seq,
                        key: keys[i],
                        meta: e.meta,
                        slot_bytes: slabs[loc.class as usize].slot_bytes,
                        slot: loc.slot as u64,
                        sum: e.sum,
                    })
                    .encode(),
                );
                entries.push((i, e));
            }
            let sync = self.opts.fsync != FsyncPolicy::None;
            match log.append(&recs, sync && !committed.is_empty()) {
                Ok(()) => {
                    for (i, e) in entries {
                        ix.commit(keys[i], e);
                        out[i] = Some(PageOutcome::Stored);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "uring backend: index log append failed");
                    for (i, _) in entries {
                        results[i] = Err(io::Error::new(e.kind(), format!("index log: {e}")));
                    }
                }
            }
            for i in 0..n {
                if let (Some(loc), Err(e)) = (locs[i], &results[i]) {
                    ix.abort(loc);
                    tracing::warn!(key = %keys[i], error = %e, "uring backend: page write failed");
                    out[i] = Some(PageOutcome::Failed(PageError::Io {
                        op: "write",
                        detail: e.to_string(),
                    }));
                }
            }
            if log.records() > 2 * ix.len() as u64 + COMPACT_SLACK {
                match log.compact(&Self::live_puts(&ix)) {
                    Ok(()) => {
                        self.compactions.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => tracing::warn!(error = %e, "uring backend: log compaction failed"),
                }
            }
        }
        for (i, f) in dups {
            out[i] = Some(match out[f].clone() {
                Some(PageOutcome::Stored) => PageOutcome::Present,
                Some(o) => o,
                None => PageOutcome::Failed(PageError::Backend(
                    "internal: duplicate without outcome".into(),
                )),
            });
        }
        out.into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    PageOutcome::Failed(PageError::Backend("internal: no outcome".into()))
                })
            })
            .collect()
    }

    fn get_blocking(&self, keys: &[PageKey], dst: &mut [PageBufMut<'_>]) -> Vec<PageOutcome> {
        let n = keys.len();
        let mut out: Vec<Option<PageOutcome>> = vec![None; n];
        let mut found: Vec<Option<Entry>> = vec![None; n];
        {
            let mut ix = self.index.lock();
            for (i, (k, d)) in keys.iter().zip(dst.iter()).enumerate() {
                match ix.get(k).copied() {
                    None => out[i] = Some(PageOutcome::Miss),
                    Some(e) if e.meta != d.meta() => {
                        bump(&self.counters.meta_mismatches, 1);
                        out[i] = Some(PageOutcome::Miss);
                    }
                    Some(e) => {
                        ix.touch(k);
                        ix.pin(e.loc);
                        found[i] = Some(e);
                    }
                }
            }
        }
        let slabs: Vec<Arc<Slab>> = self.slabs.read().clone();
        let mut plans: Vec<Option<Plan>> = (0..n).map(|_| None).collect();
        let mut left = vec![0usize; n];
        let mut reqs = Vec::new();
        for i in 0..n {
            let Some(e) = found[i] else { continue };
            let slab = &slabs[e.loc.class as usize];
            let parts: Vec<(usize, usize)> = dst[i]
                .parts_mut()
                .iter_mut()
                .map(|p| (p.as_mut_ptr() as usize, p.len()))
                .collect();
            let mut plan = self.plan(
                Dir::Read,
                i,
                slab,
                e.loc.slot as u64 * slab.slot_bytes,
                &parts,
                false,
            );
            left[i] = plan.reqs.len();
            reqs.append(&mut plan.reqs);
            plans[i] = Some(plan);
        }
        let mut errors: Vec<Option<io::Error>> = (0..n).map(|_| None).collect();
        let mut corrupt: Vec<(PageKey, u64)> = Vec::new();
        {
            let mut pending = self.ring.submit(reqs);
            if let Some((_, why)) = pending.not_submitted() {
                for i in 0..n {
                    if found[i].is_some() {
                        errors[i] = Some(io::Error::other(why.clone()));
                        left[i] = 0;
                        out[i] = Some(PageOutcome::Failed(PageError::Io {
                            op: "read",
                            detail: why.clone(),
                        }));
                    }
                }
            }
            // Verify each page as soon as its last request completes.
            while let Some((i, r)) = pending.wait_next() {
                if let Err(e) = r
                    && errors[i].is_none()
                {
                    errors[i] = Some(e);
                }
                left[i] -= 1;
                if left[i] > 0 {
                    continue;
                }
                let e = found[i].expect("requests only for found pages");
                let d = &mut dst[i];
                out[i] = Some(match errors[i].take() {
                    Some(err) if err.kind() == io::ErrorKind::UnexpectedEof => {
                        tracing::warn!(key = %keys[i], error = %err, "uring backend: slot cut short");
                        d.zero();
                        corrupt.push((keys[i], e.seq));
                        PageOutcome::Corrupt
                    }
                    Some(err) => {
                        tracing::warn!(key = %keys[i], error = %err, "uring backend: read failed");
                        PageOutcome::Failed(PageError::io("read", &err))
                    }
                    None => {
                        let ok = match plans[i].as_ref().and_then(|p| p.bounce.as_ref()) {
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
                            tracing::warn!(key = %keys[i], "uring backend: checksum mismatch, page dropped");
                            d.zero();
                            corrupt.push((keys[i], e.seq));
                            PageOutcome::Corrupt
                        }
                    }
                });
            }
        }
        for p in plans.into_iter().flatten() {
            if let Some(b) = p.bounce {
                self.pool.put(b);
            }
        }
        {
            let mut ix = self.index.lock();
            for e in found.iter().flatten() {
                ix.unpin(e.loc);
            }
            if !corrupt.is_empty() {
                let mut dels = self.dels.lock();
                for (k, seq) in corrupt {
                    if ix.remove_version(&k, seq).is_some() {
                        dels.push(Record::Del {
                            seq: ix.next_seq(),
                            key: k,
                        });
                    }
                }
            }
        }
        out.into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    PageOutcome::Failed(PageError::Backend("internal: no outcome".into()))
                })
            })
            .collect()
    }

    fn max_page_bytes(&self) -> usize {
        usize::try_from(self.capacity / ALIGN as u64 * ALIGN as u64).unwrap_or(usize::MAX)
    }
}

impl Drop for UringBackend {
    fn drop(&mut self) {
        // Records of evictions and dropped pages not yet logged (they ride on the next append
        // otherwise); unlogged ones would only bring back pages whose slots may be reused.
        let recs: Vec<[u8; format::RECORD_LEN]> =
            self.dels.get_mut().drain(..).map(|r| r.encode()).collect();
        if let Err(e) = self.log.get_mut().append(&recs, false) {
            tracing::warn!(error = %e, "uring backend: index log append at close failed");
        }
    }
}

#[async_trait]
impl Storage for UringBackend {
    fn info(&self) -> BackendInfo {
        let mut i = BackendInfo::new(NAME, self.opts.max_batch);
        i.zero_copy = true;
        i.persistent = true;
        i.shared = false;
        i.capacity_bytes = Some(self.capacity);
        i.max_page_bytes = self.max_page_bytes();
        i
    }

    async fn batch_exists(&self, keys: &[PageKey]) -> Result<usize> {
        check_batch("batch_exists", self.opts.max_batch, keys.len(), keys.len())?;
        let hits = {
            let ix = self.index.lock();
            keys.iter().take_while(|k| ix.contains(k)).count()
        };
        self.counters
            .record_exists((hits + 1).min(keys.len()), hits);
        Ok(hits)
    }

    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> Result<Vec<PageOutcome>> {
        check_batch("batch_get", self.opts.max_batch, keys.len(), dst.len())?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let out = blocking(|| self.get_blocking(keys, dst));
        self.counters.record_get(&out, dst.iter().map(|d| d.len()));
        Ok(out)
    }

    async fn batch_set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Result<Vec<PageOutcome>> {
        check_batch("batch_set", self.opts.max_batch, keys.len(), src.len())?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let out = blocking(|| self.set_blocking(keys, src));
        self.counters.record_set(&out, src.iter().map(|p| p.len()));
        Ok(out)
    }

    fn register_memory(&self, region: MemoryRegion) -> Result<()> {
        if !self.opts.fixed_buffers || region.len == 0 {
            return Ok(());
        }
        match self.ring.register_buffers(region.addr, region.len) {
            Ok(()) => {
                tracing::info!(
                    bytes = region.len,
                    "uring backend: host pool registered as fixed buffers"
                );
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(backend_err(format!(
                "register_memory called twice with different regions: {e}"
            ))),
            Err(e) => {
                // Pages still move (READV/WRITEV), only without the registered fast path.
                tracing::warn!(
                    error = %e,
                    bytes = region.len,
                    "uring backend: registering the host pool as fixed buffers failed (RLIMIT_MEMLOCK?); \
                     using unregistered I/O"
                );
                Ok(())
            }
        }
    }

    async fn delete(&self, keys: &[PageKey]) -> Result<usize> {
        let n = blocking(|| {
            let mut log = self.log.lock();
            let mut recs: Vec<[u8; format::RECORD_LEN]> =
                self.dels.lock().drain(..).map(|r| r.encode()).collect();
            let mut n = 0;
            {
                let mut ix = self.index.lock();
                for k in keys {
                    if ix.remove(k).is_some() {
                        n += 1;
                        recs.push(
                            Record::Del {
                                seq: ix.next_seq(),
                                key: *k,
                            }
                            .encode(),
                        );
                    }
                }
            }
            if let Err(e) = log.append(&recs, self.opts.fsync == FsyncPolicy::Always) {
                tracing::warn!(error = %e, "uring backend: index log append (delete) failed");
            }
            n
        });
        bump(&self.counters.deleted_pages, n as u64);
        Ok(n)
    }

    fn stats(&self) -> StorageStats {
        let (pages, bytes) = {
            let ix = self.index.lock();
            (ix.len() as u64, ix.data_bytes())
        };
        self.counters.snapshot(pages, bytes, Some(self.capacity))
    }
}

/// Registers [`UringBackend`] as `uring`.
#[derive(Copy, Clone, Debug, Default)]
pub struct UringFactory;

#[async_trait]
impl BackendFactory for UringFactory {
    fn name(&self) -> &str {
        NAME
    }

    async fn open(
        &self,
        common: &CommonConfig,
        fields: ConfigFields,
        ctx: &BackendContext,
    ) -> Result<Arc<dyn Storage>> {
        let mut opts = UringOptions::from_config(common, fields)?;
        if opts.page_bytes.is_none() && ctx.page_bytes > 0 {
            opts.page_bytes = Some(ctx.page_bytes as u64);
        }
        let backend = tokio::task::spawn_blocking(move || UringBackend::open(opts))
            .await
            .map_err(|e| backend_err(format!("open task failed: {e}")))??;
        Ok(Arc::new(backend))
    }
}

/// Adds the uring backend to `registry` (one call, as any third-party backend would).
pub fn register(registry: &Registry) -> Result<()> {
    registry.register(UringFactory)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unavailable_io_uring_names_the_file_backend() {
        let e = unavailable(&io::Error::from_raw_os_error(libc::EPERM)).to_string();
        assert!(
            e.contains("io_uring is unavailable")
                && e.contains("`file` backend")
                && e.contains("uring"),
            "{e}"
        );
    }

    #[test]
    fn plans_pick_fixed_vectored_or_bounce() {
        let dir = tempfile::tempdir().unwrap();
        let mut o = UringOptions::new(dir.path());
        o.capacity_bytes = Some(64 << 20);
        let s = UringBackend::open(o).unwrap();
        let class = s.class_of(8192).unwrap();
        let slab = s.slabs.read()[class as usize].clone();
        let mut region = AlignedBuf::zeroed(1 << 20);
        let base = region.as_mut_ptr() as usize;
        // Unregistered, aligned, two parts: one vectored request.
        let p = s.plan(
            Dir::Write,
            0,
            &slab,
            0,
            &[(base, 4096), (base + 8192, 4096)],
            false,
        );
        assert_eq!(
            (p.reqs.len(), p.reqs[0].iov.len(), p.bounce.is_some()),
            (1, 2, false)
        );
        // Unaligned: a bounce buffer of the slot's size.
        let p = s.plan(Dir::Read, 0, &slab, 8192, &[(base + 1, 5000)], false);
        assert!(p.bounce.as_ref().is_some_and(|b| b.len() == 8192));
        assert_eq!(p.reqs[0].offset, 8192);
        // Registered: one fixed request per part.
        s.register_memory(MemoryRegion {
            addr: base,
            len: region.len(),
            cuda_registered: false,
            huge_pages: false,
        })
        .unwrap();
        let p = s.plan(
            Dir::Write,
            0,
            &slab,
            0,
            &[(base, 4096), (base + 8192, 4096)],
            true,
        );
        assert_eq!(p.reqs.len(), 2);
        assert!(p.reqs.iter().all(|r| r.fixed_buf == Some(0) && r.dsync));
        assert_eq!(p.reqs[1].offset, 4096);
        // Partly outside the region: not fixed.
        let p = s.plan(
            Dir::Write,
            0,
            &slab,
            0,
            &[(base + (1 << 20) - 4096, 8192)],
            false,
        );
        assert!(p.reqs.iter().all(|r| r.fixed_buf.is_none()));
    }
}
