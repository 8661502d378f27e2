//! The transfer kernels on the CPU.
//!
//! `build.rs` compiles `hicache-gpu/src/kernels.cu` (the text NVRTC compiles) as C++17 with
//! `csrc/cuda_shim.h`: `threadIdx`/`blockIdx`/`blockDim`/`gridDim` are thread-local, the
//! qualifiers expand to nothing, `uint4` is a plain struct, and `__ldg`/`__ldcs`/`__stcs` are
//! plain loads and stores that first ask the launch's [`AccessCheck`]. `csrc/launch.cpp` runs
//! a grid one (block, thread) at a time on the calling thread; the kernels have no
//! `__syncthreads` and no shared memory, so that order is one legal CUDA schedule.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use std::cell::Cell;

use crate::error::{EmuError, Result};

type AccessFn = extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int;

unsafe extern "C" {
    fn hicache_emu_kernel_count() -> usize;
    fn hicache_emu_kernel_name(i: usize) -> *const c_char;
    fn hicache_emu_kernel_param_bytes(i: usize) -> usize;
    fn hicache_emu_kernel_run(
        i: usize,
        grid: *const u32,
        block: *const u32,
        params: *const c_void,
        param_bytes: usize,
        check: Option<AccessFn>,
        ctx: *mut c_void,
    ) -> c_int;
}

/// Decides whether a kernel may touch `bytes` bytes at `addr`.
pub trait AccessCheck {
    /// `Ok(())` to allow the access; `Err(why)` to refuse it (the access is skipped and the
    /// launch fails with [`EmuError::IllegalAccess`]).
    fn check(&self, addr: u64, bytes: usize, write: bool) -> std::result::Result<(), String>;
}

/// One CPU-compiled kernel entry point.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CpuKernel {
    index: usize,
    name: &'static str,
    param_bytes: usize,
}

/// Every compiled entry point.
pub fn kernels() -> Vec<CpuKernel> {
    // SAFETY: plain queries of a static table.
    let n = unsafe { hicache_emu_kernel_count() };
    (0..n)
        .map(|index| {
            // SAFETY: index < count, so the name is a static NUL-terminated string.
            let name = unsafe { CStr::from_ptr(hicache_emu_kernel_name(index)) };
            CpuKernel {
                index,
                name: name.to_str().expect("kernel names are ASCII"),
                // SAFETY: as above.
                param_bytes: unsafe { hicache_emu_kernel_param_bytes(index) },
            }
        })
        .collect()
}

/// The entry point called `name`.
pub fn kernel(name: &str) -> Result<CpuKernel> {
    kernels()
        .into_iter()
        .find(|k| k.name == name)
        .ok_or_else(|| EmuError::UnknownKernel(name.to_string()))
}

/// State shared with the access trampoline during one launch.
struct CheckCtx<'a> {
    check: &'a dyn AccessCheck,
    first: Cell<Option<String>>,
}

extern "C" fn access_trampoline(
    ctx: *mut c_void,
    addr: *const c_void,
    bytes: usize,
    write: c_int,
) -> c_int {
    // SAFETY: ctx is the CheckCtx that `run` passed, alive for the whole launch.
    let ctx = unsafe { &*(ctx as *const CheckCtx<'_>) };
    let verdict = catch_unwind(AssertUnwindSafe(|| {
        ctx.check.check(addr as u64, bytes, write != 0)
    }))
    .unwrap_or_else(|_| Err("the access checker panicked".into()));
    match verdict {
        Ok(()) => 0,
        Err(why) => {
            let first = ctx.first.take().or(Some(why));
            ctx.first.set(first);
            1
        }
    }
}

impl CpuKernel {
    /// Entry point name, as in the CUDA source.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// `sizeof` of the kernel's by-value parameter struct.
    pub fn param_bytes(&self) -> usize {
        self.param_bytes
    }

    /// Runs the kernel over every block of `grid` and every thread of `block`.
    ///
    /// # Safety
    /// Every address the parameters reach must be memory of this process that the kernel may
    /// read or write, unless `check` refuses the access first.
    pub unsafe fn run(
        &self,
        grid: [u32; 3],
        block: [u32; 3],
        params: &[u8],
        check: Option<&dyn AccessCheck>,
    ) -> Result<()> {
        if params.len() != self.param_bytes {
            return Err(EmuError::ParamSize {
                kernel: self.name.into(),
                given: params.len(),
                expected: self.param_bytes,
            });
        }
        if grid.contains(&0) || block.contains(&0) {
            return Err(EmuError::EmptyLaunch {
                kernel: self.name.into(),
                grid,
                block,
            });
        }
        let ctx = check.map(|check| CheckCtx {
            check,
            first: Cell::new(None),
        });
        let (f, c): (Option<AccessFn>, *mut c_void) = match &ctx {
            Some(c) => (
                Some(access_trampoline),
                c as *const CheckCtx<'_> as *mut c_void,
            ),
            None => (None, std::ptr::null_mut()),
        };
        // SAFETY: index and sizes checked above; memory validity per the contract; ctx outlives
        // the call.
        let rc = unsafe {
            hicache_emu_kernel_run(
                self.index,
                grid.as_ptr(),
                block.as_ptr(),
                params.as_ptr().cast(),
                params.len(),
                f,
                c,
            )
        };
        match rc {
            0 => Ok(()),
            1 => Err(EmuError::IllegalAccess {
                kernel: self.name.into(),
                first: ctx
                    .and_then(|c| c.first.take())
                    .unwrap_or_else(|| "unknown".into()),
            }),
            _ => Err(EmuError::ParamSize {
                kernel: self.name.into(),
                given: params.len(),
                expected: self.param_bytes,
            }),
        }
    }
}
