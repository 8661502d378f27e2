//! [`HostLayout`]: where every byte of every page lives in the host pool.
//!
//! All three layouts are affine: the row of token `t` of page `p`, layer `l`, half `h` starts at
//!
//! ```text
//! offset = h·half + p·page + l·layer + t·token        (strides in bytes, see `Strides`)
//! ```
//!
//! and is `row_bytes` contiguous bytes (`P` pages, `L` layers, `ps` tokens/page, `R` row bytes):
//!
//! | layout | order | half | page | layer | token |
//! |---|---|---|---|---|---|
//! | `layer_first` | `[h][l][p·ps+t][row]` | `L·P·ps·R` | `ps·R` | `P·ps·R` | `R` |
//! | `page_first` | `[h][p·ps+t][l][row]` | `P·ps·L·R` | `ps·L·R` | `R` | `L·R` |
//! | `page_first_direct` | `[h][p][l][t][row]` | `P·L·ps·R` | `L·ps·R` | `ps·R` | `R` |
//!
//! A page is cut into **parts**, the maximal contiguous runs of that page:
//! `layer_first` has `halves·L` parts of `ps·R` bytes (order: half, then layer),
//! `page_first` and `page_first_direct` have `halves` parts of `L·ps·R` bytes.
//!
//! Invariant 1: the concatenation of a page's parts, in order, is the page's **flat** byte order
//! (`[h][l][t][row]` for `layer_first` and `page_first_direct`, `[h][t][l][row]` for
//! `page_first`), which is what [`HostPool::get_page`](crate::HostPool::get_page) returns and
//! what generic L3 backends store. Flat order depends on the layout, as in SGLang.

use hicache_core::{KvShape, LayoutKind};

use crate::error::{HostError, Result};

/// Byte strides of a layout (see the module docs).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Strides {
    /// Between K and V (0 is never used for MLA, which has one half).
    pub half: usize,
    /// Between consecutive pages.
    pub page: usize,
    /// Between consecutive layers.
    pub layer: usize,
    /// Between consecutive tokens of a page.
    pub token: usize,
}

/// One contiguous run of a page: `len` bytes at `offset` from the start of the pool.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct PagePart {
    /// Byte offset from the start of the pool.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// The arrangement of a host pool: shape, layout and number of pages.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostLayout {
    shape: KvShape,
    kind: LayoutKind,
    num_pages: usize,
    strides: Strides,
    total_bytes: usize,
}

impl HostLayout {
    /// The layout of `num_pages` pages of `shape` arranged as `kind`.
    ///
    /// Errors on an invalid shape, zero pages, or a size that overflows `usize`.
    pub fn new(shape: KvShape, kind: LayoutKind, num_pages: usize) -> Result<Self> {
        shape.validate()?;
        if num_pages == 0 {
            return Err(HostError::BadSize(
                "a host pool needs at least one page".into(),
            ));
        }
        let overflow = || HostError::BadSize(format!("{num_pages} pages of {shape:?} overflow"));
        let total_bytes = shape
            .page_bytes()
            .checked_mul(num_pages)
            .ok_or_else(overflow)?;
        // Every offset is below total_bytes, so the products below cannot overflow.
        let r = shape.row_bytes();
        let ps = shape.page_size as usize;
        let l = shape.layers as usize;
        let p = num_pages;
        let strides = match kind {
            LayoutKind::LayerFirst => Strides {
                half: l * p * ps * r,
                page: ps * r,
                layer: p * ps * r,
                token: r,
            },
            LayoutKind::PageFirst => Strides {
                half: p * ps * l * r,
                page: ps * l * r,
                layer: r,
                token: l * r,
            },
            LayoutKind::PageFirstDirect => Strides {
                half: p * l * ps * r,
                page: l * ps * r,
                layer: ps * r,
                token: r,
            },
        };
        Ok(Self {
            shape,
            kind,
            num_pages,
            strides,
            total_bytes,
        })
    }

    /// The KV shape.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// The layout kind.
    pub fn kind(&self) -> LayoutKind {
        self.kind
    }

    /// Pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Bytes of the whole pool.
    pub fn total_bytes(&self) -> usize {
        self.total_bytes
    }

    /// Byte strides.
    pub fn strides(&self) -> Strides {
        self.strides
    }

    /// Bytes of one token row (one token, one layer, one half).
    pub fn row_bytes(&self) -> usize {
        self.shape.row_bytes()
    }

    /// Bytes of one page (all layers and halves).
    pub fn page_bytes(&self) -> usize {
        self.shape.page_bytes()
    }

    /// Byte offset of the row of `(half, page, layer, token)`. Every argument must be in
    /// range (checked in debug builds; use [`HostLayout::checked_offset`] for untrusted input).
    pub fn offset(&self, half: usize, page: usize, layer: usize, token: usize) -> usize {
        debug_assert!(half < self.shape.halves());
        debug_assert!(page < self.num_pages);
        debug_assert!(layer < self.shape.layers as usize);
        debug_assert!(token < self.shape.page_size as usize);
        let s = self.strides;
        half * s.half + page * s.page + layer * s.layer + token * s.token
    }

    /// [`HostLayout::offset`] with every argument checked; `None` when one is out of range.
    pub fn checked_offset(
        &self,
        half: usize,
        page: usize,
        layer: usize,
        token: usize,
    ) -> Option<usize> {
        (half < self.shape.halves()
            && page < self.num_pages
            && layer < self.shape.layers as usize
            && token < self.shape.page_size as usize)
            .then(|| self.offset(half, page, layer, token))
    }

