"""hicache_rs.vllm.HiCacheRsTier driven by vLLM's own tiering code (vLLM 0.33 from PyPI, CPU
only): vLLM's SecondaryTierFactory builds it from a tier config, vLLM's
TieringOffloadingManager stores blocks through it, evicts them from its CPU tier and finds
them again in ours, and loads them back byte for byte; the same sequence against vLLM's own
fs tier gives the same answers. See vllm_harness.py for the one vLLM piece not constructed
(the GPU worker) and why."""

import os
import pathlib
import signal

import pytest

from conftest import require_vllm, start_redis

require_vllm()

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402

import vllm_harness as H  # noqa: E402
from backend_configs import BACKENDS, ours_config  # noqa: E402
from hicache_rs.vllm import HiCacheRsTier  # noqa: E402


@pytest.fixture
def engines():
    made = []

    def make(tier_config, **kw):
        e = H.Engine(tier_config, **kw)
        made.append(e)
        return e

    yield make
    for e in reversed(made):
        e.close()


def ours(extra):
    return {**H.OURS, **extra}


def test_vllms_factory_loads_our_tier(engines):
    cls = SecondaryTierFactory.get_tier_class(ours({"backend": "memory"}))
    assert cls is HiCacheRsTier
    e = engines(ours({"backend": "memory"}))
    assert isinstance(e.tier, HiCacheRsTier)
    assert e.tier.tier_type == "HiCacheRsTier"
    assert e.tier.backend_name == "memory"
    assert e.tier.block_size_bytes == e.block


def _round_trip(e):
    """Store 4 blocks, evict them from vLLM's CPU tier, find the leading run again in ours
    and load it back: (hits in the CPU tier, hits after eviction, bytes back ok)."""
    ks = H.keys("round-trip", 4)
    e.store(ks)
    n_cpu, req = e.hit_run(ks)
    e.load(ks[:n_cpu], req)
    e.evict_all()
    for k in ks:
        assert e.mgr.primary_tier.lookup(k, e.request()) is LookupResult.MISS, "not evicted"
    unknown = H.keys("never-stored", 2)
    n_l3, req = e.hit_run(ks + unknown)
    got = e.load(ks[:n_l3], req)
    same = [g == H.payload(k, e.block) for g, k in zip(got, ks)]
    return n_cpu, n_l3, same


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_evict_lookup_load_on_every_backend(backend, request, tmp_path, engines):
    e = engines(ours(ours_config(backend, request, tmp_path)))
    n_cpu, n_l3, same = _round_trip(e)
    assert (n_cpu, n_l3) == (4, 4)
    assert same == [True] * 4
    assert not e.mgr.has_pending_work()


def test_same_answers_as_vllms_own_fs_tier(tmp_path, engines):
    fs = engines({"type": "fs", "root_dir": str(tmp_path / "fs"), "n_read_threads": 2,
                  "n_write_threads": 2})
    us = engines(ours({"backend": "file", "dir": str(tmp_path / "ours")}))
    assert _round_trip(fs) == _round_trip(us) == (4, 4, [True] * 4)
    # A gap: only blocks 0, 1 and 3 stored: both answer the leading run 2.
    answers = []
    for e in (fs, us):
        ks = H.keys("gap", 4)
        e.store(ks[:2] + ks[3:])
        e.evict_all()
        answers.append(e.hit_run(ks)[0])
    assert answers == [2, 2]


def test_a_redis_server_killed_mid_use_gives_misses_and_failed_stores(tmp_path, engines):
    proc, addr = start_redis(tmp_path)
    try:
        e = engines(ours({"backend": "redis", "nodes": [addr], "cluster": False,
                          "key_prefix": "kill:", "timeout_ms": 1000}))
        ks = H.keys("redis-kill", 3)
        e.store(ks)
        e.evict_all()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    # Lookups after the server died: misses, never an exception into vLLM's scheduler.
    assert e.hit_run(ks)[0] == 0
    # A store whose cascade fails: vLLM hears of a failed job and releases its CPU blocks.
    failed = []
    orig = e.tier.get_finished_jobs

    def spy():
        out = list(orig())
        failed.extend(r.job_id for r in out if not r.success)
        return out

    e.tier.get_finished_jobs = spy
    e.store(H.keys("after-kill", 2))
    assert failed, "the store to a dead server was not reported as failed"
    assert not e.mgr.has_pending_work()


@pytest.mark.parametrize("extra, field", [
    ({"backend": "file"}, "dir"),
    ({"backend": "memory", "bogus_field": 1}, "bogus_field"),
    ({"backend": "no-such-backend"}, "no-such-backend"),
    ({"backend": "memory", "tenant": 7}, "tenant"),
])
def test_a_bad_tier_config_is_an_error_naming_the_field(extra, field, tmp_path):
    with pytest.raises(ValueError, match=field):
        H.Engine(ours(extra))


