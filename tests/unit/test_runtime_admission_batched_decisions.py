"""The admission-queue decides a batch's nodes together: their decisions go to the log in one
``append_decisions`` call, awaited by one task; a node whose decision a conflict refused is
decided again on its own after catching up (never twice); a node poked while a later round of
its batch is in flight is decided (it is free once its round's decisions are in), a decision
that landed without its acknowledgement is not booked twice, and stopping the service cancels a batch still waiting for its acknowledgements and frees its nodes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

from gpupool.admission_queue.service import AdmissionQueue
from gpupool.core import Schedule
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
    event_node,
)
from gpupool.runtime.decider import DeciderLoop, _has_waiters
from gpupool.runtime.eager import start_now

NOW = datetime(2025, 1, 1, tzinfo=UTC)
WAIT_S = 10.0
NODES = ["n1", "n2", "n3"]


def pod_of(node: str, number: int = 0) -> PodRef:
    return PodRef(namespace="default", name=f"pod-{node}" + (f"-{number}" if number else ""))


async def append_as(log: InMemoryEventLog, writer: str, event: Event) -> None:
    envelope = Envelope(id=uuid.uuid4().hex, time=NOW, event=event)
    await log.append_raw(
        subject_for(event, prefix=log.subject_prefix, writer=writer), encode_envelope(envelope)
    )


async def nodes_with_one_pod_each(log: InMemoryEventLog, *, pods: int = 1) -> None:
    """Each node one GPU; its pods take 40 % of it each (two fit)."""
    for node in NODES:
        gpus = (GpuInfo(index=0, uuid=f"GPU-{node}", memory_mib=1),)
        await append_as(
            log, "node-executor", GpuInventoryReported(node=node, gpus=gpus, source="simulated")
        )
        await append_as(
            log,
            "policy",
            NodeConfigured(node=node, policy="share-pool", qos=QosConfig(), gpu_count=1),
        )
        for number in range(pods):
            await append_as(
                log,
                "policy",
                PodRegistered(
                    pod=pod_of(node, number),
                    node=node,
                    policy="share-pool",
                    requests=Share(core=40, memory=40),
                    limits=Share(core=40, memory=40),
                    priority=0,
                    uid=f"uid-{node}-{number}",
                ),
            )


async def all_ready(
    log: InMemoryEventLog, loop: DeciderLoop, nodes: Sequence[str] = NODES, number: int = 0
) -> list[StoredEvent]:
    """The nodes' PodReady appended by the executor and folded: the batch to react to."""
    before = loop.projection.last_seq
    for node in nodes:
        await append_as(log, "node-executor", PodReady(pod=pod_of(node, number), node=node))
    await loop.rebuild()
    return [
        entry
        async for entry in log.replay(from_seq=before + 1)
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, PodReady)
    ]


async def assignments(log: InMemoryEventLog) -> list[PodRef]:
    return [
        entry.envelope.event.pod
        async for entry in log.replay()
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, Assigned)
    ]


class Batches:
    """The log, recording the nodes of each ``append_decisions`` call; ``before`` runs first
    (once), ``gate`` holds the acknowledgements back while it is closed."""

    def __init__(self, inner: InMemoryEventLog) -> None:
        self.inner = inner
        self.calls: list[list[str]] = []
        self.before: list[asyncio.Future[None] | None] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.called = asyncio.Event()
        """Set on each call."""
        self.permits: asyncio.Semaphore | None = None
        """Where set, each call's acknowledgements wait for a permit of their own."""
        self.other_replica: DeciderLoop | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def append_decisions(self, decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
        self.calls.append([event_node(d.envelopes[0].event) for d in decisions])
        self.called.set()
        if self.other_replica is not None:  # decides n2 first, on the same PodReady
            other, self.other_replica = self.other_replica, None
            assert await other.execute(Schedule(node="n2"), node="n2")
        outcomes = await self.inner.append_decisions(decisions)
        await self.gate.wait()
        if self.permits is not None:
            await self.permits.acquire()
        return outcomes


async def test_a_batchs_nodes_are_decided_in_one_append_and_all_land() -> None:
    inner = InMemoryEventLog(writer="admission-queue")
    await nodes_with_one_pod_each(inner)
    log = Batches(inner)
    loop = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)  # type: ignore[arg-type]
    await loop.rebuild()
    service = AdmissionQueue()
    service._loop = loop

    await service.react_batch(await all_ready(inner, loop))

    assert log.calls == [NODES]  # decided and handed over within the poke, together
    assert sorted(await assignments(inner)) == sorted(pod_of(node) for node in NODES)
    assert all(loop.projection.state.pods[pod_of(node)].phase == "running" for node in NODES)
    assert not service._busy and not service._deciding


