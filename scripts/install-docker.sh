#!/usr/bin/env bash
# Installs what the image build and the compose test need, from Debian:
# docker.io (dockerd, containerd, runc, the docker CLI), docker-compose and
# debootstrap (the locally made base image, scripts/build-base-image.sh).
# Idempotent: installs only what is missing. Needs root (or sudo) and apt-get.
set -euo pipefail
missing=()
[ -x /usr/sbin/dockerd ] || missing+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-docker: ${missing[*]} missing and apt-get is not available;" \
       "install Docker (dockerd), docker-compose and debootstrap by other means" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# The packages also install docker.service; nothing here enables or starts it:
# scripts/dockerd.sh starts a daemon for the tests and stops it after.
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-docker: installed ${missing[*]}" >&2
