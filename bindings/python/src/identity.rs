//! The identity SGLang's page hashes lack, added back as our namespace.
//!
//! SGLang's storage keys are content hashes of the token chain only: no model, rank, layout,
//! dtype or geometry. Two deployments whose pages differ in any of these must never read each
//! other's pages, so every key is paired with a [`NamespaceId`] derived from all of them
//! (and from the tenant: an extra key such as a LoRA id, and a cache salt). For MLA the TP rank
//! is dropped (the latent cache is the same on every rank; see
//! [`Namespace::normalized`](hicache_core::Namespace::normalized)).

use hicache_core::{DType, FORMAT_VERSION, HashMode, KvKind, LayoutKind, Namespace, PageHasher};

use crate::error::{BindingError, Result};

/// Parses a layout spelling (`layer_first`, `page_first`, `page_first_direct`).
pub fn layout(s: &str) -> Result<LayoutKind> {
    LayoutKind::ALL
        .into_iter()
        .find(|l| l.as_str() == s)
        .ok_or_else(|| BindingError::Unsupported {
            what: "layout",
            value: s.to_string(),
            expected: "layer_first, page_first, page_first_direct",
        })
}

/// Parses a dtype spelling, with or without torch's `torch.` prefix.
pub fn dtype(s: &str) -> Result<DType> {
    Ok(match s.strip_prefix("torch.").unwrap_or(s) {
        "bfloat16" | "bf16" => DType::Bf16,
        "float16" | "half" | "f16" => DType::F16,
        "float32" | "float" | "f32" => DType::F32,
        "float8_e4m3fn" | "fp8_e4m3" => DType::Fp8E4m3,
        "float8_e5m2" | "fp8_e5m2" => DType::Fp8E5m2,
        _ => {
            return Err(BindingError::Unsupported {
                what: "dtype",
                value: s.to_string(),
                expected: "bfloat16, float16, float32, float8_e4m3fn, float8_e5m2",
            });
        }
    })
}

/// Everything that makes one rank's pages differ from another's, as SGLang describes it.
#[derive(Clone, Debug)]
pub struct Identity {
    /// Served model name (SGLang's `model_name`, with its storage format tag).
    pub model: String,
    /// Element type name.
    pub dtype: String,
    /// Host layout name.
    pub layout: String,
    /// `true` for MLA (one latent row per token and layer).
    pub mla: bool,
    /// MHA heads on this rank (1 for MLA).
    pub heads: u32,
    /// MHA head dim, or the MLA latent width.
    pub head_dim: u32,
    /// Layers on this rank.
    pub layers: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// TP rank and size.
    pub tp: (u32, u32),
    /// PP rank and size.
    pub pp: (u32, u32),
}

impl Identity {
    /// The validated namespace.
    pub fn namespace(&self) -> Result<Namespace> {
        let kv = if self.mla {
            KvKind::Mla {
                kv_dim: self.head_dim,
            }
        } else {
            KvKind::Mha {
                heads: self.heads,
                head_dim: self.head_dim,
            }
        };
        let ns = Namespace {
            model: self.model.clone(),
            dtype: dtype(&self.dtype)?,
            layout: layout(&self.layout)?,
            kv,
            layers: self.layers,
            page_size: self.page_size,
            tp_rank: self.tp.0,
            tp_size: self.tp.1,
            pp_rank: self.pp.0,
            pp_size: self.pp.1,
            format_version: FORMAT_VERSION,
        };
        ns.validate()?;
        Ok(ns)
    }

    /// The 32-hex namespace id of this identity for a tenant (extra key, cache salt).
    pub fn namespace_id(
        &self,
        extra_key: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<String> {
        let hasher = PageHasher::new(HashMode::Sglang, &self.namespace()?)?;
        Ok(hasher
            .chain_start(extra_key, cache_salt)
            .namespace_id
            .to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mha() -> Identity {
        Identity {
            model: "m".into(),
            dtype: "torch.bfloat16".into(),
            layout: "page_first".into(),
            mla: false,
            heads: 8,
            head_dim: 128,
            layers: 32,
            page_size: 64,
            tp: (0, 2),
            pp: (0, 1),
        }
    }

    type Edit = Box<dyn Fn(&mut Identity)>;

    #[test]
    fn every_field_changes_the_namespace() {
        let base = mha().namespace_id(None, None).unwrap();
        let variants: Vec<Edit> = vec![
            Box::new(|i| i.model = "other".into()),
            Box::new(|i| i.dtype = "float16".into()),
            Box::new(|i| i.layout = "layer_first".into()),
            Box::new(|i| i.heads = 4),
            Box::new(|i| i.head_dim = 64),
            Box::new(|i| i.layers = 16),
            Box::new(|i| i.page_size = 32),
            Box::new(|i| i.tp = (1, 2)),
            Box::new(|i| i.pp = (0, 2)),
        ];
        for (n, v) in variants.iter().enumerate() {
            let mut i = mha();
            v(&mut i);
            assert_ne!(i.namespace_id(None, None).unwrap(), base, "variant {n}");
        }
        assert_ne!(mha().namespace_id(Some("lora"), None).unwrap(), base);
        assert_ne!(mha().namespace_id(None, Some("salt")).unwrap(), base);
        assert_eq!(mha().namespace_id(None, None).unwrap(), base);
    }

    #[test]
    fn mla_ranks_share_a_namespace() {
        let mut a = mha();
        a.mla = true;
        a.heads = 1;
        a.head_dim = 576;
        let mut b = a.clone();
        b.tp = (1, 2);
        assert_eq!(
            a.namespace_id(None, None).unwrap(),
            b.namespace_id(None, None).unwrap()
        );
    }

    #[test]
    fn bad_names_and_ranks_are_errors_that_name_them() {
        let mut i = mha();
        i.dtype = "torch.uint8".into();
        assert!(
            i.namespace_id(None, None)
                .unwrap_err()
                .to_string()
                .contains("torch.uint8")
        );
        let mut i = mha();
        i.layout = "page_head".into();
        assert!(
            i.namespace_id(None, None)
                .unwrap_err()
                .to_string()
                .contains("page_head")
        );
        let mut i = mha();
        i.tp = (2, 2);
        assert!(
            i.namespace_id(None, None)
                .unwrap_err()
                .to_string()
                .contains("tp_rank")
        );
    }
}
