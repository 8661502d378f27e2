//! The error type of the simulated engine and how it maps to exit codes.

use std::path::PathBuf;

use thiserror::Error;

/// Why a simulation could not be planned or run.
#[derive(Debug, Error)]
pub enum SimError {
    /// Bad input: parameters, a trace file, a cache configuration. Exit code 2.
    #[error("{0}")]
    Usage(String),
    /// An I/O error on a named path (a trace, a scratch directory). Exit code 2.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A failure of the cache under test while the engine ran. Exit code 1.
    #[error("cache: {0}")]
    Cache(String),
    /// An error from hicache-core (e.g. an invalid KV shape). Exit code 2.
    #[error(transparent)]
    Core(#[from] hicache_core::CoreError),
    /// An error from a storage backend or its configuration.
    #[error(transparent)]
    Storage(#[from] hicache_storage::StorageError),
}

impl SimError {
    /// The process exit code for this error: 2 for bad input, 1 for run-time failures.
    pub fn exit_code(&self) -> u8 {
        match self {
            SimError::Usage(_) | SimError::Io { .. } | SimError::Core(_) => 2,
            SimError::Cache(_) => 1,
            SimError::Storage(e) if e.is_bad_config() => 2,
            SimError::Storage(_) => 1,
        }
    }

    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| SimError::Io { path, source }
    }
}

/// Result alias of the simulated engine.
pub type Result<T, E = SimError> = std::result::Result<T, E>;