    /// Contiguous parts per page (`halves·layers` for `layer_first`, `halves` otherwise).
    pub fn parts_per_page(&self) -> usize {
        match self.kind {
            LayoutKind::LayerFirst => self.shape.halves() * self.shape.layers as usize,
            LayoutKind::PageFirst | LayoutKind::PageFirstDirect => self.shape.halves(),
        }
    }

    /// Bytes of each part of a page (all parts of a layout have the same length).
    pub fn part_bytes(&self) -> usize {
        self.page_bytes() / self.parts_per_page()
    }

    /// Part `part` of page `page`. Both must be in range (checked in debug builds).
    pub fn part(&self, page: usize, part: usize) -> PagePart {
        debug_assert!(page < self.num_pages && part < self.parts_per_page());
        let offset = match self.kind {
            LayoutKind::LayerFirst => {
                let layers = self.shape.layers as usize;
                self.offset(part / layers, page, part % layers, 0)
            }
            LayoutKind::PageFirst | LayoutKind::PageFirstDirect => self.offset(part, page, 0, 0),
        };
        PagePart {
            offset,
            len: self.part_bytes(),
        }
    }

    /// Every part of page `page`, in flat order (invariant 1).
    pub fn parts(&self, page: usize) -> impl ExactSizeIterator<Item = PagePart> + '_ {
        (0..self.parts_per_page()).map(move |i| self.part(page, i))
    }

    /// Byte offset of the row `(half, layer, token)` inside a page's flat bytes (invariant 1).
    pub fn flat_offset(&self, half: usize, layer: usize, token: usize) -> usize {
        let r = self.row_bytes();
        let ps = self.shape.page_size as usize;
        let l = self.shape.layers as usize;
        let half_bytes = l * ps * r;
        half * half_bytes
            + match self.kind {
                LayoutKind::LayerFirst | LayoutKind::PageFirstDirect => (layer * ps + token) * r,
                LayoutKind::PageFirst => (token * l + layer) * r,
            }
    }

    /// Whether every part starts and ends on a multiple of `align` bytes from the pool start
    /// (what O_DIRECT backends need, e.g. `align = 4096`).
    pub fn parts_aligned(&self, align: usize) -> bool {
        align != 0
            && self.part_bytes().is_multiple_of(align)
            && self.strides.page.is_multiple_of(align)
            && (self.shape.halves() == 1 || self.strides.half.is_multiple_of(align))
            && (self.kind != LayoutKind::LayerFirst || self.strides.layer.is_multiple_of(align))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_core::{DType, KvKind};

    fn small(kind: KvKind) -> KvShape {
        KvShape {
            kind,
            layers: 3,
            dtype: DType::F16,
            page_size: 4,
        }
    }

    /// Every row of every page lands in a distinct, in-bounds place, and the rows of a page are
    /// exactly the bytes of its parts.
    #[test]
    fn rows_tile_the_pool_and_parts_cover_pages() {
        for kind in [
            KvKind::Mha {
                heads: 2,
                head_dim: 4,
            },
            KvKind::Mla { kv_dim: 6 },
        ] {
            for lk in LayoutKind::ALL {
                let shape = small(kind);
                let lay = HostLayout::new(shape, lk, 5).unwrap();
                let r = lay.row_bytes();
                let mut owner = vec![None; lay.total_bytes()];
                for p in 0..5 {
                    let parts: Vec<_> = lay.parts(p).collect();
                    assert_eq!(parts.len(), lay.parts_per_page());
                    for h in 0..shape.halves() {
                        for l in 0..3 {
                            for t in 0..4 {
                                let off = lay.offset(h, p, l, t);
                                let flat = lay.flat_offset(h, l, t);
                                // The flat offset maps into the parts at the same byte.
                                let part = &parts[flat / lay.part_bytes()];
                                assert_eq!(part.offset + flat % lay.part_bytes(), off, "{lk:?}");
                                for o in &mut owner[off..off + r] {
                                    assert!(o.is_none(), "{lk:?} overlaps");
                                    *o = Some((h, p, l, t));
                                }
                            }
                        }
                    }
                }
                assert!(owner.iter().all(Option::is_some), "{lk:?} leaves holes");
            }
        }
    }

    #[test]
    fn part_counts_match_sglang() {
        let s = KvShape::llama3_8b(64);
        assert_eq!(
            HostLayout::new(s, LayoutKind::LayerFirst, 2)
                .unwrap()
                .parts_per_page(),
            64
        );
        assert_eq!(
            HostLayout::new(s, LayoutKind::PageFirst, 2)
                .unwrap()
                .parts_per_page(),
            2
        );
        let m = KvShape::deepseek_v3_mla(64);
        assert_eq!(
            HostLayout::new(m, LayoutKind::LayerFirst, 2)
                .unwrap()
                .parts_per_page(),
            61
        );
        assert_eq!(
            HostLayout::new(m, LayoutKind::PageFirstDirect, 2)
                .unwrap()
                .parts_per_page(),
            1
        );
        assert!(
            HostLayout::new(s, LayoutKind::PageFirst, 2)
                .unwrap()
                .parts_aligned(4096)
        );
    }

    #[test]
    fn zero_pages_and_overflow_are_errors() {
        let s = KvShape::llama3_8b(64);
        assert!(HostLayout::new(s, LayoutKind::PageFirst, 0).is_err());
        assert!(HostLayout::new(s, LayoutKind::PageFirst, usize::MAX / 2).is_err());
        assert!(HostLayout::new(KvShape::llama3_8b(0), LayoutKind::PageFirst, 1).is_err());
    }
}
