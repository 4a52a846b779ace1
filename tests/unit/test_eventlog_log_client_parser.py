"""The log client's parser hands raw subscriptions' frames to their sinks, and every other
message to nats-py's message handling, in the order of the connection, however the bytes
are cut into reads (seeded random cuts); other operations between frames go to nats-py's
parser; a malformed frame is a protocol error, as nats-py has it."""

from __future__ import annotations

import asyncio
import random

import pytest
from nats.errors import ProtocolError

from gpupool.eventlog.log_client import LogClient

RAW_SID = 7
OTHER_SID = 8

Frame = tuple[int, bytes, bytes, bytes, bytes | None]


class _Sub:  # what the parser looks up in the client's subscriptions
    _max_msgs = 0
    _received = 0


class RecordingClient(LogClient):
    """Records what reaches nats-py's message handling for the other subscription."""

    def __init__(self) -> None:
        super().__init__()
        self.got: list[Frame] = []
        self._subs[RAW_SID] = _Sub()  # type: ignore[assignment]
        self._subs[OTHER_SID] = _Sub()  # type: ignore[assignment]
        self._raw_sinks[RAW_SID] = lambda s, r, d, h: self.got.append((RAW_SID, s, r, d, h))

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        if sid == OTHER_SID:
            self.got.append((sid, subject, reply, data, headers))
            return
        await super()._process_msg(sid, subject, reply, data, headers)


def frames(seed: int) -> tuple[bytes, list[Frame]]:
    rng = random.Random(seed)
    wire = bytearray()
    expected: list[Frame] = []
    for index in range(200):
        sid = RAW_SID if rng.random() < 0.8 else OTHER_SID
        subject = f"log.n{rng.randrange(5)}.admission-queue".encode()
        reply = f"$JS.ACK.S.d.1.{index + 1}.{index + 1}.0.0".encode() if rng.random() < 0.8 else b""
        payload = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 120)))
        kind = rng.random()
        if kind < 0.15:
            wire += b"+OK\r\n"  # another operation between frames
            continue
        if kind < 0.55:
            headers = b"NATS/1.0\r\nNats-Msg-Id: m-%d\r\n\r\n" % index
            line = b"HMSG %s %d %s%d %d\r\n" % (
                subject,
                sid,
                reply + b" " if reply else b"",
                len(headers),
                len(headers) + len(payload),
            )
            wire += line + headers + payload + b"\r\n"
            expected.append((sid, subject, reply, payload, headers))
        else:
            line = b"MSG %s %d %s%d\r\n" % (
                subject,
                sid,
                reply + b" " if reply else b"",
                len(payload),
            )
            wire += line + payload + b"\r\n"
            expected.append((sid, subject, reply, payload, None))
    return bytes(wire), expected


async def feed(client: LogClient, wire: bytes, cuts: list[int]) -> None:
    start = 0
    for cut in [*cuts, len(wire)]:
        await client._ps.parse(wire[start:cut])
        start = cut


def parsed(wire: bytes, cuts: list[int]) -> list[Frame]:
    client = RecordingClient()
    asyncio.run(feed(client, wire, cuts))
    assert not client._ps.buf
    return client.got


def test_frames_reach_their_subscriptions_in_order_however_the_reads_cut_them() -> None:
    for seed in range(20):
        wire, expected = frames(seed)
        rng = random.Random(1000 + seed)
        cuts = sorted(rng.sample(range(1, len(wire)), rng.randrange(1, 60)))
        assert parsed(wire, cuts) == expected, seed


def test_a_read_per_byte_and_one_read_of_everything_give_the_same_frames() -> None:
    wire, expected = frames(7)
    assert parsed(wire, list(range(1, len(wire)))) == expected
    assert parsed(wire, []) == expected


