//! The exported `cu*` entry points. Each one counts itself, checks its arguments as the
//! driver does (plus the emulator's stricter checks, see the module docs of [`super`]) and
//! never panics across the C boundary.

// Every entry point takes the driver's raw out-pointers and handles; the caller's contract is
// the CUDA driver API's own, so the per-function `# Safety` sections would repeat it.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::memory::{MemTable, RangeKind, Side, Snapshot, VMM_GRANULARITY};
use super::stats::{count, count_launch, count_n, take_injected, violation};
use super::stream::{Event, Stream};
use crate::cpu_kernels::{self, AccessCheck, CpuKernel};

/// `CUresult` values used here.
pub mod rc {
    /// Success.
    pub const SUCCESS: u32 = 0;
    /// Bad argument.
    pub const INVALID_VALUE: u32 = 1;
    /// Allocation failed.
    pub const OUT_OF_MEMORY: u32 = 2;
    /// `cuInit` not called.
    pub const NOT_INITIALIZED: u32 = 3;
    /// Bad device ordinal.
    pub const INVALID_DEVICE: u32 = 101;
    /// Module image not ours or inconsistent.
    pub const INVALID_IMAGE: u32 = 200;
    /// Unknown handle.
    pub const INVALID_HANDLE: u32 = 400;
    /// Symbol not found.
    pub const NOT_FOUND: u32 = 500;
    /// Work not finished.
    pub const NOT_READY: u32 = 600;
    /// A kernel or copy touched memory outside every allocation.
    pub const ILLEGAL_ADDRESS: u32 = 700;
    /// Range already registered.
    pub const HOST_MEMORY_ALREADY_REGISTERED: u32 = 712;
    /// Range not registered.
    pub const HOST_MEMORY_NOT_REGISTERED: u32 = 713;
    /// Unsupported request.
    pub const NOT_SUPPORTED: u32 = 801;
    /// The image has no code for this device.
    pub const NO_BINARY_FOR_GPU: u32 = 209;
}

/// `CUDA_VERSION` the emulated driver reports by default (13.0): it has `cuMemcpyBatchAsync_v2`.
pub const DEFAULT_DRIVER_VERSION: i32 = 13000;

/// The driver version reported by `cuDriverGetVersion` (0 = not set yet: the default or
/// `HICACHE_CUDA_EMU_DRIVER_VERSION`).
static DRIVER_VERSION: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The emulated driver's version: [`hicache_emu_set_driver_version`], else
/// `HICACHE_CUDA_EMU_DRIVER_VERSION`, else [`DEFAULT_DRIVER_VERSION`]. Entry points newer than
/// it answer `CUDA_ERROR_NOT_SUPPORTED`, as an older driver would lack them.
pub fn driver_version() -> i32 {
    match DRIVER_VERSION.load(Ordering::Relaxed) {
        0 => std::env::var("HICACHE_CUDA_EMU_DRIVER_VERSION")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&v| v > 0)
            .unwrap_or(DEFAULT_DRIVER_VERSION),
        v => v,
    }
}

/// Makes the emulated driver report `version` (e.g. 12080 to test the paths for drivers
/// without `cuMemcpyBatchAsync_v2`); 0 restores the default.
#[unsafe(no_mangle)]
pub extern "C" fn hicache_emu_set_driver_version(version: i32) {
    DRIVER_VERSION.store(version, Ordering::Relaxed);
}

const CTX: usize = 0x00c7_0000;
const SM_COUNT: i32 = 132;
/// Compute capability 9.0, as `major·10 + minor`.
const SM: u32 = 90;

struct Module {
    kernels: Vec<CpuKernel>,
}

#[derive(Default)]
struct Handles {
    streams: HashMap<usize, Arc<Stream>>,
    events: HashMap<usize, Arc<Event>>,
    modules: HashMap<usize, Module>,
    functions: HashMap<usize, CpuKernel>,
}

struct Emu {
    mem: Mutex<MemTable>,
    handles: Mutex<Handles>,
    null: Arc<Stream>,
    next: AtomicUsize,
}

static INIT: AtomicBool = AtomicBool::new(false);

fn emu() -> &'static Emu {
    static EMU: OnceLock<Emu> = OnceLock::new();
    EMU.get_or_init(|| Emu {
        mem: Mutex::new(MemTable::default()),
        handles: Mutex::new(Handles::default()),
        null: Stream::null(),
        next: AtomicUsize::new(0x1000),
    })
}

fn new_handle() -> usize {
    emu().next.fetch_add(16, Ordering::Relaxed)
}

/// Stricter than hardware: async copies from pageable memory are errors (default on;
/// `HICACHE_CUDA_EMU_STRICT=0` turns them into staged copies plus a recorded violation).
fn strict() -> bool {
    std::env::var("HICACHE_CUDA_EMU_STRICT").as_deref() != Ok("0")
}

/// Runs `f`, turning a panic into `CUDA_ERROR_UNKNOWN` (never unwinds into C).
fn guard(name: &'static str, f: impl FnOnce() -> u32) -> u32 {
    count(name);
    let needs_init = !matches!(name, "cuInit" | "cuGetErrorString" | "cuGetErrorName");
    if needs_init && !INIT.load(Ordering::Acquire) {
        return rc::NOT_INITIALIZED;
    }
    if let Some(code) = take_injected(name) {
        violation(format!("{name}: failure {code} injected by the test"));
        return code;
    }
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        violation(format!("{name}: internal panic"));
        999
    })
}

fn fail(code: u32, what: String) -> u32 {
    violation(what);
    code
}

fn stream_of(h: *mut c_void) -> Option<Arc<Stream>> {
    let id = h as usize;
    if id <= 2 {
        return Some(emu().null.clone());
    }
    emu().handles.lock().streams.get(&id).cloned()
}

fn event_of(h: *mut c_void) -> Option<Arc<Event>> {
    emu().handles.lock().events.get(&(h as usize)).cloned()
}

fn snapshot() -> Snapshot {
    emu().mem.lock().snapshot()
}

