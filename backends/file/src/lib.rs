//! # hicache-backend-file
//!
//! An L3 backend of hicache-rs on a local (or shared) file system: one file per page, written
//! crash-safely, verified on every read, bounded by a capacity with eviction, recovered on
//! restart, and usable by several processes at once. The on-disk format and the shared-mode
//! rules are in the crate README and in [`format`](mod@format).
//!
//! ```no_run
//! # async fn f() -> hicache_storage::Result<()> {
//! use hicache_backend_file::{FileBackend, FileOptions};
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
//! 1. **Visible only when complete.** A page is written to a temp file beside its final name
//!    (`pages/<key>.<instance>.<n>.tmp`), synced per the fsync policy, then renamed to it; a
//!    `.page` file is therefore always a complete write. Its header and data checksums are
//!    verified on every read, so even a file damaged after the fact (or, under `fsync: none`,
//!    torn by a power loss) reads as `Corrupt`, never as a hit.
//! 2. **Acknowledged means committed.** `Stored` is returned only after the rename (and, under
//!    `batch`/`always`, after data and directory syncs).
//! 3. **Bounded.** Committed plus in-flight file bytes never exceed the capacity in this
//!    process's view (see [`index`]); in shared mode the janitor bounds the directory total.
//! 4. **Recovered.** Opening scans `pages/`, keeps every file whose header and size check out,
//!    deletes the rest and every stale temp file, counting them in `discarded_on_open`.
//! 5. **One outcome, either engine.** Page I/O goes through io_uring ([`IoEngine::Uring`],
//!    chains of linked requests, see `uring.rs`) or a thread pool ([`IoEngine::Threads`]);
//!    `auto` probes io_uring at open and falls back to threads. Both write the same files in
//!    the same order of steps and verify reads the same way.
#![warn(missing_docs)]

pub mod format;
pub mod index;
pub mod options;
mod pageio;
mod par;
mod sys;
mod uring;

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use async_trait::async_trait;
use hicache_core::PageKey;
use hicache_storage::backend::bump;
use hicache_storage::{
    BackendContext, BackendFactory, BackendInfo, CommonConfig, ConfigFields, PageBuf, PageBufMut,
    PageError, PageMeta, PageOutcome, Registry, Result, StatsCounters, Storage, StorageError,
    StorageStats, check_batch,
};
use parking_lot::Mutex;

use crate::format::{HEADER_LEN, Layout, MARKER, MARKER_CONTENTS, file_bytes};
use crate::index::{Entry, Index};
pub use crate::options::{DirectIo, FileOptions, FsyncPolicy, IoEngine};
use crate::pageio::{IoCtx, ReadIo, ReadResult, WriteIo};
use crate::sys::BufPool;
use crate::uring::{Outcome, ReadJob, Uring, WriteJob};

const NAME: &str = "file";
/// Lock file in `tmp/` serialising instance registration and stale-temp cleanup.
const REGISTRY_LOCK: &str = "registry.lock";

/// What [`FileBackend::open`] found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// Committed pages indexed.
    pub pages: u64,
    /// Page files found invalid (bad header, wrong size, bad name) and deleted.
    pub discarded_pages: u64,
    /// Stale temp files (writes interrupted by a crash) deleted.
    pub discarded_temp: u64,
    /// Pages evicted at open because the capacity is below what the directory held.
    pub evicted: u64,
    /// Whether O_DIRECT is in use.
    pub direct: bool,
    /// Whether page I/O goes through io_uring (else through the threads engine).
    pub uring: bool,
}

/// How this backend issues page I/O (see [`IoEngine`]).
#[derive(Debug)]
enum Engine {
    Threads,
    Uring(Uring),
}

/// Picks the engine for `mode`, calling `probe` (which builds the io_uring engine and proves
/// it on a real page) unless threads are asked for. `auto` falls back to threads when the
/// probe fails; `uring` reports the failure.
fn choose_engine<T>(
    mode: IoEngine,
    probe: impl FnOnce() -> io::Result<T>,
) -> io::Result<Option<T>> {
    match mode {
        IoEngine::Threads => Ok(None),
        IoEngine::Uring => probe().map(Some),
        IoEngine::Auto => match probe() {
            Ok(t) => Ok(Some(t)),
            Err(e) => {
                tracing::info!(%e, "file backend: io_uring unavailable, using the threads engine");
                Ok(None)
            }
        },
    }
}

/// The file backend. See the [crate documentation](crate).
pub struct FileBackend {
    opts: FileOptions,
    paths: Layout,
    instance: String,
    instance_tmp: PathBuf,
    instance_lock_path: PathBuf,
    direct: bool,
    engine: Engine,
    capacity: u64,
    rescan_bytes: u64,
    index: Mutex<Index>,
    counters: StatsCounters,
    bufs: BufPool,
    tmp_seq: AtomicU64,
    written_since_rescan: AtomicU64,
    report: OpenReport,
    _dir_lock: File,
    _instance_lock: File,
}

impl std::fmt::Debug for FileBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileBackend")
            .field("dir", &self.paths.root)
            .field("direct", &self.direct)
            .field("engine", &self.engine)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

fn backend_err(reason: impl Into<String>) -> StorageError {
    StorageError::Backend {
        backend: NAME.into(),
        reason: reason.into(),
    }
}

/// Removes a file, treating "already gone" as success; returns whether it existed.
fn remove_file(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Counts and removes the files of a directory tree; returns how many files it held.
fn remove_tree_counting(path: &Path) -> u64 {
    let mut n = 0;
    if let Ok(rd) = fs::read_dir(path) {
        for e in rd.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                n += remove_tree_counting(&p);
                let _ = fs::remove_dir(&p);
            } else if remove_file(&p).unwrap_or(false) {
                n += 1;
            }
        }
    }
    let _ = fs::remove_dir(path);
    n
}

