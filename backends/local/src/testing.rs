//! The shared test harness of the local layouts (feature `test-util`): a conformance
//! [`Harness`] that opens a layout in fresh directories under a given base (on a real disk,
//! so O_DIRECT alignment is exercised; tmpfs would accept anything), and the fault helpers
//! the layouts' tests share.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hicache_storage::conformance::Harness;
use hicache_storage::{PageKey, Result, Storage, StorageError, async_trait};
use parking_lot::Mutex;
use tempfile::TempDir;

/// A fresh directory under `base` (tests pass their `CARGO_TARGET_TMPDIR`).
pub fn test_dir_in(base: impl AsRef<Path>) -> TempDir {
    tempfile::tempdir_in(base).expect("a temp dir under the base")
}

/// Flips one byte (xor `0x5a`) of the file at `path` at `offset`, and syncs it. Returns
/// `Ok(false)` if the file does not exist.
pub fn flip_byte(path: &Path, offset: u64) -> io::Result<bool> {
    let f = match OpenOptions::new().read(true).write(true).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset)?;
    b[0] ^= 0x5a;
    f.write_all_at(&b, offset)?;
    f.sync_all()?;
    Ok(true)
}

/// How a [`LocalHarness`] handles one layout `B` with options `O`.
#[derive(Clone, Copy)]
pub struct LayoutOps<B, O> {
    /// Test options for a directory and a capacity (`None`: the layout's test default).
    pub options: fn(&Path, Option<u64>) -> O,
    /// Opens (or reopens) the layout.
    pub open: fn(O) -> Result<B>,
    /// The options an open layout was opened with.
    pub options_of: fn(&B) -> O,
    /// Damages `key`'s stored bytes behind the layout's back (`Ok(false)`: absent).
    pub corrupt: fn(&B, &PageKey) -> io::Result<bool>,
}

/// Opens a local layout in fresh directories with options adjusted by a tweak.
pub struct LocalHarness<B, O> {
    base: PathBuf,
    dirs: Mutex<Vec<TempDir>>,
    ops: LayoutOps<B, O>,
    tweak: fn(&mut O),
}

impl<B, O> LocalHarness<B, O> {
    /// A harness making its directories under `base`.
    pub fn new(base: impl Into<PathBuf>, ops: LayoutOps<B, O>, tweak: fn(&mut O)) -> Self {
        Self {
            base: base.into(),
            dirs: Mutex::new(Vec::new()),
            ops,
            tweak,
        }
    }
}

#[async_trait]
impl<B, O> Harness for LocalHarness<B, O>
where
    B: Storage,
    O: Send + Sync + 'static,
{
    type Backend = B;

    async fn open(&self, capacity_bytes: Option<u64>) -> Result<Arc<B>> {
        let dir = test_dir_in(&self.base);
        let mut o = (self.ops.options)(dir.path(), capacity_bytes);
        (self.tweak)(&mut o);
        self.dirs.lock().push(dir);
        Ok(Arc::new((self.ops.open)(o)?))
    }

    async fn corrupt(&self, backend: &B, key: &PageKey) -> Result<bool> {
        (self.ops.corrupt)(backend, key).map_err(StorageError::io("corrupt", "page"))
    }

    async fn reopen(&self, backend: Arc<B>) -> Result<Option<Arc<B>>> {
        let opts = (self.ops.options_of)(&backend);
        drop(backend);
        Ok(Some(Arc::new((self.ops.open)(opts)?)))
    }
}

/// Writes `ks` from `region` (`len` bytes a page; page 3, if any, as `LayerFirst` in 64
/// parts) and reads them back into `back` (page 3 in `read_parts` parts), asserting every
/// outcome and every page's bytes. With `region` and `back` in an aligned mapping this is
/// the zero-copy path; inside a registered region, the fixed-buffer path.
pub async fn round_trip_in<S: Storage + ?Sized>(
    s: &S,
    ks: &[PageKey],
    region: &mut [u8],
    back: &mut [u8],
    len: usize,
    read_parts: usize,
) {
    use hicache_storage::pattern::{check_page, fill_page};
    use hicache_storage::{LayoutKind, PageBuf, PageBufMut, PageOutcome};
    const L: LayoutKind = LayoutKind::PageFirst;
    for (k, c) in ks.iter().zip(region.chunks_mut(len)) {
        fill_page(k, c);
    }
    let srcs: Vec<PageBuf<'_>> = region
        .chunks(len)
        .enumerate()
        .map(|(i, c)| match i {
            3 => PageBuf::from_parts(LayoutKind::LayerFirst, c.chunks(len / 64)),
            _ => PageBuf::contiguous(L, c),
        })
        .collect();
    let out = s.batch_set(ks, &srcs).await.unwrap();
    assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
    let mut dst: Vec<PageBufMut<'_>> = back
        .chunks_mut(len)
        .enumerate()
        .map(|(i, c)| match i {
            3 => PageBufMut::from_parts(LayoutKind::LayerFirst, c.chunks_mut(len / read_parts)),
            _ => PageBufMut::contiguous(L, c),
        })
        .collect();
    let out = s.batch_get(ks, &mut dst).await.unwrap();
    assert!(out.iter().all(|o| *o == PageOutcome::Hit), "{out:?}");
    drop(dst);
    for (k, c) in ks.iter().zip(back.chunks(len)) {
        assert!(check_page(k, c), "{k}");
    }
}

