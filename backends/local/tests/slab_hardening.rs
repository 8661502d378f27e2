//! Issue 13, items 3, 5 and 6 on the uring backend. Each test failed before its fix.

#[path = "slab_common/mod.rs"]
mod common;

use std::fs;

use common::{test_dir, test_opts};
use hicache_backend_local::slab::format::{DAMAGED_PREFIX, INDEX_FILE, LOCK_FILE, RECORD_LEN};
use hicache_backend_local::slab::{UringBackend, UringOptions};
use hicache_storage::faults::SmallFs;
use hicache_storage::pattern::{check_page, namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, PageKey, PageOutcome, Storage, StorageExt};

const L: LayoutKind = LayoutKind::PageFirst;
const LEN: usize = 16 << 10;

/// One test at a time: `SmallFs` spawns `mkfs` and `mount`, and a child between its fork and
/// its exec holds a copy of every open descriptor of this process, the directory lock's
/// included, so a sibling test that closes a backend and reopens its directory at that moment
/// would find its own just-released lock still held ("in use by another process").
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn keys(seed: u64, n: u64) -> Vec<PageKey> {
    (0..n).map(|i| page_key(namespace(13), seed, i)).collect()
}

async fn put_each(s: &UringBackend, ks: &[PageKey]) -> usize {
    let mut stored = 0;
    for chunk in ks.chunks(64) {
        let pages: Vec<(PageKey, bytes::Bytes)> = chunk
            .iter()
            .map(|k| (*k, bytes::Bytes::from(page_bytes(k, LEN))))
            .collect();
        if let Ok(outcomes) = s.put_pages(L, &pages).await {
            stored += outcomes
                .iter()
                .filter(|o| **o == PageOutcome::Stored)
                .count();
        }
    }
    stored
}

async fn intact(s: &UringBackend, ks: &[PageKey]) -> Vec<bool> {
    s.get_pages(L, LEN, ks)
        .await
        .unwrap()
        .iter()
        .zip(ks)
        .map(|(g, k)| g.as_ref().is_some_and(|b| check_page(k, b)))
        .collect()
}

/// A 96 MiB file system mounted under `root`; `None`, after a SKIPPED line, where this machine
/// cannot mount one.
fn small_fs(root: &std::path::Path) -> Option<SmallFs> {
    SmallFs::mount(root, 96 << 20)
        .map_err(|why| println!("SKIPPED: cannot mount a small file system: {why}"))
        .ok()
}

