//! The public fault-injection suite: what a hostile environment does to a persistent backend's
//! directory, as test cases any backend crate runs against itself (beside [`conformance`]).
//!
//! A backend provides a [`FaultTarget`] (how to open it on a given directory with a given
//! capacity) and invokes [`fault_tests!`](crate::fault_tests) in a test file, which expands to
//! one `#[test]` per [`Fault`]:
//!
//! ```text
//! // tests/faults.rs of a backend crate
//! hicache_storage::fault_tests!(my_backend::tests::FaultTarget::new());
//! ```
//!
//! # The invariant checked everywhere
//! Every acknowledged page reads back **intact**, or, if its own bytes were damaged, as a
//! **counted miss** (a `Miss`/`Corrupt` outcome the backend's counters account for:
//! `get_corrupt` or `discarded_on_open`); **never a wrong page** (a hit with other bytes). A
//! single flipped bit costs at most one page. Opening never panics: it succeeds, or (only when
//! a file the target lists in [`FaultTarget::identity_files`] was hit) fails with an error.
//! After every fault the backend still stores and serves new pages.
//!
//! # The faults
//! - [`Fault::BitFlips`]: one bit flipped at a random offset of every kind of file the backend
//!   owns (a fresh copy of the directory per flip, several flips per file; of many files of
//!   one kind, such as one file per page, a few are sampled).
//! - [`Fault::Truncation`]: every kind of file the backend owns cut at every record boundary
//!   (multiples of [`FaultTarget::record_bytes`], the first and last 20 of a long file) and at
//!   odd offsets.
//! - [`Fault::GarbageFiles`]: foreign files and directories dropped into every directory the
//!   backend uses: its pages stay intact and the foreign files are left untouched.
//! - [`Fault::ForeignDirectory`]: a non-empty directory the backend never marked (and one whose
//!   `tmp` is a symlink out of it) is refused with an error naming it; nothing in it, or
//!   behind the symlink, is deleted or changed.
//! - [`Fault::SecondOpener`]: a second open of a directory in use is refused with an error
//!   naming it, and the first opener keeps working.
//! - [`Fault::DiskFull`]: the backend on a small file system (a loop-mounted ext4 image, else a
//!   `size=`-limited tmpfs; both need root, the test is skipped with a printed reason
//!   otherwise) with a capacity far above it, filled past its end: writes fail cleanly (or
//!   older pages are evicted, counted), acknowledged pages stay intact, a reopen serves them,
//!   and deleting pages makes room again.
//!
//! SIGKILL at random points needs a writer process: the crash harness of
//! `hicache-bench/tests/durability` (`storage-write` killed mid-batch, `storage-check` after)
//! runs it for every backend `hicache-bench` compiles in.
//!
//! # Remote backends
//! A backend whose pages live in a server process (no directory of its own) declares it,
//! `fault_tests!(module, target, remote)` with a [`RemoteFaultTarget`]: the directory faults
//! above are then not generated, as they do not apply (a remote backend owns no files, logs or
//! directory: damage to its stored bytes is the conformance `corruption` case, frames cut short
//! and foreign bytes are the `port_garbage` case, a full pool is the conformance
//! `capacity_eviction` case, and a remote server is shared by many clients by design); a
//! `remote_as_declared` test checks the declaration, and the [`remote`] cases run instead:
//! SIGKILL and restart of the server mid-batch, garbage on its port.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::{FileExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use async_trait::async_trait;
use hicache_core::{LayoutKind, PageKey};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::Storage;
use crate::error::Result;
use crate::page::{PageBuf, PageBufMut, PageOutcome};
use crate::pattern::{check_page, fill_page, namespace, page_key};

pub mod remote;

pub use remote::{
    FaultServer, RemoteFault, RemoteFaultTarget, assert_remote, remote_fault_async,
    run_remote_fault,
};

