//! The suite's cases (feature `testing`), re-exported by [`conformance`](super).

use std::sync::Arc;

use hicache_core::{LayoutKind, PageKey};

use super::Harness;
use crate::backend::Storage;
use crate::context::{BatchContext, SeenContext};
use crate::error::StorageError;
use crate::page::{PageBuf, PageBufMut, PageError, PageOutcome};
use crate::pattern::{check_page, namespace, page_bytes, page_key};

/// One rule of the contract.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Case {
    /// Pages of every size class, contiguous and scattered, round-trip bit-exact.
    RoundTrip,
    /// `batch_exists` returns the leading run.
    ExistsLeadingRun,
    /// Mixed batches report one outcome per page, in order.
    MixedOutcomes,
    /// Setting a present page again is harmless.
    IdempotentSet,
    /// Re-setting a key returns one whole version; new metadata replaces the page.
    Overwrite,
    /// Many tasks read and write at once; every hit is exact.
    Concurrency,
    /// Stored bytes stay within capacity; eviction makes room; oversize pages fail.
    CapacityEviction,
    /// Batches over `max_batch` fail whole; batches at `max_batch` work; empty batches work.
    BatchLimits,
    /// Key/buffer count mismatches fail; wrong destination lengths or layouts are misses.
    WrongLengths,
    /// A damaged page reads as `Corrupt`, counts, and is gone afterwards.
    Corruption,
    /// Two namespaces never see each other's pages.
    NamespaceIsolation,
    /// `delete` removes exactly the named pages.
    Delete,
    /// Counters follow the outcomes.
    Stats,
    /// `clear` of one namespace removes its pages only (rule 10), or the backend says it does
    /// not support it and changes nothing.
    Clear,
    /// Calls carrying a batch context answer exactly as calls without one; a recording
    /// backend receives the context as given.
    BatchContext,
    /// A persistent backend serves its pages after a reopen (not applicable, and reported so,
    /// if the backend does not persist).
    Restart,
}

impl Case {
    /// Every case, in a sensible order.
    pub const ALL: [Case; 16] = [
        Case::RoundTrip,
        Case::ExistsLeadingRun,
        Case::MixedOutcomes,
        Case::IdempotentSet,
        Case::Overwrite,
        Case::Concurrency,
        Case::CapacityEviction,
        Case::BatchLimits,
        Case::WrongLengths,
        Case::Corruption,
        Case::NamespaceIsolation,
        Case::Delete,
        Case::Stats,
        Case::Clear,
        Case::BatchContext,
        Case::Restart,
    ];
}

/// What running a case established.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CaseOutcome {
    /// The case ran its checks and the backend passed them.
    Checked,
    /// The rule does not apply to this backend (the reason says why); nothing was checked.
    NotApplicable(&'static str),
}

/// Runs one case on a fresh multi-threaded tokio runtime (so callers need no runtime of their
/// own). Panics, naming the broken rule, if the backend fails it.
pub fn run_case<H: Harness>(harness: &H, case: Case) -> CaseOutcome {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(case_async(harness, case))
}

/// Runs every case, in order; returns what each established.
pub fn run_all<H: Harness>(harness: &H) -> Vec<(Case, CaseOutcome)> {
    Case::ALL
        .into_iter()
        .map(|case| (case, run_case(harness, case)))
        .collect()
}

/// Runs one case inside the caller's runtime (which must be multi-threaded if the backend
/// needs it).
pub async fn case_async<H: Harness>(h: &H, case: Case) -> CaseOutcome {
    match case {
        Case::RoundTrip => round_trip(h).await,
        Case::ExistsLeadingRun => exists_leading_run(h).await,
        Case::MixedOutcomes => mixed_outcomes(h).await,
        Case::IdempotentSet => idempotent_set(h).await,
        Case::Overwrite => overwrite(h).await,
        Case::Concurrency => concurrency(h).await,
        Case::CapacityEviction => capacity_eviction(h).await,
        Case::BatchLimits => batch_limits(h).await,
        Case::WrongLengths => wrong_lengths(h).await,
        Case::Corruption => corruption(h).await,
        Case::NamespaceIsolation => namespace_isolation(h).await,
        Case::Delete => delete(h).await,
        Case::Stats => stats(h).await,
        Case::Clear => clear(h).await,
        Case::BatchContext => batch_context(h).await,
        // The one case that can be not applicable answers for itself.
        Case::Restart => return restart(h).await,
    }
    CaseOutcome::Checked
}

