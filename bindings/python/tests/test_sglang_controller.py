"""A real SGLang HybridCacheController, with its background threads, backing up pages to
hicache-rs and prefetching them back: SGLang's own storage config, factory, page hashes
(its native hash extension, JIT-built), hit query, zero-copy get/set and acks.

What is not SGLang's here: the device pool and its allocator (the controller only reads
``device``, ``layer_num`` and ``register_layer_transfer_counter`` from them; GPU copies are
not exercised), single-rank parallel state, and the test standing in for the scheduler thread
(it allocates host pages for the hit and hands the operation to the I/O thread, as
``unified_radix_cache`` does)."""

import json
import threading

import pytest

from conftest import require_sglang

require_sglang()

import torch  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

import hicache_rs  # noqa: E402
from hicache_rs.sglang import HiCacheRsStorage  # noqa: E402
from sglang_pools import (  # noqa: E402
    Allocator,
    DevicePool,
    fill_pages,
    make_pool,
    read_pages,
    same,
)

TIMEOUT = 120


def controller(pool, ours):
    runtime_context.get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_rank=0, attn_dcp_size=1
    )
    group = HostPoolGroup([
        PoolEntry(name=PoolName.KV, host_pool=pool, device_pool=None,
                  layer_mapper=lambda i: i, is_primary_index_anchor=True)
    ])
    extra, threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(json.dumps({
        "backend_name": "hicache_rs", "module_path": "hicache_rs.sglang",
        "class_name": "HiCacheRsStorage", "interface_v1": 1, "prefetch_threshold": pool.page_size,
        **ours,
    }))
    return HybridCacheController(
        Allocator(DevicePool(pool.layer_num)), group, pool.page_size, tp_group=None,
        load_cache_event=threading.Event(), io_backend="direct", storage_backend="dynamic",
        prefetch_threshold=threshold, model_name="org/model", storage_backend_extra_config=extra,
    )


@pytest.mark.parametrize("kind,layout", [("mha", "layer_first"), ("mha", "page_first"),
                                         ("mla", "page_first_direct")])
def test_backup_hit_query_and_prefetch_round_trip(kind, layout, tmp_path):
    pool = make_pool(kind, layout, device_tokens=256)
    cc = controller(pool, {"backend": "file", "dir": str(tmp_path / "l3")})
    try:
        assert isinstance(cc.storage_backend, HiCacheRsStorage)
        # interface_v1 selected SGLang's zero-copy page functions.
        assert cc.page_get_func.__name__ == "_page_get_zero_copy"
        assert cc.page_set_func.__name__ == "_page_set_zero_copy"
        ps = pool.page_size
        tokens = list(range(7, 7 + 6 * ps))
        hashes = get_storage_hash_str(tokens, None, page_size=ps)
        # SGLang's hash chain is ours, bit for bit.
        assert hashes == hicache_rs.sglang_page_hashes(tokens, ps)

        # Backup: the backup thread writes, the ack carries the tokens written.
        src = pool.alloc(6 * ps)
        written = fill_pages(pool, src, seed=11)
        cc.write_storage(src, tokens, hash_value=hashes)
        op = cc.ack_backup_queue.get(timeout=TIMEOUT)
        assert op.completed_tokens == 6 * ps

        # Prefetch of a longer request: the hit query finds the six stored pages.
        more = tokens + list(range(10_000, 10_000 + 2 * ps))
        op = cc.prefetch(CacheRequestHandle(rid="r1", attempt_id=0), more, None)
        op = cc.prefetch_hit_queue.get(timeout=TIMEOUT)
        assert op.storage_hit_count == 6 * ps
        assert op.hash_value == hashes
        # The scheduler's part: host pages for the hit, then the I/O thread reads into them.
        dst = pool.alloc(op.storage_hit_count)
        op.host_indices = dst
        cc.prefetch_buffer.put(op)
        acks = []
        while not acks or not acks[-1].completed_req:
            acks.append(cc.ack_prefetch_queue.get(timeout=TIMEOUT))
        assert [a.completed_tokens for a in acks if a.completed_tokens is not None] == [6 * ps]
        assert all(same(a, b) for a, b in zip(read_pages(pool, dst), written))
        assert cc.storage_backend.backend_stats()["get_hits"] == 6
    finally:
        cc.detach_storage_backend()
    # Detach closed the backend.
    assert cc.storage_backend is None


