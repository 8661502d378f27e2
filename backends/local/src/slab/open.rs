//! Opening and recovery: ownership of the directory, its lock, the slabs, the index log's
//! replay into the index, and the capacity fit.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::path::Path;
use std::sync::Arc;

use crate::common::caused;
use crate::io::{BufPool, Ring, Threads, sys};
use crate::slab::engine::Engine;
use hicache_storage::backend::bump;
use hicache_storage::lifecycle::Clock;
use hicache_storage::{Result, StatsCounters, StorageError};
use parking_lot::{Mutex, RwLock};

use crate::common::{Core, ReclaimStage, WriteGuard};
use crate::slab::format::{self, LOCK_FILE, Put, slot_bytes};
use crate::slab::index::{Entry, Index, Loc, SlabDisk};
use crate::slab::log::{IndexLog, Replay};
use crate::slab::slabfile::{Disk, Slab, open_slab};
use crate::slab::{NAME, OpenReport, Slabs, UringOptions, backend_err};

/// The error for a system without a usable io_uring, naming the `file` backend.
pub(crate) fn unavailable(e: &io::Error) -> StorageError {
    let sysctl = fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .map(|s| format!(" (kernel.io_uring_disabled = {})", s.trim()))
        .unwrap_or_default();
    StorageError::Unavailable {
        backend: NAME.into(),
        reason: format!(
            "io_uring is unavailable on this system: io_uring_setup failed: {e}{sysctl}; \
             use `\"io_engine\": \"threads\"` (or `auto`, the default) or the `file` backend \
             (--storage-backend file), which need no io_uring"
        ),
    }
}

/// Takes the directory lock, or says who holds it.
/// Refuses a capacity that cannot hold one page of `page_bytes` (one slot of its size class),
/// which would otherwise evict every stored page at open and store nothing.
pub(crate) fn check_capacity(capacity: u64, page_bytes: usize) -> Result<()> {
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
    if IndexLog::check_owner(dir).map_err(|e| caused(NAME, "", e))? {
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

/// A read-only open's lock: a shared lock on an existing `lock` file (none if there is
/// none), refused while an owner holds it. Writes nothing.
fn lock_dir_read_only(dir: &Path) -> Result<Option<File>> {
    let path = dir.join(LOCK_FILE);
    let mut f = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StorageError::io("open", &path)(e)),
    };
    match f.try_lock_shared() {
        Ok(()) => Ok(Some(f)),
        Err(fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = f.read_to_string(&mut holder);
            Err(backend_err(format!(
                "{} is in use by pid {}; a read-only open waits for it to stop",
                dir.display(),
                holder.trim()
            )))
        }
        Err(fs::TryLockError::Error(e)) => Err(StorageError::io("lock", &path)(e)),
    }
}

/// The slabs as a read-only open sees them: fitting the capacity only counts what would be
/// evicted (no hole is punched, nothing grows).
struct ReadOnlyDisk;

impl SlabDisk for ReadOnlyDisk {
    fn grow(&self, _class: u16, _from: u32, _to: u32) -> io::Result<u32> {
        Err(io::Error::from(io::ErrorKind::ReadOnlyFilesystem))
    }

    fn punch(&self, _class: u16, _slot: u32) {}
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
            if sys::holder_is_this_process(holder) {
                return Err(backend_err(sys::held_by_this_process(dir)));
            }
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

/// Refuses a `grow_bytes` larger than the file system can sensibly give one growth step: the
/// larger of the default step and a quarter of the file system's size.
fn check_grow_bytes(dir: &Path, grow_bytes: u64) -> Result<()> {
    let d = File::open(dir).map_err(StorageError::io("open directory", dir))?;
    let (_, total) = sys::fs_space(&d).map_err(StorageError::io("statvfs", dir))?;
    let limit = (total / 4).max(crate::slab::options::DEFAULT_GROW_BYTES);
    if grow_bytes > limit {
        return Err(StorageError::config(
            format!("backend {NAME}"),
            "grow_bytes",
            grow_bytes.to_string(),
            format!(
                "more than a quarter of the file system of {} ({total} bytes in all): a slab \
                 grows by this much at once; at most {limit}",
                dir.display()
            ),
        ));
    }
    Ok(())
}

impl Slabs {
    /// Opens (creating if needed) the storage directory of `opts`, recovering what a previous
    /// run committed, with the clock page expiry (`ttl_s`) is measured with. Blocking: it
    /// replays the index log.
    /// With [`read_only`](UringOptions::read_only) nothing in the directory is created,
    /// modified or deleted: the lock is taken shared from an existing lock file, the log is
    /// replayed in memory (its damage counted, not preserved, cut or rewritten), only
    /// existing slabs are opened (for reading), and no compaction or eviction reaches the
    /// disk; the report counts what a read-write open would discard and evict.
    #[tracing::instrument(name = "uring.open", skip_all, fields(dir = %opts.dir.display(), pages))]
    pub(crate) fn open_at(opts: UringOptions, clock: Clock) -> Result<Self> {
        let dir = opts.dir.clone();
        let ro = opts.read_only;
        let lock = Self::take_directory(&opts)?;
        let engine = Self::engine(&opts)?;
        let (mut log, replay) = if ro {
            IndexLog::open_read_only(&dir)
        } else {
            IndexLog::open(&dir)
        }
        .map_err(|e| caused(NAME, "index log", e))?;
        let (sizes, slabs, file_slots) = Self::open_slabs(&engine, &opts)?;
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
        let opened = clock.now() / 1_000_000_000;
        let discarded_pages = Self::restore(&mut index, &replay, &sizes, opened);
        let victims = if ro {
            index.fit(&ReadOnlyDisk)
        } else {
            index.fit(&Disk(&slabs))
        };
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
        if !ro && (!victims.is_empty() || discarded_pages > 0 || log.records() > 2 * live + 1024) {
            let puts = Self::live_puts(&index);
            log.compact(&puts)
                .map_err(|e| caused(NAME, "index log compaction", e))?;
            report.compacted = true;
        }
        tracing::Span::current().record("pages", report.pages);
        tracing::info!(dir = %dir.display(), ?report, capacity, "uring backend opened");
        let index = Arc::new(Mutex::new(index));
        let mut backend = Self {
            engine,
            slabs: RwLock::new(slabs),
            new_slab: Mutex::new(()),
            log: Mutex::new(log),
            dels: Arc::new(Mutex::new(Vec::new())),
            core: Core {
                guard: WriteGuard::new(NAME, opts.read_only, &opts.dir),
                counters: Arc::new(counters),
                capacity,
                index,
            },
            reclaim: ReclaimStage::none(),
            bounced: 0.into(),
            compactions: 0.into(),
            pool: BufPool::new(64 << 20),
            commit: crate::slab::commit::GroupCommit::default(),
            report,
            clock,
            opts,
            _lock: lock,
        };
        backend.start_reclaimer()?;
        Ok(backend)
    }

