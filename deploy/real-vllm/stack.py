"""The processes of the real-vLLM tier: nats-server and etcd on free loopback ports,
vLLM CPU servers with KV events on (two aggregated ones, or in the prefill/decode mode
prefill and decode instances joined by vLLM's ``NixlConnector``), one ``kv-router
relay`` per engine, the router (``kv-router serve``) and ``kv-router gateway``.

Process handling (own process groups, logs under ``<out>/logs``, readiness read from
the log, SIGTERM then SIGKILL, children that die with the script), nats-server and etcd
are the gateway benchmark's (``procs.py``, ``cluster.py``), imported from
``benches/gateway-peers``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "benches" / "gateway-peers"))

from cluster import http, start_nats_etcd  # noqa: E402
from procs import Child, ChildError, Stack, free_port, free_port_block  # noqa: E402
from tools import require  # noqa: E402

NAMESPACE = "real-vllm"
MODEL = "tiny"
"""The served model name of every engine and the gateway (whichever tiny model)."""

ENGINE_READY_S = 900.0
"""vLLM's start on this CPU (import, model load, profiling) takes minutes."""

KV_ROUTER_READY_S = 60.0
HEALTH_AFTER_READY_S = 30.0
VLLM_READY = r"Application startup complete"
NIXL_POLL = Path(__file__).resolve().parent / "nixl_poll"
"""A ``sitecustomize`` giving NIXL's progress thread a poll timeout (its docstring says why)."""


@dataclass(frozen=True)
class EngineShape:
    """What both vLLM servers are started with."""

    block_size: int
    """Tokens per KV block (the CPU attention backend needs a multiple of 32)."""
    num_blocks: int
    """KV capacity per engine, blocks (``--num-gpu-blocks-override``)."""
    max_model_len: int
    """Context length, tokens."""


class Role(Enum):
    """What an engine does: kv-router's worker role (``--role`` of the relay)."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def kv_role(self) -> str | None:
        """vLLM's ``kv_role`` of the ``NixlConnector``; None: no connector."""
        return {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}.get(self)


PORTS_PER_ENGINE = 4
"""HTTP, KV events, KV events replay, NIXL side channel."""


@dataclass
class Engine:
    """One vLLM server and its ports; ``child`` is None while it is down."""

    index: int
    worker_id: int
    http_port: int
    pub_port: int
    replay_port: int
    nixl_port: int
    """``VLLM_NIXL_SIDE_CHANNEL_PORT``: where a decode instance fetches this prefill
    instance's NIXL metadata (unused without a role)."""
    role: Role = Role.BOTH
    child: Child | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


