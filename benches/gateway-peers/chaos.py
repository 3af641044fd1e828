#!/usr/bin/env python3
"""Faults under load, seen from the client and from the routers' books.

Starts mock vLLM engines behind relays (as ``run.py`` does), ``--replicas`` router
replicas and one gateway; asks streamed text completions open-loop at ``--rate`` per
second with the ``openai`` client while ``--fault`` strikes:

- ``stall``: ``--stops`` times, the replica the gateway is pinned to (the one whose
  ``kv_router_route_requests_total`` grew most over 0.3 s) is stopped (SIGSTOP) for
  ``--stop-s`` seconds, then resumed (SIGCONT). A stopped process keeps its NATS
  connection, so NATS keeps delivering to it: a replica starved, swapped out or
  partitioned without a reset.
- ``nats-outage``: nats-server is killed (SIGKILL) and started again on the same port
  and store after ``--outage-s`` seconds (longer than the gateway's 10 s route
  timeout by default, so the queries asked early in the outage fail).

Reports failed requests, the requests whose first token took over ``--slow-s``
(0.5 s) and the slowest, the queries the gateway asked again of a live replica
(``kv_gateway_route_stalls_total{event="asked_again"}``), and, a few seconds after
the load, the requests each replica still books
(``kv_router_worker_active_requests``; anything but 0 is a booking nobody will free
before the request TTL).

    python3 benches/gateway-peers/chaos.py --fault stall
    python3 benches/gateway-peers/chaos.py --fault nats-outage
    python3 benches/gateway-peers/chaos.py --fault stall --kv-router OTHER/kv-router

Needs what ``run.py`` needs; installs ``openai`` into ``target/gateway-peers/venvs/``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / "target" / "gateway-peers" / "venvs" / "openai"
OPENAI = "openai==3.54.0"
"""The client the gateway tests use (`tests/tests/gateway/fixture.rs`)."""
MODEL_DIR = REPO / "kv-tokenizer" / "tests" / "data"
BOOKS_SETTLE_S = 5.0
"""How long after the load the replicas' books are read: every request has ended and
its ``freed`` has been applied well before."""


def in_venv(argv: list[str]) -> None:
    """Runs this script again with a venv's Python that has ``openai``, if needed."""
    try:
        import openai  # noqa: F401
        return
    except ImportError:
        pass
    marker = VENV / ".requirement"
    if not (marker.exists() and marker.read_text().strip() == OPENAI):
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "--quiet",
                        "--disable-pip-version-check", OPENAI], check=True)
        marker.write_text(OPENAI + "\n")
    os.execv(str(VENV / "bin" / "python"), [str(VENV / "bin" / "python"), __file__, *argv])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kv-router", type=Path, default=REPO / "target/release/kv-router",
                   help="the kv-router binary (relays, replicas and gateway)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--rate", type=float, default=40.0, help="requests per second, open loop")
    p.add_argument("--fault", choices=("stall", "nats-outage"), default="stall")
    p.add_argument("--stops", type=int, default=5)
    p.add_argument("--stop-s", type=float, default=3.0, help="how long each stop lasts")
    p.add_argument("--gap-s", type=float, default=3.0, help="between a resume and the next stop")
    p.add_argument("--outage-s", type=float, default=12.0, help="how long NATS is away")
    p.add_argument("--slow-s", type=float, default=0.5,
                   help="a first token later than this waited on the fault (unfaulted: ~20 ms)")
    p.add_argument("--out", type=Path, default=REPO / "target" / "gateway-peers" / "chaos")
    return p.parse_args(argv)