/// Checks a copy's two sides now; `host` is the host address when one side is host memory,
/// `is_async` asks for page-locked host memory.
fn check_copy(
    name: &str,
    dev: &[(u64, u64)],
    host: Option<(u64, u64)>,
    is_async: bool,
) -> Result<bool, u32> {
    let snap = snapshot();
    for &(a, n) in dev {
        if n > 0
            && let Err(e) = snap.check(a, n, true)
        {
            return Err(fail(rc::INVALID_VALUE, format!("{name}: device side: {e}")));
        }
    }
    let pinned = host.is_none_or(|(a, n)| n == 0 || snap.is_pinned(a, n));
    if is_async && !pinned {
        let (a, n) = host.expect("pinned otherwise");
        let what = format!(
            "{name}: async copy of {n} bytes from host memory at {a:#x} that is neither \
             registered nor pinned (the driver may synchronise or stage it)"
        );
        if strict() {
            return Err(fail(rc::INVALID_VALUE, what));
        }
        violation(what);
    }
    Ok(pinned)
}

/// A copy op that rechecks the device side when it runs (use after free) then copies.
fn copy_op(dst: u64, src: u64, n: usize, dev: Vec<(u64, u64)>) -> super::stream::Op {
    Box::new(move || {
        let snap = snapshot();
        for (a, len) in dev {
            snap.check(a, len, true)?;
        }
        // SAFETY: both ranges checked (device side now, host side by the caller's contract).
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
        Ok(())
    })
}

/// `cuInit` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(_flags: c_uint) -> u32 {
    guard("cuInit", || {
        INIT.store(true, Ordering::Release);
        rc::SUCCESS
    })
}

/// `cuDriverGetVersion` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> u32 {
    guard("cuDriverGetVersion", || {
        if v.is_null() {
            return rc::INVALID_VALUE;
        }
        // SAFETY: non-null out-pointer.
        unsafe { *v = driver_version() };
        rc::SUCCESS
    })
}

/// `cuDeviceGetCount` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> u32 {
    guard("cuDeviceGetCount", || {
        if n.is_null() {
            return rc::INVALID_VALUE;
        }
        // SAFETY: non-null out-pointer.
        unsafe { *n = 1 };
        rc::SUCCESS
    })
}

/// `cuDeviceGet` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(d: *mut c_int, ordinal: c_int) -> u32 {
    guard("cuDeviceGet", || {
        if d.is_null() {
            return rc::INVALID_VALUE;
        }
        if ordinal != 0 {
            return rc::INVALID_DEVICE;
        }
        // SAFETY: non-null out-pointer.
        unsafe { *d = 0 };
        rc::SUCCESS
    })
}

/// `cuDeviceGetAttribute` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, dev: c_int) -> u32 {
    guard("cuDeviceGetAttribute", || {
        if v.is_null() || dev != 0 {
            return rc::INVALID_VALUE;
        }
        let value = match attr {
            16 => SM_COUNT,     // multiprocessors
            19 | 41 | 115 => 1, // can map host memory, unified addressing, memory pools
            75 => 9,            // compute capability major
            76 => 0,            // minor
            1 => 1024,          // max threads per block
            _ => 0,
        };
        // SAFETY: non-null out-pointer.
        unsafe { *v = value };
        rc::SUCCESS
    })
}

/// `cuDeviceGetName` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> u32 {
    guard("cuDeviceGetName", || {
        const NAME: &[u8] = b"Emulated H100 (hicache-cuda-emu)\0";
        if name.is_null() || dev != 0 || len <= 0 {
            return rc::INVALID_VALUE;
        }
        let n = NAME.len().min(len as usize);
        // SAFETY: the caller's buffer holds `len` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(NAME.as_ptr(), name.cast(), n);
            *name.add(n - 1) = 0;
        }
        rc::SUCCESS
    })
}

/// `cuDeviceTotalMem_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, _dev: c_int) -> u32 {
    guard("cuDeviceTotalMem_v2", || {
        if bytes.is_null() {
            return rc::INVALID_VALUE;
        }
        // SAFETY: non-null out-pointer.
        unsafe { *bytes = 80 << 30 };
        rc::SUCCESS
    })
}

/// `cuDevicePrimaryCtxRetain` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, dev: c_int) -> u32 {
    guard("cuDevicePrimaryCtxRetain", || {
        if ctx.is_null() || dev != 0 {
            return rc::INVALID_VALUE;
        }
        // SAFETY: non-null out-pointer.
        unsafe { *ctx = CTX as *mut c_void };
        rc::SUCCESS
    })
}

/// `cuDevicePrimaryCtxRelease_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(_dev: c_int) -> u32 {
    guard("cuDevicePrimaryCtxRelease_v2", || rc::SUCCESS)
}

/// `cuCtxSetCurrent` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> u32 {
    guard("cuCtxSetCurrent", || {
        if ctx.is_null() || ctx as usize == CTX {
            rc::SUCCESS
        } else {
            rc::INVALID_VALUE
        }
    })
}

/// `cuCtxGetCurrent` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> u32 {
    guard("cuCtxGetCurrent", || {
        if ctx.is_null() {
            return rc::INVALID_VALUE;
        }
        // SAFETY: non-null out-pointer.
        unsafe { *ctx = CTX as *mut c_void };
        rc::SUCCESS
    })
}

/// `cuCtxGetStreamPriorityRange` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(
    least: *mut c_int,
    greatest: *mut c_int,
) -> u32 {
    guard("cuCtxGetStreamPriorityRange", || {
        // SAFETY: out-pointers, each optional.
        unsafe {
            if !least.is_null() {
                *least = 0;
            }
            if !greatest.is_null() {
                *greatest = -5;
            }
        }
        rc::SUCCESS
    })
}

fn sync_all() -> u32 {
    let mut r = emu().null.synchronize();
    let streams: Vec<Arc<Stream>> = emu().handles.lock().streams.values().cloned().collect();
    for s in streams {
        r = r.and(s.synchronize());
    }
    match r {
        Ok(()) => rc::SUCCESS,
        Err(e) => fail(rc::ILLEGAL_ADDRESS, e),
    }
}

/// `cuCtxSynchronize` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> u32 {
    guard("cuCtxSynchronize", sync_all)
}

/// `CU_STREAM_NON_BLOCKING`: the stream is not ordered with the legacy NULL stream.
const STREAM_NON_BLOCKING: c_uint = 0x1;

fn create_stream(out: *mut *mut c_void, flags: c_uint) -> u32 {
    if out.is_null() {
        return rc::INVALID_VALUE;
    }
    let id = new_handle();
    let stream = if flags & STREAM_NON_BLOCKING != 0 {
        Stream::spawn()
    } else {
        Stream::spawn_blocking(&emu().null)
    };
    emu().handles.lock().streams.insert(id, stream);
    // SAFETY: non-null out-pointer.
    unsafe { *out = id as *mut c_void };
    rc::SUCCESS
}

