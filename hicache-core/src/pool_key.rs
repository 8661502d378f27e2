//! The namespaces of SGLang's sidecar host pools (the v2 multi-pool interface of hybrid
//! models): each pool's geometry [`PoolFingerprint`], its deployment [`PoolDeployment`], and
//! the [`NamespaceId`] its pages are stored under ([`pool_namespace_id`]), exactly as the
//! Python package derives them.
//!
//! Above both [`key`](crate::key) (the identities) and [`hash`](crate::hash) (the chain that
//! derives a namespace id), so that neither of those imports the other.

use crate::error::Result;
use crate::key::NamespaceId;
use crate::layout::{DType, LayoutKind};

/// torch's spelling of a dtype (`str(torch.bfloat16)`), as SGLang's host pools report it.
pub fn torch_dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::Fp8E4m3 => "torch.float8_e4m3fn",
        DType::Fp8E5m2 => "torch.float8_e5m2",
        DType::Bf16 => "torch.bfloat16",
        DType::F16 => "torch.float16",
        DType::F32 => "torch.float32",
    }
}

/// How the Python package moves a sidecar pool's page: through the pool's pieces (zero copy)
/// or as one copy of SGLang's flat data page (pools SGLang gives no pieces for).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PoolPieces {
    /// Byte sizes of one page's pieces, in SGLang's order (`get_page_buffer_meta`).
    Pieces(Vec<u64>),
    /// Bytes of SGLang's flat data page (`get_data_page`).
    Flat(u64),
}

/// The geometry fingerprint of one SGLang host pool, as `hicache_rs.pools.PoolAdapter`
/// writes it (`_fingerprint`): every field SGLang's pool object shows, spelled as Python
/// spells it. The Python package hashes the *string* ([`PoolFingerprint::render`]), which
/// names SGLang's pool class; this type holds that class name as an explicit field, so no
/// SGLang object is needed. [`PoolFingerprint::swa_mha`] and [`PoolFingerprint::mamba`]
/// fill it exactly as SGLang's `MHATokenToKVPoolHost` and `MambaPoolHost` do.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolFingerprint {
    /// SGLang's `PoolName` value (`swa`, `mamba`, ...).
    pub pool: String,
    /// SGLang's host pool class name (`type(pool).__name__`).
    pub class: String,
    /// The pool's layout string.
    pub layout: String,
    /// Tokens per page (1 for Mamba state slots).
    pub page_size: u32,
    /// The pieces of a page, or the flat page's size.
    pub pieces: PoolPieces,
    /// `(attribute, Python str of its value)` for each of the package's `GEOMETRY_ATTRS` the
    /// pool has, in that tuple's order (`dtype`, `temporal_dtype`, `conv_dtype`,
    /// `indexer_dtype`, `layer_num`, `head_num`, `head_dim`, `v_head_dim`, `kv_cache_dim`,
    /// `item_bytes`, `state_page_bytes`, `row_bytes`, `storage_format_tag`).
    pub attrs: Vec<(String, String)>,
}

impl PoolFingerprint {
    /// SGLang's sliding-window host pool (an `MHATokenToKVPoolHost` of the SWA layers),
    /// registered under `swa`: pieces are K and V of the whole page for `page_first` and
    /// `page_first_direct`, and `K_l, V_l` for every layer for `layer_first`.
    pub fn swa_mha(
        layout: LayoutKind,
        page_size: u32,
        layers: u32,
        heads: u32,
        head_dim: u32,
        v_head_dim: u32,
        dtype: DType,
    ) -> Self {
        let row = |dim: u32| u64::from(page_size) * u64::from(heads) * u64::from(dim);
        let (k, v) = (row(head_dim), row(v_head_dim));
        let d = dtype.size() as u64;
        let pieces = match layout {
            LayoutKind::LayerFirst => (0..layers).flat_map(|_| [k * d, v * d]).collect(),
            LayoutKind::PageFirst | LayoutKind::PageFirstDirect => {
                let l = u64::from(layers);
                vec![k * l * d, v * l * d]
            }
        };
        let attrs = [
            ("dtype", torch_dtype_name(dtype).to_string()),
            ("layer_num", layers.to_string()),
            ("head_num", heads.to_string()),
            ("head_dim", head_dim.to_string()),
            ("v_head_dim", v_head_dim.to_string()),
        ];
        Self::with_attrs(
            "swa",
            "MHATokenToKVPoolHost",
            layout,
            page_size,
            pieces,
            &attrs,
        )
    }

