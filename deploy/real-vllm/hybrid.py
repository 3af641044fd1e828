"""The hybrid-attention mode (issue 28): one vLLM server with its hybrid KV cache
manager on, serving a Gemma-3 of three sliding-window layers (window 128 tokens) and
one full-attention layer, so four KV cache groups: three keep only the window before
each point a prompt can be resumed from (vLLM's default sparse retention), one keeps
every block.

Every request goes through the gateway with the ``openai`` client, as token ids (so
shared prefixes and block-aligned lengths are exact), and the router's overlap × block
size must equal vLLM's ``cached_tokens`` on each. The requests are the cases where a
group-blind router and vLLM part ways:

- a prompt, then again (every full block but the last token's);
- a prompt sharing only a 256-token prefix with it: vLLM finds nothing, since the
  sliding groups do not hold the window before token 256; it then stores that window
  (the junction) beside the full group's second copies of the prefix's blocks;
- prompts sharing that prefix, or 300 tokens, with the second: hits of 256 and 288;
- a block-aligned prompt three times: vLLM never reuses its last block (the last token
  is always recomputed, and the sliding groups do not keep the block before it), and
  stores that block again each time (three copies under one hash);
- fresh prompts, each followed by a probe sharing the prefix, until the copies stored
  first are evicted one at a time while the copies the probes hit stay: the probes run
  while a block has lost a copy and still holds another;
- fresh prompts worth four times the KV pool, then the first prompts again.

Beside the relay, the harness subscribes to the engine's KV events itself
(``EngineEvents``) to see the copies per (group, block hash); that is how it knows the
probes ran in the state they are there for. One engine: a prompt the router finds no
overlap for goes wherever load says, and the prefix cases need their prompts on the
engine that holds the prefix.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from checks import Client, Outcome, Parity, Sample
from model import token_ids
from pd_gateway import bookings_freed
from stack import Cluster, Engine, http

PREFIX_TOKENS = 256
"""The shared prefix: 8 blocks, longer than the sliding window (4 blocks), so the
window before its end is a whole window."""
PROBE_ROUNDS = 8
"""Rounds of (fresh prompt, probe sharing the prefix): the pool of 136 blocks turns
over about twice, so the prefix's untouched copies are evicted."""
PROBE_FILL_TOKENS = 400
FILL_TOKENS = 900
FILL_POOLS = 4
"""Fresh prompts worth this many KV pools evict everything before them."""
SUBSCRIBE_S = 1.0
"""ZMQ drops what a PUB socket sends before a new subscription reaches it; the engine
is idle while it does."""
RECV_TIMEOUT_MS = 200
"""How often the subscriber thread looks whether it should stop."""
REFUSALS_OK = ("published", "no_change")
"""Relay event outcomes that are not refusals."""


class EngineEvents:
    """vLLM's KV events as the engine published them, read by a second subscriber of
    its PUB socket: copies held per (KV cache group, block hash), every store in
    order, and which blocks lost a copy while another copy stays."""

    def __init__(self, engine: Engine):
        import zmq  # only the venv has it (a vLLM requirement)

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        self._sock.connect(f"tcp://127.0.0.1:{engine.pub_port}")
        self._lock = threading.Lock()
        self.copies: Counter = Counter()
        """(group, hash) → physical blocks vLLM holds under that hash in that group."""
        self.stored: Counter = Counter()
        """(group, hash) → stores over the run."""
        self.split: set = set()
        """(group, hash) that lost a copy and still hold one."""
        self.split_removals = 0
        self.stores: list[tuple[int, object, list]] = []
        """Every ``BlockStored`` in order: (group, parent hash, block hashes)."""
        self.kinds: dict[int, str] = {}
        self.batches = self.missed = self.malformed = 0
        self._next_seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-events", daemon=True)
        self._thread.start()
        time.sleep(SUBSCRIBE_S)

    def _run(self) -> None:
        import msgspec

        while not self._stop.is_set():
            try:
                _topic, seq, payload = self._sock.recv_multipart()
            except self._zmq.Again:
                continue
            except ValueError:  # not three frames
                self.malformed += 1
                continue
            try:
                events = msgspec.msgpack.decode(payload)[1]
            except (msgspec.DecodeError, IndexError, TypeError):
                self.malformed += 1
                continue
            with self._lock:
                seq = int.from_bytes(seq, "big")
                self.missed += max(0, seq - self._next_seq)
                self._next_seq = seq + 1
                self.batches += 1
                for event in events:
                    if isinstance(event, dict):
                        self._apply(event)
                    else:  # vLLM sends its events as maps with a "type"
                        self.malformed += 1

    def _apply(self, event: dict) -> None:
        group = event.get("group_idx") or 0
        hashes = event.get("block_hashes") or []
        if event.get("type") == "BlockStored":
            self.kinds[group] = event.get("kv_cache_spec_kind") or "full_attention"
            self.stores.append((group, event.get("parent_block_hash"), hashes))
            for h in hashes:
                self.copies[group, h] += 1
                self.stored[group, h] += 1
        elif event.get("type") == "BlockRemoved":
            for h in hashes:
                self.copies[group, h] -= 1
                if self.copies[group, h] > 0:
                    self.split.add((group, h))
                    self.split_removals += 1
                else:
                    self.split.discard((group, h))
                    del self.copies[group, h]
        elif event.get("type") == "AllBlocksCleared":
            self.copies.clear()
            self.split.clear()

    def mark(self) -> int:
        """A point in the store log, for ``first_full_store_since``."""
        with self._lock:
            return len(self.stores)

    def first_full_store_since(self, mark: int) -> list:
        """The block hashes of the first full-attention store after ``mark``."""
        with self._lock:
            for group, _parent, hashes in self.stores[mark:]:
                if self.kinds[group] == "full_attention" and hashes:
                    return hashes
        raise RuntimeError("the engine published no full-attention store for the prompt "
                           f"({self.batches} batches seen, {self.missed} missed)")

    def split_among(self, hashes: list) -> int:
        """How many of ``hashes`` (any group) lost a copy and still hold one."""
        with self._lock:
            return sum((g, h) in self.split for g in self.kinds for h in hashes)

    def groups(self) -> dict[int, str]:
        """KV cache group → its kind (``kv_cache_spec_kind``), as stores named them."""
        with self._lock:
            return dict(self.kinds)

    def duplicated(self) -> dict[str, int]:
        """Per group kind: hashes stored more than once."""
        with self._lock:
            out: Counter = Counter()
            for (group, _h), n in self.stored.items():
                out[self.kinds.get(group, "?")] += n > 1
            return dict(out)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


