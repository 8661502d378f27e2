//! The CUDA backend: thin, checked wrappers over the driver API (through cudarc with dynamic
//! loading, so nothing of CUDA is linked at build time).
//!
//! Rules:
//! 1. [`CudaDevice::open`] checks that libcuda can be loaded before the first driver call
//!    (cudarc panics otherwise) and returns [`GpuError::NoDriver`].
//! 2. Every driver call made from a thread binds the device's context first
//!    ([`CudaDevice::bind`]); the context is the device's primary context, shared with the
//!    engine (PyTorch uses the primary context too).
//! 3. Per-transfer scratch (page index lists) lives in page-locked, device-mapped host buffers
//!    that the kernel reads directly ([`ScratchPool`]): no copy from pageable memory (which the
//!    driver may synchronise) and no allocation per transfer. A buffer is handed out again only
//!    after the event recorded behind the work that read it has completed.
//! 4. The kernels are compiled by NVRTC for the device's architecture at first use and loaded
//!    once per device: a cubin for its `sm_XY` ([`crate::kernels::compile_cubin`]), which any
//!    driver that supports the GPU loads; PTX for `compute_XY` only when that fails (PTX from
//!    an NVRTC newer than the driver does not load).
//! 5. Synchronous helpers (`alloc_zeroed`, `write`) run on the device's own non-blocking
//!    stream and wait for it, never on the legacy NULL stream, which nothing orders our
//!    non-blocking transfer streams after.
//! 6. Events are created with `CU_EVENT_BLOCKING_SYNC`: a host waiting for a transfer sleeps
//!    instead of spinning a core the engine's scheduler needs.
//! 7. cudarc runs the release calls of its handles (`cuEventDestroy`, `cuStreamDestroy`,
//!    `cuModuleUnload`, …) in `Drop` and reports a failure at the next call on the context,
//!    whatever that call is. [`CudaDevice::bind`] reports such a failure as
//!    [`GpuError::ReleaseFailed`] naming the release call (for our events, which record it
//!    when they drop), never as a failure of `cuCtxSetCurrent` or of the call at hand.
//! 8. Direct (DMA) plans go to the driver as one `cuMemcpyBatchAsync` per plan where the driver
//!    has it (CUDA 13.0 and later, checked at open), one copy call per op otherwise.

use std::sync::Arc;

pub use cudarc::driver::CudaStream;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, DeviceRepr, LaunchConfig, PushKernelArg, result, sys,
};
use parking_lot::Mutex;

use crate::copy::CopyParams;
use crate::error::{GpuError, Result};
use crate::kernels;
use crate::plan::{self, DeviceCopy, Direction, MemcpyOp};

// SAFETY: CopyParams is repr(C) plain old data (u64/u32 fields only), matching the kernel's
// struct layout (checked by a unit test in `copy`).
unsafe impl DeviceRepr for CopyParams {}

/// Whether libcuda can be loaded (never panics).
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen the library under its known names.
    unsafe { sys::is_culib_present() }
}

/// The loaded kernels of one device.
pub struct Kernels {
    _module: Arc<CudaModule>,
    functions: Vec<(u32, CudaFunction)>,
}

impl Kernels {
    fn function(&self, word_bytes: u32) -> &CudaFunction {
        &self
            .functions
            .iter()
            .find(|(w, _)| *w == word_bytes)
            .or_else(|| self.functions.last())
            .expect("five entry points are loaded")
            .1
    }
}

