#!/usr/bin/env bash
# Creates (or refreshes) the Python test environment of the `hicache-rs` package under target/:
# wheels are downloaded once into target/python-wheels (kept between CI runs) and installed
# from there into the virtual environment target/python-venv. Idempotent.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
wheels="$root/target/python-wheels"
venv="$root/target/python-venv"
mkdir -p "$wheels"
stamp="$wheels/.complete-$(sha256sum < "$here/requirements-test.txt" | cut -c1-16)"
if [ ! -e "$stamp" ]; then
    python3 -m pip download --quiet --dest "$wheels" -r "$here/requirements-test.txt"
    touch "$stamp"
fi
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --no-index --find-links "$wheels" -r "$here/requirements-test.txt"
echo "python test environment ready: $venv"
