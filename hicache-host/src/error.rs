//! The error types of `hicache-host`.

use thiserror::Error;

/// Errors of a [`PageAllocator`](crate::PageAllocator): a free that would corrupt the free list.
///
/// A failed `free` changes nothing: either every slot of the call is released or none is.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AllocError {
    /// A slot index at or past the pool's capacity.
    #[error("page {slot} is out of range (the pool has {capacity} pages)")]
    OutOfRange {
        /// The offending page index.
        slot: u32,
        /// Pages in the pool.
        capacity: usize,
    },
    /// A slot that is not allocated (freed twice, never allocated, or twice in one call).
    #[error("double free of page {slot} (it is not allocated)")]
    DoubleFree {
        /// The offending page index.
        slot: u32,
    },
}

/// Everything that can go wrong in `hicache-host`. Each variant names the offending value.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum HostError {
    /// An invalid KV shape (zero dimension, page size out of range).
    #[error("invalid KV shape: {0}")]
    Shape(#[from] hicache_core::CoreError),
    /// A pool size that cannot be honoured (zero pages, ratio not positive, overflow).
    #[error("invalid host pool size: {0}")]
    BadSize(String),
    /// Not enough host RAM for the pool once the reserve is kept free.
    #[error(
        "host pool of {requested} bytes does not fit: {available} bytes available, \
         {reserve} bytes must stay free (lower the size or the reserve)"
    )]
    InsufficientMemory {
        /// Bytes the pool needs.
        requested: u64,
        /// `MemAvailable` of the machine.
        available: u64,
        /// Bytes kept free for the rest of the process and the system.
        reserve: u64,
    },
    /// mmap / madvise failed.
    #[error("{call} of {len} bytes failed: {source}")]
    Map {
        /// The system call.
        call: &'static str,
        /// Bytes requested.
        len: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Huge pages were required but neither hugetlb nor transparent huge pages are available.
    #[error("huge pages required but unavailable: {0}")]
    HugePagesUnavailable(String),
    /// A page index out of range of the pool.
    #[error("page {page} is out of range (the pool has {capacity} pages)")]
    PageOutOfRange {
        /// The offending page index.
        page: u32,
        /// Pages in the pool.
        capacity: usize,
    },
    /// A page part index out of range.
    #[error("part {part} of a page is out of range (a page has {parts} parts)")]
    PartOutOfRange {
        /// The offending part.
        part: usize,
        /// Parts per page.
        parts: usize,
    },
    /// A buffer of the wrong length for a page copy.
    #[error("{what}: buffer is {got} bytes, a page is {expected} bytes")]
    BufferSize {
        /// Which call.
        what: &'static str,
        /// Length given.
        got: usize,
        /// Length needed.
        expected: usize,
    },
    /// An allocator error (double free, out of range).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// An invalid Mamba state geometry or layout.
    #[error("invalid Mamba state pool: {0}")]
    BadMambaShape(String),
    /// An error of one component's pool of a host pool group; the source names the slot.
    #[error("{component} host pool: {source}")]
    Component {
        /// The component whose pool failed.
        component: crate::component::HostComponent,
        /// What went wrong there.
        #[source]
        source: Box<HostError>,
    },
    /// A component the host pool group was built without.
    #[error("the host pool group has no {0} pool")]
    NoComponent(crate::component::HostComponent),
}

/// Result alias of `hicache-host`.
pub type Result<T, E = HostError> = std::result::Result<T, E>;
