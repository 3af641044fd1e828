"""Rows of results, the Markdown tables printed at the end and the JSON report.

TTFT in the trace tables is in the engines' model ms (client wall ms × the engines'
time scale), as the mock engines' model defines it and as issue 24's tables give it;
the JSON also keeps the wall ms. The overhead table is in wall ms: it measures the
gateway, not the engine.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from client import Outcome, percentile


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` prints them."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


@dataclass
class TraceRow:
    """One gateway on the Mooncake replay of one load."""

    key: str
    label: str
    tokenizes: str
    requests: int
    failed: int
    errors: dict[str, int]
    ttft_wall_ms: dict[str, float]
    ttft_model_ms: dict[str, float]
    cached_ratio: float
    requests_per_engine: list[int]
    gateway_cpu_ms_per_request: float
    router_cpu_ms_per_request: float | None
    relays_cpu_ms_per_request: float
    #: kv-router rows tokenizing locally: prompt tokens taken from the gateway's
    #: tokenizer cache over all it tokenized (``kv_gateway_tokenized_tokens_total``).
    tokenizer_cache_hits: float | None
    gateway_peak_rss_mib: float
    load_before: str
    load_after: str
    gateway_command: list[str]
    client_command: list[str]


@dataclass
class OverheadRow:
    """One target (a gateway, or the engines directly) at one request rate."""

    key: str
    label: str
    rate: float
    #: The round of the overhead pass (1-based): each compares with its own direct pass.
    round: int
    requests: int
    failed: int
    achieved_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    added_p50_ms: float | None
    gateway_cpu_ms_per_request: float | None
    load_before: str
    load_after: str
    #: kv-router rows: mean ms of each gateway stage before the first token, and of
    #: the gateway's own TTFT (``kv_gateway_stage_seconds``, ``kv_gateway_ttft_seconds``).
    stages_ms: dict[str, float] | None = None
    client_command: list[str] = field(default_factory=list)


def ttft_stats(outcome: Outcome, scale: float) -> dict[str, float]:
    values = [v * scale for v in outcome.ttft_ms]
    mean = sum(values) / len(values) if values else 0.0
    return {"mean": mean, "p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}


def per_request_ms(cpu_s: float, requests: int) -> float:
    return 1000.0 * cpu_s / requests if requests else 0.0


def markdown_table(title: str, header: list[str], align: str, rows: list[list[str]]) -> str:
    """A titled Markdown table; ``align`` has one character per column: ``l`` or ``r``."""
    rule = "|".join("---:" if a == "r" else "---" for a in align)
    lines = [f"**{title}**", "", f"| {' | '.join(header)} |", f"|{rule}|"]
    lines += [f"| {' | '.join(cells)} |" for cells in rows]
    return "\n".join(lines) + "\n"


def optional_ms(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f} ms"


def trace_table(title: str, rows: list[TraceRow]) -> str:
    header = ["gateway", "tokenizes", "mean TTFT", "p50", "p99", "failed", "cached",
              "requests per engine", "gateway CPU/req", "tokenizer cache hits",
              "router CPU/req", "load before → after"]
    cells = []
    for r in rows:
        t = r.ttft_model_ms
        cells.append([
            r.label, r.tokenizes, f"{t['mean']:,.0f}", f"{t['p50']:,.0f}", f"{t['p99']:,.0f}",
            f"{r.failed} of {r.requests}", f"{100 * r.cached_ratio:.1f}%",
            " ".join(str(n) for n in r.requests_per_engine),
            optional_ms(r.gateway_cpu_ms_per_request, 1),
            "—" if r.tokenizer_cache_hits is None else f"{100 * r.tokenizer_cache_hits:.1f}%",
            optional_ms(r.router_cpu_ms_per_request, 1), f"{r.load_before} → {r.load_after}"])
    return markdown_table(title, header, "llrrrrrlrrrl", cells)


def overhead_summary(title: str, rows: list[OverheadRow]) -> str:
    """Per gateway and rate: the median, min and max over the rounds of the added p50,
    and of the same for each round's engines-direct p50."""
    groups: dict[tuple[str, float], list[OverheadRow]] = {}
    for r in rows:
        groups.setdefault((r.label, r.rate), []).append(r)
    cells = []
    for (label, rate), group in groups.items():
        values = sorted(r.ttft_p50_ms if r.added_p50_ms is None else r.added_p50_ms
                        for r in group)
        what = "TTFT p50" if group[0].added_p50_ms is None else "added p50"
        median = statistics.median(values)
        sign = "" if what == "TTFT p50" else "+"
        cells.append([label, f"{rate:g}", what, str(len(values)), f"{median:{sign}.2f} ms",
                      f"{values[0]:{sign}.2f} … {values[-1]:{sign}.2f} ms"])
    header = ["target", "rate (req/s)", "figure", "rounds", "median", "min … max"]
    return markdown_table(title, header, "lrlrrl", cells)


def overhead_table(title: str, rows: list[OverheadRow]) -> str:
    header = ["target", "round", "rate (req/s)", "achieved", "TTFT p50", "p99", "added p50",
              "failed", "gateway CPU/req", "gateway stages (mean ms)", "load before → after"]
    cells = []
    for r in rows:
        added = "—" if r.added_p50_ms is None else f"{r.added_p50_ms:+.2f} ms"
        cells.append([
            r.label, str(r.round), f"{r.rate:g}", f"{r.achieved_rate:.0f}",
            f"{r.ttft_p50_ms:.2f} ms",
            f"{r.ttft_p99_ms:.2f} ms", added, f"{r.failed} of {r.requests}",
            optional_ms(r.gateway_cpu_ms_per_request, 2), stage_cell(r.stages_ms),
            f"{r.load_before} → {r.load_after}"])
    return markdown_table(title, header, "lrrrrrrrrll", cells)


def stage_cell(stages: dict[str, float] | None) -> str:
    """``queue 0.01 · tokenize 0.20 · route 0.40 · engine 1.10 (ttft 1.71)``."""
    if not stages:
        return "—"
    short = {"tokenize_queue": "queue", "tokenize": "tokenize", "route": "route",
             "engine": "engine"}
    parts = [f"{short[k]} {stages.get(k, 0.0):.2f}" for k in short]
    return " · ".join(parts) + f" (ttft {stages.get('gateway_ttft', 0.0):.2f})"


def as_json(value) -> object:
    """Dataclasses (and lists of them) as plain JSON values."""
    if isinstance(value, list):
        return [as_json(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return value
