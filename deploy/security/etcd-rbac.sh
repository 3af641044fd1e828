#!/usr/bin/env bash
# etcd roles and users for one kv-router namespace (docs/security.md): routers and
# gateways may read the worker registrations, each relay or engine process may write
# only its own workers' keys and worker id claims. etcd enforces them once
# authentication is enabled.
#
#   etcd-rbac.sh enable               create user root (password on stdin) and enable auth
#   etcd-rbac.sh reader USER          a router or gateway user (password on stdin)
#   etcd-rbac.sh worker USER ID...    a relay or engine user for these worker ids
#                                     (password on stdin)
#   etcd-rbac.sh relay USER           a relay user whose worker id is derived and
#                                     claimed at start (password on stdin)
#
# etcdctl (v3 API) takes the connection from its environment: ETCDCTL_ENDPOINTS,
# ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_KEY, and once auth is enabled
# ETCDCTL_USER=root:<password>. The namespace is KV_ROUTER_NAMESPACE (default
# kv-router), as for `kv-router serve`. Running a command again is harmless: a
# user that exists keeps its password, permissions are granted again.
#
# Roles: kv-router.<ns>.reader reads the prefix kv-router/<ns>/workers/;
# kv-router.<ns>.worker.<id> reads and writes the keys kv-router/<ns>/workers/<id>
# and kv-router/<ns>/worker-ids/<id> (its claim); kv-router.<ns>.relay reads and
# writes the prefixes kv-router/<ns>/workers/ and kv-router/<ns>/worker-ids/, since a
# relay without --worker-id learns its id only when it claims it (the claim, not
# etcd's permissions, keeps two relays off one id).
# Passwords are read from standard input, never taken as arguments (they would show
# in the process list).
set -euo pipefail

NS="${KV_ROUTER_NAMESPACE:-kv-router}"
if ! [[ "$NS" =~ ^[A-Za-z0-9_-]{1,64}$ ]]; then
  echo "etcd-rbac.sh: invalid namespace '$NS' (1 to 64 of [A-Za-z0-9_-])" >&2
  exit 2
fi
PREFIX="kv-router/$NS/workers/"
CLAIMS="kv-router/$NS/worker-ids/"
ETCDCTL="${ETCDCTL:-etcdctl}"

usage() {
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

ctl() {
  ETCDCTL_API=3 "$ETCDCTL" "$@"
}

# Creates USER with the password on stdin unless it exists.
ensure_user() {
  local user="$1" password
  if ctl user get "$user" >/dev/null 2>&1; then
    echo "user $user exists; password unchanged" >&2
    return
  fi
  IFS= read -r password || true
  if [ -z "$password" ]; then
    echo "etcd-rbac.sh: no password for $user on standard input" >&2
    exit 2
  fi
  printf '%s\n' "$password" | ctl user add "$user" --interactive=false >/dev/null
  echo "user $user created" >&2
}

ensure_role() {
  ctl role get "$1" >/dev/null 2>&1 || ctl role add "$1" >/dev/null
}

case "${1:-}" in
  enable)
    [ "$#" -eq 1 ] || usage
    ensure_user root
    ensure_role root
    ctl user grant-role root root >/dev/null
    ctl auth enable >/dev/null
    echo "authentication enabled; use ETCDCTL_USER=root:<password> from now on" >&2
    ;;
  reader)
    [ "$#" -eq 2 ] || usage
    role="kv-router.$NS.reader"
    ensure_role "$role"
    ctl role grant-permission "$role" read "$PREFIX" --prefix=true >/dev/null
    ensure_user "$2"
    ctl user grant-role "$2" "$role" >/dev/null
    echo "$2 may read $PREFIX" >&2
    ;;
  worker)
    [ "$#" -ge 3 ] || usage
    user="$2"
    shift 2
    ensure_user "$user"
    for id in "$@"; do
      if ! [[ "$id" =~ ^[0-9]+$ ]]; then
        echo "etcd-rbac.sh: worker id '$id' is not a number" >&2
        exit 2
      fi
      role="kv-router.$NS.worker.$id"
      ensure_role "$role"
      ctl role grant-permission "$role" readwrite "$PREFIX$id" >/dev/null
      ctl role grant-permission "$role" readwrite "$CLAIMS$id" >/dev/null
      ctl user grant-role "$user" "$role" >/dev/null
      echo "$user may write $PREFIX$id and $CLAIMS$id" >&2
    done
    ;;
  relay)
    [ "$#" -eq 2 ] || usage
    role="kv-router.$NS.relay"
    ensure_role "$role"
    ctl role grant-permission "$role" readwrite "$PREFIX" --prefix=true >/dev/null
    ctl role grant-permission "$role" readwrite "$CLAIMS" --prefix=true >/dev/null
    ensure_user "$2"
    ctl user grant-role "$2" "$role" >/dev/null
    echo "$2 may write $PREFIX and $CLAIMS" >&2
    ;;
  *)
    usage
    ;;
esac
