//! Page hashing: the chained per-page digests that name pages in L3 and in KV events.
//!
//! Both modes use the same chain step, SGLang's page hash (`get_hash_str`, chained from the
//! previous page's digest):
//!
//! ```text
//! h_i = SHA-256( raw32(h_{i-1}) || LE32(t_{i·P}) || … || LE32(t_{i·P+P-1}) )
//! ```
//!
//! where the first page's prior is absent in [`HashMode::Sglang`] (children of the root start a
//! fresh chain, bit-exact with SGLang so L3 data can be shared with it) and is the tenant's
//! **chain seed** in [`HashMode::Namespaced`] (the default). The seed is a digest of the
//! [`Namespace`] (model fingerprint, dtype, layout, KV shape, page size, TP/PP shard, format
//! version) and of the tenant (extra key such as a LoRA id, cache salt), so two namespaces can
//! never produce the same page hash for the same tokens.
//!
//! Every field enters the digests *framed* (a type tag, then a little-endian length, then the
//! bytes), so no two different namespaces serialise to the same byte string.
//!
//! Whatever the mode, every page key also carries a [`NamespaceId`] derived from the same
//! seed, so L3 keeps namespaces apart even for SGLang-compatible hashes.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{CoreError, Result};
use crate::key::{NAMESPACE_ID_LEN, NamespaceId, PageHash};
use crate::layout::{DType, KvKind, LayoutKind};

/// Version of the namespace / seed encoding below. Bump it when the encoding or the meaning of
/// stored pages changes; pages of other versions then simply miss.
pub const FORMAT_VERSION: u32 = 1;

const NAMESPACE_DOMAIN: &[u8] = b"hicache-rs/namespace\0";
const SEED_DOMAIN: &[u8] = b"hicache-rs/chain-seed\0";

/// How page hashes are chained.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HashMode {
    /// Bit-exact with SGLang: children of the root start an unseeded chain. Namespaces are kept
    /// apart only by the [`NamespaceId`] half of the page key.
    Sglang,
    /// The chain is seeded by the namespace and tenant digest (default).
    #[default]
    Namespaced,
}

/// Everything that makes the bytes of a page differ between two deployments that see the same
/// tokens. Two instances share L3 pages iff their namespaces (and tenants) are equal.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Namespace {
    /// Model fingerprint: served model name plus revision or a digest of the weights.
    pub model: String,
    /// KV element type.
    pub dtype: DType,
    /// Host layout (the byte order of L3 pages depends on it).
    pub layout: LayoutKind,
    /// MHA heads/dim or MLA latent width held by this rank.
    pub kv: KvKind,
    /// Layers held by this rank (its pipeline stage).
    pub layers: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// Tensor-parallel rank (0 for rank-replicated KV such as MLA: see [`Namespace::normalized`]).
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline-parallel rank.
    pub pp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// Encoding version, normally [`FORMAT_VERSION`].
    pub format_version: u32,
}

impl Namespace {
    /// A single-rank namespace with the current format version.
    pub fn single_rank(
        model: impl Into<String>,
        dtype: DType,
        layout: LayoutKind,
        kv: KvKind,
        layers: u32,
        page_size: u32,
    ) -> Self {
        Self {
            model: model.into(),
            dtype,
            layout,
            kv,
            layers,
            page_size,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            format_version: FORMAT_VERSION,
        }
    }

    /// The namespace as stored: MLA KV is the same on every TP rank, so its TP shard is
    /// dropped (rank 0 of 1) and all ranks share one copy in L3.
    pub fn normalized(&self) -> Self {
        let mut n = self.clone();
        if matches!(n.kv, KvKind::Mla { .. }) {
            n.tp_rank = 0;
            n.tp_size = 1;
        }
        n
    }

    /// Checks ranks against sizes and the page size.
    pub fn validate(&self) -> Result<()> {
        if self.page_size == 0 || self.page_size > 65536 {
            return Err(CoreError::BadPageSize(self.page_size));
        }
        if self.tp_size == 0 || self.tp_rank >= self.tp_size {
            return Err(CoreError::InvalidPolicy {
                field: "tp_rank",
                value: format!("{}/{}", self.tp_rank, self.tp_size),
                reason: "rank must be below a non-zero size",
            });
        }
        if self.pp_size == 0 || self.pp_rank >= self.pp_size {
            return Err(CoreError::InvalidPolicy {
                field: "pp_rank",
                value: format!("{}/{}", self.pp_rank, self.pp_size),
                reason: "rank must be below a non-zero size",
            });
        }
        Ok(())
    }

