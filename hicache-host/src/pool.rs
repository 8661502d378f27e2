//! [`HostPool`]: the L2 KV pool: a [`HostMemory`] mapping arranged by a [`HostLayout`], with a
//! page allocator and page views.
//!
//! Ownership rules (what the controller keeps, and what makes the copy methods sound):
//! 1. A page's bytes have one user at a time: the holder of its [`HostSlot`] (handed out once
//!    by [`HostPool::alloc`]) decides whether a transfer, an L3 read or an L3 write touches it,
//!    and never two at once. Copy methods on `&self` ([`HostPool::get_page`],
//!    [`HostPool::set_page`]) rely on that rule; concurrent use of *different* pages is always
//!    fine.
//! 2. Borrowed slices of a page come either from `&mut self` (exclusive, safe) or from the
//!    `unsafe` [`HostPool::page_parts_shared`] whose caller promises rule 1.
//! 3. The mapping never moves or shrinks while the pool lives: iovecs and the
//!    [`MemoryRegion`] stay valid as long as the caller holds the pool (normally an `Arc`).

use std::sync::atomic::{AtomicBool, Ordering};

use hicache_core::{KvShape, LayoutKind, MemoryRegion};
use parking_lot::Mutex;

use crate::alloc::{HostSlot, PageAllocator, Slot};
use crate::error::{HostError, Result};
use crate::layout::HostLayout;
use crate::memory::{self, HostMemory, HugePagePolicy, Populate};

/// Default bytes of host RAM kept free by the RAM check: 10 GiB, like SGLang's
/// `HICACHE_HOST_MEMORY_RESERVE_BYTES`, but at most a quarter of the machine's RAM so small
/// machines can still hold a pool.
pub const DEFAULT_RESERVE_BYTES: u64 = 10 << 30;

/// How big the host pool is.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum PoolSize {
    /// Exactly this many pages.
    Pages(usize),
    /// A byte budget (SGLang's `--hicache-size`, in bytes): `floor(bytes / token_bytes)`
    /// tokens, rounded down to pages, plus one page (SGLang always adds a page).
    Bytes(u64),
    /// A multiple of the device pool (SGLang's `--hicache-ratio`):
    /// `floor(device_pages · page_size · ratio)` tokens, rounded down to pages, plus one page.
    Ratio {
        /// Host size over device size; > 0.
        ratio: f64,
        /// Pages of the device pool.
        device_pages: usize,
    },
}

impl PoolSize {
    /// Number of pages for `shape`.
    pub fn pages(&self, shape: &KvShape) -> Result<usize> {
        shape.validate()?;
        self.units(shape.token_bytes() as u64, shape.page_size as u64)
    }

    /// Number of pages of `page_size` units of `unit_bytes` each (a unit is a token of a KV
    /// pool, or one state slot of a state pool, whose pages are one slot): the sizing of
    /// [`PoolSize::pages`] for any pool geometry. Both arguments must be non-zero.
    pub fn units(&self, unit_bytes: u64, page_size: u64) -> Result<usize> {
        if unit_bytes == 0 || page_size == 0 {
            return Err(HostError::BadSize(format!(
                "a pool unit of {unit_bytes} bytes in pages of {page_size}"
            )));
        }
        let ps = page_size;
        let pages = match *self {
            PoolSize::Pages(n) => n as u64,
            PoolSize::Bytes(b) => {
                if b == 0 {
                    return Err(HostError::BadSize("hicache size of 0 bytes".into()));
                }
                b / unit_bytes / ps + 1
            }
            PoolSize::Ratio {
                ratio,
                device_pages,
            } => {
                if !(ratio.is_finite() && ratio > 0.0) {
                    return Err(HostError::BadSize(format!(
                        "hicache ratio must be a positive number, got {ratio}"
                    )));
                }
                let tokens = (device_pages as f64 * ps as f64 * ratio).floor();
                if tokens >= u64::MAX as f64 {
                    return Err(HostError::BadSize(format!("ratio {ratio} overflows")));
                }
                let pages = tokens as u64 / ps + 1;
                if pages <= device_pages as u64 {
                    tracing::warn!(
                        host_pages = pages,
                        device_pages,
                        "host pool is not larger than the device pool: \
                         write-through will stop backing up once it is full"
                    );
                }
                pages
            }
        };
        if pages == 0 {
            return Err(HostError::BadSize(
                "a host pool needs at least one page".into(),
            ));
        }
        if pages > u32::MAX as u64 {
            return Err(HostError::BadSize(format!(
                "{pages} pages exceed the 2^32 page indices"
            )));
        }
        Ok(pages as usize)
    }
}

