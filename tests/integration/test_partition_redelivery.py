"""A node's partitioned reader loses none of its node's entries, and its watermark keeps up.

Real parts: a nats-server with JetStream, the durable pull consumer a partitioned
DeciderLoop reads through, and a pull request whose delivery is lost in flight (as at a
reconnect): JetStream hands the entry out again only after the ack wait, after later
entries of the node. The loop must still fold that entry and react to it. A quiet node
(no entry of its own near the log's end) has its watermark at the stream's end after the
rebuild and after a catch-up, so a purge does not see it as behind.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import nats
import pytest
from log_streams import delete_stream, unique_stream

from gpupool.eventlog import JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.eventlog.subjects import node_subject_filter
from gpupool.events import Envelope, Event, NodeConfigured, PodRef, PodRegistered, QosConfig, Share
from gpupool.runtime.decider import DeciderLoop

pytestmark = pytest.mark.integration

T0 = datetime(2025, 4, 22, 8, 0, tzinfo=UTC)
ACK_WAIT_S = 1.0
WAIT_S = 15.0


def envelope(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=T0, event=event)


def configured(node: str) -> Envelope:
    return envelope(NodeConfigured(node=node, policy="share-pool", qos=QosConfig(), gpu_count=1))


def registered(name: str, node: str) -> Envelope:
    share = Share(core=10, memory=10)
    return envelope(
        PodRegistered(
            pod=PodRef(namespace="default", name=name),
            node=node,
            policy="share-pool",
            requests=share,
            limits=share,
        )
    )


@pytest.fixture
async def short_ack_log(nats_url: str) -> AsyncIterator[JetStreamEventLog]:
    stream, prefix = unique_stream()
    log = await JetStreamEventLog.connect(
        nats_url, stream=stream, subject_prefix=prefix, ack_wait=ACK_WAIT_S
    )
    try:
        yield log
    finally:
        await log.close()
        await delete_stream(nats_url, stream)


async def lose_one_delivery(nats_url: str, log: JetStreamEventLog, durable: str) -> None:
    """Pull one entry of the durable into an inbox that drops it (a delivery lost in flight)."""
    nc = await nats.connect(nats_url)
    try:
        inbox = nc.new_inbox()
        handed_out = asyncio.Event()

        async def drop(_: object) -> None:
            handed_out.set()  # delivered, never acked: out with the server until the ack wait

        await nc.subscribe(inbox, cb=drop)
        await nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{log.stream}.{durable}",
            json.dumps({"batch": 1}).encode(),
            reply=inbox,
        )
        async with asyncio.timeout(WAIT_S):
            await handed_out.wait()
    finally:
        await nc.close()


async def test_an_own_node_entry_whose_delivery_was_lost_is_folded_and_reacted_to(
    nats_url: str, short_ack_log: JetStreamEventLog
) -> None:
    log = short_ack_log
    lost = await log.append(configured("a"))
    await log.append(configured("b"))  # another node's entry between: a gap in the partition
    durable = "node-executor-test-a"
    await log._ensure_consumer(
        durable, node_subject_filter("a", prefix=log.subject_prefix), from_seq=1
    )
    await lose_one_delivery(nats_url, log, durable)
    later = await log.append(registered("p", "a"))  # delivered first, after the lost one

    loop = DeciderLoop(log, service="node-executor", partition="a")
    reacted: list[int] = []
    both = asyncio.Event()

    async def react(entry: StoredEvent) -> None:
        reacted.append(entry.seq)
        if {lost, later} <= set(reacted):
            both.set()

    consuming = asyncio.create_task(loop.consume(durable, react))
    try:
        async with asyncio.timeout(WAIT_S):  # the lost one comes again after ACK_WAIT_S
            await both.wait()
    finally:
        consuming.cancel()
        await asyncio.gather(consuming, return_exceptions=True)
    state = loop.projection.state
    assert "a" in state.nodes and state.nodes["a"].policy == "share-pool"
    assert PodRef(namespace="default", name="p") in state.pods
    assert "b" not in state.nodes


async def test_a_quiet_nodes_watermark_reaches_the_streams_end_after_rebuild_and_catch_up(
    short_ack_log: JetStreamEventLog,
) -> None:
    log = short_ack_log
    await log.append(configured("a"))
    for name in ("p", "q", "r"):
        await log.append(registered(name, "b"))
    loop = DeciderLoop(log, service="node-executor", partition="a")
    await loop.rebuild()
    assert loop.projection.last_seq == await log.last_seq() == 4
    assert loop.consume_from == 5

    await log.append(registered("s", "b"))
    await log.append(registered("t", "b"))
    await loop._catch_up()  # after a conflict
    assert loop.projection.last_seq == await log.last_seq() == 6

    await log.append(registered("u", "b"))
    await loop.keep_up()  # before each snapshot
    assert loop.projection.last_seq == await log.last_seq() == 7
    assert "b" not in loop.projection.state.nodes
    assert loop.catch_up_replays == 1


async def test_keeping_up_folds_the_nodes_entries_beyond_the_watermark_first(
    short_ack_log: JetStreamEventLog,
) -> None:
    log = short_ack_log
    loop = DeciderLoop(log, service="node-executor", partition="a")
    await loop.rebuild()
    await log.append(registered("p", "b"))
    own = await log.append(configured("a"))
    await log.append(registered("q", "b"))
    await loop.keep_up()
    assert loop.projection.last_seq == 3
    assert "a" in loop.projection.state.nodes
    assert own in loop._caught_up  # reacted to when the consumer delivers it
