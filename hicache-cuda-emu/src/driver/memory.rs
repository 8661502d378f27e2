//! The emulated driver's memory table: device allocations (host memory handed out as device
//! pointers, unified addressing), page-locked host ranges (registered or driver-allocated),
//! virtual-memory (VMM) reservations with the physical chunks mapped into them, and recently
//! freed device ranges (to report use after free).
//!
//! VMM, as the driver documents it and as PyTorch's expandable segments use it: a reservation
//! (`cuMemAddressReserve`) is address space only; each `cuMemMap` of a physical allocation
//! (`cuMemCreate`) makes one chunk of it device memory. `cuMemGetAddressRange` reports the one
//! chunk holding a pointer, yet copies and kernels may run across consecutive chunks of one
//! reservation (one contiguous virtual range) — never across two `cuMemAlloc` allocations.

use std::alloc::Layout;
use std::collections::BTreeMap;

/// Alignment of device allocations (`cuMemAlloc` guarantees 256).
pub const DEVICE_ALIGN: usize = 256;

/// What a live range is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RangeKind {
    /// `cuMemAlloc` / `cuMemAllocAsync`.
    Device,
    /// `cuMemHostRegister` or `cuMemHostAlloc`: page-locked host memory, device-mapped.
    PinnedHost,
}

#[derive(Debug)]
struct Live {
    len: usize,
    kind: RangeKind,
    owned: Option<Layout>,
    /// VMM mappings: the base of their reservation (0 otherwise). Accesses may run from one
    /// mapping into the next one of the same reservation.
    segment: u64,
    /// VMM mappings: the physical allocation mapped here.
    handle: u64,
}

/// Where one side of a copy lies (the driver infers it from the pointer, unified addressing).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Side {
    /// Device memory.
    Device,
    /// Page-locked host memory.
    PinnedHost,
    /// Host memory the driver does not know (pageable).
    Pageable,
}

/// All ranges the emulated device knows.
#[derive(Debug, Default)]
pub struct MemTable {
    live: BTreeMap<u64, Live>,
    freed: BTreeMap<u64, usize>,
    /// VMM reservations: base → (bytes, layout of the backing host memory).
    reserved: BTreeMap<u64, (usize, Layout)>,
    /// VMM physical allocations: handle → (bytes, references: creation + retains).
    physical: BTreeMap<u64, (usize, u32)>,
    next_handle: u64,
}

/// A copy of the table's live ranges for lock-free checks during one operation.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// `(start, end, kind, segment)`, sorted by start.
    ranges: Vec<(u64, u64, RangeKind, u64)>,
    freed: Vec<(u64, u64)>,
    /// VMM reservations `(start, end)`: address space that is not memory unless mapped.
    reserved: Vec<(u64, u64)>,
}

/// Granularity of VMM reservations and physical allocations (the H100's).
pub const VMM_GRANULARITY: usize = 2 << 20;

