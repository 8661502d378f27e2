//! [`Device`]: one accelerator, CUDA or sim, behind one API: memory ([`DeviceBuffer`]),
//! [`Stream`]s and [`Event`]s. The transfer engine and the pools are written once against it.
//!
//! The sim device (module [`crate::sim`]) keeps "device" memory in host RAM, runs each stream
//! on a worker thread and replaces every kernel by its CPU reference; everything else (page
//! validation, plans, events, layer counters) is the same code path as on CUDA.

use std::sync::Arc;

use crate::copy::{self, CopyParams};
use crate::cuda::{self, CudaDevice, CudaMemory, StreamScratch};
use crate::error::{GpuError, Result};
use crate::plan::{self, DeviceCopy, Direction, MemcpyOp};
use crate::sim::{SimEvent, SimMemory, SimStream};

/// Which implementation a [`Device`] is.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// A CUDA GPU.
    Cuda,
    /// Host memory and CPU threads, kernels replaced by their CPU references.
    Sim,
}

pub(crate) enum Backend {
    Cuda(CudaDevice),
    /// The sim device; `payload: false` is [`Device::sim_without_payload`].
    Sim {
        payload: bool,
    },
}

/// One device. Cheap to clone (an `Arc`).
#[derive(Clone)]
pub struct Device {
    backend: Arc<Backend>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &*self.backend {
            Backend::Cuda(c) => c.fmt(f),
            Backend::Sim { payload: true } => f.write_str("SimDevice"),
            Backend::Sim { payload: false } => f.write_str("SimDevice(without payload)"),
        }
    }
}

impl Device {
    /// CUDA device `ordinal`. Errors (never panics) when libcuda is missing or the device
    /// does not exist. NVRTC is needed only by the `kernel` io backend, and checked when the
    /// kernels are first compiled.
    pub fn cuda(ordinal: usize) -> Result<Self> {
        Ok(Self {
            backend: Arc::new(Backend::Cuda(CudaDevice::open(ordinal)?)),
        })
    }

    /// The sim device.
    pub fn sim() -> Self {
        Self {
            backend: Arc::new(Backend::Sim { payload: true }),
        }
    }

    /// The sim device without payload, for simulations whose figures count pages and bytes
    /// but never depend on the bytes themselves: its memory is mapped but populated only
    /// where touched ([`alloc_zeroed`](Self::alloc_zeroed)), and its page copies (copy
    /// kernels, memcpy plans, device-to-device copies) move no bytes, though they queue,
    /// order and complete on their streams as on [`sim`](Self::sim). Synchronous reads and
    /// writes ([`DeviceBuffer::read`], [`DeviceBuffer::write`]) still move bytes. Host pools
    /// of such a device need no payload either ([`moves_payload`](Self::moves_payload)).
    pub fn sim_without_payload() -> Self {
        Self {
            backend: Arc::new(Backend::Sim { payload: false }),
        }
    }

    /// Whether the device's copies move bytes (false only for
    /// [`sim_without_payload`](Self::sim_without_payload)).
    pub fn moves_payload(&self) -> bool {
        !matches!(&*self.backend, Backend::Sim { payload: false })
    }

    /// Whether libcuda can be loaded on this machine.
    pub fn cuda_driver_available() -> bool {
        cuda::driver_available()
    }

    /// CUDA or sim.
    pub fn kind(&self) -> DeviceKind {
        match &*self.backend {
            Backend::Cuda(_) => DeviceKind::Cuda,
            Backend::Sim { .. } => DeviceKind::Sim,
        }
    }

    /// A human name (`NVIDIA H100 80GB HBM3`, `sim`).
    pub fn name(&self) -> String {
        match &*self.backend {
            Backend::Cuda(c) => c.name().to_string(),
            Backend::Sim { .. } => "sim".into(),
        }
    }

    /// Streaming multiprocessors (the sim reports the CPU threads available).
    pub fn sm_count(&self) -> u32 {
        match &*self.backend {
            Backend::Cuda(c) => c.sm_count(),
            Backend::Sim { .. } => {
                std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
            }
        }
    }

    /// Compute capability (CUDA only).
    pub fn compute_capability(&self) -> Option<(u32, u32)> {
        match &*self.backend {
            Backend::Cuda(c) => Some(c.compute_capability()),
            Backend::Sim { .. } => None,
        }
    }

    /// Compiles and loads the transfer kernels now instead of at the first transfer (CUDA;
    /// a no-op on sim). Errors when NVRTC is missing or compilation fails.
    pub fn prepare_kernels(&self) -> Result<()> {
        match &*self.backend {
            Backend::Cuda(c) => c.kernels().map(|_| ()),
            Backend::Sim { .. } => Ok(()),
        }
    }

