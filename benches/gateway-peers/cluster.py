"""The shared cluster every row runs on: nats-server and etcd (free loopback ports,
temporary data directories), N mock engines as vLLM stand-ins (``kv-mocker engines
--kv-events vllm``: OpenAI HTTP, vLLM's ``/metrics``, ``/health`` and
``/reset_prefix_cache``, vLLM's ZMQ KV events) and one ``kv-router relay`` per engine,
as ``kv-mocker quickstart`` runs them. The relays put the engines' KV events on NATS
and register them in etcd, so the router sees every row's traffic; the peers reach
the engines by URL, as they would reach vLLM.

Engine counters come from each engine's ``/metrics`` (vLLM's names): prefix-cache
queries and hits (tokens) and finished requests, read before and after a row.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from procs import Child, ChildError, Stack, free_port, free_port_block
from tools import Binaries

NAMESPACE = "gateway-peers"
MODEL = "kv-mocker"
"""The served model name of the engines, every gateway and the client."""

HTTP_TIMEOUT_S = 10.0
RESET_DEADLINE_S = 60.0


@dataclass(frozen=True)
class EngineShape:
    """The mock engines of one load."""

    workers: int
    time_scale: float
    """Model time runs this many times faster than the wall clock."""
    block_size: int
    """Tokens per KV block."""
    num_gpu_blocks: int
    """KV capacity per engine, in blocks."""


@dataclass
class EngineCounts:
    """One engine's counters at one moment (vLLM's ``/metrics``)."""

    queries: float = 0.0
    """Prompt tokens of prefilled requests."""
    hits: float = 0.0
    """Of those, tokens served from the prefix cache."""
    finished: float = 0.0
    """Requests that generated all their tokens."""


def http(method: str, url: str, body: bytes | None = None,
         timeout_s: float = HTTP_TIMEOUT_S) -> tuple[int, bytes]:
    """One HTTP request: (status, body). Connection errors raise ``OSError``."""
    req = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


class Cluster:
    """NATS, etcd, engines and relays of one load, started in that order."""

    def __init__(self, stack: Stack, bins: Binaries, shape: EngineShape, model_dir: Path):
        self.stack = stack
        self.bins = bins
        self.shape = shape
        self.model_dir = model_dir
        self._tmp = tempfile.TemporaryDirectory(prefix="gateway-peers-")
        self.nats_url = ""
        self.etcd_url = ""
        self.engine_urls: list[str] = []
        self.zmq_publish: list[str] = []
        self.zmq_replay: list[str] = []
        self.relays: list[Child] = []
        self.engines: Child | None = None

    def connection(self) -> list[str]:
        """The NATS, etcd and namespace flags of every kv-router process."""
        return ["--nats-url", self.nats_url, "--etcd-endpoints", self.etcd_url,
                "--namespace", NAMESPACE]

    def start(self) -> None:
        self.nats_url, self.etcd_url = start_nats_etcd(
            self.stack, self.bins.nats_server, self.bins.etcd, Path(self._tmp.name))
        self._start_engines()
        for i in range(self.shape.workers):
            self.relays.append(self.stack.spawn(f"relay-{i}", [
                str(self.bins.kv_router), "relay", *self.connection(),
                "--engine-endpoint", self.zmq_publish[i],
                "--replay-endpoint", self.zmq_replay[i],
                "--engine-url", self.engine_urls[i],
                "--worker-name", f"engine-{i}",
                "--metrics-interval-ms", "100"],
                ready="registered the engine's block size and capacity"))

    def _start_engines(self) -> None:
        s = self.shape
        n = s.workers
        base = free_port_block(3 * n)
        self.engines = self.stack.spawn("engines", [
            str(self.bins.kv_mocker), "engines", "--kv-events", "vllm",
            "--workers", str(n), "--block-size", str(s.block_size),
            "--num-gpu-blocks", str(s.num_gpu_blocks), "--time-scale", str(s.time_scale),
            "--http-port", str(base), "--zmq-port", str(base + n),
            "--zmq-replay-port", str(base + 2 * n),
            "--model-dir", str(self.model_dir), "--served-model-name", MODEL,
            "--vllm-dev-mode"],
            ready="kv-mocker engines ready")
        self.engine_urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]
        self.zmq_publish = [f"tcp://127.0.0.1:{base + n + i}" for i in range(n)]
        self.zmq_replay = [f"tcp://127.0.0.1:{base + 2 * n + i}" for i in range(n)]

    def start_router(self, policy: str) -> Child:
        """``kv-router serve --policy <policy>`` (block size adopted from the engines)."""
        return self.stack.spawn(f"router-{policy}", [
            str(self.bins.kv_router), "serve", *self.connection(),
            "--http-listen", "127.0.0.1:0", "--http-debug-listen", "main",
            "--policy", policy], ready="kv-router ready", serving=True)

    def reset_prefix_caches(self) -> None:
        """vLLM's ``POST /reset_prefix_cache`` on every engine (a development endpoint:
        the engines run with ``--vllm-dev-mode``, as vLLM with VLLM_SERVER_DEV_MODE=1);
        an engine still busy (``{"success": false}``) is asked again until
        ``RESET_DEADLINE_S``. Then a one-token request on each, because vLLM publishes
        ``AllBlocksCleared`` only with its next engine step."""
        deadline = time.monotonic() + RESET_DEADLINE_S
        pending = list(self.engine_urls)
        while pending:
            busy = []
            for url in pending:
                status, body = http("POST", f"{url}/reset_prefix_cache", b"")
                refused = status == 200 and body.strip() and json.loads(body).get("success") is False
                if status in (409, 500) or refused:
                    busy.append(url)
                elif status != 200:
                    raise ChildError(f"{url}/reset_prefix_cache: {status} {body[:200]!r}")
            if busy and time.monotonic() > deadline:
                raise ChildError(f"engines still busy after {RESET_DEADLINE_S:.0f} s: {busy}")
            pending = busy
            if busy:
                # Requests cancelled by the client are freed at the engine's next step.
                time.sleep(0.5)
        nudge = json.dumps({"model": MODEL, "prompt": [0], "max_tokens": 1}).encode()
        for url in self.engine_urls:
            status, body = http("POST", f"{url}/v1/completions", nudge)
            if status != 200:
                raise ChildError(f"{url}/v1/completions: {status} {body[:200]!r}")

    def counts(self) -> list[EngineCounts]:
        """Every engine's counters now, in engine order."""
        return [parse_counts(http("GET", f"{url}/metrics")[1].decode()) for url in self.engine_urls]

    def stop(self) -> None:
        self.stack.stop_all()
        self._tmp.cleanup()


