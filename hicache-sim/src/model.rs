//! The model the engine simulates: its KV shape (page sizes) and a compute-time model (how
//! long prefill, decode and transfers take on the device), so that time-to-first-token can be
//! estimated with and without each cache tier.
//!
//! # Defaults (Llama-3-8B on one H100 SXM)
//!
//! Every default is derived from public figures, and each can be overridden:
//!
//! - **Prefill, linear part**: `2 · params` FLOPs per token (one multiply-add per weight) at
//!   50% of the H100 SXM's 989 TFLOP/s dense BF16 peak (NVIDIA datasheet): 8.03 B parameters →
//!   32.5 µs per token (≈ 31k tokens/s, the range public SGLang/vLLM prefill throughputs for an
//!   8B model on one H100 report).
//! - **Prefill, attention**: `4 · q_heads · head_dim · layers` FLOPs per (query token, key
//!   position) pair (QKᵀ and PV), at the same rate: 1.06 ns per pair for Llama-3-8B. A token at
//!   position `i` attends to `i + 1` positions (causal), cached ones included.
//! - **Decode step**: every weight read once from HBM (`2 · params` bytes in bf16) plus every
//!   running request's KV (`token_bytes` per context token), at 80% of the H100 SXM's
//!   3.35 TB/s: 6.0 ms per step + 49 ns per context token.
//! - **L2 → L1 loads**: 50 GB/s (92% of the 54.3 GB/s bulk pinned H2D copy measured on our H100,
//!   PCIe 5.0 x16; see "Machines" in `docs/benchmarks.md`), overlapped layer by layer with the
//!   forward.
//! - **L1 → L2 write-through copies (D2H)**: 50 GB/s (95% of the 52.7 GB/s bulk pinned D2H
//!   copy measured on our H100), on their own link (PCIe is full duplex); see [`crate::links`].
//! - **L3 → L2 prefetch and L2 → L3 backup**: 12 GB/s after 0.5 ms (a 100 Gb/s RDMA link, 12.5 GB/s line rate, as
//!   Mooncake and 3FS deployments use; about two PCIe 4.0 NVMe drives), one link shared by all
//!   prefetches (each starting when its request arrives) and backups.
//! - **Step overhead**: 0 (scheduling and launch costs are not modelled unless asked).

use hicache_core::{DType, KvKind, KvShape};
use hicache_host::MambaShape;
use serde::Serialize;

/// The shape of the simulated model on one rank.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelShape {
    /// Display name.
    pub name: String,
    /// Transformer layers.
    pub layers: u32,
    /// Query heads (attention FLOPs).
    pub q_heads: u32,
    /// KV heads (KV bytes).
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// KV element type.
    pub dtype: DType,
    /// Parameters (weights FLOPs and bytes).
    pub params: f64,
}

impl ModelShape {
    /// Llama-3-8B: 32 layers, 32 query heads, 8 KV heads of 128, bf16, 8.03 B parameters.
    pub fn llama3_8b() -> Self {
        Self {
            name: "llama3-8b".into(),
            layers: 32,
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
            dtype: DType::Bf16,
            params: 8.03e9,
        }
    }

    /// The KV shape with `page_size` tokens per page.
    pub fn kv_shape(&self, page_size: u32) -> KvShape {
        KvShape {
            kind: KvKind::Mha {
                heads: self.kv_heads,
                head_dim: self.head_dim,
            },
            layers: self.layers,
            dtype: self.dtype,
            page_size,
        }
    }

    /// KV bytes of one token (all layers, K and V).
    pub fn token_bytes(&self) -> u64 {
        self.kv_shape(1).token_bytes() as u64
    }
}

