//! Power loss while the background reclaim thread evicts between the watermarks (issue 18):
//! a workload is written to a small store with `high_watermark` / `low_watermark` set, the
//! reclaim passes it triggers are recorded in the same journal as the writes (every unlink),
//! and crash states a file system may leave after any prefix of those events are recovered
//! and read back. Pages evicted by design may be gone; none may read back wrong or torn.
//! (Its own test binary: the journal is process-wide.)

#[path = "pages_common/mod.rs"]
mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::test_dir;
use hicache_backend_local::io::journal::{self, Event, Journal};
use hicache_backend_local::pages::format::file_bytes;
use hicache_backend_local::pages::{FileBackend, FileOptions, FsyncPolicy};
use hicache_backend_local::testing::power_loss::{Recorded, check, chooser};
use hicache_core::LayoutKind;
use hicache_storage::pattern::{namespace, page_bytes, page_key};
use hicache_storage::{PageBuf, PageKey, PageOutcome, Storage, Watermarks};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const PAGE: usize = 16 << 10;

fn open(d: &Path) -> hicache_storage::Result<FileBackend> {
    let mut o = FileOptions::new(d);
    o.capacity_bytes = Some(12 * file_bytes(PAGE));
    o.fsync = FsyncPolicy::Batch;
    o.io_threads = 4;
    o.queue_depth = 8;
    o.lifecycle.watermarks = Some(Watermarks::new(0.5, 0.2).unwrap());
    FileBackend::open(o)
}

#[test]
fn power_loss_during_watermark_eviction_never_serves_a_wrong_page() {
    let d = test_dir();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let storage = open(d.path()).unwrap();
    let reclaimed = Arc::new(AtomicU64::new(0));
    let r = reclaimed.clone();
    storage.set_reclaim_hook(Some(Arc::new(move |n| {
        r.fetch_max(n, Ordering::SeqCst);
    })));
    let batches: Vec<Vec<PageKey>> = (0..4u64)
        .map(|b| {
            (0..4u64)
                .map(|i| page_key(namespace(7), 1, b * 4 + i))
                .collect()
        })
        .collect();
    let start = journal::start(d.path());
    for (b, keys) in batches.iter().enumerate() {
        let data: Vec<Vec<u8>> = keys.iter().map(|k| page_bytes(k, PAGE)).collect();
        let bufs: Vec<PageBuf<'_>> = data
            .iter()
            .map(|p| PageBuf::contiguous(LayoutKind::PageFirst, p))
            .collect();
        let out = rt.block_on(storage.batch_set(keys, &bufs)).unwrap();
        assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
        journal::ack(b as u64);
    }
    // The passes the writes triggered finish inside the recording (a bounded wait).
    assert!(storage.wait_reclaimed(Duration::from_secs(120)));
    let journal = Journal::finish(start);
    drop(storage);
    // 16 pages into a store whose high watermark is 6: the reclaim thread must have evicted,
    // and its unlinks are in the journal.
    assert!(
        reclaimed.load(Ordering::SeqCst) > 0,
        "no reclaim pass evicted"
    );
    let unlinks = journal
        .events
        .iter()
        .filter(|e| matches!(e, Event::Unlink { path } if path.extension().is_some_and(|x| x == "page")))
        .count();
    assert!(unlinks > 0, "no page unlink recorded");
    let n = journal.events.len();
    let rec = Recorded {
        journal,
        batches,
        page_bytes: PAGE,
    };
    let mut runner = TestRunner::new(Config {
        cases: 40,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&(0..=n, any::<u64>()), |(k, seed)| {
            let into = test_dir();
            let o = check(&rec, k, &mut chooser(seed), into.path(), &open);
            prop_assert_eq!(o.wrong, 0, "crash after {} of {} events: {:?}", k, n, o);
            Ok(())
        })
        .unwrap();
    let into = test_dir();
    let o = check(&rec, n, &mut |_| 0, into.path(), &open);
    assert_eq!(o.wrong, 0, "the harshest state: {o:?}");
    assert_eq!(o.acked, 16);
}
