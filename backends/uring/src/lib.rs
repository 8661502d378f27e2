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
//!    when every byte moved ([`hicache_localio::ring`] invariant 4).
//! 5. **Buffers outlive I/O.** Calls block (through `block_in_place` on a multi-threaded tokio
//!    runtime, so the runtime's other tasks move to other workers) until every request they
//!    submitted has completed, including on error paths ([`hicache_localio::ring`] invariant 1).
//! 6. **One owner.** The directory is locked (`flock`) by one process; a second opener gets an
//!    error naming the directory.
//! 7. **Bounded.** Slab blocks in use stay within the capacity ([`index`] invariant 2).
#![warn(missing_docs)]

mod commit;
pub mod format;
pub mod index;
pub mod log;
mod open;
pub mod options;
mod plan;
mod read;
mod slab;
mod write;

use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use async_trait::async_trait;
use hicache_localio::par::blocking;
use hicache_localio::{BufPool, Ring};
use hicache_storage::backend::bump;
use hicache_storage::lifecycle::Reclaimer;
use hicache_storage::{
    BackendContext, BackendFactory, BackendInfo, CommonConfig, ConfigFields, MemoryRegion,
    NamespaceId, PageBuf, PageBufMut, PageKey, PageOutcome, Registry, Result, StatsCounters,
    Storage, StorageError, StorageStats, check_batch,
};
use parking_lot::{Mutex, RwLock};
use tracing::instrument;

use crate::format::{ALIGN, Record, slab_file_name};
use crate::index::Index;
use crate::log::IndexLog;
pub use crate::options::{FsyncPolicy, UringOptions};
use crate::slab::Slab;

pub(crate) const NAME: &str = "uring";
/// Log records beyond twice the live pages that trigger a compaction.
pub(crate) const COMPACT_SLACK: u64 = 1 << 16;

pub(crate) fn backend_err(reason: impl Into<String>) -> StorageError {
    StorageError::backend(NAME, reason)
}

