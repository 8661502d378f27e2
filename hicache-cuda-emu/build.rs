//! Compiles the transfer kernels' CUDA source (`hicache-gpu/src/kernels.cu`, the very file
//! NVRTC compiles) as host C++ with `csrc/cuda_shim.h`, plus the launcher that runs every
//! block and thread of a grid (`csrc/launch.cpp`).

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let kernel = manifest.join("../hicache-gpu/src/kernels.cu");
    let kernel = kernel
        .canonicalize()
        .unwrap_or_else(|e| panic!("kernel source {} not found: {e}", kernel.display()));
    let csrc = manifest.join("csrc");
    for f in [
        kernel.clone(),
        csrc.join("cuda_shim.h"),
        csrc.join("launch.cpp"),
    ] {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let quoted = format!("\"{}\"", kernel.display());
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file(csrc.join("launch.cpp"))
        .include(&csrc)
        .define("HICACHE_KERNEL_SOURCE", quoted.as_str())
        // `#pragma unroll` is CUDA's; host compilers ignore it.
        .flag_if_supported("-Wno-unknown-pragmas")
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .compile("hicache_cuda_emu_kernels");
}