/// `cuStreamCreate` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(out: *mut *mut c_void, flags: c_uint) -> u32 {
    guard("cuStreamCreate", || create_stream(out, flags))
}

/// `cuStreamCreateWithPriority` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    out: *mut *mut c_void,
    flags: c_uint,
    priority: c_int,
) -> u32 {
    guard("cuStreamCreateWithPriority", || {
        if !(-5..=0).contains(&priority) {
            return rc::INVALID_VALUE;
        }
        create_stream(out, flags)
    })
}

/// `cuStreamDestroy_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(s: *mut c_void) -> u32 {
    guard("cuStreamDestroy_v2", || {
        match emu().handles.lock().streams.remove(&(s as usize)) {
            Some(st) => {
                st.close();
                rc::SUCCESS
            }
            None => rc::INVALID_HANDLE,
        }
    })
}

/// `cuStreamSynchronize` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(s: *mut c_void) -> u32 {
    guard("cuStreamSynchronize", || match stream_of(s) {
        Some(st) => match st.synchronize() {
            Ok(()) => rc::SUCCESS,
            Err(e) => fail(rc::ILLEGAL_ADDRESS, e),
        },
        None => rc::INVALID_HANDLE,
    })
}

/// `cuStreamQuery` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamQuery(s: *mut c_void) -> u32 {
    guard("cuStreamQuery", || match stream_of(s) {
        Some(st) if st.is_idle() => rc::SUCCESS,
        Some(_) => rc::NOT_READY,
        None => rc::INVALID_HANDLE,
    })
}

/// `cuStreamWaitEvent` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitEvent(s: *mut c_void, e: *mut c_void, _flags: c_uint) -> u32 {
    guard("cuStreamWaitEvent", || {
        let (Some(st), Some(ev)) = (stream_of(s), event_of(e)) else {
            return rc::INVALID_HANDLE;
        };
        if ev.recorded_on_null() {
            let _ = emu().null.synchronize();
        }
        st.push(ev.wait_op());
        rc::SUCCESS
    })
}

/// `cuEventCreate` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(out: *mut *mut c_void, flags: c_uint) -> u32 {
    guard("cuEventCreate", || {
        if out.is_null() || flags & !0xf != 0 {
            return rc::INVALID_VALUE;
        }
        // CU_EVENT_BLOCKING_SYNC: a host wait sleeps instead of spinning a core.
        if flags & 0x1 != 0 {
            count("cuEventCreate[BLOCKING_SYNC]");
        }
        let id = new_handle();
        emu()
            .handles
            .lock()
            .events
            .insert(id, Arc::new(Event::default()));
        // SAFETY: non-null out-pointer.
        unsafe { *out = id as *mut c_void };
        rc::SUCCESS
    })
}

/// `cuEventDestroy_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(e: *mut c_void) -> u32 {
    guard("cuEventDestroy_v2", || {
        match emu().handles.lock().events.remove(&(e as usize)) {
            Some(_) => rc::SUCCESS,
            None => rc::INVALID_HANDLE,
        }
    })
}

/// `cuEventRecord` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(e: *mut c_void, s: *mut c_void) -> u32 {
    guard("cuEventRecord", || {
        let (Some(st), Some(ev)) = (stream_of(s), event_of(e)) else {
            return rc::INVALID_HANDLE;
        };
        ev.record(&st);
        rc::SUCCESS
    })
}

/// `cuEventQuery` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(e: *mut c_void) -> u32 {
    guard("cuEventQuery", || match event_of(e) {
        Some(ev) if ev.is_done() => rc::SUCCESS,
        Some(_) => rc::NOT_READY,
        None => rc::INVALID_HANDLE,
    })
}

/// `cuEventSynchronize` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(e: *mut c_void) -> u32 {
    guard("cuEventSynchronize", || match event_of(e) {
        Some(ev) => {
            if ev.recorded_on_null() {
                let _ = emu().null.synchronize();
            }
            ev.synchronize();
            rc::SUCCESS
        }
        None => rc::INVALID_HANDLE,
    })
}

fn alloc(out: *mut u64, len: usize) -> u32 {
    if out.is_null() || len == 0 {
        return rc::INVALID_VALUE;
    }
    match emu().mem.lock().alloc_device(len) {
        Some(a) => {
            // SAFETY: non-null out-pointer.
            unsafe { *out = a };
            rc::SUCCESS
        }
        None => rc::OUT_OF_MEMORY,
    }
}

/// `cuMemAlloc_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(out: *mut u64, len: usize) -> u32 {
    guard("cuMemAlloc_v2", || alloc(out, len))
}

/// `cuMemAllocAsync` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(out: *mut u64, len: usize, s: *mut c_void) -> u32 {
    guard("cuMemAllocAsync", || {
        if stream_of(s).is_none() {
            return rc::INVALID_HANDLE;
        }
        alloc(out, len)
    })
}

/// `cuMemFree_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(p: u64) -> u32 {
    guard("cuMemFree_v2", || {
        // cuMemFree synchronises with the device's outstanding work on the legacy stream.
        let _ = emu().null.synchronize();
        match emu().mem.lock().free(p, RangeKind::Device) {
            Ok(()) => rc::SUCCESS,
            Err(e) => fail(rc::INVALID_VALUE, format!("cuMemFree: {e}")),
        }
    })
}

/// `cuMemFreeAsync` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(p: u64, s: *mut c_void) -> u32 {
    guard("cuMemFreeAsync", || {
        let Some(st) = stream_of(s) else {
            return rc::INVALID_HANDLE;
        };
        if emu().mem.lock().containing(p).map(|r| r.0) != Some(p) {
            return fail(
                rc::INVALID_VALUE,
                format!("cuMemFreeAsync: {p:#x} is not an allocation"),
            );
        }
        st.push(Box::new(move || {
            emu().mem.lock().free(p, RangeKind::Device)
        }));
        rc::SUCCESS
    })
}

