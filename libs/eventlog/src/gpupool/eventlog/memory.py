"""The event log in memory: the JetStream semantics without a server.

Differences from :class:`~gpupool.eventlog.jetstream.JetStreamEventLog`, all on
purpose: ids are deduplicated forever (JetStream: within the duplicate window),
and an unacknowledged delivery is only redelivered after a nak or when its
subscription closes (there is no clock, so no ack wait).
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import AsyncIterator, Sequence

from gpupool.eventlog.port import (
    ConcurrencyConflict,
    Delivery,
    Entry,
    EventLogClosed,
    check_one_node,
    read_entry,
)
from gpupool.eventlog.subjects import (
    DEFAULT_SUBJECT_PREFIX,
    node_subject_filter,
    subject_for,
    subject_matches,
)
from gpupool.events import Envelope, encode_envelope, event_node


class _Record:
    __slots__ = ("data", "subject")

    def __init__(self, subject: str, data: bytes) -> None:
        self.subject = subject
        self.data = data


class InMemoryEventLog:
    """An :class:`~gpupool.eventlog.port.EventLog` held in a list; one per test or simulation."""

    def __init__(self, *, subject_prefix: str = DEFAULT_SUBJECT_PREFIX) -> None:
        self.subject_prefix = subject_prefix
        self._records: list[_Record] = []
        self._seq_by_id: dict[str, int] = {}
        self._consumers: dict[str, _MemoryConsumer] = {}
        self._appended = asyncio.Event()
        self._closed = False

    # ------------------------------------------------------------------ writing

    async def append(self, envelope: Envelope, *, expected_node_seq: int | None = None) -> int:
        self._check_open()
        known = self._seq_by_id.get(envelope.id)
        if known is not None:
            return known
        subject = subject_for(envelope.event, prefix=self.subject_prefix)
        if expected_node_seq is not None:
            node = event_node(envelope.event)
            actual = self._last_seq_matching(node_subject_filter(node, prefix=self.subject_prefix))
            if actual != expected_node_seq:
                raise ConcurrencyConflict(node=node, expected=expected_node_seq, actual=actual)
        seq = self._store(subject, encode_envelope(envelope))
        self._seq_by_id[envelope.id] = seq
        return seq

    async def append_many(
        self, envelopes: Sequence[Envelope], *, expected_node_seq: int | None = None
    ) -> list[int]:
        if expected_node_seq is not None:
            check_one_node(envelopes)
        seqs: list[int] = []
        expected = expected_node_seq
        for envelope in envelopes:
            try:
                seq = await self.append(envelope, expected_node_seq=expected)
            except ConcurrencyConflict as conflict:
                conflict.appended = tuple(seqs)
                raise
            seqs.append(seq)
            if expected is not None:
                expected = seq
        return seqs

    async def append_raw(self, subject: str, data: bytes) -> int:
        self._check_open()
        if not subject_matches(subject, f"{self.subject_prefix}.>") or "*" in subject:
            raise ValueError(f"{subject!r} is not a subject of this log ({self.subject_prefix}.>)")
        return self._store(subject, bytes(data))

    def _store(self, subject: str, data: bytes) -> int:
        self._records.append(_Record(subject, data))
        self._wake()
        return len(self._records)

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
                yield read_entry(seq, record.subject, record.data)

    def subscribe(self, *, durable: str, node: str | None = None) -> MemorySubscription:
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
        return MemorySubscription(self, consumer)

    async def close(self) -> None:
        self._closed = True
        self._wake()

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise EventLogClosed("the in-memory event log is closed")

    def _last_seq_matching(self, subject_filter: str) -> int:
        for seq in range(len(self._records), 0, -1):
            if subject_matches(self._records[seq - 1].subject, subject_filter):
                return seq
        return 0

    def _entry(self, seq: int) -> Entry:
        record = self._records[seq - 1]
        return read_entry(seq, record.subject, record.data)


class _MemoryConsumer:
    """A durable consumer: a cursor over the log, redeliveries first, and what is out unacked."""

    def __init__(self, subject_filter: str) -> None:
        self.subject_filter = subject_filter
        self.cursor = 0
        self.redeliver: list[int] = []
        self.outstanding: set[int] = set()

    def next_seq(self, log: InMemoryEventLog) -> int | None:
        while self.redeliver:
            seq = heapq.heappop(self.redeliver)
            if seq in self.outstanding:
                continue
            return seq
        while self.cursor < len(log._records):
            self.cursor += 1
            if subject_matches(log._records[self.cursor - 1].subject, self.subject_filter):
                return self.cursor
        return None

    def give_back(self, seq: int) -> None:
        heapq.heappush(self.redeliver, seq)


class MemoryDelivery:
    __slots__ = ("_done", "_entry", "_subscription")

    def __init__(self, subscription: MemorySubscription, entry: Entry) -> None:
        self._subscription = subscription
        self._entry = entry
        self._done = False

    @property
    def entry(self) -> Entry:
        return self._entry

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
                delivery = MemoryDelivery(self, self._log._entry(seq))
                self._consumer.outstanding.add(seq)
                self._unacked[seq] = delivery
                return delivery
            await appended.wait()

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
