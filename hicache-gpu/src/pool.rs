//! [`DevicePool`]: the L1 KV pool, either allocated by us or registered from the engine, with
//! a page allocator ([`DeviceSlot`]).
//!
//! Device layout (what the engine's attention kernels read): for each half (K, V; MLA has one)
//! and layer, one buffer `[page][token][row]`, so page `p` of layer `l` is the `ps·R` bytes at
//! `layer_ptr(h, l) + p·ps·R`. Our own pool is one allocation `[h][l][p][t][row]` (equally
//! spaced layers, which lets the direct backend move all layers of a page in one 2D copy);
//! an engine-registered pool has a pointer per half and layer.
//!
//! Invariants:
//! 1. Every layer buffer holds at least `num_pages·ps·R` bytes (checked at construction; on
//!    CUDA also against the driver's allocation table, so an undersized registration is an
//!    error, not an out-of-bounds write) and no two layer buffers overlap.
//! 2. The pool never frees engine memory; the engine keeps ownership and must keep it alive
//!    as long as the pool (and any transfer engine using it) lives.
//! 3. The pointer table (`[h·L + l]`) is also on the device, for the kernels.

use hicache_core::{DeviceSlot, KvShape};
use hicache_host::PageAllocator;
use parking_lot::Mutex;

use crate::device::{Backend, Device, DeviceBuffer};
use crate::error::{GpuError, Result};

/// A range of device memory owned by someone else (the engine).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct DeviceRegion {
    /// Device address.
    pub ptr: u64,
    /// Bytes.
    pub len: usize,
}

/// The engine's buffers of one layer: K and V for MHA, the latent buffer (in `k`) for MLA.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct EngineLayer {
    /// K (MHA) or the latent (MLA).
    pub k: DeviceRegion,
    /// V (MHA only).
    pub v: Option<DeviceRegion>,
}

/// The L1 KV pool (see the module docs).
pub struct DevicePool {
    device: Device,
    shape: KvShape,
    num_pages: usize,
    table: Vec<u64>,
    table_buf: DeviceBuffer,
    owned: Option<DeviceBuffer>,
    allocator: Mutex<PageAllocator<DeviceSlot>>,
}

impl std::fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePool")
            .field("shape", &self.shape)
            .field("num_pages", &self.num_pages)
            .field("engine_owned", &self.is_engine_owned())
            .finish()
    }
}

impl DevicePool {
    /// Allocates a zeroed pool of `num_pages` pages on `device`.
    pub fn new(device: &Device, shape: KvShape, num_pages: usize) -> Result<Self> {
        check_shape(&shape, num_pages)?;
        let layer_bytes = layer_bytes(&shape, num_pages)?;
        let n = shape.halves() * shape.layers as usize;
        let total = layer_bytes
            .checked_mul(n)
            .ok_or_else(|| GpuError::InvalidConfig(format!("{num_pages} pages overflow")))?;
        let owned = device.alloc_zeroed(total)?;
        let table = (0..n as u64)
            .map(|i| owned.addr() + i * layer_bytes as u64)
            .collect();
        Self::finish(device, shape, num_pages, table, Some(owned))
    }