/// Costs of the simulated device, in seconds and bytes per second.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ComputeModel {
    /// Prefill time per computed token, excluding attention.
    pub prefill_s_per_token: f64,
    /// Attention time per (query token, key position) pair of the full-attention layers; 0
    /// turns the quadratic term off.
    pub attention_s_per_pair: f64,
    /// Attention time per (query token, key position) pair of the sliding-window layers, whose
    /// queries see at most [`attention_window`](Self::attention_window) keys (0 for a dense
    /// model).
    #[serde(default)]
    pub window_attention_s_per_pair: f64,
    /// Keys a sliding-window layer's query sees (0: no sliding-window layers).
    #[serde(default)]
    pub attention_window: usize,
    /// Decode time per step, excluding KV reads.
    pub decode_s_per_step: f64,
    /// Decode time per step per context token of every running request (KV reads).
    pub decode_s_per_context_token: f64,
    /// Decode time per step per running request whatever its length (a hybrid model's
    /// sliding-window KV and linear-attention state; 0 for a dense model).
    #[serde(default)]
    pub decode_s_per_request: f64,
    /// Fixed time added to every forward step.
    pub step_overhead_s: f64,
    /// L2 → L1 bandwidth.
    pub h2d_bytes_per_s: f64,
    /// L1 → L2 bandwidth (write-through copies).
    pub d2h_bytes_per_s: f64,
    /// L3 ↔ L2 bandwidth (one link shared by every prefetch and backup).
    pub l3_bytes_per_s: f64,
    /// Latency before a prefetch's first byte.
    pub l3_latency_s: f64,
}

/// H100 SXM dense BF16 peak, FLOP/s.
pub const H100_PEAK_FLOPS: f64 = 989e12;
/// H100 SXM HBM3 bandwidth, bytes/s.
pub const H100_HBM_BYTES_PER_S: f64 = 3.35e12;
/// Fraction of peak FLOP/s prefill achieves.
pub const PREFILL_MFU: f64 = 0.5;
/// Fraction of HBM bandwidth decode achieves.
pub const DECODE_BW_EFFICIENCY: f64 = 0.8;

impl ComputeModel {
    /// The defaults of the module documentation for `model` on one H100 SXM.
    pub fn h100(model: &ModelShape) -> Self {
        let flops = H100_PEAK_FLOPS * PREFILL_MFU;
        let hbm = H100_HBM_BYTES_PER_S * DECODE_BW_EFFICIENCY;
        let weight_bytes = model.params * model.dtype.size() as f64;
        Self {
            prefill_s_per_token: 2.0 * model.params / flops,
            attention_s_per_pair: 4.0
                * model.q_heads as f64
                * model.head_dim as f64
                * model.layers as f64
                / flops,
            window_attention_s_per_pair: 0.0,
            attention_window: 0,
            decode_s_per_step: weight_bytes / hbm,
            decode_s_per_context_token: model.token_bytes() as f64 / hbm,
            decode_s_per_request: 0.0,
            step_overhead_s: 0.0,
            h2d_bytes_per_s: 50e9,
            d2h_bytes_per_s: 50e9,
            l3_bytes_per_s: 12e9,
            l3_latency_s: 0.5e-3,
        }
    }

