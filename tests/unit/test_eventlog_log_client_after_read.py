"""``LogClient.after_read``: what a sink asks to run once the reader has cut what it read runs
after the parse, once, and, while the connection's stream reader already holds more bytes
(a burst: the reader's next read returns within the same step), only after the parse of
those too, so a burst read in many chunks is handed on as one batch, not one per chunk
(docs/eventlog.md, "Deciding in the reader's step"); should the reader stop first, it runs
on the loop's next turn."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from gpupool.eventlog.log_client import LogClient

RAW_SID = 7
CHUNKS = 6
PER_CHUNK = 5


class _Sub:  # what the parser looks up in the client's subscriptions
    _max_msgs = 0
    _received = 0


class Batching:
    """A subscriber that queues each delivery and asks, once per round, to take them all
    after the read (as ``JetStreamSubscription`` does for ``react_on_arrival``)."""

    def __init__(self, client: LogClient) -> None:
        self.client = client
        self.queued: list[bytes] = []
        self.batches: list[list[bytes]] = []
        self.due = False
        self.taken = asyncio.Event()
        client._subs[RAW_SID] = _Sub()  # type: ignore[assignment]
        client._raw_sinks[RAW_SID] = self.sink

    def sink(self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        self.queued.append(data)
        if not self.due:
            self.due = True
            self.client.after_read(self.take)

    def take(self) -> None:
        self.due = False
        self.batches.append(self.queued)
        self.queued = []
        self.taken.set()


def burst() -> list[bytes]:
    return [
        b"".join(
            b"MSG log.n1.node-executor %d $JS.ACK.S.d.1.%d.%d.0.0 2\r\nd%d\r\n"
            % (RAW_SID, seq, seq, seq % 10)
            for seq in range(chunk * PER_CHUNK + 1, (chunk + 1) * PER_CHUNK + 1)
        )
        for chunk in range(CHUNKS)
    ]


def reading(client: LogClient) -> SimpleNamespace:
    """The connection's stream reader as ``after_read`` looks at it: its buffer."""
    reader = SimpleNamespace(_buffer=bytearray())
    client._transport = SimpleNamespace(_io_reader=reader)  # type: ignore[assignment]
    return reader


async def test_a_burst_read_in_many_chunks_is_taken_after_the_reads_in_one_batch() -> None:
    client = LogClient()
    subscriber = Batching(client)
    reader = reading(client)
    chunks = burst()
    # the reader loop: each read returns what the buffer holds, the rest stays buffered
    for index, chunk in enumerate(chunks):
        reader._buffer = bytearray(b"".join(chunks[index + 1 :]))
        await client._ps.parse(chunk)
        if index < len(chunks) - 1:
            assert subscriber.batches == []  # more is buffered: not yet

    assert [len(batch) for batch in subscriber.batches] == [CHUNKS * PER_CHUNK]
    # the turn's fallbacks, queued meanwhile, run before a callback queued now: nothing more
    turn = asyncio.Event()
    asyncio.get_running_loop().call_soon(turn.set)
    await turn.wait()
    assert [len(batch) for batch in subscriber.batches] == [CHUNKS * PER_CHUNK]


async def test_reads_with_nothing_more_buffered_are_taken_after_each() -> None:
    client = LogClient()
    subscriber = Batching(client)
    reading(client)  # empty: each read is all there is for now
    for chunk in burst():
        await client._ps.parse(chunk)

    assert [len(batch) for batch in subscriber.batches] == [PER_CHUNK] * CHUNKS


async def test_what_a_reader_that_stops_with_bytes_buffered_asked_for_runs_on_the_next_turn() -> (
    None
):
    client = LogClient()
    subscriber = Batching(client)
    reader = reading(client)
    first, *rest = burst()
    reader._buffer = bytearray(b"".join(rest))
    await client._ps.parse(first)  # and the reader reads no more (the connection ends, say)
    assert subscriber.batches == []

    async with asyncio.timeout(5):
        await subscriber.taken.wait()
    assert [len(batch) for batch in subscriber.batches] == [PER_CHUNK]
