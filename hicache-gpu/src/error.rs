//! The error type of `hicache-gpu`.

use hicache_core::KvShape;
use hicache_host::{AllocError, HostError, MambaShape};
use thiserror::Error;

/// Everything that can go wrong in `hicache-gpu`. Each variant names what and where.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum GpuError {
    /// The CUDA driver library (libcuda) cannot be loaded.
    #[error("CUDA driver unavailable: {0}")]
    NoDriver(String),
    /// This build of `hicache-gpu` has no CUDA backend (its `cuda` feature is off).
    #[error(
        "{0}: hicache-gpu was built without its `cuda` feature (enable the `cuda` feature of \
         hicache / hicache-gpu, on by default) or use the sim device"
    )]
    CudaNotBuilt(String),
    /// The NVRTC library cannot be loaded (needed to compile the transfer kernels).
    #[error("NVRTC unavailable: {0}")]
    NoNvrtc(String),
    /// A CUDA driver call failed.
    #[error("CUDA {call} failed: {message}")]
    Driver {
        /// The driver call.
        call: &'static str,
        /// The driver's error name and string.
        message: String,
    },
    /// Releasing an earlier CUDA handle (in a drop) failed; reported by the next call on the
    /// device, naming the release call rather than the call at hand.
    #[error(
        "CUDA {call} failed while releasing an earlier handle (reported at the next call): {message}"
    )]
    ReleaseFailed {
        /// The release call.
        call: &'static str,
        /// The driver's error name and string.
        message: String,
    },
    /// NVRTC could not compile the transfer kernels.
    #[error("compiling the transfer kernels for {arch} failed: {log}")]
    Compile {
        /// Target architecture (`default` for NVRTC's default).
        arch: String,
        /// The compiler log.
        log: String,
    },
    /// A host pool error.
    #[error(transparent)]
    Host(#[from] HostError),
    /// A device page allocator error (double free, out of range).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// Two lists that must be equally long are not.
    #[error("length mismatch: {what}: {left} vs {right}")]
    LengthMismatch {
        /// What was compared.
        what: &'static str,
        /// First length.
        left: usize,
        /// Second length.
        right: usize,
    },
    /// A page index out of range of its pool.
    #[error(
        "{pool} page {page} at position {position} is out of range (the pool has {capacity} pages)"
    )]
    PageOutOfRange {
        /// `device` or `host`.
        pool: &'static str,
        /// The offending page.
        page: u32,
        /// Its position in the list.
        position: usize,
        /// Pages in the pool.
        capacity: usize,
    },
    /// A destination page listed twice in one transfer (two sources would race for it).
    #[error("{pool} page {page} is a destination twice in one transfer")]
    DuplicateDestination {
        /// `device` or `host`.
        pool: &'static str,
        /// The page.
        page: u32,
    },
    /// The host and device pools hold different KV shapes.
    #[error("host pool shape {host:?} does not match device pool shape {device:?}")]
    ShapeMismatch {
        /// Host pool shape.
        host: KvShape,
        /// Device pool shape.
        device: KvShape,
    },
    /// A slot that is not allocated in its pool was given to a transfer or a slot access.
    #[error("{pool} slot {slot} at position {position} is not allocated")]
    SlotNotAllocated {
        /// `device state` or `host state`.
        pool: &'static str,
        /// The slot.
        slot: u32,
        /// Its position in the list.
        position: usize,
    },
    /// A copy of a state slot onto itself.
    #[error("state slot {slot} cannot be copied onto itself")]
    SameSlot {
        /// The slot.
        slot: u32,
    },
    /// The host and device state pools hold different Mamba shapes.
    #[error("host state pool shape {host:?} does not match device state pool shape {device:?}")]
    StateShapeMismatch {
        /// Host pool shape.
        host: Box<MambaShape>,
        /// Device pool shape.
        device: Box<MambaShape>,
    },
    /// A layer index or range outside the model.
    #[error("layers {begin}..{end} out of range (the model has {layers} layers)")]
    LayerOutOfRange {
        /// First layer.
        begin: u32,
        /// One past the last layer.
        end: u32,
        /// Layers of the model.
        layers: u32,
    },
    /// A buffer smaller than the shape it is declared to hold.
    #[error("{what}: {got} bytes, at least {need} needed")]
    BufferTooSmall {
        /// Which buffer.
        what: String,
        /// Bytes available.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// Engine buffers that do not match the declared shape.
    #[error("bad registration: {0}")]
    BadRegistration(String),
    /// An invalid transfer configuration.
    #[error("invalid transfer config: {0}")]
    InvalidConfig(String),
    /// Objects of two different devices were combined.
    #[error("{0} belongs to a different device")]
    WrongDevice(&'static str),
    /// A sim stream's worker thread is gone.
    #[error("sim stream worker stopped: {0}")]
    StreamStopped(String),
}

/// Result alias of `hicache-gpu`.
pub type Result<T, E = GpuError> = std::result::Result<T, E>;

impl GpuError {
    /// Wraps a cudarc driver error with the call that failed.
    pub(crate) fn driver<E: std::fmt::Display>(call: &'static str) -> impl FnOnce(E) -> Self {
        move |e| GpuError::Driver {
            call,
            message: e.to_string(),
        }
    }
}