def test_frames_of_a_raw_subscription_that_ended_are_dropped() -> None:
    wire, expected = frames(3)
    client = RecordingClient()
    del client._subs[RAW_SID]  # unsubscribed; its sink not yet forgotten
    asyncio.run(feed(client, wire, []))
    assert client.got == [frame for frame in expected if frame[0] == OTHER_SID]
    assert RAW_SID not in client._raw_sinks


def test_a_malformed_frame_is_a_protocol_error() -> None:
    for line in (b"MSG log.a x 3\r\nabc\r\n", b"HMSG log.a 7 9 3\r\nabc\r\n", b"MSG log.a\r\n"):
        with pytest.raises(ProtocolError):
            asyncio.run(feed(RecordingClient(), line, []))


def test_a_delivery_line_longer_than_a_client_may_publish_is_parsed_not_waited_on() -> None:
    # The server limits the lines clients send (4096 bytes); a delivery's line adds the
    # subscription id and a JetStream reply to a stored subject, and may be longer.
    subject = b"log." + b"x" * 4_100
    reply = b"$JS.ACK.S.d.1.1.1.0.0"
    wire = b"MSG %s %d %s 2\r\nhi\r\nMSG log.after %d 2\r\nok\r\n" % (
        subject,
        RAW_SID,
        reply,
        RAW_SID,
    )
    assert parsed(wire, [100, 4_000, 4_200]) == [
        (RAW_SID, subject, reply, b"hi", None),
        (RAW_SID, b"log.after", b"", b"ok", None),
    ]


def test_a_raw_subscription_whose_unsubscribe_failed_keeps_its_sink() -> None:
    client = RecordingClient()

    class Ended:
        _id = RAW_SID

    client.drop_raw(Ended())  # type: ignore[arg-type]  # still subscribed: kept
    asyncio.run(feed(client, b"MSG log.late %d 1\r\nx\r\n" % RAW_SID, []))
    assert client.got == [(RAW_SID, b"log.late", b"", b"x", None)]
    del client._subs[RAW_SID]
    client.drop_raw(Ended())  # type: ignore[arg-type]
    assert RAW_SID not in client._raw_sinks


INBOX_SID = 9


class RecordingInbox:
    """A raw inbox (``LogClient.raw_inbox``): its deliveries, statuses and wake-ups."""

    def __init__(self) -> None:
        self.subjects: list[bytes] = []
        self.replies: list[bytes] = []
        self.datas: list[bytes] = []
        self.statuses: list[bytes] = []
        self.wakes = 0

    @property
    def messages(self) -> list[tuple[bytes, bytes, bytes]]:
        """The deliveries as (subject, reply, data), the columns checked to be of one length."""
        return list(zip(self.subjects, self.replies, self.datas, strict=True))

    def on_status(self, headers: bytes) -> None:
        self.statuses.append(headers)

    def on_delivered(self) -> None:
        self.wakes += 1


def status_frame(subject: bytes, headers: bytes) -> bytes:
    """A status message for the inbox: a header block whose first line has a code, no payload."""
    return b"HMSG %s %d %d %d\r\n%s\r\n" % (subject, INBOX_SID, len(headers), len(headers), headers)


