"""Replays a token trace through SGLang's own ``UnifiedRadixCache`` ([Full, SWA] or
[Full, Mamba]) and writes the per-request log that ``hicache-bench tree --components`` writes.

Usage:
  unified_replay.py --trace T.jsonl --page-size P --capacity-pages C --log OUT.tsv
      --components full,swa --swa-window W [--swa-capacity-pages N]
    | --components full,mamba [--mamba-chunk 64] [--mamba-slots N]
    | --components full,swa,mamba (the options of both)
  [--host-capacity-pages N [--swa-host-capacity-pages NS] [--host-mamba-slots NM]]
  [--tree-core rust|python] [--time-repeats K] [--json]

The protocol, every column's definition and every rounding rule are in UNIFIED_PROTOCOL.md
next to this file. In short: each trace line is one request with max_new_tokens = 1 that
runs alone, through the same SGLang functions its scheduler calls: match
(``Req.init_next_round_input``: hit capped at L - 1, Mamba copy-on-write), admission lock
(``tree_cache.lock``), request slots (``alloc_req_slots``: Mamba slots of the extra_buffer
strategy, evicting Mamba states when short), KV (``alloc_paged_token_slots_extend``: evicts
for the extend plus one spare page), the Mamba track point
(``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``), one sampled token
(``Req.update_finish_state``) and ``release_kv_cache(checkpoint=True)``. All cache, pool and
allocator code is the installed SGLang, unchanged, on CPU tensors with tiny head sizes.

Timing (``--time-repeats``) covers the request loop only: the trace is read and every
repeat's new, empty cache and pools are built before the clock starts. ``--configs FILE
--out DIR`` replays every line of a configs.txt in one process.
"""

import argparse
import contextlib
import io
import json
import logging
import os
import statistics
import sys
import time
import types
import warnings
from array import array

import sglang_import
import sglang_stubs

# The scheduler-side modules (schedule_batch) import the OpenAI protocol and reasoning parser
# for text features; the replay uses none of them and the venv has no ``openai`` package.
sglang_stubs.install(["openai", "sglang.srt.parser.reasoning_parser"])
SGLANG_VERSION = sglang_import.load()
warnings.filterwarnings("ignore")
logging.disable(logging.CRITICAL)

import torch  # noqa: E402
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import PrefillAdder  # noqa: E402
from sglang.srt.mem_cache.allocation import (  # noqa: E402
    alloc_paged_token_slots_extend,
    alloc_req_slots,
)
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    HybridLinearKVPool,
    HybridReqToTokenPool,
    MHATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.runtime_context import get_context, get_schedule  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

import unified_hicache  # noqa: E402

unified_hicache.install_cpu_seams()

HEADER = (
    "idx\tid\tprompt\tmatched\tfull_hit\tbranch\tinserted\t"
    "ev_full\tev_aux\ttree_full\ttree_aux\tskipped"
)
# The column every log ends with: 1 when the admission budget refused the request (§3 step 2).
REFUSED_COLUMN = "\trefused"
REQ_SLOTS = 4
# The prefill token budget of one scheduling round (SGLang's default ``max_prefill_tokens``);
# it only bounds a second request of the same round, and the replay admits one per round.
MAX_PREFILL_TOKENS = 16384
DTYPE = torch.bfloat16
# The token the one decoded position samples; never part of any insert (its KV is never
# computed with max_new_tokens = 1).
SAMPLED_TOKEN = 0


