#!/usr/bin/env python3
"""Ask kv-router which worker should serve a prompt, then release the booking.

A minimal frontend in Python with nats-py and msgpack (pip install nats-py msgpack).
It sends a RouteRequest to `{namespace}.router.route`, prints the RouteReply as JSON,
and, with --release, publishes the request's lifecycle messages (`prefill_done`, then
`freed`) on `{namespace}.router.lifecycle`, as a frontend does when the first token
arrives and when the request ends. See docs/protocol.md for every field.

    python3 docs/examples/route_client.py --nats-url nats://127.0.0.1:4222 \
        --namespace kv-router --tokens 1000-1047 --release
"""

import argparse
import asyncio
import json
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
    args = parser.parse_args()

    nc = await nats.connect(args.nats_url)
    try:
        request_id = args.request_id or str(uuid.uuid4())
        reply = await route(nc, args.namespace, request_id, parse_tokens(args.tokens), args.timeout)
        print(json.dumps(reply), flush=True)
        if reply.get("status") != "routed":
            return 1
        # A real frontend now sends the request to reply["worker_id"] / reply["dp_rank"].
        if args.release:
            await lifecycle(nc, args.namespace, request_id, "prefill_done")
            await lifecycle(nc, args.namespace, request_id, "freed")
        await nc.flush()
        return 0
    finally:
        await nc.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