/// Expands to one `#[test]` per conformance [`Case`], each opening backends through the
/// harness expression given (evaluated once per test), in a module named `conformance` or the
/// name given first (`conformance_tests!(buffered, MyHarness::buffered())`), so one test file
/// can run the suite on several configurations.
///
/// A backend that does not persist adds `not_persistent` last
/// (`conformance_tests!(MyHarness, not_persistent)`): its `restart` test is not generated (it
/// does not apply), and a `not_persistent_as_declared` test checks that the
/// backend indeed reports `persistent: false`. Without it, `restart` fails on a backend that
/// does not persist, saying to declare it, so no test passes without checking anything.
#[macro_export]
macro_rules! conformance_tests {
    ($module:ident, $harness:expr, not_persistent) => {
        $crate::conformance_tests!(@cases $module, $harness, not_persistent;);
    };
    ($harness:expr, not_persistent) => {
        $crate::conformance_tests!(@cases conformance, $harness, not_persistent;);
    };
    ($harness:expr) => {
        $crate::conformance_tests!(conformance, $harness);
    };
    ($module:ident, $harness:expr) => {
        $crate::conformance_tests!(@cases $module, $harness, persistent;
            restart => Restart,
        );
    };
    (@cases $module:ident, $harness:expr, $persistence:ident; $($extra:ident => $extra_case:ident,)*) => {
        $crate::conformance_tests!(@tests $module, $harness, $persistence;
            round_trip => RoundTrip,
            exists_leading_run => ExistsLeadingRun,
            mixed_outcomes => MixedOutcomes,
            idempotent_set => IdempotentSet,
            overwrite => Overwrite,
            concurrency => Concurrency,
            capacity_eviction => CapacityEviction,
            batch_limits => BatchLimits,
            wrong_lengths => WrongLengths,
            corruption => Corruption,
            namespace_isolation => NamespaceIsolation,
            delete => Delete,
            stats => Stats,
            clear => Clear,
            batch_context => BatchContext,
            $($extra => $extra_case,)*
        );
    };
    (@tests $module:ident, $harness:expr, $persistence:ident; $($name:ident => $case:ident,)*) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $name() {
                    let harness = $harness;
                    let outcome =
                        $crate::conformance::run_case(&harness, $crate::conformance::Case::$case);
                    assert_eq!(
                        outcome,
                        $crate::conformance::CaseOutcome::Checked,
                        "case {:?} checked nothing; if the backend does not persist, declare it: \
                         conformance_tests!(..., not_persistent)",
                        $crate::conformance::Case::$case
                    );
                }
            )*
            $crate::conformance_tests!(@volatile $harness, $persistence);
        }
    };
    (@volatile $harness:expr, persistent) => {};
    (@volatile $harness:expr, not_persistent) => {
        #[test]
        fn not_persistent_as_declared() {
            $crate::conformance::assert_not_persistent(&$harness);
        }
    };
}

/// Checks a `not_persistent` declaration: the backend the harness opens reports
/// `persistent: false` (else its `restart` case applies and must run).
pub fn assert_not_persistent<H: Harness>(harness: &H) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        let s = open(harness, None).await;
        assert!(
            !s.info().persistent,
            "declared not_persistent, but the backend reports persistent: true; drop the \
             declaration so its restart case runs"
        );
    });
}

// ---------------------------------------------------------------------------------------------
// Helpers.

const LAYOUT: LayoutKind = LayoutKind::PageFirst;

fn key(ns: u64, i: u64) -> PageKey {
    page_key(namespace(ns), 0xc0f0, i)
}

async fn open<H: Harness>(h: &H, capacity: Option<u64>) -> Arc<H::Backend> {
    h.open(capacity)
        .await
        .unwrap_or_else(|e| panic!("harness could not open a backend: {e}"))
}

async fn set_pages<S: Storage + ?Sized>(
    s: &S,
    keys: &[PageKey],
    pages: &[Vec<u8>],
) -> Vec<PageOutcome> {
    let bufs: Vec<PageBuf<'_>> = pages
        .iter()
        .map(|p| PageBuf::contiguous(LAYOUT, p))
        .collect();
    s.batch_set(keys, &bufs)
        .await
        .unwrap_or_else(|e| panic!("batch_set of {} pages failed: {e}", keys.len()))
}

async fn set_ok<S: Storage + ?Sized>(s: &S, keys: &[PageKey], len: usize) {
    let pages: Vec<Vec<u8>> = keys.iter().map(|k| page_bytes(k, len)).collect();
    for (i, o) in set_pages(s, keys, &pages).await.iter().enumerate() {
        assert!(
            matches!(o, PageOutcome::Stored | PageOutcome::Present),
            "rule 1: batch_set of a valid {len}-byte page {i} gave {o:?}"
        );
    }
}

async fn set_pages_with<S: Storage + ?Sized>(
    s: &S,
    keys: &[PageKey],
    pages: &[Vec<u8>],
    ctx: BatchContext<'_>,
) -> Vec<PageOutcome> {
    let bufs: Vec<PageBuf<'_>> = pages
        .iter()
        .map(|p| PageBuf::contiguous(LAYOUT, p))
        .collect();
    s.batch_set_with(keys, &bufs, ctx)
        .await
        .unwrap_or_else(|e| panic!("rule 9: batch_set_with of {} pages failed: {e}", keys.len()))
}

/// Reads `keys` as `len`-byte pages; returns outcomes and buffers.
async fn get_pages<S: Storage + ?Sized>(
    s: &S,
    keys: &[PageKey],
    len: usize,
    layout: LayoutKind,
) -> (Vec<PageOutcome>, Vec<Vec<u8>>) {
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    let out = {
        let mut dst: Vec<PageBufMut<'_>> = bufs
            .iter_mut()
            .map(|b| PageBufMut::contiguous(layout, b))
            .collect();
        s.batch_get(keys, &mut dst)
            .await
            .unwrap_or_else(|e| panic!("batch_get of {} pages failed: {e}", keys.len()))
    };
    assert_eq!(out.len(), keys.len(), "rule 5: one outcome per key");
    (out, bufs)
}