/// How the fault suite opens a backend on a directory.
#[async_trait]
pub trait FaultTarget: Send + Sync + 'static {
    /// Opens the backend on `dir` with a capacity of `capacity_bytes`. `dir` is empty at the
    /// first open of a case and holds what earlier opens left at later ones. The returned
    /// backend must release the directory when the last reference is dropped.
    async fn open(&self, dir: &Path, capacity_bytes: u64) -> Result<Arc<dyn Storage>>;

    /// Where the suite makes its directories (default: the system temp directory). Prefer a
    /// directory on a real disk if the backend uses O_DIRECT.
    fn scratch_root(&self) -> PathBuf {
        std::env::temp_dir()
    }

    /// Bytes per page the suite writes (default 16 KiB).
    fn page_bytes(&self) -> usize {
        16 << 10
    }

    /// Size of one record of the backend's logs, for [`Fault::Truncation`] (default 4096).
    fn record_bytes(&self) -> u64 {
        4096
    }

    /// Names, relative to the directory, of files that identify the directory as the
    /// backend's own (format markers): damage to them may make an open fail (with an error),
    /// where damage anywhere else must not.
    fn identity_files(&self) -> Vec<PathBuf> {
        Vec::new()
    }
}

/// One fault of the suite.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Single bit flips at random offsets in every file the backend owns.
    BitFlips,
    /// Every owned file cut at record boundaries and odd offsets.
    Truncation,
    /// Foreign files in the backend's directories: ignored, never deleted.
    GarbageFiles,
    /// A non-empty unmarked directory (or one with a symlinked `tmp`) is refused untouched.
    ForeignDirectory,
    /// A second opener of a directory in use is refused; the first keeps working.
    SecondOpener,
    /// A full file system: clean write failures, acknowledged pages intact.
    DiskFull,
}

impl Fault {
    /// Every fault, in a sensible order.
    pub const ALL: [Fault; 6] = [
        Fault::BitFlips,
        Fault::Truncation,
        Fault::GarbageFiles,
        Fault::ForeignDirectory,
        Fault::SecondOpener,
        Fault::DiskFull,
    ];
}

/// Runs one fault case on a fresh multi-threaded tokio runtime. Panics, naming the broken
/// invariant, if the backend fails it.
pub fn run_fault<T: FaultTarget>(target: &T, fault: Fault) {
    // One case at a time per process: `disk_full` spawns `mkfs` and `mount`, and a child
    // between its fork and its exec holds a copy of every open descriptor, a directory lock's
    // included, so a sibling case that closes a backend and reopens its directory at that
    // moment would find its own released lock still held.
    static ONE_CASE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_CASE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(fault_async(target, fault));
}

/// Runs one fault case inside the caller's (multi-threaded) runtime.
pub async fn fault_async<T: FaultTarget>(target: &T, fault: Fault) {
    match fault {
        Fault::BitFlips => bit_flips(target).await,
        Fault::Truncation => truncation(target).await,
        Fault::GarbageFiles => garbage_files(target).await,
        Fault::ForeignDirectory => foreign_directory(target).await,
        Fault::SecondOpener => second_opener(target).await,
        Fault::DiskFull => disk_full(target).await,
    }
}

