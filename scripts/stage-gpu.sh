#!/usr/bin/env bash
# Builds the GPU test and bench binaries on the development machine (the GPU machine has no
# cargo) and stages them, stripped, in .gpu/ (ignored by git). Then, on the GPU machine, from
# the repository root: `bash scripts/gpu-run.sh` (with the device tool: carry `.gpu`).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
cargo build --release -p hicache-bench
cp target/release/hicache-bench .gpu/
# Prints the executable cargo built for test target $2 of package $1 (release).
# Built with the variables that make the GPU tests run rather than report ignored
# (hicache-gpu/build.rs); gpu-run.sh also passes --include-ignored.
test_bin() {
    HICACHE_TEST_CUDA=1 HICACHE_REQUIRE_NVRTC=1 cargo test --release -p "$1" --test "$2" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$2"
}
for t in cuda_transfers nvrtc_compile; do cp "$(test_bin hicache-gpu "$t")" ".gpu/$t"; done
# The controller's request flows and the model test on Device::cuda (HICACHE_TEST_DEVICE=cuda).
for t in flows model; do cp "$(test_bin hicache "$t")" ".gpu/$t"; done
strip .gpu/hicache-bench .gpu/cuda_transfers .gpu/nvrtc_compile .gpu/flows .gpu/model
ls -l .gpu