    /// Checks the options against the directory, creates it (unless read-only), makes sure
    /// it is ours and locks it; returns the lock (none for a read-only open of a directory
    /// without a lock file).
    fn take_directory(opts: &UringOptions) -> Result<Option<File>> {
        let dir = &opts.dir;
        if !opts.read_only {
            fs::create_dir_all(dir).map_err(StorageError::io("create directory", dir))?;
        } else if !dir.is_dir() {
            return Err(backend_err(format!(
                "{} is not a directory (a read-only open creates nothing)",
                dir.display()
            )));
        }
        if let Some(c) = opts.capacity_bytes {
            check_capacity(c, opts.page_bytes.unwrap_or(1) as usize)?;
        }
        check_grow_bytes(dir, opts.grow_bytes)?;
        // Ownership before anything is written, the lock file included.
        claim_directory(dir)?;
        if opts.read_only {
            lock_dir_read_only(dir)
        } else {
            lock_dir(dir).map(Some)
        }
    }

    /// The engine `io_engine` asks for: io_uring (`uring`, or `auto` where the kernel allows
    /// it), else the threads engine; `uring` without a usable io_uring is an error naming the
    /// `file` backend and `io_engine: "threads"`.
    fn engine(opts: &UringOptions) -> Result<Engine> {
        let ring = opts
            .io_engine
            .choose(|| Ring::new(opts.queue_depth, opts.fixed_files))
            .map_err(|e| unavailable(&e))?;
        Ok(match ring {
            Some(r) => Engine::Ring(r),
            None => Engine::Threads(Threads::new(opts.queue_depth.clamp(1, 32) as usize)),
        })
    }

    /// The slabs: every slab file present, plus the configured page size's (a slab the log
    /// names but that was lost is not recreated; its pages are then ignored). Returns the
    /// slot sizes, the slabs and the slots each file holds.
    #[allow(clippy::type_complexity)]
    fn open_slabs(
        engine: &Engine,
        opts: &UringOptions,
    ) -> Result<(Vec<u64>, Vec<Arc<Slab>>, Vec<u32>)> {
        let dir = &opts.dir;
        let mut sizes: Vec<u64> = Vec::new();
        for e in fs::read_dir(dir)
            .map_err(StorageError::io("list", dir))?
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
        // A read-only open creates no slab: only those present are opened.
        if let Some(p) = opts.page_bytes.filter(|_| !opts.read_only) {
            sizes.push(slot_bytes(p as usize));
        }
        sizes.sort_unstable();
        sizes.dedup();
        let mut slabs = Vec::new();
        let mut file_slots = Vec::new();
        for &s in &sizes {
            let (slab, len) = Self::make_slab(engine, dir, s, slabs.len(), opts.read_only)?;
            file_slots.push(u32::try_from(len.div_ceil(s)).unwrap_or(u32::MAX));
            slabs.push(Arc::new(slab));
        }
        if slabs.is_empty() && !opts.read_only {
            Self::probe_direct(dir)?;
        }
        Ok((sizes, slabs, file_slots))
    }

    /// Restores the replayed `put` records into `index`; returns how many name a slab or slot
    /// that does not exist (discarded).
    /// `opened` (Unix seconds) stands in for a record's unknown write time.
    fn restore(index: &mut Index, replay: &Replay, sizes: &[u64], opened: u64) -> u64 {
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
                            // Unknown (an earlier build's record): counts from this open.
                            written: if p.written == 0 { opened } else { p.written },
                        },
                    )
                });
            if !restored {
                discarded_pages += 1;
            }
        }
        index.finish_restore();
        discarded_pages
    }

    pub(crate) fn probe_direct(dir: &Path) -> Result<()> {
        let p = dir.join("direct-probe.tmp");
        let r = open_slab(&p, false);
        let _ = fs::remove_file(&p);
        r.map(drop).map_err(|e| {
            caused(
                NAME,
                format!(
                    "{}: the file system refuses O_DIRECT (the uring backend needs a local \
                     disk file system: ext4, xfs; use the `file` backend elsewhere)",
                    dir.display()
                ),
                e,
            )
        })
    }

    pub(crate) fn live_puts(ix: &Index) -> Vec<Put> {
        ix.entries_by_seq()
            .into_iter()
            .map(|(key, e)| Put {
                seq: e.seq,
                key,
                meta: e.meta,
                slot_bytes: ix.slot_bytes(e.loc.class),
                slot: e.loc.slot as u64,
                sum: e.sum,
                written: e.written,
            })
            .collect()
    }
}
