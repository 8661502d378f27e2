"""The storage class's one-native-call path (``hicache_rs.sglang`` point 15,
``hicache_rs.pools`` point 8) on SGLang 0.5.23's real host pools: its piece rules are SGLang's
pieces, it is taken for SGLang's calls (no ``get_page_buffer_meta`` per call), it stores and
answers exactly as the per-pool path does, and what it does not take falls back to that path's
answers and errors."""

import json
import random

import pytest

from conftest import require_sglang

require_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import hicache_rs  # noqa: E402
from hicache_rs.pools import PoolAdapter  # noqa: E402
from sglang_pools import (  # noqa: E402
    LAYOUTS,
    dsa_pools,
    fill_pool_pages,
    make_pool,
    mamba_pool,
    page_indices,
    read_pool_pages,
    same,
    storage_config,
)

DYNAMIC = {"backend_name": "hicache_rs", "module_path": "hicache_rs.sglang",
           "class_name": "HiCacheRsStorage", "interface_v1": 1}


def hybrid(kv, sidecars, ours=None, mla=False):
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(
        json.dumps({**DYNAMIC, **(ours or {"backend": "memory"})}))
    b = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra, mla=mla, layout=kv.layout), kv)
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    for name, pool in sidecars.items():
        b.register_mem_host_pool_v2(pool, name)
    b.on_host_pools_registered()
    return b


def keys(n, start=0):
    return hicache_rs.sglang_page_hashes(list(range(start, start + n * 4)), 4)


def rule_pieces(adapter, host_indices):
    """The pieces the native store makes from the adapter's rules."""
    ptrs, sizes = [], []
    for s in host_indices[:: adapter.page_size].tolist():
        for base, stride, size in adapter.affine:
            ptrs.append(base + (s // adapter.page_size) * stride)
            sizes.append(size)
    return ptrs, sizes


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_piece_rules_are_sglangs_pieces(kind, layout):
    pool = make_pool(kind, layout)
    adapter = PoolAdapter("kv", pool, kv_interleaved=kind == "mha" and layout == "layer_first")
    assert adapter.affine is not None
    pages = pool.size // pool.page_size
    rng = random.Random(3)
    for _ in range(20):
        idx = page_indices(pool, rng.sample(range(pages), rng.randint(1, min(8, pages))))
        ptrs, sizes = pool.get_page_buffer_meta(idx)
        assert rule_pieces(adapter, idx) == ([int(p) for p in ptrs], [int(s) for s in sizes])


def test_piece_rules_of_sidecar_pools_and_of_pools_without_them():
    mamba = mamba_pool()
    kv, indexer = dsa_pools()
    for name, pool in (("mamba", mamba), ("indexer", indexer)):
        adapter = PoolAdapter(name, pool)
        assert adapter.affine is not None, name
        idx = page_indices(pool, [0, pool.size // pool.page_size - 1, 1])
        ptrs, sizes = pool.get_page_buffer_meta(idx)
        assert rule_pieces(adapter, idx) == ([int(p) for p in ptrs], [int(s) for s in sizes])
    # A pool whose pieces come from its own override (not SGLang's arithmetic) has no rules.
    odd = make_pool("mha", "page_first")
    odd.get_page_buffer_meta = type(odd).get_page_buffer_meta.__get__(odd)
    assert PoolAdapter("kv", odd).affine is None
    # A Mamba pool with side states moves copies: no rules, presence only.
    side = PoolAdapter("mamba", mamba_pool(side_state=(3,)))
    assert side.copy and side.affine is None


def test_sglangs_calls_take_the_one_call_path():
    kv, mamba = make_pool("mha", "page_first"), mamba_pool()
    b = hybrid(kv, {PoolName.MAMBA: mamba})
    assert b._native_io == {"kv", "mamba"} and b._native_exists == {"kv", "mamba"}
    src, dst = page_indices(kv, [1, 2]), page_indices(kv, [5, 6])
    msrc, mdst = page_indices(mamba, [1]), page_indices(mamba, [3])
    want_kv, want_m = fill_pool_pages(kv, src, 1), fill_pool_pages(mamba, msrc, 2)
    ks = keys(2, start=100)

    # From here on a per-call get_page_buffer_meta fails: the calls below must not make one.
    def boom(*_):
        raise AssertionError("get_page_buffer_meta called on the one-call path")

    kv.get_page_buffer_meta = boom
    mamba.get_page_buffer_meta = boom
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    ok = b.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=ks, host_indices=src),
                         PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:], host_indices=msrc,
                                      hit_policy=PoolHitPolicy.TRAILING_PAGES)], info)
    assert ok == {"kv": [True, True], "mamba": [True]}
    r = b.batch_exists_v2(ks, [PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:],
                                            hit_policy=PoolHitPolicy.TRAILING_PAGES)], info)
    assert (r.kv_hit_pages, r.extra_pool_hit_pages, r.restorable_prefix_pages) == (
        2, {"kv": 2, "mamba": 2}, [2])
    got = b.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=ks, host_indices=dst),
                          PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:], host_indices=mdst,
                                       hit_policy=PoolHitPolicy.TRAILING_PAGES)], info)
    assert got == {"kv": [True, True], "mamba": [True]}
    assert all(same(a, w) for a, w in zip(read_pool_pages(kv, dst), want_kv))
    assert same(read_pool_pages(mamba, mdst)[0], want_m[0])
    # v1 too: the same KV pages, another slot.
    assert b.batch_get_v1(ks, page_indices(kv, [7, 8])) == [True, True]
    assert b.batch_set_v1(keys(1, start=900), page_indices(kv, [9])) == [True]
    assert b.batch_exists(ks + keys(1, start=500)) == 2
    b.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_both_paths_store_and_answer_alike(layout):
    """Pages written through one path are read through the other, and ``batch_exists_v2``
    answers alike through both on random presence patterns."""
    kv, mamba = make_pool("mha", layout), mamba_pool()
    b = hybrid(kv, {PoolName.MAMBA: mamba})
    native_io, native_exists = set(b._native_io), set(b._native_exists)

    def path(native):
        b._native_io = set(native_io) if native else set()
        b._native_exists = set(native_exists) if native else set()

    rng = random.Random(7)
    for rnd in range(6):
        write_native = rnd % 2 == 0
        n = rng.randint(1, 4)
        ks = keys(n, start=10_000 * (rnd + 1))
        src = page_indices(kv, rng.sample(range(8), n))
        want = fill_pool_pages(kv, src, rnd)
        ms = page_indices(mamba, [rng.randrange(8)])
        want_m = fill_pool_pages(mamba, ms, 100 + rnd)
        path(write_native)
        assert all(all(v) for v in b.batch_set_v2([
            PoolTransfer(name=PoolName.KV, keys=ks, host_indices=src),
            PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:], host_indices=ms)]).values())
        # Take some pages away again, so that the hit policies have holes to judge.
        gone = [k for k in ks if rng.random() < 0.3]
        if gone:
            b._store.delete(b._pools["mamba"].namespace, gone)
        answers = []
        for native in (True, False):
            path(native)
            for policy in (PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES):
                r = b.batch_exists_v2(ks, [PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:],
                                                        hit_policy=policy)])
                answers.append((r.kv_hit_pages, r.extra_pool_hit_pages,
                                r.restorable_prefix_pages))
        assert answers[:2] == answers[2:], answers
        path(not write_native)
        dst = page_indices(kv, rng.sample(range(8, 16), n))
        got = b.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=ks, host_indices=dst)])
        assert got == {"kv": [True] * n}
        assert all(same(a, w) for a, w in zip(read_pool_pages(kv, dst), want))
        md = page_indices(mamba, [8 + rng.randrange(8)])
        got = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:], host_indices=md)])
        assert got == {"mamba": [ks[-1] not in gone]}
        if ks[-1] not in gone:
            assert same(read_pool_pages(mamba, md)[0], want_m[0])
    b.close()