    /// Checks that every cost is finite and non-negative and every bandwidth positive.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("prefill time per token", self.prefill_s_per_token),
            ("attention time per pair", self.attention_s_per_pair),
            (
                "window attention time per pair",
                self.window_attention_s_per_pair,
            ),
            ("decode time per step", self.decode_s_per_step),
            (
                "decode time per context token",
                self.decode_s_per_context_token,
            ),
            ("decode time per request", self.decode_s_per_request),
            ("step overhead", self.step_overhead_s),
            ("L3 latency", self.l3_latency_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be a finite number ≥ 0, got {v}"));
            }
        }
        for (name, v) in [
            ("H2D bandwidth", self.h2d_bytes_per_s),
            ("D2H bandwidth", self.d2h_bytes_per_s),
            ("L3 bandwidth", self.l3_bytes_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name} must be > 0, got {v}"));
            }
        }
        Ok(())
    }

    /// Compute time of `new` tokens following `cached` tokens already in the KV cache:
    /// the linear part, the full-attention layers' causal pairs, and the sliding-window
    /// layers' pairs capped at the window.
    pub fn prefill_compute(&self, cached: usize, new: usize) -> f64 {
        let (p, n) = (cached as f64, new as f64);
        // Token i (0-based, cached ones first) attends to i + 1 positions:
        // Σ_{i=p}^{p+n−1} (i + 1) = n·p + n(n+1)/2.
        let pairs = n * p + n * (n + 1.0) / 2.0;
        let window_pairs = if self.attention_window == 0 {
            0.0
        } else {
            window_pairs(cached, new, self.attention_window)
        };
        n * self.prefill_s_per_token
            + pairs * self.attention_s_per_pair
            + window_pairs * self.window_attention_s_per_pair
    }

    /// Duration of one decode step over `requests` running requests holding `context_tokens`
    /// tokens in total.
    pub fn decode_step(&self, context_tokens: usize, requests: usize) -> f64 {
        self.step_overhead_s
            + self.decode_s_per_step
            + context_tokens as f64 * self.decode_s_per_context_token
            + requests as f64 * self.decode_s_per_request
    }

    /// These costs with the node's figures of `node`: link bandwidths, L3 latency and step
    /// overhead (a second model on the same node).
    pub fn with_node_of(self, node: &ComputeModel) -> Self {
        Self {
            step_overhead_s: node.step_overhead_s,
            h2d_bytes_per_s: node.h2d_bytes_per_s,
            d2h_bytes_per_s: node.d2h_bytes_per_s,
            l3_bytes_per_s: node.l3_bytes_per_s,
            l3_latency_s: node.l3_latency_s,
            ..self
        }
    }

    /// Duration of one prefill step of `compute` seconds of compute over `layers` layers while
    /// `load_bytes` are loaded layer by layer: loads run back to back from the start of the
    /// step, layer `i`'s compute starts when layer `i − 1`'s ended and layer `i`'s load is done.
    pub fn prefill_step(&self, compute: f64, layers: u32, load_bytes: u64) -> f64 {
        let layers = layers.max(1) as f64;
        let compute_layer = compute / layers;
        let load_layer = load_bytes as f64 / self.h2d_bytes_per_s / layers;
        let mut t = self.step_overhead_s;
        for i in 0..layers as u32 {
            let loaded = (i as f64 + 1.0) * load_layer;
            t = t.max(loaded) + compute_layer;
        }
        t
    }
}

/// The linear-attention (Gated DeltaNet) layers of a Mamba hybrid, in its config's names.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinearAttention {
    /// `linear_num_key_heads` on this rank.
    pub key_heads: u32,
    /// `linear_num_value_heads` on this rank.
    pub value_heads: u32,
    /// `linear_key_head_dim`.
    pub key_head_dim: u32,
    /// `linear_value_head_dim`.
    pub value_head_dim: u32,
    /// `linear_conv_kernel_dim`.
    pub conv_kernel: u32,
    /// Element type of the recurrent (temporal) state (`mamba_ssm_dtype`).
    pub temporal_dtype: DType,
    /// Element type of the conv state (the model's dtype).
    pub conv_dtype: DType,
}

/// A hybrid model on one rank: full-attention layers holding paged KV (the Full component),
/// plus sliding-window layers (the SWA component) or linear-attention layers holding one
/// state per request (the Mamba component).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HybridModel {
    /// Display name.
    pub name: String,
    /// Tensor-parallel ranks the heads are split over (this is one of them).
    pub tp: u32,
    /// Decoder layers in total.
    pub layers: u32,
    /// Full-attention layers (paged KV of every token).
    pub full_layers: u32,
    /// Sliding-window layers (paged KV, only the window needed).
    pub swa_layers: u32,
    /// Linear-attention layers (a fixed-size state per request).
    pub linear_layers: u32,
    /// Query heads of the attention layers on this rank.
    pub q_heads: u32,
    /// KV heads of the attention layers on this rank.
    pub kv_heads: u32,
    /// Elements per attention head.
    pub head_dim: u32,
    /// KV element type.
    pub dtype: DType,
    /// Parameters on this rank.
    pub params: f64,
    /// Sliding window in tokens (with sliding-window layers).
    pub window: Option<u32>,
    /// The linear-attention layers' geometry (with linear-attention layers).
    pub linear: Option<LinearAttention>,
}