/// `cuMemHostAlloc` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(out: *mut *mut c_void, len: usize, _flags: c_uint) -> u32 {
    guard("cuMemHostAlloc", || {
        if out.is_null() || len == 0 {
            return rc::INVALID_VALUE;
        }
        match emu().mem.lock().alloc_pinned(len) {
            Some(a) => {
                // SAFETY: non-null out-pointer.
                unsafe { *out = a as *mut c_void };
                rc::SUCCESS
            }
            None => rc::OUT_OF_MEMORY,
        }
    })
}

/// `cuMemFreeHost` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> u32 {
    guard("cuMemFreeHost", || {
        let _ = emu().null.synchronize();
        match emu().mem.lock().free(p as u64, RangeKind::PinnedHost) {
            Ok(()) => rc::SUCCESS,
            Err(e) => fail(rc::INVALID_VALUE, format!("cuMemFreeHost: {e}")),
        }
    })
}

/// `cuMemHostRegister_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostRegister_v2(p: *mut c_void, len: usize, _flags: c_uint) -> u32 {
    guard("cuMemHostRegister_v2", || {
        match emu().mem.lock().register(p as u64, len) {
            Ok(()) => rc::SUCCESS,
            Err(e) => fail(
                rc::HOST_MEMORY_ALREADY_REGISTERED,
                format!("cuMemHostRegister: {e}"),
            ),
        }
    })
}

/// `cuMemHostUnregister` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut c_void) -> u32 {
    guard("cuMemHostUnregister", || {
        match emu().mem.lock().unregister(p as u64) {
            Ok(()) => rc::SUCCESS,
            Err(e) => fail(
                rc::HOST_MEMORY_NOT_REGISTERED,
                format!("cuMemHostUnregister: {e}"),
            ),
        }
    })
}

/// `cuMemHostGetDevicePointer_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    out: *mut u64,
    p: *mut c_void,
    flags: c_uint,
) -> u32 {
    guard("cuMemHostGetDevicePointer_v2", || {
        if out.is_null() || flags != 0 {
            return rc::INVALID_VALUE;
        }
        if !snapshot().is_pinned(p as u64, 1) {
            return fail(
                rc::INVALID_VALUE,
                format!("cuMemHostGetDevicePointer: {p:?} is not page-locked"),
            );
        }
        // SAFETY: non-null out-pointer. Unified addressing: the device address is the host's.
        unsafe { *out = p as u64 };
        rc::SUCCESS
    })
}

/// `cuMemGetAddressRange_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(base: *mut u64, size: *mut usize, p: u64) -> u32 {
    guard("cuMemGetAddressRange_v2", || {
        match emu().mem.lock().containing(p) {
            Some((b, len, RangeKind::Device)) => {
                // SAFETY: out-pointers, each optional.
                unsafe {
                    if !base.is_null() {
                        *base = b;
                    }
                    if !size.is_null() {
                        *size = len;
                    }
                }
                rc::SUCCESS
            }
            _ => rc::NOT_FOUND,
        }
    })
}

/// `cuMemsetD8_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8_v2(p: u64, v: u8, n: usize) -> u32 {
    guard("cuMemsetD8_v2", || memset(p, v, n, emu().null.clone()))
}

/// `cuMemsetD8Async` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemsetD8Async(p: u64, v: u8, n: usize, s: *mut c_void) -> u32 {
    guard("cuMemsetD8Async", || match stream_of(s) {
        Some(st) => memset(p, v, n, st),
        None => rc::INVALID_HANDLE,
    })
}

fn memset(p: u64, v: u8, n: usize, st: Arc<Stream>) -> u32 {
    if let Err(code) = check_copy("cuMemsetD8", &[(p, n as u64)], None, false) {
        return code;
    }
    st.push(Box::new(move || {
        snapshot().check(p, n as u64, true)?;
        // SAFETY: checked just above.
        unsafe { std::ptr::write_bytes(p as *mut u8, v, n) };
        Ok(())
    }));
    rc::SUCCESS
}

/// `cuMemcpyHtoD_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> u32 {
    guard("cuMemcpyHtoD_v2", || {
        let pinned = match check_copy(
            "cuMemcpyHtoD",
            &[(dst, n as u64)],
            Some((src as u64, n as u64)),
            false,
        ) {
            Ok(p) => p,
            Err(code) => return code,
        };
        if pinned {
            // Synchronous with respect to the host for page-locked sources.
            let _ = emu().null.synchronize();
            // SAFETY: device side checked, host side per the caller's contract.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
            return rc::SUCCESS;
        }
        // Pageable source: the driver stages the bytes and returns; the DMA to the device
        // runs later on the legacy stream.
        // SAFETY: the caller's buffer holds n bytes.
        let staged = unsafe { std::slice::from_raw_parts(src as *const u8, n) }.to_vec();
        emu().null.push(Box::new(move || {
            snapshot().check(dst, staged.len() as u64, true)?;
            // SAFETY: checked just above.
            unsafe { std::ptr::copy_nonoverlapping(staged.as_ptr(), dst as *mut u8, staged.len()) };
            Ok(())
        }));
        rc::SUCCESS
    })
}

/// `cuMemcpyDtoH_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> u32 {
    guard("cuMemcpyDtoH_v2", || {
        if let Err(code) = check_copy("cuMemcpyDtoH", &[(src, n as u64)], None, false) {
            return code;
        }
        if let Err(e) = emu().null.synchronize() {
            return fail(rc::ILLEGAL_ADDRESS, e);
        }
        // SAFETY: device side checked, host side per the caller's contract.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
        rc::SUCCESS
    })
}

fn async_copy(
    name: &'static str,
    dst: u64,
    src: u64,
    n: usize,
    dev: u64,
    host: Option<u64>,
    s: *mut c_void,
) -> u32 {
    let Some(st) = stream_of(s) else {
        return rc::INVALID_HANDLE;
    };
    if let Err(code) = check_copy(name, &[(dev, n as u64)], host.map(|h| (h, n as u64)), true) {
        return code;
    }
    st.push(copy_op(dst, src, n, vec![(dev, n as u64)]));
    rc::SUCCESS
}

/// `cuMemcpyHtoDAsync_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    n: usize,
    s: *mut c_void,
) -> u32 {
    guard("cuMemcpyHtoDAsync_v2", || {
        async_copy(
            "cuMemcpyHtoDAsync",
            dst,
            src as u64,
            n,
            dst,
            Some(src as u64),
            s,
        )
    })
}

