//! Power loss, not just SIGKILL: every write, sync, create, rename and unlink the file layout
//! issues is recorded (`hicache_backend_local::io::journal`), and crash states a file system may legally
//! leave after any prefix of them (unsynced writes dropped or torn per 4096-byte block,
//! unsynced directory operations undone) are recovered and read back. Under every policy
//! that claims durability, and with concurrent batches (group commit), every acknowledged
//! page is intact and none reads back wrong (both `batch_sync` ways of `batch`); `fsync: none`
//! is shown to lose pages.

#[path = "pages_common/mod.rs"]
mod common;

use std::path::Path;

use hicache_backend_local::pages::{BatchSync, FileBackend, FileOptions, FsyncPolicy};

const PAGE: usize = 16 << 10;
/// Random crash states per durable configuration (plus the harshest one).
const CASES: u32 = 40;

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

hicache_backend_local::power_loss_tests!(opener, PAGE, CASES);

/// `batch_sync: per_page` (each page's own `fdatasync`, then directory syncs): the suite's
/// durable cases, one batch at a time and with group commit.
fn per_page_opener(d: &Path) -> hicache_storage::Result<FileBackend> {
    let mut o = FileOptions::new(d);
    o.capacity_bytes = Some(64 << 20);
    o.batch_sync = BatchSync::PerPage;
    o.io_threads = 4;
    o.queue_depth = 8;
    FileBackend::open(o)
}

#[test]
fn per_page_batch_sync_survives_power_loss() {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
    for inflight in [1, 3] {
        hicache_backend_local::testing::power_loss::assert_durable(
            base,
            &per_page_opener,
            PAGE,
            inflight,
            CASES,
        );
    }
}