impl HybridModel {
    /// Qwen3.5-9B, a Mamba hybrid. Source: the `text_config` of `Qwen/Qwen3.5-9B`'s
    /// `config.json` on Hugging Face: `num_hidden_layers` 32 with `layer_types` three
    /// `linear_attention` then one `full_attention`, repeated (24 Gated DeltaNet + 8
    /// full-attention layers), `num_attention_heads` 16, `num_key_value_heads` 4, `head_dim`
    /// 256, `linear_num_key_heads` 16, `linear_num_value_heads` 32, `linear_key_head_dim` /
    /// `linear_value_head_dim` 128, `linear_conv_kernel_dim` 4, `mamba_ssm_dtype` float32,
    /// bf16 weights; 9 B parameters (its name).
    pub fn qwen35_9b() -> Self {
        Self {
            name: "qwen3.5-9b".into(),
            tp: 1,
            layers: 32,
            full_layers: 8,
            swa_layers: 0,
            linear_layers: 24,
            q_heads: 16,
            kv_heads: 4,
            head_dim: 256,
            dtype: DType::Bf16,
            params: 9e9,
            window: None,
            linear: Some(LinearAttention {
                key_heads: 16,
                value_heads: 32,
                key_head_dim: 128,
                value_head_dim: 128,
                conv_kernel: 4,
                temporal_dtype: DType::F32,
                conv_dtype: DType::Bf16,
            }),
        }
    }

    /// Gemma 3 12B, a sliding-window hybrid. Source: the `text_config` of
    /// `google/gemma-3-12b-it`'s `config.json` on Hugging Face: `num_hidden_layers` 48,
    /// `sliding_window` 1024, `sliding_window_pattern` 6 (five local layers, then one global:
    /// 40 sliding-window + 8 full-attention layers), `num_attention_heads` 16,
    /// `num_key_value_heads` 8, `head_dim` 256, bf16; 12 B parameters (its name).
    pub fn gemma3_12b() -> Self {
        Self {
            name: "gemma3-12b".into(),
            tp: 1,
            layers: 48,
            full_layers: 8,
            swa_layers: 40,
            linear_layers: 0,
            q_heads: 16,
            kv_heads: 8,
            head_dim: 256,
            dtype: DType::Bf16,
            params: 12e9,
            window: Some(1024),
            linear: None,
        }
    }

    /// One rank of `tp` tensor-parallel ranks: heads and parameters divided by `tp` (heads
    /// must divide evenly).
    pub fn with_tp(mut self, tp: u32) -> Result<Self, String> {
        let divides = |n: u32| tp > 0 && n.is_multiple_of(tp);
        let mut heads = vec![self.q_heads, self.kv_heads];
        if let Some(l) = &self.linear {
            heads.extend([l.key_heads, l.value_heads]);
        }
        if !heads.into_iter().all(divides) {
            return Err(format!(
                "{}: tensor parallelism {tp} does not divide its heads",
                self.name
            ));
        }
        self.q_heads /= tp;
        self.kv_heads /= tp;
        if let Some(l) = &mut self.linear {
            l.key_heads /= tp;
            l.value_heads /= tp;
        }
        self.params /= tp as f64;
        self.tp *= tp;
        if self.tp > 1 {
            self.name = format!(
                "{} tp{}",
                self.name.split(" tp").next().unwrap_or(""),
                self.tp
            );
        }
        Ok(self)
    }

    fn attention_shape(&self, layers: u32, page_size: u32) -> KvShape {
        KvShape {
            kind: KvKind::Mha {
                heads: self.kv_heads,
                head_dim: self.head_dim,
            },
            layers,
            dtype: self.dtype,
            page_size,
        }
    }

