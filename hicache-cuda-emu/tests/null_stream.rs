//! The legacy NULL stream's held work, not ordered with a non-blocking stream (blocking
//! streams: `blocking_streams.rs`), alone in its own test process: the driver is process
//! global, and any other test's `cuMemFree`, synchronous copy or context synchronisation
//! flushes the NULL stream, which would reorder this test's memset before its copy.
//!
//! Every `unsafe` block below is one driver call whose pointers are live locals or buffers of
//! the test and whose handles came from the driver, which is the entry points' whole contract.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::ffi::c_void;

use hicache_cuda_emu::driver::api::{self, rc};

mod common;
use common::{alloc, init, stream};

#[test]
fn the_null_stream_is_held_until_something_synchronises_with_it() {
    init();
    let (d, s) = (alloc(16), stream());
    // A legacy-stream memset, then a copy on a non-blocking stream: nothing orders them, and
    // the emulator runs the memset last (at the next synchronisation with the NULL stream).
    assert_eq!(unsafe { api::cuMemsetD8_v2(d, 0, 16) }, rc::SUCCESS);
    let mut src = 0u64;
    let r = unsafe { api::cuMemHostAlloc((&mut src as *mut u64).cast(), 16, 0) };
    assert_eq!(r, rc::SUCCESS);
    unsafe { std::ptr::write_bytes(src as *mut u8, 9, 16) };
    let r = unsafe { api::cuMemcpyHtoDAsync_v2(d, src as *const c_void, 16, s) };
    assert_eq!(r, rc::SUCCESS);
    assert_eq!(unsafe { api::cuStreamSynchronize(s) }, rc::SUCCESS);
    let mut back = [1u8; 16];
    assert_eq!(
        unsafe { api::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d, 16) },
        rc::SUCCESS
    );
    assert_eq!(
        back, [0u8; 16],
        "the held memset overtook the stream's copy"
    );
    assert_eq!(
        unsafe { api::cuMemFreeHost(src as *mut c_void) },
        rc::SUCCESS
    );
}
