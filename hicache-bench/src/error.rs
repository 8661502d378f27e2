//! The error type of the bench binary and how it maps to exit codes.
//!
//! A bench fails the way an operator tool does (bad input, a failed check, an I/O error, a
//! backend error: [`CliError`]) or the way the simulated engine does ([`SimError`]); each
//! keeps its own exit code.

use std::path::PathBuf;

use hicache_cli::CliError;
use hicache_sim::SimError;
use thiserror::Error;

/// Why a bench command failed.
#[derive(Debug, Error)]
pub enum BenchError {
    /// Bad input, a failed check, an I/O or a backend error, as the operator tools report
    /// them (and an error of a tool run through its `hicache-bench` alias).
    #[error(transparent)]
    Tool(#[from] CliError),
    /// An error of the simulated engine (planning or running the main job).
    #[error(transparent)]
    Sim(#[from] SimError),
}

impl BenchError {
    /// The process exit code for this error: 2 for bad input, 1 for failed checks and
    /// run-time failures.
    pub fn exit_code(&self) -> u8 {
        match self {
            BenchError::Tool(e) => e.exit_code(),
            BenchError::Sim(e) => e.exit_code(),
        }
    }

    /// Bad input from the user: flags, parameters, input files (exit code 2).
    pub fn usage(msg: impl Into<String>) -> Self {
        CliError::Usage(msg.into()).into()
    }

    /// A check that found missing or wrong data, or a run-time failure (exit code 1).
    pub fn check_failed(msg: impl Into<String>) -> Self {
        CliError::CheckFailed(msg.into()).into()
    }

    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let io = CliError::io(path);
        move |source| io(source).into()
    }
}

impl From<hicache_storage::StorageError> for BenchError {
    fn from(e: hicache_storage::StorageError) -> Self {
        CliError::Storage(e).into()
    }
}

impl From<hicache_core::CoreError> for BenchError {
    fn from(e: hicache_core::CoreError) -> Self {
        CliError::Core(e).into()
    }
}

/// Result alias of the bench.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;