def test_two_models_on_one_store_never_see_each_others_blocks(tmp_path, engines):
    shared = {"backend": "file", "dir": str(tmp_path / "shared"), "shared": True}
    a = engines(ours(shared), model="org/model-a")
    b = engines(ours(shared), model="org/model-b")
    a2 = engines(ours(shared), model="org/model-a")
    salted = engines(ours({**shared, "tenant": "t2"}), model="org/model-a")
    half = engines(ours(shared), model="org/model-a", dtype="float16")
    # A vLLM dtype name hicache-rs has no element type for: its own namespace all the same.
    inc = engines(ours(shared), model="org/model-a", dtype="fp8_inc")
    ks = H.keys("models", 3)
    a.store(ks)
    for other in (b, salted, half, inc):
        assert other.hit_run(ks)[0] == 0
    n, req = a2.hit_run(ks)
    assert n == 3
    assert a2.load(ks, req) == [H.payload(k, a2.block) for k in ks]
    assert len({x.tier.namespace_of(0) for x in (a, b, salted, half, inc)}) == 5


def test_a_corrupt_block_is_a_miss_not_wrong_bytes(tmp_path, engines):
    d = tmp_path / "ours"
    e = engines(ours({"backend": "file", "dir": str(d)}))
    ks = H.keys("corrupt", 2)
    e.store(ks)
    e.evict_all()
    want = H.payload(ks[0], e.block)
    hit = 0
    for f in pathlib.Path(d).rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            at = data.find(want[:64])
            if at >= 0:
                f.write_bytes(data[:at] + bytes(64) + data[at + 64:])
                hit += 1
    assert hit == 1, "the stored block was not found on disk"
    n, req = e.hit_run(ks)
    assert n == 0
    e.mgr.on_request_finished(req)
    e.settle()
    assert not e.mgr.has_pending_work()


def test_jobs_complete_through_the_native_queue_without_the_gil(tmp_path, engines):
    e = engines(ours({"backend": "memory"}))
    store = e.tier._store
    ks = H.keys("queue", 4)
    e.store(ks)
    assert store.jobs_in_flight == 0
    assert store.take_completed() == []
    with pytest.raises(ValueError, match="registered"):
        store.submit_job(99, True, [e.tier.namespace_of(0)], ["ab" * 32], [8], [e.block])


# ---- issue 38 item 5: a stalled or slow backend costs failed jobs, never threads or a stall --


def _threads():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _store_job(e, i, key):
    import numpy
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.base import ReqContext

    return TransferJob(job_id=i, keys=[key], chunk_ids=numpy.array([i % 8]), is_promotion=False,
                       req_context=ReqContext(req_id=f"flood-{i}"))


def test_a_stalled_backend_turns_a_job_flood_into_failed_jobs(tmp_path, engines):
    """Before: 3000 jobs against a stalled Redis took ~512 threads and shutdown waited for the
    backend's timeout. Now every submit returns at once; the jobs beyond the native queue are
    failed JobResults in the next get_finished_jobs; threads stay a fixed set; shutdown ends
    after the store's close grace (the stalled jobs are cancelled: failed results)."""
    import threading

    from hicache_rs import _native

    proc, addr = start_redis(tmp_path)
    try:
        before = _threads()
        e = engines(ours({"backend": "redis", "nodes": [addr], "cluster": False,
                          "timeout_ms": 3600000}))
        os.kill(proc.pid, signal.SIGSTOP)
        ks = H.keys("flood", 3000)
        for i, k in enumerate(ks):
            e.tier.submit_store(_store_job(e, i, k))
        grown = _threads() - before
        assert grown <= 2 + 16 + _native.JOB_WORKERS + 8, grown
        failed = [r for r in e.tier.get_finished_jobs() if not r.success]
        assert len(failed) >= 3000 - _native.JOB_QUEUE_CAPACITY - _native.JOB_WORKERS
        closer = threading.Thread(target=e.tier.shutdown)
        closer.start()
        closer.join(120)  # bounded: the close grace, not the 1 h timeout
        assert not closer.is_alive(), "shutdown did not return against a stalled backend"
        rest = list(e.tier.get_finished_jobs())
        assert len(failed) + len(rest) == 3000 and not any(r.success for r in rest)
        assert not e.tier.has_pending_work()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)


def test_twenty_thousand_jobs_on_the_file_backend_keep_a_fixed_thread_count(tmp_path, engines):
    """Before: 20k jobs through the tier on the file backend reached 518 threads. Now the
    thread count stays within the store's fixed set; every job is answered (stored, or failed
    when the queue was full), none lost."""
    from hicache_rs import _native

    before = _threads()
    e = engines(ours({"backend": "file", "dir": str(tmp_path / "ours")}))
    ks = H.keys("twenty-k", 20_000)
    most, answered, ok = 0, 0, 0
    for i, k in enumerate(ks):
        e.tier.submit_store(_store_job(e, i, k))
        if i % 1000 == 999:
            most = max(most, _threads() - before)
            e.tier.drain_jobs()
            for r in e.tier.get_finished_jobs():
                answered += 1
                ok += r.success
    e.tier.drain_jobs()
    for r in e.tier.get_finished_jobs():
        answered += 1
        ok += r.success
    assert most <= 2 + 16 + _native.JOB_WORKERS + 8, most
    assert answered == 20_000 and ok >= 20 * (_native.JOB_QUEUE_CAPACITY // 2)
    assert not e.tier.has_pending_work()
