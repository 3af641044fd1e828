"""The prefill/decode mode through kv-router: the gateway runs both halves.

Every request goes through the gateway with the ``openai`` client (streamed). The
router's view is the gateway's response headers (``x-kv-router-disaggregation``: the
decision's reason; ``x-kv-router-prefill-worker-id``); the engines' view is their own
``/metrics``: which prefill instance answered a request (``vllm:request_success``), how
much of the prompt it found cached (``vllm:prefix_cache_hits``), and how many tokens
the decode instance pulled over NIXL (``vllm:external_prefix_cache_hits``). The
router's thresholds (``ROUTER_FLAGS``) keep prompts up to ``LOCAL_PREFILL_TOKENS``
uncached tokens on the decode instance.

A repeated prompt is also held by the decode instance, which stored the pulled blocks
(and published them): it would stay there (``decode_holds_prefix``). To see where its
prefill goes, the decode instance's prefix cache is reset first (vLLM's dev endpoint;
its ``AllBlocksCleared`` event empties the router's picture of it too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from checks import SETTLE_S, Client, Outcome
from model import count_tokens
from pd import DECODE_TOKENS, aggregated_text, metric_sums, openai_on, settled_counters
from stack import MODEL, Cluster, Role, http

LOCAL_PREFILL_TOKENS = 64
ROUTER_FLAGS = ["--disagg-max-local-prefill-tokens", str(LOCAL_PREFILL_TOKENS)]
"""The decode instance prefills a prompt itself when at most this many of its tokens
are uncached there, or when it holds 80 % of its blocks (the default): a fresh prompt of
400 tokens is disaggregated, one of 32 is not, nor is a repeat (less than a block is
uncached) or a prompt of 600 tokens the decode instance holds extended by 80."""

LONG_PROMPTS = (400, 500, 600)
"""Tokens of the fresh prompts sent disaggregated. The last, once the decode instance
holds it, is extended by 80 tokens: more than 80 % of its blocks held, and more than
``LOCAL_PREFILL_TOKENS`` uncached."""

PLANTED_TOKENS = 450
"""Tokens of the prompts put on one prefill instance before the gateway sees them."""

ENGINE_COUNTERS = ("vllm:request_success_total", "vllm:prefix_cache_hits_total",
                   "vllm:external_prefix_cache_hits_total", "vllm:prompt_tokens_total")
BOOKINGS = ("kv_router_worker_active_requests", "kv_router_worker_active_prefill_tokens",
            "kv_router_worker_active_decode_blocks")
BOOKINGS_DEADLINE_S = 10.0
"""Far below the router's request TTL (600 s): bookings gone by then were freed."""


@dataclass
class Served:
    """One request through the gateway, as the router and the engines saw it."""

    reason: str
    """``x-kv-router-disaggregation`` (empty when absent)."""
    prefill_worker: int | None
    """``x-kv-router-prefill-worker-id``."""
    prompt_tokens: int
    text: str
    ttft_s: float
    grew: dict[int, dict[str, float]]
    """Worker id → growth of each ``ENGINE_COUNTERS`` counter on that engine."""

    def answered(self, worker: int) -> bool:
        """Whether the engine of ``worker`` answered a request meanwhile."""
        return self.grew[worker]["vllm:request_success_total"] > 0


class PdClient:
    """The ``openai`` client on the gateway, reading the engines around each request."""

    def __init__(self, cluster: Cluster, seed: int):
        self.base = Client(cluster, seed)
        self.cluster = cluster
        self.decode = next(e for e in cluster.engines if e.role is Role.DECODE)
        self.prefills = [e for e in cluster.engines if e.role is Role.PREFILL]

    def counters(self) -> dict[int, dict[str, float]]:
        return {e.worker_id: settled_counters(e, ENGINE_COUNTERS) for e in self.cluster.engines}

    def send(self, prompt: str) -> Served:
        before = self.counters()
        started = time.monotonic()
        raw = self.base.openai.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=DECODE_TOKENS, temperature=0.0,
            stream=True, stream_options={"include_usage": True})
        ttft, text, prompt_tokens = None, "", 0
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].text:
                ttft = ttft or time.monotonic() - started
                text += chunk.choices[0].text
            if chunk.usage:
                prompt_tokens = chunk.usage.prompt_tokens
        after = self.counters()
        prefill = raw.headers.get("x-kv-router-prefill-worker-id")
        time.sleep(SETTLE_S)  # the router learns the stored blocks from KV events
        return Served(raw.headers.get("x-kv-router-disaggregation", ""),
                      int(prefill) if prefill else None, prompt_tokens, text,
                      ttft or float("nan"),
                      {w: {k: after[w][k] - before[w][k] for k in ENGINE_COUNTERS}
                       for w in after})

    def prefilled_by(self, s: Served) -> list[int]:
        """The prefill instances that answered a request while ``s`` ran."""
        return [e.worker_id for e in self.prefills if s.answered(e.worker_id)]

    def missed_holder(self, s: Served, holder: int | None, bs: int) -> str | None:
        """None when ``s`` was disaggregated with its prefill on ``holder`` (the prefill
        worker holding the prompt), which found every full block cached; else what
        happened instead."""
        hits = s.grew[holder]["vllm:prefix_cache_hits_total"] if holder else 0
        full = s.prompt_tokens // bs * bs
        if s.reason == "long_uncached" and s.prefill_worker == holder \
                and self.prefilled_by(s) == [holder] and hits == full:
            return None
        return (f"decision {s.reason!r}, prefill worker {s.prefill_worker}, answered by "
                f"{self.prefilled_by(s)}; worker {holder} found {hits:.0f} of {full} "
                "tokens cached")


