"""vLLM's secondary KV-offloading tier: :class:`HiCacheRsTier`.

vLLM (0.33) loads it from the ``TieringOffloadingSpec``'s tier list, with no vLLM patch::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 10737418240,
        "secondary_tiers": [{"type": "HiCacheRsTier", "module_path": "hicache_rs.vllm",
                             "backend": "file", "dir": "/var/cache/kv"}]}}'

vLLM's ``SecondaryTierFactory`` imports ``module_path``, takes the class named by ``type``
and constructs it with the offloading spec, a memoryview of vLLM's CPU (primary) tier, the
tier type and every other field of the tier config as keyword arguments.

Model of the class (each point is kept by the code named in it):

1. The tier config's fields are hicache-rs' own extra-config fields, exactly as in SGLang's
   ``--hicache-storage-backend-extra-config`` (``backend``, ``dir``, ``shared``, ``nodes``,
   ...), checked by the same native parser: an unknown or bad field is a ``ValueError`` naming
   it when vLLM builds the tier. ``tenant`` (ours) salts the namespace; ``locality`` (vLLM's)
   is kept for vLLM's tier filter (``_split_config``).
2. Keys: a vLLM ``OffloadKey`` is a block hash plus a 4-byte KV-cache group index. The page
   hash is the block hash when it has 32 bytes, else its SHA-256; the namespace is built from
   the model name, KV dtype, the group's geometry (tokens per block, blocks per chunk, bytes
   per block, layers), the parallel layout (TP/PP rank and size, PCP, DCP, world size) and the
   tenant (``_namespace``), through the same ``namespace_id`` as SGLang's keys, so two models,
   dtypes, geometries or tenants on one store never read each other's blocks.
3. Zero copy: chunk ``c`` of vLLM's CPU tier is row ``c`` of ``primary_kv_view``: the native
   store reads a stored block straight into that row and writes a block straight from it (one
   piece per key, ``block_size_bytes`` long), on its own I/O threads without the GIL. The
   view's memory is registered with the store (``set_allowed_regions``), so no piece can lie
   outside vLLM's CPU tier.
4. Non-blocking: ``submit_store`` / ``submit_load`` start a native job and return; the store's
   completion queue (``Store.take_completed``) is drained by ``get_finished_jobs``;
   ``drain_jobs`` blocks on the native idle condition, never by polling sleeps.
5. Failures are misses or failed jobs, never an exception into vLLM's scheduler: a lookup that
   fails is a ``MISS``; a job the store refuses or a backend that fails is a failed
   ``JobResult`` (a partly read load names the keys read in full in ``successful_keys``);
   a block that cannot be read intact is a miss of the backend, so no wrong bytes reach vLLM;
   a block whose load failed answers ``MISS`` until it is stored again (``_unreadable``), so
   vLLM never loops promoting a block the backend lists but cannot read.
6. ``lookup`` never blocks the scheduler: it answers from vLLM's own ``AsyncLookupManager``
   (as vLLM's fs tier does), whose thread asks the backend for every key a step looked up
   (``Store.batch_exists_each``, GIL released) after ``on_schedule_end``; until then the
   answer is ``RETRY``. vLLM's scheduler walks a request's chunks in order and stops at the
   first that is not a hit, so the chunks vLLM loads are the leading run of stored blocks.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from typing import Any, ClassVar, Dict, List, Optional, Set, Tuple

import numpy

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
)

from hicache_rs._native import Store, check_extra_config, namespace_id

logger = logging.getLogger(__name__)

#: Tier-config fields that are vLLM's, not our backend's (point 1).
VLLM_FIELDS = ("locality",)

#: The native layout every vLLM chunk is stored in: one piece, the chunk's bytes.
LAYOUT = "page_first"

#: Our element types for vLLM's KV cache dtype names; any other name (``auto``, ``fp8_inc``,
#: ...) is namespaced as ``bfloat16``. The namespace also carries vLLM's own name verbatim
#: (``kv-dtype=``), so two dtypes never share blocks either way.
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
           "half": "float16", "float32": "float32", "float": "float32",
           "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn",
           "fp8_e5m2": "float8_e5m2", "float8_e5m2": "float8_e5m2"}


def _split_config(config: Dict[str, Any]) -> Tuple[str, Optional[str], Optional[str]]:
    """Point 1: ``(our extra-config as JSON, tenant, locality)``; a bad field raises a
    ``ValueError`` naming it."""
    extra = dict(config)
    locality = extra.pop("locality", None)
    tenant = extra.pop("tenant", None)
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError(f"hicache-rs tier config field `tenant` must be a string, got {tenant!r}")
    text = json.dumps(extra)
    check_extra_config(text)
    return text, tenant, locality


def _page_hash(block_hash: bytes) -> str:
    """Point 2: the 64-hex page hash of a vLLM block hash."""
    if len(block_hash) == 32:
        return block_hash.hex()
    return hashlib.sha256(block_hash).hexdigest()


def _view_region(view: memoryview) -> Tuple[numpy.ndarray, int, int]:
    """The writable bytes of vLLM's CPU tier as an array (kept alive by the tier), its
    address and length."""
    flat = numpy.frombuffer(view, dtype=numpy.uint8)
    if flat.flags.writeable is False:
        raise ValueError("primary_kv_view must be writable (vLLM's CPU tier)")
    return flat, int(flat.__array_interface__["data"][0]), int(flat.nbytes)


class _Lookups(AsyncLookupManager):
    """Point 6: vLLM's async lookup thread asking our store."""

    def __init__(self, tier: "HiCacheRsTier", tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: List[OffloadKey], req_context: ReqContext) -> List[bool]:
        """Presence of every key, asked per namespace (a failure raises: vLLM's thread
        answers every key of the batch as a miss)."""
        namespaces, hashes = self._tier._keys(keys)
        found = [False] * len(keys)
        for ns in set(namespaces):
            at = [i for i, n in enumerate(namespaces) if n == ns]
            present = self._tier._store.batch_exists_each(ns, [hashes[i] for i in at])
            for i, p in zip(at, present):
                found[i] = bool(p)
        return found


