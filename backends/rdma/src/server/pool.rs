//! The server's memory: large anonymous mappings ([`Region`]s) and a best-fit allocator of
//! [`Extent`]s inside them.
//!
//! Invariants:
//! 1. Extents handed out by [`Allocator::alloc`] are disjoint, lie inside one region, start on
//!    a multiple of the granule and are a whole number of granules long.
//! 2. Free space is kept coalesced: no two free runs of a region touch, so a region whose
//!    extents are all freed is one run again.
//! 3. `free_bytes + allocated bytes == pool bytes` at all times.

use std::collections::{BTreeMap, BTreeSet};

use memmap2::{MmapMut, MmapOptions};

/// A run of bytes in one region.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Extent {
    /// Region number.
    pub region: u32,
    /// Offset of the first byte in the region.
    pub offset: u64,
    /// Length in bytes (a whole number of granules).
    pub len: u64,
}

impl Extent {
    /// The identity of a live extent (no two live extents share a start).
    pub fn start(&self) -> (u32, u64) {
        (self.region, self.offset)
    }
}

/// One anonymous mapping of the pool.
pub struct Region {
    id: u32,
    ptr: *mut u8,
    len: usize,
    _map: MmapMut,
}

// SAFETY: `ptr` points into `_map`, which this struct owns and never moves or unmaps while it
// lives. Access to the bytes is coordinated by the server's index (invariants of
// `server::index`): an extent is written only by the one connection that reserved it, and read
// only while pinned and immutable, so sharing the pointer between threads is sound.
unsafe impl Send for Region {}
// SAFETY: as for `Send`: the region is only a pointer plus the mapping that keeps it valid.
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}

impl Region {
    /// Maps `len` bytes of anonymous memory (lazily backed unless `populate`).
    pub fn map(id: u32, len: usize, populate: bool) -> std::io::Result<Self> {
        let mut opts = MmapOptions::new();
        opts.len(len);
        if populate {
            opts.populate();
        }
        let mut map = opts.map_anon()?;
        let ptr = map.as_mut_ptr();
        Ok(Self {
            id,
            ptr,
            len,
            _map: map,
        })
    }

    /// Region number.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start address (for RDMA registration and publication).
    pub fn addr(&self) -> *mut u8 {
        self.ptr
    }

    fn check(&self, off: u64, len: usize) {
        assert!(
            off.checked_add(len as u64)
                .is_some_and(|end| end <= self.len as u64),
            "extent {off}+{len} outside region {} of {} bytes",
            self.id,
            self.len
        );
    }

    /// The bytes `[off, off + len)`.
    ///
    /// # Safety
    /// No one may write these bytes while the returned slice lives (the extent is pinned by a
    /// lease, or held under the index lock).
    pub unsafe fn bytes(&self, off: u64, len: usize) -> &[u8] {
        self.check(off, len);
        // SAFETY: in bounds (checked above); no concurrent writer per the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off as usize), len) }
    }

    /// The bytes `[off, off + len)`, writable.
    ///
    /// # Safety
    /// No one else may read or write these bytes while the returned slice lives (the extent is
    /// reserved by the caller's connection and marked as being written, or held under the
    /// index lock with no pins).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, off: u64, len: usize) -> &mut [u8] {
        self.check(off, len);
        // SAFETY: in bounds (checked above); exclusive per the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off as usize), len) }
    }
}

/// Best-fit allocation of granule-aligned extents over a set of regions.
#[derive(Debug)]
pub struct Allocator {
    granule: u64,
    /// Per region: free runs by offset → length.
    by_offset: Vec<BTreeMap<u64, u64>>,
    /// Every free run as (length, region, offset), for best fit.
    by_size: BTreeSet<(u64, u32, u64)>,
    free_bytes: u64,
    total_bytes: u64,
}

impl Allocator {
    /// An allocator over regions of the given lengths (each a multiple of `granule`).
    pub fn new(granule: u64, region_lens: &[u64]) -> Self {
        let mut a = Self {
            granule: granule.max(1),
            by_offset: vec![BTreeMap::new(); region_lens.len()],
            by_size: BTreeSet::new(),
            free_bytes: 0,
            total_bytes: 0,
        };
        for (i, &len) in region_lens.iter().enumerate() {
            let len = len / a.granule * a.granule;
            if len > 0 {
                a.by_offset[i].insert(0, len);
                a.by_size.insert((len, i as u32, 0));
                a.free_bytes += len;
                a.total_bytes += len;
            }
        }
        a
    }

