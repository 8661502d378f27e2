//! [`HostMemory`]: one anonymous, populated mapping that stays at the same address for its
//! whole life, backed by 2 MiB huge pages when the machine has them.
//!
//! How the mapping is made ([`HugePagePolicy`]):
//! 1. `Auto` / `Require`: first `mmap(MAP_HUGETLB | MAP_HUGE_2MB | MAP_POPULATE)`; it fails at
//!    once (ENOMEM) when the hugetlb pool is empty.
//! 2. Then transparent huge pages, when `/sys/kernel/mm/transparent_hugepage/enabled` is
//!    `always` or `madvise`: map 2 MiB-aligned, `madvise(MADV_HUGEPAGE)`, then populate with
//!    `MADV_POPULATE_WRITE` (falling back to touching every 4 KiB page on kernels without it).
//!    Whether the kernel really used huge pages is read back from `/proc/self/smaps`.
//! 3. Otherwise (and always for `Off`): `mmap(MAP_POPULATE)` with 4 KiB pages. `Require`
//!    errors instead.
//!
//! [`Populate::OnTouch`] instead maps without populating (4 KiB pages, `MAP_NORESERVE`): a
//! page gets its memory, zeroed, when it is first touched. For pools whose bytes nothing
//! reads or writes (a payload-free simulation: pages counted, never copied); such a mapping is
//! never kept for reuse nor served from kept ones.
//!
//! Invariant: `ptr..ptr+len` is mapped read-write from `new` until `Drop`, and nothing else in
//! the process maps or unmaps it (a drop hands it whole to a `Mapping`, kept for reuse or
//! unmapped). CUDA registration (`cuMemHostRegister`, done by `hicache-gpu`) must be undone
//! before the drop: the registration owns an `Arc` of the pool,
//! so the pool (and this mapping) outlive it by construction.

use std::ptr::NonNull;

use crate::error::{HostError, Result};
use crate::reuse::{Shelf, ShelfKey};

const HUGE: usize = 2 << 20;
const SMALL: usize = 4096;

/// Whether to use 2 MiB huge pages.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum HugePagePolicy {
    /// Use huge pages when available, fall back to 4 KiB pages silently (default).
    #[default]
    Auto,
    /// 4 KiB pages only.
    Off,
    /// Huge pages or an error.
    Require,
}

/// When a [`HostMemory`]'s pages get their memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum Populate {
    /// All of them before [`HostMemory::new`] returns (default): no first-touch fault ever
    /// lands in a timed copy.
    #[default]
    Now,
    /// Each 4 KiB page when first touched (`MAP_NORESERVE`, no huge pages): memory nothing
    /// touches costs nothing. The huge page policy must not be `Require`.
    OnTouch,
}

/// What backs a [`HostMemory`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// 4 KiB pages.
    Small,
    /// Pages from the hugetlb pool.
    Hugetlb,
    /// Transparent huge pages were requested with `madvise`; `huge_bytes` of the mapping are
    /// backed by huge pages according to `/proc/self/smaps` (0 when it could not be read).
    Transparent {
        /// Bytes backed by huge pages right after population.
        huge_bytes: usize,
    },
    /// Not populated: 4 KiB pages given on first touch ([`Populate::OnTouch`]).
    OnTouch,
}

/// An anonymous, populated, read-write mapping (see the module docs).
#[derive(Debug)]
pub struct HostMemory {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    /// What `new` was asked for: where the mapping may be reused when this one is dropped
    /// (`None`: never kept, an on-touch mapping).
    key: Option<ShelfKey>,
}

// SAFETY: HostMemory is a plain owner of a mapping; the mapping has no thread affinity, and all
// access to its bytes goes through raw pointers whose users follow the pool's ownership rules.
unsafe impl Send for HostMemory {}
// SAFETY: as above; `&HostMemory` exposes only the address, length and backing.
unsafe impl Sync for HostMemory {}

/// A mapping no [`HostMemory`] owns (on the shelf, or between a drop and its unmapping):
/// unmapped when dropped.
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: as for HostMemory: the owner of a mapping with no thread affinity.
unsafe impl Send for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len is exactly one mapping made by `HostMemory::new` (invariant of
        // HostMemory, handed over whole by its drop); this is its only unmapping.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if rc != 0 {
            tracing::error!(
                len = self.len,
                error = %std::io::Error::last_os_error(),
                "munmap of the host pool failed"
            );
        }
    }
}

