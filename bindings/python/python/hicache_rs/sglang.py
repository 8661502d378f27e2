"""SGLang's ``dynamic`` L3 backend: :class:`HiCacheRsStorage`.

SGLang loads it with::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicache_rs",
        "module_path": "hicache_rs.sglang", "class_name": "HiCacheRsStorage",
        "interface_v1": 1, "backend": "file", "dir": "/var/cache/kv"}'

Its storage factory constructs the class as ``cls(storage_config, {})``; the host KV pool
arrives later through :meth:`HiCacheRsStorage.register_mem_pool_host`, and only then is the
backend opened (the page geometry and layout are known only then).

Model of the class (each point is kept by the code named in it):

1. The extra-config is hicache-rs' own (``{"backend": "file", "dir": ...}``, ``rdma``,
   ``uring``, ``plugin``, ``memory``), strict: unknown fields are a ``ValueError`` naming them.
   The fields SGLang itself reads (``backend_name``, ``module_path``, ``class_name``,
   ``interface_v1``) are taken out first (``_our_extra_config``), and so are the ones its
   prefill parser removes but its decode-side offload manager passes on (``prefetch_*``,
   ``hicache_storage_pass_prefix_keys``: point 11) and ``tp_lcm_size`` (point 9).
2. SGLang's keys are bare content hashes. Every key is paired with a namespace built from the
   model name, dtype, layout, page geometry, TP/PP rank (not for MLA, whose latent cache is the
   same on every rank), context-parallel shard and tenant (``_namespace``), so two deployments
   that differ in any of these never read each other's pages.
3. Zero copy: ``batch_get_v1``/``batch_set_v1`` hand the host pool's own page pieces
   (``get_page_buffer_meta``) to the native store, which reads and writes them in place with
   the GIL released. The bytes stored for a page are the pool's flat data page in every layout,
   so the legacy tensor methods (``get``/``set``) and the zero-copy ones share pages.
4. A miss is a miss: a page the backend does not have, or cannot read intact, is ``False``
   (``None`` in the legacy methods), and a failing backend (I/O error, server gone) is logged
   and answered as misses or failed writes, never an exception in SGLang's I/O threads. Bad
   input (mismatched counts, an unsupported pool, a call after ``close``) raises.
5. Only the storage writer writes: on an MLA rank that is not SGLang's storage writer the set
   methods write nothing and report success, as SGLang's own backends do.
6. Prefix keys: with SGLang's ``hicache_storage_pass_prefix_keys``, the v1 calls carry
   ``extra_info.prefix_keys`` (the hashes of the request's pages before the batch); they and
   ``extra_info.extra_info`` (as JSON text) reach the Rust backend with every batch
   (``_context``), so a backend can place a request's pages together. Without the flag SGLang
   passes none, and none is passed on.
7. Thread safety: the instance is immutable after ``register_mem_pool_host`` except for the
   metrics lists and the set of stored keys, both behind one lock; the native store is safe
   under SGLang's concurrent prefetch, query and backup threads.
8. No memory outside the pool, ever. SGLang's ``get_page_buffer_meta`` turns host indices
   into addresses without checking them, so the v1 calls check them first
   (``_check_host_indices``): a 1-D integer tensor on the CPU, one whole page per key, every
   index inside the pool (``0 <= i < pool.size``), each page a contiguous run starting at a
   multiple of the page size (what SGLang's allocator hands out and what
   ``get_page_buffer_meta``, reading only ``indices[::page_size]``, assumes). Anything else
   is a ``ValueError`` naming the key, the position, the value and the pool size, before a
   pointer exists. Behind that, the native store is told the pool's buffers
   (``Store.set_allowed_regions``, ``_pool_regions``) and refuses any piece outside them.
   The legacy tensor methods pass ``bytes`` (copies), never addresses of caller tensors.
9. ``page_head`` and heterogeneous TP (``hicache_rs.kv_layouts``): a page may be stored as
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
10. Asymmetric K/V head dims (SGLang's ``AsymmetricMHATokenToKVPoolHost``, ``page_first``
    and ``page_first_direct``): K and V are two buffers, both registered (point 8); a page is
    its K piece then its V piece, and the namespace carries both head dims. SGLang gives such
    pools no flat data page, so only the zero-copy methods serve them (the legacy ones say
    so).
11. Decode-side offload in PD disaggregation (``--disaggregation-decode-enable-offload-
    kvcache``): the decode instance's controller writes its generated pages with
    ``batch_set_v1`` under SGLang's hash chain continued from the prompt's page-aligned hash,
    with no prefix keys. Its pages are in the same namespace as a prefill instance's when
    the two agree on model name, dtype, ``--hicache-mem-layout``, page size, TP/PP geometry
    (or, for ``page_head``, ``tp_lcm_size``) and tenant, and so are hits for a later prefill
    on any instance sharing the storage. The decode side reads the extra-config with
    ``json.loads`` itself, so SGLang's prefetch fields arrive here and are dropped (point 1).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, List, Optional

import numpy
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from hicache_rs import kv_layouts
from hicache_rs._native import Store, check_extra_config, namespace_id

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
    # Fast path (numpy on the tensor's own memory, a few microseconds): every page starts at a
    # multiple of the page size inside the pool and runs consecutively. Only a batch that
    # fails it is searched for the first bad index, to name it.
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
        # without that step still carries it in the extra-config (point 9).
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
        self._shared_dir = shared_dir
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
        self.mem_pool_host = None
        self._store: Optional[Store] = None
        self._closed = False
        self._lock = threading.Lock()
        self._stored: set = set()
        self._prefetch_pgs: List[int] = []
        self._backup_pgs: List[int] = []
        self._prefetch_bw: List[float] = []
        self._backup_bw: List[float] = []

    # ---- attach -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Keeps the host pool, derives the namespace from it and opens the backend."""
        if self._store is not None:
            raise RuntimeError("register_mem_pool_host was already called on this backend")
        pool = mem_pool_host
        layout = getattr(pool, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise ValueError(
                f"host pool layout {layout!r} is not supported by hicache-rs "
                f"(expected one of: {', '.join(SUPPORTED_LAYOUTS)})"
            )
        if getattr(pool, "kv_buffer", None) is None:
            raise ValueError(
                f"host pool {type(pool).__name__} has no KV buffer (allocator-only pool): "
                "hicache-rs reads and writes pages in place and needs a materialized pool"
            )
        if getattr(pool, "dcp_size", 1) > 1:
            raise ValueError("hicache-rs does not support decode context parallel (dcp_size > 1)")
        kind = _pool_kind(pool)
        self.mla = kind == "mla"
        self.layout = layout
        cfg = self.storage_config
        asymmetric = (not self.mla) and int(pool.v_head_dim) != int(pool.head_dim)
        # Points 9 and 10: how pages are cut into stored parts (head slices for page_head).
        self.plan = kv_layouts.plan(
            pool, kind, asymmetric, cfg.tp_rank, cfg.tp_size,
            None if self.mla else self._tp_lcm_size,
        )
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
        self.native_layout = self.plan.native_layout
        self.page_size = int(pool.page_size)
        self.pool_tokens = int(pool.size)
        regions = _pool_regions(pool)
        self.page_bytes = int(pool.get_size_per_token()) * self.page_size
        self.part_bytes = self.page_bytes // self.plan.slices
        self.kv_interleaved = (not self.mla) and layout == "layer_first"
        self.namespaces = [self._namespace(pool, part) for part in range(self.plan.slices)]
        self.namespace = self.namespaces[0]
        extra = self._config_json
        if self._per_rank_dir and isinstance(self._extra.get("dir"), str):
            # One owner per directory: each rank opens its own subdirectory.
            own = dict(self._extra)
            own["dir"] = f"{own['dir'].rstrip('/')}/tp{cfg.tp_rank}-pp{cfg.pp_rank}-cp{cfg.attn_cp_rank}"
            extra = json.dumps(own)
        self._store = Store(
            extra,
            page_bytes=self.part_bytes,
            layout=self.native_layout,
            tp_rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            pp_rank=cfg.pp_rank,
            pp_size=cfg.pp_size,
        )
        self._store.set_allowed_regions(regions)
        self.mem_pool_host = pool

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """SGLang's hybrid controller registers every host pool of the group here: the KV
        pool is ours; sidecar pools (Mamba, SWA, DSA indexer, draft) need the v2 methods,
        which hicache-rs does not implement, so they fail the attach instead of being
        silently skipped."""
        name = getattr(host_pool_name, "value", host_pool_name)
        if name != "kv":
            raise ValueError(
                f"host pool {name!r} ({type(host_pool).__name__}) is a sidecar pool of a "
                "hybrid model; hicache-rs serves only the KV pool (no batch_*_v2 methods)"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _namespace(self, pool, part: int = 0) -> str:
        cfg = self.storage_config
        model = cfg.model_name or ""
        shard = []
        if cfg.attn_cp_size > 1:
            shard.append(f"cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}")
        # Point 9: a page_head part is named by its global head slice, not by this rank.
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
            raise RuntimeError(f"{op}: register_mem_pool_host was not called")
        return self._store

    def _pieces(self, op: str, keys: List[str], host_indices: torch.Tensor):
        """Point 8, then the ``(ptrs, sizes)`` of every stored part (point 9)."""
        _check_host_indices(op, keys, host_indices, self.page_size, self.pool_tokens)
        if not keys:
            return []
        return kv_layouts.part_pieces(self.plan, self.mem_pool_host, host_indices)

    def _each_part(self, store: Store, op: str, n: int, fn) -> Optional[List[bool]]:
        """``fn(namespace, part)`` for every stored part of the pages (point 9): a page is
        ``True`` only when it is in every part; ``None`` when the backend failed."""
        out = [True] * n
        for part, ns in enumerate(self.namespaces):
            res = self._call(store, op, lambda: fn(ns, part))
            if res is None:
                return None
            out = [a and bool(b) for a, b in zip(out, res)]
        return out

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
        store = self._ready("batch_exists")
        ctx = _context(extra_info)
        hits = len(keys)
        # Point 9: a page is present only when every part of it is.
        for ns in self.namespaces:
            part = self._call(
                store, "batch_exists", lambda: store.batch_exists(ns, keys[:hits], **ctx)
            )
            hits = min(hits, part or 0)
            if not hits:
                break
        return hits

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        store = self._ready("batch_get_v1")
        parts = self._pieces("batch_get_v1", keys, host_indices)
        if not keys:
            return []
        start = time.perf_counter()
        ctx = _context(extra_info)
        hits = self._each_part(store, "batch_get_v1", len(keys), lambda ns, i: store.batch_get_into(
            ns, keys, self.native_layout, *parts[i], self.kv_interleaved, **ctx))
        if hits is None:
            return [False] * len(keys)
        self._record(self._prefetch_pgs, self._prefetch_bw, sum(hits), start)
        return hits

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        store = self._ready("batch_set_v1")
        parts = self._pieces("batch_set_v1", keys, host_indices)
        if not keys:
            return []
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)
        start = time.perf_counter()
        ctx = _context(extra_info)
        ok = self._each_part(store, "batch_set_v1", len(keys), lambda ns, i: store.batch_set_from(
            ns, keys, self.native_layout, *parts[i], self.kv_interleaved, **ctx))
        if ok is None:
            return [False] * len(keys)
        self._remember([k for k, s in zip(keys, ok) if s])
        self._record(self._backup_pgs, self._backup_bw, sum(ok), start)
        return ok

    # ---- legacy tensor interface ---------------------------------------------------------

    def _flat_pages(self, op: str) -> None:
        """Point 10: SGLang's asymmetric K/V pool has no flat data page (its
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
        self._flat_pages("batch_get")
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
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
        for ns in self.namespaces:
            got = self._call(store, "batch_get", lambda: store.batch_get_bytes(
                ns, keys, self.native_layout, self.part_bytes))
            if got is None:
                return [None] * len(keys)
            parts.append(got)
        # Point 9: a page is whole only when every part of it was read.
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
        parts = [kv_layouts.split_page(self.plan, page) for page in src]
        ok = self._each_part(store, "batch_set", len(keys), lambda ns, i: store.batch_set_bytes(
            ns, keys, self.native_layout, [page[i] for page in parts]))
        if ok is None:
            return False
        self._remember([k for k, s in zip(keys, ok) if s])
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

    def _remember(self, keys: List[str]) -> None:
        with self._lock:
            self._stored.update(keys)

    def _record(self, pgs: list, bw: list, pages: int, start: float) -> None:
        if not self.storage_config.enable_storage_metrics:
            return
        elapsed = max(time.perf_counter() - start, 1e-9)
        with self._lock:
            pgs.append(pages)
            bw.append(pages * self.page_bytes / elapsed / 1e9)

    def clear(self) -> None:
        """Removes every page of this instance's namespace from the backend: pages written by
        this process, by other processes sharing the storage, and before a restart (file,
        uring, redis and memory backends, and plugins that clear (ABI 1.2), whose
        ``info()["clear"]`` is true). A backend without a
        namespace-wide clear gets the pages this instance stored deleted instead."""
        store = self._ready("clear")
        with self._lock:
            keys, self._stored = list(self._stored), set()
        for ns in self.namespaces:
            if store.info().get("clear"):
                store.clear(ns)
            elif keys:
                store.delete(ns, keys)

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
