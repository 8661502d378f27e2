//! The `pages` layout (registry name `file`): an L3 backend of hicache-rs on a local (or shared) file system: one file per page, written
//! crash-safely, verified on every read, bounded by a capacity with eviction, recovered on
//! restart, and usable by several processes at once. The on-disk format and the shared-mode
//! rules are in the crate README and in [`format`](mod@format).
//!
//! ```no_run
//! # async fn f() -> hicache_storage::Result<()> {
//! use hicache_backend_local::pages::{FileBackend, FileOptions};
//! use hicache_storage::{LayoutKind, Storage, StorageExt, pattern};
//! let mut options = FileOptions::new("/var/cache/hicache");
//! options.capacity_bytes = Some(100 << 30);
//! let storage = FileBackend::open(options)?;
//! let key = pattern::page_key(pattern::namespace(1), 7, 0);
//! storage.put(LayoutKind::PageFirst, key, &pattern::page_bytes(&key, 1 << 20)).await?;
//! # Ok(()) }
//! ```
//!
//! # Invariants
//! 1. **Visible only when complete.** A page is written to a file without a name
//!    (`O_TMPFILE`) in its final name's directory, synced per the fsync policy, then linked to
//!    it (where the file system lacks `O_TMPFILE`, or the final name exists, to a temp file
//!    beside it, `pages/<key>.<instance>.<n>.tmp`, renamed to it); a `.page` file is
//!    therefore always a complete write. Its header and data checksums are
//!    verified on every read, so even a file damaged after the fact (or, under `fsync: none`,
//!    torn by a power loss) reads as `Corrupt`, never as a hit.
//! 2. **Acknowledged means committed.** `Stored` is returned only after the link or rename
//!    (and, under `batch`/`always`, after data and directory syncs).
//! 3. **Bounded.** Committed plus in-flight file bytes never exceed the capacity in this
//!    process's view (see [`index`]); in shared mode the janitor bounds the directory total.
//! 4. **Recovered.** Opening scans `pages/`, keeps every file whose header and size check out,
//!    deletes the rest and every stale temp file, counting them in `discarded_on_open`.
//! 5. **One outcome, either driver.** Page I/O goes through the `io` engine's io_uring
//!    driver ([`IoEngine::Uring`]) or its thread pool ([`IoEngine::Threads`]); `auto` probes
//!    io_uring at open and falls back to threads. Both run the same stages (the crate is
//!    split by stage: `open`, `recover`, `write`, `read`, `janitor`) and verify reads the
//!    same way.
//! 6. **Merged barriers.** Under `fsync: batch` the directory syncs that make a batch's
//!    renames durable are merged with those of concurrent batches (one sync per directory
//!    for the group); every page of every batch in the group is acknowledged only after
//!    them.

pub mod format;
pub mod index;
mod janitor;
mod open;
pub mod options;
mod pageio;
mod read;
mod recover;
mod write;

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hicache_storage::{
    BackendContext, Clock, CommonConfig, ConfigFields, NamespaceId, Outcomes, PageBuf, PageBufMut,
    PageKey, PageOutcome, Result, StorageError,
};
use parking_lot::Mutex;

use crate::backend::{self, Factory, LocalBackend, Shape};
use crate::common::{self, Core, ReclaimStage};
use crate::io::{BufPool, DirFd, Driver, GroupCommit};
use crate::pages::format::{HEADER_LEN, Layout};
use crate::pages::index::Index;
pub use crate::pages::janitor::ReclaimHook;
use crate::pages::open::{check_capacity, remove_file};
pub use crate::pages::options::{BatchSync, DirectIo, FileOptions, FsyncPolicy, IoEngine};
use crate::pages::pageio::IoCtx;
use crate::pages::write::{DirSyncResult, DirSyncs};

const NAME: &str = "file";
/// Lock file in `tmp/` serialising instance registration and stale-temp cleanup.
const REGISTRY_LOCK: &str = "registry.lock";

