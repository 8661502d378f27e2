#!/usr/bin/env bash
# Creates (or refreshes) the Python test environment of the `hicache-rs` package under target/:
# wheels are downloaded once into target/python-wheels (kept between runs) and installed from
# there into the virtual environment target/python-venv. Idempotent.
#   requirements-test.txt:   pytest, maturin, torch's and SGLang's light import-time deps
#   requirements-sglang.txt: sglang, torch (+ the CUDA libraries `import torch` links), triton,
#                            torchvision, compressed-tensors; all without dependencies
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
wheels="$root/target/python-wheels"
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
    "$venv/bin/python" -m pip install --quiet --no-index --find-links "$wheels" -r "$here/requirements-test.txt"
    "$venv/bin/python" -m pip install --quiet --no-index --no-deps --find-links "$wheels" -r "$here/requirements-sglang.txt"
    touch "$installed"
fi
echo "python test environment ready: $venv"
