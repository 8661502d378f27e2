//! Issue 13, items 1 and 6 on the file backend: it uses only a directory it marked as its own
//! (or an empty one it marks), never follows a symlink out of it, names the holder of a
//! directory in use, and refuses a capacity that cannot hold one page. Each test failed
//! before the fix it covers.

#[path = "pages_common/mod.rs"]
mod common;

use std::fs;
use std::os::unix::fs::symlink;

use common::test_dir;
use hicache_backend_local::pages::format::MARKER;
use hicache_backend_local::pages::{FileBackend, FileOptions};
use hicache_storage::{BackendContext, Registry, StorageConfig};

fn opts(dir: &std::path::Path) -> FileOptions {
    let mut o = FileOptions::new(dir);
    o.capacity_bytes = Some(64 << 20);
    o
}

#[test]
fn a_non_empty_unmarked_directory_is_refused_untouched() {
    let d = test_dir();
    // What `{"dir": "/var"}` looked like to the backend: a tmp/ and other files.
    fs::create_dir_all(d.path().join("tmp/cache")).unwrap();
    fs::write(d.path().join("tmp/cache/file"), b"mine").unwrap();
    fs::create_dir_all(d.path().join("pages")).unwrap();
    fs::write(d.path().join("pages/notes"), b"mine too").unwrap();
    let e = FileBackend::open(opts(d.path())).unwrap_err().to_string();
    assert!(e.contains(&d.path().display().to_string()), "{e}");
    assert!(e.contains("not empty") && e.contains(MARKER), "{e}");
    assert_eq!(fs::read(d.path().join("tmp/cache/file")).unwrap(), b"mine");
    assert_eq!(fs::read(d.path().join("pages/notes")).unwrap(), b"mine too");
    assert!(
        !d.path().join(MARKER).exists(),
        "a refused directory was marked"
    );
}

#[test]
fn an_empty_directory_is_marked_and_reopened() {
    let d = test_dir();
    drop(FileBackend::open(opts(d.path())).unwrap());
    assert!(d.path().join(MARKER).is_file());
    drop(FileBackend::open(opts(d.path())).unwrap());
}

#[test]
fn a_symlinked_tmp_in_a_marked_directory_is_refused_not_followed() {
    let d = test_dir();
    let store = d.path().join("store");
    drop(FileBackend::open(opts(&store)).unwrap());
    let elsewhere = d.path().join("elsewhere");
    fs::create_dir_all(elsewhere.join("999-abc")).unwrap();
    fs::write(elsewhere.join("999-abc.lock"), b"").unwrap();
    fs::write(elsewhere.join("999-abc/x"), b"keep").unwrap();
    fs::remove_dir_all(store.join("tmp")).unwrap();
    symlink(&elsewhere, store.join("tmp")).unwrap();
    let e = FileBackend::open(opts(&store)).unwrap_err().to_string();
    assert!(e.contains("symlink") && e.contains("tmp"), "{e}");
    assert_eq!(fs::read(elsewhere.join("999-abc/x")).unwrap(), b"keep");
    assert!(elsewhere.join("999-abc.lock").exists());
}

