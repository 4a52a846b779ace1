"""A real Prometheus (Debian's package, started on loopback) scrapes a running gpupool stack
through the worked example; the values it stores, read back through PromQL, match the log.
The local scrape configuration and alert rules of deploy/prometheus are the ones used."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.parse
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from stack_harness import (
    WAITING,
    envelopes,
    of_type,
    read_log,
    running_stack,
    start_workload,
    wait_for_log,
)

from gpupool.cli.demo import NODE
from gpupool.cli.local_stack import LocalStack, free_port, http_get
from gpupool.core import fold, pooling_status, queue_positions
from gpupool.events import Assigned, PodReady, Released

ROOT = Path(__file__).resolve().parents[2]
JOB_PORTS = {
    "gpupool-policy": "policy",
    "gpupool-admission-queue": "admission-queue",
    "gpupool-preemption": "preemption",
    "gpupool-node-executor": "node-executor",
}


def prometheus_config(stack: LocalStack, directory: Path) -> Path:
    """deploy/prometheus/prometheus.yml with the stack's real ports and a 1 s scrape."""
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    config["rule_files"] = [str(ROOT / "deploy/prometheus" / f) for f in config["rule_files"]]
    config["scrape_configs"] = [
        {
            **job,
            "static_configs": [
                {"targets": [f"127.0.0.1:{stack.services[JOB_PORTS[job['job_name']]].port}"]}
            ],
        }
        for job in config["scrape_configs"]
        if job["job_name"] in JOB_PORTS
    ]
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


class Prometheus:
    def __init__(self, port: int) -> None:
        self.port = port

    async def query(self, promql: str) -> list[dict[str, Any]]:
        status, body = await http_get(
            self.port, "/api/v1/query?query=" + urllib.parse.quote(promql)
        )
        assert status == 200, body
        result: list[dict[str, Any]] = json.loads(body)["data"]["result"]
        return result

    async def until(
        self, promql: str, check: Callable[[list[dict[str, Any]]], bool]
    ) -> list[dict[str, Any]]:
        """Query until the answer satisfies ``check`` (a new scrape lands every second)."""
        async with asyncio.timeout(60):
            while not check(result := await self.query(promql)):  # noqa: ASYNC110
                await asyncio.sleep(0.25)  # between queries: Prometheus has no change feed
            return result


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[LocalStack]:
    cluster = (ROOT / "scenarios" / "worked-example.yaml").read_text()
    async with running_stack(tmp_path, cluster, NODE, gpus=2) as running:
        yield running


@asynccontextmanager
async def started_prometheus(stack: LocalStack, tmp_path: Path) -> AsyncIterator[Prometheus]:
    binary = shutil.which("prometheus")
    assert binary, "Prometheus is not installed: run ./go setup (scripts/install-prometheus.sh)"
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        binary,
        f"--config.file={prometheus_config(stack, tmp_path)}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    said: list[str] = []
    try:
        async with asyncio.timeout(60):  # its log says when it serves
            async for raw in process.stderr:
                said.append(raw.decode(errors="replace"))
                if "Server is ready to receive web requests" in said[-1]:
                    break
            else:
                raise AssertionError("Prometheus exited:\n" + "".join(said))
        drain = asyncio.create_task(_drain(process.stderr))
        assert (await http_get(port, "/-/ready"))[0] == 200
        yield Prometheus(port)
        drain.cancel()
    finally:
        process.terminate()
        await process.wait()


async def _drain(stream: asyncio.StreamReader) -> None:
    async for _ in stream:  # keep reading so that Prometheus never blocks on a full pipe
        pass


def by_pod(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"]["pod"]: float(r["value"][1]) for r in result}


async def test_prometheus_scrapes_the_stack_and_agrees_with_the_log(
    stack: LocalStack, tmp_path: Path
) -> None:
    async with started_prometheus(stack, tmp_path) as prometheus:
        workloads = {}
        for pod in ("pod-a", "pod-c"):
            workloads[pod] = await start_workload(stack, pod)
            await wait_for_log(stack, lambda log, pod=pod: bool(of_type(log, Assigned, pod)))
        for pod in ("pod-d", "pod-b"):
            workloads[pod] = await start_workload(stack, pod)
            await wait_for_log(stack, lambda log, pod=pod: bool(of_type(log, PodReady, pod)))
        await workloads["pod-b"].until_line(lambda line: WAITING.match(line) is not None)

        # T1, as Prometheus stored it, equals the log folded at T1
        state = fold(envelopes(await read_log(stack)))
        expected_status = {ref.name: float(pooling_status(p)) for ref, p in state.pods.items()}
        positions = queue_positions(state, NODE)
        expected_position = {ref.name: float(positions.get(ref, 0)) for ref in state.pods}
        status = await prometheus.until(
            f'DCGM_FI_POOLING_STATUS{{NodeName="{NODE}"}}', lambda r: by_pod(r) == expected_status
        )
        assert by_pod(status) == {"pod-a": 2.0, "pod-b": 1.0, "pod-c": 2.0, "pod-d": 1.0}
        position = await prometheus.query(f'DCGM_FI_POOLING_POSITION{{NodeName="{NODE}"}}')
        assert (
            by_pod(position)
            == expected_position
            == {"pod-a": 0.0, "pod-b": 2.0, "pod-c": 0.0, "pod-d": 1.0}
        )
        assert {r["metric"]["job"] for r in status} == {"gpupool-admission-queue"}

        # T2 and the end: counters against the log
        assert await workloads["pod-c"].finish() == 0
        await wait_for_log(stack, lambda log: bool(of_type(log, Assigned, "pod-b")))
        for name in ("pod-a", "pod-d", "pod-b"):
            assert await workloads[name].finish() == 0
        log = await wait_for_log(stack, lambda log: len(of_type(log, Released)) == 4)
        assigned = len(of_type(log, Assigned))
        completed = sum(1 for e in of_type(log, Released) if e.event.reason == "completed")
        await prometheus.until(
            f'gpupool_assignments_total{{node="{NODE}"}}',
            lambda r: bool(r) and float(r[0]["value"][1]) == assigned,
        )
        await prometheus.until(
            f'gpupool_releases_total{{node="{NODE}",reason="completed"}}',
            lambda r: bool(r) and float(r[0]["value"][1]) == completed,
        )
        waited = await prometheus.query(f'gpupool_wait_seconds_count{{node="{NODE}"}}')
        assert float(waited[0]["value"][1]) == 4  # every PodReady ended in an Assigned
        await prometheus.until(
            f'sum(gpupool_gpu_allocated_limit_percent{{node="{NODE}"}})',
            lambda r: bool(r) and float(r[0]["value"][1]) == 0.0,
        )
        # the simulated inventory is flagged, and the alert rule for it fires
        await prometheus.until(
            'ALERTS{alertname="GpupoolSimulatedInventory",alertstate="firing"}',
            lambda r: len(r) == 1,
        )
