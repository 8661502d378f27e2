"""SGLang's ``dynamic`` L3 backend: :class:`HiCacheRsStorage`.

SGLang loads it with::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicache_rs",
        "module_path": "hicache_rs.sglang", "class_name": "HiCacheRsStorage",
        "interface_v1": 1, "backend": "file", "dir": "/var/cache/kv"}'

Its storage factory constructs the class as ``cls(storage_config, {})``; the host KV pool
arrives later through :meth:`HiCacheRsStorage.register_mem_pool_host` (and, for hybrid
models, every pool of the group through :meth:`HiCacheRsStorage.register_mem_host_pool_v2`),
and only then is the backend opened (the page geometry and layout are known only then).

Model of the class (each point is kept by the code named in it):

1. The extra-config is hicache-rs' own (``{"backend": "file", "dir": ...}``, ``rdma``,
   ``uring``, ``plugin``, ``memory``), strict: unknown fields are a ``ValueError`` naming them.
   The fields SGLang itself reads (``backend_name``, ``module_path``, ``class_name``,
   ``interface_v1``) are taken out first (``_our_extra_config``), and so are the ones its
   prefill parser removes but its decode-side offload manager passes on (``prefetch_*``,
   ``hicache_storage_pass_prefix_keys``: point 13) and ``tp_lcm_size`` (point 11).
2. SGLang's keys are bare content hashes. Every key is paired with a namespace built from the
   model name, dtype, layout, page geometry, TP/PP rank (not for MLA, whose latent cache is the
   same on every rank), context-parallel shard and tenant (``_namespace``), so two deployments
   that differ in any of these never read each other's pages. Each other pool of a hybrid
   model (v2) stores its page under the same key in a namespace of its own: the pool's name
   and geometry fingerprint (``hicache_rs.pools``) plus model, TP/PP, CP and tenant
   (``_pool_namespace``), so a pool whose shape changed never serves old bytes. The KV pool's
   namespace is the same through v1 and v2, so KV pages written by either are hits for both.
   Mamba state is TP-sharded even on MLA models (as SGLang's HiCacheFile keys it).
3. Zero copy: ``batch_get_v1``/``batch_set_v1`` hand the host pool's own page pieces
   (``get_page_buffer_meta``) to the native store, which reads and writes them in place with
   the GIL released. The bytes stored for a page are the pool's flat data page in every layout,
   so the legacy tensor methods (``get``/``set``) and the zero-copy ones share pages.
4. A miss is a miss: a page the backend does not have, or cannot read intact, is ``False``
   (``None`` in the legacy methods), and a failing backend (I/O error, server gone) is logged
   and answered as misses or failed writes, never an exception in SGLang's I/O threads. Bad
   input (mismatched counts, an unsupported pool, a call after ``close``) raises.
5. Only the storage writer writes: on an MLA rank that is not SGLang's storage writer the set
   methods write nothing and report success, as SGLang's own backends do; ``batch_set_v2``
   still writes the TP-sharded pools (Mamba state) there.
6. Prefix keys: with SGLang's ``hicache_storage_pass_prefix_keys``, the v1 calls carry
   ``extra_info.prefix_keys`` (the hashes of the request's pages before the batch); they and
   ``extra_info.extra_info`` (as JSON text) reach the Rust backend with every batch
   (``_context``), so a backend can place a request's pages together. Without the flag SGLang
   passes none, and none is passed on.
7. Thread safety: registrations are serialised by one lock and only ever add pools (a
   dynamic sidecar may arrive while I/O runs; a call sees a pool once its adapter is in the
   table); otherwise the instance changes only its metrics lists and the remembered stored
   keys (point 14), both behind one lock; the native store is safe under SGLang's concurrent prefetch, query
   and backup threads.
8. No memory outside the pool, ever. SGLang's ``get_page_buffer_meta`` turns host indices
   into addresses without checking them, so the v1 calls check them first
   (``_check_host_indices``): a 1-D integer tensor on the CPU, one whole page per key, every
   index inside the pool (``0 <= i < pool.size``), each page a contiguous run starting at a
   multiple of the page size (what SGLang's allocator hands out and what
   ``get_page_buffer_meta``, reading only ``indices[::page_size]``, assumes). Anything else
   is a ``ValueError`` naming the key, the position, the value and the pool size, before a
   pointer exists. The v2 calls check every transfer's indices against that transfer's pool
   the same way, all transfers before any I/O. Behind that, the native store is told every
   registered pool's buffers (``Store.set_allowed_regions`` for the first,
   ``Store.add_allowed_regions`` for pools registered later; ``_pool_regions``,
   ``pools.buffer_regions``) and refuses any piece outside them. The legacy tensor methods
   pass ``bytes`` (copies), never addresses of caller tensors.
9. Attach order of hybrid models: SGLang may give ``register_mem_pool_host`` a logical anchor
   (allocation indices only, no ``kv_buffer``), then register the real pools, "kv" included,
   through ``register_mem_host_pool_v2``, then call ``on_host_pools_registered`` (which fails
   the attach when no pool has memory); sidecars may also arrive later through v2 alone. The
   backend opens when the first pool with memory is known. While KV is only a logical anchor
   (DeepSeek V4) no KV bytes exist, as in SGLang's Mooncake backend: the v1 KV calls check
   their indices and answer done, ``batch_exists`` answers 0, and ``batch_exists_v2`` starts
   from every page and lets the sidecar pools decide (0 when no pool gates). A dense model
   (``register_mem_pool_host`` with the KV pool) works exactly as without v2.
10. v2 I/O: ``batch_exists_v2`` has SGLang's HiCacheFile semantics (``hicache_rs.hit_policy``,
    including ``block_groups``, which HiCacheFile lacks); per-key presence of a pool comes
    from ``Store.batch_exists_each``. A pool SGLang gives no pieces for but whose flat data
    pages work (``hicache_rs.pools`` point 7) moves its pages as ``bytes`` copies through
    those. The KV pool's v2 transfers are stored in the same parts as its v1 calls (point 11).
    ``batch_get_v2``/``batch_set_v2`` answer one bool per key and pool; a transfer whose index
    count does not match its keys is logged and answered all ``False`` (as HiCacheFile does);
    an unregistered pool or bad host indices raise. Metrics count v2 pages with the v1 ones;
    ``clear`` covers every registered pool's namespaces.
11. ``page_head`` and heterogeneous TP (``hicache_rs.kv_layouts``): a page may be stored as
    several parts, one namespace each (``namespaces``), and is present, read or written only
    when every part is. A ``page_head`` page is cut into ``tp_lcm_size / tp_size`` head slices
    (SGLang's ``get_split_heads_page_buffer_meta``), each named by its global slice out of
    ``tp_lcm_size`` and the per-slice geometry, never by this instance's TP size, so
    instances of different TP sizes (prefill TP 2, decode TP 4) read each other's pages head
    for head. ``tp_lcm_size`` comes from SGLang's storage config (its controller pops it from
    the extra-config), or from the extra-config when a config was built without that step;
    one that is not a multiple of ``tp_size``, or heads that do not divide into the slices,
    are a ``ValueError``. Such sharing needs storage the instances share: the local-directory
    backends only with the file backend's ``"shared": true``. MLA is unaffected (its latent
    cache is the same on every rank, and SGLang's MLA pool has no ``page_head``).
12. Asymmetric K/V head dims (SGLang's ``AsymmetricMHATokenToKVPoolHost``, ``page_first``
    and ``page_first_direct``): K and V are two buffers, both registered (point 8); a page is
    its K piece then its V piece, and the namespace carries both head dims. SGLang gives such
    pools no flat data page, so only the zero-copy methods serve them (the legacy ones say
    so).
13. Decode-side offload in PD disaggregation (``--disaggregation-decode-enable-offload-
    kvcache``): the decode instance's controller writes its generated pages with
    ``batch_set_v1`` under SGLang's hash chain continued from the prompt's page-aligned hash,
    with no prefix keys. Its pages are in the same namespace as a prefill instance's when
    the two agree on model name, dtype, ``--hicache-mem-layout``, page size, TP/PP geometry
    (or, for ``page_head``, ``tp_lcm_size``) and tenant, and so are hits for a later prefill
    on any instance sharing the storage. The decode side reads the extra-config with
    ``json.loads`` itself, so SGLang's prefetch fields arrive here and are dropped (point 1).
14. Bounded state: the keys this instance wrote are remembered only for ``clear`` on a
    backend without a namespace-wide clear (``info()["clear"]`` false: rdma, plugins before
    ABI 1.2), and only the newest ``STORED_KEYS_MAX`` of them (``_remember``); ``clear``
    there deletes those and logs how many older ones it could not. A backend that clears
    whole namespaces costs no memory per write. Bytes reads go to the native store in calls
    of at most ``MAX_CALL_BYTES`` (``_get_bytes``), and a v2 call naming one pool in two
    transfers is a ``ValueError`` before anything is read or written (``_check_distinct``).
15. One native call per batch: every pool whose page pieces follow fixed rules
    (``hicache_rs.pools`` point 8) and whose page has one stored part is registered with
    the native store (``Store.add_pool``, ``_add_native``), and so is, for presence only,
    every other pool with one namespace. ``batch_get_v1``/``batch_set_v1``,
    ``batch_get_v2``/``batch_set_v2``, ``batch_exists`` and ``batch_exists_v2`` then hand the
    whole call to the store (``Store.pool_io``, ``Store.pool_exists``), which checks the host
    indices (point 8's rules), makes the pieces, evaluates the hit policies (point 10) and
    runs every backend call with the GIL released once; no Python object per page is made.
    A call that
    path does not take (a pool without rules, two parts per page, a logical KV anchor, a
    non-writer's set, bad indices, a count mismatch, an unknown policy) is answered ``None``
    by the store before any I/O and runs through the per-pool path below, which answers or
    raises exactly as before.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import numpy
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransferResult,
)

from hicache_rs import hit_policy, kv_layouts
from hicache_rs._native import MAX_CALL_BYTES, Store, check_extra_config, namespace_id
from hicache_rs.pools import PoolAdapter, has_memory, pool_name

logger = logging.getLogger(__name__)

#: Extra-config fields that belong to SGLang's dynamic loader, not to our backends.
SGLANG_FIELDS = ("backend_name", "module_path", "class_name", "interface_v1")

#: Extra-config fields SGLang's prefill parser removes but its decode-side offload manager
#: (``--disaggregation-decode-enable-offload-kvcache``, which ``json.loads`` the extra-config
#: itself) passes on: SGLang's, not ours, so they are dropped too (point 1).
SGLANG_PASSED_FIELDS = (
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
)

#: Host pool layouts whose page pieces we can read and write.
SUPPORTED_LAYOUTS = kv_layouts.LAYOUTS

#: Backends whose state is one local directory with a single owner process.
LOCAL_DIR_BACKENDS = ("file", "uring")

#: The most written keys remembered for ``clear`` on a backend without a namespace-wide
#: clear (point 14): about 200 bytes each, so at most about 13 MiB per instance.
STORED_KEYS_MAX = 65536


def _our_extra_config(storage_config: HiCacheStorageConfig) -> dict:
    """The extra-config without SGLang's own fields (point 1). ``file_storage_path`` (what
    SGLang's ``--file-storage-path`` adds) becomes ``dir`` for the local-disk backends when
    ``dir`` is not given."""
    extra = dict(storage_config.extra_config or {})
    for field in SGLANG_FIELDS + SGLANG_PASSED_FIELDS:
        extra.pop(field, None)
    path = extra.pop("file_storage_path", None)
    if path is not None:
        if extra.get("backend") in LOCAL_DIR_BACKENDS and "dir" not in extra:
            extra["dir"] = path
        elif extra.get("backend") not in LOCAL_DIR_BACKENDS:
            raise ValueError(
                f"--file-storage-path ({path!r}) applies to the file and uring backends of "
                f"hicache-rs, not to backend {extra.get('backend')!r}"
            )
    return extra


def _bytes_call_keys(page_bytes: int) -> int:
    """How many pages of ``page_bytes`` one native bytes read may ask for (point 14)."""
    return max(1, MAX_CALL_BYTES // max(1, page_bytes))


def _check_distinct(op: str, transfers: List[Any]) -> None:
    """Point 14: one transfer per pool in a v2 call; a pool named twice is a ``ValueError``
    naming it and both positions (its answers would overwrite each other)."""
    seen: Dict[str, int] = {}
    for i, t in enumerate(transfers):
        name = pool_name(t.name)
        if name in seen:
            raise ValueError(
                f"{op}: transfers {seen[name]} and {i} both name pool {name!r}; a call "
                "carries at most one transfer per pool"
            )
        seen[name] = i


def _native_context(extra_info: Optional[HiCacheStorageExtraInfo]) -> tuple:
    """``(prefix_keys, extra_info JSON)`` for the native one-call methods (point 15): the
    prefix as SGLang gives it (the store keeps it only when it is a list of key strings, as
    ``_context`` does), the extra info as JSON text."""
    if extra_info is None:
        return None, None
    info = getattr(extra_info, "extra_info", None)
    return (getattr(extra_info, "prefix_keys", None),
            None if info is None else json.dumps(info, sort_keys=True, default=str))


def _context(extra_info: Optional[HiCacheStorageExtraInfo]) -> dict:
    """The keyword arguments of a native call for SGLang's ``extra_info`` (point 6):
    ``prefix_keys`` when SGLang gives a list of key strings (some SGLang versions default the
    field to ``(None,)``, which is no prefix), ``extra_info`` as JSON text."""
    if extra_info is None:
        return {}
    kw = {}
    prefix = getattr(extra_info, "prefix_keys", None)
    if isinstance(prefix, (list, tuple)) and all(isinstance(k, str) for k in prefix):
        kw["prefix_keys"] = list(prefix)
    info = getattr(extra_info, "extra_info", None)
    if info is not None:
        kw["extra_info"] = json.dumps(info, sort_keys=True, default=str)
    return kw


#: dtypes SGLang's host indices may have (integers; not bool).
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


#: Up to this many host indices, ``_check_host_indices`` checks a Python list (cheaper than
#: numpy's per-call cost for few indices).
SMALL_INDEX_CHECK = 256


def _pages_ok(v: List[int], page_size: int, pool_tokens: int) -> bool:
    """Whether the indices ``v`` are whole pages of the pool: each page a consecutive run
    from a multiple of ``page_size``, inside ``0 .. pool_tokens``."""
    last = pool_tokens - page_size
    for p in range(0, len(v), page_size):
        s = v[p]
        if s < 0 or s > last or s % page_size:
            return False
        if page_size > 1 and v[p:p + page_size] != list(range(s, s + page_size)):
            return False
    return True


def _check_host_indices(
    op: str, keys: List[str], host_indices: Any, page_size: int, pool_tokens: int
) -> None:
    """Point 8: ``ValueError`` unless ``host_indices`` are whole pages of the pool, one per key,
    as SGLang's host allocator hands them out."""
    if not isinstance(host_indices, torch.Tensor):
        raise ValueError(
            f"{op}: host indices must be a torch.Tensor, got {type(host_indices).__name__}"
        )
    if host_indices.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"{op}: host indices must be an integer tensor, got dtype {host_indices.dtype}"
        )
    if host_indices.device.type != "cpu":
        raise ValueError(f"{op}: host indices must be on the CPU, got {host_indices.device}")
    if host_indices.dim() != 1:
        raise ValueError(
            f"{op}: host indices must be a 1-D tensor, got shape {tuple(host_indices.shape)}"
        )
    expected = len(keys) * page_size
    if host_indices.numel() != expected:
        raise ValueError(
            f"{op}: {len(keys)} keys need {expected} host indices "
            f"({page_size} per page), got {host_indices.numel()}"
        )
    if not keys:
        return
    # Fast paths: every page starts at a multiple of the page size inside the pool and runs
    # consecutively. Only a batch that fails them is searched for the first bad index, to
    # name it. Few indices (a Mamba slot, a short KV run) are checked as a Python list, which
    # costs a microsecond or two where each numpy reduction costs several; more, with numpy
    # on the tensor's own memory.
    if host_indices.numel() <= SMALL_INDEX_CHECK:
        if _pages_ok(host_indices.tolist(), page_size, pool_tokens):
            return
    else:
        a = host_indices.numpy().astype(numpy.int64, copy=False).reshape(-1, page_size)
        starts = a[:, 0]
        if (
            starts.min() >= 0
            and starts.max() <= pool_tokens - page_size
            and not (starts % page_size).any()
            and (a == starts[:, None] + numpy.arange(page_size)).all()
        ):
            return
    idx = host_indices.to(torch.int64)

    def where(pos: int) -> str:
        key = pos // page_size
        return f"host index {int(idx[pos])} at position {pos} (key {key}, {keys[key][:16]}...)"

    outside = torch.nonzero((idx < 0) | (idx >= pool_tokens))
    if outside.numel():
        raise ValueError(
            f"{op}: {where(int(outside[0, 0]))} is outside the host pool of {pool_tokens} "
            f"token slots (valid: 0 to {pool_tokens - 1})"
        )
    pages = idx.reshape(-1, page_size)
    off = torch.nonzero(pages[:, 0] % page_size)
    if off.numel():
        raise ValueError(
            f"{op}: {where(int(off[0, 0]) * page_size)} does not start a page: pages start at "
            f"multiples of the page size ({page_size}) in a pool of {pool_tokens} token slots"
        )
    run = pages[:, :1] + torch.arange(page_size, dtype=torch.int64)
    broken = torch.nonzero((pages != run).view(-1))
    if broken.numel():
        pos = int(broken[0, 0])
        raise ValueError(
            f"{op}: {where(pos)} breaks its page's run (expected {int(run.view(-1)[pos])}): "
            f"a page's {page_size} indices must be consecutive, as SGLang allocates them"
        )


