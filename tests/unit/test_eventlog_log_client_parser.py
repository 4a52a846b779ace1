"""The log client's parser hands raw subscriptions' frames to their sinks in the order
of the connection, however the bytes are cut into reads: whole frames on the fast path,
split frames and other operations through nats-py's own parser (seeded random cuts)."""

from __future__ import annotations

import asyncio
import random

from gpupool.eventlog.log_client import LogClient


class _Sub:  # what the parser looks up in the client's subscriptions
    _max_msgs = 0
    _received = 0


def frames(seed: int) -> tuple[bytes, list[tuple[bytes, bytes, bytes, bytes | None]]]:
    rng = random.Random(seed)
    wire = bytearray()
    expected: list[tuple[bytes, bytes, bytes, bytes | None]] = []
    for index in range(200):
        subject = f"log.n{rng.randrange(5)}.admission-queue".encode()
        reply = f"$JS.ACK.S.d.1.{index + 1}.{index + 1}.0.0".encode() if rng.random() < 0.8 else b""
        payload = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 120)))
        kind = rng.random()
        if kind < 0.15:
            wire += b"+OK\r\n"  # another operation between frames
            continue
        if kind < 0.55:
            headers = b"NATS/1.0\r\nNats-Msg-Id: m-%d\r\n\r\n" % index
            line = b"HMSG %s 7 %s%d %d\r\n" % (
                subject,
                reply + b" " if reply else b"",
                len(headers),
                len(headers) + len(payload),
            )
            wire += line + headers + payload + b"\r\n"
            expected.append((subject, reply, payload, headers))
        else:
            line = b"MSG %s 7 %s%d\r\n" % (subject, reply + b" " if reply else b"", len(payload))
            wire += line + payload + b"\r\n"
            expected.append((subject, reply, payload, None))
    return bytes(wire), expected


async def feed(wire: bytes, cuts: list[int]) -> list[tuple[bytes, bytes, bytes, bytes | None]]:
    client = LogClient()
    got: list[tuple[bytes, bytes, bytes, bytes | None]] = []
    client._subs[7] = _Sub()  # type: ignore[assignment]
    client._raw_sinks[7] = lambda s, r, d, h: got.append((s, r, d, h))
    start = 0
    for cut in [*cuts, len(wire)]:
        await client._ps.parse(wire[start:cut])
        start = cut
    return got


def test_raw_frames_reach_their_sink_in_order_however_the_reads_cut_them() -> None:
    for seed in range(20):
        wire, expected = frames(seed)
        rng = random.Random(1000 + seed)
        cuts = sorted(rng.sample(range(1, len(wire)), rng.randrange(1, 60)))
        assert asyncio.run(feed(wire, cuts)) == expected, seed


def test_a_read_per_byte_and_one_read_of_everything_give_the_same_frames() -> None:
    wire, expected = frames(7)
    assert asyncio.run(feed(wire, list(range(1, len(wire))))) == expected
    assert asyncio.run(feed(wire, [])) == expected


def test_frames_of_a_subscription_that_ended_are_dropped() -> None:
    wire, _ = frames(3)
    client = LogClient()
    got: list[bytes] = []
    client._raw_sinks[7] = lambda s, r, d, h: got.append(d)  # sid 7 is not subscribed
    asyncio.run(client._ps.parse(wire))
    assert got == []
    assert 7 not in client._raw_sinks