    /// `len` rounded up to whole granules.
    pub fn round(&self, len: u64) -> u64 {
        len.div_ceil(self.granule) * self.granule
    }

    /// Bytes not allocated.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Bytes of the pool.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// The largest free run.
    pub fn largest_free(&self) -> u64 {
        self.by_size.last().map_or(0, |r| r.0)
    }

    /// An extent of at least `len` bytes (rounded to granules), from the smallest free run
    /// that holds it, or `None`.
    pub fn alloc(&mut self, len: u64) -> Option<Extent> {
        let need = self.round(len.max(1));
        let &(run, region, offset) = self.by_size.range((need, 0, 0)..).next()?;
        self.by_size.remove(&(run, region, offset));
        let runs = &mut self.by_offset[region as usize];
        runs.remove(&offset);
        if run > need {
            runs.insert(offset + need, run - need);
            self.by_size.insert((run - need, region, offset + need));
        }
        self.free_bytes -= need;
        Some(Extent {
            region,
            offset,
            len: need,
        })
    }

    /// Returns an extent, merging it with free neighbours.
    pub fn free(&mut self, e: Extent) {
        let runs = &mut self.by_offset[e.region as usize];
        let (mut start, mut len) = (e.offset, e.len);
        if let Some((&prev, &plen)) = runs.range(..start).next_back()
            && prev + plen == start
        {
            runs.remove(&prev);
            self.by_size.remove(&(plen, e.region, prev));
            start = prev;
            len += plen;
        }
        if let Some(&nlen) = runs.get(&(e.offset + e.len)) {
            runs.remove(&(e.offset + e.len));
            self.by_size.remove(&(nlen, e.region, e.offset + e.len));
            len += nlen;
        }
        runs.insert(start, len);
        self.by_size.insert((len, e.region, start));
        self.free_bytes += e.len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_fit_and_coalescing() {
        let mut a = Allocator::new(4096, &[64 << 10, 32 << 10]);
        assert_eq!(a.total_bytes(), 96 << 10);
        // Best fit: a small request comes from the smallest run that holds it.
        let x = a.alloc(1).unwrap();
        assert_eq!((x.len, x.region), (4096, 1));
        let y = a.alloc(32 << 10).unwrap();
        assert_eq!(y.region, 0, "28 KiB left in region 1 is too small");
        assert!(a.alloc(64 << 10).is_none());
        a.free(x);
        assert_eq!(a.largest_free(), 32 << 10);
        a.free(y);
        assert_eq!(a.free_bytes(), 96 << 10);
        assert_eq!(a.largest_free(), 64 << 10, "runs coalesce");
    }

    #[test]
    fn mapped_regions_are_writable() {
        let r = Region::map(0, 1 << 20, false).unwrap();
        // SAFETY: the region is local to this test; no other reference exists.
        let b = unsafe { r.bytes_mut(4096, 10) };
        b.fill(7);
        // SAFETY: as above; the mutable borrow has ended.
        assert_eq!(unsafe { r.bytes(4096, 10) }, &[7u8; 10]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        /// Random alloc/free sequences keep extents disjoint and in bounds, and freeing
        /// everything restores one run per region.
        #[test]
        fn extents_stay_disjoint(ops in proptest::collection::vec((any::<bool>(), 1u64..40_000), 1..200)) {
            let regions = [128u64 << 10, 64 << 10];
            let mut a = Allocator::new(4096, &regions);
            let mut live: Vec<Extent> = Vec::new();
            for (alloc, len) in ops {
                if alloc || live.is_empty() {
                    if let Some(e) = a.alloc(len) {
                        prop_assert!(e.len >= len && e.len % 4096 == 0 && e.offset % 4096 == 0);
                        prop_assert!(e.offset + e.len <= regions[e.region as usize]);
                        for o in &live {
                            prop_assert!(o.region != e.region || o.offset + o.len <= e.offset || e.offset + e.len <= o.offset);
                        }
                        live.push(e);
                    }
                } else {
                    let e = live.swap_remove(len as usize % live.len());
                    a.free(e);
                }
                let used: u64 = live.iter().map(|e| e.len).sum();
                prop_assert_eq!(a.free_bytes() + used, a.total_bytes());
            }
            for e in live.drain(..) {
                a.free(e);
            }
            prop_assert_eq!(a.largest_free(), 128 << 10);
            prop_assert_eq!(a.by_size.len(), 2);
        }
    }
}
