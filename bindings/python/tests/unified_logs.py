"""What the two unified-replay tests share: the fixture paths, the configuration lists, SGLang's
replay run once per list, ``hicache-bench tree`` on one configuration, the first difference of
two logs and the totals line a log must end with.

The Rust side is the workspace's ``target/debug/hicache-bench`` (built by ``cargo test
--workspace``; built here with ``cargo build -p hicache-bench`` when absent)."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FIXTURES = os.path.join(ROOT, "hicache-bench", "tests", "fixtures", "unified")
EXPECTED = os.path.join(FIXTURES, "expected")
REPLAY = os.path.join(ROOT, "scripts", "sglang-side-by-side", "unified_replay.py")

#: The per-request columns summed into the totals line when a log has them (host tier).
HOST_COLUMNS = ("host_hit", "ev_host_full", "ev_host_aux", "ev_host_mamba")
# The admission columns a host-tier log ends with (UNIFIED_PROTOCOL.md §10 step 1a).
ADMISSION_COLUMNS = ("host_match", "refused")


def read_configs(path):
    """(name, trace file name, options) per configuration line of ``path``."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, trace, opts = line.rstrip("\n").split("\t")
                out.append((name, trace, opts.split()))
    return out


def hicache_bench():
    """Path of the workspace's debug hicache-bench, built if absent."""
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    exe = os.path.join(target, "debug", "hicache-bench")
    if not os.path.exists(exe):
        cargo = shutil.which("cargo")
        assert cargo is not None, f"{exe} is missing and cargo is not on PATH"
        subprocess.run([cargo, "build", "-p", "hicache-bench"], cwd=ROOT, check=True)
    return exe


def run_sglang(configs, out):
    """SGLang's replay of every configuration of ``configs`` into the directory ``out``, in one
    child process (its scheduler settings are process globals)."""
    run = subprocess.run(
        [sys.executable, REPLAY, "--configs", configs, "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"SGLang's replay failed:\n{run.stderr[-4000:]}"


def run_rust(name, trace, opts, log):
    """``hicache-bench tree`` on one configuration, its log written to ``log``."""
    run = subprocess.run(
        [hicache_bench(), "tree", "--trace", os.path.join(FIXTURES, trace), *opts,
         "--log", str(log), "--min-time-ms", "1"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"hicache-bench tree failed on {name}:\n{run.stderr[-4000:]}"


def first_difference(a, b):
    """A message naming the first differing line of two texts, or None when equal."""
    la, lb = a.split("\n"), b.split("\n")
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            return f"line {i + 1}:\n  sglang: {x!r}\n  rust:   {y!r}"
    if len(la) != len(lb):
        return f"sglang has {len(la)} lines, rust {len(lb)}"
    return None


def expected_totals(header, rows):
    """The totals line of a log with columns ``header`` and the rows ``rows`` (tab-separated
    texts): the sum of every counted column and the last tree sizes, the Mamba and host
    columns where the log has them."""
    cols = [dict(zip(header, r.split("\t"))) for r in rows]
    want = {"requests": len(cols)}
    for k in ("prompt", "matched", "full_hit", "inserted", "ev_full", "ev_aux", "skipped"):
        want[k] = sum(int(c[k]) for c in cols)
    want["final_tree_full"] = int(cols[-1]["tree_full"]) if cols else 0
    want["final_tree_aux"] = int(cols[-1]["tree_aux"]) if cols else 0
    if "ev_mamba" in header:
        want["ev_mamba"] = sum(int(c["ev_mamba"]) for c in cols)
        want["final_tree_mamba"] = int(cols[-1]["tree_mamba"]) if cols else 0
    for k in HOST_COLUMNS + ADMISSION_COLUMNS:
        if k in header:
            want[k] = sum(int(c[k]) for c in cols)
    return "# totals " + " ".join(f"{k}={v}" for k, v in want.items())
