#!/usr/bin/env bash
# Makes the base image gpupool/base:bookworm locally, with no registry: a Debian
# bookworm root from `debootstrap --variant=minbase` with Python 3.11, imported
# with `docker import`. Does nothing when the image exists already (about 3
# minutes otherwise). Needs root, debootstrap and a Docker engine.
#   GPUPOOL_DEBIAN_MIRROR   the Debian mirror (default: the one apt uses here)
set -euo pipefail
image="${GPUPOOL_BASE_IMAGE:-gpupool/base:bookworm}"
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "build-base-image: $image exists" >&2
  exit 0
fi
mirror="${GPUPOOL_DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
  mirror=$(grep -hoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
    | head -n 1 | awk '{print $2}' || true)
  mirror="${mirror:-http://deb.debian.org/debian}"
fi
root=$(mktemp -d "${TMPDIR:-/tmp}/gpupool-base.XXXXXX")
trap 'rm -rf "$root"' EXIT
echo "build-base-image: debootstrap bookworm from $mirror" >&2
debootstrap --variant=minbase --include=python3 bookworm "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -n 30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
  "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "build-base-image: made $image ($(docker image inspect -f '{{.Size}}' "$image") bytes)" >&2
