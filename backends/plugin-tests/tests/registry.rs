//! The plugin backend opened the way an engine opens any backend: `StorageConfig` from the
//! extra-config JSON, then `Registry::open`.

use hicache_backend_plugin::PluginFactory;
use hicache_plugin_tests::{c_plugin, rust_plugin};
use hicache_storage::{
    BackendContext, LayoutKind, PageOutcome, Registry, StorageConfig, StorageError, StorageExt,
    pattern,
};

fn registry() -> Registry {
    let r = Registry::with_builtins();
    hicache_backend_plugin::register(&r).unwrap();
    r
}

fn extra(path: &std::path::Path, rest: &str) -> String {
    format!(
        r#"{{"backend": "plugin", "plugin_path": "{}"{rest}}}"#,
        path.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opened_from_the_extra_config() {
    let r = registry();
    assert!(r.contains("plugin"));
    for (path, rest, max_batch) in [
        (
            c_plugin("hicache_c_memory"),
            r#", "capacity": "64MiB", "plugin_config": {"max_batch": 512}"#,
            512,
        ),
        (
            rust_plugin("hicache-plugin-example"),
            r#", "capacity": "64MiB", "plugin_config": "{\"max_batch\": 300}""#,
            300,
        ),
    ] {
        let cfg = StorageConfig::parse(Some("dynamic"), Some(&extra(&path, rest))).unwrap();
        let s = r.open(&cfg, &BackendContext::default()).await.unwrap();
        let info = s.info();
        assert_eq!(info.name, "plugin");
        assert_eq!(info.max_batch, max_batch);
        assert_eq!(
            info.capacity_bytes,
            Some(64 << 20),
            "capacity reaches the plugin"
        );
        let key = pattern::page_key(pattern::namespace(9), 1, 1);
        let page = pattern::page_bytes(&key, 8192);
        assert_eq!(
            s.put(LayoutKind::PageFirst, key, &page).await.unwrap(),
            PageOutcome::Stored
        );
        let back = s
            .get(LayoutKind::PageFirst, 8192, key)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&back[..], &page[..]);
    }
}

async fn open_err(extra_config: &str) -> String {
    let cfg = match StorageConfig::parse(None, Some(extra_config)) {
        Ok(c) => c,
        Err(e) => return e.to_string(),
    };
    match registry().open(&cfg, &BackendContext::default()).await {
        Ok(_) => panic!("{extra_config} must be refused"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn bad_extra_configs_are_clear_errors() {
    let p = c_plugin("hicache_c_memory");
    // Invalid JSON inside plugin_config (a string holding JSON text).
    let e = open_err(&extra(&p, r#", "plugin_config": "{\"max_batch\": }""#)).await;
    assert!(
        e.contains("plugin_config") && e.contains("invalid JSON"),
        "{e}"
    );
    // Invalid JSON in the document itself.
    let e = open_err(&format!(
        r#"{{"backend": "plugin", "plugin_path": "{}",}}"#,
        p.display()
    ))
    .await;
    assert!(e.contains("invalid storage extra-config"), "{e}");
    // Wrong type, missing path, unknown field.
    let e = open_err(&extra(&p, r#", "plugin_config": [1, 2]"#)).await;
    assert!(
        e.contains("plugin_config") && e.contains("JSON object"),
        "{e}"
    );
    let e = open_err(r#"{"backend": "plugin"}"#).await;
    assert!(e.contains("plugin_path") && e.contains("required"), "{e}");
    let e = open_err(&extra(&p, r#", "plugin_cfg": {}"#)).await;
    assert!(
        e.contains("plugin_cfg") && e.contains("unknown field"),
        "{e}"
    );
    // Loader errors come through as backend errors naming the library.
    let e = open_err(r#"{"backend": "plugin", "plugin_path": "/no/such/libp.so"}"#).await;
    assert!(
        e.contains("/no/such/libp.so") && e.contains("no such file"),
        "{e}"
    );
    let e = open_err(&extra(&c_plugin("broken_abi_major"), "")).await;
    assert!(e.contains("ABI major version mismatch"), "{e}");
}

#[tokio::test]
async fn unavailable_create_maps_to_backend_error_with_text() {
    let cfg =
        StorageConfig::parse(None, Some(&extra(&c_plugin("broken_create_fails"), ""))).unwrap();
    let e = registry()
        .open(&cfg, &BackendContext::default())
        .await
        .err()
        .unwrap();
    assert!(matches!(e, StorageError::Backend { .. }), "{e:?}");
    assert!(e.to_string().contains("10.0.0.1:7000"), "{e}");
}

#[test]
fn factory_name() {
    use hicache_storage::BackendFactory;
    assert_eq!(PluginFactory.name(), "plugin");
    assert!(matches!(
        registry().register(PluginFactory),
        Err(StorageError::DuplicateBackend(n)) if n == "plugin"
    ));
}