#[test]
fn the_in_use_error_names_the_holder() {
    let d = test_dir();
    let first = FileBackend::open(opts(d.path())).unwrap();
    let e = FileBackend::open(opts(d.path())).unwrap_err().to_string();
    assert!(
        e.contains(&format!("pid {}", std::process::id())),
        "the holder is not named: {e}"
    );
    drop(first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capacity_below_one_page_is_refused_and_evicts_nothing() {
    let d = test_dir();
    let page = 64 << 10;
    {
        use hicache_storage::{LayoutKind, StorageExt, pattern};
        let s = FileBackend::open(opts(d.path())).unwrap();
        let k = pattern::page_key(pattern::namespace(1), 1, 0);
        s.put(LayoutKind::PageFirst, k, &pattern::page_bytes(&k, page))
            .await
            .unwrap();
    }
    let mut o = opts(d.path());
    o.capacity_bytes = Some(100);
    let e = FileBackend::open(o).unwrap_err().to_string();
    assert!(e.contains("capacity") && e.contains("100"), "{e}");
    // Through the registry the deployment's page size is known: one page must fit.
    let r = Registry::new();
    hicache_backend_local::FileFactory::register(&r).unwrap();
    let cfg = StorageConfig::parse(
        Some("file"),
        Some(&format!(
            r#"{{"dir": "{}", "capacity": 8192}}"#,
            d.path().display()
        )),
    )
    .unwrap();
    let ctx = BackendContext {
        page_bytes: page,
        ..BackendContext::default()
    };
    let e = match r.open(&cfg, &ctx).await {
        Ok(_) => panic!("a capacity below one page was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("capacity") && e.contains("cannot hold one page"),
        "{e}"
    );
    let s = FileBackend::open(opts(d.path())).unwrap();
    assert_eq!(s.open_report().pages, 1, "the refused opens evicted pages");
}

/// A read-only open (what `storage-check` uses) of a store with a torn page file, a dead
/// instance's temp files and an exclusive-mode lock file changes nothing on disk, counts what
/// a read-write open would discard, serves the intact pages and refuses writes; a missing
/// directory is refused, not created; an exclusive owner refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_open_changes_nothing_and_refuses_writes() {
    use hicache_core::LayoutKind;
    use hicache_storage::pattern::{check_page, namespace, page_bytes, page_key};
    use hicache_storage::{PageBuf, PageBufMut, PageKey, PageOutcome, Storage};
    let d = test_dir();
    let len = 4096;
    let keys: Vec<PageKey> = (0..4).map(|i| page_key(namespace(1), 3, i)).collect();
    let src: Vec<Vec<u8>> = keys.iter().map(|k| page_bytes(k, len)).collect();
    let bufs: Vec<PageBuf<'_>> = src
        .iter()
        .map(|b| PageBuf::contiguous(LayoutKind::PageFirst, b))
        .collect();
    let s = FileBackend::open(opts(d.path())).unwrap();
    s.batch_set(&keys, &bufs).await.unwrap();
    let torn = s.page_path(&keys[1]);
    drop(s);
    fs::OpenOptions::new()
        .write(true)
        .open(&torn)
        .unwrap()
        .set_len(10)
        .unwrap();
    // A dead instance's scratch directory with two temp files.
    fs::create_dir_all(d.path().join("tmp/77-abc")).unwrap();
    fs::write(d.path().join("tmp/77-abc/a"), b"x").unwrap();
    fs::write(d.path().join("tmp/77-abc/b"), b"y").unwrap();
    let listing = |p: &std::path::Path| {
        let mut v: Vec<(String, u64, std::time::SystemTime)> = walk(p);
        v.sort();
        v
    };
    fn walk(p: &std::path::Path) -> Vec<(String, u64, std::time::SystemTime)> {
        let mut v = Vec::new();
        for e in fs::read_dir(p).unwrap().flatten() {
            let m = fs::symlink_metadata(e.path()).unwrap();
            v.push((
                e.path().display().to_string(),
                m.len(),
                m.modified().unwrap(),
            ));
            if m.is_dir() {
                v.extend(walk(&e.path()));
            }
        }
        v
    }
    let before = (
        listing(d.path()),
        fs::read(d.path().join("dir.lock")).unwrap(),
    );
    let mut ro = opts(d.path());
    ro.read_only = true;
    let s = FileBackend::open(ro.clone()).unwrap();
    assert!(s.is_read_only());
    let r = s.open_report();
    assert_eq!(
        (r.pages, r.discarded_pages, r.discarded_temp),
        (3, 1, 2),
        "{r:?}"
    );
    let mut back = vec![0u8; keys.len() * len];
    let mut dst: Vec<PageBufMut<'_>> = back
        .chunks_mut(len)
        .map(|c| PageBufMut::contiguous(LayoutKind::PageFirst, c))
        .collect();
    let out = s.batch_get(&keys, &mut dst).await.unwrap();
    drop(dst);
    assert_eq!(out[1], PageOutcome::Miss);
    for i in [0, 2, 3] {
        assert_eq!(out[i], PageOutcome::Hit);
        assert!(check_page(&keys[i], &back[i * len..(i + 1) * len]));
    }
    let e = s.batch_set(&keys[..1], &bufs[..1]).await.unwrap_err();
    assert!(e.to_string().contains("read-only"), "{e}");
    let e = s.delete(&keys[..1]).await.unwrap_err();
    assert!(e.to_string().contains("read-only"), "{e}");
    // A second read-only opener shares the lock.
    drop(FileBackend::open(ro.clone()).unwrap());
    drop(s);
    let after = (
        listing(d.path()),
        fs::read(d.path().join("dir.lock")).unwrap(),
    );
    assert_eq!(before, after);
    // An exclusive owner refuses a read-only open.
    let w = FileBackend::open(opts(d.path())).unwrap();
    let e = FileBackend::open(ro).unwrap_err().to_string();
    assert!(e.contains("in use"), "{e}");
    drop(w);
    // A missing directory is refused, and stays missing.
    let mut missing = opts(&d.path().join("none"));
    missing.read_only = true;
    let e = FileBackend::open(missing).unwrap_err().to_string();
    assert!(e.contains("none") && e.contains("not a directory"), "{e}");
    assert!(!d.path().join("none").exists());
}
