"""Hostile input against the native store (issue 38, round 3 of hardening): what a caller can
make one call, one job flood or one registration cost, and that each cost is bounded. Each test
failed on the code before the fix it names.

- batch_get_bytes zero-filled keys × length bytes before any lookup (item 4);
- every submit_job took a blocking-pool thread, up to ~512, and close waited for the backend's
  own timeouts (item 5);
- memory sizes were checked against the machine, not the process's limits (item 9);
- any (address, length) was accepted as a region, so one huge region disabled the fence."""

import ctypes
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

import hicache_rs
from hicache_rs import _native
from conftest import start_redis

NS = hicache_rs.namespace_id("m", "bfloat16", "page_first", False, 8, 128, 32, 64)
GIB = 1 << 30


def keys(n, start=0):
    return hicache_rs.sglang_page_hashes(list(range(start, start + n * 4)), 4)


def threads():
    """This process's thread count (the kernel's, every OS thread)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads line in /proc/self/status")


def vm_size():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize line in /proc/self/status")


def run_child(code, env_extra=None):
    """Runs ``code`` in a fresh interpreter (limits set there stay there); its stdout."""
    env = dict(os.environ, **(env_extra or {}))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


# ---- item 4: batch_get_bytes allocates only for what exists, bounded per call --------------


def test_absent_pages_cost_no_memory_and_a_call_is_bounded():
    """Before: one absent key of 1 GiB zero-filled 1 GiB first (two keys, 2 GiB), so under an
    address-space limit 768 MiB above what the process has mapped the call was a MemoryError
    (and under overcommit an OOM kill). Now the absent page costs nothing, and a call asking
    for more than MAX_CALL_BYTES is a ValueError naming the bound before anything is
    allocated."""
    out = run_child(f"""
        import resource
        import hicache_rs
        ns, (k0, k1) = {NS!r}, hicache_rs.sglang_page_hashes(list(range(8)), 4)
        s = hicache_rs.Store('{{"backend": "memory"}}')
        s.set_bytes(ns, k1, "page_first", b"\\x07" * 4096)
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (768 << 20), resource.RLIM_INFINITY))
        print(s.get_bytes(ns, k0, "page_first", 1 << 30))
        print(s.batch_get_bytes(ns, [k0], "page_first", 1 << 30))
        try:
            s.batch_get_bytes(ns, [k0, k1], "page_first", 1 << 30)
        except ValueError as e:
            print("ValueError", e)
        got = s.batch_get_bytes(ns, [k0, k1, k0], "page_first", 4096)
        print([None if g is None else len(g) for g in got])
        s.close()
    """)
    lines = out.splitlines()
    assert lines[0] == "None" and lines[1] == "[None]", out
    assert lines[2].startswith("ValueError batch_get_bytes: 2 pages of 1073741824 bytes"), out
    assert f"the {hicache_rs._native.MAX_CALL_BYTES} bytes one call may read" in lines[2], out
    assert lines[3] == "[None, 4096, None]", out


# ---- item 5: jobs on a fixed set of workers, a bounded queue, a bounded close --------------


def job_buffer(size=4096):
    buf = ctypes.create_string_buffer(size)
    return buf, ctypes.addressof(buf)


def test_jobs_against_a_stalled_redis_hold_a_fixed_number_of_threads(tmp_path):
    """Before: 3000 jobs against a stalled Redis grew the process by ~512 threads (one
    blocking-pool thread each) and close() waited for the backend's timeout. Now the jobs run
    on JOB_WORKERS threads; beyond JOB_QUEUE_CAPACITY waiting jobs submit_job refuses at once
    (RuntimeError: refused), and close(grace_s) fails the queued jobs and cancels the stalled
    ones once its grace is over, so every accepted job completes (failed)."""
    proc, addr = start_redis(tmp_path)
    try:
        before = threads()
        s = hicache_rs.Store('{"backend": "redis", "nodes": ["%s"], "cluster": false, '
                             '"timeout_ms": 3600000}' % addr, page_bytes=4096)
        buf, ptr = job_buffer()
        # A stalled Redis: the process stops; the kernel still accepts and buffers, nobody
        # answers.
        os.kill(proc.pid, signal.SIGSTOP)
        ks = keys(3000, start=50_000)
        accepted, refused = [], 0
        for i, k in enumerate(ks):
            try:
                s.submit_job(i, False, [NS], [k], [ptr], [4096])
                accepted.append(i)
            except RuntimeError as e:
                assert "refused" in str(e), e
                refused += 1
        grown = threads() - before
        assert s.job_workers == _native.JOB_WORKERS
        # Runtime threads, blocking pool, job workers: fixed, not one per job.
        assert grown <= 2 + 16 + _native.JOB_WORKERS + 4, grown
        assert refused >= 3000 - _native.JOB_QUEUE_CAPACITY - _native.JOB_WORKERS
        assert s.jobs_in_flight == len(accepted)
        closer = threading.Thread(target=s.close, kwargs={"grace_s": 0.2})
        closer.start()
        closer.join(120)  # bounded: the grace, then cancellation; not the 1 h timeout
        assert not closer.is_alive(), "close() did not return against a stalled backend"
        done = s.take_completed()
        assert sorted(c[0] for c in done) == accepted
        assert all(c[3] is not None and not any(c[1]) for c in done)
        assert s.jobs_in_flight == 0
        with pytest.raises(RuntimeError, match="closed"):
            s.submit_job(10**6, False, [NS], [ks[0]], [ptr], [4096])
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)


def test_twenty_thousand_jobs_on_the_file_backend_hold_a_fixed_number_of_threads(tmp_path):
    """Before: 20k jobs through vLLM's tier on the file backend reached 518 threads. Now every
    job runs on the store's fixed workers; a refused job (queue full) is resubmitted after
    waiting, so all 20k run, and the thread count never grows past the fixed set."""
    before = threads()
    s = hicache_rs.Store('{"backend": "file", "dir": "%s"}' % (tmp_path / "l3"), page_bytes=512)
    bufs = [ctypes.create_string_buffer(bytes([i % 251]) * 512, 512) for i in range(64)]
    ptrs = [ctypes.addressof(b) for b in bufs]
    ks = keys(20_000, start=200_000)
    most, refusals = 0, 0
    for i, k in enumerate(ks):
        for _ in range(2):  # bounded: after wait_idle the queue is empty
            try:
                s.submit_job(i, False, [NS], [k], [ptrs[i % 64]], [512])
                break
            except RuntimeError as e:
                assert "refused" in str(e), e
                refusals += 1
                s.wait_idle()
        else:
            raise AssertionError(f"job {i} refused after the queue drained")
        if i % 500 == 0:
            most = max(most, threads() - before)
    s.wait_idle()
    most = max(most, threads() - before)
    assert most <= 2 + 16 + _native.JOB_WORKERS + 8, most
    done = s.take_completed()
    assert len(done) == 20_000 and all(c[1] == [True] and c[3] is None for c in done)
    assert s.batch_exists_each(NS, ks[:5] + ks[-5:]) == [True] * 10
    s.close()


def test_close_with_a_grace_keeps_jobs_that_finish_in_time(tmp_path):
    """An honest close waits for the queued jobs (they run, nothing is failed)."""
    s = hicache_rs.Store('{"backend": "file", "dir": "%s"}' % (tmp_path / "l3"), page_bytes=512)
    buf = ctypes.create_string_buffer(b"\x05" * 512, 512)
    ks = keys(200, start=900_000)
    for i, k in enumerate(ks):
        s.submit_job(i, False, [NS], [k], [ctypes.addressof(buf)], [512])
    s.close(grace_s=600)
    done = s.take_completed()
    assert len(done) == 200 and all(c[3] is None for c in done)
    with pytest.raises(ValueError, match="grace_s"):
        s.close(grace_s=-1)


# ---- also: registered regions must be memory of this process --------------------------------


def test_regions_that_are_not_this_processs_memory_are_refused():
    """Before: any (address, length) was accepted, so one region covering the address space
    let every pointer through the fence. Now a region must lie in readable and writable
    mappings of this process when registered."""
    s = hicache_rs.Store('{"backend": "memory"}')
    # A guard mapping (PROT_NONE): part of the address space, not memory one may touch.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    guard = libc.mmap(None, 1 << 20, 0,  # PROT_NONE
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert guard not in (None, ctypes.c_void_p(-1).value)
    buf = ctypes.create_string_buffer(4096)
    for regions, what in [
        ([(4096, 1 << 46)], "address 0x1000 is not mapped"),
        ([(ctypes.addressof(buf), 4096), (ctypes.addressof(buf), 1 << 46)], "region 1"),
        ([(guard, 1 << 20)], "not readable and writable"),
    ]:
        with pytest.raises(ValueError, match=what):
            s.set_allowed_regions(regions)
        with pytest.raises(ValueError, match=what):
            s.add_allowed_regions(regions)
    assert s.allowed_regions is None
    # A read-only mapping of this process (a library's constants, from /proc/self/maps).
    with open("/proc/self/maps") as f:
        spans = [line.split()[:2] for line in f]
    ro_span = next(((int(a, 16), int(b, 16)) for (r, p) in spans
                    for a, b in [r.split("-")] if p.startswith("r--")), None)
    assert ro_span is not None
    with pytest.raises(ValueError, match="not readable and writable"):
        s.add_allowed_regions([(ro_span[0], ro_span[1] - ro_span[0])])
    libc.munmap(guard, 1 << 20)
    # Real memory of this process is accepted.
    s.set_allowed_regions([(ctypes.addressof(buf), 4096)])
    assert s.allowed_regions == [(ctypes.addressof(buf), 4096)]
    s.close()


# ---- item 9: memory sizes against the process's limits ---------------------------------------


@pytest.mark.parametrize("limit", ["RLIMIT_AS", "RLIMIT_DATA"])
def test_a_memory_capacity_above_the_process_limit_is_refused(limit):
    """Before: an 8 GiB memory store under a 1.5 GiB limit was accepted (the machine has more)
    and the process aborted when it filled. Now the capacity is checked against the smallest of
    the machine, the cgroup limit, RLIMIT_AS and RLIMIT_DATA, and the error names it."""
    out = run_child(f"""
        import resource
        import hicache_rs
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        # RLIMIT_AS counts what is mapped already; RLIMIT_DATA is a plain 1.5 GiB.
        cap = vm + (3 << 29) if "{limit}" == "RLIMIT_AS" else 3 << 29
        resource.setrlimit(resource.{limit}, (cap, resource.RLIM_INFINITY))
        try:
            hicache_rs.Store('{{"backend": "memory", "capacity": "8gib"}}')
            print("accepted")
        except ValueError as e:
            print("ValueError", e)
        s = hicache_rs.Store('{{"backend": "memory", "capacity": "256mib"}}')
        print("small ok")
        s.close()
    """)
    lines = out.splitlines()
    assert lines[0].startswith("ValueError") and "`capacity` = 8589934592" in lines[0], out
    assert limit in lines[0], out
    assert lines[1] == "small ok", out
