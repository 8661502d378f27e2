//! Page identities: [`PageHash`] (one chained digest per page), [`NamespaceId`] (which model,
//! adapter, tenant and layout a page belongs to) and [`PageKey`] (the pair, as L3 sees it).
//!
//! These are plain descriptors shared by every crate: `hicache-storage` keys pages with
//! [`PageKey`] without knowing how the hashes were made.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};

/// Number of bytes of a page hash (SHA-256).
pub const PAGE_HASH_LEN: usize = 32;
/// Number of bytes of a namespace id.
pub const NAMESPACE_ID_LEN: usize = 16;

fn decode_hex<const N: usize>(what: &'static str, s: &str) -> Result<[u8; N]> {
    let bad = || CoreError::BadHex {
        what,
        expected_len: 2 * N,
        got: s.chars().take(128).collect(),
    };
    if s.len() != 2 * N {
        return Err(bad());
    }
    let mut out = [0u8; N];
    hex::decode_to_slice(s, &mut out).map_err(|_| bad())?;
    Ok(out)
}

/// The SHA-256 digest identifying one page of tokens together with everything before it in
/// its sequence (SGLang's page-hash chain, described in the `hash` module).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PageHash(pub [u8; PAGE_HASH_LEN]);

impl PageHash {
    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; PAGE_HASH_LEN] {
        &self.0
    }

    /// Lowercase hex, 64 characters (SGLang's storage key form).
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses the 64-character hex form (either case).
    pub fn from_hex(s: &str) -> Result<Self> {
        decode_hex("page hash", s).map(Self)
    }

    /// The signed 64-bit id that KV events carry: the first 16 hex digits read as a big-endian
    /// integer in two's complement (SGLang's `hash_str_to_int64`).
    pub fn event_id(&self) -> i64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[..8]);
        i64::from_be_bytes(b)
    }
}

impl fmt::Debug for PageHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageHash({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for PageHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl Serialize for PageHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for PageHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

/// A 128-bit digest of a namespace (the `hash` module's `Namespace`) plus a tenant (extra key, cache
/// salt). Stored with every L3 page and part of its [`PageKey`], so two namespaces never read
/// each other's pages even when their token hashes coincide (SGLang-compatible hashing).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct NamespaceId(pub [u8; NAMESPACE_ID_LEN]);

impl NamespaceId {
    /// The raw 16 bytes.
    pub fn as_bytes(&self) -> &[u8; NAMESPACE_ID_LEN] {
        &self.0
    }

    /// Lowercase hex, 32 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses the 32-character hex form.
    pub fn from_hex(s: &str) -> Result<Self> {
        decode_hex("namespace id", s).map(Self)
    }
}

impl fmt::Debug for NamespaceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NamespaceId({})", self.to_hex())
    }
}

impl fmt::Display for NamespaceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// The identity of one page in L3: the namespace it belongs to and its chained page hash.
///
/// Backends treat it as an opaque fixed-size key of [`PageKey::LEN`] bytes; [`PageKey::to_hex`]
/// gives a file-name and network safe form.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PageKey {
    /// Which model / adapter / tenant / layout the page belongs to.
    pub namespace: NamespaceId,
    /// The chained page hash.
    pub hash: PageHash,
}

impl PageKey {
    /// Length of the binary form in bytes.
    pub const LEN: usize = NAMESPACE_ID_LEN + PAGE_HASH_LEN;

    /// Builds a key.
    pub fn new(namespace: NamespaceId, hash: PageHash) -> Self {
        Self { namespace, hash }
    }

    /// Binary form: namespace id then page hash.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..NAMESPACE_ID_LEN].copy_from_slice(&self.namespace.0);
        out[NAMESPACE_ID_LEN..].copy_from_slice(&self.hash.0);
        out
    }

    /// Parses the binary form written by [`PageKey::to_bytes`].
    pub fn from_bytes(b: &[u8; Self::LEN]) -> Self {
        let mut ns = [0u8; NAMESPACE_ID_LEN];
        let mut h = [0u8; PAGE_HASH_LEN];
        ns.copy_from_slice(&b[..NAMESPACE_ID_LEN]);
        h.copy_from_slice(&b[NAMESPACE_ID_LEN..]);
        Self::new(NamespaceId(ns), PageHash(h))
    }

    /// Lowercase hex of the binary form, 96 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.to_bytes())
    }

    /// Parses the 96-character hex form.
    pub fn from_hex(s: &str) -> Result<Self> {
        decode_hex::<{ Self::LEN }>("page key", s).map(|b| Self::from_bytes(&b))
    }
}

impl fmt::Debug for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PageKey({}/{})",
            &self.namespace.to_hex()[..8],
            &self.hash.to_hex()[..16]
        )
    }
}

impl fmt::Display for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Converts engine token ids (often `i64`/`u64` tensors) to the `u32` ids the tree and the
/// hashes use; an id that does not fit is an error naming its position.
pub fn tokens_from_u64(ids: &[u64]) -> Result<Vec<u32>> {
    ids.iter()
        .enumerate()
        .map(|(position, &value)| {
            u32::try_from(value).map_err(|_| CoreError::TokenOutOfRange { position, value })
        })
        .collect()
}

/// Like [`tokens_from_u64`] for signed ids; negative ids are out of range too.
pub fn tokens_from_i64(ids: &[i64]) -> Result<Vec<u32>> {
    ids.iter()
        .enumerate()
        .map(|(position, &value)| {
            u32::try_from(value).map_err(|_| CoreError::TokenOutOfRange {
                position,
                value: value as u64,
            })
        })
        .collect()
}

/// A tenant: one (extra key, cache salt) pair, interned by the radix tree
/// (`HiRadixTree::tenant`). Lives here, below both the tree and its KV events, which name it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TenantId(pub u32);

impl TenantId {
    /// The tenant without extra key or cache salt; it always exists.
    pub const DEFAULT: TenantId = TenantId(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips() {
        let k = PageKey::new(NamespaceId([7; 16]), PageHash([0xab; 32]));
        assert_eq!(PageKey::from_hex(&k.to_hex()).unwrap(), k);
        assert_eq!(k.to_hex().len(), 96);
        assert_eq!(PageKey::from_bytes(&k.to_bytes()), k);
        let h = PageHash([0x01; 32]);
        assert_eq!(PageHash::from_hex(&h.to_hex()).unwrap(), h);
    }

    #[test]
    fn bad_hex_is_an_error() {
        assert!(matches!(
            PageHash::from_hex("abc"),
            Err(CoreError::BadHex { .. })
        ));
        assert!(PageHash::from_hex(&"zz".repeat(32)).is_err());
        assert!(NamespaceId::from_hex(&"00".repeat(17)).is_err());
    }

    #[test]
    fn event_id_is_first_16_hex_twos_complement() {
        let mut b = [0u8; 32];
        b[0] = 0xff;
        b[7] = 0xfe;
        let h = PageHash(b);
        // 0xff000000000000fe as i64
        assert_eq!(h.event_id(), 0xff00_0000_0000_00feu64 as i64);
    }

    #[test]
    fn token_conversion_rejects_wide_ids() {
        assert_eq!(tokens_from_u64(&[1, 2, 3]).unwrap(), vec![1, 2, 3]);
        assert_eq!(
            tokens_from_u64(&[1, 1 << 32]),
            Err(CoreError::TokenOutOfRange {
                position: 1,
                value: 1 << 32
            })
        );
        assert!(tokens_from_i64(&[-1]).is_err());
    }
}
