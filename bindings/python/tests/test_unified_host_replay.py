"""Issue 36, "Host tier as SGLang's": for every configuration in
``hicache-bench/tests/fixtures/unified/host_configs.txt`` SGLang 0.5.23's own
``UnifiedRadixCache`` with its hierarchical cache (its ``HybridCacheController`` and host
pools on CPU) admitted by its own scheduler code (``PrefillAdder.add_one_req``: the budget
check with the host hit counted, the load-back, the check again when nothing was loaded),
replayed by ``scripts/sglang-side-by-side/unified_replay.py --host-capacity-pages``
(protocol in ``UNIFIED_PROTOCOL.md`` §10 there), and ``hicache-bench tree --components ...
--host-capacity-pages N`` (the budget of ``hicache_core::UnifiedTree::admission_fits``, the
one ``HybridCache::try_admit`` checks) must write byte-identical logs, host hits, host
evictions and refusals included. SGLang's logs are also committed (``expected/<name>.log``); SGLang's
replay must reproduce them exactly.

SGLang runs in one child process for all configurations (its scheduler settings are process
globals, so they stay out of this test process).
"""

import os

import pytest

from conftest import require_sglang
from unified_logs import (
    EXPECTED,
    FIXTURES,
    ADMISSION_COLUMNS,
    HOST_COLUMNS,
    expected_totals,
    first_difference,
    read_configs,
    run_rust,
    run_sglang,
)

require_sglang()

CONFIGS = os.path.join(FIXTURES, "host_configs.txt")
CASES = read_configs(CONFIGS)


@pytest.fixture(scope="module")
def sglang_logs(tmp_path_factory):
    """Directory holding SGLang's log for every configuration."""
    out = tmp_path_factory.mktemp("sglang-unified-host")
    run_sglang(CONFIGS, out)
    return out


def test_configs_force_host_eviction_for_each_component(sglang_logs):
    """Every configuration has a host tier; [Full, SWA], [Full, Mamba] and
    [Full, SWA, Mamba] are covered, the first two at both page sizes; the logs show host
    hits and host evictions of Full, SWA and Mamba in every kind."""
    names = [c[0] for c in CASES]
    assert all("--host-capacity-pages" in o for _, _, o in CASES)
    for kind in ("swa", "mamba"):
        for page in ("p16", "p64"):
            assert any(n.startswith(f"{kind}-{page}-") for n in names), (kind, page)
    assert any(n.startswith("swamamba-") for n in names)
    seen = {}
    for name in names:
        kind = name.split("-")[0]
        lines = (sglang_logs / f"{name}.log").read_text().rstrip("\n").split("\n")
        header = lines[0].split("\t")
        for row in lines[1:-1]:
            cols = dict(zip(header, row.split("\t")))
            for k in HOST_COLUMNS:
                if int(cols.get(k, 0)) > 0:
                    seen.setdefault(kind, set()).add(k)
    want = {"host_hit", "ev_host_full", "ev_host_aux"}
    assert seen.get("swa", set()) >= want, seen
    assert seen.get("mamba", set()) >= want, seen
    assert seen.get("swamamba", set()) >= want | {"ev_host_mamba"}, seen


def test_budget_refuses_requests_with_their_host_hit(sglang_logs):
    """SGLang's admission budget is part of the replay: in every kind, a ``*-hostbudget``
    configuration has a request refused with a host hit (the load-back and the rest do not
    fit: ``refused`` 1, ``host_match`` > 0, nothing loaded, evicted or inserted) beside
    requests whose hit is loaded back."""
    budget = [n for n, _, _ in CASES if n.endswith("-hostbudget")]
    assert {n.split("-")[0] for n in budget} == {"swa", "mamba", "swamamba"}, budget
    for name in budget:
        lines = (sglang_logs / f"{name}.log").read_text().rstrip("\n").split("\n")
        header = lines[0].split("\t")
        assert header[-len(ADMISSION_COLUMNS):] == list(ADMISSION_COLUMNS), header
        rows = [dict(zip(header, r.split("\t"))) for r in lines[1:-1]]
        refused = [r for r in rows if r["refused"] == "1" and int(r["host_match"]) > 0]
        assert refused, name
        for r in refused:
            assert (r["host_hit"], r["inserted"], r["skipped"]) == ("0", "0", "0"), r
            assert (r["ev_full"], r["ev_aux"], r["ev_host_full"]) == ("0", "0", "0"), r
        assert any(int(r["host_hit"]) > 0 for r in rows), name


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_sglang_reproduces_committed_log(name, sglang_logs):
    with open(os.path.join(EXPECTED, f"{name}.log")) as f:
        committed = f.read()
    diff = first_difference(committed, (sglang_logs / f"{name}.log").read_text())
    assert diff is None, f"{name}: SGLang's replay no longer gives expected/{name}.log: {diff}"


def test_totals_line_sums_the_rows(sglang_logs):
    """The totals line of every SGLang log is the sum of its rows (and its last tree sizes),
    the three-component columns and the host columns in their places."""
    for name, _, _ in CASES:
        lines = (sglang_logs / f"{name}.log").read_text().rstrip("\n").split("\n")
        header, rows, totals = lines[0].split("\t"), lines[1:-1], lines[-1]
        assert totals == expected_totals(header, rows), name


@pytest.mark.parametrize("name,trace,opts", CASES, ids=[c[0] for c in CASES])
def test_log_identical_to_sglang(name, trace, opts, sglang_logs, tmp_path):
    expected = (sglang_logs / f"{name}.log").read_text()
    assert expected.startswith("idx\tid\tprompt\tmatched\tfull_hit\tbranch\t")
    assert "\thost_hit\tev_host_full\tev_host_aux" in expected.split("\n")[0]
    assert expected.split("\n")[0].endswith("\thost_match\trefused")
    rust_log = tmp_path / f"{name}.log"
    run_rust(name, trace, opts, rust_log)
    diff = first_difference(expected, rust_log.read_text())
    assert diff is None, f"{name}: the logs differ at {diff}"
