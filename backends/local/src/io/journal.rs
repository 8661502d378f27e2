//! The I/O journal (feature `journal`; off unless a test starts it): every write, sync,
//! create, rename and unlink the local layouts issue through this crate, in issue order, so
//! that a power-loss test can compute the crash states a file system may legally leave
//! ([`Journal::crash_state`]) and recover each.
//!
//! The model (a subset of what POSIX allows, close to ext4 with `data=ordered`):
//! 1. A file's write is durable once a sync of that file (`fsync`/`fdatasync`) or an
//!    `RWF_DSYNC` completion covering it was recorded after it; until then, at a crash, each
//!    4096-byte block it touched holds the old or the new bytes (dropped, kept or torn).
//! 2. A size change (preallocation, growth) is durable with the file's next sync.
//! 3. A directory operation (create, link, rename, unlink) is durable once its directory was
//!    synced after it; until then, at a crash, it may be undone (each independently, applied
//!    in order).
//! 4. A file-system sync (`syncfs`) makes every operation recorded before it durable: all
//!    writes and size changes of every file, and every directory operation.
//!
//! Writes are recorded when issued (an in-flight write may land whole, partly or not at all),
//! `RWF_DSYNC` durability when the write completed.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Block size of torn writes.
pub const BLOCK: usize = 4096;

/// One recorded operation. Paths are relative to the journal's root; files are named by
/// inode number.
#[derive(Clone, Debug)]
pub enum Event {
    /// `data` written at `offset` of inode `ino`.
    Write {
        /// Inode.
        ino: u64,
        /// File offset.
        offset: u64,
        /// The bytes.
        data: Vec<u8>,
    },
    /// Inode `ino`'s size set to at least `len` (preallocation) or exactly (`exact`).
    SetLen {
        /// Inode.
        ino: u64,
        /// New length.
        len: u64,
    },
    /// Inode `ino`'s writes made durable (all, or those within `range`).
    Sync {
        /// Inode.
        ino: u64,
        /// `(offset, len)`, or `None` for the whole file.
        range: Option<(u64, u64)>,
    },
    /// A new file `path` (inode `ino`), empty.
    Create {
        /// Relative path.
        path: PathBuf,
        /// Inode.
        ino: u64,
    },
    /// Inode `ino` (created without a name, empty) linked as `path` (which did not exist).
    Link {
        /// Relative path.
        path: PathBuf,
        /// Inode.
        ino: u64,
    },
    /// `from` renamed to `to` (replacing it).
    Rename {
        /// Relative path.
        from: PathBuf,
        /// Relative path.
        to: PathBuf,
    },
    /// `path` removed.
    Unlink {
        /// Relative path.
        path: PathBuf,
    },
    /// Directory `dir` synced (its entries durable).
    SyncDir {
        /// Relative path.
        dir: PathBuf,
    },
    /// The whole file system synced (`syncfs`): everything before it durable.
    SyncFs,
    /// The test's marker: batch `tag` was acknowledged here.
    Ack {
        /// The test's tag.
        tag: u64,
    },
}

struct Recorder {
    root: PathBuf,
    inodes: HashSet<u64>,
    events: Vec<Event>,
}

/// The tree at the start of a recording: directories, and files (path, inode, contents).
pub type StartTree = (Vec<PathBuf>, Vec<(PathBuf, u64, Vec<u8>)>);

static ACTIVE: AtomicBool = AtomicBool::new(false);
static RECORDER: Mutex<Option<Recorder>> = Mutex::new(None);

fn with(f: impl FnOnce(&mut Recorder)) {
    if !ACTIVE.load(Ordering::Relaxed) {
        return;
    }
    if let Some(r) = RECORDER.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
        f(r);
    }
}

fn ino_of_fd(fd: i32) -> Option<u64> {
    // SAFETY: fstat on a descriptor the caller holds open; `st` is a plain out-value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st.st_ino)
}

fn rel(r: &Recorder, p: &Path) -> Option<PathBuf> {
    p.strip_prefix(&r.root).ok().map(Path::to_path_buf)
}

