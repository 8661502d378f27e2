"""vLLM's own tiering stack on CPU, driven as its scheduler-side connector drives it.

``Engine`` builds vLLM's ``TieringOffloadingSpec`` from an ``OffloadingConfig`` and takes its
``TieringOffloadingManager`` (vLLM's CPU primary tier on its shared-memory region, plus one
secondary tier built by vLLM's ``SecondaryTierFactory`` from a tier config). The one piece of
vLLM not constructed is its GPU worker (``TieringOffloadingSpec.get_worker`` raises without a
CUDA-alike platform): it copies blocks between GPU memory and the CPU tier's rows, so here the
test writes a block's bytes into its CPU row after ``prepare_store`` and reads them after
``prepare_load``, exactly where that worker would.

A scheduler step is ``step()``: wait for the secondary tier's jobs (``drain_jobs``, vLLM's own
method; a blocking wait, no sleep), then ``on_schedule_end``, which collects finished jobs and
submits the promotions that lookups queued."""

from __future__ import annotations

import hashlib
import uuid

import numpy
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

#: The tier config naming our class (the rest are our extra-config fields).
OURS = {"type": "HiCacheRsTier", "module_path": "hicache_rs.vllm"}


def offloading_config(tiers, model="m", chunks=8, block_bytes=4096, dtype="bfloat16",
                      tokens=16):
    """vLLM's normalized offloading config for one full-attention group on one worker."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=tokens, layer_names=("l0", "l1"),
                                      group_id=0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": chunks * block_bytes, "secondary_tiers": tiers,
                      "tier_poll_interval_s": 0},
        engine_id="hicache-test-" + uuid.uuid4().hex[:12],
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
    )


def keys(tag, n, start=0):
    """``n`` vLLM offload keys (32-byte block hashes, group 0), distinct per ``tag``."""
    return [make_offload_key(hashlib.sha256(f"{tag}|{i}".encode()).digest(), 0)
            for i in range(start, start + n)]


def payload(key, nbytes):
    """The deterministic bytes of a block: a SHAKE-256 stream of its key."""
    return hashlib.shake_256(bytes(key)).digest(nbytes)


class Engine:
    """vLLM's tiering manager with one secondary tier (see the module doc)."""

    def __init__(self, tier_config, **kw):
        self.spec = TieringOffloadingSpec(offloading_config([dict(tier_config)], **kw))
        self.mgr = self.spec.get_manager()
        self.tier = self.mgr.secondary_tiers[0]
        view = self.mgr.primary_tier.get_kv_memoryview()
        self.rows = numpy.frombuffer(view, dtype=numpy.uint8).reshape(view.shape)
        self.block = view.strides[0]
        self._n = 0

    def request(self):
        self._n += 1
        req = ReqContext(req_id=f"req-{self._n}")
        self.mgr.on_new_request(req)
        return req

    def step(self):
        self.tier.drain_jobs()
        self.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self):
        """Steps until no job is left (bounded)."""
        for _ in range(8):
            self.step()
            if not self.mgr.has_pending_work():
                return
        raise AssertionError("jobs still pending after 8 steps")

    def store(self, ks):
        """One request storing blocks ``ks`` (GPU → CPU by the test, then vLLM's cascade to
        the secondary tier); returns once the cascade's jobs were collected."""
        req = self.request()
        out = self.mgr.prepare_store(ks, req)
        assert out is not None, "vLLM's CPU tier refused the store"
        for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.rows[int(c)][:] = numpy.frombuffer(payload(k, self.block), dtype=numpy.uint8)
        self.mgr.complete_store(out.keys_to_store, req)
        self.mgr.on_request_finished(req)
        self.settle()

    def evict_all(self, tag="filler"):
        """Fills vLLM's CPU tier with other blocks, so every earlier block is evicted from it,
        then scribbles over every row (a later hit's bytes can only come from the tier)."""
        n = self.rows.shape[0]
        self.store(keys(f"{tag}-{uuid.uuid4().hex}", n))
        self.rows[:] = 0xEE

    def _wait_async_lookups(self):
        """vLLM's fs tier and ours answer lookups from vLLM's AsyncLookupManager thread:
        block until its next result batch is posted (a blocking queue read, bounded), and put
        it back."""
        lm = getattr(self.tier, "_lookup_manager", None) or getattr(self.tier, "_lookups", None)
        if lm is not None:
            lm._pending_results.put(lm._pending_results.get(timeout=30))

    def lookup(self, key, req):
        """vLLM's answer for ``key`` once settled: HIT (in the CPU tier, promoted there if
        needed) or MISS."""
        for _ in range(6):
            r = self.mgr.lookup(key, req)
            if r in (LookupResult.HIT, LookupResult.MISS):
                return r
            self.step()
            if r is LookupResult.RETRY:
                self._wait_async_lookups()
        raise AssertionError(f"lookup did not settle: {r}")

    def hit_run(self, ks):
        """How many leading blocks of ``ks`` vLLM finds (its scheduler stops at the first
        miss), and a request holding them for ``load``."""
        req = self.request()
        n = 0
        for k in ks:
            if self.lookup(k, req) is not LookupResult.HIT:
                break
            n += 1
        return n, req

    def load(self, ks, req):
        """The bytes of blocks ``ks`` as vLLM's GPU worker would read them from the CPU tier."""
        spec = self.mgr.prepare_load(ks, req)
        out = [self.rows[int(c)].tobytes() for c in spec.chunk_ids]
        self.mgr.complete_load(ks, req)
        self.mgr.on_request_finished(req)
        self.settle()
        return out

    def close(self):
        self.rows = None  # vLLM releases the CPU tier's memoryview: no export may remain
        self.mgr.shutdown()
