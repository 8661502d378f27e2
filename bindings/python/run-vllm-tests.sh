#!/usr/bin/env bash
# Runs the tests of hicache_rs.vllm against vLLM's own tiering code (tests/test_vllm.py), with
# the wheel run-tests.sh installed into target/python-venv and vLLM from target/python-vllm
# (setup-vllm-env.sh). Run run-tests.sh first (it builds and installs the wheel and the example
# storage plugin). The tests must run here, never skip: HICACHE_REQUIRE_VLLM=1 and
# HICACHE_REQUIRE_REDIS=1 / HICACHE_REQUIRE_PLUGIN=1 make a missing piece a failure.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
bash "$here/setup-vllm-env.sh"
venv="$root/target/python-venv"
cd "$here"
export PYTHONPATH="$root/target/python-vllm${PYTHONPATH:+:$PYTHONPATH}"
export HICACHE_REQUIRE_VLLM=1 HICACHE_REQUIRE_REDIS=1 HICACHE_REQUIRE_PLUGIN=1
# pytest exits 5 when it collected no test: a failure here like any other non-zero code.
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm.py