def parse_args(argv=None):
    """The options of one replay (or of the batch mode)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace")
    ap.add_argument("--page-size", type=int)
    ap.add_argument("--capacity-pages", type=int)
    ap.add_argument("--components", choices=["full,swa", "full,mamba", "full,swa,mamba"])
    ap.add_argument("--swa-window", type=int)
    ap.add_argument("--swa-capacity-pages", type=int)
    ap.add_argument("--mamba-chunk", type=int, default=64)
    ap.add_argument("--mamba-slots", type=int)
    ap.add_argument("--host-capacity-pages", type=int,
                    help="SGLang's hierarchical cache with this many host Full pages")
    ap.add_argument("--swa-host-capacity-pages", type=int)
    ap.add_argument("--host-mamba-slots", type=int)
    ap.add_argument("--log")
    ap.add_argument(
        "--configs",
        help="batch mode: replay every line of this configs.txt (name, trace, options; "
        "traces relative to its directory) and write OUT/<name>.log",
    )
    ap.add_argument("--out", help="batch mode: directory of the logs")
    ap.add_argument("--tree-core", choices=["rust", "python"], default="rust")
    ap.add_argument("--time-repeats", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print a JSON summary line")
    a = ap.parse_args(argv)
    if a.configs:
        if not a.out:
            ap.error("--configs needs --out")
        return a
    for need in ("trace", "page_size", "capacity_pages", "components", "log"):
        if getattr(a, need) is None:
            ap.error(f"--{need.replace('_', '-')} is required")
    if has(a, "swa") and a.swa_window is None:
        ap.error(f"--components {a.components} needs --swa-window")
    if not has(a, "swa") and a.swa_window is not None:
        ap.error("--swa-window is for --components with swa")
    if a.mamba_slots is None:
        a.mamba_slots = a.capacity_pages
    if a.swa_capacity_pages is None:
        a.swa_capacity_pages = a.capacity_pages
    if a.host_capacity_pages is None:
        if a.swa_host_capacity_pages is not None or a.host_mamba_slots is not None:
            ap.error("--swa-host-capacity-pages and --host-mamba-slots go with "
                     "--host-capacity-pages")
    else:
        if a.swa_host_capacity_pages is None:
            a.swa_host_capacity_pages = a.host_capacity_pages
        if a.host_mamba_slots is None:
            a.host_mamba_slots = a.host_capacity_pages
    return a


def read_trace(path):
    """(id, tokens) per non-empty JSONL line, in file order."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append((str(r["id"]), array("q", r["tokens"])))
    return out


def install_server_args(a):
    """SGLang reads its scheduler settings from the published ServerArgs: the page size,
    the default Mamba strategy (extra_buffer, not lazy, overlap schedule on) and the Mamba
    cache chunk (max(model chunk, page size), as SGLang derives it)."""
    fields = {"page_size": a.page_size, "mamba_radix_cache_strategy": "extra_buffer"}
    if has(a, "mamba"):
        fields["_mamba_cache_chunk_size"] = max(a.mamba_chunk, a.page_size)
    if a.host_capacity_pages is not None:
        fields.update(unified_hicache.server_fields(a))
    return get_context().override_server_args(**fields).install()


def mamba_cache_params():
    """A tiny Mamba2 state (one layer, a few elements): the tree only moves slot ids."""
    shape = Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=4,
        n_groups=1,
        num_heads=1,
        head_dim=4,
        state_size=2,
        conv_kernel=2,
    )
    return Mamba2CacheParams(shape=shape, layers=[0])


def has(a, component):
    """Whether ``--components`` names ``component`` (``swa`` or ``mamba``)."""
    return component in a.components.split(",")


