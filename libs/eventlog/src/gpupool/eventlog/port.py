"""The event-log port: what services may ask of the append-only log.

Two adapters implement it with the same semantics, checked by one contract
suite (tests/contract/test_eventlog_contract.py): :class:`InMemoryEventLog` for
unit tests and ``gpupool simulate``, :class:`JetStreamEventLog` for everything
real. docs/eventlog.md describes subjects, headers, consumers and dead letters.
"""

from __future__ import annotations

import operator
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime
from typing import NamedTuple, Protocol, cast

import msgspec

from gpupool.eventlog.subjects import (
    DEFAULT_WRITER,
    node_entry_subject,
    node_of_subject,
    node_token,
)
from gpupool.events import (
    NODELESS,
    Envelope,
    EventDecodeError,
    MessageRejected,
    decode_entry,
    decode_plain,
    decode_plain_many,
    event_node,
)
from gpupool.events.limits import MAX_MESSAGE, MAX_NODE_NAME


class StoredEvent(msgspec.Struct, frozen=True, gc=False):
    """An envelope as the log holds it: its stream sequence and subject.

    A decision entry (several envelopes committed as one stream message) is read as
    one StoredEvent per envelope, all with the entry's ``seq``: ``index`` is the
    envelope's place in the entry and ``last`` marks the entry's final envelope.
    """

    seq: int
    subject: str
    envelope: Envelope
    index: int = 0
    last: bool = True


class Undecodable(msgspec.Struct, frozen=True, gc=False):
    """An entry on a log subject whose bytes are not an envelope this code can read."""

    seq: int
    subject: str
    data: bytes
    error: str


Entry = StoredEvent | Undecodable


class ConcurrencyConflict(Exception):
    """Another entry was appended for the node after the sequence the writer expected.

    ``actual`` is the node's last sequence when the server knows it. Nothing of
    the refused append was committed: a decision is one entry, all or nothing.
    """

    def __init__(
        self,
        *,
        node: str,
        expected: int,
        actual: int | None = None,
    ) -> None:
        self.node = node
        self.expected = expected
        self.actual = actual
        actual_text = "unknown" if actual is None else str(actual)
        super().__init__(
            f"node {node or '<none>'!s}: expected last sequence {expected}, log has {actual_text}"
        )


class EventLogClosed(RuntimeError):
    """The log was closed while an iterator was still reading from it."""


class Delivery(Protocol):
    """One stream message handed to a durable subscriber; ack when handled, nak to get it again.

    ``entries`` are its events (several for a decision entry, in order); ``entry`` is the first.
    ``seq`` is the entry's stream sequence, known without decoding it: a subscriber that
    already folded that sequence (its own append, a redelivery) acks it unread.
    """

    @property
    def seq(self) -> int: ...

    @property
    def follows(self) -> int | None:
        """A sequence below ``seq`` such that no entry of the subscription's subjects lies
        strictly between the two; None: not known (a redelivery, or a delivery before it was
        not seen). A partitioned reader passes its watermark over a gap only with this proof
        (docs/eventlog.md, "A node's partition")."""
        ...

    @property
    def entry(self) -> Entry: ...

    @property
    def entries(self) -> tuple[Entry, ...]: ...

    async def ack(self) -> None: ...

    async def nak(self) -> None: ...


class Subscription(Protocol):
    """A live, durable subscription. Closing it hands unacknowledged deliveries back at once."""

    def __aiter__(self) -> AsyncIterator[Delivery]: ...

    async def __anext__(self) -> Delivery: ...

    def take_ready(self, limit: int) -> list[Delivery]:
        """The deliveries that can be handed out now, at most ``limit``, without waiting.

        A consumer takes one delivery with ``__anext__`` and then everything already
        received with this, to fold it all before deciding (batched consumption)."""
        ...

    async def ack_many(self, deliveries: Sequence[Delivery], *, now: bool = False) -> None:
        """Ack each of ``deliveries`` (this subscription's) in order, as ``ack`` would each;
        an adapter may send them together (JetStream: one write of the ack frames).

        ``now``: the batch's last frames (JetStream: they go to the socket in this step
        where they can, not on the flusher's turn; a later write in the step is not held
        back by them)."""
        ...

    def react_on_arrival(self, hook: Callable[[], bool] | None) -> bool:
        """Call ``hook()`` within the step that received deliveries while the iterator
        waits for them, instead of waking the iterator on a later turn of the event loop.

        ``hook`` takes the deliveries with :meth:`take_ready` and returns True, or returns
        False and the iterator is woken as without a hook; it must not raise, block or
        await (it starts what must wait as a task). None removes it. Returns False where
        the adapter has no such step (the iterator is woken as usual)."""
        ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Subscription: ...

    async def __aexit__(self, *exc_info: object) -> None: ...