/// Asserts every key reads back as its exact pattern page.
async fn assert_hits<S: Storage + ?Sized>(s: &S, keys: &[PageKey], len: usize, what: &str) {
    let (out, bufs) = get_pages(s, keys, len, LAYOUT).await;
    for (i, (o, b)) in out.iter().zip(&bufs).enumerate() {
        assert_eq!(
            *o,
            PageOutcome::Hit,
            "{what}: page {i} of {len} bytes not a hit"
        );
        assert!(
            check_page(&keys[i], b),
            "{what}: page {i} of {len} bytes has wrong bytes"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Cases.

/// Page size classes: sub-sector, odd, 4 KiB, odd 64 KiB, 256 KiB (small Llama page), an MLA
/// DeepSeek-V3 page (4.5 MB), an 8 MiB Llama-3-8B page.
const SIZE_CLASSES: [usize; 7] = [1, 511, 4096, 65_543, 256 << 10, 1152 * 61 * 64, 8 << 20];

async fn round_trip<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let keys: Vec<PageKey> = (0..SIZE_CLASSES.len() as u64).map(|i| key(1, i)).collect();
    let pages: Vec<Vec<u8>> = keys
        .iter()
        .zip(SIZE_CLASSES)
        .map(|(k, n)| page_bytes(k, n))
        .collect();
    // Contiguous write, one batch of every class.
    let out = set_pages(&*s, &keys, &pages).await;
    assert!(
        out.iter().all(|o| *o == PageOutcome::Stored),
        "rule 1: a fresh batch of valid pages must be Stored, got {out:?}"
    );
    for (i, (k, n)) in keys.iter().zip(SIZE_CLASSES).enumerate() {
        let (o, b) = get_pages(&*s, &[*k], n, LAYOUT).await;
        assert_eq!(o[0], PageOutcome::Hit, "size class {n}: not a hit");
        assert_eq!(b[0], pages[i], "size class {n}: bytes differ");
    }
    // Scattered (layer_first-like) write of an 8 MiB page in 64 parts, read back into 3 parts
    // and into one.
    let k = key(1, 100);
    let n = 8 << 20;
    let page = page_bytes(&k, n);
    let parts = PageBuf::from_parts(LayoutKind::LayerFirst, page.chunks(n / 64));
    let out = s
        .batch_set(&[k], &[parts])
        .await
        .expect("scattered batch_set");
    assert_eq!(
        out,
        vec![PageOutcome::Stored],
        "scattered page must be Stored"
    );
    let mut back = vec![0u8; n];
    {
        let (a, rest) = back.split_at_mut(1000);
        let (b, c) = rest.split_at_mut(n / 2);
        let mut dst = [PageBufMut::from_parts(LayoutKind::LayerFirst, [a, b, c])];
        let out = s.batch_get(&[k], &mut dst).await.expect("scattered get");
        assert_eq!(out, vec![PageOutcome::Hit], "scattered page must be a hit");
    }
    assert!(
        back == page,
        "a page written from 64 parts must read back exactly into 3 parts"
    );
    let (o, b) = get_pages(&*s, &[k], n, LayoutKind::LayerFirst).await;
    assert!(
        o[0] == PageOutcome::Hit && b[0] == page,
        "and into one part"
    );
}

async fn exists_leading_run<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let keys: Vec<PageKey> = (0..10).map(|i| key(2, i)).collect();
    set_ok(&*s, &keys[..5], 4096).await;
    set_ok(&*s, &keys[6..7], 4096).await;
    let q = |ks: Vec<PageKey>| {
        let s = s.clone();
        async move { s.batch_exists(&ks).await.expect("batch_exists") }
    };
    assert_eq!(
        q(keys.clone()).await,
        5,
        "rule 4: leading run of 0..5 present, 5 absent"
    );
    assert_eq!(q(keys[..5].to_vec()).await, 5, "rule 4: all present");
    assert_eq!(
        q(vec![keys[5], keys[0]]).await,
        0,
        "rule 4: first absent gives 0"
    );
    assert_eq!(
        q(vec![keys[6], keys[0], keys[5]]).await,
        2,
        "rule 4: out-of-order run"
    );
    assert_eq!(q(vec![]).await, 0, "rule 4: empty batch");
}

async fn mixed_outcomes<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let k: Vec<PageKey> = (0..5).map(|i| key(3, i)).collect();
    set_ok(&*s, &[k[0], k[2], k[3]], 8192).await;
    let mut bufs = [
        vec![0u8; 8192],
        vec![0u8; 8192],
        vec![0u8; 4096],
        vec![0u8; 8192],
        vec![0u8; 8192],
    ];
    let out = {
        let mut dst: Vec<PageBufMut<'_>> = bufs
            .iter_mut()
            .map(|b| PageBufMut::contiguous(LAYOUT, b))
            .collect();
        s.batch_get(&k, &mut dst).await.expect("mixed batch_get")
    };
    use PageOutcome::{Hit, Miss};
    assert_eq!(
        out,
        vec![Hit, Miss, Miss, Hit, Miss],
        "rule 5: [present, absent, wrong length, present, absent]"
    );
    assert!(check_page(&k[0], &bufs[0]) && check_page(&k[3], &bufs[3]));
    // Mixed set: valid, empty, valid.
    let ks = [key(3, 10), key(3, 11), key(3, 12)];
    let a = page_bytes(&ks[0], 4096);
    let c = page_bytes(&ks[2], 4096);
    let src = [
        PageBuf::contiguous(LAYOUT, &a),
        PageBuf::contiguous(LAYOUT, &[]),
        PageBuf::contiguous(LAYOUT, &c),
    ];
    let out = s.batch_set(&ks, &src).await.expect("mixed batch_set");
    assert_eq!(
        out,
        vec![
            PageOutcome::Stored,
            PageOutcome::Failed(PageError::EmptyPage),
            PageOutcome::Stored
        ],
        "rule 5: an empty page fails alone"
    );
    assert_hits(&*s, &[ks[0], ks[2]], 4096, "pages beside a failed one").await;
    assert_eq!(
        s.batch_exists(&ks[1..2]).await.unwrap(),
        0,
        "failed page absent"
    );
}

