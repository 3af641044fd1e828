#!/usr/bin/env python3
"""Side-by-side gateway benchmark (issue 24): kv-router's gateway, SMG and
vllm-router in front of the same mock vLLM engines, driven by aiperf.

See README.md beside this file. Usage:

    python3 benches/gateway-peers/run.py            # full run, ~16 min on 2 cores
    python3 benches/gateway-peers/run.py --quick    # smoke run, a few minutes
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gateways
import tools
from client import Aiperf, hf_cache, percentile, scaled_trace
from cluster import Cluster, EngineShape, engine_report
from procs import Placement, Stack
from report import (OverheadRow, TraceRow, as_json, loadavg, overhead_summary,
                    overhead_table, per_request_ms, trace_table, ttft_stats)

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "engine-model" / "data" / "mooncake_conversation_excerpt.jsonl"
MODEL_DIR = REPO / "kv-tokenizer" / "tests" / "data"


@dataclass(frozen=True)
class Load:
    """One load of the Mooncake replay: the same arrivals, more or fewer engines."""

    name: str
    title: str
    workers: int


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "target" / "gateway-peers",
                   help="output directory: report.json, report.md, logs/, aiperf/")
    p.add_argument("--requests", type=int, default=400,
                   help="first N requests of the Mooncake excerpt replayed per row")
    p.add_argument("--time-scale", type=float, default=3.0,
                   help="engines run this many times faster than model time, and the "
                        "trace's arrivals are sped up as much")
    p.add_argument("--workers", type=int, default=8, help="engines of the light load")
    p.add_argument("--bound-workers", type=int, default=4,
                   help="engines of the engine-bound load (same arrivals, fewer engines)")
    p.add_argument("--block-size", type=int, default=64, help="engine KV block, tokens")
    p.add_argument("--num-gpu-blocks", type=int, default=8192,
                   help="KV capacity per engine, blocks")
    p.add_argument("--loads", default="light,bound",
                   help="comma-separated: light, bound")
    p.add_argument("--rows", default=",".join(gateways.DEFAULT_ROWS),
                   help=f"comma-separated gateways of the trace replay; known: "
                        f"{','.join(gateways.ROW_KEYS)}")
    p.add_argument("--overhead-rows", default=",".join(gateways.DEFAULT_OVERHEAD_ROWS),
                   help="comma-separated gateways of the overhead pass")
    p.add_argument("--overhead-rates", default="100,500",
                   help="open-loop short-prompt rates, requests/s; empty skips the pass")
    p.add_argument("--overhead-seconds", type=float, default=6.0,
                   help="length of each overhead pass, s")
    p.add_argument("--overhead-rounds", type=int, default=3,
                   help="rounds of the overhead pass; each round runs the engines "
                        "directly and then every gateway, and the summary gives the "
                        "median over rounds of each gateway's added p50")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 40 requests per row, 2 s overhead passes")
    p.add_argument("--pin-serving", default="",
                   help="comma-separated CPUs for the request path (gateways, routers, "
                        "nats-server); engines, relays, etcd and the client run on the "
                        "others, as if the engines were on other hosts; empty: no pinning")
    p.add_argument("--no-build", action="store_true",
                   help="use the existing target/release binaries")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.overhead_seconds = 40, 2.0
    for flag, value in (("--rows", args.rows), ("--overhead-rows", args.overhead_rows)):
        unknown = set(value.split(",")) - set(gateways.ROW_KEYS) - {""}
        if unknown:
            p.error(f"{flag}: unknown {sorted(unknown)}; known: {gateways.ROW_KEYS}")
    if not set(args.loads.split(",")) <= {"light", "bound"}:
        p.error("--loads takes light and/or bound")
    try:
        args.placement = (Placement({int(c) for c in args.pin_serving.split(",")})
                          if args.pin_serving else None)
    except ValueError as e:
        p.error(f"--pin-serving: {e}")
    if min(args.requests, args.workers, args.bound_workers, args.overhead_rounds) < 1:
        p.error("--requests, --workers, --bound-workers and --overhead-rounds must be "
                "at least 1")
    return args


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True,
                          check=False).stdout.strip()


def cache_hits(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Tokens from the tokenizer cache over all tokenized between two scrapes."""
    def delta(source: str) -> float:
        name = f'kv_gateway_tokenized_tokens_total{{source="{source}"}}'
        return after.get(name, 0.0) - before.get(name, 0.0)
    total = delta("cache") + delta("encoded")
    return delta("cache") / total if total > 0 else None


