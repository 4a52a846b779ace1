# gpupool — `just` lists the recipes. `./go <recipe>` installs uv and just first.

set shell := ["bash", "-euo", "pipefail", "-c"]

# list the recipes
default:
    @just --list

# install everything the tests need that PyPI does not ship (Prometheus, promtool)
[group('setup')]
setup:
    bash scripts/install-prometheus.sh

# the worked example of SPEC.md, live through all four services
[group('run')]
demo:
    uv run --all-packages gpupool demo

# simulate a scenario file and print the event log as JSON lines
[group('run')]
simulate FILE:
    uv run --all-packages gpupool simulate {{FILE}}

# start NATS and the four services locally with simulated GPUs
[group('run')]
up CLUSTER NODE GPUS="2":
    uv run --all-packages gpupool up --cluster {{CLUSTER}} --node-name {{NODE}} --simulate-gpus {{GPUS}}

# everything CI runs: lint, types, architecture contracts, the whole test suite
[group('check')]
test: setup lint typecheck contracts pytest

# ruff lint and format check
[group('check')]
lint:
    uv run ruff check . && uv run ruff format --check .

# mypy --strict on every library and service
[group('check')]
typecheck:
    uv run mypy libs/*/src services/*/src

# import-linter: the core is pure, libraries never import services
[group('check')]
contracts:
    uv run lint-imports

# the test suite (unit, contract, integration, e2e)
[group('check')]
pytest *ARGS:
    uv run pytest -q {{ARGS}}

# benchmarks: tables and ratios against baselines measured in the same run
[group('bench')]
bench:
    for b in bench/bench_*.py; do echo "== $b"; uv run python "$b"; done

# mutation run over the core's placement and preemption (slow; not part of `test`):
# survivors are listed, with what kills or explains each, in docs/testing.md
[group('test')]
mutation *ARGS:
    uv run python scripts/mutation_run.py {{ARGS}}