/// The power-loss suite: a workload of concurrent batches recorded by the
/// [`journal`](crate::io::journal), then crash states recovered and checked.
pub mod power_loss {
    use std::collections::BTreeMap;
    use std::path::Path;

    use hicache_storage::{
        LayoutKind, PageBuf, PageBufMut, PageKey, PageOutcome, Result, Storage, pattern,
    };

    use crate::io::journal::{self, Journal};

    /// The journal is process-wide: one recording (and its checks) at a time.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Batches and pages per batch of the suite's workload.
    const BATCHES: usize = 4;
    const PER_BATCH: usize = 4;

    /// A small deterministic generator of a crash state's choices (xorshift from `seed`), for
    /// [`Journal::crash_state`]-style callers that pick among `n` options.
    pub fn chooser(mut seed: u64) -> impl FnMut(u32) -> u32 {
        seed |= 1;
        move |n| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % u64::from(n)) as u32
        }
    }

    /// The suite for a policy that claims durability: a workload of `inflight` concurrent
    /// batches recorded, then `cases` random crash states (proptest: crash point and choices)
    /// and the harshest state after everything (every open choice against the layout) are
    /// recovered; every acknowledged page must be intact and none wrong. `open` opens the
    /// layout with the policy under test in a directory; directories are made under `base`.
    pub fn assert_durable<B: Storage>(
        base: &Path,
        open: &dyn Fn(&Path) -> Result<B>,
        page_bytes: usize,
        inflight: usize,
        cases: u32,
    ) {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, TestRunner};
        let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let d = super::test_dir_in(base);
        let rec = record(d.path(), open, page_bytes, BATCHES, PER_BATCH, inflight);
        let n = rec.journal.events.len();
        assert_eq!(
            rec.journal.acked_before(n).len(),
            BATCHES,
            "the workload was not acknowledged"
        );
        let mut runner = TestRunner::new(Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        });
        runner
            .run(&(0..=n, any::<u64>()), |(k, seed)| {
                let into = super::test_dir_in(base);
                let o = check(&rec, k, &mut chooser(seed), into.path(), open);
                prop_assert_eq!(o.lost, 0, "crash after {} of {} events: {:?}", k, n, o);
                prop_assert_eq!(o.wrong, 0, "crash after {} of {} events: {:?}", k, n, o);
                Ok(())
            })
            .unwrap();
        let into = super::test_dir_in(base);
        let o = check(&rec, n, &mut |_| 0, into.path(), open);
        assert_eq!((o.lost, o.wrong), (0, 0), "the harshest state: {o:?}");
        assert_eq!(o.acked, BATCHES * PER_BATCH);
    }

    /// For a policy that does not claim durability: the harshest crash state after the whole
    /// workload loses acknowledged pages (and still returns none wrong).
    pub fn assert_loses_pages<B: Storage>(
        base: &Path,
        open: &dyn Fn(&Path) -> Result<B>,
        page_bytes: usize,
    ) {
        let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let d = super::test_dir_in(base);
        let rec = record(d.path(), open, page_bytes, BATCHES, PER_BATCH, 2);
        let into = super::test_dir_in(base);
        let o = check(
            &rec,
            rec.journal.events.len(),
            &mut |_| 0,
            into.path(),
            open,
        );
        assert_eq!(o.acked, BATCHES * PER_BATCH);
        assert!(o.lost > 0, "every page survived a power loss: {o:?}");
        assert_eq!(o.wrong, 0, "lost, never wrong: {o:?}");
    }

    /// A recorded workload: the journal and the keys of each batch (its tag is its index).
    pub struct Recorded {
        /// What the layout issued.
        pub journal: Journal,
        /// Keys per batch.
        pub batches: Vec<Vec<PageKey>>,
        /// Bytes per page.
        pub page_bytes: usize,
    }

    /// What one crash state recovered to.
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    pub struct Outcome {
        /// Acknowledged pages checked.
        pub acked: usize,
        /// Acknowledged pages not read back intact.
        pub lost: usize,
        /// Pages read back as hits with wrong bytes.
        pub wrong: usize,
    }

    fn keys(seed: u64, batch: usize, n: usize) -> Vec<PageKey> {
        (0..n as u64)
            .map(|i| pattern::page_key(pattern::namespace(7), seed, (batch * n) as u64 + i))
            .collect()
    }

    /// Opens the layout in `dir` (already populated by `open`'s first call is fine), starts
    /// the journal, writes `batches` batches of `per_batch` pages with `inflight` of them at
    /// once, marking each acknowledgement, and returns the recording.
    pub fn record<B: Storage>(
        dir: &Path,
        open: &dyn Fn(&Path) -> Result<B>,
        page_bytes: usize,
        batches: usize,
        per_batch: usize,
        inflight: usize,
    ) -> Recorded {
        use futures_util::StreamExt;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .build()
            .expect("a runtime");
        let storage = open(dir).expect("the layout opens");
        let all: Vec<Vec<PageKey>> = (0..batches).map(|b| keys(1, b, per_batch)).collect();
        let start = journal::start(dir);
        rt.block_on(async {
            let storage = &storage;
            let all = &all;
            let mut s = futures_util::stream::iter(0..batches)
                .map(|b| async move {
                    let data: Vec<Vec<u8>> = all[b]
                        .iter()
                        .map(|k| pattern::page_bytes(k, page_bytes))
                        .collect();
                    let bufs: Vec<PageBuf<'_>> = data
                        .iter()
                        .map(|d| PageBuf::contiguous(LayoutKind::PageFirst, d))
                        .collect();
                    let out = storage.batch_set(&all[b], &bufs).await.expect("batch_set");
                    if out.iter().all(|o| *o == PageOutcome::Stored) {
                        journal::ack(b as u64);
                    }
                })
                .buffer_unordered(inflight);
            while s.next().await.is_some() {}
        });
        let journal = Journal::finish(start);
        drop(storage);
        Recorded {
            journal,
            batches: all,
            page_bytes,
        }
    }

    /// Builds the crash state after `k` events (choices by `choose`) in the empty directory
    /// `into`, recovers it with `open` and reads every page of the workload back.
    pub fn check<B: Storage>(
        rec: &Recorded,
        k: usize,
        choose: &mut dyn FnMut(u32) -> u32,
        into: &Path,
        open: &dyn Fn(&Path) -> Result<B>,
    ) -> Outcome {
        let state: BTreeMap<_, _> = rec.journal.crash_state(k, choose);
        rec.journal
            .materialize(&state, into)
            .expect("a crash state is written");
        let acked: Vec<u64> = rec.journal.acked_before(k);
        let storage = open(into).expect("a crash state recovers");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let mut out = Outcome::default();
        for (b, keys) in rec.batches.iter().enumerate() {
            let is_acked = acked.contains(&(b as u64));
            let mut back = vec![0u8; keys.len() * rec.page_bytes];
            let res = {
                let mut dst: Vec<PageBufMut<'_>> = back
                    .chunks_mut(rec.page_bytes)
                    .map(|c| PageBufMut::contiguous(LayoutKind::PageFirst, c))
                    .collect();
                rt.block_on(storage.batch_get(keys, &mut dst))
                    .expect("batch_get")
            };
            for ((k, o), c) in keys.iter().zip(&res).zip(back.chunks(rec.page_bytes)) {
                let intact = *o == PageOutcome::Hit && pattern::check_page(k, c);
                if *o == PageOutcome::Hit && !intact {
                    out.wrong += 1;
                }
                if is_acked {
                    out.acked += 1;
                    if !intact {
                        out.lost += 1;
                    }
                }
            }
        }
        out
    }
}