async fn idempotent_set<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let ks: Vec<PageKey> = (0..4).map(|i| key(4, i)).collect();
    set_ok(&*s, &ks, 65_536).await;
    let before = s.stats();
    set_ok(&*s, &ks, 65_536).await;
    set_ok(&*s, &ks[1..3], 65_536).await;
    let after = s.stats();
    assert_eq!(
        after.pages, before.pages,
        "rule 6: re-setting present pages adds none"
    );
    assert_eq!(
        after.bytes, before.bytes,
        "rule 6: re-setting present pages adds no bytes"
    );
    assert_hits(&*s, &ks, 65_536, "rule 6: after repeated sets").await;
}

async fn overwrite<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let k = key(5, 0);
    let a = page_bytes(&key(5, 1000), 16_384);
    let b = page_bytes(&key(5, 2000), 16_384);
    assert!(set_pages(&*s, &[k], std::slice::from_ref(&a)).await[0].is_ok());
    assert!(set_pages(&*s, &[k], std::slice::from_ref(&b)).await[0].is_ok());
    let (o, got) = get_pages(&*s, &[k], 16_384, LAYOUT).await;
    assert_eq!(
        o[0],
        PageOutcome::Hit,
        "rule 6: re-set page must be readable"
    );
    assert!(
        got[0] == a || got[0] == b,
        "rule 6: a re-set page reads as one whole version"
    );
    // New metadata (length) replaces the page.
    let c = page_bytes(&key(5, 3000), 32_768);
    assert_eq!(
        set_pages(&*s, &[k], std::slice::from_ref(&c)).await[0],
        PageOutcome::Stored,
        "rule 6: a set with a new length must be Stored"
    );
    let (o, got) = get_pages(&*s, &[k], 32_768, LAYOUT).await;
    assert!(
        o[0] == PageOutcome::Hit && got[0] == c,
        "rule 6: the new version replaces the old"
    );
    let (o, _) = get_pages(&*s, &[k], 16_384, LAYOUT).await;
    assert_eq!(
        o[0],
        PageOutcome::Miss,
        "rule 3: the old length no longer matches"
    );
    // New layout too.
    let d = page_bytes(&key(5, 4000), 32_768);
    let out = s
        .batch_set(&[k], &[PageBuf::contiguous(LayoutKind::LayerFirst, &d)])
        .await
        .unwrap();
    assert_eq!(
        out[0],
        PageOutcome::Stored,
        "rule 6: a set with a new layout must be Stored"
    );
    let (o, got) = get_pages(&*s, &[k], 32_768, LayoutKind::LayerFirst).await;
    assert!(
        o[0] == PageOutcome::Hit && got[0] == d,
        "rule 6: new layout replaces"
    );
    assert_eq!(s.stats().pages, 1, "one key, one page");
}

async fn concurrency<H: Harness>(h: &H) {
    const TASKS: u64 = 16;
    const ROUNDS: u64 = 6;
    const KEYS: u64 = 48;
    const LEN: usize = 32 << 10;
    let s = open(h, None).await;
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let mut hits = 0u64;
            for r in 0..ROUNDS {
                // Overlapping writers: each task writes 8 keys of a shared pool of 48.
                let ks: Vec<PageKey> = (0..8).map(|j| key(6, (t * 5 + r * 3 + j) % KEYS)).collect();
                set_ok(&*s, &ks, LEN).await;
                // Readers of keys other tasks may be writing right now.
                let rs: Vec<PageKey> = (0..8)
                    .map(|j| key(6, (t * 7 + r * 11 + j * 5) % KEYS))
                    .collect();
                let (out, bufs) = get_pages(&*s, &rs, LEN, LAYOUT).await;
                for (i, o) in out.iter().enumerate() {
                    match o {
                        PageOutcome::Hit => {
                            assert!(
                                check_page(&rs[i], &bufs[i]),
                                "rule 8: a concurrent hit has wrong bytes"
                            );
                            hits += 1;
                        }
                        PageOutcome::Miss => {}
                        other => panic!("rule 8: concurrent read gave {other:?}"),
                    }
                }
                // Own writes are visible to oneself.
                assert_eq!(
                    s.batch_exists(&ks).await.unwrap(),
                    ks.len(),
                    "rule 1: own writes visible"
                );
            }
            hits
        }));
    }
    let mut hits = 0;
    for t in tasks {
        hits += t.await.expect("a conformance task panicked");
    }
    assert!(
        hits > 0,
        "concurrent readers found none of the written pages"
    );
    let all: Vec<PageKey> = (0..KEYS).map(|i| key(6, i)).collect();
    let n = s.batch_exists(&all).await.unwrap();
    assert_eq!(
        n as u64, KEYS,
        "every key of the pool was written by some task"
    );
    assert_hits(&*s, &all, LEN, "after concurrent writers").await;
}

