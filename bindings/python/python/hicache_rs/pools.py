"""What hicache-rs knows about each host pool SGLang hands its storage backend.

One :class:`PoolAdapter` per registered pool (SGLang's ``PoolName``: kv, mamba, swa,
auxiliary_swa, indexer, the deepseek_v4_* pools, draft, draft_indexer, draft_swa). Model:

1. Pages are read and written in place through the pool's own ``get_page_buffer_meta``: the
   pieces of each page, in SGLang's order (Mamba: the temporal state then each conv state;
   DSA: the index_k + scale row; DeepSeek V4: one row per layer or one page row). The stored
   value of a page is its pieces concatenated, except the MHA ``layer_first`` KV pool, whose
   K0, V0, K1, ... pieces are stored K then V (as the v1 path stores them).
2. A pool SGLang itself cannot store is refused at registration with SGLang's own reason: the
   adapter asks the pool for the pieces of its first and last page, and whatever SGLang raises
   (MXFP8 pools: scales outside ``kv_buffer``; NVFP4 pools in a ``layer_first`` layout;
   Mamba pools with slot side states) becomes a ``ValueError`` quoting it, unless the flat
   data pages work (point 7).
3. Regions: the CPU tensors the pool's pieces may point into (``kv_buffer`` and the pool
   kinds' own buffers: ``temporal_buffer``, ``conv_buffer``, ``index_k_with_scale_buffer``,
   the unified pools' ``_host_page_buffer_view``), each as the whole allocation behind it.
   Every probed piece must lie inside them, or the pool is refused; the native store is given
   them (``Store.add_allowed_regions``) and refuses, at every call, any piece outside
   registered memory.
4. Host indices of every transfer are checked against the pool's page size and size
   (``sglang._check_host_indices``) before any pointer is made.
5. The geometry fingerprint (class, layout, page size, the byte sizes of a page's pieces,
   dtypes, layer count, storage format tag) is part of the pool's namespace: a pool whose
   shape changed never serves old bytes.
6. TP sharding follows SGLang's HiCacheFile: every pool of an MHA model is per TP rank; on an
   MLA model the pools are shared by the TP ranks except Mamba state, which is per rank.
7. A pool SGLang gives no pieces for but whose flat data pages it reads and writes
   (``get_data_page`` / ``set_from_flat_data_page``, as its HiCacheFile stores every pool:
   Mamba pools with slot side states, NVFP4 page rows in ``layer_first``) moves its pages as
   copies of those flat pages; only a pool whose flat pages SGLang refuses too (MXFP8 KV) is
   refused, with SGLang's reasons.
8. Native pieces: for the SGLang pool classes whose ``get_page_buffer_meta`` is plain
   arithmetic on a page's first index (``AFFINE_META``: MHA, K-only MHA, asymmetric MHA, MLA,
   Mamba, DSA indexer), every piece of page ``p`` is ``base + p * stride`` bytes.
   ``PoolAdapter.affine`` holds those ``(base, stride, size)`` rules once they are checked
   against SGLang's own pieces of the first, second and last page and of up to
   ``AFFINE_SAMPLE`` pages spread over the pool; the native store then makes a batch's
   pieces itself (``Store.add_pool``), still inside the registered regions. Any other pool,
   or a pool whose pieces do not follow the rules, has ``affine = None`` and its pieces come
   from SGLang at every call.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

#: Host pool attributes holding the tensors a pool's pieces point into (point 3).
BUFFER_ATTRS = (
    "kv_buffer", "temporal_buffer", "conv_buffer", "index_k_with_scale_buffer",
    "_host_page_buffer_view",
)

#: Attributes whose values describe a pool's bytes (point 5), when present.
GEOMETRY_ATTRS = (
    "dtype", "temporal_dtype", "conv_dtype", "indexer_dtype", "layer_num", "head_num",
    "head_dim", "v_head_dim", "kv_cache_dim", "item_bytes", "state_page_bytes", "row_bytes",
    "storage_format_tag",
)

#: Pages (besides the first, second and last) whose pieces are compared with the affine rules
#: at registration (point 8).
AFFINE_SAMPLE = 64


def _affine_meta() -> tuple:
    """SGLang's ``get_page_buffer_meta`` implementations that compute every piece as
    ``base + index * stride`` (point 8), those this SGLang has."""
    found = []
    for module, names in (
        ("sglang.srt.mem_cache.pool_host.mha",
         ("MHATokenToKVPoolHost", "MHATokenToKOnlyPoolHost", "AsymmetricMHATokenToKVPoolHost")),
        ("sglang.srt.mem_cache.pool_host.mla", ("MLATokenToKVPoolHost",)),
        ("sglang.srt.mem_cache.pool_host.mamba", ("MambaPoolHost",)),
        ("sglang.srt.mem_cache.pool_host.dsa", ("DSAIndexerPoolHost",)),
    ):
        try:
            m = importlib.import_module(module)
        except ImportError:
            continue
        for name in names:
            fn = getattr(getattr(m, name, None), "get_page_buffer_meta", None)
            if fn is not None:
                found.append(fn)
    return tuple(found)


AFFINE_META = _affine_meta()

#: Layouts a namespace can name; other layout strings are kept in the fingerprint.
NAMESPACE_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def pool_name(name: Any) -> str:
    """The plain string of SGLang's ``PoolName`` (or of a string)."""
    value = getattr(name, "value", name)
    if not isinstance(value, str) or not value:
        raise ValueError(f"host pool name must be a non-empty string or PoolName, got {name!r}")
    return value


