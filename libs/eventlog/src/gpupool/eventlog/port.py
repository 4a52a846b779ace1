"""The event-log port: what services may ask of the append-only log.

Two adapters implement it with the same semantics, checked by one contract
suite (tests/contract/test_eventlog_contract.py): :class:`InMemoryEventLog` for
unit tests and ``gpupool simulate``, :class:`JetStreamEventLog` for everything
real. docs/eventlog.md describes subjects, headers, consumers and dead letters.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Protocol

import msgspec

from gpupool.eventlog.subjects import node_token
from gpupool.events import (
    NODELESS,
    Envelope,
    EventDecodeError,
    MessageRejected,
    decode_envelope,
    event_node,
)


class StoredEvent(msgspec.Struct, frozen=True):
    """An envelope as the log holds it: its stream sequence and subject."""

    seq: int
    subject: str
    envelope: Envelope


class Undecodable(msgspec.Struct, frozen=True):
    """An entry on a log subject whose bytes are not an envelope this code can read."""

    seq: int
    subject: str
    data: bytes
    error: str


Entry = StoredEvent | Undecodable


class ConcurrencyConflict(Exception):
    """Another entry was appended for the node after the sequence the writer expected.

    ``actual`` is the node's last sequence when the server knows it. For
    ``append_many``, ``appended`` holds the sequences already committed before
    the conflict (the batch is not atomic).
    """

    def __init__(
        self,
        *,
        node: str,
        expected: int,
        actual: int | None = None,
        appended: tuple[int, ...] = (),
    ) -> None:
        self.node = node
        self.expected = expected
        self.actual = actual
        self.appended = appended
        actual_text = "unknown" if actual is None else str(actual)
        super().__init__(
            f"node {node or '<none>'!s}: expected last sequence {expected}, log has {actual_text}"
        )


class EventLogClosed(RuntimeError):
    """The log was closed while an iterator was still reading from it."""


class Delivery(Protocol):
    """One entry handed to a durable subscriber; ack when handled, nak to get it again."""

    @property
    def entry(self) -> Entry: ...

    async def ack(self) -> None: ...

    async def nak(self) -> None: ...


class Subscription(Protocol):
    """A live, durable subscription. Closing it hands unacknowledged deliveries back at once."""

    def __aiter__(self) -> AsyncIterator[Delivery]: ...

    async def __anext__(self) -> Delivery: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Subscription: ...

    async def __aexit__(self, *exc_info: object) -> None: ...


class EventLog(Protocol):
    """The append-only log of gpupool: ordered, replayable, deduplicated by envelope id."""

    async def append(self, envelope: Envelope, *, expected_node_seq: int | None = None) -> int:
        """Append one envelope and return its stream sequence.

        Appending an envelope whose id is already in the log returns the original
        sequence and adds nothing. With ``expected_node_seq=S`` the append fails with
        :class:`ConcurrencyConflict` unless the node's last entry is at ``S``
        (``0``: the node has no entry yet).
        """
        ...

    async def append_many(
        self, envelopes: Sequence[Envelope], *, expected_node_seq: int | None = None
    ) -> list[int]:
        """Append several envelopes in order and return their sequences.

        With ``expected_node_seq`` all envelopes must be for one node; the first
        expects ``S``, each next one the sequence of the one before it.
        """
        ...

    async def append_raw(self, subject: str, data: bytes) -> int:
        """Append arbitrary bytes on a log subject (tests, garbage injection)."""
        ...

    async def last_seq(self) -> int:
        """The sequence of the last entry (0 for an empty log)."""
        ...

    def replay(self, *, node: str | None = None, from_seq: int = 1) -> AsyncIterator[Entry]:
        """Every entry present when called, from ``from_seq`` on, in order; then it stops."""
        ...

    def subscribe(self, *, durable: str, node: str | None = None) -> Subscription:
        """Live entries for a durable consumer: explicit ack, at-least-once.

        A new durable starts at the beginning of the log; a known one resumes after
        what it acknowledged. Unacknowledged entries are delivered again.
        """
        ...

    async def close(self) -> None:
        """Release connections; running iterators end with :class:`EventLogClosed`. Idempotent."""
        ...


def check_one_node(envelopes: Sequence[Envelope]) -> None:
    """``append_many`` with an expectation chains one node's sequence: all envelopes must share it."""
    tokens = {node_token(event_node(envelope.event)) for envelope in envelopes}
    if len(tokens) > 1:
        raise ValueError(
            "append_many with expected_node_seq needs envelopes of one node, got "
            + ", ".join(sorted(tokens))
        )


def read_entry(seq: int, subject: str, data: bytes) -> Entry:
    """Decode the bytes of one log entry; garbage becomes :class:`Undecodable`, never an error."""
    try:
        return StoredEvent(seq=seq, subject=subject, envelope=decode_envelope(data))
    except EventDecodeError as exc:
        return Undecodable(seq=seq, subject=subject, data=data, error=str(exc))


REJECTED_PAYLOAD_LIMIT = 4096
"""How many characters of an undecodable payload a MessageRejected keeps."""


def rejection_id(seq: int) -> str:
    """The envelope id of the rejection of entry ``seq``: the same for every service, so it is recorded once."""
    return f"rejected-{seq}"


def rejection_envelope(entry: Undecodable, *, time: datetime) -> Envelope:
    """The dead letter of an undecodable entry, to append on ``<prefix>._.MessageRejected``."""
    payload = entry.data.decode("utf-8", errors="replace")[:REJECTED_PAYLOAD_LIMIT]
    return Envelope(
        id=rejection_id(entry.seq),
        time=time,
        event=MessageRejected(
            subject=entry.subject, reason=entry.error, payload=payload, node=NODELESS
        ),
    )