impl MemTable {
    /// Allocates `len` bytes of "device" memory (zeroed is not promised; we fill with 0xA5 so
    /// reading before writing shows).
    pub fn alloc_device(&mut self, len: usize) -> Option<u64> {
        let layout = Layout::from_size_align(len.max(1), DEVICE_ALIGN).ok()?;
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return None;
        }
        // SAFETY: just allocated, `layout.size()` bytes.
        unsafe { std::ptr::write_bytes(p, 0xA5, layout.size()) };
        let addr = p as u64;
        self.freed
            .retain(|&b, &mut l| addr + len as u64 <= b || b + l as u64 <= addr);
        self.live.insert(
            addr,
            Live {
                len,
                kind: RangeKind::Device,
                owned: Some(layout),
                segment: 0,
                handle: 0,
            },
        );
        Some(addr)
    }

    /// Allocates page-locked host memory (`cuMemHostAlloc`).
    pub fn alloc_pinned(&mut self, len: usize) -> Option<u64> {
        let layout = Layout::from_size_align(len.max(1), 4096).ok()?;
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return None;
        }
        self.live.insert(
            p as u64,
            Live {
                len,
                kind: RangeKind::PinnedHost,
                owned: Some(layout),
                segment: 0,
                handle: 0,
            },
        );
        Some(p as u64)
    }

    /// Frees an allocation made by this table; `Err` names why not.
    pub fn free(&mut self, addr: u64, kind: RangeKind) -> Result<(), String> {
        match self.live.get(&addr) {
            Some(l) if l.kind == kind && l.owned.is_some() => {}
            Some(_) => return Err(format!("{addr:#x} is not a {kind:?} allocation")),
            None if self.freed.contains_key(&addr) => {
                return Err(format!("double free of {addr:#x}"));
            }
            None => return Err(format!("{addr:#x} is not the start of an allocation")),
        }
        let l = self.live.remove(&addr).expect("checked above");
        let layout = l.owned.expect("checked above");
        // SAFETY: allocated by us with this layout, removed from the table so freed once.
        unsafe { std::alloc::dealloc(addr as *mut u8, layout) };
        if kind == RangeKind::Device {
            self.freed.insert(addr, l.len);
        }
        Ok(())
    }

    /// Registers `len` bytes at `addr` as page-locked (`cuMemHostRegister`).
    pub fn register(&mut self, addr: u64, len: usize) -> Result<(), String> {
        if len == 0 {
            return Err("registering 0 bytes".into());
        }
        if self.overlapping(addr, len as u64) {
            return Err(format!(
                "{len} bytes at {addr:#x} overlap an already registered or allocated range"
            ));
        }
        self.live.insert(
            addr,
            Live {
                len,
                kind: RangeKind::PinnedHost,
                owned: None,
                segment: 0,
                handle: 0,
            },
        );
        Ok(())
    }

    /// Undoes [`MemTable::register`].
    pub fn unregister(&mut self, addr: u64) -> Result<(), String> {
        match self.live.get(&addr) {
            Some(l) if l.kind == RangeKind::PinnedHost && l.owned.is_none() && l.segment == 0 => {
                self.live.remove(&addr);
                Ok(())
            }
            _ => Err(format!("{addr:#x} is not the start of a registered range")),
        }
    }

    /// Reserves `len` bytes of address space (`cuMemAddressReserve`); nothing is accessible
    /// until mapped.
    pub fn reserve(&mut self, len: usize, align: usize) -> Result<u64, String> {
        if len == 0 || !len.is_multiple_of(VMM_GRANULARITY) {
            return Err(format!(
                "{len} bytes is not a positive multiple of the granularity {VMM_GRANULARITY}"
            ));
        }
        let layout = Layout::from_size_align(len, align.max(VMM_GRANULARITY))
            .map_err(|e| format!("bad reservation layout: {e}"))?;
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return Err(format!("no host memory for a {len}-byte reservation"));
        }
        self.reserved.insert(p as u64, (len, layout));
        Ok(p as u64)
    }

    /// Frees a reservation (`cuMemAddressFree`); nothing may be mapped in it.
    pub fn unreserve(&mut self, addr: u64, len: usize) -> Result<(), String> {
        match self.reserved.get(&addr) {
            Some(&(l, _)) if l == len => {}
            _ => return Err(format!("{len} bytes at {addr:#x} are not a reservation")),
        }
        if self.live.values().any(|l| l.segment == addr) {
            return Err(format!("the reservation at {addr:#x} still has mappings"));
        }
        let (_, layout) = self.reserved.remove(&addr).expect("checked above");
        // SAFETY: allocated in `reserve` with this layout; removed from the table, so once.
        unsafe { std::alloc::dealloc(addr as *mut u8, layout) };
        Ok(())
    }

    /// A physical allocation of `len` bytes (`cuMemCreate`); returns its handle.
    pub fn create_physical(&mut self, len: usize) -> Result<u64, String> {
        if len == 0 || !len.is_multiple_of(VMM_GRANULARITY) {
            return Err(format!(
                "{len} bytes is not a positive multiple of the granularity {VMM_GRANULARITY}"
            ));
        }
        self.next_handle += 1;
        let h = 0x7000_0000 + self.next_handle;
        self.physical.insert(h, (len, 1));
        Ok(h)
    }

    /// Drops one reference of a physical allocation (`cuMemRelease`).
    pub fn release_physical(&mut self, handle: u64) -> Result<(), String> {
        let Some(entry) = self.physical.get_mut(&handle) else {
            return Err(format!("{handle:#x} is not a physical allocation handle"));
        };
        entry.1 -= 1;
        if entry.1 == 0 {
            self.physical.remove(&handle);
        }
        Ok(())
    }

    /// Maps physical allocation `handle` (all of it) at `addr` inside a reservation
    /// (`cuMemMap`). The emulator's physical memory is the reservation's own host memory, so
    /// contents do not follow a handle to another address.
    pub fn map(&mut self, addr: u64, len: usize, handle: u64) -> Result<(), String> {
        let Some(&(plen, _)) = self.physical.get(&handle) else {
            return Err(format!("{handle:#x} is not a physical allocation handle"));
        };
        if plen != len {
            return Err(format!(
                "mapping {len} bytes of a {plen}-byte physical allocation (the emulator maps whole allocations)"
            ));
        }
        let (&base, &(rlen, _)) = self
            .reserved
            .range(..=addr)
            .next_back()
            .ok_or_else(|| format!("{addr:#x} is not inside a reservation"))?;
        if addr + len as u64 > base + rlen as u64 {
            return Err(format!(
                "{len} bytes at {addr:#x} run past the reservation {base:#x}+{rlen}"
            ));
        }
        if self.overlapping(addr, len as u64) {
            return Err(format!("{len} bytes at {addr:#x} are already mapped"));
        }
        // SAFETY: inside the reservation's host memory (checked above).
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0xA5, len) };
        self.freed
            .retain(|&b, &mut l| addr + len as u64 <= b || b + l as u64 <= addr);
        self.physical.get_mut(&handle).expect("checked above").1 += 1;
        self.live.insert(
            addr,
            Live {
                len,
                kind: RangeKind::Device,
                owned: None,
                segment: base,
                handle,
            },
        );
        Ok(())
    }

    /// Unmaps every mapping inside `addr..addr+len` (`cuMemUnmap`).
    pub fn unmap(&mut self, addr: u64, len: usize) -> Result<(), String> {
        let end = addr + len as u64;
        let inside: Vec<u64> = self
            .live
            .range(addr..end)
            .filter(|(_, l)| l.segment != 0)
            .map(|(&b, _)| b)
            .collect();
        if inside.is_empty() {
            return Err(format!("nothing is mapped in {len} bytes at {addr:#x}"));
        }
        for b in inside {
            let l = self.live.remove(&b).expect("listed above");
            self.freed.insert(b, l.len);
            self.release_physical(l.handle)?;
        }
        Ok(())
    }

    /// The physical allocation mapped at `addr`, with a new reference
    /// (`cuMemRetainAllocationHandle`); `None` for memory that is not a VMM mapping.
    pub fn retain_handle(&mut self, addr: u64) -> Option<u64> {
        let (&b, l) = self.live.range(..=addr).next_back()?;
        if addr >= b + l.len as u64 || l.segment == 0 {
            return None;
        }
        let h = l.handle;
        self.physical.get_mut(&h)?.1 += 1;
        Some(h)
    }

    fn overlapping(&self, addr: u64, len: u64) -> bool {
        self.live
            .range(..addr + len)
            .next_back()
            .is_some_and(|(&b, l)| b + l.len as u64 > addr)
    }

    /// The live range containing `addr`: `(base, len, kind)`.
    pub fn containing(&self, addr: u64) -> Option<(u64, usize, RangeKind)> {
        let (&b, l) = self.live.range(..=addr).next_back()?;
        (addr < b + l.len.max(1) as u64).then_some((b, l.len, l.kind))
    }

    /// The table's ranges, for checks outside the lock.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            ranges: self
                .live
                .iter()
                .map(|(&b, l)| (b, b + l.len as u64, l.kind, l.segment))
                .collect(),
            freed: self
                .freed
                .iter()
                .map(|(&b, &l)| (b, b + l as u64))
                .collect(),
            reserved: self
                .reserved
                .iter()
                .map(|(&b, &(l, _))| (b, b + l as u64))
                .collect(),
        }
    }
}