async fn capacity_eviction<H: Harness>(h: &H) {
    const LEN: usize = 64 << 10;
    let capacity = 16 * LEN as u64;
    let s = open(h, Some(capacity)).await;
    for b in 0..8u64 {
        let ks: Vec<PageKey> = (0..8).map(|j| key(7, b * 8 + j)).collect();
        set_ok(&*s, &ks, LEN).await;
        let st = s.stats();
        assert!(
            st.bytes <= capacity,
            "rule 7: {} bytes stored over a capacity of {capacity}",
            st.bytes
        );
        assert_eq!(
            s.batch_exists(&ks).await.unwrap(),
            8,
            "rule 7: the batch just written must be present (eviction must take older pages)"
        );
        assert_hits(&*s, &ks, LEN, "rule 7: newest batch").await;
    }
    let st = s.stats();
    assert!(
        st.evicted_pages >= 48,
        "rule 7: 64 pages through 16 slots evict ≥ 48, counted {}",
        st.evicted_pages
    );
    assert!(
        st.pages <= 16,
        "rule 7: at most 16 pages fit, {} stored",
        st.pages
    );
    let all: Vec<PageKey> = (0..64).map(|i| key(7, i)).collect();
    let (out, bufs) = get_pages(&*s, &all, LEN, LAYOUT).await;
    let mut present = 0;
    for (i, o) in out.iter().enumerate() {
        if *o == PageOutcome::Hit {
            assert!(
                check_page(&all[i], &bufs[i]),
                "rule 7: survivor {i} has wrong bytes"
            );
            present += 1;
        } else {
            assert_eq!(
                *o,
                PageOutcome::Miss,
                "rule 7: an evicted page is a plain miss"
            );
        }
    }
    assert!((8..=16).contains(&present), "rule 7: {present} survivors");
    // A page larger than the whole capacity fails alone.
    let big = key(7, 1000);
    let out = set_pages(
        &*s,
        &[big, key(7, 1001)],
        &[
            page_bytes(&big, capacity as usize + 4096),
            page_bytes(&key(7, 1001), LEN),
        ],
    )
    .await;
    assert!(
        matches!(out[0], PageOutcome::Failed(PageError::TooLarge { .. })),
        "rule 7: a page over capacity must fail TooLarge, got {:?}",
        out[0]
    );
    assert_eq!(
        out[1],
        PageOutcome::Stored,
        "rule 5: its neighbour is unaffected"
    );
    assert!(s.stats().bytes <= capacity, "rule 7: still within capacity");
}

async fn batch_limits<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let max = s.info().max_batch;
    assert!(
        max >= crate::STORAGE_BATCH_SIZE,
        "max_batch {max} below the controller's 128"
    );
    let over: Vec<PageKey> = (0..max as u64 + 1).map(|i| key(8, i)).collect();
    let is_too_large = |e: &StorageError| matches!(e, StorageError::BatchTooLarge { len, max: m } if *len == max + 1 && *m == max);
    let e = s
        .batch_exists(&over)
        .await
        .expect_err("rule 5: oversize batch_exists must fail");
    assert!(is_too_large(&e), "rule 5: wrong error {e}");
    let pages: Vec<Vec<u8>> = over.iter().map(|k| page_bytes(k, 512)).collect();
    let bufs: Vec<PageBuf<'_>> = pages
        .iter()
        .map(|p| PageBuf::contiguous(LAYOUT, p))
        .collect();
    let e = s
        .batch_set(&over, &bufs)
        .await
        .expect_err("rule 5: oversize batch_set must fail");
    assert!(is_too_large(&e), "rule 5: wrong error {e}");
    assert_eq!(
        s.batch_exists(&over[..1]).await.unwrap(),
        0,
        "rule 5: a refused batch writes nothing"
    );
    let mut bufs_mut: Vec<Vec<u8>> = over.iter().map(|_| vec![0u8; 512]).collect();
    let mut dst: Vec<PageBufMut<'_>> = bufs_mut
        .iter_mut()
        .map(|b| PageBufMut::contiguous(LAYOUT, b))
        .collect();
    let e = s
        .batch_get(&over, &mut dst)
        .await
        .expect_err("rule 5: oversize batch_get must fail");
    assert!(is_too_large(&e), "rule 5: wrong error {e}");
    drop(dst);
    // Exactly max_batch works (bounded, to keep the test quick for huge limits).
    if max <= 4096 {
        let ks = &over[..max];
        set_ok(&*s, ks, 512).await;
        assert_eq!(
            s.batch_exists(ks).await.unwrap(),
            max,
            "rule 5: a full batch is accepted"
        );
        assert_hits(&*s, ks, 512, "rule 5: full batch").await;
    }
    // Empty batches.
    assert_eq!(
        s.batch_set(&[], &[]).await.unwrap(),
        vec![],
        "empty batch_set"
    );
    assert_eq!(
        s.batch_get(&[], &mut []).await.unwrap(),
        vec![],
        "empty batch_get"
    );
    assert_eq!(s.delete(&[]).await.unwrap(), 0, "empty delete");
}

