//! `hicache_storage::conformance` through the loader, for both example plugins (and the C one
//! built as if against a newer ABI minor version, whose larger vtable the host reads through
//! the common prefix, and as if against the 1.1 header, without the 1.2 `clear` entry). The
//! Rust example clears (ABI 1.2), so the `clear` case runs its full path across the ABI; the C
//! examples answer Unsupported.
//!
//! The Rust example is a cdylib that `hicache_plugin_tests::rust_plugin` builds with cargo on
//! first use; a build failure fails the tests rather than skipping them.

use hicache_backend_plugin::conformance::PluginHarness;
use hicache_plugin_tests::{c_plugin, rust_plugin};

hicache_storage::conformance_tests!(
    rust_example,
    PluginHarness::new(rust_plugin("hicache-plugin-example")),
    not_persistent
);
hicache_storage::conformance_tests!(
    c_example,
    PluginHarness::new(c_plugin("hicache_c_memory")),
    not_persistent
);
hicache_storage::conformance_tests!(
    c_example_newer_minor,
    PluginHarness::new(c_plugin("hicache_c_memory_next")),
    not_persistent
);
hicache_storage::conformance_tests!(
    c_example_v1_1,
    PluginHarness::new(c_plugin("hicache_c_memory_v1_1")),
    not_persistent
);
