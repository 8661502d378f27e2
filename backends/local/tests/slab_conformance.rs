//! The conformance suite on the uring backend, in its main configurations.

#[path = "slab_common/mod.rs"]
mod common;

use common::UringHarness;
use hicache_backend_local::slab::FsyncPolicy;

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

// The threads engine (`io_engine: "threads"`, what `auto` falls back to where io_uring is
// unavailable): the same suite without the ring.
hicache_storage::conformance_tests!(
    threads_engine,
    UringHarness::new(|o| {
        o.io_engine = hicache_backend_local::io::IoEngine::Threads;
    })
);
