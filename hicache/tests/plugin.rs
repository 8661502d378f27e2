//! The whole L3 flow through a plugin: the example plugin (the memory backend behind the C
//! ABI, loaded from its `.so`) named in the extra-config, as an operator would. SGLang's
//! acceptance test: a 768-token prompt, flush L1 and L2, the same prompt again served from L3.
//!
//! The example plugin is a cdylib, which `cargo test` does not build by itself:
//! `hicache_plugin_tests::rust_plugin` builds it with cargo on first use.
#![cfg(feature = "plugin")]

mod common;

use std::path::PathBuf;

use common::{Engine, prompt, small_shape};
use hicache::{HiCache, HiCacheConfig, PrefetchPolicy};

fn example_plugin() -> PathBuf {
    hicache_plugin_tests::rust_plugin("hicache-plugin-example")
}

#[test]
fn l3_round_trip_through_a_plugin() {
    let cfg = HiCacheConfig {
        page_size: 64,
        hicache_ratio: 1.2,
        storage_backend: Some("dynamic".into()),
        storage_backend_extra_config: Some(format!(
            r#"{{"backend": "plugin", "plugin_path": "{}", "capacity": "256MiB",
                "prefetch_threshold": 256, "plugin_config": {{"eviction": "lru"}}}}"#,
            example_plugin().display()
        )),
        storage_prefetch_policy: PrefetchPolicy::WaitComplete,
        host_reserve_bytes: Some(0),
        ..Default::default()
    };
    let cache = HiCache::builder(cfg.clone())
        .shape(small_shape(cfg.page_size))
        .device_pages(40)
        .build()
        .unwrap();
    assert_eq!(cache.storage_backend().as_deref(), Some("plugin"));
    let mut e = Engine::new(cache);
    let p = prompt(42, 768 + 30);
    e.run(None, &p);
    e.settle();
    e.cache.flush().unwrap();
    assert_eq!(e.cache.tree().device_pages(), 0);
    assert_eq!(e.cache.tree().host_pages(), 0);
    let again = e.run(None, &p);
    assert_eq!(again.admission.storage_pages, 12, "{:?}", again.admission);
    assert!(again.admission.cached_pages() * 64 > 700);
    e.settle();
    e.cache.shutdown().unwrap();
}
