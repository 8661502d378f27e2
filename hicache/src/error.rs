//! The error type of the `hicache` facade, wrapping every lower crate's error.

use thiserror::Error;

use crate::rank::RankError;

/// Everything that can go wrong in the cache controller. Lower crates' errors are wrapped
/// (and their types re-exported by this crate), so one `match` covers them all.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum HiCacheError {
    /// Invalid or contradictory configuration; names the field.
    #[error("invalid config: {field} = {value}: {reason}")]
    Config {
        /// The field, as spelled in configuration.
        field: &'static str,
        /// The value given.
        value: String,
        /// Why it was refused.
        reason: String,
    },
    /// The named storage backend exists but was not compiled in.
    #[error(
        "storage backend {backend:?} is not compiled in: enable the `{feature}` feature of the \
         `hicache` crate"
    )]
    BackendNotCompiled {
        /// The backend name.
        backend: String,
        /// The cargo feature that builds it.
        feature: &'static str,
    },
    /// A request id the cache does not know, or a request in the wrong state for the call.
    #[error("request {request}: {reason}")]
    Request {
        /// The engine's request id.
        request: u64,
        /// What was wrong.
        reason: String,
    },
    /// An argument that does not fit the call (lengths, alignment, unknown slots).
    #[error("bad argument: {0}")]
    BadArgument(String),
    /// The cache was shut down.
    #[error("the cache was shut down; no further calls are accepted")]
    Closed,
    /// An operation that requires an idle cache (attach, detach) was called with work in
    /// flight.
    #[error("the cache is not idle: {0}")]
    NotIdle(String),
    /// The tree refused an operation.
    #[error(transparent)]
    Core(#[from] hicache_core::CoreError),
    /// The host pool refused an operation.
    #[error(transparent)]
    Host(#[from] hicache_host::HostError),
    /// The device or transfer engine failed.
    #[error(transparent)]
    Gpu(#[from] hicache_gpu::GpuError),
    /// The storage layer failed.
    #[error(transparent)]
    Storage(#[from] hicache_storage::StorageError),
    /// Ranks disagree or a peer failed.
    #[error(transparent)]
    Rank(#[from] RankError),
    /// The async runtime for L3 could not be started.
    #[error("could not start the L3 runtime: {0}")]
    Runtime(std::io::Error),
}

impl HiCacheError {
    /// A configuration error.
    pub fn config(field: &'static str, value: impl ToString, reason: impl Into<String>) -> Self {
        HiCacheError::Config {
            field,
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    /// A request error.
    pub fn request(request: u64, reason: impl Into<String>) -> Self {
        HiCacheError::Request {
            request,
            reason: reason.into(),
        }
    }
}

/// Result alias of the facade.
pub type Result<T, E = HiCacheError> = std::result::Result<T, E>;
