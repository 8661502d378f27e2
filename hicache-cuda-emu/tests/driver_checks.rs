//! The emulated driver's ordering and checks, called through its exported entry points
//! (linked from the rlib: the same code the cdylib exports as `libcuda.so`).
//!
//! Every `unsafe` block below is one driver call whose pointers are live locals or buffers of
//! the test and whose handles came from the driver, which is the entry points' whole contract.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::ffi::{CString, c_void};
use std::ptr::null_mut;

use hicache_cuda_emu::driver::api::{self, rc};
use hicache_cuda_emu::driver::stats;

fn init() {
    // SAFETY: plain driver calls with valid out-pointers throughout this file.
    assert_eq!(unsafe { api::cuInit(0) }, rc::SUCCESS);
}

fn alloc(n: usize) -> u64 {
    let mut p = 0u64;
    assert_eq!(unsafe { api::cuMemAlloc_v2(&mut p, n) }, rc::SUCCESS);
    p
}

fn stream() -> *mut c_void {
    let mut s = null_mut();
    assert_eq!(unsafe { api::cuStreamCreate(&mut s, 1) }, rc::SUCCESS);
    s
}

#[test]
fn async_copy_from_pageable_memory_is_an_error() {
    init();
    let (d, s) = (alloc(64), stream());
    let src = [7u8; 64];
    let r = unsafe { api::cuMemcpyHtoDAsync_v2(d, src.as_ptr().cast(), 64, s) };
    assert_eq!(r, rc::INVALID_VALUE);
    // Registered, the same copy is fine and lands once the stream is synchronised.
    let r = unsafe { api::cuMemHostRegister_v2(src.as_ptr() as *mut _, 64, 0) };
    assert_eq!(r, rc::SUCCESS);
    assert_eq!(
        unsafe { api::cuMemcpyHtoDAsync_v2(d, src.as_ptr().cast(), 64, s) },
        rc::SUCCESS
    );
    assert_eq!(unsafe { api::cuStreamSynchronize(s) }, rc::SUCCESS);
    let mut back = [0u8; 64];
    assert_eq!(
        unsafe { api::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d, 64) },
        rc::SUCCESS
    );
    assert_eq!(back, [7u8; 64]);
    assert_eq!(
        unsafe { api::cuMemHostUnregister(src.as_ptr() as *mut _) },
        rc::SUCCESS
    );
}

#[test]
fn out_of_bounds_and_use_after_free_are_refused() {
    init();
    let d = alloc(100);
    let mut buf = [0u8; 101];
    let r = unsafe { api::cuMemcpyDtoH_v2(buf.as_mut_ptr().cast(), d, 101) };
    assert_eq!(r, rc::INVALID_VALUE, "one byte past the allocation");
    assert_eq!(unsafe { api::cuMemFree_v2(d) }, rc::SUCCESS);
    let r = unsafe { api::cuMemcpyDtoH_v2(buf.as_mut_ptr().cast(), d, 10) };
    assert_eq!(r, rc::INVALID_VALUE, "use after free");
    assert_eq!(
        unsafe { api::cuMemFree_v2(d) },
        rc::INVALID_VALUE,
        "double free"
    );
}

#[test]
fn events_order_streams() {
    init();
    let (d, a, b) = (alloc(8), stream(), stream());
    let mut ev = null_mut();
    assert_eq!(unsafe { api::cuEventCreate(&mut ev, 2) }, rc::SUCCESS);
    assert_eq!(
        unsafe { api::cuEventQuery(ev) },
        rc::SUCCESS,
        "never recorded: done"
    );
    assert_eq!(unsafe { api::cuMemsetD8Async(d, 3, 8, a) }, rc::SUCCESS);
    assert_eq!(unsafe { api::cuEventRecord(ev, a) }, rc::SUCCESS);
    assert_eq!(unsafe { api::cuStreamWaitEvent(b, ev, 0) }, rc::SUCCESS);
    assert_eq!(unsafe { api::cuMemsetD8Async(d, 5, 4, b) }, rc::SUCCESS);
    assert_eq!(unsafe { api::cuStreamSynchronize(b) }, rc::SUCCESS);
    assert_eq!(unsafe { api::cuEventQuery(ev) }, rc::SUCCESS);
    let mut back = [0u8; 8];
    assert_eq!(
        unsafe { api::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d, 8) },
        rc::SUCCESS
    );
    assert_eq!(back, [5, 5, 5, 5, 3, 3, 3, 3]);
}