def test_the_hybrid_controllers_attach_registers_every_pool(tmp_path):
    """SGLang's own attach order for a hybrid group: the anchor through
    register_mem_pool_host, every group entry (KV included) through
    register_mem_host_pool_v2, then on_host_pools_registered; a sidecar added later arrives
    through v2 alone (register_host_pool_entry). SGLang's backup thread then writes a Mamba
    state through batch_set_v2 next to the KV pages (batch_set_v1)."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer
    from sglang_pools import fill_pool_pages, mamba_pool, page_pieces, swa_pool

    pool = make_pool("mha", "page_first", device_tokens=256)
    mamba = mamba_pool()
    runtime_context.get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_rank=0, attn_dcp_size=1
    )
    group = HostPoolGroup([
        PoolEntry(name=PoolName.KV, host_pool=pool, device_pool=None,
                  layer_mapper=lambda i: i, is_primary_index_anchor=True),
        PoolEntry(name=PoolName.MAMBA, host_pool=mamba, device_pool=None,
                  layer_mapper=lambda i: i),
    ])
    extra, threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(json.dumps({
        "backend_name": "hicache_rs", "module_path": "hicache_rs.sglang",
        "class_name": "HiCacheRsStorage", "interface_v1": 1, "prefetch_threshold": pool.page_size,
        "backend": "file", "dir": str(tmp_path / "l3"),
    }))
    cc = HybridCacheController(
        Allocator(DevicePool(pool.layer_num)), group, pool.page_size, tp_group=None,
        load_cache_event=threading.Event(), io_backend="direct", storage_backend="dynamic",
        prefetch_threshold=threshold, model_name="org/model", storage_backend_extra_config=extra,
    )
    try:
        backend = cc.storage_backend
        assert isinstance(backend, HiCacheRsStorage)
        assert sorted(backend._pools) == ["kv", "mamba"]
        assert backend._pools["kv"].pool is pool and backend._pools["mamba"].pool is mamba
        # Backup through SGLang's backup thread: the Mamba state of the last page goes through
        # batch_set_v2, the KV pages through batch_set_v1; then SGLang's hit query
        # (batch_exists_v2) sees both.
        ps = pool.page_size
        tokens = list(range(3, 3 + 4 * ps))
        hashes = get_storage_hash_str(tokens, None, page_size=ps)
        src = pool.alloc(4 * ps)
        fill_pages(pool, src, seed=5)
        slot = torch.tensor([2], dtype=torch.int64)
        fill_pool_pages(mamba, slot, seed=6)
        state = page_pieces(mamba, slot)
        mt = PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=hashes[-1:],
                          hit_policy=PoolHitPolicy.TRAILING_PAGES)
        cc.write_storage(src, tokens, hash_value=hashes, extra_pools=[mt])
        op = cc.ack_backup_queue.get(timeout=TIMEOUT)
        assert op.completed_tokens == 4 * ps
        assert backend._store.batch_exists_each(backend._pools["mamba"].namespace, hashes) == [
            False, False, False, True]
        res = backend.batch_exists_v2(hashes, [PoolTransfer(
            name=PoolName.MAMBA, keys=hashes[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        assert (res.kv_hit_pages, res.restorable_prefix_pages) == (4, [4])
        mamba.temporal_buffer.zero_()
        for c in mamba.conv_buffer:
            c.zero_()
        assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slot,
                                                  keys=hashes[-1:])]) == {"mamba": [True]}
        assert page_pieces(mamba, slot) == state
        swa = swa_pool()
        cc.register_host_pool_entry(PoolEntry(name=PoolName.SWA, host_pool=swa,
                                              device_pool=None, layer_mapper=lambda i: i))
        assert backend._pools["swa"].pool is swa
    finally:
        cc.detach_storage_backend()
