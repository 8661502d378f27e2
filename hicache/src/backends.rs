//! Backends compiled into this build, by cargo feature.

use hicache_storage::Registry;

use crate::error::Result;

/// The registry of every backend compiled in: `memory` always, `file` with the `file`
/// feature (default), `plugin` with the `plugin` feature (default), `uring` with the `uring` feature, `rdma` with the `rdma`
/// feature (its verbs transport with `rdma-verbs`), `redis` with the `redis` feature.
pub fn builtin_registry() -> Result<Registry> {
    let r = Registry::with_builtins();
    #[cfg(feature = "file")]
    hicache_backend_local::FileFactory::register(&r)?;
    #[cfg(feature = "plugin")]
    hicache_backend_plugin::register(&r)?;
    #[cfg(feature = "uring")]
    hicache_backend_local::UringFactory::register(&r)?;
    #[cfg(feature = "rdma")]
    hicache_backend_rdma::register(&r)?;
    #[cfg(feature = "redis")]
    hicache_backend_redis::register(&r)?;
    Ok(r)
}

/// The cargo feature that builds the backend `name`, for backends this crate knows of.
pub fn feature_for(name: &str) -> Option<&'static str> {
    match name {
        "file" => Some("file"),
        "plugin" => Some("plugin"),
        "uring" => Some("uring"),
        "rdma" => Some("rdma"),
        "redis" => Some("redis"),
        _ => None,
    }
}