def start_nats_etcd(stack: Stack, nats_server: Path, etcd: Path,
                    tmp: Path) -> tuple[str, str]:
    """nats-server (with JetStream) and a one-member etcd on free loopback ports, data
    under ``tmp``, each waited for; their URLs ``(nats://…, http://…)``."""
    port = free_port()
    stack.spawn("nats", [str(nats_server), "-a", "127.0.0.1", "-p", str(port), "-js",
                         "-sd", str(tmp / "nats")], ready="Server is ready", serving=True)
    client, peer = free_port(), free_port()
    stack.spawn("etcd", [
        str(etcd), "--name", "default", "--data-dir", str(tmp / "etcd"),
        "--listen-client-urls", f"http://127.0.0.1:{client}",
        "--advertise-client-urls", f"http://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
        ready="ready to serve client requests")
    return f"nats://127.0.0.1:{port}", f"http://127.0.0.1:{client}"


def parse_counts(metrics: str) -> EngineCounts:
    """Sums vLLM's prefix-cache and success counters over an engine's dp ranks."""
    names = {
        "vllm:prefix_cache_queries_total": "queries",
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:request_success_total": "finished",
    }
    counts = EngineCounts()
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            field = names[name]
            setattr(counts, field, getattr(counts, field) + float(line.rsplit(" ", 1)[1]))
    return counts


def engine_report(before: list[EngineCounts], after: list[EngineCounts]) -> dict:
    """Per-engine requests and the cached ratio between two readings."""
    per_engine = [round(a.finished - b.finished) for a, b in zip(after, before)]
    queries = sum(a.queries - b.queries for a, b in zip(after, before))
    hits = sum(a.hits - b.hits for a, b in zip(after, before))
    return {
        "requests_per_engine": per_engine,
        "prompt_tokens": queries,
        "cached_tokens": hits,
        "cached_ratio": hits / queries if queries else 0.0,
    }