/// The first failed release of a handle, kept until the next [`CudaDevice::bind`] (rule 7).
#[derive(Default)]
struct ReleaseErrors(Mutex<Option<(&'static str, String)>>);

impl ReleaseErrors {
    fn take(&self) -> Option<GpuError> {
        self.0
            .lock()
            .take()
            .map(|(call, message)| GpuError::ReleaseFailed { call, message })
    }
}

/// Makes `ctx` current on this thread, first reporting a failed release of an earlier
/// handle under its own name (rule 7).
fn bind_ctx(ctx: &CudaContext, errors: &ReleaseErrors) -> Result<()> {
    if let Some(e) = errors.take() {
        return Err(e);
    }
    ctx.check_err().map_err(|e| GpuError::ReleaseFailed {
        call: "a release run by cudarc in a drop (cuStreamDestroy, cuModuleUnload or \
               cuMemFreeHost)",
        message: e.to_string(),
    })?;
    ctx.bind_to_thread()
        .map_err(GpuError::driver("cuCtxSetCurrent"))
}

/// A CUDA event of this backend, created without timing and with `CU_EVENT_BLOCKING_SYNC`
/// (rule 6; cudarc's events take one flag only). A failed `cuEventDestroy` when it drops is
/// recorded under that name and reported by the next call (rule 7).
pub struct CudaEvent {
    raw: sys::CUevent,
    ctx: Arc<CudaContext>,
    errors: Arc<ReleaseErrors>,
}

// SAFETY: a CUevent is a driver handle usable from any thread once its context is bound (every
// method binds it first).
unsafe impl Send for CudaEvent {}
// SAFETY: as above; the driver's event calls are thread-safe.
unsafe impl Sync for CudaEvent {}

fn new_event(ctx: &Arc<CudaContext>, errors: &Arc<ReleaseErrors>) -> Result<CudaEvent> {
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
    let mut raw = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; the context is bound by the caller.
    unsafe { sys::cuEventCreate(&mut raw, flags) }
        .result()
        .map_err(GpuError::driver("cuEventCreate"))?;
    Ok(CudaEvent {
        raw,
        ctx: ctx.clone(),
        errors: errors.clone(),
    })
}

impl CudaEvent {
    /// The `CUevent` (valid while this event lives).
    pub fn cu_event(&self) -> sys::CUevent {
        self.raw
    }

    /// Records the event at the current end of `stream`'s queue.
    pub fn record(&self, stream: &CudaStream) -> Result<()> {
        bind_ctx(&self.ctx, &self.errors)?;
        // SAFETY: live event and stream of this context.
        unsafe { sys::cuEventRecord(self.raw, stream.cu_stream()) }
            .result()
            .map_err(GpuError::driver("cuEventRecord"))
    }

    /// Makes `stream` wait (on the device) for the record current now.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        bind_ctx(&self.ctx, &self.errors)?;
        // SAFETY: live event and stream of this context.
        unsafe { sys::cuStreamWaitEvent(stream.cu_stream(), self.raw, 0) }
            .result()
            .map_err(GpuError::driver("cuStreamWaitEvent"))
    }

    /// Blocks (sleeping, rule 6) until the recorded work completed.
    pub fn synchronize(&self) -> Result<()> {
        bind_ctx(&self.ctx, &self.errors)?;
        // SAFETY: live event.
        unsafe { sys::cuEventSynchronize(self.raw) }
            .result()
            .map_err(GpuError::driver("cuEventSynchronize"))
    }

    /// Whether the recorded work completed (never blocks); errors of that work are errors.
    pub fn is_complete(&self) -> Result<bool> {
        bind_ctx(&self.ctx, &self.errors)?;
        // SAFETY: live event.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(GpuError::driver("cuEventQuery")(
                cudarc::driver::DriverError(e),
            )),
        }
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // Binds without cudarc's check of earlier errors, which would attribute them to us.
        // SAFETY: the context outlives the event (we hold an Arc of it).
        let r = unsafe { result::ctx::set_current(self.ctx.cu_ctx()) }
            .map_err(GpuError::driver("cuCtxSetCurrent"))
            .and_then(|()| {
                // SAFETY: created by cuEventCreate, destroyed once, here.
                unsafe { sys::cuEventDestroy_v2(self.raw) }
                    .result()
                    .map_err(GpuError::driver("cuEventDestroy"))
            });
        if let Err(e) = r {
            let GpuError::Driver { call, message } = e else {
                return;
            };
            self.errors.0.lock().get_or_insert((call, message));
        }
    }
}

