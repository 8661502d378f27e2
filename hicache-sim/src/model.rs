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
    /// Attention time per (query token, key position) pair; 0 turns the quadratic term off.
    pub attention_s_per_pair: f64,
    /// Decode time per step, excluding KV reads.
    pub decode_s_per_step: f64,
    /// Decode time per step per context token of every running request (KV reads).
    pub decode_s_per_context_token: f64,
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
            decode_s_per_step: weight_bytes / hbm,
            decode_s_per_context_token: model.token_bytes() as f64 / hbm,
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
            ("decode time per step", self.decode_s_per_step),
            (
                "decode time per context token",
                self.decode_s_per_context_token,
            ),
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

    /// Compute time of `new` tokens following `cached` tokens already in the KV cache.
    pub fn prefill_compute(&self, cached: usize, new: usize) -> f64 {
        let (p, n) = (cached as f64, new as f64);
        // Token i (0-based, cached ones first) attends to i + 1 positions:
        // Σ_{i=p}^{p+n−1} (i + 1) = n·p + n(n+1)/2.
        let pairs = n * p + n * (n + 1.0) / 2.0;
        n * self.prefill_s_per_token + pairs * self.attention_s_per_pair
    }

    /// Duration of one decode step over requests holding `context_tokens` tokens in total.
    pub fn decode_step(&self, context_tokens: usize) -> f64 {
        self.step_overhead_s
            + self.decode_s_per_step
            + context_tokens as f64 * self.decode_s_per_context_token
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
        assert!(c.decode_step(100_000) > c.decode_step(0));
        assert!((c.decode_step(0) - c.decode_s_per_step).abs() < 1e-15);
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
}
