//! # hicache-cuda-emu
//!
//! Test support only; never linked by a product crate.
//!
//! - [`cpu_kernels`]: the transfer kernels' exact CUDA source (`hicache-gpu/src/kernels.cu`)
//!   compiled as host C++ with a small shim (`csrc/cuda_shim.h`) and run for every block and
//!   thread of a grid, every global access optionally checked.
#![warn(missing_docs)]

pub mod cpu_kernels;
pub mod driver;
pub mod error;

pub use cpu_kernels::{AccessCheck, CpuKernel};
pub use error::{EmuError, Result};
