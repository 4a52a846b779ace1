"""DeciderLoop after an optimistic-concurrency conflict, on the in-memory log.

* Entries another process appended, folded while a decision for some *other* node
  catches up, must still get their reaction when the subscription delivers them
  (else a PodReady on that node waits for the next unrelated event: a lost wake-up).
* A decision that meets another writer before it commits lands not at all (one
  entry, all or nothing); the retry decides again on the caught-up state.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from contextlib import AsyncExitStack, suppress

from core_gwt import T0, node_events, ref, registered

from gpupool.admission_queue.service import AdmissionQueue
from gpupool.core import RequestGpu, Schedule
from gpupool.eventlog import InMemoryEventLog
from gpupool.eventlog.port import DecisionAppend, StoredEvent, append_each
from gpupool.events import Assigned, Envelope, Event, PodRef
from gpupool.runtime.decider import DeciderLoop


def envelope(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=T0, event=event)


async def append_all(log: InMemoryEventLog, events: Sequence[Event]) -> None:
    for event in events:
        await log.append(envelope(event))


async def assigned_in_log(log: InMemoryEventLog, pod: PodRef, *, within: float) -> bool:
    """Whether an Assigned for ``pod`` arrives in the log within ``within`` seconds."""
    subscription = log.subscribe(durable=f"watch-{uuid.uuid4().hex}")
    try:
        async with asyncio.timeout(within):
            async for delivery in subscription:
                await delivery.ack()
                entry = delivery.entry
                if (
                    isinstance(entry, StoredEvent)
                    and isinstance(entry.envelope.event, Assigned)
                    and entry.envelope.event.pod == pod
                ):
                    return True
    except TimeoutError:
        return False
    finally:
        await subscription.aclose()
    return False


async def test_a_pod_made_ready_while_another_node_catches_up_is_still_scheduled(
    memory_log: InMemoryEventLog,
) -> None:
    # n1 holds pod b, n2 holds pod a; a is ready before the admission-queue starts.
    await append_all(
        memory_log,
        [
            *node_events(1, node="n1"),
            *node_events(1, node="n2"),
            registered("b", 50, node="n1"),
            registered("a", 50, node="n2"),
            registered("c", 50, node="n2"),
        ],
    )
    executor = DeciderLoop(memory_log, service="node-executor")
    await executor.rebuild()
    await executor.execute(RequestGpu(pod=ref("a"), node="n2"), node="n2")

    admission = DeciderLoop(memory_log, service="admission-queue")
    await admission.rebuild()

    # Meanwhile (before the admission-queue folds them) the executor appends on both
    # nodes: b becomes ready on n1, and n2's last sequence moves (c becomes ready).
    await executor.execute(RequestGpu(pod=ref("b"), node="n1"), node="n1")
    await executor.execute(RequestGpu(pod=ref("c"), node="n2"), node="n2")

    service = AdmissionQueue()
    async with AsyncExitStack() as stack:
        # start() serves n1 (b not ready in its view yet: nothing), then n2: a conflict,
        # whose catch-up folds b's PodReady on n1.
        await service.start(admission, stack)
        assert admission.conflicts == 1
        consumer = asyncio.create_task(admission.consume("admission-queue-test", service.react))
        try:
            assert await assigned_in_log(memory_log, ref("b"), within=5.0), (
                "b's PodReady was folded during n2's catch-up and never reacted to"
            )
        finally:
            consumer.cancel()
            with suppress(asyncio.CancelledError):
                await consumer


class AnotherWriterFirst:
    """The in-memory log, but another writer appends on the node just before the first decision."""

    def __init__(self, inner: InMemoryEventLog, interloper: Event) -> None:
        self.inner = inner
        self.interloper = interloper
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
        if not self.tripped and len(envelopes) >= 2:
            self.tripped = True
            await self.inner.append(envelope(self.interloper))  # another process, same node
        return await self.inner.append_decision(
            envelopes, expected_node_seq=expected_node_seq, expected_writer=expected_writer
        )

    async def append_decisions(self, decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
        return await append_each(self, decisions)  # type: ignore[arg-type]  # through the above


async def test_a_decision_that_meets_another_writer_lands_whole_after_a_retry(
    memory_log: InMemoryEventLog,
) -> None:
    await append_all(
        memory_log,
        [
            *node_events(2, node="n1"),
            registered("a", 60, node="n1"),
            registered("b", 60, node="n1"),
        ],
    )
    executor = DeciderLoop(memory_log, service="node-executor")
    await executor.rebuild()
    for pod in ("a", "b"):
        await executor.execute(RequestGpu(pod=ref(pod), node="n1"), node="n1")

    log = AnotherWriterFirst(memory_log, registered("late", 10, node="n1"))
    admission = DeciderLoop(log, service="admission-queue")  # type: ignore[arg-type]
    await admission.rebuild()
    before = await memory_log.last_seq()
    events = await admission.execute(Schedule(node="n1"), node="n1")

    assert admission.conflicts == 1
    # the interloper, then ONE entry holding both Assigned: nothing landed in part
    assert await memory_log.last_seq() == before + 2
    in_log = [
        entry.envelope.event
        async for entry in memory_log.replay()
        if isinstance(entry, StoredEvent) and isinstance(entry.envelope.event, Assigned)
    ]
    assert sorted(e.pod.name for e in in_log) == ["a", "b"]
    assert sorted(e.pod.name for e in events if isinstance(e, Assigned)) == ["a", "b"]
    assert admission.projection.state.pods[ref("a")].phase == "running"
    assert admission.projection.state.pods[ref("b")].phase == "running"


async def test_a_failure_deciding_for_one_node_does_not_stop_the_others(
    memory_log: InMemoryEventLog,
) -> None:
    await append_all(memory_log, [*node_events(1, node="n1"), *node_events(1, node="n2")])
    loop = DeciderLoop(memory_log, service="admission-queue")
    await loop.rebuild()
    broken = loop.projection.state.nodes["n1"]
    broken.queue = [()]  # type: ignore[list-item]  # a state no fold produces: decide raises
    assert await loop.execute(Schedule(node="n1"), node="n1") == []
    assert loop.decide_failures == 1
    await append_all(memory_log, [registered("a", 50, node="n2")])
    await loop.rebuild()
    await loop.execute(RequestGpu(pod=ref("a"), node="n2"), node="n2")
    assert [type(e).__name__ for e in await loop.execute(Schedule(node="n2"), node="n2")] == [
        "Assigned"
    ]
