#!/usr/bin/env bash
# Builds the wheel with maturin, installs it into target/python-venv and runs the pytest suite.
# pytest's exit code is passed on, except 5 (no test collected), which is a failure here too.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bash "$here/setup-test-env.sh"
venv="$root/target/python-venv"
dist="$root/target/python-dist"
rm -rf "$dist"
(cd "$here" && "$venv/bin/maturin" build --out "$dist")
"$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$dist"/hicache_rs-*.whl
# The example storage plugin (the in-memory backend behind the C ABI), for the `plugin`
# backend's cases of the v2 tests (tests/v2_harness.py finds it in target/debug).
(cd "$root" && cargo build -q -p hicache-plugin-example)
cd "$here"
# The environment above has sglang and torch: their tests must run, never skip.
export HICACHE_REQUIRE_SGLANG=1
# SGLang JIT-builds its native page hash with ninja (from the venv), g++ and OpenSSL headers.
export PATH="$venv/bin:$PATH"
set +e
# vLLM's tests run in their own session with vLLM on PYTHONPATH (run-vllm-tests.sh), so that
# SGLang's modules never see vLLM installed.
"$venv/bin/python" -m pytest -q tests --ignore=tests/test_vllm.py
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no test" >&2
    exit 1
fi
exit "$rc"
