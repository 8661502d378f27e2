//! Opening: ownership of the directory (marker, locks), this instance's registration and
//! scratch directory, the O_DIRECT probe, the choice of driver (io_uring or threads), then
//! recovery ([`recover`](crate::pages::recover)) and the capacity fit.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::SystemTime;

use crate::io::ring::{Dir, Req};
use crate::io::{AlignedBuf, BufPool, DirFd, Driver, Ring, Threads, sys};
use hicache_storage::backend::bump;
use hicache_storage::{Clock, Result, StatsCounters, StorageError};
use parking_lot::Mutex;

use crate::common::{Core, ReclaimStage, WriteGuard};
use crate::pages::format::{self, Layout, MARKER, MARKER_CONTENTS, file_bytes};
use crate::pages::{
    DirectIo, FileOptions, NAME, Pages, REGISTRY_LOCK, backend_err, backend_err_caused,
};

/// Removes a file, treating "already gone" as success; returns whether it existed.
pub(crate) fn remove_file(path: &Path) -> io::Result<bool> {
    sys::remove_file(path)
}

/// Counts and (unless `dry`) removes the files of a directory tree; returns how many files
/// it held.
fn remove_tree_counting(path: &Path, dry: bool) -> u64 {
    let mut n = 0;
    if let Ok(rd) = fs::read_dir(path) {
        for e in rd.flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                n += remove_tree_counting(&p, dry);
                if !dry {
                    let _ = fs::remove_dir(&p);
                }
            } else if dry || remove_file(&p).unwrap_or(false) {
                n += 1;
            }
        }
    }
    if !dry {
        let _ = fs::remove_dir(path);
    }
    n
}

