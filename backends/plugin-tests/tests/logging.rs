//! Plugin logs reach the host's `tracing` (target `hicache_plugin`, the plugin's name in the
//! `plugin` field): from C through the log callback, from Rust through the SDK's forwarder,
//! including events of the wrapped backend.

mod common;

use common::Capture;
use hicache_backend_plugin::{HostParams, PluginStorage};
use hicache_plugin_tests::{c_plugin, rust_plugin};
use hicache_storage::pattern::{namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, PageBufMut, PageOutcome, Storage, StorageExt};

#[test]
fn plugin_logs_become_tracing_events() {
    let cap = Capture::default();
    tracing::subscriber::set_global_default(cap.clone()).unwrap();
    let has = |needles: &[&str]| {
        cap.0
            .lock()
            .unwrap()
            .iter()
            .any(|l| needles.iter().all(|n| l.contains(n)))
    };

    let _c =
        PluginStorage::open(c_plugin("hicache_c_memory"), "{}", &HostParams::default()).unwrap();
    assert!(
        has(&[
            "hicache_plugin INFO",
            "plugin=c-memory-example",
            "created: capacity"
        ]),
        "{:#?}",
        cap.0.lock().unwrap()
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let r = PluginStorage::open(
        rust_plugin("hicache-plugin-example"),
        "{}",
        &HostParams::default().with_capacity(Some(1 << 20)),
    )
    .unwrap();
    assert!(
        has(&[
            "hicache_plugin INFO",
            "plugin=hicache-example-memory",
            "example memory plugin opened",
            "capacity_bytes=1048576"
        ]),
        "{:#?}",
        cap.0.lock().unwrap()
    );
    // An event inside the wrapped MemoryBackend (a checksum mismatch) is forwarded too.
    let key = page_key(namespace(5), 5, 5);
    let page = page_bytes(&key, 4096);
    rt.block_on(r.put(LayoutKind::PageFirst, key, &page))
        .unwrap();
    assert!(r.test_corrupt_page(&key).unwrap());
    let mut b = vec![0u8; 4096];
    let out = rt
        .block_on(r.batch_get(
            &[key],
            &mut [PageBufMut::contiguous(LayoutKind::PageFirst, &mut b)],
        ))
        .unwrap();
    assert_eq!(out, vec![PageOutcome::Corrupt]);
    assert!(
        has(&[
            "hicache_plugin WARN",
            "plugin=hicache-example-memory",
            "checksum mismatch"
        ]),
        "{:#?}",
        cap.0.lock().unwrap()
    );
    // The loader's own record of loading a library.
    assert!(has(&[
        "hicache_plugin INFO",
        "loaded storage plugin",
        "hicache-example-memory"
    ]));
}
