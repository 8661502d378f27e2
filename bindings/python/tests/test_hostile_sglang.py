"""Hostile use of HiCacheRsStorage (issue 38, round 3 of hardening), against SGLang's own pools
and transfer types. Each test failed on the code before the fix it names.

- every (namespace, key) ever written was kept in ``_stored`` until ``clear``, for every backend
  (~200 B per page per pool: ~17 GiB a day at 1,000 pages/s) (item 6);
- two v2 transfers naming one pool both ran and the first one's answers were dropped (item 8);
- the legacy bytes path asked the native store for keys × page bytes in one call, which it now
  refuses above MAX_CALL_BYTES (item 4): the class splits such reads."""

import tracemalloc

import pytest

from conftest import require_sglang

require_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402

import hicache_rs.sglang as hs  # noqa: E402
from sglang_pools import fill_pages, make_pool, mamba_pool, same  # noqa: E402
from test_sglang_v2 import BACKENDS, attach, keys, transfer  # noqa: E402


def test_a_backend_that_clears_namespaces_keeps_no_key_per_write(tmp_path):
    """Item 6: on a backend with a namespace-wide clear nothing is remembered per write: the
    Python memory of the instance does not grow with the pages written."""
    kv = make_pool("mha", "page_first")
    b = attach({"backend": "memory"}, kv, {})
    idx = kv.alloc(4 * kv.page_size)
    fill_pages(kv, idx, seed=3)

    def write(rounds, start):
        for r in range(rounds):
            assert all(b.batch_set_v1(keys(4, start=start + 16 * r), idx))

    write(50, 0)  # warm up (caches, interned strings)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        write(1000, 10_000)  # 4,000 pages: ~800 KB when every key was kept
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(b._stored) == 0
    assert grown < 200_000, grown
    b.clear()
    assert b.batch_exists(keys(4, start=10_000)) == 0
    b.close()


def test_a_backend_without_clear_remembers_a_bounded_number_of_keys(tmp_path, monkeypatch, caplog):
    """Item 6: where the backend cannot clear a namespace (rdma), the newest STORED_KEYS_MAX
    keys are remembered for ``clear``, never more; ``clear`` deletes those and says how many
    older ones it could not."""
    monkeypatch.setattr(hs, "STORED_KEYS_MAX", 6)
    kv = make_pool("mha", "page_first")
    m = mamba_pool()
    b = attach(BACKENDS["rdma"](tmp_path), kv, {PoolName.MAMBA: m})
    assert b._store.info()["clear"] is False
    for r in range(5):
        ks = keys(2, start=100 * r)
        b.batch_set_v2([transfer("kv", kv, ks, [1, 2]), transfer("mamba", m, ks, [1, 2])])
        assert len(b._stored) <= 6
    assert len(b._stored) == 6 and b._stored_forgotten == 5 * 4 - 6
    newest, oldest = keys(2, start=400), keys(2, start=0)
    with caplog.at_level("WARNING", logger="hicache_rs.sglang"):
        b.clear()
    assert "14 older ones stay" in caplog.text
    assert len(b._stored) == 0
    assert b.batch_exists(newest) == 0
    assert b.batch_exists(oldest) == 2  # forgotten: the backend evicts it in time
    b.close()


def test_two_transfers_of_one_pool_in_one_call_are_refused():
    """Item 8: before, both transfers ran and the second one's answers replaced the first's.
    Now the call is a ValueError naming the pool and both positions, before any I/O."""
    kv = make_pool("mha", "page_first")
    m = mamba_pool()
    b = attach({"backend": "memory"}, kv, {PoolName.MAMBA: m})
    ks = keys(2)
    first = transfer("mamba", m, ks, [1, 2])
    second = PoolTransfer(name=PoolName.MAMBA, host_indices=first.host_indices, keys=ks)
    for call in (b.batch_set_v2, b.batch_get_v2):
        with pytest.raises(ValueError, match=r"transfers 0 and 2 both name pool 'mamba'"):
            call([first, transfer("kv", kv, ks, [1, 2]), second])
    with pytest.raises(ValueError, match="both name pool 'mamba'"):
        b.batch_exists_v2(ks, [first, second])
    # Nothing was written by the refused set.
    assert b._store.batch_exists_each(b._pools["mamba"].namespace, ks) == [False, False]
    assert b.batch_exists(ks) == 0
    # One transfer per pool works as before.
    assert b.batch_set_v2([first, transfer("kv", kv, ks, [1, 2])]) == \
        {"mamba": [True, True], "kv": [True, True]}
    b.close()


def test_legacy_reads_are_split_under_the_native_call_bound(monkeypatch):
    """Item 4: the native store refuses a bytes read above MAX_CALL_BYTES; the legacy
    ``batch_get`` splits its reads so that SGLang's calls still work whatever their size."""
    kv = make_pool("mha", "page_first")
    b = attach({"backend": "memory"}, kv, {})
    n = 6
    idx = kv.alloc(n * kv.page_size)
    fill_pages(kv, idx, seed=11)
    ks = keys(n, start=7_000)
    assert all(b.batch_set_v1(ks, idx))

    def targets(k):
        return [torch.empty_like(kv.get_dummy_flat_data_page()) for _ in range(k)]

    whole = b.batch_get(ks, targets(n))
    # Two pages per native call at most.
    monkeypatch.setattr(hs, "MAX_CALL_BYTES", 2 * b.part_bytes)
    calls = []
    real = b._store

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def batch_get_bytes(self, ns, hashes, layout, length):
            calls.append(len(hashes))
            return real.batch_get_bytes(ns, hashes, layout, length)

    b._store = Spy()
    got = b.batch_get(ks + keys(1, start=99_000), targets(n + 1))
    assert calls == [2, 2, 2, 1]
    assert got[n] is None
    assert all(same(g, w) for g, w in zip(got[:n], whole))
    b._store = real
    b.close()
