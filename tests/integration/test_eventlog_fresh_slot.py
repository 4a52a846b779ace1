"""A service restarted behind its own durable: nothing of the rebuilt log is delivered again.

No credential may delete a consumer, so a durable slot that lags behind where a restarted
service's rebuild ended (the instance before acknowledged little, the rebuild went from
zero) cannot be started again there. Resumed, it would deliver every folded entry a
second time (each acked unread). Instead the restarted service claims a fresh slot at
its rebuild's end and leaves the lagging one to expire (docs/eventlog.md, "Subscribe");
a restart after that resumes the fresh slot, so restarts in a loop hold at most two.
On a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import UTC, datetime

import pytest
from log_streams import delete_stream, unique_stream

from gpupool.eventlog import JetStreamEventLog
from gpupool.eventlog.archive import StreamOperator
from gpupool.eventlog.durables import CLAIMANT
from gpupool.eventlog.jetstream import FRESH_SLOT_LAG
from gpupool.eventlog.port import StoredEvent
from gpupool.eventlog.subjects import node_subject_filter
from gpupool.events import Envelope, Event, MessageRejected, PodReady, PodRef
from gpupool.runtime.decider import DeciderLoop

pytestmark = pytest.mark.integration

USER = "admission-queue"
INSTANCE = "aq-1"
WAIT_S = 30.0


async def connected(nats_url: str, stream: str, prefix: str) -> JetStreamEventLog:
    """A log of the instance, as the service connects it (its claimant set)."""
    return await JetStreamEventLog.connect(
        nats_url, stream=stream, subject_prefix=prefix, claimant=INSTANCE
    )


def wrap(event: Event, name: str) -> Envelope:
    return Envelope(
        id=f"{name}-{uuid.uuid4().hex}", time=datetime(2025, 1, 1, tzinfo=UTC), event=event
    )


def rejected(name: str) -> Envelope:
    return wrap(MessageRejected(subject="test", reason=name, payload=""), name)


def ready(node: str, pod: str) -> Envelope:
    return wrap(PodReady(pod=PodRef(namespace="default", name=pod), node=node), pod)


async def restarted_from_zero(
    connect: object, writer: JetStreamEventLog, live: str
) -> tuple[str, int]:
    """A restart of the instance from an empty projection: rebuild, consume, react to one
    live entry. Returns the durable it consumed from and how many messages that durable has
    delivered in all."""
    assert callable(connect)
    log: JetStreamEventLog = await connect()
    loop = DeciderLoop(log, service=USER)
    reacted: asyncio.Queue[StoredEvent] = asyncio.Queue()

    async def react(entry: StoredEvent) -> None:
        await reacted.put(entry)

    try:
        await loop.rebuild()
        consumer = asyncio.create_task(loop.consume(USER, react))
        seq = await writer.append(rejected(live))
        async with asyncio.timeout(WAIT_S):
            first = await reacted.get()
        assert first.seq == seq  # nothing folded by the rebuild was reacted to
        subscription = loop._subscription
        assert subscription is not None
        durable = subscription.durable
        info = await log._consumer_info(durable)
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        return durable, info.delivered.consumer_seq or 0
    finally:
        await log.close()


async def test_a_service_restarted_from_zero_behind_its_durable_is_delivered_only_live_entries(
    nats_url: str,
) -> None:
    stream, prefix = unique_stream()

    async def connect() -> JetStreamEventLog:
        return await connected(nats_url, stream, prefix)

    writer = await connect()
    try:
        # the instance before claimed its slot at the log's start and acknowledged nothing
        await writer.append(rejected("before"))
        before = writer.subscribe(durable=USER)
        async with asyncio.timeout(WAIT_S):
            await anext(before)
        lagging = before.durable
        await before.aclose()
        await writer.append_many([rejected(f"e{i}") for i in range(FRESH_SLOT_LAG + 100)])

        durable, delivered = await restarted_from_zero(connect, writer, "live-1")
        assert durable != lagging  # a fresh slot, claimed where the rebuild ended
        assert delivered == 1  # the live entry alone: the folded log is not delivered again
        assert (await writer._consumer_info(lagging)).delivered.consumer_seq == 1  # left alone

        # restarted again (a restart loop): the fresh slot, acknowledged furthest, is resumed
        again, delivered_again = await restarted_from_zero(connect, writer, "live-2")
        assert again == durable
        assert delivered_again == 2  # one more: the second live entry
        infos = await writer._js.consumers_info(stream)
        held = sorted(
            info.name for info in infos if (info.config.metadata or {}).get(CLAIMANT) == INSTANCE
        )
        assert held == sorted([lagging, durable])  # no third slot
        operator = await StreamOperator.connect(nats_url, stream=stream, subject_prefix=prefix)
        try:
            # both slots stand for one reader: a purge asks for its snapshot once
            assert await operator.durables() == [f"{USER}-{INSTANCE}"]
        finally:
            await operator.close()
    finally:
        await writer.close()
        await delete_stream(nats_url, stream)


async def test_a_caught_up_durable_of_a_quiet_node_is_resumed_not_replaced(nats_url: str) -> None:
    stream, prefix = unique_stream()

    async def connect() -> JetStreamEventLog:
        return await connected(nats_url, stream, prefix)

    writer = await connect()
    try:
        await writer.append(ready("node-a", "a-0"))
        before = writer.subscribe(durable=USER, node="node-a")
        async with asyncio.timeout(WAIT_S):
            delivery = await anext(before)
            await delivery.ack()  # taken or still on its way: either way nothing lags
        caught_up = before.durable
        await before.aclose()
        # the rest of the cluster moves on; node-a is quiet: its filter has nothing pending
        await writer.append_many([ready("node-b", f"b-{i}") for i in range(FRESH_SLOT_LAG + 100)])
        rebuilt_to = await writer.last_seq()

        restarted = await connect()
        try:
            durable, _ = await restarted._claim_durable(
                USER,
                INSTANCE,
                node_subject_filter("node-a", prefix=prefix),
                rebuilt_to + 1,
            )
        finally:
            await restarted.close()
        assert durable == caught_up  # resumed: nothing of it lags, no second slot taken
    finally:
        await writer.close()
        await delete_stream(nats_url, stream)
