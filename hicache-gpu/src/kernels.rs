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

/// The kernel source (CUDA C++, compiled by NVRTC): `kernels.cu`, which `hicache-cuda-emu`
/// also compiles as plain C++ to run the same text on the CPU.
pub const SOURCE: &str = include_str!("kernels.cu");

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
