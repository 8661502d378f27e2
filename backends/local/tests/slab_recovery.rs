//! Restart and recovery (torn index-log tails, truncated slabs, a lowered capacity), the
//! directory lock, and the three I/O paths: registered fixed buffers, unregistered aligned
//! memory, unaligned memory through bounce buffers.

#[path = "slab_common/mod.rs"]
mod common;

use std::fs;
use std::sync::Arc;

use common::{test_dir, test_opts};
use hicache_backend_local::slab::format::{INDEX_FILE, RECORD_LEN, slab_file_name};
use hicache_backend_local::slab::{FsyncPolicy, UringBackend};
use hicache_storage::pattern::{check_page, namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, MemoryRegion, PageKey, PageOutcome, Storage, StorageExt};
use memmap2::MmapMut;

const L: LayoutKind = LayoutKind::PageFirst;

fn keys(seed: u64, n: u64) -> Vec<PageKey> {
    (0..n).map(|i| page_key(namespace(1), seed, i)).collect()
}

async fn put_all(s: &UringBackend, ks: &[PageKey], len: usize) {
    let pages: Vec<(PageKey, bytes::Bytes)> = ks
        .iter()
        .map(|k| (*k, bytes::Bytes::from(page_bytes(k, len))))
        .collect();
    for o in s.put_pages(L, &pages).await.unwrap() {
        assert_eq!(o, PageOutcome::Stored);
    }
}