/// Records a write of `data` at `offset` of the file open as `fd`.
pub fn write(fd: i32, offset: u64, data: &[u8]) {
    with(|r| {
        if let Some(ino) = ino_of_fd(fd).filter(|i| r.inodes.contains(i)) {
            r.events.push(Event::Write {
                ino,
                offset,
                data: data.to_vec(),
            });
        }
    });
}

/// Records a write described by iovecs (copied now).
///
/// # Safety
/// Every iovec must describe readable memory.
pub unsafe fn write_iov(fd: i32, offset: u64, iov: &[libc::iovec]) {
    if !ACTIVE.load(Ordering::Relaxed) {
        return;
    }
    let mut data = Vec::new();
    for v in iov {
        // SAFETY: the caller guarantees each iovec is readable.
        data.extend_from_slice(unsafe {
            std::slice::from_raw_parts(v.iov_base.cast::<u8>(), v.iov_len)
        });
    }
    write(fd, offset, &data);
}

/// Records a size change of the file open as `fd`.
pub fn set_len(fd: i32, len: u64) {
    with(|r| {
        if let Some(ino) = ino_of_fd(fd).filter(|i| r.inodes.contains(i)) {
            r.events.push(Event::SetLen { ino, len });
        }
    });
}

/// Records a sync of the file open as `fd` (of `range`, or all of it).
pub fn sync(fd: i32, range: Option<(u64, u64)>) {
    with(|r| {
        if let Some(ino) = ino_of_fd(fd).filter(|i| r.inodes.contains(i)) {
            r.events.push(Event::Sync { ino, range });
        }
    });
}

/// Records the creation of `path`, open as `file`.
pub fn create(path: &Path, file: &File) {
    with(|r| {
        if let (Some(path), Ok(m)) = (rel(r, path), file.metadata()) {
            r.inodes.insert(m.ino());
            r.events.push(Event::Create { path, ino: m.ino() });
        }
    });
}

/// Records the creation of a file without a name (`O_TMPFILE`), open as `file`: its writes
/// are recorded from now on; it appears in the tree only once linked ([`link`]).
pub fn create_unnamed(file: &File) {
    with(|r| {
        if let Ok(m) = file.metadata() {
            r.inodes.insert(m.ino());
        }
    });
}

/// Records that the file open as `file` was linked as `path`.
pub fn link(file: &File, path: &Path) {
    with(|r| {
        if let (Some(path), Ok(m)) = (rel(r, path), file.metadata()) {
            r.inodes.insert(m.ino());
            r.events.push(Event::Link { path, ino: m.ino() });
        }
    });
}

/// Records that the file open as `file` was linked as `name` in the directory `dir` (the
/// path is joined only while recording).
pub fn link_at(file: &File, dir: &Path, name: &std::ffi::OsStr) {
    if ACTIVE.load(Ordering::Relaxed) {
        link(file, &dir.join(name));
    }
}

/// Records a rename.
pub fn rename(from: &Path, to: &Path) {
    with(|r| {
        if let (Some(from), Some(to)) = (rel(r, from), rel(r, to)) {
            r.events.push(Event::Rename { from, to });
        }
    });
}

/// Records an unlink.
pub fn unlink(path: &Path) {
    with(|r| {
        if let Some(path) = rel(r, path) {
            r.events.push(Event::Unlink { path });
        }
    });
}

/// Records a directory sync.
pub fn sync_dir(dir: &Path) {
    with(|r| {
        if let Some(dir) = rel(r, dir) {
            r.events.push(Event::SyncDir { dir });
        }
    });
}

/// Records a sync of the whole file system.
pub fn sync_fs() {
    with(|r| r.events.push(Event::SyncFs));
}

/// Records the test's acknowledgement marker.
pub fn ack(tag: u64) {
    with(|r| r.events.push(Event::Ack { tag }));
}

/// A recorded run: the tree at the start (taken as durable) and the events since.
#[derive(Clone, Debug)]
pub struct Journal {
    /// Directories at the start (relative).
    pub dirs: Vec<PathBuf>,
    /// Files at the start: relative path, inode, contents.
    pub files: Vec<(PathBuf, u64, Vec<u8>)>,
    /// The events, in issue order.
    pub events: Vec<Event>,
}

