"""``DeciderLoop.consume(react_on_arrival=True)``: a batch that arrives while the loop waits
is folded and reacted to within the connection's reader step (docs/eventlog.md, "Deciding
in the reader's step"), without stalling the reader, out of order, or unacked. On a real
nats-server: the reader step is the JetStream adapter's."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from log_streams import acked_up_to, delete_stream, unique_stream

import gpupool.eventlog.jetstream as jetstream
import gpupool.runtime.decider as decider
from gpupool.eventlog import JetStreamEventLog
from gpupool.eventlog.port import StoredEvent
from gpupool.events import NODELESS, Envelope, Event, MessageRejected
from gpupool.runtime.decider import DeciderLoop

pytestmark = pytest.mark.integration

WAIT_S = 30.0
DURABLE = "arrival"


def wrap(event: Event) -> Envelope:
    return Envelope(id=uuid.uuid4().hex, time=datetime(2025, 1, 1, tzinfo=UTC), event=event)


def note(reason: str) -> Envelope:
    return wrap(MessageRejected(subject=NODELESS, reason=reason, payload=""))


@asynccontextmanager
async def logs(nats_url: str) -> AsyncIterator[tuple[JetStreamEventLog, JetStreamEventLog]]:
    """The consuming service's log and another writer's, on one fresh stream."""
    stream, prefix = unique_stream()
    service = await JetStreamEventLog.connect(nats_url, stream=stream, subject_prefix=prefix)
    writer = await JetStreamEventLog.connect(
        nats_url, stream=stream, subject_prefix=prefix, writer="node-executor"
    )
    try:
        yield service, writer
    finally:
        await writer.close()
        await service.close()
        await delete_stream(nats_url, stream)


async def started(
    loop: DeciderLoop, react_batch: Callable[[list[StoredEvent]], Awaitable[None]]
) -> asyncio.Task[None]:
    async def react(entry: StoredEvent) -> None:
        raise AssertionError("a batch reaction was given")

    await loop.rebuild()
    return asyncio.create_task(
        loop.consume(DURABLE, react, react_batch=react_batch, react_on_arrival=True)
    )


async def stopped(consumer: asyncio.Task[None]) -> None:
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)


def reader_parse_watched(log: JetStreamEventLog) -> Callable[[], bool]:
    """Whether the connection's reader is within its parse of what it read, now."""
    parser: Any = log._nc._ps
    parse = parser.parse
    depth = 0

    async def counted_parse(data: bytes = b"") -> None:
        nonlocal depth
        depth += 1
        try:
            await parse(data)
        finally:
            depth -= 1

    parser.parse = counted_parse
    return lambda: depth > 0


async def test_a_batch_arriving_while_the_loop_waits_is_reacted_to_within_the_readers_parse(
    nats_url: str,
) -> None:
    async with logs(nats_url) as (log, writer):
        in_parse = reader_parse_watched(log)
        parsing: list[bool] = []
        loop = DeciderLoop(log, service="admission-queue")
        reacted = asyncio.Event()
        seen: list[int] = []

        async def react_batch(entries: list[StoredEvent]) -> None:
            parsing.append(in_parse())
            seen.extend(entry.seq for entry in entries)
            reacted.set()

        consumer = await started(loop, react_batch)
        try:
            # the first may come before the consumer waits for it; once it is reacted to,
            # the loop waits again (within that step) for the second
            first = await writer.append(note("written first"))
            async with asyncio.timeout(WAIT_S):
                await reacted.wait()
            reacted.clear()
            seq = await writer.append(note("written"))
            async with asyncio.timeout(WAIT_S):
                await reacted.wait()
            assert seen == [first, seq]
            assert parsing[1:] == [True]  # folded and reacted to in the reader's step
            assert loop.projection.last_seq == seq
            await acked_up_to(log, DURABLE, seq, within_s=WAIT_S)
        finally:
            await stopped(consumer)


async def test_a_reaction_awaiting_its_own_append_in_the_readers_step_gets_its_puback(
    nats_url: str,
) -> None:
    async with logs(nats_url) as (log, writer):
        loop = DeciderLoop(log, service="admission-queue")
        appended: list[int] = []
        seen: list[int] = []
        done = asyncio.Event()

        async def react_batch(entries: list[StoredEvent]) -> None:
            for entry in entries:
                seen.append(entry.seq)
                event = entry.envelope.event
                assert type(event) is MessageRejected
                if event.reason.startswith("written"):
                    # its PubAck comes on this connection, read by the reader this began in
                    appended.append(await log.append(note(f"after {entry.seq}")))
            if len(seen) == 4:
                done.set()

        consumer = await started(loop, react_batch)
        try:
            first = await writer.append(note("written first"))
            second = await writer.append(note("written second"))
            async with asyncio.timeout(WAIT_S):
                await done.wait()
            assert len(appended) == 2
            assert seen == sorted(seen)
            assert seen == sorted([first, second, *appended])
            await acked_up_to(log, DURABLE, max(seen), within_s=WAIT_S)
        finally:
            await stopped(consumer)


