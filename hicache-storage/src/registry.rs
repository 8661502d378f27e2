//! The backend registry: names mapped to factories that open a backend from a
//! [`StorageConfig`] and a [`BackendContext`].
//!
//! Built-in backends of this crate register behind their cargo features
//! ([`Registry::with_builtins`]); a backend crate (ours or a third party's) registers its own
//! factory with one call, `registry.register(MyFactory)?`. The facade's `global` registry is
//! [`Registry::global`].
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> hicache_storage::Result<()> {
//! use hicache_storage::{BackendContext, Registry, StorageConfig};
//! let registry = Registry::with_builtins();
//! let config = StorageConfig::parse(Some("memory"), Some(r#"{"capacity": "64MiB"}"#))?;
//! let storage = registry.open(&config, &BackendContext::default()).await?;
//! assert_eq!(storage.info().name, "memory");
//! assert!(registry.open(&StorageConfig::new("nope"), &BackendContext::default()).await.is_err());
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use parking_lot::RwLock;

use crate::backend::Storage;
use crate::config::StorageConfig;
use crate::error::{Result, StorageError};
pub use crate::factory::{BackendContext, BackendFactory};

/// Names mapped to factories.
#[derive(Default)]
pub struct Registry {
    factories: RwLock<BTreeMap<String, Arc<dyn BackendFactory>>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("names", &self.names())
            .finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry holding this crate's built-in backends enabled by features (`memory`).
    pub fn with_builtins() -> Self {
        let r = Self::new();
        #[cfg(feature = "memory")]
        r.register(crate::memory::MemoryFactory)
            .expect("an empty registry has no duplicates");
        r
    }

    /// The process-wide registry, created with [`with_builtins`](Self::with_builtins) on first
    /// use. Backend crates add theirs to it with [`register`](Self::register).
    pub fn global() -> &'static Registry {
        static GLOBAL: OnceLock<Registry> = OnceLock::new();
        GLOBAL.get_or_init(Self::with_builtins)
    }

    /// Adds a factory under its name; a name already taken is an error.
    pub fn register(&self, factory: impl BackendFactory) -> Result<()> {
        self.register_arc(Arc::new(factory))
    }

    /// Adds a shared factory under its name; a name already taken is an error.
    pub fn register_arc(&self, factory: Arc<dyn BackendFactory>) -> Result<()> {
        let mut map = self.factories.write();
        let name = factory.name().to_string();
        if map.contains_key(&name) {
            return Err(StorageError::DuplicateBackend(name));
        }
        map.insert(name, factory);
        Ok(())
    }

    /// Whether a backend of that name is registered.
    pub fn contains(&self, name: &str) -> bool {
        self.factories.read().contains_key(name)
    }

    /// Every registered name, sorted.
    pub fn names(&self) -> Vec<String> {
        self.factories.read().keys().cloned().collect()
    }

    /// The factory of `name`, or an error listing the known names.
    pub fn factory(&self, name: &str) -> Result<Arc<dyn BackendFactory>> {
        self.factories
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| StorageError::UnknownBackend {
                name: name.to_string(),
                known: self.names(),
            })
    }

    /// Opens the backend `config` names.
    pub async fn open(
        &self,
        config: &StorageConfig,
        ctx: &BackendContext,
    ) -> Result<Arc<dyn Storage>> {
        let factory = self.factory(&config.backend)?;
        factory
            .open(&config.common, config.backend_fields.clone(), ctx)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{CommonConfig, ConfigFields};
    use async_trait::async_trait;

    struct Named(&'static str);

    #[async_trait]
    impl BackendFactory for Named {
        fn name(&self) -> &str {
            self.0
        }
        async fn open(
            &self,
            _: &CommonConfig,
            _: ConfigFields,
            _: &BackendContext,
        ) -> Result<Arc<dyn Storage>> {
            Err(StorageError::backend(self.0, "test factory"))
        }
    }

    #[tokio::test]
    async fn unknown_names_list_known_ones() {
        let r = Registry::new();
        r.register(Named("alpha")).unwrap();
        r.register(Named("beta")).unwrap();
        let e = r
            .open(&StorageConfig::new("gamma"), &BackendContext::default())
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("gamma") && e.contains("alpha, beta"), "{e}");
        assert!(matches!(
            r.register(Named("alpha")),
            Err(StorageError::DuplicateBackend(n)) if n == "alpha"
        ));
        assert_eq!(r.names(), vec!["alpha", "beta"]);
    }

    #[cfg(feature = "memory")]
    #[tokio::test]
    async fn global_has_memory_and_checks_its_fields() {
        assert!(Registry::global().contains("memory"));
        let cfg = StorageConfig::parse(Some("memory"), Some(r#"{"bogus": 1}"#)).unwrap();
        let e = Registry::global()
            .open(&cfg, &BackendContext::default())
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("bogus") && e.contains("backend memory"), "{e}");
    }
}
