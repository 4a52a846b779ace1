"""Batches taken in the reader's step (``DeciderLoop.consume(react_on_arrival=True)``) while
something else is in flight (docs/eventlog.md, "Deciding in the reader's step"), on a real
nats-server:

* a reaction that waits for its own conflict's catch-up fails at once with
  ``ReactionWaitsOnArrival`` (it would stall the catch-up: only reactions that wait for
  none of their decisions may react on arrival).

Every wait is on a condition (a gate the test opens, an event, the server's ack floor).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime

import pytest
from log_streams import delete_stream, unique_stream

import gpupool.eventlog.jetstream as jetstream
import gpupool.runtime.decider as decider
from gpupool.core import Schedule
from gpupool.eventlog import JetStreamEventLog, StoredEvent
from gpupool.events import (
    Assigned,
    Envelope,
    Event,
    GpuInfo,
    GpuInventoryReported,
    NodeConfigured,
    PodReady,
    PodRef,
    PodRegistered,
    QosConfig,
    Share,
)
from gpupool.runtime.decider import DeciderLoop, ReactionWaitsOnArrival

pytestmark = pytest.mark.integration

NOW = datetime(2025, 1, 1, tzinfo=UTC)
WAIT_S = 30.0
DURABLE = "in-flight"
WRITERS = ("policy", "node-executor", "admission-queue", "admission-queue-2")


def wrap(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=NOW, event=event)


def pod(name: str) -> PodRef:
    return PodRef(namespace="default", name=name)


@asynccontextmanager
async def logs(nats_url: str) -> AsyncIterator[dict[str, JetStreamEventLog]]:
    """One connection per writer on one fresh stream (``admission-queue-2``: the other
    replica, under the same writer token)."""
    stream, prefix = unique_stream()
    opened: dict[str, JetStreamEventLog] = {}
    try:
        for writer in WRITERS:
            opened[writer] = await JetStreamEventLog.connect(
                nats_url, stream=stream, subject_prefix=prefix, writer=writer.removesuffix("-2")
            )
        yield opened
    finally:
        for log in opened.values():
            await log.close()
        await delete_stream(nats_url, stream)


async def cluster(logs: dict[str, JetStreamEventLog], pods: dict[str, list[str]]) -> None:
    """Each node one GPU and its pods registered (20 % of the GPU each), by their producers."""
    for node, names in pods.items():
        gpus = (GpuInfo(index=0, uuid=f"GPU-{node}", memory_mib=1),)
        await logs["node-executor"].append(
            wrap(GpuInventoryReported(node=node, gpus=gpus, source="simulated"))
        )
        await logs["policy"].append_many(
            [
                wrap(NodeConfigured(node=node, policy="share-pool", qos=QosConfig(), gpu_count=1)),
                *(
                    wrap(
                        PodRegistered(
                            pod=pod(name),
                            node=node,
                            policy="share-pool",
                            requests=Share(core=20, memory=20),
                            limits=Share(core=20, memory=20),
                            priority=0,
                            uid=f"uid-{name}",
                        )
                    )
                    for name in names
                ),
            ]
        )


async def ready(logs: dict[str, JetStreamEventLog], node: str, *names: str) -> list[int]:
    return await logs["node-executor"].append_many(
        [wrap(PodReady(pod=pod(name), node=node)) for name in names]
    )


async def assignments(log: JetStreamEventLog) -> list[PodRef]:
    return [
        entry.envelope.event.pod
        async for entry in log.replay()
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, Assigned)
    ]


async def stopped(consumer: asyncio.Task[None]) -> None:
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)


WAITING_REACTIONS: dict[str, Callable[[DeciderLoop, str], Awaitable[object]]] = {
    "in the batch's own task": lambda loop, node: loop.execute(Schedule(node=node), node=node),
    "through a task it awaits": lambda loop, node: asyncio.ensure_future(
        loop.execute(Schedule(node=node), node=node)
    ),
    "through a gather it awaits": lambda loop, node: asyncio.gather(
        loop.execute(Schedule(node=node), node=node)
    ),
}


@pytest.mark.parametrize("how", list(WAITING_REACTIONS))
async def test_a_reaction_on_arrival_that_waits_for_its_conflicts_catch_up_fails_at_once(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setattr(jetstream, "PULL_BATCH", 1)  # the first pull: the PodReady only
    # without the check the catch-up would wait this long (consume cannot fold meanwhile)
    monkeypatch.setattr(decider, "CATCH_UP_WAIT_S", 10 * WAIT_S)
    waits = WAITING_REACTIONS[how]
    async with logs(nats_url) as opened:
        await cluster(opened, {"n1": ["x1"]})
        loop = DeciderLoop(opened["admission-queue"], service="admission-queue", clock=lambda: NOW)
        await loop.rebuild()
        await ready(opened, "n1", "x1")
        b = DeciderLoop(opened["admission-queue-2"], service="admission-queue", clock=lambda: NOW)
        await b.rebuild()
        assert await b.execute(Schedule(node="n1"), node="n1")

        async def react(entry: StoredEvent) -> None:
            raise AssertionError("a batch reaction was given")

        async def react_batch(entries: list[StoredEvent]) -> None:
            for entry in entries:
                await waits(loop, entry.envelope.event.node)  # waits for its decision

        consumer = asyncio.create_task(
            loop.consume(DURABLE, react, react_batch=react_batch, react_on_arrival=True)
        )
        try:
            with pytest.raises(ReactionWaitsOnArrival, match="waits for the catch-up"):
                async with asyncio.timeout(WAIT_S):
                    await consumer
        finally:
            await stopped(consumer)
        assert loop.conflicts == 1
        assert loop.catch_up_replays == 0 and loop.catch_ups_from_consumer == 0
        assert not loop._arrival_batches
        assert await assignments(opened["policy"]) == [pod("x1")]  # B's only
