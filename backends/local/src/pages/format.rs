//! The on-disk format, version 1 (see the crate README for the full description).
//!
//! ```text
//! DIR/hicache-file.json          format marker: {"format": "hicache-file", "version": 1}
//! DIR/dir.lock                   flock: exclusive (one process) or shared (shared mode)
//! DIR/janitor.lock               flock: held by the process doing a shared-mode rescan
//! DIR/pages/<key>.page           committed pages; <key> = 96 hex digits of the PageKey
//! DIR/pages/<key>.<instance>.<n>.tmp
//!                                a page being written by process instance <instance>
//!                                (committed by a same-directory rename to <key>.page)
//! DIR/tmp/registry.lock          flock serialising instance registration and cleanup
//! DIR/tmp/<instance>.lock        flock held for the life of a process instance
//! DIR/tmp/<instance>/            that instance's scratch directory (O_DIRECT probe)
//! ```
//!
//! A page file is a 4096-byte header followed by the page's bytes, zero-padded to a multiple
//! of 512 bytes (so O_DIRECT transfers whole sectors). Header fields, little-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `HICACHEP` |
//! | 8 | 4 | format version (1) |
//! | 12 | 4 | header length (4096) |
//! | 16 | 48 | page key: namespace id (16) then page hash (32) |
//! | 64 | 1 | layout tag (`LayoutKind::tag`) |
//! | 65 | 7 | reserved, zero |
//! | 72 | 8 | page length in bytes |
//! | 80 | 8 | XXH3-64 of the page's bytes |
//! | 88 | 8 | write time, Unix nanoseconds (informational) |
//! | 96 | 3992 | reserved, zero |
//! | 4088 | 8 | XXH3-64 of bytes 0..4088 (the header checksum) |

use std::path::PathBuf;

use hicache_core::{LayoutKind, PageKey};
use hicache_storage::PageMeta;

/// Header length; also the O_DIRECT alignment of the data that follows.
pub const HEADER_LEN: usize = 4096;
/// Sector size data is padded to (the O_DIRECT length granularity).
pub const SECTOR: usize = 512;
/// Magic bytes at offset 0.
pub const MAGIC: &[u8; 8] = b"HICACHEP";
/// Format version written and accepted.
pub const VERSION: u32 = 1;
/// Name of the format marker file.
pub const MARKER: &str = "hicache-file.json";
/// Contents of the format marker file.
pub const MARKER_CONTENTS: &str = "{\"format\": \"hicache-file\", \"version\": 1}\n";

/// Rounds `n` up to a whole number of sectors.
pub fn pad(n: usize) -> usize {
    n.div_ceil(SECTOR) * SECTOR
}

/// Bytes a page of `len` bytes occupies on disk (header, data, padding).
pub fn file_bytes(len: usize) -> u64 {
    (HEADER_LEN + pad(len)) as u64
}

/// The layout of a tag, if valid.
pub fn layout_from_tag(tag: u8) -> Option<LayoutKind> {
    LayoutKind::ALL.into_iter().find(|l| l.tag() == tag)
}

/// A decoded, verified header.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The page's key.
    pub key: PageKey,
    /// Layout and length.
    pub meta: PageMeta,
    /// XXH3-64 of the data.
    pub checksum: u64,
    /// When the page was written, Unix nanoseconds (what `ttl_s` expiry counts from).
    pub written: u64,
}

/// Why a header was refused.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HeaderError {
    /// Shorter than [`HEADER_LEN`].
    Short,
    /// Wrong magic.
    Magic,
    /// Another format version.
    Version(u32),
    /// Header checksum mismatch.
    Checksum,
    /// Unknown layout tag.
    Layout(u8),
    /// A length that does not fit this platform.
    Length,
}

impl std::fmt::Display for HeaderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeaderError::Short => f.write_str("short header"),
            HeaderError::Magic => f.write_str("bad magic"),
            HeaderError::Version(v) => write!(f, "format version {v}, expected {VERSION}"),
            HeaderError::Checksum => f.write_str("header checksum mismatch"),
            HeaderError::Layout(t) => write!(f, "unknown layout tag {t}"),
            HeaderError::Length => f.write_str("page length out of range"),
        }
    }
}

