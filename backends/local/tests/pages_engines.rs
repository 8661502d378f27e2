//! The two I/O engines (io_uring and threads): the same on-disk format, the same outcomes for
//! damaged pages, and the engine each mode selects.

#[path = "pages_common/mod.rs"]
mod common;

use common::test_dir;
use hicache_backend_local::pages::format::HEADER_LEN;
use hicache_backend_local::pages::{FileBackend, FileOptions, FsyncPolicy, IoEngine};
use hicache_core::LayoutKind;
use hicache_storage::pattern::{check_page, namespace, page_bytes, page_key};
use hicache_storage::{PageBufMut, PageKey, PageOutcome, Storage, StorageExt};
use memmap2::MmapMut;

const L: LayoutKind = LayoutKind::PageFirst;
const LEN: usize = 64 << 10;

fn opts(dir: &std::path::Path, engine: IoEngine) -> FileOptions {
    let mut o = FileOptions::new(dir);
    o.capacity_bytes = Some(256 << 20);
    o.io_threads = 4;
    o.queue_depth = 8;
    o.io_engine = engine;
    o
}

fn keys(seed: u64, n: u64) -> Vec<PageKey> {
    (0..n).map(|i| page_key(namespace(2), seed, i)).collect()
}

async fn put_all(s: &FileBackend, ks: &[PageKey]) {
    let pages: Vec<(PageKey, bytes::Bytes)> = ks
        .iter()
        .map(|k| (*k, bytes::Bytes::from(page_bytes(k, LEN))))
        .collect();
    for o in s.put_pages(L, &pages).await.unwrap() {
        assert_eq!(o, PageOutcome::Stored);
    }
}

/// Reads `ks` with O_DIRECT-able destinations (page-aligned, as the host pool's pages are).
async fn get_aligned(s: &FileBackend, ks: &[PageKey]) -> (Vec<PageOutcome>, MmapMut) {
    let mut region = MmapMut::map_anon(ks.len() * LEN).unwrap();
    let mut dst: Vec<PageBufMut<'_>> = region
        .chunks_mut(LEN)
        .map(|c| PageBufMut::contiguous(L, c))
        .collect();
    let out = s.batch_get(ks, &mut dst).await.unwrap();
    drop(dst);
    (out, region)
}

#[test]
fn the_mode_selects_the_engine() {
    let dir = test_dir();
    let s = FileBackend::open(opts(dir.path(), IoEngine::Threads)).unwrap();
    assert!(!s.uses_uring() && !s.open_report().uring);
    drop(s);
    // This machine's kernel has io_uring (reference/machines.md): `uring` must get it, and
    // `auto` must pick it.
    for mode in [IoEngine::Uring, IoEngine::Auto] {
        let s = FileBackend::open(opts(dir.path(), mode)).unwrap();
        assert!(s.uses_uring() && s.open_report().uring, "{mode:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_engine_reads_what_the_other_wrote() {
    for (writer, reader) in [
        (IoEngine::Threads, IoEngine::Uring),
        (IoEngine::Uring, IoEngine::Threads),
    ] {
        let dir = test_dir();
        // More pages than the ring's depth, so slots are reused within a batch.
        let ks = keys(1, 40);
        {
            let s = FileBackend::open(opts(dir.path(), writer)).unwrap();
            put_all(&s, &ks).await;
        }
        let s = FileBackend::open(opts(dir.path(), reader)).unwrap();
        assert_eq!(s.open_report().pages, 40);
        let (out, region) = get_aligned(&s, &ks).await;
        assert!(out.iter().all(|o| *o == PageOutcome::Hit), "{out:?}");
        for (k, c) in ks.iter().zip(region.chunks(LEN)) {
            assert!(check_page(k, c), "{writer:?} -> {reader:?}: {k}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_damaged_while_open_read_as_corrupt_on_both_engines() {
    for engine in [IoEngine::Uring, IoEngine::Threads] {
        for fsync in [FsyncPolicy::Batch, FsyncPolicy::Always, FsyncPolicy::None] {
            let dir = test_dir();
            let mut o = opts(dir.path(), engine);
            o.fsync = fsync;
            let s = FileBackend::open(o).unwrap();
            let ks = keys(3, 12);
            put_all(&s, &ks).await;
            // 0: truncated inside the data; 1: truncated inside the header; 2: a data byte
            // flipped; 3: deleted behind the backend's back.
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(s.page_path(&ks[0]))
                .unwrap();
            f.set_len((HEADER_LEN + LEN / 2) as u64).unwrap();
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(s.page_path(&ks[1]))
                .unwrap();
            f.set_len(100).unwrap();
            common::corrupt_file(&s.page_path(&ks[2])).unwrap();
            std::fs::remove_file(s.page_path(&ks[3])).unwrap();
            let (out, region) = get_aligned(&s, &ks).await;
            let what = format!("{engine:?} {fsync:?}");
            assert_eq!(out[0], PageOutcome::Corrupt, "{what}");
            assert_eq!(out[1], PageOutcome::Corrupt, "{what}");
            assert_eq!(out[2], PageOutcome::Corrupt, "{what}");
            assert_eq!(out[3], PageOutcome::Miss, "{what}");
            for (i, c) in region.chunks(LEN).enumerate() {
                if i < 3 {
                    assert!(
                        c.iter().all(|&b| b == 0),
                        "{what}: a corrupt page is zeroed"
                    );
                } else if i > 3 {
                    assert_eq!(out[i], PageOutcome::Hit, "{what}");
                    assert!(check_page(&ks[i], c), "{what}");
                }
            }
            assert_eq!(s.stats().get_corrupt, 3, "{what}");
            // Damaged pages are gone; rewriting them works.
            assert_eq!(s.batch_exists(&ks).await.unwrap(), 0);
            put_all(&s, &ks[..4]).await;
            let (out, _) = get_aligned(&s, &ks).await;
            assert!(
                out.iter().all(|o| *o == PageOutcome::Hit),
                "{what}: {out:?}"
            );
        }
    }
}