/// Expands to one `#[test]` per [`Fault`], each opening backends through the target
/// expression given (evaluated once per test), in a module named `faults` or the name given
/// first (`fault_tests!(direct, MyTarget::direct())`).
///
/// A remote backend adds `remote` last (`fault_tests!(tcp, MyRemoteTarget, remote)`, with a
/// [`RemoteFaultTarget`]): the directory faults are not generated (they do not apply; see the
/// module documentation for where each is covered), `remote_as_declared` checks the declaration
/// ([`assert_remote`]), and one test per [`RemoteFault`] runs.
#[macro_export]
macro_rules! fault_tests {
    ($module:ident, $target:expr, remote) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            #[test]
            fn remote_as_declared() {
                $crate::faults::assert_remote(&$target);
            }
            #[test]
            fn server_kill() {
                $crate::faults::run_remote_fault(
                    &$target,
                    $crate::faults::RemoteFault::ServerKill,
                );
            }
            #[test]
            fn port_garbage() {
                $crate::faults::run_remote_fault(
                    &$target,
                    $crate::faults::RemoteFault::PortGarbage,
                );
            }
        }
    };
    ($target:expr) => {
        $crate::fault_tests!(faults, $target);
    };
    ($module:ident, $target:expr) => {
        $crate::fault_tests!(@cases $module, $target;
            bit_flips => BitFlips,
            truncation => Truncation,
            garbage_files => GarbageFiles,
            foreign_directory => ForeignDirectory,
            second_opener => SecondOpener,
            disk_full => DiskFull,
        );
    };
    (@cases $module:ident, $target:expr; $($name:ident => $fault:ident,)*) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $name() {
                    let target = $target;
                    $crate::faults::run_fault(&target, $crate::faults::Fault::$fault);
                }
            )*
        }
    };
}

// ---------------------------------------------------------------------------------------------
// The invariant.

const LAYOUT: LayoutKind = LayoutKind::PageFirst;
/// Pages written before each fault.
const PAGES: u64 = 24;
/// Capacity the suite opens backends with (room for every page it writes).
const CAPACITY: u64 = 256 << 20;

fn key(seed: u64, i: u64) -> PageKey {
    page_key(namespace(0xfa17), seed, i)
}

/// What reading back a set of acknowledged pages found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Hits with the right bytes.
    pub intact: u64,
    /// Misses, `Corrupt` outcomes and failed reads.
    pub lost: u64,
    /// Hits with other bytes: never allowed.
    pub wrong: u64,
}

/// Writes `keys` (pattern bytes of `page_bytes` each) and returns the acknowledged ones.
pub async fn write_pages(s: &dyn Storage, keys: &[PageKey], page_bytes: usize) -> Vec<PageKey> {
    let batch = s.info().max_batch.clamp(1, 16);
    let mut acked = Vec::new();
    for chunk in keys.chunks(batch) {
        let bufs: Vec<Vec<u8>> = chunk
            .iter()
            .map(|k| {
                let mut b = vec![0u8; page_bytes];
                fill_page(k, &mut b);
                b
            })
            .collect();
        let src: Vec<PageBuf<'_>> = bufs
            .iter()
            .map(|b| PageBuf::contiguous(LAYOUT, b))
            .collect();
        if let Ok(outcomes) = s.batch_set(chunk, &src).await {
            for (k, o) in chunk.iter().zip(outcomes) {
                if matches!(o, PageOutcome::Stored | PageOutcome::Present) {
                    acked.push(*k);
                }
            }
        }
    }
    acked
}

/// Reads `keys` back and classifies each outcome.
pub async fn read_back(s: &dyn Storage, keys: &[PageKey], page_bytes: usize) -> Tally {
    let mut t = Tally::default();
    let batch = s.info().max_batch.clamp(1, 16);
    for chunk in keys.chunks(batch) {
        let mut bufs = vec![vec![0u8; page_bytes]; chunk.len()];
        let outcomes = {
            let mut dst: Vec<PageBufMut<'_>> = bufs
                .iter_mut()
                .map(|b| PageBufMut::contiguous(LAYOUT, b))
                .collect();
            s.batch_get(chunk, &mut dst).await
        };
        match outcomes {
            Ok(outcomes) => {
                for ((k, o), b) in chunk.iter().zip(outcomes).zip(&bufs) {
                    match o {
                        PageOutcome::Hit if check_page(k, b) => t.intact += 1,
                        PageOutcome::Hit => t.wrong += 1,
                        _ => t.lost += 1,
                    }
                }
            }
            Err(_) => t.lost += chunk.len() as u64,
        }
    }
    t
}

