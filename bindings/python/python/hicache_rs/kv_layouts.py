"""How a host pool's pages are cut into stored objects: plain pages, SGLang's ``page_head``
layout in head slices (heterogeneous TP), and asymmetric K/V head dims.

:class:`hicache_rs.sglang.HiCacheRsStorage` stores every page as one or more *parts*. A part
is one object per key in one namespace; a page is present only when every part is. This
module decides the parts (:func:`plan`) and cuts SGLang's page pieces and flat pages into
them.

1. Plain pages (``layer_first``, ``page_first``, ``page_first_direct``, MHA and MLA): one
   part, the pool's page pieces (``get_page_buffer_meta``), in the rank's namespace.
2. ``page_head`` (MHA only; SGLang's MLA pool has no such layout): a page is
   ``[K|V][head][token][layer][dim]``, so the heads of a page are contiguous runs. SGLang
   gives TP rank ``r`` of ``tp_size`` the KV heads ``r*H .. (r+1)*H`` (``H`` heads per rank),
   and with ``tp_lcm_size`` (the least common multiple of the TP sizes of the instances
   sharing the storage, popped from the extra-config by SGLang's cache controller) its pages
   are cut in ``split = tp_lcm_size / tp_size`` head slices of ``H / split`` heads
   (``get_split_heads_page_buffer_meta``: per page, slice by slice, K then V). Slice ``i`` of
   rank ``r`` is global slice ``r*split + i`` of ``tp_lcm_size``, whatever this rank's TP
   size: each slice is one part whose namespace names the global slice (its index and
   ``tp_lcm_size``), the heads per slice and the rest of the geometry, never ``tp_size``. So a
   TP-2 instance and a TP-4 instance of the same model with ``tp_lcm_size`` 4 store and read
   the same objects, head for head. Without ``tp_lcm_size`` (or equal to ``tp_size``) a
   ``page_head`` page is one part, global slice ``r`` of ``tp_size``: the same objects a
   larger-TP writer's split produces when ``tp_lcm_size`` equals this TP size.
3. Asymmetric K/V (``AsymmetricMHATokenToKVPoolHost``: K head dim != V head dim, layouts
   ``page_first`` and ``page_first_direct``): K and V live in two buffers; a page is one part
   of two pieces of different sizes (K then V), and the namespace carries both head dims.
4. The native store knows the layouts ``layer_first``, ``page_first`` and
   ``page_first_direct`` (the tag it writes into page headers); ``page_head`` parts are
   stored with the ``page_first`` tag (each part is one K run then one V run), and the
   ``page_head`` layout itself is in the part's namespace, so they never meet plain
   ``page_first`` pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

#: Host pool layouts :class:`hicache_rs.sglang.HiCacheRsStorage` reads and writes.
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")

#: Layouts of SGLang's asymmetric K/V host pool.
ASYMMETRIC_LAYOUTS = ("page_first", "page_first_direct")

#: The native layout tag ``page_head`` parts are stored under (point 4).
PAGE_HEAD_NATIVE_LAYOUT = "page_first"


@dataclass(frozen=True)
class Plan:
    """How one rank's pages are stored (module points 1-3).

    ``slices``: parts per page (1 but for split ``page_head``); ``first_slice`` and
    ``total_slices``: the global index of this rank's first part and how many global slices
    there are (``page_head`` only; ``None`` otherwise); ``heads``: heads per part;
    ``native_layout``: the layout tag given to the native store; ``asymmetric``: K and V
    head dims differ."""

    layout: str
    native_layout: str
    slices: int
    first_slice: Optional[int]
    total_slices: Optional[int]
    heads: int
    asymmetric: bool

    @property
    def split_heads(self) -> bool:
        """Whether pages are cut into head slices by SGLang's split meta."""
        return self.slices > 1


