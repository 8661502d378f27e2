//! The CUDA source of the transfer kernels and their compilation with NVRTC.
//!
//! One kernel family, `hicache_copy_w{16,8,4,2,1}`: the page copy of [`crate::copy`] with
//! `W`-byte words (16-byte `uint4` accesses whenever rows and base addresses allow, scalar
//! fallbacks otherwise). Loads use `ld.global.cs` and stores `st.global.cs` (streaming: the
//! data is touched once) and each lane keeps [`UNROLL`] words in flight. The kernel reads and
//! writes the page-locked host pool directly (zero-copy over PCIe), so a transfer needs no
//! staging buffer and one launch moves every layer of a backup.
//!
//! The device's real architecture (`sm_XY`) is compiled to a cubin at first use and cached
//! for the process ([`compile_cubin`]); the device loads it once per context. PTX
//! ([`compile_ptx`]) is the fallback for a GPU that this NVRTC cannot target: PTX from a
//! newer NVRTC than the driver fails to load, a cubin does not.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::nvrtc::result as nvrtc;
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

/// What NVRTC produces.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
enum Output {
    /// PTX text (JIT-compiled by the driver at load; needs a driver at least as new as NVRTC).
    Ptx,
    /// Machine code for one real architecture (`sm_XY`): loads on any driver that supports
    /// the GPU, whatever NVRTC version built it.
    Cubin,
}

/// PTX of [`SOURCE`] for `arch` (e.g. `"compute_90"`; `None` for NVRTC's default target),
/// compiled once per architecture per process. The fallback of [`compile_cubin`].
pub fn compile_ptx(arch: Option<&str>) -> Result<Arc<str>> {
    let bytes = compile(arch, Output::Ptx)?;
    let text = std::str::from_utf8(&bytes)
        .map_err(|e| GpuError::Compile {
            arch: arch.unwrap_or("default").into(),
            log: format!("NVRTC returned PTX that is not UTF-8: {e}"),
        })?
        .trim_end_matches('\0');
    Ok(text.into())
}

/// A cubin of [`SOURCE`] for the real architecture `arch` (e.g. `"sm_90"`), compiled once per
/// architecture per process. Errors when NVRTC does not know `arch` (a GPU newer than the
/// NVRTC): callers fall back to [`compile_ptx`].
pub fn compile_cubin(arch: &str) -> Result<Arc<[u8]>> {
    compile(Some(arch), Output::Cubin)
}

fn compile(arch: Option<&str>, output: Output) -> Result<Arc<[u8]>> {
    type Cache = HashMap<(String, Output), Arc<[u8]>>;
    static CACHE: Mutex<Option<Cache>> = Mutex::new(None);
    let key = (arch.unwrap_or("default").to_string(), output);
    if let Some(out) = CACHE.lock().get_or_insert_with(HashMap::new).get(&key) {
        return Ok(out.clone());
    }
    if !nvrtc_available() {
        return Err(GpuError::NoNvrtc(
            "libnvrtc not found: install the CUDA toolkit's NVRTC (or the \
             nvidia-cuda-nvrtc wheel) and put its lib directory on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let fail = |log: String| GpuError::Compile {
        arch: key.0.clone(),
        log,
    };
    let mut options = vec![format!("-DHICACHE_UNROLL={UNROLL}")];
    if let Some(a) = arch {
        options.push(format!("--gpu-architecture={a}"));
    }
    let src = std::ffi::CString::new(SOURCE).map_err(|e| fail(format!("kernel source: {e}")))?;
    let prog = nvrtc::create_program(&src, Some(c"kernels.cu"))
        .map_err(|e| fail(format!("nvrtcCreateProgram: {e:?}")))?;
    // SAFETY: `prog` comes from create_program and is destroyed once, below.
    let out = unsafe {
        match nvrtc::compile_program(prog, &options) {
            Ok(()) => match output {
                Output::Ptx => nvrtc::get_ptx(prog)
                    .map(|p| p.into_iter().map(|c| c as u8).collect::<Vec<u8>>())
                    .map_err(|e| fail(format!("nvrtcGetPTX: {e:?}"))),
                Output::Cubin => cubin_of(prog).map_err(fail),
            },
            Err(e) => {
                let log = nvrtc::get_program_log(prog)
                    .map(|l| {
                        let l: Vec<u8> = l.into_iter().map(|c| c as u8).collect();
                        String::from_utf8_lossy(&l)
                            .trim_end_matches('\0')
                            .to_string()
                    })
                    .unwrap_or_default();
                Err(fail(format!("{e:?}: {log}")))
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    let out: Arc<[u8]> = out?.into();
    CACHE
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(key, out.clone());
    Ok(out)
}

/// The cubin of a compiled program.
///
/// # Safety
/// `prog` must be a live, successfully compiled NVRTC program.
unsafe fn cubin_of(prog: cudarc::nvrtc::sys::nvrtcProgram) -> std::result::Result<Vec<u8>, String> {
    use cudarc::nvrtc::sys;
    let mut size = 0usize;
    // SAFETY: live program, out-pointer to a local.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
    if size == 0 {
        return Err("NVRTC produced no cubin (the target is not a real sm_XY architecture)".into());
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: the buffer holds the size NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
    Ok(cubin)
}
