"""Publishes KV events with an engine's own classes: SGLang's or vLLM's ZmqEventPublisher and
KVEventBatch / BlockStored / BlockRemoved, unchanged, over pyzmq.

Usage: engine_publisher.py sglang|vllm

Binds the PUB and replay ROUTER sockets on 127.0.0.1 (ports chosen by the OS), prints
``{"endpoint", "replay_endpoint"}`` as one JSON line, then reads commands, one JSON line each,
from standard input:

- ``{"stored": [hashes], "parent": h|null, "tokens": [..], "block_size": n, "medium": m}``
  publishes one batch with one BlockStored;
- ``{"removed": [hashes], "medium": m}`` publishes one batch with one BlockRemoved;
- ``{"quit": true}`` shuts the publisher down.

Each command is answered with ``ok`` once the publisher thread has sent the batch. vLLM's hashes
are published as bytes (its default: a SHA-256 digest; the index keeps the last 8 bytes), so the
test passes ints and this script turns them into 32-byte big-endian digests.

Both engines' packages import torch and most of their runtime at the top; the event module
needs none of it. The module file is loaded by path, and the few helpers it imports for its
publisher's endpoint handling are given inert stand-ins (``get_parallel``, ``NetworkAddress``,
vLLM's logger, network helpers and config class): the event classes and the publisher are the
engines' own, unchanged, except vLLM's bind heuristic (it binds only wildcard hosts), which is
told to bind loopback.
"""

import dataclasses
import importlib.util
import json
import logging
import os
import socket
import sys
import time
import types



def package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{name} is not installed")
    return spec.submodule_search_locations[0]


def load(name, path):
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def stub(name, **attrs):
    module = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(module, k, v)
    sys.modules[name] = module
    return module


def load_sglang():
    class NetworkAddress:
        def __init__(self, host, port):
            self.host, self.port, self.is_ipv6 = host, port, ":" in host

        @staticmethod
        def parse(text):
            host, _, port = text.rpartition(":")
            return NetworkAddress(host.strip("[]"), int(port))

        def to_tcp(self):
            return f"tcp://{self.host}:{self.port}"

    stub("sglang.srt.runtime_context", get_parallel=lambda: None)
    stub("sglang.srt.utils.network", NetworkAddress=NetworkAddress)
    path = os.path.join(package_dir("sglang"), "srt", "disaggregation", "kv_events.py")
    return load("sglang_kv_events", path)


def load_vllm():
    @dataclasses.dataclass
    class KVEventsConfig:
        enable_kv_cache_events: bool = False
        publisher: str = "null"
        endpoint: str = ""
        replay_endpoint: str = None
        buffer_steps: int = 10_000
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = ""

    stub("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    stub("vllm.logger", init_logger=logging.getLogger)
    stub(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: False,
        split_zmq_path=lambda p: ("tcp", p.rsplit(":", 1)[0], p.rsplit(":", 1)[1]),
    )
    stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    path = os.path.join(package_dir("vllm"), "distributed", "kv_events.py")
    module = load("vllm_kv_events", path)
    # vLLM binds wildcard hosts only (else it connects); tests bind loopback.
    module.ZmqEventPublisher._is_bind_endpoint = staticmethod(lambda endpoint: True)
    return module


def main():
    engine = sys.argv[1]
    kv = load_sglang() if engine == "sglang" else load_vllm()
    # Free loopback ports (the publisher binds them right after).
    probes = [socket.socket() for _ in range(2)]
    for s in probes:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in probes]
    for s in probes:
        s.close()
    endpoint, replay = (f"tcp://127.0.0.1:{p}" for p in ports)
    if engine == "sglang":
        pub = kv.ZmqEventPublisher(
            attn_dp_rank=0, endpoint=endpoint, replay_endpoint=replay, topic="kv", bind=True
        )
    else:
        pub = kv.ZmqEventPublisher(
            data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay, topic="kv"
        )
    print(json.dumps({"endpoint": endpoint, "replay_endpoint": replay}), flush=True)

    def h(x):
        if engine == "vllm":
            return (x & ((1 << 64) - 1)).to_bytes(32, "big")
        return x

    published = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        if "stored" in cmd:
            fields = dict(
                block_hashes=[h(x) for x in cmd["stored"]],
                parent_block_hash=None if cmd["parent"] is None else h(cmd["parent"]),
                token_ids=cmd["tokens"],
                block_size=cmd["block_size"],
                lora_id=None,
                medium=cmd["medium"],
            )
            if engine == "vllm":
                # A KV cache group of a hybrid model: `group_idx`, `kind` and `window` say which
                # (vLLM's `kv_cache_spec_kind` / `kv_cache_spec_sliding_window`); Full is group 0.
                fields.update(
                    lora_name=None,
                    extra_keys=[None] * len(cmd["stored"]),
                    group_idx=cmd.get("group_idx", 0),
                    kv_cache_spec_kind=cmd.get("kind"),
                    kv_cache_spec_sliding_window=cmd.get("window"),
                )
            event = kv.BlockStored(**fields)
        else:
            fields = dict(block_hashes=[h(x) for x in cmd["removed"]], medium=cmd["medium"])
            if engine == "vllm" and "group_idx" in cmd:
                fields.update(group_idx=cmd["group_idx"])
            event = kv.BlockRemoved(**fields)
        pub.publish(kv.KVEventBatch(ts=time.time(), events=[event]))
        published += 1
        deadline = time.time() + 10
        while len(pub._buffer) < published and time.time() < deadline:
            time.sleep(0.005)
        print("ok", flush=True)
    pub.shutdown()


if __name__ == "__main__":
    main()
