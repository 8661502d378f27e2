//! Bad input at every step of loading and calling a plugin: each is a clear error naming the
//! library and the cause, and the host process carries on.
//!
//! C plugins are built by this crate's build script; the Rust plugins are cdylibs that
//! `hicache_plugin_tests::rust_plugin` builds with cargo on first use.

use std::path::Path;

use hicache_backend_plugin::{HostParams, PluginError, PluginLibrary, PluginStorage};
use hicache_plugin_tests::{c_plugin, rust_plugin};
use hicache_storage::pattern::{namespace, page_bytes, page_key};
use hicache_storage::{
    LayoutKind, PageBuf, PageBufMut, PageError, PageKey, PageOutcome, Storage, StorageError,
};

fn open(path: &Path, config: &str) -> Result<PluginStorage, PluginError> {
    PluginStorage::open(path, config, &HostParams::default())
}

fn open_err(path: &Path, config: &str) -> (PluginError, String) {
    let e = open(path, config).expect_err("the plugin must be refused");
    let text = e.to_string();
    (e, text)
}

fn keys(n: u64) -> Vec<PageKey> {
    (0..n).map(|i| page_key(namespace(77), 5, i)).collect()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap()
}

#[test]
fn nonexistent_path() {
    let (e, t) = open_err(Path::new("/nonexistent/dir/libnothing.so"), "{}");
    assert!(matches!(e, PluginError::NotFound { .. }), "{e:?}");
    assert!(
        t.contains("/nonexistent/dir/libnothing.so") && t.contains("no such file"),
        "{t}"
    );
    // A bare name is searched by the dynamic loader and not found there either.
    let (e, t) = open_err(Path::new("libhicache_no_such_plugin.so"), "{}");
    assert!(matches!(e, PluginError::Load { .. }), "{e:?}");
    assert!(t.contains("libhicache_no_such_plugin.so"), "{t}");
}

#[test]
fn a_file_that_is_not_a_shared_library() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("libfake.so");
    std::fs::write(&p, "this is not an ELF file\n").unwrap();
    let (e, t) = open_err(&p, "{}");
    // Issue 13: the message says what the file is and why it was refused (it said only that
    // the dynamic loader failed).
    assert!(matches!(e, PluginError::NotSharedObject { .. }), "{e:?}");
    assert!(
        t.contains("libfake.so")
            && t.contains("a text file")
            && t.contains("must be an ELF shared object"),
        "{t}"
    );
    std::fs::write(&p, "").unwrap();
    let (_, t) = open_err(&p, "{}");
    assert!(t.contains("empty"), "{t}");
    std::fs::write(&p, "#!/bin/sh\nexit 0\n").unwrap();
    let (_, t) = open_err(&p, "{}");
    assert!(t.contains("a script"), "{t}");
    let (_, t) = open_err(dir.path(), "{}");
    assert!(t.contains("a directory"), "{t}");
}

#[test]
fn a_shared_library_that_is_not_a_plugin() {
    let (e, t) = open_err(&c_plugin("not_a_plugin"), "{}");
    assert!(matches!(e, PluginError::MissingEntry { .. }), "{e:?}");
    assert!(
        t.contains("not a hicache storage plugin") && t.contains("hicache_storage_plugin"),
        "{t}"
    );
}