#[cfg(feature = "journal")]
fn walk(root: &Path, at: &Path, dirs: &mut Vec<PathBuf>, files: &mut Vec<(PathBuf, u64, Vec<u8>)>) {
    let Ok(rd) = std::fs::read_dir(at) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let r = p.strip_prefix(root).expect("below root").to_path_buf();
        match e.file_type() {
            Ok(t) if t.is_dir() => {
                dirs.push(r);
                walk(root, &p, dirs, files);
            }
            Ok(t) if t.is_file() => {
                if let (Ok(m), Ok(b)) = (e.metadata(), std::fs::read(&p)) {
                    files.push((r, m.ino(), b));
                }
            }
            _ => {}
        }
    }
}

#[cfg(feature = "journal")]
/// Starts recording operations under `root`, taking its current tree as the durable start.
/// One recording at a time per process.
pub fn start(root: &Path) -> StartTree {
    let mut dirs = Vec::new();
    let mut files = Vec::new();
    walk(root, root, &mut dirs, &mut files);
    let inodes = files.iter().map(|f| f.1).collect();
    *RECORDER.lock().unwrap_or_else(|p| p.into_inner()) = Some(Recorder {
        root: root.to_path_buf(),
        inodes,
        events: Vec::new(),
    });
    ACTIVE.store(true, Ordering::SeqCst);
    (dirs, files)
}

/// Stops recording; returns the events.
#[cfg(feature = "journal")]
pub fn stop() -> Vec<Event> {
    ACTIVE.store(false, Ordering::SeqCst);
    RECORDER
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
        .map(|r| r.events)
        .unwrap_or_default()
}

/// A file's state while replaying: durable bytes, and the writes since its last sync.
#[derive(Clone, Default)]
struct Inode {
    durable: Vec<u8>,
    /// `(event index, offset, data)` or a size change `(index, len, empty)`.
    pending: Vec<Pending>,
}

#[derive(Clone)]
enum Pending {
    Write(u64, Vec<u8>),
    SetLen(u64),
}

fn apply_write(buf: &mut Vec<u8>, offset: u64, data: &[u8], keep_block: &mut dyn FnMut() -> bool) {
    let off = offset as usize;
    let end = off + data.len();
    if buf.len() < end {
        buf.resize(end, 0);
    }
    let mut at = off;
    while at < end {
        let next = ((at / BLOCK) + 1) * BLOCK;
        let stop = next.min(end);
        if keep_block() {
            buf[at..stop].copy_from_slice(&data[at - off..stop - off]);
        }
        at = stop;
    }
}

fn apply(buf: &mut Vec<u8>, p: &Pending, keep_block: &mut dyn FnMut() -> bool) {
    match p {
        Pending::Write(o, d) => apply_write(buf, *o, d, keep_block),
        Pending::SetLen(l) => {
            if keep_block() && buf.len() < *l as usize {
                buf.resize(*l as usize, 0);
            }
        }
    }
}

/// What each random choice of a crash state decides: `choose(n)` returns a number below `n`.
pub type Chooser<'a> = &'a mut dyn FnMut(u32) -> u32;

impl Journal {
    /// Stops recording and returns what was recorded, with the start tree.
    #[cfg(feature = "journal")]
    pub fn finish(start: StartTree) -> Self {
        Self {
            dirs: start.0,
            files: start.1,
            events: stop(),
        }
    }

    /// The acknowledgement tags recorded before event `k`.
    pub fn acked_before(&self, k: usize) -> Vec<u64> {
        self.events[..k]
            .iter()
            .filter_map(|e| match e {
                Event::Ack { tag } => Some(*tag),
                _ => None,
            })
            .collect()
    }

