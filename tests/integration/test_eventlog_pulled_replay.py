"""The replay by raw pulls on a real nats-server: every entry once, in order, whatever is lost.

``JetStreamEventLog.replay`` reads a consumer without acks by raw pulls
(gpupool.eventlog.pulled_replay). It proves contiguity by the consumer's delivery
numbers: a delivery lost on the way, the consumer deleted under the replay, or a stall
(less than a pull's worth arriving in time: what did arrive is handed out first) makes it
open a new consumer after the last entry it handed out, and it still hands out every
entry once; it ends at the entries pending when it started, leaving no consumer behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from itertools import accumulate

import pytest

from gpupool.eventlog import JetStreamEventLog, jetstream, pulled_replay
from gpupool.eventlog.log_client import LogClient, inline_status
from gpupool.eventlog.port import Entry, EventLogClosed
from gpupool.events import Envelope, MessageRejected

pytestmark = pytest.mark.integration

ENTRIES = 2 * pulled_replay.REPLAY_BATCH + 500
"""More than the two pulls kept in flight: the replay pulls again while it reads."""


def rejected(i: int) -> Envelope:
    return Envelope(
        id=f"entry-{i}",
        time=datetime(2025, 1, 1, tzinfo=UTC),
        event=MessageRejected(subject="test", reason=f"entry {i}", payload=""),
    )


async def filled(log: JetStreamEventLog) -> list[int]:
    return await log.append_many([rejected(i) for i in range(ENTRIES)])


def counted(inner: pulled_replay.Opener, opened: list[str]) -> pulled_replay.Opener:
    """``inner``, each consumer it opens named into ``opened``."""

    async def open_consumer(start: int) -> tuple[str, int]:
        name, pending = await inner(start)
        opened.append(name)
        return name, pending

    return open_consumer


def counting_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The consumers the log's replays open, by name, in order."""
    opened: list[str] = []
    make = pulled_replay.open_ephemeral

    def open_ephemeral(nc: object, stream: str, subject_filter: str) -> pulled_replay.Opener:
        return counted(make(nc, stream, subject_filter), opened)

    monkeypatch.setattr(jetstream, "open_ephemeral", open_ephemeral)
    return opened


def delivering_only(
    monkeypatch: pytest.MonkeyPatch, passes: Callable[[pulled_replay._Inbox, bytes | None], bool]
) -> None:
    """Of what the server sends a replay's inbox (a delivery, ``headers`` None; or a status),
    only what ``passes`` lets through reaches it; the rest is gone, or still on its way."""
    on_status = pulled_replay._Inbox.on_status
    on_delivered = pulled_replay._Inbox.on_delivered
    seen: dict[pulled_replay._Inbox, tuple[list[bytes], int]] = {}

    def passing_status(inbox: pulled_replay._Inbox, headers: bytes) -> None:
        if passes(inbox, headers):
            on_status(inbox, headers)

    def passing_deliveries(inbox: pulled_replay._Inbox) -> None:
        # the deliveries appended since the last call (the replay takes the lists, whole)
        datas = inbox.datas
        before, count = seen.get(inbox, (None, 0))
        first = count if before is datas else 0
        kept = [passes(inbox, None) for _ in datas[first:]]
        for column in (inbox.subjects, inbox.replies, datas):
            column[first:] = [item for item, keep in zip(column[first:], kept, strict=True) if keep]
        seen[inbox] = (datas, len(datas))
        on_delivered(inbox)

    monkeypatch.setattr(pulled_replay._Inbox, "on_status", passing_status)
    monkeypatch.setattr(pulled_replay._Inbox, "on_delivered", passing_deliveries)


async def consumers_left(log: JetStreamEventLog) -> list[str]:
    return [info.name for info in await log._js.consumers_info(log.stream)]


async def replayed(log: JetStreamEventLog, *, from_seq: int = 1) -> list[Entry]:
    async with asyncio.timeout(60):
        return [entry async for entry in log.replay(from_seq=from_seq)]