/// Dropped mappings kept for reuse (off until [`reuse_dropped_mappings`]).
static SHELF: Shelf<Mapping> = Shelf::new();

/// Keeps up to `budget_bytes` of dropped [`HostMemory`] mappings mapped and populated in this
/// process, each handed to the next [`HostMemory::new`] of the same policy that it fits: the
/// smallest kept mapping at least as long as the request ([`HostMemory::len`] is then the kept
/// mapping's). To keep a newly dropped mapping within the budget, those dropped longest ago
/// are unmapped. For programs that build and drop pools one after another (a bench's runs):
/// populating a fresh multi-GiB mapping costs the kernel's zeroing (and, under memory
/// pressure, reclaim and compaction), a kept one nothing. A reused mapping is
/// **not** zero-filled: it holds what its previous owner in this process wrote, as memory from
/// `cudaMalloc` or a pinned `torch.empty` does. 0 (the default) turns it off and unmaps what is
/// kept. Libraries never call this; [`mem_available`] counts the kept bytes as available.
pub fn reuse_dropped_mappings(budget_bytes: usize) {
    drop(SHELF.set_budget(budget_bytes));
}

/// The shelf key of a request: its page policy (a kept mapping fits a request of the same
/// policy for at most its length).
fn shelf_key(policy: HugePagePolicy) -> ShelfKey {
    match policy {
        HugePagePolicy::Auto => 0,
        HugePagePolicy::Off => 1,
        HugePagePolicy::Require => 2,
    }
}

impl HostMemory {
    /// Maps `len` bytes (rounded up to the page size used), zero-filled and populated (or, with
    /// [`reuse_dropped_mappings`] on, a kept mapping of the same request, not zero-filled).
    pub fn new(len: usize, policy: HugePagePolicy) -> Result<Self> {
        Self::with_population(len, policy, Populate::Now)
    }

    /// Maps `len` bytes as [`new`](Self::new) with [`Populate::Now`]; with
    /// [`Populate::OnTouch`], an unpopulated mapping of 4 KiB pages (rounded up to them),
    /// zero-filled as it is touched, never taken from or given to the kept mappings of
    /// [`reuse_dropped_mappings`]. `OnTouch` with [`HugePagePolicy::Require`] is an error.
    pub fn with_population(len: usize, policy: HugePagePolicy, populate: Populate) -> Result<Self> {
        if len == 0 {
            return Err(HostError::BadSize("cannot map 0 bytes".into()));
        }
        let (key, mapping) = match populate {
            Populate::Now => {
                let key = shelf_key(policy);
                let mapping = match SHELF.take(key, len) {
                    Some(kept) => kept,
                    None => Self::map(len, policy)?,
                };
                (Some(key), mapping)
            }
            Populate::OnTouch if policy == HugePagePolicy::Require => {
                return Err(HostError::HugePagesUnavailable(
                    "a mapping populated on touch uses 4 KiB pages".into(),
                ));
            }
            Populate::OnTouch => (None, Self::map_on_touch(len)?),
        };
        // Ownership of the mapping passes to this HostMemory, whose drop hands it back whole.
        let mapping = std::mem::ManuallyDrop::new(mapping);
        Ok(Self {
            ptr: mapping.ptr,
            len: mapping.len,
            backing: mapping.backing,
            key,
        })
    }

    /// A fresh mapping for `new`.
    fn map(len: usize, policy: HugePagePolicy) -> Result<Mapping> {
        if policy != HugePagePolicy::Off {
            let huge_len = len.checked_next_multiple_of(HUGE).ok_or_else(|| {
                HostError::BadSize(format!("{len} bytes overflow when rounded to 2 MiB"))
            })?;
            if let Some(ptr) = map_hugetlb(huge_len) {
                return Ok(Mapping {
                    ptr,
                    len: huge_len,
                    backing: Backing::Hugetlb,
                });
            }
            if thp_enabled() {
                let ptr = map_thp(huge_len)?;
                let huge_bytes = smaps_huge_bytes(ptr.as_ptr() as usize).unwrap_or(0);
                return Ok(Mapping {
                    ptr,
                    len: huge_len,
                    backing: Backing::Transparent { huge_bytes },
                });
            }
            if policy == HugePagePolicy::Require {
                return Err(HostError::HugePagesUnavailable(
                    "no hugetlb pages and transparent huge pages are disabled".into(),
                ));
            }
        }
        let len = len.checked_next_multiple_of(SMALL).ok_or_else(|| {
            HostError::BadSize(format!("{len} bytes overflow when rounded to 4 KiB"))
        })?;
        let ptr = mmap(len, libc::MAP_POPULATE).map_err(|source| HostError::Map {
            call: "mmap",
            len,
            source,
        })?;
        Ok(Mapping {
            ptr,
            len,
            backing: Backing::Small,
        })
    }

