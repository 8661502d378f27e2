//! Driver-call helpers shared by the emulator's test files (each file is its own process).
//!
//! Every `unsafe` block below is one driver call with valid out-pointers.
#![allow(clippy::undocumented_unsafe_blocks, dead_code)]

use std::ffi::c_void;
use std::ptr::null_mut;

use hicache_cuda_emu::driver::api::{self, rc};

/// `cuInit(0)`, asserted.
pub fn init() {
    assert_eq!(unsafe { api::cuInit(0) }, rc::SUCCESS);
}

/// A device allocation of `n` bytes, asserted.
pub fn alloc(n: usize) -> u64 {
    let mut p = 0u64;
    assert_eq!(unsafe { api::cuMemAlloc_v2(&mut p, n) }, rc::SUCCESS);
    p
}

/// A non-blocking stream, asserted.
pub fn stream() -> *mut c_void {
    let mut s = null_mut();
    assert_eq!(unsafe { api::cuStreamCreate(&mut s, 1) }, rc::SUCCESS);
    s
}
