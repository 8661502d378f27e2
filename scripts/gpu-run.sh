#!/usr/bin/env bash
# Runs the staged GPU tests and the transfer bench on a GPU machine (see stage-gpu.sh).
# Usage: bash scripts/gpu-run.sh [tests|bench|all]   (default all)
# NVRTC: the CUDA toolkit's (13.0 on our GPU machine). The kernels load as a cubin for the GPU's
# sm_XY (any driver that supports the GPU loads it); PTX, which needs a driver at least as new as
# the NVRTC, only as the fallback.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
for d in /usr/local/cuda-13.0/targets/x86_64-linux/lib /usr/local/cuda/lib64; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true
if [ "$what" = tests ] || [ "$what" = all ]; then
    # --include-ignored: a test binary built without HICACHE_TEST_CUDA=1 /
    # HICACHE_REQUIRE_NVRTC=1 marks these tests ignored (see hicache-gpu/build.rs); here every
    # one of them runs.
    HICACHE_REQUIRE_NVRTC=1 .gpu/nvrtc_compile --include-ignored --nocapture
    HICACHE_TEST_CUDA=1 .gpu/cuda_transfers --include-ignored --nocapture --test-threads=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    for model in llama3-8b deepseek-v3-mla; do
        # Every byte of every layout x io x direction checked against the host-side reference
        # first (small pools), then the timed runs.
        .gpu/hicache-bench transfer --device cuda --model "$model" --pages 16 \
            --layout page_first,layer_first,page_first_direct --io kernel,direct,staged \
            --iters 1 --verify --json
        .gpu/hicache-bench transfer --device cuda --model "$model" --pages 64,256,1024 \
            --layout page_first,layer_first,page_first_direct --io kernel,direct,staged --json
    done
    # A 32k-token load-back through the controller, overlapped with a simulated forward.
    for io in kernel direct; do
        .gpu/hicache-bench loadback --device cuda --model llama3-8b --tokens 32768 --io "$io" --json
    done
fi