/// One CUDA device (its primary context).
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    name: String,
    sm_count: u32,
    compute_capability: (u32, u32),
    /// Whether the driver has `cuMemcpyBatchAsync_v2` (rule 8).
    copy_batching: bool,
    kernels: Mutex<Option<Arc<Kernels>>>,
    /// Stream of the synchronous helpers (rule 5), created at first use.
    sync_stream: Mutex<Option<Arc<CudaStream>>>,
    scratch: Arc<ScratchPool>,
    errors: Arc<ReleaseErrors>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.name)
            .field("ordinal", &self.ctx.ordinal())
            .field("sm_count", &self.sm_count)
            .field("compute_capability", &self.compute_capability)
            .field("copy_batching", &self.copy_batching)
            .finish()
    }
}

impl CudaDevice {
    /// Opens device `ordinal` (rule 1).
    pub fn open(ordinal: usize) -> Result<Self> {
        if !driver_available() {
            return Err(GpuError::NoDriver(
                "libcuda.so could not be loaded (no NVIDIA driver on this machine, or its \
                 directory is not on LD_LIBRARY_PATH)"
                    .into(),
            ));
        }
        let count = CudaContext::device_count().map_err(GpuError::driver("cuDeviceGetCount"))?;
        if ordinal >= count.max(0) as usize {
            return Err(GpuError::NoDriver(format!(
                "device {ordinal} requested but {count} CUDA device(s) present"
            )));
        }
        let ctx =
            CudaContext::new(ordinal).map_err(GpuError::driver("cuDevicePrimaryCtxRetain"))?;
        let name = ctx.name().map_err(GpuError::driver("cuDeviceGetName"))?;
        if !ctx.has_async_alloc() {
            return Err(GpuError::NoDriver(format!(
                "{name} has no stream-ordered memory pools (cuMemAllocAsync), which the \
                 transfer engine needs"
            )));
        }
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(GpuError::driver("cuDeviceGetAttribute"))? as u32;
        let (maj, min) = ctx
            .compute_capability()
            .map_err(GpuError::driver("cuDeviceGetAttribute"))?;
        // SAFETY: we never use cudarc's CudaSlice (whose cross-stream safety relies on event
        // tracking); every ordering between our streams is explicit (events), and tracking would
        // make the first stream creation synchronise the whole (engine-shared) context.
        unsafe { ctx.disable_event_tracking() };
        let copy_batching = batch_copies_available()?;
        let errors = Arc::new(ReleaseErrors::default());
        Ok(Self {
            name,
            sm_count,
            compute_capability: (maj as u32, min as u32),
            copy_batching,
            kernels: Mutex::new(None),
            sync_stream: Mutex::new(None),
            scratch: Arc::new(ScratchPool {
                ctx: ctx.clone(),
                idle: Mutex::new(Vec::new()),
                errors: errors.clone(),
            }),
            errors,
            ctx,
        })
    }

    /// Makes the context current on this thread (rule 2), first reporting a failed release of
    /// an earlier handle under its own name (rule 7).
    pub fn bind(&self) -> Result<()> {
        bind_ctx(&self.ctx, &self.errors)
    }

    /// Whether direct plans are issued as one `cuMemcpyBatchAsync` each (rule 8).
    pub fn batches_copies(&self) -> bool {
        self.copy_batching
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Compute capability.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }

    /// The kernels, compiled and loaded at first use (rule 4).
    pub fn kernels(&self) -> Result<Arc<Kernels>> {
        let mut slot = self.kernels.lock();
        if let Some(k) = slot.as_ref() {
            return Ok(k.clone());
        }
        let (maj, min) = self.compute_capability;
        let sm = format!("sm_{maj}{min}");
        let cubin = kernels::compile_cubin(&sm).and_then(|bin| {
            self.bind()?;
            self.ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(bin.to_vec()))
                .map_err(GpuError::driver("cuModuleLoadData (cubin)"))
        });
        let module = match cubin {
            Ok(m) => m,
            Err(e @ GpuError::NoNvrtc(_)) => return Err(e),
            Err(cubin_err) => {
                tracing::warn!(
                    error = %cubin_err,
                    "no loadable {sm} cubin of the transfer kernels; falling back to PTX"
                );
                let arch = format!("compute_{maj}{min}");
                let ptx = kernels::compile_ptx(Some(&arch))?;
                self.bind()?;
                self.ctx
                    .load_module(cudarc::nvrtc::Ptx::from_src(ptx.to_string()))
                    .map_err(|e| GpuError::Driver {
                        call: "cuModuleLoadData",
                        message: format!("PTX for {arch}: {e} (after the {sm} cubin: {cubin_err})"),
                    })?
            }
        };
        let mut functions = Vec::new();
        for (w, name) in kernels::ENTRY_POINTS {
            let f = module
                .load_function(name)
                .map_err(GpuError::driver("cuModuleGetFunction"))?;
            functions.push((w, f));
        }
        let k = Arc::new(Kernels {
            _module: module,
            functions,
        });
        *slot = Some(k.clone());
        Ok(k)
    }

    /// A new non-blocking stream at the context's highest priority: transfers must not
    /// queue behind the engine's compute (default-priority) work.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.bind()?;
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: out-pointers to locals.
        unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) }
            .result()
            .map_err(GpuError::driver("cuCtxGetStreamPriorityRange"))?;
        self.ctx
            .new_stream_with_priority(greatest)
            .map_err(GpuError::driver("cuStreamCreateWithPriority"))
    }

    /// Wraps a stream owned by someone else (the engine).
    ///
    /// # Safety
    /// `raw` must be a live `CUstream` of this device's primary context that outlives the
    /// wrapper.
    pub unsafe fn borrow_stream(&self, raw: sys::CUstream) -> Arc<CudaStream> {
        // SAFETY: per the contract.
        unsafe { self.ctx.wrap_borrowed_stream(raw) }
    }

    /// A new event without timing, whose host waits block (rule 6).
    pub fn new_event(&self) -> Result<CudaEvent> {
        self.bind()?;
        new_event(&self.ctx, &self.errors)
    }

    /// `len` zeroed bytes of device memory.
    pub fn alloc_zeroed(&self, len: usize) -> Result<CudaMemory> {
        self.bind()?;
        // SAFETY: plain allocation in the bound context; freed in CudaMemory's Drop.
        let ptr =
            unsafe { result::malloc_sync(len.max(1)) }.map_err(GpuError::driver("cuMemAlloc"))?;
        let mem = CudaMemory {
            ctx: self.ctx.clone(),
            ptr,
            len,
        };
        let stream = self.sync_stream()?;
        // SAFETY: ptr..ptr+len was just allocated; the memset completes before we return, so
        // no later transfer on any stream can be overtaken by it (rule 5).
        unsafe { result::memset_d8_async(ptr, 0, len, stream.cu_stream()) }
            .map_err(GpuError::driver("cuMemsetD8Async"))?;
        stream
            .synchronize()
            .map_err(GpuError::driver("cuStreamSynchronize"))?;
        Ok(mem)
    }

    /// Copies device bytes to `dst` (synchronous).
    ///
    /// # Safety
    /// `src..src+dst.len()` must be device memory of this context.
    pub unsafe fn read(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: per the contract; dst is a valid Rust buffer.
        unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(GpuError::driver("cuMemcpyDtoH"))
    }

    /// Copies `src` to device bytes (synchronous).
    ///
    /// # Safety
    /// `dst..dst+src.len()` must be device memory of this context that nothing else uses.
    pub unsafe fn write(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.bind()?;
        if src.is_empty() {
            return Ok(());
        }
        // Through a page-locked bounce buffer on the helper stream, waited for (rule 5): a
        // pageable cuMemcpyHtoD returns before its DMA lands, on the NULL stream.
        let stream = self.sync_stream()?;
        let buf = self.scratch.take(src.len())?;
        // SAFETY: the buffer is idle (its last reader completed) and holds ≥ src.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), buf.host as *mut u8, src.len()) };
        // SAFETY: dst per the contract; the source is page-locked and outlives the copy (we
        // wait for the stream before the buffer goes back to the pool).
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, buf.host as *const _, src.len(), stream.cu_stream())
        }
        .result()
        .map_err(GpuError::driver("cuMemcpyHtoDAsync"))
        .and_then(|()| {
            stream
                .synchronize()
                .map_err(GpuError::driver("cuStreamSynchronize"))
        });
        self.scratch.give_back(buf, None)?;
        r
    }

    /// The helper stream of rule 5.
    fn sync_stream(&self) -> Result<Arc<CudaStream>> {
        let mut slot = self.sync_stream.lock();
        if let Some(s) = slot.as_ref() {
            return Ok(s.clone());
        }
        let s = self.new_stream()?;
        *slot = Some(s.clone());
        Ok(s)
    }

    /// The allocation that contains `ptr`: `(base, size)`.
    pub fn address_range(&self, ptr: u64) -> Result<(u64, usize)> {
        self.bind()?;
        let mut base = 0u64;
        let mut size = 0usize;
        // SAFETY: out-pointers to locals; the driver only inspects its allocation table.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(GpuError::driver("cuMemGetAddressRange"))?;
        Ok((base, size))
    }

    /// The end of the device memory reachable from `ptr` without a gap, looking no further
    /// than `ptr + want`: the end of the allocation holding `ptr` and, for memory mapped with
    /// the virtual memory API (PyTorch's expandable segments), of the following mappings of the
    /// same contiguous range: `cuMemGetAddressRange` reports one physical chunk of such memory
    /// per call, so an engine buffer spanning two chunks would look too short.
    pub fn reachable_end(&self, ptr: u64, want: usize) -> Result<u64> {
        let (base, size) = self.address_range(ptr)?;
        let mut end = base + size as u64;
        let target = ptr.saturating_add(want as u64);
        // Chunks are at least the VMM granularity (2 MiB), so this is bounded by want / 2 MiB;
        // the cap only guards against a driver answering zero-sized ranges.
        for _ in 0..(1 << 20) {
            if end >= target || !self.is_vmm_mapping(end - 1)? || !self.is_vmm_mapping(end)? {
                break;
            }
            let (next, len) = self.address_range(end)?;
            if next != end || len == 0 {
                break;
            }
            end += len as u64;
        }
        Ok(end)
    }

    /// Whether `addr` lies in memory mapped with `cuMemMap` (only there does
    /// `cuMemRetainAllocationHandle` succeed).
    fn is_vmm_mapping(&self, addr: u64) -> Result<bool> {
        self.bind()?;
        let mut handle = 0;
        // SAFETY: out-pointer to a local; the driver only looks the address up.
        let r = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, addr as *mut _) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Ok(false);
        }
        // SAFETY: releases the reference retained just above.
        unsafe { sys::cuMemRelease(handle) }
            .result()
            .map_err(GpuError::driver("cuMemRelease"))?;
        Ok(true)
    }

    /// Page-locks `len` bytes at `addr` and maps them for the device; returns the device
    /// address of `addr`.
    ///
    /// # Safety
    /// `addr..addr+len` must be a live mapping that stays mapped until
    /// [`CudaDevice::unregister_host`] is called for it.
    pub unsafe fn register_host(&self, addr: usize, len: usize) -> Result<u64> {
        self.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: per the contract.
        unsafe { sys::cuMemHostRegister_v2(addr as *mut _, len, flags) }
            .result()
            .map_err(GpuError::driver("cuMemHostRegister"))?;
        let mut dptr = 0u64;
        // SAFETY: addr was registered just above with DEVICEMAP.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, addr as *mut _, 0) }.result();
        if let Err(e) = r {
            // SAFETY: undo the registration made above.
            unsafe { sys::cuMemHostUnregister(addr as *mut _) };
            return Err(GpuError::driver("cuMemHostGetDevicePointer")(e));
        }
        Ok(dptr)
    }

    /// Undoes [`CudaDevice::register_host`].
    ///
    /// # Safety
    /// `addr` must have been registered by `register_host` and no transfer may still use it.
    pub unsafe fn unregister_host(&self, addr: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: per the contract.
        unsafe { sys::cuMemHostUnregister(addr as *mut _) }
            .result()
            .map_err(GpuError::driver("cuMemHostUnregister"))
    }

    /// Puts `data` where the kernels read it: a page-locked, device-mapped buffer of the
    /// scratch pool (rule 3), handed back behind the stream's work when the scratch drops.
    pub fn upload_u32(&self, stream: &Arc<CudaStream>, data: &[u32]) -> Result<StreamScratch> {
        self.bind()?;
        let bytes = std::mem::size_of_val(data).max(4);
        let buf = self.scratch.take(bytes)?;
        // SAFETY: the buffer is idle (the event behind its last reader completed) and holds
        // at least `bytes` bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.host as *mut u32, data.len()) };
        Ok(StreamScratch {
            stream: stream.clone(),
            pool: self.scratch.clone(),
            buf: Some(buf),
        })
    }

    /// Launches the copy kernel for `params`.
    pub fn launch_copy(
        &self,
        stream: &Arc<CudaStream>,
        params: &CopyParams,
        word_bytes: u32,
        ctas: u32,
        threads: u32,
    ) -> Result<()> {
        let kernels = self.kernels()?;
        self.bind()?;
        let cfg = LaunchConfig {
            grid_dim: (ctas, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = kernels.function(word_bytes);
        let mut b = stream.launch_builder(f);
        b.arg(params);
        // SAFETY: the params reach only memory the transfer engine validated (device pool
        // layers, registered host pool, stream-ordered index scratch), per `copy`'s contract.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(GpuError::driver("cuLaunchKernel"))
    }

    /// Queues the DMA copies of a plan.
    ///
    /// # Safety
    /// Every op's device addresses must be device memory of this context and its host
    /// addresses page-locked host memory that stays registered until the work completes.
    pub unsafe fn run_plan(
        &self,
        stream: &Arc<CudaStream>,
        dir: Direction,
        ops: &[MemcpyOp],
    ) -> Result<()> {
        self.bind()?;
        let s = stream.cu_stream();
        let mut ops = std::borrow::Cow::Borrowed(ops);
        if self.copy_batching {
            let (rows, rest) = plan::split_for_batch(&ops, plan::BATCH_MAX_ROWS);
            if rows.len() > 1 {
                // SAFETY: per the function's contract.
                unsafe { batch_copy(s, dir, &rows)? };
                ops = std::borrow::Cow::Owned(rest);
            }
        }
        for op in ops.iter() {
            // SAFETY: per the function's contract.
            let r = unsafe {
                match (*op, dir) {
                    (MemcpyOp::Linear { dev, host, bytes }, Direction::ToHost) => {
                        sys::cuMemcpyDtoHAsync_v2(host as *mut _, dev, bytes as usize, s)
                    }
                    (MemcpyOp::Linear { dev, host, bytes }, Direction::ToDevice) => {
                        sys::cuMemcpyHtoDAsync_v2(dev, host as *const _, bytes as usize, s)
                    }
                    (
                        MemcpyOp::Pitched {
                            dev,
                            dev_pitch,
                            host,
                            host_pitch,
                            width,
                            height,
                        },
                        dir,
                    ) => {
                        // Every field written: the memory types are enums without a zero
                        // value, so a zeroed CUDA_MEMCPY2D is undefined behaviour (an abort).
                        let mut c = sys::CUDA_MEMCPY2D {
                            srcXInBytes: 0,
                            srcY: 0,
                            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
                            srcHost: std::ptr::null(),
                            srcDevice: 0,
                            srcArray: std::ptr::null_mut(),
                            srcPitch: 0,
                            dstXInBytes: 0,
                            dstY: 0,
                            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
                            dstHost: std::ptr::null_mut(),
                            dstDevice: 0,
                            dstArray: std::ptr::null_mut(),
                            dstPitch: 0,
                            WidthInBytes: width as usize,
                            Height: height as usize,
                        };
                        match dir {
                            Direction::ToHost => {
                                c.srcMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
                                c.srcDevice = dev;
                                c.srcPitch = dev_pitch as usize;
                                c.dstMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_HOST;
                                c.dstHost = host as *mut _;
                                c.dstPitch = host_pitch as usize;
                            }
                            Direction::ToDevice => {
                                c.srcMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_HOST;
                                c.srcHost = host as *const _;
                                c.srcPitch = host_pitch as usize;
                                c.dstMemoryType = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
                                c.dstDevice = dev;
                                c.dstPitch = dev_pitch as usize;
                            }
                        }
                        sys::cuMemcpy2DAsync_v2(&c, s)
                    }
                }
            };
            r.result().map_err(GpuError::driver("cuMemcpyAsync"))?;
        }
        Ok(())
    }

    /// Queues device-to-device copies, one `cuMemcpyDtoDAsync` each.
    ///
    /// # Safety
    /// Every copy's ranges must be device memory of this context, valid until the work
    /// completes, with no destination overlapping a source.
    pub unsafe fn run_d2d(&self, stream: &Arc<CudaStream>, copies: &[DeviceCopy]) -> Result<()> {
        self.bind()?;
        let s = stream.cu_stream();
        for c in copies {
            // SAFETY: per the function's contract.
            unsafe { sys::cuMemcpyDtoDAsync_v2(c.dst, c.src, c.bytes as usize, s) }
                .result()
                .map_err(GpuError::driver("cuMemcpyDtoDAsync"))?;
        }
        Ok(())
    }
}

/// Whether the driver has `cuMemcpyBatchAsync_v2` (CUDA 13.0 and later; rule 8). cudarc
/// panics on a missing symbol, so the symbol is looked up first.
fn batch_copies_available() -> Result<bool> {
    let mut version = 0;
    // SAFETY: out-pointer to a local.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(GpuError::driver("cuDriverGetVersion"))?;
    // SAFETY: the driver library is loaded (checked by `open`); only looks a symbol up.
    let present = unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync_v2\0")
            .is_ok()
    };
    Ok(version >= 13000 && present)
}

