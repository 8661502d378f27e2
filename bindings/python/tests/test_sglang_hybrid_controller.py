"""A real SGLang HybridCacheController, with its background threads, driving HiCacheRsStorage
(every backend our package compiles) through the v2 multi-pool interface: backup of KV +
KV-derived DSA indexer + Mamba state pages (its backup thread: ``batch_set_v2`` for the
sidecars, the zero-copy v1 set for KV),
the hit query (its prefetch thread: ``batch_exists_v2`` with the Mamba pool's TRAILING_PAGES
window and the indexer's ALL_PAGES, folded into restorable prefixes by SGLang's own
``_sync_prefetch_hit_query``), and the prefetch (its I/O thread: KV v1 reads, KV-derived
indexer ``batch_get_v2`` per batch, then the trailing Mamba window re-aligned by SGLang's
``_sync_trailing_keys`` and read with ``batch_get_v2``) into zeroed host slots. Bytes are
compared per pool and per zero-copy piece.

SGLang's own: the host pools (MLA KV, DSAIndexerPoolHost over a real DSATokenToKVPool on the
CPU device, MambaPoolHost), the pool entries (``hybrid_pool_assembler.build_pool_entry``),
``HostPoolGroup``, the controller, its storage factory, config parser, attach sequence
(register_mem_pool_host, register_mem_host_pool_v2 per entry, on_host_pools_registered),
page hashes and all its threads.

Replaced, and why: ``build_hybrid_mamba_stack`` (the assembler's whole-stack entry point)
needs the model runner's CacheInitParams, the device Mamba pool's allocator and SGLang's
server-args memory config, so the test calls its two storage-relevant pieces
(``build_pool_entry``, ``HostPoolGroup``) itself; the device KV pool and its allocator (the
controller only reads ``device``, ``layer_num`` and ``register_layer_transfer_counter``; no
GPU copy is exercised); and the scheduler thread (the test allocates host slots for the hit
and the Mamba window and hands the operation to the I/O thread, as ``unified_radix_cache``
does)."""

import json
import os
import threading

import pytest

from conftest import require_sglang

require_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (  # noqa: E402
    build_pool_entry,
)
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

import sglang_pools  # noqa: E402
from v2_harness import (  # noqa: E402
    BACKENDS,
    DYNAMIC,
    INDEXER,
    KV,
    MAMBA,
    PoolSet,
    fill,
    flat_page_len,
    ours_config,
    page_bytes,
    page_starts,
    read_page,
    zero,
)

TIMEOUT = 120
PAGES = 6  # request span in pages; nodes A = [0, 3), B = [3, 6)


def controller(pools, storage_backend, extra):
    sglang_pools.set_parallel()
    layers = pools.kv.layer_num
    entries = [
        build_pool_entry(name=KV, host_pool=pools.kv, device_pool=None,
                         layer_mapping={i: i for i in range(layers)},
                         transfer_layer_id_max=layers, is_anchor=True),
        build_pool_entry(name=INDEXER, host_pool=pools.indexer,
                         device_pool=pools.indexer._test_device_pool,
                         layer_mapping={i: i for i in range(layers)},
                         transfer_layer_id_max=layers),
        build_pool_entry(name=MAMBA, host_pool=pools.mamba, device_pool=None,
                         layer_mapping={i: i for i in range(pools.mamba.num_mamba_layers)},
                         transfer_layer_id_max=layers),
    ]
    group = HostPoolGroup(entries)
    parsed, threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(
        json.dumps({**extra, "prefetch_threshold": pools.page_size}))
    return HybridCacheController(
        sglang_pools.Allocator(sglang_pools.DevicePool(layers)), group, pools.page_size,
        tp_group=None, load_cache_event=threading.Event(), io_backend="direct",
        storage_backend=storage_backend, prefetch_threshold=threshold,
        model_name="org/hybrid-model", storage_backend_extra_config=parsed,
    )


