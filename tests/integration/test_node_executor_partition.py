"""A node-executor reads only its own node's entries, and still runs and ends its pods.

Real parts: a nats-server with JetStream (one stream, two nodes' traffic), the node-executor
service object on node A with its partitioned decider loop (``partition=A``: rebuild,
consumer and catch-ups read ``<prefix>.A.>`` only), real processes for A's commands, an
admission-queue loop that reads the whole log and schedules both nodes, and node B's own
executor loop making B's traffic. The log the executor reads through counts what it is
handed, by the node its subject names; a whole-log reader counts the same traffic as the
control (so the count of B's entries seen by A can fail).
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from log_streams import delete_stream

from gpupool.core import RemovePod, ReportRelease, RequestGpu, Schedule, State
from gpupool.eventlog import InMemoryEventLog, JetStreamEventLog
from gpupool.eventlog.port import Delivery, Entry, StoredEvent
from gpupool.eventlog.subjects import node_of_subject
from gpupool.events import (
    Envelope,
    Event,
    GpuInventoryReported,
    NodeConfigured,
    PodRef,
    PodRegistered,
    QosConfig,
    Share,
    event_node,
)
from gpupool.gpus import simulated_inventory
from gpupool.node_executor.inventory import sampler_for
from gpupool.node_executor.peer_identity import PeerIdentity
from gpupool.node_executor.processes import ProcessSupervisor
from gpupool.node_executor.service import NodeExecutor
from gpupool.runtime.decider import DeciderLoop
from gpupool.workload import ExecutorMessage, Exited, RunRequest, Started

pytestmark = pytest.mark.integration

NODE_A, NODE_B = "gpu-a.example", "gpu-b.example"
T0 = datetime(2025, 4, 22, 8, 0, 0, tzinfo=UTC)
B_ROUNDS = 4
"""Placements of each of B's two pods: B's traffic while A's pods run."""


def ref(name: str) -> PodRef:
    return PodRef(namespace="default", name=name)


def node_events(node: str, pods: list[str]) -> list[Event]:
    inventory = simulated_inventory(1, node=node)
    events: list[Event] = [
        GpuInventoryReported(node=node, gpus=inventory.gpus, source="simulated"),
        NodeConfigured(node=node, policy="share-pool", qos=QosConfig(), gpu_count=1),
    ]
    events += [
        PodRegistered(
            pod=ref(name),
            node=node,
            policy="share-pool",
            requests=Share(core=100, memory=100),  # one at a time on the node's one GPU
            limits=Share(core=100, memory=100),
            uid=f"uid-{name}",
        )
        for name in pods
    ]
    return events


class CountingSubscription:
    """A subscription that counts its deliveries by the node their subject names."""

    def __init__(self, inner: Any, counts: Counter[str | None]) -> None:
        self._inner = inner
        self._counts = counts

    def _count(self, delivery: Delivery) -> Delivery:
        self._counts[node_of_subject(delivery.entries[0].subject)] += 1
        return delivery

    def __aiter__(self) -> CountingSubscription:
        return self

    async def __anext__(self) -> Delivery:
        return self._count(await self._inner.__anext__())

    def take_ready(self, limit: int) -> list[Delivery]:
        return [self._count(d) for d in self._inner.take_ready(limit)]

    async def ack_many(self, deliveries: list[Delivery], *, now: bool = False) -> None:
        await self._inner.ack_many(deliveries, now=now)

    async def aclose(self) -> None:
        await self._inner.aclose()


class CountingLog:
    """The event log as a loop reads it, counting deliveries and replayed entries by node."""

    def __init__(self, inner: JetStreamEventLog | InMemoryEventLog) -> None:
        self._inner = inner
        self.delivered: Counter[str | None] = Counter()
        self.replayed: Counter[str | None] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def subscribe(self, **options: Any) -> CountingSubscription:
        return CountingSubscription(self._inner.subscribe(**options), self.delivered)

    async def replay(self, **options: Any) -> AsyncIterator[Entry]:
        async for entry in self._inner.replay(**options):
            self.replayed[node_of_subject(entry.subject)] += 1
            yield entry

    async def replay_batches(self, **options: Any) -> AsyncIterator[list[Entry]]:
        async for batch in self._inner.replay_batches(**options):
            for entry in batch:
                self.replayed[node_of_subject(entry.subject)] += 1
            yield batch


class Client:
    """The executor's side of a client connection: records what it is told."""

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
        while True:
            found = next((m for m in self.messages if isinstance(m, kind)), None)
            if found is not None:
                return found
            self.changed.clear()
            await self.changed.wait()


class Watched:
    """A loop's projection, with a wait for a condition on its state after each reaction."""

    def __init__(self, loop: DeciderLoop) -> None:
        self.loop = loop
        self.changed = asyncio.Event()

    async def react(self, entry: StoredEvent) -> None:
        self.changed.set()

    async def until(self, holds: Callable[[State], bool]) -> None:
        while not holds(self.loop.projection.state):
            self.changed.clear()
            await self.changed.wait()


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_RDWR)
    yield fd
    os.close(fd)