class DecisionAppend(NamedTuple):
    """One decision of :meth:`EventLog.append_decisions`: ``append_decision``'s arguments."""

    envelopes: Sequence[Envelope]
    expected_node_seq: int | None = None
    expected_writer: str | None = None


async def append_each(log: EventLog, decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
    """:meth:`EventLog.append_decisions` one ``append_decision`` after the other (an adapter
    with nothing to pipeline; a test's wrapper that intercepts ``append_decision``)."""
    outcomes: list[int | Exception] = []
    for decision in decisions:
        try:
            outcomes.append(
                await log.append_decision(
                    decision.envelopes,
                    expected_node_seq=decision.expected_node_seq,
                    expected_writer=decision.expected_writer,
                )
            )
        except Exception as error:  # the decision's outcome; the others go on
            outcomes.append(error)
    return outcomes


class EventLog(Protocol):
    """The append-only log of gpupool: ordered, replayable, deduplicated by envelope id."""

    writer: str
    """The writer token of the subjects this log appends on (``<prefix>.<node>.<writer>``)."""

    async def append(self, envelope: Envelope, *, expected_node_seq: int | None = None) -> int:
        """Append one envelope and return its stream sequence.

        Appending an envelope whose id is already in the log returns the original
        sequence and adds nothing. With ``expected_node_seq=S`` the append fails with
        :class:`ConcurrencyConflict` unless the node's last entry is at ``S``
        (``0``: the node has no entry yet).
        """
        ...

    async def append_decision(
        self,
        envelopes: Sequence[Envelope],
        *,
        expected_node_seq: int | None = None,
        expected_writer: str | None = None,
    ) -> int:
        """Append the envelopes of one decision as ONE entry (all or nothing); return its sequence.

        All envelopes must be for one node. One envelope is written as a plain
        envelope entry, several as a decision entry (docs/eventlog.md). The entry is
        deduplicated by the first envelope's id; ``expected_node_seq`` as for ``append``.
        With ``expected_writer`` the expectation is narrowed to the node's entries by
        that writer (``<prefix>.<node>.<writer>``): ``expected_node_seq`` is then the
        last sequence on that subject (0: none yet).
        """
        ...

    async def append_decisions(self, decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
        """Append several decisions, each as :meth:`append_decision` would, at most one per node;
        return one outcome each, in order: its sequence, or the error ``append_decision``
        would have raised (:class:`ConcurrencyConflict`, a publish that failed).

        The decisions are independent: one that fails leaves the others to land. An
        adapter may pipeline them (JetStream: written together, their acknowledgements
        awaited together); a failed one is not retried here (its caller decides again).
        """
        ...

    async def append_many(
        self, envelopes: Sequence[Envelope], *, expected_node_seq: int | None = None
    ) -> list[int]:
        """Append several envelopes and return their sequences.

        Without an expectation each envelope is its own entry (bulk loading; not
        atomic). With ``expected_node_seq`` they are one decision: one entry, as
        :meth:`append_decision`, and every envelope reports that entry's sequence.
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

    def replay_batches(
        self, *, node: str | None = None, from_seq: int = 1
    ) -> AsyncIterator[list[Entry]]:
        """``replay`` in batches (non-empty lists, in order; a decision entry's envelopes are
        never split between two): the same entries, without an await per entry (a rebuild
        folds each batch as it is handed out, while the next ones arrive)."""
        ...

    def subscribe(
        self, *, durable: str, node: str | None = None, from_seq: int = 1
    ) -> Subscription:
        """Live entries for a durable consumer: explicit ack, at-least-once.

        A new durable starts at ``from_seq``; a known one resumes after what it
        acknowledged, or at ``from_seq`` if that is further on (the caller already
        folded everything before it: a service resumes where its rebuild ended).
        Unacknowledged entries are delivered again.
        """
        ...

    async def close(self) -> None:
        """Release connections; running iterators end with :class:`EventLogClosed`. Idempotent."""
        ...


def check_one_node(envelopes: Sequence[Envelope]) -> None:
    """A decision entry is one node's: all its envelopes must share the node."""
    tokens = {node_token(event_node(envelope.event)) for envelope in envelopes}
    if len(tokens) > 1:
        raise ValueError(
            "a decision entry needs envelopes of one node, got " + ", ".join(sorted(tokens))
        )


def subject_disagreement(subject: str, envelopes: Sequence[Envelope]) -> str | None:
    """Why an entry's subject does not name the node of its events (None: it does).

    The log's optimistic concurrency is per subject node: an event of node A stored on
    node B's subject would move B's last sequence without B's state knowing it, and every
    later decision for B would conflict for ever. Such an entry is not believed.
    An entry read without its subject (a line of an export file: ``""``) is not checked.
    """
    if subject.count(".") < 2:
        return None
    subject_node = node_of_subject(subject)
    for envelope in envelopes:
        node = event_node(envelope.event)
        if (subject_node or NODELESS) != node:
            return (
                f"subject {subject[:MAX_NODE_NAME]!r} names node "
                f"{subject_node or '<none>'!r} but its {type(envelope.event).__name__} is for "
                f"node {node[:MAX_NODE_NAME] or '<none>'!r}"
            )
    return None


_UNSEEN = object()
_SUBJECT_NODES: dict[str, object] = {}
"""Subject -> the node it names (NODELESS for ``_``; None: not checked), for ``read_entries``."""
MAX_REMEMBERED_SUBJECTS = 4096


def _subject_node(subject: str) -> str | None:
    """The node an entry's events must be for on ``subject`` (``subject_disagreement``'s rule),
    remembered (a log has a few subjects per node; garbage ones do not grow it for ever)."""
    named = None if subject.count(".") < 2 else (node_of_subject(subject) or NODELESS)
    if len(_SUBJECT_NODES) >= MAX_REMEMBERED_SUBJECTS:
        _SUBJECT_NODES.clear()
    _SUBJECT_NODES[subject] = named
    return named


def read_plain(seq: int, subject: str, data: bytes) -> StoredEvent | None:
    """:func:`read_entries`' most frequent case, without a tuple: the entry is one current
    envelope (:func:`decode_plain`) for the node its subject names. None: anything else,
    for ``read_entries`` to read or refuse (a replay calls this first, then that)."""
    envelope = decode_plain(data)
    if envelope is None:
        return None
    named = _SUBJECT_NODES.get(subject, _UNSEEN)
    if named is _UNSEEN:
        named = _subject_node(subject)
    if named is None or envelope.event.node == named:  # event_node
        return StoredEvent(seq, subject, envelope)
    return None  # a disagreement: read_entries says so


def read_entries(
    seq: int, subject: str, data: bytes, *, plain_tried: bool = False
) -> tuple[Entry, ...]:
    """Decode the bytes of one log entry into its events; garbage becomes one :class:`Undecodable`.

    Garbage is anything :func:`decode_entry` refuses (too large, too deep, a field out of
    range, an unknown version) and an entry whose subject names another node than its
    events (:func:`subject_disagreement`). ``plain_tried``: the caller has had
    :func:`read_plain` answer None for these bytes already (it is not asked again).
    """
    if not plain_tried:  # (a replay's read_batch decoded it already)
        plain = read_plain(seq, subject, data)
        if plain is not None:  # the common case, checked against the subject's node remembered
            return (plain,)
    try:  # read_plain decoded these bytes as one current envelope, if they are one
        envelopes = decode_entry(data, plain_tried=True)
    except EventDecodeError as exc:
        return (Undecodable(seq=seq, subject=subject, data=data, error=str(exc)),)
    disagreement = subject_disagreement(subject, envelopes)
    if disagreement is not None:
        return (Undecodable(seq=seq, subject=subject, data=data, error=disagreement),)
    if len(envelopes) == 1:  # one envelope, no generator
        return (StoredEvent(seq=seq, subject=subject, envelope=envelopes[0], index=0, last=True),)
    last = len(envelopes) - 1
    return tuple(
        StoredEvent(seq=seq, subject=subject, envelope=envelope, index=index, last=index == last)
        for index, envelope in enumerate(envelopes)
    )


_EVENT_NODE = operator.attrgetter("event.node")  # event_node


def read_batch(seqs: Sequence[int], subjects: Sequence[str], datas: Sequence[bytes]) -> list[Entry]:
    """The entries of several log entries (``seqs[i]``, ``subjects[i]``, ``datas[i]``), in
    order: ``read_entries`` of each, concatenated (a replay's batch).

    The entries that are one current envelope are decoded together
    (:func:`decode_plain_many`), checked against the nodes their subjects name all at once
    and made StoredEvents without a call per entry here; each of the others is read as
    ``read_entries`` reads it (``tests/unit/test_eventlog_read_batch.py`` holds the two to
    each other)."""
    envelopes = decode_plain_many(datas)
    named: dict[str, object] = {}
    for subject in set(subjects):  # a batch has a few subjects
        node = _SUBJECT_NODES.get(subject, _UNSEEN)
        named[subject] = _subject_node(subject) if node is _UNSEEN else node
    if (
        None not in envelopes
        and None not in named.values()
        and list(map(_EVENT_NODE, envelopes)) == list(map(named.__getitem__, subjects))
    ):  # every entry one current envelope for the node its subject names
        return list(map(StoredEvent, seqs, subjects, cast(list[Envelope], envelopes)))
    entries: list[Entry] = []
    for seq, subject, data, envelope in zip(seqs, subjects, datas, envelopes, strict=True):
        if envelope is not None:
            node = named[subject]
            if node is None or envelope.event.node == node:  # read_plain's answer
                entries.append(StoredEvent(seq, subject, envelope))
                continue
        entries += read_entries(seq, subject, data, plain_tried=True)
    return entries


def read_entry(seq: int, subject: str, data: bytes) -> Entry:
    """Decode an entry that holds one envelope (a JSON-lines export line); a decision
    entry is reported as Undecodable here, never read in part."""
    entries = read_entries(seq, subject, data)
    if len(entries) == 1:
        return entries[0]
    return Undecodable(
        seq=seq,
        subject=subject,
        data=data,
        error=f"a decision entry of {len(entries)} envelopes where one envelope was expected",
    )


def entry_subject(
    envelopes: Sequence[Envelope], *, prefix: str, writer: str = DEFAULT_WRITER
) -> str:
    """The subject of the entry holding ``envelopes`` (one node's; checked), by ``writer``."""
    check_one_node(envelopes)
    return node_entry_subject(event_node(envelopes[0].event), writer=writer, prefix=prefix)


REJECTED_PAYLOAD_LIMIT = 4096
REJECTED_REASON_LIMIT = MAX_MESSAGE
"""A MessageRejected keeps its reason and subject whole up to this many characters."""
"""How many characters of an undecodable payload a MessageRejected keeps."""


def rejection_id(seq: int) -> str:
    """The envelope id of the rejection of entry ``seq``: the same for every service, so it is recorded once."""
    return f"rejected-{seq}"


def rejection_envelope(entry: Undecodable, *, time: datetime, node: str = NODELESS) -> Envelope:
    """The dead letter of an undecodable entry: node-less (on ``<prefix>._.<writer>``), or, for
    a writer that appends for one node only (a node-executor, which may publish on its node's
    subject alone), ``node``'s, on that node's subject (docs/eventlog.md, "A node's partition")."""
    payload = entry.data.decode("utf-8", errors="replace")[:REJECTED_PAYLOAD_LIMIT]
    return Envelope(
        id=rejection_id(entry.seq),
        time=time,
        event=MessageRejected(
            subject=entry.subject[:REJECTED_REASON_LIMIT],
            reason=entry.error[:REJECTED_REASON_LIMIT],
            payload=payload,
            node=node,
            seq=entry.seq,
        ),
    )
