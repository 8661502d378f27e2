//! The crate's error type and how it reaches Python.
//!
//! Bad input (a malformed key, mismatched counts, an unknown config field, a backend that is
//! not compiled in) becomes a `ValueError`; a closed store or a failing backend becomes a
//! `RuntimeError`. Nothing panics across the Python boundary.

use hicache_storage::StorageError;
use pyo3::PyErr;
use pyo3::exceptions::{PyRuntimeError, PyValueError};

/// Everything that can go wrong in a call from Python.
#[derive(Debug, thiserror::Error)]
pub enum BindingError {
    /// A page hash is not 64 hexadecimal digits.
    #[error("key {index} ({key:?}) is not a page hash of 64 hexadecimal digits")]
    BadKey {
        /// Position in the batch.
        index: usize,
        /// The key as given (cut to 80 characters).
        key: String,
    },
    /// A prefix key is not a page hash.
    #[error("prefix key {index} ({key:?}) is not a page hash of 64 hexadecimal digits")]
    BadPrefixKey {
        /// Position in the prefix.
        index: usize,
        /// The key as given (cut to 80 characters).
        key: String,
    },
    /// A namespace id is not 32 hexadecimal digits.
    #[error("namespace {0:?} is not a namespace id of 32 hexadecimal digits")]
    BadNamespace(String),
    /// The pieces of a batch do not divide evenly among its pages.
    #[error(
        "{op}: {pieces} memory pieces (and {sizes} sizes) for {keys} keys: \
         every page needs the same number of pieces, one size per pointer"
    )]
    PieceCount {
        /// The operation.
        op: &'static str,
        /// Keys in the batch.
        keys: usize,
        /// Pointers given.
        pieces: usize,
        /// Sizes given.
        sizes: usize,
    },
    /// A piece is empty or null.
    #[error(
        "{op}: piece {index} has pointer {ptr:#x} and size {size}: pieces must be non-null and non-empty"
    )]
    BadPiece {
        /// The operation.
        op: &'static str,
        /// Position of the piece.
        index: usize,
        /// Its address.
        ptr: usize,
        /// Its length.
        size: usize,
    },
    /// Two destination pieces share memory.
    #[error(
        "{op}: destination pieces overlap at address {ptr:#x}: every page must have its own memory"
    )]
    Overlap {
        /// The operation.
        op: &'static str,
        /// Where the overlap starts.
        ptr: usize,
    },
    /// `kv_interleaved` with an odd number of pieces per page.
    #[error(
        "{op}: kv_interleaved needs an even number of pieces per page (K and V per layer), got {pieces}"
    )]
    OddInterleave {
        /// The operation.
        op: &'static str,
        /// Pieces per page.
        pieces: usize,
    },
    /// A name that is not one of the accepted spellings.
    #[error("{what} {value:?} is not supported (expected one of: {expected})")]
    Unsupported {
        /// What was named (layout, dtype, attention kind).
        what: &'static str,
        /// The value given.
        value: String,
        /// The accepted values.
        expected: &'static str,
    },
    /// The backend exists in hicache-rs but this build was compiled without it.
    #[error(
        "backend `{name}` is not compiled into this build of hicache-rs (cargo feature `{feature}` \
         of hicache-python); compiled in: {compiled}"
    )]
    NotCompiled {
        /// The backend.
        name: String,
        /// The cargo feature that builds it.
        feature: &'static str,
        /// The backends this build has.
        compiled: String,
    },
    /// The store was closed.
    #[error("{0}: the store is closed")]
    Closed(&'static str),
    /// The tokio runtime could not start.
    #[error("cannot start the I/O runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// An error of the namespace or hash logic.
    #[error(transparent)]
    Core(#[from] hicache_core::CoreError),
    /// An error of the storage layer or a backend.
    #[error(transparent)]
    Storage(#[from] StorageError),
}

impl BindingError {
    /// Whether the caller's input is at fault (as opposed to the backend or the store's state).
    pub fn is_bad_input(&self) -> bool {
        match self {
            BindingError::Closed(_) | BindingError::Runtime(_) => false,
            BindingError::Storage(e) => matches!(
                e,
                StorageError::Config { .. }
                    | StorageError::ConfigSyntax { .. }
                    | StorageError::UnknownBackend { .. }
                    | StorageError::LengthMismatch { .. }
                    | StorageError::BatchTooLarge { .. }
            ),
            _ => true,
        }
    }
}

impl From<BindingError> for PyErr {
    fn from(e: BindingError) -> Self {
        if e.is_bad_input() {
            PyValueError::new_err(e.to_string())
        } else {
            PyRuntimeError::new_err(e.to_string())
        }
    }
}

/// The crate's result type.
pub type Result<T, E = BindingError> = std::result::Result<T, E>;
