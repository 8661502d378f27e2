#!/usr/bin/env bash
# Runs the staged GPU tests and benches on a GPU machine (see stage-gpu.sh).
# Usage: bash scripts/gpu-run.sh [tests|bench|sweep|flows|all]   (default all; sweep: the
# kernels' CTA sweep and the load-backs only, after the Llama verify; flows: the controller's
# request flows and the model test on Device::cuda only)
# Every step runs under its own time limit and the script goes on after a failing step; each
# phase's output goes to $OUT/<phase>.log (the device tool's result folder; gpu-out/ without
# it) and one line per step to $OUT/summary.txt. Exit status: the number of failed steps.
# NVRTC: the CUDA toolkit's (13.0 on our GPU machines) or the nvidia-cuda-nvrtc wheel's. The
# kernels load as a cubin for the GPU's sm_XY; PTX, which needs a driver at least as new as the
# NVRTC, only as the fallback.
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
out="${OUT:-gpu-out}"
mkdir -p "$out"
for d in /usr/local/cuda-13.0/targets/x86_64-linux/lib /usr/local/cuda/lib64 /usr/local/nvidia/lib64; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
nvrtc=""
for d in ${LD_LIBRARY_PATH//:/ }; do
    for f in "$d"/libnvrtc.so*; do [ -e "$f" ] && nvrtc="$f" && break 2; done
done
if [ -z "$nvrtc" ]; then
    nvrtc=$(find /usr/local /opt /usr/lib -name 'libnvrtc.so.1[3-9]*' 2>/dev/null | head -n 1)
    [ -n "$nvrtc" ] && export LD_LIBRARY_PATH="$(dirname "$nvrtc"):$LD_LIBRARY_PATH"
fi
{
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total --format=csv || true
    echo "libcuda: $(ldconfig -p | grep -m 1 'libcuda\.so' || echo 'not in ldconfig')"
    echo "nvrtc: ${nvrtc:-not found}"
    nproc
} | tee "$out/summary.txt"
failed=0
# step PHASE LIMIT_S NAME COMMAND...: runs COMMAND, output appended to $OUT/PHASE.log.
step() {
    local phase="$1" limit="$2" name="$3"
    shift 3
    local t0=$SECONDS rc=0
    echo "===== $name: $*" >>"$out/$phase.log"
    timeout -k 10 "$limit" "$@" >>"$out/$phase.log" 2>&1 || rc=$?
    [ "$rc" = 0 ] || failed=$((failed + 1))
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$out/summary.txt"
}
if [ "$what" = tests ] || [ "$what" = all ]; then
    # --include-ignored: a test binary built without HICACHE_TEST_CUDA=1 / HICACHE_REQUIRE_NVRTC=1
    # marks these tests ignored (hicache-gpu/build.rs); here every one of them runs.
    step tests 60 nvrtc_compile env HICACHE_REQUIRE_NVRTC=1 .gpu/nvrtc_compile --include-ignored --nocapture
    step tests 150 cuda_transfers env HICACHE_TEST_CUDA=1 .gpu/cuda_transfers --include-ignored --nocapture --test-threads=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    # Every byte of every layout x io x direction checked against the host-side reference
    # first (small pools), then the timed runs.
    for model in llama3-8b deepseek-v3-mla; do
        step bench 60 "transfer-verify-$model" .gpu/hicache-bench transfer --device cuda \
            --model "$model" --pages 16 --layout page_first,layer_first,page_first_direct \
            --io kernel,direct,staged --iters 1 --verify --json
    done
    for model in llama3-8b deepseek-v3-mla; do
        step bench 150 "transfer-$model" .gpu/hicache-bench transfer --device cuda --model "$model" \
            --pages 256,1024 --layout page_first,layer_first,page_first_direct \
            --io kernel,direct,staged --iters 8 --json
    done
fi
if [ "$what" = sweep ]; then
    step bench 60 "transfer-verify-llama3-8b" .gpu/hicache-bench transfer --device cuda \
        --model llama3-8b --pages 16 --layout page_first,layer_first,page_first_direct \
        --io kernel,direct,staged --iters 1 --verify --json
fi
if [ "$what" = bench ] || [ "$what" = sweep ] || [ "$what" = all ]; then
    # The kernels' H2D loads stopped at 0.92 of the bulk copy with the default 8 CTAs
    # (2026-12-04): the same loads with more CTAs (8 again as the same-run baseline; 128 is
    # about one CTA per SM of an H100 / H200).
    for c in 8 16 32 64 128; do
        step bench 60 "transfer-ctas-$c" .gpu/hicache-bench transfer --device cuda --model llama3-8b \
            --pages 1024 --layout page_first,layer_first --io kernel --iters 8 --ctas "$c" --json
    done
    # A 32k-token load-back through the controller, overlapped with a simulated forward
    # (`direct` runs on page_first_direct: the builder resolves page_first + direct).
    for io in kernel direct; do
        step bench 60 "loadback-$io" .gpu/hicache-bench loadback --device cuda --model llama3-8b \
            --tokens 32768 --io "$io" --json
    done
fi
if [ "$what" = tests ] || [ "$what" = flows ] || [ "$what" = all ]; then
    # The controller's request flows and the model test with Device::cuda (KV contents checked).
    step tests 120 flows env HICACHE_TEST_CUDA=1 HICACHE_TEST_DEVICE=cuda .gpu/flows --test-threads=2
    step tests 90 model env HICACHE_TEST_CUDA=1 HICACHE_TEST_DEVICE=cuda .gpu/model --test-threads=2
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    # The main job with --device cuda: L1<->L2 copies on the GPU, the L3 in a temp dir.
    d=$(mktemp -d)
    step bench 120 main-job-cuda .gpu/hicache-bench --device cuda --report-dir "$d"
    rm -rf "$d"
fi
echo "failed steps: $failed" | tee -a "$out/summary.txt"
exit "$failed"