/// Everything needed to build a [`HostPool`].
#[derive(Clone, Debug, PartialEq)]
pub struct HostPoolConfig {
    /// KV shape (MHA or MLA, layers, dtype, page size).
    pub shape: KvShape,
    /// Host layout.
    pub layout: LayoutKind,
    /// Size.
    pub size: PoolSize,
    /// Huge page policy.
    pub huge_pages: HugePagePolicy,
    /// When the pool's memory is populated (at once by default; on touch for a pool that a
    /// payload-free device never copies to or from).
    pub populate: Populate,
    /// Bytes of RAM that must stay available after the pool is mapped; `None` for
    /// `min(DEFAULT_RESERVE_BYTES, MemTotal / 4)`.
    pub reserve_bytes: Option<u64>,
}

impl HostPoolConfig {
    /// A config with the default huge page policy and reserve.
    pub fn new(shape: KvShape, layout: LayoutKind, size: PoolSize) -> Self {
        Self {
            shape,
            layout,
            size,
            huge_pages: HugePagePolicy::Auto,
            populate: Populate::Now,
            reserve_bytes: None,
        }
    }

    /// Sets the huge page policy.
    pub fn huge_pages(mut self, policy: HugePagePolicy) -> Self {
        self.huge_pages = policy;
        self
    }

    /// Sets when the pool's memory is populated.
    pub fn populate(mut self, populate: Populate) -> Self {
        self.populate = populate;
        self
    }

    /// Sets the RAM reserve.
    pub fn reserve_bytes(mut self, bytes: u64) -> Self {
        self.reserve_bytes = Some(bytes);
        self
    }
}

/// One contiguous run of host memory, for vectored and zero-copy I/O.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct IoVec {
    /// Start address.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
}

impl IoVec {
    /// The start address as a pointer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }
}

/// The RAM check: `requested` bytes must fit in `MemAvailable` once `reserve` (default:
/// `min(DEFAULT_RESERVE_BYTES, MemTotal / 4)`) is kept free. Passes where the machine does
/// not say how much is available.
pub(crate) fn check_ram(requested: u64, reserve: Option<u64>) -> Result<()> {
    if let Some(available) = memory::mem_available() {
        let reserve = reserve.unwrap_or_else(|| {
            let quarter = memory::mem_total().unwrap_or(u64::MAX) / 4;
            DEFAULT_RESERVE_BYTES.min(quarter)
        });
        if requested > available.saturating_sub(reserve) {
            return Err(HostError::InsufficientMemory {
                requested,
                available,
                reserve,
            });
        }
    }
    Ok(())
}

/// The region descriptor of a pool's mapping.
pub(crate) fn region_of(memory: &HostMemory, cuda_registered: &AtomicBool) -> MemoryRegion {
    MemoryRegion {
        addr: memory.as_ptr() as usize,
        len: memory.len(),
        cuda_registered: cuda_registered.load(Ordering::Acquire),
        huge_pages: memory.huge_pages(),
    }
}

/// Copies the bytes of `iovs`, in order, into `dst`, whose length must be their total.
///
/// # Safety
/// Every iovec must lie inside a live mapping, disjoint from `dst`, and have no writer while
/// this runs (rule 1 of the module docs).
pub(crate) unsafe fn gather(iovs: &[IoVec], dst: &mut [u8]) {
    let mut at = 0;
    for iov in iovs {
        // SAFETY: per the contract; dst[at..at + len] is in bounds (total length checked by
        // every caller).
        unsafe { std::ptr::copy_nonoverlapping(iov.as_ptr(), dst[at..].as_mut_ptr(), iov.len) };
        at += iov.len;
    }
    debug_assert_eq!(at, dst.len());
}

/// Writes `src`, in order, into the bytes of `iovs`; `src` must be their total length.
///
/// # Safety
/// Every iovec must lie inside a live mapping, disjoint from `src`, with no other user while
/// this runs (rule 1 of the module docs).
pub(crate) unsafe fn scatter(iovs: &[IoVec], src: &[u8]) {
    let mut at = 0;
    for iov in iovs {
        let chunk = &src[at..at + iov.len];
        // SAFETY: per the contract; chunk is exactly iov.len bytes.
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), iov.as_ptr(), iov.len) };
        at += iov.len;
    }
    debug_assert_eq!(at, src.len());
}

/// Checks that a copy buffer has the length of one page (or slot).
pub(crate) fn check_buffer(what: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(HostError::BufferSize {
            what,
            got,
            expected,
        })
    }
}

/// The L2 KV pool (see the module docs for the ownership rules).
pub struct HostPool {
    layout: HostLayout,
    memory: HostMemory,
    allocator: Mutex<PageAllocator<HostSlot>>,
    cuda_registered: AtomicBool,
}

impl std::fmt::Debug for HostPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPool")
            .field("layout", &self.layout)
            .field("backing", &self.memory.backing())
            .field("available", &self.available())
            .finish()
    }
}

