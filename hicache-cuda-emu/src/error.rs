//! Errors of the emulator's Rust API.

/// Result with [`EmuError`].
pub type Result<T> = std::result::Result<T, EmuError>;

/// What went wrong in the emulator.
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    /// No kernel of that name was compiled in.
    #[error("no CPU kernel named {0:?} (known: hicache_copy_w16/w8/w4/w2/w1)")]
    UnknownKernel(String),
    /// The parameter block differs from the kernel's.
    #[error("kernel {kernel}: parameter block of {given} bytes, the kernel takes {expected}")]
    ParamSize {
        /// Kernel name.
        kernel: String,
        /// Bytes passed.
        given: usize,
        /// `sizeof` of the kernel's parameter struct.
        expected: usize,
    },
    /// A grid or block dimension is zero.
    #[error("kernel {kernel}: empty launch dimensions grid {grid:?} block {block:?}")]
    EmptyLaunch {
        /// Kernel name.
        kernel: String,
        /// Grid size.
        grid: [u32; 3],
        /// Block size.
        block: [u32; 3],
    },
    /// The access checker refused at least one access (it was skipped).
    #[error("kernel {kernel}: illegal memory access (first: {first})")]
    IllegalAccess {
        /// Kernel name.
        kernel: String,
        /// The checker's description of the first refused access.
        first: String,
    },
}