    /// An unpopulated mapping of `len` bytes (rounded up to 4 KiB) for [`Populate::OnTouch`].
    fn map_on_touch(len: usize) -> Result<Mapping> {
        let len = len.checked_next_multiple_of(SMALL).ok_or_else(|| {
            HostError::BadSize(format!("{len} bytes overflow when rounded to 4 KiB"))
        })?;
        let ptr = mmap(len, libc::MAP_NORESERVE).map_err(|source| HostError::Map {
            call: "mmap",
            len,
            source,
        })?;
        // SAFETY: advice on our own mapping; it changes performance, not semantics (a touch
        // then zeroes 4 KiB, not a 2 MiB huge page).
        let rc = unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_NOHUGEPAGE) };
        if rc != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "MADV_NOHUGEPAGE refused");
        }
        Ok(Mapping {
            ptr,
            len,
            backing: Backing::OnTouch,
        })
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes mapped (at least what was asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a mapping has at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// What backs the mapping.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// Whether the mapping is (at least 90%) backed by 2 MiB pages.
    pub fn huge_pages(&self) -> bool {
        match self.backing {
            Backing::Small | Backing::OnTouch => false,
            Backing::Hugetlb => true,
            Backing::Transparent { huge_bytes } => huge_bytes >= self.len / 10 * 9,
        }
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // The mapping passes whole to a `Mapping`, kept on the shelf or unmapped by its drop.
        let mapping = Mapping {
            ptr: self.ptr,
            len: self.len,
            backing: self.backing,
        };
        match self.key {
            Some(key) => drop(SHELF.offer(key, self.len, mapping)),
            None => drop(mapping),
        }
    }
}

fn mmap(len: usize, extra_flags: libc::c_int) -> std::io::Result<NonNull<u8>> {
    // SAFETY: an anonymous private mapping at an address the kernel picks; no existing memory
    // is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra_flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(NonNull::new(p.cast()).expect("mmap never returns null on success"))
}

fn map_hugetlb(len: usize) -> Option<NonNull<u8>> {
    // MAP_HUGE_2MB = 21 << MAP_HUGE_SHIFT.
    let flags = libc::MAP_HUGETLB | (21 << libc::MAP_HUGE_SHIFT) | libc::MAP_POPULATE;
    mmap(len, flags).ok()
}

fn thp_enabled() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| s.contains("[always]") || s.contains("[madvise]"))
        .unwrap_or(false)
}

/// Maps `len` (a multiple of 2 MiB) bytes at a 2 MiB-aligned address with MADV_HUGEPAGE,
/// populated.
fn map_thp(len: usize) -> Result<NonNull<u8>> {
    let over = len + HUGE;
    let raw = mmap(over, 0).map_err(|source| HostError::Map {
        call: "mmap",
        len: over,
        source,
    })?;
    let start = raw.as_ptr() as usize;
    let aligned = start.next_multiple_of(HUGE);
    let head = aligned - start;
    let tail = over - head - len;
    // SAFETY: both ranges lie inside the mapping just made and are no longer used; trimming
    // them leaves exactly [aligned, aligned + len) mapped.
    unsafe {
        if head > 0 {
            libc::munmap(raw.as_ptr().cast(), head);
        }
        if tail > 0 {
            libc::munmap((aligned + len) as *mut libc::c_void, tail);
        }
    }
    let ptr = aligned as *mut u8;
    // SAFETY: advice on our own mapping; it changes performance, not semantics.
    let rc = unsafe { libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE) };
    if rc != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "MADV_HUGEPAGE refused");
    }
    // SAFETY: populating our own private anonymous mapping.
    let rc = unsafe { libc::madvise(ptr.cast(), len, libc::MADV_POPULATE_WRITE) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINVAL) {
            // Kernel older than 5.14: fault every page in by hand.
            for off in (0..len).step_by(SMALL) {
                // SAFETY: off < len, inside the mapping; a volatile write of the value the
                // page already holds (zero) only faults it in.
                unsafe { std::ptr::write_volatile(ptr.add(off), 0) };
            }
        } else {
            // SAFETY: undo the mapping made above; nothing else refers to it.
            unsafe { libc::munmap(ptr.cast(), len) };
            return Err(HostError::Map {
                call: "madvise(MADV_POPULATE_WRITE)",
                len,
                source: err,
            });
        }
    }
    Ok(NonNull::new(ptr).expect("aligned address of a successful mapping is not null"))
}

