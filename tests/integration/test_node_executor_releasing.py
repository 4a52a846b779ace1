"""The node-executor records a deleted pod's end only once its processes are gone (issue 9).

Real parts: the node-executor service object, a real process for the command that
takes its time to stop after SIGTERM, the in-memory log with a second decider as the
admission-queue. The client is a stand-in channel that records what it is told.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack, suppress
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpupool.core import RemovePod, RequestGpu, Schedule
from gpupool.eventlog import InMemoryEventLog
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInventoryReported,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    QosConfig,
    Released,
    Share,
)
from gpupool.gpus import simulated_inventory
from gpupool.node_executor.inventory import sampler_for
from gpupool.node_executor.peer_identity import PeerIdentity
from gpupool.node_executor.processes import ProcessSupervisor, group_members
from gpupool.node_executor.service import NodeExecutor
from gpupool.runtime.decider import DeciderLoop
from gpupool.workload import ExecutorMessage, Rejected, RunRequest, Started

pytestmark = pytest.mark.integration

NODE = "n1"
A = PodRef(namespace="default", name="a")
B = PodRef(namespace="default", name="b")
T0 = datetime(2025, 4, 22, 8, 0, 0, tzinfo=UTC)
SLOW_TO_STOP = (
    "import signal, sys, time\n"
    "def stop(*_):\n"
    "    time.sleep(0.5)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "print('up', flush=True)\n"
    "time.sleep(60)\n"
)


def pod(ref: PodRef, policy: str = "share-pool", share: int = 100) -> PodRegistered:
    return PodRegistered(
        pod=ref,
        node=NODE,
        policy=policy,  # type: ignore[arg-type]
        requests=Share(core=share, memory=share),
        limits=Share(core=share, memory=share),
        uid=f"uid-{ref.name}",
    )


class Client:
    def __init__(self) -> None:
        self.peer = PeerIdentity(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
        self.messages: list[ExecutorMessage] = []
        self.changed = asyncio.Event()
        self._gone = asyncio.Event()

    @property
    def client_gone(self) -> bool:
        return self._gone.is_set()

    async def wait_client_gone(self) -> None:
        await self._gone.wait()

    async def send(self, message: ExecutorMessage) -> bool:
        self.messages.append(message)
        self.changed.set()
        return True

    async def until(self, kind: type) -> ExecutorMessage:
        async with asyncio.timeout(10):
            while True:
                found = next((m for m in self.messages if isinstance(m, kind)), None)
                if found is not None:
                    return found
                self.changed.clear()
                await self.changed.wait()


class WatchedLog(InMemoryEventLog):
    """The in-memory log, noting at the moment of each append whether a pid still lives."""

    def __init__(self) -> None:
        super().__init__()
        self.pid: int | None = None
        self.alive_at_release: list[bool] = []
        self.a_ready = asyncio.Event()

    def _watch(self, envelopes: Sequence[Envelope]) -> None:
        for envelope in envelopes:
            event = envelope.event
            if isinstance(event, PodReady) and event.pod == A:
                self.a_ready.set()
            if isinstance(event, Released) and event.pod == A and self.pid is not None:
                # the group's live members (zombies excluded), as the executor counts them
                self.alive_at_release.append(bool(group_members(self.pid)))

    async def append(self, envelope: Envelope, *, expected_node_seq: int | None = None) -> int:
        self._watch([envelope])
        return await super().append(envelope, expected_node_seq=expected_node_seq)

    async def append_decision(
        self,
        envelopes: Sequence[Envelope],
        *,
        expected_node_seq: int | None = None,
        expected_writer: str | None = None,
    ) -> int:
        self._watch(envelopes)
        return await super().append_decision(
            envelopes, expected_node_seq=expected_node_seq, expected_writer=expected_writer
        )


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_RDWR)
    yield fd
    os.close(fd)


async def start_executor(
    log: InMemoryEventLog, given: list[Event], tmp_path: Path, stack: AsyncExitStack
) -> tuple[NodeExecutor, DeciderLoop]:
    for event in given:
        await log.append(Envelope(id=uuid.uuid4().hex, time=T0, event=event))
    loop = DeciderLoop(log, service="node-executor")
    await loop.rebuild()
    inventory = simulated_inventory(1, node=NODE)
    executor = NodeExecutor(
        node=NODE,
        inventory=inventory,
        socket_path=tmp_path / "gpupool.sock",
        sampler=sampler_for(inventory),
        supervisor=ProcessSupervisor(),
        message_period_seconds=3600,
    )
    stack.push_async_callback(log.close)
    await executor.start(loop, stack)
    return executor, loop


async def decider(log: InMemoryEventLog, service: str) -> DeciderLoop:
    loop = DeciderLoop(log, service=service)
    await loop.rebuild()
    return loop


async def test_a_deleted_running_pod_is_released_only_after_its_process_is_gone(
    tmp_path: Path, devnull: int
) -> None:
    """Finding 2: the GPU was handed to the next pod while SIGTERM was still being waited out."""
    log = WatchedLog()
    inventory = simulated_inventory(1, node=NODE)
    given: list[Event] = [
        GpuInventoryReported(node=NODE, gpus=inventory.gpus, source="simulated"),
        NodeConfigured(node=NODE, policy="share-pool", qos=QosConfig(), gpu_count=1),
        pod(A),
        pod(B),
    ]
    async with AsyncExitStack() as stack:
        executor, loop = await start_executor(log, given, tmp_path, stack)
        consumer = asyncio.create_task(loop.consume("node-executor-test", executor.react))
        client = Client()
        request = RunRequest(
            pod=A, argv=[sys.executable, "-c", SLOW_TO_STOP], cwd=str(tmp_path), env={}
        )
        handling = asyncio.create_task(
            executor.handle(request, (devnull, devnull, devnull), client)  # type: ignore[arg-type]
        )
        try:
            async with asyncio.timeout(10):
                await log.a_ready.wait()
            admission = await decider(log, "admission-queue")
            assert assigned(await admission.execute(Schedule(node=NODE), node=NODE)) == [A]
            started = await client.until(Started)
            assert isinstance(started, Started)
            log.pid = started.pid
            other = await decider(log, "another-executor")
            await other.execute(RequestGpu(pod=B, node=NODE), node=NODE)  # b waits
            policy = await decider(log, "policy")
            await policy.execute(RemovePod(pod=A, node=NODE), node=NODE)
            # a's process is being ended: its slot still counts, b gets nothing yet
            await admission.rebuild()
            assert await admission.execute(Schedule(node=NODE), node=NODE) == []
            async with asyncio.timeout(10):
                await handling
            assert log.alive_at_release, "no Released(a) was recorded"
            assert not any(log.alive_at_release), "Released was recorded while the process ran"
            await admission.rebuild()
            assert assigned(await admission.execute(Schedule(node=NODE), node=NODE)) == [B]
        finally:
            for task in (handling, consumer):
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task


def assigned(events: list[Event]) -> list[PodRef]:
    return [event.pod for event in events if isinstance(event, Assigned)]


async def test_a_static_pod_without_a_gpu_is_told_so_instead_of_spinning(
    tmp_path: Path, devnull: int
) -> None:
    """Finding 1: a dormant static pod without its GPU made the session loop without yielding."""
    log = InMemoryEventLog()
    inventory = simulated_inventory(1, node=NODE)
    given: list[Event] = [
        GpuInventoryReported(node=NODE, gpus=inventory.gpus, source="simulated"),
        NodeConfigured(node=NODE, policy="static", qos=QosConfig(), gpu_count=1),
        pod(A, policy="static"),  # registered, but never bound (a half-committed decision)
    ]
    async with AsyncExitStack() as stack:
        executor, loop = await start_executor(log, given, tmp_path, stack)
        consumer = asyncio.create_task(loop.consume("node-executor-test", executor.react))
        client = Client()
        request = RunRequest(pod=A, argv=[sys.executable, "-c", "pass"], cwd=str(tmp_path), env={})
        try:
            async with asyncio.timeout(10):
                await executor.handle(request, (devnull, devnull, devnull), client)  # type: ignore[arg-type]
            rejected = await client.until(Rejected)
            assert isinstance(rejected, Rejected)
            assert rejected.reason == "NoStaticGpu"
        finally:
            consumer.cancel()
            with suppress(asyncio.CancelledError):
                await consumer