def build_cache(a, max_len):
    """A new UnifiedRadixCache over new pools of the configured capacities."""
    size = a.capacity_pages * a.page_size
    swa, mamba = has(a, "swa"), has(a, "mamba")
    if mamba:
        req_pool = HybridReqToTokenPool(
            size=REQ_SLOTS,
            mamba_size=a.mamba_slots,
            mamba_spec_state_size=REQ_SLOTS,
            max_context_len=max_len,
            device="cpu",
            enable_memory_saver=False,
            cache_params=mamba_cache_params(),
            mamba_layer_ids=[0],
            enable_mamba_extra_buffer=True,
        )
    else:
        req_pool = ReqToTokenPool(
            size=REQ_SLOTS, max_context_len=max_len, device="cpu", enable_memory_saver=False
        )
    if swa:
        kv = SWAKVPool(
            size=size,
            size_swa=a.swa_capacity_pages * a.page_size,
            page_size=a.page_size,
            dtype=DTYPE,
            head_num=1,
            head_dim=1,
            swa_attention_layer_ids=[0],
            full_attention_layer_ids=[1],
            device="cpu",
        )
        allocator = SWATokenToKVPoolAllocator(
            size,
            a.swa_capacity_pages * a.page_size,
            page_size=a.page_size,
            dtype=DTYPE,
            device="cpu",
            kvcache=kv,
            need_sort=False,
            req_to_token_pool=req_pool,
        )
    else:
        if a.host_capacity_pages is None:
            kv = MHATokenToKVPool(
                size,
                page_size=a.page_size,
                dtype=DTYPE,
                head_num=1,
                head_dim=1,
                layer_num=1,
                device="cpu",
                enable_memory_saver=False,
            )
        else:
            # SGLang's hierarchical cache takes a Mamba model's KV as the hybrid pool
            # its model runner builds (full attention beside the Mamba layer).
            kv = HybridLinearKVPool(
                size,
                dtype=DTYPE,
                page_size=a.page_size,
                head_num=1,
                head_dim=1,
                full_attention_layer_ids=[1],
                device="cpu",
                mamba_pool=req_pool.mamba_pool,
            )
        allocator = PagedTokenToKVPoolAllocator(
            size, a.page_size, DTYPE, "cpu", kv, need_sort=False
        )
    components = (ComponentType.FULL,)
    components += (ComponentType.SWA,) if swa else ()
    components += (ComponentType.MAMBA,) if mamba else ()
    window = a.swa_window if swa else None
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=a.page_size,
        enable_mamba_extra_buffer=mamba,
        chunked_prefill_size=get_schedule().chunked_prefill_size,
        sliding_window_size=window,
        tree_components=components,
        tree_core_backend=a.tree_core,
    )
    cache = UnifiedRadixCache(params)
    if a.host_capacity_pages is not None:
        unified_hicache.attach(cache, params, a)
    return cache


# The cache's entry points the scheduler path calls; their time is the "cache" time.
CACHE_CALLS = ("match_prefix", "lock", "unlock", "evict_for_alloc", "checkpoint")


class Recorder:
    """Wraps the cache's own entry points (instance attributes; the class is untouched) to
    see the match result of the scheduler's match, the sum of every eviction's result, and
    the time spent inside the cache's entry points (outermost calls only: the Mamba
    copy-on-write's eviction inside a match is not counted twice)."""

    def __init__(self, cache):
        self.match = None
        self.ev = [0, 0, 0]
        self.cache_seconds = 0.0
        self.depth = 0
        evict = cache._evict

        def _evict(*args, **kwargs):
            r = evict(*args, **kwargs)
            self.ev[0] += r.num_tokens_evicted
            self.ev[1] += r.swa_num_tokens_evicted
            self.ev[2] += r.mamba_num_evicted
            return r

        cache._evict = _evict
        for name in CACHE_CALLS:
            setattr(cache, name, self.timed(name, getattr(cache, name)))

    def timed(self, name, fn):
        """``fn`` wrapped to add its time to ``cache_seconds`` (outermost calls) and to
        keep the result of ``match_prefix``."""
        def call(*args, **kwargs):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.cache_seconds += time.perf_counter() - t0
            if name == "match_prefix":
                self.match = result
            return result

        return call

    def start(self):
        """Forget the previous request's match and eviction counts."""
        self.match = None
        self.ev = [0, 0, 0]