/// Refuses a capacity that cannot hold one page of `page_bytes` (with its header), which
/// would otherwise evict every stored page at open and store nothing.
pub(crate) fn check_capacity(capacity: u64, page_bytes: usize) -> Result<()> {
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
/// touched. With `create` false (a read-only open) an empty or missing directory is accepted
/// as an empty store and nothing is written.
fn claim_directory(root: &Path, create: bool) -> Result<()> {
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
    let listing = match fs::read_dir(root) {
        Err(e) if !create && e.kind() == io::ErrorKind::NotFound => return Ok(()),
        r => r.map_err(StorageError::io("list", root))?,
    };
    let foreign: Vec<String> = listing
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
    if !create {
        return Ok(());
    }
    let aside = root.join(format!("{MARKER}.{}.tmp", std::process::id()));
    fs::write(&aside, MARKER_CONTENTS)
        .and_then(|()| fs::rename(&aside, &marker))
        .map_err(StorageError::io("write format marker", &marker))
}

/// Creates (if needed) a subdirectory of the storage directory and checks it is a real
/// directory: a symlink there (to somewhere this backend does not own) is refused, never
/// followed. With `create` false (a read-only open) a missing one is left missing.
fn own_subdir(path: &Path, create: bool) -> Result<()> {
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
        Err(e) if e.kind() == io::ErrorKind::NotFound && !create => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => match fs::create_dir(path) {
            Ok(()) => Ok(()),
            // Another process sharing the directory made it since we looked: check what it
            // made (a directory is fine, anything else is refused as above).
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => own_subdir(path, false),
            Err(e) => Err(StorageError::io("create directory", path)(e)),
        },
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
pub(crate) fn owned_temp_instance(name: &str) -> Option<&str> {
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

/// This instance's registration in `tmp/`: its name, scratch directory and held lock file.
struct Instance {
    name: String,
    tmp: PathBuf,
    lock_path: PathBuf,
    lock: File,
    /// Files of dead instances removed while registering.
    stale_files: u64,
}

impl Pages {
    /// An open with the io_uring probe given (tests inject a failing one to take
    /// the fallback path on a kernel that has io_uring).
    #[cfg(test)]
    pub(crate) fn open_with_probe(
        opts: FileOptions,
        probe: impl FnOnce(&Path, &FileOptions, bool) -> io::Result<Ring>,
    ) -> Result<Self> {
        Self::open_inner(opts, probe, Clock::system())
    }

    /// Opens (creating if needed) the directory of `opts`, recovering what a previous run
    /// committed, with `probe` building the io_uring driver and `clock` measuring expiry.
    #[tracing::instrument(name = "file.open", skip_all, fields(dir = %opts.dir.display(), pages))]
    pub(crate) fn open_inner(
        opts: FileOptions,
        probe: impl FnOnce(&Path, &FileOptions, bool) -> io::Result<Ring>,
        clock: Clock,
    ) -> Result<Self> {
        sys::raise_nofile_limit();
        let root = opts.dir.clone();
        let paths = Layout { root: root.clone() };
        if let Some(c) = opts.capacity_bytes {
            check_capacity(c, 1)?;
        }
        if opts.read_only {
            return Self::open_read_only(opts, clock);
        }
        let dir_lock = Self::lock_directory(&root, opts.shared)?;
        own_subdir(&paths.pages(), true)?;
        own_subdir(&paths.tmp(), true)?;
        let inst = Self::register_instance(&paths.tmp(), opts.shared)?;
        let direct = Self::choose_direct(&opts, &inst.tmp)?;
        let unnamed = Self::open_unnamed_dir(&paths.pages(), &inst.tmp, direct)?;
        let (driver, uring): (Box<dyn Driver>, bool) =
            match opts.io_engine.choose(|| probe(&inst.tmp, &opts, direct)) {
                Ok(Some(r)) => (Box::new(r), true),
                Ok(None) => (Box::new(Threads::new(opts.io_threads)), false),
                Err(e) => {
                    return Err(backend_err_caused(
                        format!(
                            "{}: io_uring unavailable (io_engine: \"uring\")",
                            root.display()
                        ),
                        e,
                    ));
                }
            };
        let (index, capacity, mut report, evicted_bytes) = Self::recover(&paths, &opts)?;
        report.discarded_temp += inst.stale_files;
        report.direct = direct;
        report.uring = uring;
        let counters = StatsCounters::default();
        bump(
            &counters.discarded_on_open,
            report.discarded_pages + report.discarded_temp,
        );
        bump(&counters.evicted_pages, report.evicted);
        bump(&counters.evicted_bytes, evicted_bytes);
        tracing::Span::current().record("pages", report.pages);
        tracing::info!(dir = %root.display(), ?report, capacity, "file backend opened");
        let guard = WriteGuard::new(NAME, opts.read_only, &paths.root);
        let index = Arc::new(Mutex::new(index));
        let mut backend = Self {
            rescan_bytes: opts.rescan_bytes.unwrap_or((capacity / 16).max(1)),
            bufs: BufPool::new(64 << 20),
            driver,
            uring,
            opts,
            paths,
            instance: inst.name,
            instance_tmp: inst.tmp,
            unnamed,
            instance_lock_path: inst.lock_path,
            direct,
            core: Core {
                guard,
                counters: Arc::new(counters),
                capacity,
                index,
            },
            clock: clock.clone(),
            reclaim: ReclaimStage::none(),
            reclaim_hook: Arc::new(Mutex::new(None)),
            tmp_seq: AtomicU64::new(0),
            written_since_rescan: AtomicU64::new(0),
            commit: Default::default(),
            report,
            _dir_lock: Some(dir_lock),
            _instance_lock: Some(inst.lock),
        };
        backend.start_reclaimer()?;
        Ok(backend)
    }

    /// A read-only open (for checks): creates, modifies and deletes nothing. The directory
    /// must exist and be ours (or empty: an empty store); the directory lock is taken shared
    /// (an exclusive owner refuses the check; the lock file is neither created nor written);
    /// no instance is registered, no probe file written (buffered reads on the threads
    /// engine); recovery is computed in memory, its report counting what a read-write open
    /// would discard (invalid page files, dead instances' temp files) and evict.
    fn open_read_only(mut opts: FileOptions, clock: Clock) -> Result<Self> {
        let root = opts.dir.clone();
        let paths = Layout { root: root.clone() };
        if !root.is_dir() {
            return Err(backend_err(format!(
                "{} is not a directory (a read-only open creates nothing)",
                root.display()
            )));
        }
        claim_directory(&root, false)?;
        let dir_lock = Self::lock_read_only(&root)?;
        own_subdir(&paths.pages(), false)?;
        own_subdir(&paths.tmp(), false)?;
        let stale = match fs::symlink_metadata(paths.tmp()) {
            Ok(m) if m.file_type().is_dir() => Self::clean_temp(&paths.tmp(), opts.shared, true)?,
            _ => 0,
        };
        let (index, capacity, mut report, evicted_bytes) = Self::recover(&paths, &opts)?;
        report.discarded_temp += stale;
        let counters = StatsCounters::default();
        bump(
            &counters.discarded_on_open,
            report.discarded_pages + report.discarded_temp,
        );
        bump(&counters.evicted_pages, report.evicted);
        bump(&counters.evicted_bytes, evicted_bytes);
        tracing::info!(dir = %root.display(), ?report, capacity, "file backend opened read-only");
        // Nothing is adopted, refreshed or cleaned up behind other processes: a read-only
        // instance behaves as an exclusive one that never writes.
        opts.shared = false;
        let guard = WriteGuard::new(NAME, opts.read_only, &paths.root);
        let index = Arc::new(Mutex::new(index));
        Ok(Self {
            rescan_bytes: u64::MAX,
            bufs: BufPool::new(64 << 20),
            driver: Box::new(Threads::new(opts.io_threads)),
            uring: false,
            opts,
            paths,
            instance: String::new(),
            instance_tmp: PathBuf::new(),
            unnamed: None,
            instance_lock_path: PathBuf::new(),
            direct: false,
            core: Core {
                guard,
                counters: Arc::new(counters),
                capacity,
                index,
            },
            clock: clock.clone(),
            reclaim: ReclaimStage::none(),
            reclaim_hook: Arc::new(Mutex::new(None)),
            tmp_seq: AtomicU64::new(0),
            written_since_rescan: AtomicU64::new(0),
            commit: Default::default(),
            report,
            _dir_lock: dir_lock,
            _instance_lock: None,
        })
    }

    /// A shared lock on an existing `dir.lock` (none if there is none): refused while an
    /// exclusive owner holds it. Writes nothing.
    fn lock_read_only(root: &Path) -> Result<Option<File>> {
        let lock_path = root.join("dir.lock");
        let lock = match File::open(&lock_path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StorageError::io("open", &lock_path)(e)),
        };
        if !sys::try_flock(&lock, false).map_err(StorageError::io("lock", &lock_path))? {
            let holder = fs::read_to_string(&lock_path).unwrap_or_default();
            return Err(backend_err(format!(
                "{} is in use by {} in exclusive mode; a read-only open waits for it to stop",
                root.display(),
                holder.trim()
            )));
        }
        Ok(Some(lock))
    }

    /// Ownership and the directory lock. The directory is ours only if it carries our marker,
    /// or is empty (or new) and we mark it now; a non-empty unmarked directory is refused
    /// untouched. The lock is exclusive, or shared among shared-mode processes; the lock file
    /// is never truncated before the lock is held, so a refused opener can name the holder
    /// an exclusive owner wrote into it.
    fn lock_directory(root: &Path, shared: bool) -> Result<File> {
        fs::create_dir_all(root).map_err(StorageError::io("create directory", root))?;
        claim_directory(root, true)?;
        let lock_path = root.join("dir.lock");
        let dir_lock = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(StorageError::io("create", &lock_path))?;
        if !sys::try_flock(&dir_lock, !shared).map_err(StorageError::io("lock", &lock_path))? {
            let holder = fs::read_to_string(&lock_path).unwrap_or_default();
            if sys::holder_is_this_process(&holder) {
                return Err(backend_err(sys::held_by_this_process(root)));
            }
            let holder = match holder.trim() {
                "" => "processes in shared mode".to_string(),
                h => h.to_string(),
            };
            return Err(backend_err(format!(
                "{} is in use by {holder}{}; to share a directory, every process must \
                 open it with \"shared\": true",
                root.display(),
                if shared { " in exclusive mode" } else { "" }
            )));
        }
        // Any text in the lock file now is a dead owner's: an exclusive owner names itself,
        // shared owners leave it empty.
        write_holder(&dir_lock, !shared).map_err(StorageError::io("write", &lock_path))?;
        Ok(dir_lock)
    }

    /// Under the registry lock (so no instance is seen between creating and locking its lock
    /// file): removes dead instances' leftovers (everything in exclusive mode), then
    /// registers this instance with a lock file it holds for its whole life and a scratch
    /// directory.
    fn register_instance(tmp: &Path, shared: bool) -> Result<Instance> {
        let registry_path = tmp.join(REGISTRY_LOCK);
        let registry =
            File::create(&registry_path).map_err(StorageError::io("create", &registry_path))?;
        sys::flock_wait(&registry).map_err(StorageError::io("lock", &registry_path))?;
        let stale_files = Self::clean_temp(tmp, shared, false)?;
        let name = format!(
            "{}-{:x}",
            std::process::id(),
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        );
        let lock_path = tmp.join(format!("{name}.lock"));
        let lock = File::create(&lock_path).map_err(StorageError::io("create", &lock_path))?;
        sys::try_flock(&lock, true).map_err(StorageError::io("lock", &lock_path))?;
        sys::unflock(&registry);
        drop(registry);
        let inst_tmp = tmp.join(&name);
        debug_assert!(!name.contains('.'), "temp names split on '.'");
        fs::create_dir_all(&inst_tmp).map_err(StorageError::io("create directory", &inst_tmp))?;
        Ok(Instance {
            name,
            tmp: inst_tmp,
            lock_path,
            lock,
            stale_files,
        })
    }

    /// `pages/` held open for unnamed page files, where the file system has `O_TMPFILE`
    /// (probed in the instance's scratch directory); `None` where it has not.
    fn open_unnamed_dir(pages: &Path, scratch: &Path, direct: bool) -> Result<Option<Arc<DirFd>>> {
        let mut dir = DirFd::open(pages).map_err(StorageError::io("open directory", pages))?;
        let ok = dir.probe_unnamed(direct, scratch);
        tracing::debug!(ok, via = ?dir.link_via(), "file backend: unnamed page files");
        Ok(ok.then(|| Arc::new(dir)))
    }

    /// Whether page I/O uses O_DIRECT: as configured, probed in the scratch directory.
    fn choose_direct(opts: &FileOptions, scratch: &Path) -> Result<bool> {
        if opts.direct_io == DirectIo::Off {
            return Ok(false);
        }
        let ok = crate::io::probe_direct(scratch).is_ok();
        if !ok && opts.direct_io == DirectIo::On {
            return Err(backend_err(format!(
                "{}: the file system refuses O_DIRECT (direct_io: \"on\")",
                opts.dir.display()
            )));
        }
        if !ok {
            tracing::info!(dir = %opts.dir.display(), "file backend: O_DIRECT refused, using buffered I/O");
        }
        Ok(ok)
    }

    /// Builds the io_uring driver and proves it here: a block written (durably, with the
    /// backend's O_DIRECT choice) and read back through the ring, in the scratch directory.
    pub(crate) fn probe_uring(dir: &Path, opts: &FileOptions, direct: bool) -> io::Result<Ring> {
        let ring = Ring::new(opts.queue_depth as u32, false)?;
        let path = dir.join("uring-probe.tmp");
        let r = (|| {
            let file = sys::create_new(&path, direct)?;
            sys::preallocate(&file, 8192)?;
            let mut data = AlignedBuf::zeroed(8192);
            for (i, b) in data.iter_mut().enumerate() {
                *b = (i * 31 % 251) as u8;
            }
            let mut back = AlignedBuf::zeroed(8192);
            let req = |dir, fd, buf: &mut AlignedBuf| Req {
                dsync: true,
                ..Req::new(
                    dir,
                    fd,
                    0,
                    vec![libc::iovec {
                        iov_base: buf.as_mut_ptr().cast(),
                        iov_len: buf.len(),
                    }],
                    0,
                )
            };
            let mut res = Vec::new();
            let w = req(Dir::Write, file.as_raw_fd(), &mut data);
            ring.run(vec![w], &mut |_, r| res.push(r));
            drop(file);
            let file = sys::open_read(&path, direct)?;
            let rq = req(Dir::Read, file.as_raw_fd(), &mut back);
            ring.run(vec![rq], &mut |_, r| res.push(r));
            for r in res {
                r.map_err(|e| io::Error::new(e.kind(), format!("io_uring probe: {e}")))?;
            }
            if back[..] != data[..] {
                return Err(io::Error::other("io_uring probe: read back other bytes"));
            }
            Ok(())
        })();
        let _ = fs::remove_file(&path);
        r.map(|()| ring)
    }

    /// Removes dead instances' lock files and scratch directories (only names of the form
    /// this backend creates, `<pid>-<hex>` and `<pid>-<hex>.lock`, and never through a
    /// symlink); returns how many files they held. Anything else in `tmp/` is left alone.
    /// With `dry` (a read-only open) nothing is removed: the files are only counted.
    fn clean_temp(tmp: &Path, shared: bool, dry: bool) -> Result<u64> {
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
                if !dry {
                    let _ = remove_file(&p);
                }
            } else if !is_lock && ty.is_dir() {
                n += remove_tree_counting(&p, dry);
            }
        }
        Ok(n)
    }

    /// Whether the process instance `inst` still runs: it holds the lock on its lock file for
    /// its whole life, and creates that file before any temp file.
    pub(crate) fn instance_alive(tmp: &Path, inst: &str) -> bool {
        match File::open(tmp.join(format!("{inst}.lock"))) {
            Ok(f) => !sys::try_flock(&f, true).unwrap_or(true),
            Err(_) => false,
        }
    }
}
