//! The error type of the bench binary and how it maps to exit codes.

use std::path::PathBuf;

use thiserror::Error;

/// Why a bench command failed.
#[derive(Debug, Error)]
pub enum BenchError {
    /// Bad input from the user: flags, parameters, input files. Exit code 2.
    #[error("{0}")]
    Usage(String),
    /// An I/O error on a named path. Exit code 2 when the path was given by the user.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A check that found missing or wrong data (e.g. `storage-check`). Exit code 1.
    #[error("check failed: {0}")]
    CheckFailed(String),
    /// A failure of the cache under test in the simulated engine. Exit code 1.
    #[error("cache: {0}")]
    Cache(String),
    /// An error from hicache-core.
    #[error(transparent)]
    Core(#[from] hicache_core::CoreError),
    /// An error from a storage backend or its configuration.
    #[error(transparent)]
    Storage(#[from] hicache_storage::StorageError),
}

impl BenchError {
    /// The process exit code for this error: 2 for bad input, 1 for failed checks and
    /// run-time failures.
    pub fn exit_code(&self) -> u8 {
        match self {
            BenchError::Usage(_) | BenchError::Io { .. } | BenchError::Core(_) => 2,
            BenchError::CheckFailed(_) | BenchError::Cache(_) => 1,
            BenchError::Storage(e) => match e {
                hicache_storage::StorageError::Config { .. }
                | hicache_storage::StorageError::ConfigSyntax { .. }
                | hicache_storage::StorageError::UnknownBackend { .. } => 2,
                _ => 1,
            },
        }
    }

    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| BenchError::Io { path, source }
    }
}

/// Result alias of the bench.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;
