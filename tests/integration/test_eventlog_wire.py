"""The log's writes on the wire against a real nats-server: PubAcks muxed on one raw inbox
(each answer reaches its own publish, in whatever order they come; a publish nobody answers
fails with nats-py's TimeoutError, through the log's retries too; a lone publish is
written at once, one behind another awaiting its PubAck is left to the flusher; no
responders is NoStreamResponseError; the inbox works again after a reconnect); deliveries acked and
naked out of order each get their own fate; the raw pull loop issues an expired pull again
and ends when its durable is deleted."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from itertools import count
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg

from gpupool.eventlog import EventLogClosed, JetStreamEventLog
from gpupool.eventlog import jetstream as jetstream_module
from gpupool.eventlog.log_client import LogClient, inline_status
from gpupool.eventlog.nats_server import run_nats_server
from gpupool.eventlog.wire import PubAckMux, header_block
from gpupool.events import Envelope, Event, PodReady, PodRef

pytestmark = pytest.mark.integration

WAIT_S = 20.0
_ids = count(1)


def wrap(event: Event) -> Envelope:
    return Envelope(id=f"wire-{next(_ids)}", time=datetime(2025, 1, 1, tzinfo=UTC), event=event)


def ready(node: str, pod: str) -> PodReady:
    return PodReady(pod=PodRef(namespace="default", name=pod), node=node)


async def ignore(msg: Msg) -> None:
    """A subscriber that never answers."""


async def connected(url: str) -> LogClient:
    client = LogClient()
    await client.connect(url, connect_timeout=2)
    return client


async def test_each_puback_reaches_its_own_publish_when_answers_come_in_reverse(
    nats_url: str,
) -> None:
    client = await connected(nats_url)
    # The responder is the publishing connection itself: the server takes one connection's
    # operations in order. (On a second connection, nats-py's flush wrote its PING ahead of
    # the queued SUB, so the publish could come before the interest: "no responders";
    # LogClient now queues the PING behind, test_eventlog_log_client.py.)
    responder = client
    requests: list[Msg] = []
    all_in = asyncio.Event()

    async def collect(msg: Msg) -> None:
        requests.append(msg)
        if len(requests) == 3:
            all_in.set()

    mux = PubAckMux(client, timeout=WAIT_S)
    try:
        await responder.subscribe("wire.reverse", cb=collect)
        await responder.flush()
        futures = [
            await mux.submit(b"wire.reverse", b"%d" % n, header_block([(b"Nats-Msg-Id", f"r{n}")]))
            for n in range(3)
        ]
        async with asyncio.timeout(WAIT_S):
            await all_in.wait()
        for msg in reversed(requests):  # answered last first, each with its payload's number
            await responder.publish(
                msg.reply, json.dumps({"stream": "S", "seq": 100 + int(msg.data)}).encode()
            )
        acks = [await PubAckMux.result(future) for future in futures]
    finally:
        mux.close()
        await client.close()
    assert [ack.seq for ack in acks] == [100, 101, 102]
    assert [msg.headers for msg in requests] == [{"Nats-Msg-Id": f"r{n}"} for n in range(3)]
    assert mux.in_flight == 0


async def test_a_publish_nobody_answers_times_out_with_nats_timeout_error(nats_url: str) -> None:
    client = await connected(nats_url)
    mux = PubAckMux(client, timeout=0.2)
    try:
        # The silent subscriber is on the publishing connection itself: the server takes a
        # connection's operations in order, so it has the interest before the publish.
        await client.subscribe("wire.silent", cb=ignore)
        await client.flush()
        with pytest.raises(nats.errors.TimeoutError):
            async with asyncio.timeout(WAIT_S):
                await mux.publish(b"wire.silent", b"x", header_block([]))
        assert mux.in_flight == 0
    finally:
        mux.close()
        await client.close()


async def test_a_lone_publish_is_written_at_once_and_one_behind_an_unanswered_publish_is_not(
    nats_url: str,
) -> None:
    client = await connected(nats_url)
    mux = PubAckMux(client, timeout=WAIT_S)
    try:
        await client.subscribe("wire.lone", cb=ignore)  # on this connection: see above
        await client.flush()
        first = await mux.submit(b"wire.lone", b"1", header_block([]), now=True)
        lone_left = list(client._pending)  # nothing suspended since: the flusher has not run
        await client.flush()  # a later turn: only the unanswered first publish rules now
        second = await mux.submit(b"wire.lone", b"2", header_block([]), now=True)
        behind_left = len(client._pending)
        await client.flush()
        in_flight = mux.in_flight  # both reached the server: neither is answered
    finally:
        mux.close()  # fails both with ConnectionClosedError
        await client.close()
    for future in (first, second):
        assert isinstance(future.exception(), nats.errors.ConnectionClosedError)
    assert lone_left == []
    assert behind_left == 1  # the flusher writes it, with whatever else its turn brings
    assert in_flight == 2


async def test_a_publish_whose_puback_was_given_up_no_longer_holds_a_lone_one_back(
    nats_url: str,
) -> None:
    client = await connected(nats_url)
    mux = PubAckMux(client, timeout=WAIT_S)
    try:
        await client.subscribe("wire.forgotten", cb=ignore)  # nobody answers
        await client.flush()
        abandoned = await mux.submit(b"wire.forgotten", b"1", header_block([]))
        abandoned.cancel()  # its caller gave up on it (append_many after an error)
        mux.forget([abandoned])
        await client.flush()
        in_flight = mux.in_flight
        lone = await mux.submit(b"wire.forgotten", b"2", header_block([]), now=True)
        lone_left = list(client._pending)  # written at once: nothing counts as in flight
    finally:
        mux.close()
        await client.close()
    assert in_flight == 0
    assert lone_left == []
    assert isinstance(lone.exception(), nats.errors.ConnectionClosedError)


async def test_a_publish_to_a_subject_without_a_stream_is_no_stream_response(
    nats_url: str,
) -> None:
    client = await connected(nats_url)
    mux = PubAckMux(client, timeout=WAIT_S)
    try:
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await mux.publish(b"wire.nobody.listens", b"x", header_block([]))
    finally:
        mux.close()
        await client.close()


async def test_an_append_whose_puback_never_comes_fails_as_js_publish_did(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = await JetStreamEventLog.connect(
        nats_url, stream="WIRE_SILENT", subject_prefix="wiresilent.log"
    )
    silent = await connected(nats_url)
    try:
        await log._js.delete_stream("WIRE_SILENT")
        await silent.subscribe("wiresilent.log.>", cb=ignore)
        await silent.flush()
        monkeypatch.setattr(jetstream_module, "APPEND_RETRY_FOR_S", 0.5)
        log._mux.timeout = 0.1
        with pytest.raises(nats.errors.TimeoutError):
            async with asyncio.timeout(WAIT_S):
                await log.append(wrap(ready("n", "never-acked")))
    finally:
        await log.close()
        await silent.close()


async def test_pubacks_come_on_the_muxed_inbox_again_after_a_reconnect(tmp_path: Path) -> None:
    store = tmp_path / "store"
    reconnected = asyncio.Event()
    async with run_nats_server(store) as url:
        log = await JetStreamEventLog.connect(url)
        first = await log.append(wrap(ready("n", "before")))
        renew = log._pull_again

        def on_reconnect() -> None:
            renew()
            reconnected.set()

        log._pull_again = on_reconnect  # type: ignore[method-assign]
    port = int(url.rsplit(":", 1)[1])
    try:
        async with run_nats_server(store, port=port):
            async with asyncio.timeout(WAIT_S):
                await reconnected.wait()
            retried: list[int] = []
            envelope = wrap(ready("n", "after"))
            ack = await log._publish(
                f"{log.subject_prefix}.n.{log.writer}",
                jetstream_module.encode_envelope(envelope),
                header_block([(b"Nats-Msg-Id", envelope.id)]),
                retried=retried,
            )
            await log.close()
    finally:
        await log.close()
    assert (first, ack.seq) == (1, 2)
    assert retried == []  # answered on the first try: the inbox was subscribed again


async def test_deliveries_acked_and_naked_out_of_order_each_get_their_own_fate(
    jetstream_log: JetStreamEventLog,
) -> None:
    seqs = [await jetstream_log.append(wrap(ready("n", f"p{i}"))) for i in range(3)]
    subscription = jetstream_log.subscribe(durable="out-of-order")
    try:
        async with asyncio.timeout(WAIT_S):
            batch = [await anext(subscription)]
            while len(batch) < 3:
                batch += subscription.take_ready(3 - len(batch)) or [await anext(subscription)]
        assert [d.seq for d in batch] == seqs
        assert [d.follows for d in batch][1:] == seqs[:2]
        await batch[2].ack()
        await batch[1].ack()
        await batch[0].nak()
        async with asyncio.timeout(WAIT_S):
            again = await anext(subscription)
        assert (again.seq, again.follows) == (seqs[0], None)  # a redelivery proves nothing
        await again.ack()
    finally:
        await subscription.aclose()
    fourth = await jetstream_log.append(wrap(ready("n", "p3")))
    async with jetstream_log.subscribe(durable="out-of-order") as resumed:
        async with asyncio.timeout(WAIT_S):
            nxt = await anext(resumed)
        await nxt.ack()
    assert nxt.seq == fourth  # nothing acked came back


async def test_a_pull_that_expires_is_issued_again_and_the_next_entry_still_arrives(
    jetstream_log: JetStreamEventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jetstream_module, "PULL_EXPIRES_S", 0.3)
    monkeypatch.setattr(jetstream_module, "PULL_HEARTBEAT_S", 0.1)
    subscription = jetstream_log.subscribe(durable="expiring-pulls")
    pulls = 0
    third_pull = asyncio.Event()
    pull = subscription._pull

    async def counted_pull() -> None:
        nonlocal pulls
        pulls += 1
        if pulls == 3:
            third_pull.set()
        await pull()

    statuses: list[bytes | None] = []
    sink = subscription._on_raw

    def recording_sink(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        statuses.append(inline_status(headers))
        sink(subject, reply, data, headers)

    subscription._pull = counted_pull  # type: ignore[method-assign]
    subscription._on_raw = recording_sink  # type: ignore[method-assign]
    try:
        waiting = asyncio.create_task(anext(subscription))
        async with asyncio.timeout(WAIT_S):
            await third_pull.wait()  # two pulls expired (status 408) and were issued again
        seq = await jetstream_log.append(wrap(ready("n", "after-expiries")))
        async with asyncio.timeout(WAIT_S):
            delivery = await waiting
        await delivery.ack()
    finally:
        await subscription.aclose()
    assert delivery.seq == seq
    assert b"408" in statuses  # the pulls ended by expiring, not by a missed heartbeat


async def test_a_subscriber_whose_durable_is_deleted_ends_with_event_log_closed(
    jetstream_log: JetStreamEventLog,
) -> None:
    await jetstream_log.append(wrap(ready("n", "first")))
    subscription = jetstream_log.subscribe(durable="to-be-deleted")
    try:
        async with asyncio.timeout(WAIT_S):
            first = await anext(subscription)  # its pull request stays outstanding
        await first.ack()
        waiting = asyncio.create_task(anext(subscription))
        await jetstream_log._js.delete_consumer(jetstream_log.stream, "to-be-deleted")
        with pytest.raises(EventLogClosed, match="was deleted"):
            async with asyncio.timeout(WAIT_S):
                await waiting
    finally:
        await subscription.aclose()
