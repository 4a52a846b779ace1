"""Batched consumption: the decider loop folds everything delivered, then reacts once.

An admission-queue handed a burst decides once per node the burst touched (not once
per event), and acks the whole batch after its decisions committed.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

from gpupool.admission_queue.service import AdmissionQueue
from gpupool.eventlog import InMemoryEventLog, StoredEvent
from gpupool.eventlog.subjects import subject_for
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
    encode_envelope,
)
from gpupool.runtime.decider import DeciderLoop, last_entry_per_node

NOW = datetime(2025, 1, 1, tzinfo=UTC)
WAIT_S = 10.0


def wrap(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=NOW, event=event)


def node_with_pods(node: str, pods: int) -> list[Event]:
    events: list[Event] = [
        GpuInventoryReported(
            node=node,
            gpus=(GpuInfo(index=0, uuid=f"GPU-{node}", memory_mib=1),),
            source="simulated",
        ),
        NodeConfigured(node=node, policy="share-pool", qos=QosConfig(), gpu_count=1),
    ]
    for index in range(pods):
        events.append(
            PodRegistered(
                pod=PodRef(namespace="default", name=f"{node}-{index}"),
                node=node,
                policy="share-pool",
                requests=Share(core=1, memory=1),
                limits=Share(core=10, memory=10),
                priority=0,
                uid=f"uid-{node}-{index}",
            )
        )
    return events


async def append_as_producers(log: InMemoryEventLog, events: list[Event]) -> None:
    """Each event on the subject of the service that appends it (gpupool.core.producers):
    the inventory and PodReady by the node-executor, the rest by the policy."""
    for event in events:
        writer = "node-executor" if isinstance(event, GpuInventoryReported | PodReady) else "policy"
        subject = subject_for(event, prefix=log.subject_prefix, writer=writer)
        await log.append_raw(subject, encode_envelope(wrap(event)))


def test_a_batch_touches_each_node_once_with_its_last_event() -> None:
    a1, b1, a2 = (
        StoredEvent(
            seq=seq,
            subject="s",
            envelope=wrap(PodReady(pod=PodRef(namespace="default", name=n), node=node)),
        )
        for seq, (n, node) in enumerate((("x", "a"), ("y", "b"), ("z", "a")), start=1)
    )

    touched = last_entry_per_node([a1, b1, a2])

    assert list(touched) == ["a", "b"]
    assert touched["a"] is a2.envelope


async def test_an_admission_queue_decides_once_per_node_of_a_burst_and_acks_it_all() -> None:
    log = InMemoryEventLog(writer="admission-queue")
    for node in ("a", "b"):
        await append_as_producers(log, node_with_pods(node, 5))
    loop = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)
    await loop.rebuild()
    service = AdmissionQueue()
    service._loop = loop
    batches: list[list[StoredEvent]] = []
    decided = asyncio.Event()

    async def react_batch(entries: list[StoredEvent]) -> None:
        batches.append(entries)
        await service.react_batch(entries)
        decided.set()

    # the burst is in the log before the consumer looks: it is delivered as one batch
    await append_as_producers(
        log,
        [
            PodReady(pod=PodRef(namespace="default", name=f"{node}-{index}"), node=node)
            for index in range(5)
            for node in ("a", "b")
        ],
    )
    consumer = asyncio.create_task(loop.consume("aq", service.react, react_batch=react_batch))
    async with asyncio.timeout(WAIT_S):
        await decided.wait()
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)

    assert [len(batch) for batch in batches] == [10]
    entries = [entry async for entry in log.replay(from_seq=loop.consume_from)]
    decisions = {
        entry.seq
        for entry in entries
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, Assigned)
    }
    assert len(decisions) == 2, "one decision entry per node touched"
    assigned = [
        e for e in entries if isinstance(e, StoredEvent) and isinstance(e.envelope.event, Assigned)
    ]
    assert len(assigned) == 10
    # every PodReady delivered was acked: a new subscriber of the durable gets none again
    again = log.subscribe(durable="aq", from_seq=1)
    left = [entry for delivery in again.take_ready(100) for entry in delivery.entries]
    await again.aclose()
    assert not [
        e for e in left if isinstance(e, StoredEvent) and isinstance(e.envelope.event, PodReady)
    ]
