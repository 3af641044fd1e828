"""What the benchmark runs besides its own processes: the Python tools, each in its own
venv under ``target/`` (their dependencies clash: aiperf pins one aiohttp, the peers
others), and kv-router's release binaries.

A venv is reused while its marker file names the same pinned requirement, so a second
run installs nothing. Versions are pinned to the ones this benchmark was checked with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: venv name → (pip requirement, executable the venv provides).
TOOLS: dict[str, tuple[str, str]] = {
    "aiperf": ("aiperf==0.13.0", "aiperf"),
    "smg": ("smg==1.13.0", "smg"),
    "vllm-router": ("vllm-router==0.1.17", "vllm-router"),
}

MARKER = ".gateway-peers-requirement"


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every executable the benchmark starts."""

    kv_router: Path
    kv_mocker: Path
    nats_server: Path
    etcd: Path
    aiperf: Path
    smg: Path
    vllm_router: Path


def ensure_venv(venvs: Path, name: str, log) -> Path:
    """The executable of tool ``name``, installing its venv first if needed."""
    requirement, exe = TOOLS[name]
    venv = venvs / name
    marker = venv / MARKER
    if not (marker.exists() and marker.read_text().strip() == requirement):
        log(f"installing {requirement} into {venv}")
        if venv.exists():
            shutil.rmtree(venv)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet",
                        "--disable-pip-version-check", requirement], check=True)
        marker.write_text(requirement + "\n")
    path = venv / "bin" / exe
    if not path.exists():
        raise FileNotFoundError(f"{requirement} installed no `{exe}` in {venv}/bin")
    return path


def build_release(repo: Path, log) -> tuple[Path, Path]:
    """``cargo build --release -p kv-router -p mocker``; the two binaries."""
    log("cargo build --release -p kv-router -p mocker")
    subprocess.run(["cargo", "build", "--release", "-p", "kv-router", "-p", "mocker"],
                   cwd=repo, check=True)
    target = Path(os.environ.get("CARGO_TARGET_DIR", repo / "target"))
    return target / "release" / "kv-router", target / "release" / "kv-mocker"


def require(name: str) -> Path:
    """The path of a system executable (nats-server, etcd), or a clear error."""
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"`{name}` is not on PATH (deploy/ensure-deps.sh installs it)")
    return Path(found)


def resolve(repo: Path, venvs: Path, build: bool, log) -> Binaries:
    """Installs or finds everything; builds the release binaries unless ``build`` is
    false (then they must exist)."""
    if build:
        kv_router, kv_mocker = build_release(repo, log)
    else:
        target = Path(os.environ.get("CARGO_TARGET_DIR", repo / "target"))
        kv_router, kv_mocker = target / "release" / "kv-router", target / "release" / "kv-mocker"
        for path in (kv_router, kv_mocker):
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing: run without --no-build")
    return Binaries(
        kv_router=kv_router,
        kv_mocker=kv_mocker,
        nats_server=require("nats-server"),
        etcd=require("etcd"),
        aiperf=ensure_venv(venvs, "aiperf", log),
        smg=ensure_venv(venvs, "smg", log),
        vllm_router=ensure_venv(venvs, "vllm-router", log),
    )
