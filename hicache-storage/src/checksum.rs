//! The page checksum every backend built on this crate stores and verifies: XXH3-64 over the
//! page's bytes, streamed over its parts (so a page checksums the same whatever its parts).

use xxhash_rust::xxh3::Xxh3;

use crate::page::{PageBuf, PageBufMut};

/// XXH3-64 of a contiguous byte run.
pub fn checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

/// XXH3-64 of the concatenation of `parts`.
pub fn checksum_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h = Checksummer::default();
    for p in parts {
        h.update(p);
    }
    h.finish()
}

/// The page checksum computed piece by piece, as bytes arrive (hashing each piece while it
/// is still in the CPU cache); [`finish`](Self::finish) equals [`checksum_parts`] of the
/// same bytes however they were split.
#[derive(Clone)]
pub struct Checksummer(Xxh3);

impl Default for Checksummer {
    fn default() -> Self {
        Self(Xxh3::new())
    }
}

impl Checksummer {
    /// Adds the next bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The checksum of every byte added.
    pub fn finish(&self) -> u64 {
        self.0.digest()
    }
}

/// XXH3-64 of a page to be written.
pub fn checksum_page(page: &PageBuf<'_>) -> u64 {
    checksum_parts(page.parts().iter().copied())
}

/// XXH3-64 of a page just read into a destination.
pub fn checksum_page_mut(page: &PageBufMut<'_>) -> u64 {
    checksum_parts(page.parts().iter().map(|p| &**p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_core::LayoutKind;

    #[test]
    fn piecewise_equals_whole() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 13 + 5) as u8).collect();
        let mut c = Checksummer::default();
        for piece in data.chunks(4097) {
            c.update(piece);
        }
        assert_eq!(c.finish(), checksum(&data));
    }

    #[test]
    fn independent_of_parts() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let whole = checksum(&data);
        let p = PageBuf::from_parts(LayoutKind::LayerFirst, data.chunks(333));
        assert_eq!(checksum_page(&p), whole);
        let mut copy = data.clone();
        let m = PageBufMut::from_parts(LayoutKind::LayerFirst, copy.chunks_mut(1000));
        assert_eq!(checksum_page_mut(&m), whole);
    }
}