def disaggregated(pd: PdClient, prompts: list[str], out: Outcome) -> list[Served]:
    """Each prompt (long, fresh) disaggregated: one prefill instance answers, and the
    decode instance pulls every prompt token over NIXL."""
    served = []
    for i, prompt in enumerate(prompts):
        s = pd.send(prompt)
        served.append(s)
        by = pd.prefilled_by(s)
        pulled = s.grew[pd.decode.worker_id]["vllm:external_prefix_cache_hits_total"]
        out.expect(s.reason == "long_uncached" and len(by) == 1 and s.prefill_worker in by,
                   f"prompt {i} ({s.prompt_tokens} tokens): decision {s.reason!r}, prefill "
                   f"worker {s.prefill_worker}, answered by prefill instances {by}")
        out.expect(pulled == s.prompt_tokens,
                   f"prompt {i}: the decode instance pulled {pulled:.0f} tokens over NIXL, "
                   f"the prompt has {s.prompt_tokens}")
    out.figures["prefill worker of each prompt"] = ", ".join(
        str(s.prefill_worker) for s in served)
    out.figures["TTFT through the gateway, ms"] = ", ".join(
        f"{s.ttft_s * 1e3:.0f}" for s in served)
    return served


def same_as_aggregated(pd: PdClient, prompt: str, first: Served, out: Outcome) -> None:
    """``prompt`` answered whole by the prefill instance that did not prefill it (so
    computes all of it): greedy, the text is the one the gateway gave."""
    other = next(e for e in pd.prefills if e.worker_id != first.prefill_worker)
    reference = aggregated_text(other, prompt)
    out.expect(first.text == reference, f"the gateway's disaggregated text {first.text!r} "
               f"is not vllm-{other.index}'s aggregated {reference!r}")
    out.figures["disaggregated text = aggregated text"] = first.text == reference


def repeats_after_decode_reset(pd: PdClient, prompts: list[str], holders: list[int | None],
                               bs: int, out: Outcome) -> None:
    """The decode instance's cache reset, each prompt again: its prefill goes to the
    instance that holds it, which finds every full block cached."""
    reset_and_forget(pd)
    kept, ttfts = 0, []
    for i, prompt in enumerate(prompts):
        s = pd.send(prompt)
        ttfts.append(s.ttft_s)
        miss = pd.missed_holder(s, holders[i], bs)
        kept += miss is None
        out.expect(miss is None, f"prompt {i} again (its blocks on {holders[i]}): {miss}")
    out.figures["repeats prefilled where their blocks are, all full blocks hit"] = \
        f"{kept}/{len(prompts)}"
    out.figures["TTFT of the repeats through the gateway, ms"] = ", ".join(
        f"{t * 1e3:.0f}" for t in ttfts)


def planted(pd: PdClient, bs: int, out: Outcome) -> None:
    """A fresh prompt answered straight by each prefill instance in turn (not through
    kv-router), then sent through the gateway: its prefill goes to that instance, which
    finds every full block cached. Unlike the repeats above, where the router placed the
    first time, this puts a prompt on every prefill instance."""
    kept = 0
    for engine in pd.prefills:
        prompt = pd.base.prompt(PLANTED_TOKENS)
        openai_on(engine).completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        time.sleep(SETTLE_S)
        miss = pd.missed_holder(pd.send(prompt), engine.worker_id, bs)
        kept += miss is None
        out.expect(miss is None, f"a prompt held by worker {engine.worker_id} only: {miss}")
    out.figures["prompts held by one prefill instance prefilled there"] = \
        f"{kept}/{len(pd.prefills)}"