STAGES = ("tokenize_queue", "tokenize", "route", "engine")


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """Mean ms of each of the gateway's stages before the first token between two
    scrapes (``kv_gateway_stage_seconds``), and of its own TTFT."""
    if not after:
        return None
    def mean_ms(name: str, labels: str) -> float:
        def delta(suffix: str) -> float:
            key = f"{name}_{suffix}{labels}"
            return after.get(key, 0.0) - before.get(key, 0.0)
        count = delta("count")
        return 1000 * delta("sum") / count if count > 0 else 0.0
    means = {s: mean_ms("kv_gateway_stage_seconds", f'{{stage="{s}"}}') for s in STAGES}
    def total(key_prefix: str, snapshot: dict[str, float]) -> float:
        return sum(v for k, v in snapshot.items() if k.startswith(key_prefix))
    ttft_sum = total("kv_gateway_ttft_seconds_sum", after) - total("kv_gateway_ttft_seconds_sum", before)
    ttft_count = (total("kv_gateway_ttft_seconds_count", after)
                  - total("kv_gateway_ttft_seconds_count", before))
    means["gateway_ttft"] = 1000 * ttft_sum / ttft_count if ttft_count > 0 else 0.0
    return means


def trace_row(row: gateways.Row, cluster: Cluster, aiperf: Aiperf, trace: Path,
              artifacts: Path, scale: float, timeout_s: float) -> TraceRow:
    """Cold caches, the gateway started, the trace replayed, everything read."""
    cluster.reset_prefix_caches()
    running = gateways.start(row, cluster, MODEL_DIR)
    try:
        load_before = loadavg()
        counts = cluster.counts()
        gw0 = running.gateway.cpu_seconds()
        router0 = running.router.cpu_seconds() if running.router else 0.0
        relays0 = sum(r.cpu_seconds() for r in cluster.relays)
        tokenized0 = gateways.scrape(running)
        outcome = aiperf.trace(running.url, trace, artifacts, timeout_s)
        gw = running.gateway.cpu_seconds() - gw0
        router = running.router.cpu_seconds() - router0 if running.router else None
        relays = sum(r.cpu_seconds() for r in cluster.relays) - relays0
        engines = engine_report(counts, cluster.counts())
        rss = running.gateway.peak_rss_bytes() / (1 << 20)
        load_after = loadavg()
        tokenized = gateways.scrape(running)
    finally:
        gateways.stop(running, cluster)
    n = outcome.requests
    return TraceRow(
        key=row.key, label=row.label, tokenizes=row.tokenizes, requests=n,
        failed=outcome.failed, errors=outcome.errors,
        ttft_wall_ms=ttft_stats(outcome, 1.0), ttft_model_ms=ttft_stats(outcome, scale),
        cached_ratio=engines["cached_ratio"],
        requests_per_engine=engines["requests_per_engine"],
        gateway_cpu_ms_per_request=per_request_ms(gw, n),
        router_cpu_ms_per_request=None if router is None else per_request_ms(router, n),
        relays_cpu_ms_per_request=per_request_ms(relays, n),
        tokenizer_cache_hits=cache_hits(tokenized0, tokenized),
        gateway_peak_rss_mib=rss, load_before=load_before, load_after=load_after,
        gateway_command=running.command, client_command=outcome.command)


