"""A waiting pod's session must not lose the wake-up of its Assigned.

The session sends the waiting message, and only then waits for a change. If the
Assigned arrives while that message is being sent (a client slow to read), the change
must still count: the command starts at once, not one waiting-message period later.

Real parts: the node-executor service object, a real process for the command, the
in-memory log with a second decider as the admission-queue; the client is a stand-in
channel whose first Waiting send blocks until the test lets it through.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack, suppress
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpupool.core import Schedule
from gpupool.eventlog import InMemoryEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInventoryReported,
    NodeConfigured,
    PodRef,
    PodRegistered,
    QosConfig,
    Share,
)
from gpupool.gpus import simulated_inventory
from gpupool.node_executor.inventory import sampler_for
from gpupool.node_executor.peer_identity import PeerIdentity
from gpupool.node_executor.processes import ProcessSupervisor
from gpupool.node_executor.service import NodeExecutor
from gpupool.runtime.decider import DeciderLoop
from gpupool.workload import ExecutorMessage, RunRequest, Started, Waiting

pytestmark = pytest.mark.integration

NODE = "n1"
POD = PodRef(namespace="default", name="a")
T0 = datetime(2025, 4, 22, 8, 0, 0, tzinfo=UTC)


def node_with_one_pod() -> list[Event]:
    inventory = simulated_inventory(1, node=NODE)
    return [
        GpuInventoryReported(node=NODE, gpus=inventory.gpus, source="simulated"),
        NodeConfigured(node=NODE, policy="share-pool", qos=QosConfig(), gpu_count=1),
        PodRegistered(
            pod=POD,
            node=NODE,
            policy="share-pool",
            requests=Share(core=50, memory=50),
            limits=Share(core=50, memory=50),
            priority=0,
            uid="uid-a",
        ),
    ]


class SlowClient:
    """The executor's side of a connection whose client reads the first Waiting late."""

    def __init__(self) -> None:
        self.peer = PeerIdentity(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
        self.messages: list[ExecutorMessage] = []
        self.sending = asyncio.Event()
        self.let_through = asyncio.Event()
        self.started = asyncio.Event()
        self._gone = asyncio.Event()

    @property
    def client_gone(self) -> bool:
        return self._gone.is_set()

    async def wait_client_gone(self) -> None:
        await self._gone.wait()

    async def send(self, message: ExecutorMessage) -> bool:
        if isinstance(message, Waiting) and not self.sending.is_set():
            self.sending.set()
            await self.let_through.wait()
        self.messages.append(message)
        if isinstance(message, Started):
            self.started.set()
        return True


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_RDWR)
    yield fd
    os.close(fd)


async def test_assigned_while_the_waiting_message_is_being_sent_starts_the_command_at_once(
    tmp_path: Path, devnull: int
) -> None:
    log = InMemoryEventLog()
    for event in node_with_one_pod():
        await log.append(Envelope(id=uuid.uuid4().hex, time=T0, event=event))
    loop = DeciderLoop(log, service="node-executor")
    await loop.rebuild()
    executor = NodeExecutor(
        node=NODE,
        inventory=simulated_inventory(1, node=NODE),
        socket_path=tmp_path / "gpupool.sock",
        sampler=sampler_for(simulated_inventory(1, node=NODE)),
        supervisor=ProcessSupervisor(),
        message_period_seconds=0.05,
    )
    assigned_seen = asyncio.Event()

    async def react(entry: StoredEvent) -> None:
        await executor.react(entry)
        if isinstance(entry.envelope.event, Assigned):
            assigned_seen.set()

    client = SlowClient()
    request = RunRequest(pod=POD, argv=[sys.executable, "-c", "pass"], cwd=str(tmp_path), env={})
    async with AsyncExitStack() as stack:
        stack.push_async_callback(log.close)
        await executor.start(loop, stack)
        consumer = asyncio.create_task(loop.consume("node-executor-test", react))
        handling = asyncio.create_task(
            executor.handle(request, (devnull, devnull, devnull), client)  # type: ignore[arg-type]
        )
        try:
            async with asyncio.timeout(10):
                await client.sending.wait()  # the first Waiting is on its way
            admission = DeciderLoop(log, service="admission-queue")
            await admission.rebuild()
            assert await admission.execute(Schedule(node=NODE), node=NODE)
            async with asyncio.timeout(10):
                await assigned_seen.wait()
            # from now on the next waiting message is far away: only the wake-up starts it
            executor.message_period_override = 3600.0
            client.let_through.set()
            async with asyncio.timeout(5):
                await client.started.wait()
            async with asyncio.timeout(10):
                await handling
        finally:
            for task in (handling, consumer):
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
