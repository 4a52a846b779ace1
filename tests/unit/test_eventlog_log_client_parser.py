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