/// Refuses a capacity that cannot hold one page of `page_bytes` (with its header), which
/// would otherwise evict every stored page at open and store nothing.
fn check_capacity(capacity: u64, page_bytes: usize) -> Result<()> {
    let need = file_bytes(page_bytes);
    if capacity < need {
        return Err(StorageError::config(
            "extra-config",
            "capacity",
            capacity.to_string(),
            format!(
                "cannot hold one page of {page_bytes} bytes ({need} bytes on disk with its \
                 header)"
            ),
        ));
    }
    Ok(())
}

/// Whether a name in the storage directory is one an opener writes while creating the marker
/// (`hicache-file.json.<pid>.tmp`), so a directory holding only such names counts as empty.
fn is_marker_temp(name: &str) -> bool {
    name.strip_prefix(MARKER)
        .and_then(|r| r.strip_prefix('.'))
        .and_then(|r| r.strip_suffix(".tmp"))
        .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
}

/// Makes `root` this backend's directory or refuses it: a directory carrying the format
/// marker is ours; an empty one is marked (the marker written aside and renamed, so a
/// concurrent opener never reads it half-written); a non-empty unmarked one, or one whose
/// marker says something else, is refused with an error naming it, and nothing in it is
/// touched.
fn claim_directory(root: &Path) -> Result<()> {
    let marker = root.join(MARKER);
    match fs::read_to_string(&marker) {
        Ok(s) if s == MARKER_CONTENTS => return Ok(()),
        Ok(s) => {
            return Err(backend_err(format!(
                "{} holds {:?}: not a hicache-file v1 directory",
                marker.display(),
                s.trim()
            )));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(StorageError::io("read format marker", &marker)(e)),
    }
    let foreign: Vec<String> = fs::read_dir(root)
        .map_err(StorageError::io("list", root))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !is_marker_temp(n))
        .collect();
    if !foreign.is_empty() {
        let mut shown: Vec<&str> = foreign.iter().map(String::as_str).take(5).collect();
        shown.sort_unstable();
        return Err(backend_err(format!(
            "{} is not empty and has no {MARKER}: refusing to use a directory the file backend \
             did not create ({} entries, e.g. {}); give an empty or new directory",
            root.display(),
            foreign.len(),
            shown.join(", ")
        )));
    }
    let aside = root.join(format!("{MARKER}.{}.tmp", std::process::id()));
    fs::write(&aside, MARKER_CONTENTS)
        .and_then(|()| fs::rename(&aside, &marker))
        .map_err(StorageError::io("write format marker", &marker))
}

/// Creates (if needed) a subdirectory of the storage directory and checks it is a real
/// directory: a symlink there (to somewhere this backend does not own) is refused, never
/// followed.
fn own_subdir(path: &Path) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_dir() => Ok(()),
        Ok(m) => Err(backend_err(format!(
            "{} is a {}, not a directory the file backend created; refusing to use it",
            path.display(),
            if m.file_type().is_symlink() {
                "symlink"
            } else {
                "file"
            }
        ))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::create_dir(path).map_err(StorageError::io("create directory", path))
        }
        Err(e) => Err(StorageError::io("inspect", path)(e)),
    }
}

/// Records who holds the directory lock in its file: `pid P on host H` for an exclusive owner,
/// nothing for shared owners.
fn write_holder(lock: &File, exclusive: bool) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    lock.set_len(0)?;
    if exclusive {
        let host = fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let text = format!("pid {} on host {}\n", std::process::id(), host.trim());
        lock.write_all_at(text.as_bytes(), 0)?;
    }
    Ok(())
}

/// The instance of a temp page file name this backend writes (`<key>.<instance>.<n>.tmp`,
/// with a whole key and an instance name of its form), if `name` is one.
fn owned_temp_instance(name: &str) -> Option<&str> {
    let inst = format::temp_instance(name)?;
    let key_hex = name.split('.').next()?;
    let is_key = key_hex.len() == 96 && key_hex.bytes().all(|b| b.is_ascii_hexdigit());
    (is_key && is_instance_name(inst)).then_some(inst)
}

