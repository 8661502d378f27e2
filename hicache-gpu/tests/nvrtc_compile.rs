//! Every transfer kernel compiles to PTX with NVRTC, for the default target and for sm_90
//! (H100). Needs no GPU, only NVRTC: built with `HICACHE_REQUIRE_NVRTC=1` (as CI builds it;
//! see `build.rs`) the tests run and fail when NVRTC cannot be loaded; built without it, cargo
//! reports them as ignored, with the command that runs them.

#![cfg(feature = "cuda")]

use hicache_gpu::kernels::{self, ENTRY_POINTS};

/// Fails the test, naming what is missing, when NVRTC cannot be loaded.
fn require_nvrtc() {
    assert!(
        kernels::nvrtc_available(),
        "libnvrtc cannot be loaded: put NVRTC 13 on LD_LIBRARY_PATH (scripts/with-cuda-emu.sh \
         fetches it)"
    );
}

#[test]
#[cfg_attr(
    not(hicache_nvrtc),
    ignore = "needs NVRTC: \
              HICACHE_REQUIRE_NVRTC=1 scripts/with-cuda-emu.sh cargo test -p hicache-gpu --test nvrtc_compile"
)]
fn every_kernel_compiles_to_ptx() {
    require_nvrtc();
    for arch in [None, Some("sm_90"), Some("compute_90")] {
        let ptx = kernels::compile_ptx(arch)
            .unwrap_or_else(|e| panic!("kernels do not compile for {arch:?}: {e}"));
        for (_, name) in ENTRY_POINTS {
            assert!(
                ptx.contains(&format!(".entry {name}")),
                "{name} missing from the PTX for {arch:?}"
            );
        }
        // 16-byte streaming accesses in the vector kernel.
        assert!(
            ptx.contains("ld.global.cs.v4"),
            "no 16-byte loads for {arch:?}"
        );
        assert!(
            ptx.contains("st.global.cs.v4"),
            "no 16-byte stores for {arch:?}"
        );
        let target = ptx.lines().find(|l| l.starts_with(".target")).unwrap_or("");
        if let Some(a) = arch {
            let want = a.replace("compute_", "sm_");
            assert!(target.contains(&want), "{arch:?} compiled for {target}");
        }
        println!("{arch:?}: {} bytes of PTX, {target}", ptx.len());
    }
}

#[test]
#[cfg_attr(
    not(hicache_nvrtc),
    ignore = "needs NVRTC: \
              HICACHE_REQUIRE_NVRTC=1 scripts/with-cuda-emu.sh cargo test -p hicache-gpu --test nvrtc_compile"
)]
fn a_bad_architecture_is_a_clear_error() {
    require_nvrtc();
    let e = kernels::compile_ptx(Some("sm_1")).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("sm_1"), "{msg}");
}

/// The device path loads a cubin for the GPU's own architecture (PTX only as the fallback):
/// NVRTC must produce one for sm_90 holding every entry point.
#[test]
#[cfg_attr(
    not(hicache_nvrtc),
    ignore = "needs NVRTC: \
              HICACHE_REQUIRE_NVRTC=1 scripts/with-cuda-emu.sh cargo test -p hicache-gpu --test nvrtc_compile"
)]
fn every_kernel_compiles_to_an_sm_90_cubin() {
    require_nvrtc();
    let cubin = kernels::compile_cubin("sm_90").unwrap();
    assert_eq!(&cubin[..4], b"\x7fELF");
    // e_machine EM_CUDA (190); e_flags carry the SM in bits 8..16.
    assert_eq!(u16::from_le_bytes([cubin[0x12], cubin[0x13]]), 190);
    let flags = u32::from_le_bytes(cubin[0x30..0x34].try_into().unwrap());
    assert_eq!((flags >> 8) & 0xff, 90);
    for (_, name) in ENTRY_POINTS {
        let text = format!(".text.{name}\0");
        assert!(
            cubin.windows(text.len()).any(|w| w == text.as_bytes()),
            "{name} missing from the cubin"
        );
    }
    // A virtual architecture has no machine code: a clear error, the caller falls back to PTX.
    let e = kernels::compile_cubin("compute_90").unwrap_err();
    assert!(e.to_string().contains("compute_90"), "{e}");
}