async fn wrong_lengths<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let ks = [key(9, 0), key(9, 1)];
    set_ok(&*s, &ks, 8192).await;
    let p = page_bytes(&ks[0], 8192);
    let e = s
        .batch_set(&ks, &[PageBuf::contiguous(LAYOUT, &p)])
        .await
        .expect_err("rule 5: 2 keys, 1 buffer must fail");
    assert!(
        matches!(
            e,
            StorageError::LengthMismatch {
                keys: 2,
                buffers: 1,
                ..
            }
        ),
        "{e}"
    );
    let mut b = vec![0u8; 8192];
    let e = s
        .batch_get(&ks, &mut [PageBufMut::contiguous(LAYOUT, &mut b)])
        .await
        .expect_err("rule 5: 2 keys, 1 destination must fail");
    assert!(
        matches!(
            e,
            StorageError::LengthMismatch {
                keys: 2,
                buffers: 1,
                ..
            }
        ),
        "{e}"
    );
    let before = s.stats().meta_mismatches;
    for len in [8191, 8193, 4096, 16_384] {
        let (o, _) = get_pages(&*s, &ks[..1], len, LAYOUT).await;
        assert_eq!(
            o[0],
            PageOutcome::Miss,
            "rule 3: a {len}-byte destination for an 8192-byte page is a miss"
        );
    }
    let (o, _) = get_pages(&*s, &ks[..1], 8192, LayoutKind::LayerFirst).await;
    assert_eq!(o[0], PageOutcome::Miss, "rule 3: another layout is a miss");
    assert_eq!(
        s.stats().meta_mismatches,
        before + 5,
        "rule 3: each mismatch is counted"
    );
    assert_hits(
        &*s,
        &ks,
        8192,
        "rule 3: mismatched reads leave the page intact",
    )
    .await;
}

async fn corruption<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let ks: Vec<PageKey> = (0..3).map(|i| key(10, i)).collect();
    set_ok(&*s, &ks, 65_536).await;
    let damaged = h
        .corrupt(&s, &ks[1])
        .await
        .unwrap_or_else(|e| panic!("harness could not damage a page: {e}"));
    assert!(damaged, "harness reported the page absent");
    let before = s.stats().get_corrupt;
    let (out, bufs) = get_pages(&*s, &ks, 65_536, LAYOUT).await;
    assert_eq!(out[0], PageOutcome::Hit, "an undamaged neighbour is a hit");
    assert_eq!(
        out[1],
        PageOutcome::Corrupt,
        "rule 2: a damaged page must read as Corrupt, never as a hit"
    );
    assert_eq!(out[2], PageOutcome::Hit, "an undamaged neighbour is a hit");
    assert!(
        check_page(&ks[0], &bufs[0]) && check_page(&ks[2], &bufs[2]),
        "rule 2: the undamaged neighbours of a damaged page read back exactly"
    );
    assert_eq!(
        s.stats().get_corrupt,
        before + 1,
        "rule 2: corruption is counted"
    );
    let (o, _) = get_pages(&*s, &ks[1..2], 65_536, LAYOUT).await;
    assert_eq!(
        o[0],
        PageOutcome::Miss,
        "rule 2: the damaged copy is dropped"
    );
    assert_eq!(
        s.batch_exists(&ks).await.unwrap(),
        1,
        "rule 2: dropped page no longer exists"
    );
    set_ok(&*s, &ks[1..2], 65_536).await;
    assert_hits(&*s, &ks, 65_536, "a dropped page can be stored again").await;
}

async fn namespace_isolation<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let a = key(11, 0);
    let b = PageKey::new(namespace(12), a.hash);
    set_ok(&*s, &[a], 4096).await;
    assert_eq!(
        s.batch_exists(&[b]).await.unwrap(),
        0,
        "rule 3: same hash, other namespace, absent"
    );
    let (o, _) = get_pages(&*s, &[b], 4096, LAYOUT).await;
    assert_eq!(o[0], PageOutcome::Miss, "rule 3: other namespace is a miss");
    set_ok(&*s, &[b], 4096).await;
    assert_hits(
        &*s,
        &[a, b],
        4096,
        "rule 3: each namespace reads its own page",
    )
    .await;
    assert_eq!(s.delete(&[b]).await.unwrap(), 1);
    assert_hits(
        &*s,
        &[a],
        4096,
        "rule 3: deleting in one namespace leaves the other",
    )
    .await;
}

async fn delete<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let ks: Vec<PageKey> = (0..4).map(|i| key(13, i)).collect();
    set_ok(&*s, &ks, 4096).await;
    let before = s.stats();
    let n = s
        .delete(&[ks[1], ks[3], key(13, 99)])
        .await
        .expect("delete");
    assert_eq!(n, 2, "delete counts the pages it removed");
    assert_eq!(
        s.batch_exists(&ks).await.unwrap(),
        1,
        "deleted page 1 ends the run"
    );
    let (o, _) = get_pages(&*s, &ks, 4096, LAYOUT).await;
    use PageOutcome::{Hit, Miss};
    assert_eq!(
        o,
        vec![Hit, Miss, Hit, Miss],
        "exactly the deleted pages miss"
    );
    let after = s.stats();
    assert_eq!(
        after.deleted_pages,
        before.deleted_pages + 2,
        "deletes are counted"
    );
    assert_eq!(
        after.pages + 2,
        before.pages,
        "deleted pages leave the occupancy"
    );
    assert_eq!(
        after.bytes + 2 * 4096,
        before.bytes,
        "deleted bytes leave the occupancy"
    );
    assert_eq!(
        s.delete(&[ks[1]]).await.unwrap(),
        0,
        "deleting again removes nothing"
    );
}