    /// A crash state after the first `k` events: relative path to contents, per the model
    /// in the module docs, each undetermined choice made by `choose`.
    pub fn crash_state(&self, k: usize, choose: Chooser<'_>) -> BTreeMap<PathBuf, Vec<u8>> {
        let mut inodes: BTreeMap<u64, Inode> = BTreeMap::new();
        let mut durable_ns: BTreeMap<PathBuf, u64> = BTreeMap::new();
        for (p, ino, b) in &self.files {
            inodes.insert(
                *ino,
                Inode {
                    durable: b.clone(),
                    pending: Vec::new(),
                },
            );
            durable_ns.insert(p.clone(), *ino);
        }
        // Namespace operations not yet covered by a sync of their directory.
        let mut ns_pending: Vec<Event> = Vec::new();
        for e in &self.events[..k] {
            match e {
                Event::Write { ino, offset, data } => inodes
                    .entry(*ino)
                    .or_default()
                    .pending
                    .push(Pending::Write(*offset, data.clone())),
                Event::SetLen { ino, len } => inodes
                    .entry(*ino)
                    .or_default()
                    .pending
                    .push(Pending::SetLen(*len)),
                Event::Sync { ino, range } => {
                    let f = inodes.entry(*ino).or_default();
                    let (now, later): (Vec<Pending>, Vec<Pending>) =
                        f.pending.drain(..).partition(|p| match (p, range) {
                            (_, None) => true,
                            (Pending::SetLen(_), Some(_)) => true,
                            (Pending::Write(o, d), Some((ro, rl))) => {
                                *o >= *ro && *o + d.len() as u64 <= ro + rl
                            }
                        });
                    for p in &now {
                        apply(&mut f.durable, p, &mut || true);
                    }
                    f.pending = later;
                }
                Event::Create { ino, .. } | Event::Link { ino, .. } => {
                    inodes.entry(*ino).or_default();
                    ns_pending.push(e.clone());
                }
                Event::Rename { .. } | Event::Unlink { .. } => ns_pending.push(e.clone()),
                Event::SyncDir { dir } => {
                    // Apply (durably) every pending operation in this directory, in order.
                    let (mine, rest): (Vec<Event>, Vec<Event>) =
                        ns_pending.drain(..).partition(|op| in_dir(op, dir));
                    for op in &mine {
                        apply_ns(&mut durable_ns, op);
                    }
                    ns_pending = rest;
                }
                Event::SyncFs => {
                    for f in inodes.values_mut() {
                        for p in f.pending.drain(..) {
                            apply(&mut f.durable, &p, &mut || true);
                        }
                    }
                    for op in ns_pending.drain(..) {
                        apply_ns(&mut durable_ns, &op);
                    }
                }
                Event::Ack { .. } => {}
            }
        }
        let mut ns = durable_ns;
        for op in &ns_pending {
            if choose(2) == 1 {
                apply_ns(&mut ns, op);
            }
        }
        let mut out = BTreeMap::new();
        for (path, ino) in ns {
            let Some(f) = inodes.get(&ino) else { continue };
            let mut b = f.durable.clone();
            for p in &f.pending {
                // Dropped, kept, or torn block by block.
                match choose(3) {
                    0 => {}
                    1 => apply(&mut b, p, &mut || true),
                    _ => apply(&mut b, p, &mut || choose(2) == 1),
                }
            }
            out.insert(path, b);
        }
        out
    }

    /// Writes a crash state into the empty directory `into` (with the start's directories).
    pub fn materialize(
        &self,
        state: &BTreeMap<PathBuf, Vec<u8>>,
        into: &Path,
    ) -> std::io::Result<()> {
        for d in &self.dirs {
            std::fs::create_dir_all(into.join(d))?;
        }
        for (p, b) in state {
            if let Some(parent) = into.join(p).parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(into.join(p), b)?;
        }
        Ok(())
    }
}

fn in_dir(op: &Event, dir: &Path) -> bool {
    let parent = |p: &PathBuf| p.parent().map(Path::to_path_buf).unwrap_or_default();
    match op {
        Event::Create { path, .. } | Event::Link { path, .. } | Event::Unlink { path } => {
            parent(path) == dir
        }
        // A rename is durable with its target's directory (ours stay within one directory).
        Event::Rename { to, .. } => parent(to) == dir,
        _ => false,
    }
}

