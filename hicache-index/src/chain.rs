//! The index's page-hash chain.
//!
//! A block's hash is XXH3-64 over its tokens (u32 little-endian each), seeded with the hash of
//! the block before it; the first block of a sequence is seeded with the chain's *root*, which
//! is derived from the LoRA adapter (or none). Two sequences share a block hash exactly when
//! they share every token up to and including that block (up to 64-bit collisions), whatever
//! engine produced them, so the index can be queried with tokens alone.
//!
//! The chain is per model: an index keeps one table per model, so the model is not hashed.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// One block's chained hash.
pub type BlockHash = u64;

/// Computes chained block hashes from tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainHasher {
    page_size: usize,
    root: BlockHash,
}

/// The root of chains without a LoRA adapter.
const ROOT_SEED: u64 = 0x6869_6361_6368_6549; // "hicacheI"

impl ChainHasher {
    /// A hasher for pages of `page_size` tokens (≥ 1), with no LoRA adapter.
    pub fn new(page_size: usize) -> Self {
        Self::with_lora(page_size, None)
    }

    /// A hasher whose chains start from the root of `lora` (an engine's LoRA id), so that
    /// sequences under different adapters never share a block.
    pub fn with_lora(page_size: usize, lora: Option<i64>) -> Self {
        let root = match lora {
            None => ROOT_SEED,
            Some(id) => xxh3_64_with_seed(&id.to_le_bytes(), ROOT_SEED ^ 0x4c6f_5241),
        };
        Self {
            page_size: page_size.max(1),
            root,
        }
    }

    /// Tokens per block.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The seed of a chain's first block.
    pub fn root(&self) -> BlockHash {
        self.root
    }

    /// The hash of one block of tokens following `parent` (`None`: the first block).
    pub fn block(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let mut buf = [0u8; 4 * 64];
        let seed = parent.unwrap_or(self.root);
        if tokens.len() <= 64 {
            for (i, t) in tokens.iter().enumerate() {
                buf[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
            }
            xxh3_64_with_seed(&buf[..4 * tokens.len()], seed)
        } else {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            xxh3_64_with_seed(&bytes, seed)
        }
    }

    /// The hashes of every whole page of `tokens`, chained from `parent` (a trailing partial
    /// page is ignored), appended to `out`.
    pub fn extend(&self, parent: Option<BlockHash>, tokens: &[u32], out: &mut Vec<BlockHash>) {
        let mut prev = parent;
        for page in tokens.chunks_exact(self.page_size) {
            let h = self.block(prev, page);
            out.push(h);
            prev = Some(h);
        }
    }

    /// The hashes of every whole page of `tokens` from the start of a sequence.
    pub fn hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.page_size);
        self.extend(None, tokens, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_share_hashes_and_diverge_after() {
        let h = ChainHasher::new(2);
        let a = h.hashes(&[1, 2, 3, 4, 5, 6, 7]);
        let b = h.hashes(&[1, 2, 3, 4, 9, 9]);
        assert_eq!(a.len(), 3);
        assert_eq!(b.len(), 3);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
    }

    #[test]
    fn a_chain_continues_from_its_parent() {
        let h = ChainHasher::new(2);
        let whole = h.hashes(&[1, 2, 3, 4, 5, 6]);
        let mut tail = Vec::new();
        h.extend(Some(whole[0]), &[3, 4, 5, 6], &mut tail);
        assert_eq!(tail, whole[1..]);
    }

    #[test]
    fn lora_adapters_never_share_blocks() {
        let t = [1u32, 2, 3, 4];
        assert_ne!(
            ChainHasher::new(4).hashes(&t),
            ChainHasher::with_lora(4, Some(1)).hashes(&t)
        );
        assert_ne!(
            ChainHasher::with_lora(4, Some(1)).hashes(&t),
            ChainHasher::with_lora(4, Some(2)).hashes(&t)
        );
    }

    #[test]
    fn long_pages_hash_like_short_ones_would() {
        let h = ChainHasher::new(100);
        let t: Vec<u32> = (0..100).collect();
        let bytes: Vec<u8> = t.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(h.block(None, &t), xxh3_64_with_seed(&bytes, h.root()));
    }
}