/// What [`FileBackend::open`] found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// Committed pages indexed.
    pub pages: u64,
    /// Page files found invalid (bad header, wrong size, bad name) and deleted (a read-only
    /// open: that a read-write open would delete).
    pub discarded_pages: u64,
    /// Stale temp files (writes interrupted by a crash) deleted (read-only: would delete).
    pub discarded_temp: u64,
    /// Pages evicted at open because the capacity is below what the directory held.
    pub evicted: u64,
    /// Whether O_DIRECT is in use.
    pub direct: bool,
    /// Whether page I/O goes through io_uring (else through the threads engine).
    pub uring: bool,
}

/// The `file` layout's state: a directory of page files, its index, engine and stages. The
/// storage backend over it is [`FileBackend`]; see the [module documentation](self).
pub struct Pages {
    opts: FileOptions,
    paths: Layout,
    instance: String,
    instance_tmp: PathBuf,
    instance_lock_path: PathBuf,
    direct: bool,
    /// `pages/`, held open, where page files are created without a name and linked into
    /// place (`O_TMPFILE`, probed at open); `None`: created under a temp name and renamed.
    unnamed: Option<Arc<DirFd>>,
    driver: Box<dyn Driver>,
    uring: bool,
    rescan_bytes: u64,
    /// The read-only guard and the counters (what the generic backend reads).
    core: Core<Index>,
    /// Time as expiry (`ttl_s`) sees it.
    clock: Clock,
    /// The background reclaim stage (expiry, watermark eviction); no thread without a
    /// lifecycle option or in a read-only open. Stopped and joined first when the backend
    /// drops.
    reclaim: ReclaimStage,
    reclaim_hook: Arc<Mutex<Option<ReclaimHook>>>,
    bufs: BufPool,
    tmp_seq: AtomicU64,
    written_since_rescan: AtomicU64,
    commit: GroupCommit<DirSyncs, DirSyncResult>,
    report: OpenReport,
    /// The directory lock (none for a read-only open of a directory without one).
    _dir_lock: Option<File>,
    /// This instance's registration lock (none for a read-only open, which registers none).
    _instance_lock: Option<File>,
}

/// A `file` backend error.
pub(crate) fn backend_err(reason: impl Into<String>) -> StorageError {
    common::err(NAME, reason)
}

/// A `file` backend error caused by `cause` (kept as its `source()`).
pub(crate) fn backend_err_caused(
    reason: impl Into<String>,
    cause: impl std::error::Error + Send + Sync + 'static,
) -> StorageError {
    common::caused(NAME, reason, cause)
}

impl Pages {
    /// What opening found and did.
    pub fn open_report(&self) -> &OpenReport {
        &self.report
    }

    /// The committed file of `key` (for tools and fault-injection tests).
    pub fn page_path(&self, key: &PageKey) -> PathBuf {
        self.paths.page_path(key)
    }

    /// The storage directory.
    pub fn dir(&self) -> &Path {
        &self.paths.root
    }

    /// Whether O_DIRECT is in use.
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    /// Whether page I/O goes through io_uring.
    pub fn uses_uring(&self) -> bool {
        self.uring
    }

    /// The options it was opened with.
    pub fn options(&self) -> &FileOptions {
        &self.opts
    }

    /// Whether it was opened read-only ([`FileOptions::read_only`]).
    pub fn is_read_only(&self) -> bool {
        self.opts.read_only
    }

    /// Whether the entry written at `written` is expired under `ttl_s` now.
    pub(crate) fn expired(&self, written: u64) -> bool {
        self.clock.expired(written, self.opts.lifecycle.ttl)
    }

    /// Asks the reclaim thread for a pass (an expired page was seen).
    pub(crate) fn wake_reclaimer(&self) {
        self.reclaim.wake();
    }

