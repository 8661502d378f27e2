"""HiCacheRsStorage's multi-pool (v2) interface against SGLang 0.5.23's own code: its real
hybrid host pools (Mamba, SWA, DSA indexer, DeepSeek V4, NVFP4 index rows) on CPU, its
PoolTransfer / PoolTransferResult types, its storage backend factory, and its HiCacheFile as
the reference of the hit policies."""

import json
import random

import pytest

from conftest import require_sglang

require_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import hicache_rs  # noqa: E402
from hicache_rs import hit_policy  # noqa: E402
from sglang_pools import (  # noqa: E402
    dsa_pools,
    fill_pool_pages,
    logical_anchor,
    make_pool,
    mamba_pool,
    mxfp8_pool,
    nvfp4_index_pool,
    page_indices,
    page_pieces,
    read_pool_pages,
    same,
    storage_config,
    swa_pool,
    v4_paged_pool,
    v4_state_pool,
)

DYNAMIC = {
    "backend_name": "hicache_rs",
    "module_path": "hicache_rs.sglang",
    "class_name": "HiCacheRsStorage",
    "interface_v1": 1,
}


def create(ours, anchor, mla=False, **cfg):
    """SGLang's path: its parser, its factory (``cls(config, {})``), then the anchor pool."""
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(
        json.dumps({**DYNAMIC, **ours}))
    config = storage_config(extra, mla=mla, layout=anchor.layout, **cfg)
    backend = StorageBackendFactory.create_backend("dynamic", config, anchor)
    backend.register_mem_pool_host(anchor)
    return backend


def attach(ours, kv, sidecars, mla=False, **cfg):
    """The hybrid controller's order: anchor, every pool of the group through v2 (KV
    included), then on_host_pools_registered."""
    backend = create(ours, kv, mla=mla, **cfg)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    for name, pool in sidecars.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def keys(n, start=0, page_size=4):
    return hicache_rs.sglang_page_hashes(list(range(start, start + n * page_size)), page_size)


def zero_buffers(pool):
    for attr in ("kv_buffer", "temporal_buffer", "conv_buffer", "index_k_with_scale_buffer"):
        v = getattr(pool, attr, None)
        for t in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(t, torch.Tensor):
                t.zero_()


def transfer(name, pool, ks, pages, policy=PoolHitPolicy.ALL_PAGES):
    return PoolTransfer(name=name, host_indices=page_indices(pool, pages), keys=ks,
                        hit_policy=policy)


BACKENDS = {
    "memory": lambda tmp: {"backend": "memory"},
    "file": lambda tmp: {"backend": "file", "dir": str(tmp / "l3")},
    "uring": lambda tmp: {"backend": "uring", "dir": str(tmp / "l3"), "capacity": "256MiB"},
    "rdma": lambda tmp: {"backend": "rdma", "spawn_server": True, "capacity": "64MiB"},
}


def c_memory_plugin(tmp_path):
    """The C example plugin (backends/plugin/examples/c) built with the system's C compiler,
    as the plugin tests build it."""
    import os
    import shutil
    import subprocess

    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the example plugin")
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..", "backends", "plugin")
    out = str(tmp_path / "libhicache_c_memory.so")
    subprocess.run([cc, "-std=c11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
                    "-I", os.path.join(root, "include"), "-o", out,
                    os.path.join(root, "examples", "c", "memory_plugin.c"), "-lpthread"],
                   check=True)
    return out


@pytest.fixture(params=["memory", "file", "uring", "rdma", "redis", "plugin"])
def ours(request, tmp_path):
    if request.param == "redis":
        return {"backend": "redis", "nodes": [request.getfixturevalue("redis_server")],
                "cluster": False, "key_prefix": f"v2{id(tmp_path)}:"}
    if request.param == "plugin":
        return {"backend": "plugin", "plugin_path": c_memory_plugin(tmp_path)}
    return BACKENDS[request.param](tmp_path)


