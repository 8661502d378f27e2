//! [`PluginHarness`]: runs `hicache_storage::conformance` on a plugin through the loader, so a
//! plugin author (in any language) checks a built `.so` against every rule of the contract:
//!
//! ```ignore
//! // tests/conformance.rs
//! hicache_storage::conformance_tests!(
//!     hicache_backend_plugin::conformance::PluginHarness::new("/path/to/libmy_plugin.so"),
//!     not_persistent // leave out if the plugin persists (its restart case then runs)
//! );
//! ```
//!
//! The corruption case needs the plugin's test-only `test_corrupt_page`
//! (`HICACHE_CAP_TEST_CORRUPT`); without it that case fails, naming the missing capability.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use hicache_core::PageKey;
use hicache_storage::Result;
use hicache_storage::conformance::Harness;

use crate::storage::{HostParams, PluginStorage};

/// Opens fresh instances of one plugin for the conformance suite.
#[derive(Clone, Debug)]
pub struct PluginHarness {
    path: PathBuf,
    config: String,
    params: HostParams,
}

impl PluginHarness {
    /// Instances of the plugin at `path` with an empty `plugin_config`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            config: "{}".into(),
            params: HostParams::default(),
        }
    }

    /// With this `plugin_config` (JSON object text).
    pub fn with_config(mut self, config_json: impl Into<String>) -> Self {
        self.config = config_json.into();
        self
    }

    /// With these host parameters (the suite still sets the capacity it needs).
    pub fn with_params(mut self, params: HostParams) -> Self {
        self.params = params;
        self
    }
}

#[async_trait]
impl Harness for PluginHarness {
    type Backend = PluginStorage;

    async fn open(&self, capacity_bytes: Option<u64>) -> Result<Arc<PluginStorage>> {
        // `None` asks for room for at least 256 MiB of pages.
        let params = self
            .params
            .clone()
            .with_capacity(Some(capacity_bytes.unwrap_or(512 << 20)));
        Ok(Arc::new(PluginStorage::open(
            &self.path,
            &self.config,
            &params,
        )?))
    }

    async fn corrupt(&self, backend: &PluginStorage, key: &PageKey) -> Result<bool> {
        Ok(backend.test_corrupt_page(key)?)
    }
}
