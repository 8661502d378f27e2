//! The error type of the operator tools and how it maps to exit codes.

use std::path::PathBuf;

use thiserror::Error;

/// Why a tool failed.
#[derive(Debug, Error)]
pub enum CliError {
    /// Bad input from the user: flags, parameters, input. Exit code 2.
    #[error("{0}")]
    Usage(String),
    /// An I/O error on a named path (or `<stdin>` / `<stdout>`). Exit code 2.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A check that found missing or wrong data (`storage-check`, `storage-write`). Exit code 1.
    #[error("check failed: {0}")]
    CheckFailed(String),
    /// An error from hicache-core (e.g. a bad namespace). Exit code 2.
    #[error(transparent)]
    Core(#[from] hicache_core::CoreError),
    /// An error from a storage backend or its configuration: exit code 2 for a bad
    /// configuration, 1 for a failure of the backend.
    #[error(transparent)]
    Storage(#[from] hicache_storage::StorageError),
    /// The facade could not build its registry of compiled-in backends. Exit code 1.
    #[error(transparent)]
    Registry(#[from] hicache::HiCacheError),
}

impl CliError {
    /// The process exit code for this error: 2 for bad input, 1 for failed checks and
    /// run-time failures.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) | CliError::Io { .. } | CliError::Core(_) => 2,
            CliError::CheckFailed(_) | CliError::Registry(_) => 1,
            CliError::Storage(e) if e.is_bad_config() => 2,
            CliError::Storage(_) => 1,
        }
    }

    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| CliError::Io { path, source }
    }
}

/// Result alias of the tools.
pub type Result<T, E = CliError> = std::result::Result<T, E>;