def inbox_wire(
    seed: int, *, others: bool = True
) -> tuple[bytes, list[tuple[bytes, bytes, bytes]], list[bytes], int]:
    """Frames for the inbox (plain, with stored headers, with and without a reply), statuses
    among them, other operations between (``others``); what the inbox must get; how many
    frames."""
    rng = random.Random(seed)
    wire = bytearray()
    deliveries: list[tuple[bytes, bytes, bytes]] = []
    statuses: list[bytes] = []
    for index in range(120):
        subject = f"log.n{rng.randrange(5)}.admission-queue".encode()
        reply = f"$JS.ACK.S.d.1.{index + 1}.{index + 1}.0.0".encode() if rng.random() < 0.8 else b""
        payload = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 60)))
        kind = rng.random()
        if kind < 0.1 and others:
            wire += b"PING\r\n" if rng.random() < 0.5 else b"+OK\r\n"
            continue
        if kind < 0.2:  # a status: a header block whose first line has a code, no payload
            headers = b"NATS/1.0 %s Status\r\n\r\n" % rng.choice([b"100", b"408", b"409"])
            wire += status_frame(subject, headers)
            statuses.append(headers)
            continue
        space = b" " if rng.random() < 0.9 else b"  "  # spelt as the server does, or not
        if kind < 0.6:
            headers = b"NATS/1.0\r\nNats-Msg-Id: m-%d\r\n\r\n" % index
            wire += b"HMSG %s %d %s%d%s%d\r\n" % (
                subject,
                INBOX_SID,
                reply + space if reply else b"",
                len(headers),
                space,
                len(headers) + len(payload),
            )
            wire += headers + payload + b"\r\n"
        else:
            wire += b"MSG %s%s%d %s%d\r\n%s\r\n" % (
                subject,
                space,
                INBOX_SID,
                reply + b" " if reply else b"",
                len(payload),
                payload,
            )
        deliveries.append((subject, reply, payload))
    return bytes(wire), deliveries, statuses, len(deliveries) + len(statuses)


def into_inbox(wire: bytes, cuts: list[int]) -> tuple[RecordingClient, RecordingInbox]:
    client = RecordingClient()
    inbox = RecordingInbox()
    client._subs[INBOX_SID] = _Sub()  # type: ignore[assignment]
    client._raw_inboxes[INBOX_SID] = inbox

    async def pings() -> None:  # nats-py answers a PING by queueing a PONG
        pass

    client._process_ping = pings  # type: ignore[method-assign]
    asyncio.run(feed(client, wire, cuts))
    assert not client._ps.buf
    return client, inbox


def test_an_inbox_gets_its_deliveries_and_statuses_in_order_however_the_reads_cut_them() -> None:
    for seed in range(10):
        wire, deliveries, statuses, frames_sent = inbox_wire(seed)
        rng = random.Random(2000 + seed)
        cuts = sorted(rng.sample(range(1, len(wire)), rng.randrange(1, 40)))
        for every in (cuts, list(range(1, len(wire))), []):
            client, inbox = into_inbox(wire, every)
            assert inbox.messages == deliveries, seed
            assert inbox.statuses == statuses, seed
            assert client.stats["in_msgs"] == frames_sent
            assert client.got == []


def test_an_inbox_is_woken_once_per_read_that_delivered_to_it() -> None:
    wire, deliveries, _, _ = inbox_wire(5, others=False)
    _, inbox = into_inbox(wire, [])
    assert inbox.wakes == 1  # one read: one wake-up, however many deliveries
    _, inbox = into_inbox(wire, list(range(1, len(wire))))
    assert inbox.wakes == len(deliveries)  # a byte a read: each delivery completes in its own
    wire, deliveries, _, _ = inbox_wire(5)
    _, inbox = into_inbox(wire, [])
    assert 1 < inbox.wakes < len(deliveries)  # and before each other operation handed on


def test_frames_of_an_inbox_that_ended_are_dropped() -> None:
    wire, _, _, _ = inbox_wire(3)
    client = RecordingClient()
    inbox = RecordingInbox()
    client._raw_inboxes[INBOX_SID] = inbox  # unsubscribed: not in the client's subscriptions
    client._process_ping = lambda: asyncio.sleep(0)  # type: ignore[method-assign]
    asyncio.run(feed(client, wire, []))
    assert inbox.messages == [] and inbox.statuses == []
    assert INBOX_SID not in client._raw_inboxes


def test_a_malformed_frame_for_an_inbox_is_a_protocol_error() -> None:
    for line in (
        b"MSG log.a 9x 3\r\nabc\r\n",
        b"MSG log.a 9 r s 3\r\nabc\r\n",
        b"HMSG log.a 9 4 3\r\nabc\r\n",  # a header block larger than the whole
        b"HMSG log.a 9 r 4 3\r\nabc\r\n",
        b"HMSG log.a 9 3\r\nabc\r\n",
    ):
        with pytest.raises(ProtocolError):
            into_inbox(line, [])


