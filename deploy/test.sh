#!/usr/bin/env bash
# The README's second command: installs what the build and the tests need when it is
# missing (deploy/ensure-deps.sh), checks that this list covers every system file the
# locked dependencies' build scripts use (deploy/check-build-deps.py), then runs every
# test in the workspace (unit, contract, property and end-to-end tests against real
# nats-server and etcd processes). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
. deploy/ensure-deps.sh
ensure_deps
python3 deploy/check-build-deps.py
cargo test --workspace --locked "$@"
