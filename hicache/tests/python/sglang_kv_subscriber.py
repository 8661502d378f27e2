"""Replays a hicache-rs KV-event publisher and decodes every batch with SGLang's own classes.

Usage: sglang_kv_subscriber.py REPLAY_ENDPOINT TOPIC

Connects a DEALER to the replay ROUTER, asks for every batch from sequence 0, decodes each
payload with ``msgspec.msgpack.Decoder(KVEventBatch)`` from SGLang's
``sglang/srt/disaggregation/kv_events.py`` (the installed sglang package's file), and prints one
JSON line per event: ``{"seq", "type", "medium", "block_hashes"}``. Exit code 0 on success.

``sglang/__init__.py`` and ``sglang/srt/utils/__init__.py`` import torch and most of SGLang's
runtime; the event classes need none of it. The file is loaded by path, and the two helpers it
imports for its *publisher* side (``get_parallel``, ``NetworkAddress``) are given inert
stand-ins: decoding uses SGLang's classes unchanged.
"""

import importlib.util
import json
import os
import sys
import types

import msgspec
import zmq


def load_sglang_kv_events():
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("sglang is not installed")
    path = os.path.join(
        spec.submodule_search_locations[0], "srt", "disaggregation", "kv_events.py"
    )
    runtime_context = types.ModuleType("sglang.srt.runtime_context")
    runtime_context.get_parallel = lambda: None
    network = types.ModuleType("sglang.srt.utils.network")

    class NetworkAddress:  # only the publisher's endpoint helpers use it
        @staticmethod
        def parse(_text):
            raise ValueError("not used by the subscriber")

    network.NetworkAddress = NetworkAddress
    sys.modules["sglang.srt.runtime_context"] = runtime_context
    sys.modules["sglang.srt.utils.network"] = network
    module_spec = importlib.util.spec_from_file_location("sglang_kv_events", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def main():
    endpoint, topic = sys.argv[1], sys.argv[2].encode()
    kv = load_sglang_kv_events()
    decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    end = (-1).to_bytes(8, "big", signed=True)
    while True:
        empty, got_topic, seq_bytes, payload = dealer.recv_multipart()
        assert empty == b""
        if seq_bytes == end:
            break
        assert got_topic == topic, (got_topic, topic)
        seq = int.from_bytes(seq_bytes, "big")
        batch = decoder.decode(payload)
        assert isinstance(batch, kv.KVEventBatch)
        for event in batch.events:
            print(
                json.dumps(
                    {
                        "seq": seq,
                        "type": type(event).__name__,
                        "medium": getattr(event, "medium", None),
                        "block_hashes": list(getattr(event, "block_hashes", [])),
                    }
                )
            )
    dealer.close()
    ctx.term()


if __name__ == "__main__":
    main()
