"""Bench: hicache-rs as SGLang's L3 against SGLang's own HiCacheFile, same run, same pages.

Both backends are driven by SGLang's own cache-controller code on one real SGLang host pool
(MHA, page_first, bf16, CPU memory):

- ours: ``HiCacheRsStorage`` (file backend) through the controller's zero-copy page functions
  (``_page_set_zero_copy`` / ``_page_get_zero_copy``: ``batch_set_v1`` / ``batch_get_v1``);
- reference: SGLang's ``HiCacheFile`` through the controller's generic page functions
  (``_generic_page_set`` / ``_generic_page_get``: flat page copies, one file per page), which
  is what SGLang uses for its file backend;
- native: the same hicache-rs backend called straight through the native ``Store`` with the
  page pointers computed once, i.e. without the Python class: ``ours / native`` is what the
  class costs.

A hybrid (v2) case (``--only hybrid``; first under ``all``) moves KV pages plus one Mamba
state page per node as SGLang's hybrid controller does: per node one ``batch_set_v2`` (KV +
Mamba, TRAILING_PAGES), one ``batch_exists_v2``, one ``batch_get_v2``, with ours, HiCacheFile
(its v2 methods: one file per page, flat page copies) and the native Store on the same pages;
it reports pages/s and GB/s, the ratios, and the class's overhead per v2 call against the
native Store. Our file backend syncs each batch before acknowledging it by default
(``fsync: batch``); HiCacheFile never syncs, so the like-for-like write row is the
``fsync-none`` one.

Both file backends write to directories side by side under ``--dir`` with buffered I/O (ours
with ``"direct_io": "off"``, as SGLang's HiCacheFile has no other mode), and
every read follows the writes of the same run, so reads are served from a warm page cache on
both sides: the figures compare the two backends' own costs, they are NOT disk speed.
Every set uses fresh keys (a set of present keys is a no-op on both sides). Each figure is the
fastest of ``--repeats`` rounds (after one warm-up round); the three variants run in a
different order every round.

The small-call rows (``--only calls``; also under ``all``) give the class / native ratio
and the microseconds the class adds per call, per method, for dense (v1 methods) and hybrid
(v2 methods, KV + Mamba) pools on the memory and file backends, one 4-token page per call.
The L3 reference rows (``--only mooncake``; also under ``all``) put ours beside SGLang's own
Mooncake Store backend (``MooncakeStore``; PyPI ``mooncake-transfer-engine-non-cuda``, TCP
transport, ``mooncake_master`` and its metadata server started on loopback for the run) with
the same SGLang calls (the controller's ``_page_set_zero_copy`` / ``_page_get_zero_copy`` and
``batch_exists``) on one host pool of 8 MiB pages, ``--mooncake-batch`` (128) pages a call:
our ``memory`` backend against Mooncake with its segment in this process, and our ``redis``
backend (a 3-node Redis Cluster on loopback) against Mooncake with its segment in a separate
store process over TCP, twice: the cluster as docs/user-guide.md deploys it for an L3 (the
servers' jemalloc keeping freed memory, the client's presence cache on: ``redis`` rows) and
everything at its defaults (``redis-defaults`` rows). ``exists-first`` is the first ask of a
batch's keys, ``exists`` the mean of 20 asks after it. Fresh keys every round; both sides' pages are deleted after each
round. Without an importable ``mooncake`` these rows are skipped with a message saying how
to install it (bindings/python/README.md).
``--before-site DIR`` runs the whole bench alternately against the package installed in DIR
(e.g. main's wheel: ``pip install --no-deps --target DIR hicache_rs-*.whl``) and the one in
the environment, in one run, and prints both sides' ratios with the machine's load.

    python bindings/python/bench_sglang.py [--json] [--dir DIR] [--batch 128] [--repeats 3]

Needs the test environment (bindings/python/setup-test-env.sh) and a release build of the
package for meaningful figures (``maturin build --release``).
"""

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))

from conftest import HAVE_SGLANG  # noqa: E402

if not HAVE_SGLANG:
    sys.exit("bench_sglang: sglang and torch are needed (bash bindings/python/setup-test-env.sh)")

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import hicache_rs  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from sglang_pools import (  # noqa: E402
    fill_pages,
    fill_pool_pages,
    mha_pool,
    read_pages,
    read_pool_pages,
    same,
    storage_config,
)

HEADS, HEAD_DIM, LAYERS = 8, 128, 8  # 32 KiB per token (K and V, bf16)
TOKEN_BYTES = 2 * HEADS * HEAD_DIM * 2 * LAYERS


class _Op:
    request_id = "bench"

    @staticmethod
    def is_terminated():
        return False


def _controller_view(backend, pool):
    """The attributes SGLang's controller page functions read from ``self``."""
    return types.SimpleNamespace(storage_backend=backend, storage_host_pool=pool,
                                 page_size=pool.page_size)


def _ours(pool, directory):
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(json.dumps({
        "backend_name": "hicache_rs", "module_path": "hicache_rs.sglang",
        "class_name": "HiCacheRsStorage", "interface_v1": 1,
        "backend": "file", "dir": directory, "direct_io": "off",
    }))
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    b.register_mem_pool_host(pool)
    return b


