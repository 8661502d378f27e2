//! Batch contexts across the C ABI (1.1): a plugin that declares `HICACHE_CAP_BATCH_CONTEXT`
//! receives each batch's prefix keys and extra info exactly as given; a 1.0 plugin still
//! loads, serves every call, and simply receives no context.

mod common;

use common::Capture;
use hicache_backend_plugin::{HostParams, PluginStorage, abi};
use hicache_plugin_tests::{c_plugin, rust_plugin};
use hicache_storage::pattern::{namespace, page_bytes, page_key};
use hicache_storage::{
    BatchContext, LayoutKind, PageBuf, PageBufMut, PageKey, PageOutcome, Storage, StorageExt,
};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap()
}

fn keys(ns: u64, n: u64) -> Vec<PageKey> {
    (0..n).map(|i| page_key(namespace(ns), 9, i)).collect()
}

/// Sets, looks up and reads `ks` with `ctx`; checks the answers.
fn round_trip(
    rt: &tokio::runtime::Runtime,
    s: &PluginStorage,
    ks: &[PageKey],
    ctx: BatchContext<'_>,
) {
    let pages: Vec<Vec<u8>> = ks.iter().map(|k| page_bytes(k, 4096)).collect();
    let src: Vec<PageBuf<'_>> = pages
        .iter()
        .map(|p| PageBuf::contiguous(LayoutKind::PageFirst, p))
        .collect();
    let out = rt.block_on(s.batch_set_with(ks, &src, ctx)).unwrap();
    assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
    assert_eq!(rt.block_on(s.batch_exists_with(ks, ctx)).unwrap(), ks.len());
    let mut back: Vec<Vec<u8>> = ks.iter().map(|_| vec![0u8; 4096]).collect();
    let out = {
        let mut dst: Vec<PageBufMut<'_>> = back
            .iter_mut()
            .map(|b| PageBufMut::contiguous(LayoutKind::PageFirst, b))
            .collect();
        rt.block_on(s.batch_get_with(ks, &mut dst, ctx)).unwrap()
    };
    assert!(out.iter().all(|o| o.is_hit()), "{out:?}");
    assert_eq!(back, pages);
}

#[test]
fn prefix_keys_cross_the_abi_and_a_1_0_plugin_still_works() {
    let cap = Capture::default();
    tracing::subscriber::set_global_default(cap.clone()).unwrap();
    let rt = rt();

    // A 1.1 Rust plugin (the SDK exports the context entries); its memory backend logs every
    // context it receives.
    let r = PluginStorage::open(
        rust_plugin("hicache-plugin-example"),
        r#"{"record_contexts": true}"#,
        &HostParams::default().with_capacity(Some(16 << 20)),
    )
    .unwrap();
    assert_eq!(r.library().abi_version(), (abi::ABI_MAJOR, abi::ABI_MINOR));
    assert!(r.library().batch_context());
    assert!(r.info().batch_context);
    let prefix = keys(40, 5);
    let ks = keys(41, 3);
    let ctx = BatchContext::with_prefix_keys(&prefix).extra_info("req-17");
    round_trip(&rt, &r, &ks, ctx);
    let lines: Vec<String> = cap
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("batch context"))
        .cloned()
        .collect();
    for op in ["batch_set", "batch_exists", "batch_get"] {
        let want = [
            "plugin=hicache-example-memory".to_string(),
            format!("op={op}"),
            "keys=3".to_string(),
            format!("first_key={}", ks[0].to_hex()),
            "prefix_keys=5".to_string(),
            format!("prefix_first={}", prefix[0].to_hex()),
            format!("prefix_last={}", prefix[4].to_hex()),
            "extra_info=req-17".to_string(),
        ];
        assert!(
            lines
                .iter()
                .any(|l| want.iter().all(|w| l.contains(w.as_str()))),
            "{op}: the plugin did not receive the context as given: {lines:#?}"
        );
    }
    // An empty prefix (the batch starts the request) is a prefix of 0 keys, not none.
    let ks2 = keys(42, 2);
    round_trip(&rt, &r, &ks2, BatchContext::with_prefix_keys(&[]));
    assert!(
        cap.0
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("batch context")
                && l.contains(&format!("first_key={}", ks2[0].to_hex()))
                && l.contains("prefix_keys=0")),
        "an empty prefix must arrive as 0 keys"
    );
    // Calls without a context reach the plain entries: nothing recorded.
    let before = cap.0.lock().unwrap().len();
    let ks3 = keys(43, 2);
    round_trip(&rt, &r, &ks3, BatchContext::NONE);
    assert!(
        !cap.0.lock().unwrap()[before..]
            .iter()
            .any(|l| l.contains("batch context")),
        "a call without context recorded one"
    );

    // A plugin built against the 1.0 header: loads, has no context entries, and serves the
    // same calls (the context is dropped on the host side).
    let old = PluginStorage::open(
        c_plugin("hicache_c_memory_v1_0"),
        "{}",
        &HostParams::default().with_capacity(Some(16 << 20)),
    )
    .unwrap();
    assert_eq!(old.library().abi_version(), (abi::ABI_MAJOR, 0));
    assert!(!old.library().batch_context());
    assert!(!old.info().batch_context);
    round_trip(&rt, &old, &ks, ctx);
    assert_eq!(old.protocol_violations(), 0);
    let page = rt
        .block_on(old.get(LayoutKind::PageFirst, 4096, ks[1]))
        .unwrap()
        .expect("a hit through the plain entry");
    assert_eq!(&page[..], &page_bytes(&ks[1], 4096)[..]);
}
