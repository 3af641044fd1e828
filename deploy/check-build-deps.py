#!/usr/bin/env python3
"""Fails when the build needs a system file or tool that deploy/ensure-deps.sh does not
provide.

A green build on a machine that happens to have a package proves nothing about a fresh
one. So this check does not look at the machine: it derives what the build scripts of
the locked dependency graph (`cargo metadata --locked`, for this host) reach outside
their crate for, and compares that with the list `deploy/ensure-deps.sh --provides`
guarantees:

- a build dependency on prost-build, tonic-build, tonic-prost-build or protobuf-codegen
  needs `protoc`, plus every `import "..."` of the crate's .proto files that the crate
  does not ship itself (protobuf's well-known types come from the system);
- a build dependency on cc or cmake needs a C compiler (`cc`), cmake also `cmake`;
- a build dependency on pkg-config, system-deps, vcpkg or bindgen probes a system
  library this check cannot name: it fails until that library is added to
  ensure-deps.sh and to KNOWN_SYSTEM_LIBRARIES below;
- a build script that runs a program named by a string literal needs that program,
  unless ALLOWED_PROGRAMS says why not.

Then it proves it can fail: the list ensure-deps.sh guaranteed before it knew about
protobuf's include files (protoc alone) must be reported. Exit status 0 when
everything is provided, 1 otherwise (with one line per missing requirement and the crate that needs it).

Usage: deploy/check-build-deps.py [--provides-file FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROTOC_BUILD_DEPS = {"prost-build", "tonic-build", "tonic-prost-build", "protobuf-codegen"}
C_BUILD_DEPS = {"cc": ["cmd:cc"], "cmake": ["cmd:cc", "cmd:cmake"]}
SYSTEM_LIBRARY_BUILD_DEPS = {"pkg-config", "system-deps", "vcpkg", "bindgen"}
# Crates allowed to probe system libraries, with the requirement that covers them.
KNOWN_SYSTEM_LIBRARIES: dict[str, list[str]] = {}
# Programs run by build scripts that need nothing from us, and why.
ALLOWED_PROGRAMS = {
    "freebsd-version": "libc: only when the target is FreeBSD",
    "./target/tools/windows/nasm/nasm": "ring: only when the target is Windows",
    "rustc": "the toolchain itself",
}

IMPORT_RE = re.compile(r'^\s*import\s+(?:public\s+|weak\s+)?"([^"]+)"\s*;', re.MULTILINE)
PROGRAM_RE = re.compile(r'Command::new\(\s*"([^"]+)"\s*\)')


def cargo_metadata() -> dict:
    host = subprocess.run(
        ["rustc", "-vV"], check=True, capture_output=True, text=True
    ).stdout
    triple = next(
        line.split(":", 1)[1].strip() for line in host.splitlines() if line.startswith("host:")
    )
    out = subprocess.run(
        ["cargo", "metadata", "--locked", "--format-version", "1", "--filter-platform", triple],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    return json.loads(out)


def shipped_protos(package_dir: Path) -> tuple[list[Path], set[str]]:
    """The crate's .proto files, and every path suffix under which an import could
    name one of them."""
    files = [p for p in package_dir.rglob("*.proto") if p.is_file()]
    suffixes = set()
    for f in files:
        parts = f.relative_to(package_dir).parts
        for i in range(len(parts)):
            suffixes.add("/".join(parts[i:]))
    return files, suffixes


def needs(metadata: dict) -> dict[str, set[str]]:
    """Requirement -> the crates that need it."""
    packages = {p["id"]: p for p in metadata["packages"]}
    required: dict[str, set[str]] = {}

    def need(requirement: str, crate: str) -> None:
        required.setdefault(requirement, set()).add(crate)

    for node in metadata["resolve"]["nodes"]:
        package = packages[node["id"]]
        build_scripts = [t for t in package["targets"] if "custom-build" in t["kind"]]
        if not build_scripts:
            continue
        crate = f'{package["name"]} {package["version"]}'
        package_dir = Path(package["manifest_path"]).parent
        build_deps = {
            packages[dep["pkg"]]["name"]
            for dep in node["deps"]
            if any(kind.get("kind") == "build" for kind in dep["dep_kinds"])
        }
        if build_deps & PROTOC_BUILD_DEPS:
            need("cmd:protoc", crate)
            files, suffixes = shipped_protos(package_dir)
            for f in files:
                for imported in IMPORT_RE.findall(f.read_text(errors="replace")):
                    if imported not in suffixes:
                        need(f"proto:{imported}", crate)
        for dep, requirements in C_BUILD_DEPS.items():
            if dep in build_deps:
                for requirement in requirements:
                    need(requirement, crate)
        if build_deps & SYSTEM_LIBRARY_BUILD_DEPS:
            for requirement in KNOWN_SYSTEM_LIBRARIES.get(
                package["name"], [f"system-library:{package['name']}"]
            ):
                need(requirement, crate)
        for target in build_scripts:
            script_dir = Path(target["src_path"]).parent
            sources = [Path(target["src_path"])]
            if script_dir != package_dir:
                sources += list(script_dir.rglob("*.rs"))
            for source in sources:
                for program in PROGRAM_RE.findall(source.read_text(errors="replace")):
                    if program not in ALLOWED_PROGRAMS:
                        need(f"cmd:{program}", crate)
    return required


def missing(required: dict[str, set[str]], provided: set[str]) -> list[str]:
    return [
        f"{requirement} (needed by {', '.join(sorted(crates))})"
        for requirement, crates in sorted(required.items())
        if requirement not in provided
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--provides-file",
        help="read the provided list from FILE instead of `deploy/ensure-deps.sh --provides`",
    )
    args = parser.parse_args()
    if args.provides_file:
        provided_text = Path(args.provides_file).read_text()
    else:
        provided_text = subprocess.run(
            ["bash", str(ROOT / "deploy" / "ensure-deps.sh"), "--provides"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    provided = {line.strip() for line in provided_text.splitlines() if line.strip()}

    required = needs(cargo_metadata())
    gaps = missing(required, provided)
    if gaps:
        print("check-build-deps: the build needs what deploy/ensure-deps.sh does not provide:")
        for gap in gaps:
            print(f"  {gap}")
        return 1

    # The check must be able to fail, on the very gap it exists for: the list the
    # script guaranteed before it knew about protobuf's include files.
    before_the_fix = {"cmd:nats-server", "cmd:etcd", "cmd:protoc", "cmd:python3", "python:venv"}
    caught = missing(required, before_the_fix)
    if not any(gap.startswith("proto:google/protobuf/descriptor.proto") for gap in caught):
        print("check-build-deps: internal error: a list without protobuf's well-known types passed")
        return 1
    summary = ", ".join(
        f"{requirement} ({', '.join(sorted(crates))})"
        for requirement, crates in sorted(required.items())
    )
    print(f"check-build-deps: ok, ensure-deps.sh provides all {len(required)} system requirements of the build: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
