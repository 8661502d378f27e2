//! The conformance suite on the file backend, in its main configurations.

mod common;

use common::FileHarness;
use hicache_backend_file::{DirectIo, FsyncPolicy};

// Default: O_DIRECT where possible, fsync per batch.
hicache_storage::conformance_tests!(direct_batch, FileHarness::new(|_| {}));

// Buffered I/O, fsync of every page.
hicache_storage::conformance_tests!(
    buffered_always,
    FileHarness::new(|o| {
        o.direct_io = DirectIo::Off;
        o.fsync = FsyncPolicy::Always;
    })
);

// Shared-directory mode, no fsync.
hicache_storage::conformance_tests!(
    shared_none,
    FileHarness::new(|o| {
        o.shared = true;
        o.fsync = FsyncPolicy::None;
    })
);