def test_what_the_one_call_path_does_not_take_falls_back():
    kv, mamba = make_pool("mha", "page_first"), mamba_pool()
    b = hybrid(kv, {PoolName.MAMBA: mamba})
    store = b._store
    ks = keys(2, start=300)
    good = page_indices(kv, [1, 2])
    assert store.pool_io(False, [("kv", ks, good)]) is not None
    shifted = good + 1
    for bad in ([("kv", ks, shifted)],                       # not page starts
                [("kv", ks[:1], good)],                      # count mismatch
                [("swa", ks, good)],                         # not registered
                [("kv", ks, good), ("kv", ks, good)],        # one pool twice
                [("kv", ks, good.to(torch.float32))],        # not an integer tensor
                [("kv", ks, good.view(2, 4))],               # not 1-D
                [("kv", ks, good.tolist())],                 # not a tensor
                [("kv", [1, 2], good)]):                     # keys not strings
        assert store.pool_io(False, bad) is None, bad
    # ... and the class then answers or raises as its per-pool path always did.
    with pytest.raises(ValueError, match="does not start a page"):
        b.batch_get_v1(ks, shifted)
    with pytest.raises(ValueError, match="not registered"):
        b.batch_get_v2([PoolTransfer(name=PoolName.SWA, keys=ks, host_indices=good)])
    with pytest.raises(ValueError, match="both name pool 'kv'"):
        b.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=ks, host_indices=good)] * 2)
    assert b.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=ks[:1], host_indices=good)]) == {
        "kv": [False]}
    with pytest.raises(ValueError, match="block_pages"):
        b.batch_exists_v2(ks, [PoolTransfer(name=PoolName.MAMBA, keys=ks,
                                            hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
    # A malformed key is bad input on the one-call path too.
    with pytest.raises(ValueError, match="key 1"):
        b.batch_get_v1([ks[0], "not-a-hash"], good)
    # Pieces still have to lie in the registered memory: a pool registered with rules that
    # point past it is refused at the call.
    store.add_pool("rogue", b.namespace, "page_first", 4, 64, [(8, 64, 64)])
    with pytest.raises(ValueError, match="not wholly inside"):
        store.pool_io(False, [("rogue", ks, good)])
    with pytest.raises(ValueError, match="already registered"):
        store.add_pool("rogue", b.namespace, "page_first", 4, 64, [(8, 64, 64)])
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.pool_io(False, [("kv", ks, good)])
