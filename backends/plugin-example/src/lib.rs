//! An example hicache-rs storage plugin written in Rust: `hicache-storage`'s in-memory
//! reference backend, exported through the C ABI with the SDK. Build it with
//! `cargo build -p hicache-plugin-example` and load `target/debug/libhicache_plugin_example.so`:
//!
//! ```json
//! {"backend": "plugin", "plugin_path": "target/debug/libhicache_plugin_example.so",
//!  "capacity": "4GiB", "plugin_config": {"eviction": "lru", "max_batch": 256}}
//! ```
//!
//! `plugin_config` takes the memory backend's own fields (`eviction`, `max_batch`,
//! `record_contexts`); the common `capacity` arrives from the host. Being an SDK plugin it
//! exports the ABI 1.1 batch-context entries and the 1.2 `clear` (the memory backend clears,
//! so it reports `HICACHE_INFO_CLEAR`); with `"record_contexts": true` the backend logs every
//! context it receives (through the host's log callback), which the ABI tests read. It also
//! exports the test-only corruption hook, so it runs the whole conformance suite through the
//! loader.

use std::ffi::CStr;

use hicache_backend_plugin::sdk::{OpenArgs, Plugin};
use hicache_storage::{MemoryBackend, MemoryOptions, PageKey, Result};

/// The plugin: [`MemoryBackend`] behind the ABI.
pub struct MemoryPlugin;

impl Plugin for MemoryPlugin {
    type Backend = MemoryBackend;
    const NAME: &'static CStr = c"hicache-example-memory";
    const VERSION: &'static CStr = c"0.1.0";
    const TEST_CORRUPT: bool = true;

    async fn open(args: OpenArgs) -> Result<MemoryBackend> {
        let options = MemoryOptions::from_config(&args.common, args.fields)?;
        tracing::info!(
            capacity_bytes = options.capacity_bytes,
            max_batch = options.max_batch,
            "example memory plugin opened"
        );
        Ok(MemoryBackend::new(options))
    }

    fn corrupt_page(backend: &MemoryBackend, key: &PageKey) -> Result<bool> {
        Ok(backend.corrupt_page(key))
    }
}

hicache_backend_plugin::export_plugin!(MemoryPlugin);