    /// Registers the engine's buffers (per layer K and V, or the MLA latent) as the pool.
    ///
    /// Errors when the number of layers, the halves (V present for MHA, absent for MLA), a
    /// buffer's size (at least `num_pages·page_size·row_bytes`), a null or overlapping
    /// pointer does not match `shape`; on CUDA every buffer is also checked against the
    /// driver's record of its allocation.
    ///
    /// # Safety
    /// Every region must be device memory of `device` (on sim: host memory of this process)
    /// that stays allocated, and is not used by anything else while transfers run, for as
    /// long as the pool lives.
    pub unsafe fn from_engine(
        device: &Device,
        shape: KvShape,
        num_pages: usize,
        layers: &[EngineLayer],
    ) -> Result<Self> {
        check_shape(&shape, num_pages)?;
        let need = layer_bytes(&shape, num_pages)?;
        if layers.len() != shape.layers as usize {
            return Err(GpuError::BadRegistration(format!(
                "{} layers given, the shape has {}",
                layers.len(),
                shape.layers
            )));
        }
        let mha = shape.halves() == 2;
        let mut regions: Vec<(DeviceRegion, String)> = Vec::new();
        for (i, l) in layers.iter().enumerate() {
            match (mha, l.v) {
                (true, None) => {
                    return Err(GpuError::BadRegistration(format!(
                        "layer {i}: MHA needs a V buffer"
                    )));
                }
                (false, Some(_)) => {
                    return Err(GpuError::BadRegistration(format!(
                        "layer {i}: MLA has one latent buffer, a V buffer was given"
                    )));
                }
                _ => {}
            }
            regions.push((
                l.k,
                format!("layer {i} {}", if mha { "K" } else { "latent" }),
            ));
        }
        if mha {
            for (i, l) in layers.iter().enumerate() {
                regions.push((l.v.expect("checked above"), format!("layer {i} V")));
            }
        }
        for (r, what) in &regions {
            if r.ptr == 0 {
                return Err(GpuError::BadRegistration(format!("{what}: null pointer")));
            }
            if r.len < need {
                return Err(GpuError::BufferTooSmall {
                    what: what.clone(),
                    got: r.len,
                    need,
                });
            }
            if r.ptr.checked_add(need as u64).is_none() {
                return Err(GpuError::BadRegistration(format!(
                    "{what}: address overflows"
                )));
            }
            if let Backend::Cuda(c) = device.backend() {
                // Across consecutive VMM mappings (expandable segments) when the buffer
                // continues past the chunk the driver reports first.
                let end = c.reachable_end(r.ptr, need).map_err(|e| {
                    GpuError::BadRegistration(format!("{what}: not device memory ({e})"))
                })?;
                let avail = end.saturating_sub(r.ptr) as usize;
                if avail < need {
                    return Err(GpuError::BufferTooSmall {
                        what: format!("{what} (driver allocation)"),
                        got: avail,
                        need,
                    });
                }
            }
        }
        let mut spans: Vec<(u64, u64, &str)> = regions
            .iter()
            .map(|(r, w)| (r.ptr, r.ptr + need as u64, w.as_str()))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(GpuError::BadRegistration(format!(
                    "{} and {} overlap",
                    w[0].2, w[1].2
                )));
            }
        }
        let table = regions.iter().map(|(r, _)| r.ptr).collect();
        Self::finish(device, shape, num_pages, table, None)
    }

    fn finish(
        device: &Device,
        shape: KvShape,
        num_pages: usize,
        table: Vec<u64>,
        owned: Option<DeviceBuffer>,
    ) -> Result<Self> {
        let bytes: Vec<u8> = table.iter().flat_map(|p: &u64| p.to_le_bytes()).collect();
        let table_buf = device.alloc_zeroed(bytes.len())?;
        table_buf.write(0, &bytes)?;
        Ok(Self {
            device: device.clone(),
            shape,
            num_pages,
            table,
            table_buf,
            owned,
            allocator: Mutex::new(PageAllocator::new(num_pages)),
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The KV shape.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Bytes of one page (all layers and halves).
    pub fn page_bytes(&self) -> usize {
        self.shape.page_bytes()
    }

    /// Whether the memory belongs to the engine.
    pub fn is_engine_owned(&self) -> bool {
        self.owned.is_none()
    }

    /// Device address of layer `layer` of half `half` (0 = K or latent, 1 = V).
    pub fn layer_ptr(&self, half: usize, layer: usize) -> Option<u64> {
        (half < self.shape.halves() && layer < self.shape.layers as usize)
            .then(|| self.table[half * self.shape.layers as usize + layer])
    }

    /// Every layer pointer, `[half · layers + layer]`.
    pub fn layer_table(&self) -> &[u64] {
        &self.table
    }

    pub(crate) fn table_addr(&self) -> u64 {
        self.table_buf.addr()
    }

    /// `n` free pages, or `None` when fewer are free.
    pub fn alloc(&self, n: usize) -> Option<Vec<DeviceSlot>> {
        self.allocator.lock().alloc(n)
    }

    /// Frees pages; all-or-nothing, double frees are errors.
    pub fn free(&self, slots: &[DeviceSlot]) -> Result<()> {
        Ok(self.allocator.lock().free(slots)?)
    }

    /// Pages free now.
    pub fn available(&self) -> usize {
        self.allocator.lock().available()
    }

    /// Whether `slot` is allocated now.
    pub fn is_allocated(&self, slot: DeviceSlot) -> bool {
        self.allocator.lock().is_allocated(slot)
    }

    /// The position of the first of `slots` that is not allocated now, if any (one lock for
    /// the whole list).
    pub fn first_unallocated(&self, slots: &[DeviceSlot]) -> Option<usize> {
        let a = self.allocator.lock();
        slots.iter().position(|&s| !a.is_allocated(s))
    }

    /// Copies page `slot` to `dst` in flat order `[half][layer][token][row]` (synchronous; no
    /// transfer may be writing the page).
    pub fn read_page(&self, slot: DeviceSlot, dst: &mut [u8]) -> Result<()> {
        self.check(slot, dst.len())?;
        let chunk = self.shape.page_layer_bytes();
        for (i, d) in dst.chunks_exact_mut(chunk).enumerate() {
            let src = self.table[i] + slot.0 as u64 * chunk as u64;
            // SAFETY: inside layer buffer i (invariant 1, checked slot).
            unsafe { self.device.read_raw(src, d)? };
        }
        Ok(())
    }

    /// Writes page `slot` from `src` in flat order `[half][layer][token][row]` (synchronous;
    /// no transfer may be using the page).
    pub fn write_page(&self, slot: DeviceSlot, src: &[u8]) -> Result<()> {
        self.check(slot, src.len())?;
        let chunk = self.shape.page_layer_bytes();
        for (i, s) in src.chunks_exact(chunk).enumerate() {
            let dst = self.table[i] + slot.0 as u64 * chunk as u64;
            // SAFETY: inside layer buffer i (invariant 1, checked slot).
            unsafe { self.device.write_raw(dst, s)? };
        }
        Ok(())
    }

    fn check(&self, slot: DeviceSlot, len: usize) -> Result<()> {
        if slot.0 as usize >= self.num_pages {
            return Err(GpuError::PageOutOfRange {
                pool: "device",
                page: slot.0,
                position: 0,
                capacity: self.num_pages,
            });
        }
        if len != self.page_bytes() {
            return Err(GpuError::BufferTooSmall {
                what: format!("page buffer of {len} bytes (must be exactly one page)"),
                got: len,
                need: self.page_bytes(),
            });
        }
        Ok(())
    }
}

fn check_shape(shape: &KvShape, num_pages: usize) -> Result<()> {
    shape.validate().map_err(hicache_host::HostError::from)?;
    if num_pages == 0 || num_pages > u32::MAX as usize {
        return Err(GpuError::InvalidConfig(format!(
            "a device pool needs 1..2^32 pages, got {num_pages}"
        )));
    }
    Ok(())
}

fn layer_bytes(shape: &KvShape, num_pages: usize) -> Result<usize> {
    shape
        .page_layer_bytes()
        .checked_mul(num_pages)
        .ok_or_else(|| GpuError::InvalidConfig(format!("{num_pages} pages overflow")))
}