    /// Wakes the reclaim thread when committed bytes exceed the high watermark.
    pub(crate) fn check_watermark(&self) {
        self.reclaim
            .check_watermark(|| self.core.index.lock().used());
    }

    /// Starts the reclaim stage (see [`ReclaimStage::start`]) over this instance's index.
    fn start_reclaimer(&mut self) -> Result<()> {
        let l = self.opts.lifecycle;
        let ctx = janitor::Reclaim {
            index: self.core.index.clone(),
            counters: self.core.counters.clone(),
            paths: self.paths.clone(),
            capacity: self.core.capacity,
            lifecycle: l,
            clock: self.clock.clone(),
            hook: self.reclaim_hook.clone(),
        };
        self.reclaim = ReclaimStage::start(
            "hicache-file-reclaim",
            self.opts.read_only,
            l.ttl,
            l.watermarks,
            self.core.capacity,
            move || ctx.pass(),
        )
        .map_err(|e| e.into_storage(NAME))?;
        Ok(())
    }

    /// Sets (or clears) the hook the reclaim thread calls after each chunk of a pass.
    pub fn set_reclaim_hook(&self, hook: Option<ReclaimHook>) {
        *self.reclaim_hook.lock() = hook;
    }

    /// Waits at most `timeout` until the reclaim thread has no pass asked for or running;
    /// returns whether it got there (true at once without a reclaim thread). A bounded wait
    /// for tools and tests.
    pub fn wait_reclaimed(&self, timeout: std::time::Duration) -> bool {
        self.reclaim.wait_idle(timeout)
    }

    fn io(&self) -> IoCtx<'_> {
        IoCtx {
            direct: self.direct,
            bufs: &self.bufs,
            now: self.clock.now(),
        }
    }

    /// A fresh temp name in the key's own bucket, so the commit is a same-directory rename.
    fn temp_path(&self, key: &PageKey) -> PathBuf {
        let n = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        self.paths.temp_path(key, &self.instance, n)
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // The reclaim thread deletes files: it ends before anything else is given up.
        self.reclaim.stop();
        if self.opts.read_only {
            return;
        }
        let _ = fs::remove_dir_all(&self.instance_tmp);
        let _ = fs::remove_file(&self.instance_lock_path);
    }
}

impl backend::Layout for Pages {
    const NAME: &'static str = NAME;
    type Options = FileOptions;

    /// The engine's page size bounds the capacity from below (one page must fit).
    fn options(c: &CommonConfig, f: ConfigFields, ctx: &BackendContext) -> Result<FileOptions> {
        let opts = FileOptions::from_config(c, f)?;
        match opts.capacity_bytes {
            Some(cap) => check_capacity(cap, ctx.page_bytes.max(1)).map(|()| opts),
            None => Ok(opts),
        }
    }

    fn open_with_clock(opts: FileOptions, clock: Clock) -> Result<Self> {
        Self::open_inner(opts, Self::probe_uring, clock)
    }

    fn shape(&self) -> Shape {
        Shape {
            max_batch: self.opts.max_batch,
            zero_copy: self.direct,
            shared: self.opts.shared,
            max_page_bytes: (self.core.capacity as usize).saturating_sub(HEADER_LEN),
        }
    }

    type Index = Index;

    fn core(&self) -> &Core<Index> {
        &self.core
    }

    fn exists(&self, keys: &[PageKey]) -> usize {
        self.leading_run(keys)
    }

