"""The admission-queue's pipelined decisions start at once: when ``react_batch`` returns, the
decision for each node it touched has been made and handed to the log (only its
acknowledgement is awaited in a task), and a node whose decision landed within that step is
free for the next one."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

from gpupool.admission_queue.service import AdmissionQueue
from gpupool.eventlog import InMemoryEventLog, StoredEvent
from gpupool.eventlog.port import DecisionAppend, append_each
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
WAIT_S = 10.0
PODS = [PodRef(namespace="default", name=f"p{index}") for index in range(3)]


def wrap(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=NOW, event=event)


async def append_as(log: InMemoryEventLog, writer: str, event: Event) -> None:
    subject = subject_for(event, prefix=log.subject_prefix, writer=writer)
    await log.append_raw(subject, encode_envelope(wrap(event)))


async def node_with_pods(log: InMemoryEventLog) -> None:
    await append_as(
        log,
        "node-executor",
        GpuInventoryReported(
            node="n", gpus=(GpuInfo(index=0, uuid="GPU-n", memory_mib=1),), source="simulated"
        ),
    )
    await append_as(
        log, "policy", NodeConfigured(node="n", policy="share-pool", qos=QosConfig(), gpu_count=1)
    )
    for pod in PODS:
        await append_as(
            log,
            "policy",
            PodRegistered(
                pod=pod,
                node="n",
                policy="share-pool",
                requests=Share(core=1, memory=1),
                limits=Share(core=10, memory=10),
                priority=0,
                uid=f"uid-{pod.name}",
            ),
        )


async def ready(log: InMemoryEventLog, loop: DeciderLoop, pod: PodRef) -> list[StoredEvent]:
    """The pod's PodReady appended by the executor and folded: the batch to react to."""
    await append_as(log, "node-executor", PodReady(pod=pod, node="n"))
    before = loop.projection.last_seq
    await loop.rebuild()
    return [
        entry
        async for entry in log.replay(from_seq=before + 1)
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, PodReady)
    ]


class AckWaitsForGate:
    """The log, but every decision's acknowledgement waits until the gate opens (as a
    PubAck does): the append itself is recorded when it is called."""

    def __init__(self, inner: InMemoryEventLog) -> None:
        self.inner = inner
        self.appended: list[list[Envelope]] = []
        self.gate = asyncio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def append_decision(
        self,
        envelopes: Sequence[Envelope],
        *,
        expected_node_seq: int | None = None,
        expected_writer: str | None = None,
    ) -> int:
        self.appended.append(list(envelopes))
        seq = await self.inner.append_decision(
            envelopes, expected_node_seq=expected_node_seq, expected_writer=expected_writer
        )
        await self.gate.wait()
        return seq

    async def append_decisions(self, decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
        return await append_each(self, decisions)  # type: ignore[arg-type]  # through the above


def assigned(envelopes: list[Envelope]) -> list[PodRef]:
    return [e.event.pod for e in envelopes if isinstance(e.event, Assigned)]


async def test_react_batch_returns_with_the_decision_already_handed_to_the_log() -> None:
    inner = InMemoryEventLog(writer="admission-queue")
    await node_with_pods(inner)
    log = AckWaitsForGate(inner)
    loop = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)  # type: ignore[arg-type]
    await loop.rebuild()
    service = AdmissionQueue()
    service._loop = loop

    await service.react_batch(await ready(inner, loop, PODS[0]))

    # no turn of the event loop in between: the decision was made and appended in the call
    assert [assigned(envelopes) for envelopes in log.appended] == [[PODS[0]]]
    # poked again while its acknowledgement is awaited: decided once more afterwards
    await service.react_batch(await ready(inner, loop, PODS[1]))
    assert len(log.appended) == 1
    log.gate.set()
    async with asyncio.timeout(WAIT_S):
        await service.settled()
    assert [assigned(envelopes) for envelopes in log.appended] == [[PODS[0]], [PODS[1]]]


async def test_a_decision_that_landed_within_the_poke_leaves_the_node_free() -> None:
    log = InMemoryEventLog(writer="admission-queue")  # its appends never wait
    await node_with_pods(log)
    loop = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)
    await loop.rebuild()
    service = AdmissionQueue()
    service._loop = loop

    for pod in PODS:
        await service.react_batch(await ready(log, loop, pod))
        assert loop.projection.state.pods[pod].phase == "running"  # decided, appended, folded

    async with asyncio.timeout(WAIT_S):
        await service.settled()  # nothing left in flight
    decided = [
        entry.envelope.event.pod
        async for entry in log.replay()
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, Assigned)
    ]
    assert decided == PODS
