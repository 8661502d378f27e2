//! The backends compiled into this build of the package: the facade's registry, by cargo
//! feature (this crate's features turn on the facade's of the same name).

use hicache_storage::Registry;

use crate::error::{BindingError, Result};

/// A registry holding every backend compiled in: the facade's
/// ([`hicache::backends::builtin_registry`]), whose cargo features this crate's features
/// select.
pub fn registry() -> Result<Registry> {
    Ok(hicache::backends::builtin_registry()?)
}

/// An error naming the feature when `name` is a backend of hicache-rs this build lacks.
pub fn check_compiled(registry: &Registry, name: &str) -> Result<()> {
    if registry.contains(name) {
        return Ok(());
    }
    match hicache::backends::feature_for(name) {
        Some(feature) => Err(BindingError::NotCompiled {
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