    /// SHA-256 over the framed encoding of every field (of the normalized namespace).
    pub fn digest(&self) -> [u8; 32] {
        let n = self.normalized();
        let mut f = Framer::new(NAMESPACE_DOMAIN);
        f.u32(n.format_version);
        f.str(&n.model);
        f.u8(n.dtype.tag());
        f.u8(n.layout.tag());
        match n.kv {
            KvKind::Mha { heads, head_dim } => {
                f.u8(1);
                f.u32(heads);
                f.u32(head_dim);
            }
            KvKind::Mla { kv_dim } => {
                f.u8(2);
                f.u32(kv_dim);
            }
        }
        f.u32(n.layers);
        f.u32(n.page_size);
        f.u32(n.tp_rank);
        f.u32(n.tp_size);
        f.u32(n.pp_rank);
        f.u32(n.pp_size);
        f.finish()
    }
}

/// Byte framing for digests: each item is a one-byte type tag, then for strings a LE32 length
/// and the bytes; `None` is its own tag. Prevents ambiguity between concatenated fields.
struct Framer(Sha256);

impl Framer {
    fn new(domain: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(domain);
        Self(h)
    }
    fn u8(&mut self, v: u8) {
        self.0.update([b'b', v]);
    }
    fn u32(&mut self, v: u32) {
        self.0.update([b'u']);
        self.0.update(v.to_le_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.0.update([b's']);
        self.0.update((v.len() as u32).to_le_bytes());
        self.0.update(v);
    }
    fn str(&mut self, v: &str) {
        self.bytes(v.as_bytes());
    }
    fn opt_str(&mut self, v: Option<&str>) {
        match v {
            None => self.0.update([b'n']),
            Some(s) => self.str(s),
        }
    }
    fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

/// Where a tenant's chains start: the [`NamespaceId`] its L3 keys carry and the prior of the
/// first page under the root.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ChainStart {
    /// Namespace half of every [`PageKey`](crate::key::PageKey) of this tenant.
    pub namespace_id: NamespaceId,
    /// Prior of the root's children: `None` in SGLang mode, the seed in namespaced mode.
    pub prior: Option<PageHash>,
}

/// Computes chained page hashes for one namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageHasher {
    mode: HashMode,
    page_size: u32,
    namespace_digest: [u8; 32],
}

impl PageHasher {
    /// A hasher for `namespace` in `mode`.
    pub fn new(mode: HashMode, namespace: &Namespace) -> Result<Self> {
        namespace.validate()?;
        Ok(Self {
            mode,
            page_size: namespace.page_size,
            namespace_digest: namespace.digest(),
        })
    }

    /// An SGLang-compatible hasher with a page size only (the namespace id is then that of an
    /// anonymous namespace; use [`PageHasher::new`] to keep deployments apart in L3).
    pub fn sglang(page_size: u32) -> Result<Self> {
        if page_size == 0 || page_size > 65536 {
            return Err(CoreError::BadPageSize(page_size));
        }
        Ok(Self {
            mode: HashMode::Sglang,
            page_size,
            namespace_digest: [0; 32],
        })
    }

