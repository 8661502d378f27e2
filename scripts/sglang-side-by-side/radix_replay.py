"""Replays a token trace through SGLang's own ``RadixCache`` under the replay rule of
``hicache-bench tree`` and checks every request's hit against ``hicache-bench tree --log``.

Usage: radix_replay.py TRACE.jsonl PAGE_SIZE CAPACITY LOG.tsv [--min-time SECONDS]

CAPACITY is a number of pages or ``unlimited``. The replay rule (the one ``hicache-bench
tree`` documents): key = tokens cut to whole pages (n pages); n = 0 is a miss; m = match(key);
lock the matched node; need = n - m; if need > 0 and fewer than need pages are free, evict
(need - free) pages' worth of tokens (whole leaves, oldest first); if still too few are free,
skip the insert, otherwise allocate need pages and insert the key; unlock. Free pages = capacity
minus pages held by the tree: the allocator below hands out page-aligned token slots and takes
them back when the tree evicts (SGLang calls ``free_segment``).

Timing covers the replay loop only (keys are built before the clock starts, as the Rust side
parses the trace first); each replay starts from a new, empty cache built outside the clock.
Prints one JSON line.
"""

import argparse
import array
import json
import logging
import statistics
import sys
import time
import warnings

import sglang_import

SGLANG_VERSION = sglang_import.load()
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402


class PageAllocator:
    """Pages of ``page_size`` token slots; ``capacity`` pages, or unlimited (None)."""

    def __init__(self, capacity, page_size):
        self.device = "cpu"
        self.page_size = page_size
        self.capacity = capacity
        self.free_pages = list(range(capacity)) if capacity is not None else []
        self.next_page = 0 if capacity is None else capacity

    def free_count(self):
        return len(self.free_pages) if self.capacity is not None else sys.maxsize

    def alloc(self, pages):
        if self.capacity is None:
            ids = list(range(self.next_page, self.next_page + pages))
            self.next_page += pages
        else:
            ids = self.free_pages[-pages:]
            del self.free_pages[-pages:]
        p = torch.tensor(ids, dtype=torch.int64) * self.page_size
        return (p[:, None] + torch.arange(self.page_size, dtype=torch.int64)).reshape(-1)

    def free_segment(self, value, start_pos=0):
        pages = (value[start_pos :: self.page_size] // self.page_size).tolist()
        if self.capacity is not None:
            self.free_pages.extend(pages)

    free = free_segment


def replay(keys, page_size, capacity):
    """One replay; returns (seconds, hits per request, skipped inserts)."""
    alloc = PageAllocator(capacity, page_size)
    cache = RadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=alloc,
            page_size=page_size,
        )
    )
    hits = []
    skipped = 0
    empty = torch.empty((0,), dtype=torch.int64)
    start = time.perf_counter()
    for key in keys:
        if key is None:
            hits.append(0)
            continue
        n = len(key) // page_size
        m = cache.match_prefix(MatchPrefixParams(key=key))
        node = m.last_device_node
        hit = m.device_prefix_len
        hits.append(hit)
        cache.inc_lock_ref(node)
        need = n - hit // page_size
        if need > 0 and alloc.free_count() < need:
            cache.evict(EvictParams(num_tokens=(need - alloc.free_count()) * page_size))
        if alloc.free_count() >= need:
            prefix = cache.path_device_indices(node) if hit else empty
            value = torch.cat([prefix, alloc.alloc(need)]) if need else prefix
            cache.insert(InsertParams(key=key, value=value))
        else:
            skipped += 1
        cache.dec_lock_ref(node)
    return time.perf_counter() - start, hits, skipped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("page_size", type=int)
    ap.add_argument("capacity")
    ap.add_argument("log")
    ap.add_argument("--min-time", type=float, default=3.0)
    a = ap.parse_args()
    capacity = None if a.capacity == "unlimited" else int(a.capacity)
    keys = []
    with open(a.trace) as f:
        for line in f:
            if not line.strip():
                continue
            tokens = json.loads(line)["tokens"]
            n = len(tokens) // a.page_size * a.page_size
            keys.append(RadixKey(array.array("q", tokens[:n])) if n else None)
    with open(a.log) as f:
        rows = [l.rstrip("\n").split("\t") for l in f][1:]
    expected = [int(r[2]) for r in rows]
    if len(expected) != len(keys):
        sys.exit(f"the log has {len(expected)} requests, the trace {len(keys)}")
    times = []
    first = None
    while len(times) < 3 or sum(times) < a.min_time:
        t, hits, skipped = replay(keys, a.page_size, capacity)
        times.append(t)
        if first is None:
            first = (hits, skipped)
    hits, skipped = first
    bad = [i for i, (h, e) in enumerate(zip(hits, expected)) if h != e]
    out = {
        "sglang": SGLANG_VERSION,
        "torch": torch.__version__,
        "requests": len(keys),
        "req_per_s": len(keys) / statistics.median(times),
        "best_req_per_s": len(keys) / min(times),
        "replays": len(times),
        "hit_tokens": sum(hits),
        "skipped": skipped,
        "mismatches": len(bad),
    }
    if bad:
        i = bad[0]
        out["first_mismatch"] = {"request": i, "sglang": hits[i], "hicache": expected[i]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