impl Header {
    /// Writes the header into `out` (at least [`HEADER_LEN`] bytes; the rest of the header is
    /// zeroed).
    pub fn encode(&self, out: &mut [u8]) {
        let h = &mut out[..HEADER_LEN];
        h.fill(0);
        h[0..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
        h[16..64].copy_from_slice(&self.key.to_bytes());
        h[64] = self.meta.layout.tag();
        h[72..80].copy_from_slice(&(self.meta.len as u64).to_le_bytes());
        h[80..88].copy_from_slice(&self.checksum.to_le_bytes());
        h[88..96].copy_from_slice(&self.written.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&h[..HEADER_LEN - 8]);
        h[HEADER_LEN - 8..].copy_from_slice(&sum.to_le_bytes());
    }

    /// Decodes and verifies a header.
    pub fn decode(h: &[u8]) -> Result<Self, HeaderError> {
        if h.len() < HEADER_LEN {
            return Err(HeaderError::Short);
        }
        let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8 bytes"));
        if &h[0..8] != MAGIC {
            return Err(HeaderError::Magic);
        }
        if u32_at(8) != VERSION || u32_at(12) != HEADER_LEN as u32 {
            return Err(HeaderError::Version(u32_at(8)));
        }
        if xxhash_rust::xxh3::xxh3_64(&h[..HEADER_LEN - 8]) != u64_at(HEADER_LEN - 8) {
            return Err(HeaderError::Checksum);
        }
        let layout = layout_from_tag(h[64]).ok_or(HeaderError::Layout(h[64]))?;
        let len = usize::try_from(u64_at(72)).map_err(|_| HeaderError::Length)?;
        if len == 0 || len > (1 << 40) {
            return Err(HeaderError::Length);
        }
        let key = PageKey::from_bytes(h[16..64].try_into().expect("48 bytes"));
        Ok(Self {
            key,
            meta: PageMeta { layout, len },
            checksum: u64_at(80),
            written: u64_at(88),
        })
    }
}

/// Paths inside a storage directory.
#[derive(Clone, Debug)]
pub struct Layout {
    /// The storage directory.
    pub root: PathBuf,
}

impl Layout {
    /// `DIR/pages`.
    pub fn pages(&self) -> PathBuf {
        self.root.join("pages")
    }

    /// `DIR/tmp`.
    pub fn tmp(&self) -> PathBuf {
        self.root.join("tmp")
    }

    /// The directory of a key's files: `DIR/pages` for every key. One flat directory (hashed
    /// B-tree directories such as ext4's and XFS's look names up in O(log n)) keeps the files
    /// of a batch close together on disk, so reads of a prefix are near-sequential, and a
    /// batch commits with a single directory sync; fanning out into per-hash subdirectories
    /// measured markedly slower on ext4, which spreads directories over block groups.
    pub fn bucket(&self, _key: &PageKey) -> PathBuf {
        self.pages()
    }

    /// The temp file of a key written by `instance` (its `n`-th write).
    pub fn temp_path(&self, key: &PageKey, instance: &str, n: u64) -> PathBuf {
        self.bucket(key)
            .join(format!("{}.{instance}.{n}.tmp", key.to_hex()))
    }

    /// The committed file of a key.
    pub fn page_path(&self, key: &PageKey) -> PathBuf {
        self.bucket(key).join(format!("{}.page", key.to_hex()))
    }
}

/// The instance that owns a temp file name (`<key>.<instance>.<n>.tmp`), if it is one.
pub fn temp_instance(name: &str) -> Option<&str> {
    let rest = name.strip_suffix(".tmp")?;
    let mut it = rest.rsplitn(3, '.');
    let _seq = it.next()?;
    let inst = it.next()?;
    let _key = it.next()?;
    Some(inst)
}

/// Parses a committed page's file name back into its key.
pub fn key_from_file_name(name: &str) -> Option<PageKey> {
    let hex = name.strip_suffix(".page")?;
    PageKey::from_hex(hex).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache_core::{NamespaceId, PageHash};

    fn header() -> Header {
        Header {
            key: PageKey::new(NamespaceId([3; 16]), PageHash([9; 32])),
            meta: PageMeta {
                layout: LayoutKind::LayerFirst,
                len: 12345,
            },
            checksum: 0xdead_beef,
            written: 1_700_000_000_123_456_789,
        }
    }

    #[test]
    fn header_round_trips() {
        let mut b = vec![0xffu8; HEADER_LEN];
        header().encode(&mut b);
        assert_eq!(Header::decode(&b), Ok(header()));
    }

    #[test]
    fn damaged_headers_are_refused() {
        let mut b = vec![0u8; HEADER_LEN];
        header().encode(&mut b);
        assert_eq!(Header::decode(&b[..100]), Err(HeaderError::Short));
        let mut m = b.clone();
        m[0] = b'X';
        assert_eq!(Header::decode(&m), Err(HeaderError::Magic));
        let mut m = b.clone();
        m[8] = 2;
        assert_eq!(Header::decode(&m), Err(HeaderError::Version(2)));
        for i in [16, 64, 72, 80, 200] {
            let mut m = b.clone();
            m[i] ^= 1;
            assert_eq!(Header::decode(&m), Err(HeaderError::Checksum), "byte {i}");
        }
    }

    #[test]
    fn names_and_sizes() {
        let k = header().key;
        let l = Layout { root: "/d".into() };
        let p = l.page_path(&k);
        assert_eq!(p.parent().unwrap(), l.bucket(&k));
        let name = p.file_name().unwrap().to_str().unwrap();
        assert_eq!(key_from_file_name(name), Some(k));
        assert_eq!(key_from_file_name("x.page"), None);
        let t = l.temp_path(&k, "123-abc", 7);
        let tn = t.file_name().unwrap().to_str().unwrap();
        assert_eq!(temp_instance(tn), Some("123-abc"));
        assert_eq!(key_from_file_name(tn), None);
        assert_eq!(temp_instance(name), None);
        assert_eq!(pad(1), 512);
        assert_eq!(pad(512), 512);
        assert_eq!(file_bytes(4096), 8192);
        assert_eq!(file_bytes(8 << 20), 4096 + (8 << 20));
    }
}
