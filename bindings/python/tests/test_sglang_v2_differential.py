"""Differential test of the v2 (multi-pool) storage interface: seeded random operation
sequences run side by side against SGLang's own ``HiCacheFile`` and ``HiCacheRsStorage``
(every backend our package compiles), both registered on the SAME host pools (SGLang's real
host pools of a hybrid model on CPU: a DSA model's MLA KV pool with its KV-derived DSA
indexer pool, and a Mamba state pool).

Operations: ``batch_set_v2`` of random components (KV, Mamba, indexer) for random subsets of a
chain's pages; ``batch_exists_v2`` over random spans with random ``prefix_keys``, sidecars in
random order with random hit policies (ALL_PAGES, TRAILING_PAGES with random windows); and
``batch_get_v2`` of random pages into zeroed host slots (each side its own). The
``PoolTransferResult`` fields and every success list must be identical, and every page read
must hold exactly the bytes written for its key.

BLOCK_GROUPS, which HiCacheFile refuses (``ValueError``), is checked against a small model of
the policy's documented meaning (``v2_harness.block_groups_pages``)."""

import os
import random

import pytest

from conftest import require_sglang

require_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy  # noqa: E402

from v2_harness import (  # noqa: E402
    BACKENDS,
    INDEXER,
    KV,
    MAMBA,
    PoolSet,
    block_groups_pages,
    chain,
    fill,
    flat_page_len,
    info,
    make_ours,
    make_reference,
    ours_config,
    page_bytes,
    page_starts,
    plain,
    read_page,
    result_tuple,
    transfer,
    zero,
)

SEEDS = range(20)
OPS = 30
CHAINS = 2
PAGES = 8
POLICIES = (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES)


@pytest.fixture(params=BACKENDS)
def backend_name(request):
    return request.param


class World:
    """The pools, the chains, their source slots and each side's destination slots."""

    def __init__(self, tag, kind="dsa"):
        self.pools = PoolSet(kv_pages=(CHAINS + 2) * PAGES + 2,
                             mamba_slots=(CHAINS + 2) * PAGES + 2, kind=kind)
        self.side = self.pools.side
        self.sidecars = (MAMBA, self.side)
        self.chains = [chain(f"{tag}/{c}", PAGES) for c in range(CHAINS)]
        # Source slots: one page per chain page in the KV pool (a KV-derived sidecar shares
        # them: indices_from_pool=KV; another has its own) and one Mamba slot per chain page.
        self.src = {c: self._slots() for c in range(CHAINS)}
        for c, keys in enumerate(self.chains):
            for name, idx in self.src[c].items():
                fill(self.pools, name, idx, keys)
        # Destination slots of each side, PAGES pages per pool.
        self.dst = {side: self._slots() for side in ("ref", "ours")}

    def _slots(self):
        kv = self.pools.alloc_pages(KV, PAGES)
        side = kv if self.pools.side_derived else self.pools.alloc_pages(self.side, PAGES)
        return {KV: kv, self.side: side, MAMBA: self.pools.alloc_pages(MAMBA, PAGES)}

    def derived(self, name):
        return KV if name == self.side and self.pools.side_derived else None

    def slots(self, table, name, pages):
        """The host indices of ``pages`` (positions) in ``table[name]``."""
        ps = self.pools.pool(name).page_size
        idx = table[name]
        return torch.cat([idx[p * ps:(p + 1) * ps] for p in pages]) if pages else idx[:0]


def random_pages(rng):
    """A contiguous run (with the chain prefix known) or a random subset (prefix unknown)."""
    if rng.random() < 0.6:
        a = 0 if rng.random() < 0.4 else rng.randrange(PAGES)
        b = rng.randrange(a + 1, PAGES + 1)
        return list(range(a, b)), True
    return sorted(rng.sample(range(PAGES), rng.randrange(1, PAGES + 1))), False


def components(w, rng):
    names = [n for n in (KV, MAMBA, w.side) if rng.random() < 0.6]
    return names or [rng.choice((KV, MAMBA, w.side))]


def op_set(w, rng, ref, ours, log):
    c = rng.randrange(CHAINS)
    pages, contiguous = random_pages(rng)
    keys = [w.chains[c][p] for p in pages]
    names = components(w, rng)
    prefix = w.chains[c][:pages[0]] if contiguous and rng.random() < 0.5 else None
    transfers = [transfer(n, keys, w.slots(w.src[c], n, pages), indices_from_pool=w.derived(n))
                 for n in names]
    if rng.random() < 0.05:
        # A host-index count that does not match the keys: that pool all False, on both.
        t = rng.choice(transfers)
        t.host_indices = t.host_indices[:-1]
    log.append(("set", c, pages, [n.value for n in names], prefix is not None))
    a = plain(ref.batch_set_v2(transfers, info(prefix)))
    b = plain(ours.batch_set_v2(transfers, info(prefix)))
    assert b == a, log


