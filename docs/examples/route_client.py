#!/usr/bin/env python3
"""Ask kv-router which worker should serve a prompt, then release the booking.

A minimal frontend in Python with nats-py and msgpack (pip install nats-py msgpack).
It sends a RouteRequest to `{namespace}.router.route`, prints the RouteReply as JSON,
and, with --release, publishes the request's lifecycle messages (`prefill_done`, then
`freed`) on `{namespace}.router.lifecycle`, as a frontend does when the first token
arrives and when the request ends. With --samples N > 1 (parallel sampling: N
sequences of one prompt) it routes the N requests together in one RouteBatchRequest
on `{namespace}.router.route_batch` and prints the RouteBatchReply. With --packed
it sends the token ids packed in one msgpack bin (4 little-endian bytes each), which
the router decodes far faster than an array for long prompts. See docs/protocol.md
for every field.

    python3 docs/examples/route_client.py --nats-url nats://127.0.0.1:4222 \
        --namespace kv-router --tokens 1000-1047 --release
    python3 docs/examples/route_client.py --tokens 1000-1047 --samples 4 --release
"""

import argparse
import asyncio
import json
import struct
import sys
import uuid

import msgpack
import nats


def parse_tokens(spec):
    """'1,2,3' or '1000-1047' (inclusive) or a mix: '1-4,9' -> [1, 2, 3, 4, 9]."""
    tokens = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            tokens.extend(range(int(lo), int(hi) + 1))
        else:
            tokens.append(int(part))
    return tokens


def pack_tokens(token_ids):
    """Token ids as one msgpack bin: 4 little-endian bytes each (docs/protocol.md,
    "Packed lists")."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


async def route(nc, namespace, request_id, token_ids, timeout):
    """One routing query; returns the decoded RouteReply (a dict)."""
    request = {
        "request_id": request_id,
        "prompt": {"type": "tokens", "token_ids": token_ids},
    }
    reply = await nc.request(
        f"{namespace}.router.route", msgpack.packb(request), timeout=timeout
    )
    return msgpack.unpackb(reply.data)


async def route_batch(nc, namespace, request_ids, token_ids, timeout):
    """One batch query, a request per id, all with the same prompt; returns the
    decoded RouteBatchReply (a dict: status 'answered' with 'replies' in input order,
    or status 'error')."""
    batch = {
        "requests": [
            {"request_id": rid, "prompt": {"type": "tokens", "token_ids": token_ids}}
            for rid in request_ids
        ],
        "order": "as-given",
    }
    reply = await nc.request(
        f"{namespace}.router.route_batch", msgpack.packb(batch), timeout=timeout
    )
    return msgpack.unpackb(reply.data)


async def lifecycle(nc, namespace, request_id, event):
    """Publishes one lifecycle message: 'prefill_done' or 'freed'."""
    message = {"request_id": request_id, "event": event}
    await nc.publish(f"{namespace}.router.lifecycle", msgpack.packb(message))


async def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--namespace", default="kv-router")
    parser.add_argument("--tokens", required=True, help="token ids: '1,2,3' or '1000-1047'")
    parser.add_argument("--request-id", default=None)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds")
    parser.add_argument(
        "--release", action="store_true", help="publish prefill_done and freed afterwards"
    )
    parser.add_argument(
        "--packed", action="store_true", help="send the token ids packed in one bin"
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=1,
        help="route N requests of this prompt together (ids <request-id>-0 … -N-1)",
    )
    args = parser.parse_args()

    nc = await nats.connect(args.nats_url)
    try:
        request_id = args.request_id or str(uuid.uuid4())
        tokens = parse_tokens(args.tokens)
        if args.packed:
            tokens = pack_tokens(tokens)
        if args.samples > 1:
            ids = [f"{request_id}-{i}" for i in range(args.samples)]
            reply = await route_batch(nc, args.namespace, ids, tokens, args.timeout)
            replies = reply.get("replies", [])
        else:
            ids = [request_id]
            reply = await route(nc, args.namespace, request_id, tokens, args.timeout)
            replies = [reply]
        print(json.dumps(reply), flush=True)
        routed = [r["request_id"] for r in replies if r.get("status") == "routed"]
        # A real frontend now sends each request to its reply's worker_id / dp_rank.
        if args.release:
            for rid in routed:
                await lifecycle(nc, args.namespace, rid, "prefill_done")
                await lifecycle(nc, args.namespace, rid, "freed")
        await nc.flush()
        return 0 if len(routed) == len(ids) else 1
    finally:
        await nc.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