def _mamba(kv):
    return {PoolName.MAMBA: mamba_pool()}


def _swa(kv):
    return {PoolName.SWA: swa_pool()}


def _v4(kv):
    return {PoolName.DEEPSEEK_V4_C4: v4_paged_pool("deepseek_v4_c4"),
            PoolName.DEEPSEEK_V4_C4_STATE: v4_state_pool("deepseek_v4_c4_state"),
            PoolName.DEEPSEEK_V4_C128: v4_paged_pool("deepseek_v4_c128", layout="layer_first",
                                                     item_bytes=40)}


def _nvfp4(kv):
    return {PoolName.INDEXER: nvfp4_index_pool(kv)}


def _draft(kv):
    return {PoolName.DRAFT: make_pool("mha", "page_first", layers=1, heads=1, head_dim=8),
            PoolName.DRAFT_SWA: swa_pool(layers=1)}


KINDS = {"mamba": _mamba, "swa": _swa, "deepseek_v4": _v4, "nvfp4_indexer": _nvfp4,
         "draft": _draft}


def _round_trip(ours, kv, sidecars, page_size, mla=False):
    backend = attach(ours, kv, sidecars, mla=mla)
    pools = {"kv": kv, **{str(n): p for n, p in sidecars.items()}}
    ks = keys(2, page_size=page_size)
    src, dst = [1, 2], [3, 0]
    written, pieces = {}, {}
    for name, pool in pools.items():
        written[name] = fill_pool_pages(pool, page_indices(pool, src), seed=len(name))
        pieces[name] = page_pieces(pool, page_indices(pool, src))
    transfers = [transfer(n, p, ks, src) for n, p in pools.items()]
    assert backend.batch_set_v2(transfers) == {n: [True, True] for n in pools}
    for pool in pools.values():
        zero_buffers(pool)
    res = backend.batch_exists_v2(ks, [transfer(n, p, ks, dst) for n, p in pools.items()
                                       if n != "kv"])
    assert res.kv_hit_pages == 2 and res.restorable_prefix_pages == [1, 2]
    got = backend.batch_get_v2([transfer(n, p, ks, dst) for n, p in pools.items()])
    assert got == {n: [True, True] for n in pools}
    for name, pool in pools.items():
        # Per pool and per piece: the bytes SGLang's own page meta names, and its flat pages.
        assert page_pieces(pool, page_indices(pool, dst)) == pieces[name], name
        for a, b in zip(read_pool_pages(pool, page_indices(pool, dst)), written[name]):
            assert same(a, b), name
    backend.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_pool_kind_round_trips_in_place(kind, tmp_path):
    kv = make_pool("mha", "page_first")
    _round_trip(BACKENDS["file"](tmp_path), kv, KINDS[kind](kv), kv.page_size)


def test_values_of_different_sizes_share_every_backend(ours):
    # Mamba pages are three pieces of 256, 72 and 20 bytes next to KV pages of 384: one store.
    kv = make_pool("mha", "page_first")
    _round_trip(ours, kv, {PoolName.MAMBA: mamba_pool(), PoolName.SWA: swa_pool()},
                kv.page_size)


def test_dsa_indexer_rides_on_mla_kv(tmp_path):
    kv, indexer = dsa_pools()
    _round_trip({"backend": "memory"}, kv, {PoolName.INDEXER: indexer}, kv.page_size, mla=True)