class Replay:
    """One replay over one new cache."""

    def __init__(self, a, max_len):
        self.a = a
        self.cache = build_cache(a, max_len)
        self.rec = Recorder(self.cache)
        self.host = None
        if a.host_capacity_pages is not None:
            self.host = unified_hicache.HostRecorder(self.cache)
        self.mamba = has(a, "mamba")
        # Both auxiliary components: SWA fills the aux columns, Mamba the three last ones.
        self.both = self.mamba and has(a, "swa")
        self.batch = types.SimpleNamespace(
            model_config=types.SimpleNamespace(
                hf_text_config=types.SimpleNamespace(mamba_chunk_size=a.mamba_chunk)
            ),
            tree_cache=self.cache,
            req_to_token_pool=self.cache.req_to_token_pool,
        )

    def tree_sizes(self):
        """(Full tokens, SWA tokens or Mamba states[, Mamba states with both]) held by the
        tree now."""
        c = self.cache
        full = c.full_evictable_size() + c.full_protected_size()
        states = c.mamba_evictable_size() + c.mamba_protected_size() if self.mamba else 0
        if self.mamba and not self.both:
            return full, states
        swa = c.swa_evictable_size() + c.swa_protected_size()
        return (full, swa, states) if self.both else (full, swa)

    def run_one(self, rid, tokens):
        """One request start to finish; returns its log fields after `prompt`."""
        cache, rec = self.cache, self.rec
        rec.start()
        sampling = SamplingParams(max_new_tokens=1)
        sampling.normalize(None)
        req = Req(rid, "", tokens, sampling)
        if self.host is not None:
            self.host.start()
        req.init_next_round_input(cache)
        m = rec.match
        branch = m.swa_branching_seqlen
        if self.mamba and not self.both:
            branch = m.mamba_branching_seqlen
        host_match = req.host_hit_length
        # SGLang's admission: budget, load-back, admission lock (§3 step 2, §10 step 1a)
        host_hit, refused = 0, 0
        if admit(cache, req, self.a.page_size):
            host_hit = req.host_loaded_length
            if self.host is not None:
                unified_hicache.complete_loads(cache)
        else:
            refused = 1
        matched = req.prefix_len
        skipped = 0
        if refused:
            out = None
            self.abort(req)
        else:
            prefix = cache.prefix_device_indices(req) if matched else None
            rows, out = self.allocate(req, prefix, matched, len(tokens))
            if out is None:
                skipped = 1
                self.abort(req)
        if out is not None:
            row = rows[0]
            kv = torch.cat([prefix, out]) if matched else out
            cache.req_to_token_pool.write((row, slice(0, len(tokens))), kv.to(torch.int32))
            req.kv.kv_allocated_len = len(tokens)
            if self.mamba:
                ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend(self.batch, req)
            # the forward: the prompt's KV is computed, one token is sampled
            req.kv.kv_committed_len = len(tokens)
            req.output_ids.append(SAMPLED_TOKEN)
            req.update_finish_state(1)
            assert req.finished(), "max_new_tokens = 1 finishes after the prefill"
            release_kv_cache(req, cache, checkpoint=True)
        if self.host is not None:
            unified_hicache.complete_writes(cache)
        inserted = cache_inserted(req, skipped or refused)
        sizes = self.tree_sizes()
        ev_aux = rec.ev[2] if self.mamba and not self.both else rec.ev[1]
        row = [matched, m.full_kv_hit_length, branch, inserted, rec.ev[0], ev_aux,
               sizes[0], sizes[1], skipped]
        if self.both:
            row += [m.mamba_branching_seqlen, rec.ev[2], sizes[2]]
        if self.host is not None:
            ev = self.host.ev
            aux_type = ComponentType.MAMBA if self.mamba else ComponentType.SWA
            if self.both:
                aux_type = ComponentType.SWA
            row += [host_hit, ev[ComponentType.FULL], ev[aux_type]]
            if self.both:
                row.append(ev[ComponentType.MAMBA])
            row.append(host_match)
        row.append(refused)
        return row

    def allocate(self, req, prefix, matched, length):
        """Steps 3 and 4 of the protocol: request slots, then the extend's KV, each through
        SGLang's own function (which evicts as the scheduler does). (None, None) when an
        allocation fails after eviction; SGLang then prints its tree to stdout and raises."""
        cache = self.cache
        last = prefix[-1:] if matched else torch.full((1,), -1, dtype=torch.int64)
        prefix_lens = torch.tensor([matched], dtype=torch.int64)
        seq_lens = torch.tensor([length], dtype=torch.int64)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                rows = alloc_req_slots(cache.req_to_token_pool, [req], cache)
                out = alloc_paged_token_slots_extend(
                    tree_cache=cache,
                    prefix_lens=prefix_lens,
                    prefix_lens_cpu=prefix_lens,
                    seq_lens=seq_lens,
                    seq_lens_cpu=seq_lens,
                    last_loc=last,
                    extend_num_tokens=length - matched,
                )
        except RuntimeError:
            return None, None
        return rows, out

    def abort(self, req):
        """A request whose request slots or KV could not be allocated after eviction
        (SGLang's own allocators raise), or that the admission budget refused (§3 step 2;
        the protocol drops it from the waiting queue): it gives back what it took, in
        SGLang's pool calls, inserts nothing and drops its admission lock."""
        pool = self.cache.req_to_token_pool
        if req.lock is None:
            # Refused by the admission budget: it holds no row and no lock, at most the
            # Mamba slot of its match's copy-on-write.
            if req.kv.holds_mamba:
                pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
                req.kv.mamba_pool_idx = None
            return
        if req.kv.holds_kv and self.mamba:
            pool.free_mamba_cache(req)
        elif req.kv.holds_mamba:
            pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
            req.kv.mamba_pool_idx = None
        if req.kv.holds_kv:
            pool.free(req)
        self.cache.unlock(req.lock)
        req.lock = None


