#!/usr/bin/env bash
# Runs a command with a Docker engine: uses the running one, or starts
# `dockerd --iptables=false --ip6tables=false --bridge=none` (containers use host
# networking; compose.yaml does) for the command and stops it after.
#   scripts/with-dockerd.sh docker build ...
set -euo pipefail
export PATH="/usr/sbin:/usr/bin:$PATH"  # Debian's docker CLI and dockerd first
if docker info >/dev/null 2>&1; then
  exec "$@"
fi
if ! command -v dockerd >/dev/null 2>&1; then
  echo "with-dockerd: no Docker engine runs and dockerd is not installed (bash scripts/install-docker.sh)" >&2
  exit 1
fi
log="${TMPDIR:-/tmp}/gpupool-dockerd.$$.log"
dockerd --iptables=false --ip6tables=false --bridge=none >"$log" 2>&1 &
pid=$!
stop() {
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
trap stop EXIT
for _ in $(seq 1 300); do
  if docker info >/dev/null 2>&1; then break; fi
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "with-dockerd: dockerd exited; its log ($log):" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  sleep 0.1
done
docker info >/dev/null 2>&1 || { echo "with-dockerd: dockerd did not answer in 30 s; log: $log" >&2; exit 1; }
"$@"
