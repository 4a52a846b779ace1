"""``gpupool verify`` passes a log the admission-queue writes when a PodReady lands while its
decision is in flight (the chaos run's finding in CI, commit 32000be: "a scheduling decision
on chaos-node (entry 75) left the head default/p1 waiting although GPU 1 has room for it").

The admission-queue's ``Assigned`` expects only the node's admission-queue entries
(docs/eventlog.md, "Which entries an expectation covers"), so an executor's PodReady appended
between its decision and its append does not refuse it: the decision assigns the head it knew
of and leaves the pod readied meanwhile, which then heads the queue and fits. The
admission-queue reacts to that PodReady with the next decision; an entry of the executor
before that reaction (another pod's PodReady) was reported as a violation, though no decision
that knew of the room left it idle. Both ways a decision is made are driven here, on the
service's own code: a reaction (it names its cause) and a start's (after a restart's
rebuild, no cause).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from datetime import UTC, datetime

import pytest

from gpupool.admission_queue.service import AdmissionQueue
from gpupool.cli.audit import verify
from gpupool.eventlog import DecisionAppend, InMemoryEventLog, StoredEvent
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
from gpupool.runtime.decider import DeciderLoop

NOW = datetime(2025, 1, 1, tzinfo=UTC)
NODE = "chaos-node"


def pod(name: str) -> PodRef:
    return PodRef(namespace="default", name=name)


async def append_as(log: InMemoryEventLog, writer: str, event: Event) -> StoredEvent:
    envelope = Envelope(id=uuid.uuid4().hex, time=NOW, event=event)
    seq = await log.append_raw(
        subject_for(event, prefix=log.subject_prefix, writer=writer), encode_envelope(envelope)
    )
    entries = [entry async for entry in log.replay(from_seq=seq)]
    assert isinstance(entries[0], StoredEvent)
    return entries[0]


class ReadyWhileInFlight:
    """The log, where ``before`` (once) appends another writer's entry between the decision
    and its append."""

    def __init__(self, inner: InMemoryEventLog) -> None:
        self.inner = inner
        self.before: Callable[[], Awaitable[object]] | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def _first(self) -> None:
        before, self.before = self.before, None
        if before is not None:
            await before()

    async def append_decision(self, envelopes: Sequence[Envelope], **expectation: object) -> int:
        await self._first()
        return await self.inner.append_decision(envelopes, **expectation)  # type: ignore[arg-type]

    async def append_decisions(self, decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
        await self._first()
        return await self.inner.append_decisions(decisions)


@pytest.mark.parametrize("decided_by", ["a reaction", "a start after a restart"])
async def test_a_pod_readied_while_a_decision_is_in_flight_is_no_violation(decided_by: str) -> None:
    inner = InMemoryEventLog(writer="admission-queue")
    gpus = tuple(GpuInfo(index=i, uuid=f"GPU-{i}", memory_mib=1) for i in range(2))
    await append_as(
        inner, "node-executor", GpuInventoryReported(node=NODE, gpus=gpus, source="simulated")
    )
    await append_as(
        inner,
        "policy",
        NodeConfigured(node=NODE, policy="share-pool", qos=QosConfig(), gpu_count=2),
    )
    for name in ("a", "b", "c"):  # half a GPU each
        await append_as(
            inner,
            "policy",
            PodRegistered(
                pod=pod(name),
                node=NODE,
                policy="share-pool",
                requests=Share(core=50, memory=50),
                limits=Share(core=50, memory=50),
                priority=0,
                uid=f"uid-{name}",
            ),
        )
    ready_a = await append_as(inner, "node-executor", PodReady(pod=pod("a"), node=NODE))
    log = ReadyWhileInFlight(inner)
    loop = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)  # type: ignore[arg-type]
    await loop.rebuild()
    service = AdmissionQueue(pipelined=False)
    readied: list[StoredEvent] = []

    async def ready_b() -> None:
        readied.append(await append_as(inner, "node-executor", PodReady(pod=pod("b"), node=NODE)))

    log.before = ready_b
    async with AsyncExitStack() as stack:
        if decided_by == "a reaction":
            service._loop = loop
            await service.react_batch([ready_a])
        else:
            await service.start(loop, stack)  # decides for every node, from the rebuild
        assert log.before is None  # b's PodReady landed before the decision that assigns a
        # the executor's next entry comes before the reaction to b's PodReady
        readied.append(await append_as(inner, "node-executor", PodReady(pod=pod("c"), node=NODE)))
        await loop.rebuild()  # folds them, as the consumer does
        await service.react_batch(readied)
        await service.settled()

    entries = [entry async for entry in inner.replay()]
    decisions = [
        sorted(e.envelope.event.pod.name for e in entries if e.seq == seq)  # type: ignore[union-attr]
        for seq in sorted(
            {
                e.seq
                for e in entries
                if isinstance(e, StoredEvent) and isinstance(e.envelope.event, Assigned)
            }
        )
    ]
    assert decisions == [["a"], ["b", "c"]]  # the log the race writes: a alone, then b and c
    report = verify(entries)
    assert report.ok, report.violations
