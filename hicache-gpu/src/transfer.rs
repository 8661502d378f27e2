//! [`TransferEngine`]: moves pages between the device pool (L1) and the host pool (L2).
//!
//! - `backup` (D2H) copies every layer of a list of `(device page, host page)` pairs on the
//!   **write stream** and returns a [`Completion`].
//! - `load` (H2D) copies layer by layer on the **load stream**, recording one event per layer,
//!   and returns a [`LoadHandle`]; the engine's attention for layer `i` waits for layer `i`
//!   only (directly or through a [`LayerDoneCounter`](crate::LayerDoneCounter)).
//!
//! Io backends ([`IoBackend`]):
//! - `kernel`: one launch of the page-copy kernel per backup (all layers) or per loaded layer,
//!   reading/writing the page-locked host pool directly over PCIe with 16-byte accesses, on a
//!   bounded number of CTAs ([`TransferConfig::ctas`]: at most that many SMs are used).
//!   With [`TransferConfig::staged_backup_pages`] `> 0`, backups are staged instead: the same
//!   kernel gathers a batch of pages into a device buffer laid out like the host pool, and
//!   DMA copies move each contiguous host run (one copy per page half and run of consecutive
//!   host pages for `page_first`) on a third stream, double-buffered so gathers overlap DMA.
//!   Which of the two is faster is for the `transfer` bench on the GPU to say.
//! - `direct`: DMA copies (`cuMemcpyAsync` / `cuMemcpy2DAsync`) queued back to back, with
//!   contiguous runs coalesced and `page_first` pages moved as one 2D copy per run and layer
//!   (see [`crate::plan`]).
//!
//! Validation before anything is queued (nothing is written on error): equal list lengths,
//! every page in range of its pool, no destination page twice, layers in range; at
//! construction, host and device pools of the same shape on the same device.
//!
//! Ordering: each call waits (on the device) for the events in `after` before it reads its
//! source, e.g. the event the engine recorded after writing the KV that is being backed up.
//! Dropping the engine synchronises both streams, so in-flight transfers never outlive the
//! pools and the registration they use.

use std::ops::Range;
use std::str::FromStr;
use std::sync::Arc;

use hicache_host::{HostLayout, HostPool, HostSlot, Slot};
use parking_lot::Mutex;

use crate::copy::CopyParams;
use crate::device::{Device, DeviceBuffer, DeviceKind, Event, Scratch, Stream};
use crate::error::{GpuError, Result};
use crate::marks::PageMarks;
use crate::plan::{self, Direction, MemcpyOp, PlanGeometry};
use crate::pool::DevicePool;
use crate::registration::HostRegistration;
use hicache_core::DeviceSlot;

/// How pages are moved.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum IoBackend {
    /// Gather/scatter kernels on a bounded number of SMs (default).
    #[default]
    Kernel,
    /// Batched DMA copies with coalesced runs.
    Direct,
}

impl IoBackend {
    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            IoBackend::Kernel => "kernel",
            IoBackend::Direct => "direct",
        }
    }
}

impl FromStr for IoBackend {
    type Err = GpuError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "kernel" => Ok(IoBackend::Kernel),
            "direct" => Ok(IoBackend::Direct),
            other => Err(GpuError::InvalidConfig(format!(
                "unknown io backend {other:?} (expected kernel or direct)"
            ))),
        }
    }
}

/// Transfer engine settings.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TransferConfig {
    /// Io backend.
    pub io: IoBackend,
    /// CTAs per kernel launch: an upper bound on the SMs a transfer occupies (1..=1024).
    pub ctas: u32,
    /// Threads per CTA (a multiple of 32, 32..=1024).
    pub threads_per_cta: u32,
    /// Bytes of a page half-layer handled by one warp at a time (≥ 512).
    pub chunk_bytes: u32,
    /// `kernel` io only: 0 (default) makes backups write the host pool directly from the
    /// kernel (zero-copy); `n > 0` stages them instead: the kernel gathers up to `n` pages at a
    /// time into a device staging buffer laid out like the host pool, and DMA copies move
    /// each contiguous host run (a whole page half for `page_first`), double-buffered so the
    /// gather of one batch overlaps the DMA of the previous one. Uses `2·n` pages of device
    /// memory. Loads are always zero-copy (a staged load could not signal layer by layer).
    pub staged_backup_pages: u32,
}