def test_logical_anchor_then_pools_through_v2(tmp_path):
    # DeepSeek V4's order: an allocation-only anchor, registered again as "kv", then the
    # compressed pools; no KV bytes exist, the sidecars decide.
    anchor = logical_anchor(size=36, page_size=4)
    backend = create({"backend": "memory"}, anchor)
    with pytest.raises(RuntimeError, match="no host pool with page memory"):
        backend.batch_exists_v2(keys(1), [])
    backend.register_mem_host_pool_v2(anchor, PoolName.KV)
    c4 = v4_paged_pool("deepseek_v4_c4")
    backend.register_mem_host_pool_v2(c4, PoolName.DEEPSEEK_V4_C4)
    backend.on_host_pools_registered()
    ks = keys(3)
    fill_pool_pages(c4, page_indices(c4, [1, 2]), seed=1)
    want = page_pieces(c4, page_indices(c4, [1, 2]))
    assert backend.batch_set_v1(ks[:2], page_indices(anchor, [1, 2])) == [True, True]
    assert backend.batch_set_v2([transfer("kv", anchor, ks[:2], [1, 2]),
                                 transfer("deepseek_v4_c4", c4, ks[:2], [1, 2])]) == {
        "kv": [True, True], "deepseek_v4_c4": [True, True]}
    res = backend.batch_exists_v2(ks, [transfer("deepseek_v4_c4", c4, ks, [0, 1, 2])])
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (2, [1, 2])
    assert res.extra_pool_hit_pages == {"kv": 3, "deepseek_v4_c4": 2}
    zero_buffers(c4)
    assert backend.batch_get_v2([transfer("deepseek_v4_c4", c4, ks[:2], [3, 4])]) == {
        "deepseek_v4_c4": [True, True]}
    assert page_pieces(c4, page_indices(c4, [3, 4])) == want
    # A dynamic sidecar arriving later, through v2 alone.
    state = v4_state_pool("deepseek_v4_c4_state")
    backend.register_mem_host_pool_v2(state, PoolName.DEEPSEEK_V4_C4_STATE)
    fill_pool_pages(state, page_indices(state, [5]), seed=2)
    assert backend.batch_set_v2([transfer("deepseek_v4_c4_state", state, ks[:1], [5])]) == {
        "deepseek_v4_c4_state": [True]}
    backend.close()


def test_anchor_without_buffer_then_real_kv_pool(tmp_path):
    # An anchor with allocation indices only, then the real KV pool through v2: the v1 KV
    # calls then work on it exactly as in the dense case.
    kv = make_pool("mha", "page_first")
    backend = create({"backend": "memory"}, logical_anchor(size=kv.size, page_size=4))
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba_pool(), PoolName.MAMBA)
    backend.on_host_pools_registered()
    ks = keys(2)
    idx = page_indices(kv, [1, 2])
    fill_pool_pages(kv, idx, seed=3)
    want = read_pool_pages(kv, idx)
    assert backend.batch_set_v1(ks, idx) == [True, True]
    assert backend.batch_exists(ks) == 2
    zero_buffers(kv)
    assert backend.batch_get_v1(ks, idx) == [True, True]
    assert all(same(a, b) for a, b in zip(read_pool_pages(kv, idx), want))
    backend.close()
    # Nothing with memory: the attach fails.
    b = create({"backend": "memory"}, logical_anchor())
    with pytest.raises(ValueError, match="no host pool with page memory"):
        b.on_host_pools_registered()


def test_pools_sglang_cannot_store_are_refused_with_its_reason():
    kv = make_pool("mha", "page_first")
    b = attach({"backend": "memory"}, kv, {})
    with pytest.raises(ValueError, match="scales live outside kv_buffer"):
        b.register_mem_host_pool_v2(mxfp8_pool(), PoolName.SWA)
    with pytest.raises(ValueError, match="already registered"):
        b.register_mem_host_pool_v2(make_pool("mha", "page_first"), PoolName.KV)
    with pytest.raises(ValueError, match="no page memory"):
        b.register_mem_host_pool_v2(logical_anchor(), PoolName.MAMBA)
    with pytest.raises(ValueError, match="not registered"):
        b.batch_get_v2([transfer("mamba", mamba_pool(), keys(1), [1])])
    b.close()