fn memcpy2d(src_type: u32, dst_type: u32, src: u64, dst: u64, w: usize, pitch: usize) -> [u64; 16] {
    // A CUDA_MEMCPY2D laid out as the driver's: 16 eight-byte slots (the memory types are u32
    // followed by padding).
    let mut c = [0u64; 16];
    c[2] = src_type as u64;
    c[3] = src;
    c[4] = src;
    c[6] = pitch as u64;
    c[9] = dst_type as u64;
    c[10] = dst;
    c[11] = dst;
    c[13] = pitch as u64;
    c[14] = w as u64;
    c[15] = 2;
    c
}

#[test]
fn bad_2d_copies_are_refused() {
    init();
    let (d, e, s) = (alloc(64), alloc(64), stream());
    let ok = memcpy2d(2, 2, d, e, 16, 32);
    let r = unsafe { api::cuMemcpy2DAsync_v2(ok.as_ptr().cast(), s) };
    assert_eq!(r, rc::SUCCESS);
    let wide = memcpy2d(2, 2, d, e, 40, 32);
    let r = unsafe { api::cuMemcpy2DAsync_v2(wide.as_ptr().cast(), s) };
    assert_eq!(r, rc::INVALID_VALUE, "width > pitch");
    let zeroed = memcpy2d(0, 2, d, e, 16, 32);
    let r = unsafe { api::cuMemcpy2DAsync_v2(zeroed.as_ptr().cast(), s) };
    assert_eq!(r, rc::INVALID_VALUE, "memory type 0");
    assert_eq!(unsafe { api::cuStreamSynchronize(s) }, rc::SUCCESS);
}

#[test]
fn modules_must_be_our_kernels_with_matching_parameter_blocks() {
    init();
    let mut m = null_mut();
    let foreign =
        CString::new(".version 8.0\n.entry other(\n.param .u64 other_param_0\n)").unwrap();
    let r = unsafe { api::cuModuleLoadData(&mut m, foreign.as_ptr().cast()) };
    assert_eq!(r, rc::INVALID_IMAGE);
    let wrong = CString::new(
        ".entry hicache_copy_w16(\n.param .align 8 .b8 hicache_copy_w16_param_0[104]\n)",
    )
    .unwrap();
    let r = unsafe { api::cuModuleLoadData(&mut m, wrong.as_ptr().cast()) };
    assert_eq!(r, rc::INVALID_IMAGE, "parameter block of the wrong size");
    let right = CString::new(
        ".entry hicache_copy_w16(\n.param .align 8 .b8 hicache_copy_w16_param_0[112]\n)",
    )
    .unwrap();
    assert_eq!(
        unsafe { api::cuModuleLoadData(&mut m, right.as_ptr().cast()) },
        rc::SUCCESS
    );
    let mut f = null_mut();
    let name = CString::new("hicache_copy_w16").unwrap();
    assert_eq!(
        unsafe { api::cuModuleGetFunction(&mut f, m, name.as_ptr()) },
        rc::SUCCESS
    );
    let before = stats::hicache_emu_launch_count();
    let name = CString::new("cuModuleGetFunction").unwrap();
    assert!(unsafe { stats::hicache_emu_call_count(name.as_ptr()) } >= 1);
    assert!(stats::hicache_emu_launch_count() >= before);
}
