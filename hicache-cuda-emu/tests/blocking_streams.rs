//! The legacy NULL stream and blocking streams (created with default flags, without
//! `CU_STREAM_NON_BLOCKING`), alone in their own test process: the NULL stream is process
//! global. Work on a blocking stream waits for the NULL stream's earlier work, and NULL-stream
//! work waits for every blocking stream's earlier work, as the driver documents. (Non-blocking
//! streams are not ordered with the NULL stream: `null_stream.rs`.)
//!
//! Every `unsafe` block below is one driver call whose pointers are live locals or buffers of
//! the test and whose handles came from the driver, which is the entry points' whole contract.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::ffi::c_void;
use std::ptr::null_mut;

use hicache_cuda_emu::driver::api::{self, rc};

mod common;
use common::{alloc, init};

const N: usize = 16;

/// The legacy NULL stream's handle.
const NULL_STREAM: *mut c_void = null_mut();

/// A blocking stream (default flags), asserted.
fn blocking_stream() -> *mut c_void {
    let mut s = null_mut();
    assert_eq!(unsafe { api::cuStreamCreate(&mut s, 0) }, rc::SUCCESS);
    s
}

/// `N` bytes of pinned host memory filled with `value`, asserted.
fn pinned(value: u8) -> *mut u8 {
    let mut p = 0u64;
    let r = unsafe { api::cuMemHostAlloc((&mut p as *mut u64).cast(), N, 0) };
    assert_eq!(r, rc::SUCCESS);
    unsafe { std::ptr::write_bytes(p as *mut u8, value, N) };
    p as *mut u8
}

/// The `N` bytes at device address `d`, read with a synchronous copy.
fn device_bytes(d: u64) -> [u8; N] {
    let mut back = [0u8; N];
    let r = unsafe { api::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d, N) };
    assert_eq!(r, rc::SUCCESS);
    back
}

#[test]
fn blocking_streams_and_the_null_stream_are_ordered_both_ways() {
    init();
    let (d, d2, s) = (alloc(N), alloc(N), blocking_stream());
    let ones = pinned(1);
    assert_eq!(
        unsafe { api::cuMemcpyHtoD_v2(d, ones.cast(), N) },
        rc::SUCCESS
    );

    // A memset on the NULL stream, then a copy on a blocking stream: the copy reads the
    // memset's bytes.
    assert_eq!(unsafe { api::cuMemsetD8_v2(d, 7, N) }, rc::SUCCESS);
    let host = pinned(0);
    let r = unsafe { api::cuMemcpyDtoHAsync_v2(host.cast(), d, N, s) };
    assert_eq!(r, rc::SUCCESS);
    assert_eq!(unsafe { api::cuStreamSynchronize(s) }, rc::SUCCESS);
    let read = unsafe { std::slice::from_raw_parts(host, N) };
    assert_eq!(
        read, [7u8; N],
        "a blocking stream's copy read the bytes from before the NULL stream's memset"
    );

    // A copy on a blocking stream, then a copy on the NULL stream of what it wrote: the NULL
    // stream's copy reads the blocking stream's bytes.
    let nines = pinned(9);
    let r = unsafe { api::cuMemcpyHtoDAsync_v2(d, nines.cast(), N, s) };
    assert_eq!(r, rc::SUCCESS);
    let r = unsafe { api::cuMemcpyDtoDAsync_v2(d2, d, N, NULL_STREAM) };
    assert_eq!(r, rc::SUCCESS);
    assert_eq!(
        unsafe { api::cuStreamSynchronize(NULL_STREAM) },
        rc::SUCCESS
    );
    assert_eq!(
        device_bytes(d2),
        [9u8; N],
        "the NULL stream's copy overtook the blocking stream's earlier copy"
    );

    assert_eq!(unsafe { api::cuStreamDestroy_v2(s) }, rc::SUCCESS);
    for p in [ones, host, nines] {
        assert_eq!(unsafe { api::cuMemFreeHost(p.cast()) }, rc::SUCCESS);
    }
}