@pytest.fixture(params=BACKENDS)
def backend_args(request, tmp_path):
    """Ours (each backend) through SGLang's ``dynamic`` loader (zero-copy v1 for KV); with
    HICACHE_V2_SELFCHECK=1 SGLang's own ``file`` backend (HiCacheFile), to check the test."""
    if os.environ.get("HICACHE_V2_SELFCHECK") == "1":
        return "file", {"file_storage_path": str(tmp_path / "l3")}
    return "dynamic", {**DYNAMIC, **ours_config(request.param, request, tmp_path)}


def sidecars_for_backup(pools, node_hashes, mamba_slot):
    """The transfers unified_radix_cache.write_backup_storage builds for one node: the
    indexer derived from KV (its indices and keys are resolved by the controller), the node's
    Mamba state at its end boundary (one key: the node's last page hash)."""
    out = [PoolTransfer(name=INDEXER, indices_from_pool=KV, hit_policy=PoolHitPolicy.ALL_PAGES)]
    if mamba_slot is not None:
        out.append(PoolTransfer(name=MAMBA, host_indices=mamba_slot, keys=[node_hashes[-1]],
                                hit_policy=PoolHitPolicy.TRAILING_PAGES))
    return out


def backup(cc, pools, tokens, hashes, lo, hi, with_mamba):
    ps = pools.page_size
    kv_src = pools.alloc_pages(KV, hi - lo)
    node = hashes[lo:hi]
    fill(pools, KV, kv_src, node)
    fill(pools, INDEXER, kv_src, node)
    mamba_src = None
    if with_mamba:
        mamba_src = pools.alloc_pages(MAMBA, 1)
        fill(pools, MAMBA, mamba_src, node[-1:])
    cc.write_storage(kv_src, tokens[lo * ps:hi * ps], hash_value=node,
                     extra_pools=sidecars_for_backup(pools, node, mamba_src))
    op = cc.ack_backup_queue.get(timeout=TIMEOUT)
    assert op.completed_tokens == (hi - lo) * ps
    want = {INDEXER.value: hi - lo}
    if with_mamba:
        want[MAMBA.value] = 1
    got = {getattr(k, "value", k): v
           for k, v in op.pool_storage_result.extra_pool_hit_pages.items()}
    assert got == want
    return kv_src


def prefetch(cc, pools, tokens, window=1):
    """Query, then (as the scheduler) allocate host slots for the hit and the Mamba window,
    then let the I/O thread read. Returns (operation, kv host indices, mamba transfer, acks).
    The Mamba transfer's keys are the request's last ``window`` page hashes (the scheduler's
    target span; the controller re-aligns them to the hit)."""
    hashes = get_storage_hash_str(tokens, None, page_size=pools.page_size)
    mamba_t = PoolTransfer(name=MAMBA, keys=hashes[-window:],
                           hit_policy=PoolHitPolicy.TRAILING_PAGES)
    indexer_t = PoolTransfer(name=INDEXER, indices_from_pool=KV,
                             hit_policy=PoolHitPolicy.ALL_PAGES)
    cc.prefetch(CacheRequestHandle(rid=f"r{id(mamba_t)}", attempt_id=0), tokens, None,
                extra_pools=[indexer_t, mamba_t])
    op = cc.prefetch_hit_queue.get(timeout=TIMEOUT)
    if op.storage_hit_count == 0:
        return op, None, mamba_t, []
    dst = cc.alloc_prefetch_host_buffers(op, op.storage_hit_count)
    zero(pools, KV, dst)
    zero(pools, INDEXER, dst)
    mamba_t.host_indices = pools.alloc_pages(MAMBA, window)
    zero(pools, MAMBA, mamba_t.host_indices)
    op.host_indices = dst
    cc.prefetch_buffer.put(op)
    acks = []
    while not acks or not acks[-1].completed_req:
        acks.append(cc.ack_prefetch_queue.get(timeout=TIMEOUT))
    return op, dst, mamba_t, acks


