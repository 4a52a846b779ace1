#!/usr/bin/env bash
# Runs the test suite on another Python (3.12, 3.13, ...) in its own environment,
# .venv-<version>, synced from uv.lock:  scripts/test-on-python.sh 3.12 [pytest args]
# The interpreter comes from PATH (pythonX.Y), pyenv's versions or uv's own
# installs; without one the run fails, saying so (with GPUPOOL_PYTHON_OPTIONAL=1 it
# says so and succeeds: "the suite runs on each available interpreter").
set -euo pipefail
cd "$(dirname "$0")/.."
version="$1"
shift
python=""
for candidate in "$(command -v "python$version" || true)" \
    "$HOME"/.pyenv/versions/"$version".*/bin/"python$version" \
    /usr/bin/"python$version" /usr/local/bin/"python$version" \
    "$(uv python find "$version" 2>/dev/null || true)"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c "import sys" >/dev/null 2>&1; then
    python="$candidate"
    break
  fi
done
if [ -z "$python" ]; then
  echo "test-on-python: no Python $version on this machine (PATH, ~/.pyenv/versions, uv)" >&2
  if [ "${GPUPOOL_PYTHON_OPTIONAL:-0}" = "1" ]; then
    echo "test-on-python: NOT tested on Python $version" >&2
    exit 0
  fi
  exit 1
fi
export UV_PROJECT_ENVIRONMENT=".venv-$version"
echo "test-on-python: $("$python" --version) ($python) in $UV_PROJECT_ENVIRONMENT" >&2
uv sync --quiet --all-packages --frozen --python "$python"
exec uv run --no-sync --python "$python" pytest -q "$@"
