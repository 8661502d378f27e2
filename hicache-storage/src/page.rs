//! Caller-owned page buffers and per-page outcomes.
//!
//! A page travels between L2 and L3 without being copied into an intermediate buffer: the
//! caller lends the backend views of its own memory (normally pages of the pinned host pool).
//! One page may be scattered over several *parts* (iovecs): one part for `page_first` layouts,
//! `2·layers` parts (K and V of every layer) for an MHA `layer_first` page. The page's bytes are
//! the concatenation of its parts in order; how they are cut into parts is the caller's business
//! and is not stored (a page written from 64 parts may be read into one, and back).
//!
//! Invariants every backend keeps (checked by the `conformance` suite, feature `testing`):
//!
//! 1. The page's [`PageMeta`] (layout tag and total byte length, plus the namespace carried by
//!    the key) is stored with the page and compared on read. A read whose buffer has another
//!    layout or length is a [`PageOutcome::Miss`], counted in
//!    [`StorageStats::meta_mismatches`](crate::StorageStats::meta_mismatches); the buffer is not
//!    written.
//! 2. A [`PageOutcome::Hit`] means every byte of the destination holds the page exactly as it
//!    was written. After any other outcome the destination's contents are unspecified and must
//!    not be used.

use std::fmt;

use hicache_core::LayoutKind;
use smallvec::SmallVec;

/// What a backend stores next to a page's bytes and checks on read.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct PageMeta {
    /// The host layout the bytes are arranged in.
    pub layout: LayoutKind,
    /// Total length in bytes (sum of the parts).
    pub len: usize,
}

/// A read-only view of one page in caller memory, for [`Storage::batch_set`](crate::Storage::batch_set).
#[derive(Clone, Debug)]
pub struct PageBuf<'a> {
    parts: SmallVec<[&'a [u8]; 2]>,
    layout: LayoutKind,
    len: usize,
}

impl<'a> PageBuf<'a> {
    /// A page held in one contiguous run (`page_first`, `page_first_direct`, MLA).
    pub fn contiguous(layout: LayoutKind, data: &'a [u8]) -> Self {
        Self {
            len: data.len(),
            parts: smallvec::smallvec![data],
            layout,
        }
    }

    /// A page scattered over several runs, concatenated in order.
    pub fn from_parts(layout: LayoutKind, parts: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let parts: SmallVec<[&'a [u8]; 2]> = parts.into_iter().collect();
        Self {
            len: parts.iter().map(|p| p.len()).sum(),
            parts,
            layout,
        }
    }

    /// The runs, in page order.
    pub fn parts(&self) -> &[&'a [u8]] {
        &self.parts
    }

    /// The layout tag.
    pub fn layout(&self) -> LayoutKind {
        self.layout
    }

    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the page has no bytes (never valid to store).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Layout and length, as stored with the page.
    pub fn meta(&self) -> PageMeta {
        PageMeta {
            layout: self.layout,
            len: self.len,
        }
    }

    /// Copies the page into one contiguous vector (for backends that keep owned copies).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len);
        for p in &self.parts {
            v.extend_from_slice(p);
        }
        v
    }
}

/// A writable view of one page in caller memory, for [`Storage::batch_get`](crate::Storage::batch_get).
#[derive(Debug)]
pub struct PageBufMut<'a> {
    parts: SmallVec<[&'a mut [u8]; 2]>,
    layout: LayoutKind,
    len: usize,
}

impl<'a> PageBufMut<'a> {
    /// A destination page in one contiguous run.
    pub fn contiguous(layout: LayoutKind, data: &'a mut [u8]) -> Self {
        Self {
            len: data.len(),
            parts: smallvec::smallvec![data],
            layout,
        }
    }

