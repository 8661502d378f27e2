//! The emulated driver's memory table: device allocations (host memory handed out as device
//! pointers, unified addressing), page-locked host ranges (registered or driver-allocated),
//! and recently freed device ranges (to report use after free).

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
}

/// All ranges the emulated device knows.
#[derive(Debug, Default)]
pub struct MemTable {
    live: BTreeMap<u64, Live>,
    freed: BTreeMap<u64, usize>,
}

/// A copy of the table's live ranges for lock-free checks during one operation.
#[derive(Clone, Debug)]
pub struct Snapshot {
    ranges: Vec<(u64, u64, RangeKind)>,
    freed: Vec<(u64, u64)>,
}

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
            },
        );
        Ok(())
    }

    /// Undoes [`MemTable::register`].
    pub fn unregister(&mut self, addr: u64) -> Result<(), String> {
        match self.live.get(&addr) {
            Some(l) if l.kind == RangeKind::PinnedHost && l.owned.is_none() => {
                self.live.remove(&addr);
                Ok(())
            }
            _ => Err(format!("{addr:#x} is not the start of a registered range")),
        }
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
                .map(|(&b, l)| (b, b + l.len as u64, l.kind))
                .collect(),
            freed: self
                .freed
                .iter()
                .map(|(&b, &l)| (b, b + l as u64))
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
            let (b, e, kind) = self.ranges[i - 1];
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
        Err(format!(
            "{len} bytes at {addr:#x} are outside every allocation"
        ))
    }

    /// Whether `addr..addr+len` is page-locked host memory (registered or driver-allocated).
    pub fn is_pinned(&self, addr: u64, len: u64) -> bool {
        matches!(self.check(addr, len, true), Ok(RangeKind::PinnedHost))
    }
}