async def test_a_replay_of_several_pulls_hands_out_every_entry_once_and_leaves_no_consumer(
    jetstream_log: JetStreamEventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs = await filled(jetstream_log)
    opened = counting_opens(monkeypatch)
    entries = await replayed(jetstream_log)
    assert [entry.seq for entry in entries] == seqs
    assert len(opened) == 1  # nothing lost: one consumer
    assert await consumers_left(jetstream_log) == []
    middle = seqs[len(seqs) // 2]
    assert [e.seq for e in await replayed(jetstream_log, from_seq=middle)] == seqs[len(seqs) // 2 :]
    batches = [batch async for batch in jetstream_log.replay_batches()]
    # what has arrived, read (decoded) READ_CHUNK entries at a time: each batch is folded
    # while what its read made is still in the core's cache
    assert all(0 < len(batch) <= pulled_replay.READ_CHUNK for batch in batches)
    assert len(batches) >= ENTRIES // pulled_replay.READ_CHUNK
    assert [entry.seq for batch in batches for entry in batch] == seqs


async def test_a_decision_entry_is_never_split_between_batches(
    jetstream_log: JetStreamEventLog,
) -> None:
    """A replay's batch holds whole log entries: a decision entry's envelopes (one stream
    message) are handed out together, whatever the READ_CHUNK boundaries."""
    singles = await jetstream_log.append_many(
        [rejected(i) for i in range(pulled_replay.READ_CHUNK - 1)]
    )
    decision = [
        Envelope(
            id=f"decision-{k}",
            time=datetime(2025, 1, 1, tzinfo=UTC),
            event=MessageRejected(subject="test", reason=f"decision {k}", payload=""),
        )
        for k in range(3)
    ]
    seq = await jetstream_log.append_decision(decision)  # the chunk's last entry
    after = await jetstream_log.append_many([rejected(i) for i in range(1000, 1005)])
    batches = [batch async for batch in jetstream_log.replay_batches()]
    # its three envelopes go past READ_CHUNK envelopes, all in the first batch
    assert [len(batch) for batch in batches] == [pulled_replay.READ_CHUNK + 2, 5]
    assert [entry.seq for entry in batches[0][-3:]] == [seq] * 3
    assert [(entry.index, entry.last) for entry in batches[0][-3:]] == [
        (0, False),
        (1, False),
        (2, True),
    ]
    assert [entry.seq for entry in batches[0][:-3]] == singles
    assert [entry.seq for entry in batches[1]] == after


async def test_a_delivery_lost_on_the_way_is_read_again_from_a_new_consumer(
    jetstream_log: JetStreamEventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs = await filled(jetstream_log)
    opened = counting_opens(monkeypatch)
    seen = 0
    lost = pulled_replay.REPLAY_BATCH + 7  # one delivery in the second pull

    def all_but_the_lost_one(inbox: pulled_replay._Inbox, headers: bytes | None) -> bool:
        nonlocal seen
        if inline_status(headers) is None:  # an entry, not a status
            seen += 1
            return seen != lost  # gone, as with a connection that dropped
        return True

    delivering_only(monkeypatch, all_but_the_lost_one)
    entries = await replayed(jetstream_log)
    assert [entry.seq for entry in entries] == seqs  # the lost one too, nothing twice
    assert len(opened) == 2  # the gap was seen: a second consumer read on after it
    assert await consumers_left(jetstream_log) == []


async def test_a_replay_whose_consumer_is_deleted_under_it_reads_on_from_a_new_one(
    jetstream_log: JetStreamEventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs = await filled(jetstream_log)
    opened = counting_opens(monkeypatch)
    entries: list[Entry] = []
    async with asyncio.timeout(60):
        async for batch in jetstream_log.replay_batches():
            entries += batch
            if len(opened) == 1 and len(entries) == len(batch):  # after the first batch
                await jetstream_log._js.delete_consumer(jetstream_log.stream, opened[0])
    assert [entry.seq for entry in entries] == seqs
    assert len(opened) == 2
    assert await consumers_left(jetstream_log) == []


TRICKLE = 300
"""Deliveries of each consumer that reach the replay before it stalls (less than a pull)."""
STALL_S = 0.25


def trickling(monkeypatch: pytest.MonkeyPatch, per_consumer: int) -> None:
    """Each consumer's first ``per_consumer`` deliveries reach the replay; the rest are
    still on their way when it stalls (a replay slower than a pull per stall)."""
    arrived: dict[pulled_replay._Inbox, int] = {}

    def the_first_ones(inbox: pulled_replay._Inbox, headers: bytes | None) -> bool:
        if inline_status(headers) is not None:  # a status, not an entry
            return True
        count = arrived[inbox] = arrived.get(inbox, 0) + 1
        return count <= per_consumer

    delivering_only(monkeypatch, the_first_ones)


async def stalling_replay(log: JetStreamEventLog, opened: list[str]) -> list[list[Entry]]:
    """The whole log by raw pulls, a stall being ``STALL_S``; the consumers into ``opened``."""
    nc = log._nc
    assert isinstance(nc, LogClient)
    open_consumer = counted(
        pulled_replay.open_ephemeral(nc, log.stream, f"{log.subject_prefix}.>"), opened
    )
    async with asyncio.timeout(60):
        return [
            batch
            async for batch in pulled_replay.pulled_batches(
                nc, stream=log.stream, open_consumer=open_consumer, start=1, stall_s=STALL_S
            )
        ]


async def test_a_replay_slower_than_a_pull_per_stall_hands_out_what_arrived_and_reads_on(
    jetstream_log: JetStreamEventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs = await filled(jetstream_log)
    trickling(monkeypatch, TRICKLE)
    opened: list[str] = []
    batches = await stalling_replay(jetstream_log, opened)
    assert [entry.seq for batch in batches for entry in batch] == seqs  # once each, in order
    sizes = [len(batch) for batch in batches]
    assert all(0 < size <= pulled_replay.READ_CHUNK for size in sizes)
    # what each consumer delivered before its stall is handed out whole before the next
    # consumer's: the batches end at every multiple of TRICKLE (not one of READ_CHUNK)
    assert set(range(TRICKLE, ENTRIES, TRICKLE)) <= set(accumulate(sizes))
    assert len(opened) >= -(-ENTRIES // TRICKLE)  # each stall read on from a new consumer
    assert await consumers_left(jetstream_log) == []


async def test_a_consumer_that_delivers_nothing_is_given_up_for_a_new_one(
    jetstream_log: JetStreamEventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pull requests lost (a reconnect): nothing arrives, and a new consumer reads it all."""
    seqs = await filled(jetstream_log)
    silent: list[pulled_replay._Inbox] = []

    def not_to_the_first_inbox(inbox: pulled_replay._Inbox, headers: bytes | None) -> bool:
        if not silent:
            silent.append(inbox)
        return inbox is not silent[0]

    delivering_only(monkeypatch, not_to_the_first_inbox)
    opened: list[str] = []
    batches = await stalling_replay(jetstream_log, opened)
    assert [entry.seq for batch in batches for entry in batch] == seqs
    # the silent one given up for a new one (more if a busy machine made a later consumer
    # miss the short stall time too: that one hands out what it had, and reads on)
    assert len(opened) >= 2
    assert await consumers_left(jetstream_log) == []


async def test_a_replay_closed_between_the_batches_of_one_pull_hands_out_no_more(
    jetstream_log: JetStreamEventLog,
) -> None:
    """A pull's deliveries are read READ_CHUNK at a time: the log closing after the first
    ends the replay there, not after the rest of the pull is read and handed out."""
    await filled(jetstream_log)
    nc = jetstream_log._nc
    assert isinstance(nc, LogClient)
    replay = pulled_replay.PulledReplay()
    batches: list[list[Entry]] = []

    async def read_closing_after_the_first() -> None:
        async with asyncio.timeout(60):
            async for batch in pulled_replay.pulled_batches(
                nc,
                stream=jetstream_log.stream,
                open_consumer=pulled_replay.open_ephemeral(
                    nc, jetstream_log.stream, f"{jetstream_log.subject_prefix}.>"
                ),
                start=1,
                replay=replay,
            ):
                batches.append(batch)
                replay.close()

    with pytest.raises(EventLogClosed):
        await read_closing_after_the_first()
    assert [len(batch) for batch in batches] == [pulled_replay.READ_CHUNK]
    assert await consumers_left(jetstream_log) == []