def test_pools_without_pieces_move_as_flat_page_copies(tmp_path):
    # SGLang gives no zero-copy pieces for a Mamba pool with slot side states nor for NVFP4
    # rows in layer_first, but its own flat data pages work (HiCacheFile stores them so).
    kv = make_pool("mha", "layer_first")
    side = mamba_pool(side_state=(3,))
    rows = nvfp4_index_pool(kv, layout="layer_first")
    for pool, match in ((side, "side states"), (rows, "zero-copy layout")):
        with pytest.raises(Exception, match=match):
            pool.get_page_buffer_meta(page_indices(pool, [1]))
    b = attach(BACKENDS["file"](tmp_path), kv, {PoolName.MAMBA: side, PoolName.INDEXER: rows})
    assert b._pools["mamba"].copy and b._pools["indexer"].copy
    ks = keys(2)
    written = {}
    for name, pool in (("mamba", side), ("indexer", rows)):
        written[name] = fill_pool_pages(pool, page_indices(pool, [1, 2]), seed=7)
    assert b.batch_set_v2([transfer("mamba", side, ks, [1, 2]),
                           transfer("indexer", rows, ks, [1, 2])]) == {
        "mamba": [True, True], "indexer": [True, True]}
    zero_buffers(rows)
    for t in side.slot_state_buffers:
        t.zero_()
    zero_buffers(side)
    assert b.batch_get_v2([transfer("mamba", side, ks + keys(1, start=99), [3, 0, 4]),
                           transfer("indexer", rows, ks, [3, 0])]) == {
        "mamba": [True, True, False], "indexer": [True, True]}
    for name, pool in (("mamba", side), ("indexer", rows)):
        got = read_pool_pages(pool, page_indices(pool, [3, 0]))
        assert all(same(a, w) for a, w in zip(got, written[name])), name
    with pytest.raises(ValueError, match="outside the host pool"):
        b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([99]),
                                     keys=ks[:1])])
    b.close()


def test_a_pool_whose_geometry_changed_misses(tmp_path):
    ours = {"backend": "file", "dir": str(tmp_path / "l3")}
    ks = keys(2)
    kv = make_pool("mha", "page_first")
    m = mamba_pool()
    b = attach(ours, kv, {PoolName.MAMBA: m})
    assert all(all(v) for v in b.batch_set_v2([
        transfer("kv", kv, ks, [1, 2]), transfer("mamba", m, ks, [1, 2])]).values())
    b.close()
    for conv, hit in (((6, 3), 2), ((6, 4), 0)):
        m2 = mamba_pool(convs=(conv, (5,)))
        b = attach(ours, make_pool("mha", "page_first"), {PoolName.MAMBA: m2})
        res = b.batch_exists_v2(ks, [transfer("mamba", m2, ks, [1, 2])])
        assert res.kv_hit_pages == hit, conv
        assert res.extra_pool_hit_pages.get("mamba", 0) == hit
        b.close()


def test_v1_kv_pages_hit_through_v2_and_back():
    kv = make_pool("mha", "layer_first")
    b = attach({"backend": "memory"}, kv, {})
    ks = keys(4)
    fill_pool_pages(kv, page_indices(kv, [1, 2, 3, 4]), seed=4)
    want = read_pool_pages(kv, page_indices(kv, [1, 2, 3, 4]))
    assert b.batch_set_v1(ks[:2], page_indices(kv, [1, 2])) == [True, True]
    assert b.batch_set_v2([transfer("kv", kv, ks[2:], [3, 4])]) == {"kv": [True, True]}
    assert b.batch_exists(ks) == 4
    assert b.batch_exists_v2(ks, []).kv_hit_pages == 4
    zero_buffers(kv)
    assert b.batch_get_v2([transfer("kv", kv, ks[:2], [1, 2])]) == {"kv": [True, True]}
    assert b.batch_get_v1(ks[2:], page_indices(kv, [3, 4])) == [True, True]
    got = read_pool_pages(kv, page_indices(kv, [1, 2, 3, 4]))
    assert all(same(a, w) for a, w in zip(got, want))
    b.close()