class HiCacheRsTier(SecondaryTierManager):
    """hicache-rs' L3 backends (file, uring, redis, rdma, plugin, memory) as a vLLM
    secondary tier."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, **config: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        text, self._tenant, locality = _split_config(config)
        self.locality = Locality(locality) if locality is not None else None
        self._spec_config = offloading_spec.config
        self._namespaces: Dict[int, str] = {}
        for group in range(len(self._spec_config.groups)):
            self._namespace(group)  # a bad dtype or geometry fails before anything opens
        self._flat, base, length = _view_region(primary_kv_view)
        self._base = base
        self._store = Store(text, page_bytes=self.block_size_bytes, layout=LAYOUT)
        self._store.set_allowed_regions([(base, length)])
        self.backend_name = self._store.info()["name"]
        self._jobs: Dict[int, Tuple[bool, List[OffloadKey]]] = {}
        # Point 5: blocks whose load failed answer MISS until stored again (no endless
        # promote-fail loop on a block the backend lists but cannot read).
        self._unreadable: Set[OffloadKey] = set()
        self._refused: List[JobResult] = []
        self._refusals = 0
        self._closed = False
        self._lookups = _Lookups(self, tier_type)

    # ---- keys (point 2) ---------------------------------------------------------------

    def _namespace(self, group: int) -> str:
        ns = self._namespaces.get(group)
        if ns is not None:
            return ns
        cfg = self._spec_config
        if not 0 <= group < len(cfg.groups):
            raise ValueError(f"KV cache group {group} is not one of the {len(cfg.groups)} groups")
        g = cfg.groups[group]
        par = cfg.parallel
        raw_dtype = str(cfg.model.dtype)
        plain = raw_dtype.removeprefix("torch.")
        layers = hashlib.sha256("\0".join(g.layer_names).encode()).hexdigest()[:16]
        shape = [
            "vllm", f"group{g.group_id}", f"kv-dtype={raw_dtype}",
            f"tokens-per-hash={cfg.cache.tokens_per_hash}", f"chunk-bytes={self.block_size_bytes}",
            f"world={par.world_size}", f"pcp={par.pcp_size}", f"dcp={par.dcp_size}",
            f"layers={layers}", f"canonical={cfg.canonical_layout}:{cfg.kv_cache_layout}",
            f"replicated={cfg.replicated_layout}",
        ]
        tp_size, pp_size = max(par.tp_size, 1), max(par.pp_size, 1)
        ns = namespace_id(
            cfg.model.name,
            _DTYPES.get(plain, "bfloat16"),
            LAYOUT,
            False,
            1,
            max(int(cfg.worker_kv_bytes_per_block), 1),
            max(len(g.layer_names), 1),
            int(g.tokens_per_block) * int(cfg.cache.blocks_per_chunk),
            tp_rank=par.rank % tp_size,
            tp_size=tp_size,
            pp_rank=(par.rank // tp_size) % pp_size,
            pp_size=pp_size,
            extra_key="|".join(shape),
            cache_salt=self._tenant,
        )
        self._namespaces[group] = ns
        return ns

    def _keys(self, keys: Iterable[OffloadKey]) -> Tuple[List[str], List[str]]:
        namespaces, hashes = [], []
        for key in keys:
            namespaces.append(self._namespace(get_offload_group_idx(key)))
            hashes.append(_page_hash(get_offload_block_hash(key)))
        return namespaces, hashes

    # ---- vLLM's interface ---------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Point 6: RETRY until the backend answered, then HIT when it has the chunk, MISS
        otherwise or on any failure (point 5)."""
        if self._closed or key in self._unreadable:
            return LookupResult.MISS
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Hands this step's lookups to the lookup thread (point 6)."""
        self._lookups.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Drops the request's lookup state."""
        self._lookups.cleanup(req_context.req_id)

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Starts a native store of the job's chunks from vLLM's CPU tier (point 4)."""
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Starts a native load of the job's chunks into vLLM's CPU tier (point 4)."""
        self._submit(job_metadata, load=True)

    def _submit(self, job: TransferJob, load: bool) -> None:
        keys = list(job.keys)
        self._jobs[job.job_id] = (load, keys)
        size = self.block_size_bytes
        try:
            if len(keys) != len(job.chunk_ids):
                raise ValueError(f"{len(keys)} keys for {len(job.chunk_ids)} chunks")
            namespaces, hashes = self._keys(keys)
            ptrs = [self._base + int(c) * size for c in job.chunk_ids]
            self._store.submit_job(job.job_id, load, namespaces, hashes, ptrs, [size] * len(keys))
        except Exception as e:  # point 5: a refused job is a failed job
            # Logged at the 1st, 2nd, 4th, 8th, ... refusal: a stalled backend that refuses
            # every job (its queue full) writes log2(jobs) lines, not one per job.
            self._refusals += 1
            if self._refusals & (self._refusals - 1) == 0:
                logger.warning("hicache-rs %s job %s refused (%d refusals so far): %s",
                               "load" if load else "store", job.job_id, self._refusals, e)
            if load:
                self._unreadable.update(keys)
            self._refused.append(JobResult(job_id=job.job_id, success=False))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs finished since the last call, from the native completion queue."""
        results, self._refused = self._refused, []
        for r in results:
            self._jobs.pop(r.job_id, None)
        for job_id, ok, seconds, error in self._store.take_completed():
            load, keys = self._jobs.pop(job_id, (False, []))
            if error is not None:
                logger.warning("hicache-rs job %s failed: %s", job_id, error)
            success = error is None and all(ok)
            read = tuple(k for k, o in zip(keys, ok) if o)
            if load:
                failed = [k for k, o in zip(keys, ok) if not o]
                self._unreadable.update(failed)
                self._lookups.mark_miss(failed)
            else:
                self._unreadable.difference_update(read)
            done = len(read)
            results.append(JobResult(
                job_id=job_id,
                success=success,
                successful_keys=None if success or not read else read,
                transfer_time=seconds,
                transfer_bytes=done * self.block_size_bytes,
            ))
        return results

    def has_pending_work(self) -> bool:
        """Whether a job is in flight or finished and not yet collected."""
        return bool(self._jobs)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Chunk-level offloading (vLLM's default): no per-request state."""
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Blocks until every submitted job finished (point 4)."""
        if not self._closed:
            self._store.wait_idle()

    def shutdown(self) -> None:
        """Waits for the jobs in flight, then closes the backend."""
        if not self._closed:
            self._closed = True
            self._lookups.shutdown()
            self._store.close()
            # vLLM releases the CPU tier's memoryview after the tiers: no export may remain.
            self._flat = None

    def backend_stats(self) -> dict:
        """The backend's counters (pages, bytes, hits, misses, corrupt pages, ...)."""
        return self._store.stats()

    def namespace_of(self, group: int = 0) -> str:
        """The 32-hex namespace of KV cache group ``group`` (tools, tests)."""
        return self._namespace(group)


__all__ = ["HiCacheRsTier"]
