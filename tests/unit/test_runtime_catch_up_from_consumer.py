"""After a conflict, the decider catches up from its own consumer, not from a new replay.

Two admission-queue replicas share one log (one writer token). Replica B assigns the
only GPU while replica A is deciding on the same PodReady: A's append is refused, A
folds B's Assigned from its own durable (no replay opened), decides again (nothing
left to assign), reacts to the caught-up entry and acks it. Both ways a decision can
meet its conflict: during ``consume``'s reaction (the catch-up reads the consumer) and
beside it (a pipelined decision: it waits for ``consume`` to fold the entry).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime

from gpupool.admission_queue.service import AdmissionQueue
from gpupool.core import Schedule
from gpupool.eventlog import InMemoryEventLog, StoredEvent
from gpupool.eventlog.port import DecisionAppend, Entry, append_each
from gpupool.eventlog.subjects import node_entry_subject
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
from gpupool.runtime.decider import DeciderLoop

NOW = datetime(2025, 1, 1, tzinfo=UTC)
WAIT_S = 10.0
POD = PodRef(namespace="default", name="only")


class ReplayCountingLog(InMemoryEventLog):
    def __init__(self) -> None:
        super().__init__(writer="admission-queue")
        self.replays = 0

    async def replay(self, *, node: str | None = None, from_seq: int = 1) -> AsyncIterator[Entry]:
        self.replays += 1
        async for entry in super().replay(node=node, from_seq=from_seq):
            yield entry


async def append_as(log: InMemoryEventLog, writer: str, event: Event) -> int:
    envelope = Envelope(id=uuid.uuid4().hex, time=NOW, event=event)
    return await log.append_raw(
        node_entry_subject("n", writer=writer, prefix=log.subject_prefix),
        encode_envelope(envelope),
    )


async def node_with_one_gpu_and_a_pod(log: InMemoryEventLog) -> None:
    for event in (
        GpuInventoryReported(
            node="n", gpus=(GpuInfo(index=0, uuid="GPU-0", memory_mib=1),), source="simulated"
        ),
        NodeConfigured(node="n", policy="share-pool", qos=QosConfig(), gpu_count=1),
        PodRegistered(
            pod=POD,
            node="n",
            policy="share-pool",
            requests=Share(core=1, memory=1),
            limits=Share(core=100, memory=100),
            priority=0,
            uid="uid-only",
        ),
    ):
        writer = "node-executor" if isinstance(event, GpuInventoryReported) else "policy"
        await append_as(log, writer, event)


async def test_a_conflict_met_while_reacting_is_caught_up_from_the_services_own_consumer() -> None:
    log = ReplayCountingLog()
    await node_with_one_gpu_and_a_pod(log)
    a = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)
    await a.rebuild()
    await append_as(log, "node-executor", PodReady(pod=POD, node="n"))
    b = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)
    await b.rebuild()
    replays_before = log.replays

    service = AdmissionQueue(pipelined=False)
    service._loop = a
    batches: list[list[StoredEvent]] = []
    reacted_to_b = asyncio.Event()

    async def react_batch(entries: list[StoredEvent]) -> None:
        batches.append(entries)
        if len(batches) == 1:  # B decides first, on the same PodReady
            assert [type(e) for e in await b.execute(Schedule(node="n"), node="n")] == [Assigned]
        await service.react_batch(entries)
        if any(isinstance(entry.envelope.event, Assigned) for entry in entries):
            reacted_to_b.set()

    consumer = asyncio.create_task(
        a.consume("aq-a", service.react, react_batch=react_batch, ack_before_reacting=True)
    )
    try:
        async with asyncio.timeout(WAIT_S):
            await reacted_to_b.wait()
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)

    assert a.conflicts == 1
    assert (a.catch_ups_from_consumer, a.catch_up_replays) == (1, 0)
    assert log.replays == replays_before, "a conflict opened a replay"
    assigned = [
        entry
        async for entry in log.replay()
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, Assigned)
    ]
    assert len(assigned) == 1  # A decided again after folding B's: nothing more to assign
    assert a.projection.state.pods[POD].phase == "running"
    # the caught-up entry was reacted to in a later batch, and acked
    assert [[type(e.envelope.event) for e in batch] for batch in batches] == [
        [PodReady],
        [Assigned],
    ]
    assert not log._consumers["aq-a"].outstanding


class ReplicaBFirst:
    """Replica A's view of the log: replica B decides just before A's first append lands."""

    def __init__(self, inner: ReplayCountingLog, b: DeciderLoop) -> None:
        self.inner = inner
        self.b = b
        self.tripped = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def append_decision(
        self,
        envelopes: Sequence[Envelope],
        *,
        expected_node_seq: int | None = None,
        expected_writer: str | None = None,
    ) -> int:
        if not self.tripped:
            self.tripped = True
            assert [type(e) for e in await self.b.execute(Schedule(node="n"), node="n")] == [
                Assigned
            ]
        return await self.inner.append_decision(
            envelopes, expected_node_seq=expected_node_seq, expected_writer=expected_writer
        )

    async def append_decisions(self, decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
        return await append_each(self, decisions)  # type: ignore[arg-type]  # through the above


async def test_a_pipelined_decisions_conflict_waits_for_the_consumer_to_fold_the_entry() -> None:
    log = ReplayCountingLog()
    await node_with_one_gpu_and_a_pod(log)
    b = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)
    view = ReplicaBFirst(log, b)
    a = DeciderLoop(view, service="admission-queue", clock=lambda: NOW)  # type: ignore[arg-type]
    await a.rebuild()
    await append_as(log, "node-executor", PodReady(pod=POD, node="n"))
    await b.rebuild()
    replays_before = log.replays
    service = AdmissionQueue()  # pipelined: decisions run beside the consumer
    service._loop = a
    reacted_to_b = asyncio.Event()

    async def react_batch(entries: list[StoredEvent]) -> None:
        await service.react_batch(entries)
        if any(isinstance(entry.envelope.event, Assigned) for entry in entries):
            reacted_to_b.set()

    consumer = asyncio.create_task(
        a.consume("aq-a", service.react, react_batch=react_batch, ack_before_reacting=True)
    )
    try:
        async with asyncio.timeout(WAIT_S):
            await reacted_to_b.wait()
            await service.settled()
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)

    assert a.conflicts == 1
    assert (a.catch_ups_from_consumer, a.catch_up_replays) == (1, 0)
    assert log.replays == replays_before, "a conflict opened a replay"
    assigned = [
        entry
        async for entry in log.replay()
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, Assigned)
    ]
    assert len(assigned) == 1
    assert a.projection.state.pods[POD].phase == "running"
