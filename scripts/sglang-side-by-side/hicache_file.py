"""Write and read throughput of SGLang's own ``HiCacheFile`` L3 backend.

Usage: hicache_file.py DIR PAGE_BYTES PAGES [--batch N]

Writes PAGES pages of PAGE_BYTES (uint8 CPU tensors, a different pattern per page) through
``batch_set`` in batches of N (as SGLang's cache controller calls it), then reads them back
through ``batch_get`` into preallocated tensors and checks every byte. Three figures, GB/s
(1e9 bytes per second):

- ``write``: ``batch_set`` alone. HiCacheFile writes each page with ``numpy.tofile`` to a
  temporary file and renames it, without any fsync: the figure is page-cache speed, and an
  acknowledged page can be lost on a crash.
- ``write_durable``: ``batch_set`` plus an ``fsync`` of every file written and of the
  directory, the cost of making the same pages durable (what a ``fsync: batch`` backend pays
  before it acknowledges).
- ``read``: ``batch_get`` after the pages were synced and dropped from the page cache
  (``posix_fadvise(DONTNEED)`` per file), so the reads come from the disk (cold), as the Rust
  bench's O_DIRECT reads do.

Prints one JSON line.
"""

import argparse
import json
import logging
import os
import time
import warnings

import sglang_import

SGLANG_VERSION = sglang_import.load()
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageConfig,
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("page_bytes", type=int)
    ap.add_argument("pages", type=int)
    ap.add_argument("--batch", type=int, default=128)
    a = ap.parse_args()
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="side-by-side",
        extra_config={"file_storage_path": a.dir},
    )
    store = HiCacheFile(cfg)
    keys = [f"{i:064x}" for i in range(a.pages)]
    base = torch.arange(a.page_bytes, dtype=torch.int64)
    values = [((base * 31 + i * 7) % 251).to(torch.uint8) for i in range(a.pages)]
    total = a.pages * a.page_bytes

    start = time.perf_counter()
    for at in range(0, a.pages, a.batch):
        if not store.batch_set(keys[at : at + a.batch], values[at : at + a.batch]):
            raise SystemExit(f"batch_set failed at page {at}")
    write_s = time.perf_counter() - start
    files = [
        os.path.join(store.file_path, f"{store._get_suffixed_key(k)}.bin") for k in keys
    ]
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dfd = os.open(store.file_path, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    durable_s = time.perf_counter() - start

    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    targets = [torch.empty(a.page_bytes, dtype=torch.uint8) for _ in range(a.pages)]
    start = time.perf_counter()
    for at in range(0, a.pages, a.batch):
        got = store.batch_get(keys[at : at + a.batch], targets[at : at + a.batch])
        if any(g is None for g in got):
            raise SystemExit(f"batch_get missed a page in the batch at {at}")
    read_s = time.perf_counter() - start
    bad = sum(1 for v, t in zip(values, targets) if not torch.equal(v, t))
    if bad:
        raise SystemExit(f"{bad} pages read back wrong")
    print(
        json.dumps(
            {
                "sglang": SGLANG_VERSION,
                "page_bytes": a.page_bytes,
                "pages": a.pages,
                "batch": a.batch,
                "write": total / write_s / 1e9,
                "write_durable": total / durable_s / 1e9,
                "read": total / read_s / 1e9,
            }
        )
    )


if __name__ == "__main__":
    main()