/// A backend error caused by `cause`, which stays reachable as its `source()`.
pub(crate) fn backend_err_caused(
    reason: impl Into<String>,
    cause: impl std::error::Error + Send + Sync + 'static,
) -> StorageError {
    StorageError::backend_caused(NAME, reason, cause)
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

/// The uring backend. See the [crate documentation](crate).
pub struct UringBackend {
    // Dropped first: the ring thread ends before the slab files close.
    ring: Ring,
    opts: UringOptions,
    capacity: u64,
    slabs: RwLock<Vec<Arc<Slab>>>,
    new_slab: Mutex<()>,
    index: Arc<Mutex<Index>>,
    log: Mutex<IndexLog>,
    dels: Arc<Mutex<Vec<Record>>>,
    counters: Arc<StatsCounters>,
    /// The background reclaim thread (watermark eviction); none without watermarks or in a
    /// read-only open. Stopped and joined first when the backend drops, so its `del` records
    /// are in `dels` before the last append.
    reclaimer: Option<Reclaimer>,
    bounced: std::sync::atomic::AtomicU64,
    compactions: std::sync::atomic::AtomicU64,
    pool: BufPool,
    commit: commit::GroupCommit,
    report: OpenReport,
    /// The directory lock (none for a read-only open of a directory without a lock file).
    _lock: Option<File>,
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

impl UringBackend {
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

    /// The error for a write to a read-only instance ([`UringOptions::read_only`]).
    fn refuse_if_read_only(&self, op: &str) -> Result<()> {
        if self.opts.read_only {
            return Err(backend_err(format!(
                "{op} refused: {} was opened read-only (\"read_only\": true)",
                self.opts.dir.display()
            )));
        }
        Ok(())
    }

    /// Starts the reclaim thread when watermarks are set (not for a read-only open) and asks
    /// it for a first pass. A pass takes pages out of the index in eviction order, 64 per hold
    /// of the index lock, until page bytes are at most `low × capacity`, and queues a `del`
    /// record for each (appended with the next index-log write, as evictions by writes are).
    /// It does no I/O, so batches only ever wait for one chunk's bookkeeping.
    pub(crate) fn start_reclaimer(&mut self) -> Result<()> {
        let Some(w) = self.opts.watermarks else {
            return Ok(());
        };
        if self.opts.read_only {
            return Ok(());
        }
        let (_, low) = w.bytes(self.capacity);
        let (index, dels, counters) =
            (self.index.clone(), self.dels.clone(), self.counters.clone());
        let pass = move || {
            loop {
                let mut evicted = Vec::new();
                let reached = {
                    let mut ix = index.lock();
                    let reached = ix.evict_down_to(low, 64, &mut evicted);
                    let mut d = dels.lock();
                    for (key, _) in &evicted {
                        d.push(Record::Del {
                            seq: ix.next_seq(),
                            key: *key,
                        });
                    }
                    reached
                };
                bump(&counters.evicted_pages, evicted.len() as u64);
                bump(
                    &counters.evicted_bytes,
                    evicted.iter().map(|(_, e)| e.meta.len as u64).sum(),
                );
                if reached {
                    break;
                }
            }
        };
        let r = Reclaimer::spawn("hicache-uring-reclaim", None, pass)
            .map_err(|e| backend_err(format!("cannot start the reclaim thread: {e}")))?;
        r.wake();
        self.reclaimer = Some(r);
        Ok(())
    }

    /// Wakes the reclaim thread when page bytes exceed the high watermark.
    fn check_watermark(&self) {
        if let (Some(w), Some(r)) = (self.opts.watermarks, &self.reclaimer) {
            let (high, _) = w.bytes(self.capacity);
            if self.index.lock().data_bytes() > high {
                r.wake();
            }
        }
    }

    /// Waits at most `timeout` until the reclaim thread has no pass asked for or running;
    /// returns whether it got there (true at once without one). For tools and tests.
    pub fn wait_reclaimed(&self, timeout: std::time::Duration) -> bool {
        self.reclaimer.as_ref().is_none_or(|r| r.wait_idle(timeout))
    }

    pub(crate) fn max_page_bytes(&self) -> usize {
        usize::try_from(self.capacity / ALIGN as u64 * ALIGN as u64).unwrap_or(usize::MAX)
    }
}

impl Drop for UringBackend {
    fn drop(&mut self) {
        drop(self.reclaimer.take());
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

#[async_trait]
impl Storage for UringBackend {
    fn info(&self) -> BackendInfo {
        let mut i = BackendInfo::new(NAME, self.opts.max_batch);
        i.zero_copy = true;
        i.persistent = true;
        i.shared = false;
        i.capacity_bytes = Some(self.capacity);
        i.max_page_bytes = self.max_page_bytes();
        i.clear = !self.opts.read_only;
        i
    }

    #[instrument(name = "uring.batch_exists", skip_all, fields(pages = keys.len()))]
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

    #[instrument(name = "uring.batch_get", skip_all, fields(pages = keys.len()))]
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

    #[instrument(name = "uring.batch_set", skip_all, fields(pages = keys.len()))]
    async fn batch_set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Result<Vec<PageOutcome>> {
        check_batch("batch_set", self.opts.max_batch, keys.len(), src.len())?;
        self.refuse_if_read_only("batch_set")?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let out = blocking(|| self.set_blocking(keys, src));
        self.check_watermark();
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
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(backend_err_caused(
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

    #[instrument(name = "uring.delete", skip_all, fields(pages = keys.len()))]
    async fn delete(&self, keys: &[PageKey]) -> Result<usize> {
        self.refuse_if_read_only("delete")?;
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

    /// Crash safety: the cleared pages leave the index at once and a `del` record for each
    /// is appended to the index log and synced (unless `fsync: none`) before the call
    /// returns. A crash before the append leaves each page intact (its `put` record and
    /// slot untouched, or a reused slot that fails its checksum: a miss); one during it
    /// leaves a prefix of the `del`s (a torn record tail is cut at open), so every page of
    /// the namespace is either intact or absent.
    #[instrument(name = "uring.clear", skip_all)]
    async fn clear(&self, namespace: NamespaceId) -> Result<u64> {
        self.refuse_if_read_only("clear")?;
        let n = blocking(|| {
            let mut log = self.log.lock();
            let mut recs: Vec<[u8; format::RECORD_LEN]> =
                self.dels.lock().drain(..).map(|r| r.encode()).collect();
            let mut n = 0u64;
            {
                let mut ix = self.index.lock();
                let doomed: Vec<PageKey> = ix
                    .entries_by_seq()
                    .into_iter()
                    .map(|(k, _)| k)
                    .filter(|k| k.namespace == namespace)
                    .collect();
                for k in doomed {
                    if ix.remove(&k).is_some() {
                        n += 1;
                        recs.push(
                            Record::Del {
                                seq: ix.next_seq(),
                                key: k,
                            }
                            .encode(),
                        );
                    }
                }
            }
            log.append(&recs, self.opts.fsync != FsyncPolicy::None)
                .map(|()| n)
        })
        .map_err(StorageError::io(
            "clear: append to the index log in",
            &self.opts.dir,
        ))?;
        bump(&self.counters.cleared_pages, n);
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
            .map_err(|e| backend_err_caused("open task failed", e))??;
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
    use crate::open::unavailable;

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
        let mut region = hicache_localio::AlignedBuf::zeroed(1 << 20);
        let base = region.as_mut_ptr() as usize;
        // Unregistered, aligned, two parts: one vectored request.
        let p = s.plan(
            hicache_localio::ring::Dir::Write,
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
            hicache_localio::ring::Dir::Read,
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
            hicache_localio::ring::Dir::Write,
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
            hicache_localio::ring::Dir::Write,
            0,
            &slab,
            0,
            &[(base + (1 << 20) - 4096, 8192)],
            false,
        );
        assert!(p.reqs.iter().all(|r| r.fixed_buf.is_none()));
    }
}