def overhead_rows(rows: list[gateways.Row], cluster: Cluster, aiperf: Aiperf,
                  rates: list[float], seconds: float, rounds: int, out: Path,
                  results: list[OverheadRow]) -> None:
    """Open-loop short prompts at each rate, appended to ``results``: the engines
    directly (aiperf spreading requests round robin over their URLs), then through
    each gateway, all of it ``rounds`` times, so that each gateway's added p50 is
    taken against the direct pass of its own round (the host's load drifts)."""
    for round_ in range(1, rounds + 1):
        overhead_round(rows, cluster, aiperf, rates, seconds, round_, out, results)


def overhead_round(rows: list[gateways.Row], cluster: Cluster, aiperf: Aiperf,
                   rates: list[float], seconds: float, round_: int, out: Path,
                   results: list[OverheadRow]) -> None:
    """One round of :func:`overhead_rows`."""
    direct_p50: dict[float, float] = {}
    targets: list[gateways.Row | None] = [None, *rows]
    for row in targets:
        running = gateways.start(row, cluster, MODEL_DIR) if row else None
        try:
            for rate in rates:
                count = max(1, int(rate * seconds))
                cluster.reset_prefix_caches()
                key = row.key if row else "direct"
                load_before = loadavg()
                cpu0 = running.gateway.cpu_seconds() if running else 0.0
                scraped0 = gateways.scrape(running) if running else {}
                urls = [running.url] if running else cluster.engine_urls
                outcome = aiperf.rate(urls, rate, count, out / f"{key}-{rate:g}-r{round_}",
                                      timeout_s=4 * seconds + 60)
                cpu = running.gateway.cpu_seconds() - cpu0 if running else None
                stages = stage_means(scraped0, gateways.scrape(running)) if running else None
                p50 = percentile(outcome.ttft_ms, 0.5)
                if row is None:
                    direct_p50[rate] = p50
                results.append(OverheadRow(
                    key=key, label=row.label if row else "engines directly", rate=rate,
                    round=round_,
                    requests=outcome.requests, failed=outcome.failed,
                    achieved_rate=outcome.requests / outcome.duration_s
                    if outcome.duration_s else 0.0,
                    ttft_p50_ms=p50, ttft_p99_ms=percentile(outcome.ttft_ms, 0.99),
                    added_p50_ms=None if row is None else p50 - direct_p50[rate],
                    gateway_cpu_ms_per_request=None if cpu is None
                    else per_request_ms(cpu, outcome.requests),
                    load_before=load_before, load_after=loadavg(), stages_ms=stages,
                    client_command=outcome.command))
                log(f"  overhead round {round_}, {key} at {rate:g}/s: p50 TTFT {p50:.2f} ms, "
                    f"{outcome.failed} failed")
        finally:
            if running:
                gateways.stop(running, cluster)


