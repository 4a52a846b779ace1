#!/usr/bin/env bash
# One entry point on a fresh machine with only Python 3.11 and bash:
#   ./go demo   set everything up, then run the worked example live through all services
#   ./go test   set everything up, then run the whole test suite (what CI runs)
#   ./go <just recipe...>   set up, then any recipe of the justfile
set -euo pipefail
cd "$(dirname "$0")"
tools=.tools
if [ ! -x "$tools/bin/uv" ] || [ ! -x "$tools/bin/just" ]; then
  echo "go: installing uv and just into $tools/ (from PyPI)" >&2
  python3.11 -m venv "$tools" 2>/dev/null || python3 -m venv "$tools"
  "$tools/bin/python" -m pip install --quiet --disable-pip-version-check "uv>=0.5" "rust-just>=1.30"
fi
export PATH="$PWD/$tools/bin:$PATH"
export UV_PYTHON="${UV_PYTHON:-python3.11}"
uv sync --quiet --all-packages --frozen 2>/dev/null || uv sync --quiet --all-packages
if [ $# -eq 0 ]; then set -- --list; fi
exec just "$@"
