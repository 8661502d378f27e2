//! The CUDA source of the transfer kernels and their compilation with NVRTC.
//!
//! One kernel family, `hicache_copy_w{16,8,4,2,1}`: the page copy of [`crate::copy`] with
//! `W`-byte words (16-byte `uint4` accesses whenever rows and base addresses allow, scalar
//! fallbacks otherwise). Loads use `ld.global.cs` and stores `st.global.cs` (streaming: the
//! data is touched once) and each lane keeps [`UNROLL`] words in flight. The kernel reads and
//! writes the page-locked host pool directly (zero-copy over PCIe), so a transfer needs no
//! staging buffer and one launch moves every layer of a backup.
//!
//! PTX is compiled at first use per target architecture and cached for the process
//! ([`compile_ptx`]); the device loads it once per context.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{GpuError, Result};

/// Words each lane loads before it stores.
pub const UNROLL: u32 = 4;

/// Kernel entry points, by word width in bytes.
pub const ENTRY_POINTS: [(u32, &str); 5] = [
    (16, "hicache_copy_w16"),
    (8, "hicache_copy_w8"),
    (4, "hicache_copy_w4"),
    (2, "hicache_copy_w2"),
    (1, "hicache_copy_w1"),
];

/// The entry point for `word_bytes`.
pub fn entry_point(word_bytes: u32) -> &'static str {
    ENTRY_POINTS
        .iter()
        .find(|(w, _)| *w == word_bytes)
        .map(|(_, n)| *n)
        .unwrap_or("hicache_copy_w1")
}

/// The kernel source (CUDA C++, compiled by NVRTC).
pub const SOURCE: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;

// Must match hicache_gpu::copy::CopyParams (repr(C), every u64 before every u32).
struct CopyParams {
    u64 dev_table;
    u64 dev_pages;
    u64 host_pages;
    u64 host_base;
    u64 host_half_stride;
    u64 host_page_stride;
    u64 host_layer_stride;
    u64 host_token_stride;
    u64 dev_page_stride;
    u32 num_pairs;
    u32 layer_begin;
    u32 num_layers;
    u32 total_layers;
    u32 num_halves;
    u32 page_size;
    u32 row_bytes;
    u32 to_host;
    u32 rows_per_chunk;
    u32 chunks_per_unit;
};

#ifndef HICACHE_UNROLL
#define HICACHE_UNROLL 4
#endif

template <typename W>
__device__ __forceinline__ void copy_pages(const CopyParams& p) {
    const u32 lane = threadIdx.x & 31u;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 units = (u64)p.num_pairs * p.num_halves * p.num_layers;
    const u64 items = units * p.chunks_per_unit;
    const u32 words_per_row = p.row_bytes / (u32)sizeof(W);
    const u64* table = (const u64*)p.dev_table;
    const u32* dpages = (const u32*)p.dev_pages;
    const u32* hpages = (const u32*)p.host_pages;

    for (u64 item = warp; item < items; item += nwarps) {
        const u64 unit = item / p.chunks_per_unit;
        const u32 chunk = (u32)(item - unit * p.chunks_per_unit);
        const u32 layer = p.layer_begin + (u32)(unit % p.num_layers);
        const u64 t = unit / p.num_layers;
        const u32 half = (u32)(t % p.num_halves);
        const u64 pair = t / p.num_halves;

        const u64 dev = __ldg(table + (u64)half * p.total_layers + layer)
                      + (u64)__ldg(dpages + pair) * p.dev_page_stride;
        const u64 host = p.host_base + (u64)half * p.host_half_stride
                       + (u64)__ldg(hpages + pair) * p.host_page_stride
                       + (u64)layer * p.host_layer_stride;
        const u32 row0 = chunk * p.rows_per_chunk;
        const u32 rows = min(p.rows_per_chunk, p.page_size - row0);

        u64 src, dst, src_stride, dst_stride;
        if (p.to_host) {
            src = dev;  src_stride = p.row_bytes;
            dst = host; dst_stride = p.host_token_stride;
        } else {
            src = host; src_stride = p.host_token_stride;
            dst = dev;  dst_stride = p.row_bytes;
        }
        src += (u64)row0 * src_stride;
        dst += (u64)row0 * dst_stride;

        const u32 n = rows * words_per_row;
        for (u32 base = lane; base < n; base += 32u * HICACHE_UNROLL) {
            W r[HICACHE_UNROLL];
#pragma unroll
            for (int k = 0; k < HICACHE_UNROLL; ++k) {
                const u32 i = base + 32u * k;
                if (i < n) {
                    const u32 row = i / words_per_row;
                    const u32 col = i - row * words_per_row;
                    r[k] = __ldcs((const W*)(src + (u64)row * src_stride) + col);
                }
            }
#pragma unroll
            for (int k = 0; k < HICACHE_UNROLL; ++k) {
                const u32 i = base + 32u * k;
                if (i < n) {
                    const u32 row = i / words_per_row;
                    const u32 col = i - row * words_per_row;
                    __stcs((W*)(dst + (u64)row * dst_stride) + col, r[k]);
                }
            }
        }
    }
}

extern "C" __global__ void hicache_copy_w16(const CopyParams p) { copy_pages<uint4>(p); }
extern "C" __global__ void hicache_copy_w8(const CopyParams p) { copy_pages<unsigned long long>(p); }
extern "C" __global__ void hicache_copy_w4(const CopyParams p) { copy_pages<unsigned int>(p); }
extern "C" __global__ void hicache_copy_w2(const CopyParams p) { copy_pages<unsigned short>(p); }
extern "C" __global__ void hicache_copy_w1(const CopyParams p) { copy_pages<unsigned char>(p); }
"#;

/// Whether the NVRTC library can be loaded (never panics).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library under its known names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// PTX of [`SOURCE`] for `arch` (e.g. `"sm_90"`; `None` for NVRTC's default target), compiled
/// once per architecture per process.
pub fn compile_ptx(arch: Option<&str>) -> Result<Arc<str>> {
    static CACHE: Mutex<Option<HashMap<String, Arc<str>>>> = Mutex::new(None);
    let key = arch.unwrap_or("default").to_string();
    if let Some(ptx) = CACHE.lock().get_or_insert_with(HashMap::new).get(&key) {
        return Ok(ptx.clone());
    }
    if !nvrtc_available() {
        return Err(GpuError::NoNvrtc(
            "libnvrtc not found: install the CUDA toolkit's NVRTC (or the \
             nvidia-cuda-nvrtc wheel) and put its lib directory on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let mut options = vec![format!("-DHICACHE_UNROLL={UNROLL}")];
    if let Some(a) = arch {
        options.push(format!("--gpu-architecture={a}"));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options,
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| {
        let log = match &e {
            cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
                format!("{nvrtc:?}: {}", log.to_string_lossy())
            }
            other => format!("{other:?}"),
        };
        GpuError::Compile {
            arch: key.clone(),
            log,
        }
    })?;
    let ptx: Arc<str> = ptx.to_src().into();
    CACHE
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(key, ptx.clone());
    Ok(ptx)
}
