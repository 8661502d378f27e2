#!/usr/bin/env bash
# Creates (or refreshes) the Python test environment of the `hicache-rs` package under target/:
# wheels are downloaded once into target/python-wheels (the project keeps what it downloads
# under target/; $HICACHE_PYTHON_WHEELS names another directory, e.g. one shared by worktrees,
# so that 3.5 GB of torch and CUDA libraries are fetched once per machine) and installed from there into the virtual
# environment target/python-venv, without byte-compiling every module (Python compiles what it
# imports). Idempotent.
#   requirements-test.txt:   pytest, maturin, torch's and SGLang's light import-time deps
#   requirements-sglang.txt: sglang, torch (+ the CUDA libraries `import torch` links), triton,
#                            torchvision, compressed-tensors; all without dependencies
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
wheels="${HICACHE_PYTHON_WHEELS:-$root/target/python-wheels}"
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
