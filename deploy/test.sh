#!/usr/bin/env bash
# The README's second command: installs the test servers if missing and runs every
# test in the workspace (unit, contract, property and end-to-end tests against real
# nats-server and etcd processes). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
. deploy/ensure-deps.sh
ensure_deps
cargo test --workspace --locked "$@"