/// Asserts the invariant on `keys` after `what`: no wrong page, at most `max_lost` lost, every
/// loss counted by the backend. Returns the tally.
async fn assert_invariant(
    s: &dyn Storage,
    keys: &[PageKey],
    page_bytes: usize,
    max_lost: u64,
    what: &str,
) -> Tally {
    let t = read_back(s, keys, page_bytes).await;
    assert_eq!(
        t.wrong, 0,
        "{what}: {} pages read back WRONG ({t:?})",
        t.wrong
    );
    assert!(
        t.lost <= max_lost,
        "{what}: {} acknowledged pages lost, at most {max_lost} allowed ({t:?})",
        t.lost
    );
    let st = s.stats();
    let counted = st.get_corrupt + st.discarded_on_open;
    assert!(
        t.lost <= counted,
        "{what}: {} acknowledged pages lost but the backend counted only {counted} \
         (get_corrupt {} + discarded_on_open {}): a silent loss",
        t.lost,
        st.get_corrupt,
        st.discarded_on_open
    );
    t
}

/// After a fault: the backend still stores and serves new pages.
async fn assert_writable(s: &dyn Storage, page_bytes: usize, seed: u64, what: &str) {
    let keys: Vec<PageKey> = (0..4).map(|i| key(seed, i)).collect();
    let acked = write_pages(s, &keys, page_bytes).await;
    assert_eq!(
        acked.len(),
        keys.len(),
        "{what}: the backend no longer stores new pages"
    );
    let t = read_back(s, &keys, page_bytes).await;
    assert_eq!(
        t.intact,
        keys.len() as u64,
        "{what}: new pages do not read back ({t:?})"
    );
}

// ---------------------------------------------------------------------------------------------
// Directory helpers.

fn scratch<T: FaultTarget>(t: &T) -> tempfile::TempDir {
    let root = t.scratch_root();
    fs::create_dir_all(&root).expect("the scratch root");
    tempfile::tempdir_in(root).expect("a scratch directory")
}

async fn open<T: FaultTarget>(t: &T, dir: &Path) -> Arc<dyn Storage> {
    t.open(dir, CAPACITY)
        .await
        .unwrap_or_else(|e| panic!("could not open the backend on {}: {e}", dir.display()))
}

/// A directory holding `PAGES` acknowledged pages of `seed`, the backend closed.
async fn populated<T: FaultTarget>(t: &T, dir: &Path, seed: u64) -> Vec<PageKey> {
    let s = open(t, dir).await;
    let keys: Vec<PageKey> = (0..PAGES).map(|i| key(seed, i)).collect();
    let acked = write_pages(&*s, &keys, t.page_bytes()).await;
    assert_eq!(
        acked.len(),
        keys.len(),
        "the backend refused pages on a fresh directory"
    );
    drop(s);
    acked
}

/// A sample of `files` to damage: up to `per_group` of each group of files that share a
/// directory and an extension (the pages of a file-per-page backend are one group), so the
/// cost stays bounded while every kind of file is hit.
fn sample(files: &BTreeMap<PathBuf, u64>, per_group: usize) -> Vec<(PathBuf, u64)> {
    let mut groups: BTreeMap<(Option<PathBuf>, Option<String>), usize> = BTreeMap::new();
    let mut out = Vec::new();
    for (f, len) in files {
        let group = (
            f.parent().map(Path::to_path_buf),
            f.extension().map(|e| e.to_string_lossy().into_owned()),
        );
        let n = groups.entry(group).or_insert(0);
        if *n < per_group {
            *n += 1;
            out.push((f.clone(), *len));
        }
    }
    out
}