def has_memory(pool: Any) -> bool:
    """Whether the pool holds page memory in one of its buffers (point 3), unlike SGLang's
    allocation-only logical anchor or a DSA indexer pool in dummy mode."""
    return any(t.numel() > 0 for attr in BUFFER_ATTRS for t in _tensors(getattr(pool, attr, None)))


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def buffer_regions(pool: Any) -> List[Tuple[int, int]]:
    """Point 3: ``(address, length)`` of the allocation behind every CPU buffer tensor."""
    regions = []
    for attr in BUFFER_ATTRS:
        for t in _tensors(getattr(pool, attr, None)):
            if t.device.type != "cpu":
                raise ValueError(
                    f"host pool {type(pool).__name__}: its buffer {attr} is on {t.device}, "
                    "hicache-rs reads and writes host (CPU) memory only"
                )
            storage = t.untyped_storage()
            if storage.nbytes() > 0:
                regions.append((storage.data_ptr(), storage.nbytes()))
    return regions


def _inside(regions: Sequence[Tuple[int, int]], ptr: int, size: int) -> bool:
    return any(start <= ptr and ptr + size <= start + length for start, length in regions)


def probe_pieces(name: str, pool: Any, indices: torch.Tensor) -> Tuple[list, list]:
    """The pool's pieces for ``indices``, or a ``ValueError`` quoting SGLang's refusal
    (point 2)."""
    try:
        meta = pool.get_page_buffer_meta(indices)
    except (NotImplementedError, ValueError, AssertionError, IndexError, RuntimeError) as e:
        raise ValueError(
            f"host pool {name!r} ({type(pool).__name__}) cannot be stored by hicache-rs: "
            f"SGLang gives no storage pages for it: {e}"
        ) from e
    if meta is None:
        raise ValueError(
            f"host pool {name!r} ({type(pool).__name__}) has no page memory "
            "(get_page_buffer_meta gives nothing)"
        )
    ptrs, sizes = meta
    return [int(p) for p in ptrs], [int(s) for s in sizes]