    /// Whether `other` is the same device (same `Device::cuda`/`Device::sim` call).
    pub fn same_as(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.backend, &other.backend)
    }

    /// `len` zeroed bytes of device memory.
    pub fn alloc_zeroed(&self, len: usize) -> Result<DeviceBuffer> {
        let mem = match &*self.backend {
            Backend::Cuda(c) => Mem::Cuda(c.alloc_zeroed(len)?),
            Backend::Sim { payload } => Mem::Sim(SimMemory::new(len, *payload)?),
        };
        Ok(DeviceBuffer {
            device: self.clone(),
            mem,
        })
    }

    /// A new stream.
    pub fn new_stream(&self, name: &str) -> Result<Stream> {
        let inner = match &*self.backend {
            Backend::Cuda(c) => StreamInner::Cuda(c.new_stream()?),
            Backend::Sim { .. } => StreamInner::Sim(SimStream::new(name)?),
        };
        Ok(Stream {
            device: self.clone(),
            inner,
        })
    }

    pub(crate) fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Synchronous device → host copy.
    ///
    /// # Safety
    /// `src..src+dst.len()` must be device memory of this device that no running work writes.
    pub(crate) unsafe fn read_raw(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        match &*self.backend {
            // SAFETY: per the contract.
            Backend::Cuda(c) => unsafe { c.read(src, dst) },
            Backend::Sim { .. } => {
                // SAFETY: sim device memory is host memory; valid per the contract.
                unsafe {
                    std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len())
                };
                Ok(())
            }
        }
    }

    /// Synchronous host → device copy.
    ///
    /// # Safety
    /// `dst..dst+src.len()` must be device memory of this device that no running work uses.
    pub(crate) unsafe fn write_raw(&self, dst: u64, src: &[u8]) -> Result<()> {
        match &*self.backend {
            // SAFETY: per the contract.
            Backend::Cuda(c) => unsafe { c.write(dst, src) },
            Backend::Sim { .. } => {
                // SAFETY: sim device memory is host memory; valid per the contract.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
                Ok(())
            }
        }
    }
}

enum Mem {
    Cuda(CudaMemory),
    Sim(SimMemory),
}

/// Device memory we allocated; freed on drop.
///
/// Dropping a buffer while queued work still uses it is the owner's responsibility to avoid
/// (the pools and the transfer engine synchronise their streams before they drop theirs).
pub struct DeviceBuffer {
    device: Device,
    mem: Mem,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .finish()
    }
}

impl DeviceBuffer {
    /// Device address.
    pub fn addr(&self) -> u64 {
        match &self.mem {
            Mem::Cuda(m) => m.addr(),
            Mem::Sim(m) => m.addr(),
        }
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        match &self.mem {
            Mem::Cuda(m) => m.len(),
            Mem::Sim(m) => m.len(),
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device it lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Copies `dst.len()` bytes at `offset` to `dst` (synchronous; no queued work may be
    /// writing them).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: in bounds of our allocation (checked).
        unsafe { self.device.read_raw(self.addr() + offset as u64, dst) }
    }

    /// Copies `src` to `offset` (synchronous; no queued work may be using those bytes).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: in bounds of our allocation (checked).
        unsafe { self.device.write_raw(self.addr() + offset as u64, src) }
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_some_and(|e| e <= self.len()) {
            Ok(())
        } else {
            Err(GpuError::BufferTooSmall {
                what: format!("device buffer access at offset {offset}"),
                got: self.len(),
                need: offset.saturating_add(len),
            })
        }
    }
}

enum StreamInner {
    Cuda(Arc<cuda::CudaStream>),
    Sim(SimStream),
}

/// An in-order queue of device work.
pub struct Stream {
    device: Device,
    inner: StreamInner,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("device", &self.device)
            .finish()
    }
}

/// Index lists uploaded for one transfer; released in stream order.
pub(crate) enum Scratch {
    Cuda(#[allow(dead_code)] StreamScratch),
    Sim(Arc<[u32]>),
}

impl Scratch {
    pub(crate) fn addr(&self) -> u64 {
        match self {
            Scratch::Cuda(s) => s.addr(),
            Scratch::Sim(v) => v.as_ptr() as u64,
        }
    }
}

impl Stream {
    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Records a new event at the current end of the queue.
    pub fn record(&self) -> Result<Event> {
        match (&self.inner, self.device.backend()) {
            (StreamInner::Cuda(s), Backend::Cuda(c)) => {
                let e = c.new_event()?;
                e.record(s)?;
                Ok(Event {
                    inner: EventInner::Cuda(Arc::new(e)),
                })
            }
            (StreamInner::Sim(s), _) => {
                let e = SimEvent::new();
                s.record(&e)?;
                Ok(Event {
                    inner: EventInner::Sim(e),
                })
            }
            _ => unreachable!("a stream's backend is its device's"),
        }
    }