/// Queues `rows` (device address, host address, bytes) as one `cuMemcpyBatchAsync`: source
/// accessed in stream order, preferring copy engines that overlap with compute.
///
/// # Safety
/// As [`CudaDevice::run_plan`]; `stream` is a stream of the bound context (never the legacy
/// NULL stream, which the call refuses).
unsafe fn batch_copy(
    stream: sys::CUstream,
    dir: Direction,
    rows: &[(u64, u64, u64)],
) -> Result<()> {
    let (mut dsts, mut srcs, mut sizes): (Vec<u64>, Vec<u64>, Vec<usize>) = rows
        .iter()
        .map(|&(dev, host, n)| match dir {
            Direction::ToHost => (host, dev, n as usize),
            Direction::ToDevice => (dev, host, n as usize),
        })
        .collect();
    let hint = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
        id: 0,
    };
    let mut attrs = [sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: hint,
        dstLocHint: hint,
        flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
    }];
    let mut first = [0usize];
    // SAFETY: three arrays of rows.len() entries and one attribute entry for all copies, read
    // during the call; the memory they name per the caller's contract.
    unsafe {
        sys::cuMemcpyBatchAsync_v2(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            rows.len(),
            attrs.as_mut_ptr(),
            first.as_mut_ptr(),
            1,
            stream,
        )
    }
    .result()
    .map_err(GpuError::driver("cuMemcpyBatchAsync"))
}

