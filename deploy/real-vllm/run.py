#!/usr/bin/env python3
"""kv-router in front of two real vLLM servers on this machine's CPU: the opt-in
real-engine test tier (issue 25). Not part of ``deploy/test.sh``: the first run
installs about 6 GB and a run takes 3-5 minutes on 2 cores.

    python3 deploy/real-vllm/run.py            # builds kv-router (release) first
    python3 deploy/real-vllm/run.py --no-build # uses target/release/kv-router as is
    python3 deploy/real-vllm/run.py --pd       # prefill/decode over NIXL
    python3 deploy/real-vllm/run.py --hybrid   # a sliding-window + full-attention model

Steps: the venv (``install.py``, reused), a tiny random-weight Llama and tokenizer
(``model.py``, no download), nats-server + etcd + 2 vLLM + 2 relays + router +
gateway (``stack.py``), then the checks (``checks.py``): token parity, prefix reuse,
eviction, a relay restarted beside an idle engine with a long history, an engine
killed and back (``--pd``: ``pd.py``, ``pd_gateway.py``; ``--hybrid``: ``hybrid.py``).
Prints a table of figures; exits 1 if a check failed, 2 if the
cluster could not be brought up. Every process is stopped on exit, Ctrl-C included;
logs stay in ``target/real-vllm/logs``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
# No __pycache__ in the checkout, here nor in the processes started (nixl_poll/).
sys.dont_write_bytecode = True
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"

import install  # noqa: E402

IN_VENV = "KV_REAL_VLLM_IN_VENV"


def log(msg: str) -> None:
    print(f"[real-vllm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-build", action="store_true",
                   help="do not run cargo build --release -p kv-router")
    p.add_argument("--kv-router", type=Path, default=None,
                   help="kv-router binary to run (then nothing is built); default: "
                        "$CARGO_TARGET_DIR or target/, release/kv-router")
    p.add_argument("--out", type=Path, default=REPO / "target" / "real-vllm",
                   help="venv, models, logs (default: target/real-vllm)")
    p.add_argument("--venv", type=Path, default=None,
                   help="an existing vLLM venv made by install.py (its pins marker must "
                        "match; it is never replaced); default: <out>/venv, installed "
                        "or replaced as needed")
    p.add_argument("--prompts", type=int, default=6,
                   help="prompts of the parity / reuse check (each sent 3 times)")
    p.add_argument("--history", type=int, default=3000,
                   help="requests sent straight to one engine before its relay restarts")
    p.add_argument("--relay-restarts", type=int, default=3,
                   help="times that engine's relay is stopped and started beside it")
    p.add_argument("--seed", type=int, default=1)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--pd", action="store_true",
                      help="the prefill/decode mode: 2 prefill + 1 decode vLLM joined by "
                           "NIXL (pd.py) instead of 2 aggregated engines")
    mode.add_argument("--hybrid", action="store_true",
                      help="the hybrid-attention mode: 1 vLLM serving a tiny Gemma-3 (3 "
                           "sliding-window layers + 1 full) with its hybrid KV cache "
                           "manager (hybrid.py) instead of 2 aggregated engines")
    p.add_argument("--nixl-poll-delay-us", type=int, default=1000,
                   help="with --pd: poll timeout of NIXL's progress thread, us (0: NIXL's "
                        "own zero timeout, which spins a core per instance)")
    p.add_argument("--engines-only", action="store_true",
                   help="with --pd: only the vLLM servers and the transfer run by hand "
                        "(no kv-router, nothing built)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if os.environ.get(IN_VENV) != "1":
        # Stage 1, system python: build, install, then run again inside the venv.
        if not args.no_build and args.kv_router is None and not args.engines_only:
            log("cargo build --release -p kv-router")
            subprocess.run(["cargo", "build", "--release", "-p", "kv-router"],
                           cwd=REPO, check=True)
        python = install.ensure(args.venv or args.out / "venv", log,
                                replace=args.venv is None)
        os.environ[IN_VENV] = "1"
        os.execv(str(python), [str(python), __file__, *sys.argv[1:]])
    return run_in_venv(args)


def run_in_venv(args: argparse.Namespace) -> int:
    from stack import ChildError, Cluster

    # No hub, no telemetry; vLLM's dev endpoints (/reset_prefix_cache); a small KV
    # space so the servers fit beside the other work on this machine.
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                       "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1",
                       "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    # Ctrl-C and SIGTERM stop every child (also when started where SIGINT is ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    kv_router = args.kv_router or \
        Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release" / "kv-router"
    if not kv_router.exists() and not args.engines_only:
        log(f"{kv_router} is missing: run without --no-build")
        return 2
    kind = PdMode if args.pd else HybridMode if args.hybrid else AggregatedMode
    model_dir, shape = kind.served(args.out, log)
    cluster = Cluster(args.out, kv_router, Path(sys.executable), model_dir, shape, log,
                      nixl_poll_delay_us=args.nixl_poll_delay_us)
    mode = kind(cluster, args)
    try:
        log(f"starting {mode.processes} (minutes)")
        started = time.monotonic()
        try:
            mode.start()
        except ChildError as err:
            log(f"the cluster did not come up: {err}")
            return 2
        log(f"cluster up in {time.monotonic() - started:.0f} s")
        outcomes = mode.run()
    except KeyboardInterrupt:
        log("interrupted; stopping every process")
        return 130
    finally:
        cluster.stop()
    report(outcomes)
    return 1 if any(o.failures for o in outcomes) else 0


def run_steps(steps) -> list:
    """Each ``(name, step)`` in turn; an exception is that check's failure."""
    from checks import Outcome

    outcomes = []
    for name, step in steps:
        try:
            outcome = step()
        except Exception as err:  # noqa: BLE001 - reported as that check's failure
            outcome = Outcome(name, failures=[f"{type(err).__name__}: {err}"])
        log(f"{outcome.name}: {'ok' if not outcome.failures else 'FAILED'}")
        outcomes.append(outcome)
    return outcomes