def _pool_regions(pool: Any) -> list:
    """Point 8: the ``(address, length)`` of every buffer ``get_page_buffer_meta`` points into
    (``kv_buffer``: one tensor for SGLang's MHA and MLA pools in every supported layout)."""
    buffers = pool.kv_buffer
    if not isinstance(buffers, (list, tuple)):
        buffers = [buffers]
    regions = []
    for b in buffers:
        if not isinstance(b, torch.Tensor) or b.device.type != "cpu" or not b.is_contiguous():
            raise ValueError(
                f"host pool {type(pool).__name__}: its KV buffer must be one contiguous CPU "
                "tensor for hicache-rs to read and write pages in place"
            )
        regions.append((b.data_ptr(), b.numel() * b.element_size()))
    return regions


def _bytes_view(t: torch.Tensor) -> numpy.ndarray:
    """The bytes of a contiguous CPU tensor as a writable uint8 array sharing its memory."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _pool_kind(pool: Any) -> str:
    """``"mha"`` or ``"mla"`` for SGLang's KV host pools (the asymmetric K/V MHA pool
    included); a ValueError for anything else."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    if isinstance(pool, MLATokenToKVPoolHost):
        return "mla"
    if isinstance(pool, MHATokenToKVPoolHost):
        return "mha"
    raise ValueError(
        f"host pool {type(pool).__name__} is not supported by hicache-rs "
        "(expected SGLang's MHATokenToKVPoolHost or MLATokenToKVPoolHost)"
    )