/// `cuMemcpyDtoHAsync_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    n: usize,
    s: *mut c_void,
) -> u32 {
    guard("cuMemcpyDtoHAsync_v2", || {
        async_copy(
            "cuMemcpyDtoHAsync",
            dst as u64,
            src,
            n,
            src,
            Some(dst as u64),
            s,
        )
    })
}

/// `cuMemcpyDtoDAsync_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, n: usize, s: *mut c_void) -> u32 {
    guard("cuMemcpyDtoDAsync_v2", || {
        let Some(st) = stream_of(s) else {
            return rc::INVALID_HANDLE;
        };
        let dev = vec![(dst, n as u64), (src, n as u64)];
        if let Err(code) = check_copy("cuMemcpyDtoDAsync", &dev, None, true) {
            return code;
        }
        st.push(copy_op(dst, src, n, dev));
        rc::SUCCESS
    })
}

/// `CUDA_MEMCPY2D` with the memory types as plain integers (a zeroed one is representable
/// here and refused as a bad memory type).
#[repr(C)]
pub struct Memcpy2D {
    src_x: usize,
    src_y: usize,
    src_type: u32,
    src_host: *const c_void,
    src_device: u64,
    src_array: *mut c_void,
    src_pitch: usize,
    dst_x: usize,
    dst_y: usize,
    dst_type: u32,
    dst_host: *mut c_void,
    dst_device: u64,
    dst_array: *mut c_void,
    dst_pitch: usize,
    width: usize,
    height: usize,
}

/// `cuMemcpy2DAsync_v2` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy2DAsync_v2(c: *const Memcpy2D, s: *mut c_void) -> u32 {
    guard("cuMemcpy2DAsync_v2", || {
        let Some(st) = stream_of(s) else {
            return rc::INVALID_HANDLE;
        };
        if c.is_null() {
            return rc::INVALID_VALUE;
        }
        // SAFETY: non-null, the caller's struct.
        let c = unsafe { &*c };
        let side = |t: u32,
                    host: u64,
                    dev: u64,
                    x: usize,
                    y: usize,
                    pitch: usize|
         -> Result<(u64, bool), String> {
            let base = match t {
                1 => (host, true),
                2 | 4 => (dev, false),
                3 => return Err("CU_MEMORYTYPE_ARRAY is not supported by the emulator".into()),
                other => return Err(format!("bad memory type {other}")),
            };
            Ok((base.0 + (y * pitch + x) as u64, base.1))
        };
        let sides = side(
            c.src_type,
            c.src_host as u64,
            c.src_device,
            c.src_x,
            c.src_y,
            c.src_pitch,
        )
        .and_then(|s| {
            Ok((
                s,
                side(
                    c.dst_type,
                    c.dst_host as u64,
                    c.dst_device,
                    c.dst_x,
                    c.dst_y,
                    c.dst_pitch,
                )?,
            ))
        });
        let ((src, src_host), (dst, dst_host)) = match sides {
            Ok(v) => v,
            Err(e) => return fail(rc::INVALID_VALUE, format!("cuMemcpy2DAsync: {e}")),
        };
        if c.height > 1 && (c.width > c.src_pitch || c.width > c.dst_pitch) {
            return fail(
                rc::INVALID_VALUE,
                format!(
                    "cuMemcpy2DAsync: width {} exceeds a pitch (src {}, dst {})",
                    c.width, c.src_pitch, c.dst_pitch
                ),
            );
        }
        let span = |pitch: usize| (c.height.saturating_sub(1) * pitch + c.width) as u64;
        let (mut dev, mut host) = (Vec::new(), None);
        for (addr, is_host, pitch) in [(src, src_host, c.src_pitch), (dst, dst_host, c.dst_pitch)] {
            if is_host {
                host = Some((addr, span(pitch)));
            } else {
                dev.push((addr, span(pitch)));
            }
        }
        if let Err(code) = check_copy("cuMemcpy2DAsync", &dev, host, true) {
            return code;
        }
        let (w, h, sp, dp) = (c.width, c.height, c.src_pitch, c.dst_pitch);
        st.push(Box::new(move || {
            let snap = snapshot();
            for (a, n) in dev {
                snap.check(a, n, true)?;
            }
            for row in 0..h {
                // SAFETY: every row lies inside the checked spans.
                unsafe {
                    std::ptr::copy(
                        (src + (row * sp) as u64) as *const u8,
                        (dst + (row * dp) as u64) as *mut u8,
                        w,
                    )
                };
            }
            Ok(())
        }));
        rc::SUCCESS
    })
}

/// `CUmemLocation` (CUDA 13.0 layout).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct MemLocation {
    /// `CUmemLocationType`.
    pub kind: u32,
    /// Device ordinal or NUMA node.
    pub id: c_int,
}

/// `CUmemcpyAttributes` (CUDA 13.0 layout).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct MemcpyAttributes {
    /// `CUmemcpySrcAccessOrder`: 1 stream, 2 during the API call, 3 any.
    pub src_access_order: u32,
    /// Hint for managed memory (ignored here, as for memory that is not managed).
    pub src_loc_hint: MemLocation,
    /// Hint for managed memory (ignored here).
    pub dst_loc_hint: MemLocation,
    /// `CUmemcpyFlags`.
    pub flags: c_uint,
}

/// Checks the attribute table of a batch as the driver documents it: at least one entry, no
/// more than copies, first index 0, indices strictly increasing and below `count`, every
/// access order valid. Returns the access order of each copy.
fn batch_orders(
    count: usize,
    attrs: &[MemcpyAttributes],
    idxs: &[usize],
) -> Result<Vec<u32>, String> {
    if attrs.is_empty() || attrs.len() > count {
        return Err(format!(
            "{} attribute entries for {count} copies (1..=count needed)",
            attrs.len()
        ));
    }
    if idxs[0] != 0 {
        return Err(format!("attrsIdxs[0] is {}, must be 0", idxs[0]));
    }
    if let Some(w) = idxs.windows(2).find(|w| w[1] <= w[0]) {
        return Err(format!(
            "attrsIdxs not strictly increasing ({} then {})",
            w[0], w[1]
        ));
    }
    if idxs[idxs.len() - 1] >= count {
        return Err(format!(
            "attrsIdxs entry {} ≥ count {count}",
            idxs[idxs.len() - 1]
        ));
    }
    if let Some(a) = attrs
        .iter()
        .find(|a| !(1..=3).contains(&a.src_access_order))
    {
        return Err(format!("bad srcAccessOrder {}", a.src_access_order));
    }
    let mut orders = Vec::with_capacity(count);
    for (k, a) in attrs.iter().enumerate() {
        let end = idxs.get(k + 1).copied().unwrap_or(count);
        orders.resize(end, a.src_access_order);
    }
    Ok(orders)
}