/// A uring store in `dir` with a capacity of 10 GiB (far above a small file system) and the
/// default growth step; `None`, after a SKIPPED line, where the file system refuses O_DIRECT.
fn open_far_above(dir: &std::path::Path) -> Option<UringBackend> {
    let mut o = UringOptions::new(dir);
    o.capacity_bytes = Some(10 << 30);
    match UringBackend::open(o) {
        Ok(s) => Some(s),
        Err(e) if e.to_string().contains("O_DIRECT") => {
            println!("SKIPPED: the small file system refuses O_DIRECT: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// Item 3: a damaged record inside the log costs its own page only; every later record is
/// kept, the damaged bytes are preserved before the log is rewritten, and the open reports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_log_record_costs_only_its_own_page() {
    let _serial = SERIAL.lock().await;
    let dir = test_dir();
    let ks = keys(1, 10);
    {
        let s = UringBackend::open(test_opts(dir.path())).unwrap();
        assert_eq!(put_each(&s, &ks).await, 10);
    }
    let log = dir.path().join(INDEX_FILE);
    let mut b = fs::read(&log).unwrap();
    // Record 0 is the header; the put of page 2 is record 3.
    let at = 3 * RECORD_LEN + 50;
    b[at] ^= 0x10;
    fs::write(&log, &b).unwrap();
    let s = UringBackend::open(test_opts(dir.path())).unwrap();
    let r = s.open_report().clone();
    assert_eq!(r.skipped_records, 1, "{r:?}");
    assert_eq!(s.stats().discarded_on_open, 1);
    let mut want = vec![true; 10];
    want[2] = false;
    assert_eq!(intact(&s, &ks).await, want, "every later page is kept");
    let kept = fs::read(r.preserved.as_ref().expect("the damaged bytes preserved")).unwrap();
    assert_eq!(
        kept[..],
        b[3 * RECORD_LEN..],
        "the damaged region was preserved"
    );
    assert!(
        r.preserved
            .unwrap()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(DAMAGED_PREFIX)
    );
    drop(s);
    let s = UringBackend::open(test_opts(dir.path())).unwrap();
    assert_eq!(s.open_report().skipped_records, 0);
    assert_eq!(s.stats().pages, 9);
}

/// Item 6: a directory that is not the backend's (a foreign `index.log`, or files without one)
/// is refused before anything in it is written: the foreign `lock` file keeps its bytes.
#[test]
fn a_foreign_directory_is_refused_and_its_lock_file_untouched() {
    let _serial = SERIAL.blocking_lock();
    let dir = test_dir();
    fs::write(dir.path().join(LOCK_FILE), b"someone else's lock\n").unwrap();
    fs::write(dir.path().join(INDEX_FILE), vec![b'x'; 4096]).unwrap();
    let e = UringBackend::open(test_opts(dir.path()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a hicache-uring index log"), "{e}");
    assert_eq!(
        fs::read(dir.path().join(LOCK_FILE)).unwrap(),
        b"someone else's lock\n"
    );
    let other = test_dir();
    fs::write(other.path().join("data.bin"), b"mine").unwrap();
    let e = UringBackend::open(test_opts(other.path()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&other.path().display().to_string()) && e.contains("not empty"),
        "{e}"
    );
    assert!(!other.path().join(LOCK_FILE).exists());
}

/// Item 6: a capacity below one page is refused before anything is evicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capacity_below_one_page_is_refused() {
    let _serial = SERIAL.lock().await;
    let dir = test_dir();
    let ks = keys(2, 3);
    {
        let s = UringBackend::open(test_opts(dir.path())).unwrap();
        assert_eq!(put_each(&s, &ks).await, 3);
    }
    let mut o = test_opts(dir.path());
    o.capacity_bytes = Some(100);
    let e = UringBackend::open(o).unwrap_err().to_string();
    assert!(e.contains("capacity") && e.contains("100"), "{e}");
    let mut o = test_opts(dir.path());
    o.capacity_bytes = Some(LEN as u64 - 1);
    o.page_bytes = Some(LEN as u64);
    assert!(UringBackend::open(o).is_err());
    let s = UringBackend::open(test_opts(dir.path())).unwrap();
    assert_eq!(intact(&s, &ks).await, vec![true; 3], "nothing was evicted");
}

/// Item 5: with a capacity above the free space (and the default 256 MiB growth step, more
/// than the file system holds) the backend still writes, never leaves the file system full
/// with a partial slab, and keeps working by evicting once the disk is full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capacity_above_the_free_space_still_writes() {
    let _serial = SERIAL.lock().await;
    let root = test_dir();
    let Some(small) = small_fs(root.path()) else {
        return;
    };
    let dir = small.path().join("store");
    let Some(s) = open_far_above(&dir) else {
        return;
    };
    let first = keys(3, 8);
    assert_eq!(put_each(&s, &first).await, 8, "nothing could be written");
    assert_eq!(intact(&s, &first).await, vec![true; 8]);
    // Fill it past its end: every write still succeeds (older pages evicted, counted).
    let many = keys(4, (160 << 20) / LEN as u64);
    let stored = put_each(&s, &many).await;
    assert_eq!(stored, many.len(), "writes failed on a full file system");
    assert!(s.stats().evicted_pages > 0);
    let tail = &many[many.len() - 8..];
    assert_eq!(intact(&s, tail).await, vec![true; 8]);
    drop(s);
    let s = UringBackend::open({
        let mut o = UringOptions::new(&dir);
        o.capacity_bytes = Some(10 << 30);
        o
    })
    .unwrap();
    assert_eq!(intact(&s, tail).await, vec![true; 8]);
}

/// Item "read-only tools": a read-only open of a store with a damaged log record changes no
/// byte, length or name in the directory, reports what a read-write open would discard,
/// serves every other page, refuses writes, and is refused while an owner holds the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_open_changes_nothing_and_refuses_writes() {
    let _serial = SERIAL.lock().await;
    let dir = test_dir();
    let ks = keys(7, 10);
    {
        let s = UringBackend::open(test_opts(dir.path())).unwrap();
        assert_eq!(put_each(&s, &ks).await, 10);
    }
    let log = dir.path().join(INDEX_FILE);
    let mut b = fs::read(&log).unwrap();
    b[3 * RECORD_LEN + 50] ^= 0x10;
    fs::write(&log, &b).unwrap();
    let listing = || {
        let mut v: Vec<(String, u64, Vec<u8>)> = fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| {
                let m = e.metadata().unwrap();
                let small = m.len() < (1 << 20);
                let content = if small {
                    fs::read(e.path()).unwrap()
                } else {
                    Vec::new()
                };
                (
                    e.file_name().to_string_lossy().into_owned(),
                    m.len(),
                    content,
                )
            })
            .collect();
        v.sort();
        v
    };
    let before = listing();
    let mut ro = test_opts(dir.path());
    ro.read_only = true;
    let s = UringBackend::open(ro.clone()).unwrap();
    let r = s.open_report().clone();
    assert_eq!(r.skipped_records, 1, "{r:?}");
    assert!(r.preserved.is_none() && !r.compacted, "{r:?}");
    assert_eq!(s.stats().discarded_on_open, 1);
    let mut want = vec![true; 10];
    want[2] = false;
    assert_eq!(intact(&s, &ks).await, want);
    let pages = vec![(ks[0], bytes::Bytes::from(page_bytes(&ks[0], LEN)))];
    let e = s.put_pages(L, &pages).await.unwrap_err().to_string();
    assert!(e.contains("read-only"), "{e}");
    let e = s.delete(&ks[..1]).await.unwrap_err().to_string();
    assert!(e.contains("read-only"), "{e}");
    drop(s);
    assert_eq!(listing(), before, "a read-only open changed the directory");
    let w = UringBackend::open(test_opts(dir.path())).unwrap();
    let e = UringBackend::open(ro).unwrap_err().to_string();
    assert!(e.contains("in use"), "{e}");
    drop(w);
}

/// Issue 28, item 9: `grow_bytes` is bounded. `u64::MAX` (which preallocated a 44 GB slab and
/// made unrelated writers fail with "no space") is refused when the configuration is read, a
/// value above a quarter of the file system is refused at open, and on a small file system a
/// growth never takes more than half of what is free, however large the step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grow_bytes_is_bounded_by_the_file_system() {
    let _serial = SERIAL.lock().await;
    let cfg = hicache_storage::StorageConfig::parse(
        Some("uring"),
        Some(r#"{"dir": "/nonexistent", "grow_bytes": 18446744073709551615}"#),
    )
    .unwrap();
    let e = UringOptions::from_config(&cfg.common, cfg.backend_fields)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`grow_bytes`") && e.contains("at most"), "{e}");

    let dir = test_dir();
    let mut o = test_opts(dir.path());
    o.grow_bytes = hicache_backend_local::slab::options::MAX_GROW_BYTES;
    let e = match UringBackend::open(o) {
        Ok(_) => panic!("a 1 TiB step is refused here"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("`grow_bytes`") && e.contains("quarter"), "{e}");

    let root = test_dir();
    let Some(small) = small_fs(root.path()) else {
        return;
    };
    let free = || {
        let d = fs::File::open(small.path()).unwrap();
        hicache_backend_local::io::sys::fs_space(&d).unwrap().0
    };
    let before = free();
    // The default step (256 MiB) is larger than this whole file system.
    let Some(s) = open_far_above(&small.path().join("store")) else {
        return;
    };
    let ks = keys(28, 1);
    assert_eq!(put_each(&s, &ks).await, 1);
    let after = free();
    assert!(
        after >= before / 2 - (1 << 20),
        "one growth took {} of {} free bytes",
        before - after,
        before
    );
    assert_eq!(intact(&s, &ks).await, vec![true]);
}
