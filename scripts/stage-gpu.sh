#!/usr/bin/env bash
# Builds the GPU test and bench binaries on the development machine (the GPU machine has no
# cargo) and stages them in .gpu/ (ignored by git) together with gpu-run.sh's inputs.
# Then, on the GPU machine, from the repository root: `bash scripts/gpu-run.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
cargo build --release -p hicache-bench
cp target/release/hicache-bench .gpu/
for t in cuda_transfers nvrtc_compile; do
    # Built with the variables that make the GPU tests run rather than report ignored
    # (hicache-gpu/build.rs); gpu-run.sh also passes --include-ignored.
    bin=$(HICACHE_TEST_CUDA=1 HICACHE_REQUIRE_NVRTC=1 \
        cargo test --release -p hicache-gpu --test "$t" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$t")
    cp "$bin" ".gpu/$t"
done
ls -l .gpu
