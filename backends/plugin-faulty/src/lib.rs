//! A deliberately faulty storage plugin, for the loader's tests: the in-memory backend, except
//! that the operation named by `plugin_config.panic_in` panics. The test asserts that each
//! panic reaches the host as an error naming the operation and the panic message, and that the
//! host process (and the instance, for the other operations) carries on.
//!
//! `panic_in`: `open`, `info`, `batch_exists`, `batch_get`, `batch_set`, `delete`, `clear`,
//! `stats`, `corrupt`, or absent (no panic).

use std::ffi::CStr;

use async_trait::async_trait;
use hicache_backend_plugin::sdk::{OpenArgs, Plugin};
use hicache_core::{NamespaceId, PageKey};
use hicache_storage::{
    BackendInfo, MemoryBackend, MemoryOptions, PageBuf, PageBufMut, PageOutcome, Result, Storage,
    StorageStats,
};

const OPS: [&str; 9] = [
    "open",
    "info",
    "batch_exists",
    "batch_get",
    "batch_set",
    "delete",
    "clear",
    "stats",
    "corrupt",
];

/// The in-memory backend with one operation that panics.
pub struct Faulty {
    inner: MemoryBackend,
    panic_in: Option<&'static str>,
}

impl Faulty {
    fn maybe_panic(&self, op: &str) {
        if self.panic_in == Some(op) {
            panic!("deliberate panic in {op} (hicache-plugin-faulty)");
        }
    }
}

#[async_trait]
impl Storage for Faulty {
    fn info(&self) -> BackendInfo {
        self.maybe_panic("info");
        self.inner.info()
    }

    async fn batch_exists(&self, keys: &[PageKey]) -> Result<usize> {
        self.maybe_panic("batch_exists");
        self.inner.batch_exists(keys).await
    }

    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> Result<Vec<PageOutcome>> {
        self.maybe_panic("batch_get");
        self.inner.batch_get(keys, dst).await
    }

    async fn batch_set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Result<Vec<PageOutcome>> {
        self.maybe_panic("batch_set");
        self.inner.batch_set(keys, src).await
    }

    async fn delete(&self, keys: &[PageKey]) -> Result<usize> {
        self.maybe_panic("delete");
        self.inner.delete(keys).await
    }

    // Forwarded: the info is the inner backend's, which clears (contract rule 10).
    async fn clear(&self, namespace: NamespaceId) -> Result<u64> {
        self.maybe_panic("clear");
        self.inner.clear(namespace).await
    }

    fn stats(&self) -> StorageStats {
        self.maybe_panic("stats");
        self.inner.stats()
    }
}

/// The plugin.
pub struct FaultyPlugin;

impl Plugin for FaultyPlugin {
    type Backend = Faulty;
    const NAME: &'static CStr = c"hicache-test-faulty";
    const VERSION: &'static CStr = c"0.1.0";
    const TEST_CORRUPT: bool = true;

    async fn open(mut args: OpenArgs) -> Result<Faulty> {
        let panic_in = args.fields.choice("panic_in", "none", &OPS)?;
        let panic_in = (panic_in != "none").then_some(panic_in);
        if panic_in == Some("open") {
            panic!("deliberate panic in open (hicache-plugin-faulty)");
        }
        let inner = MemoryBackend::new(MemoryOptions::from_config(&args.common, args.fields)?);
        Ok(Faulty { inner, panic_in })
    }

    fn corrupt_page(backend: &Faulty, key: &PageKey) -> Result<bool> {
        backend.maybe_panic("corrupt");
        Ok(backend.inner.corrupt_page(key))
    }
}

hicache_backend_plugin::export_plugin!(FaultyPlugin);
