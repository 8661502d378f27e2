//! The conformance suite on the in-memory reference backend.

use std::sync::Arc;

use hicache_storage::conformance::Harness;
use hicache_storage::{MemoryBackend, PageKey, Result, SeenContext, async_trait};

/// Opens fresh memory backends (recording the batch contexts they receive); damages pages
/// through the backend's fault-injection hook.
struct MemoryHarness;

#[async_trait]
impl Harness for MemoryHarness {
    type Backend = MemoryBackend;

    async fn open(&self, capacity_bytes: Option<u64>) -> Result<Arc<MemoryBackend>> {
        let b = MemoryBackend::with_capacity(capacity_bytes.unwrap_or(256 << 20));
        b.contexts().enable(true);
        Ok(Arc::new(b))
    }

    async fn corrupt(&self, backend: &MemoryBackend, key: &PageKey) -> Result<bool> {
        Ok(backend.corrupt_page(key))
    }

    async fn contexts_seen(&self, backend: &MemoryBackend) -> Option<Vec<SeenContext>> {
        Some(backend.contexts().take())
    }
}

hicache_storage::conformance_tests!(MemoryHarness, not_persistent);