def _sglang_file(pool, directory):
    cfg = storage_config({"file_storage_path": directory})
    b = StorageBackendFactory.create_backend("file", cfg, pool)
    b.register_mem_pool_host(pool)
    return b


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def bench_page_size(page_tokens, batch, repeats, root):
    """One page geometry: set and get of `batch` pages, three ways."""
    pool = mha_pool("page_first", layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM,
                    page_size=page_tokens, device_tokens=batch * page_tokens, ratio=2.0)
    ps = pool.page_size
    page_bytes = TOKEN_BYTES * ps
    src = pool.alloc(batch * ps)
    dst = pool.alloc(batch * ps)
    fill_pages(pool, src, seed=7)
    written = read_pages(pool, src)
    zero = pool.get_dummy_flat_data_page()
    ours = _ours(pool, os.path.join(root, f"ours-{page_tokens}"))
    ref = _sglang_file(pool, os.path.join(root, f"sglang-{page_tokens}"))
    ours_cc, ref_cc = _controller_view(ours, pool), _controller_view(ref, pool)
    store, ns = ours._store, ours.namespace
    ptrs_src, sizes = pool.get_page_buffer_meta(src)
    ptrs_dst, _ = pool.get_page_buffer_meta(dst)
    times = {k: [] for k in ("set ours", "set ref", "set native", "get ours", "get ref",
                             "get native")}
    nbytes = batch * page_bytes
    for r in range(repeats + 1):  # the first round warms up and is not counted
        base = 1_000_000 * (r + 1)
        k_ours = hicache_rs.sglang_page_hashes(list(range(base, base + batch * ps)), ps)
        k_ref = hicache_rs.sglang_page_hashes(list(range(base + 1, base + 1 + batch * ps)), ps)
        k_nat = hicache_rs.sglang_page_hashes(list(range(base + 2, base + 2 + batch * ps)), ps)
        cases = [
            ("set ours", lambda: HiCacheController._page_set_zero_copy(ours_cc, k_ours, src)),
            ("set ref", lambda: HiCacheController._generic_page_set(ref_cc, k_ref, src)),
            ("set native", lambda: all(store.batch_set_from(ns, k_nat, "page_first",
                                                            ptrs_src, sizes))),
            ("get ours", lambda: HiCacheController._page_get_zero_copy(ours_cc, _Op, k_ours, dst)
             == batch),
            ("get ref", lambda: HiCacheController._generic_page_get(ref_cc, _Op, k_ref, dst)
             == batch),
            ("get native", lambda: all(store.batch_get_into(ns, k_nat, "page_first",
                                                            ptrs_dst, sizes))),
        ]
        # Sets before gets (the gets read what the sets wrote); within each, an order that
        # changes every round, so no variant always follows another's write-back.
        order = random.Random(r)
        sets, gets = cases[:3], cases[3:]
        order.shuffle(sets)
        order.shuffle(gets)
        for name, fn in sets + gets:
            for start in dst[::ps].tolist():
                pool.set_from_flat_data_page(start, zero)
            secs, ok = _timed(fn)
            if not ok:
                raise SystemExit(f"bench_sglang: {name} failed at {page_bytes} B pages")
            if name.startswith("get") and not all(
                    same(a, b) for a, b in zip(read_pages(pool, dst), written)):
                raise SystemExit(f"bench_sglang: {name} read wrong bytes")
            if r > 0:
                times[name].append(secs)
    # batch_exists of a whole batch of present keys.
    k = hicache_rs.sglang_page_hashes(list(range(1_000_000 * repeats, 1_000_000 * repeats
                                                 + batch * ps)), ps)
    kr = hicache_rs.sglang_page_hashes(list(range(1_000_000 * repeats + 1, 1_000_000 * repeats
                                                  + 1 + batch * ps)), ps)
    variants = (("exists ours", lambda: ours.batch_exists(k)),
                ("exists native", lambda: store.batch_exists(ns, k)),
                ("exists ref", lambda: ref.batch_exists(kr)))
    assert all(fn() == batch for _, fn in variants)
    # Rounds alternate between the three; the fastest round of each counts (a loaded
    # machine only ever adds time).
    exists = {name: float("inf") for name, _ in variants}
    for _ in range(5):
        for name, fn in variants:
            t = time.perf_counter()
            for _ in range(50):
                fn()
            exists[name] = min(exists[name], (time.perf_counter() - t) / 50)
    # The one step the class adds to every get/set: SGLang's get_page_buffer_meta.
    t = time.perf_counter()
    for _ in range(50):
        pool.get_page_buffer_meta(dst)
    exists["page meta"] = (time.perf_counter() - t) / 50
    exists["native get call"] = min(times["get native"])
    ours.close()
    # The fastest round of each case counts: a loaded machine only ever adds time.
    gbps = {k: nbytes / min(v) / 1e9 for k, v in times.items()}
    return page_bytes, gbps, exists


# ---- hybrid (v2) case: KV pages + Mamba state pages ---------------------------------------

MAMBA_LAYERS, MAMBA_TEMPORAL, MAMBA_CONVS = 8, (8, 64, 32), ((3, 1024),)  # ~518 KiB / state


def _v2_ours(pools, directory, **more):
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(json.dumps({
        "backend_name": "hicache_rs", "module_path": "hicache_rs.sglang",
        "class_name": "HiCacheRsStorage", "interface_v1": 1,
        "backend": "file", "dir": directory, "direct_io": "off", **more,
    }))
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pools["kv"])
    return _v2_register(b, pools)


def _v2_ref(pools, directory):
    b = StorageBackendFactory.create_backend(
        "file", storage_config({"file_storage_path": directory}), pools["kv"])
    return _v2_register(b, pools)


def _v2_register(b, pools):
    """SGLang's hybrid attach sequence."""
    b.register_mem_pool_host(pools["kv"])
    for name, pool in pools.items():
        b.register_mem_host_pool_v2(pool, PoolName(name))
    b.on_host_pools_registered()
    return b