    /// The Full component's KV shape (the full-attention layers) with `page_size` tokens per
    /// page.
    pub fn full_kv_shape(&self, page_size: u32) -> KvShape {
        self.attention_shape(self.full_layers, page_size)
    }

    /// The SWA component's KV shape (the sliding-window layers), if the model has them.
    pub fn swa_kv_shape(&self, page_size: u32) -> Option<KvShape> {
        (self.swa_layers > 0).then(|| self.attention_shape(self.swa_layers, page_size))
    }

    /// The Mamba component's state shape, if the model has linear-attention layers. As
    /// SGLang's Gated DeltaNet state: per layer a temporal state of `value_heads ×
    /// key_head_dim × value_head_dim` elements and one conv state of `conv_dim ×
    /// (conv_kernel − 1)` elements, `conv_dim = 2 · key_heads · key_head_dim + value_heads
    /// · value_head_dim`.
    pub fn mamba_shape(&self) -> Option<MambaShape> {
        let l = self.linear.as_ref()?;
        let conv_dim = 2 * u64::from(l.key_heads) * u64::from(l.key_head_dim)
            + u64::from(l.value_heads) * u64::from(l.value_head_dim);
        Some(MambaShape {
            layers: self.linear_layers,
            temporal_elems: u64::from(l.value_heads)
                * u64::from(l.key_head_dim)
                * u64::from(l.value_head_dim),
            temporal_dtype: l.temporal_dtype,
            conv_elems: vec![conv_dim * u64::from(l.conv_kernel - 1)],
            conv_dtype: l.conv_dtype,
        })
    }

    /// Bytes of one request's linear-attention state (0 without linear-attention layers).
    pub fn state_bytes(&self) -> u64 {
        self.mamba_shape().map_or(0, |m| m.slot_bytes() as u64)
    }

    /// The costs of this model on one H100 SXM, derived as [`ComputeModel::h100`] derives a
    /// dense model's: weights `2 · params` FLOPs per token; full-attention layers
    /// `4 · q_heads · head_dim` FLOPs per causal (query, key) pair as the dense model;
    /// sliding-window layers the same per pair, pairs capped at the window; linear-attention
    /// layers `4 · value_heads · key_head_dim · value_head_dim` FLOPs per token (state update
    /// and read-out), linear in tokens. Decode reads the weights, the full-attention KV of
    /// every context token, and per request a window of sliding-window KV plus its state
    /// (read and written).
    pub fn compute_h100(&self) -> ComputeModel {
        let flops = H100_PEAK_FLOPS * PREFILL_MFU;
        let hbm = H100_HBM_BYTES_PER_S * DECODE_BW_EFFICIENCY;
        let pair = 4.0 * self.q_heads as f64 * self.head_dim as f64 / flops;
        let linear_flops = self.linear.as_ref().map_or(0.0, |l| {
            4.0 * l.value_heads as f64 * l.key_head_dim as f64 * l.value_head_dim as f64
        }) * self.linear_layers as f64;
        let window = self.window.unwrap_or(0) as usize;
        let window_bytes = self
            .swa_kv_shape(1)
            .map_or(0, |s| s.token_bytes() as u64 * window as u64);
        ComputeModel {
            prefill_s_per_token: (2.0 * self.params + linear_flops) / flops,
            attention_s_per_pair: pair * self.full_layers as f64,
            window_attention_s_per_pair: pair * self.swa_layers as f64,
            attention_window: window,
            decode_s_per_step: self.params * self.dtype.size() as f64 / hbm,
            decode_s_per_context_token: self.full_kv_shape(1).token_bytes() as f64 / hbm,
            decode_s_per_request: (window_bytes + 2 * self.state_bytes()) as f64 / hbm,
            // The links (H2D, D2H, L3) are the node's, not the model's.
            ..ComputeModel::h100(&ModelShape::llama3_8b())
        }
    }
}

