//! The `slab` layout (registry name `uring`): an L3 backend of hicache-rs for local NVMe: pages live in preallocated slab files opened
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
//! use hicache_backend_local::slab::{UringBackend, UringOptions};
//! use hicache_storage::{LayoutKind, Storage, StorageExt, pattern};
//! let mut options = UringOptions::new("/nvme/hicache");
//! options.capacity_bytes = Some(500 << 30);
//! let storage = UringBackend::open(options)?;
//! let key = pattern::page_key(pattern::namespace(1), 7, 0);
//! storage.put(LayoutKind::PageFirst, key, &pattern::page_bytes(&key, 1 << 20)).await?;
//! # Ok(()) }
//! ```
//!
//! The on-disk format (slabs and the index log) is described in [`format`](mod@format).
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
//!    when every byte moved ([`crate::io::ring`] invariant 4).
//! 5. **Buffers outlive I/O.** Calls block (through `block_in_place` on a multi-threaded tokio
//!    runtime, so the runtime's other tasks move to other workers) until every request they
//!    submitted has completed, including on error paths ([`crate::io::ring`] invariant 1).
//! 6. **One owner.** The directory is locked (`flock`) by one process; a second opener gets an
//!    error naming the directory.
//! 7. **Bounded.** Slab blocks in use stay within the capacity ([`index`] invariant 2).

mod commit;
mod engine;
pub mod format;
pub mod index;
pub mod log;
mod open;
pub mod options;
mod plan;
mod read;
mod reclaim;
mod slabfile;
mod write;

use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hicache_storage::lifecycle::Clock;
use hicache_storage::{
    BackendContext, CommonConfig, ConfigFields, MemoryRegion, NamespaceId, Outcomes, PageBuf,
    PageBufMut, PageKey, PageOutcome, Result, StorageError,
};
use parking_lot::{Mutex, RwLock};

use crate::backend::{Factory, Layout, LocalBackend, Shape};
use crate::common::{Core, ReclaimStage, caused};
use crate::io::ring::RingCounters;
use crate::io::{BufPool, Ring};
use crate::slab::engine::Engine;
use crate::slab::format::{ALIGN, Record, slab_file_name};
use crate::slab::index::Index;
use crate::slab::log::IndexLog;
pub use crate::slab::options::{FsyncPolicy, UringOptions};
use crate::slab::slabfile::Slab;

pub(crate) const NAME: &str = "uring";
/// Log records beyond twice the live pages that trigger a compaction.
pub(crate) const COMPACT_SLACK: u64 = 1 << 16;
/// Nanoseconds per second (the clock counts nanoseconds, `put` records seconds).
pub(crate) const NANOS: u64 = 1_000_000_000;

/// A backend error of this layout.
pub(crate) fn backend_err(reason: impl Into<String>) -> StorageError {
    StorageError::backend(NAME, reason)
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
    /// Whether io_uring carries the I/O (else the threads engine, with no request counters).
    pub uring: bool,
}

/// The `uring` layout's state: slab files, the index and its log, the ring and the stages.
/// The storage backend over it is [`UringBackend`]; see the [module documentation](self).
pub struct Slabs {
    // Dropped first: the ring thread ends before the slab files close.
    engine: Engine,
    opts: UringOptions,
    slabs: RwLock<Vec<Arc<Slab>>>,
    new_slab: Mutex<()>,
    log: Mutex<IndexLog>,
    dels: Arc<Mutex<Vec<Record>>>,
    /// The read-only guard and the counters (what the generic backend reads).
    core: Core<Index>,
    /// The background reclaim stage (expiry and watermark eviction); no thread without
    /// `ttl_s` or watermarks, or in a read-only open. Stopped and joined first when the
    /// backend drops, so its `del` records are in `dels` before the last append.
    reclaim: ReclaimStage,
    bounced: std::sync::atomic::AtomicU64,
    compactions: std::sync::atomic::AtomicU64,
    pool: BufPool,
    commit: commit::GroupCommit,
    report: OpenReport,
    /// Time as expiry (`ttl_s`) sees it.
    clock: Clock,
    /// The directory lock (none for a read-only open of a directory without a lock file).
    _lock: Option<File>,
}

