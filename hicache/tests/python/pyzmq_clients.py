"""libzmq (through pyzmq) as the client of hicache-rs's own ZMTP server.

Usage: pyzmq_clients.py PUB_ENDPOINT REPLAY_ENDPOINT TOPIC

A SUB with ZMTP heartbeats on (libzmq sends PING and drops a peer that does not PONG) receives
30 consecutive live batches, pausing past the heartbeat timeout in the middle; then a DEALER
(heartbeats on too) asks for a replay from sequence 0 and checks that it gets consecutive
sequence numbers up to the end marker, twice on the same connection. Prints one JSON line,
exit code 0 on success.
"""

import json
import sys
import time

import zmq

pub_ep, replay_ep, topic = sys.argv[1], sys.argv[2], sys.argv[3].encode()
ctx = zmq.Context()


def heartbeats(sock):
    sock.setsockopt(zmq.HEARTBEAT_IVL, 100)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 1000)
    sock.setsockopt(zmq.LINGER, 0)


sub = ctx.socket(zmq.SUB)
heartbeats(sub)
sub.setsockopt(zmq.RCVTIMEO, 20000)
sub.connect(pub_ep)
sub.setsockopt(zmq.SUBSCRIBE, topic)
live = []
paused = False
while len(live) < 30:
    t, seq, payload = sub.recv_multipart()
    assert t == topic, t
    seq = int.from_bytes(seq, "big")
    if live:
        assert seq == live[-1] + 1, (live[-1], seq)
    live.append(seq)
    if len(live) == 10 and not paused:
        paused = True
        # Past the heartbeat timeout: the connection survives only if our PINGs are answered.
        time.sleep(1.5)
        # What the publisher sent meanwhile is queued; start counting afresh.
        live = []
        while True:
            try:
                sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break

dealer = ctx.socket(zmq.DEALER)
heartbeats(dealer)
dealer.setsockopt(zmq.RCVTIMEO, 20000)
dealer.connect(replay_ep)
replays = []
for _ in range(2):
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs = []
    while True:
        empty, t, seq, payload = dealer.recv_multipart()
        assert empty == b""
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
            break
        assert t == topic
        seqs.append(seq)
    assert seqs == list(range(len(seqs))), seqs[:5]
    replays.append(len(seqs))
print(json.dumps({"live": len(live), "replays": replays}))
