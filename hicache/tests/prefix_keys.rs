//! `hicache_storage_pass_prefix_keys`: with it on, every L3 batch (backup exists/set, prefetch
//! exists/get) reaches the backend with the keys of the request's pages before the batch;
//! with it off, with none. Checked on the sim device with a memory backend that records the
//! contexts it receives, against the page chain read from the tree.

mod common;

use std::sync::Arc;

use common::{Engine, prompt, small_shape, test_config};
use hicache::{HiCache, HiCacheConfig, PrefetchPolicy, TenantId, WritePolicy};
use hicache_storage::{MemoryBackend, PageHash, SeenContext};

/// Pages per L3 batch: several batches per operation, so later batches carry the operation's
/// own earlier pages in their prefix.
const BATCH: usize = 2;

fn cache(storage: Arc<MemoryBackend>, pass: bool) -> HiCache {
    let cfg = HiCacheConfig {
        storage_backend: Some("memory".into()),
        storage_backend_extra_config: Some(format!(
            r#"{{"prefetch_threshold": 4, "hicache_storage_pass_prefix_keys": {pass}}}"#
        )),
        storage_prefetch_policy: PrefetchPolicy::WaitComplete,
        write_policy: WritePolicy::WriteThrough,
        storage_batch_pages: BATCH,
        hicache_ratio: 2.0,
        ..test_config(4)
    };
    HiCache::builder(cfg.clone())
        .shape(small_shape(cfg.page_size))
        .device_pages(64)
        .storage(storage)
        .build()
        .unwrap()
}

/// The page hashes of the tree's one path, root first (the tests cache one prompt family).
fn path_hashes(cache: &HiCache) -> Vec<PageHash> {
    let tree = cache.tree();
    let mut node = tree.tenant_root(TenantId(0)).unwrap();
    loop {
        let children = tree.children(node).unwrap();
        match children.as_slice() {
            [] => return tree.prefix_hashes(node).unwrap(),
            [only] => node = *only,
            more => panic!("expected one path, found {} children", more.len()),
        }
    }
}

/// Runs a 4-page prompt, then its 8-page continuation (both backed up to L3), drops L1 and
/// L2, and serves both again from L3: backups at the root and below a node, prefetches at
/// the root and below a node. Returns what the backend received and the 8-page chain.
fn scenario(pass: bool) -> (Vec<SeenContext>, Vec<PageHash>, Arc<MemoryBackend>) {
    let storage = Arc::new(MemoryBackend::with_capacity(64 << 20));
    storage.contexts().enable(true);
    let mut e = Engine::new(cache(storage.clone(), pass));
    let long = prompt(7, 32);
    let short = &long[..16];
    e.run(None, short);
    e.settle();
    e.run(None, &long);
    e.settle();
    let chain = path_hashes(&e.cache);
    assert_eq!(chain.len(), 8);
    e.cache.flush().unwrap();
    let first = e.run(None, short);
    assert_eq!(first.admission.storage_pages, 4, "served from L3");
    e.settle();
    let second = e.run(None, &long);
    assert_eq!(
        second.admission.storage_pages, 4,
        "the continuation from L3"
    );
    e.settle();
    e.cache.shutdown().unwrap();
    (storage.contexts().take(), chain, storage)
}

#[test]
fn every_batch_carries_the_keys_of_the_pages_before_it() {
    let (seen, chain, _) = scenario(true);
    let mut ops = std::collections::BTreeMap::<&str, usize>::new();
    let mut below_a_node = 0;
    for c in &seen {
        *ops.entry(c.op).or_default() += 1;
        let first = c.keys[0].hash;
        let at = chain
            .iter()
            .position(|h| *h == first)
            .unwrap_or_else(|| panic!("{} of a key outside the prompt", c.op));
        let want: Vec<PageHash> = chain[at..at + c.keys.len()].to_vec();
        let got: Vec<PageHash> = c.keys.iter().map(|k| k.hash).collect();
        assert_eq!(
            got, want,
            "{}: the batch is a run of the prompt's pages",
            c.op
        );
        let prefix = c
            .prefix_keys
            .as_ref()
            .unwrap_or_else(|| panic!("{} at page {at} without prefix keys", c.op));
        let prefix: Vec<PageHash> = prefix.iter().map(|k| k.hash).collect();
        assert_eq!(
            prefix,
            chain[..at],
            "{} at page {at}: the prefix keys are the request's pages before the batch",
            c.op
        );
        assert!(
            c.prefix_keys
                .as_ref()
                .unwrap()
                .iter()
                .all(|k| k.namespace == c.keys[0].namespace)
        );
        if at == 4 {
            below_a_node += 1;
        }
    }
    // Backups: 2 + 2 batches, each an exists then a set; prefetches: the 4 pages from the root,
    // then the 4 below the first node (each an exists per batch then a get per batch).
    assert!(ops.get("batch_set").copied().unwrap_or(0) >= 4, "{ops:?}");
    assert!(
        ops.get("batch_exists").copied().unwrap_or(0) >= 8,
        "{ops:?}"
    );
    assert_eq!(ops.get("batch_get"), Some(&4), "{ops:?}");
    assert!(
        below_a_node >= 4,
        "batches starting below the first node (backup exists/set, prefetch exists/get): \
         {below_a_node}"
    );
}

#[test]
fn without_the_flag_no_context_is_passed() {
    let (seen, _, storage) = scenario(false);
    assert!(
        seen.is_empty(),
        "contexts arrived with the flag off: {seen:?}"
    );
    let st = hicache_storage::Storage::stats(&*storage);
    assert!(
        st.set_stored >= 8 && st.get_hits >= 8,
        "the flow ran: {st:?}"
    );
}