def exists_transfers(w, rng, keys):
    out = []
    for n in rng.sample(w.sidecars, rng.randrange(len(w.sidecars) + 1)):
        policy = rng.choice(POLICIES)
        if rng.random() < 0.15:
            # No keys: SGLang's KV-derived sidecars at query time; a window of 1 for
            # TRAILING_PAGES.
            out.append(transfer(n, None, policy=policy))
        elif policy == PoolHitPolicy.TRAILING_PAGES:
            window = rng.randrange(1, 5)
            out.append(transfer(n, keys[-window:] if keys else [], policy=policy))
        else:
            out.append(transfer(n, keys, policy=policy))
    return out


def op_exists(w, rng, ref, ours, log):
    c = rng.randrange(CHAINS)
    a = rng.randrange(PAGES) if rng.random() < 0.4 else 0
    b = rng.randrange(a, PAGES + 1) if rng.random() < 0.3 else PAGES
    keys = w.chains[c][a:b]
    prefix = w.chains[c][:a] if rng.random() < 0.7 else None
    transfers = exists_transfers(w, rng, keys)
    log.append(("exists", c, a, b, [(t.name.value, t.hit_policy.value,
                                     None if t.keys is None else len(t.keys))
                                    for t in transfers]))
    want = result_tuple(ref.batch_exists_v2(keys, transfers, info(prefix)))
    got = result_tuple(ours.batch_exists_v2(keys, transfers, info(prefix)))
    assert got == want, log


def op_get(w, rng, ref, ours, log):
    c = rng.randrange(CHAINS)
    pages, contiguous = random_pages(rng)
    keys = [w.chains[c][p] for p in pages]
    names = components(w, rng)
    prefix = w.chains[c][:pages[0]] if contiguous and rng.random() < 0.5 else None
    log.append(("get", c, pages, [n.value for n in names]))
    answers = {}
    for side, backend in (("ref", ref), ("ours", ours)):
        dst = w.dst[side]
        positions = list(range(len(pages)))
        transfers = []
        for n in names:
            idx = w.slots(dst, n, positions)
            zero(w.pools, n, idx)
            transfers.append(transfer(n, keys, idx, indices_from_pool=w.derived(n)))
        answers[side] = plain(backend.batch_get_v2(transfers, info(prefix)))
        # Every page reported read holds exactly the bytes written for its key.
        for t in transfers:
            pool = w.pools.pool(t.name)
            n_bytes = flat_page_len(pool)
            for ok, key, start in zip(answers[side][t.name.value], keys,
                                      page_starts(pool, t.host_indices)):
                if ok:
                    assert read_page(pool, start) == page_bytes(t.name, key, n_bytes), (
                        side, t.name, log)
    assert answers["ours"] == answers["ref"], log


OPS_TABLE = (op_set, op_set, op_exists, op_exists, op_exists, op_get)


@pytest.mark.parametrize("kind,seed", [("dsa", s) for s in SEEDS]
                         + [("mha-swa", s) for s in SEEDS[::2]])
def test_random_sequences_match_hicache_file(kind, seed, backend_name, request, tmp_path):
    """``dsa``: MLA KV + KV-derived DSA indexer + Mamba; ``mha-swa``: MHA KV (layer_first) +
    an SWA pool with its own indices + Mamba (half the seeds)."""
    extra = ours_config(backend_name, request, tmp_path)
    extra["_selfcheck_dir"] = str(tmp_path / "self")
    w = World(f"{kind}/{backend_name}/{seed}/{tmp_path.name}", kind)
    ref = make_reference(w.pools, tmp_path / "ref")
    ours = make_ours(w.pools, extra)
    rng = random.Random(seed)
    log = [("seed", seed, backend_name)]
    try:
        for _ in range(OPS):
            rng.choice(OPS_TABLE)(w, rng, ref, ours, log)
        # Closing query: every chain in full, every sidecar under both policies.
        for c in range(CHAINS):
            keys = w.chains[c]
            for policy in POLICIES:
                ts = [transfer(n, keys if policy == PoolHitPolicy.ALL_PAGES else keys[-2:],
                               policy=policy) for n in w.sidecars]
                want = result_tuple(ref.batch_exists_v2(keys, ts, info([])))
                assert result_tuple(ours.batch_exists_v2(keys, ts, info([]))) == want, log
    finally:
        for b in (ours, ref):
            if hasattr(b, "close"):
                b.close()