/// One copy of a batch: destination, source, bytes, and the source's bytes when they were
/// read at the call (pageable memory out of stream order).
type BatchCopy = (u64, u64, usize, Option<Vec<u8>>);

/// The device ranges (address, bytes) to recheck when a batch runs, and its copies.
type BatchPlan = (Vec<(u64, u64)>, Vec<BatchCopy>);

/// Checks and classifies the copies of a `cuMemcpyBatchAsync` call: the device ranges to
/// recheck when the batch runs and the copies to make; `Err` is the call's return code.
fn plan_batch(
    dsts: &[u64],
    srcs: &[u64],
    sizes: &[usize],
    orders: &[u32],
) -> Result<BatchPlan, u32> {
    let snap = snapshot();
    let mut dev = Vec::new();
    let mut copies = Vec::with_capacity(sizes.len());
    for (i, &size) in sizes.iter().enumerate() {
        let n = size as u64;
        if n == 0 {
            continue;
        }
        let (dst, src) = (dsts[i], srcs[i]);
        let mut staged = None;
        for (addr, is_src) in [(dst, false), (src, true)] {
            match snap.classify(addr, n) {
                Ok(Side::Device) => dev.push((addr, n)),
                Ok(Side::PinnedHost) => {}
                Ok(Side::Pageable) if orders[i] == 1 => {
                    let what = format!(
                        "cuMemcpyBatchAsync: copy {i}: stream-ordered copy of {n} bytes \
                         {} pageable host memory at {addr:#x}",
                        if is_src { "from" } else { "to" }
                    );
                    if strict() {
                        return Err(fail(rc::INVALID_VALUE, what));
                    }
                    violation(what);
                }
                Ok(Side::Pageable) => {
                    // Out of stream order: the driver may read the source now.
                    if is_src {
                        // SAFETY: the caller's source holds n bytes.
                        staged = Some(
                            unsafe { std::slice::from_raw_parts(src as *const u8, n as usize) }
                                .to_vec(),
                        );
                    }
                }
                Err(e) => {
                    return Err(fail(
                        rc::INVALID_VALUE,
                        format!("cuMemcpyBatchAsync: copy {i}: {e}"),
                    ));
                }
            }
        }
        copies.push((dst, src, n as usize, staged));
    }
    Ok((dev, copies))
}

/// `cuMemcpyBatchAsync_v2` of the driver API (CUDA 13.0), emulated: `count` pointer-to-pointer
/// copies in one call, kinds inferred from the pointers, the batch in stream order (copies
/// within it in no particular order). Refused on the legacy NULL stream and by drivers that
/// predate it ([`driver_version`] < 13000). Stream-ordered copies from or to pageable host
/// memory are errors (strict mode), as for every other async copy.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyBatchAsync_v2(
    dsts: *const u64,
    srcs: *const u64,
    sizes: *const usize,
    count: usize,
    attrs: *const MemcpyAttributes,
    attrs_idxs: *const usize,
    num_attrs: usize,
    s: *mut c_void,
) -> u32 {
    guard("cuMemcpyBatchAsync_v2", || {
        if driver_version() < 13000 {
            return fail(
                rc::NOT_SUPPORTED,
                format!(
                    "cuMemcpyBatchAsync_v2 called on an emulated driver of version {} (needs 13000)",
                    driver_version()
                ),
            );
        }
        if (s as usize) < 2 {
            return fail(
                rc::INVALID_VALUE,
                "cuMemcpyBatchAsync: the legacy NULL stream is not accepted".into(),
            );
        }
        let Some(st) = stream_of(s) else {
            return rc::INVALID_HANDLE;
        };
        if count == 0
            || [dsts as usize, srcs as usize, sizes as usize].contains(&0)
            || attrs.is_null()
            || attrs_idxs.is_null()
        {
            return fail(
                rc::INVALID_VALUE,
                format!("cuMemcpyBatchAsync: count {count} or a null array"),
            );
        }
        // SAFETY: the caller's arrays hold `count` and `num_attrs` entries (the API's contract).
        let (dsts, srcs, sizes, attrs, idxs) = unsafe {
            (
                std::slice::from_raw_parts(dsts, count),
                std::slice::from_raw_parts(srcs, count),
                std::slice::from_raw_parts(sizes, count),
                std::slice::from_raw_parts(attrs, num_attrs),
                std::slice::from_raw_parts(attrs_idxs, num_attrs),
            )
        };
        let orders = match batch_orders(count, attrs, idxs) {
            Ok(o) => o,
            Err(e) => return fail(rc::INVALID_VALUE, format!("cuMemcpyBatchAsync: {e}")),
        };
        let (dev, copies) = match plan_batch(dsts, srcs, sizes, &orders) {
            Ok(plan) => plan,
            Err(code) => return code,
        };
        count_n("cuMemcpyBatchAsync_v2[copies]", count as u64);
        st.push(Box::new(move || {
            let snap = snapshot();
            for (a, n) in dev {
                snap.check(a, n, true)?;
            }
            for (dst, src, n, staged) in copies {
                let from = staged.as_ref().map_or(src as *const u8, |v| v.as_ptr());
                // SAFETY: device sides rechecked just above, host sides per the caller's
                // contract (page-locked, alive until the stream passes this point).
                unsafe { std::ptr::copy(from, dst as *mut u8, n) };
            }
            Ok(())
        }));
        rc::SUCCESS
    })
}

/// `cuMemGetAllocationGranularity` of the driver API, emulated: 2 MiB for every request.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    out: *mut usize,
    prop: *const c_void,
    _option: c_uint,
) -> u32 {
    guard("cuMemGetAllocationGranularity", || {
        if out.is_null() || prop.is_null() {
            return rc::INVALID_VALUE;
        }
        // SAFETY: non-null out-pointer.
        unsafe { *out = VMM_GRANULARITY };
        rc::SUCCESS
    })
}