impl Slabs {
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
        let ring = self.engine.ring();
        let count = |f: fn(&RingCounters) -> &AtomicU64| {
            ring.map_or(0, |r| f(r.counters()).load(Ordering::Relaxed))
        };
        IoStats {
            fixed_requests: count(|c| &c.fixed),
            vectored_requests: count(|c| &c.vectored),
            plain_requests: count(|c| &c.plain),
            bounced_pages: self.bounced.load(Ordering::Relaxed),
            short_transfers: count(|c| &c.short),
            registered_bytes: ring.and_then(Ring::registered).map_or(0, |r| r.len as u64),
            compactions: self.compactions.load(Ordering::Relaxed),
            uring: ring.is_some(),
        }
    }

    /// Where `key`'s bytes lie: slab path, byte offset and page length (for tools and tests
    /// that inspect or damage the medium).
    pub fn page_location(&self, key: &PageKey) -> Option<(PathBuf, u64, usize)> {
        let e = *self.core.index.lock().get(key)?;
        let b = self.slabs.read()[e.loc.class as usize].slot_bytes;
        Some((
            self.opts.dir.join(slab_file_name(b)),
            e.loc.slot as u64 * b,
            e.meta.len,
        ))
    }

    /// Now, in Unix seconds of the backend's clock (the write time `put` records hold).
    pub(crate) fn now_secs(&self) -> u64 {
        self.clock.now() / NANOS
    }

    /// Whether a page written at `written` (Unix seconds) is expired under `ttl_s` now.
    pub(crate) fn is_expired(&self, written: u64) -> bool {
        self.clock
            .expired(written.saturating_mul(NANOS), self.opts.ttl)
    }

    /// Asks the reclaim thread for a pass (a batch met an expired page).
    pub(crate) fn wake_reclaimer(&self) {
        self.reclaim.wake();
    }

    /// Starts the reclaim stage (see [`ReclaimStage::start`]) with a [`reclaim::Reclaim`]
    /// pass over this instance's index.
    pub(crate) fn start_reclaimer(&mut self) -> Result<()> {
        let pass = reclaim::Reclaim {
            ttl: self.opts.ttl,
            low: self.opts.watermarks.map(|w| w.bytes(self.core.capacity).1),
            index: self.core.index.clone(),
            dels: self.dels.clone(),
            counters: self.core.counters.clone(),
            clock: self.clock.clone(),
        };
        self.reclaim = ReclaimStage::start(
            "hicache-uring-reclaim",
            self.opts.read_only,
            self.opts.ttl,
            self.opts.watermarks,
            self.core.capacity,
            move || pass.pass(),
        )
        .map_err(|e| e.into_storage(NAME))?;
        Ok(())
    }

    /// Wakes the reclaim thread when page bytes exceed the high watermark.
    fn check_watermark(&self) {
        self.reclaim
            .check_watermark(|| self.core.index.lock().data_bytes());
    }

    /// Waits at most `timeout` until the reclaim thread has no pass asked for or running;
    /// returns whether it got there (true at once without one). For tools and tests.
    pub fn wait_reclaimed(&self, timeout: std::time::Duration) -> bool {
        self.reclaim.wait_idle(timeout)
    }

    pub(crate) fn max_page_bytes(&self) -> usize {
        usize::try_from(self.core.capacity / ALIGN as u64 * ALIGN as u64).unwrap_or(usize::MAX)
    }
}

impl Drop for Slabs {
    fn drop(&mut self) {
        self.reclaim.stop();
        if self.opts.read_only {
            return;
        }
        // Records of evictions and dropped pages not yet logged (they ride on the next append
        // otherwise); unlogged ones would only bring back pages whose slots may be reused.
        let recs: Vec<[u8; format::RECORD_LEN]> =
            self.dels.lock().drain(..).map(|r| r.encode()).collect();
        if let Err(e) = self.log.get_mut().append(&recs, false) {
            tracing::warn!(error = %e, "uring backend: index log append at close failed");
        }
    }
}

impl Layout for Slabs {
    const NAME: &'static str = NAME;
    type Options = UringOptions;

    /// The engine's page size, when it gives one, is the default `page_bytes` (its slab is
    /// created at open).
    fn options(c: &CommonConfig, f: ConfigFields, ctx: &BackendContext) -> Result<UringOptions> {
        let mut opts = UringOptions::from_config(c, f)?;
        if opts.page_bytes.is_none() && ctx.page_bytes > 0 {
            opts.page_bytes = Some(ctx.page_bytes as u64);
        }
        Ok(opts)
    }

    fn open_with_clock(opts: UringOptions, clock: Clock) -> Result<Self> {
        Self::open_at(opts, clock)
    }

    fn shape(&self) -> Shape {
        Shape {
            max_batch: self.opts.max_batch,
            zero_copy: true,
            shared: false,
            max_page_bytes: self.max_page_bytes(),
        }
    }

    type Index = Index;

    fn core(&self) -> &Core<Index> {
        &self.core
    }

