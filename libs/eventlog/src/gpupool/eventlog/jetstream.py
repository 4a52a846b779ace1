"""The event log on NATS JetStream: one file-backed stream, append-only, kept forever.

Everything JetStream-specific lives here; docs/eventlog.md explains the choices.

* Append: a JetStream publish with ``Nats-Msg-Id`` (dedupe within
  :data:`DUPLICATE_WINDOW_S`) and, for optimistic concurrency,
  ``Nats-Expected-Last-Subject-Sequence`` with
  ``Nats-Expected-Last-Subject-Sequence-Subject: <prefix>.<node>.>`` (nats-server
  >= 2.11). Timeouts and missing responders (reconnects, leader changes) are
  retried; the msg id makes that safe. Publishes are framed by
  :mod:`gpupool.eventlog.wire` and their PubAcks muxed on one raw inbox.
* Replay: raw pulls of a consumer without acks, decoded in batches while the next
  batch is on its way (:mod:`gpupool.eventlog.pulled_replay`), up to the entries
  pending when the replay started.
* Subscribe: a durable pull consumer with explicit acks, fetched in batches by a
  small pull loop of our own (one outstanding request, idle heartbeats to notice a
  lost request after a reconnect), on a raw subscription: a delivery stays bytes until
  read; acks are frames queued without a publish call each.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js import api

from gpupool.eventlog.credentials import connect_options
from gpupool.eventlog.durables import CLAIMANT, SLOT_INACTIVE_SECONDS, durable_names
from gpupool.eventlog.log_client import LogClient, inline_status, status_description
from gpupool.eventlog.named_replay import open_replay_slot
from gpupool.eventlog.port import (
    ConcurrencyConflict,
    DecisionAppend,
    Delivery,
    Entry,
    EventLogClosed,
    check_one_node,
    read_entries,
)
from gpupool.eventlog.pulled_replay import PulledReplay, open_ephemeral, pulled_batches
from gpupool.eventlog.stream_limits import StreamLimits
from gpupool.eventlog.subjects import (
    DEFAULT_SUBJECT_PREFIX,
    DEFAULT_WRITER,
    node_entry_subject,
    node_subject_filter,
    subject_matches,
    writer_subject_filter,
    writer_token,
)
from gpupool.eventlog.wire import (
    ACK,
    NAK,
    PubAck,
    PubAckMux,
    ack_frame,
    header_block,
    header_value,
    read_puback,
    send_frame,
)
from gpupool.events import Envelope, encode_entry, encode_envelope, event_node

logger = logging.getLogger(__name__)
CONSUMER_INFO_ATTEMPTS = 5
"""A subscriber's consumer_info is tried this often before its timeout is raised."""

DEFAULT_STREAM = "GPUPOOL"

DUPLICATE_WINDOW_S = 120.0
"""Appends of an envelope id already appended this long ago are answered with the original seq."""

ACK_WAIT_S = 30.0
"""A delivery not acknowledged within this time goes to the durable's next fetch again."""

MAX_DELIVER = -1
"""Unlimited redeliveries: a log consumer must never silently skip an event.

Unreadable entries come out as ``Undecodable`` (services ack them and record a
MessageRejected), so the only entries delivered again and again are those whose
handler keeps failing, which should stop the service loudly, not lose the event.
"""

PULL_BATCH = 1024
PULL_EXPIRES_S = 30.0
PULL_HEARTBEAT_S = 5.0
PULL_SILENCE_S: float | None = None
"""How long the iterator waits with nothing received before it takes its pull request for
lost (a reconnect) and pulls again; None: two heartbeats and a second."""
UNEXPECTED_STATUS_BACKOFF_S = 0.1
PIPELINE_WINDOW = 1000
"""append_many keeps at most two windows of publishes in flight (nats-py allows 4000)."""
REPLAY_BUFFER = 4096
REQUEST_TIMEOUT_S = 5.0
APPEND_RETRY_FOR_S = 30.0
CONFLICT_SCAN_LIMIT = 64
"""On a conflict after a retried publish, how many of the node's newer entries are searched
for the envelope's own id."""
REMEMBERED_APPENDS = 4096
"""How many of its latest appends (id -> sequence) a connection remembers, to answer a second
append of one of them without asking the server."""
FRAMING_CACHE_LIMIT = 16_384
"""How many (node, expectation) framings of decisions a log keeps (``_decision_framing``)."""

ERR_WRONG_LAST_SEQUENCE = 10071
ERR_STREAM_NAME_IN_USE = 10058

H_MSG_ID = "Nats-Msg-Id"
H_EXPECTED_STREAM = "Nats-Expected-Stream"
H_EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
H_EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
_H_MSG_ID = H_MSG_ID.encode()
_H_EXPECTED_STREAM = H_EXPECTED_STREAM.encode()
_H_EXPECTED_LAST = H_EXPECTED_LAST_SUBJECT_SEQUENCE.encode()
_H_EXPECTED_LAST_SUBJECT = H_EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT.encode()

_PULL_AGAIN = "pull again"
"""Put in a subscriber's inbox instead of a message: its pull request was lost."""

_RETRYABLE = (
    nats.errors.TimeoutError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError,
)
_LAST_SEQUENCE = re.compile(r"wrong last sequence: (\d+)")


def _conflict(node: str, expected: int, exc: nats.js.errors.APIError) -> ConcurrencyConflict:
    """The conflict a "wrong last sequence" answer reports (the actual sequence, where named)."""
    match = _LAST_SEQUENCE.search(exc.description or "")
    return ConcurrencyConflict(
        node=node, expected=expected, actual=int(match.group(1)) if match else None
    )


CONSUMER_EXISTS = 10148
"""JetStream's error code for a ``create`` of a consumer that exists."""

FRESH_SLOT_LAG = PULL_BATCH
"""A claimed durable lagging more entries than this behind where its service's rebuild ended
is left to expire, and a fresh slot claimed there (``_claim_durable``); a smaller lag is
delivered again and acked unread (cheaper than holding a second slot for 5 minutes)."""