def metric_sum(port: int, name: str) -> float:
    """The sum of every sample of ``name`` on a replica's ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name))


async def run(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    import openai
    from cluster import MODEL, Cluster, EngineShape
    from procs import Stack, free_port
    from tools import Binaries, require

    unused = Path("/nonexistent")
    bins = Binaries(args.kv_router.resolve(), REPO / "target/release/kv-mocker",
                    require("nats-server"), require("etcd"), unused, unused, unused)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    stack = Stack(args.out / "logs")
    cluster = Cluster(stack, bins, EngineShape(args.engines, 3.0, 64, 2048), MODEL_DIR)
    try:
        cluster.start()
        replicas = []
        for i in range(args.replicas):
            port = free_port()
            child = stack.spawn(f"router-{i}", [
                str(bins.kv_router), "serve", *cluster.connection(),
                "--http-listen", f"127.0.0.1:{port}", "--http-debug-listen", "main"],
                ready="kv-router ready")
            replicas.append((child, port))
        gport = free_port()
        stack.spawn("gateway", [
            str(bins.kv_router), "gateway", *cluster.connection(),
            "--listen", f"127.0.0.1:{gport}", "--served-model-name", MODEL,
            "--model-dir", str(MODEL_DIR)], ready="kv-router gateway ready")
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gport}/v1", api_key="-",
                                    max_retries=0, timeout=60)
        words = (REPO / "docs" / "architecture.md").read_text().split()
        ttfts: list[float] = []
        failed: list[str] = []

        async def one(k: int) -> None:
            # 12 shared 300-word prefixes, then a distinct tail.
            prompt = " ".join(words[(k % 12) * 300:(k % 12 + 1) * 300] + words[k:k + 60])
            began = time.monotonic()
            try:
                stream = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=32, stream=True)
                first = None
                async for _ in stream:
                    first = first or time.monotonic() - began
                ttfts.append(first or 0.0)
            except openai.OpenAIError as e:
                failed.append(f"{type(e).__name__}: {e}")

        async def stops() -> None:
            def routes(port: int) -> float:
                return metric_sum(port, "kv_router_route_requests_total")
            await asyncio.sleep(4)
            for k in range(args.stops):
                before = [await asyncio.to_thread(routes, p) for _, p in replicas]
                await asyncio.sleep(0.3)
                after = [await asyncio.to_thread(routes, p) for _, p in replicas]
                pinned = max(range(len(replicas)), key=lambda i: after[i] - before[i])
                print(f"stop {k + 1}: replica {pinned} for {args.stop_s} s", flush=True)
                os.killpg(replicas[pinned][0].pgid, signal.SIGSTOP)
                await asyncio.sleep(args.stop_s)
                os.killpg(replicas[pinned][0].pgid, signal.SIGCONT)
                await asyncio.sleep(args.gap_s)

        async def outage() -> None:
            await asyncio.sleep(4)
            nats = next(c for c in stack._children if c.name == "nats")
            print(f"NATS killed for {args.outage_s} s", flush=True)
            os.killpg(nats.pgid, signal.SIGKILL)
            await asyncio.sleep(args.outage_s)
            await asyncio.to_thread(stack.spawn, "nats-again", nats.argv,
                                    ready="Server is ready")
            await asyncio.sleep(args.gap_s)

        async def arrivals(seconds: float) -> None:
            tasks, k, end = [], 0, time.monotonic() + seconds
            while time.monotonic() < end:
                tasks.append(asyncio.create_task(one(k)))
                k += 1
                await asyncio.sleep(1.0 / args.rate)
            await asyncio.gather(*tasks)

        if args.fault == "stall":
            seconds, fault = 4 + args.stops * (0.3 + args.stop_s + args.gap_s), stops()
        else:
            seconds, fault = 4 + args.outage_s + args.gap_s, outage()
        await asyncio.gather(arrivals(seconds), fault)
        await asyncio.sleep(BOOKS_SETTLE_S)
        books = [metric_sum(p, "kv_router_worker_active_requests") for _, p in replicas]
        slow = [t for t in ttfts if t > args.slow_s]
        asked_again = metric_sum(gport, 'kv_gateway_route_stalls_total{event="asked_again"}')
        print(f"\n| kv-router | fault | requests | failed | first token over {args.slow_s} s "
              f"| their summed wait (s) | slowest (s) | asked again | still booked per replica "
              f"| load |\n|---|---|---:|---:|---:|---:|---:|---:|---|---|")
        print(f"| {args.kv_router} | {args.fault} | {len(ttfts) + len(failed)} "
              f"| {len(failed)} | {len(slow)} | {sum(slow):.1f} | {max(ttfts, default=0):.2f} "
              f"| {asked_again:.0f} | {' / '.join(f'{b:.0f}' for b in books)} "
              f"| {os.getloadavg()[0]:.2f} |")
        for line in sorted(set(failed))[:10]:
            print("  failed:", line)
        return 0
    finally:
        stack.stop_all()


def main(argv: list[str]) -> int:
    in_venv(argv)
    args = parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
