"""Issue 26, "Identical to SGLang": for every configuration in
``hicache-bench/tests/fixtures/unified/configs.txt`` SGLang 0.5.23's own ``UnifiedRadixCache``
(replayed by ``scripts/sglang-side-by-side/unified_replay.py``, protocol in
``UNIFIED_PROTOCOL.md`` there) and ``hicache-bench tree --components ...`` must write
byte-identical logs. SGLang's logs are also committed (``expected/<name>.log`` beside the
configurations, for Rust-only tests); SGLang's replay must reproduce them exactly.

SGLang runs in one child process for all configurations (its scheduler settings are process
globals, so they stay out of this test process). The Rust side is the workspace's
``target/debug/hicache-bench`` (built by ``cargo test --workspace``; built here with
``cargo build -p hicache-bench`` when absent).
"""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import require_sglang

require_sglang()

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FIXTURES = os.path.join(ROOT, "hicache-bench", "tests", "fixtures", "unified")
CONFIGS = os.path.join(FIXTURES, "configs.txt")
EXPECTED = os.path.join(FIXTURES, "expected")
REPLAY = os.path.join(ROOT, "scripts", "sglang-side-by-side", "unified_replay.py")


def read_configs():
    """(name, trace file name, options) per configuration line."""
    out = []
    with open(CONFIGS) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, trace, opts = line.rstrip("\n").split("\t")
                out.append((name, trace, opts.split()))
    return out


CASES = read_configs()


def hicache_bench():
    """Path of the workspace's debug hicache-bench, built if absent."""
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    exe = os.path.join(target, "debug", "hicache-bench")
    if not os.path.exists(exe):
        cargo = shutil.which("cargo")
        assert cargo is not None, f"{exe} is missing and cargo is not on PATH"
        subprocess.run([cargo, "build", "-p", "hicache-bench"], cwd=ROOT, check=True)
    return exe


@pytest.fixture(scope="module")
def sglang_logs(tmp_path_factory):
    """Directory holding SGLang's log for every configuration."""
    out = tmp_path_factory.mktemp("sglang-unified")
    run = subprocess.run(
        [sys.executable, REPLAY, "--configs", CONFIGS, "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"SGLang's replay failed:\n{run.stderr[-4000:]}"
    return out


def first_difference(a, b):
    """A message naming the first differing line of two texts, or None when equal."""
    la, lb = a.split("\n"), b.split("\n")
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            return f"line {i + 1}:\n  sglang: {x!r}\n  rust:   {y!r}"
    if len(la) != len(lb):
        return f"sglang has {len(la)} lines, rust {len(lb)}"
    return None


def test_configs_cover_every_component_and_page_size():
    """The configuration list forces what the issue asks for, at both page sizes, and has
    [Full, SWA, Mamba] lines (issue 36)."""
    names = [c[0] for c in CASES]
    for kind in ("swa", "mamba"):
        for page in ("p16", "p64"):
            assert any(n.startswith(f"{kind}-{page}-") for n in names), (kind, page)
    assert any(n.startswith("swamamba-") for n in names)
    assert any(n.endswith("swaevict") for n in names)
    assert any(n.endswith("mambaevict") for n in names)
    assert any(n.startswith("swa-") and n.endswith("fullevict") for n in names)
    assert any(n.startswith("mamba-") and n.endswith("fullevict") for n in names)
    windows = [int(o[o.index("--swa-window") + 1]) for _, _, o in CASES if "--swa-window" in o]
    pages = {int(o[o.index("--page-size") + 1]) for _, _, o in CASES}
    assert any(all(w % p == 0 for p in pages) for w in windows)
    assert any(all(w % p != 0 for p in pages) for w in windows)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_sglang_reproduces_committed_log(name, sglang_logs):
    with open(os.path.join(EXPECTED, f"{name}.log")) as f:
        committed = f.read()
    diff = first_difference(committed, (sglang_logs / f"{name}.log").read_text())
    assert diff is None, f"{name}: SGLang's replay no longer gives expected/{name}.log: {diff}"


def test_totals_line_sums_the_rows(sglang_logs):
    """The totals line of every SGLang log is the sum of its rows (and its last tree sizes)."""
    for name, _, _ in CASES:
        lines = (sglang_logs / f"{name}.log").read_text().rstrip("\n").split("\n")
        header, rows, totals = lines[0].split("\t"), lines[1:-1], lines[-1]
        cols = [dict(zip(header, r.split("\t"))) for r in rows]
        want = {"requests": len(cols)}
        for k in ("prompt", "matched", "full_hit", "inserted", "ev_full", "ev_aux", "skipped"):
            want[k] = sum(int(c[k]) for c in cols)
        want["final_tree_full"] = int(cols[-1]["tree_full"]) if cols else 0
        want["final_tree_aux"] = int(cols[-1]["tree_aux"]) if cols else 0
        if "ev_mamba" in header:
            want["ev_mamba"] = sum(int(c["ev_mamba"]) for c in cols)
            want["final_tree_mamba"] = int(cols[-1]["tree_mamba"]) if cols else 0
        expected = "# totals " + " ".join(f"{k}={v}" for k, v in want.items())
        assert totals == expected, name


@pytest.mark.parametrize("name,trace,opts", CASES, ids=[c[0] for c in CASES])
def test_log_identical_to_sglang(name, trace, opts, sglang_logs, tmp_path):
    expected = (sglang_logs / f"{name}.log").read_text()
    assert expected.startswith("idx\tid\tprompt\tmatched\tfull_hit\tbranch\t")
    rust_log = tmp_path / f"{name}.log"
    run = subprocess.run(
        [hicache_bench(), "tree", "--trace", os.path.join(FIXTURES, trace), *opts,
         "--log", str(rust_log), "--min-time-ms", "1"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"hicache-bench tree failed on {name}:\n{run.stderr[-4000:]}"
    diff = first_difference(expected, rust_log.read_text())
    assert diff is None, f"{name}: the logs differ at {diff}"
