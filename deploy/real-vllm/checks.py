"""The checks, each against the running cluster, each returning figures and failures.

Every request goes through the gateway with the ``openai`` client; the router's view
of it is the gateway's response headers (``x-kv-router-worker-id``,
``x-kv-router-overlap-blocks``) and vLLM's is ``usage.prompt_tokens_details
.cached_tokens`` (``--enable-prompt-tokens-details``). Prompts are generated so that
their token count is never a multiple of the block size: vLLM always recomputes a
prompt's last token, so a block-aligned prompt's last block is never a cache hit and
would make overlap × block size exceed ``cached_tokens`` by design.

The router learns of blocks from the engine's KV events, asynchronously: a request
sent within milliseconds of the one that stored its prefix may see less overlap than
the engine has. Dependent requests are therefore sent ``SETTLE_S`` apart.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from model import count_tokens, words
from stack import MODEL, Cluster, Engine, http

SETTLE_S = 0.5
ROUTABLE_DEADLINE_S = 120.0
ROUTABLE_BOUND_S = 3.0
"""Issue 25's bound from engine healthy to routable (finding 4: the relay's ZMQ
reconnect backoff grew to 30 s)."""
HISTORY_CONCURRENCY = 2
"""Requests in flight while the history is made (vLLM batches concurrent ones into
one step, so one KV event batch)."""
STABLE_S = 2.0
"""The router's block count must hold this long to count as caught up."""


@dataclass
class Sample:
    """One request as the router and the engine saw it."""

    worker: int
    overlap_blocks: int
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Outcome:
    """A check's figures (name → value, printed) and failures (sentences)."""

    name: str
    figures: dict[str, object] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def expect(self, ok: bool, failure: str) -> None:
        if not ok:
            self.failures.append(failure)


class Client:
    """The ``openai`` client on the gateway, plus the prompt maker."""

    def __init__(self, cluster: Cluster, seed: int):
        from openai import OpenAI  # only the venv has it

        self.cluster = cluster
        self.bs = cluster.shape.block_size
        self.rng = random.Random(seed)
        self.openai = OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused",
                             max_retries=0, timeout=300.0)

    def prompt(self, tokens: int, prefix: str = "") -> str:
        """Fresh text of about ``tokens`` tokens (BOS included), never block-aligned."""
        text = prefix
        while True:
            n = count_tokens(self.cluster.model_dir, text) if text else 1
            if n >= tokens and n % self.bs:
                return text
            text = f"{text} {' '.join(words(self.rng, 1 if n >= tokens else 8))}".strip()

    def send(self, prompt: str | list[int]) -> Sample:
        """One completion through the gateway (2 tokens out); ``prompt`` is text or
        token ids."""
        raw = self.openai.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0)
        usage = raw.parse().usage
        details = usage.prompt_tokens_details
        return Sample(
            worker=int(raw.headers["x-kv-router-worker-id"]),
            overlap_blocks=int(raw.headers["x-kv-router-overlap-blocks"]),
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=(details.cached_tokens or 0) if details else 0)

    def send_settled(self, prompt: str | list[int]) -> Sample:
        sample = self.send(prompt)
        time.sleep(SETTLE_S)
        return sample


