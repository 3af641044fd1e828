#!/usr/bin/env bash
# Installs what kv-router needs at build and test time, from Debian packages, when it
# is missing: nats-server, etcd (package etcd-server) and protoc (protobuf-compiler,
# needed by the etcd client's build), and python3 with venv (Python client tests).
# Sourced by quickstart.sh and test.sh.
set -euo pipefail

ensure_deps() {
  local missing=()
  command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
  command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
  command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
  # python3 with venv: the Python client and libzmq interop tests (tests/tests/python_clients.rs).
  command -v python3 >/dev/null 2>&1 || missing+=(python3)
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
  if [ "${#missing[@]}" -gt 0 ]; then
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    echo ">> installing ${missing[*]} (Debian packages)" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
  # Debian installs nats-server in /usr/sbin, which is not on every user's PATH.
  case ":$PATH:" in *":/usr/sbin:"*) ;; *) export PATH="$PATH:/usr/sbin" ;; esac
}
