//! Watermark eviction of the uring backend (issue 18): past the high watermark the reclaim
//! thread evicts, oldest first, down to the low one; its `del` records reach the index log,
//! so a restart serves exactly the pages that were left. (`clear` is in the conformance
//! suite; `ttl_s` is refused by the options.)

mod common;

use std::time::Duration;

use common::{test_dir, test_opts};
use hicache_backend_uring::UringBackend;
use hicache_storage::pattern::{check_page, namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, PageBuf, PageBufMut, PageKey, PageOutcome, Storage, Watermarks};

const LEN: usize = 4096;

async fn put(s: &UringBackend, keys: &[PageKey]) {
    let pages: Vec<Vec<u8>> = keys.iter().map(|k| page_bytes(k, LEN)).collect();
    let bufs: Vec<PageBuf<'_>> = pages
        .iter()
        .map(|p| PageBuf::contiguous(LayoutKind::PageFirst, p))
        .collect();
    let out = s.batch_set(keys, &bufs).await.unwrap();
    assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
}

async fn hits(s: &UringBackend, keys: &[PageKey]) -> usize {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; LEN]).collect();
    let out = {
        let mut dst: Vec<PageBufMut<'_>> = bufs
            .iter_mut()
            .map(|b| PageBufMut::contiguous(LayoutKind::PageFirst, b))
            .collect();
        s.batch_get(keys, &mut dst).await.unwrap()
    };
    let mut n = 0;
    for ((k, o), b) in keys.iter().zip(&out).zip(&bufs) {
        if *o == PageOutcome::Hit {
            assert!(check_page(k, b), "wrong bytes for {k}");
            n += 1;
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watermark_eviction_in_the_background_and_across_a_restart() {
    let d = test_dir();
    let mut o = test_opts(d.path());
    o.capacity_bytes = Some(256 * LEN as u64);
    o.watermarks = Some(Watermarks::new(0.5, 0.1).unwrap());
    let s = UringBackend::open(o.clone()).unwrap();
    let keys: Vec<PageKey> = (0..200).map(|i| page_key(namespace(8), 1, i)).collect();
    put(&s, &keys[..100]).await;
    assert!(s.wait_reclaimed(Duration::from_secs(120)));
    assert_eq!(
        s.stats().evicted_pages,
        0,
        "below the high watermark: no eviction"
    );
    put(&s, &keys[100..]).await;
    assert!(s.wait_reclaimed(Duration::from_secs(120)));
    let st = s.stats();
    let low = (256.0 * LEN as f64 * 0.1) as u64;
    assert_eq!(
        st.pages,
        low / LEN as u64,
        "evicted exactly down to low: {st:?}"
    );
    assert_eq!(st.evicted_pages, 200 - st.pages);
    let kept = st.pages as usize;
    // Oldest first: the last `kept` pages are the ones left.
    assert_eq!(hits(&s, &keys[200 - kept..]).await, kept);
    assert_eq!(hits(&s, &keys[..200 - kept]).await, 0);
    drop(s);
    let s = UringBackend::open(o).unwrap();
    assert_eq!(s.stats().pages, kept as u64, "the evictions were logged");
    assert_eq!(hits(&s, &keys[200 - kept..]).await, kept);
    assert_eq!(hits(&s, &keys[..200 - kept]).await, 0);
}
