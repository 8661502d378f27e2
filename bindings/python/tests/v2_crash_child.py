"""The writer of test_sglang_v2_crash.py, run in a child process (forked from a forkserver
that preloads this module, so SGLang is imported once): hybrid backups of KV + DSA indexer
+ Mamba state through ``batch_set_v2``, node after node, sequence after sequence, reporting
each acknowledged node to the parent, until the parent SIGKILLs it."""

import conftest  # noqa: F401  (SGLang without its server __init__)

from v2_harness import INDEXER, KV, MAMBA, PoolSet, chain, fill, info, make_ours, transfer

PAGES = 6  # pages per sequence
NODE = 2  # pages per backup (one node); its Mamba state is at its last page
POOL_PAGES = 8
MAX_SEQUENCES = 10_000  # bound of the writer's loop


def sequence_keys(tag, s):
    return chain(f"crash/{tag}/{s}", PAGES)


def pools():
    return PoolSet(kv_pages=POOL_PAGES, mamba_slots=POOL_PAGES)


def writer(extra, tag, conn):
    p = pools()
    backend = make_ours(p, extra)
    kv_src = p.alloc_pages(KV, NODE)
    mamba_src = p.alloc_pages(MAMBA, 1)
    conn.send("ready")
    for s in range(MAX_SEQUENCES):
        keys = sequence_keys(tag, s)
        for lo in range(0, PAGES, NODE):
            node = keys[lo:lo + NODE]
            fill(p, KV, kv_src, node)
            fill(p, INDEXER, kv_src, node)
            fill(p, MAMBA, mamba_src, node[-1:])
            res = backend.batch_set_v2(
                [transfer(KV, node, kv_src),
                 transfer(INDEXER, node, kv_src, indices_from_pool=KV),
                 transfer(MAMBA, node[-1:], mamba_src)],
                info(keys[:lo]),
            )
            ok = all(all(v) for v in res.values())
            conn.send((s, lo, ok))