impl Snapshot {
    /// Checks that `addr..addr+len` lies inside one live range the device may access (device
    /// memory, or device-mapped page-locked host memory when `host_ok`).
    pub fn check(&self, addr: u64, len: u64, host_ok: bool) -> Result<RangeKind, String> {
        let end = addr.checked_add(len).ok_or("address overflow")?;
        let i = self.ranges.partition_point(|r| r.0 <= addr);
        if i > 0 {
            let (b, mut e, kind, segment) = self.ranges[i - 1];
            // VMM: run on through consecutive mappings of the same reservation.
            let mut j = i;
            while end > e
                && segment != 0
                && self
                    .ranges
                    .get(j)
                    .is_some_and(|r| r.0 == e && r.3 == segment)
            {
                e = self.ranges[j].1;
                j += 1;
            }
            if addr >= b && end <= e.max(b + 1) {
                if kind == RangeKind::PinnedHost && !host_ok {
                    return Err(format!(
                        "{addr:#x} is host memory where device memory is required"
                    ));
                }
                return Ok(kind);
            }
            if addr < e {
                return Err(format!(
                    "{len} bytes at {addr:#x} run past the end of the allocation {b:#x}+{}",
                    e - b
                ));
            }
        }
        if self.freed.iter().any(|&(b, e)| addr >= b && addr < e) {
            return Err(format!("use after free: {addr:#x}"));
        }
        if self.reserved.iter().any(|&(b, e)| addr >= b && addr < e) {
            return Err(format!(
                "{addr:#x} is reserved address space with no memory mapped (cuMemMap)"
            ));
        }
        Err(format!(
            "{len} bytes at {addr:#x} are outside every allocation"
        ))
    }

    /// Where `addr..addr+len` lies for a copy whose pointer kinds the driver infers: inside a
    /// live range (which it must not overrun), or pageable host memory. Freed device memory
    /// is an error (use after free).
    pub fn classify(&self, addr: u64, len: u64) -> Result<Side, String> {
        let i = self.ranges.partition_point(|r| r.0 <= addr);
        let inside = i > 0 && addr < self.ranges[i - 1].1.max(self.ranges[i - 1].0 + 1);
        let known = |v: &[(u64, u64)]| v.iter().any(|&(b, e)| addr >= b && addr < e);
        if inside || known(&self.freed) || known(&self.reserved) {
            return self.check(addr, len, true).map(|k| match k {
                RangeKind::Device => Side::Device,
                RangeKind::PinnedHost => Side::PinnedHost,
            });
        }
        Ok(Side::Pageable)
    }

    /// Whether `addr..addr+len` is page-locked host memory (registered or driver-allocated).
    pub fn is_pinned(&self, addr: u64, len: u64) -> bool {
        matches!(self.check(addr, len, true), Ok(RangeKind::PinnedHost))
    }
}
