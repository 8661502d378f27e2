"""The hit policies of SGLang's ``batch_exists_v2``, as pure functions of per-page presence.

SGLang 0.5.23's own ``HiCacheFile`` is the executable reference for ``all_pages`` and
``trailing_pages``; :func:`evaluate` gives the same ``(kv_hit_pages, extra_pool_hit_pages,
restorable_prefix_pages)`` for the same presence pattern:

1. The KV verdict is the leading run of present KV pages (``kv_pages``). Every prefix length
   ``1..kv_pages`` starts out restorable; ``extra_pool_hit_pages`` holds ``{"kv": kv_pages}``
   only when ``kv_pages > 0``.
2. Pools are taken in the order given, and the walk stops as soon as no prefix length is
   restorable any more (so later pools then have no entry).
3. ``all_pages``: the pool's pages ``0..b`` are present; restorable lengths are ``1..b`` where
   ``b`` is the first missing page below ``kv_pages`` (or ``kv_pages``).
4. ``trailing_pages``: with ``w = max(1, len(transfer.keys))`` (1 when the transfer has no
   keys), length ``p`` is restorable when the pool has pages ``max(0, p - w) .. p - 1``. Holes
   are allowed: 5 may be restorable while 4 is not.
5. A pool's entry in ``extra_pool_hit_pages`` is its largest restorable length, left out when
   zero. The restorable set is intersected across pools; ``kv_hit_pages`` is its maximum.
6. ``block_groups`` (SGLang documents it; its HiCacheFile raises ``ValueError`` and nothing in
   SGLang 0.5.23 produces it): the pool's keys form groups of ``group_pages`` keys from the
   start of the span, and each complete group (every key present) covers ``block_pages`` FULL
   pages. The pool's verdict is ``block_pages`` times its number of leading complete groups,
   capped at ``kv_pages``; it is reported (when non-zero) but never gates the KV hit or the
   restorable set (a second form of the FULL pages, not a condition on them). A transfer with
   ``block_pages`` or ``group_pages`` below 1 is a ``ValueError``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

#: The policy names (SGLang's ``PoolHitPolicy`` values).
ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
BLOCK_GROUPS = "block_groups"


def policy_name(policy) -> str:
    """The plain string of a ``PoolHitPolicy`` (or of a string naming one)."""
    return str(getattr(policy, "value", policy))


def pool_name(name) -> str:
    """The plain string of a ``PoolName`` (or of a string naming one)."""
    return str(getattr(name, "value", name))


def leading_run(present: Sequence[bool]) -> int:
    """Number of leading ``True`` values."""
    for i, p in enumerate(present):
        if not p:
            return i
    return len(present)


def trailing_window(keys: Optional[Sequence[str]]) -> int:
    """The ``trailing_pages`` window of a transfer (point 4)."""
    return max(1, len(keys) if keys else 1)


def _has(present: Sequence[bool], i: int) -> bool:
    return i < len(present) and bool(present[i])


def block_groups_verdict(
    kv_pages: int, present: Sequence[bool], block_pages: int, group_pages: int
) -> int:
    """Point 6: pages covered by the leading complete groups of the pool's keys, capped at
    ``kv_pages``."""
    if block_pages < 1 or group_pages < 1:
        raise ValueError(
            f"block_groups needs block_pages >= 1 and group_pages >= 1, "
            f"got block_pages={block_pages}, group_pages={group_pages}"
        )
    groups = leading_run(present) // group_pages
    return min(kv_pages, groups * block_pages)


def evaluate(
    kv_pages: int,
    transfers: Sequence,
    present: Union[Mapping[str, Sequence[bool]], Callable[[Any], Sequence[bool]]],
) -> Tuple[int, Dict[str, int], List[int]]:
    """``(kv_hit_pages, extra_pool_hit_pages, restorable_prefix_pages)`` (points 1-6).

    ``transfers``: objects with SGLang's ``PoolTransfer`` fields ``name``, ``hit_policy``,
    ``keys``, ``block_pages``, ``group_pages``. ``present[name]``: for ``all_pages`` and
    ``trailing_pages`` pools, whether the pool has each of the query's pages (at least the
    first ``kv_pages``); for ``block_groups`` pools, whether it has each of its keys.
    ``present`` may also be a function of the transfer giving that list: it is then called
    only for the pools the walk reaches (point 2), so a storage asks no more than needed."""
    hit: Dict[str, int] = {"kv": kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for t in transfers:
        if not restorable:
            break
        name = pool_name(t.name)
        policy = policy_name(t.hit_policy)
        flags = present(t) if callable(present) else present.get(name, ())
        if policy == ALL_PAGES:
            boundary = leading_run([_has(flags, i) for i in range(kv_pages)])
            allowed = set(range(1, boundary + 1))
        elif policy == TRAILING_PAGES:
            w = trailing_window(t.keys)
            allowed = {
                p
                for p in range(1, kv_pages + 1)
                if all(_has(flags, i) for i in range(max(0, p - w), p))
            }
            boundary = max(allowed, default=0)
        elif policy == BLOCK_GROUPS:
            boundary = block_groups_verdict(
                kv_pages, flags, int(t.block_pages or 0), int(t.group_pages or 0)
            )
            if boundary:
                hit[name] = boundary
            continue
        else:
            raise ValueError(f"pool {name!r}: unsupported hit policy {t.hit_policy!r}")
        if boundary:
            hit[name] = boundary
        restorable = [p for p in restorable if p in allowed]
    return (restorable[-1] if restorable else 0), hit, restorable


def check_transfer(transfer) -> None:
    """``ValueError`` for a transfer whose policy is unknown or whose ``block_groups``
    geometry is not positive (bad input, raised before any I/O)."""
    policy = policy_name(transfer.hit_policy)
    if policy not in (ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS):
        raise ValueError(
            f"pool {pool_name(transfer.name)!r}: unsupported hit policy {transfer.hit_policy!r}"
        )
    if policy == BLOCK_GROUPS:
        block, group = int(transfer.block_pages or 0), int(transfer.group_pages or 0)
        if block < 1 or group < 1:
            raise ValueError(
                f"pool {pool_name(transfer.name)!r}: block_groups needs block_pages >= 1 and "
                f"group_pages >= 1, got block_pages={block}, group_pages={group}"
            )


def pages_to_ask(kv_pages: int, transfer) -> int:
    """How many of the query's pages (from the first) decide ``transfer``'s verdict: the
    first ``kv_pages`` for ``all_pages``/``trailing_pages``; for ``block_groups`` its keys
    up to the complete groups that can count (``ceil(kv_pages / block_pages)`` groups)."""
    policy = policy_name(transfer.hit_policy)
    if policy != BLOCK_GROUPS:
        return kv_pages
    block, group = int(transfer.block_pages or 0), int(transfer.group_pages or 0)
    if block < 1 or group < 1:
        return 0
    return -(-kv_pages // block) * group