    /// Runs `f`, handing the work it queues on this stream to the device as one submission
    /// where the backend has a cost per hand-off: on the sim device one wake-up of the stream's
    /// worker thread instead of one per kernel and event. On CUDA every launch is its own
    /// driver call anyway and `f` just runs. `f` must not block on work it queues here.
    pub(crate) fn batch<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        match &self.inner {
            StreamInner::Sim(s) => s.batch(f)?,
            StreamInner::Cuda(_) => f(),
        }
    }

    /// Holds the stream's later work until `event` completes.
    pub fn wait(&self, event: &Event) -> Result<()> {
        match (&self.inner, &event.inner) {
            (StreamInner::Cuda(s), EventInner::Cuda(e)) => e.wait_on(s),
            (StreamInner::Sim(s), EventInner::Sim(e)) => s.wait(e),
            _ => Err(GpuError::WrongDevice("event")),
        }
    }

    /// Holds the stream's later work until every event of `events` completes.
    pub fn wait_all(&self, events: &[&Event]) -> Result<()> {
        events.iter().try_for_each(|e| self.wait(e))
    }

    /// Blocks until everything queued so far has completed.
    pub fn synchronize(&self) -> Result<()> {
        match &self.inner {
            StreamInner::Cuda(s) => s
                .synchronize()
                .map_err(GpuError::driver("cuStreamSynchronize")),
            StreamInner::Sim(s) => s.synchronize(),
        }
    }

    /// Wraps a CUDA stream owned by the engine (e.g. the stream its attention runs on), so
    /// transfers can wait for its events and it can wait for layer events
    /// ([`LayerDoneCounter::stream_wait`](crate::LayerDoneCounter::stream_wait)). Dropping the
    /// wrapper leaves the stream alone. Errors on the sim device.
    ///
    /// # Safety
    /// `raw` must be a live `CUstream` of `device`'s primary context (the one PyTorch and
    /// SGLang use) that outlives the returned wrapper.
    pub unsafe fn borrow_cuda(device: &Device, raw: *mut std::ffi::c_void) -> Result<Stream> {
        match device.backend() {
            Backend::Cuda(c) => Ok(Stream {
                device: device.clone(),
                // SAFETY: per the contract.
                inner: StreamInner::Cuda(unsafe { c.borrow_stream(raw.cast()) }),
            }),
            Backend::Sim { .. } => Err(GpuError::InvalidConfig(
                "borrow_cuda needs a CUDA device".into(),
            )),
        }
    }

    /// The `CUstream` (CUDA only), for an engine to queue on or wait for with its own API.
    pub fn as_raw_cuda(&self) -> Option<*mut std::ffi::c_void> {
        match &self.inner {
            StreamInner::Cuda(s) => Some(s.cu_stream().cast()),
            StreamInner::Sim(_) => None,
        }
    }

    /// Sim only: holds the stream's later work until the returned gate is opened (or
    /// dropped). For tests of asynchronous behaviour; errors on CUDA streams.
    pub fn sim_gate(&self) -> Result<SimGate> {
        match &self.inner {
            StreamInner::Sim(s) => {
                let (tx, rx) = std::sync::mpsc::channel::<()>();
                s.run(move || {
                    let _ = rx.recv();
                })?;
                Ok(SimGate { tx: Some(tx) })
            }
            StreamInner::Cuda(_) => Err(GpuError::InvalidConfig(
                "sim_gate is only available on sim streams".into(),
            )),
        }
    }

    /// Uploads a list of page indices, freed in stream order when the returned scratch drops.
    pub(crate) fn upload_u32(&self, data: Arc<[u32]>) -> Result<Scratch> {
        match (&self.inner, self.device.backend()) {
            (StreamInner::Cuda(s), Backend::Cuda(c)) => Ok(Scratch::Cuda(c.upload_u32(s, &data)?)),
            (StreamInner::Sim(_), _) => Ok(Scratch::Sim(data)),
            _ => unreachable!("a stream's backend is its device's"),
        }
    }