/// The power-loss suite of a local layout as four tests: `batch` and `always` (one batch at
/// a time) and group commit (3 batches in flight) survive every legal crash state checked,
/// `fsync: none` is shown to lose acknowledged pages. `$opener` is a
/// `fn(FsyncPolicy) -> impl Fn(&Path) -> Result<Layout>` opening the layout under a policy;
/// pages are `$page` bytes; `$cases` random crash states per durable configuration (plus the
/// harshest one). Directories are made under the test crate's `CARGO_TARGET_TMPDIR`.
#[macro_export]
macro_rules! power_loss_tests {
    ($opener:path, $page:expr, $cases:expr) => {
        fn power_loss_base() -> &'static ::std::path::Path {
            ::std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        }

        #[test]
        fn batch_policy_survives_power_loss() {
            let open = $opener($crate::io::FsyncPolicy::Batch);
            $crate::testing::power_loss::assert_durable(power_loss_base(), &open, $page, 1, $cases);
        }

        #[test]
        fn always_policy_survives_power_loss() {
            let open = $opener($crate::io::FsyncPolicy::Always);
            $crate::testing::power_loss::assert_durable(power_loss_base(), &open, $page, 1, $cases);
        }

        #[test]
        fn group_commit_survives_power_loss() {
            let open = $opener($crate::io::FsyncPolicy::Batch);
            $crate::testing::power_loss::assert_durable(power_loss_base(), &open, $page, 3, $cases);
        }

        #[test]
        fn fsync_none_loses_acknowledged_pages_at_a_power_loss() {
            let open = $opener($crate::io::FsyncPolicy::None);
            $crate::testing::power_loss::assert_loses_pages(power_loss_base(), &open, $page);
        }
    };
}