/// Regular files under `dir` (relative path → length), not following symlinks.
fn owned_files(dir: &Path) -> BTreeMap<PathBuf, u64> {
    fn walk(root: &Path, at: &Path, out: &mut BTreeMap<PathBuf, u64>) {
        let Ok(rd) = fs::read_dir(at) else { return };
        for e in rd.flatten() {
            let Ok(ty) = e.file_type() else { continue };
            let p = e.path();
            if ty.is_dir() {
                walk(root, &p, out);
            } else if ty.is_file() {
                let len = e.metadata().map(|m| m.len()).unwrap_or(0);
                out.insert(p.strip_prefix(root).unwrap_or(&p).to_path_buf(), len);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// Copies the tree `from` into `to` (regular files and directories).
fn copy_tree(from: &Path, to: &Path) -> io::Result<()> {
    fs::create_dir_all(to)?;
    for e in fs::read_dir(from)? {
        let e = e?;
        let ty = e.file_type()?;
        let dst = to.join(e.file_name());
        if ty.is_dir() {
            copy_tree(&e.path(), &dst)?;
        } else if ty.is_file() {
            fs::copy(e.path(), &dst)?;
        }
    }
    Ok(())
}

fn flip_bit(path: &Path, offset: u64, bit: u8) -> io::Result<()> {
    let f = fs::OpenOptions::new().read(true).write(true).open(path)?;
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset)?;
    b[0] ^= 1 << bit;
    f.write_all_at(&b, offset)?;
    f.sync_all()
}

/// Opens `dir` after damage to `file`: the backend must open unless `file` identifies the
/// directory, in which case an error is accepted (and `None` returned).
async fn open_after<T: FaultTarget>(
    t: &T,
    dir: &Path,
    file: &Path,
    what: &str,
) -> Option<Arc<dyn Storage>> {
    match t.open(dir, CAPACITY).await {
        Ok(s) => Some(s),
        Err(e) if t.identity_files().iter().any(|f| f == file) => {
            println!("{what}: open refused (identity file damaged): {e}");
            None
        }
        Err(e) => panic!("{what}: the backend no longer opens: {e}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The cases.

/// Flips per owned file.
const FLIPS_PER_FILE: usize = 3;

async fn bit_flips<T: FaultTarget>(t: &T) {
    let pristine = scratch(t);
    let keys = populated(t, pristine.path(), 1).await;
    let files = owned_files(pristine.path());
    assert!(!files.is_empty(), "the backend wrote no files");
    let mut rng = ChaCha8Rng::seed_from_u64(0xb17f);
    let work = scratch(t);
    for (file, len) in &sample(&files, 4) {
        if *len == 0 {
            continue;
        }
        for _ in 0..FLIPS_PER_FILE {
            let dir = work.path().join("d");
            let _ = fs::remove_dir_all(&dir);
            copy_tree(pristine.path(), &dir).expect("copy of the directory");
            let offset = rng.random_range(0..*len);
            let bit = rng.random_range(0..8u8);
            flip_bit(&dir.join(file), offset, bit).expect("flip a bit");
            let what = format!("bit {bit} of byte {offset} of {} flipped", file.display());
            if let Some(s) = open_after(t, &dir, file, &what).await {
                assert_invariant(&*s, &keys, t.page_bytes(), 1, &what).await;
                assert_writable(&*s, t.page_bytes(), 100, &what).await;
            }
        }
    }
}

/// Cut points of a file of `len` bytes: every record boundary (up to a bound) and odd offsets.
fn cut_points(len: u64, record: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..=len / record.max(1))
        .map(|i| i * record)
        .filter(|&o| o < len)
        .collect();
    if v.len() > 40 {
        // Every boundary of the first 20 and the last 20 records.
        let tail = v.split_off(v.len() - 20);
        v.truncate(20);
        v.extend(tail);
    }
    v.extend([
        1,
        len / 2,
        len.saturating_sub(1),
        len.saturating_sub(record / 2),
    ]);
    v.sort_unstable();
    v.dedup();
    v.retain(|&o| o < len);
    v
}

async fn truncation<T: FaultTarget>(t: &T) {
    let pristine = scratch(t);
    let keys = populated(t, pristine.path(), 2).await;
    let files = owned_files(pristine.path());
    let work = scratch(t);
    for (file, len) in &sample(&files, 2) {
        for cut in cut_points(*len, t.record_bytes()) {
            let dir = work.path().join("d");
            let _ = fs::remove_dir_all(&dir);
            copy_tree(pristine.path(), &dir).expect("copy of the directory");
            let f = fs::OpenOptions::new()
                .write(true)
                .open(dir.join(file))
                .expect("open to truncate");
            f.set_len(cut).expect("truncate");
            drop(f);
            let what = format!("{} cut at {cut} of {len} bytes", file.display());
            if let Some(s) = open_after(t, &dir, file, &what).await {
                // A cut at a record boundary is indistinguishable from a shorter file, so
                // losses need not be counted here; wrong pages are never allowed.
                let r = read_back(&*s, &keys, t.page_bytes()).await;
                assert_eq!(r.wrong, 0, "{what}: pages read back WRONG ({r:?})");
                assert_writable(&*s, t.page_bytes(), 200, &what).await;
            }
        }
    }
}

/// Foreign names dropped into the backend's directories.
const GARBAGE_NAMES: [&str; 4] = ["notes.txt", "GARBAGE", ".hidden", "backup.old"];

async fn garbage_files<T: FaultTarget>(t: &T) {
    let d = scratch(t);
    let keys = populated(t, d.path(), 3).await;
    let mut dirs = vec![d.path().to_path_buf()];
    for file in owned_files(d.path()).keys() {
        if let Some(parent) = file.parent().filter(|p| !p.as_os_str().is_empty()) {
            dirs.push(d.path().join(parent));
        }
    }
    dirs.sort();
    dirs.dedup();
    let mut planted = Vec::new();
    let mut rng = ChaCha8Rng::seed_from_u64(0x6a6b);
    for dir in &dirs {
        for name in GARBAGE_NAMES {
            let p = dir.join(name);
            let mut bytes = vec![0u8; rng.random_range(0..9000)];
            rng.fill(&mut bytes[..]);
            fs::write(&p, &bytes).expect("plant a garbage file");
            planted.push((p, bytes));
        }
        let sub = dir.join("foreign-subdir");
        fs::create_dir_all(&sub).expect("plant a foreign directory");
        let p = sub.join("data");
        fs::write(&p, b"not yours").expect("plant a file in a foreign directory");
        planted.push((p, b"not yours".to_vec()));
    }
    let what = "garbage files in the backend's directories";
    let s = open(t, d.path()).await;
    assert_invariant(&*s, &keys, t.page_bytes(), 0, what).await;
    assert_writable(&*s, t.page_bytes(), 300, what).await;
    drop(s);
    let s = open(t, d.path()).await;
    drop(s);
    for (p, bytes) in &planted {
        let now = fs::read(p).unwrap_or_else(|e| {
            panic!(
                "{what}: the backend deleted a file it does not own: {} ({e})",
                p.display()
            )
        });
        assert!(
            now == *bytes,
            "{what}: the backend changed a file it does not own: {}",
            p.display()
        );
    }
}

async fn foreign_directory<T: FaultTarget>(t: &T) {
    let d = scratch(t);
    // A directory someone else uses, with names a backend might also use.
    let foreign = d.path().join("foreign");
    let mut planted = Vec::new();
    for rel in ["precious.txt", "tmp/work.txt", "pages/x.page", "tmp/sub/y"] {
        let p = foreign.join(rel);
        fs::create_dir_all(p.parent().expect("a parent")).expect("create a foreign directory");
        fs::write(&p, rel).expect("a foreign file");
        planted.push(p);
    }
    // A directory whose `tmp` is a symlink to somewhere else.
    let elsewhere = d.path().join("elsewhere");
    fs::create_dir_all(&elsewhere).expect("create the symlink target");
    let victim = elsewhere.join("keep-me");
    fs::write(&victim, b"keep").expect("a file behind the symlink");
    planted.push(victim);
    let linked = d.path().join("linked");
    fs::create_dir_all(&linked).expect("create the linked directory");
    symlink(&elsewhere, linked.join("tmp")).expect("a symlink");
    for dir in [&foreign, &linked] {
        match t.open(dir, CAPACITY).await {
            Ok(_) => panic!(
                "{}: a non-empty directory the backend never marked was accepted",
                dir.display()
            ),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(&dir.display().to_string()),
                    "the refusal does not name the directory {}: {msg}",
                    dir.display()
                );
            }
        }
    }
    for p in &planted {
        assert!(
            p.is_file(),
            "opening a foreign directory deleted {}",
            p.display()
        );
    }
    assert!(
        fs::symlink_metadata(linked.join("tmp")).is_ok_and(|m| m.file_type().is_symlink()),
        "opening a foreign directory removed its symlink"
    );
}

async fn second_opener<T: FaultTarget>(t: &T) {
    let d = scratch(t);
    let keys = populated(t, d.path(), 4).await;
    let first = open(t, d.path()).await;
    match t.open(d.path(), CAPACITY).await {
        Ok(_) => panic!("a second opener of {} was accepted", d.path().display()),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains(&d.path().display().to_string()),
                "the refusal of a second opener does not name the directory: {msg}"
            );
        }
    }
    let what = "after a refused second opener";
    assert_invariant(&*first, &keys, t.page_bytes(), 0, what).await;
    assert_writable(&*first, t.page_bytes(), 400, what).await;
    drop(first);
    let again = open(t, d.path()).await;
    assert_invariant(
        &*again,
        &keys,
        t.page_bytes(),
        0,
        "reopened after the first closed",
    )
    .await;
}

/// A small file system mounted for one test (a loop-mounted ext4 image, else a `size=`-limited
/// tmpfs; both need root), unmounted (lazily) on drop. Backend tests use it for their own
/// disk-full cases.
pub struct SmallFs {
    mount: PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallFs {
    /// Mounts a `bytes`-sized file system under `root`; `Err` says why it could not.
    pub fn mount(root: &Path, bytes: u64) -> std::result::Result<Self, String> {
        let dir = tempfile::tempdir_in(root).map_err(|e| format!("scratch: {e}"))?;
        let mount = dir.path().join("mnt");
        fs::create_dir_all(&mount).map_err(|e| format!("mount point: {e}"))?;
        let image = dir.path().join("fs.img");
        let run = |cmd: &mut Command| -> std::result::Result<(), String> {
            match cmd.output() {
                Ok(o) if o.status.success() => Ok(()),
                Ok(o) => Err(format!(
                    "{cmd:?}: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                )),
                Err(e) => Err(format!("{cmd:?}: {e}")),
            }
        };
        let ext4 = fs::File::create(&image)
            .and_then(|f| f.set_len(bytes))
            .map_err(|e| format!("image: {e}"))
            .and_then(|()| run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image)))
            .and_then(|()| {
                run(Command::new("mount")
                    .args(["-o", "loop"])
                    .arg(&image)
                    .arg(&mount))
            });
        let _ = fs::remove_file(&image).map_err(|_| ());
        match ext4 {
            Ok(()) => Ok(Self { mount, _dir: dir }),
            Err(e4) => {
                let size = format!("size={bytes}");
                run(Command::new("mount")
                    .args(["-t", "tmpfs", "-o", &size, "tmpfs"])
                    .arg(&mount))
                .map(|()| Self { mount, _dir: dir })
                .map_err(|et| format!("no ext4 loop mount ({e4}) and no tmpfs ({et})"))
            }
        }
    }
}

impl SmallFs {
    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.mount
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mount).output();
    }
}