CLAIM_RETRY_S = 5.0
"""How often a replica that found every durable slot claimed looks again."""

DURABLE_INACTIVE_SECONDS = 24 * 3600.0
"""A durable named by its caller (no claimant: tools, tests) that nobody has pulled from for
this long is removed by the server; a service's claimed slots expire sooner
(``SLOT_INACTIVE_SECONDS``: :mod:`gpupool.eventlog.durables`)."""


class JetStreamEventLog:
    """An :class:`~gpupool.eventlog.port.EventLog` on one JetStream stream."""

    def __init__(
        self,
        nc: LogClient,
        *,
        stream: str,
        subject_prefix: str,
        ack_wait: float,
        writer: str = DEFAULT_WRITER,
        claimant: str | None = None,
        consumer_base: str | None = None,
    ) -> None:
        self._nc = nc
        self.consumer_base = consumer_base
        """The NATS user this log connects as (``durable_base``), when it reads through its
        own replay consumers (:mod:`gpupool.eventlog.named_replay`); None: replay consumers under
        random names (:func:`gpupool.eventlog.pulled_replay.open_ephemeral`)."""
        self.writer = writer_token(writer)
        self.claimant = claimant
        """When set (a service's instance), ``subscribe(durable=base)`` claims one of the
        durables ``durable_names(base)`` for it (:mod:`gpupool.eventlog.durables`)."""
        self._js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        self._mux = PubAckMux(nc, timeout=REQUEST_TIMEOUT_S)
        """Every publish of this log, its PubAck muxed on one raw inbox (:mod:`.wire`)."""
        self.stream = stream
        self.subject_prefix = subject_prefix
        self.ack_wait = ack_wait
        self._closed = False
        self._subscriptions: set[JetStreamSubscription] = set()
        self._replays: set[PulledReplay] = set()
        self._appended: dict[str, int] = {}
        self._framing: dict[tuple[str, str | None, str, str, str], tuple[str, bytes, bytes]] = {}
        """(node, expectation's writer, stream, prefix, writer) -> ``_decision_framing``."""
        self._created_consumers: dict[str, int] = {}
        """Durables this connection created and no subscriber has started on yet: the sequence
        each was created to start at."""

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        stream: str = DEFAULT_STREAM,
        subject_prefix: str = DEFAULT_SUBJECT_PREFIX,
        ack_wait: float = ACK_WAIT_S,
        connect_timeout: float = 10.0,
        name: str = "gpupool",
        writer: str = DEFAULT_WRITER,
        credentials: Path | None = None,
        tls_ca: Path | None = None,
        limits: StreamLimits | None = None,
        claimant: str | None = None,
        consumer_base: str | None = None,
    ) -> JetStreamEventLog:
        """Connect (retrying for up to ``connect_timeout``) and create the stream if needed.

        Every entry this log appends goes on ``<prefix>.<node>.<writer>``. ``credentials``
        (an nkey seed or ``.creds`` file) and ``tls_ca`` are for an authenticated server
        (:func:`gpupool.eventlog.credentials.connect_options`); without them, none. A stream
        it creates has ``limits`` (default: :meth:`StreamLimits.from_environment`).
        ``claimant``: this replica's name; its subscriptions claim a durable slot
        (:mod:`gpupool.eventlog.durables`) instead of using the durable's name as is.
        ``consumer_base``: the NATS user's name, on a server with permissions: replays read
        through the user's own replay consumers (:mod:`gpupool.eventlog.named_replay`)."""
        events = _ConnectionEvents(url)
        nc = await _connect(
            url,
            name=name,
            wait_for_server=connect_timeout,
            events=events,
            options=connect_options(credentials, tls_ca),
        )
        log = cls(
            nc,
            stream=stream,
            subject_prefix=subject_prefix,
            ack_wait=ack_wait,
            writer=writer,
            claimant=claimant,
            consumer_base=consumer_base,
        )
        events.log = log
        try:
            await log._ensure_stream(limits or StreamLimits.from_environment())
        except BaseException:
            await nc.close()
            raise
        return log

    async def _ensure_stream(self, limits: StreamLimits) -> None:
        subjects = f"{self.subject_prefix}.>"
        config = api.StreamConfig(
            name=self.stream,
            description="gpupool: the append-only event log",
            subjects=[subjects],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            discard=limits.discard,  # full: refuse appends, never drop the oldest entries
            max_msgs=-1,
            max_bytes=limits.max_bytes,
            max_msg_size=limits.max_msg_size,
            max_age=0,
            duplicate_window=DUPLICATE_WINDOW_S,
            num_replicas=1,
        )
        # Look first: asking to create a stream that exists is answered "insufficient
        # storage" rather than "name in use" when its bound and ours do not both fit the
        # server's store (a deployed stream sized close to it), and a service credential
        # need not be allowed to create it.
        try:
            info = await self._js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            try:
                await self._js.add_stream(config)
                return
            except nats.js.errors.APIError as exc:
                if exc.err_code != ERR_STREAM_NAME_IN_USE:
                    raise
                info = await self._js.stream_info(self.stream)  # created meanwhile
        # Created elsewhere (deploy/ may define it with replicas): use it if it holds our subjects.
        if subjects not in (info.config.subjects or []):
            raise ValueError(
                f"stream {self.stream} exists but does not hold {subjects}: {info.config.subjects}"
            )
        logger.info("stream %s exists; using it", self.stream)
        if limits.differs_from(info.config):
            logger.warning(
                "stream %s is not bounded as gpupool creates it (max_bytes %s, "
                "max_msg_size %s, discard %s): deploy/base/nats/ensure_stream.py sets it",
                self.stream,
                info.config.max_bytes,
                info.config.max_msg_size,
                info.config.discard,
            )

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
        """One publish: a decision is one stream message, so it lands whole or not at all.

        With ``expected_writer`` the expectation covers only the node's entries on
        ``<prefix>.<node>.<expected_writer>`` instead of all of the node's entries.
        """
        self._check_open()
        subject, data, headers = self._decision_message(
            envelopes, expected_node_seq, expected_writer
        )
        envelope = envelopes[0]
        node = event_node(envelope.event)
        retried: list[int] = []
        try:
            ack = await self._publish(subject, data, headers, retried=retried)
        except nats.js.errors.APIError as exc:
            if exc.err_code != ERR_WRONG_LAST_SEQUENCE or expected_node_seq is None:
                raise
            # The server checks expectations before duplicates: a retry of an append
            # that did land, or a second append of the same envelope, looks like a
            # conflict. An envelope this connection appended is remembered; only a
            # publish that was retried (its first ack may be lost) needs a look at the
            # node's newer entries. A plain conflict costs nothing more.
            own = self._appended.get(envelope.id)
            if own is None and retried:
                own = await self._find_by_id(
                    node_subject_filter(node, prefix=self.subject_prefix),
                    after=expected_node_seq,
                    msg_id=envelope.id,
                )
            if own is not None:
                return own
            raise _conflict(node, expected_node_seq, exc) from None
        self._remember(envelope.id, ack.seq)
        return ack.seq

    def _decision_message(
        self,
        envelopes: Sequence[Envelope],
        expected_node_seq: int | None,
        expected_writer: str | None,
    ) -> tuple[str, bytes, bytes]:
        """A decision's subject, its entry's bytes and its header block."""
        if not envelopes:
            raise ValueError("a decision holds at least one envelope")
        envelope = envelopes[0]
        node = event_node(envelope.event)
        if len(envelopes) > 1:
            check_one_node(envelopes)
        subject, stream_line, expectation_line = self._decision_framing(node, expected_writer)
        # header_block's bytes, its constant lines made once per node and expectation
        if expected_node_seq is None:
            headers = b"NATS/1.0\r\n%b: %b\r\n%b\r\n" % (
                _H_MSG_ID,
                header_value(envelope.id),
                stream_line,
            )
        else:
            headers = b"NATS/1.0\r\n%b: %b\r\n%b%b: %d\r\n%b\r\n" % (
                _H_MSG_ID,
                header_value(envelope.id),
                stream_line,
                _H_EXPECTED_LAST,
                expected_node_seq,
                expectation_line,
            )
        data = encode_envelope(envelope) if len(envelopes) == 1 else encode_entry(list(envelopes))
        return subject, data, headers

    async def append_decisions(self, decisions: Sequence[DecisionAppend]) -> list[int | Exception]:
        """Every decision's publish handed to the connection in this step (one write, where
        nothing else of this connection awaits a PubAck: as a lone append), then their
        PubAcks awaited together; a decision's own error is its outcome (none is retried:
        its caller decides again from the folded state, which a publish that did land
        refuses as a conflict until it is folded)."""
        self._check_open()
        alone = not self._mux.in_flight
        submit = self._mux.submit
        sent: list[tuple[DecisionAppend, asyncio.Future[bytes] | Exception]] = []
        try:
            for decision in decisions:
                try:
                    subject, data, headers = self._decision_message(*decision)
                    sent.append((decision, await submit(subject.encode(), data, headers)))
                except Exception as error:  # this decision's outcome (bad input, buffer full)
                    sent.append((decision, error))
            if alone:
                self._nc.write_now()  # else the flusher writes them, on its turn
            outcomes: list[int | Exception] = []
            for decision, future in sent:
                if isinstance(future, Exception):
                    outcomes.append(future)
                    continue
                try:
                    ack = read_puback(await future)
                except nats.js.errors.APIError as exc:
                    outcomes.append(self._refusal(decision, exc))
                    continue
                except Exception as error:  # no answer in time, the connection lost
                    outcomes.append(error)
                    continue
                self._remember(decision.envelopes[0].id, ack.seq)
                outcomes.append(ack.seq)
        finally:
            abandoned = [
                future
                for _, future in sent
                if isinstance(future, asyncio.Future) and not future.done()
            ]
            for future in abandoned:
                future.cancel()  # cancelled while waiting: nobody reads these PubAcks
            if abandoned:
                self._mux.forget(abandoned)
        return outcomes

    def _refusal(self, decision: DecisionAppend, exc: nats.js.errors.APIError) -> int | Exception:
        """A pipelined decision's error answer: its sequence where it was this connection's
        own append already, a :class:`ConcurrencyConflict`, or the error."""
        envelope = decision.envelopes[0]
        if exc.err_code != ERR_WRONG_LAST_SEQUENCE or decision.expected_node_seq is None:
            return exc
        own = self._appended.get(envelope.id)
        if own is not None:
            return own
        return _conflict(event_node(envelope.event), decision.expected_node_seq, exc)

    def _decision_framing(self, node: str, expected_writer: str | None) -> tuple[str, bytes, bytes]:
        """A decision's subject, its ``Nats-Expected-Stream`` header line, and its expectation's
        ``Nats-Expected-Last-Subject-Sequence-Subject`` line: the same for every decision of a
        node (and expectation), so made once and kept (bounded: cleared past
        ``FRAMING_CACHE_LIMIT`` keys)."""
        key = (node, expected_writer, self.stream, self.subject_prefix, self.writer)
        framing = self._framing.get(key)
        if framing is None:
            if expected_writer is None:
                expectation = node_subject_filter(node, prefix=self.subject_prefix)
            else:
                expectation = writer_subject_filter(
                    expected_writer, node, prefix=self.subject_prefix
                )
            framing = (
                node_entry_subject(node, writer=self.writer, prefix=self.subject_prefix),
                b"%b: %b\r\n" % (_H_EXPECTED_STREAM, header_value(self.stream)),
                b"%b: %b\r\n" % (_H_EXPECTED_LAST_SUBJECT, header_value(expectation)),
            )
            if len(self._framing) >= FRAMING_CACHE_LIMIT:
                self._framing.clear()
            self._framing[key] = framing
        return framing

    def _remember(self, envelope_id: str, seq: int) -> None:
        """Keep the ids of the latest appends of this connection (see ``append_decision``)."""
        self._appended[envelope_id] = seq
        if len(self._appended) > REMEMBERED_APPENDS:
            del self._appended[next(iter(self._appended))]

    async def append_many(
        self, envelopes: Sequence[Envelope], *, expected_node_seq: int | None = None
    ) -> list[int]:
        """Without an expectation, pipelined (publish_async); with one, one decision entry."""
        self._check_open()
        if expected_node_seq is None:
            return await self._append_pipelined(envelopes)
        check_one_node(envelopes)
        if not envelopes:
            return []
        seq = await self.append_decision(envelopes, expected_node_seq=expected_node_seq)
        return [seq] * len(envelopes)

    async def _append_pipelined(self, envelopes: Sequence[Envelope]) -> list[int]:
        """Publishes in windows; a window's PubAcks are collected while the next one is sent."""
        seqs: list[int] = []
        in_flight: list[tuple[Envelope, asyncio.Future[bytes] | None]] = []
        window: list[tuple[Envelope, asyncio.Future[bytes] | None]] = []
        submit = self._mux.submit
        framing = self._decision_framing
        try:
            for start in range(0, len(envelopes), PIPELINE_WINDOW):
                window = []
                for envelope in envelopes[start : start + PIPELINE_WINDOW]:
                    # header_block's bytes (the message id, the stream), the subject and the
                    # stream's line kept per node, as a decision's are (_decision_framing)
                    subject, stream_line, _ = framing(event_node(envelope.event), None)
                    try:
                        future: asyncio.Future[bytes] | None = await submit(
                            subject.encode(),
                            encode_envelope(envelope),
                            b"NATS/1.0\r\n%b: %b\r\n%b\r\n"
                            % (_H_MSG_ID, header_value(envelope.id), stream_line),
                        )
                    except nats.errors.OutboundBufferLimitError:
                        future = None  # disconnected and the buffer is full: append it alone
                    window.append((envelope, future))
                seqs += await self._settle(in_flight)
                in_flight, window = window, []
            seqs += await self._settle(in_flight)
        finally:
            # the window being settled and the one being sent, where an error left them
            abandoned = [
                unsettled
                for _, unsettled in (*in_flight, *window)
                if unsettled is not None and not unsettled.done()
            ]
            for unsettled in abandoned:
                unsettled.cancel()  # an error left them behind; settled ones are unaffected
            if abandoned:  # nobody waits for their PubAcks now: a lone append is lone again
                self._mux.forget(abandoned)
        return seqs

    async def _settle(
        self, window: list[tuple[Envelope, asyncio.Future[bytes] | None]]
    ) -> list[int]:
        # Every future ends within REQUEST_TIMEOUT_S: answered, or failed by the mux's sweeper.
        seqs: list[int] = []
        for envelope, future in window:
            if future is not None:
                try:
                    seqs.append((await PubAckMux.result(future)).seq)
                    continue
                except _RETRYABLE:
                    pass
            # Not sent, no ack in time, or lost: appending again is safe, the msg id dedupes it.
            seqs.append(await self.append(envelope))
        return seqs

    async def append_raw(self, subject: str, data: bytes) -> int:
        self._check_open()
        if not subject_matches(subject, f"{self.subject_prefix}.>") or "*" in subject:
            raise ValueError(f"{subject!r} is not a subject of this log ({self.subject_prefix}.>)")
        ack = await self._publish(subject, data, header_block([(_H_EXPECTED_STREAM, self.stream)]))
        return ack.seq

    async def _publish(
        self,
        subject: str,
        data: bytes,
        headers: bytes,
        *,
        retried: list[int] | None = None,
    ) -> PubAck:
        """Publish, retrying what may not have reached the server; each retry is noted in ``retried``."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + APPEND_RETRY_FOR_S
        delay = 0.05
        wire_subject = subject.encode()
        while True:
            try:
                # PubAckMux.publish spelt out: two coroutine frames fewer on every append;
                # a lone append waits for its PubAck: written now, not on the flusher's turn
                return read_puback(
                    await (await self._mux.submit(wire_subject, data, headers, now=True))
                )
            except _RETRYABLE as exc:
                if self._closed or self._nc.is_closed or loop.time() + delay > give_up_at:
                    raise
                if retried is not None:
                    retried.append(1)
                logger.warning("append to %s: %r; retrying in %.2fs", subject, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _find_by_id(self, node_filter: str, *, after: int, msg_id: str) -> int | None:
        seq = after + 1
        for _ in range(CONFLICT_SCAN_LIMIT):
            try:
                msg = await self._js.get_msg(self.stream, seq=seq, subject=node_filter, next=True)
            except nats.js.errors.NotFoundError:
                return None
            if msg.seq is None:
                return None
            if msg.headers and msg.headers.get(H_MSG_ID) == msg_id:
                return msg.seq
            seq = msg.seq + 1
        return None

    # ------------------------------------------------------------------ reading

    async def last_seq(self) -> int:
        self._check_open()
        info = await self._js.stream_info(self.stream)
        return info.state.last_seq

    async def first_seq(self) -> int:
        """The stream's first sequence (past a purge: the entry after the cut; last + 1 when
        it holds nothing)."""
        self._check_open()
        state = (await self._js.stream_info(self.stream)).state
        return state.first_seq if state.messages else state.last_seq + 1

    async def _last_seq_matching(self, node: str | None) -> int:
        if node is None:
            return await self.last_seq()
        try:
            msg = await self._js.get_last_msg(
                self.stream, node_subject_filter(node, prefix=self.subject_prefix)
            )
        except nats.js.errors.NotFoundError:
            return 0
        return msg.seq or 0

    async def replay(self, *, node: str | None = None, from_seq: int = 1) -> AsyncIterator[Entry]:
        async for batch in self.replay_batches(node=node, from_seq=from_seq):
            for entry in batch:
                if self._closed:
                    raise EventLogClosed(f"event log {self.stream} closed during a replay")
                yield entry

    async def replay_batches(
        self, *, node: str | None = None, from_seq: int = 1
    ) -> AsyncIterator[list[Entry]]:
        """``replay`` in batches: raw pulls of a consumer without acks, two requests in flight
        (:mod:`gpupool.eventlog.pulled_replay`); every entry once, in order, up to the end at
        the call (the consumer's pending entries when it was created)."""
        self._check_open()
        nc = self._nc
        if not isinstance(nc, LogClient):
            raise TypeError("a JetStreamEventLog replays through a LogClient connection")
        subject_filter = node_subject_filter(node, prefix=self.subject_prefix)
        if self.consumer_base is not None:  # an authenticated service: its own replay slots
            opener = open_replay_slot(nc, self.stream, self.consumer_base, subject_filter)
        else:
            opener = open_ephemeral(nc, self.stream, subject_filter)
        running = PulledReplay()
        self._replays.add(running)
        try:
            async for batch in pulled_batches(
                nc, stream=self.stream, open_consumer=opener, start=from_seq, replay=running
            ):
                yield batch
        finally:
            self._replays.discard(running)

    def subscribe(
        self, *, durable: str, node: str | None = None, from_seq: int = 1
    ) -> JetStreamSubscription:
        self._check_open()
        return JetStreamSubscription(
            self, durable, node_subject_filter(node, prefix=self.subject_prefix), from_seq
        )

    async def _consumer_info(self, durable: str) -> api.ConsumerInfo:
        """``consumer_info``, retried on a timeout (a busy or reconnecting server) a few times."""
        for attempt in range(1, CONSUMER_INFO_ATTEMPTS + 1):
            try:
                info: api.ConsumerInfo = await self._js.consumer_info(self.stream, durable)
                return info
            except nats.errors.TimeoutError:
                if attempt == CONSUMER_INFO_ATTEMPTS:
                    raise
                logger.warning(
                    "consumer_info of %s timed out (attempt %d); retrying", durable, attempt
                )
                await asyncio.sleep(0.2 * attempt)  # a back-off between attempts
        raise AssertionError("unreachable")

    async def _ensure_consumer(self, durable: str, subject_filter: str, from_seq: int) -> int:
        """The durable, created at ``from_seq`` if it is new; returns the sequence below
        which its deliveries are to be skipped (acked unseen; 0: none).

        A service folds the log before it subscribes; a durable that lags behind that
        (a rebuild from zero, a snapshot newer than the acks) would hand it every
        folded entry a second time. It is kept — no credential may delete a consumer —
        and what it delivers below ``from_seq`` is acknowledged and passed over.
        """
        try:
            info = await self._consumer_info(durable)
        except nats.js.errors.NotFoundError:
            await self._create_consumer(durable, subject_filter, from_seq)
            return 0
        return self._resumed(durable, info, subject_filter, from_seq)

    def _resumed(
        self, durable: str, info: api.ConsumerInfo, subject_filter: str, from_seq: int
    ) -> int:
        if info.config.filter_subject != subject_filter:
            raise ValueError(
                f"durable {durable!r} exists with filter {info.config.filter_subject!r}, "
                f"not {subject_filter!r}"
            )
        acked = _acked(info)
        if acked + 1 >= from_seq:
            return 0
        logger.info(
            "durable %s acknowledged up to %d, its subscriber folded up to %d: "
            "passing over the entries in between",
            durable,
            acked,
            from_seq - 1,
        )
        return from_seq

    async def _claim_durable(
        self, base: str, claimant: str, subject_filter: str, from_seq: int
    ) -> tuple[str, int]:
        """One of ``durable_names(base)`` for ``claimant``: the one it claimed before (resumed),
        else the first free one, created with the ``create`` action (the server refuses it
        if another replica created it first). Returns (its name, skip below).

        A claimed slot that lags more than :data:`FRESH_SLOT_LAG` entries behind ``from_seq``
        (a rebuild from zero, a snapshot newer than the slot's acks) is not resumed when a
        slot is free: a fresh one is claimed at ``from_seq`` and the lagging one, pulled by
        nobody, expires after ``SLOT_INACTIVE_SECONDS`` (no credential may delete it).
        Resuming it would deliver every folded entry again, each acked unread. Of the
        claimant's slots the one acknowledged furthest is taken, so a restart after that
        resumes the fresh slot; a claimant holds at most two (the fresh one and one left
        behind): with two lagging, the better is resumed and what it delivers below
        ``from_seq`` is passed over, as before, and no further slot is taken from the other
        replicas."""
        names = durable_names(base)
        give_up_at = asyncio.get_running_loop().time() + SLOT_INACTIVE_SECONDS + 60
        while True:
            free: list[str] = []
            ours: list[tuple[int, str, api.ConsumerInfo]] = []
            for name in names:
                try:
                    info = await self._consumer_info(name)
                except nats.js.errors.NotFoundError:
                    free.append(name)
                    continue
                if (info.config.metadata or {}).get(CLAIMANT) == claimant:
                    ours.append((_acked(info), name, info))
            if ours:
                acked, name, info = max(ours, key=lambda held: held[0])
                # What resuming it would deliver below ``from_seq``: at most the entries
                # between its ack floor and there, and at most what its filter still has
                # pending (a caught-up durable of a quiet node keeps its ack floor at its
                # filter's last entry, however far the rest of the log has moved on).
                pending = (info.num_pending or 0) + (info.num_ack_pending or 0)
                lags = min(from_seq - 1 - acked, pending) > FRESH_SLOT_LAG
                if not lags or len(ours) > 1 or not free:
                    return name, self._resumed(name, info, subject_filter, from_seq)
                logger.info(
                    "durable %s of %s acknowledged up to %d, its rebuild folded up to %d: "
                    "claiming a fresh slot there; %s expires unused",
                    name,
                    claimant,
                    acked,
                    from_seq - 1,
                    name,
                )
            for name in free:
                try:
                    await self._create_consumer(name, subject_filter, from_seq, claimant=claimant)
                except nats.js.errors.APIError as error:
                    if error.err_code != CONSUMER_EXISTS:
                        raise
                    continue  # another replica claimed it in between
                logger.info("durable %s claimed by %s", name, claimant)
                return name, 0
            if ours:
                continue  # the free slots went to other replicas meanwhile: resume ours
            if asyncio.get_running_loop().time() > give_up_at:
                raise EventLogClosed(
                    f"every durable of {base} ({names[0]} … {names[-1]}) is claimed by "
                    "another replica"
                )
            logger.warning(
                "every durable of %s is claimed; waiting for one to expire (%.0f s unused)",
                base,
                SLOT_INACTIVE_SECONDS,
            )
            await asyncio.sleep(CLAIM_RETRY_S)  # the server announces no expiry to us

    async def _create_consumer(
        self, durable: str, subject_filter: str, from_seq: int, *, claimant: str | None = None
    ) -> None:
        """Create the durable (JetStream action ``create``: refused if it exists)."""
        start = max(from_seq, 1)
        config = api.ConsumerConfig(
            name=durable,
            durable_name=durable,
            description="gpupool event-log subscriber",
            filter_subject=subject_filter,
            deliver_policy=api.DeliverPolicy.ALL
            if start == 1
            else api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=None if start == 1 else start,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait,
            max_deliver=MAX_DELIVER,
            replay_policy=api.ReplayPolicy.INSTANT,
            inactive_threshold=SLOT_INACTIVE_SECONDS
            if claimant is not None
            else DURABLE_INACTIVE_SECONDS,
            metadata=None if claimant is None else {CLAIMANT: claimant},
        )
        request = {"stream_name": self.stream, "config": config.as_dict(), "action": "create"}
        reply = await self._nc.request(
            f"{api.DEFAULT_PREFIX}.CONSUMER.CREATE.{self.stream}.{durable}.{subject_filter}",
            json.dumps(request).encode(),
            timeout=REQUEST_TIMEOUT_S,
        )
        answer = json.loads(reply.data)
        if "error" in answer:
            nats.js.errors.APIError.from_error(answer["error"])  # raises
        self._created_consumers[durable] = start

    # ------------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for subscription in list(self._subscriptions):
            await subscription.aclose()
        for running in list(self._replays):
            running.close()  # it ends with EventLogClosed
        if self._nc.is_closed:
            self._mux.close()
            return
        try:
            await asyncio.wait_for(self._nc.drain(), timeout=REQUEST_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error) as exc:
            logger.warning("draining the NATS connection: %r; closing it", exc)
            await self._nc.close()
        finally:
            self._mux.close()  # after the drain: PubAcks already on their way were read

    def _check_open(self) -> None:
        if self._closed:
            raise EventLogClosed(f"event log {self.stream} is closed")

    def _pull_again(self) -> None:
        """After a reconnect, pull requests may be gone with the old connection: renew them."""
        for subscription in self._subscriptions:
            subscription._put(_PULL_AGAIN)

    async def _send_ack(self, reply: bytes, verb: bytes) -> None:
        await send_frame(self._nc, ack_frame(reply, verb))


_Raw = tuple[bytes, bytes, bytes, bytes | None]
"""One message of a subscriber's inbox as the raw sink got it: (subject, reply, data, headers)."""


def _silence_s() -> float:
    """``PULL_SILENCE_S``, or what it stands for (read at each wait: tests change both)."""
    return 2 * PULL_HEARTBEAT_S + 1 if PULL_SILENCE_S is None else PULL_SILENCE_S


class JetStreamDelivery:
    """One delivered message, kept as the bytes it arrived as; decoded on first look at
    ``entries`` (a subscriber that already folded ``seq`` acks it without decoding it)."""

    __slots__ = (
        "_data",
        "_done",
        "_entries",
        "_reply",
        "_subject",
        "_subscription",
        "follows",
        "seq",
    )

    def __init__(
        self,
        subscription: JetStreamSubscription,
        subject: bytes,
        reply: bytes,
        data: bytes,
        seq: int,
        follows: int | None = None,
    ) -> None:
        self._subscription = subscription
        self._subject = subject
        self._reply = reply
        self._data = data
        self.seq = seq
        self.follows = follows
        self._entries: tuple[Entry, ...] | None = None
        self._done = False

    @property
    def entry(self) -> Entry:
        return self.entries[0]

    @property
    def entries(self) -> tuple[Entry, ...]:
        if self._entries is None:
            self._entries = read_entries(self.seq, self._subject.decode(), self._data)
        return self._entries

    async def ack(self) -> None:
        if not self._done:
            self._done = True
            self._subscription._unacked.pop(self._reply, None)
            await self._subscription._log._send_ack(self._reply, ACK)

    async def nak(self) -> None:
        if not self._done:
            self._done = True
            self._subscription._unacked.pop(self._reply, None)
            await self._subscription._log._send_ack(self._reply, NAK)


class JetStreamSubscription:
    """One subscriber of a durable pull consumer.

    The consumer is created (idempotently) on the first ``__anext__``. Its deliveries
    arrive on a raw subscription (:meth:`LogClient.raw_subscribe`): the reader loop
    appends each message's bytes to the inbox and wakes the iterator; nothing is parsed
    until the message is taken. Closing the subscription naks what it holds
    unacknowledged, so the next subscriber of the durable gets those entries at once
    instead of after the ack wait.
    """

    def __init__(
        self, log: JetStreamEventLog, durable: str, subject_filter: str, from_seq: int = 1
    ) -> None:
        self._log = log
        self.durable = durable
        self.subject_filter = subject_filter
        self.from_seq = from_seq
        self._skip_below = 0
        """Deliveries below this sequence were folded before: acked, not handed out."""
        self._inbox: collections.deque[_Raw | str | None] = collections.deque()
        """Messages as received, a renewal (``_PULL_AGAIN``), the end (None)."""
        self._arrived = asyncio.Event()
        self._inbox_subject = ""
        self._nats_subscription: NatsSubscription | None = None
        self._requested = 0
        self._unacked: dict[bytes, JetStreamDelivery] = {}
        self._closed = False
        self._last_delivered: tuple[int, int] | None = None
        """(consumer sequence, stream sequence) of the last delivery seen, if it was a first
        delivery: the proof of ``Delivery.follows`` for the next one."""
        self._on_arrival: Callable[[], bool] | None = None
        """``react_on_arrival``'s hook."""
        self._arrival_due = False
        """The hook is queued to run after the reader's parse."""
        self._silence: asyncio.Timeout | None = None
        """The iterator's wait for anything from its pull (``_next_item``), while it waits."""

    @property
    def _waiting(self) -> bool:
        """The iterator waits for the inbox (``_next_item``)."""
        return self._silence is not None

    def _put(self, item: _Raw | str | None) -> None:
        self._inbox.append(item)
        self._arrived.set()

    def _on_raw(self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        # The reader loop's sink (LogClient): no parsing, never raises.
        self._inbox.append((subject, reply, data, headers))
        if self._on_arrival is None or not self._waiting:
            self._arrived.set()
        elif not self._arrival_due:
            self._arrival_due = True
            self._log._nc.after_read(self._arrival)

    def react_on_arrival(self, hook: Callable[[], bool] | None) -> bool:
        """``hook`` runs in the connection's reader step, once the reader has cut what it
        read, when deliveries arrived while the iterator waits (docs/eventlog.md, "Deciding
        in the reader's step")."""
        self._on_arrival = hook
        return True

    def _arrival(self) -> None:
        """After the reader's parse: the hook takes the deliveries, or the iterator does."""
        self._arrival_due = False
        hook = self._on_arrival
        taken = False
        try:
            taken = hook is not None and self._waiting and not self._closed and hook()
        finally:
            silence = self._silence
            if taken and silence is not None and not silence.expired():
                # the pull is alive: the iterator, still waiting, did not see what came
                silence.reschedule(asyncio.get_running_loop().time() + _silence_s())
            if taken and self._requested <= 0 and not self._closed:
                self._put(_PULL_AGAIN)  # the hook took the pull's last: the iterator asks again
            elif not taken or self._inbox:
                self._arrived.set()  # what the hook left (a status, the end, a batch's rest)

    def take_ready(self, limit: int) -> list[Delivery]:
        """Deliveries already received, at most ``limit``, without waiting (none: [])."""
        taken: list[Delivery] = []
        if self._closed or self._nats_subscription is None:
            return taken
        inbox = self._inbox
        while len(taken) < limit and inbox:
            item = inbox[0]
            if type(item) is tuple and item[1] and inline_status(item[3]) is None:
                seq, delivered, consumer_seq = _reply_counts(item[1])
                if seq >= self._skip_below:
                    inbox.popleft()
                    taken.append(self._deliver(item, seq, delivered, consumer_seq))
                    continue
            break  # a status, a renewal, the end, a folded entry: __anext__ handles it
        return taken

    async def ack_many(self, deliveries: Sequence[Delivery], *, now: bool = False) -> None:
        """Ack each of ``deliveries`` (this subscription's) not acked or nakked yet, in order:
        the frames each ``ack`` would queue, queued as one (one ``send_frame`` for a batch;
        nats-py's ``out_msgs`` counts it once). ``now``: written in this step where
        ``LogClient.write_now`` can (with every frame queued before them), else on the
        flusher's turn: a consumer whose batch is done saves the flusher's wake-up. Such a
        write does not count as the turn's one direct write (``write_now``'s
        ``takes_turn``)."""
        frames: list[bytes] = []
        taken: list[JetStreamDelivery] = []
        unacked = self._unacked
        for delivery in deliveries:
            assert isinstance(delivery, JetStreamDelivery)
            if not delivery._done:
                delivery._done = True
                unacked.pop(delivery._reply, None)
                frames.append(ack_frame(delivery._reply, ACK))
                taken.append(delivery)
        if frames:
            try:
                # the batch's last frames: a decision made next in this step is written too
                await send_frame(self._log._nc, b"".join(frames), now=now, takes_turn=False)
            except BaseException:
                # not acked: they stay this subscription's, nakked at its close as before
                for delivery in taken:
                    delivery._done = False
                    unacked[delivery._reply] = delivery
                raise

    def _deliver(
        self, item: _Raw, seq: int, delivered: int, consumer_seq: int
    ) -> JetStreamDelivery:
        self._requested -= 1
        subject, reply, data, _ = item
        delivery = JetStreamDelivery(
            self, subject, reply, data, seq, self._follows(seq, delivered, consumer_seq)
        )
        self._unacked[reply] = delivery
        return delivery

    def _follows(self, seq: int, delivered: int, consumer_seq: int) -> int | None:
        """``Delivery.follows`` of a message, seen in the order the consumer sent them.

        The consumer numbers every delivery it sends (first or again) and sends first
        deliveries in stream order: a first delivery numbered right after a first delivery
        of ``s`` is the filter's next entry after ``s``. Anything else (a redelivery, a
        delivery lost before it, the first one seen) proves nothing.
        """
        last, self._last_delivered = (
            self._last_delivered,
            (consumer_seq, seq) if delivered == 1 else None,
        )
        if delivered != 1 or last is None or consumer_seq != last[0] + 1:
            return None
        return last[1]

    def __aiter__(self) -> JetStreamSubscription:
        return self

    async def __aenter__(self) -> JetStreamSubscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _start(self) -> None:
        if self._log.claimant is not None:
            self.durable, self._skip_below = await self._log._claim_durable(
                self.durable, self._log.claimant, self.subject_filter, self.from_seq
            )
        else:
            self._skip_below = await self._log._ensure_consumer(
                self.durable, self.subject_filter, self.from_seq
            )
        created_at = self._log._created_consumers.pop(self.durable, None)
        if created_at is not None:
            # created here: its first delivery is the filter's first entry from that sequence
            self._last_delivered = (0, created_at - 1)
        self._inbox_subject = self._log._nc.new_inbox()
        self._nats_subscription = await self._log._nc.raw_subscribe(
            self._inbox_subject, self._on_raw
        )
        self._log._subscriptions.add(self)

    async def _pull(self) -> None:
        request = {
            "batch": PULL_BATCH,
            "expires": int(PULL_EXPIRES_S * 1e9),
            "idle_heartbeat": int(PULL_HEARTBEAT_S * 1e9),
        }
        await self._log._nc.publish(
            f"{api.DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{self._log.stream}.{self.durable}",
            json.dumps(request).encode(),
            reply=self._inbox_subject,
        )
        self._requested = PULL_BATCH

    async def _next_item(self) -> _Raw | str | None:
        """The inbox's next item; waits for one (raises TimeoutError after no heartbeat)."""
        while not self._inbox:
            self._arrived.clear()
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                # cancellation that arrives together with a message (SIGTERM under a burst).
                # Deliveries the reader's hook takes (react_on_arrival) push it back.
                async with asyncio.timeout(_silence_s()) as self._silence:
                    await self._arrived.wait()
            finally:
                self._silence = None
        return self._inbox.popleft()

    async def __anext__(self) -> Delivery:
        if self._closed:
            raise StopAsyncIteration
        self._log._check_open()
        if self._nats_subscription is None:
            await self._start()
        while True:
            if self._requested <= 0:
                await self._pull()
            try:
                item = await self._next_item()
            except TimeoutError:
                # Not even a heartbeat: the pull request was lost (reconnect). Ask again.
                self._requested = 0
                continue
            if item is None:
                if self._log._closed:
                    raise EventLogClosed(f"event log {self._log.stream} is closed")
                raise StopAsyncIteration
            if isinstance(item, str):  # _PULL_AGAIN
                self._requested = 0
                continue
            _, reply, _, headers = item
            status = inline_status(headers)
            if status is None and reply:
                seq, delivered, consumer_seq = _reply_counts(reply)
                if seq < self._skip_below:  # folded before it began
                    self._requested -= 1
                    self._follows(seq, delivered, consumer_seq)
                    await self._log._send_ack(reply, ACK)
                    continue
                return self._deliver(item, seq, delivered, consumer_seq)
            if status == b"100":
                continue  # idle heartbeat
            if status in (b"404", b"408"):
                self._requested = 0  # request ended (expired); pull again
                continue
            description = status_description(headers) if headers else ""
            if status == b"409" and "Consumer Deleted" in description:
                raise EventLogClosed(f"durable {self.durable!r} was deleted")
            shown = status.decode("ascii", "replace") if status else None
            logger.warning("durable %s: pull status %s %s", self.durable, shown, description)
            self._requested = 0
            await asyncio.sleep(UNEXPECTED_STATUS_BACKOFF_S)  # do not spin on a server that says no

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._on_arrival = None
        self._log._subscriptions.discard(self)
        nc = self._log._nc
        if self._nats_subscription is not None:
            if not nc.is_closed:
                await _quietly(self._nats_subscription.unsubscribe(), "subscriber unsubscribe")
            nc.drop_raw(self._nats_subscription)
        for delivery in list(self._unacked.values()):
            await _quietly(delivery.nak(), "nak on close")
        while self._inbox:
            item = self._inbox.popleft()
            if type(item) is tuple and item[1] and inline_status(item[3]) is None:
                await _quietly(self._log._send_ack(item[1], NAK), "nak on close")
        self._put(None)
        if not nc.is_closed:
            await _quietly(nc.flush(timeout=2), "flush on close")


def _reply_counts(reply: bytes) -> tuple[int, int, int]:
    """(stream sequence, times delivered, consumer sequence) from a JetStream reply subject
    (``$JS.ACK.…``), v1 or v2 layout."""
    tokens = reply.split(b".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[4]), int(tokens[6])
    return int(tokens[7]), int(tokens[6]), int(tokens[8])


def _acked(info: api.ConsumerInfo) -> int:
    """The stream sequence a durable has acknowledged everything up to (a new one: its start - 1)."""
    return (info.ack_floor.stream_seq if info.ack_floor is not None else 0) or 0


async def _quietly(awaitable: Any, what: str) -> None:
    try:
        await awaitable
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        logger.debug("%s: %r", what, exc)


class _ConnectionEvents:
    """What the NATS client reports about its connection, logged, and acted on by the log."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.log: JetStreamEventLog | None = None

    async def error(self, exc: Exception) -> None:
        logger.warning("NATS %s: %r", self.url, exc)

    async def disconnected(self) -> None:
        if self.log is not None and self.log._closed:
            return
        logger.warning("NATS %s: disconnected; reconnecting", self.url)

    async def reconnected(self) -> None:
        logger.info("NATS %s: reconnected", self.url)
        if self.log is not None:
            self.log._pull_again()


async def _connect(
    url: str,
    *,
    name: str,
    wait_for_server: float,
    events: _ConnectionEvents,
    options: dict[str, Any] | None = None,
) -> LogClient:
    client = LogClient()
    try:
        await asyncio.wait_for(
            client.connect(
                url,
                name=name,
                error_cb=events.error,
                disconnected_cb=events.disconnected,
                reconnected_cb=events.reconnected,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,  # type: ignore[arg-type]  # nats-py takes seconds as float
                connect_timeout=2,
                **(options or {}),
            ),
            timeout=wait_for_server,
        )
    except TimeoutError as exc:
        raise ConnectionError(
            f"no NATS server answered at {url} within {wait_for_server}s"
        ) from exc
    return client
