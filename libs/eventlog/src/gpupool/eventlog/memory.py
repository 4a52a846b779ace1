"""The event log in memory: the JetStream semantics without a server.

Differences from :class:`~gpupool.eventlog.jetstream.JetStreamEventLog`, all on
purpose: ids are deduplicated forever (JetStream: within the duplicate window),
and an unacknowledged delivery is only redelivered after a nak or when its
subscription closes (there is no clock, so no ack wait).
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import AsyncIterator, Callable, Sequence

from gpupool.eventlog.port import (
    ConcurrencyConflict,
    DecisionAppend,
    Delivery,
    Entry,
    EventLogClosed,
    StoredEvent,
    append_each,
    check_one_node,
    entry_subject,
    read_entries,
)
from gpupool.eventlog.subjects import (
    DEFAULT_SUBJECT_PREFIX,
    DEFAULT_WRITER,
    node_subject_filter,
    node_token,
    subject_matches,
    writer_subject_filter,
    writer_token,
)
from gpupool.events import Envelope, encode_entry, encode_envelope, event_node

REPLAY_BATCH = 1024
"""Entries per list of ``replay_batches``."""


class _Record:
    __slots__ = ("data", "subject")

    def __init__(self, subject: str, data: bytes) -> None:
        self.subject = subject
        self.data = data


class InMemoryEventLog:
    """An :class:`~gpupool.eventlog.port.EventLog` held in a list; one per test or simulation."""

    def __init__(
        self, *, subject_prefix: str = DEFAULT_SUBJECT_PREFIX, writer: str = DEFAULT_WRITER
    ) -> None:
        self.subject_prefix = subject_prefix
        self.writer = writer_token(writer)
        self._records: list[_Record] = []
        self._seq_by_id: dict[str, int] = {}
        self._last_by_subject: dict[str, int] = {}
        self._last_by_node: dict[str, int] = {}
        """The last sequence on each subject, and on each node token's subjects."""
        self._consumers: dict[str, _MemoryConsumer] = {}
        self._appended = asyncio.Event()
        self._closed = False

    # ------------------------------------------------------------------ writing

    async def append(self, envelope: Envelope, *, expected_node_seq: int | None = None) -> int:
        return await self.append_decision([envelope], expected_node_seq=expected_node_seq)

    async def append_decision(
        self,
        envelopes: Sequence[Envelope],
        *,
        expected_node_seq: int | None = None,
        expected_writer: str | None = None,
    ) -> int:
        self._check_open()
        if not envelopes:
            raise ValueError("a decision holds at least one envelope")
        subject = entry_subject(envelopes, prefix=self.subject_prefix, writer=self.writer)
        entry_id = envelopes[0].id
        known = self._seq_by_id.get(entry_id)
        if known is not None:
            return known
        if expected_node_seq is not None:
            node = event_node(envelopes[0].event)
            if expected_writer is None:
                actual = self._last_by_node.get(node_token(node), 0)
            else:
                actual = self._last_by_subject.get(
                    writer_subject_filter(expected_writer, node, prefix=self.subject_prefix), 0
                )
            if actual != expected_node_seq:
                raise ConcurrencyConflict(node=node, expected=expected_node_seq, actual=actual)
        data = (
            encode_envelope(envelopes[0]) if len(envelopes) == 1 else encode_entry(list(envelopes))
        )
        seq = self._store(subject, data)
        self._seq_by_id[entry_id] = seq
        return seq

    async def append_decisions(self, decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
        return await append_each(self, decisions)

    async def append_many(
        self, envelopes: Sequence[Envelope], *, expected_node_seq: int | None = None
    ) -> list[int]:
        if expected_node_seq is not None:
            check_one_node(envelopes)
            if not envelopes:
                return []
            seq = await self.append_decision(envelopes, expected_node_seq=expected_node_seq)
            return [seq] * len(envelopes)
        return [await self.append(envelope) for envelope in envelopes]

    async def append_raw(self, subject: str, data: bytes) -> int:
        self._check_open()
        if not subject_matches(subject, f"{self.subject_prefix}.>") or "*" in subject:
            raise ValueError(f"{subject!r} is not a subject of this log ({self.subject_prefix}.>)")
        return self._store(subject, bytes(data))

    def _store(self, subject: str, data: bytes) -> int:
        self._records.append(_Record(subject, data))
        seq = len(self._records)
        self._last_by_subject[subject] = seq
        token = subject[len(self.subject_prefix) + 1 :].split(".", 1)
        if len(token) == 2:  # <prefix>.<node_token>.<...>: the node's entries
            self._last_by_node[token[0]] = seq
        self._wake()
        return seq

    def _wake(self) -> None:
        """Wake every subscriber waiting for something to deliver."""
        appended, self._appended = self._appended, asyncio.Event()
        appended.set()

    # ------------------------------------------------------------------ reading

    async def last_seq(self) -> int:
        self._check_open()
        return len(self._records)

    async def replay(self, *, node: str | None = None, from_seq: int = 1) -> AsyncIterator[Entry]:
        self._check_open()
        subject_filter = node_subject_filter(node, prefix=self.subject_prefix)
        end = len(self._records)
        for seq in range(max(from_seq, 1), end + 1):
            if self._closed:
                raise EventLogClosed("the in-memory event log was closed during a replay")
            record = self._records[seq - 1]
            if subject_matches(record.subject, subject_filter):
                for entry in read_entries(seq, record.subject, record.data):
                    yield entry

    async def replay_batches(
        self, *, node: str | None = None, from_seq: int = 1
    ) -> AsyncIterator[list[Entry]]:
        """``replay``'s entries (a subclass's ``replay`` included), in lists of about
        :data:`REPLAY_BATCH`, never splitting a decision entry."""
        batch: list[Entry] = []
        async for entry in self.replay(node=node, from_seq=from_seq):
            batch.append(entry)
            if len(batch) >= REPLAY_BATCH and (not isinstance(entry, StoredEvent) or entry.last):
                yield batch
                batch = []
        if batch:
            yield batch

    def subscribe(
        self, *, durable: str, node: str | None = None, from_seq: int = 1
    ) -> MemorySubscription:
        self._check_open()
        subject_filter = node_subject_filter(node, prefix=self.subject_prefix)
        consumer = self._consumers.get(durable)
        if consumer is None:
            consumer = self._consumers[durable] = _MemoryConsumer(subject_filter)
        elif consumer.subject_filter != subject_filter:
            raise ValueError(
                f"durable {durable!r} exists with filter {consumer.subject_filter!r}, "
                f"not {subject_filter!r}"
            )
        consumer.skip_to(from_seq)
        return MemorySubscription(self, consumer)

    async def close(self) -> None:
        self._closed = True
        self._wake()

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise EventLogClosed("the in-memory event log is closed")

    def _entries(self, seq: int) -> tuple[Entry, ...]:
        record = self._records[seq - 1]
        return read_entries(seq, record.subject, record.data)


class _MemoryConsumer:
    """A durable consumer: a cursor over the log, redeliveries first, and what is out unacked."""

    def __init__(self, subject_filter: str) -> None:
        self.subject_filter = subject_filter
        self.cursor = 0
        self.redeliver: list[int] = []
        self.outstanding: set[int] = set()
        self.follows: int | None = None
        """Of the sequence ``next_seq`` returned last: see ``Delivery.follows``."""

    def next_seq(self, log: InMemoryEventLog) -> int | None:
        self.follows = None
        while self.redeliver:
            seq = heapq.heappop(self.redeliver)
            if seq in self.outstanding:
                continue
            return seq
        self.follows = self.cursor  # no entry of the filter lies between it and the next
        while self.cursor < len(log._records):
            self.cursor += 1
            if subject_matches(log._records[self.cursor - 1].subject, self.subject_filter):
                return self.cursor
        return None

    def skip_to(self, seq: int) -> None:
        """Deliver nothing before ``seq`` (the subscriber folded it already)."""
        if seq - 1 > self.cursor:
            self.cursor = seq - 1
        self.redeliver = [kept for kept in self.redeliver if kept >= seq]
        heapq.heapify(self.redeliver)

    def give_back(self, seq: int) -> None:
        heapq.heappush(self.redeliver, seq)


class MemoryDelivery:
    __slots__ = ("_done", "_entries", "_subscription", "follows")

    def __init__(
        self,
        subscription: MemorySubscription,
        entries: tuple[Entry, ...],
        follows: int | None = None,
    ) -> None:
        self._subscription = subscription
        self._entries = entries
        self._done = False
        self.follows = follows

    @property
    def seq(self) -> int:
        return self._entries[0].seq

    @property
    def entry(self) -> Entry:
        return self._entries[0]

    @property
    def entries(self) -> tuple[Entry, ...]:
        return self._entries

    async def ack(self) -> None:
        if not self._done:
            self._done = True
            self._subscription._settle(self, redeliver=False)

    async def nak(self) -> None:
        if not self._done:
            self._done = True
            self._subscription._settle(self, redeliver=True)


class MemorySubscription:
    """Deliveries of one subscriber; several subscribers of a durable share its entries."""

    def __init__(self, log: InMemoryEventLog, consumer: _MemoryConsumer) -> None:
        self._log = log
        self._consumer = consumer
        self._unacked: dict[int, MemoryDelivery] = {}
        self._closed = False

    def __aiter__(self) -> MemorySubscription:
        return self

    async def __anext__(self) -> Delivery:
        while True:
            if self._closed:
                raise StopAsyncIteration
            self._log._check_open()
            appended = self._log._appended
            seq = self._consumer.next_seq(self._log)
            if seq is not None:
                delivery = MemoryDelivery(self, self._log._entries(seq), self._consumer.follows)
                self._consumer.outstanding.add(seq)
                self._unacked[seq] = delivery
                return delivery
            await appended.wait()

    def take_ready(self, limit: int) -> list[Delivery]:
        """Deliveries available now, at most ``limit``, without waiting."""
        taken: list[Delivery] = []
        while len(taken) < limit and not self._closed and not self._log._closed:
            seq = self._consumer.next_seq(self._log)
            if seq is None:
                break
            delivery = MemoryDelivery(self, self._log._entries(seq), self._consumer.follows)
            self._consumer.outstanding.add(seq)
            self._unacked[seq] = delivery
            taken.append(delivery)
        return taken

    async def ack_many(self, deliveries: Sequence[Delivery], *, now: bool = False) -> None:
        """Ack each of ``deliveries`` in order (``JetStreamSubscription.ack_many``; ``now``
        changes nothing here: an ack is applied at once)."""
        for delivery in deliveries:
            await delivery.ack()

    def react_on_arrival(self, hook: Callable[[], bool] | None) -> bool:
        """Not here: an append wakes the iterator (no reader step to react within)."""
        return False

    async def __aenter__(self) -> MemorySubscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for delivery in list(self._unacked.values()):
            await delivery.nak()
        self._log._wake()

    def _settle(self, delivery: MemoryDelivery, *, redeliver: bool) -> None:
        seq = delivery.entry.seq
        self._unacked.pop(seq, None)
        self._consumer.outstanding.discard(seq)
        if redeliver:
            self._consumer.give_back(seq)
            self._log._wake()