async def test_a_node_refused_in_a_batch_is_decided_again_after_catching_up_never_twice() -> None:
    inner = InMemoryEventLog(writer="admission-queue")
    await nodes_with_one_pod_each(inner)
    log = Batches(inner)
    a = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)  # type: ignore[arg-type]
    await a.rebuild()
    batch = await all_ready(inner, a)
    b = DeciderLoop(inner, service="admission-queue", clock=lambda: NOW)  # the other replica
    await b.rebuild()
    log.other_replica = b
    service = AdmissionQueue()
    service._loop = a

    await service.react_batch(batch)
    async with asyncio.timeout(WAIT_S):
        await service.settled()

    assert a.conflicts == 1
    assert sorted(await assignments(inner)) == sorted(pod_of(node) for node in NODES)  # n2: B's
    assert a.projection.state.pods[pod_of("n2")].phase == "running"  # folded B's after the conflict
    assert log.calls == [NODES]  # n2 was decided again alone (execute): nothing left to assign
    assert not service._busy and not service._deciding


async def test_a_node_poked_while_a_later_round_of_its_batch_is_in_flight_is_decided() -> None:
    inner = InMemoryEventLog(writer="admission-queue")
    await nodes_with_one_pod_each(inner, pods=2)
    log = Batches(inner)
    log.permits = asyncio.Semaphore(0)  # each batch's acknowledgements wait for a permit
    loop = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)  # type: ignore[arg-type]
    await loop.rebuild()
    service = AdmissionQueue()
    service._loop = loop
    await service.react_batch(await all_ready(inner, loop, ["n1", "n2"]))
    # n1 poked during the first round: decided again, in a second round of the same batch
    await service.react_batch(await all_ready(inner, loop, ["n1"], number=1))
    log.permits.release()
    async with asyncio.timeout(WAIT_S):
        while log.calls != [["n1", "n2"], ["n1"]]:
            log.called.clear()
            await log.called.wait()  # the batch's second round
    # n2's decision is in: poked while the second round is in flight, it is decided now
    await service.react_batch(await all_ready(inner, loop, ["n2"], number=1))
    assert log.calls == [["n1", "n2"], ["n1"], ["n2"]]
    log.permits.release()
    log.permits.release()
    async with asyncio.timeout(WAIT_S):
        await service.settled()

    assert sorted(await assignments(inner)) == sorted(
        pod_of(node, number) for node in ("n1", "n2") for number in (0, 1)
    )
    assert not service._busy and not service._deciding and not service._again


async def test_stopping_cancels_a_batch_waiting_for_its_acknowledgements_and_frees_its_nodes() -> (
    None
):
    inner = InMemoryEventLog(writer="admission-queue")
    await nodes_with_one_pod_each(inner)
    log = Batches(inner)
    log.gate.clear()  # the acknowledgements never come
    loop = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)  # type: ignore[arg-type]
    await loop.rebuild()
    service = AdmissionQueue()
    service._loop = loop
    await service.react_batch(await all_ready(inner, loop))
    assert set(service._busy) == set(NODES)
    batch = next(iter(service._deciding.values()))

    async with asyncio.timeout(WAIT_S):
        await service._stop_deciding()

    assert batch.cancelled()
    assert not service._busy and not service._deciding and not service._again
    assert loop.failure is None  # a stop, not a failure


class LostAcknowledgements(Batches):
    """The log, whose first ``lost`` decisions land but are answered with a lost PubAck."""

    def __init__(self, inner: InMemoryEventLog, lost: int) -> None:
        super().__init__(inner)
        self.lost = lost

    async def append_decisions(self, decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
        outcomes = await super().append_decisions(decisions)
        for index, outcome in enumerate(outcomes):
            if self.lost and not isinstance(outcome, Exception):
                self.lost -= 1
                outcomes[index] = TimeoutError("the PubAck was lost (the entry landed)")
        return outcomes


async def test_a_decision_that_landed_without_its_acknowledgement_is_not_booked_twice() -> None:
    inner = InMemoryEventLog(writer="admission-queue")
    await nodes_with_one_pod_each(inner)
    log = LostAcknowledgements(inner, lost=2)
    loop = DeciderLoop(log, service="admission-queue", clock=lambda: NOW)  # type: ignore[arg-type]
    await loop.rebuild()
    service = AdmissionQueue()
    service._loop = loop

    await service.react_batch(await all_ready(inner, loop))
    async with asyncio.timeout(WAIT_S):
        await service.settled()

    assert log.lost == 0  # two decisions' publishes failed as far as the batch knew
    # decided again, refused on the node's expectation until the landed entry is folded:
    # each pod is assigned once
    assert sorted(await assignments(inner)) == sorted(pod_of(node) for node in NODES)
    assert loop.failure is None
    assert not service._busy and not service._deciding


async def test_a_node_lock_just_released_to_a_waiter_counts_as_held_for_a_batch() -> None:
    # released, the lock is no longer locked() but promised to the task waiting for it: a
    # batch taking it would queue behind that task and suspend mid-step
    lock = asyncio.Lock()
    await lock.acquire()
    waiter = start_now(lock.acquire())  # queued behind the holder when this returns
    lock.release()

    assert not lock.locked() and _has_waiters(lock)
    await waiter
    lock.release()
    assert not _has_waiters(lock)
