//! `clear` across the C ABI (1.2): an SDK plugin whose backend clears removes exactly one
//! namespace's pages through the `clear` entry; a plugin without the entry (the C example, a
//! 1.1 vtable that sets the 1.2 bit it never knew) loads and answers Unsupported, changing
//! nothing; a panic inside `clear` is an error and the instance carries on.

use std::path::Path;

use hicache_backend_plugin::{HostParams, PluginStorage, abi};
use hicache_plugin_tests::{c_plugin, rust_plugin};
use hicache_storage::pattern::{namespace, page_bytes, page_key};
use hicache_storage::{
    LayoutKind, PageBuf, PageKey, PageOutcome, Storage, StorageError, StorageExt,
};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap()
}

fn open(path: &Path, config: &str) -> PluginStorage {
    PluginStorage::open(
        path,
        config,
        &HostParams::default().with_capacity(Some(16 << 20)),
    )
    .unwrap()
}

fn keys(ns: u64, n: u64) -> Vec<PageKey> {
    (0..n).map(|i| page_key(namespace(ns), 3, i)).collect()
}

fn set(rt: &tokio::runtime::Runtime, s: &PluginStorage, ks: &[PageKey]) {
    let pages: Vec<Vec<u8>> = ks.iter().map(|k| page_bytes(k, 4096)).collect();
    let src: Vec<PageBuf<'_>> = pages
        .iter()
        .map(|p| PageBuf::contiguous(LayoutKind::PageFirst, p))
        .collect();
    let out = rt.block_on(s.batch_set(ks, &src)).unwrap();
    assert!(out.iter().all(|o| *o == PageOutcome::Stored), "{out:?}");
}

/// Every page of `ks` reads back with its own bytes.
fn assert_hits(rt: &tokio::runtime::Runtime, s: &PluginStorage, ks: &[PageKey], what: &str) {
    assert_eq!(rt.block_on(s.batch_exists(ks)).unwrap(), ks.len(), "{what}");
    for k in ks {
        let page = rt
            .block_on(s.get(LayoutKind::PageFirst, 4096, *k))
            .unwrap()
            .unwrap_or_else(|| panic!("{what}: {k:?} missing"));
        assert_eq!(&page[..], &page_bytes(k, 4096)[..], "{what}");
    }
}

#[test]
fn a_plugin_clears_one_namespace_and_the_other_survives() {
    let rt = rt();
    let s = open(&rust_plugin("hicache-plugin-example"), "{}");
    assert_eq!(s.library().abi_version(), (abi::ABI_MAJOR, 2));
    assert!(s.library().clear(), "the SDK exports the 1.2 clear entry");
    assert!(
        s.info().clear,
        "the memory backend clears: HICACHE_INFO_CLEAR"
    );

    let a = keys(30, 6);
    let b: Vec<PageKey> = (0..4).map(|i| page_key(namespace(31), 7, i)).collect();
    // The same hashes as `a` under `b`'s namespace: the clear must look at the namespace.
    let twins: Vec<PageKey> = a[..3]
        .iter()
        .map(|k| PageKey::new(namespace(31), k.hash))
        .collect();
    set(&rt, &s, &a);
    set(&rt, &s, &b);
    set(&rt, &s, &twins);
    let before = s.stats();

    assert_eq!(rt.block_on(s.clear(namespace(30))).unwrap(), a.len() as u64);
    assert_eq!(rt.block_on(s.batch_exists(&a[..1])).unwrap(), 0);
    for k in &a {
        assert!(
            rt.block_on(s.get(LayoutKind::PageFirst, 4096, *k))
                .unwrap()
                .is_none(),
            "a cleared page must read as a miss"
        );
    }
    assert_hits(&rt, &s, &b, "the other namespace survives");
    assert_hits(&rt, &s, &twins, "same hashes, other namespace, survive");

    let after = s.stats();
    assert_eq!(
        after.cleared_pages,
        before.cleared_pages + a.len() as u64,
        "hicache_stats.cleared_pages crosses the ABI"
    );
    assert_eq!(after.pages + a.len() as u64, before.pages);
    assert_eq!(rt.block_on(s.clear(namespace(30))).unwrap(), 0, "empty now");
    set(&rt, &s, &a);
    assert_hits(&rt, &s, &a, "a cleared namespace accepts pages again");
    assert_eq!(s.protocol_violations(), 0);
}

/// Clear answers Unsupported without touching a page.
fn assert_unsupported(rt: &tokio::runtime::Runtime, s: &PluginStorage) {
    let ks = keys(32, 3);
    set(rt, s, &ks);
    match rt.block_on(s.clear(namespace(32))) {
        Err(StorageError::Unsupported { op: "clear", .. }) => {}
        other => panic!("expected Unsupported, got {other:?}"),
    }
    assert_hits(rt, s, &ks, "an unsupported clear changes nothing");
    assert_eq!(s.stats().cleared_pages, 0);
}

#[test]
fn plugins_without_the_clear_entry_answer_unsupported() {
    let rt = rt();
    // Built against the 1.2 header, entry NULL and no HICACHE_CAP_CLEAR.
    let c = open(&c_plugin("hicache_c_memory"), "{}");
    assert_eq!(c.library().abi_version(), (abi::ABI_MAJOR, abi::ABI_MINOR));
    assert!(!c.library().clear());
    assert!(!c.info().clear);
    assert_unsupported(&rt, &c);

    // Built against the 1.1 header (struct_size = the 1.1 vtable), with the 1.2 bit set: the
    // bit lies about a field the vtable does not have, so the host ignores it and loads.
    let old = open(&c_plugin("hicache_c_memory_v1_1"), "{}");
    assert_eq!(old.library().abi_version(), (abi::ABI_MAJOR, 1));
    assert_ne!(old.library().capabilities() & abi::CAP_CLEAR, 0);
    assert!(!old.library().clear(), "a 1.1 vtable has no clear entry");
    assert!(!old.info().clear);
    assert_unsupported(&rt, &old);
    assert_eq!(old.protocol_violations(), 0);
}

#[test]
fn a_panic_in_clear_is_an_error_and_the_instance_carries_on() {
    let rt = rt();
    let s = open(
        &rust_plugin("hicache-plugin-faulty"),
        r#"{"panic_in": "clear"}"#,
    );
    assert!(s.info().clear);
    let ks = keys(33, 2);
    set(&rt, &s, &ks);
    let t = rt
        .block_on(s.clear(namespace(33)))
        .expect_err("a panic must be an error")
        .to_string();
    assert!(
        t.contains("HICACHE_ERR_PANIC") && t.contains("deliberate panic in clear"),
        "{t}"
    );
    assert_hits(&rt, &s, &ks, "the instance still serves");
}