impl HostPool {
    /// Sizes, checks and maps a pool.
    ///
    /// Errors: invalid shape or size, not enough RAM once the reserve is kept
    /// ([`HostError::InsufficientMemory`]), mapping failures.
    pub fn new(config: HostPoolConfig) -> Result<Self> {
        let pages = config.size.pages(&config.shape)?;
        let layout = HostLayout::new(config.shape, config.layout, pages)?;
        let requested = layout.total_bytes() as u64;
        check_ram(requested, config.reserve_bytes)?;
        let memory =
            HostMemory::with_population(layout.total_bytes(), config.huge_pages, config.populate)?;
        tracing::info!(
            pages,
            bytes = requested,
            layout = config.layout.as_str(),
            backing = ?memory.backing(),
            "host pool mapped"
        );
        Ok(Self {
            layout,
            memory,
            allocator: Mutex::new(PageAllocator::new(pages)),
            cuda_registered: AtomicBool::new(false),
        })
    }

    /// The layout descriptor (byte offsets of every row, parts of every page).
    pub fn layout(&self) -> &HostLayout {
        &self.layout
    }

    /// The KV shape.
    pub fn shape(&self) -> KvShape {
        self.layout.shape()
    }

    /// The layout kind.
    pub fn layout_kind(&self) -> LayoutKind {
        self.layout.kind()
    }

    /// Pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.layout.num_pages()
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> usize {
        self.layout.page_bytes()
    }

    /// Start address of the pool's bytes.
    pub fn base_ptr(&self) -> *mut u8 {
        self.memory.as_ptr()
    }

    /// The backing mapping.
    pub fn memory(&self) -> &HostMemory {
        &self.memory
    }

    /// The whole mapping as a [`MemoryRegion`], for io_uring / RDMA / CUDA registration.
    pub fn region(&self) -> MemoryRegion {
        region_of(&self.memory, &self.cuda_registered)
    }

    /// Records whether the region is page-locked with CUDA. Called by the owner of the
    /// registration (`hicache_gpu`), which registers before setting `true` and sets `false`
    /// before unregistering.
    pub fn set_cuda_registered(&self, registered: bool) {
        self.cuda_registered.store(registered, Ordering::Release);
    }

    /// `n` free pages, or `None` when fewer are free.
    pub fn alloc(&self, n: usize) -> Option<Vec<HostSlot>> {
        self.allocator.lock().alloc(n)
    }

    /// Frees pages; all-or-nothing, double frees are errors.
    pub fn free(&self, slots: &[HostSlot]) -> Result<()> {
        Ok(self.allocator.lock().free(slots)?)
    }

    /// Pages free now.
    pub fn available(&self) -> usize {
        self.allocator.lock().available()
    }

    /// Whether `slot` is allocated now.
    pub fn is_allocated(&self, slot: HostSlot) -> bool {
        self.allocator.lock().is_allocated(slot)
    }

    /// Checks that `slot` is a page of this pool.
    pub fn check_slot(&self, slot: HostSlot) -> Result<()> {
        if (slot.index() as usize) < self.num_pages() {
            Ok(())
        } else {
            Err(HostError::PageOutOfRange {
                page: slot.index(),
                capacity: self.num_pages(),
            })
        }
    }

    /// The iovecs of one page, in flat order (`halves·layers` for `layer_first`, `halves`
    /// otherwise; their concatenation is the flat page).
    pub fn page_iovecs(&self, slot: HostSlot) -> Result<Vec<IoVec>> {
        let mut v = Vec::with_capacity(self.layout.parts_per_page());
        self.extend_iovecs(&[slot], &mut v)?;
        Ok(v)
    }

    /// Appends the iovecs of every page of `slots`, page after page, to `out`.
    /// Checks every slot first; on error `out` is unchanged.
    pub fn extend_iovecs(&self, slots: &[HostSlot], out: &mut Vec<IoVec>) -> Result<()> {
        for &s in slots {
            self.check_slot(s)?;
        }
        let base = self.memory.as_ptr() as usize;
        out.reserve(slots.len() * self.layout.parts_per_page());
        for &s in slots {
            out.extend(self.layout.parts(s.index() as usize).map(|p| IoVec {
                addr: base + p.offset,
                len: p.len,
            }));
        }
        Ok(())
    }

    /// Copies page `slot` in flat order into `dst` (exactly one page long).
    pub fn get_page(&self, slot: HostSlot, dst: &mut [u8]) -> Result<()> {
        check_buffer("get_page", dst.len(), self.page_bytes())?;
        let iovs = self.page_iovecs(slot)?;
        // SAFETY: the iovecs lie inside the mapping (checked slot, layout invariant); dst is a
        // distinct Rust buffer of the page's length; the page has one user (rule 1).
        unsafe { gather(&iovs, dst) };
        Ok(())
    }

