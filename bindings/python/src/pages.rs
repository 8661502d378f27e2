//! Views of caller memory (pointer + length per piece) as page buffers, without copying.
//!
//! SGLang's host pool describes a batch of pages as flat lists of pointers and sizes (its
//! `get_page_buffer_meta`), every page the same number of pieces in page order. This module
//! checks that shape and lends the backend slices over that memory for the duration of one call.
//!
//! Invariants:
//! 1. Every piece is non-null and non-empty, `ptr + size` does not overflow, nor does the sum
//!    of a page's sizes; pieces divide evenly among the keys.
//! 2. Destination pieces never overlap (checked before any `&mut [u8]` is made), so no two
//!    mutable slices alias.
//! 3. With `kv_interleaved` (MHA `layer_first`: K0, V0, K1, V1, …) the pieces are reordered to
//!    K0 … K(L-1), V0 … V(L-1), so a page's stored bytes are the same as SGLang's flat data
//!    page (`get_data_page`) in every layout, and pages written through the legacy tensor path
//!    read back through the zero-copy path and vice versa.
//! 4. When the store has registered regions (the host pool's buffers, see
//!    [`crate::regions`]), every piece lies wholly inside one of them: checked in
//!    [`Pieces::new`], before any slice is made, so no caller pointer reaches memory outside
//!    the pool.

use hicache_core::LayoutKind;
use hicache_storage::{PageBuf, PageBufMut};

use crate::error::{BindingError, Result};
use crate::regions::Regions;

/// A checked batch of page pieces: `ptrs[i]`/`sizes[i]`, `per_page` pieces per page.
#[derive(Debug)]
pub struct Pieces {
    ptrs: Vec<usize>,
    sizes: Vec<usize>,
    per_page: usize,
}

impl Pieces {
    /// Checks the shape of a batch of `keys` pages (invariant 1), that every piece lies inside
    /// `within` when given (invariant 4), and puts the pieces in stored order (invariant 3).
    pub fn new(
        op: &'static str,
        keys: usize,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        kv_interleaved: bool,
        within: Option<&Regions>,
    ) -> Result<Self> {
        if ptrs.len() != sizes.len()
            || (keys == 0) != ptrs.is_empty()
            || (keys > 0 && !ptrs.len().is_multiple_of(keys))
        {
            return Err(BindingError::PieceCount {
                op,
                keys,
                pieces: ptrs.len(),
                sizes: sizes.len(),
            });
        }
        for (index, (&ptr, &size)) in ptrs.iter().zip(&sizes).enumerate() {
            if ptr == 0 || size == 0 || ptr.checked_add(size).is_none() {
                return Err(BindingError::BadPiece {
                    op,
                    index,
                    ptr,
                    size,
                });
            }
        }
        if let Some(regions) = within
            && let Some(index) = (0..ptrs.len()).find(|&i| !regions.contains(ptrs[i], sizes[i]))
        {
            return Err(BindingError::OutsideRegions {
                op,
                index,
                ptr: ptrs[index],
                size: sizes[index],
                regions: regions.describe(),
            });
        }
        let per_page = ptrs.len().checked_div(keys).unwrap_or(0);
        for (page, chunk) in sizes.chunks(per_page.max(1)).enumerate() {
            if chunk
                .iter()
                .try_fold(0usize, |a, &b| a.checked_add(b))
                .is_none()
            {
                return Err(BindingError::PageOverflow { op, page });
            }
        }
        let mut p = Self {
            ptrs,
            sizes,
            per_page,
        };
        if kv_interleaved {
            if !per_page.is_multiple_of(2) {
                return Err(BindingError::OddInterleave {
                    op,
                    pieces: per_page,
                });
            }
            p.deinterleave();
        }
        Ok(p)
    }

    fn deinterleave(&mut self) {
        let n = self.per_page;
        for page in 0..self.ptrs.len() / n.max(1) {
            let range = page * n..(page + 1) * n;
            let reorder = |v: &[usize]| -> Vec<usize> {
                v.iter()
                    .step_by(2)
                    .chain(v.iter().skip(1).step_by(2))
                    .copied()
                    .collect()
            };
            let p = reorder(&self.ptrs[range.clone()]);
            let s = reorder(&self.sizes[range.clone()]);
            self.ptrs[range.clone()].copy_from_slice(&p);
            self.sizes[range].copy_from_slice(&s);
        }
    }

    /// Total bytes of page `i` (cannot overflow: checked in `new`).
    pub fn page_len(&self, i: usize) -> usize {
        self.sizes[i * self.per_page..(i + 1) * self.per_page]
            .iter()
            .sum()
    }

    /// Read-only views, one per page.
    ///
    /// # Safety
    /// Every piece must be memory the caller keeps alive and readable for `'a`, and that nobody
    /// writes while the views live.
    pub unsafe fn sources<'a>(&self, layout: LayoutKind) -> Vec<PageBuf<'a>> {
        self.page_chunks()
            .map(|(ptrs, sizes)| {
                PageBuf::from_parts(
                    layout,
                    ptrs.iter().zip(sizes).map(|(&p, &s)| {
                        // SAFETY: non-null and non-empty (checked in `new`); alive, readable and
                        // not written for 'a by this function's contract.
                        unsafe { std::slice::from_raw_parts(p as *const u8, s) }
                    }),
                )
            })
            .collect()
    }