async fn stats<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let st0 = s.stats();
    let ks: Vec<PageKey> = (0..3).map(|i| key(14, i)).collect();
    set_ok(&*s, &ks[..2], 4096).await;
    let _ = get_pages(&*s, &ks, 4096, LAYOUT).await;
    let _ = s.batch_exists(&ks).await.unwrap();
    let st = s.stats();
    assert_eq!(st.set_pages - st0.set_pages, 2, "set_pages");
    assert_eq!(st.set_stored - st0.set_stored, 2, "set_stored");
    assert_eq!(st.set_bytes - st0.set_bytes, 8192, "set_bytes");
    assert_eq!(st.get_pages - st0.get_pages, 3, "get_pages");
    assert_eq!(st.get_hits - st0.get_hits, 2, "get_hits");
    assert_eq!(st.get_misses - st0.get_misses, 1, "get_misses");
    assert_eq!(st.get_bytes - st0.get_bytes, 8192, "get_bytes");
    assert_eq!(st.exists_calls - st0.exists_calls, 1, "exists_calls");
    assert_eq!(st.exists_hits - st0.exists_hits, 2, "exists_hits");
    assert_eq!(st.pages, 2, "pages");
    assert_eq!(st.bytes, 8192, "bytes");
}

async fn clear<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let a: Vec<PageKey> = (0..5).map(|i| key(16, i)).collect();
    let b: Vec<PageKey> = (0..3).map(|i| key(17, i)).collect();
    // Same hashes as `a` under another namespace: the clear must look at the namespace.
    let b_twins: Vec<PageKey> = a[..2]
        .iter()
        .map(|k| PageKey::new(namespace(17), k.hash))
        .collect();
    set_ok(&*s, &a, 4096).await;
    set_ok(&*s, &b, 4096).await;
    set_ok(&*s, &b_twins, 4096).await;
    if !s.info().clear {
        return clear_unsupported(&*s, &a).await;
    }
    let before = s.stats();
    let n = s.clear(namespace(16)).await.expect("clear");
    assert_eq!(
        n,
        a.len() as u64,
        "rule 10: clear counts the pages it removed"
    );
    assert_eq!(
        s.batch_exists(&a[..1]).await.unwrap(),
        0,
        "rule 10: cleared pages are absent"
    );
    let (o, _) = get_pages(&*s, &a, 4096, LAYOUT).await;
    assert!(
        o.iter().all(|o| *o == PageOutcome::Miss),
        "rule 10: cleared pages read as misses, got {o:?}"
    );
    assert_hits(
        &*s,
        &b,
        4096,
        "rule 10: another namespace's pages survive a clear",
    )
    .await;
    assert_hits(
        &*s,
        &b_twins,
        4096,
        "rule 10: another namespace's pages with the same hashes survive a clear",
    )
    .await;
    let after = s.stats();
    assert_eq!(
        after.cleared_pages,
        before.cleared_pages + a.len() as u64,
        "rule 10: cleared pages are counted"
    );
    assert_eq!(
        after.pages + a.len() as u64,
        before.pages,
        "rule 10: cleared pages leave the occupancy"
    );
    assert_eq!(
        s.clear(namespace(16)).await.expect("second clear"),
        0,
        "rule 10: clearing an empty namespace removes nothing"
    );
    set_ok(&*s, &a[..2], 4096).await;
    assert_hits(
        &*s,
        &a[..2],
        4096,
        "rule 10: a cleared namespace accepts pages again",
    )
    .await;
    if s.info().persistent {
        clear_survives_restart(h, s, &a, &b).await;
    }
}

/// Rule 10 for a backend without the clear capability: `clear` answers `Unsupported` and
/// changes nothing (`a` stays stored).
async fn clear_unsupported<S: Storage + ?Sized>(s: &S, a: &[PageKey]) {
    match s.clear(namespace(16)).await {
        Err(StorageError::Unsupported { op: "clear", .. }) => {}
        other => panic!(
            "rule 10: a backend without the clear capability must answer Unsupported, \
             got {other:?}"
        ),
    }
    assert_hits(s, a, 4096, "rule 10: an unsupported clear changes nothing").await;
}

/// Rule 10 across a restart of a persistent backend: of the cleared namespace's pages `a`,
/// only the first two (set again after the clear) are back; the other namespace's pages `b`
/// survive.
async fn clear_survives_restart<H: Harness>(
    h: &H,
    s: Arc<H::Backend>,
    a: &[PageKey],
    b: &[PageKey],
) {
    let s = h
        .reopen(s)
        .await
        .unwrap_or_else(|e| panic!("reopen failed: {e}"))
        .expect("a persistent backend's harness must implement reopen");
    assert_eq!(
        s.batch_exists(&a[2..]).await.unwrap(),
        0,
        "rule 10: a cleared page stays cleared after a restart"
    );
    assert_hits(
        &*s,
        &a[..2],
        4096,
        "rule 10: pages set after a clear survive a restart",
    )
    .await;
    assert_hits(
        &*s,
        b,
        4096,
        "rule 10: the other namespace survives a restart",
    )
    .await;
}

