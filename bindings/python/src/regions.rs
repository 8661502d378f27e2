//! The memory a store may read and write through caller pointers.
//!
//! The zero-copy calls (`Store.batch_get_into`, `Store.batch_set_from`) take raw addresses from
//! Python. Once the caller has registered the regions its pages live in (SGLang's host pool
//! buffers, `Store.set_allowed_regions`), every piece of those calls must lie wholly inside
//! one of them, so no caller mistake (an index past the pool's end, a stale pointer) can make
//! the backend read or write memory outside the pool.
//!
//! Invariants:
//! 1. Every region is non-null, non-empty and `start + len` does not overflow.
//! 2. Regions are kept sorted by start with overlapping or touching ones merged, so a piece is
//!    allowed exactly when one merged span holds all of it.

use crate::error::{BindingError, Result};

/// A set of allowed memory spans (`start..end`, end exclusive), sorted and merged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Regions {
    spans: Vec<(usize, usize)>,
}

impl Regions {
    /// Checks `(address, length)` pairs (invariant 1) and merges them (invariant 2).
    pub fn new(regions: &[(usize, usize)]) -> Result<Self> {
        if regions.is_empty() {
            return Err(BindingError::NoRegions);
        }
        let mut spans = Vec::with_capacity(regions.len());
        for (index, &(ptr, len)) in regions.iter().enumerate() {
            match ptr.checked_add(len) {
                Some(end) if ptr != 0 && len != 0 => spans.push((ptr, end)),
                _ => return Err(BindingError::BadRegion { index, ptr, len }),
            }
        }
        Ok(Self {
            spans: merged(spans),
        })
    }

    /// The spans of both sets, merged (invariant 2).
    pub fn union(&self, other: &Regions) -> Regions {
        Regions {
            spans: merged(self.spans.iter().chain(&other.spans).copied().collect()),
        }
    }

    /// Whether `ptr .. ptr + size` lies wholly inside one span. A range whose end overflows
    /// is never inside.
    pub fn contains(&self, ptr: usize, size: usize) -> bool {
        let Some(end) = ptr.checked_add(size) else {
            return false;
        };
        // The last span starting at or before `ptr` is the only one that can hold it.
        let after = self.spans.partition_point(|&(start, _)| start <= ptr);
        after > 0 && end <= self.spans[after - 1].1
    }

    /// The spans as `(address, length)` pairs, sorted and merged.
    pub fn spans(&self) -> Vec<(usize, usize)> {
        self.spans.iter().map(|&(s, e)| (s, e - s)).collect()
    }

    /// The spans for an error message (`0x1000..0x2000 (4096 bytes), ...`, at most four).
    pub fn describe(&self) -> String {
        let mut parts: Vec<String> = self
            .spans
            .iter()
            .take(4)
            .map(|&(s, e)| format!("{s:#x}..{e:#x} ({} bytes)", e - s))
            .collect();
        if self.spans.len() > 4 {
            parts.push(format!("and {} more", self.spans.len() - 4));
        }
        parts.join(", ")
    }
}

/// `(start, end)` spans sorted, with overlapping and touching ones joined (invariant 2).
fn merged(mut spans: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    spans.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
    for (start, end) in spans {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_regions_are_refused() {
        assert!(Regions::new(&[]).is_err());
        assert!(Regions::new(&[(0, 16)]).is_err());
        assert!(Regions::new(&[(16, 0)]).is_err());
        let e = Regions::new(&[(16, 16), (usize::MAX - 4, 8)]).unwrap_err();
        assert!(e.to_string().contains("region 1"), "{e}");
    }

    #[test]
    fn pieces_inside_one_span_are_allowed() {
        let r = Regions::new(&[(0x3000, 0x100), (0x1000, 0x100), (0x1100, 0x100)]).unwrap();
        // Touching regions merge; the list is sorted.
        assert_eq!(r.spans(), vec![(0x1000, 0x200), (0x3000, 0x100)]);
        assert!(r.contains(0x1000, 0x200));
        assert!(r.contains(0x10ff, 2));
        assert!(r.contains(0x3080, 0x80));
        assert!(!r.contains(0x0fff, 2));
        assert!(!r.contains(0x11ff, 2));
        assert!(!r.contains(0x1200, 1));
        assert!(!r.contains(0x3080, 0x81));
        assert!(!r.contains(0x2000, 1));
        assert!(!r.contains(0x10, 1));
        assert!(!r.contains(usize::MAX, 2));
        assert!(r.describe().contains("0x1000..0x1200 (512 bytes)"));
    }

    #[test]
    fn a_union_holds_both_sets_merged() {
        let a = Regions::new(&[(0x1000, 0x100)]).unwrap();
        let b = Regions::new(&[(0x1100, 0x100), (0x4000, 0x10)]).unwrap();
        let u = a.union(&b);
        assert_eq!(u.spans(), vec![(0x1000, 0x200), (0x4000, 0x10)]);
        assert!(u.contains(0x10f0, 0x20));
        assert!(u.contains(0x4000, 0x10));
        assert!(!u.contains(0x4000, 0x11));
        assert!(!a.contains(0x4000, 1));
    }
}