    fn get(&self, keys: &[PageKey], dst: &mut [PageBufMut<'_>], out: &mut Outcomes) {
        self.read_pages(keys, dst, out)
    }

    fn set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Vec<PageOutcome> {
        self.set_blocking(keys, src)
    }

    fn delete(&self, keys: &[PageKey]) -> usize {
        let mut n = 0;
        for k in keys {
            let known = self.core.index.lock().remove(k).is_some();
            if known || self.opts.shared {
                match remove_file(&self.paths.page_path(k)) {
                    Ok(existed) => n += usize::from(existed || known),
                    Err(e) => tracing::warn!(key = %k, %e, "file backend: delete failed"),
                }
            }
        }
        n
    }

    fn clear(&self, namespace: NamespaceId) -> Result<u64> {
        self.clear_blocking(namespace)
            .map_err(StorageError::io("clear namespace in", self.paths.pages()))
    }
}

/// The `file` layout as a storage backend. See the [module documentation](self).
pub type FileBackend = LocalBackend<Pages>;

/// Registers [`FileBackend`] as `file`.
pub type FileFactory = Factory<Pages>;

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;
    use hicache_storage::Storage;

    fn refused() -> io::Result<u32> {
        Err(io::Error::from_raw_os_error(libc::EPERM))
    }

    #[test]
    fn engine_choice_and_fallback() {
        let mut probed = false;
        let r = IoEngine::Threads.choose(|| {
            probed = true;
            Ok(1)
        });
        assert_eq!(r.unwrap(), None);
        assert!(!probed, "threads never touch io_uring");
        assert_eq!(IoEngine::Auto.choose(|| Ok(1)).unwrap(), Some(1));
        assert_eq!(IoEngine::Uring.choose(|| Ok(1)).unwrap(), Some(1));
        // io_uring refused (old kernel, seccomp, sysctl): auto falls back, uring fails.
        assert_eq!(IoEngine::Auto.choose(refused).unwrap(), None);
        let e = IoEngine::Uring.choose(refused).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
    }

    fn refused_probe(_: &Path, _: &FileOptions, _: bool) -> io::Result<crate::io::Ring> {
        Err(io::Error::from_raw_os_error(libc::ENOSYS))
    }

    /// A whole open whose io_uring probe fails (as under a seccomp policy or
    /// `io_uring_disabled`): `auto` opens on the threads engine and serves pages, `uring`
    /// refuses to open and says why.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn auto_falls_back_to_threads_when_the_probe_fails() {
        use hicache_core::LayoutKind;
        use hicache_storage::pattern::{check_page, namespace, page_bytes, page_key};
        let dir = tempfile::tempdir().unwrap();
        let mut o = FileOptions::new(dir.path());
        o.capacity_bytes = Some(64 << 20);
        let s = LocalBackend(Pages::open_with_probe(o.clone(), refused_probe).unwrap());
        assert!(!s.uses_uring() && !s.open_report().uring);
        let len = 64 << 10;
        let keys: Vec<PageKey> = (0..20).map(|i| page_key(namespace(1), 9, i)).collect();
        let src: Vec<Vec<u8>> = keys.iter().map(|k| page_bytes(k, len)).collect();
        let bufs: Vec<PageBuf<'_>> = src
            .iter()
            .map(|b| PageBuf::contiguous(LayoutKind::PageFirst, b))
            .collect();
        let out = s.batch_set(&keys, &bufs).await.unwrap();
        assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
        let mut back = memmap2::MmapMut::map_anon(keys.len() * len).unwrap();
        let mut dst: Vec<PageBufMut<'_>> = back
            .chunks_mut(len)
            .map(|c| PageBufMut::contiguous(LayoutKind::PageFirst, c))
            .collect();
        let out = s.batch_get(&keys, &mut dst).await.unwrap();
        assert!(out.iter().all(|o| *o == PageOutcome::Hit), "{out:?}");
        drop(dst);
        for (k, c) in keys.iter().zip(back.chunks(len)) {
            assert!(check_page(k, c), "{k}");
        }
        drop(s);
        o.io_engine = IoEngine::Uring;
        let Err(e) = Pages::open_with_probe(o, refused_probe) else {
            panic!("a uring open without io_uring must fail");
        };
        let msg = e.to_string();
        assert!(msg.contains("io_engine") && msg.contains("uring"), "{msg}");
    }
}
