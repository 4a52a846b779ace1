"""Replay by raw pulls: a consumer without acks, pulled in batches into a synchronous sink.

A replay (a rebuild, a catch-up) reads every entry of its subjects from a sequence up to
the log's end at its start, once each and in order. nats-py's ordered consumer costs,
per message, a header parse into a dict, a ``Msg``, a put into a queue and a task switch
to the callback task, and then a second queue between that callback and the reader.
Here the log's :class:`~gpupool.eventlog.log_client.LogClient` appends each message's
subject, reply subject and data to the inbox's three lists itself
(:meth:`LogClient.raw_inbox`: no call per message; the inbox is told once per read of the
socket); the reader takes the lists once a pull's worth has arrived, reads the reply
subjects' numbers in one split (:func:`_delivered`), then decodes the data
:data:`READ_CHUNK` deliveries at a time (:func:`~gpupool.eventlog.port.read_batch`:
``read_entries`` of each entry, the plain envelopes in one decode), handing each such
batch on to be folded before it reads the next (:func:`pulled_batches`), while the server
already sends the next pull's: two pull requests of :data:`REPLAY_BATCH` are kept in
flight. Each part of a delivery is let go as soon as it has been read (the reply subjects
after their split, the subjects once named, each chunk's data once decoded): freed while
still in the core's cache, its memory is what the next objects are made in, instead of a
pull's worth of it going cold and then being touched again to be freed
(docs/benchmarks.md, session #17).

**Which consumer.** :func:`pulled_batches` is given an *opener*: a coroutine that
creates a pull consumer without acks on the replay's filter starting at a sequence, and
returns its name and its ``num_pending`` (the entries on the filter from that sequence
at creation: the replay's length). An unauthenticated log creates one under a random
name (:func:`open_ephemeral`); an authenticated one claims one of its user's replay
slots (:func:`gpupool.eventlog.named_replay.open_replay_slot`). The consumer is deleted
when the replay ends (an abandoned one expires after :data:`REPLAY_INACTIVE_SECONDS`).

**Every entry once, in order.** Without acks, a consumer sends each entry of its filter
once, in stream order, numbering its deliveries 1, 2, 3, … (the consumer sequence in the
reply subject). So a run of deliveries whose consumer sequences follow each other from
1 holds every entry of the filter from the start sequence on, none twice. A delivery
whose number does not follow (deliveries lost with a connection, a server restart) or
any pull status but a heartbeat (a request that expired, a consumer deleted under it,
a leader change), or less than a pull's worth delivered within :data:`STALL_S` (pull
requests lost in a reconnect, or a replay slower than a pull per stall): the consumer is
given up and a new one opened at the sequence after the last entry handed out (the
ordered consumer's reset), with its own inbox, so nothing of the old one is taken for the
new one. What did arrive in order before that is handed out first, so a slow replay
still makes progress, a stall's worth at a time.

**The end.** The replay hands out as many entries as the first consumer had pending
at creation: every entry present when it began (a reset counts on from there, and ends
early if the new consumer has fewer: entries purged meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from gpupool.eventlog.log_client import LogClient, status_description
from gpupool.eventlog.port import Entry, EventLogClosed, read_batch

logger = logging.getLogger(__name__)

REPLAY_BATCH = 1024
"""Entries per pull request; two are kept in flight."""
READ_CHUNK = 64
"""Deliveries read (decoded) at a time, each such batch handed out to be folded before the
next is read: the objects a batch's read makes (~2.5 kB an entry) are still in the core's
cache when its fold reads them (a pull's worth read at once, ~2.5 MB, is not: a quarter of
a rebuild's time at 1,000,000 entries; docs/benchmarks.md)."""
PULLS_IN_FLIGHT = 2
PULL_EXPIRES_S = 5.0
REQUEST_TIMEOUT_S = 5.0
STALL_S = PULL_EXPIRES_S + REQUEST_TIMEOUT_S
"""Less than a pull's worth and no status for this long: the pull requests were lost (a
reconnect), or the replay is slow; what arrived is handed out, then a new consumer opened."""
REPLAY_INACTIVE_SECONDS = 30.0
"""A replay consumer nobody pulls from for this long is removed by the server."""
MAX_RESETS = 100
"""A replay that had to open a new consumer this often in a row without progress gives up."""

Opener = Callable[[int], Awaitable[tuple[str, int]]]
"""``open(start)``: create a consumer from ``start``; (its name, its pending entries)."""


def replay_consumer_config(name: str, subject_filter: str, start: int) -> api.ConsumerConfig:
    """A replay's consumer: pulled, no acks, in memory, expiring when abandoned."""
    return api.ConsumerConfig(
        name=name,
        description="gpupool replay",
        filter_subject=subject_filter,
        deliver_policy=api.DeliverPolicy.ALL if start <= 1 else api.DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=None if start <= 1 else start,
        ack_policy=api.AckPolicy.NONE,
        replay_policy=api.ReplayPolicy.INSTANT,
        inactive_threshold=REPLAY_INACTIVE_SECONDS,
        num_replicas=1,
        mem_storage=True,
    )


async def api_request(nc: Any, subject: str, body: dict[str, Any]) -> dict[str, Any]:
    """A JetStream API request; its error raised as nats-py's ``APIError``."""
    reply = await nc.request(subject, json.dumps(body).encode(), timeout=REQUEST_TIMEOUT_S)
    answer: dict[str, Any] = json.loads(reply.data) if reply.data else {}
    if "error" in answer:
        nats.js.errors.APIError.from_error(answer["error"])  # raises
    return answer


def pending_of(answer: dict[str, Any]) -> int:
    """``num_pending`` of a consumer-create answer."""
    return int(answer.get("num_pending") or 0)


def open_ephemeral(nc: Any, stream: str, subject_filter: str) -> Opener:
    """An opener of replay consumers under random names (a server without permissions)."""

    async def open_consumer(start: int) -> tuple[str, int]:
        name = f"gpupool-replay-{secrets.token_hex(8)}"
        config = replay_consumer_config(name, subject_filter, start)
        answer = await api_request(
            nc,
            f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{subject_filter}",
            {"stream_name": stream, "action": "create", "config": config.as_dict()},
        )
        return name, pending_of(answer)

    return open_consumer


class _Inbox:
    """What one consumer's pulls delivered, filled by the client's reader loop
    (a :class:`~gpupool.eventlog.log_client.RawInbox`)."""

    __slots__ = ("datas", "replies", "status", "subjects", "wake", "want")

    def __init__(self) -> None:
        self.subjects: list[bytes] = []
        self.replies: list[bytes] = []
        self.datas: list[bytes] = []
        self.status: bytes | None = None
        self.want = 1
        self.wake = asyncio.Event()

    def on_status(self, headers: bytes) -> None:
        if headers[9:12] != b"100":  # a heartbeat says nothing
            self.status = headers
            self.wake.set()

    def arrived(self) -> int:
        return len(self.datas)

    def take(self) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """What arrived (subjects, reply subjects, data), the inbox emptied."""
        taken = self.subjects, self.replies, self.datas
        self.subjects, self.replies, self.datas = [], [], []
        return taken

    def on_delivered(self) -> None:
        if len(self.datas) >= self.want:
            self.wake.set()


class PulledReplay:
    """One running replay; :meth:`close` (the log closing) ends it with EventLogClosed."""

    def __init__(self) -> None:
        self.closed = False
        self._inbox: _Inbox | None = None

    def close(self) -> None:
        self.closed = True
        if self._inbox is not None:
            self._inbox.wake.set()


class _Reset(Exception):
    """The consumer is given up: open a new one after the last entry handed out."""


async def pulled_batches(
    nc: LogClient,
    *,
    stream: str,
    open_consumer: Opener,
    start: int,
    replay: PulledReplay | None = None,
    stall_s: float = STALL_S,
) -> AsyncIterator[list[Entry]]:
    """The entries of the opener's filter from ``start`` to the end at the call, in batches
    of at most READ_CHUNK entries (log entries; a decision entry's envelopes all in one
    batch), each decoded when the one before has been taken: what has arrived, at least a
    pull's worth but at the end or after a stall of ``stall_s``, read a batch at a time."""
    replay = replay or PulledReplay()
    last = max(start, 1) - 1
    name, remaining = await open_consumer(last + 1)
    subjects: dict[bytes, str] = {}
    resets = 0
    consumer: _Consumer | None = None
    try:
        while remaining > 0:
            consumer = _Consumer(nc, stream, name, remaining, replay, subjects, stall_s)
            await consumer.start()
            try:
                while remaining > 0:
                    seqs, texts, datas = await consumer.next_batch()
                    if seqs:
                        remaining -= len(seqs)
                        resets = 0
                    for at in range(0, len(seqs), READ_CHUNK):  # read as folded (see READ_CHUNK)
                        if at and replay.closed:
                            raise EventLogClosed(f"event log {stream} closed during a replay")
                        chunk = slice(at, at + READ_CHUNK)
                        chunk_datas = datas[:READ_CHUNK]
                        del datas[:READ_CHUNK]  # each entry's data freed once read, still cached
                        batch = read_batch(seqs[chunk], texts[chunk], chunk_datas)
                        del chunk_datas
                        last = batch[-1].seq
                        yield batch
                    if replay.closed:
                        raise EventLogClosed(f"event log {stream} closed during a replay")
            except _Reset as reason:
                resets += 1
                if resets > MAX_RESETS:
                    raise nats.errors.Error(f"replay of {stream}: {reason}") from None
                logger.info("replay of %s: %s; reading on after %d", stream, reason, last)
                await consumer.close()
                await _delete(nc, stream, name)
                name, pending = await open_consumer(last + 1)
                remaining = min(remaining, pending)
    finally:
        if consumer is not None:
            await consumer.close()
        await _delete(nc, stream, name)


class _Consumer:
    """One consumer's deliveries, pulled and handed out in order, until ``target`` messages
    were handed out; ``next_batch`` raises _Reset to give the consumer up."""

    def __init__(
        self,
        nc: LogClient,
        stream: str,
        name: str,
        target: int,
        replay: PulledReplay,
        subjects: dict[bytes, str],
        stall_s: float,
    ) -> None:
        self._nc = nc
        self._stall_s = stall_s
        self._stream = stream
        self._replay = replay
        self._subjects = subjects
        self._target = target
        self._handed = 0
        self._taken = 0
        """Deliveries taken from the inbox (handed out, or past the target)."""
        self._requested = 0
        self._expected = 1
        """The consumer sequence of the next delivery."""
        self._inbox = _Inbox()
        self._inbox_subject = nc.new_inbox()
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}"
        self._subscription: Any = None
        self._given_up: str | None = None

    async def start(self) -> None:
        self._subscription = await self._nc.raw_inbox(self._inbox_subject, self._inbox)
        self._replay._inbox = self._inbox

    async def close(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is None:
            return
        self._replay._inbox = None
        if not self._nc.is_closed:
            with contextlib.suppress(nats.errors.Error, OSError):
                await subscription.unsubscribe()
        self._nc.drop_raw(subscription)

    async def _pull(self) -> None:
        """Keep up to PULLS_IN_FLIGHT requests' worth outstanding, never past the target."""
        inbox = self._inbox
        while (
            self._requested - (self._taken + inbox.arrived()) < PULLS_IN_FLIGHT * REPLAY_BATCH
            and self._requested < self._target
        ):
            count = min(REPLAY_BATCH, self._target - self._requested)
            body = json.dumps({"batch": count, "expires": int(PULL_EXPIRES_S * 1e9)}).encode()
            await self._nc.publish(self._next_subject, body, reply=self._inbox_subject)
            self._requested += count

    async def next_batch(self) -> tuple[list[int], list[str], list[bytes]]:
        """The next deliveries in order, undecoded: their stream sequences, subjects and
        data (at least one unless the replay was closed)."""
        if self._given_up is not None:
            raise _Reset(self._given_up)
        await self._pull()
        inbox = self._inbox
        left = self._target - self._handed
        inbox.want = min(REPLAY_BATCH, left)
        stalled: str | None = None
        if inbox.arrived() < inbox.want and inbox.status is None:
            inbox.wake.clear()
            try:
                async with asyncio.timeout(self._stall_s):
                    await inbox.wake.wait()
            except TimeoutError:
                # (the wait may time out in the very turn the pull's last message came)
                full = inbox.arrived() >= inbox.want or inbox.status is not None
                if not self._replay.closed and not full:
                    # what did arrive is handed out below, then the consumer is given up
                    stalled = f"{inbox.arrived()} of {inbox.want} delivered in {self._stall_s:g} s"
        if self._replay.closed:
            raise EventLogClosed(f"event log {self._stream} closed during a replay")
        subject_bytes, replies, datas = inbox.take()
        self._taken += len(datas)
        if len(datas) > left:
            del subject_bytes[left:], replies[left:], datas[left:]
        seqs: list[int] = []
        texts: list[str] = []
        gap: str | None = None
        if datas:
            seqs, gap = _delivered(replies, self._expected)
            replies.clear()  # (freed while the split has them in the cache, not a pull later)
            handed = len(seqs)
            self._expected += handed
            if handed < len(datas):
                del subject_bytes[handed:], datas[handed:]
            subjects = self._subjects
            for subject in set(subject_bytes).difference(subjects):
                subjects[subject] = subject.decode()
            texts = list(map(subjects.__getitem__, subject_bytes))
            subject_bytes.clear()
        handed = len(seqs)
        self._handed += handed
        status = inbox.status
        if gap is None and status is not None and self._handed < self._target:
            gap = f"pull status {status[9:12].decode()} {status_description(status)}".strip()
        if gap is None and stalled is not None and self._handed < self._target:
            gap = stalled
        if gap is not None:
            if not seqs:
                raise _Reset(gap)
            self._given_up = gap  # what came before it is handed out first
        return seqs, texts, datas


_REPLY_TOKENS = 9
"""``$JS.ACK.<stream>.<consumer>.<delivered>.<seq>.<consumer seq>.<timestamp>.<pending>``"""


def _delivered(replies: Sequence[bytes], expected: int) -> tuple[list[int], str | None]:
    """The stream sequences of the deliveries with these reply subjects as long as their
    consumer sequences follow each other from ``expected``; and, where one does not, why.

    A batch of reply subjects without a domain is read in one split of them all (each
    reply's tokens at the same places, proven by the count and by every reply's second
    token); any other, or one whose numbers do not follow, reply by reply."""
    count = len(replies)
    tokens = b".".join(replies).split(b".")
    if (
        len(tokens) == _REPLY_TOKENS * count
        and tokens[1::_REPLY_TOKENS].count(b"ACK") == count
        and tokens[0::_REPLY_TOKENS].count(b"$JS") == count
    ):
        with contextlib.suppress(ValueError):  # (not numbers: read reply by reply)
            if list(map(int, tokens[6::_REPLY_TOKENS])) == list(range(expected, expected + count)):
                return list(map(int, tokens[5::_REPLY_TOKENS])), None
    seqs: list[int] = []
    for reply in replies:
        tokens = reply.split(b".")
        if len(tokens) == _REPLY_TOKENS:
            seq, number = int(tokens[5]), int(tokens[6])
        else:  # $JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<n>.<seq>.<cseq>.…
            seq, number = int(tokens[7]), int(tokens[8])
        if number != expected:
            return seqs, f"delivery {number} where {expected} was next"
        expected += 1
        seqs.append(seq)
    return seqs, None


async def _delete(nc: Any, stream: str, name: str) -> None:
    if nc.is_closed:
        return
    with contextlib.suppress(nats.errors.Error, OSError, TimeoutError):
        await nc.request(f"$JS.API.CONSUMER.DELETE.{stream}.{name}", b"", timeout=2)
