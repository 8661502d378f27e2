//! Plain descriptors of KV cache shapes and host layouts, shared by the host pool, the device
//! pool, the transfer engine and L3 (which stores the layout tag with every page).
//!
//! A *page* is `page_size` consecutive tokens. Its KV for all layers is
//! [`KvShape::page_bytes`] bytes; how those bytes are arranged in host memory is the
//! [`LayoutKind`].

use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};

/// Element type of the KV cache.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// 8-bit float, e4m3.
    Fp8E4m3,
    /// 8-bit float, e5m2.
    Fp8E5m2,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Fp8E4m3 | DType::Fp8E5m2 => 1,
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }

    /// Stable one-byte tag (stored in namespace digests and L3 page headers).
    pub fn tag(self) -> u8 {
        match self {
            DType::Fp8E4m3 => 1,
            DType::Fp8E5m2 => 2,
            DType::Bf16 => 3,
            DType::F16 => 4,
            DType::F32 => 5,
        }
    }
}

/// How a page's bytes are arranged in the host pool (and therefore in L3).
///
/// `K`/`V` below are the two halves of MHA; MLA has one latent buffer and no V.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayoutKind {
    /// `[K|V][layer][token][row]`: same as the GPU pool; a page is `layers` separate runs per
    /// half.
    LayerFirst,
    /// `[K|V][token][layer][row]`: a page's K (and its V) for every layer is one contiguous run,
    /// token-major. What L3 zero-copy wants. SGLang's default.
    #[default]
    PageFirst,
    /// `[K|V][page][layer][token-in-page][row]`: contiguous per page, layer-major inside the
    /// page, so each (page, layer) is one contiguous run: memcpy-only transfers.
    PageFirstDirect,
}

impl LayoutKind {
    /// Stable one-byte tag (stored in namespace digests and L3 page headers).
    pub fn tag(self) -> u8 {
        match self {
            LayoutKind::LayerFirst => 1,
            LayoutKind::PageFirst => 2,
            LayoutKind::PageFirstDirect => 3,
        }
    }

    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            LayoutKind::LayerFirst => "layer_first",
            LayoutKind::PageFirst => "page_first",
            LayoutKind::PageFirstDirect => "page_first_direct",
        }
    }

    /// Every layout.
    pub const ALL: [LayoutKind; 3] = [
        LayoutKind::LayerFirst,
        LayoutKind::PageFirst,
        LayoutKind::PageFirstDirect,
    ];
}

/// Attention flavour of the KV cache.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum KvKind {
    /// Multi-head (or grouped-query) attention: separate K and V, each `heads × head_dim`
    /// elements per token and layer.
    Mha {
        /// KV heads held by this rank.
        heads: u32,
        /// Elements per head.
        head_dim: u32,
    },
    /// Multi-head latent attention: one latent row of `kv_dim` elements per token and layer
    /// (e.g. 576 = 512 + 64 for DeepSeek-V3).
    Mla {
        /// Elements of the latent row.
        kv_dim: u32,
    },
}

/// The shape of one rank's KV cache.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvShape {
    /// MHA or MLA, with its per-token row shape.
    pub kind: KvKind,
    /// Number of layers.
    pub layers: u32,
    /// Element type.
    pub dtype: DType,
    /// Tokens per page.
    pub page_size: u32,
}

impl KvShape {
    /// Llama-3-8B on one rank: 32 layers, 8 KV heads of 128, bf16.
    pub fn llama3_8b(page_size: u32) -> Self {
        Self {
            kind: KvKind::Mha {
                heads: 8,
                head_dim: 128,
            },
            layers: 32,
            dtype: DType::Bf16,
            page_size,
        }
    }

    /// DeepSeek-V3 MLA: 61 layers, 576-wide latent, bf16.
    pub fn deepseek_v3_mla(page_size: u32) -> Self {
        Self {
            kind: KvKind::Mla { kv_dim: 576 },
            layers: 61,
            dtype: DType::Bf16,
            page_size,
        }
    }

    /// Checks that every dimension is non-zero and the sizes fit in memory arithmetic.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, v: u32| CoreError::InvalidPolicy {
            field,
            value: v.to_string(),
            reason: "must be at least 1",
        };
        if self.page_size == 0 || self.page_size > 65536 {
            return Err(CoreError::BadPageSize(self.page_size));
        }
        if self.layers == 0 {
            return Err(bad("layers", 0));
        }
        match self.kind {
            KvKind::Mha { heads, head_dim } => {
                if heads == 0 {
                    return Err(bad("heads", 0));
                }
                if head_dim == 0 {
                    return Err(bad("head_dim", 0));
                }
            }
            KvKind::Mla { kv_dim } => {
                if kv_dim == 0 {
                    return Err(bad("kv_dim", 0));
                }
            }
        }
        Ok(())
    }

    /// Number of halves: 2 (K and V) for MHA, 1 for MLA.
    pub fn halves(&self) -> usize {
        match self.kind {
            KvKind::Mha { .. } => 2,
            KvKind::Mla { .. } => 1,
        }
    }

    /// Bytes of one token's row in one layer and one half (`heads·head_dim·elem` or
    /// `kv_dim·elem`). SGLang calls this the element size of the transfer kernels.
    pub fn row_bytes(&self) -> usize {
        let elems = match self.kind {
            KvKind::Mha { heads, head_dim } => heads as usize * head_dim as usize,
            KvKind::Mla { kv_dim } => kv_dim as usize,
        };
        elems * self.dtype.size()
    }

    /// Bytes of one page in one layer and one half.
    pub fn page_layer_bytes(&self) -> usize {
        self.row_bytes() * self.page_size as usize
    }

    /// Bytes of one token across all layers and halves.
    pub fn token_bytes(&self) -> usize {
        self.row_bytes() * self.layers as usize * self.halves()
    }

    /// Bytes of one whole page (all layers, all halves).
    pub fn page_bytes(&self) -> usize {
        self.token_bytes() * self.page_size as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_page_is_8_mib() {
        let s = KvShape::llama3_8b(64);
        assert_eq!(s.row_bytes(), 2048);
        assert_eq!(s.page_bytes(), 8 << 20);
        assert_eq!(s.halves(), 2);
    }

    #[test]
    fn deepseek_row_is_1152_bytes() {
        let s = KvShape::deepseek_v3_mla(64);
        assert_eq!(s.row_bytes(), 1152);
        assert_eq!(s.page_bytes(), 1152 * 61 * 64);
    }

    #[test]
    fn zero_dimensions_are_rejected() {
        let mut s = KvShape::llama3_8b(0);
        assert_eq!(s.validate(), Err(CoreError::BadPageSize(0)));
        s.page_size = 16;
        s.layers = 0;
        assert!(s.validate().is_err());
        assert!(KvShape::llama3_8b(16).validate().is_ok());
    }

    #[test]
    fn layouts_serialise_as_config_names() {
        for l in LayoutKind::ALL {
            let j = serde_json::to_string(&l).unwrap();
            assert_eq!(j, format!("\"{}\"", l.as_str()));
        }
    }
}