    /// The mode.
    pub fn mode(&self) -> HashMode {
        self.mode
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// The chain start of a tenant (extra key, e.g. a LoRA id, and cache salt).
    pub fn chain_start(&self, extra_key: Option<&str>, cache_salt: Option<&str>) -> ChainStart {
        let mut f = Framer::new(SEED_DOMAIN);
        f.bytes(&self.namespace_digest);
        f.opt_str(extra_key);
        f.opt_str(cache_salt);
        let seed = f.finish();
        let mut id = [0u8; NAMESPACE_ID_LEN];
        id.copy_from_slice(&seed[..NAMESPACE_ID_LEN]);
        ChainStart {
            namespace_id: NamespaceId(id),
            prior: match self.mode {
                HashMode::Sglang => None,
                HashMode::Namespaced => Some(PageHash(seed)),
            },
        }
    }

    /// One chain step: SHA-256 of the prior's raw bytes (if any) then each token as LE u32.
    /// Any number of tokens (SGLang hashes a short final page the same way).
    pub fn hash_page(prior: Option<&PageHash>, tokens: &[u32]) -> PageHash {
        let mut h = Sha256::new();
        if let Some(p) = prior {
            h.update(p.0);
        }
        // Serialise in small stack chunks: one `update` per chunk keeps SHA-NI busy.
        let mut buf = [0u8; 256];
        for chunk in tokens.chunks(64) {
            for (i, t) in chunk.iter().enumerate() {
                buf[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..4 * chunk.len()]);
        }
        PageHash(h.finalize().into())
    }

    /// Hashes every whole page of `tokens`, chained from `prior`, appending to `out`; returns the
    /// number of pages hashed. A trailing partial page is ignored (it is never cached).
    pub fn hash_pages_into(
        &self,
        prior: Option<PageHash>,
        tokens: &[u32],
        out: &mut Vec<PageHash>,
    ) -> usize {
        let ps = self.page_size as usize;
        let mut prior = prior;
        let mut n = 0;
        for page in tokens.chunks_exact(ps) {
            let h = Self::hash_page(prior.as_ref(), page);
            out.push(h);
            prior = Some(h);
            n += 1;
        }
        n
    }

    /// Hashes every whole page of `tokens` chained from `prior`.
    pub fn hash_pages(&self, prior: Option<PageHash>, tokens: &[u32]) -> Vec<PageHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.page_size as usize);
        self.hash_pages_into(prior, tokens, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    //! Expected digests were computed independently with Python's `hashlib` (see
    //! `tests/hash_vectors.rs` for the script); here only structural properties.
    use super::*;

    fn ns() -> Namespace {
        Namespace::single_rank(
            "llama-3-8b@abc",
            DType::Bf16,
            LayoutKind::PageFirst,
            KvKind::Mha {
                heads: 8,
                head_dim: 128,
            },
            32,
            4,
        )
    }

    #[test]
    fn chain_is_prefix_stable() {
        let h = PageHasher::new(HashMode::Namespaced, &ns()).unwrap();
        let start = h.chain_start(None, None);
        let toks: Vec<u32> = (0..16).collect();
        let all = h.hash_pages(start.prior, &toks);
        assert_eq!(all.len(), 4);
        let first_two = h.hash_pages(start.prior, &toks[..8]);
        assert_eq!(&all[..2], &first_two[..]);
        let rest = h.hash_pages(Some(all[1]), &toks[8..]);
        assert_eq!(&all[2..], &rest[..]);
    }

    #[test]
    fn tenants_and_namespaces_never_collide() {
        let h = PageHasher::new(HashMode::Namespaced, &ns()).unwrap();
        let toks: Vec<u32> = (0..4).collect();
        let a = h.chain_start(Some("lora-a"), None);
        let b = h.chain_start(Some("lora-b"), None);
        let c = h.chain_start(None, Some("lora-a"));
        assert_ne!(a.namespace_id, b.namespace_id);
        assert_ne!(a.namespace_id, c.namespace_id);
        assert_ne!(h.hash_pages(a.prior, &toks), h.hash_pages(b.prior, &toks));
        let mut other = ns();
        other.layout = LayoutKind::LayerFirst;
        let h2 = PageHasher::new(HashMode::Namespaced, &other).unwrap();
        assert_ne!(
            h.chain_start(None, None).namespace_id,
            h2.chain_start(None, None).namespace_id
        );
    }

    #[test]
    fn sglang_mode_has_no_seed_but_keeps_namespace_ids_apart() {
        let h = PageHasher::new(HashMode::Sglang, &ns()).unwrap();
        let a = h.chain_start(Some("x"), None);
        let b = h.chain_start(Some("y"), None);
        assert_eq!(a.prior, None);
        assert_ne!(a.namespace_id, b.namespace_id);
    }

    #[test]
    fn mla_namespaces_ignore_tp_rank() {
        let mut a = ns();
        a.kv = KvKind::Mla { kv_dim: 576 };
        a.tp_size = 8;
        a.tp_rank = 3;
        let mut b = a.clone();
        b.tp_rank = 5;
        assert_eq!(a.digest(), b.digest());
        let mut m = ns();
        m.tp_size = 2;
        let mut m2 = m.clone();
        m2.tp_rank = 1;
        assert_ne!(m.digest(), m2.digest());
    }

    #[test]
    fn bad_ranks_are_rejected() {
        let mut a = ns();
        a.tp_rank = 1;
        assert!(PageHasher::new(HashMode::Namespaced, &a).is_err());
        a.tp_rank = 0;
        a.page_size = 0;
        assert!(PageHasher::new(HashMode::Namespaced, &a).is_err());
        assert!(PageHasher::sglang(0).is_err());
    }
}
