//! Decides at build time which GPU tests can run, so that `cargo test` reports the others as
//! ignored (with the command that runs them) instead of passing without checking anything:
//!
//! - `HICACHE_TEST_CUDA=1` (a GPU, or the emulated driver under `scripts/with-cuda-emu.sh`)
//!   sets `cfg(hicache_test_cuda)`: the CUDA suites run;
//! - `HICACHE_CUDA_EMU=1` (set by `scripts/with-cuda-emu.sh`) sets `cfg(hicache_cuda_emu)`:
//!   the suites that read the emulated driver's counters run (with `hicache_test_cuda`);
//! - `HICACHE_REQUIRE_NVRTC=1` (NVRTC on `LD_LIBRARY_PATH`, as CI and `with-cuda-emu.sh`
//!   provide) sets `cfg(hicache_nvrtc)`: the kernel compile tests run.
//!
//! Changing one of these variables rebuilds the crate. The cfgs change no library code.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    for (var, cfg) in [
        ("HICACHE_TEST_CUDA", "hicache_test_cuda"),
        ("HICACHE_CUDA_EMU", "hicache_cuda_emu"),
        ("HICACHE_REQUIRE_NVRTC", "hicache_nvrtc"),
    ] {
        println!("cargo::rerun-if-env-changed={var}");
        println!("cargo::rustc-check-cfg=cfg({cfg})");
        if std::env::var(var).as_deref() == Ok("1") {
            println!("cargo::rustc-cfg={cfg}");
        }
    }
}