def admit(cache, req, page_size):
    """The scheduler's admission of one matched request (UNIFIED_PROTOCOL.md §3 step 2,
    §10 step 1a), by SGLang's own ``PrefillAdder.add_one_req`` on a new adder (one
    scheduling round, no running batch, no chunked prefill): its budget check with the host
    hit counted, with a host tier the load-back (``init_load_back``) under its locks and the
    check again without the hit when nothing was loaded (the recompute fallback), and the
    admission lock (``_commit_prefill_admission``). Whether it admitted the request (a
    refused one would stay in the waiting queue)."""
    adder = PrefillAdder(
        page_size,
        cache,
        cache.token_to_kv_pool_allocator,
        None,
        1.0,
        MAX_PREFILL_TOKENS,
        None,
    )
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    return req in adder.can_run_list


def cache_inserted(req, skipped):
    """Tokens the finished insert published: the page-aligned key length the checkpoint
    inserted (``req.kv.cache_inserted_len``); 0 when the request was skipped."""
    return 0 if skipped else req.kv.cache_inserted_len


def fmt(v):
    """A log field: ``-`` for none, else the decimal integer."""
    return "-" if v is None else str(v)


def replay(a, trace, max_len):
    """One full replay: (seconds of the request loop, rows, final tree sizes, seconds of
    those spent inside the cache's entry points)."""
    r = Replay(a, max_len)
    rows = []
    t0 = time.perf_counter()
    for rid, tokens in trace:
        rows.append([rid, len(tokens)] + r.run_one(rid, tokens))
    dt = time.perf_counter() - t0
    return dt, rows, r.tree_sizes(), r.rec.cache_seconds


# The columns [Full, SWA, Mamba] adds after `skipped` (the aux columns are SWA's), and
# after the host ones.
MAMBA_COLUMNS = "\tbranch_mamba\tev_mamba\ttree_mamba"
HOST_MAMBA_COLUMN = "\tev_host_mamba"