/// Default CTA count of the copy kernel: 8 CTAs × 512 threads keep enough 16-byte loads in
/// flight to fill PCIe while leaving every other SM to the engine's compute.
pub const DEFAULT_CTAS: u32 = 8;

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            io: IoBackend::Kernel,
            ctas: DEFAULT_CTAS,
            threads_per_cta: 512,
            chunk_bytes: 16 << 10,
            staged_backup_pages: 0,
        }
    }
}

impl TransferConfig {
    /// Checks the ranges documented on the fields.
    pub fn validate(&self) -> Result<()> {
        if !(1..=1024).contains(&self.ctas) {
            return Err(GpuError::InvalidConfig(format!(
                "ctas must be 1..=1024, got {}",
                self.ctas
            )));
        }
        if !(32..=1024).contains(&self.threads_per_cta) || !self.threads_per_cta.is_multiple_of(32)
        {
            return Err(GpuError::InvalidConfig(format!(
                "threads_per_cta must be a multiple of 32 in 32..=1024, got {}",
                self.threads_per_cta
            )));
        }
        if self.staged_backup_pages > 0 && self.io != IoBackend::Kernel {
            return Err(GpuError::InvalidConfig(
                "staged_backup_pages needs the kernel io backend".into(),
            ));
        }
        if self.chunk_bytes < 512 {
            return Err(GpuError::InvalidConfig(format!(
                "chunk_bytes must be at least 512, got {}",
                self.chunk_bytes
            )));
        }
        Ok(())
    }
}

/// The end of one queued transfer.
#[derive(Clone, Debug)]
pub struct Completion {
    event: Event,
}

impl Completion {
    /// The completion marked by `event`.
    pub(crate) fn new(event: Event) -> Self {
        Self { event }
    }

    /// Whether the transfer has finished (never blocks).
    pub fn is_done(&self) -> Result<bool> {
        self.event.is_done()
    }

    /// Blocks until the transfer has finished.
    pub fn wait(&self) -> Result<()> {
        self.event.wait()
    }

    /// The event recorded after the transfer (for other streams to wait on).
    pub fn event(&self) -> &Event {
        &self.event
    }
}

/// A queued layer-by-layer load: one event per layer. Cheap to clone.
#[derive(Clone, Debug)]
pub struct LoadHandle {
    layers: Arc<Vec<Event>>,
}

impl LoadHandle {
    /// A handle over one event per layer, in layer order.
    pub(crate) fn from_events(layers: Vec<Event>) -> Self {
        Self {
            layers: Arc::new(layers),
        }
    }

    /// Layers (events).
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn event(&self, layer: usize) -> Result<&Event> {
        self.layers.get(layer).ok_or(GpuError::LayerOutOfRange {
            begin: layer as u32,
            end: layer as u32 + 1,
            layers: self.layers.len() as u32,
        })
    }

    /// Whether layer `layer` has arrived (never blocks).
    pub fn is_layer_done(&self, layer: usize) -> Result<bool> {
        self.event(layer)?.is_done()
    }

    /// Blocks until layer `layer` has arrived.
    pub fn wait_layer(&self, layer: usize) -> Result<()> {
        self.event(layer)?.wait()
    }

    /// Makes `stream` wait (on the device) for layer `layer`.
    pub fn stream_wait_layer(&self, stream: &Stream, layer: usize) -> Result<()> {
        stream.wait(self.event(layer)?)
    }

    /// Whether every layer has arrived.
    pub fn is_done(&self) -> Result<bool> {
        match self.layers.last() {
            Some(e) => e.is_done(),
            None => Ok(true),
        }
    }

    /// Blocks until every layer has arrived.
    pub fn wait(&self) -> Result<()> {
        match self.layers.last() {
            Some(e) => e.wait(),
            None => Ok(()),
        }
    }
}