/// (query, key) pairs of `new` tokens after `cached` ones when a query sees at most `window`
/// keys: Σ_{k=cached+1}^{cached+new} min(k, window).
fn window_pairs(cached: usize, new: usize, window: usize) -> f64 {
    let (lo, hi, w) = (cached as f64 + 1.0, (cached + new) as f64, window as f64);
    if new == 0 {
        0.0
    } else if hi <= w {
        (lo + hi) * new as f64 / 2.0
    } else if lo > w {
        new as f64 * w
    } else {
        (lo + w) * (w - lo + 1.0) / 2.0 + (hi - w) * w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_defaults_match_the_documented_figures() {
        let m = ModelShape::llama3_8b();
        assert_eq!(m.token_bytes(), 131_072);
        assert_eq!(m.kv_shape(64).page_bytes(), 8 << 20);
        let c = ComputeModel::h100(&m);
        c.validate().unwrap();
        assert!((c.prefill_s_per_token * 1e6 - 32.48).abs() < 0.01);
        assert!((c.attention_s_per_pair * 1e9 - 1.06).abs() < 0.01);
        assert!((c.decode_s_per_step * 1e3 - 5.99).abs() < 0.01);
        assert!((c.decode_s_per_context_token * 1e9 - 48.9).abs() < 0.1);
    }

    #[test]
    fn prefill_counts_causal_pairs() {
        let c = ComputeModel {
            prefill_s_per_token: 1.0,
            attention_s_per_pair: 0.001,
            ..ComputeModel::h100(&ModelShape::llama3_8b())
        };
        // 3 new tokens after 2 cached: positions 2, 3, 4 attend to 3 + 4 + 5 = 12 keys.
        assert!((c.prefill_compute(2, 3) - (3.0 + 0.012)).abs() < 1e-12);
        assert_eq!(c.prefill_compute(10, 0), 0.0);
        // Computing a prompt in two chunks costs the same as in one.
        let whole = c.prefill_compute(0, 100);
        let split = c.prefill_compute(0, 40) + c.prefill_compute(40, 60);
        assert!((whole - split).abs() < 1e-9);
    }

    #[test]
    fn layer_overlap_waits_for_the_slower_of_load_and_compute() {
        let c = ComputeModel {
            h2d_bytes_per_s: 1.0,
            step_overhead_s: 0.0,
            ..ComputeModel::h100(&ModelShape::llama3_8b())
        };
        // No load: pure compute.
        assert!((c.prefill_step(4.0, 4, 0) - 4.0).abs() < 1e-12);
        // Load of 1 s per layer under 1 s of compute per layer: only the first layer's load
        // shows.
        assert!((c.prefill_step(4.0, 4, 4) - 5.0).abs() < 1e-12);
        // Load-bound: 2 s per layer of load, 1 s of compute: 8 s of load + the last layer.
        assert!((c.prefill_step(4.0, 4, 8) - 9.0).abs() < 1e-12);
        // Nothing to compute: the step is the load.
        assert!((c.prefill_step(0.0, 4, 8) - 8.0).abs() < 1e-12);
    }

    #[test]
    fn decode_grows_with_context() {
        let c = ComputeModel::h100(&ModelShape::llama3_8b());
        assert!(c.decode_step(100_000, 1) > c.decode_step(0, 1));
        assert!((c.decode_step(0, 1) - c.decode_s_per_step).abs() < 1e-15);
    }

    #[test]
    fn invalid_costs_are_named() {
        let mut c = ComputeModel::h100(&ModelShape::llama3_8b());
        c.h2d_bytes_per_s = 0.0;
        assert!(c.validate().unwrap_err().contains("H2D"));
        let mut c = ComputeModel::h100(&ModelShape::llama3_8b());
        c.prefill_s_per_token = f64::NAN;
        assert!(c.validate().unwrap_err().contains("prefill"));
    }

    #[test]
    fn window_pairs_cap_each_query_at_the_window() {
        let naive = |p: usize, n: usize, w: usize| -> f64 {
            (p + 1..=p + n).map(|k| k.min(w) as f64).sum()
        };
        for (p, n, w) in [
            (0, 10, 4),
            (2, 3, 10),
            (5, 10, 6),
            (20, 5, 4),
            (0, 0, 4),
            (3, 1, 4),
        ] {
            assert_eq!(window_pairs(p, n, w), naive(p, n, w), "p={p} n={n} w={w}");
        }
    }

    #[test]
    fn qwen35_state_and_kv_follow_the_config() {
        let m = HybridModel::qwen35_9b();
        assert_eq!(m.full_layers + m.linear_layers, m.layers);
        // 8 full-attention layers × 4 KV heads × 256 × K and V × bf16.
        assert_eq!(m.full_kv_shape(1).token_bytes(), 32_768);
        assert!(m.swa_kv_shape(64).is_none());
        let s = m.mamba_shape().unwrap();
        s.validate().unwrap();
        // Per layer: 32 × 128 × 128 f32 temporal + (2·16·128 + 32·128) × 3 bf16 conv.
        assert_eq!(
            s.slot_bytes() as u64,
            24 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
        );
        assert_eq!(m.state_bytes(), s.slot_bytes() as u64);
        let tp2 = m.clone().with_tp(2).unwrap();
        assert_eq!(tp2.state_bytes() * 2, m.state_bytes());
        assert_eq!(tp2.name, "qwen3.5-9b tp2");
        assert!(m.with_tp(3).unwrap_err().contains("does not divide"));
    }

    #[test]
    fn gemma3_is_five_local_to_one_global() {
        let m = HybridModel::gemma3_12b();
        assert_eq!(m.swa_layers, 5 * m.full_layers);
        assert_eq!(m.window, Some(1024));
        assert!(m.mamba_shape().is_none());
        assert_eq!(m.state_bytes(), 0);
        let full = m.full_kv_shape(64).page_bytes();
        assert_eq!(m.swa_kv_shape(64).unwrap().page_bytes(), 5 * full);
    }

    #[test]
    fn hybrid_costs_cap_windows_and_grow_linearly_in_state_layers() {
        let dense_like = |m: &HybridModel| ComputeModel {
            window_attention_s_per_pair: 0.0,
            attention_s_per_pair: m.compute_h100().attention_s_per_pair
                + m.compute_h100().window_attention_s_per_pair,
            ..m.compute_h100()
        };
        let g = HybridModel::gemma3_12b();
        let c = g.compute_h100();
        c.validate().unwrap();
        assert_eq!(c.attention_window, 1024);
        // Short prompts: every query is inside the window, as if every layer were global.
        let short = c.prefill_compute(0, 1000);
        assert!((short - dense_like(&g).prefill_compute(0, 1000)).abs() < 1e-12);
        // Long prompts: sliding-window layers cost linearly beyond the window, so attention
        // costs about the global layers' sixth of the dense model's.
        let attention_only = |c: ComputeModel| ComputeModel {
            prefill_s_per_token: 0.0,
            ..c
        };
        let long = attention_only(c.clone()).prefill_compute(0, 32_768);
        let dense = attention_only(dense_like(&g)).prefill_compute(0, 32_768);
        assert!(long < 0.25 * dense, "{long} vs {dense}");
        let q = HybridModel::qwen35_9b().compute_h100();
        q.validate().unwrap();
        assert_eq!(q.attention_window, 0);
        assert!(q.decode_s_per_request > 0.0);
        assert!(q.decode_step(0, 2) > q.decode_step(0, 1));
        // Linear-attention layers add a per-token cost beyond the weights.
        assert!(q.prefill_s_per_token > 2.0 * 9e9 / (H100_PEAK_FLOPS * PREFILL_MFU));
        let node = ComputeModel {
            h2d_bytes_per_s: 1.0,
            ..c.clone()
        };
        assert_eq!(q.clone().with_node_of(&node).h2d_bytes_per_s, 1.0);
    }
}
