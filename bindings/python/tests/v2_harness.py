"""Shared pieces of the v2 (multi-pool) tests: hybrid pool sets (a KV host pool, a Mamba
state pool, a paged sidecar: the KV-derived DSA indexer or an SWA pool of its own),
SGLang's registration sequence for a backend, deterministic page contents, transfers built
as SGLang's hybrid controller builds them, the backends our package compiles, and an
independent model of the BLOCK_GROUPS hit policy.

Everything here drives SGLang's real host pools and its real ``HiCacheFile``; nothing of
SGLang is re-implemented except the BLOCK_GROUPS model (HiCacheFile refuses that policy)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

import sglang_pools
from backend_configs import BACKENDS, ours_config, plugin_path  # noqa: F401 (re-exported)
from sglang_pools import storage_config

KV, MAMBA, INDEXER, SWA = PoolName.KV, PoolName.MAMBA, PoolName.INDEXER, PoolName.SWA

DYNAMIC = {
    "backend_name": "hicache_rs",
    "module_path": "hicache_rs.sglang",
    "class_name": "HiCacheRsStorage",
    "interface_v1": 1,
}



# ---- pools ----------------------------------------------------------------------------------


class PoolSet:
    """SGLang's real hybrid host pools on CPU (``sglang_pools``), two shapes of hybrid model:

    - ``"dsa"``: the MLA KV host pool of a DSA model (the anchor, 64-token pages, page_first),
      its DSA indexer pool (KV-derived: same host indices) and a Mamba state pool;
    - ``"mha-swa"``: an MHA KV host pool (layer_first, 4-token pages), a sliding-window
      ``swa`` pool with host indices of its own (page_first) and a Mamba state pool.

    ``side`` names the paged sidecar; ``side_derived`` says whether it rides on the KV
    indices. The Mamba pool has page size 1."""

    def __init__(self, kv_pages=32, mamba_slots=32, layout="page_first", kind="dsa"):
        self.kind = kind
        if kind == "dsa":
            self.kv, side = sglang_pools.dsa_pools(
                layout, layers=2, device_tokens=kv_pages * sglang_pools.DSA_PAGE_SIZE // 2)
            self.side, self.side_derived, self.mla = INDEXER, True, True
        else:
            ps = 4
            self.kv = sglang_pools.mha_pool("layer_first", layers=2, heads=1, head_dim=8,
                                            page_size=ps, device_tokens=kv_pages * ps // 2)
            side = sglang_pools.swa_pool("page_first", page_size=ps,
                                         device_tokens=kv_pages * ps // 2)
            self.side, self.side_derived, self.mla = SWA, False, False
        self.indexer = side  # the paged sidecar, whatever its name
        self.mamba = sglang_pools.mamba_pool(layout, layers=2, slots=mamba_slots // 2 + 1)
        self.by_name = {KV: self.kv, MAMBA: self.mamba, self.side: side}
        self.page_size = self.kv.page_size

    def entries(self):
        """(name, pool) in SGLang's registration order: the anchor first."""
        return [(KV, self.kv), (self.side, self.indexer), (MAMBA, self.mamba)]

    def pool(self, name):
        return self.by_name[PoolName(name)]

    def alloc_pages(self, name, pages):
        """Host indices of ``pages`` whole pages of pool ``name``."""
        p = self.pool(name)
        idx = p.alloc(pages * p.page_size)
        assert idx is not None, f"pool {name} is full"
        return idx


def page_bytes(name, key, nbytes):
    """The deterministic content of ``key``'s page in pool ``name``: a SHAKE-256 stream, so a
    reader can check a page from its key alone."""
    return hashlib.shake_256(f"{PoolName(name).value}|{key}".encode()).digest(nbytes)


def write_page(pool, start, data: bytes):
    """Writes a flat data page given as bytes (viewed as the pool's own page dtype)."""
    dtype = pool.get_dummy_flat_data_page().dtype
    page = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    pool.set_from_flat_data_page(start, page)


