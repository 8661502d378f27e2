"""libzmq (through pyzmq) as the server of hicache-zmtp's clients.

Usage: pyzmq_servers.py

Binds a PUB and a ROUTER on loopback ports of its choosing and prints them as one JSON line
({"pub": ..., "router": ...}). The PUB sends [b"kv", seq (8 bytes BE), 1 MiB] and [b"zz", b"x"]
every 10 ms; the ROUTER answers each request [b"", x] with [b"", x, b"ok"]. Runs until killed
(at most 60 s).
"""

import json
import sys
import time

import zmq

ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub.setsockopt(zmq.LINGER, 0)
pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
router = ctx.socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 0)
router_port = router.bind_to_random_port("tcp://127.0.0.1")
print(json.dumps({"pub": f"tcp://127.0.0.1:{pub_port}", "router": f"tcp://127.0.0.1:{router_port}"}))
sys.stdout.flush()

payload = b"\x07" * (1 << 20)
poller = zmq.Poller()
poller.register(router, zmq.POLLIN)
seq = 0
end = time.time() + 60
while time.time() < end:
    pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
    pub.send_multipart([b"zz", b"x"])
    seq += 1
    for sock, _ in poller.poll(10):
        ident, *frames = router.recv_multipart()
        router.send_multipart([ident, *frames, b"ok"])
