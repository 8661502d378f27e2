//! L3 lifecycle of the file backend: `clear` of one namespace (foreign files and other
//! namespaces untouched, durable across a restart), `ttl_s` expiry on an injected clock (no
//! sleeps), and watermark eviction on the background reclaim thread, held midway by its hook
//! while batches run (ordering, not timing).

#[path = "pages_common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use common::test_dir;
use hicache_backend_local::pages::format::file_bytes;
use hicache_backend_local::pages::{FileBackend, FileOptions, ReclaimHook};
use hicache_core::LayoutKind;
use hicache_storage::pattern::{check_page, namespace, page_bytes, page_key};
use hicache_storage::{
    Clock, PageBuf, PageBufMut, PageKey, PageOutcome, Storage, StorageError, Watermarks,
};

const LAYOUT: LayoutKind = LayoutKind::PageFirst;
/// Bounded waits: generous, and never what a test's verdict depends on.
const WAIT: Duration = Duration::from_secs(120);

async fn put(s: &FileBackend, keys: &[PageKey], len: usize) -> Vec<PageOutcome> {
    let pages: Vec<Vec<u8>> = keys.iter().map(|k| page_bytes(k, len)).collect();
    let bufs: Vec<PageBuf<'_>> = pages
        .iter()
        .map(|p| PageBuf::contiguous(LAYOUT, p))
        .collect();
    s.batch_set(keys, &bufs).await.unwrap()
}

async fn get(s: &FileBackend, keys: &[PageKey], len: usize) -> Vec<PageOutcome> {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    let out = {
        let mut dst: Vec<PageBufMut<'_>> = bufs
            .iter_mut()
            .map(|b| PageBufMut::contiguous(LAYOUT, b))
            .collect();
        s.batch_get(keys, &mut dst).await.unwrap()
    };
    for ((k, o), b) in keys.iter().zip(&out).zip(&bufs) {
        if *o == PageOutcome::Hit {
            assert!(check_page(k, b), "a hit with wrong bytes for {k}");
        }
    }
    out
}