    /// Writable views, one per page, after checking that no two pieces overlap (invariant 2).
    ///
    /// # Safety
    /// Every piece must be memory the caller keeps alive and writable for `'a`, and that nobody
    /// else reads or writes while the views live.
    pub unsafe fn destinations<'a>(
        &self,
        op: &'static str,
        layout: LayoutKind,
    ) -> Result<Vec<PageBufMut<'a>>> {
        let mut order: Vec<usize> = (0..self.ptrs.len()).collect();
        order.sort_unstable_by_key(|&i| self.ptrs[i]);
        for w in order.windows(2) {
            let (a, b) = (w[0], w[1]);
            if self.ptrs[a] + self.sizes[a] > self.ptrs[b] {
                return Err(BindingError::Overlap {
                    op,
                    ptr: self.ptrs[b],
                });
            }
        }
        Ok(self
            .page_chunks()
            .map(|(ptrs, sizes)| {
                PageBufMut::from_parts(
                    layout,
                    ptrs.iter().zip(sizes).map(|(&p, &s)| {
                        // SAFETY: non-null, non-empty and disjoint from every other piece
                        // (checked above), so this is the only reference to these bytes; alive
                        // and writable for 'a by this function's contract.
                        unsafe { std::slice::from_raw_parts_mut(p as *mut u8, s) }
                    }),
                )
            })
            .collect())
    }

    fn page_chunks(&self) -> impl Iterator<Item = (&[usize], &[usize])> {
        let n = self.per_page.max(1);
        self.ptrs.chunks(n).zip(self.sizes.chunks(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_checked() {
        assert!(Pieces::new("t", 2, vec![8, 16, 24], vec![1, 1, 1], false, None).is_err());
        assert!(Pieces::new("t", 1, vec![8], vec![1, 1], false, None).is_err());
        assert!(Pieces::new("t", 1, vec![0], vec![1], false, None).is_err());
        assert!(Pieces::new("t", 1, vec![8], vec![0], false, None).is_err());
        assert!(Pieces::new("t", 1, vec![8, 16, 24], vec![1, 1, 1], true, None).is_err());
        assert!(Pieces::new("t", 0, vec![], vec![], false, None).is_ok());
    }

    #[test]
    fn overflowing_pieces_and_pages_are_refused() {
        let e = Pieces::new("t", 1, vec![usize::MAX - 3], vec![8], false, None).unwrap_err();
        assert!(matches!(e, BindingError::BadPiece { index: 0, .. }), "{e}");
        let half = usize::MAX / 2 + 1;
        let e = Pieces::new(
            "t",
            2,
            vec![8, 16, 1, 2],
            vec![1, 1, half, half],
            false,
            None,
        )
        .unwrap_err();
        assert!(
            matches!(e, BindingError::PageOverflow { page: 1, .. }),
            "{e}"
        );
    }

    #[test]
    fn pieces_outside_the_registered_regions_are_refused() {
        let pool = Regions::new(&[(0x1000, 0x100), (0x4000, 0x100)]).unwrap();
        let r = Some(&pool);
        let ok = Pieces::new(
            "t",
            2,
            vec![0x1000, 0x1080, 0x4000, 0x40f0],
            vec![0x80, 0x80, 0x10, 0x10],
            false,
            r,
        );
        assert!(ok.is_ok());
        // Past the end of a region, straddling its end, before its start, between regions.
        for (ptr, size) in [(0x1100, 1), (0x10f0, 0x20), (0x0ff0, 0x20), (0x2000, 8)] {
            let e = Pieces::new("get", 2, vec![0x1000, ptr], vec![8, size], false, r).unwrap_err();
            assert!(
                matches!(e, BindingError::OutsideRegions { index: 1, .. }),
                "{e}"
            );
            assert!(e.to_string().contains("0x1000..0x1100"), "{e}");
        }
        // An end that overflows is outside whatever the regions are.
        let all = Regions::new(&[(1, usize::MAX - 1)]).unwrap();
        assert!(Pieces::new("t", 1, vec![usize::MAX - 1], vec![1], false, Some(&all)).is_ok());
        assert!(Pieces::new("t", 1, vec![usize::MAX - 1], vec![2], false, Some(&all)).is_err());
        // Without regions only the shape is checked (the bytes calls' own buffers).
        assert!(Pieces::new("t", 1, vec![0x2000], vec![8], false, None).is_ok());
    }

    #[test]
    fn interleaved_pieces_are_stored_k_then_v() {
        let p = Pieces::new("t", 2, vec![1, 2, 3, 4, 5, 6, 7, 8], vec![1; 8], true, None).unwrap();
        assert_eq!(p.ptrs, vec![1, 3, 2, 4, 5, 7, 6, 8]);
    }

    #[test]
    fn overlapping_destinations_are_refused_and_disjoint_ones_written() {
        let mut buf = vec![0u8; 16];
        let base = buf.as_mut_ptr() as usize;
        let p = Pieces::new("get", 2, vec![base, base + 4], vec![8, 8], false, None).unwrap();
        // SAFETY: `buf` outlives the views; the call fails before making any.
        let e = unsafe { p.destinations("get", LayoutKind::PageFirst) }.unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        let p = Pieces::new("get", 2, vec![base + 8, base], vec![8, 8], false, None).unwrap();
        // SAFETY: `buf` outlives the views and is not otherwise touched while they live.
        let mut d = unsafe { p.destinations("get", LayoutKind::PageFirst) }.unwrap();
        d[0].copy_from(&[1; 8]);
        d[1].copy_from(&[2; 8]);
        drop(d);
        assert_eq!(&buf[..8], &[2; 8]);
        assert_eq!(&buf[8..], &[1; 8]);
        assert_eq!(p.page_len(0), 8);
    }
}
