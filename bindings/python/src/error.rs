//! The crate's error type and how it reaches Python.
//!
//! Bad input (a malformed key, mismatched counts, an unknown config field, a backend that is
//! not compiled in, a piece outside the registered pool memory, a length no page can have)
//! becomes a `ValueError`; a closed store or a failing backend becomes a `RuntimeError`; an
//! allocation that fails for a length that is allowed becomes a `MemoryError`. Nothing panics
//! or aborts across the Python boundary.

use hicache_storage::StorageError;
use pyo3::PyErr;
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyValueError};

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
    /// A piece lies (partly) outside every memory region registered with the store.
    #[error(
        "{op}: piece {index} ({ptr:#x}, {size} bytes) is not wholly inside the memory \
         registered with set_allowed_regions ({regions}): refusing to touch memory outside the pool"
    )]
    OutsideRegions {
        /// The operation.
        op: &'static str,
        /// Position of the piece (as given, before any reordering).
        index: usize,
        /// Its address.
        ptr: usize,
        /// Its length.
        size: usize,
        /// The registered regions, for the message.
        regions: String,
    },
    /// The pieces of one page add up to more than the address space.
    #[error("{op}: the pieces of page {page} add up to more than the address space")]
    PageOverflow {
        /// The operation.
        op: &'static str,
        /// Position of the page.
        page: usize,
    },
    /// A job's namespaces and keys differ in number.
    #[error("{op}: {namespaces} namespaces for {keys} keys: one namespace per key")]
    NamespaceCount {
        /// The operation.
        op: &'static str,
        /// Keys in the job.
        keys: usize,
        /// Namespaces given.
        namespaces: usize,
    },
    /// `set_allowed_regions` or `add_allowed_regions` without any region.
    #[error(
        "allowed regions (set_allowed_regions / add_allowed_regions): no region given \
         (expected a list of (address, length) pairs)"
    )]
    NoRegions,
    /// A region to register is null, empty or runs past the end of the address space.
    #[error(
        "allowed regions (set_allowed_regions / add_allowed_regions): region {index} has \
         address {ptr:#x} and length {len}: regions must be non-null, non-empty and inside \
         the address space"
    )]
    BadRegion {
        /// Position of the region.
        index: usize,
        /// Its address.
        ptr: usize,
        /// Its length.
        len: usize,
    },
    /// `set_allowed_regions` was already called on this store (or regions were added).
    #[error(
        "set_allowed_regions: this store already has its regions ({0}); they cannot be \
         replaced (add_allowed_regions adds the buffers of pools registered later)"
    )]
    RegionsAlreadySet(String),
    /// A requested length is above what a page may be.
    #[error("{op}: length {length} is not a page length this store can read (1 to {max} bytes)")]
    BadLength {
        /// The operation.
        op: &'static str,
        /// The length asked for.
        length: usize,
        /// The largest page the store reads.
        max: usize,
    },
    /// The memory for a read could not be allocated.
    #[error("{op}: cannot allocate {bytes} bytes for the pages read")]
    OutOfMemory {
        /// The operation.
        op: &'static str,
        /// The bytes asked for.
        bytes: usize,
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
    /// A bytes read that asks for more than one call may read.
    #[error(
        "{op}: {keys} pages of {length} bytes ask for more than the {max} bytes one call may \
         read: split the keys into calls of at most {max} bytes"
    )]
    CallTooLarge {
        /// The operation.
        op: &'static str,
        /// Keys asked for.
        keys: usize,
        /// Bytes per page asked for.
        length: usize,
        /// The bound of one call.
        max: usize,
    },
    /// A region to register is not memory this process has mapped readable and writable.
    #[error(
        "allowed regions (set_allowed_regions / add_allowed_regions): region {index} \
         ({ptr:#x}, {len} bytes) is not readable and writable memory of this process: {why}"
    )]
    NotMapped {
        /// Position of the region.
        index: usize,
        /// Its address.
        ptr: usize,
        /// Its length.
        len: usize,
        /// What is wrong: the first address not mapped, or not readable and writable.
        why: String,
    },
    /// The process's memory map could not be read to check regions.
    #[error("allowed regions: cannot read this process's memory map (/proc/self/maps): {0}")]
    Maps(#[source] std::io::Error),
    /// The job queue is full: the job was refused and will have no completion.
    #[error(
        "{op}: refused: {capacity} jobs already wait for the store's {workers} job workers \
         (the backend is slower than the jobs come, or stalled)"
    )]
    JobQueueFull {
        /// The operation.
        op: &'static str,
        /// Jobs the queue holds.
        capacity: usize,
        /// Worker threads.
        workers: usize,
    },
    /// A host pool's geometry (`Store.add_pool`) cannot describe its pages.
    #[error("host pool {pool}: {why}")]
    BadPoolGeometry {
        /// The pool's name.
        pool: String,
        /// What is wrong with it.
        why: String,
    },
    /// `Store.add_pool` of a name already registered.
    #[error("host pool {0:?} is already registered with this store")]
    PoolRegistered(String),
    /// `close` cancelled the call: its grace ran out while the call waited on the backend.
    #[error("{0}: cancelled: the store was closed while the call waited on its backend")]
    Cancelled(&'static str),
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
    /// The facade could not build its registry of compiled-in backends.
    #[error(transparent)]
    Registry(#[from] hicache::HiCacheError),
}

impl BindingError {
    /// Whether the caller's input is at fault (as opposed to the backend or the store's state).
    pub fn is_bad_input(&self) -> bool {
        match self {
            BindingError::Closed(_)
            | BindingError::Cancelled(_)
            | BindingError::JobQueueFull { .. }
            | BindingError::Maps(_)
            | BindingError::Runtime(_)
            | BindingError::Registry(_)
            | BindingError::OutOfMemory { .. } => false,
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
        if matches!(e, BindingError::OutOfMemory { .. }) {
            PyMemoryError::new_err(e.to_string())
        } else if e.is_bad_input() {
            PyValueError::new_err(e.to_string())
        } else {
            PyRuntimeError::new_err(e.to_string())
        }
    }
}

/// The crate's result type.
pub type Result<T, E = BindingError> = std::result::Result<T, E>;