def check_pages(pools, name, host_indices, keys):
    """Every page at ``host_indices`` holds its key's bytes, compared whole and piece by
    piece (SGLang's ``get_page_buffer_meta`` pieces, where the pool has them)."""
    pool = pools.pool(name)
    n = flat_page_len(pool)
    for start, key in zip(page_starts(pool, host_indices), keys):
        want = page_bytes(name, key, n)
        assert read_page(pool, start) == want, (name, key)
        one = host_indices[:0].new_tensor(list(range(start, start + pool.page_size)))
        pieces = sglang_pools.page_pieces(pool, one)
        assert sum(len(p) for p in pieces) == n, (name, [len(p) for p in pieces])
        # The pieces are the flat page's bytes in SGLang's order for these pools.
        assert b"".join(pieces) == want, (name, key)


def test_hybrid_backup_hit_query_and_prefetch(backend_args):
    pools = PoolSet(kv_pages=24, mamba_slots=24)
    ps = pools.page_size
    storage_backend, extra = backend_args
    cc = controller(pools, storage_backend, extra)
    try:
        if storage_backend == "dynamic":
            from hicache_rs.sglang import HiCacheRsStorage

            assert type(cc.storage_backend) is HiCacheRsStorage
            assert cc.page_get_func.__name__ == "_page_get_zero_copy"
            assert cc.page_set_func.__name__ == "_page_set_zero_copy"
        tokens = list(range(100, 100 + PAGES * ps))
        hashes = get_storage_hash_str(tokens, None, page_size=ps)

        # Two nodes backed up, each with its Mamba state at its end: pages 3 and 6 are
        # restorable prefixes; 1, 2, 4, 5 are not (no state there).
        backup(cc, pools, tokens, hashes, 0, 3, with_mamba=True)
        backup(cc, pools, tokens, hashes, 3, PAGES, with_mamba=True)

        # A longer request: KV hits 6 pages, the Mamba window ends at page 6.
        more = tokens + list(range(10_000, 10_000 + 2 * ps))
        op, dst, mamba_t, acks = prefetch(cc, pools, more)
        assert op.pool_storage_result.kv_hit_pages == PAGES
        assert list(op.pool_storage_result.restorable_prefix_pages) == [3, 6]
        assert op.storage_hit_count == PAGES * ps
        assert [a.completed_tokens for a in acks if a.completed_tokens is not None] == [PAGES * ps]
        pool_hits = [a.pool_hits for a in acks if a.pool_hits]
        assert len(pool_hits) == 1 and pool_hits[0][MAMBA.value] == 1
        # KV and indexer pages at the hit slots; the Mamba slot holds page 6's state.
        check_pages(pools, KV, dst, hashes)
        check_pages(pools, INDEXER, dst, hashes)
        assert mamba_t.keys == hashes[PAGES - 1:PAGES]  # re-aligned by _sync_trailing_keys
        check_pages(pools, MAMBA, mamba_t.host_indices, hashes[PAGES - 1:])
    finally:
        cc.detach_storage_backend()
    assert cc.storage_backend is None


def test_a_missing_trailing_state_cuts_the_hit_to_the_last_restorable_prefix(backend_args):
    """Node B's KV and indexer are stored but its Mamba state is not: the usable prefix is
    node A (3 pages), whose state is read back, never page 6's."""
    pools = PoolSet(kv_pages=24, mamba_slots=24)
    ps = pools.page_size
    storage_backend, extra = backend_args
    cc = controller(pools, storage_backend, extra)
    try:
        tokens = list(range(500, 500 + PAGES * ps))
        hashes = get_storage_hash_str(tokens, None, page_size=ps)
        backup(cc, pools, tokens, hashes, 0, 3, with_mamba=True)
        backup(cc, pools, tokens, hashes, 3, PAGES, with_mamba=False)
        op, dst, mamba_t, acks = prefetch(cc, pools, tokens)
        assert op.pool_storage_result.kv_hit_pages == 3
        assert list(op.pool_storage_result.restorable_prefix_pages) == [3]
        assert op.storage_hit_count == 3 * ps
        check_pages(pools, KV, dst, hashes[:3])
        check_pages(pools, INDEXER, dst, hashes[:3])
        assert mamba_t.keys == hashes[2:3]
        check_pages(pools, MAMBA, mamba_t.host_indices, hashes[2:3])
    finally:
        cc.detach_storage_backend()