def reset_and_forget(pd: PdClient) -> None:
    """Resets the decode instance's prefix cache and waits until the router indexes no
    block of it. vLLM queues the reset's ``AllBlocksCleared`` event until its next
    engine step, so a request of less than a block (which stores no block) follows."""
    status, body = http("POST", f"{pd.decode.url}/reset_prefix_cache")
    if status != 200:
        raise RuntimeError(f"decode /reset_prefix_cache: {status} {body[:200]!r}")
    openai_on(pd.decode).completions.create(model=MODEL, prompt="step", max_tokens=1)
    deadline = time.monotonic() + BOOKINGS_DEADLINE_S
    while pd.cluster.workers()[pd.decode.worker_id]["indexed_blocks"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the router still indexes blocks of the decode instance "
                               f"{BOOKINGS_DEADLINE_S:.0f} s after its cache was reset")
        time.sleep(0.1)


def stays_on_decode(pd: PdClient, name: str, prompt: str, reason: str, out: Outcome) -> None:
    """``prompt`` is prefilled by the decode instance itself, for ``reason``."""
    s = pd.send(prompt)
    pulled = s.grew[pd.decode.worker_id]["vllm:external_prefix_cache_hits_total"]
    out.expect(s.reason == reason and s.prefill_worker is None and not pd.prefilled_by(s)
               and pulled == 0 and s.answered(pd.decode.worker_id),
               f"{name} ({s.prompt_tokens} tokens): decision {s.reason!r} (expected "
               f"{reason!r}), prefill worker {s.prefill_worker}, prefill instances that "
               f"answered {pd.prefilled_by(s)}, {pulled:.0f} tokens pulled")
    out.figures[f"{name}: decision, tokens pulled"] = f"{s.reason or 'none'}, {pulled:.0f}"


def bookings_freed(cluster: Cluster, out: Outcome) -> None:
    """Every booking of the run freed by its lifecycle, none left to expire."""
    deadline = time.monotonic() + BOOKINGS_DEADLINE_S
    while True:
        left = metric_sums(f"{cluster.router_url}/metrics",
                           (*BOOKINGS, "kv_router_requests_expired_total"))
        if not any(left[b] for b in BOOKINGS) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out.figures["router bookings left (requests, prefill tokens, decode blocks)"] = \
        ", ".join(f"{left[b]:.0f}" for b in BOOKINGS)
    out.expect(not any(left[b] for b in BOOKINGS) and not left[
        "kv_router_requests_expired_total"],
               f"bookings left {BOOKINGS_DEADLINE_S:.0f} s after the last answer: {left}")


def remote_prefill_time(cluster: Cluster, out: Outcome) -> None:
    """The gateway's own measure of the prefill halves (request sent → answer whole)."""
    name = "kv_gateway_remote_prefill_seconds"
    m = metric_sums(f"{cluster.gateway_url}/metrics", (f"{name}_sum", f"{name}_count"))
    count = m[f"{name}_count"]
    out.figures["prefill halves run by the gateway: count, mean ms"] = \
        f"{count:.0f}, {m[f'{name}_sum'] / count * 1e3:.0f}" if count else "0"


def through_gateway(cluster: Cluster, seed: int) -> Outcome:
    """The whole proof: disaggregated requests, their repeats, the two requests that
    stay on the decode instance, and the router's bookings at the end."""
    out = Outcome("prefill/decode through the gateway")
    pd = PdClient(cluster, seed)
    bs = cluster.shape.block_size
    long = [pd.base.prompt(tokens) for tokens in LONG_PROMPTS]
    first = disaggregated(pd, long, out)
    extended = pd.base.prompt(count_tokens(cluster.model_dir, long[-1]) + 80, long[-1])
    steps = [
        lambda: repeats_after_decode_reset(pd, long, [s.prefill_worker for s in first], bs,
                                           out),
        lambda: planted(pd, bs, out),
        lambda: stays_on_decode(pd, "a repeat the decode instance holds", long[0],
                                "short_uncached", out),
        lambda: stays_on_decode(pd, "a held prompt extended by 80 tokens", extended,
                                "decode_holds_prefix", out),
        lambda: stays_on_decode(pd, "a short fresh prompt",
                                pd.base.prompt(LOCAL_PREFILL_TOKENS // 2), "short_uncached",
                                out),
        lambda: bookings_freed(cluster, out),
        lambda: same_as_aggregated(pd, long[0], first[0], out),
        lambda: remote_prefill_time(cluster, out),
    ]
    for step in steps:
        try:
            step()
        except Exception as err:  # noqa: BLE001 - one part failed; the others still run
            out.failures.append(f"{type(err).__name__}: {err}")
    return out