    /// SGLang's Mamba state pool (`MambaPoolHost`, page size 1: one slot per state), registered
    /// under `mamba`, without slot side states. `temporal_elems` / `conv_elems` are the
    /// elements of one layer's temporal state and of each conv state; a temporal state of 0
    /// elements (conv-only models) has no piece, as SGLang drops it. SGLang's `dtype` of the
    /// pool is the conv dtype.
    pub fn mamba(
        layout: LayoutKind,
        layers: u32,
        temporal_elems: u64,
        temporal_dtype: DType,
        conv_elems: &[u64],
        conv_dtype: DType,
    ) -> Self {
        let l = u64::from(layers);
        let temporal = temporal_elems * l * temporal_dtype.size() as u64;
        let pieces = (temporal > 0)
            .then_some(temporal)
            .into_iter()
            .chain(conv_elems.iter().map(|&c| c * l * conv_dtype.size() as u64))
            .collect();
        let attrs = [
            ("dtype", torch_dtype_name(conv_dtype).to_string()),
            (
                "temporal_dtype",
                torch_dtype_name(temporal_dtype).to_string(),
            ),
            ("conv_dtype", torch_dtype_name(conv_dtype).to_string()),
        ];
        Self::with_attrs("mamba", "MambaPoolHost", layout, 1, pieces, &attrs)
    }

    fn with_attrs(
        pool: &str,
        class: &str,
        layout: LayoutKind,
        page_size: u32,
        pieces: Vec<u64>,
        attrs: &[(&str, String)],
    ) -> Self {
        Self {
            pool: pool.to_string(),
            class: class.to_string(),
            layout: layout.as_str().to_string(),
            page_size,
            pieces: PoolPieces::Pieces(pieces),
            attrs: attrs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        }
    }

    /// The fingerprint string, byte for byte as `PoolAdapter._fingerprint` returns it.
    pub fn render(&self) -> String {
        let join = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        let pieces = match &self.pieces {
            PoolPieces::Pieces(p) => format!("pieces={}", join(p)),
            PoolPieces::Flat(n) => format!("flat={n}"),
        };
        let mut parts = vec![
            format!("pool={}", self.pool),
            format!("class={}", self.class),
            format!("layout={}", self.layout),
            format!("page={}", self.page_size),
            pieces,
        ];
        parts.extend(self.attrs.iter().map(|(k, v)| format!("{k}={v}")));
        parts.join("|")
    }

    /// The layout the namespace names: the pool's own when it is one of ours, else
    /// `page_first` (the package's `namespace_layout`).
    pub fn namespace_layout(&self) -> LayoutKind {
        LayoutKind::ALL
            .into_iter()
            .find(|l| l.as_str() == self.layout)
            .unwrap_or(LayoutKind::PageFirst)
    }

    /// Bytes of one stored page (the sum of the pieces, or the flat page).
    pub fn page_bytes(&self) -> u64 {
        match &self.pieces {
            PoolPieces::Pieces(p) => p.iter().sum(),
            PoolPieces::Flat(n) => *n,
        }
    }

    /// Whether the pool's pages are per TP rank: every pool of an MHA model, and Mamba state
    /// on an MLA model too (the package's `sharded`, after SGLang's HiCacheFile).
    pub fn sharded(&self, is_mla_model: bool) -> bool {
        !is_mla_model || self.pool == "mamba"
    }
}

/// The deployment fields of a sidecar pool's namespace (SGLang's `HiCacheStorageConfig` plus
/// the package's `tenant`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolDeployment {
    /// SGLang's `model_name` (empty when it has none).
    pub model: String,
    /// Whether the model is MLA (`is_mla_model`): its non-Mamba pools are shared by TP ranks.
    pub is_mla_model: bool,
    /// TP rank and size.
    pub tp: (u32, u32),
    /// PP rank and size.
    pub pp: (u32, u32),
    /// Attention context-parallel rank and size (`attn_cp_rank`, `attn_cp_size`).
    pub cp: (u32, u32),
    /// The package's `tenant` extra-config field (salts the namespace).
    pub tenant: Option<String>,
}

