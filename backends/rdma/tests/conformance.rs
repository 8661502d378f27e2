//! The storage conformance suite on the rdma backend: an in-process server, TCP transport.

mod common;

hicache_storage::conformance_tests!(tcp, common::RdmaHarness::default(), not_persistent);
