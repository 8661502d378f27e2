//! The stored value of one page: a fixed header followed by the page's bytes.
//!
//! ```text
//! offset  size  field
//!      0     4  magic  b"HCRP"
//!      4     1  format version (1)
//!      5     1  layout tag (LayoutKind::tag)
//!      6     2  reserved, zero
//!      8     8  page length in bytes, u64 little endian
//!     16     8  XXH3-64 of the page bytes, u64 little endian
//!     24    48  the PageKey (namespace id, page hash)
//!     72     …  the page bytes
//! ```
//!
//! Invariants: a value is accepted only if its magic, version and key match, its length field
//! equals the bytes that follow, and the checksum of those bytes matches. The key inside the
//! value means a value copied (or renamed) under another key never reads as that key's page.

use hicache_core::{LayoutKind, PageKey};
use hicache_storage::checksum::checksum_parts;
use hicache_storage::{PageBuf, PageMeta};

/// Bytes of the header in front of every page.
pub const HEADER_LEN: usize = 72;
const MAGIC: &[u8; 4] = b"HCRP";
const VERSION: u8 = 1;

/// What a stored header says, once its magic, version and key were checked.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// Layout and length of the stored page.
    pub meta: PageMeta,
    /// XXH3-64 of the page bytes.
    pub checksum: u64,
}

/// Why a stored value was refused.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Damage {
    /// Shorter than a header.
    Truncated,
    /// Wrong magic or format version.
    BadHeader,
    /// The header names another page.
    WrongKey,
    /// The length field does not match the bytes stored.
    BadLength,
    /// The bytes do not match the checksum.
    BadChecksum,
}

/// Writes the header of `page` stored under `key`.
pub fn header(key: &PageKey, page: &PageBuf<'_>) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(MAGIC);
    h[4] = VERSION;
    h[5] = page.layout().tag();
    h[8..16].copy_from_slice(&(page.len() as u64).to_le_bytes());
    h[16..24].copy_from_slice(&checksum_parts(page.parts().iter().copied()).to_le_bytes());
    h[24..72].copy_from_slice(&key.to_bytes());
    h
}

/// Parses the header at the start of `value` (at least [`HEADER_LEN`] bytes) for `key`.
pub fn parse_header(key: &PageKey, value: &[u8]) -> Result<Header, Damage> {
    if value.len() < HEADER_LEN {
        return Err(Damage::Truncated);
    }
    if &value[..4] != MAGIC || value[4] != VERSION {
        return Err(Damage::BadHeader);
    }
    let layout = layout_from_tag(value[5]).ok_or(Damage::BadHeader)?;
    if value[24..72] != key.to_bytes() {
        return Err(Damage::WrongKey);
    }
    let len = u64::from_le_bytes(value[8..16].try_into().expect("8 bytes"));
    let len = usize::try_from(len).map_err(|_| Damage::BadLength)?;
    let checksum = u64::from_le_bytes(value[16..24].try_into().expect("8 bytes"));
    Ok(Header {
        meta: PageMeta { layout, len },
        checksum,
    })
}

/// Checks a whole stored value for `key`: header, length and checksum. Returns the header and
/// the page bytes.
pub fn verify<'v>(key: &PageKey, value: &'v [u8]) -> Result<(Header, &'v [u8]), Damage> {
    let h = parse_header(key, value)?;
    let body = &value[HEADER_LEN..];
    if body.len() != h.meta.len {
        return Err(Damage::BadLength);
    }
    if hicache_storage::checksum::checksum(body) != h.checksum {
        return Err(Damage::BadChecksum);
    }
    Ok((h, body))
}

/// The byte ranges `(start, len)` a value of `total` bytes is read in with reads of at most
/// `chunk` bytes: as few ranges as that allows, of equal length but the last (no longer
/// than the others), so with `chunk ≥ 2 × HEADER_LEN` the first holds the whole header.
pub fn read_ranges(total: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let size = total.div_ceil(total.div_ceil(chunk.max(1)).max(1)).max(1);
    (0..total.div_ceil(size)).map(move |i| {
        let start = i * size;
        (start, size.min(total - start))
    })
}

fn layout_from_tag(tag: u8) -> Option<LayoutKind> {
    [
        LayoutKind::LayerFirst,
        LayoutKind::PageFirst,
        LayoutKind::PageFirstDirect,
    ]
    .into_iter()
    .find(|l| l.tag() == tag)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_storage::pattern;

    fn stored(key: &PageKey, data: &[u8]) -> Vec<u8> {
        let page = PageBuf::from_parts(LayoutKind::LayerFirst, data.chunks(7));
        let mut v = header(key, &page).to_vec();
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn read_ranges_cover_the_value_once_in_order() {
        for (total, chunk) in [
            (8_388_680usize, 524_288usize),
            (8_388_680, 4096),
            (10_000, 4096),
            (8193, 4096),
            (4097, 4096),
            (512 << 20, 4096),
            (100, 4096),
        ] {
            let r: Vec<(usize, usize)> = read_ranges(total, chunk).collect();
            assert!(r.len() <= total.div_ceil(chunk), "{total}/{chunk}");
            assert!(r[0].1 >= HEADER_LEN.min(total));
            let mut at = 0;
            for &(s, l) in &r {
                assert_eq!(s, at);
                assert!(l <= chunk && l > 0 && l <= r[0].1, "{total}/{chunk}");
                at += l;
            }
            assert_eq!(at, total);
        }
    }

    #[test]
    fn round_trip_and_every_damage() {
        let key = pattern::page_key(pattern::namespace(1), 5, 0);
        let other = pattern::page_key(pattern::namespace(1), 6, 0);
        let data = pattern::page_bytes(&key, 1000);
        let v = stored(&key, &data);
        let (h, body) = verify(&key, &v).unwrap();
        assert_eq!(h.meta.layout, LayoutKind::LayerFirst);
        assert_eq!(h.meta.len, 1000);
        assert_eq!(body, &data[..]);
        assert_eq!(verify(&other, &v), Err(Damage::WrongKey));
        assert_eq!(verify(&key, &v[..10]), Err(Damage::Truncated));
        assert_eq!(verify(&key, &v[..v.len() - 1]), Err(Damage::BadLength));
        let mut flipped = v.clone();
        flipped[HEADER_LEN + 500] ^= 1;
        assert_eq!(verify(&key, &flipped), Err(Damage::BadChecksum));
        let mut magic = v.clone();
        magic[0] = b'X';
        assert_eq!(verify(&key, &magic), Err(Damage::BadHeader));
        let mut layout = v;
        layout[5] = 99;
        assert_eq!(verify(&key, &layout), Err(Damage::BadHeader));
    }
}
