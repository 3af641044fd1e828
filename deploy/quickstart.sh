#!/usr/bin/env bash
# The README's first command: builds kv-router and kv-mocker, then starts nats-server
# (JetStream on) and etcd on free loopback ports, mock engines in vLLM mode with one
# kv-router relay each, the gateway and the router daemon, replays the bundled Mooncake trace excerpt with kv routing and with round robin,
# prints the comparison and writes target/quickstart/report.json. Every process it
# starts is stopped before it exits. Extra arguments go to `kv-mocker quickstart`.
set -euo pipefail
cd "$(dirname "$0")/.."
. deploy/ensure-deps.sh
ensure_deps
cargo build --release --locked -p kv-router -p mocker
exec target/release/kv-mocker quickstart "$@"
