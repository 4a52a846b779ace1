"""compose.yaml on a real Docker engine: the images built here, the stack up, the worked
example played through the containers, health, /metrics, a Prometheus scrape, ``down -v``.

The engine is the running one or a dockerd this test starts (and stops after).
``scripts/build-images.sh`` builds the three images offline from a base made here
(debootstrap + docker import); ``docker-compose up`` starts compose.yaml with the
simulated profile: the node-executor has 2 SIMULATED GPUs, and says so. The four
pods are ``gpupool run`` processes inside the node-executor's container
(``docker exec``), exactly as a user runs them; their Assigned order is read from
the NATS inside the stack.

Without an engine the test fails when GPUPOOL_REQUIRE_DOCKER=1 (``just test``, CI)
and is skipped otherwise, saying why (conftest.py: the engine and images are shared
by the compose tests of a session).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import socket
import subprocess
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from docker_engine import tool

from gpupool.cli.demo import EXPECTED_ASSIGNMENTS, NODE, DemoRun, run_worked_example
from gpupool.cli.local_stack import http_get

ROOT = Path(__file__).resolve().parents[2]
NATS_URL = "nats://127.0.0.1:4222"
SERVICE_PORTS = {"policy": 9101, "admission-queue": 9102, "preemption": 9103,
                 "node-executor-simulated": 9104}  # fmt: skip
HOST_PORTS = (4222, 8222, 9090, *SERVICE_PORTS.values())
PROMETHEUS_PORT = 9090
EXECUTOR = "node-executor-simulated"
SOCKET = "/run/gpupool/gpupool.sock"

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]


@dataclass
class ComposeStack:
    docker: str
    compose: list[str]
    project: str

    @property
    def nats_url(self) -> str:
        return NATS_URL

    @property
    def socket_path(self) -> Path:
        return Path(SOCKET)

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.compose, *args], capture_output=True, text=True, timeout=timeout, check=False
        )

    def container(self, service: str) -> str:
        result = self.run("ps", "-q", service)
        assert result.returncode == 0 and result.stdout.strip(), result.stderr
        return result.stdout.strip().splitlines()[0]

    def pod_command(self, pod: str, task: str) -> list[str]:
        """``gpupool run`` for the pod, inside the node-executor's container."""
        return [self.docker, "exec", "-i", self.container(EXECUTOR),
                "gpupool", "run", "--socket", SOCKET, "--pod", pod, "--", "python", "-c", task]  # fmt: skip

    def health(self, service: str) -> str:
        result = subprocess.run(
            [self.docker, "inspect", "-f", "{{.State.Health.Status}}", self.container(service)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        return result.stdout.strip()

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "40").stdout


def port_taken(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


@pytest.fixture(scope="module")
def compose_stack(compose_images: str) -> Iterator[ComposeStack]:
    with running_stack(compose_images, ["-f", str(ROOT / "compose.yaml")]) as stack:
        yield stack


@contextmanager
def running_stack(
    docker: str, files: list[str], environment: dict[str, str] | None = None
) -> Iterator[ComposeStack]:
    """``up -d`` of the compose files (the simulated profile, the worked example's pods) until
    the block ends; then ``down -v``, which must leave no volume behind."""
    compose_cli = tool("docker-compose")
    assert compose_cli, "docker-compose is missing (bash scripts/install-docker.sh)"
    taken = [port for port in HOST_PORTS if port_taken(port)]
    assert not taken, f"compose.yaml's host ports {taken} are in use on 127.0.0.1"
    project = f"gpupool-test-{uuid.uuid4().hex[:8]}"
    settings = {
        "GPUPOOL_CLUSTER_FILE": str(ROOT / "scenarios" / "worked-example.yaml"),
        "GPUPOOL_NODE_NAME": NODE,
        "GPUPOOL_MESSAGE_PERIOD": "0.5",
        **(environment or {}),
    }
    os.environ.update(settings)
    stack = ComposeStack(
        docker=docker,
        compose=[compose_cli, *files, "-p", project, "--profile", "simulated"],
        project=project,
    )
    try:
        up = stack.run("up", "-d")
        assert up.returncode == 0, up.stderr
        yield stack
    finally:
        down = stack.run("down", "-v", "--remove-orphans")
        for name in settings:
            os.environ.pop(name, None)
        assert down.returncode == 0, down.stderr
        volumes = subprocess.run(
            [docker, "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={project}"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert volumes.stdout.strip() == "", f"down -v left volumes: {volumes.stdout}"


async def wait_ready(port: int, within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while (await http_get(port, "/readyz"))[0] != 200:
        assert time.monotonic() < deadline, f"127.0.0.1:{port}/readyz not 200 after {within}s"
        await asyncio.sleep(0.2)  # polling an HTTP probe: there is nothing to wait on


async def prometheus_query(query: str) -> list[dict[str, object]]:
    status, body = await http_get(
        PROMETHEUS_PORT, "/api/v1/query?query=" + urllib.parse.quote(query)
    )
    if status != 200:
        return []
    result: list[dict[str, object]] = json.loads(body)["data"]["result"]
    return result


async def test_worked_example_through_the_compose_stack(compose_stack: ComposeStack) -> None:
    stack = compose_stack
    for port in SERVICE_PORTS.values():
        await wait_ready(port)

    # The worked example, four `gpupool run` pods inside the executor's container.
    out = io.StringIO()
    run = DemoRun(stack=stack, out=out, pod_command=stack.pod_command)
    try:
        assignments = await run_worked_example(run)
    except BaseException:
        print(out.getvalue(), stack.logs())  # shown by pytest on failure
        raise
    assert assignments == EXPECTED_ASSIGNMENTS
    assert "gpupool: running on GPU 1 (GPU-SIMULATED-" in "\n".join(run.pods["pod-d"].lines)

    # The image carries the CUDA hook the node-executor installs on a node, as an ELF library.
    hook = stack.run("exec", "-T", EXECUTOR, "head", "-c", "4",
                     "/opt/gpupool/cuda-hook/libgpupool-cuda-hook.so")  # fmt: skip
    assert hook.returncode == 0 and hook.stdout == "\x7fELF", hook.stderr

    # The executor says its GPUs are simulated: in its log and in its metrics.
    executor_log = stack.run("logs", "--no-color", EXECUTOR).stdout
    assert "SIMULATED GPUs" in executor_log
    _, metrics = await http_get(SERVICE_PORTS[EXECUTOR], "/metrics")
    assert re.search(r"^gpupool_inventory_simulated(\{[^}]*\})? 1\.0$", metrics.decode(), re.M)
    # The pooling metrics, rebuilt from the log: the four pods are done now (status 0).
    _, pooling = await http_get(SERVICE_PORTS["admission-queue"], "/metrics")
    statuses = re.findall(r'^DCGM_FI_POOLING_STATUS\{[^}]*pod="(pod-[a-d])"[^}]*\} (\S+)$',
                          pooling.decode(), re.M)  # fmt: skip
    assert {pod for pod, _ in statuses} == {"pod-a", "pod-b", "pod-c", "pod-d"}, pooling.decode()

    # Docker's own health checks turn healthy; Prometheus scrapes every service.
    deadline = time.monotonic() + 120
    pending = set(SERVICE_PORTS) | {"prometheus"}
    while pending:
        pending = {service for service in pending if stack.health(service) != "healthy"}
        assert time.monotonic() < deadline, f"not healthy: {pending}\n{stack.logs()}"
        if pending:
            await asyncio.sleep(1)  # polling docker inspect: health has no event to await
    jobs = {"gpupool-policy", "gpupool-admission-queue", "gpupool-preemption",
            "gpupool-node-executor"}  # fmt: skip
    while True:
        up = await prometheus_query('up{job=~"gpupool-.*"} == 1')
        simulated = await prometheus_query("gpupool_inventory_simulated == 1")
        if {str(r["metric"]["job"]) for r in up} >= jobs and simulated:  # type: ignore[index]
            break
        assert time.monotonic() < deadline, f"Prometheus has not scraped {jobs}: {up}"
        await asyncio.sleep(1)  # polling the query API: scrapes have no event to await