def replay_wire(seed: int) -> tuple[bytes, list[tuple[bytes, bytes, bytes]], list[Frame]]:
    """A pull's deliveries as the server writes them (plain frames with a reply, one after
    the other), now and then broken by another subscription's frame, an odd spelling, a
    frame without a reply, one with stored headers, a status or another operation; what
    the inbox and the other subscription must get."""
    rng = random.Random(seed)
    wire = bytearray()
    deliveries: list[tuple[bytes, bytes, bytes]] = []
    others: list[Frame] = []
    for index in range(300):
        subject = f"gpupool.log.n{rng.randrange(3)}.admission-queue".encode()
        reply = f"$JS.ACK.S.replay.1.{index + 1}.{index + 1}.17647.{300 - index}".encode()
        payload = b'{"id":"e-%d","pad":"%s"}' % (index, b"x" * rng.randrange(0, 200))
        kind = rng.random()
        if kind < 0.03:
            other = (OTHER_SID, subject, reply, payload, None)
            wire += b"MSG %s %d %s %d\r\n%s\r\n" % (
                subject,
                OTHER_SID,
                reply,
                len(payload),
                payload,
            )
            others.append(other)
            continue
        if kind < 0.05:
            wire += b"PING\r\n"
            continue
        if kind < 0.07:
            wire += status_frame(subject, b"NATS/1.0 100 Idle Heartbeat\r\n\r\n")
            continue
        if kind < 0.09:
            headers = b"NATS/1.0\r\nNats-Msg-Id: m-%d\r\n\r\n" % index
            wire += b"HMSG %s %d %s %d %d\r\n%s%s\r\n" % (
                subject,
                INBOX_SID,
                reply,
                len(headers),
                len(headers) + len(payload),
                headers,
                payload,
            )
        elif kind < 0.11:
            reply = b""
            wire += b"MSG %s %d %d\r\n%s\r\n" % (subject, INBOX_SID, len(payload), payload)
        elif kind < 0.13:  # spelt otherwise than the server does: read field by field
            wire += b"MSG %s  %d %s %d\r\n%s\r\n" % (
                subject,
                INBOX_SID,
                reply,
                len(payload),
                payload,
            )
        elif kind < 0.15:  # the same subscription spelt with a leading zero
            wire += b"MSG %s 0%d %s %d\r\n%s\r\n" % (
                subject,
                INBOX_SID,
                reply,
                len(payload),
                payload,
            )
        else:
            wire += b"MSG %s %d %s %d\r\n%s\r\n" % (
                subject,
                INBOX_SID,
                reply,
                len(payload),
                payload,
            )
        deliveries.append((subject, reply, payload))
    return bytes(wire), deliveries, others


def test_a_pulls_run_of_deliveries_reads_as_frame_by_frame_however_the_reads_cut_it() -> None:
    """The parser cuts a run of plain frames for one inbox in one loop (``_inbox_run``);
    whatever breaks the run, and wherever a read ends inside it, the inbox and the other
    subscription get what a frame-by-frame read gives, in order."""
    for seed in range(8):
        wire, deliveries, others = replay_wire(seed)
        rng = random.Random(3000 + seed)
        cuts = sorted(rng.sample(range(1, len(wire)), rng.randrange(1, 200)))
        for every in (cuts, list(range(1, len(wire), 7)), list(range(1, len(wire))), []):
            client, inbox = into_inbox(wire, every)
            assert inbox.messages == deliveries, seed
            assert client.got == others, seed
            # the inbox's frames counted (the other subscription's are nats-py's to count)
            assert client.stats["in_msgs"] == len(deliveries) + wire.count(b"Heartbeat")
            assert client.stats["in_bytes"] == sum(len(d[2]) for d in deliveries)
