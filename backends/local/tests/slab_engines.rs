//! The slab layout on either engine: the threads engine (what `io_engine: "auto"` falls back
//! to where io_uring is unavailable, forced here with `io_engine: "threads"`) serves pages
//! without the ring, and a store written on one engine reads back on the other.

#[path = "slab_common/mod.rs"]
mod common;

use common::{test_dir, test_opts};
use hicache_backend_local::io::IoEngine;
use hicache_backend_local::slab::UringBackend;
use hicache_storage::pattern::{namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, PageKey, Storage, StorageExt};

const PAGE: usize = 64 << 10;

fn keys(seed: u64) -> Vec<PageKey> {
    (0..16).map(|i| page_key(namespace(3), seed, i)).collect()
}

async fn put_all(s: &UringBackend, keys: &[PageKey]) {
    for k in keys {
        s.put(LayoutKind::PageFirst, *k, &page_bytes(k, PAGE))
            .await
            .unwrap();
    }
}

async fn check_all(s: &UringBackend, keys: &[PageKey]) {
    assert_eq!(s.batch_exists(keys).await.unwrap(), keys.len());
    for k in keys {
        let got = s.get(LayoutKind::PageFirst, PAGE, *k).await.unwrap();
        assert_eq!(got.as_deref(), Some(&page_bytes(k, PAGE)[..]), "{k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn threads_engine_serves_and_either_engine_reads_the_other() {
    let dir = test_dir();
    let mut o = test_opts(dir.path());
    o.io_engine = IoEngine::Threads;
    let s = UringBackend::open(o.clone()).unwrap();
    let st = s.io_stats();
    assert!(!st.uring, "{st:?}");
    let a = keys(1);
    put_all(&s, &a).await;
    check_all(&s, &a).await;
    // No ring: no request went through io_uring's counters.
    assert_eq!(
        s.io_stats().fixed_requests + s.io_stats().vectored_requests,
        0
    );
    drop(s);

    o.io_engine = IoEngine::Auto;
    let s = UringBackend::open(o.clone()).unwrap();
    check_all(&s, &a).await;
    let b = keys(2);
    put_all(&s, &b).await;
    drop(s);

    o.io_engine = IoEngine::Threads;
    let s = UringBackend::open(o).unwrap();
    check_all(&s, &a).await;
    check_all(&s, &b).await;
}