def read_page(pool, start) -> bytes:
    return pool.get_data_page(start, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def flat_page_len(pool):
    return pool.get_dummy_flat_data_page().view(torch.uint8).numel()


def page_starts(pool, host_indices):
    return host_indices[:: pool.page_size].tolist()


def fill(pools, name, host_indices, keys):
    """Writes each key's deterministic page at its host slot."""
    p = pools.pool(name)
    n = flat_page_len(p)
    for start, key in zip(page_starts(p, host_indices), keys):
        write_page(p, start, page_bytes(name, key, n))


def zero(pools, name, host_indices):
    p = pools.pool(name)
    z = bytes(flat_page_len(p))
    for start in page_starts(p, host_indices):
        write_page(p, start, z)


def chain(tag, pages, page_size=4):
    """A chain of SGLang page hashes (hex strings), distinct per ``tag``."""
    from hicache_rs import sglang_page_hashes

    base = int.from_bytes(hashlib.sha256(str(tag).encode()).digest()[:3], "little") * 64
    return sglang_page_hashes(list(range(base, base + pages * page_size)), page_size)


# ---- backends -------------------------------------------------------------------------------


def register(backend, pools):
    """SGLang's attach sequence (HybridCacheController.attach_storage_backend): the anchor
    pool through ``register_mem_pool_host``, then every pool-group entry through
    ``register_mem_host_pool_v2``, then ``on_host_pools_registered`` once."""
    backend.register_mem_pool_host(pools.kv)
    for name, pool in pools.entries():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def make_reference(pools, directory):
    """SGLang's HiCacheFile over ``directory``."""
    cfg = storage_config({"file_storage_path": str(directory)}, mla=pools.mla,
                         layout=pools.kv.layout)
    return register(HiCacheFile(cfg), pools)


def has_v2(cls):
    return cls.batch_exists_v2 is not HiCacheStorage.batch_exists_v2


def make_ours(pools, extra, **cfg):
    """Our class through SGLang's own parser and factory (``dynamic``), then the attach
    sequence. With HICACHE_V2_SELFCHECK=1, or while our class has no v2 methods, the harness
    is validated with a second HiCacheFile instead (over ``extra['dir']`` or a fresh one)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from hicache_rs.sglang import HiCacheRsStorage

    if os.environ.get("HICACHE_V2_SELFCHECK") == "1":
        d = extra.get("dir") or extra["_selfcheck_dir"]
        return make_reference(pools, d)
    if not has_v2(HiCacheRsStorage):
        pytest.fail("HiCacheRsStorage has no batch_exists_v2 (the v2 interface is not merged)")
    extra = {k: v for k, v in extra.items() if not k.startswith("_")}
    parsed, *_ = HybridCacheController.parse_storage_backend_extra_config(
        json.dumps({**DYNAMIC, **extra}))
    config = storage_config(parsed, mla=pools.mla, layout=pools.kv.layout, **cfg)
    backend = StorageBackendFactory.create_backend("dynamic", config, pools.kv)
    return register(backend, pools)


# ---- transfers ------------------------------------------------------------------------------


def transfer(name, keys, host_indices=None, policy=PoolHitPolicy.ALL_PAGES, **kw):
    return PoolTransfer(name=PoolName(name), keys=None if keys is None else list(keys),
                        host_indices=host_indices,
                        hit_policy=policy, **kw)


def info(prefix_keys):
    return HiCacheStorageExtraInfo(prefix_keys=None if prefix_keys is None else list(prefix_keys))


def result_tuple(r):
    """A PoolTransferResult as plain comparable values (pool names as strings)."""
    return (
        int(r.kv_hit_pages),
        {getattr(k, "value", k): int(v) for k, v in r.extra_pool_hit_pages.items()},
        None if r.restorable_prefix_pages is None else list(r.restorable_prefix_pages),
    )


def plain(results):
    """A batch_get_v2/batch_set_v2 answer with pool names as strings."""
    return {getattr(k, "value", k): [bool(x) for x in v] for k, v in results.items()}


# ---- BLOCK_GROUPS model ---------------------------------------------------------------------


def block_groups_pages(present, group_keys, block_pages, group_pages, kv_pages):
    """The documented meaning of PoolHitPolicy.BLOCK_GROUPS for one pool (SGLang's
    docstring): its keys come in groups of ``group_pages`` keys, group ``g`` standing for the
    FULL pages ``[g * block_pages, (g + 1) * block_pages)`` from the span start; the pool's
    verdict is the number of FULL pages its leading *complete* groups cover (every key of the
    group present; a trailing partial group counts for nothing), as its own verdict: it never
    gates the KV hit. hicache-rs' choice (h24-v2, ``hit_policy.py`` point 6): the verdict is
    capped at the KV hit (``kv_pages``), as FULL pages past it cannot be restored."""
    whole = len(group_keys) // group_pages
    groups = 0
    for g in range(whole):
        if all(k in present for k in group_keys[g * group_pages:(g + 1) * group_pages]):
            groups += 1
        else:
            break
    return min(kv_pages, groups * block_pages)