class PoolAdapter:
    """One registered host pool: its pieces, regions, geometry and sharding."""

    def __init__(self, name: str, pool: Any, kv_interleaved: bool = False,
                 is_mla_model: bool = False):
        self.name = name
        self.pool = pool
        self._is_mla_model = is_mla_model
        for attr in ("page_size", "size", "layout"):
            if getattr(pool, attr, None) is None:
                raise ValueError(
                    f"host pool {name!r} ({type(pool).__name__}) has no `{attr}`: not a "
                    "SGLang host pool hicache-rs can store"
                )
        self.page_size = int(pool.page_size)
        self.size = int(pool.size)
        self.layout = str(pool.layout)
        if self.page_size < 1 or self.size < self.page_size:
            raise ValueError(
                f"host pool {name!r}: page size {self.page_size} and size {self.size} "
                "hold no whole page"
            )
        self.kv_interleaved = kv_interleaved
        #: Whether pages move as copies of SGLang's flat data page (point 7) instead of in
        #: place through pieces.
        self.copy = False
        self.regions = buffer_regions(pool)
        if not self.regions:
            raise ValueError(
                f"host pool {name!r} ({type(pool).__name__}) has no CPU buffer hicache-rs "
                f"knows (looked for: {', '.join(BUFFER_ATTRS)})"
            )
        first = torch.arange(0, self.page_size, dtype=torch.int64)
        last_start = (self.size // self.page_size - 1) * self.page_size
        last = torch.arange(last_start, last_start + self.page_size, dtype=torch.int64)
        try:
            ptrs, sizes = probe_pieces(name, pool, first)
            lptrs, lsizes = probe_pieces(name, pool, last)
        except ValueError as refusal:
            self._init_copy(refusal)
            return
        if not sizes or sizes != lsizes:
            raise ValueError(
                f"host pool {name!r} ({type(pool).__name__}): its first and last pages have "
                f"pieces of {sizes} and {lsizes} bytes; hicache-rs needs the same pieces "
                "for every page"
            )
        for p, s in zip(ptrs + lptrs, sizes + lsizes):
            if s <= 0 or not _inside(self.regions, p, s):
                raise ValueError(
                    f"host pool {name!r} ({type(pool).__name__}): a page piece "
                    f"({p:#x}, {s} bytes) lies outside the buffers hicache-rs knows "
                    f"({', '.join(BUFFER_ATTRS)}); refusing to touch memory it cannot bound"
                )
        self.piece_sizes = sizes
        self.page_bytes = sum(sizes)
        self._finish(is_mla_model)
        self.affine = self._affine_rules()

    def _affine_rules(self) -> Optional[List[Tuple[int, int, int]]]:
        """Point 8: the pool's ``(base, stride, size)`` piece rules, or ``None``."""
        if (getattr(type(self.pool), "get_page_buffer_meta", None) not in AFFINE_META
                or "get_page_buffer_meta" in getattr(self.pool, "__dict__", {})):
            return None
        pages = self.size // self.page_size
        sample = sorted({0, 1, pages - 1} | {pages * k // AFFINE_SAMPLE
                                             for k in range(AFFINE_SAMPLE)})
        sample = [p for p in sample if 0 <= p < pages]
        starts = torch.tensor(sample, dtype=torch.int64) * self.page_size
        idx = (starts[:, None] + torch.arange(self.page_size, dtype=torch.int64)).reshape(-1)
        try:
            ptrs, sizes = self.pool.get_page_buffer_meta(idx)
        except Exception:  # SGLang refuses a batch it accepted page by page: no rules
            return None
        n = len(self.piece_sizes)
        if len(ptrs) != n * len(sample) or len(sizes) != len(ptrs):
            return None
        base = [int(p) for p in ptrs[:n]]
        stride = ([int(ptrs[n + j]) - base[j] for j in range(n)] if len(sample) > 1
                  else [0] * n)
        if any(s < 0 for s in stride):
            return None
        for k, page in enumerate(sample):
            for j in range(n):
                if (int(ptrs[k * n + j]) != base[j] + page * stride[j]
                        or int(sizes[k * n + j]) != self.piece_sizes[j]):
                    return None
        return [(base[j], stride[j], self.piece_sizes[j]) for j in range(n)]

    def _init_copy(self, refusal: ValueError) -> None:
        """Point 7: no pieces, but SGLang's flat data pages work: pages move as copies (no
        pointer of the pool reaches the native store). Otherwise SGLang's refusal stands."""
        try:
            flat = self.pool.get_data_page(0, flat=True)
            dummy = self.pool.get_dummy_flat_data_page()
        except Exception as e:  # SGLang's own refusal, whatever its type
            raise ValueError(f"{refusal}; its flat data pages are refused too: {e}") from e
        nbytes = int(flat.numel() * flat.element_size())
        if nbytes == 0 or nbytes != int(dummy.numel() * dummy.element_size()):
            raise refusal
        self.copy = True
        self.affine = None
        self.regions = []
        self.piece_sizes = [nbytes]
        self.page_bytes = nbytes
        self._finish(self._is_mla_model)

    def _finish(self, is_mla_model: bool) -> None:
        """Sharding (point 6), fingerprint (point 5) and the fields the storage class sets."""
        self.sharded = (not is_mla_model) or self.name == "mamba"
        self.fingerprint = self._fingerprint()
        #: The namespace the pool's pages are stored under (set by the storage class, which
        #: knows the deployment: model, ranks, tenant).
        self.namespace = ""
        #: The layout named to the native store with every call.
        self.store_layout = self.namespace_layout

    def _fingerprint(self) -> str:
        parts = [
            f"pool={self.name}",
            f"class={type(self.pool).__name__}",
            f"layout={self.layout}",
            f"page={self.page_size}",
            ("flat=" if self.copy else "pieces=") + ",".join(str(s) for s in self.piece_sizes),
        ]
        for attr in GEOMETRY_ATTRS:
            v = getattr(self.pool, attr, None)
            if v is not None and not callable(v):
                parts.append(f"{attr}={v}")
        return "|".join(parts)

    @property
    def namespace_layout(self) -> str:
        """The layout a namespace can name (others are in the fingerprint)."""
        return self.layout if self.layout in NAMESPACE_LAYOUTS else "page_first"

    def pieces(self, op: str, keys: List[str], host_indices: Any,
               check: Callable[..., None]) -> Tuple[list, list]:
        """Point 4: checks ``host_indices`` (whole pages of this pool, one per key) with
        ``check`` (``sglang._check_host_indices``; ``op`` names the call in its errors), then
        the pool's pieces for them."""
        check(op, keys, host_indices, self.page_size, self.size)
        if not keys:
            return [], []
        if self.copy:
            # Point 7: the page starts, for get_data_page / set_from_flat_data_page.
            return [int(i) for i in host_indices[:: self.page_size].tolist()], []
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        per_page = len(self.piece_sizes)
        if len(ptrs) != len(keys) * per_page or len(sizes) != len(ptrs):
            raise ValueError(
                f"{op}: pool {self.name!r} gave {len(ptrs)} pieces for {len(keys)} pages, "
                f"expected {per_page} per page"
            )
        return ptrs, sizes


def find_pool(pools: dict, name: Any) -> Optional[PoolAdapter]:
    """The adapter registered under ``name`` (a ``PoolName`` or string), if any."""
    return pools.get(pool_name(name))