#[test]
fn abi_major_mismatch_is_refused() {
    let (e, t) = open_err(&c_plugin("broken_abi_major"), "{}");
    assert!(
        matches!(
            e,
            PluginError::AbiMismatch {
                plugin_major: 2,
                host_major: 1,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        t.contains(&format!("2.{}", hicache_backend_plugin::abi::ABI_MINOR))
            && t.contains("1.x")
            && t.contains("rebuild"),
        "{t}"
    );
}

#[test]
fn broken_vtables_are_refused() {
    let (e, t) = open_err(&c_plugin("broken_null_vtable"), "{}");
    assert!(matches!(e, PluginError::NullVtable { .. }), "{e:?}");
    assert!(t.contains("null vtable"), "{t}");

    let (e, t) = open_err(&c_plugin("broken_small_vtable"), "{}");
    assert!(matches!(e, PluginError::VtableTooSmall { .. }), "{e:?}");
    assert!(t.contains("struct_size"), "{t}");

    let (e, t) = open_err(&c_plugin("broken_null_function"), "{}");
    assert!(matches!(e, PluginError::InvalidVtable { .. }), "{e:?}");
    assert!(t.contains("`batch_get` is NULL"), "{t}");

    let (e, t) = open_err(&c_plugin("broken_cap_without_fn"), "{}");
    assert!(matches!(e, PluginError::InvalidVtable { .. }), "{e:?}");
    assert!(
        t.contains("HICACHE_CAP_TEST_CORRUPT") && t.contains("test_corrupt_page"),
        "{t}"
    );

    let (e, t) = open_err(&c_plugin("broken_context_cap_without_fn"), "{}");
    assert!(matches!(e, PluginError::InvalidVtable { .. }), "{e:?}");
    assert!(
        t.contains("HICACHE_CAP_BATCH_CONTEXT") && t.contains("batch_exists_ctx"),
        "{t}"
    );

    let (e, t) = open_err(&c_plugin("broken_clear_cap_without_fn"), "{}");
    assert!(matches!(e, PluginError::InvalidVtable { .. }), "{e:?}");
    assert!(
        t.contains("HICACHE_CAP_CLEAR") && t.contains("`clear` is NULL"),
        "{t}"
    );
}

#[test]
fn create_failure_carries_the_plugins_error_text() {
    let (e, t) = open_err(&c_plugin("broken_create_fails"), "{}");
    assert!(matches!(e, PluginError::Create { status: -4, .. }), "{e:?}");
    assert!(
        t.contains("HICACHE_ERR_UNAVAILABLE")
            && t.contains("cannot reach the storage server at 10.0.0.1:7000")
            && t.contains("`broken`"),
        "{t}"
    );
    // A config the plugin refuses: the C example names the field.
    let (e, t) = open_err(&c_plugin("hicache_c_memory"), r#"{"colour": "red"}"#);
    assert!(matches!(e, PluginError::Create { status: -2, .. }), "{e:?}");
    assert!(
        t.contains("HICACHE_ERR_CONFIG") && t.contains("unknown field `colour`"),
        "{t}"
    );
    // And the Rust example, through the SDK's strict ConfigFields.
    let (e, t) = open_err(
        &rust_plugin("hicache-plugin-example"),
        r#"{"eviction": "random"}"#,
    );
    assert!(matches!(e, PluginError::Create { status: -2, .. }), "{e:?}");
    assert!(
        t.contains("plugin hicache-example-memory plugin_config")
            && t.contains("eviction")
            && t.contains("random"),
        "{t}"
    );
    // Text that is not JSON reaches the plugin only through this API (the factory checks it
    // first); the SDK refuses it with a config error too.
    let (_, t) = open_err(&rust_plugin("hicache-plugin-example"), "{not json");
    assert!(t.contains("not valid JSON"), "{t}");
}

#[test]
fn a_max_batch_of_zero_is_a_protocol_error() {
    let (e, t) = open_err(&c_plugin("broken_zero_batch"), "{}");
    assert!(matches!(e, PluginError::Protocol { .. }), "{e:?}");
    assert!(t.contains("max_batch is 0"), "{t}");
}

#[test]
fn garbage_results_become_per_page_errors() {
    let s = open(&c_plugin("broken_garbage"), "{}").unwrap();
    let rt = rt();
    let ks = keys(12);
    let len = 4096;
    let mut bufs: Vec<Vec<u8>> = ks.iter().map(|_| vec![0u8; len]).collect();
    let out = rt.block_on(async {
        let mut dst: Vec<PageBufMut<'_>> = bufs
            .iter_mut()
            .map(|b| PageBufMut::contiguous(LayoutKind::PageFirst, b))
            .collect();
        s.batch_get(&ks, &mut dst).await.unwrap()
    });
    let text = |o: &PageOutcome| match o {
        PageOutcome::Failed(PageError::Backend(t)) => t.clone(),
        other => panic!("expected a per-page error, got {other:?}"),
    };
    for (i, o) in out.iter().enumerate() {
        match i % 6 {
            0 => assert!(text(o).contains("result code 77"), "{o:?}"),
            1 => assert!(text(o).contains("is not a batch_get result"), "{o:?}"),
            2 => assert!(
                text(o).contains("hit with 2048 bytes for a 4096-byte page"),
                "{o:?}"
            ),
            3 => assert!(text(o).contains("HICACHE_PAGE_UNSET"), "{o:?}"),
            4 => assert_eq!(*o, PageOutcome::Hit, "a valid hit among garbage"),
            _ => assert!(text(o).contains("4097 bytes"), "{o:?}"),
        }
    }
    assert_eq!(s.protocol_violations(), 10);

    let pages: Vec<Vec<u8>> = ks.iter().map(|k| page_bytes(k, len)).collect();
    let src: Vec<PageBuf<'_>> = pages
        .iter()
        .map(|p| PageBuf::contiguous(LayoutKind::PageFirst, p))
        .collect();
    let out = rt.block_on(s.batch_set(&ks[..3], &src[..3])).unwrap();
    assert!(text(&out[0]).contains("result code -5"), "{:?}", out[0]);
    assert!(
        text(&out[1]).contains("is not a batch_set result"),
        "{:?}",
        out[1]
    );
    assert_eq!(out[2], PageOutcome::Stored);

    let e = rt.block_on(s.batch_exists(&ks)).unwrap_err().to_string();
    assert!(e.contains("17 keys present out of a batch of 12"), "{e}");
    let e = rt.block_on(s.delete(&ks)).unwrap_err().to_string();
    assert!(e.contains("removed 13 pages out of a batch of 12"), "{e}");
    assert_eq!(s.protocol_violations(), 14);
}

#[test]
fn unknown_status_codes_and_failed_stats() {
    let s = open(&c_plugin("broken_plain"), "{}").unwrap();
    let rt = rt();
    let e = rt.block_on(s.delete(&keys(2))).unwrap_err();
    let t = e.to_string();
    assert!(matches!(e, StorageError::Backend { .. }), "{e:?}");
    assert!(
        t.contains("12345")
            && t.contains("unknown status")
            && t.contains("delete is broken on purpose"),
        "{t}"
    );
    // get_stats fails: the counters read as zero (with a warning), nothing panics.
    let st = s.stats();
    assert_eq!((st.pages, st.get_pages), (0, 0));
    // No corruption hook: a clear error.
    let e = s.test_corrupt_page(&keys(1)[0]).unwrap_err().to_string();
    assert!(e.contains("does not support test_corrupt_page"), "{e}");
}

#[test]
fn the_same_path_loads_once() {
    let a = PluginLibrary::load(c_plugin("hicache_c_memory")).unwrap();
    let b = PluginLibrary::load(c_plugin("hicache_c_memory")).unwrap();
    assert!(std::ptr::eq(a, b));
    assert_eq!(a.name(), "c-memory-example");
    let minor = hicache_backend_plugin::abi::ABI_MINOR;
    assert_eq!(a.abi_version(), (1, minor));
    let next = PluginLibrary::load(c_plugin("hicache_c_memory_next")).unwrap();
    assert_eq!(next.abi_version(), (1, minor + 1), "a newer minor loads");
    let old = PluginLibrary::load(c_plugin("hicache_c_memory_v1_0")).unwrap();
    assert_eq!(old.abi_version(), (1, 0), "an older minor loads");
    let v1_1 = PluginLibrary::load(c_plugin("hicache_c_memory_v1_1")).unwrap();
    assert_eq!(v1_1.abi_version(), (1, 1), "a 1.1 plugin loads");
}

/// A panic inside any call of a Rust plugin becomes an error, never an abort; the instance
/// keeps serving the other operations.
#[test]
fn rust_plugin_panics_become_errors() {
    let path = rust_plugin("hicache-plugin-faulty");
    let rt = rt();

    let (e, t) = open_err(&path, r#"{"panic_in": "open"}"#);
    assert!(matches!(e, PluginError::Create { status: -8, .. }), "{e:?}");
    assert!(
        t.contains("HICACHE_ERR_PANIC")
            && t.contains("panicked in create")
            && t.contains("deliberate panic in open"),
        "{t}"
    );
    let (_, t) = open_err(&path, r#"{"panic_in": "info"}"#);
    assert!(
        t.contains("get_info") && t.contains("deliberate panic in info"),
        "{t}"
    );

    let ks = keys(4);
    let pages: Vec<Vec<u8>> = ks.iter().map(|k| page_bytes(k, 1024)).collect();
    let src = || -> Vec<PageBuf<'_>> {
        pages
            .iter()
            .map(|p| PageBuf::contiguous(LayoutKind::PageFirst, p))
            .collect()
    };
    for op in ["batch_exists", "batch_get", "batch_set", "delete"] {
        let s = open(&path, &format!(r#"{{"panic_in": "{op}"}}"#)).unwrap();
        let r = rt.block_on(async {
            match op {
                "batch_exists" => s.batch_exists(&ks).await.map(drop),
                "batch_get" => {
                    let mut b = vec![0u8; 1024];
                    let mut dst = [PageBufMut::contiguous(LayoutKind::PageFirst, &mut b)];
                    s.batch_get(&ks[..1], &mut dst).await.map(drop)
                }
                "batch_set" => s.batch_set(&ks, &src()).await.map(drop),
                _ => s.delete(&ks).await.map(drop),
            }
        });
        let t = r.expect_err("a panic must be an error").to_string();
        assert!(
            t.contains("HICACHE_ERR_PANIC") && t.contains(&format!("deliberate panic in {op}")),
            "{op}: {t}"
        );
        // The instance still serves what does not panic.
        if op != "batch_set" {
            let out = rt.block_on(s.batch_set(&ks, &src())).unwrap();
            assert!(
                out.iter().all(|o| *o == PageOutcome::Stored),
                "{op}: {out:?}"
            );
        }
        if op != "batch_exists" && op != "batch_set" {
            assert_eq!(rt.block_on(s.batch_exists(&ks)).unwrap(), 4, "{op}");
        }
    }
    // stats panics: zeros and a warning; corrupt panics: an error.
    let s = open(&path, r#"{"panic_in": "stats"}"#).unwrap();
    assert_eq!(s.stats().pages, 0);
    let s = open(&path, r#"{"panic_in": "corrupt"}"#).unwrap();
    let t = s.test_corrupt_page(&ks[0]).unwrap_err().to_string();
    assert!(t.contains("panicked in test_corrupt_page"), "{t}");
}

/// Plugin calls work without a runtime and on a current-thread runtime (run in place), not
/// only in tokio's blocking sections.
#[test]
fn calls_outside_a_multi_threaded_runtime() {
    for path in [
        rust_plugin("hicache-plugin-example"),
        c_plugin("hicache_c_memory"),
    ] {
        let s = open(&path, "{}").unwrap();
        let ks = keys(3);
        let pages: Vec<Vec<u8>> = ks.iter().map(|k| page_bytes(k, 512)).collect();
        let src: Vec<PageBuf<'_>> = pages
            .iter()
            .map(|p| PageBuf::contiguous(LayoutKind::PageFirst, p))
            .collect();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let out = rt.block_on(s.batch_set(&ks, &src)).unwrap();
        assert!(out.iter().all(PageOutcome::is_ok), "{out:?}");
        assert_eq!(rt.block_on(s.batch_exists(&ks)).unwrap(), 3);
        // Scattered destination: three parts of a page.
        let mut b = vec![0u8; 512];
        let (x, rest) = b.split_at_mut(100);
        let (y, z) = rest.split_at_mut(1);
        let out = {
            let mut dst = [PageBufMut::from_parts(LayoutKind::PageFirst, [x, y, z])];
            rt.block_on(s.batch_get(&ks[1..2], &mut dst)).unwrap()
        };
        assert_eq!(out, vec![PageOutcome::Hit]);
        assert_eq!(b, pages[1]);
        // register_memory: accepted (the Rust SDK passes it on; the C example lacks the
        // capability, so the host ignores it).
        let region = hicache_storage::MemoryRegion {
            addr: pages[0].as_ptr() as usize,
            len: pages[0].len(),
            cuda_registered: false,
            huge_pages: false,
        };
        s.register_memory(region).unwrap();
    }
}
