//! Stores written by the code before the local backends became one crate (the separate
//! `hicache-backend-file` and `hicache-backend-uring` crates at commit 78f82f5) open and serve
//! their pages: `tests/fixtures/pages` (registry name `file`) and `tests/fixtures/slab`
//! (`uring`) each hold three 4096-byte pages, `pattern::page_key(namespace(1), 7, i)` for
//! i in 0..3 with `pattern::page_bytes` contents, written with a 1 MiB capacity (the slab
//! store with `grow_bytes` 16384). Each test opens a copy, so the checked-in files never
//! change.

use std::path::Path;

use hicache_backend_local::{FileBackend, FileOptions, UringBackend, UringOptions};
use hicache_storage::pattern::{namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, Storage, StorageExt};

const PAGE: usize = 4096;
const PAGES: u64 = 3;

/// Copies the tree `from` into `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), &dest).unwrap();
        }
    }
}

/// A fresh copy of the fixture `name`.
fn fixture(name: &str) -> tempfile::TempDir {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    copy_tree(&src, dir.path());
    dir
}

/// Every fixture page is present and reads back with the bytes it was written with; a page
/// never written is a miss.
async fn serves_the_fixture(s: &dyn Storage) {
    let keys: Vec<_> = (0..PAGES).map(|i| page_key(namespace(1), 7, i)).collect();
    assert_eq!(s.batch_exists(&keys).await.unwrap(), PAGES as usize);
    for k in &keys {
        let got = s.get(LayoutKind::PageFirst, PAGE, *k).await.unwrap();
        assert_eq!(got.as_deref(), Some(&page_bytes(k, PAGE)[..]), "{k}");
    }
    let absent = page_key(namespace(1), 7, PAGES);
    assert_eq!(
        s.get(LayoutKind::PageFirst, PAGE, absent).await.unwrap(),
        None
    );
    assert_eq!(s.stats().pages, PAGES);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_file_store_written_before_the_merge_opens_and_serves() {
    let dir = fixture("pages");
    let mut o = FileOptions::new(dir.path());
    o.capacity_bytes = Some(1 << 20);
    let s = FileBackend::open(o).unwrap();
    assert_eq!(s.open_report().pages, PAGES);
    assert_eq!(s.open_report().discarded_pages, 0);
    serves_the_fixture(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slab_store_written_before_the_merge_opens_and_serves() {
    let dir = fixture("slab");
    let mut o = UringOptions::new(dir.path());
    o.capacity_bytes = Some(1 << 20);
    o.grow_bytes = 16384;
    let s = UringBackend::open(o).unwrap();
    assert_eq!(s.open_report().pages, PAGES);
    assert_eq!(s.open_report().discarded_pages, 0);
    serves_the_fixture(&s).await;
}
