//! Watermark eviction of the uring backend (issue 18): past the high watermark the reclaim
//! thread evicts, oldest first, down to the low one; its `del` records reach the index log,
//! so a restart serves exactly the pages that were left; and page expiry (`ttl_s`) on an
//! injected manual clock (no sleeps): expired pages are misses, rewritten by a set, deleted by
//! the reclaim thread, and their write times survive restarts and compactions. (`clear` is in
//! the conformance suite.)

#[path = "slab_common/mod.rs"]
mod common;

use std::time::Duration;

use common::{test_dir, test_opts};
use hicache_backend_local::slab::UringBackend;
use hicache_backend_local::slab::format::{INDEX_FILE, RECORD_LEN, Record};
use hicache_storage::lifecycle::Clock;
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

const WAIT: Duration = Duration::from_secs(120);
/// A fixed start for the manual clock (Unix nanoseconds, whole seconds).
const T0: u64 = 1_800_000_000_000_000_000;

fn ttl_opts(dir: &std::path::Path) -> hicache_backend_local::slab::UringOptions {
    let mut o = test_opts(dir);
    o.capacity_bytes = Some(64 << 20);
    o.ttl = Some(Duration::from_secs(100));
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_expires_pages_on_the_injected_clock() {
    let d = test_dir();
    let clock = Clock::manual(T0);
    let o = ttl_opts(d.path());
    let s = UringBackend::open_with_clock(o.clone(), clock.clone()).unwrap();
    let old: Vec<PageKey> = (0..10).map(|i| page_key(namespace(4), 3, i)).collect();
    let young: Vec<PageKey> = (0..4).map(|i| page_key(namespace(4), 4, i)).collect();
    put(&s, &old).await;
    clock.advance(Duration::from_secs(60));
    put(&s, &young).await;
    clock.advance(Duration::from_secs(39)); // old: 99 s
    assert_eq!(s.batch_exists(&old).await.unwrap(), 10);
    assert_eq!(hits(&s, &old).await, 10);
    clock.advance(Duration::from_secs(1)); // old: 100 s, young: 40 s
    assert_eq!(s.batch_exists(&old).await.unwrap(), 0, "expired: absent");
    // Leading run: a young page then an expired one.
    let mixed = [young[0], old[0], young[1]];
    assert_eq!(s.batch_exists(&mixed).await.unwrap(), 1);
    assert_eq!(hits(&s, &old).await, 0, "expired: misses");
    assert_eq!(s.batch_exists(&young).await.unwrap(), 4);
    assert_eq!(hits(&s, &young).await, 4);
    // The reclaim thread deletes them (woken by the misses; a bounded wait, not a sleep).
    assert!(s.wait_reclaimed(WAIT));
    let st = s.stats();
    assert_eq!((st.expired_pages, st.pages), (10, 4), "{st:?}");
    // An expired key is written again (a fresh write time), not reported present.
    clock.advance(Duration::from_secs(10)); // young: 50 s
    put(&s, &old[..2]).await;
    assert_eq!(s.stats().set_stored, 16);
    assert_eq!(hits(&s, &old[..2]).await, 2);
    drop(s);
    // The deletions were logged: after a restart (clock unmoved) the reclaimed pages stay
    // gone, the rest are served.
    let s = UringBackend::open_with_clock(o.clone(), clock.clone()).unwrap();
    assert_eq!(s.stats().pages, 6);
    assert_eq!(hits(&s, &old[2..]).await, 0);
    assert_eq!(hits(&s, &young).await, 4);
    drop(s);
    // Write times persist: past the young pages' ttl after a restart, they are misses; the
    // pages written again (60 s old) are not.
    clock.advance(Duration::from_secs(50)); // young: 100 s, rewritten: 60 s
    let s = UringBackend::open_with_clock(o, clock.clone()).unwrap();
    assert_eq!(s.batch_exists(&young).await.unwrap(), 0);
    assert_eq!(s.batch_exists(&old[..2]).await.unwrap(), 2);
    assert!(s.wait_reclaimed(WAIT));
    let st = s.stats();
    assert_eq!((st.expired_pages, st.pages), (4, 2), "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_rewrites_an_expired_page_before_the_reclaim_thread_runs() {
    let d = test_dir();
    let clock = Clock::manual(T0);
    let s = UringBackend::open_with_clock(ttl_opts(d.path()), clock.clone()).unwrap();
    let keys: Vec<PageKey> = (0..3).map(|i| page_key(namespace(5), 1, i)).collect();
    put(&s, &keys).await;
    let pages: Vec<Vec<u8>> = keys.iter().map(|k| page_bytes(k, LEN)).collect();
    let bufs: Vec<PageBuf<'_>> = pages
        .iter()
        .map(|p| PageBuf::contiguous(LayoutKind::PageFirst, p))
        .collect();
    // Not expired: present, not rewritten.
    let out = s.batch_set(&keys, &bufs).await.unwrap();
    assert!(out.iter().all(|o| *o == PageOutcome::Present), "{out:?}");
    clock.advance(Duration::from_secs(100));
    // Expired: rewritten whether or not the reclaim thread got to it first.
    let out = s.batch_set(&keys, &bufs).await.unwrap();
    assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
    assert!(s.wait_reclaimed(WAIT));
    assert_eq!(s.batch_exists(&keys).await.unwrap(), 3);
    assert_eq!(hits(&s, &keys).await, 3);
    clock.advance(Duration::from_secs(99));
    assert_eq!(
        s.batch_exists(&keys).await.unwrap(),
        3,
        "a fresh write time"
    );
}

/// Rewrites every `put` record of `dir`'s index log with write time 0, as builds before the
/// field wrote them (bytes 104..112 zero, the record checksum valid).
fn zero_write_times(dir: &std::path::Path) -> usize {
    let path = dir.join(INDEX_FILE);
    let mut log = std::fs::read(&path).unwrap();
    let mut n = 0;
    for rec in log.chunks_exact_mut(RECORD_LEN) {
        let b: &mut [u8; RECORD_LEN] = rec.try_into().unwrap();
        if let Ok(Record::Put(mut p)) = Record::decode(b) {
            assert_ne!(p.written, 0, "this build records write times");
            p.written = 0;
            *b = Record::Put(p).encode();
            assert!(b[104..112].iter().all(|x| *x == 0));
            n += 1;
        }
    }
    std::fs::write(&path, &log).unwrap();
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_without_write_time_counts_from_the_open() {
    let d = test_dir();
    let clock = Clock::manual(T0);
    let o = ttl_opts(d.path());
    let keys: Vec<PageKey> = (0..5).map(|i| page_key(namespace(6), 1, i)).collect();
    let s = UringBackend::open_with_clock(o.clone(), clock.clone()).unwrap();
    put(&s, &keys).await;
    drop(s);
    assert_eq!(zero_write_times(d.path()), 5);
    // Opened long after the write: the pages count from this open, not from time 0.
    clock.advance(Duration::from_secs(1000));
    let s = UringBackend::open_with_clock(o.clone(), clock.clone()).unwrap();
    assert_eq!(s.batch_exists(&keys).await.unwrap(), 5);
    clock.advance(Duration::from_secs(99));
    assert_eq!(hits(&s, &keys).await, 5);
    clock.advance(Duration::from_secs(1));
    assert_eq!(s.batch_exists(&keys).await.unwrap(), 0);
    assert_eq!(hits(&s, &keys).await, 0);
    assert!(s.wait_reclaimed(WAIT));
    assert_eq!(s.stats().expired_pages, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_at_open_carries_write_times() {
    let d = test_dir();
    let clock = Clock::manual(T0);
    let mut o = ttl_opts(d.path());
    o.capacity_bytes = Some(64 * LEN as u64);
    o.grow_bytes = LEN as u64;
    let keys: Vec<PageKey> = (0..40).map(|i| page_key(namespace(7), 1, i)).collect();
    let s = UringBackend::open_with_clock(o.clone(), clock.clone()).unwrap();
    put(&s, &keys[..20]).await;
    clock.advance(Duration::from_secs(50));
    put(&s, &keys[20..]).await;
    drop(s);
    // A lower capacity evicts the oldest pages at open, which compacts the log.
    o.capacity_bytes = Some(30 * LEN as u64);
    let s = UringBackend::open_with_clock(o.clone(), clock.clone()).unwrap();
    assert!(s.open_report().compacted, "{:?}", s.open_report());
    assert_eq!(s.stats().pages, 30);
    drop(s);
    // The compacted log kept each page's own write time: at 100 s after the first writes
    // the 10 first-written survivors are expired, the 20 later ones (50 s) are not.
    clock.advance(Duration::from_secs(50));
    let s = UringBackend::open_with_clock(o, clock).unwrap();
    assert_eq!(hits(&s, &keys[..10]).await, 0);
    assert_eq!(hits(&s, &keys[10..20]).await, 0, "expired");
    assert_eq!(hits(&s, &keys[20..]).await, 20);
}
