//! L3 for the hybrid facade: pages written L1 → L2 → L3 by one cache come back
//! L3 → L2 → L1 in a new cache over the same L3 directory, byte-equal per component (Full
//! pages, SWA pages in the window, the Mamba state); the hit policy decides how far.

mod common;
mod hybrid_common;

use std::path::Path;
use std::sync::Arc;

use hicache::{HybridCache, HybridConfig, StorageConfig};
use hicache_storage::{BackendContext, Storage};
use hybrid_common::{Engine, extended, prompt};

const PS: u32 = 4;

fn file_storage(dir: &Path) -> Arc<dyn Storage> {
    let extra = format!(r#"{{"dir": "{}"}}"#, dir.display());
    let cfg = StorageConfig::parse(Some("file"), Some(&extra)).unwrap();
    let registry = hicache::backends::builtin_registry().unwrap();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(registry.open(&cfg, &BackendContext::default()))
        .unwrap()
}

fn cache(swa: bool, mamba: bool, storage: Arc<dyn Storage>) -> HybridCache {
    let cfg = HybridConfig {
        page_size: PS,
        swa_window: swa.then_some(8),
        mamba_chunk: mamba.then_some(8),
        prefetch_threshold_tokens: 8,
        ..Default::default()
    };
    hybrid_common::builder(cfg, 32)
        .storage(storage)
        .build()
        .unwrap()
}

fn l3_round_trip(swa: bool, mamba: bool) {
    let dir = tempfile::tempdir().unwrap();
    let a = prompt(1, 40);
    {
        let mut e = Engine::new(cache(swa, mamba, file_storage(dir.path())));
        e.turn(&a);
        let t = e.cache.metrics();
        assert_eq!(t.full.pages_l2_to_l3, 10, "{t:?}");
        // Every SWA page backed up to host goes to L3 too.
        assert_eq!(t.swa.pages_l2_to_l3, t.swa.pages_d2h, "{t:?}");
        assert_eq!(t.swa.pages_l2_to_l3 > 0, swa, "{t:?}");
        assert_eq!(t.mamba.pages_l2_to_l3, u64::from(mamba), "{t:?}");
        e.cache.shutdown().unwrap();
    }
    // A new cache (empty L1 and L2) over the same directory.
    let mut e = Engine::new(cache(swa, mamba, file_storage(dir.path())));
    let run = e.run(&extended(&a, 3, 24));
    assert_eq!(run.admission.device_tokens, 0);
    assert_eq!(run.admission.host_tokens, 40, "{run:?}");
    assert_eq!(run.admission.storage_tokens, 40, "{run:?}");
    assert_eq!(run.checked[0], 10, "every Full page checked");
    if swa {
        assert_eq!(run.checked[1], 2, "the window's SWA pages checked");
    }
    assert_eq!(run.checked[2], usize::from(mamba), "the state checked");
    let t = e.cache.metrics();
    assert_eq!(t.full.hit_tokens_l3, 40);
    assert_eq!(t.full.pages_l3_to_l2, 10);
    assert_eq!(t.mamba.pages_l3_to_l2, u64::from(mamba));
    e.settle();
    e.cache.shutdown().unwrap();
}

#[test]
fn full_swa_pages_come_back_from_l3_in_a_new_cache() {
    l3_round_trip(true, false);
}

#[test]
fn full_mamba_pages_come_back_from_l3_in_a_new_cache() {
    l3_round_trip(false, true);
}

#[test]
fn full_swa_mamba_pages_come_back_from_l3_in_a_new_cache() {
    l3_round_trip(true, true);
}

#[test]
fn a_prompt_shorter_than_the_threshold_is_not_prefetched() {
    let dir = tempfile::tempdir().unwrap();
    let a = prompt(1, 8);
    {
        let mut e = Engine::new(cache(true, true, file_storage(dir.path())));
        e.turn(&a);
        e.cache.shutdown().unwrap();
    }
    let mut e = Engine::new(cache(true, true, file_storage(dir.path())));
    let run = e.run(&a);
    assert_eq!(run.admission.cached_tokens(), 0, "{run:?}");
    e.cache.shutdown().unwrap();
}

/// A prefetch of a span below a cached prefix (not from the root), KV events off: the new
/// cache computed the first 16 tokens itself; the rest of the prompt comes from L3.
fn prefetch_below_a_cached_prefix(swa: bool, mamba: bool) {
    let dir = tempfile::tempdir().unwrap();
    let a = prompt(1, 40);
    {
        let mut e = Engine::new(cache(swa, mamba, file_storage(dir.path())));
        e.turn(&a);
        e.cache.shutdown().unwrap();
    }
    let mut e = Engine::new(cache(swa, mamba, file_storage(dir.path())));
    e.turn(&a[..17]);
    let run = e.run(&extended(&a, 3, 24));
    // Before the fix this path panicked (page identities taken from events that were off).
    assert_eq!(run.admission.device_tokens, 16, "{run:?}");
    assert_eq!(run.admission.host_tokens, 24, "{run:?}");
    assert_eq!(run.admission.storage_tokens, 24, "{run:?}");
    assert_eq!(run.checked[0], 10, "every Full page checked");
    e.settle();
    e.assert_no_leaks();
    e.cache.shutdown().unwrap();
}

#[test]
fn full_prefetch_below_a_cached_prefix() {
    prefetch_below_a_cached_prefix(false, false);
}

#[test]
fn full_swa_prefetch_below_a_cached_prefix() {
    prefetch_below_a_cached_prefix(true, false);
}

#[test]
fn full_swa_mamba_prefetch_below_a_cached_prefix() {
    prefetch_below_a_cached_prefix(true, true);
}

/// A backend whose every call fails.
struct Down;

#[hicache_storage::async_trait]
impl Storage for Down {
    fn info(&self) -> hicache_storage::BackendInfo {
        hicache_storage::BackendInfo::new("down", 2)
    }
    async fn batch_exists(&self, _: &[hicache_core::PageKey]) -> hicache_storage::Result<usize> {
        Err(hicache::StorageError::backend("down", "unreachable"))
    }
    async fn batch_get(
        &self,
        _: &[hicache_core::PageKey],
        _: &mut [hicache_storage::PageBufMut<'_>],
    ) -> hicache_storage::Result<Vec<hicache_storage::PageOutcome>> {
        Err(hicache::StorageError::backend("down", "unreachable"))
    }
    async fn batch_set(
        &self,
        _: &[hicache_core::PageKey],
        _: &[hicache_storage::PageBuf<'_>],
    ) -> hicache_storage::Result<Vec<hicache_storage::PageOutcome>> {
        Err(hicache::StorageError::backend("down", "unreachable"))
    }
    async fn delete(&self, _: &[hicache_core::PageKey]) -> hicache_storage::Result<usize> {
        Ok(0)
    }
    fn stats(&self) -> hicache_storage::StorageStats {
        hicache_storage::StorageStats::default()
    }
}

/// A backend that is down: backups fail and are counted per component (the pages stay in
/// L2, the tick goes on), lookups are misses; every request is still served.
#[test]
fn a_down_backend_is_counted_never_an_error() {
    let mut e = Engine::new(cache(true, true, Arc::new(Down)));
    let a = prompt(1, 40);
    e.turn(&a);
    let t = e.cache.metrics();
    assert_eq!(t.full.pages_l2_to_l3, 0, "{t:?}");
    assert_eq!(t.full.l3_failed_write_pages, t.full.pages_d2h, "{t:?}");
    assert!(t.full.l3_failed_write_pages > 0, "{t:?}");
    assert_eq!(t.swa.l3_failed_write_pages, t.swa.pages_d2h, "{t:?}");
    assert_eq!(t.mamba.l3_failed_write_pages, t.mamba.pages_d2h, "{t:?}");
    let text = e.cache.render_metrics();
    assert!(
        text.contains(r#"hicache_hybrid_l3_failed_pages_total{component="full",op="write"}"#),
        "{text}"
    );
    // An unrelated prompt: its lookup fails, it is computed.
    let run = e.run(&prompt(2, 40));
    assert_eq!(run.admission.cached_tokens(), 0, "{run:?}");
    e.settle();
    e.assert_no_leaks();
    e.cache.shutdown().unwrap();
}