    fn exists(&self, keys: &[PageKey]) -> usize {
        let hits = {
            let ix = self.core.index.lock();
            keys.iter()
                .take_while(|k| ix.get(k).is_some_and(|e| !self.is_expired(e.written)))
                .count()
        };
        if hits < keys.len() && self.core.index.lock().get(&keys[hits]).is_some() {
            // The run ended at an expired page: the reclaim thread deletes it.
            self.wake_reclaimer();
        }
        hits
    }

    fn get(&self, keys: &[PageKey], dst: &mut [PageBufMut<'_>], out: &mut Outcomes) {
        self.read_slots(keys, dst, out)
    }

    fn set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Vec<PageOutcome> {
        let out = self.set_blocking(keys, src);
        self.check_watermark();
        out
    }

    fn register_memory(&self, region: MemoryRegion) -> Result<()> {
        if !self.opts.fixed_buffers || region.len == 0 {
            return Ok(());
        }
        let Some(ring) = self.engine.ring() else {
            // The threads engine has no registered buffers; pages move all the same.
            return Ok(());
        };
        match ring.register_buffers(region.addr, region.len) {
            Ok(()) => {
                tracing::info!(
                    bytes = region.len,
                    "uring backend: host pool registered as fixed buffers"
                );
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(caused(
                NAME,
                "register_memory called twice with different regions",
                e,
            )),
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

    fn delete(&self, keys: &[PageKey]) -> usize {
        let sync = self.opts.fsync == FsyncPolicy::Always;
        match self.remove_and_log(keys.iter().copied(), sync) {
            Ok(n) => n as usize,
            Err((n, e)) => {
                tracing::warn!(error = %e, "uring backend: index log append (delete) failed");
                n as usize
            }
        }
    }

    /// Crash safety: the cleared pages leave the index at once and a `del` record for each
    /// is appended to the index log and synced (unless `fsync: none`) before the call
    /// returns. A crash before the append leaves each page intact (its `put` record and
    /// slot untouched, or a reused slot that fails its checksum: a miss); one during it
    /// leaves a prefix of the `del`s (a torn record tail is cut at open), so every page of
    /// the namespace is either intact or absent.
    fn clear(&self, namespace: NamespaceId) -> Result<u64> {
        let doomed: Vec<PageKey> = self
            .core
            .index
            .lock()
            .entries_by_seq()
            .into_iter()
            .map(|(k, _)| k)
            .filter(|k| k.namespace == namespace)
            .collect();
        self.remove_and_log(doomed, self.opts.fsync != FsyncPolicy::None)
            .map_err(|(_, e)| {
                StorageError::io("clear: append to the index log in", &self.opts.dir)(e)
            })
    }
}

impl Slabs {
    /// Removes `keys` from the index and appends a `del` record for each one present (after
    /// the queued `del`s of evictions) to the index log, synced when `sync`. Returns how many
    /// were present, with the append's error if it failed.
    fn remove_and_log(
        &self,
        keys: impl IntoIterator<Item = PageKey>,
        sync: bool,
    ) -> std::result::Result<u64, (u64, io::Error)> {
        let mut log = self.log.lock();
        let mut recs: Vec<[u8; format::RECORD_LEN]> =
            self.dels.lock().drain(..).map(|r| r.encode()).collect();
        let mut n = 0;
        {
            let mut ix = self.core.index.lock();
            for key in keys {
                if ix.remove(&key).is_some() {
                    n += 1;
                    let seq = ix.next_seq();
                    recs.push(Record::Del { seq, key }.encode());
                }
            }
        }
        log.append(&recs, sync).map(|()| n).map_err(|e| (n, e))
    }
}

/// The `uring` layout as a storage backend. See the [module documentation](self).
pub type UringBackend = LocalBackend<Slabs>;

/// Registers [`UringBackend`] as `uring`.
pub type UringFactory = Factory<Slabs>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slab::open::unavailable;

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
        let mut region = crate::io::AlignedBuf::zeroed(1 << 20);
        let base = region.as_mut_ptr() as usize;
        // Unregistered, aligned, two parts: one vectored request.
        let p = s.plan(
            crate::io::ring::Dir::Write,
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
        let p = s.plan(
            crate::io::ring::Dir::Read,
            0,
            &slab,
            8192,
            &[(base + 1, 5000)],
            false,
        );
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
            crate::io::ring::Dir::Write,
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
            crate::io::ring::Dir::Write,
            0,
            &slab,
            0,
            &[(base + (1 << 20) - 4096, 8192)],
            false,
        );
        assert!(p.reqs.iter().all(|r| r.fixed_buf.is_none()));
    }
}
