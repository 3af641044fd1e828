#!/usr/bin/env python3
"""The engine's side of vLLM's KV-event wire, on real libzmq (pyzmq), for tests.

Replays the captured vLLM 0.33 frames of a fixture file the way vLLM's
ZmqEventPublisher sends them: `[topic, seq (8 bytes BE), payload]` on a publisher
socket, and a ROUTER replay socket answering `["", start_seq]` with
`["", topic, seq, payload]` per buffered batch and `["", "", ff*8, ""]` at the end.
Batch 2 is buffered but never sent (lost in transit), so the relay must fetch it
from the replay socket.

The publisher is an XPUB socket (the same as PUB on the wire) so the script can
wait for the relay's subscription instead of sleeping. It prints one JSON line with
its two endpoints, waits for the subscription, publishes batches 0, 1 and 3, prints
"published", and serves replay requests until stdin closes.
"""

import json
import os
import sys
import threading

import zmq


def main():
    fixture, topic = sys.argv[1], sys.argv[2].encode()
    frames = json.load(open(fixture))["frames"]
    payloads = [bytes.fromhex(f["payload_hex"]) for f in frames]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    print(json.dumps({"pub": f"tcp://127.0.0.1:{pub_port}",
                      "replay": f"tcp://127.0.0.1:{replay_port}"}), flush=True)

    while not pub.recv().startswith(b"\x01"):
        pass
    buffered = [(seq, payloads[seq]) for seq in range(4)]
    for seq in (0, 1, 3):
        pub.send_multipart([topic, seq.to_bytes(8, "big"), payloads[seq]])
    print("published", flush=True)

    threading.Thread(target=exit_when_stdin_closes, daemon=True).start()
    while True:
        identity, _, start = router.recv_multipart()
        start = int.from_bytes(start, "big")
        for seq, payload in buffered:
            if seq >= start:
                router.send_multipart([identity, b"", topic, seq.to_bytes(8, "big"), payload])
        router.send_multipart([identity, b"", b"", b"\xff" * 8, b""])


def exit_when_stdin_closes():
    sys.stdin.read()
    os._exit(0)


if __name__ == "__main__":
    main()