fn apply_ns(ns: &mut BTreeMap<PathBuf, u64>, op: &Event) {
    match op {
        Event::Create { path, ino } | Event::Link { path, ino } => {
            ns.insert(path.clone(), *ino);
        }
        Event::Rename { from, to } => {
            if let Some(ino) = ns.remove(from) {
                ns.insert(to.clone(), ino);
            }
        }
        Event::Unlink { path } => {
            ns.remove(path);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsynced_writes_may_be_lost_synced_ones_stay() {
        let j = Journal {
            dirs: vec![],
            files: vec![(PathBuf::from("f"), 1, vec![0; 8192])],
            events: vec![
                Event::Write {
                    ino: 1,
                    offset: 0,
                    data: vec![1; 4096],
                },
                Event::Sync {
                    ino: 1,
                    range: None,
                },
                Event::Write {
                    ino: 1,
                    offset: 4096,
                    data: vec![2; 4096],
                },
                Event::Create {
                    path: "g".into(),
                    ino: 2,
                },
            ],
        };
        // Every choice "drop/undo": the synced write stays, the rest is gone.
        let s = j.crash_state(4, &mut |_| 0);
        assert_eq!(s[Path::new("f")][..4096], [1; 4096]);
        assert_eq!(s[Path::new("f")][4096..], [0; 4096]);
        assert!(!s.contains_key(Path::new("g")));
        // Every choice "keep/apply".
        let s = j.crash_state(4, &mut |n| n - 1 - u32::from(n == 3));
        assert_eq!(s[Path::new("f")][4096..], [2; 4096]);
        assert!(s.contains_key(Path::new("g")));
    }

    /// A file created without a name exists in a crash state only once linked, and its link
    /// is undone at a crash until its directory was synced.
    #[test]
    fn a_link_names_an_unnamed_file_durably_after_its_directory_sync() {
        let j = Journal {
            dirs: vec![PathBuf::from("d")],
            files: vec![],
            events: vec![
                Event::Write {
                    ino: 7,
                    offset: 0,
                    data: vec![4; 4096],
                },
                Event::Sync {
                    ino: 7,
                    range: None,
                },
                Event::Link {
                    path: "d/p".into(),
                    ino: 7,
                },
                Event::SyncDir { dir: "d".into() },
            ],
        };
        assert!(j.crash_state(2, &mut |n| n - 1).is_empty(), "no name yet");
        assert!(j.crash_state(3, &mut |_| 0).is_empty(), "link undone");
        let s = j.crash_state(3, &mut |n| n - 1);
        assert_eq!(s.get(Path::new("d/p")), Some(&vec![4; 4096]));
        let s = j.crash_state(4, &mut |_| 0);
        assert_eq!(s.get(Path::new("d/p")), Some(&vec![4; 4096]), "durable");
    }

    #[test]
    fn a_file_system_sync_makes_everything_before_it_durable() {
        let j = Journal {
            dirs: vec![PathBuf::from("d")],
            files: vec![],
            events: vec![
                Event::Create {
                    path: "d/t".into(),
                    ino: 1,
                },
                Event::SetLen { ino: 1, len: 8192 },
                Event::Write {
                    ino: 1,
                    offset: 0,
                    data: vec![3; 8192],
                },
                Event::Rename {
                    from: "d/t".into(),
                    to: "d/p".into(),
                },
                Event::SyncFs,
                Event::Create {
                    path: "d/u".into(),
                    ino: 2,
                },
            ],
        };
        // Every choice "drop/undo": what came before the sync stays, what came after is gone.
        let s = j.crash_state(6, &mut |_| 0);
        assert_eq!(s.get(Path::new("d/p")), Some(&vec![3; 8192]));
        assert!(!s.contains_key(Path::new("d/t")) && !s.contains_key(Path::new("d/u")));
        // Before the sync nothing is promised.
        let s = j.crash_state(4, &mut |_| 0);
        assert!(s.is_empty(), "{:?}", s.keys().collect::<Vec<_>>());
    }
}
