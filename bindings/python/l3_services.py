"""Loopback services for bench_sglang.py's L3 references: Mooncake Store's master (with its
HTTP metadata server), a Mooncake store process that holds a segment, and a Redis Cluster.

Every service binds 127.0.0.1 on free ports, every wait for one is bounded, and each is a
context manager that kills what it started when it ends (also on error).

Mooncake comes from PyPI (``mooncake-transfer-engine-non-cuda``, the TCP-only build); when
its module is not importable, :func:`mooncake_missing` says why and how to install it.
"""

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

MOONCAKE_INSTALL = (
    "pip install --target DIR mooncake-transfer-engine-non-cuda (plus aiohttp and msgpack "
    "if the environment lacks them), then PYTHONPATH=DIR; see bindings/python/README.md")


def mooncake_missing():
    """``None`` when ``mooncake.store`` imports, else the reason and how to install it."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"mooncake is not importable ({e}); {MOONCAKE_INSTALL}"
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_port():
    """A free port whose cluster bus port (port + 10000) is a valid, free port too."""
    for _ in range(1000):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) for a Redis Cluster node")


def _wait_port(port, proc, what, within=30.0):
    """Bounded wait until ``127.0.0.1:port`` accepts a connection (or ``proc`` exits)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {within:.0f} s")


def _stop(proc, grace=10.0):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)


@contextlib.contextmanager
def mooncake_master(logdir):
    """``mooncake_master`` with its HTTP metadata server, both on 127.0.0.1. Yields
    ``(master_address, metadata_url)``."""
    import mooncake

    exe = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    if not os.path.exists(exe):
        exe = shutil.which("mooncake_master")
    if not exe:
        raise RuntimeError("mooncake_master is not in the mooncake package nor on PATH")
    rpc, meta, metrics = free_port(), free_port(), free_port()
    log = open(os.path.join(logdir, f"mooncake-master-{rpc}.log"), "w")
    proc = subprocess.Popen(
        [exe, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={meta}", "--metrics_host=127.0.0.1",
         f"--metrics_port={metrics}", "--eviction_high_watermark_ratio=0.95",
         # A client is dropped (its segment unmounted) after client_ttl s without a
         # heartbeat: 10 by default, too short on a machine loaded by builds.
         "--client_ttl=120"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_port(rpc, proc, "mooncake_master")
        _wait_port(meta, proc, "mooncake_master's metadata server")
        yield f"127.0.0.1:{rpc}", f"http://127.0.0.1:{meta}/metadata"
    finally:
        _stop(proc)
        log.close()


# The store process: one Mooncake client that mounts a segment of SIZE bytes and serves it
# over TCP until its stdin closes. No local buffer (it never puts or gets itself).
_STORE_PROCESS = """
import sys
from mooncake.store import MooncakeDistributedStore
master, meta, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", meta, size, 0, "tcp", "", master)
print("ready" if rc == 0 else f"setup failed: {rc}", flush=True)
if rc == 0:
    sys.stdin.read()
    s.close()
"""


@contextlib.contextmanager
def mooncake_store_process(master, metadata, segment_bytes, logdir):
    """A separate process holding a Mooncake segment of ``segment_bytes``, reached over TCP."""
    log = open(os.path.join(logdir, "mooncake-store.log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", _STORE_PROCESS, master, metadata, str(segment_bytes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = _readline_within(proc, 60.0)
        if line.strip() != "ready":
            raise RuntimeError(f"mooncake store process: {line.strip() or 'no answer'}")
        yield proc
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        _stop(proc)
        log.close()


def _readline_within(proc, within):
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(within):
        raise RuntimeError(f"mooncake store process: not ready within {within:.0f} s")
    return proc.stdout.readline()


def _redis_cli(port, *args):
    return subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
                          capture_output=True, text=True, timeout=30).stdout


# jemalloc options that make a server keep the memory of freed values for the next ones
# (``MALLOC_CONF`` for a redis-server linked to the system's jemalloc, as Debian's and
# Ubuntu's packages are; ``JE_MALLOC_CONF`` for Redis's or Valkey's bundled jemalloc, built with
# the ``je_`` prefix). By default jemalloc hands freed pages back to the kernel within
# ``dirty_decay_ms`` (10 s) and at once for allocations of 8 MiB or more (its oversize arena),
# so a server storing 8 MiB pages page-faults every byte of every value it receives or sends.
KEEP_FREED_MEMORY = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def _server_keeps_freed_memory(port):
    """Whether the server's allocator runs with ``KEEP_FREED_MEMORY`` (its
    ``MEMORY MALLOC-STATS`` names the options jemalloc runs with)."""
    stats = _redis_cli(port, "memory", "malloc-stats")
    return "opt.dirty_decay_ms: -1" in stats and "opt.muzzy_decay_ms: -1" in stats


@contextlib.contextmanager
def redis_cluster(primaries=3, keep_freed_memory=False):
    """A Redis Cluster of ``primaries`` nodes on loopback (apt's redis-server and redis-cli,
    no persistence), healthy before it is yielded. Yields the nodes' ``host:port``.

    ``keep_freed_memory``: the servers run with ``KEEP_FREED_MEMORY`` (what
    docs/user-guide.md recommends for an L3 cluster of large pages); a server whose allocator
    did not take it (not jemalloc) fails the start with that said."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise RuntimeError("redis-server and redis-cli are needed (apt-get install redis-server)")
    work = tempfile.mkdtemp(prefix="hicache-bench-redis-")
    procs, ports = [], []
    env = dict(os.environ)
    for name in ("MALLOC_CONF", "JE_MALLOC_CONF"):
        if keep_freed_memory:
            env[name] = KEEP_FREED_MEMORY
        else:
            env.pop(name, None)
    try:
        for i in range(primaries):
            port = _redis_port()
            d = os.path.join(work, str(i))
            os.makedirs(d)
            procs.append(subprocess.Popen(
                ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                 "--appendonly", "no", "--cluster-enabled", "yes",
                 "--cluster-config-file", os.path.join(d, "nodes.conf"), "--dir", d],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
            ports.append(port)
        for p, port in zip(procs, ports):
            _wait_port(port, p, "redis-server")
            if keep_freed_memory and not _server_keeps_freed_memory(port):
                raise RuntimeError(f"redis-server on port {port} did not take the allocator "
                                   f"options {KEEP_FREED_MEMORY} (is it linked to jemalloc?)")
        nodes = [f"127.0.0.1:{p}" for p in ports]
        out = subprocess.run(["redis-cli", "--cluster", "create", *nodes, "--cluster-yes"],
                             stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in _redis_cli(p, "cluster", "info") for p in ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not become healthy within 30 s")
            time.sleep(0.1)
        yield nodes
    finally:
        for p in procs:
            _stop(p)
        shutil.rmtree(work, ignore_errors=True)