async def test_an_executor_reads_only_its_node_and_still_starts_and_ends_its_pods(
    nats_url: str, tmp_path: Path, devnull: int
) -> None:
    token = uuid.uuid4().hex[:12]
    stream, prefix = f"TEST_{token}", f"test_{token}.log"

    async def connect(writer: str) -> JetStreamEventLog:
        log = await JetStreamEventLog.connect(
            nats_url, stream=stream, subject_prefix=prefix, writer=writer
        )
        stack.push_async_callback(log.close)
        return log

    tasks: list[asyncio.Task[Any]] = []
    async with AsyncExitStack() as stack:
        stack.push_async_callback(delete_stream, nats_url, stream)
        policy_log = await connect("policy")
        inventory_log = await connect("node-executor")  # an inventory is the executor's event
        for event in node_events(NODE_A, ["a1", "a2", "a3"]) + node_events(NODE_B, ["b1", "b2"]):
            writer = inventory_log if isinstance(event, GpuInventoryReported) else policy_log
            await writer.append(Envelope(id=uuid.uuid4().hex, time=T0, event=event))

        executor_log = CountingLog(await connect("node-executor"))
        loop = DeciderLoop(executor_log, service="node-executor", partition=NODE_A)  # type: ignore[arg-type]
        await loop.rebuild()
        inventory = simulated_inventory(1, node=NODE_A)
        executor = NodeExecutor(
            node=NODE_A,
            inventory=inventory,
            socket_path=tmp_path / "gpupool.sock",
            sampler=sampler_for(inventory),
            supervisor=ProcessSupervisor(),
            message_period_seconds=3600,
        )
        await executor.start(loop, stack)
        reacted: set[str] = set()
        executor_reacted = asyncio.Event()

        async def react(entry: StoredEvent) -> None:
            await executor.react(entry)
            reacted.add(entry.envelope.id)
            executor_reacted.set()

        tasks.append(asyncio.create_task(loop.consume("executor-a", react)))

        # the admission-queue reads the whole log (the control count) and schedules both nodes
        admission_log = CountingLog(await connect("admission-queue"))
        admission = DeciderLoop(admission_log, service="admission-queue")  # type: ignore[arg-type]
        await admission.rebuild()

        async def schedule(entry: StoredEvent) -> None:
            node = event_node(entry.envelope.event)
            if node:
                await admission.execute(Schedule(node=node), node=node, cause=entry.envelope)

        tasks.append(asyncio.create_task(admission.consume("admission", schedule)))

        # node B's own executor loop: B's pods placed and released, round after round
        b_loop = DeciderLoop(await connect("node-executor"), service="node-executor")
        await b_loop.rebuild()
        b_watch = Watched(b_loop)
        tasks.append(asyncio.create_task(b_loop.consume("executor-b", b_watch.react)))

        async def b_traffic() -> None:
            for _ in range(B_ROUNDS):
                for name in ("b1", "b2"):
                    pod = ref(name)
                    await b_loop.execute(RequestGpu(pod=pod, node=NODE_B), node=NODE_B)
                    await b_watch.until(lambda state, pod=pod: state.pods[pod].phase == "running")
                    await b_loop.execute(
                        ReportRelease(pod=pod, node=NODE_B, reason="completed", exit_code=0),
                        node=NODE_B,
                    )

        def run(name: str, code: str) -> tuple[Client, asyncio.Task[None]]:
            client = Client()
            request = RunRequest(
                pod=ref(name), argv=[sys.executable, "-c", code], cwd=str(tmp_path), env={}
            )
            task = asyncio.create_task(
                executor.handle(request, (devnull, devnull, devnull), client)  # type: ignore[arg-type]
            )
            tasks.append(task)
            return client, task

        try:
            async with asyncio.timeout(60):
                b_done = asyncio.create_task(b_traffic())
                tasks.append(b_done)
                first, first_done = run("a1", "pass")
                second, second_done = run("a2", "raise SystemExit(3)")
                await asyncio.gather(first_done, second_done)
                # a long one, deleted while it runs: the executor ends it
                third, third_done = run("a3", "import time; time.sleep(60)")
                await third.until(Started)
                policy = DeciderLoop(policy_log, service="policy")
                await policy.rebuild()
                await policy.execute(RemovePod(pod=ref("a3"), node=NODE_A), node=NODE_A)
                await third_done
                await b_done
                # a last entry of A's: once the executor reacted to it, it was handed all before
                marker = Envelope(
                    id=uuid.uuid4().hex, time=T0, event=node_events(NODE_A, ["a4"])[-1]
                )
                marker_seq = await policy_log.append(marker)
                while marker.id not in reacted:
                    executor_reacted.clear()
                    await executor_reacted.wait()
        finally:
            for task in tasks:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task

    done = {
        name: next(m for m in client.messages if isinstance(m, Exited))
        for name, client in (("a1", first), ("a2", second), ("a3", third))
    }
    assert (done["a1"].reason, done["a1"].exit_code) == ("completed", 0)
    assert (done["a2"].reason, done["a2"].exit_code) == ("failed", 3)
    assert done["a3"].reason == "cancelled"

    # the control: B's traffic was in the log, and a whole-log reader was handed it
    b_entries = admission_log.delivered[NODE_B] + admission_log.replayed[NODE_B]
    assert b_entries >= 3 * 2 * B_ROUNDS
    # the executor of A was handed none of it, by its consumer or by any replay
    assert executor_log.delivered[NODE_B] == 0
    assert executor_log.replayed[NODE_B] == 0
    assert executor_log.delivered[NODE_A] > 0
    # and its projection holds its node only
    state = loop.projection.state
    assert set(state.nodes) == {NODE_A}
    assert {pod.node for pod in state.pods.values()} == {NODE_A}
    assert loop.projection.last_seq == marker_seq
    assert not loop.projection.ahead, "the watermark passes the other node's sequences"
