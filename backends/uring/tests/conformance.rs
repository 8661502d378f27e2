//! The conformance suite on the uring backend, in its main configurations.

mod common;

use common::UringHarness;
use hicache_backend_uring::FsyncPolicy;

// Default: fixed files, fsync per batch.
hicache_storage::conformance_tests!(batch, UringHarness::new(|_| {}));

// Every page written with RWF_DSYNC, a shallow queue (requests wait for room in the ring).
hicache_storage::conformance_tests!(
    always_shallow,
    UringHarness::new(|o| {
        o.fsync = FsyncPolicy::Always;
        o.queue_depth = 2;
    })
);

// No fsync, no fixed files, FIFO eviction.
hicache_storage::conformance_tests!(
    none_plain_files,
    UringHarness::new(|o| {
        o.fsync = FsyncPolicy::None;
        o.fixed_files = false;
        o.eviction = hicache_storage::EvictionPolicy::Fifo;
    })
);
