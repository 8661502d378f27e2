"""Store / load GB/s of hicache_rs.vllm.HiCacheRsTier through vLLM's secondary-tier interface,
next to two references measured in the same run:

- vLLM's own ``fs`` tier (``FileSystemTierManager``) on the same CPU blocks and the same disk:
  the same ``TransferJob`` batches submitted through the same interface;
- the same hicache-rs backend driven from Rust (``hicache-bench storage`` with the same page
  size, batch and total, run before and after the vLLM rounds, best of each phase; its own
  reference is raw O_DIRECT I/O of the disk).

Both tiers are built by vLLM's ``TieringOffloadingSpec`` / ``SecondaryTierFactory`` over one
CPU tier (vLLM's shared-memory region), filled with random bytes. Writes are durable on both
sides: our file backend fsyncs each batch (its default ``"fsync": "batch"``); vLLM's fs tier
writes with O_DIRECT and renames without fsync, so its write phase ends with one ``os.sync()``
(counted in its time; ours gets the same call). Reads are cold: the page cache is dropped
(``sync; echo 3 > /proc/sys/vm/drop_caches``) before every read phase, or the bench says it
could not. Every byte read back is compared with what was written.

Usage (with target/python-vllm on PYTHONPATH, see setup-vllm-env.sh, and a release wheel)::

    python bench_vllm.py --dir /mnt/nvme/bench --rust-bench target/release/hicache-bench
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import uuid

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "tests"))

from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from vllm_harness import OURS, keys, offloading_config  # noqa: E402

MiB = 1 << 20


def drop_caches() -> bool:
    """Drops the page cache; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class Side:
    """One secondary tier under test and its job counter."""

    def __init__(self, name, tier):
        self.name, self.tier, self.next_id = name, tier, 0

    def phase(self, load, ks, batch):
        """Submits ``ks`` (chunk ``i`` for key ``i``) in jobs of ``batch`` chunks through
        vLLM's interface, waits for all of them (``drain_jobs``), and returns seconds."""
        req = ReqContext(req_id="bench")
        start = time.perf_counter()
        for i in range(0, len(ks), batch):
            job = TransferJob(job_id=self.next_id, keys=ks[i:i + batch],
                              chunk_ids=numpy.arange(i, min(i + batch, len(ks)), dtype=numpy.int64),
                              is_promotion=load, req_context=req)
            self.next_id += 1
            (self.tier.submit_load if load else self.tier.submit_store)(job)
        self.tier.drain_jobs()
        if not load:
            os.sync()
        seconds = time.perf_counter() - start
        failed = [r.job_id for r in self.tier.get_finished_jobs() if not r.success]
        if failed:
            raise SystemExit(f"{self.name}: {len(failed)} jobs failed")
        return seconds


def rust_reference(exe, directory, chunk, batch, total, rounds):
    """``hicache-bench storage`` on the same backend: {phase: (GB/s, raw reference GB/s)}."""
    cmd = [exe, "storage", "--backend", "file", "--dir", str(directory), "--page-bytes",
           str(chunk), "--batch", str(batch), "--total", str(total), "--rounds", str(rounds),
           "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    figures = {}
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        for phase in ("write", "read"):
            if f"/{phase}/" in r.get("case", "") and r.get("unit") == "GB/s":
                figures[phase] = (r["value"], r.get("reference"))
    return figures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk under test")
    ap.add_argument("--chunk-mib", type=int, default=2, help="bytes per vLLM chunk, in MiB")
    ap.add_argument("--total-mib", type=int, default=1024, help="bytes per phase, in MiB")
    ap.add_argument("--batch", type=int, default=32, help="chunks per job")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each figure is the best")
    ap.add_argument("--rust-bench", help="hicache-bench binary for the Rust reference")
    args = ap.parse_args()

    chunk, n = args.chunk_mib * MiB, args.total_mib // args.chunk_mib
    root = pathlib.Path(args.dir) / f"bench-vllm-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    tiers = [{**OURS, "backend": "file", "dir": str(root / "ours")},
             {"type": "fs", "root_dir": str(root / "fs"), "n_read_threads": 16,
              "n_write_threads": 16}]
    spec = TieringOffloadingSpec(offloading_config(tiers, chunks=n, block_bytes=chunk))
    mgr = spec.get_manager()
    view = mgr.primary_tier.get_kv_memoryview()
    rows = numpy.frombuffer(view, dtype=numpy.uint8).reshape(view.shape)
    rows[:] = numpy.random.default_rng(1).integers(0, 256, size=rows.shape, dtype=numpy.uint8)
    want = rows.copy()
    sides = [Side("hicache-rs (file)", mgr.secondary_tiers[0]),
             Side("vLLM fs tier", mgr.secondary_tiers[1])]
    best = {(s.name, p): 0.0 for s in sides for p in ("store", "load")}
    cold = True
    rust = {}

    def run_rust(tag):
        # Before and after the vLLM rounds (a shared disk drifts): the best of each phase.
        if args.rust_bench:
            got = rust_reference(args.rust_bench, root / f"rust-{tag}", chunk, args.batch,
                                 chunk * n, args.rounds)
            for phase, fig in got.items():
                if phase not in rust or fig[0] > rust[phase][0]:
                    rust[phase] = fig

    try:
        run_rust("before")
        for r in range(args.rounds):
            ks = keys(f"bench-{r}-{uuid.uuid4().hex}", n)
            order = sides if r % 2 == 0 else sides[::-1]
            for s in order:
                gbps = chunk * n / s.phase(False, ks, args.batch) / 1e9
                best[(s.name, "store")] = max(best[(s.name, "store")], gbps)
            for s in order:
                rows[:] = 0
                cold = drop_caches() and cold
                gbps = chunk * n / s.phase(True, ks, args.batch) / 1e9
                if not numpy.array_equal(rows, want):
                    raise SystemExit(f"{s.name}: bytes read back differ")
                best[(s.name, "load")] = max(best[(s.name, "load")], gbps)
                rows[:] = want
        run_rust("after")
    finally:
        rows = None
        mgr.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    print(f"chunk {args.chunk_mib} MiB, {n} chunks ({args.total_mib} MiB) per phase, "
          f"{args.batch} chunks per job, best of {args.rounds}; "
          f"reads {'cold (page cache dropped)' if cold else 'NOT cold (drop_caches refused)'}")
    ours, fs = sides[0].name, sides[1].name
    for p, rp in (("store", "write"), ("load", "read")):
        o, f = best[(ours, p)], best[(fs, p)]
        line = f"{p:5}: {ours} {o:6.2f} GB/s | {fs} {f:6.2f} GB/s (x{o / f:.2f})"
        if rp in rust:
            v, raw = rust[rp]
            line += f" | Rust hicache-bench {v:6.2f} GB/s (ratio {o / v:.2f}"
            line += f"; raw disk {raw:.2f} GB/s)" if raw else ")"
        print(line)


if __name__ == "__main__":
    main()