/// `AnonHugePages` of the smaps entry that starts at `addr`, in bytes.
fn smaps_huge_bytes(addr: usize) -> Option<usize> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let prefix = format!("{addr:x}-");
    let mut in_entry = false;
    for line in smaps.lines() {
        let is_header = line
            .split_whitespace()
            .next()
            .is_some_and(|f| f.contains('-') && !f.ends_with(':'));
        if is_header {
            in_entry = line.starts_with(&prefix);
            continue;
        }
        if in_entry && let Some(rest) = line.strip_prefix("AnonHugePages:") {
            let kib: usize = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
            return Some(kib * 1024);
        }
    }
    None
}

/// `MemAvailable` from `/proc/meminfo`, in bytes, plus the bytes of dropped mappings this
/// process keeps for reuse ([`reuse_dropped_mappings`]).
pub fn mem_available() -> Option<u64> {
    meminfo_field("MemAvailable:").map(|a| a + SHELF.held_bytes() as u64)
}

/// `MemTotal` from `/proc/meminfo`, in bytes.
pub fn mem_total() -> Option<u64> {
    meminfo_field("MemTotal:")
}

fn meminfo_field(name: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line[name.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_pages_map_zeroed_and_writable() {
        let m = HostMemory::new(10_000, HugePagePolicy::Off).unwrap();
        assert_eq!(m.len(), 12_288);
        assert_eq!(m.backing(), Backing::Small);
        // SAFETY: inside the mapping, exclusively ours.
        let s = unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), m.len()) };
        assert!(s.iter().all(|&b| b == 0));
        s.fill(7);
    }

    #[test]
    fn auto_maps_2mib_multiples_and_falls_back_cleanly() {
        let m = HostMemory::new(3 << 20, HugePagePolicy::Auto).unwrap();
        assert!(m.len() >= 3 << 20);
        match m.backing() {
            Backing::Small => assert_eq!(m.len(), 3 << 20),
            _ => {
                assert_eq!(m.len(), 4 << 20);
                assert_eq!(m.as_ptr() as usize % HUGE, 0);
            }
        }
        // SAFETY: inside the mapping, exclusively ours.
        unsafe { std::ptr::write_volatile(m.as_ptr().add(m.len() - 1), 1) };
    }

    #[test]
    fn on_touch_maps_unpopulated_zeroed_pages_never_kept() {
        let m =
            HostMemory::with_population(10_000, HugePagePolicy::Auto, Populate::OnTouch).unwrap();
        assert_eq!(
            (m.len(), m.backing(), m.huge_pages()),
            (12_288, Backing::OnTouch, false)
        );
        // SAFETY: inside the mapping, exclusively ours.
        let s = unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), m.len()) };
        assert!(s.iter().all(|&b| b == 0));
        s.fill(7);
        assert!(m.key.is_none(), "never offered to the kept mappings");
        let e = HostMemory::with_population(4096, HugePagePolicy::Require, Populate::OnTouch)
            .unwrap_err();
        assert!(e.to_string().contains("4 KiB"), "{e}");
        assert!(HostMemory::with_population(0, HugePagePolicy::Off, Populate::OnTouch).is_err());
    }

    #[test]
    fn zero_length_is_an_error() {
        assert!(HostMemory::new(0, HugePagePolicy::Auto).is_err());
        assert!(mem_available().unwrap() > 0);
    }
}