class HiCacheRsStorage(HiCacheStorage):
    """hicache-rs' L3 backends (file, uring, rdma, plugin, memory) as SGLang's L3."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self._extra = _our_extra_config(storage_config)
        # `tenant` is ours, not the backend's: it salts the namespace (point 2).
        self._tenant = self._extra.pop("tenant", None)
        if self._tenant is not None and not isinstance(self._tenant, str):
            raise ValueError(f"extra-config field `tenant` must be a string, got {self._tenant!r}")
        # SGLang's cache controller pops `tp_lcm_size` into the storage config; a config built
        # without that step still carries it in the extra-config (point 11).
        lcm = self._extra.pop("tp_lcm_size", None)
        self._tp_lcm_size = getattr(storage_config, "tp_lcm_size", None) or lcm
        self._config_json = json.dumps(self._extra)
        # Parses the common fields and checks the backend is compiled in, now, so a bad
        # extra-config fails SGLang's attach at once (the backend's own fields are checked
        # when it opens, in register_mem_pool_host).
        self.backend_name = check_extra_config(self._config_json)
        ranks = storage_config.tp_size * storage_config.pp_size * storage_config.attn_cp_size
        # A local directory has one owner process unless the file backend runs `shared`
        # (several processes, one directory); namespaces keep the ranks' pages apart either way.
        shared_dir = self.backend_name == "file" and self._extra.get("shared") is True
        if (
            self.backend_name in LOCAL_DIR_BACKENDS
            and not shared_dir
            and storage_config.is_mla_model
            and storage_config.tp_size > 1
        ):
            raise ValueError(
                f"backend {self.backend_name!r} without `\"shared\": true` keeps one directory "
                "per rank, but an MLA model's TP ranks read the pages of one writer rank: use "
                "the file backend with \"shared\": true, or a shared backend (rdma, redis)"
            )
        self._per_rank_dir = (
            self.backend_name in LOCAL_DIR_BACKENDS and not shared_dir and ranks > 1
        )
        self._shared_dir = shared_dir
        self.mem_pool_host = None
        self._store: Optional[Store] = None
        self._closed = False
        self._lock = threading.Lock()
        # Point 9: the registered pools by name (the KV pool too, once it has memory), the
        # anchor given to register_mem_pool_host, and whether KV is a logical anchor only.
        self._attach_lock = threading.Lock()
        self._pools: Dict[str, PoolAdapter] = {}
        self._anchor = None
        self._logical_kv = False
        self._registered_once = False
        # Point 14: (namespace, key) of pages written, newest last, only where the backend
        # cannot clear a namespace; how many were forgotten to keep the bound.
        self._stored: "OrderedDict[Tuple[str, str], None]" = OrderedDict()
        self._stored_forgotten = 0
        self._backend_clears = True
        # Point 15: pools the native store moves pages of itself, and pools it can ask for
        # presence (only ever added to).
        self._native_io: set = set()
        self._native_exists: set = set()
        self._prefetch_pgs: List[int] = []
        self._backup_pgs: List[int] = []
        self._prefetch_bw: List[float] = []
        self._backup_bw: List[float] = []

    # ---- attach -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Keeps the host pool (SGLang's anchor). A pool with page memory is the KV pool: its
        namespace is derived and the backend opened (the dense case). An allocation-only
        anchor (a hybrid model's logical pool, no ``kv_buffer``) is kept for its geometry; the
        backend opens when the first pool with memory arrives through
        ``register_mem_host_pool_v2`` (point 9)."""
        with self._attach_lock:
            if self._anchor is not None or "kv" in self._pools:
                raise RuntimeError("register_mem_pool_host was already called on this backend")
            pool = mem_pool_host
            if not has_memory(pool):
                self._attach_logical_kv(pool)
                return
            self._attach_kv(pool, strict=True)
            self._anchor = pool

    def _attach_logical_kv(self, pool) -> None:
        """Point 9: SGLang's allocation-only anchor as the KV pool: no KV bytes exist."""
        for attr in ("page_size", "size"):
            if not isinstance(getattr(pool, attr, None), int) or getattr(pool, attr) < 1:
                raise ValueError(
                    f"host pool {type(pool).__name__} has no KV buffer and no valid `{attr}`: "
                    "not an allocation anchor hicache-rs can use"
                )
        self._anchor = pool
        self.mem_pool_host = pool
        self._logical_kv = True
        self.page_size = int(pool.page_size)
        self.pool_tokens = int(pool.size)

    def _attach_kv(self, pool, strict: bool) -> None:
        """The KV pool (with memory): today's namespace for SGLang's MHA and MLA pools (so v1
        and v2 share KV pages); with ``strict`` (``register_mem_pool_host``) only those."""
        layout = getattr(pool, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise ValueError(
                f"host pool layout {layout!r} is not supported by hicache-rs "
                f"(expected one of: {', '.join(SUPPORTED_LAYOUTS)})"
            )
        if getattr(pool, "dcp_size", 1) > 1:
            raise ValueError("hicache-rs does not support decode context parallel (dcp_size > 1)")
        try:
            kind = _pool_kind(pool)
        except ValueError:
            if strict:
                raise
            kind = None
        cfg = self.storage_config
        self.mla = kind == "mla" if kind is not None else bool(cfg.is_mla_model)
        self.kv_interleaved = kind == "mha" and layout == "layer_first"
        adapter = PoolAdapter("kv", pool, kv_interleaved=self.kv_interleaved,
                              is_mla_model=self.mla)
        if adapter.copy:
            raise ValueError(
                f"host pool 'kv' ({type(pool).__name__}): SGLang gives no page pieces for it "
                "(get_page_buffer_meta), which the KV pool's zero-copy calls need"
            )
        self.layout = layout
        self.page_size = int(pool.page_size)
        self.pool_tokens = int(pool.size)
        if kind is not None:
            # Points 11 and 12: how pages are cut into stored parts (head slices for
            # page_head), then one namespace per part.
            asymmetric = (not self.mla) and int(pool.v_head_dim) != int(pool.head_dim)
            self.plan = kv_layouts.plan(
                pool, kind, asymmetric, cfg.tp_rank, cfg.tp_size,
                None if self.mla else self._tp_lcm_size,
            )
            self.native_layout = self.plan.native_layout
            self._check_shared_slices()
            regions = _pool_regions(pool)
            self.page_bytes = int(pool.get_size_per_token()) * self.page_size
            self.namespaces = [self._namespace(pool, part) for part in range(self.plan.slices)]
        else:
            self.plan = kv_layouts.Plan(layout, layout, 1, None, None, 1, False)
            self.native_layout = layout
            regions = adapter.regions
            self.page_bytes = adapter.page_bytes
            self.namespaces = [self._pool_namespace(adapter)]
        self.part_bytes = self.page_bytes // self.plan.slices
        self.namespace = self.namespaces[0]
        adapter.namespace = self.namespace
        adapter.store_layout = self.native_layout
        store = self._open_store(self.part_bytes, self.native_layout)
        if not self._registered_once:
            store.set_allowed_regions(regions)
            self._registered_once = True
        else:
            store.add_allowed_regions(regions)
        self._add_native(store, adapter, len(self.namespaces) == 1)
        self._pools["kv"] = adapter
        self.mem_pool_host = pool

    def _add_native(self, store: Store, adapter: PoolAdapter, one_part: bool) -> None:
        """Point 15: registers a pool of one stored part with the native store, with its piece
        rules when it has some (its regions are registered first)."""
        if not one_part:
            return
        rules = adapter.affine if not adapter.copy else None
        try:
            store.add_pool(adapter.name, adapter.namespace, adapter.store_layout,
                           adapter.page_size, adapter.size, rules or [], adapter.kv_interleaved)
        except ValueError as e:
            # Only the one-call path is lost: the pool's calls take the per-pool path.
            logger.info("hicache-rs: pool %r keeps the per-pool path: %s", adapter.name, e)
            return
        self._native_exists.add(adapter.name)
        if rules:
            self._native_io.add(adapter.name)

    def _answered(self, store: Store, op: str, failures: list) -> None:
        """Point 4 for the native one-call methods: the backend failures they answered as
        misses or failed writes are logged (raised once the store is closed)."""
        for name, err in failures:
            if store.closed:
                raise RuntimeError(f"{op}: the store is closed")
            logger.warning("hicache-rs %s failed (answered as misses/failures): pool %r: %s",
                           op, name, err)

    def _check_shared_slices(self) -> None:
        """Point 11: head slices shared between instances need storage the instances share."""
        if (
            self.plan.layout == "page_head"
            and self._tp_lcm_size is not None
            and self.backend_name in LOCAL_DIR_BACKENDS
            and not self._shared_dir
        ):
            raise ValueError(
                f"page_head with tp_lcm_size shares head slices between instances, but "
                f"backend {self.backend_name!r} without `\"shared\": true` keeps one directory "
                "per process: use the file backend with \"shared\": true, or a shared backend "
                "(rdma, redis)"
            )

    def _open_store(self, page_bytes: int, layout: str) -> Store:
        """Opens the backend the first time a pool with memory is known (point 9)."""
        if self._store is not None:
            return self._store
        cfg = self.storage_config
        extra = self._config_json
        if self._per_rank_dir and isinstance(self._extra.get("dir"), str):
            # One owner per directory: each rank opens its own subdirectory.
            own = dict(self._extra)
            own["dir"] = f"{own['dir'].rstrip('/')}/tp{cfg.tp_rank}-pp{cfg.pp_rank}-cp{cfg.attn_cp_rank}"
            extra = json.dumps(own)
        self._store = Store(
            extra,
            page_bytes=page_bytes,
            layout=layout,
            tp_rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            pp_rank=cfg.pp_rank,
            pp_size=cfg.pp_size,
        )
        self._backend_clears = bool(self._store.info().get("clear"))
        return self._store

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Registers one host pool of a hybrid model's group (point 9): the KV pool (the one
        ``register_mem_pool_host`` gave again, or the real KV pool after a logical anchor)
        and every sidecar (Mamba, SWA, DSA indexer, DeepSeek V4, draft pools), also ones that
        arrive later. A pool SGLang cannot store is refused with SGLang's reason; the same
        name with another pool is a ``ValueError``."""
        name = pool_name(host_pool_name)
        with self._attach_lock:
            if self._closed:
                raise RuntimeError("register_mem_host_pool_v2: the hicache-rs backend is closed")
            known = self._pools.get(name)
            if known is not None or (name == "kv" and self._logical_kv):
                same_pool = (known.pool if known is not None else self._anchor) is host_pool
                if known is None and not same_pool and has_memory(host_pool):
                    # The real KV pool after a logical anchor.
                    self._attach_kv(host_pool, strict=False)
                    self._logical_kv = False
                elif not same_pool:
                    raise ValueError(
                        f"host pool {name!r} is already registered with another pool "
                        f"({type(known.pool if known else self._anchor).__name__})"
                    )
            elif name == "kv":
                if has_memory(host_pool):
                    self._attach_kv(host_pool, strict=False)
                    if self._anchor is None:
                        self._anchor = host_pool
                else:
                    self._attach_logical_kv(host_pool)
            else:
                if not has_memory(host_pool):
                    raise ValueError(
                        f"host pool {name!r} ({type(host_pool).__name__}) has no page memory "
                        "(no buffer tensor): only the KV anchor may be allocation-only"
                    )
                adapter = PoolAdapter(name, host_pool,
                                      is_mla_model=bool(self.storage_config.is_mla_model))
                adapter.namespace = self._pool_namespace(adapter)
                adapter.store_layout = adapter.namespace_layout
                store = self._open_store(adapter.page_bytes, adapter.store_layout)
                if adapter.regions:
                    store.add_allowed_regions(adapter.regions)
                    self._registered_once = True
                self._add_native(store, adapter, True)
                self._pools[name] = adapter
            super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        """The first registration burst is over (point 9): at least one pool must carry page
        memory, else there is nothing to store and the attach fails."""
        if self._closed:
            raise RuntimeError("on_host_pools_registered: the hicache-rs backend is closed")
        if self._store is None:
            raise ValueError(
                "hicache-rs: no host pool with page memory was registered (only an "
                "allocation-only anchor): nothing to store"
            )

    def _pool_namespace(self, adapter: PoolAdapter) -> str:
        """Point 2: a sidecar pool's namespace: model, TP/PP (TP only when the pool is
        sharded), CP shard and tenant as the KV namespace, plus the pool's name and geometry
        fingerprint."""
        cfg = self.storage_config
        extra = [f"v2|{adapter.fingerprint}"]
        if cfg.attn_cp_size > 1:
            extra.append(f"cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}")
        return namespace_id(
            cfg.model_name or "",
            "bfloat16",
            adapter.namespace_layout,
            not adapter.sharded,
            1,
            1,
            1,
            adapter.page_size,
            tp_rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            pp_rank=cfg.pp_rank,
            pp_size=cfg.pp_size,
            extra_key="|".join(extra),
            cache_salt=self._tenant,
        )

    def _namespace(self, pool, part: int = 0) -> str:
        cfg = self.storage_config
        model = cfg.model_name or ""
        shard = []
        if cfg.attn_cp_size > 1:
            shard.append(f"cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}")
        # Point 11: a page_head part is named by its global head slice, not by this rank.
        tp_rank, tp_size, tag = kv_layouts.part_identity(
            self.plan, part, cfg.tp_rank, cfg.tp_size
        )
        if tag:
            shard.append(tag)
        if self.mla:
            heads, head_dim = 1, int(pool.kv_cache_dim)
        else:
            heads, head_dim = self.plan.heads, int(pool.head_dim)
            v_head_dim = int(getattr(pool, "v_head_dim", head_dim))
            if v_head_dim != head_dim:
                shard.append(f"v{v_head_dim}")
        dtype = str(pool.dtype)
        if pool.dtype == torch.uint8:
            # SGLang stores fp8 KV caches as uint8: which fp8 format is not recorded here, so
            # the namespace marks the storage type (deployments of one model name with
            # e4m3 and e5m2 KV need different `tenant`s).
            dtype = "float8_e4m3fn"
            shard.append("uint8-storage")
        return namespace_id(
            model,
            dtype,
            self.native_layout,
            self.mla,
            heads,
            head_dim,
            int(pool.layer_num),
            self.page_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=cfg.pp_rank,
            pp_size=cfg.pp_size,
            extra_key="|".join(shard) or None,
            cache_salt=self._tenant,
        )

    def _ready(self, op: str) -> Store:
        if self._closed:
            raise RuntimeError(f"{op}: the hicache-rs backend is closed")
        if self._store is None:
            if self._anchor is not None:
                raise RuntimeError(
                    f"{op}: no host pool with page memory is registered yet (only the "
                    "allocation-only anchor)"
                )
            raise RuntimeError(f"{op}: register_mem_pool_host was not called")
        return self._store

    def _kv(self, op: str) -> PoolAdapter:
        """The KV pool with memory, for the v1 and legacy methods."""
        kv = self._pools.get("kv")
        if kv is None:
            raise RuntimeError(f"{op}: no KV host pool with page memory is registered")
        return kv

    def _kv_parts(self, op: str, keys: List[str], host_indices: torch.Tensor) -> list:
        """Point 8, then ``(namespace, ptrs, sizes)`` for every stored part of the KV pages
        (point 11: one part, or the head slices of a split ``page_head`` pool)."""
        kv = self._kv(op)
        if not self.plan.split_heads:
            pieces = [kv.pieces(op, keys, host_indices, _check_host_indices)]
        else:
            _check_host_indices(op, keys, host_indices, self.page_size, self.pool_tokens)
            pieces = kv_layouts.part_pieces(self.plan, kv.pool, host_indices) if keys else []
        return [(ns, ptrs, sizes) for ns, (ptrs, sizes) in zip(self.namespaces, pieces)]

    def _all_parts(self, store: Store, op: str, n: int, parts: list, fn) -> Optional[List[bool]]:
        """``fn(*part)`` for every stored part of ``n`` pages (a tuple whose first item is the
        part's namespace): a page is ``True`` only when it is in every part (point 11);
        ``None`` when the backend failed (point 4)."""
        out = [True] * n
        for part in parts:
            res = self._call(store, op, lambda: fn(*part))
            if res is None:
                return None
            out = [a and bool(b) for a, b in zip(out, res)]
        return out

    def _kv_run(self, store: Store, op: str, keys: List[str], ctx: dict) -> int:
        """The leading run of KV pages present in every part (point 11); 0 when the backend
        failed (point 4)."""
        hits = len(keys)
        for ns in self.namespaces:
            part = self._call(store, op, lambda: store.batch_exists(ns, keys[:hits], **ctx))
            hits = min(hits, part or 0)
            if not hits:
                break
        return hits

    def _call(self, store: Store, op: str, fn):
        """One backend call (point 4): bad input (``ValueError``) and a closed store raise;
        a failing backend is logged and gives ``None``, which the caller answers as misses
        or failed writes."""
        try:
            return fn()
        except RuntimeError as e:
            if store.closed:
                raise
            logger.warning("hicache-rs %s failed (answered as misses/failures): %s", op, e)
            return None

    # ---- zero-copy interface (interface_v1) ----------------------------------------------

    def batch_exists(
        self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> int:
        if self._logical_kv and not self._closed:
            # Point 9: no KV bytes exist for a logical anchor; without sidecar transfers
            # nothing is known to be restorable.
            return 0
        store = self._ready("batch_exists")
        if "kv" in self._native_exists:
            # Point 15: the leading KV run in one native call (no pool to judge).
            prefix, info = _native_context(extra_info)
            out = store.pool_exists("kv", keys, (), prefix, info)
            if out is not None:
                if out[3]:
                    self._answered(store, "batch_exists", out[3])
                return out[0]
        return self._kv_run(store, "batch_exists", keys, _context(extra_info))

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        if self._logical_kv and not self._closed:
            return self._logical_v1("batch_get_v1", keys, host_indices)
        store = self._ready("batch_get_v1")
        if "kv" in self._native_io:
            prefix, info = _native_context(extra_info)
            start = time.perf_counter() if self.storage_config.enable_storage_metrics else 0.0
            out = store.pool_io(False, (("kv", keys, host_indices),), prefix, info)
            if out is not None:
                if out[1]:
                    self._answered(store, "batch_get_v1", out[1])
                hits = out[0]["kv"]
                if self.storage_config.enable_storage_metrics:
                    self._record(self._prefetch_pgs, self._prefetch_bw, sum(hits), start,
                                 sum(hits) * self.page_bytes)
                return hits
        parts = self._kv_parts("batch_get_v1", keys, host_indices)
        if not keys:
            return []
        start = time.perf_counter()
        ctx = _context(extra_info)
        hits = self._all_parts(store, "batch_get_v1", len(keys), parts,
                               lambda ns, ptrs, sizes: store.batch_get_into(
                                   ns, keys, self.native_layout, ptrs, sizes,
                                   self.kv_interleaved, **ctx))
        if hits is None:
            return [False] * len(keys)
        self._record(self._prefetch_pgs, self._prefetch_bw, sum(hits), start,
                     sum(hits) * self.page_bytes)
        return hits

    def _logical_v1(self, op: str, keys: List[str], host_indices: Any) -> List[bool]:
        """Point 9: KV of a logical anchor has no bytes: the indices are checked against the
        anchor, and every page is done (the sidecar pools carry the data), as SGLang's
        Mooncake backend answers."""
        _check_host_indices(op, keys, host_indices, self.page_size, self.pool_tokens)
        return [True] * len(keys)

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        if self._logical_kv and not self._closed:
            return self._logical_v1("batch_set_v1", keys, host_indices)
        store = self._ready("batch_set_v1")
        if "kv" in self._native_io and self.storage_config.is_storage_writer:
            prefix, info = _native_context(extra_info)
            start = time.perf_counter() if self.storage_config.enable_storage_metrics else 0.0
            out = store.pool_io(True, (("kv", keys, host_indices),), prefix, info)
            if out is not None:
                if out[1]:
                    self._answered(store, "batch_set_v1", out[1])
                ok = out[0]["kv"]
                if not self._backend_clears:
                    self._remember_kv([k for k, s in zip(keys, ok) if s])
                if self.storage_config.enable_storage_metrics:
                    self._record(self._backup_pgs, self._backup_bw, sum(ok), start,
                                 sum(ok) * self.page_bytes)
                return ok
        parts = self._kv_parts("batch_set_v1", keys, host_indices)
        if not keys:
            return []
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)
        start = time.perf_counter()
        ctx = _context(extra_info)
        ok = self._all_parts(store, "batch_set_v1", len(keys), parts,
                             lambda ns, ptrs, sizes: store.batch_set_from(
                                 ns, keys, self.native_layout, ptrs, sizes,
                                 self.kv_interleaved, **ctx))
        if ok is None:
            return [False] * len(keys)
        self._remember_kv([k for k, s in zip(keys, ok) if s])
        self._record(self._backup_pgs, self._backup_bw, sum(ok), start,
                     sum(ok) * self.page_bytes)
        return ok

    # ---- multi-pool interface (v2: hybrid models) ------------------------------------------

    def _adapter(self, op: str, name: Any) -> Optional[PoolAdapter]:
        """The registered pool ``name`` (``None`` for the KV pool of a logical anchor); an
        unregistered pool is a ``ValueError`` (bad input)."""
        n = pool_name(name)
        adapter = self._pools.get(n)
        if adapter is None and not (n == "kv" and self._logical_kv):
            raise ValueError(
                f"{op}: host pool {n!r} is not registered "
                f"(registered: {', '.join(sorted(self._pools)) or 'none'})"
            )
        return adapter

    def batch_exists_v2(
        self,
        keys: List[str],
        pool_transfers: Optional[List[Any]] = None,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> PoolTransferResult:
        """Point 10: the leading KV run, then each pool's hit policy (``hit_policy``), with
        SGLang's HiCacheFile semantics; a failing backend counts as absent pages."""
        store = self._ready("batch_exists_v2")
        if "kv" in self._native_exists:
            prefix, info = _native_context(extra_info)
            out = store.pool_exists("kv", keys, () if pool_transfers is None else pool_transfers,
                                    prefix, info)
            if out is not None:
                if out[3]:
                    self._answered(store, "batch_exists_v2", out[3])
                return PoolTransferResult(out[0], out[1], out[2])
        transfers = list(pool_transfers or [])
        _check_distinct("batch_exists_v2", transfers)
        adapters = [(t, self._adapter("batch_exists_v2", t.name)) for t in transfers]
        for t, _ in adapters:
            hit_policy.check_transfer(t)
        ctx = _context(extra_info)
        if not keys:
            return PoolTransferResult(0, {}, [])
        if self._logical_kv:
            gating = any(
                hit_policy.policy_name(t.hit_policy) != hit_policy.BLOCK_GROUPS
                for t, a in adapters if a is not None
            )
            kv_pages = len(keys) if gating else 0
        else:
            kv_pages = self._kv_run(store, "batch_exists_v2", keys, ctx)
        by_name = {pool_name(t.name): a for t, a in adapters}
        asked_before: Dict[str, List[bool]] = {}

        def present(t) -> List[bool]:
            """The pool's per-key presence, asked only when the walk reaches it."""
            name = pool_name(t.name)
            adapter = by_name[name]
            if adapter is None:
                # KV of a logical anchor: no KV bytes exist, every page counts.
                return [True] * len(keys)
            policy = hit_policy.policy_name(t.hit_policy)
            asked = list(t.keys) if policy == hit_policy.BLOCK_GROUPS and t.keys else keys
            n = min(len(asked), hit_policy.pages_to_ask(kv_pages, t))
            if policy != hit_policy.BLOCK_GROUPS and name in asked_before:
                return asked_before[name]
            if n == 0:
                return []
            flags = self._present_each(store, adapter, asked[:n], ctx)
            if policy != hit_policy.BLOCK_GROUPS:
                asked_before[name] = flags
            return flags

        kv_hit, hit, restorable = hit_policy.evaluate(kv_pages, transfers, present)
        return PoolTransferResult(kv_hit, hit, restorable)

    def _namespaces_of(self, adapter: PoolAdapter) -> List[str]:
        """The namespaces a pool's page is stored in: one, or the KV pool's head slices
        (point 11)."""
        return self.namespaces if adapter is self._pools.get("kv") else [adapter.namespace]

    def _present_each(self, store: Store, adapter: PoolAdapter, keys: List[str],
                      ctx: dict) -> List[bool]:
        """Per-key presence of a pool's pages (every part present); absent when the backend
        failed (point 4)."""
        found = self._all_parts(store, "batch_exists_v2", len(keys),
                                [(ns,) for ns in self._namespaces_of(adapter)],
                                lambda ns: store.batch_exists_each(ns, keys, **ctx))
        return found if found is not None else [False] * len(keys)

    def _v2_plan(self, op: str, transfers: List[Any], results: Dict[str, List[bool]]):
        """Checks every transfer before any I/O (point 8): a count mismatch answers that pool
        all ``False`` (logged, as SGLang's HiCacheFile does); bad host indices, and two transfers
        of one pool (point 14), raise."""
        _check_distinct(op, transfers)
        plan = []
        for t in transfers:
            name = pool_name(t.name)
            adapter = self._adapter(op, name)
            keys = list(t.keys or [])
            page_size = adapter.page_size if adapter is not None else self.page_size
            expected = len(keys) * page_size
            got = t.host_indices.numel() if isinstance(t.host_indices, torch.Tensor) else None
            if got != expected:
                logger.error(
                    "hicache-rs %s: pool %r has %d keys, which need %d host indices; got %s",
                    op, name, len(keys), expected, got,
                )
                results[name] = [False] * len(keys)
                continue
            if adapter is None:
                _check_host_indices(f"{op} (pool 'kv')", keys, t.host_indices, self.page_size,
                                    self.pool_tokens)
                plan.append((name, None, keys, []))
                continue
            where = f"{op} (pool {name!r})"
            if adapter is self._pools.get("kv"):
                # Point 11: the KV pool's stored parts, as its v1 calls make them.
                parts = self._kv_parts(where, keys, t.host_indices)
            else:
                ptrs, sizes = adapter.pieces(where, keys, t.host_indices, _check_host_indices)
                parts = [(adapter.namespace, ptrs, sizes)]
            plan.append((name, adapter, keys, parts))
        return plan

    def batch_get_v2(
        self,
        transfers: List[Any],
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> Dict[str, List[bool]]:
        """Point 10: reads each transfer's pages in place into its pool; one bool per key."""
        store = self._ready("batch_get_v2")
        if self._native_io:
            prefix, info = _native_context(extra_info)
            start = time.perf_counter() if self.storage_config.enable_storage_metrics else 0.0
            out = store.pool_io(False, transfers, prefix, info)
            if out is not None:
                if out[1]:
                    self._answered(store, "batch_get_v2", out[1])
                if self.storage_config.enable_storage_metrics:
                    self._record_v2(self._prefetch_pgs, self._prefetch_bw, out[0], start)
                return out[0]
        results: Dict[str, List[bool]] = {}
        plan = self._v2_plan("batch_get_v2", list(transfers or []), results)
        ctx = _context(extra_info)
        start = time.perf_counter()
        pages = nbytes = 0
        for name, adapter, keys, parts in plan:
            if adapter is None or not keys:
                results[name] = [True] * len(keys)
                continue
            if adapter.copy:
                hits = self._copy_in(store, adapter, keys, parts[0][1])
            else:
                hits = self._all_parts(store, "batch_get_v2", len(keys), parts,
                                       lambda ns, ptrs, sizes: store.batch_get_into(
                                           ns, keys, adapter.store_layout, ptrs, sizes,
                                           adapter.kv_interleaved, **ctx))
            results[name] = hits if hits is not None else [False] * len(keys)
            pages += sum(results[name])
            nbytes += sum(results[name]) * adapter.page_bytes
        if pages:
            self._record(self._prefetch_pgs, self._prefetch_bw, pages, start, nbytes)
        return results

    def _copy_in(self, store: Store, adapter: PoolAdapter, keys: List[str],
                 starts: List[int]) -> Optional[List[bool]]:
        """``pools`` point 7: pages read as bytes, each written into the pool through SGLang's
        ``set_from_flat_data_page`` (no pool address reaches the native store)."""
        hits = []
        step = _bytes_call_keys(adapter.page_bytes)
        for at in range(0, len(keys), step):
            # Point 14: one native call of at most MAX_CALL_BYTES at a time.
            part = keys[at:at + step]
            datas = self._call(store, "batch_get_v2", lambda: store.batch_get_bytes(
                adapter.namespace, part, adapter.store_layout, adapter.page_bytes))
            if datas is None:
                return None
            for start, data in zip(starts[at:at + step], datas):
                if data is not None:
                    page = adapter.pool.get_dummy_flat_data_page()
                    numpy.copyto(_bytes_view(page), numpy.frombuffer(data, dtype=numpy.uint8))
                    adapter.pool.set_from_flat_data_page(start, page)
                hits.append(data is not None)
        return hits

    def batch_set_v2(
        self,
        transfers: List[Any],
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> Dict[str, List[bool]]:
        """Point 10: writes each transfer's pages in place from its pool; one bool per key.
        On an MLA rank that is not the storage writer, pools shared by the TP ranks are not
        written (reported done) while TP-sharded ones (Mamba state) are (point 5)."""
        store = self._ready("batch_set_v2")
        if self._native_io and self.storage_config.is_storage_writer:
            prefix, info = _native_context(extra_info)
            start = time.perf_counter() if self.storage_config.enable_storage_metrics else 0.0
            out = store.pool_io(True, transfers, prefix, info)
            if out is not None:
                if out[1]:
                    self._answered(store, "batch_set_v2", out[1])
                results = out[0]
                if not self._backend_clears:
                    for t in transfers:
                        name = pool_name(t.name)
                        done = [k for k, s in zip(t.keys or [], results[name]) if s]
                        for ns in self._namespaces_of(self._pools[name]):
                            self._remember(ns, done)
                if self.storage_config.enable_storage_metrics:
                    self._record_v2(self._backup_pgs, self._backup_bw, results, start)
                return results
        results: Dict[str, List[bool]] = {}
        plan = self._v2_plan("batch_set_v2", list(transfers or []), results)
        ctx = _context(extra_info)
        writer = self.storage_config.is_storage_writer
        start = time.perf_counter()
        pages = nbytes = 0
        for name, adapter, keys, parts in plan:
            if adapter is None or not keys or (not writer and not adapter.sharded):
                results[name] = [True] * len(keys)
                continue
            if adapter.copy:
                flat = [_bytes_view(adapter.pool.get_data_page(at, flat=True).contiguous())
                        .tobytes() for at in parts[0][1]]
                ok = self._call(store, "batch_set_v2", lambda: store.batch_set_bytes(
                    adapter.namespace, keys, adapter.store_layout, flat))
            else:
                ok = self._all_parts(store, "batch_set_v2", len(keys), parts,
                                     lambda ns, ptrs, sizes: store.batch_set_from(
                                         ns, keys, adapter.store_layout, ptrs, sizes,
                                         adapter.kv_interleaved, **ctx))
            results[name] = ok if ok is not None else [False] * len(keys)
            done = [k for k, s in zip(keys, results[name]) if s]
            for ns in self._namespaces_of(adapter):
                self._remember(ns, done)
            pages += sum(results[name])
            nbytes += sum(results[name]) * adapter.page_bytes
        if pages:
            self._record(self._backup_pgs, self._backup_bw, pages, start, nbytes)
        return results

    # ---- legacy tensor interface ---------------------------------------------------------

    def _flat_pages(self, op: str) -> None:
        """Point 12: SGLang's asymmetric K/V pool has no flat data page (its
        ``get_data_page`` raises), so the legacy methods refuse it and name the way that
        works."""
        if self.plan.asymmetric:
            raise ValueError(
                f"{op}: a pool whose K and V head dims differ has no flat data pages in "
                "SGLang; use the zero-copy interface (\"interface_v1\": 1)"
            )

    def _page_tensor(self, op: str, t: Any) -> torch.Tensor:
        self._flat_pages(op)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: expected a torch.Tensor page, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{op}: the page tensor is on {t.device}, expected host memory")
        if t.numel() * t.element_size() != self.page_bytes:
            raise ValueError(
                f"{op}: the page tensor has {t.numel() * t.element_size()} bytes, "
                f"a page of this pool has {self.page_bytes}"
            )
        return t

    def batch_get(
        self,
        keys: List[str],
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> List[Optional[torch.Tensor]]:
        """Reads pages into flat page tensors (new ones from the pool when none are given)."""
        store = self._ready("batch_get")
        kv_pool = self._kv("batch_get").pool
        self._flat_pages("batch_get")
        if target_locations is None:
            target_locations = [kv_pool.get_dummy_flat_data_page() for _ in keys]
        if len(target_locations) != len(keys):
            raise ValueError(
                f"batch_get: {len(keys)} keys and {len(target_locations)} target tensors"
            )
        if not keys:
            return []
        dst = [self._page_tensor("batch_get", t) for t in target_locations]
        for t in dst:
            if not t.is_contiguous():
                raise ValueError("batch_get: target tensors must be contiguous")
        # Point 8: the native store hands back bytes; no address of a caller tensor crosses.
        parts: List[List[Optional[bytes]]] = []
        step = _bytes_call_keys(self.part_bytes)
        for ns in self.namespaces:
            got: List[Optional[bytes]] = []
            for at in range(0, len(keys), step):
                # Point 14: one native call of at most MAX_CALL_BYTES at a time.
                chunk = self._call(store, "batch_get", lambda: store.batch_get_bytes(
                    ns, keys[at:at + step], self.native_layout, self.part_bytes))
                if chunk is None:
                    return [None] * len(keys)
                got.extend(chunk)
            parts.append(got)
        # Point 11: a page is whole only when every part of it was read.
        pages: List[Optional[bytes]] = [
            None if any(p is None for p in page) else kv_layouts.join_page(self.plan, page)
            for page in zip(*parts)
        ]
        out: List[Optional[torch.Tensor]] = []
        for t, data in zip(dst, pages):
            if data is not None:
                numpy.copyto(_bytes_view(t), numpy.frombuffer(data, dtype=numpy.uint8))
            out.append(None if data is None else t)
        return out

    def get(
        self,
        key: str,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> Optional[torch.Tensor]:
        """Reads one page into ``target_location`` (a flat page tensor); ``None`` on a miss."""
        locs = None if target_location is None else [target_location]
        return self.batch_get([key], locs)[0]

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        """Writes flat page tensors; ``True`` when every page is stored (or already was)."""
        store = self._ready("batch_set")
        self._kv("batch_set")
        if values is None or len(values) != len(keys):
            raise ValueError(
                f"batch_set: {len(keys)} keys and "
                f"{'no' if values is None else len(values)} values"
            )
        if not keys:
            return True
        if not self.storage_config.is_storage_writer:
            return True
        src = [_bytes_view(self._page_tensor("batch_set", v).contiguous()).tobytes()
               for v in values]
        pages = [kv_layouts.split_page(self.plan, page) for page in src]
        parts = [(ns, [page[i] for page in pages]) for i, ns in enumerate(self.namespaces)]
        ok = self._all_parts(store, "batch_set", len(keys), parts,
                             lambda ns, datas: store.batch_set_bytes(
                                 ns, keys, self.native_layout, datas))
        if ok is None:
            return False
        self._remember_kv([k for k, s in zip(keys, ok) if s])
        return all(ok)

    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        """Writes one flat page tensor."""
        return self.batch_set([key], None if value is None else [value])

    def exists(self, key: str) -> bool:
        """Whether the page is present."""
        return self.batch_exists([key]) == 1

    # ---- lifecycle and metrics ------------------------------------------------------------

    def _remember(self, namespace: str, keys: List[str]) -> None:
        """Point 14: remembers written keys for ``clear`` only where the backend cannot clear
        a namespace, the newest ``STORED_KEYS_MAX`` of them."""
        if self._backend_clears or not keys:
            return
        with self._lock:
            for k in keys:
                self._stored[(namespace, k)] = None
                self._stored.move_to_end((namespace, k))
            while len(self._stored) > STORED_KEYS_MAX:
                self._stored.popitem(last=False)
                self._stored_forgotten += 1

    def _remember_kv(self, keys: List[str]) -> None:
        """The KV pages stored, in every part's namespace (point 11)."""
        for ns in self.namespaces:
            self._remember(ns, keys)

    def _record_v2(self, pgs: list, bw: list, results: Dict[str, List[bool]],
                   start: float) -> None:
        """Metrics of a v2 call's pages, counted with the v1 ones (point 10)."""
        pages = nbytes = 0
        for name, flags in results.items():
            n = sum(flags)
            pages += n
            nbytes += n * self._pools[name].page_bytes
        if pages:
            self._record(pgs, bw, pages, start, nbytes)

    def _record(self, pgs: list, bw: list, pages: int, start: float, nbytes: int) -> None:
        if not self.storage_config.enable_storage_metrics:
            return
        elapsed = max(time.perf_counter() - start, 1e-9)
        with self._lock:
            pgs.append(pages)
            bw.append(nbytes / elapsed / 1e9)

    def clear(self) -> None:
        """Removes every page of this instance's namespaces (the KV pool's and every
        registered sidecar pool's) from the backend: pages written by this process, by other
        processes sharing the storage, and before a restart (file, uring, redis and memory
        backends, and plugins that clear (ABI 1.2), whose ``info()["clear"]`` is true). A
        backend without a namespace-wide clear gets the newest pages this instance stored (at
        most ``STORED_KEYS_MAX``, point 14) deleted instead."""
        store = self._ready("clear")
        with self._lock:
            stored, self._stored = list(self._stored), OrderedDict()
            forgotten, self._stored_forgotten = self._stored_forgotten, 0
        with self._attach_lock:
            namespaces = sorted(
                {ns for a in self._pools.values() for ns in self._namespaces_of(a)}
            )
        if store.info().get("clear"):
            for ns in namespaces:
                store.clear(ns)
            return
        by_ns: Dict[str, List[str]] = {}
        for ns, key in stored:
            by_ns.setdefault(ns, []).append(key)
        for ns, keys in by_ns.items():
            store.delete(ns, keys)
        if forgotten:
            logger.warning(
                "hicache-rs clear: backend %r cannot clear a namespace, so only the %d newest "
                "pages this instance wrote were remembered and deleted; %d older ones stay "
                "until the backend evicts them", self.backend_name, STORED_KEYS_MAX, forgotten,
            )

    def get_stats(self):
        """SGLang's ``StorageMetrics`` (pages and GB/s per call since the last call), or
        ``None`` without ``--enable-storage-metrics``."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._lock:
            m.prefetch_pgs.extend(self._prefetch_pgs)
            m.backup_pgs.extend(self._backup_pgs)
            m.prefetch_bandwidth.extend(self._prefetch_bw)
            m.backup_bandwidth.extend(self._backup_bw)
            for lst in (self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw):
                lst.clear()
        return m

    def backend_stats(self) -> dict:
        """The backend's own counters (hits, misses, corrupt pages, bytes, ...)."""
        return self._ready("backend_stats").stats()

    def close(self) -> None:
        """Closes the backend; later calls raise ``RuntimeError``. Idempotent."""
        self._closed = True
        if self._store is not None:
            self._store.close()
