//! Power loss, not just SIGKILL: every write, sync, create, rename and unlink the file layout
//! issues is recorded (`hicache_localio::journal`), and crash states a file system may legally
//! leave after any prefix of them (unsynced writes dropped or torn per 4096-byte block,
//! unsynced directory operations undone) are recovered and read back. Under every policy
//! that claims durability, and with concurrent batches (group commit), every acknowledged
//! page is intact and none reads back wrong; `fsync: none` is shown to lose pages.

mod common;

use std::path::Path;
use std::sync::Mutex;

use common::test_dir;
use hicache_backend_file::{FileBackend, FileOptions, FsyncPolicy};
use hicache_localio::testing::power_loss::{Recorded, check, record};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// The journal is process-wide: one recording at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const PAGE: usize = 16 << 10;

fn opener(fsync: FsyncPolicy) -> impl Fn(&Path) -> hicache_storage::Result<FileBackend> {
    move |d: &Path| {
        let mut o = FileOptions::new(d);
        o.capacity_bytes = Some(64 << 20);
        o.fsync = fsync;
        o.io_threads = 4;
        o.queue_depth = 8;
        FileBackend::open(o)
    }
}

fn recorded(fsync: FsyncPolicy, inflight: usize) -> (tempfile::TempDir, Recorded) {
    let d = test_dir();
    let rec = record(d.path(), &opener(fsync), PAGE, 4, 4, inflight);
    assert!(
        !rec.journal
            .acked_before(rec.journal.events.len())
            .is_empty(),
        "the workload acknowledged nothing"
    );
    (d, rec)
}

/// A small deterministic generator of the crash state's choices.
fn chooser(mut seed: u64) -> impl FnMut(u32) -> u32 {
    move |n| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % n as u64) as u32
    }
}

fn durable_policy_survives(fsync: FsyncPolicy, inflight: usize) {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let (_d, rec) = recorded(fsync, inflight);
    let n = rec.journal.events.len();
    let open = opener(fsync);
    let mut runner = TestRunner::new(Config {
        cases: 40,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&(0..=n, any::<u64>()), |(k, seed)| {
            let into = test_dir();
            let o = check(&rec, k, &mut chooser(seed | 1), into.path(), &open);
            prop_assert_eq!(o.lost, 0, "crash after {} of {} events: {:?}", k, n, o);
            prop_assert_eq!(o.wrong, 0, "crash after {} of {} events: {:?}", k, n, o);
            Ok(())
        })
        .unwrap();
    // The harshest state after everything: every unsynced choice against us.
    let into = test_dir();
    let o = check(&rec, n, &mut |_| 0, into.path(), &open);
    assert_eq!((o.lost, o.wrong), (0, 0), "{o:?}");
    assert_eq!(o.acked, 16, "every batch was acknowledged");
}

#[test]
fn batch_policy_survives_power_loss() {
    durable_policy_survives(FsyncPolicy::Batch, 1);
}

#[test]
fn always_policy_survives_power_loss() {
    durable_policy_survives(FsyncPolicy::Always, 1);
}

#[test]
fn group_commit_survives_power_loss() {
    durable_policy_survives(FsyncPolicy::Batch, 3);
}

#[test]
fn fsync_none_loses_acknowledged_pages_at_a_power_loss() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let (_d, rec) = recorded(FsyncPolicy::None, 2);
    let n = rec.journal.events.len();
    let into = test_dir();
    let o = check(&rec, n, &mut |_| 0, into.path(), &opener(FsyncPolicy::None));
    assert_eq!(o.acked, 16);
    assert!(
        o.lost > 0,
        "fsync none kept every page through a power loss: {o:?}"
    );
    assert_eq!(o.wrong, 0, "lost, never wrong: {o:?}");
}
