//! The backends compiled into this build of the package, by cargo feature.

use hicache_storage::Registry;

use crate::error::{BindingError, Result};

/// The backends hicache-rs has and the cargo feature of this crate that builds each (`memory`
/// is always there).
pub const KNOWN: &[(&str, &str)] = &[
    ("file", "file"),
    ("uring", "uring"),
    ("rdma", "rdma"),
    ("plugin", "plugin"),
    ("redis", "redis"),
];

/// A registry holding every backend compiled in.
pub fn registry() -> Result<Registry> {
    let r = Registry::with_builtins();
    #[cfg(feature = "file")]
    hicache_backend_local::FileFactory::register(&r)?;
    #[cfg(feature = "uring")]
    hicache_backend_local::UringFactory::register(&r)?;
    #[cfg(feature = "rdma")]
    hicache_backend_rdma::register(&r)?;
    #[cfg(feature = "plugin")]
    hicache_backend_plugin::register(&r)?;
    #[cfg(feature = "redis")]
    hicache_backend_redis::register(&r)?;
    Ok(r)
}

/// An error naming the feature when `name` is a backend of hicache-rs this build lacks.
pub fn check_compiled(registry: &Registry, name: &str) -> Result<()> {
    if registry.contains(name) {
        return Ok(());
    }
    match KNOWN.iter().find(|(n, _)| *n == name) {
        Some((_, feature)) => Err(BindingError::NotCompiled {
            name: name.to_string(),
            feature,
            compiled: registry.names().join(", "),
        }),
        // Not ours: the registry's own error lists what is known.
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backend_left_out_is_named_with_its_feature() {
        let r = Registry::with_builtins();
        let e = check_compiled(&r, "redis").unwrap_err().to_string();
        assert!(
            e.contains("`redis`") && e.contains("feature `redis`"),
            "{e}"
        );
        let r = registry().unwrap();
        assert!(check_compiled(&r, "memory").is_ok());
        assert!(
            check_compiled(&r, "nope").is_ok(),
            "unknown names are the registry's to report"
        );
    }
}
