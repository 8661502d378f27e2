"""Issue 26, "Identical to SGLang": for every configuration in
``hicache-bench/tests/fixtures/unified/configs.txt`` SGLang 0.5.23's own ``UnifiedRadixCache``
admitted by its own scheduler code (``PrefillAdder.add_one_req``'s budget), replayed by
``scripts/sglang-side-by-side/unified_replay.py`` (protocol in ``UNIFIED_PROTOCOL.md``
there), and ``hicache-bench tree --components ...`` must write
byte-identical logs. SGLang's logs are also committed (``expected/<name>.log`` beside the
configurations, for Rust-only tests); SGLang's replay must reproduce them exactly.

SGLang runs in one child process for all configurations (its scheduler settings are process
globals, so they stay out of this test process).
"""

import os

import pytest

from conftest import require_sglang
from unified_logs import (
    EXPECTED,
    FIXTURES,
    expected_totals,
    first_difference,
    read_configs,
    run_rust,
    run_sglang,
)

require_sglang()

CONFIGS = os.path.join(FIXTURES, "configs.txt")
CASES = read_configs(CONFIGS)


@pytest.fixture(scope="module")
def sglang_logs(tmp_path_factory):
    """Directory holding SGLang's log for every configuration."""
    out = tmp_path_factory.mktemp("sglang-unified")
    run_sglang(CONFIGS, out)
    return out


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


def test_budget_refuses_requests_that_do_not_fit(sglang_logs):
    """SGLang's admission budget (``PrefillAdder.add_one_req``, UNIFIED_PROTOCOL.md §3 step 2)
    is part of the replay: every log ends with ``refused``; the ``*-skip`` configurations of
    both kinds have requests it refuses, which lock, evict and insert nothing."""
    for name, _, _ in CASES:
        lines = (sglang_logs / f"{name}.log").read_text().rstrip("\n").split("\n")
        header = lines[0].split("\t")
        assert header[-1] == "refused", name
        rows = [dict(zip(header, r.split("\t"))) for r in lines[1:-1]]
        refused = [r for r in rows if r["refused"] == "1"]
        if name.endswith("-skip"):
            assert refused, name
        for r in refused:
            assert (r["inserted"], r["ev_full"], r["ev_aux"], r["skipped"]) == (
                "0", "0", "0", "0"), (name, r)


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
        assert totals == expected_totals(header, rows), name


@pytest.mark.parametrize("name,trace,opts", CASES, ids=[c[0] for c in CASES])
def test_log_identical_to_sglang(name, trace, opts, sglang_logs, tmp_path):
    expected = (sglang_logs / f"{name}.log").read_text()
    assert expected.startswith("idx\tid\tprompt\tmatched\tfull_hit\tbranch\t")
    rust_log = tmp_path / f"{name}.log"
    run_rust(name, trace, opts, rust_log)
    diff = first_difference(expected, rust_log.read_text())
    assert diff is None, f"{name}: the logs differ at {diff}"