def run(args: argparse.Namespace, report: dict) -> None:
    """Runs every load into ``report`` (filled as rows finish, so an interrupted run
    still leaves what it measured)."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    bins = tools.resolve(REPO, out / "venvs", not args.no_build, log)
    aiperf = Aiperf(bins.aiperf, hf_cache(MODEL_DIR, out), log)
    placement = args.placement.describe() if args.placement else "unpinned"
    if args.placement:
        # After the build, which should have every CPU.
        args.placement.pin_self()
        log(placement)
    rows = [r for r in gateways.ROWS if r.key in args.rows.split(",")]
    trace = scaled_trace(TRACE, args.requests, args.time_scale,
                         out / f"trace-{args.requests}-x{args.time_scale:g}.jsonl")
    span_s = json.loads(trace.read_text().splitlines()[-1])["timestamp"] / 1000
    loads = [Load("light", f"Light load: {args.workers} engines", args.workers),
             Load("bound", f"Engine-bound load: {args.bound_workers} engines",
                  args.bound_workers)]
    report.update({
        "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
        "command": " ".join(sys.argv), "uptime_start": loadavg(),
        "config": {k: str(v) for k, v in vars(args).items() if k != "placement"},
        "placement": placement, "loads": {}, "overhead": [],
    })
    rates = [float(r) for r in args.overhead_rates.split(",") if r]
    for load in (l for l in loads if l.name in args.loads.split(",")):
        shape = EngineShape(load.workers, args.time_scale, args.block_size,
                            args.num_gpu_blocks)
        cluster = Cluster(Stack(out / "logs" / load.name, args.placement), bins, shape,
                          MODEL_DIR)
        try:
            log(f"{load.title}: starting nats, etcd, {load.workers} engines and relays")
            cluster.start()
            results: list[TraceRow] = []
            report["loads"][load.name] = {"title": load.title, "workers": load.workers,
                                          "rows": results}
            for row in rows:
                log(f"{load.name}: {row.label}: {args.requests} requests over {span_s:.0f} s")
                results.append(trace_row(row, cluster, aiperf, trace,
                                         out / "aiperf" / load.name / row.key,
                                         args.time_scale, timeout_s=span_s))
                r = results[-1]
                log(f"  mean TTFT {r.ttft_model_ms['mean']:,.0f} model ms, "
                    f"{r.failed} failed, cached {100 * r.cached_ratio:.1f}%, "
                    f"gateway {r.gateway_cpu_ms_per_request:.1f} ms CPU/req")
            print(trace_table(load.title, results), flush=True)
            if load.name == "light" and rates:
                log(f"overhead pass: {', '.join(f'{r:g}' for r in rates)} requests/s")
                targets = [r for r in gateways.ROWS if r.key in args.overhead_rows.split(",")]
                overhead_rows(targets, cluster, aiperf, rates, args.overhead_seconds,
                              args.overhead_rounds, out / "aiperf" / "overhead",
                              report["overhead"])
        finally:
            cluster.stop()
    report["uptime_end"] = loadavg()
    report["round_robin_bound_over_light"] = round_robin_ratio(report)


def round_robin_ratio(report: dict) -> float | None:
    """Round robin's mean TTFT at the engine-bound load over the light one (the
    engine-bound load is meant to at least double it), if both ran."""
    means = {}
    for name, load in report["loads"].items():
        for row in load["rows"]:
            if row.key == "kv-round-robin":
                means[name] = row.ttft_model_ms["mean"]
    if "light" in means and "bound" in means and means["light"]:
        return means["bound"] / means["light"]
    return None


def markdown(report: dict) -> str:
    parts = [f"commit {report.get('commit')}{' (dirty)' if report.get('dirty') else ''}; "
             f"load {report.get('uptime_start')} → {report.get('uptime_end', loadavg())}; "
             f"{report.get('placement', 'unpinned')}\n"]
    ratio = report.get("round_robin_bound_over_light")
    if ratio is not None:
        parts.append(f"round robin's mean TTFT, engine-bound over light: {ratio:.2f}×\n")
    for load in report["loads"].values():
        parts.append(trace_table(load["title"] + " (TTFT in model ms)", load["rows"]))
    if report.get("overhead"):
        parts.append(overhead_table("Open-loop short prompts (256 tokens in, 16 out; wall ms)",
                                    report["overhead"]))
        parts.append(overhead_summary("Added TTFT p50 over the rounds (wall ms)",
                                      report["overhead"]))
    return "\n".join(parts)


def interrupt(_signum, _frame) -> None:
    """SIGINT and SIGTERM unwind the run, so every started process is stopped."""
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # SIGINT explicitly too: a shell starts background jobs with it ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    report: dict = {}
    code = 0
    try:
        run(args, report)
    except KeyboardInterrupt:
        log("interrupted; every process started was stopped")
        code = 130
    finally:
        # Whatever was measured is written, also when a later row failed.
        if report.get("loads"):
            (args.out / "report.json").write_text(json.dumps(as_json_report(report), indent=2)
                                                  + "\n")
            text = markdown(report)
            (args.out / "report.md").write_text(text)
            print(text)
            log(f"report: {args.out / 'report.json'}, {args.out / 'report.md'}; "
                f"logs: {args.out / 'logs'}")
    return code


def as_json_report(report: dict) -> dict:
    """``report`` with its rows as plain JSON values."""
    loads = {name: {**load, "rows": as_json(load["rows"])}
             for name, load in report["loads"].items()}
    return {**report, "loads": loads, "overhead": as_json(report.get("overhead", []))}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