async fn batch_context<H: Harness>(h: &H) {
    let s = open(h, None).await;
    let _ = h.contexts_seen(&s).await;
    let len = 4096;
    // Pages set with a context (namespace 16) and the same calls without one (namespace 17).
    let prefix: Vec<PageKey> = (0..5).map(|i| key(16, i)).collect();
    let with: Vec<PageKey> = (5..9).map(|i| key(16, i)).collect();
    let plain: Vec<PageKey> = (0..4).map(|i| key(17, i)).collect();
    let ctx = BatchContext::with_prefix_keys(&prefix).extra_info("conformance extra info");
    let at_root = BatchContext::with_prefix_keys(&[]);
    let bytes =
        |ks: &[PageKey]| -> Vec<Vec<u8>> { ks.iter().map(|k| page_bytes(k, len)).collect() };
    let w = set_pages_with(&*s, &with[..3], &bytes(&with[..3]), ctx).await;
    let p = set_pages(&*s, &plain[..3], &bytes(&plain[..3])).await;
    assert_eq!(w, p, "rule 9: batch_set_with answers as batch_set");
    assert!(
        w.iter().all(|o| *o == PageOutcome::Stored),
        "rule 9: fresh pages set with a context must be Stored, got {w:?}"
    );
    let w = set_pages_with(&*s, &with[..3], &bytes(&with[..3]), ctx).await;
    let p = set_pages(&*s, &plain[..3], &bytes(&plain[..3])).await;
    assert_eq!(
        w, p,
        "rule 9: a repeated batch_set_with answers as batch_set"
    );

    for (c, what) in [(ctx, "prefix keys"), (at_root, "an empty prefix")] {
        let n = s
            .batch_exists_with(&with, c)
            .await
            .unwrap_or_else(|e| panic!("batch_exists_with failed: {e}"));
        assert_eq!(
            n, 3,
            "rule 9: batch_exists_with ({what}) must answer the leading run"
        );
    }
    let n = s
        .batch_exists_with(&with, BatchContext::NONE)
        .await
        .unwrap();
    assert_eq!(
        n,
        s.batch_exists(&plain).await.unwrap(),
        "rule 9: no context"
    );

    // Hits, a miss in the middle and out of order, with and without the context.
    let order = [0usize, 3, 2, 1];
    let mut bufs: Vec<Vec<u8>> = order.iter().map(|_| vec![0u8; len]).collect();
    let ks: Vec<PageKey> = order.iter().map(|&i| with[i]).collect();
    let w = {
        let mut dst: Vec<PageBufMut<'_>> = bufs
            .iter_mut()
            .map(|b| PageBufMut::contiguous(LAYOUT, b))
            .collect();
        s.batch_get_with(&ks, &mut dst, ctx)
            .await
            .unwrap_or_else(|e| panic!("batch_get_with failed: {e}"))
    };
    let pks: Vec<PageKey> = order.iter().map(|&i| plain[i]).collect();
    let (p, _) = get_pages(&*s, &pks, len, LAYOUT).await;
    assert_eq!(w, p, "rule 9: batch_get_with answers as batch_get");
    for (i, o) in w.iter().enumerate() {
        if *o == PageOutcome::Hit {
            assert!(
                check_page(&ks[i], &bufs[i]),
                "rule 9: page {i} read with a context has wrong bytes"
            );
        }
    }
    assert_eq!(
        w.iter().filter(|o| o.is_hit()).count(),
        3,
        "rule 9: the three stored pages are hits"
    );

    if let Some(seen) = h.contexts_seen(&s).await {
        let given = |op, keys: &[PageKey], c: BatchContext<'_>| SeenContext {
            op,
            keys: keys.to_vec(),
            prefix_keys: c.prefix_keys.map(<[PageKey]>::to_vec),
            extra_info: c.extra_info.map(str::to_owned),
        };
        let expected = vec![
            given("batch_set", &with[..3], ctx),
            given("batch_set", &with[..3], ctx),
            given("batch_exists", &with, ctx),
            given("batch_exists", &with, at_root),
            given("batch_get", &ks, ctx),
        ];
        assert_eq!(
            seen, expected,
            "rule 9: the backend must receive each context as the caller gave it"
        );
    }
}

async fn restart<H: Harness>(h: &H) -> CaseOutcome {
    let s = open(h, None).await;
    if !s.info().persistent {
        return CaseOutcome::NotApplicable(
            "the backend does not persist (BackendInfo::persistent)",
        );
    }
    let ks: Vec<PageKey> = (0..6).map(|i| key(15, i)).collect();
    set_ok(&*s, &ks[..3], 4096).await;
    set_ok(&*s, &ks[3..], 300_000).await;
    assert_eq!(s.delete(&ks[1..2]).await.unwrap(), 1);
    let before = s.stats();
    let s = h
        .reopen(s)
        .await
        .unwrap_or_else(|e| panic!("reopen failed: {e}"))
        .expect("a persistent backend's harness must implement reopen");
    let after = s.stats();
    assert_eq!(after.pages, before.pages, "restart: page count restored");
    assert_eq!(
        after.bytes, before.bytes,
        "restart: byte accounting restored"
    );
    assert_hits(&*s, &[ks[0], ks[2]], 4096, "restart: committed small pages").await;
    assert_hits(&*s, &ks[3..], 300_000, "restart: committed large pages").await;
    assert_eq!(
        s.batch_exists(&ks[1..2]).await.unwrap(),
        0,
        "restart: a deleted page stays deleted"
    );
    CaseOutcome::Checked
}
