//! The emulated driver's ordering and checks, called through its exported entry points
//! (linked from the rlib: the same code the cdylib exports as `libcuda.so`).
//!
//! Every `unsafe` block below is one driver call whose pointers are live locals or buffers of
//! the test and whose handles came from the driver, which is the entry points' whole contract.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::ffi::CString;
use std::ptr::null_mut;

use hicache_cuda_emu::driver::api::{self, rc};
use hicache_cuda_emu::driver::stats;

mod common;
use common::{alloc, init, stream};

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

fn attrs(order: u32) -> api::MemcpyAttributes {
    let hint = api::MemLocation { kind: 0, id: 0 };
    api::MemcpyAttributes {
        src_access_order: order,
        src_loc_hint: hint,
        dst_loc_hint: hint,
        flags: 0,
    }
}

#[test]
fn batched_copies_check_their_stream_attributes_and_operands() {
    init();
    let (d, s) = (alloc(256), stream());
    let pinned = vec![9u8; 256];
    assert_eq!(
        unsafe { api::cuMemHostRegister_v2(pinned.as_ptr() as *mut _, 256, 0) },
        rc::SUCCESS
    );
    let p = pinned.as_ptr() as u64;
    // Two host-to-device copies and one device-to-device copy in one call.
    let dsts = [d, d + 100, d + 200];
    let srcs = [p, p + 10, d];
    let sizes = [50usize, 20, 40];
    let stream_order = [attrs(1)];
    let batch = |dsts: &[u64], srcs: &[u64], attrs: &[api::MemcpyAttributes], idxs: &[usize], s| unsafe {
        api::cuMemcpyBatchAsync_v2(
            dsts.as_ptr(),
            srcs.as_ptr(),
            sizes.as_ptr(),
            dsts.len(),
            attrs.as_ptr(),
            idxs.as_ptr(),
            attrs.len(),
            s,
        )
    };
    assert_eq!(
        batch(&dsts[..2], &srcs[..2], &stream_order, &[0], s),
        rc::SUCCESS
    );
    assert_eq!(unsafe { api::cuStreamSynchronize(s) }, rc::SUCCESS);
    assert_eq!(
        batch(&dsts[2..], &srcs[2..], &stream_order, &[0], s),
        rc::SUCCESS
    );
    assert_eq!(unsafe { api::cuStreamSynchronize(s) }, rc::SUCCESS);
    let mut back = [0u8; 256];
    assert_eq!(
        unsafe { api::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d, 256) },
        rc::SUCCESS
    );
    assert!(back[..50].iter().all(|&b| b == 9) && back[100..120].iter().all(|&b| b == 9));
    assert!(
        back[200..240].iter().all(|&b| b == 9),
        "device-to-device copy"
    );
    // The legacy NULL stream, an attribute table not starting at copy 0, an invalid access
    // order, a copy past its allocation and a stream-ordered pageable source are refused.
    assert_eq!(
        batch(&dsts[..2], &srcs[..2], &stream_order, &[0], null_mut()),
        rc::INVALID_VALUE
    );
    assert_eq!(
        batch(&dsts[..2], &srcs[..2], &stream_order, &[1], s),
        rc::INVALID_VALUE
    );
    assert_eq!(
        batch(&dsts[..2], &srcs[..2], &[attrs(0)], &[0], s),
        rc::INVALID_VALUE
    );
    assert_eq!(
        batch(&[d + 230], &[p], &stream_order, &[0], s),
        rc::INVALID_VALUE
    );
    let pageable = [1u8; 64];
    assert_eq!(
        batch(&[d], &[pageable.as_ptr() as u64], &stream_order, &[0], s),
        rc::INVALID_VALUE
    );
    // Out of stream order, a pageable source is read at the call.
    assert_eq!(
        batch(&[d], &[pageable.as_ptr() as u64], &[attrs(2)], &[0], s),
        rc::SUCCESS
    );
    assert_eq!(unsafe { api::cuStreamSynchronize(s) }, rc::SUCCESS);
    assert_eq!(
        unsafe { api::cuMemHostUnregister(pinned.as_ptr() as *mut _) },
        rc::SUCCESS
    );
}

#[test]
fn vmm_mappings_are_one_range_for_copies_and_one_chunk_for_address_ranges() {
    init();
    const CHUNK: usize = 2 << 20;
    let prop = [0u8; 64];
    let mut base = 0u64;
    assert_eq!(
        unsafe { api::cuMemAddressReserve(&mut base, 2 * CHUNK, 0, 0, 0) },
        rc::SUCCESS
    );
    let mut handles = [0u64; 2];
    for (i, h) in handles.iter_mut().enumerate() {
        assert_eq!(
            unsafe { api::cuMemCreate(h, CHUNK, prop.as_ptr().cast(), 0) },
            rc::SUCCESS
        );
        assert_eq!(
            unsafe { api::cuMemMap(base + (i * CHUNK) as u64, CHUNK, 0, *h, 0) },
            rc::SUCCESS
        );
    }
    let (mut b, mut n) = (0u64, 0usize);
    assert_eq!(
        unsafe { api::cuMemGetAddressRange_v2(&mut b, &mut n, base + CHUNK as u64 + 5) },
        rc::SUCCESS
    );
    assert_eq!((b, n), (base + CHUNK as u64, CHUNK), "one chunk per query");
    // A copy across the boundary is one contiguous range.
    let s = stream();
    let across = base + CHUNK as u64 - 8;
    assert_eq!(
        unsafe { api::cuMemsetD8Async(across, 4, 16, s) },
        rc::SUCCESS
    );
    assert_eq!(unsafe { api::cuStreamSynchronize(s) }, rc::SUCCESS);
    let mut h = 0u64;
    assert_eq!(
        unsafe { api::cuMemRetainAllocationHandle(&mut h, across as *mut _) },
        rc::SUCCESS
    );
    assert_eq!(unsafe { api::cuMemRelease(h) }, rc::SUCCESS);
    let plain = alloc(64);
    assert_eq!(
        unsafe { api::cuMemRetainAllocationHandle(&mut h, plain as *mut _) },
        rc::INVALID_VALUE,
        "cuMemAlloc memory has no allocation handle"
    );
    // Unmapped, the second chunk is gone: copies into it fail, the first chunk stays.
    assert_eq!(
        unsafe { api::cuMemUnmap(base + CHUNK as u64, CHUNK) },
        rc::SUCCESS
    );
    assert_eq!(
        unsafe { api::cuMemsetD8Async(across, 4, 16, s) },
        rc::INVALID_VALUE
    );
    assert_eq!(
        unsafe { api::cuMemsetD8Async(across, 4, 8, s) },
        rc::SUCCESS
    );
    assert_eq!(unsafe { api::cuStreamSynchronize(s) }, rc::SUCCESS);
    assert_eq!(
        unsafe { api::cuMemAddressFree(base, 2 * CHUNK) },
        rc::INVALID_VALUE,
        "still mapped"
    );
    assert_eq!(unsafe { api::cuMemUnmap(base, CHUNK) }, rc::SUCCESS);
    for h in handles {
        assert_eq!(unsafe { api::cuMemRelease(h) }, rc::SUCCESS);
    }
    assert_eq!(
        unsafe { api::cuMemAddressFree(base, 2 * CHUNK) },
        rc::SUCCESS
    );
}
