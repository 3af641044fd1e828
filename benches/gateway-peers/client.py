"""The client: NVIDIA's aiperf, run once per row, and what is read from its export.

Two workloads, both streamed OpenAI text completions:

- **trace**: the first N requests of the Mooncake conversation excerpt, with their
  timestamps divided by the arrival speed-up, replayed on aiperf's fixed schedule
  (``--custom-dataset-type mooncake_trace --fixed-schedule``). aiperf turns each
  512-token ``hash_id`` into text with the tokenizer it is given, from a fixed
  ``--random-seed``, so every row sends byte-identical prompts (checked: two runs'
  raw payloads hash the same).
- **synthetic**: open-loop arrivals at a constant request rate, 256-token prompts,
  16 output tokens (``--request-rate``, ``--isl``, ``--osl``).

The tokenizer is the mock engines' small test tokenizer. aiperf loads tokenizers
through the Hugging Face cache only (its worker processes run offline and resolve a
plain directory path as a hub id, which fails), so the directory is laid out as a
local cache entry (``hf-cache/models--kv-router--mock-tokenizer``) and aiperf runs
with ``HF_HUB_OFFLINE=1``: nothing is downloaded.

Per-request results come from ``profile_export.jsonl``: time to first token (ms,
measured by the client) and the error of each failed request.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from cluster import MODEL
from procs import die_with_parent, stop_group

TOKENIZER_ID = "kv-router/mock-tokenizer"
SEED = 1
#: Client-side limit of one request, s: far above any TTFT here, so a hung request
#: shows as a failure instead of stalling the run.
REQUEST_TIMEOUT_S = 600
#: Grace after the last scheduled request for the whole aiperf run, s.
RUN_GRACE_S = 900


@dataclass
class Outcome:
    """What one aiperf run measured."""

    ttft_ms: list[float] = field(default_factory=list)
    """Client-side TTFT of every successful request, wall ms."""
    requests: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    """Failure messages (truncated) and their counts."""
    duration_s: float = 0.0
    """aiperf's benchmark duration."""
    command: list[str] = field(default_factory=list)


def hf_cache(model_dir: Path, out: Path) -> Path:
    """Lays ``model_dir``'s tokenizer files out as a Hugging Face cache entry under
    ``out`` and returns the cache directory."""
    cache = out / "hf-cache"
    repo = cache / ("models--" + TOKENIZER_ID.replace("/", "--"))
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model_dir / name, snapshot / name)
    return cache


def scaled_trace(source: Path, requests: int, speedup: float, out: Path) -> Path:
    """The first ``requests`` lines of ``source`` with timestamps divided by
    ``speedup``, written to ``out``."""
    lines = []
    with source.open() as f:
        for line in f:
            if len(lines) == requests:
                break
            record = json.loads(line)
            record["timestamp"] = record["timestamp"] / speedup
            lines.append(json.dumps(record))
    out.write_text("\n".join(lines) + "\n")
    return out


class Aiperf:
    """Runs ``aiperf profile`` with the shared flags."""

    def __init__(self, exe: Path, cache: Path, log):
        self.exe = exe
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
        self.log = log

    def _common(self, urls: list[str], artifacts: Path) -> list[str]:
        argv = [str(self.exe), "profile", "--model", MODEL, "--endpoint-type", "completions",
                "--streaming", "--tokenizer", TOKENIZER_ID, "--random-seed", str(SEED),
                "--output-artifact-dir", str(artifacts), "--ui", "none",
                "--no-server-metrics", "--no-gpu-telemetry",
                "--request-timeout-seconds", str(REQUEST_TIMEOUT_S)]
        for url in urls:
            argv += ["--url", url]
        return argv

    def trace(self, url: str, trace: Path, artifacts: Path, timeout_s: float) -> Outcome:
        """Replays ``trace`` on its fixed schedule against ``url``."""
        argv = self._common([url], artifacts) + [
            "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
            "--fixed-schedule"]
        return self._run(argv, artifacts, timeout_s)

    def rate(self, urls: list[str], rate: float, count: int, artifacts: Path,
             timeout_s: float) -> Outcome:
        """``count`` synthetic requests at ``rate`` per second, open loop, spread
        round robin over ``urls``."""
        argv = self._common(urls, artifacts) + [
            "--request-rate", str(rate), "--arrival-pattern", "constant",
            "--request-count", str(count), "--num-dataset-entries", str(count),
            "--warmup-request-count", str(max(20, count // 20)),
            "--isl", "256", "--isl-stddev", "0", "--osl", "16", "--osl-stddev", "0"]
        return self._run(argv, artifacts, timeout_s)

    def _run(self, argv: list[str], artifacts: Path, timeout_s: float) -> Outcome:
        if artifacts.exists():
            shutil.rmtree(artifacts)
        artifacts.mkdir(parents=True)
        with (artifacts / "aiperf.stdout.log").open("wb") as out:
            # Its own process group: aiperf starts worker processes, and an interrupted
            # run (Ctrl-C, a deadline) must stop them all.
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env,
                                    start_new_session=True, preexec_fn=die_with_parent)
            try:
                code = proc.wait(timeout_s + RUN_GRACE_S)
            finally:
                stop_group(proc)
        if code != 0:
            raise RuntimeError(f"aiperf exited with {code}; see {artifacts}/aiperf.stdout.log")
        outcome = read_records(artifacts / "profile_export.jsonl")
        summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
        outcome.duration_s = float(summary.get("benchmark_duration", {}).get("avg") or 0.0)
        outcome.command = argv
        return outcome


def read_records(path: Path) -> Outcome:
    """TTFTs and failures of every request of an aiperf records export."""
    outcome = Outcome()
    errors: Counter[str] = Counter()
    with path.open() as f:
        for line in f:
            record = json.loads(line)
            if record.get("metadata", {}).get("benchmark_phase") not in (None, "profiling"):
                continue
            outcome.requests += 1
            error = record.get("error")
            if error:
                outcome.failed += 1
                errors[f"{error.get('code')} {error.get('type')}: "
                       f"{str(error.get('message'))[:120]}"] += 1
                continue
            ttft = record.get("metrics", {}).get("time_to_first_token")
            if ttft is not None:
                outcome.ttft_ms.append(float(ttft["value"]))
    outcome.errors = dict(errors.most_common())
    return outcome


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)