/// `cuMemAddressReserve` of the driver API, emulated (address space only; see `memory`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    out: *mut u64,
    size: usize,
    align: usize,
    _addr: u64,
    _flags: u64,
) -> u32 {
    guard("cuMemAddressReserve", || {
        if out.is_null() {
            return rc::INVALID_VALUE;
        }
        match emu().mem.lock().reserve(size, align) {
            Ok(a) => {
                // SAFETY: non-null out-pointer.
                unsafe { *out = a };
                rc::SUCCESS
            }
            Err(e) => fail(rc::INVALID_VALUE, format!("cuMemAddressReserve: {e}")),
        }
    })
}

/// `cuMemAddressFree` of the driver API, emulated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressFree(p: u64, size: usize) -> u32 {
    guard("cuMemAddressFree", || {
        match emu().mem.lock().unreserve(p, size) {
            Ok(()) => rc::SUCCESS,
            Err(e) => fail(rc::INVALID_VALUE, format!("cuMemAddressFree: {e}")),
        }
    })
}

/// `cuMemCreate` of the driver API, emulated (a handle with a size; see `memory`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    out: *mut u64,
    size: usize,
    prop: *const c_void,
    _flags: u64,
) -> u32 {
    guard("cuMemCreate", || {
        if out.is_null() || prop.is_null() {
            return rc::INVALID_VALUE;
        }
        match emu().mem.lock().create_physical(size) {
            Ok(h) => {
                // SAFETY: non-null out-pointer.
                unsafe { *out = h };
                rc::SUCCESS
            }
            Err(e) => fail(rc::INVALID_VALUE, format!("cuMemCreate: {e}")),
        }
    })
}

/// `cuMemRelease` of the driver API, emulated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> u32 {
    guard("cuMemRelease", || {
        match emu().mem.lock().release_physical(handle) {
            Ok(()) => rc::SUCCESS,
            Err(e) => fail(rc::INVALID_VALUE, format!("cuMemRelease: {e}")),
        }
    })
}

/// `cuMemMap` of the driver API, emulated (whole physical allocations at offset 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    p: u64,
    size: usize,
    offset: usize,
    handle: u64,
    _flags: u64,
) -> u32 {
    guard("cuMemMap", || {
        if offset != 0 {
            return fail(
                rc::NOT_SUPPORTED,
                "cuMemMap: the emulator maps physical allocations from offset 0 only".into(),
            );
        }
        match emu().mem.lock().map(p, size, handle) {
            Ok(()) => rc::SUCCESS,
            Err(e) => fail(rc::INVALID_VALUE, format!("cuMemMap: {e}")),
        }
    })
}

/// `cuMemUnmap` of the driver API, emulated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(p: u64, size: usize) -> u32 {
    guard("cuMemUnmap", || {
        let _ = emu().null.synchronize();
        match emu().mem.lock().unmap(p, size) {
            Ok(()) => rc::SUCCESS,
            Err(e) => fail(rc::INVALID_VALUE, format!("cuMemUnmap: {e}")),
        }
    })
}

/// `cuMemSetAccess` of the driver API, emulated: the range must be mapped; access is then
/// granted to the one device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    p: u64,
    size: usize,
    desc: *const c_void,
    count: usize,
) -> u32 {
    guard("cuMemSetAccess", || {
        if desc.is_null() || count == 0 {
            return rc::INVALID_VALUE;
        }
        match snapshot().check(p, size as u64, false) {
            Ok(_) => rc::SUCCESS,
            Err(e) => fail(rc::INVALID_VALUE, format!("cuMemSetAccess: {e}")),
        }
    })
}

/// `cuMemRetainAllocationHandle` of the driver API, emulated: succeeds for addresses inside a
/// VMM mapping only (how a caller tells expandable-segment memory from `cuMemAlloc` memory).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(out: *mut u64, addr: *mut c_void) -> u32 {
    guard("cuMemRetainAllocationHandle", || {
        if out.is_null() {
            return rc::INVALID_VALUE;
        }
        match emu().mem.lock().retain_handle(addr as u64) {
            Some(h) => {
                // SAFETY: non-null out-pointer.
                unsafe { *out = h };
                rc::SUCCESS
            }
            None => rc::INVALID_VALUE,
        }
    })
}

/// `cuModuleLoadData` of the driver API, emulated: a PTX or cubin image of our kernels (see
/// [`super::image`]). A cubin must target the emulated device's SM (9.0), as a GPU refuses
/// code for another architecture; every kernel's declared parameter block must equal the CPU
/// kernel's. Counted as `cuModuleLoadData[cubin]` or `cuModuleLoadData[ptx]` as well.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(out: *mut *mut c_void, image: *const c_void) -> u32 {
    guard("cuModuleLoadData", || {
        if out.is_null() || image.is_null() {
            return rc::INVALID_VALUE;
        }
        // SAFETY: a PTX string or a whole ELF file, per the driver's contract.
        let img = match unsafe { super::image::read(image.cast()) } {
            Ok(i) => i,
            Err(e) => return fail(rc::INVALID_IMAGE, format!("cuModuleLoadData: {e}")),
        };
        if let super::image::Image::Cubin { sm, .. } = img
            && sm != SM
        {
            return fail(
                rc::NO_BINARY_FOR_GPU,
                format!("cuModuleLoadData: a cubin for sm_{sm} on an sm_{SM} device"),
            );
        }
        let mut kernels = Vec::new();
        for k in cpu_kernels::kernels() {
            let Some(entry) = img.entry(k.name()) else {
                continue;
            };
            match entry.param_bytes {
                Some(n) if n == k.param_bytes() => kernels.push(k),
                other => {
                    return fail(
                        rc::INVALID_IMAGE,
                        format!(
                            "cuModuleLoadData: {} declares a {other:?}-byte parameter block, the \
                             CPU kernel takes {}",
                            k.name(),
                            k.param_bytes()
                        ),
                    );
                }
            }
        }
        if kernels.is_empty() {
            return fail(
                rc::INVALID_IMAGE,
                "cuModuleLoadData: the image has none of our kernels (not hicache-gpu's NVRTC output)".into(),
            );
        }
        count(if img.is_cubin() {
            "cuModuleLoadData[cubin]"
        } else {
            "cuModuleLoadData[ptx]"
        });
        let id = new_handle();
        emu().handles.lock().modules.insert(id, Module { kernels });
        // SAFETY: non-null out-pointer.
        unsafe { *out = id as *mut c_void };
        rc::SUCCESS
    })
}

