"""Shared fixtures. SGLang's own code is imported without executing ``sglang/__init__.py``
(which pulls in the whole server): ``sglang`` is registered as a bare package whose
``__path__`` is the installed directory, and only the submodules the tests name are imported.
Without torch and sglang installed the SGLang tests are skipped, unless
``HICACHE_REQUIRE_SGLANG=1`` (CI), where that is a failure."""

import importlib.util
import os
import sys
import types

import pytest


def _register_bare_sglang():
    if "sglang" in sys.modules:
        return True
    spec = importlib.util.find_spec("sglang")
    if spec is None or importlib.util.find_spec("torch") is None:
        return False
    pkg = types.ModuleType("sglang")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["sglang"] = pkg
    return True


HAVE_SGLANG = _register_bare_sglang()


def require_sglang():
    """Skips the calling module without SGLang, or fails under HICACHE_REQUIRE_SGLANG=1."""
    if HAVE_SGLANG:
        return
    msg = "sglang and torch are not installed (bash bindings/python/setup-test-env.sh installs them)"
    if os.environ.get("HICACHE_REQUIRE_SGLANG") == "1":
        pytest.fail(msg + " and HICACHE_REQUIRE_SGLANG=1", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def start_redis(workdir):
    """Starts a real redis-server on a free loopback port (bounded wait for its PONG):
    ``(process, "127.0.0.1:port")``. Skips without redis-server, or fails under
    HICACHE_REQUIRE_REDIS=1 (CI)."""
    import shutil
    import socket
    import subprocess
    import time

    exe = shutil.which("redis-server")
    if exe is None:
        msg = "redis-server is not installed"
        if os.environ.get("HICACHE_REQUIRE_REDIS") == "1":
            pytest.fail(msg + " and HICACHE_REQUIRE_REDIS=1", pytrace=False)
        pytest.skip(msg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    for _ in range(200):  # bounded: 10 s
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return proc, f"127.0.0.1:{port}"
        except OSError:
            pass
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"redis-server did not answer on 127.0.0.1:{port}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on loopback for the whole session: its address."""
    proc, addr = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield addr
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def require_vllm():
    """Skips the calling module without vLLM (target/python-vllm on PYTHONPATH, see
    setup-vllm-env.sh), or fails under HICACHE_REQUIRE_VLLM=1 (CI)."""
    if importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("torch"):
        return
    msg = "vllm is not importable (bash bindings/python/setup-vllm-env.sh installs it)"
    if os.environ.get("HICACHE_REQUIRE_VLLM") == "1":
        pytest.fail(msg + " and HICACHE_REQUIRE_VLLM=1", pytrace=False)
    pytest.skip(msg, allow_module_level=True)