/// Size of the small file system of [`Fault::DiskFull`].
const SMALL_FS_BYTES: u64 = 48 << 20;

async fn disk_full<T: FaultTarget>(t: &T) {
    let root = scratch(t);
    let small = match SmallFs::mount(root.path(), SMALL_FS_BYTES) {
        Ok(m) => m,
        Err(why) => {
            println!("fault suite: disk_full SKIPPED: cannot mount a small file system: {why}");
            let _ = io::stdout().flush();
            return;
        }
    };
    let dir = small.mount.join("store");
    let pb = t.page_bytes();
    // A capacity far above the file system's size, so the disk fills before eviction starts.
    let s = t
        .open(&dir, 64 * SMALL_FS_BYTES)
        .await
        .unwrap_or_else(|e| panic!("open on a small file system: {e}"));
    let total = 4 * SMALL_FS_BYTES / pb as u64;
    let keys: Vec<PageKey> = (0..total).map(|i| key(5, i)).collect();
    let acked = write_pages(&*s, &keys, pb).await;
    let what = "disk full";
    assert!(
        acked.len() as u64 * pb as u64 >= SMALL_FS_BYTES / 4,
        "{what}: only {} pages of {pb} bytes stored on an empty {SMALL_FS_BYTES}-byte file \
         system",
        acked.len()
    );
    // A full disk either fails writes or, for a cache that lowers its capacity to what fits,
    // evicts older pages: both are fine, as long as every loss is an eviction it counted.
    let evicted = s.stats().evicted_pages;
    assert!(
        (acked.len() as u64) < total || evicted > 0,
        "{what}: {} pages of {pb} bytes acknowledged on a {SMALL_FS_BYTES}-byte file system \
         with nothing evicted",
        acked.len()
    );
    let before = read_back(&*s, &acked, pb).await;
    assert_eq!(
        before.wrong, 0,
        "{what}: pages read back WRONG ({before:?})"
    );
    assert!(
        before.lost <= evicted,
        "{what}: {} acknowledged pages lost, {evicted} evicted ({before:?})",
        before.lost
    );
    drop(s);
    let s = t_open_again(t, &dir).await;
    let r = read_back(&*s, &acked, pb).await;
    assert_eq!(
        r.wrong, 0,
        "{what}, reopened: pages read back WRONG ({r:?})"
    );
    assert_eq!(
        r.intact, before.intact,
        "{what}, reopened: pages served before the restart are gone ({before:?} then {r:?})"
    );
    let present: Vec<PageKey> = {
        let mut v = Vec::new();
        for k in &acked {
            if read_back(&*s, std::slice::from_ref(k), pb).await.intact == 1 {
                v.push(*k);
            }
        }
        v
    };
    let half = present.len() / 2;
    s.delete(&present[..half])
        .await
        .expect("delete on a full file system");
    assert_writable(&*s, pb, 500, "disk full, after deleting half").await;
    assert_invariant(
        &*s,
        &present[half..],
        pb,
        0,
        "disk full, after deleting half",
    )
    .await;
    drop(s);
}

async fn t_open_again<T: FaultTarget>(t: &T, dir: &Path) -> Arc<dyn Storage> {
    t.open(dir, 64 * SMALL_FS_BYTES)
        .await
        .unwrap_or_else(|e| panic!("disk full: reopen of a full file system failed: {e}"))
}

#[cfg(test)]
mod tests {
    use super::cut_points;

    #[test]
    fn cut_points_cover_boundaries_and_odd_offsets() {
        let v = cut_points(128 * 5, 128);
        assert_eq!(
            v,
            vec![0, 1, 64 * 5, 128, 256, 384, 512, 576, 639]
                .into_iter()
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
        );
        let big = cut_points(4096 * 1000, 4096);
        assert!(big.len() <= 44 && big.contains(&0) && big.contains(&(4096 * 999)));
    }
}
