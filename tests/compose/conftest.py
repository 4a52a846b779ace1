"""The Docker engine and the images, shared by the compose tests of a session.

The engine is started once (or the running one is used) and the images are built
once (``scripts/build-images.sh``), however many compose stacks the tests bring up.
Without an engine the tests fail when GPUPOOL_REQUIRE_DOCKER=1 (``just test``, CI)
and are skipped otherwise, saying why.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker_engine import NoDockerEngine, docker_engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def docker_cli() -> Iterator[str]:
    """The docker CLI of a running engine (started here if none runs)."""
    try:
        with docker_engine() as docker:
            yield docker
    except NoDockerEngine as why:
        if os.environ.get("GPUPOOL_REQUIRE_DOCKER") == "1":
            pytest.fail(f"the compose test needs a Docker engine: {why}")
        pytest.skip(f"no Docker engine: {why} (GPUPOOL_REQUIRE_DOCKER=1 makes this a failure)")


@pytest.fixture(scope="session")
def compose_images(docker_cli: str) -> str:
    """The images compose.yaml runs, built here offline; the docker CLI."""
    built = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-images.sh")],
        capture_output=True, text=True, timeout=900, check=False, cwd=ROOT,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-4000:]
    return docker_cli