def llama(out: Path, log):
    """The tiny Llama and the engine shape of the aggregated and prefill/decode modes."""
    import model
    from stack import EngineShape

    return (model.make(out / "model", log),
            EngineShape(block_size=32, num_blocks=96, max_model_len=1024))


class AggregatedMode:
    """Two aggregated engines: token parity, reuse, eviction, relay and engine restarts."""

    processes = "nats-server, etcd, 2 vLLM servers, relays, router, gateway"
    served = staticmethod(llama)

    def __init__(self, cluster, args: argparse.Namespace):
        self.cluster, self.args = cluster, args

    def start(self) -> None:
        from stack import Role

        self.cluster.start([Role.BOTH, Role.BOTH])

    def run(self) -> list:
        import checks

        cluster, args = self.cluster, self.args
        client = checks.Client(cluster, args.seed)
        parity = checks.Parity(cluster.shape.block_size)
        first = [client.prompt(300 + 40 * i) for i in range(args.prompts)]
        outcomes = run_steps([
            ("parity and reuse", lambda: checks.parity_and_reuse(client, parity, first)),
            ("eviction", lambda: checks.eviction(client, parity, first, fill_tokens=700)),
            ("relay restart", lambda: checks.relay_restart(
                client, parity, cluster.engines[1], args.history, args.relay_restarts,
                tokens=100)),
            ("engine restart", lambda: checks.engine_restart(
                client, parity, cluster.engines[0], tokens=200)),
        ])
        total = checks.Outcome("token parity over every request")
        total.figures["requests with overlap × block size = cached_tokens"] = \
            f"{parity.checked - len(parity.mismatches)}/{parity.checked}"
        total.figures["of which the engine found cached blocks"] = parity.with_overlap
        total.failures.extend(parity.mismatches)
        return [total, *outcomes]


class PdMode:
    """Two prefill and one decode vLLM joined by NIXL: the transfer by hand, then
    (unless ``--engines-only``) disaggregated requests through the gateway."""

    ROLES = ("prefill", "prefill", "decode")
    served = staticmethod(llama)

    def __init__(self, cluster, args: argparse.Namespace):
        self.cluster, self.args = cluster, args
        self.processes = "2 prefill + 1 decode vLLM servers" + (
            "" if args.engines_only else ", nats-server, etcd, relays, router, gateway")

    def start(self) -> None:
        from pd_gateway import ROUTER_FLAGS
        from stack import Role

        roles = [Role(r) for r in self.ROLES]
        if self.args.engines_only:
            self.cluster.start_engines(roles)
        else:
            self.cluster.start(roles, ROUTER_FLAGS)

    def run(self) -> list:
        import checks
        import pd
        import pd_gateway

        cluster = self.cluster
        client = checks.Client(cluster, self.args.seed)
        prompts = [client.prompt(300 + 200 * i) for i in range(3)]
        steps = [("by hand", lambda: pd.engines_by_hand(cluster.engines, prompts,
                                                        cluster.shape.block_size))]
        if not self.args.engines_only:
            steps.append(("through the gateway",
                          lambda: pd_gateway.through_gateway(cluster, self.args.seed + 1)))
        return run_steps(steps)


class HybridMode:
    """One engine serving a hybrid-attention model: token parity on repeats,
    prefix-sharing prompts, duplicate blocks and after eviction."""

    processes = ("nats-server, etcd, 1 vLLM server (hybrid KV cache manager), relay, "
                 "router, gateway")

    def __init__(self, cluster, args: argparse.Namespace):
        self.cluster, self.args = cluster, args

    @staticmethod
    def served(out: Path, log):
        """The tiny Gemma-3, with 136 blocks: its 4 KV cache groups share one pool, and
        vLLM refuses to start it with 96 at 1,024 tokens (it counts each sliding-window
        group as needing a whole context too)."""
        import model
        from stack import EngineShape

        return (model.make_hybrid(out / "model-hybrid", log),
                EngineShape(block_size=32, num_blocks=136, max_model_len=1024))

    def start(self) -> None:
        from stack import Role

        self.cluster.start([Role.BOTH])

    def run(self) -> list:
        import hybrid

        return hybrid.run(self.cluster, self.args.seed)


def report(outcomes) -> None:
    print("\n| check | figure | value |\n|---|---|---|")
    for o in outcomes:
        for key, value in o.figures.items():
            print(f"| {o.name} | {key} | {value} |")
    failed = [(o.name, f) for o in outcomes for f in o.failures]
    print(f"\n{sum(not o.failures for o in outcomes)} passed, "
          f"{sum(bool(o.failures) for o in outcomes)} failed")
    for name, failure in failed:
        print(f"FAILED {name}: {failure}")


if __name__ == "__main__":
    sys.exit(main())