def write_log(path, rows, final, host=False, both=False):
    """The header, one line per request and the totals line (UNIFIED_PROTOCOL.md §5); with
    both auxiliary components, the Mamba columns (§11); with a host tier, its columns and
    totals after the others (§10); `refused` last."""
    header = HEADER
    cols = ["prompt", "matched", "full_hit", "inserted", "ev_full", "ev_aux", "skipped"]
    extra = []  # (total name, row index) of the columns after `skipped`
    nxt = 11  # the row index of the next column
    if both:
        header += MAMBA_COLUMNS
        extra.append(("ev_mamba", 12))
        nxt = 14
    if host:
        header += unified_hicache.HOST_COLUMNS
        names = ["host_hit", "ev_host_full", "ev_host_aux"]
        if both:
            header += HOST_MAMBA_COLUMN
            names.append("ev_host_mamba")
        header += unified_hicache.HOST_MATCH_COLUMN
        names.append("host_match")
        extra += [(k, nxt + j) for j, k in enumerate(names)]
        nxt += len(names)
    header += REFUSED_COLUMN
    extra.append(("refused", nxt))
    tot = dict.fromkeys(cols + [k for k, _ in extra], 0)
    lines = [header]
    for i, row in enumerate(rows):
        rid, prompt, matched, full_hit, _, ins, evf, eva, _, _, sk = row[:11]
        lines.append("\t".join([str(i), rid] + [fmt(v) for v in row[1:]]))
        for k, v in zip(cols, [prompt, matched, full_hit, ins, evf, eva, sk]):
            tot[k] += v
        for k, j in extra:
            tot[k] += row[j]
    totals = (
        f"# totals requests={len(rows)} prompt={tot['prompt']} matched={tot['matched']} "
        f"full_hit={tot['full_hit']} inserted={tot['inserted']} ev_full={tot['ev_full']} "
        f"ev_aux={tot['ev_aux']} skipped={tot['skipped']} final_tree_full={final[0]} "
        f"final_tree_aux={final[1]}"
    )
    if both:
        totals += f" ev_mamba={tot['ev_mamba']} final_tree_mamba={final[2]}"
    for k, _ in extra:
        if k != "ev_mamba":
            totals += f" {k}={tot[k]}"
    lines.append(totals)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def read_configs(path):
    """(name, trace path, option list) per non-comment line of a configs.txt."""
    base = os.path.dirname(os.path.abspath(path))
    out = []
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, trace, opts = line.rstrip("\n").split("\t")
                out.append((name, os.path.join(base, trace), opts.split()))
    return out


def run_config(a):
    """One configuration: replay, write the log, time the extra repeats; a summary dict."""
    trace = read_trace(a.trace)
    max_len = max((len(t) for _, t in trace), default=1) + 2 * a.page_size + 8
    install_server_args(a)
    dt, rows, final, cache_dt = replay(a, trace, max_len)
    write_log(a.log, rows, final, host=a.host_capacity_pages is not None,
              both=has(a, "swa") and has(a, "mamba"))
    times, cache_times = [dt], [cache_dt]
    for _ in range(a.time_repeats):
        dt, _, _, cache_dt = replay(a, trace, max_len)
        times.append(dt)
        cache_times.append(cache_dt)
    probe = build_cache(a, max_len)
    return {
        "sglang": SGLANG_VERSION,
        "tree_core": type(probe.tree_core).__name__,
        "requests": len(trace),
        "req_per_s": len(trace) / statistics.median(times),
        "best_req_per_s": len(trace) / min(times),
        "cache_req_per_s": len(trace) / statistics.median(cache_times),
        "replays": len(times),
    }


def main(argv=None):
    a = parse_args(argv)
    if not a.configs:
        summary = run_config(a)
        if a.json:
            print(json.dumps(summary))
        return
    os.makedirs(a.out, exist_ok=True)
    for name, trace, opts in read_configs(a.configs):
        extra = ["--tree-core", a.tree_core, "--time-repeats", str(a.time_repeats)]
        one = parse_args(opts + ["--trace", trace, "--log", os.path.join(a.out, name + ".log")]
                         + extra)
        summary = run_config(one)
        if a.json:
            print(json.dumps({"config": name, **summary}), flush=True)


if __name__ == "__main__":
    main()
