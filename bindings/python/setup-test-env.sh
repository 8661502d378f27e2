#!/usr/bin/env bash
# Creates (or refreshes) the Python test environment of the `hicache-rs` package under target/:
# wheels are downloaded once into a cache outside the clone ($HICACHE_PYTHON_WHEELS, default
# ~/.cache/hicache-rs/python-wheels: 3.5 GB of torch and CUDA libraries that a fresh clone, a
# worktree or `cargo clean` need not fetch again) and installed from there into the virtual
# environment target/python-venv, without byte-compiling every module (Python compiles what it
# imports). Idempotent.
#   requirements-test.txt:   pytest, maturin, torch's and SGLang's light import-time deps
#   requirements-sglang.txt: sglang, torch (+ the CUDA libraries `import torch` links), triton,
#                            torchvision, compressed-tensors; all without dependencies
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
wheels="${HICACHE_PYTHON_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/hicache-rs/python-wheels}"
venv="$root/target/python-venv"
mkdir -p "$wheels"
stamp="$wheels/.complete-$(cat "$here/requirements-test.txt" "$here/requirements-sglang.txt" | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
    python3 -m pip download --quiet --dest "$wheels" -r "$here/requirements-test.txt"
    python3 -m pip download --quiet --no-deps --dest "$wheels" -r "$here/requirements-sglang.txt"
    touch "$stamp"
fi
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
installed="$venv/.installed-$(basename "$stamp")"
if [ ! -e "$installed" ]; then
    "$venv/bin/python" -m pip install --quiet --no-compile --no-index --find-links "$wheels" -r "$here/requirements-test.txt"
    "$venv/bin/python" -m pip install --quiet --no-compile --no-index --no-deps --find-links "$wheels" -r "$here/requirements-sglang.txt"
    touch "$installed"
fi
echo "python test environment ready: $venv"
