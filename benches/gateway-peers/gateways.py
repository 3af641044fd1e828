"""The gateways under test, one row each, and how each is started.

Every row serves the same model name on a free loopback port in front of the same
engines. kv-router rows start their own router (``kv-router serve --policy …``) so
that each row's router begins from the cold caches the row starts with; the peers
take the engines' URLs (``--worker-urls``), as they would take vLLM's.

Where each row tokenizes matters for both CPU and routing: kv-router hashes token
ids, so it tokenizes before routing (in process, or through the engine's
``/tokenize``); SMG and vllm-router ``cache_aware`` route on the prompt's text (an
approximate character tree) and leave tokenization to the engine.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cluster import MODEL, Cluster
from procs import Child, free_port


@dataclass(frozen=True)
class Row:
    """One gateway configuration."""

    key: str
    """Short name, as ``--rows`` takes it."""
    label: str
    """Table label."""
    tokenizes: str
    """Where prompts are tokenized."""
    kind: str
    """``kv-router``, ``smg`` or ``vllm-router``."""
    router_policy: str = "predicted-ttft"
    """kv-router rows: the router's ``--policy``."""
    flags: tuple[str, ...] = ()
    """Extra gateway flags (kv-router) or the peer's ``--policy`` and options."""
    kv_events: bool = False
    """vllm-router ``kv_aware``: subscribes to every engine's ZMQ KV events itself."""


ROWS: list[Row] = [
    Row("kv-default", "kv-router default", "gateway (local), token ids to the engine",
        "kv-router"),
    Row("kv-no-cache", "kv-router --tokenizer-cache-mib 0",
        "gateway (local, no tokenizer cache), token ids to the engine", "kv-router",
        flags=("--tokenizer-cache-mib", "0")),
    Row("kv-text", "kv-router --forward text", "gateway (local) to route; engine again",
        "kv-router", flags=("--forward", "text")),
    Row("kv-engine-tok", "kv-router --tokenize-via engine",
        "engine (/tokenize), token ids to the engine", "kv-router",
        flags=("--tokenize-via", "engine")),
    Row("kv-round-robin", "kv-router round robin", "gateway (local), token ids to the engine",
        "kv-router", router_policy="round-robin"),
    Row("smg", "SMG cache_aware", "engine only (routes on text)", "smg",
        flags=("--policy", "cache_aware")),
    Row("vllm-router", "vllm-router cache_aware", "engine only (routes on text)",
        "vllm-router", flags=("--policy", "cache_aware")),
    Row("vllm-router-kv", "vllm-router kv_aware", "router (local) to route; engine again",
        "vllm-router", flags=("--policy", "kv_aware"), kv_events=True),
]

ROW_KEYS = [r.key for r in ROWS]
#: Rows run unless ``--rows`` says otherwise. vllm-router ``kv_aware`` is left out:
#: on these engines it sends every request to one engine (see README.md).
DEFAULT_ROWS = [k for k in ROW_KEYS if k not in ("vllm-router-kv", "kv-no-cache")]
#: Rows of the overhead pass: the router's policy does not change the gateway's cost.
DEFAULT_OVERHEAD_ROWS = [k for k in DEFAULT_ROWS if k != "kv-round-robin"]

READY_TIMEOUT_S = 120.0


@dataclass
class Running:
    """A started row: its URL, the gateway's process group and the router's (if any)."""

    url: str
    gateway: Child
    router: Child | None = None
    command: list[str] = field(default_factory=list)


def start(row: Row, cluster: Cluster, model_dir: Path) -> Running:
    """Starts ``row`` in front of ``cluster``'s engines and waits until it is ready."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    bins = cluster.bins
    stack = cluster.stack
    if row.kind == "kv-router":
        router = cluster.start_router(row.router_policy)
        argv = [str(bins.kv_router), "gateway", *cluster.connection(),
                "--listen", f"127.0.0.1:{port}", "--served-model-name", MODEL, *row.flags]
        if "engine" not in row.flags:
            argv += ["--model-dir", str(model_dir)]
        gateway = stack.spawn(f"gateway-{row.key}", argv, ready="kv-router gateway ready",
                              ready_timeout_s=READY_TIMEOUT_S, serving=True)
        return Running(url, gateway, router, argv)
    if row.kind == "smg":
        # As a user runs it: no model path (SMG routes on text and loads no tokenizer).
        argv = [str(bins.smg), "launch", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *cluster.engine_urls, *row.flags,
                "--prometheus-port", str(free_port())]
        # SMG serves at once and registers the workers in the background.
        gateway = stack.spawn(f"gateway-{row.key}", argv, ready=SMG_WORKER_READY,
                              ready_count=len(cluster.engine_urls),
                              ready_timeout_s=READY_TIMEOUT_S, serving=True)
        return Running(url, gateway, None, argv)
    if row.kind == "vllm-router":
        argv = [str(bins.vllm_router), "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *cluster.engine_urls, *row.flags,
                "--prometheus-port", str(free_port())]
        if row.kv_events:
            for url, pub, replay in zip(cluster.engine_urls, cluster.zmq_publish,
                                        cluster.zmq_replay):
                argv += ["--kv-event-source", f"{url}={pub}",
                         "--kv-event-replay-source", f"{url}={replay}"]
            argv += ["--kv-event-block-size", str(cluster.shape.block_size),
                     "--kv-event-model", str(model_dir)]
        gateway = stack.spawn(f"gateway-{row.key}", argv, ready=VLLM_ROUTER_READY,
                              ready_timeout_s=READY_TIMEOUT_S, serving=True)
        return Running(url, gateway, None, argv)
    raise ValueError(f"unknown gateway kind {row.kind}")


def scrape(running: Running) -> dict[str, float]:
    """A kv-router gateway's ``/metrics`` samples, ``name{labels}`` → value; empty for
    the peers."""
    if running.router is None:
        return {}
    with urllib.request.urlopen(f"{running.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^(\S+) (\S+)$", line)
        if match and not line.startswith("#"):
            samples[match[1]] = float(match[2])
    return samples


def stop(running: Running, cluster: Cluster) -> None:
    cluster.stack.stop(running.gateway)
    if running.router:
        cluster.stack.stop(running.router)


# The log lines the peers print once they serve, checked with smg 1.13.0 and
# vllm-router 0.1.17 (SMG: once per worker registered).
SMG_WORKER_READY = r"Activated 1 of 1 worker"
VLLM_ROUTER_READY = r"Starting server on"
