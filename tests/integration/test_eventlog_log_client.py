"""The log's NATS client against a real nats-server: raw subscriptions get every message's
undecoded parts in order, status messages are told apart, plain subscriptions and
JetStream requests on the same connection are nats-py's own, an unsubscribed raw
subscription gets nothing more, a frame sent ``now`` is written in the sender's step
(with the frames queued before it; the rest of that turn's frames go to the flusher), and
a flush's PING goes after the frames queued before it."""

from __future__ import annotations

import asyncio
import json

import pytest

from gpupool.eventlog.log_client import LogClient, header_value, inline_status, status_description
from gpupool.eventlog.wire import send_frame

pytestmark = pytest.mark.integration

WAIT_S = 20.0


async def connected(url: str) -> LogClient:
    client = LogClient()
    await client.connect(url, connect_timeout=2)
    return client


async def test_a_raw_subscription_gets_subject_reply_data_and_header_block_in_order(
    nats_url: str,
) -> None:
    client = await connected(nats_url)
    got: list[tuple[bytes, bytes, bytes, bytes | None]] = []
    all_in = asyncio.Event()

    def sink(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        got.append((subject, reply, data, headers))
        if len(got) == 3:
            all_in.set()

    try:
        await client.raw_subscribe("raw.>", sink)
        await client.publish("raw.a", b"one")
        await client.publish("raw.b", b"two", reply="back.1", headers={"Nats-Msg-Id": "x-1"})
        await client.publish("raw.c", b"")
        async with asyncio.timeout(WAIT_S):
            await all_in.wait()
    finally:
        await client.close()
    assert [(s, r, d) for s, r, d, _ in got] == [
        (b"raw.a", b"", b"one"),
        (b"raw.b", b"back.1", b"two"),
        (b"raw.c", b"", b""),
    ]
    assert got[0][3] is None
    assert header_value(got[1][3], "Nats-Msg-Id") == "x-1"
    assert inline_status(got[1][3]) is None


async def test_a_pull_that_expires_arrives_as_a_status_on_the_raw_subscription(
    nats_url: str,
) -> None:
    client = await connected(nats_url)
    js = client.jetstream()
    statuses: list[bytes] = []
    descriptions: list[str] = []
    ended = asyncio.Event()

    def sink(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        status = inline_status(headers)
        if status is not None and headers is not None:
            statuses.append(status)
            descriptions.append(status_description(headers))
            ended.set()

    try:
        await js.add_stream(name="RAWSTATUS", subjects=["rawstatus.>"])
        await js.add_consumer("RAWSTATUS", durable_name="d", ack_policy="explicit")
        inbox = client.new_inbox()
        await client.raw_subscribe(inbox, sink)
        await client.publish(
            "$JS.API.CONSUMER.MSG.NEXT.RAWSTATUS.d",
            json.dumps({"batch": 1, "expires": 50_000_000}).encode(),
            reply=inbox,
        )
        async with asyncio.timeout(WAIT_S):
            await ended.wait()
    finally:
        await client.close()
    assert statuses == [b"408"]
    assert descriptions == ["Request Timeout"]


async def test_plain_subscriptions_and_jetstream_requests_share_the_connection(
    nats_url: str,
) -> None:
    client = await connected(nats_url)
    raw: list[bytes] = []
    plain: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_plain(msg: object) -> None:
        plain.put_nowait(msg.data)  # type: ignore[attr-defined]

    try:
        await client.raw_subscribe("mixed.raw", lambda s, r, d, h: raw.append(d))
        await client.subscribe("mixed.plain", cb=on_plain)
        js = client.jetstream()
        await js.add_stream(name="MIXED", subjects=["mixed.stored"])
        ack = await js.publish("mixed.stored", b"kept", headers={"Nats-Msg-Id": "m-1"})
        await client.publish("mixed.plain", b"p")
        await client.publish("mixed.raw", b"r")
        async with asyncio.timeout(WAIT_S):
            assert await plain.get() == b"p"
        await client.flush()
    finally:
        await client.close()
    assert ack.seq == 1
    assert raw == [b"r"]


async def test_an_unsubscribed_raw_subscription_gets_nothing_more(nats_url: str) -> None:
    client = await connected(nats_url)
    got: list[bytes] = []
    marker: asyncio.Queue[bytes] = asyncio.Queue()
    try:
        subscription = await client.raw_subscribe("gone.raw", lambda s, r, d, h: got.append(d))
        await client.raw_subscribe("gone.marker", lambda s, r, d, h: marker.put_nowait(d))
        await client.publish("gone.raw", b"before")
        await client.publish("gone.marker", b"1")
        async with asyncio.timeout(WAIT_S):
            await marker.get()
        await subscription.unsubscribe()
        client.drop_raw(subscription)
        await client.publish("gone.raw", b"after")
        await client.publish("gone.marker", b"2")
        async with asyncio.timeout(WAIT_S):
            # "after" was sent first: on one connection, it would have arrived before "2"
            await marker.get()
    finally:
        await client.close()
    assert got == [b"before"]


async def test_a_frame_sent_now_is_written_before_the_flusher_runs(nats_url: str) -> None:
    client = await connected(nats_url)
    got: list[bytes] = []
    arrived = asyncio.Event()

    def sink(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        got.append(data)
        arrived.set()

    try:
        await client.raw_subscribe("now.a", sink)
        await send_frame(client, b"PUB now.a 1\r\nA\r\n", 1, now=True)
        # nothing suspended since: the flusher has not had a turn, the socket has the frame
        left = list(client._pending)
        async with asyncio.timeout(WAIT_S):
            await arrived.wait()
    finally:
        await client.close()
    assert left == []
    assert got == [b"A"]


async def test_frames_queued_before_go_with_the_frame_sent_now_and_later_ones_to_the_flusher(
    nats_url: str,
) -> None:
    client = await connected(nats_url)
    got: list[bytes] = []
    all_in = asyncio.Event()

    def sink(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        got.append(data)
        if len(got) == 5:
            all_in.set()

    def frame(data: bytes) -> bytes:
        return b"PUB now.b %d\r\n%b\r\n" % (len(data), data)

    try:
        await client.raw_subscribe("now.b", sink)
        await send_frame(client, frame(b"1"), 1)  # queued for the flusher
        await send_frame(client, frame(b"2"), 1, now=True)  # written, with 1 before it
        after_first = list(client._pending)
        await send_frame(client, frame(b"3"), 1, now=True)  # same turn: the flusher's
        await send_frame(client, frame(b"4"), 1)
        same_turn = list(client._pending)
        await client.flush()  # a PING answered: the flusher has written, turns have passed
        await send_frame(client, frame(b"5"), 1, now=True)  # a later turn: written again
        later_turn = list(client._pending)
        async with asyncio.timeout(WAIT_S):
            await all_in.wait()
    finally:
        await client.close()
    assert after_first == []
    assert same_turn == [frame(b"3"), frame(b"4")]
    assert later_turn == []
    assert got == [b"1", b"2", b"3", b"4", b"5"]


async def test_a_flush_is_written_after_the_frames_queued_before_it(nats_url: str) -> None:
    client = await connected(nats_url)
    writer = client._transport._io_writer  # type: ignore[union-attr]
    assert writer is not None
    written: list[bytes] = []
    write, writelines = writer.write, writer.writelines

    def recording_write(data: bytes) -> None:
        written.append(bytes(data))
        write(data)

    def recording_writelines(lines: list[bytes]) -> None:
        written.extend(bytes(line) for line in lines)
        writelines(lines)

    writer.write = recording_write  # type: ignore[method-assign]
    writer.writelines = recording_writelines  # type: ignore[method-assign]
    try:
        subscription = await client.subscribe("flush.order", cb=ignore_msg)
        await client.flush()  # its PONG: the server had everything written before the PING
        await subscription.unsubscribe()
    finally:
        await client.close()
    frames = b"".join(written)
    assert b"SUB flush.order" in frames and b"PING\r\n" in frames
    assert frames.index(b"SUB flush.order") < frames.index(b"PING\r\n"), written


async def ignore_msg(msg: object) -> None:
    pass