    /// A destination page scattered over several runs, filled in order.
    pub fn from_parts(layout: LayoutKind, parts: impl IntoIterator<Item = &'a mut [u8]>) -> Self {
        let parts: SmallVec<[&'a mut [u8]; 2]> = parts.into_iter().collect();
        Self {
            len: parts.iter().map(|p| p.len()).sum(),
            parts,
            layout,
        }
    }

    /// The runs, in page order.
    pub fn parts(&self) -> &[&'a mut [u8]] {
        &self.parts
    }

    /// The runs, writable, in page order.
    pub fn parts_mut(&mut self) -> &mut [&'a mut [u8]] {
        &mut self.parts
    }

    /// The layout tag the caller expects.
    pub fn layout(&self) -> LayoutKind {
        self.layout
    }

    /// Total length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Layout and length the caller expects to read.
    pub fn meta(&self) -> PageMeta {
        PageMeta {
            layout: self.layout,
            len: self.len,
        }
    }

    /// Scatters `src` (exactly [`len`](Self::len) bytes) over the parts.
    ///
    /// # Panics
    /// If `src.len() != self.len()`; backends check the stored length first.
    pub fn copy_from(&mut self, src: &[u8]) {
        assert_eq!(src.len(), self.len, "page length checked by the caller");
        let mut off = 0;
        for p in self.parts.iter_mut() {
            let n = p.len();
            p.copy_from_slice(&src[off..off + n]);
            off += n;
        }
    }

    /// Fills every byte with zero (used by backends to scrub a destination after a failed
    /// verification, so stale bytes are never mistaken for a page).
    pub fn zero(&mut self) {
        for p in self.parts.iter_mut() {
            p.fill(0);
        }
    }
}

/// Why one page of a batch failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PageError {
    /// The page has no bytes.
    EmptyPage,
    /// The page is larger than the backend accepts (or than its whole capacity).
    TooLarge {
        /// The page's length.
        len: usize,
        /// The largest page the backend accepts.
        max: usize,
    },
    /// The backend's storage is full and nothing could be evicted to make room.
    NoSpace,
    /// An I/O error, with the operation and the OS's message.
    Io {
        /// What was being done (`write`, `read`, `rename`, …).
        op: &'static str,
        /// The OS's message (and errno), rendered.
        detail: String,
    },
    /// Any other backend-specific failure.
    Backend(String),
}

impl PageError {
    /// Builds [`PageError::Io`] from an [`std::io::Error`].
    pub fn io(op: &'static str, e: &std::io::Error) -> Self {
        PageError::Io {
            op,
            detail: e.to_string(),
        }
    }
}

impl fmt::Display for PageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PageError::EmptyPage => f.write_str("page has no bytes"),
            PageError::TooLarge { len, max } => {
                write!(f, "page of {len} bytes exceeds the limit of {max} bytes")
            }
            PageError::NoSpace => f.write_str("no space left and nothing evictable"),
            PageError::Io { op, detail } => write!(f, "{op}: {detail}"),
            PageError::Backend(s) => f.write_str(s),
        }
    }
}

impl std::error::Error for PageError {}

/// The outcome of one page of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PageOutcome {
    /// `get`: the destination holds the page, verified.
    Hit,
    /// `get`: the page is absent, was evicted, or its stored metadata (layout, length) differs
    /// from the destination's.
    Miss,
    /// `get`: the stored copy failed verification (checksum, header). It counts as a miss; the
    /// backend dropped the copy and counted it in
    /// [`StorageStats::get_corrupt`](crate::StorageStats::get_corrupt). The destination holds no
    /// usable bytes.
    Corrupt,
    /// `set`: the page was written and committed (durable as far as the backend's durability
    /// policy promises).
    Stored,
    /// `set`: a page with the same key and metadata was already present, so it was not
    /// rewritten (keys name contents, so the stored copy is equivalent).
    Present,
    /// The page failed; the cause says why. Other pages of the batch are unaffected.
    Failed(PageError),
}

impl PageOutcome {
    /// `Hit`, `Stored` or `Present`: the operation achieved its purpose for this page.
    pub fn is_ok(&self) -> bool {
        matches!(
            self,
            PageOutcome::Hit | PageOutcome::Stored | PageOutcome::Present
        )
    }

    /// Whether this is a [`PageOutcome::Hit`].
    pub fn is_hit(&self) -> bool {
        matches!(self, PageOutcome::Hit)
    }
}

/// Length of the leading run of successful outcomes: how many pages of a batch a caller can
/// credit when it needs a contiguous prefix (SGLang credits a fetched batch up to its first
/// failed page).
pub fn leading_ok(outcomes: &[PageOutcome]) -> usize {
    outcomes.iter().take_while(|o| o.is_ok()).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_concatenate_and_scatter() {
        let a = [1u8, 2, 3];
        let b = [4u8, 5];
        let page = PageBuf::from_parts(LayoutKind::LayerFirst, [&a[..], &b[..]]);
        assert_eq!(page.len(), 5);
        assert_eq!(page.to_vec(), vec![1, 2, 3, 4, 5]);
        let mut x = [0u8; 1];
        let mut y = [0u8; 4];
        {
            let mut dst = PageBufMut::from_parts(LayoutKind::LayerFirst, [&mut x[..], &mut y[..]]);
            assert_eq!(dst.meta(), page.meta());
            dst.copy_from(&page.to_vec());
        }
        assert_eq!((x, y), ([1], [2, 3, 4, 5]));
    }

    #[test]
    fn leading_ok_stops_at_first_failure() {
        use PageOutcome::*;
        assert_eq!(leading_ok(&[Hit, Present, Miss, Hit]), 2);
        assert_eq!(leading_ok(&[Failed(PageError::EmptyPage)]), 0);
        assert_eq!(leading_ok(&[]), 0);
    }
}