def bench_hybrid(requests, pages, repeats, root):
    """``requests`` nodes of ``pages`` KV pages each plus one Mamba state at the node's end,
    as SGLang's hybrid controller moves them: per node one ``batch_set_v2`` (KV + Mamba),
    then per node one ``batch_exists_v2`` (Mamba TRAILING_PAGES window of 1), then per node
    one ``batch_get_v2`` (KV + Mamba) into other host slots; ours vs HiCacheFile vs the same
    backend through the native Store (pieces computed once, outside the timing)."""
    from sglang_pools import mamba_pool

    kv = mha_pool("page_first", layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, page_size=16,
                  device_tokens=requests * pages * 16, ratio=2.0)
    mamba = mamba_pool("page_first", layers=MAMBA_LAYERS, slots=requests,
                       temporal=MAMBA_TEMPORAL, convs=MAMBA_CONVS)
    pools = {"kv": kv, "mamba": mamba}
    ps = kv.page_size
    kv_src = [kv.alloc(pages * ps) for _ in range(requests)]
    kv_dst = [kv.alloc(pages * ps) for _ in range(requests)]
    m_src = [mamba.alloc(1) for _ in range(requests)]
    m_dst = [mamba.alloc(1) for _ in range(requests)]
    for r in range(requests):
        fill_pool_pages(kv, kv_src[r], seed=100 + r)
        fill_pool_pages(mamba, m_src[r], seed=200 + r)
    want_kv = [read_pool_pages(kv, i) for i in kv_src]
    want_m = [read_pool_pages(mamba, i) for i in m_src]
    kv_page = kv.get_size_per_token() * ps
    m_page = mamba.get_size_per_token()
    nbytes = requests * (pages * kv_page + m_page)
    npages = requests * (pages + 1)

    ours = _v2_ours(pools, os.path.join(root, "v2-ours"))
    ref = _v2_ref(pools, os.path.join(root, "v2-sglang"))
    # Our default makes a batch durable before acknowledging it (fsync: batch); HiCacheFile
    # never syncs. The like-for-like write figure is ours with `"fsync": "none"`.
    nosync = _v2_ours(pools, os.path.join(root, "v2-ours-nosync"), fsync="none")
    store = ours._store
    ad_kv, ad_m = ours._pools["kv"], ours._pools["mamba"]
    meta = {
        "kv_src": [kv.get_page_buffer_meta(i) for i in kv_src],
        "kv_dst": [kv.get_page_buffer_meta(i) for i in kv_dst],
        "m_src": [mamba.get_page_buffer_meta(i) for i in m_src],
        "m_dst": [mamba.get_page_buffer_meta(i) for i in m_dst],
    }

    def keys_for(tag, rnd):
        return [hicache_rs.sglang_page_hashes(
            list(range(10_000_000 * rnd + 100_000 * r + tag * 10_000,
                       10_000_000 * rnd + 100_000 * r + tag * 10_000 + pages * ps)), ps)
            for r in range(requests)]

    def v2_set(b, ks):
        return all(all(v) for r in range(requests) for v in b.batch_set_v2([
            PoolTransfer(name=PoolName.KV, keys=ks[r], host_indices=kv_src[r]),
            PoolTransfer(name=PoolName.MAMBA, keys=ks[r][-1:], host_indices=m_src[r],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ], HiCacheStorageExtraInfo(prefix_keys=[])).values())

    def v2_exists(b, ks):
        return all(b.batch_exists_v2(ks[r], [
            PoolTransfer(name=PoolName.MAMBA, keys=ks[r][-1:],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)],
            HiCacheStorageExtraInfo(prefix_keys=[])).kv_hit_pages == pages
            for r in range(requests))

    def v2_get(b, ks):
        return all(all(v) for r in range(requests) for v in b.batch_get_v2([
            PoolTransfer(name=PoolName.KV, keys=ks[r], host_indices=kv_dst[r]),
            PoolTransfer(name=PoolName.MAMBA, keys=ks[r][-1:], host_indices=m_dst[r],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ], HiCacheStorageExtraInfo(prefix_keys=[])).values())

    def nat_set(ks):
        ok = True
        for r in range(requests):
            p, z = meta["kv_src"][r]
            ok &= all(store.batch_set_from(ad_kv.namespace, ks[r], ad_kv.store_layout, p, z,
                                           ad_kv.kv_interleaved, prefix_keys=[]))
            p, z = meta["m_src"][r]
            ok &= all(store.batch_set_from(ad_m.namespace, ks[r][-1:], ad_m.store_layout, p,
                                           z, ad_m.kv_interleaved, prefix_keys=[]))
        return ok

    def nat_exists(ks):
        ok = True
        for r in range(requests):
            ok &= store.batch_exists(ad_kv.namespace, ks[r], prefix_keys=[]) == pages
            # The Mamba presence of every page of the KV run: what batch_exists_v2 must ask
            # for SGLang's restorable set (TRAILING_PAGES judges every prefix length).
            ok &= store.batch_exists_each(ad_m.namespace, ks[r], prefix_keys=[])[-1]
        return ok

    def nat_get(ks):
        ok = True
        for r in range(requests):
            p, z = meta["kv_dst"][r]
            ok &= all(store.batch_get_into(ad_kv.namespace, ks[r], ad_kv.store_layout, p, z,
                                           ad_kv.kv_interleaved, prefix_keys=[]))
            p, z = meta["m_dst"][r]
            ok &= all(store.batch_get_into(ad_m.namespace, ks[r][-1:], ad_m.store_layout, p,
                                           z, ad_m.kv_interleaved, prefix_keys=[]))
        return ok

    def zero_dst():
        for r in range(requests):
            for start in kv_dst[r][::ps].tolist():
                kv.set_from_flat_data_page(start, kv.get_dummy_flat_data_page())
            mamba.set_from_flat_data_page(int(m_dst[r][0]), mamba.get_dummy_flat_data_page())

    def check_dst(name):
        for r in range(requests):
            got_kv, got_m = read_pool_pages(kv, kv_dst[r]), read_pool_pages(mamba, m_dst[r])
            if not (all(same(a, b) for a, b in zip(got_kv, want_kv[r]))
                    and all(same(a, b) for a, b in zip(got_m, want_m[r]))):
                raise SystemExit(f"bench_sglang: hybrid {name} read wrong bytes")

    variants = {"ours": (lambda k: v2_set(ours, k), lambda k: v2_exists(ours, k),
                         lambda k: v2_get(ours, k)),
                "ref": (lambda k: v2_set(ref, k), lambda k: v2_exists(ref, k),
                        lambda k: v2_get(ref, k)),
                "native": (nat_set, nat_exists, nat_get),
                "nosync": (lambda k: v2_set(nosync, k), lambda k: v2_exists(nosync, k),
                           lambda k: v2_get(nosync, k))}
    times = {(v, op): [] for v in variants for op in ("set", "exists", "get")}
    for rnd in range(repeats + 1):  # round 0 warms up
        ks = {v: keys_for(i, rnd + 1) for i, v in enumerate(variants)}
        order = list(variants)
        random.Random(rnd).shuffle(order)
        for op_i, op in enumerate(("set", "exists", "get")):
            for v in order:
                if op == "get":
                    zero_dst()
                secs, ok = _timed(lambda: variants[v][op_i](ks[v]))
                if not ok:
                    raise SystemExit(f"bench_sglang: hybrid {op} {v} failed")
                if op == "get":
                    check_dst(v)
                if rnd > 0:
                    times[(v, op)].append(secs)
    # What SGLang's own get_page_buffer_meta costs per v2 get/set call (KV + Mamba pieces):
    # the class computes it on every call, the native variant once outside the timing.
    meta_s = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for r in range(requests):
            kv.get_page_buffer_meta(kv_dst[r])
            mamba.get_page_buffer_meta(m_dst[r])
        meta_s = min(meta_s, time.perf_counter() - t)
    ours.close()
    nosync.close()
    best = {k: min(v) for k, v in times.items()}
    calls = requests  # v2 calls per op and variant
    rows = []
    size = f"{label(kv_page)}kv+{label(m_page)}mamba/{requests}x{pages}"
    for op in ("set", "exists", "get"):
        o, rf, n = best[("ours", op)], best[("ref", op)], best[("native", op)]
        row = {"bench": "sglang-l3-v2", "case": f"file/hybrid-{op}/{size}/vs-HiCacheFile",
               "value": round(npages / o, 1), "unit": "pages/s",
               "reference": round(npages / rf, 1), "ratio": round(rf / o, 3)}
        if op != "exists":
            row["gbps"] = round(nbytes / o / 1e9, 3)
            row["reference_gbps"] = round(nbytes / rf / 1e9, 3)
        rows.append(row)
        rows.append({"bench": "sglang-l3-v2", "case": f"file/hybrid-{op}/{size}/vs-native-store",
                     "value": round(npages / o, 1), "unit": "pages/s",
                     "reference": round(npages / n, 1), "ratio": round(n / o, 3),
                     "overhead_us_per_call": round((o - n) / calls * 1e6, 1)})
    o, rf = best[("nosync", "set")], best[("ref", "set")]
    rows.append({"bench": "sglang-l3-v2",
                 "case": f"file/hybrid-set-fsync-none/{size}/vs-HiCacheFile",
                 "value": round(npages / o, 1), "unit": "pages/s",
                 "reference": round(npages / rf, 1), "ratio": round(rf / o, 3),
                 "gbps": round(nbytes / o / 1e9, 3),
                 "reference_gbps": round(nbytes / rf / 1e9, 3)})
    rows.append({"bench": "sglang-l3-v2", "case": f"file/hybrid-page-meta/{size}",
                 "value": round(meta_s / calls * 1e6, 1), "unit": "us/call"})
    return rows


def bench_call_overhead(backend, kind, root, calls=300, rounds=5):
    """The class's own cost per call, per method, with I/O small: one KV page of 4 tokens
    (plus, ``hybrid``, one small Mamba state) per call, on ``backend`` (``memory``, or ``file``
    with buffered I/O and ``"fsync": "none"``, so that no sync hides the class's cost).
    ``dense``: ``batch_set_v1`` / ``batch_exists`` / ``batch_get_v1`` against the native
    ``batch_set_from`` / ``batch_exists`` / ``batch_get_into``; ``hybrid``: ``batch_set_v2``
    / ``batch_exists_v2`` / ``batch_get_v2`` (KV + Mamba, TRAILING_PAGES) against the same
    native calls per pool (plus ``batch_exists_each`` for the Mamba presence). The native
    variant uses pieces computed once. Fastest of ``rounds`` rounds of ``calls`` calls each;
    the two variants alternate within every round."""
    from sglang_pools import mamba_pool

    kv = mha_pool("page_first", layers=2, heads=1, head_dim=8, page_size=4, device_tokens=64)
    pools = {"kv": kv}
    if kind == "hybrid":
        pools["mamba"] = mamba_pool("page_first", layers=2, slots=8)
    config = {"backend": "memory"} if backend == "memory" else {
        "backend": "file", "dir": os.path.join(root, f"calls-{kind}"), "direct_io": "off",
        "fsync": "none"}
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(json.dumps({
        "backend_name": "hicache_rs", "module_path": "hicache_rs.sglang",
        "class_name": "HiCacheRsStorage", "interface_v1": 1, **config}))
    ours = StorageBackendFactory.create_backend("dynamic", storage_config(extra), kv)
    if kind == "hybrid":
        _v2_register(ours, pools)
    else:
        ours.register_mem_pool_host(kv)
    store, ad_kv = ours._store, ours._pools["kv"]
    src, dst = kv.alloc(4), kv.alloc(4)
    fill_pool_pages(kv, src, seed=1)
    (ps_, zs_), (pd_, zd_) = kv.get_page_buffer_meta(src), kv.get_page_buffer_meta(dst)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    tag = 7_000_000 + (1_000_000 if kind == "hybrid" else 0)
    keys = [hicache_rs.sglang_page_hashes([tag + 10 * i + j for j in range(4)], 4)
            for i in range(calls * (2 * rounds + 2))]
    it = iter(keys)
    ns, lay, inter = ad_kv.namespace, ad_kv.store_layout, ad_kv.kv_interleaved

    if kind == "hybrid":
        mamba, ad_m = pools["mamba"], ours._pools["mamba"]
        msrc, mdst = mamba.alloc(1), mamba.alloc(1)
        fill_pool_pages(mamba, msrc, seed=2)
        (pms, zms) = mamba.get_page_buffer_meta(msrc)
        (pmd, zmd) = mamba.get_page_buffer_meta(mdst)

        def ours_set(k):
            return ours.batch_set_v2([
                PoolTransfer(name=PoolName.KV, keys=k, host_indices=src),
                PoolTransfer(name=PoolName.MAMBA, keys=k, host_indices=msrc,
                             hit_policy=PoolHitPolicy.TRAILING_PAGES)], info)

        def nat_set(k):
            store.batch_set_from(ns, k, lay, ps_, zs_, inter, prefix_keys=[])
            store.batch_set_from(ad_m.namespace, k, ad_m.store_layout, pms, zms,
                                 ad_m.kv_interleaved, prefix_keys=[])

        def ours_exists(k):
            return ours.batch_exists_v2(k, [PoolTransfer(
                name=PoolName.MAMBA, keys=k, hit_policy=PoolHitPolicy.TRAILING_PAGES)], info)

        def nat_exists(k):
            store.batch_exists(ns, k, prefix_keys=[])
            store.batch_exists_each(ad_m.namespace, k, prefix_keys=[])

        def ours_get(k):
            return ours.batch_get_v2([
                PoolTransfer(name=PoolName.KV, keys=k, host_indices=dst),
                PoolTransfer(name=PoolName.MAMBA, keys=k, host_indices=mdst,
                             hit_policy=PoolHitPolicy.TRAILING_PAGES)], info)

        def nat_get(k):
            store.batch_get_into(ns, k, lay, pd_, zd_, inter, prefix_keys=[])
            store.batch_get_into(ad_m.namespace, k, ad_m.store_layout, pmd, zmd,
                                 ad_m.kv_interleaved, prefix_keys=[])

        def check(k):
            return ours_exists(k).kv_hit_pages == 1
        methods = ("batch_set_v2", "batch_exists_v2", "batch_get_v2")
    else:
        def ours_set(k):
            return ours.batch_set_v1(k, src, info)

        def nat_set(k):
            store.batch_set_from(ns, k, lay, ps_, zs_, inter, prefix_keys=[])

        def ours_exists(k):
            return ours.batch_exists(k, info)

        def nat_exists(k):
            store.batch_exists(ns, k, prefix_keys=[])

        def ours_get(k):
            return ours.batch_get_v1(k, dst, info)

        def nat_get(k):
            store.batch_get_into(ns, k, lay, pd_, zd_, inter, prefix_keys=[])

        def check(k):
            return ours_exists(k) == 1
        methods = ("batch_set_v1", "batch_exists", "batch_get_v1")

    best = {}
    stored = []
    for rnd in range(rounds):
        # Who goes first alternates, so neither always follows the other's writes.
        first = (lambda pair: pair) if rnd % 2 == 0 else (lambda pair: pair[::-1])
        for name, fn in first((("ours", ours_set), ("native", nat_set))):
            ks = [next(it) for _ in range(calls)]
            t = time.perf_counter()
            for k in ks:
                fn(k)
            best[("set", name)] = min(best.get(("set", name), 1e9),
                                      (time.perf_counter() - t) / calls)
            if name == "native":
                stored = ks
        for op, fo, fn in (("exists", ours_exists, nat_exists), ("get", ours_get, nat_get)):
            for name, fn_ in first((("ours", fo), ("native", fn))):
                t = time.perf_counter()
                for k in stored:
                    fn_(k)
                best[(op, name)] = min(best.get((op, name), 1e9),
                                       (time.perf_counter() - t) / calls)
    assert check(stored[0])
    ours.close()
    return [{"bench": "sglang-l3-calls",
             "case": f"{backend}/{kind}/{method}/small/class-vs-native",
             "value": round(best[(op, "ours")] * 1e6, 2), "unit": "us/call",
             "reference": round(best[(op, "native")] * 1e6, 2),
             "ratio": round(best[(op, "native")] / best[(op, "ours")], 3),
             "added_us": round((best[(op, "ours")] - best[(op, "native")]) * 1e6, 2)}
            for op, method in zip(("set", "exists", "get"), methods)]


# ---- L3 references: SGLang's own Mooncake Store backend -------------------------------------


def _ours_backend(pool, config):
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(json.dumps({
        "backend_name": "hicache_rs", "module_path": "hicache_rs.sglang",
        "class_name": "HiCacheRsStorage", "interface_v1": 1, **config}))
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    b.register_mem_pool_host(pool)
    return b


def _mooncake_backend(pool, master, metadata, segment_bytes):
    """SGLang's ``MooncakeStore`` as SGLang builds it for ``--hicache-storage-backend
    mooncake``: TCP transport, no local buffer (its zero-copy calls need none), the host pool
    registered with Mooncake; ``segment_bytes`` of segment in this process (0: none)."""
    cfg = storage_config({"master_server_address": master, "metadata_server": metadata,
                          "global_segment_size": segment_bytes, "protocol": "tcp",
                          "device_name": "", "local_hostname": "127.0.0.1",
                          "check_server": False})
    b = StorageBackendFactory.create_backend("mooncake", cfg, pool)
    b.register_mem_pool_host(pool)
    return b


def _l3_pair(pool, src, dst, ours, ref, batch, repeats, tag, sample_dst, want):
    """Set, get and exists of ``batch`` pages through SGLang's controller page functions,
    ours against the reference, alternating who goes first; fresh keys every round, both
    sides' pages deleted at the end of each round (so memory stays bounded). After every get
    the pages ``sample_dst`` (token slots of ``dst``) must hold ``want``. Returns the fastest
    seconds per (op, side)."""
    ps = pool.page_size
    ours_cc, ref_cc = _controller_view(ours, pool), _controller_view(ref, pool)
    zero = pool.get_dummy_flat_data_page()
    best = {}

    def note(key, secs):
        best[key] = min(best.get(key, float("inf")), secs)

    for r in range(repeats + 1):  # round 0 warms up (segments, first faults) and is not kept
        base = 50_000_000 * tag + 1_000_000 * r
        keys = {"ours": hicache_rs.sglang_page_hashes(list(range(base, base + batch * ps)), ps),
                "ref": hicache_rs.sglang_page_hashes(
                    list(range(base + 500_000, base + 500_000 + batch * ps)), ps)}
        sides = {"ours": (ours, ours_cc), "ref": (ref, ref_cc)}
        order = ["ours", "ref"] if r % 2 == 0 else ["ref", "ours"]
        for side in order:
            _, cc = sides[side]
            secs, ok = _timed(lambda: HiCacheController._page_set_zero_copy(cc, keys[side], src))
            if not ok:
                raise SystemExit(f"bench_sglang: {side} set failed ({tag}; the services' logs "
                                 "are kept in hicache-bench-mooncake-logs-*)")
            if r:
                note(("set", side), secs)
        for side in order:
            _, cc = sides[side]
            for start in dst[::ps].tolist():
                pool.set_from_flat_data_page(start, zero)
            secs, n = _timed(lambda: HiCacheController._page_get_zero_copy(cc, _Op, keys[side],
                                                                           dst))
            if n != batch:
                raise SystemExit(f"bench_sglang: {side} get read {n} of {batch} pages ({tag})")
            if not all(same(a, b_) for a, b_ in zip(read_pages(pool, sample_dst), want)):
                raise SystemExit(f"bench_sglang: {side} get read wrong bytes ({tag})")
            if r:
                note(("get", side), secs)
        for side in order:
            b, _ = sides[side]
            # The first ask of the round's keys (nothing of them known to a client-side
            # cache), then 20 asks again (what a cache of ours answers without the servers).
            t = time.perf_counter()
            hits = b.batch_exists(keys[side])
            first = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(20):
                hits = min(hits, b.batch_exists(keys[side]))
            if hits != batch:
                raise SystemExit(f"bench_sglang: {side} exists found {hits} of {batch} ({tag})")
            if r:
                note(("exists-first", side), first)
                note(("exists", side), (time.perf_counter() - t) / 20)
        ours._store.delete(ours.namespace, keys["ours"])
        _mooncake_clear(ref, keys["ref"])
    return best


def _mooncake_clear(ref, keys, within=60.0):
    """Removes the round's objects from ``ref`` (Mooncake's ``remove_all``, what SGLang's
    ``clear`` calls) and waits until all of them went: Mooncake keeps an object that a get or
    exists leased (``default_kv_lease_ttl``; an exists renews the lease, so presence is not
    polled) and its removal skips it until the lease ends. ``remove_all`` returns the number
    removed; two objects (K and V) per page."""
    deadline = time.monotonic() + within
    removed = 0
    while True:
        removed += max(0, ref.store.remove_all())
        if removed >= 2 * len(keys):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_sglang: Mooncake removed {removed} of {2 * len(keys)} "
                             f"objects within {within:.0f} s")
        time.sleep(0.25)


def bench_l3_references(batch, repeats, root, segment_bytes=None):
    """Ours against SGLang's own Mooncake Store backend (``MooncakeStore``, TCP transport,
    ``mooncake_master`` and its metadata server on loopback), same SGLang calls on one host
    pool of 8 MiB pages, ``batch`` pages a call:

    - ``memory`` (in-process) vs Mooncake with its segment in this process;
    - ``redis`` (a 3-node loopback Redis Cluster) vs Mooncake with its segment in a separate
      store process, reached over TCP.

    Returns rows, or none with a message on stderr when mooncake is not importable."""
    import l3_services

    why = l3_services.mooncake_missing()
    if why:
        print(f"bench_sglang: skipping the Mooncake reference rows: {why}", file=sys.stderr)
        return []
    page_tokens = 256  # 8 MiB pages
    pool = mha_pool("page_first", layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM,
                    page_size=page_tokens, device_tokens=batch * page_tokens // 2, ratio=4.0)
    ps = pool.page_size
    page_bytes = TOKEN_BYTES * ps
    nbytes = batch * page_bytes
    # Room for two batches (Mooncake refuses puts well before its segment is full); both
    # stores hold at most this much.
    segment_bytes = segment_bytes or 2 * nbytes + (256 << 20)
    src, dst = pool.alloc(batch * ps), pool.alloc(batch * ps)
    g = torch.Generator().manual_seed(11)
    for start in src[::ps].tolist():
        flat = pool.get_dummy_flat_data_page()
        flat.view(torch.uint8).copy_(torch.randint(0, 256, (flat.numel() * flat.element_size(),),
                                                   generator=g, dtype=torch.uint8))
        pool.set_from_flat_data_page(start, flat)
    # The bytes checked after every get: the first, a middle and the last page.
    picks = sorted({0, batch // 2, batch - 1})
    sample_src = torch.cat([src[i * ps:(i + 1) * ps] for i in picks])
    sample_dst = torch.cat([dst[i * ps:(i + 1) * ps] for i in picks])
    # Kept after a failure (the services' logs say why), removed after a clean run.
    logs = tempfile.mkdtemp(prefix="hicache-bench-mooncake-logs-", dir=os.path.dirname(root))
    rows = []
    size = f"{label(page_bytes)}x{batch}"

    def add(backend, ref_name, best):
        for op in ("set", "get", "exists-first", "exists"):
            o, rf = best[(op, "ours")], best[(op, "ref")]
            row = {"bench": "sglang-l3-ref", "case": f"{backend}/{op}/{size}/vs-{ref_name}"}
            if op.startswith("exists"):
                row.update(value=round(o * 1e6, 1), unit="us/call",
                           reference=round(rf * 1e6, 1), ratio=round(rf / o, 3))
            else:
                row.update(value=round(nbytes / o / 1e9, 3), unit="GB/s",
                           reference=round(nbytes / rf / 1e9, 3), ratio=round(rf / o, 3))
            rows.append(row)

    def run_pair(ours, ref, tag):
        return _l3_pair(pool, src, dst, ours, ref, batch, repeats, tag, sample_dst,
                        read_pages(pool, sample_src))

    # memcpy of the same pieces (glibc's, one thread) into / out of one buffer touched
    # beforehand: the physical limit of an in-process store, measured beside the rest.
    import ctypes

    stage = torch.ones(nbytes, dtype=torch.uint8)
    base = stage.data_ptr()
    ptrs_src, sizes = pool.get_page_buffer_meta(src)
    ptrs_dst, _ = pool.get_page_buffer_meta(dst)

    def memcpy(out):
        off = 0
        for p, z in zip(ptrs_src if out else ptrs_dst, sizes):
            if out:
                ctypes.memmove(base + off, p, z)
            else:
                ctypes.memmove(p, base + off, z)
            off += z
    memcpy_best = {}
    for r in range(repeats + 1):
        for op, out in (("set", True), ("get", False)):
            secs, _ = _timed(lambda: memcpy(out))
            if r:
                memcpy_best[op] = min(memcpy_best.get(op, float("inf")), secs)

    with l3_services.mooncake_master(logs) as (master, meta):
        ref = _mooncake_backend(pool, master, meta, segment_bytes)
        ours = _ours_backend(pool, {"backend": "memory", "capacity": segment_bytes})
        best = run_pair(ours, ref, 1)
        add("memory", "mooncake-in-process", best)
        for op in ("set", "get"):
            o, m = best[(op, "ours")], memcpy_best[op]
            rows.append({"bench": "sglang-l3-ref", "case": f"memory/{op}/{size}/vs-memcpy",
                         "value": round(nbytes / o / 1e9, 3), "unit": "GB/s",
                         "reference": round(nbytes / m / 1e9, 3), "ratio": round(m / o, 3)})
        del stage
        ours.close()
        ref.store.close()
        del ref
    # Two clusters against the same Mooncake store: as the user guide deploys them for an L3
    # (the servers' jemalloc keeps freed memory, as Mooncake keeps its preallocated segment;
    # the client's presence cache on), then everything at its defaults (freed pages go back
    # to the kernel and every value of 8 MiB or more is page-faulted in again on the server;
    # every `batch_exists` asks the servers).
    with l3_services.mooncake_master(logs) as (master, meta), \
            l3_services.mooncake_store_process(master, meta, segment_bytes, logs):
        ref = _mooncake_backend(pool, master, meta, 0)
        guide = (True, {"presence_cache_keys": 65536})
        for tag, (name, (keep, client)) in enumerate(
                (("redis", guide), ("redis-defaults", (False, {}))), start=2):
            with l3_services.redis_cluster(keep_freed_memory=keep) as nodes:
                ours = _ours_backend(pool, {"backend": "redis", "nodes": nodes, **client})
                add(name, "mooncake-tcp-store", run_pair(ours, ref, tag))
                ours.close()
        ref.store.close()
        del ref
    shutil.rmtree(logs, ignore_errors=True)
    return rows


def compare(args):
    """``--before-site``: this bench run alternately against the package installed in that
    directory (e.g. main's wheel, ``pip install --target DIR``) and against the one in the
    environment, ``--compare-rounds`` times each, in one run; per case the best ratio of
    each side (a loaded machine only ever lowers it), with ``uptime`` before and after."""
    import subprocess

    def load():
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])

    print(f"load average (1, 5, 15 min) at start: {load()}")
    best = {}
    order = []
    for rnd in range(args.compare_rounds):
        for side in ("before", "after"):
            env = dict(os.environ)
            if side == "before":
                env["PYTHONPATH"] = args.before_site + os.pathsep + env.get("PYTHONPATH", "")
            cmd = [sys.executable, os.path.abspath(__file__), "--json", "--only", args.only,
                   "--repeats", str(args.repeats), "--batch", str(args.batch),
                   "--big-batch", str(args.big_batch),
                   "--mooncake-batch", str(args.mooncake_batch),
                   "--hybrid-requests", str(args.hybrid_requests),
                   "--hybrid-pages", str(args.hybrid_pages)]
            if args.dir:
                cmd += ["--dir", args.dir]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                tail = "\n".join(out.stderr.splitlines()[-15:])
                raise SystemExit(f"bench_sglang: the {side} run failed ({out.returncode}):\n{tail}")
            for line in out.stdout.splitlines():
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                if "ratio" not in r:
                    continue
                key = (r["case"], side)
                if r["case"] not in order:
                    order.append(r["case"])
                if key not in best or r["ratio"] > best[key]["ratio"]:
                    best[key] = r
        print(f"round {rnd + 1}/{args.compare_rounds} done, load average: {load()}",
              flush=True)
    print(f"{'case':<72} {'before':>8} {'after':>8}  before/after: ours, reference, unit")
    for case in order:
        b, a = best.get((case, "before")), best.get((case, "after"))
        if not (a and b):
            continue
        print(f"{case:<72} {b['ratio']:>8} {a['ratio']:>8}  "
              f"{b['value']}, {b['reference']} / {a['value']}, {a['reference']} {a['unit']}"
              + (f"  added us: {b['added_us']} -> {a['added_us']}" if "added_us" in a else ""))
    print(f"load average at end: {load()}")
    print("ratio: class / native (reference / ours for us/call); higher is better, 1.0 = the "
          "class adds nothing.")


def label(page_bytes):
    return f"{page_bytes // (1 << 20)}MiB" if page_bytes >= 1 << 20 else f"{page_bytes >> 10}KiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per case")
    ap.add_argument("--dir", help="parent directory of both backends' directories")
    ap.add_argument("--batch", type=int, default=128, help="pages per call (SGLang: 128)")
    ap.add_argument("--big-batch", type=int, default=32,
                    help="pages per call at 8 MiB pages (128 needs 3 GiB of host pool)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hybrid-requests", type=int, default=16,
                    help="hybrid case: nodes per op (one v2 call each)")
    ap.add_argument("--hybrid-pages", type=int, default=8,
                    help="hybrid case: KV pages per node (plus one Mamba state)")
    ap.add_argument("--only", choices=("all", "v1", "hybrid", "calls", "mooncake"),
                    default="all",
                    help="calls: only the small-call class/native rows; mooncake: only the "
                    "rows against SGLang's Mooncake Store backend")
    ap.add_argument("--mooncake-batch", type=int, default=128,
                    help="pages of 8 MiB per call in the Mooncake rows (128: 1 GiB a call)")
    ap.add_argument("--before-site",
                    help="compare with the package installed in this directory (same run)")
    ap.add_argument("--compare-rounds", type=int, default=2)
    args = ap.parse_args()
    if args.before_site:
        compare(args)
        return
    root = tempfile.mkdtemp(prefix="hicache-bench-sglang-", dir=args.dir)
    rows = []
    try:
        if args.only in ("all", "hybrid"):
            rows += bench_hybrid(args.hybrid_requests, args.hybrid_pages, args.repeats, root)
        if args.only in ("all", "mooncake"):
            rows += bench_l3_references(args.mooncake_batch, args.repeats, root)
        if args.only in ("all", "calls"):
            for backend in ("memory", "file"):
                for kind in ("dense", "hybrid"):
                    rows += bench_call_overhead(backend, kind, root)
        for tokens, batch in (((8, args.batch), (256, args.big_batch))
                              if args.only in ("all", "v1") else ()):
            page_bytes, gbps, exists = bench_page_size(tokens, batch, args.repeats, root)
            for op in ("set", "get"):
                case = f"file/{op}/{label(page_bytes)}x{batch}"
                rows.append({"bench": "sglang-l3", "case": case + "/vs-HiCacheFile",
                             "value": round(gbps[f"{op} ours"], 3), "unit": "GB/s",
                             "reference": round(gbps[f"{op} ref"], 3),
                             "ratio": round(gbps[f"{op} ours"] / gbps[f"{op} ref"], 3)})
                rows.append({"bench": "sglang-l3", "case": case + "/vs-native-store",
                             "value": round(gbps[f"{op} ours"], 3), "unit": "GB/s",
                             "reference": round(gbps[f"{op} native"], 3),
                             "ratio": round(gbps[f"{op} ours"] / gbps[f"{op} native"], 3)})
            case = f"file/batch_exists/{label(page_bytes)}x{batch}"
            rows.append({"bench": "sglang-l3", "case": case + "/vs-HiCacheFile",
                         "value": round(exists["exists ours"] * 1e6, 1), "unit": "us/call",
                         "reference": round(exists["exists ref"] * 1e6, 1),
                         "ratio": round(exists["exists ref"] / exists["exists ours"], 3)})
            rows.append({"bench": "sglang-l3",
                         "case": f"file/page-meta/{label(page_bytes)}x{batch}/vs-native-get-call",
                         "value": round(exists["page meta"] * 1e6, 1), "unit": "us/call",
                         "reference": round(exists["native get call"] * 1e6, 1),
                         "ratio": round(exists["page meta"] / exists["native get call"], 4)})
            rows.append({"bench": "sglang-l3", "case": case + "/class-overhead",
                         "value": round((exists["exists ours"] - exists["exists native"]) * 1e6, 1),
                         "unit": "us/call"})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{'case':<64} {'value':>10} {'unit':<8} {'reference':>10} {'ratio':>7}  extra")
    for r in rows:
        extra = {k: v for k, v in r.items()
                 if k not in ("bench", "case", "value", "unit", "reference", "ratio")}
        print(f"{r['case']:<64} {r['value']:>10} {r['unit']:<8} "
              f"{r.get('reference', ''):>10} {r.get('ratio', ''):>7}  "
              f"{' '.join(f'{k}={v}' for k, v in extra.items())}")
    print("load average (1, 5, 15 min): %.2f %.2f %.2f" % os.getloadavg())
    print("ratio: ours / reference for GB/s and pages/s; reference / ours for us/call "
          "(higher is better for us), except page-meta: the share "
          "of a native get call the class adds. Reads are from a warm page cache on both "
          "sides (HiCacheFile and our file backend alike): not disk speed. CPU-only figures: "
          "no GPU is involved.")


if __name__ == "__main__":
    main()
