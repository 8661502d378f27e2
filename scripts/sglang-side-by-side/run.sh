#!/usr/bin/env bash
# SGLang side by side, from a fresh clone: SGLang's own RadixCache against `hicache-bench tree`
# on the same token trace (per-request hits checked equal), and SGLang's own HiCacheFile against
# our file backend (`hicache-bench storage --backend file`) on the same page sizes and disk.
# Prints both figures and their ratio for every case; see README.md here.
#
# Environment (all optional):
#   SGLANG_PYTHON   a Python that already has sglang 0.5.23 and torch (skips the venv below)
#   SBS_TOTAL       bytes per page size for the file comparison (default 1GiB)
#   SBS_MIN_TIME    seconds each tree replay is repeated for (default 3)
#   HICACHE_BENCH   a built hicache-bench binary (default: cargo build --release)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="$root/target/sglang-side-by-side"
mkdir -p "$work"

if [ -z "${HICACHE_BENCH:-}" ]; then
    (cd "$root" && cargo build --release -p hicache-bench --quiet)
    HICACHE_BENCH="${CARGO_TARGET_DIR:-$root/target}/release/hicache-bench"
fi

if [ -z "${SGLANG_PYTHON:-}" ]; then
    # Wheels from PyPI, downloaded once into target/ and installed from there into a venv.
    wheels="$work/wheels"
    venv="$work/venv"
    stamp="$(cat "$here/requirements.txt" "$here/requirements-nodeps.txt" | sha256sum | cut -c1-16)"
    if [ ! -e "$wheels/.complete-$stamp" ]; then
        mkdir -p "$wheels"
        python3 -m pip download --quiet --dest "$wheels" -r "$here/requirements.txt"
        python3 -m pip download --quiet --no-deps --dest "$wheels" -r "$here/requirements-nodeps.txt"
        touch "$wheels/.complete-$stamp"
    fi
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    if [ ! -e "$venv/.installed-$stamp" ]; then
        "$venv/bin/python" -m pip install --quiet --no-index --find-links "$wheels" -r "$here/requirements.txt"
        "$venv/bin/python" -m pip install --quiet --no-index --no-deps --find-links "$wheels" -r "$here/requirements-nodeps.txt"
        touch "$venv/.installed-$stamp"
    fi
    SGLANG_PYTHON="$venv/bin/python"
fi

exec python3 "$here/side_by_side.py" --bench "$HICACHE_BENCH" --python "$SGLANG_PYTHON" \
    --work "$work" --total "${SBS_TOTAL:-1GiB}" --min-time "${SBS_MIN_TIME:-3}" "$@"
