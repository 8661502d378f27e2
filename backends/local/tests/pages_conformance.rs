//! The conformance suite on the file backend, in its main configurations, on both I/O
//! engines (the default `auto` picks io_uring where the kernel has it, as it does here).

#[path = "pages_common/mod.rs"]
mod common;

use common::FileHarness;
use hicache_backend_local::pages::{DirectIo, FsyncPolicy, IoEngine};

// Default: O_DIRECT where possible, fsync per batch, io_uring.
hicache_storage::conformance_tests!(
    direct_batch,
    FileHarness::new(|o| o.io_engine = IoEngine::Uring)
);

// Buffered I/O, fsync of every page, io_uring (small ring: pages wait for slots).
hicache_storage::conformance_tests!(
    buffered_always,
    FileHarness::new(|o| {
        o.io_engine = IoEngine::Uring;
        o.queue_depth = 3;
        o.direct_io = DirectIo::Off;
        o.fsync = FsyncPolicy::Always;
    })
);

// Shared-directory mode, no fsync, io_uring.
hicache_storage::conformance_tests!(
    shared_none,
    FileHarness::new(|o| {
        o.io_engine = IoEngine::Uring;
        o.shared = true;
        o.fsync = FsyncPolicy::None;
    })
);

// The threads engine (the fallback where io_uring is unavailable): O_DIRECT + batch.
hicache_storage::conformance_tests!(
    threads_direct_batch,
    FileHarness::new(|o| o.io_engine = IoEngine::Threads)
);

// The threads engine, shared mode, fsync of every page.
hicache_storage::conformance_tests!(
    threads_shared_always,
    FileHarness::new(|o| {
        o.io_engine = IoEngine::Threads;
        o.shared = true;
        o.fsync = FsyncPolicy::Always;
    })
);
