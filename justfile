# gpupool — `just` lists the recipes. `./go <recipe>` installs uv and just first.

set shell := ["bash", "-euo", "pipefail", "-c"]

# list the recipes
default:
    @just --list

# install everything the tests need that PyPI does not ship (Prometheus, Docker, debootstrap, Chromium), build the CUDA hook
[group('setup')]
setup:
    bash scripts/install-prometheus.sh
    bash scripts/install-docker.sh
    bash scripts/install-chromium.sh
    bash scripts/build-cuda-hook.sh

# build the images (gpupool, NATS, Prometheus) offline from a locally made base
[group('setup')]
image: setup
    bash scripts/with-dockerd.sh bash scripts/build-images.sh

# the worked example (docs/behaviour.md), live through all four services
[group('run')]
demo:
    uv run --all-packages gpupool demo

# simulate a scenario file and print the event log as JSON lines
[group('run')]
simulate FILE:
    uv run --all-packages gpupool simulate {{FILE}}

# start NATS and the four services locally with simulated GPUs, supervised
[group('run')]
up CLUSTER NODE GPUS="2":
    uv run --all-packages gpupool up --cluster {{CLUSTER}} --node-name {{NODE}} --simulate-gpus {{GPUS}}

# everything CI runs: lint, types, architecture contracts, the whole test suite (and the pure tests on 3.12)
[group('check')]
test: setup lint typecheck contracts pytest pytest-3-12

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

# the test suite (unit, contract, integration, e2e, compose on a real Docker engine)
[group('check')]
pytest *ARGS:
    GPUPOOL_REQUIRE_DOCKER=1 uv run pytest -q {{ARGS}}

# the pure tests (unit, contract) on Python 3.12 too, when this machine has it, and the
# workload-outlives-a-failing-executor test (3.12's asyncio killed such shims)
[group('check')]
pytest-3-12:
    GPUPOOL_PYTHON_OPTIONAL=1 bash scripts/test-on-python.sh 3.12 tests/unit tests/contract tests/integration/test_node_executor_survives_failure.py

# the suite on another Python (3.12, 3.13) in its own environment, .venv-VERSION
[group('check')]
test-python VERSION *ARGS:
    GPUPOOL_REQUIRE_DOCKER=1 bash scripts/test-on-python.sh {{VERSION}} {{ARGS}}

# write the Helm chart's templates and values from the kustomize base (deploy/helm/gpupool)
[group('deploy')]
chart:
    uv run python scripts/generate_helm_chart.py

# benchmarks: tables and ratios against baselines measured in the same run
[group('bench')]
bench:
    for b in bench/bench_*.py; do echo "== $b"; uv run python "$b"; done

# mutation run over the core's placement and preemption (slow; not part of `test`):
# survivors are listed, with what kills or explains each, in docs/testing.md
[group('test')]
mutation *ARGS:
    uv run python scripts/mutation_run.py {{ARGS}}
