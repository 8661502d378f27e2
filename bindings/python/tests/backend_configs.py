"""The extra-config of every backend hicache-rs can compile into the package, set up for a
test: a real redis-server and an in-process rdma server on loopback, the example plugin .so,
directories under the test's tmp_path. Shared by the SGLang (v2) and vLLM tests."""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]

#: Every backend hicache-rs can compile into the package.
BACKENDS = ("memory", "file", "uring", "redis", "rdma", "plugin")


def plugin_path():
    """The example plugin (``cargo build -p hicache-plugin-example``; run-tests.sh builds it)."""
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    for profile in ("debug", "release"):
        p = target / profile / "libhicache_plugin_example.so"
        if p.exists():
            return str(p)
    return None


def ours_config(name, request, tmp_path, subdir="ours", uring_capacity="64MiB", grow="1MiB"):
    """hicache-rs' extra-config for backend ``name``; a real redis-server / in-process rdma
    server on loopback; the example plugin .so; local directories under ``tmp_path/subdir``."""
    if name == "redis":
        return {"backend": "redis", "nodes": [request.getfixturevalue("redis_server")],
                "cluster": False, "key_prefix": f"v2-{os.getpid()}-{id(request)}-{tmp_path.name}:"}
    if name == "plugin":
        path = plugin_path()
        if path is None:
            msg = "target/debug/libhicache_plugin_example.so is not built"
            if os.environ.get("HICACHE_REQUIRE_PLUGIN") == "1":
                pytest.fail(msg, pytrace=False)
            pytest.skip(msg)
        return {"backend": "plugin", "plugin_path": path, "capacity": "64MiB"}
    return {
        "memory": {"backend": "memory"},
        "file": {"backend": "file", "dir": str(tmp_path / subdir)},
        "uring": {"backend": "uring", "dir": str(tmp_path / subdir), "capacity": uring_capacity,
                  "grow_bytes": grow},
        "rdma": {"backend": "rdma", "spawn_server": True, "capacity": "64MiB"},
    }[name]
