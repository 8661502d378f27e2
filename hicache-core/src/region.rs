//! [`MemoryRegion`]: a descriptor of a long-lived memory range (the pinned host pool) that
//! I/O layers register once: io_uring as fixed buffers, RDMA as a memory region, CUDA as
//! page-locked host memory.

use serde::{Deserialize, Serialize};

/// A contiguous range of this process's address space that stays mapped, at the same address,
/// for as long as its owner (normally `hicache-host`'s pool) lives.
///
/// It is only a description: creating one is safe; whoever dereferences `addr` must hold the
/// owner alive and respect the owner's rules about which pages it may touch.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemoryRegion {
    /// Start address.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Whether the range is page-locked with the GPU driver (`cuMemHostRegister`).
    pub cuda_registered: bool,
    /// Whether the range is backed by 2 MiB huge pages.
    pub huge_pages: bool,
}

impl MemoryRegion {
    /// Whether `[addr, addr + len)` lies inside this region.
    pub fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contains_checks_both_ends() {
        let r = MemoryRegion {
            addr: 4096,
            len: 8192,
            cuda_registered: false,
            huge_pages: false,
        };
        assert!(r.contains(4096, 8192));
        assert!(r.contains(8192, 10));
        assert!(!r.contains(4095, 1));
        assert!(!r.contains(12000, 1000));
        assert!(!r.contains(usize::MAX, 2));
    }
}