/// Device memory allocated with `cuMemAlloc`, freed on drop.
pub struct CudaMemory {
    ctx: Arc<CudaContext>,
    ptr: u64,
    len: usize,
}

impl CudaMemory {
    /// Device address.
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether zero bytes were asked for.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemAlloc in this context, freed once; owners keep it alive
            // until the work using it has been synchronised.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// One page-locked, device-mapped host buffer of a [`ScratchPool`].
pub struct PinnedBuf {
    host: usize,
    dev: u64,
    cap: usize,
    /// Recorded behind the last work that read the buffer; `None` before the first use.
    done: Option<CudaEvent>,
}

/// Page-locked index-list buffers, reused once the work that read them completed (rule 3).
pub struct ScratchPool {
    ctx: Arc<CudaContext>,
    idle: Mutex<Vec<PinnedBuf>>,
    errors: Arc<ReleaseErrors>,
}

impl ScratchPool {
    /// An idle buffer of at least `bytes` bytes (a new one when none is free).
    fn take(&self, bytes: usize) -> Result<PinnedBuf> {
        {
            let mut idle = self.idle.lock();
            let free = idle.iter().position(|b| {
                b.cap >= bytes
                    && b.done
                        .as_ref()
                        .is_none_or(|e| e.is_complete().unwrap_or(false))
            });
            if let Some(i) = free {
                return Ok(idle.swap_remove(i));
            }
        }
        let cap = bytes.next_power_of_two().max(4096);
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: plain page-locked allocation in the bound context; freed in Drop.
        let host = unsafe { result::malloc_host(cap, flags) }
            .map_err(GpuError::driver("cuMemHostAlloc"))? as usize;
        let mut dev = 0u64;
        // SAFETY: host was just allocated with DEVICEMAP.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut _, 0) }.result();
        if let Err(e) = r {
            // SAFETY: undo the allocation made above.
            let _ = unsafe { result::free_host(host as *mut _) };
            return Err(GpuError::driver("cuMemHostGetDevicePointer")(e));
        }
        Ok(PinnedBuf {
            host,
            dev,
            cap,
            done: None,
        })
    }