class Cluster:
    """Everything the checks talk to, started in dependency order."""

    def __init__(self, out: Path, kv_router: Path, venv_python: Path, model_dir: Path,
                 shape: EngineShape, log, nixl_poll_delay_us: int = 0):
        shutil.rmtree(out / "logs", ignore_errors=True)
        self.stack = Stack(out / "logs")
        self.kv_router = kv_router
        self.python = venv_python
        self.model_dir = model_dir
        self.shape = shape
        self.log = log
        self.nixl_poll_delay_us = nixl_poll_delay_us
        """NIXL progress thread's poll timeout, us (``nixl_poll/``); 0: NIXL's busy poll."""
        self._tmp = tempfile.TemporaryDirectory(prefix="real-vllm-")
        self.nats_url = self.etcd_url = self.gateway_url = self.router_url = ""
        self.engines: list[Engine] = []
        self.relays: dict[int, Child] = {}
        self.relay_http: dict[int, int] = {}

    # --- infrastructure --------------------------------------------------------------

    def connection(self) -> list[str]:
        return ["--nats-url", self.nats_url, "--etcd-endpoints", self.etcd_url,
                "--namespace", NAMESPACE]

    def start(self, roles: list[Role], router_flags: list[str] = ()) -> None:
        """Every process: an engine of each role in ``roles`` (worker ids from 1), its
        relay, the router (with ``router_flags``) and the gateway."""
        self.start_engines(roles)
        self.nats_url, self.etcd_url = start_nats_etcd(
            self.stack, require("nats-server"), require("etcd"), Path(self._tmp.name))
        for engine in self.engines:
            self.start_relay(engine)
        router_port = free_port()
        self.stack.spawn("router", [
            str(self.kv_router), "serve", *self.connection(),
            "--http-listen", f"127.0.0.1:{router_port}", "--http-debug-listen", "main",
            *router_flags],
            ready="kv-router ready", ready_timeout_s=KV_ROUTER_READY_S)
        self.router_url = f"http://127.0.0.1:{router_port}"
        gateway_port = free_port()
        self.stack.spawn("gateway", [
            str(self.kv_router), "gateway", *self.connection(),
            "--listen", f"127.0.0.1:{gateway_port}", "--served-model-name", MODEL,
            "--model-dir", str(self.model_dir)],
            ready="kv-router gateway ready", ready_timeout_s=KV_ROUTER_READY_S)
        self.gateway_url = f"http://127.0.0.1:{gateway_port}"

    # --- engines ---------------------------------------------------------------------

    def start_engines(self, roles: list[Role]) -> None:
        """The vLLM servers alone, started side by side (their start-up is the slow part)."""
        base = free_port_block(PORTS_PER_ENGINE * len(roles))
        self.engines = [Engine(i, i + 1, *range(base + PORTS_PER_ENGINE * i,
                                                base + PORTS_PER_ENGINE * (i + 1)), role)
                        for i, role in enumerate(roles)]
        for engine in self.engines:
            self.spawn_engine(engine)
        for engine in self.engines:
            self.wait_engine(engine)

    def spawn_engine(self, engine: Engine) -> None:
        """Starts vLLM for ``engine`` (same ports every time) without waiting."""
        s = self.shape
        # vLLM binds only a wildcard endpoint (`tcp://127.0.0.1:N` makes it connect).
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{engine.pub_port}",
                  "replay_endpoint": f"tcp://*:{engine.replay_port}",
                  "topic": "kv-events", "buffer_steps": 10000}
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", MODEL,
                "--host", "127.0.0.1", "--port", str(engine.http_port),
                "--block-size", str(s.block_size),
                "--num-gpu-blocks-override", str(s.num_blocks),
                "--max-model-len", str(s.max_model_len), "--max-num-seqs", "8",
                "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(events)]
        if engine.role.kv_role:
            # The KV pages live in host memory: NIXL moves them from there.
            transfer = {"kv_connector": "NixlConnector", "kv_role": engine.role.kv_role,
                        "kv_buffer_device": "cpu"}
            argv += ["--kv-transfer-config", json.dumps(transfer)]
            # Each instance's own side channel (vLLM's default port is shared).
            env = ["VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1",
                   f"VLLM_NIXL_SIDE_CHANNEL_PORT={engine.nixl_port}"]
            if self.nixl_poll_delay_us:
                env += [f"PYTHONPATH={NIXL_POLL}",
                        f"KV_REAL_VLLM_NIXL_POLL_DELAY_US={self.nixl_poll_delay_us}"]
            argv = ["env", *env, *argv]
        engine.child = self.stack.spawn(f"vllm-{engine.index}", argv, ready=VLLM_READY,
                                        wait=False)

    def wait_engine(self, engine: Engine) -> float:
        """Waits for vLLM's ready line, then for a 200 on ``/health`` (the ready line
        comes a moment before the socket listens); the monotonic time of that 200."""
        assert engine.child is not None
        engine.child.wait_ready(ENGINE_READY_S)
        deadline = time.monotonic() + HEALTH_AFTER_READY_S
        while True:
            try:
                status, body = http("GET", f"{engine.url}/health")
                if status == 200:
                    return time.monotonic()
                failure = f"{status} {body[:200]!r}"
            except OSError as err:
                failure = str(err)
            if time.monotonic() > deadline or not engine.child.running():
                raise ChildError(f"vllm-{engine.index} /health: {failure}")
            time.sleep(0.05)

    def kill_engine(self, engine: Engine) -> None:
        """SIGKILL to the engine's whole process group (API server and EngineCore)."""
        assert engine.child is not None
        os.killpg(engine.child.pgid, signal.SIGKILL)
        self.stack.stop(engine.child)
        engine.child = None

    # --- relays ----------------------------------------------------------------------

    def start_relay(self, engine: Engine) -> None:
        port = self.relay_http.setdefault(engine.worker_id, free_port())
        self.relays[engine.worker_id] = self.stack.spawn(f"relay-{engine.index}", [
            str(self.kv_router), "relay", *self.connection(),
            "--engine-endpoint", f"tcp://127.0.0.1:{engine.pub_port}",
            "--replay-endpoint", f"tcp://127.0.0.1:{engine.replay_port}",
            "--topic", "kv-events", "--engine-url", engine.url,
            "--worker-name", f"vllm-{engine.index}", "--worker-id", str(engine.worker_id),
            "--http-listen", f"127.0.0.1:{port}",
            *(["--role", engine.role.value, "--kv-transfer", "vllm"] if engine.role.kv_role
              else [])],
            ready="registered the engine's block size and capacity",
            ready_timeout_s=KV_ROUTER_READY_S)

    def stop_relay(self, engine: Engine) -> None:
        """SIGTERM (an orderly stop: the registration is revoked at once)."""
        self.stack.stop(self.relays.pop(engine.worker_id))

    def relay_metric(self, engine: Engine, name: str) -> dict[str, float]:
        """Samples of one relay metric, ``{labels}`` → value."""
        _, body = http("GET", f"http://127.0.0.1:{self.relay_http[engine.worker_id]}/metrics")
        samples = {}
        for line in body.decode().splitlines():
            if line.startswith(name):
                key, value = line.rsplit(" ", 1)
                samples[key[len(name):]] = float(value)
        return samples

    def relay_replay_read(self, engine: Engine) -> str:
        """The counts (``batches=``, ``newest=``, ``requests=``: which ones depends on
        the relay's version) of the relay's last log line ``engine replay buffer read
        at connect``; ``none`` if it logged none."""
        found = "none"
        log = self.stack.logs / f"relay-{engine.index}.log"
        for line in log.read_text(errors="replace").splitlines():
            if "engine replay buffer read at connect" in line:
                found = " ".join(re.findall(r"\b(?:batches|newest|requests)=\d+", line))
        return found

    # --- router ----------------------------------------------------------------------

    def workers(self) -> dict[int, dict]:
        """The router's ``/debug/workers``: worker id → its rank 0 (``liveness``,
        ``indexed_blocks``, …), for every worker the router lists (so can route to)."""
        status, body = http("GET", f"{self.router_url}/debug/workers")
        if status != 200:
            raise ChildError(f"router /debug/workers: {status} {body[:200]!r}")
        return {int(w["worker_id"]): w["ranks"][0] for w in json.loads(body)["workers"]}

    def stop(self) -> None:
        self.stack.stop_all()
        self._tmp.cleanup()

