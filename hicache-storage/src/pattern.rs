//! Deterministic page keys and page contents for tests, durability tools and benches: page `i`
//! of seed `s` always has the same key and the same bytes, so a checker can tell a correct page
//! from a wrong one without keeping a copy.

use hicache_core::{NamespaceId, PageHash, PageKey};
use xxhash_rust::xxh3::xxh3_128_with_seed;

/// The key of page `index` of `seed` in namespace `namespace`: the page hash is a 256-bit
/// digest of (seed, index), so distinct indices never collide in practice.
pub fn page_key(namespace: NamespaceId, seed: u64, index: u64) -> PageKey {
    let mut hash = [0u8; 32];
    let a = xxh3_128_with_seed(&index.to_le_bytes(), seed);
    let b = xxh3_128_with_seed(&index.to_le_bytes(), seed ^ 0x9e37_79b9_7f4a_7c15);
    hash[..16].copy_from_slice(&a.to_le_bytes());
    hash[16..].copy_from_slice(&b.to_le_bytes());
    PageKey::new(namespace, PageHash(hash))
}

/// A namespace id made from a small number (tests use a few distinct ones).
pub fn namespace(n: u64) -> NamespaceId {
    NamespaceId(xxh3_128_with_seed(b"hicache-rs/test-namespace", n).to_le_bytes())
}

/// The 64-bit stream seed of a key's contents.
fn stream_seed(key: &PageKey) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&key.to_bytes())
}

/// Fills `buf` with the deterministic pseudo-random contents of `key` (a splitmix64 stream
/// seeded by the key). The contents depend on the key only, so a prefix of a longer page equals
/// a shorter page of the same key.
pub fn fill_page(key: &PageKey, buf: &mut [u8]) {
    let mut state = stream_seed(key);
    let mut chunks = buf.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let v = splitmix64(&mut state).to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&v[..n]);
    }
}

/// The contents of `key` as a new vector of `len` bytes (see [`fill_page`]).
pub fn page_bytes(key: &PageKey, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_page(key, &mut v);
    v
}

/// Whether `buf` holds exactly the contents of `key` (see [`fill_page`]).
pub fn check_page(key: &PageKey, buf: &[u8]) -> bool {
    let mut state = stream_seed(key);
    let mut chunks = buf.chunks_exact(8);
    for c in &mut chunks {
        if c != splitmix64(&mut state).to_le_bytes() {
            return false;
        }
    }
    let rest = chunks.remainder();
    rest.is_empty() || rest == &splitmix64(&mut state).to_le_bytes()[..rest.len()]
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_checkable() {
        let k = page_key(namespace(1), 7, 3);
        assert_eq!(k, page_key(namespace(1), 7, 3));
        assert_ne!(k, page_key(namespace(1), 7, 4));
        assert_ne!(k, page_key(namespace(2), 7, 3));
        assert_ne!(k.hash, page_key(namespace(1), 8, 3).hash);
        for len in [0, 1, 7, 8, 9, 4096, 4099] {
            let mut p = page_bytes(&k, len);
            assert!(check_page(&k, &p));
            if len > 0 {
                p[len - 1] ^= 1;
                assert!(!check_page(&k, &p));
            }
        }
        assert!(!check_page(
            &page_key(namespace(1), 7, 4),
            &page_bytes(&k, 64)
        ));
    }
}
