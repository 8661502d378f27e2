//! Host pools whose page pieces this crate computes itself, so that SGLang's batch calls cost
//! one native call each instead of a Python pass over every page.
//!
//! SGLang's host pools describe a page as pieces (`get_page_buffer_meta`), and for the pools
//! the Python class hands here (MHA, MLA, Mamba, DSA indexer: pools whose pieces are plain
//! arithmetic on the index, checked by the class on sampled pages before it registers them)
//! every piece of page `p` (the page starting at token slot `p × page_size`) is
//! `base + p × stride` bytes, `size` bytes long. A [`HostPool`] keeps that geometry, checks a
//! batch's host indices as SGLang's allocator hands them out, and makes the batch's pieces.
//!
//! Invariants:
//! 1. A registered pool holds at least one whole page (`1 <= page_size <= tokens`); every
//!    piece has a non-zero size, and every piece of every page of the pool has an address
//!    that does not overflow (checked at registration, [`HostPool::new`]).
//! 2. [`HostPool::page_starts`] accepts host indices only when they are whole pages of the
//!    pool: one run of `page_size` consecutive slots per page, starting at a multiple of
//!    `page_size`, inside `0 .. tokens`. Anything else is `None`: the caller then takes the
//!    Python path, which names the first bad index. No piece is made for a rejected batch.
//! 3. The pieces made here are still checked against the store's registered regions by
//!    [`crate::pages::Pieces::new`], like pieces that come from Python.

use hicache_core::{LayoutKind, NamespaceId};

use crate::error::{BindingError, Result};

/// One piece of every page: page `p`'s piece is `size` bytes at `base + p × stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceRule {
    /// Address of page 0's piece.
    pub base: usize,
    /// Bytes from one page's piece to the next page's.
    pub stride: usize,
    /// Bytes in the piece.
    pub size: usize,
}

/// A host pool registered with a store: its namespace, layout and page geometry.
#[derive(Debug)]
pub struct HostPool {
    /// SGLang's pool name (`kv`, `mamba`, ...).
    pub name: String,
    /// The namespace its pages are stored under.
    pub namespace: NamespaceId,
    /// The namespace as 32 hex digits (for `Call::new`).
    pub namespace_hex: String,
    /// The layout named to the backend with every call.
    pub layout: LayoutKind,
    /// Token slots per page.
    pub page_size: usize,
    /// Token slots in the pool.
    pub tokens: usize,
    /// The pieces of a page, in SGLang's order; empty for a pool whose pages do not move
    /// through pieces (only its presence is asked here).
    pub pieces: Vec<PieceRule>,
    /// MHA `layer_first`: the pieces are K0, V0, K1, V1, ... (see [`crate::pages`]).
    pub kv_interleaved: bool,
}