def test_mla_non_writer_skips_kv_but_writes_mamba_state():
    kv = make_pool("mla", "page_first")
    m = mamba_pool()
    b = attach({"backend": "memory"}, kv, {PoolName.MAMBA: m}, mla=True, tp=(1, 2))
    assert not b.storage_config.is_storage_writer
    ks = keys(2)
    fill_pool_pages(m, page_indices(m, [1, 2]), seed=5)
    assert b.batch_set_v2([transfer("kv", kv, ks, [1, 2]), transfer("mamba", m, ks, [1, 2])]) \
        == {"kv": [True, True], "mamba": [True, True]}
    assert b.batch_exists(ks) == 0  # no KV written by this rank
    mamba_ns = b._pools["mamba"].namespace
    assert b._store.batch_exists_each(mamba_ns, ks) == [True, True]
    # Mamba state is per TP rank even for MLA; the MLA KV namespace is shared.
    b0 = attach({"backend": "memory"}, make_pool("mla", "page_first"),
                {PoolName.MAMBA: mamba_pool()}, mla=True, tp=(0, 2))
    assert b0._pools["mamba"].namespace != mamba_ns
    assert b0.namespace == b.namespace
    b.close()
    b0.close()


def test_bad_host_indices_in_a_v2_transfer_raise_before_anything_is_written():
    kv = make_pool("mha", "page_first")
    m = mamba_pool()
    b = attach({"backend": "memory"}, kv, {PoolName.MAMBA: m})
    ks = keys(2)
    good = transfer("mamba", m, ks, [1, 2])
    for bad, match in (
        (torch.tensor([4, 5, 6, 7, 10_000, 10_001, 10_002, 10_003]), "outside the host pool"),
        (torch.tensor([1, 2, 3, 4, 8, 9, 10, 11]), "does not start a page"),
        (torch.tensor([4, 5, 6, 7, 8, 9, 11, 10]), "breaks its page's run"),
    ):
        t = PoolTransfer(name=PoolName.KV, host_indices=bad, keys=ks)
        with pytest.raises(ValueError, match=match):
            b.batch_set_v2([good, t])
    with pytest.raises(ValueError, match="outside the host pool"):
        b.batch_get_v2([transfer("kv", kv, ks, [1, 2]),
                        PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0, 99]),
                                     keys=ks)])
    assert b._store.batch_exists_each(b._pools["mamba"].namespace, ks) == [False, False]
    assert b.batch_exists(ks) == 0
    # A count mismatch is answered all False for that pool (SGLang's HiCacheFile does so).
    short = PoolTransfer(name=PoolName.KV, host_indices=torch.arange(4, 8), keys=ks)
    assert b.batch_set_v2([good, short]) == {"mamba": [True, True], "kv": [False, False]}
    b.close()


@pytest.mark.parametrize("backend", ["memory", "rdma"])
def test_clear_removes_every_pools_pages(backend, tmp_path):
    # memory clears whole namespaces; rdma has no namespace-wide clear and deletes what this
    # instance stored, per pool.
    kv = make_pool("mha", "page_first")
    m = mamba_pool()
    b = attach(BACKENDS[backend](tmp_path), kv, {PoolName.MAMBA: m}, metrics=True)
    ks = keys(2)
    b.batch_set_v2([transfer("kv", kv, ks, [1, 2]), transfer("mamba", m, ks, [1, 2])])
    stats = b.get_stats()
    assert sum(stats.backup_pgs) == 4  # v2 pages are counted
    b.batch_get_v2([transfer("mamba", m, ks, [3, 4])])
    assert sum(b.get_stats().prefetch_pgs) == 2
    res = b.batch_exists_v2(ks, [transfer("mamba", m, ks, [1, 2])])
    assert res.kv_hit_pages == 2
    b.clear()
    res = b.batch_exists_v2(ks, [transfer("mamba", m, ks, [1, 2])])
    assert res.kv_hit_pages == 0
    assert b._store.batch_exists_each(b._pools["mamba"].namespace, ks) == [False, False]
    b.close()