/// Whether `name` is an instance name this backend creates in `tmp/`: `<pid>-<hex>`.
fn is_instance_name(name: &str) -> bool {
    name.split_once('-').is_some_and(|(pid, t)| {
        !pid.is_empty()
            && !t.is_empty()
            && pid.bytes().all(|b| b.is_ascii_digit())
            && t.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

impl FileBackend {
    /// Opens (creating if needed) the storage directory of `opts`, recovering what a previous
    /// run committed. Blocking: it scans the directory.
    pub fn open(opts: FileOptions) -> Result<Self> {
        Self::open_with_probe(opts, Self::probe_uring)
    }

    /// [`open`](Self::open) with the io_uring probe given (tests inject a failing one to take
    /// the fallback path on a kernel that has io_uring).
    fn open_with_probe(
        opts: FileOptions,
        probe: impl FnOnce(&Path, &FileOptions, bool, &BufPool) -> io::Result<Uring>,
    ) -> Result<Self> {
        sys::raise_nofile_limit();
        let root = opts.dir.clone();
        let paths = Layout { root: root.clone() };
        if let Some(c) = opts.capacity_bytes {
            check_capacity(c, 1)?;
        }
        // 0. Ownership: the directory is ours only if it carries our marker, or is empty (or
        // new) and we mark it now. A non-empty unmarked directory is refused untouched.
        fs::create_dir_all(&root).map_err(StorageError::io("create directory", &root))?;
        claim_directory(&root)?;
        // 1. The directory lock: exclusive, or shared among shared-mode processes. The lock
        // file is never truncated before the lock is held, so a refused opener can name the
        // holder an exclusive owner wrote into it.
        let lock_path = root.join("dir.lock");
        let dir_lock = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(StorageError::io("create", &lock_path))?;
        if !sys::try_flock(&dir_lock, !opts.shared).map_err(StorageError::io("lock", &lock_path))? {
            let holder = fs::read_to_string(&lock_path).unwrap_or_default();
            let holder = match holder.trim() {
                "" => "processes in shared mode".to_string(),
                h => h.to_string(),
            };
            return Err(backend_err(format!(
                "{} is in use by {holder}{}; to share a directory, every process must \
                 open it with \"shared\": true",
                root.display(),
                if opts.shared {
                    " in exclusive mode"
                } else {
                    ""
                }
            )));
        }
        // Any text in the lock file now is a dead owner's: an exclusive owner names itself,
        // shared owners leave it empty.
        write_holder(&dir_lock, !opts.shared).map_err(StorageError::io("write", &lock_path))?;
        // 2. The page directory.
        let pages_dir = paths.pages();
        own_subdir(&pages_dir)?;
        let tmp = paths.tmp();
        own_subdir(&tmp)?;
        // 3. Under the registry lock (so no instance is seen between creating and locking
        // its lock file): remove dead instances' leftovers (everything in exclusive mode),
        // then register this instance with a lock file it holds for its whole life.
        let registry_path = tmp.join(REGISTRY_LOCK);
        let registry =
            File::create(&registry_path).map_err(StorageError::io("create", &registry_path))?;
        sys::flock_wait(&registry).map_err(StorageError::io("lock", &registry_path))?;
        let stale_temp_dirs = Self::clean_temp(&tmp, opts.shared)?;
        // 4. This instance's temp directory, locked for its life.
        let instance = format!(
            "{}-{:x}",
            std::process::id(),
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        );
        let instance_lock_path = tmp.join(format!("{instance}.lock"));
        let instance_lock = File::create(&instance_lock_path)
            .map_err(StorageError::io("create", &instance_lock_path))?;
        sys::try_flock(&instance_lock, true)
            .map_err(StorageError::io("lock", &instance_lock_path))?;
        sys::unflock(&registry);
        drop(registry);
        let instance_tmp = tmp.join(&instance);
        debug_assert!(!instance.contains('.'), "temp names split on '.'");
        fs::create_dir_all(&instance_tmp)
            .map_err(StorageError::io("create directory", &instance_tmp))?;
        // 5. O_DIRECT probe.
        let direct = match opts.direct_io {
            DirectIo::Off => false,
            mode => {
                let ok = Self::probe_direct(&instance_tmp);
                if !ok && mode == DirectIo::On {
                    return Err(backend_err(format!(
                        "{}: the file system refuses O_DIRECT (direct_io: \"on\")",
                        root.display()
                    )));
                }
                if !ok {
                    tracing::info!(dir = %root.display(), "file backend: O_DIRECT refused, using buffered I/O");
                }
                ok
            }
        };
        // 6. The I/O engine: io_uring if wanted and it works here on a real page.
        let bufs = BufPool::new(opts.io_threads.max(opts.queue_depth) * 2);
        let engine = match choose_engine(opts.io_engine, || {
            probe(&instance_tmp, &opts, direct, &bufs)
        }) {
            Ok(Some(u)) => Engine::Uring(u),
            Ok(None) => Engine::Threads,
            Err(e) => {
                return Err(backend_err(format!(
                    "{}: io_uring unavailable (io_engine: \"uring\"): {e}",
                    root.display()
                )));
            }
        };
        // 7. Scan committed pages.
        let (found, discarded_pages, stale_temp_files) =
            Self::scan(&paths, opts.io_threads, opts.verify_on_open, opts.shared);
        let discarded_temp = stale_temp_dirs + stale_temp_files;
        let used: u64 = found.iter().map(|(_, m, _)| file_bytes(m.len)).sum();
        let capacity = match opts.capacity_bytes {
            Some(c) => c,
            None => {
                let free = sys::free_bytes(&root).map_err(StorageError::io("statvfs", &root))?;
                (free + used) / 10 * 9
            }
        };
        let mut index = Index::new(capacity, opts.eviction);
        let mut found = found;
        found.sort_by_key(|(_, _, t)| *t);
        for (k, m, _) in &found {
            index.insert(*k, *m);
        }
        let mut victims = Vec::new();
        index.reserve(0, &mut victims);
        for (k, _) in &victims {
            let _ = remove_file(&paths.page_path(k));
        }
        let counters = StatsCounters::default();
        bump(
            &counters.discarded_on_open,
            discarded_pages + discarded_temp,
        );
        bump(&counters.evicted_pages, victims.len() as u64);
        bump(
            &counters.evicted_bytes,
            victims.iter().map(|(_, e)| e.meta.len as u64).sum(),
        );
        let report = OpenReport {
            pages: index.len() as u64,
            discarded_pages,
            discarded_temp,
            evicted: victims.len() as u64,
            direct,
            uring: matches!(engine, Engine::Uring(_)),
        };
        tracing::info!(dir = %root.display(), ?report, capacity, "file backend opened");
        Ok(Self {
            rescan_bytes: opts.rescan_bytes.unwrap_or((capacity / 16).max(1)),
            bufs,
            engine,
            opts,
            paths,
            instance,
            instance_tmp,
            instance_lock_path,
            direct,
            capacity,
            index: Mutex::new(index),
            counters,
            tmp_seq: AtomicU64::new(0),
            written_since_rescan: AtomicU64::new(0),
            report,
            _dir_lock: dir_lock,
            _instance_lock: instance_lock,
        })
    }

    /// Removes dead instances' lock files and scratch directories (only names of the form
    /// this backend creates, `<pid>-<hex>` and `<pid>-<hex>.lock`, and never through a
    /// symlink); returns how many files they held. Anything else in `tmp/` is left alone.
    fn clean_temp(tmp: &Path, shared: bool) -> Result<u64> {
        let mut n = 0;
        let rd = fs::read_dir(tmp).map_err(StorageError::io("list", tmp))?;
        for e in rd.flatten() {
            let p = e.path();
            let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let Ok(ty) = e.file_type() else { continue };
            let (inst, is_lock) = match name.strip_suffix(".lock") {
                Some(inst) => (inst, true),
                None => (name, false),
            };
            if !is_instance_name(inst) || (shared && Self::instance_alive(tmp, inst)) {
                continue;
            }
            if is_lock && ty.is_file() {
                let _ = remove_file(&p);
            } else if !is_lock && ty.is_dir() {
                n += remove_tree_counting(&p);
            }
        }
        Ok(n)
    }

    /// Whether the process instance `inst` still runs: it holds the lock on its lock file for
    /// its whole life, and creates that file before any temp file.
    fn instance_alive(tmp: &Path, inst: &str) -> bool {
        match File::open(tmp.join(format!("{inst}.lock"))) {
            Ok(f) => !sys::try_flock(&f, true).unwrap_or(true),
            Err(_) => false,
        }
    }

    fn probe_direct(dir: &Path) -> bool {
        let p = dir.join("direct-probe");
        let r = (|| -> io::Result<()> {
            let f = sys::create_new(&p, true)?;
            let buf = memmap2::MmapMut::map_anon(4096)?;
            sys::pwritev_all(&f, &[io::IoSlice::new(&buf)], 0)
        })();
        let _ = remove_file(&p);
        r.is_ok()
    }

    /// Builds the io_uring engine and proves it here: a page written (created, preallocated,
    /// written, synced, renamed) and read back through the ring, with the backend's O_DIRECT
    /// choice, in the instance's scratch directory.
    fn probe_uring(
        dir: &Path,
        opts: &FileOptions,
        direct: bool,
        bufs: &BufPool,
    ) -> io::Result<Uring> {
        use hicache_core::{LayoutKind, NamespaceId, PageHash};
        let u = Uring::new(opts.queue_depth, opts.io_threads)?;
        let ctx = IoCtx { direct, bufs };
        let key = PageKey::new(NamespaceId([0xa5; 16]), PageHash([0x3c; 32]));
        let mut data = memmap2::MmapMut::map_anon(8192)?;
        for (i, b) in data.iter_mut().enumerate() {
            *b = (i * 31 % 251) as u8;
        }
        let tmp = dir.join("uring-probe.tmp");
        let fin = dir.join("uring-probe.page");
        let page = PageBuf::contiguous(LayoutKind::PageFirst, &data);
        let mut w = [WriteJob::new(
            WriteIo::new(ctx, &key, &page)?,
            sys::cpath(&tmp)?,
            sys::cpath(&fin)?,
            true,
            None,
        )];
        let written = u.write(&mut w).pop();
        if let Some(io) = w[0].take_io() {
            io.release(bufs);
        }
        let fail = |what: String| io::Error::other(format!("io_uring probe: {what}"));
        let r = (|| {
            match written {
                Some(Outcome::Done(Ok(()))) => {}
                Some(Outcome::Done(Err(e))) => return Err(fail(format!("{}: {}", e.op, e.err))),
                _ => return Err(fail("the write did not complete".into())),
            }
            let mut back = memmap2::MmapMut::map_anon(8192)?;
            {
                let mut dst = PageBufMut::contiguous(LayoutKind::PageFirst, &mut back);
                let mut r = [ReadJob::new(
                    sys::cpath(&fin)?,
                    &key,
                    ReadIo::new(ctx, &mut dst)?,
                    ctx,
                )];
                match u.read(&mut r).pop() {
                    Some(Outcome::Done(ReadResult::Hit)) => {}
                    other => return Err(fail(format!("read back: {other:?}"))),
                }
            }
            if back[..] != data[..] {
                return Err(fail("read back other bytes".into()));
            }
            Ok(())
        })();
        let _ = remove_file(&tmp);
        let _ = remove_file(&fin);
        r.map(|()| u)
    }

    /// Lists and checks every page file; returns the valid ones (key, meta, mtime), the
    /// number of invalid files deleted and the number of stale temp files deleted (every temp
    /// file in exclusive mode; those of dead instances in shared mode).
    #[allow(clippy::type_complexity)]
    fn scan(
        paths: &Layout,
        threads: usize,
        verify: bool,
        shared: bool,
    ) -> (Vec<(PageKey, PageMeta, SystemTime)>, u64, u64) {
        let alive: Mutex<HashMap<String, bool>> = Mutex::new(HashMap::new());
        let tmp = paths.tmp();
        let is_live = |inst: &str| {
            shared
                && *alive
                    .lock()
                    .entry(inst.to_string())
                    .or_insert_with(|| Self::instance_alive(&tmp, inst))
        };
        let entries: Vec<fs::DirEntry> = match fs::read_dir(paths.pages()) {
            Ok(rd) => rd.flatten().collect(),
            Err(_) => Vec::new(),
        };
        let chunks: Vec<Vec<fs::DirEntry>> = {
            let mut it = entries.into_iter().peekable();
            let mut v = Vec::new();
            while it.peek().is_some() {
                v.push(it.by_ref().take(256).collect());
            }
            v
        };
        let per_chunk = par::par_map(threads, chunks, |chunk| {
            let mut ok = Vec::new();
            let mut bad = 0u64;
            let mut temp = 0u64;
            for e in chunk {
                let p = e.path();
                let name = e.file_name();
                // Only regular files with names this backend writes are touched: anything
                // else (foreign files, directories, symlinks) is left alone.
                if !e.file_type().is_ok_and(|t| t.is_file()) {
                    continue;
                }
                let Some(name) = name.to_str() else { continue };
                if let Some(inst) = owned_temp_instance(name) {
                    if !is_live(inst) && remove_file(&p).unwrap_or(false) {
                        temp += 1;
                    }
                    continue;
                }
                let checked = match format::key_from_file_name(name) {
                    None => continue,
                    Some(k) => pageio::check_page_file(&p, verify).and_then(|h| {
                        if h.key == k {
                            Ok(h)
                        } else {
                            Err(format!("header names key {}", h.key))
                        }
                    }),
                };
                match checked {
                    Ok(h) => {
                        let mtime = e
                            .metadata()
                            .and_then(|m| m.modified())
                            .unwrap_or(SystemTime::UNIX_EPOCH);
                        ok.push((h.key, h.meta, mtime));
                    }
                    Err(why) => {
                        tracing::warn!(path = %p.display(), %why, "file backend: discarding invalid page file");
                        if remove_file(&p).unwrap_or(false) {
                            bad += 1;
                        }
                    }
                }
            }
            (ok, bad, temp)
        });
        let mut all = Vec::new();
        let mut bad = 0;
        let mut temp = 0;
        for (ok, b, t) in per_chunk {
            all.extend(ok);
            bad += b;
            temp += t;
        }
        (all, bad, temp)
    }

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
        matches!(self.engine, Engine::Uring(_))
    }

    /// The options it was opened with.
    pub fn options(&self) -> &FileOptions {
        &self.opts
    }

    fn io(&self) -> IoCtx<'_> {
        IoCtx {
            direct: self.direct,
            bufs: &self.bufs,
        }
    }

    /// A fresh temp name in the key's own bucket, so the commit is a same-directory rename.
    fn temp_path(&self, key: &PageKey) -> PathBuf {
        let n = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        self.paths.temp_path(key, &self.instance, n)
    }

    /// Shared mode: if `key` is already committed on disk with `meta` (by another process),
    /// adopts it.
    fn adopt_from_disk(&self, key: &PageKey, meta: Option<PageMeta>) -> Option<PageMeta> {
        let h = pageio::check_page_file(&self.paths.page_path(key), false).ok()?;
        if h.key != *key || meta.is_some_and(|m| m != h.meta) {
            return None;
        }
        let mut ix = self.index.lock();
        if !ix.contains(key) {
            let mut victims = Vec::new();
            if ix.reserve(file_bytes(h.meta.len), &mut victims) {
                ix.insert(*key, h.meta);
                ix.release(file_bytes(h.meta.len));
            }
            drop(ix);
            self.drop_victims(&victims);
        }
        Some(h.meta)
    }

    fn drop_victims(&self, victims: &[(PageKey, Entry)]) {
        for (k, e) in victims {
            if let Err(err) = remove_file(&self.paths.page_path(k)) {
                tracing::warn!(key = %k, %err, "file backend: could not delete an evicted page");
            }
            bump(&self.counters.evicted_pages, 1);
            bump(&self.counters.evicted_bytes, e.meta.len as u64);
        }
    }

    fn set_blocking(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Vec<PageOutcome> {
        let n = keys.len();
        let mut out: Vec<Option<PageOutcome>> = vec![None; n];
        let mut jobs: Vec<usize> = Vec::new();
        let mut dups: Vec<(usize, usize)> = Vec::new();
        let mut reserved = 0u64;
        let mut victims = Vec::new();
        {
            let mut ix = self.index.lock();
            let mut first: HashMap<PageKey, usize> = HashMap::new();
            for (i, (k, p)) in keys.iter().zip(src).enumerate() {
                if p.is_empty() {
                    out[i] = Some(PageOutcome::Failed(PageError::EmptyPage));
                    continue;
                }
                if file_bytes(p.len()) > self.capacity {
                    out[i] = Some(PageOutcome::Failed(PageError::TooLarge {
                        len: p.len(),
                        max: (self.capacity as usize).saturating_sub(HEADER_LEN),
                    }));
                    continue;
                }
                if ix.get(k).is_some_and(|e| e.meta == p.meta()) {
                    ix.touch(k);
                    out[i] = Some(PageOutcome::Present);
                    continue;
                }
                if let Some(&f) = first.get(k) {
                    dups.push((i, f));
                    continue;
                }
                first.insert(*k, i);
                let need = file_bytes(p.len());
                if ix.reserve(need, &mut victims) {
                    reserved += need;
                    jobs.push(i);
                } else {
                    out[i] = Some(PageOutcome::Failed(PageError::NoSpace));
                }
            }
        }
        self.drop_victims(&victims);

        // Phase 1, page by page, many pages in flight: write to a temp file beside the final
        // name, sync its data (unless the policy is `none`), commit it by renaming (so the
        // renames of early pages overlap the writes of later ones) and, under `always`, sync
        // the directory. In shared mode a page another process committed meanwhile is
        // adopted, not rewritten.
        let shared = self.opts.shared;
        let mut results: Vec<(usize, Result<bool, PageError>)> = Vec::new();
        let todo: Vec<usize> = if shared {
            par::par_map(self.opts.io_threads, jobs.clone(), |i| {
                (
                    i,
                    self.adopt_from_disk(&keys[i], Some(src[i].meta()))
                        .is_some(),
                )
            })
            .into_iter()
            .filter_map(|(i, adopted)| {
                if adopted {
                    results.push((i, Ok(false)));
                    None
                } else {
                    Some(i)
                }
            })
            .collect()
        } else {
            jobs.clone()
        };
        results.extend(match &self.engine {
            Engine::Uring(u) => self.write_uring(u, keys, src, &todo),
            Engine::Threads => par::par_map(self.opts.io_threads, todo, |i| {
                (i, self.write_one(&keys[i], &src[i]))
            }),
        });
        // Phase 2 (batch): make the renames durable, one sync per touched directory, before
        // any page of the batch is acknowledged.
        if self.opts.fsync == FsyncPolicy::Batch {
            let buckets: BTreeSet<PathBuf> = results
                .iter()
                .filter(|(_, r)| matches!(r, Ok(true)))
                .map(|(i, _)| self.paths.bucket(&keys[*i]))
                .collect();
            let synced = par::par_map(
                self.opts.io_threads,
                buckets.into_iter().collect(),
                |b: PathBuf| sys::sync_dir(&b).map_err(|e| (b, e)),
            );
            if let Some(Err((b, e))) = synced.into_iter().find(|r| r.is_err()) {
                // The renames happened but may not survive a power loss: report, do not ack.
                tracing::warn!(dir = %b.display(), %e, "file backend: directory sync failed");
                for (_, r) in results.iter_mut() {
                    if matches!(r, Ok(true)) {
                        *r = Err(PageError::io("sync directory", &e));
                    }
                }
            }
        }
        // Phase 3: publish to the index, end the reservation.
        let mut stored_bytes = 0u64;
        {
            let mut ix = self.index.lock();
            for (i, r) in results {
                out[i] = Some(match r {
                    Ok(true) => {
                        ix.insert(keys[i], src[i].meta());
                        stored_bytes += file_bytes(src[i].len());
                        PageOutcome::Stored
                    }
                    Ok(false) => PageOutcome::Present,
                    Err(e) => {
                        tracing::warn!(key = %keys[i], error = %e, "file backend: page write failed");
                        PageOutcome::Failed(e)
                    }
                });
            }
            ix.release(reserved);
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
        if shared && stored_bytes > 0 {
            let w = self
                .written_since_rescan
                .fetch_add(stored_bytes, Ordering::Relaxed)
                + stored_bytes;
            if w >= self.rescan_bytes {
                self.written_since_rescan.store(0, Ordering::Relaxed);
                self.janitor();
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

    fn get_blocking(&self, keys: &[PageKey], dst: &mut [PageBufMut<'_>]) -> Vec<PageOutcome> {
        let n = keys.len();
        let mut out: Vec<Option<PageOutcome>> = vec![None; n];
        let mut want = vec![false; n];
        {
            let mut ix = self.index.lock();
            for (i, (k, d)) in keys.iter().zip(dst.iter()).enumerate() {
                match ix.get(k) {
                    Some(e) if e.meta != d.meta() => {
                        bump(&self.counters.meta_mismatches, 1);
                        out[i] = Some(PageOutcome::Miss);
                    }
                    Some(_) => {
                        ix.touch(k);
                        want[i] = true;
                    }
                    None if self.opts.shared && !d.is_empty() => want[i] = true,
                    None => out[i] = Some(PageOutcome::Miss),
                }
            }
        }
        let mut jobs: Vec<(usize, &mut PageBufMut<'_>)> = dst
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| want[*i])
            .collect();
        let io = self.io();
        let shared = self.opts.shared;
        let results: Vec<ReadResult> = match &self.engine {
            Engine::Uring(u) => self.read_uring(u, keys, &mut jobs),
            Engine::Threads => par::par_map(
                self.opts.io_threads,
                jobs.iter_mut().map(|(i, d)| (*i, &mut **d)).collect(),
                |(i, d)| pageio::read_page_file(io, &self.paths.page_path(&keys[i]), &keys[i], d),
            ),
        };
        for ((i, d), r) in jobs.iter_mut().zip(results) {
            let i = *i;
            let meta = d.meta();
            match &r {
                ReadResult::Corrupt(_) => d.zero(),
                ReadResult::Hit if shared => {
                    let _ = sys::touch_mtime(&self.paths.page_path(&keys[i]));
                }
                _ => {}
            }
            let key = &keys[i];
            out[i] = Some(match r {
                ReadResult::Hit => {
                    if shared {
                        let mut ix = self.index.lock();
                        if !ix.contains(key) {
                            let mut v = Vec::new();
                            if ix.reserve(file_bytes(meta.len), &mut v) {
                                ix.insert(*key, meta);
                                ix.release(file_bytes(meta.len));
                            }
                            drop(ix);
                            self.drop_victims(&v);
                        }
                    }
                    PageOutcome::Hit
                }
                ReadResult::Missing => {
                    self.index.lock().remove(key);
                    PageOutcome::Miss
                }
                ReadResult::Mismatch(stored) => {
                    tracing::debug!(key = %key, ?stored, wanted = ?meta, "file backend: metadata mismatch");
                    bump(&self.counters.meta_mismatches, 1);
                    PageOutcome::Miss
                }
                ReadResult::Corrupt(why) => {
                    tracing::warn!(key = %key, %why, "file backend: corrupt page dropped");
                    self.index.lock().remove(key);
                    let _ = remove_file(&self.paths.page_path(key));
                    PageOutcome::Corrupt
                }
                ReadResult::Io(e) => PageOutcome::Failed(PageError::io("read", &e)),
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

    /// Writes one page with blocking calls: temp file (synced per the policy), rename, and
    /// under `always` the directory sync. Returns `Ok(true)` once committed.
    fn write_one(&self, key: &PageKey, page: &PageBuf<'_>) -> Result<bool, PageError> {
        let policy = self.opts.fsync;
        let tmp = self.temp_path(key);
        let r = pageio::write_page_file(self.io(), &tmp, key, page, policy != FsyncPolicy::None)
            .map_err(|e| PageError::io("write", &e))
            .and_then(|_file| {
                fs::rename(&tmp, self.paths.page_path(key)).map_err(|e| PageError::io("rename", &e))
            })
            .and_then(|()| {
                if policy == FsyncPolicy::Always {
                    sys::sync_dir(&self.paths.bucket(key))
                        .map_err(|e| PageError::io("sync directory", &e))
                } else {
                    Ok(())
                }
            });
        if r.is_err() {
            let _ = remove_file(&tmp);
        }
        r.map(|()| true)
    }

    /// Writes the pages `todo` (indices into `keys`/`src`) through the ring, as
    /// [`write_one`](Self::write_one) would each; pages the ring hands back are written
    /// with blocking calls.
    fn write_uring(
        &self,
        u: &Uring,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
        todo: &[usize],
    ) -> Vec<(usize, Result<bool, PageError>)> {
        let io = self.io();
        let policy = self.opts.fsync;
        let mut out = Vec::with_capacity(todo.len());
        // Under `always`, each rename is followed by a sync of its directory, open for the
        // whole batch.
        let mut dirs: HashMap<PathBuf, io::Result<File>> = HashMap::new();
        let mut jobs = Vec::with_capacity(todo.len());
        let mut which = Vec::with_capacity(todo.len());
        for &i in todo {
            let key = &keys[i];
            let dir = if policy == FsyncPolicy::Always {
                let b = self.paths.bucket(key);
                match dirs.entry(b.clone()).or_insert_with(|| File::open(&b)) {
                    Ok(f) => Some(std::os::fd::AsRawFd::as_raw_fd(f)),
                    Err(e) => {
                        out.push((i, Err(PageError::io("sync directory", e))));
                        continue;
                    }
                }
            } else {
                None
            };
            let tmp = self.temp_path(key);
            let job = (|| {
                Ok::<_, io::Error>(WriteJob::new(
                    WriteIo::new(io, key, &src[i])?,
                    sys::cpath(&tmp)?,
                    sys::cpath(&self.paths.page_path(key))?,
                    policy != FsyncPolicy::None,
                    dir,
                ))
            })();
            match job {
                Ok(j) => {
                    jobs.push(j);
                    which.push((i, tmp));
                }
                Err(e) => out.push((i, Err(PageError::io("write", &e)))),
            }
        }
        let outcomes = u.write(&mut jobs);
        for j in &mut jobs {
            if let Some(w) = j.take_io() {
                w.release(&self.bufs);
            }
        }
        drop(jobs);
        drop(dirs);
        let mut redo = Vec::new();
        for ((i, tmp), o) in which.into_iter().zip(outcomes) {
            match o {
                Outcome::Done(Ok(())) => out.push((i, Ok(true))),
                Outcome::Done(Err(e)) => {
                    let _ = remove_file(&tmp);
                    out.push((i, Err(PageError::io(e.op, &e.err))));
                }
                Outcome::Redo => {
                    let _ = remove_file(&tmp);
                    redo.push(i);
                }
            }
        }
        // Pages the ring handed back (all of them if it failed): the threads engine's way.
        out.extend(par::par_map(self.opts.io_threads, redo, |i| {
            (i, self.write_one(&keys[i], &src[i]))
        }));
        out
    }

    /// Reads the pages of `jobs` (index into `keys`, destination) through the ring; results
    /// in job order. Pages the ring hands back are read with blocking calls.
    fn read_uring(
        &self,
        u: &Uring,
        keys: &[PageKey],
        jobs: &mut [(usize, &mut PageBufMut<'_>)],
    ) -> Vec<ReadResult> {
        let io = self.io();
        let mut results: Vec<Option<ReadResult>> = (0..jobs.len()).map(|_| None).collect();
        let outcomes: Vec<(usize, Outcome<ReadResult>)> = {
            let mut ring_jobs = Vec::with_capacity(jobs.len());
            let mut which = Vec::with_capacity(jobs.len());
            for (x, (i, d)) in jobs.iter_mut().enumerate() {
                let key = &keys[*i];
                let job = sys::cpath(&self.paths.page_path(key))
                    .and_then(|p| Ok(ReadJob::new(p, key, ReadIo::new(io, d)?, io)));
                match job {
                    Ok(j) => {
                        ring_jobs.push(j);
                        which.push(x);
                    }
                    Err(e) => results[x] = Some(ReadResult::Io(e)),
                }
            }
            let out = u.read(&mut ring_jobs);
            which.into_iter().zip(out).collect()
        };
        let mut redo = vec![false; jobs.len()];
        for (x, o) in outcomes {
            match o {
                Outcome::Done(r) => results[x] = Some(r),
                Outcome::Redo => redo[x] = true,
            }
        }
        // Pages the ring handed back (all of them if it failed): the threads engine's way.
        let again: Vec<(usize, &mut (usize, &mut PageBufMut<'_>))> = jobs
            .iter_mut()
            .enumerate()
            .filter(|(x, _)| redo[*x])
            .collect();
        for (x, r) in par::par_map(self.opts.io_threads, again, |(x, (i, d))| {
            let key = &keys[*i];
            (
                x,
                pageio::read_page_file(io, &self.paths.page_path(key), key, d),
            )
        }) {
            results[x] = Some(r);
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| ReadResult::Io(io::Error::other("internal: no result"))))
            .collect()
    }

    /// Shared mode: if no other process is doing it, rescans the directory and deletes the
    /// least recently used page files (by modification time, which readers refresh) until the
    /// directory's total is within the capacity.
    fn janitor(&self) {
        let lock_path = self.paths.root.join("janitor.lock");
        let Ok(lock) = File::create(&lock_path) else {
            return;
        };
        if !sys::try_flock(&lock, true).unwrap_or(false) {
            return;
        }
        let mut files: Vec<(SystemTime, u64, PageKey, PathBuf)> = Vec::new();
        if let Ok(rd) = fs::read_dir(self.paths.pages()) {
            for e in rd.flatten() {
                let Some(k) = e.file_name().to_str().and_then(format::key_from_file_name) else {
                    continue;
                };
                let Ok(m) = e.metadata() else { continue };
                if !m.file_type().is_file() {
                    continue;
                }
                files.push((
                    m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    m.len(),
                    k,
                    e.path(),
                ));
            }
        }
        let mut total: u64 = files.iter().map(|f| f.1).sum();
        if total > self.capacity {
            files.sort_by_key(|f| f.0);
            for (_, len, k, p) in files {
                if total <= self.capacity {
                    break;
                }
                if remove_file(&p).unwrap_or(false) {
                    total -= len;
                    let e = self.index.lock().remove(&k);
                    bump(&self.counters.evicted_pages, 1);
                    bump(
                        &self.counters.evicted_bytes,
                        e.map_or(len.saturating_sub(HEADER_LEN as u64), |e| e.meta.len as u64),
                    );
                }
            }
        }
        sys::unflock(&lock);
    }
}

impl Drop for FileBackend {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.instance_tmp);
        let _ = fs::remove_file(&self.instance_lock_path);
    }
}

#[async_trait]
impl Storage for FileBackend {
    fn info(&self) -> BackendInfo {
        let mut i = BackendInfo::new(NAME, self.opts.max_batch);
        i.zero_copy = self.direct;
        i.persistent = true;
        i.shared = self.opts.shared;
        i.capacity_bytes = Some(self.capacity);
        i.max_page_bytes = (self.capacity as usize).saturating_sub(HEADER_LEN);
        i
    }

    async fn batch_exists(&self, keys: &[PageKey]) -> Result<usize> {
        check_batch("batch_exists", self.opts.max_batch, keys.len(), keys.len())?;
        let mut hits = {
            let ix = self.index.lock();
            keys.iter().take_while(|k| ix.contains(k)).count()
        };
        if self.opts.shared && hits < keys.len() {
            hits += par::blocking(|| {
                keys[hits..]
                    .iter()
                    .take_while(|k| self.adopt_from_disk(k, None).is_some())
                    .count()
            });
        }
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
        let out = par::blocking(|| self.get_blocking(keys, dst));
        self.counters.record_get(&out, dst.iter().map(|d| d.len()));
        Ok(out)
    }

    async fn batch_set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Result<Vec<PageOutcome>> {
        check_batch("batch_set", self.opts.max_batch, keys.len(), src.len())?;
        let out = par::blocking(|| self.set_blocking(keys, src));
        self.counters.record_set(&out, src.iter().map(|p| p.len()));
        Ok(out)
    }

    async fn delete(&self, keys: &[PageKey]) -> Result<usize> {
        let n = par::blocking(|| {
            let mut n = 0;
            for k in keys {
                let known = self.index.lock().remove(k).is_some();
                if known || self.opts.shared {
                    match remove_file(&self.paths.page_path(k)) {
                        Ok(existed) => n += usize::from(existed || known),
                        Err(e) => tracing::warn!(key = %k, %e, "file backend: delete failed"),
                    }
                }
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

/// Registers [`FileBackend`] as `file`.
#[derive(Copy, Clone, Debug, Default)]
pub struct FileFactory;

#[async_trait]
impl BackendFactory for FileFactory {
    fn name(&self) -> &str {
        NAME
    }

    async fn open(
        &self,
        common: &CommonConfig,
        fields: ConfigFields,
        ctx: &BackendContext,
    ) -> Result<Arc<dyn Storage>> {
        let opts = FileOptions::from_config(common, fields)?;
        if let Some(c) = opts.capacity_bytes {
            check_capacity(c, ctx.page_bytes.max(1))?;
        }
        let backend = tokio::task::spawn_blocking(move || FileBackend::open(opts))
            .await
            .map_err(|e| backend_err(format!("open task failed: {e}")))??;
        Ok(Arc::new(backend))
    }
}

/// Adds the file backend to `registry` (one call, as any third-party backend would).
pub fn register(registry: &Registry) -> Result<()> {
    registry.register(FileFactory)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> io::Result<u32> {
        Err(io::Error::from_raw_os_error(libc::EPERM))
    }

    #[test]
    fn engine_choice_and_fallback() {
        let mut probed = false;
        let r = choose_engine(IoEngine::Threads, || {
            probed = true;
            Ok(1)
        });
        assert_eq!(r.unwrap(), None);
        assert!(!probed, "threads never touch io_uring");
        assert_eq!(choose_engine(IoEngine::Auto, || Ok(1)).unwrap(), Some(1));
        assert_eq!(choose_engine(IoEngine::Uring, || Ok(1)).unwrap(), Some(1));
        // io_uring refused (old kernel, seccomp, sysctl): auto falls back, uring fails.
        assert_eq!(choose_engine(IoEngine::Auto, refused).unwrap(), None);
        let e = choose_engine(IoEngine::Uring, refused).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
    }

    fn refused_probe(_: &Path, _: &FileOptions, _: bool, _: &BufPool) -> io::Result<Uring> {
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
        let s = FileBackend::open_with_probe(o.clone(), refused_probe).unwrap();
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
        let e = FileBackend::open_with_probe(o, refused_probe).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("io_engine") && msg.contains("uring"), "{msg}");
    }
}