/// Moves pages between a [`DevicePool`] and a registered [`HostPool`] (module docs).
pub struct TransferEngine {
    device: Device,
    dev_pool: Arc<DevicePool>,
    host: Arc<HostRegistration>,
    config: TransferConfig,
    word_bytes: u32,
    write_stream: Stream,
    load_stream: Stream,
    staging: Option<Staging>,
    /// Marks of destination pages for the duplicate check, kept between transfers so that
    /// the check allocates, sorts and zeroes nothing (all clear between checks).
    dup_marks: Mutex<PageMarks>,
}

/// Device staging of backups (see [`TransferConfig::staged_backup_pages`]).
struct Staging {
    buffers: [DeviceBuffer; 2],
    /// The host layout with `pages` pages: the arrangement of each staging buffer.
    layout: HostLayout,
    pages: usize,
    word_bytes: [u32; 2],
    /// Runs the DMA copies, so the next gather (write stream) overlaps them.
    copy_stream: Stream,
    /// Per buffer, the end of the last DMA that reads it; held while a backup is queued,
    /// which also serialises concurrent staged backups.
    state: Mutex<StagingState>,
}

struct StagingState {
    next: usize,
    dma_done: [Option<Event>; 2],
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("device", &self.device)
            .field("config", &self.config)
            .field("word_bytes", &self.word_bytes)
            .finish()
    }
}