# ---- hit policies against SGLang's HiCacheFile --------------------------------------------


def _hicache_file(tmp_path):
    cfg = storage_config({"file_storage_path": str(tmp_path / "hf")})
    return HiCacheFile(cfg, file_path=str(tmp_path / "hf"))


POLICIES = [
    # (pool, policy, window: len(transfer.keys))
    [("mamba", PoolHitPolicy.TRAILING_PAGES, 1)],
    [("swa", PoolHitPolicy.TRAILING_PAGES, 3)],
    [("indexer", PoolHitPolicy.ALL_PAGES, 6)],
    [("mamba", PoolHitPolicy.TRAILING_PAGES, 1), ("swa", PoolHitPolicy.TRAILING_PAGES, 2)],
    [("indexer", PoolHitPolicy.ALL_PAGES, 6), ("swa", PoolHitPolicy.TRAILING_PAGES, 2),
     ("mamba", PoolHitPolicy.TRAILING_PAGES, 1)],
    [("swa", PoolHitPolicy.TRAILING_PAGES, 0)],
]


def _patterns(n, seed):
    rng = random.Random(seed)
    yield [True] * n
    yield [False] * n
    yield [True, True, False, True, True, True, True, False][:n]
    for _ in range(6):
        yield [rng.random() < 0.75 for _ in range(n)]


@pytest.mark.parametrize("case", range(len(POLICIES)))
def test_hit_policies_match_sglang_hicache_file(case, tmp_path):
    n = 8
    pools = POLICIES[case]
    ks = keys(n)
    rng = random.Random(case)
    for trial, kv_present in enumerate(_patterns(n, case)):
        present = {name: [rng.random() < 0.7 for _ in range(n)] for name, _, _ in pools}
        if trial == 0:
            present = {name: [True] * n for name, _, _ in pools}
        # The reference: SGLang's own file backend over the same presence pattern.
        hf = _hicache_file(tmp_path / f"t{trial}")
        page = torch.zeros(4, dtype=torch.uint8)
        for i, k in enumerate(ks):
            if kv_present[i]:
                hf.set(k, page)
            for name, _, _ in pools:
                if present[name][i]:
                    hf.set(hf._log_key(name, k), page)
        transfers = [PoolTransfer(name=PoolName(name), keys=ks[:w], hit_policy=pol)
                     for name, pol, w in pools]
        want = hf.batch_exists_v2(ks, transfers)
        kv_pages = hit_policy.leading_run(kv_present)
        got = hit_policy.evaluate(kv_pages, transfers, present)
        assert got == (want.kv_hit_pages, want.extra_pool_hit_pages,
                       list(want.restorable_prefix_pages)), (trial, kv_present, present)


def test_our_storage_answers_hit_policies_as_hicache_file(tmp_path):
    # The same, end to end through our backend: pages written one pool at a time.
    kv = make_pool("mha", "page_first")
    m, s = mamba_pool(), swa_pool()
    b = attach({"backend": "memory"}, kv, {PoolName.MAMBA: m, PoolName.SWA: s})
    n = 6
    ks = keys(n)
    kv_present = [True, True, True, True, True, False]
    present = {"mamba": [False, True, False, True, True, False],
               "swa": [True, False, True, True, True, True]}
    hf = _hicache_file(tmp_path)
    page = torch.zeros(4, dtype=torch.uint8)
    for i, k in enumerate(ks):
        if kv_present[i]:
            b.batch_set_v2([transfer("kv", kv, [k], [1])])
            hf.set(k, page)
        for name, pool in (("mamba", m), ("swa", s)):
            if present[name][i]:
                b.batch_set_v2([transfer(name, pool, [k], [1])])
                hf.set(hf._log_key(name, k), page)
    for pools in ([("mamba", 1)], [("swa", 2)], [("swa", 2), ("mamba", 1)], [("mamba", 3)]):
        transfers = [PoolTransfer(name=PoolName(nm), keys=ks[:w],
                                  hit_policy=PoolHitPolicy.TRAILING_PAGES) for nm, w in pools]
        want = hf.batch_exists_v2(ks, transfers)
        got = b.batch_exists_v2(ks, transfers)
        assert got.kv_hit_pages == want.kv_hit_pages, pools
        assert got.extra_pool_hit_pages == want.extra_pool_hit_pages, pools
        assert list(got.restorable_prefix_pages) == list(want.restorable_prefix_pages), pools
    b.close()