async def test_an_error_in_a_reaction_ends_consume_with_it_and_leaves_the_reader_reading(
    nats_url: str,
) -> None:
    async with logs(nats_url) as (log, writer):
        in_parse = reader_parse_watched(log)
        loop = DeciderLoop(log, service="admission-queue")
        first_reacted = asyncio.Event()
        failing_in_parse: list[bool] = []

        async def react_batch(entries: list[StoredEvent]) -> None:
            if not first_reacted.is_set():
                first_reacted.set()  # the loop then waits again, within this step
                return
            failing_in_parse.append(in_parse())
            raise ValueError("a reaction's fault")

        consumer = await started(loop, react_batch)
        await writer.append(note("written first"))
        async with asyncio.timeout(WAIT_S):
            await first_reacted.wait()
        await writer.append(note("written"))
        with pytest.raises(ValueError, match="a reaction's fault"):
            async with asyncio.timeout(WAIT_S):
                await consumer
        assert failing_in_parse == [True]  # the batch taken in the reader's step failed
        assert not loop.ready
        # the connection still reads: an append's PubAck, and a replay, come through it
        seq = await log.append(note("after the fault"))
        assert [entry.seq async for entry in log.replay(from_seq=seq)] == [seq]


async def test_bursts_reacted_to_on_arrival_keep_the_log_order_and_the_batch_bound(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decider, "CONSUME_BATCH", 8)
    async with logs(nats_url) as (log, writer):
        loop = DeciderLoop(log, service="admission-queue")
        batches: list[list[int]] = []
        notes: list[int] = []
        appending = 0
        changed = asyncio.Event()

        async def react_batch(entries: list[StoredEvent]) -> None:
            nonlocal appending
            batches.append([entry.seq for entry in entries])
            written = any(
                type(e.envelope.event) is MessageRejected
                and e.envelope.event.reason.startswith("written")
                for e in entries
            )
            if written and len(batches) % 3 == 0:
                # now and then a reaction waits (for its own append's PubAck): the batches
                # arriving meanwhile wait for it, then go in order
                appending += 1
                notes.append(await log.append(note(f"after batch {len(batches)}")))
                appending -= 1
            changed.set()

        consumer = await started(loop, react_batch)
        try:
            seqs: list[int] = []
            for start in range(0, 100, 25):
                seqs += await writer.append_many(
                    [note(f"written {i}") for i in range(start, start + 25)]
                )
            reacted: list[int] = []
            async with asyncio.timeout(WAIT_S):
                while appending or not set(seqs) | set(notes) <= set(reacted):
                    changed.clear()
                    await changed.wait()
                    reacted = [seq for batch in batches for seq in batch]
            assert reacted == sorted(set(reacted))  # each once, in the log's order
            assert set(reacted) == set(seqs) | set(notes)
            assert all(len(batch) <= 8 for batch in batches)
            assert notes  # some reactions waited
            await acked_up_to(log, DURABLE, await log.last_seq(), within_s=WAIT_S)
        finally:
            await stopped(consumer)


async def test_a_pull_used_up_by_batches_reacted_to_on_arrival_is_renewed(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each pull asks for 3: the reader's batches take a pull's last delivery, and the
    # iterator (still waiting) must ask again, else the rest never comes
    monkeypatch.setattr(jetstream, "PULL_BATCH", 3)
    async with logs(nats_url) as (log, writer):
        loop = DeciderLoop(log, service="admission-queue")
        reacted: list[int] = []
        changed = asyncio.Event()

        async def react_batch(entries: list[StoredEvent]) -> None:
            reacted.extend(entry.seq for entry in entries)
            changed.set()

        consumer = await started(loop, react_batch)
        try:
            seqs = [await writer.append(note(f"written {i}")) for i in range(15)]
            async with asyncio.timeout(WAIT_S):
                while reacted != seqs:
                    changed.clear()
                    await changed.wait()
            await acked_up_to(log, DURABLE, seqs[-1], within_s=WAIT_S)
        finally:
            await stopped(consumer)


async def test_deliveries_taken_in_the_readers_step_keep_the_pull_alive_for_the_waiting_iterator(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The iterator, waiting all along while the reader's hook takes every delivery, must not
    # read its pull's silence as a lost request: a second pull would then be outstanding.
    # Entries keep arriving (each written once the one before was reacted to) for three
    # times the silence it allows; the server sends no heartbeat while messages flow.
    monkeypatch.setattr(jetstream, "PULL_SILENCE_S", 0.5)
    monkeypatch.setattr(jetstream, "PULL_BATCH", 1_000_000)  # no renewal by count meanwhile
    pulls = 0
    pull = jetstream.JetStreamSubscription._pull

    async def counted_pull(self: jetstream.JetStreamSubscription) -> None:
        nonlocal pulls
        pulls += 1
        await pull(self)

    monkeypatch.setattr(jetstream.JetStreamSubscription, "_pull", counted_pull)
    async with logs(nats_url) as (log, writer):
        loop = DeciderLoop(log, service="admission-queue")
        reacted = asyncio.Event()
        in_hook: list[bool] = []

        async def react_batch(entries: list[StoredEvent]) -> None:
            subscription = loop._subscription
            assert isinstance(subscription, jetstream.JetStreamSubscription)
            in_hook.append(subscription._waiting)
            reacted.set()

        consumer = await started(loop, react_batch)
        try:
            clock = asyncio.get_running_loop().time
            until = clock() + 3 * 0.5
            written = 0
            while clock() < until:
                reacted.clear()
                await writer.append(note(f"steady {written}"))
                written += 1
                async with asyncio.timeout(WAIT_S):
                    await reacted.wait()
            assert sum(in_hook) >= written // 2  # the hook took most of them, not the iterator
            assert pulls == 1
        finally:
            await stopped(consumer)