class Parity:
    """Counts requests whose router overlap × block size equals vLLM's cached tokens."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.checked = 0
        self.with_overlap = 0
        """Requests where the engine found cached blocks (the non-trivial comparisons)."""
        self.mismatches: list[str] = []

    def add(self, where: str, s: Sample) -> Sample:
        self.checked += 1
        self.with_overlap += s.cached_tokens > 0
        if s.overlap_blocks * self.bs != s.cached_tokens:
            self.mismatches.append(
                f"{where}: router overlap {s.overlap_blocks} blocks × {self.bs} != vLLM "
                f"cached_tokens {s.cached_tokens} (prompt {s.prompt_tokens} tokens, "
                f"worker {s.worker})")
        return s


def parity_and_reuse(client: Client, parity: Parity, prompts: list[str]) -> Outcome:
    """Each prompt twice, then a prompt sharing its first half: the repeat goes to the
    engine that served it with every full block found; overlap × block size equals
    ``cached_tokens`` on every request."""
    out = Outcome("token parity, prefix reuse")
    bs = client.bs
    reused = 0
    for i, prompt in enumerate(prompts):
        first = parity.add(f"prompt {i} first", client.send_settled(prompt))
        again = parity.add(f"prompt {i} again", client.send_settled(prompt))
        full = first.prompt_tokens // bs
        out.expect(again.worker == first.worker,
                   f"prompt {i}: repeat went to worker {again.worker}, "
                   f"its blocks are on {first.worker}")
        out.expect(again.overlap_blocks == full,
                   f"prompt {i}: repeat overlap {again.overlap_blocks} blocks, expected {full}")
        reused += again.worker == first.worker and again.overlap_blocks == full
        half = prompt[: len(prompt) // 2]
        branch = parity.add(f"prompt {i} branch",
                            client.send_settled(client.prompt(first.prompt_tokens, half)))
        out.expect(branch.worker == first.worker and branch.overlap_blocks > 0,
                   f"prompt {i}: a prompt sharing its first half went to worker "
                   f"{branch.worker} with overlap {branch.overlap_blocks}")
    out.figures["repeats routed to their engine, full overlap"] = f"{reused}/{len(prompts)}"
    return out


def eviction(client: Client, parity: Parity, old: list[str], fill_tokens: int) -> Outcome:
    """Distinct prompts worth 4× the cluster's KV capacity, then the old prompts again:
    vLLM evicted them, and the router's overlap for them is gone too (= cached)."""
    out = Outcome("eviction")
    shape = client.cluster.shape
    capacity = shape.num_blocks * len(client.cluster.engines)
    fills = -(-4 * capacity * shape.block_size // fill_tokens)
    for i in range(fills):
        parity.add(f"fill {i}", client.send_settled(client.prompt(fill_tokens)))
    lost = 0
    for i, prompt in enumerate(old):
        s = parity.add(f"old prompt {i} after the fill", client.send_settled(prompt))
        lost += s.overlap_blocks == 0 and s.cached_tokens == 0
    out.figures["fill requests (4x KV capacity)"] = fills
    out.figures["old prompts evicted in engine and router"] = f"{lost}/{len(old)}"
    out.expect(lost == len(old), f"only {lost} of {len(old)} old prompts lost their "
               "overlap after 4x the KV capacity went through")
    return out


def engine_restart(client: Client, parity: Parity, engine: Engine, tokens: int) -> Outcome:
    """SIGKILL one engine: requests fail over to the other. Start it again: measure
    engine healthy → listed by the router, then a request is served there again."""
    out = Outcome(f"engine {engine.index} killed and back")
    cluster = client.cluster
    cluster.kill_engine(engine)
    retries_before = gateway_retries(cluster)
    served = []
    for i in range(6):
        try:
            served.append(parity.add(f"while down {i}", client.send(client.prompt(tokens))).worker)
        except Exception as err:  # noqa: BLE001 - every failure is a finding here
            out.failures.append(f"request {i} with engine {engine.index} down failed: {err}")
    out.figures["requests while down: served / sent"] = f"{len(served)}/6"
    out.figures["gateway failovers meanwhile"] = round(gateway_retries(cluster) - retries_before)
    out.expect(engine.worker_id not in served,
               f"a request was answered by the killed worker {engine.worker_id}")
    started = time.monotonic()
    cluster.spawn_engine(engine)
    healthy = cluster.wait_engine(engine)
    out.figures["engine start → healthy, s"] = round(healthy - started, 1)
    routable = None
    while time.monotonic() < healthy + ROUTABLE_DEADLINE_S:
        rank = cluster.workers().get(engine.worker_id)
        if rank is not None and rank["liveness"] in ("live", "never_reported"):
            routable = time.monotonic()
            break
        time.sleep(0.05)
    if routable is None:
        out.failures.append(f"worker {engine.worker_id} not routable "
                            f"{ROUTABLE_DEADLINE_S:.0f} s after its engine was healthy")
        return out
    out.figures["engine healthy → routable, s"] = round(routable - healthy, 2)
    out.expect(routable - healthy <= ROUTABLE_BOUND_S,
               f"worker {engine.worker_id} became routable {routable - healthy:.1f} s after "
               f"its engine was healthy, over the {ROUTABLE_BOUND_S:.0f} s bound (issue 25 "
               "finding 4: the relay's reconnect backoff)")
    for i in range(12):
        if parity.add(f"after restart {i}", client.send_settled(client.prompt(tokens))).worker \
                == engine.worker_id:
            out.figures["requests until served by it again"] = i + 1
            break
    else:
        out.failures.append(f"12 fresh prompts after the restart, none went to worker "
                            f"{engine.worker_id}")
    return out


def relay_restart(client: Client, parity: Parity, engine: Engine, history: int,
                  restarts: int, tokens: int) -> Outcome:
    """``history`` requests straight to one engine, then its relay stopped and started
    ``restarts`` times beside the idle engine: each time the relay reads the engine's
    whole replay buffer and the router's picture (blocks it indexes for the worker,
    overlap of the newest prompts) is what it was before."""
    out = Outcome(f"relay {engine.index} restarted beside an idle engine")
    cluster = client.cluster
    frames_before = sum(cluster.relay_metric(engine, "kv_relay_frames_total").values())
    prompts = [client.prompt(tokens) for _ in range(history)]
    from openai import OpenAI

    direct = OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0,
                    timeout=300.0)
    with ThreadPoolExecutor(HISTORY_CONCURRENCY) as pool:
        list(pool.map(lambda p: direct.completions.create(
            model=MODEL, prompt=p, max_tokens=1, temperature=0.0), prompts))
    batches = sum(cluster.relay_metric(engine, "kv_relay_frames_total").values()) - frames_before
    out.figures["history: requests / engine batches"] = f"{history} / {batches:.0f}"
    before = stable_blocks(cluster, engine)
    afters, reads, complete = [], [], 0
    for i in range(restarts):
        cluster.stop_relay(engine)
        out.expect(engine.worker_id not in cluster.workers(),
                   f"restart {i}: worker {engine.worker_id} still listed after its relay stopped")
        cluster.start_relay(engine)
        afters.append(stable_blocks(cluster, engine))
        replays = {k: v for k, v in cluster.relay_metric(
            engine, "kv_relay_connect_replays_total").items() if v}
        reads.append(cluster.relay_replay_read(engine))
        complete += set(replays) == {'{result="complete"}'}
        out.expect(set(replays) == {'{result="complete"}'},
                   f"restart {i}: the relay's replay read was {replays or 'not made'}, not "
                   f"complete ({reads[-1]}; issue 25 finding 3: vLLM's lossy "
                   "replay, read as a trimmed buffer)")
        out.expect(afters[-1] == before,
                   f"restart {i}: the router indexes {afters[-1]} blocks for worker "
                   f"{engine.worker_id}, {before} before the restart")
    out.figures["replay reads complete"] = f"{complete}/{restarts}"
    out.figures["replay reads as the relay logged them"] = "; ".join(sorted(set(reads)))
    out.figures["router blocks before / after each restart"] = \
        f"{before} / {', '.join(map(str, afters))}"
    hits = 0
    newest = prompts[-8:]
    for i, prompt in enumerate(newest):
        s = parity.add(f"history prompt -{len(newest) - i}", client.send_settled(prompt))
        hits += s.worker == engine.worker_id and s.overlap_blocks == s.prompt_tokens // client.bs
    out.figures["newest history prompts routed back with full overlap"] = f"{hits}/{len(newest)}"
    out.expect(hits == len(newest), f"{len(newest) - hits} of the {len(newest)} newest "
               "history prompts did not find their blocks through the router")
    return out


def gateway_retries(cluster: Cluster) -> float:
    """The gateway's ``kv_gateway_retries_total``, every reason."""
    _, body = http("GET", f"{cluster.gateway_url}/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith("kv_gateway_retries_total"))


def stable_blocks(cluster: Cluster, engine: Engine) -> int | None:
    """The router's block count for ``engine`` once it held for ``STABLE_S``."""
    deadline = time.monotonic() + ROUTABLE_DEADLINE_S
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        rank = cluster.workers().get(engine.worker_id)
        now = rank["indexed_blocks"] if rank else None
        if now != last:
            last, since = now, time.monotonic()
        elif now is not None and time.monotonic() - since >= STABLE_S:
            return now
        time.sleep(0.1)
    return last