def test_block_groups_report_leading_complete_groups_and_never_gate():
    t = PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, keys=keys(8),
                     hit_policy=PoolHitPolicy.BLOCK_GROUPS, block_pages=2, group_pages=2)
    # Groups {0,1}, {2,3}, {4,5}, {6,7}: the second is incomplete.
    present = {"deepseek_v4_c4": [True, True, True, False, True, True, True, True]}
    assert hit_policy.evaluate(8, [t], present) == (8, {"kv": 8, "deepseek_v4_c4": 2},
                                                    list(range(1, 9)))
    # Capped at the KV run, and reported only when non-zero.
    full = {"deepseek_v4_c4": [True] * 8}
    assert hit_policy.evaluate(3, [t], full)[1] == {"kv": 3, "deepseek_v4_c4": 3}
    none = {"deepseek_v4_c4": [False] * 8}
    assert hit_policy.evaluate(8, [t], none)[1] == {"kv": 8}
    # One group of 4 keys covering 8 FULL pages.
    t2 = PoolTransfer(name=PoolName.DEEPSEEK_V4_C128, keys=keys(4),
                      hit_policy=PoolHitPolicy.BLOCK_GROUPS, block_pages=8, group_pages=4)
    assert hit_policy.evaluate(8, [t2], {"deepseek_v4_c128": [True] * 4})[1] == {
        "kv": 8, "deepseek_v4_c128": 8}
    bad = PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, keys=keys(2),
                       hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    with pytest.raises(ValueError, match="block_pages"):
        hit_policy.check_transfer(bad)
    with pytest.raises(ValueError, match="block_pages"):
        hit_policy.evaluate(2, [bad], {})


def test_block_groups_through_the_backend():
    kv = make_pool("mha", "page_first")
    c4 = v4_paged_pool("deepseek_v4_c4")
    b = attach({"backend": "memory"}, kv, {PoolName.DEEPSEEK_V4_C4: c4})
    ks = keys(4)
    b.batch_set_v2([transfer("kv", kv, ks, [1, 2, 3, 4]),
                    transfer("deepseek_v4_c4", c4, ks[:2], [1, 2])])
    t = PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, keys=ks, host_indices=None,
                     hit_policy=PoolHitPolicy.BLOCK_GROUPS, block_pages=2, group_pages=2)
    res = b.batch_exists_v2(ks, [t])
    assert (res.kv_hit_pages, res.extra_pool_hit_pages) == (4, {"kv": 4, "deepseek_v4_c4": 2})
    b.close()


def test_presence_is_asked_only_for_pools_the_walk_reaches():
    ks = keys(4)
    ts = [PoolTransfer(name=PoolName.INDEXER, keys=ks, hit_policy=PoolHitPolicy.ALL_PAGES),
          PoolTransfer(name=PoolName.MAMBA, keys=ks[-1:],
                       hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    asked = []

    def present(t):
        asked.append(hit_policy.pool_name(t.name))
        return [False] * 4 if t.name == PoolName.INDEXER else [True] * 4

    # The indexer has nothing: nothing is restorable, the Mamba pool is never asked.
    assert hit_policy.evaluate(4, ts, present) == (0, {"kv": 4}, [])
    assert asked == ["indexer"]
    assert hit_policy.evaluate(0, ts, present) == (0, {}, [])
    assert asked == ["indexer"]