    /// Writes page `slot` from `src` in flat order (exactly one page long).
    pub fn set_page(&self, slot: HostSlot, src: &[u8]) -> Result<()> {
        check_buffer("set_page", src.len(), self.page_bytes())?;
        let iovs = self.page_iovecs(slot)?;
        // SAFETY: as in get_page, with the copy reversed.
        unsafe { scatter(&iovs, src) };
        Ok(())
    }

    /// Borrowed slices of the parts of page `slot`, in flat order (exclusive borrow: safe).
    pub fn page_parts(&mut self, slot: HostSlot) -> Result<Vec<&[u8]>> {
        // SAFETY: &mut self excludes every other user of the pool for the borrow's lifetime.
        unsafe { self.page_parts_shared(slot) }
    }

    /// Borrowed slices of the parts of page `slot` from a shared pool.
    ///
    /// # Safety
    /// While the slices live, nothing may write page `slot` (no transfer into it, no
    /// `set_page`, no L3 read into it): rule 1 of the module docs.
    pub unsafe fn page_parts_shared(&self, slot: HostSlot) -> Result<Vec<&[u8]>> {
        let iovs = self.page_iovecs(slot)?;
        Ok(iovs
            .into_iter()
            // SAFETY: inside the mapping, which outlives &self; no writer per the contract.
            .map(|iov| unsafe { std::slice::from_raw_parts(iov.as_ptr(), iov.len) })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_core::{DType, KvKind};

    fn shape() -> KvShape {
        KvShape {
            kind: KvKind::Mha {
                heads: 2,
                head_dim: 8,
            },
            layers: 4,
            dtype: DType::Bf16,
            page_size: 16,
        }
    }

    #[test]
    fn sizes_follow_sglang() {
        let s = shape();
        assert_eq!(PoolSize::Pages(7).pages(&s).unwrap(), 7);
        // token bytes = 2·8·2·4·2 = 256; 1 MiB → 4096 tokens → 256 pages, +1.
        assert_eq!(PoolSize::Bytes(1 << 20).pages(&s).unwrap(), 257);
        let r = PoolSize::Ratio {
            ratio: 2.0,
            device_pages: 100,
        };
        assert_eq!(r.pages(&s).unwrap(), 201);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let r = PoolSize::Ratio {
                ratio: bad,
                device_pages: 100,
            };
            assert!(matches!(r.pages(&s), Err(HostError::BadSize(_))), "{bad}");
        }
        assert!(PoolSize::Bytes(0).pages(&s).is_err());
        assert!(PoolSize::Pages(0).pages(&s).is_err());
    }

    #[test]
    fn ram_check_names_the_numbers() {
        let cfg = HostPoolConfig::new(shape(), LayoutKind::PageFirst, PoolSize::Pages(4))
            .reserve_bytes(u64::MAX / 2);
        let e = HostPool::new(cfg).unwrap_err();
        assert!(matches!(e, HostError::InsufficientMemory { .. }), "{e}");
        assert!(e.to_string().contains("must stay free"));
    }

    #[test]
    fn set_then_get_round_trips_and_iovecs_are_in_bounds() {
        for lk in LayoutKind::ALL {
            let cfg = HostPoolConfig::new(shape(), lk, PoolSize::Pages(5)).reserve_bytes(0);
            let mut pool = HostPool::new(cfg).unwrap();
            let pb = pool.page_bytes();
            let data: Vec<u8> = (0..pb).map(|i| (i * 7 + 3) as u8).collect();
            pool.set_page(HostSlot(3), &data).unwrap();
            let mut back = vec![0; pb];
            pool.get_page(HostSlot(3), &mut back).unwrap();
            assert_eq!(back, data);
            pool.get_page(HostSlot(2), &mut back).unwrap();
            assert!(
                back.iter().all(|&b| b == 0),
                "{lk:?}: neighbour page touched"
            );
            let parts: Vec<u8> = pool.page_parts(HostSlot(3)).unwrap().concat();
            assert_eq!(parts, data);
            let region = pool.region();
            for iov in pool.page_iovecs(HostSlot(4)).unwrap() {
                assert!(region.contains(iov.addr, iov.len));
            }
            assert!(pool.get_page(HostSlot(5), &mut back).is_err());
            assert!(matches!(
                pool.set_page(HostSlot(0), &data[1..]),
                Err(HostError::BufferSize { .. })
            ));
        }
    }

    #[test]
    fn pool_allocates_and_detects_double_free() {
        let cfg = HostPoolConfig::new(shape(), LayoutKind::LayerFirst, PoolSize::Pages(3))
            .reserve_bytes(0);
        let pool = HostPool::new(cfg).unwrap();
        let a = pool.alloc(2).unwrap();
        assert!(pool.alloc(2).is_none());
        pool.free(&a).unwrap();
        assert!(matches!(pool.free(&a), Err(HostError::Alloc(_))));
        assert_eq!(pool.available(), 3);
    }
}