def test_hicache_file_refuses_block_groups(tmp_path):
    """The reason BLOCK_GROUPS is checked against a model: SGLang's reference refuses it."""
    w = World("bg-ref")
    ref = make_reference(w.pools, tmp_path / "ref")
    keys = w.chains[0]
    ref.batch_set_v2([transfer(KV, keys, w.slots(w.src[0], KV, range(PAGES)))])
    t = transfer(INDEXER, keys, policy=PoolHitPolicy.BLOCK_GROUPS, block_pages=2, group_pages=2)
    with pytest.raises(ValueError):
        ref.batch_exists_v2(keys, [t])


@pytest.mark.parametrize("seed", range(10))
def test_block_groups_against_the_policy_model(seed, backend_name, request, tmp_path):
    """Random present sets of a BLOCK_GROUPS pool (KV-derived indexer pages standing for
    compressed blocks), next to a Mamba pool under ALL_PAGES or TRAILING_PAGES, in random
    order: ours reports for the group pool the pages its leading complete groups cover (the
    model), and everything else (KV hit, restorable prefixes, the other pools' verdicts) is
    HiCacheFile's answer for the query without the BLOCK_GROUPS transfer: the group pool
    neither gates nor is gated."""
    if os.environ.get("HICACHE_V2_SELFCHECK") == "1":
        pytest.skip("HiCacheFile (the self-check's stand-in) refuses BLOCK_GROUPS")
    rng = random.Random(1000 + seed)
    extra = ours_config(backend_name, request, tmp_path)
    extra["_selfcheck_dir"] = str(tmp_path / "self")
    w = World(f"bg/{backend_name}/{seed}/{tmp_path.name}")
    ref = make_reference(w.pools, tmp_path / "ref")
    ours = make_ours(w.pools, extra)
    try:
        for trial in range(6):
            c = trial % CHAINS
            keys = chain(f"bg/{backend_name}/{seed}/{tmp_path.name}/{trial}", PAGES)
            src = w.src[c]
            # The source slots hold chain c's bytes; the pages are stored under these keys
            # (content is not what this test is about, presence is).
            kv_pages = rng.randrange(PAGES + 1)
            group_present = sorted(rng.sample(range(PAGES), rng.randrange(PAGES + 1)))
            mamba_present = sorted(rng.sample(range(PAGES), rng.randrange(PAGES + 1)))
            for b in (ref, ours):
                ts = []
                if kv_pages:
                    ts.append(transfer(KV, keys[:kv_pages], w.slots(src, KV, range(kv_pages))))
                if group_present:
                    ts.append(transfer(INDEXER, [keys[p] for p in group_present],
                                       w.slots(src, INDEXER, group_present),
                                       indices_from_pool=KV))
                if mamba_present:
                    ts.append(transfer(MAMBA, [keys[p] for p in mamba_present],
                                       w.slots(src, MAMBA, mamba_present)))
                assert all(all(v) for v in b.batch_set_v2(ts).values())
            group_pages = rng.choice((1, 2, 3))
            block_pages = rng.choice((1, 2, 4))
            group_keys = keys[:rng.randrange(PAGES + 1)]
            bg = transfer(INDEXER, group_keys, policy=PoolHitPolicy.BLOCK_GROUPS,
                          block_pages=block_pages, group_pages=group_pages)
            policy = rng.choice(POLICIES)
            other = transfer(MAMBA, keys if policy == PoolHitPolicy.ALL_PAGES
                             else keys[-rng.randrange(1, 4):], policy=policy)
            order = [bg, other] if rng.random() < 0.5 else [other, bg]
            got = result_tuple(ours.batch_exists_v2(keys, order, info([])))
            base = result_tuple(ref.batch_exists_v2(keys, [other], info([])))
            want_pages = block_groups_pages({keys[p] for p in group_present}, group_keys,
                                            block_pages, group_pages, kv_pages)
            if order[0] is other and not base[2]:
                # HiCacheFile's convention for every pool: once no prefix is restorable, the
                # pools after that point get no verdict (SGLang reads "no verdict", not 0).
                want_pages = 0
            ctx = dict(seed=seed, trial=trial, kv_pages=kv_pages, group=group_present,
                       mamba=mamba_present, group_pages=group_pages, block_pages=block_pages,
                       group_keys=len(group_keys), other=(policy.value, len(other.keys)),
                       bg_first=order[0] is bg, got=got, base=base, want=want_pages)
            # Never gates the KV hit, the restorable prefixes or the other pools' verdicts.
            assert got[0] == base[0], ctx
            assert got[2] == base[2], ctx
            assert {k: v for k, v in got[1].items() if k != INDEXER.value} == base[1], ctx
            # Its own verdict: the model's (absent when zero, as every pool's).
            assert got[1].get(INDEXER.value, 0) == want_pages, ctx
            assert (INDEXER.value in got[1]) == (want_pages > 0), ctx
    finally:
        for b in (ours, ref):
            if hasattr(b, "close"):
                b.close()