impl TransferEngine {
    /// An engine between `dev_pool` and the registered host pool.
    ///
    /// Errors: pools of different shapes ([`GpuError::ShapeMismatch`]), of different devices,
    /// an invalid config. With the `kernel` backend on CUDA, the kernels are compiled now, so
    /// a missing NVRTC or a compile failure shows here rather than at the first transfer.
    pub fn new(
        dev_pool: Arc<DevicePool>,
        host: Arc<HostRegistration>,
        config: TransferConfig,
    ) -> Result<Self> {
        config.validate()?;
        let device = dev_pool.device().clone();
        if !device.same_as(host.device()) {
            return Err(GpuError::WrongDevice("host registration"));
        }
        let (hs, ds) = (host.pool().shape(), dev_pool.shape());
        if hs != ds {
            return Err(GpuError::ShapeMismatch {
                host: hs,
                device: ds,
            });
        }
        if config.io == IoBackend::Kernel {
            device.prepare_kernels()?;
        }
        // Every u32 field of CopyParams derived from the shape below fits once this does
        // (page_size and layers are u32 already).
        let row_bytes = u32::try_from(ds.row_bytes()).map_err(|_| {
            GpuError::InvalidConfig(format!(
                "rows of {} bytes do not fit the copy kernel's 32-bit row size",
                ds.row_bytes()
            ))
        })?;
        let probe = CopyParams {
            row_bytes,
            host_base: host.device_addr(),
            ..Default::default()
        };
        let word_bytes = probe.word_bytes(dev_pool.layer_table().iter().copied());
        if word_bytes < 16 && config.io == IoBackend::Kernel {
            tracing::warn!(
                word_bytes,
                row_bytes,
                host_base = format_args!("{:#x}", host.device_addr()),
                "rows or buffers are not 16-byte aligned: the copy kernel falls back to \
                 {word_bytes}-byte accesses (slower); align engine buffers and rows to 16 bytes"
            );
        }
        let staging = match config.staged_backup_pages as usize {
            0 => None,
            pages => {
                let layout = HostLayout::new(ds, host.pool().layout_kind(), pages)?;
                let buffers = [
                    device.alloc_zeroed(layout.total_bytes())?,
                    device.alloc_zeroed(layout.total_bytes())?,
                ];
                let word = |b: &DeviceBuffer| {
                    CopyParams {
                        host_base: b.addr(),
                        ..probe
                    }
                    .word_bytes(dev_pool.layer_table().iter().copied())
                };
                Some(Staging {
                    word_bytes: [word(&buffers[0]), word(&buffers[1])],
                    buffers,
                    layout,
                    pages,
                    copy_stream: device.new_stream("staged-copy")?,
                    state: Mutex::new(StagingState {
                        next: 0,
                        dma_done: [None, None],
                    }),
                })
            }
        };
        Ok(Self {
            staging,
            write_stream: device.new_stream("write")?,
            load_stream: device.new_stream("load")?,
            device,
            dev_pool,
            host,
            config,
            word_bytes,
            dup_marks: Mutex::new(PageMarks::default()),
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The device pool.
    pub fn device_pool(&self) -> &Arc<DevicePool> {
        &self.dev_pool
    }

    /// The host pool.
    pub fn host_pool(&self) -> &Arc<HostPool> {
        self.host.pool()
    }

    /// The settings.
    pub fn config(&self) -> TransferConfig {
        self.config
    }

    /// Bytes per kernel memory access (16 when rows and addresses allow).
    pub fn word_bytes(&self) -> u32 {
        self.word_bytes
    }

    /// SMs a kernel transfer can occupy at most (`min(ctas, SMs)`); 0 for `direct`, which
    /// uses the copy engines, and on the sim device, which has no SMs.
    pub fn sms_used(&self) -> u32 {
        match (self.config.io, self.device.kind()) {
            (IoBackend::Kernel, DeviceKind::Cuda) => self.config.ctas.min(self.device.sm_count()),
            _ => 0,
        }
    }

    /// The stream backups run on.
    pub fn write_stream(&self) -> &Stream {
        &self.write_stream
    }

    /// The stream loads run on.
    pub fn load_stream(&self) -> &Stream {
        &self.load_stream
    }

    /// Backs up every layer of `device[i]` into `host[i]` (D2H) on the write stream, after
    /// the events in `after`.
    #[tracing::instrument(level = "debug", skip_all, fields(pages = device.len()))]
    pub fn backup(
        &self,
        device: &[DeviceSlot],
        host: &[HostSlot],
        after: &[&Event],
    ) -> Result<Completion> {
        let layers = 0..self.dev_pool.shape().layers;
        match &self.staging {
            Some(st) => self.backup_staged(st, device, host, after),
            None => self.copy_layers(Direction::ToHost, device, host, layers, after),
        }
    }

    /// Staged backup (see [`TransferConfig::staged_backup_pages`]).
    fn backup_staged(
        &self,
        st: &Staging,
        device: &[DeviceSlot],
        host: &[HostSlot],
        after: &[&Event],
    ) -> Result<Completion> {
        let layers = 0..self.dev_pool.shape().layers;
        let (dev, hst) = self.validate(Direction::ToHost, device, host, &layers)?;
        let ws = &self.write_stream;
        for e in after {
            ws.wait(e)?;
        }
        if dev.is_empty() {
            return Ok(Completion {
                event: ws.record()?,
            });
        }
        // Host-page order: consecutive host pages land in consecutive staging pages, so each
        // contiguous host run is one DMA copy per part.
        let mut pairs: Vec<(u32, u32)> = hst.iter().copied().zip(dev.iter().copied()).collect();
        pairs.sort_unstable();
        let host_layout = self.host.pool().layout();
        let host_base = self.host.pool().base_ptr() as u64;
        let mut state = st.state.lock();
        let mut last = None;
        for chunk in pairs.chunks(st.pages) {
            let b = state.next;
            state.next ^= 1;
            if let Some(e) = &state.dma_done[b] {
                ws.wait(e)?;
            }
            let n = chunk.len() as u32;
            let scratch = self.upload(
                ws,
                chunk.iter().map(|&(_, d)| d).collect(),
                (0..n).collect(),
            )?;
            let target = (st.buffers[b].addr(), st.layout.strides(), st.word_bytes[b]);
            self.launch_to(ws, Direction::ToHost, &scratch, n, layers.clone(), target)?;
            let gathered = ws.record()?;
            st.copy_stream.wait(&gathered)?;
            let mut ops: Vec<MemcpyOp> = Vec::new();
            for part in 0..st.layout.parts_per_page() {
                for (k, &(h, _)) in chunk.iter().enumerate() {
                    let src = st.layout.part(k, part);
                    let dst = host_layout.part(h as usize, part);
                    plan::push_linear(
                        &mut ops,
                        st.buffers[b].addr() + src.offset as u64,
                        host_base + dst.offset as u64,
                        src.len as u64,
                    );
                }
            }
            // SAFETY: staging offsets are inside buffer b (k < pages); host offsets are parts
            // of validated host pages.
            unsafe { st.copy_stream.run_plan(Direction::ToHost, ops)? };
            let done = st.copy_stream.record()?;
            state.dma_done[b] = Some(done.clone());
            last = Some(done);
        }
        Ok(Completion {
            event: last.expect("at least one chunk"),
        })
    }

    /// Loads `host[i]` into `device[i]` (H2D) layer by layer on the load stream, after the
    /// events in `after`, with one event per layer.
    #[tracing::instrument(level = "debug", skip_all, fields(pages = device.len()))]
    pub fn load(
        &self,
        host: &[HostSlot],
        device: &[DeviceSlot],
        after: &[&Event],
    ) -> Result<LoadHandle> {
        let layers = self.dev_pool.shape().layers;
        let (dev, hst) = self.validate(Direction::ToDevice, device, host, &(0..layers))?;
        let stream = &self.load_stream;
        // One hand-off for the whole load (nothing here waits on it).
        stream.batch(|| {
            for e in after {
                stream.wait(e)?;
            }
            let mut events = Vec::with_capacity(layers as usize);
            match self.config.io {
                IoBackend::Kernel => {
                    let n = dev.len() as u32;
                    let scratch = self.upload(stream, dev, hst)?;
                    for l in 0..layers {
                        self.launch(stream, Direction::ToDevice, &scratch, n, l..l + 1)?;
                        events.push(stream.record()?);
                    }
                }
                IoBackend::Direct => {
                    for l in 0..layers {
                        let ops = self.plan(&dev, &hst, l..l + 1);
                        // SAFETY: validated pages, so every op is inside the pools.
                        unsafe { stream.run_plan(Direction::ToDevice, ops)? };
                        events.push(stream.record()?);
                    }
                }
            }
            Ok(LoadHandle {
                layers: Arc::new(events),
            })
        })
    }

    /// Copies `layers` of every pair in direction `dir`, on the write stream (`ToHost`) or the
    /// load stream (`ToDevice`), after the events in `after`.
    #[tracing::instrument(level = "debug", skip_all, fields(dir = ?dir, pages = device.len(), layers = ?layers))]
    pub fn copy_layers(
        &self,
        dir: Direction,
        device: &[DeviceSlot],
        host: &[HostSlot],
        layers: Range<u32>,
        after: &[&Event],
    ) -> Result<Completion> {
        let (dev, hst) = self.validate(dir, device, host, &layers)?;
        let stream = self.stream(dir);
        // One hand-off for the whole copy (nothing here waits on it).
        stream.batch(|| {
            for e in after {
                stream.wait(e)?;
            }
            if !dev.is_empty() && !layers.is_empty() {
                match self.config.io {
                    IoBackend::Kernel => {
                        let n = dev.len() as u32;
                        let scratch = self.upload(stream, dev, hst)?;
                        self.launch(stream, dir, &scratch, n, layers)?;
                    }
                    IoBackend::Direct => {
                        let ops = self.plan(&dev, &hst, layers);
                        // SAFETY: validated pages, so every op is inside the pools.
                        unsafe { stream.run_plan(dir, ops)? };
                    }
                }
            }
            Ok(Completion {
                event: stream.record()?,
            })
        })
    }

    /// The plan the `direct` backend would run for these pairs (for inspection and tests).
    pub fn direct_plan(
        &self,
        device: &[DeviceSlot],
        host: &[HostSlot],
        layers: Range<u32>,
    ) -> Result<Vec<MemcpyOp>> {
        let (dev, hst) = self.validate(Direction::ToHost, device, host, &layers)?;
        Ok(self.plan(&dev, &hst, layers))
    }

    /// The physical reference of benches: one bulk DMA copy of `bytes` between `scratch` and
    /// the start of the (page-locked) host pool, on the stream of `dir`.
    ///
    /// It **overwrites** the first `bytes` of the host pool (`ToHost`) or of `scratch`
    /// (`ToDevice`): for benches, not for a pool holding live pages.
    pub fn bulk_copy(
        &self,
        dir: Direction,
        scratch: &DeviceBuffer,
        bytes: usize,
        after: &[&Event],
    ) -> Result<Completion> {
        if !scratch.device().same_as(&self.device) {
            return Err(GpuError::WrongDevice("scratch buffer"));
        }
        let host_len = self.host.pool().layout().total_bytes();
        if bytes > scratch.len() || bytes > host_len {
            return Err(GpuError::BufferTooSmall {
                what: "bulk copy (scratch buffer or host pool)".into(),
                got: scratch.len().min(host_len),
                need: bytes,
            });
        }
        let stream = self.stream(dir);
        for e in after {
            stream.wait(e)?;
        }
        let op = MemcpyOp::Linear {
            dev: scratch.addr(),
            host: self.host.pool().base_ptr() as u64,
            bytes: bytes as u64,
        };
        // SAFETY: both ranges checked above; the caller accepts the overwrite.
        unsafe { stream.run_plan(dir, vec![op])? };
        Ok(Completion {
            event: stream.record()?,
        })
    }

    /// Blocks until every stream of the engine is idle.
    pub fn synchronize(&self) -> Result<()> {
        self.write_stream.synchronize()?;
        if let Some(st) = &self.staging {
            st.copy_stream.synchronize()?;
        }
        self.load_stream.synchronize()
    }

    fn stream(&self, dir: Direction) -> &Stream {
        match dir {
            Direction::ToHost => &self.write_stream,
            Direction::ToDevice => &self.load_stream,
        }
    }

    /// The validation of the module docs; returns the raw page indices.
    fn validate(
        &self,
        dir: Direction,
        device: &[DeviceSlot],
        host: &[HostSlot],
        layers: &Range<u32>,
    ) -> Result<(PageList, PageList)> {
        if device.len() != host.len() {
            return Err(GpuError::LengthMismatch {
                what: "device pages vs host pages",
                left: device.len(),
                right: host.len(),
            });
        }
        let total = self.dev_pool.shape().layers;
        if layers.start > layers.end || layers.end > total {
            return Err(GpuError::LayerOutOfRange {
                begin: layers.start,
                end: layers.end,
                layers: total,
            });
        }
        let dev = check_pages("device", device, self.dev_pool.num_pages())?;
        let hst = check_pages("host", host, self.host.pool().num_pages())?;
        let (pool, dst, cap) = match dir {
            Direction::ToHost => ("host", &hst, self.host.pool().num_pages()),
            Direction::ToDevice => ("device", &dev, self.dev_pool.num_pages()),
        };
        if let Some(page) = first_duplicate(dst, cap, &mut self.dup_marks.lock()) {
            return Err(GpuError::DuplicateDestination { pool, page });
        }
        Ok((dev, hst))
    }

    fn upload(&self, stream: &Stream, dev: PageList, hst: PageList) -> Result<[Scratch; 2]> {
        Ok([stream.upload_u32(dev)?, stream.upload_u32(hst)?])
    }

    fn launch(
        &self,
        stream: &Stream,
        dir: Direction,
        scratch: &[Scratch; 2],
        num_pairs: u32,
        layers: Range<u32>,
    ) -> Result<()> {
        let target = (
            self.host.device_addr(),
            self.host.pool().layout().strides(),
            self.word_bytes,
        );
        self.launch_to(stream, dir, scratch, num_pairs, layers, target)
    }

    /// Launches the copy kernel between the device pool and `target` = (device-visible base,
    /// layout strides, word width): the host pool, or a staging buffer in the host layout.
    fn launch_to(
        &self,
        stream: &Stream,
        dir: Direction,
        scratch: &[Scratch; 2],
        num_pairs: u32,
        layers: Range<u32>,
        (base, s, word_bytes): (u64, hicache_host::Strides, u32),
    ) -> Result<()> {
        if num_pairs == 0 || layers.is_empty() {
            return Ok(());
        }
        let shape = self.dev_pool.shape();
        let params = CopyParams {
            dev_table: self.dev_pool.table_addr(),
            dev_pages: scratch[0].addr(),
            host_pages: scratch[1].addr(),
            host_base: base,
            host_half_stride: s.half as u64,
            host_page_stride: s.page as u64,
            host_layer_stride: s.layer as u64,
            host_token_stride: s.token as u64,
            dev_page_stride: shape.page_layer_bytes() as u64,
            num_pairs,
            layer_begin: layers.start,
            num_layers: layers.end - layers.start,
            total_layers: shape.layers,
            num_halves: shape.halves() as u32,
            page_size: shape.page_size,
            row_bytes: shape.row_bytes() as u32,
            to_host: (dir == Direction::ToHost) as u32,
            rows_per_chunk: 0,
            chunks_per_unit: 0,
        }
        .with_chunk_bytes(self.config.chunk_bytes);
        // SAFETY: pages validated against both pools (staging pages are 0..num_pairs of a
        // staging buffer of at least that many pages); the table, index lists, pools and
        // staging buffers stay alive until the work completes (scratch is stream-ordered or
        // held by the sim task; the rest is held by the engine, which synchronises on drop).
        unsafe {
            stream.launch_copy(
                params,
                word_bytes,
                self.config.ctas,
                self.config.threads_per_cta,
                [&scratch[0], &scratch[1]],
            )
        }
    }

    fn plan(&self, dev: &[u32], hst: &[u32], layers: Range<u32>) -> Vec<MemcpyOp> {
        let shape = self.dev_pool.shape();
        let g = PlanGeometry {
            dev_table: self.dev_pool.layer_table(),
            total_layers: shape.layers,
            halves: shape.halves() as u32,
            page_size: shape.page_size,
            row_bytes: shape.row_bytes() as u32,
            host_base: self.host.pool().base_ptr() as u64,
            host: self.host.pool().layout().strides(),
            dev_one_allocation: !self.dev_pool.is_engine_owned(),
        };
        plan::plan_direct(&g, dev, hst, layers)
    }
}

/// A transfer's raw page indices of one pool, in pair order, shared with the queued work.
type PageList = Arc<[u32]>;

/// The first page of `pages` (in order) that repeats an earlier one; pages are below `cap`
/// (checked before), `marks` the engine's reused bitmap.
fn first_duplicate(pages: &[u32], cap: usize, marks: &mut PageMarks) -> Option<u32> {
    marks.first_repeat(pages, |&p| p, cap).map(|i| pages[i])
}

/// The raw page indices of `slots`, each checked below `capacity`: one allocation, shared
/// as is by the sim device's queued work (an index list is never copied there).
fn check_pages<S: Slot>(pool: &'static str, slots: &[S], capacity: usize) -> Result<PageList> {
    if let Some((position, page)) = slots
        .iter()
        .map(|s| s.index())
        .enumerate()
        .find(|&(_, page)| page as usize >= capacity)
    {
        return Err(GpuError::PageOutOfRange {
            pool,
            page,
            position,
            capacity,
        });
    }
    // A slice iterator knows its length: the shared slice is allocated once, filled in place.
    Ok(slots.iter().map(|s| s.index()).collect())
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        if let Err(e) = self.synchronize() {
            tracing::error!(error = %e, "synchronising transfer streams on drop failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::first_duplicate;
    use crate::marks::PageMarks;

    #[test]
    fn the_first_repeated_page_is_found_and_the_marks_are_left_clear() {
        // One bitmap reused across checks and pool sizes, as the engine reuses it.
        let mut marks = PageMarks::default();
        for cap in [4096, 8, 64, 65] {
            assert_eq!(first_duplicate(&[3, 1, 2], cap, &mut marks), None);
            assert_eq!(first_duplicate(&[5, 1, 7, 1, 5], cap, &mut marks), Some(1));
            assert_eq!(first_duplicate(&[5, 6, 5, 6], cap, &mut marks), Some(5));
            assert_eq!(first_duplicate(&[], cap, &mut marks), None);
            assert_eq!(first_duplicate(&[7, 7], cap, &mut marks), Some(7));
            assert!(marks.is_clear(), "marks left set (cap {cap})");
            // A page marked by an earlier check is not a repeat in this one.
            assert_eq!(first_duplicate(&[1, 2, 3, 5, 6, 7], cap, &mut marks), None);
        }
        assert_eq!(
            first_duplicate(&[4095, 0, 4095], 4096, &mut marks),
            Some(4095)
        );
        assert!(marks.is_clear());
    }
}