@dataclass
class Row:
    label: str
    sample: Sample
    expected_cached: int | None


@dataclass
class Ledger:
    """Every request in order, its parity, and what vLLM was expected to find."""

    client: Client
    parity: Parity
    rows: list[Row] = field(default_factory=list)

    def send(self, label: str, prompt: list[int], expected_cached: int | None) -> Sample:
        s = self.parity.add(label, self.client.send_settled(prompt))
        self.rows.append(Row(label, s, expected_cached))
        return s

    def table(self) -> str:
        bs = self.parity.bs
        lines = ["| # | request | prompt tokens | router overlap tokens | cached_tokens | agree |",
                 "|---|---|---|---|---|---|"]
        for i, r in enumerate(self.rows, 1):
            s = r.sample
            lines.append(f"| {i} | {r.label} | {s.prompt_tokens} | {s.overlap_blocks * bs} "
                         f"| {s.cached_tokens} | "
                         f"{'yes' if s.overlap_blocks * bs == s.cached_tokens else 'NO'} |")
        return "\n".join(lines)


def requests(ledger: Ledger, events: EngineEvents, cluster: Cluster, seed: int,
             out: Outcome) -> None:
    """The whole sequence (module docstring), as token ids exact to the token; the
    expected ``cached_tokens`` are vLLM 0.32's with its default sparse sliding-window
    retention (the shared prefix, 8 blocks, is longer than the window, 4 blocks)."""
    rng = random.Random(seed)

    def fresh(n: int, bos: bool = False) -> list[int]:
        return token_ids(cluster.model_dir, rng, n, bos)

    bs = cluster.shape.block_size
    prefix = fresh(PREFIX_TOKENS, bos=True)
    a = prefix + fresh(101)  # 357 tokens: 11 full blocks
    b = prefix + fresh(121)  # 377
    c = prefix + fresh(90)   # 346
    d = b[:300] + fresh(70)  # shares 9 full blocks with b
    aligned = fresh(10 * bs, bos=True)
    shared = PREFIX_TOKENS // bs

    mark = events.mark()
    ledger.send("A", a, 0)
    prefix_hashes = events.first_full_store_since(mark)[:shared]
    ledger.send("A again", a, len(a) // bs * bs)
    ledger.send("B: only the 256-token prefix shared with A", b, 0)
    ledger.send("B again", b, len(b) // bs * bs)
    ledger.send("C: the prefix, after B stored the window before it", c, shared * bs)
    ledger.send("D: B's first 300 tokens", d, 300 // bs * bs)
    # vLLM recomputes an aligned prompt's last token: its last block is never a hit.
    ledger.send(f"aligned: {len(aligned)} tokens", aligned, 0)
    ledger.send("aligned again", aligned, (len(aligned) // bs - 1) * bs)
    ledger.send("aligned a third time", aligned, (len(aligned) // bs - 1) * bs)

    split_probes = 0
    for i in range(PROBE_ROUNDS):
        ledger.send(f"fill {i} ({PROBE_FILL_TOKENS} tokens)", fresh(PROBE_FILL_TOKENS, True),
                    0)
        split = events.split_among(prefix_hashes)
        split_probes += split > 0
        ledger.send(f"probe {i}: the prefix" + (f" ({split} of its blocks lost a copy, "
                                               "hold another)" if split else ""),
                    prefix + fresh(60), shared * bs)
    out.figures["probes run while a prefix block had lost a copy and held another"] = \
        f"{split_probes}/{PROBE_ROUNDS}"
    out.expect(split_probes > 0, "no probe ran while a block of the prefix had lost one "
               "copy and still held another: the run did not test copies")

    shape = cluster.shape
    fills = -(-FILL_POOLS * shape.num_blocks * bs // FILL_TOKENS)  # ceil
    for i in range(fills):
        ledger.send(f"evict {i} ({FILL_TOKENS} tokens)", fresh(FILL_TOKENS, True), 0)
    ledger.send("A after eviction", a, 0)
    ledger.send("B after eviction", b, 0)
    ledger.send("C after eviction", c, shared * bs)
    ledger.send("A again after eviction", a, len(a) // bs * bs)
    ledger.send("aligned after eviction", aligned, 0)
    ledger.send("aligned again after eviction", aligned, (len(aligned) // bs - 1) * bs)
    out.figures["eviction: fresh prompts before the first prompts again"] = \
        f"{fills} × {FILL_TOKENS} tokens ({FILL_POOLS}× the {shape.num_blocks}-block pool)"


def relay_refusals(cluster: Cluster, out: Outcome) -> None:
    """The relay published every engine event (or found nothing to change): no
    refusal by reason, no malformed frame."""
    engine = cluster.engines[0]
    refused: Counter = Counter()
    for labels, n in cluster.relay_metric(engine, "kv_relay_engine_events_total").items():
        outcome = re.search(r'outcome="([^"]*)"', labels)
        if n and outcome and outcome[1] not in REFUSALS_OK:
            refused[outcome[1]] += int(n)
    for labels, n in cluster.relay_metric(engine, "kv_relay_frames_total").items():
        if n and 'outcome="ok"' not in labels and 'outcome="duplicate"' not in labels:
            refused[f"frames {labels}"] += int(n)
    out.figures["relay: refused engine events by reason"] = \
        ", ".join(f"{k} {v}" for k, v in sorted(refused.items())) or "none"
    out.expect(not refused, f"the relay refused engine events: {dict(refused)}")


def run(cluster: Cluster, seed: int) -> list[Outcome]:
    """The sequence, then the router's bookings and the relay's refusals; prints the
    per-request table."""
    client = Client(cluster, seed)
    ledger = Ledger(client, Parity(cluster.shape.block_size))
    engine_side = Outcome("the engine's own hits as vLLM 0.32 makes them (the cases exist)")
    after = Outcome("bookings and refusals")
    events = EngineEvents(cluster.engines[0])
    try:
        requests(ledger, events, cluster, seed, engine_side)
    except Exception as err:  # noqa: BLE001 - reported; the figures so far still count
        engine_side.failures.append(f"the sequence stopped: {type(err).__name__}: {err}")
    finally:
        events.close()
    for row in ledger.rows:
        if row.expected_cached is not None and row.sample.cached_tokens != row.expected_cached:
            engine_side.failures.append(
                f"{row.label}: vLLM found {row.sample.cached_tokens} cached tokens, "
                f"{row.expected_cached} expected")
    kinds = events.groups()
    engine_side.figures["KV cache groups in the engine's events"] = \
        ", ".join(f"{g} {k}" for g, k in sorted(kinds.items()))
    engine_side.expect({"full_attention", "sliding_window"} <= set(kinds.values()),
                       f"the engine did not publish both a full-attention and a "
                       f"sliding-window KV cache group: {kinds or 'no store seen'} (is its "
                       "hybrid KV cache manager off?)")
    engine_side.figures["copies: hashes stored more than once, by group kind"] = \
        ", ".join(f"{k} {v}" for k, v in sorted(events.duplicated().items()))
    engine_side.figures["copies: removals that left another copy"] = events.split_removals
    engine_side.figures["event batches the harness saw / missed / found malformed"] = \
        f"{events.batches} / {events.missed} / {events.malformed}"
    for step in (lambda: bookings_freed(cluster, after), lambda: relay_refusals(cluster, after),
                 lambda: router_events(cluster, after)):
        try:
            step()
        except Exception as err:  # noqa: BLE001 - one part failed; the others still run
            after.failures.append(f"{type(err).__name__}: {err}")
    print(f"\n{ledger.table()}", flush=True)
    parity = ledger.parity
    total = Outcome("token parity over every request")
    total.figures["requests with overlap × block size = cached_tokens"] = \
        f"{parity.checked - len(parity.mismatches)}/{parity.checked}"
    total.figures["of which the engine found cached blocks"] = parity.with_overlap
    total.failures.extend(parity.mismatches)
    return [total, engine_side, after]


def router_events(cluster: Cluster, out: Outcome) -> None:
    """The router indexer's KV events by outcome (a figure, not a check)."""
    name = "kv_router_indexer_events_total"
    _, body = http("GET", f"{cluster.router_url}/metrics")
    by: Counter = Counter()
    for line in body.decode().splitlines():
        if line.startswith(name + "{"):
            outcome = re.search(r'outcome="([^"]*)"', line)
            by[outcome[1] if outcome else "?"] += int(float(line.rsplit(" ", 1)[1]))
    out.figures["router: indexer events by outcome"] = \
        ", ".join(f"{k} {v}" for k, v in sorted(by.items()))
