"""The node-executor ends a pod whose processes hold more GPU memory than its limit and
records the release as out-of-memory. There is no GPU here, so the GPU is a stand-in
sampler that reports the workload's real pid holding more than its limit; everything
else is real: nats-server, the services (in this process), the socket, the processes."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from stack_harness import follow_log

from gpupool.admission_queue.service import AdmissionQueue
from gpupool.eventlog.jetstream import JetStreamEventLog
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.eventlog.port import StoredEvent
from gpupool.events import InventorySource, PodRef, PodRegistered, Released
from gpupool.gpus import GpuSample, simulated_inventory
from gpupool.node_executor.processes import ProcessSupervisor
from gpupool.node_executor.service import NodeExecutor
from gpupool.policy.local_config import load_local_cluster
from gpupool.policy.service import PolicyService
from gpupool.runtime.service import ServiceOptions, run_service
from gpupool.workload import Exited, RunRequest
from gpupool.workload.client import run_workload

CLUSTER = """
nodes: [{name: n1, gpus: 1}]
pods:
  - {name: hungry, node: n1, requests: {core: 10, memory: 10}, limits: {core: 100, memory: 25}}
"""


class OverLimitSampler:
    """Stands in for NVML: every running workload's leader holds 1 MiB more than its limit."""

    def __init__(self, executor: NodeExecutor) -> None:
        self.executor = executor

    @property
    def source(self) -> InventorySource:
        return "nvml"

    def sample(self) -> tuple[GpuSample, ...]:
        gpu = self.executor.inventory.gpus[0]
        limit = gpu.memory_mib * 25 // 100 * 1024 * 1024
        pids = {
            session.workload.pid: limit + 1024 * 1024
            for session in self.executor.sessions.values()
            if session.workload is not None
        }
        return (
            GpuSample(
                index=0,
                uuid=gpu.uuid,
                memory_used_bytes=sum(pids.values()),
                memory_total_bytes=gpu.memory_mib * 1024 * 1024,
                utilisation=1.0,
                process_memory_bytes=pids,
            ),
        )


async def registered(url: str, pod: str) -> None:
    await follow_log(
        url,
        lambda log: any(
            isinstance(e.event, PodRegistered) and e.event.pod.name == pod for e in log
        ),
    )


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[str]:
    async with run_nats_server(tmp_path / "nats") as url:
        yield url


async def test_memory_over_the_limit_ends_the_pod_as_out_of_memory(
    tmp_path: Path, nats_server: str
) -> None:
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(CLUSTER)
    inventory = simulated_inventory(1, 1000, node="n1")
    executor = NodeExecutor(
        node="n1",
        inventory=inventory,
        socket_path=tmp_path / "gpupool.sock",
        sampler=None,  # type: ignore[arg-type]  # set below: the sampler reads the executor
        supervisor=ProcessSupervisor(records_dir=tmp_path / "records"),
        memory_guard_period_seconds=0.05,
    )
    executor.sampler = OverLimitSampler(executor)
    stop = asyncio.Event()

    def options(port: int) -> ServiceOptions:
        return ServiceOptions(
            nats_url=nats_server,
            http_host="127.0.0.1",
            http_port=0,
            stream="GPUPOOL",
            instance=f"t{port}",
        )

    async with AsyncExitStack() as stack:
        policy = PolicyService(load_local_cluster(cluster_file))
        tasks = [asyncio.create_task(run_service(policy, options(1), stop))]
        await registered(nats_server, "hungry")  # the others rebuild from a log that has it
        tasks += [
            asyncio.create_task(run_service(AdmissionQueue(), options(2), stop)),
            asyncio.create_task(run_service(executor, options(3), stop)),
        ]

        async def shutdown() -> None:
            stop.set()
            await asyncio.gather(*tasks)

        stack.push_async_callback(shutdown)
        async with asyncio.timeout(30):
            await executor.serving.wait()
        messages = []
        devnull = os.open(os.devnull, os.O_RDWR)
        request = RunRequest(
            pod=PodRef(namespace="default", name="hungry"),
            argv=[sys.executable, "-c", "import signal; signal.pause()"],  # runs until ended
            cwd="/",
            env={},
        )
        async with asyncio.timeout(30):
            code = await run_workload(
                tmp_path / "gpupool.sock",
                request,
                on_message=messages.append,
                fds=(devnull, devnull, devnull),
            )
        os.close(devnull)

    assert isinstance(messages[-1], Exited)
    assert messages[-1].reason == "out-of-memory"
    assert code == 137
    log = await JetStreamEventLog.connect(nats_server)
    try:
        releases = [
            e.envelope.event
            async for e in log.replay()
            if isinstance(e, StoredEvent) and isinstance(e.envelope.event, Released)
        ]
    finally:
        await log.close()
    assert [(r.reason, r.pod.name) for r in releases] == [("out-of-memory", "hungry")]
