//! Restart, recovery, locking, O_DIRECT zero-copy and multi-process shared-directory tests.

#[path = "pages_common/mod.rs"]
mod common;

use std::fs;
use std::process::Command;
use std::sync::Arc;

use common::test_dir;
use hicache_backend_local::pages::format::{HEADER_LEN, file_bytes};
use hicache_backend_local::pages::{FileBackend, FileOptions, FsyncPolicy};
use hicache_core::LayoutKind;
use hicache_storage::pattern::{check_page, namespace, page_bytes, page_key};
use hicache_storage::{PageKey, Storage, StorageExt};
use memmap2::MmapMut;

const L: LayoutKind = LayoutKind::PageFirst;

fn opts(dir: &std::path::Path) -> FileOptions {
    let mut o = FileOptions::new(dir);
    o.capacity_bytes = Some(256 << 20);
    o.io_threads = 4;
    o
}

fn keys(seed: u64, n: u64) -> Vec<PageKey> {
    (0..n).map(|i| page_key(namespace(1), seed, i)).collect()
}

async fn put_all(s: &FileBackend, ks: &[PageKey], len: usize) {
    let pages: Vec<(PageKey, bytes::Bytes)> = ks
        .iter()
        .map(|k| (*k, bytes::Bytes::from(page_bytes(k, len))))
        .collect();
    for o in s.put_pages(L, &pages).await.unwrap() {
        assert!(o.is_ok(), "{o:?}");
    }
}

