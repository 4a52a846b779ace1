"""A real Docker engine for the compose test: the running one, or a dockerd started here.

``docker_engine()`` answers with the docker CLI to use once ``docker info``
works. When no engine answers it starts ``dockerd --iptables=false
--ip6tables=false --bridge=none`` (containers use the host's network; that is
what compose.yaml does), waits for it, and stops it on exit. When the engine
cannot be had, :class:`NoDockerEngine` says why.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
SEARCH_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
"""Debian's docker CLI, docker-compose and dockerd come first (they match each other)."""


class NoDockerEngine(RuntimeError):
    pass


def tool(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH + ":" + os.environ.get("PATH", ""))


def engine_answers(docker: str) -> bool:
    result = subprocess.run(
        [docker, "info", "--format", "{{.ServerVersion}}"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return result.returncode == 0


@contextmanager
def docker_engine() -> Iterator[str]:
    docker = tool("docker")
    if docker is None:
        raise NoDockerEngine("no docker CLI (bash scripts/install-docker.sh installs docker.io)")
    if engine_answers(docker):
        yield docker
        return
    dockerd = tool("dockerd")
    if dockerd is None:
        raise NoDockerEngine("no Docker engine runs and dockerd is not installed")
    if os.geteuid() != 0:
        raise NoDockerEngine("no Docker engine runs, and only root can start dockerd")
    with tempfile.NamedTemporaryFile(prefix="gpupool-dockerd-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
        process = subprocess.Popen(
            [dockerd, "--iptables=false", "--ip6tables=false", "--bridge=none"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not engine_answers(docker):
            if process.poll() is not None:
                raise NoDockerEngine(
                    f"dockerd exited with {process.returncode}: "
                    + "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
                )
            if time.monotonic() > deadline:
                raise NoDockerEngine(f"dockerd did not answer within {START_TIMEOUT_S:.0f}s")
            time.sleep(0.1)  # polling `docker info`: the daemon offers nothing to wait on
        yield docker
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log_path.unlink(missing_ok=True)