impl HostPool {
    /// Checks the geometry (invariant 1).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: String,
        namespace_hex: String,
        layout: LayoutKind,
        page_size: usize,
        tokens: usize,
        pieces: Vec<PieceRule>,
        kv_interleaved: bool,
    ) -> Result<Self> {
        let namespace = NamespaceId::from_hex(&namespace_hex)
            .map_err(|_| BindingError::BadNamespace(namespace_hex.chars().take(80).collect()))?;
        if page_size == 0 || tokens < page_size {
            return Err(BindingError::BadPoolGeometry {
                pool: name,
                why: format!("page size {page_size} and {tokens} token slots hold no whole page"),
            });
        }
        let last_page = tokens / page_size - 1;
        for (i, r) in pieces.iter().enumerate() {
            let end = r
                .stride
                .checked_mul(last_page)
                .and_then(|o| o.checked_add(r.base))
                .and_then(|a| a.checked_add(r.size));
            if r.size == 0 || r.base == 0 || end.is_none() {
                return Err(BindingError::BadPoolGeometry {
                    pool: name,
                    why: format!(
                        "piece {i} (base {:#x}, stride {}, {} bytes) is empty, null or runs \
                         past the address space within {} pages",
                        r.base,
                        r.stride,
                        r.size,
                        last_page + 1
                    ),
                });
            }
        }
        Ok(Self {
            name,
            namespace,
            namespace_hex,
            layout,
            page_size,
            tokens,
            pieces,
            kv_interleaved,
        })
    }

    /// The first slot of every page of `indices` when they are whole pages of this pool
    /// (invariant 2), else `None`.
    pub fn page_starts(&self, indices: &[i64]) -> Option<Vec<usize>> {
        let ps = self.page_size;
        if !indices.len().is_multiple_of(ps) {
            return None;
        }
        let last = (self.tokens - ps) as i64;
        let mut starts = Vec::with_capacity(indices.len() / ps);
        for page in indices.chunks_exact(ps) {
            let s = page[0];
            if s < 0 || s > last || s % ps as i64 != 0 {
                return None;
            }
            if page.iter().zip(s..).any(|(&i, want)| i != want) {
                return None;
            }
            starts.push(s as usize);
        }
        Some(starts)
    }

    /// The pieces of the pages starting at `starts` (slots from [`Self::page_starts`]), in
    /// SGLang's order: `(pointers, sizes)`. Cannot overflow (invariant 1).
    pub fn pieces_of(&self, starts: &[usize]) -> (Vec<usize>, Vec<usize>) {
        let n = starts.len() * self.pieces.len();
        let (mut ptrs, mut sizes) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for &s in starts {
            let page = s / self.page_size;
            for r in &self.pieces {
                ptrs.push(r.base + page * r.stride);
                sizes.push(r.size);
            }
        }
        (ptrs, sizes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NS: &str = "0123456789abcdef0123456789abcdef";

    fn pool(page_size: usize, tokens: usize) -> HostPool {
        let pieces = vec![
            PieceRule {
                base: 0x1000,
                stride: 0x100,
                size: 0x80,
            },
            PieceRule {
                base: 0x9000,
                stride: 0x40,
                size: 0x40,
            },
        ];
        HostPool::new(
            "kv".into(),
            NS.into(),
            LayoutKind::PageFirst,
            page_size,
            tokens,
            pieces,
            false,
        )
        .unwrap()
    }

    #[test]
    fn whole_pages_inside_the_pool_are_accepted() {
        let p = pool(4, 16);
        assert_eq!(p.page_starts(&[8, 9, 10, 11, 0, 1, 2, 3]), Some(vec![8, 0]));
        assert_eq!(p.page_starts(&[12, 13, 14, 15]), Some(vec![12]));
        assert_eq!(p.page_starts(&[]), Some(vec![]));
    }

    #[test]
    fn anything_but_whole_pages_is_left_to_the_python_path() {
        let p = pool(4, 16);
        for bad in [
            &[0, 1, 2][..],                  // not a whole page
            &[16, 17, 18, 19],               // past the pool
            &[-4, -3, -2, -1],               // negative
            &[2, 3, 4, 5],                   // not page-aligned
            &[0, 1, 3, 2],                   // not consecutive
            &[0, 1, 2, 3, 4, 5, 6, 8],       // second page broken
            &[i64::MAX, 0, 0, 0],            // huge
            &[i64::MIN, i64::MIN, 0, 0][..], // very negative
        ] {
            assert_eq!(p.page_starts(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn pieces_follow_the_page_number() {
        let p = pool(4, 16);
        let (ptrs, sizes) = p.pieces_of(&[8, 0]);
        assert_eq!(ptrs, vec![0x1200, 0x9080, 0x1000, 0x9000]);
        assert_eq!(sizes, vec![0x80, 0x40, 0x80, 0x40]);
    }

    #[test]
    fn bad_geometry_is_refused() {
        let ok = PieceRule {
            base: 0x1000,
            stride: 8,
            size: 8,
        };
        let mk = |ps, tokens, r: PieceRule| {
            HostPool::new(
                "m".into(),
                NS.into(),
                LayoutKind::PageFirst,
                ps,
                tokens,
                vec![r],
                false,
            )
        };
        assert!(mk(1, 8, ok).is_ok());
        assert!(mk(0, 8, ok).is_err());
        assert!(mk(4, 3, ok).is_err());
        assert!(mk(1, 8, PieceRule { size: 0, ..ok }).is_err());
        assert!(mk(1, 8, PieceRule { base: 0, ..ok }).is_err());
        let e = mk(
            1,
            8,
            PieceRule {
                stride: usize::MAX / 4,
                ..ok
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("pool m"), "{e}");
        assert!(
            HostPool::new(
                "m".into(),
                "zz".into(),
                LayoutKind::PageFirst,
                1,
                8,
                vec![ok],
                false
            )
            .is_err()
        );
    }
}
