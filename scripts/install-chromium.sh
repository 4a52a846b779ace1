#!/usr/bin/env bash
# Installs Debian's chromium, which the console's browser tests drive headless
# (Playwright with executable_path=/usr/bin/chromium). Idempotent: does nothing
# when chromium is already on PATH. Needs root (or sudo) and apt-get.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-chromium: chromium is missing and apt-get is not available;" \
       "install Debian's chromium by other means" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
# apt-get update only when the lists are missing (install-prometheus.sh may just have run it)
if [ -z "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v -e lock -e partial)" ]; then
  $sudo apt-get update -qq
fi
$sudo apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
command -v chromium >/dev/null
echo "install-chromium: $(chromium --version 2>/dev/null | head -n 1)" >&2