/// `cuModuleUnload` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleUnload(m: *mut c_void) -> u32 {
    guard("cuModuleUnload", || {
        match emu().handles.lock().modules.remove(&(m as usize)) {
            Some(_) => rc::SUCCESS,
            None => rc::INVALID_HANDLE,
        }
    })
}

/// `cuModuleGetFunction` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    out: *mut *mut c_void,
    m: *mut c_void,
    name: *const c_char,
) -> u32 {
    guard("cuModuleGetFunction", || {
        if out.is_null() || name.is_null() {
            return rc::INVALID_VALUE;
        }
        // SAFETY: NUL-terminated per the driver's contract.
        let name = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy();
        let mut h = emu().handles.lock();
        let Some(module) = h.modules.get(&(m as usize)) else {
            return rc::INVALID_HANDLE;
        };
        let Some(k) = module.kernels.iter().find(|k| k.name() == name).copied() else {
            return rc::NOT_FOUND;
        };
        let id = new_handle();
        h.functions.insert(id, k);
        // SAFETY: non-null out-pointer.
        unsafe { *out = id as *mut c_void };
        rc::SUCCESS
    })
}

/// Kernel accesses must fall in live device memory or page-locked host memory, naturally
/// aligned.
struct LaunchCheck(Snapshot);

impl AccessCheck for LaunchCheck {
    fn check(&self, addr: u64, bytes: usize, _write: bool) -> Result<(), String> {
        if !addr.is_multiple_of(bytes as u64) {
            return Err(format!("misaligned {bytes}-byte access at {addr:#x}"));
        }
        self.0.check(addr, bytes as u64, true).map(|_| ())
    }
}

/// `cuLaunchKernel` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    s: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> u32 {
    guard("cuLaunchKernel", || {
        let Some(k) = emu().handles.lock().functions.get(&(f as usize)).copied() else {
            return rc::INVALID_HANDLE;
        };
        let Some(st) = stream_of(s) else {
            return rc::INVALID_HANDLE;
        };
        if params.is_null() || !extra.is_null() || shared != 0 {
            return fail(
                rc::INVALID_VALUE,
                format!("cuLaunchKernel {}: expects kernelParams only", k.name()),
            );
        }
        if bx * by * bz > 1024 || [gx, gy, gz, bx, by, bz].contains(&0) {
            return fail(
                rc::INVALID_VALUE,
                format!("cuLaunchKernel {}: bad launch dimensions", k.name()),
            );
        }
        // The driver copies the argument values at launch.
        // SAFETY: kernelParams[0] points to the kernel's parameter block (size checked
        // against the image at module load).
        let block =
            unsafe { std::slice::from_raw_parts(*params as *const u8, k.param_bytes()) }.to_vec();
        count_launch();
        st.push(Box::new(move || {
            let check = LaunchCheck(snapshot());
            // SAFETY: every access is checked against the live ranges first.
            unsafe { k.run([gx, gy, gz], [bx, by, bz], &block, Some(&check)) }.map_err(|e| {
                let e = e.to_string();
                violation(e.clone());
                e
            })
        }));
        rc::SUCCESS
    })
}

fn error_text(code: u32) -> (&'static [u8], &'static [u8]) {
    match code {
        rc::SUCCESS => (b"CUDA_SUCCESS\0", b"no error\0"),
        rc::INVALID_VALUE => (b"CUDA_ERROR_INVALID_VALUE\0", b"invalid argument\0"),
        rc::OUT_OF_MEMORY => (b"CUDA_ERROR_OUT_OF_MEMORY\0", b"out of memory\0"),
        rc::NOT_INITIALIZED => (b"CUDA_ERROR_NOT_INITIALIZED\0", b"initialization error\0"),
        rc::INVALID_DEVICE => (b"CUDA_ERROR_INVALID_DEVICE\0", b"invalid device ordinal\0"),
        rc::INVALID_IMAGE => (
            b"CUDA_ERROR_INVALID_IMAGE\0",
            b"device kernel image is invalid\0",
        ),
        rc::INVALID_HANDLE => (b"CUDA_ERROR_INVALID_HANDLE\0", b"invalid resource handle\0"),
        rc::NOT_FOUND => (b"CUDA_ERROR_NOT_FOUND\0", b"named symbol not found\0"),
        rc::NOT_READY => (b"CUDA_ERROR_NOT_READY\0", b"device not ready\0"),
        rc::ILLEGAL_ADDRESS => (
            b"CUDA_ERROR_ILLEGAL_ADDRESS\0",
            b"an illegal memory access was encountered\0",
        ),
        rc::HOST_MEMORY_ALREADY_REGISTERED => (
            b"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED\0",
            b"part or all of the requested memory range is already mapped\0",
        ),
        rc::HOST_MEMORY_NOT_REGISTERED => (
            b"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED\0",
            b"pointer does not correspond to a registered memory region\0",
        ),
        rc::NOT_SUPPORTED => (b"CUDA_ERROR_NOT_SUPPORTED\0", b"operation not supported\0"),
        _ => (b"CUDA_ERROR_UNKNOWN\0", b"unknown error\0"),
    }
}

/// `cuGetErrorString` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(code: u32, out: *mut *const c_char) -> u32 {
    guard("cuGetErrorString", || {
        if out.is_null() {
            return rc::INVALID_VALUE;
        }
        // SAFETY: non-null out-pointer; static strings.
        unsafe { *out = error_text(code).1.as_ptr().cast() };
        rc::SUCCESS
    })
}

/// `cuGetErrorName` of the driver API, emulated (see the module docs of `driver`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: u32, out: *mut *const c_char) -> u32 {
    guard("cuGetErrorName", || {
        if out.is_null() {
            return rc::INVALID_VALUE;
        }
        // SAFETY: non-null out-pointer; static strings.
        unsafe { *out = error_text(code).0.as_ptr().cast() };
        rc::SUCCESS
    })
}

/// `cuGetExportTable`, the driver's private interface table. NVRTC opens `libcuda.so.1` and
/// asks for it; the emulator has none to give, so NVRTC goes on without it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetExportTable(out: *mut *const c_void, _id: *const c_void) -> u32 {
    guard("cuGetExportTable", || {
        if !out.is_null() {
            // SAFETY: non-null out-pointer.
            unsafe { *out = std::ptr::null() };
        }
        rc::NOT_SUPPORTED
    })
}