    /// Queues the page copy kernel (sim: its CPU reference). `scratch` must hold the index
    /// lists the params point at (the device's and the host's pages).
    ///
    /// # Safety
    /// The params must satisfy [`copy::copy_reference`]'s contract (on sim) or reach only
    /// device memory of this device and registered host memory (on CUDA), valid until the
    /// work completes.
    pub(crate) unsafe fn launch_copy(
        &self,
        params: CopyParams,
        word_bytes: u32,
        ctas: u32,
        threads: u32,
        scratch: [&Scratch; 2],
    ) -> Result<()> {
        match (&self.inner, self.device.backend()) {
            (StreamInner::Cuda(s), Backend::Cuda(c)) => {
                c.launch_copy(s, &params, word_bytes, ctas, threads)
            }
            (StreamInner::Sim(s), _) => {
                // Held by the task, inline (no allocation per launch).
                let keep = scratch.map(|x| match x {
                    Scratch::Sim(v) => Some(v.clone()),
                    Scratch::Cuda(_) => None,
                });
                let payload = self.device.moves_payload();
                s.run(move || {
                    if payload {
                        // SAFETY: per the function's contract; `keep` holds the index lists.
                        unsafe { copy::copy_reference(&params) };
                    }
                    drop(keep);
                })
            }
            _ => unreachable!("a stream's backend is its device's"),
        }
    }

    /// Queues the DMA copies of a plan.
    ///
    /// # Safety
    /// Every op must reach only device memory of this device and (registered) host memory,
    /// valid until the work completes, with no destination overlapping a source.
    pub(crate) unsafe fn run_plan(&self, dir: Direction, ops: Vec<MemcpyOp>) -> Result<()> {
        match (&self.inner, self.device.backend()) {
            // SAFETY: per the function's contract.
            (StreamInner::Cuda(s), Backend::Cuda(c)) => unsafe { c.run_plan(s, dir, &ops) },
            (StreamInner::Sim(s), _) if !self.device.moves_payload() => s.run(move || drop(ops)),
            (StreamInner::Sim(s), _) => s.run(move || {
                // SAFETY: per the function's contract.
                unsafe { plan::run_plan_on_cpu(dir, &ops) }
            }),
            _ => unreachable!("a stream's backend is its device's"),
        }
    }

    /// Queues device-to-device copies (`cuMemcpyDtoDAsync` each; sim: memcpy on the
    /// stream's worker thread).
    ///
    /// # Safety
    /// Every copy's ranges must be device memory of this device, valid until the work
    /// completes, with no destination overlapping a source or another destination.
    pub(crate) unsafe fn run_d2d(&self, copies: Vec<DeviceCopy>) -> Result<()> {
        match (&self.inner, self.device.backend()) {
            // SAFETY: per the function's contract.
            (StreamInner::Cuda(s), Backend::Cuda(c)) => unsafe { c.run_d2d(s, &copies) },
            (StreamInner::Sim(s), _) if !self.device.moves_payload() => s.run(move || drop(copies)),
            (StreamInner::Sim(s), _) => s.run(move || {
                for c in copies {
                    // SAFETY: sim device memory is host memory; valid and disjoint per the
                    // function's contract.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            c.src as *const u8,
                            c.dst as *mut u8,
                            c.bytes as usize,
                        )
                    };
                }
            }),
            _ => unreachable!("a stream's backend is its device's"),
        }
    }
}

/// A closed gate on a sim stream (see [`Stream::sim_gate`]); opens on drop.
#[derive(Debug)]
pub struct SimGate {
    tx: Option<std::sync::mpsc::Sender<()>>,
}

impl SimGate {
    /// Lets the stream go on.
    pub fn open(mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for SimGate {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(());
        }
    }
}

#[derive(Clone)]
enum EventInner {
    Cuda(Arc<cuda::CudaEvent>),
    Sim(SimEvent),
}

/// A point in a stream's queue. Cheap to clone.
#[derive(Clone)]
pub struct Event {
    inner: EventInner,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event").finish_non_exhaustive()
    }
}

impl Event {
    /// Whether the work before the event has completed (never blocks).
    pub fn is_done(&self) -> Result<bool> {
        match &self.inner {
            EventInner::Cuda(e) => e.is_complete(),
            EventInner::Sim(e) => Ok(e.is_done()),
        }
    }

    /// The `CUevent` (CUDA only), for an engine to wait on with its own API. Valid while this
    /// event (or a clone) lives.
    pub fn as_raw_cuda(&self) -> Option<*mut std::ffi::c_void> {
        match &self.inner {
            EventInner::Cuda(e) => Some(e.cu_event().cast()),
            EventInner::Sim(_) => None,
        }
    }

    /// Blocks until the work before the event has completed.
    pub fn wait(&self) -> Result<()> {
        match &self.inner {
            EventInner::Cuda(e) => e.synchronize(),
            EventInner::Sim(e) => {
                e.wait();
                Ok(())
            }
        }
    }
}