    /// Returns `buf`, recording its event behind `stream`'s queued work first (if given).
    fn give_back(&self, mut buf: PinnedBuf, stream: Option<&Arc<CudaStream>>) -> Result<()> {
        if let Some(s) = stream {
            let ev = match buf.done.take() {
                Some(e) => e,
                None => new_event(&self.ctx, &self.errors)?,
            };
            ev.record(s)?;
            buf.done = Some(ev);
        }
        self.idle.lock().push(buf);
        Ok(())
    }
}

impl Drop for ScratchPool {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        for b in self.idle.get_mut().drain(..) {
            if let Some(e) = &b.done {
                let _ = e.synchronize();
            }
            // SAFETY: allocated by cuMemHostAlloc, no longer read (its event completed).
            let _ = unsafe { result::free_host(b.host as *mut _) };
        }
    }
}

/// An index list in a pinned scratch buffer; on drop the buffer goes back to the pool behind
/// the stream's queued work (rule 3).
pub struct StreamScratch {
    stream: Arc<CudaStream>,
    pool: Arc<ScratchPool>,
    buf: Option<PinnedBuf>,
}

impl StreamScratch {
    /// Device address.
    pub fn addr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.dev)
    }
}

impl Drop for StreamScratch {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        if self.stream.context().bind_to_thread().is_ok()
            && let Err(e) = self.pool.give_back(buf, Some(&self.stream))
        {
            tracing::error!(error = %e, "returning an index-list buffer failed; it is leaked");
        }
    }
}
