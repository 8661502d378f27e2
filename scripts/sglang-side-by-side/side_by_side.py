"""Runs both sides of each comparison and prints them with their ratio (see README.md).

Called by run.sh with the hicache-bench binary and a Python that has SGLang; standard library
only. Writes every figure as JSON lines to WORK/results.jsonl as well.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout


def json_lines(text):
    return [json.loads(l) for l in text.splitlines() if l.startswith("{")]


def byte_size(s):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def radix(a, out):
    trace = os.path.join(a.work, "trace.jsonl")
    run([a.bench, "tree", "--write-trace", trace, "--capacity-pages", "unlimited",
         "--min-time-ms", "1", "--json"])
    for cap in ("unlimited", "25%"):
        log = os.path.join(a.work, "tree.log.tsv")
        ours = json_lines(run([a.bench, "tree", "--trace", trace, "--page-size", "64",
                               "--capacity-pages", cap, "--log", log, "--json",
                               "--min-time-ms", str(int(a.min_time * 1000))]))[0]
        pages = ours["capacity_pages"]
        pages = "unlimited" if pages is None else str(pages)
        theirs = json.loads(run([a.python, os.path.join(HERE, "radix_replay.py"), trace, "64",
                                 pages, log, "--min-time", str(a.min_time)],
                                cwd=HERE).splitlines()[-1])
        ratio = ours["value"] / theirs["req_per_s"]
        same = theirs["mismatches"] == 0 and theirs["hit_tokens"] == ours["hit_tokens"]
        print(f"tree replay, page 64, LRU, capacity {pages} pages: hicache-rs "
              f"{ours['value']:,.0f} req/s, SGLang {theirs['sglang']} RadixCache "
              f"{theirs['req_per_s']:,.0f} req/s, ratio {ratio:,.0f}; per-request hits "
              f"{'equal' if same else 'DIFFER'} ({theirs['requests']} requests, "
              f"{ours['hit_tokens']} hit tokens)")
        out.append({"case": f"radix/{pages}", "hicache_req_per_s": ours["value"],
                    "hicache_best_req_per_s": ours["best_req_per_s"],
                    "sglang_req_per_s": theirs["req_per_s"],
                    "sglang_best_req_per_s": theirs["best_req_per_s"], "ratio": ratio,
                    "requests": theirs["requests"], "hit_tokens": ours["hit_tokens"],
                    "hits_equal": same, "sglang_mismatches": theirs["mismatches"]})
        if not same:
            sys.exit(f"per-request hits differ: {theirs}")


def files(a, out):
    total = byte_size(a.total)
    for page in (8 << 20, 256 << 10):
        pages = max(1, total // page)
        d = os.path.join(a.work, "l3")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(os.path.join(d, "ours"))
        recs = json_lines(run([a.bench, "storage", "--backend", "file", "--dir",
                               os.path.join(d, "ours"), "--page-bytes", str(page),
                               "--batch", "128", "--total", str(pages * page),
                               "--rounds", "1", "--json"]))
        ours = {r["case"].split("/")[1]: r for r in recs if r["case"].startswith("file/")}
        theirs = json.loads(run([a.python, os.path.join(HERE, "hicache_file.py"),
                                 os.path.join(d, "sglang"), str(page), str(pages),
                                 "--batch", "128"], cwd=HERE).splitlines()[-1])
        shutil.rmtree(d, ignore_errors=True)
        label = f"{page >> 20}MiB" if page >= 1 << 20 else f"{page >> 10}KiB"
        w, r = ours["write"]["value"], ours["read"]["value"]
        print(f"file L3, {label} pages x {pages}: write hicache-rs {w:.2f} GB/s (durable, "
              f"fsync per batch) vs SGLang HiCacheFile {theirs['write_durable']:.2f} GB/s "
              f"durable (x{w / theirs['write_durable']:.2f}), {theirs['write']:.2f} GB/s "
              f"unsynced (x{w / theirs['write']:.2f}); read (cold) hicache-rs {r:.2f} GB/s "
              f"vs SGLang {theirs['read']:.2f} GB/s (x{r / theirs['read']:.2f}); raw "
              f"O_DIRECT reference {ours['write'].get('reference', 0):.2f} / "
              f"{ours['read'].get('reference', 0):.2f} GB/s")
        out.append({"case": f"file/{label}", "pages": pages, "hicache_write": w,
                    "hicache_read": r, "sglang_write_durable": theirs["write_durable"],
                    "sglang_write_unsynced": theirs["write"], "sglang_read": theirs["read"],
                    "write_ratio_durable": w / theirs["write_durable"],
                    "read_ratio": r / theirs["read"],
                    "raw_write": ours["write"].get("reference"),
                    "raw_read": ours["read"].get("reference")})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--total", default="1GiB")
    ap.add_argument("--min-time", type=float, default=3.0)
    ap.add_argument("--only", choices=["radix", "file"])
    a = ap.parse_args()
    print(f"side by side on {platform.node()} ({os.cpu_count()} cores), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
          f"{os.getloadavg()[0]:.1f}")
    out = []
    if a.only in (None, "radix"):
        radix(a, out)
    if a.only in (None, "file"):
        files(a, out)
    with open(os.path.join(a.work, "results.jsonl"), "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