fn options(dir: &std::path::Path, capacity: u64) -> FileOptions {
    let mut o = FileOptions::new(dir);
    o.capacity_bytes = Some(capacity);
    o.io_threads = 4;
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clear_touches_one_namespace_and_nothing_foreign() {
    let d = test_dir();
    let s = FileBackend::open(options(d.path(), 64 << 20)).unwrap();
    assert!(s.info().clear);
    let a: Vec<PageKey> = (0..20).map(|i| page_key(namespace(1), 1, i)).collect();
    let b: Vec<PageKey> = (0..5).map(|i| page_key(namespace(2), 1, i)).collect();
    assert!(
        put(&s, &a, 5000)
            .await
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    assert!(
        put(&s, &b, 5000)
            .await
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    // Files the backend did not write, with names near its own: never touched.
    let pages = d.path().join("pages");
    let foreign = [
        pages.join("notes.txt"),
        pages.join(format!("{}.page.bak", a[0].to_hex())),
        pages.join(format!("{}.page", &a[1].to_hex()[..90])),
    ];
    for f in &foreign {
        std::fs::write(f, b"not a page").unwrap();
    }
    // A directory with a page's name is not a page either.
    let dir_named_like_a_page =
        pages.join(format!("{}.page", page_key(namespace(1), 9, 9).to_hex()));
    std::fs::create_dir(&dir_named_like_a_page).unwrap();
    assert_eq!(s.clear(namespace(1)).await.unwrap(), 20);
    assert_eq!(s.batch_exists(&a).await.unwrap(), 0);
    assert_eq!(s.batch_exists(&b).await.unwrap(), 5);
    for f in &foreign {
        assert!(f.exists(), "{} was deleted", f.display());
    }
    assert!(dir_named_like_a_page.is_dir());
    assert_eq!(s.stats().cleared_pages, 20);
    drop(s);
    // The clear is on disk: a restart serves none of the cleared pages.
    let s = FileBackend::open(options(d.path(), 64 << 20)).unwrap();
    assert_eq!(s.batch_exists(&a[..1]).await.unwrap(), 0);
    assert_eq!(s.batch_exists(&b).await.unwrap(), 5);
    drop(s);
    // Read-only: refused, nothing changed.
    let mut ro = options(d.path(), 64 << 20);
    ro.read_only = true;
    let s = FileBackend::open(ro).unwrap();
    assert!(!s.info().clear);
    let e = s.clear(namespace(2)).await.unwrap_err();
    assert!(e.to_string().contains("read-only"), "{e}");
    assert_eq!(s.batch_exists(&b).await.unwrap(), 5);
}

/// Another process shares the directory: a clear removes that process's pages of the
/// namespace too (they are files in `pages/`, whoever wrote them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clear_in_shared_mode_removes_every_writer_s_pages() {
    let d = test_dir();
    let mut o = options(d.path(), 64 << 20);
    o.shared = true;
    let s1 = FileBackend::open(o.clone()).unwrap();
    let s2 = FileBackend::open(o).unwrap();
    let a: Vec<PageKey> = (0..6).map(|i| page_key(namespace(3), 2, i)).collect();
    put(&s1, &a[..3], 4096).await;
    put(&s2, &a[3..], 4096).await;
    assert_eq!(s1.clear(namespace(3)).await.unwrap(), 6);
    assert_eq!(s1.batch_exists(&a).await.unwrap(), 0);
    // Issue 28 (low): s2's index still names its pages, but `batch_exists` checks each listed
    // file and reports none of them (it reported 3 before: a stale positive until a get missed).
    assert_eq!(s2.batch_exists(&a[3..]).await.unwrap(), 0);
    assert_eq!(s2.batch_exists(&a[4..]).await.unwrap(), 0);
    // A read finds the files gone: a miss, never stale data.
    assert!(
        get(&s2, &a[3..], 4096)
            .await
            .iter()
            .all(|o| *o != PageOutcome::Hit)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_expires_pages_on_the_injected_clock() {
    let d = test_dir();
    let t0 = 1_800_000_000_000_000_000u64;
    let clock = Clock::manual(t0);
    let mut o = options(d.path(), 64 << 20);
    o.lifecycle.ttl = Some(Duration::from_secs(100));
    let s = FileBackend::open_with_clock(o.clone(), clock.clone()).unwrap();
    let old: Vec<PageKey> = (0..10).map(|i| page_key(namespace(4), 3, i)).collect();
    let young: Vec<PageKey> = (0..4).map(|i| page_key(namespace(4), 4, i)).collect();
    put(&s, &old, 4096).await;
    clock.advance(Duration::from_secs(60));
    put(&s, &young, 4096).await;
    assert_eq!(s.batch_exists(&old).await.unwrap(), 10);
    clock.advance(Duration::from_secs(40)); // old: 100 s, young: 40 s
    assert_eq!(
        s.batch_exists(&old).await.unwrap(),
        0,
        "expired pages are absent"
    );
    assert!(
        get(&s, &old, 4096)
            .await
            .iter()
            .all(|o| *o == PageOutcome::Miss)
    );
    assert_eq!(s.batch_exists(&young).await.unwrap(), 4);
    assert!(
        get(&s, &young, 4096)
            .await
            .iter()
            .all(|o| *o == PageOutcome::Hit)
    );
    // The reclaim thread deletes them (woken by the misses; a bounded wait, not a sleep).
    assert!(s.wait_reclaimed(WAIT));
    assert_eq!(s.stats().expired_pages, 10);
    assert_eq!(s.stats().pages, 4);
    for k in &old {
        assert!(!s.page_path(k).exists(), "expired {k} still on disk");
    }
    // An expired key is written again (a fresh write time), not reported present.
    assert!(
        put(&s, &old[..2], 4096)
            .await
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    drop(s);
    // Write times persist: after a restart with the clock past the young pages' ttl, they
    // are misses too; the pages written again are not.
    clock.advance(Duration::from_secs(70)); // young: 110 s, rewritten: 70 s
    let s = FileBackend::open_with_clock(o, clock.clone()).unwrap();
    assert_eq!(s.batch_exists(&young).await.unwrap(), 0);
    assert_eq!(s.batch_exists(&old[..2]).await.unwrap(), 2);
    assert!(s.wait_reclaimed(WAIT));
    assert_eq!(s.stats().pages, 2);
}

/// Stored bytes pass the high watermark; the reclaim thread evicts down to the low one in
/// chunks. Its hook holds it after the first chunk until batches have run: they complete
/// while the pass is midway (proved by the eviction count at that point), so eviction does
/// not block them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watermark_eviction_runs_in_the_background() {
    let d = test_dir();
    let len = 4096;
    let cap = 256 * file_bytes(len);
    let mut o = options(d.path(), cap);
    o.lifecycle.watermarks = Some(Watermarks::new(0.5, 0.1).unwrap());
    let s = Arc::new(FileBackend::open(o).unwrap());
    let (paused_tx, paused_rx) = mpsc::channel::<u64>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = parking_lot::Mutex::new(Some(go_rx));
    let hook: ReclaimHook = Arc::new(move |removed| {
        // Hold the first pass after its first chunk until the test says go.
        if let Some(rx) = go_rx.lock().take() {
            paused_tx.send(removed).unwrap();
            rx.recv_timeout(WAIT).unwrap();
        }
    });
    s.set_reclaim_hook(Some(hook));
    let first: Vec<PageKey> = (0..100).map(|i| page_key(namespace(5), 5, i)).collect();
    let second: Vec<PageKey> = (100..200).map(|i| page_key(namespace(5), 5, i)).collect();
    put(&s, &first, len).await;
    assert_eq!(
        s.stats().evicted_pages,
        0,
        "below the high watermark: no eviction"
    );
    put(&s, &second, len).await; // 200 pages > 128: the reclaim thread is woken
    let removed = paused_rx
        .recv_timeout(WAIT)
        .expect("the reclaim pass started");
    assert_eq!(removed, 64, "held after its first chunk");
    // The pass is midway. Batches run to completion meanwhile.
    let during: Vec<PageKey> = (0..10).map(|i| page_key(namespace(5), 6, i)).collect();
    assert!(
        put(&s, &during, len)
            .await
            .iter()
            .all(|o| *o == PageOutcome::Stored)
    );
    assert!(
        get(&s, &during, len)
            .await
            .iter()
            .all(|o| *o == PageOutcome::Hit)
    );
    assert_eq!(s.batch_exists(&second[50..]).await.unwrap(), 50);
    assert_eq!(
        s.stats().evicted_pages,
        64,
        "the pass was still holding midway"
    );
    go_tx.send(()).unwrap();
    assert!(s.wait_reclaimed(WAIT));
    let st = s.stats();
    let low = (cap as f64 * 0.1) as u64;
    assert!(st.pages * file_bytes(len) <= low, "{st:?}");
    assert!(st.pages > 0);
    // Eviction order: the oldest first; the pages written during the pass survive.
    assert_eq!(s.batch_exists(&first[..1]).await.unwrap(), 0);
    assert_eq!(s.batch_exists(&during).await.unwrap(), 10);
    assert_eq!(
        st.pages,
        (low / file_bytes(len)),
        "evicted exactly down to low"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_config_errors_at_build_time() {
    let r = hicache_storage::Registry::with_builtins();
    hicache_backend_local::FileFactory::register(&r).unwrap();
    let d = test_dir();
    for (extra, field) in [
        (r#"{"ttl_s": 0}"#, "ttl_s"),
        (
            r#"{"high_watermark": 0.4, "low_watermark": 0.6}"#,
            "low_watermark",
        ),
        (r#"{"low_watermark": 0.2}"#, "low_watermark"),
        (r#"{"high_watermark": 0}"#, "high_watermark"),
    ] {
        let mut doc: serde_json::Value = serde_json::from_str(extra).unwrap();
        doc["dir"] = serde_json::Value::String(d.path().display().to_string());
        let cfg =
            hicache_storage::StorageConfig::parse(Some("file"), Some(&doc.to_string())).unwrap();
        let Err(e) = r
            .open(&cfg, &hicache_storage::BackendContext::default())
            .await
        else {
            panic!("{extra}: opened");
        };
        assert!(matches!(e, StorageError::Config { .. }), "{extra}: {e}");
        assert!(
            e.to_string().contains(&format!("`{field}`")),
            "{extra}: {e}"
        );
    }
    assert_eq!(
        std::fs::read_dir(d.path()).unwrap().count(),
        0,
        "nothing was created"
    );
}
