#!/usr/bin/env bash
# Installs promtool (Debian package "prometheus"), which the deploy tests use:
# promtool check config / check rules / test rules. Idempotent: does nothing
# when promtool is already on PATH. Needs root (or sudo) and apt-get.
set -euo pipefail
if command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-prometheus: promtool is missing and apt-get is not available;" \
       "install Prometheus' promtool by other means" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# The package also installs a prometheus.service; nothing here starts it.
$sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool >/dev/null
echo "install-prometheus: $(promtool --version 2>&1 | head -n 1)" >&2
