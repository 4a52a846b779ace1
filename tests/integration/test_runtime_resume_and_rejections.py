"""The decider loop at the seams where the log meets the world (issue 9, findings 6, 8, 9).

* A rejection is recorded once, forever: a replica rebuilding from zero long after
  (outside any dedupe window) sees the rejection already in the log and adds none.
* A service rebuilt from zero is not handed the folded log a second time: its
  durable starts where the rebuild ended.
* Cancelling the consumer works while a burst of messages keeps arriving (real
  JetStream): the pull loop waits with asyncio.timeout, which never loses it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from contextlib import suppress
from datetime import UTC, datetime

import pytest

from gpupool.eventlog import InMemoryEventLog, JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import Envelope, Event, MessageRejected, PodRef, PodRegistered, Share
from gpupool.runtime.decider import DeciderLoop

T0 = datetime(2025, 4, 22, 8, 0, 0, tzinfo=UTC)


def envelope(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=T0, event=event)


def registered(name: str, node: str = "n") -> PodRegistered:
    """A pod's registration: an event every service folds without question (a PodReady of a
    pod nobody registered would itself be set aside: gpupool.core.admission_check)."""
    share = Share(core=10, memory=10)
    return PodRegistered(
        pod=PodRef(namespace="default", name=name),
        node=node,
        policy="share-pool",
        requests=share,
        limits=share,
    )


class CountingLog(InMemoryEventLog):
    """Counts the rejections a service asks to append (JetStream would keep every copy
    appended outside its dedupe window; the in-memory log dedupes forever)."""

    def __init__(self) -> None:
        super().__init__()
        self.rejections_asked = 0
        self.delivered: list[int] = []

    async def append(self, envelope: Envelope, *, expected_node_seq: int | None = None) -> int:
        if isinstance(envelope.event, MessageRejected):
            self.rejections_asked += 1
        return await super().append(envelope, expected_node_seq=expected_node_seq)

    def subscribe(self, *, durable: str, node: str | None = None, from_seq: int = 1):  # type: ignore[no-untyped-def]
        inner = super().subscribe(durable=durable, node=node, from_seq=from_seq)
        log = self

        class Counted:
            def __aiter__(self) -> Counted:
                return self

            async def __anext__(self):  # type: ignore[no-untyped-def]
                delivery = await inner.__anext__()
                log.delivered.append(delivery.entry.seq)
                return delivery

            def take_ready(self, limit: int):  # type: ignore[no-untyped-def]
                taken = inner.take_ready(limit)
                log.delivered.extend(delivery.entry.seq for delivery in taken)
                return taken

            async def ack_many(self, deliveries, *, now=False):  # type: ignore[no-untyped-def]
                await inner.ack_many(deliveries, now=now)

            async def aclose(self) -> None:
                await inner.aclose()

        return Counted()


async def test_a_rejection_is_recorded_once_even_by_a_replica_rebuilding_from_zero() -> None:
    log = CountingLog()
    await log.append(envelope(registered("a")))
    garbage = await log.append_raw("gpupool.log.n.PodReady", b"\x00 not json")
    first = DeciderLoop(log, service="admission-queue")
    await first.rebuild()
    assert log.rejections_asked == 1
    rejections = [
        e
        async for e in log.replay()
        if isinstance(e, StoredEvent) and isinstance(e.envelope.event, MessageRejected)
    ]
    assert [r.envelope.event.seq for r in rejections] == [garbage]  # type: ignore[union-attr]
    # much later, another replica rebuilds from zero: the rejection is already there
    second = DeciderLoop(log, service="admission-queue")
    await second.rebuild()
    assert log.rejections_asked == 1
    assert second.projection.state.rejected_messages == 1


async def test_a_rejection_written_before_it_named_its_sequence_is_recognised_by_its_id() -> None:
    log = CountingLog()
    garbage = await log.append_raw("gpupool.log.n.PodReady", b"{broken")
    old_style = Envelope(
        id=f"rejected-{garbage}",
        time=T0,
        event=MessageRejected(subject="gpupool.log.n.PodReady", reason="old", payload="{broken"),
    )
    await log.append(old_style)
    asked = log.rejections_asked
    loop = DeciderLoop(log, service="policy")
    await loop.rebuild()
    assert log.rejections_asked == asked


async def test_a_service_rebuilt_from_zero_is_not_handed_the_folded_log_again() -> None:
    log = CountingLog()
    for index in range(200):
        await log.append(envelope(registered(f"p{index}")))
    loop = DeciderLoop(log, service="admission-queue")
    await loop.rebuild()
    live = asyncio.Event()
    seen: list[int] = []

    async def react(entry: StoredEvent) -> None:
        seen.append(entry.seq)
        live.set()

    consumer = asyncio.create_task(loop.consume("admission-queue-x", react))
    try:
        later = await log.append(envelope(registered("later")))
        async with asyncio.timeout(5):
            await live.wait()
        assert seen == [later]
        assert log.delivered == [later], "the durable delivered folded entries again"
    finally:
        consumer.cancel()
        with suppress(asyncio.CancelledError):
            await consumer


@pytest.mark.integration
async def test_cancelling_the_consumer_works_while_a_burst_keeps_arriving(
    jetstream_log: JetStreamEventLog,
) -> None:
    """Finding 9: with wait_for, 11 of 11 cancellations under a burst were lost on 3.11."""
    for attempt in range(5):
        loop = DeciderLoop(jetstream_log, service=f"burst-{attempt}")
        await loop.rebuild()
        reacted = asyncio.Event()

        async def react(_: StoredEvent, reacted: asyncio.Event = reacted) -> None:
            reacted.set()

        stop_burst = asyncio.Event()

        async def burst(stop: asyncio.Event = stop_burst, attempt: int = attempt) -> None:
            index = 0
            while not stop.is_set():
                batch: Sequence[Envelope] = [
                    envelope(registered(f"b{attempt}-{index}-{i}", node=f"n{i % 4}"))
                    for i in range(50)
                ]
                await jetstream_log.append_many(batch)
                index += 1

        publisher = asyncio.create_task(burst())
        consumer = asyncio.create_task(
            loop.consume(f"burst-{attempt}-{uuid.uuid4().hex[:6]}", react)
        )
        try:
            async with asyncio.timeout(10):
                await reacted.wait()  # the consumer is taking the burst
            consumer.cancel()
            async with asyncio.timeout(5):  # cancelled while messages keep arriving
                with suppress(asyncio.CancelledError):
                    await consumer
            assert consumer.done()
        finally:
            stop_burst.set()
            await publisher
            consumer.cancel()
            with suppress(asyncio.CancelledError):
                await consumer


async def test_a_node_partitioned_loop_sets_garbage_on_its_node_aside_once() -> None:
    """A loop that reads one node's entries does not fold the node-less rejections: it looks
    them up on the node-less subject, so a replica rebuilding from zero adds none."""
    log = CountingLog()
    await log.append(envelope(registered("a")))
    await log.append(envelope(registered("b", node="other")))
    garbage = await log.append_raw("gpupool.log.n.PodReady", b"\x00 not json")
    first = DeciderLoop(log, service="node-executor", partition="n")
    await first.rebuild()
    assert log.rejections_asked == 1
    second = DeciderLoop(log, service="node-executor", partition="n")
    await second.rebuild()
    assert log.rejections_asked == 1
    assert second.projection.undecodable == 1
    assert set(second.projection.state.nodes) | {
        p.node for p in second.projection.state.pods.values()
    } == {"n"}
    assert second.projection.last_seq >= garbage
