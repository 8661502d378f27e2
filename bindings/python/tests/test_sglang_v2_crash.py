"""SIGKILL during hybrid backups (KV + DSA indexer + Mamba state through ``batch_set_v2``) on
the file and uring backends, then a fresh instance over the same directory: for every key
sequence, every prefix in ``restorable_prefix_pages`` is fully readable (KV and indexer
pages, and the Mamba state at its end) and every KV page up to ``kv_hit_pages`` too, each with
exactly the bytes written (computed from the key), every node the writer saw acknowledged is
restorable, and no read anywhere returns wrong bytes.

The writer runs in a child forked from a multiprocessing forkserver that preloads SGLang
(``v2_crash_child``); the parent kills it right after it has reported a seeded number of
acknowledged nodes, so the kill lands inside the next backup or between two. Nothing waits
on time: the parent reads the child's reports with a bounded poll."""

import multiprocessing
import os
import random
import signal

import pytest

from conftest import require_sglang

require_sglang()

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy  # noqa: E402

import v2_crash_child as child  # noqa: E402
from v2_harness import (  # noqa: E402
    INDEXER,
    KV,
    MAMBA,
    flat_page_len,
    info,
    make_ours,
    page_bytes,
    page_starts,
    read_page,
    transfer,
    zero,
)

TIMEOUT = 180  # seconds for one report of the child (its first includes SGLang's import)

_ctx = None


def context():
    """The forkserver context, its server started with SGLang preloaded. Python 3.11's
    forkserver ignores the parent's sys.path, so the tests directory reaches it through
    PYTHONPATH (set only while it starts)."""
    global _ctx
    if _ctx is None:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["v2_crash_child"])
        old = os.environ.get("PYTHONPATH")
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["PYTHONPATH"] = here + (os.pathsep + old if old else "")
        try:
            forkserver.ensure_running()
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        _ctx = ctx
    return _ctx


# Started at collection: the server's SGLang import overlaps the tests collected before these.
context()


def config(backend, directory):
    if backend == "file":
        extra = {"backend": "file", "dir": str(directory)}
    else:
        extra = {"backend": "uring", "dir": str(directory), "capacity": "64MiB",
                 "grow_bytes": "1MiB"}
    extra["_selfcheck_dir"] = str(directory)
    return extra


def run_and_kill(extra, tag, kill_after):
    """Starts the writer, reads ``kill_after`` acknowledged nodes, SIGKILLs it. Returns the
    acknowledged (sequence, node start) pairs."""
    ctx = context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child.writer, args=(extra, tag, send), daemon=True)
    proc.start()
    send.close()
    acked = []
    try:
        assert recv.poll(TIMEOUT), "the writer did not start"
        assert recv.recv() == "ready"
        while len(acked) < kill_after:
            assert recv.poll(TIMEOUT), f"the writer stopped after {acked}"
            s, lo, ok = recv.recv()
            assert ok, f"backup {s}/{lo} failed"
            acked.append((s, lo))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(TIMEOUT)
        recv.close()
    assert proc.exitcode == -signal.SIGKILL
    return acked


def read_back(backend, pools, name, keys):
    """batch_get_v2 of ``keys`` of pool ``name`` into zeroed slots: the success list, and
    every success checked against the key's bytes (never wrong bytes)."""
    pool = pools.pool(name)
    idx = pools.alloc_pages(name, len(keys))
    try:
        zero(pools, name, idx)
        res = backend.batch_get_v2(
            [transfer(name, keys, idx, indices_from_pool=KV if name == INDEXER else None)])
        ok = [bool(x) for x in res[getattr(name, "value", name)]]
        n = flat_page_len(pool)
        for good, key, start in zip(ok, keys, page_starts(pool, idx)):
            if good:
                assert read_page(pool, start) == page_bytes(name, key, n), (name, key)
        return ok
    finally:
        pool.free(idx)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("backend", ["file", "uring"])
def test_sigkill_during_hybrid_backup_leaves_only_whole_restorable_prefixes(backend, seed,
                                                                           tmp_path):
    kill_after = random.Random(seed).randrange(1, 12)
    extra = config(backend, tmp_path / "l3")
    tag = f"{backend}-{seed}-{tmp_path.name}"
    acked = run_and_kill(extra, tag, kill_after)
    last_seq = acked[-1][0]

    pools = child.pools()
    fresh = make_ours(pools, extra)
    node_ends = list(range(child.NODE, child.PAGES + 1, child.NODE))
    try:
        for s in range(last_seq + 2):
            keys = child.sequence_keys(tag, s)
            r = fresh.batch_exists_v2(
                keys,
                [transfer(INDEXER, keys, policy=PoolHitPolicy.ALL_PAGES),
                 transfer(MAMBA, keys[-1:], policy=PoolHitPolicy.TRAILING_PAGES)],
                info([]),
            )
            restorable = list(r.restorable_prefix_pages or [])
            # States were written only at node ends.
            assert set(restorable) <= set(node_ends), (s, restorable)
            # Every acknowledged node survived the kill.
            for (a, lo) in acked:
                if a == s:
                    assert lo + child.NODE in restorable, (s, lo, restorable)
            assert r.kv_hit_pages == (max(restorable) if restorable else 0)
            # Every restorable prefix is whole: KV and indexer pages, and its state.
            for p in restorable:
                assert all(read_back(fresh, pools, KV, keys[:p])), (s, p)
                assert all(read_back(fresh, pools, INDEXER, keys[:p])), (s, p)
                assert read_back(fresh, pools, MAMBA, keys[p - 1:p]) == [True], (s, p)
            # And what the KV query reports present is readable.
            kv_only = fresh.batch_exists_v2(keys, [], info([]))
            assert all(read_back(fresh, pools, KV, keys[:kv_only.kv_hit_pages])), s
            # Anything else that reads, reads right (checked inside read_back).
            for name in (KV, INDEXER, MAMBA):
                read_back(fresh, pools, name, keys)
    finally:
        if hasattr(fresh, "close"):
            fresh.close()