async fn all_hit(s: &FileBackend, ks: &[PageKey], len: usize) -> bool {
    let got = s.get_pages(L, len, ks).await.unwrap();
    got.iter()
        .zip(ks)
        .all(|(g, k)| g.as_ref().is_some_and(|b| check_page(k, b)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o_direct_zero_copy_from_aligned_buffers() {
    let dir = test_dir();
    let s = FileBackend::open(opts(dir.path())).unwrap();
    assert!(
        s.direct_io(),
        "the work tree's file system takes O_DIRECT; tmpfs-only checks would miss alignment bugs"
    );
    assert!(s.info().zero_copy);
    // Pages in an aligned region, as in the pinned host pool; one of them layer_first in
    // 64 aligned parts (read back in 2).
    let ks = keys(1, 4);
    let len = 1 << 20;
    let mut region = MmapMut::map_anon(4 * len).unwrap();
    let mut back = MmapMut::map_anon(4 * len).unwrap();
    hicache_backend_local::testing::round_trip_in(&s, &ks, &mut region, &mut back, len, 2).await;
    assert!(back[..] == region[..]);
    // Files are header + data, no padding for sector multiples.
    let m = fs::metadata(s.page_path(&ks[0])).unwrap();
    assert_eq!(m.len(), (HEADER_LEN + len) as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_discards_torn_files_and_restores_accounting() {
    let dir = test_dir();
    let ks = keys(2, 10);
    let before = {
        let s = FileBackend::open(opts(dir.path())).unwrap();
        put_all(&s, &ks, 10_000).await;
        s.stats()
    };
    // Leftovers of a crash: a temp file of a dead instance, a truncated page, a page with a
    // damaged header; and files the backend never writes (a stray temp file, a file whose
    // name is no key), which it must leave alone.
    let probe = FileBackend::open(opts(dir.path())).unwrap();
    let p_trunc = probe.page_path(&ks[3]);
    let p_head = probe.page_path(&ks[4]);
    drop(probe);
    let tmp = dir.path().join("tmp");
    fs::create_dir_all(tmp.join("999999-dead")).unwrap();
    fs::write(tmp.join("999999-dead/0.tmp"), vec![1u8; 5000]).unwrap();
    fs::write(tmp.join("999999-dead.lock"), b"").unwrap();
    fs::write(tmp.join("stray.tmp"), b"x").unwrap();
    let bucket = p_trunc.parent().unwrap().to_path_buf();
    fs::write(
        bucket.join(format!("{}.999999-dead.0.tmp", ks[3].to_hex())),
        vec![2u8; 9000],
    )
    .unwrap();
    let f = fs::OpenOptions::new().write(true).open(&p_trunc).unwrap();
    f.set_len(HEADER_LEN as u64 + 100).unwrap();
    drop(f);
    let mut b = fs::read(&p_head).unwrap();
    b[20] ^= 1;
    fs::write(&p_head, &b).unwrap();
    fs::write(p_head.parent().unwrap().join("garbage.page"), b"zz").unwrap();

    let s = FileBackend::open(opts(dir.path())).unwrap();
    let r = s.open_report().clone();
    assert_eq!(r.pages, 8, "{r:?}");
    assert_eq!(r.discarded_pages, 2, "truncated, bad header: {r:?}");
    assert_eq!(
        r.discarded_temp, 2,
        "dead instance's temp files (tmp/ and bucket): {r:?}"
    );
    let st = s.stats();
    assert_eq!(st.pages, before.pages - 2);
    assert_eq!(st.bytes, before.bytes - 20_000);
    assert_eq!(st.discarded_on_open, 4);
    assert!(
        fs::read_dir(&bucket).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_str()
            .unwrap()
            .ends_with(".tmp"))
    );
    assert!(!tmp.join("999999-dead").exists());
    // Not its names: untouched.
    assert_eq!(fs::read(tmp.join("stray.tmp")).unwrap(), b"x");
    assert_eq!(fs::read(bucket.join("garbage.page")).unwrap(), b"zz");
    // Every intact page is served, the damaged ones are misses.
    let good: Vec<PageKey> = ks
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, k)| *k)
        .collect();
    assert!(all_hit(&s, &good, 10_000).await);
    assert_eq!(
        s.get_pages(L, 10_000, &ks[3..5]).await.unwrap(),
        vec![None, None]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_smaller_capacity_evicts_at_open_oldest_first() {
    let dir = test_dir();
    let ks = keys(3, 8);
    {
        let s = FileBackend::open(opts(dir.path())).unwrap();
        put_all(&s, &ks, 50_000).await;
        // Distinct modification times order the pages for the rebuilt LRU.
        let t0 = std::time::SystemTime::now() - std::time::Duration::from_secs(100);
        for (i, k) in ks.iter().enumerate() {
            let f = fs::File::options()
                .write(true)
                .open(s.page_path(k))
                .unwrap();
            f.set_modified(t0 + std::time::Duration::from_secs(i as u64))
                .unwrap();
        }
    }
    let mut o = opts(dir.path());
    o.capacity_bytes = Some(3 * file_bytes(50_000));
    let s = FileBackend::open(o).unwrap();
    assert_eq!(s.open_report().evicted, 5);
    assert_eq!(s.stats().pages, 3);
    assert!(
        all_hit(&s, &ks[5..], 50_000).await,
        "the newest pages survive"
    );
    assert_eq!(s.batch_exists(&ks[..1]).await.unwrap(), 0);
}

#[test]
fn exclusive_mode_refuses_a_second_opener() {
    let dir = test_dir();
    let a = FileBackend::open(opts(dir.path())).unwrap();
    let e = FileBackend::open(opts(dir.path())).unwrap_err().to_string();
    assert!(e.contains("held by a store of this same process"), "{e}");
    let mut sh = opts(dir.path());
    sh.shared = true;
    assert!(
        FileBackend::open(sh.clone()).is_err(),
        "shared cannot join an exclusive owner"
    );
    drop(a);
    let b = FileBackend::open(sh.clone()).unwrap();
    let c = FileBackend::open(sh).unwrap();
    assert!(
        FileBackend::open(opts(dir.path())).is_err(),
        "exclusive cannot join sharers"
    );
    drop((b, c));
}

#[test]
fn a_foreign_directory_marker_is_refused() {
    let dir = test_dir();
    fs::write(
        dir.path().join("hicache-file.json"),
        "{\"format\": \"other\"}",
    )
    .unwrap();
    let e = FileBackend::open(opts(dir.path())).unwrap_err().to_string();
    assert!(e.contains("not a hicache-file v1 directory"), "{e}");
}

#[tokio::test(flavor = "current_thread")]
async fn works_on_a_current_thread_runtime_and_on_tmpfs_like_fallback() {
    let dir = test_dir();
    let mut o = opts(dir.path());
    o.direct_io = hicache_backend_local::pages::DirectIo::Off;
    o.fsync = FsyncPolicy::None;
    let s = FileBackend::open(o).unwrap();
    assert!(!s.direct_io());
    let ks = keys(4, 5);
    put_all(&s, &ks, 777).await;
    assert!(all_hit(&s, &ks, 777).await);
    // /dev/shm (tmpfs) accepts O_DIRECT opens on recent kernels; either way the backend works.
    if std::path::Path::new("/dev/shm").is_dir() {
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let s = FileBackend::open(opts(shm.path())).unwrap();
        put_all(&s, &ks, 777).await;
        assert!(all_hit(&s, &ks, 777).await);
    }
}

// ---------------------------------------------------------------------------------------------
// Several processes on one shared directory. The test binary re-executes itself as the
// children (`HICACHE_SHARED_CHILD` selects the role).

const CHILD_ENV: &str = "HICACHE_SHARED_CHILD";
const PAGES_PER_CHILD: u64 = 40;
const LEN: usize = 20_000;

fn shared_opts(dir: &std::path::Path, capacity: u64) -> FileOptions {
    let mut o = opts(dir);
    o.shared = true;
    o.capacity_bytes = Some(capacity);
    o.rescan_bytes = Some(file_bytes(LEN) * 8);
    o
}

/// Child role: writes its own pages and a common set every child also writes, then reads
/// every page of every child it can find; exits non-zero on any wrong byte.
#[test]
fn shared_child_role() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut it = spec.split(',');
    let dir = it.next().unwrap().to_string();
    let me: u64 = it.next().unwrap().parse().unwrap();
    let children: u64 = it.next().unwrap().parse().unwrap();
    let capacity: u64 = it.next().unwrap().parse().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    rt.block_on(async {
        let s = FileBackend::open(shared_opts(dir.as_ref(), capacity)).unwrap();
        let mine = keys(100 + me, PAGES_PER_CHILD);
        let common = keys(999, 16);
        for chunk in mine.chunks(8) {
            put_all(&s, chunk, LEN).await;
            put_all(&s, &common, LEN).await;
        }
        for c in 0..children {
            let theirs = keys(100 + c, PAGES_PER_CHILD);
            for g in s
                .get_pages(L, LEN, &theirs)
                .await
                .unwrap()
                .iter()
                .zip(&theirs)
            {
                if let (Some(b), k) = g {
                    assert!(
                        check_page(k, b),
                        "child {me}: wrong bytes in a page of child {c}"
                    );
                }
            }
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_processes_share_a_directory() {
    let dir = test_dir();
    let children = 4u64;
    // Room for about half of what the children write: the janitors must evict.
    let capacity = file_bytes(LEN) * (children * PAGES_PER_CHILD / 2 + 16);
    let exe = std::env::current_exe().unwrap();
    let procs: Vec<_> = (0..children)
        .map(|c| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "shared_child_role",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(
                    CHILD_ENV,
                    format!("{},{c},{children},{capacity}", dir.path().display()),
                )
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut p in procs {
        assert!(p.wait().unwrap().success(), "a shared-mode child failed");
    }
    // The janitors kept the directory within capacity plus at most one rescan interval per
    // process.
    let mut on_disk = 0u64;
    for f in fs::read_dir(dir.path().join("pages")).unwrap() {
        on_disk += f.unwrap().metadata().unwrap().len();
    }
    let slack = children * file_bytes(LEN) * 8;
    assert!(
        on_disk <= capacity + slack,
        "{on_disk} bytes on disk over {capacity} + {slack}"
    );
    assert!(on_disk > 0);
    // A later opener sees a consistent directory: every file valid, no temp files left.
    let s = Arc::new(FileBackend::open(shared_opts(dir.path(), capacity)).unwrap());
    assert_eq!(s.open_report().discarded_pages, 0, "no invalid page file");
    assert_eq!(
        s.open_report().discarded_temp,
        0,
        "children cleaned their temp dirs"
    );
    assert!(s.stats().pages > 0);
    let all: Vec<PageKey> = (0..children)
        .flat_map(|c| keys(100 + c, PAGES_PER_CHILD))
        .collect();
    for chunk in all.chunks(128) {
        for (g, k) in s.get_pages(L, LEN, chunk).await.unwrap().iter().zip(chunk) {
            if let Some(b) = g {
                assert!(check_page(k, b), "wrong bytes after sharing");
            }
        }
    }
}
