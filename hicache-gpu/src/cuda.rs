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
//! 5. Synchronous helpers (`alloc_zeroed`, `write`) run on the device's own non-blocking
//!    stream and wait for it, never on the legacy NULL stream, which nothing orders our
//!    non-blocking transfer streams after.
//! 4. The kernels are compiled by NVRTC for the device's architecture at first use
//!    ([`crate::kernels::compile_ptx`]) and loaded once per device.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, DeviceRepr, LaunchConfig, PushKernelArg, result, sys,
};
pub use cudarc::driver::{CudaEvent, CudaStream};
use parking_lot::Mutex;

use crate::copy::CopyParams;
use crate::error::{GpuError, Result};
use crate::kernels;
use crate::plan::{Direction, MemcpyOp};

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

/// One CUDA device (its primary context).
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    name: String,
    sm_count: u32,
    compute_capability: (u32, u32),
    kernels: Mutex<Option<Arc<Kernels>>>,
    /// Stream of the synchronous helpers (rule 5), created at first use.
    sync_stream: Mutex<Option<Arc<CudaStream>>>,
    scratch: Arc<ScratchPool>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.name)
            .field("ordinal", &self.ctx.ordinal())
            .field("sm_count", &self.sm_count)
            .field("compute_capability", &self.compute_capability)
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
        Ok(Self {
            name,
            sm_count,
            compute_capability: (maj as u32, min as u32),
            kernels: Mutex::new(None),
            sync_stream: Mutex::new(None),
            scratch: Arc::new(ScratchPool {
                ctx: ctx.clone(),
                idle: Mutex::new(Vec::new()),
            }),
            ctx,
        })
    }

    /// Makes the context current on this thread (rule 2).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(GpuError::driver("cuCtxSetCurrent"))
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
        let arch: String = format!("compute_{maj}{min}");
        let ptx = kernels::compile_ptx(Some(&arch))?;
        self.bind()?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.to_string()))
            .map_err(GpuError::driver("cuModuleLoadData"))?;
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

    /// A new event without timing.
    pub fn new_event(&self) -> Result<CudaEvent> {
        self.bind()?;
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(GpuError::driver("cuEventCreate"))
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
        for op in ops {
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
}

impl ScratchPool {
    /// An idle buffer of at least `bytes` bytes (a new one when none is free).
    fn take(&self, bytes: usize) -> Result<PinnedBuf> {
        {
            let mut idle = self.idle.lock();
            let free = idle
                .iter()
                .position(|b| b.cap >= bytes && b.done.as_ref().is_none_or(|e| e.is_complete()));
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
                None => self
                    .ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(GpuError::driver("cuEventCreate"))?,
            };
            ev.record(s).map_err(GpuError::driver("cuEventRecord"))?;
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
