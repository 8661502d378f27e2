#!/usr/bin/env bash
# Creates (or refreshes) the vLLM side of the Python test environment under target/: the wheels
# of requirements-vllm.txt are downloaded once into the wheel cache of setup-test-env.sh
# and installed WITHOUT dependencies into target/python-vllm, a plain directory the vLLM tests
# put on PYTHONPATH next to the test venv (target/python-venv, from setup-test-env.sh, which
# supplies torch 2.9.1 and numpy). Nothing is installed into the venv itself. Idempotent.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
wheels="${HICACHE_PYTHON_WHEELS:-$root/target/python-wheels}"
venv="$root/target/python-venv"
site="$root/target/python-vllm"
bash "$here/setup-test-env.sh"
stamp="$wheels/.complete-vllm-$(sha256sum "$here/requirements-vllm.txt" | cut -c1-16)"
if [ ! -e "$stamp" ]; then
    python3 -m pip download --quiet --no-deps --dest "$wheels" -r "$here/requirements-vllm.txt"
    touch "$stamp"
fi
installed="$site/.installed-$(basename "$stamp")"
if [ ! -e "$installed" ]; then
    rm -rf "$site"
    "$venv/bin/python" -m pip install --quiet --no-compile --no-index --no-deps --find-links "$wheels" \
        --target "$site" -r "$here/requirements-vllm.txt"
    touch "$installed"
fi
echo "vLLM test environment ready: $site (PYTHONPATH, with $venv/bin/python)"