impl PoolDeployment {
    /// One rank, no context parallelism, no tenant.
    pub fn single_rank(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            is_mla_model: false,
            tp: (0, 1),
            pp: (0, 1),
            cp: (0, 1),
            tenant: None,
        }
    }
}

/// The namespace a sidecar pool's pages are stored under, as the Python package derives it
/// (`HiCacheRsStorage._pool_namespace`): an SGLang-mode namespace of `model`, `bfloat16`, the
/// pool's namespace layout, one head of width 1 and one layer (MLA-shaped, so without TP
/// rank, when the pool is not [sharded](PoolFingerprint::sharded)), the pool's page size,
/// TP and PP, with the extra key `v2|<fingerprint>` (then `|cp<rank>/<size>` when context
/// parallel) and the tenant as cache salt.
///
/// A page of the pool is stored under [`PageKey::new`]`(namespace, hash)` with SGLang's page
/// hash (the same key as the Full KV page of those tokens).
pub fn pool_namespace_id(fp: &PoolFingerprint, dep: &PoolDeployment) -> Result<NamespaceId> {
    use crate::hash::{HashMode, Namespace, PageHasher};
    use crate::layout::KvKind;
    let kv = if fp.sharded(dep.is_mla_model) {
        KvKind::Mha {
            heads: 1,
            head_dim: 1,
        }
    } else {
        KvKind::Mla { kv_dim: 1 }
    };
    let mut ns = Namespace::single_rank(
        dep.model.clone(),
        DType::Bf16,
        fp.namespace_layout(),
        kv,
        1,
        fp.page_size,
    );
    (ns.tp_rank, ns.tp_size) = dep.tp;
    (ns.pp_rank, ns.pp_size) = dep.pp;
    let mut extra = format!("v2|{}", fp.render());
    if dep.cp.1 > 1 {
        extra.push_str(&format!("|cp{}/{}", dep.cp.0, dep.cp.1));
    }
    let hasher = PageHasher::new(HashMode::Sglang, &ns)?;
    Ok(hasher
        .chain_start(Some(&extra), dep.tenant.as_deref())
        .namespace_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The expected fingerprints and namespace ids below were obtained by running the Python
    // package (bindings/python, identical to the installed `hicache_rs` of
    // target/python-venv) on SGLang 0.5.23's real host pools built on CPU by
    // bindings/python/tests/sglang_pools.py (`swa_pool`, `mamba_pool`): `PoolAdapter(name,
    // pool).fingerprint`, then `_native.namespace_id` called with exactly the arguments of
    // `HiCacheRsStorage._pool_namespace`.

    fn swa(layout: LayoutKind) -> PoolFingerprint {
        PoolFingerprint::swa_mha(layout, 4, 2, 1, 16, 16, DType::Bf16)
    }

    fn mamba_3l() -> PoolFingerprint {
        // mamba_pool(layers=3, temporal=(2, 4, 8), convs=((16, 4),), temporal_dtype=bf16)
        PoolFingerprint::mamba(
            LayoutKind::PageFirst,
            3,
            64,
            DType::Bf16,
            &[64],
            DType::Bf16,
        )
    }

    #[test]
    fn fingerprints_match_the_python_package() {
        assert_eq!(
            swa(LayoutKind::PageFirst).render(),
            "pool=swa|class=MHATokenToKVPoolHost|layout=page_first|page=4|pieces=256,256|\
             dtype=torch.bfloat16|layer_num=2|head_num=1|head_dim=16|v_head_dim=16"
        );
        assert_eq!(
            swa(LayoutKind::LayerFirst).render(),
            "pool=swa|class=MHATokenToKVPoolHost|layout=layer_first|page=4|\
             pieces=128,128,128,128|dtype=torch.bfloat16|layer_num=2|head_num=1|head_dim=16|\
             v_head_dim=16"
        );
        // mamba_pool(layers=2, temporal=(4, 8) f32, convs=((6, 3), (5,)) bf16)
        for (layout, name) in [
            (LayoutKind::PageFirst, "page_first"),
            (LayoutKind::PageFirstDirect, "page_first_direct"),
        ] {
            let fp = PoolFingerprint::mamba(layout, 2, 32, DType::F32, &[18, 5], DType::Bf16);
            assert_eq!(
                fp.render(),
                format!(
                    "pool=mamba|class=MambaPoolHost|layout={name}|page=1|pieces=256,72,20|\
                     dtype=torch.bfloat16|temporal_dtype=torch.float32|conv_dtype=torch.bfloat16"
                )
            );
            assert_eq!(fp.page_bytes(), 348);
        }
        assert_eq!(
            mamba_3l().render(),
            "pool=mamba|class=MambaPoolHost|layout=page_first|page=1|pieces=384,384|\
             dtype=torch.bfloat16|temporal_dtype=torch.bfloat16|conv_dtype=torch.bfloat16"
        );
        let conv_only =
            PoolFingerprint::mamba(LayoutKind::PageFirst, 2, 0, DType::F32, &[5], DType::Bf16);
        assert_eq!(conv_only.pieces, PoolPieces::Pieces(vec![20]));
    }

    #[test]
    fn namespaces_match_the_python_package() {
        let mut dep = PoolDeployment::single_rank("Qwen/Qwen3.5-9B");
        dep.tp = (1, 2);
        assert_eq!(
            pool_namespace_id(&mamba_3l(), &dep).unwrap().to_hex(),
            "704e48a0005a42adc8b8168fec6b76b2"
        );
        dep.pp = (1, 2);
        dep.cp = (1, 4);
        dep.tenant = Some("acme".into());
        assert_eq!(
            pool_namespace_id(&mamba_3l(), &dep).unwrap().to_hex(),
            "4284e88a8ff5768e0da14e7dd708f0e1"
        );
        let gemma = PoolFingerprint::swa_mha(LayoutKind::PageFirst, 16, 5, 4, 64, 64, DType::Bf16);
        assert_eq!(gemma.pieces, PoolPieces::Pieces(vec![40960, 40960]));
        let mut dep = PoolDeployment::single_rank("google/gemma-3");
        dep.tenant = Some("t1".into());
        assert_eq!(
            pool_namespace_id(&gemma, &dep).unwrap().to_hex(),
            "b773f53cd00cad85e0b9433e94ba607b"
        );
        let direct =
            PoolFingerprint::swa_mha(LayoutKind::PageFirstDirect, 64, 1, 2, 8, 8, DType::F16);
        assert_eq!(
            direct.render(),
            "pool=swa|class=MHATokenToKVPoolHost|layout=page_first_direct|page=64|\
             pieces=2048,2048|dtype=torch.float16|layer_num=1|head_num=2|head_dim=8|v_head_dim=8"
        );
        assert_eq!(
            pool_namespace_id(&direct, &PoolDeployment::single_rank(""))
                .unwrap()
                .to_hex(),
            "f9efb9e2e841943c77a5ebce644a34a4"
        );
    }

    #[test]
    fn mla_models_share_sidecars_across_tp_but_not_mamba() {
        let mut dep = PoolDeployment::single_rank("m");
        dep.is_mla_model = true;
        dep.tp = (0, 2);
        let a = pool_namespace_id(&swa(LayoutKind::PageFirst), &dep).unwrap();
        dep.tp = (1, 2);
        let b = pool_namespace_id(&swa(LayoutKind::PageFirst), &dep).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.to_hex(), "be6ab7febeab6a6950aff2eb499a3a1b");
        let m = pool_namespace_id(&mamba_3l(), &dep).unwrap();
        dep.tp = (0, 2);
        assert_ne!(m, pool_namespace_id(&mamba_3l(), &dep).unwrap());
        dep.tp = (2, 2);
        assert!(pool_namespace_id(&mamba_3l(), &dep).is_err());
    }

    #[test]
    fn unknown_layouts_name_page_first_and_flat_pages_render() {
        let mut fp = swa(LayoutKind::PageFirst);
        fp.layout = "page_head".into();
        fp.pieces = PoolPieces::Flat(512);
        assert_eq!(fp.namespace_layout(), LayoutKind::PageFirst);
        assert!(fp.render().contains("|layout=page_head|page=4|flat=512|"));
        assert_eq!(fp.page_bytes(), 512);
    }
}