/// Which of `ks` read back: `Some(true)` exact, `Some(false)` wrong bytes (never allowed),
/// `None` not a hit.
async fn read_back(s: &UringBackend, ks: &[PageKey], len: usize) -> Vec<Option<bool>> {
    s.get_pages(L, len, ks)
        .await
        .unwrap()
        .iter()
        .zip(ks)
        .map(|(g, k)| g.as_ref().map(|b| check_page(k, b)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_serves_every_committed_page_bit_exact() {
    let dir = test_dir();
    let ks = keys(1, 40);
    let before = {
        let s = UringBackend::open(test_opts(dir.path())).unwrap();
        put_all(&s, &ks[..20], 262_144).await;
        put_all(&s, &ks[20..], 10_000).await;
        assert_eq!(s.delete(&ks[5..7]).await.unwrap(), 2);
        s.stats()
    };
    let s = UringBackend::open(test_opts(dir.path())).unwrap();
    let r = s.open_report().clone();
    assert_eq!(
        (r.pages, r.discarded_records, r.discarded_pages),
        (38, 0, 0)
    );
    let st = s.stats();
    assert_eq!((st.pages, st.bytes), (before.pages, before.bytes));
    let big = read_back(&s, &ks[..20], 262_144).await;
    for (i, r) in big.iter().enumerate() {
        let want = if (5..7).contains(&i) {
            None
        } else {
            Some(true)
        };
        assert_eq!(*r, want, "page {i}");
    }
    assert!(
        read_back(&s, &ks[20..], 10_000)
            .await
            .iter()
            .all(|r| *r == Some(true))
    );
    // Writing after a restart reuses freed slots and keeps everything else.
    put_all(&s, &keys(2, 10), 262_144).await;
    assert!(
        read_back(&s, &ks[..5], 262_144)
            .await
            .iter()
            .all(|r| *r == Some(true))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torn_index_tails_are_discarded_and_the_rest_served() {
    let dir = test_dir();
    let a = keys(3, 8);
    let b = keys(4, 4);
    {
        let s = UringBackend::open(test_opts(dir.path())).unwrap();
        put_all(&s, &a, 65_536).await;
        put_all(&s, &b, 65_536).await;
    }
    let log = dir.path().join(INDEX_FILE);
    // A torn last record (the last page of batch b): truncation mid-record.
    let full = fs::read(&log).unwrap();
    fs::write(&log, &full[..full.len() - RECORD_LEN / 2]).unwrap();
    {
        let s = UringBackend::open(test_opts(dir.path())).unwrap();
        assert_eq!(s.open_report().discarded_records, 1);
        assert_eq!(s.stats().discarded_on_open, 1);
        assert!(
            read_back(&s, &a, 65_536)
                .await
                .iter()
                .all(|r| *r == Some(true))
        );
        assert_eq!(
            read_back(&s, &b, 65_536).await,
            vec![Some(true), Some(true), Some(true), None]
        );
    }
    // Garbage appended after the last whole record (a torn append of three records).
    let mut bytes = fs::read(&log).unwrap();
    bytes.extend((0..3 * RECORD_LEN).map(|i| (i * 31 % 251) as u8));
    fs::write(&log, &bytes).unwrap();
    let s = UringBackend::open(test_opts(dir.path())).unwrap();
    assert_eq!(s.open_report().discarded_records, 3);
    assert_eq!(s.stats().pages, 11);
    assert!(
        read_back(&s, &a, 65_536)
            .await
            .iter()
            .all(|r| *r == Some(true))
    );
    assert_eq!(fs::metadata(&log).unwrap().len() % RECORD_LEN as u64, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_slab_reads_as_corrupt_never_as_a_hit() {
    let dir = test_dir();
    let ks = keys(5, 6);
    {
        let s = UringBackend::open(test_opts(dir.path())).unwrap();
        put_all(&s, &ks, 65_536).await;
    }
    // Cut the slab in the middle of slot 3 (slots are handed out lowest first).
    let slab = dir.path().join(slab_file_name(65_536));
    let f = fs::OpenOptions::new().write(true).open(&slab).unwrap();
    f.set_len(3 * 65_536 + 8192).unwrap();
    drop(f);
    let s = UringBackend::open(test_opts(dir.path())).unwrap();
    // Slots 4 and 5 lie wholly past the end: their records are dropped at open.
    assert_eq!(s.open_report().discarded_pages, 2);
    let got = read_back(&s, &ks, 65_536).await;
    assert_eq!(&got[..3], &[Some(true); 3]);
    assert_eq!(&got[3..], &[None; 3], "short slots are misses");
    let st = s.stats();
    assert_eq!(st.get_corrupt, 1, "slot 3 is cut short: {st:?}");
    assert!(
        s.io_stats().short_transfers >= 1,
        "the cut slot gave a short read first"
    );
    assert_eq!(s.batch_exists(&ks[3..4]).await.unwrap(), 0, "dropped");
    // The dropped pages can be stored again (the slab grows back).
    put_all(&s, &ks[3..], 65_536).await;
    assert!(
        read_back(&s, &ks, 65_536)
            .await
            .iter()
            .all(|r| *r == Some(true))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_capacity_at_open_evicts_oldest_first() {
    let dir = test_dir();
    let ks = keys(6, 10);
    {
        let s = UringBackend::open(test_opts(dir.path())).unwrap();
        for k in &ks {
            put_all(&s, std::slice::from_ref(k), 65_536).await;
        }
    }
    let mut o = test_opts(dir.path());
    o.capacity_bytes = Some(4 * 65_536);
    let s = UringBackend::open(o.clone()).unwrap();
    assert_eq!(s.open_report().evicted, 6);
    assert!(s.open_report().compacted);
    assert_eq!(s.stats().pages, 4);
    assert!(
        read_back(&s, &ks[6..], 65_536)
            .await
            .iter()
            .all(|r| *r == Some(true))
    );
    assert_eq!(s.batch_exists(&ks[..1]).await.unwrap(), 0);
    drop(s);
    // The evictions were logged: a reopen at the larger capacity does not bring them back.
    let s = UringBackend::open(test_opts(dir.path())).unwrap();
    assert_eq!(s.stats().pages, 4);
}

#[test]
fn a_second_owner_in_this_process_is_refused_naming_this_process() {
    let dir = test_dir();
    let a = UringBackend::open(test_opts(dir.path())).unwrap();
    let e = UringBackend::open(test_opts(dir.path()))
        .unwrap_err()
        .to_string();
    // The holder is this very process (issue 28, low: it used to say "in use by another
    // process (pid <own pid>)").
    assert!(e.contains("held by a store of this same process"), "{e}");
    drop(a);
    UringBackend::open(test_opts(dir.path())).unwrap();
}

#[test]
fn a_foreign_index_log_is_refused() {
    let dir = test_dir();
    fs::write(dir.path().join(INDEX_FILE), vec![b'x'; 4096]).unwrap();
    let e = UringBackend::open(test_opts(dir.path()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a hicache-uring index log"), "{e}");
}

/// The shared round trip, page 3 read back in 4 parts.
async fn round_trip_in(
    s: &UringBackend,
    ks: &[PageKey],
    region: &mut [u8],
    back: &mut [u8],
    len: usize,
) {
    hicache_backend_local::testing::round_trip_in(s, ks, region, back, len, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_pool_pages_use_fixed_buffers_others_do_not() {
    let dir = test_dir();
    let s = Arc::new(UringBackend::open(test_opts(dir.path())).unwrap());
    let len = 1 << 20;
    // The "host pool": one mapping holding both the source and the destination pages.
    let mut pool = MmapMut::map_anon(16 * len).unwrap();
    s.register_memory(MemoryRegion {
        addr: pool.as_ptr() as usize,
        len: pool.len(),
        cuda_registered: false,
        huge_pages: false,
    })
    .unwrap();
    assert_eq!(s.io_stats().registered_bytes, 16 * len as u64);
    let (src, dst) = pool.split_at_mut(8 * len);
    let ks = keys(7, 8);
    round_trip_in(&s, &ks, src, dst, len).await;
    let io = s.io_stats();
    // 7 contiguous pages + 64 parts for the scattered write; 7 + 4 for the reads.
    assert_eq!(io.fixed_requests, 7 + 64 + 7 + 4, "{io:?}");
    assert_eq!(
        (io.vectored_requests, io.plain_requests, io.bounced_pages),
        (0, 0, 0)
    );

    // Aligned memory outside the registered pool: direct, but not fixed.
    let mut other = MmapMut::map_anon(8 * len).unwrap();
    let mut other_back = MmapMut::map_anon(8 * len).unwrap();
    let ks2 = keys(8, 8);
    round_trip_in(&s, &ks2, &mut other, &mut other_back, len).await;
    let io2 = s.io_stats();
    assert_eq!(io2.fixed_requests, io.fixed_requests, "{io2:?}");
    assert_eq!(
        io2.vectored_requests, 2,
        "one vectored request per scattered page"
    );
    assert_eq!(io2.plain_requests, 14);
    assert_eq!(io2.bounced_pages, 0);

    // Unaligned memory: bounce buffers, still exact.
    let mut v = vec![0u8; 8 * len + 1];
    let mut w = vec![0u8; 8 * len + 1];
    let ks3 = keys(9, 8);
    round_trip_in(&s, &ks3, &mut v[1..], &mut w[1..], len).await;
    assert_eq!(s.io_stats().bounced_pages, 16);

    // A second, different region is refused; the same one again is fine.
    assert!(
        s.register_memory(MemoryRegion {
            addr: other.as_ptr() as usize,
            len: other.len(),
            cuda_registered: false,
            huge_pages: false,
        })
        .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_buffers_off_ignores_the_region() {
    let dir = test_dir();
    let mut o = test_opts(dir.path());
    o.fixed_buffers = false;
    o.fsync = FsyncPolicy::None;
    let s = UringBackend::open(o).unwrap();
    let len = 65_536;
    let mut pool = MmapMut::map_anon(16 * len).unwrap();
    s.register_memory(MemoryRegion {
        addr: pool.as_ptr() as usize,
        len: pool.len(),
        cuda_registered: false,
        huge_pages: false,
    })
    .unwrap();
    let (src, dst) = pool.split_at_mut(8 * len);
    round_trip_in(&s, &keys(10, 8), src, dst, len).await;
    assert_eq!(s.io_stats().fixed_requests, 0);
    assert_eq!(s.io_stats().registered_bytes, 0);
}

#[tokio::test(flavor = "current_thread")]
async fn works_on_a_current_thread_runtime() {
    let dir = test_dir();
    let s = UringBackend::open(test_opts(dir.path())).unwrap();
    let ks = keys(11, 5);
    put_all(&s, &ks, 777).await;
    assert!(
        read_back(&s, &ks, 777)
            .await
            .iter()
            .all(|r| *r == Some(true))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_opens_it_with_strict_fields() {
    let dir = test_dir();
    let r = hicache_storage::Registry::new();
    hicache_backend_local::UringFactory::register(&r).unwrap();
    let extra = format!(
        r#"{{"dir": {:?}, "capacity": "64MiB", "queue_depth": 16, "page_bytes": 65536}}"#,
        dir.path().display().to_string()
    );
    let cfg = hicache_storage::StorageConfig::parse(Some("uring"), Some(&extra)).unwrap();
    let s = r
        .open(&cfg, &hicache_storage::BackendContext::default())
        .await
        .unwrap();
    assert_eq!(s.info().name, "uring");
    assert!(s.info().persistent && s.info().zero_copy);
    assert!(
        dir.path().join(slab_file_name(65_536)).exists(),
        "page_bytes creates the slab"
    );
    let k = page_key(namespace(2), 1, 1);
    assert_eq!(
        s.put(L, k, &page_bytes(&k, 4096)).await.unwrap(),
        PageOutcome::Stored
    );
    drop(s);
    let bad = hicache_storage::StorageConfig::parse(
        Some("uring"),
        Some(r#"{"dir": "/tmp/x", "queue_depth": 0}"#),
    )
    .unwrap();
    let e = r
        .open(&bad, &hicache_storage::BackendContext::default())
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("`queue_depth`") && e.contains("backend uring"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_dropped_as_corrupt_stays_dropped_after_a_restart() {
    let dir = test_dir();
    let ks = keys(12, 3);
    {
        let s = UringBackend::open(test_opts(dir.path())).unwrap();
        put_all(&s, &ks, 65_536).await;
        assert!(common::corrupt_page(&s, &ks[1]).unwrap());
        assert_eq!(
            read_back(&s, &ks, 65_536).await,
            vec![Some(true), None, Some(true)]
        );
        assert_eq!(s.stats().get_corrupt, 1);
    }
    let s = UringBackend::open(test_opts(dir.path())).unwrap();
    assert_eq!(s.stats().pages, 2);
    assert_eq!(s.batch_exists(&ks[1..2]).await.unwrap(), 0);
    assert_eq!(
        read_back(&s, &ks, 65_536).await,
        vec![Some(true), None, Some(true)]
    );
    assert_eq!(s.stats().get_corrupt, 0, "not found corrupt a second time");
}