def _positive_int(name: str, value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: `{name}` must be a positive integer, got {value!r}")
    return value


def plan(pool: Any, kind: str, asymmetric: bool, tp_rank: int, tp_size: int,
         tp_lcm_size: Optional[int]) -> Plan:
    """The plan of ``pool`` (``kind``: ``"mha"`` or ``"mla"``) on TP rank ``tp_rank`` of
    ``tp_size``; ``tp_lcm_size`` as SGLang's storage config carries it (``None``: not set).
    A ``ValueError`` names what does not fit: a layout we do not store, ``tp_lcm_size`` not
    a multiple of ``tp_size``, heads that do not divide into the slices, a pool whose buffer
    is not the layout's."""
    layout = getattr(pool, "layout", None)
    where = f"host pool {type(pool).__name__} (layout {layout!r})"
    if layout not in LAYOUTS:
        raise ValueError(
            f"host pool layout {layout!r} is not supported by hicache-rs "
            f"(expected one of: {', '.join(LAYOUTS)})"
        )
    if asymmetric and layout not in ASYMMETRIC_LAYOUTS:
        raise ValueError(
            f"{where}: K and V head dims differ, which SGLang supports only in layouts "
            f"{', '.join(ASYMMETRIC_LAYOUTS)}"
        )
    tp_size = _positive_int("tp_size", tp_size, where)
    if tp_lcm_size is not None:
        tp_lcm_size = _positive_int("tp_lcm_size", tp_lcm_size, where)
        if tp_lcm_size % tp_size:
            raise ValueError(
                f"{where}: tp_lcm_size {tp_lcm_size} is not a multiple of this instance's "
                f"tp_size {tp_size}: it must be the least common multiple of the TP sizes "
                "of every instance sharing the storage"
            )
    if layout != "page_head":
        heads = 1 if kind == "mla" else int(pool.head_num)
        return Plan(layout, layout, 1, None, None, heads, asymmetric)
    if kind != "mha":
        raise ValueError(f"{where}: page_head is an MHA layout, this pool is {kind}")
    heads = int(pool.head_num)
    expected = (2, int(pool.page_num), heads, int(pool.page_size), int(pool.layer_num),
                int(pool.head_dim))
    buf = getattr(pool, "kv_buffer", None)
    shape = tuple(getattr(buf, "shape", ()))
    if shape != expected:
        raise ValueError(
            f"{where}: a page_head KV buffer has shape {expected} "
            "(K|V, page, head, token, layer, dim), this one has "
            f"{shape}: hicache-rs cannot cut its pages into heads"
        )
    total = tp_lcm_size or tp_size
    split = total // tp_size
    if heads % split:
        raise ValueError(
            f"{where}: {heads} KV heads on this rank do not split into {split} slices "
            f"(tp_lcm_size {total} / tp_size {tp_size}); SGLang needs the same"
        )
    return Plan(layout, PAGE_HEAD_NATIVE_LAYOUT, split, tp_rank * split, total,
                heads // split, asymmetric)


def part_identity(p: Plan, part: int, tp_rank: int, tp_size: int) -> Tuple[int, int, str]:
    """``(rank, size, tag)`` for the namespace of part ``part``: the global slice and
    ``tp_lcm_size`` for ``page_head`` (point 2), else this rank; ``tag`` goes into the
    namespace's extra key."""
    if p.layout != "page_head":
        return tp_rank, tp_size, ""
    index = p.first_slice + part
    return index, p.total_slices, f"page_head:slice{index}/{p.total_slices}"


def part_pieces(p: Plan, pool: Any, host_indices: Any) -> List[Tuple[List[int], List[int]]]:
    """``(ptrs, sizes)`` of every part for a batch of whole pages (already checked against
    the pool): SGLang's own page meta, split meta for head slices, each part's pieces in page
    order."""
    if not p.split_heads:
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        return [(list(ptrs), list(sizes))]
    ptrs, sizes = pool.get_split_heads_page_buffer_meta(host_indices, p.slices)
    per_page = 2 * p.slices
    if len(ptrs) != len(sizes) or len(ptrs) % per_page:
        raise ValueError(
            f"page_head split meta: {len(ptrs)} pointers and {len(sizes)} sizes are not "
            f"{per_page} pieces per page (K and V of {p.slices} head slices)"
        )
    parts = []
    for s in range(p.slices):
        sel = [
            i for page in range(0, len(ptrs), per_page) for i in (page + 2 * s, page + 2 * s + 1)
        ]
        parts.append(([ptrs[i] for i in sel], [sizes[i] for i in sel]))
    return parts


def split_page(p: Plan, data: bytes) -> List[bytes]:
    """A flat data page (SGLang's ``get_data_page``) cut into the bytes of each part: for
    ``page_head`` slice ``s`` is K's ``s``-th run of heads then V's."""
    if p.slices == 1:
        return [data]
    half = len(data) // 2
    run = half // p.slices
    return [
        data[s * run:(s + 1) * run] + data[half + s * run:half + (s + 1) * run]
        for s in range(p.slices)
    ]


def join_page(p: Plan, parts: Sequence[bytes]) -> bytes:
    """The inverse of :func:`split_page`: the parts of a page back into its flat bytes."""
    if p.slices == 1:
        return parts[0]
    halves = [part[: len(part) // 2] for part in parts] + [part[len(part) // 2:] for part in parts]
    return b"".join(halves)
