//! Power loss, not just SIGKILL: every write, sync, create, rename and unlink the uring layout
//! issues is recorded (`hicache_backend_local::io::journal`), and crash states a file system may legally
//! leave after any prefix of them (unsynced writes dropped or torn per 4096-byte block,
//! unsynced directory operations undone) are recovered and read back. Under every policy
//! that claims durability, and with concurrent batches (group commit), every acknowledged
//! page is intact and none reads back wrong; `fsync: none` is shown to lose pages.

#[path = "slab_common/mod.rs"]
mod common;

use std::path::Path;

use hicache_backend_local::slab::{FsyncPolicy, UringBackend};

const PAGE: usize = 16 << 10;
/// Random crash states per durable configuration (plus the harshest one).
const CASES: u32 = 40;

fn opener(fsync: FsyncPolicy) -> impl Fn(&Path) -> hicache_storage::Result<UringBackend> {
    move |d: &Path| {
        let mut o = common::test_opts(d);
        o.capacity_bytes = Some(64 << 20);
        o.grow_bytes = 256 << 10;
        o.page_bytes = Some(PAGE as u64);
        o.fsync = fsync;
        UringBackend::open(o)
    }
}

hicache_backend_local::power_loss_tests!(opener, PAGE, CASES);
