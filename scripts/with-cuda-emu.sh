#!/usr/bin/env bash
# Runs CMD… against the emulated CUDA driver (hicache-cuda-emu): builds it if needed, links it as
# libcuda.so / libcuda.so.1 in <target>/<profile>/cuda-emu/ (never in <target>/<profile>/ itself,
# where cargo's own library path would hand it to every test), fetches NVRTC 13.0 from PyPI into
# <target>/nvrtc-13.0 (target/nvrtc-13.0 without CARGO_TARGET_DIR, as .ci/run does), puts both on
# LD_LIBRARY_PATH and runs CMD….
#
#   scripts/with-cuda-emu.sh env HICACHE_TEST_CUDA=1 cargo test -p hicache-gpu --test cuda_transfers
#
# HICACHE_CUDA_EMU_PROFILE=release builds the release driver (default: debug, which CI has built).
# Figures measured under the emulator are CPU copies, never GPU speed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
if [ "$#" -eq 0 ]; then
    echo "usage: $0 CMD [ARGS…]" >&2
    exit 2
fi
profile="${HICACHE_CUDA_EMU_PROFILE:-debug}"
target="${CARGO_TARGET_DIR:-$repo/target}"
flags=()
[ "$profile" = release ] && flags=(--release)
(cd "$repo" && cargo build --quiet -p hicache-cuda-emu "${flags[@]}")
lib="$target/$profile/libhicache_cuda_emu.so"
[ -e "$lib" ] || { echo "$lib was not built" >&2; exit 1; }
emu_dir="$target/$profile/cuda-emu"
mkdir -p "$emu_dir"
ln -sf "$lib" "$emu_dir/libcuda.so"
ln -sf "$lib" "$emu_dir/libcuda.so.1"

nvrtc_dir="$target/nvrtc-13.0"
nvrtc_lib="$nvrtc_dir/nvidia/cu13/lib"
if [ ! -e "$nvrtc_lib/libnvrtc.so.13" ]; then
    rm -rf "$nvrtc_dir.tmp" && mkdir -p "$nvrtc_dir.tmp"
    python3 -m pip download --quiet --no-deps --dest "$nvrtc_dir.tmp" 'nvidia-cuda-nvrtc==13.0.*'
    python3 -c 'import sys, zipfile, glob; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in glob.glob(sys.argv[1] + "/*.whl")]' "$nvrtc_dir.tmp"
    rm -f "$nvrtc_dir.tmp"/*.whl
    rm -rf "$nvrtc_dir" && mv "$nvrtc_dir.tmp" "$nvrtc_dir"
fi
export LD_LIBRARY_PATH="$emu_dir:$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export HICACHE_CUDA_EMU=1
exec "$@"
